"""Writing a call's results into the caller's TensorDict: all of them, or none."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from tdhook.attribution._writes import set_all_or_nothing
from tests.attribution._interrupts import Interrupt, every_line


def test_a_write_interrupted_at_any_line_leaves_the_tensordict_as_it_was():
    def caller_td() -> TensorDict:
        return TensorDict(x=torch.ones(2, 3), y=torch.zeros(2), batch_size=[2])

    updates = {"y": torch.ones(2), ("relevance", "x"): torch.full((2, 3), 2.0), ("relevance", "z", "w"): torch.ones(2)}
    written = caller_td()
    set_all_or_nothing(written, updates)
    assert set(written.keys(include_nested=True, leaves_only=True)) == {"x", "y", *updates}
    for at in every_line(lambda: set_all_or_nothing(caller_td(), updates), stride=1):
        td = caller_td()
        before = dict(td.items(include_nested=True, leaves_only=True))
        with Interrupt(at) as interrupt:
            set_all_or_nothing(td, updates)
        assert interrupt.where is not None  # a write runs the same lines every time
        now = dict(td.items(include_nested=True, leaves_only=True))
        assert now.keys() == before.keys() and all(now[k] is v for k, v in before.items()), interrupt.where
        assert list(td.keys()) == ["x", "y"], interrupt.where  # no branch of its own left, empty or not
