"""Chains of linear layers and ReLUs run without hooks and autograd: the same call as with them.

The oracle is the wrapper's own general path (rule hooks and autograd) on a copy of the model that carries a
forward hook doing nothing, which keeps the plan aside.
"""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.data import Bounded
from torchrl.modules import MLP, Actor, ProbabilisticActor, ValueOperator

from tdhook.attribution import LRP
from tdhook.attribution._chain_plan import ChainPlan, PlannedCall
from tdhook.attribution.lrp_helpers.rules import BaseRuleMapper, EpsilonAlpha2Beta1, EpsilonPlus, EpsilonPlusFlat
from tdhook.attribution.rules import EpsilonRule

MAPPERS = {
    "EpsilonPlus": EpsilonPlus,
    "EpsilonPlusFlat": EpsilonPlusFlat,  # its first layer's flat rule: no plan
    "EpsilonAlpha2Beta1": EpsilonAlpha2Beta1,
    "LRP-0": BaseRuleMapper,
    "epsilon 0.25": lambda: {nn.Linear: EpsilonRule(0.25)},
}


ACTIVATIONS = {
    "relu": nn.ReLU,
    "relu in place": lambda: nn.ReLU(inplace=True),
    "tanh": nn.Tanh,
    "elu": nn.ELU,
    "silu": nn.SiLU,
    "leaky in place": lambda: nn.LeakyReLU(0.1, inplace=True),  # no plan: the pass rule's input is overwritten
}


