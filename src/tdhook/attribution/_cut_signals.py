"""Parts of the signal computed without gradient and added back to it: relevance that the pass cannot follow.

A forward that computes part of its hidden state from the explained inputs under ``torch.no_grad()`` or through
``.detach()``, then adds it back to a tensor that has a gradient (``h + f(h).detach()``, a recurrence whose early
steps run without gradient, ``torch.cat([h, f(h).detach()])``), gives the relevance pass a constant where the
value came from the inputs: the relevance that reaches that part stops there, as a bias's does, and the input
relevance no longer sums to the target (0.66 to 1.09 of it on a two-layer net, -35 where the part cancels the
rest). A product with such a part (a gate, a held scale) is not one: its relevance passes through the other factor.

:class:`CutSignals` follows the calls of one watched forward pass (see
:class:`~tdhook.attribution._nonlinear_calls.NonlinearCalls`): it marks each floating-point tensor computed from the
signal without gradient (a ``detach`` of it, a call on it under ``no_grad``, and what is computed from those without
joining the graph again: ``f(h).detach() * 2``, a layer run on it), and finds the sums and joins of a marked tensor
with one that has a gradient from the inputs.

Examples:
    >>> import torch
    >>> x = torch.randn(3, requires_grad=True)
    >>> h = x * 2
    >>> found = CutSignals()
    >>> cut = h.detach()
    >>> found.note(torch.Tensor.detach, (h,), cut)
    >>> found.note(torch.Tensor.__add__, (h, cut), h + cut)
    'a part computed from the inputs without gradient, added back (h + f(h).detach(), under torch.no_grad())'
    >>> found.note(torch.Tensor.__mul__, (h, cut), h * cut)  # a held factor: its relevance passes through h
    >>> found.forget()
    >>> cut.__dict__
    {}
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from tdhook.attribution._straight_through import SUMS, held_activations
from tdhook.attribution.rules._autograd import is_activation
from tdhook.attribution.rules._in_place_writes import WRITES_IN_PLACE

__all__ = ["CUT_SIGNAL", "CutSignals"]

#: the name under which a module's sums with a part of the signal computed without gradient are counted
CUT_SIGNAL = "a part computed from the inputs without gradient, added back (h + f(h).detach(), under torch.no_grad())"

_CUT = "_tdhook_cut_signal"  # on a tensor: computed from the signal without gradient

_T = torch.Tensor
_DETACHES = frozenset({_T.detach, torch.detach})
# Sums and joins: every operand's relevance is its own share of the result's.
_JOINS = SUMS | {_T.__rsub__, torch.cat, torch.concat, torch.concatenate, torch.stack, torch.hstack, torch.vstack}


def _is_signal(value: Any) -> bool:
    """Whether ``value`` carries the signal with its gradient: an activation, or an explained input itself (a leaf
    that requires grad and is no parameter)."""
    if is_activation(value):
        return True
    return (
        isinstance(value, torch.Tensor)
        and value.requires_grad
        and value.is_leaf
        and not isinstance(value, torch.nn.Parameter)
    )


def _operands(args: tuple) -> list[Any]:
    """The tensors among ``args``, and within a list or tuple argument (the tensors ``torch.cat`` joins)."""
    found: list[Any] = []
    for arg in args:
        if isinstance(arg, (list, tuple)):
            found.extend(arg)
        else:
            found.append(arg)
    return found


def _reads_values(func: Any) -> bool:
    """Whether ``func``'s result depends on its arguments' values: ``zeros_like``, ``new_ones`` and their kind read
    only a shape, a dtype and a device."""
    name = getattr(func, "__name__", "")
    return not (name.endswith("_like") or name.startswith("new_"))


def _copies_of_the_rest(cut: list[torch.Tensor], operands: list[Any]) -> bool:
    """Whether each part in ``cut`` is a detached copy of an activation the other operands hold (``h + h.detach()``,
    a gradient scaling's ``x * s + x.detach()``): such sums are those of
    :class:`~tdhook.attribution._straight_through.StraightThrough`, which names the estimators and scalings among
    them."""
    held: set[int] = set()
    for operand in operands:
        if not any(operand is part for part in cut):
            held |= held_activations(operand)
    return all((copied := held_activations(part)) and copied <= held for part in cut)


class CutSignals:
    """Finds, among the calls it is told of, the sums and joins of the signal with a part of it computed without
    gradient.

    The marks it puts on tensors last until :meth:`forget` (the end of the watched call).
    """

    def __init__(self) -> None:
        self._marked: list[weakref.ref] = []

    def _mark(self, result: Any, module_output: bool = False) -> None:
        for tensor in result if isinstance(result, (list, tuple)) else (result,):
            if (
                isinstance(tensor, torch.Tensor)
                and tensor.is_floating_point()
                and (module_output or not _is_signal(tensor))
            ):
                tensor.__dict__[_CUT] = True
                self._marked.append(weakref.ref(tensor))

    def forget(self) -> None:
        """Take the marks off the tensors that are still alive."""
        for ref in self._marked:
            tensor = ref()
            if tensor is not None:
                tensor.__dict__.pop(_CUT, None)
        self._marked.clear()

    def note_module(self, args: tuple, output: Any) -> None:
        """Mark the output of a module call on the signal under ``no_grad``, or on a part computed without gradient
        and no signal (a layer run on it): a rule may keep the module's own calls from the watch."""
        signal = any(_is_signal(t) for t in args)
        if (signal and not torch.is_grad_enabled()) or (
            not signal and any(isinstance(t, torch.Tensor) and t.__dict__.get(_CUT, False) for t in args)
        ):
            self._mark(output, module_output=True)  # a rule's Function may give it autograd history of its own

    def note(self, func: Any, args: tuple, result: Any) -> str | None:
        """Mark ``result`` where it is computed from the signal without gradient; :data:`CUT_SIGNAL` where the call
        sums or joins such a part with the signal, else ``None``."""
        if not args:
            return None
        if func in _DETACHES:
            if _is_signal(args[0]):
                self._mark(result)
            return None
        operands = _operands(args)
        cut = [t for t in operands if isinstance(t, torch.Tensor) and t.__dict__.get(_CUT, False)]
        joined = func in _JOINS and cut and torch.is_grad_enabled() and any(_is_signal(t) for t in operands)
        if joined and not _copies_of_the_rest(cut, operands):
            return CUT_SIGNAL
        if not _reads_values(func) or func in WRITES_IN_PLACE:
            # A write in place changes state the model keeps (a running mean updated under no_grad), not marked.
            return None
        if cut and not _is_signal(result if not isinstance(result, (list, tuple)) or not result else result[0]):
            self._mark(result)  # computed from a cut part without joining the signal again (a layer run on it)
        elif not torch.is_grad_enabled() and any(_is_signal(t) for t in operands):
            self._mark(result)  # a call on the signal under no_grad
        return None
