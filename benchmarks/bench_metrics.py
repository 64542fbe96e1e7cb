"""Time tdhook's pixel_flipping against Quantus' PixelFlipping on the same model, inputs and attributions.

Both compute the same curve (Quantus' scores equal ``curve[..., 1:]``; the script checks it). They run in this
one process, pinned to one thread: after a warm-up round, ``--repeats`` rounds run both in turn; the medians are
reported with Quantus' time over tdhook's. Inputs are ``channels x size x size`` (768 features by default, 16 per
step: 48 perturbation steps). Both run the model on the same 8 x 48 perturbed samples (Quantus one pass of the
batch per step, tdhook stacks of steps), so the model's cost bounds the ratio: ``linear`` (one 768-10 layer) shows
the metrics' own work, ``mlp`` (768-256-10) and ``cnn`` (two 16-channel 3x3 convolutions and a linear layer) add
more and more of the same forward work to both. The script also times those forward passes alone, in each
library's batching, and prints the bound they set: Quantus' time over tdhook's passes alone. The bound holds for
the CNN; ``linear`` and ``mlp`` start with a linear layer on the flattened sample, whose output tdhook updates from
step to step instead of recomputing (``tdhook.metrics._leading_affine``): it runs no such stacked passes. For them
the script also times the bare operations of that update (the sort, the gather of the features, the first layer
once, ``embedding_bag`` over a transpose made beforehand, the ``cumsum``, the layers after it and the target's
gather, with no check, key or wrapper at all, checked to give the same curve) and prints the bound they set:
Quantus' time over theirs.

The collector runs, untimed, before every timed call. Its walk of the half million objects the imports made (torch,
Quantus' pandas, scipy, scikit-learn, ...) evicts the caches, so that each call starts cold; ``--warm`` times each
call after an untimed one instead, and ``--frozen-heap`` takes the imports' objects out of the walk (``gc.freeze``),
so that each call starts with the caches as the methods before it left them.

    taskset -c 1 python benchmarks/bench_metrics.py --model linear mlp cnn --features-per-step 16 --repeats 9
"""

from __future__ import annotations

import argparse
import gc
import time
import warnings
from collections.abc import Callable

import numpy as np
import torch
from tensordict import TensorDict
from timing import interleaved_medians
from torch import nn

