"""What an LRP wrapper keeps for :meth:`~tdhook.attribution.LRP.coverage`: the first call's watch, and the last
call's seeds and relevances.

Examples:
    >>> recorder = CoverageRecorder()
    >>> recorder.coverage(n_inputs=1, n_layers=0, split_dim=None)
    Coverage(plain_gradient=(), reached=None)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from tdhook.attribution._nonlinear_calls import NonlinearCalls, report_dropout_calls, report_plain_gradient
from tdhook.attribution._unmapped_layers import report_recurrent_first_layers, report_unmapped_layers
from tdhook.attribution._unmerged_norms import layer_rules_merging, report_unmerged_norms
from tdhook.attribution.coverage import Coverage, PlainGradientCall, reached_share
from tdhook.attribution.rules.base import RemovableRuleHandle
from tdhook.attribution.rules.basic import IgnoreRule
from tdhook.attribution.rules.functional import FunctionalRules
from tdhook.attribution.targets import EveryUnit

__all__ = ["CoverageRecorder"]


class CoverageRecorder:
    """Watches a wrapper's first forward pass for nonlinear calls without a rule, and keeps its last call."""

    def __init__(self) -> None:
        self._pending = True
        self._plain_gradient: tuple[PlainGradientCall, ...] = ()
        self._last_call: tuple[int, list, list[torch.Tensor]] | None = None
        self._function_rules = False

    @property
    def watching(self) -> bool:
        """Whether the next call is watched (no call was watched yet)."""
        return self._pending

    def watch(
        self,
        modes: contextlib.ExitStack,
        rule_modes: Sequence,
        named_modules: Callable[[], Mapping[str, nn.Module]],
        handles: Sequence[RemovableRuleHandle],
    ) -> NonlinearCalls | None:
        """Enter the watch on ``modes`` if no call was watched yet; the watch, or ``None``. ``named_modules``
        gives the model's modules by name (asked only when watching: not on every call)."""
        if not self._pending:
            return None
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

    def _watch_again(self) -> None:
        """The watched call was refused in its backward pass (a hook of the caller's changed a gradient): the next
        call is watched too."""
        self._pending = True

    def report(
        self, calls: NonlinearCalls, targets: list[torch.Tensor], modules: Mapping[str, nn.Module], mapper: Any
    ) -> None:
        """Warn about (or, with a ``strict`` mapper, refuse) the watched calls the targets depend on: nonlinear calls
        without a rule, convolutions or linear maps outside layers that ``mapper`` would give another rule, and
        batch norms computed outside a BatchNorm module on a layer's output, which no rule merges into the layer."""
        strict = bool(getattr(mapper, "strict", False))
        # Watched only once the whole report is out: after a strict error, or a warning that the caller's filter
        # turned into one (warnings.simplefilter("error")), the next call checks and warns again.
        plain = report_plain_gradient(calls.found(targets), modules, strict, self._function_rules)
        first = calls.found_first_layers(targets)
        layers = report_unmapped_layers(calls.found_layers(targets), modules, mapper, strict, first=first)
        norms = report_unmerged_norms(calls.found_unmerged_norms(targets), modules, strict)
        report_recurrent_first_layers(calls.found_first_recurrent(targets), mapper, strict)
        report_dropout_calls(calls.found_dropouts(targets), modules)
        self._plain_gradient = plain + layers + norms
        self._pending = False

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
