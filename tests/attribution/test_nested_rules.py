"""The ε-rule on a block whose inner modules have rules of their own is refused; on a block whose inner modules
keep the plain gradient it is the ε-rule of the block as one layer."""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import LRP, AlphaBetaRule, EpsilonPlus, EpsilonRule, IgnoreRule, TaylorDecompositionRule
from tdhook.attribution.rules import Rule, redirect, stabilize
from tests.attribution._helpers import assert_unchanged, state_snapshot
from tests.conftest import relative_error


def block_net() -> nn.Module:
    block = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 5))
    return nn.Sequential(block, nn.ReLU(), nn.Linear(5, 3)).double()


def explain(net: nn.Module, x: torch.Tensor, rule_mapper) -> torch.Tensor:
    lrp = LRP(TensorDictModule(net, in_keys=["x"], out_keys=["y"]), rule_mapper=rule_mapper)
    return lrp(TensorDict(x=x, batch_size=x.shape[:1]))["relevance", "x"]


@pytest.mark.parametrize(
    "rule_mapper",
    [
        {"module.0": EpsilonRule(0.5), nn.Linear: EpsilonRule(0.5)},  # the block's and its layers' ε
        EpsilonPlus(rule_mapper={nn.Sequential: EpsilonRule(0.5)}),  # the whole model's and the preset's
        {"module.0": EpsilonRule(0.5), "module.0.0": AlphaBetaRule(1.0, 0.0)},  # z⁺ inside
    ],
)
def test_the_epsilon_rule_over_inner_rules_is_refused_by_name(rule_mapper):
    # Before, the block's ε-rule was applied on top of its layers' (its last layer's output stabilised twice),
    # silently: on the first mapper, 74 % (relative L2) from the layers' rules alone, 95 % from the block's alone.
    net = block_net()
    snapshot = state_snapshot(net)
    expected = r"EpsilonRule\(epsilon=0.5\) on module 'module(.0)?' \(Sequential\) would act on top of the rules of "
    td = TensorDict(x=torch.randn(2, 4, dtype=torch.float64), batch_size=[2])
    x = td["x"]
    lrp = LRP(TensorDictModule(net, in_keys=["x"], out_keys=["y"]), rule_mapper=rule_mapper)
    with lrp:
        for _ in range(2):  # a refused call leaves the next one of the context watched, and refused
            with pytest.raises(ValueError, match=expected + r"the modules inside it \('module.0"):
                lrp(td)
    assert_unchanged(net, snapshot)
    assert list(td.keys()) == ["x"] and td["x"] is x


@pytest.mark.parametrize("inner", [{}, {nn.Linear: EpsilonRule(0.0)}], ids=["defaults", "LRP-0"])
def test_the_epsilon_rule_on_a_block_of_plain_layers_is_the_epsilon_rule_of_its_jacobian(inner):
    # R_in = x ⊙ Jᵀ (R / stabilize(z, ε)), J the block's plain Jacobian (the rule's formula), for the target's
    # relevance at the block's output.
    net, x, epsilon = block_net(), torch.randn(3, 4, dtype=torch.float64), 0.5
    actual = explain(net, x, {"module.0": EpsilonRule(epsilon), **inner})
    assert relative_error(actual, block_epsilon(net, x, epsilon)) < 1e-12


def block_epsilon(net: nn.Module, x: torch.Tensor, epsilon: float) -> torch.Tensor:
    """The ε-rule on ``block_net``'s block as one layer, its head plain, for the largest output: written out."""
    block, head = net[0], net[2]
    z = block(x)
    y = head(torch.relu(z))
    seed = torch.zeros_like(y).scatter_(1, y.argmax(1, keepdim=True), 1.0) * y
    z_var = z.detach().requires_grad_()
    (grad_z,) = torch.autograd.grad(head(torch.relu(z_var)), z_var, seed / y.detach().where(seed != 0, 1.0))
    relevance_z = z.detach() * grad_z
    stabilized = z.detach() + epsilon * torch.where(z.detach() >= 0, 1.0, -1.0)
    x_var = x.clone().requires_grad_()
    (grad_x,) = torch.autograd.grad(block(x_var), x_var, relevance_z / stabilized)
    return x * grad_x


