"""FunctionalRules: the transformer rules on function calls (norms, products, fused attention), in float64."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tdhook.attribution.rules.functional import FunctionalRules
from tdhook.attribution.rules.transformer import AHQKVRule, LayerNormRule, PseudoIdentityRule, SoftmaxEpsilonRule
from tests.attribution.rules._helpers import F64, randn
from tests.conftest import relative_error, tdhook_relevance


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


@pytest.mark.parametrize("softmax", [SoftmaxEpsilonRule(), AHQKVRule()], ids=["AttnLRP", "CP-LRP"])
def test_a_product_changed_in_place_afterwards_keeps_the_rule(softmax):
    # Falcon scales its attention scores in place (``scores /= sqrt(d)``): the product the rule returns must allow
    # it, and the in-place division must reach the gradient as it does without the mode.
    q, k = randn(2, 3, 4), randn(2, 3, 4)

    def scores(mode):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k)]
        with mode:
            s = (leaves[0] * 1) @ (leaves[1] * 1).transpose(-1, -2)
            s /= 2.0
        return s, leaves

    with_rules, leaves = scores(FunctionalRules(softmax, PseudoIdentityRule(), hold_gates=False))
    plain, plain_leaves = scores(torch.enable_grad())
    torch.testing.assert_close(with_rules, plain)
    grads = torch.autograd.grad(with_rules.sum(), leaves)
    plain_grads = torch.autograd.grad(plain.sum(), plain_leaves)
    for grad, plain_grad in zip(grads, plain_grads, strict=True):  # the uniform rule: half of each gradient
        torch.testing.assert_close(grad, plain_grad / 2)


@pytest.mark.parametrize("hold_gates", [False, True])
@pytest.mark.parametrize(
    "scale", ["reshape", "one_plus", "expand", "cat", "stack", "chunk", "split", "unbind", "topk", "max"]
)
def test_a_parameter_reshaped_or_shifted_is_not_an_activation(hold_gates: bool, scale: str):
    # A layer scale (x * gamma.reshape(1, -1)) or a Gemma-style weight (x * (1 + w)) has autograd history but is
    # a parameter: the product is linear in x and keeps all of its relevance (it was halved as a product of two
    # activations).
    gamma = nn.Parameter(randn(4).abs() + 0.5)
    x = randn(3, 4).requires_grad_(True)
    with FunctionalRules(SoftmaxEpsilonRule(), PseudoIdentityRule(), hold_gates=hold_gates):
        h = x * 1
        factor = {
            "reshape": lambda: gamma.reshape(1, -1),
            "one_plus": lambda: 1 + gamma,
            "expand": lambda: gamma.view(1, 4).expand(3, 4),
            # Parameters joined by one call taking a list of them (a scale assembled from pieces).
            "cat": lambda: torch.cat([gamma[:2], gamma[2:]]),
            "stack": lambda: torch.stack([gamma, gamma * 1]).mean(0),
            # Pieces of a parameter: calls that return several tensors (a weight split per head or per expert).
            "chunk": lambda: torch.cat(gamma.chunk(2)),
            "split": lambda: torch.split(gamma, [1, 3])[1].sum() * torch.ones(4),
            "unbind": lambda: gamma.view(2, 2).unbind(0)[0].repeat(2),
            "topk": lambda: torch.topk(gamma, 4).values,
            "max": lambda: gamma.view(2, 2).max(0).values.repeat(2),
        }
        y = h * factor[scale]()
    (grad,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(x * grad, y.detach())


def _skew_rotation(vec: torch.Tensor) -> torch.Tensor:
    """``I + 2Q + 2Q²``, ``Q`` skew-symmetric from ``vec``, built in place as peft's OFT builds its rotation."""
    rows, cols = torch.triu_indices(4, 4, 1)
    skew = torch.zeros(4, 4, dtype=F64)
    skew[rows, cols] = vec
    skew = skew - skew.T
    rotation = torch.eye(4, dtype=F64)
    rotation.add_(skew, alpha=2.0)
    rotation += 2.0 * (skew @ skew)
    return rotation


