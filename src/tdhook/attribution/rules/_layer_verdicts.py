"""The verdicts of the probes that run a Linear or convolution layer's own forward, kept per layer.

The checks of a layer's own forward (timm's ``StdConv2dSame``, ``ScaledStdConv2d``, a LoRA layer of one's own)
run it a few times on random inputs with a random weight: some milliseconds a layer, at every registration of a
rule (every context entry, every call made without an open context). The verdict (passed, or the error) depends
on what the forward is and on what it reads besides the weight it is given, not on that weight's values, so it is
kept here and given again while nothing it may depend on changed:

* the layer and its submodules (each by identity, weakly), their classes, their ``forward`` functions (one set
  on the instance included, a monkeypatch) and their modes (the probes run the forward in the call's), the
  attributes in their ``__dict__`` (numbers, strings, tuples by value; functions and classes by identity, weakly;
  anything else, a mutable object whose contents the forward may read, is not kept and the layer is probed at each
  check);
* what the code of those forwards may read besides: for each class of the layer and its submodules (their bases
  but ``nn.Module`` included), the attributes its ``__dict__`` holds; for each function found there or in an
  instance's ``__dict__`` (torch's own aside), the globals its code names (and, in a module of one's own it names,
  the attributes its code names), its closure's cells and its defaults, followed to the functions and classes they
  hold (a flag or a helper of the forward's module, replaced later); anything else it holds is not kept, as above;
* the forward hooks of the submodules, which the forward runs through their ``__call__`` (the layer's own do not
  run: the probes call ``forward``; tdhook's own, which the probes run with the rules off, are not kept), the
  weight hooks of the layer and torch's global forward hooks;
* the dtype, device, shape and kind of every parameter and buffer, and the values of all of them but the layer's
  own ``weight`` (the probes replace it): a learnt clip threshold (PACT), a flag in a buffer or a bias added after
  the linear function (a shift where it is not zero) may decide the verdict; a write through ``.data`` is seen.
  Beyond :data:`_HELD_VALUES` elements of such tensors the layer is probed at each check instead;
* what the check itself is given (the ε-rule's class of ε: whether clips are ruled) and the autocast state around
  it; not the torch function modes active around it, which the probes run without (a call's function rules: a
  layer checked at registration and again in a call, by the first-layer rules, was probed at every call).

A verdict is kept with a weak reference to the layer: the cache never keeps a model alive.
"""

from __future__ import annotations

import enum
import functools
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _module_globals
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from tdhook.attribution.rules._identity import IdentityWeakKeyDict

__all__ = ["checked_once", "clear_verdicts"]

# The most elements of tensors whose values a verdict keeps a copy of (the layer's own weight and bias not counted).
_HELD_VALUES = 1 << 16
# What every nn.Module has in its __dict__ (tables, hooks and ``training`` read here one by one),
# and the copy methods an open context sets on each module (``copy.deepcopy`` and pickle read them, no forward does):
# a layer prepared in a call (the first-layer rules) was otherwise probed again at every call.
_MODULE_INTERNALS = frozenset(nn.Module().__dict__) | frozenset({"__getstate__", "__deepcopy__", "__reduce_ex__"})
# And the quantization configuration torch.ao's quantization-aware layers keep for their conversion (their forward
# reads the fake quantizers built from it): a QAT ``ConvBn2d`` was probed again at every check.
_MODULE_INTERNALS |= frozenset({"qconfig"})
_PLAIN = frozenset({type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout})
_PLAIN |= frozenset({torch.qscheme})
_BY_IDENTITY = (types.FunctionType, type, types.ModuleType)
_WEIGHT_HOOKS = (WeightNorm, SpectralNorm, BasePruningMethod)
# The layer's own weight, whose values the probes replace by random ones (its bias is kept: a forward may add it
# after its linear function, a shift only where it is not zero).
_SUBSTITUTED = "weight"
# What a class holds that no forward of its instances reads (the rest is read as its attributes are).
_CLASS_INTERNALS = frozenset(
    {"__module__", "__doc__", "__qualname__", "__annotations__", "__annotate__", "__dict__", "__weakref__"}
    | {"__init__", "__init_subclass__", "__setstate__", "__getstate__", "__repr__", "__constants__", "__slots__"}
    | {"__orig_bases__", "__parameters__", "__type_params__", "__firstlineno__", "__static_attributes__"}
    | {"__abstractmethods__", "_abc_impl", "extra_repr", "reset_parameters"}
)
# The most functions and classes followed for one layer; beyond, the layer is probed at each check.
_MOST_FOLLOWED = 512
_EMPTY_CELL = object()
# Packages whose functions, classes and modules a forward names without their code being followed.
_TRUSTED_PACKAGES = frozenset(
    {"torch", "numpy", "builtins", "math", "operator", "functools", "itertools", "collections", "typing", "types"}
    | {"enum", "abc", "dataclasses", "numbers", "warnings", "logging", "inspect", "contextlib", "copy", "weakref"}
)


class _Uncacheable(Exception):
    """Something the verdict may depend on that cannot be compared later: the layer is probed at each check."""


