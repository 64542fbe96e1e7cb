"""The model parameter randomisation test (Adebayo et al., 2018), cascading from the top layer down.

A method whose explanation depends on what the model learnt should drift away from its original explanation as
the layers are re-initialised one after the other; a method that ignores the weights keeps a similarity of 1.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Literal

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey, unravel_key
from torch import nn
from torch.nn.utils import parametrize

from tdhook.attribution.methods._options import checked_flag
from tdhook.attribution.rules._caller import warn_at_caller
from tdhook.metrics._agent_templates import reset_in_template, template_owner
from tdhook.metrics._batch_statistics import statistics_kept
from tdhook.metrics._features import Features
from tdhook.metrics._layer_reset import refuse_hooked_weights, reset_layer, resettable
from tdhook.metrics._methods import (
    check_method,
    explain,
    in_batch_of,
    method_keys,
    method_prefix,
    original_target,
    target_set,
    unit_dims,
    written_attributions,
)
from tdhook.metrics._random import cuda_devices
from tdhook.metrics._scoring import progress_bar
from tdhook.metrics._similarity import pearson, spearman

__all__ = ["randomisation_check"]


def _named_modules(method: TensorDictModuleBase) -> list[tuple[str, nn.Module]]:
    """The modules of the method's model, by the names the method gives them."""
    if hasattr(method, "named_explained_modules"):
        return list(method.named_explained_modules().items())
    return list(getattr(method, "module", method).named_modules())


def _named_layers(method: TensorDictModuleBase) -> list[tuple[str, nn.Module]]:
    """The modules of the method's model that can be re-initialised, by the names the method gives them."""
    return [(name, m) for name, m in _named_modules(method) if resettable(m)]


def _written(parameter: nn.Parameter) -> tuple[int, int]:
    """What an in-place write into ``parameter`` changes: its version counter, or its storage."""
    return parameter._version, parameter.data_ptr()


def _reset_by_layers(modules: Sequence[tuple[str, nn.Module]]) -> set[int]:
    """The ``id`` of every parameter that the reset of a layer (:func:`resettable`) among ``modules`` draws: the
    layer's own, and the originals of its parametrized tensors."""
    reached = set()
    for _, module in modules:
        if resettable(module):
            reached.update(id(p) for p in module.parameters(recurse=False))
            if parametrize.is_parametrized(module):
                reached.update(id(p) for p in module.parametrizations.parameters())
    return reached


def _warn_for_parameters_kept(modules: Sequence[tuple[str, nn.Module]], versions: dict[int, tuple[int, int]]) -> None:
    """Warn, naming them, of the parameters of the method's model (its ``modules`` by name) that no layer's reset
    draws (see :func:`_reset_by_layers`) and nothing wrote to during the cascade (see :func:`_written`; ``versions``
    by ``id`` before it): a parameter held by a module without ``reset_parameters`` (a class token, a learnt scale of
    the model's own, torchrl's ``BatchRenorm1d``), which keeps its trained values through the whole cascade."""
    reached, kept, seen = _reset_by_layers(modules), [], set()
    for prefix, module in modules:
        for name, parameter in module.named_parameters(recurse=False):
            if id(parameter) in seen or id(parameter) in reached:
                continue
            seen.add(id(parameter))
            if _written(parameter) == versions.get(id(parameter)):
                kept.append(f"{prefix}.{name}" if prefix else name)
    if kept:
        shown = ", ".join(repr(name) for name in kept[:8]) + (f" and {len(kept) - 8} more" if len(kept) > 8 else "")
        warn_at_caller(
            f"randomisation_check: no layer's reset_parameters re-initialises the parameters {shown}: they keep their "
            "trained values through the whole cascade, so the last similarity is not that of a randomised model "
            "(give their module a reset_parameters that draws them)"
        )


