"""Integrated gradients: (input − baseline) times the gradient averaged along the straight path between them."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import nn

from tdhook.attribution.methods._accumulation import accumulation_dtype
from tdhook.attribution.methods._base import AttributionMethod, Call, pass_gradients, refuse_unreached
from tdhook.attribution.methods._options import Baselines, baseline_tensors, steps_per_pass
from tdhook.attribution.methods._quadrature import METHODS, quadrature
from tdhook.attribution.methods._settable_options import CheckedOption, batch_size
from tdhook.attribution.targets import Target

__all__ = ["IntegratedGradients"]


class IntegratedGradients(AttributionMethod):
    """Integrated gradients, written at ``(relevance_key, *in_key)`` with each input's shape.

    For every explained key, ``(x − b) · Σₖ wₖ ∂F/∂x (b + αₖ (x − b))``: the
    explained output ``F`` differentiated at points ``αₖ`` of the straight
    path from the baseline ``b`` to the input ``x``, weighted by a quadrature
    rule on [0, 1] computed in float64. All explained keys move along the path
    together (one α per point); keys not explained stay fixed. The points of
    the path are evaluated in one forward and one backward pass (or in pieces
    of ``internal_batch_size`` rows).

    Args:
        module: a ``TensorDictModuleBase``, or a plain ``nn.Module`` with ``in_keys`` and ``out_keys``.
        in_keys: see :class:`~tdhook.attribution.methods._base.AttributionMethod`.
        out_keys: the output keys of a plain module.
        target_key: the output to explain.
        target: ``None``, an int, a LongTensor, a callable or ``"all"`` (as for LRP), resolved on the input.
        relevance_key: the prefix of the attribution keys.
        baselines: a number, a tensor with one sample's shape (or the input's), or a dict keyed by in_key.
        n_steps: the number of points on the path.
        method: ``"gausslegendre"``, ``"riemann_trapezoid"``, ``"riemann_left"``,
            ``"riemann_right"`` or ``"riemann_middle"`` (see
            :func:`~tdhook.attribution.methods._quadrature.quadrature`).
        internal_batch_size: the most rows (points × samples) per forward pass; ``None`` for all at once. A pass
            holds one of every sample at least: below the batch's samples, a warning says so.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tdhook.attribution import IntegratedGradients
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        >>> ig = IntegratedGradients(net, in_keys=["x"], out_keys=["v"], baselines=0.0, n_steps=20)
        >>> x = torch.randn(4, 3, dtype=torch.float64)
        >>> td = ig.double()(TensorDict(x=x, batch_size=[4]))
        >>> completeness = td["attribution", "x"].sum(-1) - (td["v"] - net(torch.zeros_like(x))).squeeze(-1)
        >>> bool(completeness.abs().max() < 1e-8)
        True
    """

    _per_call_options = ("baselines",)
    tunables = {
        "n_steps": (int, {"low": 5, "high": 200, "log": True}),
        "method": (str, {"choices": list(METHODS)}),
    }

    internal_batch_size = CheckedOption(batch_size)  # checked whenever set, as the constructor checks it

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
        n_steps: int = 50,
        method: str = "gausslegendre",
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
        self.n_steps = n_steps
        self.method = method
        self._points: tuple | None = None
        self._quadrature()  # checked here, and found again where the attributes change
        self.internal_batch_size = internal_batch_size

    def _quadrature(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The points and weights of ``method`` with ``n_steps`` points (as the attributes are at the call: set
        directly, they hold as set_kwargs's), kept while they stay the same."""
        key = (self.method, self.n_steps)
        if self._points is None or self._points[0] != key:
            try:
                self._points = (key, *quadrature(*key))
            except ValueError as err:
                raise ValueError(f"IntegratedGradients: {err}") from None
        return self._points[1], self._points[2]

    def _attribute(self, call: Call) -> list[torch.Tensor]:
        baselines = baseline_tensors(
            self.baselines, self.explained_keys, call.inputs, call.batch_dims, "IntegratedGradients"
        )
        differences = [x - b for x, b in zip(call.inputs, baselines, strict=True)]
        # Summed over the points in float32 at least (see accumulation_dtype), rounded once to the input's dtype.
        totals = [x.new_zeros(call.seeds.shape[0], *x.shape, dtype=accumulation_dtype(x.dtype)) for x in call.inputs]
        points, weights_of_points = self._quadrature()
        chunk = steps_per_pass(self.n_steps, call.batch_shape.numel(), self.internal_batch_size, "IntegratedGradients")
        reached: list[bool] = []  # whether any pass so far reached each input
        for start in range(0, self.n_steps, chunk):
            alphas = points[start : start + chunk]
            weights = weights_of_points[start : start + chunk]
            perturbed = []
            for b, d in zip(baselines, differences, strict=True):
                a = alphas.to(dtype=d.dtype, device=d.device).view(-1, *[1] * d.dim())
                perturbed.append(b.unsqueeze(0) + a * d.unsqueeze(0))
            objective, leaves = self._evaluate(call, perturbed, grad=True)
            for total, grad in zip(totals, pass_gradients(self, objective, leaves, reached), strict=True):
                w = weights.to(dtype=total.dtype, device=grad.device).view(1, -1, *[1] * (grad.dim() - 2))
                total += (grad.to(total.dtype) * w).sum(1)
        refuse_unreached(self, call, reached)
        return [
            (total * d.unsqueeze(0).to(total.dtype)).to(d.dtype) for total, d in zip(totals, differences, strict=True)
        ]
