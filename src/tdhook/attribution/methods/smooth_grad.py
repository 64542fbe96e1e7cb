"""SmoothGrad: saliency averaged over copies of the input with Gaussian noise (or its square's mean, or variance)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Union

import torch
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import nn

from tdhook.attribution.methods._accumulation import accumulation_dtype
from tdhook.attribution.methods._base import AttributionMethod, Call, pass_gradients, refuse_unreached
from tdhook.attribution.methods._options import (
    checked_flag,
    draws_shape,
    seeded_generator,
    steps_per_pass,
)
from tdhook.attribution.methods._settable_options import (
    CheckedOption,
    PerKeyOption,
    batch_size,
    check_stdevs,
    one_of,
    positive_int,
    seed_value,
)
from tdhook.attribution.targets import Target

__all__ = ["SmoothGrad", "noisy_copies"]

NT_TYPES = ("smoothgrad", "smoothgrad_sq", "vargrad")


def noisy_copies(
    inputs: Sequence[torch.Tensor], stdevs: Sequence[float], n_samples: int, seed: int | None, batch_dims: int = 0
) -> list[torch.Tensor]:
    """``n_samples`` copies of each input with ``N(0, stdev²)`` noise added, drawn from a generator of their own.

    The noise is drawn on the CPU from a ``torch.Generator`` seeded with ``seed``, key after key, then scaled by
    the key's ``stdev`` and moved to the input's device; the global random state is not touched. With a seed,
    every sample of the batch (the first ``batch_dims`` dimensions) takes the same draws,
    ``torch.randn(n_samples, *[1] * batch_dims, *sample_shape, dtype=x.dtype)``: a sample's copies do not depend on
    the batch it comes in (alone, in a batch, or stacked with perturbed copies by a metric such as
    :func:`~tdhook.metrics.sensitivity_max`). Without one, each sample draws its own,
    ``torch.randn(n_samples, *x.shape)``.

    Args:
        inputs: the inputs, one per explained key.
        stdevs: the noise's standard deviation per key.
        n_samples: the number of copies.
        seed: the generator's seed (``None`` for a nondeterministic one).
        batch_dims: the number of batch dimensions of the inputs.

    Returns:
        Per key, ``[n_samples, *x.shape]``.

    Examples:
        >>> x = torch.zeros(2, 3)
        >>> a, = noisy_copies([x], [0.5], 4, seed=0, batch_dims=1)
        >>> a.shape, torch.equal(a, noisy_copies([x], [0.5], 4, seed=0, batch_dims=1)[0])
        (torch.Size([4, 2, 3]), True)
        >>> torch.equal(a[:, 1], noisy_copies([x[1:]], [0.5], 4, seed=0, batch_dims=1)[0][:, 0])  # as it is alone
        True
    """
    generator = seeded_generator(seed)
    copies = []
    for x, stdev in zip(inputs, stdevs, strict=True):
        shape = draws_shape(x.shape, n_samples, batch_dims, seed)
        noise = torch.randn(shape, generator=generator, dtype=x.dtype, device="cpu")
        copies.append(x.unsqueeze(0) + stdev * noise.to(x.device))
    return copies


class SmoothGrad(AttributionMethod):
    """Saliency at noisy copies of the input, aggregated, written at ``(relevance_key, *in_key)``.

    With ``s`` the saliency (absolute gradient, or the gradient for
    ``abs=False``) at ``x + ε``, ``ε ~ N(0, stdev²)``: ``nt_type="smoothgrad"``
    writes the mean of ``s``, ``"smoothgrad_sq"`` the mean of ``s²``, and
    ``"vargrad"`` the variance ``mean((s − mean(s))²)``, summed as squared
    deviations from a mean (never negative, 0 where ``s`` does not vary). All explained keys get
    their noise in the same copies; keys not explained stay fixed. The copies
    run in one forward and one backward pass (or in pieces of
    ``internal_batch_size`` rows). With ``stdev=0`` SmoothGrad is
    :class:`~tdhook.attribution.Saliency`.

    Args:
        module: a ``TensorDictModuleBase``, or a plain ``nn.Module`` with ``in_keys`` and ``out_keys``.
        in_keys: see :class:`~tdhook.attribution.methods._base.AttributionMethod`.
        out_keys: the output keys of a plain module.
        target_key: the output to explain.
        target: ``None``, an int, a LongTensor, a callable or ``"all"`` (as for LRP), resolved on the input.
        relevance_key: the prefix of the attribution keys.
        n_samples: the number of noisy copies.
        stdev: the noise's standard deviation, one number or a dict keyed by in_key.
        seed: the seed of the noise (drawn as :func:`noisy_copies` says: every sample takes the same draws, so that
            a sample's attribution does not depend on the batch it comes in); ``None`` for fresh noise every call,
            each sample its own.
        nt_type: ``"smoothgrad"``, ``"smoothgrad_sq"`` or ``"vargrad"``.
        abs: whether the saliency is the gradient's absolute value.
        internal_batch_size: the most rows (copies × samples) per forward pass; ``None`` for all at once. A pass
            holds one of every sample at least: below the batch's samples, a warning says so.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tdhook.attribution import SmoothGrad
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        >>> smooth = SmoothGrad(net, in_keys=["x"], out_keys=["y"], n_samples=16, stdev=0.1, seed=0)
        >>> td = TensorDict(x=torch.randn(4, 3), batch_size=[4])
        >>> torch.equal(smooth(td.clone())["attribution", "x"], smooth(td.clone())["attribution", "x"])
        True
    """

    tunables = {
        "n_samples": (int, {"low": 2, "high": 100, "log": True}),
        "stdev": (float, {"low": 1e-3, "high": 2.0, "log": True}),
        "nt_type": (str, {"choices": list(NT_TYPES)}),
    }

    _per_key_options = ("stdevs",)
    # The noise's standard deviation as given (``stdevs`` holds it per explained key); set, it holds for the next
    # call, as ``set_kwargs(stdev=...)`` does.
    stdev = PerKeyOption(check_stdevs, per_key_name="stdevs")
    # Checked whenever set, as the constructor checks them.
    n_samples = CheckedOption(positive_int)
    seed = CheckedOption(seed_value)
    nt_type = CheckedOption(one_of(NT_TYPES))
    abs = CheckedOption(checked_flag)
    internal_batch_size = CheckedOption(batch_size)

    def __init__(
        self,
        module: TensorDictModuleBase | nn.Module,
        *,
        in_keys: Sequence[NestedKey] | None = None,
        out_keys: Sequence[NestedKey] | None = None,
        target_key: NestedKey | None = None,
        target: Target = None,
        relevance_key: str = "attribution",
        n_samples: int = 5,
        stdev: Union[float, Mapping[NestedKey, float]] = 1.0,
        seed: int | None = None,
        nt_type: str = "smoothgrad",
        abs: bool = True,
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
        self.stdev = stdev
        self.n_samples = n_samples
        self.seed = seed
        self.nt_type = nt_type
        self.abs = abs
        self.internal_batch_size = internal_batch_size

    def _attribute(self, call: Call) -> list[torch.Tensor]:
        copies = noisy_copies(call.inputs, self.stdevs, self.n_samples, self.seed, call.batch_dims)
        units = call.seeds.shape[0]
        # Summed over the copies in float32 at least (see accumulation_dtype), rounded once to the input's dtype.
        sums = [x.new_zeros(units, *x.shape, dtype=accumulation_dtype(x.dtype)) for x in call.inputs]
        squares = [torch.zeros_like(total) for total in sums]
        # vargrad: the squared deviations from the mean, summed per pass around that pass's mean and merged across
        # passes (Chan et al.), never negative; mean(s²) − mean(s)² cancels to negative numbers where s barely varies.
        deviations = [torch.zeros_like(total) for total in sums]
        chunk = steps_per_pass(self.n_samples, call.batch_shape.numel(), self.internal_batch_size, "SmoothGrad")
        reached: list[bool] = []  # whether any pass so far reached each input
        for start in range(0, self.n_samples, chunk):
            objective, leaves = self._evaluate(call, [c[start : start + chunk] for c in copies], grad=True)
            gradients = pass_gradients(self, objective, leaves, reached)
            for total, square, deviation, grad in zip(sums, squares, deviations, gradients, strict=True):
                saliency = (grad.abs() if self.abs else grad).to(total.dtype)
                if self.nt_type == "vargrad":
                    merge_deviations(deviation, total, start, saliency)
                total += saliency.sum(1)
                square += (saliency * saliency).sum(1)
        refuse_unreached(self, call, reached)
        if self.nt_type == "smoothgrad":
            found = [total / self.n_samples for total in sums]
        elif self.nt_type == "smoothgrad_sq":
            found = [square / self.n_samples for square in squares]
        else:
            found = [deviation / self.n_samples for deviation in deviations]
        return [value.to(x.dtype) for value, x in zip(found, call.inputs, strict=True)]


def merge_deviations(deviation: torch.Tensor, total: torch.Tensor, seen: int, saliency: torch.Tensor) -> None:
    """Add a pass's copies (``saliency``, ``[units, copies, ...]``) to the summed squared deviations ``deviation``
    of the ``seen`` copies before it, whose sum is ``total``, in place (Chan, Golub and LeVeque's pairwise update).

    Every term is a square or a product of counts and a square, so the sum is never negative, and it is 0 where
    every copy's saliency is the same.

    Examples:
        >>> s = torch.tensor([[[1.0], [2.0], [4.0]]])
        >>> deviation, total = torch.zeros(1, 1), torch.zeros(1, 1)
        >>> merge_deviations(deviation, total, 0, s[:, :2]); total += s[:, :2].sum(1)
        >>> merge_deviations(deviation, total, 2, s[:, 2:])
        >>> torch.allclose(deviation / 3, s.var(1, unbiased=False))
        True
    """
    count = saliency.shape[1]
    mean = saliency.mean(1)
    deviation += (saliency - mean.unsqueeze(1)).square().sum(1)
    if seen:
        deviation += (mean - total / seen).square() * (seen * count / (seen + count))
