"""What an LRP wrapper keeps for :meth:`~tdhook.attribution.LRP.coverage`: the watch of its first call of each
signature (see :mod:`~tdhook.attribution._call_signatures`), and the last call's seeds and relevances.

Examples:
    >>> recorder = CoverageRecorder()
    >>> recorder.coverage(n_inputs=1, n_layers=0, split_dim=None)
    Coverage(plain_gradient=(), reached=None)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from tdhook.attribution._nonlinear_calls import NonlinearCalls
from tdhook.attribution._plain_gradient_reports import report_dropout_calls, report_plain_gradient
from tdhook.attribution._random_calls import report_random_calls
from tdhook.attribution._unmapped_layers import report_recurrent_first_layers, report_unmapped_layers
from tdhook.attribution._unmerged_norms import layer_rules_merging, report_unmerged_norms
from tdhook.attribution.coverage import Coverage, PlainGradientCall, reached_share
from tdhook.attribution.rules.base import RemovableRuleHandle
from tdhook.attribution.rules.basic import IgnoreRule
from tdhook.attribution.rules.functional import FunctionalRules
from tdhook.attribution.targets import EveryUnit

__all__ = ["CoverageRecorder"]


class CoverageRecorder:
    """Watches a wrapper's first forward pass of each signature for nonlinear calls without a rule, and keeps its
    last call."""

    def __init__(self) -> None:
        self._watched: set[Hashable] = set()  # the signatures of the calls watched and reported
        self._watching: Hashable | None = None  # that of the call in the watch
        self._reported: set[tuple[str, str, str]] = set()  # (kind, module, function) warned of
        self._plain_gradient: tuple[PlainGradientCall, ...] = ()
        self._last_call: tuple[int, list, list[torch.Tensor]] | None = None
        self._function_rules = False

    def watches(self, signature: Hashable) -> bool:
        """Whether a call of ``signature`` (see :mod:`~tdhook.attribution._call_signatures`) is watched: no call
        of it was watched yet."""
        return signature not in self._watched

    def watch(
        self,
        modes: contextlib.ExitStack,
        rule_modes: Sequence,
        named_modules: Callable[[], Mapping[str, nn.Module]],
        handles: Sequence[RemovableRuleHandle],
        signature: Hashable = None,
    ) -> NonlinearCalls | None:
        """Enter the watch on ``modes`` if no call of ``signature`` was watched yet; the watch, or ``None``.
        ``named_modules`` gives the model's modules by name (asked only when watching: not on every call)."""
        if not self.watches(signature):
            return None
        self._watching = signature
        modules = named_modules()
        ruled = {
            id(h.module)
            for h in handles
            if h.module is not None and h.rule.decides_every_call and h.rule.is_registered(h.module)
        }
        merging = layer_rules_merging(h for h in handles if h.module is not None and id(h.module) in ruled)
        # Modules the caller mapped to IgnoreRule (a recurrent layer, a block): their plain gradient is asked for.
        plain = {id(h.module) for h in handles if h.module is not None and _asks_plain_gradient(h.rule)}
        self._function_rules = any(isinstance(mode, FunctionalRules) for mode in rule_modes)
        watch = NonlinearCalls(rule_modes, self._watch_again).watch(modules, ruled, merging, plain)
        return modes.enter_context(watch)

    def watch_every_signature_again(self) -> None:
        """The next call of every signature is watched again (a hook of the caller's was put on the model since
        the calls watched: see ``tdhook.attribution._model_changes``); what was reported is not reported again."""
        self._watched.clear()

    def _watch_again(self) -> None:
        """The watched call was refused in its backward pass (a hook of the caller's changed a gradient): the next
        call is watched too."""
        self._watched.discard(self._watching)

    def report(
        self, calls: NonlinearCalls, targets: list[torch.Tensor], modules: Mapping[str, nn.Module], mapper: Any
    ) -> None:
        """Warn about (or, with a ``strict`` mapper, refuse) the watched calls the targets depend on: nonlinear calls
        without a rule, convolutions or linear maps outside layers that ``mapper`` would give another rule, and
        batch norms computed outside a BatchNorm module on a layer's output, which no rule merges into the layer."""
        strict = bool(getattr(mapper, "strict", False))
        # Watched only once the whole report is out: after a strict error, or a warning that the caller's filter
        # turned into one (warnings.simplefilter("error")), the next call checks and warns again. A call of another
        # signature reports what the calls before it did not.
        found = {
            "plain": calls.found(targets),
            "layers": calls.found_layers(targets),
            "norms": calls.found_unmerged_norms(targets),
            "recurrent": calls.found_first_recurrent(targets),
            "dropouts": calls.found_dropouts(targets),
            "draws": calls.found_random_calls(targets),
        }
        new = {kind: self._unreported(kind, calls_of) for kind, calls_of in found.items()}
        plain = report_plain_gradient(new["plain"], modules, strict, self._function_rules)
        first = calls.found_first_layers(targets)
        layers = report_unmapped_layers(new["layers"], modules, mapper, strict, first=first)
        norms = report_unmerged_norms(new["norms"], modules, strict)
        report_recurrent_first_layers(new["recurrent"], mapper, strict)
        report_dropout_calls(new["dropouts"], modules)
        report_random_calls(new["draws"], modules)
        self._plain_gradient += plain + layers + norms
        self._reported.update(
            (kind, name, function) for kind, calls_of in new.items() for name in calls_of for function in calls_of[name]
        )
        self._watched.add(self._watching)

    def _unreported(self, kind: str, found: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
        """The calls of ``found`` (module name → function → number of calls) of a ``kind`` not reported before."""
        new = {
            name: {function: n for function, n in functions.items() if (kind, name, function) not in self._reported}
            for name, functions in found.items()
        }
        return {name: functions for name, functions in new.items() if functions}

    def keep(self, batch_dims: int, seeds: list, relevances: list[torch.Tensor]) -> None:
        """Keep a call's ``(target name, output, initial gradient)`` seeds and relevances."""
        # Detached: relevance that keeps its graph (create_graph=True) must not keep it alive here.
        kept = [r.detach() if r is not None and r.requires_grad else r for r in relevances]
        seeds = [(name, output, _detached(seed)) for name, output, seed in seeds]  # a callable target's keeps its own
        self._last_call = (batch_dims, seeds, kept)

    def coverage(self, n_inputs: int, n_layers: int, split_dim: int | None) -> Coverage:
        """The report, for relevances laid out per target as ``n_inputs`` inputs, then ``n_layers`` layers."""
        if self._last_call is None:
            return Coverage(self._plain_gradient, None)
        batch_dims, seeds, relevances = self._last_call
        shares = {}
        for position, (name, output, grad_output) in enumerate(seeds):
            start = position * (n_inputs + n_layers)
            inputs = [r for r in relevances[start : start + n_inputs] if r is not None]  # None: not explained
            per_unit = isinstance(grad_output, EveryUnit)
            if split_dim is not None:  # the positions' relevances add up to the whole target's
                dim = split_dim
                inputs = [r.sum(dim).movedim(dim, batch_dims) if per_unit else r.sum(dim) for r in inputs]
            if per_unit:  # [*batch, units], each unit's relevance at [*batch, unit, ...]
                target = grad_output.totals(output)
            else:
                # per sample; an output of the batch's shape alone (a value written as [B]) has one unit per sample
                product = (output.detach() * grad_output).double()
                target = product.reshape(*product.shape[:batch_dims], -1).sum(-1)
            shares[name] = reached_share(batch_dims, target, inputs)
        return Coverage(self._plain_gradient, shares if None not in shares else shares[None])


def _detached(value: object) -> object:
    return value.detach() if isinstance(value, torch.Tensor) and value.requires_grad else value


def _asks_plain_gradient(rule: Any) -> bool:
    """Whether ``rule`` is an :class:`~tdhook.attribution.rules.basic.IgnoreRule` the caller mapped a module to (the
    plain gradient of all it computes), not the presets' own for modules whose gradient routes relevance."""
    return isinstance(rule, IgnoreRule) and rule._plain_inside
