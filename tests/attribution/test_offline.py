"""Offline attribution over replay buffers and memory-mapped TensorDicts."""

from __future__ import annotations

import pytest
import torch
from tensordict import MemoryMappedTensor, TensorDict
from tensordict.nn import NormalParamExtractor, TensorDictModule, TensorDictSequential
from torch import nn
from torch.distributions import Categorical
from torchrl.data import (
    Bounded,
    LazyMemmapStorage,
    LazyTensorStorage,
    ListStorage,
    ReplayBuffer,
    TensorDictReplayBuffer,
)
from torchrl.envs import ObservationNorm, Transform
from torchrl.envs.utils import ExplorationType, set_exploration_type
from torchrl.modules import (
    MLP,
    Actor,
    AdditiveGaussianModule,
    GRUModule,
    LSTMModule,
    MaskedCategorical,
    ProbabilisticActor,
    QValueActor,
    TanhNormal,
    set_recurrent_mode,
)

from tdhook.attribution import (
    LRP,
    FeatureAblation,
    InputXGradient,
    IntegratedGradients,
    Occlusion,
    Saliency,
    UniformEpsilon,
    explain_offline,
)
from tdhook.attribution._offline_shards import shard_runs
from tdhook.attribution.lrp_helpers.rules import EpsilonGammaBox, EpsilonPlus
from tdhook.attribution.offline import _missing_runs, _unmark_changed_rows


def q_actor() -> QValueActor:
    net = MLP(in_features=4, out_features=2, num_cells=[16]).double()
    return QValueActor(net, in_keys=["observation"], action_space="one-hot")


def data(rows: int = 37) -> TensorDict:
    return TensorDict(observation=torch.randn(rows, 4, dtype=torch.float64), batch_size=[rows])


def test_memmapped_source_in_batches_equals_one_big_call(tmp_path):
    source = data().memmap_(tmp_path / "data")
    lrp = LRP(q_actor(), EpsilonPlus())
    out = explain_offline(lrp, source, tmp_path / "relevance", batch_size=8, progress=False)
    whole = lrp(source.to_tensordict())["relevance", "observation"]
    torch.testing.assert_close(out["relevance", "observation"].clone(), whole, rtol=1e-12, atol=1e-14)
    reopened = TensorDict.load_memmap(tmp_path / "relevance")
    assert isinstance(reopened["relevance", "observation"], MemoryMappedTensor) and reopened.batch_size == (37,)
    torch.testing.assert_close(reopened["relevance", "observation"].clone(), whole, rtol=1e-12, atol=1e-14)


def test_replay_buffer_with_memmap_storage(tmp_path):
    buffer = ReplayBuffer(storage=LazyMemmapStorage(100, scratch_dir=tmp_path / "buffer"))
    rows = data(23)
    buffer.extend(rows)
    lrp = LRP(q_actor(), EpsilonPlus())
    out = explain_offline(lrp, buffer, tmp_path / "relevance", batch_size=5, progress=True)
    assert out.batch_size == (23,)
    expected = lrp(rows.clone())["relevance", "observation"]
    torch.testing.assert_close(out["relevance", "observation"].clone(), expected, rtol=1e-12, atol=1e-14)


def test_slices_fill_the_same_output_like_separate_ranks(tmp_path):
    source = data(20)
    lrp = LRP(q_actor(), EpsilonPlus())
    explain_offline(lrp, source, tmp_path / "out", start=0, stop=0, progress=False)  # creates the files
    explain_offline(lrp, source, tmp_path / "out", start=10, stop=20, progress=False)
    out = explain_offline(lrp, source, tmp_path / "out", start=0, stop=10, progress=False)
    expected = lrp(source.clone())["relevance", "observation"]
    torch.testing.assert_close(out["relevance", "observation"].clone(), expected, rtol=1e-12, atol=1e-14)


def test_memory_does_not_grow_with_the_source(tmp_path):
    source = data(4096).memmap_(tmp_path / "data")
    lrp = LRP(q_actor(), EpsilonPlus())
    sizes = []

    class Recorder(nn.Module):
        def forward(self, x):
            sizes.append(x.shape[0])
            return x

    lrp.module.module[0].module.insert(0, Recorder())
    explain_offline(lrp, source, tmp_path / "relevance", batch_size=256, progress=False)
    # The model never sees more than one batch at a time.
    assert max(sizes) == 256 and sum(sizes) == 4096


def test_a_context_the_caller_opened_is_used_and_left_open(tmp_path):
    source = data(13)
    lrp = LRP(q_actor(), EpsilonPlus())
    with lrp:
        out = explain_offline(lrp, source, tmp_path / "out", batch_size=4, progress=False)
        again = explain_offline(lrp, source, tmp_path / "out", start=3, stop=3, progress=False)  # checks by a row
        expected = lrp(source.clone())["relevance", "observation"]  # still open
    torch.testing.assert_close(out["relevance", "observation"].clone(), expected, rtol=1e-12, atol=1e-14)
    assert bool(again["explained"].all())
    torch.testing.assert_close(lrp(source.clone())["relevance", "observation"], expected)  # entered per call


def test_inside_the_wrappers_inactive_block_the_rows_get_what_its_calls_give(tmp_path):
    """``lrp.inactive()`` switches the rules off: entering the context in the block put them back on, silently."""
    source = data(9)
    lrp = LRP(q_actor(), EpsilonPlus())
    with lrp.inactive():
        out = explain_offline(lrp, source, tmp_path / "out", batch_size=4, progress=False)
        expected = lrp(source.clone())["relevance", "observation"]  # gradient x input
    torch.testing.assert_close(out["relevance", "observation"].clone(), expected, rtol=1e-12, atol=1e-14)
    assert not torch.allclose(expected, lrp(source.clone())["relevance", "observation"])  # LRP's differs


