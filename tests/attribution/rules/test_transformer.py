"""The transformer rules (softmax-ε, AH-QKV, pseudo-identity, uniform product) against their closed forms, in float64.

LayerNormRule (AttnLRP's name for NormRule) is tested with the norms, in test_normalization.py."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.mappers.transformer import AttnLRP
from tdhook.attribution.rules.transformer import (
    AHQKVRule,
    PseudoIdentityRule,
    SoftmaxEpsilonRule,
    uniform_product,
)
from tests.attribution.rules._helpers import F64, randn
from tests.conftest import relative_error, tdhook_relevance


class Softmax(nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=-1)


@pytest.mark.parametrize("epsilon", [0.0, 0.1])
@pytest.mark.parametrize("how", ["module", "function"])
def test_softmax_rule_closed_form(epsilon: float, how: str):
    x, relevance_out = randn(4, 6), randn(4, 6)
    if how == "module":
        relevance = tdhook_relevance(SoftmaxEpsilonRule(epsilon), nn.Softmax(dim=-1), x, relevance_out)
    else:
        mapper = AttnLRP(softmax_epsilon=epsilon)
        lrp = LRP(Softmax(), mapper, in_keys=["x"], out_keys=["y"], target=lambda y: relevance_out)
        relevance = lrp(TensorDict(x=x.clone(), batch_size=[4]))["relevance", "x"]
    s = torch.softmax(x, -1)
    closed = x * (relevance_out - s * relevance_out.sum(-1, keepdim=True))
    sign = torch.where(x >= 0, 1.0, -1.0).to(F64)
    expected = closed * x / (x + epsilon * sign)
    assert relative_error(relevance, expected) <= 1e-12


@pytest.mark.parametrize("create_graph", [False, True])
def test_softmax_rule_in_float16_with_an_epsilon_below_its_smallest_step_is_finite_at_a_zero_logit(create_graph):
    # float16's smallest step is 6e-8: stabilize(0, 1e-9) rounded to 0, and x · (…) / stabilize(x) was 0 / 0 there,
    # NaN at every input (the sum over the softmax dimension spreads it).
    x, relevance_out = randn(3, 5), randn(3, 5)
    x[:, 2] = 0.0
    expected = x * (relevance_out - torch.softmax(x, -1) * relevance_out.sum(-1, keepdim=True))
    target = lambda y: relevance_out.half()  # noqa: E731
    mapper = AttnLRP(softmax_epsilon=1e-9)
    lrp = LRP(Softmax(), mapper, in_keys=["x"], out_keys=["y"], target=target, create_graph=create_graph)
    relevance = lrp(TensorDict(x=x.half(), batch_size=[3]))["relevance", "x"]
    assert relevance.dtype == torch.float16 and torch.isfinite(relevance).all(), relevance
    torch.testing.assert_close(relevance.double(), expected, rtol=1e-2, atol=2e-3)


def test_softmax_rule_gives_masked_logits_no_relevance():
    x = randn(2, 5).masked_fill(torch.tensor([False, True, False, False, True]), float("-inf"))
    x.requires_grad_(True)
    with SoftmaxEpsilonRule(epsilon=0.1).register(softmax := nn.Softmax(dim=-1)):
        s = softmax(x)
        (grad,) = torch.autograd.grad(s, x, randn(2, 5))
    assert torch.isfinite(grad).all() and (grad[:, [1, 4]] == 0).all()


def test_ahqkv_rule_holds_attention_weights_constant():
    # Attention weights alone carry no relevance: explaining them is an error that names the key.
    with pytest.raises(ValueError, match="target 'y' does not depend on the explained inputs"):
        tdhook_relevance(AHQKVRule(), nn.Softmax(dim=-1), randn(3, 4), randn(3, 4))


@pytest.mark.parametrize("activation", [nn.GELU(), nn.SiLU(), nn.Tanh(), nn.Softplus()])
def test_pseudo_identity_rule_passes_relevance_on(activation: nn.Module):
    x, relevance_out = randn(4, 5), randn(4, 5)
    relevance = tdhook_relevance(PseudoIdentityRule(), activation, x, relevance_out)
    assert relative_error(relevance, relevance_out) <= 1e-8  # the stabilizer is 1e-10


def test_uniform_product_rule_halves_the_relevance_of_each_factor():
    a, b = randn(3, 4).requires_grad_(True), randn(4, 2).requires_grad_(True)
    relevance_out = randn(3, 2)
    z = a @ b
    ha, hb = uniform_product(a, b)
    ga, gb = torch.autograd.grad(ha @ hb, (a, b), relevance_out / z.detach())
    # R_a[i, k] = Σ_j a_ik b_kj R_ij / (2 z_ij), and the same for b.
    share = relevance_out / z.detach() / 2
    expected_a = torch.einsum("ik,kj,ij->ik", a.detach(), b.detach(), share)
    expected_b = torch.einsum("ik,kj,ij->kj", a.detach(), b.detach(), share)
    assert relative_error(a.detach() * ga, expected_a) <= 1e-12
    assert relative_error(b.detach() * gb, expected_b) <= 1e-12
    torch.testing.assert_close((a.detach() * ga).sum() + (b.detach() * gb).sum(), relevance_out.sum())


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: SoftmaxEpsilonRule(epsilon=-0.1), "SoftmaxEpsilonRule: epsilon must be a finite number >= 0"),
        (lambda: PseudoIdentityRule(stabilizer=-1e-10), "PseudoIdentityRule: stabilizer must be a finite number >= 0"),
    ],
)
def test_wrong_numbers_are_refused_at_construction(make, match: str):
    with pytest.raises(ValueError, match=match):
        make()
    assert SoftmaxEpsilonRule(epsilon=0.0).epsilon == 0.0 and PseudoIdentityRule(0.0).stabilizer == 0.0


class _SoftmaxBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.softmax = nn.Linear(4, 4, dtype=F64), nn.Softmax(dim=-1)

    def forward(self, x):
        return self.softmax(self.lin(x))


@pytest.mark.parametrize("make_rule", [lambda: SoftmaxEpsilonRule(0.1), AHQKVRule])
@pytest.mark.parametrize(
    ("name", "kind"), [("module.1", "_SoftmaxBlock"), ("module", "Sequential"), ("module.1.lin", "Linear")]
)
@pytest.mark.parametrize("by", ["dict", "callable"])
def test_softmax_rules_on_a_module_that_is_no_softmax_are_refused_naming_it(make_rule, name: str, kind: str, by: str):
    # They read the module's softmax dimension: on a container or a layer that was a bare AttributeError ('dim').
    net = nn.Sequential(nn.Linear(4, 4, dtype=F64), _SoftmaxBlock(), nn.Linear(4, 2, dtype=F64))
    rule = make_rule()
    mapper = {name: rule} if by == "dict" else (lambda module_name, module: rule if module_name == name else None)
    lrp = LRP(TensorDictModule(net, in_keys=["x"], out_keys=["y"]), mapper)
    match = rf"module '{name}' \({kind}\): {type(rule).__name__} expects an nn.Softmax module"
    with pytest.raises(TypeError, match=match):
        lrp(TensorDict(x=randn(3, 4), batch_size=[3]))
    assert not net[1].lin._forward_hooks and not net._forward_hooks  # nothing left registered


@pytest.mark.parametrize("module", [nn.LogSoftmax(dim=-1), nn.Softmin(dim=-1)])
def test_softmax_rule_refuses_a_module_that_computes_another_function_along_a_dimension(module: nn.Module):
    # These have a `dim` too: the softmax rule's gradient on them would be silently wrong.
    match = f"SoftmaxEpsilonRule expects an nn.Softmax module.*got {type(module).__name__}"
    with pytest.raises(TypeError, match=match):
        SoftmaxEpsilonRule(0.1).register(module)
