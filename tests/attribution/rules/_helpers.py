"""What the rule tests share: layers in float64, random output relevance, the rule pairs (tdhook, zennit), a spy, and
the checks every rule with a direct (autograd-free) path passes."""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import nn
from zennit import rules as zrules

from tdhook.attribution import LRP
from tdhook.attribution.mappers.presets import EpsilonAlpha2Beta1, EpsilonGammaBox, EpsilonPlus, EpsilonPlusFlat
from tdhook.attribution.rules.basic import EpsilonRule
from tdhook.attribution.rules.input_layer import FlatRule, WSquareRule, ZBoxRule
from tdhook.attribution.rules.modified import AlphaBetaRule, GammaRule
from tests.conftest import relative_error, tdhook_relevance, zennit_relevance

TOL = 1e-6
F64 = torch.float64


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=F64)


def make_layer(kind: str) -> tuple[nn.Module, torch.Tensor]:
    layers = {
        "linear": (nn.Linear(6, 5), (4, 6)),
        "conv1d": (nn.Conv1d(3, 4, 3, padding=1), (2, 3, 9)),
        "conv2d": (nn.Conv2d(3, 4, 3, stride=2, padding=1), (2, 3, 7, 7)),
        "conv3d": (nn.Conv3d(2, 3, 3, padding=1), (2, 2, 4, 4, 4)),
        "convtranspose1d": (nn.ConvTranspose1d(3, 4, 3, stride=2, padding=1), (2, 3, 6)),
        "convtranspose2d": (nn.ConvTranspose2d(3, 2, 3, stride=2), (2, 3, 4, 4)),
        "convtranspose3d": (nn.ConvTranspose3d(2, 3, 3, stride=2, padding=1), (2, 2, 3, 3, 3)),
    }
    layer, shape = layers[kind]
    layer = layer.double()
    with torch.no_grad():
        layer.bias.normal_()
    return layer, torch.randn(shape, dtype=torch.float64)


