"""AOPC: the area over the perturbation curve (Samek et al., 2017)."""

from __future__ import annotations

import torch

__all__ = ["aopc"]


def aopc(curve: torch.Tensor) -> torch.Tensor:
    """The mean drop of a perturbation curve below its first point.

    ``aopc = mean over k = 0..L of (curve[..., 0] - curve[..., k])``: the mean includes the unperturbed point
    (a zero drop), as in Samek et al.'s ``1 / (L + 1)``.

    Args:
        curve: ``batch + [L + 1]``, as returned by :func:`~tdhook.metrics.pixel_flipping` or
            :func:`~tdhook.metrics.region_perturbation`; any batch shape.

    Returns:
        ``batch``.

    Raises:
        ValueError: ``curve`` is not a floating-point tensor with at least one point.

    Examples:
        >>> aopc(torch.tensor([[4.0, 2.0, 0.0], [1.0, 1.0, 1.0]]))
        tensor([2., 0.])
    """
    if not isinstance(curve, torch.Tensor) or not curve.is_floating_point() or curve.dim() < 1 or not curve.shape[-1]:
        raise ValueError(
            f"aopc: curve must be a floating-point tensor batch + [L + 1] with L >= 0, got "
            f"{getattr(curve, 'dtype', type(curve).__name__)} {list(getattr(curve, 'shape', []))}"
        )
    return (curve[..., :1] - curve).mean(-1)
