"""In-place writes seen by the function modes: a weight built in place from parameters stays a weight.

A tensor written into (``torch.zeros(...)[rows, cols] = vec``, ``r.add_(q, alpha=2)``, as peft's OFT builds the
rotation it applies to a layer's input) has autograd history after the write, and the plain test of
:func:`~tdhook.attribution.rules._autograd.mark_parameter_derived`, made after the call, would take it for an
activation: a product with it would then get the uniform rule of two activations, halving its relevance.
:func:`mark_written_in_place` judges the tensor written into by what it was before the write and by what is written.
A write that replaces every element (``buf.copy_(w)``, ``buf[...] = w``, ``buf.fill_(0)``) leaves the tensor what
the values written are, whatever it was before: an activation buffer overwritten with a weight is a weight. Where
views of the tensor may exist, the elements a write replaces (see
:mod:`~tdhook.attribution.rules._written_regions`) or reaches are noted on it (see
:mod:`~tdhook.attribution.rules._activation_writes`): each view then shows what its elements are now.
"""

from __future__ import annotations

from typing import Any

import torch

from tdhook.attribution.rules._activation_writes import (
    ACTIVATION_WRITTEN,
    MASKS_MADE,
    SHOWN,
    note_activation_written,
    note_weight_written,
)
from tdhook.attribution.rules._autograd import PARAMETER_DERIVED, is_activation
from tdhook.attribution.rules._constant_elements import (
    CONSTANT_MASKS_MADE,
    CONSTANTS_JOINED,
    constants_before,
    note_constants_written,
)
from tdhook.attribution.rules._filled_gates import is_constant
from tdhook.attribution.rules._gate_writes import (
    GATE_MASKS_MADE,
    GATE_WRITTEN,
    OTHER_GATES,
    gate_marks_shown,
    note_gate_written,
)
from tdhook.attribution.rules._joined_weights import (
    WEIGHTS_MARK,
    WEIGHTS_MASKS_MADE,
    note_weights_written,
    weights_shown,
)
from tdhook.attribution.rules._other_gate_writes import note_other_gates_written
from tdhook.attribution.rules._unrecorded_writes import (
    ALIAS_OF,
    STRAIGHT_THROUGH_WRITES,
    UNRECORDED,
    note_unrecorded_write,
    settle_numpy_watch,
    unrecorded_source,
)
from tdhook.attribution.rules._written_regions import (
    REPLACING,
    reached_region,
    replaced_region,
    replaces,
    written_value,
)

__all__ = [
    "WRITES_IN_PLACE",
    "gate_marks_of",
    "mark_written_in_place",
    "note_gate_views",
    "unrecorded_straight_through",
]

# The operators of the augmented assignments (``+=``, ``*=``, ``**=``, ...).
_AUGMENTED = {
    "add",
    "sub",
    "mul",
    "div",
    "truediv",
    "floordiv",
    "mod",
    "pow",
    "matmul",
    "and",
    "or",
    "xor",
    "lshift",
    "rshift",
}

# In-place writes into their first argument (``table[:, rows, cols] = vec``, ``r.add_(q, alpha=2)``,
# ``w.baddbmm_(u, v)``): every in-place method of a tensor (its name ends with one underscore), every augmented
# assignment, and the functions of the same writes (``torch.index_put_(c, i, w)``, ``torch.addmv_(c, m, h)``,
# ``torch.fill_(c, w)``). One left out kept a weight it wrote an activation into for a weight, as it was before the
# write, and an activation a weight's values replaced for an activation (5.8 and 1.0 off, relative L2, under AttnLRP).
WRITES_IN_PLACE = frozenset(
    getattr(torch.Tensor, name)
    for name in dir(torch.Tensor)
    if (name.endswith("_") and not name.startswith("_"))
    or name == "__setitem__"
    or (name.startswith("__i") and name.endswith("__") and name[3:-2] in _AUGMENTED)
) | frozenset(
    getattr(torch, name)
    for name in dir(torch)
    if name.endswith("_") and not name.startswith("_") and not name.endswith("__") and callable(getattr(torch, name))
)


