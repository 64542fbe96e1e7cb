"""Hooks of tdhook's that a failure left on the model with no handle to remove them.

torch puts a hook into the module's (or tensor's) dict before it returns the handle: ``register_forward_hook``
writes its ``with_kwargs`` and ``always_call`` companions after the hook, and a subclass's registration may do more
after torch's. An error or an interrupt between the insertion and the moment tdhook lists the handle leaves a hook
that no list holds, and that removing the listed ones misses. A :class:`HooksMade` notes the id of every hook made in
its thread while it is open (torch's ``RemovableHandle`` takes its id when the registration starts; its ``__init__`` is
wrapped only while a record is open in some thread, and torch's own is back once the last one closes): after a failure,
those whose callable is tdhook's own (a function, method, partial or callable object defined in ``tdhook``) and that
no list of the context holds are taken out of every module's hook dicts and of its parameters' and buffers' tensor
hooks. Hooks of the model's own or of other libraries are never touched, and neither are those another thread made
meanwhile on the same model (another wrapper's context, a ``GradCAM`` call): their ids are not noted.

Examples:
    >>> from torch import nn
    >>> layer = nn.Linear(2, 2)
    >>> with HooksMade() as made:
    ...     _ = layer.register_forward_hook(orphans_removed, with_kwargs=True)  # its handle lost
    >>> remove_orphans([layer], made.ids)
    >>> len(layer._forward_hooks), len(layer._forward_hooks_with_kwargs)
    (0, 0)
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator

from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["HooksMade", "is_ours", "listed_hook_ids", "noting_installed", "orphans_removed", "remove_orphans"]

_TENSOR_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")

_OPEN = threading.local()  # per thread: weak references to its open HooksMade (``records``)
_LIVE: set[weakref.ref] = set()  # the open HooksMade of every thread: the noting is installed while there is one
# Held to open and close a record (its install or restore of the noting with it); re-entrant: a record the garbage
# collector takes while the lock is held in its thread closes there.
_NOTING = threading.RLock()
_inner: Callable = RemovableHandle.__init__  # what the noting calls: the ``__init__`` it replaced (torch's)
_above: Callable | None = None  # an ``__init__`` put over the noting by someone else (it calls the noting)
_PRUNED_AT = 8  # records (open or collected) in a thread's list from which the collected ones are dropped


def _noting_init(handle: RemovableHandle, *args: object, **kwargs: object) -> None:
    """torch's ``RemovableHandle.__init__``, then the handle's id noted in each :class:`HooksMade` open in the thread
    (one attribute read where none is)."""
    _inner(handle, *args, **kwargs)
    records = getattr(_OPEN, "records", None)
    if records:
        for reference in records:
            record = reference()
            if record is not None:
                record.ids.add(handle.id)


def _install() -> None:
    """Put the noting in place of ``RemovableHandle.__init__`` (with :data:`_NOTING` held)."""
    global _inner
    current = RemovableHandle.__dict__["__init__"]
    if current is not _noting_init and current is not _above:
        _inner = current
        RemovableHandle.__init__ = _noting_init  # type: ignore[method-assign]


def _closed(reference: weakref.ref) -> None:
    """A record closed or collected: the last one of the process puts back the ``__init__`` the noting replaced."""
    global _above
    with _NOTING:
        _LIVE.discard(reference)
        if not _LIVE:
            current = RemovableHandle.__dict__["__init__"]
            if current is _noting_init:
                RemovableHandle.__init__ = _inner  # type: ignore[method-assign]
            elif current is not _inner:  # another wrapper put over the noting meanwhile calls it: left in place
                _above = current


def noting_installed() -> bool:
    """Whether torch's ``RemovableHandle.__init__`` notes hook ids now (only while a :class:`HooksMade` is open).

    Examples:
        >>> noting_installed()
        False
        >>> with HooksMade():
        ...     noting_installed()
        True
        >>> noting_installed()
        False
    """
    return RemovableHandle.__dict__["__init__"] is _noting_init


class HooksMade:
    """The ids of the hooks made in this thread while it is open: the hooks a failure there may have left without a
    handle, and none of another thread's. It is open from :meth:`open` until :meth:`close`, which its block calls
    inside the part that a failure undoes (an interrupt in it is such a failure), or until it is garbage collected
    (a close that was itself interrupted).

    While one is open in any thread, torch's ``RemovableHandle.__init__`` is wrapped to note the ids (each handle
    takes its id as the registration starts); the last one closed puts torch's back, so that outside tdhook's calls
    and the entering of its contexts, torch's hooks are registered as torch registers them.

    Examples:
        >>> from torch import nn
        >>> layer = nn.Linear(2, 2)
        >>> with HooksMade() as made:
        ...     handle = layer.register_forward_hook(is_ours)
        >>> made.ids == {handle.id}
        True
    """

    __slots__ = ("__weakref__", "_reference", "ids")

    def __init__(self) -> None:
        self.ids: set[int] = set()
        self._reference: weakref.ref | None = None

    def open(self) -> HooksMade:
        """Start noting (returns ``self``)."""
        reference = self._reference = weakref.ref(self, _closed)
        with _NOTING:
            _LIVE.add(reference)  # before the install: a record collected meanwhile leaves the noting in place
            _install()
        records = getattr(_OPEN, "records", None)
        if records is None:
            records = _OPEN.records = []
        elif len(records) >= _PRUNED_AT:  # the collected ones out, now and then (a call's dies when it returns)
            records[:] = [reference for reference in records if reference() is not None]
        records.append(reference)
        return self

    def close(self) -> None:
        """Stop noting."""
        records = getattr(_OPEN, "records", [])
        records[:] = [reference for reference in records if reference() not in (self, None)]
        reference, self._reference = self._reference, None  # no call back when it is collected
        if reference is not None:
            _closed(reference)

    def __enter__(self) -> HooksMade:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def is_ours(hook: object) -> bool:
    """Whether ``hook`` is tdhook's: a function, bound method or callable object defined in ``tdhook``, possibly
    wrapped in ``functools.partial``.

    Examples:
        >>> is_ours(remove_orphans), is_ours(functools.partial(remove_orphans)), is_ours(print)
        (True, True, False)
    """
    while isinstance(hook, functools.partial):
        hook = hook.func
    hook = getattr(hook, "__func__", hook)  # a bound method: its function
    module = getattr(hook, "__module__", None)
    if not isinstance(module, str):
        module = type(hook).__module__
    return module == "tdhook" or module.startswith("tdhook.")


def _orphans_in(dicts: list[dict], made: Collection[int], listed: Collection[int]) -> set[int]:
    return {
        hook_id
        for hooks in dicts
        for hook_id, hook in hooks.items()
        if hook_id in made and hook_id not in listed and callable(hook) and is_ours(hook)
    }


def _drop(dicts: list[dict], orphans: set[int]) -> None:
    for hooks in dicts:  # the companions (with_kwargs, always_call) share their hook's id
        for hook_id in orphans.intersection(hooks):
            del hooks[hook_id]


def remove_orphans(modules: Iterable[nn.Module], made: Collection[int], listed: Collection[int] = ()) -> None:
    """Remove from ``modules`` (and their own parameters' and buffers' tensors) the hooks of tdhook's whose ids are in
    ``made`` and not in ``listed`` (the ids of the hooks a list of the context still holds).

    Args:
        modules: the model's modules.
        made: the ids of the hooks made by the failing block (:attr:`HooksMade.ids`), in its thread.
        listed: ids of hooks to keep (held by an open context, removed when it closes).
    """
    if not made:  # nothing registered: nothing to look for
        return
    for module in modules:
        dicts = [hooks for key, hooks in vars(module).items() if "hooks" in key and isinstance(hooks, dict)]
        _drop(dicts, _orphans_in(dicts, made, listed))
        for tensor in [*module._parameters.values(), *module._buffers.values()]:
            tensor_dicts = [getattr(tensor, key, None) for key in _TENSOR_HOOKS] if tensor is not None else []
            tensor_dicts = [hooks for hooks in tensor_dicts if isinstance(hooks, dict) and hooks]
            if tensor_dicts:
                _drop(tensor_dicts, _orphans_in(tensor_dicts, made, listed))


def listed_hook_ids(listed: Iterable[object]) -> set[int]:
    """The ids of the hooks that ``listed`` (torch handles, rule handles, objects holding ``hook_ids``) holds."""
    ids: set[int] = set()
    for item in listed:
        if isinstance(item, RemovableHandle):
            ids.add(item.id)
        ids.update(getattr(item, "hook_ids", ()))
        handles = getattr(item, "hook_handles", None)
        if callable(handles):
            ids.update(handle.id for handle in handles())
    return ids


@contextlib.contextmanager
def orphans_removed(modules: Callable[[], Iterable[nn.Module]], listed: Callable[[], Iterable[object]]) -> Iterator:
    """On a failure of the block (an error, an interrupt), :func:`remove_orphans` from ``modules()`` the hooks made
    in the block that ``listed()`` (what the context holds then) does not hold; then the failure goes on.

    Examples:
        >>> layer = nn.Linear(2, 2)
        >>> try:
        ...     with orphans_removed(lambda: [layer], list):
        ...         _ = layer.register_forward_pre_hook(is_ours)
        ...         raise KeyboardInterrupt
        ... except KeyboardInterrupt:
        ...     len(layer._forward_pre_hooks)
        0
    """
    made = HooksMade()  # open until the block ends
    try:
        made.open()
        yield
        made.close()
    except BaseException:
        remove_orphans(modules(), made.ids, listed_hook_ids(listed()))
        made.close()  # not left to the traceback, which holds it
        raise
