"""Every warning of the LRP wrapper is shown at the caller's line, whatever path the call takes: a fixed
``stacklevel`` pointed into tdhook on some (``lrp.py``, ``_coverage_recorder.py``), where filters by module and
the reader's eye cannot match it."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from tensordict.nn import TensorDictModule, TensorDictSequential
from torch import nn

from tdhook.attribution import LRP, AlphaBetaRule, UniformRule
from tdhook.attribution.lrp_helpers.rules import AttnLRP, EpsilonPlus


class DirectWeight(nn.Module):
    """Computes with its child's weight directly: the child's rule has no effect (the rule-use warning)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(F.linear(x, self.lin.weight, self.lin.bias))


class SineOfLinear(nn.Module):
    """A sine no rule covers (inside a module with a layer, so no element-wise rule takes the module)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.sin(self.lin(x))


class AttentionDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        weights = F.dropout(torch.softmax(self.q(x) @ x.transpose(1, 2), -1), p=0.5, training=True)
        return self.head((weights @ x).mean(1))


CASES = {
    "rule without effect": (DirectWeight, EpsilonPlus, (3, 4), "has no effect"),
    "plain-gradient call": (lambda: nn.Sequential(SineOfLinear(), nn.Linear(4, 2)), EpsilonPlus, (3, 4), "sin"),
    "dropout module in training mode": (
        lambda: nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 2)).train(),
        EpsilonPlus,
        (3, 4),
        "training mode",
    ),
    "attention dropout": (AttentionDropout, AttnLRP, (2, 3, 4), "calls dropout"),
    "rule without merge": (
        lambda: nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4)).eval(),
        lambda: EpsilonPlus(rule_mapper={nn.Linear: UniformRule()}),
        (3, 4),
        "cannot be merged",
    ),
    "unmatched name": (
        lambda: nn.Sequential(nn.Linear(4, 2)),
        lambda: {"missing": AlphaBetaRule(1.0, 0.0)},
        (3, 4),
        "no module",
    ),
}


@pytest.mark.parametrize("inside", [False, True], ids=["call", "with-block"])
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "in-a-sequential"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_warning_is_shown_at_the_callers_line(case: str, nested: bool, inside: bool):
    make_model, make_mapper, shape, expected = CASES[case]
    model = make_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if nested:
            lrp = LRP(TensorDictSequential(TensorDictModule(model, ["x"], ["y"])), make_mapper())
        else:
            lrp = LRP(model, make_mapper(), in_keys=["x"], out_keys=["y"])
        td = TensorDict(x=torch.randn(*shape), batch_size=shape[:1])
        if inside:
            with lrp:
                lrp(td)
        else:
            lrp(td)
    ours = [w for w in caught if str(w.message).startswith(("LRP", "UniformRule"))]
    assert any(expected in str(w.message) for w in ours), [str(w.message) for w in caught]
    assert [w.filename for w in ours] == [__file__] * len(ours), [(w.filename, str(w.message)[:60]) for w in ours]
