"""Time tdhook's IntegratedGradients against captum's on a small CNN.

Both run in this one process, pinned to one thread, on the same weights and
images: after a warm-up round, ``--repeats`` rounds run every method in turn;
the medians are reported with their ratio to captum's. tdhook's wrapper runs
the model once more on the unperturbed input (the outputs it writes and the
target it resolves there); captum is handed the target.

    python benchmarks/bench_methods.py --batch 8 --size 32 --steps 32 --repeats 9
"""

from __future__ import annotations

import argparse

import captum.attr
import torch
from tensordict import TensorDict
from timing import interleaved_medians
from torch import nn

from tdhook.attribution import IntegratedGradients


def small_cnn(classes: int = 10, size: int = 32) -> nn.Module:
    """Two convolution blocks and a linear head: the small CNN of the benchmark."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * (size // 4) ** 2, classes),
    ).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = small_cnn(size=args.size)
    images = torch.randn(args.batch, 3, args.size, args.size)
    target = net(images).argmax(-1)
    td = TensorDict(image=images, batch_size=[args.batch])
    ours = IntegratedGradients(net, in_keys=["image"], out_keys=["logits"], n_steps=args.steps)
    theirs = captum.attr.IntegratedGradients(net)
    check = ours(td.clone())["attribution", "image"]
    expected = theirs.attribute(images, target=target, n_steps=args.steps)
    error = ((check - expected).norm() / expected.norm()).item()
    seconds = interleaved_medians(
        {
            "captum IntegratedGradients": lambda: theirs.attribute(images, target=target, n_steps=args.steps),
            "tdhook IntegratedGradients": lambda: ours(td.clone()),
        },
        args.repeats,
    )
    base = seconds["captum IntegratedGradients"]
    print(
        f"batch {args.batch} x 3x{args.size}x{args.size}, {args.steps} Gauss-Legendre steps, 1 thread, "
        f"median of {args.repeats} interleaved rounds; relative L2 difference {error:.1e}"
    )
    print(f"{'method':<28} {'seconds':>9} {'x captum':>9}")
    for label, value in seconds.items():
        print(f"{label:<28} {value:9.4f} {value / base:9.2f}")


if __name__ == "__main__":
    main()
