"""Occlusion: how much the explained output drops when a sliding window of an input is set to its baseline."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Union

import torch
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import nn

from tdhook.attribution.methods._accumulation import accumulation_dtype
from tdhook.attribution.methods._base import Call
from tdhook.attribution.methods._options import Baselines
from tdhook.attribution.methods._perturbation import PerturbationMethod
from tdhook.attribution.methods._settable_options import PerKeyOption
from tdhook.attribution.targets import Target

__all__ = ["Occlusion", "window_starts"]

Shape = Sequence[int]


def window_starts(size: int, window: int, stride: int) -> list[int]:
    """Where the windows along one dimension start: every ``stride``, the last one reaching the end.

    The last window may pass the end of the dimension; it is then cut there.

    Examples:
        >>> window_starts(8, 3, 2), window_starts(8, 8, 1), window_starts(5, 2, 2)
        ([0, 2, 4, 6], [0], [0, 2, 4])
    """
    count = -(-(size - window) // stride) + 1  # ceil((size - window) / stride) + 1
    return [k * stride for k in range(count)]


def _as_shape(
    value: object, dims: int, name: str, key: NestedKey, sample: Shape, batched: bool = True
) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value,) * dims if name == "strides" else (value,)
    if (
        not isinstance(value, (tuple, list))
        or len(value) != dims
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)
    ):
        whole = ""
        if not batched:
            whole = (
                " (the TensorDict has no batch dimension, so the whole tensor is one sample: give a TensorDict "
                "with batch_size=[B] to explain B samples)"
            )
        raise ValueError(
            f"Occlusion: the {name} of input key {key!r} must be {dims} positive ints, one per dimension "
            f"of a sample {list(sample)}{whole}, got {value!r}"
        )
    return tuple(value)


class Occlusion(PerturbationMethod):
    """Sliding-window occlusion, written at ``(relevance_key, *in_key)`` with each input's shape.

    For every explained key, a window of ``sliding_window_shapes`` (one size
    per dimension of a sample) slides over the sample by ``strides``; each
    position is set to the baseline, in one forward pass over the whole batch,
    and every element of the window gets the drop of the explained output.
    An element's attribution is the mean over the windows that cover it. Each
    key's windows are occluded on their own while the other keys keep their
    values (as captum's ``Occlusion`` does with several inputs).

    Args:
        module: a ``TensorDictModuleBase``, or a plain ``nn.Module`` with ``in_keys`` and ``out_keys``.
        in_keys: see :class:`~tdhook.attribution.methods._base.AttributionMethod`.
        out_keys: the output keys of a plain module.
        target_key: the output to explain.
        target: ``None``, an int, a LongTensor, a callable or ``"all"`` (as for LRP), resolved on the input.
        relevance_key: the prefix of the attribution keys.
        sliding_window_shapes: the window's size per dimension of one sample, or a dict keyed by in_key.
        strides: an int for every dimension, a tuple, or a dict keyed by in_key; at most the window's size
            where the window is smaller than the sample.
        baselines: a number, a tensor with one sample's shape, or a dict keyed by in_key.
        progress: whether to show a progress bar over the forward passes.
        perturbations_per_eval: how many windows one forward pass occludes (each in its own copy of the batch).

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tdhook.attribution import Occlusion
        >>> net = torch.nn.Linear(4, 1, bias=False)
        >>> with torch.no_grad():
        ...     _ = net.weight.copy_(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
        >>> occlusion = Occlusion(net, in_keys=["x"], out_keys=["v"], sliding_window_shapes=(2,), strides=2)
        >>> occlusion(TensorDict(x=torch.ones(4), batch_size=[]))["attribution", "x"]
        tensor([3., 3., 7., 7.])
    """

    _per_key_options = ("_sliding_window_shapes", "_strides")  # per explained key, from the options as given
    # Settable after construction: read per key as the constructor reads them.
    sliding_window_shapes = PerKeyOption()
    strides = PerKeyOption()

    def __init__(
        self,
        module: TensorDictModuleBase | nn.Module,
        *,
        in_keys: Sequence[NestedKey] | None = None,
        out_keys: Sequence[NestedKey] | None = None,
        target_key: NestedKey | None = None,
        target: Target = None,
        relevance_key: str = "attribution",
        sliding_window_shapes: Union[Shape, Mapping[NestedKey, Shape]],
        strides: Union[int, Shape, Mapping[NestedKey, Union[int, Shape]]] = 1,
        baselines: Baselines = 0.0,
        progress: bool = False,
        perturbations_per_eval: int = 1,
    ) -> None:
        super().__init__(
            module,
            in_keys=in_keys,
            out_keys=out_keys,
            target_key=target_key,
            target=target,
            relevance_key=relevance_key,
            baselines=baselines,
            progress=progress,
            perturbations_per_eval=perturbations_per_eval,
        )
        self.sliding_window_shapes = sliding_window_shapes
        self.strides = strides

    def _grids(self, call: Call) -> list[list[tuple[slice, ...]]]:
        """Per key, the windows as tuples of slices over a sample's dimensions."""
        grids = []
        for key, x, window, stride in zip(
            self.explained_keys, call.inputs, self._sliding_window_shapes, self._strides, strict=True
        ):
            sample = x.shape[call.batch_dims :]
            batched = call.batch_dims > 0
            window = _as_shape(window, len(sample), "sliding window shape", key, sample, batched)
            stride = _as_shape(stride, len(sample), "strides", key, sample, batched)
            if any(w > d for w, d in zip(window, sample, strict=True)):
                raise ValueError(
                    f"Occlusion: the window {list(window)} of input key {key!r} exceeds a sample {list(sample)}"
                )
            if any(s > w for s, w, d in zip(stride, window, sample, strict=True) if w < d):
                raise ValueError(
                    f"Occlusion: the strides {list(stride)} of input key {key!r} exceed the window {list(window)}, "
                    "which would leave elements never occluded"
                )
            starts = [window_starts(d, w, s) for d, w, s in zip(sample, window, stride, strict=True)]
            grids.append(
                [
                    tuple(slice(a, a + w) for a, w in zip(corner, window, strict=True))
                    for corner in itertools.product(*starts)
                ]
            )
        return grids

    def _attribute(self, call: Call) -> list[torch.Tensor]:
        baselines = self._baselines(call)
        grids = self._grids(call)
        unperturbed = self._unperturbed(call)
        lead = (slice(None),) * (1 + call.batch_dims)
        windows = [(i, window) for i, grid in enumerate(grids) for window in grid]
        # Drops and counts summed in float32 at least (see accumulation_dtype: a bfloat16 count stops at 256
        # windows), rounded once to the input's dtype.
        wide = [torch.promote_types(accumulation_dtype(x.dtype), call.output.dtype) for x in call.inputs]
        totals = [x.new_zeros(call.seeds.shape[0], *x.shape, dtype=w) for x, w in zip(call.inputs, wide, strict=True)]
        counts = [x.new_zeros(x.shape[call.batch_dims :], dtype=w) for x, w in zip(call.inputs, wide, strict=True)]

        def occluded(step: tuple[int, tuple[slice, ...]]) -> list[torch.Tensor]:
            i, window = step
            x = call.inputs[i].clone()
            x[(Ellipsis, *window)] = baselines[i][(Ellipsis, *window)]
            return [x if j == i else other for j, other in enumerate(call.inputs)]

        for (i, window), value in self._values(call, windows, occluded):
            drop = unperturbed.to(wide[i]) - value.to(wide[i])
            totals[i][(*lead, *window)] += drop.view(*drop.shape, *[1] * len(window))
            counts[i][window] += 1
        return [(total / count).to(x.dtype) for total, count, x in zip(totals, counts, call.inputs, strict=True)]
