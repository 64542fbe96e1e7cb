"""Layers of a torchrl multi-agent network's template, whose values live in the network's stacked parameters.

torchrl's ``MultiAgentMLP`` and ``MultiAgentConvNet`` build one template network (``_empty_net``) whose own
tensors are on the meta device, and keep every agent's values in a ``TensorDictParams`` (``params``: stacked over the
agents, or one set with ``share_params=True``), which each call puts into the template. A ``reset_parameters`` of a
template layer alone would draw meta tensors and leave the network as it was; the reset runs with the values put in
instead, each agent drawing its own (as the network's own ``reset_parameters`` draws them).

Examples:
    >>> import torch
    >>> from torchrl.modules import MultiAgentMLP
    >>> net = MultiAgentMLP(3, 2, n_agents=4, centralized=False, share_params=False, depth=1, num_cells=8)
    >>> layer = net._empty_net[0]
    >>> template_owner(list(net.named_modules()), layer) is net
    True
    >>> before = net.params["0", "weight"].clone()
    >>> reset_in_template(net, layer.reset_parameters)
    >>> bool((net.params["0", "weight"] != before).all()), bool(net.params["2", "weight"].ne(0).any())
    (True, True)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from tensordict import TensorDictBase
from torch import nn
from torchrl.modules.models.multiagent import MultiAgentNetBase

__all__ = ["reset_in_template", "template_owner"]


def template_owner(modules: Sequence[tuple[str, nn.Module]], layer: nn.Module) -> MultiAgentNetBase | None:
    """The torchrl multi-agent network among ``modules`` whose template holds ``layer``; ``None`` if none does."""
    for _, module in modules:
        if isinstance(module, MultiAgentNetBase) and any(sub is layer for sub in module._empty_net.modules()):
            return module
    return None


def reset_in_template(net: MultiAgentNetBase, reset: Callable[[], None]) -> None:
    """Run ``reset`` (the reset of a layer of ``net``'s template) with the values of ``net``'s parameters put in the
    template, so that it draws them: once with shared parameters, else for every agent under ``torch.vmap``, each
    agent drawing its own values."""
    template = net._empty_net
    if net.share_params:
        with net.params.to_module(template, preserve_module_state=False):
            reset()
        return

    def one_agent(params: TensorDictBase) -> TensorDictBase:
        with params.to_module(template, preserve_module_state=False):
            reset()
        return params

    torch.vmap(one_agent, randomness="different")(net.params)
