"""Default targets of torchrl pipelines: actor and critic together, the allowed action of a masked policy, the
step a decision transformer acts on, and the action an exploring policy takes.

* An ``ActorValueOperator``, an ``ActorCriticOperator``, an
  ``ActorCriticWrapper``, and a ``TensorDictSequential`` of an actor followed
  by a ``ValueOperator`` (a critic of the actor's action, as in DDPG or SAC)
  explain both heads: ``{"actor": ..., "critic": ...}``.
* A policy sampling one of the actions its logits score (``Categorical``,
  ``OneHotCategorical``, ``MaskedCategorical``, ``MaskedOneHotCategorical``,
  the ordinal ones) explains the action taken: in a stored transition (a
  TensorDict holding ``"next"``, as collectors and replay buffers give them),
  the action it holds (written back over the call's own draw); else the action
  the call draws, its mode under deterministic exploration (for a masked
  policy the highest allowed logit: the plain argmax could be forbidden) or a
  sample. A live step of torchrl's ``env.rollout`` or of a collector holds the
  previous step's action and no ``"next"``: that action is not the one this
  step takes.
* A policy sampling from torchrl's ``Ordinal`` or ``OneHotOrdinal`` reads
  scores whose argmax need not be its action: the action is the argmax of the
  ordinal log-probabilities the distribution makes from them. Its scores
  explained, the default target is that action (in a stored transition, the
  action it holds), at its unit of the scores.
* A ``DistributionalQValueActor`` writes action values of shape
  ``[*batch, atoms, actions]`` (the log-probabilities of each action's return
  falling in each atom of the support). Explained (``target_key`` its action
  values), its default target is the greedy action, the one whose expected
  return over the support is highest, at every atom: the log-probabilities of
  the chosen action's return distribution. The argmax of the last dimension
  would take at each atom the action most likely there, a mix of actions none
  of which need be the chosen one.
* torchrl's ``DecisionTransformerInferenceWrapper`` runs its actor on a
  context of T steps and outputs the action of the last one. It explains what
  its actor explains by default (``param`` of a ``DTActor``, ``loc`` of an
  ``OnlineDTActor``), at the last step: the prediction the wrapper acts on,
  not every step of the context.
* Exploration steps after an actor (``AdditiveGaussianModule``,
  ``OrnsteinUhlenbeckProcessModule``, ``EGreedyModule``) write no output to
  explain: the action taken is explained (their noise, and the projection of
  the noisy action into the spec, are a constant of the call), not the noise
  process's state. ``EGreedyModule`` replaces the action now and then by a
  random one, which the network has no part in: the greedy action's value
  (``chosen_action_value``) is what is explained.

Examples:
    >>> from torch import nn
    >>> from tensordict import TensorDict
    >>> from tensordict.nn import TensorDictModule
    >>> from torchrl.modules import MaskedCategorical, ProbabilisticActor
    >>> actor = ProbabilisticActor(
    ...     TensorDictModule(nn.Linear(4, 3), in_keys=["observation"], out_keys=["logits"]),
    ...     in_keys={"logits": "logits", "mask": "action_mask"}, distribution_class=MaskedCategorical,
    ... )
    >>> result = TensorDict(logits=torch.tensor([[0.0, 5.0, 1.0]]), action_mask=torch.tensor([[True, False, True]]),
    ...                     batch_size=[1])
    >>> allowed_action(actor, "logits", result, TensorDict(batch_size=[1]))  # 1 is forbidden
    tensor([2])
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from tensordict import TensorDictBase
from tensordict.nn import (
    CompositeDistribution,
    InteractionType,
    ProbabilisticTensorDictModule,
    TensorDictModuleBase,
    TensorDictSequential,
)
from tensordict.nn.probabilistic import interaction_type
from tensordict.utils import NestedKey, unravel_key
from torch import distributions, nn
from torchrl.data import Bounded, Composite, Unbounded
from torchrl.modules import (
    Actor,
    ActorCriticOperator,
    ActorCriticWrapper,
    ActorValueOperator,
    AdditiveGaussianModule,
    DecisionTransformerInferenceWrapper,
    EGreedyModule,
    OrnsteinUhlenbeckProcessModule,
    QValueModule,
    ValueOperator,
)
from torchrl.modules.distributions import (
    MaskedCategorical,
    MaskedOneHotCategorical,
    OneHotCategorical,
    OneHotOrdinal,
    Ordinal,
)
from torchrl.modules.tensordict_module.actors import DistributionalQValueModule

from tdhook.attribution.rules._caller import warn_at_caller
from tdhook.attribution.rules._identity import IdentityWeakKeyDict

__all__ = [
    "actor_and_critic",
    "allowed_action",
    "distributional_action",
    "distributional_module",
    "allowed_mask",
    "ordinal_sampler",
    "holds_transition",
    "stored_rows",
    "held_action_record",
    "masked_action_keys",
    "acted_step",
    "default_target_operator",
    "sequential_steps",
    "EXPLORATION_MODULES",
]

_MASKED = (MaskedCategorical, MaskedOneHotCategorical)
_ORDINAL = (Ordinal, OneHotOrdinal)
_CATEGORICAL = (distributions.Categorical, distributions.OneHotCategorical)  # torchrl's own subclass the first
_ONE_HOT = (MaskedOneHotCategorical, OneHotOrdinal, OneHotCategorical, distributions.OneHotCategorical)
# Steps that perturb the action an actor wrote (noise, a random action now and then): they write no output of
# their own to explain (the Ornstein-Uhlenbeck process writes its state, ``_ou_prev_noise`` and ``_ou_steps``).
EXPLORATION_MODULES = (AdditiveGaussianModule, OrnsteinUhlenbeckProcessModule, EGreedyModule)


def actor_and_critic(module: TensorDictModuleBase) -> dict[str, TensorDictModuleBase] | None:
    """The actor and critic operators of an actor-critic pipeline, or ``None`` for any other module."""
    if isinstance(module, ActorCriticOperator):  # its critic runs the policy head too: the value head's output
        return {"actor": module.get_policy_operator(), "critic": module.get_value_head()}
    if isinstance(module, (ActorValueOperator, ActorCriticWrapper)):
        return {"actor": module.get_policy_operator(), "critic": module.get_value_operator()}
    steps = sequential_steps(module)
    if len(steps) > 1 and isinstance(steps[-1], ValueOperator):
        actor_steps = steps[:-1]
        critic_reads = {unravel_key(k) for k in steps[-1].in_keys}
        actions = {
            unravel_key(k) for step in actor_steps for sub in step.modules() if _chooses(sub) for k in sub.out_keys
        }
        if critic_reads & actions:  # the critic values the action the steps before it chose
            actor = actor_steps[0] if len(actor_steps) == 1 else TensorDictSequential(*actor_steps)
            return {"actor": actor, "critic": steps[-1]}
    return None


def sequential_steps(module: TensorDictModuleBase) -> list[nn.Module]:
    """The steps of a ``TensorDictSequential``, given in order (a ``ModuleList``) or by name (an ordered dict, held
    as a ``ModuleDict``); none for any other module."""
    if not isinstance(module, TensorDictSequential):
        return []
    steps = module.module
    return list(steps.values() if isinstance(steps, nn.ModuleDict) else steps)


def _chooses(module: object) -> bool:
    """Whether ``module`` writes an action: a sampling step, or one of torchrl's deterministic actors."""
    return isinstance(module, (ProbabilisticTensorDictModule, Actor))


