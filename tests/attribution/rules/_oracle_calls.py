"""What the tests of gates kept through calls share: a model explained twice in one open context, against an oracle
model of the same values."""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP
from tests.conftest import relative_error


def relevance_twice(model: nn.Module, x: torch.Tensor, mapper) -> list[torch.Tensor]:
    """The input relevance of ``model``'s largest output in two calls of one open context (the first records the
    rules, the second may apply them without the function modes)."""
    lrp = LRP(model, rule_mapper=mapper, in_keys=["x"], out_keys=["y"])
    with lrp:
        return [lrp(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))["relevance", "x"] for _ in range(2)]


def check_like_oracle(model: nn.Module, oracle: nn.Module, x: torch.Tensor, mapper, tolerance: float = 1e-10) -> None:
    """``model`` and ``oracle`` give the same output on ``x``, and, explained twice under the rule mapper ``mapper``
    (a callable that makes one), ``model``'s relevance in each call is ``oracle``'s, to ``tolerance`` (relative L2)."""
    torch.testing.assert_close(model(x), oracle(x), rtol=1e-12, atol=1e-12)
    (expected, _) = relevance_twice(oracle, x, mapper())
    for actual in relevance_twice(model, x, mapper()):
        assert relative_error(actual, expected) <= tolerance
