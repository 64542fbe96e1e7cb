"""What every attribution method other than LRP shares: keys, the target resolved once, evaluations, writes.

:class:`AttributionMethod` is the ``TensorDictModuleBase`` that the methods of
this package subclass. It runs the wrapped model once on the caller's inputs
(the outputs it writes, and the target it resolves there), evaluates the
model on perturbed copies of the explained inputs, a whole batch of
perturbations in one forward pass, and writes the outputs and the
attributions all at once.

Examples:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> class Doubled(AttributionMethod):
    ...     def _attribute(self, call):
    ...         return [2 * x.unsqueeze(0) for x in call.inputs]
    >>> method = Doubled(torch.nn.Linear(3, 2), in_keys=["x"], out_keys=["y"])
    >>> td = method(TensorDict(x=torch.ones(4, 3), batch_size=[4]))
    >>> td["attribution", "x"][0]
    tensor([2., 2., 2.])
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey, unravel_key_list
from torch import nn

from tdhook.attribution._aliased_inputs import checked_after_run
from tdhook.attribution._chosen_values import chosen_action
from tdhook.attribution._gradient_hooks import backward_hooks_checked
from tdhook.attribution._inputs import describe, feed_inputs, optional_inputs, validate_inputs
from tdhook.attribution._kept_grads import KeptGrads
from tdhook.attribution._keys import check_free, check_read, check_writable, read_not_written, relevance_keys
from tdhook.attribution._keyword_calls import keyword_dispatch
from tdhook.attribution._loss_callers import refuse_loss_module_caller
from tdhook.attribution._no_grad_values import caller_values_in
from tdhook.attribution._orphan_hooks import orphans_removed
from tdhook.attribution._plain_modules import as_tensordict_module, call_plain
from tdhook.attribution._policy_targets import allowed_action, held_action_record
from tdhook.attribution._ragged_stacks import raise_for_ragged
from tdhook.attribution._random_modules import random_modules, warn_for_random_modules
from tdhook.attribution._read_keys import carried_inputs
from tdhook.attribution._run_errors import run_error
from tdhook.attribution._running_statistics import refuse_moving_statistics
from tdhook.attribution._tokens import TokenInputs
from tdhook.attribution._writes import model_updates, returned_tensordict, set_all_or_nothing, with_input_writes
from tdhook.attribution.methods._batch_statistics import (
    BufferValues,
    batch_normalisers,
    buffers_kept,
    buffers_restored_on_error,
)
from tdhook.attribution.methods._call_keys import keys_explained_in_call, narrowed
from tdhook.attribution.methods._cross_sample_outputs import scored_across_copies
from tdhook.attribution.methods._global_rng import global_rng_kept
from tdhook.attribution.methods._mixed_copies import checked_for_mixing, copies_apart, known_to_mix
from tdhook.attribution.methods._norm_gradients import norm_gradients_laid_out
from tdhook.attribution.methods._options import MISSING
from tdhook.attribution.methods._random_draws import RandomDraws, random_states
from tdhook.attribution.methods._sampled_targets import sampled_target
from tdhook.attribution.methods._settable_options import FixedKeys
from tdhook.attribution.methods._time_reads import read_as_one_sequence, recurrent_layers, time_lengths
from tdhook.attribution.rules._caller import warn_at_caller
from tdhook.attribution.rules._dropout_calls import dropout_watch
from tdhook.attribution.rules._meta_tensors import meta_tensors_refused
from tdhook.attribution.rules._norm_function_layout import NormFunctionCalls, late_norm_nodes_laid_out
from tdhook.attribution.targets import (
    EveryUnit,
    Target,
    initial_relevance,
    named_targets,
    raise_for_no_gradient,
    resolve_target_key,
    target_output,
    zero_entries,
)
from tdhook.attribution.tunables import ModelTunable, RecordedModules

__all__ = ["AttributionMethod", "Call", "hooks_removed"]

_NOTHING = contextlib.nullcontext()


@dataclass
class Call:
    """One call of a method: the caller's inputs and what the unperturbed forward pass resolved.

    ``seeds`` has one row per explained output unit (one row unless
    ``target="all"``); the explained quantity of a forward pass is its target
    output times a row, summed over the output's non-batch dimensions.
    ``buffers_before`` holds the buffers of the modules in training mode as the
    caller left them, before the unperturbed pass moved them: every perturbed
    pass starts from them. ``recurrent`` holds the model's recurrent layers
    (of a method that evaluates copies) and ``time_lengths`` the time lengths
    they saw in the unperturbed pass (see
    :mod:`~tdhook.attribution.methods._time_reads`). ``positions_alone``: the
    model reads across the last batch dimension, and each step of a
    perturbation method perturbs one position of it per copy (see
    :mod:`~tdhook.attribution.methods._positions_alone`).
    """

    tensordict: TensorDictBase
    inputs: list[torch.Tensor]
    base: TensorDictBase
    result: TensorDictBase
    target_key: NestedKey
    output: torch.Tensor
    seeds: torch.Tensor
    all_units: bool
    fed: list[torch.Tensor]
    leaves: list[torch.Tensor] = field(default_factory=list)
    separate_copies: bool = False
    mixing_checked: bool = False  # the copies stacked in a pass were compared with a copy alone (_mixed_copies)
    buffers_before: BufferValues | None = None
    recurrent: dict[str, nn.Module] = field(default_factory=dict)
    time_lengths: set = field(default_factory=set)
    positions_alone: bool = False  # each position of the last batch dimension perturbed alone (_positions_alone)
    held_record: dict = field(default_factory=dict)  # a stored transition's action explained (held_action_record)

    @property
    def batch_shape(self) -> torch.Size:
        """The caller's batch shape."""
        return self.tensordict.batch_size

    @property
    def batch_dims(self) -> int:
        """The number of batch dimensions."""
        return self.tensordict.batch_dims


