"""Relevance does not depend on how tensors are laid out in memory (float64, against zennit and exact identities).

A tensor's values say nothing of its strides: a channels-last image, a slice taken with a step, one sample expanded
to a batch (stride 0), an ``as_strided`` window or a view of a larger tensor hold the same numbers as their
contiguous copies, and their relevance must be the contiguous copy's. The rules' direct paths read tensors as flat
memory where they can; these tests feed them every layout, in the model (``model.to(memory_format=...)``), at its
inputs, in the incoming relevance and inside its forward (``permute``, ``unfold``, ``pixel_shuffle``, ...), and
check that the caller's tensors are left as they were.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
import torchvision
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from zennit import composites as zcomposites
from zennit.canonizers import SequentialMergeBatchNorm
from zennit.torchvision import ResNetCanonizer, VGGCanonizer

from tdhook.attribution import LRP
from tdhook.attribution.mappers.presets import EpsilonAlpha2Beta1, EpsilonGammaBox, EpsilonPlus
from tdhook.attribution.rules import _input_gradients as input_gradients
from tdhook.attribution.rules.basic import EpsilonRule
from tests.attribution.rules._helpers import RULE_PAIRS, make_layer, output_relevance
from tests.attribution.test_lrp_vision import assert_unchanged, image, snapshot
from tests.conftest import relative_error, zennit_model_relevance, zennit_relevance

F64 = torch.float64

PRESETS = {
    "EpsilonPlus": (lambda: EpsilonPlus(stabilize_additions=True), zcomposites.EpsilonPlus),
    "EpsilonGammaBox": (
        lambda: EpsilonGammaBox(-3.0, 3.0, stabilize_additions=True),
        lambda: zcomposites.EpsilonGammaBox(low=-3.0, high=3.0),
    ),
    "EpsilonAlpha2Beta1": (lambda: EpsilonAlpha2Beta1(stabilize_additions=True), zcomposites.EpsilonAlpha2Beta1),
}


def take_few_channel_products(monkeypatch) -> None:
    """The first layers' products take their few-channel paths (stride phases, shifted sums), which index the
    gradient's memory, at these small sizes too (a plain Conv2d of few input channels only)."""
    monkeypatch.setattr(input_gradients, "_MIN_FEW_CHANNEL_GRADIENT", 1)


# The layers under test: a Conv2d of three input channels twice, with torch's products and with the few-channel ones.
KINDS = ["linear", "conv2d", "conv2d-few-channel", "conv3d", "convtranspose2d"]


def layer_of(kind: str, monkeypatch) -> tuple[nn.Module, torch.Tensor]:
    if kind.endswith("-few-channel"):
        take_few_channel_products(monkeypatch)
    return make_layer(kind.removesuffix("-few-channel"))


def channels_last(x: torch.Tensor) -> torch.Tensor:
    """``x`` in channels-last order (``channels_last_3d`` for a volume)."""
    return x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)


def _reversed(x: torch.Tensor) -> torch.Tensor:
    order = list(range(x.dim()))[::-1]
    return x.permute(*order).contiguous().permute(*order)


def _every_other(x: torch.Tensor) -> torch.Tensor:
    wide = x.new_zeros(*x.shape[:-1], 2 * x.shape[-1])
    wide[..., ::2] = x
    return wide[..., ::2]


def _inside_larger(x: torch.Tensor) -> torch.Tensor:
    larger = x.new_zeros(len(x) + 1, *x.shape[1:])
    larger[1:] = x
    return larger[1:]


def _as_strided(x: torch.Tensor) -> torch.Tensor:
    strides, step = [], 3  # every third element of a flat buffer, from an offset
    for size in reversed(x.shape):
        strides.insert(0, step)
        step *= size
    window = x.new_zeros(3 * x.numel() + 1).as_strided(x.shape, strides, 1)
    return window.copy_(x)


