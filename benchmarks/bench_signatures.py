"""Time the calls of one open context on inputs of a new shape at each call, against gradient × input.

A wrapper watches its first call of each input signature (keys, shapes, dtypes, devices) for functions no rule
covers, and the CNN presets probe it for gates computed with functions: a forward may branch on its inputs' shapes.
Under AttnLRP and CP-LRP too: their watch refuses gradient hooks the model puts on its own tensors, which no graph
shows. This script measures what that costs where every call brings a new shape: a tiny
random Llama (as in ``bench_transformer.py``) under AttnLRP over ``--lengths`` sequence lengths, and a small CNN
under EpsilonPlus over as many image sizes, each in one context; then the same inputs again (shapes seen). The
times are per call, with their ratio to a gradient × input pass over the same inputs; one thread, thread time.

    python benchmarks/bench_signatures.py --lengths 40
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable

import torch
from bench_transformer import tiny_llama
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.rules import AttnLRP, EpsilonPlus


def gradient_times_input(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(model(x).max(-1).values.sum(), x)
    return x * grad


def per_call(fn: Callable[[torch.Tensor], object], inputs: list[torch.Tensor]) -> float:
    """Thread time per call of ``fn`` over ``inputs``, in milliseconds."""
    start = time.thread_time()
    for x in inputs:
        fn(x)
    return (time.thread_time() - start) / len(inputs) * 1e3


def rows(label: str, model: nn.Module, mapper, key: str, out_key: str, inputs: list[torch.Tensor]) -> list[tuple]:
    lrp = LRP(model, mapper, in_keys=[key], out_keys=[out_key])
    explain = lambda x: lrp(TensorDict({key: x}, batch_size=x.shape[:1]))  # noqa: E731
    with lrp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        explain(inputs[0])  # the context's first call
        new = per_call(explain, inputs[1:])
        seen = per_call(explain, inputs[1:])
    base = per_call(lambda x: gradient_times_input(model, x), inputs[1:])
    return [(f"{label}, a new shape each call", new, new / base), (f"{label}, shapes seen", seen, seen / base)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, default=40, help="distinct shapes per model")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    llama = tiny_llama(args.hidden, args.layers)
    sequences = [torch.randn(args.batch, 5 + i, args.hidden) for i in range(args.lengths)]
    cnn = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)).eval()
    images = [torch.randn(args.batch, 3, 8 + i, 8 + i) for i in range(args.lengths)]
    table = rows("AttnLRP, tiny Llama", llama, AttnLRP(), "embeds", "logits", sequences)
    table += rows("EpsilonPlus, small CNN", cnn, EpsilonPlus(), "x", "y", images)
    print(f"{args.lengths} shapes, batch {args.batch}, 1 thread, thread time")
    print(f"{'case':<52} {'ms/call':>8} {'x grad*input':>13}")
    for label, ms, ratio in table:
        print(f"{label:<52} {ms:8.3f} {ratio:13.2f}")


if __name__ == "__main__":
    main()
