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
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from tdhook.attribution._kept_caches import ACTIVE_WATCH, held_objects, is_cache
from tdhook.attribution.rules._constant_elements import CACHED

__all__ = ["CacheWatch", "caches_detached", "detach_cache"]


class CacheWatch:
    """Hooks on ``receivers`` that note the caches handed to them (or returned by them) in a call of
    :func:`caches_detached` given this watch, in the call's thread: registered once for a context, so that its calls
    register none. Its ``handles`` are removed with the context's other hooks."""

    def __init__(self, receivers: list[nn.Module]) -> None:
        self.receivers = receivers
        self._call = threading.local()  # ``caches``: those of this thread's call, where one is on
        self.handles = _noting_hooks(receivers, self._handed, self._returned)

    def _handed(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        caches = getattr(self._call, "caches", None)
        if caches is not None:
            _note(caches, (*args, *kwargs.values()), handed=True)
            kept = getattr(ACTIVE_WATCH, "kept", None)  # a run that may be let go: the caches' state before it
            if kept is not None:
                kept._note(module, args, kwargs)

    def _returned(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        caches = getattr(self._call, "caches", None)
        if caches is not None:
            _note(caches, _returned_values(output))


def _note(caches: dict[int, Any], values: Iterable[Any], handed: bool = False) -> None:
    for value in values:
        if is_cache(value) and id(value) not in caches:
            caches[id(value)] = value
            if handed:  # (a cache the call made and returns holds its own keys: nothing to mark)
                _mark_cached(value)


def _mark_cached(cache: Any) -> None:
    """Mark the tensors ``cache`` holds (a cached prefix's keys and values) as a cache's (see
    :data:`~tdhook.attribution.rules._constant_elements.CACHED`): the tokens after them get the relevance the whole
    sequence gives them, the prefix's keys no constants beside the new ones'. (Types compared, not ``isinstance``:
    each step of a generation loop hands the cache again.)"""
    for obj in held_objects(cache):
        for value in vars(obj).values():
            kind = type(value)
            items = value.values() if kind is dict else value if kind is list or kind is tuple else (value,)
            for item in items:
                if type(item) is torch.Tensor:
                    item.__dict__[CACHED] = True


def _returned_values(output: Any) -> Iterable[Any]:
    return output.values() if isinstance(output, dict) else output if isinstance(output, tuple) else (output,)


@contextlib.contextmanager
def caches_detached(
    receivers: list[nn.Module], watch: CacheWatch | None = None, keep_graph: bool = False
) -> Iterator[None]:
    """Detach, when the block ends, the tensors of every cache handed to ``receivers`` (or returned by them) in
    the block's thread; with ``keep_graph``, leave them as they are (noted all the same: a cache handed over has its
    tensors marked, see :func:`_note`). A ``watch`` registered on these ``receivers`` notes them with its hooks; else
    the block registers hooks of its own."""
    if not receivers:
        yield
        return
    caches: dict[int, Any] = {}
    outer = getattr(ACTIVE_WATCH, "notes", None), getattr(ACTIVE_WATCH, "kept", None)  # a wrapper in the model
    handles: list = []
    if watch is not None and watch.receivers is receivers:
        outer_call, watch._call.caches = getattr(watch._call, "caches", None), caches
    else:
        outer_call, watch = None, None
    try:
        if watch is None:
            handles += _own_hooks(receivers, caches)  # one line: all of them, or none where a registration fails
        ACTIVE_WATCH.notes, ACTIVE_WATCH.kept = caches, None
        yield
    finally:
        ACTIVE_WATCH.notes, ACTIVE_WATCH.kept = outer
        if watch is not None:
            watch._call.caches = outer_call
        for handle in handles:
            handle.remove()
        for cache in () if keep_graph else caches.values():
            detach_cache(cache)


def _own_hooks(receivers: list[nn.Module], caches: dict[int, Any]) -> list:
    """Hooks on ``receivers`` noting in ``caches`` what this thread's calls hand them or they return."""
    thread = threading.get_ident()  # another thread's calls of the model (without rules) keep their caches

    def handed(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if threading.get_ident() == thread:
            _note(caches, (*args, *kwargs.values()), handed=True)
            kept = getattr(ACTIVE_WATCH, "kept", None)  # a run that may be let go: the caches' state before it
            if kept is not None:
                kept._note(module, args, kwargs)

    def returned(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if threading.get_ident() == thread:
            _note(caches, _returned_values(output))

    return _noting_hooks(receivers, handed, returned)


def _noting_hooks(receivers: list[nn.Module], handed: Callable, returned: Callable) -> list:
    """A forward pre-hook ``handed`` and a forward hook ``returned`` (both given the keyword arguments) on each of
    ``receivers``: all of them, or none where a registration fails (an error, an interrupt)."""
    handles: list = []
    try:
        for module in receivers:
            handles.append(module.register_forward_pre_hook(handed, with_kwargs=True))
        for module in receivers:
            handles.append(module.register_forward_hook(returned, with_kwargs=True))
        return handles  # inside the try: an interrupt before the return leaves no hook
    except BaseException:
        while handles:  # each listed until it is removed (removing again does nothing)
            handles[-1].remove()
            handles.pop()
        raise


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
