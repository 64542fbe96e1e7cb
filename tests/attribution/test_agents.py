"""Multi-agent networks: rules apply to every agent, with its own parameters, shared or not."""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.modules import MultiAgentConvNet, MultiAgentMLP

from tdhook.attribution import LRP, AttnLRP, BaseRuleMapper, EpsilonGammaBox, EpsilonPlus, EpsilonRule
from tdhook.attribution.rules import AlphaBetaRule, GammaRule

F64 = torch.float64
AGENTS, BATCH = 3, 4


def agents_td(shape: tuple[int, ...]) -> TensorDict:
    observation = torch.randn(BATCH, AGENTS, *shape, dtype=F64)
    return TensorDict({"agents": TensorDict(observation=observation, batch_size=[BATCH, AGENTS])}, batch_size=[BATCH])


def wrapped(net: nn.Module) -> TensorDictModule:
    return TensorDictModule(net, in_keys=[("agents", "observation")], out_keys=[("agents", "action_value")])


def multi_agent_mlp(
    centralized: bool, share_params: bool, activation: type[nn.Module], norm: bool | dict = False
) -> MultiAgentMLP:
    """``norm``: a LayerNorm after each layer, away from its identity initialisation; or the norm's arguments
    (``norm_class``, ``norm_kwargs``)."""
    torch.manual_seed(0)
    normalised = {"norm_class": nn.LayerNorm, "norm_kwargs": {"normalized_shape": 8}} if norm is True else norm or {}
    net = MultiAgentMLP(
        3,
        2,
        n_agents=AGENTS,
        centralized=centralized,
        share_params=share_params,
        depth=2,
        num_cells=8,
        activation_class=activation,
        **normalised,
    )
    if norm is True:  # norms away from their identity initialisation
        with torch.no_grad():
            for value in net.params.values(include_nested=True, leaves_only=True):
                value.add_(torch.randn_like(value) * 0.5)
    return net.to(F64)


def agent_mlp(net: MultiAgentMLP, agent: int) -> nn.Sequential:
    """The network of one agent as a plain ``nn.Sequential`` holding that agent's weights."""
    params = net.params if net.share_params else net.params[agent]
    layers = []
    for name, module in net._empty_net.named_children():
        if isinstance(module, (nn.Linear, nn.LayerNorm)):
            if isinstance(module, nn.Linear):
                layer = nn.Linear(module.in_features, module.out_features, dtype=F64)
            else:
                layer = nn.LayerNorm(module.normalized_shape, eps=module.eps, dtype=F64)
            with torch.no_grad():
                layer.weight.copy_(params[name]["weight"])
                layer.bias.copy_(params[name]["bias"])
            layers.append(layer)
        else:
            layers.append(type(module)())
    return nn.Sequential(*layers)


MAPPERS = {
    "LRP-0": BaseRuleMapper,
    "EpsilonPlus": EpsilonPlus,
    "EpsilonGammaBox": lambda: EpsilonGammaBox(low=-3.0, high=3.0),
    # Rules that build modified weights from each agent's parameters (the presets give Linear layers ε):
    "Gamma": lambda: BaseRuleMapper(rule_mapper={nn.Linear: GammaRule(0.5)}),
    "AlphaBeta": lambda: BaseRuleMapper(rule_mapper={nn.Linear: AlphaBetaRule(2.0, 1.0)}),
}


