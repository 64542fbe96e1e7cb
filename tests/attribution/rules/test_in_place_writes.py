"""An activation buffer overwritten in place with a weight's values, under AttnLRP and CP-LRP (float64).

``buf.copy_(w)``, ``buf[...] = w`` or ``buf.zero_().add_(w)`` replace every element of an activation ``buf`` with a
tensor computed from parameters alone: ``buf`` then is that weight, and its product with the signal is linear in the
signal, which keeps all of its relevance. Taken for the activation it was before the write, the product got the
uniform rule of two activations, and half of its relevance went to the overwritten values, whose gradient is zero
(the relevance of the explained input halved). A write into part of the buffer leaves it an activation, as the same
tensor built out of place (``torch.cat``) is. Oracles: the same model with the weight out of place, and with it
stored whole as a parameter.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.mappers.base import BaseRuleMapper
from tdhook.attribution.mappers.presets import EpsilonPlus
from tdhook.attribution.mappers.transformer import CPLRP, AttnLRP
from tdhook.attribution.rules._in_place_writes import GATE_MARKS
from tdhook.attribution.rules.gates import GATE_MARK, SIGMOID_MARK
from tests.attribution.rules.test_activation_writes import _explained, assert_explained_as_out_of_place

F64 = torch.float64

WHOLE_WRITES = ["copy_", "copy_ broadcast", "setitem ...", "setitem :", "zero_ add_", "copy_ into a view of all"]


class OverwrittenBuffer(nn.Module):
    """``lin2(buf * lin1(x))`` (``lin2(buf * sigmoid(lin1(x)))`` where ``gated``) where ``buf`` starts as the
    activation ``lin0(x)`` and is overwritten, in place or not, with ``2 * vec`` (``build``); ``part`` overwrites its
    first three columns only."""

    def __init__(self, build: str, gated: bool = False) -> None:
        super().__init__()
        self.gated = gated
        self.lin0, self.lin1, self.lin2 = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 3)
        self.vec = nn.Parameter(torch.randn(6))
        self.stored = nn.Parameter(torch.zeros(6))
        self.build = build

    def buffer(self, x: torch.Tensor) -> torch.Tensor:
        buf = self.lin0(x) * 1.0
        weight = (2.0 * self.vec).expand_as(buf)
        build = self.build
        if build == "stored":
            return self.stored.expand_as(buf)
        if build == "out of place":
            return weight
        if build == "part out of place":
            return torch.cat([weight[:, :3], buf[:, 3:]], 1)
        if build == "part":
            buf[:, :3] = weight[:, :3]
        elif build == "copy_":
            buf.copy_(weight)
        elif build == "copy_ broadcast":
            buf.copy_(2.0 * self.vec)
        elif build == "setitem ...":
            buf[...] = 2.0 * self.vec
        elif build == "setitem :":
            buf[:] = weight
        elif build == "zero_ add_":
            buf.zero_().add_(weight)
        elif build == "copy_ into a view of all":
            buf.view(-1).copy_(weight.reshape(-1))
        return buf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        signal = self.lin1(x)
        return self.lin2(self.buffer(x) * (torch.sigmoid(signal) if self.gated else signal))


def model(build: str, gated: bool = False) -> nn.Module:
    torch.manual_seed(0)
    net = OverwrittenBuffer(build, gated).to(F64)
    with torch.no_grad():
        net.stored.copy_(2.0 * net.vec)
    return net


def relevance(net: nn.Module, mapper, x: torch.Tensor, calls: int = 2) -> torch.Tensor:
    lrp = LRP(net, rule_mapper=mapper, in_keys=["x"], out_keys=["y"])
    with warnings.catch_warnings(), lrp:
        warnings.simplefilter("ignore")
        for _ in range(calls):  # the first call records the rules' places, later ones follow them
            result = lrp(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))["relevance", "x"]
    return result


MAPPERS = {"AttnLRP": AttnLRP, "CPLRP": CPLRP, "AttnLRP, stabilised sums": lambda: AttnLRP(stabilize_additions=True)}


@pytest.mark.parametrize("mapper", list(MAPPERS))
@pytest.mark.parametrize("build", WHOLE_WRITES)
def test_an_activation_overwritten_with_a_weight_is_a_weight(build: str, mapper: str):
    x = torch.randn(5, 4, dtype=F64)
    expected = relevance(model("out of place"), MAPPERS[mapper](), x)
    torch.testing.assert_close(relevance(model("stored"), MAPPERS[mapper](), x), expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(relevance(model(build), MAPPERS[mapper](), x), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mapper", list(MAPPERS))
def test_an_activation_overwritten_in_part_stays_an_activation(mapper: str):
    x = torch.randn(5, 4, dtype=F64)
    expected = relevance(model("part out of place"), MAPPERS[mapper](), x)
    weight_only = relevance(model("out of place"), MAPPERS[mapper](), x)
    assert (expected - weight_only).abs().max() > 1e-3  # the uniform rule on the columns still an activation
    torch.testing.assert_close(relevance(model("part"), MAPPERS[mapper](), x), expected, rtol=1e-10, atol=1e-12)


GATE_MAPPERS = {"EpsilonPlus": EpsilonPlus, "LRP-0": lambda: BaseRuleMapper(stabilizer=0.0)}


@pytest.mark.parametrize("mapper", list(GATE_MAPPERS))
@pytest.mark.parametrize("build", ["copy_", "setitem :", "zero_ add_"])
def test_a_weight_overwriting_an_activation_gates_as_a_weight_under_the_cnn_presets(build: str, mapper: str):
    """The CNN presets hold a sigmoid gate where it multiplies an activation; times a weight, the gate is not held
    and passes relevance on. An activation overwritten with a weight's values is that weight: its gate is not held,
    and the relevance through the gate reaches the input (as LRP-0's gradient x input says)."""
    x = torch.randn(5, 4, dtype=F64)
    expected = relevance(model("out of place", gated=True), GATE_MAPPERS[mapper](), x)
    ours = relevance(model(build, gated=True), GATE_MAPPERS[mapper](), x)
    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-12)
    if mapper == "LRP-0":
        net, leaf = model(build, gated=True), x.clone().requires_grad_(True)
        out = net(leaf)
        (grad,) = torch.autograd.grad(out.gather(1, out.argmax(1, keepdim=True)).sum(), leaf)
        torch.testing.assert_close(ours, x * grad, rtol=1e-10, atol=1e-12)


