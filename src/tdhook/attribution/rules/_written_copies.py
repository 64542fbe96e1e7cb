"""Writes out of place (``c.index_add(1, i, h)``, ``torch.scatter(c, 1, i, h)``, ``torch.slice_scatter(c, h, 1)``):
the same write in place into a copy, so that what the result holds is noted as an in-place write notes it.

Each of these calls makes a new tensor: ``args[0]``'s values, with what it writes put into some elements (or added to
them). An activation put into part of a constant (a buffer, ``torch.full(...)``), a gate's values into part of an
activation, or a weight's into part of one, made a tensor the rules took as one thing in every element: an
activation whose constant elements the uniform rule gave half of a product's relevance, passed on to nothing, or no
gate where a gate's values went (0.16-1.7 off, relative L2, float64, under AttnLRP, CP-LRP and EpsilonPlus, against
the products taken apart). The in-place writes (``c.index_add_(...)``, ``c[:, i] = h``) note where each kind went
(see :mod:`~tdhook.attribution.rules._in_place_writes`): :func:`write_into_copy` makes the call as that write into a
copy of ``args[0]``. Where nothing would be noted (an activation written into an activation, the common case), the
call runs as it is, and the graph stays the one a later call, planned without the rules' modes, makes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tdhook.attribution.rules._autograd import PARAMETER_DERIVED, call_argument, is_activation
from tdhook.attribution.rules._in_place_writes import mark_written_in_place
from tdhook.attribution.rules._written_regions import written_value

__all__ = ["WRITES_INTO_COPIES", "write_into_copy", "writes_into_copy"]


def _in_place(method: Callable) -> Callable[[torch.Tensor, tuple, dict], Any]:
    """The write ``method`` (an in-place method of a tensor) into ``copy``, with the call's other arguments."""
    return lambda copy, args, kwargs: mark_written_in_place(method, (copy, *args[1:]), kwargs)


def _slice_scatter(copy: torch.Tensor, args: tuple, kwargs: dict) -> Any:
    given = dict(zip(("src", "dim", "start", "end", "step"), args[1:], strict=False)) | kwargs
    dim = given.get("dim", 0)
    key = (slice(None),) * (dim % copy.dim()) + (slice(given.get("start"), given.get("end"), given.get("step", 1)),)
    return mark_written_in_place(torch.Tensor.__setitem__, (copy, key, given["src"]), {})


def _select_scatter(copy: torch.Tensor, args: tuple, kwargs: dict) -> Any:
    given = dict(zip(("src", "dim", "index"), args[1:], strict=False)) | kwargs
    key = (slice(None),) * (given["dim"] % copy.dim()) + (given["index"],)
    return mark_written_in_place(torch.Tensor.__setitem__, (copy, key, given["src"]), {})


def _diagonal_scatter(copy: torch.Tensor, args: tuple, kwargs: dict) -> Any:
    given = dict(zip(("src", "offset", "dim1", "dim2"), args[1:], strict=False)) | kwargs
    view = copy.diagonal(given.get("offset", 0), given.get("dim1", 0), given.get("dim2", 1))
    return mark_written_in_place(torch.Tensor.copy_, (view, given["src"]), {})


_METHODS = ("index_add", "index_copy", "index_fill", "index_put", "index_reduce", "masked_scatter", "scatter")
_METHODS += ("scatter_add", "scatter_reduce", "put")
# The in-place write each write out of place makes into a copy (for what it writes: see written_value).
_IN_PLACE = {getattr(o, name): getattr(torch.Tensor, name + "_") for name in _METHODS for o in (torch.Tensor, torch)}
_MASKED_SCATTERS = frozenset({torch.masked_scatter, torch.Tensor.masked_scatter})
_SCATTERS = {"slice_scatter": _slice_scatter, "select_scatter": _select_scatter}
_SCATTERS["diagonal_scatter"] = _diagonal_scatter
#: The writes out of place (methods, and the functions of the same writes) → the same write in place into a copy.
WRITES_INTO_COPIES: dict[Any, Callable[[torch.Tensor, tuple, dict], Any]] = {
    func: _in_place(method) for func, method in _IN_PLACE.items()
} | {getattr(owner, name): made for name, made in _SCATTERS.items() for owner in (torch.Tensor, torch)}


