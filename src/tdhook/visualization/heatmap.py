"""Relevance heatmaps: colour image relevance with a signed colour map and save it.

Matplotlib is needed here (the ``examples`` extra); it is imported inside the
functions, so importing this module works without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tensordict import is_tensor_collection

if TYPE_CHECKING:
    import numpy as np

__all__ = ["heatmap", "plot_heatmaps", "save_heatmap"]

_CHANNEL_REDUCTIONS = ("sum", "abs_sum")


def _matplotlib() -> Any:
    """The ``matplotlib`` module, or an ImportError that says how to install it."""
    try:
        import matplotlib
        import matplotlib.figure
        import matplotlib.image
    except ImportError as err:
        raise ImportError(
            "tdhook.visualization needs matplotlib: pip install matplotlib (or tdhook's 'examples' extra)"
        ) from err
    return matplotlib


def _relevance_map(relevance: torch.Tensor, channel_reduction: str) -> torch.Tensor:
    """The ``(H, W)`` float64 map of one sample's relevance."""
    if is_tensor_collection(relevance):  # torch.as_tensor would make an empty tensor of it
        keys = list(relevance.keys(True, True))
        nested = [key for key in keys if isinstance(key, tuple)]
        sample = "[0]" if relevance.batch_dims else ""
        example = f"td[{', '.join(map(repr, nested[0] if nested else ('relevance', 'image')))}]{sample}"
        raise TypeError(
            f"heatmap takes one sample's relevance as a tensor, got a {type(relevance).__name__} with keys {keys}; "
            f"read the relevance of one input key, e.g. {example}"
        )
    relevance = torch.as_tensor(relevance).detach()
    shape = tuple(relevance.shape)
    if relevance.dim() == 4:
        if relevance.shape[0] != 1:
            raise ValueError(
                f"heatmap takes one sample, got relevance of shape {shape} with a batch of {shape[0]}; "
                "index the batch first, e.g. relevance[0]"
            )
        relevance = relevance[0]
    if relevance.dim() not in (2, 3):
        raise ValueError(
            f"heatmap expects image relevance of shape (H, W), (C, H, W) or (1, C, H, W), got shape {shape}"
        )
    if channel_reduction not in _CHANNEL_REDUCTIONS:
        raise ValueError(f"channel_reduction must be one of {_CHANNEL_REDUCTIONS}, got {channel_reduction!r}")
    relevance = relevance.to(device="cpu", dtype=torch.float64)
    if not torch.isfinite(relevance).all():
        raise ValueError(f"relevance of shape {shape} holds NaN or infinite values; no heatmap can be drawn")
    if channel_reduction == "abs_sum":
        relevance = relevance.abs()
    return relevance.sum(0) if relevance.dim() == 3 else relevance


def heatmap(
    relevance: torch.Tensor,
    *,
    cmap: str = "bwr",
    channel_reduction: str = "sum",
    level: float = 1.0,
) -> np.ndarray:
    """Colour the relevance of one image with a signed colour map.

    The channels are reduced to one ``(H, W)`` map, which is divided by
    ``vmax = max |R| / level`` and clipped, so that ``[-vmax, vmax]`` spans the
    colour map with zero at its centre: positive relevance takes the upper end
    of the map (red for ``"bwr"``), negative relevance the lower end (blue),
    and ``R`` and ``-R`` get mirrored colours. All-zero relevance gives the
    centre colour everywhere.

    Args:
        relevance: relevance of shape ``(H, W)``, ``(C, H, W)`` or
            ``(1, C, H, W)``, for example ``td["relevance", "image"][0]``.
        cmap: name of a matplotlib colour map, best a diverging one.
        channel_reduction: ``"sum"`` (signed sum over the channels) or
            ``"abs_sum"`` (sum of the absolute values: magnitude only, which
            uses the upper half of the colour map).
        level: contrast; ``vmax`` is ``max |R| / level``, so a level above 1
            saturates the strongest values and brings out weaker ones.

    Returns:
        A float array of shape ``(H, W, 3)`` with RGB values in ``[0, 1]``.

    Raises:
        ValueError: for relevance of another shape, a batch of several
            samples, NaN or infinite values, an unknown ``channel_reduction``
            or colour map, or a ``level`` that is not positive.
        TypeError: for a TensorDict (the output of an explainer) in place of
            the relevance tensor of one input key.

    Examples:
        >>> import torch
        >>> from tdhook.visualization import heatmap
        >>> relevance = torch.tensor([[2.0, 0.0], [-2.0, 1.0]])
        >>> rgb = heatmap(relevance)
        >>> rgb.shape
        (2, 2, 3)
        >>> rgb[0, 0].round(2).tolist(), rgb[1, 0].round(2).tolist()  # positive red, negative blue
        ([1.0, 0.0, 0.0], [0.0, 0.0, 1.0])
        >>> rgb[0, 1].round(2).tolist()  # zero: the centre of "bwr", white
        [1.0, 1.0, 1.0]
        >>> heatmap(torch.randn(1, 3, 8, 8)).shape  # channels summed, batch of one dropped
        (8, 8, 3)
        >>> heatmap(torch.zeros(5))
        Traceback (most recent call last):
            ...
        ValueError: heatmap expects image relevance of shape (H, W), (C, H, W) or (1, C, H, W), got shape (5,)
    """
    matplotlib = _matplotlib()
    if not level > 0:
        raise ValueError(f"level must be positive, got {level!r}")
    try:
        colormap = matplotlib.colormaps[cmap]
    except KeyError:
        raise ValueError(f"unknown matplotlib colour map {cmap!r}") from None
    relevance = _relevance_map(relevance, channel_reduction)
    vmax = relevance.abs().max().item() / level
    if vmax > 0:
        position = (relevance / vmax).clamp(-1.0, 1.0) * 0.5 + 0.5
    else:
        position = torch.full_like(relevance, 0.5)
    return colormap(position.numpy())[..., :3]


