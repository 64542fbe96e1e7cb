"""Explain a memory-mapped data set on every rank of torch.distributed, and compare with one process.

Every rank runs the same ``explain_offline`` call; the rows are shared out by it.
Rank 0 then explains the same data alone (``distributed=False``), once with the
same batch size and once with other batch boundaries, and prints the largest
absolute differences from the ranks' result and the times.

    python -m torch.distributed.run --standalone --nproc_per_node=2 examples/explain_offline_distributed.py

(``torchrun`` is the same launcher.) Under ``torchrun`` every rank runs with one
thread unless ``OMP_NUM_THREADS`` says otherwise; the one-process runs here run
with that thread count too, so the times compare like with like.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torchrl.modules import MLP, QValueActor

from tdhook.attribution import LRP, explain_offline
from tdhook.attribution.lrp_helpers.rules import EpsilonPlus


def policy() -> QValueActor:
    """A Q-value policy over 64 features, 2 hidden layers of 256 and 8 actions; the same on every rank (seeded)."""
    torch.manual_seed(0)
    net = MLP(in_features=64, out_features=8, num_cells=[256, 256])
    return QValueActor(net, in_keys=["observation"], action_space="one-hot")


def timed(call):
    begin = time.perf_counter()
    result = call()
    return result, time.perf_counter() - begin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()) / "tdhook-offline-distributed")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0:  # the data set: written once, read by every rank from the same folder
        shutil.rmtree(args.folder, ignore_errors=True)
        observation = torch.randn(args.rows, 64, generator=torch.Generator().manual_seed(1))
        TensorDict(observation=observation, batch_size=[args.rows]).memmap_(args.folder / "source")
    dist.barrier()
    source = TensorDict.load_memmap(args.folder / "source")
    lrp = LRP(policy(), EpsilonPlus())

    def explain(prefix, **kwargs):
        kwargs = {"batch_size": args.batch_size, "progress": False, **kwargs}
        return timed(lambda: explain_offline(lrp, source, args.folder / prefix, **kwargs))

    ranks, ranks_time = explain("ranks")
    if rank == 0:
        alone, alone_time = explain("one_process", distributed=False)
        other, _ = explain("other_batches", distributed=False, batch_size=args.batch_size + 100)
        relevance = ranks["relevance", "observation"]
        print(f"{args.rows} rows, batch size {args.batch_size}, {torch.get_num_threads()} thread(s) per process")
        print(f"{world_size} ranks: {ranks_time:.2f} s; one process: {alone_time:.2f} s")
        for name, result in [("the same batches", alone), (f"batches of {args.batch_size + 100}", other)]:
            difference = (relevance - result["relevance", "observation"]).abs().max().item()
            print(f"max |ranks - one process| with {name}: {difference:.3g}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
