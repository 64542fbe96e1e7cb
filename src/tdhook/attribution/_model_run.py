"""One forward pass of a wrapper's model in its context: the first call's watches, the function modes, the call.

Examples:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from tdhook.attribution import LRP
    >>> lrp = LRP(torch.nn.Linear(3, 2), in_keys=["x"], out_keys=["y"])
    >>> with lrp:
    ...     result, calls = run_model(lrp, TensorDict(x=torch.ones(4, 3), batch_size=[4]))
    >>> result["y"].shape, calls is not None  # the first call watches the functions the model calls
    (torch.Size([4, 2]), True)
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from tensordict import TensorDictBase

from tdhook.attribution._checkpointing import raise_for_checkpointing
from tdhook.attribution._nonlinear_calls import NonlinearCalls
from tdhook.attribution._plain_modules import call_plain
from tdhook.attribution._rule_use import RuleUse
from tdhook.attribution.rules._scopes import closing_scopes

__all__ = ["run_model"]


def run_model(lrp: Any, work: TensorDictBase) -> tuple[TensorDictBase | None, NonlinearCalls | None]:
    """Run ``lrp``'s model on ``work`` under the function modes of its rules; what the model returned, and the
    watch of the nonlinear calls that no rule covers (the first call of a wrapper only, else ``None``)."""
    raise_for_checkpointing("LRP", [] if lrp._inactive else lrp._checkpointing)  # before the model runs
    handles = lrp._handles or []
    watch = lrp._rule_use.watch(lrp.named_explained_modules, handles, lrp._hooks)
    rule_modes = [] if lrp._inactive else list(getattr(lrp.rule_mapper, "function_modes", list)())
    rule_modes += [] if lrp._inactive else lrp._function_gates.modes(lrp.rule_mapper, rule_modes)
    if not (rule_modes or lrp._compiled or lrp._coverage.watching or watch is not RuleUse.NOTHING):
        with closing_scopes():  # nothing to enter but the scopes (every call of a context after its first, mostly)
            return _call(lrp, work), None
    with contextlib.ExitStack() as modes:
        modes.enter_context(watch)
        for mode in rule_modes:
            modes.enter_context(mode)
        calls = lrp._coverage.watch(modes, rule_modes, lrp.named_explained_modules, handles)
        if lrp._compiled:  # parts compiled by torch.compile run as written: every rule applies
            modes.enter_context(torch.compiler.set_stance("force_eager"))
        # Innermost: what ruled modules entered and an interrupt kept them from leaving ends first.
        modes.enter_context(closing_scopes())
        return _call(lrp, work), calls


def _call(lrp: Any, work: TensorDictBase) -> TensorDictBase | None:
    return call_plain(lrp.module, work) if lrp._name_prefix else lrp.module(work)
