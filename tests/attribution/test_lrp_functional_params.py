"""Policies explained with swapped parameters: ``TensorDict.to_module``, ``torch.func.functional_call``, ensembles of
``TensorDict.from_modules``, torchrl losses' functional parameters and target networks, parametrized layers.

The oracle is the same network with the swapped parameters loaded plainly (``load_state_dict`` into a copy), explained
by a fresh wrapper; LRP-0 against gradient × input of ``functional_call``, and conservation with the biases zeroed.
The rules that modify parameters (z⁺, γ, αβ) must read the parameters the call runs with, and the caller's parameters
are left bit for bit as they were. Under ``torch.vmap`` (or another ``torch.func`` transform) around the wrapper, the
call is refused by name before any rule is prepared on the transform's batched parameters.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import EnsembleModule, TensorDictModule, TensorDictParams
from torch import nn
from torch.func import functional_call, stack_module_state
from zennit.attribution import Gradient
from zennit.composites import LayerMapComposite
from zennit.rules import AlphaBeta, Gamma

from tdhook.attribution import LRP, EpsilonAlpha2Beta1, EpsilonGammaBox, EpsilonPlus, UniformEpsilon, _chain_plan
from tdhook.attribution.mappers.base import rule_mapper_from_dict
from tdhook.attribution.rules import AlphaBetaRule, EpsilonRule, GammaRule

F64 = torch.float64

# The CNN presets (z⁺, γ, z^B, αβ on convolutions, ε on Linear), ε everywhere, and rules that modify a Linear
# layer's parameters (as an MLP policy is explained with them).
MAPPERS: dict[str, Callable] = {
    "EpsilonPlus": EpsilonPlus,
    "EpsilonGammaBox": lambda: EpsilonGammaBox(-3.0, 3.0),
    "EpsilonAlpha2Beta1": EpsilonAlpha2Beta1,
    "Epsilon": lambda: UniformEpsilon(epsilon=1e-6),
    "Linear gamma": lambda: rule_mapper_from_dict({nn.Linear: GammaRule(0.5)}),
    "Linear alpha2beta1": lambda: rule_mapper_from_dict({nn.Linear: AlphaBetaRule(2.0, 1.0)}),
}
MODIFYING = ["Linear gamma", "Linear alpha2beta1"]


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16, 3)
    ).to(F64)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).to(F64)


def model_and_batch(kind: str) -> tuple[nn.Module, TensorDict]:
    net = cnn() if kind == "cnn" else mlp()
    x = torch.randn(5, 2, 6, 6, dtype=F64) if kind == "cnn" else torch.randn(5, 4, dtype=F64)
    return net, TensorDict(x=x, batch_size=[5])


def other_parameters(net: nn.Module) -> TensorDictBase:
    """Parameters of ``net``'s structure with other values (signs flipped, so that z⁺ and γ read other entries)."""
    return TensorDict.from_module(net).apply(lambda p: p.detach() * -1.3 + 0.1 * torch.randn_like(p))


def explained(net: nn.Module, mapper: str, td: TensorDict) -> torch.Tensor:
    return LRP(TensorDictModule(net, in_keys=["x"], out_keys=["y"]), MAPPERS[mapper]())(td.clone())["relevance", "x"]


def oracle(net: nn.Module, params: TensorDictBase | None, mapper: str, td: TensorDict) -> torch.Tensor:
    """``net`` with ``params`` loaded plainly into a copy, explained by a fresh wrapper."""
    twin = copy.deepcopy(net)
    if params is not None:
        twin.load_state_dict({k: v.detach().clone() for k, v in params.flatten_keys(".").items()})
    return explained(twin, mapper, td)


def state(net: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def assert_same_state(net: nn.Module, before: dict[str, torch.Tensor], ids: list[int]) -> None:
    now = state(net)
    assert now.keys() == before.keys() and all(torch.equal(now[k], before[k]) for k in now)
    assert [id(p) for p in net.parameters()] == ids


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-12)


