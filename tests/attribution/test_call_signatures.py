"""A forward that branches on its inputs' shapes: a call of an open context whose signature no call before it had is
watched as a first call is, so it gets the relevance, the warnings and the refusals of a fresh wrapper's call.

The oracle is that fresh call (a new wrapper, called once on the same input), and, for the gates, gradient × input
of the same model with its gate detached by hand (signal-take-all). Before, the watch and the gates' probe ran on the
first call only: the long call below, after a short one, kept its gate's plain gradient (0.35 off the fresh call,
relative L2) with no warning, and ``lrp.coverage()`` said every call had a rule.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import LazyStackedTensorDict, NonTensorData, TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import CPLRP, LRP, AttnLRP, BaseRuleMapper, EpsilonAlpha2Beta1, EpsilonPlus
from tdhook.attribution._call_signatures import call_signature
from tests.attribution._helpers import assert_unchanged, gradient_times_input, state_snapshot
from tests.attribution.test_function_gates import ModeSpy
from tests.conftest import relative_error

F64 = torch.float64
CNN_PRESETS = {
    "LRP-0": lambda **kw: BaseRuleMapper(stabilizer=0.0, **kw),
    "EpsilonPlus": lambda **kw: EpsilonPlus(**kw),
    "EpsilonAlpha2Beta1": lambda **kw: EpsilonAlpha2Beta1(**kw),
}


class GatedWhenLong(nn.Module):
    """``relu(l1(x))`` for sequences of two positions or fewer, ``tanh(l1(x)) * sigmoid(gate(x))`` for longer ones
    (a branch on a shape, as models with a window do); ``held``: the gate detached by hand (the oracle)."""

    def __init__(self, held: bool = False) -> None:
        super().__init__()
        self.l1, self.gate, self.head = (nn.Linear(6, 6, bias=False), nn.Linear(6, 6, bias=False), nn.Linear(6, 3))
        self.held = held

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        if x.shape[1] > 2:
            gate = torch.sigmoid(self.gate(x))
            h = torch.tanh(h) * (gate.detach() if self.held else gate)
        else:
            h = torch.relu(h)
        return self.head(h.mean(1))


class DecayWhenLong(nn.Module):
    """A running product of sigmoid decays (a scan's) on sequences longer than two positions only."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.head = nn.Linear(6, 6, bias=False), nn.Linear(6, 6, bias=False), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        if x.shape[1] > 2:
            h = torch.cumprod(torch.sigmoid(self.l2(x)), 1) * h
        return self.head(h.mean(1))


class SineEverywhere(nn.Module):
    """A sine on every path, and a tanh on long sequences only."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.head = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sin(self.l1(x))
        return self.head((torch.tanh(h) if x.shape[1] > 2 else h).mean(1))


def sequences(length: int, seed: int = 0) -> TensorDict:
    generator = torch.Generator().manual_seed(seed)
    return TensorDict(x=torch.randn(3, length, 6, generator=generator, dtype=F64), batch_size=[3])


def seeded(model_class: type, **kwargs) -> nn.Module:
    torch.manual_seed(0)
    return model_class(**kwargs).to(F64).eval()


def call(lrp: LRP, td: TensorDict) -> tuple[torch.Tensor, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        output = lrp(td)
    key = lrp.in_keys[0]
    return output["relevance", *(key if isinstance(key, tuple) else (key,))], [str(w.message) for w in caught]


@pytest.mark.parametrize("preset", CNN_PRESETS)
def test_a_gate_on_a_branch_a_later_call_takes_is_held_as_in_a_fresh_call(preset: str):
    model, long = seeded(GatedWhenLong), sequences(4, seed=1)
    fresh, fresh_warnings = call(LRP(model, CNN_PRESETS[preset](), in_keys=["x"], out_keys=["y"]), long)
    lrp = LRP(model, CNN_PRESETS[preset](), in_keys=["x"], out_keys=["y"])
    with lrp:
        _, short_warnings = call(lrp, sequences(2))
        later, later_warnings = call(lrp, long)
    assert short_warnings == []
    assert relative_error(later, fresh) < 1e-12  # 0.35 off before: the gate's plain gradient
    assert later_warnings == fresh_warnings and len(later_warnings) == 1 and "computes tanh" in later_warnings[0]
    assert "tanh" in str(lrp.coverage())
    if preset == "LRP-0":  # the gate held by hand: signal-take-all, exactly
        held = seeded(GatedWhenLong, held=True)
        assert relative_error(later, gradient_times_input(held, long["x"])) < 1e-12
        assert relative_error(later, gradient_times_input(model, long["x"])) > 0.1


def test_a_strict_mapper_refuses_a_later_call_of_another_signature_and_leaves_everything_as_it_was():
    model, long = seeded(GatedWhenLong), sequences(4, seed=1)
    lrp = LRP(model, BaseRuleMapper(strict=True, stabilizer=0.0), in_keys=["x"], out_keys=["y"])
    with lrp:
        lrp(sequences(2))
        snapshot, before = state_snapshot(model), dict(long.items())
        with pytest.raises(ValueError, match=r"the model itself \(GatedWhenLong\) computes tanh"):
            lrp(long)
        assert_unchanged(model, snapshot)
        assert dict(long.items()).keys() == before.keys() and all(long[k] is v for k, v in before.items())
        with pytest.raises(ValueError, match="computes tanh"):  # refused again: not counted as watched
            lrp(long)


@pytest.mark.parametrize("preset", {"CPLRP": CPLRP, "AttnLRP": AttnLRP})
def test_a_function_no_rule_covers_on_a_later_branch_is_named_under_the_transformer_presets(preset: str):
    # The later call of a new length is watched as the fresh call is: it warns at once, with the fresh relevance.
    model, long = seeded(DecayWhenLong), sequences(4, seed=1)
    mapper = {"CPLRP": CPLRP, "AttnLRP": AttnLRP}[preset]
    fresh, fresh_warnings = call(LRP(model, mapper(), in_keys=["x"], out_keys=["y"]), long)
    lrp = LRP(model, mapper(), in_keys=["x"], out_keys=["y"])
    with lrp:
        _, short_warnings = call(lrp, sequences(2))
        later, later_warnings = call(lrp, long)
        again, again_warnings = call(lrp, long)
    assert short_warnings == [] and any("computes cumprod" in message for message in later_warnings)
    assert later_warnings == fresh_warnings and again_warnings == []
    assert "cumprod" in str(lrp.coverage())
    assert relative_error(later, fresh) < 1e-12 and relative_error(again, fresh) < 1e-12


def test_a_call_is_warned_of_what_no_call_before_it_was_and_only_that():
    model = seeded(SineEverywhere)
    lrp = LRP(model, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
    with lrp:
        _, first = call(lrp, sequences(2))
        _, second = call(lrp, sequences(4))
        _, third = call(lrp, sequences(5))  # a third signature, nothing new
    assert len(first) == 1 and "computes sin" in first[0] and "tanh" not in first[0]
    assert len(second) == 1 and "computes tanh" in second[0] and "sin" not in second[0]
    assert third == []
    coverage = lrp.coverage()
    assert {call.function for call in coverage.plain_gradient} == {"sin", "tanh"}


def test_a_signature_is_watched_once_and_later_calls_of_it_run_without_a_mode():
    spy = seeded(ModeSpy, body=nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3)))
    lrp = LRP(spy, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
    with lrp:
        for length in (2, 2, 4, 4, 2):
            lrp(TensorDict(x=sequences(length)["x"][:, 0], batch_size=[3]) if length == 2 else sequences(length))
    assert spy.modes_on == [True, False, True, False, False]


def test_a_later_call_of_the_first_signature_keeps_the_gate_held_once_found():
    model = seeded(GatedWhenLong)
    lrp = LRP(model, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
    with lrp, warnings.catch_warnings(record=True):
        lrp(sequences(2))
        lrp(sequences(4))
        again = lrp(sequences(4, seed=2))["relevance", "x"]
    fresh, _ = call(LRP(model, EpsilonPlus(), in_keys=["x"], out_keys=["y"]), sequences(4, seed=2))
    assert relative_error(again, fresh) < 1e-12


class TestCallSignature:
    def test_values_do_not_count_and_shapes_dtypes_and_keys_do(self):
        x = torch.zeros(2, 3)
        signature = call_signature(TensorDict(x=x, batch_size=[2]))
        assert signature == call_signature(TensorDict(x=torch.randn(2, 3), batch_size=[2]))
        assert signature != call_signature(TensorDict(x=torch.zeros(2, 4), batch_size=[2]))
        assert signature != call_signature(TensorDict(x=x.double(), batch_size=[2]))
        assert signature != call_signature(TensorDict(y=x, batch_size=[2]))
        assert signature != call_signature(TensorDict(x=x, mask=torch.ones(2, dtype=torch.bool), batch_size=[2]))
        hash(signature)

    def test_a_lazy_stack_has_the_shapes_of_its_entries(self):
        def stack(*lengths: int, dtype: torch.dtype = torch.float32) -> TensorDict:
            return TensorDict(a=LazyStackedTensorDict(*[TensorDict(x=torch.zeros(n, dtype=dtype)) for n in lengths]))

        assert call_signature(stack(2, 2)) == call_signature(stack(2, 2))
        assert len({call_signature(td) for td in (stack(2, 2), stack(4, 4), stack(1, 2), stack(2, 2, 2))}) == 4
        assert call_signature(stack(2, 2)) != call_signature(stack(2, 2, dtype=F64))

    def test_the_values_of_the_non_tensor_entries_the_model_reads_count(self):
        assert call_signature(flagged("a"), ["mode"]) != call_signature(flagged("b"), ["mode"])
        assert call_signature(flagged("a"), ["mode"]) == call_signature(flagged("a", seed=1), ["mode"])
        assert call_signature(flagged("a"), ["x"]) == call_signature(flagged("b"), ["x"])  # not read: not counted
        listed = TensorDict(x=torch.zeros(2), mode=NonTensorData([1], batch_size=[2]), batch_size=[2])
        hash(call_signature(listed, ["mode"]))  # a value that cannot be hashed counts by its type


class GatedInMode(nn.Module):
    """``tanh(l1(x)) * sigmoid(gate(x))`` where a flag the model reads says ``"gated"``, else ``relu(l1(x))``."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.gate, self.head = nn.Linear(6, 6, bias=False), nn.Linear(6, 6, bias=False), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, mode: str) -> torch.Tensor:
        h = self.l1(x)
        h = torch.tanh(h) * torch.sigmoid(self.gate(x)) if mode == "gated" else torch.relu(h)
        return self.head(h)


def flagged(mode: str, seed: int = 0) -> TensorDict:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 6, generator=generator, dtype=F64)
    return TensorDict(x=x, mode=NonTensorData(mode, batch_size=[3]), batch_size=[3])


