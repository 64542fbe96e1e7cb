"""Random draws of the metrics, from a generator of their own: the global random state is never touched, not even
by the model's own draws (an exploration step such as torchrl's ``EGreedyModule``), which run on a fork of it.

Examples:
    >>> import torch
    >>> g = generator(0)
    >>> torch.equal(torch.rand(3, generator=g), torch.rand(3, generator=generator(0)))
    True
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from numbers import Integral
from typing import TypeVar

import torch
from torch import nn

from tdhook.attribution.methods._global_rng import cuda_devices
from tdhook.attribution.methods._settable_options import SEEDS

__all__ = ["cuda_devices", "generator", "keeps_global_rng"]

Metric = TypeVar("Metric", bound=Callable)


def generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with ``seed``, or from fresh entropy for ``None``.

    Raises:
        TypeError: ``seed`` is neither an integer (a NumPy one too; no bool) nor ``None``.
        ValueError: ``seed`` is outside the seeds torch's generators take, ``[-2**63, 2**64)``.
    """
    g = torch.Generator()
    if seed is None:
        g.seed()
    elif isinstance(seed, Integral) and not isinstance(seed, bool):
        if int(seed) not in SEEDS:
            raise ValueError(f"metrics: seed must be an int in [-2**63, 2**64), got {seed!r}")
        g.manual_seed(int(seed))
    else:
        raise TypeError(f"metrics: seed must be an int or None, got {type(seed).__name__}")
    return g


def keeps_global_rng(metric: Metric) -> Metric:
    """``metric`` run on a fork of the global random state (CPU, and the CUDA devices of its model, its first
    argument): draws of the model's own leave the caller's state as it was."""
    first = next(iter(inspect.signature(metric).parameters))

    @functools.wraps(metric)
    def forked(*args, **kwargs):
        model = args[0] if args else kwargs.get(first)
        devices = cuda_devices(model) if isinstance(model, nn.Module) else []
        if devices:
            with torch.random.fork_rng(devices=devices):
                return metric(*args, **kwargs)
        # The CPU state alone: what fork_rng keeps without devices, in two calls instead of its generic setup.
        state = torch.default_generator.get_state()
        try:
            return metric(*args, **kwargs)
        finally:
            torch.default_generator.set_state(state)

    return forked