def swapped(kind: str, mapper: str) -> tuple:
    """A seeded network, a batch, other parameters, their oracle relevance, the network's state and parameter ids,
    and a wrapper of the network."""
    torch.manual_seed(0)
    net, td = model_and_batch(kind)
    other = other_parameters(net)
    theirs = oracle(net, other, mapper, td)
    before, ids = state(net), [id(p) for p in net.parameters()]
    return (
        net,
        td,
        other,
        theirs,
        before,
        ids,
        LRP(TensorDictModule(net, in_keys=["x"], out_keys=["y"]), MAPPERS[mapper]()),
    )


KINDS_AND_MAPPERS = [("cnn", m) for m in MAPPERS] + [("mlp", m) for m in ("Epsilon", *MODIFYING)]


@pytest.mark.parametrize("kind, mapper", KINDS_AND_MAPPERS)
class TestSwappedParameters:
    def test_parameters_swapped_in_an_open_context_are_the_ones_explained(self, kind: str, mapper: str):
        net, td, other, theirs, before, ids, lrp = swapped(kind, mapper)
        mine = oracle(net, None, mapper, td)
        with other.to_module(net):  # swapped before the call enters its context
            close(lrp(td.clone())["relevance", "x"], theirs)
        with lrp:
            close(lrp(td.clone())["relevance", "x"], mine)
            with other.to_module(net):
                close(lrp(td.clone())["relevance", "x"], theirs)
            close(lrp(td.clone())["relevance", "x"], mine)
            # tensordict's functional form: the tensors set in the layers' __dict__, no parameter left in them
            with other.data.to_module(net, preserve_module_state=False):
                close(lrp(td.clone())["relevance", "x"], theirs)
            close(lrp(td.clone())["relevance", "x"], mine)
        with other.to_module(net), lrp:  # swapped before the context is entered
            close(lrp(td.clone())["relevance", "x"], theirs)
        assert_same_state(net, before, ids)

    def test_a_context_left_while_the_parameters_are_swapped_leaves_them_to_the_swap(self, kind: str, mapper: str):
        net, td, other, theirs, before, ids, lrp = swapped(kind, mapper)
        lrp.__enter__()
        lrp(td.clone())
        swap = other.to_module(net)
        swap.__enter__()
        close(lrp(td.clone())["relevance", "x"], theirs)
        lrp.__exit__(None, None, None)
        now = state(net)
        assert all(torch.equal(now[k], v) for k, v in other.flatten_keys(".").items())
        swap.__exit__(None, None, None)
        assert_same_state(net, before, ids)

    def test_a_failed_call_with_swapped_parameters_leaves_them_to_the_swap(self, kind: str, mapper: str):
        net, td, other, theirs, before, ids, lrp = swapped(kind, mapper)
        bad = TensorDict(x=td["x"][..., :3], batch_size=[5])  # the model's shapes do not fit it
        with other.to_module(net), lrp:
            with pytest.raises(RuntimeError):
                lrp(bad)
            close(lrp(td.clone())["relevance", "x"], theirs)
        assert_same_state(net, before, ids)

    def test_functional_call_of_the_wrapper_explains_the_given_parameters(self, kind: str, mapper: str):
        net, td, other, theirs, before, ids, lrp = swapped(kind, mapper)
        mine = oracle(net, None, mapper, td)
        given = {f"module.module.{k}": v for k, v in other.flatten_keys(".").items()}
        assert set(given) == {name for name, _ in lrp.named_parameters()}
        close(functional_call(lrp, given, (td.clone(),))["relevance", "x"], theirs)
        with lrp:
            close(lrp(td.clone())["relevance", "x"], mine)
            close(functional_call(lrp, given, (td.clone(),))["relevance", "x"], theirs)
            close(lrp(td.clone())["relevance", "x"], mine)
        assert_same_state(net, before, ids)

    def test_parameters_written_or_replaced_in_an_open_context_are_the_ones_explained(self, kind: str, mapper: str):
        torch.manual_seed(0)
        net, td = model_and_batch(kind)
        other = other_parameters(net).flatten_keys(".")
        lrp = LRP(TensorDictModule(net, in_keys=["x"], out_keys=["y"]), MAPPERS[mapper]())
        with lrp:
            lrp(td.clone())
            for name, p in net.named_parameters():  # as torchrl's target updates write (no version counter)
                p.data.copy_(other[name])
            close(lrp(td.clone())["relevance", "x"], oracle(net, None, mapper, td))
            net[0].weight = nn.Parameter(net[0].weight.detach() * -2.0)
            close(lrp(td.clone())["relevance", "x"], oracle(net, None, mapper, td))


