"""Input gradients without a forward pass, against autograd's, in float64."""

import itertools

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import LRP, EpsilonAlpha2Beta1, EpsilonGammaBox, EpsilonPlus, EpsilonPlusFlat
from tdhook.attribution.rules import _input_gradients as input_gradients
from tdhook.attribution.rules import redirect
from tdhook.attribution.rules._input_gradients import (
    direct_input_gradient,
    direct_input_gradients,
    has_direct_input_gradient,
    phase_stacked_input_gradient,
    shifted_input_gradient,
)


def autograd_input_gradient(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A random output gradient of ``module`` at ``x`` and the input gradient autograd computes for it."""
    leaf = x.detach().requires_grad_(True)
    out = module(leaf)
    grad = torch.randn_like(out)
    return grad, torch.autograd.grad(out, leaf, grad)[0]


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


# kernel, stride, padding, input size: odd and even sizes, sizes the stride does not divide, padding beyond
# the kernel's half, strides larger than the kernel (positions that receive nothing), unequal height and width.
PHASE_CASES = [
    ((7, 7), (2, 2), (3, 3), (30, 30)),
    ((7, 7), (2, 2), (3, 3), (31, 29)),
    ((3, 3), (2, 2), (1, 1), (15, 16)),
    ((3, 3), (2, 2), (0, 0), (6, 7)),
    ((4, 4), (4, 4), (0, 0), (16, 18)),
    ((11, 11), (4, 4), (2, 2), (35, 37)),
    ((1, 1), (2, 2), (0, 0), (9, 8)),
    ((2, 2), (3, 3), (1, 1), (10, 11)),
    ((5, 3), (2, 1), (2, 0), (13, 9)),
    ((3, 5), (1, 3), (0, 4), (8, 14)),
    ((5, 5), (3, 2), (4, 1), (12, 11)),
]


@pytest.mark.parametrize(("kernel", "stride", "padding", "size"), PHASE_CASES)
@pytest.mark.parametrize("in_channels", [1, 3])
def test_phase_stacked_input_gradient_matches_autograd(kernel, stride, padding, size, in_channels):
    torch.manual_seed(0)
    conv = nn.Conv2d(in_channels, 5, kernel, stride=stride, padding=padding, bias=False).double()
    x = torch.randn(2, in_channels, *size, dtype=torch.float64)
    grad, expected = autograd_input_gradient(conv, x)
    actual = phase_stacked_input_gradient(conv.weight.detach(), grad, x.shape, stride, padding)
    assert_close(actual, expected)
    assert actual.is_contiguous()


# kernel, padding, input size: padding from none to beyond the kernel's half, unequal height and width.
SHIFTED_CASES = [
    ((3, 3), (1, 1), (12, 12)),
    ((3, 3), (0, 0), (9, 11)),
    ((5, 3), (2, 1), (10, 7)),
    ((1, 1), (0, 0), (6, 5)),
    ((2, 4), (1, 3), (8, 9)),
    ((3, 3), (3, 2), (5, 6)),
]


@pytest.mark.parametrize(("kernel", "padding", "size"), SHIFTED_CASES)
@pytest.mark.parametrize("in_channels", [1, 3])
@pytest.mark.parametrize("piece", [1 << 20, 7], ids=["whole batch", "one sample at a time"])
def test_shifted_input_gradient_matches_autograd(kernel, padding, size, in_channels, piece, monkeypatch):
    monkeypatch.setattr(input_gradients, "_SHIFTED_PIECE", piece)
    torch.manual_seed(0)
    conv = nn.Conv2d(in_channels, 5, kernel, padding=padding, bias=False).double()
    x = torch.randn(3, in_channels, *size, dtype=torch.float64)
    grad, expected = autograd_input_gradient(conv, x)
    assert_close(shifted_input_gradient(conv.weight.detach(), grad, x.shape, padding), expected)


def test_first_layers_take_the_few_channel_paths(monkeypatch):
    monkeypatch.setattr(input_gradients, "_MIN_FEW_CHANNEL_GRADIENT", 1)
    taken = []
    for name in ("phase_stacked_input_gradient", "shifted_input_gradient"):
        original = getattr(input_gradients, name)

        def spy(*args, name=name, original=original):
            taken.append(name)
            return original(*args)

        monkeypatch.setattr(input_gradients, name, spy)
    torch.manual_seed(0)
    for conv, path in [
        (nn.Conv2d(3, 16, 7, stride=2, padding=3), "phase_stacked_input_gradient"),
        (nn.Conv2d(3, 16, 3, padding=1), "shifted_input_gradient"),
    ]:
        conv = conv.double()
        x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
        grad, expected = autograd_input_gradient(conv, x)
        assert_close(direct_input_gradient(conv, conv.weight.detach(), grad, x), expected)
        assert taken.pop() == path

    # Many input channels, dilation or groups: torch's own transposed convolution.
    for conv in [
        nn.Conv2d(16, 16, 3, stride=1, padding=1),
        nn.Conv2d(16, 16, 3, stride=2, padding=1),
        nn.Conv2d(3, 16, 3, stride=2, dilation=2),
        nn.Conv2d(4, 16, 3, groups=2),
    ]:
        conv = conv.double()
        x = torch.randn(2, conv.in_channels, 16, 16, dtype=torch.float64)
        grad, expected = autograd_input_gradient(conv, x)
        assert_close(direct_input_gradient(conv, conv.weight.detach(), grad, x), expected)
    assert taken == []

    # Small products: their fixed costs would outweigh the gain.
    monkeypatch.setattr(input_gradients, "_MIN_FEW_CHANNEL_GRADIENT", 1 << 17)
    small = nn.Conv2d(3, 16, 3, padding=1).double()
    x = torch.randn(1, 3, 64, 64, dtype=torch.float64)
    grad, expected = autograd_input_gradient(small, x)
    assert_close(direct_input_gradient(small, small.weight.detach(), grad, x), expected)
    assert taken == []
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    grad, expected = autograd_input_gradient(small, x)
    assert_close(direct_input_gradient(small, small.weight.detach(), grad, x), expected)
    assert taken == ["shifted_input_gradient"]


@pytest.mark.parametrize("stride", [1, 2])
def test_batched_gradients_take_torchs_product(stride, monkeypatch):
    # With is_grads_batched (vectorized Jacobians) a rule's backward runs under vmap, where the few-channel
    # paths would fail: their views and in-place sums have no batching rule.
    monkeypatch.setattr(input_gradients, "_MIN_FEW_CHANNEL_GRADIENT", 1)
    torch.manual_seed(0)
    stem = nn.Conv2d(3, 8, 3, stride=stride, padding=1).double()
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64, requires_grad=True)
    out = redirect(stem(x), [x], lambda grad: [direct_input_gradient(stem, stem.weight.detach(), grad, x.shape)])
    grads = torch.randn(4, *out.shape, dtype=torch.float64)
    batched = torch.autograd.grad(out, x, grads, is_grads_batched=True, retain_graph=True)[0]
    one_by_one = torch.stack([torch.autograd.grad(out, x, grad, retain_graph=True)[0] for grad in grads])
    assert_close(batched, one_by_one)


@pytest.mark.parametrize(("kernel", "padding"), [(1, 0), (3, 2)], ids=["1x1", "a tap covering the input"])
def test_shifted_sums_under_autograd(kernel, padding, monkeypatch):
    # With a weight that requires grad, the product is recorded by autograd; a tap covering the whole input
    # must not be assigned back into the result (an in-place error on a leaf view).
    monkeypatch.setattr(input_gradients, "_MIN_FEW_CHANNEL_GRADIENT", 1)
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 8, kernel, padding=padding).double()
    x = torch.randn(2, 3, 10, 10, dtype=torch.float64)
    grad, expected = autograd_input_gradient(conv, x)
    result = shifted_input_gradient(conv.weight, grad, x.shape, conv.padding)
    assert_close(result.detach(), expected)
    # The same product as a transposed convolution (stride 1: it has the input's size), differentiated too.
    reference = torch.nn.functional.conv_transpose2d(grad, conv.weight, padding=padding)
    weights = torch.randn_like(expected)
    (weight_grad,) = torch.autograd.grad((result * weights).sum(), conv.weight)
    (expected_weight_grad,) = torch.autograd.grad((reference * weights).sum(), conv.weight)
    assert_close(weight_grad, expected_weight_grad)


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize(
    ("grad_dtype", "weight_dtype"),
    [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)],
)
def test_half_precisions_and_mixed_dtypes_take_torchs_product(stride, grad_dtype, weight_dtype, monkeypatch):
    # Mixed dtypes are what autocast leaves; half precisions would lose accuracy in the shifted sums.
    monkeypatch.setattr(input_gradients, "_MIN_FEW_CHANNEL_GRADIENT", 1)
    torch.manual_seed(0)
    stem = nn.Conv2d(3, 8, 3, stride=stride, padding=1)
    weight = stem.weight.detach().to(weight_dtype)
    grad = torch.randn(2, 8, 16 // stride, 16 // stride).to(grad_dtype)
    x = torch.empty(2, 3, 16, 16, dtype=grad_dtype)
    expected = torch.ops.aten.convolution_backward(
        grad,
        x,
        weight.to(grad_dtype),
        None,
        stem.stride,
        stem.padding,
        stem.dilation,
        False,
        [0, 0],
        1,
        [True, False, False],
    )[0]
    result = direct_input_gradient(stem, weight, grad, x)
    assert result.dtype == grad_dtype
    assert torch.equal(result, expected)


@pytest.mark.parametrize("stride", [1, 2])
def test_few_channel_paths_ignore_autocast(stride, monkeypatch):
    monkeypatch.setattr(input_gradients, "_MIN_FEW_CHANNEL_GRADIENT", 1)
    stem = nn.Conv2d(3, 8, 3, stride=stride, padding=1)
    grad = torch.randn(1, 8, 32 // stride, 32 // stride)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        result = direct_input_gradient(stem, stem.weight.detach(), grad, (1, 3, 32, 32))
    assert result.dtype == torch.float32
    assert torch.equal(result, direct_input_gradient(stem, stem.weight.detach(), grad, (1, 3, 32, 32)))


@pytest.mark.parametrize(
    "module",
    [
        nn.Linear(6, 4),
        nn.Conv1d(3, 4, 3, stride=2, padding=1),
        nn.Conv2d(4, 6, 3, padding=1, groups=2),
        nn.Conv3d(2, 3, 2, stride=(1, 2, 1)),
        nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1, output_padding=1),
        nn.ConvTranspose1d(2, 3, 3, stride=2, output_padding=2, dilation=3),
    ],
    ids=lambda m: type(m).__name__,
)
@pytest.mark.parametrize("batched", [True, False])
def test_direct_input_gradient_matches_autograd(module, batched):
    torch.manual_seed(0)
    module = module.double()
    features = (6,) if isinstance(module, nn.Linear) else (module.in_channels, *[9] * len(module.kernel_size))
    x = torch.randn(*((2,) if batched else ()), *features, dtype=torch.float64)
    grad, expected = autograd_input_gradient(module, x)
    assert has_direct_input_gradient(module)
    assert_close(direct_input_gradient(module, module.weight.detach(), grad, x), expected)
    assert_close(direct_input_gradient(module, module.weight.detach(), grad, x.shape), expected)


@pytest.mark.parametrize("module", [nn.Linear(5, 3), nn.Conv2d(3, 4, 7, stride=2, padding=3)], ids=["linear", "stem"])
def test_stacked_products_equal_separate_ones(module):
    torch.manual_seed(0)
    module = module.double()
    x = torch.randn(2, 5, dtype=torch.float64) if isinstance(module, nn.Linear) else torch.randn(2, 3, 20, 20).double()
    grad, _ = autograd_input_gradient(module, x)
    weights = [module.weight.detach(), module.weight.detach().clamp(min=0), torch.randn_like(module.weight)]
    for stacked, weight in itertools.zip_longest(direct_input_gradients(module, weights, grad, x), weights):
        assert_close(stacked, direct_input_gradient(module, weight, grad, x))


def test_only_zero_padded_convolutions_and_linear_layers_are_handled():
    assert not has_direct_input_gradient(nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"))
    assert not has_direct_input_gradient(nn.Conv2d(3, 4, 3, padding="same"))
    assert not has_direct_input_gradient(nn.Bilinear(2, 2, 2))


@pytest.mark.parametrize("onednn", [True, False], ids=["oneDNN", "no oneDNN"])
@pytest.mark.parametrize(
    "preset",
    [EpsilonPlus(), EpsilonPlusFlat(), EpsilonGammaBox(-3.0, 3.0), EpsilonAlpha2Beta1()],
    ids=lambda preset: type(preset).__name__,
)
@pytest.mark.parametrize(
    "layers",
    [
        lambda: [nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2, padding=1)],
        lambda: [nn.ConvTranspose2d(3, 8, 3), nn.ReLU(), nn.ConvTranspose2d(8, 8, 3, stride=2)],
        lambda: [nn.Conv2d(4, 8, 3, groups=2), nn.ReLU(), nn.Conv2d(8, 8, 3, groups=8)],
    ],
    ids=["conv", "transposed", "grouped"],
)
def test_presets_under_bfloat16_autocast_follow_float32(layers, preset, onednn):
    # Autocast leaves bfloat16 gradients beside float32 weights. torch's CPU convolution kernels without oneDNN
    # (CPUs without AVX512-BF16, or oneDNN switched off) refuse mixed dtypes; the products must not mix them.
    torch.manual_seed(0)
    stem = layers()
    net = nn.Sequential(*stem, nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 4))
    x = torch.rand(2, stem[0].in_channels, 12, 12)
    lrp = LRP(TensorDictModule(net, in_keys=["x"], out_keys=["y"]), rule_mapper=preset)
    with torch.backends.mkldnn.flags(enabled=onednn):
        expected = lrp(TensorDict(x=x, batch_size=[2]))["relevance", "x"]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            result = lrp(TensorDict(x=x, batch_size=[2]))["relevance", "x"]
    assert result.shape == x.shape and torch.isfinite(result).all()
    # bfloat16 keeps 8 bits of mantissa: the maps agree in direction, not in the last digits.
    assert torch.cosine_similarity(result.flatten().double(), expected.flatten().double(), dim=0) > 0.99
