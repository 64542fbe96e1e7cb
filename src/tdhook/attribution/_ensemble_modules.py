"""tensordict's ``EnsembleModule`` inside an explained model, refused by name when a context is entered.

An ``EnsembleModule`` runs the module it copies under ``torch.vmap`` over its members' stacked parameters, which
it puts in that module with ``to_module(..., preserve_module_state=False)``, and returns the members' outputs with
their dimension in front of the batch. Under ``torch.vmap`` no rule sees a call (the relevance would be the plain
gradient's), so a rule refuses it from inside the vmapped forward; tensordict's ``to_module`` then leaves the
members' batched tensors in the copied module, whose own parameters are lost (any later call of it fails). The
wrapper refuses such a model before it registers anything or runs it, naming the module and the loop that explains
each member with its own parameters.
"""

from __future__ import annotations

from collections.abc import Mapping

from tensordict.nn import EnsembleModule
from torch import nn

__all__ = ["refuse_ensembles"]


def refuse_ensembles(modules: Mapping[str, nn.Module]) -> None:
    """Raise where one of ``modules`` (the model's, by name) is tensordict's ``EnsembleModule``.

    Args:
        modules: the wrapped model's modules by name.

    Raises:
        ValueError: naming the first ``EnsembleModule`` and how to explain its members one at a time.

    Examples:
        >>> import torch
        >>> from tensordict.nn import TensorDictModule
        >>> member = TensorDictModule(nn.Linear(3, 1), in_keys=["x"], out_keys=["q"])
        >>> refuse_ensembles(dict(member.named_modules()))
        >>> refuse_ensembles(dict(EnsembleModule(member, 2).named_modules()))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: LRP: module 'the model itself' (EnsembleModule) runs its members under torch.vmap, ...
    """
    for name, module in modules.items():
        if isinstance(module, EnsembleModule):
            path = name or "the model itself"
            inner = f"{name}.module" if name else "ensemble.module"
            raise ValueError(
                f"LRP: module {path!r} (EnsembleModule) runs its members under torch.vmap, where no rule sees a "
                "call (the relevance would be the plain gradient's), and an EnsembleModule puts its members' "
                "dimension in front of the batch: explain one member at a time, with its parameters put in the "
                f"module it copies ({inner!r}): wrap that module, lrp = LRP(ensemble.module, ...), and call "
                "`with params.to_module(ensemble.module): lrp(td)` for each params in ensemble.params_td.unbind(0)"
            )
