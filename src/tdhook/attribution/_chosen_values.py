"""The value of the greedy action (torchrl's ``chosen_action_value``): a score whose action a perturbation may change.

A ``QValueModule`` writes the action values, the greedy action and that action's value. Explained at an input,
the chosen value is the value of the action chosen there; on a perturbed input it is the value of whatever action
is greedy there, so a curve of it would switch from one action to another. The metrics score instead the value of
the action chosen on the unperturbed input, a fixed unit of the action values: the quantity the explanation is
about, as the argmax of ``None`` targets stays fixed. The attribution methods that evaluate perturbed inputs (path,
sampling and perturbation methods) explain that value too, as LRP and the gradient at the input do.

Examples:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from torchrl.modules import QValueActor
    >>> actor = QValueActor(torch.nn.Linear(3, 2), in_keys=["observation"], spec=None, action_space="one_hot")
    >>> result = actor(TensorDict(observation=torch.randn(4, 3), batch_size=[4]))
    >>> key, index = chosen_action(actor, "chosen_action_value", result)
    >>> key, torch.equal(result["action_value"].gather(-1, index[:, None]), result["chosen_action_value"])
    ('action_value', True)
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey, unravel_key
from torchrl.modules import QValueModule

__all__ = ["chosen_action", "chosen_value_module"]


def chosen_value_module(module: TensorDictModuleBase, key: NestedKey) -> QValueModule | None:
    """The ``QValueModule`` in ``module`` that writes the chosen action's value at ``key``, or ``None``."""
    key = unravel_key(key)
    for sub in module.modules():
        if isinstance(sub, QValueModule) and len(sub.out_keys) > 2 and unravel_key(sub.out_keys[2]) == key:
            return sub
    return None


def chosen_action(
    module: TensorDictModuleBase, key: NestedKey, result: TensorDictBase, name: str = "LRP"
) -> tuple[NestedKey, torch.Tensor] | None:
    """Where ``key`` is a chosen action's value: the key of the action values and the index of the action chosen
    in ``result`` (per sample: the module writes the action values of forbidden actions as the lowest float, so
    that their argmax is the greedy allowed action); else ``None``.

    Raises:
        ValueError: the module's action space is ``"mult_one_hot"``, whose action is one unit of each of several
            groups of the action values: no index per sample names it (``name`` begins the message).
    """
    found = chosen_value_module(module, key)
    if found is None:
        return None
    if found.action_space == "mult_one_hot":
        raise ValueError(
            f"{name}: {key!r} is the value of the action of a QValueModule with action space 'mult_one_hot', one unit "
            f"of each group of {found.out_keys[1]!r}: the value a perturbed input gives would follow its own greedy "
            "units, and no index per sample names the chosen ones. Pass target_key and a target (a LongTensor of "
            "units of one group, or target='all'), or explain it with LRP or the gradient methods, which take the "
            "value at the input only"
        )
    values_key = unravel_key(found.out_keys[1])
    return values_key, result.get(values_key).detach().argmax(-1)  # masked already where the module reads a mask