def randomisation_check(
    method: TensorDictModuleBase,
    td: TensorDictBase,
    *,
    seed: int = 42,
    similarity: Literal["spearman", "pearson"] = "spearman",
    abs: bool = True,
    in_keys: Sequence[NestedKey] | None = None,
    relevance_key: NestedKey | None = None,
    progress: bool | None = None,
) -> dict[str, torch.Tensor]:
    """The similarity of the original explanation to those of ever more randomised copies of the model.

    The method is deep-copied with its model. Every module of the copy that has ``reset_parameters`` (and every
    ``nn.MultiheadAttention``, whose input projection only its ``_reset_parameters`` draws) is re-initialised in
    turn, from the last (top) layer to the first, each after ``torch.manual_seed(seed + 1)``, keeping the layers
    already reset (the cascade; a parametrized tensor takes the plain layer's fresh values
    through its parametrization); after each, the copy explains ``td`` for the original targets
    (``target=None`` is held at the original argmax, a callable at the weights it gave the original output) and the
    attributions of all explained keys together are compared with the original ones, per sample. The caller's
    method, model and global random state are left as they were. Parameters that no layer's reset re-initialises
    (held by a module without ``reset_parameters``) are named in a warning: they keep their trained values.

    The original explanation is read from ``td`` at ``(relevance_key, *key)`` where every key is there, and
    computed by the method otherwise.

    Args:
        method: the attribution wrapper (:class:`~tdhook.attribution.LRP` or another method).
        td: the inputs (left unchanged).
        seed: each layer is reset after ``torch.manual_seed(seed + 1)``.
        similarity: ``"spearman"`` (rank correlation, ties sharing their mean rank) or ``"pearson"``.
        abs: compare absolute attributions.
        in_keys: the explained keys (by default the method's).
        relevance_key: the prefix of the method's attribution keys (by default its ``relevance_key``).
        progress: show a tqdm bar (``None``: for models of at least 20 such layers).

    Returns:
        ``layer name -> batch`` similarities, in the order the layers were reset; names as in the model given to
        the method (``named_modules()`` of a plain ``nn.Module``).

    Raises:
        TypeError: ``method`` is not a TensorDict module, or ``abs`` is not a bool.
        ValueError: an unknown ``similarity``, a model without parameters to reset, a parametrization that cannot
            take fresh values, or a tensor recomputed in a forward pre-hook (``torch.nn.utils.weight_norm``,
            ``spectral_norm``, ``prune``), which a reset would not reach.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tdhook.attribution import LRP
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        >>> lrp = LRP(net, in_keys=["x"], out_keys=["y"])
        >>> scores = randomisation_check(lrp, TensorDict(x=torch.randn(5, 3), batch_size=[5]))
        >>> list(scores), scores["2"].shape
        (['2', '0'], torch.Size([5]))
    """
    check_method(method, "randomisation_check")
    if similarity not in ("spearman", "pearson"):
        raise ValueError(f"randomisation_check: similarity must be 'spearman' or 'pearson', got {similarity!r}")
    checked_flag(abs, "abs", "randomisation_check")
    compare = spearman if similarity == "spearman" else pearson
    keys = method_keys(method, in_keys, td)
    prefix = method_prefix(method, relevance_key)
    units = unit_dims(method)  # target="all": every unit's attribution, compared together
    batch_dims = td.batch_dims
    refuse_hooked_weights(_named_modules(method), "randomisation_check")
    with torch.inference_mode(False):  # a copy with version counters, as the caller's model has, in any mode
        copied = copy.deepcopy(method)
    layers = _named_layers(copied)[::-1]
    if not layers:
        raise ValueError("randomisation_check: the method's model has no module with reset_parameters to randomise")
    with statistics_kept(copied):  # every explanation from the caller's running statistics
        result = explain(copied, td)
    td = in_batch_of(td, result)  # a context the model reads as one sample (torchrl's Decision Transformer's)
    batch_dims = td.batch_dims
    target = original_target(copied, result, batch_dims, td)
    own = written_attributions(result, td, keys, prefix, units)
    try:
        stored = Features.read(td, keys, prefix, units).attributions
    except KeyError:
        stored = own
    for key, kept, fresh in zip(keys, stored, own, strict=True):
        if kept.shape != fresh.shape:  # compared element by element with the method's explanations
            a_key = unravel_key((prefix, key))
            raise ValueError(
                f"randomisation_check: the stored attribution {a_key!r} has shape {list(kept.shape)}, but the method "
                f"writes {list(fresh.shape)} there, which the explanations of the randomised models are compared with "
                "element by element; store the method's own output (or drop the stored one to have it computed)"
            )

    def flat(attributions: Sequence[torch.Tensor]) -> torch.Tensor:
        values = torch.cat([a.flatten(batch_dims) for a in attributions], dim=-1)
        return values.abs() if abs else values

    original = flat(stored)
    scores: dict[str, torch.Tensor] = {}
    update = progress_bar(len(layers), "randomisation check", progress)
    modules = _named_modules(copied)
    versions = {id(p): _written(p) for _, m in _named_modules(copied) for p in m.parameters(recurse=False)}
    with torch.random.fork_rng(devices=cuda_devices(copied)), target_set(copied, target):
        for name, layer in layers:
            torch.manual_seed(seed + 1)
            owner = template_owner(modules, layer)
            if owner is None:
                reset_layer(name, layer)
            else:  # a layer of a torchrl multi-agent network's template: its values are the network's
                reset_in_template(owner, lambda name=name, layer=layer: reset_layer(name, layer))
            with statistics_kept(copied):
                changed = written_attributions(explain(copied, td), td, keys, prefix, units)
            scores[name] = compare(original, flat(changed))
            update(1)
    update(0)
    _warn_for_parameters_kept(_named_modules(copied), versions)
    return scores
