"""The hooks an LRP context puts on the model's modules besides the rules, for torchrl's modules and grad modes.

* multi-agent networks that vmap their agents run them one by one (:mod:`._agents`);
* exploration steps after an actor perturb the action by a constant of the call (:mod:`._exploration`);
* under a caller's ``no_grad``, modules whose kernels depend on the grad mode give that mode's values
  (:mod:`._no_grad_values`);
* torchrl's ``VecNorm`` that is not frozen moves its statistics once, from the detached input, and normalises with
  them held constant (:mod:`._running_statistics`);
* recurrent modules whose backend bypasses their ``nn.LSTM``/``nn.GRU`` are refused (:mod:`._recurrent_backends`);
* layers holding a parameter or buffer on the meta device when the context opens refuse a call computing an output
  off it, whether or not their rule puts a hook there (:mod:`.rules._meta_tensors`).

Examples:
    >>> from torch import nn
    >>> hooks = module_hooks(dict(nn.LSTM(3, 4).named_modules()))
    >>> len(hooks)
    1
    >>> for hook in hooks:
    ...     hook.remove()
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.utils.hooks import RemovableHandle

from tdhook.attribution._agents import agent_by_agent
from tdhook.attribution._exploration import perturbation_held_constant
from tdhook.attribution._no_grad_values import caller_values
from tdhook.attribution._recurrent_backends import refuse_bypassing_backends
from tdhook.attribution._running_statistics import statistics_held_constant
from tdhook.attribution.rules._meta_tensors import meta_tensor_hooks

__all__ = ["module_hooks"]


def module_hooks(modules: Mapping[str, nn.Module], into: list | None = None) -> list[RemovableHandle]:
    """Every hook of the module docstring that applies to ``modules`` (the model's modules by name), each handle
    appended to ``into`` (a new list by default) as soon as its hook is registered: a registration that fails (an
    error, an interrupt) leaves none unlisted. Returns ``into``."""
    handles = [] if into is None else into
    handles += agent_by_agent(modules)  # one line: all of them, or none where a registration fails
    perturbation_held_constant(modules, handles)
    statistics_held_constant(modules, handles)
    caller_values(modules, handles)
    refuse_bypassing_backends(modules, handles)
    meta_tensor_hooks(modules, handles)
    return handles
