"""Which elements an in-place write replaces: ``t[key] = v``, ``t.index_put_(...)``, ``t.scatter_(...)``, ``t.copy_``.

An in-place write either replaces elements of the tensor written into with the values written (``copy_``,
``t[key] = v``, ``index_put_``, ``masked_scatter_``, ``scatter_`` without a reduction, ...), which are then what
was written, whatever they were before; or combines them with what is written (``add_``, ``mul_``, ``index_add_``,
``relu_``), which leaves them what they were where what is written is a weight. :func:`replaced_region` tells the
first kind's elements, as a mask of the tensor written into, found by the same write of ``True`` into a mask of
``False`` (so indices, masks and broadcasting are torch's own). :func:`reached_region` tells the elements a write of
either kind reaches where an index or a mask picks them (``index_add_``, ``scatter_add_``, ``index_put_(...,
accumulate=True)``): an activation added there makes them an activation's, the others stay what they were.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tdhook.attribution.rules._autograd import call_argument

__all__ = ["REPLACING", "reached_region", "replaced_region", "written_value"]


def _whole(region: torch.Tensor, args: tuple, kwargs: dict) -> None:
    region.fill_(True)


def _key(region: torch.Tensor, args: tuple, kwargs: dict) -> None:
    region[args[1]] = True


def _index_put(region: torch.Tensor, args: tuple, kwargs: dict) -> None:
    region.index_put_(call_argument(args, kwargs, 1, "indices"), _true(region))


def _index_fill(region: torch.Tensor, args: tuple, kwargs: dict) -> None:
    region.index_fill_(call_argument(args, kwargs, 1, "dim"), call_argument(args, kwargs, 2, "index"), True)


def _masked(region: torch.Tensor, args: tuple, kwargs: dict) -> None:
    region.masked_fill_(call_argument(args, kwargs, 1, "mask"), True)


def _scatter(region: torch.Tensor, args: tuple, kwargs: dict) -> None:
    index = call_argument(args, kwargs, 2, "index")
    region.scatter_(call_argument(args, kwargs, 1, "dim"), index, _true(region).expand(index.shape))


def _put(region: torch.Tensor, args: tuple, kwargs: dict) -> None:
    index = call_argument(args, kwargs, 1, "index")
    region.put_(index, _true(region).expand(index.shape))


def _diagonal(region: torch.Tensor, args: tuple, kwargs: dict) -> None:
    region.fill_diagonal_(True, wrap=bool(call_argument(args, kwargs, 2, "wrap", False)))


def _true(region: torch.Tensor) -> torch.Tensor:
    return torch.ones((), dtype=torch.bool, device=region.device)


#: in-place writes that replace elements of their first argument (methods, and the functions of the same writes) →
#: how to mark those elements in a mask of it
REPLACING: dict[Any, Callable[[torch.Tensor, tuple, dict], None]] = {
    torch.Tensor.copy_: _whole,
    torch.Tensor.fill_: _whole,
    torch.Tensor.zero_: _whole,
    torch.Tensor.__setitem__: _key,
    torch.Tensor.index_put_: _index_put,
    torch.Tensor.index_copy_: _index_fill,
    torch.Tensor.index_fill_: _index_fill,
    torch.Tensor.masked_fill_: _masked,
    torch.Tensor.masked_scatter_: _masked,
    torch.Tensor.scatter_: _scatter,
    torch.Tensor.put_: _put,
    torch.Tensor.fill_diagonal_: _diagonal,
    torch.fill_: _whole,
    torch.zero_: _whole,
    torch.index_put_: _index_put,
    torch.Tensor.scatter_reduce_: _scatter,
    torch.Tensor.index_reduce_: _index_fill,
}
# In-place writes that combine what they write with the elements an index picks, and never replace them.
_INDEXED_COMBINING: dict[Any, Callable[[torch.Tensor, tuple, dict], None]] = {
    torch.Tensor.index_add_: _index_fill,
    torch.Tensor.scatter_add_: _scatter,
}

# Writes of :data:`REPLACING` that replace only without ``include_self=True`` (their default): a reduction of what
# is written alone, else one with the elements.
_WITHOUT_SELF = frozenset({torch.Tensor.scatter_reduce_, torch.Tensor.index_reduce_})

# Options under which a write of :data:`REPLACING` combines what it writes with the elements instead.
_COMBINING = {
    torch.Tensor.index_put_: (3, "accumulate"),
    torch.Tensor.put_: (3, "accumulate"),
    torch.Tensor.scatter_: (4, "reduce"),
    torch.index_put_: (3, "accumulate"),
}


# Where the values an in-place write puts into its first argument are, for writes that take them elsewhere than
# second (``t[key] = v``, ``t.index_copy_(dim, index, v)``, ``t.scatter_(dim, index, v)``): position and name.
_VALUE_PLACES: dict[Any, tuple[int, str]] = {
    torch.Tensor.__setitem__: (2, "value"),
    torch.Tensor.index_put_: (2, "values"),
    torch.index_put_: (2, "values"),
    torch.Tensor.index_copy_: (3, "source"),
    torch.Tensor.index_fill_: (3, "value"),
    torch.Tensor.index_add_: (3, "source"),
    torch.Tensor.index_reduce_: (3, "source"),
    torch.Tensor.masked_fill_: (2, "value"),
    torch.Tensor.masked_scatter_: (2, "source"),
    torch.Tensor.scatter_: (3, "src"),
    torch.Tensor.scatter_add_: (3, "src"),
    torch.Tensor.scatter_reduce_: (3, "src"),
    torch.Tensor.put_: (2, "source"),
}


def written_value(func: Any, args: tuple, kwargs: dict) -> Any:
    """What the in-place write ``func(*args, **kwargs)`` puts into ``args[0]``: the values written (a tensor or a
    number), or the other operand of a write that combines (``add_``, ``mul_``); ``None`` where there is none
    (``zero_``, ``relu_``).

    Examples:
        >>> t, v = torch.zeros(2, 3), torch.ones(2, 1)
        >>> written_value(torch.Tensor.index_copy_, (t, 1, torch.tensor([0]), v), {}) is v
        True
        >>> written_value(torch.Tensor.__setitem__, (t, 0, 2.0), {}), written_value(torch.Tensor.add_, (t, 3.0), {})
        (2.0, 3.0)
    """
    position, name = _VALUE_PLACES.get(func, (1, "other"))
    value = call_argument(args, kwargs, position, name)
    if value is None and func is torch.Tensor.scatter_:  # ``t.scatter_(dim, index, value=2.0)``
        value = kwargs.get("value")
    return value


def replaces(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``func(*args, **kwargs)`` replaces elements of ``args[0]`` with what it writes (see :data:`REPLACING`),
    rather than combining them with it (``index_put_(..., accumulate=True)``, ``scatter_(..., reduce="add")``).

    Examples:
        >>> t, i = torch.zeros(3), (torch.tensor([0]),)
        >>> replaces(torch.Tensor.index_put_, (t, i, torch.ones(1)), {}), replaces(torch.Tensor.add_, (t, 1), {})
        (True, False)
        >>> replaces(torch.Tensor.index_put_, (t, i, torch.ones(1)), {"accumulate": True})
        False
    """
    if func not in REPLACING:
        return False
    if func in _WITHOUT_SELF:
        return not kwargs.get("include_self", True)
    combining = _COMBINING.get(func)
    return combining is None or not call_argument(args, kwargs, *combining)


