"""GradientSHAP: the expected gradient × (input − reference) over reference samples and points between them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Union

import torch
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import nn

from tdhook.attribution._inputs import describe
from tdhook.attribution.methods._accumulation import accumulation_dtype
from tdhook.attribution.methods._base import AttributionMethod, Call, pass_gradients, refuse_unreached
from tdhook.attribution.methods._options import (
    MISSING,
    draws_shape,
    seeded_generator,
    steps_per_pass,
)
from tdhook.attribution.methods._settable_options import (
    CheckedOption,
    PerKeyOption,
    batch_size,
    check_stdevs,
    positive_int,
    seed_value,
)
from tdhook.attribution.targets import Target

__all__ = ["GradientShap", "shap_draws"]


def shap_draws(
    inputs: Sequence[torch.Tensor],
    references: Sequence[torch.Tensor],
    stdevs: Sequence[float],
    n_samples: int,
    batch_dims: int,
    seed: int | None,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The random draws of GradientSHAP, from a CPU generator of its own seeded with ``seed``, in this order.

    1. ``indices = torch.randint(R, (n_samples, *batch))``: the reference sample for each copy,
       the same for every key (a reference is one sample of every key);
    2. ``alphas = torch.rand((n_samples, *batch), dtype=float64)``: where on the way from the
       reference to the input each copy lies, the same for every key;
    3. key after key, ``torch.randn((n_samples, *x.shape), dtype=x.dtype)`` times the key's ``stdev``:
       the noise added to the input.

    With a seed, every sample of the batch takes the same draws (each drawn with size 1 along the batch
    dimensions, then broadcast: see :func:`~tdhook.attribution.methods._options.draws_shape`), so that a sample's
    attribution does not depend on the batch it comes in (alone, in a batch, or stacked with perturbed copies by a
    metric such as :func:`~tdhook.metrics.sensitivity_max`).

    Args:
        inputs: the inputs, one per explained key.
        references: per key, ``[R, *sample_shape]``.
        stdevs: the noise's standard deviation per key.
        n_samples: the copies per sample.
        batch_dims: the number of batch dimensions.
        seed: the seed (``None`` for a nondeterministic one).

    Returns:
        ``indices``, ``alphas`` (float64, on the CPU) and the noisy inputs ``[n_samples, *x.shape]``.

    Examples:
        >>> x = torch.zeros(4, 3)
        >>> indices, alphas, (noisy,) = shap_draws([x], [torch.ones(2, 3)], [0.0], 5, 1, seed=0)
        >>> indices.shape, alphas.shape, noisy.shape, bool(noisy.eq(0).all())
        (torch.Size([5, 4]), torch.Size([5, 4]), torch.Size([5, 4, 3]), True)
    """
    generator = seeded_generator(seed)
    batch = inputs[0].shape[:batch_dims]
    shape = draws_shape(batch, n_samples, batch_dims, seed)
    indices = torch.randint(references[0].shape[0], shape, generator=generator, device="cpu").expand(n_samples, *batch)
    alphas = torch.rand(shape, generator=generator, dtype=torch.float64, device="cpu").expand(n_samples, *batch)
    noisy = []
    for x, stdev in zip(inputs, stdevs, strict=True):
        shape = draws_shape(x.shape, n_samples, batch_dims, seed)
        noise = torch.randn(shape, generator=generator, dtype=x.dtype, device="cpu")
        noisy.append(x.unsqueeze(0) + stdev * noise.to(x.device))
    return indices, alphas, noisy


def _check_references(owner: str, keys: Sequence[NestedKey], references: list) -> None:
    """Refuse reference samples that are no floating-point tensor ``[R, *sample_shape]``, or that differ in ``R``
    between keys."""
    sizes = set()
    for key, reference in zip(keys, references, strict=True):
        if reference is MISSING:
            continue
        if not isinstance(reference, torch.Tensor) or not reference.is_floating_point() or reference.dim() < 1:
            raise TypeError(
                f"GradientShap: the baselines of input key {key!r} must be a floating-point tensor of reference "
                f"samples [R, *sample_shape], got {describe(reference)}"
            )
        sizes.add(reference.shape[0])
    if len(sizes) != 1 or 0 in sizes:
        raise ValueError(
            f"GradientShap: every key needs the same number R > 0 of reference samples, got {sorted(sizes)}"
        )


