"""An ``nn.EmbeddingBag``'s output computed from the rows it gathered, with a backward that can be differentiated again.

The rows an ``nn.EmbeddingBag`` gathers stand in for its tokens in the relevance backward pass (see
:mod:`~tdhook.attribution._tokens`), and the bag's output is computed again from them. torch's backward of
``F.embedding_bag`` has no derivative of its own, and a first-layer rule on the layer after the bag (Flat, w²)
carries the relevance it sets back through the bag by differentiating that backward again: it raised torch's
``NotImplementedError`` for ``_embedding_bag_backward``. :func:`bag_of_rows` gives the same output, bit for bit, and
writes its backward with operations autograd can differentiate: each row gets its bag's gradient times its weight in
the bag (1 for a sum, a per-sample weight, one over the bag's size for a mean, 0 for padding), and a maximum's gradient
goes to the row that gave it.

Examples:
    >>> bag = nn.EmbeddingBag(5, 2, mode="mean")
    >>> ids = torch.tensor([[1, 2, 2], [0, 4, 3]])
    >>> rows = bag.weight.detach()[ids].requires_grad_(True)
    >>> out = bag_of_rows(bag, ids, rows, None, None)
    >>> torch.equal(out, bag(ids))
    True
    >>> w = torch.ones_like(out, requires_grad=True)
    >>> (g,) = torch.autograd.grad(out, rows, w, create_graph=True)
    >>> torch.autograd.grad(g.sum(), w)[0]  # the backward differentiated again: three rows per bag, 1/3 each
    tensor([[1., 1.],
            [1., 1.]])
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["bag_of_rows"]

_MODES = {"sum": 0, "mean": 1, "max": 2}


def bag_of_rows(
    bag: nn.EmbeddingBag,
    ids: torch.Tensor,
    rows: torch.Tensor,
    offsets: torch.Tensor | None,
    weights: torch.Tensor | None,
) -> torch.Tensor:
    """What ``bag`` computed for the token ``ids``, from ``rows``, their gathered embeddings (``ids.shape + (D,)``):
    the bag over a table of those rows, each token reading its own, and a row of zeros for the padding tokens.

    Args:
        bag: the ``nn.EmbeddingBag`` (its mode, padding index and ``include_last_offset``).
        ids: the token ids it read, 2-D (one bag per row) or 1-D with ``offsets``.
        rows: the rows of its table for ``ids``.
        offsets: where each bag starts in 1-D ``ids``; ``None`` for 2-D ones.
        weights: the per-sample weights (a sum), held as constants; ``None`` for none.
    """
    count = ids.numel()
    index = torch.arange(count, device=ids.device).view_as(ids)
    table = rows.reshape(count, rows.shape[-1])
    padding = None
    if bag.padding_idx is not None:
        index = torch.where(ids == bag.padding_idx, count, index)
        table, padding = torch.cat([table, table.new_zeros(1, table.shape[-1])]), count
    options = (bag.mode, bag.include_last_offset, padding)
    return _BagOfRows.apply(table, index, offsets, weights, options)


def _bags_of_tokens(index: torch.Tensor, offsets: torch.Tensor | None, include_last_offset: bool) -> torch.Tensor:
    """The bag of each token of ``index`` (flattened), and the offsets of the bags (as ``F.embedding_bag`` takes 2-D
    input: one bag per row)."""
    if index.dim() == 2:
        return torch.arange(index.shape[0], device=index.device).repeat_interleave(index.shape[1])
    starts = offsets[:-1] if include_last_offset else offsets
    positions = torch.arange(index.numel(), device=index.device)
    return torch.searchsorted(starts.to(positions.dtype), positions, right=True) - 1


class _BagOfRows(torch.autograd.Function):
    """``F.embedding_bag`` over a table of rows, with its backward written in differentiable operations."""

    @staticmethod
    def forward(ctx: Any, table, index, offsets, weights, options) -> torch.Tensor:  # type: ignore[override]
        mode, include_last_offset, padding = options
        out = F.embedding_bag(
            index,
            table,
            offsets,
            mode=mode,
            per_sample_weights=weights,
            include_last_offset=include_last_offset,
            padding_idx=padding,
        )
        bags = _bags_of_tokens(index, offsets, include_last_offset)
        flat = index.reshape(-1)
        kept = flat != padding if padding is not None else torch.ones_like(flat, dtype=torch.bool)
        if mode == "max":
            flat_offsets = offsets
            if index.dim() == 2:
                flat_offsets = torch.arange(0, flat.numel(), index.shape[1], device=flat.device)
            _, _, _, chosen = torch.embedding_bag(
                table, flat, flat_offsets, False, _MODES[mode], False, None, include_last_offset, padding
            )
            sizes = torch.zeros(out.shape[0], dtype=torch.long, device=flat.device).index_add_(0, bags, kept.long())
            ctx.save_for_backward(chosen, sizes > 0)
        else:
            share = kept.to(table.dtype)
            if weights is not None:
                share = share * weights.reshape(-1).to(table.dtype)
            if mode == "mean":
                sizes = torch.zeros(out.shape[0], dtype=table.dtype, device=flat.device).index_add_(
                    0, bags, kept.to(table.dtype)
                )
                share = share / sizes.clamp_min(1).index_select(0, bags)
            ctx.save_for_backward(bags, share, flat)
        ctx.mode, ctx.rows = mode, table.shape[0]
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        if ctx.mode == "max":
            chosen, filled = ctx.saved_tensors
            picked = grad * filled.unsqueeze(-1).to(grad.dtype)  # an empty bag gave zeros, from no row
            table_grad = grad.new_zeros(ctx.rows, grad.shape[-1]).scatter_add(0, chosen, picked)
        else:
            bags, share, flat = ctx.saved_tensors
            per_token = grad.index_select(0, bags) * share.unsqueeze(-1)
            table_grad = grad.new_zeros(ctx.rows, grad.shape[-1]).index_add(0, flat, per_token)
        return table_grad, None, None, None, None
