"""Hooks of tdhook's that a failure left on the model with no handle to remove them.

torch puts a hook into the module's (or tensor's) dict before it returns the handle: ``register_forward_hook``
writes its ``with_kwargs`` and ``always_call`` companions after the hook, and a subclass's registration may do more
after torch's. An error or an interrupt between the insertion and the moment tdhook lists the handle leaves a hook
that no list holds, and that removing the listed ones misses. Every hook takes the next id of torch's
``RemovableHandle`` counter, so the hooks made since a point are those whose id is at least the counter's value
then: after a failure, those whose callable is tdhook's own (a function, method, partial or callable object defined
in ``tdhook``) and that no list of the context holds are taken out of every module's hook dicts and of its
parameters' and buffers' tensor hooks. Hooks of the model's own or of other libraries are never touched.

Examples:
    >>> from torch import nn
    >>> layer, since = nn.Linear(2, 2), next_hook_id()
    >>> _ = layer.register_forward_hook(orphans_removed, with_kwargs=True)  # its handle lost
    >>> remove_orphans([layer], since)
    >>> len(layer._forward_hooks), len(layer._forward_hooks_with_kwargs)
    (0, 0)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Collection, Iterable, Iterator

from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["is_ours", "listed_hook_ids", "next_hook_id", "orphans_removed", "remove_orphans"]

_TENSOR_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")


def next_hook_id() -> int:
    """The id torch gives the next hook registered (any hook made later has this id or a larger one)."""
    return RemovableHandle.next_id


def is_ours(hook: object) -> bool:
    """Whether ``hook`` is tdhook's: a function, bound method or callable object defined in ``tdhook``, possibly
    wrapped in ``functools.partial``.

    Examples:
        >>> is_ours(next_hook_id), is_ours(functools.partial(next_hook_id)), is_ours(print)
        (True, True, False)
    """
    while isinstance(hook, functools.partial):
        hook = hook.func
    hook = getattr(hook, "__func__", hook)  # a bound method: its function
    module = getattr(hook, "__module__", None)
    if not isinstance(module, str):
        module = type(hook).__module__
    return module == "tdhook" or module.startswith("tdhook.")


def _orphans_in(dicts: list[dict], since: int, listed: Collection[int]) -> set[int]:
    return {
        hook_id
        for hooks in dicts
        for hook_id, hook in hooks.items()
        if isinstance(hook_id, int) and hook_id >= since and hook_id not in listed and callable(hook) and is_ours(hook)
    }


def _drop(dicts: list[dict], orphans: set[int]) -> None:
    for hooks in dicts:  # the companions (with_kwargs, always_call) share their hook's id
        for hook_id in orphans.intersection(hooks):
            del hooks[hook_id]


def remove_orphans(modules: Iterable[nn.Module], since: int, listed: Collection[int] = ()) -> None:
    """Remove from ``modules`` (and their own parameters' and buffers' tensors) the hooks of tdhook's made since the
    hook id ``since`` that are not in ``listed`` (the ids of the hooks a list of the context still holds).

    Args:
        modules: the model's modules.
        since: :func:`next_hook_id` before the hooks were made.
        listed: ids of hooks to keep (held by an open context, removed when it closes).
    """
    if next_hook_id() <= since:  # nothing registered since: nothing to look for
        return
    for module in modules:
        dicts = [hooks for key, hooks in vars(module).items() if "hooks" in key and isinstance(hooks, dict)]
        _drop(dicts, _orphans_in(dicts, since, listed))
        for tensor in [*module._parameters.values(), *module._buffers.values()]:
            tensor_dicts = [getattr(tensor, key, None) for key in _TENSOR_HOOKS] if tensor is not None else []
            tensor_dicts = [hooks for hooks in tensor_dicts if isinstance(hooks, dict) and hooks]
            if tensor_dicts:
                _drop(tensor_dicts, _orphans_in(tensor_dicts, since, listed))


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
        ...         _ = layer.register_forward_pre_hook(next_hook_id)
        ...         raise KeyboardInterrupt
        ... except KeyboardInterrupt:
        ...     len(layer._forward_pre_hooks)
        0
    """
    since = next_hook_id()
    try:
        yield
    except BaseException:
        remove_orphans(modules(), since, listed_hook_ids(listed()))
        raise