@pytest.mark.parametrize("storage", [None, LazyTensorStorage, ListStorage])
def test_a_source_with_no_rows_is_named_before_anything_is_written(tmp_path, storage):
    source = data(0) if storage is None else ReplayBuffer(storage=storage(10))
    with pytest.raises(ValueError, match=r"the source \((TensorDict|ReplayBuffer)\) holds no rows"):
        explain_offline(LRP(q_actor(), EpsilonPlus()), source, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_bad_rows_and_mismatched_output_are_named(tmp_path):
    lrp = LRP(q_actor(), EpsilonPlus())
    with pytest.raises(ValueError, match="rows 5:50 are not within the source's 10 rows"):
        explain_offline(lrp, data(10), tmp_path / "a", start=5, stop=50, progress=False)
    explain_offline(lrp, data(10), tmp_path / "b", progress=False)
    with pytest.raises(ValueError, match="has 10 rows, the source 12"):
        explain_offline(lrp, data(12), tmp_path / "b", progress=False)


def test_a_prefix_holding_another_memmapped_tensordict_is_refused(tmp_path):
    lrp = LRP(q_actor(), EpsilonPlus())
    data(10).memmap_(tmp_path / "data")  # the source itself, say
    with pytest.raises(ValueError, match=r"'.*data' already holds a memory-mapped TensorDict that explain_offline"):
        explain_offline(lrp, data(10), tmp_path / "data", progress=False)
    explain_offline(lrp, data(10), tmp_path / "out", progress=False)
    other = LRP(q_actor(), EpsilonPlus(), relevance_key="attribution")
    with pytest.raises(ValueError, match=r"'.*out' already holds another memory-mapped TensorDict"):
        explain_offline(other, data(10), tmp_path / "out", progress=False)


def test_a_prefix_holding_other_files_is_refused_before_anything_is_written(tmp_path):
    """A folder of one's own files was written into, the output's files beside them; one with a meta.json of
    something else gave tensordict's bare ``KeyError: '_type'``."""
    lrp = LRP(q_actor(), EpsilonPlus())
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "notes.txt").write_text("mine")
    with pytest.raises(
        ValueError, match=r"'.*notes' holds files that are not a memory-mapped TensorDict \(notes.txt\)"
    ):
        explain_offline(lrp, data(10), tmp_path / "notes", progress=False)
    assert [entry.name for entry in (tmp_path / "notes").iterdir()] == ["notes.txt"]
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "meta.json").write_text('{"name": "a configuration"}')
    with pytest.raises(ValueError, match=r"'.*config' holds a meta.json that is not a memory-mapped TensorDict's"):
        explain_offline(lrp, data(10), tmp_path / "config", progress=False)
    explain_offline(lrp, data(10), tmp_path / "empty", progress=False)  # a new folder, and an empty one
    (tmp_path / "made").mkdir()
    assert bool(explain_offline(lrp, data(10), tmp_path / "made", progress=False)["explained"].all())


class Interrupt(nn.Module):
    """Counts the rows it sees; raises KeyboardInterrupt at the call numbered ``at``."""

    def __init__(self, at: int | None) -> None:
        super().__init__()
        self.at, self.calls, self.rows = at, 0, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        self.rows += x.shape[0]
        return x


def test_an_interrupted_run_is_visibly_incomplete_and_a_rerun_finishes_only_the_missing_rows(tmp_path):
    source = data(40)
    lrp = LRP(q_actor(), EpsilonPlus())
    expected = lrp(source.clone())["relevance", "observation"]
    interrupt = Interrupt(at=3)
    lrp.module.module[0].module.insert(0, interrupt)
    with pytest.raises(KeyboardInterrupt):
        explain_offline(lrp, source, tmp_path / "out", batch_size=8, progress=False)
    partial = TensorDict.load_memmap(tmp_path / "out")
    assert partial["explained"].tolist() == [True] * 16 + [False] * 24
    interrupt.at, interrupt.rows = None, 0
    out = explain_offline(lrp, source, tmp_path / "out", batch_size=8, progress=False)
    assert interrupt.rows == 24 and bool(out["explained"].all())
    torch.testing.assert_close(out["relevance", "observation"].clone(), expected, rtol=1e-12, atol=1e-14)
    interrupt.rows = 0
    explain_offline(lrp, source, tmp_path / "out", batch_size=8, progress=False)
    assert interrupt.rows == 1  # all done: one row is run to check the output is this explanation's


@pytest.mark.parametrize("kind", ["tensordict", "buffer"])
def test_sources_with_two_batch_dimensions(tmp_path, kind):
    steps = TensorDict(observation=torch.randn(4, 5, 4, dtype=torch.float64), batch_size=[4, 5])
    lrp = LRP(q_actor(), EpsilonPlus())
    if kind == "buffer":
        source = ReplayBuffer(storage=LazyTensorStorage(40, ndim=2))
        source.extend(steps)
        rows = source.storage[:].clone()  # the storage's own [N, T] layout
    else:
        source = rows = steps
    out = explain_offline(lrp, source, tmp_path / "out", batch_size=3, progress=False)
    expected = lrp(rows.clone())["relevance", "observation"]
    assert out.batch_size == rows.batch_size and expected.shape == (*rows.batch_size, 4)
    torch.testing.assert_close(out["relevance", "observation"].clone(), expected, rtol=1e-12, atol=1e-14)


def recurrent_policy_and_trajectories(kind: str) -> tuple[TensorDictSequential, TensorDict]:
    torch.manual_seed(0)
    module = LSTMModule if kind == "LSTM" else GRUModule
    rnn = module(input_size=4, hidden_size=5, in_key="observation", out_key="embed").double()
    head = TensorDictModule(MLP(in_features=5, out_features=2, num_cells=[8]).double(), ["embed"], ["action_value"])
    steps = TensorDict(
        observation=torch.randn(4, 5, 4, dtype=torch.float64),
        is_init=torch.zeros(4, 5, 1, dtype=torch.bool),
        batch_size=[4, 5],
    )
    steps["is_init"][:, 0] = True
    return TensorDictSequential(rnn, head), steps


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_trajectories_of_a_recurrent_policy_that_hold_no_recurrent_states(tmp_path, kind):
    """A torchrl LSTMModule/GRUModule reads its recurrent states when the data holds them and starts from zeros
    otherwise: stored trajectories ``[N, T]`` without them are explained by their observations alone."""
    policy, steps = recurrent_policy_and_trajectories(kind)
    buffer = ReplayBuffer(storage=LazyTensorStorage(40, ndim=2))
    buffer.extend(steps)
    lrp = LRP(policy, EpsilonPlus())
    with set_recurrent_mode(True):
        expected = lrp(steps.clone())["relevance", "observation"]
        for source in (steps, buffer.storage[:].transpose(0, 1)):  # trajectories as rows
            out = explain_offline(lrp, source, tmp_path / f"out-{len(list(tmp_path.iterdir()))}", progress=False)
            assert set(out.keys(include_nested=True, leaves_only=True)) == {("relevance", "observation"), "explained"}
            torch.testing.assert_close(out["relevance", "observation"].clone(), expected)