@pytest.mark.parametrize("kind, mapper", [("cnn", "EpsilonGammaBox"), *(("mlp", m) for m in ("Epsilon", *MODIFYING))])
def test_ensemble_members_are_explained_in_turn_each_with_its_own_parameters(kind: str, mapper: str):
    """Members of ``TensorDict.from_modules(..., as_module=True)`` put in a template one after another (views of the
    stacked parameters), also after the stack was written in place."""
    torch.manual_seed(0)
    nets, td = [model_and_batch(kind)[0] for _ in range(3)], model_and_batch(kind)[1]
    members = TensorDict.from_modules(*nets, as_module=True)
    template = copy.deepcopy(nets[0])
    lrp = LRP(TensorDictModule(template, in_keys=["x"], out_keys=["y"]), MAPPERS[mapper]())
    with lrp:
        for _ in range(2):
            for i in range(3):
                with members[i].to_module(template):
                    got = lrp(td.clone())["relevance", "x"]
                close(got, oracle(nets[0], members[i], mapper, td))
            with torch.no_grad():
                members.data.mul_(-1.1)
    assert not torch.equal(oracle(nets[0], members[0], mapper, td), oracle(nets[0], members[1], mapper, td))


def test_lrp0_with_swapped_parameters_is_gradient_times_input():
    torch.manual_seed(0)
    net, td = model_and_batch("mlp")
    other = other_parameters(net)
    lrp = LRP(
        TensorDictModule(net, in_keys=["x"], out_keys=["y"]), rule_mapper_from_dict({nn.Linear: EpsilonRule(0.0)})
    )
    x = td["x"].clone().requires_grad_()
    y = functional_call(net, dict(other.flatten_keys(".").items()), (x,))
    (grad,) = torch.autograd.grad(y.gather(1, y.argmax(1, keepdim=True)).sum(), x)
    with lrp, other.to_module(net):
        close(lrp(td.clone())["relevance", "x"], x.detach() * grad)