# In-place writes that replace every element of the tensor written into, whatever their arguments.
_WHOLE_WRITES = frozenset({torch.Tensor.copy_, torch.Tensor.fill_, torch.Tensor.zero_, torch.fill_, torch.zero_})


# The attributes of a gate's marks (``GATE_MARK`` and ``SIGMOID_MARK`` of :mod:`~tdhook.attribution.rules.gates`,
# which imports this module): the first marks every gate.
GATE_MARKS = ("_tdhook_activation_of", "_tdhook_sigmoid_gate")
_SIGMOID = GATE_MARKS[1]
# The sigmoid computed in place: its output a sigmoid-like gate (a view of a gate of another kind, or of a sigmoid's,
# written so was left no gate: 0.17-1.3 off, relative L2, under AttnLRP and CP-LRP, 0.27-0.83 under EpsilonPlus).
_SIGMOIDS_IN_PLACE = frozenset({torch.sigmoid_, torch.Tensor.sigmoid_})
# Writes that scale a gate by a positive number (``g.mul_(2)``, ``g /= 6``): a gate still, as ``2 * g`` is.
_SCALINGS_IN_PLACE = frozenset(
    {torch.Tensor.mul_, torch.Tensor.__imul__, torch.Tensor.multiply_, torch.Tensor.div_, torch.Tensor.__itruediv__}
    | {torch.Tensor.divide_, torch.Tensor.true_divide_}
)
# Products in place (a gate times a gate: a gate, see _held_values), and negations in place (weights: weights).
_PRODUCTS_IN_PLACE = frozenset({torch.Tensor.mul_, torch.Tensor.__imul__, torch.Tensor.multiply_})
_NEGATIONS_IN_PLACE = frozenset({torch.Tensor.neg_, torch.Tensor.negative_, torch.neg_})

# Writes that replace elements with reductions of what they write (a sum of a gate's values is none): no gate there.
_REDUCING = frozenset({torch.Tensor.scatter_reduce_, torch.Tensor.index_reduce_})


def gate_marks_of(value: Any) -> dict:
    """The gate marks of ``value`` (see :data:`GATE_MARKS`): for a view of a tensor an in-place write changed the
    gate elements of, those of what it shows now (see :mod:`~tdhook.attribution.rules._gate_writes`), else its own.

    Examples:
        >>> gate_marks_of(torch.ones(2))
        {}
    """
    if not isinstance(value, torch.Tensor):
        return {}
    shown = gate_marks_shown(value) if GATE_MASKS_MADE else None
    if shown is not None:
        return shown
    own = value.__dict__
    return {mark: own[mark] for mark in GATE_MARKS if mark in own} if GATE_MARKS[0] in own else {}