# The module found for each operator, key and kind of search (a masked sampler, a distributional Q-value module):
# looked up once, not at every call of a policy.
_FOUND: IdentityWeakKeyDict[TensorDictModuleBase, dict] = IdentityWeakKeyDict()


def _found_once(operator: TensorDictModuleBase, target_key: NestedKey, find: Callable) -> Any:
    found = _FOUND.get(operator)
    if found is None:
        found = _FOUND[operator] = {}
    if (find, target_key) not in found:
        found[find, target_key] = find(operator, target_key)
    return found[find, target_key]


def _masked_sampler(operator: TensorDictModuleBase, target_key: NestedKey) -> ProbabilisticTensorDictModule | None:
    return _found_once(operator, target_key, _find_masked_sampler)


def _categorical_sampler(operator: TensorDictModuleBase, target_key: NestedKey) -> ProbabilisticTensorDictModule | None:
    return _found_once(operator, target_key, _find_categorical_sampler)


def _find_sampler_of(
    kinds: tuple[type, ...], operator: TensorDictModuleBase, target_key: NestedKey
) -> ProbabilisticTensorDictModule | None:
    """The sampler of ``operator`` whose distribution, one of ``kinds``, reads ``target_key`` as its logits or
    probabilities, or ``None``."""
    for sub in operator.modules():
        if isinstance(sub, ProbabilisticTensorDictModule) and issubclass(sub.distribution_class, kinds):
            keys = _distribution_keys(sub)
            if unravel_key(target_key) in (keys.get("logits"), keys.get("probs")):
                return sub
    return None


