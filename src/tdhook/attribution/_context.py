"""What an LRP context holds on the model besides its rules: its claim on the modules, and function-mode pauses.

A module is inside at most one LRP wrapper's context at a time (the rules of
two wrappers on one model would mix): :func:`claim` takes the modules for a
wrapper, :func:`release` gives them back; a claim holds its wrapper weakly, so that
a wrapper garbage collected with its context open (its hooks removed then, see
:func:`abandon`) holds the modules no longer. :func:`suspend_function_modes_in`
pauses the rule mapper's torch function modes inside modules that have a rule
of their own.

Examples:
    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> class Owner:
    ...     pass
    >>> first, second = Owner(), Owner()
    >>> claim(first, dict(net.named_modules()))
    >>> claim(second, dict(net.named_modules()))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    RuntimeError: LRP: module 'the model itself' (Sequential) is already inside another LRP wrapper's ...
    >>> release(first)
    >>> claim(second, dict(net.named_modules()))
    >>> release(second)
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from tdhook.attribution._model_changes import forget_modules, record_modules
from tdhook.attribution._orphan_hooks import HooksMade
from tdhook.attribution._scripted_modules import refuse_scripted_modules
from tdhook.attribution.rules._graph_calls import note_region
from tdhook.attribution.rules._identity import IdentityWeakKeyDict
from tdhook.attribution.rules._layers import (
    ACTIVATIONS,
    GATES,
    GRADIENT_ROUTED,
    GRADIENT_ROUTED_NAMES,
    GRADIENT_ROUTED_SUFFIXES,
    LINEAR_LAYERS,
    _has_plain_forward,
)
from tdhook.attribution.rules._scopes import pop, push
from tdhook.attribution.rules._unrecorded_writes import UNRECORDED, raise_for_unrecorded_inputs
from tdhook.attribution.rules._wrapper_calls import context_closed, context_opened
from tdhook.attribution.rules.base import RemovableRuleHandle, Rule
from tdhook.attribution.rules.basic import EpsilonRule, IgnoreRule
from tdhook.attribution.rules.gates import give_back_norms_entering

__all__ = [
    "abandon",
    "claim",
    "leave_out_unread_marks",
    "marks_are_read",
    "marks_for_target",
    "register_rule",
    "release",
    "hooks_around",
    "remove_listed",
    "stop_marks",
    "suspend_function_modes_in",
]

# Every module inside an open LRP context, with (a weak reference to) the wrapper that owns it: two wrappers' rules
# on one module would mix.
_OWNERS: IdentityWeakKeyDict[nn.Module, weakref.ref] = IdentityWeakKeyDict()
# The thread that opened each owner's context (named where another thread's wrapper asks for its modules).
_OWNER_THREADS: IdentityWeakKeyDict[object, int] = IdentityWeakKeyDict()
# Held for each claim (its check and its marks, at once) and release: two threads' wrappers entering on one model
# at once would both pass the check, and a release walking the owners while another thread's changes them fails.
_CLAIMS = threading.RLock()  # re-entrant: a finalizer run by the garbage collector inside


def _owner(module: nn.Module) -> object | None:
    reference = _OWNERS.get(module)
    return None if reference is None else reference()


def claim(owner: object, modules: Mapping[str, nn.Module]) -> None:
    """Mark ``modules`` as inside the context of ``owner``.

    Args:
        owner: the LRP wrapper entering its context.
        modules: the wrapped model's modules by name.

    Raises:
        TypeError: one of ``modules`` is a TorchScript module, which no rule reaches
            (:func:`~tdhook.attribution._scripted_modules.refuse_scripted_modules`).
        RuntimeError: one of ``modules`` is inside another owner's context (of this thread or another);
            then none is claimed.
    """
    refuse_scripted_modules(modules)
    with _CLAIMS:
        for name, module in modules.items():
            current = _owner(module)
            if current is not None and current is not owner:
                raise _claimed(name, module, current)
        reference = weakref.ref(owner)
        for module in modules.values():
            _OWNERS[module] = reference
        _OWNER_THREADS[owner] = threading.get_ident()
    record_modules(owner, modules)  # each call checks that the model still has these (see _model_changes)
    context_opened(owner, modules.values())


def _claimed(name: str, module: nn.Module, current: object) -> RuntimeError:
    """The error for a claim of ``module``, which ``current``'s context holds."""
    path = name or "the model itself"
    what = f"LRP: module {path!r} ({type(module).__name__}) is already inside another LRP wrapper's context"
    if _OWNER_THREADS.get(current, threading.get_ident()) != threading.get_ident():
        return RuntimeError(
            f"{what}, opened in another thread: this model is being explained by another LRP context in another "
            "thread; give each worker its own copy of the model (copy.deepcopy) and its own wrapper, or share one "
            "wrapper between the threads (its calls run one at a time); the rules of two wrappers on one model "
            "would mix"
        )
    return RuntimeError(f"{what}; leave that context first (the rules of two wrappers on one model would mix)")