class _Verdict:
    __slots__ = ("key", "values", "error")

    def __init__(self, key: tuple, values: list[torch.Tensor], error: str | None) -> None:
        self.key, self.values, self.error = key, values, error


# Per check's name and first argument (a class of ε, a dtype: few; the rest, a shape, is in the key): one verdict a
# layer, so that two classes of ε used in turn are each probed once.
_VERDICTS: dict[Any, IdentityWeakKeyDict[nn.Module, _Verdict]] = {}
_LOCK = threading.Lock()


def _token(value: Any) -> Any:
    """What ``value`` is compared by: itself where plain, a weak reference to a function or a class."""
    kind = type(value)
    if kind in _PLAIN or isinstance(value, (enum.Enum, types.BuiltinFunctionType)):  # torch.tanh has no weakref
        return value
    if kind in (tuple, list, torch.Size):
        return kind, tuple(map(_token, value))
    if kind in (set, frozenset):
        return kind, frozenset(map(_token, value))
    if isinstance(value, types.MethodType):  # not weakref.WeakMethod: its callback fails once it is itself gone
        try:
            return types.MethodType, weakref.ref(value.__func__), weakref.ref(value.__self__)
        except TypeError:
            raise _Uncacheable from None
    if isinstance(value, _BY_IDENTITY):
        return weakref.ref(value)
    raise _Uncacheable


def _trusted(value: Any) -> bool:
    """Whether ``value`` (a function, a class, a module) is torch's, NumPy's or Python's own: its code and its
    attributes are not followed (the probes trust them), but for the classes of the layer and its submodules."""
    name = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
    return isinstance(name, str) and name.partition(".")[0] in _TRUSTED_PACKAGES