@pytest.mark.parametrize(
    "mapper, rule", [("Linear gamma", (Gamma, 0.5)), ("Linear alpha2beta1", (AlphaBeta, 2.0, 1.0))]
)
def test_swapped_parameters_are_explained_as_zennit_explains_them_loaded(mapper: str, rule: tuple):
    """zennit's rule on the network with the swapped parameters loaded (biases zeroed); the γ-rule then conserves
    the explained output, computed with the swapped parameters (the original ones give another)."""
    torch.manual_seed(0)
    net, td = model_and_batch("mlp")
    other = other_parameters(net).apply(lambda p: p if p.ndim > 1 else torch.zeros_like(p))
    lrp = LRP(TensorDictModule(net, in_keys=["x"], out_keys=["y"]), MAPPERS[mapper]())
    with lrp:
        lrp(td.clone())
        with other.to_module(net):
            out = lrp(td.clone())
    twin = copy.deepcopy(net)
    twin.load_state_dict(dict(other.flatten_keys(".").items()))
    y = twin(td["x"]).detach()
    with Gradient(twin, LayerMapComposite([(nn.Linear, rule[0](*rule[1:]))])) as attributor:
        _, expected = attributor(td["x"].clone(), nn.functional.one_hot(y.argmax(1), 3).to(F64) * y)
    torch.testing.assert_close(out["relevance", "x"], expected, rtol=1e-8, atol=1e-12)
    if rule[0] is Gamma:  # up to the stabilizer (1e-6) added to each denominator
        torch.testing.assert_close(out["relevance", "x"].sum(-1), y.amax(-1), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(net(td["x"]).amax(-1), y.amax(-1))


@pytest.mark.parametrize("parametrization", ["weight_norm", "spectral_norm"])
@pytest.mark.parametrize("mapper", ["Epsilon", *MODIFYING])
def test_parametrized_layers_are_explained_with_their_computed_weights_when_swapped(parametrization: str, mapper: str):
    """A parametrization computes the layer's weight from its own parameters (``parametrizations.weight.original*``):
    written in place, or swapped with ``to_module``, the weight explained is the one computed from the new values."""
    torch.manual_seed(0)
    net, td = model_and_batch("mlp")
    make = getattr(nn.utils.parametrizations, parametrization)
    make(net[0]), make(net[2])
    net.eval()  # spectral_norm's power iteration runs in training mode only

    def plain_copy() -> torch.Tensor:
        twin = mlp()
        with torch.no_grad():
            for i in (0, 2, 4):
                twin[i].weight.copy_(net[i].weight), twin[i].bias.copy_(net[i].bias)
        return explained(twin, mapper, td)

    lrp = LRP(TensorDictModule(net, in_keys=["x"], out_keys=["y"]), MAPPERS[mapper]())
    with lrp:
        close(lrp(td.clone())["relevance", "x"], plain_copy())
        with torch.no_grad():
            for p in net[0].parameters():
                p.mul_(-1.2)
        close(lrp(td.clone())["relevance", "x"], plain_copy())
        with TensorDict.from_module(net).apply(lambda p: p.detach() * 1.1 + 0.05).to_module(net):
            close(lrp(td.clone())["relevance", "x"], plain_copy())


class TestTorchRLLosses:
    @pytest.mark.parametrize("mapper", ["Linear gamma", "Epsilon ε-plan"])
    def test_dqn_online_and_target_networks_are_explained_between_training_steps(self, mapper: str, monkeypatch):
        """DQNLoss on CartPole's action spec: the online and target Q-networks explained with the loss's functional
        parameters, after SGD steps and SoftUpdate (which writes the target through ``.data``); the ε mapper takes
        the chain plan of an open context."""
        from torchrl.envs import GymEnv
        from torchrl.modules import MLP, QValueActor
        from torchrl.objectives import DQNLoss, SoftUpdate

        def rules():
            return rule_mapper_from_dict({nn.Linear: EpsilonRule(1e-6)}) if "plan" in mapper else MAPPERS[mapper]()

        def expected(params: TensorDictBase) -> torch.Tensor:
            twin = copy.deepcopy(loss.value_network)
            params.data.to_module(twin)
            return LRP(twin, rules())(td.clone())["relevance", "observation"]

        planned = []
        run_plan = _chain_plan.ChainPlan.forward
        monkeypatch.setattr(_chain_plan.ChainPlan, "forward", lambda plan, x: planned.append(1) or run_plan(plan, x))
        torch.manual_seed(0)
        spec = GymEnv("CartPole-v1").action_spec
        actor = QValueActor(
            MLP(in_features=4, out_features=2, num_cells=[16, 16], activation_class=nn.ReLU).to(F64), spec=spec
        )
        loss = DQNLoss(actor, action_space=spec, delay_value=True)
        updater = SoftUpdate(loss, eps=0.7)
        optim = torch.optim.SGD(loss.parameters(), lr=0.5)
        td = TensorDict(observation=torch.randn(6, 4, dtype=F64), batch_size=[6])
        lrp = LRP(loss.value_network, rules())
        seen = []
        with lrp:
            for _ in range(3):
                for params in (loss.value_network_params, loss.target_value_network_params):
                    with params.to_module(loss.value_network):
                        got = lrp(td.clone())["relevance", "observation"]
                    close(got, expected(params))
                    seen.append(got)
                batch = TensorDict(
                    observation=torch.randn(8, 4, dtype=F64),
                    action=nn.functional.one_hot(torch.randint(2, (8,)), 2),
                    next=TensorDict(
                        observation=torch.randn(8, 4, dtype=F64),
                        reward=torch.randn(8, 1, dtype=F64),
                        done=torch.zeros(8, 1, dtype=torch.bool),
                        terminated=torch.zeros(8, 1, dtype=torch.bool),
                    ),
                    batch_size=[8],
                )
                optim.zero_grad()
                loss(batch)["loss"].backward()
                optim.step()
                updater.step()
        assert not torch.allclose(seen[1], seen[3])  # the target moved between the explained calls
        if "plan" in mapper:  # the open context's calls after its first ran by the plan, the target's included
            assert len(planned) >= 5

    @pytest.mark.parametrize("mapper", MODIFYING)
    def test_sac_q_networks_stacked_parameters_written_in_place_are_the_ones_explained(self, mapper: str):
        from tensordict.nn import NormalParamExtractor
        from torchrl.modules import MLP, ProbabilisticActor, TanhNormal, ValueOperator
        from torchrl.objectives import SACLoss

        torch.manual_seed(0)
        actor = ProbabilisticActor(
            TensorDictModule(
                nn.Sequential(MLP(in_features=3, out_features=2, num_cells=[8]), NormalParamExtractor()).to(F64),
                in_keys=["observation"],
                out_keys=["loc", "scale"],
            ),
            in_keys=["loc", "scale"],
            distribution_class=TanhNormal,
        )
        critic = MLP(in_features=4, out_features=1, num_cells=[8, 8], activation_class=nn.ReLU).to(F64)
        loss = SACLoss(actor, ValueOperator(critic, in_keys=["observation", "action"]), num_qvalue_nets=2)
        td = TensorDict(observation=torch.randn(6, 3, dtype=F64), action=torch.randn(6, 1, dtype=F64), batch_size=[6])
        lrp = LRP(loss.qvalue_network, MAPPERS[mapper]())
        with lrp:
            for _ in range(2):
                for params in loss.qvalue_network_params.unbind(0):
                    with params.to_module(loss.qvalue_network):
                        got = lrp(td.clone())
                    twin = copy.deepcopy(loss.qvalue_network)
                    params.data.to_module(twin)
                    expected = LRP(twin, MAPPERS[mapper]())(td.clone())
                    for key in ("observation", "action"):
                        close(got["relevance", key], expected["relevance", key])
                with torch.no_grad():
                    loss.qvalue_network_params.data.mul_(-1.1)  # the stacked storage, under the views


# Ways of running a wrapper under torch.vmap over an ensemble's parameters. Each returns the error raised in the
# vmapped call, caught there: tensordict's ``to_module`` leaves the swapped tensors in place when its block raises.
def _vmap_to_module(lrp: LRP, template: nn.Module, nets: list[nn.Module], td: TensorDict) -> BaseException | None:
    errors: list[BaseException] = []

    def member(params: TensorDictBase, td: TensorDictBase) -> TensorDictBase:
        with params.to_module(template):
            try:
                return lrp(td)
            except Exception as err:  # noqa: BLE001 (checked by the test)
                errors.append(err)
                return td

    torch.vmap(member, (0, None))(TensorDict.from_modules(*nets, as_module=True), td)
    return errors[0] if errors else None


def _vmap_functional_call(lrp: LRP, template: nn.Module, nets: list[nn.Module], td: TensorDict) -> BaseException:
    params, buffers = stack_module_state(nets)
    given = {f"module.module.{k}": v for k, v in params.items()}
    try:
        torch.vmap(lambda p, td: functional_call(lrp, (p, buffers), (td,)), (0, None))(given, td)
    except Exception as err:  # noqa: BLE001 (checked by the test)
        return err
    raise AssertionError("not refused")


def _ensemble_module(lrp: LRP, template: nn.Module, nets: list[nn.Module], td: TensorDict) -> BaseException:
    ensemble = EnsembleModule(copy.deepcopy(lrp), 3)
    try:
        ensemble(td)
    except Exception as err:  # noqa: BLE001 (checked by the test)
        return err
    raise AssertionError("not refused")


def _context_under_vmap(lrp: LRP, template: nn.Module, nets: list[nn.Module], td: TensorDict) -> BaseException:
    errors: list[BaseException] = []

    def entered(x: torch.Tensor) -> torch.Tensor:
        try:
            with lrp:
                pass
        except Exception as err:  # noqa: BLE001 (checked by the test)
            errors.append(err)
        return x

    torch.vmap(entered)(td["x"])
    return errors[0] if errors else None


def _grad_of_the_call(lrp: LRP, template: nn.Module, nets: list[nn.Module], td: TensorDict) -> BaseException:
    try:
        torch.func.grad(lambda x: lrp(TensorDict(x=x, batch_size=x.shape[:1]))["y"].sum())(td["x"])
    except Exception as err:  # noqa: BLE001 (checked by the test)
        return err
    raise AssertionError("not refused")


TRANSFORMED = {
    "from_modules + to_module": _vmap_to_module,
    "stack_module_state + functional_call": _vmap_functional_call,
    "EnsembleModule": _ensemble_module,
    "context entered": _context_under_vmap,
    "torch.func.grad": _grad_of_the_call,
}


@pytest.mark.parametrize("way", list(TRANSFORMED))
@pytest.mark.parametrize("mapper", ["Epsilon", *MODIFYING])
def test_a_wrapper_under_vmap_over_an_ensemble_is_refused_by_name_and_left_usable(way: str, mapper: str):
    """Before, a rule that prepares a Linear layer's modified parameters at registration (γ, αβ) failed on the
    transform's batched parameters with torch's message ("vmap: called random operation while in randomness error
    mode", "your tensor may have escaped"; under torch.func.grad, "Cannot access data pointer of Tensor that doesn't
    have storage"), naming neither the transform nor what to do; the ε-rule's context entered under vmap was not
    refused at all."""
    torch.manual_seed(0)
    nets, td = [mlp() for _ in range(3)], model_and_batch("mlp")[1]
    template = copy.deepcopy(nets[0])
    before, ids = state(template), [id(p) for p in template.parameters()]
    hooks = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in template.modules()]
    lrp = LRP(TensorDictModule(template, in_keys=["x"], out_keys=["y"]), MAPPERS[mapper]())
    err = TRANSFORMED[way](lrp, template, nets, td)
    assert isinstance(err, NotImplementedError), repr(err)
    assert str(err).startswith(f"LRP: the {'context' if way == 'context entered' else 'call'} runs under a torch.func")
    now = state(template)  # values: tensordict's to_module under vmap puts back new Parameter objects
    assert all(torch.equal(now[k], before[k]) for k in before)
    if way != "from_modules + to_module":
        assert [id(p) for p in template.parameters()] == ids
    assert [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in template.modules()] == hooks
    members = TensorDict.from_modules(*nets, as_module=True)
    for i in range(3):  # the members in a loop instead, as the message asks
        with members[i].to_module(template):
            close(lrp(td.clone())["relevance", "x"], oracle(nets[i], None, mapper, td))


