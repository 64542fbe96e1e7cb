"""A softmax's weights joined by ``torch.cat`` or ``torch.stack``: weights where every element joined is one.

A softmax's output (see :func:`~tdhook.attribution.rules.gates.mark_weights`) multiplied element by element with an
activation weighs it, and AttnLRP holds it constant there. Weights computed in pieces and joined again (attention
written with a loop over heads, ``torch.stack([softmax(q_h @ k_hᵀ) for h ...], 1)``, or ``torch.cat`` of each head's
weights along the batch dimension; branches' weights per group) were no weights: a product ``w * v`` shared its
relevance with them (0.50-0.51 off, relative L2, under AttnLRP, with and without its ε, against the same attention with
one batched softmax). :func:`mark_joined_weights` marks such a join as weights where every piece is weights (or a
constant: held or not, it passes no gradient).

A join of weights and other activations (``torch.cat([softmax(a), h], 1)``) is no weights, but the elements its
weights went to are: they are noted as a mask over the join, with the join's version, and a product with the join
(or a view of it: ``chunk``, a slice, a reshape; or a copy: ``mixed.t().contiguous()``, ``mixed.flip(1)``, see
:func:`keep_weights_elements`) holds, element by element, the weights there (:func:`mixed_weights_product`). An
in-place write into such a tensor, or of weights into part of another (a mixture's combine weights scattered into a
buffer), is followed (:func:`note_weights_written`); where its weights are after a write the modes did not see is not
known: such a product raises rather than guess.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tdhook.attribution.rules._autograd import hold, is_activation
from tdhook.attribution.rules._storage_masks import count_mask, laid_over_storage, shown_of_storage

__all__ = [
    "WEIGHTS_MARK",
    "WEIGHTS_MASKS_MADE",
    "keep_weights_elements",
    "mark_joined_weights",
    "mixed_weights_product",
    "note_weights_written",
    "weights_held_where_mixed",
    "weights_shown",
]

#: The attribute that marks a softmax's output (weights in [0, 1] summing to 1): held where it multiplies an
#: activation element by element (see :func:`~tdhook.attribution.rules.gates.weighing_factors`); a matrix product
#: with it is attention, and shares its relevance.
WEIGHTS_MARK = "_tdhook_softmax_weights"
# On a join of weights and other activations: a mask of its shape, true where weights (or a constant) went, and the
# join's version then.
_WEIGHTS_JOINED = "_tdhook_weights_joined"
#: One entry a mask alive (see :func:`~tdhook.attribution.rules._storage_masks.count_mask`): products pay for the
#: look-up only while one is.
WEIGHTS_MASKS_MADE: list[bool] = []


def mark_joined_weights(func: Any, args: tuple, kwargs: dict, result: Any) -> None:
    """Mark ``result``, the output of the join ``func(*args, **kwargs)``, as a softmax's weights where every piece
    joined is weights or a constant, and at least one is weights; where only some are, note their elements on
    ``result`` (see the module's docstring).

    Examples:
        >>> x = torch.ones(2, 3, requires_grad=True)
        >>> heads = [torch.softmax(x * 1, -1), torch.softmax(x * 2, -1)]
        >>> for head in heads:
        ...     head.__dict__["_tdhook_softmax_weights"] = True
        >>> joined = torch.stack(heads, 1)
        >>> mark_joined_weights(torch.stack, (heads, 1), {}, joined)
        >>> joined.__dict__.get("_tdhook_softmax_weights")
        True
        >>> pieces = [heads[0], x * 3]  # weights beside an activation
        >>> mixed = torch.cat(pieces, 1)
        >>> mark_joined_weights(torch.cat, (pieces, 1), {}, mixed)
        >>> weights_shown(mixed).tolist()
        [[True, True, True, False, False, False], [True, True, True, False, False, False]]
    """
    pieces = args[0] if args else kwargs.get("tensors", ())
    if not isinstance(result, torch.Tensor) or not isinstance(pieces, (list, tuple)) or not pieces:
        return
    if kwargs.get("out") is not None:  # (under no_grad alone: a tensor written into, whose views this does not follow)
        return
    with torch._C.DisableTorchFunction():  # (a property read is a call of another mode)
        whole = [WEIGHTS_MARK in piece.__dict__ or not is_activation(piece) for piece in pieces]
        shown = [None if keep else weights_shown(piece) for piece, keep in zip(pieces, whole, strict=True)]
        if all(whole):
            result.__dict__[WEIGHTS_MARK] = True
            return
        if not any(WEIGHTS_MARK in piece.__dict__ for piece in pieces) and all(part is None for part in shown):
            return  # no weights joined (rotary embeddings' ``cat`` while a mask is alive)
        if any(part is False for part in shown):  # a piece of a join written into since: not known
            _note_weights(result, False)
            return
        with torch.no_grad():  # bookkeeping, which a function mode must not see
            flags = [
                torch.full(piece.shape, keep, dtype=torch.bool, device=result.device) if part is None else part
                for piece, keep, part in zip(pieces, whole, shown, strict=True)
            ]
            region = func(flags, *args[1:], **{k: v for k, v in kwargs.items() if k != "tensors"})
    if region.shape == result.shape:
        _note_weights(result, region)


def note_weights_written(
    target: torch.Tensor, region: torch.Tensor | None, weights: bool, before: torch.Tensor | bool | None
) -> None:
    """Note, after an in-place write into ``target`` (a tensor, or a view of one) that made its elements ``region`` (a
    mask of its shape; ``None``: all) a softmax's weights' (``weights``) or not, where the tensor is weights now:
    ``before``, where it was, read before the write (:func:`weights_shown` of the tensor; ``True`` or ``False`` where
    it was weights or a constant in every element, or in none). Weights written into part of a buffer (a mixture's
    combine weights, ``torch.zeros(b, e).scatter(1, top, w)``) were no weights: the product with them took the
    uniform rule under AttnLRP (0.76-0.92 off, relative L2, against the products apart).

    Examples:
        >>> x = torch.ones(2, 3, requires_grad=True)
        >>> w = torch.softmax(x * 1, -1)
        >>> w.__dict__[WEIGHTS_MARK] = True
        >>> buffer = torch.zeros(2, 3)
        >>> buffer[:, :2] = w[:, :2]
        >>> note_weights_written(buffer, None, True, True)  # into a constant: weights (or constants) whole
        >>> buffer.__dict__.get(WEIGHTS_MARK)
        True
    """
    if before is False and not weights:
        return
    with torch._C.DisableTorchFunction(), torch.no_grad():  # bookkeeping, which a function mode must not see
        root = target if target._base is None else target._base
        own = root.__dict__
        own.pop(WEIGHTS_MARK, None)
        own.pop(_WEIGHTS_JOINED, None)
        shown = before if isinstance(before, torch.Tensor) else torch.full(root.shape, bool(before), device=root.device)
        storage = laid_over_storage(root, shown)
        if storage is None:
            return
        written = storage.as_strided(target.shape, target.stride(), target.storage_offset())
        if region is None:
            written.fill_(weights)
        else:
            written.masked_fill_(region, weights)
        now = storage.as_strided(root.shape, root.stride(), root.storage_offset())
        every, some = bool(now.all()), bool(now.any())
    if every:
        own[WEIGHTS_MARK] = True
    elif some:
        setattr(root, _WEIGHTS_JOINED, (storage, root._version))
        count_mask(root, WEIGHTS_MASKS_MADE)


def _note_weights(result: torch.Tensor, region: torch.Tensor | bool) -> None:
    """Note on ``result`` where it is weights: ``region``, a mask of its shape (``False``: not known)."""
    mask = None if region is False else laid_over_storage(result, region)  # (``None``: not known)
    setattr(result, _WEIGHTS_JOINED, (mask, result._version))
    count_mask(result, WEIGHTS_MASKS_MADE)


def keep_weights_elements(
    source: torch.Tensor, result: torch.Tensor, rearranged: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> None:
    """Note on ``result``, a new tensor whose elements are ``source``'s at the same places (a copy:
    ``mixed.t().contiguous()``), where ``source``, a join of weights and other activations or a view of one, is
    weights; ``rearranged``: the call that made ``result`` from ``source`` (``mixed.flip(1)``), made on a mask of
    ``source``'s shape instead (``None``: the same places).

    Examples:
        >>> pieces = [torch.ones(2, 2, requires_grad=True).softmax(-1), torch.ones(2, 2, requires_grad=True) * 2]
        >>> pieces[0].__dict__["_tdhook_softmax_weights"] = True  # weights beside an activation
        >>> mixed = torch.cat(pieces, 1)
        >>> mark_joined_weights(torch.cat, (pieces, 1), {}, mixed)
        >>> copy = mixed.t().contiguous()
        >>> keep_weights_elements(mixed.t(), copy)
        >>> weights_shown(copy).tolist()
        [[True, True], [True, True], [False, False], [False, False]]
    """
    shown = weights_shown(source)
    if shown is None or result is source or result._base is not None:  # (a view reads its tensor's note)
        return
    if rearranged is not None and shown is not False:
        with torch._C.DisableTorchFunction(), torch.no_grad():  # bookkeeping, which a function mode must not see
            try:
                shown = rearranged(shown)
            except (RuntimeError, TypeError, NotImplementedError):  # a call a mask cannot take: not known
                shown = False
    if shown is False or shown.shape == result.shape:
        _note_weights(result, shown)


def weights_shown(value: Any) -> torch.Tensor | bool | None:
    """Where ``value``, a join of weights and other activations (or a view of one), is weights: a mask of its
    shape; ``None`` where no such join is noted, ``False`` where the join was written into in place since (not known).

    Examples:
        >>> x = torch.ones(2, 2, requires_grad=True)
        >>> weights = torch.softmax(x * 1, -1)
        >>> weights.__dict__["_tdhook_softmax_weights"] = True
        >>> mixed = torch.cat([weights, x * 2], 1)
        >>> mark_joined_weights(torch.cat, ([weights, x * 2], 1), {}, mixed)
        >>> weights_shown(mixed[:, 1:3]).tolist(), weights_shown(x * 3)
        ([[True, False], [True, False]], None)
    """
    if not WEIGHTS_MASKS_MADE or not isinstance(value, torch.Tensor):
        return None
    return shown_of_storage(value, _WEIGHTS_JOINED)


def mixed_weights_product(
    func: Callable, args: tuple, kwargs: dict, ungated: Callable[[tuple], torch.Tensor], factors: tuple | None = None
) -> torch.Tensor | None:
    """``func(*args, **kwargs)``, an element-wise product of two activations of which one at least is a softmax's
    weights in some of its elements only (see :func:`weights_shown`), with, element by element, the weights held
    where one factor is weights and the other none, and elsewhere ``ungated(args)`` (the product under the rule of
    a product without weights); ``None`` where no factor is such a join. ``factors``: the factors multiplied, where
    they are not ``args`` (a copy of a factor an in-place product writes into).

    Raises:
        NotImplementedError: where a factor is a join of weights and other activations written into in place since.

    Examples:
        >>> x = torch.tensor([[1.0, -2.0]], requires_grad=True)
        >>> weights = torch.softmax(x[:, :1] * 1, -1)  # over one element: the constant 1
        >>> weights.__dict__["_tdhook_softmax_weights"] = True
        >>> mixed = torch.cat([weights, x[:, 1:] * 2], 1)
        >>> mark_joined_weights(torch.cat, ([weights, x[:, 1:] * 2], 1), {}, mixed)
        >>> z = mixed_weights_product(torch.mul, (mixed, x * 3), {}, lambda factors: torch.mul(*factors))
        >>> torch.equal(z, mixed * (x * 3))
        True
        >>> torch.autograd.grad(z.sum(), x)[0].tolist()  # the weights held; the other element's plain gradient
        [[3.0, -24.0]]
    """
    if len(args) != 2 or not (is_activation(args[0]) and is_activation(args[1])):
        return None
    shown = [weights_shown(a) for a in args]
    if shown[0] is None and shown[1] is None:
        return None
    for a, part in zip(args, shown, strict=True):
        if part is False:
            raise NotImplementedError(
                f"an element-wise product of two activations, one a softmax's weights in some of its elements only "
                f"(shape {tuple(a.shape)}, a join of weights and other activations): where its weights are is not "
                f"known after an in-place write into the join; multiply its pieces apart, or write into a copy"
            )
    with torch._C.DisableTorchFunction(), torch.no_grad():  # bookkeeping, which a function mode must not see
        device = next(part.device for part in shown if part is not None)
        weights = [
            torch.tensor(WEIGHTS_MARK in a.__dict__, device=device) if part is None else part
            for a, part in zip(args, shown, strict=True)
        ]
        held = [weights[0] & ~weights[1], weights[1] & ~weights[0]]
    factors = args if factors is None else factors
    products = [func(*(hold(a) if i == place else a for i, a in enumerate(factors)), **kwargs) for place in (0, 1)]
    return torch.where(held[0], products[0], torch.where(held[1], products[1], ungated(factors)))


def weights_held_where_mixed(
    func: Callable, args: tuple, kwargs: dict, ungated: Callable[[tuple], torch.Tensor]
) -> Callable[[tuple], torch.Tensor]:
    """``ungated``, the rule of a product ``func(*args, **kwargs)`` without gates, with a factor's weights held
    element by element where one is a softmax's weights in some elements only (see :func:`mixed_weights_product`):
    the rule of a product with a join of gates *and* weights (``torch.cat([sigmoid(a), softmax(b)], 1)``) where its
    elements are no gate. (Its weights were none: AttnLRP shared their relevance with them, 0.18-0.64 off, relative
    L2.)

    Examples:
        >>> h = torch.tensor([[2.0]], requires_grad=True)
        >>> weights = torch.ones(1, 1, requires_grad=True).softmax(-1)  # over one element: 1
        >>> weights.__dict__["_tdhook_softmax_weights"] = True
        >>> pieces = [weights, h * 1]  # weights beside an activation
        >>> joined, signal = torch.cat(pieces, 1), torch.cat([h, h], 1) * 2
        >>> mark_joined_weights(torch.cat, (pieces, 1), {}, joined)
        >>> product = weights_held_where_mixed(torch.mul, (joined, signal), {}, lambda pair: torch.mul(*pair))
        >>> torch.autograd.grad(product((joined, signal)).sum(), h)[0].tolist()  # 2 (weights held) + 4 h
        [[10.0]]
    """
    if not WEIGHTS_MASKS_MADE:
        return ungated

    def product(factors: tuple) -> torch.Tensor:
        mixed = mixed_weights_product(func, args, kwargs, ungated, factors)
        return ungated(factors) if mixed is None else mixed

    return product