_find_masked_sampler = functools.partial(_find_sampler_of, _MASKED)
_find_categorical_sampler = functools.partial(_find_sampler_of, _CATEGORICAL)


def _action_sampler(operator: TensorDictModuleBase, target_key: NestedKey) -> ProbabilisticTensorDictModule | None:
    """The sampler of ``operator`` that draws one of the actions ``target_key`` scores: a categorical, masked or
    ordinal distribution reading it, or ``None``."""
    return (
        _masked_sampler(operator, target_key)
        or ordinal_sampler(operator, target_key)
        or _categorical_sampler(operator, target_key)
    )


def _composite_part(operator: TensorDictModuleBase, target_key: NestedKey) -> tuple[Any, str] | None:
    """The sampler of ``operator`` whose ``CompositeDistribution`` reads ``target_key`` as the logits or
    probabilities of a categorical part, and that part's name; else ``None``."""
    return _found_once(operator, target_key, _find_composite_part)


def _find_composite_part(operator: TensorDictModuleBase, target_key: NestedKey) -> tuple[Any, str] | None:
    key = unravel_key(target_key)
    for sub in operator.modules():
        if not isinstance(sub, ProbabilisticTensorDictModule) or sub.distribution_class is not CompositeDistribution:
            continue
        parts = (getattr(sub, "distribution_kwargs", None) or {}).get("distribution_map", {})
        for name, kind in parts.items():
            if isinstance(kind, type) and issubclass(kind, _CATEGORICAL + _MASKED):
                for root in sub.in_keys:
                    if key in (unravel_key((root, name, "logits")), unravel_key((root, name, "probs"))):
                        return sub, name
    return None


def _refuse_composite_draw(
    operator: TensorDictModuleBase, target_key: NestedKey, tensordict: TensorDictBase, explained: bool, owner: str
) -> None:
    """Refuse the default target where ``target_key`` holds the logits of a categorical part of a torchrl
    ``CompositeDistribution`` (a hybrid action) whose action taken may be another than the argmax: a draw at random,
    or a stored transition's action. The default target would explain the argmax (the part's action is not followed
    to its key), which is the action taken only where the policy acts deterministically."""
    found = None if owner == "metrics" else _composite_part(operator, target_key)
    if found is None:  # the metrics score the argmax an explanation of such a part explained (refused otherwise)
        return
    sampler, name = found
    random = (interaction_type() or sampler.default_interaction_type) == InteractionType.RANDOM
    if random or explained or holds_transition(tensordict):
        raise ValueError(
            f"{owner}: {target_key!r} holds the logits of the categorical part {name!r} of a CompositeDistribution "
            "(a hybrid action), whose action taken (drawn at random, or a stored transition's) the default target "
            "does not follow: it would explain the argmax. Pass the action taken as the target "
            "(target=td[<the part's action key>]), or explain under "
            "torchrl.envs.utils.set_exploration_type(ExplorationType.DETERMINISTIC), where the action is the argmax"
        )


def _warn_for_continuous_units(
    operator: TensorDictModuleBase, target_key: NestedKey, result: TensorDictBase, owner: str
) -> None:
    """Warn where the default target, the unit of largest value in each sample, is taken among the dimensions of a
    continuous action: none of them is the action taken, as the argmax of action values or logits is."""
    head = _found_once(operator, target_key, _find_continuous_head)
    if head is None:  # most heads: the output is not read
        return
    output = result.get(target_key, None)
    if not isinstance(output, torch.Tensor) or output.dim() == 0 or output.shape[-1] < 2:
        return
    warn_at_caller(
        f"{owner}: target=None explains, in each sample, the unit of {target_key!r} with the largest value, as for "
        f"action values or logits; but {target_key!r} holds the {output.shape[-1]} dimensions of a continuous "
        f"action ({head}), none of which is the action taken, so samples explain different dimensions. Pass "
        "target=<a dimension> for one, target='all' for each, or a callable (their sum, lambda y: y.sum(-1))"
    )


