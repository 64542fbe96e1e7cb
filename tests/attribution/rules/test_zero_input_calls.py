"""Activations called as functions at inputs of exactly 0: the relevance their identity rule drops is warned about.

The identity rule passes ``grad · f(x) / x``, so an output ``f(0) != 0`` (``torch.sigmoid``, ``F.softplus`` behind
a ReLU) keeps its relevance: the input relevance falls short of the explained output by exactly the relevance of
those outputs. An activation module warns about it; a call must too, naming the function. So must a clip called as a
function (``torch.clamp``, ``torch.clip``, ``F.hardtanh``, ``torch.maximum`` with a constant, in place or not) whose
bounds leave out 0: it gets the pass (or identity) rule as ``nn.Hardtanh`` does, and lost the relevance of its
outputs at zero inputs with no warning, where the module warned. At inputs exactly at the bounds, and at 0 where the
bounds hold 0 (``F.relu6``, ``clamp(-1, 1)``), the rule is exact.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.rules import CPLRP, AttnLRP, BaseRuleMapper, EpsilonPlus

F64 = torch.float64
ACTIVATIONS = {"sigmoid": torch.sigmoid, "softplus": F.softplus}


class ActivatedHead(nn.Module):
    """``head(f(relu(x)))`` with ``f`` called as a function: no module holds a rule but the head."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.head = nn.Linear(4, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(ACTIVATIONS[self.name](F.relu(x)))