@pytest.mark.parametrize("hold_gates", [False, True])
@pytest.mark.parametrize("build", ["setitem_and_add_", "copy_", "index_put_"])
def test_a_weight_built_in_place_from_parameters_is_not_an_activation(hold_gates: bool, build: str):
    """A weight written into a fresh constant tensor (``torch.zeros(...)[rows, cols] = vec``, ``copy_``,
    ``index_put_``) has autograd history after the write and was taken for an activation: its product with the
    signal got the uniform rule of two activations, halving the relevance (peft's OFT adapters: 0.69 of a tiny
    Llama's relevance, relative L2, away from the merged model's under CP-LRP). The product is linear in ``x`` and
    keeps all of its relevance. An activation written into it makes it one."""
    vec = nn.Parameter(randn(6))
    x = randn(3, 4).requires_grad_(True)
    with FunctionalRules(SoftmaxEpsilonRule(), PseudoIdentityRule(), hold_gates=hold_gates):
        if build == "setitem_and_add_":
            weight = _skew_rotation(vec)
        elif build == "copy_":
            weight = torch.zeros(4, 4, dtype=F64)
            weight[:, 1:3].copy_(vec.view(3, 2).repeat(2, 1)[:4])
        else:
            weight = torch.zeros(4, 4, dtype=F64).index_put_((torch.arange(4), torch.arange(4)), vec[:4])
        y = (x * 1) @ weight
        (grad,) = torch.autograd.grad(y.sum(), x)
        h = x * 1
        table = torch.zeros(3, 4, dtype=F64)
        table[:, :2] = h[:, :2]  # an activation written in: the table is one, its product with h gets the rule
        (grad_of_square,) = torch.autograd.grad((h * table).sum(), x)
    (plain,) = torch.autograd.grad((x @ weight.detach()).sum(), x)  # the product is linear in x: LRP-0
    assert weight.abs().sum() > 0
    torch.testing.assert_close(x * grad, x * plain)
    torch.testing.assert_close(grad_of_square[:, :2], x.detach()[:, :2])  # half of 2x: the uniform rule of x · x


@pytest.mark.parametrize("write", ["add_", "addr_", "baddbmm_", "addmv_"])
def test_an_activation_written_in_place_into_a_weight_makes_it_one(write: str):
    """A weight computed from a parameter (``2 * W``) into which an activation is written in place is an activation,
    as the same sum written out of place is: its product with the signal gets the rule of two activations. Written
    by an in-place call outside a short list (``addr_``, ``baddbmm_``, ``addmv_``), it stayed a weight, and the
    product gave the signal all of its relevance (0.5 off the out-of-place form, relative L2, here)."""
    weight, constant, matrix = nn.Parameter(randn(4, 4)), randn(4), randn(4, 4)
    x = randn(3, 4).requires_grad_(True)

    def written(h: torch.Tensor, in_place: bool) -> torch.Tensor:
        u = h[0]  # the activation written in, times constants only (a product no rule sees either way)
        w = weight * 2.0
        if write == "addmv_":
            column = w[:, 0]  # a view: the write reaches the weight it views
            if not in_place:
                return torch.cat([(column + matrix @ u)[:, None], w[:, 1:]], 1)
            column.addmv_(matrix, u)
            return w
        if not in_place:
            return w + torch.outer(u, constant)
        if write == "add_":
            return w.add_(torch.outer(u, constant))
        if write == "addr_":
            return w.addr_(u, constant)
        w = w.unsqueeze(0)
        w.baddbmm_(u.view(1, 4, 1), constant.view(1, 1, 4))
        return w[0]

    grads = []
    for in_place in (False, True):
        with FunctionalRules(SoftmaxEpsilonRule(), PseudoIdentityRule()):
            h = x * 1
            y = (h @ written(h, in_place)).sum()
        grads.append(torch.autograd.grad(y, x)[0])
    assert relative_error(x * grads[0], x * grads[1]) <= 1e-12


def test_rules_of_the_wrong_kind_are_refused():
    with pytest.raises(TypeError, match="FunctionalRules: softmax must be a SoftmaxEpsilonRule, got float"):
        FunctionalRules(0.1, PseudoIdentityRule())
    with pytest.raises(TypeError, match="FunctionalRules: activation must be a PseudoIdentityRule, got NoneType"):
        FunctionalRules(AHQKVRule(), None)


PRODUCT_FORMS = {
    "multiply": lambda a, b: torch.multiply(a, b),  # ConvBERT's dynamic convolution
    "Tensor.multiply": lambda a, b: a.multiply(b),
    "mm": lambda a, b: torch.mm(a, b.T),
    "Tensor.mm": lambda a, b: a.mm(b.T),
    "einsum": lambda a, b: torch.einsum("ij,kj->ik", a, b),  # Funnel's, Longformer's attention scores
    "einsum, operands listed": lambda a, b: torch.einsum("ij,kj->ik", [a, b]),
}


