"""A product with a join of gates and other activations whole (``m * s``, ``m = torch.cat([sigmoid(a), tanh(b)], 1)``):
its gate elements held, the others under the rule of a product without gates, against the same model written with
the join's pieces apart (``torch.cat([sigmoid(a) * s1, tanh(b) * s2], 1)``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.attribution.rules.test_joined_gates import MAPPERS, assert_same_relevance

# A product of the mixed join ``m`` (laid out as ``torch.cat([sigmoid, tanh], -1)``) and the signal ``s``: each
# order of factors, the call, and broadcasting (``m`` over heads of the signal; the signal over units of ``m``).
PRODUCTS = {
    "m * s": lambda m, s: m * s,
    "s * m": lambda m, s: s * m,
    "torch.mul(m, s)": lambda m, s: torch.mul(m, s),
    "s.mul(m)": lambda m, s: s.mul(m),
    "m[:, None] * heads": lambda m, s: (m[:, None] * s.view(-1, 2, 3).repeat(1, 1, 2)).sum(1),
    "heads * m[:, None]": lambda m, s: (s.view(-1, 2, 3).repeat(1, 1, 2) * m[:, None]).sum(1),
    "m * s[:, :1]": lambda m, s: m * s[:, :1],
    # In place: the join written into, or a copy of the signal.
    "m.mul_(s)": lambda m, s: m.mul_(s),
    "m *= s": lambda m, s: torch.Tensor.__imul__(m, s),
    "s.mul_(m)": lambda m, s: (s * 1).mul_(m),
}

INDEX = torch.tensor([5, 0, 4, 1, 3, 2])
# A new tensor with the mixed join's values at the same places, a copy or a positive scaling, or rearranged, times the
# signal (laid out as the new tensor is); the result laid out as the join.
KEPT = {
    "(m * 2) * s": lambda m, s: (m * 2) * s,
    "(2 * m) * s": lambda m, s: (2 * m) * s,
    "m / 2 * s": lambda m, s: m / 2 * s,
    "m.div(2) * s": lambda m, s: m.div(2) * s,
    "m * tensor(2.0) * s": lambda m, s: m * torch.tensor(2.0, dtype=m.dtype) * s,
    "m.t().contiguous() * s.t()": lambda m, s: (m.t().contiguous() * s.t()).t(),
    "m.transpose(0, 1).clone() * s.t()": lambda m, s: (m.transpose(0, 1).clone() * s.t()).t(),
    "m.clone() * s": lambda m, s: m.clone() * s,
    "torch.clone(m) * s": lambda m, s: torch.clone(m) * s,
    "(m.t().contiguous() * 2) * s.t()": lambda m, s: ((m.t().contiguous() * 2) * s.t()).t(),
    # The values rearranged into a new tensor: a reshape that copies, a flip, an advanced index, a repeat.
    "m.t().reshape(-1) * s.t().reshape(-1)": lambda m, s: (m.t().reshape(-1) * s.t().reshape(-1)).view(6, -1).t(),
    "m.flip(1) * s.flip(1)": lambda m, s: (m.flip(1) * s.flip(1)).flip(1),
    "m[:, index] * s[:, index]": lambda m, s: (m[:, INDEX] * s[:, INDEX])[:, INDEX.argsort()],
    "m.repeat(1, 2) * s.repeat(1, 2)": lambda m, s: (m.repeat(1, 2) * s.repeat(1, 2))[:, 6:],
    # Padded: the constants padded with beside the gate elements, or the values copied.
    "F.pad(m) * F.pad(s)": lambda m, s: (F.pad(m, (1, 2)) * F.pad(s, (1, 2)))[:, 1:-2],
    "F.pad(m, value=1)[:, :-1] * s": lambda m, s: F.pad(m, (0, 1), value=1.0)[:, :-1] * s,
    "F.pad(m, replicate) * F.pad(s, replicate)": lambda m, s: (
        F.pad(m[:, None], (1, 1), mode="replicate") * F.pad(s[:, None], (1, 1), mode="replicate")
    )[:, 0, 1:-1],
    "torch.constant_pad_nd(m) * F.pad(s)": lambda m, s: (torch.constant_pad_nd(m, (2, 0)) * F.pad(s, (2, 0)))[:, 2:],
}


class MixedProduct(nn.Module):
    """``out(product(cat([sigmoid(z1), tanh(z2)], 1), relu(s(x))))``; ``apart`` computes the product piece by piece
    (the oracle), each piece its own product (a gate's, or two activations')."""

    def __init__(self, product: str, apart: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.s, self.out = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 3)
        self.product, self.apart = {**PRODUCTS, **KEPT}[product], apart

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z, signal = self.a(x), torch.relu(self.s(x))
        pieces = [torch.sigmoid(z[:, :3]), torch.tanh(z[:, 3:])]
        if not self.apart:
            return self.out(self.product(torch.cat(pieces, 1), signal))
        # Each piece times the signal as the whole would be: the product of the piece beside zeros, kept where it is.
        zeros = [torch.zeros_like(piece) for piece in pieces]
        gate = self.product(torch.cat([pieces[0], zeros[1]], 1), signal)[:, :3]
        other = self.product(torch.cat([zeros[0], pieces[1]], 1), signal)[:, 3:]
        return self.out(torch.cat([gate, other], 1))


@pytest.mark.parametrize("mapper", sorted(MAPPERS))
@pytest.mark.parametrize("product", sorted(PRODUCTS))
def test_a_product_with_a_mixed_join_holds_its_gate_elements_alone(product: str, mapper: str):
    # 0.20-0.65 off, relative L2, under AttnLRP, 0.44-0.97 under CP-LRP, 0.05-0.13 under EpsilonPlus.
    model = MixedProduct(product).double()
    assert_same_relevance(model, MixedProduct(product, apart=True).double(), mapper)


class WrittenJoin(nn.Module):
    """A join of a gate and another activation, written into in place, then multiplied whole; ``apart``: the same
    product piece by piece (the oracle)."""

    def __init__(self, apart: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.s, self.out = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 3)
        self.apart = apart

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z, signal = self.a(x), torch.relu(self.s(x))
        if self.apart:
            return self.out(
                torch.cat([torch.sigmoid(z[:, :3]) * signal[:, :3], torch.relu(z[:, 3:]) * signal[:, 3:]], 1)
            )
        m = torch.cat([torch.sigmoid(z[:, :3]), torch.tanh(z[:, 3:])], 1)
        m[:, 3:] = torch.relu(z[:, 3:])  # what its other elements are now, a gate of another kind or none: not known
        return self.out(m * signal)


@pytest.mark.parametrize("mapper", sorted(MAPPERS))
def test_a_product_with_a_join_written_into_holds_its_gate_elements(mapper: str):
    # AttnLRP holds sigmoid-like gates alone: the mask over the join, kept by the write, tells. CP-LRP and EpsilonPlus
    # hold gates of any kind: where they are after the write is noted too (see _other_gate_writes; it was not known,
    # and the product raised).
    assert_same_relevance(WrittenJoin().double(), WrittenJoin(apart=True).double(), mapper)


class ThreeKinds(nn.Module):
    """``s * cat([sigmoid(z1), tanh(z2), 2 * z3])``: a sigmoid-like gate, a gate of another kind (held by CP-LRP
    alone) and no gate; ``nested`` joins the first two first; ``apart``: each piece its own product (the oracle)."""

    def __init__(self, apart: bool = False, nested: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.s, self.out = nn.Linear(4, 9), nn.Linear(4, 9), nn.Linear(9, 3)
        self.apart, self.nested = apart, nested

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z, signal = self.a(x), torch.relu(self.s(x))
        pieces = [torch.sigmoid(z[:, :3]), torch.tanh(z[:, 3:6]), z[:, 6:] * 2]
        if self.apart:
            return self.out(torch.cat([piece * signal[:, 3 * i : 3 * i + 3] for i, piece in enumerate(pieces)], 1))
        joined = torch.cat([torch.cat(pieces[:2], 1), pieces[2]], 1) if self.nested else torch.cat(pieces, 1)
        return self.out(signal * joined)


@pytest.mark.parametrize("mapper", sorted(MAPPERS))
@pytest.mark.parametrize("nested", [False, True])
def test_a_product_with_a_join_of_three_kinds_gives_each_element_its_rule(nested: bool, mapper: str):
    # 0.30 off, relative L2, under AttnLRP, 0.70 under CP-LRP, 0.15 under EpsilonPlus.
    assert_same_relevance(ThreeKinds(nested=nested).double(), ThreeKinds(apart=True).double(), mapper)


@pytest.mark.parametrize("mapper", sorted(MAPPERS))
@pytest.mark.parametrize("kept", sorted(KEPT))
def test_a_copy_or_a_scaling_of_a_mixed_join_keeps_its_gate_elements(kept: str, mapper: str):
    # The new tensor had no note of the join's gates: a product with it took it as no gate (0.14-0.39 off, relative
    # L2, under AttnLRP, 0.14-0.52 under CP-LRP, 0.10-0.27 under the CNN presets).
    model = MixedProduct(kept).double()
    assert_same_relevance(model, MixedProduct(kept, apart=True).double(), mapper)


class ClonedGate(nn.Module):
    """``out(copy(sigmoid(a(x))) * relu(s(x)))``, ``copy`` a copy of the gate; ``held`` detaches the gate (the
    oracle: a gate is held in the product)."""

    def __init__(self, copy: Callable[[torch.Tensor], torch.Tensor], held: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.s, self.out = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 3)
        self.copy, self.held = copy, held

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.a(x))
        return self.out(self.copy(gate.detach() if self.held else gate) * torch.relu(self.s(x)))


COPIES = {
    "torch.clone(g)": torch.clone,
    "torch.clone(g.t()).t()": lambda g: torch.clone(g.t()).t(),
    "torch.ops.aten.clone(g)": torch.ops.aten.clone.default,
}


@pytest.mark.parametrize("mapper", sorted(MAPPERS))
@pytest.mark.parametrize("copy", sorted(COPIES))
def test_a_gate_copied_by_the_function_clone_is_a_gate(copy: str, mapper: str):
    # ``torch.clone(gate)`` was no gate (``gate.clone()`` was one): the product shared its relevance with the gate,
    # 0.43 off, relative L2, under AttnLRP and CP-LRP, 0.33 under EpsilonPlus.
    model = ClonedGate(COPIES[copy]).double()
    assert_same_relevance(model, ClonedGate(COPIES[copy], held=True).double(), mapper)


class JoinTimesGate(nn.Module):
    """``out(join([first, relu(h(x))]) * gate(g(x)))``: a join that is a sigmoid-like gate in some elements only (a
    sigmoid's output, or a constant) times a gate whole (a tanh, or a sigmoid), or a view of the join showing its
    first piece alone (``view``) times the gate; ``apart`` multiplies each piece by its part of the gate (the
    oracle)."""

    def __init__(self, first: str, gate: str, view: bool = False, apart: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.h, self.g, self.out = nn.Linear(4, 2), nn.Linear(4, 3), nn.Linear(4, 5), nn.Linear(5, 3)
        self.first, self.gate, self.view, self.apart = first, gate, view, apart

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        other, gate = torch.relu(self.h(x)), getattr(torch, self.gate)(self.g(x))
        first = torch.sigmoid(self.a(x)) if self.first == "sigmoid" else torch.ones(x.shape[0], 2, dtype=x.dtype)
        if self.view:  # the first piece's elements of the join alone, then the join's others times nothing
            joined = first if self.apart else torch.cat([first, other], 1)[:, :2]
            return self.out(torch.cat([joined * gate[:, :2], 0 * gate[:, 2:]], 1))
        if self.apart:
            return self.out(torch.cat([first * gate[:, :2], other * gate[:, 2:]], 1))
        return self.out(torch.cat([first, other], 1) * gate)


@pytest.mark.parametrize("mapper", sorted(MAPPERS))
@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("gate", ["tanh", "sigmoid"])
@pytest.mark.parametrize("first", ["sigmoid", "a constant"])
def test_a_join_gated_in_part_times_a_gate_whole(first: str, gate: str, view: bool, mapper: str):
    # Under CP-LRP, which holds the tanh beside the join's other elements, the tanh's gate mark (its source, a tensor)
    # was read as a truth value: the product raised ("Boolean value of Tensor ... is ambiguous"). A constant joined
    # with an activation, noted as a sigmoid-like gate's element, times a sigmoid was the sigmoid's like: the two
    # shared the product, the constant's half passed on to nothing (0.49 off, relative L2, under AttnLRP and CP-LRP).
    model = JoinTimesGate(first, gate, view).double()
    assert_same_relevance(model, JoinTimesGate(first, gate, view, apart=True).double(), mapper)
