"""Multi-agent networks that run their agents under ``torch.vmap``, run agent by agent inside an LRP context.

torchrl's multi-agent networks (``MultiAgentMLP``, ``MultiAgentConvNet``) with
``share_params=False`` stack the agents' parameters in a ``TensorDictParams``
and call one template network for all agents at once under ``torch.vmap``.
Inside a vmapped call tensors report no gradient, so no rule would see the
call: the relevance would silently be the plain gradient. While an LRP
context is open, such a network maps its template over the agents one by one
instead (:func:`agent_by_agent`); the rules then run on each agent's call with
that agent's parameters. The values are those of the network's own vmapped
call, run once more without gradient: a loop rounds differently, and a policy's
outputs must not change under LRP. In a call that keeps the graph (``create_graph=True``), every later backward
pass (a loss on the outputs, on the relevance) takes the gradient of the loop too: the rules inside it send each
pass where it belongs. The model's own calls in an open context (a loss module's training step) and
calls without gradient run the vmapped call alone, as the network does. A template that draws in training mode
(dropout) is refused in a wrapper's call: the loop's draws are not those of the vmapped call, so the relevance
would explain other dropped units than the outputs hold.

Examples:
    >>> import torch
    >>> from torchrl.modules import MultiAgentMLP
    >>> net = MultiAgentMLP(3, 2, n_agents=4, centralized=False, share_params=False, depth=1, num_cells=8)
    >>> x = torch.randn(5, 4, 3)
    >>> plain = net(x)
    >>> hooks = agent_by_agent({"": net})
    >>> torch.equal(net(x.requires_grad_()), plain)
    True
    >>> for hook in hooks:
    ...     hook.remove()
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from tdhook.attribution._agent_calls import agent_call
from tdhook.attribution._context import hooks_around
from tdhook.attribution._random_modules import draw, draws_now
from tdhook.attribution.rules._autograd import redirect
from tdhook.attribution.rules._keeping_graph import graph_kept
from tdhook.attribution.rules.base import plain_calls, rules_apply

__all__ = ["agent_by_agent"]

# The method torchrl's multi-agent networks map their template network with.
_MAP_METHOD = "vmap_func_module"


def _map_by_loop(vmapped: Callable, net: nn.Module, name: str) -> Callable:
    """A replacement for the network's ``vmap_func_module(module, in_dims, out_dims, ...)``: the agents' calls run
    one by one (over the first dimension of their parameters), so that the rules see each; the values are those of
    ``vmapped``, the network's own vmapped call, run without gradient (a loop rounds differently). Calls the rules
    do not act on (the model's own in an open context, or without gradient) run ``vmapped`` alone. ``net`` is the
    multi-agent network, ``name`` its name in the model."""

    def map_over_agents(module: nn.Module, in_dims: Any = 0, out_dims: Any = 0, **kwargs: Any) -> Callable:
        input_dims = in_dims[1:] if isinstance(in_dims, tuple) else (in_dims,)
        out_dim = out_dims[0] if isinstance(out_dims, tuple) else out_dims

        def call(params: Any, *inputs: torch.Tensor) -> torch.Tensor:
            if not rules_apply():  # as the network runs it: a training step's gradient is that of its own draws
                return vmapped(module, in_dims, out_dims, **kwargs)(params, *inputs)
            _raise_for_draws(net, name, module)
            lazy = _has_lazy_parameters(params)
            if lazy:  # lazy layers take their shapes from the network's own vmapped call (which moves the statistics)
                with torch.no_grad(), plain_calls():
                    vmapped(module, in_dims, out_dims, **kwargs)(params, *_detached(inputs))
            # The running statistics of norms in training mode move once per call, as in the network's own call.
            buffers = [t for t in params.values(True, True) if not isinstance(t, nn.Parameter)]
            before = [t.detach().clone() for t in buffers]
            outputs = []
            count = params.shape[0]
            for agent in range(count):
                agent_inputs = [
                    x if dim is None else x.select(dim, agent) for x, dim in zip(inputs, input_dims, strict=True)
                ]
                with params[agent].to_module(module, preserve_module_state=False), agent_call(agent, count, out_dim):
                    outputs.append(module(*agent_inputs))
            looped = torch.stack(outputs, out_dim)
            if not looped.requires_grad:
                if lazy:
                    _put_back(buffers, before)
                return looped
            with torch.no_grad(), plain_calls():  # detached: tensors that require grad take other kernels under vmap
                _put_back(buffers, before)  # the network's own call, from the state it was called in
                # .data, not .detach(): a locked TensorDictParams caches detach(), whose tensors a later
                # p.data = ... (vector_to_parameters, to_module) leaves behind
                value = vmapped(module, in_dims, out_dims, **kwargs)(params.data, *_detached(inputs))
                if lazy:
                    _put_back(buffers, before)
            if graph_kept() is None:
                return redirect(value, [looped], lambda grad: [grad])
            # Not redirect: the plain passes after the call would reach the vmapped value, which has no graph.
            return _LoopGradient.apply(value, looped)

        return call

    return map_over_agents


class _LoopGradient(torch.autograd.Function):
    """The network's own ``value`` with the gradient of ``looped`` (the same values, computed agent by agent) in
    every backward pass: the wrapper's relevance pass, and in a call that keeps the graph the plain passes after it.
    The backward is the identity, so a pass that records it (``create_graph``) can be differentiated again."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, looped: torch.Tensor) -> torch.Tensor:
        return value.clone()  # the vmapped call may return a view made without gradient

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, grad


def _raise_for_draws(net: nn.Module, name: str, template: nn.Module) -> None:
    """Refuse a template with a module that draws in this call (a dropout or an ``nn.RReLU`` in training mode, a
    fractional max pooling),
    naming it: the loop would draw other units than the network's own vmapped call, whose values the outputs are."""
    for inner, module in template.named_modules():
        if draws_now(module):
            child = next((n for n, c in net.named_children() if c is template), "")
            path = ".".join(part for part in (name, child, inner) if part)
            when = "training mode" if module.training else "eval mode too"
            raise ValueError(
                f"LRP: {type(net).__name__} {name!r} runs its agents with their own parameters under torch.vmap, "
                f"and {path!r} ({type(module).__name__}, {draw(module)}) draws in {when}: the "
                "rules see the agents only when they run one by one, whose draws are not those of the network's own "
                "vmapped call, so the relevance would explain other units than the outputs keep. Call .eval() on "
                "the model, or share the agents' parameters (share_params=True)"
            )


def _put_back(buffers: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """Write ``values`` back into the ``buffers`` a call changed (only those: an unchanged one keeps its version)."""
    with torch.no_grad():
        for buffer, value in zip(buffers, values, strict=True):
            if not torch.equal(buffer, value):
                buffer.copy_(value)


def _detached(inputs: tuple) -> list:
    return [x.detach() if isinstance(x, torch.Tensor) else x for x in inputs]


def _has_lazy_parameters(params: Any) -> bool:
    return any(isinstance(p, nn.parameter.UninitializedTensorMixin) for p in params.values(True, True))


def _is_vmapped_agents(module: nn.Module) -> bool:
    return callable(getattr(type(module), _MAP_METHOD, None)) and getattr(module, "share_params", True) is False


def agent_by_agent(modules: Mapping[str, nn.Module]) -> list[RemovableHandle]:
    """Make every multi-agent network among ``modules`` that maps its agents with ``torch.vmap`` map them one by
    one during its forward pass; the returned hook handles end it."""

    names = {id(module): name for name, module in modules.items()}

    def start(net: nn.Module, args: tuple) -> None:
        net.__dict__[_MAP_METHOD] = _map_by_loop(getattr(type(net), _MAP_METHOD), net, names.get(id(net), ""))

    def end(net: nn.Module, args: tuple, output: Any) -> None:
        net.__dict__.pop(_MAP_METHOD, None)

    return hooks_around((module for module in modules.values() if _is_vmapped_agents(module)), start, end)