def _find_continuous_head(operator: TensorDictModuleBase, target_key: NestedKey) -> str | None:
    """What makes ``target_key`` the dimensions of a continuous action: a parameter or the sample of a sampler's
    distribution that is not a categorical, masked or ordinal one (``loc`` of a ``TanhNormal``), or the output of a
    torchrl ``Actor`` whose action spec is continuous (a DDPG actor's); ``None`` for anything else."""
    key = unravel_key(target_key)
    discrete = (*_CATEGORICAL, *_MASKED, *_ORDINAL, *_ONE_HOT)
    for sub in operator.modules():
        if isinstance(sub, ProbabilisticTensorDictModule) and sub.distribution_class is CompositeDistribution:
            if (part := _continuous_composite_part(sub, key, discrete)) is not None:
                return part
        elif isinstance(sub, ProbabilisticTensorDictModule) and not issubclass(sub.distribution_class, discrete):
            if key in _distribution_keys(sub).values():
                return f"the {sub.distribution_class.__name__} parameter of {type(sub).__name__}"
            if key == unravel_key(sub.out_keys[0]):
                return f"the {sub.distribution_class.__name__} sample of {type(sub).__name__}"
        elif isinstance(sub, Actor) and key in map(unravel_key, sub.out_keys):
            spec = sub.spec.get(key, None) if isinstance(sub.spec, Composite) else sub.spec
            if isinstance(spec, (Bounded, Unbounded)) and spec.dtype.is_floating_point:
                return f"the output of {type(sub).__name__} under a {type(spec).__name__} action spec"
    return None


def _continuous_composite_part(
    sampler: ProbabilisticTensorDictModule, key: tuple | str, discrete: tuple[type, ...]
) -> str | None:
    """What makes ``key`` the dimensions of a continuous part of ``sampler``'s ``CompositeDistribution`` (a hybrid
    action): a parameter of a part that is not a discrete distribution (``("params", "cont", "loc")``), or that part's
    sample (its key in ``name_map``); ``None`` for anything else."""
    kwargs = getattr(sampler, "distribution_kwargs", None) or {}
    names = kwargs.get("name_map") or {}
    for name, kind in (kwargs.get("distribution_map") or {}).items():
        if not isinstance(kind, type) or issubclass(kind, discrete):
            continue
        for root in sampler.in_keys:
            prefix = unravel_key((root, name))
            prefix = prefix if isinstance(prefix, tuple) else (prefix,)
            if isinstance(key, tuple) and len(key) == len(prefix) + 1 and key[: len(prefix)] == prefix:
                return f"the {kind.__name__} parameter of the part {name!r} of a CompositeDistribution"
        if key == unravel_key(names.get(name, name)):
            return f"the {kind.__name__} sample of the part {name!r} of a CompositeDistribution"
    return None


def ordinal_sampler(operator: TensorDictModuleBase, target_key: NestedKey) -> ProbabilisticTensorDictModule | None:
    """The sampler of ``operator`` whose torchrl ``Ordinal`` or ``OneHotOrdinal`` distribution reads its scores at
    ``target_key``, or ``None``. Its action is the argmax of the ordinal log-probabilities made from the scores, not
    of the scores: that of the distribution's ``logits`` (:func:`ordinal_logits`)."""
    return _found_once(operator, target_key, _find_ordinal_sampler)


def _find_ordinal_sampler(
    operator: TensorDictModuleBase, target_key: NestedKey
) -> ProbabilisticTensorDictModule | None:
    for sub in operator.modules():
        if isinstance(sub, ProbabilisticTensorDictModule) and issubclass(sub.distribution_class, _ORDINAL):
            if unravel_key(target_key) == _distribution_keys(sub).get("scores"):
                return sub
    return None


def ordinal_logits(sampler: ProbabilisticTensorDictModule, scores: torch.Tensor) -> torch.Tensor:
    """The log-probabilities of the actions of ``sampler``'s ordinal distribution given ``scores``.

    Examples:
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl.modules import ProbabilisticActor
        >>> actor = ProbabilisticActor(TensorDictModule(nn.Identity(), ["observation"], ["scores"]),
        ...                            in_keys=["scores"], distribution_class=Ordinal)
        >>> scores = torch.tensor([[2.0, 1.0, -0.5, -3.0]])
        >>> scores.argmax(-1), ordinal_logits(ordinal_sampler(actor, "scores"), scores).argmax(-1)
        (tensor([0]), tensor([1]))
    """
    return sampler.distribution_class(scores=scores, **sampler.distribution_kwargs).logits


