"""An opt-in ε-rule on the additions of two computed tensors (residual sums).

tdhook splits a sum ``a + b`` exactly: the plain gradient gives ``a`` and ``b``
the shares ``a · g`` and ``b · g`` of the sum's relevance ``(a + b) · g``. zennit
instead turns each residual addition into a module under its ``Norm`` rule,
``R_a = a · R / stabilize(a + b)``, whose stabilizer absorbs a little relevance.
:class:`StabilizedAdditions` reproduces that choice without touching the model
code: while it is active, every addition of two tensors of the same shape that
both carry autograd history (activations, not parameters or constants) has its
incoming gradient rescaled by ``(a + b) / stabilize(a + b)``.

Enable it with ``stabilize_additions=True`` on a rule mapper; the LRP wrapper
then runs the model's forward pass inside this mode.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from tdhook.attribution.rules._arguments import nonnegative
from tdhook.attribution.rules._autograd import (
    is_activation,
    mark_parameter_derived,
    raise_for_transformed_call,
    scale_gradient,
)
from tdhook.attribution.rules._copied_gates import written_in_place
from tdhook.attribution.rules._in_place_writes import WRITES_IN_PLACE
from tdhook.attribution.rules._keeping_graph import graph_kept
from tdhook.attribution.rules._numerics import stabilize
from tdhook.attribution.rules._recomputed import raise_for_checkpoint
from tdhook.attribution.rules._unrecorded_writes import NOT_READ, UNRECORDED, note_out_write, read_unrecorded

__all__ = ["StabilizedAdditions"]

# ``a + b`` and ``a += b`` reach a mode as ``Tensor.add`` and ``Tensor.add_``.
_ADDITIONS = frozenset({torch.add, torch.Tensor.add, torch.Tensor.add_})


class StabilizedAdditions(TorchFunctionMode):
    """Treat each addition of two activations as zennit's ``Sum`` module under ``Norm(epsilon)``.

    Only additions with two operands of the same shape that both have autograd
    history are changed (``a + b``, ``a += b``, ``torch.add(a, b)``, ``a.add_(b)``
    without ``alpha``); bias additions, constants and broadcasts keep the exact split.

    Args:
        epsilon: the stabilizer of the sum (zennit's default is ``1e-6``).

    Examples:
        >>> import torch
        >>> x = torch.tensor([1.0, -2.0], requires_grad=True)
        >>> with StabilizedAdditions(epsilon=0.5):
        ...     y = (2 * x) + (-x)
        >>> torch.equal(y, x.detach())
        True
        >>> torch.autograd.grad(y.sum(), x)[0]  # (a + b) / stabilize(a + b) instead of 1
        tensor([0.6667, 0.8000])
    """

    #: the rescaling keeps the graph in a call that asks for it (``LRP(..., create_graph=True)``)
    differentiable = True
    #: sums of two activations are stabilised (the watch of nonlinear calls names those made by ATen operators)
    stabilizes_sums = True

    def __init__(self, epsilon: float = 1e-6) -> None:
        nonnegative(type(self).__name__, "epsilon", epsilon)
        super().__init__()
        self.epsilon = epsilon

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs and "out" in kwargs:  # an ``out=`` write into an alias, or under no_grad: see _unrecorded_writes
            note_out_write(func, kwargs["out"])
        if UNRECORDED and (read := read_unrecorded(func, args, kwargs)) is not NOT_READ:  # see _unrecorded_writes
            return read
        summed = False
        if func in _ADDITIONS and len(args) == 2:
            raise_for_transformed_call("stabilised additions", args, needs=2)
            # Judged before the call: ``a += b`` gives a constant ``a`` autograd history, but adds no activation to b.
            summed = not kwargs and is_activation(args[0]) and is_activation(args[1]) and args[0].shape == args[1].shape
        if func in WRITES_IN_PLACE:  # a weight an activation is written into is one, as the out-of-place sum is
            result = written_in_place(func, args, kwargs)
        else:
            result = mark_parameter_derived(args, func(*args, **kwargs), func)
        if summed:
            raise_for_checkpoint("stabilised additions")
            if graph_kept() is not None:  # from a copy of the sum, with its history
                total = result.clone()
                scale = total / stabilize(total, self.epsilon)
            else:
                with torch.no_grad():
                    scale = result / stabilize(result, self.epsilon)
            # Rebased in place: ``a += b`` must leave the very tensor ``a`` with the new history.
            result = scale_gradient(result, scale, in_place=True)
        return result