def hooked(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose chain has a forward hook that changes nothing: the plan stands aside."""
    module = copy.deepcopy(module)
    chain = module.module if isinstance(module, TensorDictModule) else module
    chain.register_forward_hook(lambda m, args, out: None)
    return module


def calls(wrapper: LRP, td: TensorDict, n: int = 2) -> tuple[list[TensorDict], list[bool]]:
    """``n`` calls in one context, and whether each ran by a plan."""
    results, planned = [], []
    with wrapper, mock.patch.object(PlannedCall, "run", autospec=True, side_effect=PlannedCall.run) as run:
        for _ in range(n):
            count = run.call_count
            results.append(wrapper(td.clone()))
            planned.append(run.call_count > count)
    return results, planned


def assert_same_call(ours: TensorDict, general: TensorDict) -> None:
    assert set(ours.keys(True, True)) == set(general.keys(True, True))
    for key in general.keys(True, True):
        assert not ours[key].requires_grad, key
        assert ours[key].dtype == general[key].dtype, key
        torch.testing.assert_close(ours[key], general[key], rtol=1e-12, atol=1e-12)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    widths=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    bias=st.booleans(),
    activation=st.sampled_from(sorted(ACTIVATIONS)),
    mapper=st.sampled_from(sorted(MAPPERS)),
    batch=st.sampled_from([(), (1,), (5,), (2, 3)]),
    target=st.sampled_from([None, 0, "tensor"]),
    plain=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_chains_give_the_general_paths_call(widths, bias, activation, mapper, batch, target, plain, seed):
    """Random depths, widths, biases, activations (in place or not), presets, batch shapes, targets, plain or
    TensorDict modules: every call after the first (which watches the rules) equals the general path's, and takes
    the plan where all rules are ε, the plain gradient or the pass rule."""
    torch.manual_seed(seed)
    sizes = [5, *widths]
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(sizes, sizes[1:], strict=False)):
        layers += [nn.Linear(n_in, n_out, bias=bias)] + ([ACTIVATIONS[activation]()] if i < len(widths) - 1 else [])
    chain = nn.Sequential(*layers).double()
    x = torch.randn(*batch, 5, dtype=torch.float64)
    if target == "tensor":
        target = torch.randint(0, widths[-1], batch) if batch else torch.tensor(widths[-1] - 1)
    keys = {"in_keys": ["x"], "out_keys": ["y"]}
    module = chain if plain else TensorDictModule(chain, **keys)
    options = {"target": target, **(keys if plain else {"in_keys": ["x"]})}
    td = TensorDict(x=x, batch_size=batch)
    (first, second), planned = calls(LRP(module, MAPPERS[mapper](), **options), td)
    (_, general), general_planned = calls(LRP(hooked(module), MAPPERS[mapper](), **options), td)
    assert not planned[0] and not any(general_planned)
    if mapper in ("EpsilonPlus", "LRP-0", "epsilon 0.25") and (activation != "leaky in place" or len(widths) == 1):
        assert planned[1]  # ε or the plain gradient on every Linear, the pass rule on every activation
    if mapper == "EpsilonPlusFlat":  # the flat rule on the first layer
        assert not planned[1]
    assert_same_call(second, general)
    assert_same_call(first, general)


@pytest.mark.parametrize("activation", [nn.ReLU, nn.Tanh], ids=["ReLU", "Tanh (torchrl's default)"])
def test_a_torchrl_mlp_policy_in_a_rollout_loop(activation):
    """The per-step case: torchrl's ``MLP`` at batch 1, many calls in one context; outputs and relevance as the
    general path writes them, the caller's TensorDict unchanged."""
    torch.manual_seed(0)
    net = MLP(in_features=8, out_features=3, num_cells=[16, 16], activation_class=activation).double()
    policy = TensorDictModule(net, in_keys=["observation"], out_keys=["action_value"])
    td = TensorDict(observation=torch.randn(1, 8, dtype=torch.float64), batch_size=[1])
    before = td.clone()
    results, planned = calls(LRP(policy, EpsilonPlus()), td, n=4)
    (_, general), _ = calls(LRP(hooked(policy), EpsilonPlus()), td)
    assert planned == [False, True, True, True]
    for result in results:
        assert_same_call(result, general)
    assert (td == before).all() and set(td.keys(True, True)) == {"observation"}


@pytest.mark.parametrize(
    "make",
    [
        lambda: MLP(in_features=4, out_features=(2, 3), num_cells=[8]),  # reshapes its output
        lambda: nn.Sequential(nn.Linear(4, 8), nn.Sigmoid(), nn.Linear(8, 6)),  # a gate rule
        lambda: nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8).eval(), nn.ReLU(), nn.Linear(8, 6)),
        lambda: nn.Sequential(nn.Sequential(nn.Linear(4, 8)), nn.ReLU(), nn.Linear(8, 6)),  # nested
    ],
)
def test_chains_it_cannot_follow_take_the_general_path(make):
    torch.manual_seed(1)
    policy = TensorDictModule(make().double().eval(), in_keys=["x"], out_keys=["y"])
    td = TensorDict(x=torch.randn(3, 4, dtype=torch.float64), batch_size=[3])
    (_, second), planned = calls(LRP(policy, EpsilonPlus()), td)
    assert planned == [False, False]
    (_, general), _ = calls(LRP(hooked(policy), EpsilonPlus()), td)
    assert_same_call(second, general)


@pytest.mark.parametrize(
    "options",
    [{"target": "all"}, {"target": lambda y: y}, {"split_dim": 1}, {"create_graph": True}, {"layers": ["module.0"]}],
    ids=["all", "callable", "split_dim", "create_graph", "layers"],
)
def test_calls_with_more_than_one_seed_or_graph_take_the_general_path(options):
    torch.manual_seed(2)
    policy = TensorDictModule(
        nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).double(), in_keys=["x"], out_keys=["y"]
    )
    td = TensorDict(x=torch.randn(2, 5, 4, dtype=torch.float64), batch_size=[2, 5])
    (_, second), planned = calls(LRP(policy, EpsilonPlus(), **options), td)
    assert planned == [False, False]
    (_, general), _ = calls(LRP(hooked(policy), EpsilonPlus(), **options), td)
    for key in general.keys(True, True):
        torch.testing.assert_close(second[key].detach(), general[key].detach(), rtol=1e-12, atol=1e-12)


