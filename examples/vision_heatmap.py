"""Explain a torchvision ResNet-18 with LRP and save the input next to its relevance heatmap.

Builds ``torchvision.models.resnet18`` with random weights (nothing is
downloaded) and BatchNorm statistics set to random, non-trivial values, draws a
synthetic image with torch operations (a red disc and a blue square on a smooth
background), explains the predicted class with the ``EpsilonPlusFlat`` preset
through ``tdhook.attribution.LRP``, prints the prediction and how much of the
explained logit the input relevance adds up to, and saves a figure with the
input image and its heatmap.

    python examples/vision_heatmap.py --output vision_heatmap.png --size 64
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import torch  # noqa: E402
import torchvision  # noqa: E402
from tensordict import TensorDict, TensorDictBase  # noqa: E402

from tdhook.attribution import LRP  # noqa: E402
from tdhook.attribution.lrp_helpers.rules import EpsilonPlusFlat  # noqa: E402
from tdhook.visualization import plot_heatmaps  # noqa: E402

# The usual per-channel statistics of RGB photographs, used to normalise the input.
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def build_model(num_classes: int = 10, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised ResNet-18 in eval mode whose BatchNorm layers are not the identity."""
    torch.manual_seed(seed)
    model = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.normal_(0.0, 0.1)
                module.running_var.uniform_(0.5, 2.0)
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0.0, 0.1)
    return model.eval().float()


def synthetic_image(size: int = 64) -> torch.Tensor:
    """A ``(1, 3, size, size)`` image in ``[0, 1]``: a red disc and a blue square on a smooth background."""
    ys, xs = torch.meshgrid(torch.linspace(-1.0, 1.0, size), torch.linspace(-1.0, 1.0, size), indexing="ij")
    background = 0.45 + 0.15 * torch.sin(3.0 * xs) * torch.cos(2.0 * ys)
    image = background.expand(3, size, size).clone()
    disc = (xs + 0.3) ** 2 + (ys + 0.25) ** 2 < 0.35**2
    square = ((xs - 0.45).abs() < 0.25) & ((ys - 0.4).abs() < 0.25)
    image[:, disc] = torch.tensor([0.9, 0.15, 0.1]).unsqueeze(1)
    image[:, square] = torch.tensor([0.1, 0.2, 0.85]).unsqueeze(1)
    return image.unsqueeze(0)


def explain(model: torch.nn.Module, image: torch.Tensor) -> TensorDictBase:
    """Run ``model`` on the normalised ``image`` through LRP.

    The result holds the ``logits`` and the input relevance at ``("relevance", "image")``.
    """
    lrp = LRP(model, rule_mapper=EpsilonPlusFlat(), in_keys=["image"], out_keys=["logits"])
    return lrp(TensorDict(image=(image - MEAN) / STD, batch_size=[image.shape[0]]))


def main(output: Path, size: int = 64) -> Path:
    image = synthetic_image(size)
    td = explain(build_model(), image)
    logits, relevance = td["logits"][0], td["relevance", "image"][0]
    predicted = int(logits.argmax())
    total = relevance.sum().item()
    explained = logits[predicted].item()
    print(f"predicted class: {predicted} (logit {explained:.4f})")
    print(f"total input relevance: {total:.4f} ({total / explained:.1%} of the explained logit)")
    print(f"relevance: shape {tuple(relevance.shape)}, min {relevance.min():.4g}, max {relevance.max():.4g}")
    plot_heatmaps(image, relevance.unsqueeze(0), output, titles=[f"relevance for class {predicted}"])
    print(f"saved {output}")
    return output


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("vision_heatmap.png"))
    parser.add_argument("--size", type=int, default=64, help="height and width of the synthetic image")
    args = parser.parse_args()
    main(args.output, args.size)