def writes_into_copy(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``func(*args, **kwargs)``, a write out of place (one of :data:`WRITES_INTO_COPIES`), is to be made as
    the same write in place into a copy (see :func:`write_into_copy`): ``args[0]`` or what is written is no plain
    activation (a constant, a weight, a gate, a tensor with constants in part), in a call autograd records.

    Examples:
        >>> h = torch.ones(2, 3, requires_grad=True) * 2  # an activation
        >>> index = torch.tensor([0])
        >>> writes_into_copy(torch.Tensor.index_add, (torch.zeros(2, 3), 1, index, h[:, :1]), {})
        True
        >>> writes_into_copy(torch.Tensor.index_add, (h * 1, 1, index, h[:, :1]), {})
        False
    """
    args, kwargs = _input_by_position(args, kwargs)
    target = args[0] if args else None
    if not isinstance(target, torch.Tensor) or "out" in kwargs or not torch.is_grad_enabled():
        return False
    if func in _IN_PLACE:
        value = written_value(_IN_PLACE[func], args, kwargs)
    else:
        value = call_argument(args, kwargs, 1, "src")
    return not (_plain_activation(target) and _plain_activation(value))


def write_into_copy(func: Any, args: tuple, kwargs: dict, copy: Callable[..., torch.Tensor]) -> torch.Tensor:
    """``func(*args, **kwargs)``, a write out of place (one of :data:`WRITES_INTO_COPIES`), made as the same write in
    place into ``copy(args[0], shape)`` (made as a mode of the rules makes a copy, which keeps what ``args[0]`` is
    noted to be: a gate, constants in part; broadcast to ``shape`` where the call broadcasts it, else ``None``), so
    that the result is noted as the in-place write notes it.

    Examples:
        >>> from tdhook.attribution.rules._constant_elements import constants_shown
        >>> h = torch.ones(2, 3, requires_grad=True) * 2  # an activation
        >>> buffer = torch.full((2, 3), 5.0)  # a constant
        >>> index = torch.tensor([0])
        >>> added = write_into_copy(torch.Tensor.index_add, (buffer, 1, index, h[:, :1]), {}, lambda t, s: t.clone())
        >>> added[0].tolist(), constants_shown(added).tolist()
        ([7.0, 5.0, 5.0], [[False, True, True], [False, True, True]])
    """
    args, kwargs = _input_by_position(args, kwargs)
    target = args[0]
    shape = None
    if func in _MASKED_SCATTERS:  # (out of place, the tensor broadcasts with the mask: ``c.masked_scatter(m, v)``)
        shape = torch.broadcast_shapes(target.shape, call_argument(args, kwargs, 1, "mask").shape)
    copied = copy(target, shape)
    WRITES_INTO_COPIES[func](copied, args, kwargs)  # (returns the copy, a view of it, or nothing)
    return copied


def _input_by_position(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with an ``input`` given by keyword (``torch.scatter(input=c, ...)``) moved first."""
    if args or "input" not in kwargs:
        return args, kwargs
    return (kwargs["input"],), {k: v for k, v in kwargs.items() if k != "input"}


def _plain_activation(value: Any) -> bool:
    """Whether ``value`` is an activation with nothing noted on it (no gate, no constants, no write's mask): a write
    of one into another leaves an activation in every element, as the call out of place makes it."""
    if not is_activation(value):
        return False
    base = value._base
    return not any(name.startswith("_tdhook_") and name != PARAMETER_DERIVED for name in value.__dict__) and (
        base is None or not any(name.startswith("_tdhook_") for name in base.__dict__)
    )
