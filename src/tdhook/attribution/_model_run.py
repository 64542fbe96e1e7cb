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
import weakref
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from tensordict import TensorDictBase

from tdhook.attribution._checkpointing import raise_for_checkpointing
from tdhook.attribution._detached_caches import CacheWatch
from tdhook.attribution._function_rule_plan import FunctionRulePlan
from tdhook.attribution._given_inputs import given_inputs, restore_inputs
from tdhook.attribution._kept_caches import KeptCaches, cache_receivers
from tdhook.attribution._nonlinear_calls import NonlinearCalls
from tdhook.attribution._numeric_inputs import watch_numeric_inputs
from tdhook.attribution._plain_modules import call_plain
from tdhook.attribution._rerun_state import ModelBuffers
from tdhook.attribution._rule_use import RuleUse
from tdhook.attribution._tokens import rewind
from tdhook.attribution._writes import has_lazy_stack
from tdhook.attribution.rules._graph_calls import KeptOutputs, graph_call
from tdhook.attribution.rules._norm_function_layout import NormFunctionLayouts
from tdhook.attribution.rules._scopes import closing_scopes
from tdhook.attribution.rules.functional import FunctionalRules

__all__ = ["cache_receivers_of", "cache_watch_of", "context_cache_watch", "run_model"]

sequence_number = FunctionRulePlan.sequence_number


def run_model(
    lrp: Any,
    work: TensorDictBase,
    leaves: Sequence[torch.Tensor | None] = (),
    fed: Sequence[torch.Tensor | None] = (),
    signature: Hashable = None,
) -> tuple[TensorDictBase | None, NonlinearCalls | None]:
    """Run ``lrp``'s model on ``work`` under the function modes of its rules; what the model returned, and the
    watch of the nonlinear calls that no rule covers (the first call of a wrapper of its ``signature``, see
    :mod:`~tdhook.attribution._call_signatures`, with its rules on only, else ``None``).

    A call that runs the model again (its graph was not the recorded one) starts from the inputs it was given:
    ``work``'s entries, and the values of the explained inputs' copies ``fed``, taken again from ``leaves`` where
    the model changed them in place. Running statistics of norms in training mode, and the key-value caches
    handed to the model (a generation loop's), are put back as they were before the first run, and so is the global
    random state. An input that is not explained and that the model changed in place is the caller's tensor, which
    nothing can put back: such a call raises a ``RuntimeError`` naming its key.

    Under the CNN presets, a call of a signature whose first call held no gate computed by functions runs without
    the gates' mode; where its graph is not one its signature had with no gate (a branch on a flag or on values,
    see :mod:`~tdhook.attribution._function_gates`), the model runs again in the mode, from the same inputs and
    state."""
    result, calls, kept = _run_once(lrp, work, leaves, fed, signature)
    if kept is None:
        return result, calls
    seen = lrp._function_gates.changed(work if result is None else result, lrp)
    if seen is None:
        kept.kept()
        return result, calls
    kept.put_back(work, leaves, fed)
    result, calls, _ = _run_once(lrp, work, leaves, fed, signature, seen)
    return result, calls


class _KeptRun:
    """What a run of ``lrp``'s model that may be let go changes, kept before it: the entries of the TensorDict it
    runs on, the buffers it may write (``every`` one) and the random state (see
    :mod:`~tdhook.attribution._rerun_state`), the key-value caches it is handed while it runs in :meth:`watching`."""

    def __init__(self, lrp: Any, work: TensorDictBase, every: bool = False) -> None:
        self.lrp, self.inputs = lrp, given_inputs(work)
        self.buffers = _model_buffers(lrp)
        self.statistics = self.buffers.keep(every=every)  # a BatchNorm's statistics in training mode, a counter
        self.caches = KeptCaches(cache_receivers_of(lrp))  # a KV cache handed in: the run appends to it

    def watching(self) -> contextlib.AbstractContextManager:
        """The run's context: the caches handed in are noted (nothing to enter for a model that takes none)."""
        return self.caches.watching() if self.caches.receivers else contextlib.nullcontext()

    def kept(self) -> None:
        """The run was kept: the buffers it wrote are kept with their values before later runs."""
        self.buffers.note(self.statistics)

    def put_back(self, work: TensorDictBase, leaves: Sequence, fed: Sequence) -> None:
        """Before the model runs again: what the run let go changed, as it was (see :func:`run_model`); the rules'
        records, the layers' outputs and the tokens' embeddings it made, dropped."""
        for handle in self.lrp._handles or []:
            handle.pop_records()
        restore_inputs(work, self.inputs, leaves, fed)
        self.buffers.put_back(self.statistics)  # the run that was let go moved them: as the plain call, once
        self.caches.put_back()  # and appended to the caches: the next run appends once more
        self.lrp._layers.clear()
        rewind(self.lrp._tokens)


