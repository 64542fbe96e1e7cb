"""Which clips guard a divisor: clips of statistics that normalise, up to reshapes and constants."""

from __future__ import annotations

import pytest
import torch

from tdhook.attribution.rules._statistics import clips_a_statistic

STATISTICS = {
    "norm": lambda h: h.norm(dim=-1, keepdim=True),
    "linalg.vector_norm": lambda h: torch.linalg.vector_norm(h, dim=-1),
    "root mean square": lambda h: h.pow(2).mean(-1, keepdim=True).sqrt(),
    "root mean square + eps": lambda h: (h.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt(),
    "mean square + eps": lambda h: h.pow(2).mean(-1, keepdim=True) + 1e-6,
    "sum of squares": lambda h: h.square().sum(-1),
    "sum of absolute values": lambda h: h.abs().sum(-1),
    "largest absolute value": lambda h: h.abs().amax(-1),
    "variance": lambda h: h.var(-1),
    "deviation, scaled and viewed": lambda h: (h.std(-1) * 2.0).view(-1, 1).expand(-1, 3),
    "power -1/2": lambda h: h.pow(2).sum(-1).pow(-0.5),
}
SIGNALS = {
    "activation": lambda h: h,
    "sum": lambda h: h.sum(-1),
    "absolute value": lambda h: h.abs(),
    "square": lambda h: h.pow(2),
    "mean of a cube": lambda h: h.pow(3).mean(-1),
    "sum of two activations": lambda h: h.norm(dim=-1) + h.sum(-1),
    "product of a norm and an activation": lambda h: h.norm(dim=-1) * h.sum(-1),
}


@pytest.mark.parametrize("name", sorted(STATISTICS))
def test_a_statistic_that_normalises_is_one(name: str):
    h = torch.randn(4, 3, requires_grad=True) * 1
    assert clips_a_statistic(STATISTICS[name](h))


@pytest.mark.parametrize("name", sorted(SIGNALS))
def test_a_signal_is_none(name: str):
    h = torch.randn(4, 3, requires_grad=True) * 1
    assert not clips_a_statistic(SIGNALS[name](h))


def test_a_tensor_without_history_is_none():
    assert not clips_a_statistic(torch.randn(3).norm())