def _distribution_keys(sampler: ProbabilisticTensorDictModule) -> dict[str, NestedKey]:
    """The keys a sampler reads, by the distribution's argument each is given as (``logits``, ``mask``, ...)."""
    dist_keys = list(getattr(sampler, "dist_keys", sampler.in_keys))
    # A nested key given in a list names its argument by its last element, as tensordict's get_dist reads it.
    return {
        (name[-1] if isinstance(name, tuple) else name): unravel_key(key)
        for name, key in zip(dist_keys, sampler.in_keys, strict=True)
    }


def allowed_action(
    operator: TensorDictModuleBase,
    target_key: NestedKey,
    result: TensorDictBase,
    tensordict: TensorDictBase,
    explained: bool = False,
    owner: str = "LRP",
) -> torch.Tensor | None:
    """The per-sample action to explain where ``target_key`` holds the logits of a categorical distribution (masked
    or not), the scores of an ordinal one (see :func:`ordinal_sampler`), or the action values of a distributional
    Q-value actor (see :func:`distributional_action`), else ``None`` (the default target applies). The action taken:
    a stored transition's (see :func:`holds_transition`), else the one the call drew into ``result``, else the best
    allowed one.

    Args:
        operator: the module whose output is explained.
        target_key: the explained key.
        result: the model's outputs (holding the logits, the mask and the action drawn).
        tensordict: the caller's TensorDict; an action it holds is the one explained where it holds a transition
            (see :func:`holds_transition`), or where ``explained``.
        explained: ``tensordict`` is the output of an explanation (a metric's input): the action it holds, written
            beside the relevance, is the one explained, where the call's own draw (``result``) may be another.
        owner: who explains, for the warning on a continuous action's dimensions (LRP, a method, the metrics).
    """
    greedy = distributional_action(operator, target_key, result)
    if greedy is not None:
        return greedy
    if _several_units_module(operator, target_key) is not None:
        raise ValueError(
            f"LRP: {target_key!r} holds the action values of a QValueModule with action space 'mult_one_hot', whose "
            "action is one unit of each of several groups: the argmax of the row names one unit, not the action. "
            "Pass a target (a LongTensor of units, or target='all'), or explain the chosen action's value (its "
            "third output key, 'chosen_action_value' by default)"
        )
    sampler = _action_sampler(operator, target_key)
    if sampler is None:
        _refuse_composite_draw(operator, target_key, tensordict, explained, owner)
        _warn_for_continuous_units(operator, target_key, result, owner)
        return None
    action_key = unravel_key(sampler.out_keys[0])
    held = holds_transition(tensordict)
    # The action taken: a stored transition's (or the one an explanation wrote), else the call's own draw.
    taken = tensordict.get(action_key, None) if held or explained else None
    held = held and taken is not None  # a transition's action, which the mask of its state must allow
    if taken is None:
        taken = result.get(action_key, None)
    one_hot = issubclass(sampler.distribution_class, _ONE_HOT)
    logits = result.get(target_key).detach()
    if isinstance(taken, torch.Tensor):  # one action per row of logits (the agents of a nested key included)
        if (taken.shape[:-1] if one_hot else taken.numel()) != (
            logits.shape[:-1] if one_hot else logits[..., 0].numel()
        ):
            one_hot_stored = not one_hot and taken.shape == logits.shape  # a one-hot action for an index policy
            raise ValueError(
                f"LRP: the action at {action_key!r} (shape {list(taken.shape)}) is not one action per row of the "
                f"logits at {target_key!r} (shape {list(logits.shape)}); it is the action explained by default"
                + (
                    f" ({sampler.distribution_class.__name__} draws an index per row, and this looks one-hot, as a "
                    "one-hot environment's random frames store it: pass target=td['action'].argmax(-1), or use a "
                    "one-hot distribution, OneHotCategorical)"
                    if one_hot_stored
                    else "; pass a target to explain another unit"
                )
            )
        action = taken.long().argmax(-1) if one_hot else taken.long().reshape(logits.shape[:-1])
        outside = (action < 0) | (action >= logits.shape[-1])
        if outside.any():  # a padding value (-1), or actions of another head: no unit of these logits
            raise ValueError(
                f"LRP: the action at {action_key!r}, explained by default as the action taken, holds "
                f"{sorted(set(action[outside].tolist()))[:5]} in rows {outside.nonzero()[:5].tolist()}, outside the "
                f"{logits.shape[-1]} actions of the logits at {target_key!r}; pass a target to explain another unit"
            )
        if held:
            _raise_for_forbidden(operator, target_key, result, action, action_key)
        return action
    if issubclass(sampler.distribution_class, _ORDINAL):  # its action is the argmax of the ordinal log-probabilities
        logits = ordinal_logits(sampler, logits)
    mask = allowed_mask(operator, target_key, result)
    return logits.argmax(-1) if mask is None else logits.masked_fill(~mask, float("-inf")).argmax(-1)


