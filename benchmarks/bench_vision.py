"""Time LRP on torchvision models against gradient × input, zennit and captum.

Every method runs in this one process, pinned to one thread, on the same model
weights, batch and inputs. After a warm-up round, ``--repeats`` rounds run
every method once in turn; the median of each is reported with its ratio to a
plain gradient × input pass, and the peak memory one call adds (measured in a
forked child, see ``timing.peak_memory_mb``). Each tdhook wrapper has its own
copy of the model and stays inside one open context, as in a loop over many
batches; zennit and captum register and remove their hooks per call, as their
APIs do.

    python benchmarks/bench_vision.py --models vgg11 resnet18 --batch 8 --size 224 --repeats 5
    python benchmarks/bench_vision.py --models mobilenet_v3_small efficientnet_b0 --presets EpsilonPlus --no-memory

zennit gets its VGG and ResNet canonizers on those families, and its generic BatchNorm merger elsewhere.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import warnings
from collections.abc import Callable

import torch
import torchvision
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from timing import interleaved_medians, peak_memory_mb
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.rules import (
    BaseRuleMapper,
    EpsilonGammaBox,
    EpsilonPlus,
    EpsilonPlusFlat,
    EpsilonRule,
)

LOW, HIGH = -3.0, 3.0  # input bounds of the z^B rule (EpsilonGammaBox)


def gradient_times_input(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_(True)
    out = model(x)
    (grad,) = torch.autograd.grad(out.max(-1).values.sum(), x)
    return x * grad


def tdhook_runner(lrp: LRP, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: lrp(TensorDict(x=x, batch_size=x.shape[:1]))["relevance", "x"]


def zennit_runner(model: nn.Module, composite, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    from zennit.attribution import Gradient

    def run() -> torch.Tensor:
        with Gradient(model=model, composite=composite) as attributor:
            _, relevance = attributor(x, lambda out: torch.zeros_like(out).scatter_(1, out.argmax(1, keepdim=True), 1))
        return relevance

    return run


def captum_runner(model: nn.Module, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    from captum.attr import LRP as CaptumLRP

    def run() -> torch.Tensor:
        with torch.no_grad():
            target = model(x).argmax(-1)
        return CaptumLRP(model).attribute(x, target=target)

    return run


PRESETS = ("epsilon only", "EpsilonPlus", "EpsilonPlusFlat", "EpsilonGammaBox")


def tdhook_mappers(presets: list[str]) -> dict:
    mappers = {
        "epsilon only": BaseRuleMapper(
            rule_mapper=lambda n, m: EpsilonRule() if isinstance(m, (nn.Linear, nn.Conv2d)) else None
        ),
        "EpsilonPlus": EpsilonPlus(),
        "EpsilonPlusFlat": EpsilonPlusFlat(),
        "EpsilonGammaBox": EpsilonGammaBox(LOW, HIGH),
    }
    return {f"tdhook {preset}": mappers[preset] for preset in presets}


def zennit_composites(name: str, presets: list[str]) -> dict:
    from zennit import canonizers, composites, rules, types
    from zennit.torchvision import ResNetCanonizer, VGGCanonizer

    def canonizers_of_model():
        if name.startswith("resnet"):
            return [ResNetCanonizer()]
        if name.startswith("vgg"):
            return [VGGCanonizer()]
        return [canonizers.SequentialMergeBatchNorm()]

    made = {
        "epsilon only": lambda: composites.LayerMapComposite(
            layer_map=[
                (types.Activation, rules.Pass()),
                (types.AvgPool, rules.Norm()),
                (types.Linear, rules.Epsilon()),
            ],
            canonizers=canonizers_of_model(),
        ),
        "EpsilonPlus": lambda: composites.EpsilonPlus(canonizers=canonizers_of_model()),
        "EpsilonPlusFlat": lambda: composites.EpsilonPlusFlat(canonizers=canonizers_of_model()),
        "EpsilonGammaBox": lambda: composites.EpsilonGammaBox(low=LOW, high=HIGH, canonizers=canonizers_of_model()),
    }
    return {f"zennit {preset}": made[preset]() for preset in presets}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["vgg11", "resnet18"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--presets", nargs="+", choices=PRESETS, default=["epsilon only", "EpsilonPlusFlat", "EpsilonGammaBox"]
    )
    parser.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", module="captum")  # it notes that it made the input require grad
    torch.manual_seed(0)

    print(
        f"batch {args.batch} x 3x{args.size}x{args.size}, 1 thread, median of {args.repeats} interleaved rounds; "
        "memory: peak MiB one call adds"
    )
    print(f"{'model':<20} {'method':<26} {'seconds':>8} {'x grad*input':>13} {'peak MiB':>9}")
    for name in args.models:
        model = getattr(torchvision.models, name)(weights=None).eval()
        x = torch.randn(args.batch, 3, args.size, args.size).clamp(LOW, HIGH)
        mappers = tdhook_mappers(args.presets)
        methods: dict[str, Callable] = {"gradient x input": lambda: gradient_times_input(model, x)}
        with contextlib.ExitStack() as contexts:
            for label, mapper in mappers.items():
                module = TensorDictModule(copy.deepcopy(model), in_keys=["x"], out_keys=["y"])
                methods[label] = tdhook_runner(contexts.enter_context(LRP(module, rule_mapper=mapper)), x)
            if args.peers:
                for label, composite in zennit_composites(name, args.presets).items():
                    methods[label] = zennit_runner(model, composite, x)
                captum = captum_runner(model, x)
                try:
                    captum()
                    methods["captum LRP"] = captum
                except TypeError as err:  # captum has no rule for some activations (Hardswish, SiLU)
                    print(f"{name:<20} captum LRP refuses the model ({type(err).__name__}: {str(err)[:60]}...)")
            seconds = interleaved_medians(methods, args.repeats)
            memory = {label: peak_memory_mb(fn) if args.memory else float("nan") for label, fn in methods.items()}
        base = seconds["gradient x input"]
        for label, value in seconds.items():
            print(f"{name:<20} {label:<26} {value:8.3f} {value / base:13.2f} {memory[label]:9.0f}")


if __name__ == "__main__":
    main()