def note_gate_views(target: torch.Tensor, region: torch.Tensor | None, marks: dict | None) -> None:
    """Before an in-place write makes the elements ``region`` (a mask of ``target``'s shape; ``None``: all) of
    ``target`` a gate with the marks ``marks`` (``None``: no gate), note it for the views of ``target``'s tensor, where
    any may exist (see :func:`~tdhook.attribution.rules._gate_writes.note_gate_written`): a view taken before the write
    then shows a gate where every element it shows is one, whatever its own marks.

    Examples:
        >>> x = torch.ones(2, 3, requires_grad=True)
        >>> gate = torch.sigmoid(x) * 1
        >>> gate.__dict__.update(_tdhook_activation_of=x, _tdhook_sigmoid_gate=True)
        >>> row = gate[0]
        >>> row.__dict__.update(_tdhook_activation_of=x, _tdhook_sigmoid_gate=True)  # a view of the gate
        >>> note_gate_views(gate, torch.tensor([[True] * 3, [False] * 3]), None)  # an activation over row 0 next
        >>> gate_marks_of(row), bool(gate_marks_of(gate[1]))
        ({}, True)
    """
    # (Read where no mode sees it: another mode would take the tensor a view shows only a weight's values of, after
    # a write, for that weight, ``buf[:, 1:4].copy_(w)`` marking the activation ``buf`` computed from parameters.)
    with torch._C.DisableTorchFunction():
        base = target._base
    root = target if base is None else base
    own = root.__dict__
    before = {mark: own[mark] for mark in GATE_MARKS if mark in own} if GATE_MARKS[0] in own else None
    record = own.get(GATE_WRITTEN) if GATE_MASKS_MADE else None
    held = record[1] if record is not None else before  # the kind of gate the mask keeps (or would keep)
    if marks is not None and held and bool(marks.get(_SIGMOID, False)) is not bool(held.get(_SIGMOID, False)):
        # Gates of two kinds in one tensor: the mask keeps the sigmoid-like ones' elements (where every gate is
        # one of any kind: see _other_gate_writes); a sigmoid-like gate's counted another kind's as its own.
        if not marks.get(_SIGMOID, False):
            marks = None
        elif record is not None:
            with torch._C.DisableTorchFunction():
                record[0].fill_(False)
        else:
            before = None
    # A write into part of the tensor that makes it a gate in some elements only (a gate's values into part of an
    # activation, an activation's into part of a gate): noted for the tensor itself too, whose marks cannot tell it
    # (a product with it took it as no gate: 0.17-2.6 off, relative L2, under AttnLRP and CP-LRP, up to 0.80 under
    # EpsilonPlus, against the pieces multiplied apart).
    part = region is not None and (marks is not None) is not (before is not None)
    if base is None and not part and not (GATE_MASKS_MADE and GATE_WRITTEN in own) and not _maybe_viewed(root):
        return
    note_gate_written(target, region, marks, before)


def _gate_written(
    func: Any, args: tuple, kwargs: dict, whole: bool, tensors: list[torch.Tensor], prior: tuple | None
) -> None:
    """Give ``tensors`` (the tensor written into, and the tensor it views) the gate marks of what the write made of
    them: none after a write into a gate (``g.copy_(h)``, ``g.add_(h)``; it kept its marks, and a product held it
    constant: 1.0 off, relative L2, under AttnLRP), but a scaling by a positive number; a gate's, where one replaced
    every element (``c.copy_(g)``), on each tensor it covers whole. The views of them that may exist are noted (see
    :func:`note_gate_views`): a gate where a gate's values replaced their elements, none where the write reached."""
    value = written_value(func, args, kwargs)
    positive = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    # (The number given by position or by name, ``g.mul_(other=2.0)``: it lost its marks, and the product with it
    # got the rule of two activations, 6.7 off, relative L2, under AttnLRP and CP-LRP, 0.37 under EpsilonPlus.)
    if func in _SCALINGS_IN_PLACE and positive and len(args) + len(kwargs) == 2:
        return
    written = {} if func in _REDUCING else gate_marks_of(value)
    if func in _PRODUCTS_IN_PLACE and written and len(tensors) == 1 and (marks := gate_marks_of(args[0])):
        # ``s.mul_(g)``: a product of two gates, a gate, sigmoid-like where both are (see _held_values)
        if not (marks.get(_SIGMOID, False) and written.get(_SIGMOID, False)):
            args[0].__dict__.pop(_SIGMOID, None)
        return
    if func in _SIGMOIDS_IN_PLACE:  # ``c[:, :3].sigmoid_()``: a sigmoid-like gate over every element it reaches
        whole, written = True, {GATE_MARKS[0]: args[0], _SIGMOID: True}
    replacing = replaces(func, args, kwargs)
    if replacing and not whole and is_constant(value) and all(GATE_MARKS[0] in t.__dict__ for t in tensors):
        # A constant over part of a gate (``g.masked_fill_(pad, 0.0)``, ``g[:, :2] = 1.0``): a gate still, as a
        # constant joined with one is (it was none: 6.5 off, relative L2, under AttnLRP and CP-LRP, 0.22 under
        # EpsilonPlus; see _filled_gates).
        return
    try:
        # What it replaces, or what an index picks to add to (``g.index_add_(1, i, h)``: no gate there).
        region = None if whole else (replaced_region if replacing else reached_region)(func, args, kwargs)
    except (RuntimeError, NotImplementedError, IndexError, TypeError, ValueError):  # indices a transform wraps
        region, written = None, {}  # no gate left where the write reaches
    root_marks = tensors[-1].__dict__  # of the tensor written into, or of the one it views
    if region is None and whole and len(tensors) == 2:  # every element of a view (``c[:, :3].copy_(g)``): part of c
        with torch._C.DisableTorchFunction():
            region = torch.ones(tensors[0].shape, dtype=torch.bool, device=tensors[0].device)
    if region is not None and (prior is not None or _other_kind(written) or _other_kind(root_marks)):
        # A gate of another kind (a tanh's) written into part of the tensor, or part of one written into: where every
        # gate of any kind is (see _other_gate_writes).
        note_other_gates_written(
            tensors[0], region, bool(written) and (replacing or whole), GATE_MARKS[0] in root_marks, prior
        )
    note_gate_views(tensors[0], region, written if written and (replacing or whole) else None)
    marks = written if whole else {}
    for tensor in tensors:
        covered = tensor is tensors[0] or tensor.numel() == tensors[0].numel()
        own = tensor.__dict__
        if written and (replacing or whole) and GATE_MARKS[0] in own and not (marks and covered):
            # A gate's values over part of a gate (``g[:, :3] = torch.sigmoid(s)``): every element a gate still (it
            # was none: 5.2 off, relative L2, under AttnLRP), marked as both are (a sigmoid's where both are).
            new = {mark: own[mark] for mark in GATE_MARKS if mark in own and mark in written}
        else:
            new = marks if covered else {}
        for mark in GATE_MARKS:
            own.pop(mark, None)
        own.update(new)


