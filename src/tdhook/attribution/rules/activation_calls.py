"""Modules whose own forward calls ``tanh`` on a signal: the pass rule on each such call.

torchrl's ``TanhModule`` (the last step of TD3 and DDPG actors) reads a key of a
TensorDict, computes ``tanh`` and maps the result affinely onto the action
bounds. It is no activation module that :class:`~tdhook.attribution.rules.basic.PassRule`
could be registered on: its input and output are TensorDicts. :class:`TanhCallsRule`
acts inside its forward, as the pass rule would on an ``nn.Tanh``: relevance passes
through ``tanh`` unchanged, and the affine map to the bounds keeps its plain
gradient, a layer whose offset (the middle of the bounds) is a bias. With bounds
symmetric about zero the action's relevance is conserved. The clamp that
``TanhModule(clamp=True)`` puts just inside (-1, 1) passes relevance too: its zero
gradient on saturated values would drop their relevance.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from tdhook.attribution.rules._arguments import nonnegative
from tdhook.attribution.rules._autograd import raise_for_transformed_call
from tdhook.attribution.rules.base import RemovableRuleHandle, Rule
from tdhook.attribution.rules.basic import PassRule

__all__ = ["TanhCallsRule"]

_TANH = frozenset({torch.tanh, torch.Tensor.tanh, F.tanh})
# Clamps just inside (-1, 1) after the tanh (``TanhModule(clamp=True)``): their gradient is zero on saturated
# values, which would drop the relevance of every saturated action.
_CLAMPS = frozenset({torch.clamp, torch.Tensor.clamp, torch.clip, torch.Tensor.clip})
_PASSED = _TANH | _CLAMPS


class _PassTanh(TorchFunctionMode):
    """The mode a ruled module's forward runs in: every ``tanh`` (and clamp) of a tensor that requires grad gets the
    pass rule."""

    def __init__(self, rule: PassRule) -> None:
        super().__init__()
        self.rule = rule

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunction():
            result = func(*args, **kwargs)
            x = args[0] if args else None
            if func in _PASSED:  # under torch.vmap the input reports no gradient: refused, not passed plainly
                raise_for_transformed_call("the pass rule on tanh", args[:1])
            if func in _PASSED and isinstance(x, torch.Tensor) and x.requires_grad:
                return self.rule.apply(result, x)
            return result


class TanhCallsRule(Rule):
    """The pass rule on every ``tanh`` that a module's own forward computes (torchrl's ``TanhModule``).

    Args:
        stabilizer: the pass rule's stabilizer of the input.

    Examples:
        >>> from tensordict import TensorDict
        >>> from torchrl.modules import TanhModule
        >>> squash = TanhModule(in_keys=["param"], out_keys=["action"])
        >>> param = torch.tensor([[-1.0, 0.5]], requires_grad=True)
        >>> with TanhCallsRule().register(squash):
        ...     action = squash(TensorDict(param=param, batch_size=[1]))["action"]
        >>> relevance = param * torch.autograd.grad(action, param, torch.ones(1, 2))[0]
        >>> torch.allclose(relevance, action)
        True
    """

    uses_input = False
    acts_in_forward = True
    differentiable = True

    def __init__(self, stabilizer: float = 1e-12) -> None:
        nonnegative(type(self).__name__, "stabilizer", stabilizer)
        super().__init__()
        self.stabilizer = stabilizer
        self._pass = PassRule(stabilizer)

    def register(self, module: nn.Module) -> RemovableRuleHandle:
        return self._register_in_forward(module, lambda mod: _PassTanh(self._pass))