# The same values in other memory layouts: each a function of a contiguous tensor.
LAYOUTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "channels-last": lambda x: channels_last(x) if x.dim() in (4, 5) else x.t().contiguous().t(),
    "reversed-strides": _reversed,
    "every-other-column": _every_other,
    "view-of-a-larger-tensor": _inside_larger,
    "as-strided": _as_strided,
    "one-sample-expanded": lambda x: x[:1].expand_as(x),
}


def dense(layout: str, x: torch.Tensor) -> torch.Tensor:
    """The contiguous tensor with the values that ``LAYOUTS[layout]`` gives for ``x``."""
    return LAYOUTS[layout](x).contiguous()


def assert_untouched(x: torch.Tensor, version: int, values: torch.Tensor, strides: tuple[int, ...]) -> None:
    assert x._version == version
    assert x.stride() == strides
    assert torch.equal(x, values)


def layer_relevance(layer: nn.Module, rule, x: torch.Tensor, relevance_out: torch.Tensor, **options) -> torch.Tensor:
    """tdhook's relevance of ``layer``'s input ``x``, handed to the wrapper as it is (no copy)."""
    lrp = LRP(
        layer,
        rule_mapper=lambda name, module: rule if module is layer else None,
        in_keys=["x"],
        out_keys=["y"],
        target=lambda y: relevance_out,
        **options,
    )
    return lrp(TensorDict(x=x, batch_size=[x.shape[0]]))["relevance", "x"]


# The rules that read their input or their incoming gradient on a direct (non-autograd) path.
LAYER_RULES = ["epsilon", "zplus", "alpha2beta1", "gamma", "flat", "wsquare", "zbox"]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("rule_name", LAYER_RULES)
@pytest.mark.parametrize("kind", KINDS)
def test_a_layer_input_in_any_layout_gets_zennits_relevance(kind: str, rule_name: str, layout: str, monkeypatch):
    ours, theirs = RULE_PAIRS[rule_name]
    layer, x = layer_of(kind, monkeypatch)
    strided = LAYOUTS[layout](x)
    relevance_out = output_relevance(layer, dense(layout, x))
    expected = zennit_relevance(theirs(), layer, dense(layout, x), relevance_out)
    state = strided._version, strided.clone(), strided.stride()

    actual = layer_relevance(layer, ours(), strided, relevance_out)
    assert relative_error(actual, expected) <= 1e-10
    assert_untouched(strided, *state)


