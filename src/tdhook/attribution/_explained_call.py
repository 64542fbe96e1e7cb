"""One explained call of the LRP wrapper: the forward pass under the rules, a backward pass per target, and the
relevance written to the caller's TensorDict last, all of it or nothing."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from tensordict import TensorDictBase

from tdhook.attribution._aliased_inputs import checked_after_run
from tdhook.attribution._backward import drop_records, leaf_relevance
from tdhook.attribution._backward_passes import InputsReached, check_split_dim
from tdhook.attribution._call_signatures import call_signature
from tdhook.attribution._chain_plan import planned_call, planned_feed, planned_updates
from tdhook.attribution._context import marks_for_target
from tdhook.attribution._detached_caches import caches_detached
from tdhook.attribution._differentiable import relevance_graph
from tdhook.attribution._held_softmax_targets import checked_relevance, with_held_softmax_cause
from tdhook.attribution._inputs import explained_in_call, validate_inputs
from tdhook.attribution._keys import check_writable
from tdhook.attribution._model_changes import follow_model_changes, note_call_end
from tdhook.attribution._model_run import cache_watch_of, run_model
from tdhook.attribution._numeric_inputs import report_numeric_inputs
from tdhook.attribution._policy_targets import allowed_action, held_action_record
from tdhook.attribution._ragged_stacks import raise_for_ragged
from tdhook.attribution._random_modules import warn_for_random_modules
from tdhook.attribution._run_errors import run_error
from tdhook.attribution._scaled_passes import UNRECORDED, check_overflow, scaled_target, scaled_when_overflowing
from tdhook.attribution._tokens import is_embedding_leaf
from tdhook.attribution._training_norms import warn_for_training_norms
from tdhook.attribution._writes import relevance_updates, returned_tensordict, set_all_or_nothing, with_input_writes
from tdhook.attribution.rules._keeping_graph import RelevancePass
from tdhook.attribution.rules._norm_function_layout import late_norm_nodes_laid_out
from tdhook.attribution.targets import (
    TargetWithoutGradient,
    explained_output,
    initial_relevance,
    resolve_target_key,
    zero_output_seeds,
)

__all__ = ["explain"]

# Sets the per-call state on the wrapper without nn.Module's __setattr__ (a microsecond a call: it looks the name up
# among parameters, buffers and submodules, which these plain values never are).
_set_state = object.__setattr__


@contextlib.contextmanager
def _explaining(lrp: Any) -> Iterator[RelevancePass | None]:
    """Grad on for a call's forward and backward passes, with the graph of differentiable relevance; the caches
    handed to the model (a generation loop's) then detached, as the outputs are written (``create_graph`` keeps
    both graphs)."""
    with caches_detached(*cache_watch_of(lrp), keep_graph=lrp.create_graph), torch.enable_grad():
        with relevance_graph(lrp.create_graph and not lrp._inactive, lrp._handles) as graph:
            yield graph


def explain(lrp: Any, tensordict: TensorDictBase) -> tuple[TensorDictBase, Callable[[], None]]:
    """Run ``lrp``'s model on ``tensordict`` under its rules and compute the relevance of every target; return the
    TensorDict the call gives back and the step that writes the results into it (the call's last step, run once
    the context entered for the call, if any, is left).

    Examples:
        >>> from tensordict import TensorDict
        >>> from torch import nn
        >>> from tdhook.attribution import LRP
        >>> net = nn.Linear(3, 1)
        >>> td = TensorDict(x=torch.ones(2, 3), batch_size=[2])
        >>> with LRP(net, in_keys=["x"], out_keys=["y"]) as lrp:
        ...     out, write = explain(lrp, td)
        ...     ("relevance", "x") in out.keys(True), write(), ("relevance", "x") in out.keys(True)
        (False, None, True)
    """
    follow_model_changes(lrp)  # a module put in since the context was entered gets its rule
    _set_state(lrp, "_marks_read", lrp._marks_read or marks_for_target(lrp._handles or [], lrp.target))
    try:
        explained = explained_in_call(tensordict, lrp.explained_keys, lrp._defaulted_inputs, lrp._optional_inputs)
        explained_now = [key for key, e in zip(lrp.explained_keys, explained, strict=True) if e]
        validate_inputs(tensordict, explained_now, differentiable=lrp.create_graph)
    except RuntimeError as err:  # a lazy stack of entries of different shapes is named
        raise_for_ragged(tensordict, lrp.explained_keys, "input", err)
        raise
    check_writable(tensordict, lrp.relevance_keys, lrp.token_relevance_keys)
    if lrp._stochastic:
        lrp._stochastic = warn_for_random_modules("LRP", lrp._stochastic, tensordict)  # once per context
    if lrp._training_norms:
        lrp._training_norms = warn_for_training_norms("LRP", lrp._training_norms)  # once per context
    work = tensordict.copy()
    signature = call_signature(work, lrp.in_keys)  # a forward may branch on it: its first call is watched
    lrp._layers.clear()
    lrp._tokens.clear()
    try:
        with _explaining(lrp) as graph:
            planned = planned_call(lrp, explained, work, signature)  # a chain of layers: no hooks, modes or autograd
            leaves, fed = planned_feed(  # integer tokens go to TokenInputs: their embeddings' relevance is theirs
                planned, work, lrp.explained_keys, lrp._tokens, explained, lrp.create_graph
            )
            with checked_after_run("LRP", tensordict, lrp.explained_keys, fed, lrp.in_keys):
                try:
                    if planned:
                        result, calls = planned.run(work), None
                    else:
                        result, calls = run_model(lrp, work, leaves, fed, signature)
                    lrp._function_gates.settle(work if result is None else result, lrp)
                except Exception as err:
                    lrp._tokens.raise_for_unembedded(leaves, err)
                    error = run_error(err, tensordict, lrp.explained_keys, lrp.named_explained_modules())
                    if error is err:
                        raise
                    raise error from err
            report_numeric_inputs(lrp, leaves)  # integers the first call saw computed with as numbers
            lrp._tokens.raise_for_unembedded(leaves, optional=lrp._defaulted_inputs)
            result = with_input_writes(tensordict, work, result, lrp.explained_keys)  # a loss's td_error
            # The caller's TensorDict, unless the module cut the batch.
            out = returned_tensordict(tensordict, result, "LRP", lrp.named_explained_modules, lrp.module)
            relevances, outputs = [], []
            names = list(lrp.targets)
            seeds, reach = [], InputsReached(lrp.explained_keys, len(names))
            held: dict = {}  # a stored transition's action explained, written back over the call's own draw
            for position, name in enumerate(names):
                try:
                    target_key = resolve_target_key(result, *lrp.targets[name], lrp._candidates.of(lrp, name))
                    output = explained_output(result, target_key, lrp.explained_keys, lrp.targets[name][1])
                except TargetWithoutGradient as err:  # CP-LRP's held softmax may be why: said where it is
                    raise with_held_softmax_cause(err, lrp.rule_mapper) from None
                except RuntimeError as err:
                    raise_for_ragged(result, [key for key in [lrp.targets[name][0]] if key is not None], "output", err)
                    raise
                target = lrp.target
                if target is None:  # a sampling policy explains the action taken (a transition's, kept)
                    target = allowed_action(lrp.targets[name][1], target_key, result, tensordict)
                    held.update(held_action_record(lrp.targets[name][1], target_key, result, tensordict))
                one_pass = functools.partial(
                    planned.one_pass if planned else functools.partial(_one_pass, lrp),
                    leaves=leaves,
                    fed=fed,
                    graph=graph,
                )
                first_seed: list = []

                def relevance_at(scale: float, keep: bool) -> list:
                    # The target's relevance scaled by ``scale`` (see _scaled_passes): 1 but where float16 overflows.
                    grad_outputs, at_zero = initial_relevance(
                        output, scaled_target(target, scale), target_key, out.batch_dims
                    )
                    if scale != 1 and not callable(target):
                        grad_outputs = grad_outputs * scale
                    first_seed.append(grad_outputs)
                    try:
                        extra = zero_output_seeds(output, at_zero, target_key) if at_zero is not None else []
                    except ValueError:  # no rule carries it: where R / output overflowed float16, a smaller scale
                        check_overflow(output, at_zero, scale)
                        raise
                    if lrp._norm_calls.found is False and not planned:  # a norm function the first call did not make
                        late_norm_nodes_laid_out(output, *([seed for seed, _ in extra] if extra else ()))
                    _set_state(lrp, "_split_dim", check_split_dim(lrp.split_dim, output, target_key, out.batch_dims))
                    if len(first_seed) == 1:
                        outputs.append(output)
                        if calls is not None and position == len(names) - 1:
                            lrp._coverage.report(calls, outputs, lrp.named_explained_modules(), lrp.rule_mapper)
                    reached = reach if len(first_seed) == 1 else UNRECORDED  # the first pass's record stands
                    passes = (output, grad_outputs, extra, target_key, lrp._split_dim, keep, reached)
                    return checked_relevance(lrp.rule_mapper, one_pass, *passes, leaves, lrp.memory_budget)

                retain = position < len(names) - 1  # the next target reuses this forward pass
                every_unit = isinstance(target, str)  # target="all": its units' passes are not scaled
                relevances += scaled_when_overflowing(
                    relevance_at, output, retain, target_key, leaves, not every_unit, first_seed
                )
                seeds.append((name, output.detach(), first_seed[0]))
    finally:
        lrp._layers.clear()
        lrp._tokens.clear()
        drop_records(lrp._handles or [])
        note_call_end(lrp)  # hooks registered from here to the next call are the caller's (see _model_changes)

    def write() -> None:  # the last step of a call: all of its results, or none
        lrp._coverage.keep(out.batch_dims, seeds, relevances)
        updates = planned_updates(planned, out, result, lrp.explained_keys, fed, detach=not lrp.create_graph)
        updates.update(held)
        keys = (lrp.relevance_keys, lrp.token_relevance_keys, lrp._relevance_sources)
        updates.update(relevance_updates(out, relevances, *keys))
        set_all_or_nothing(out, updates)

    return out, write


def _one_pass(lrp: Any, seeds: list, keep: bool, leaves: list, fed: list, graph: RelevancePass | None) -> tuple:
    relevances, used = leaf_relevance(
        seeds, leaves, fed, lrp._handles or [], lrp.named_explained_modules, keep, lrp.create_graph, graph
    )
    return _finish(lrp, relevances, leaves), used


def _finish(lrp: Any, relevances: list[torch.Tensor | None], leaves: list[torch.Tensor | None]) -> list:
    # Token relevance: the relevance of each token's embedding vector, summed over its features.
    for i, leaf in enumerate(leaves):
        if leaf is not None and is_embedding_leaf(leaf):
            relevances[i] = lrp._tokens.per_token(i, relevances[i])
    like = next(leaf for leaf in leaves if leaf is not None)
    return relevances + [lrp._layers.pop(name, like) for name in lrp.layer_keys]
