"""What the perturbation methods share: feature groups across keys, a baseline per key, and one forward per step.

A feature mask gives each element of an input an integer group id; it
broadcasts to the input's shape (``[1, H, W]`` for an image ``[B, C, H, W]``
makes every pixel a group across its channels). Ids span keys: id 2 in
``obs`` and id 2 in ``goal`` are one group, which moves as one. A key without
a mask is one group of its own.

Examples:
    >>> import torch
    >>> obs, goal = torch.zeros(2, 3), torch.zeros(2, 2)
    >>> given = {"obs": torch.tensor([0, 1, 1]), "goal": None}
    >>> masks, ids = feature_groups(given, ["obs", "goal"], [obs, goal], 1, "FeatureAblation")
    >>> ids, masks[1][0].tolist()
    ([0, 1, 2], [2, 2])
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar, Union

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import nn
from tqdm import tqdm  # the plain bar: tqdm.auto warns in notebooks without ipywidgets

from tdhook.attribution._inputs import module_in_recurrent_mode
from tdhook.attribution.methods._base import AttributionMethod, Call
from tdhook.attribution.methods._options import Baselines, baseline_tensors, per_key
from tdhook.attribution.methods._positions_alone import (
    own_positions,
    position_splits,
    positions_alone,
    positions_apart,
    read_across,
    split_positions,
)
from tdhook.attribution.methods._rows_in_one_sample import (
    called_with_keywords,
    keyword_call,
    rows_in_one_sample,
    rows_message,
)
from tdhook.attribution.methods._settable_options import CheckedOption, positive_int
from tdhook.attribution.rules._caller import warn_at_caller
from tdhook.attribution.targets import Target

__all__ = ["FeatureMasks", "PerturbationMethod", "feature_groups", "spread"]

T = TypeVar("T")
FeatureMasks = Union[None, torch.Tensor, Mapping[NestedKey, Union[torch.Tensor, None]]]


def feature_groups(
    feature_masks: FeatureMasks,
    keys: Sequence[NestedKey],
    inputs: Sequence[torch.Tensor],
    batch_dims: int,
    owner: str,
) -> tuple[list[torch.Tensor], list[int]]:
    """Each input's group ids at the input's shape, and the ids of all groups.

    Args:
        feature_masks: ``None`` (one group per key), an integer tensor for
            every key, or a dict keyed by input key (``None`` entries: that
            key is one group).
        keys: the explained input keys.
        inputs: the inputs, one per key.
        batch_dims: the number of batch dimensions.
        owner: the method's name, for error messages.

    Returns:
        Per key, a LongTensor of the input's shape (possibly an expanded view),
        and the sorted group ids. A key without a mask gets an id above every
        given one.

    Raises:
        TypeError: a mask is not an integer tensor.
        ValueError: a mask does not broadcast to its input's shape.

    Examples:
        >>> masks, ids = feature_groups(None, ["a", "b"], [torch.ones(2, 3), torch.ones(2, 2)], 1, "FeatureAblation")
        >>> [mask[0].tolist() for mask in masks], ids  # one group per key
        ([[0, 0, 0], [1, 1]], [0, 1])
        >>> masks, ids = feature_groups({"a": torch.tensor([0, 0, 5])}, ["a"], [torch.ones(2, 3)], 1, "Occlusion")
        >>> masks[0][0].tolist(), ids
        ([0, 0, 5], [0, 5])
    """
    given = per_key(feature_masks, keys, "feature_masks", owner)
    masks: list[torch.Tensor | None] = []
    for key, x, mask in zip(keys, inputs, given, strict=True):
        if mask is None:
            masks.append(None)
            continue
        if (
            not isinstance(mask, torch.Tensor)
            or mask.is_floating_point()
            or mask.is_complex()
            or mask.dtype == torch.bool
        ):
            raise TypeError(
                f"{owner}: the feature mask of input key {key!r} must be an integer tensor of group ids, "
                f"got {getattr(mask, 'dtype', type(mask).__name__)}"
            )
        try:
            shape = torch.broadcast_shapes(mask.shape, x.shape)
        except RuntimeError:
            shape = None
        if shape != x.shape:
            raise ValueError(
                f"{owner}: the feature mask of input key {key!r} has shape {list(mask.shape)}, which does not "
                f"broadcast to the input's {list(x.shape)}; expected a shape that broadcasts to one sample's "
                f"{list(x.shape[batch_dims:])}"
            )
        masks.append(mask.to(device=x.device, dtype=torch.long).expand(x.shape))
    ids = sorted({int(i) for mask in masks if mask is not None for i in mask.unique().tolist()})
    fresh = (ids[-1] + 1) if ids else 0
    full = []
    for x, mask in zip(inputs, masks, strict=True):
        if mask is None:
            mask = torch.full((), fresh, dtype=torch.long, device=x.device).expand(x.shape)
            ids.append(fresh)
            fresh += 1
        full.append(mask)
    return full, ids


class PerturbationMethod(AttributionMethod):
    """A method that evaluates the model at perturbed inputs, without gradients: baselines and a progress bar.

    Args:
        module: a ``TensorDictModuleBase``, or a plain ``nn.Module`` with ``in_keys`` and ``out_keys``.
        in_keys: see :class:`~tdhook.attribution.methods._base.AttributionMethod`.
        out_keys: the output keys of a plain module.
        target_key: the output to explain.
        target: ``None``, an int, a LongTensor, a callable or ``"all"`` (as for LRP), resolved on the input.
        relevance_key: the prefix of the attribution keys.
        baselines: the value a perturbed feature takes: a number, a tensor with
            one sample's shape (or the input's), or a dict keyed by in_key.
        progress: whether to show a progress bar over the forward passes.
        perturbations_per_eval: how many perturbed copies of the batch one
            forward pass evaluates (1: one forward pass per step).
    """

    _needs_gradients = False
    _per_call_options = ("baselines",)

    perturbations_per_eval = CheckedOption(positive_int)  # checked whenever set, as the constructor checks it

    def __init__(
        self,
        module: TensorDictModuleBase | nn.Module,
        *,
        in_keys: Sequence[NestedKey] | None = None,
        out_keys: Sequence[NestedKey] | None = None,
        target_key: NestedKey | None = None,
        target: Target = None,
        relevance_key: str = "attribution",
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
        )
        self.baselines = baselines
        self.progress = progress
        self.perturbations_per_eval = perturbations_per_eval
        self._rows_told: list[int] = []  # the rows of a call of batch [] warned of (once per wrapper)
        self._positions_told: list[bool] = []  # a model reading across the batch's positions warned of (once)

    def _check_batch(self, tensordict: TensorDictBase) -> None:
        """Refuse a batch whose samples read each other: a torchrl LSTMModule/GRUModule in recurrent mode reads the
        last batch dimension as time, so a step's output depends on the features of the steps before it, which a
        perturbation changes at every step at once, while its drop is written to the step's own features."""
        if not tensordict.batch_dims or tensordict.batch_size[-1] < 2:
            return
        found = module_in_recurrent_mode(self.module.module if self._plain else self.module)
        if found is not None:
            raise ValueError(
                f"{type(self).__name__}: {type(found[1]).__name__} {found[0]!r} runs in recurrent mode, reading the "
                f"last batch dimension (of {list(tensordict.batch_size)}) as time: a perturbation of every step at "
                "once changes each step's output through the steps before it too, which the step's own features "
                "cannot carry. Explain the steps one by one, outside recurrent mode with the recurrent states the "
                "rollout stored, or use a gradient method or LRP (with split_dim for each step on its own)"
            )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The base's call, noting whether it was given tensors as keywords (see :meth:`_warn_for_rows`)."""
        with keyword_call(args, kwargs):
            return super().forward(*args, **kwargs)

    def _first_pass(self, tensordict: TensorDictBase) -> Call:
        """The base's first pass, then a warning of rows given as one sample: the groups span them."""
        call = super()._first_pass(tensordict)
        self._warn_for_rows(call)
        return call

    def _warn_for_rows(self, call: Call) -> None:
        """Warn, once per wrapper, of a call given tensors as keywords whose inputs hold rows of samples (see
        :mod:`~tdhook.attribution.methods._rows_in_one_sample`)."""
        if self._rows_told or not called_with_keywords():
            return
        rows = rows_in_one_sample(call.inputs, call.output, self.target, call.batch_dims)
        if rows is not None:
            self._rows_told.append(rows)  # shared with the narrowed copies of a call (a shallow copy)
            warn_at_caller(rows_message(type(self).__name__, rows, call.target_key))

    def _baselines(self, call: Call) -> list[torch.Tensor]:
        return baseline_tensors(self.baselines, self.explained_keys, call.inputs, call.batch_dims, type(self).__name__)

    def _unperturbed(self, call: Call) -> torch.Tensor:
        """The explained quantity at the caller's inputs: ``[units, *batch]``.

        On a batch of several dimensions whose last holds several positions, one pass more finds whether the model
        reads across them (see :mod:`~tdhook.attribution.methods._positions_alone`); where it does, the passes after
        it perturb each position alone, with a warning once per wrapper."""
        unperturbed = self._contract(call, call.output.detach(), None)
        if call.batch_dims >= 2 and call.batch_shape[-1] >= 2 and not call.positions_alone and not self._apart():
            splits = position_splits(call.batch_shape[-1], unperturbed.device)
            split = split_positions(call.inputs, self._baselines(call), call.batch_dims, splits)
            changed, _ = self._evaluate(call, split)
            moved = read_across(unperturbed, changed, splits, lambda: self._at(call, call.inputs), call.batch_dims)
            if moved is not None:
                call.positions_alone = True
            if moved is not None and not self._positions_told:
                self._positions_told.append(True)  # shared with the narrowed copies of a call (a shallow copy)
                warn_at_caller(
                    f"{type(self).__name__}: the model reads across the last batch dimension (of "
                    f"{list(call.batch_shape)}): with some of its positions perturbed, the explained output at "
                    f"the positions left as given moved ({moved:.2g} apart, relative to its largest value), as a "
                    "transformer over the time steps of a [B, T] batch moves it. A perturbation of every position "
                    "at once would write the effect of the others on each position's features; each position is "
                    f"perturbed alone instead, the others as given ({call.batch_shape[-1]} copies a step)"
                )
        return unperturbed

    def _apart(self) -> bool:
        """Whether the wrapped model cannot read across a batch's positions (see
        :func:`~tdhook.attribution.methods._positions_alone.positions_apart`): a TensorDictModule of such layers."""
        inner, hooks = getattr(self.module, "module", None), nn.modules.module
        if hooks._global_forward_hooks or hooks._global_forward_pre_hooks or self.module._forward_pre_hooks:
            return False
        return isinstance(inner, nn.Module) and positions_apart(inner) and not self.module._forward_hooks

    def _copies(self, call: Call, state: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One step's perturbed inputs as the copies a pass runs: the step itself, or one copy per position of the
        last batch dimension perturbed alone (``call.positions_alone``)."""
        if not call.positions_alone:
            return [x.unsqueeze(0) for x in state]
        return [positions_alone(x, x0, call.batch_dims) for x, x0 in zip(state, call.inputs, strict=True)]

    def _at(self, call: Call, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """The explained quantity at one perturbed copy of the batch (one forward pass): ``[units, *batch]``."""
        objective, _ = self._evaluate(call, self._copies(call, inputs))
        return own_positions(objective, call.batch_dims) if call.positions_alone else objective.squeeze(1)

    def _values(
        self, call: Call, steps: Sequence[T], perturb: Callable[[T], Sequence[torch.Tensor]]
    ) -> Iterator[tuple[T, torch.Tensor]]:
        """The explained quantity at each step's perturbed inputs, ``perturbations_per_eval`` steps per forward pass.

        Args:
            call: the call.
            steps: what to perturb, one entry per step.
            perturb: a step's inputs, one tensor per explained key, shaped like the key's input.

        Yields:
            ``(step, [units, *batch])``, in the order of ``steps``, behind a progress bar over the forward passes
            when ``progress`` is on.
        """
        size = self.perturbations_per_eval
        chunks = [steps[start : start + size] for start in range(0, len(steps), size)]
        for chunk in tqdm(chunks, desc=type(self).__name__, disable=not self.progress, leave=False):
            states = [self._copies(call, perturb(step)) for step in chunk]
            stacked = [torch.cat([state[i] for state in states]) for i in range(len(self.explained_keys))]
            values, _ = self._evaluate(call, stacked)
            per_step = values.shape[1] // len(chunk)
            for position, step in enumerate(chunk):
                value = values[:, position * per_step : (position + 1) * per_step]
                yield step, own_positions(value, call.batch_dims) if call.positions_alone else value[:, 0]


def spread(value: torch.Tensor, where: torch.Tensor, batch_dims: int) -> torch.Tensor:
    """``value`` (``[units, *batch]``) put on the elements ``where`` is true (``[*batch, ...]``), 0 elsewhere.

    A selection, not a product with the mask: an infinite value (a group whose removal makes the output infinite)
    stays on its own elements, where ``inf * 0`` would put NaN on every other group's.

    Examples:
        >>> spread(torch.tensor([[1.0, 2.0]]), torch.tensor([[True, False], [True, True]]), 1)
        tensor([[[1., 0.],
                 [2., 2.]]])
        >>> spread(torch.tensor([[float("inf")]]), torch.tensor([[True, False]]), 1)
        tensor([[[inf, 0.]]])
    """
    shape = (*value.shape, *[1] * (where.dim() - batch_dims))
    return torch.where(where.unsqueeze(0), value.reshape(shape), value.new_zeros(()))
