"""Perturbation curves through a model that starts with a linear layer, updated step by step instead of recomputed.

A curve's step ``k`` differs from step ``k - 1`` in a few features only. When the model is an ``nn.Sequential``
whose first layer (after an optional ``nn.Flatten``) is an ``nn.Linear`` on the whole sample, that layer's output
at step ``k`` is its output with every element at the baseline plus ``sum W[:, e] (x_e - b_e)`` over the elements
not yet perturbed. The sum over the elements that one step perturbs is one bag of ``nn.functional.embedding_bag``
over the rows of ``W^T``; the bags are then summed from the last step back, in float64, so that an element once at
the baseline leaves no rounding behind (a raw price of 1e6 in float32 would). The rest of the model runs on those
outputs. The first layer costs one pass instead of one per step, and the curve is the same up to rounding.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))
    >>> LeadingAffine.find(net) is not None, LeadingAffine.find(nn.Sequential(nn.ReLU(), nn.Linear(4, 1)))
    (True, None)
    >>> x = torch.randn(2, 4)
    >>> positions = torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]])  # the rank of each feature
    >>> [(start, steps)] = LeadingAffine.find(net).outputs(x, torch.zeros(()), positions, torch.tensor([2, 4]), size=2)
    >>> direct = torch.stack([net(torch.where(positions < 2, 0.0, x)), net(torch.zeros(2, 4))])
    >>> start, torch.allclose(steps, direct)
    (0, True)
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules import module as module_globals

from tdhook.attribution.rules._meta_tensors import holds_meta_tensors
from tdhook.metrics._batch_statistics import StepsMixed, hooked, samples_apart, statistics_kept, steps_mixed
from tdhook.metrics._features import stacked_batch
from tdhook.metrics._transposed_weights import transposed

__all__ = ["LeadingAffine"]

# The largest leading layer updated step by step (weights): its transposed copy takes at most 32 MiB in float32.
_LARGEST_LAYER = 1 << 23
# The layer's outputs that one stack of steps holds (steps times the batch times its width): a stack's fixed cost
# (a dozen operations) is then small next to its work, and its float64 sums take 2 MiB.
_STACK_ELEMENTS = 1 << 18


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

        No hook may sit on the model or on the layers it skips (they would not run), nor a forward set on one of
        them, nor a global module hook.
        """
        if not _plain_sequential(model) or hooked(model):
            return None
        if module_globals._global_forward_hooks or module_globals._global_forward_pre_hooks:
            return None
        layers = list(model)
        flatten = bool(layers) and type(layers[0]) is nn.Flatten
        if flatten and (layers[0].start_dim != 1 or layers[0].end_dim != -1 or hooked(layers[0])):
            return None
        first = layers[1 if flatten else 0 : 2 if flatten else 1]
        if not first or type(first[0]) is not nn.Linear or hooked(first[0]):
            return None
        if any(holds_meta_tensors(module) for module in model.modules()):
            return None  # the model's own passes name the module computing from a tensor that holds no values
        return cls(flatten, first[0], layers[2 if flatten else 1 :])

    def fits(self, x: torch.Tensor, batch_dims: int, baseline: torch.Tensor) -> bool:
        """Whether the linear layer reads each sample of ``x`` (``batch + shape``, not empty) whole (after a flatten, on
        a batch of one dimension), in float32 or float64 and outside autocast (which runs the layer's own pass in a
        lower precision than the sums here), and ``x`` and ``baseline`` are finite (an infinite or NaN input would stay
        in the summed outputs after it went to the baseline; such a baseline would be in the outputs before it
        came)."""
        shape, weight = x.shape[batch_dims:], self.linear.weight
        # nn.Flatten() flattens every dimension after the first: a sample's own on a batch of one dimension only.
        flat = batch_dims == 1 if self.flatten else len(shape) == 1
        whole = flat and math.prod(shape) == self.linear.in_features and x.numel() > 0
        small = weight.numel() <= _LARGEST_LAYER  # its transposed copy stays small
        typed = x.dtype == weight.dtype and x.dtype in (torch.float32, torch.float64)
        same = typed and x.device == weight.device and x.device.type != "mps"  # MPS: no float64
        if not (whole and small and same) or torch.is_autocast_enabled(x.device.type):
            return False
        # A sum is finite only where every element is (one that overflows takes the stacked passes, as a non-finite
        # element does): a reduction instead of a mask of each tensor and its reduction.
        return math.isfinite(x.sum().item() + (baseline.item() if baseline.dim() == 0 else baseline.sum().item()))

    def stack_size(self, n: int) -> int:
        """How many steps one stack holds for a batch of ``n`` samples."""
        return max(1, _STACK_ELEMENTS // (n * self.linear.out_features))

    def outputs(
        self,
        x: torch.Tensor,
        baseline: torch.Tensor,
        positions: torch.Tensor | None,
        thresholds: torch.Tensor,
        size: int,
        batch: Sequence[int] | None = None,
        unperturbed: bool = False,
        order: torch.Tensor | None = None,
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """The model's outputs at every step, in stacks of ``size`` steps from the last stack to the first.

        The layers after the first see a stack of ``S`` steps as the batch ``[S * B, ...]`` (see
        :func:`~tdhook.metrics._features.stacked_batch`), so that a layer mixing along the other batch dimensions (a
        time dimension) sees each step's batch as it is.

        Args:
            x: the unperturbed input, ``[N] + shape``, ``N`` the product of ``batch``.
            baseline: the baseline, broadcasting to ``x``.
            positions: the rank of each element of ``x``, broadcasting to ``x``; ``None`` where ``order`` gives it.
            thresholds: step ``k`` (from 1) sets the elements with ``positions < thresholds[k - 1]`` to the baseline;
                increasing.
            size: the steps of one stack.
            batch: the batch shape that ``N`` flattens (``None``: ``[N]``). On a batch ``[]``, a stack of one step
                runs the sample unbatched, as the model's own passes of one step do.
            unperturbed: the stack of the first steps begins with step 0, the unperturbed input (its first layer's
                output is the sum of every bag, which that stack's running sum reaches anyway).
            order: ``[N, M]``: each sample's elements in the order they go, where the ranks are ``0 .. M - 1`` (one
                per element: ``positions`` is its inverse, which is then not needed).

        Yields:
            ``(start, outputs)``: the outputs ``[steps, N, ...]`` of the steps ``start + 1 .. start + steps``
            (``start`` is ``-1`` for a stack that begins with step 0).

        Raises:
            StepsMixed: the first stack of several steps gives a step other outputs than its own pass: a layer after
                the first mixes the samples of its batch (warned of, naming it; see
                :func:`~tdhook.metrics._batch_statistics.steps_mixed`).
        """
        n, weight, n_steps = x.shape[0], self.linear.weight, len(thresholds)
        with torch.no_grad():  # not around a yield: the caller's code between stacks keeps its own grad mode
            base = baseline.expand_as(x).reshape(n, -1)
            # Each sample's elements in the order they go and their ranks in that order (None: 0 .. M - 1); the
            # bags read them from the last to go.
            if order is None:
                ranks, order = _in_order(positions.expand_as(x).reshape(n, -1), whole=positions.shape == x.shape)
            else:
                ranks = None
            last_first = order.flip(-1)
            bounds = _bag_bounds(ranks, thresholds, x[0].numel(), x.device).expand(n, -1)
            # A baseline other than zero: its output and x - b in float64. In the layer's float32, the output at a
            # step before the baseline's elements come would be the sum of two large terms (the output at the
            # baseline, the changes x - b) that cancel, and would carry their rounding (a baseline of 1e6 for inputs
            # near 1: about 1, more than the output itself, and the target fixed on it another unit).
            at_baseline = self._at_baseline(base)
            wide = at_baseline is None
            if wide:
                base, rows, bias = base.to(torch.float64), transposed(weight).to(torch.float64), self.linear.bias
                at_baseline = base @ rows if bias is None else torch.addmm(bias.to(torch.float64), base, rows)
            else:
                rows = transposed(weight)
            values = (x.reshape(n, -1).to(base.dtype) - base).gather(-1, last_first)
            bags = _Bags(last_first, values, bounds, rows, at_baseline)
            modules = [module for layer in self.rest for module in layer.modules()]
            plain = all(_strided_ok(module) for module in modules)
            # Modules in training mode update their buffers: each stack starts from the caller's (the others do not).
            kept = nn.ModuleList(self.rest) if any(module.training for module in modules) else None
        batch_dims = 1 if batch is None else len(batch)
        # Unchecked: the first stack is compared with its steps alone.
        unchecked = not all(samples_apart(layer, batch_dims) for layer in self.rest)
        for start in reversed(range(0, n_steps, size)):
            stop = min(start + size, n_steps)
            first = start - int(unperturbed and start == 0)  # the step before the stack's first
            with torch.no_grad():
                hidden = bags.outputs(start, stop, unperturbed=first < start)
                if hidden.dtype != weight.dtype:  # summed in float64 (see above): rounded once to the layer's
                    hidden = hidden.to(weight.dtype)
                hidden = hidden if plain else hidden.contiguous()
                rest = functools.partial(self._rest, batch=batch, kept=kept)
                # The first stack of several steps is compared with its steps alone: a layer after the first may mix
                # the samples of its batch (copies of its outputs: a layer may change its input in place).
                copy = hidden.clone() if unchecked and len(hidden) > 1 else None
                out = rest(hidden)
                if copy is not None:
                    unchecked = False
                    alone = lambda i: rest(copy[i : i + 1].clone())[0]  # noqa: E731
                    found = steps_mixed(
                        out, alone, self.named_rest, lambda: rest(copy.clone()), unbatched=not batch_dims
                    )
                    if found is not None:
                        raise StepsMixed(found)
            yield first, out.flip(0)  # from the first step

    def _rest(self, hidden: torch.Tensor, batch: Sequence[int] | None, kept: nn.Module | None) -> torch.Tensor:
        """The layers after the first on its outputs ``[steps, N, out]``, stacked as one batch (see :meth:`outputs`),
        as ``[steps, N, ...]``."""
        steps, n = hidden.shape[:2]
        alone = batch is not None and not len(batch) and steps == 1  # one sample, run as it is
        stacked = () if alone else stacked_batch(steps, (n,) if batch is None else batch)
        out = hidden.reshape(*stacked, hidden.shape[-1])
        with statistics_kept(kept) if kept is not None else contextlib.nullcontext():
            for layer in self.rest:
                out = layer(out)
        return out.reshape(steps, n, *out.shape[len(stacked) :])

    def named_rest(self) -> dict[str, nn.Module]:
        """The modules of the layers after the first, named as in the model.

        Examples:
            >>> list(LeadingAffine.find(nn.Sequential(nn.Flatten(), nn.Linear(4, 3), nn.ReLU())).named_rest())
            ['2']
        """
        offset = 2 if self.flatten else 1
        return {
            f"{offset + i}{'.' if sub else ''}{sub}": module
            for i, layer in enumerate(self.rest)
            for sub, module in layer.named_modules()
        }

    def _at_baseline(self, base: torch.Tensor) -> torch.Tensor | None:
        """The layer's output with every element at the baseline ``base`` ``[N, M]`` where the baseline is zero: its
        bias ``[1, out]``, as the pass would give it (a sum of zeros plus the bias); ``None`` for any other baseline."""
        weight, bias = self.linear.weight, self.linear.bias
        stored = base if any(base.stride()) else base.reshape(-1)[:1]  # a number expanded: one element to look at
        if not (stored.item() == 0 if stored.numel() == 1 else bool((stored == 0).all())):
            return None
        if bias is None:
            return weight.new_zeros(1, self.linear.out_features)
        return bias.detach().unsqueeze(0)


def _bag_bounds(ranks: torch.Tensor | None, thresholds: torch.Tensor, m: int, device: torch.device) -> torch.Tensor:
    """``[R, steps + 3]``: where each bag of :class:`_Bags` begins in each row of elements sorted by ``ranks``
    ``[R, m]`` (``None``: one row ranked ``0 .. m - 1``), read from the last element back: bag 0 empty, bag 1 the
    elements that never go, bag ``j >= 2`` those that go at step ``steps + 2 - j``, the elements of step ``k`` (from 1)
    those ranked below ``thresholds[k - 1]`` and not below the threshold before; the last column is ``m``.

    Examples:
        >>> _bag_bounds(None, torch.tensor([2, 4, 6]), 5, torch.device("cpu"))  # [0, 0, 1, 3, 5]: steps 3, 2, 1
        tensor([[0, 0, 0, 1, 3, 5]])
        >>> _bag_bounds(torch.tensor([[0, 0, 1, 3, 3]]), torch.tensor([1, 2]), 5, torch.device("cpu"))
        tensor([[0, 0, 2, 3, 5]])
    """
    if ranks is None:  # the count of ranks below each threshold, from the last
        counts = [max(0, min(threshold, m)) for threshold in reversed(thresholds.tolist())]
        return torch.tensor([[0, 0, *(m - count for count in counts), m]], device=device)
    low, high = torch.iinfo(ranks.dtype).min, torch.iinfo(ranks.dtype).max  # below and above every rank
    bounds = torch.tensor([low, *thresholds.tolist(), high], dtype=ranks.dtype, device=ranks.device)
    ends = torch.searchsorted(ranks, bounds.expand(len(ranks), -1).contiguous())  # [R, steps + 2], from the first
    return torch.cat([ends[:, :1], m - ends.flip(-1)], -1)


def _strided_ok(module: nn.Module) -> bool:
    """Whether ``module`` is one of torch's own layers, which take inputs of any strides (a layer of the caller's may
    call ``view`` on its input, which needs a contiguous one)."""
    return type(module).__module__.startswith("torch.nn.")


def _in_order(ranks: torch.Tensor, whole: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``ranks`` ``[N, M]`` sorted along each row, and the order that sorts them (ties in element order).

    Where each row may be a permutation of ``0 .. M - 1`` (``whole``: one rank per element), its inverse is the order,
    found without a sort, and the sorted ranks are one row ``[1, M]`` for all.

    Examples:
        >>> _in_order(torch.tensor([[2, 0, 1]]), whole=True)
        (tensor([[0, 1, 2]]), tensor([[1, 2, 0]]))
        >>> _in_order(torch.tensor([[1, 0, 1]]), whole=True)  # not a permutation
        (tensor([[0, 1, 1]]), tensor([[1, 0, 2]]))
    """
    n, m = ranks.shape
    if whole and _within(ranks, m):
        elements = torch.arange(m, device=ranks.device)
        order = torch.full((n, m), -1, device=ranks.device).scatter_(-1, ranks.long(), elements.expand(n, m))
        if bool((order >= 0).all()):  # every rank once
            return elements.to(ranks.dtype).unsqueeze(0), order
    ranks, order = torch.sort(ranks, dim=-1, stable=True)
    return ranks, order


# Padding of each row of a stack's summed outputs (elements): rows of a power-of-two width would start at addresses
# a power of two apart, and the running sum, which reads and writes them a row apart, would keep evicting its own
# cache lines (the padded layout ran about five times faster for a 256-wide layer).
_ROW_PADDING = 8


def _within(ranks: torch.Tensor, m: int) -> bool:
    """Whether every rank lies in ``0 .. m - 1`` (one reduction for both ends)."""
    low, high = torch.aminmax(ranks)
    return bool(low >= 0) and bool(high < m)


@dataclass
class _Bags:
    """The changes of the layer's output, one bag of elements per sample and step, from the last step back.

    Bag 0 is empty: its sum is the layer's output with every element at the baseline. Bag 1 holds the elements that
    never go, bag ``j >= 2`` those that go at step ``steps + 2 - j`` (from 1).

    Attributes:
        order: ``[N, M]``: each sample's elements, the last to go first.
        values: ``[N, M]``: ``x_e - b_e`` of those elements.
        ends: ``[N, steps + 3]``: where in ``order`` each bag begins.
        rows: ``W^T``, row ``e`` the weights of element ``e``.
        base: the layer's output with every element at the baseline, ``[N, out]`` or ``[1, out]``.
        carry: the output (float64 ``[N, out]``) at the step after the next stack's last; ``None`` before the first.
    """

    order: torch.Tensor
    values: torch.Tensor
    ends: torch.Tensor
    rows: torch.Tensor
    base: torch.Tensor
    carry: torch.Tensor | None = None

    def outputs(self, start: int, stop: int, unperturbed: bool = False) -> torch.Tensor:
        """The layer's outputs ``[stop - start, N, out]`` at steps ``stop .. start + 1`` (from the last step back);
        the stacks come from the last to the first. With ``unperturbed`` (where ``start`` is 0), the output at step 0
        follows: ``[stop + 1, N, out]``.

        Each output is the sum of the bags of the elements still there, so an element at the baseline leaves no
        rounding behind (a running sum from the first step, taken off its total, would keep the rounding of a large
        one). The sums run along the bags in float64 (``torch.cumsum`` accumulates float32 in float64 on CPU, and
        rounds each output once); the carry from one stack to the next is float64 too.
        """
        steps, n_bags, first = stop - start, self.ends.shape[1] - 1, self.carry is None
        # The bags of the stack: those of the outputs' steps (the first stack from bag 0 on), and the bag of the step
        # before them, whose sum carries to the next stack (or, after the last one, is not used).
        low = 0 if first else n_bags - 1 - stop
        high = n_bags if start == 0 else n_bags - start
        sums = self._sums(low, high)  # [N, bags, out]
        if first:
            sums[:, 0] = self.base
        n, count, width = sums.shape
        padded = torch.empty(count, n, width + _ROW_PADDING, dtype=sums.dtype, device=sums.device)[..., :width]
        torch.cumsum(sums, 1, out=padded.transpose(0, 1))
        # Bag 0 of the first stack is no step's; the row after the stack's steps adds the bag of step start + 1.
        outputs = padded[int(first) : int(first) + steps + int(unperturbed)]
        if not first:
            outputs.add_(self.carry)  # in float64, rounded once
        if start > 0:  # the output at step start + 1, the last of the stack: every bag but the one after it
            carry = sums[:, :-1].sum(1, dtype=torch.float64)
            self.carry = carry if first else carry.add_(self.carry)
        return outputs

    def _sums(self, start: int, stop: int) -> torch.Tensor:
        """``[N, stop - start, out]``: per sample and bag in ``[start, stop)``, ``sum rows[e] * values[e]``."""
        n, m = self.order.shape
        begins = self.ends[:, start:stop]
        # Every element (every bag, from the first, which begins at 0, to the last, which ends at m): no selection.
        every = start == 0 and stop == self.ends.shape[1] - 1
        low, high = (None, None) if every else (self.ends[:, start], self.ends[:, stop])
        if every or (bool((low == 0).all()) and bool((high == m).all())):
            order, values = self.order.reshape(-1), self.values.reshape(-1)
            offsets = begins + torch.arange(0, n * m, m, device=begins.device).unsqueeze(-1)
        else:
            counts = high - low
            rows = torch.repeat_interleave(torch.arange(n, device=counts.device), counts)
            first = counts.cumsum(0) - counts  # where each sample's selection begins
            picked = torch.arange(len(rows), device=counts.device) - first[rows] + low[rows]
            order, values = self.order[rows, picked], self.values[rows, picked]
            offsets = begins - low.unsqueeze(-1) + first.unsqueeze(-1)
        sums = torch.nn.functional.embedding_bag(
            order, self.rows, offsets.reshape(-1), mode="sum", per_sample_weights=values
        )
        return sums.view(n, stop - start, -1)
