"""Modules that draw anew at every forward pass in training mode (dropout): an explanation of such a model is
random from call to call, and the user is told once.

Examples:
    >>> import warnings
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     remaining = warn_for_random_modules("LRP", random_modules(dict(net.named_modules())))
    >>> remaining, "module '1' (Dropout, p=0.5) is in training mode" in str(caught[0].message)
    ([], True)
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

from torch import nn

__all__ = ["random_modules", "warn_for_random_modules"]


def random_modules(modules: Mapping[str, nn.Module]) -> list[tuple[str, nn.Module]]:
    """The dropout modules among ``modules`` that drop anything (``p > 0``), by name."""
    return [(n, m) for n, m in modules.items() if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0]


def warn_for_random_modules(who: str, candidates: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Warn if one of ``candidates`` is in training mode; the candidates left to watch (none once warned)."""
    for name, module in candidates:
        if module.training:
            warnings.warn(
                f"{who}: module {name!r} ({type(module).__name__}, p={module.p}) is in training mode, so each "
                "forward pass drops other units and the explanation is random from call to call; call .eval() on "
                "the model for a deterministic one",
                stacklevel=4,
            )
            return []
    return candidates