from tdhook.metrics import pixel_flipping
from tdhook.metrics._scoring import Scorer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--channels", type=int, default=3)
    parser.add_argument("--size", type=int, default=16)
    parser.add_argument("--features-per-step", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", nargs="+", choices=["linear", "mlp", "cnn"], default=["linear", "mlp", "cnn"])
    parser.add_argument(
        "--warm", action="store_true", help="time each call after an untimed one, as in a loop over many batches"
    )
    parser.add_argument(
        "--loop",
        type=int,
        default=1,
        help="time LOOP calls of each method in a row and count their mean, as a metric run over the batches of a "
        "data set calls it (the collector runs before the first only)",
    )
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time the CPU time of this process instead of the wall time (steadier where other work shares the core)",
    )
    parser.add_argument(
        "--frozen-heap",
        action="store_true",
        help="move the objects made before the timing (imports, models, inputs) out of the collector's reach "
        "(gc.freeze): the collection before each timed call then walks only those made since, instead of the "
        "half million of the imports, a walk that evicts the caches",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    warnings.filterwarnings("ignore")
    import quantus

    c, s, b = args.channels, args.size, args.batch
    n_features = c * s * s
    print(
        f"batch {b} x {c}x{s}x{s} ({n_features} features, {args.features_per_step} per step), 1 thread, "
        f"median of {args.repeats} interleaved rounds{', warm caches' if args.warm else ''}"
        f"{f', {args.loop} calls in a row' if args.loop > 1 else ''}"
        f"{', CPU time' if args.cpu_time else ''}{', frozen heap' if args.frozen_heap else ''}"
    )
    print(
        f"{'model':<6} {'tdhook s':>9} {'its fwd s':>10} {'quantus s':>10} {'its fwd s':>10} "
        f"{'quantus / tdhook':>17} {'fwd-only bound':>15} {'bare-ops bound':>15} {'max |diff|':>11}"
    )
    for name in args.model:
        torch.manual_seed(0)
        net = _model(name, c, s)
        x, a = torch.randn(b, c, s, s), torch.randn(b, c, s, s)
        y = net(x).argmax(-1).numpy()
        td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[b])
        metric = quantus.PixelFlipping(
            features_in_step=args.features_per_step,
            perturb_baseline=0.0,
            normalise=False,
            abs=False,
            disable_warnings=True,
            display_progressbar=False,
        )

        def ours(net=net, td=td) -> torch.Tensor:
            return pixel_flipping(net, td, in_keys=["x"], out_keys=["y"], features_per_step=args.features_per_step)

        def theirs(net=net, x=x, a=a, y=y, metric=metric) -> np.ndarray:
            scores = metric(model=net, x_batch=x.numpy(), y_batch=y, a_batch=a.numpy(), softmax=False, device="cpu")
            return np.array(scores)

        # The forward passes alone, on the same samples as each metric: tdhook's stacks of steps (and its
        # unperturbed pass), Quantus' one pass of the batch per step. Their ratio bounds what any metric code
        # running these passes can reach.
        n_steps = -(-n_features // args.features_per_step)
        per_forward = Scorer(net, td, in_keys=["x"], out_keys=["y"]).chunk_size([x])
        stacked = x.unsqueeze(0).expand(n_steps, *x.shape).reshape(-1, *x.shape[1:]).clone()

        def our_forwards(net=net, x=x, stacked=stacked, size=per_forward * b) -> None:
            with torch.no_grad():
                net(x)
                for start in range(0, len(stacked), size):
                    net(stacked[start : start + size])

        def their_forwards(net=net, stacked=stacked) -> None:
            with torch.no_grad():
                for start in range(0, len(stacked), b):
                    net(stacked[start : start + b])

        methods = {"tdhook": ours, "quantus": theirs, "tdhook fwd": our_forwards, "quantus fwd": their_forwards}
        if name != "cnn":
            bare = _bare_curve(net, x, a, args.features_per_step)
            torch.testing.assert_close(bare(), ours(), rtol=1e-4, atol=1e-4)
            methods["bare"] = bare
        gap = np.abs(ours()[:, 1:].numpy() - theirs()).max()
        if args.frozen_heap:
            gc.collect()
            gc.freeze()
        times = interleaved_medians(
            methods,
            args.repeats,
            collect=True,
            warm=args.warm,
            loop=args.loop,
            clock=time.process_time if args.cpu_time else time.perf_counter,
        )
        if args.frozen_heap:
            gc.unfreeze()
        ratio = times["quantus"] / times["tdhook"]
        bound = times["quantus"] / times["tdhook fwd"]
        bare_bound = f"{times['quantus'] / times['bare']:15.1f}" if "bare" in times else f"{'-':>15}"
        print(
            f"{name:<6} {times['tdhook']:9.4f} {times['tdhook fwd']:10.4f} {times['quantus']:10.4f} "
            f"{times['quantus fwd']:10.4f} {ratio:17.1f} {bound:15.1f} {bare_bound} {gap:11.1e}"
        )


def _bare_curve(net: nn.Sequential, x: torch.Tensor, a: torch.Tensor, per_step: int) -> Callable[[], torch.Tensor]:
    """The pixel-flipping curve of ``net`` (a flatten, a linear layer, then any layers) at baseline 0, from the bare
    operations of a step-by-step update of the first layer's output: no check of the inputs, the weights (their
    transpose is made here, once) or the model, no key, no wrapper. The least a call that updates the first layer
    can run; its time bounds the ratio such a call can reach."""
    first, rest = net[1], net[2:]
    transposed = first.weight.detach().t().contiguous()
    n = x.shape[0]
    flat, scores = x.reshape(n, -1), a.reshape(n, -1)
    n_features = flat.shape[1]
    steps = -(-n_features // per_step)
    # each sample's bags start at its own first feature (its last step may take fewer features)
    offsets = (torch.arange(n).unsqueeze(1) * n_features + torch.arange(0, n_features, per_step)).reshape(-1)

    def curve() -> torch.Tensor:
        with torch.no_grad():
            order = torch.argsort(scores, dim=1, descending=True, stable=True)
            deltas = flat.neg().gather(1, order)
            bags = nn.functional.embedding_bag(
                order.reshape(-1),
                transposed,
                offsets,
                mode="sum",
                per_sample_weights=deltas.reshape(-1),
            )
            hidden = torch.cat([first(flat).unsqueeze(1), bags.view(n, steps, -1)], 1).cumsum(1)
            outputs = rest(hidden.view(n * (steps + 1), -1)).view(n, steps + 1, -1)
            target = outputs[:, 0].argmax(-1)
            return outputs.gather(2, target.view(n, 1, 1).expand(n, steps + 1, 1)).squeeze(-1)

    return curve


def _model(name: str, channels: int, size: int) -> nn.Module:
    if name == "linear":
        return nn.Sequential(nn.Flatten(), nn.Linear(channels * size * size, 10)).eval()
    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(channels * size * size, 256), nn.ReLU(), nn.Linear(256, 10)).eval()
    return nn.Sequential(
        nn.Conv2d(channels, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * size * size, 10),
    ).eval()


if __name__ == "__main__":
    main()
