"""Multi-agent networks that run their agents under ``torch.vmap``, run agent by agent inside an LRP context.

torchrl's multi-agent networks (``MultiAgentMLP``, ``MultiAgentConvNet``) with
``share_params=False`` stack the agents' parameters in a ``TensorDictParams``
and call one template network for all agents at once under ``torch.vmap``.
Inside a vmapped call tensors report no gradient, so no rule would see the
call: the relevance would silently be the plain gradient. While an LRP
context is open, such a network maps its template over the agents one by one
instead (:func:`agent_by_agent`), with the same values; the rules then run on
each agent's call with that agent's parameters.

Examples:
    >>> import torch
    >>> from torchrl.modules import MultiAgentMLP
    >>> net = MultiAgentMLP(3, 2, n_agents=4, centralized=False, share_params=False, depth=1, num_cells=8)
    >>> x = torch.randn(5, 4, 3)
    >>> hooks = agent_by_agent({"": net})
    >>> torch.allclose(net(x), torch.stack([net(x)[:, i] for i in range(4)], 1))
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

__all__ = ["agent_by_agent"]

# The method torchrl's multi-agent networks map their template network with.
_MAP_METHOD = "vmap_func_module"


def _map_by_loop(module: nn.Module, in_dims: Any = 0, out_dims: Any = 0, **_: Any) -> Callable:
    """``torch.vmap(call)`` over the agents' parameters (their first dimension), written as a loop over the agents."""
    input_dims = in_dims[1:] if isinstance(in_dims, tuple) else (in_dims,)
    out_dim = out_dims[0] if isinstance(out_dims, tuple) else out_dims

    def call(params: Any, *inputs: torch.Tensor) -> torch.Tensor:
        outputs = []
        for agent in range(params.shape[0]):
            agent_inputs = [
                x if dim is None else x.select(dim, agent) for x, dim in zip(inputs, input_dims, strict=True)
            ]
            with params[agent].to_module(module, preserve_module_state=False):
                outputs.append(module(*agent_inputs))
        return torch.stack(outputs, out_dim)

    return call


def _is_vmapped_agents(module: nn.Module) -> bool:
    return callable(getattr(type(module), _MAP_METHOD, None)) and getattr(module, "share_params", True) is False


def agent_by_agent(modules: Mapping[str, nn.Module]) -> list[RemovableHandle]:
    """Make every multi-agent network among ``modules`` that maps its agents with ``torch.vmap`` map them one by
    one during its forward pass; the returned hook handles end it."""
    hooks: list[RemovableHandle] = []
    for module in modules.values():
        if not _is_vmapped_agents(module):
            continue

        def start(net: nn.Module, args: tuple) -> None:
            net.__dict__[_MAP_METHOD] = _map_by_loop

        def end(net: nn.Module, args: tuple, output: Any) -> None:
            net.__dict__.pop(_MAP_METHOD, None)

        hooks.append(module.register_forward_pre_hook(start))
        hooks.append(module.register_forward_hook(end, always_call=True))
    return hooks
