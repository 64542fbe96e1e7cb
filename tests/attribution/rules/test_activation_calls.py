"""TanhCallsRule: the pass rule on the ``tanh`` inside a module's own forward (torchrl's TanhModule); SafeTanhCallsRule:
on the ``safetanh`` Function of torchrl's TanhDelta and TanhNormal distributions.

The oracle is the pass rule on an ``nn.Tanh`` followed by the same affine map to the bounds.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import (
    NormalParamExtractor,
    ProbabilisticTensorDictModule,
    TensorDictModule,
    TensorDictSequential,
)
from torch import nn
from torchrl.envs.utils import ExplorationType, set_exploration_type
from torchrl.modules import OneHotCategorical, ProbabilisticActor, TanhDelta, TanhModule, TanhNormal

from tdhook.attribution import (
    LRP,
    BaseRuleMapper,
    EpsilonPlus,
    EpsilonRule,
    PassRule,
    SafeTanhCallsRule,
    TanhCallsRule,
)

F64 = torch.float64
LOW, HIGH = -1.0, 3.0


def squash() -> TanhModule:
    return TanhModule(in_keys=["param"], out_keys=["action"], low=LOW, high=HIGH)


def run(module: TanhModule, param: torch.Tensor) -> torch.Tensor:
    return module(TensorDict(param=param, batch_size=param.shape[:1]))["action"]


def pass_rule_gradient(param: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """The oracle: ``nn.Tanh`` under the pass rule, then the affine map onto the bounds."""
    tanh = nn.Tanh()
    with PassRule().register(tanh):
        action = LOW + (HIGH - LOW) * (tanh(param) + 1) / 2
        return torch.autograd.grad(action, param, seed)[0]


def test_the_gradient_is_the_pass_rules_through_tanh():
    param = torch.randn(4, 3, dtype=F64, requires_grad=True)
    seed = torch.randn(4, 3, dtype=F64)
    module = squash()
    plain = run(module, param)
    with TanhCallsRule().register(module):
        action = run(module, param)
        grad = torch.autograd.grad(action, param, seed)[0]
    assert torch.equal(action, plain)
    torch.testing.assert_close(grad, pass_rule_gradient(param, seed), rtol=1e-12, atol=1e-14)
    # Relevance passes through tanh: what reaches param is the action less the bounds' offset.
    torch.testing.assert_close(param * grad, (action - (LOW + HIGH) / 2) * seed, rtol=1e-10, atol=1e-12)


def test_the_relevance_keeps_its_graph_where_asked():
    """With ``create_graph=True`` the relevance's derivative is that of the pass rule on an ``nn.Tanh``."""
    torch.manual_seed(0)
    net = nn.Linear(3, 2, dtype=F64)
    actor = TensorDictSequential(TensorDictModule(net, in_keys=["observation"], out_keys=["param"]), squash())
    reference = nn.Sequential(net, nn.Tanh())
    derivatives = []
    for module, kwargs in ((actor, {}), (reference, {"in_keys": ["observation"], "out_keys": ["action"]})):
        observation = torch.randn(4, 3, dtype=F64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        lrp = LRP(module, EpsilonPlus(), create_graph=True, target=0, **kwargs)
        relevance = lrp(TensorDict(observation=observation, batch_size=[4]))["relevance", "observation"]
        derivatives.append(torch.autograd.grad(relevance.pow(2).sum(), observation)[0])
    scale = (HIGH - LOW) / 2
    torch.testing.assert_close(derivatives[0], derivatives[1] * scale**2, rtol=1e-10, atol=1e-12)


def test_removing_the_rule_gives_back_the_plain_gradient():
    param = torch.randn(4, 3, dtype=F64, requires_grad=True)
    module = squash()
    plain = torch.autograd.grad(run(module, param).sum(), param)[0]
    rule = TanhCallsRule()
    with rule.register(module):
        with pytest.raises(ValueError, match="already registered"):
            rule.register(module)
    assert not module._forward_hooks and not module._forward_pre_hooks
    assert torch.equal(torch.autograd.grad(run(module, param).sum(), param)[0], plain)


def test_the_default_mapper_gives_a_tanh_module_the_rule():
    assert isinstance(BaseRuleMapper()("actor.1", squash()), TanhCallsRule)
    with pytest.raises(ValueError, match="stabilizer"):
        TanhCallsRule(stabilizer=-1.0)


def test_a_clamped_saturated_action_keeps_its_relevance():
    """``TanhModule(clamp=True)`` clamps tanh just inside (-1, 1): a saturated action (param 20, -40) has a zero
    plain gradient there, and would get no relevance; the pass rule carries it through the clamp as through tanh."""
    module = TanhModule(in_keys=["param"], out_keys=["action"], low=LOW, high=HIGH, clamp=True)
    param = torch.tensor([[20.0, -40.0, 0.3]], dtype=F64, requires_grad=True)
    plain = run(module, param)
    assert torch.equal(torch.autograd.grad(plain.sum(), param)[0][0, :2], torch.zeros(2, dtype=F64))
    with TanhCallsRule().register(module):
        action = run(module, param)
        grad = torch.autograd.grad(action.sum(), param)[0]
    assert torch.equal(action, plain)
    torch.testing.assert_close(param * grad, action - (LOW + HIGH) / 2, rtol=1e-10, atol=1e-12)


def test_a_tanh_under_vmap_is_refused_naming_the_module():
    # Under torch.vmap the tanh's input reports no gradient: the pass rule did not apply, silently.
    squash = TanhModule(in_keys=["param"], out_keys=["action"])

    class Vmapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.squash = nn.Linear(3, 2), squash

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.vmap(lambda h: self.squash(TensorDict(param=h))["action"])(self.fc(x))

    mapper = BaseRuleMapper(rule_mapper=lambda name, module: TanhCallsRule() if module is squash else None)
    lrp = LRP(Vmapped(), mapper, in_keys=["x"], out_keys=["y"])
    with pytest.raises(RuntimeError, match="module TanhModule runs under torch.vmap"):
        lrp(TensorDict(x=torch.randn(4, 3), batch_size=[4]))


# ----------------------------------------------------------------------------- SafeTanhCallsRule


def tanh_head(
    distribution: type, low: float = LOW, high: float = HIGH, safe: bool = True
) -> ProbabilisticTensorDictModule:
    """A head sampling from torchrl's TanhDelta (from ``param``) or TanhNormal (from ``loc`` and ``scale``), with
    their tanh in torchrl's custom Function (``safe``) or a plain ``tanh``."""
    keys = ["param"] if distribution is TanhDelta else ["loc", "scale"]
    return ProbabilisticTensorDictModule(
        in_keys=keys,
        out_keys=["action"],
        distribution_class=distribution,
        distribution_kwargs={"low": low, "high": high, ("safe" if distribution is TanhDelta else "safe_tanh"): safe},
        return_log_prob=True,
    )


def sample(head: ProbabilisticTensorDictModule, param: torch.Tensor) -> TensorDict:
    td = TensorDict(param=param, loc=param, scale=torch.ones_like(param), batch_size=param.shape[:1])
    with set_exploration_type(ExplorationType.DETERMINISTIC):
        return head(td)


@pytest.mark.parametrize("safe", [True, False])
@pytest.mark.parametrize("bounds", [(LOW, HIGH), (-1.0, 1.0)])  # (-1, 1): the action is the safetanh's own output
@pytest.mark.parametrize("distribution", [TanhDelta, TanhNormal])
def test_the_safe_tanh_of_a_squashing_distribution_gets_the_pass_rule(distribution: type, bounds: tuple, safe: bool):
    """The deterministic action of a TanhDelta or TanhNormal head: torchrl computes its tanh in a custom autograd
    Function with the plain gradient. Under the rule the action is the head's, bit for bit, and its gradient is the
    pass rule's through tanh, then the affine map onto the bounds."""
    low, high = bounds
    param = torch.tensor([[20.0, -40.0, 0.3], [0.0, -0.7, 1.5]], dtype=F64, requires_grad=True)  # two saturated
    seed = torch.randn(2, 3, dtype=F64)
    head = tanh_head(distribution, low, high, safe)
    plain = sample(head, param)
    with SafeTanhCallsRule().register(head):
        out = sample(head, param)
        grad = torch.autograd.grad(out["action"], param, seed)[0]
    assert torch.equal(out["action"], plain["action"])
    # (the unsafe tanh's log-probability of a saturated action is not a number)
    torch.testing.assert_close(out["action_log_prob"], plain["action_log_prob"], rtol=0, atol=0, equal_nan=True)
    middle, half = (low + high) / 2, (high - low) / 2
    shift = middle if distribution is TanhDelta else 0.0  # TanhDelta squashes param + middle, TanhNormal its loc
    tanh = nn.Tanh()
    with PassRule().register(tanh):
        expected = torch.autograd.grad(middle + half * tanh(param + shift), param, seed)[0]
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)
    # Relevance passes through tanh: what reaches the tanh's input is the action less the middle of the bounds.
    torch.testing.assert_close((param + shift) * grad, (out["action"] - middle) * seed, rtol=1e-10, atol=1e-12)


