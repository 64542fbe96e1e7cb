"""Random draws of the metrics, from a generator of their own: the global random state is never touched.

Examples:
    >>> import torch
    >>> g = generator(0)
    >>> torch.equal(torch.rand(3, generator=g), torch.rand(3, generator=generator(0)))
    True
"""

from __future__ import annotations

import torch

__all__ = ["generator"]


def generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with ``seed``, or from fresh entropy for ``None``.

    Raises:
        TypeError: ``seed`` is neither an int nor ``None``.
    """
    g = torch.Generator()
    if seed is None:
        g.seed()
    elif isinstance(seed, int) and not isinstance(seed, bool):
        g.manual_seed(seed)
    else:
        raise TypeError(f"metrics: seed must be an int or None, got {type(seed).__name__}")
    return g
