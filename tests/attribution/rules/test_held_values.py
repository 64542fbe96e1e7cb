"""Values computed from the factors that products hold (a softmax's weights, gates) and constants alone, then
multiplied with an activation: held as those factors are, under AttnLRP, CP-LRP and EpsilonPlus (float64).

Oracle: the same model with what the preset holds detached where it is computed (the weights; a sigmoid gate; under
CP-LRP and EpsilonPlus any gate), which gives the activation all of the product's relevance; the forward is the same.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tdhook.attribution.rules.gates import SIGMOID_MARK, is_gate, keep_held_product_mark, mark_gate
from tests.attribution.rules.test_filled_constants import assert_like_apart

Held = Callable[[torch.Tensor], torch.Tensor]
# Each value computed from weights ``w``, sigmoid gates ``s`` and ``g`` and a tanh gate ``t``, times ``h``
IDX = torch.tensor([0, 2, 5])
COMPUTED: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "(w * s) * h": lambda w, s, g, t, h: (w * s) * h,
    "(s * w) * h": lambda w, s, g, t, h: (s * w) * h,
    "h * (w * s)": lambda w, s, g, t, h: h * (w * s),
    "(w * w) * h": lambda w, s, g, t, h: (w * w) * h,
    "(-w) * h": lambda w, s, g, t, h: (-w) * h,
    "w.neg() * h": lambda w, s, g, t, h: w.neg() * h,
    "(w + 0.5) * h": lambda w, s, g, t, h: (w + 0.5) * h,
    "(1 - w) * h": lambda w, s, g, t, h: (1 - w) * h,
    "torch.sub(w, 0.25) * h": lambda w, s, g, t, h: torch.sub(w, 0.25) * h,
    "(w / w.sum(-1, keepdim=True)) * h": lambda w, s, g, t, h: (w / w.sum(-1, keepdim=True)) * h,
    "(w[:, :4] / w[:, :4].mean()) * h": lambda w, s, g, t, h: (w[:, :4] / w[:, :4].mean()) * h[:, :4],
    "(w / w.sum(-1, keepdim=True).clamp(min=1e-9)) * h": lambda w, s, g, t, h: (
        (w / w.sum(-1, keepdim=True).clamp(min=1e-9)) * h
    ),
    "(w / w.norm(p=1, dim=-1, keepdim=True)) * h": lambda w, s, g, t, h: (w / w.norm(p=1, dim=-1, keepdim=True)) * h,
    "F.normalize(w, p=1.0, dim=-1) * h": lambda w, s, g, t, h: F.normalize(w, p=1.0, dim=-1) * h,
    "w.clamp_min(0.1) * h": lambda w, s, g, t, h: w.clamp_min(0.1) * h,
    "zeros.index_add(1, i, w[:, i]) * h": lambda w, s, g, t, h: torch.zeros_like(h).index_add(1, IDX, w[:, IDX]) * h,
    "zeros.index_add_(1, i, w[:, i]) * h": lambda w, s, g, t, h: torch.zeros_like(h).index_add_(1, IDX, w[:, IDX]) * h,
    "zeros.scatter_add(1, i, w) * h": lambda w, s, g, t, h: (
        torch.zeros_like(h).scatter_add(1, IDX.expand(h.shape[0], -1), w[:, IDX]) * h
    ),
    "(-(w * s)) * h": lambda w, s, g, t, h: (-(w * s)) * h,
    "((w * s) + 0.5) * h": lambda w, s, g, t, h: ((w * s) + 0.5) * h,
    "(w * s).sum(-1, keepdim=True) * h": lambda w, s, g, t, h: (w * s).sum(-1, keepdim=True) * h,
    "torch.add(w, other=1.0) * h": lambda w, s, g, t, h: torch.add(w, other=1.0) * h,
    "torch.sub(input=w, other=0.25) * h": lambda w, s, g, t, h: torch.sub(input=w, other=0.25) * h,
    "w.clone().neg_() * h": lambda w, s, g, t, h: w.clone().neg_() * h,
    "w.clone().add_(0.5) * h": lambda w, s, g, t, h: w.clone().add_(0.5) * h,
    "(w * 1).mul_(s) * h": lambda w, s, g, t, h: (w * 1).mul_(s) * h,
    "(s * g) * h": lambda w, s, g, t, h: (s * g) * h,
    "s.clone().mul_(g) * h": lambda w, s, g, t, h: s.clone().mul_(g) * h,
    "((s * g) * s) * h": lambda w, s, g, t, h: ((s * g) * s) * h,
    "(s * t) * h": lambda w, s, g, t, h: (s * t) * h,
}
# What each preset holds: the weights (not under EpsilonPlus, which has no rule for them), sigmoid gates, tanh gates
HOLDS = {"AttnLRP": {"w", "s", "g"}, "CPLRP": {"w", "s", "g", "t"}, "EpsilonPlus": {"s", "g"}}


class Computed(nn.Module):
    """``out(computed(softmax(a(x)), sigmoid(b(x)), sigmoid(c(x)), tanh(d(x)), relu(e(x))))``; ``held``: those of
    the weights and gates detached where they are computed (the oracle)."""

    def __init__(self, computed: str, held: frozenset[str] = frozenset()) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c, self.d, self.e = (nn.Linear(4, 6) for _ in range(5))
        self.out = nn.LazyLinear(3)
        self.computed, self.held = computed, held

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values = {
            "w": torch.softmax(self.a(x), -1),
            "s": torch.sigmoid(self.b(x)),
            "g": torch.sigmoid(self.c(x)),
            "t": torch.tanh(self.d(x)),
        }
        w, s, g, t = (value.detach() if name in self.held else value for name, value in values.items())
        return self.out(COMPUTED[self.computed](w, s, g, t, torch.relu(self.e(x))))


def _cases() -> list:
    """The cases each preset holds something of: not the weights' under EpsilonPlus."""
    return [
        pytest.param(computed, mapper, id=f"{computed}-{mapper}")
        for computed in COMPUTED
        for mapper in HOLDS
        if not (mapper == "EpsilonPlus" and "w" in computed)
    ]


