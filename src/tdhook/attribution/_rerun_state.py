"""What a call that runs the model twice must put back in between: the running statistics of its normalisations.

A later call of a context first runs the model without the function mode, on the plan recorded for its inputs'
signature; where its graph is not the recorded one, it runs the model again, in the mode (see
:mod:`~tdhook.attribution._model_run`). A BatchNorm in training mode moves its running statistics at each run, so
the discarded run would move them once more than the plain call does. :func:`training_statistics` keeps their values
before the first run, and :func:`put_back` writes them back before the second.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> norm = nn.BatchNorm1d(3)
    >>> kept = training_statistics([norm])
    >>> _ = norm(torch.randn(4, 3))  # the discarded run
    >>> put_back(kept)
    >>> int(norm.num_batches_tracked), bool(norm.running_mean.eq(0).all())
    (0, True)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.parameter import is_lazy

__all__ = ["moving_norms", "put_back", "training_statistics"]


def moving_norms(model: nn.Module) -> list[nn.Module]:
    """The normalisations of ``model`` that keep running statistics (BatchNorm, and InstanceNorm with
    ``track_running_stats``): those a run in training mode moves."""
    return [module for module in model.modules() if isinstance(module, _NormBase) and module.track_running_stats]


def training_statistics(norms: Iterable[nn.Module]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each running statistic of the ``norms`` in training mode, with a copy of its values now (none of a lazy norm
    not yet run, whose statistics hold no values)."""
    return [
        (buffer, buffer.clone())
        for norm in norms
        if norm.training
        for buffer in (norm.running_mean, norm.running_var, norm.num_batches_tracked)
        if buffer is not None and not is_lazy(buffer)
    ]


def put_back(kept: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Write the kept values back into their running statistics."""
    with torch.no_grad():
        for buffer, value in kept:
            buffer.copy_(value)
