"""Products of two activations written in place (``a.mul_(b)``, ``a *= b``, ``a.multiply_(b)``): the rules of ``a * b``.

Under AttnLRP and CP-LRP a product of two activations gets the uniform rule (each factor half of the product's
relevance), or holds one factor constant where it is a gate or a statistic (a norm's scale): see
:class:`~tdhook.attribution.rules.functional.FunctionalRules`. Written in place, the product overwrites its first
factor; :func:`product_in_place` gives it the rule its out-of-place form gets, with the values torch's in-place
call writes:

* the uniform rule: the in-place product, whose gradient is then halved on the tensor itself (rebased in place, a
  view of another tensor included, as the out-of-place product is);
* the second factor held (a signal times its gate, ``h.mul_(g)``; a norm written in place,
  ``h.mul_(torch.rsqrt(var + eps))``; branches mixed by a softmax's weights, ``paths.mul_(weights)``): the product
  by the factor held;
* the first factor held (a gate or weights written into by its signal, ``g.mul_(h)``): the product of the first
  factor's values, held, and the second factor, copied into the first (the product's node keeps a copy of the old
  values, which the write would change).

What is written into is no gate, statistic or softmax's weights after the write, as the out-of-place product of two
activations is none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from tdhook.attribution.rules._autograd import PARAMETER_DERIVED, hold, is_activation, scale_gradient
from tdhook.attribution.rules._gate_writes import GATE_MASKS_MADE, GATE_WRITTEN
from tdhook.attribution.rules._held_statistics import statistic_factors
from tdhook.attribution.rules._held_values import held_product_kind
from tdhook.attribution.rules._in_place_writes import mark_written_in_place, note_gate_views
from tdhook.attribution.rules._joined_weights import (
    WEIGHTS_MASKS_MADE,
    mixed_weights_product,
    weights_held_where_mixed,
)
from tdhook.attribution.rules._mixed_gate_products import mixed_gate_product
from tdhook.attribution.rules.gates import (
    GATE_MARK,
    SIGMOID_MARK,
    WEIGHTS_MARK,
    held_factors,
    mark_held_kind,
    weighing_factors,
)

if TYPE_CHECKING:
    from tdhook.attribution._function_rule_plan import Recording

__all__ = ["PRODUCTS_IN_PLACE", "product_in_place", "two_activations_in_place"]

#: the in-place products of two tensors that get the rules of ``a * b``
PRODUCTS_IN_PLACE = frozenset({torch.Tensor.mul_, torch.Tensor.__imul__, torch.Tensor.multiply_})


def two_activations_in_place(func: Any, args: tuple, kwargs: dict | None) -> bool:
    """Whether ``func(*args, **kwargs)`` is an in-place product of two activations (``a.mul_(b)``, ``a *= b``).

    Examples:
        >>> a, b = torch.ones(2, requires_grad=True) * 2, torch.ones(2, requires_grad=True) * 3
        >>> mul_ = torch.Tensor.mul_
        >>> two_activations_in_place(mul_, (a, b), {}), two_activations_in_place(mul_, (a, 2), {})
        (True, False)
    """
    return (
        func in PRODUCTS_IN_PLACE
        and not kwargs
        and len(args) == 2
        and is_activation(args[0])
        and is_activation(args[1])
    )


def product_in_place(
    func: Any, a: torch.Tensor, b: torch.Tensor, hold_gates: bool, recording: Recording | None = None
) -> torch.Tensor:
    """``func(a, b)``, a product of two activations written into ``a``, with the rule of ``a * b``: the uniform rule,
    or the gate (any gate with ``hold_gates``, else a sigmoid-like one), statistic or softmax's weights held constant.
    ``recording`` (see :mod:`~tdhook.attribution._function_rule_plan`) is told what was done: the uniform rule on a
    tensor that is no view, as the out-of-place product's; any other rule keeps the mode in later calls.

    Examples:
        >>> x = torch.tensor([2.0, -1.0], requires_grad=True)
        >>> a, b = x * 3, x * 1
        >>> y = product_in_place(torch.Tensor.mul_, a, b, hold_gates=False)
        >>> y is a, y.tolist()
        (True, [12.0, 3.0])
        >>> (x * torch.autograd.grad(y.sum(), x)[0]).tolist()  # each factor half of the product: all of it to x
        [12.0, 3.0]
    """
    if not torch.is_grad_enabled():  # autograd records nothing: no rule, the write noted (see _unrecorded_writes)
        return mark_written_in_place(func, (a, b), {})
    kind = held_product_kind((a, b), hold_gates)  # of two factors products hold: one too, as out of place
    product = _ruled_in_place(func, a, b, hold_gates, recording)
    mark_held_kind(product, kind)
    return product


def _ruled_in_place(
    func: Any, a: torch.Tensor, b: torch.Tensor, hold_gates: bool, recording: Recording | None
) -> torch.Tensor:
    """The rule of :func:`product_in_place`, its result marked no gate nor weights."""
    if GATE_MASKS_MADE:  # a factor a gate in some elements only (see _mixed_gate_products): ``a * b``'s rule, copied
        ungated = weights_held_where_mixed(torch.mul, (a, b), {}, _uniform)  # (a join's weights in part: held)
        product = mixed_gate_product(torch.mul, (a, b), {}, hold_gates, ungated, (a.clone(), b))
        if product is not None:
            if recording is not None:
                recording.other_rule()
            return _no_gate(a.copy_(product))
    gates = statistic_factors(torch.mul, (a, b)) or held_factors((a, b), any_gate=hold_gates)
    if gates is None and WEIGHTS_MASKS_MADE:  # a factor a softmax's weights in some elements only (_joined_weights)
        product = mixed_weights_product(torch.mul, (a, b), {}, _uniform, (a.clone(), b))
        if product is not None:
            if recording is not None:
                recording.other_rule()
            return _no_gate(a.copy_(product))
    if gates is None:  # a softmax's weights mixing what they multiply (``h.mul_(weights)``): held, as in ``h * w``
        gates = weighing_factors((a, b))
    view = a._base is not None
    if gates is None:  # the uniform rule: half of the product's gradient to each factor
        product = func(a, b)
        node = product.grad_fn
        scaled = scale_gradient(product, 0.5, in_place=True)
        if recording is not None and view:
            recording.other_rule()
        elif recording is not None:
            recording.scaled(node, scaled.grad_fn)
        return _no_gate(scaled)
    if recording is not None:
        recording.other_rule()
    if not gates[0]:  # the factor written into is the signal: the gate (or statistic) it is multiplied by held
        return _no_gate(func(a, hold(b)))
    product = hold(a.clone()) * (hold(b) if gates[1] else b)
    written = _no_gate(a.copy_(product))
    if gates[1]:  # two statistics: a product of scales is a constant, as out of place
        setattr(written, PARAMETER_DERIVED, True)
    return written


def _uniform(factors: tuple) -> torch.Tensor:
    """The product of two factors under the uniform rule, half its gradient to each."""
    return scale_gradient(torch.mul(*factors), 0.5)


def _no_gate(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` without the marks of a gate or a softmax's weights, nor (a gate's) the tensor it views: a product of
    two activations is none. Views of them taken before the product show none either (see
    :func:`~tdhook.attribution.rules._in_place_writes.note_gate_views`; ``v = g[:, :2]``, then ``g.mul_(h)``, left
    ``v`` a gate, held in a product: 1.1 off, relative L2, under AttnLRP)."""
    tensor.__dict__.pop(WEIGHTS_MARK, None)
    root = tensor if tensor._base is None else tensor._base
    if (
        GATE_MARK in root.__dict__
        or GATE_MARK in tensor.__dict__
        or (GATE_MASKS_MADE and GATE_WRITTEN in root.__dict__)
    ):
        note_gate_views(tensor, None, None)
        for written in (tensor, root):
            written.__dict__.pop(GATE_MARK, None)
            written.__dict__.pop(SIGMOID_MARK, None)
    return tensor