@pytest.mark.parametrize("mapper", ["Epsilon", *MODIFYING])
def test_an_ensemble_module_is_refused_before_it_runs_and_its_members_are_explained_in_a_loop(mapper: str):
    """tensordict's EnsembleModule runs its members under torch.vmap, with their parameters put in the module it
    copies by ``to_module(..., preserve_module_state=False)``. Before, a rule refused the vmapped call from inside it,
    and tensordict left the members' batched tensors in that module: its own parameters were gone (a later call of it
    failed with functorch's "your tensor may have escaped"). Now the wrapper refuses the ensemble by name before it
    registers anything, and the loop its message gives explains each member as the network with its parameters
    loaded."""
    torch.manual_seed(0)
    net, td = model_and_batch("mlp")
    ensemble = EnsembleModule(TensorDictModule(net, in_keys=["x"], out_keys=["y"]), 3)
    before, ids = state(net), [id(p) for p in net.parameters()]
    with pytest.raises(ValueError, match=r"^LRP: module 'the model itself' \(EnsembleModule\) runs its members under"):
        LRP(ensemble, MAPPERS[mapper](), target_key="y")(td.clone())
    assert_same_state(net, before, ids)
    assert not any(isinstance(v, torch.Tensor) for v in net[0].__dict__.values())
    lrp = LRP(ensemble.module, MAPPERS[mapper]())
    with lrp:
        for params in ensemble.params_td.unbind(0):
            with params.to_module(ensemble.module):
                got = lrp(td.clone())["relevance", "x"]
            close(got, oracle(net, params["module"], mapper, td))
    assert_same_state(net, before, ids)


