"""The steps a planned LRP call cannot do without, run bare: the floor under the wrapper's time in a context.

A call inside an open context, once its input signature has a plan (see
``tdhook/attribution/_function_rule_plan.py``), copies the caller's TensorDict, feeds the model a copy of a fresh
leaf, runs the forward pass with the plan's quiet modules, puts the plan's hooks on the graph (after checking its
shape), seeds the target's one-hot, takes one backward pass and writes the outputs and the relevance. Everything
else it does (the refusals, the guards that put the model and the caller's TensorDict back on a failure, the
target's resolution, the checks of inputs, keys and caches) is bookkeeping. :func:`planned_steps` runs those steps
alone, with the wrapper's own plan, and :func:`check_planned_steps` checks that they give the wrapper's relevance
bit for bit; with ``apply=False`` the plan's hooks are left off (its walk and hooks costed apart; the relevance is
then not LRP's). A diagnostic of the design, not an API: it reads the wrapper's private state.

    >>> import torch
    >>> from tdhook.attribution import LRP
    >>> from tdhook.attribution.lrp_helpers.rules import AttnLRP
    >>> class Gated(torch.nn.Module):  # a product of two activations: AttnLRP's uniform rule, put on by the plan
    ...     def __init__(self) -> None:
    ...         super().__init__()
    ...         self.a, self.b = torch.nn.Linear(3, 4), torch.nn.Linear(3, 4)
    ...     def forward(self, x: torch.Tensor) -> torch.Tensor:
    ...         return self.a(x) * self.b(x)
    >>> lrp = LRP(Gated(), AttnLRP(), in_keys=["x"], out_keys=["y"])
    >>> with lrp:
    ...     check_planned_steps(lrp, "x", "y", torch.randn(5, 3))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from tdhook.attribution._plain_modules import call_plain
from tdhook.attribution.rules._graph_calls import graph_call
from tdhook.attribution.rules._scopes import closing_scopes
from tdhook.attribution.rules._wrapper_calls import wrapper_call

__all__ = ["check_planned_steps", "planned_steps"]

_sequence_number = torch._C._autograd._get_sequence_nr


def planned_steps(lrp: Any, in_key: str, out_key: str, x: torch.Tensor, apply: bool = True) -> Callable[[], Any]:
    """The bare steps of ``lrp``'s planned call on ``x`` at ``in_key``, explaining the argmax of ``out_key``; ``lrp``
    is in its context, and the plan for ``x``'s signature is made by two calls of the wrapper first."""
    for _ in range(2):  # the first call records the plan, the second may record again (outputs kept)
        lrp(TensorDict({in_key: x}, batch_size=x.shape[:1]))
    plans = [plan for plan in lrp._function_rule_plan._plans.values() if plan is not None]
    if len(plans) != 1:
        raise RuntimeError(f"planned_steps: {len(plans)} plans for one signature; the call runs in the modes")
    plan, rule_plan = plans[0], lrp._function_rule_plan

    def call() -> TensorDictBase:
        with lrp._lock, wrapper_call(lrp._lock):
            tensordict = TensorDict({in_key: x}, batch_size=x.shape[:1])
            work = tensordict.copy()
            leaf = work.get(in_key).detach().requires_grad_(True)
            work.set(in_key, leaf.clone())
            start, norm_outputs, regions = _sequence_number(), [], []
            with closing_scopes(), graph_call(plain=plan.plain, outputs=norm_outputs, regions=regions):
                with rule_plan.quiet.running(plan.quiet, plan.noting):
                    result = call_plain(lrp.module, work) if lrp._name_prefix else lrp.module(work)
            activations = rule_plan.quiet.taken_outputs()
            if apply and not plan.apply(result, start, _sequence_number(), norm_outputs, None, activations, regions):
                raise RuntimeError("planned_steps: the call's graph is not the recorded one")
            output = result.get(out_key)
            seed = torch.zeros_like(output).scatter_(-1, output.argmax(-1, keepdim=True), 1.0)
            (grad,) = torch.autograd.grad(output, leaf, seed)
            tensordict.set(out_key, output.detach())
            tensordict.set(("relevance", in_key), leaf.detach() * grad)
            return tensordict

    return call


def check_planned_steps(lrp: Any, in_key: str, out_key: str, x: torch.Tensor) -> None:
    """Raise where :func:`planned_steps` does not give the relevance of ``lrp``'s own call, bit for bit."""
    steps = planned_steps(lrp, in_key, out_key, x)()
    called = lrp(TensorDict({in_key: x}, batch_size=x.shape[:1]))
    if not torch.equal(steps.get(("relevance", in_key)), called.get(("relevance", in_key))):
        raise RuntimeError("planned_steps: the bare steps do not give the wrapper's relevance")
