"""What can be tuned: ``get_tunables()``, ``set_kwargs()`` and ``copy()`` on rules, presets and attribution methods.

Every rule with parameters, every preset, the LRP wrapper and every attribution
method says which of its parameters can be tuned and over what range, in
pnpxai's form: ``{name: (type, {"low": …, "high": …, "log": …})}`` for a number
and ``{name: (type, {"choices": […]})}`` for a categorical parameter.
``set_kwargs(**values)`` checks the values against these ranges and builds the
object anew from its constructor's arguments with those values (a preset's
layer rules are made from its parameters, so they are made again), and
``copy()`` returns an independent copy.

Examples:
    >>> from tdhook.attribution import EpsilonGammaBox
    >>> preset = EpsilonGammaBox(low=-3.0, high=3.0)
    >>> preset.get_tunables()["gamma"]
    (<class 'float'>, {'low': 1e-06, 'high': 1.0, 'log': True})
    >>> tuned = preset.copy().set_kwargs(gamma=0.5)
    >>> tuned.gamma, preset.gamma
    (0.5, 0.25)
    >>> preset.set_kwargs(gamma=2.0)
    Traceback (most recent call last):
    ...
    ValueError: EpsilonGammaBox: gamma must be in [1e-06, 1.0], got 2.0
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import typing
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Self

import torch

from tdhook.attribution.rules._arguments import finite_number

__all__ = ["Space", "EPSILON", "GAMMA", "Tunable", "ModelTunable", "MapperTunable", "RecordedModules", "check_tunable"]

#: A tunable parameter: its type and its range (``low``, ``high``, ``log``) or its ``choices``.
Space = tuple[type, dict[str, Any]]

#: ε of the ε-rules and the presets, on a log scale (pnpxai's range).
EPSILON: Space = (float, {"low": 1e-6, "high": 1.0, "log": True})
#: γ of the γ-rule, on a log scale (pnpxai's range).
GAMMA: Space = (float, {"low": 1e-6, "high": 1.0, "log": True})

_ARGUMENTS = "_tunable_init_arguments"
# How many constructors are running on an object now (0 once it is built; see _recording).
BUILDING = "_tunable_constructors_running"


def check_tunable(owner: str, name: str, value: Any, space: Space) -> Any:
    """``value`` checked against the tunable parameter's ``space``: one of its choices, or a number in its range.

    Examples:
        >>> check_tunable("IntegratedGradients", "n_steps", 20, (int, {"low": 5, "high": 200, "log": True}))
        20
        >>> check_tunable("Saliency", "abs", "yes", (bool, {"choices": [True, False]}))
        Traceback (most recent call last):
        ...
        ValueError: Saliency: abs must be one of [True, False], got 'yes'
    """
    kind, spec = space
    if "choices" in spec:
        if not any(value is choice or (type(value) is type(choice) and value == choice) for choice in spec["choices"]):
            raise ValueError(f"{owner}: {name} must be one of {spec['choices']}, got {value!r}")
        return value
    number = finite_number(owner, name, value)
    if kind is int:
        if number != int(number):
            raise ValueError(f"{owner}: {name} must be an integer, got {value!r}")
        number = int(number)
    if not spec["low"] <= number <= spec["high"]:
        raise ValueError(f"{owner}: {name} must be in [{spec['low']}, {spec['high']}], got {value!r}")
    return number


def _read_once(value: Any) -> Any:
    """``value``, an iterator read into a tuple (it can then be read again)."""
    return tuple(value) if isinstance(value, Iterator) else value


def _recording(init: Callable) -> Callable:
    """``init``, recording the arguments of the outermost call (the class the object is) on the object."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def wrapper(self, *args: Any, **kwargs: Any) -> None:
        # An iterator is read once: recorded as it is, the object built anew by set_kwargs would find it empty.
        args = tuple(_read_once(value) for value in args)
        kwargs = {name: _read_once(value) for name, value in kwargs.items()}
        if _ARGUMENTS not in self.__dict__:
            try:
                bound = signature.bind(self, *args, **kwargs)
            except TypeError as err:  # the call's own error, named as Python names it
                raise TypeError(f"{init.__qualname__}() {err}") from None
            bound.apply_defaults()
            arguments: dict[str, Any] = {}
            for name, value in list(bound.arguments.items())[1:]:
                kind = signature.parameters[name].kind
                if kind is inspect.Parameter.VAR_KEYWORD:
                    arguments.update(value)
                elif kind is not inspect.Parameter.VAR_POSITIONAL:
                    arguments[name] = value
            object.__setattr__(self, _ARGUMENTS, arguments)
        depth = self.__dict__.get(BUILDING, 0)  # the constructors running on the object (a subclass's calls its base's)
        object.__setattr__(self, BUILDING, depth + 1)
        try:
            init(self, *args, **kwargs)
        finally:
            object.__setattr__(self, BUILDING, depth)

    return wrapper