def test_a_time_major_buffer_under_a_policy_in_recurrent_mode_is_refused_naming_the_module(tmp_path):
    """A replay buffer of ``ndim=2`` extended along time (torchrl's default) stores time first, so its rows are time
    steps; a recurrent module in recurrent mode would read its environments as time steps (50% off)."""
    policy, steps = recurrent_policy_and_trajectories("GRU")
    buffer = ReplayBuffer(storage=LazyTensorStorage(40, ndim=2))
    buffer.extend(steps)
    with set_recurrent_mode(True), pytest.raises(ValueError, match=r"GRUModule 'module.0'.*recurrent mode.*transpose"):
        explain_offline(LRP(policy, EpsilonPlus()), buffer, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    out = explain_offline(LRP(policy, EpsilonPlus()), buffer, tmp_path / "out", progress=False)  # step by step
    assert out.batch_size == (5, 4)


@pytest.mark.parametrize("kind", ["tensordict", "buffer"])
def test_rows_of_one_batch_dimension_under_a_policy_in_recurrent_mode_are_refused_naming_the_module(tmp_path, kind):
    """Rows of one batch dimension are the time steps of one sequence under recurrent mode: batches would cut it
    into sequences of their own, each starting from zero states (the direct call's relevance differs, silently)."""
    policy, steps = recurrent_policy_and_trajectories("LSTM")
    trajectory = steps[0].clone()  # [5]: one trajectory, its steps as rows
    source = trajectory
    if kind == "buffer":
        source = ReplayBuffer(storage=LazyTensorStorage(10))
        source.extend(trajectory)
    lrp = LRP(policy, EpsilonPlus())
    with set_recurrent_mode(True):
        with pytest.raises(ValueError, match=r"one batch dimension.*LSTMModule 'module.0'.*recurrent mode.*unsqueeze"):
            explain_offline(lrp, source, tmp_path / "out", batch_size=2, progress=False)
        assert not (tmp_path / "out").exists()
        out = explain_offline(lrp, trajectory.unsqueeze(0), tmp_path / "row", batch_size=2, progress=False)
        expected = lrp(trajectory.clone())["relevance", "observation"]
    torch.testing.assert_close(out["relevance", "observation"][0].clone(), expected)


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_ranks_share_whole_batches_contiguously_and_balanced_by_rows(world_size):
    generator = torch.Generator().manual_seed(world_size)
    sizes = torch.randint(1, 9, (17,), generator=generator).tolist()
    bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
    runs = list(zip(bounds[:-1], bounds[1:], strict=True))
    shares = [shard_runs(runs, rank, world_size) for rank in range(world_size)]
    assert [run for share in shares for run in share] == runs  # every batch once, in order: contiguous shares
    for share in shares:  # each share is within one batch of an even split
        assert abs(sum(end - begin for begin, end in share) - bounds[-1] / world_size) <= max(sizes)
    assert shard_runs([], 0, world_size) == []


def test_without_a_process_group_nothing_waits_and_no_row_is_run_twice(tmp_path, monkeypatch):
    def no_barrier():
        raise AssertionError("explain_offline waited for other ranks without a process group")

    monkeypatch.setattr("tdhook.attribution._offline_shards.dist.barrier", no_barrier)
    lrp = LRP(q_actor(), EpsilonPlus())
    interrupt = Interrupt(at=None)
    lrp.module.module[0].module.insert(0, interrupt)
    explain_offline(lrp, data(37), tmp_path / "out", batch_size=8, progress=False)
    assert interrupt.calls == 5 and interrupt.rows == 37  # 8, 8, 8, 8, 5: no extra call to check the output
    with pytest.raises(RuntimeError, match=r"distributed=True\) needs an initialised torch.distributed process"):
        explain_offline(lrp, data(37), tmp_path / "out", progress=False, distributed=True)


def test_a_process_group_of_one_rank_gives_the_result_of_no_group_bit_for_bit(tmp_path):
    import torch.distributed as dist

    source = data(37)
    lrp = LRP(q_actor(), EpsilonPlus())
    alone = explain_offline(lrp, source, tmp_path / "alone", batch_size=8, progress=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        out = explain_offline(lrp, source, tmp_path / "group", batch_size=8, progress=False)
        other = LRP(q_actor(), EpsilonPlus(), relevance_key="other")
        with pytest.raises(ValueError, match=r"'.*alone' already holds another memory-mapped TensorDict"):
            explain_offline(other, source, tmp_path / "alone", progress=False)
    finally:
        dist.destroy_process_group()
    assert torch.equal(out["relevance", "observation"].clone(), alone["relevance", "observation"].clone())
    assert bool(out["explained"].all())


def rows_not_done_in_batches(done: torch.Tensor, start: int, stop: int, batch_size: int) -> list[tuple[int, int]]:
    """Row by row: a batch starts at a row not done after a row done, or once the previous batch is full."""
    batches: list[list[int]] = []
    for row in range(start, stop):
        if bool(done[row].all()):
            continue
        if batches and batches[-1][-1] == row - 1 and len(batches[-1]) < batch_size:
            batches[-1].append(row)
        else:
            batches.append([row])
    return [(batch[0], batch[-1] + 1) for batch in batches]


@pytest.mark.parametrize("steps", [None, 3])
def test_the_batches_cover_exactly_the_rows_not_done(steps):
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        rows = int(torch.randint(1, 30, (), generator=generator))
        shape = (rows,) if steps is None else (rows, steps)
        done = torch.rand(shape, generator=generator) < torch.rand((), generator=generator)
        start = int(torch.randint(0, rows + 1, (), generator=generator))
        stop = int(torch.randint(start, rows + 1, (), generator=generator))
        batch_size = int(torch.randint(1, 8, (), generator=generator))
        assert _missing_runs(done, start, stop, batch_size) == rows_not_done_in_batches(done, start, stop, batch_size)


class BatchSizes:
    """Records the number of rows of every call of the module it is a forward pre-hook of (a hook: a module put into
    the model changes its layout, and a run resumed with it is refused)."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, module: nn.Module, args: tuple) -> None:
        self.sizes.append(args[0].shape[0])


def test_a_mask_with_holes_is_finished_stretch_by_stretch(tmp_path):
    source = data(30)
    lrp = LRP(q_actor(), EpsilonPlus())
    expected = lrp(source.clone())["relevance", "observation"]
    out = explain_offline(lrp, source, tmp_path / "out", batch_size=4, progress=False)
    holes = torch.zeros(30, dtype=torch.bool)
    holes[2:7] = holes[9] = holes[20:] = True
    out["explained"][holes] = False
    out["relevance", "observation"][holes] = 0.0
    recorder = BatchSizes()
    lrp.module.module[0].module.register_forward_pre_hook(recorder)
    out = explain_offline(lrp, source, tmp_path / "out", batch_size=4, progress=False)
    assert recorder.sizes == [4, 1, 1, 4, 4, 2]  # rows 2:6, 6:7, 9:10, 20:24, 24:28, 28:30
    assert bool(out["explained"].all())
    torch.testing.assert_close(out["relevance", "observation"].clone(), expected, rtol=1e-12, atol=1e-14)


def test_an_empty_range_over_an_existing_output_explains_nothing(tmp_path):
    lrp = LRP(q_actor(), EpsilonPlus())
    first = explain_offline(lrp, data(10), tmp_path / "out", stop=4, progress=False)
    written = first["relevance", "observation"].clone()
    recorder = BatchSizes()
    lrp.module.module[0].module.register_forward_pre_hook(recorder)
    out = explain_offline(lrp, data(10), tmp_path / "out", start=5, stop=5, progress=False)
    assert recorder.sizes == [1]  # only the row that checks the output is this explanation's
    assert out["explained"].tolist() == [True] * 4 + [False] * 6
    assert torch.equal(out["relevance", "observation"].clone(), written)


def test_relevance_that_keeps_its_graph_is_stored_without_it(tmp_path):
    net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)).double()
    lrp = LRP(net, in_keys=["observation"], out_keys=["action_value"], create_graph=True)
    source = data(10)
    out = explain_offline(lrp, source, tmp_path / "out", batch_size=4, progress=False)
    with lrp:
        expected = lrp(source.clone())["relevance", "observation"]
    assert expected.requires_grad and not out["relevance", "observation"].requires_grad
    torch.testing.assert_close(out["relevance", "observation"].clone(), expected.detach(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("explainer", [lambda: q_actor(), lambda: nn.Linear(4, 2)], ids=["policy", "plain-module"])
def test_an_explainer_other_than_lrp_or_a_method_is_named_before_anything_is_written(tmp_path, explainer):
    """The policy itself was refused by Python's ``with`` ("does not support the context manager protocol"),
    naming neither explain_offline nor what it takes."""
    explainer = explainer()
    message = rf"explain_offline runs an LRP wrapper .* or an attribution method .* got {type(explainer).__name__}$"
    with pytest.raises(TypeError, match=message):
        explain_offline(explainer, data(8), tmp_path / "out", progress=False)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "explainer",
    [
        lambda: LRP(q_actor(), EpsilonPlus(), relevance_key="explained"),
        lambda: Saliency(q_actor(), relevance_key="explained"),
    ],
    ids=["lrp", "method"],
)
def test_a_relevance_key_that_clashes_with_the_mask_of_rows_done_is_named_before_anything_is_written(
    tmp_path, explainer
):
    """The relevance at ``("explained", "observation")`` and the mask at ``"explained"`` cannot both be stored: the
    first batch created the output and then refused it as "another memory-mapped TensorDict", left behind."""
    explainer = explainer()
    message = r"rows done at 'explained', where \w+ would store \('explained', 'observation'\) \(its relevance_key"
    with pytest.raises(ValueError, match=message):
        explain_offline(explainer, data(8), tmp_path / "out", progress=False)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("rows", [4, 8], ids=["one-batch", "whole-source"])
@pytest.mark.parametrize("make", [LRP, Saliency], ids=["lrp", "method"])
def test_a_target_tensor_of_rows_is_named_before_anything_is_written(tmp_path, rows, make):
    """A target tensor of per-row indices is the target of one call's rows, which every batch took as it was: shaped
    like a batch (4 of 8 rows, batches of 4), the second batch was explained at the first batch's indices, with no
    word; shaped like the source, each batch failed on its shape."""
    explainer = make(q_actor(), target=torch.tensor([0, 1] * (rows // 2)), target_key="action_value")
    with pytest.raises(ValueError, match=rf"explain_offline: target is a tensor of shape \({rows},\), the targets of"):
        explain_offline(explainer, data(8), tmp_path / "out", batch_size=4, progress=False)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("source", "options", "error", "match"),
    [
        (torch.ones(4, 4), {}, TypeError, "explain_offline reads a TensorDict or a torchrl ReplayBuffer, got Tensor"),
        (TensorDict(observation=torch.ones(4)), {}, ValueError, r"at least one batch dimension, got batch_size \[\]"),
        (data(8), {"batch_size": 0}, ValueError, "explain_offline: batch_size must be positive, got 0"),
    ],
    ids=["tensor", "no-batch-dimension", "batch-size-0"],
)
def test_a_source_or_batch_size_it_cannot_read_is_named_before_anything_is_written(
    tmp_path, source, options, error, match
):
    lrp = LRP(q_actor(), EpsilonPlus())
    with pytest.raises(error, match=match):
        explain_offline(lrp, source, tmp_path / "out", **options)
    assert not any(tmp_path.iterdir())
    rows = data(8)
    expected = lrp(rows.clone())["relevance", "observation"]
    written = explain_offline(lrp, rows, tmp_path / "out", batch_size=3)
    assert torch.allclose(written["relevance", "observation"], expected, rtol=1e-12, atol=1e-14)


def test_a_buffers_transform_is_applied_to_the_rows_as_its_samples_are(tmp_path):
    """A buffer that standardises its observations when sampled: the policy reads the standardised rows, and so
    must the explanation (it read the stored raw rows: 1.08 off, with no word); the storage is left as it is."""
    raw = torch.randn(16, 4, dtype=torch.float64) * 0.1 + 5.0
    loc, scale = torch.tensor(5.0, dtype=torch.float64), torch.tensor(0.1, dtype=torch.float64)
    norm = ObservationNorm(loc=loc, scale=scale, in_keys=["observation"], standard_normal=True)
    buffer = ReplayBuffer(storage=LazyTensorStorage(16), transform=norm)
    buffer.extend(TensorDict(observation=raw.clone(), batch_size=[16]))
    lrp = LRP(q_actor(), EpsilonPlus())
    out = explain_offline(lrp, buffer, tmp_path / "out", batch_size=5, progress=False)
    seen = TensorDict(observation=(raw - loc) / scale, batch_size=[16])
    expected = lrp(seen)["relevance", "observation"]
    torch.testing.assert_close(out["relevance", "observation"].clone(), expected, rtol=1e-10, atol=1e-12)
    assert torch.equal(buffer.storage[:16]["observation"], raw)


class _FirstRowOnly(Transform):
    def forward(self, tensordict):
        return tensordict[:1]


def test_a_transform_that_changes_the_number_of_rows_is_refused_naming_it(tmp_path):
    buffer = ReplayBuffer(storage=LazyTensorStorage(8), transform=_FirstRowOnly())
    buffer.extend(data(8))
    with pytest.raises(
        ValueError, match=r"the replay buffer's transform \(_FirstRowOnly\) turns 3 rows of its storage into 1"
    ):
        explain_offline(LRP(q_actor(), EpsilonPlus()), buffer, tmp_path / "out", batch_size=3, progress=False)


@pytest.mark.parametrize("make", [TensorDictReplayBuffer, ReplayBuffer], ids=["TensorDictReplayBuffer", "ReplayBuffer"])
def test_a_list_storage_of_tensordicts_is_explained_row_by_row(tmp_path, make):
    """torchrl's default storage: its slices are lists of the rows' TensorDicts (the call failed on them with an
    AttributeError), and its shape is its capacity (1000), not the rows it holds."""
    buffer = make()
    rows = data(10)
    buffer.extend(rows.clone())
    lrp = LRP(q_actor(), EpsilonPlus())
    out = explain_offline(lrp, buffer, tmp_path / "out", batch_size=4, progress=False)
    assert out.batch_size == (10,)
    expected = lrp(rows)["relevance", "observation"]
    torch.testing.assert_close(out["relevance", "observation"].clone(), expected, rtol=1e-12, atol=1e-14)


def test_a_list_storage_of_other_entries_is_refused_naming_them(tmp_path):
    buffer = ReplayBuffer(storage=ListStorage(10))
    buffer.extend([(torch.randn(4), 1) for _ in range(5)])
    with pytest.raises(TypeError, match="the replay buffer's ListStorage holds tuple entries"):
        explain_offline(LRP(q_actor(), EpsilonPlus()), buffer, tmp_path / "out", progress=False)
    assert not any(tmp_path.iterdir())


def test_a_list_storage_of_trajectories_of_different_lengths_is_refused_naming_them(tmp_path):
    """tensordict's stacking error, which named neither explain_offline nor the storage."""
    buffer = ReplayBuffer(storage=ListStorage(10))
    buffer.extend([data(3), data(5)])
    with pytest.raises(ValueError, match=r"ListStorage holds TensorDicts of different batch sizes \[\[3\], \[5\]\]"):
        explain_offline(LRP(q_actor(), EpsilonPlus()), buffer, tmp_path / "out", progress=False)
    assert not any(tmp_path.iterdir())


def categorical_actor() -> ProbabilisticActor:
    net = TensorDictModule(MLP(in_features=4, out_features=5, num_cells=[16]).double(), ["observation"], ["logits"])
    return ProbabilisticActor(net, in_keys=["logits"], distribution_class=Categorical, return_log_prob=True)


def tanh_normal_actor() -> ProbabilisticActor:
    mlp = MLP(in_features=4, out_features=4, num_cells=[16]).double()
    net = TensorDictModule(nn.Sequential(mlp, NormalParamExtractor()), ["observation"], ["loc", "scale"])
    return ProbabilisticActor(net, in_keys=["loc", "scale"], distribution_class=TanhNormal, return_log_prob=True)


def relevance_of_actions(actor: ProbabilisticActor, rows: TensorDict, actions: torch.Tensor) -> torch.Tensor:
    """The relevance of the logits at ``actions``, the target given, whatever the call draws."""
    return LRP(actor, EpsilonPlus(), target=actions)(rows.clone())["relevance", "observation"]


class TestActionsOfASamplingPolicy:
    """Rows of a policy that draws its action keep that action beside their relevance."""

    @pytest.mark.parametrize("source", ["tensordict", "buffer"])
    def test_each_row_keeps_the_random_action_its_relevance_explains(self, tmp_path, source):
        torch.manual_seed(0)
        actor, rows = categorical_actor(), data(40)
        if source == "buffer":
            rows_source = ReplayBuffer(storage=LazyMemmapStorage(40, scratch_dir=tmp_path / "buffer"))
            rows_source.extend(rows)
        else:
            rows_source = rows
        with set_exploration_type(ExplorationType.RANDOM):
            out = explain_offline(
                LRP(actor, EpsilonPlus()), rows_source, tmp_path / "out", batch_size=8, progress=False
            )
        action, logits = out["action"].clone(), actor.module[0](rows.clone())["logits"].detach()
        assert (action != logits.argmax(-1)).any()  # drawn at random, not the mode
        expected = relevance_of_actions(actor, rows, action)
        torch.testing.assert_close(out["relevance", "observation"].clone(), expected, rtol=1e-12, atol=1e-14)
        log_prob = Categorical(logits=logits).log_prob(action)
        torch.testing.assert_close(out["action_log_prob"].clone(), log_prob, rtol=1e-12, atol=1e-14)

    def test_a_resumed_run_keeps_each_rows_own_draw(self, tmp_path):
        torch.manual_seed(1)
        actor, rows = categorical_actor(), data(40)
        lrp = LRP(actor, EpsilonPlus())
        with set_exploration_type(ExplorationType.RANDOM):
            first = explain_offline(lrp, rows, tmp_path / "out", batch_size=8, stop=16, progress=False)
            kept = first["action"][:16].clone()
            out = explain_offline(lrp, rows, tmp_path / "out", batch_size=8, progress=False)
        assert torch.equal(out["action"][:16], kept) and bool(out["explained"].all())
        expected = relevance_of_actions(actor, rows, out["action"].clone())
        torch.testing.assert_close(out["relevance", "observation"].clone(), expected, rtol=1e-12, atol=1e-14)

    def test_under_deterministic_exploration_the_rows_keep_the_mode(self, tmp_path):
        actor, rows = categorical_actor(), data(24)
        with set_exploration_type(ExplorationType.DETERMINISTIC):
            out = explain_offline(LRP(actor, EpsilonPlus()), rows, tmp_path / "out", batch_size=8, progress=False)
        logits = actor.module[0](rows.clone())["logits"].detach()
        assert torch.equal(out["action"].clone(), logits.argmax(-1))
        expected = relevance_of_actions(actor, rows, logits.argmax(-1))
        torch.testing.assert_close(out["relevance", "observation"].clone(), expected, rtol=1e-12, atol=1e-14)

    def test_stored_transitions_keep_their_own_action(self, tmp_path):
        torch.manual_seed(2)
        actor, rows = categorical_actor(), data(24)
        stored = torch.randint(5, (24,))
        rows.set("action", stored).set("next", data(24))
        with set_exploration_type(ExplorationType.RANDOM):
            out = explain_offline(LRP(actor, EpsilonPlus()), rows, tmp_path / "out", batch_size=8, progress=False)
        assert torch.equal(out["action"].clone(), stored)
        expected = relevance_of_actions(actor, rows, stored)
        torch.testing.assert_close(out["relevance", "observation"].clone(), expected, rtol=1e-12, atol=1e-14)

    @pytest.mark.parametrize("exploration", [ExplorationType.RANDOM, ExplorationType.DETERMINISTIC])
    def test_stored_rows_without_next_keep_their_own_action(self, tmp_path, exploration):
        """A data set of (observation, action) rows holds no ``"next"``: its actions are the ones taken all the
        same. Each row explained a new draw (or the mode) and wrote it over the stored action."""
        torch.manual_seed(5)
        actor, rows = categorical_actor(), data(24)
        stored = torch.randint(5, (24,))
        rows.set("action", stored)
        with set_exploration_type(exploration):
            out = explain_offline(LRP(actor, EpsilonPlus()), rows, tmp_path / "out", batch_size=8, progress=False)
        assert torch.equal(out["action"].clone(), stored)
        expected = relevance_of_actions(actor, rows, stored)
        torch.testing.assert_close(out["relevance", "observation"].clone(), expected, rtol=1e-12, atol=1e-14)
        logits = actor.module[0](rows.clone())["logits"].detach()
        log_prob = Categorical(logits=logits).log_prob(stored)
        torch.testing.assert_close(out["action_log_prob"].clone(), log_prob, rtol=1e-12, atol=1e-14)

    def test_a_masked_policys_stored_rows_keep_an_allowed_action_that_is_not_the_best(self, tmp_path):
        torch.manual_seed(6)
        net = TensorDictModule(MLP(in_features=4, out_features=5, num_cells=[16]).double(), ["observation"], ["logits"])
        actor = ProbabilisticActor(
            net, in_keys={"logits": "logits", "mask": "action_mask"}, distribution_class=MaskedCategorical
        )
        rows = data(16)
        logits = net(rows.clone())["logits"].detach()
        worst = logits.argmin(-1)  # allowed by the mask, never the best allowed action
        rows.set("action", worst).set("action_mask", torch.ones(16, 5, dtype=torch.bool))
        with set_exploration_type(ExplorationType.DETERMINISTIC):
            out = explain_offline(LRP(actor, EpsilonPlus()), rows, tmp_path / "out", batch_size=8, progress=False)
        assert torch.equal(out["action"].clone(), worst)
        expected = relevance_of_actions(actor, rows, worst)
        torch.testing.assert_close(out["relevance", "observation"].clone(), expected, rtol=1e-12, atol=1e-14)

    def test_a_live_step_outside_explain_offline_still_explains_its_own_draw(self):
        """The rows of ``explain_offline`` are stored; a call of the wrapper on a step that holds the previous
        step's action and no ``"next"`` still explains the action this step takes."""
        actor, rows = categorical_actor(), data(8)
        logits = actor.module[0](rows.clone())["logits"].detach()
        rows.set("action", logits.argmin(-1))  # the previous step's action, never this step's mode
        with set_exploration_type(ExplorationType.DETERMINISTIC):
            result = LRP(actor, EpsilonPlus())(rows.clone())
        assert torch.equal(result["action"], logits.argmax(-1))
        expected = relevance_of_actions(actor, rows, logits.argmax(-1))
        torch.testing.assert_close(result["relevance", "observation"], expected, rtol=1e-12, atol=1e-14)

    def test_a_gaussian_policy_keeps_its_action_and_log_probability(self, tmp_path):
        torch.manual_seed(3)
        actor, rows = tanh_normal_actor(), data(24)
        with set_exploration_type(ExplorationType.RANDOM):
            out = explain_offline(LRP(actor, target_key="action"), rows, tmp_path / "out", batch_size=8, progress=False)
        params = actor.module[0](rows.clone())
        log_prob = TanhNormal(params["loc"], params["scale"]).log_prob(out["action"].clone())
        torch.testing.assert_close(out["action_log_prob"].clone(), log_prob.detach(), rtol=1e-6, atol=1e-8)

    def test_a_noisy_action_is_kept_with_the_relevance_of_its_unit(self, tmp_path):
        torch.manual_seed(4)
        actor = Actor(MLP(in_features=4, out_features=3, num_cells=[16]).double(), in_keys=["observation"])
        noise = AdditiveGaussianModule(Bounded(-1.0, 1.0, (3,), dtype=torch.float64), sigma_init=1.0)
        rows = data(24)
        with set_exploration_type(ExplorationType.RANDOM):
            lrp = LRP(TensorDictSequential(actor, noise), EpsilonPlus())
            out = explain_offline(lrp, rows, tmp_path / "out", batch_size=8, progress=False)
        unit = out["action"].clone().argmax(-1)
        assert (unit != actor(rows.clone())["action"].argmax(-1)).any()  # the noise moved the explained unit
        expected = LRP(actor, EpsilonPlus(), target=unit)(rows.clone())["relevance", "observation"]
        torch.testing.assert_close(out["relevance", "observation"].clone(), expected, rtol=1e-12, atol=1e-14)


METHODS = {
    "Saliency": lambda module: Saliency(module),
    "IntegratedGradients": lambda module: IntegratedGradients(module, n_steps=8),
    "FeatureAblation": lambda module: FeatureAblation(module, feature_masks=torch.tensor([0, 0, 1, 1])),
    "Occlusion": lambda module: Occlusion(module, sliding_window_shapes=(2,), perturbations_per_eval=3),
}


@pytest.mark.parametrize("source", ["tensordict", "buffer"])
@pytest.mark.parametrize("name", list(METHODS))
def test_an_attribution_method_is_run_over_the_rows_as_lrp_is(tmp_path, name, source):
    """The attribution methods were refused ("runs an LRP wrapper"): a replay buffer could be explained offline by
    LRP alone. A method's attribution keys are stored the same way, batch by batch, and equal one call on every row
    (up to the rounding of kernels that depend on the batch size)."""
    rows = data(21)
    if source == "buffer":
        rows_source = ReplayBuffer(storage=LazyTensorStorage(21))
        rows_source.extend(rows.clone())
    else:
        rows_source = rows
    method = METHODS[name](q_actor())
    out = explain_offline(method, rows_source, tmp_path / "out", batch_size=8, progress=False)
    assert set(out.keys(True, True)) == {("attribution", "observation"), "explained"}
    expected = method(rows.clone())["attribution", "observation"]
    assert expected.abs().max() > 1e-3
    torch.testing.assert_close(out["attribution", "observation"].clone(), expected, rtol=1e-10, atol=1e-12)
    assert bool(out["explained"].all())


def test_a_method_over_stored_rows_explains_each_rows_own_action(tmp_path):
    """As LRP (see ``TestActionsOfASamplingPolicy``): a categorical policy's stored action, with no ``"next"``."""
    torch.manual_seed(7)
    actor, rows = categorical_actor(), data(16)
    stored = torch.randint(5, (16,))
    rows.set("action", stored)
    with set_exploration_type(ExplorationType.RANDOM):
        out = explain_offline(Saliency(actor), rows, tmp_path / "out", batch_size=8, progress=False)
    assert torch.equal(out["action"].clone(), stored)
    expected = Saliency(actor, target=stored)(rows.clone())["attribution", "observation"]
    torch.testing.assert_close(out["attribution", "observation"].clone(), expected, rtol=1e-12, atol=1e-14)


def test_a_resumed_run_of_a_method_explains_only_the_rows_not_marked(tmp_path):
    method, rows = IntegratedGradients(q_actor(), n_steps=4), data(20)
    first = explain_offline(method, rows, tmp_path / "out", batch_size=8, stop=8, progress=False)
    assert int(first["explained"].sum()) == 8
    out = explain_offline(method, rows, tmp_path / "out", batch_size=8, progress=False)
    expected = method(rows.clone())["attribution", "observation"]
    torch.testing.assert_close(out["attribution", "observation"].clone(), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("upsample", [False, True])
def test_gradcams_map_of_its_layer_is_stored(tmp_path, upsample):
    """GradCAM writes its layer's map at its own key, which the output left out: without ``upsample`` nothing was
    stored, with it only the input-sized map."""
    from tdhook.attribution import GradCAM

    torch.manual_seed(8)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2)).double()
    cam = GradCAM(TensorDictModule(net, ["image"], ["logits"]), layer="module.0", upsample=upsample)
    rows = TensorDict(image=torch.randn(10, 3, 6, 6, dtype=torch.float64), batch_size=[10])
    out = explain_offline(cam, rows, tmp_path / "out", batch_size=4, progress=False)
    expected = cam(rows.clone())
    keys = {("attribution", "module.0"), *([("attribution", "image")] if upsample else [])}
    assert set(out.keys(True, True)) == keys | {"explained"}
    for key in keys:
        assert expected[key].abs().max() > 0
        torch.testing.assert_close(out[key].clone(), expected[key], rtol=1e-12, atol=1e-14)


class TestAResumedRunExplainsAsTheFirstDid:
    """An output's keys, shapes and dtypes did not say how its rows were explained: a run resumed with another rule,
    another method of the same keys, or the model trained further in between filled the rows not done with another
    explanation, and the output mixed the two with no word. The explainer that wrote it is kept beside it."""

    @staticmethod
    def first_half(explainer, tmp_path) -> TensorDict:
        out = explain_offline(explainer, data(20), tmp_path / "out", batch_size=5, stop=10, progress=False)
        assert int(out["explained"].sum()) == 10
        return out

    @staticmethod
    def refused(explainer, tmp_path, match: str) -> None:
        before = TensorDict.load_memmap(tmp_path / "out").clone()
        with pytest.raises(ValueError, match=match):
            explain_offline(explainer, data(20), tmp_path / "out", batch_size=5, progress=False)
        assert (TensorDict.load_memmap(tmp_path / "out") == before).all()  # no row written, none marked

    def test_another_rule_mapper_is_refused_naming_it(self, tmp_path):
        policy = q_actor()
        self.first_half(LRP(policy, EpsilonPlus()), tmp_path)
        match = r"another explanation than this one; rule_mapper: EpsilonPlus\(epsilon=1e-06\) then, EpsilonGammaBox"
        self.refused(LRP(policy, EpsilonGammaBox(low=-3.0, high=3.0)), tmp_path, match)
        self.refused(LRP(policy, EpsilonPlus(epsilon=0.1)), tmp_path, r"EpsilonPlus\(epsilon=0.1\) now")

    def test_another_method_of_the_same_keys_is_refused_naming_it(self, tmp_path):
        policy = q_actor()
        self.first_half(Saliency(policy), tmp_path)
        self.refused(InputXGradient(policy), tmp_path, "explainer: Saliency then, InputXGradient now")
        self.refused(Saliency(policy, abs=False), tmp_path, "abs: True then, False now")

    def test_a_model_of_another_layout_with_the_same_weights_is_refused(self, tmp_path):
        """The record kept the model's class and a digest of its parameters only: a ReLU swapped for a Tanh, or a
        LeakyReLU's slope set anew, with the same weights, resumed the output (its rows 0.76 off the new model's)."""
        policy = q_actor()
        self.first_half(LRP(policy, EpsilonPlus()), tmp_path / "activation")
        policy.module[0].module[1] = nn.ReLU()  # the MLP's Tanh
        self.refused(LRP(policy, EpsilonPlus()), tmp_path / "activation", r"layout #\w+, .* then, .* layout #")
        policy = q_actor()
        policy.module[0].module[1] = nn.LeakyReLU(0.01)
        self.first_half(LRP(policy, EpsilonPlus()), tmp_path / "slope")
        policy.module[0].module[1].negative_slope = 0.5
        self.refused(LRP(policy, EpsilonPlus()), tmp_path / "slope", r"layout #\w+, .* then, .* layout #")

    def test_a_model_whose_running_statistics_changed_is_refused(self, tmp_path):
        """Buffers were left out of the record (a module in training mode may update one as it runs): a BatchNorm in
        eval mode whose running statistics were updated between two runs resumed the output, its first rows 0.75 off
        the new model's. Those of modules in eval mode are kept."""
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2)).double().eval()
        policy = TensorDictModule(net, in_keys=["observation"], out_keys=["action_value"])
        self.first_half(LRP(policy, EpsilonPlus()), tmp_path)
        with torch.no_grad():
            net[1].running_mean.add_(0.5)
        self.refused(LRP(policy, EpsilonPlus()), tmp_path, r"buffers in eval mode #\w+ then, .* buffers in eval mode")

    def test_a_callable_target_computing_otherwise_is_refused(self, tmp_path):
        """Every lambda was recorded as ``<lambda>``, and a function defined again under its name as itself: a run
        resumed with a target of another unit was accepted (its first rows 0.73 off). Functions are recorded by
        their code and the values they close over; the same code over the same values resumes."""
        policy = q_actor()

        def unit(k: int):
            return lambda output: torch.nn.functional.one_hot(torch.full(output.shape[:-1], k), 2) * output

        self.first_half(LRP(policy, EpsilonPlus(), target=unit(0), target_key="action_value"), tmp_path / "unit")
        self.refused(
            LRP(policy, EpsilonPlus(), target=unit(1), target_key="action_value"),
            tmp_path / "unit",
            r"target: .*<lambda> #\w+ then",
        )
        self.refused(
            LRP(policy, EpsilonPlus(), target=lambda output: output, target_key="action_value"),
            tmp_path / "unit",
            "target: ",
        )
        out = explain_offline(
            LRP(policy, EpsilonPlus(), target=unit(0), target_key="action_value"),
            data(20),
            tmp_path / "unit" / "out",
            batch_size=5,
            progress=False,
        )
        assert bool(out["explained"].all())

    def test_an_option_set_on_the_explainer_after_its_first_run_is_refused_naming_it(self, tmp_path):
        """The record kept the constructor's arguments: a rule mapper set on the same wrapper afterwards
        (lrp.rule_mapper = ..., as a context follows it), a method's option set as an attribute, or another model
        set on the explainer (explainer.module = ...) resumed the output, its rows mixing two explanations (the
        first half EpsilonPlus's, the rest UniformEpsilon's)."""
        policy = q_actor()
        lrp = LRP(policy, EpsilonPlus())
        self.first_half(lrp, tmp_path / "lrp")
        lrp.rule_mapper = UniformEpsilon(epsilon=0.5)
        self.refused(lrp, tmp_path / "lrp", r"rule_mapper: EpsilonPlus\(epsilon=1e-06\) then, UniformEpsilon")
        option = LRP(policy, EpsilonPlus())  # a preset's option it was not built with, set on it afterwards
        self.first_half(option, tmp_path / "option")
        option.rule_mapper.stabilize_additions = True
        self.refused(option, tmp_path / "option", r"then, EpsilonPlus\(epsilon=1e-06, stabilize_additions=True\)")
        method = IntegratedGradients(policy, n_steps=8)
        self.first_half(method, tmp_path / "ig")
        method.n_steps = 16
        self.refused(method, tmp_path / "ig", "n_steps: 8 then, 16 now")
        for explainer, folder in ((LRP(policy, EpsilonPlus()), "swapped lrp"), (Saliency(policy), "swapped saliency")):
            self.first_half(explainer, tmp_path / folder)
            explainer.module = q_actor()  # another model (other weights), set on the same explainer
            self.refused(
                explainer,
                tmp_path / folder,
                r"module: QValueActor, parameters #\w+, layout #\w+, buffers in eval mode #\w+ then, QValueActor",
            )

    def test_a_model_whose_parameters_changed_is_refused_naming_it(self, tmp_path):
        policy = q_actor()
        self.first_half(LRP(policy, EpsilonPlus()), tmp_path)
        with torch.no_grad():
            next(policy.parameters()).add_(1e-3)  # a step of training
        self.refused(
            LRP(policy, EpsilonPlus()),
            tmp_path,
            r"module: QValueActor, parameters #\w+, layout #\w+, buffers in eval mode #\w+ then, QValueActor",
        )

    def test_the_same_explanation_built_anew_and_batched_otherwise_resumes(self, tmp_path):
        """A new wrapper and preset of the same arguments (nothing in the record is an object's address), and other
        batching options (batch_size, internal_batch_size), explain the rest."""
        policy = q_actor()
        self.first_half(IntegratedGradients(policy, n_steps=8, baselines=torch.zeros(4)), tmp_path)
        method = IntegratedGradients(policy, n_steps=8, baselines=torch.zeros(4), internal_batch_size=16)
        out = explain_offline(method, data(20), tmp_path / "out", batch_size=7, progress=False)
        assert bool(out["explained"].all())
        self.first_half(LRP(policy, EpsilonPlus()), tmp_path / "lrp")
        out = explain_offline(LRP(policy, EpsilonPlus()), data(20), tmp_path / "lrp" / "out", progress=False)
        assert bool(out["explained"].all())

    def test_an_output_written_without_a_record_resumes_and_is_given_one(self, tmp_path):
        policy = q_actor()
        self.first_half(LRP(policy, EpsilonPlus()), tmp_path)
        (tmp_path / "out" / "explainer.json").unlink()
        out = explain_offline(LRP(policy, EpsilonPlus()), data(20), tmp_path / "out", batch_size=5, progress=False)
        assert bool(out["explained"].all()) and (tmp_path / "out" / "explainer.json").exists()
        self.first_half(LRP(policy, EpsilonPlus()), tmp_path / "again")
        self.refused(Saliency(policy, relevance_key="relevance"), tmp_path / "again", "explainer: LRP then, Saliency")