@pytest.mark.parametrize("rule_name", LAYER_RULES)
@pytest.mark.parametrize("kind", ["conv2d", "conv2d-few-channel", "conv3d", "convtranspose2d"])
def test_a_channels_last_layer_gets_zennits_relevance(kind: str, rule_name: str, monkeypatch):
    # Weights, inputs and the incoming relevance all channels-last: the products and their gradients come back so.
    ours, theirs = RULE_PAIRS[rule_name]
    layer, x = layer_of(kind, monkeypatch)
    relevance_out = output_relevance(layer, x)
    expected = zennit_relevance(theirs(), layer, x, relevance_out)
    converted = copy.deepcopy(layer).to(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
    actual = layer_relevance(converted, ours(), channels_last(x), channels_last(relevance_out))
    assert relative_error(actual, expected) <= 1e-10


def _expanded_sample(r: torch.Tensor) -> torch.Tensor:
    return r[:1].expand_as(r)


def _expanded_number(r: torch.Tensor) -> torch.Tensor:
    return r.reshape(-1)[:1].reshape([1] * r.dim()).expand_as(r)


@pytest.mark.parametrize("create_graph", [False, True], ids=["plain", "create_graph"])
@pytest.mark.parametrize(
    "relevance_layout",
    [_expanded_sample, _expanded_number, _reversed, _every_other],
    ids=["one-sample-expanded", "one-number-expanded", "reversed-strides", "every-other-column"],
)
@pytest.mark.parametrize("rule_name", LAYER_RULES)
@pytest.mark.parametrize("kind", ["linear", "conv2d-few-channel", "convtranspose2d"])
def test_an_incoming_relevance_in_any_layout_gets_zennits_relevance(
    kind: str, rule_name: str, relevance_layout, create_graph: bool, monkeypatch
):
    # A sum or mean after the layer hands it a gradient of stride 0; the direct paths write their shares with
    # ``out=`` and must not write into (or read as flat memory) such a gradient.
    ours, theirs = RULE_PAIRS[rule_name]
    layer, x = layer_of(kind, monkeypatch)
    relevance_out = relevance_layout(output_relevance(layer, x))
    expected = zennit_relevance(theirs(), layer, x, relevance_out.contiguous())
    state = relevance_out._version, relevance_out.clone(), relevance_out.stride()

    actual = layer_relevance(layer, ours(), x.clone(), relevance_out, create_graph=create_graph)
    assert relative_error(actual.detach(), expected) <= 1e-10
    assert_untouched(relevance_out, *state)


def calibrated(model: nn.Module, batches: int = 3) -> nn.Module:
    """``model`` in float64 with BatchNorm statistics taken from a few random batches in training mode, then in
    evaluation mode with ``eps = 0`` (zennit's merge leaves ``x / sqrt(1 + eps)`` behind; tdhook keeps the model's
    function: with ``eps = 0`` both compute the same)."""
    model = model.to(F64)
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for norm in norms:
        norm.momentum = None  # the running statistics are the average over the batches
    generator = torch.Generator().manual_seed(3)
    model.train()
    with torch.no_grad():
        for _ in range(batches):
            model(torch.randn(4, *SAMPLE_SHAPES[type(model)], generator=generator, dtype=F64))
    for norm in norms:
        norm.eps = 0.0
    return model.eval()


class SmallVolumeNet(nn.Sequential):
    """Conv3d and BatchNorm3d, for channels_last_3d."""

    def __init__(self) -> None:
        super().__init__(
            nn.Conv3d(3, 6, 3, padding=1),
            nn.BatchNorm3d(6),
            nn.ReLU(),
            nn.Conv3d(6, 8, 3, stride=2, padding=1),
            nn.BatchNorm3d(8),
            nn.ReLU(),
            nn.AdaptiveAvgPool3d(1),
            nn.Flatten(),
            nn.Linear(8, 5),
        )


SAMPLE_SHAPES = {
    torchvision.models.ResNet: (3, 32, 32),
    torchvision.models.VGG: (3, 32, 32),
    SmallVolumeNet: (3, 6, 6, 6),
}


def _model(name: str) -> tuple[nn.Module, Callable[[], object]]:
    """The calibrated model ``name`` (the same values at every call: built from one seed), and its zennit canonizer.

    Built for each test rather than kept for the file and copied: vgg11_bn holds 1 GiB of float64 parameters, which
    a kept copy doubles at the peak of its test."""
    torch.manual_seed(0)
    if name == "resnet18":
        return calibrated(torchvision.models.resnet18(weights=None, num_classes=10)), ResNetCanonizer
    if name == "vgg11_bn":
        return calibrated(torchvision.models.vgg11_bn(weights=None, num_classes=10)), VGGCanonizer
    return calibrated(SmallVolumeNet()), SequentialMergeBatchNorm


@pytest.mark.parametrize(
    ("model_name", "preset", "convert_model", "convert_input", "few_channel"),
    [
        *[("resnet18", preset, True, True, False) for preset in sorted(PRESETS)],
        ("resnet18", "EpsilonGammaBox", True, False, True),
        ("resnet18", "EpsilonAlpha2Beta1", False, True, True),
        ("vgg11_bn", "EpsilonGammaBox", True, True, True),
        *[("volume", preset, True, True, False) for preset in sorted(PRESETS)],
    ],
)
def test_a_channels_last_model_matches_zennit(
    model_name: str, preset: str, convert_model: bool, convert_input: bool, few_channel: bool, monkeypatch
):
    if few_channel:
        take_few_channel_products(monkeypatch)
    model, canonizer = _model(model_name)
    ours, theirs = PRESETS[preset]
    x = image() if model_name != "volume" else torch.randn(2, 3, 6, 6, 6, dtype=F64)
    expected = zennit_model_relevance(theirs(), copy.deepcopy(model), x, canonizers=[canonizer()])

    if convert_model:
        model.to(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
    given = channels_last(x) if convert_input else x.clone()
    before, strides = snapshot(model), {k: v.stride() for k, v in model.state_dict().items()}
    state = given._version, given.clone(), given.stride()
    with LRP(model, rule_mapper=ours(), in_keys=["image"], out_keys=["logits"]) as lrp:
        # Later calls in one context reuse what the first kept: inputs in other layouts must not notice.
        for layout in (None, "every-other-column", None):
            value = given if layout is None else LAYOUTS[layout](x)
            relevance = lrp(TensorDict(image=value, batch_size=[2]))["relevance", "image"]
            assert relative_error(relevance, expected) <= 1e-10, layout
    assert_unchanged(model, before)
    assert {k: v.stride() for k, v in model.state_dict().items()} == strides  # channels-last kept so
    assert_untouched(given, *state)


class Step(nn.Module):
    """A function of the activations between layers, with no parameters of its own."""

    def __init__(self, function: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.function = function

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function(x)


def _windows(t: torch.Tensor, size: int, step: int) -> torch.Tensor:
    """``size × size`` windows ``step`` apart over each channel of the contiguous ``(N, 8, 6, 6)`` tensor ``t``."""
    count = (6 - size) // step + 1
    return torch.as_strided(t.contiguous(), (len(t), 8, count, count, size, size), (288, 36, 6 * step, step, 6, 1))


def layout_networks() -> dict[str, nn.Module]:
    """Small CNNs over ``(N, 3, 6, 6)`` whose forward moves memory around between layers."""
    torch.manual_seed(0)

    def stem() -> nn.Module:
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())

    def conv(c_in: int) -> nn.Module:
        return nn.Conv2d(c_in, 4, 3, padding=1)

    flat = (nn.Flatten(), nn.Linear(4 * 36, 5))
    networks = {
        "permute-contiguous-view": (Step(lambda t: t.permute(0, 2, 3, 1).contiguous().view(len(t), -1)),),
        "permute-reshape": (Step(lambda t: t.permute(0, 2, 3, 1).reshape(len(t), -1)),),
        "linear-over-channels-transposed": (
            Step(lambda t: t.flatten(2).transpose(1, 2)),
            nn.Linear(8, 4),
            Step(lambda t: t.transpose(1, 2).flatten(1)),
        ),
        "movedim-linear-swapaxes": (
            Step(lambda t: t.movedim(1, -1)),
            nn.Linear(8, 4),
            Step(lambda t: t.swapaxes(1, 3).swapaxes(2, 3)),
            conv(4),
        ),
        "channels-last-copy": (Step(channels_last), conv(8)),
        "pixel-shuffle-unshuffle": (nn.PixelShuffle(2), conv(2), nn.ReLU(), nn.PixelUnshuffle(2), nn.Conv2d(16, 4, 1)),
        "unfold-linear-fold": (
            Step(lambda t: F.unfold(t, 2, stride=2).transpose(1, 2)),
            nn.Linear(32, 32),
            Step(lambda t: F.fold(t.transpose(1, 2), (6, 6), 2, stride=2)),
            conv(8),
        ),
        "tensor-unfold": (Step(lambda t: t.unfold(3, 3, 3).flatten(1)),),
        "as-strided-windows": (Step(lambda t: _windows(t, 2, 2).flatten(1)),),
        "overlapping-as-strided-windows": (Step(lambda t: _windows(t, 2, 1).flatten(1)),),
        "strided-slice": (Step(lambda t: t[:, ::2, ::2, 1::2]), nn.Conv2d(4, 4, 3, padding=1)),
        "channel-expanded": (Step(lambda t: t[:, :1].expand(-1, 8, -1, -1)), conv(8)),
        "output-permuted": (nn.Conv2d(8, 5, 6), Step(lambda t: t.permute(0, 2, 3, 1).flatten(1))),
    }
    heads = {  # the last layer's input width where the network ends in the flattening head
        "permute-contiguous-view": nn.Linear(288, 5),
        "permute-reshape": nn.Linear(288, 5),
        "linear-over-channels-transposed": nn.Linear(144, 5),
        "tensor-unfold": nn.Linear(288, 5),
        "as-strided-windows": nn.Linear(8 * 9 * 4, 5),
        "overlapping-as-strided-windows": nn.Linear(8 * 25 * 4, 5),
    }
    built = {}
    for name, middle in networks.items():
        tail = (heads[name],) if name in heads else () if name == "output-permuted" else flat
        if name == "strided-slice":
            tail = (nn.Flatten(), nn.Linear(36, 5))
        built[name] = nn.Sequential(stem(), *middle, *tail).to(F64)
    return built


NETWORKS = layout_networks()


def gradient_times_input(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x · ∂y_k/∂x`` for the argmax logit ``y_k``: LRP-0 of a ReLU network."""
    x = x.detach().clone().requires_grad_(True)
    y = model(x)
    (gradient,) = torch.autograd.grad(y, x, torch.zeros_like(y).scatter_(1, y.argmax(1, keepdim=True), 1.0))
    return gradient * x.detach()


def images() -> torch.Tensor:
    return torch.randn(3, 3, 6, 6, generator=torch.Generator().manual_seed(4), dtype=F64)


@pytest.mark.parametrize("layout", [None, "channels-last", "every-other-column"])
@pytest.mark.parametrize("network", sorted(NETWORKS))
def test_layout_changes_in_the_forward_keep_lrp0_equal_to_gradient_times_input(network: str, layout: str | None):
    model = NETWORKS[network]
    x = images()
    given = x.clone() if layout is None else LAYOUTS[layout](x)
    expected = gradient_times_input(model, x)
    with torch.no_grad():
        output = model(x)
    rules = {nn.Linear: EpsilonRule(0.0), nn.Conv2d: EpsilonRule(0.0)}
    td = LRP(model, rule_mapper=rules, in_keys=["x"], out_keys=["y"])(TensorDict(x=given, batch_size=[3]))
    assert relative_error(td["relevance", "x"], expected) <= 1e-12
    assert relative_error(td["y"], output) <= 1e-12  # the model's output, unchanged by the rules' backward pass


# zennit passes relevance through the functions between its hooked layers as a gradient: the same as tdhook's
# product rule for functions that only move values (not for a sum or a mean, which zennit would need a canonizer for).
@pytest.mark.parametrize("few_channel", [False, True], ids=["torch-products", "few-channel-products"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("network", sorted(NETWORKS))
def test_layout_changes_in_the_forward_match_zennits_presets(network: str, preset: str, few_channel: bool, monkeypatch):
    if few_channel:
        take_few_channel_products(monkeypatch)
    model = NETWORKS[network]
    ours, theirs = PRESETS[preset]
    x = images()
    expected = zennit_model_relevance(theirs(), model, x, canonizers=[])
    converted = copy.deepcopy(model).to(memory_format=torch.channels_last)
    lrp = LRP(converted, rule_mapper=ours(), in_keys=["x"], out_keys=["y"])
    relevance = lrp(TensorDict(x=channels_last(x), batch_size=[3]))["relevance", "x"]
    assert relative_error(relevance, expected) <= 1e-10


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.a(x) + self.b(y)))


def _pair(make: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], shape: tuple[int, ...]):
    return lambda: make(torch.randn(*shape, generator=torch.Generator().manual_seed(5), dtype=F64))


# Two input keys whose tensors share memory, in ways a TensorDict allows.
SHARED_INPUTS = {
    "one-tensor-under-two-keys": _pair(lambda t: (t, t), (5, 4)),
    "one-key-a-view-of-the-other": _pair(lambda t: (t[:, :4], t), (5, 4)),
    "two-halves-of-one-tensor": _pair(lambda t: (t[:, :4], t[:, 4:]), (5, 8)),
    "interleaved-columns": _pair(lambda t: (t[:, ::2], t[:, 1::2]), (5, 8)),
    "one-expanded-sample-under-two-keys": _pair(lambda t: (t[:1].expand(5, 4),) * 2, (5, 4)),
    "overlapping-windows": _pair(lambda t: (t.as_strided((5, 4), (2, 1)), t.as_strided((5, 4), (2, 1), 1)), (20,)),
}


@pytest.mark.parametrize("case", sorted(SHARED_INPUTS))
def test_input_keys_sharing_memory_each_get_their_gradient_times_input(case: str):
    torch.manual_seed(0)
    model = TwoInputs().to(F64)
    x, y = SHARED_INPUTS[case]()
    leaves = [x.detach().clone().requires_grad_(True), y.detach().clone().requires_grad_(True)]
    out = model(*leaves)
    seed = torch.zeros_like(out).scatter_(1, out.argmax(1, keepdim=True), 1.0)
    expected = [g * leaf.detach() for g, leaf in zip(torch.autograd.grad(out, leaves, seed), leaves, strict=True)]
    states = [(t._version, t.clone(), t.stride()) for t in (x, y)]

    policy = TensorDictModule(model, in_keys=["x", "y"], out_keys=["out"])
    td = LRP(policy, rule_mapper={nn.Linear: EpsilonRule(0.0)})(TensorDict(x=x, y=y, batch_size=[5]))
    assert relative_error(td["relevance", "x"], expected[0]) <= 1e-12
    assert relative_error(td["relevance", "y"], expected[1]) <= 1e-12
    for tensor, state in zip((x, y), states, strict=True):
        assert_untouched(tensor, *state)


@pytest.fixture(scope="module")
def cartpole_rollout() -> TensorDict:
    """Observations of two CartPole rollouts, ``[2, 12]``, in float64."""
    from torchrl.envs import GymEnv

    env = GymEnv("CartPole-v1")
    env.set_seed(0)
    runs = [env.rollout(12, break_when_any_done=False) for _ in range(2)]
    env.close()
    observations = torch.stack([run["observation"] for run in runs]).to(F64)
    return TensorDict(observation=observations, batch_size=[2, 12])


@pytest.mark.parametrize(
    "select",
    [
        lambda td: td[..., ::2],
        lambda td: td[:, 1::3],
        lambda td: td.transpose(0, 1),
        lambda td: td.permute(1, 0),
        lambda td: td[:, :1].expand(2, 5),
        lambda td: td.reshape(-1),
    ],
    ids=["time-step-2", "offset-step-3", "transpose", "permute", "expanded-step", "flattened"],
)
def test_a_slice_of_a_rollout_is_explained_as_its_contiguous_copy(cartpole_rollout: TensorDict, select):
    from torchrl.modules import MLP, QValueActor

    torch.manual_seed(0)
    actor = QValueActor(
        MLP(in_features=4, out_features=2, num_cells=[16, 16]).to(F64), in_keys=["observation"], action_space="one_hot"
    )
    source = cartpole_rollout.clone()
    before = source["observation"].clone()
    view = select(source)
    copied = TensorDict(observation=view["observation"].contiguous().clone(), batch_size=view.batch_size)
    expected = LRP(actor, EpsilonPlus())(copied)

    explained = LRP(actor, EpsilonPlus())(view)
    assert relative_error(explained["relevance", "observation"], expected["relevance", "observation"]) <= 1e-12
    assert relative_error(explained["chosen_action_value"], expected["chosen_action_value"]) <= 1e-12
    assert torch.equal(source["observation"], before)
