"""A GELU written out (``x * 0.5 * (1 + erf(x / √2))``, ``0.5 * x * (1 + tanh(...))``) under AttnLRP and CP-LRP: its
factor ``(1 ± tanh) / 2`` or ``(1 + erf) / 2`` is a sigmoid-like gate, held, so the relevance is that of the same
model with ``F.gelu`` (the identity rule), in every call of a context; other offsets are still named.

Oracles: the same model with the factor detached by hand (1e-12, relative L2, float64), and with ``F.gelu``, whose
identity rule passes the same relevance but for its stabiliser (1e-6): ``1 + tanh(z) = 2 σ(2z)`` and
``1 + erf(z) = 2 Φ(√2 z)``, so the factor is a gate, and the held gate passes all of the product's relevance to its
signal, as the identity rule does.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import CPLRP, LRP, AttnLRP
from tests.attribution.rules._helpers import F64
from tests.conftest import relative_error

PRESETS = {"AttnLRP": AttnLRP, "CPLRP": CPLRP}
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def erf_gelu(x: torch.Tensor) -> torch.Tensor:  # ESM's
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def tanh_gelu(x: torch.Tensor) -> torch.Tensor:  # BLOOM's, minGPT's
    return 0.5 * x * (1.0 + torch.tanh(SQRT_2_OVER_PI * (x + 0.044715 * torch.pow(x, 3.0))))


def tanh_gelu_added(x: torch.Tensor) -> torch.Tensor:  # ``t + 1``, ``torch.add``, the gate scaled before the product
    return torch.add(torch.tanh(SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)), 1).mul(0.5) * x


def special_erf_gelu(x: torch.Tensor) -> torch.Tensor:
    return (torch.special.erf(x * 2**-0.5) + 1) * x / 2


def complement(x: torch.Tensor) -> torch.Tensor:  # 1 - tanh(z) = 2 sigmoid(-2z)
    return x * (1 - torch.tanh(x))


def held(factor: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x * factor(x)`` with the factor detached: the gate held by hand."""
    return lambda x: x * factor(x).detach()


# Each form, with the same function written with its factor held by hand, and with a torch function.
WRITTEN = {
    "erf": (erf_gelu, held(lambda x: 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))), F.gelu),
    "special_erf": (special_erf_gelu, held(lambda x: 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))), F.gelu),
    "tanh": (
        tanh_gelu,
        held(lambda x: 0.5 * (1.0 + torch.tanh(SQRT_2_OVER_PI * (x + 0.044715 * x**3)))),
        lambda x: F.gelu(x, approximate="tanh"),
    ),
    "tanh_added": (
        tanh_gelu_added,
        held(lambda x: 0.5 * (1.0 + torch.tanh(SQRT_2_OVER_PI * (x + 0.044715 * x**3)))),
        lambda x: F.gelu(x, approximate="tanh"),
    ),
    "one_minus_tanh": (complement, held(lambda x: 1 - torch.tanh(x)), lambda x: x * (2 * torch.sigmoid(-2 * x))),
}


class Mlp(nn.Module):
    """Two linear layers with an activation between them, called as a function; no biases."""

    def __init__(self, activation: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.up, self.down, self.activation = nn.Linear(6, 8, bias=False), nn.Linear(8, 3, bias=False), activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.activation(self.up(x)))


def relevances(model: nn.Module, preset: str, inputs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[str]]:
    """The relevance of each input, one call each in one context, and the warnings."""
    lrp = LRP(model, PRESETS[preset](), in_keys=["x"], out_keys=["y"])
    with warnings.catch_warnings(record=True) as caught, lrp:
        warnings.simplefilter("always")
        found = [lrp(TensorDict(x=x.clone(), batch_size=[len(x)]))["relevance", "x"] for x in inputs]
    return found, [str(w.message) for w in caught]


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("written", sorted(WRITTEN))
def test_a_gelu_written_out_gets_the_relevance_of_the_function(written: str, preset: str):
    """The first call (in the modes) and the later ones (the plan, or the modes again) give the relevance of the same
    model with its factor held by hand, and of the model with the function (whose identity rule divides by its input
    stabilised: 1e-6 apart), with no warning; they conserve."""
    torch.manual_seed(0)
    models = [Mlp(function).to(F64) for function in WRITTEN[written]]
    for model in models[1:]:
        model.load_state_dict(models[0].state_dict())
    inputs = [torch.randn(5, 6, dtype=F64, generator=torch.Generator().manual_seed(seed)) for seed in range(3)]
    (found, warned), (by_hand, _), (by_function, _) = (relevances(model, preset, inputs) for model in models)
    assert warned == []
    for relevance, oracle, function, x in zip(found, by_hand, by_function, inputs, strict=True):
        assert relative_error(relevance, oracle) <= 1e-12
        assert relative_error(relevance, function) <= 1e-6
        logit = models[0](x).max(-1).values
        assert torch.allclose(relevance.sum(-1), logit, rtol=1e-9, atol=1e-12)


def shifted_in_place(x: torch.Tensor) -> torch.Tensor:  # 1.5 + erf(x), the erf written into
    t = torch.erf(x)
    t.add_(0.5)
    return x * (1 + t)


def scaled_in_place(x: torch.Tensor) -> torch.Tensor:  # 1 + 3 erf(x), in [-2, 4]
    t = torch.erf(x)
    t.mul_(3)
    return x * (1 + t)


OFFSETS = {
    "1.5 + tanh": lambda x: x * (1.5 + torch.tanh(x)),
    "1 + (erf + 0.5 in place)": shifted_in_place,
    "1 + (3 erf in place)": scaled_in_place,
    "1 + sigmoid": lambda x: x * (1 + torch.sigmoid(x)),
    "add(tanh, 1, alpha=2)": lambda x: x * torch.add(torch.tanh(x), 1, alpha=2),
    "1 + erf, squared": lambda x: x * (1 + torch.erf(x)) ** 2,
}


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("offset", sorted(OFFSETS))
def test_other_offsets_of_an_odd_unit_are_still_named(offset: str, preset: str):
    """Only ``1 ± t`` is a scaled distribution: a factor ``1.5 + tanh(z)`` (in ``[0.5, 2.5]``), one plus a sigmoid
    (in ``[1, 2]``), ``tanh(z) + 2``, the square of ``1 + erf``, or one plus an erf written into in place before
    (``t.add_(0.5)``, ``t.mul_(3)``: its values another's) is no gate, and the module is named."""
    torch.manual_seed(0)
    model = Mlp(OFFSETS[offset]).to(F64)
    _, warned = relevances(model, preset, [torch.randn(5, 6, dtype=F64)])
    assert any("the model itself (Mlp)" in message for message in warned), warned
