"""Models whose output depends on the other samples of their batch: BatchNorm normalising by the batch's statistics.

The metrics stack perturbed copies of a batch into one pass; through such a layer the copies would change each
other's outputs, so they run one copy per pass. In training mode each pass also updates the layer's running
statistics: the metrics put them back, so that the caller's model is left as it was.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    >>> batch_normalising_module(net)
    '1 (BatchNorm1d)'
    >>> @keeps_running_statistics
    ... def passes(model, x):
    ...     return model(x)
    >>> _ = passes(net, torch.randn(5, 3))
    >>> net[1].running_mean.abs().max().item(), int(net[1].num_batches_tracked)
    (0.0, 0)
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from torch import nn

__all__ = ["batch_normalising_module", "keeps_running_statistics", "running_statistics_kept"]

Metric = TypeVar("Metric", bound=Callable)


def batch_normalising_module(module: object) -> str | None:
    """The first module of ``module`` whose output depends on the other samples of its batch, named with its type, or
    ``None``: a BatchNorm in training mode or without running statistics normalises by the batch's own statistics.

    Examples:
        >>> net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, track_running_stats=False))
        >>> batch_normalising_module(net), batch_normalising_module(nn.BatchNorm1d(4).eval())
        ('1 (BatchNorm1d)', None)
    """
    if not isinstance(module, nn.Module):
        return None
    for name, layer in module.named_modules():
        if isinstance(layer, nn.modules.batchnorm._BatchNorm) and (layer.training or layer.running_mean is None):
            return f"{name or type(module).__name__} ({type(layer).__name__})"
    return None


@contextlib.contextmanager
def running_statistics_kept(module: object) -> Iterator[None]:
    """The running statistics of ``module``'s BatchNorm layers in training mode, put back after the block."""
    layers = module.modules() if isinstance(module, nn.Module) else ()
    saved = [
        (buffer, buffer.clone())
        for layer in layers
        if isinstance(layer, nn.modules.batchnorm._BatchNorm) and layer.training
        for buffer in layer.buffers(recurse=False)
    ]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


def keeps_running_statistics(metric: Metric) -> Metric:
    """``metric`` leaving the running statistics of its model (its first argument) as they were, even on failure."""
    first = next(iter(inspect.signature(metric).parameters))

    @functools.wraps(metric)
    def kept(*args, **kwargs):
        with running_statistics_kept(args[0] if args else kwargs.get(first)):
            return metric(*args, **kwargs)

    return kept