def replaced_region(func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The elements of ``args[0]`` that ``func(*args, **kwargs)``, a write of :data:`REPLACING`, replaces: a mask of
    ``args[0]``'s shape, or ``None`` where the write combines (see :func:`replaces`). Read before or after the write:
    only indices, keys and masks are read.

    Examples:
        >>> t = torch.zeros(2, 3)
        >>> replaced_region(torch.Tensor.__setitem__, (t, (slice(None), 0), 1.0), {}).int().tolist()
        [[1, 0, 0], [1, 0, 0]]
        >>> index = torch.tensor([[2], [1]])
        >>> replaced_region(torch.Tensor.scatter_, (t, 1, index, torch.ones(2, 1)), {}).int().tolist()
        [[0, 0, 1], [0, 1, 0]]
        >>> replaced_region(torch.Tensor.add_, (t, 1.0), {}) is None
        True
    """
    if not replaces(func, args, kwargs):
        return None
    target = args[0]
    with torch._C.DisableTorchFunction(), torch.no_grad():  # bookkeeping, which no function mode may see
        region = torch.zeros(target.shape, dtype=torch.bool, device=target.device)
        REPLACING[func](region, args, kwargs)
    return region


def reached_region(func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The elements of ``args[0]`` that ``func(*args, **kwargs)``, an in-place write, reaches where an index, a key
    or a mask picks them, whether it replaces them or combines them with what it writes (``index_add_``,
    ``scatter_add_``, ``index_put_(..., accumulate=True)``, ``scatter_reduce_``): a mask of ``args[0]``'s shape;
    ``None`` for a write that reaches every element (``add_``, ``copy_``). Read before or after the write.

    Examples:
        >>> t = torch.zeros(2, 3)
        >>> reached_region(torch.Tensor.index_add_, (t, 1, torch.tensor([2]), torch.ones(2, 1)), {}).int().tolist()
        [[0, 0, 1], [0, 0, 1]]
        >>> rows, cols = torch.tensor([0]), torch.tensor([1])
        >>> reached_region(torch.Tensor.index_put_, (t, (rows, cols), torch.ones(1), True), {}).int().tolist()
        [[0, 1, 0], [0, 0, 0]]
        >>> reached_region(torch.Tensor.add_, (t, 1.0), {}) is None
        True
    """
    mark = REPLACING.get(func) or _INDEXED_COMBINING.get(func)
    if mark is None or mark is _whole:
        return None
    target = args[0]
    with torch._C.DisableTorchFunction(), torch.no_grad():  # bookkeeping, which no function mode may see
        region = torch.zeros(target.shape, dtype=torch.bool, device=target.device)
        mark(region, args, kwargs)
    return region
