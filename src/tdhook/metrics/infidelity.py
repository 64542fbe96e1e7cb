"""Infidelity (Yeh et al., 2019): how far the attribution times a perturbation is from the score change it causes."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import nn

from tdhook.attribution.methods._options import checked_flag
from tdhook.attribution.targets import Target
from tdhook.metrics._batch_statistics import keeps_running_statistics
from tdhook.metrics._features import Features
from tdhook.metrics._positions_read_across import warn_for_positions_read_across
from tdhook.metrics._random import keeps_global_rng
from tdhook.metrics._scoring import Scorer

__all__ = ["infidelity", "repeated"]

PerturbFn = Callable[[TensorDictBase], tuple[TensorDictBase, TensorDictBase]]


def repeated(td: TensorDictBase, keys: Sequence[NestedKey], n: int) -> TensorDictBase:
    """The ``keys`` of ``td`` with each sample repeated ``n`` times: batch ``batch + [n]``, a copy out of any graph.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> repeated(TensorDict(x=torch.ones(2, 3), batch_size=[2]), ["x"], 4)["x"].shape
        torch.Size([2, 4, 3])
    """
    selected = td.select(*keys).detach()
    return selected.unsqueeze(selected.batch_dims).expand(*selected.batch_size, n).clone()


def check_perturbed(
    name: str, what: str, value: object, keys: Sequence[NestedKey], expected: TensorDictBase
) -> TensorDictBase:
    """``value`` if it is a TensorDict holding every key shaped as in ``expected``.

    Raises:
        TypeError: ``value`` is not a TensorDict.
        KeyError: a key is missing.
        ValueError: a key has another shape.
    """
    if not isinstance(value, TensorDictBase):
        raise TypeError(f"{name}: perturb_fn must return {what} as a TensorDict, got {type(value).__name__}")
    for key in keys:
        got = value.get(key, None)
        if got is None:
            raise KeyError(f"{name}: the {what} returned by perturb_fn has no key {key!r}")
        if not isinstance(got, torch.Tensor) or got.shape != expected.get(key).shape:
            raise ValueError(
                f"{name}: the {what} at {key!r} must be shaped like the repeated input "
                f"{list(expected.get(key).shape)}, got {list(getattr(got, 'shape', []))}"
            )
    return value


@keeps_running_statistics
@keeps_global_rng
def infidelity(
    module: TensorDictModuleBase | nn.Module,
    td: TensorDictBase,
    *,
    perturb_fn: PerturbFn,
    n_perturb_samples: int = 10,
    normalize: bool = False,
    in_keys: Sequence[NestedKey] | None = None,
    out_keys: Sequence[NestedKey] | None = None,
    target_key: NestedKey | None = None,
    target: Target = None,
    relevance_key: NestedKey = "attribution",
) -> torch.Tensor:
    """The mean squared gap between ``attribution · perturbation`` and the score drop, per sample.

    ``perturb_fn(repeated)`` receives the explained keys with each sample repeated ``n_perturb_samples`` times
    (batch ``batch + [n_perturb_samples]``, a copy) and returns ``(perturbation, perturbed)``: two TensorDicts with
    the same keys and shapes. For each draw ``I`` with perturbed input ``x̃`` the gap is
    ``Σ attribution · I − (f(x) − f(x̃))``, the dot product over all explained keys together; the result is the
    mean of its square over the draws. With ``normalize=True`` the attribution is first scaled by the ``β`` that
    minimises the mean (``β = E[a·I · Δf] / E[(a·I)²]``). All draws run in one forward pass.

    Args:
        module: the model: a ``TensorDictModuleBase``, or a plain ``nn.Module`` with ``in_keys`` and ``out_keys``.
        td: inputs and attributions (left unchanged).
        perturb_fn: see above.
        n_perturb_samples: how many perturbations per sample.
        normalize: scale the attribution by the best ``β`` first.
        in_keys, out_keys, target_key, target, relevance_key: as for :func:`~tdhook.metrics.pixel_flipping`.

    Returns:
        ``batch``.

    Raises:
        TypeError, KeyError, ValueError: ``perturb_fn`` returned something other than two TensorDicts with the
            explained keys shaped like the repeated inputs.
        TypeError: ``normalize`` is not a bool.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> net = torch.nn.Linear(3, 1, bias=False, dtype=torch.float64)
        >>> x = torch.randn(2, 3, dtype=torch.float64)
        >>> td = TensorDict(x=x, attribution=TensorDict(x=x * net.weight.detach()), batch_size=[2])
        >>> def drop_some(repeated):  # binary perturbations suit attributions that include the input (x · w here)
        ...     mask = (torch.rand(repeated["x"].shape) < 0.5).double()
        ...     return repeated.apply(lambda v: mask), repeated.apply(lambda v: v * (1 - mask))
        >>> infidelity(net, td, perturb_fn=drop_some, in_keys=["x"], out_keys=["y"]).abs().max() < 1e-10
        tensor(True)
    """
    if isinstance(n_perturb_samples, bool) or not isinstance(n_perturb_samples, int) or n_perturb_samples < 1:
        raise ValueError(f"infidelity: n_perturb_samples must be a positive int, got {n_perturb_samples!r}")
    checked_flag(normalize, "normalize", "infidelity")
    scorer = Scorer(module, td, in_keys=in_keys, out_keys=out_keys, target_key=target_key, target=target)
    features = Features.read(td, scorer.keys, relevance_key)
    batch_dims = td.batch_dims
    expanded = repeated(td, scorer.keys, n_perturb_samples)
    with torch.no_grad():
        returned = perturb_fn(expanded)
    if not isinstance(returned, tuple) or len(returned) != 2:
        raise TypeError("infidelity: perturb_fn must return a tuple (perturbation, perturbed) of TensorDicts")
    perturbation = check_perturbed("infidelity", "perturbation", returned[0], scorer.keys, expanded)
    perturbed = check_perturbed("infidelity", "perturbed input", returned[1], scorer.keys, expanded)
    scores = scorer.scores({key: perturbed.get(key).movedim(batch_dims, 0) for key in scorer.keys})
    # In float32 at least, rounded once to the result's dtype: in float16 the sums of squares overflow past 65504
    # (a few hundred draws of dot products near 15), and the gaps came out NaN.
    dtype = torch.result_type(scores, features.attributions[0])
    for key, a in zip(scorer.keys, features.attributions, strict=True):
        dtype = torch.promote_types(dtype, torch.promote_types(a.dtype, perturbation.get(key).dtype))
    wide = torch.promote_types(dtype, torch.float32)
    drops = scorer.reference.unsqueeze(-1).to(wide) - scores.movedim(0, -1).to(wide)
    dots = sum(
        (a.unsqueeze(batch_dims).to(wide) * perturbation.get(key).to(wide)).flatten(batch_dims + 1).sum(-1)
        for key, a in zip(scorer.keys, features.attributions, strict=True)
    )
    if normalize:
        denominator = dots.pow(2).sum(-1, keepdim=True)
        beta = (dots * drops).sum(-1, keepdim=True) / torch.where(denominator == 0, 1.0, denominator)
        dots = beta * dots
    # The perturbations are the caller's function's: the check of the positions read across splits them at zeros.
    zeros = [torch.zeros((), dtype=x.dtype, device=x.device) for x in features.inputs]
    warn_for_positions_read_across(scorer, features, zeros, "infidelity")
    return (dots - drops).pow(2).mean(-1).to(dtype)