@pytest.mark.parametrize("form", sorted(PRODUCT_FORMS))
def test_every_spelling_of_a_product_of_two_activations_gets_the_uniform_rule(form: str):
    """``torch.multiply``, ``mm`` and a two-operand ``einsum`` are products as ``*`` and ``@`` are: each factor gets
    half of the product's gradient (it got all of it, doubling the relevance, with a warning)."""
    a, b = randn(3, 4), randn(3, 4)
    leaves = [t.clone().requires_grad_(True) for t in (a, b)]
    with FunctionalRules(SoftmaxEpsilonRule(), PseudoIdentityRule()):
        z = PRODUCT_FORMS[form](leaves[0] * 1, leaves[1] * 1)
    grads = torch.autograd.grad(z.sum(), leaves)
    plain = torch.autograd.grad(PRODUCT_FORMS[form](*leaves).sum(), leaves)
    torch.testing.assert_close(z, PRODUCT_FORMS[form](a, b))
    for grad, plain_grad in zip(grads, plain, strict=True):
        torch.testing.assert_close(grad, plain_grad / 2)


def test_an_einsum_of_one_activation_or_of_three_operands_is_left_alone():
    """A map linear in its one activation keeps its plain gradient; so does an einsum of three activations (no
    rule covers it, the wrapper names it)."""
    a, b, c = (randn(3, 3).requires_grad_(True) for _ in range(3))
    weight = nn.Parameter(randn(3, 3))
    with FunctionalRules(SoftmaxEpsilonRule(), PseudoIdentityRule()):
        linear = torch.einsum("ij,jk->ik", a * 1, weight)
        triple = torch.einsum("ij,jk,kl->il", a * 1, b * 1, c * 1)
    torch.testing.assert_close(torch.autograd.grad(linear.sum(), a)[0], weight.sum(1).expand(3, 3))
    plain = torch.autograd.grad(torch.einsum("ij,jk,kl->il", a, b, c).sum(), (a, b, c))
    for grad, plain_grad in zip(torch.autograd.grad(triple.sum(), (a, b, c)), plain, strict=True):
        torch.testing.assert_close(grad, plain_grad)


@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
@pytest.mark.parametrize("softmax", [SoftmaxEpsilonRule(0.0), SoftmaxEpsilonRule(0.05), AHQKVRule()])
def test_fused_attention_with_a_query_row_masked_whole_is_unchanged(softmax, mask_kind: str):
    """A left-padded query sees no key: the fused kernel gives it zeros where a softmax gives NaN. Computed unfused
    (softmax ε > 0), its output was NaN and the NaN reached every other row through ``0 · NaN``; the output must be
    the fused call's, bit for bit, and the relevance finite."""
    q, k, v = randn(2, 2, 5, 4), randn(2, 2, 5, 4), randn(2, 2, 5, 4)
    keep = torch.ones(5, 5, dtype=torch.bool).tril()
    keep[:2] = False  # the first two queries are padding: no key at all
    mask = keep if mask_kind == "bool" else torch.zeros(5, 5, dtype=F64).masked_fill(~keep, float("-inf"))
    plain = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    with FunctionalRules(softmax, PseudoIdentityRule()):
        fused = F.scaled_dot_product_attention(*(t * 1 for t in leaves), attn_mask=mask)
    assert torch.equal(fused, plain)
    grads = torch.autograd.grad(fused, leaves, randn(2, 2, 5, 4), allow_unused=True)
    assert all(g is None or torch.isfinite(g).all() for g in grads)
    assert grads[2] is not None and grads[2][:, :, 2:].abs().sum() > 0


DROPOUT_CALLS = {  # a call, and whether it drops
    "F.dropout, training by default": (lambda x: F.dropout(x, 0.5), True),
    "F.dropout, not training": (lambda x: F.dropout(x, 0.5, training=False), False),
    "F.dropout, p = 0": (lambda x: F.dropout(x, 0.0, True), False),
    "F.dropout2d, training": (lambda x: F.dropout2d(x, 0.5, True), True),
    "F.alpha_dropout, not training by default": (lambda x: F.alpha_dropout(x, 0.5), False),
    "F.feature_alpha_dropout, training": (lambda x: F.feature_alpha_dropout(x, 0.5, training=True), True),
    "torch.dropout, training": (lambda x: torch.dropout(x, 0.5, True), True),
    "torch.dropout, not training": (lambda x: torch.dropout(x, 0.5, train=False), False),
}


