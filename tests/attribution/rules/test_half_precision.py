"""float16 and bfloat16 layers under the rules that modify weights or split by sign, against float64.

The rules compute their quotients ``R / stabilize(z_mod)`` and transposed products in float32 for these dtypes.
In float16 (largest value 65504) the quotient overflowed for a relevance of 0.03 over a modified output near
1e-6, and its infinities met in the transposed product as NaN.

Tolerance: a model's relevance can cancel (signed contributions, one input feature), which amplifies rounding
in every dtype alike. The float32 run measures that amplification, ``κ = max(1, err₃₂ / u₃₂)`` with ``u`` the
unit roundoff (2⁻²⁴ for float32, 2⁻¹¹ for float16, 2⁻⁸ for bfloat16); a half-precision run must be finite and
within ``16 · κ · u`` of float64 (per sample, relative L2): a few roundings per layer of these models, which
also run their forward pass in half precision.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import (
    LRP,
    AlphaBetaRule,
    EpsilonAlpha2Beta1,
    EpsilonAlpha2Beta1Flat,
    EpsilonGammaBox,
    EpsilonPlus,
    EpsilonPlusFlat,
    EpsilonRule,
    FlatRule,
    GammaRule,
    WSquareRule,
    ZBoxRule,
)
from tests.attribution.mappers.test_presets_fuzz import build_model

F64 = torch.float64
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
LAYERS = (nn.Linear, nn.modules.conv._ConvNd)

# Rules on every layer, the input-layer rules on the first one (ε elsewhere), and the presets.
RULES = {
    "alpha2beta1": lambda: AlphaBetaRule(2.0, 1.0),
    # a stabiliser below float16's smallest step (6e-8): it rounded to 0 there, and 0 / 0 was NaN
    "alpha2beta1-1e-9": lambda: AlphaBetaRule(2.0, 1.0, stabilizer=1e-9),
    "gamma-1e-9": lambda: GammaRule(0.25, stabilizer=1e-9),
    "zplus": lambda: AlphaBetaRule(1.0, 0.0),
    "gamma": lambda: GammaRule(0.25),
}
FIRST_LAYER_RULES = {"flat": FlatRule, "wsquare": WSquareRule, "zbox": lambda: ZBoxRule(-3.0, 3.0)}
PRESETS = {
    "EpsilonPlus": EpsilonPlus,
    "EpsilonPlusFlat": EpsilonPlusFlat,
    "EpsilonAlpha2Beta1": EpsilonAlpha2Beta1,
    "EpsilonAlpha2Beta1Flat": EpsilonAlpha2Beta1Flat,
    "EpsilonGammaBox": lambda: EpsilonGammaBox(-3.0, 3.0),
}


def mapper(name: str):
    if name in PRESETS:
        return PRESETS[name]()
    if name in RULES:
        return lambda path, module: RULES[name]() if isinstance(module, LAYERS) else None
    first = FIRST_LAYER_RULES[name]
    return lambda path, module: (first() if path == "0" else EpsilonRule(1e-6)) if isinstance(module, LAYERS) else None


def relevance(
    model: nn.Module, x: torch.Tensor, name: str, out: torch.Tensor, dtype: torch.dtype, create_graph: bool = False
) -> torch.Tensor:
    target = lambda y: out.to(dtype)  # noqa: E731
    model = copy.deepcopy(model).to(dtype)
    lrp = LRP(model, mapper(name), in_keys=["x"], out_keys=["y"], target=target, create_graph=create_graph)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SiLU without a rule, and the like: the same in every dtype
        return lrp(TensorDict(x=x.to(dtype), batch_size=x.shape[:1]))["relevance", "x"]


def relative_errors(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    difference = (actual.double() - expected).flatten(1).norm(dim=1)
    return difference / expected.flatten(1).norm(dim=1).clamp_min(1e-300)


@pytest.mark.parametrize("create_graph", [False, True])
def test_alpha_beta_on_a_grouped_conv1d_in_float16_gives_finite_relevance(create_graph: bool):
    # R / stabilize(z⁺) near 4e4, times α = 2, overflowed float16: 4 of 16 entries were NaN.
    layer = build_model(1)[0][0]  # Conv1d(2, 4, 2, groups=2, padding="same", padding_mode="replicate")
    _, x = build_model(1)
    torch.manual_seed(0)
    out = torch.randn_like(layer(x)) * 0.03
    expected = relevance(layer, x, "alpha2beta1", out, F64)
    for dtype in (torch.float16, torch.bfloat16):
        actual = relevance(layer, x, "alpha2beta1", out, dtype, create_graph)
        assert actual.dtype == dtype and torch.isfinite(actual).all(), actual
        assert relative_errors(actual, expected).max() <= 16 * UNIT_ROUNDOFF[dtype]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", [*RULES, *FIRST_LAYER_RULES, *PRESETS])
def test_half_precisions_agree_with_float64(seed: int, name: str):
    model, x = build_model(seed)
    torch.manual_seed(100 + seed)
    out = torch.randn_like(model(x)) * 0.03  # output relevance where R / z_mod reached float16's largest value
    expected = relevance(model, x, name, out, F64)
    single = relative_errors(relevance(model, x, name, out, torch.float32), expected).max().item()
    amplification = max(1.0, single / UNIT_ROUNDOFF[torch.float32])
    for dtype in (torch.float16, torch.bfloat16):
        actual = relevance(model, x, name, out, dtype)
        assert actual.dtype == dtype and torch.isfinite(actual).all(), (dtype, actual)
        error = relative_errors(actual, expected).max().item()
        assert error <= 16 * amplification * UNIT_ROUNDOFF[dtype], (dtype, error, amplification)
