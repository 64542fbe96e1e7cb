"""Half-precision targets whose gradient overflows: the target's relevance again, scaled down by a power of two.

The gradient of a tensor ``a`` carries ``R / a``, the ratio of its relevance to its value. In float16, whose largest
value is 65504, that ratio overflows where a relevance of 0.1 sits on values below about 1.5e-6: a callable target of
1 on outputs near 1e-5 (``R / ε`` of the ε-rule at an output of 0 is 1e6), or inputs near 1e-5 through a model
without biases. Its infinities then meet zeros or each other in the next layer as NaN, and the relevance came out
NaN. Every rule is linear in the relevance it receives, so a target's relevance scaled by ``s`` gives ``s`` times
the relevance: where a float16 output gives non-finite relevance from a finite target, the target's relevance is
scaled by a power of two (exact) before it is divided by the output, the backward pass runs again, and its
relevance (``x · grad`` in float32) is divided by ``s`` before it is rounded to float16. The first float16 pass keeps
the graph for that (its saved tensors live until the call ends, not until the pass frees them); a float16 pass
that stays finite is the one it always was. bfloat16 has float32's range, and float32, float64 and bfloat16 run one
pass, as before. Where no scale down to 2^-24 gives finite relevance, the call raises rather than return NaN.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tdhook.attribution.rules._caller import warn_at_caller
from tdhook.attribution.rules._half_precision import in_scaled_pass, scaled_pass

__all__ = [
    "SCALES",
    "UNRECORDED",
    "Overflowing",
    "check_overflow",
    "relevance_product",
    "scaled_target",
    "scaled_when_overflowing",
]

#: The scales tried after a non-finite pass, halving each time down to 2^-24: the first that gives finite relevance
#: is the largest, whose gradients inside the network round to 0 the least (a jump from 1 to 2^-8 lost all the
#: relevance of a float16 MobileNet-V3 whose quotient overflowed by less than 2).
SCALES = tuple(2.0**-k for k in range(1, 25))


class _Unrecorded:
    """Where a pass at a smaller scale records the inputs it reached: nowhere (its first pass recorded them)."""

    def record(self, key: object, reached: list[bool]) -> None:
        """Nothing to record."""


#: The sink of :meth:`~tdhook.attribution._backward_passes.InputsReached.record` for passes at a smaller scale.
UNRECORDED = _Unrecorded()


class Overflowing(Exception):
    """A target's relevance over its output overflows float16 at a non-zero output: a smaller scale carries it."""


def check_overflow(output: torch.Tensor, rest: torch.Tensor | None, scale: float) -> None:
    """Raise :class:`Overflowing` where ``rest`` (the target's relevance that ``output × gradient`` cannot carry,
    and no rule of the layers before the output can) sits on non-zero float16 outputs, whose ``R / output``
    overflowed, and a smaller scale is left to try. At the smallest scale, or at outputs that are exactly 0, the
    caller raises its own error, as in float32.

    Examples:
        >>> out = torch.tensor([1e-6, 0.0, 1.0], dtype=torch.float16)
        >>> check_overflow(out, torch.tensor([0.0, 1.0, 0.0], dtype=torch.float16), 1.0)  # only at an output of 0
        >>> check_overflow(out, torch.tensor([1.0, 0.0, 0.0], dtype=torch.float16), 1.0)
        Traceback (most recent call last):
        ...
        tdhook.attribution._scaled_passes.Overflowing
    """
    if rest is None or output.dtype is not torch.float16 or scale <= SCALES[-1]:
        return
    if bool(rest.ne(0).logical_and_(output.detach().ne(0)).any()):
        raise Overflowing