@pytest.mark.parametrize("preset", CNN_PRESETS)
def test_a_gate_on_a_branch_a_flag_the_model_reads_takes_is_held_as_in_a_fresh_call(preset: str):
    # A flag held as NonTensorData is part of the signature where the model reads it. Before, the gated call after a
    # plain one kept its gate's plain gradient (0.53 off the fresh call under EpsilonPlus) with no warning.
    model = TensorDictModule(seeded(GatedInMode), in_keys=["x", "mode"], out_keys=["y"])
    fresh, fresh_warnings = call(LRP(model, CNN_PRESETS[preset](), in_keys=["x"]), flagged("gated", seed=1))
    lrp = LRP(model, CNN_PRESETS[preset](), in_keys=["x"])
    with lrp:
        call(lrp, flagged("plain"))
        later, later_warnings = call(lrp, flagged("gated", seed=1))
    assert relative_error(later, fresh) < 1e-12
    assert later_warnings == fresh_warnings


def stacked_sequences(length: int, seed: int = 0) -> TensorDict:
    """Three sequences of ``length`` positions as a lazy stack under ``"a"``, as a rollout's may come."""
    generator = torch.Generator().manual_seed(seed)
    parts = [TensorDict(x=torch.randn(length, 6, generator=generator, dtype=F64)) for _ in range(3)]
    return TensorDict(a=LazyStackedTensorDict(*parts, stack_dim=0), batch_size=[3])


