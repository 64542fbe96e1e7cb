"""Parts of the signal computed without gradient and added back to it: relevance that the pass cannot follow.

A forward that computes part of its hidden state from the explained inputs under ``torch.no_grad()`` or through
``.detach()``, then adds it back to a tensor that has a gradient (``h + f(h).detach()``, a recurrence whose early
steps run without gradient, ``torch.cat([h, f(h).detach()])``), gives the relevance pass a constant where the
value came from the inputs: the relevance that reaches that part stops there, as a bias's does, and the input
relevance no longer sums to the target (0.66 to 1.09 of it on a two-layer net, -35 where the part cancels the
rest). A product with such a part (a gate, a held scale) is not one: its relevance passes through the other factor.

:class:`CutSignals` follows the calls of one watched forward pass (see
:class:`~tdhook.attribution._nonlinear_calls.NonlinearCalls`): it marks each floating-point tensor computed from the
signal without gradient (a ``detach`` of it, the signal itself after ``detach_()``, a call on it under ``no_grad``,
and what is computed from those without joining the graph again: ``f(h).detach() * 2``, a layer run on it), and finds
the sums and joins of a marked tensor with one that has a gradient from the inputs.

Examples:
    >>> import torch
    >>> x = torch.randn(3, requires_grad=True)
    >>> h = x * 2
    >>> found = CutSignals()
    >>> cut = h.detach()
    >>> found.note(torch.Tensor.detach, (h,), cut)
    >>> total = h + cut
    >>> found.note(torch.Tensor.__add__, (h, cut), total) == (total, frozenset())  # the sum, no shift
    True
    >>> found.note(torch.Tensor.__mul__, (h, cut), h * cut)  # a held factor: its relevance passes through h
    >>> found.forget()
    >>> cut.__dict__
    {}
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch

from tdhook.attribution._straight_through import SUMS, held_activations
from tdhook.attribution.rules._autograd import TEMPLATED, is_activation
from tdhook.attribution.rules._in_place_writes import WRITES_IN_PLACE

__all__ = ["CUT_SIGNAL", "DETACHES_IN_PLACE", "CutSignals"]

#: the name under which a module's sums with a part of the signal computed without gradient are counted
CUT_SIGNAL = "a part computed from the inputs without gradient, added back (h + f(h).detach(), under torch.no_grad())"

_CUT = "_tdhook_cut_signal"  # on a tensor: computed from the signal without gradient

_T = torch.Tensor
_DETACHES = frozenset({_T.detach, torch.detach})
#: ``h.detach_()``: the signal itself made a tensor without gradient (see :meth:`CutSignals.note_detached`)
DETACHES_IN_PLACE = frozenset({_T.detach_, torch.detach_})
_DATA = _T.data.__get__  # ``h.data``: a detached view (compared by equality: a new method-wrapper at each read)
# Sums and joins: every operand's relevance is its own share of the result's (a selection by a mask included).
_JOINS = SUMS | {_T.__rsub__, _T.__setitem__, torch.where, _T.where, torch.lerp, _T.lerp, _T.lerp_}
_JOINS |= {torch.cat, torch.concat, torch.concatenate, torch.stack, torch.hstack, torch.vstack, torch.dstack}
_JOINS |= {torch.column_stack, torch.row_stack, torch.index_add, _T.index_add, _T.index_add_, torch.scatter_add}
_JOINS |= {_T.scatter_add, _T.scatter_add_, _T.masked_scatter, _T.masked_scatter_, torch.addcmul, _T.addcmul}
_JOINS |= {_T.addcmul_, torch.addcdiv, _T.addcdiv, _T.addcdiv_}
# Functions whose output does not change when a constant is added along ``dim``: a part constant along it that was
# added before them passes them no relevance to lose (``sim - sim.amax(-1, keepdim=True).detach()`` before a
# softmax, a stable softmax's shift).
_SHIFT_FREE = frozenset(
    {torch.softmax, _T.softmax, torch.nn.functional.softmax, torch.log_softmax, _T.log_softmax}
    | {torch.nn.functional.log_softmax}
)
_SHIFT_FREE_MODULES = (torch.nn.LayerNorm, torch.nn.Softmax, torch.nn.LogSoftmax)
# Recurrent modules: a state computed without gradient (a long sequence run in chunks, the state detached between
# them) is summed with the signal inside, where the watch does not see it.
_RECURRENT = (torch.nn.RNNBase, torch.nn.RNNCellBase)


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


def _is_cut(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.__dict__.get(_CUT, False)


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
    only a shape, a dtype and a device (``new_tensor`` copies values)."""
    name = getattr(func, "__name__", "")
    return not (name.endswith("_like") or (name.startswith("new_") and name != "new_tensor"))


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


