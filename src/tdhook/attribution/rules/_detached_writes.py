"""Writes in place through a detached alias of a tensor with autograd history (``c.detach().copy_(w)``, ``c.data``).

``c.detach()`` and ``c.data`` share ``c``'s storage without its autograd history: a write into them changes ``c``'s
values where autograd does not see it, and ``c``'s gradient still reaches what ``c`` was computed from before. An
activation overwritten with a weight's values that way was explained as the activation (1.0 off, relative L2,
under AttnLRP), a weight overwritten with an activation's as the weight (11.4 off), since the function modes never
saw a write into ``c``. :func:`note_detached` marks such an alias as the modes make it, and
:func:`raise_for_detached_write` raises at a write into it that changes what ``c`` is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["DETACHED_FROM", "DETACHING", "note_detached", "raise_for_detached_write"]

#: the calls that give a tensor's values without its autograd history: an alias of its storage
DETACHING = frozenset({torch.Tensor.detach, torch.detach, torch.Tensor.data.__get__})
# On such an alias of a tensor with autograd history: that tensor.
DETACHED_FROM = "_tdhook_detached_from"
# In-place methods that write no values into the storage (its shape, strides, flags: ``requires_grad_``,
# ``unsqueeze_``, ``as_strided_``; or another storage, ``set_``).
_NO_VALUES_WRITTEN = frozenset(
    getattr(torch.Tensor, name)
    for name in (
        *("requires_grad_", "as_strided_", "squeeze_", "unsqueeze_", "t_", "transpose_", "swapdims_", "swapaxes_"),
        *("resize_", "resize_as_", "share_memory_", "detach_", "set_", "rename_", "refine_names_"),
    )
    if hasattr(torch.Tensor, name)
)


def note_detached(args: tuple, alias: torch.Tensor) -> None:
    """Mark ``alias``, the result of a call of :data:`DETACHING` on ``args[0]``, as an alias of it where ``args[0]``
    has autograd history (a parameter's ``.data`` is not marked: it has none).

    Examples:
        >>> c = torch.ones(2, requires_grad=True) * 2
        >>> alias = c.detach()
        >>> note_detached((c,), alias)
        >>> getattr(alias, DETACHED_FROM) is c
        True
    """
    source = args[0] if args else None
    if isinstance(source, torch.Tensor) and source.grad_fn is not None:
        setattr(alias, DETACHED_FROM, source)


def raise_for_detached_write(
    func: Any, args: tuple, kwargs: dict, source: torch.Tensor, is_activation: Callable[[Any], bool]
) -> None:
    """Raise for ``func(*args, **kwargs)``, an in-place write into an alias of ``source`` (see :func:`note_detached`),
    where it writes values and ``source`` is an activation or an activation is written (``is_activation`` tells). A
    weight's values written over a weight leave it one (``c.detach().mul_(2)``), and pass.

    Examples:
        >>> from tdhook.attribution.rules._autograd import is_activation, mark_parameter_derived
        >>> weight = torch.nn.Parameter(torch.ones(2))
        >>> c = mark_parameter_derived((weight,), weight * 2)  # a weight, to the rules
        >>> raise_for_detached_write(torch.Tensor.mul_, (c.detach(), 2), {}, c, is_activation)  # passes
        >>> h = torch.ones(2, requires_grad=True) * 2  # an activation
        >>> raise_for_detached_write(torch.Tensor.mul_, (h.detach(), 2), {}, h, is_activation)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        RuntimeError: LRP: mul_ writes in place into a detached alias ...
    """
    if func in _NO_VALUES_WRITTEN:
        return
    written = [
        tensor
        for arg in (*args[1:], *kwargs.values())
        for tensor in (arg if isinstance(arg, (list, tuple)) else (arg,))
        if isinstance(tensor, torch.Tensor)
    ]
    if is_activation(source) or any(is_activation(tensor) for tensor in written):
        name = getattr(func, "__name__", repr(func))
        raise RuntimeError(
            f"LRP: {name} writes in place into a detached alias (`c.detach()`, `c.data`) of a tensor with autograd "
            "history: autograd does not see the write, and the tensor's gradient still reaches what its values were "
            "computed from before it, so its relevance would be wrong. Write into the tensor itself "
            "(`c.copy_(w)`), or build the new values out of place"
        )