def against_unrolled_agents(net: MultiAgentMLP, mapper: Callable[[], Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The relevance of a non-centralised network's agents, and the oracle: LRP on each agent's unrolled network."""
    td = agents_td((3,))
    relevance = LRP(wrapped(net), mapper())(td.clone())["relevance", "agents", "observation"]
    expected = []
    for agent in range(AGENTS):
        x = td["agents", "observation"][:, agent]
        single = LRP(agent_mlp(net, agent), mapper(), in_keys=["x"], out_keys=["y"])
        expected.append(single(TensorDict(x=x, batch_size=[BATCH]))["relevance", "x"])
    return relevance, torch.stack(expected, 1)


def against_gradient_times_input(net: nn.Module, td: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
    """LRP-0's relevance of the chosen actions, and the oracle: gradient × input."""
    relevance = LRP(wrapped(net), BaseRuleMapper())(td.clone())["relevance", "agents", "observation"]
    x = td["agents", "observation"].clone().requires_grad_(True)
    y = net(x)
    seed = nn.functional.one_hot(y.argmax(-1), y.shape[-1]).to(F64)
    (grad,) = torch.autograd.grad(y, x, seed)
    return relevance, x.detach() * grad


def conv_agents(share_params: bool) -> tuple[MultiAgentConvNet, TensorDict]:
    torch.manual_seed(0)
    net = MultiAgentConvNet(
        n_agents=AGENTS,
        centralized=False,
        share_params=share_params,
        num_cells=[4, 4],
        kernel_sizes=3,
        activation_class=nn.ReLU,
    ).to(F64)
    td = agents_td((2, 8, 8))
    net(td["agents", "observation"])  # lazy layers take their shapes
    return net, td


@pytest.mark.parametrize("mapper", MAPPERS.values(), ids=MAPPERS.keys())
@pytest.mark.parametrize("activation", [nn.ReLU, nn.Tanh], ids=lambda a: a.__name__)
@pytest.mark.parametrize("share_params", [False, True], ids=["own-params", "shared"])
def test_each_agent_gets_the_relevance_of_its_own_unrolled_network(share_params, activation, mapper):
    relevance, expected = against_unrolled_agents(multi_agent_mlp(False, share_params, activation), mapper)
    torch.testing.assert_close(relevance, expected, rtol=1e-10, atol=1e-12)


class UnrolledCentralized(nn.Module):
    """A centralised network written out: every agent's unrolled network reads all agents' observations,
    flattened; shared parameters give one output, which every agent takes."""

    def __init__(self, net: MultiAgentMLP) -> None:
        super().__init__()
        self.shared = net.share_params
        self.nets = nn.ModuleList(agent_mlp(net, agent) for agent in range(1 if self.shared else AGENTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(*x.shape[:-2], -1)
        if self.shared:
            y = self.nets[0](flat)
            return y.unsqueeze(-2).expand(*y.shape[:-1], AGENTS, y.shape[-1])
        return torch.stack([agent(flat) for agent in self.nets], -2)


@pytest.mark.parametrize("mapper", MAPPERS.values(), ids=MAPPERS.keys())
@pytest.mark.parametrize("activation", [nn.ReLU, nn.Tanh], ids=lambda a: a.__name__)
@pytest.mark.parametrize("share_params", [False, True], ids=["own-params", "shared"])
def test_centralized_agents_get_the_relevance_of_their_unrolled_networks(share_params, activation, mapper):
    net, td = multi_agent_mlp(True, share_params, activation), agents_td((3,))
    relevance = LRP(wrapped(net), mapper())(td.clone())["relevance", "agents", "observation"]
    unrolled = UnrolledCentralized(net)
    x = td["agents", "observation"]
    torch.testing.assert_close(unrolled(x), net(x), rtol=1e-12, atol=1e-14)
    single = LRP(unrolled, mapper(), in_keys=["x"], out_keys=["y"])
    expected = single(TensorDict(x=x.clone(), batch_size=[BATCH]))["relevance", "x"]
    torch.testing.assert_close(relevance, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mapper", ["LRP-0", "EpsilonPlus", "Gamma"])
@pytest.mark.parametrize("share_params", [False, True], ids=["own-params", "shared"])
def test_centralized_agents_conserve_relevance_with_biases_zeroed(share_params, mapper):
    net, td = multi_agent_mlp(True, share_params, nn.ReLU), agents_td((3,))
    with torch.no_grad():
        for key, value in net.params.items(include_nested=True, leaves_only=True):
            if key[-1] == "bias":
                value.zero_()
    out = LRP(wrapped(net), MAPPERS[mapper]())(td.clone())
    chosen = out["agents", "action_value"].max(-1).values.sum(-1)  # every agent's chosen action, summed
    total = out["relevance", "agents", "observation"].sum((-1, -2))
    # ε = 1e-6 on activations of 1e-2 to 1e-1 absorbs a few 1e-6 of the relevance; LRP-0 none.
    torch.testing.assert_close(total, chosen, rtol=1e-12, atol=1e-12 if mapper == "LRP-0" else 2e-5)
    assert chosen.abs().min() > 1e-3


@pytest.mark.parametrize("mapper", [EpsilonPlus, AttnLRP], ids=["EpsilonPlus", "AttnLRP"])
@pytest.mark.parametrize("share_params", [False, True], ids=["own-params", "shared"])
def test_agents_with_layer_norms_get_the_relevance_of_their_unrolled_networks(share_params, mapper):
    """torchrl runs unshared agents' layers under vmap, where a norm's input reports no gradient; the agents are
    unrolled for the rules, so each agent's norms get the norm rule as in its own network."""
    relevance, expected = against_unrolled_agents(multi_agent_mlp(False, share_params, nn.Tanh, norm=True), mapper)
    torch.testing.assert_close(relevance, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("share_params", [False, True], ids=["own-params", "shared"])
@pytest.mark.parametrize("centralized", [False, True], ids=["local", "centralized"])
def test_lrp0_is_gradient_times_input_for_every_layout(centralized, share_params):
    net = multi_agent_mlp(centralized, share_params, nn.ReLU)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    relevance, expected = against_gradient_times_input(net, agents_td((3,)))
    torch.testing.assert_close(relevance, expected, rtol=1e-10, atol=1e-12)
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
    assert "vmap_func_module" not in vars(net) and not net._forward_hooks and not net._forward_pre_hooks


@pytest.mark.parametrize("kind", ["mlp", "conv"])
@pytest.mark.parametrize("centralized", [False, True], ids=["local", "centralized"])
def test_the_outputs_are_those_of_the_vmapped_network_bit_for_bit(centralized, kind):
    """The agents run one by one for the rules, but the outputs are the values of the network's own vmapped call:
    a loop over the agents rounds differently, and a policy's outputs must not change under LRP."""
    if kind == "mlp":
        net, td = multi_agent_mlp(centralized, False, nn.ReLU), agents_td((3,))
    else:
        torch.manual_seed(0)
        net = MultiAgentConvNet(
            n_agents=AGENTS, centralized=centralized, share_params=False, num_cells=[4], kernel_sizes=3
        )
        net = net.to(F64)
        td = agents_td((2, 6, 6))
        net(td["agents", "observation"])
    plain = wrapped(net)(td.clone())["agents", "action_value"]
    out = LRP(wrapped(net), EpsilonPlus())(td.clone())
    assert torch.equal(out["agents", "action_value"], plain)
    relevance, expected = against_gradient_times_input(net, td)
    torch.testing.assert_close(relevance, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("share_params", [False, True], ids=["own-params", "shared"])
def test_convolutional_agents(share_params):
    net, td = conv_agents(share_params)
    relevance, expected = against_gradient_times_input(net, td)
    torch.testing.assert_close(relevance, expected, rtol=1e-10, atol=1e-12)
    eps = LRP(wrapped(net), EpsilonPlus())(td.clone())["relevance", "agents", "observation"]
    assert not torch.allclose(eps, relevance)  # the rules ran (z+ on the convolutions) under every layout


def test_convolutional_agents_with_their_own_parameters_get_the_relevance_of_their_unrolled_networks():
    """Each agent's parameters are put in the template's ``__dict__`` for its call (tensordict's ``to_module`` without
    preserving the module's state), where the rules' record of the parameters did not look: every agent's z⁺ weights
    were agent 0's under EpsilonPlus (137 % off, relative L2; agent 2 alone 218 %)."""
    net, td = conv_agents(share_params=False)
    relevance = LRP(wrapped(net), EpsilonPlus())(td.clone())["relevance", "agents", "observation"]
    expected = []
    for agent in range(AGENTS):
        single = copy.deepcopy(net._empty_net)
        net.params[agent].data.clone().to_module(single)
        x = td["agents", "observation"][:, agent]
        lrp = LRP(single, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
        expected.append(lrp(TensorDict(x=x, batch_size=x.shape[:1]))["relevance", "x"])
    torch.testing.assert_close(relevance, torch.stack(expected, 1), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["mlp", "conv"])
@pytest.mark.parametrize("share_params", [False, True], ids=["own-params", "shared"])
def test_agents_with_lazy_layers_take_their_shapes_from_the_first_explained_call(kind, share_params):
    """A network with lazy layers explained before any plain call: its own vmapped call sizes the layers first."""
    torch.manual_seed(0)
    if kind == "mlp":
        net = MultiAgentMLP(
            None, 2, n_agents=AGENTS, centralized=False, share_params=share_params, depth=1, activation_class=nn.ReLU
        )
        td = agents_td((3,))
    else:
        net = MultiAgentConvNet(
            n_agents=AGENTS, centralized=False, share_params=share_params, num_cells=[4], activation_class=nn.ReLU
        )
        td = agents_td((2, 6, 6))
    net = net.to(F64)
    out = LRP(wrapped(net), BaseRuleMapper())(td.clone())
    assert torch.equal(out["agents", "action_value"], wrapped(net)(td.clone())["agents", "action_value"])
    relevance, expected = against_gradient_times_input(net, td)
    torch.testing.assert_close(out["relevance", "agents", "observation"], expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(relevance, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("norm", ["BatchNorm1d", "BatchRenorm1d"])
def test_norms_in_training_mode_move_their_statistics_once_and_give_the_networks_outputs(norm):
    """The agents' loop and the network's own vmapped call both moved the running statistics (two steps per call);
    the vmapped call then ran from the moved ones, so a BatchRenorm1d past its warm-up gave other outputs (0.33 to
    0.37 off, relative)."""
    from torchrl.modules.models.batchrenorm import BatchRenorm1d

    kwargs = {"num_features": 8, "momentum": 0.5}
    if norm == "BatchRenorm1d":
        kwargs["warmup_steps"] = 0
    norm_class = nn.BatchNorm1d if norm == "BatchNorm1d" else BatchRenorm1d
    network = functools.partial(
        multi_agent_mlp, False, False, nn.ReLU, {"norm_class": norm_class, "norm_kwargs": kwargs}
    )

    explained, plain = network(), network()
    lrp = LRP(wrapped(explained), BaseRuleMapper())
    for call in range(3):
        td = agents_td((3,))
        td["agents", "observation"] = td["agents", "observation"] * (call + 1) + call
        out = lrp(td.clone())
        assert torch.equal(out["agents", "action_value"], wrapped(plain)(td.clone())["agents", "action_value"])
        for key, value in plain.params.items(include_nested=True, leaves_only=True):
            assert torch.equal(explained.params[key], value), (call, key)


def test_a_module_run_under_vmap_by_the_model_itself_is_refused_by_name():
    class Vmapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.vmap(self.inner, in_dims=1, out_dims=1)(x)

    model = Vmapped().to(F64)
    td = TensorDict(x=torch.randn(2, 5, 3, dtype=F64), batch_size=[2])
    with pytest.raises(RuntimeError, match="runs under torch.vmap") as caught:
        LRP(model, EpsilonPlus(), in_keys=["x"], out_keys=["y"])(td)
    assert str(caught.value).startswith("LRP: module 'inner.0' (Linear) runs under torch.vmap")
    assert set(td.keys()) == {"x"}


def agents_with_dropout(share_params: bool) -> MultiAgentMLP:
    """Agents whose layers drop units in training mode (``dropout=0.5``), with their biases zeroed: the relevance of
    each agent's chosen action then sums to that action's value."""
    net = multi_agent_mlp(False, share_params, nn.ReLU, {"dropout": 0.5})
    with torch.no_grad():
        for key, value in net.params.items(include_nested=True, leaves_only=True):
            if key[-1] == "bias":
                value.zero_()
    return net.train()


def test_agents_with_their_own_parameters_that_draw_are_refused_naming_the_dropout():
    """The agents run one by one for the rules, and their dropout drew other units than the network's own vmapped
    call, whose values were the outputs: the relevance explained another pass than the outputs (its sums missed the
    chosen action values by 1.03, relative L2, with zero biases), and the outputs were not the plain call's under
    the same seed. Shared parameters run no vmap and are explained, conserving; so are the agents in eval mode."""
    net, td = agents_with_dropout(share_params=False), agents_td((3,))
    before, state = td.clone(), {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.warns(UserWarning, match="training mode"):
        with pytest.raises(ValueError, match=r"'module._empty_net.1' \(Dropout, p=0.5\) draws in training mode"):
            LRP(wrapped(net), BaseRuleMapper())(td)
    assert (td == before).all() and set(td.keys(True, True)) == set(before.keys(True, True))
    assert all(torch.equal(v, state[k]) for k, v in net.state_dict().items())
    mapper = BaseRuleMapper(stabilizer=1e-12, rule_mapper={nn.Linear: EpsilonRule(0.0)})
    for network in (agents_with_dropout(share_params=True), net.eval()):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the dropout of the shared agents draws: a random explanation
            out = LRP(wrapped(network), mapper)(td.clone())
        chosen = out["agents", "action_value"].max(-1).values
        torch.testing.assert_close(out["relevance", "agents", "observation"].sum(-1), chosen, rtol=1e-9, atol=1e-12)


def test_the_networks_own_calls_in_an_open_context_run_its_vmapped_call():
    """A training step inside ``with lrp:`` calls the network itself: it ran the agents' loop for the gradient and
    the vmapped call for the values, so with dropout the gradient followed other units than the values (2.7 off,
    relative, on the parameters; the values 1.8 off the plain call's under the same seed); it is now the plain
    call's, bit for bit, values and gradient."""
    net = agents_with_dropout(share_params=False)
    x = agents_td((3,))["agents", "observation"]

    def training_step() -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        torch.manual_seed(1)
        value = net(x)
        return value.detach(), torch.autograd.grad(value.square().sum(), list(net.parameters()))

    plain_value, plain_grads = training_step()
    with LRP(wrapped(net), EpsilonPlus()):
        value, grads = training_step()
    assert torch.equal(value, plain_value)
    assert all(torch.equal(grad, plain) for grad, plain in zip(grads, plain_grads, strict=True))


@pytest.mark.parametrize("centralized", [False, True], ids=["local", "centralized"])
def test_outputs_kept_differentiable_carry_the_networks_gradient(centralized):
    """With ``create_graph=True`` the outputs keep their graph: a loss on them gives the parameters and the
    observation the gradient of the plain network. Agents with their own parameters gave both a zero gradient (the
    outputs carried the gradient of the vmapped values, computed without one), so a policy trained with such a
    wrapper inside did not learn."""
    net = multi_agent_mlp(centralized, share_params=False, activation=nn.Tanh)
    observation = agents_td((3,))["agents", "observation"]

    def gradients(module: nn.Module) -> list[torch.Tensor]:
        x = observation.clone().requires_grad_()
        td = TensorDict({"agents": TensorDict(observation=x, batch_size=[BATCH, AGENTS])}, batch_size=[BATCH])
        loss = module(td)["agents", "action_value"].square().sum()
        return list(torch.autograd.grad(loss, [x, *net.parameters()]))

    plain = gradients(wrapped(net))
    kept = gradients(LRP(wrapped(net), EpsilonPlus(), create_graph=True))
    for grad, expected in zip(kept, plain, strict=True):
        assert expected.any()
        torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("centralized", [False, True], ids=["local", "centralized"])
def test_a_loss_on_the_relevance_and_the_outputs_kept_differentiable_has_its_true_derivative(centralized):
    """``create_graph=True`` on agents with their own parameters, each agent's action explained alone: a loss on
    both the relevance and the outputs has the derivative that central finite differences give along a random
    direction of the parameters (0.94 to 1.06 off, relative, when the outputs carried no gradient)."""
    net = multi_agent_mlp(centralized, share_params=False, activation=nn.Tanh)
    td = agents_td((3,))

    def loss(create_graph: bool) -> torch.Tensor:
        out = LRP(wrapped(net), EpsilonPlus(epsilon=0.1), split_dim=1, create_graph=create_graph)(td.clone())
        return out["relevance", "agents", "observation"].square().sum() + out["agents", "action_value"].square().sum()

    params = list(net.parameters())
    torch.manual_seed(2)
    direction = [torch.randn_like(p) for p in params]
    derivative = sum((g * d).sum() for g, d in zip(torch.autograd.grad(loss(True), params), direction, strict=True))
    step = 1e-5
    values = []
    for sign in (1.0, -2.0, 1.0):  # up, down, and back
        with torch.no_grad():
            for p, d in zip(params, direction, strict=True):
                p.add_(sign * step * d)
        if len(values) < 2:
            values.append(loss(False).item())
    central = (values[0] - values[1]) / (2 * step)
    assert abs(derivative.item() - central) <= 1e-6 * abs(central)


def only_agent(agent: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """A callable target: the chosen (argmax) action value of ``agent`` alone, zero for the other agents."""

    def target(out: torch.Tensor) -> torch.Tensor:
        kept = torch.zeros_like(out)
        kept[:, agent] = out[:, agent] * nn.functional.one_hot(out[:, agent].argmax(-1), out.shape[-1])
        return kept

    return target


def split_over_agents(centralized: bool, share_params: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The relevance of every agent's action on every agent's observation (``split_dim=1``, over the agents), the
    oracle (one call per agent, with a target keeping that agent's action alone) and the unsplit relevance."""
    net = multi_agent_mlp(centralized, share_params, nn.Tanh)
    td = agents_td((3,))

    def relevance(**options: Any) -> torch.Tensor:
        return LRP(wrapped(net), EpsilonPlus(), **options)(td.clone())["relevance", "agents", "observation"]

    per_agent = torch.stack([relevance(target=only_agent(agent)) for agent in range(AGENTS)], 1)
    return relevance(split_dim=1), per_agent, relevance()


@pytest.mark.parametrize("share_params", [False, True], ids=["own-params", "shared"])
@pytest.mark.parametrize("centralized", [False, True], ids=["local", "centralized"])
def test_split_dim_over_the_agents_explains_each_agents_action_alone(centralized, share_params):
    split, per_agent, whole = split_over_agents(centralized, share_params)
    assert split.shape == (BATCH, AGENTS, AGENTS, 3)  # [batch, agent of the action, agent of the observation, feature]
    torch.testing.assert_close(split, per_agent, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(split.sum(1), whole, rtol=1e-10, atol=1e-12)  # the agents' targets add up
    others = ~torch.eye(AGENTS, dtype=torch.bool)
    if centralized:  # every agent's action depends on every agent's observation
        assert (split[:, others].abs().sum(-1) > 0).all()
    else:  # an agent's action depends on its own observation only
        assert split[:, others].abs().max() == 0


def measure() -> None:
    """Print each layout's largest error against its oracle, relative to the oracle's largest value."""

    def row(network: str, centralized: bool, share_params: bool, rules: str, oracle: str, pair: tuple) -> None:
        got, want = pair
        error = ((got - want).abs().max() / want.abs().max()).item()
        layout = f"{'yes' if centralized else 'no'} | {'shared' if share_params else 'per agent'}"
        print(f"| {network} | {layout} | {rules} | {oracle} | {error:.1e} |")

    print("| network | centralized | parameters | rules | oracle | error |")
    print("| --- | --- | --- | --- | --- | --- |")
    for share in (False, True):
        for activation in (nn.ReLU, nn.Tanh):
            for name, mapper in MAPPERS.items():
                pair = against_unrolled_agents(multi_agent_mlp(False, share, activation), mapper)
                row(f"MultiAgentMLP, {activation.__name__}", False, share, name, "each agent unrolled", pair)
    for centralized in (False, True):
        for share in (False, True):
            pair = against_gradient_times_input(multi_agent_mlp(centralized, share, nn.ReLU), agents_td((3,)))
            row("MultiAgentMLP, ReLU", centralized, share, "LRP-0", "gradient × input", pair)
    for share in (False, True):
        row(
            "MultiAgentConvNet, ReLU",
            False,
            share,
            "LRP-0",
            "gradient × input",
            against_gradient_times_input(*conv_agents(share)),
        )
    for centralized in (False, True):
        for share in (False, True):
            split, per_agent, _ = split_over_agents(centralized, share)
            row(
                "MultiAgentMLP, Tanh, split_dim=1",
                centralized,
                share,
                "EpsilonPlus",
                "one target per agent",
                (split, per_agent),
            )


if __name__ == "__main__":
    measure()


@pytest.mark.parametrize("mapper", [BaseRuleMapper, EpsilonPlus], ids=["LRP-0", "EpsilonPlus"])
@pytest.mark.parametrize("share_params", [False, True], ids=["own-params", "shared"])
def test_a_layer_of_the_agents_network_gets_each_agents_relevance_along_the_agents_dimension(share_params, mapper):
    """With per-agent parameters the template runs once per agent, and a layer named in ``layers`` had one output
    per agent: their relevance was summed into one [batch, cells] map (0.10 off any agent's own, no word), where
    shared parameters give [batch, agents, cells]."""
    net = multi_agent_mlp(False, share_params, nn.ReLU)
    td = agents_td((3,))
    out = LRP(wrapped(net), mapper(), layers=["module._empty_net.1"])(td.clone())
    expected = []
    for agent in range(AGENTS):
        single = LRP(agent_mlp(net, agent), mapper(), in_keys=["x"], out_keys=["y"], layers=["1"])
        x = td["agents", "observation"][:, agent]
        expected.append(single(TensorDict(x=x, batch_size=[BATCH]))["relevance", "1"])
    torch.testing.assert_close(
        out["relevance", "module._empty_net.1"], torch.stack(expected, 1), rtol=1e-10, atol=1e-12
    )


def test_a_convolution_of_agents_with_their_own_parameters_gets_each_agents_relevance():
    net, td = conv_agents(share_params=False)
    out = LRP(wrapped(net), EpsilonPlus(), layers=["module._empty_net.1"])(td.clone())
    expected = []
    for agent in range(AGENTS):
        single = copy.deepcopy(net._empty_net)
        net.params[agent].data.clone().to_module(single)
        x = td["agents", "observation"][:, agent]
        lrp = LRP(single, EpsilonPlus(), in_keys=["x"], out_keys=["y"], layers=["1"])
        expected.append(lrp(TensorDict(x=x, batch_size=x.shape[:1]))["relevance", "1"])
    torch.testing.assert_close(
        out["relevance", "module._empty_net.1"], torch.stack(expected, 1), rtol=1e-10, atol=1e-12
    )


@pytest.mark.parametrize("method", ["LRP", "GradCAM"])
def test_a_layer_of_a_convolution_of_agents_with_shared_parameters_is_refused_naming_the_fold(method: str):
    """With shared parameters, MultiAgentConvNet runs its convolutions on the agents folded into their batch
    ([batch x agents, C, H, W]): a layer's map cannot be written per sample. Refused, saying so (GradCAM's error
    named the batch shape only)."""
    from tdhook.attribution import GradCAM

    net, td = conv_agents(share_params=True)
    if method == "LRP":
        explainer = LRP(wrapped(net), EpsilonPlus(), layers=["module._empty_net.1"])
    else:
        explainer = GradCAM(wrapped(net), layer="module._empty_net.1")
    with pytest.raises(ValueError, match=r"MultiAgentConvNet with share_params=True.*folds its agents"):
        explainer(td.clone())


@pytest.mark.parametrize("update", ["vector_to_parameters", "to_module"])
def test_parameters_given_new_tensors_between_calls_give_the_networks_outputs(update):
    """``vector_to_parameters`` (``p.data = ...``) and ``to_module`` put new tensors in the agents' parameters: the
    outputs were those of the parameters the second call saw (1.2 off the network's, no word), whose detached copy a
    locked ``TensorDictParams`` keeps, while the relevance followed the new ones."""
    net = multi_agent_mlp(False, False, nn.Tanh)
    td = agents_td((3,))
    lrp = LRP(wrapped(net), EpsilonPlus())
    for _ in range(2):
        lrp(td.clone())
    if update == "vector_to_parameters":
        vector = torch.nn.utils.parameters_to_vector(net.parameters())
        torch.nn.utils.vector_to_parameters(vector * 2, net.parameters())
    else:
        TensorDict.from_module(net).data.apply(lambda t: t * 2).to_module(net)
    out = lrp(td.clone())
    expected = LRP(wrapped(copy.deepcopy(net)), EpsilonPlus())(td.clone())
    torch.testing.assert_close(out["agents", "action_value"], net(td["agents", "observation"]).detach())
    for key in expected.keys(True, True):
        torch.testing.assert_close(out[key], expected[key], rtol=1e-10, atol=1e-12)
