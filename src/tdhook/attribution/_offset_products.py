"""Products of activations where a factor adds a number: ``(up + 1) · glu``, ``norm(x) · (1 + scale)``.

The function rules of AttnLRP and CP-LRP split a product of two activations between its factors (or hold one of
them, a gate). A factor that adds a number to an activation (GPT-OSS's experts compute ``(up + 1) · glu``, an
adaptive norm ``norm(x) · (1 + scale(c))``) passes on only the share of the relevance its activation takes: the
number takes the rest, as a bias does, and it cannot be zeroed as a bias can. The relevance is then not conserved
there, by as much as the number weighs in the factor (CP-LRP keeps 0.87 of the logit on a tiny GPT-OSS).
:class:`OffsetProducts` follows the calls of one watched forward pass (see
:class:`~tdhook.attribution._nonlinear_calls.NonlinearCalls`): it notes the sums of an activation and a number,
and finds the products of two activations with such a factor that the rules do not hold, so that the first call
of a context names the module in a warning.

Examples:
    >>> up, glu = (torch.randn(3, requires_grad=True) * 1 for _ in range(2))
    >>> found = OffsetProducts()
    >>> shifted = up + 1
    >>> found.note("add", (up, 1), shifted)
    >>> found.unheld((shifted.view(3), glu)), found.unheld((up, glu))
    (True, False)
    >>> found.forget()  # the end of the watched call
    >>> found.unheld((shifted, glu))
    False
"""

from __future__ import annotations

from typing import Any

import torch

from tdhook.attribution.rules._autograd import is_activation
from tdhook.attribution.rules.gates import held_factors

__all__ = ["OFFSET_PRODUCT", "OffsetProducts"]

#: the name under which a module's products with an offset factor are counted (see :mod:`~tdhook.attribution.coverage`)
OFFSET_PRODUCT = "a product whose factor adds a number ((a + 1) * b)"

# Sums and differences, as :func:`~tdhook.attribution._function_kinds.function_kind` names them.
_SUMS = frozenset({"add", "sub", "rsub"})
# Nodes that only reshape, select or copy: the offset may be made before them (AltUp permutes its coefficients).
_PASSED = frozenset(
    "ViewBackward0 UnsafeViewBackward0 ReshapeAliasBackward0 UnsqueezeBackward0 SqueezeBackward0 SqueezeBackward1 "
    "SqueezeBackward2 ExpandBackward0 CloneBackward0 ToCopyBackward0 TransposeBackward0 PermuteBackward0 TBackward0 "
    "SliceBackward0 SelectBackward0 RepeatBackward0 IndexBackward0".split()
)
# Nodes that scale by a number (``(a + 3) / 6``) or clip element-wise, piecewise linearly (``relu6(a + 3)`` in a
# hand-written hard swish, ``relu(a + 1)``): the number still takes its share of what passes back through them. A
# clip the rules hold as a gate (CP-LRP holds any activation's output) takes no relevance, and is no reason. A clip
# under the pass rule (AttnLRP's on ``F.relu6``) is the rule's node, with the sum as its one edge.
_PASSED |= frozenset(
    "_RedirectBackward MulBackward0 DivBackward0 ReluBackward0 HardtanhBackward0 ClampBackward1 ClampMinBackward0 "
    "ClampMaxBackward0 LeakyReluBackward0 ThresholdBackward0".split()
)
_DEPTH = 8  # nodes walked back at most


class OffsetProducts:
    """The sums of an activation and a number in one watched forward pass, and the products they are factors of."""

    def __init__(self) -> None:
        self._offsets: set = set()  # the autograd nodes of those sums (alive while the pass's graph is)

    def note(self, name: str, args: tuple, result: Any) -> None:
        """Note ``result`` where the call (``name``: its function's, ``"add"`` for ``__radd__``) adds a nonzero
        number to one activation (``a + 1``, ``1 - a``, ``torch.add(a, 1)``)."""
        if name not in _SUMS or len(args) < 2 or not isinstance(result, torch.Tensor) or result.grad_fn is None:
            return
        numbers = [a for a in args[:2] if isinstance(a, (int, float)) and not isinstance(a, bool) and a != 0]
        if len(numbers) == 1 and sum(is_activation(a) for a in args[:2]) == 1:
            self._offsets.add(result.grad_fn)

    def unheld(self, factors: tuple[Any, ...], hold_gates: bool = False) -> bool:
        """Whether a product of the two activations ``factors`` has a factor noted by :meth:`note` (up to reshapes
        and copies) that the rules do not hold (a held gate takes no relevance; with ``hold_gates``, as under CP-LRP,
        any activation function's output is one).

        Args:
            factors: the product's factors.
            hold_gates: whether the rules hold every gate, not only sigmoid-like ones.
        """
        if not self._offsets or len(factors) != 2 or not all(is_activation(factor) for factor in factors):
            return False
        offsets = [self._is_offset(factor) for factor in factors]
        if not any(offsets):
            return False
        held = held_factors(tuple(factors), any_gate=hold_gates) or [False, False]
        return any(offset and not kept for offset, kept in zip(offsets, held, strict=True))

    def forget(self) -> None:
        """Drop the noted sums (the end of the watched pass)."""
        self._offsets.clear()

    def _is_offset(self, factor: torch.Tensor) -> bool:
        node = factor.grad_fn
        for _ in range(_DEPTH):
            if node in self._offsets:
                return True
            edges = [edge for edge, _ in node.next_functions if edge is not None]
            if type(node).__name__ not in _PASSED or len(edges) != 1:
                return False
            node = edges[0]
        return False
