"""Dropout called as a function: whether a call drops, and the watch over a pass that finds it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tdhook.attribution.rules._dropout_calls import DROPOUTS, DropoutCalls, dropout_probability, dropout_watch

X = torch.ones(2, 3, 4, 4)


@pytest.mark.parametrize("func", [f for f in DROPOUTS if f is not torch.dropout])
def test_every_functional_dropout_drops_with_its_p_in_training_only(func):
    assert dropout_probability(func, (X, 0.25), {}) == 0.25
    assert dropout_probability(func, (X,), {"p": 0.25, "training": True}) == 0.25
    assert dropout_probability(func, (X, 0.25, False), {}) == 0.0
    assert dropout_probability(func, (X,), {}) == 0.5  # torch's default p, in training


def test_torch_dropout_and_the_fused_attention():
    assert dropout_probability(torch.dropout, (X, 0.1, True), {}) == 0.1
    assert dropout_probability(torch.dropout, (X,), {"p": 0.1, "train": False}) == 0.0
    q = torch.ones(1, 2, 4)
    assert dropout_probability(F.scaled_dot_product_attention, (q, q, q), {"dropout_p": 0.2}) == 0.2
    assert dropout_probability(F.scaled_dot_product_attention, (q, q, q, None, 0.2), {}) == 0.2
    assert dropout_probability(F.scaled_dot_product_attention, (q, q, q), {}) == 0.0


def test_the_watch_finds_the_first_call_that_drops_and_changes_no_call():
    torch.manual_seed(0)
    expected = F.dropout(torch.ones(8), 0.5)
    torch.manual_seed(0)
    with DropoutCalls() as watch:
        found = F.dropout(torch.ones(8), 0.5)
        F.dropout(torch.ones(8), 0.3)
    assert watch.found == 0.5 and torch.equal(found, expected)


def test_a_watch_only_where_a_module_is_in_training_mode():
    net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with dropout_watch(net.modules()) as watch:
        pass
    assert isinstance(watch, DropoutCalls)
    with dropout_watch(net.eval().modules()) as watch:
        pass
    assert watch is None
