"""The global random state across a method's call: the caller sees the draws of one plain forward pass only.

A policy that samples (a ``ProbabilisticActor`` under random interaction, an
``EGreedyModule`` inside the explained model) draws from the global random
state in every forward pass. A method runs the model once on the caller's
input, then on its perturbed copies: the passes after the first run on a fork
of the global state (CPU, and the CUDA devices of the model), so that the
caller's state moves as one plain call of the policy moves it, and a rollout
with the method as its policy takes the bare policy's actions under the same
seed.

Examples:
    >>> import torch
    >>> model = torch.nn.Linear(2, 2)
    >>> _ = torch.manual_seed(0)
    >>> first = torch.rand(1)
    >>> _ = torch.manual_seed(0)
    >>> with global_rng_kept(model):
    ...     _ = torch.rand(3)
    >>> torch.equal(torch.rand(1), first)
    True
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

__all__ = ["cuda_devices", "global_rng_kept"]


def cuda_devices(model: nn.Module) -> list[int]:
    """The CUDA devices that hold ``model``'s parameters or buffers (none without CUDA started).

    Examples:
        >>> cuda_devices(torch.nn.Linear(2, 2))
        []
    """
    if not torch.cuda.is_initialized():  # a tensor on a CUDA device starts CUDA: none yet, no walk of the model
        return []
    return sorted({t.device.index or 0 for t in [*model.parameters(), *model.buffers()] if t.device.type == "cuda"})


def global_rng_kept(model: nn.Module) -> contextlib.AbstractContextManager:
    """A fork of the global random state (CPU and ``model``'s CUDA devices): draws inside leave it as it was."""
    return torch.random.fork_rng(devices=cuda_devices(model))