def _record(owner: Any, name: str, value: Any) -> None:
    """Record ``value`` for the constructor's argument ``name`` set on ``owner`` after it was built (lrp.rule_mapper =
    ..., method.n_steps = 16), as given: set_kwargs builds the object anew from the record (and would put the old
    value back), and explain_offline checks the record (and would resume an output of other rules or another model).
    An option the constructor takes through a typed ``**options`` (a preset's ``strict``, ``stabilize_additions``)
    is recorded too, though the call that built the object did not give it."""
    arguments = owner.__dict__.get(_ARGUMENTS)
    if arguments is None or owner.__dict__.get(BUILDING):
        return
    if name in arguments or name in _options_taken(type(owner)):
        arguments[name] = value


@functools.cache
def _options_taken(cls: type) -> frozenset[str]:
    """The names the constructor of ``cls`` takes through its ``**options`` where they are typed as the keys of a
    ``TypedDict`` (``**options: Unpack[PresetOptions]``); none for untyped ones.

    Examples:
        >>> from typing import TypedDict, Unpack
        >>> class Options(TypedDict, total=False):
        ...     strict: bool
        >>> class Mapper(Tunable):
        ...     def __init__(self, epsilon: float = 0.1, **options: Unpack[Options]) -> None:
        ...         self.epsilon, self.strict = epsilon, options.get("strict", False)
        >>> sorted(_options_taken(Mapper))
        ['strict']
        >>> mapper = Mapper()
        >>> mapper.strict = True
        >>> mapper.set_kwargs().strict, Mapper(0.2).__dict__[_ARGUMENTS]
        (True, {'epsilon': 0.2})
    """
    init = inspect.unwrap(cls.__init__)
    try:
        hints = typing.get_type_hints(init)
    except (NameError, TypeError):  # an annotation that does not resolve: no option is known by name
        return frozenset()
    for name, parameter in inspect.signature(init).parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            arguments = typing.get_args(hints.get(name))
            if typing.get_origin(hints.get(name)) is typing.Unpack and typing.is_typeddict(arguments[0]):
                return frozenset(typing.get_type_hints(arguments[0]))
    return frozenset()


class RecordedModules:
    """A base put before ``nn.Module``'s among an explainer's: a module set as a constructor's argument afterwards
    (``lrp.module = policy``) is recorded as :class:`Tunable` records the other arguments (``nn.Module`` stores a
    module without reaching :class:`Tunable`'s ``__setattr__``).

    Examples:
        >>> from tensordict.nn import TensorDictModule
        >>> from tdhook.attribution import Saliency
        >>> first = TensorDictModule(torch.nn.Linear(3, 2), in_keys=["x"], out_keys=["y"])
        >>> method = Saliency(first)
        >>> method.module = TensorDictModule(torch.nn.Linear(3, 2), in_keys=["x"], out_keys=["y"])
        >>> method.tunable_values(), method.__dict__[_ARGUMENTS]["module"] is method.module
        ({'abs': True}, True)
    """

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)  # first: a value the attribute refuses is not recorded
        if isinstance(value, torch.nn.Module):
            _record(self, name, value)


class Tunable:
    """The mixin of the tunables: subclasses list theirs in the class attribute ``tunables``.

    The arguments an object was built with are recorded, so that
    :meth:`set_kwargs` builds it anew with the new values: whatever the
    constructor derives from its parameters (a preset's layer rules, quadrature
    points) follows, and the constructor's own checks apply.

    Examples:
        >>> class Smoothing(Tunable):
        ...     tunables = {"width": (float, {"low": 0.1, "high": 10.0, "log": True})}
        ...
        ...     def __init__(self, width: float = 1.0) -> None:
        ...         self.width, self.inverse = width, 1 / width
        >>> Smoothing().set_kwargs(width=4.0).inverse
        0.25
        >>> Smoothing().set_kwargs(height=4.0)
        Traceback (most recent call last):
        ...
        ValueError: Smoothing: height is not a tunable parameter; the tunable ones are ['width']
    """

    #: The tunable parameters: ``{name: (type, range or choices)}``.
    tunables: ClassVar[dict[str, Space]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is not None:
            cls.__init__ = _recording(init)  # type: ignore[misc]

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)  # first: a value the attribute refuses (a checked option) is not recorded
        _record(self, name, value)

    def _being_built(self) -> bool:
        """Whether a constructor of the object is running (its first build, or :meth:`set_kwargs`'s)."""
        return bool(self.__dict__.get(BUILDING))

    def get_tunables(self) -> dict[str, Space]:
        """The tunable parameters: ``{name: (type, {"low", "high", "log"} or {"choices"})}`` (a fresh dict)."""
        return {name: (kind, dict(spec)) for name, (kind, spec) in self.tunables.items()}

    def tunable_values(self) -> dict[str, Any]:
        """The current value of each tunable parameter, as given to the constructor or to :meth:`set_kwargs`."""
        arguments = self.__dict__.get(_ARGUMENTS, {})
        return {name: arguments.get(name, getattr(self, name, None)) for name in self.get_tunables()}

    def set_kwargs(self, **values: Any) -> Self:
        """Check ``values`` against :meth:`get_tunables`, build the object anew with them, and return it.

        Raises:
            ValueError: naming a parameter that is not tunable, or a value outside its range.
        """
        tunables = self.get_tunables()
        owner = type(self).__name__
        checked = {}
        for name, value in values.items():
            if name not in tunables:
                raise ValueError(f"{owner}: {name} is not a tunable parameter; the tunable ones are {sorted(tunables)}")
            checked[name] = check_tunable(owner, name, value, tunables[name])
        if checked:
            self._rebuild(checked)
        return self

    def _rebuild(self, values: dict[str, Any]) -> None:
        before = dict(self.__dict__)  # put back where the constructor refuses the values (the object as it was)
        arguments = {**before.get(_ARGUMENTS, {}), **values}
        del self.__dict__[_ARGUMENTS]
        try:
            type(self).__init__(self, **arguments)
        except BaseException:
            self.__dict__.clear()
            self.__dict__.update(before)
            raise

    def _shared_in_copies(self) -> dict[int, Any]:
        """Objects a copy shares with the original instead of copying (``deepcopy``'s memo)."""
        return {}

    def copy(self) -> Self:
        """An independent copy: setting its parameters leaves the original as it is."""
        return copy.deepcopy(self, self._shared_in_copies())


