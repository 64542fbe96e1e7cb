"""Calling an attribution method for a metric: its keys, its output, and its target held fixed.

A method is a ``TensorDictModuleBase`` that writes its attribution of each input key ``k`` at
``(relevance_key, *k)`` (:class:`~tdhook.attribution.LRP` and the gradient and perturbation methods).

Examples:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from tdhook.attribution import LRP
    >>> lrp = LRP(torch.nn.Linear(3, 2), in_keys=["x"], out_keys=["y"])
    >>> method_keys(lrp, None), method_prefix(lrp, None)
    (['x'], 'relevance')
    >>> result = explain(lrp, TensorDict(x=torch.ones(4, 3), batch_size=[4]))
    >>> result["relevance", "x"].shape, original_target(lrp, result, 1).shape
    (torch.Size([4, 3]), torch.Size([4]))
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase, TensorDictSequential
from tensordict.utils import NestedKey, unravel_key

from tdhook.attribution._chosen_values import chosen_value_module
from tdhook.attribution._inputs import explained_in_call, optional_inputs
from tdhook.attribution._policy_targets import allowed_action, masked_action_keys
from tdhook.attribution._read_keys import reads_only_in_keys
from tdhook.attribution.methods._options import entries
from tdhook.attribution.targets import initial_relevance, resolve_target_key, target_output, zero_entries
from tdhook.metrics._features import Features, explained_keys, stacked_batch

__all__ = [
    "HeldWeights",
    "attribution_wrapper",
    "check_method",
    "explain",
    "explained_output",
    "in_batch_of",
    "method_keys",
    "method_prefix",
    "options_repeated",
    "original_target",
    "refuse_recomputed_keys",
    "repeat_target",
    "target_set",
    "unit_dims",
    "written_attributions",
]


def check_method(method: object, name: str) -> TensorDictModuleBase:
    if not isinstance(method, TensorDictModuleBase):
        raise TypeError(
            f"{name}: method must be an attribution wrapper (a TensorDictModuleBase such as LRP), "
            f"got {type(method).__name__}"
        )
    wrapper = attribution_wrapper(method)
    if not hasattr(wrapper, "target") and not any(isinstance(unravel_key(k), tuple) for k in method.out_keys):
        # the model itself (a policy, a value operator): it writes no attribution, and the metric would read none
        raise TypeError(
            f"{name}: method must be an attribution wrapper, which the metric calls (LRP, Saliency, "
            f"IntegratedGradients, ...), got {type(method).__name__} (out_keys {list(method.out_keys)}), which is "
            "none and runs none: pass the method that explains it, for example LRP(module, EpsilonPlus())"
        )
    if getattr(wrapper, "upsample", None) is False and hasattr(wrapper, "layer_key"):  # GradCAM on a layer alone
        raise ValueError(
            f"{name}: GradCAM writes its map of layer {wrapper.layer!r} at {wrapper.layer_key!r}, not an attribution "
            "of the input keys, which the metric compares; build it with upsample=True (the map resized to each "
            "input)"
        )
    return method


def attribution_wrapper(method: TensorDictModuleBase) -> TensorDictModuleBase:
    """The module that holds the method's ``target``: the method itself where it has one, else the one attribution
    wrapper inside it (a ``TensorDictSequential`` that runs a preprocessing step before an LRP wrapper, say).

    Raises:
        TypeError: the method holds several attribution wrappers, whose targets could not be held as one.
    """
    if hasattr(method, "target"):
        return method
    found = [(name, m) for name, m in method.named_modules() if name and _is_wrapper(m)]
    outer = [(name, m) for name, m in found if not any(name.startswith(f"{other}.") for other, _ in found)]
    if len(outer) > 1:
        raise TypeError(
            f"metrics: the method holds several attribution wrappers ({', '.join(repr(n) for n, _ in outer)}); "
            "score one at a time"
        )
    return outer[0][1] if outer else method


def _is_wrapper(module: object) -> bool:
    return isinstance(module, TensorDictModuleBase) and hasattr(module, "target") and hasattr(module, "relevance_key")


def refuse_recomputed_keys(method: TensorDictModuleBase, keys: Sequence[NestedKey], name: str) -> None:
    """Refuse explained ``keys`` that a step of the pipeline ``method`` computes from other inputs before its
    attribution wrapper: a perturbed value of such a key is overwritten before the wrapper explains it.

    Raises:
        ValueError: naming the key, the step and the keys it reads.

    Examples:
        >>> from tensordict.nn import TensorDictModule
        >>> from tdhook.attribution import Saliency
        >>> scale = TensorDictModule(lambda raw: raw * 2.0, in_keys=["raw"], out_keys=["obs"])
        >>> saliency = Saliency(TensorDictModule(torch.nn.Linear(3, 2), in_keys=["obs"], out_keys=["q"]))
        >>> refuse_recomputed_keys(saliency, ["obs"], "sensitivity_max")  # the wrapper alone
        >>> pipeline = TensorDictSequential(scale, saliency)
        >>> refuse_recomputed_keys(pipeline, ["obs"], "sensitivity_max")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: sensitivity_max: the method explains 'obs', which step 'module.0' (TensorDictModule) of the ...
    """
    wrapper = attribution_wrapper(method)
    wanted = {unravel_key(key) for key in keys}
    for step_name, step in method.named_modules():
        if step is wrapper:
            return
        if not isinstance(step, TensorDictModuleBase) or isinstance(step, TensorDictSequential):
            continue
        read = [unravel_key(key) for key in step.in_keys]
        for key in map(unravel_key, step.out_keys):
            if key in wanted and key not in read:
                raise ValueError(
                    f"{name}: the method explains {key!r}, which step {step_name!r} ({type(step).__name__}) of the "
                    f"pipeline computes from {read} before the attribution wrapper: a perturbed {key!r} would be "
                    "overwritten there, and the explanations compared would be those of the unperturbed input; score "
                    f"the wrapper itself on a TensorDict that holds {key!r} (the pipeline's output)"
                )


def method_keys(
    method: TensorDictModuleBase, in_keys: Sequence[NestedKey] | None, td: TensorDictBase | None = None
) -> list[NestedKey]:
    """The explained keys: ``in_keys``, else the method's explained keys, else its in_keys. Keys the method took
    from its module's in_keys are those it explains in a call on ``td``: not the flags and masks, nor the
    recurrent states ``td`` does not hold."""
    method = attribution_wrapper(method)
    keys = explained_keys(in_keys, getattr(method, "explained_keys", None) or method.in_keys)
    if in_keys is None and td is not None and getattr(method, "_defaulted_inputs", False):
        module = getattr(method, "module", method)
        flags = explained_in_call(td, keys, True, optional_inputs(module))
        keys = [key for key, explained in zip(keys, flags, strict=True) if explained]
    return keys


def unit_dims(method: TensorDictModuleBase) -> int:
    """The dimensions the method's attributions hold between the batch's and the input's: one for
    ``target="all"`` (every output unit), one for LRP's ``split_dim`` (every position of that dimension).

    Examples:
        >>> from tdhook.attribution import Saliency
        >>> net = torch.nn.Linear(3, 2)
        >>> unit_dims(Saliency(net, in_keys=["x"], out_keys=["y"])), unit_dims(
        ...     Saliency(net, in_keys=["x"], out_keys=["y"], target="all")
        ... )
        (0, 1)
    """
    wrapper = attribution_wrapper(method)
    target = getattr(wrapper, "target", None)
    return int(isinstance(target, str) and target == "all") + int(getattr(wrapper, "split_dim", None) is not None)


def method_prefix(method: TensorDictModuleBase, relevance_key: NestedKey | None) -> NestedKey:
    """The prefix of the attribution keys: ``relevance_key``, else the method's own, else ``"attribution"``."""
    if relevance_key is not None:
        return relevance_key
    return getattr(attribution_wrapper(method), "relevance_key", "attribution")


