"""Random float64 models and inputs shared by the metric tests, and the Quantus oracle's view of a model."""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn


def conv_net(channels: int = 3, size: int = 6, classes: int = 5) -> nn.Module:
    """A small random CNN in float64, in eval mode."""
    return (
        nn.Sequential(
            nn.Conv2d(channels, 4, 3, padding=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(4 * size * size, classes),
        )
        .double()
        .eval()
    )


def images(batch: int, channels: int = 3, size: int = 6) -> torch.Tensor:
    """Random images whose values are exact in float32 (Quantus feeds the model float32 copies)."""
    return torch.randn(batch, channels, size, size).double()


def for_quantus(model: nn.Module) -> nn.Module:
    """A copy of ``model`` that turns Quantus' float32 inputs back into float64 (exact for :func:`images`)."""
    copied = copy.deepcopy(model)
    copied.register_forward_pre_hook(lambda module, args: (args[0].double(),))
    return copied


def quantus_scores(
    metric, net: nn.Module, x: torch.Tensor, a: torch.Tensor, y: torch.Tensor, **options
) -> torch.Tensor:
    """The scores of the Quantus ``metric`` (built) for ``net`` on the images ``x`` with the attributions ``a`` of the
    classes ``y``, without softmax, as a tensor; ``options``: the call's other keywords."""
    scores = metric(
        model=for_quantus(net), x_batch=x.numpy(), y_batch=y.numpy(), a_batch=a.numpy(), softmax=False, **options
    )
    return torch.tensor(np.array(scores))


class TwoKeys(nn.Module):
    """A model of two inputs ``u`` [5] and ``v`` [3] with four outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 8)
        self.b = nn.Linear(3, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.a(u) + self.b(v)))


def gradient_times_input(model: nn.Module, inputs, targets, **kwargs):
    """Quantus' ``explain_func``: gradient x input of the target logit, in float64."""
    x = torch.as_tensor(inputs, dtype=torch.float64).requires_grad_(True)
    out = model(x)
    (grad,) = torch.autograd.grad(out[torch.arange(len(x)), torch.as_tensor(targets)].sum(), x)
    return (grad * x).detach().numpy()


def mlp_net(channels: int = 3, size: int = 6, classes: int = 5, hidden: int = 16) -> nn.Module:
    """A small random MLP on images in float64, in eval mode: its first layer reads the flattened sample."""
    return (
        nn.Sequential(nn.Flatten(), nn.Linear(channels * size * size, hidden), nn.ReLU(), nn.Linear(hidden, classes))
        .double()
        .eval()
    )


class Trajectory(nn.Module):
    """A GRU over its input's first dimension: a ``[6, 3]`` input is one trajectory of 6 steps (unbatched)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn, self.head = nn.GRU(3, 5), nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])
