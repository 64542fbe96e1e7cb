"""Norms that normalise with the statistics of the batch they are given: a BatchNorm in training mode.

Such a norm makes each sample's output, and its relevance, depend on the other samples of the batch, and moves its
running statistics at every call, as a plain call does. The relevance is that of the model as it runs in training
mode, each call's statistics held constant (per sample an affine map), which is rarely what a user who forgot
``.eval()`` meant to explain: it can differ from the model's relevance in eval mode by more than its own size. The
user is told once.

Examples:
    >>> import warnings
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     remaining = warn_for_training_norms("LRP", training_norms(dict(net.named_modules())))
    >>> remaining, "module '1' (BatchNorm1d) is in training mode and moves" in str(caught[0].message)
    ([], True)
    >>> warn_for_training_norms("LRP", training_norms(dict(net.eval().named_modules())))  # no warning
    [('1', BatchNorm1d(3, eps=1e-05, momentum=0.1, affine=True, bias=True, track_running_stats=True))]
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from tdhook.attribution.rules._caller import warn_at_caller

__all__ = ["training_norms", "warn_for_training_norms"]


def training_norms(modules: Mapping[str, nn.Module]) -> list[tuple[str, nn.Module]]:
    """The BatchNorms among ``modules`` (the model's modules by name): each normalises with the batch's statistics
    in training mode, or in every mode where it keeps no running statistics (read at the call, as the mode may
    change within a context)."""
    return [(name, module) for name, module in modules.items() if isinstance(module, nn.modules.batchnorm._BatchNorm)]


def warn_for_training_norms(who: str, candidates: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Warn if one of ``candidates`` is in training mode now; the candidates left to watch (none once warned)."""
    for name, module in candidates:
        if module.training or module.running_mean is None:
            if module.running_mean is None:
                why, fix = "keeps no running statistics", "give it running statistics to explain each sample alone"
            else:
                why = "is in training mode and moves its running statistics"
                fix = "call .eval() on the model to explain it with its running statistics"
            warn_at_caller(
                f"{who}: module {name!r} ({type(module).__name__}) {why}, so it normalises with the statistics of the "
                f"batch it is given, as a plain call does: each sample's relevance depends on the other samples of "
                f"the batch; {fix}"
            )
            return []
    return candidates