def held_action_record(
    operator: TensorDictModuleBase, target_key: NestedKey, result: TensorDictBase, tensordict: TensorDictBase
) -> dict[NestedKey, torch.Tensor]:
    """What a call writes back where :func:`allowed_action` explains the action a stored transition holds: the
    transition's action, and its log-probability, in place of the ones the policy drew again in the call. The
    relevance written is that action's; a new draw beside it (a random sample, or the greedy action where the
    transition's was exploratory) would stand for an action no relevance was computed for, and a metric reading the
    TensorDict would score it. A log-probability the transition does not hold is that of its action under the
    distribution of the call. Empty where no held action is explained.

    Examples:
        >>> from tensordict import TensorDict
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl.modules import ProbabilisticActor
        >>> actor = ProbabilisticActor(
        ...     TensorDictModule(nn.Identity(), in_keys=["observation"], out_keys=["logits"]),
        ...     in_keys={"logits": "logits", "mask": "action_mask"}, distribution_class=MaskedCategorical,
        ... )
        >>> step = TensorDict(observation=torch.tensor([[0.0, 5.0, 1.0]]), action=torch.tensor([0]),
        ...                   action_mask=torch.tensor([[True, True, True]]), batch_size=[1])
        >>> result = step.clone().set("action", torch.tensor([1])).set("logits", step["observation"])
        >>> held_action_record(actor, "logits", result, step)  # a live step: no action held
        {}
        >>> held_action_record(actor, "logits", result, step.set("next", step.select("observation")))
        {'action': tensor([0])}
    """
    sampler = _action_sampler(operator, target_key)
    if sampler is None or not holds_transition(tensordict):
        return {}
    action_key = unravel_key(sampler.out_keys[0])
    taken = tensordict.get(action_key, None)
    if not isinstance(taken, torch.Tensor):
        return {}
    record: dict[NestedKey, torch.Tensor] = {action_key: taken}
    for key in map(unravel_key, sampler.out_keys[1:]):
        held = tensordict.get(key, None)
        if isinstance(held, torch.Tensor):
            record[key] = held
        elif isinstance(result.get(key, None), torch.Tensor):  # the log-probability of the new draw
            with torch.no_grad():
                record[key] = sampler.get_dist(result).log_prob(taken.to(result.get(action_key, taken).dtype))
    return record


def _several_units_module(operator: TensorDictModuleBase, target_key: NestedKey) -> QValueModule | None:
    """The ``QValueModule`` of action space ``"mult_one_hot"`` whose action values ``target_key`` holds, or
    ``None``."""
    return _found_once(operator, target_key, _find_several_units_module)


def _find_several_units_module(operator: TensorDictModuleBase, target_key: NestedKey) -> QValueModule | None:
    key = unravel_key(target_key)
    for sub in operator.modules():
        if type(sub) is QValueModule and sub.action_space == "mult_one_hot" and len(sub.out_keys) > 1:
            if key == unravel_key(sub.out_keys[1]):
                return sub
    return None


def distributional_module(operator: TensorDictModuleBase, target_key: NestedKey) -> DistributionalQValueModule | None:
    """The torchrl ``DistributionalQValueModule`` of ``operator`` whose action values are at ``target_key``, or
    ``None``."""
    return _found_once(operator, target_key, _find_distributional_module)


def _find_distributional_module(
    operator: TensorDictModuleBase, target_key: NestedKey
) -> DistributionalQValueModule | None:
    key = unravel_key(target_key)
    for sub in operator.modules():
        if isinstance(sub, DistributionalQValueModule):
            if key in {unravel_key(k) for k in (sub.action_value_key, *sub.out_keys[1:2])}:
                return sub
    return None


