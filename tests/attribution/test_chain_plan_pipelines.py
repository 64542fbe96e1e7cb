"""Pipelines whose first step is a planned chain (torchrl's QValueActor): the chain runs by its plan, the steps
after it as they are, and every call equals the general path's.

The oracle is the wrapper's general path on a copy of the pipeline whose head chain carries a forward hook doing
nothing, which keeps the plan aside.
"""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule, TensorDictSequential
from torch import nn
from torchrl.modules import MLP, QValueActor

from tdhook.attribution import LRP
from tdhook.attribution._chain_plan import PlannedCall
from tdhook.attribution.lrp_helpers.rules import EpsilonPlus
from tdhook.attribution.rules import EpsilonRule
from tests.attribution.test_chain_plan import assert_same_call, calls


def _general_copy(pipeline: TensorDictSequential) -> TensorDictSequential:
    """A copy of ``pipeline`` whose head chain has a forward hook that changes nothing: the plan stands aside."""
    pipeline = copy.deepcopy(pipeline)
    pipeline.module[0].module.register_forward_hook(lambda m, args, out: None)
    return pipeline


def _q_value_actor(action_space: str) -> QValueActor:
    torch.manual_seed(3)
    chain = MLP(in_features=5, out_features=4, num_cells=[8, 8], activation_class=nn.Tanh)
    return QValueActor(chain, in_keys=["observation"], action_space=action_space).double()


def _with_ruled_tail() -> TensorDictSequential:
    torch.manual_seed(4)
    head = TensorDictModule(nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 4)), ["observation"], ["hidden"])
    tail = TensorDictModule(nn.Sequential(nn.Tanh(), nn.Linear(4, 3)), in_keys=["hidden"], out_keys=["logits"])
    return TensorDictSequential(head, tail).double()


@pytest.mark.parametrize("target_key", [None, "action_value"])
@pytest.mark.parametrize(
    "make",
    [lambda: _q_value_actor("one_hot"), lambda: _q_value_actor("categorical"), _with_ruled_tail],
    ids=["q-value one-hot", "q-value categorical", "ruled tail"],
)
def test_a_pipeline_whose_first_step_is_a_chain_runs_its_tail_as_it_is(make, target_key):
    """torchrl's QValueActor runs its Q-network, then a QValueModule that picks the action: the chain is planned
    and the steps after it run as they are (their rules included), their outputs taking the gradient to the
    chain's output with autograd. Every output and the relevance are the general path's."""
    pipeline = make()
    if target_key is not None and "action_value" not in pipeline.out_keys:
        target_key = "hidden"
    td = TensorDict(observation=torch.randn(6, 5, dtype=torch.float64), batch_size=[6])
    ours, planned = calls(LRP(pipeline, EpsilonPlus(), target_key=target_key), td, n=3)
    general, _ = calls(LRP(_general_copy(pipeline), EpsilonPlus(), target_key=target_key), td, n=3)
    assert planned == [False, True, True]
    for mine, theirs in zip(ours, general, strict=True):
        assert_same_call(mine, theirs)


def _tail_reading_the_input() -> TensorDictSequential:
    torch.manual_seed(5)
    head = TensorDictModule(nn.Sequential(nn.Linear(5, 4), nn.ReLU()), ["observation"], ["hidden"])
    tail = TensorDictModule(Concatenated(), in_keys=["hidden", "observation"], out_keys=["value"])
    return TensorDictSequential(head, tail).double()


class Concatenated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(9, 1)

    def forward(self, hidden: torch.Tensor, observation: torch.Tensor) -> torch.Tensor:
        return self.layer(torch.cat([hidden, observation], -1))


def assert_general_path(pipeline: TensorDictSequential) -> None:
    """Two calls of ``pipeline`` in one context take the general path, and equal those of the hooked copy."""
    td = TensorDict(observation=torch.randn(6, 5, dtype=torch.float64), batch_size=[6])
    ours, planned = calls(LRP(pipeline, EpsilonPlus()), td, n=2)
    general, _ = calls(LRP(_general_copy(pipeline), EpsilonPlus()), td, n=2)
    assert planned == [False, False]
    for mine, theirs in zip(ours, general, strict=True):
        assert_same_call(mine, theirs)


@pytest.mark.parametrize(
    "make",
    [
        _tail_reading_the_input,  # relevance reaches the input beside the chain
        lambda: TensorDictSequential(*_with_ruled_tail().module, selected_out_keys=["logits"]),
        lambda: TensorDictSequential(*_with_ruled_tail().module, partial_tolerant=True),
    ],
    ids=["tail reads the input", "selected out keys", "partial tolerant"],
)
def test_pipelines_the_plan_does_not_follow_take_the_general_path(make):
    pipeline = make()
    assert_general_path(pipeline)