def output_relevance(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.randn_like(layer(x))


LAYERS = ["linear", "conv1d", "conv2d", "conv3d", "convtranspose1d", "convtranspose2d", "convtranspose3d"]

RULE_PAIRS = {
    "epsilon": (lambda: EpsilonRule(1e-6), lambda: zrules.Epsilon(1e-6)),
    "epsilon-large": (lambda: EpsilonRule(0.5), lambda: zrules.Epsilon(0.5)),
    "zplus": (lambda: AlphaBetaRule(1.0, 0.0), lambda: zrules.ZPlus()),
    "alpha2beta1": (lambda: AlphaBetaRule(2.0, 1.0), lambda: zrules.AlphaBeta(2.0, 1.0)),
    "alpha1beta0": (lambda: AlphaBetaRule(1.0, 0.0), lambda: zrules.AlphaBeta(1.0, 0.0)),
    "gamma": (lambda: GammaRule(0.25), lambda: zrules.Gamma(0.25)),
    "gamma-nobias": (lambda: GammaRule(1.0, zero_params=["bias"]), lambda: zrules.Gamma(1.0, zero_params=["bias"])),
    "flat": (lambda: FlatRule(), lambda: zrules.Flat()),
    "wsquare": (lambda: WSquareRule(), lambda: zrules.WSquare()),
    "zbox": (lambda: ZBoxRule(-2.5, 2.5), lambda: zrules.ZBox(-2.5, 2.5)),
}

# The CNN presets, each a factory of keyword options (ZBox bounds: inputs inside [-3, 3]).
CNN_PRESETS = {
    "EpsilonPlus": lambda **options: EpsilonPlus(**options),
    "EpsilonPlusFlat": lambda **options: EpsilonPlusFlat(**options),
    "EpsilonGammaBox": lambda **options: EpsilonGammaBox(-3.0, 3.0, **options),
    "EpsilonAlpha2Beta1": lambda **options: EpsilonAlpha2Beta1(**options),
}


def spy(monkeypatch, cls: type, name: str) -> list:
    """Record the calls of ``cls.name`` (it still runs)."""
    calls, method = [], getattr(cls, name)

    def recorded(*args, **kwargs):
        calls.append(args)
        return method(*args, **kwargs)

    monkeypatch.setattr(cls, name, recorded)
    return calls


def assert_rule_matches_zennit(rule_name: str, kind: str) -> None:
    """The rule ``rule_name`` of :data:`RULE_PAIRS` on the layer ``kind`` gives zennit's relevance, in its shape."""
    ours, theirs = RULE_PAIRS[rule_name]
    layer, x = make_layer(kind)
    r_out = output_relevance(layer, x)
    expected = zennit_relevance(theirs(), layer, x, r_out)
    actual = tdhook_relevance(ours(), layer, x, r_out)
    assert actual.shape == x.shape
    assert relative_error(actual, expected) <= TOL


def assert_an_expanded_output_gradient_gives_the_contiguous_result(rule_name: str) -> None:
    # out.sum() sends back an expanded gradient: the element-wise work then runs on whole tensors.
    layer, x = make_layer("conv2d")
    x = x.clamp(min=0)

    def relevance(expanded: bool) -> torch.Tensor:
        rule, leaf = RULE_PAIRS[rule_name][0](), x.clone().requires_grad_(True)
        with rule.register(layer) as handle:
            out = layer(leaf)
            grad_out = torch.ones(()).double().expand_as(out) if expanded else torch.ones_like(out)
            assert grad_out.is_contiguous() != expanded
            grad = torch.autograd.grad(out, leaf, grad_out)[0]
            return leaf.detach() * grad + sum(rest for _, rest in handle.pop_records())

    torch.testing.assert_close(relevance(expanded=True), relevance(expanded=False), rtol=1e-12, atol=1e-14)


def assert_an_unbatched_input_gives_the_batched_result(rule_name: str, kind: str) -> None:
    layer, x = make_layer(kind)
    x = x.clamp(min=0)  # the z⁺ and γ paths without a forward pass for x⁻
    sample = x[1] if kind == "conv2d" else x[1, :]
    r_out = output_relevance(layer, x)
    batched = tdhook_relevance(RULE_PAIRS[rule_name][0](), layer, x, r_out)
    rule = RULE_PAIRS[rule_name][0]()
    lrp = LRP(
        layer,
        rule_mapper=lambda n, m: rule if m is layer else None,
        in_keys=["x"],
        out_keys=["y"],
        target=lambda y: r_out[1],
    )
    single = lrp(TensorDict(x=sample.clone()))["relevance", "x"]
    assert relative_error(single, batched[1]) <= 1e-12


def assert_repeated_backward_over_one_forward_gives_the_same_gradient(rule_name: str) -> None:
    # A backward that frees the graph may write into what the rule saved; one that keeps it must not.
    rule = RULE_PAIRS[rule_name.removesuffix("-positive-outputs")][0]()
    layer, x = make_layer("conv2d")
    x = x.clamp(min=0).requires_grad_(True)
    with rule.register(layer):
        out = layer(x)
        grad = torch.randn_like(out)
        if rule_name.endswith("-positive-outputs"):
            grad = grad * (out > 0)
        first = torch.autograd.grad(out, x, grad, retain_graph=True)[0]
        second = torch.autograd.grad(out, x, grad, retain_graph=True)[0]
        last = torch.autograd.grad(out, x, grad)[0]
    assert torch.equal(first, second)
    assert torch.equal(first, last)


def assert_vectorized_jacobian_equals_the_unit_by_unit_one(rule_name: str) -> None:
    # Batched gradients (is_grads_batched) must not be written into the rule's saved tensors.
    net = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)).double()
    x = torch.randn(2, 4, dtype=torch.float64)
    rule, second = RULE_PAIRS[rule_name.removesuffix("-after-relu")][0](), EpsilonRule()
    if rule_name.endswith("-after-relu"):  # the γ paths for inputs x ≥ 0
        rule, second = second, rule
    with rule.register(net[0]), second.register(net[2]):
        vectorized = torch.autograd.functional.jacobian(net, x, vectorize=True)
        unit_by_unit = torch.autograd.functional.jacobian(net, x)
    assert torch.allclose(vectorized, unit_by_unit, rtol=1e-12, atol=1e-14)


def assert_transposed_convolution_with_output_padding_past_the_stride_matches_zennit(rule_name: str) -> None:
    # Its transposed product runs past the input's end; the direct paths keep the input's positions.
    layer = nn.ConvTranspose1d(2, 3, 3, stride=1, dilation=2, output_padding=1).double()
    x = torch.randn(2, 2, 6, dtype=torch.float64).abs()
    ours, theirs = RULE_PAIRS[rule_name]
    r_out = output_relevance(layer, x)
    expected = zennit_relevance(theirs(), layer, x, r_out)
    assert relative_error(tdhook_relevance(ours(), layer, x, r_out), expected) <= TOL
