"""Norms that normalise with the statistics of the batch they are given: a BatchNorm in training mode.

Such a norm makes each sample's output, and its relevance, depend on the other samples of the batch, and moves its
running statistics at every call, as a plain call does. The relevance is that of the model as it runs in training
mode, each call's statistics held constant (per sample an affine map), which is rarely what a user who forgot
``.eval()`` meant to explain: it can differ from the model's relevance in eval mode by more than its own size. The
user is told once.

Examples:
    >>> import warnings
    >>> from torch import nn
    >>> norms = training_norms({"encoder": nn.Linear(2, 3), "norm": nn.BatchNorm1d(3)})
    >>> [name for name, _ in norms]
    ['norm']
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("error")
    ...     try:
    ...         warn_for_training_norms("LRP", norms)
    ...     except UserWarning as warning:
    ...         print(str(warning)[:55])
    LRP: module 'norm' (BatchNorm1d) is in training mode an
    >>> len(warn_for_training_norms("LRP", [(name, norm.eval()) for name, norm in norms]))  # eval: watched on
    1
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from tdhook.attribution.rules._caller import warn_at_caller

__all__ = ["normalises_by_batch", "training_norms", "warn_for_training_norms"]


def normalises_by_batch(module: nn.Module) -> bool:
    """Whether ``module``, a BatchNorm, normalises with the statistics of the batch it is given now: in training mode,
    or in every mode where it keeps no running statistics. Its rule then holds them constant, where in eval mode it
    merges the running ones into the layer before it, on an autograd node of the same kind (a plan of the function
    rules recorded in one mode is no plan for the other, see :mod:`~tdhook.attribution._function_rule_plan`)."""
    return module.training or module.running_mean is None


def training_norms(modules: Mapping[str, nn.Module]) -> list[tuple[str, nn.Module]]:
    """The BatchNorms among ``modules`` (the model's modules by name): each normalises with the batch's statistics
    in training mode, or in every mode where it keeps no running statistics (read at the call, as the mode may
    change within a context)."""
    return [(name, module) for name, module in modules.items() if isinstance(module, nn.modules.batchnorm._BatchNorm)]


def warn_for_training_norms(who: str, candidates: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Warn if one of ``candidates`` is in training mode now; the candidates left to watch (none once warned)."""
    for name, module in candidates:
        if normalises_by_batch(module):
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
