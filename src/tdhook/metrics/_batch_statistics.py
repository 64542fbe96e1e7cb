"""Models whose output depends on the other samples of their batch: BatchNorm normalising by the batch's statistics.

The metrics stack perturbed copies of a batch into one pass; through such a layer the copies would change each
other's outputs, so they run one copy per pass. In training mode each pass also updates the layer's running
statistics, with which some layers normalise (torchrl's ``BatchRenorm1d``): every pass of a metric starts from the
statistics the caller left (:func:`statistics_kept`), and the caller's model is left as it was.

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

A model may also mix its samples in its own forward, where no module shows it (``F.batch_norm(x, None, None,
training=True)``, ``(x - x.mean(0)) / x.std(0)``): the first pass of stacked steps of a metric's call is compared
with its first and middle steps run alone (:func:`~tdhook.attribution.methods._mixed_copies.steps_mixed`; the scorer
puts the unperturbed batch first, whose own pass it has), and on a difference beyond rounding the steps run one per
pass, with a warning naming the module that mixes them. A model built of torch's layers that compute each sample
apart is not compared (:func:`~tdhook.attribution.methods._mixed_copies.samples_apart`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import TypeVar

from torch import nn

from tdhook.attribution._running_statistics import refuse_moving_statistics
from tdhook.attribution.methods._batch_statistics import batch_normalisers, buffers_kept
from tdhook.attribution.methods._mixed_copies import hooked, samples_apart, steps_mixed

__all__ = [
    "StepsMixed",
    "batch_normalising_module",
    "hooked",
    "keeps_running_statistics",
    "samples_apart",
    "statistics_kept",
    "steps_mixed",
]

Metric = TypeVar("Metric", bound=Callable)


def batch_normalising_module(module: object, modules: Mapping[str, nn.Module] | None = None) -> str | None:
    """The first module of ``module`` whose output depends on the other samples of its batch, named with its type, or
    ``None`` (see :func:`~tdhook.attribution.methods._batch_statistics.batch_normalisers`: a BatchNorm in training
    mode or without running statistics, torchrl's ``BatchRenorm1d`` in training mode). ``modules``: those of
    ``module`` by name, where the caller has walked them already.

    Examples:
        >>> net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, track_running_stats=False))
        >>> batch_normalising_module(net), batch_normalising_module(nn.BatchNorm1d(4).eval())
        ('1 (BatchNorm1d)', None)
    """
    if not isinstance(module, nn.Module):
        return None
    modules = dict(module.named_modules()) if modules is None else modules
    names = batch_normalisers(modules)
    return f"{names[0] or type(module).__name__} ({type(modules[names[0]]).__name__})" if names else None


def statistics_kept(model: nn.Module) -> contextlib.AbstractContextManager:
    """The context of one pass of a metric through ``model`` (or through a method that runs it): modules in training
    mode update copies of their buffers, so that the next pass starts, as this one did, from the running statistics
    the caller left.

    Examples:
        >>> import torch
        >>> from torchrl.modules import BatchRenorm1d
        >>> norm = BatchRenorm1d(2, warmup_steps=1, momentum=0.5)
        >>> x = torch.randn(4, 2)
        >>> with statistics_kept(norm):
        ...     first = norm(x)
        >>> torch.equal(norm(x), first)  # from the same statistics, the same output
        True
    """
    return buffers_kept(model)


def keeps_running_statistics(metric: Metric) -> Metric:
    """``metric`` leaving the buffers of its model (its first argument) as they were, even on failure: the passes of
    modules in training mode update copies of them (see
    :func:`~tdhook.attribution.methods._batch_statistics.buffers_kept`). A torchrl ``VecNorm`` that is not frozen,
    whose statistics are no buffers, is refused by name."""
    first = next(iter(inspect.signature(metric).parameters))

    @functools.wraps(metric)
    def kept(*args, **kwargs):
        model = args[0] if args else kwargs.get(first)
        if not isinstance(model, nn.Module):
            return metric(*args, **kwargs)
        modules = dict(model.named_modules())
        refuse_moving_statistics(metric.__name__, modules)  # not buffers: kept by no copy
        # Modules in eval mode leave their buffers as they are: with no buffer in a module in training mode there is
        # nothing to keep.
        if not any(module.training and len(module._buffers) for module in modules.values()):
            return metric(*args, **kwargs)
        with buffers_kept(model):
            return metric(*args, **kwargs)

    return kept


class StepsMixed(Exception):
    """Raised where a stack of steps shows that the model mixes the samples of its batch: ``found`` names the module
    (see :func:`steps_mixed`, which warned of it)."""

    def __init__(self, found: str) -> None:
        super().__init__(found)
        self.found = found
