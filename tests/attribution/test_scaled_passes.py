"""float16 relevance where the gradient ``R / a`` overflows, against float64.

A callable target of 1 on the outputs of a model without biases whose input is near 1e-3 puts ``R / y`` near 1e4
on the output, and the ε-rule sends ``R / ε`` (1e6) through the layer at outputs too small to carry it: float16
(largest value 65504) overflowed, and the relevance of whole samples came out NaN (under γ, which carries nothing
from an output of 0, the call raised). The wrapper runs such a pass again with the target's relevance scaled by a
power of two and divides it back in float32.

Tolerance: the model and input are rounded to the half dtype first, so the half-precision run differs from the
float64 one by its arithmetic alone. As in tests/attribution/rules/test_half_precision.py, a sample whose relevance
cancels amplifies rounding in every dtype alike; the float32 run measures that, ``κ = max(1, err₃₂ / u₃₂)`` with
``u`` the unit roundoff (2⁻²⁴ float32, 2⁻¹¹ float16, 2⁻⁸ bfloat16), and a run must be within ``16 · κ · u`` of
float64 per sample (relative L2). float16, the dtype that overflowed, must also be within ``16 · u`` (a few
roundings per layer of this three-layer model): measured at most 5.1e-3 (7.8e-3 allowed; NaN before). bfloat16
(float32's range: one pass, as before) reaches 1.65 on a sample whose relevance sums to 13 % of the target's, which
the float32 run's ``κ`` covers.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torchvision
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import (
    LRP,
    EpsilonGammaBox,
    EpsilonPlus,
    EpsilonPlusFlat,
    EpsilonRule,
    FlatRule,
    GammaRule,
    WSquareRule,
    ZBoxRule,
)
from tdhook.attribution._scaled_passes import SCALES, scaled_when_overflowing

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
LAYERS = (nn.Linear, nn.modules.conv._ConvNd)


def _first_layer(rule):
    return lambda path, module: (rule() if path == "0" else EpsilonRule(1e-6)) if isinstance(module, LAYERS) else None


MAPPERS = {
    "epsilon": lambda: lambda path, module: EpsilonRule(1e-6) if isinstance(module, LAYERS) else None,
    "EpsilonPlus": EpsilonPlus,
    # γ gives an output of 0 nothing to pass on: R / y overflowing float16 at outputs near 1e-5 raised
    "gamma": lambda: lambda path, module: GammaRule(0.25) if isinstance(module, LAYERS) else None,
    "EpsilonPlusFlat": EpsilonPlusFlat,
    "EpsilonGammaBox": lambda: EpsilonGammaBox(-1.0, 1.0),
    "flat": lambda: _first_layer(FlatRule),
    "wsquare": lambda: _first_layer(WSquareRule),
    "zbox": lambda: _first_layer(lambda: ZBoxRule(-1.0, 1.0)),
}


def one_hot(y: torch.Tensor) -> torch.Tensor:
    return nn.functional.one_hot(y.argmax(-1), y.shape[-1]).to(y.dtype)


def model_and_input(seed: int, scale: float) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.zeros_(module.bias)
    return model, torch.randn(4, 8, dtype=torch.float64) * scale


def relevance(model: nn.Module, x: torch.Tensor, name: str, dtype: torch.dtype, half: torch.dtype, **kwargs):
    model = copy.deepcopy(model).to(half).to(dtype)  # the weights and input of the half-precision run, in every run
    lrp = LRP(model, MAPPERS[name](), in_keys=["x"], out_keys=["y"], target=one_hot, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lrp(TensorDict(x=x.to(half).to(dtype), batch_size=x.shape[:1]))["relevance", "x"]


def relative_errors(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    difference = (actual.double() - expected).flatten(1).norm(dim=1)
    return difference / expected.flatten(1).norm(dim=1).clamp_min(1e-300)


@pytest.mark.parametrize("create_graph", [False, True])
@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("name", sorted(MAPPERS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_overflowing_half_precision_gradient_gives_finite_relevance_close_to_float64(
    dtype: torch.dtype, name: str, seed: int, create_graph: bool
):
    model, x = model_and_input(seed, 1e-3)
    expected = relevance(model, x, name, torch.float64, dtype)
    single = relative_errors(relevance(model, x, name, torch.float32, dtype), expected).max().item()
    amplification = max(1.0, single / UNIT_ROUNDOFF[torch.float32])
    actual = relevance(model, x, name, dtype, dtype, create_graph=create_graph)
    assert actual.dtype == dtype and torch.isfinite(actual).all(), actual
    error = relative_errors(actual, expected).max().item()
    assert error <= 16 * amplification * UNIT_ROUNDOFF[dtype], (error, amplification)
    if dtype is torch.float16:
        assert error <= 16 * UNIT_ROUNDOFF[dtype], error


def test_a_deep_float16_cnn_whose_quotient_overflows_by_a_little_keeps_its_relevance():
    """A one-hot target on logits near 1.3e-5 overflows float16's R / y by less than 2: the pass again at 2^-8 (the
    first scale tried before) rounded the gradients inside MobileNet-V3 to 0, and the relevance came back finite but
    all but lost (1.0 off float64, 3 of 24576 elements non-zero). The largest finite scale is taken now."""
    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v3_small(weights=None).train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(8, 3, 64, 64))
        model.eval()
        model.classifier[-1].weight.mul_(0.1)
        model.classifier[-1].bias.mul_(0.1)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        chosen = copy.deepcopy(model).double()(x.double()).argmax(1)

    def explain(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        lrp = LRP(
            copy.deepcopy(model).to(dtype),
            EpsilonPlus(),
            in_keys=["x"],
            out_keys=["y"],
            target=lambda y: torch.zeros_like(y).scatter(1, chosen[:, None], 1.0),
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = lrp(TensorDict(x=x.to(dtype), batch_size=[2]))
        return out["relevance", "x"], out["y"]

    expected, logits = explain(torch.float64)
    assert logits.gather(1, chosen[:, None]).abs().max() < 2e-5  # 1 / logit overflows float16
    actual, _ = explain(torch.float16)
    assert torch.isfinite(actual).all() and (actual != 0).float().mean() > 0.5
    assert relative_errors(actual, expected).max() < 0.1


class TestScaledWhenOverflowing:
    """The retry itself, on passes that count their calls."""

    @staticmethod
    def passes(result: torch.Tensor) -> tuple[list, object]:
        calls: list[tuple[float, bool]] = []

        def relevance_at(scale: float, keep: bool) -> list[torch.Tensor]:
            calls.append((scale, keep))
            return [result.clone()]

        return calls, relevance_at

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
    def test_other_dtypes_run_one_pass_as_asked(self, dtype: torch.dtype):
        calls, relevance_at = self.passes(torch.tensor([float("nan")], dtype=dtype))
        scaled_when_overflowing(relevance_at, torch.ones(1, dtype=dtype), False, "y")
        assert calls == [(1.0, False)]

    def test_a_finite_float16_pass_runs_once_keeping_the_graph(self):
        calls, relevance_at = self.passes(torch.tensor([0.5], dtype=torch.float16))
        result = scaled_when_overflowing(relevance_at, torch.ones(1, dtype=torch.float16), False, "y")
        assert calls == [(1.0, True)] and result[0].item() == 0.5

    def test_a_non_finite_input_gives_its_relevance_in_one_pass(self):
        nan = torch.tensor([float("nan")], dtype=torch.float16)
        calls, relevance_at = self.passes(nan)
        result = scaled_when_overflowing(relevance_at, torch.ones(1, dtype=torch.float16), False, "y", [nan])
        assert len(calls) == 1 and result[0].isnan().all()

    def test_a_pass_that_stays_non_finite_raises_naming_the_target_and_dtype(self):
        calls, relevance_at = self.passes(torch.tensor([float("inf")], dtype=torch.float16))
        with pytest.raises(FloatingPointError, match=r"target 'y'.*torch\.float16"):
            scaled_when_overflowing(relevance_at, torch.ones(1, dtype=torch.float16), False, "y")
        assert [scale for scale, _ in calls] == [1.0, *SCALES] and SCALES == tuple(2.0**-k for k in range(1, 25))
        assert [keep for _, keep in calls] == [True] * 24 + [False]  # the graph freed by the last pass

    def test_a_target_of_every_unit_is_checked_not_scaled(self):
        calls, relevance_at = self.passes(torch.tensor([float("inf")], dtype=torch.float16))
        with pytest.raises(FloatingPointError, match="every unit"):
            scaled_when_overflowing(relevance_at, torch.ones(1, dtype=torch.float16), False, "y", scalable=False)
        assert calls == [(1.0, False)]


class TestUnderflow:
    @pytest.mark.parametrize("target", [0, "all"])
    def test_relevance_that_rounds_to_zero_everywhere_is_told(self, target):
        """Relevance below float16's smallest step rounds to 0: a target output near 1e-7 spread over many inputs
        gave a float16 relevance of 0 at every entry (float32's is 1e-10 to 1e-9 per entry, not 0), which read as no
        relevance at all, with no word. It is warned about; a model whose outputs are large gives no warning."""
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(1024, 16), nn.ReLU(), nn.Linear(16, 2))
        with torch.no_grad():
            net[2].weight.mul_(1e-6)
            net[2].bias.zero_()
        x = torch.rand(2, 1024)
        wide = LRP(copy.deepcopy(net), EpsilonPlus(), in_keys=["x"], out_keys=["y"], target=target)
        wide = wide(TensorDict(x=x, batch_size=[2]))["relevance", "x"]
        assert bool(wide.any()) and wide.abs().max() < 2**-25  # rounds to 0 in float16
        half = LRP(copy.deepcopy(net).half(), EpsilonPlus(), in_keys=["x"], out_keys=["y"], target=target)
        with pytest.warns(UserWarning, match=r"relevance in float16 is 0 at every entry.*explain the model in"):
            relevance = half(TensorDict(x=x.half(), batch_size=[2]))["relevance", "x"]
        assert not bool(relevance.any())
        with torch.no_grad():
            net[2].weight.mul_(1e6)
        loud = LRP(net.half(), EpsilonPlus(), in_keys=["x"], out_keys=["y"], target=target)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert bool(loud(TensorDict(x=x.half(), batch_size=[2]))["relevance", "x"].any())