def explain(method: TensorDictModuleBase, td: TensorDictBase) -> TensorDictBase:
    """The method's result on a shallow copy of ``td``'s inputs and, for a masked policy, of the actions it holds and
    of its ``"next"`` (a transition's action is the one the method explains by default; ``td`` itself is not written
    to)."""
    held = masked_action_keys(method)
    if not reads_only_in_keys(method):  # every entry: it may read more than it declares (see carried_inputs)
        work = td.copy()
    else:
        work = td.select(*method.in_keys, *held, *(["next"] if held else []), strict=False)
    result = method(work)
    return work if result is None else result


def in_batch_of(td: TensorDictBase, result: TensorDictBase) -> TensorDictBase:
    """``td``, or, where a method's ``result`` on it has a batch that begins ``td``'s and is shorter, a shallow copy
    of ``td`` with that batch: torchrl's ``DecisionTransformerInferenceWrapper`` called on a ``[B, T]`` context acts
    once per context, and returns ``[B]``; each context is one sample, as the methods explain it.

    Examples:
        >>> from tensordict import TensorDict
        >>> contexts = TensorDict(x=torch.ones(3, 6, 2), batch_size=[3, 6])
        >>> in_batch_of(contexts, TensorDict(action=torch.ones(3, 2), batch_size=[3])).batch_size
        torch.Size([3])
    """
    size, given = result.batch_size, td.batch_size
    # A batch reduced to none (a loss's mean) is no batch of contexts: its copies, stacked, would reduce together.
    if 0 < len(size) < len(given) and given[: len(size)] == size:
        td = td.copy()
        td.batch_size = size
    return td


