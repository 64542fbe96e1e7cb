"""Every public module class of ``torch.nn``, each in a small model, under LRP in float64.

Each class is listed once below with what LRP does with it, and the test holds it to that:

* ``LRP0``: LRP-0 (the default rules, the plain gradient on average pooling) equals gradient × input, with no word;
* ``CONSERVES``: a rule of its own (the pass rule of a curved activation, a norm's scale held, a recurrent layer's
  signal-take-all) that conserves the relevance with the biases zeroed, with no word;
* ``WARNS``: a warning naming the module (its path and class) and what its plain gradient misses;
* ``DRAWS``: a warning naming the module that draws at every forward pass (the explanation is random).

A class of a newer torch that is in none of these lists (and no loss, container or base class) fails
:func:`test_every_public_module_class_is_listed`: it enters LRP unchecked until it is looked at and listed.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.rules import BaseRuleMapper, IgnoreRule
from tests.conftest import relative_error

F64 = torch.float64
LRP0, CONSERVES, WARNS, DRAWS = "LRP-0", "conserves", "warns", "draws"

# Module classes that make no layer of a model: containers and base classes, and a loss head whose forward reads the
# targets (the losses themselves, subclasses of ``_Loss``, are left out by type).
NOT_IN_A_MODEL = frozenset(
    {"Container", "Module", "ModuleDict", "ModuleList", "ParameterDict", "ParameterList", "Sequential"}
    | {"RNNBase", "RNNCellBase", "AdaptiveLogSoftmaxWithLoss"}
)


class Pair(nn.Module):
    """A module of two inputs, called on an activation and its flip shifted by ``offset`` (with a trailing unit
    dimension where the module reduces the last one)."""

    def __init__(self, module: nn.Module, unsqueeze: bool = True, offset: float = 0.5) -> None:
        super().__init__()
        self.module, self.unsqueeze, self.offset = module, unsqueeze, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.module(x, x.flip(-1) + self.offset)
        return out.unsqueeze(-1) if self.unsqueeze else out


class First(nn.Module):
    """The first output of a module that returns a tuple (recurrent layers, attention)."""

    def __init__(self, module: nn.Module, *extra: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.module, self.extra = module, extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x, *(f(x) for f in self.extra))[0]


class Both(nn.Module):
    """A module called on an activation and on its flip over the sequence (a decoder's target and memory)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x, x.flip(1))


class Loop(nn.Module):
    """A recurrent cell run over the steps of a sequence ``(B, T, F)``: the last hidden state."""

    def __init__(self, cell: nn.Module) -> None:
        super().__init__()
        self.cell = cell

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = None
        for t in range(x.shape[1]):
            state = self.cell(x[:, t], state)
        return state[0] if isinstance(state, tuple) else state


class Unpool(nn.Module):
    """Max pooling with its indices, and the max unpooling that puts the maxima back."""

    def __init__(self, dims: int) -> None:
        super().__init__()
        self.pool = getattr(nn, f"MaxPool{dims}d")(2, return_indices=True)
        self.unpool = getattr(nn, f"MaxUnpool{dims}d")(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.unpool(*self.pool(x))


class Blocks(nn.Module):
    """``nn.Fold`` of the channels of a ``(B, 4, 6, 6)`` activation read as 36 blocks of ``2 × 2``."""

    def __init__(self) -> None:
        super().__init__()
        self.fold = nn.Fold((7, 7), 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fold(x.flatten(2))


def _transformer_layer(kind: str) -> nn.Module:
    return getattr(nn, kind)(6, 2, 8, dropout=0.0, batch_first=True)


# Name → (what LRP does, the input: "vec" (B, 4), "seq" (B, T, 4), "c1"/"c2"/"c3" (B, 2, *spatial), "tokens",
# the module). The module follows a Linear or convolution layer and is followed by Flatten and a Linear head.
CASES: dict[str, tuple[str, str, Callable[[], nn.Module]]] = {
    # Piecewise-linear activations: the pass rule is their gradient.
    "Identity": (LRP0, "vec", nn.Identity),
    "ReLU": (LRP0, "vec", nn.ReLU),
    "LeakyReLU": (LRP0, "vec", lambda: nn.LeakyReLU(0.1)),
    "PReLU": (LRP0, "vec", lambda: nn.PReLU(6, 0.3)),
    "RReLU": (LRP0, "vec", nn.RReLU),  # eval mode: a fixed slope
    "Hardshrink": (LRP0, "vec", lambda: nn.Hardshrink(0.3)),
    # Curved activations and clips (a unit clipped at a bound other than zero keeps its relevance): the pass rule.
    **{
        name: (CONSERVES, "vec", getattr(nn, name))
        for name in "ELU CELU SELU GELU Hardsigmoid Hardswish LogSigmoid ReLU6 Sigmoid SiLU Mish Softplus Softshrink "
        "Softsign Tanh Tanhshrink".split()
    },
    "Hardtanh": (CONSERVES, "vec", lambda: nn.Hardtanh(-0.2, 0.5)),
    "Threshold": (CONSERVES, "vec", lambda: nn.Threshold(0.1, -2.0)),
    # A sigmoid gate is held (signal-take-all): the half it multiplies takes the relevance.
    "GLU": (CONSERVES, "vec", nn.GLU),
    # Functions of several units that no CNN rule covers.
    "Softmax": (WARNS, "vec", lambda: nn.Softmax(-1)),
    "Softmin": (WARNS, "vec", lambda: nn.Softmin(-1)),
    "LogSoftmax": (WARNS, "vec", lambda: nn.LogSoftmax(-1)),
    "Softmax2d": (WARNS, "c2", nn.Softmax2d),
    # Its norms held, its product shared: bilinear in its inputs (unshifted: a shift is a bias).
    "CosineSimilarity": (CONSERVES, "vec", lambda: Pair(nn.CosineSimilarity(1), offset=0.0)),
    "PairwiseDistance": (WARNS, "vec", lambda: Pair(nn.PairwiseDistance())),
    "Bilinear": (WARNS, "vec", lambda: Pair(nn.Bilinear(6, 6, 5), unsqueeze=False)),
    "LPPool1d": (WARNS, "c1", lambda: nn.LPPool1d(2, 2)),
    "LPPool2d": (WARNS, "c2", lambda: nn.LPPool2d(4, 2)),
    "LPPool3d": (WARNS, "c3", lambda: nn.LPPool3d(2, 2)),
    "CrossMapLRN2d": (WARNS, "c2", lambda: nn.CrossMapLRN2d(3)),
    # Pooling: the maximum routes the gradient, the average is linear (the plain gradient here, ε by default).
    "MaxPool1d": (LRP0, "c1", lambda: nn.MaxPool1d(3, 2, padding=1, dilation=2)),
    "MaxPool2d": (LRP0, "c2", lambda: nn.MaxPool2d(2, ceil_mode=True)),
    "MaxPool3d": (LRP0, "c3", lambda: nn.MaxPool3d(2)),
    "MaxUnpool1d": (LRP0, "c1", lambda: Unpool(1)),
    "MaxUnpool2d": (LRP0, "c2", lambda: Unpool(2)),
    "MaxUnpool3d": (LRP0, "c3", lambda: Unpool(3)),
    "AdaptiveMaxPool1d": (LRP0, "c1", lambda: nn.AdaptiveMaxPool1d(3)),
    "AdaptiveMaxPool2d": (LRP0, "c2", lambda: nn.AdaptiveMaxPool2d(4)),
    "AdaptiveMaxPool3d": (LRP0, "c3", lambda: nn.AdaptiveMaxPool3d(3)),
    "AvgPool1d": (LRP0, "c1", lambda: nn.AvgPool1d(3, 2, padding=1, count_include_pad=False)),
    "AvgPool2d": (LRP0, "c2", lambda: nn.AvgPool2d(3, 2, padding=1, ceil_mode=True, divisor_override=5)),
    "AvgPool3d": (LRP0, "c3", lambda: nn.AvgPool3d(3, 2, padding=1, count_include_pad=False)),
    "AdaptiveAvgPool1d": (LRP0, "c1", lambda: nn.AdaptiveAvgPool1d(5)),  # sizes that do not divide
    "AdaptiveAvgPool2d": (LRP0, "c2", lambda: nn.AdaptiveAvgPool2d(4)),
    "AdaptiveAvgPool3d": (LRP0, "c3", lambda: nn.AdaptiveAvgPool3d(3)),
    "FractionalMaxPool2d": (DRAWS, "c2", lambda: nn.FractionalMaxPool2d(2, output_size=4)),
    "FractionalMaxPool3d": (DRAWS, "c3", lambda: nn.FractionalMaxPool3d(2, output_ratio=0.6)),
    # Norms: BatchNorm merged into the layer before it, the others with their scale held constant.
    "BatchNorm1d": (LRP0, "vec", lambda: nn.BatchNorm1d(6)),
    "BatchNorm2d": (LRP0, "c2", lambda: nn.BatchNorm2d(4)),
    "BatchNorm3d": (LRP0, "c3", lambda: nn.BatchNorm3d(4)),
    "SyncBatchNorm": (LRP0, "c2", lambda: nn.SyncBatchNorm(4)),
    "LazyBatchNorm1d": (LRP0, "vec", nn.LazyBatchNorm1d),
    "LazyBatchNorm2d": (LRP0, "c2", nn.LazyBatchNorm2d),
    "LazyBatchNorm3d": (LRP0, "c3", nn.LazyBatchNorm3d),
    "LayerNorm": (CONSERVES, "vec", lambda: nn.LayerNorm(6)),
    "RMSNorm": (CONSERVES, "vec", lambda: nn.RMSNorm(6)),
    "GroupNorm": (CONSERVES, "c2", lambda: nn.GroupNorm(2, 4)),
    "InstanceNorm1d": (CONSERVES, "c1", lambda: nn.InstanceNorm1d(4, affine=True)),
    "InstanceNorm2d": (CONSERVES, "c2", lambda: nn.InstanceNorm2d(4)),
    "InstanceNorm3d": (CONSERVES, "c3", lambda: nn.InstanceNorm3d(4, affine=True)),
    "LazyInstanceNorm1d": (CONSERVES, "c1", lambda: nn.LazyInstanceNorm1d(track_running_stats=False)),
    "LazyInstanceNorm2d": (CONSERVES, "c2", lambda: nn.LazyInstanceNorm2d(track_running_stats=False)),
    "LazyInstanceNorm3d": (CONSERVES, "c3", lambda: nn.LazyInstanceNorm3d(track_running_stats=False)),
    "LocalResponseNorm": (CONSERVES, "c2", lambda: nn.LocalResponseNorm(3, alpha=0.5)),
    # Shapes, padding, resampling and dropout (eval mode): copies and averages, whose gradient is LRP-0.
    "Flatten": (LRP0, "c2", lambda: nn.Flatten(2)),
    "Unflatten": (LRP0, "vec", lambda: nn.Unflatten(1, (2, 3))),
    "ChannelShuffle": (LRP0, "c2", lambda: nn.ChannelShuffle(2)),
    "PixelShuffle": (LRP0, "c2", lambda: nn.PixelShuffle(2)),
    "PixelUnshuffle": (LRP0, "c2", lambda: nn.PixelUnshuffle(2)),
    "Upsample": (LRP0, "c2", lambda: nn.Upsample(scale_factor=1.5, mode="bicubic")),
    "UpsamplingBilinear2d": (LRP0, "c2", lambda: nn.UpsamplingBilinear2d(scale_factor=2)),
    "UpsamplingNearest2d": (LRP0, "c2", lambda: nn.UpsamplingNearest2d(scale_factor=2)),
    "Fold": (LRP0, "c2", Blocks),
    "Unfold": (LRP0, "c2", lambda: nn.Unfold(3, padding=1, stride=2)),
    **{f"ZeroPad{d}d": (LRP0, f"c{d}", lambda d=d: getattr(nn, f"ZeroPad{d}d")(1)) for d in (1, 2, 3)},
    **{f"ConstantPad{d}d": (LRP0, f"c{d}", lambda d=d: getattr(nn, f"ConstantPad{d}d")(1, 0.5)) for d in (1, 2, 3)},
    **{f"ReflectionPad{d}d": (LRP0, f"c{d}", lambda d=d: getattr(nn, f"ReflectionPad{d}d")(1)) for d in (1, 2, 3)},
    **{f"ReplicationPad{d}d": (LRP0, f"c{d}", lambda d=d: getattr(nn, f"ReplicationPad{d}d")(1)) for d in (1, 2, 3)},
    **{f"CircularPad{d}d": (LRP0, f"c{d}", lambda d=d: getattr(nn, f"CircularPad{d}d")(1)) for d in (1, 2, 3)},
    "Dropout": (LRP0, "vec", nn.Dropout),
    "Dropout1d": (LRP0, "c1", nn.Dropout1d),
    "Dropout2d": (LRP0, "c2", nn.Dropout2d),
    "Dropout3d": (LRP0, "c3", nn.Dropout3d),
    "AlphaDropout": (LRP0, "vec", nn.AlphaDropout),
    "FeatureAlphaDropout": (LRP0, "c2", nn.FeatureAlphaDropout),
    # Layers.
    "Linear": (LRP0, "vec", lambda: nn.Linear(6, 5)),
    "LazyLinear": (LRP0, "vec", lambda: nn.LazyLinear(5)),
    **{f"Conv{d}d": (LRP0, f"c{d}", lambda d=d: getattr(nn, f"Conv{d}d")(4, 3, 2, dilation=1)) for d in (1, 2, 3)},
    **{
        f"ConvTranspose{d}d": (LRP0, f"c{d}", lambda d=d: getattr(nn, f"ConvTranspose{d}d")(4, 3, 2, stride=2))
        for d in (1, 2, 3)
    },
    **{f"LazyConv{d}d": (LRP0, f"c{d}", lambda d=d: getattr(nn, f"LazyConv{d}d")(3, 2)) for d in (1, 2, 3)},
    **{
        f"LazyConvTranspose{d}d": (LRP0, f"c{d}", lambda d=d: getattr(nn, f"LazyConvTranspose{d}d")(3, 2, stride=2))
        for d in (1, 2, 3)
    },
    "Embedding": (CONSERVES, "tokens", lambda: nn.Embedding(10, 6, max_norm=1.0)),
    "EmbeddingBag": (CONSERVES, "tokens", lambda: nn.EmbeddingBag(10, 6, mode="mean")),
    # Recurrent layers and attention.
    "LSTM": (CONSERVES, "seq", lambda: First(nn.LSTM(6, 5, num_layers=2, bidirectional=True, batch_first=True))),
    "GRU": (CONSERVES, "seq", lambda: First(nn.GRU(6, 5, num_layers=2, bidirectional=True, batch_first=True))),
    "LSTMCell": (CONSERVES, "seq", lambda: Loop(nn.LSTMCell(6, 5))),
    "GRUCell": (CONSERVES, "seq", lambda: Loop(nn.GRUCell(6, 5))),
    "RNN": (WARNS, "seq", lambda: First(nn.RNN(6, 5, batch_first=True))),
    "RNNCell": (WARNS, "seq", lambda: Loop(nn.RNNCell(6, 5))),
    # A ReLU recurrence of linear maps: piecewise linear, its plain gradient is LRP-0.
    "RNN (relu)": (
        LRP0,
        "seq",
        lambda: First(nn.RNN(6, 5, num_layers=2, nonlinearity="relu", bidirectional=True, batch_first=True)),
    ),
    "RNNCell (relu)": (LRP0, "seq", lambda: Loop(nn.RNNCell(6, 5, nonlinearity="relu"))),
    "MultiheadAttention": (
        WARNS,
        "seq",
        lambda: First(nn.MultiheadAttention(6, 2, batch_first=True), *[nn.Identity()] * 2),
    ),
    "TransformerEncoderLayer": (WARNS, "seq", lambda: _transformer_layer("TransformerEncoderLayer")),
    "TransformerDecoderLayer": (WARNS, "seq", lambda: Both(_transformer_layer("TransformerDecoderLayer"))),
    "TransformerEncoder": (
        WARNS,
        "seq",
        lambda: nn.TransformerEncoder(_transformer_layer("TransformerEncoderLayer"), 1, enable_nested_tensor=False),
    ),
    "TransformerDecoder": (
        WARNS,
        "seq",
        lambda: Both(nn.TransformerDecoder(_transformer_layer("TransformerDecoderLayer"), 1)),
    ),
    "Transformer": (WARNS, "seq", lambda: Both(nn.Transformer(6, 2, 1, 1, 8, dropout=0.0, batch_first=True))),
}


def _public_module_classes() -> list[str]:
    """The names in ``torch.nn.modules.__all__`` that are module classes, losses left out."""
    names = []
    for name in nn.modules.__all__:
        value = getattr(nn, name)
        if isinstance(value, type) and issubclass(value, nn.Module) and not issubclass(value, nn.modules.loss._Loss):
            names.append(name)
    return names


def test_every_public_module_class_is_listed():
    """A module class of a newer torch enters LRP unchecked: look at it in a model, and list it in CASES."""
    unlisted = [name for name in _public_module_classes() if name not in CASES and name not in NOT_IN_A_MODEL]
    assert unlisted == [], f"torch.nn module classes not checked under LRP: {unlisted}; check each and list it"
    stale = [name for name in CASES if not hasattr(nn, name.split(" ")[0])]  # "RNN (relu)": a variant of nn.RNN
    assert stale == [], f"listed but not in this torch: {stale}"


def _model(kind: str, module: nn.Module) -> tuple[nn.Sequential, torch.Tensor]:
    """``module`` between a first layer and a head, in eval mode, materialised, with its biases zeroed; an input."""
    generator = torch.Generator().manual_seed(0)
    if kind == "tokens":
        x = torch.randint(0, 10, (3, 4), generator=generator)
        front: list[nn.Module] = []
    elif kind in ("vec", "seq"):
        x = torch.randn(3, 4, dtype=F64, generator=generator) if kind == "vec" else torch.randn(2, 3, 4, dtype=F64)
        front = [nn.Linear(4, 6)]
    else:
        dims = int(kind[1])
        x = torch.randn(2, 2, *[6 if dims < 3 else 4] * dims, dtype=F64, generator=generator)
        front = [getattr(nn, f"Conv{dims}d")(2, 4, 3, padding=1)]
    torch.manual_seed(0)
    model = nn.Sequential(*front, module, nn.Flatten(), nn.LazyLinear(3)).to(F64)
    with torch.no_grad():
        model.train()(x)  # lazy modules take their shapes, norms their running statistics
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if "bias" in name.rpartition(".")[2] or name.endswith("running_mean"):  # bias_ih_l1_reverse, in_proj_bias
                tensor.zero_()
    return model.eval(), x


def _lrp0() -> BaseRuleMapper:
    """LRP-0: the default rules with no stabilizer, and the plain gradient on average pooling."""
    pools = [getattr(nn, f"{kind}AvgPool{d}d") for kind in ("", "Adaptive") for d in (1, 2, 3)]
    return BaseRuleMapper(stabilizer=0.0, rule_mapper={pool: IgnoreRule() for pool in pools})


def _explain(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
    lrp = LRP(model, _lrp0(), in_keys=["x"], out_keys=["y"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        relevance = lrp(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))["relevance", "x"]
    return relevance, [str(w.message) for w in caught]


def _explained_logit_and_gradient_times_input(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = x.clone().requires_grad_(True)
    out = model(leaf)
    start = torch.zeros_like(out).scatter_(-1, out.argmax(-1, keepdim=True), 1.0)
    (grad,) = torch.autograd.grad(out, leaf, start)
    return (out * start).sum(-1).detach(), x * grad


@pytest.mark.parametrize("name", list(CASES))
def test_each_module_class_in_a_model(name: str):
    expected, kind, make = CASES[name]
    module = make()
    model, x = _model(kind, module)
    path = "1"
    relevance, messages = _explain(model, x)
    if expected == WARNS:
        named = re.compile(rf"module '{path}(\.[\w.]+)?' \(\w+\)")
        assert any(named.search(m) for m in messages), messages
        return
    if expected == DRAWS:
        assert any(f"module '{path}' ({name}, pooling regions drawn at random)" in m for m in messages), messages
        return
    assert messages == []
    if kind == "tokens":  # relevance per token: conserved (LRP-0 on the embeddings is tested in test_tokens.py)
        leaf = model[0](x)
        out = model[1:](leaf)
        logit = out.gather(-1, out.argmax(-1, keepdim=True)).squeeze(-1).detach()
        assert relative_error(relevance.sum(-1), logit) < 1e-10
        return
    logit, gradient_times_input = _explained_logit_and_gradient_times_input(model, x)
    if expected == LRP0:
        assert relative_error(relevance, gradient_times_input) < 1e-10
    else:
        assert relative_error(relevance.flatten(1).sum(1), logit) < 1e-10


@pytest.mark.parametrize("cell", [False, True], ids=["layer", "cell"])
def test_a_relu_rnn_as_first_layer_is_named_by_a_preset_with_a_first_layer_rule(cell: bool):
    """A ReLU RNN (LRP-0 by its plain gradient) that reads the model's input gets no first-layer rule (Flat has no
    form for it), as an LSTM or GRU there: EpsilonPlusFlat says so, naming it, and its relevance is EpsilonPlus's."""
    from tdhook.attribution import EpsilonPlus, EpsilonPlusFlat

    rnn = Loop(nn.RNNCell(4, 5, nonlinearity="relu")) if cell else First(nn.RNN(4, 5, nonlinearity="relu"))
    torch.manual_seed(0)
    model = nn.Sequential(rnn, nn.Flatten(), nn.LazyLinear(3)).to(F64)
    x = torch.randn(2, 3, 4, dtype=F64)
    model(x)
    name, kind = ("0.cell", "RNNCell") if cell else ("0.module", "RNN")

    def explain(mapper):
        lrp = LRP(model, mapper, in_keys=["x"], out_keys=["y"])
        return lrp(TensorDict(x=x.clone(), batch_size=[2]))["relevance", "x"]

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        expected = explain(EpsilonPlus())
    message = rf"module '{name}' \({kind}\) is the first layer .* \(FlatRule\) .* keeps its plain gradient \(LRP-0\)"
    with pytest.warns(UserWarning, match=message):
        assert relative_error(explain(EpsilonPlusFlat()), expected) < 1e-12