def _explained_in_batch(method: AttributionMethod, cut: TensorDictBase, batch: torch.Size) -> TensorDictBase:
    """``method``'s call on ``cut``, a shallow copy of the caller's TensorDict of batch ``batch`` with the fewer
    batch dimensions its module returned. Where they are none (a loss's mean over the batch: one output), the module
    runs on the inputs as one sample, which some refuse (torchrl's value estimators need a batch): the error says
    why it ran so, and what explains each sample.

    Examples:
        >>> from tensordict import TensorDict
        >>> from tdhook.attribution import Saliency
        >>> class Mean(TensorDictModuleBase):  # a loss's mean, in a new TensorDict (as torchrl's losses return)
        ...     in_keys, out_keys = ["x"], ["m"]
        ...     def forward(self, td):
        ...         if not td.batch_size:
        ...             raise ValueError("a batch is needed")
        ...         return TensorDict(m=td["x"].sum(-1).mean())
        >>> try:
        ...     Saliency(Mean())(TensorDict(x=torch.ones(4, 3), batch_size=[4]))
        ... except RuntimeError as err:
        ...     print(str(err)[:98])
        Saliency: the module returned one output for the whole batch [4] (a mean over it), explained as on
    """
    try:
        return method.forward(cut)
    except Exception as err:
        if cut.batch_dims:
            raise
        name = type(method).__name__
        raise RuntimeError(
            f"{name}: the module returned one output for the whole batch {list(batch)} (a mean over it), explained "
            f"as one sample: the module ran again on the inputs as one sample (batch size []), and raised "
            f"{type(err).__name__}: {err}. A torchrl loss explains each sample with reduction='none'; LRP explains "
            "the whole batch's output without running the module again"
        ) from err


def _written_dims(method: AttributionMethod, tensordict: TensorDictBase, result: TensorDictBase) -> int:
    """The batch dimensions of the TensorDict a call writes to: a module that returns fewer than it was given (a
    decision transformer's one action per ``[B, T]`` context) leaves the rest of its output's dimensions to units."""
    name, modules = type(method).__name__, method.named_explained_modules
    return returned_tensordict(tensordict, result, name, modules, method.module).batch_dims


def _rename(err: Exception, owner: str) -> Exception:
    """``err`` with the method's name in place of LRP's at the head of its message (the helpers are LRP's).

    Examples:
        >>> str(_rename(ValueError("LRP: target 'q' is wrong"), "Saliency"))
        "Saliency: target 'q' is wrong"
        >>> str(_rename(ValueError("target 'q' is wrong"), "Saliency"))
        "Saliency: target 'q' is wrong"
    """
    if not err.args or not isinstance(err.args[0], str):
        return err
    message = err.args[0]
    message = owner + message[3:] if message.startswith("LRP") else f"{owner}: {message}"
    return type(err)(message, *err.args[1:]).with_traceback(err.__traceback__)


