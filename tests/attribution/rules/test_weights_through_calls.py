"""A softmax's weights through the calls between the softmax and an element-wise product with an activation, under
AttnLRP and CP-LRP (float64): a scaling by a constant (a mixture's routing scale), the values a ``topk`` or a sort
picks (a mixture's routing weights), a padding, an ``einsum`` that multiplies element by element, ``torch.addcmul``.

The weights are held in ``w * h`` (the activation takes all of the product's relevance). Oracle: the same model with
the weights detached where they are multiplied, which gives ``w * h`` that relevance; the forward is the same.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.attribution.rules.test_filled_constants import assert_like_apart

Weighing = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# Each call between the weights ``w`` and the product with ``h``, and the product
WEIGHINGS: dict[str, Weighing] = {
    "(w * 2.5) * h": lambda w, h: (w * 2.5) * h,
    "(-3.0 * w) * h": lambda w, h: (-3.0 * w) * h,
    "(w / 4) * h": lambda w, h: (w / 4) * h,
    "(w * scale) * h": lambda w, h: (w * torch.linspace(0.5, 2.0, 6, dtype=w.dtype)) * h,
    "torch.topk(w, 6).values * h": lambda w, h: torch.topk(w, 6, -1).values * h,
    "w.sort(descending=True).values * h": lambda w, h: w.sort(-1, descending=True).values * h,
    "w.max(-1, keepdim=True).values * h": lambda w, h: w.max(-1, keepdim=True).values * h,
    "F.pad(w[:, :4], (1, 1)) * h": lambda w, h: F.pad(w[:, :4], (1, 1)) * h,
    "F.pad(w[:, :4], (1, 1), value=1.0) * h": lambda w, h: F.pad(w[:, :4], (1, 1), value=1.0) * h,
    "torch.einsum('bi,bi->bi', w, h)": lambda w, h: torch.einsum("bi,bi->bi", w, h),
    "torch.addcmul(h, w, h)": lambda w, h: torch.addcmul(h, w, h),
    "h.clone().addcmul_(w, h, value=0.5)": lambda w, h: h.clone().addcmul_(w, h, value=0.5),
}


class Weighed(nn.Module):
    """``out(weighing(softmax(a(x)), relu(b(x))))``; ``held``: the weights detached (the oracle)."""

    def __init__(self, weighing: str, held: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.out = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 3)
        self.weighing, self.held = weighing, held

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.softmax(self.a(x), -1)
        w = w.detach() if self.held else w
        return self.out(WEIGHINGS[self.weighing](w, torch.relu(self.b(x))))


@pytest.mark.parametrize("mapper", ["AttnLRP", "CPLRP"])
@pytest.mark.parametrize("weighing", WEIGHINGS)
def test_weights_stay_weights_through_the_calls_before_their_product(weighing: str, mapper: str):
    # Under AttnLRP they were no weights: the product took the uniform rule (scaled 1.05 off, relative L2; topk and
    # sort 0.50-0.63; padded 0.19-0.55; the einsum 1.05; addcmul 0.04-1.3).
    assert_like_apart(Weighed(weighing).double(), Weighed(weighing, held=True).double(), mapper)


class Routed(nn.Module):
    """A mixture of two experts written by hand: the top-1 of a softmax router's weights, scaled (a routing scale),
    times the chosen expert's output, added into zeros per token; ``held``: the weights detached."""

    def __init__(self, held: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.router, self.out = nn.Linear(4, 2), nn.Linear(6, 3)
        self.experts = nn.ModuleList(nn.Linear(4, 6) for _ in range(2))
        self.held = held

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = torch.topk(torch.softmax(self.router(x), -1), 1, -1)
        weights = (weights.detach() if self.held else weights) * 2.5
        mixed = torch.zeros(x.shape[0], 6, dtype=x.dtype)
        for e, expert in enumerate(self.experts):
            rows = (chosen[:, 0] == e).nonzero()[:, 0]
            mixed.index_add_(0, rows, torch.relu(expert(x[rows])) * weights[rows])
        return self.out(mixed)


@pytest.mark.parametrize("mapper", ["AttnLRP", "CPLRP"])
def test_a_mixture_of_experts_written_by_hand_holds_its_routing_weights(mapper: str):
    # The weights a topk picked, scaled, were no weights: 0.72-0.76 off, relative L2, under AttnLRP.
    assert_like_apart(Routed().double(), Routed(held=True).double(), mapper)


IDX = torch.tensor([0, 2, 5])
WRITTEN = torch.zeros(6, dtype=torch.bool).index_fill(0, IDX, True)


def _rows(c: torch.Tensor) -> torch.Tensor:
    return torch.arange(c.shape[0])[:, None]


def _set_columns(c: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    c[:, IDX] = w[:, IDX]
    return c


# Writes that put the weights' values at the columns IDX of ``c``, in place and out of place
WRITES: dict[str, Weighing] = {
    "c.scatter(1, i, w)": lambda c, w: c.scatter(1, IDX.expand(c.shape[0], -1), w[:, IDX]),
    "c.scatter_(1, i, w)": lambda c, w: c.scatter_(1, IDX.expand(c.shape[0], -1), w[:, IDX]),
    "c.index_copy(1, i, w)": lambda c, w: c.index_copy(1, IDX, w[:, IDX]),
    "c[:, i] = w[:, i]": _set_columns,
    "c.masked_scatter(m, w)": lambda c, w: c.masked_scatter(WRITTEN.expand_as(c), w[:, IDX]),
    "c.index_put((rows, i), w)": lambda c, w: c.index_put((_rows(c), IDX[None]), w[:, IDX]),
}


class Scattered(nn.Module):
    """``out(write(c, softmax(a(x))) * relu(b(x)))``, ``c`` zeros, a buffer or an activation (``root``);
    ``held``: the weights detached (the oracle)."""

    def __init__(self, write: str, root: str, held: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.r, self.out = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 3)
        self.register_buffer("constant", torch.randn(6) + 2.0)
        self.write, self.root, self.held = write, root, held

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.softmax(self.a(x), -1)
        w = w.detach() if self.held else w
        roots = {
            "zeros": lambda: torch.zeros(x.shape[0], 6, dtype=x.dtype),
            "buffer": lambda: self.constant.expand(x.shape[0], -1).clone(),
            "activation": lambda: torch.relu(self.r(x)) * 1.0,
        }
        return self.out(WRITES[self.write](roots[self.root](), w) * torch.relu(self.b(x)))


@pytest.mark.parametrize("mapper", ["AttnLRP", "CPLRP"])
@pytest.mark.parametrize("root", ["zeros", "buffer", "activation"])
@pytest.mark.parametrize("write", WRITES)
def test_weights_written_into_part_of_a_tensor_are_held_there(write: str, root: str, mapper: str):
    # A mixture's combine weights scattered into zeros were no weights: 0.76-0.92 off, relative L2, under AttnLRP;
    # into a buffer 0.02-0.50, into an activation 0.07-0.14.
    assert_like_apart(Scattered(write, root).double(), Scattered(write, root, held=True).double(), mapper)
