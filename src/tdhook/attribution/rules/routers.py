"""The router of a mixture of experts: found by what its forward selects, and held constant."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: F401  (the examples' router)
from torch import nn

from tdhook.attribution.rules._autograd import hold
from tdhook.attribution.rules._layers import LINEAR_LAYERS
from tdhook.attribution.rules.base import RemovableRuleHandle, Rule, rules_apply

__all__ = ["RouterRule", "is_router", "is_router_layer"]

# Class names of routers whose forward selects experts without ``topk`` (by ``max`` in a helper, as PhiMoE).
_ROUTER_NAMES = ("Router",)
# Class names of routers that hold their projection and select by ``topk`` (JetMoE's ``TopKGating``, HunYuan's gate).
_GATE_NAMES = ("Gate", "Gating")


def is_router(module: nn.Module) -> bool:
    """Whether ``module`` routes tokens to experts: its forward selects the top k of its scores
    (``torch.topk``), or it is a Hugging Face class named a router (``PhimoeTopKRouter`` selects by ``max`` in a
    helper function); and it holds no layer besides itself (the mixture around it holds the experts; a
    router may itself be a ``Linear``, as Llama 4's is), or, named a router, one: its projection (DBRX's; and
    JetMoE's and HunYuan's, named gates, which select by ``topk``).

    Examples:
        >>> class Router(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.weight = nn.Parameter(torch.randn(4, 8))
        ...     def forward(self, x):
        ...         return torch.topk(torch.softmax(F.linear(x, self.weight), -1), 2, dim=-1)
        >>> class LinearRouter(nn.Linear):
        ...     def forward(self, x):
        ...         return torch.topk(super().forward(x), 2, dim=-1)
        >>> is_router(Router()), is_router(LinearRouter(8, 4)), is_router(nn.Linear(8, 4))
        (True, True, False)
    """
    layers = sum(isinstance(sub, LINEAR_LAYERS) for sub in module.modules() if sub is not module)
    code = getattr(type(module).forward, "__code__", None)
    selects = code is not None and "topk" in code.co_names
    if selects and not layers:
        return True
    # By name only in Hugging Face's classes: a user's module named a router may well be a branch of the signal.
    name = type(module).__name__
    named = name.endswith(_ROUTER_NAMES) or (selects and name.endswith(_GATE_NAMES))
    return named and type(module).__module__.startswith("transformers.") and layers <= 1  # its projection (DBRX's)


def is_router_layer(name: str, module: nn.Module, parent: nn.Module | None) -> bool:
    """Whether ``module`` is a ``Linear`` layer that a Hugging Face class holds as its router (an attribute named
    ``…router``, as Gemma 3n's AltUp holds ``modality_router``, whose outputs mix its inputs with coefficients, as
    routing weights mix experts); a class that is a router itself (see :func:`is_router`) holds its projection.

    Examples:
        >>> class AltUp(nn.Module):  # a Hugging Face class in transformers' package
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.modality_router = nn.Linear(8, 2)
        >>> AltUp.__module__ = "transformers.models.gemma3n.modeling_gemma3n"
        >>> is_router_layer("altup.modality_router", AltUp().modality_router, AltUp())
        True
        >>> AltUp.__module__ = "my_model"  # a user's module named a router may be a branch of the signal
        >>> is_router_layer("altup.modality_router", AltUp().modality_router, AltUp())
        False
    """
    if parent is None or not isinstance(module, nn.Linear) or is_router(parent):
        return False
    named = name.rpartition(".")[2].lower().endswith("router")
    return named and type(parent).__module__.startswith("transformers.")


class RouterRule(Rule):
    """The router of a mixture of experts: its outputs (router logits, routing weights) are held constant.

    The routing is unchanged: the same experts are chosen with the same weights.
    The weights multiply the experts' outputs, and held constant they act as the
    gates of :class:`GateRule` do (signal-take-all): the mixture's relevance
    flows through the experts only, none through the router, and relevance is
    conserved through the weighted sum of the experts.

    Examples:
        >>> class Router(nn.Module):
        ...     def forward(self, x):
        ...         weights, index = torch.topk(torch.softmax(x, -1), 1, dim=-1)
        ...         return weights, index
        >>> x = torch.randn(3, 4, requires_grad=True)
        >>> router = Router()
        >>> with RouterRule().register(router):
        ...     weights, index = router(x)
        >>> weights.requires_grad, torch.equal(weights, torch.softmax(x, -1).max(-1, keepdim=True).values)
        (False, True)
    """

    uses_input = False
    differentiable = True

    def register(self, module: nn.Module) -> RemovableRuleHandle:
        if module in self._registrations:
            raise ValueError(f"{self!r} is already registered on this {type(module).__name__}")
        registration = self._new_registration(module)

        def hold(mod: nn.Module, args: tuple, output: Any) -> Any:
            if not rules_apply(mod):
                return None
            return _held(output, mod)

        with self._recorded(module, registration):
            registration.hooks.append(module.register_forward_hook(hold))
        return RemovableRuleHandle(self, module)


def _held(output: Any, module: nn.Module) -> Any:
    if isinstance(output, torch.Tensor):
        return hold(output)
    if isinstance(output, (tuple, list)):
        return type(output)(_held(item, module) for item in output)
    if output is None or isinstance(output, (int, float, bool)):
        return output
    raise TypeError(
        f"RouterRule on {type(module).__name__}: expected a router returning tensors (routing weights, expert "
        f"indices) or a tuple of them, got {type(output).__name__}; map the module to another rule"
    )