class ViewOfAWrittenBuffer(nn.Module):
    """``lin2(row * h1[:, :3])`` with ``row`` the first three columns of a buffer: in place, ``row`` (a view of the
    activation ``buf``) is overwritten whole with a weight, then ``buf += h1`` writes an activation into it, ``row``
    included; out of place, ``row = w + h1[:, :3]``, an activation."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.lin0, self.lin1, self.lin2 = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(3, 2)
        self.vec = nn.Parameter(torch.randn(3))
        self.in_place = in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0, h1 = self.lin0(x), self.lin1(x)
        if self.in_place:
            buf = h0.clone()
            row = buf[:, :3]
            row.copy_(self.vec.expand_as(row))
            buf.add_(h1)
        else:
            row = self.vec + h1[:, :3]
        return self.lin2(row * h1[:, :3])


@pytest.mark.parametrize("mapper", ["AttnLRP", "CPLRP"])  # (buf += h1 is a sum of two activations: stabilised)
def test_a_view_overwritten_whole_stays_what_its_tensor_becomes(mapper: str):
    """A view overwritten whole with a weight's values (``buf[:, :3].copy_(w)``) is part of its tensor, which later
    writes reach: marked a weight, it kept that mark after ``buf += h1`` made it an activation, and its product with
    ``h1`` was taken for a linear map (all of the relevance to one factor, 2x that of the same model out of place)."""
    x = torch.randn(5, 4, dtype=F64)
    torch.manual_seed(0)
    expected = relevance(ViewOfAWrittenBuffer(in_place=False).to(F64), MAPPERS[mapper](), x)
    torch.manual_seed(0)
    ours = relevance(ViewOfAWrittenBuffer(in_place=True).to(F64), MAPPERS[mapper](), x)
    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-12)


def _ones(s: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return s * torch.ones_like(like)


# The functions of in-place writes (``torch.fill_(c, w)``, not ``c.fill_(w)``), each with the same model out of place.
# They were taken for calls out of place: an activation a weight's values replaced stayed one (1.0 off, relative L2,
# under AttnLRP), a weight an activation was written into stayed a weight (5.8 off for ``index_put_``, 12.8 for
# ``addmv_``).
FUNCTION_WRITES = {
    "torch.fill_(c, w)": (
        lambda s, h, g: _viewed_after(h.clone(), 2, lambda c: torch.fill_(c, 3 * s)) * g[:, :2],
        lambda s, h, g: _ones(3 * s, h[:, :2]) * g[:, :2],
    ),
    "torch.index_put_(c, rows, w)": (
        lambda s, h, g: (
            _viewed_after(h.clone(), 2, lambda c: torch.index_put_(c, (torch.arange(5),), _ones(3 * s, h))) * g[:, :2]
        ),
        lambda s, h, g: _ones(3 * s, h[:, :2]) * g[:, :2],
    ),
    "torch.index_put_(w, rows, h)": (
        lambda s, h, g: _viewed_after(_ones(s, h), 2, lambda c: torch.index_put_(c, (torch.arange(5),), h)) * g[:, :2],
        lambda s, h, g: h[:, :2] * g[:, :2],
    ),
    "torch.addmv_(w, h.T, 1)": (
        lambda s, h, g: torch.addmv_(_ones(s, h[0]), h.T, torch.ones_like(h[:, 0])) * g,
        lambda s, h, g: (_ones(s, h[0]) + h.T @ torch.ones_like(h[:, 0])) * g,
    ),
}


def _viewed_after(c: torch.Tensor, columns: int, write) -> torch.Tensor:
    """A view of ``c``'s first columns, taken before ``write(c)``."""
    view = c[:, :columns]
    write(c)
    return view


