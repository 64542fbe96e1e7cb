"""Perturbation curves through a model that starts with a linear layer, updated step by step instead of recomputed.

A curve's step ``k`` differs from step ``k - 1`` in a few features only. When the model is an ``nn.Sequential``
whose first layer (after an optional ``nn.Flatten``) is an ``nn.Linear`` on the whole sample, that layer's output
at step ``k`` is its output on the unperturbed input plus ``W (x_k - x)``, a sum over the features perturbed so
far. Each step's change ``sum W[:, e] (b_e - x_e)`` over the features it perturbs is one row of a sparse product,
and the unperturbed output and the changes are computed and summed in float64; the rest of the model then runs on
those outputs. The first layer costs one pass instead of one per step, and the curve is the same up to rounding.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))
    >>> LeadingAffine.find(net) is not None, LeadingAffine.find(nn.Sequential(nn.ReLU(), nn.Linear(4, 1)))
    (True, None)
    >>> x = torch.randn(2, 4)
    >>> positions = torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]])  # the rank of each feature
    >>> (steps,) = LeadingAffine.find(net).outputs(x, torch.zeros(()), positions, torch.tensor([2, 4]), size=2)
    >>> direct = torch.stack([net(torch.where(positions < 2, 0.0, x)), net(torch.zeros(2, 4))])
    >>> torch.allclose(steps, direct)
    True
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules import module as module_globals

__all__ = ["LeadingAffine"]

# The largest leading layer updated step by step (weights): its transposed copy takes at most 64 MiB.
_LARGEST_LAYER = 1 << 23
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _hooked(module: nn.Module) -> bool:
    return any(getattr(module, name, None) for name in _HOOKS)


def _plain_sequential(module: nn.Module) -> bool:
    return isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward


@dataclass
class LeadingAffine:
    """A model split into its leading linear layer and the layers after it.

    Attributes:
        flatten: whether the sample is flattened before the linear layer.
        linear: the leading layer.
        rest: the layers after it, run in order.
    """

    flatten: bool
    linear: nn.Linear
    rest: list[nn.Module]

    @classmethod
    def find(cls, model: nn.Module) -> LeadingAffine | None:
        """The split of ``model``, or ``None`` where it is not a plain ``nn.Sequential`` starting with a linear layer.

        No hook may sit on the model or on the layers it skips (they would not run), nor a global module hook.
        """
        if not _plain_sequential(model) or _hooked(model):
            return None
        if module_globals._global_forward_hooks or module_globals._global_forward_pre_hooks:
            return None
        layers = list(model)
        flatten = bool(layers) and type(layers[0]) is nn.Flatten
        if flatten and (layers[0].start_dim != 1 or layers[0].end_dim != -1 or _hooked(layers[0])):
            return None
        first = layers[1 if flatten else 0 : 2 if flatten else 1]
        if not first or type(first[0]) is not nn.Linear or _hooked(first[0]):
            return None
        return cls(flatten, first[0], layers[2 if flatten else 1 :])

    def fits(self, x: torch.Tensor, batch_dims: int) -> bool:
        """Whether the linear layer reads each sample of ``x`` (``batch + shape``) whole, and ``x`` is finite (an
        infinite or NaN input would stay in the updated output after it went to the baseline)."""
        shape, weight = x.shape[batch_dims:], self.linear.weight
        whole = (self.flatten or len(shape) == 1) and math.prod(shape) == self.linear.in_features
        small = weight.numel() <= _LARGEST_LAYER  # its transposed copy stays small
        same = x.dtype == weight.dtype and x.device == weight.device and x.device.type != "mps"  # MPS: no float64
        return whole and small and same and bool(torch.isfinite(x).all())

    def outputs(
        self, x: torch.Tensor, baseline: torch.Tensor, positions: torch.Tensor, thresholds: torch.Tensor, size: int
    ) -> Iterator[torch.Tensor]:
        """The model's outputs at every step, in stacks of ``size`` steps, each ``[steps, N, ...]``.

        Args:
            x: the unperturbed input, ``[N] + shape``.
            baseline: the baseline, broadcasting to ``x``.
            positions: the rank of each element of ``x``, broadcasting to ``x``.
            thresholds: step ``k`` (from 1) sets the elements with ``positions < thresholds[k - 1]`` to the baseline;
                increasing.
            size: the steps of one stack.
        """
        n, weight = x.shape[0], self.linear.weight
        with torch.no_grad():  # not around a yield: the caller's code between stacks keeps its own grad mode
            flat = x.reshape(n, -1)
            delta = baseline.expand_as(x).reshape(n, -1).double() - flat.double()
            # The step (from 0) from which each element is at the baseline (len(thresholds): never), and each
            # sample's elements in the order they go (by element within a step).
            first = torch.searchsorted(thresholds, positions.expand_as(x).reshape(n, -1).contiguous(), right=True)
            first, order = torch.sort(first, dim=-1, stable=True)
            # W[:, e] as row e, the unperturbed output and the changes b_e - x_e, all in float64: the output at a
            # late step is the unperturbed one plus the changes, and in the weights' precision the rounding of a
            # large input (a raw price of 1e6 in float32) would stay in it after that input went to the baseline.
            columns = weight.t().contiguous().double()  # transposed in the weights' own type: cheaper
            bias = None if self.linear.bias is None else self.linear.bias.double()
            carry = torch.nn.functional.linear(flat.double(), columns.t(), bias)
        for start in range(0, len(thresholds), size):
            stop = min(start + size, len(thresholds))
            with torch.no_grad():
                hidden = self._changes(first, order, delta, columns, start, stop).add_(carry)
                carry = hidden[-1].clone()  # the layers after may work in place on a view of ``hidden``
                out = hidden.to(weight.dtype).reshape(-1, weight.shape[0])
                for layer in self.rest:
                    out = layer(out)
            yield out.reshape(stop - start, n, *out.shape[1:])

    @staticmethod
    def _changes(
        first: torch.Tensor, order: torch.Tensor, delta: torch.Tensor, columns: torch.Tensor, start: int, stop: int
    ) -> torch.Tensor:
        """How much the layer's output has changed at steps ``start + 1 .. stop`` since step ``start``, in float64."""
        n, steps = first.shape[0], stop - start
        # One sparse row per (sample, step) holding the elements that reach the baseline at that step: its product
        # with the columns of W is that step's change. Listed by sample, then in the order they go, the elements
        # are sorted as a coalesced sparse tensor needs.
        rows, ranks = _between(first, start, stop)
        cols = order[rows, ranks]
        changes = torch.sparse_coo_tensor(
            torch.stack([rows * steps + first[rows, ranks] - start, cols]),
            delta[rows, cols],
            size=(n * steps, delta.shape[1]),
            is_coalesced=True,
            check_invariants=False,
        )
        per_step = torch.sparse.mm(changes, columns).view(n, steps, -1)
        # The running sum over the steps, along a middle dimension: a product with a triangular matrix of ones
        # would take steps² memory (32 GiB for a stack of 65536 steps).
        return per_step.cumsum(1).transpose(0, 1)


def _between(first: torch.Tensor, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, ranks)`` of the entries of ``first`` (sorted along its rows) in ``[start, stop)``, row by row.

    Examples:
        >>> _between(torch.tensor([[0, 1, 1, 2], [1, 2, 3, 3]]), 1, 3)
        (tensor([0, 0, 0, 1, 1]), tensor([1, 2, 3, 0, 1]))
    """
    bounds = torch.tensor([start, stop], dtype=first.dtype, device=first.device).expand(first.shape[0], 2)
    low, high = torch.searchsorted(first, bounds.contiguous()).unbind(-1)
    counts = high - low
    rows = torch.repeat_interleave(torch.arange(first.shape[0], device=first.device), counts)
    offsets = torch.repeat_interleave(low - (counts.cumsum(0) - counts), counts)
    return rows, torch.arange(len(rows), device=first.device) + offsets
