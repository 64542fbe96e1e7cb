"""The caller's hooks that change a gradient: refused by name, as relevance is input × modified gradient.

A backward hook that returns a gradient replaces the one passing through: a module's
``register_full_backward_hook`` or ``register_full_backward_pre_hook`` (or torch's global forms,
``register_module_full_backward_hook``), and a hook put on a tensor by the model's own forward
(``h.register_hook(lambda g: g.clamp(-1, 1))``, a gradient clip or scale in a world model). Every rule acts on the
gradient, so such a change would be taken into the relevance: a hook halving the gradient at a small MLP's hidden
layer halved ``EpsilonPlus``'s relevance, with no word. The watched first call of a wrapper (see
:class:`~tdhook.attribution._nonlinear_calls.NonlinearCalls`) runs these hooks through :func:`checked`, which raises
where one returns a gradient other than the one it was given, or changes the one it was given in place
(``grad.mul_(2)``, or through ``grad.data``: seen by its values); a hook that only reads the gradient (a Grad-CAM
recorder) returns ``None`` and is let be. torch takes a module's backward hooks when its forward runs, so swapping
them for the forward pass of that call is enough.

Examples:
    >>> import torch
    >>> halve = checked(lambda grad: grad * 0.5, lambda *args: "a hook", refused=lambda: None)
    >>> y = torch.ones(2, requires_grad=True) * 1
    >>> _ = y.register_hook(halve)
    >>> y.sum().backward()  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: LRP: a hook returns a gradient other than the one it was given: relevance is input × modified ...
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module

__all__ = ["backward_hooks_checked", "checked", "is_ours", "tensor_hook_checked"]

_ADVICE = (
    "relevance is input × modified gradient, so the hook's change would be taken into the relevance. Make the hook "
    "return None while explaining (a hook that only reads the gradient is fine), or remove it"
)
# The same for an attribution method of the gradient family (Saliency, IntegratedGradients, ...).
_METHOD_ADVICE = (
    "the attribution is made of the model's gradient, so the hook's change would be taken into it (its "
    "gradient is no longer the derivative of the output). Make the hook return None while explaining (a hook "
    "that only reads the gradient is fine), or remove it"
)


def is_ours(hook: Any) -> bool:
    """Whether ``hook`` is one of this package's (by the module defining it, or its function's)."""
    hook = hook.func if isinstance(hook, functools.partial) else hook
    return getattr(hook, "__module__", None) is not None and hook.__module__.startswith("tdhook.")


def _changed(given: Any, returned: Any) -> bool:
    """Whether a hook given ``given`` (a gradient, or a tuple of them) returned another gradient."""
    if returned is None or returned is given:
        return False
    if isinstance(given, tuple) and isinstance(returned, (tuple, list)) and len(given) == len(returned):
        return any(r is not g for g, r in zip(given, returned, strict=True))
    return True


def _tensors(given: Any) -> tuple[torch.Tensor, ...]:
    """The gradients ``given`` to a hook (a tensor, or a tuple with ``None`` entries)."""
    grads = given if isinstance(given, tuple) else (given,)
    return tuple(grad for grad in grads if isinstance(grad, torch.Tensor))


def _snapshot(given: Any) -> tuple | None:
    """The values of the gradients ``given`` to a hook, to tell a write into them (by their values: a write through
    ``grad.data`` leaves the version counter as it was, and one that writes the same values changes nothing);
    ``None`` where they cannot be read (a batched gradient under a function transform)."""
    try:
        return tuple(grad.detach().clone() for grad in _tensors(given))
    except RuntimeError:
        return None


def _written(given: Any, snapshot: tuple | None) -> bool:
    """Whether the gradients ``given`` to a hook changed since ``snapshot`` (NaN equal to NaN)."""
    if snapshot is None:
        return False
    grads = _tensors(given)
    return not all(
        bool(((grad == value) | (grad.isnan() & value.isnan())).all())
        for grad, value in zip(grads, snapshot, strict=True)
    )


def checked(hook: Callable, what: Callable[..., str], refused: Callable[[], None], owner: str = "LRP") -> Callable:
    """``hook``, raising where it returns a gradient other than the one it was given, or writes into the one it was
    given (an in-place change, which the relevance would take as well).

    Args:
        hook: the caller's hook: a tensor's (``grad``), or a module's (``module, grad_input, grad_output`` or
            ``module, grad_output``), whose second argument is what it may replace.
        what: the hook and where it is, for the error, from the hook's arguments
            (``"the full backward hook f registered on module 'a' (Linear)"``).
        refused: called before raising (the next call of the wrapper then checks again).
        owner: the wrapper whose call runs the hook (``"LRP"``, or a method's name), for the error.
    """
    advice = _ADVICE if owner == "LRP" else _METHOD_ADVICE

    @functools.wraps(hook)
    def hook_checked(*args: Any) -> Any:
        given = args[1] if len(args) > 1 else args[0]
        before = _snapshot(given)
        returned = hook(*args)
        if _changed(given, returned):
            refused()
            raise ValueError(f"{owner}: {what(*args)} returns a gradient other than the one it was given: {advice}")
        if _written(given, before):
            refused()
            raise ValueError(f"{owner}: {what(*args)} changes the gradient it was given in place: {advice}")
        return returned

    return hook_checked


def tensor_hook_checked(hook: Callable, where: str, module: nn.Module | None, refused: Callable[[], None]) -> Callable:
    """``hook``, put on a tensor by the forward of module ``where`` (the model itself: ``""``), checked as by
    :func:`checked`."""
    place = f"{_place(where)} ({type(module).__name__})" if module is not None else _place(where)
    what = f"a hook that {place} puts on a tensor in its own forward (tensor.register_hook: {_name(hook)})"
    return checked(hook, lambda *args: what, refused)


def _name(hook: Any) -> str:
    hook = hook.func if isinstance(hook, functools.partial) else hook
    return getattr(hook, "__qualname__", None) or type(hook).__name__


def _place(name: str) -> str:
    return f"module {name!r}" if name else "the model itself"


_KINDS = {"_backward_hooks": "backward hook", "_backward_pre_hooks": "backward pre-hook"}
_GLOBAL = {
    "_global_backward_hooks": "register_module_full_backward_hook",
    "_global_backward_pre_hooks": "register_module_full_backward_pre_hook",
}


@contextlib.contextmanager
def backward_hooks_checked(
    modules: Mapping[str, nn.Module], refused: Callable[[], None], owner: str = "LRP"
) -> Iterator[None]:
    """Inside the block, the backward hooks and pre-hooks on ``modules``, and torch's global ones, are
    :func:`checked` in the calls of the modules made in it (torch takes a module's backward hooks when it runs).

    Args:
        modules: the model's modules by name.
        refused: called before a hook's error is raised.
        owner: the wrapper whose call runs the hooks, for the error (see :func:`checked`).
    """
    swapped: list[tuple[dict, Any, Callable]] = []
    names = {id(m): name for name, m in modules.items()}
    try:
        for name, module in modules.items():
            for attribute, kind in _KINDS.items():
                hooks = getattr(module, attribute)
                full = "full " if attribute == "_backward_pre_hooks" or module._is_full_backward_hook else ""
                for key, hook in list(hooks.items()):
                    what = f"the {full}{kind} {_name(hook)} registered on {_place(name)} ({type(module).__name__})"
                    _swap(hooks, key, checked(hook, lambda *args, w=what: w, refused, owner), swapped)
        for attribute, registration in _GLOBAL.items():
            hooks = getattr(torch_module, attribute)
            for key, hook in list(hooks.items()):
                what = functools.partial(_global_hook, f"a global hook ({registration}: {_name(hook)})", names)
                _swap(hooks, key, _for_modules(hook, checked(hook, what, refused, owner), names), swapped)
        yield
    finally:
        for hooks, key, hook in reversed(swapped):
            if key in hooks:
                hooks[key] = hook


def _global_hook(what: str, names: Mapping[int, str], module: nn.Module, *grads: Any) -> str:
    return f"{what}, called on {_place(names[id(module)])} ({type(module).__name__}),"


def _swap(hooks: dict, key: Any, hook_checked: Callable, swapped: list) -> None:
    """Put ``hook_checked`` in ``hooks`` at ``key`` in place (unless the hook there is this package's own)."""
    if not is_ours(hooks[key]):
        swapped.append((hooks, key, hooks[key]))
        hooks[key] = hook_checked


def _for_modules(hook: Callable, hook_checked: Callable, only: Mapping) -> Callable:
    """A global hook checked for the modules in ``only`` (other threads' modules run it as it is)."""

    @functools.wraps(hook)
    def dispatch(module: nn.Module, *args: Any) -> Any:
        return (hook_checked if id(module) in only else hook)(module, *args)

    return dispatch
