"""explain_offline under torch.distributed: two ranks by ``torchrun`` on gloo, against one process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

import tdhook
from tdhook.attribution import explain_offline
from tests.attribution._offline_worker import BATCH_SIZE, RANGE, explainer, observations, policy, steps_buffer

WORKER = Path(__file__).with_name("_offline_worker.py")
ROWS = 45
#: rows of the output "resume" marked done before the two ranks resume it
DONE_BEFORE = [*range(0, 5), *range(16, 30)]
#: what the rows marked done hold in "resume": kept as they are, never explained again
SENTINEL = 7.0


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Prepares the sources, the policy and a partial output, runs the worker on two ranks, reads their reports."""
    folder = tmp_path_factory.mktemp("offline_distributed")
    torch.manual_seed(0)
    torch.save(policy().state_dict(), folder / "policy.pt")
    rows = observations(ROWS).memmap_(folder / "source_rows")
    observations(12, 5).memmap_(folder / "source_steps")
    partial = explain_offline(explainer(folder)[0], rows, folder / "resume", progress=False)
    partial["explained"][:] = False
    partial["explained"][DONE_BEFORE] = True
    partial["relevance", "observation"].fill_(float("nan"))
    partial["relevance", "observation"][DONE_BEFORE] = SENTINEL
    shutil.copytree(folder / "resume", folder / "resume_in_one_process")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(tdhook.__file__).parents[1]), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    done = subprocess.run(
        [*command, str(WORKER), str(folder)], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, "\n".join(line for line in done.stderr.splitlines() if line.startswith("[rank"))
    reports = [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(2)]
    return folder, reports


def in_one_process(folder: Path, source, prefix: str, **kwargs) -> TensorDict:
    """The same explanation by one process, with one thread as each rank has."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        lrp, _ = explainer(folder)
        return explain_offline(lrp, source, folder / prefix, batch_size=BATCH_SIZE, progress=False, **kwargs)
    finally:
        torch.set_num_threads(threads)


def rows_explained(calls: list[list[int]]) -> list[int]:
    """The rows of a rank's batches, leaving out its first call: the one row that checks the output's entries."""
    return [row for call in calls[1:] for row in call]


def assert_equal_bit_for_bit(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape and torch.equal(actual, expected), (actual - expected).abs().max()


def test_two_ranks_share_the_batches_and_equal_one_process_bit_for_bit(run):
    folder, reports = run
    out = TensorDict.load_memmap(folder / "fresh")
    expected = in_one_process(folder, TensorDict.load_memmap(folder / "source_rows"), "fresh_in_one_process")
    assert_equal_bit_for_bit(out["relevance", "observation"].clone(), expected["relevance", "observation"].clone())
    assert bool(out["explained"].all())
    # Each rank explained one contiguous share of whole batches, balanced by rows; no row twice.
    mine = [rows_explained(report["fresh"]["calls"]) for report in reports]
    assert mine == [list(range(0, 24)), list(range(24, ROWS))]
    assert [len(call) for call in reports[1]["fresh"]["calls"][1:]] == [8, 8, 5]
    # On return, every rank sees every row written.
    assert all(all(report["fresh"]["explained"]) for report in reports)


def test_a_replay_buffer_of_two_dimensional_storage(run):
    folder, reports = run
    out = TensorDict.load_memmap(folder / "steps")
    buffer = steps_buffer(folder)
    assert torch.equal(buffer.storage[:]["observation"], TensorDict.load_memmap(folder / "source_steps")["observation"])
    expected = in_one_process(folder, buffer, "steps_in_one_process")
    assert out.batch_size == (12, 5)
    assert_equal_bit_for_bit(out["relevance", "observation"].clone(), expected["relevance", "observation"].clone())
    assert [rows_explained(report["steps"]["calls"]) for report in reports] == [list(range(8)), list(range(8, 12))]
    assert all(all(report["steps"]["explained"]) for report in reports)


def test_resuming_explains_only_the_missing_rows(run):
    folder, reports = run
    out = TensorDict.load_memmap(folder / "resume")
    missing = [row for row in range(ROWS) if row not in DONE_BEFORE]
    assert sorted(rows_explained(reports[0]["resume"]["calls"]) + rows_explained(reports[1]["resume"]["calls"])) == (
        missing
    )
    assert all(rows_explained(report["resume"]["calls"]) for report in reports)  # both ranks had work
    relevance = out["relevance", "observation"].clone()
    assert bool(out["explained"].all()) and bool((relevance[DONE_BEFORE] == SENTINEL).all())
    # The same resume by one process runs the same batches: equal bit for bit.
    expected = in_one_process(folder, TensorDict.load_memmap(folder / "source_rows"), "resume_in_one_process")
    assert_equal_bit_for_bit(relevance, expected["relevance", "observation"].clone())
    # Against a fresh run, the batches start elsewhere (5:13 instead of 0:8): equal within float32 rounding.
    fresh = TensorDict.load_memmap(folder / "fresh")["relevance", "observation"].clone()
    torch.testing.assert_close(relevance[missing], fresh[missing], rtol=1e-5, atol=1e-6)


def test_start_and_stop_are_shared_out(run):
    folder, reports = run
    out = TensorDict.load_memmap(folder / "range")
    inside = list(range(*RANGE))
    assert out["explained"].tolist() == [row in inside for row in range(ROWS)]
    mine = [rows_explained(report["range"]["calls"]) for report in reports]
    assert mine[0] + mine[1] == inside and mine[0] and mine[1]
    expected = in_one_process(
        folder, TensorDict.load_memmap(folder / "source_rows"), "range_in_one_process", start=RANGE[0], stop=RANGE[1]
    )
    assert_equal_bit_for_bit(
        out["relevance", "observation"][inside].clone(), expected["relevance", "observation"][inside].clone()
    )


def test_distributed_false_explains_only_the_rows_given(run):
    folder, reports = run
    half = ROWS // 2
    assert [[row for call in report["by_hand"]["calls"] for row in call] for report in reports] == [
        list(range(half)),
        list(range(half, ROWS)),
    ]
    out = TensorDict.load_memmap(folder / "by_hand")
    fresh = TensorDict.load_memmap(folder / "fresh")
    assert bool(out["explained"].all())
    torch.testing.assert_close(
        out["relevance", "observation"].clone(), fresh["relevance", "observation"].clone(), rtol=1e-5, atol=1e-6
    )


def test_every_rank_refuses_a_prefix_that_is_not_this_explanations_output(run):
    _, reports = run
    for report in reports:
        source, other = report["refused"]
        assert "source_rows' already holds a memory-mapped TensorDict that explain_offline did not write" in source
        assert "fresh' already holds another memory-mapped TensorDict" in other