def written_attributions(
    result: TensorDictBase, given: TensorDictBase, keys: Sequence[NestedKey], prefix: NestedKey, units: int
) -> list[torch.Tensor]:
    """The attributions of ``keys`` that a method's ``result`` holds, read against the inputs ``given`` to its call.

    A model may write an output over one of its input keys (torchrl's ``DecisionTransformerInferenceWrapper`` writes
    the last step's ``action`` over the context's): the attribution is of the input given.

    Examples:
        >>> from tensordict import TensorDict
        >>> given = TensorDict(x=torch.ones(4, 3), batch_size=[4])
        >>> result = TensorDict(x=torch.ones(4, 1), attribution=TensorDict(x=torch.ones(4, 3)), batch_size=[4])
        >>> written_attributions(result, given, ["x"], "attribution", 0)[0].shape
        torch.Size([4, 3])
    """
    if result.batch_size == given.batch_size:
        result = result.copy().update(given.select(*keys, strict=False))
    return Features.read(result, keys, prefix, units).attributions


@dataclass(frozen=True)
class HeldWeights:
    """A callable target that gives every output the weights a callable target gave the unperturbed one.

    The methods turn a callable target into weights ``target(y) / y`` on the output ``y`` they explain; holding
    those weights explains a perturbed input for the same target, as ``None`` held at the original argmax does.

    Examples:
        >>> held = HeldWeights(torch.tensor([[0.5, -1.0]]))
        >>> held(torch.tensor([[2.0, 4.0]]))
        tensor([[ 1., -4.]])
    """

    weights: torch.Tensor

    def __call__(self, output: torch.Tensor) -> torch.Tensor:
        return output * self.weights


