"""Time explain_offline over a memory-mapped TensorDict against a bare loop of LRP calls on the same batches.

The source is a memory-mapped TensorDict of ``--rows`` observations in a
temporary folder; the policy is an MLP (observation → action values) under
EpsilonPlus. Three ways over the same batches of ``--batch`` rows, each inside
one ``with lrp:`` per pass:

- the bare loop reads each batch into memory and calls the wrapper, discarding
  the relevance (the baseline);
- the bare loop that also copies each batch's relevance into a file created
  for the pass and mapped in memory (the writing no explanation kept on disk
  avoids);
- ``explain_offline`` into a new output folder, which also marks each batch in
  its ``"explained"`` mask once its relevance is written.

Pinned to one thread; after a warm-up round, ``--repeats`` rounds run every
way once in turn, and medians are reported with their ratio to the baseline.
``--clock cpu`` times this process's CPU time instead of the wall time: the
work is single-threaded, so on a machine that other processes load the CPU
time keeps the ratios steadier.

    python benchmarks/bench_offline.py --rows 32768 --batch 1024 --repeats 20
    python benchmarks/bench_offline.py --rows 32768 --batch 1024 --repeats 20 --clock cpu
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from timing import interleaved_medians
from torch import nn
from torchrl.modules import MLP

from tdhook.attribution import LRP, explain_offline
from tdhook.attribution.lrp_helpers.rules import EpsilonPlus

RELEVANCE = ("relevance", "observation")


def bare_loop(lrp: LRP, source: TensorDict, batch: int) -> None:
    with lrp:
        for begin in range(0, source.batch_size[0], batch):
            lrp(source[begin : begin + batch].to_tensordict())


def bare_loop_written(lrp: LRP, source: TensorDict, batch: int, filename: Path) -> None:
    rows, features = source["observation"].shape
    written = torch.from_file(str(filename), shared=True, size=rows * features).view(rows, features)
    with lrp:
        for begin in range(0, rows, batch):
            written[begin : begin + batch].copy_(lrp(source[begin : begin + batch].to_tensordict())[RELEVANCE])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--actions", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall time, or this process's CPU time (steadier on a machine that other processes load)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = MLP(
        in_features=args.features,
        out_features=args.actions,
        num_cells=[args.hidden, args.hidden],
        activation_class=nn.ReLU,
    )
    lrp = LRP(TensorDictModule(net, in_keys=["observation"], out_keys=["action_value"]), rule_mapper=EpsilonPlus())

    with tempfile.TemporaryDirectory() as folder:
        source = TensorDict(observation=torch.randn(args.rows, args.features), batch_size=[args.rows])
        source = source.memmap_(Path(folder) / "source")
        passes = itertools.count()  # every pass writes new files, as a first run over a buffer does
        methods: dict[str, Callable] = {
            "bare loop of LRP calls": lambda: bare_loop(lrp, source, args.batch),
            "bare loop, relevance into a memmap": lambda: bare_loop_written(
                lrp, source, args.batch, Path(folder) / f"written-{next(passes)}"
            ),
            "explain_offline": lambda: explain_offline(
                lrp, source, Path(folder) / f"out-{next(passes)}", batch_size=args.batch, progress=False
            ),
        }
        clock = time.perf_counter if args.clock == "wall" else time.process_time
        seconds = interleaved_medians(methods, args.repeats, collect=True, clock=clock)

    print(
        f"MLP {args.features}-{args.hidden}-{args.hidden}-{args.actions} (ReLU), EpsilonPlus, "
        f"{args.rows} memory-mapped rows in batches of {args.batch}, 1 thread, {args.clock} time, "
        f"median of {args.repeats} interleaved rounds"
    )
    print(f"{'method':<36} {'milliseconds':>12} {'x bare loop':>12}")
    base = seconds["bare loop of LRP calls"]
    for label, value in seconds.items():
        print(f"{label:<36} {1000 * value:12.3f} {value / base:12.3f}")


if __name__ == "__main__":
    main()
