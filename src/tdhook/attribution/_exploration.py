"""Exploration steps after an actor, inside an LRP context: the perturbation they make is a constant of the call.

torchrl's ``AdditiveGaussianModule`` and ``OrnsteinUhlenbeckProcessModule``
add noise to the action an actor wrote and project the result into the action
spec (a clamp for a bounded spec). The action taken is explained, with the
whole perturbation, noise and projection, held constant: the gradient of the
action taken is that of the actor's action. Without this, a step whose noisy
action reached a bound would get no relevance at all (the clamp's gradient is
zero there), while the same step inside the bounds gets the actor's.

Examples:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from torchrl.data import Bounded
    >>> from torchrl.modules import AdditiveGaussianModule
    >>> noise = AdditiveGaussianModule(spec=Bounded(-1.0, 1.0, (1,)), sigma_init=10.0)
    >>> hooks = perturbation_held_constant({"noise": noise})
    >>> action = torch.zeros(4, 1, requires_grad=True)
    >>> taken = noise(TensorDict(action=action, batch_size=[4]))["action"]
    >>> bool((taken.abs() == 1).any()), torch.autograd.grad(taken.sum(), action)[0].flatten().tolist()
    (True, [1.0, 1.0, 1.0, 1.0])
    >>> for hook in hooks:
    ...     hook.remove()
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import nn
from torch.utils.hooks import RemovableHandle
from torchrl.modules import AdditiveGaussianModule, OrnsteinUhlenbeckProcessModule

from tdhook.attribution.rules._autograd import redirect
from tdhook.attribution.rules._wrapper_calls import rules_act_here

__all__ = ["perturbation_held_constant"]

# Exploration steps that perturb the floating-point action they read (their first in_key) and write it back;
# EGreedyModule picks integer actions instead.
_PERTURBING = (AdditiveGaussianModule, OrnsteinUhlenbeckProcessModule)


def _tensordict(args: tuple, kwargs: dict) -> TensorDictBase | None:
    found = args[0] if args else kwargs.get("tensordict")
    return found if isinstance(found, TensorDictBase) else None


def perturbation_held_constant(modules: Mapping[str, nn.Module], into: list | None = None) -> list[RemovableHandle]:
    """Make every perturbing exploration step among ``modules`` write its action with the gradient of the action
    it read; the returned hook handles end it. With ``into``, each handle is appended to it as soon as its hook is
    registered (a registration that fails then leaves none unlisted), and ``into`` is returned."""
    hooks: list[RemovableHandle] = [] if into is None else into
    for module in modules.values():
        if not isinstance(module, _PERTURBING):
            continue
        read: dict[int, torch.Tensor] = {}

        def before(step: nn.Module, args: tuple, kwargs: dict, read: dict = read) -> None:
            if not rules_act_here():  # the model's own call, in an open context: as it is
                return
            td = _tensordict(args, kwargs)
            action = td.get(step.in_keys[0], None) if td is not None else None
            if isinstance(action, torch.Tensor) and action.requires_grad:
                read[id(td)] = action

        def after(step: nn.Module, args: tuple, kwargs: dict, output: Any, read: dict = read) -> None:
            td = _tensordict(args, kwargs)
            action = read.pop(id(td), None) if td is not None else None
            if action is None or not isinstance(output, TensorDictBase):
                return
            taken = output.get(step.in_keys[0], None)
            if isinstance(taken, torch.Tensor) and taken is not action and taken.shape == action.shape:
                output.set(step.in_keys[0], redirect(taken, [action], lambda grad: [grad]))

        hooks.append(module.register_forward_pre_hook(before, with_kwargs=True))
        hooks.append(module.register_forward_hook(after, with_kwargs=True, always_call=True))
    return hooks