@pytest.mark.parametrize(("computed", "mapper"), _cases())
def test_values_computed_from_held_factors_and_constants_are_held(computed: str, mapper: str):
    # They were no weights or gates: the product took the uniform rule where the factors apart are held (weights
    # times a gate 0.44 off, relative L2, under AttnLRP, 0.86 under CP-LRP; -w 0.61; w + 0.5 0.39; renormalised
    # weights 0.39, by a norm or a clipped sum 0.40-0.47; weights added into zeros 0.44; two gates 0.61, 0.51 under
    # EpsilonPlus; in place 0.50-0.92).
    model = Computed(computed)
    oracle = Computed(computed, held=frozenset(HOLDS[mapper]))
    x = torch.zeros(1, 4)
    model(x), oracle(x)  # (the lazy layer made)
    oracle.load_state_dict(model.state_dict())
    assert_like_apart(model.double(), oracle.double(), mapper)


def test_a_gate_times_a_gate_is_a_gate_of_the_kind_both_are():
    x = torch.ones(2, 3, requires_grad=True) * 1
    s, g = mark_gate(torch.sigmoid(x), x, sigmoid=True), mark_gate(torch.sigmoid(x * 2), x, sigmoid=True)
    t = mark_gate(torch.tanh(x), x)
    products = {"s * g": (s, g), "s * t": (s, t), "s * x": (s, x)}
    kinds = {}
    for name, factors in products.items():
        product = factors[0] * factors[1]
        keep_held_product_mark(factors, product, any_gate=True)
        kinds[name] = (is_gate(product), bool(getattr(product, SIGMOID_MARK, False)))
    # A sigmoid gate times a tanh gate: a gate, not a sigmoid-like one (held where any gate is, as the tanh)
    assert kinds == {"s * g": (True, True), "s * t": (True, False), "s * x": (False, False)}
    product = s * t
    keep_held_product_mark((s, t), product, any_gate=False)  # (AttnLRP: a tanh gate is no factor to hold)
    assert not is_gate(product)
