"""Constants written in place into part of an activation, or an activation into part of a constant (float64).

``buf[:, :3] = w[:, :3]`` (an activation ``buf``, a weight ``w``), ``buf.masked_fill_(m, 2.0)``, ``buf.index_put_``,
``c[:, :2] = h[:, :2]`` (a constant ``c``, an activation ``h``), ...: the tensor holds constants in some elements,
an activation in the others. In a product with a signal, a constant element takes none of the relevance, as it does
multiplied apart (a product with a constant is a linear map). The write left the whole tensor an activation: the
uniform rule gave its constant elements half of the product's relevance, passed on to nothing (AttnLRP, CP-LRP), and
the CNN presets held the sigmoid gate against a constant. Oracle, from the definition: the same values with each
element's product taken apart, ``torch.where(m, c * s, h * s)`` (``c`` a constant, ``h`` the activation); the layers
and the signal are the same.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.mappers.presets import EpsilonAlpha2Beta1, EpsilonPlus
from tdhook.attribution.mappers.transformer import CPLRP, AttnLRP
from tdhook.attribution.rules._constant_elements import CONSTANTS_JOINED, constants_shown, note_constants_written
from tdhook.attribution.rules.gates import HeldGates, is_gate

F64 = torch.float64
MAPPERS = {"AttnLRP": AttnLRP, "CPLRP": CPLRP, "EpsilonPlus": EpsilonPlus, "EpsilonAlpha2Beta1": EpsilonAlpha2Beta1}
# Where the constants go (a pattern that differs by row, for the masks): of a buffer of 5 rows and 6 columns.
MASK = torch.tensor([[True, False, True, False, False, True]] * 3 + [[False, True, True, False, True, False]] * 2)
ROWS, COLS = MASK.nonzero(as_tuple=True)


def _masked_scatter(buf: torch.Tensor, w: torch.Tensor, h: torch.Tensor) -> None:
    buf.masked_scatter_(MASK, w[MASK])


# Each write, in place, and where its constants are with their values (``None``: a weight's, ``w``; a number: it).
Write = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]
WRITES: dict[str, tuple[Write, torch.Tensor, float | None]] = {
    "buf[:, :3] = w[:, :3]": (lambda buf, w, h: buf.__setitem__((slice(None), slice(0, 3)), w[:, :3]), None, None),
    "buf[:, 1:4].copy_(w[:, 1:4])": (lambda buf, w, h: buf[:, 1:4].copy_(w[:, 1:4]), None, None),
    "buf.masked_fill_(m, 2.0)": (lambda buf, w, h: buf.masked_fill_(MASK, 2.0), MASK, 2.0),
    "buf[m] = 2.0": (lambda buf, w, h: buf.__setitem__(MASK, 2.0), MASK, 2.0),
    "buf.index_put_((rows, cols), w[rows, cols])": (
        lambda buf, w, h: buf.index_put_((ROWS, COLS), w[ROWS, COLS]),
        MASK,
        None,
    ),
    "buf.index_copy_(1, i, w[:, i])": (
        lambda buf, w, h: buf.index_copy_(1, torch.tensor([0, 4]), w[:, [0, 4]]),
        None,
        None,
    ),
    "buf.index_fill_(1, i, -1.5)": (lambda buf, w, h: buf.index_fill_(1, torch.tensor([2, 5]), -1.5), None, -1.5),
    "buf.masked_scatter_(m, w[m])": (_masked_scatter, MASK, None),
    "buf.T[:2] = w.T[:2]": (lambda buf, w, h: buf.T.__setitem__(slice(0, 2), w.T[:2]), None, None),
}
# The constant columns of the writes with no mask above.
COLUMNS = {
    "buf[:, :3] = w[:, :3]": [0, 1, 2],
    "buf[:, 1:4].copy_(w[:, 1:4])": [1, 2, 3],
    "buf.index_copy_(1, i, w[:, i])": [0, 4],
    "buf.index_fill_(1, i, -1.5)": [2, 5],
    "buf.T[:2] = w.T[:2]": [0, 1],
}


def _where(name: str) -> torch.Tensor:
    mask = WRITES[name][1]
    if mask is not None:
        return mask
    where = torch.zeros(5, 6, dtype=torch.bool)
    where[:, COLUMNS[name]] = True
    return where


class Written(nn.Module):
    """``out(buf * signal)``, ``buf`` made in place (``form``) or its products apart (``apart``), ``signal`` a ReLU's
    output or a sigmoid gate."""

    def __init__(self, form: str, signal: str, apart: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.h, self.s, self.out = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 3)
        self.vec = nn.Parameter(torch.randn(6))
        self.form, self.signal, self.apart = form, signal, apart

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.h(x))
        s = torch.sigmoid(self.s(x)) if self.signal == "sigmoid" else torch.relu(self.s(x))
        w = (2.0 * self.vec).expand(x.shape[0], -1)  # a weight, computed from a parameter alone
        if self.form in WRITES:
            write, _, number = WRITES[self.form]
            if not self.apart:
                buf = h * 1.0
                write(buf, w, h)
                return self.out(buf * s)
            where = _where(self.form)
            constant = torch.full_like(h, number) if number is not None else w
            return self.out(torch.where(where, constant * s, h * s))
        # An activation into part of a constant: ``c = 2 * vec``, its first two columns then ``h``'s.
        c = (2.0 * self.vec) * torch.ones_like(h)
        if self.apart:
            return self.out(torch.cat([h[:, :2] * s[:, :2], c[:, 2:] * s[:, 2:]], 1))
        if self.form == "c[:, :2] = h[:, :2]":
            c[:, :2] = h[:, :2]
        elif self.form == "c[:, :2].copy_(h[:, :2])":
            c[:, :2].copy_(h[:, :2])
        elif self.form == "c.index_copy_(1, i, h[:, :2])":
            c.index_copy_(1, torch.tensor([0, 1]), h[:, :2])
        return self.out(c * s)


FORMS = [*WRITES, "c[:, :2] = h[:, :2]", "c[:, :2].copy_(h[:, :2])", "c.index_copy_(1, i, h[:, :2])"]


def relevance(model: nn.Module, mapper: str, x: torch.Tensor) -> torch.Tensor:
    lrp = LRP(model, rule_mapper=MAPPERS[mapper](), in_keys=["x"], out_keys=["y"])
    with warnings.catch_warnings(), lrp:
        warnings.simplefilter("ignore")
        for _ in range(2):  # the first call records the rules' places, a later one follows them
            result = lrp(TensorDict(x=x.clone(), batch_size=[5]))["relevance", "x"]
    return result


@pytest.mark.parametrize("mapper", sorted(MAPPERS))
@pytest.mark.parametrize("signal", ["relu", "sigmoid"])
@pytest.mark.parametrize("form", FORMS)
def test_constants_written_beside_an_activation_take_no_relevance_in_a_product(form: str, signal: str, mapper: str):
    x = torch.randn(5, 4, dtype=F64, generator=torch.Generator().manual_seed(1))
    expected = relevance(Written(form, signal, apart=True).double(), mapper, x)
    plain = Written(form, signal).double()
    torch.testing.assert_close(plain(x), Written(form, signal, apart=True).double()(x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(relevance(plain, mapper, x), expected, rtol=1e-10, atol=1e-12)


def test_constants_written_then_an_activation_over_them_are_no_more():
    # ``buf[:, :3] = 1.0`` notes three constant columns; ``buf[:, :1] += h`` and ``buf[:, 1:2] = h`` make two of them
    # an activation again; a write of zeros over an activation notes nothing (zero in a product, held or not).
    x = torch.randn(2, 4, dtype=F64, requires_grad=True)
    with HeldGates():
        h = x[:, :1] * 1
        buf = torch.cat([x, x], 1) * 1
        buf[:, :3] = 1.0
        noted = constants_shown(buf).clone()
        buf[:, :1] += h
        buf[:, 1:2] = h
        after = constants_shown(buf)
        views = [is_gate(buf[:, 2:3]), is_gate(buf[:, :2]), is_gate(buf[:, 3:])]
        zeros = x * 1
        zeros.masked_fill_(torch.tensor([[True, False, False, False]] * 2), 0.0)
    assert noted[0].tolist() == [True] * 3 + [False] * 5
    assert after[0].tolist() == [False, False, True] + [False] * 5
    assert views == [True, False, False]
    assert CONSTANTS_JOINED not in zeros.__dict__ and constants_shown(zeros) is None


def test_constants_all_overwritten_by_an_activation_are_dropped():
    x = torch.randn(2, 3, dtype=F64, requires_grad=True)
    with HeldGates():
        buf = x * 1
        buf[:, 0] = 2.0
        assert constants_shown(buf) is not None
        buf.copy_(x * 3)
    assert CONSTANTS_JOINED not in buf.__dict__ and not is_gate(buf[:, :1])


def test_a_write_whose_reach_cannot_be_read_over_constants_warns():
    # Indices that cannot be read (here: out of range, as a transform's wrapped ones are unreadable): where the
    # constants are after the write is not known, they are taken as an activation's, and it says so.
    x = torch.randn(2, 3, dtype=F64, requires_grad=True)
    with HeldGates():
        buf = x * 1
        buf[:, 0] = 2.0
    with pytest.warns(UserWarning, match=r"__setitem__.*constants beside an activation"):
        note_constants_written(torch.Tensor.__setitem__, (buf, torch.tensor([7]), 1.0), {}, True, False, 1.0)
    assert constants_shown(buf) is None