_WATCHING = ("tdhook.attribution._cut_signals", "tdhook.attribution._nonlinear_calls")


def _called_by_rules() -> bool:
    """Whether the torch call being watched comes from this package's code (a rule's hook), not the model's: the
    first frame outside torch and the watch."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.partition(".")[0] != "torch" and name not in _WATCHING:
            return name.startswith("tdhook.")
        frame = frame.f_back
    return False


def _constant_dims(cut: list[torch.Tensor], result: Any) -> frozenset[int]:
    """The dimensions of ``result`` (counted from the end) along which every part in ``cut`` is broadcast: a shift
    constant along them."""
    if not isinstance(result, torch.Tensor):
        return frozenset()
    dims = None
    for part in cut:
        shape = (1,) * (result.dim() - part.dim()) + tuple(part.shape)
        here = {d - result.dim() for d, (a, b) in enumerate(zip(shape, result.shape, strict=True)) if a == 1 < b}
        dims = here if dims is None else dims & here
    return frozenset(dims or ())


class CutSignals:
    """Finds, among the calls it is told of, the sums and joins of the signal with a part of it computed without
    gradient, and lists them in ``calls`` as ``(module name, CUT_SIGNAL, autograd node)``.

    A sum whose part is constant along a dimension (a shift) is listed, then taken off the list where a softmax or a
    layer norm over that dimension reads it first: their output does not change with the shift, and no relevance
    reaches it. The marks it puts on tensors last until :meth:`forget` (the end of the watched call).
    """

    def __init__(self, calls: list | None = None) -> None:
        self._calls = [] if calls is None else calls
        self._marked: list[weakref.ref] = []
        self._shifts: dict[int, tuple[weakref.ref, frozenset[int], tuple]] = {}  # by result: its dims and entry

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
        self._shifts.clear()

    def add(self, where: str, node: Any, found: tuple) -> None:
        """List the sum or join :meth:`note` found (``found``), in module ``where``, at autograd node ``node``."""
        entry = (where, CUT_SIGNAL, node)
        self._calls.append(entry)
        result, dims = found
        if dims:  # a shift along ``dims``: taken off the list where a function free of it reads it first
            self._shifts[id(result)] = (weakref.ref(result), dims, entry)

    def _read_by_shift_free(self, value: Any, dims: frozenset[int]) -> None:
        """``value`` read first by a function whose output does not change by a shift along ``dims``: the sum
        itself, or the output of a rule's own function on it (a module's rule may hand its input on so)."""
        if not isinstance(value, torch.Tensor) or not self._shifts:
            return
        node = value.grad_fn
        parents = {id(child) for child, _ in node.next_functions if child is not None} if node is not None else set()
        for key, (ref, shifted_dims, entry) in list(self._shifts.items()):
            shifted = ref()
            if shifted is None:
                del self._shifts[key]
            elif shifted is value or (shifted.grad_fn is not None and id(shifted.grad_fn) in parents):
                del self._shifts[key]
                if shifted_dims & dims:
                    self._calls[:] = [call for call in self._calls if call is not entry]

    def _read_first(self, operands: list[Any], by_module: bool = False) -> None:
        """A reader other than a shift-free one reads a shifted sum first: the shift stays named. A module reads
        with calls out of the watch's sight where a rule acts on it; a call of a rule's hook (handing a module its
        input on) is no such reader."""
        for operand in operands:
            if isinstance(operand, torch.Tensor) and id(operand) in self._shifts:
                if self._shifts[id(operand)][0]() is operand and (by_module or not _called_by_rules()):
                    del self._shifts[id(operand)]

    @staticmethod
    def carries_signal(value: Any) -> bool:
        """Whether ``value`` carries the signal with its gradient (read before ``value.detach_()``)."""
        return _is_signal(value)

    def note_detached(self, tensor: Any) -> None:
        """Mark ``tensor``, the signal before a ``tensor.detach_()`` cut it off the graph in place: a part computed
        without gradient from here on, as ``tensor.detach()`` gives one."""
        self._mark(tensor, module_output=True)

    def note_module_input(self, module: torch.nn.Module, args: tuple) -> None:
        """Note that ``module`` is called on ``args`` (see :meth:`_read_first`)."""
        if self._shifts and not isinstance(module, _SHIFT_FREE_MODULES):
            self._read_first(_operands(args), by_module=True)

    def note_module(self, module: torch.nn.Module, args: tuple, output: Any, ruled: bool) -> tuple | None:
        """Mark the output of a ``ruled`` module's call (whose own calls the watch does not follow) on the signal
        under ``no_grad``, or on a part computed without gradient and no signal (a layer run on it). What
        :meth:`add` lists where a recurrent module runs on the signal from a state computed without gradient, else
        ``None``."""
        operands = _operands(args)
        signal = any(_is_signal(t) for t in operands)
        cut = any(_is_cut(t) for t in operands)
        if isinstance(module, torch.nn.LayerNorm) and operands:
            self._read_by_shift_free(operands[0], frozenset(range(-len(module.normalized_shape), 0)))
        elif isinstance(module, (torch.nn.Softmax, torch.nn.LogSoftmax)) and operands and module.dim is not None:
            value = operands[0]
            self._read_by_shift_free(value, frozenset({module.dim % value.dim() - value.dim()}))
        if signal and cut and torch.is_grad_enabled() and isinstance(module, _RECURRENT):
            return (output, frozenset())
        if ruled and ((signal and not torch.is_grad_enabled()) or (not signal and cut)):
            self._mark(output, module_output=True)  # a rule's Function may give it autograd history of its own
        return None

    def note(self, func: Any, args: tuple, result: Any, kwargs: dict | None = None) -> tuple | None:
        """Mark ``result`` where it is computed from the signal without gradient; what :meth:`add` lists where the
        call sums or joins such a part with the signal (the result, and the dimensions along which the part is a
        constant shift), else ``None``."""
        if not args:
            return None
        if func in _DETACHES or func == _DATA:
            if _is_signal(args[0]):
                self._mark(result, module_output=True)
            return None
        if func in _SHIFT_FREE and isinstance(args[0], torch.Tensor):
            dim = args[1] if len(args) > 1 else (kwargs or {}).get("dim")
            if isinstance(dim, int):
                self._read_by_shift_free(args[0], frozenset({dim % max(args[0].dim(), 1) - args[0].dim()}))
        operands = _operands(args[:1] if func in TEMPLATED else args)  # ``table.to(h)``: h gives a dtype only
        if self._shifts and func not in _SHIFT_FREE and getattr(func, "__name__", "") != "__get__":
            self._read_first(operands)  # (a property read, ``h.shape``, reads no value)
        cut = [t for t in operands if _is_cut(t)]
        joined = func in _JOINS and cut and torch.is_grad_enabled() and any(_is_signal(t) for t in operands)
        if joined and not _copies_of_the_rest(cut, operands):
            return (result, _constant_dims(cut, result) if func in SUMS else frozenset())
        if not _reads_values(func) or func in WRITES_IN_PLACE:
            # A write in place changes state the model keeps (a running mean updated under no_grad), not marked.
            return None
        if cut and not _is_signal(result if not isinstance(result, (list, tuple)) or not result else result[0]):
            self._mark(result)  # computed from a cut part without joining the signal again (a layer run on it)
        elif not torch.is_grad_enabled() and any(_is_signal(t) for t in operands):
            self._mark(result)  # a call on the signal under no_grad
        return None
