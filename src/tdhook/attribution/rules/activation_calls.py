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

torchrl's tanh-squashed distributions (``TanhNormal``, ``TanhDelta``) compute
their tanh in a custom autograd Function (``safetanh``: tanh clamped just inside
(-1, 1)), whose forward runs without gradients and whose backward is the plain
one. :class:`SafeTanhCallsRule` acts inside the forward of the probabilistic
module that samples from them: it notes the input of each such tanh, and gives
the Function's output the pass rule wherever the forward uses it (the affine
map onto the action bounds) and where the module writes it (an action in
(-1, 1)); a plain ``tanh`` (the distributions built with ``safe_tanh=False`` or
``safe=False``) gets it as in ``TanhModule``. An actor explained on its action (``TanhDelta``, DDPG's actor; a
``TanhNormal`` acting deterministically) then conserves it as through
``TanhModule``. The module's other calls (a log-probability's) keep their plain
gradient, and are reported as for a module without a rule.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from tensordict import TensorDictBase
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from tdhook.attribution.rules._arguments import nonnegative
from tdhook.attribution.rules._autograd import raise_for_transformed_call
from tdhook.attribution.rules.base import RemovableRuleHandle, Rule
from tdhook.attribution.rules.basic import PassRule

__all__ = ["SafeTanhCallsRule", "TanhCallsRule", "samples_a_safe_tanh"]

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


# torchrl's custom Functions of a tanh clamped just inside (-1, 1) (``torchrl.modules.distributions.utils``).
_SAFE_TANH_FUNCTIONS = frozenset({"_SafeTanh", "_SafeTanhNoEps"})


def samples_a_safe_tanh(module: nn.Module) -> bool:
    """Whether ``module`` samples from one of torchrl's tanh-squashed distributions (``TanhNormal``, ``TanhDelta``,
    a subclass of either): the modules :class:`SafeTanhCallsRule` is for.

    Examples:
        >>> from tensordict.nn import ProbabilisticTensorDictModule
        >>> from torchrl.modules import OneHotCategorical, TanhNormal
        >>> def head(cls):
        ...     return ProbabilisticTensorDictModule(in_keys=["loc", "scale"], distribution_class=cls)
        >>> samples_a_safe_tanh(head(TanhNormal)), samples_a_safe_tanh(head(OneHotCategorical))
        (True, False)
    """
    from tensordict.nn import ProbabilisticTensorDictModule
    from torchrl.modules import TanhDelta, TanhNormal

    if not isinstance(module, ProbabilisticTensorDictModule):
        return False
    distribution = getattr(module, "distribution_class", None)
    return isinstance(distribution, type) and issubclass(distribution, (TanhNormal, TanhDelta))


def _is_safe_tanh(node: Any) -> bool:
    function = getattr(node, "_forward_cls", None)
    return (
        function is not None
        and function.__name__ in _SAFE_TANH_FUNCTIONS
        and function.__module__.startswith("torchrl.")
    )


class _PassSafeTanh(TorchFunctionMode):
    """The mode a ruled module's forward runs in: the output of each ``safetanh`` Function of an activation gets the
    pass rule from the Function's input wherever the forward then uses it, and where the module writes it."""

    def __init__(self, rule: PassRule) -> None:
        super().__init__()
        self.rule = rule
        self._squashed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # a tanh inside a Function: its input
        self._outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # a clamp of it: the Function's output
        self._passed: dict[int, torch.Tensor] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # The calls run on through the modes outside this one: the wrapper's watch of nonlinear calls sees the
        # module's other calls (a log-probability's) as in a module without a rule.
        kwargs = kwargs or {}
        if torch.is_grad_enabled():
            if self._outputs:
                args, kwargs = tree_map(self.passed, (args, kwargs))
            result = func(*args, **kwargs)
            x = args[0] if args else None
            if func in _TANH and isinstance(x, torch.Tensor) and x.requires_grad:  # the distribution built unsafe
                with torch._C.DisableTorchFunction():
                    return self.rule.apply(result, x)
            if func in _TANH:  # under torch.vmap the input reports no gradient: refused, not passed plainly
                raise_for_transformed_call("the pass rule on tanh", args[:1])
            return result
        # Without gradients: the forward of a custom Function (or a block the model runs under no_grad).
        result = func(*args, **kwargs)
        x = args[0] if args else None
        if not (isinstance(x, torch.Tensor) and isinstance(result, torch.Tensor)):
            return result
        if func in _TANH and x.requires_grad:
            self._squashed[id(result)] = (result, x)
        elif func in _CLAMPS and id(x) in self._squashed and self._squashed[id(x)][0] is x:
            self._outputs[id(result)] = (result, self._squashed[id(x)][1])
        return result

    def passed(self, value: Any) -> Any:
        """``value`` with the pass rule's gradient where it is the output of a ``safetanh`` Function seen here."""
        if not isinstance(value, torch.Tensor):
            return value
        found = self._outputs.get(id(value))
        if found is None or found[0] is not value or not _is_safe_tanh(value.grad_fn):
            return value
        if id(value) not in self._passed:
            raise_for_transformed_call("the pass rule on tanh", (found[1],))
            with torch._C.DisableTorchFunction():
                # On a copy: the Function's node saved its output, which other calls (a log-probability's inverse
                # tanh, another Function) may still take their gradient through.
                self._passed[id(value)] = self.rule.apply(value.clone(), found[1])
        return self._passed[id(value)]


def _write_passed(module: nn.Module, args: tuple, output: Any, mode: _PassSafeTanh) -> Any:
    """The module's outputs that are a ``safetanh`` Function's output itself (an action in (-1, 1)), with the pass
    rule's gradient."""
    if not isinstance(output, TensorDictBase):
        return None
    for key in getattr(module, "out_keys", ()):
        value = output.get(key, None)
        passed = mode.passed(value)
        if passed is not value:
            output.set(key, passed)
    return None


class SafeTanhCallsRule(TanhCallsRule):
    """The pass rule on the tanh of torchrl's tanh-squashed distributions (``TanhNormal``, ``TanhDelta``), which a
    probabilistic module computes in a custom autograd Function (``safetanh``).

    The module's other calls keep their plain gradient (and are reported where they are not piecewise linear).

    Args:
        stabilizer: the pass rule's stabilizer of the input.

    Examples:
        >>> from tensordict import TensorDict
        >>> from tensordict.nn import ProbabilisticTensorDictModule
        >>> from torchrl.envs.utils import ExplorationType, set_exploration_type
        >>> from torchrl.modules import TanhNormal
        >>> sampler = ProbabilisticTensorDictModule(
        ...     in_keys=["loc", "scale"], out_keys=["action"], distribution_class=TanhNormal
        ... )
        >>> loc = torch.tensor([[2.0, -0.3]], requires_grad=True)
        >>> inputs = TensorDict(loc=loc, scale=torch.ones(1, 2), batch_size=[1])
        >>> with SafeTanhCallsRule().register(sampler), set_exploration_type(ExplorationType.DETERMINISTIC):
        ...     mean_action = sampler(inputs)["action"]  # tanh(loc), acting deterministically
        ...     (gradient,) = torch.autograd.grad(mean_action.sum(), loc)
        >>> torch.allclose(loc * gradient, mean_action)  # the relevance of loc: the action, whole
        True
    """

    decides_every_call = False  # the module's other calls (a log-probability's) are watched as without a rule

    def register(self, module: nn.Module) -> RemovableRuleHandle:
        return self._register_in_forward(module, lambda mod: _PassSafeTanh(self._pass), _write_passed)
