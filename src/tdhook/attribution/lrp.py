"""The LRP wrapper: a ``TensorDictModule`` that writes relevance next to the outputs."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey, unravel_key_list
from torch import nn

from tdhook.attribution._backward_passes import (
    DEFAULT_MEMORY_BUDGET,
)
from tdhook.attribution._chain_plan import (
    ChainPlan,
    context_plan,
)
from tdhook.attribution._checkpointing import checkpointing_modules
from tdhook.attribution._context import (
    abandon,
    claim,
    leave_out_unread_marks,
    marks_are_read,
    register_rule,
    release,
    remove_listed,
    stop_marks,
    suspend_function_modes_in,
)
from tdhook.attribution._copies import hide_from_copies, wrapper_copy, wrapper_state
from tdhook.attribution._coverage_recorder import CoverageRecorder
from tdhook.attribution._differentiable import check_differentiable, rules_off
from tdhook.attribution._ensemble_modules import refuse_ensembles
from tdhook.attribution._explained_call import explain
from tdhook.attribution._function_gates import FunctionGates
from tdhook.attribution._function_rule_plan import FunctionRulePlan
from tdhook.attribution._function_transforms import refuse_outer_transform
from tdhook.attribution._inputs import (
    optional_inputs,
)
from tdhook.attribution._kept_grads import KeptGrads
from tdhook.attribution._keys import (
    check_free,
    check_read,
    layer_keys,
    read_not_written,
    relevance_keys,
    unique_keys,
)
from tdhook.attribution._keyword_calls import keyword_dispatch
from tdhook.attribution._layer_relevance import (
    LayerRelevance,
    RelevanceCheck,
    add_check_hooks,
    refuse_layers_inside_whole_rules,
)
from tdhook.attribution._loss_callers import refuse_loss_module_caller
from tdhook.attribution._lrp_options import LRPOptions
from tdhook.attribution._model_run import context_cache_watch
from tdhook.attribution._module_hooks import module_hooks
from tdhook.attribution._no_grad_values import called_in_grad_mode
from tdhook.attribution._orphan_hooks import HooksMade, listed_hook_ids, remove_orphans
from tdhook.attribution._parameter_slots import ParameterSlots, TransformedSlots
from tdhook.attribution._plain_modules import as_tensordict_module
from tdhook.attribution._random_modules import random_modules
from tdhook.attribution._rule_names import warn_for_unused_keys
from tdhook.attribution._rule_use import RuleUse
from tdhook.attribution._tokens import TokenInputs
from tdhook.attribution._training_norms import training_norms
from tdhook.attribution.coverage import Coverage
from tdhook.attribution.mappers.aliases import module_aliases, user_rule
from tdhook.attribution.mappers.base import RuleMapper
from tdhook.attribution.mappers.given import as_rule_mapper, checked_rules
from tdhook.attribution.methods._batch_statistics import BufferHolders, buffers_restored_on_error
from tdhook.attribution.rules._norm_function_layout import NormFunctionCalls
from tdhook.attribution.rules._norm_gradient_layout import norm_gradient_hooks
from tdhook.attribution.rules.base import RemovableRuleHandle, Rule
from tdhook.attribution.rules.normalization import NormRule
from tdhook.attribution.targets import (
    DefaultTargets,
    Target,
    named_targets,
)
from tdhook.attribution.tunables import MapperTunable, RecordedModules

__all__ = ["LRP"]

_NO_CONTEXT = contextlib.nullcontext()  # reusable: entering it does nothing
# Sets the per-call state on the wrapper without nn.Module's __setattr__ (a microsecond a call: it looks the name up
# among parameters, buffers and submodules, which these plain values never are).
_set_state = object.__setattr__


def _uncompiled_dispatch(forward: Callable) -> Callable:
    """``forward`` called with keyword tensors too (tensordict's ``dispatch``; :mod:`._keyword_calls`), and run as
    written where the wrapper itself is compiled (``torch.compile(lrp)``, a collector's ``compile_policy``): a call
    registers hooks, runs the rules' autograd functions and a backward pass, which a compiled graph would not run as
    written."""
    return torch.compiler.disable(keyword_dispatch(forward))


def _compiled(module: nn.Module) -> bool:
    """Whether ``module`` is compiled by torch.compile: wrapped (``_orig_mod``), or in place by
    ``module.compile()`` (its call replaced on the instance)."""
    return hasattr(module, "_orig_mod") or vars(module).get("_compiled_call_impl") is not None


class LRP(LRPOptions, RecordedModules, TensorDictModuleBase, MapperTunable):
    """Layer-wise relevance propagation around a ``TensorDictModule``.

    Inside ``with lrp:`` the rules chosen by ``rule_mapper`` are registered on
    the wrapped model once; every call runs the model, writes its outputs as
    the model would and writes the relevance of each input key ``k`` at
    ``(relevance_key, *k)``. The relevance of a tensor is the tensor times its
    rule-modified gradient, so glue code between modules (concatenation,
    scaling, reshapes) needs no rule. Calling outside ``with`` enters and
    leaves the context for that call.

    Args:
        module: a ``TensorDictModuleBase`` (``TensorDictModule``,
            ``TensorDictSequential``, torchrl actors and value operators), or a
            plain ``nn.Module`` together with ``in_keys`` and ``out_keys``.
        rule_mapper: ``(name, module) -> Rule | None``, or a dict keyed by
            module type or name pattern (completed with the defaults of
            :class:`~tdhook.attribution.lrp_helpers.rules.BaseRuleMapper`);
            by default LRP-0 on Linear and convolution layers, with each
            eval-mode BatchNorm merged into the layer before it. Names are
            those of ``module.named_modules()`` for the object passed as
            ``module`` (a plain ``nn.Module``'s own names).
        in_keys: for a plain module, its input keys; for a TensorDict module, the input keys to explain. The module's
            other inputs are constants of the call, as if the model held them: under AttnLRP and CP-LRP a product of an
            explained input with one of them is linear in it and kept whole, where explaining both splits it. By default
            its in_keys, leaving out in each call those that hold booleans (``is_init``, an action mask), integers no
            ``nn.Embedding`` or ``nn.EmbeddingBag`` reads (but those that index a parameter, ``self.table[task]``, are
            refused by name), the recurrent states of a torchrl ``LSTMModule``/``GRUModule`` the TensorDict does not
            hold, and the inputs of a ``TensorDictSequential(partial_tolerant=True)`` it does not hold (the sequence
            skips the modules that read them).
        out_keys: the output keys of a plain module.
        target_key: the output to explain. Defaults to the first
            floating-point out key that no module of the pipeline reads,
            leaving out sampling steps and, while there are others, the states
            written under ``"next"`` for the next step (a recurrent actor
            explains its action values, not its next hidden state):
            ``"chosen_action_value"`` for a
            ``QValueActor``, ``"loc"`` for a ``ProbabilisticActor`` with a
            ``TanhNormal`` (or other location-scale) distribution,
            ``"logits"`` for one with a ``Categorical`` or
            ``OneHotCategorical``, ``"state_value"`` for a ``ValueOperator``.
            A dict ``name -> key`` explains several outputs from one forward
            pass, writing relevance at ``(relevance_key, name, *input_key)``.
            An ``ActorValueOperator``, ``ActorCriticOperator``,
            ``ActorCriticWrapper``, or a ``TensorDictSequential`` of an actor
            then a ``ValueOperator`` reading its action, gets
            ``{"actor": <its actor's default>, "critic": <its critic's>}``.
        target: the initial relevance: ``None`` (the output at the argmax of
            its last dimension, or the output itself for a one-element last
            dimension; for the logits of a policy that samples its action, the
            action taken: a stored transition's, else the one the call draws),
            an int, a LongTensor
            of per-sample indices, a callable
            ``output -> relevance``, or ``"all"`` (every output unit, stacked
            in a dimension right after the batch dimensions).
        relevance_key: the prefix of the relevance keys.
        layers: inner modules whose output relevance is written too: a list
            of module names (written at ``(relevance_key, name)``) or a dict
            ``name -> key`` (written at ``(relevance_key, *key)``). A module the
            model holds under several names is asked for by any of them. A Linear or
            convolution layer merged with its BatchNorm reports the merged
            output's relevance. A module the forward calls several times (a
            layer shared across steps or blocks, as ALBERT's) gets the relevance
            of all its outputs, summed; the agents of a torchrl multi-agent
            network with parameters of their own get theirs stacked along the
            agents' dimension. A module inside a block under the Taylor rule
            receives no relevance and is refused (``ValueError``).
        relevance_check: optional ``(name, module, relevance_in, relevance_out)``
            callable run on every module with a rule, for example
            :func:`~tdhook.attribution.lrp_helpers.rules.raise_for_unconserved_rel_factory`.
        token_relevance_key: if given, every relevance is also written summed
            over its last (feature) dimension at ``(token_relevance_key, ...)``,
            in place of ``relevance_key``: for embeddings ``[B, T, H]`` given
            as input, or an embedding layer named in ``layers``, the relevance
            of each token ``[B, T]``. Integer token ids read by an
            ``nn.Embedding`` or ``nn.EmbeddingBag`` get their per-token relevance at
            ``(relevance_key, key)`` already.
        split_dim: a dimension of the target output whose positions are
            explained one by one (time in a ``[B, T]`` batch, the sequence of
            a language model's logits): each relevance gains a dimension of
            that size right before ``split_dim``, so that for a ``[B, T]``
            batch and ``split_dim=1``, ``relevance[b, t_target, t]`` is the
            relevance of the target at step ``t_target`` on the input at step
            ``t``. With ``target="all"`` the units follow the new dimension.
        create_graph: write relevance (and outputs) that keep their graph: a
            loss on them has its true derivative with respect to the inputs
            that require grad and to every parameter, paths through the rules'
            modified weights included (see the docs' page on differentiable
            relevance). Every rule must support it (``rule.differentiable``).
        memory_budget: for ``target="all"``, the bytes the units' initial
            gradients (one output-sized tensor per unit) may take at once: they
            are built and explained in chunks of units that fit (default 32 MiB).

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tensordict.nn import TensorDictModule
        >>> from tdhook.attribution import LRP
        >>> from tdhook.attribution.lrp_helpers.rules import EpsilonPlus
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        >>> policy = TensorDictModule(net, in_keys=["observation"], out_keys=["action_value"])
        >>> lrp = LRP(policy, rule_mapper=EpsilonPlus())
        >>> with lrp:
        ...     td = lrp(TensorDict(observation=torch.randn(3, 4), batch_size=[3]))
        >>> td["relevance", "observation"].shape
        torch.Size([3, 4])
        >>> torch.equal(td["action_value"], net(td["observation"]))
        True
    """

    def __init__(
        self,
        module: TensorDictModuleBase | nn.Module,
        rule_mapper: RuleMapper | Mapping | None = None,
        *,
        in_keys: Sequence[NestedKey] | None = None,
        out_keys: Sequence[NestedKey] | None = None,
        target_key: NestedKey | Mapping[str, NestedKey] | None = None,
        target: Target = None,
        relevance_key: str = "relevance",
        layers: Sequence[str] | Mapping[str, NestedKey] | None = None,
        relevance_check: RelevanceCheck | None = None,
        token_relevance_key: str | None = None,
        split_dim: int | None = None,
        create_graph: bool = False,
        memory_budget: int = DEFAULT_MEMORY_BUDGET,
    ) -> None:
        super().__init__()
        module, plain = as_tensordict_module(module, in_keys, out_keys)
        # Module names (for rule mappers and inner-layer keys) are relative to what the caller passed.
        self._name_prefix = "module." if plain else ""
        self.module = module
        self.rule_mapper = rule_mapper
        given = read_not_written(module)
        self.explained_keys = unique_keys(in_keys) if in_keys is not None else given
        check_read("LRP", given, self.explained_keys, True, module)  # one the module writes or does not read: zero
        # Keys taken from the module's in_keys: those holding booleans or integers no embedding reads, and the
        # recurrent states a torchrl LSTMModule/GRUModule does without, and the inputs a partial_tolerant sequence does
        # without, are not explained when absent (see explained_in_call).
        self._defaulted_inputs = in_keys is None
        self._optional_inputs = optional_inputs(module)
        self.targets = named_targets(module, target_key)
        named = None not in self.targets
        self.target_key = {n: k for n, (k, _) in self.targets.items()} if named else self.targets[None][0]
        self.target = target
        self.relevance_key = relevance_key
        self.relevance_check = relevance_check
        self.layer_keys = layer_keys(layers, self.named_explained_modules(), self.explained_keys)
        # Per target, in order: the explained inputs' relevance, then the inner layers'.
        self.relevance_keys = relevance_keys(
            relevance_key, self.targets, [*self.explained_keys, *self.layer_keys.values()]
        )
        # The input key each relevance key belongs to (None for an inner layer's).
        self._relevance_sources = [
            key for _ in self.targets for key in [*self.explained_keys, *[None] * len(self.layer_keys)]
        ]
        if token_relevance_key is not None and token_relevance_key == relevance_key:
            raise ValueError(f"LRP: token_relevance_key and relevance_key are both {relevance_key!r}; pick two")
        self.token_relevance_key = token_relevance_key
        self.token_relevance_keys = (
            [(token_relevance_key, *key[1:]) for key in self.relevance_keys] if token_relevance_key else []
        )
        check_free(module, self.relevance_keys)
        check_free(module, self.token_relevance_keys, "token_relevance_key")
        self.in_keys = unravel_key_list(list(dict.fromkeys([*module.in_keys, *self.explained_keys])))
        self.out_keys = [*unravel_key_list(module.out_keys), *self.relevance_keys, *self.token_relevance_keys]
        self._handles: list[RemovableRuleHandle] | None = None
        self._candidates = DefaultTargets()  # per target, its default keys, found once per open context
        self._marks_read = True  # whether the open context's layers mark their outputs (see marks_are_read)
        self._hooks: list = []
        self._layers = LayerRelevance()
        self._tokens = TokenInputs(self.explained_keys)
        self._stochastic, self._checkpointing = [], []  # dropout to warn of, checkpointing to refuse, at each call
        self._training_norms: list = []
        self._compiled, self._rule_use, self._grads = False, RuleUse(), KeptGrads(module)  # .grad kept
        # The first call watches which nonlinear functions keep their plain gradient (see coverage()).
        self._coverage = CoverageRecorder()
        self._norm_calls = NormFunctionCalls()  # whether the model calls F.batch_norm and the like (first call)
        self._function_gates, self._function_rule_plan = FunctionGates(), FunctionRulePlan()  # found by calls
        self._call_enters = False  # whether the call in flight entered the context it leaves when it ends
        self.split_dim = split_dim
        self._split_dim: int | None = None
        # One call (and context change) at a time: the rules' per-module state is shared between threads.
        self._lock = threading.RLock()
        self.create_graph = create_graph
        self.memory_budget = memory_budget
        self._inactive = False  # inside inactive(): no rules
        self._plan: ChainPlan | None = None  # a chain of layers run without hooks and autograd (see _chain_plan)
        self._abandoned: weakref.finalize | None = None  # an open context's cleanup if the wrapper is collected
        self._buffer_holders = BufferHolders()  # the modules whose buffers a failing call puts back
        self._transformed_slots = TransformedSlots()  # the parameters a refusal under torch.vmap puts back
        self._keep_slots()

    def named_explained_modules(self) -> dict[str, nn.Module]:
        """The wrapped model's modules by the names rule mappers and ``layers`` use."""
        prefix = self._name_prefix
        root = self.module.module if prefix else self.module
        return dict(root.named_modules())

    def _rules(self) -> dict[str, Rule]:
        mapper = self.rule_mapper
        modules = self.named_explained_modules()
        if hasattr(mapper, "rules"):
            return checked_rules(mapper.rules(modules[""]), modules)
        rules, aliases = {}, module_aliases(modules[""])
        for name, sub in modules.items():
            rule = user_rule(mapper, name, sub, aliases)  # a module of several names is asked under each
            if rule is not None:
                rules[name] = rule
        return checked_rules(rules, modules)

    def __enter__(self) -> LRP:
        with self._lock:
            return self._enter()

    def _enter(self) -> LRP:
        if self._handles is not None:
            raise RuntimeError("this LRP wrapper's context is already active; leave it before entering again")
        try:
            refuse_outer_transform("the context")  # before the rules are prepared on the transform's parameters
        except NotImplementedError:  # a caller's to_module under the transform does not put the parameters back
            self._transformed_slots.restore(self.named_explained_modules().values())
            raise
        remove_listed(self._hooks)  # what a removal interrupted while leaving the last context left behind
        modules = self.named_explained_modules()
        refuse_ensembles(modules)  # before anything is registered: its vmapped forward would lose its parameters
        made = HooksMade()  # a hook made here (this thread) whose handle a failure lost is found by its id
        claim(self, modules)
        handles: list[RemovableRuleHandle] = []
        try:
            made.open()  # until _enter ends
            self._abandoned = weakref.finalize(self, abandon, self._hooks, handles)  # collected, never left
            rules = self._rules()
            refuse_layers_inside_whole_rules(rules, modules, self.layer_keys)
            if self.create_graph:
                check_differentiable(rules, self.rule_mapper)
            read = marks_are_read(rules, self.relevance_check is not None, self.target)
            for name, rule in (rules if read else leave_out_unread_marks(rules, modules)).items():
                handles.append(register_rule(rule, name, modules[name]))
            if not read:
                stop_marks(handles)
            # A norm's own backward runs where its rule is not a norm rule (IgnoreRule, EpsilonRule) or it has none:
            # PyTorch's CPU batch_norm backward needs the gradient laid out as the norm's output.
            normed = {id(modules[name]) for name, rule in rules.items() if isinstance(rule, NormRule)}
            norm_gradient_hooks(modules.values(), normed, self._hooks)  # listed as made
            self._marks_read = read
            if self.relevance_check is not None:
                self._hooks += add_check_hooks(handles, modules, self.relevance_check, self._layers)
            modes = getattr(self.rule_mapper, "function_modes", list)()
            # Modes that stay on in ruled modules (the CNN presets') pause in those the caller mapped to IgnoreRule.
            plain_only = not any(getattr(mode, "pause_in_ruled_modules", True) for mode in modes)
            self._hooks += (pausing := suspend_function_modes_in(handles, plain_only))  # one line: listed as made
            # Each of these lists its hooks in self._hooks as it makes them: a registration that fails (an error, an
            # interrupt) leaves none of the others made so far on the model.
            self._layers.register(modules, self.layer_keys, self._hooks)  # by any name of each module
            self._tokens.register(modules, self._hooks)  # on each nn.Embedding and nn.EmbeddingBag
            module_hooks(modules, self._hooks)  # torchrl's modules and the caller's grad mode (see _module_hooks)
            self._hooks += context_cache_watch(self, handles)  # what notes the caches handed to the model
            # Copies of the model made inside the context (deepcopy, pickle) leave every hook of the context out.
            ours = {h.id for handle in handles for h in handle.hook_handles()}
            self._hooks.append(hide_from_copies(modules.values(), ours | {hook.id for hook in self._hooks}))
            # Plans for this context's rules; a module whose hooks are all its rule's and pausing ones may skip them.
            self._function_rule_plan = FunctionRulePlan(ours | {hook.id for hook in pausing}, self._hooks[-1].hook_ids)
            self._norm_calls.follow(list(modules.values()))  # found again where the model's modules changed
            self._hooks.append(self._function_rule_plan)  # puts back what an interrupt left without hooks, and more
            self._handles = handles
            self._candidates.clear()
            self._rule_use.reset()
            self._stochastic, self._checkpointing = random_modules(modules), checkpointing_modules(modules)
            self._training_norms = training_norms(modules)  # a BatchNorm in training mode, warned of once
            self._compiled = any(map(_compiled, modules.values()))
            self._plan = context_plan(self, rules, modules, ours)
            made.close()  # inside the try, as all before: torch's RemovableHandle.__init__ back once none is open
            return self  # inside the try: an interrupt before the return leaves the context as if never entered
        except BaseException:
            try:
                self._leave(handles)
            finally:  # and the hooks put in a module's dict whose registration failed before giving their handle
                remove_orphans([*modules.values(), self.module], made.ids)
                made.close()  # not left to the traceback, which holds it
            raise

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:  # waits for calls of other threads in flight
            self._leave(self._handles or [])

    def _leave(self, handles: list[RemovableRuleHandle]) -> None:
        self._hooks += reversed(handles)  # the rules last, in the reverse order of their registration
        self._handles, self._plan = None, None
        if self._abandoned is not None:
            self._abandoned.detach()
            self._abandoned = None
        try:
            remove_listed(self._hooks)  # an interrupted removal leaves the rest listed, removed at the next enter
        finally:
            release(self)

    def __getstate__(self) -> dict:
        return wrapper_state(self, super().__getstate__)

    __deepcopy__ = wrapper_copy  # holding the lock

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._lock = threading.RLock()
        self._transformed_slots = TransformedSlots()  # the copy's model's own tensors
        self._keep_slots()

    def _keep_slots(self) -> None:
        """Keep (weakly) the tensors in the model's slots, which a refusal under a transform puts back."""
        if not torch._C._are_functorch_transforms_active():
            self._transformed_slots.take(self.named_explained_modules().values())

    def inactive(self) -> contextlib.AbstractContextManager[None]:
        """Switch the rules off in the block (plain forward and backward; calls write gradient × input), and
        enter an open context again when the block ends, however it ends.

        Examples:
            >>> from tensordict import TensorDict
            >>> net = nn.Linear(3, 1)
            >>> lrp, td = LRP(net, in_keys=["x"], out_keys=["y"]), TensorDict(x=torch.ones(2, 3), batch_size=[2])
            >>> with lrp, lrp.inactive():
            ...     torch.allclose(lrp(td)["relevance", "x"], net.weight.detach().expand(2, 3))
            True
        """
        return rules_off(self)

    @property
    def rule_mapper(self) -> RuleMapper:
        """The rules' mapper; one set here (a dict, ``None``) is made one as the constructor makes it."""
        try:
            return self.__dict__["_rule_mapper"]
        except KeyError:  # not set yet (a wrapper being built or unpickled): an attribute missing, as getattr expects
            raise AttributeError("rule_mapper") from None

    @rule_mapper.setter
    def rule_mapper(self, mapper: RuleMapper | Mapping | None) -> None:
        self.__dict__["_rule_mapper"] = mapper = as_rule_mapper(mapper)
        warn_for_unused_keys(mapper, self.named_explained_modules()[""])

    @_uncompiled_dispatch
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        refuse_loss_module_caller("LRP", self, self.create_graph)  # its outputs would give no gradient
        try:
            refuse_outer_transform()  # before a context is entered for the call
        except NotImplementedError:  # a caller's to_module under the transform does not put the parameters back
            self._transformed_slots.restore(self.named_explained_modules().values())
            raise
        # One call at a time (docs/guarantees.md); one that fails leaves the running statistics as they were.
        with self._lock:
            made, slots = HooksMade(), None
            try:
                made.open()  # until the call's write
                with buffers_restored_on_error(self.module, self._buffer_holders), self._grads.kept(self._handles):
                    # The parameters a swap inside the model's forward would leave out where the call fails.
                    slots = ParameterSlots(self._buffer_holders.modules(self.module))
                    entering = self._handles is None and not self._inactive
                    _set_state(self, "_call_enters", entering)
                    # A context entered here is left before the write, and so is the record of the caller's grad
                    # mode.
                    with called_in_grad_mode(torch.is_grad_enabled(), self._lock), self if entering else _NO_CONTEXT:
                        out, write = explain(self, tensordict)
                    made.close()  # before the write: an interrupt in it writes nothing
                    write()  # a call whose context fails to close writes nothing
                    return out
            except BaseException:  # a hook of the call whose registration failed before giving its handle
                if slots is not None:
                    slots.restore()
                listed = listed_hook_ids([*self._hooks, *(self._handles or [])])  # the open context's, kept
                remove_orphans([*self.named_explained_modules().values(), self.module], made.ids, listed)
                made.close()  # not left to the traceback, which holds it
                raise

    def coverage(self) -> Coverage:
        """What this wrapper's calls left to the plain gradient, and how much relevance reached the inputs.

        The first call of a wrapper, and its first call of each other signature (keys, shapes, dtypes and
        devices of its inputs), watches its forward pass for functions that are not piecewise linear
        and that no rule covers (a custom module computing ``torch.sin``, a product of two activations under
        a CNN preset); the last call gives the share of the target's relevance that reached the explained
        inputs, per sample.
        See :class:`~tdhook.attribution.coverage.Coverage`.

        Examples:
            >>> from tensordict import TensorDict
            >>> from tdhook.attribution import EpsilonPlus
            >>> net = nn.Sequential(nn.Linear(3, 4, bias=False), nn.ReLU(), nn.Linear(4, 2, bias=False))
            >>> lrp = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
            >>> _ = lrp(TensorDict(x=torch.rand(5, 3), batch_size=[5]))
            >>> report = lrp.coverage()
            >>> report.plain_gradient, report.reached.dtype, bool((report.reached - 1).abs().max() < 1e-4)
            ((), torch.float64, True)
        """
        return self._coverage.coverage(len(self.explained_keys), len(self.layer_keys), self._split_dim)
