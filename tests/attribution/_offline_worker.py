"""One rank of explain_offline under torch.distributed, run by ``torchrun`` from test_offline_distributed.py.

Usage: ``torchrun --nproc_per_node=2 _offline_worker.py FOLDER``. ``FOLDER`` holds what the test prepared:
``policy.pt``, the sources ``source_rows`` and ``source_steps``, and the partial output ``resume``. Every rank
explains them into prefixes under ``FOLDER`` and writes ``rank<R>.json``: the rows its model saw in each call of
each case, whether every row was marked on return, and the error messages of the refused cases.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import nn
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.modules import MLP, QValueActor

from tdhook.attribution import LRP, explain_offline
from tdhook.attribution.lrp_helpers.rules import EpsilonPlus

FEATURES = 32
BATCH_SIZE = 8
#: the rows of the case "range"
RANGE = (3, 40)


def policy() -> QValueActor:
    net = MLP(in_features=FEATURES, out_features=4, num_cells=[64, 64])
    return QValueActor(net, in_keys=["observation"], action_space="one-hot")


def observations(*batch: int) -> TensorDict:
    """Random observations whose first feature is the row's index, so a model can tell which rows it sees."""
    observation = torch.randn(*batch, FEATURES)
    observation[..., 0] = torch.arange(batch[0], dtype=observation.dtype).reshape(-1, *[1] * (len(batch) - 1))
    return TensorDict(observation=observation, batch_size=list(batch))


class RowRecorder(nn.Module):
    """Passes its input on, recording the rows (the first feature) of each call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list[int]] = []

    def forward(self, x):
        self.calls.append(sorted({int(row) for row in x[..., 0].flatten().tolist()}))
        return x


def explainer(folder: Path) -> tuple[LRP, RowRecorder]:
    actor = policy()
    actor.load_state_dict(torch.load(folder / "policy.pt"))
    recorder = RowRecorder()
    actor.module[0].module.insert(0, recorder)
    return LRP(actor, EpsilonPlus()), recorder


def steps_buffer(folder: Path) -> ReplayBuffer:
    """A replay buffer of two-dimensional storage holding ``source_steps`` ([N, T]) in storage order."""
    steps = TensorDict.load_memmap(folder / "source_steps").to_tensordict()
    buffer = ReplayBuffer(storage=LazyTensorStorage(steps.numel(), ndim=2))
    buffer.extend(steps.transpose(0, 1).contiguous())  # torchrl stores a [B, T] batch as [T, B]
    return buffer


def main(folder: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    lrp, recorder = explainer(folder)
    rows = TensorDict.load_memmap(folder / "source_rows")
    steps = steps_buffer(folder)
    report = {}

    def case(name, source, **kwargs):
        recorder.calls = []
        out = explain_offline(lrp, source, folder / name, batch_size=BATCH_SIZE, progress=False, **kwargs)
        report[name] = {
            "calls": list(recorder.calls),
            "explained": out["explained"].reshape(len(out), -1).all(-1).tolist(),
        }

    case("fresh", rows)
    case("steps", steps)
    case("resume", rows)
    case("range", rows, start=RANGE[0], stop=RANGE[1])
    # The opt-out: rows shared out by hand, each rank explaining only the slice it is given.
    if rank == 0:
        explain_offline(lrp, rows, folder / "by_hand", start=0, stop=0, progress=False, distributed=False)
    dist.barrier()
    half = len(rows) // 2
    mine = (0, half) if rank == 0 else (half, len(rows))
    case("by_hand", rows, start=mine[0], stop=mine[1], distributed=False)
    dist.barrier()
    # Prefixes that are not this explanation's output: every rank refuses them, none waits for the others.
    other = LRP(policy(), EpsilonPlus(), relevance_key="attribution")
    report["refused"] = []
    for explanation, prefix in [(lrp, "source_rows"), (other, "fresh")]:
        try:
            explain_offline(explanation, rows, folder / prefix, progress=False)
        except ValueError as err:
            report["refused"].append(str(err))
    (folder / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