def _change_pipeline(pipeline: TensorDictSequential, change: str) -> None:
    torch.manual_seed(6)
    if change == "hook on the head":
        pipeline.module[0].register_forward_hook(lambda m, args, out: out.set("hidden", out["hidden"] * 2))
    elif change == "step appended":
        pipeline.module.append(TensorDictModule(nn.Linear(3, 2).double(), in_keys=["logits"], out_keys=["q"]))
    elif change == "a step set to read the input":
        step = pipeline.module[1]
        step.module, step.in_keys = nn.Linear(5, 3).double(), ["observation"]
    elif change == "a step reading the input appended to a nested pipeline":
        step = TensorDictModule(nn.Linear(5, 2).double(), in_keys=["observation"], out_keys=["logits"])
        pipeline.module[1].module.append(step)
    else:
        pipeline.module[0] = copy.deepcopy(pipeline.module[0])


@pytest.mark.parametrize(
    "change",
    [
        "hook on the head",
        "step appended",
        "head replaced",
        "a step set to read the input",
        "a step reading the input appended to a nested pipeline",
    ],
)
def test_a_pipeline_changed_inside_the_context_sets_the_plan_aside(change):
    """After the change the call is the general path's on the changed pipeline (whose new parts get their rules: the
    context follows the change, see test_model_changes.py)."""
    pipeline = _with_ruled_tail()
    if change.endswith("nested pipeline"):
        head, tail = pipeline.module
        pipeline = TensorDictSequential(head, TensorDictSequential(tail))
    general = _general_copy(pipeline)
    td = TensorDict(observation=torch.randn(6, 5, dtype=torch.float64), batch_size=[6])
    lrp, reference = LRP(pipeline, EpsilonPlus()), LRP(general, EpsilonPlus())
    with lrp, reference, mock.patch.object(PlannedCall, "run", autospec=True, side_effect=PlannedCall.run) as run:
        for _ in range(2):
            assert_same_call(lrp(td.clone()), reference(td.clone()))
        assert run.call_count == 1
        _change_pipeline(pipeline, change)
        _change_pipeline(general, change)
        result, expected = lrp(td.clone()), reference(td.clone())
        assert run.call_count == 1
    assert_same_call(result, expected)


class _DoubledInPlace(nn.Module):
    """Doubles its input in place (as a step may do to the action values it reads), then adds one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2.0)
        return x + 1


@pytest.mark.parametrize("last", [nn.Tanh, nn.ReLU, None], ids=["tanh last", "relu last", "linear last"])
def test_a_tail_that_changes_the_chain_output_in_place_gives_the_general_paths_call(last):
    """A step after the chain may change the chain's output in place, as it may on the general path, which keeps
    the chain's factors as they were in the forward pass; where autograd needs that output itself (a ReLU last:
    its gradient reads its output) the general path raises, and so does the plan."""
    torch.manual_seed(7)
    layers = [nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 4), *([last()] if last else [])]
    head = TensorDictModule(nn.Sequential(*layers), ["observation"], ["hidden"])
    pipeline = TensorDictSequential(head, TensorDictModule(_DoubledInPlace(), ["hidden"], ["out"])).double()
    td = TensorDict(observation=torch.randn(6, 5, dtype=torch.float64), batch_size=[6])
    lrp, reference = LRP(pipeline, EpsilonPlus()), LRP(_general_copy(pipeline), EpsilonPlus())
    with lrp, reference, mock.patch.object(PlannedCall, "run", autospec=True, side_effect=PlannedCall.run) as run:
        for _ in range(3):
            given, before = td.clone(), td.clone()
            if last is nn.ReLU:
                with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                    reference(td.clone())
                with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                    lrp(given)
                assert set(given.keys(True, True)) == {"observation"} and (given == before).all()
            else:
                assert_same_call(lrp(given), reference(td.clone()))
        assert run.call_count == 2  # every call after the first is planned


class _ReadsBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(5, 1)

    def forward(self, observation: TensorDict, hidden: torch.Tensor) -> torch.Tensor:
        return self.layer(observation["x"]) + hidden.sum(-1, keepdim=True)


def test_a_tail_reading_the_branch_that_holds_the_input_takes_the_general_path():
    """A step that reads the sub-TensorDict holding the explained input reads the input itself: relevance reaches
    it beside the chain, as the general path finds."""
    torch.manual_seed(8)
    head = TensorDictModule(nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 4)), [("obs", "x")], ["hidden"])
    pipeline = TensorDictSequential(head, TensorDictModule(_ReadsBranch(), ["obs", "hidden"], ["out"])).double()
    td = TensorDict(obs=TensorDict(x=torch.randn(6, 5, dtype=torch.float64), batch_size=[6]), batch_size=[6])
    options = {"in_keys": [("obs", "x")], "target_key": "out"}
    ours, planned = calls(LRP(pipeline, EpsilonPlus(), **options), td, n=2)
    general, _ = calls(LRP(_general_copy(pipeline), EpsilonPlus(), **options), td, n=2)
    assert planned == [False, False]
    for mine, theirs in zip(ours, general, strict=True):
        assert_same_call(mine, theirs)


class _FunctionGate(nn.Module):
    """A gate computed with functions (``sigmoid(a) * b``), which the presets hold constant after the first call."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 6)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        z = self.layer(hidden)
        return torch.sigmoid(z[..., :3]) * z[..., 3:]