# A failed call leaves every module as it found it: the parameter and buffer objects in their slots (in their order),
# the module's __dict__ (no tensor left under a parameter's name) and the values.
def slots(model: nn.Module) -> dict[str, tuple]:
    return {
        name: (
            [(key, id(value)) for key, value in module._parameters.items()],
            [(key, id(value)) for key, value in module._buffers.items()],
            {key: id(value) for key, value in vars(module).items() if isinstance(value, torch.Tensor)},
            sorted(vars(module)),
        )
        for name, module in model.named_modules()
    }


def assert_left_as_found(model: nn.Module, before: dict[str, torch.Tensor], found: dict[str, tuple]) -> None:
    assert slots(model) == found
    now = state(model)
    assert now.keys() == before.keys() and all(torch.equal(now[k], before[k]) for k in now)


class SelfEnsemble(nn.Module):
    """A custom ensemble: one network run under torch.vmap with each member's parameters put in by to_module."""

    def __init__(self, nets: list[nn.Module], keep_slots: bool) -> None:
        super().__init__()
        self.net = copy.deepcopy(nets[0])
        self.params = TensorDictParams(TensorDict.from_modules(*nets, as_module=True))
        self.keep_slots = keep_slots  # to_module's preserve_module_state: batched tensors in the slots, or __dict__

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def member(params: TensorDictBase, x: torch.Tensor) -> torch.Tensor:
            with params.to_module(self.net, preserve_module_state=self.keep_slots):
                return self.net(x)

        return torch.vmap(member, (0, None))(self.params, x).mean(0)


