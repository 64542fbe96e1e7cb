"""Peak memory of one LRP call with target="all", split_dim and create_graph=True, against a plain call.

Each figure is the resident memory one call adds above the model and its inputs
(``timing.peak_memory_mb``: a forked child, Linux only), inside an open context
after a warm-up call, next to the size of the relevance it returns. The first
row is one plain gradient x input pass: the child's first backward pass sets up
torch's autograd engine again (about 64 MiB here), so the figures are read as
differences from that row. The policy is an MLP ``features -> 256 -> 256 ->
units`` in float32, on one thread.

    python benchmarks/memory_targets.py --units 1000 --batch 64 --steps 32
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from tensordict import TensorDict
from timing import peak_memory_mb
from torch import nn

from tdhook.attribution import LRP, EpsilonPlus

MiB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32, help="time steps of the [batch, steps] batch of split_dim")
    parser.add_argument("--budget-mib", type=float, nargs="*", default=[1.0], help="memory_budget values to try")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(args.features, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, args.units)
    )
    flat = TensorDict(x=torch.randn(args.batch, args.features), batch_size=[args.batch])
    steps = TensorDict(x=torch.randn(args.batch, args.steps, args.features), batch_size=[args.batch, args.steps])
    cases: list[tuple[str, dict, TensorDict]] = [
        ("target=None", {}, flat),
        ("target='all'", {"target": "all"}, flat),
        *[
            (f"target='all', memory_budget={b:g} MiB", {"target": "all", "memory_budget": int(b * MiB)}, flat)
            for b in args.budget_mib
        ],
        (f"target=None on [{args.batch}, {args.steps}]", {}, steps),
        (f"split_dim=1 on [{args.batch}, {args.steps}]", {"split_dim": 1}, steps),
        ("create_graph=True", {"create_graph": True}, flat),
        ("create_graph=True, loss.backward()", {"create_graph": True, "backward": True}, flat),
    ]
    print(
        f"MLP {args.features}-256-256-{args.units}, float32, 1 thread; peak MiB one call adds "
        "(inside an open context, after a warm-up call)"
    )
    print(f"{'case':48} {'relevance MiB':>14} {'peak MiB':>9}")

    def gradient_x_input() -> torch.Tensor:
        x = flat["x"].clone().requires_grad_(True)
        return x.detach() * torch.autograd.grad(net(x)[:, 0].sum(), x)[0]

    size = gradient_x_input().numel() * 4 / MiB
    print(f"{'gradient x input, one unit':48} {size:14.1f} {peak_memory_mb(gradient_x_input):9.1f}")
    for label, kwargs, td in cases:
        backward = kwargs.pop("backward", False)
        with LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"], **kwargs) as lrp:
            call = _call(lrp, td, backward)
            relevance = call()
            peak = peak_memory_mb(call)
        size = relevance.numel() * relevance.element_size() / MiB
        print(f"{label:48} {size:14.1f} {peak:9.1f}")


def _call(lrp: LRP, td: TensorDict, backward: bool) -> Callable[[], torch.Tensor]:
    def call() -> torch.Tensor:
        relevance = lrp(td.clone())["relevance", "x"]
        if backward:
            relevance.square().sum().backward()
            relevance = relevance.detach()
        return relevance

    return call


if __name__ == "__main__":
    main()
