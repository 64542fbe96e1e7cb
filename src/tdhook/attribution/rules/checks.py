"""A relevance check for the LRP wrapper: raise where a module loses, creates or corrupts relevance."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tdhook.attribution.rules._arguments import nonnegative

__all__ = ["raise_for_unconserved_rel_factory"]


def raise_for_unconserved_rel_factory(
    atol: float = 1e-6, rtol: float = 1e-6
) -> Callable[[str, nn.Module, torch.Tensor, torch.Tensor], None]:
    """A layer check that raises where relevance is lost, created, NaN or infinite.

    The check compares the total relevance entering a module (its output's)
    with the total leaving it (its input's). Pass it as ``LRP(...,
    relevance_check=...)``. Biases and ε absorb relevance, so use it with
    zero biases and a small ε, or loose tolerances.

    Examples:
        >>> check = raise_for_unconserved_rel_factory(atol=1e-3)
        >>> check("fc", nn.Linear(2, 2), torch.tensor([0.5, 0.5]), torch.tensor([1.0]))
        >>> check("fc", nn.Linear(2, 2), torch.tensor([0.5, 0.0]), torch.tensor([1.0]))
        Traceback (most recent call last):
        ...
        ValueError: relevance is not conserved at module 'fc' (Linear): input sum 0.5, output sum 1
    """

    for name, value in (("atol", atol), ("rtol", rtol)):
        nonnegative("raise_for_unconserved_rel_factory", name, value)
    return _ConservationCheck(atol, rtol)


class _ConservationCheck:
    """The check :func:`raise_for_unconserved_rel_factory` makes: a class, not a closure, so that a wrapper holding
    it pickles (``torch.save``, a collector's worker processes)."""

    def __init__(self, atol: float, rtol: float) -> None:
        self.atol, self.rtol = atol, rtol

    def __call__(self, name: str, module: nn.Module, relevance_in: torch.Tensor, relevance_out: torch.Tensor) -> None:
        kind = type(module).__name__
        for label, rel in (("input", relevance_in), ("output", relevance_out)):
            if not torch.isfinite(rel).all():
                raise ValueError(f"{label} relevance of module {name!r} ({kind}) has NaN or inf values")
        total_in, total_out = relevance_in.sum().item(), relevance_out.sum().item()
        if abs(total_in - total_out) > self.atol + self.rtol * abs(total_out):
            raise ValueError(
                f"relevance is not conserved at module {name!r} ({kind}): "
                f"input sum {total_in:.6g}, output sum {total_out:.6g}"
            )