@pytest.mark.parametrize("call", sorted(DROPOUT_CALLS))
def test_a_dropout_call_that_drops_is_warned_of(call: str):
    """The explanation of a call that drops units is random from call to call, as for a Dropout module in
    training mode; a call that does not drop (not training, ``p = 0``, each function's own default) is not."""
    function, drops = DROPOUT_CALLS[call]
    x = randn(2, 3, 4, 4).requires_grad_(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with FunctionalRules(SoftmaxEpsilonRule(), PseudoIdentityRule()):
            function(x * 1)
    warned = [str(w.message) for w in caught if "calls dropout" in str(w.message)]
    assert bool(warned) == drops, warned


def assert_explained_as(model: nn.Module, reference: nn.Module, x: torch.Tensor, preset: str) -> None:
    """``model`` under ``preset`` (AttnLRP or CP-LRP): its output unchanged, no warning, the relevance of
    ``reference`` (the same function written another way), which conserves the explained logit (no biases)."""
    from tensordict import TensorDict

    from tdhook.attribution import CPLRP, LRP, AttnLRP

    relevance = []
    for module in (model, reference):
        mapper = {"AttnLRP": AttnLRP, "CPLRP": CPLRP}[preset]()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            td = LRP(module, mapper, in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[len(x)]))
        relevance.append(td["relevance", "x"])
        assert torch.equal(td["y"], module(x))
    assert relative_error(relevance[0], relevance[1]) <= 1e-12
    logit = reference(x).max(1).values
    assert ((relevance[0].sum(1) - logit).abs() / logit.abs()).max() <= 1e-9


class Clipped(nn.Module):
    """A linear map, its output clipped to ``[-1, 1]`` by a call (as DBRX and OLMo clip queries, keys and values
    with ``clip_qkv``), then another linear map; ``clip=None``: the module form, ``nn.Hardtanh`` (``nn.ReLU6`` on
    ``6 h``, over 6, with ``relu6``)."""

    def __init__(self, clip: str | None, relu6: bool = False) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 6, bias=False), nn.Linear(6, 3, bias=False)
        self.clip, self.module = clip, nn.ReLU6() if relu6 else nn.Hardtanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        if self.clip is None:
            h = self.module(h * 6.0) / 6.0 if isinstance(self.module, nn.ReLU6) else self.module(h)
        elif self.clip.endswith("_"):  # in place: the result is the same tensor
            getattr(h, self.clip)(min=-1.0, max=1.0)
        else:
            h = CLIP_CALLS[self.clip](h)
        return self.second(h)


CLIP_CALLS = {
    "torch.clamp": lambda h: torch.clamp(h, -1.0, 1.0),
    "Tensor.clamp": lambda h: h.clamp(min=-1.0, max=1.0),
    "torch.clip": lambda h: torch.clip(h, min=-1.0, max=1.0),
    "F.hardtanh": F.hardtanh,
    "F.hardtanh in place": lambda h: F.hardtanh(h, inplace=True),
    "F.relu6": lambda h: F.relu6(h * 6.0) / 6.0,
}


@pytest.mark.parametrize("preset", ["AttnLRP", "CPLRP"])
@pytest.mark.parametrize("clip", [*sorted(CLIP_CALLS), "clamp_", "clip_"])
def test_a_clipping_call_passes_relevance_on_as_the_module_does(clip: str, preset: str):
    """A unit clipped at a bound other than zero has no gradient but a value: the plain gradient lost its relevance
    (a tiny DBRX with ``clip_qkv=0.5``: CP-LRP 8.9 % of the logit off, OLMo 7.7 %, without a warning). A clipping
    call gets the identity rule, as ``nn.Hardtanh`` and ``nn.ReLU6`` do: the same relevance, which conserves."""
    torch.manual_seed(0)
    model = Clipped(clip).double()
    reference = Clipped(None, relu6=clip == "F.relu6").double()
    reference.load_state_dict(model.state_dict())
    x = randn(5, 4) * 3
    assert (model.first(x).abs() > 1).float().mean() > 0.3  # many units clipped
    assert_explained_as(model, reference, x, preset)


class OneSided(nn.Module):
    """A linear map, its output clipped on one side only (at -1 or at 1, not at zero) by ``call``, then another."""

    def __init__(self, call) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 6, bias=False), nn.Linear(6, 3, bias=False)
        self.call = call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.call(self.first(x)))


