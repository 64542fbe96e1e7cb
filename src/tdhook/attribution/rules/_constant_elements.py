"""Constants beside an activation in one tensor: where they are, for the products that take the tensor.

A join of constants and activations (``torch.cat([torch.ones(b, 2), relu(h)], 1)``, see
:mod:`~tdhook.attribution.rules._joined_gates`) and an in-place write that puts a constant into part of an
activation (``buf[:, :3] = w[:, :3]``, ``buf[:, :3].copy_(w)``, ``buf.index_put_(i, w)``,
``buf.masked_fill_(pad, 2.0)``), or an activation into part of a constant (``c = s * torch.ones(...)``, then
``c[:, :2] = h[:, :2]``), make the same tensor: constants in some elements, an activation in the others. In a
product, a constant element takes none of the relevance, as it does multiplied apart (times a constant, a product is
a linear map of its other factor). The join notes where its constants went; a write left the whole tensor an
activation, and the uniform rule gave its constant elements half of the product's relevance, passed on to nothing
(up to 0.50 off, relative L2, float64, under AttnLRP and CP-LRP times a ReLU's output, 0.61-1.08 times a sigmoid
gate, which took it all; 0.07-0.77 under the CNN presets, whose gate was held against a constant), against the
products taken apart.

:data:`CONSTANTS_JOINED` keeps, on such a tensor, a mask of its storage's elements (true where a constant is) and the
tensor's version then; :func:`constants_shown` reads it for a view. :func:`note_constants_written` keeps it at an
in-place write, and notes the constant elements as a sigmoid-like gate's too (see
:func:`~tdhook.attribution.rules._gate_writes.note_gate_written`), as the join does: a view that shows only
constants is then a gate, held in a product, and a product with the tensor whole holds them element by element (see
:mod:`~tdhook.attribution.rules._mixed_gate_products`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tdhook.attribution.rules._caller import warn_at_caller
from tdhook.attribution.rules._gate_writes import GATE_WRITTEN, OTHER_GATES, OTHER_MASKS_MADE, note_gate_written
from tdhook.attribution.rules._storage_masks import (
    bytes_reached,
    count_mask,
    laid_over_storage,
    rearranged_mask,
    shown_of_storage,
)
from tdhook.attribution.rules._written_regions import reached_region, replaced_region

__all__ = [
    "CACHED",
    "CONSTANTS_JOINED",
    "CONSTANT_MASKS_MADE",
    "constants_before",
    "constants_shown",
    "follows_values",
    "keep_constant_elements",
    "note_constant_gates",
    "note_constants_written",
    "repeated_constants",
]

#: On a tensor with constants beside an activation (a join of them, or one written in place): a mask of its
#: storage's elements, true where a constant is, and the tensor's version then.
CONSTANTS_JOINED = "_tdhook_constants_joined"
#: On a tensor a key-value cache handed to the model held (a cached prefix's keys and values): no constant beside
#: the activations joined to it or written into it, for a cached prefix gives the new tokens the relevance the whole
#: sequence gives them (the prefix's keys a factor of two activations there, as in the whole sequence's call).
CACHED = "_tdhook_cached"
#: One entry a mask alive of :data:`CONSTANTS_JOINED`: products look it up only while one is.
CONSTANT_MASKS_MADE: list[bool] = []
# The marks of a sigmoid-like gate (``GATE_MARK``, ``SIGMOID_MARK`` of :mod:`~tdhook.attribution.rules.gates`).
_GATE, _SIGMOID = "_tdhook_activation_of", "_tdhook_sigmoid_gate"


def constants_shown(value: Any) -> torch.Tensor | None:
    """Where ``value``, a tensor with constants beside an activation (or a view of one), shows a constant (see
    :data:`CONSTANTS_JOINED`): a mask of its shape; ``None`` where none is noted, or it was written into since.

    Examples:
        >>> root = torch.zeros(2, 2)
        >>> root.__dict__[CONSTANTS_JOINED] = (torch.tensor([True, False, True, False]), root._version)
        >>> count_mask(root, CONSTANT_MASKS_MADE)
        >>> constants_shown(root[:, :1]).tolist(), constants_shown(root[0]).tolist()
        ([[True], [True]], [True, False])
    """
    if not CONSTANT_MASKS_MADE or not isinstance(value, torch.Tensor):
        return None
    shown = shown_of_storage(value, CONSTANTS_JOINED)
    return shown if isinstance(shown, torch.Tensor) else None


def repeated_constants(value: torch.Tensor, repeats: int, dim: int) -> torch.Tensor:
    """``value.repeat_interleave(repeats, dim)`` (a grouped-query attention's keys repeated over the heads), noting
    where its constants went where ``value`` holds constants beside an activation (see :data:`CONSTANTS_JOINED`):
    the copy would hold none.

    Examples:
        >>> root = torch.zeros(2, 1)
        >>> root.__dict__[CONSTANTS_JOINED] = (torch.tensor([True, False]), root._version)
        >>> count_mask(root, CONSTANT_MASKS_MADE)
        >>> constants_shown(repeated_constants(root, 2, 0)).tolist()
        [[True], [True], [False], [False]]
    """
    repeated = value.repeat_interleave(repeats, dim)
    shown = constants_shown(value)
    if shown is not None:
        if repeated._base is not None:  # (a view of a tensor of another shape: a copy of its own holds the mask)
            repeated = repeated.clone()
        with torch._C.DisableTorchFunction(), torch.no_grad():
            mask = laid_over_storage(repeated, shown.repeat_interleave(repeats, dim))
        if mask is not None:
            setattr(repeated, CONSTANTS_JOINED, (mask, repeated._version))
            count_mask(repeated, CONSTANT_MASKS_MADE)
    return repeated


def keep_constant_elements(
    source: torch.Tensor, result: torch.Tensor, rearranged: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> None:
    """Note on ``result``, a new tensor whose elements are ``source``'s at the same places (a copy, a cast, a positive
    scaling: ``c.clone()``, ``c.t().contiguous()``, ``c.to(torch.float64)``, ``c * 2``), where ``source`` shows
    constants beside an activation (see :data:`CONSTANTS_JOINED`); ``rearranged``: the call that made ``result`` from
    ``source`` (``c.flip(1)``, ``c[:, idx]``), made on a mask of ``source``'s shape instead (``None``: the same places).
    The copy had no mask: a product with it gave its constant elements half of its relevance, passed on to nothing
    (0.47-0.97 off, relative L2, float64, under AttnLRP, CP-LRP and EpsilonPlus, against the products taken apart).

    Examples:
        >>> root = torch.zeros(2, 2)
        >>> root.__dict__[CONSTANTS_JOINED] = (torch.tensor([True, False, True, False]), root._version)
        >>> count_mask(root, CONSTANT_MASKS_MADE)
        >>> copy = root.t().contiguous()
        >>> keep_constant_elements(root.t(), copy)
        >>> constants_shown(copy).tolist()
        [[True, True], [False, False]]
    """
    shown = constants_shown(source)
    if shown is None or result is source or result._base is not None:  # (a view reads its tensor's mask)
        return
    region = rearranged_mask(shown, rearranged, result.shape)
    if region is None:  # (a call a mask cannot take: nothing noted)
        return
    with torch._C.DisableTorchFunction(), torch.no_grad():  # bookkeeping, which a function mode must not see
        mask = laid_over_storage(result, region)
    if mask is not None:
        setattr(result, CONSTANTS_JOINED, (mask, result._version))
        count_mask(result, CONSTANT_MASKS_MADE)


def constants_before(root: torch.Tensor, constant: bool) -> torch.Tensor | bool:
    """Where ``root``'s storage holds constants, read before an in-place write into it: its mask (see
    :data:`CONSTANTS_JOINED`) where one is noted and current; else ``constant`` (``root`` a constant whole, or not).

    Examples:
        >>> constants_before(torch.zeros(2), True), constants_before(torch.zeros(2), False)
        (True, False)
    """
    noted = root.__dict__.get(CONSTANTS_JOINED) if CONSTANT_MASKS_MADE else None
    if noted is None or noted[0] is None:
        return constant
    with torch._C.DisableTorchFunction():  # (a property read is a call of another mode)
        return noted[0] if noted[1] == root._version else constant


def note_constants_written(
    func: Any, args: tuple, kwargs: dict, before: torch.Tensor | bool, activation: bool, value: Any
) -> None:
    """Note on the tensor ``args[0]`` views (or on itself) where its constants are after the in-place write
    ``func(*args, **kwargs)`` (see the module's docstring): ``before``, where they were (see :func:`constants_before`);
    ``activation``, whether what is written is an activation (then no element it reaches is a constant), else a
    constant (an element it replaces is one; one it combines with stays what it was); ``value``, what is written.
    Where the tensor holds constants beside an activation, they are noted (:data:`CONSTANTS_JOINED`, and as a
    sigmoid-like gate's elements); elsewhere its mask is dropped.

    Examples:
        >>> from tdhook.attribution.rules._gate_writes import gate_marks_shown
        >>> x = torch.ones(2, 3, requires_grad=True)
        >>> buf = x * 2  # an activation
        >>> buf[:, :2] = torch.ones(2)  # a constant over its first two columns
        >>> key = (slice(None), slice(0, 2))
        >>> note_constants_written(torch.Tensor.__setitem__, (buf, key, 1.0), {}, False, False, 1.0)
        >>> constants_shown(buf).tolist()
        [[True, True, False], [True, True, False]]
        >>> bool(gate_marks_shown(buf[:, :2])), bool(gate_marks_shown(buf[:, 1:]))
        (True, False)
    """
    if before is False and activation:  # an activation written into an activation: it stays one
        return
    target = args[0]
    with torch._C.DisableTorchFunction():
        base = target._base
        root = target if base is None else base
        if CACHED in root.__dict__:  # a cache's buffer (a StaticCache's): the whole sequence's keys, no constants
            return
        try:
            region = replaced_region(func, args, kwargs)  # (``None``: the write combines, every element reached)
            if region is None and activation:  # an activation added where an index picks (``c.index_add_(...)``)
                region = reached_region(func, args, kwargs)
        except (RuntimeError, NotImplementedError, IndexError, TypeError, ValueError):  # indices a transform wraps
            if activation or before is not False:  # constants the write may reach, where not known
                _unknown(func, root)
            return
        if not activation and region is None and not isinstance(before, torch.Tensor):
            return  # a constant combined with the elements (``h.add_(w)``, ``h.mul_(2)``): each stays what it was
        with torch.no_grad():
            mask = _written(root, target, before, region, activation)
            shown = mask.as_strided(root.shape, root.stride(), root.storage_offset())
            every, some = bool(shown.all()), bool(shown.any())
            # Constants beside an activation; constants alone in an activation's graph (a product holds them); or no
            # constant, where another call's mask or index may leave some (no plan of the rules follows their values:
            # a product with a mask noted runs in the rules' mode).
            kept = (some and not every) or (root.requires_grad and (every or follows_values(args, kwargs)))
        noted = root.__dict__.get(CONSTANTS_JOINED)
        if not kept:  # constants alone, or no constant left: nothing to note
            if noted is not None:
                delattr(root, CONSTANTS_JOINED)
            return
        setattr(root, CONSTANTS_JOINED, (mask, root._version))
        if noted is None:
            count_mask(root, CONSTANT_MASKS_MADE)
    note_constant_gates(root, shown, value)


def note_constant_gates(root: torch.Tensor, shown: torch.Tensor, value: Any) -> None:
    """Note the constant elements ``shown`` (a mask of its shape) of ``root``, a tensor that is no view, as a
    sigmoid-like gate's elements, as a join of constants and activations notes them (``value``: a constant there);
    its other elements stay what they were: a sigmoid-like gate in every element stays one, and a gate of another
    kind (a tanh's) one to a rule that holds gates of any kind (CP-LRP), whose constant elements would else be its
    only gates.

    Examples:
        >>> from tdhook.attribution.rules._gate_writes import gate_marks_shown
        >>> x = torch.ones(2, 2, requires_grad=True)
        >>> gate = torch.sigmoid(x) * 1
        >>> gate.__dict__.update(_tdhook_activation_of=x, _tdhook_sigmoid_gate=True)
        >>> note_constant_gates(gate, torch.tensor([[True, False]] * 2), 2.0)
        >>> bool(gate_marks_shown(gate[:, 1:]))  # its gate's elements a gate's still
        True
    """
    own = root.__dict__
    record = own.get(GATE_WRITTEN)
    before = None
    if record is not None and record[1].get(_SIGMOID, False):  # real sigmoid-like gates' elements: their marks
        marks = record[1]
    elif own.get(_SIGMOID, False) and own.get(_GATE) is not None:  # a sigmoid-like gate in every element
        marks = before = {_GATE: own[_GATE], _SIGMOID: True}
    else:
        source = value if isinstance(value, torch.Tensor) and not value.requires_grad else torch.zeros(())
        marks = {_GATE: source, _SIGMOID: True}
        if record is not None and record[1].get(_GATE) is not None:  # another kind's gates in part: kept apart
            with torch._C.DisableTorchFunction(), torch.no_grad():
                if OTHER_GATES not in own:
                    setattr(root, OTHER_GATES, (record[0].clone(), root._version))
                    count_mask(root, OTHER_MASKS_MADE)
                record[0].fill_(False)  # (the sigmoid-like gates' mask: they counted as such gates)
        elif own.get(_GATE) is not None and OTHER_GATES not in own:  # a gate of another kind in every element
            with torch._C.DisableTorchFunction(), torch.no_grad():
                whole = laid_over_storage(root, torch.ones(root.shape, dtype=torch.bool, device=root.device))
            setattr(root, OTHER_GATES, (whole, root._version))
            count_mask(root, OTHER_MASKS_MADE)
    note_gate_written(root, shown, marks, before)
    if _GATE not in own and OTHER_GATES not in own:  # a gate's values over the rest of a constant: a gate whole
        record = own[GATE_WRITTEN]
        with torch._C.DisableTorchFunction():
            whole = bool(record[0].as_strided(root.shape, root.stride(), root.storage_offset()).all())
        if whole:
            own.update(record[1])


def follows_values(args: tuple, kwargs: dict) -> bool:
    """Whether the elements a call with ``args`` and ``kwargs`` reaches follow a tensor's values: a mask, an index
    (``h.masked_fill(pad, 2.0)``, ``buf[idx] = w``), any tensor among them but the first that holds no floating-point
    values.

    Examples:
        >>> h = torch.zeros(2)
        >>> follows_values((h, torch.tensor([True, False]), 2.0), {}), follows_values((h, slice(0, 1), 2.0), {})
        (True, False)
    """
    values = [*args[1:], *kwargs.values()]
    for value in values:
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, torch.Tensor) and not (item.is_floating_point() or item.is_complex()):
                return True
    return False


def _written(
    root: torch.Tensor, target: torch.Tensor, before: torch.Tensor | bool, region: torch.Tensor | None, activation: bool
) -> torch.Tensor:
    """The mask of ``root``'s storage, true where a constant is, after a write into ``target`` (``root`` or a view of
    it) that reaches ``region`` (``None``: every element of ``target``)."""
    if isinstance(before, torch.Tensor):
        mask = before.clone()
        if region is None and not activation:  # a constant combined with the elements: each stays what it was
            return mask
    else:
        mask = torch.full((root.untyped_storage().nbytes() // root.element_size(),), before, device=root.device)
    if target.element_size() != root.element_size():  # a view as a dtype of another size (``view_as_complex``)
        reached = bytes_reached(mask, root, target, region)
        if activation:
            mask &= ~reached.any(1)
        else:
            mask |= reached.all(1)
        return mask
    shown = mask.as_strided(target.shape, target.stride(), target.storage_offset())
    if region is None:
        shown.fill_(not activation)
    else:
        shown.masked_fill_(region, not activation)
    return mask


def _unknown(func: Any, root: torch.Tensor) -> None:
    """Warn that where ``root``'s constants are is not known after the in-place write ``func``, and drop its mask."""
    root.__dict__.pop(CONSTANTS_JOINED, None)
    name = getattr(func, "__name__", str(func))
    warn_at_caller(
        f"an in-place write ({name}) into a tensor of shape {tuple(root.shape)} with constants beside an activation: "
        f"the elements it reaches are not known (its indices could not be read), and its constant elements are taken "
        f"as an activation's (in a product they would take no relevance); write into a copy out of place "
        f"(torch.cat, torch.where) to keep them",
        UserWarning,
    )