def original_target(
    method: TensorDictModuleBase, result: TensorDictBase, batch_dims: int, td: TensorDictBase | None = None
) -> object:
    """The method's target as resolved on the unperturbed ``result`` of a call on ``td``.

    ``None`` becomes the argmax of the explained output (nothing for a one-unit output; for a torchrl policy that
    masks actions, the action ``td`` holds, else the highest allowed logit, as the methods explain it), a callable
    becomes :class:`HeldWeights` with the weights it gives that output; an int or per-sample indices stay as they
    are.

    Raises:
        TypeError: the method explains several outputs at once (a dict ``target_key``).
        ValueError: ``None`` on a ``QValueModule``'s chosen action value, whose action another input may change.
    """
    method = attribution_wrapper(method)
    target = getattr(method, "target", None)
    if target is not None and not callable(target):
        return target
    key, operator = _target_of(method, result)
    if target is None and chosen_value_module(operator, key) is not None:
        raise ValueError(
            f"metrics: the method explains {key!r}, the value of the greedy action, which another input may change: "
            "its explanations there would be of another action. Build the method with target_key= the action "
            "values (for a QValueActor, 'action_value': the same relevance here, and its argmax is then held)"
        )
    output = target_output(result, key, operator)
    if target is not None:
        weights, at_zero = initial_relevance(output.detach(), target, key, batch_dims)
        if at_zero is not None:  # LRP seeds it at the zero outputs; held weights on other outputs cannot
            raise ValueError(
                f"metrics: the method's callable target puts relevance on {zero_entries(at_zero, key, output)}; "
                "weights relevance / output held for other inputs cannot carry it: return the output times the weights "
                "(lambda y: y * w)"
            )
        return HeldWeights(weights)
    if output.dim() > batch_dims and output.shape[-1] > 1:
        allowed = allowed_action(operator, key, result, result if td is None else td, owner="metrics")
        return output.argmax(-1) if allowed is None else allowed
    return None


def _target_of(method: TensorDictModuleBase, result: TensorDictBase) -> tuple[NestedKey, TensorDictModuleBase]:
    """The key of the output the method (its :func:`attribution_wrapper`) explains in ``result``, and the module
    that writes it.

    Raises:
        TypeError: the method explains several outputs at once (a dict ``target_key``).
    """
    target_key = getattr(method, "target_key", None)
    if isinstance(target_key, Mapping):
        raise TypeError(
            f"metrics: the method explains several outputs at once ({sorted(map(str, target_key))}: a dict "
            "target_key, or the heads of an ActorValueOperator by default); a metric scores one: build the method with "
            "target_key= one output key"
        )
    operator = getattr(method, "module", None)
    operator = operator if isinstance(operator, TensorDictModuleBase) else method
    return resolve_target_key(result, target_key, operator), operator


def explained_output(method: TensorDictModuleBase, result: TensorDictBase) -> torch.Tensor:
    """The output the method explains, as the ``result`` of one of its calls holds it.

    Raises:
        TypeError: the method explains several outputs at once (a dict ``target_key``).

    Examples:
        >>> from tensordict import TensorDict
        >>> from tdhook.attribution import Saliency
        >>> saliency = Saliency(torch.nn.Linear(3, 2), in_keys=["x"], out_keys=["y"])
        >>> explained_output(saliency, explain(saliency, TensorDict(x=torch.ones(4, 3), batch_size=[4]))).shape
        torch.Size([4, 2])
    """
    key, operator = _target_of(attribution_wrapper(method), result)
    return target_output(result, key, operator)


def repeat_target(target: object, batch_size: torch.Size, n: int) -> object:
    """A per-sample target (indices ``batch``, ``batch + [1]`` or ``batch + [heads]`` for an output
    ``batch + [heads, units]``, or held weights) for ``n`` copies of the batch stacked along its first dimension
    (see :func:`~tdhook.metrics._features.stacked_batch`); other targets as they are.

    Examples:
        >>> repeat_target(torch.tensor([[0, 1, 2]]), torch.Size([1, 3]), 2)
        tensor([[0, 1, 2],
                [0, 1, 2]])
        >>> repeat_target(torch.tensor([1, 0]), torch.Size([]), 3)  # one index per head of a batch []
        tensor([[1, 0],
                [1, 0],
                [1, 0]])
    """
    if isinstance(target, torch.Tensor) and target.shape[: len(batch_size)] == batch_size and target.dim():
        return _stacked_copies(target, batch_size, n)
    if isinstance(target, HeldWeights) and len(batch_size):
        return HeldWeights(_stacked_copies(target.weights, batch_size, n))
    return target