class ModelTunable(Tunable):
    """The tunables of a wrapper around a model (an attribution method): copies share the wrapped ``module``.

    The model is what is explained, not a parameter of the explanation, so a
    copy explains the same model (its weights are not copied).

    Examples:
        >>> from torch import nn
        >>> from tdhook.attribution import IntegratedGradients
        >>> ig = IntegratedGradients(nn.Linear(3, 2), in_keys=["x"], out_keys=["y"], n_steps=8)
        >>> more = ig.copy().set_kwargs(n_steps=16)
        >>> more.n_steps, ig.n_steps, next(more.parameters()) is next(ig.parameters())  # the same weights
        (16, 8, True)
    """

    def _shared_in_copies(self) -> dict[int, Any]:
        # The module as given is shared too: a plain nn.Module is wrapped in a TensorDictModule, and set_kwargs builds
        # the copy anew from the arguments it was given, which would otherwise hold a copy of the model's weights.
        given = (self.__dict__.get("_modules", {}).get("module"), self.__dict__.get(_ARGUMENTS, {}).get("module"))
        return {id(module): module for module in given if module is not None}


class MapperTunable(ModelTunable):
    """The tunables of the LRP wrapper: its rule mapper's (a preset's ``epsilon``, ``gamma``, ...).

    Setting them, or copying the wrapper, needs its context closed: the rules
    registered in it were made from the values of the moment.

    Examples:
        >>> from torch import nn
        >>> from tdhook.attribution import LRP, UniformEpsilon
        >>> lrp = LRP(nn.Linear(3, 2), UniformEpsilon(), in_keys=["x"], out_keys=["y"])
        >>> lrp.set_kwargs(epsilon=0.5).tunable_values()
        {'epsilon': 0.5}
        >>> with lrp:
        ...     lrp.set_kwargs(epsilon=0.1)
        Traceback (most recent call last):
        ...
        RuntimeError: LRP: leave the wrapper's context before setting its parameters
    """

    def _open_context(self) -> bool:
        return getattr(self, "_handles", None) is not None

    def _refuse_in_context(self, what: str) -> None:
        if self._open_context():
            raise RuntimeError(f"{type(self).__name__}: leave the wrapper's context before {what}")

    def get_tunables(self) -> dict[str, Space]:
        getter = getattr(self.rule_mapper, "get_tunables", None)
        return getter() if getter is not None else {}

    def tunable_values(self) -> dict[str, Any]:
        getter = getattr(self.rule_mapper, "tunable_values", None)
        return getter() if getter is not None else {}

    def set_kwargs(self, **values: Any) -> Self:
        """Set the rule mapper's tunable parameters (see :meth:`Tunable.set_kwargs`) and return the wrapper."""
        with self._calls_ended():
            self._refuse_in_context("setting its parameters")
            setter = getattr(self.rule_mapper, "set_kwargs", None)
            if setter is None:
                unknown = ", ".join(values)
                raise ValueError(
                    f"{type(self).__name__}: {unknown} is not a tunable parameter; the rule mapper has none"
                )
            setter(**values)
            return self

    def copy(self) -> Self:
        """An independent copy of the wrapper and its rule mapper, explaining the same model."""
        with self._calls_ended():
            self._refuse_in_context("copying it")
            return super().copy()

    def _calls_ended(self) -> Any:
        """The wrapper's lock, held for the block: a call of another thread, which enters a context for its length,
        ends first, and none starts in the block."""
        lock = self.__dict__.get("_lock")
        return contextlib.nullcontext() if lock is None else lock