def test_the_default_mapper_gives_the_rule_to_tanh_squashing_heads_only():
    mapper = BaseRuleMapper()
    assert isinstance(mapper("actor.1", tanh_head(TanhDelta)), SafeTanhCallsRule)
    assert isinstance(mapper("actor.1", tanh_head(TanhNormal)), SafeTanhCallsRule)
    categorical = ProbabilisticTensorDictModule(in_keys=["logits"], distribution_class=OneHotCategorical)
    assert not isinstance(mapper("actor.1", categorical), SafeTanhCallsRule)
    with pytest.raises(ValueError, match="stabilizer"):
        SafeTanhCallsRule(stabilizer=-1.0)


def test_removing_the_safe_tanh_rule_gives_back_the_plain_gradient():
    param = torch.randn(4, 3, dtype=F64, requires_grad=True)
    head = tanh_head(TanhDelta)
    plain = torch.autograd.grad(sample(head, param)["action"].sum(), param)[0]
    with SafeTanhCallsRule().register(head):
        pass
    assert not head._forward_hooks and not head._forward_pre_hooks
    assert torch.equal(torch.autograd.grad(sample(head, param)["action"].sum(), param)[0], plain)


@pytest.mark.parametrize("distribution", [TanhDelta, TanhNormal])
def test_an_actor_explained_on_its_squashed_action_conserves_it(distribution: type):
    """DDPG's TanhDelta actor and a TanhNormal actor acting deterministically, explained on the action: with no
    bias and bounds symmetric about zero, the relevance sums to the action, with no warning (the safetanh kept its
    plain gradient, with a warning naming the module, and the sum was off)."""
    torch.manual_seed(0)
    units = 2 if distribution is TanhDelta else 4
    net = nn.Sequential(nn.Linear(3, 8, bias=False), nn.ReLU(), nn.Linear(8, units, bias=False)).double()
    if distribution is TanhNormal:
        net.append(NormalParamExtractor(scale_mapping="none"))
    keys = ["param"] if distribution is TanhDelta else ["loc", "scale"]
    actor = ProbabilisticActor(
        TensorDictModule(net, ["observation"], keys),
        in_keys=keys,
        distribution_class=distribution,
        distribution_kwargs={"low": -2.0, "high": 2.0},
    )
    td = TensorDict(observation=torch.randn(5, 3, dtype=F64) * 2, batch_size=[5])
    mapper = BaseRuleMapper(stabilizer=1e-12, rule_mapper={nn.Linear: EpsilonRule(0.0)})
    with set_exploration_type(ExplorationType.DETERMINISTIC), warnings.catch_warnings():
        warnings.simplefilter("error")
        out = LRP(actor, mapper, target_key="action", target="all")(td.clone())
    relevance = out["relevance", "observation"].sum(-1)  # [5, units]
    torch.testing.assert_close(relevance, out["action"], rtol=1e-9, atol=1e-12)