class TestRowsChangedSinceTheyWereExplained:
    """A run over a source whose rows changed since an earlier run into the same output (a circular buffer that kept
    filling) explained nothing, every row being marked done, and returned the old rows' relevance for the new ones
    (1.1 off); the rows changed since are now explained again, and only those."""

    @staticmethod
    def recorded(lrp: LRP) -> BatchSizes:
        recorder = BatchSizes()
        lrp.module.module[0].module.register_forward_pre_hook(recorder)
        return recorder

    def test_a_circular_buffer_that_kept_filling_is_explained_anew(self, tmp_path):
        lrp = LRP(q_actor(), EpsilonPlus())
        buffer = TensorDictReplayBuffer(storage=LazyTensorStorage(24))
        buffer.extend(data(24))
        explain_offline(lrp, buffer, tmp_path / "out", batch_size=8, progress=False)
        buffer.extend(data(24))  # every row overwritten
        out = explain_offline(lrp, buffer, tmp_path / "out", batch_size=8, progress=False)
        expected = lrp(buffer.storage[:].clone())["relevance", "observation"]
        torch.testing.assert_close(out["relevance", "observation"].clone(), expected, rtol=1e-12, atol=1e-14)

    def test_only_the_rows_changed_are_explained_again(self, tmp_path):
        lrp, rows = LRP(q_actor(), EpsilonPlus()), data(20)
        explain_offline(lrp, rows, tmp_path / "out", batch_size=6, progress=False)
        rows["observation"][[3, 17]] += 1.0
        recorder = self.recorded(lrp)
        out = explain_offline(lrp, rows, tmp_path / "out", batch_size=6, progress=False)
        assert recorder.sizes == [1, 1]  # rows 3 and 17, each its own stretch
        expected = lrp(rows.clone())["relevance", "observation"]
        torch.testing.assert_close(out["relevance", "observation"].clone(), expected, rtol=1e-12, atol=1e-14)

    def test_a_rerun_stopped_before_the_changed_rows_leaves_them_marked_not_done(self, tmp_path):
        """A rerun found the changed rows but left them marked done on disk until it reached them: stopped before,
        its output said every row was done, row 17 holding the old row's relevance."""

        calls = []

        def stop_at_second_call(module: nn.Module, args: tuple) -> None:  # a hook: the model's layout unchanged
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt

        lrp, rows = LRP(q_actor(), EpsilonPlus()), data(20)
        explain_offline(lrp, rows, tmp_path / "out", batch_size=6, progress=False)
        rows["observation"][[3, 17]] += 1.0
        handle = lrp.module.module[0].module.register_forward_pre_hook(stop_at_second_call)
        with pytest.raises(KeyboardInterrupt):
            explain_offline(lrp, rows, tmp_path / "out", batch_size=6, progress=False)
        handle.remove()
        out = TensorDict.load_memmap(tmp_path / "out")
        assert out["explained"].tolist() == [row != 17 for row in range(20)]  # row 3 explained anew, then stopped
        expected = lrp(rows.clone())["relevance", "observation"]
        torch.testing.assert_close(out["relevance", "observation"][3].clone(), expected[3], rtol=1e-12, atol=1e-14)
        out = explain_offline(lrp, rows, tmp_path / "out", batch_size=6, progress=False)
        assert bool(out["explained"].all())
        torch.testing.assert_close(out["relevance", "observation"].clone(), expected, rtol=1e-12, atol=1e-14)

    def test_unchanged_rows_read_in_other_batches_are_not_explained_again(self, tmp_path):
        lrp, rows = LRP(q_actor(), EpsilonPlus()), data(20)
        explain_offline(lrp, rows, tmp_path / "out", batch_size=6, stop=13, progress=False)
        recorder = self.recorded(lrp)
        explain_offline(lrp, rows, tmp_path / "out", batch_size=4, progress=False)
        assert recorder.sizes == [4, 3]  # rows 13:17 and 17:20 only

    def test_an_output_written_without_checksums_takes_its_rows_as_they_are(self, tmp_path):
        lrp, rows = LRP(q_actor(), EpsilonPlus()), data(20)
        explain_offline(lrp, rows, tmp_path / "out", batch_size=5, stop=10, progress=False)
        (tmp_path / "out" / "row_checksums.memmap").unlink()
        recorder = self.recorded(lrp)
        out = explain_offline(lrp, rows, tmp_path / "out", batch_size=5, progress=False)
        assert recorder.sizes == [5, 5] and bool(out["explained"].all())
        rows["observation"][2] += 1.0  # a change after the checksums were kept is found
        recorder.sizes.clear()
        explain_offline(lrp, rows, tmp_path / "out", batch_size=5, progress=False)
        assert recorder.sizes == [1]