def _other_kind(marks: dict) -> bool:
    """Whether ``marks`` (a tensor's ``__dict__``, or gate marks) are a gate's of another kind than sigmoid-like."""
    return GATE_MARKS[0] in marks and not marks.get(_SIGMOID, False)


def _zero(value: Any) -> bool:
    """Whether ``value``, what an in-place write puts, is the number 0."""
    return isinstance(value, (int, float)) and value == 0


def _whole_key(args: tuple) -> bool:
    """Whether the key of ``t[key] = v`` (``args[1]``) selects every element: ``...``, ``:``, ``:, :``."""
    if len(args) < 2:
        return False
    keys = args[1] if isinstance(args[1], tuple) else (args[1],)
    return all(key is Ellipsis or (isinstance(key, slice) and key == slice(None)) for key in keys)


def mark_written_in_place(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)``, an in-place write into ``args[0]``, with ``args[0]`` marked as computed from
    parameters alone where it was a constant or so marked before and what is written into it is too (a weight built
    in place from its parameters: ``torch.zeros(...)`` filled with a parameter's values), and unmarked where an
    activation is written into it. A write that replaces every element of ``args[0]`` (``copy_``, ``fill_``,
    ``zero_``, ``t[...] = v``) marks it by what is written alone: an activation overwritten with a weight's values is
    a weight, as the weight itself is out of place. Where views of ``args[0]``'s tensor may exist (``args[0]`` is one,
    or its storage has other owners), the elements written are noted on the tensor viewed: an activation where one
    went, a weight where a weight's values replaced what was there (``c[:, :3] = w``, ``c.index_put_(i, w)``,
    ``buf[:, :3].copy_(w)``); each view of it then shows what its elements are, whatever its mark, and the tensor
    viewed is an activation while one element of it is.

    After the write, the tensor has autograd history, and the plain test of
    :func:`~tdhook.attribution.rules._autograd.mark_parameter_derived` would take it for an activation (a product
    with it then got the uniform rule of two activations, halving its relevance).

    Examples:
        >>> vec = torch.nn.Parameter(torch.ones(3))
        >>> table = torch.zeros(2, 3)
        >>> _ = mark_written_in_place(torch.Tensor.__setitem__, (table, 0, vec), {})
        >>> is_activation(table), table.requires_grad
        (False, True)
        >>> _ = mark_written_in_place(torch.Tensor.add_, (table, torch.ones(3, requires_grad=True) * 2), {})
        >>> is_activation(table)
        True
        >>> buffer = torch.ones(2, 3, requires_grad=True) * 2  # an activation
        >>> _ = mark_written_in_place(torch.Tensor.copy_, (buffer, vec), {})  # overwritten by a weight
        >>> is_activation(buffer)
        False
        >>> buffer = torch.ones(2, 3, requires_grad=True) * 2
        >>> row = buffer[0]  # a view, taken before a weight's values replace the row
        >>> _ = mark_written_in_place(torch.Tensor.__setitem__, (buffer, 0, vec), {})
        >>> is_activation(row), is_activation(buffer[1]), is_activation(buffer)
        (False, True, True)
    """
    target = args[0] if args else None
    if not isinstance(target, torch.Tensor):
        return func(*args, **kwargs)
    # Each property read once: under another function mode, every read of one is a call of that mode.
    base, requires_grad = target._base, target.requires_grad
    marked = bool(getattr(target, PARAMETER_DERIVED, False))
    root = target if base is None else base
    if UNRECORDED:  # a NumPy array shares the storage: written through it before, or watched no more
        settle_numpy_watch(root)
    if ALIAS_OF in root.__dict__ or not torch.is_grad_enabled():  # a write autograd may not record: the tensor noted
        source = unrecorded_straight_through(func, args, kwargs) if func in STRAIGHT_THROUGH_WRITES else None
        if source is None:
            note_unrecorded_write(func, args, root)
        elif ALIAS_OF in root.__dict__:
            # ``c.data`` keeps a version counter of its own: moved, a tensor autograd saved of ``c`` (``exp``'s,
            # ``sigmoid``'s output) is refused by the backward pass, as the write is under ``torch.no_grad()``
            torch.autograd.graph.increment_version(source)
    masked = bool(MASKS_MADE) and ACTIVATION_WRITTEN in root.__dict__
    gated = (
        GATE_MARKS[0] in target.__dict__
        or GATE_MARKS[0] in root.__dict__
        or (bool(GATE_MASKS_MADE) and GATE_WRITTEN in root.__dict__)
    )
    weighed = WEIGHTS_MARK in target.__dict__ or WEIGHTS_MARK in root.__dict__
    if base is None and requires_grad and not marked and func not in REPLACING and not (masked or gated or weighed):
        # an activation written into in part (``relu_``, ``out += identity``): it stays one, nothing to mark
        return func(*args, **kwargs)
    replacing = replaces(func, args, kwargs)
    if MASKS_MADE:  # what the tensor showed, read before the write (``as_strided_`` changes what it shows)
        target.__dict__.pop(SHOWN, None)
    # The tensor written into and, for a view (``weight[:, 1:3].copy_(...)``), the tensor it views: constant before?
    targets, constant = [target], [not requires_grad or marked]
    if base is not None:
        targets.append(base)
        constant.append(not base.requires_grad or bool(getattr(base, PARAMETER_DERIVED, False)))
    # An activation before the write, every element of it where it has no mask.
    root_activation = not constant[-1] and not root.is_leaf
    # Where its constants are beside an activation (a join of them, or written in place before): read before the write.
    noted = root.__dict__.get(CONSTANTS_JOINED) if CONSTANT_MASKS_MADE else None
    constants = constant[-1] if noted is None else constants_before(root, constant[-1])
    # Every element replaced: the tensor, and a base it views whole, is what is written, whatever it was before. Not a
    # view (``buf[:, :3].copy_(w)``): it shows its base, which later writes reach (``buf += h``) and the mark would not
    # follow. (The cheap tests first: most writes are an activation's, ``relu_``, ``out += identity``.)
    whole = func in _WHOLE_WRITES or (func is torch.Tensor.__setitem__ and _whole_key(args))
    if whole and not all(constant):
        constant = [
            was or (tensor._base is None and tensor.numel() == target.numel())
            for tensor, was in zip(targets, constant, strict=True)
        ]
    # Views of the tensor may exist (``v = c[:, :2]``), which a write into part of it reaches.
    viewed = masked or base is not None or ((any(constant) or (replacing and root_activation)) and _maybe_viewed(root))
    # Where a gate of any kind is, noted before the write (a join's of gates of another kind, see _other_gate_writes).
    prior = root.__dict__.get(OTHER_GATES)
    prior = None if prior is None else (*prior, root._version)
    # (and weights added into a constant or weights: ``zeros.index_add_(1, i, w)``, see _weights_written)
    adds_weights = not (weighed or WEIGHTS_MASKS_MADE or replacing) and _weights(written_value(func, args, kwargs))
    weights = (
        _weights_before(func, args, kwargs, root, constant[-1])
        if weighed or WEIGHTS_MASKS_MADE or replacing or adds_weights
        else None
    )
    result = func(*args, **kwargs)
    value = written_value(func, args, kwargs)
    if weights is not None:  # a softmax's weights written into part of a tensor, or part of weights written into
        _weights_written(func, args, kwargs, whole, *weights)
    if gated or whole or (replacing and isinstance(value, torch.Tensor) and gate_marks_of(value)):
        _gate_written(func, args, kwargs, whole, targets, prior)  # a gate's elements written: its marks, its views'
    # Those with autograd history now (a constant written into without gradient, in a rule's own work, has none).
    judged = [
        tensor
        for tensor, was_constant in zip(targets, constant, strict=True)
        if was_constant and tensor.requires_grad and not tensor.is_leaf
    ]
    # Constants beside an activation, where the write may leave some: a constant into part of an activation, an
    # activation into part of a constant, any write into a tensor that has such constants.
    mixing = noted is not None or (replacing and root_activation) or (constants is True and bool(judged))
    if not (judged or masked or (replacing and root_activation and viewed) or mixing):
        return result
    written = [
        tensor
        for arg in (*args[1:], *kwargs.values())
        for tensor in (arg if isinstance(arg, (list, tuple)) else (arg,))
        if isinstance(tensor, torch.Tensor) and tensor is not target
    ]
    derived = not any(is_activation(tensor) for tensor in written)
    if mixing and (noted is not None or derived is not constants):
        # (Not zeros over an activation, ``h.masked_fill_(pad, 0.0)``: zero in a product, held or not, they take
        # nothing. A constant over part of a gate is noted too: a gate still, but a constant element times another
        # gate takes none of the product's relevance, where the two gates alike would share it.)
        if not (constants is False and _zero(value)):
            note_constants_written(func, args, kwargs, constants, not derived, value)
    for tensor in judged:
        setattr(tensor, PARAMETER_DERIVED, derived)
    if not viewed:  # no view shows the elements written: the marks tell
        return result
    # What views of the tensor show now: an activation where it went, a weight where one replaced what was there.
    try:
        region = replaced_region(func, args, kwargs)
    except (RuntimeError, NotImplementedError, IndexError, TypeError, ValueError):  # indices a transform wraps
        region, replacing = None, False  # an activation's reach taken whole; a weight's unknown, not noted
    if not derived:
        holds = note_activation_written(target, region, made=bool(judged))
    elif replacing:
        holds = note_weight_written(target, region, made=root_activation)
    else:  # a weight combined with the elements (``c.add_(w)``): each stays what it was
        return result
    if holds is not None and root.requires_grad and not root.is_leaf:  # the tensor viewed is what its elements are
        setattr(root, PARAMETER_DERIVED, not holds)
    return result


def _weights(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and WEIGHTS_MARK in value.__dict__


def _weights_before(func: Any, args: tuple, kwargs: dict, root: torch.Tensor, constant: bool) -> tuple | None:
    """Where ``root`` is a softmax's weights before the in-place write ``func(*args, **kwargs)`` into it (or into a
    view of it), and whether the write puts weights there: ``None`` where no weights are written or noted on it (see
    :func:`~tdhook.attribution.rules._joined_weights.note_weights_written`; a constant counts as weights, held or
    not)."""
    writes = _weights(written_value(func, args, kwargs))
    if WEIGHTS_MARK in root.__dict__:
        return True, writes
    shown = weights_shown(root) if WEIGHTS_MASKS_MADE else None
    if isinstance(shown, torch.Tensor):
        return shown, writes
    return (constant and shown is None, writes) if writes else None


def _weights_written(func: Any, args: tuple, kwargs: dict, whole: bool, before: Any, writes: bool) -> None:
    """Note where the tensor ``args[0]`` views is a softmax's weights after the in-place write ``func(*args, **kwargs)``
    (``whole``: it replaces every element of ``args[0]``), from ``before`` and ``writes`` (see :func:`_weights_before`):
    weights where weights replaced the elements, none where anything else reached them."""
    if func in _SCALINGS_IN_PLACE or func in _NEGATIONS_IN_PLACE:  # ``w.mul_(2.5)``, ``w /= w.sum(-1, keepdim=True)``,
        return  # ``w.neg_()``: weights still, as they were
    replacing = whole or replaces(func, args, kwargs)
    value = written_value(func, args, kwargs)
    if not replacing and value is not None and not is_activation(value):  # ``w.add_(0.5)``: each stays what it was
        return
    if writes and not replacing:  # weights added into weights or a constant (``zeros.index_add_(1, i, w)``): weights
        unchanged = torch.zeros(args[0].shape, dtype=torch.bool, device=args[0].device)
        note_weights_written(args[0], unchanged, False, before)  # (where the tensor was weights or a constant)
        return
    try:
        region = None if whole else (replaced_region if replacing else reached_region)(func, args, kwargs)
    except (RuntimeError, NotImplementedError, IndexError, TypeError, ValueError):  # indices a transform wraps
        region, writes = None, False  # no weights where the write may reach
    note_weights_written(args[0], region, writes and replacing, before)


def unrecorded_straight_through(func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The activation whose straight-through estimator ``func(*args, **kwargs)`` is, if it is one: a write of
    :data:`~tdhook.attribution.rules._unrecorded_writes.STRAIGHT_THROUGH_WRITES` with numbers alone
    (``c.clamp_(-1, 1)``, ``c.round_()``) into an activation ``c`` (or a view of it) where autograd does not record
    it (under ``torch.no_grad()``, or through a detached alias, but for a sigmoid gate's): the values are ``f(c)``,
    the gradient passes to ``c``, as in ``c + (f(c) - c).detach()``. Judged before or after the write.

    Examples:
        >>> c = torch.ones(2, requires_grad=True) * 2
        >>> with torch.no_grad():
        ...     unrecorded_straight_through(torch.Tensor.clamp_, (c, -1.0, 1.0), {}) is c
        True
        >>> with torch.no_grad():  # a bound of another tensor's values
        ...     unrecorded_straight_through(torch.Tensor.clamp_, (c, torch.zeros(2)), {}) is None
        True
    """
    if func not in STRAIGHT_THROUGH_WRITES or not args or not isinstance(args[0], torch.Tensor):
        return None
    if any(isinstance(value, torch.Tensor) for value in (*args[1:], *kwargs.values())):
        return None
    source = unrecorded_source(args[0])
    if not is_activation(source):
        return None
    # A gate's marks follow a write into the gate itself, not one through an alias of it (``g.detach().clamp_()``:
    # 2.3 off the estimator under AttnLRP): noted, and refused at a read, as any write through an alias
    return None if GATE_MARKS[1] in source.__dict__ and ALIAS_OF in _root_of(args[0]).__dict__ else source


def _root_of(tensor: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunction():  # ``_base`` read where no mode sees it
        base = tensor._base
    return tensor if base is None else base


def _maybe_viewed(tensor: torch.Tensor) -> bool:
    """Whether another tensor may share ``tensor``'s storage (a view of it, or one autograd saved): its storage has
    more owners than ``tensor`` and the storage object read for the count."""
    with torch._C.DisableTorchFunction():
        try:
            return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata) > 2
        except (AttributeError, RuntimeError, NotImplementedError):  # no storage to read (under torch.vmap)
            return True