class GradientShap(AttributionMethod):
    """GradientSHAP, written at ``(relevance_key, *in_key)`` with each input's shape.

    Each sample gets ``n_samples`` copies; copy ``k`` draws a reference
    ``r`` among ``baselines`` and a point ``α`` in [0, 1] (the same for every
    key), adds ``N(0, stdev²)`` noise to the input, ``x̃ = x + ε``, and
    contributes ``∂F/∂x (r + α (x̃ − r)) · (x̃ − r)``; the attribution is the
    mean over the copies, which run in one forward and one backward pass (or
    pieces of ``internal_batch_size`` rows). On a linear model it is
    ``w · (x − mean reference)`` in expectation, and exactly ``w · (x − r)``
    with one reference and no noise. Draws follow :func:`shap_draws`.

    Args:
        module: a ``TensorDictModuleBase``, or a plain ``nn.Module`` with ``in_keys`` and ``out_keys``.
        in_keys: see :class:`~tdhook.attribution.methods._base.AttributionMethod`.
        out_keys: the output keys of a plain module.
        target_key: the output to explain.
        target: ``None``, an int, a LongTensor, a callable or ``"all"`` (as for LRP), resolved on the input.
        relevance_key: the prefix of the attribution keys.
        baselines: the reference samples, ``[R, *sample_shape]`` (one tensor, or a dict keyed by in_key
            with the same ``R`` for every key).
        n_samples: the copies per sample.
        stdevs: the noise's standard deviation, one number or a dict keyed by in_key.
        seed: the seed of the draws; ``None`` for fresh draws every call.
        internal_batch_size: the most rows (copies × samples) per forward pass; ``None`` for all at once. A pass
            holds one of every sample at least: below the batch's samples, a warning says so.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tdhook.attribution import GradientShap
        >>> net = torch.nn.Linear(3, 1)
        >>> shap = GradientShap(net, in_keys=["x"], out_keys=["v"], baselines=torch.zeros(1, 3), seed=0)
        >>> x = torch.randn(4, 3)
        >>> torch.allclose(shap(TensorDict(x=x, batch_size=[4]))["attribution", "x"], net.weight.detach() * x)
        True
    """

    tunables = {
        "n_samples": (int, {"low": 2, "high": 100, "log": True}),
        "stdevs": (float, {"low": 0.0, "high": 1.0, "log": False}),
    }

    _per_key_options = ("_baselines", "_stdevs")  # per explained key, from the options as given
    # Settable after construction: read, and checked, per key as the constructor reads them.
    baselines = PerKeyOption(_check_references)
    stdevs = PerKeyOption(check_stdevs)
    # Checked whenever set, as the constructor checks them.
    n_samples = CheckedOption(positive_int)
    seed = CheckedOption(seed_value)
    internal_batch_size = CheckedOption(batch_size)

    def __init__(
        self,
        module: TensorDictModuleBase | nn.Module,
        *,
        baselines: Union[torch.Tensor, Mapping[NestedKey, torch.Tensor]],
        in_keys: Sequence[NestedKey] | None = None,
        out_keys: Sequence[NestedKey] | None = None,
        target_key: NestedKey | None = None,
        target: Target = None,
        relevance_key: str = "attribution",
        n_samples: int = 5,
        stdevs: Union[float, Mapping[NestedKey, float]] = 0.0,
        seed: int | None = None,
        internal_batch_size: int | None = None,
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
        self.stdevs = stdevs
        self.n_samples = n_samples
        self.seed = seed
        self.internal_batch_size = internal_batch_size

    def _references(self, call: Call) -> list[torch.Tensor]:
        out = []
        for key, x, reference in zip(self.explained_keys, call.inputs, self._baselines, strict=True):
            sample = x.shape[call.batch_dims :]
            if reference.shape[1:] != sample:
                raise ValueError(
                    f"GradientShap: the baselines of input key {key!r} have shape {list(reference.shape)}; "
                    f"expected [R, *sample_shape] = [R, {', '.join(map(str, sample))}]"
                )
            out.append(reference.to(dtype=x.dtype, device=x.device))
        return out

    def _attribute(self, call: Call) -> list[torch.Tensor]:
        references = self._references(call)
        indices, alphas, noisy = shap_draws(
            call.inputs, references, self._stdevs, self.n_samples, call.batch_dims, self.seed
        )
        units = call.seeds.shape[0]
        # Summed over the copies in float32 at least (see accumulation_dtype), rounded once to the input's dtype.
        totals = [x.new_zeros(units, *x.shape, dtype=accumulation_dtype(x.dtype)) for x in call.inputs]
        chunk = steps_per_pass(self.n_samples, call.batch_shape.numel(), self.internal_batch_size, "GradientShap")
        reached: list[bool] = []  # whether any pass so far reached each input
        for start in range(0, self.n_samples, chunk):
            stop = start + chunk
            drawn = [r[indices[start:stop].to(r.device)] for r in references]  # [copies, *batch, *sample]
            differences = [n[start:stop] - d for n, d in zip(noisy, drawn, strict=True)]
            points = []
            for d, diff in zip(drawn, differences, strict=True):
                a = alphas[start:stop].to(dtype=diff.dtype, device=diff.device)
                points.append(d + a.view(*a.shape, *[1] * (diff.dim() - a.dim())) * diff)
            objective, leaves = self._evaluate(call, points, grad=True)
            for total, grad, diff in zip(
                totals, pass_gradients(self, objective, leaves, reached), differences, strict=True
            ):
                total += (grad.to(total.dtype) * diff.unsqueeze(0).to(total.dtype)).sum(1)
        refuse_unreached(self, call, reached)
        return [(total / self.n_samples).to(x.dtype) for total, x in zip(totals, call.inputs, strict=True)]
