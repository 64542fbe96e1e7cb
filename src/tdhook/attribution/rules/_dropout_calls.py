"""Dropout called as a function (attention dropout, mostly): whether a call drops, and a watch over a forward pass.

A Dropout module in training mode is found among a model's modules. Dropout called as a function is seen only in a
forward pass: transformers' eager attention calls ``F.dropout(weights, p, training=module.training)`` and its
sdpa attention passes ``dropout_p`` to ``F.scaled_dot_product_attention``, with no module of its own (a Llama
with ``attention_dropout`` holds no ``nn.Dropout``). :class:`DropoutCalls` watches a pass for such calls that
drop.

Examples:
    >>> import torch
    >>> import torch.nn.functional as F
    >>> with DropoutCalls() as watch:
    ...     _ = F.dropout(torch.ones(3), 0.0) + F.dropout(torch.ones(3), 0.25, training=False)
    >>> watch.found
    0.0
    >>> with DropoutCalls() as watch:
    ...     _ = F.scaled_dot_product_attention(*torch.ones(3, 1, 2, 4), dropout_p=0.1)
    >>> watch.found
    0.1
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from tdhook.attribution.rules._autograd import call_argument
from tdhook.attribution.rules._caller import warn_at_caller

__all__ = [
    "DROPOUTS",
    "DropoutCalls",
    "dropout_probability",
    "dropout_watch",
    "named_by_module",
    "warn_random_dropout",
]

# Dropout as a function: its keyword that says whether it drops, by function.
DROPOUTS = {F.dropout: "training", F.dropout1d: "training", F.dropout2d: "training", F.dropout3d: "training"}
DROPOUTS |= {F.alpha_dropout: "training", F.feature_alpha_dropout: "training", torch.dropout: "train"}
# The ATen operators, called through ``torch.ops`` (``(input, p, train)``; ``native_dropout``'s ``train`` may be
# ``None``: it drops). No rule acts on them: they are only watched for.
_ATEN = torch.ops.aten
_OPERATOR_DROPOUTS = frozenset(
    op
    for packet in (_ATEN.dropout, _ATEN.feature_dropout, _ATEN.alpha_dropout, _ATEN.feature_alpha_dropout)
    for op in (packet, packet.default)
) | {_ATEN.native_dropout, _ATEN.native_dropout.default}


def dropout_probability(func: Callable, args: tuple, kwargs: dict) -> float:
    """The probability with which a call of ``func`` drops a unit: its ``p`` (``dropout_p`` for the fused attention)
    where it drops, ``0`` where it does not (``training=False``) or is no dropout.

    Examples:
        >>> x = torch.ones(2)
        >>> dropout_probability(F.dropout, (x, 0.3), {}), dropout_probability(F.dropout, (x, 0.3), {"training": False})
        (0.3, 0.0)
        >>> dropout_probability(torch.dropout, (x, 0.3, True), {}), dropout_probability(torch.relu, (x,), {})
        (0.3, 0.0)
    """
    if func in DROPOUTS:
        dropping = call_argument(args, kwargs, 2, DROPOUTS[func], func is not torch.dropout)
        return float(call_argument(args, kwargs, 1, "p", 0.5)) if dropping else 0.0
    if func in _OPERATOR_DROPOUTS:
        dropping = call_argument(args, kwargs, 2, "train", None)
        return float(call_argument(args, kwargs, 1, "p", 0.5)) if dropping is None or dropping else 0.0
    if func is F.scaled_dot_product_attention:
        return float(call_argument(args, kwargs, 4, "dropout_p", 0.0))
    return 0.0


class DropoutCalls(TorchFunctionMode):
    """A function mode that watches the block for dropout calls that drop; it changes no call.

    Attributes:
        found: the probability of the first such call, ``0`` while there is none.
    """

    def __init__(self) -> None:
        super().__init__()
        self.found = 0.0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.found:
            self.found = dropout_probability(func, args, kwargs)
        return func(*args, **kwargs)


def dropout_watch(modules: Iterable[nn.Module]) -> contextlib.AbstractContextManager[DropoutCalls | None]:
    """A :class:`DropoutCalls` where one of ``modules`` is in training mode (a model in eval mode passes its mode to
    the dropout it calls, and runs its passes without the watch's cost); else a block that yields ``None``.

    Examples:
        >>> with dropout_watch(nn.Linear(2, 2).eval().modules()) as watch:
        ...     pass
        >>> watch is None
        True
    """
    if any(module.training for module in modules):
        return DropoutCalls()
    return contextlib.nullcontext()


def named_by_module(p: float) -> bool:
    """Whether a dropout call that drops with probability ``p`` runs in the forward of a module the wrappers name
    when it draws (see :func:`~tdhook.attribution._random_modules.draw`): an ``nn.MultiheadAttention`` with a
    dropout of its own, or a module whose child drops with ``p`` (an attention passing its ``attn_drop.p`` to the
    fused attention). The nearest module on the call stack decides; a function called outside any module's forward
    is named by none.

    Examples:
        >>> class Attention(nn.Module):
        ...     def __init__(self) -> None:
        ...         super().__init__()
        ...         self.attn_drop = nn.Dropout(0.5)
        ...
        ...     def forward(self, p: float) -> bool:
        ...         return named_by_module(p)
        >>> attention = Attention()
        >>> attention(0.5), attention(0.25), attention.eval()(0.5), named_by_module(0.5)
        (True, False, False, False)
    """
    from tdhook.attribution._random_modules import draws_now, drop_probability  # imports the rules

    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_locals.get("self")
        if isinstance(module, nn.Module):
            return draws_now(module) or any(draws_now(c) and drop_probability(c) == p for c in module.children())
        frame = frame.f_back
    return False


def warn_random_dropout(p: float) -> None:
    """Warn that a dropout call drops (``p > 0``): the explanation is random from call to call, as for a
    ``Dropout`` module in training mode (under CP-LRP the dropped attention weights are held constant, but they
    still differ from call to call). A call in the forward of a module the wrapper names when it draws (an
    ``nn.MultiheadAttention``'s attention dropout) is left to that warning.

    Examples:
        >>> warn_random_dropout(0.0)  # no dropout: nothing to say
    """
    if p and not named_by_module(p):
        warn_at_caller(
            f"LRP: the forward pass calls dropout (p={p}) in training mode, outside any Dropout module (attention "
            "dropout, mostly), so each forward pass drops other units and the explanation is random from call to "
            "call; call .eval() on the model for a deterministic one"
        )
