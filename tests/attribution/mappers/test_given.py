"""as_rule_mapper and checked_rules: what a wrapper's rule_mapper may give, and the errors for what it may not."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn
from zennit import rules as zrules

from tdhook.attribution import LRP, EpsilonPlus, EpsilonRule
from tests.attribution._helpers import assert_unchanged, state_snapshot


def model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2)).double().eval()


class TestRulesThatAreNotTdhooks:
    """A callable mapper is trusted to return rules: what it returns instead is named with its module, before any
    hook is put on the model (it raised an AttributeError on ``reads_layer_marks`` inside the context)."""

    @pytest.mark.parametrize(
        ("given", "match"),
        [
            (zrules.Flat(), r"module '0' \(Conv2d\) a zennit\.rules\.Flat, .* use tdhook\.attribution\.FlatRule"),
            (zrules.ZPlus(), r"zennit\.rules\.ZPlus, .* use tdhook\.attribution\.AlphaBetaRule\(1\.0, 0\.0\)"),
            (zrules.Norm(), r"zennit\.rules\.Norm, .* use tdhook\.attribution\.EpsilonRule in its place"),
            (EpsilonRule, r"module '0' \(Conv2d\) the class EpsilonRule, .* pass an instance, EpsilonRule\(\)"),
            ("epsilon", r"module '0' \(Conv2d\) a builtins\.str, not a tdhook Rule; map it to one of"),
        ],
        ids=["zennit-flat", "zennit-zplus", "zennit-norm", "rule-class", "string"],
    )
    @pytest.mark.parametrize("through_preset", [False, True], ids=["callable", "preset"])
    def test_is_refused_naming_the_module(self, given, match: str, through_preset: bool):
        def mapper(name: str, module: nn.Module):
            return given if name == "0" else None

        net = model()
        before = state_snapshot(net)
        lrp = LRP(net, EpsilonPlus(rule_mapper=mapper) if through_preset else mapper, in_keys=["x"], out_keys=["y"])
        td = TensorDict(x=torch.randn(2, 3, 6, 6, dtype=torch.float64), batch_size=[2])
        with pytest.raises(TypeError, match=match):
            lrp(td)
        assert_unchanged(net, before)
        assert set(td.keys()) == {"x"}
