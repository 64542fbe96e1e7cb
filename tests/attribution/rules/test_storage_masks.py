"""The masks that in-place writes keep on a tensor for its views: counted while their tensor lives.

A flag set at the first mask of the process made every later product of every call look its factors up in masks
(the gate test of a product took 15 µs instead of 4 µs after one call that wrote into a viewed tensor).
"""

from __future__ import annotations

import gc

import pytest
import torch

from tdhook.attribution import CPLRP, AttnLRP, EpsilonPlus
from tdhook.attribution.rules._activation_writes import MASKS_MADE
from tdhook.attribution.rules._gate_writes import GATE_MASKS_MADE, gate_marks_shown, note_gate_written
from tests.attribution.rules.test_activation_writes import _explained


def _gate_and_weight_written_over_views(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = h.clone()
    v, w = c[:, :2], c[:, 2:4]
    c[:, :2] = g[:, :2]  # a gate mask
    c[:, 2:4] = s * torch.ones_like(w)  # an activation mask
    return h[:, 4:6] * v + w * h[:, :2]


@pytest.mark.parametrize("preset", [AttnLRP, CPLRP, EpsilonPlus], ids=lambda p: p.__name__)
def test_no_mask_is_counted_once_the_tensors_of_a_call_are_freed(preset):
    gc.collect()
    counted = len(GATE_MASKS_MADE), len(MASKS_MADE)
    seen = []

    def form(s, h, g):
        out = _gate_and_weight_written_over_views(s, h, g)
        seen.append((len(GATE_MASKS_MADE), len(MASKS_MADE)))  # counted while the call's tensors live
        return out

    _explained(form, preset)
    gc.collect()
    assert seen[-1][0] > counted[0] and seen[-1][1] > counted[1]  # (the first call, outside LRP, makes none)
    assert (len(GATE_MASKS_MADE), len(MASKS_MADE)) == counted


def test_a_mask_on_a_tensor_that_lives_on_is_read_by_its_views():
    kept = torch.zeros(2, 3)
    gc.collect()
    before = len(GATE_MASKS_MADE)
    note_gate_written(kept[:, :1], None, {"_tdhook_activation_of": kept, "_tdhook_sigmoid_gate": True})
    gc.collect()
    assert len(GATE_MASKS_MADE) == before + 1
    assert gate_marks_shown(kept[:, :1])["_tdhook_sigmoid_gate"] and gate_marks_shown(kept[:, 1:]) == {}
    del kept
    gc.collect()
    assert len(GATE_MASKS_MADE) == before