class AttributionMethod(FixedKeys, RecordedModules, TensorDictModuleBase, ModelTunable):
    """The base of the attribution methods: LRP's constructor conventions and one call's machinery.

    Subclasses implement :meth:`_attribute`, which returns, for every
    explained key, a tensor of shape ``[units, *input.shape]``. The base
    writes it at ``(relevance_key, *key)``, with the unit dimension dropped,
    or moved right after the batch dimensions for ``target="all"``.

    Args:
        module: a ``TensorDictModuleBase``, or a plain ``nn.Module`` with
            ``in_keys`` and ``out_keys``.
        in_keys: for a plain module, its input keys; for a TensorDict
            module, the floating-point inputs to explain (all of its in_keys
            by default, leaving out those the TensorDict lacks where the module
            does without them, as for :class:`~tdhook.attribution.LRP`). Keys
            not explained stay fixed.
        out_keys: the output keys of a plain module.
        target_key: the output to explain (the pipeline's final output by
            default, as for :class:`~tdhook.attribution.LRP`).
        target: ``None`` (argmax of the last dimension), an int, a
            LongTensor of per-sample indices, a callable ``output -> relevance``
            (as for LRP: ``lambda y: y * w`` weights the output by ``w``) or
            ``"all"``, resolved once, on the unperturbed input: every
            perturbed output is contracted with the weights found there
            (``relevance / output``).
        relevance_key: the prefix of the attribution keys.
    """

    #: whether the unperturbed forward pass records gradients (methods that differentiate at the input).
    _gradient_at_input = False
    #: whether the model is run again on perturbed copies (:meth:`_evaluate`) after the unperturbed pass.
    _evaluates_copies = True
    #: whether the method differentiates the model (it cannot run under ``torch.inference_mode()``).
    _needs_gradients = True
    #: what refusing a non-floating input says beyond the keys to pass; ``None``: any dtype (a map at a layer alone)
    _floating_inputs: str | None = ""
    #: attributes holding one option per explained key, in their order (narrowed with the keys of a call).
    _per_key_options: tuple[str, ...] = ()
    #: options resolved against the keys of each call (one value, or a dict keyed by in_key), which may hold one
    #: value per sample (a tensor with the batch's shape before a sample's): a caller that explains copies of the
    #: batch stacked along its first dimension repeats them for the copies.
    _per_call_options: tuple[str, ...] = ()

    def __init__(
        self,
        module: TensorDictModuleBase | nn.Module,
        *,
        in_keys: Sequence[NestedKey] | None = None,
        out_keys: Sequence[NestedKey] | None = None,
        target_key: NestedKey | None = None,
        target: Target = None,
        relevance_key: str = "attribution",
    ) -> None:
        super().__init__()
        name = type(self).__name__
        try:
            module, plain = as_tensordict_module(module, in_keys, out_keys)
        except TypeError as err:
            raise TypeError(str(err).replace("LRP", name, 1)) from None
        self._plain = plain
        self.module = module
        # As LRP: by default the module's in_keys it does not fill itself (a composite actor's "params").
        given = read_not_written(module)
        self.explained_keys = unravel_key_list(list(in_keys)) if in_keys is not None else given
        # Default keys: a call leaves out those holding booleans, and the recurrent states and the inputs of a
        # partial_tolerant sequence that the TensorDict lacks.
        self._defaulted_inputs = in_keys is None
        self._optional_inputs = optional_inputs(module)
        if not self.explained_keys:
            raise ValueError(f"{name}: no input key to explain; pass in_keys=[...]")
        check_read(
            name, given, self.explained_keys, module=module
        )  # its attribution would be zero whatever the model does
        try:
            targets = named_targets(module, target_key)
        except (TypeError, ValueError) as err:
            raise _rename(err, name) from None
        if set(targets) != {None}:
            raise ValueError(
                f"{name}: explains one output; pass target_key=<key> (the module has several defaults: "
                f"{sorted(str(k) for k in targets)})"
            )
        self._target = targets[None]
        self.target_key = self._target[0]
        self.target = target
        self.relevance_key = relevance_key
        self.relevance_keys = relevance_keys(relevance_key, [None], self.explained_keys, name)
        try:
            check_free(module, self.relevance_keys)
        except ValueError as err:
            raise _rename(err, name) from None
        self.in_keys = unravel_key_list(list(dict.fromkeys([*module.in_keys, *self.explained_keys])))
        self.out_keys = [*unravel_key_list(module.out_keys), *self.relevance_keys]
        self._warned = False
        self._warned_sampled = False
        self._draws = RandomDraws()  # shared by the narrowed copies of a call
        self._norm_calls = NormFunctionCalls()  # whether the model calls F.batch_norm and the like (first call)

    # ------------------------------------------------------------------ call

    @keyword_dispatch
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        name = type(self).__name__
        refuse_loss_module_caller(name, self, None)  # its detached outputs would give a loss no gradient
        try:
            flags = keys_explained_in_call(self, tensordict)
        except RuntimeError as err:  # a lazy stack of entries of different shapes is named, as LRP names it
            raise_for_ragged(tensordict, self.explained_keys, "input", err, name)
            raise
        if not all(flags):  # default keys: as LRP, not the flags and masks, nor recurrent states left out
            method = narrowed(self, flags)
            try:
                return method.forward(tensordict)
            finally:
                self._warned, self._warned_sampled = method._warned, method._warned_sampled
        for option in self._per_key_options:  # with default keys, a dict needs entries for the keys a call explains
            missing = [
                key for key, value in zip(self.explained_keys, getattr(self, option), strict=True) if value is MISSING
            ]
            if missing:
                raise KeyError(  # the option by its constructor name (``_strides`` holds ``strides`` per key)
                    f"{name}: {option.lstrip('_')} has no entry for input keys {missing}, which the call explains; "
                    f"give one per explained input key {self.explained_keys}"
                )
        try:
            # A method that needs no gradient runs under inference mode, which the check refuses for the others.
            with contextlib.nullcontext() if self._needs_gradients else torch.inference_mode(False):
                validate_inputs(tensordict, self.explained_keys)
                check_writable(tensordict, self.relevance_keys)
        except (KeyError, TypeError, RuntimeError) as err:
            if isinstance(err, RuntimeError):
                raise_for_ragged(tensordict, self.explained_keys, "input", err, name)
            raise _rename(err, name) from None
        _refuse_non_floating_inputs(self, tensordict)
        self._check_batch(tensordict)
        refuse_moving_statistics(name, self.named_explained_modules())
        self._warn_for_random_modules(tensordict)
        # The random states a first pass may move (see RandomDraws), read until the check has run; the CPU's is one.
        states_before = None if self._draws.checked else random_states(self.module)
        rng_before = torch.get_rng_state() if states_before is None else states_before[0]
        # A hook of the call whose registration failed before giving back its handle is removed where the call fails.
        swept = orphans_removed(lambda: [*self.named_explained_modules().values(), self.module], tuple)
        with buffers_restored_on_error(self.module) as before, swept:  # up to the write: a call that fails moves none
            # A module computing from a parameter on the meta device returns whatever the memory held: refused.
            # A model's own backward may write the parameters' .grad (Reformer's reversible layers): put back.
            kept = KeptGrads(self.module).kept(None) if self._needs_gradients else _NOTHING
            # PyTorch's CPU BatchNorm backward misreads a gradient laid out unlike the norm's output: laid out again.
            laid_out = norm_gradients_laid_out(self.module, self._norm_calls) if self._needs_gradients else _NOTHING
            with meta_tensors_refused(self.module), self._model_context(), kept, laid_out:
                # Under the caller's no_grad, the outputs written are the plain call's (LSTM, transformer kernels).
                with caller_values_in(self.named_explained_modules()) if _no_grad_values(self) else _NOTHING:
                    call = self._first_pass(tensordict)
                call.buffers_before = before
                self._warn_for_sampled_target(call)
                cut = returned_tensordict(tensordict, call.result, name, self.named_explained_modules, self.module)
                if cut is tensordict:
                    # The perturbed passes draw on a fork: the caller's random state moves as one plain call moves it.
                    with global_rng_kept(self.module):
                        self._draws.check(self, call, states_before)
                        attributions = self._attribute(call)
                        extra = self._extra_updates(call)
            if cut is not tensordict:  # the module returned fewer batch dimensions: explain in its batch, as LRP does
                before.restore()  # that call runs the model's own pass again, from the random state of this one
                torch.set_rng_state(rng_before)
                return _explained_in_batch(self, cut, tensordict.batch_size)
            updates = model_updates(tensordict, call.result, self.explained_keys, call.fed) | call.held_record
            for key, attribution in zip(self.relevance_keys, attributions, strict=True):
                updates[key] = self._per_unit(call, attribution)
            updates.update(extra)
            set_all_or_nothing(tensordict, updates)
            return tensordict

    def named_explained_modules(self) -> dict[str, nn.Module]:
        """The wrapped model's modules by name, relative to the object passed as ``module`` (as LRP names them)."""
        root = self.module.module if self._plain else self.module
        return dict(root.named_modules())

    def _warn_for_random_modules(self, tensordict: TensorDictBase) -> None:
        """Warn, once per wrapper, if a dropout module in training mode makes every forward pass draw anew."""
        if not self._warned:
            modules = random_modules(self.named_explained_modules())
            self._warned = warn_for_random_modules(type(self).__name__, modules, tensordict) != modules

    def _warn_for_sampled_target(self, call: Call) -> None:
        """Warn, once per wrapper, if the target is drawn at random anew in every pass of a method that compares
        passes (see :func:`~tdhook.attribution.methods._sampled_targets.sampled_target`)."""
        if self._evaluates_copies and not self._warned_sampled:
            found = sampled_target(self.module, call.target_key)
            if found is not None:
                warnings.warn(
                    f"{type(self).__name__}: the target {call.target_key!r} is drawn at random ({found}), so each "
                    "forward pass draws anew and the explanation compares independent draws; explain the "
                    "distribution's parameters (target_key='loc', say) or sample deterministically "
                    "(tensordict.nn.set_interaction_type('deterministic'))",
                    stacklevel=4,
                )
                self._warned_sampled = True  # once warned: a warning the caller's filter made an error is given again

    def _check_batch(self, tensordict: TensorDictBase) -> None:
        """Refuse, before the model runs, a batch the method cannot explain (none by default)."""

    def _per_unit(self, call: Call, attribution: torch.Tensor) -> torch.Tensor:
        attribution = attribution.detach()
        if call.all_units:
            return attribution.movedim(0, call.batch_dims)
        return attribution.squeeze(0)

    def _model_context(self) -> contextlib.AbstractContextManager:
        """What the model runs under for the whole call (hooks of a method); nothing by default."""
        return contextlib.nullcontext()

    def _extra_updates(self, call: Call) -> dict:
        """Entries written besides the outputs and the attributions (none by default)."""
        return {}

    def _attribute(self, call: Call) -> list[torch.Tensor]:
        """Per explained key, the attribution of each unit: ``[units, *input.shape]``."""
        raise NotImplementedError

    def _run(self, work: TensorDictBase) -> TensorDictBase:
        try:
            with _hooks_checked(self):  # the caller's backward hooks that would change a gradient: refused
                result = call_plain(self.module, work) if self._plain else self.module(work)
        except Exception as err:
            error = run_error(err, work, self.explained_keys, self.named_explained_modules(), type(self).__name__)
            if error is err:
                raise
            raise error from err
        return work if result is None else result

    def _first_pass(self, tensordict: TensorDictBase) -> Call:
        """Run the model on the caller's inputs: the outputs to write and the target, resolved once."""
        name = type(self).__name__
        work = tensordict.copy()
        grad = self._gradient_at_input
        base = carried_inputs(self.module, tensordict).exclude(*self.explained_keys)
        if self._evaluates_copies:  # as the caller gave them: the model may scale an input in place (obs /= 255)
            base = base.clone()
        modules = self.named_explained_modules() if self._evaluates_copies else {}
        recurrent = recurrent_layers(modules)
        # Dropout called as a function (attention dropout) draws anew in every pass, as a Dropout module does.
        watch = _NOTHING if self._warned else dropout_watch(self.named_explained_modules().values())
        with _noting_hooks_without_gradient(name, grad), time_lengths(recurrent) as lengths:
            leaves, fed = feed_inputs(work, self.explained_keys, TokenInputs(self.explained_keys))
            # A write into memory an explained input shares with another input is refused after the run.
            with checked_after_run(name, tensordict, self.explained_keys, fed, self.in_keys), watch as dropping:
                result = with_input_writes(tensordict, work, self._run(work), self.explained_keys)
        if dropping is not None and dropping.found:
            warn_at_caller(
                f"{name}: the forward pass calls dropout (p={dropping.found}) in training mode, outside any Dropout "
                "module (attention dropout, mostly), so each forward pass drops other units and the attribution is "
                "random from call to call; call .eval() on the model for a deterministic one"
            )
            self._warned = True  # once warned: a warning the caller's filter made an error is given again
        target_key, target, output = _read_target(self, result)
        if not isinstance(output, torch.Tensor) or not output.is_floating_point():
            raise TypeError(
                f"{name}: target {target_key!r} is {describe(output)}; pass target_key=<a floating-point output>"
            )
        if grad:
            raise_for_no_gradient(name, target_key, output, self._target[1])
        try:
            target, record = _policy_target(self, target, target_key, result, tensordict)
            seeds, at_zero = initial_relevance(output, target, target_key, _written_dims(self, tensordict, result))
        except (IndexError, ValueError, TypeError) as err:
            raise _rename(err, name) from None
        if at_zero is not None:
            raise ValueError(
                f"{name}: the callable target puts relevance on {zero_entries(at_zero, target_key, output)}; the "
                "output is weighted by relevance / output, which cannot carry it: return the output times the weights "
                "(lambda y: y * w)"
            )
        if isinstance(seeds, EveryUnit):
            seeds = seeds.seeds(0, len(seeds))
        all_units = seeds.dim() > output.dim()
        return Call(
            tensordict=tensordict,
            inputs=[tensordict.get(k) for k in self.explained_keys],
            base=base,
            result=result,
            target_key=target_key,
            output=output,
            seeds=seeds if all_units else seeds.unsqueeze(0),
            all_units=all_units,
            fed=fed,
            leaves=leaves if grad else [],
            separate_copies=bool(batch_normalisers(modules)) or known_to_mix(self),
            mixing_checked=copies_apart(self.module, tensordict.batch_dims),
            recurrent=recurrent,
            time_lengths=lengths,
            held_record=record,
        )

    # ------------------------------------------------------------------ evaluations

    def _contract(self, call: Call, output: torch.Tensor, copies: int | None) -> torch.Tensor:
        """The explained quantity: ``[units, *batch]``, or ``[units, copies, *batch]`` for stacked copies."""
        seeds = call.seeds
        if copies is None:
            product = output.unsqueeze(0) * seeds
            start = 1 + call.batch_dims
        else:
            product = output.reshape(copies, *seeds.shape[1:]).unsqueeze(0) * seeds.unsqueeze(1)
            start = 2 + call.batch_dims
        dims = tuple(range(start, product.dim()))
        return product.sum(dims) if dims else product

    def _evaluate(
        self, call: Call, perturbed: Sequence[torch.Tensor], grad: bool = False
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The explained quantity at ``copies`` perturbed inputs, in one forward pass.

        A model that normalises over the batch (BatchNorm in training mode) runs one copy per pass instead, as the
        model on one batch runs; so does, from the first stacked pass that shows it on, a model whose recurrent layer
        reads the batch's first dimension as time (:mod:`~tdhook.attribution.methods._time_reads`), whose target
        scores the samples of its batch against each other (:mod:`~tdhook.attribution.methods._cross_sample_outputs`),
        or that mixes them in its forward (:mod:`~tdhook.attribution.methods._mixed_copies`).

        Args:
            call: the call.
            perturbed: per explained key, ``[copies, *input.shape]``.
            grad: whether to record gradients (the returned leaves are the perturbed inputs).

        Returns:
            ``[units, copies, *batch]``, and the leaves (empty without ``grad``).
        """
        copies = perturbed[0].shape[0]
        leaves = [x.detach().requires_grad_(True) for x in perturbed] if grad else []
        inputs = leaves if grad else perturbed
        parts, start = [], 0
        with torch.enable_grad() if grad else torch.no_grad():
            while start < copies:
                stop = start + 1 if call.separate_copies else copies
                chunk = [x[start:stop] for x in inputs]
                part = checked_for_mixing(self, call, chunk, self._run_copies(call, chunk))
                if part is not None:  # None: the copies ran as one sequence, or mixed, and run again one per pass
                    parts.append(part)
                    start = stop
            objective = torch.cat(parts, dim=1)
        if grad and not objective.requires_grad:
            raise ValueError(f"{type(self).__name__}: target {call.target_key!r} does not depend on the inputs")
        return objective, leaves

    def _run_copies(self, call: Call, perturbed: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """The explained quantity at perturbed copies of the batch, stacked in one forward pass: ``[units, copies,
        *batch]``; ``None`` where a recurrent layer read the copies as one sequence, or the target scored them against
        each other (``call.separate_copies`` is then set)."""
        copies = perturbed[0].shape[0]
        batch = call.batch_shape
        shape = _copies_shape(copies, batch)
        # Copies of the inputs left fixed, never views of the caller's: the model may write into them.
        work = call.base.unsqueeze(0).expand(copies, *batch).clone().reshape(shape)
        for key, x in zip(self.explained_keys, perturbed, strict=True):
            work.set(key, x.reshape(*shape, *x.shape[1 + call.batch_dims :]).clone())
        layers = call.recurrent if copies > 1 else {}
        with buffers_kept(self.module, call.buffers_before), time_lengths(layers) as lengths:  # the caller's statistics
            with _noting_stacked_sample(self, copies, call.batch_dims):
                output = target_output(self._run(work), call.target_key, self._target[1])
        if read_as_one_sequence(call.time_lengths, lengths) or (
            copies > 1 and scored_across_copies(output, len(shape), call.output, call.batch_dims)
        ):
            call.separate_copies = True
            return None
        return self._contract(call, output, copies)

    def _gradients(
        self,
        objective: torch.Tensor,
        leaves: Sequence[torch.Tensor],
        unreached: list[bool] | None = None,
        target_key: NestedKey | None = None,
    ) -> list[torch.Tensor]:
        """Per leaf, the gradient of each unit's explained quantity: ``[units, *leaf.shape]``.

        Zero where a unit does not depend on the leaf; ``unreached``, when given, is filled with whether no unit
        depends on each leaf (no path to it in the graph). Without it, the leaves are the explained inputs', in
        order, and one that no unit depends on is refused by name, as LRP refuses it
        (:func:`raise_for_unreached_input`), ``target_key`` naming the output.
        """
        if self._norm_calls.found is False:  # a norm called as a function that the first call did not make
            late_norm_nodes_laid_out(objective)
        units = objective.shape[0]
        per_unit = []
        reached = [False] * len(leaves)
        with torch.enable_grad():
            for u in range(units):
                grads = torch.autograd.grad(objective[u].sum(), leaves, retain_graph=u < units - 1, allow_unused=True)
                reached = [r or g is not None for r, g in zip(reached, grads, strict=True)]
                per_unit.append([torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads, strict=True)])
        if unreached is not None:
            unreached[:] = [not r for r in reached]
        else:
            raise_for_unreached_input(type(self).__name__, target_key, self.explained_keys, reached)
        return [torch.stack([unit[i] for unit in per_unit]) for i in range(len(leaves))]

    def _input_gradients(self, call: Call) -> list[torch.Tensor]:
        """The gradients at the unperturbed input (needs ``_gradient_at_input``): ``[units, *input.shape]``."""
        with torch.enable_grad():
            objective = self._contract(call, call.output, None)
            return self._gradients(objective, call.leaves, target_key=call.target_key)


@contextlib.contextmanager
def _noting_hooks_without_gradient(name: str, grad: bool) -> Iterator[None]:
    """A first pass with gradient where ``grad``, else under ``torch.no_grad()``, where a forward putting a hook on a
    tensor fails with torch's error alone: a note says why and what to write instead."""
    try:
        with torch.enable_grad() if grad else torch.no_grad():
            yield
    except RuntimeError as err:
        if not grad and "register a hook on a tensor that doesn't require gradient" in str(err):
            err.add_note(
                f"{name}: its first pass on the caller's inputs, which resolves the target and the outputs to write, "
                "runs without gradient (torch.no_grad()): a forward that puts a hook on a tensor must do so only "
                "where the tensor requires grad (if h.requires_grad: h.register_hook(...)), as under any "
                "torch.no_grad() call of the model"
            )
        raise


def _hooks_checked(method: AttributionMethod) -> contextlib.AbstractContextManager[None]:
    """The caller's backward hooks on ``method``'s modules (and torch's global ones) checked in the forward passes
    run inside (torch takes a module's hooks when its forward runs): one that would change a gradient is refused by
    name, as the gradient methods' attributions are made of it."""
    return backward_hooks_checked(method.named_explained_modules(), _nothing, type(method).__name__)


def _nothing() -> None:
    """No state to reset where a hook is refused: every call checks the hooks."""


def _copies_shape(copies: int, batch: torch.Size) -> tuple[int, ...]:
    """The batch shape of ``copies`` copies of a batch stacked in one pass: along its first dimension; on a batch
    ``[]`` a new first dimension, and a copy alone at the sample's own shape, as the model's own pass ran it (a model
    may read its input's dimensions from the front; see :mod:`~tdhook.attribution.methods._mixed_copies`).

    Examples:
        >>> _copies_shape(3, torch.Size([2, 5])), _copies_shape(3, torch.Size([])), _copies_shape(1, torch.Size([]))
        ((6, 5), (3,), ())
    """
    if len(batch):
        return (copies * batch[0], *batch[1:])
    return () if copies == 1 else (copies,)


def pass_gradients(
    method: AttributionMethod, objective: torch.Tensor, leaves: Sequence[torch.Tensor], reached: list[bool]
) -> list[torch.Tensor]:
    """The method's gradients of one of several passes (the points of a path, noisy copies); ``reached`` (one flag
    per leaf, empty before the first pass) notes whether any pass so far reached each leaf. A pass whose graph does
    not reach an input (a branch of the model's own code taken at some points only) gives it zeros; the call refuses
    only an input that no pass reaches (:func:`refuse_unreached`).

    Examples:
        >>> from tensordict.nn import TensorDictModule
        >>> from tdhook.attribution import Saliency
        >>> method = Saliency(TensorDictModule(torch.nn.Linear(2, 1), ["x"], ["y"]))
        >>> x, z, reached = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True), []
        >>> grads = pass_gradients(method, (2 * x).sum().view(1), [x, z], reached)
        >>> reached, grads[1].abs().sum().item()
        ([True, False], 0.0)
    """
    unreached: list[bool] = []
    grads = method._gradients(objective, leaves, unreached)
    before = reached or [False] * len(unreached)
    reached[:] = [r or not u for r, u in zip(before, unreached, strict=True)]
    return grads


def refuse_unreached(method: AttributionMethod, call: Call, reached: Sequence[bool]) -> None:
    """After the passes of :func:`pass_gradients`: refuse an explained input that none of them reached."""
    raise_for_unreached_input(type(method).__name__, call.target_key, method.explained_keys, reached)


def raise_for_unreached_input(
    name: str, target_key: NestedKey | None, keys: Sequence[NestedKey], reached: Sequence[bool]
) -> None:
    """Refuse an explained input that the target does not reach through its gradient: its gradient, and so the
    attribution of every gradient method, would be zero everywhere, whatever the input's effect on the output.

    Examples:
        >>> raise_for_unreached_input("Saliency", "y", ["x", "z"], [True, False])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Saliency: target 'y' does not depend on the explained input 'z' through its gradient ...
    """
    # Leaves that are not one per explained input have no key to name.
    unreached = [key for key, was in zip(keys, reached, strict=True) if not was] if len(keys) == len(reached) else []
    if unreached:
        raise ValueError(
            f"{name}: target {target_key!r} does not depend on the explained input {unreached[0]!r} through its "
            "gradient (the model does not read it for this output, or cuts its path: detach(), .item(), a conversion "
            "to integers, a comparison); its attribution would be zero everywhere, whatever its effect on the output: "
            "leave it out of in_keys, or use a perturbation method (Occlusion, FeatureAblation, "
            "ShapleyValueSampling), which sees paths that the gradient does not"
        )


def _policy_target(
    method: AttributionMethod, target: Any, target_key: NestedKey, result: TensorDictBase, tensordict: TensorDictBase
) -> tuple[Any, dict]:
    """The target to explain and what to write back of a stored transition's action: as LRP, a policy sampling its
    action explains by default the action a transition holds (kept in the output), else the one the call draws."""
    if target is not None:
        return target, {}
    operator = method._target[1]
    return (
        allowed_action(operator, target_key, result, tensordict, owner=type(method).__name__),
        held_action_record(operator, target_key, result, tensordict),
    )


@contextlib.contextmanager
def _noting_stacked_sample(method: AttributionMethod, copies: int, batch_dims: int) -> Iterator[None]:
    """Where the model raises on ``copies`` (more than one) copies of a sample (``batch_dims`` 0: a TensorDict of
    batch ``[]``) stacked along a new first dimension, a note on its error (not on tdhook's own refusals, which name
    the method or LRP): how to run one copy per pass."""
    try:
        yield
    except Exception as err:
        name = type(method).__name__
        if copies > 1 and not batch_dims and not str(err).startswith((f"{name}:", "LRP:")):
            option = "internal_batch_size" if hasattr(method, "internal_batch_size") else "perturbations_per_eval"
            err.add_note(
                f"{name}: the TensorDict has batch [] (one sample), so the {copies} copies of a pass were stacked "
                "along a new first dimension; a model that cannot take them so (one that adds its batch dimension "
                f"itself) runs one copy per pass, at the sample's own shape, with {option}=1"
            )
        raise


def _refuse_non_floating_inputs(method: AttributionMethod, tensordict: TensorDictBase) -> None:
    """Refuse an explained input that is not floating point where the method attributes to its inputs, saying what
    to pass: where the keys were explained by default, the floating-point ones."""
    if method._floating_inputs is None:
        return
    name = type(method).__name__
    for key in method.explained_keys:
        value = tensordict.get(key)
        if value.is_floating_point():
            continue
        advice = method._floating_inputs
        if not advice and method._defaulted_inputs:
            floating = [k for k in method.explained_keys if tensordict.get(k).is_floating_point()]
            advice = (
                "; it is explained by default (in_keys defaults to the keys the module reads, booleans left out): "
                f"pass the keys to explain{f', such as in_keys={floating}' if floating else ''} (an integer mask or "
                "index is then read as it is)"
            )
        raise TypeError(f"{name}: input key {key!r} must be a floating-point tensor, got {describe(value)}{advice}")


def _no_grad_values(method: AttributionMethod) -> bool:
    """Whether the call gives the outputs of the caller's ``no_grad`` (a pass with gradient, called without)."""
    return method._gradient_at_input and not torch.is_grad_enabled()


def _read_target(method: AttributionMethod, result: TensorDictBase) -> tuple[NestedKey, Any, Any]:
    """The target's key, the target and the output ``method`` explains, read from its first pass's ``result``; a
    target held by a lazy stack of entries of different shapes is refused by name, as LRP refuses it."""
    name = type(method).__name__
    try:
        try:
            target_key = resolve_target_key(result, *method._target)
        except KeyError as err:
            raise _rename(err, name) from None
        target = method.target
        # A chosen action's value follows the greedy action of each perturbed input: the methods that evaluate such
        # inputs explain the value of the action chosen here (the action values at that action), as LRP does.
        evaluates = target is None and method._evaluates_copies
        chosen = chosen_action(method.module, target_key, result, name) if evaluates else None
        if chosen is not None:
            target_key, target = chosen
        # With gradient: a slice of an output (a decision transformer's last step) taken under the caller's no_grad
        # would have no graph back to the inputs.
        with torch.enable_grad() if method._gradient_at_input else _NOTHING:
            return target_key, target, target_output(result, target_key, method._target[1])
    except RuntimeError as err:
        raise_for_ragged(result, [key for key in [method._target[0]] if key is not None], "output", err, name)
        raise


@contextlib.contextmanager
def hooks_removed(handles: list) -> Iterator[list]:
    """Yield ``handles`` to fill, and remove every one of them on the way out, by error or not.

    Examples:
        >>> layer = torch.nn.ReLU()
        >>> with hooks_removed([]) as handles:
        ...     handles.append(layer.register_forward_hook(lambda m, i, o: o))
        >>> len(layer._forward_hooks)
        0
    """
    try:
        yield handles
    finally:
        for handle in reversed(handles):
            handle.remove()
        handles.clear()
