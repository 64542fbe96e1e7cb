"""What a call that runs the model twice must put back in between: the key-value caches its modules are handed.

A later call of a context first runs the model on the plan recorded for its inputs' signature; where its graph is
not the recorded one, it runs the model again (see :mod:`~tdhook.attribution._model_run`). A Hugging Face model
given a key-value cache held outside the call (``past_key_values=cache``, a ``transformers`` ``Cache``, as a
generation loop keeps one from step to step) appends the new tokens' keys and values to it at each run: the second
run would see them twice, as a longer prefix, and give other logits and other relevance than the plain call.
:class:`KeptCaches` notes the state of each cache that a module taking a cache argument is handed, when first
handed it in a run, and :meth:`KeptCaches.put_back` restores it before the run that follows.

A cache's state is its attributes and those of the objects it holds (its layers): a run that replaces a tensor
(``torch.cat`` of a dynamic cache) or a count is undone by putting the attributes back, and a small tensor written
in place (a static cache's length) by copying its values back. A large tensor written in place (a static cache's
keys, a recurrent state copied into its slot) cannot be put back without a copy of every cache at every call: such a
call raises an error naming the cache.

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
    >>> kept = KeptCaches(cache_receivers(step))
    >>> with kept.watching():
    ...     _ = step(torch.ones(1, 2), past_key_values=cache)  # the run that is let go
    >>> kept.put_back()
    >>> cache.keys.shape
    torch.Size([1, 0])
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["ACTIVE_WATCH", "CACHE_ARGUMENTS", "KeptCaches", "cache_receivers", "held_objects", "is_cache"]

# The names under which Hugging Face modules take a key-value (or recurrent) cache.
CACHE_ARGUMENTS = frozenset({"past_key_values", "past_key_value", "cache", "layer_past", "cache_params", "past"})
# Tensors of at most this many elements (lengths, counters) are copied and written back where changed in place.
SMALL_TENSOR = 64
_DEPTH = 3  # a cache, its layers, and what they hold


def is_cache(value: Any) -> bool:
    """Whether ``value`` is a ``transformers`` cache (a subclass of its ``Cache``), told by its classes' names
    (``transformers`` is not imported); decided once per type."""
    kind = type(value)
    found = _CACHE_TYPES.get(kind)
    if found is None:
        found = _CACHE_TYPES[kind] = any(
            cls.__name__ == "Cache" and cls.__module__.startswith("transformers") for cls in kind.__mro__[:-1]
        )
    return found


# The call's watch of the caches in this thread, where one is on: its ``notes`` (the caches handed) and the
# :class:`KeptCaches` that a run which may be let go keeps (``kept``), so that one set of hooks serves both.
ACTIVE_WATCH = threading.local()

# Whether each type met is a cache's: the argument values of a receiver's call are checked at every call.
_CACHE_TYPES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cache_receivers(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that watching the caches handed to the model needs: of those whose ``forward``
    takes a cache argument by name and that a caller may hand a cache (the outermost such modules, and the
    ``transformers`` models below them: a step may hand the cache to an inner model, as one calling ``model.model``
    does), the innermost. A ``transformers`` model hands its cache on to its base model, which makes and returns
    one where none is handed: hooks on the base model see every cache, and the outer model, the layers and the
    attention modules keep ``nn.Module``'s way without hooks.

    Examples:
        >>> from torch import nn
        >>> class Step(nn.Module):
        ...     def forward(self, x, past_key_values=None):
        ...         return x
        >>> class Outer(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.step = Step()
        ...     def forward(self, x, cache=None):
        ...         return self.step(x, past_key_values=cache)
        >>> [type(module).__name__ for module in cache_receivers(Outer())]
        ['Outer']
    """
    candidates: list[nn.Module] = []
    covered: set[int] = set()  # modules below a candidate
    for module in model.modules():
        if _takes_cache(module) and (id(module) not in covered or _is_pretrained_model(module)):
            candidates.append(module)
            covered.update(id(child) for child in module.modules() if child is not module)
    below = {id(child) for module in candidates for child in module.modules() if child is not module}
    inner = {id(module) for module in candidates if id(module) in below}
    return [
        module
        for module in candidates
        if not any(id(child) in inner for child in module.modules() if child is not module)
    ]


