"""Products with a tensor that is a gate in some of its elements only: the gate's rule there, the others' elsewhere.

A join of sigmoid-like gates and other activations (``m = torch.cat([sigmoid(a), tanh(b)], 1)``, an LSTM cell's
gates computed together) is no gate, but the elements its gates went to are noted as a mask over it (see
:mod:`~tdhook.attribution.rules._joined_gates`), as are those an in-place write made a gate (``c[:, :3] = g``, see
:mod:`~tdhook.attribution.rules._gate_writes`). A product with such a tensor whole (``m * s``, ``s * m``,
``torch.mul(m, s)``, ``m.mul_(s)``) took it as no gate: its gate elements' relevance was shared with the gate (0.94
off, relative L2, under AttnLRP, 0.87 under CP-LRP, 0.14 under EpsilonPlus, against the same model with the join's
pieces multiplied apart). :func:`mixed_gate_product` gives it, element by element, the rule its factors' elements
would get apart: where one factor's element is a sigmoid-like gate and the other's is none, that factor held
(signal-take-all); where neither (or both) is, with ``any_gate`` (CP-LRP), one that is a gate of another kind (an
activation's output) held; elsewhere the rule of a product without gates (AttnLRP's uniform rule, the plain
gradient under the CNN presets). Its values are the product's own.

A join of gates of another kind beside other activations, and no sigmoid-like gate (``torch.cat([tanh(a), relu(h)],
1)``), notes where they went alone: with ``any_gate``, a product with it (or a view of it) holds them there.

A join notes where its gates of another kind went (``torch.cat([sigmoid(a), tanh(b)], 1)``: ``tanh(b)``'s
elements, held by CP-LRP) as a mask over it, with the join's version; an in-place write into part of a tensor that
mixes the kinds notes it anew (see :mod:`~tdhook.attribution.rules._other_gate_writes`). Where a write leaves it not
known (a view as a dtype of another size), a product that would hold them raises rather than guess.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tdhook.attribution.rules._autograd import hold, is_activation
from tdhook.attribution.rules._gate_writes import GATE_MASKS_MADE
from tdhook.attribution.rules._in_place_writes import GATE_MARKS, gate_marks_of
from tdhook.attribution.rules._joined_gates import (
    CONSTANT_MASKS_MADE,
    OTHER_MASKS_MADE,
    _gates_shown,
    constants_shown,
    other_gates_shown,
)

__all__ = ["gate_elements", "mixed_gate_in_place", "mixed_gate_product"]

_GATE, _SIGMOID = GATE_MARKS


def gate_elements(value: Any) -> tuple[torch.Tensor, Any] | None:
    """Where ``value``, a tensor (or a view of one) whose sigmoid-like gate elements are noted, is such a gate in
    some of its elements only: a mask of its shape, and the gate's source; ``None`` where it is one in every element
    or in none, or no mask is noted (its own marks then tell).

    Examples:
        >>> from tdhook.attribution.rules._joined_gates import mark_joined_gate
        >>> x = torch.ones(2, 4, requires_grad=True)
        >>> pieces = [torch.sigmoid(x[:, :2] * 1), x[:, 2:] * 2]  # a gate beside an activation
        >>> pieces[0].__dict__.update(_tdhook_activation_of=x, _tdhook_sigmoid_gate=True)
        >>> mixed = torch.cat(pieces, 1)
        >>> mark_joined_gate(torch.cat, (pieces, 1), {}, mixed)
        >>> gate_elements(mixed)[0].tolist(), gate_elements(mixed[:, :2])
        ([[True, True, False, False], [True, True, False, False]], None)
    """
    shown = _gates_shown(value) if GATE_MASKS_MADE and isinstance(value, torch.Tensor) else None
    if shown is None:
        return None
    with torch._C.DisableTorchFunction(), torch.no_grad():  # an inspection, which a function mode must not see
        try:
            return None if bool(shown[0].all()) or not bool(shown[0].any()) else shown
        except (RuntimeError, NotImplementedError):  # a mask on the meta device: no values to read
            return None


def mixed_gate_product(
    func: Callable,
    args: tuple,
    kwargs: dict,
    any_gate: bool,
    ungated: Callable[[tuple], torch.Tensor],
    factors: tuple | None = None,
    first: bool = True,
) -> torch.Tensor | None:
    """``func(*args, **kwargs)``, a product of two activations of which one at least is a sigmoid-like gate in some
    of its elements only (see :func:`gate_elements`), with the rule of the module's docstring element by element:
    ``ungated(args)`` is the product under the rule of a product without gates; ``None`` where no factor is such a
    gate in part. ``factors``: the factors multiplied, where they are not ``args`` (a copy of a factor an in-place
    product writes into); with ``first`` false the first factor is never held (the CNN presets' ``g.mul_(h)``).

    Raises:
        NotImplementedError: with ``any_gate``, where a factor's gates of another kind are not known (see the
            module's docstring).

    Examples:
        >>> from tdhook.attribution.rules._joined_gates import mark_joined_gate
        >>> x = torch.tensor([[1.0, -2.0]], requires_grad=True)
        >>> pieces = [torch.sigmoid(x[:, :1] * 1), x[:, 1:] * 2]  # a gate beside an activation
        >>> pieces[0].__dict__.update(_tdhook_activation_of=x, _tdhook_sigmoid_gate=True)
        >>> mixed = torch.cat(pieces, 1)
        >>> mark_joined_gate(torch.cat, (pieces, 1), {}, mixed)
        >>> signal = x * 3
        >>> z = mixed_gate_product(torch.mul, (mixed, signal), {}, False, lambda factors: torch.mul(*factors))
        >>> torch.equal(z, mixed * signal)
        True
        >>> grad = torch.autograd.grad(z.sum(), x)[0]  # the gate held; the other element's plain gradient
        >>> torch.allclose(grad, torch.tensor([[3 * torch.sigmoid(x[0, 0]).item(), -24.0]]))
        True
    """
    if len(args) != 2 or not (is_activation(args[0]) and is_activation(args[1])):
        return None
    shown = [gate_elements(a) for a in args]
    if shown[0] is None and shown[1] is None and not (any_gate and OTHER_MASKS_MADE and _other_in_part(args)):
        if not (CONSTANT_MASKS_MADE and any(constants_shown(a) is not None for a in args)):
            return None
    with torch._C.DisableTorchFunction(), torch.no_grad():  # bookkeeping, which a function mode must not see
        held = _held_elements(args, shown, any_gate)
    if not first:  # (but its constants: times a constant, the product is a linear map of the other factor)
        constant = constants_shown(args[0]) if CONSTANT_MASKS_MADE else None
        held[0] = torch.zeros((), dtype=torch.bool, device=held[0].device) if constant is None else constant
    factors = args if factors is None else factors
    products = [func(*(hold(a) if i == place else a for i, a in enumerate(factors)), **kwargs) for place in (0, 1)]
    return torch.where(held[0], products[0], torch.where(held[1], products[1], ungated(factors)))


def mixed_gate_in_place(args: tuple) -> bool:
    """Whether ``args`` of an in-place product (``h.mul_(m)``) are a signal, no gate in any element, and a gate in
    some elements only (see :func:`gate_elements`), or a signal with constants in some elements (held there: it lost
    their product's relevance under the CNN presets, 0.21-1.1 off, relative L2), in a call autograd records.

    Examples:
        >>> x = torch.ones(2, 2, requires_grad=True)
        >>> mixed_gate_in_place((x * 2, x * 3))  # no gate in part
        False
    """
    if len(args) != 2 or not torch.is_grad_enabled():
        return False
    if CONSTANT_MASKS_MADE and constants_shown(args[0]) is not None:  # constants in part (``h.masked_fill(m, 2.0)``)
        return True
    return gate_elements(args[1]) is not None and not _whole(args[0], _GATE) and gate_elements(args[0]) is None


def _held_elements(args: tuple, shown: list, any_gate: bool) -> list[torch.Tensor]:
    """Where each of a product's two factors ``args`` is held (``shown``: their gate elements, see
    :func:`gate_elements`): masks that broadcast to the product's shape."""
    device = args[0].device
    sigmoid = [
        torch.tensor(_whole(a, _SIGMOID), device=device) if part is None else part[0]
        for a, part in zip(args, shown, strict=True)
    ]
    held = [sigmoid[0] & ~sigmoid[1], sigmoid[1] & ~sigmoid[0]]
    if any_gate:  # where the sigmoid-like gates do not tell, a gate of another kind
        gates = [
            _whole_or_other(a, device) if part is None else _other_gates(a) for a, part in zip(args, shown, strict=True)
        ]
        alike = sigmoid[0] == sigmoid[1]
        held = [held[0] | (alike & gates[0] & ~gates[1]), held[1] | (alike & gates[1] & ~gates[0])]
    # A constant joined with activations (noted as a sigmoid-like gate's element) beside a factor's element that is
    # none: held, whatever the other is (times a sigmoid-like gate, the two alike shared the product).
    constant = [constants_shown(a) for a in args]
    if constant[0] is not None or constant[1] is not None:
        masks = [torch.tensor(False, device=device) if c is None else c for c in constant]
        alone = [masks[0] & ~masks[1], masks[1] & ~masks[0]]
        held = [(held[0] & ~alone[1]) | alone[0], (held[1] & ~alone[0]) | alone[1]]
    return held


def _whole(value: Any, mark: str) -> bool:
    """Whether ``value`` is, in every element, a gate (``mark``: a gate's mark) of that kind. (The gate mark holds
    the gate's source, a tensor: its presence tells, not its values.)"""
    found = gate_marks_of(value).get(mark)
    return found is not None and found is not False


def _other_in_part(args: tuple) -> bool:
    """Whether a factor of ``args`` is a join of gates of another kind alone beside other activations (or a view of
    one, see :data:`~tdhook.attribution.rules._joined_gates.OTHER_MASKS_MADE`): a mask of where they are."""
    return any(isinstance(other_gates_shown(a), torch.Tensor) for a in args)


def _whole_or_other(value: Any, device: torch.device) -> torch.Tensor:
    """Where ``value``, a factor that shows no sigmoid-like gate in part, is a gate of any kind: its join's mask
    where one noted it (a join of gates of another kind beside other activations), else its own mark."""
    other = other_gates_shown(value) if isinstance(value, torch.Tensor) else None
    if isinstance(other, torch.Tensor) and not _whole(value, _GATE):
        return other
    return torch.tensor(_whole(value, _GATE), device=device)


def _other_gates(value: torch.Tensor) -> torch.Tensor:
    """Where ``value`` (a join of gates and other activations, or a view of one) is a gate of any kind."""
    other = other_gates_shown(value)
    if other is None:  # gates written in place (``c[:, 2:] = g``): no join noted others, its sigmoid-like gates tell
        return gate_elements(value)[0]
    if other is False:
        raise NotImplementedError(
            f"a product of two activations, one a sigmoid-like gate in some of its elements only (shape "
            f"{tuple(value.shape)}, a join of gates and other activations), under a rule that holds gates of any "
            f"kind: where its other elements are such gates is not known after an in-place write into the join; "
            f"multiply its pieces apart, or write into a copy"
        )
    return other