def release(owner: object) -> None:
    """Give back every module that ``owner`` claimed.

    Args:
        owner: the LRP wrapper leaving its context.
    """
    with _CLAIMS:
        held = [m for m, reference in _OWNERS.items() if reference() in (owner, None)]
        _OWNER_THREADS.pop(owner, None)
        context_closed(owner, held)
        forget_modules(owner)
        for module in held:
            del _OWNERS[module]


def abandon(hooks: list, handles: list[RemovableRuleHandle]) -> None:
    """Remove what the context of a wrapper garbage collected with it open left on the model: ``hooks`` and the
    rules of ``handles`` (the finalizer of an open context; it holds the lists, not the wrapper).

    Args:
        hooks: the context's hooks (the wrapper's list).
        handles: the handles of its rules.
    """
    hooks += reversed(handles)
    remove_listed(hooks)


def register_rule(rule: Rule, name: str, module: nn.Module) -> RemovableRuleHandle:
    """``rule.register(module)``, and where that fails (an error, an interrupt), the hooks it had added so far
    removed and its record of the module dropped: a rule half registered would act on later calls of the model.
    Hooks that another thread put on the module meanwhile stay.

    Args:
        rule: the rule.
        name: the module's path, named in the error.
        module: the module.

    Raises:
        BaseException: what the registration raised; an ``Exception`` as the same type, naming the rule and the
            module.
    """
    before = {key: set(hooks) for key, hooks in vars(module).items() if "hooks" in key and isinstance(hooks, dict)}
    had = module in rule._registrations  # registered already (refused below): that registration is not ours
    made = HooksMade()  # open until the registration ends
    try:
        made.open()
        handle = rule.register(module)
        made.close()  # an interrupt in it undoes the registration as any failure does
        return handle
    except BaseException as err:
        if not had:
            rule.unregister(module)
        for key, hooks in vars(module).items():
            if key in before and isinstance(hooks, dict):
                for hook_id in [hook_id for hook_id in hooks if hook_id not in before[key] and hook_id in made.ids]:
                    del hooks[hook_id]
        made.close()  # not left to the traceback, which holds it
        if isinstance(err, Exception):
            raise type(err)(f"cannot register {rule!r} on module {name!r} ({type(module).__name__}): {err}") from err
        raise


def remove_listed(hooks: list) -> None:
    """Remove the hooks and rule handles listed in ``hooks``, in order, each even if removing another raised.

    Each stays listed until its removal has returned: one that an interrupt (``KeyboardInterrupt``) stopped is
    removed when this is called again (removing is idempotent). The first failure is raised at the end.

    Args:
        hooks: torch hook handles, rule handles, or anything with a ``remove()`` method; emptied but for the
            interrupted ones.
    """
    failure, index = None, 0
    while index < len(hooks):
        try:
            hooks[index].remove()
        except BaseException as err:  # a rule of one's own whose removal raised: the others are removed still
            failure = failure or err
            if not isinstance(err, Exception):
                index += 1  # interrupted: kept, to be removed again
                continue
        del hooks[index]
    if failure is not None:
        raise failure


# Rules whose hook computes on detached tensors only: nothing in it is a call on activations for a mode to change.
_DETACHED_HOOKS = (EpsilonRule, IgnoreRule)


