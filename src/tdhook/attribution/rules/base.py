"""What every rule is made of: the ``Rule`` base class, its registration on a module, the handle that undoes it,
and ``ParamModifier`` for the rules that compute with modified parameters.

Every rule changes the gradient that flows backward through one module, so that
the relevance of any tensor ``a`` is ``a * grad(a)`` (see the design page of the
docs). With ``z`` the module's output and ``R = z * grad(z)`` its relevance, each
rule's docstring gives the relevance ``R_i`` it assigns to the module's input ``x``.

A rule is registered on a module with :meth:`Rule.register`, which returns a
:class:`RemovableRuleHandle`. Registration adds forward hooks only and never
writes a parameter: the modified parameters a rule needs are computed when it
is registered, again only when the module's parameters change (see
:class:`~tdhook.attribution.rules._held_parameters.HeldParameters`), and passed to its own forward passes.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from tdhook.attribution.rules._autograd import (
    is_activation,
    mark_module_of_parameters_alone,
    mark_parameter_derived,
    marked_parameter_derived,
    raise_for_vmap,
    relevance_pass_edges,
)
from tdhook.attribution.rules._earlier_hooks import raise_if_an_earlier_hook_changed
from tdhook.attribution.rules._graph_calls import recording
from tdhook.attribution.rules._held_parameters import HeldParameters, parameter_fingerprint
from tdhook.attribution.rules._identity import IdentityWeakKeyDict
from tdhook.attribution.rules._keeping_graph import graph_kept
from tdhook.attribution.rules._layer_nodes import LAYER_CALL, LAYER_MARK, is_layer_node
from tdhook.attribution.rules._layers import (
    LINEAR_LAYERS,
    TRANSPOSED_FORWARDS,
    _has_plain_forward,
    has_weight,
)
from tdhook.attribution.rules._meta_tensors import raise_for_meta_tensors
from tdhook.attribution.rules._module_inputs import inputs_in_forward
from tdhook.attribution.rules._parameter_sets import ParameterSets
from tdhook.attribution.rules._plain_calls import PLAIN_DEPTH, plain_calls
from tdhook.attribution.rules._rewrites import RUNNING, checked_rewrite, is_own_rewrite, rewrites
from tdhook.attribution.rules._rules_on_modules import forget_rule, note_rule, raise_for_another_rule
from tdhook.attribution.rules._scopes import pop, push
from tdhook.attribution.rules._unrecorded_writes import UNRECORDED, raise_for_unrecorded_inputs
from tdhook.attribution.rules._wrapper_calls import rules_act_here
from tdhook.attribution.rules.records import _LAYER_CALL, LayerCall, MergedLayer, Registration, layer_call_of
from tdhook.attribution.tunables import Tunable

_LAYER_MARK = LAYER_MARK

__all__ = [
    "ParamModifier",
    "Registration",
    "LayerCall",
    "MergedLayer",
    "layer_call_of",
    "parameter_fingerprint",
    "RemovableRuleHandle",
    "Rule",
    "plain_calls",
    "rules_apply",
    "output_seen_by_rule_alone",
]


def _identity_modifier(name: str, param: torch.Tensor) -> torch.Tensor:
    return param


class ParamModifier:
    """A modification of a module's own parameters.

    Rules call :meth:`modify` and :meth:`state_dicts`, which return modified
    copies and leave the module untouched. Calling the modifier,
    ``with modifier(module):``, is the one operation that writes: it puts the
    modified tensors in the module's parameter slots for the ``with`` block and
    the original parameter objects back after it, error or not. It is there for
    running a modified module by hand; no rule uses it.

    Args:
        modify_fn: ``(name, param) -> tensor``, the modified value of a selected parameter.
            Defaults to the identity.
        select_fn: ``(name, param) -> bool``, which parameters to modify. Defaults to
            :meth:`select_all`.

    Examples:
        >>> lin = nn.Linear(2, 1)
        >>> positive = ParamModifier(lambda name, p: p.clamp(min=0))
        >>> original, modified = positive.state_dicts(lin)
        >>> sorted(modified), bool((modified["weight"] >= 0).all())
        (['bias', 'weight'], True)
        >>> with positive(lin):
        ...     bool((lin.weight >= 0).all())
        True
        >>> lin.weight is original["weight"]
        True
    """

    def __init__(
        self,
        modify_fn: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
        select_fn: Callable[[str, torch.Tensor], bool] | None = None,
    ) -> None:
        self.modify_fn = modify_fn or _identity_modifier
        self.select_fn = select_fn or self.select_all

    @staticmethod
    def select_all(name: str, param: torch.Tensor) -> bool:
        """Select every parameter."""
        return True

    @classmethod
    def from_modifiers(cls, modifiers: Sequence[ParamModifier]) -> ParamModifier:
        """Chain modifiers: each applies, in order, to the parameters it selects.

        Examples:
            >>> zero_bias = ParamModifier(lambda n, p: torch.zeros_like(p), lambda n, p: n == "bias")
            >>> ones = ParamModifier(lambda n, p: torch.ones_like(p))
            >>> flat = ParamModifier.from_modifiers([ones, zero_bias])
            >>> _, modified = flat.state_dicts(nn.Linear(2, 1))
            >>> modified["weight"].tolist(), modified["bias"].tolist()
            ([[1.0, 1.0]], [0.0])
        """
        modifiers = list(modifiers)

        def select_fn(name: str, param: torch.Tensor) -> bool:
            return any(m.select_fn(name, param) for m in modifiers)

        def modify_fn(name: str, param: torch.Tensor) -> torch.Tensor:
            for m in modifiers:
                if m.select_fn(name, param):
                    param = m.modify_fn(name, param)
            return param

        return cls(modify_fn, select_fn)

    def modify(self, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The selected entries of ``params``, modified (for example a layer merged with its BatchNorm).

        Detached from ``params``, except in a call that keeps the graph (see
        :mod:`~tdhook.attribution.rules._keeping_graph`): there the modified
        tensors are functions of the live ones, so that the derivative of the
        relevance runs through them.

        Examples:
            >>> ParamModifier(lambda n, p: 2 * p).modify({"weight": torch.ones(1)})
            {'weight': tensor([2.])}
        """
        if graph_kept() is not None:
            return {n: self.modify_fn(n, p) for n, p in params.items() if self.select_fn(n, p)}
        with torch.no_grad():
            return {n: self.modify_fn(n, p.detach()) for n, p in params.items() if self.select_fn(n, p)}

    def state_dicts(self, module: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The selected parameters of ``module`` (not of its children), as they are and as modified.

        A parameter the module holds under several names is selected under each of them; a tensor that a
        parametrization computes (``weight_norm``, ``orthogonal``) is read as the module's forward reads it.
        """
        own = dict(module.named_parameters(recurse=False, remove_duplicate=False))
        if nn.utils.parametrize.is_parametrized(module):
            own.update((name, getattr(module, name)) for name in module.parametrizations)
        original = {n: p for n, p in own.items() if self.select_fn(n, p)}
        return original, self.modify(original)

    @contextmanager
    def __call__(self, module: nn.Module) -> Iterator[nn.Module]:
        """Swap in the modified parameters for the ``with`` block; restore the originals after it.

        Raises:
            ValueError: a selected tensor is computed by a parametrization: it has no slot to swap.
        """
        original, modified = self.state_dicts(module)
        computed = [n for n in original if nn.utils.parametrize.is_parametrized(module, n)]
        if computed:
            raise ValueError(
                f"ParamModifier: {type(module).__name__}'s {', '.join(map(repr, computed))} is computed by a "
                "parametrization (torch.nn.utils.parametrize), which would keep computing it unmodified in the "
                "with block; compute with the tensors of state_dicts() instead"
            )
        try:
            for name, value in modified.items():
                module._parameters[name] = value
            yield module
        finally:
            for name, value in original.items():
                module._parameters[name] = value


_ZERO_BIAS = ParamModifier(lambda n, p: torch.zeros_like(p), lambda n, p: n == "bias")


def _zeroing(names: Sequence[str]) -> ParamModifier:
    names = tuple(names)
    return ParamModifier(lambda n, p: torch.zeros_like(p), lambda n, p: n in names)


_UNPREPARED = object()

# torch's global forward hooks (``register_module_forward_hook``), run before every module's own.
_GLOBAL_FORWARD_HOOKS = nn.modules.module._global_forward_hooks


def rules_apply(module: nn.Module | None = None) -> bool:
    """Whether a rule's hooks apply it to a call of ``module`` made now: with gradients, outside
    :func:`plain_calls`, and, on a module an open wrapper's context holds, in a wrapper's call
    (:mod:`._wrapper_calls`; ``None``: any module, as held).

    Examples:
        >>> rules_apply()
        True
        >>> with torch.no_grad():
        ...     rules_apply()
        False
    """
    return torch.is_grad_enabled() and not getattr(PLAIN_DEPTH, "depth", 0) and rules_act_here(module)


class RemovableRuleHandle:
    """Undo one :meth:`Rule.register`. Holds the module by weak reference.

    Examples:
        >>> from tdhook.attribution.rules import EpsilonRule
        >>> lin = nn.Linear(2, 2)
        >>> with EpsilonRule().register(lin):
        ...     len(lin._forward_hooks)
        1
        >>> len(lin._forward_hooks)
        0
    """

    def __init__(self, rule: Rule, module: nn.Module) -> None:
        self.rule = rule
        self._module_ref = weakref.ref(module)
        # Read on every call of a context (the records): kept here rather than looked up by module each time.
        self._registration: Registration | None = rule._registrations.get(module)

    @property
    def module(self) -> nn.Module | None:
        """The module, or ``None`` once it has been garbage collected."""
        return self._module_ref()

    def hook_handles(self) -> list:
        """The torch hook handles the rule holds on the module (empty once removed)."""
        module = self.module
        registration = self.rule._registrations.get(module) if module is not None else None
        return list(registration.hooks) if registration is not None else []

    def _records(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        registration = self._registration
        return registration.records if registration is not None else []

    @property
    def records(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Relevance not carried by the gradient so far, as ``(module input, relevance)`` pairs."""
        return list(self._records())

    def pop_records(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Relevance not carried by the gradient, as ``(module input, relevance)`` pairs, since the last pop."""
        records = self._records()
        if not records:
            return []
        popped = list(records)
        records.clear()
        return popped

    def remove(self) -> None:
        """Remove the rule's hooks from the module."""
        module = self.module
        if module is not None:
            self.rule.unregister(module)
        self._registration = None

    def __enter__(self) -> RemovableRuleHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()


class Rule(Tunable):
    """Base class of the LRP rules.

    A rule rewrites a module's output into a tensor of the same value whose
    gradient is the rule's. Subclasses implement :meth:`rewrite` and, when they
    need modified parameters, :meth:`prepare` (called at registration, and again when the parameters change).
    ``docs/custom_rules.md`` writes a rule step by step.

    Examples:
        >>> from tdhook.attribution.rules import redirect
        >>> class HalfRule(Rule):
        ...     # half of the relevance of the module's output reaches its input
        ...     uses_input = False
        ...     def rewrite(self, module, registration, inputs, output):
        ...         return redirect(output, [output], lambda grad: [grad / 2])
        >>> lin = nn.Linear(3, 1, bias=False)
        >>> x = torch.randn(2, 3, requires_grad=True)
        >>> with HalfRule().register(lin):
        ...     lin(x).sum().backward()
        >>> torch.allclose(x.grad, lin.weight.detach().expand(2, 3) / 2)
        True
    """

    #: whether :meth:`rewrite` reads the module's input (in-place modules then keep a copy of it).
    uses_input: bool = True
    #: whether :meth:`rewrite_merged` is implemented (a following BatchNorm can be merged).
    merges_batch_norm: bool = False
    #: whether the rule acts inside the module's forward (through a function mode of its own), so that the
    #: wrapper must not pause function modes there.
    acts_in_forward: bool = False
    #: whether every call of the module gets the rule's gradient; where not (a rule that keeps the module's own
    #: gradient for some calls), the wrapper's coverage watch and relevance checks look inside the module.
    decides_every_call: bool = True
    #: whether the rule's relevance keeps its graph in a call that asks for it (``LRP(..., create_graph=True)``,
    #: see :mod:`~tdhook.attribution.rules._keeping_graph`): its backward is then written with torch operations
    #: on tensors that keep their history, so that the relevance has its true derivative.
    differentiable: bool = False
    #: whether the wrapper pauses the mapper's function modes inside the module (see
    #: :func:`~tdhook.attribution._context.suspend_function_modes_in`); a rule that computes the module's gradient
    #: from its own evaluation (the Taylor rule) leaves them running, so that the rules inside act as they would.
    pauses_function_modes: bool = True
    #: whether the gradient the rule hands back runs through the modules inside its module; where not (the Taylor
    #: rule takes it from its own evaluation at the reference), the relevance of those modules (``layers``) is refused.
    reaches_inner_modules: bool = True
    #: whether the rule rewrites one output tensor only: on a module whose output is a tuple, a list or a dict
    #: the rule then raises, where it would otherwise be skipped and the module keep its plain gradient.
    one_output_only: bool = False
    #: whether the rule reads the :class:`LayerCall` marks that rules leave on the outputs of Linear and
    #: convolution layers (a BatchNorm merging into the layer before it, a first-layer rule finding the model's
    #: input). Where no rule of a context reads them, the wrapper leaves out the rules registered only to leave
    #: them (:attr:`only_marks`).
    reads_layer_marks: bool = False
    #: whether the rule's only effect is the :class:`LayerCall` mark (the plain gradient otherwise).
    only_marks: bool = False
    # Whether the class's rewrite is written outside tdhook, a rule of one's own: its calls are checked (see _rewrites).
    own_rewrite: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.own_rewrite = is_own_rewrite(cls)

    def __init__(self) -> None:
        self._registrations: IdentityWeakKeyDict[nn.Module, Registration] = IdentityWeakKeyDict()

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if not name.startswith("_"):  # a setting (rule.gamma = 0.5): what prepare derived from it is prepared again
            super().__setattr__("_settings", self.__dict__.get("_settings", 0) + 1)

    def __getstate__(self) -> dict:
        if len(self._registrations):
            raise RuntimeError(
                f"{type(self).__name__} is registered on {len(self._registrations)} module(s); copy or pickle it "
                "outside the LRP context"
            )
        return {k: v for k, v in self.__dict__.items() if k != "_registrations"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._registrations = IdentityWeakKeyDict()

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"

    def _rebuild(self, values: dict[str, Any]) -> None:
        if len(self._registrations):
            raise RuntimeError(
                f"{type(self).__name__} is registered on {len(self._registrations)} module(s); set its parameters "
                "outside the LRP context"
            )
        super()._rebuild(values)

    def prepare(self, module: nn.Module) -> Any:
        """Per-module state computed from the module's parameters (for example modified parameters).

        It is computed at registration and again whenever the parameters change
        (see :meth:`prepared_state`).
        """
        return None

    def prepared_state(self, module: nn.Module, registration: Registration) -> Any:
        """``registration.state``, prepared anew when ``module``'s parameters changed since it was prepared.

        An ``optimizer.step()`` or an in-place write between two calls inside one
        context (one through ``.data`` included, as torchrl's target updates and
        weight syncs write), or a parameter replaced by another, is seen through
        :class:`~tdhook.attribution.rules._held_parameters.HeldParameters`: the
        modified parameters always follow the live ones, and are not rebuilt while
        nothing changes. In a call that keeps
        the graph (``LRP(..., create_graph=True)``), the state is built from the
        live parameters inside the autograd graph, once per call and set of
        parameters the module runs with, and ``registration.state`` is left as it is.

        Examples:
            >>> from tdhook.attribution.rules import AlphaBetaRule
            >>> lin, rule = nn.Linear(2, 1), AlphaBetaRule(1.0, 0.0)
            >>> with rule.register(lin):
            ...     registration = rule._registrations[lin]
            ...     with torch.no_grad():
            ...         _ = lin.weight.fill_(-1.0)
            ...     rule.prepared_state(lin, registration)["pos"]["weight"]
            tensor([[0., 0.]])
        """
        if type(self).prepare is Rule.prepare:  # nothing is derived from the parameters
            if registration.state is _UNPREPARED:
                registration.state = None
            return registration.state
        relevance_pass = graph_kept()
        if relevance_pass is not None:  # from the live parameters, once per call and parameter set: never the cache
            return relevance_pass.state(self, module, lambda: self.prepare(module), parameter_fingerprint(module))
        settings = self.__dict__.get("_settings", 0)
        if (
            registration.state is _UNPREPARED
            or registration.settings != settings
            or not registration.held.unchanged(module)
        ):
            registration.state = self.prepare(module)
            registration.held = HeldParameters(module)
            if isinstance(registration.state, ParameterSets):  # a write through ``.data`` before a set is built
                registration.state.hold(registration.held.copies_of(registration.state.sources(), module))
            registration.settings = settings
        return registration.state

    def rewrite(
        self, module: nn.Module, registration: Registration, inputs: tuple, output: torch.Tensor
    ) -> torch.Tensor | None:
        """Return the module's output with the rule's gradient, or ``None`` to keep it.

        ``registration.state`` holds what :meth:`prepare` returned, and relevance the
        gradient cannot carry goes to ``registration.records``.
        """
        raise NotImplementedError

    def rewrite_merged(self, call: LayerCall, output: torch.Tensor, merged: MergedLayer) -> torch.Tensor | None:
        """Like :meth:`rewrite`, for ``call.module`` merged with the BatchNorm whose output is ``output``.

        The returned tensor replaces the BatchNorm's output. Implemented by the
        rules with ``merges_batch_norm = True``.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot be merged with a BatchNorm")

    def zero_output_seeds(
        self, call: LayerCall, relevance: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Where a backward pass starts so that ``relevance``, put on outputs of ``call`` that are exactly 0 (and
        zero elsewhere), flows as the rule's explicit form sends it: ``output × gradient`` cannot carry it there.

        Returns ``(tensor, gradient)`` pairs added to the pass, or ``None`` where the rule gives such outputs no
        way to pass relevance on (the wrapper then refuses the target, naming the outputs).
        """
        return None

    def resolve(self, module: nn.Module, registration: Registration, inputs: tuple) -> tuple[Rule, Registration]:
        """The rule that handles this call (a rule that delegates returns another)."""
        return self, registration

    def register(self, module: nn.Module) -> RemovableRuleHandle:
        """Attach the rule to ``module``; the returned handle removes it."""
        if module in self._registrations:
            raise ValueError(f"{self!r} is already registered on this {type(module).__name__}")
        registration = self._new_registration(module)
        if isinstance(module, LINEAR_LAYERS) and _has_plain_forward(module):
            registration.plain_layer = type(module)  # a parametrization, added later, changes the class
        with self._recorded(module, registration):
            if self.uses_input and hasattr(module, "inplace"):  # in place now, or once its flag is set in the context
                snapshot = self._snapshot_hook(registration)
                registration.hooks.append(module.register_forward_pre_hook(snapshot, with_kwargs=True))
            # Before the module's own forward hooks: what they change is then code after the layer, passed by its
            # gradient, not taken by the rule for the layer's own computation.
            hook = self._forward_hook(registration)
            registration.hooks.append(module.register_forward_hook(hook, prepend=True, with_kwargs=True))
        return RemovableRuleHandle(self, module)

    @contextmanager
    def _recorded(self, module: nn.Module, registration: Registration) -> Iterator[None]:
        """Record ``registration`` for ``module``, then run the block that adds its hooks; where the block fails (an
        error, an interrupt), remove the hooks it added and the record.

        Recorded first, each hook is listed as it is added, so :meth:`unregister` finds every hook the rule put
        on the module, whatever line an interrupt stops the registration at: none is left acting unseen.
        """
        raise_for_another_rule(self, module)
        try:
            self._registrations[module] = registration
            note_rule(self, module)
            yield
        except BaseException:
            self.unregister(module)
            raise

    def _register_in_forward(
        self, module: nn.Module, make_mode: Callable[[nn.Module], Any], leave: Callable | None = None
    ) -> RemovableRuleHandle:
        """Attach a rule that acts inside ``module``'s forward: each call with gradients runs in ``make_mode(module)``
        (a ``TorchFunctionMode``), and ``leave(module, args, output, mode)``, if given, may replace the output.
        ``args`` holds the call's positional arguments, then the tensors it was given by keyword (``norm(input=x)``
        is ``norm(x)``: see :mod:`~tdhook.attribution.rules._module_inputs`)."""
        if module in self._registrations:
            raise ValueError(f"{self!r} is already registered on this {type(module).__name__}")
        registration = self._new_registration(module)
        modes: list = []

        def enter(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            if UNRECORDED:  # a tensor whose values autograd did not see written: the modes see no read inside
                raise_for_unrecorded_inputs(mod, inputs_in_forward(mod, args, kwargs))
            push(modes, make_mode(mod) if rules_apply(mod) else None, enter=True)

        def done(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            mode = pop(modes)  # left; or by closing_scopes, if an interrupt skips this hook
            if mode is None or leave is None:
                return None
            try:
                return leave(mod, inputs_in_forward(mod, args, kwargs), output, mode)
            except Exception as err:
                if getattr(err, "module", None) is None:
                    err.module = mod  # the wrapper names its path
                raise

        with self._recorded(module, registration):
            registration.hooks.append(module.register_forward_pre_hook(enter, with_kwargs=True))
            registration.hooks.append(module.register_forward_hook(done, with_kwargs=True, always_call=True))
        return RemovableRuleHandle(self, module)

    def _new_registration(self, module: nn.Module) -> Registration:
        # A lazy module (LazyConv2d, LazyLinear) is prepared at its first call, once its shapes are known; so is a
        # template whose parameters are placeholders on the meta device, swapped in at call time (torchrl's
        # multi-agent networks).
        registration = Registration(_UNPREPARED)
        if (
            not _has_uninitialized_parameters(module)
            and not _has_meta_weight(module)
            and not _weight_set_at_call(module)
        ):
            self.prepared_state(module, registration)
        return registration

    def is_registered(self, module: nn.Module) -> bool:
        """Whether the rule has hooks on ``module``."""
        registration = self._registrations.get(module)
        return registration is not None and bool(registration.hooks)

    def is_registered_anywhere(self) -> bool:
        """Whether the rule has hooks on some module."""
        return any(registration.hooks for registration in self._registrations.values())

    def unregister(self, module: nn.Module) -> None:
        """Detach the rule from ``module`` (no-op when it is not attached)."""
        registration = self._registrations.get(module)
        if registration is not None:
            # Each hook listed until it is removed, and the registration kept until they all are: an unregistering
            # that an interrupt stops is finished by the next one, never leaving a hook of the rule on the module.
            # The pre-hooks go first: one left without the forward hook that closes what it opens (a function mode
            # entered for the forward) would leave that open at every plain call until the next unregistering.
            pre_hooks = module._forward_pre_hooks
            while registration.hooks:
                opening = [h for h in registration.hooks if getattr(h, "hooks_dict_ref", lambda: None)() is pre_hooks]
                handle = opening[0] if opening else registration.hooks[-1]
                handle.remove()
                registration.hooks.remove(handle)
            self._registrations.pop(module, None)
        forget_rule(self, module)

    @staticmethod
    def _snapshot_hook(registration: Registration) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not getattr(module, "inplace", False) or not torch.is_grad_enabled():
                return
            inputs = _call_arguments(module, args, kwargs)
            if inputs and isinstance(inputs[0], torch.Tensor) and inputs[0].requires_grad:
                push(registration.snapshots, (inputs[0].clone(), *inputs[1:]))

        return hook

    def _forward_hook(self, registration: Registration) -> Callable:
        # The hook knows itself through a weak reference: one to itself in its closure would make a reference cycle,
        # which would keep the registration (the prepared state: copies of the layer's weights) after the rule is
        # removed, until the garbage collector's next full pass.
        itself: Callable[[], Callable | None]

        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            inputs = pop(registration.snapshots) if registration.snapshots else None  # this thread's, if it took one
            inputs = _call_arguments(module, args, kwargs) if inputs is None else inputs
            # Not for a call of the module that its own rule's rewrite makes (RUNNING.stack is empty for all others).
            busy = registration.busy and threading.get_ident() in registration.busy
            if busy or not rules_apply(module) or (RUNNING.stack and rewrites(module)):
                return _ruled_in_forward(module)
            if UNRECORDED:  # a tensor whose values autograd did not see written: the modes see no read inside
                raise_for_unrecorded_inputs(module, inputs)
            raise_for_vmap(module, output)
            if not isinstance(output, torch.Tensor) or not output.requires_grad:
                # A rule of one's own rewrites one tensor: skipped, it would leave the module its plain gradient.
                if (self.one_output_only or self.own_rewrite) and not isinstance(output, torch.Tensor):
                    _raise_for_several_outputs(self, module, output)
                return _ruled_in_forward(module)
            raise_for_meta_tensors(module, output)
            earlier = next(iter(module._forward_hooks.values())) is not itself()  # prepended in the open context
            if (_GLOBAL_FORWARD_HOOKS or earlier) and isinstance(module, LINEAR_LAYERS):
                raise_if_an_earlier_hook_changed(module, registration.busy, inputs, output, not earlier)
            self.prepared_state(module, registration)
            rule, reg = self.resolve(module, registration, inputs)
            if rule.own_rewrite:  # a rule of one's own: what it returns and what its backward gives are checked
                result = checked_rewrite(rule, module, reg, inputs, output)
            else:
                result = rule.rewrite(module, reg, inputs, output)
            one_input = isinstance(module, LINEAR_LAYERS) and len(inputs) == 1 and isinstance(inputs[0], torch.Tensor)
            if one_input and not is_activation(inputs[0]) and _has_plain_forward(module):
                # A layer of a constant (a buffer, a learned query) computes from parameters alone, whether its
                # forward ran inside the function modes or paused: mark it as the modes would. Only where its one
                # input is all it reads.
                parameters = (inputs[0], *module.parameters(recurse=False))
                mark_parameter_derived(parameters, output if result is None else result)
            elif (
                len(inputs) == 1
                and isinstance(first := inputs[0], torch.Tensor)
                and (not first.requires_grad or first.is_leaf or marked_parameter_derived(first))
            ):
                # So does any other module of one constant (a time embedding's SiLU): the modes do not see into a
                # module with a rule, and a product with what it computes would take it for an activation. (Asked
                # here, not in a call: the input of most modules is an activation, which then costs no call.)
                mark_module_of_parameters_alone(inputs, output if result is None else result)
            if one_input and registration.marks:
                read = (module.weight, module.bias) if type(module) is registration.plain_layer else None
                call = LayerCall(module, rule, reg, inputs[0], output, 0, read=read)
                _mark(result if result is not None else output, call)
            return result

        itself = weakref.ref(hook)
        return hook


def _call_arguments(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """The arguments of a call of ``module``: the positional ones, then those given by keyword (``layer(input=x)``
    is ``layer(x)``, and a keyword the rule's modified pass would leave out is refused as a second argument is), but
    a transposed convolution's ``output_size``, by keyword or as its second argument (``forward(input,
    output_size)``): its rules take the shape of its output."""
    transposed = isinstance(module, tuple(TRANSPOSED_FORWARDS))
    if transposed and len(args) == 2:
        args = args[:1]
    if not kwargs:
        return args
    names = tuple(name for name in kwargs if not (transposed and name == "output_size"))
    return CallArguments((*args, *(kwargs[name] for name in names)), names)


class CallArguments(tuple):
    """A call's arguments as one tuple, those it gave by keyword last, named by ``keywords`` in their order (a rule
    that calls the module again, as the Taylor rule does at its reference, gives them back by keyword).

    Examples:
        >>> arguments = CallArguments((1, 2, 3), ("scale",))
        >>> tuple(arguments), arguments.keywords
        ((1, 2, 3), ('scale',))
    """

    keywords: tuple[str, ...]

    def __new__(cls, values: tuple, keywords: tuple[str, ...]) -> CallArguments:
        arguments = super().__new__(cls, values)
        arguments.keywords = keywords
        return arguments


def _ruled_in_forward(module: nn.Module) -> None:
    """A call that records its rules' places in the graph keeps ``module``'s hooks in later calls: its rule acted in
    the forward, or left a call alone (see ``Recording.rule_in_forward`` in ``tdhook.attribution._function_rule_plan``).
    """
    record = recording()
    if record is not None:
        record.rule_in_forward(module)


def _raise_for_several_outputs(rule: Rule, module: nn.Module, output: Any) -> None:
    """Raise where a rule that rewrites one output tensor is on a module whose output holds several that need
    grad."""
    values = output.values() if isinstance(output, Mapping) else output if isinstance(output, (tuple, list)) else ()
    if any(isinstance(v, torch.Tensor) and v.requires_grad for v in values):
        error = ValueError(
            f"{type(rule).__name__} on {type(module).__name__}: the rule explains a module with one output tensor, "
            f"and this one returns a {type(output).__name__}; map the modules inside it, or a module that "
            "returns one tensor"
        )
        error.module = module  # type: ignore[attr-defined]  # the wrapper names its path
        raise error


def _has_uninitialized_parameters(module: nn.Module) -> bool:
    return any(nn.parameter.is_lazy(p) for p in module.parameters(recurse=False))


def _weight_set_at_call(module: nn.Module) -> bool:
    """Whether a Linear or convolution layer has no weight until its forward pre-hooks set one (EqualLR's, in
    progressive-GAN and StyleGAN code: the ``weight`` parameter deleted, ``weight_orig`` kept): prepared at its first
    call, once they ran, as a lazy layer is."""
    return isinstance(module, LINEAR_LAYERS) and not has_weight(module) and bool(module._forward_pre_hooks)


def _has_meta_weight(module: nn.Module) -> bool:
    if nn.utils.parametrize.is_parametrized(module, "weight"):
        # The stored tensors: computing the weight would run the parametrization (spectral_norm's power
        # iteration, in training mode), which only the module's own call may do.
        stored = module.parametrizations["weight"]
        return any(t.is_meta for t in (*stored.parameters(), *stored.buffers()))
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.is_meta


def _mark(tensor: torch.Tensor, call: LayerCall) -> None:
    """Attach ``call`` to the layer's output and mark its autograd node as a layer boundary."""
    call.version = tensor._version
    base = tensor._base  # F.linear's (..., out) view of its (M, out) product: marked too, for its other views
    raw = call.raw
    if tensor is raw or (base is not None and (base is raw or base is raw._base)):
        # The tensor (or its base) holds the call, and would be held back by it: a cycle, which kept the layer's
        # output and the graph behind it after the call. Whoever reads the call holds the tensor, and so ``raw``.
        call.held_by_raw()
    setattr(tensor, _LAYER_CALL, call)
    if base is not None and tensor.numel() == base.numel() and tensor.is_contiguous() and base.is_contiguous():
        if tensor is raw or (base is raw._base and raw.is_contiguous() and raw.numel() == base.numel()):
            # The base may outlive ``raw``, a view of it: so may the tensor, a view of that base too (the view a
            # rule's ``scale_gradient`` returns), which does not hold ``raw`` (see layer_call_of).
            call.shape = raw.shape
        setattr(base, _LAYER_CALL, call)
    if tensor.grad_fn is not None:
        tensor.grad_fn.metadata[_LAYER_MARK] = True
        # For a BatchNorm over a concatenation of layers' outputs (which holds no part itself): ``raw`` as it is
        # where it comes before the node (a rule's own tensor: a merge sends the gradient back to it), detached where
        # it is the node's own output (it would hold the node that holds it: a cycle).
        own = raw.grad_fn is tensor.grad_fn
        tensor.grad_fn.metadata[LAYER_CALL] = call.copy(raw=raw.detach() if own else raw)


def output_seen_by_rule_alone(module: nn.Module, registration: Registration, output: torch.Tensor) -> bool:
    """Whether a rule may change the gradient at ``output`` on ``output``'s own autograd node rather than through
    a tensor of its own: nothing but the rule ever sees ``output`` before the gradient is changed.

    That holds where ``output`` is a fresh tensor (not a view, whose in-place changes would go around its node)
    made by a plain Linear or convolution layer; the rule's forward hook is the module's first and no global
    forward hook runs (no other hook saw ``output`` and registered a tensor hook on it); and no pass starts at
    the layer's raw output (its :class:`LayerCall` mark is not left: no BatchNorm merges, no callable target
    or relevance check reads it). Not in a compiled graph, nor under ``torch.func`` transforms.

    Examples:
        >>> from tdhook.attribution.rules import EpsilonRule
        >>> lin, rule, x = nn.Linear(2, 2), EpsilonRule(), torch.ones(1, 2)
        >>> with rule.register(lin):
        ...     registration = rule._registrations[lin]
        ...     registration.marks = False
        ...     output_seen_by_rule_alone(lin, registration, nn.functional.linear(x, lin.weight, lin.bias))
        True
    """
    return (
        not registration.marks
        and type(module) is registration.plain_layer
        and not output._is_view()
        and output.grad_fn is not None
        and not _GLOBAL_FORWARD_HOOKS
        and next(iter(module._forward_hooks), None) == registration.hooks[-1].id
        and not torch._C._are_functorch_transforms_active()
        and not torch.compiler.is_compiling()
    )


def _reaches_model_input(x: torch.Tensor) -> bool:
    """Whether ``x`` depends on a non-parameter leaf without passing through a Linear or convolution layer."""
    if x.grad_fn is None:
        return x.requires_grad and not isinstance(x, nn.Parameter)
    stack, seen = [x.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if is_layer_node(node):
            continue
        variable = getattr(node, "variable", None)
        if variable is not None:
            if not isinstance(variable, nn.Parameter):
                return True
            continue
        stack.extend(relevance_pass_edges(node))
    return False


def _single_input(rule: Rule, module: nn.Module, inputs: tuple) -> torch.Tensor:
    if len(inputs) != 1 or not isinstance(inputs[0], torch.Tensor):
        raise ValueError(
            f"{type(rule).__name__} expects one tensor input on {type(module).__name__}, got {len(inputs)} arguments"
        )
    return inputs[0]
