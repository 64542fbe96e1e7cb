"""Memory that an open context holds for the rules' modified parameters, on torchvision models in float64.

For each model and preset, one call (batch 1, 3×224×224) inside a context; then the live tensors are listed through
the garbage collector, and those that were not alive before the context opened (the model's parameters and the
input left out) are the context's: their bytes (each storage once), and how many of them have the shape of a
layer's weight, per Linear or convolution layer. The relevance's bytes are hashed (sha256), so that two versions of
the code can be compared bit for bit. With ``--time N``, the median and the least CPU time of N calls inside the
context, after a warm-up call (one thread).

    python benchmarks/modified_parameters.py --models resnet18 vgg11
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import statistics
import time

import torch
import torchvision
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.mappers import presets

MiB = 2**20
PRESETS = ["EpsilonPlus", "EpsilonGammaBox", "EpsilonAlpha2Beta1", "EpsilonPlusFlat"]


def calibrated(name: str) -> nn.Module:
    """The model with no weights loaded, in float64, its BatchNorms' statistics from three batches of noise."""
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None).double().train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(4, 3, 224, 224, dtype=torch.float64))
    return model.eval()


def mapper(name: str) -> presets.Preset:
    return presets.EpsilonGammaBox(-3.0, 3.0) if name == "EpsilonGammaBox" else getattr(presets, name)()


def live_storages() -> dict[int, torch.Tensor]:
    """One live tensor per storage, by the storage's address."""
    gc.collect()
    found: dict[int, torch.Tensor] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and not obj.is_meta and obj.numel():
            found.setdefault(obj.untyped_storage().data_ptr(), obj)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["resnet18", "vgg11"])
    parser.add_argument("--presets", nargs="*", default=PRESETS)
    parser.add_argument("--time", type=int, default=0, help="timed calls inside the context (0: none)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'model':9} {'preset':18} {'held MiB':>9} {'weight-shaped per layer':>24}  relevance sha256")
    for name in args.models:
        model = calibrated(name)
        layers = [m for m in model.modules() if isinstance(m, nn.Linear | nn.Conv2d)]
        shapes = {tuple(m.weight.shape) for m in layers}
        torch.manual_seed(1)
        x = torch.randn(1, 3, 224, 224, dtype=torch.float64)
        for preset in args.presets:
            lrp = LRP(TensorDictModule(model, in_keys=["x"], out_keys=["y"]), rule_mapper=mapper(preset))
            before = set(live_storages())
            with lrp:
                td = lrp(TensorDict(x=x.clone(), batch_size=[1]))
                digest = hashlib.sha256(td["relevance", "x"].detach().contiguous().numpy().tobytes()).hexdigest()
                del td
                held = {ptr: t for ptr, t in live_storages().items() if ptr not in before}
                nbytes = sum(t.untyped_storage().nbytes() for t in held.values())
                weight_shaped = sum(tuple(t.shape) in shapes for t in held.values())
                timing = ""
                if args.time:
                    seconds = []
                    for _ in range(args.time):
                        start = time.process_time()
                        lrp(TensorDict(x=x.clone(), batch_size=[1]))
                        seconds.append(time.process_time() - start)
                    timing = f"  call {statistics.median(seconds):.3f} s (least {min(seconds):.3f} s)"
                del held
            print(
                f"{name:9} {preset:18} {nbytes / MiB:9.1f} {weight_shaped / len(layers):24.1f}  {digest[:16]}{timing}",
                flush=True,
            )
            del lrp
        del model
        gc.collect()


if __name__ == "__main__":
    main()