@pytest.mark.parametrize("preset", [AttnLRP, CPLRP], ids=lambda p: p.__name__)
@pytest.mark.parametrize("name", sorted(FUNCTION_WRITES))
def test_the_functions_of_in_place_writes_are_writes(name: str, preset):
    assert_explained_as_out_of_place(*FUNCTION_WRITES[name], preset)


def _written_gate(write):
    """``h[:, 2:4] * c[:, :2]`` with ``c`` a copy of the gate ``g`` written into by ``write(c, h)``."""

    def form(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        c = g.clone()
        write(c, h)
        return h[:, 2:4] * c[:, :2]

    return form


# Writes into a gate (``g`` a sigmoid of the input), each with the same model out of place. The gate kept its marks
# after an activation was written over it or added to it, and a product held it constant (AttnLRP and CP-LRP 1.0 off,
# relative L2, EpsilonPlus 0.8); an activation overwritten with a gate's values was no gate (1.0 off).
GATE_WRITES = {
    "c = g.clone(); c.copy_(h)": (
        _written_gate(lambda c, h: c.copy_(h * 1)),
        lambda s, h, g: h[:, 2:4] * (h[:, :2] * 1),
    ),
    "c = g.clone(); c.add_(h)": (_written_gate(lambda c, h: c.add_(h)), lambda s, h, g: h[:, 2:4] * (g + h)[:, :2]),
    "c = g.clone(); c.mul_(2) (a gate still)": (
        _written_gate(lambda c, h: c.mul_(2)),
        lambda s, h, g: h[:, 2:4] * (2 * g)[:, :2],
    ),
    "c = h.clone(); c.copy_(g)": (
        lambda s, h, g: h[:, 2:4] * h.clone().copy_(g)[:, :2],
        lambda s, h, g: h[:, 2:4] * g[:, :2],
    ),
}


@pytest.mark.parametrize("preset", [AttnLRP, CPLRP, EpsilonPlus], ids=lambda p: p.__name__)
@pytest.mark.parametrize("name", sorted(GATE_WRITES))
def test_a_gate_written_into_is_what_the_write_made_of_it(name: str, preset):
    """(The relevance only: under the CNN presets the coverage names the sigmoid of a gate overwritten whole, which
    the graph still reaches, with a gradient of zero.)"""
    in_place, out_of_place = GATE_WRITES[name]
    relevance, _ = _explained(in_place, preset)
    expected, _ = _explained(out_of_place, preset)
    torch.testing.assert_close(relevance, expected, rtol=1e-12, atol=1e-12)


def test_the_gate_marks_read_by_writes_are_the_gates_own():
    assert GATE_MARKS == (GATE_MARK, SIGMOID_MARK)