def test_the_relevance_through_a_safe_tanh_keeps_its_graph_where_asked():
    """With ``create_graph=True`` the relevance's derivative is that of the pass rule on an ``nn.Tanh``."""
    torch.manual_seed(0)
    net = nn.Linear(3, 2, dtype=F64)
    actor = ProbabilisticActor(
        TensorDictModule(net, in_keys=["observation"], out_keys=["param"]),
        in_keys=["param"],
        distribution_class=TanhDelta,
        distribution_kwargs={"low": -2.0, "high": 2.0},
    )
    reference = nn.Sequential(net, nn.Tanh())
    derivatives = []
    for module, kwargs in (
        (actor, {"target_key": "action"}),
        (reference, {"in_keys": ["observation"], "out_keys": ["action"]}),
    ):
        observation = torch.randn(4, 3, dtype=F64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        lrp = LRP(module, EpsilonPlus(), create_graph=True, target=0, **kwargs)
        with set_exploration_type(ExplorationType.DETERMINISTIC):
            relevance = lrp(TensorDict(observation=observation, batch_size=[4]))["relevance", "observation"]
        derivatives.append(torch.autograd.grad(relevance.pow(2).sum(), observation)[0])
    scale = 2.0
    torch.testing.assert_close(derivatives[0], derivatives[1] * scale**2, rtol=1e-10, atol=1e-12)
