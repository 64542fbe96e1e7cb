"""Forward hooks that keep modules' outputs for a call, where an activation's rule needs its input.

``torch.tanh`` called as a function (RoBERTa's, MobileBERT's and Funnel's classification heads) leaves a node that
saved its output, not its input: no hook on that node can compute the identity rule's factor ``tanh(x) / x`` from
what the node holds (and ``atanh`` of a saturated output is not ``x``). Where ``x`` is a module's output (the head's
``Linear``), a call that follows a plan keeps it: a forward hook on that module hands its output to the call (see
:class:`~tdhook.attribution.rules._graph_calls.KeptOutputs`), and the plan's hook on the activation's node computes
the factor from it and from the output the node saved, as the function mode computes it from both.

A recording call finds the module: where an activation's input is no output it knows, the next recording call on
inputs of the same signature puts a hook of this kind on every module of the model for its one call, and a plan
that uses one module's output keeps its hook for the rest of the context. The hooks are appended (they see what the
module's other hooks made of its output, as the activation does) and are left out of copies of the model made in
the context.

Examples:
    >>> import torch
    >>> from tdhook.attribution.rules._graph_calls import KeptOutputs, graph_call
    >>> layer, keepers = torch.nn.Linear(2, 2), OutputKeepers(set())
    >>> keepers.keep([layer])
    >>> kept = KeptOutputs({id(layer)})
    >>> with graph_call(outputs=[], kept=kept):
    ...     y = layer(torch.ones(2))
    >>> kept.output(id(layer)) is y
    True
    >>> keepers.remove()
    >>> len(layer._forward_hooks)
    0
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from tdhook.attribution.rules._graph_calls import keep_output

__all__ = ["OutputKeepers"]


def _keep(module: nn.Module, args: tuple, output: Any) -> None:
    keep_output(module, output)


class OutputKeepers:
    """The hooks that keep outputs for one context (see the module); ``hidden``: the ids of the context's hooks that
    copies of the model leave out, to which each hook's id is added. :meth:`remove` removes every hook, as a hook
    handle's removes one."""

    def __init__(self, hidden: set[int]) -> None:
        self._hidden = hidden
        self._kept: dict[int, Any] = {}  # by module id: the handle of the hook kept for the context
        self._every: list[Any] = []  # the handles of a recording call's hooks on every module

    def keep(self, modules: Iterable[nn.Module]) -> None:
        """Keep the outputs of ``modules`` in every later call that asks for them, until :meth:`remove`."""
        for module in modules:
            if id(module) not in self._kept:
                self._add(module, self._kept.setdefault(id(module), []))

    def every(self, modules: Iterable[nn.Module]) -> _Every:
        """A ``with`` block in which every module of ``modules`` hands its outputs to the call."""
        return _Every(self, modules)

    def _add(self, module: nn.Module, listed: list) -> None:
        handle = module.register_forward_hook(_keep)
        listed.append(handle)  # listed before anything else: remove() finds it whatever interrupts
        self._hidden.add(handle.id)

    def remove_every(self) -> None:
        """Remove a recording call's hooks on every module (idempotent)."""
        every = self._every
        while every:
            every[-1].remove()
            every.pop()

    def remove(self) -> None:
        """Remove every hook (idempotent)."""
        self.remove_every()
        for handles in self._kept.values():
            while handles:
                handles[-1].remove()
                handles.pop()
        self._kept.clear()


class _Every:
    """The block of :meth:`OutputKeepers.every`."""

    def __init__(self, keepers: OutputKeepers, modules: Iterable[nn.Module]) -> None:
        self._keepers, self._modules = keepers, modules

    def __enter__(self) -> None:
        keepers = self._keepers
        try:
            for module in self._modules:
                keepers._add(module, keepers._every)
        except BaseException:
            keepers.remove_every()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self._keepers.remove_every()