ONE_SIDED = {
    "Tensor.clamp_min": (lambda h: h.clamp_min(-1.0), "min"),
    "torch.clamp_min": (lambda h: torch.clamp_min(h, -1.0), "min"),
    "Tensor.clamp_min_": (lambda h: h.clamp_min_(-1.0), "min"),
    "torch.clamp_min_": (lambda h: torch.clamp_min_(h, -1.0), "min"),
    "Tensor.clamp_max": (lambda h: h.clamp_max(1.0), "max"),
    "torch.clamp_max": (lambda h: torch.clamp_max(h, 1.0), "max"),
    "Tensor.clamp_max_": (lambda h: h.clamp_max_(1.0), "max"),
    "torch.clip, max only": (lambda h: torch.clip(h, max=1.0), "max"),
}


@pytest.mark.parametrize("preset", ["AttnLRP", "CPLRP"])
@pytest.mark.parametrize("clip", sorted(ONE_SIDED))
def test_a_one_sided_clip_passes_relevance_on_as_clamp_does(clip: str, preset: str):
    """``clamp_min`` and ``clamp_max`` kept their plain gradient (classed piecewise linear), where ``clamp(min=...)``
    gets the identity rule: a unit clipped at a bound other than zero lost its relevance, with no warning (a linear
    map clipped at -1 or 1 then another: the explained logit's relevance 4.2 to 5.4 times the logit off). They get
    the rule of ``clamp`` with the same bound, which conserves."""
    call, side = ONE_SIDED[clip]
    torch.manual_seed(0)
    model = OneSided(call).double()
    reference = OneSided(lambda h: torch.clamp(h, **{side: -1.0 if side == "min" else 1.0})).double()
    reference.load_state_dict(model.state_dict())
    x = randn(5, 4) * 3
    assert (model.first(x).abs() > 1).float().mean() > 0.3  # many units clipped
    assert_explained_as(model, reference, x, preset)