class BlockEpsilon(Rule):
    """The ε-rule written as a rule of one's own: the output gradient rescaled by ``z / stabilize(z, ε)``."""

    def __init__(self, epsilon: float) -> None:
        super().__init__()
        self.epsilon = epsilon

    def rewrite(self, module, registration, inputs, output):
        z = output.detach()
        return redirect(output, [output], lambda grad: [grad * z / stabilize(z, self.epsilon)])


def test_a_rule_of_ones_own_over_inner_rules_is_refused_by_name():
    # Before, the rule of one's own on the block stacked with its layers' ε-rules without a word (the relevance's sum
    # 0.0007 where the block's rule alone gives 0.015, on the net of the script that showed it).
    net = block_net()
    snapshot = state_snapshot(net)
    td = TensorDict(x=torch.randn(2, 4, dtype=torch.float64), batch_size=[2])
    lrp = LRP(
        TensorDictModule(net, in_keys=["x"], out_keys=["y"]),
        rule_mapper={"module.0": BlockEpsilon(0.5), nn.Linear: EpsilonRule(0.5)},
    )
    with pytest.raises(
        ValueError,
        match=r"BlockEpsilon\(epsilon=0.5\) on module 'module.0' \(Sequential\) would act on top of "
        r"the rules of the modules inside it \('module.0.0' \(Linear\): EpsilonRule.*'module.0.\*'",
    ):
        lrp(td)
    assert_unchanged(net, snapshot)
    assert list(td.keys()) == ["x"]
    # The modules inside mapped to IgnoreRule: the block's rule alone, the ε-rule of its Jacobian.
    x = td["x"]
    alone = explain(net, x, {"module.0": BlockEpsilon(0.5), "module.0.*": IgnoreRule()})
    assert relative_error(alone, block_epsilon(net, x, 0.5)) < 1e-12


def test_a_block_rule_that_replaces_the_inner_rules_is_kept():
    # The Taylor rule evaluates its block plainly: the inner rules play no part, and the pair is allowed.
    net, x = block_net(), torch.randn(2, 4, dtype=torch.float64)
    taylor = TaylorDecompositionRule(ref=0.1, bias=True)
    with_inner = explain(net, x, {"module.0": taylor, nn.Linear: EpsilonRule(0.5)})
    alone = explain(net, x, {"module.0": taylor, "module.2": EpsilonRule(0.5)})
    torch.testing.assert_close(with_inner, alone, rtol=1e-12, atol=0)


def test_the_plain_gradient_asked_for_a_container_of_ruled_layers_is_warned_of():
    # IgnoreRule on an nn.Sequential changes nothing (the container computes nothing itself) while its layers keep
    # their z⁺: before, the relevance was that of z⁺ everywhere with no word, though the block was asked to keep its
    # plain gradient (on this net, 0.5 and more off it, relative L2).
    net, x = block_net(), torch.randn(3, 4, dtype=torch.float64)
    zplus = AlphaBetaRule(1.0, 0.0)
    with pytest.warns(UserWarning, match=r"IgnoreRule\(\) on module 'module.0' \(Sequential\) changes nothing.*'m"):
        asked = explain(net, x, {"module.0": IgnoreRule(), nn.Linear: zplus})
    torch.testing.assert_close(asked, explain(net, x, {nn.Linear: zplus}), rtol=1e-12, atol=0)
    # The modules inside mapped too: gradient × input through the block, and no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain_block = explain(net, x, {"module.0*": IgnoreRule(), "module.2": IgnoreRule()})
    x_var = x.clone().requires_grad_()
    y = net(x_var)
    (grad,) = torch.autograd.grad(y.gather(1, y.argmax(1, keepdim=True)).sum(), x_var)
    assert relative_error(plain_block, x * grad) < 1e-12
    assert relative_error(asked, x * grad) > 0.1