@pytest.mark.parametrize("preset", CNN_PRESETS)
def test_a_gate_on_a_branch_a_later_lazy_stack_takes_is_held_as_in_a_fresh_call(preset: str):
    # Before, every lazy stack had one signature: the long stack after a short one kept its gate's plain gradient
    # (0.33 off the fresh call, relative L2) with no warning.
    model, long = seeded(GatedWhenLong), stacked_sequences(4, seed=1)
    fresh, _ = call(LRP(model, CNN_PRESETS[preset](), in_keys=[("a", "x")], out_keys=["y"]), long)
    lrp = LRP(model, CNN_PRESETS[preset](), in_keys=[("a", "x")], out_keys=["y"])
    with lrp:
        call(lrp, stacked_sequences(2))
        later, _ = call(lrp, long)
    assert relative_error(later, fresh) < 1e-12


class ProductThenDecayWhenLong(nn.Module):
    """A product of two activations, and a running product of decays on sequences longer than three positions."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = (nn.Linear(6, 6, bias=False) for _ in range(3))
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x) * self.l2(x)
        if x.shape[1] > 3:
            h = torch.cumprod(torch.sigmoid(self.l3(x)), 1) * h
        return self.head(h.mean(1))


class HookWhenLong(nn.Module):
    """A gradient hook of the model's own that triples the gradient, on sequences longer than two positions only:
    the graph has the same shape at every length, the hook is not in it."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.head = nn.Linear(6, 6, bias=False), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        if x.shape[1] > 2 and h.requires_grad:
            h.register_hook(lambda grad: 3 * grad)
        return self.head(h.mean(1))