def distributional_action(
    operator: TensorDictModuleBase, target_key: NestedKey, result: TensorDictBase
) -> torch.Tensor | None:
    """The greedy action at every atom where ``target_key`` holds the action values of torchrl's
    ``DistributionalQValueModule`` (log-probabilities ``[*batch, atoms, actions]``), else ``None``.

    The greedy action is the one whose expected return over the module's support is highest, computed as the
    module computes it (from the values it wrote, masked where it reads a mask), not read from the action key: an
    exploration step after the actor (``EGreedyModule``) may have replaced it.

    Raises:
        ValueError: the module's action space is ``"mult_one_hot"``: its actions are several units of each row,
            which no per-row index can name; pass a target.

    Examples:
        >>> from tensordict import TensorDict
        >>> from torchrl.modules import DistributionalQValueActor
        >>> support = torch.tensor([-1.0, 0.0, 1.0])
        >>> actor = DistributionalQValueActor(
        ...     nn.Identity(), in_keys=["observation"], support=support, action_space="categorical")
        >>> values = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.2, 0.7], [0.2, 0.6, 0.2]]).log()  # atoms x actions
        >>> result = actor(TensorDict(observation=values[None], batch_size=[1]))
        >>> values.argmax(-1)  # the action most likely at each atom: 0, 2 and 1
        tensor([0, 2, 1])
        >>> distributional_action(actor, "action_value", result)  # action 1: the highest expected return
        tensor([[1, 1, 1]])
    """
    module = distributional_module(operator, target_key)
    if module is None:
        return None
    if module.action_space not in ("one_hot", "categorical"):
        raise ValueError(
            f"LRP: {target_key!r} holds the action values of {type(module).__name__} with action space "
            f"{module.action_space!r}, whose action is several units of each row: pass a target (a callable "
            "weighting the chosen units)"
        )
    written = module.out_keys[1] if len(module.out_keys) > 1 else module.action_value_key
    values = result.get(written, None)
    values = result.get(target_key) if values is None else values
    values = values.detach()
    greedy = module._support_expected(values).argmax(-1)
    return greedy.unsqueeze(-1).expand(values.shape[:-1])


_STORED_ROWS: ContextVar[bool] = ContextVar("tdhook_stored_rows", default=False)


def holds_transition(tensordict: TensorDictBase) -> bool:
    """Whether ``tensordict`` is a stored transition, whose action is the one taken in its state: it holds
    ``"next"``, as the TensorDicts of torchrl's rollouts, collectors and replay buffers do, or it is a batch of rows
    read from storage (see :func:`stored_rows`). The TensorDict a rollout or a collector gives the policy at a step
    holds the previous step's action (``step_mdp`` keeps it), and no ``"next"``.

    Examples:
        >>> from tensordict import TensorDict
        >>> step = TensorDict(observation=torch.zeros(2, 4), action=torch.zeros(2, dtype=torch.long), batch_size=[2])
        >>> holds_transition(step), holds_transition(step.set("next", step.select("observation")))
        (False, True)
    """
    return _STORED_ROWS.get() or "next" in tensordict.keys()


@contextmanager
def stored_rows() -> Iterator[None]:
    """Calls made inside read rows from storage (a data set, a replay buffer): an action a row holds is the one
    taken in its state, with or without ``"next"`` (see :func:`holds_transition`). ``explain_offline`` runs its
    batches inside.

    Examples:
        >>> from tensordict import TensorDict
        >>> row = TensorDict(observation=torch.zeros(2, 4), action=torch.zeros(2, dtype=torch.long), batch_size=[2])
        >>> with stored_rows():
        ...     holds_transition(row)
        True
    """
    token = _STORED_ROWS.set(True)
    try:
        yield
    finally:
        _STORED_ROWS.reset(token)


