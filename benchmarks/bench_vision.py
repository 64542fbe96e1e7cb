"""Time LRP on torchvision models against gradient × input, zennit and captum.

Every method runs in this one process, pinned to one thread, on the same model,
batch and inputs: a warm-up call, then ``--repeats`` timed calls; the median is
reported, with its ratio to a plain gradient × input pass.

    python benchmarks/bench_vision.py --models vgg11 resnet18 --batch 8 --size 224 --repeats 5
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torchvision
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from timing import median_seconds
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.rules import BaseRuleMapper, EpsilonPlusFlat, EpsilonRule


def gradient_times_input(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_(True)
    out = model(x)
    (grad,) = torch.autograd.grad(out.max(-1).values.sum(), x)
    return x * grad


def tdhook_runner(model: nn.Module, rule_mapper) -> tuple[Callable, Callable]:
    lrp = LRP(TensorDictModule(model, in_keys=["x"], out_keys=["y"]), rule_mapper=rule_mapper)

    def run(x: torch.Tensor) -> torch.Tensor:
        return lrp(TensorDict(x=x, batch_size=x.shape[:1]))["relevance", "x"]

    return run, lrp


def zennit_runner(model: nn.Module, composite) -> Callable:
    from zennit.attribution import Gradient

    def run(x: torch.Tensor) -> torch.Tensor:
        with Gradient(model=model, composite=composite) as attributor:
            out, relevance = attributor(
                x, lambda out: torch.zeros_like(out).scatter_(1, out.argmax(1, keepdim=True), 1)
            )
        return relevance

    return run


def captum_runner(model: nn.Module) -> Callable:
    from captum.attr import LRP as CaptumLRP

    def run(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = model(x).argmax(-1)
        return CaptumLRP(model).attribute(x, target=target)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["vgg11", "resnet18"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    from zennit.composites import EpsilonPlusFlat as ZennitEpsilonPlusFlat
    from zennit.torchvision import ResNetCanonizer, VGGCanonizer

    print(f"batch {args.batch} x 3x{args.size}x{args.size}, 1 thread, median of {args.repeats}")
    print(f"{'model':<10} {'method':<32} {'seconds':>8} {'x grad*input':>13}")
    for name in args.models:
        model = getattr(torchvision.models, name)(weights=None).eval()
        x = torch.randn(args.batch, 3, args.size, args.size)
        epsilon_only = BaseRuleMapper(
            rule_mapper=lambda n, m: EpsilonRule() if isinstance(m, (nn.Linear, nn.Conv2d)) else None
        )
        tdhook_eps, _ = tdhook_runner(model, epsilon_only)
        tdhook_epf, _ = tdhook_runner(model, EpsilonPlusFlat())
        methods: dict[str, Callable] = {
            "gradient x input": lambda x: gradient_times_input(model, x),
            "tdhook epsilon only": tdhook_eps,
            "tdhook EpsilonPlusFlat": tdhook_epf,
        }
        if args.peers:
            canonizers = [ResNetCanonizer()] if name.startswith("resnet") else [VGGCanonizer()]
            methods["zennit EpsilonPlusFlat"] = zennit_runner(model, ZennitEpsilonPlusFlat(canonizers=canonizers))
            methods["captum LRP"] = captum_runner(model)
        base = None
        for label, fn in methods.items():
            seconds = median_seconds(lambda: fn(x), args.repeats)
            base = base or seconds
            print(f"{name:<10} {label:<32} {seconds:8.3f} {seconds / base:13.2f}")


if __name__ == "__main__":
    main()