class ExpWhenEven(nn.Module):
    """An exponential decay on sequences of an even length only."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.head = nn.Linear(6, 6, bias=False), nn.Linear(6, 6, bias=False), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        if x.shape[1] % 2 == 0:
            h = h * torch.exp(-torch.relu(self.l2(x)))
        return self.head(h.mean(1))


TRANSFORMER_PRESETS = {"CPLRP": CPLRP, "AttnLRP": AttnLRP}


class TestEverySignatureIsWatchedUnderTheFunctionRules:
    """Under AttnLRP and CP-LRP too, a call of a new signature is watched. The watch does not only report: it
    refuses a gradient hook the model puts on its own tensors, which no autograd graph shows. Before, such a call ran
    unwatched where its graph had the shape of a watched call's: a hook on long sequences only was accepted at every
    other long call after a short one, with three times the relevance, and a branch taken at even lengths only was
    never named."""

    def run(self, monkeypatch, mapper, lengths: tuple[int, ...]) -> tuple[list, list, list]:
        from tdhook.attribution._coverage_recorder import CoverageRecorder

        watched: list[int] = []
        original = CoverageRecorder.watch
        monkeypatch.setattr(
            CoverageRecorder, "watch", lambda self, *a, **k: watched.append(1) or original(self, *a, **k)
        )
        model = seeded(ProductThenDecayWhenLong)
        fresh = [call(LRP(model, mapper(), in_keys=["x"], out_keys=["y"]), sequences(n, seed=n))[0] for n in lengths]
        watched.clear()
        lrp = LRP(model, mapper(), in_keys=["x"], out_keys=["y"])
        counts, messages, errors = [], [], []
        with lrp:
            for length, expected in zip(lengths, fresh, strict=True):
                relevance, caught = call(lrp, sequences(length, seed=length))
                counts.append(len(watched))
                messages.append([message for message in caught if "cumprod" in message])
                errors.append(relative_error(relevance, expected))
        return counts, messages, errors

    @pytest.mark.parametrize("preset", TRANSFORMER_PRESETS)
    def test_each_new_length_is_watched_once_and_warns_at_once(self, monkeypatch, preset):
        counts, messages, errors = self.run(monkeypatch, TRANSFORMER_PRESETS[preset], (2, 3, 4, 5, 4))
        assert counts == [1, 2, 3, 4, 4]
        assert messages == [[], [], messages[2], [], []] and len(messages[2]) == 1
        assert max(errors) < 1e-12  # the watch changes no relevance

    @pytest.mark.parametrize("preset", TRANSFORMER_PRESETS)
    def test_a_hook_of_the_models_own_on_a_later_length_is_refused_at_every_call(self, preset):
        model = seeded(HookWhenLong)
        lrp = LRP(model, TRANSFORMER_PRESETS[preset](), in_keys=["x"], out_keys=["y"])
        with lrp:
            lrp(sequences(2))
            for _ in range(3):
                long = sequences(4, seed=1)
                before = dict(long.items())
                with pytest.raises(ValueError, match="a hook that the model itself"):
                    lrp(long)
                assert long.keys() == before.keys() and all(long[k] is v for k, v in before.items())

    @pytest.mark.parametrize("preset", TRANSFORMER_PRESETS)
    def test_a_function_at_even_lengths_only_is_named_whatever_length_came_first(self, preset):
        lrp = LRP(seeded(ExpWhenEven), TRANSFORMER_PRESETS[preset](), in_keys=["x"], out_keys=["y"])
        with lrp, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for length in range(1, 8):
                lrp(sequences(length))
        assert len([w for w in caught if "computes exp" in str(w.message)]) == 1
        assert {call.function for call in lrp.coverage().plain_gradient} == {"exp"}

    def test_a_strict_mapper_watches_every_new_signature_at_once(self):
        lrp = LRP(seeded(ProductThenDecayWhenLong), CPLRP(strict=True), in_keys=["x"], out_keys=["y"])
        with lrp:
            lrp(sequences(2))
            lrp(sequences(3))
            with pytest.raises(ValueError, match="computes cumprod"):
                lrp(sequences(4))
