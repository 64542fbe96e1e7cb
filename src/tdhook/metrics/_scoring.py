"""The score a perturbation metric tracks: the model's target output, on many perturbed inputs at once.

:class:`Scorer` runs the model once on the unperturbed TensorDict, fixes the target there (``None`` becomes the
argmax of that output, as the explained class stays the same while the input is perturbed), and then scores stacks
of perturbed inputs: ``S`` perturbed versions of a ``[B, ...]`` batch run as one batch ``[S * B, ...]``, in as few
forward passes of moderate size (large enough to spare per-call overhead, small enough to stay in cache).

Examples:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> net = torch.nn.Linear(3, 2, bias=False)
    >>> with torch.no_grad():
    ...     _ = net.weight.copy_(torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]]))
    >>> td = TensorDict(x=torch.tensor([[1.0, 2.0, 3.0]]), batch_size=[1])
    >>> scorer = Scorer(net, td, in_keys=["x"], out_keys=["y"])
    >>> scorer.reference
    tensor([5.])
    >>> scorer.scores({"x": torch.tensor([[[1.0, 0.0, 3.0]], [[9.0, 0.0, 0.0]]])})
    tensor([[3.],
            [0.]])
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from tensordict import TensorDictBase
from tensordict.nn import InteractionType, ProbabilisticTensorDictModule, TensorDictModule, TensorDictModuleBase
from tensordict.nn.probabilistic import interaction_type
from tensordict.utils import NestedKey, unravel_key_list
from torch import nn

from tdhook.attribution._chosen_values import chosen_action
from tdhook.attribution._inputs import explained_in_call, module_in_recurrent_mode, optional_inputs
from tdhook.attribution._map_targets import warn_for_rows_of_a_map
from tdhook.attribution._plain_modules import as_tensordict_module, call_plain
from tdhook.attribution._policy_targets import allowed_action, allowed_mask
from tdhook.attribution._random_modules import deterministic, draw, draws_anew, draws_now, in_mode, random_modules
from tdhook.attribution._read_keys import carried_inputs
from tdhook.attribution._run_errors import run_error
from tdhook.attribution.methods._cross_sample_outputs import scored_across_copies
from tdhook.attribution.methods._random_draws import drew, random_states, redrawn
from tdhook.attribution.methods._sampled_targets import exploration_draws
from tdhook.attribution.methods._time_reads import read_as_one_sequence, recurrent_layers, time_lengths
from tdhook.attribution.rules._dropout_calls import DropoutCalls
from tdhook.attribution.rules._meta_tensors import meta_tensors_refused
from tdhook.attribution.targets import (
    Target,
    initial_gradient,
    initial_relevance,
    named_targets,
    resolve_target_key,
    target_output,
    zero_entries,
)
from tdhook.metrics._batch_statistics import (
    batch_normalising_module,
    hooked,
    samples_apart,
    statistics_kept,
    steps_mixed,
)
from tdhook.metrics._features import explained_keys, stacked_batch
from tdhook.metrics._leading_affine import LeadingAffine

__all__ = ["Scorer", "chunks", "progress_bar"]

# Elements of the explained inputs that one forward pass may hold (stacked perturbation steps times the batch):
# on CPU a small CNN ran fastest with stacks of about this size, and larger ones fell out of cache.
_ELEMENTS_PER_FORWARD = 1 << 16
# The action a metric's default target explains: the one taken, as for LRP (its warnings name the metrics).
_taken_action = functools.partial(allowed_action, owner="metrics")


def _metrics_error(err: Exception) -> Exception:
    """The wrapper's error of a target or key under the metrics' name, listing the targets a metric accepts (one
    unit's score: not ``'all'``, which the wrappers take).

    Examples:
        >>> _metrics_error(TypeError("LRP: target must be None, an int, a LongTensor, a callable or 'all', got float"))
        TypeError('metrics: target must be None, an int, a LongTensor or a callable, got float')
        >>> print(_metrics_error(KeyError("LRP: target key 'q' was not written by the wrapped module")))
        "metrics: target key 'q' was not written by the wrapped module"
    """
    message = err.args[0] if err.args and isinstance(err.args[0], str) else str(err)  # a KeyError's str is quoted
    message = message.replace("LRP:", "metrics:", 1).replace(", a callable or 'all'", " or a callable", 1)
    return type(err)(message)


def _target_key(result: TensorDictBase, key: NestedKey | None, operator: TensorDictModuleBase) -> NestedKey:
    """:func:`resolve_target_key`, its refusal under the metrics' name."""
    try:
        return resolve_target_key(result, key, operator)
    except KeyError as err:
        raise _metrics_error(err) from None


def _refuse_steps_read_together(module: TensorDictModuleBase, td: TensorDictBase) -> None:
    """A torchrl LSTMModule/GRUModule in recurrent mode reads the last batch dimension as time, so each step's
    output depends on the steps before it: perturbing every step at once would count those effects too."""
    if not td.batch_dims or td.batch_size[-1] < 2:
        return
    found = module_in_recurrent_mode(module)
    if found is not None:
        raise ValueError(
            f"metrics: {type(found[1]).__name__} {found[0]!r} runs in recurrent mode, reading the last batch dimension "
            f"(of {list(td.batch_size)}) as time: perturbing every step at once would change each step's output "
            "through the steps before it as well. Score the steps one by one: outside recurrent mode, with the "
            "recurrent states the rollout stored in the TensorDict"
        )


def _refuse_random_modules(modules: Mapping[str, nn.Module], td: TensorDictBase) -> None:
    """A module that draws in training mode (among the model's ``modules``, by name: a dropout, stochastic depth, an
    ``nn.RReLU``'s slopes), or in any mode (a fractional max pooling's regions), draws anew at every forward pass:
    each perturbed input's score would carry its own noise (and the draws would come from the global random state)."""
    for name, found, mask in random_modules(modules):
        if draws_now(found) and (mask is None or td.get(mask, None) is None):
            raise ValueError(
                f"metrics: module {name!r} ({type(found).__name__}, {draw(found)}) {in_mode(found)}: each "
                f"forward pass of the perturbed inputs {draws_anew(found)}, and the scores would mix the perturbation "
                f"with that noise; {deterministic(found)}"
            )


def _refuse_sampled_target(module: nn.Module, key: NestedKey) -> None:
    """A target sampled from a distribution under random interaction is drawn anew at every forward pass: a curve
    of it would be noise."""
    for name, sub in module.named_modules():
        if exploration_draws(sub) and key in unravel_key_list(list(sub.out_keys)):
            raise ValueError(
                f"metrics: target {key!r} is perturbed by module {name!r} ({type(sub).__name__}) with noise drawn "
                "anew at every forward pass while exploration is random or unset: the scores would mix the "
                "perturbation with that noise. Score the action before the exploration step (a model without it) "
                "or call the metric under torchrl's set_exploration_type(ExplorationType.DETERMINISTIC)"
            )
        if isinstance(sub, ProbabilisticTensorDictModule) and key in unravel_key_list(list(sub.out_keys)):
            mode = interaction_type() or sub.default_interaction_type
            if mode == InteractionType.RANDOM:
                raise ValueError(
                    f"metrics: target {key!r} is sampled from the {sub.distribution_class.__name__} distribution of "
                    f"module {name!r} under random interaction: every forward pass of a perturbed input would draw "
                    "it anew. Score a parameter of the distribution (target_key='loc', 'logits', ...) or call the "
                    "metric under torchrl's set_exploration_type(ExplorationType.DETERMINISTIC)"
                )


def _refuse_redrawn(scorer: Scorer, before: list[torch.Tensor]) -> None:
    """A target that differs between two passes on the same input (a model drawing in its own forward, as torchrl's
    RSSMPrior samples its state): a curve of it would be noise (see
    :mod:`~tdhook.attribution.methods._random_draws`). ``before``: the random states before the scorer's pass."""
    if not drew(scorer.module, before):  # no draw: the modules are not walked
        return
    modules = dict((scorer.module.module if scorer._plain else scorer.module).named_modules())
    run = functools.partial(scorer._output_of, scorer._base)
    found = redrawn(scorer.module, modules, before, scorer.reference_output, run)
    if found is not None:
        raise ValueError(
            f"metrics: target {scorer._key!r} differs between two forward passes on the same input (by up to "
            f"{found[0]:.3g}): {found[1]} drew at random in its own forward, so each perturbed input's score would "
            "mix the perturbation with new draws; score an output computed before the draw, or make the draw an "
            "input of the model (torchrl's RSSMPrior and RSSMPosterior take their noise as an argument)"
        )


def _perturbable(keys: list[NestedKey], td: TensorDictBase) -> list[NestedKey]:
    """Default keys without those holding integers (an attention mask, an index), where others remain: a metric
    perturbs floating-point inputs only (an integer takes no baseline value), and LRP's default keys leave out the
    integers no embedding reads, so the relevance it wrote holds none for them. Where only integer keys remain, they
    are kept, for the check that names them."""
    kept = [key for key in keys if not _holds_integers(td.get(key, None))]
    return kept if kept else keys


def _holds_integers(value: object) -> bool:
    return isinstance(value, torch.Tensor) and not value.is_floating_point() and not value.is_complex()


def _default_units(output: torch.Tensor, key: NestedKey, batch_dims: int) -> torch.Tensor:
    """The units that ``target=None`` scores: the argmax of the last dimension (warned of on a map, see
    :func:`~tdhook.attribution._map_targets.warn_for_rows_of_a_map`)."""
    warn_for_rows_of_a_map(output, None, key, batch_dims, owner="metrics")
    return output.detach().argmax(-1)


class Scorer:
    """The target score of a model on a TensorDict and on perturbed versions of it.

    Args:
        module: a ``TensorDictModuleBase``, or a plain ``nn.Module`` with ``in_keys`` and ``out_keys``.
        td: the unperturbed TensorDict (left unchanged).
        in_keys: the explained input keys (a plain module's inputs; by default those of a TensorDict module that
            LRP explains by default: not the flags and masks, nor the recurrent states the TensorDict lacks).
        out_keys: a plain module's output keys.
        target_key: the output scored; the default is the one :class:`~tdhook.attribution.LRP` explains.
        target: ``None`` (the argmax of the unperturbed output's last dimension, the output itself for a value
            head, or for a sampling policy's logits the action the TensorDict holds beside its relevance), an int,
            a LongTensor of per-sample indices (refused on an output with no dimension after the batch, as by the
            methods), or a callable ``output -> relevance``. As for the
            attribution methods, it is resolved once, on the unperturbed output ``y``: a callable gives the
            weights ``w = target(y) / y`` (relevance where ``y`` is 0 is refused: ``w`` cannot carry it), and the
            score of a perturbed output ``y'`` is ``sum(y' * w)`` over its non-batch dimensions (``sum(target(y))``
            unperturbed). An index target scores
            the sum of the picked units over any dimensions between the batch and the units. With ``None``, the
            value of a torchrl ``QValueModule``'s chosen action (``chosen_action_value``) is scored as the action
            values at the action chosen on the unperturbed input (see :mod:`~tdhook.attribution._chosen_values`).
        steps_per_forward: how many perturbed versions of the batch share one forward pass; ``None`` picks as
            many as fit about 65 thousand input elements (larger stacks ran slower on CPU). With 1 the model sees
            the TensorDict's own batch shape; with more, the steps stacked along the batch's first dimension
            (``[steps * B, T]`` for a ``[B, T]`` batch: the time dimension stays). A model that normalises over
            the batch (see
            :func:`~tdhook.metrics._batch_statistics.batch_normalising_module`) sees one step per pass; more is refused.
            So does, from the first stack on, a model that mixes its samples in its forward (see
            :func:`~tdhook.metrics._batch_statistics.steps_mixed`), with a warning.
        defer: where the model starts with a linear layer (see :meth:`leading_affine`), leave the unperturbed pass
            and the target to :meth:`resolve`, which takes the unperturbed output from the curve's own sums: the
            attributes below wait for that call.

    Attributes:
        keys: the explained input keys.
        reference: the score on the unperturbed input, shaped like the batch.
        reference_output: the target output on the unperturbed input.
        allowed: where the target holds the logits of a masked torchrl policy, its mask of allowed actions (an
            input, the same for every perturbed version); else ``None``. ``target=None`` then scores the action
            the TensorDict holds, else the highest allowed logit, as the methods explain it.
    """

    def __init__(
        self,
        module: TensorDictModuleBase | nn.Module,
        td: TensorDictBase,
        *,
        in_keys: Sequence[NestedKey] | None = None,
        out_keys: Sequence[NestedKey] | None = None,
        target_key: NestedKey | None = None,
        target: Target = None,
        steps_per_forward: int | None = None,
        defer: bool = False,
    ) -> None:
        try:
            self.module, self._plain = as_tensordict_module(module, in_keys, out_keys)
        except TypeError as err:
            raise TypeError(str(err).replace("LRP", "metrics", 1)) from err
        if isinstance(target_key, Mapping):
            raise TypeError("metrics: target_key must name one output, not a dict of several")
        if isinstance(target, str):
            raise ValueError(f"metrics: target must be None, an int, a LongTensor or a callable, got {target!r}")
        if steps_per_forward is not None and steps_per_forward < 1:
            raise ValueError(f"metrics: steps_per_forward must be a positive int or None, got {steps_per_forward}")
        self.keys = explained_keys(in_keys, self.module.in_keys)
        if in_keys is None:  # as LRP explains by default: no flags or masks, no recurrent state the data leaves out
            flags = explained_in_call(td, self.keys, True, optional_inputs(self.module))
            self.keys = _perturbable([key for key, explained in zip(self.keys, flags, strict=True) if explained], td)
        unread = [key for key in self.keys if key not in self.module.in_keys]
        if unread:
            raise ValueError(
                f"metrics: in_keys {unread} are not inputs of the model (its in_keys: {list(self.module.in_keys)}); "
                "perturbing them would leave its output as it is"
            )
        modules = dict(module.named_modules())  # the caller's model, walked once for the checks below
        # A plain model that holds none of tensordict's modules holds none of torchrl's recurrent, sampling, Q-value
        # or masked modules either: the checks and targets that look for them would find nothing.
        self._tensordict_free = self._plain and not any(
            isinstance(sub, TensorDictModuleBase) for sub in modules.values()
        )
        if not self._tensordict_free:
            _refuse_steps_read_together(self.module, td)
        _refuse_random_modules(modules, td)
        # Dropout called as a function (attention dropout) follows its module's mode: watched for in the first pass.
        self._watch = any(sub.training for sub in modules.values())
        self._alone = batch_normalising_module(module, modules)
        if self._alone is not None and steps_per_forward not in (None, 1):
            raise ValueError(
                f"metrics: module {self._alone} normalises over the batch (training mode or no running "
                f"statistics): {steps_per_forward} steps stacked in one pass would change each other's scores; "
                "leave steps_per_forward at None (one step per pass) or call .eval() on the model"
            )
        self.steps_per_forward = 1 if self._alone is not None else steps_per_forward
        self._batch = td.batch_size
        self._mixing_checked = self.steps_per_forward == 1 or _samples_apart(self)  # else the first stack is compared
        # Recurrent layers, and the time lengths they see in the unperturbed pass: a stack of steps that gives them
        # others ran as one sequence, and runs again one step per pass (see tdhook.attribution.methods._time_reads).
        self._recurrent, self._lengths = recurrent_layers(modules), set()
        self._base = carried_inputs(self.module, td)
        try:
            named = named_targets(self.module, target_key)
        except TypeError as err:
            raise _metrics_error(err) from None
        if None not in named:
            raise ValueError(
                f"metrics: {type(self.module).__name__} has several outputs to score by default ({sorted(named)}); "
                "a metric scores one: pass target_key= one of its outputs (and relevance_key= the prefix of that "
                "head's relevance, such as ('relevance', 'actor') for LRP)"
            )
        self._key, self._operator = named[None]
        self._pending: tuple[TensorDictBase, Target] | None = (td, target)
        self._split: LeadingAffine | None | bool = False  # the model's split, once looked for (False: not yet)
        if not (defer and self._alone is None and self.leading_affine() is not None):  # (each step as its own batch)
            self.resolve()

    @property
    def pending(self) -> bool:
        """Whether the unperturbed output is still to come (see :meth:`resolve`)."""
        return self._pending is not None

    def resolve(self, output: torch.Tensor | None = None, before: list[torch.Tensor] | None = None) -> None:
        """Fix the target on the unperturbed output: ``output`` (``[N, ...]``, the target output of the batch
        flattened, as a curve through the model's leading linear layer finds it at step 0), or one pass of the model.

        A scorer made with ``defer=True`` for a model that starts with a linear layer waits for this call; any other
        has made it already, and a second call does nothing. ``before``: the random states before the pass that
        gave ``output``; where the model drew in it, a target that another pass on the same input changes is refused
        (the scorer's own pass is checked so too).
        """
        if self._pending is None:
            return
        td, target = self._pending
        before = random_states(self.module) if output is None else before
        if output is None:
            with time_lengths(self._recurrent) as self._lengths:
                result = self._run(self._base.clone())  # copies: a model may change its inputs in place
        else:  # what the wrapped plain module's pass writes: its inputs and its one output
            result = self._base.clone(recurse=False)
            result.set(self.module.out_keys[0], output.reshape(*self._batch, *output.shape[1:]))
        self._pending = None
        self._resolve(result, td, target)
        if before is not None:  # a target the model draws in its own forward: each perturbed input's score draws anew
            _refuse_redrawn(self, before)

    def _resolve(self, result: TensorDictBase, td: TensorDictBase, target: Target) -> None:
        operator = self._operator
        self._key = _target_key(result, self._key, operator)
        free = self._tensordict_free
        if not free:
            _refuse_sampled_target(self.module, self._key)
        # A chosen action's value follows the greedy action of each perturbed input: score the value of the action
        # chosen here instead, the quantity explained.
        chosen = chosen_action(self.module, self._key, result, "metrics") if target is None and not free else None
        if chosen is not None:
            self._key = chosen[0]
        output = self.reference_output = self._output(result)
        self._reference = None
        if tuple(output.shape[: len(self._batch)]) != tuple(self._batch):
            raise ValueError(
                f"metrics: the target output {self._key!r} of shape {list(output.shape)} does not start with the "
                f"TensorDict's batch shape {list(self._batch)}: a metric scores one output per sample; give the "
                "TensorDict the batch shape of the output (the batch of contexts [B], not [B, T], for a model "
                "that reads a whole context and acts once)"
            )
        self._units = output.dim() - len(self._batch)  # the output's dimensions after the batch
        self._weights = None
        self._index = None
        if callable(target):
            try:
                self._weights, at_zero = initial_relevance(output, target, self._key, len(self._batch))
            except (ValueError, TypeError) as err:
                raise _metrics_error(err) from err
            if at_zero is not None:  # y * relevance / y cannot score it: the curve would start below sum(target(y))
                raise ValueError(
                    f"metrics: the callable target puts relevance on {zero_entries(at_zero, self._key, output)}; a "
                    "perturbed output y' scores sum(y' * relevance / y), which cannot carry it: return the output "
                    "times the weights (lambda y: y * w)"
                )
        elif output.dim() == len(self._batch) and target is not None:
            # An index on an output with no unit dimension (a [B] value head): refused as the methods refuse it,
            # rather than scoring the output itself whatever unit the target names.
            try:
                initial_gradient(output, target, self._key, len(self._batch))
            except (IndexError, ValueError, TypeError) as err:
                raise _metrics_error(err) from err
        elif output.dim() > len(self._batch) and (target is not None or output.shape[-1] > 1):
            try:
                allowed = _taken_action(operator, self._key, result, td, True) if target is None and not free else None
                if chosen is not None:
                    self._index = chosen[1]
                elif allowed is not None:
                    self._index = allowed.reshape(output.shape[:-1])
                elif target is None:  # the argmax, as the one-hot initial gradient of the methods has it
                    self._index = _default_units(output, self._key, len(self._batch))
                else:
                    self._index = initial_gradient(output, target, self._key, len(self._batch), "metrics").argmax(-1)
            except (IndexError, ValueError, TypeError) as err:
                raise _metrics_error(err) from err
        self.allowed = None if free else allowed_mask(operator, self._key, result)

    @property
    def reference(self) -> torch.Tensor:
        """The score on the unperturbed input, shaped like the batch."""
        if self._reference is None:
            self._reference = self._score(self.reference_output)
        return self._reference

    @property
    def target_key(self) -> NestedKey:
        """The scored output's key."""
        return self._key

    @property
    def target_index(self) -> torch.Tensor | None:
        """The unit of the output scored for each sample (``None`` for a callable target or a value head)."""
        return self._index

    def _run(self, work: TensorDictBase) -> TensorDictBase:
        try:
            # Every pass from the caller's running statistics; a module computing from a parameter on the meta
            # device returns whatever the memory held: refused, naming it.
            with torch.no_grad(), statistics_kept(self.module), meta_tensors_refused(self.module):
                with self._dropout_watch() as watch:
                    result = call_plain(self.module, work) if self._plain else self.module(work)
        except Exception as err:
            modules = dict((self.module.module if self._plain else self.module).named_modules())
            error = run_error(err, work, self.keys, modules, "metrics")
            if error is err:
                raise
            raise error from err
        self._refuse_dropout_calls(watch)
        return work if result is None else result

    def _output_of(self, td: TensorDictBase) -> torch.Tensor:
        """The target output of one pass on a copy of ``td``."""
        return self._output(self._run(td.clone()))

    def _dropout_watch(self) -> contextlib.AbstractContextManager[DropoutCalls | None]:
        """A watch for dropout called as a function over the first pass of a model with a module in training mode."""
        return DropoutCalls() if self._watch else contextlib.nullcontext()

    def _refuse_dropout_calls(self, watch: DropoutCalls | None) -> None:
        """Raise where the pass called dropout that drops; a pass without stops the watch (a model's own calls)."""
        if watch is None:
            return
        self._watch = False
        if watch.found:
            raise ValueError(
                f"metrics: the forward pass calls dropout (p={watch.found}) in training mode, outside any Dropout "
                "module (attention dropout, mostly): each forward pass of the perturbed inputs would drop other "
                "units, and the scores would mix the perturbation with that noise; call .eval() on the model"
            )

    def _output(self, result: TensorDictBase) -> torch.Tensor:
        output = target_output(result, self._key, self._operator)
        if not isinstance(output, torch.Tensor) or not output.is_floating_point():
            raise TypeError(
                f"metrics: target key {self._key!r} holds {getattr(output, 'dtype', type(output).__name__)}; "
                "a metric scores a floating-point output: pass target_key=<such a key>"
            )
        return output

    def _score(self, output: torch.Tensor) -> torch.Tensor:
        """The score of ``output`` (``lead + batch + units``, ``units`` the unperturbed output's non-batch shape),
        shaped ``lead + batch``: the sum over ``units`` of the output times the target's initial gradient."""
        units = self._units
        if self._weights is not None:
            output = output * self._weights
        elif self._index is not None:
            index = self._index.expand(output.shape[:-1]).unsqueeze(-1)
            output, units = output.gather(-1, index).squeeze(-1), units - 1
        return output.sum(tuple(range(-units, 0))) if units else output

    def scores(self, perturbed: Mapping[NestedKey, torch.Tensor]) -> torch.Tensor:
        """The scores of ``S`` perturbed versions of the batch, shaped ``[S] + batch``, in one forward pass.

        Args:
            perturbed: ``key -> [S] + batch + shape`` for each explained key (other inputs are repeated).
        """
        return self._score(self.outputs(perturbed))

    def scores_of(self, outputs: torch.Tensor) -> torch.Tensor:
        """The scores ``[S] + batch`` of the target outputs ``[S, N, ...]`` of ``S`` perturbed versions of the batch."""
        return self._score(outputs.reshape(outputs.shape[0], *self._batch, *outputs.shape[2:]))

    def leading_affine(self) -> LeadingAffine | None:
        """The model split at its leading linear layer, where the one explained key is its only input and the target
        its only output (see :class:`~tdhook.metrics._leading_affine.LeadingAffine`); otherwise ``None``."""
        module = self.module
        if type(module) is not TensorDictModule or module._forward_hooks or module._forward_pre_hooks:
            return None
        # A forward set on the instance runs in place of the class's; method="name" calls net.name, not its forward.
        if "forward" in vars(module) or module.method is not None:
            return None
        if self._recurrent:  # whether the steps may share a pass is found in the passes (see outputs)
            return None
        key = self._key if self._key is not None or len(module.out_keys) != 1 else module.out_keys[0]
        if list(module.in_keys) != self.keys or list(module.out_keys) != [key] or self._operator is not module:
            return None
        if self._split is False:  # the model does not change within the metric's call
            self._split = LeadingAffine.find(module.module)
        return self._split

    def outputs(self, perturbed: Mapping[NestedKey, torch.Tensor]) -> torch.Tensor:
        """The target outputs of ``S`` perturbed versions of the batch, ``[S] + batch + ...``, in one forward pass.

        Args:
            perturbed: ``key -> [S] + batch + shape`` for each explained key (other inputs are repeated).
        """
        n_steps = next(iter(perturbed.values())).shape[0]
        if self._alone is not None and n_steps > 1:  # each step as the batch it is
            return torch.cat([self.outputs(_step(perturbed, i)) for i in range(n_steps)])
        given = perturbed
        # The first stack of a call also runs the unperturbed batch, copies of its inputs kept (see _steps_mixed).
        kept = _with_unperturbed(self, perturbed) if n_steps > 1 and not self._mixing_checked else None
        if kept is not None:
            perturbed, n_steps = _step(kept, slice(None)), n_steps + 1
        if n_steps > 1 and self._recurrent:
            with time_lengths(self._recurrent) as lengths:
                output = self._stacked_outputs(perturbed, n_steps)
            if output is not None and read_as_one_sequence(self._lengths, lengths):
                name = next(name for name, _ in sorted(lengths - self._lengths, key=str))
                self._alone = f"{name} ({type(self._recurrent[name]).__name__})"  # read the steps as one sequence
                return self.outputs(given)
        else:
            output = self._stacked_outputs(perturbed, n_steps)
        if output is None or (kept is not None and _steps_mixed(self, kept, output)):
            return self.outputs(given)
        return output if kept is None else output[1:]

    def run_steps_alone(self, found: str) -> None:
        """Run each step in a pass of its own from now on: ``found`` mixes the samples of a batch."""
        self._alone, self.steps_per_forward = found, 1

    def _scored_across_steps(self, output: torch.Tensor, stacked_dims: int) -> bool:
        """Whether the target output of stacked steps scores them against each other (see
        :mod:`~tdhook.attribution.methods._cross_sample_outputs`); the steps then run one per pass."""
        if self._pending is not None or not scored_across_copies(
            output, stacked_dims, self.reference_output, len(self._batch)
        ):
            return False
        self._alone = f"the target {self._key!r}, which scores the samples of its batch against each other"
        return True

    def _stacked_outputs(self, perturbed: Mapping[NestedKey, torch.Tensor], n_steps: int) -> torch.Tensor | None:
        """:meth:`outputs`, the steps stacked in one pass; ``None`` where the target scored them against each other."""
        if self._plain and self._key in self.module.out_keys:
            return self._plain_outputs(perturbed, n_steps)
        if n_steps == 1:  # the other inputs copied (stacked, they are copies already)
            work = self._base.exclude(*perturbed).clone()
            for key, value in perturbed.items():
                work.set(key, value[0])
            return self._output(self._run(work)).unsqueeze(0)
        work = self._base.expand(n_steps, *self._batch).clone(recurse=False)
        for key, value in perturbed.items():
            work.set(key, value)
        stacked = stacked_batch(n_steps, self._batch)
        output = self._output(self._run(work.reshape(*stacked)))
        if self._scored_across_steps(output, len(stacked)):
            return None
        return output.reshape(n_steps, *self._batch, *output.shape[len(stacked) :])

    def _plain_outputs(self, perturbed: Mapping[NestedKey, torch.Tensor], n_steps: int) -> torch.Tensor | None:
        """:meth:`outputs` for a plain module: its positional inputs built directly, without a TensorDict; ``None``
        where the target scored the stacked steps against each other."""
        batch_dims = len(self._batch)
        args = []
        for key in self.module.in_keys:
            value = perturbed.get(key)
            if value is None:  # a copy for one step (stacked, flattening copies), as a model may change it in place
                value = self._base.get(key)
                value = value.clone().unsqueeze(0) if n_steps == 1 else value.expand(n_steps, *value.shape)
            args.append(value[0] if n_steps == 1 else value.flatten(0, 1) if batch_dims else value)  # [S * B, ...]
        with torch.no_grad(), statistics_kept(self.module), self._dropout_watch() as watch:
            outputs = self.module.module(*args)
        self._refuse_dropout_calls(watch)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        if len(outputs) != len(self.module.out_keys):
            raise RuntimeError(
                f"metrics: the module returned {len(outputs)} outputs for the {len(self.module.out_keys)} out_keys "
                f"{self.module.out_keys}"
            )
        output = outputs[self.module.out_keys.index(self._key)]
        if not isinstance(output, torch.Tensor) or not output.is_floating_point():
            raise TypeError(
                f"metrics: target key {self._key!r} holds {getattr(output, 'dtype', type(output).__name__)}; "
                "a metric scores a floating-point output: pass target_key=<such a key>"
            )
        if n_steps == 1:
            return output.unsqueeze(0)
        if self._scored_across_steps(output, max(batch_dims, 1)):
            return None
        return output.reshape(n_steps, *self._batch, *output.shape[max(batch_dims, 1) :])

    def chunk_size(self, inputs: Sequence[torch.Tensor]) -> int:
        """How many perturbed versions of the batch one forward pass takes."""
        if self.steps_per_forward is not None:
            return self.steps_per_forward
        per_step = max(1, sum(x.numel() for x in inputs))
        return max(1, _ELEMENTS_PER_FORWARD // per_step)


def _samples_apart(scorer: Scorer) -> bool:
    """Whether the model is a plain one of torch's layers that compute each sample apart, or a ``TensorDictModule``
    of one (see :func:`~tdhook.metrics._batch_statistics.samples_apart`)."""
    module = scorer.module
    if not scorer._plain and (type(module) is not TensorDictModule or hooked(module)):
        return False
    return samples_apart(module.module, len(scorer._batch))


def _with_unperturbed(scorer: Scorer, perturbed: Mapping[NestedKey, torch.Tensor]) -> dict | None:
    """The stacked steps ``perturbed`` after the unperturbed batch, as a new stack; ``None`` before the target is
    fixed on the unperturbed output."""
    if scorer._pending is not None:
        return None
    return {key: torch.cat([scorer._base.get(key).unsqueeze(0), value]) for key, value in perturbed.items()}


def _steps_mixed(scorer: Scorer, kept: Mapping[NestedKey, torch.Tensor], output: torch.Tensor) -> bool:
    """Whether the first stack of a call shows that the model mixes the samples of its batch (see
    :func:`~tdhook.metrics._batch_statistics.steps_mixed`); the steps then run one per pass. ``output``: that of the
    steps ``kept`` (copied before the pass: a model may change its inputs in place), the unperturbed batch first,
    which the scorer's own pass gave alone. Later stacks are not compared."""
    scorer._mixing_checked = True
    modules = lambda: dict((scorer.module.module if scorer._plain else scorer.module).named_modules())  # noqa: E731
    n_steps = output.shape[0]
    rerun = lambda: scorer._stacked_outputs(_step(kept, slice(None)), n_steps)  # noqa: E731
    alone = lambda i: scorer._stacked_outputs(_step(kept, slice(i, i + 1)), 1)[0]  # noqa: E731
    found = steps_mixed(output, alone, modules, rerun, first=scorer.reference_output, unbatched=not scorer._batch)
    if found is not None:
        scorer.run_steps_alone(found)
    return found is not None


def _step(perturbed: Mapping[NestedKey, torch.Tensor], i: int | slice) -> dict[NestedKey, torch.Tensor]:
    """Step ``i`` of stacked perturbed inputs as a stack of one (a view), or the steps of a slice, copied."""
    if isinstance(i, slice):
        return {key: value[i].clone() for key, value in perturbed.items()}
    return {key: value[i : i + 1] for key, value in perturbed.items()}


def chunks(total: int, size: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` pairs covering ``range(total)`` in pieces of ``size``.

    Examples:
        >>> list(chunks(5, 2))
        [(0, 2), (2, 4), (4, 5)]
    """
    for start in range(0, total, size):
        yield start, min(start + size, total)


def progress_bar(total: int, description: str, show: bool | None) -> Callable[[int], None]:
    """An ``update(n)`` function of a tqdm bar over ``total`` forward passes, shown for long runs.

    ``show=None`` shows the bar when there are at least 20 passes; ``update(0)`` at the end closes it.

    Examples:
        >>> update = progress_bar(3, "demo", show=False)
        >>> update(3)
    """
    if show is None:
        show = total >= 20
    if not show:
        return lambda n: None
    from tqdm import tqdm  # the plain bar: tqdm.auto warns in notebooks without ipywidgets

    bar = tqdm(total=total, desc=description, leave=False)
    done = [0]

    def update(n: int) -> None:
        bar.update(n)
        done[0] += n
        if n == 0 or done[0] >= total:
            bar.close()

    return update
