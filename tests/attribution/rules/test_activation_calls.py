"""TanhCallsRule: the pass rule on the ``tanh`` inside a module's own forward (torchrl's TanhModule).

The oracle is the pass rule on an ``nn.Tanh`` followed by the same affine map to the bounds.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule, TensorDictSequential
from torch import nn
from torchrl.modules import TanhModule

from tdhook.attribution import LRP, BaseRuleMapper, EpsilonPlus, PassRule, TanhCallsRule

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
