"""Modules that normalise with the statistics of the batch they see (BatchNorm in training mode).

A method that stacks perturbed copies of the batch in one forward pass would
normalise every copy with the statistics of all of them, a function other than
the model's on one batch; such models get one copy per pass. Every perturbed
pass would also move the running statistics; they are put back after each,
so that every pass sees the model as the caller's own pass left it, and the
call leaves the model as one plain forward pass on the caller's input does.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    >>> batch_normalisers(dict(net.named_modules())), batch_normalisers(dict(net.eval().named_modules()))
    (['1'], [])
    >>> with buffers_kept(net.train()):
    ...     _ = net(torch.randn(4, 2))
    >>> int(net[1].num_batches_tracked)
    0
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch import nn
from torchrl.modules import BatchRenorm1d

__all__ = ["batch_normalisers", "buffers_kept", "buffers_restored_on_error"]


def batch_normalisers(modules: Mapping[str, nn.Module]) -> list[str]:
    """The names of the modules that normalise with the statistics of the batch they are given.

    A BatchNorm does in training mode, or in eval mode without running
    statistics; torchrl's ``BatchRenorm1d`` does in training mode.
    """
    names = []
    for name, module in modules.items():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            if module.training or module.running_mean is None or module.running_var is None:
                names.append(name)
        elif isinstance(module, BatchRenorm1d) and module.training:
            names.append(name)
    return names


def _training_buffers(model: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """The buffers of ``model``'s modules in training mode, the only ones a forward pass updates."""
    return [
        (module, name, buffer)
        for module in model.modules()
        if module.training
        for name, buffer in module._buffers.items()
        if isinstance(buffer, torch.Tensor)
    ]


@contextlib.contextmanager
def buffers_restored_on_error(model: nn.Module) -> Iterator[None]:
    """Give the buffers of ``model``'s modules in training mode their values back if the block raises (and their
    places in the modules, where a :func:`buffers_kept` inside was stopped before it put them back).

    Examples:
        >>> norm = nn.BatchNorm1d(2)
        >>> try:
        ...     with buffers_restored_on_error(norm):
        ...         _ = norm(torch.randn(4, 2))
        ...         raise RuntimeError("a later step failed")
        ... except RuntimeError:
        ...     pass
        >>> int(norm.num_batches_tracked)
        0
    """
    kept = [(module, name, buffer, buffer.clone()) for module, name, buffer in _training_buffers(model)]
    try:
        yield
    except BaseException:
        with torch.no_grad():
            for module, name, buffer, value in kept:
                module._buffers[name] = buffer  # the module's own, where an interrupt left a copy in its place
                buffer.copy_(value)
        raise


@contextlib.contextmanager
def buffers_kept(model: nn.Module) -> Iterator[None]:
    """Run the block on copies of the buffers of ``model``'s modules in training mode, and put the originals back.

    Modules in eval mode do not update their buffers; those in training mode
    (running statistics, batch counters) update copies, which a backward pass
    may still read, and get their own buffers back, untouched, on the way out
    (by error or not).
    """
    kept = _training_buffers(model)
    try:
        for module, name, buffer in kept:
            module._buffers[name] = buffer.clone()
        yield
    finally:
        for module, name, buffer in kept:
            module._buffers[name] = buffer