@functools.lru_cache(maxsize=4096)
def _named(code: types.CodeType) -> tuple[str, ...]:
    """The names ``code`` and the code nested in it (a lambda, a comprehension) may look up as globals."""
    names = list(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names += _named(constant)
    return tuple(dict.fromkeys(names))


def _follow(value: Any, key: list, seen: set[int], layer_class: bool = False) -> None:
    """Add to ``key`` what the code of ``value`` may read besides its arguments (see the module's docstring):
    a class's attributes, along its bases; a function's globals, closure and defaults; each followed in turn.
    ``layer_class``: ``value`` is the class of the layer or of a submodule, followed even where torch's own."""
    if isinstance(value, (tuple, list, set, frozenset)):
        for item in value:
            _follow(item, key, seen)
        return
    if isinstance(value, (types.MethodType, staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        _follow((value.fget, value.fset, value.fdel), key, seen)
        return
    if not isinstance(value, (type, types.FunctionType)) or id(value) in seen or (_trusted(value) and not layer_class):
        return
    seen.add(id(value))
    if len(seen) > _MOST_FOLLOWED:
        raise _Uncacheable
    if isinstance(value, type):
        for cls in value.__mro__:
            if cls in (nn.Module, object) or (cls is not value and id(cls) in seen):
                continue
            seen.add(id(cls))
            for name, attribute in vars(cls).items():
                if name not in _CLASS_INTERNALS:
                    key += (name, _member_token(attribute))
                    _follow(attribute, key, seen)
        return
    key += (_token(value.__defaults__), _token(tuple(sorted((value.__kwdefaults__ or {}).items()))))
    for cell in value.__closure__ or ():
        try:
            contents = cell.cell_contents
        except ValueError:  # a cell not yet filled
            contents = _EMPTY_CELL
        key.append(_EMPTY_CELL if contents is _EMPTY_CELL else _token(contents))
        _follow(contents, key, seen)
    names = _named(value.__code__)
    space = value.__globals__
    for name in names:
        if name in space:
            found = space[name]
            key += (name, _token(found))
            _follow(found, key, seen)
            if isinstance(found, types.ModuleType) and not _trusted(found):
                # A module of one's own read as a configuration (cfg.USE_TANH): its attributes the code names.
                for attribute in names:
                    if attribute in vars(found):
                        key += (attribute, _token(vars(found)[attribute]))
                        _follow(vars(found)[attribute], key, seen)


def _member_token(attribute: Any) -> Any:
    """:func:`_token` of a class's attribute: a property, static or class method by its functions."""
    if isinstance(attribute, property):
        return property, _token(attribute.fget), _token(attribute.fset), _token(attribute.fdel)
    if isinstance(attribute, (staticmethod, classmethod)):
        return type(attribute), _token(attribute.__func__)
    return _token(attribute)


def _tensor_token(tensor: torch.Tensor) -> tuple:
    return type(tensor), tensor.dtype, tensor.device, tuple(tensor.shape), tensor.requires_grad


def _state(module: nn.Module, extra: tuple) -> tuple[tuple, list[torch.Tensor]]:
    """The key of ``module``'s verdict and the tensors whose values it keeps; raises :class:`_Uncacheable`."""
    key: list = [extra]
    key.append(tuple(torch.is_autocast_enabled(device) for device in ("cpu", "cuda")))
    valued: list[torch.Tensor] = []
    seen: set[int] = set()
    for name, sub in module.named_modules(remove_duplicate=False):
        root = sub is module
        key += (name, weakref.ref(sub), type(sub), _token(getattr(type(sub), "forward", None)), sub.training)
        _follow(type(sub), key, seen, layer_class=True)
        if root:
            pre_hooks = sub._forward_pre_hooks.items()
            key.append(tuple(handle for handle, hook in pre_hooks if isinstance(hook, _WEIGHT_HOOKS)))
        else:  # run by the submodule's __call__ inside the forward
            key += (_foreign(sub._forward_pre_hooks), _foreign(sub._forward_hooks))
        tables = (sub._parameters.items(), sub._buffers.items(), sub.__dict__.items())
        for kind, table in enumerate(tables):
            for attribute, value in table:
                if kind == 2 and attribute in _MODULE_INTERNALS:
                    continue
                if isinstance(value, nn.parameter.UninitializedTensorMixin):  # no shape yet
                    raise _Uncacheable
                if isinstance(value, torch.Tensor):
                    key += (kind, attribute, _tensor_token(value))
                    if not (root and attribute == _SUBSTITUTED) and not value.is_meta:
                        valued.append(value)
                else:
                    key += (kind, attribute, _token(value))
                    _follow(value, key, seen)
    if len(module._modules):
        key += (tuple(_module_globals._global_forward_pre_hooks), tuple(_module_globals._global_forward_hooks))
    if sum(t.numel() for t in valued) > _HELD_VALUES:
        raise _Uncacheable
    return tuple(key), valued


def _foreign(hooks: dict[int, Callable]) -> tuple[int, ...]:
    """The ids of ``hooks`` but tdhook's own (the rules' hooks, registered anew at each context entry): the probes run
    with the rules off (:func:`~tdhook.attribution.rules._plain_calls.run_alone`), where those leave the forward as
    it is. A layer with a submodule that has a rule (the BatchNorm inside QAT's ``ConvBn2d``) was probed again at
    each entry, and at each call made without an open context."""
    return tuple(handle for handle, hook in hooks.items() if not _is_own(hook))


def _is_own(hook: Callable) -> bool:
    func = hook.func if isinstance(hook, functools.partial) else hook
    name = getattr(getattr(func, "__func__", func), "__module__", None)
    return isinstance(name, str) and name.startswith("tdhook.attribution.")


def _same_values(live: list[torch.Tensor], held: list[torch.Tensor]) -> bool:
    if len(live) != len(held):
        return False
    for now, then in zip(live, held, strict=True):
        if now.shape != then.shape or now.device != then.device or now.dtype != then.dtype:
            return False
        if torch.equal(now, then):
            continue
        if not now.is_floating_point() or not bool(((now == then) | (now.isnan() & then.isnan())).all()):
            return False
    return True


def checked_once(module: nn.Module, check: tuple, probe: Callable[[], None]) -> None:
    """Run ``probe`` (which raises a ``ValueError`` or returns ``None``) on ``module``, or give its verdict again
    where the last probe of this ``check`` on ``module`` saw the same layer (see the module's docstring). ``check``
    is the check's name, then what else its verdict depends on (the class of ε, the dtype of the weight).

    Examples:
        >>> class Doubled(nn.Linear):
        ...     def forward(self, x):
        ...         return 2 * super().forward(x)
        >>> layer, runs = Doubled(2, 3), []
        >>> for _ in range(3):
        ...     checked_once(layer, ("example",), lambda: runs.append(1))
        >>> len(runs)
        1
        >>> layer.forward = lambda x: torch.tanh(Doubled.forward(layer, x))
        >>> checked_once(layer, ("example",), lambda: runs.append(1))
        >>> len(runs)
        2
    """
    try:
        key, valued = _state(module, check)
    except _Uncacheable:
        probe()
        return
    with _LOCK:
        verdicts = _VERDICTS.setdefault(check[:2], IdentityWeakKeyDict())
        kept = verdicts.get(module)
    if kept is not None and kept.key == key and _same_values(valued, kept.values):
        if kept.error is not None:
            raise ValueError(kept.error)
        return
    held = [t.detach().clone() for t in valued]
    try:
        probe()
    except ValueError as err:  # kept as its message: the error's traceback would keep the layer alive
        _keep(verdicts, module, _Verdict(key, held, str(err)))
        raise
    _keep(verdicts, module, _Verdict(key, held, None))  # not on any other exception (an interrupt): no verdict


def _keep(verdicts: IdentityWeakKeyDict[nn.Module, _Verdict], module: nn.Module, verdict: _Verdict) -> None:
    with _LOCK:
        verdicts[module] = verdict


def clear_verdicts() -> None:
    """Forget every verdict kept (the next check of each layer probes it).

    Examples:
        >>> layer, runs = nn.Linear(2, 2), []
        >>> checked_once(layer, ("example",), lambda: runs.append(1))
        >>> clear_verdicts()
        >>> checked_once(layer, ("example",), lambda: runs.append(1))
        >>> len(runs)
        2
    """
    with _LOCK:
        _VERDICTS.clear()
