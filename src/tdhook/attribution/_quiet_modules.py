"""Modules that a call following a plan runs without their hooks: their rule is on the graph already.

A module with a forward hook takes torch's slow way through ``nn.Module.__call__``: on a small transformer, an
activation module's hooks cost more than its own forward. In a call that follows the plan a recording call made (see
:mod:`~tdhook.attribution._function_rule_plan`), an activation module whose rule the plan puts on its output's node
leaves its hooks nothing to do: the rule's hook would put the rule the plan puts, and the hooks that pause the
function modes pause none (such a call runs without them). So does a norm that the plan runs plainly (its scale's
gradient cut on the graph), but for one thing its hooks did, which its quiet call does: it notes its output's node
for the plan (see :func:`~tdhook.attribution.rules._graph_calls.note_output`), where the paths to the nodes it rules
start. So the call runs such a module straight to its ``forward``: an instance attribute
``_call_impl`` (what ``nn.Module.__call__`` calls) set to the bound ``forward`` for the call, removed after it,
however it ends. Only a module whose every hook is the wrapper's own (its rule's, and the pausing ones), with no
backward hook, no global module hook set and no trace running, is run that way; any other keeps its way. A call of
such a module made while a function mode is entered (by the caller, or by the model around the module) takes torch's
way with its hooks all the same: the pausing ones pause that mode too, so that out of context it sees nothing of the
module's forward.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> act, calls = nn.SiLU(), []
    >>> hook = act.register_forward_hook(lambda module, args, output: calls.append(1))
    >>> with QuietModules({hook.id}).running([act]):
    ...     _ = act(torch.ones(2))
    >>> _ = act(torch.ones(2))
    >>> len(calls), "_call_impl" in act.__dict__  # the hook ran for the second call only
    (1, False)
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from tdhook.attribution.rules._graph_calls import note_output, note_region
from tdhook.attribution.rules.base import rules_apply

__all__ = ["QuietCall", "QuietModules"]

_GLOBAL_HOOKS = (
    torch_module._global_forward_hooks,
    torch_module._global_forward_pre_hooks,
    torch_module._global_backward_hooks,
    torch_module._global_backward_pre_hooks,
)


_function_modes = torch._C._is_torch_function_mode_enabled


class QuietCall:
    """What a call of ``module`` runs while it is quiet: its forward, or torch's way with its hooks where a function
    mode is entered; with ``notes``, the forward's output is noted where its rule's hooks would note it (a norm's);
    else (an activation's, whose rule the plan puts on its output's node) the output and its version are appended
    to ``outputs``, where the rule's factor takes the output instead of computing it again (see
    :meth:`~tdhook.attribution.rules.basic.PassRuleOnNode.given`), and its call is noted as its hooks that pause the
    modes note it (see :func:`~tdhook.attribution.rules._graph_calls.note_region`). A copy of the module made
    meanwhile leaves it out (see :mod:`~tdhook.attribution._copies`)."""

    __slots__ = ("_call_impl", "_forward", "_module", "_notes", "_outputs")

    def __init__(self, module: nn.Module, notes: bool = False, outputs: list | None = None) -> None:
        self._module, self._forward, self._call_impl = module, module.forward, type(module)._call_impl
        self._notes, self._outputs = notes, outputs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _function_modes():
            return self._call_impl(self._module, *args, **kwargs)
        if not self._notes:  # an activation, which its pausing hooks would note (see note_region)
            note_region(self._module)
        output = self._forward(*args, **kwargs)
        if self._notes:
            if rules_apply():
                note_output(output)
            return output
        note_region(None)
        if self._outputs is not None and type(output) is torch.Tensor:
            self._outputs.append((output, output._version))
        return output


class QuietModules:
    """Runs calls with modules set to skip their hooks (see the module), if all of them are in ``own_hook_ids``.

    Its :meth:`remove` puts every module back, as a hook handle's removes a hook: listed with a context's hooks, it
    ends with the context (or with the wrapper, collected with its context open).
    """

    def __init__(self, own_hook_ids: Collection[int]) -> None:
        self._own = frozenset(own_hook_ids)
        self._quieted: list[nn.Module] = []  # the modules running without hooks now
        self._modules: Sequence[nn.Module] = ()
        self._noting: Collection[int] = ()
        self._outputs: list[tuple[torch.Tensor, int]] = []  # the quiet activations' outputs in the running block

    def running(self, modules: Sequence[nn.Module], noting: Collection[int] = ()) -> QuietModules:
        """A ``with`` block in which each of ``modules`` whose hooks are all the wrapper's own runs straight to its
        forward, those whose ids are in ``noting`` noting their outputs as their hooks would; every module is back on
        torch's way when the block ends, however it ends."""
        self._modules, self._noting = modules, noting
        return self

    def taken_outputs(self) -> list[tuple[torch.Tensor, int]]:
        """The outputs of the activations the last block ran quiet (not the norms), each with its version when the
        module returned it, in the order of their calls; the block's list is handed over (not kept here, where it
        would hold the call's graph until the next one)."""
        outputs, self._outputs = self._outputs, []
        return outputs

    def __enter__(self) -> None:
        self.remove()  # what an interrupt in the last block's end left
        self._outputs = outputs = []
        modules, quieted, noting = self._modules, self._quieted, self._noting
        try:
            if modules and not any(_GLOBAL_HOOKS) and not torch._C._get_tracing_state():
                for module in modules:
                    if self._quiet_possible(module):
                        quieted.append(module)  # listed first: an interrupt after it leaves nothing unlisted
                        module.__dict__["_call_impl"] = QuietCall(module, id(module) in noting, outputs)
        except BaseException:  # an interrupt: no block to end
            self.remove()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self._put_back()
        if exc_info[0] is not None:  # no plan follows the call: nothing holds its outputs
            self._outputs = []

    def _quiet_possible(self, module: nn.Module) -> bool:
        own = self._own
        return (
            "_call_impl" not in module.__dict__
            and not module._backward_hooks
            and not module._backward_pre_hooks
            and all(key in own for key in module._forward_hooks)
            and all(key in own for key in module._forward_pre_hooks)
        )

    def remove(self) -> None:
        """Put every module run without its hooks back on torch's way (idempotent)."""
        self._outputs = []
        self._put_back()

    def _put_back(self) -> None:
        quieted = self._quieted
        while quieted:
            quieted[-1].__dict__.pop("_call_impl", None)
            quieted.pop()
