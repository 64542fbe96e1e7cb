"""Re-initialising one layer of a model for the randomisation check, parametrized tensors included.

``reset_parameters`` writes into the tensors it reads as attributes. A tensor under
``torch.nn.utils.parametrize`` is recomputed from its originals at every read, so the fresh values would land
in a temporary and the layer would keep its weights: here the layer's tensors are drawn on a copy without
parametrizations (the same draws as the plain layer) and handed to each parametrization, through its
``right_inverse`` where it has one: a layer whose parametrization inverts computes with the plain layer's fresh
values. Tensors that older utilities recompute in a forward
pre-hook (``torch.nn.utils.weight_norm``, ``spectral_norm``, ``prune``) would lose the fresh values at the next
call: they are refused by name.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> from torch.nn.utils import parametrizations
    >>> plain, normed = nn.Linear(3, 2), parametrizations.weight_norm(nn.Linear(3, 2))
    >>> _ = torch.manual_seed(0)
    >>> plain.reset_parameters()
    >>> _ = torch.manual_seed(0)
    >>> reset_layer("head", normed)
    >>> torch.allclose(normed.weight, plain.weight), torch.equal(normed.bias, plain.bias)
    (True, True)
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

__all__ = ["refuse_hooked_weights", "resettable", "reset_layer"]

_WEIGHT_HOOKS = (WeightNorm, SpectralNorm, BasePruningMethod)


def refuse_hooked_weights(modules: Iterable[tuple[str, nn.Module]], name: str) -> None:
    """Raise where one of the named ``modules`` recomputes a tensor in a forward pre-hook from other parameters.

    Args:
        modules: ``(name, module)`` pairs, as ``named_modules()`` gives them.
        name: the metric, for the error.

    Raises:
        ValueError: naming the module, the tensor and the utility.
    """
    for module_name, module in modules:
        for hook in module._forward_pre_hooks.values():
            if isinstance(hook, _WEIGHT_HOOKS):
                tensor = getattr(hook, "name", None) or getattr(hook, "_tensor_name", "?")
                raise ValueError(
                    f"{name}: module {module_name!r} ({type(module).__name__}) recomputes {tensor!r} from other "
                    f"parameters in a forward pre-hook ({type(hook).__name__}): reset_parameters would write values "
                    "that the next call overwrites. Use torch.nn.utils.parametrizations (weight_norm, "
                    "spectral_norm) or make the pruning permanent (torch.nn.utils.prune.remove) first"
                )


def resettable(module: nn.Module) -> bool:
    """Whether ``module`` re-initialises its parameters: it has ``reset_parameters``, or it is an
    ``nn.MultiheadAttention``, whose ``_reset_parameters`` draws its input projection (torch's initialisation for it;
    its output projection, an ``nn.Linear``, is a layer of its own).

    Examples:
        >>> resettable(nn.Linear(2, 2)), resettable(nn.MultiheadAttention(4, 2)), resettable(nn.ReLU())
        (True, True, False)
    """
    return callable(getattr(module, "reset_parameters", None)) or isinstance(module, nn.MultiheadAttention)


def _reset(module: nn.Module) -> None:
    """Draw ``module``'s parameters anew (see :func:`resettable`)."""
    if callable(getattr(module, "reset_parameters", None)):
        module.reset_parameters()
    else:
        module._reset_parameters()


def reset_layer(name: str, layer: nn.Module) -> None:
    """``layer.reset_parameters()`` (see :func:`resettable`) under ``no_grad``, with parametrized tensors of ``layer``
    and of its submodules set to the fresh values through their parametrizations.

    Args:
        name: the layer's name, for errors.
        layer: a module that :func:`resettable` accepts.

    Raises:
        ValueError: a parametrization cannot take the fresh values (it has no ``right_inverse``, or refuses them).
    """
    parametrized = [m for m in layer.modules() if parametrize.is_parametrized(m)]
    with torch.no_grad():
        if not parametrized:
            _reset(layer)
            return
        twin = copy.deepcopy(layer)
        for module in list(twin.modules()):  # listed first: a removal changes the module's class and children
            if parametrize.is_parametrized(module):
                for tensor in list(module.parametrizations):
                    parametrize.remove_parametrizations(module, tensor, leave_parametrized=True)
        before = {key: value.clone() for key, value in _tensors(twin)}
        _reset(twin)  # the draws of the plain layer
        for key, value in _tensors(twin):
            if torch.equal(value, before[key]):
                continue
            owner_name, _, tensor = key.rpartition(".")
            owner = layer.get_submodule(owner_name)
            if not parametrize.is_parametrized(owner, tensor):
                getattr(owner, tensor).copy_(value)
                continue
            try:
                setattr(owner, tensor, value.detach().clone())
            except (NotImplementedError, RuntimeError, ValueError) as err:
                where = f"{name}.{key}" if name else key
                raise ValueError(
                    f"randomisation_check: the parametrization of {where!r} cannot take the values reset_parameters "
                    f"drew for it ({type(err).__name__}: {err}); give it a right_inverse that accepts them"
                ) from err


def _tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(), *module.named_buffers()]