def test_a_tail_computing_a_gate_with_functions_takes_the_general_path():
    """The gate is held under a function mode that the calls after the first enter around the model: the tail
    would run without it, so the call takes the general path."""
    torch.manual_seed(9)
    head = TensorDictModule(nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 4)), ["observation"], ["hidden"])
    pipeline = TensorDictSequential(head, TensorDictModule(_FunctionGate(), ["hidden"], ["out"])).double()
    td = TensorDict(observation=torch.randn(6, 5, dtype=torch.float64), batch_size=[6])
    ours, planned = calls(LRP(pipeline, EpsilonPlus()), td, n=3)
    general, _ = calls(LRP(_general_copy(pipeline), EpsilonPlus()), td, n=3)
    assert planned == [False, False, False]
    for mine, theirs in zip(ours, general, strict=True):
        assert_same_call(mine, theirs)


@pytest.mark.parametrize("chain", ["linear layers", "an activation alone"])
def test_a_tail_whose_rule_reads_the_layers_before_it_takes_the_general_path(chain):
    """A rule of the input layer (the flat rule) on a step after the chain walks back through the graph to the
    layers before it: through the chain's Linear layers it raises, through glue alone it gives the explained
    input the relevance the gradient cannot carry. The planned chain leaves no such graph, so the call takes the
    general path, which raises or gives the same relevance."""
    from tdhook.attribution.rules import GlueError, PassRule
    from tdhook.attribution.rules.input_layer import FlatRule

    torch.manual_seed(10)
    layers = [nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 5)] if chain == "linear layers" else [nn.Tanh()]
    head = TensorDictModule(nn.Sequential(*layers), ["observation"], ["hidden"])
    tail = TensorDictModule(nn.Sequential(nn.Linear(5, 3)), ["hidden"], ["out"])
    pipeline = TensorDictSequential(head, tail).double()
    mapper = {"module.1.module.0": FlatRule(), nn.Linear: EpsilonRule(0.0), (nn.Tanh, nn.ReLU): PassRule()}
    td = TensorDict(observation=torch.randn(6, 5, dtype=torch.float64), batch_size=[6])
    lrp, reference = LRP(pipeline, mapper), LRP(_general_copy(pipeline), mapper)
    with lrp, reference, mock.patch.object(PlannedCall, "run", autospec=True, side_effect=PlannedCall.run) as run:
        for _ in range(2):
            if chain == "linear layers":
                with pytest.raises(GlueError, match="the layer.s input is the output of another Linear"):
                    reference(td.clone())
                with pytest.raises(GlueError, match="the layer.s input is the output of another Linear"):
                    lrp(td.clone())
            else:
                assert_same_call(lrp(td.clone()), reference(td.clone()))
        assert run.call_count == 0


class _Raising(nn.Module):
    """A Linear layer that raises ``error`` when it is set."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 3)
        self.error: BaseException | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        output = self.layer(hidden)
        if self.error is not None:
            raise self.error
        return output


@pytest.mark.parametrize("error", [RuntimeError("in the tail"), KeyboardInterrupt()], ids=["error", "interrupt"])
def test_a_tail_that_raises_leaves_the_call_and_the_context_as_they_were(error):
    """The caller's TensorDict and the model's hooks are unchanged, and the next call is planned and the general
    path's."""
    torch.manual_seed(11)
    head = TensorDictModule(nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 4)), ["observation"], ["hidden"])
    raising = _Raising()
    pipeline = TensorDictSequential(head, TensorDictModule(raising, ["hidden"], ["out"])).double()
    td = TensorDict(observation=torch.randn(6, 5, dtype=torch.float64), batch_size=[6])
    lrp, reference = LRP(pipeline, EpsilonPlus()), LRP(_general_copy(pipeline), EpsilonPlus())

    def hooks() -> list[int]:
        return [len(getattr(m, name)) for m in pipeline.modules() for name in ("_forward_hooks", "_forward_pre_hooks")]

    with lrp, reference, mock.patch.object(PlannedCall, "run", autospec=True, side_effect=PlannedCall.run) as run:
        expected = reference(td.clone())
        lrp(td.clone())
        given, before, registered = td.clone(), td.clone(), hooks()
        raising.error = error
        with pytest.raises(type(error)):
            lrp(given)
        assert run.call_count == 1  # the call that raised was planned
        assert set(given.keys(True, True)) == {"observation"} and (given == before).all()
        assert hooks() == registered
        raising.error = None
        assert_same_call(lrp(td.clone()), expected)
        assert run.call_count == 2


def test_a_batch_norm_right_after_the_chain_takes_the_general_path():
    """The presets merge a BatchNorm into the Linear layer before it, here the chain's last one (the merge reads
    the layers' marks, which the planned chain leaves none of): the call takes the general path."""
    torch.manual_seed(12)
    head = TensorDictModule(nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 4)), ["observation"], ["hidden"])
    norm = nn.BatchNorm1d(4).eval()
    norm.running_mean.uniform_(-1.0, 1.0)
    norm.running_var.uniform_(0.5, 2.0)
    tail = TensorDictModule(nn.Sequential(norm, nn.Linear(4, 2)), ["hidden"], ["out"])
    pipeline = TensorDictSequential(head, tail).double()
    assert_general_path(pipeline)