@pytest.mark.parametrize("keep_slots", [True, False])
@pytest.mark.parametrize("mapper", ["Epsilon", "EpsilonPlus", *MODIFYING])
def test_a_model_swapping_its_parameters_under_vmap_comes_out_of_the_refusal_as_it_was(mapper: str, keep_slots: bool):
    """Before, the rule's refusal inside the vmapped forward passed through tensordict's to_module, which does not
    put the parameters back when its block raises: the network was left with the members' batched tensors in its
    parameter slots (or, with preserve_module_state=False, in its __dict__ and no Parameter at all), every later call
    failing with "your tensor may have escaped from inside a function being vmapped". The refusal names the module's
    path."""
    torch.manual_seed(0)
    model = SelfEnsemble([mlp() for _ in range(3)], keep_slots)
    td = model_and_batch("mlp")[1]
    before, found = state(model), slots(model)
    lrp = LRP(TensorDictModule(model, in_keys=["x"], out_keys=["y"]), MAPPERS[mapper]())
    with pytest.raises(RuntimeError) as refused:
        lrp(td.clone())
    assert_left_as_found(model, before, found)
    assert str(refused.value).startswith("LRP: module 'module.net.0' (Linear) runs under torch.vmap")
    model.net(td["x"])  # usable
    with lrp, pytest.raises(RuntimeError, match="runs under torch.vmap"):  # the same inside an open context
        lrp(td.clone())
    assert_left_as_found(model, before, found)


def test_a_callers_own_to_module_around_a_failing_call_in_an_open_context_stays():
    """What the call puts back is what it found: parameters the caller swapped in around it stay (a context's own
    record, taken when it was entered, would undo them) until the caller's block ends."""
    torch.manual_seed(0)
    model = nn.Sequential(mlp(), SelfEnsemble([nn.Sequential(nn.Linear(3, 2)).to(F64) for _ in range(2)], True))
    td = model_and_batch("mlp")[1]
    before, found = state(model), slots(model)
    lrp = LRP(TensorDictModule(model, in_keys=["x"], out_keys=["y"]), MAPPERS["Epsilon"]())
    other = other_parameters(model[0])
    with lrp:
        with other.to_module(model[0]):
            theirs = slots(model)
            assert theirs != found
            with pytest.raises(RuntimeError) as refused:
                lrp(td.clone())
            assert slots(model) == theirs
            assert str(refused.value).startswith("LRP: module 'module.1.net.0' (Linear) runs under torch.vmap")
            assert all(torch.equal(model[0].get_parameter(k), v) for k, v in other.flatten_keys(".").items())
    assert_left_as_found(model, before, found)