def suspend_function_modes_in(
    handles: Sequence[RemovableRuleHandle], plain_only: bool = False
) -> list[RemovableHandle]:
    """Run modules that have a rule of their own without the mapper's function modes.

    A module rule decides the module's gradient as a whole, so the function
    rules (AttnLRP's products and softmax, stabilised additions) have
    nothing to change inside it, and skipping their Python dispatch there
    saves time. The modes resume when the module returns or raises; if it is
    interrupted (``KeyboardInterrupt``, which skips torch's ``always_call``
    hooks), when the wrapper's :func:`~tdhook.attribution.rules._scopes.closing_scopes` ends.

    Args:
        handles: the handles of the registered rules.
        plain_only: pause only in the modules the caller mapped to ``IgnoreRule`` that compute more than a layer or
            an activation (a block, a norm written in a module's forward), whose plain gradient inside the caller
            asked for: for modes that stay on inside modules with rules (the CNN presets' gate mode, which holds the
            norms of ``F.normalize`` and ``F.cosine_similarity``, and gives them back their plain gradient where what
            they computed enters such a module: the mode does not see its products).

    Returns:
        The handles of the forward hooks that pause and resume the modes, for removal.
    """
    guards: list = []

    def suspend(module: nn.Module, args: tuple, kwargs: dict) -> None:
        enabled = torch._C._is_torch_function_mode_enabled()
        if enabled and kwargs:  # inputs given by keyword (``block(hidden_states=h)``) enter it as positional ones do
            args = (*args, *kwargs.values())
        if enabled and plain_only:  # norms held upstream: the modes do not see the products inside
            give_back_norms_entering(args)
        if enabled and UNRECORDED:  # a tensor whose values autograd did not see written: the modes see no read inside
            raise_for_unrecorded_inputs(module, args)
        guard = torch._C.DisableTorchFunction() if enabled else None
        push(guards, guard, enter=True)  # left by resume, or by closing_scopes if the forward never returns
        note_region(module)  # where a call records or follows a plan: which nodes the modes did not see made

    def resume(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        pop(guards)
        note_region(None)

    def pausing(handle: RemovableRuleHandle) -> bool:
        module, rule = handle.module, handle.rule
        if module is not None and isinstance(rule, IgnoreRule) and not rule.is_registered(module):
            # The plain gradient asked for by the caller: the modes must not act inside.
            if plain_only and isinstance(module, (*LINEAR_LAYERS, *ACTIVATIONS, *GATES)):
                return False  # a layer or an activation: what the gate mode does there is no call inside it
            return rule._plain_inside and _computes_in_forward(module)
        if plain_only:
            return False
        if module is None or not rule.is_registered(module) or rule.acts_in_forward:
            return False
        if not rule.pauses_function_modes:  # a rule that lets the rules inside act (the Taylor rule)
            return False
        detached = type(rule) in _DETACHED_HOOKS
        # One F.linear or convolution call, which no mode changes: pausing costs more than it saves. A layer's own
        # forward calling more (an activation, a clip, a norm): those calls get the function rules they would get
        # beside the layer, whose ε-rule or plain gradient (a detached hook on its output) they leave as it is.
        return not (detached and isinstance(module, LINEAR_LAYERS))

    return hooks_around((handle.module for handle in handles if pausing(handle)), suspend, resume, with_kwargs=True)


def _computes_in_forward(module: nn.Module) -> bool:
    """Whether ``module``, mapped to :class:`~tdhook.attribution.rules.basic.IgnoreRule`, may compute what the
    function modes give a rule (a norm, an activation, attention): any module but those whose gradient routes the
    relevance by itself (pooling, dropout, reshapes, padding), which the presets map to that rule by default and
    whose calls no mode changes.

    Examples:
        >>> _computes_in_forward(nn.LayerNorm(2)), _computes_in_forward(nn.Dropout())
        (True, False)
    """
    name = type(module).__name__
    routed = name in GRADIENT_ROUTED_NAMES or name.endswith(GRADIENT_ROUTED_SUFFIXES)
    return not (routed or isinstance(module, GRADIENT_ROUTED))


def hooks_around(
    modules: Iterable[nn.Module], start: Callable, end: Callable, with_kwargs: bool = False
) -> list[RemovableHandle]:
    """A forward pre-hook ``start`` and a forward hook ``end`` (called when the forward raises too) on each of
    ``modules``, or none if an interrupt stops the registration (the model is then left as it was). With
    ``with_kwargs``, each hook also takes the call's keyword arguments (after its positional ones).

    Examples:
        >>> hooks = hooks_around([nn.Linear(2, 2), nn.ReLU()], lambda m, a: None, lambda m, a, o: None)
        >>> len(hooks)
        4
        >>> remove_listed(hooks)
    """
    hooks: list[RemovableHandle] = []
    try:
        for module in modules:
            hooks.append(module.register_forward_pre_hook(start, with_kwargs=with_kwargs))
            hooks.append(module.register_forward_hook(end, with_kwargs=with_kwargs, always_call=True))
        return hooks  # inside the try: an interrupt before the return leaves no hook
    except BaseException:  # an interrupt: leave the model as it was
        remove_listed(hooks)
        raise


def marks_are_read(rules: Mapping[str, Rule], checked: bool, target: object) -> bool:
    """Whether anything in a context reads the marks that rules leave on Linear and convolution layers' outputs.

    A BatchNorm merging into the layer before it and a first-layer rule read them (``reads_layer_marks``), and
    so do per-module relevance checks (``checked``) and a callable target, whose relevance on outputs that are
    exactly zero goes to the rule of the layer that produced them.

    Examples:
        >>> from tdhook.attribution.rules import EpsilonRule, IgnoreRule, MergeBatchNormRule
        >>> marks_are_read({"fc": IgnoreRule(), "head": EpsilonRule()}, checked=False, target=None)
        False
        >>> marks_are_read({"fc": IgnoreRule(), "bn": MergeBatchNormRule()}, checked=False, target=None)
        True
    """
    return checked or callable(target) or any(rule.reads_layer_marks for rule in rules.values())


def leave_out_unread_marks(rules: Mapping[str, Rule], modules: Mapping[str, nn.Module]) -> dict[str, Rule]:
    """``rules`` without those whose only effect is a mark (:attr:`~tdhook.attribution.rules.base.Rule.only_marks`)
    on a plain Linear or convolution layer, for a context where :func:`marks_are_read` is false.

    :class:`~tdhook.attribution.rules.basic.IgnoreRule` keeps a Linear or convolution layer's plain gradient;
    its hook only marks the layer's output. A transformer under AttnLRP reads no marks, and the hook and the
    pause of the function modes around each layer cost more than the layer's one ``F.linear`` call in the
    modes. A layer with a forward of its own (a subclass), a parametrized weight or hooks of the user's keeps
    its rule and so its pause: the modes must not change what its forward computes.

    Examples:
        >>> from tdhook.attribution.rules import EpsilonRule, IgnoreRule
        >>> modules = {"fc": nn.Linear(2, 2), "head": nn.Linear(2, 1)}
        >>> sorted(leave_out_unread_marks({"fc": IgnoreRule(), "head": EpsilonRule()}, modules))
        ['head']
    """
    return {name: rule for name, rule in rules.items() if not (rule.only_marks and _bare_layer(modules[name]))}


def _bare_layer(module: nn.Module) -> bool:
    """A Linear or convolution layer with torch's own forward, its own weight and no hooks."""
    hooks = module._forward_hooks or module._forward_pre_hooks
    return isinstance(module, LINEAR_LAYERS) and _has_plain_forward(module) and not hooks


def stop_marks(handles: Sequence[RemovableRuleHandle], stop: bool = True) -> None:
    """Registered rules leave no marks, in a context where :func:`marks_are_read` is false (or leave them again,
    with ``stop`` false: a callable target set while the context is open)."""
    for handle in handles:
        if handle._registration is not None:
            handle._registration.marks = not stop


def marks_for_target(handles: Sequence[RemovableRuleHandle], target: object) -> bool:
    """Whether ``target`` reads the marks (a callable, set while a context that left them out is open); the
    registered rules then leave them again."""
    if not callable(target):
        return False
    stop_marks(handles, stop=False)
    return True
