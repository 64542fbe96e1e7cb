"""Writes in place through a detached alias of a tensor with autograd history (``c.detach()``, ``c.data``; float64).

Autograd does not see such a write: ``c``'s gradient still reaches what it was computed from before. They were not
seen at all (an activation overwritten with a weight's values explained as the activation: 1.0 off, relative L2,
under AttnLRP; a weight overwritten with an activation's, 11.4 off), and now raise where they change what ``c`` is.
Writes that leave it what it was pass: compared with the same model out of place.
"""

from __future__ import annotations

import pytest
import torch

from tdhook.attribution import AttnLRP, EpsilonPlus
from tests.attribution.rules.test_activation_writes import _explained

DETACHED_WRITES = {
    "c = h.clone(); c.detach().copy_(3s)": (
        lambda s, h, g: _written_through(h.clone(), g, torch.Tensor.detach, lambda a: a.copy_(3 * s)),
        "copy_",
    ),
    "c = h.clone(); c.data.copy_(3s)": (
        lambda s, h, g: _written_through(h.clone(), g, lambda c: c.data, lambda a: a.copy_(3 * s)),
        "copy_",
    ),
    "c = s * ones; c.detach()[:, :2].copy_(h)": (
        lambda s, h, g: _written_through(
            s * torch.ones_like(h), g, torch.Tensor.detach, lambda a: a[:, :2].copy_(h[:, :2])
        ),
        "copy_",
    ),
    "c = h.clone(); torch.detach(c).mul_(2)": (
        lambda s, h, g: _written_through(h.clone(), g, torch.detach, lambda a: a.mul_(2)),
        "mul_",
    ),
}


def _written_through(c: torch.Tensor, g: torch.Tensor, alias, write) -> torch.Tensor:
    """``c * g`` after ``write(alias(c))``."""
    write(alias(c))
    return c * g


@pytest.mark.parametrize("preset", [AttnLRP, EpsilonPlus], ids=lambda p: p.__name__)
@pytest.mark.parametrize("name", sorted(DETACHED_WRITES))
def test_a_write_through_a_detached_alias_of_an_activation_raises(name: str, preset):
    form, op = DETACHED_WRITES[name]
    with pytest.raises(RuntimeError, match=rf"{op} writes in place into a detached alias"):
        _explained(form, preset)


def _weight_scaled_through_an_alias(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = s * torch.ones_like(h)
    c.detach().mul_(2)  # a weight's values over a weight: still one, as 2 * s is
    return c * g


def _alias_reshaped(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = h.clone()
    alias = c.detach()
    alias.unsqueeze_(0)  # no values written
    alias.requires_grad_(True)
    return c * g


@pytest.mark.parametrize("preset", [AttnLRP, EpsilonPlus], ids=lambda p: p.__name__)
@pytest.mark.parametrize(
    "forms",
    [
        (_weight_scaled_through_an_alias, lambda s, h, g: (2 * s * torch.ones_like(h)) * g),
        (_alias_reshaped, lambda s, h, g: h * g),
    ],
    ids=["a weight scaled through c.detach()", "c.detach() reshaped and made a leaf in place"],
)
def test_writes_through_a_detached_alias_that_leave_the_tensor_what_it_was_pass(forms, preset):
    in_place, out_of_place = forms
    relevance, _ = _explained(in_place, preset)
    expected, _ = _explained(out_of_place, preset)
    torch.testing.assert_close(relevance, expected, rtol=1e-12, atol=1e-12)