def _takes_cache(module: nn.Module) -> bool:
    """Whether ``module``'s ``forward`` takes a cache argument; decided once per type, unless the module has a
    ``forward`` of its own."""
    if "forward" in vars(module):
        return _forward_takes_cache(module)
    kind = type(module)
    found = _TAKES_CACHE.get(kind)
    if found is None:
        found = _TAKES_CACHE[kind] = _forward_takes_cache(module)
    return found


# Whether each module type's forward takes a cache: the receivers are found at every call that enters a context.
_TAKES_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _forward_takes_cache(module: nn.Module) -> bool:
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):  # a builtin forward
        return False
    return bool(CACHE_ARGUMENTS.intersection(parameters))


def _is_pretrained_model(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers`` ``PreTrainedModel``, told by its classes' names."""
    return any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers") for cls in type(module).__mro__
    )


class _State:
    """One object's attributes, with the items of its lists and dicts and its tensors' versions (the values of the
    small ones)."""

    def __init__(self, obj: Any, cache: str) -> None:
        self.obj = obj
        self.cache = cache
        self.attributes = dict(vars(obj))
        self.lists = {name: list(value) for name, value in self.attributes.items() if isinstance(value, list)}
        self.dicts = {name: dict(value) for name, value in self.attributes.items() if isinstance(value, dict)}
        held = [*self.attributes.values(), *(i for v in self.lists.values() for i in v)]
        held += [item for entries in self.dicts.values() for item in entries.values()]
        self.tensors = [
            (value, _version(value), value.detach().clone() if value.numel() <= SMALL_TENSOR else None)
            for value in held
            if isinstance(value, torch.Tensor)
        ]

    def put_back(self) -> None:
        for name, items in self.lists.items():
            self.attributes[name][:] = items
        for name, entries in self.dicts.items():  # an encoder-decoder cache's flags, set in place
            self.attributes[name].clear()
            self.attributes[name].update(entries)
        vars(self.obj).clear()
        vars(self.obj).update(self.attributes)
        with torch.no_grad():
            for tensor, version, values in self.tensors:
                if _version(tensor) == version:
                    continue
                if values is None:
                    raise RuntimeError(
                        f"LRP: the model wrote the key-value cache it was handed ({self.cache}) in place, in a call "
                        "that runs the model again (its graph is not the one recorded), and its values cannot be "
                        "put back: explain such steps each in a call of its own (outside `with lrp:`), or use a "
                        "cache that appends (DynamicCache)"
                    )
                tensor.copy_(values)


def _version(tensor: torch.Tensor) -> int | None:
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor keeps no version: it cannot have been written by a run with grad
        return None


def held_objects(obj: Any, depth: int = _DEPTH, seen: set[int] | None = None) -> Iterator[Any]:
    """``obj`` and the ``transformers`` objects it holds (directly or in a list, a tuple or a dict), depth first."""
    seen = set() if seen is None else seen
    if id(obj) in seen or not hasattr(obj, "__dict__") or isinstance(obj, (nn.Module, torch.Tensor)):
        return
    seen.add(id(obj))
    yield obj
    if depth == 0:
        return
    for value in vars(obj).values():
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
        for item in items:
            if type(item).__module__.startswith("transformers"):
                yield from held_objects(item, depth - 1, seen)


class KeptCaches:
    """The state of the caches handed to ``receivers`` in a run, noted before they change, to be put back."""

    def __init__(self, receivers: list[nn.Module]) -> None:
        self.receivers = receivers
        self.states: dict[int, list[_State]] = {}

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Note each cache when a receiver is first handed it, for the length of the block: by the hooks of the
        call's watch where one is on in this thread (see :func:`~tdhook.attribution._detached_caches.caches_detached`),
        else by hooks of its own."""
        watch = getattr(ACTIVE_WATCH, "notes", None)
        if watch is not None:
            outer, ACTIVE_WATCH.kept = getattr(ACTIVE_WATCH, "kept", None), self
            try:
                yield
            finally:
                ACTIVE_WATCH.kept = outer
            return
        handles = []
        try:
            for module in self.receivers:  # each listed as it is made: a registration that fails leaves none
                handles.append(module.register_forward_pre_hook(self._note, with_kwargs=True))
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _note(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        for value in (*args, *kwargs.values()):
            if id(value) not in self.states and is_cache(value):
                name = type(value).__name__
                self.states[id(value)] = [_State(obj, name) for obj in held_objects(value)]

    def put_back(self) -> None:
        """Restore every noted cache to its state when noted."""
        for states in self.states.values():
            for state in states:
                state.put_back()
        self.states.clear()