def relevance_product(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``x * grad``, the relevance a backward pass gives ``x``; in float32 in a pass at a smaller scale, whose
    relevance is divided back before it is rounded to ``x``'s dtype (a small scaled relevance would round to 0).

    Examples:
        >>> relevance_product(torch.tensor([2.0]), torch.tensor([3.0]))
        tensor([6.])
    """
    if not in_scaled_pass():
        return x * grad
    return x.float() * grad.float()


def scaled_target(target: object, scale: float) -> object:
    """A callable ``target`` whose relevance is ``scale`` times its own, scaled before it is rounded to the output's
    dtype; any other target as it is (its initial gradient is scaled instead).

    Examples:
        >>> scaled_target(lambda y: y * 2, 0.5)(torch.tensor([3.0]))
        tensor([3.])
        >>> scaled_target(None, 0.5) is None
        True
    """
    if scale == 1 or not callable(target):
        return target
    return lambda output: target(output) * scale


def scaled_when_overflowing(
    relevance_at: Callable[[float, bool], list[torch.Tensor | None]],
    output: torch.Tensor | None,
    retain: bool,
    key: object = None,
    inputs: Sequence[torch.Tensor | None] = (),
    scalable: bool = True,
    seeds: Sequence[torch.Tensor] = (),
) -> list[torch.Tensor | None]:
    """``relevance_at(1.0, retain)``, a target's relevances from its backward pass, or where a float16 ``output``
    gives non-finite relevance, ``relevance_at(scale, keep)`` with the target's relevance scaled by each of
    :data:`SCALES` in turn, divided back, until it is finite (``output`` ``None``: one pass, as in float32). Where
    ``output`` or one of ``inputs`` is not finite, the relevance follows it in one pass, as in float32. A target
    that is not ``scalable`` (``target="all"``, whose units are passed one by one) gets one pass, checked.
    ``seeds``: where ``relevance_at`` puts the target's relevance at the output (the first is read to tell relevance
    that rounded to 0 in float16 from none at all; the output where none is given).

    Raises:
        FloatingPointError: the relevance is still not finite at the smallest scale, naming the target and dtype.

    Examples:
        >>> x = torch.full((2,), 1e-6, dtype=torch.float16, requires_grad=True)
        >>> y = x * 1
        >>> def relevance_at(scale, keep):
        ...     seed = torch.ones_like(y) * scale / y.detach()  # R / y: 1 / 1e-6 overflows float16
        ...     return [x.detach() * torch.autograd.grad(y, x, seed, retain_graph=keep)[0]]
        >>> relevance_at(1.0, True)[0]
        tensor([inf, inf], dtype=torch.float16)
        >>> scaled_when_overflowing(relevance_at, y, False, "y")[0]
        tensor([1., 1.], dtype=torch.float16)
    """
    if output is None or output.dtype is not torch.float16:  # bfloat16 has float32's range
        return relevance_at(1.0, retain)
    if not scalable:
        relevances = relevance_at(1.0, retain)
        if _finite(relevances) or not _finite([output, *inputs]):
            return _checked_for_underflow(relevances, output, seeds, inputs, key)
        raise FloatingPointError(
            f"LRP: target {key!r}: the relevance in {output.dtype} is not finite: its gradient (relevance / "
            f"activation) overflows {output.dtype} (a target of every unit is not scaled down); explain the model "
            "in float32"
        )
    try:
        relevances = relevance_at(1.0, True)  # the graph kept for a pass at a smaller scale
        if _finite(relevances) or not _finite([output, *inputs]):
            # A non-finite output or input: the relevance follows it, as in float32.
            return _checked_for_underflow(relevances, output, seeds, inputs, key)
    except Overflowing:  # before the backward pass: the graph is whole
        pass
    for i, scale in enumerate(SCALES):
        last = i == len(SCALES) - 1
        try:
            with scaled_pass(scale):
                scaled = relevance_at(scale, retain or not last)
        except Overflowing:
            continue
        # The inputs' relevance, a product in float32 (relevance_product), back to the input's dtype.
        dtypes = [x.dtype if x is not None else None for x in inputs]
        dtypes += [None] * (len(scaled) - len(dtypes))
        relevances = [
            None if r is None else (r.float() / scale).to(d or r.dtype) for r, d in zip(scaled, dtypes, strict=True)
        ]
        if _finite(relevances):
            return _checked_for_underflow(relevances, output, seeds, inputs, key)
    raise FloatingPointError(
        f"LRP: target {key!r}: the relevance in {output.dtype} is not finite: its gradient (relevance / activation) "
        f"overflows {output.dtype} even with the target's relevance scaled by {SCALES[-1]}; explain the model in "
        "float32"
    )


def _checked_for_underflow(
    relevances: list[torch.Tensor | None],
    output: torch.Tensor,
    seeds: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor | None],
    key: object,
) -> list[torch.Tensor | None]:
    """``relevances``, with a warning where every one is 0 at every entry though the target's relevance at the float16
    ``output`` and an input are not: relevance below float16's smallest step (6e-8 per entry, a target output of 1e-7
    spread over a thousand inputs) rounds to 0, which would read as no relevance at all. The target's relevance is
    the output times the first of ``seeds``, the gradient the pass starts from (the output itself where none is
    given, or for every unit).

    Examples:
        >>> import warnings
        >>> x = torch.ones(2, dtype=torch.float16)
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     _ = _checked_for_underflow([torch.zeros(2, dtype=torch.float16)], x, [], [x], "y")
        >>> "rounds to 0" in str(caught[0].message)
        True
    """
    if any(r is not None and bool(r.detach().any()) for r in relevances):
        return relevances
    seed = seeds[0] if seeds and isinstance(seeds[0], torch.Tensor) else None  # every unit's: the output
    target = output.detach() if seed is None else output.detach().float() * seed.detach().float()
    if not bool(target.any()) or not any(x is not None and bool(x.detach().any()) for x in inputs):
        return relevances
    largest = target.abs().max().item()
    warn_at_caller(
        f"LRP: target {key!r}: the relevance in float16 is 0 at every entry, though the target's relevance (largest "
        f"|value| {largest:.1e}) and the inputs are not: relevance below float16's smallest step (6e-8 per entry) "
        "rounds to 0, which would read as no relevance at all (an output whose gradient reaches no explained input, "
        "a dead layer, gives 0 in float32 too); explain the model in float32 to tell"
    )
    return relevances


def _finite(tensors: Sequence[torch.Tensor | None]) -> bool:
    return all(t is None or bool(t.detach().isfinite().all()) for t in tensors)