def _run_once(
    lrp: Any,
    work: TensorDictBase,
    leaves: Sequence[torch.Tensor | None],
    fed: Sequence[torch.Tensor | None],
    signature: Hashable,
    seen: tuple | None = None,
) -> tuple[TensorDictBase | None, NonlinearCalls | None, _KeptRun | None]:
    """:func:`run_model`, once, and what the gates' check needs to run it again (``None`` where it is neither checked
    nor probed): ``seen``, the shape of the graph of the run let go."""
    raise_for_checkpointing("LRP", [] if lrp._inactive else lrp._checkpointing)  # before the model runs
    lrp._function_rule_plan.quiet.remove()  # modules a plan ran without hooks, if an interrupt left them so
    handles = lrp._handles or []
    watch = lrp._rule_use.watch(lrp.named_explained_modules, handles, lrp._hooks, signature)
    rule_modes = [] if lrp._inactive else list(getattr(lrp.rule_mapper, "function_modes", list)())
    rule_modes += [] if lrp._inactive else lrp._function_gates.modes(lrp.rule_mapper, rule_modes, signature, seen)
    # A call that runs without the gates' mode may have to run again (see run_model): what it changes, kept; and
    # in a probe, which buffers the forward writes.
    gates, checked = lrp._function_gates, None
    if (gates.checks or gates.probes) and not lrp._inactive:
        if not has_lazy_stack(work):
            checked = _KeptRun(lrp, work)
        elif gates.checks:  # the entries of a lazy stack are not kept to run again: the call runs in the mode
            rule_modes.append(gates.hold())
    # The first call of a signature with the rules on is watched for calls no rule covers: with the rules off
    # (``inactive()``), every call takes the plain gradient as asked, and has nothing to report.
    watching = lrp._coverage.watches(signature) and not lrp._inactive
    key = _plan_key(lrp, rule_modes, work)
    recording = None
    if key is not None:
        plan = lrp._function_rule_plan.usable(key)
        if plan is not None and watch is RuleUse.NOTHING and not watching:
            # What the call may overwrite in ``work`` (a step may write the key it reads): its leaves, a list being
            # several times cheaper than a copy of the TensorDict.
            before = _KeptRun(lrp, work)
            start = sequence_number()
            norm_outputs: list = []
            kept = KeptOutputs(plan.kept) if plan.kept else None  # activations' inputs (a tanh's)
            # Modules whose rules the plan puts, without their hooks (the norms note their outputs all the same).
            quiet = lrp._function_rule_plan.quiet.running(plan.quiet, plan.noting)
            regions: list = []  # the calls of the modules the modes would pause in
            with closing_scopes(), graph_call(plain=plan.plain, outputs=norm_outputs, kept=kept, regions=regions):
                with quiet, before.watching():
                    result = _call(lrp, work) if lrp._norm_calls.found is False else _laid_out_call(lrp, work)
            activations = lrp._function_rule_plan.quiet.taken_outputs()  # their rule's factor takes them
            if plan.apply(
                work if result is None else result, start, sequence_number(), norm_outputs, kept, activations, regions
            ):
                before.kept()
                return result, None, None
            # Not the recorded graph: the call runs again in the mode, from the same inputs, and records anew.
            lrp._function_rule_plan.forget(key)
            before.put_back(work, leaves, fed)
        recording = rule_modes[0].recording = lrp._function_rule_plan.recorder(key)
        if recording is not None:  # a recording call may run again (see below): the leaves it may overwrite
            before = _KeptRun(lrp, work, every=True)  # once per signature: every buffer's values
    if not (rule_modes or lrp._compiled or watching or watch is not RuleUse.NOTHING):
        # Nothing to enter but the scopes, and a checked call's watch of the caches (most calls after a first)
        with closing_scopes(), checked.watching() if checked is not None else contextlib.nullcontext():
            result = _call(lrp, work) if lrp._norm_calls.found is False else _laid_out_call(lrp, work)
        return result, None, checked
    with contextlib.ExitStack() as modes:
        if lrp._norm_calls.found is not False:  # first, under every other mode: it sees the calls as the model makes
            modes.enter_context(NormFunctionLayouts(lrp._norm_calls))
        modes.enter_context(watch)
        for mode in rule_modes:
            modes.enter_context(mode)
        calls = (
            lrp._coverage.watch(modes, rule_modes, lrp.named_explained_modules, handles, signature)
            if watching
            else None
        )
        numeric = watch_numeric_inputs(lrp, work) if watching else None  # integers computed with as numbers
        if numeric is not None:
            modes.enter_context(numeric)
        if lrp._compiled:  # parts compiled by torch.compile run as written: every rule applies
            modes.enter_context(torch.compiler.set_stance("force_eager"))
        if recording is not None:  # norms tell where the scales they hold are, and their outputs
            modes.enter_context(
                graph_call(recording, outputs=recording.outputs, kept=recording.kept, regions=recording.regions)
            )
            if recording.kept is not None:  # every module's output, where an activation's input may be one
                modes.enter_context(lrp._function_rule_plan.keepers.every(lrp.named_explained_modules().values()))
            modes.enter_context(before.watching())
        elif checked is not None:
            modes.enter_context(checked.watching())
        # Innermost: what ruled modules entered and an interrupt kept them from leaving ends first.
        modes.enter_context(closing_scopes())
        start = sequence_number()
        try:
            result = _call(lrp, work)
        finally:
            if recording is not None:
                rule_modes[0].recording = None
        if watch is not RuleUse.NOTHING:  # the first pass of a context: which parameters its graph reaches
            lrp._rule_use.saw(work if result is None else result)
        if recording is not None and not lrp._function_rule_plan.settle(
            recording, work if result is None else result, start
        ):
            # Its tensors held without a detach left a graph whose backward would raise: again, detached.
            before.put_back(work, leaves, fed)
            result = _call(lrp, work)
        elif recording is not None:
            before.kept()
        return result, calls, checked


