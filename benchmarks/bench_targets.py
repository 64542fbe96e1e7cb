"""Time target="all" against one LRP call per output unit.

Explaining every action's value (or every logit) with ``target="all"`` runs
the policy forward once and one backward pass per unit; the alternative is one
full call per unit. Both run in this one process, pinned to one thread, on the
same policy, batch and open context: after a warm-up round, ``--repeats``
rounds run both in turn; the medians are reported with the ratio of the
per-unit calls to ``target="all"``.

    python benchmarks/bench_targets.py --units 2 8 18 --batch 256 --repeats 20
"""

from __future__ import annotations

import argparse

import torch
from tensordict import TensorDict
from timing import interleaved_medians
from torchrl.modules import MLP

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.rules import EpsilonPlus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, nargs="+", default=[2, 8, 18])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"batch {args.batch} x {args.features} features, MLP 256-256, 1 thread, median of {args.repeats}")
    print(f"{'units':>5} {'target=all s':>13} {'per-unit s':>11} {'per-unit / all':>15}")
    for units in args.units:
        net = MLP(in_features=args.features, out_features=units, num_cells=[256, 256])
        td = TensorDict(observation=torch.randn(args.batch, args.features), batch_size=[args.batch])
        with LRP(net, EpsilonPlus(), in_keys=["observation"], out_keys=["action_value"]) as lrp:

            def every_unit() -> None:
                lrp.target = "all"
                lrp(td.clone())

            def one_call_per_unit() -> None:
                for k in range(units):
                    lrp.target = k
                    lrp(td.clone())

            seconds = interleaved_medians({"all": every_unit, "per unit": one_call_per_unit}, args.repeats)
        all_seconds, unit_seconds = seconds["all"], seconds["per unit"]
        print(f"{units:5d} {all_seconds:13.4f} {unit_seconds:11.4f} {unit_seconds / all_seconds:15.2f}")


if __name__ == "__main__":
    main()
