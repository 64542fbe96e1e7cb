"""Relevance set at zero inputs of the first layer, carried back through glue before it.

Flat, w² and z^B give relevance to zero-valued inputs, which ``x * grad`` cannot carry. With glue between the
explained input and the first layer (a normaliser inside the model, a scaling step of a pipeline), that
relevance must still reach the explained input, position by position.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule, TensorDictSequential
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.rules import (
    EpsilonPlus,
    EpsilonPlusFlat,
    FirstLayerRule,
    WSquareRule,
    ZBoxRule,
)
from tdhook.attribution.rules import GlueError

F64 = torch.float64


def first_layer(rule) -> EpsilonPlus:
    return EpsilonPlus(
        rule_mapper=lambda name, module: FirstLayerRule(rule()) if isinstance(module, nn.Linear) else None
    )


PRESETS = {
    "Flat": EpsilonPlusFlat,
    "ZBox": lambda: first_layer(lambda: ZBoxRule(-3.0, 3.0)),
    "WSquare": lambda: first_layer(WSquareRule),
}


class Glue(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def network() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).to(F64)


def inputs() -> torch.Tensor:
    torch.manual_seed(1)
    u = torch.randn(4, 6, dtype=F64)
    u[:, ::2] = 0.0  # zero entries: the relevance there is set directly
    return u


MEAN = torch.linspace(-0.5, 0.5, 6, dtype=F64)
STD = torch.linspace(0.5, 2.0, 6, dtype=F64)
# glue x = fn(u), and the constant b of x = a * u + b (zero for linear glue)
GLUES = {
    "halve": (lambda u: u / 2, 0.0),
    "normalise": (lambda u: (u - MEAN) / STD, -MEAN / STD),
    "permute": (lambda u: u.flip(-1), 0.0),
}


def relevance(module, preset: str, x: torch.Tensor, **kwargs) -> torch.Tensor:
    lrp = LRP(module, PRESETS[preset](), **kwargs)
    return lrp(TensorDict(x=x, batch_size=[len(x)]))["relevance", "x"]


@pytest.mark.parametrize("glue", sorted(GLUES))
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_relevance_at_zero_inputs_crosses_glue_inside_the_model(preset: str, glue: str):
    net = network()
    fn, _shift = GLUES[glue]
    u = inputs()
    x = fn(u)
    if glue == "normalise":  # zeros of the layer input, where x * grad cannot carry the relevance
        x[:, ::2] = 0.0
        u = x * STD + MEAN
    expected_at_x = relevance(net, preset, x, in_keys=["x"], out_keys=["y"])
    # The relevance the first-layer rule sets at x belongs, whole, to the input position x was computed from: the
    # shift b of a normaliser takes no share (the gradient through it carried R_x (x - b) / x, unbounded near 0).
    expected = expected_at_x
    if glue == "permute":
        expected = expected.flip(-1)
    actual = relevance(nn.Sequential(Glue(fn), *net), preset, u, in_keys=["x"], out_keys=["y"])
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-12)
    assert expected_at_x[x == 0].abs().min() > 1e-6  # the relevance that used to be lost is there


@pytest.mark.parametrize("create_graph", [False, True], ids=["", "create_graph"])
@pytest.mark.parametrize("step", ["module", "pipeline"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_an_input_near_a_normalisers_mean_gets_the_relevance_of_its_normalised_value(
    preset: str, step: str, create_graph: bool
):
    # Through the normaliser's shift the gradient carried R_x (x - b) / x, unbounded near the mean: 1e5 to 3e6
    # relative error here, and a sample's total -2.7e5 where the layer's is 0.05. The normalised input's relevance
    # is the oracle: each input position gets that of the value computed from it, and the sum is kept.
    net = network()
    u = inputs() + 0.3
    u[:, 1] = MEAN[1] + torch.tensor([1e-2, 1e-5, 1e-8, 0.0], dtype=F64)
    if step == "module":
        model, keys = nn.Sequential(Glue(lambda u: (u - MEAN) / STD), *net), {"in_keys": ["x"], "out_keys": ["y"]}
    else:
        normalise = TensorDictModule(lambda x: (x - MEAN) / STD, in_keys=["x"], out_keys=["normalised"])
        model, keys = TensorDictSequential(normalise, TensorDictModule(net, ["normalised"], ["y"])), {}
    expected = relevance(net, preset, (u - MEAN) / STD, in_keys=["x"], out_keys=["y"])
    actual = relevance(model, preset, u, create_graph=create_graph, **keys).detach()
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(actual.sum(-1), expected.sum(-1), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_relevance_at_zero_inputs_crosses_a_pipeline_step(preset: str):
    net = network()
    u = inputs()
    pipeline = TensorDictSequential(
        TensorDictModule(lambda x: x * 2, in_keys=["x"], out_keys=["scaled"]),
        TensorDictModule(net, in_keys=["scaled"], out_keys=["y"]),
    )
    expected = relevance(net, preset, u * 2, in_keys=["x"], out_keys=["y"])
    actual = relevance(pipeline, preset, u, in_keys=["x"])
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-12)


def test_glue_that_sums_inputs_before_the_first_layer_raises_naming_the_layer():
    net = network()
    u = torch.randn(4, 6, dtype=F64)
    u[:, 1] = -u[:, 0]  # the layer input u + roll(u) is zero at position 1
    model = nn.Sequential(Glue(lambda u: u + u.roll(1, -1)), *net)
    lrp = LRP(model, EpsilonPlusFlat(), in_keys=["x"], out_keys=["y"])
    with pytest.raises(GlueError, match=r"FlatRule on Linear.*several input positions") as info:
        lrp(TensorDict(x=u, batch_size=[len(u)]))
    assert any("'1'" in note for note in info.value.__notes__)


def test_glue_that_sums_inputs_into_a_subnormal_before_the_first_layer_raises_as_a_zero_does():
    # R / x overflows at a layer input of 1e-320 as at 0: x · grad cannot carry the relevance set there, which
    # came out non-finite (-inf) where a zero raises.
    net = network()
    u = torch.randn(4, 6, dtype=F64)
    u[:, 0], u[:, 1] = 0.0, 1e-320  # the layer input u + roll(u) is subnormal at position 1
    model = nn.Sequential(Glue(lambda u: u + u.roll(1, -1)), *net)
    lrp = LRP(model, EpsilonPlusFlat(), in_keys=["x"], out_keys=["y"])
    with pytest.raises(GlueError, match=r"FlatRule on Linear.*several input positions"):
        lrp(TensorDict(x=u, batch_size=[len(u)]))


def test_a_float32_image_normaliser_before_a_convolution_gives_each_pixel_its_normalised_relevance():
    # The usual (image - mean) / std per channel in float32: its roundings once made the positions look mixed, and
    # the relevance went through the shift's gradient instead (a sum 16x the layer's, 1e2 relative error).
    torch.manual_seed(0)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)
    )
    u = torch.rand(2, 3, 16, 16)
    u[:, :, ::3, ::2] = mean  # at the mean: the normalised input is zero there
    u[:, :, 1::3, ::2] = mean + 1e-3
    expected = LRP(net, EpsilonPlusFlat(), in_keys=["x"], out_keys=["y"])(
        TensorDict(x=(u - mean) / std, batch_size=[2])
    )
    model = nn.Sequential(Glue(lambda u: (u - mean) / std), *net)
    actual = LRP(model, EpsilonPlusFlat(), in_keys=["x"], out_keys=["y"])(TensorDict(x=u, batch_size=[2]))
    torch.testing.assert_close(actual["relevance", "x"], expected["relevance", "x"], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(actual["relevance", "x"].sum((1, 2, 3)), expected["relevance", "x"].sum((1, 2, 3)))


@pytest.mark.parametrize("create_graph", [False, True], ids=["", "create_graph"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_feature_mixing_inputs_beside_a_normaliser_leaves_the_normalised_positions_whole(
    preset: str, create_graph: bool
):
    # x = [(u - mean) / std, mean(u)]: the last feature mixes every input, so its relevance goes by the gradient
    # (x * grad through the mean); the normalised positions keep theirs whole. Sending them to the gradient too
    # gave R (x - b) / x near the mean: 5e6 relative error, a sample's total -3.3e6 where the layer's is 0.77.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(7, 8), nn.ReLU(), nn.Linear(8, 3)).to(F64)
    u = inputs() + 0.3
    u[:, 1] = MEAN[1] + torch.tensor([1e-2, 1e-5, 1e-8, 0.0], dtype=F64)

    def glue(u: torch.Tensor) -> torch.Tensor:
        return torch.cat([(u - MEAN) / STD, u.mean(-1, keepdim=True)], -1)

    x = glue(u)
    at_x = relevance(net, preset, x, in_keys=["x"], out_keys=["y"])
    expected = at_x[:, :6] + u * at_x[:, 6:] / x[:, 6:] / 6  # the mean's relevance by gradient x input
    actual = relevance(
        nn.Sequential(Glue(glue), *net), preset, u, create_graph=create_graph, in_keys=["x"], out_keys=["y"]
    )
    torch.testing.assert_close(actual.detach(), expected, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(actual.detach().sum(-1), at_x.sum(-1), rtol=1e-9, atol=1e-12)