def test_a_hook_added_inside_the_context_runs_and_the_plan_stands_aside():
    torch.manual_seed(3)
    chain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    lrp = LRP(TensorDictModule(chain, in_keys=["x"], out_keys=["y"]), EpsilonPlus())
    td = TensorDict(x=torch.randn(2, 4, dtype=torch.float64), batch_size=[2])
    seen = []
    with lrp:
        lrp(td.clone())
        assert lrp._plan is not None and lrp._plan.applies()
        handle = chain[1].register_forward_hook(lambda m, args, out: seen.append(out.shape))
        assert not lrp._plan.applies()
        out = lrp(td.clone())
        handle.remove()
        assert lrp._plan.applies()
    assert seen == [torch.Size([2, 8])]
    assert torch.equal(out["y"], chain(td["x"]))
    assert lrp._plan is None  # left with the context


def test_a_policy_a_distribution_reads_is_not_a_plain_chain():
    """A ``ProbabilisticActor`` explains its logits with the distribution's mask and action in mind: its
    ``TensorDictSequential`` is not the plain ``TensorDictModule`` the plan takes."""
    torch.manual_seed(4)
    net = TensorDictModule(nn.Linear(4, 3).double(), in_keys=["observation"], out_keys=["logits"])
    actor = ProbabilisticActor(net, in_keys=["logits"], distribution_class=torch.distributions.Categorical)
    td = TensorDict(observation=torch.randn(2, 4, dtype=torch.float64), batch_size=[2])
    _, planned = calls(LRP(actor, EpsilonPlus(), in_keys=["observation"]), td)
    assert planned == [False, False]


def test_the_plan_of_a_chain_follows_autograd():
    torch.manual_seed(5)
    chain = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    plan = ChainPlan.build(chain, {})
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    output, factors = plan.forward(x)
    seed = torch.randn(6, 2, dtype=torch.float64)
    torch.testing.assert_close(output, chain(x).detach(), rtol=0, atol=0)
    (expected,) = torch.autograd.grad(chain(x), x, seed)
    torch.testing.assert_close(plan.input_gradient(factors, seed), expected, rtol=1e-14, atol=1e-14)


def test_a_layer_replaced_inside_the_context_sets_the_plan_aside():
    """The new layer gets its rule (the context follows the change: see test_model_changes.py), and the output is the
    new chain's: as without a plan. (The new layer kept its plain gradient before.)"""
    torch.manual_seed(6)
    chain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    lrp = LRP(TensorDictModule(chain, in_keys=["x"], out_keys=["y"]), {nn.Linear: EpsilonRule(0.5)})
    td = TensorDict(x=torch.randn(2, 4, dtype=torch.float64), batch_size=[2])
    with lrp:
        lrp(td.clone())
        chain[2] = nn.Linear(8, 3).double()
        assert not lrp._plan.applies()
        out = lrp(td.clone())
    assert torch.equal(out["y"], chain(td["x"]))
    x = td["x"].clone().requires_grad_(True)
    hidden = chain[1](chain[0](x))
    scale = hidden.detach().abs() / (hidden.detach().abs() + 0.5)  # the ε-rule on the first layer
    logits = chain[2](hidden)
    top = logits.detach().max(-1).values
    (grad,) = torch.autograd.grad(logits.max(-1).values, hidden, top.abs() / (top.abs() + 0.5))  # and on the new one
    (expected,) = torch.autograd.grad(hidden, x, grad * scale)
    torch.testing.assert_close(out["relevance", "x"], x.detach() * expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["ValueOperator", "Actor", "safe Actor"])
