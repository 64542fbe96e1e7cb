"""Targets drawn at random: a probabilistic module (a torchrl ``ProbabilisticActor``) sampling its action, or a
torchrl exploration step (``AdditiveGaussianModule``, ``OrnsteinUhlenbeckProcessModule``, ``EGreedyModule``) that
perturbs it.

A method that runs the model again on perturbed copies compares outputs of
separate forward passes. Where the explained output is drawn at random (the
sampled action under ``InteractionType.RANDOM``, as in a collector, its
log-probability, or anything computed from them; the action an exploration
step perturbs while exploration is random or unset, as in ``env.rollout``),
every pass draws anew, and
the differences are those of independent draws rather than of the
perturbation; the user is told once.

Examples:
    >>> import torch
    >>> from tensordict.nn import InteractionType, NormalParamExtractor, TensorDictModule, set_interaction_type
    >>> from torchrl.modules import ProbabilisticActor, TanhNormal
    >>> net = TensorDictModule(
    ...     torch.nn.Sequential(torch.nn.Linear(3, 4), NormalParamExtractor()), ["obs"], ["loc", "scale"]
    ... )
    >>> actor = ProbabilisticActor(net, in_keys=["loc", "scale"], distribution_class=TanhNormal)
    >>> sampled_target(actor, "action") is None, sampled_target(actor, "loc") is None
    (True, True)
    >>> with set_interaction_type(InteractionType.RANDOM):
    ...     sampled_target(actor, "action")
    "module 'module.1' (SafeProbabilisticModule) draws 'action' at random"
"""

from __future__ import annotations

from tensordict.nn import InteractionType, ProbabilisticTensorDictModule, TensorDictModuleBase
from tensordict.nn.probabilistic import interaction_type
from tensordict.utils import NestedKey, unravel_key, unravel_key_list
from torch import nn

from tdhook.attribution._policy_targets import EXPLORATION_MODULES

__all__ = ["exploration_draws", "sampled_target"]


def _draws_at_random(module: ProbabilisticTensorDictModule) -> bool:
    return (interaction_type() or module.default_interaction_type) == InteractionType.RANDOM


def exploration_draws(module: nn.Module) -> bool:
    """Whether ``module`` is a torchrl exploration step that perturbs the action it writes with a draw now.

    Examples:
        >>> from torchrl.data import Bounded
        >>> from torchrl.envs.utils import ExplorationType, set_exploration_type
        >>> from torchrl.modules import AdditiveGaussianModule
        >>> noise = AdditiveGaussianModule(spec=Bounded(-1.0, 1.0, (1,)))
        >>> exploration_draws(noise)
        True
        >>> with set_exploration_type(ExplorationType.DETERMINISTIC):
        ...     exploration_draws(noise)
        False
    """
    # torchrl's exploration steps draw while exploration is random or unset (``exploration_type() in (RANDOM, None)``).
    return isinstance(module, EXPLORATION_MODULES) and interaction_type() in (InteractionType.RANDOM, None)


def sampled_target(root: nn.Module, target_key: NestedKey) -> str | None:
    """Where ``target_key`` is drawn at random in the modules of ``root`` (in the order they run), or ``None``.

    A key is drawn at random when a probabilistic module sampling at random now
    writes it (the sample or its log-probability), or an exploration step that
    draws now (exploration random or unset) writes it, or when a later module reads
    a key drawn at random and writes it.

    Args:
        root: the wrapped model.
        target_key: the explained output.

    Returns:
        A description naming the sampling module and the key it draws, or ``None``.
    """
    drawn: dict[NestedKey, str] = {}
    for name, module in root.named_modules():
        if isinstance(module, ProbabilisticTensorDictModule):
            if _draws_at_random(module):
                for key in unravel_key_list(list(module.out_keys)):
                    drawn[key] = f"module {name!r} ({type(module).__name__}) draws {key!r} at random"
        elif isinstance(module, EXPLORATION_MODULES):
            if exploration_draws(module):
                for key in unravel_key_list(list(module.out_keys)):
                    drawn[key] = f"module {name!r} ({type(module).__name__}) draws {key!r} at random"
        elif isinstance(module, TensorDictModuleBase):  # a container too: what it writes may come from the draw
            sources = [drawn[k] for k in unravel_key_list(list(module.in_keys)) if k in drawn]
            if sources:
                for key in unravel_key_list(list(module.out_keys)):
                    drawn.setdefault(key, sources[0])
    return drawn.get(unravel_key(target_key))