@pytest.mark.parametrize("copied", [False, True])
def test_sac_q_network_wrapper_comes_out_of_the_refusal_under_the_loss_vmap_as_it_was(copied: bool):
    """SACLoss on Pendulum's specs, given the wrapper with create_graph=True: torchrl calls the Q-network under
    torch.vmap with each stacked set of parameters put in by to_module(preserve_module_state=False); the call is
    refused there by name. Before, the Q-network's layers were left with no Parameter (the batched tensors in their
    __dict__), and the loss itself failed after with torch's "tensor may have escaped" error. A copy of the wrapper
    puts back its own model's parameters, and leaves the original's alone."""
    from tensordict.nn import NormalParamExtractor
    from torchrl.envs import GymEnv
    from torchrl.modules import MLP, ProbabilisticActor, TanhNormal, ValueOperator
    from torchrl.objectives import SACLoss

    torch.manual_seed(0)
    env = GymEnv("Pendulum-v1")
    observations, actions = env.observation_spec["observation"].shape[-1], env.action_spec.shape[-1]
    actor = ProbabilisticActor(
        TensorDictModule(
            nn.Sequential(
                MLP(in_features=observations, out_features=2 * actions, num_cells=[8]), NormalParamExtractor()
            ).to(F64),
            in_keys=["observation"],
            out_keys=["loc", "scale"],
        ),
        in_keys=["loc", "scale"],
        distribution_class=TanhNormal,
        spec=env.action_spec,
    )
    critic = MLP(in_features=observations + actions, out_features=1, num_cells=[8], activation_class=nn.ReLU)
    q = ValueOperator(critic.to(F64), in_keys=["observation", "action"])
    lrp = LRP(q, MAPPERS["EpsilonPlus"](), create_graph=True)
    original, kept = q, (state(q), slots(q))
    if copied:
        lrp = copy.deepcopy(lrp)
        q = lrp.module
    before, found = state(q), slots(q)
    loss = SACLoss(actor, lrp, num_qvalue_nets=2)
    batch = TensorDict(
        observation=torch.randn(8, observations, dtype=F64),
        action=torch.rand(8, actions, dtype=F64) * 2 - 1,
        next=TensorDict(
            observation=torch.randn(8, observations, dtype=F64),
            reward=torch.randn(8, 1, dtype=F64),
            done=torch.zeros(8, 1, dtype=torch.bool),
            terminated=torch.zeros(8, 1, dtype=torch.bool),
        ),
        batch_size=[8],
    )
    for _ in range(2):  # the second as the first: nothing left behind
        with pytest.raises(NotImplementedError, match="LRP: the call runs under a torch.func transform.*SACLoss"):
            loss(batch)
        assert_left_as_found(q, before, found)
    td = TensorDict(observation=batch["observation"], action=batch["action"], batch_size=[8])
    for params in loss.qvalue_network_params.unbind(0):  # each Q-network in turn, as the loop explains it
        with params.to_module(loss.qvalue_network):
            got = lrp(td.clone())["relevance", "observation"]
        twin = copy.deepcopy(q)
        params["module"].data.to_module(twin)
        close(got, LRP(twin, MAPPERS["EpsilonPlus"]())(td.clone())["relevance", "observation"])
    assert_left_as_found(q, before, found)
    assert_left_as_found(original, *kept)


def test_a_torchrl_vmap_module_is_named_with_mock_and_explained_once_mocked():
    """A rule refusing torch.vmap inside torchrl's VmapModule names the module's path and the VmapModule's mock_(),
    which runs its module slice by slice (the rules see each call): then the relevance is the plain network's."""
    from torchrl.modules import VmapModule

    torch.manual_seed(0)
    net, td = model_and_batch("mlp")
    vmapped = VmapModule(TensorDictModule(net, in_keys=["x"], out_keys=["y"]), 0)
    before, found = state(vmapped), slots(vmapped)
    lrp = LRP(vmapped, MAPPERS["Linear gamma"](), in_keys=["x"])
    with pytest.raises(RuntimeError, match=r"module 'module\.module\.0' \(Linear\).*VmapModule.*mock_\(\)"):
        lrp(td.clone())
    assert_left_as_found(vmapped, before, found)
    vmapped.mock_()
    close(lrp(td.clone())["relevance", "x"], oracle(net, None, "Linear gamma", td))