def save_heatmap(relevance: torch.Tensor, path: str | Path, **kwargs: Any) -> Path:
    """Write the :func:`heatmap` of ``relevance`` as a PNG file, one pixel per input pixel.

    The parent folder is created when missing. No interactive backend is used.

    Args:
        relevance: image relevance, as for :func:`heatmap`.
        path: where to write the PNG.
        **kwargs: ``cmap``, ``channel_reduction`` and ``level`` of :func:`heatmap`.

    Returns:
        ``path`` as a :class:`pathlib.Path`.

    Examples:
        >>> import tempfile
        >>> from pathlib import Path
        >>> import torch
        >>> from tdhook.visualization import save_heatmap
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     path = save_heatmap(torch.randn(3, 16, 24), Path(folder) / "relevance.png")
        ...     path.name, path.read_bytes()[:4]
        ('relevance.png', b'\\x89PNG')
    """
    imsave = _matplotlib().image.imsave
    rgb = heatmap(relevance, **kwargs)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    imsave(path, rgb, format="png")
    return path


def _display_image(image: torch.Tensor) -> tuple[np.ndarray, str | None]:
    """An input image scaled to ``[0, 1]`` for ``imshow``, and the colour map it needs."""
    image = torch.as_tensor(image).detach().to(device="cpu", dtype=torch.float64)
    shape = tuple(image.shape)
    if image.dim() == 4 and image.shape[0] == 1:
        image = image[0]
    if image.dim() == 3 and image.shape[0] == 1:
        image = image[0]
    if image.dim() == 3 and image.shape[0] == 3:
        image = image.permute(1, 2, 0)
    elif image.dim() != 2:
        raise ValueError(f"plot_heatmaps expects images of shape (H, W), (1 or 3, H, W) or (1, C, H, W), got {shape}")
    low, high = image.min(), image.max()
    image = (image - low) / (high - low) if high > low else torch.zeros_like(image)
    return image.numpy(), ("gray" if image.dim() == 2 else None)


def plot_heatmaps(
    images: Sequence[torch.Tensor] | torch.Tensor,
    relevances: Sequence[torch.Tensor] | torch.Tensor,
    path: str | Path,
    titles: Sequence[str] | None = None,
    **kwargs: Any,
) -> Path:
    """Save a figure with one row per sample: the input image, then its heatmap.

    Each input image is min-max scaled to ``[0, 1]`` for display, so normalised
    inputs can be passed as they are. The figure is drawn without pyplot, so
    no interactive backend is touched.

    Args:
        images: the inputs, a sequence of ``(3, H, W)``, ``(1, H, W)`` or
            ``(H, W)`` tensors or one ``(N, C, H, W)`` batch.
        relevances: their relevance, in the same layout, drawn with :func:`heatmap`.
        path: where to write the figure (the format follows the suffix).
        titles: optional title of each row, shown above its heatmap.
        **kwargs: ``cmap``, ``channel_reduction`` and ``level`` of :func:`heatmap`.

    Returns:
        ``path`` as a :class:`pathlib.Path`.

    Examples:
        >>> import tempfile
        >>> from pathlib import Path
        >>> import torch
        >>> from tdhook.visualization import plot_heatmaps
        >>> images, relevances = torch.rand(2, 3, 16, 16), torch.randn(2, 3, 16, 16)
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     path = plot_heatmaps(images, relevances, Path(folder) / "figure.png", titles=["a", "b"])
        ...     path.read_bytes()[:4]
        b'\\x89PNG'
    """
    matplotlib = _matplotlib()
    images, relevances = list(images), list(relevances)
    if len(images) != len(relevances) or not images:
        raise ValueError(
            f"plot_heatmaps needs as many images as relevances (at least one), got {len(images)} and {len(relevances)}"
        )
    if titles is not None and len(titles) != len(images):
        raise ValueError(f"plot_heatmaps got {len(titles)} titles for {len(images)} rows")
    fig = matplotlib.figure.Figure(figsize=(5.0, 2.6 * len(images)), layout="constrained")
    axes = fig.subplots(len(images), 2, squeeze=False)
    for row, (image, relevance) in enumerate(zip(images, relevances, strict=True)):
        shown, image_cmap = _display_image(image)
        axes[row, 0].imshow(shown, cmap=image_cmap)
        axes[row, 1].imshow(heatmap(relevance, **kwargs))
        axes[row, 0].set_title("input")
        axes[row, 1].set_title(titles[row] if titles is not None else "relevance")
        for ax in axes[row]:
            ax.set_axis_off()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