def _raise_for_forbidden(
    operator: TensorDictModuleBase,
    target_key: NestedKey,
    result: TensorDictBase,
    action: torch.Tensor,
    action_key: NestedKey,
) -> None:
    """Refuse a transition's action that the mask of the same TensorDict forbids: no policy took it under that
    mask (the action and the mask are of different steps)."""
    mask = allowed_mask(operator, target_key, result)
    if mask is None:
        return
    # Rows that allow no action (the padding of split trajectories) have no action taken to tell apart.
    forbidden = ~mask.gather(-1, action.unsqueeze(-1)).squeeze(-1) & mask.any(-1)
    if forbidden.any():
        keys = _distribution_keys(_masked_sampler(operator, target_key))
        mask_key = keys.get("mask", keys.get("indices"))
        where = f" at rows {[tuple(row) for row in forbidden.nonzero().tolist()[:5]]}" if forbidden.dim() else ""
        raise ValueError(
            f"LRP: the action at {action_key!r}, explained by default as the action taken, is forbidden by the mask "
            f"at {mask_key!r}{where}: it was not taken under that mask (a stored transition, whose action is explained "
            "as the one taken in its state); pass a target to explain another action"
        )


def masked_action_keys(module: object) -> list[NestedKey]:
    """The keys where the masked distributions of ``module`` write their actions: an action a TensorDict holds
    there is the one explained by default (see :func:`allowed_action`).

    Examples:
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl.modules import MaskedCategorical, ProbabilisticActor
        >>> net = TensorDictModule(nn.Linear(4, 3), in_keys=["observation"], out_keys=["logits"])
        >>> actor = ProbabilisticActor(
        ...     net, in_keys={"logits": "logits", "mask": "action_mask"}, distribution_class=MaskedCategorical
        ... )
        >>> masked_action_keys(actor), masked_action_keys(net)
        (['action'], [])
    """
    if not isinstance(module, nn.Module):
        return []
    return [
        unravel_key(sub.out_keys[0])
        for sub in module.modules()
        if isinstance(sub, ProbabilisticTensorDictModule) and issubclass(sub.distribution_class, _MASKED)
    ]


def allowed_mask(operator: TensorDictModuleBase, target_key: NestedKey, result: TensorDictBase) -> torch.Tensor | None:
    """The boolean mask of the allowed actions where ``target_key`` holds the logits (or probabilities) of a masked
    distribution that reads a mask, or the indices of the allowed actions (entries equal to the distribution's
    ``padding_value`` left out), read from ``result``; else ``None``.

    Examples:
        >>> from tensordict import TensorDict
        >>> from tensordict.nn import TensorDictModule
        >>> plain = TensorDictModule(nn.Linear(4, 3), in_keys=["observation"], out_keys=["logits"])
        >>> allowed_mask(plain, "logits", TensorDict(batch_size=[1])) is None  # no masked distribution
        True
    """
    sampler = _masked_sampler(operator, target_key)
    if sampler is None:
        return None
    keys = _distribution_keys(sampler)
    if "mask" in keys:
        return result.get(keys["mask"]).to(torch.bool)
    if "indices" not in keys:
        return None
    indices = result.get(keys["indices"]).long()
    padding = sampler.distribution_kwargs.get("padding_value")
    listed = torch.ones_like(indices) if padding is None else (indices != padding).long()
    counts = torch.zeros(result.get(target_key).shape, dtype=torch.long, device=indices.device)
    return counts.scatter_add_(-1, indices.masked_fill(listed == 0, 0), listed) > 0


def default_target_operator(module: TensorDictModuleBase) -> TensorDictModuleBase:
    """The module whose outputs give ``module``'s default target: a decision transformer's actor for its inference
    wrapper (the wrapper writes its inputs back, so its own keys name no output), else ``module`` itself."""
    if isinstance(module, DecisionTransformerInferenceWrapper):
        return module.td_module
    return module


def acted_step(operator: TensorDictModuleBase, key: NestedKey, output: torch.Tensor) -> torch.Tensor:
    """``output`` at the step the policy acts on: the last context step where ``operator`` is a
    ``DecisionTransformerInferenceWrapper`` and ``key`` one of its actor's per-step outputs, else ``output``.

    The wrapper cuts its action output (and the return-to-go) to the last step itself; its actor's other
    outputs (``param``, ``loc``, ``scale``) keep the context's time dimension, second to last.
    """
    if not isinstance(operator, DecisionTransformerInferenceWrapper) or output.dim() < 2:
        return output
    key = unravel_key(key)
    cut = {unravel_key(operator.out_action_key), unravel_key(operator.return_to_go_key)}
    per_step = {unravel_key(k) for k in operator.td_module.out_keys} - cut
    return output[..., -1, :] if key in per_step else output
