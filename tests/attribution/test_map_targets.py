"""Targets on a map (``[B, C, H, W]``): ``None``, an int and ``"all"`` pick units of the last dimension, the map's
width, at every channel and row; LRP, the methods and the metrics say so. Rows of a sequence or of agents get no
word."""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import LRP, InputXGradient
from tdhook.attribution.lrp_helpers.rules import EpsilonPlus
from tdhook.metrics import pixel_flipping

F64 = torch.float64
MAP = "(LRP|metrics). target=None on 'y' .shape .2, 4, 6, 7., batch .2.. explains, at each of the 24 positions .4, 6."


def segmenter() -> TensorDictModule:
    """Class scores per pixel, ``[B, 4, H, W]``."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 5, 3, padding=1, bias=False), nn.ReLU(), nn.Conv2d(5, 4, 1, bias=False))
    return TensorDictModule(net.to(F64), in_keys=["x"], out_keys=["y"])


def batch() -> TensorDict:
    return TensorDict(x=torch.rand(2, 3, 6, 7, dtype=F64), batch_size=[2])


def gradient_times_input(module: TensorDictModule, x: torch.Tensor, score) -> torch.Tensor:
    x = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(score(module.module(x)), x)
    return x.detach() * grad


def test_lrp_warns_that_the_default_target_on_a_map_explains_the_rows_of_its_width():
    """Under LRP-0 (no rule: the plain gradient), the default target's relevance is gradient x input of the largest
    pixel of every row of every class channel, summed: not of any class score. It used to come with no word."""
    module, td = segmenter(), batch()
    with pytest.warns(UserWarning, match=MAP) as caught:
        relevance = LRP(module, {})(td.clone())["relevance", "x"]
    assert "lambda y: y * (y == y.amax(1, keepdim=True))" in str(caught[0].message)
    expected = gradient_times_input(module, td["x"], lambda y: y.amax(-1).sum())
    torch.testing.assert_close(relevance, expected, rtol=1e-12, atol=1e-14)


def test_the_advised_callable_explains_each_pixels_class_with_no_warning():
    module, td = segmenter(), batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = LRP(module, {}, target=lambda y: y * (y == y.amax(1, keepdim=True)))(td.clone())
    expected = gradient_times_input(module, td["x"], lambda y: y.amax(1).sum())
    torch.testing.assert_close(out["relevance", "x"], expected, rtol=1e-12, atol=1e-14)


def test_a_method_and_a_metric_warn_as_lrp():
    module = segmenter()
    with pytest.warns(UserWarning, match=MAP):
        explained = InputXGradient(module)(batch())
    with pytest.warns(UserWarning, match=MAP.replace("(LRP|metrics)", "metrics")):
        pixel_flipping(module, explained, features_per_step=42)
    with pytest.warns(UserWarning, match=MAP.replace("(LRP|metrics)", "metrics").replace("None", "3")):
        pixel_flipping(module, explained, features_per_step=42, target=3)


@pytest.mark.parametrize(
    "shape, batch_size",
    [
        ((2, 3), [2]),  # action values
        ((2, 5, 3), [2]),  # a sequence's rows (the logits of every position), or the agents' action values
        ((2, 5, 3), [2, 5]),  # the same rows as batch dimensions
        ((2, 4, 6, 1), [2]),  # one unit: the value itself
        ((2, 1, 1, 3), [2]),  # one position
    ],
)
def test_rows_that_are_no_map_get_no_warning(shape: tuple[int, ...], batch_size: list[int]):
    torch.manual_seed(0)
    module = TensorDictModule(nn.Linear(4, shape[-1]).to(F64), in_keys=["x"], out_keys=["y"])
    td = TensorDict(x=torch.randn(*shape[:-1], 4, dtype=F64), batch_size=batch_size)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        relevance = LRP(module, EpsilonPlus())(td)["relevance", "x"]
    assert relevance.shape == td["x"].shape


@pytest.mark.parametrize(
    "target, picked",
    [(3, "unit 3 of the last dimension"), ("all", "each unit of the last dimension"), (-1, "unit -1 of the last")],
)
def test_an_int_or_all_on_a_map_is_warned_of_as_columns_of_the_map(target, picked: str):
    """``target=3`` on class scores ``[B, C, H, W]`` explains the fourth column of every channel (the last dimension),
    where a captum user means class 3; ``"all"`` each column on its own."""
    module, td = segmenter(), batch()
    expected_map = MAP.replace("target=None", f"target={target!r}").replace("(LRP|metrics)", "LRP")
    with pytest.warns(UserWarning, match=expected_map) as caught:
        relevance = LRP(module, {}, target=target)(td.clone())["relevance", "x"]
    assert picked in str(caught[0].message)
    if target == 3:
        torch.testing.assert_close(relevance, gradient_times_input(module, td["x"], lambda y: y[..., 3].sum()))


def test_the_advised_callable_for_one_class_explains_that_class_with_no_warning():
    module, td = segmenter(), batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = LRP(module, {}, target=lambda y: y * (torch.arange(y.shape[1], device=y.device) == 2)[:, None, None])(
            td.clone()
        )
    expected = gradient_times_input(module, td["x"], lambda y: y[:, 2].sum())
    torch.testing.assert_close(out["relevance", "x"], expected, rtol=1e-12, atol=1e-14)


def test_units_named_at_each_position_get_no_warning():
    """A LongTensor shaped like the output without its last dimension names a unit at every position itself."""
    module, td = segmenter(), batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LRP(module, {}, target=torch.zeros(2, 4, 6, dtype=torch.long))(td)