def test_a_run_on_its_own_rows_leaves_the_marks_of_other_rows_alone(tmp_path):
    """Two processes explaining halves of one output by hand (``distributed=False``, start/stop): one read the mask
    of rows done, then the other marked its rows done, then the first cleared every row marked on disk but not in
    what it had read, taking the other's fresh rows for changed ones: the output ended with rows explained but
    marked not done (seen as a flaky ``test_distributed_false_explains_only_the_rows_given``)."""
    lrp = LRP(q_actor(), EpsilonPlus())
    out = explain_offline(lrp, data(16), tmp_path / "out", batch_size=4, progress=False)
    read_before = out["explained"].as_subclass(torch.Tensor).clone()
    read_before[:8] = False  # as the second process read the mask, before the first marked rows 0:8
    _unmark_changed_rows(lrp, tmp_path / "out", out, read_before, range(8, 16))
    assert bool(TensorDict.load_memmap(tmp_path / "out")["explained"].all())


def test_a_model_error_says_which_rows_it_was_explaining(tmp_path):
    """The error of a model failing in a batch named the key and the batch's shape, not the rows of the source nor
    the prefix; it now says both, and that the rows before are kept."""
    calls = []

    def fail_at_third_call(module: nn.Module, args: tuple) -> None:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the model failed")

    lrp = LRP(q_actor(), EpsilonPlus())
    handle = lrp.module.module[0].module.register_forward_pre_hook(fail_at_third_call)
    try:
        with pytest.raises(RuntimeError, match="the model failed") as caught:
            explain_offline(lrp, data(20), tmp_path / "out", batch_size=4, progress=False)
    finally:
        handle.remove()
    assert any(
        "in rows 8:12 of the source" in note and str(tmp_path / "out") in note for note in caught.value.__notes__
    )
    out = TensorDict.load_memmap(tmp_path / "out")
    assert out["explained"].tolist() == [True] * 8 + [False] * 12
