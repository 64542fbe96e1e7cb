"""Time AttnLRP and CP-LRP on every architecture of the test suite's transformer zoo against gradient × input.

The zoo (``tests/attribution/test_lrp_transformer_zoo.py``) builds each Hugging Face architecture from a tiny random
config (hidden size 32, 2 layers, batch 2 × 7 tokens or a small image; no weights downloaded), with eager attention
and, where transformers offers it, sdpa. Each model is explained on its input embeddings (pixels, features), the
explained output its top logit. Per architecture and attention, the three methods run in this one process on one
thread: a warm-up round, then ``--repeats`` rounds in which each runs once, in an order drawn anew every round; the
median of each is reported with its ratio to gradient × input. The wrappers run inside one open ``with lrp:``
context each, as in a loop over many inputs.

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/bench_transformer_zoo.py --clock thread --repeats 40
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import warnings
from pathlib import Path

import torch
from tensordict import TensorDict
from timing import add_clock_options, clock_of, interleaved_medians

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: the zoo lives in its tests

from tdhook.attribution import LRP  # noqa: E402
from tdhook.attribution.lrp_helpers.rules import CPLRP, AttnLRP  # noqa: E402
from tests.attribution.test_lrp_transformer_zoo import ZOO, Explained, model_input  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="architectures of the zoo (default: all of them)")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    add_clock_options(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dtype = getattr(torch, args.dtype)
    clock = clock_of(args)
    unknown = sorted(set(args.names) - set(ZOO))
    if unknown:
        parser.error(f"not in the zoo: {', '.join(unknown)}; it has {', '.join(sorted(ZOO))}")
    print(f"{args.dtype}, 1 thread, {args.clock} time, median of {args.repeats} rounds in random order")
    print(f"{'architecture':<14} {'attention':<9} {'grad*input ms':>14} {'AttnLRP':>8} {'CP-LRP':>8}")
    for name in args.names or sorted(ZOO):
        architecture = ZOO[name]
        for implementation in architecture.implementations():
            model = Explained(architecture.build(implementation, dtype=dtype), architecture.inputs)
            x = model_input(architecture, dtype)

            def gradient_times_input(model=model, x=x) -> torch.Tensor:
                leaf = x.detach().requires_grad_(True)
                (grad,) = torch.autograd.grad(model(leaf).max(-1).values.sum(), leaf)
                return leaf * grad

            methods = {"gradient x input": gradient_times_input}
            with contextlib.ExitStack() as contexts:
                for label, preset in [("AttnLRP", AttnLRP), ("CP-LRP", CPLRP)]:
                    lrp = contexts.enter_context(LRP(copy.deepcopy(model), preset(), in_keys=["x"], out_keys=["y"]))
                    methods[label] = lambda lrp=lrp, x=x: lrp(TensorDict(x=x, batch_size=x.shape[:1]))
                seconds = interleaved_medians(methods, args.repeats, clock=clock, warm=args.warm)
            base = seconds["gradient x input"]
            print(
                f"{name:<14} {implementation:<9} {base * 1e3:14.2f} "
                f"{seconds['AttnLRP'] / base:8.2f} {seconds['CP-LRP'] / base:8.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
