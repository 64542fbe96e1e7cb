"""A ``where`` of a gate and another activation whose condition takes one of them in every element (a padding or done
mask with nothing masked, or everything) is marked as the piece it took: a gate where it took the gate everywhere.

The oracle: the same model with the products taken per element before the choice (``where(c, g * s, h * s)``, the
products of each piece whole, which the gate tests check). The mask is an input of the model that is not explained,
as a padding mask is: a wrapper's later calls may get another one, on inputs of the same shapes, and each call's
relevance must be the oracle's for its own mask, whichever mask the first call of the context had.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.mappers.presets import EpsilonPlus
from tdhook.attribution.mappers.transformer import CPLRP, AttnLRP
from tdhook.attribution.rules._whole_choices import choice_follows_values, keep_whole_choice
from tdhook.attribution.rules.gates import is_gate, mark_gate, mark_weights
from tests.attribution.rules._helpers import randn
from tests.conftest import relative_error

MAPPERS = {"AttnLRP": AttnLRP, "CPLRP": CPLRP, "EpsilonPlus": EpsilonPlus}
MASKS = {
    "all": torch.ones(3, 6, dtype=torch.bool),
    "none": torch.zeros(3, 6, dtype=torch.bool),
    "mixed": torch.tensor([True, False, True, False, False, True]).expand(3, 6),
    "rows": torch.tensor([[True], [False], [True]]).expand(3, 6),  # (its first column takes each piece somewhere)
}

#: (the product with the choice, the oracle's per element) of a mask ``c``, a sigmoid's gate ``g``, a signal ``s``, an
#: activation ``h`` and a tanh ``t`` (a gate of another kind, which CP-LRP holds and AttnLRP does not).
FORMS = {
    "where(c, g, h) * s": (
        lambda c, g, s, h, t: torch.where(c, g, h) * s,
        lambda c, g, s, h, t: torch.where(c, g * s, h * s),
    ),
    "s * g.where(c, h)": (
        lambda c, g, s, h, t: s * g.where(c, h),
        lambda c, g, s, h, t: torch.where(c, s * g, s * h),
    ),
    "where(c, g, other=h) * s": (
        lambda c, g, s, h, t: torch.where(c, g, other=h) * s,
        lambda c, g, s, h, t: torch.where(c, g * s, h * s),
    ),
    "where(c, h, g) * s": (
        lambda c, g, s, h, t: torch.where(c, h, g) * s,
        lambda c, g, s, h, t: torch.where(c, h * s, g * s),
    ),
    "where(c, t, g) * s": (
        lambda c, g, s, h, t: torch.where(c, t, g) * s,
        lambda c, g, s, h, t: torch.where(c, t * s, g * s),
    ),
    "where(c[:, :1], g, h) * s": (  # a mask per sample (a done mask), spread over the units
        lambda c, g, s, h, t: torch.where(c[:, :1], g, h) * s,
        lambda c, g, s, h, t: torch.where(c[:, :1], g * s, h * s),
    ),
    "where(c, g[:1], h) * s": (  # a gate spread over the batch
        lambda c, g, s, h, t: torch.where(c, g[:1], h) * s,
        lambda c, g, s, h, t: torch.where(c, g[:1] * s, h * s),
    ),
    "where(c, softmax(g), h) * s": (  # a softmax's weights (held by the transformer presets)
        lambda c, g, s, h, t: torch.where(c, torch.softmax(3 * g, -1), h) * s,
        lambda c, g, s, h, t: torch.where(c, torch.softmax(3 * g, -1) * s, h * s),
    ),
    "where(c, h, cat([g, h])) * s": (  # a join of a gate and an activation, a gate in some elements only
        lambda c, g, s, h, t: torch.where(c, h, torch.cat([g[:, :3], h[:, 3:]], 1)) * s,
        lambda c, g, s, h, t: torch.where(c, h * s, torch.cat([g[:, :3].detach() * s[:, :3], h[:, 3:] * s[:, 3:]], 1)),
    ),
    "where(c, g, 0.0) * s": (  # a gate filled with a constant: one, whatever it takes
        lambda c, g, s, h, t: torch.where(c, g, 0.0) * s,
        lambda c, g, s, h, t: torch.where(c, g.detach(), 0.0) * s,
    ),
    "g.masked_fill(~c, 0.0) * s": (
        lambda c, g, s, h, t: g.masked_fill(~c, 0.0) * s,
        lambda c, g, s, h, t: g.detach().masked_fill(~c, 0.0) * s,
    ),
}


class Chosen(nn.Module):
    """A sigmoid's gate over 6 units chosen with an activation by a mask, as ``form`` says, times a signal;
    ``apart``: the products taken per element before the choice (the oracle)."""

    def __init__(self, form: str, apart: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.h, self.s, self.t = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(4, 6)
        self.out = nn.Linear(6, 3)
        self.product, self.tanh = FORMS[form][1 if apart else 0], "t," in form

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        signal, other = torch.relu(self.s(x)), torch.relu(self.h(x))
        tanh = torch.tanh(self.t(x)) if self.tanh else None
        return self.out(self.product(mask, torch.sigmoid(self.a(x)), signal, other, tanh))


def _relevance(model: nn.Module, x: torch.Tensor, masks: list[str], mapper: str) -> list[torch.Tensor]:
    """The relevance of ``x`` in one call per mask of ``masks``, in one open context (the mask is not explained)."""
    module = TensorDictModule(model, in_keys=["x", "mask"], out_keys=["y"])
    lrp = LRP(module, rule_mapper=MAPPERS[mapper](), in_keys=["x"])
    with lrp:
        return [lrp(TensorDict(x=x.clone(), mask=MASKS[m], batch_size=[3]))["relevance", "x"] for m in masks]


def _check(form: str, masks: list[str], mapper: str) -> None:
    torch.manual_seed(1)
    x = randn(3, 4)
    model, oracle = Chosen(form).double(), Chosen(form, apart=True).double()
    for mask in masks:
        torch.testing.assert_close(model(x, MASKS[mask]), oracle(x, MASKS[mask]), rtol=1e-12, atol=1e-12)
    for mask, actual in zip(masks, _relevance(model, x, masks, mapper), strict=True):
        (expected,) = _relevance(oracle, x, [mask], mapper)
        assert relative_error(actual, expected) <= 1e-10, (mask, relative_error(actual, expected))


# CP-LRP holds a softmax's output whole, a constant to the rules: chosen beside an activation, the product with the
# choice is one of two activations whose uniform rule halves the signal's share where the constant was taken (a
# constant chosen so is not held as a join's constants are), which the oracle's product with the constant does not.
CASES = [(f, m) for f in sorted(FORMS) for m in sorted(MAPPERS) if not ("softmax" in f and m == "CPLRP")]


@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize(("form", "mapper"), CASES)
def test_a_choice_that_takes_one_piece_everywhere_is_marked_as_that_piece(form: str, mask: str, mapper: str):
    # A gate taken in every element left no gate (0.47-1.05 off, relative L2, under AttnLRP and CP-LRP, 0.14-0.20
    # under EpsilonPlus); a sigmoid taken in every element beside a tanh, a gate of another kind (0.47 under AttnLRP).
    _check(form, [mask, mask], mapper)


ORDERS = [["all", "mixed"], ["mixed", "all"], ["none", "mixed"], ["mixed", "none"], ["all", "none"], ["none", "all"]]
ORDERS += [["all", "rows"], ["rows", "none"]]


@pytest.mark.parametrize("mapper", sorted(MAPPERS))
@pytest.mark.parametrize("order", ORDERS, ids="->".join)
@pytest.mark.parametrize(
    "form", ["where(c, g, h) * s", "where(c, t, g) * s", "where(c[:, :1], g, h) * s", "where(c, g, 0.0) * s"]
)
def test_a_context_recorded_on_one_mask_is_right_on_another(form: str, order: list[str], mapper: str):
    # A first call that took the gate everywhere or nowhere decided the later calls: a plan of its rules replayed on a
    # mask that takes it in some elements (0.47 off, relative L2, under AttnLRP and CP-LRP), or no gates' mode at all
    # (0.10-0.17 under EpsilonPlus).
    _check(form, order, mapper)


def test_the_piece_taken_everywhere_gives_its_marks():
    x = randn(2, 6).requires_grad_(True)
    gate, tanh, other = mark_gate(torch.sigmoid(x * 1), x, sigmoid=True), mark_gate(torch.tanh(x * 1), x), x * 2
    everywhere, nowhere = MASKS["all"][:2], MASKS["none"][:2]
    chosen = torch.where(everywhere, gate, other)
    assert keep_whole_choice(everywhere, (gate, other), chosen) and is_gate(chosen)
    chosen = torch.where(nowhere, gate, other)
    assert keep_whole_choice(nowhere, (gate, other), chosen) and not is_gate(chosen)
    chosen = torch.where(nowhere, tanh, gate)
    chosen.__dict__.update(tanh.__dict__)  # marked a gate of the other kind, as a join of the two is
    assert keep_whole_choice(nowhere, (tanh, gate), chosen) and getattr(chosen, "_tdhook_sigmoid_gate", False)
    weights = mark_weights(torch.softmax(x * 1, -1))
    chosen = torch.where(everywhere[0], weights, other)  # (a condition broadcast over the result)
    assert keep_whole_choice(everywhere[0], (weights, other), chosen)
    assert getattr(chosen, "_tdhook_softmax_weights", False)
    assert not keep_whole_choice(MASKS["mixed"][:2], (gate, other), torch.where(MASKS["mixed"][:2], gate, other))


def test_a_choice_follows_the_values_where_its_pieces_differ_in_kind():
    x = randn(2, 6).requires_grad_(True)
    gate, tanh, other = mark_gate(torch.sigmoid(x * 1), x, sigmoid=True), mark_gate(torch.tanh(x * 1), x), x * 2
    c = MASKS["mixed"][:2]
    assert choice_follows_values(torch.where, (c, gate, other), {})
    assert choice_follows_values(torch.Tensor.where, (tanh, c), {"other": gate})
    assert not choice_follows_values(torch.where, (c, gate, 0.0), {})  # a gate still, whatever it takes
    assert not choice_follows_values(torch.where, (c, other, x * 3), {})  # no gate at all: a Hugging Face mask's
    second = mark_gate(torch.sigmoid(x * 2), x, sigmoid=True)
    assert not choice_follows_values(torch.where, (c, gate, second), {})  # gates of one kind
    assert not choice_follows_values(torch.Tensor.masked_fill, (gate, c, 0.0), {})


def test_only_the_first_call_asks_whether_a_choice_follows_the_values(monkeypatch: pytest.MonkeyPatch):
    # The gates' mode of the CNN presets asked it of every where in every later call too, which its answer no longer
    # decides (16 Python calls more per where and per call: a torchrl LSTM policy's later calls grew by 30 of 7,056).
    from tdhook.attribution.rules import gates

    asked = []
    monkeypatch.setattr(gates, "choice_follows_values", lambda *a: asked.append(1) or choice_follows_values(*a))
    torch.manual_seed(1)
    model = Chosen("where(c, g, h) * s").double()
    module = TensorDictModule(model, in_keys=["x", "mask"], out_keys=["y"])
    lrp = LRP(module, rule_mapper=EpsilonPlus(), in_keys=["x"])
    counts = []
    with lrp:
        for mask in ["none", "mixed", "all"]:
            before = len(asked)
            lrp(TensorDict(x=randn(3, 4), mask=MASKS[mask], batch_size=[3]))
            counts.append(len(asked) - before)
    assert counts[0] > 0 and counts[1:] == [0, 0], counts