def test_torchrl_value_operators_and_actors(kind):
    """torchrl's ``ValueOperator`` and ``Actor`` call their module as ``TensorDictModule`` does: planned; a safe
    ``Actor`` projects its action in a hook: the general path, which runs it."""
    torch.manual_seed(7)
    net = MLP(in_features=4, out_features=1 if kind == "ValueOperator" else 2, num_cells=[8]).double()
    if kind == "ValueOperator":
        module = ValueOperator(net, in_keys=["observation"])
    else:
        spec = Bounded(-0.01, 0.01, (2,), dtype=torch.float64) if kind == "safe Actor" else None
        module = Actor(net, in_keys=["observation"], spec=spec, safe=spec is not None)
    td = TensorDict(observation=torch.randn(3, 4, dtype=torch.float64), batch_size=[3])
    (_, second), planned = calls(LRP(module, EpsilonPlus()), td)
    assert planned == [False, kind != "safe Actor"]
    (_, general), _ = calls(LRP(hooked(module), EpsilonPlus()), td)
    assert_same_call(second, general)
    if kind == "safe Actor":
        assert second["action"].abs().max() <= 0.01


class _Chain(nn.Sequential):
    """A plain chain (``nn.Sequential``'s own forward) with one more method a ``TensorDictModule`` may call."""

    def doubled(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * self(x)


def _patch_linear(policy: TensorDictModule) -> None:
    layer = policy.module[2]
    layer.forward = lambda x: nn.functional.linear(x, 2 * layer.weight, layer.bias)


def _patch_relu(policy: TensorDictModule) -> None:
    policy.module[1].forward = lambda x: nn.functional.leaky_relu(x, 0.3)


def _patch_chain(policy: TensorDictModule) -> None:
    chain = policy.module
    chain.forward = lambda x: nn.Sequential.forward(chain, 2 * x)


def _compile_chain_in_place(policy: TensorDictModule) -> None:
    chain = policy.module  # what ``module.compile()`` sets, without the compiler's time
    chain._compiled_call_impl = lambda *args, **kwargs: 2 * chain._call_impl(*args, **kwargs)


def _patch_call_module(policy: TensorDictModule) -> None:
    call = policy._call_module
    policy._call_module = lambda tensors, **kwargs: call([2 * t for t in tensors], **kwargs)


def _parametrize_weight(policy: TensorDictModule) -> None:
    nn.utils.parametrize.register_parametrization(policy.module[2], "weight", _Doubled())


class _Doubled(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return 2 * weight


MODEL_CHANGES = {
    "a Linear layer's forward set on it": _patch_linear,
    "a ReLU's forward set on it": _patch_relu,
    "the chain's forward set on it": _patch_chain,
    "the chain compiled in place": _compile_chain_in_place,
    "the TensorDictModule's _call_module set on it": _patch_call_module,
    "the TensorDictModule calling another method": lambda policy: setattr(policy, "method", "doubled"),
    "another chain put in the TensorDictModule": lambda policy: setattr(
        policy, "module", _Chain(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)).double()
    ),
    "a parametrization on a weight": _parametrize_weight,
}


@pytest.mark.parametrize("when", ["before the context", "after its first call"])
@pytest.mark.parametrize("change", sorted(MODEL_CHANGES))
def test_a_model_whose_calls_run_other_code_is_explained_as_it_runs(change, when):
    """Whatever makes a call of the model run other code than its classes' (a forward set on an instance, a
    module compiled in place, another chain or method, a parametrization) sets the plan aside: LRP-0 is gradient
    × input of the model as it runs, on every call."""
    torch.manual_seed(8)
    policy = TensorDictModule(
        _Chain(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).double(), in_keys=["x"], out_keys=["y"]
    )
    td = TensorDict(x=torch.randn(5, 4, dtype=torch.float64), batch_size=[5])
    lrp = LRP(policy, BaseRuleMapper())
    if when == "before the context":
        MODEL_CHANGES[change](policy)
    with lrp:
        results = [lrp(td.clone())]
        if when == "after its first call":
            MODEL_CHANGES[change](policy)
        results.append(lrp(td.clone()))
    x = td["x"].clone().requires_grad_(True)
    y = policy(TensorDict(x=x, batch_size=[5]))["y"]
    (grad,) = torch.autograd.grad(y.max(-1).values.sum(), x)
    for result in results[1:] if when == "after its first call" else results:
        torch.testing.assert_close(result["y"], y.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(result["relevance", "x"], x.detach() * grad, rtol=1e-12, atol=1e-12)


class _DoubledCall(nn.Sequential):
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().__call__(x)


class _DoubledCallImpl(nn.Sequential):
    def _call_impl(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super()._call_impl(x)


class _ReversedIter(nn.Sequential):
    def __iter__(self):
        return reversed(list(self._modules.values()))


class _DoubledPolicy(TensorDictModule):
    def __call__(self, tensordict: TensorDict) -> TensorDict:
        tensordict = super().__call__(tensordict)
        return tensordict.set("y", 2 * tensordict["y"])


def _policy_of(chain_class: type, policy_class: type = TensorDictModule) -> TensorDictModule:
    chain = chain_class(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)).double()
    return policy_class(chain, in_keys=["x"], out_keys=["y"])


@pytest.mark.parametrize(
    "make",
    [
        lambda: _policy_of(_DoubledCall),
        lambda: _policy_of(_DoubledCallImpl),
        lambda: _policy_of(_ReversedIter),
        lambda: _policy_of(nn.Sequential, _DoubledPolicy),
    ],
    ids=["chain's __call__", "chain's _call_impl", "chain's __iter__", "TensorDictModule's __call__"],
)
def test_subclasses_that_change_the_call_take_the_general_path(make):
    """A chain or TensorDictModule subclass that keeps ``forward`` but changes how a call runs (``__call__``,
    ``_call_impl``, the order ``nn.Sequential.forward`` iterates in) is explained as it runs: LRP-0 is gradient ×
    input."""
    torch.manual_seed(10)
    policy = make()
    td = TensorDict(x=torch.randn(5, 4, dtype=torch.float64), batch_size=[5])
    results, planned = calls(LRP(policy, BaseRuleMapper()), td)
    assert planned == [False, False]
    x = td["x"].clone().requires_grad_(True)
    y = policy(TensorDict(x=x, batch_size=[5]))["y"]
    (grad,) = torch.autograd.grad(y.max(-1).values.sum(), x)
    for result in results:
        torch.testing.assert_close(result["y"], y.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(result["relevance", "x"], x.detach() * grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("key", [nn.Sequential, "module"], ids=["by type", "by name"])
def test_a_rule_on_the_chain_itself_takes_the_general_path(key):
    """The ε-rule on the chain as a whole rescales the gradient of its output before LRP-0 runs through the
    layers: the plan, which follows the layers' rules only, stands aside."""
    torch.manual_seed(11)
    chain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    td = TensorDict(x=torch.randn(5, 4, dtype=torch.float64), batch_size=[5])
    mapper = {key: EpsilonRule(0.5), nn.Linear: EpsilonRule(0.0)}
    results, planned = calls(LRP(TensorDictModule(chain, in_keys=["x"], out_keys=["y"]), mapper), td)
    assert planned == [False, False]
    x = td["x"].clone().requires_grad_(True)
    y = chain(x)
    seed = torch.zeros_like(y).scatter_(-1, y.argmax(-1, keepdim=True), 1.0) * y.abs() / (y.abs() + 0.5)
    (grad,) = torch.autograd.grad(y, x, seed.detach())
    for result in results:
        torch.testing.assert_close(result["relevance", "x"], x.detach() * grad, rtol=1e-12, atol=1e-12)


def _optimizer_step(chain: nn.Module) -> None:
    parameters = list(chain.parameters())
    for p in parameters:
        p.grad = torch.randn_like(p)
    torch.optim.SGD(parameters, lr=0.5).step()


PARAMETER_UPDATES = {
    "an optimizer step": _optimizer_step,
    "a soft update in place": lambda chain: [p.data.mul_(0.5).add_(0.25) for p in chain.parameters()],
    "load_state_dict": lambda chain: chain.load_state_dict(
        {k: torch.randn_like(v) for k, v in chain.state_dict().items()}
    ),
    "load_state_dict(assign=True)": lambda chain: chain.load_state_dict(
        {k: torch.randn_like(v) for k, v in chain.state_dict().items()}, assign=True
    ),
    "a new weight Parameter": lambda chain: setattr(
        chain[2], "weight", nn.Parameter(torch.randn_like(chain[2].weight))
    ),
    "the bias removed": lambda chain: setattr(chain[0], "bias", None),
    "requires_grad off, train() and a step": lambda chain: [
        p.requires_grad_(False).mul_(0.5) for p in chain.train().parameters()
    ],
}


@pytest.mark.parametrize("update", sorted(PARAMETER_UPDATES))
def test_parameters_updated_between_calls_are_read_live(update):
    """Target networks and training loops change the weights between the calls of one context: each planned call
    computes with the weights of its time, as the general path does (the same updates, from the same seed)."""
    torch.manual_seed(12)
    policy = TensorDictModule(
        nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double(), in_keys=["x"], out_keys=["y"]
    )
    td = TensorDict(x=torch.randn(5, 4, dtype=torch.float64), batch_size=[5])
    results = []
    for module in (policy, hooked(policy)):
        lrp, out = LRP(module, EpsilonPlus()), []
        with lrp, mock.patch.object(PlannedCall, "run", autospec=True, side_effect=PlannedCall.run) as run:
            out += [lrp(td.clone()), lrp(td.clone())]
            torch.manual_seed(13)
            PARAMETER_UPDATES[update](module.module)
            out.append(lrp(td.clone()))
        results.append((out, run.call_count))
    (ours, planned), (general, general_planned) = results
    assert (planned, general_planned) == (2, 0)
    assert not torch.allclose(ours[1]["y"], ours[2]["y"])  # the update changed the output
    for mine, theirs in zip(ours, general, strict=True):
        assert_same_call(mine, theirs)


@pytest.mark.parametrize("path", ["planned", "general"])
@pytest.mark.parametrize("activation", [nn.ELU, nn.SiLU, nn.LeakyReLU])
def test_an_activation_set_in_place_inside_the_context_keeps_its_input(path, activation):
    """The pass rule reads an activation's input; one set to run in place after the context was entered
    overwrote it before the rule read it (in both paths), and the relevance was that of ``f(f(x)) / f(x)``."""
    torch.manual_seed(0)
    chain = nn.Sequential(nn.Linear(4, 6), activation(), nn.Linear(6, 3)).double()
    policy = TensorDictModule(chain, in_keys=["observation"], out_keys=["action_value"])
    policy = policy if path == "planned" else hooked(policy)
    td = TensorDict(observation=torch.randn(5, 4, dtype=torch.float64), batch_size=[5])
    expected = LRP(copy.deepcopy(policy), EpsilonPlus())(td.clone())
    lrp = LRP(policy, EpsilonPlus())
    with lrp:
        lrp(td.clone())  # the context's first call: the activation still out of place
        policy.module[1].inplace = True
        results = [lrp(td.clone()) for _ in range(2)]
    for result in results:
        assert_same_call(result, expected)


@pytest.mark.parametrize("tensor", ["weight", "bias"])
def test_a_tensor_set_on_the_meta_device_inside_the_context_is_named(tensor):
    """The plan computes a linear layer from a weight on the meta device as torch does, from whatever the memory
    held (relevance up to 1e35 before): refused as the general path refuses it, naming the module and the tensor."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    lrp = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
    td = TensorDict(x=torch.randn(1, 3), batch_size=[1])
    with lrp:
        lrp(td.clone())
        assert lrp._plan is not None
        setattr(net[2], tensor, nn.Parameter(torch.empty_like(getattr(net[2], tensor), device="meta")))
        expected = rf"^LRP: the module '2' \(Linear\) holds its parameter '{tensor}' on the meta device"
        with pytest.raises(ValueError, match=expected):
            lrp(td)
    assert list(td.keys()) == ["x"]


def test_a_chain_set_to_read_another_key_inside_the_context_is_not_explained_under_the_old_one():
    """The plan read the key the chain's ``TensorDictModule`` reads now and wrote that input's relevance under the
    explained key's name, with no word; the general path refuses the explained key, which the model no longer reads,
    in the context as in a call of its own."""
    torch.manual_seed(0)
    policy = TensorDictModule(
        nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double(), in_keys=["x"], out_keys=["y"]
    )
    td = TensorDict(x=torch.randn(5, 4, dtype=torch.float64), z=torch.randn(5, 4, dtype=torch.float64), batch_size=[5])
    lrp = LRP(policy, EpsilonPlus())
    with lrp:
        lrp(td.clone())
        lrp(td.clone())
        assert lrp._plan is not None
        policy.in_keys = ["z"]
        with pytest.raises(ValueError, match="^LRP: target 'y' does not depend on the explained input 'x'"):
            lrp(td.clone())


@pytest.mark.parametrize(
    "activation",
    [lambda: nn.LeakyReLU(0.1), lambda: nn.PReLU(2, init=0.3), lambda: nn.Hardtanh(0.0, float("inf")), nn.ReLU],
    ids=["LeakyReLU", "PReLU", "Hardtanh(0, inf)", "ReLU"],
)
def test_a_homogeneous_activation_keeps_its_plain_gradient_in_planned_calls(activation):
    """The pass rule registers nothing on a leaky or parametric ReLU (its plain gradient is the rule), but a planned
    call took ``output / stabilize(input)``: off by ``stabilizer / |x|``, 1.5 in a relevance of 4 at a
    pre-activation of 1e-12 (LRP-0 of the first call, and of the plan now, is gradient × input)."""
    chain = nn.Sequential(nn.Linear(2, 2), activation(), nn.Linear(2, 2)).double()
    with torch.no_grad():  # the first hidden unit's pre-activation 1e-12 at x = [1, 1]
        chain[0].weight.copy_(torch.tensor([[3.0, -2.0], [1.0, 0.5]]))
        chain[0].bias.copy_(torch.tensor([-1.0 + 1e-12, 0.1]))
        chain[2].weight.copy_(torch.tensor([[1.0, 1.0], [-1.0, 0.2]]))
        chain[2].bias.zero_()
    x = torch.ones(1, 2, dtype=torch.float64)
    (first, second), planned = calls(LRP(TensorDictModule(chain, ["x"], ["y"]), BaseRuleMapper(), target=0),
                                     TensorDict(x=x, batch_size=[1]))  # fmt: skip
    leaf = x.clone().requires_grad_(True)
    expected = x * torch.autograd.grad(chain(leaf)[:, 0].sum(), leaf)[0]
    assert planned == [False, not isinstance(chain[1], nn.Hardtanh)]  # the preset gives Hardtanh no pass rule
    for call in (first, second):
        torch.testing.assert_close(call["relevance", "x"], expected, rtol=1e-12, atol=1e-12)


def test_a_float16_chain_takes_the_pass_factor_in_float32():
    """A Tanh's pass factor at an input of exactly 0 in float16: the stabiliser (1e-12) rounds to 0 there, and a
    planned call's 0 / 0 raised a non-finite relevance where the first call (in float32, as the rule takes it) did
    not."""
    chain = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2)).half()
    with torch.no_grad():
        chain[0].weight.copy_(torch.tensor([[1.0, -1.0], [0.5, 0.25]]))
        chain[0].bias.zero_()
    td = TensorDict(x=torch.ones(1, 2, dtype=torch.float16), batch_size=[1])
    (first, second), planned = calls(LRP(TensorDictModule(chain, ["x"], ["y"]), BaseRuleMapper(), target=0), td)
    assert planned == [False, True] and torch.isfinite(second["relevance", "x"]).all()
    assert torch.equal(second["relevance", "x"], first["relevance", "x"])
