"""Max-sensitivity (Yeh et al., 2019): the largest relative change of an explanation under small input noise."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey

from tdhook.attribution._read_keys import carried_inputs
from tdhook.attribution.methods._accumulation import accumulation_dtype
from tdhook.attribution.methods._cross_sample_outputs import scored_across_copies
from tdhook.attribution.methods._mixed_copies import copies_apart
from tdhook.attribution.methods._time_reads import read_as_one_sequence, recurrent_layers, time_lengths
from tdhook.metrics._batch_statistics import batch_normalising_module, keeps_running_statistics, statistics_kept
from tdhook.metrics._features import inputs_value, stacked_batch
from tdhook.metrics._methods import (
    check_method,
    explain,
    explained_output,
    in_batch_of,
    method_keys,
    method_prefix,
    options_repeated,
    original_target,
    refuse_recomputed_keys,
    repeat_target,
    target_set,
    unit_dims,
    written_attributions,
)
from tdhook.metrics._random import generator, keeps_global_rng
from tdhook.metrics.infidelity import check_perturbed, repeated

__all__ = ["sensitivity_max"]


def _refuse_batch_reduced(output: torch.Tensor, batch: torch.Size) -> None:
    """Refuse an explained output that is not one per sample: a model that reduces its batch (a torchrl loss with
    ``reduction="mean"``) explains the whole batch as one sample, and the perturbed copies, stacked along the batch,
    would be explained as their mean."""
    if tuple(output.shape[: len(batch)]) != tuple(batch):
        raise ValueError(
            f"sensitivity_max: the explained output of shape {list(output.shape)} does not start with the "
            f"TensorDict's batch shape {list(batch)}: a metric scores one output per sample (a loss with "
            'reduction="mean" is one number for the whole batch: build it with reduction="none")'
        )


def _stackable(method: TensorDictModuleBase, batch: torch.Size) -> bool:
    """Whether the perturbed copies may run stacked in one call of ``method``: not where its model normalises over
    the batch, nor on a batch ``[]`` (the copies are then a new first dimension of its one sample, which a model that
    reads its input's dimensions from the front reads otherwise: ``nn.LogSoftmax(dim=1)`` of ``[rows, classes]``)
    unless the model is built of layers that read only their inputs' last dimensions (see
    :func:`~tdhook.attribution.methods._mixed_copies.copies_apart`)."""
    if batch_normalising_module(method) is not None:
        return False
    return bool(len(batch)) or copies_apart(getattr(method, "module", method), 0)


def _flat(attributions: Sequence[torch.Tensor], batch_dims: int) -> torch.Tensor:
    return torch.cat([a.flatten(batch_dims) for a in attributions], dim=-1)


@keeps_running_statistics
@keeps_global_rng
def sensitivity_max(
    method: TensorDictModuleBase,
    td: TensorDictBase,
    *,
    perturb_fn: Callable[[TensorDictBase, float], TensorDictBase] | None = None,
    perturb_radius: float = 0.02,
    n_perturb_samples: int = 10,
    seed: int | None = None,
    in_keys: Sequence[NestedKey] | None = None,
    relevance_key: NestedKey | None = None,
) -> torch.Tensor:
    """The largest ``‖e(x̃) − e(x)‖ / ‖e(x)‖`` over perturbed inputs ``x̃``, per sample.

    ``e`` is the method's attribution, the norm the Frobenius norm over all explained keys together (a zero
    ``‖e(x)‖`` counts as 1). The method explains each perturbed input for the target it explained at ``x``
    (``target=None`` is held at the original argmax, a callable at the weights ``target(y) / y`` it gave the
    output ``y`` at ``x``). All perturbed inputs run in one call of the method, stacked along the batch's first
    dimension (``[n_perturb_samples * B, ...]``, with the method's per-sample baselines and feature masks repeated
    alike), or one call each where the model normalises over the batch (a BatchNorm in training mode or without
    running statistics), the batch is ``[]`` and the model reads more than its inputs' last dimensions (stacked,
    the copies would be a new first dimension of the sample), a recurrent layer reads the batch's first dimension
    as time (it saw other time lengths in the stacked call than in the method's own call), or the explained output
    scores the samples of its batch against each other (CLIP's ``logits_per_image``: its dimensions after the batch
    grow with it).

    Args:
        method: the attribution wrapper (:class:`~tdhook.attribution.LRP` or another method); it is called, and
            its ``target`` is restored afterwards.
        td: the inputs (left unchanged).
        perturb_fn: ``perturb_fn(repeated, perturb_radius)`` returns the perturbed explained keys, given them with
            each sample repeated ``n_perturb_samples`` times (batch ``batch + [n_perturb_samples]``, a copy). By
            default uniform noise in ``[-perturb_radius, perturb_radius]`` is added to every element.
        perturb_radius: the radius of the perturbation (the L∞ ball for the default).
        n_perturb_samples: how many perturbed inputs per sample.
        seed: the seed of the default noise (``None``: fresh entropy); the global random state is not used.
        in_keys: the explained keys (by default the method's).
        relevance_key: the prefix of the method's attribution keys (by default its ``relevance_key``).

    Returns:
        ``batch``.

    Raises:
        TypeError: ``method`` is not a TensorDict module.
        KeyError, ValueError: the perturbed TensorDict lacks a key or changes its shape.
        ValueError: the explained output is not one per sample (it does not start with the batch shape).

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tdhook.attribution import LRP
        >>> lrp = LRP(torch.nn.Linear(3, 2), in_keys=["x"], out_keys=["y"])
        >>> td = TensorDict(x=torch.randn(4, 3), batch_size=[4])
        >>> sensitivity_max(lrp, td, seed=0).shape
        torch.Size([4])
    """
    check_method(method, "sensitivity_max")
    if isinstance(n_perturb_samples, bool) or not isinstance(n_perturb_samples, int) or n_perturb_samples < 1:
        raise ValueError(f"sensitivity_max: n_perturb_samples must be a positive int, got {n_perturb_samples!r}")
    keys = method_keys(method, in_keys, td)
    refuse_recomputed_keys(method, keys, "sensitivity_max")
    for key in keys:  # the keys perturbed: inputs the TensorDict holds
        inputs_value(td, key)
    prefix = method_prefix(method, relevance_key)
    units = unit_dims(method)  # target="all": every unit's attribution, compared together
    batch, n = td.batch_size, n_perturb_samples
    rng = generator(seed) if perturb_fn is None else None
    # A recurrent layer that reads the batch's first dimension as time would read the stacked copies as one
    # sequence: the time lengths of the method's own call tell (see tdhook.attribution.methods._time_reads).
    recurrent = recurrent_layers(dict(method.named_modules()))
    with torch.no_grad():
        with statistics_kept(method), time_lengths(recurrent) as own:  # from the caller's running statistics
            result = explain(method, td)
        td = in_batch_of(td, result)  # a context the model reads as one sample (torchrl's Decision Transformer's)
        batch = td.batch_size
        target = original_target(method, result, len(batch), td)  # first: it names a method of several outputs
        _refuse_batch_reduced(explained_output(method, result), batch)
        reference = _flat(written_attributions(result, td, keys, prefix, units), len(batch))
        expanded = repeated(td, keys, n)
        if perturb_fn is None:
            perturbed = expanded.apply(
                lambda x: x + (torch.rand(x.shape, generator=rng, dtype=x.dtype) * 2 - 1).to(x.device) * perturb_radius
            )
        else:
            perturbed = perturb_fn(expanded, perturb_radius)
        perturbed = check_perturbed("sensitivity_max", "perturbed input", perturbed, keys, expanded)
    # The perturbed copies stacked along the batch's first dimension, ``[n * B, ...]``: a ``[B, T]`` batch keeps
    # its time dimension for a method whose model mixes along it. A model that normalises over the batch explains
    # each copy alone (stacked, the copies would change each other's explanations).
    stacked = stacked_batch(n, batch)
    work = carried_inputs(method, td).expand(n, *batch).clone(recurse=False)
    for key in keys:
        work.set(key, perturbed.get(key).movedim(len(batch), 0))
    attributions = None
    if _stackable(method, batch):
        held = target_set(method, repeat_target(target, batch, n))
        with held, options_repeated(method, td, n), torch.no_grad(), statistics_kept(method):
            with time_lengths(recurrent) as lengths:
                explained = explain(method, work.reshape(*stacked))
        # A target that scores the samples of its batch against each other scored the copies so, and each sample
        # against the first copy's (see tdhook.attribution.methods._cross_sample_outputs).
        across = scored_across_copies(
            explained_output(method, explained), len(stacked), explained_output(method, result), len(batch)
        )
        if not (across or read_as_one_sequence(own, lengths)):
            read = written_attributions(explained, work.reshape(*stacked), keys, prefix, units)
            attributions = [a.reshape(n, *batch, *a.shape[len(stacked) :]) for a in read]
    if attributions is None:  # one call per copy
        with target_set(method, target), torch.no_grad():
            copies = []
            for i in range(n):
                with statistics_kept(method):
                    copies.append(written_attributions(explain(method, work[i]), work[i], keys, prefix, units))
        attributions = [torch.stack(parts) for parts in zip(*copies, strict=True)]
    # The norms in float32 at least, rounded once to the attributions' dtype: in float16 a norm of finite
    # attributions passes 65504 to inf, and the ratio of two such norms is NaN.
    dtype = reference.dtype
    wide = accumulation_dtype(dtype)
    changed, reference = _flat(attributions, len(batch) + 1).movedim(0, -2).to(wide), reference.to(wide)
    norm = reference.norm(dim=-1, keepdim=True)
    norm = torch.where(norm == 0, torch.ones_like(norm), norm)
    return ((changed - reference.unsqueeze(-2)).norm(dim=-1) / norm).amax(-1).to(dtype)
