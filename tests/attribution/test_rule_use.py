"""Rules that never take effect are named: a module with a rule that does not run while its parent does."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP, AttnLRP, BaseRuleMapper, EpsilonPlus, EpsilonRule, GammaRule, IgnoreRule


class Attending(nn.Module):
    """An encoder layer: its attention computes with ``out_proj.weight`` directly, never calling ``out_proj``."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x).mean(1))


def unused_rule_warnings(mapper, model: nn.Module, calls: int = 1) -> list[str]:
    lrp = LRP(model.double().eval(), mapper, in_keys=["x"], out_keys=["y"])
    with warnings.catch_warnings(record=True) as caught, lrp:
        warnings.simplefilter("always")
        for _ in range(calls):
            lrp(TensorDict(x=torch.randn(2, 5, 8, dtype=torch.float64), batch_size=[2]))
    return [str(w.message) for w in caught if "has no effect" in str(w.message)]


class TestRulesThatNeverRun:
    @pytest.mark.parametrize("epsilon", [0.1, 1e-6])
    def test_a_rule_on_a_submodule_the_parent_never_calls_is_named(self, epsilon):
        messages = unused_rule_warnings(BaseRuleMapper(rule_mapper={nn.Linear: EpsilonRule(epsilon)}), Attending())
        assert len(messages) == 1
        assert "'layer.self_attn.out_proj'" in messages[0] and "'layer.self_attn' (MultiheadAttention)" in messages[0]

    def test_only_the_first_call_in_a_context_is_watched(self):
        mapper = BaseRuleMapper(rule_mapper={nn.Linear: EpsilonRule(0.1)})
        assert len(unused_rule_warnings(mapper, Attending(), calls=3)) == 1

    def test_rules_that_run_or_change_nothing_are_not_named(self):
        # LRP-0 on every Linear (IgnoreRule) changes nothing, so an out_proj that never runs loses nothing.
        assert unused_rule_warnings(BaseRuleMapper(), Attending()) == []
        mlp = nn.Sequential(nn.Flatten(), nn.Linear(40, 8), nn.ReLU(), nn.Linear(8, 2))
        assert unused_rule_warnings(EpsilonPlus(), mlp) == []


class Unused(nn.Module):
    """A model holding a hand-written activation it never calls (configurations often build such spares)."""

    class Swish(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * torch.sigmoid(x)

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.spare = nn.Linear(8, 3), self.Swish()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).mean(1)


def test_a_module_without_parameters_that_never_runs_is_not_named():
    # Its parent cannot compute with parameters it does not have: nothing is lost by the module not running.
    assert unused_rule_warnings(EpsilonPlus(), Unused()) == []


class RefusesPreHooks(nn.Linear):
    """A layer that refuses forward pre-hooks (TorchScript modules do)."""

    def register_forward_pre_hook(self, *args, **kwargs):
        raise RuntimeError("register_forward_pre_hook is not supported here")


def test_a_watch_that_cannot_hook_a_module_leaves_no_hook_on_the_others():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), RefusesPreHooks(8, 3)).double()
    lrp = LRP(model, lambda name, module: EpsilonRule(0.1) if name == "0" else None, in_keys=["x"], out_keys=["y"])
    with pytest.raises(RuntimeError, match="not supported here"):
        lrp(TensorDict(x=torch.randn(2, 8, dtype=torch.float64), batch_size=[2]))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