def _explained(model: nn.Module, mapper, x: torch.Tensor, calls: int = 1) -> tuple[TensorDict, list[str]]:
    lrp = LRP(model, mapper, in_keys=["x"], out_keys=["y"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with lrp:
            for _ in range(calls):
                td = lrp(TensorDict(x=x, batch_size=[x.shape[0]]))
    return td, [str(w.message) for w in caught if "exactly 0" in str(w.message)]


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
@pytest.mark.parametrize("preset", [AttnLRP, CPLRP], ids=["AttnLRP", "CPLRP"])
def test_a_call_at_zero_inputs_warns_once_and_loses_exactly_their_relevance(name, preset):
    torch.manual_seed(0)
    model = ActivatedHead(name).to(F64)
    x = torch.randn(6, 4, dtype=F64)
    td, caught = _explained(model, preset(stabilizer=1e-15), x, calls=3)
    assert len(caught) == 1 and f"call of {name}" in caught[0] and f"{name}(0) != 0" in caught[0]
    # Closed form: the head's relevance of each activation output, f(h) · w_target, is lost where h = 0.
    h = F.relu(x)
    target = td["y"].argmax(-1)
    out_relevance = ACTIVATIONS[name](h) * model.head.weight.detach()[target]
    lost = (out_relevance * (h == 0)).sum(-1)
    explained = td["y"].gather(-1, target[:, None])[:, 0]
    torch.testing.assert_close(td["relevance", "x"].sum(-1), explained - lost, rtol=1e-9, atol=1e-12)
    assert lost.abs().max() > 0.1 * explained.abs().max()  # the loss is not small: the warning matters


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_no_warning_where_no_input_is_zero_and_relevance_is_conserved(name):
    torch.manual_seed(0)
    model = ActivatedHead(name).to(F64)
    x = torch.rand(6, 4, dtype=F64) + 0.1
    td, caught = _explained(model, AttnLRP(stabilizer=1e-15), x)
    assert caught == []
    torch.testing.assert_close(td["relevance", "x"].sum(-1), td["y"].max(-1).values, rtol=1e-9, atol=1e-12)


def test_no_warning_for_a_held_gate_at_zero_inputs():
    # sigmoid(relu(x)) gating a signal is held constant: no relevance reaches its outputs, none is lost.
    class Gated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.head = nn.Linear(4, 4, bias=False), nn.Linear(4, 3, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.up(x) * torch.sigmoid(F.relu(x)))

    torch.manual_seed(0)
    x = torch.randn(6, 4, dtype=F64)
    td, caught = _explained(Gated().to(F64), CPLRP(stabilizer=1e-15), x)
    assert caught == []
    torch.testing.assert_close(td["relevance", "x"].sum(-1), td["y"].max(-1).values, rtol=1e-9, atol=1e-12)


BOUND = torch.tensor(0.1, dtype=F64)
# Clips to bounds that leave out 0, called as functions: (name in the warning, call).
CLIPS_AWAY_FROM_ZERO = {
    "torch.clamp": ("clamp", lambda h: torch.clamp(h, 0.1, 6.0)),
    "Tensor.clamp": ("clamp", lambda h: h.clamp(0.1, 6.0)),
    "torch.clip": ("clip", lambda h: torch.clip(h, min=0.1)),
    "clamp_min": ("clamp_min", lambda h: h.clamp_min(0.1)),
    "clamp_": ("clamp_", lambda h: (h * 1.0).clamp_(0.1, 6.0)),
    "hardtanh": ("hardtanh", lambda h: F.hardtanh(h, 0.1, 6.0)),
    "hardtanh_inplace": ("hardtanh", lambda h: F.hardtanh(h * 1.0, 0.1, 6.0, inplace=True)),
    "maximum": ("maximum", lambda h: torch.maximum(h, BOUND)),
}
# Presets whose function modes give a clip the identity rule (AttnLRP, CP-LRP) or the pass rule (the others).
CLIP_PRESETS = {
    "AttnLRP": lambda: AttnLRP(stabilizer=1e-15),
    "CPLRP": lambda: CPLRP(stabilizer=1e-15),
    "EpsilonPlus": lambda: EpsilonPlus(epsilon=1e-15, stabilizer=1e-15),
    "LRP-0": lambda: BaseRuleMapper(stabilizer=0.0),
}


class ClippedHead(nn.Module):
    """``head(clip(relu(x)))`` with the clip called as a function."""

    def __init__(self, clip) -> None:
        super().__init__()
        self.clip = clip
        self.head = nn.Linear(4, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.clip(F.relu(x)))


@pytest.mark.parametrize("spelling", sorted(CLIPS_AWAY_FROM_ZERO))
@pytest.mark.parametrize("preset", sorted(CLIP_PRESETS))
def test_a_clip_call_at_zero_inputs_warns_once_and_loses_exactly_their_relevance(spelling, preset):
    name, clip = CLIPS_AWAY_FROM_ZERO[spelling]
    torch.manual_seed(0)
    model = ClippedHead(clip).to(F64)
    x = torch.randn(6, 4, dtype=F64)
    td, caught = _explained(model, CLIP_PRESETS[preset](), x, calls=3)
    assert len(caught) == 1 and f"call of {name}:" in caught[0], caught
    # Closed form: the head's relevance of each clipped output, clip(h) · w_target, is lost where h = 0.
    h = F.relu(x)
    target = td["y"].argmax(-1)
    out_relevance = torch.clamp(h, 0.1, 6.0) * model.head.weight.detach()[target]
    lost = (out_relevance * (h == 0)).sum(-1)
    explained = td["y"].gather(-1, target[:, None])[:, 0]
    torch.testing.assert_close(td["relevance", "x"].sum(-1), explained - lost, rtol=1e-9, atol=1e-12)
    assert lost.abs().max() > 0.1 * explained.abs().max()  # the loss is not small: the warning matters


@pytest.mark.parametrize("preset", sorted(CLIP_PRESETS))
def test_a_clip_call_and_its_module_warn_alike(preset):
    torch.manual_seed(0)
    x = torch.randn(6, 4, dtype=F64)
    module = ClippedHead(nn.Hardtanh(0.1, 6.0)).to(F64)
    call = ClippedHead(lambda h: F.hardtanh(h, 0.1, 6.0)).to(F64)
    call.head.load_state_dict(module.head.state_dict())
    by_module, module_warnings = _explained(module, CLIP_PRESETS[preset](), x)
    by_call, call_warnings = _explained(call, CLIP_PRESETS[preset](), x)
    assert len(module_warnings) == len(call_warnings) == 1
    torch.testing.assert_close(by_call["relevance", "x"], by_module["relevance", "x"], rtol=1e-12, atol=1e-14)


# Clips whose bounds hold 0: at inputs of exactly 0 the output is 0 too, and nothing is lost.
CLIPS_THROUGH_ZERO = {
    "relu6": lambda h: F.relu6(h),
    "clamp": lambda h: torch.clamp(h, -1.0, 1.0),
    "hardtanh_inplace": lambda h: F.hardtanh(h * 1.0, inplace=True),
    "clamp_max": lambda h: h.clamp_max(1.0),
}


@pytest.mark.parametrize("spelling", sorted(CLIPS_THROUGH_ZERO))
@pytest.mark.parametrize("preset", sorted(CLIP_PRESETS))
def test_a_clip_call_at_its_bounds_and_at_zero_conserves(spelling, preset):
    # Inputs exactly at the bounds (-1, 1, 6), at 0 and beyond the bounds: each unit passes on its clipped value's
    # relevance, and the input relevance sums to the explained output (no shifts), with no warning.
    class Clipped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(8, 3, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(CLIPS_THROUGH_ZERO[spelling](x * 1.0))

    torch.manual_seed(0)
    x = torch.tensor([-1.0, 1.0, 6.0, 0.0, 0.0, 7.5, -2.5, 0.5], dtype=F64).repeat(3, 1)
    x[1:] *= torch.tensor([[1.0], [-1.0]], dtype=F64)
    td, caught = _explained(Clipped().to(F64), CLIP_PRESETS[preset](), x)
    assert caught == []
    torch.testing.assert_close(td["relevance", "x"].sum(-1), td["y"].max(-1).values, rtol=1e-9, atol=1e-12)
