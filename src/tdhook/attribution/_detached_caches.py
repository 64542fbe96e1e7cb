"""The key-value caches a call hands its model, left without the call's graph, as the wrapper writes its outputs.

The explained forward pass runs with grad, whatever the caller's mode: the keys and values (a state-space model's
states) that the model writes into a ``transformers`` cache it is handed, or into one it makes and returns, require
grad and hold the graph of the call. A generation loop keeping its cache from step to step would keep every
explained step's graph alive, its memory growing with the steps. When the call ends, each such tensor of the
caches is detached: in place where it is not a view (its identity kept, as a static cache's compiled address
needs), or replaced in its holder by a detached view of the same values. The cache then holds the values of the
plain call, without a graph. A wrapper that keeps the graph of its results (``create_graph=True``) keeps that of the
caches too.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> class Cache:  # stands for transformers' Cache
    ...     __module__ = "transformers.cache_utils"
    ...     def __init__(self):
    ...         self.keys = torch.zeros(1, 0)
    >>> class Step(nn.Module):
    ...     def forward(self, x, past_key_values=None):
    ...         past_key_values.keys = torch.cat([past_key_values.keys, x], 1)
    ...         return past_key_values.keys.sum()
    >>> step, cache = Step(), Cache()
    >>> with caches_detached([step]):
    ...     _ = step(torch.ones(1, 2, requires_grad=True), past_key_values=cache)
    ...     cache.keys.requires_grad
    True
    >>> cache.keys.requires_grad, cache.keys.shape
    (False, torch.Size([1, 2]))
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from tdhook.attribution._kept_caches import ACTIVE_WATCH, held_objects, is_cache

__all__ = ["caches_detached", "detach_cache"]


@contextlib.contextmanager
def caches_detached(receivers: list[nn.Module], keep_graph: bool = False) -> Iterator[None]:
    """Detach, when the block ends, the tensors of every cache handed to ``receivers`` (or returned by them) in
    the block's thread; with ``keep_graph``, leave them as they are."""
    if keep_graph or not receivers:
        yield
        return
    caches: dict[int, Any] = {}
    thread = threading.get_ident()  # another thread's calls of the model (without rules) keep their caches

    def note(values: Iterable[Any]) -> None:
        if threading.get_ident() == thread:
            caches.update((id(value), value) for value in values if is_cache(value))

    def handed(module: nn.Module, args: tuple, kwargs: dict) -> None:
        note((*args, *kwargs.values()))
        kept = getattr(ACTIVE_WATCH, "kept", None)  # a run that may be let go: the caches' state before it
        if kept is not None and threading.get_ident() == thread:
            kept._note(module, args, kwargs)

    def returned(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        note(output.values() if isinstance(output, dict) else output if isinstance(output, tuple) else (output,))

    handles = [module.register_forward_pre_hook(handed, with_kwargs=True) for module in receivers]
    handles += [module.register_forward_hook(returned, with_kwargs=True) for module in receivers]
    outer = getattr(ACTIVE_WATCH, "notes", None), getattr(ACTIVE_WATCH, "kept", None)  # a wrapper in the model
    ACTIVE_WATCH.notes, ACTIVE_WATCH.kept = caches, None
    try:
        yield
    finally:
        ACTIVE_WATCH.notes, ACTIVE_WATCH.kept = outer
        for handle in handles:
            handle.remove()
        for cache in caches.values():
            detach_cache(cache)


def detach_cache(cache: Any) -> None:
    """Detach each tensor that ``cache`` (and the objects it holds) holds with a graph, in an attribute or in a
    list, a tuple or a dict of one."""
    for obj in held_objects(cache):
        for name, value in list(vars(obj).items()):
            if isinstance(value, torch.Tensor):
                setattr(obj, name, _detached(value))
            elif isinstance(value, list):
                value[:] = [_detached(item) for item in value]
            elif isinstance(value, dict):
                value.update({key: _detached(item) for key, item in value.items()})
            elif type(value) is tuple and any(_has_graph(item) for item in value):
                setattr(obj, name, tuple(_detached(item) for item in value))


def _has_graph(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.grad_fn is not None


def _detached(value: Any) -> Any:
    """``value`` without its graph: the same tensor detached in place, or a detached view of a view."""
    if not _has_graph(value):
        return value  # not a tensor, or a leaf (one that requires grad is the caller's own)
    if value._base is not None:  # a view cannot be detached in place
        return value.detach()
    return value.detach_()
