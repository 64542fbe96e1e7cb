"""Where the time of an LRP call goes: torch.profiler's op table for gradient × input and a tdhook preset.

Runs one warm-up call and one profiled call of each, on one thread, and prints
the ops with the most self CPU time, grouped as convolutions (forward and
backward), matrix products, and element-wise work.

    python benchmarks/profile_vision.py --model vgg11 --preset EpsilonGammaBox --batch 2
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
import torchvision
from tensordict import TensorDict
from torch.profiler import ProfilerActivity, profile

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.rules import EpsilonGammaBox, EpsilonPlusFlat

PRESETS = {"EpsilonPlusFlat": EpsilonPlusFlat, "EpsilonGammaBox": lambda: EpsilonGammaBox(-3.0, 3.0)}
GROUPS = {
    "convolution": ("conv", "mkldnn_convolution", "convolution_backward"),
    "matrix product": ("addmm", "mm", "linear", "matmul"),
}


def group_of(name: str) -> str:
    for group, words in GROUPS.items():
        if any(word in name for word in words):
            return group
    return "element-wise and other"


def profile_call(fn) -> dict[str, float]:
    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    seconds: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        if event.key.startswith("aten::"):
            seconds[group_of(event.key)] += event.self_cpu_time_total / 1e6
    seconds["total"] = sum(seconds.values())
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vgg11")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="EpsilonGammaBox")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--size", type=int, default=224)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = getattr(torchvision.models, args.model)(weights=None).eval()
    x = torch.randn(args.batch, 3, args.size, args.size).clamp(-3.0, 3.0)

    def gradient_times_input():
        leaf = x.detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(model(leaf).max(-1).values.sum(), leaf)
        return leaf * grad

    with LRP(model, PRESETS[args.preset](), in_keys=["x"], out_keys=["y"]) as lrp:
        ours = profile_call(lambda: lrp(TensorDict(x=x, batch_size=[args.batch])))
    base = profile_call(gradient_times_input)
    print(f"{args.model}, batch {args.batch}, {args.preset}: self CPU seconds of aten ops, by group")
    print(f"{'group':<24} {'grad x input':>13} {'tdhook':>9} {'extra':>8}")
    for group in [*GROUPS, "element-wise and other", "total"]:
        print(f"{group:<24} {base[group]:13.3f} {ours[group]:9.3f} {ours[group] - base[group]:8.3f}")


if __name__ == "__main__":
    main()