# By wrapper: the id of its rule handles when they were found (a context's), and the model's buffers; a stale list
# only leaves some buffer moved twice, as before. Nothing here is taken by a copy or a pickle of the wrapper.
_MODEL_BUFFERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _model_buffers(lrp: Any) -> ModelBuffers:
    """The buffers of ``lrp``'s model, and those its forward writes, found once per context (its rule handles mark
    it)."""
    found = _MODEL_BUFFERS.get(lrp)
    if found is None or found[0] != id(lrp._handles):
        found = _MODEL_BUFFERS[lrp] = (id(lrp._handles), ModelBuffers(lrp.module))
    return found[1]


# By wrapper: the id of its rule handles when they were found (a context's), the modules taking a cache, and the
# context's hooks on them that note the caches handed to the model (see CacheWatch), where it has some.
_CACHE_RECEIVERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cache_receivers_of(lrp: Any, handles: list | None = None) -> list:
    """The modules of ``lrp``'s model that take a key-value cache argument, found once per context (that of its
    rule ``handles``, by default its own)."""
    return _cache_entry(lrp, lrp._handles if handles is None else handles)[1]


def cache_watch_of(lrp: Any) -> tuple[list, CacheWatch | None]:
    """The modules of ``lrp``'s model that take a key-value cache argument, and the hooks its open context
    registered on them to note the caches handed in (``None`` where it registered none)."""
    found = _cache_entry(lrp, lrp._handles)
    return found[1], found[2]


def context_cache_watch(lrp: Any, handles: list) -> list:
    """Register, for the context of ``lrp``'s rule ``handles``, the hooks noting the caches handed to its model in
    each call (none where no module takes a cache, or the caches keep their graph); their handles."""
    receivers = cache_receivers_of(lrp, handles)
    if not receivers or lrp.create_graph:
        return []
    watch = CacheWatch(receivers)
    _CACHE_RECEIVERS[lrp] = (id(handles), receivers, watch)
    return watch.handles


def _cache_entry(lrp: Any, handles: list | None) -> tuple:
    found = _CACHE_RECEIVERS.get(lrp)
    if found is None or found[0] != id(handles):
        found = _CACHE_RECEIVERS[lrp] = (id(handles), cache_receivers(lrp.module), None)
    return found


def _plan_key(lrp: Any, rule_modes: list, work: TensorDictBase) -> tuple | None:
    """The signature of a call whose function rules may be found in its graph (see
    :mod:`~tdhook.attribution._function_rule_plan`): the names, shapes and types of its inputs; ``None`` for a call
    that runs in the modes whatever its inputs."""
    if len(rule_modes) != 1 or type(rule_modes[0]) is not FunctionalRules or lrp._compiled:
        return None
    if lrp.create_graph or lrp.layer_keys or lrp.relevance_check is not None or lrp._tokens.feeding:
        return None
    if lrp._call_enters:  # its context ends with the call: no later call would use a plan
        return None
    if has_lazy_stack(work):  # entries of different shapes cannot be stacked into a signature
        return None
    return tuple(
        (key, value.shape, value.dtype, value.device, value.requires_grad)
        for key, value in work.items(True, True)
        if isinstance(value, torch.Tensor)
    )


def _call(lrp: Any, work: TensorDictBase) -> TensorDictBase | None:
    with lrp._tokens.tracking():  # token ids copied or shifted from explained ones, refused where embedded
        return call_plain(lrp.module, work) if lrp._name_prefix else lrp.module(work)


def _laid_out_call(lrp: Any, work: TensorDictBase) -> TensorDictBase | None:
    """:func:`_call` where the model may call ``F.batch_norm`` and the like as functions: their gradients laid out
    (see :mod:`~tdhook.attribution.rules._norm_function_layout`)."""
    with NormFunctionLayouts(lrp._norm_calls):
        return _call(lrp, work)