def _stacked_copies(value: torch.Tensor, batch_size: torch.Size, n: int) -> torch.Tensor:
    """``value`` (``batch + rest``) for ``n`` copies of the batch stacked along its first dimension."""
    return value.expand(n, *value.shape).reshape(*stacked_batch(n, batch_size), *value.shape[len(batch_size) :])


@contextlib.contextmanager
def options_repeated(method: TensorDictModuleBase, td: TensorDictBase, n: int) -> Iterator[None]:
    """The method's options that hold one value per sample of ``td`` (a baseline or a feature mask with the batch's
    shape before a sample's, or 1 along its dimensions after the first: ``_per_call_options`` of the methods)
    repeated for ``n`` copies of the batch stacked along its first dimension (see
    :func:`~tdhook.metrics._features.stacked_batch`), restored afterwards.

    Examples:
        >>> from tensordict import TensorDict
        >>> from tdhook.attribution import IntegratedGradients
        >>> ig = IntegratedGradients(torch.nn.Linear(3, 1), in_keys=["x"], out_keys=["y"], baselines=torch.zeros(2, 1))
        >>> with options_repeated(ig, TensorDict(x=torch.ones(2, 3), batch_size=[2]), 4):
        ...     ig.baselines.shape
        torch.Size([8, 1])
        >>> ig.baselines.shape
        torch.Size([2, 1])
    """
    method = attribution_wrapper(method)
    batch = td.batch_size
    # The keys a call explains: floating-point inputs (with default keys, a call leaves out flags and masks).
    inputs = {key: td.get(key) for key in getattr(method, "explained_keys", ()) if key in td.keys(True)}
    inputs = {key: x for key, x in inputs.items() if x.is_floating_point()}

    def per_sample(value: object, keys: Sequence[NestedKey]) -> bool:
        # One value per sample along the batch's first dimension: the input's number of dimensions, that dimension's
        # size, and, along the other batch dimensions, theirs or 1 (a [B1, 1, F] baseline for a [B1, B2] batch).
        return (
            isinstance(value, torch.Tensor)
            and len(batch) > 0
            and bool(keys)
            and all(
                value.dim() == inputs[key].dim()
                and value.shape[0] == batch[0]
                and all(v in (1, b) for v, b in zip(value.shape[1 : len(batch)], batch[1:], strict=True))
                for key in keys
            )
        )

    def repeated(value: object, keys: Sequence[NestedKey]) -> object:
        if not per_sample(value, keys):
            return value
        return value.expand(n, *value.shape).reshape(n * value.shape[0], *value.shape[1:])

    previous = {name: getattr(method, name) for name in getattr(method, "_per_call_options", ())}
    try:
        for name, value in previous.items():
            if isinstance(value, Mapping):
                value = entries(value)
                given = {key: unravel_key(key) for key in value}
                value = {key: repeated(v, [given[key]] if given[key] in inputs else []) for key, v in value.items()}
            else:
                value = repeated(value, list(inputs))
            setattr(method, name, value)
        yield
    finally:
        for name, value in previous.items():
            setattr(method, name, value)


@contextlib.contextmanager
def target_set(method: TensorDictModuleBase, target: object) -> Iterator[TensorDictModuleBase]:
    """``method`` (its :func:`attribution_wrapper`) with ``target`` in place of its own for the block, restored
    afterwards."""
    method = attribution_wrapper(method)
    if not hasattr(method, "target"):
        yield method
        return
    previous = method.target
    method.target = target
    try:
        yield method
    finally:
        method.target = previous