class DividedByNorm(nn.Module):
    """A linear map divided by its norm kept away from zero (a norm written out, as ``F.normalize`` computes it),
    then another linear map."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 6, bias=False), nn.Linear(6, 3, bias=False)
        self.form = form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        if self.form == "F.normalize":
            return self.second(F.normalize(h, dim=-1, eps=1e-6))
        if self.form == "norm.clamp_min":
            return self.second(h / h.norm(dim=-1, keepdim=True).clamp_min(1e-6))
        if self.form == "norm.clamp(min)":
            return self.second(h / torch.clamp(h.norm(dim=-1, keepdim=True), min=1e-6))
        if self.form == "torch.maximum(norm, eps)":
            return self.second(h / torch.maximum(h.norm(dim=-1, keepdim=True), torch.tensor(1e-6, dtype=h.dtype)))
        if self.form == "mean square.clamp_min_":
            return self.second(h / (h.pow(2).mean(-1, keepdim=True) + 1e-14).clamp_min_(1e-12).sqrt())
        return self.second(h / h.square().sum(-1, keepdim=True).clamp_min(1e-12).sqrt())  # "sum of squares.clamp_min"


@pytest.mark.parametrize("preset", ["AttnLRP", "CPLRP"])
@pytest.mark.parametrize(
    "form",
    [
        "F.normalize",
        "norm.clamp_min",
        "norm.clamp(min)",
        "torch.maximum(norm, eps)",
        "mean square.clamp_min_",
        "sum of squares.clamp_min",
    ],
)
def test_a_clip_that_guards_a_divisor_keeps_its_plain_gradient(form: str, preset: str):
    """A norm's clamp away from zero is no activation's clip: where the norm is below the bound, ``h / eps`` is linear
    in ``h`` and its plain gradient is LRP-0. The identity rule there passed relevance into the norm, which takes
    back what ``h`` gets (``clamp(min=eps)`` on the norm: 99 % of the logit lost on inputs of size 1e-8, 85 % off
    gradient × input). Such clamps keep their plain gradient: gradient × input, which conserves."""
    torch.manual_seed(0)
    model, x = DividedByNorm(form).double(), randn(5, 4) * 1e-8
    assert (model.first(x).norm(dim=-1) < 1e-6).all() and (model.first(x).pow(2).sum(-1) < 1e-12).all()  # all clip
    leaf = x.clone().requires_grad_(True)
    logits = model(leaf)
    (grad,) = torch.autograd.grad(logits.max(1).values.sum(), leaf)
    from tensordict import TensorDict

    from tdhook.attribution import CPLRP, LRP, AttnLRP

    lrp = LRP(model, {"AttnLRP": AttnLRP, "CPLRP": CPLRP}[preset](), in_keys=["x"], out_keys=["y"])
    with warnings.catch_warnings():  # the norm held constant in the division (see test_held_statistics.py)
        warnings.simplefilter("error")
        relevance = lrp(TensorDict(x=x.clone(), batch_size=[len(x)]))["relevance", "x"]
    assert relative_error(relevance, x * grad) <= 1e-9
    logit = logits.detach().max(1).values
    assert ((relevance.sum(1) - logit).abs() / logit.abs()).max() <= 1e-9


class Gated(nn.Module):
    """A linear map, a gated linear unit over its output (``F.glu``, ``nn.GLU`` or written out as
    ``a * sigmoid(b)``), another linear map: Speech2Text's convolutional subsampler, Wav2Vec2-Conformer's ``nn.GLU``."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 8, bias=False), nn.Linear(4, 3, bias=False)
        self.form, self.glu = form, nn.GLU(dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        if self.form == "F.glu":
            h = F.glu(h, dim=-1)
        elif self.form == "nn.GLU":
            h = self.glu(h)
        else:
            a, b = h.chunk(2, -1)
            h = a * torch.sigmoid(b)
        return self.second(h)


@pytest.mark.parametrize("preset", ["AttnLRP", "CPLRP"])
@pytest.mark.parametrize("form", ["F.glu", "nn.GLU"])
def test_a_gated_linear_unit_holds_its_gate_as_the_written_out_product_does(form: str, preset: str):
    """``F.glu`` kept its plain gradient, with a warning (a tiny Speech2Text's encoder: CP-LRP 25 % of the output
    off). It gets the rule of ``a * sigmoid(b)`` written out: the sigmoid gate held, ``a`` takes all the relevance,
    which conserves."""
    torch.manual_seed(0)
    model, reference = Gated(form).double(), Gated("written out").double()
    reference.load_state_dict(model.state_dict())
    assert_explained_as(model, reference, randn(5, 4) * 3, preset)


class GeneratedLinear(nn.Module):
    """A hypernetwork's layer: ``F.linear(x, W, b)`` by a weight (and bias) computed from the task input ``z``, or
    the same map written out as the matrix product it is (``written``)."""

    def __init__(self, written: bool, bias: bool) -> None:
        super().__init__()
        self.weights, self.biases = nn.Linear(2, 20, bias=False), nn.Linear(2, 5, bias=False)
        self.head = nn.Linear(5, 3, bias=False)
        self.written, self.bias = written, bias

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        weight = torch.relu(self.weights(z[:1])).view(5, 4)
        bias = self.biases(z[0]) if self.bias else None
        if self.written:
            h = x @ weight.T if bias is None else x @ weight.T + bias
        else:
            h = F.linear(x, weight, bias)
        return self.head(F.relu(h))


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "generated-bias"])
@pytest.mark.parametrize("preset", ["AttnLRP", "CPLRP"])
def test_a_linear_map_by_a_generated_weight_is_the_product_written_out(preset: str, bias: bool):
    # F.linear by a weight computed from another input multiplies two activations: it gets the uniform rule of the
    # written-out ``x @ W.T + b`` (it kept its plain gradient with a warning, which gives both factors all of the
    # product's relevance), and without a bias the relevance of both inputs sums to the logit.
    from tensordict import TensorDict

    from tdhook.attribution import CPLRP, LRP, AttnLRP

    mapper = {"AttnLRP": AttnLRP, "CPLRP": CPLRP}[preset]
    inputs = {"x": randn(3, 4), "z": randn(3, 2)}

    def explain(written: bool) -> TensorDict:
        torch.manual_seed(0)
        model = GeneratedLinear(written, bias).double()
        lrp = LRP(model, mapper(stabilizer=1e-15), in_keys=["x", "z"], out_keys=["y"])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with lrp:
                return [lrp(TensorDict(inputs, batch_size=[3])) for _ in range(2)]

    expected = explain(written=True)[0]
    for td in explain(written=False):
        for key in ("x", "z"):
            assert relative_error(td["relevance", key], expected["relevance", key]) <= 1e-12
    if not bias:
        total = expected["relevance", "x"].sum() + expected["relevance", "z"].sum()
        torch.testing.assert_close(total, expected["y"].max(-1).values.sum(), rtol=1e-9, atol=1e-12)