class Spare(nn.Module):
    """A model holding a layer it never calls (a head of another task, a configuration's spare)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.spare = nn.Linear(8, 3), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).mean(1)


def test_a_layer_that_nothing_computes_with_is_not_named():
    # Neither the layer nor its parent reads its parameters: no relevance passes it by, and the rule is not needed.
    assert unused_rule_warnings(EpsilonPlus(), Spare()) == []


@pytest.mark.parametrize("rule", [EpsilonRule(0.1), GammaRule(0.25)])
def test_a_layer_whose_parameters_the_parent_reads_is_named_whatever_its_rule(rule):
    messages = unused_rule_warnings(BaseRuleMapper(rule_mapper={nn.Linear: rule}), Attending())
    assert len(messages) == 1 and "'layer.self_attn.out_proj'" in messages[0]


def test_a_frozen_layer_the_parent_never_calls_is_named():
    # Parameters that do not require grad leave no trace in the graph: whether the parent reads them is unknown.
    model = Attending().requires_grad_(False)
    messages = unused_rule_warnings(BaseRuleMapper(rule_mapper={nn.Linear: EpsilonRule(0.1)}), model)
    assert len(messages) == 1 and "'layer.self_attn.out_proj'" in messages[0]


class ProjectsWhenLong(nn.Module):
    """Calls ``proj`` on sequences of two positions or fewer, and computes with its parameters directly on longer
    ones (as an attention's fused path may)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.head = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > 2:
            h = torch.nn.functional.linear(x, self.proj.weight, self.proj.bias)
        else:
            h = self.proj(x)
        return self.head(h.mean(1))


class InnerWhenLong(nn.Module):
    """A block that runs its inner layer on sequences longer than two positions only."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) if x.shape[1] > 2 else 2 * x


def sequences_of(length: int) -> TensorDict:
    generator = torch.Generator().manual_seed(length)
    return TensorDict(x=torch.randn(2, length, 8, generator=generator, dtype=torch.float64), batch_size=[2])


class TestEachSignaturesFirstCallIsWatched:
    """A forward may branch on its inputs' shapes: the first call of each signature in a context is watched, as the
    context's first is. Before, only the context's first call was: a later call of another length kept the plain
    gradient of a layer whose rule never ran, or stacked a block's ε-rule on its inner layer's, with no word."""

    def test_a_rule_a_later_length_bypasses_is_named(self):
        mapper = BaseRuleMapper(rule_mapper={nn.Linear: EpsilonRule(0.1)})
        lrp = LRP(ProjectsWhenLong().double(), mapper, in_keys=["x"], out_keys=["y"])
        with warnings.catch_warnings(record=True) as caught, lrp:
            warnings.simplefilter("always")
            lrp(sequences_of(2))
            assert not [w for w in caught if "has no effect" in str(w.message)]
            lrp(sequences_of(4))
            lrp(sequences_of(4))
        messages = [str(w.message) for w in caught if "has no effect" in str(w.message)]
        assert len(messages) == 1 and "'proj'" in messages[0]

    def test_a_block_rule_over_an_inner_rule_a_later_length_runs_is_refused(self):
        model = nn.Sequential(InnerWhenLong(), nn.Linear(8, 3)).double()
        mapper = BaseRuleMapper(rule_mapper={InnerWhenLong: EpsilonRule(0.1), nn.Linear: EpsilonRule(0.1)})
        lrp = LRP(model, mapper, in_keys=["x"], out_keys=["y"])
        with lrp:
            lrp(sequences_of(2))
            long = sequences_of(4)
            before = dict(long.items())
            for _ in range(2):  # at every call: a refused pass does not count as watched
                with pytest.raises(ValueError, match="'0'.*would act on top of the rules"):
                    lrp(long)
            assert long.keys() == before.keys() and all(long[k] is v for k, v in before.items())

    @pytest.mark.parametrize("mapper", [EpsilonPlus, AttnLRP])
    def test_a_rules_check_of_its_inputs_warns_once_a_context_whatever_signatures_follow(self, mapper):
        # A sigmoid behind a ReLU gets inputs of exactly 0 (sigmoid(0) != 0): its rule says so in the watched pass.
        model = nn.Sequential(nn.ReLU(), nn.Sigmoid(), nn.Linear(6, 3)).double()
        lrp = LRP(model, mapper(), in_keys=["x"], out_keys=["y"])
        generator = torch.Generator().manual_seed(0)
        with warnings.catch_warnings(record=True) as caught, lrp:
            warnings.simplefilter("always")
            for batch in (2, 3, 4, 4):
                x = torch.randn(batch, 6, generator=generator, dtype=torch.float64)
                lrp(TensorDict(x=x, batch_size=[batch]))
        assert len([w for w in caught if "of its inputs are exactly 0" in str(w.message)]) == 1

    def test_a_rule_without_effect_is_named_once_a_context_whatever_lengths_follow(self):
        mapper = BaseRuleMapper(rule_mapper={nn.Linear: EpsilonRule(0.1)})
        lrp = LRP(Attending().double().eval(), mapper, in_keys=["x"], out_keys=["y"])
        with warnings.catch_warnings(record=True) as caught, lrp:
            warnings.simplefilter("always")
            for length in (5, 6, 7):
                lrp(TensorDict(x=torch.randn(2, length, 8, dtype=torch.float64), batch_size=[2]))
        assert len([w for w in caught if "has no effect" in str(w.message)]) == 1

    def test_ignore_rule_over_ruled_modules_is_named_once_a_context_whatever_lengths_follow(self):
        model = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 3)).double()
        mapper = BaseRuleMapper(rule_mapper={"0": IgnoreRule(), nn.Linear: GammaRule(0.25)})
        lrp = LRP(model, mapper, in_keys=["x"], out_keys=["y"])
        with warnings.catch_warnings(record=True) as caught, lrp:
            warnings.simplefilter("always")
            for length in (5, 6, 7):
                lrp(sequences_of(length))
        assert len([w for w in caught if "changes nothing" in str(w.message)]) == 1


class Cumulative(nn.Module):
    """Two layers of a class of its own: the default rules put no rule on them (the first pass runs with the
    function modes' rules only)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)).cumsum(-1))


@pytest.mark.parametrize("mapper", ["default", "EpsilonPlus"])
def test_a_wrapper_keeps_nothing_of_a_calls_graph(mapper: str):
    """The first pass's outputs, noted for the check of the module rules, were kept until the next context where no
    module had a rule: the call's graph stayed alive, and a deep copy of the wrapper (``randomisation_check`` makes
    one) raised "Only Tensors created explicitly by the user (graph leaves) support the deepcopy protocol"."""
    torch.manual_seed(0)
    model = Cumulative().double()
    rules = () if mapper == "default" else (EpsilonPlus(),)
    lrp = LRP(model, *rules, in_keys=["x"], out_keys=["y"])
    td = TensorDict(x=torch.randn(3, 4, dtype=torch.float64), batch_size=[3])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cumsum keeps its plain gradient, which a warning names
        expected = lrp(td.clone())["relevance", "x"]
        kept = lrp._rule_use._outputs
        copied = copy.deepcopy(lrp)
        torch.testing.assert_close(copied(td.clone())["relevance", "x"], expected, rtol=1e-12, atol=1e-12)
    assert kept == []
