"""TorchScript modules inside an explained model, refused by name when a context is entered.

A module compiled by ``torch.jit.script`` or ``torch.jit.trace`` runs its forward
as TorchScript: neither forward hooks nor torch function modes reach what it
computes, so no rule can act inside it, and its submodules are not the
``nn.Linear`` or ``nn.Conv2d`` a rule mapper looks for. The wrapper refuses such
a model before it registers anything, naming the module.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

__all__ = ["refuse_scripted_modules"]


def refuse_scripted_modules(modules: Mapping[str, nn.Module]) -> None:
    """Raise where one of ``modules`` (the model's, by name) is a TorchScript module.

    Args:
        modules: the wrapped model's modules by name.

    Raises:
        TypeError: naming the first TorchScript module, the class it was compiled from, and what to do.

    Examples:
        >>> from torch import nn
        >>> refuse_scripted_modules(dict(nn.Sequential(nn.Linear(2, 2), nn.ReLU()).named_modules()))
    """
    for name, module in modules.items():
        if isinstance(module, torch.jit.ScriptModule):
            path = name or "the model itself"
            origin = getattr(module, "original_name", type(module).__name__)
            raise TypeError(
                f"LRP: module {path!r} ({origin} compiled by torch.jit) is a TorchScript module: its forward runs as "
                "TorchScript, which no forward hook or function mode reaches, so no LRP rule can act inside it. "
                "Explain the module as it was before torch.jit.script or torch.jit.trace."
            )
