"""The transformer rules against their closed forms, in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.functional_rules import FunctionalRules
from tdhook.attribution.lrp_helpers.rules import (
    AHQKVRule,
    AttnLRP,
    LayerNormRule,
    PseudoIdentityRule,
    SoftmaxEpsilonRule,
)
from tdhook.attribution.lrp_helpers.transformer_rules import uniform_product
from tests.conftest import relative_error, tdhook_relevance

F64 = torch.float64


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=F64)


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


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_layer_norm_rule_is_the_gradient_with_the_scale_detached(norm: str):
    if norm == "layer":
        module = nn.LayerNorm(6, dtype=F64)
    else:
        module = nn.RMSNorm(6, eps=1e-5, dtype=F64)
    with torch.no_grad():
        module.weight.copy_(randn(6))
        if norm == "layer":
            module.bias.copy_(randn(6))
    x, relevance_out = randn(5, 6), randn(5, 6)
    relevance = tdhook_relevance(LayerNormRule(), module, x, relevance_out)

    xr = x.clone().requires_grad_(True)
    if norm == "layer":
        centred = xr - xr.mean(-1, keepdim=True)
        sigma = (centred.pow(2).mean(-1, keepdim=True) + module.eps).sqrt().detach()
        y = centred / sigma * module.weight + module.bias
    else:
        y = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + module.eps).detach() * module.weight
    torch.testing.assert_close(y, module(x))
    (grad,) = torch.autograd.grad(y, xr, relevance_out / y.detach())
    assert relative_error(relevance, x * grad) <= 1e-12
    if norm == "rms":  # each feature keeps its own relevance
        assert relative_error(relevance, relevance_out) <= 1e-12


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_functional_norms_get_the_same_rule_as_the_modules(norm: str):
    module = nn.LayerNorm(6, dtype=F64) if norm == "layer" else nn.RMSNorm(6, eps=1e-6, dtype=F64)
    x, relevance_out = randn(5, 6), randn(5, 6)
    by_module = tdhook_relevance(LayerNormRule(), module, x, relevance_out)
    xr = x.clone().requires_grad_(True)
    with FunctionalRules(SoftmaxEpsilonRule(), PseudoIdentityRule()):
        y = module(xr * 1)  # nn.LayerNorm and nn.RMSNorm call F.layer_norm and F.rms_norm
    (grad,) = torch.autograd.grad(y, xr, relevance_out / y.detach())
    assert relative_error(x * grad, by_module) <= 1e-12


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


def test_functional_rules_leave_parameters_and_constants_alone():
    weight = nn.Parameter(randn(4, 4))
    x = randn(2, 4).requires_grad_(True)
    with FunctionalRules(SoftmaxEpsilonRule(), PseudoIdentityRule()):
        y = (x * 1) @ weight * 3.0
    (grad,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(grad, (weight * 3.0).sum(1).expand(2, 4))


@pytest.mark.parametrize("softmax", [SoftmaxEpsilonRule(0.0), SoftmaxEpsilonRule(0.05), AHQKVRule()])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_attention_equals_the_unfused_rules(softmax, causal: bool):
    q, k, v = randn(2, 2, 5, 4), randn(2, 2, 5, 4), randn(2, 2, 5, 4)
    relevance_out = randn(2, 2, 5, 4)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    with FunctionalRules(softmax, PseudoIdentityRule()):
        fused = F.scaled_dot_product_attention(*(t * 1 for t in leaves), is_causal=causal)
    grads = torch.autograd.grad(fused, leaves, relevance_out / fused.detach(), allow_unused=True)
    ours = [t * g if g is not None else torch.zeros_like(t) for t, g in zip((q, k, v), grads, strict=True)]

    # Reference: the attention written out, with the rules spelled out independently.
    def half(t):
        return 0.5 * t + 0.5 * t.detach()

    ref_leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    rq, rk, rv = ref_leaves
    if not isinstance(softmax, AHQKVRule):
        rq, rk = half(rq), half(rk)
    scores = rq @ rk.transpose(-1, -2) / 2.0
    if causal:
        scores = scores.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    weights = torch.softmax(scores, -1)
    if isinstance(softmax, AHQKVRule):
        out = weights.detach() @ rv
    else:
        if softmax.epsilon:
            weights = _softmax_epsilon_reference(scores, weights, softmax.epsilon)
        out = half(weights) @ half(rv)
    torch.testing.assert_close(out, fused)
    grads = torch.autograd.grad(out, ref_leaves, relevance_out / out.detach(), allow_unused=True)
    theirs = [t * g if g is not None else torch.zeros_like(t) for t, g in zip((q, k, v), grads, strict=True)]
    for mine, expected in zip(ours, theirs, strict=True):
        assert (mine - expected).norm() <= 1e-10 * max(expected.norm(), 1.0)


def _softmax_epsilon_reference(scores: torch.Tensor, weights: torch.Tensor, epsilon: float) -> torch.Tensor:
    """``weights`` with the closed-form softmax-ε gradient, written with a custom autograd function."""

    class Rule(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return weights.detach().clone()

        @staticmethod
        def backward(ctx, grad):
            s, logits = weights.detach(), scores.detach()
            relevance = s * grad
            finite = torch.isfinite(logits)
            safe = torch.where(finite, logits, 0.0)
            relevance_in = safe * (relevance - s * relevance.sum(-1, keepdim=True))
            sign = torch.where(safe >= 0, 1.0, -1.0).to(safe.dtype)
            return torch.where(finite, relevance_in / (safe + epsilon * sign), 0.0)

    return Rule.apply(scores)
