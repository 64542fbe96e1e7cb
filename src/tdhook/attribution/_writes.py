"""Writing LRP's results into the caller's TensorDict: all of them, or none.

Examples:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> td = TensorDict(x=torch.zeros(2), batch_size=[2])
    >>> set_all_or_nothing(td, {("relevance", "x"): torch.ones(2), "y": torch.ones(3)})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    RuntimeError: batch dimension mismatch, ...
    >>> sorted(td.keys())
    ['x']
    >>> set_all_or_nothing(td, {("relevance", "x"): torch.ones(2)})
    >>> td["relevance", "x"]
    tensor([1., 1.])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDictBase, UnbatchedTensor, is_tensorclass
from tensordict.nn import EnsembleModule, ProbabilisticTensorDictModule, TensorDictModule, TensorDictSequential
from tensordict.utils import NestedKey
from torch import nn

from tdhook.attribution._keys import as_tuple

__all__ = [
    "batch_changing_steps",
    "has_lazy_stack",
    "model_updates",
    "relevance_updates",
    "returned_tensordict",
    "returns_sizeless",
    "set_all_or_nothing",
    "with_input_writes",
]


def returned_tensordict(
    tensordict: TensorDictBase,
    result: TensorDictBase,
    name: str = "LRP",
    modules: Callable[[], Mapping[str, nn.Module]] | None = None,
    module: nn.Module | None = None,
) -> TensorDictBase:
    """Where a call writes its results: the caller's TensorDict, or, where the module returned fewer batch
    dimensions than it was given, a shallow copy of it with the module's batch size.

    ``module``: the wrapped module. One that returns its outputs in a new TensorDict without a batch size (see
    :func:`returns_sizeless`, looked at only where a result has none: ``TensorDictModule(..., inplace=False)``, a
    torchrl loss with ``reduction="none"``), where every tensor in that TensorDict begins with the batch given (a
    loss's statistics of the whole batch aside, which are then kept whole: ``UnbatchedTensor``), gave the caller's
    batch: read as a batch cut to none, the whole batch was one sample, and the perturbation methods moved every
    sample's features at once.
    Any other module returning no batch size is taken at its word (a policy pointing at one of the batch's items
    returns one decision over them all).

    torchrl's ``DecisionTransformerInferenceWrapper``, called on a ``[B, T]`` context, returns a ``[B]``
    TensorDict (one action per context) and leaves the caller's as it was; LRP does the same. Any other batch
    size (tensordict's ``EnsembleModule`` puts its members' dimension in front of the batch, torchrl's
    ``RandomCropTensorDict`` in a pipeline cuts its time dimension) is refused with a ``ValueError`` naming both
    sizes, before anything is written (``name`` begins the message). Given ``modules``, a callable returning the
    model's modules by name (called only then), the message names the steps that can change the batch size
    (see :func:`batch_changing_steps`).

    Examples:
        >>> from tensordict import TensorDict
        >>> td = TensorDict(x=torch.zeros(2, 5, 3), batch_size=[2, 5])
        >>> returned_tensordict(td, td) is td
        True
        >>> cut = returned_tensordict(td, TensorDict(y=torch.zeros(2, 1), batch_size=[2]))
        >>> cut.batch_size, cut["x"] is td["x"], td.batch_size
        (torch.Size([2]), True, torch.Size([2, 5]))
        >>> sizeless = TensorDictModule(nn.Identity(), ["x"], ["y"], inplace=False)
        >>> returned_tensordict(td, TensorDict(y=torch.zeros(2, 5, 4)), module=sizeless) is td  # entries of the batch
        True
        >>> returned_tensordict(td, TensorDict(y=torch.zeros(3, 2, 5), batch_size=[3, 2, 5]))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: LRP: the module returned a TensorDict of batch size [3, 2, 5] for one of batch size [2, 5]; ...
    """
    size, given = result.batch_size, tensordict.batch_size
    if not size and given and module is not None and returns_sizeless(module):
        statistics = _batch_statistics(result, given, module)
        if statistics is not None:  # a new TensorDict without a batch size: its entries keep the batch
            for key in statistics:  # a loss's statistics of the whole batch, kept whole next to the samples
                result.set(key, UnbatchedTensor(result.get(key)))
            return tensordict
    if len(size) < len(given) and given[: len(size)] == size:
        returned = tensordict.copy()
        returned.batch_size = size
        return returned
    if size != given:
        named = {} if modules is None else modules()
        steps = batch_changing_steps(named)
        message = (
            f"{name}: the module returned a TensorDict of batch size {list(size)} for one of batch size "
            f"{list(given)}; the results are written next to the inputs, in the batch they were given with"
        )
        ensembles = [step for step in steps if isinstance(named[step], EnsembleModule)]
        others = [step for step in steps if step not in ensembles]
        if others:
            steps_named = ", ".join(f"{step!r} ({type(named[step]).__name__})" for step in others)
            message += (
                f". {steps_named} returns a TensorDict of its own, which can have another batch size: apply it to the "
                "TensorDict before the call and explain the rest of the pipeline"
            )
        if ensembles or not steps:
            message += (
                " (an EnsembleModule puts its members' dimension in front of the batch: explain one member at a "
                "time, with its parameters put in the module it copies, params_td[i].to_module(ensemble.module))"
                if ensembles
                else "; apply the step that changes the batch size to the TensorDict before the call and explain the "
                "rest of the model"
            )
        raise ValueError(message)
    return tensordict


# Steps that write keys into the TensorDict they are given and return it: they cannot change its batch size.
_KEY_WRITERS = (TensorDictModule, TensorDictSequential, ProbabilisticTensorDictModule)


def batch_changing_steps(modules: Mapping[str, nn.Module]) -> list[str]:
    """The names of the modules that can return a TensorDict of another batch size than they were given: every
    ``EnsembleModule``, and every step of a ``TensorDictSequential`` that is no module writing keys into the
    TensorDict it is given (a torchrl transform such as ``RandomCropTensorDict``, a ``TensorDictModuleBase`` of
    one's own).

    Args:
        modules: the model's modules by name.

    Examples:
        >>> from tensordict.nn import TensorDictModule, TensorDictSequential
        >>> from torchrl.envs.transforms import RandomCropTensorDict
        >>> policy = TensorDictSequential(RandomCropTensorDict(3), TensorDictModule(nn.Linear(3, 2), ["x"], ["y"]))
        >>> batch_changing_steps(dict(policy.named_modules()))
        ['module.0']
    """
    found = [name for name, module in modules.items() if isinstance(module, EnsembleModule)]
    for name, module in modules.items():
        if isinstance(module, TensorDictSequential):
            prefix = f"{name}.module." if name else "module."
            found += [
                f"{prefix}{i}"
                for i, step in enumerate(module.module)
                if not isinstance(step, (*_KEY_WRITERS, EnsembleModule)) and f"{prefix}{i}" in modules
            ]
    return found


def model_updates(
    tensordict: TensorDictBase,
    result: TensorDictBase,
    explained_keys: Sequence[NestedKey],
    fed: Sequence[torch.Tensor | None],
    detach: bool = True,
) -> dict[NestedKey, Any]:
    """The model's outputs to write into the caller's TensorDict, detached (unless ``detach`` is false: a call
    that keeps the graph, whose outputs can be trained on).

    Args:
        tensordict: the caller's TensorDict.
        result: what the model wrote its outputs to: a copy of ``tensordict``.
        explained_keys: the explained input keys.
        fed: the tensors given to the model for the explained inputs (``None``
            for integer tokens).

    Returns:
        ``key -> value`` for every leaf of ``result`` that is not already in
        ``tensordict`` (the same object) and is not an explained input's copy
        made for the model (or its integer tokens).
    """
    explained = set(explained_keys)
    updates: dict[Any, Any] = {}
    if has_lazy_stack(result):
        return _lazy_stack_updates(tensordict, result, explained, fed, detach)
    # items() rather than keys() and get(): several times cheaper on a small TensorDict.
    for key, value in result.items(include_nested=True, leaves_only=True):
        if key in explained and (any(value is f for f in fed) or not value.is_floating_point()):
            continue
        if _get_or_none(tensordict, key) is value:  # already there (None: absent, or a leaf in the way)
            continue
        updates[key] = value.detach() if detach and isinstance(value, torch.Tensor) else value
    return updates


def has_lazy_stack(tensordict: TensorDictBase) -> bool:
    """Whether ``tensordict`` is, or holds, a ``LazyStackedTensorDict`` (whose ``get`` stacks a new tensor).

    Examples:
        >>> from tensordict import LazyStackedTensorDict, TensorDict
        >>> parts = [TensorDict(x=torch.zeros(i + 1)) for i in range(2)]
        >>> has_lazy_stack(TensorDict(x=torch.zeros(2))), has_lazy_stack(TensorDict(a=LazyStackedTensorDict(*parts)))
        (False, True)
    """
    if isinstance(tensordict, LazyStackedTensorDict):
        return True
    return any(has_lazy_stack(value) for value in tensordict.values() if isinstance(value, TensorDictBase))


def _stacked_leaves(tensordict: Any, key: tuple) -> list | None:
    """The tensors a lazy stack holds at ``key``, one per stacked TensorDict (nested stacks flattened), without
    stacking them; ``None`` where one is absent."""
    if isinstance(tensordict, LazyStackedTensorDict):
        leaves = []
        for part in tensordict.tensordicts:
            found = _stacked_leaves(part, key)
            if found is None:
                return None
            leaves += found
        return leaves
    if not isinstance(tensordict, TensorDictBase) and not is_tensorclass(tensordict):  # a tensorclass: a branch
        return None
    value = _get_or_none(tensordict, key[0])
    if len(key) == 1:
        return None if value is None or isinstance(value, LazyStackedTensorDict) else [value]
    return _stacked_leaves(value, key[1:])


def _lazy_stack_updates(
    tensordict: TensorDictBase,
    result: TensorDictBase,
    explained: set,
    fed: Sequence[torch.Tensor | None],
    detach: bool,
) -> dict[NestedKey, Any]:
    """:func:`model_updates` for a TensorDict that holds lazy stacks: their entries are compared one stacked
    TensorDict at a time, so that the caller's tensors stay in place and entries of different shapes (which cannot
    be stacked) are left alone unless the model wrote them."""
    updates: dict[Any, Any] = {}
    for key in result.keys(include_nested=True, leaves_only=True):
        path = as_tuple(key)
        new = _stacked_leaves(result, path)
        if not new:
            continue
        if key in explained and isinstance(new[0], torch.Tensor):
            if not new[0].is_floating_point():
                continue  # integer tokens, given as they were
            if all(any(t is f or t._base is f for f in fed if f is not None) for t in new):
                continue  # the copy made for the model, or a lazy stack's views of it
        old = _stacked_leaves(tensordict, path)
        if old is not None and len(old) == len(new) and all(a is b for a, b in zip(old, new, strict=True)):
            continue
        value = result.get(key)
        updates[key] = value.detach() if detach and isinstance(value, torch.Tensor) else value
    return updates


def relevance_updates(
    tensordict: TensorDictBase,
    relevances: Sequence[torch.Tensor | None],
    keys: Sequence[NestedKey],
    token_keys: Sequence[NestedKey],
    sources: Sequence[NestedKey | None],
) -> dict[NestedKey, torch.Tensor]:
    """``key -> relevance`` for each relevance key, and for each token relevance key (if any) the relevance per
    token: token ids already have one relevance per token; embeddings and layer outputs sum their features.

    Examples:
        >>> from tensordict import TensorDict
        >>> td = TensorDict(x=torch.ones(2, 3), batch_size=[2])
        >>> updates = relevance_updates(td, [torch.ones(2, 3)], [("relevance", "x")], [("tokens", "x")], ["x"])
        >>> updates["tokens", "x"]
        tensor([3., 3.])
    """
    updates = {key: rel for key, rel in zip(keys, relevances, strict=True) if rel is not None}
    batch = tensordict.batch_size
    for key, rel in updates.items():
        if rel.shape[: len(batch)] != batch:  # a layer's output that folds the batch into another dimension
            raise ValueError(
                f"LRP: the relevance at {key!r} has shape {list(rel.shape)}, which does not start with the "
                f"TensorDict's batch shape {list(batch)}: the layer named there returns an output whose leading "
                "dimensions are not the batch (such as [batch x patches, ...]; [batch x agents, ...] in a torchrl "
                "MultiAgentConvNet with share_params=True, which folds its agents into its convolutions' batch; a "
                "batch of several dimensions flattened into one, as torchrl's ConvNet does, which a TensorDict with a "
                "batch of one dimension, td.reshape(-1), avoids), and its relevance cannot be written per sample; "
                "name a layer whose output keeps the batch in front"
            )
    for key, source, rel in zip(token_keys, sources, relevances, strict=bool(token_keys)):
        if rel is not None:
            per_token = source is not None and not tensordict.get(source).is_floating_point()
            updates[key] = rel if per_token else rel.sum(-1)
    return updates


def set_all_or_nothing(tensordict: TensorDictBase, updates: dict) -> None:
    """Write every update, or, if one fails, none: the caller's TensorDict never holds partial results.

    Args:
        tensordict: the TensorDict to write to.
        updates: ``key -> value``, written in order.

    Raises:
        BaseException: whatever a write raised, after the writes before it
            were undone and the sub-TensorDicts they created removed.
    """
    # What each write replaces, and the branches it creates, are looked up right before it: a write changes
    # nothing but its own key and the branches on its path (looked up once, at the first key that has them).
    previous: dict = {}
    branches: set = set()
    new_branches: list = []
    written = []
    try:
        for key, value in updates.items():
            path = as_tuple(key)
            for depth in range(1, len(path)):
                branch = path[:depth]
                if branch not in branches:
                    branches.add(branch)
                    if _get_or_none(tensordict, branch) is None:
                        new_branches.append(branch)
            previous[key] = _get_or_none(tensordict, key)
            written.append(key)  # before the write: an interrupt right after it still finds it undone
            tensordict.set(key, value)
    except BaseException:
        for key in reversed(written):
            if previous[key] is not None:
                tensordict.set(key, previous[key])
            elif _get_or_none(tensordict, key) is not None:  # not there where its write failed
                tensordict.del_(key)
        for branch in sorted(new_branches, key=len, reverse=True):  # deepest first; only the ones this call created
            value = _get_or_none(tensordict, branch)
            if isinstance(value, TensorDictBase) and value.is_empty():
                tensordict.del_(branch)
        raise


def with_input_writes(
    tensordict: TensorDictBase,
    work: TensorDictBase,
    result: TensorDictBase | None,
    explained_keys: Sequence[NestedKey] = (),
) -> TensorDictBase:
    """What a module returned for ``work``, a shallow copy of the caller's ``tensordict`` (``work`` itself where it
    returned ``None``), with the entries it wrote into ``work`` where it returned another TensorDict of ``work``'s
    batch or of none: a torchrl loss writes each sample's ``td_error`` (its priority) into the TensorDict it is
    given, and returns its losses in a new one, where a statistic of the batch may take the same key. Called by
    itself, the loss leaves the caller's TensorDict with the samples' entry; so does a wrapper's call. The
    ``explained_keys`` hold the inputs' copies made for the call, which are no writes.

    Examples:
        >>> from tensordict import TensorDict
        >>> given = TensorDict(x=torch.ones(4, 3), batch_size=[4])
        >>> work = given.copy().set("td_error", torch.ones(4, 1))  # what the loss wrote into its input
        >>> returned = with_input_writes(given, work, TensorDict(loss=torch.ones(4), td_error=torch.ones(1)))
        >>> returned["td_error"].shape
        torch.Size([4, 1])
    """
    if result is None or result is work:
        return work
    batch = work.batch_size
    if result.batch_size and result.batch_size != batch:  # a batch the module cut (DT's): written in its own
        return result
    explained = set(explained_keys)
    for key, value in work.items(True, True):
        if key in explained:
            continue
        own = _get_or_none(tensordict, key) is value  # the caller's entry (which the module may write in place)
        held = _get_or_none(result, key)
        per_sample = isinstance(value, torch.Tensor) and value.shape[: len(batch)] == batch
        if held is None:
            if not own:
                result.set(key, value)
        elif per_sample and isinstance(held, torch.Tensor) and held.shape[: len(batch)] != batch:
            if own:  # a statistic of the batch under the key of the samples' entry: the samples' stands
                del result[key]
            else:
                result.set(key, value)
    return result


def _get_or_none(tensordict: TensorDictBase, key: Any) -> Any:
    try:
        return tensordict.get(key, None)
    except (KeyError, ValueError):  # a leaf where the key needs a branch: setting it will fail, before any write
        return None


def _batch_statistics(result: TensorDictBase, batch: torch.Size, module: nn.Module) -> list[NestedKey] | None:
    """The keys of the entries of ``result`` that are statistics of the whole batch ``batch``, where its other
    entries are per sample (each begins with the dimensions ``batch``); ``None`` where it holds no tensor per sample.

    A torchrl loss with ``reduction="none"`` returns its per-sample losses with statistics of the batch (PPO's
    ``clip_fraction``, ``ESS``, SAC's ``alpha``); any other module's entries must all be per sample."""
    batched, statistics = False, []
    for key, value in result.items(True, True):
        if not isinstance(value, torch.Tensor):
            continue
        if value.shape[: len(batch)] == batch:
            batched = True
        else:
            statistics.append(key)
    if not batched or (statistics and not _is_torchrl_loss(module)):
        return None
    return statistics


def returns_sizeless(module: nn.Module) -> bool:
    """Whether ``module`` returns its outputs in a new TensorDict without a batch size, whatever batch it is given:
    a ``TensorDictModule`` or ``TensorDictSequential`` made with ``inplace=False`` (or a sequence ending with such a
    step), or a torchrl loss with ``reduction="none"`` (its per-sample losses).

    Examples:
        >>> from tensordict.nn import TensorDictModule
        >>> returns_sizeless(TensorDictModule(nn.Linear(2, 2), ["x"], ["y"], inplace=False))
        True
        >>> returns_sizeless(TensorDictModule(nn.Linear(2, 2), ["x"], ["y"]))
        False
    """
    if isinstance(module, (TensorDictModule, TensorDictSequential)) and getattr(module, "inplace", None) is False:
        return True
    steps = list(module.module.children()) if isinstance(module, TensorDictSequential) else []  # a list, or named
    if steps:
        return returns_sizeless(steps[-1])
    return _is_torchrl_loss(module) and getattr(module, "reduction", None) == "none"


def _is_torchrl_loss(module: nn.Module) -> bool:
    """Whether ``module`` is a torchrl loss (without importing torchrl's objectives)."""
    return any(c.__name__ == "LossModule" and c.__module__.startswith("torchrl.") for c in type(module).__mro__)
