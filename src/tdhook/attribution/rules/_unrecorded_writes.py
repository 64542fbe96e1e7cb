"""Writes into a tensor with autograd history that autograd does not record, and the reads of that tensor after them.

``c.detach().copy_(w)``, ``c.data.copy_(w)``, ``c.data[...] = w``, ``c.data = w`` and a write into ``c`` under
``torch.no_grad()`` change ``c``'s values where autograd does not see it: ``c``'s gradient still reaches what its
values were computed from before the write. A call that reads ``c`` afterwards with gradient enabled computes with
the new values and passes its gradient to the old ones, so that not even LRP-0 (the gradient times the input) is
the gradient of the function computed: an activation overwritten that way with a weight's values was explained as
the activation (1.0 off, relative L2, under AttnLRP), a weight overwritten with an activation's as the weight (11.4
off). The write itself is no error: a straight-through estimator written in place
(``z = (torch.round(h) - h).detach(); z += h``) writes through a detached alias and reads only the alias, whose own
write autograd records. Nor is ``h.data = y`` for an activation ``h`` and a tensor ``y`` of its shape, dtype and
device (a binarised network's ``input.data = sign(input.data)``): it replaces ``h``'s storage, leaving the tensors
autograd saved as they were, so that it is the straight-through estimator ``h + (y - h).detach()``, explained and
reported as one (see :func:`assigns_straight_through`). Nor is a write of the activation's own values alone, clamped
or rounded (``c.clamp_(-1, 1)`` under ``torch.no_grad()``, ``c.data.round_()``: :data:`STRAIGHT_THROUGH_WRITES`):
it is the straight-through estimator ``c + (f(c) - c).detach()``, explained and reported as one too (a tensor
autograd saved before it is refused by torch's backward pass, as in the model's own; a write through ``c.data``,
whose version counter is its own, moves ``c``'s too). A sigmoid gate written through an alias is not: its marks
follow writes into the gate alone.

The function modes note an alias as they make it (:func:`note_alias`), the tensor whose values a write autograd
does not record changed (:func:`note_unrecorded_write`; an ``out=`` write into an alias, or under
``torch.no_grad()``, too: :func:`note_out_write`), and refuse a call that reads that tensor, or a view of it,
into a result with gradient (:func:`read_unrecorded`, and :func:`raise_for_unrecorded_inputs` at the modules
inside which the modes pause). A write that replaces the whole tensor with gradient enabled (``c.copy_(h)``) gives
it a history of its values again. A NumPy array made of such a tensor's storage (``c.detach().numpy()``,
``c.numpy(force=True)``, ``np.asarray(c.detach())``) is written where no mode sees it, nor the version counter: the
tensor's values are kept when the array is made, and a read with gradient that finds them changed is refused as
well (a write the modes see into the tensor or an alias of it first, ``c += h``, ends the watch: a NumPy write
after it is not seen; an in-place write autograd records inside a call the modes see, ``F.relu(c, inplace=True)``,
moves the version counter, which a NumPy write does not: the values it wrote are kept in place of the first).
Writes no mode sees are not noted: those of a call run without the modes (a later call of AttnLRP or CP-LRP that its
plan runs without them, a later call of a CNN preset on a model without gates; the first call of every context runs
in them) or inside a module where they pause.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = [
    "ALIASING",
    "ALIAS_OF",
    "DETACHING",
    "NOT_READ",
    "UNRECORDED",
    "assigns_straight_through",
    "NUMPY_VIEWS",
    "STRAIGHT_THROUGH_WRITES",
    "note_alias",
    "note_out_write",
    "note_unrecorded_write",
    "settle_numpy_watch",
    "unrecorded_source",
    "raise_for_unrecorded_inputs",
    "read_unrecorded",
]

#: the calls that give a tensor's values without its autograd history: an alias of its storage
DETACHING = frozenset({torch.Tensor.detach, torch.detach, torch.Tensor.data.__get__})
_DATA_SET = torch.Tensor.data.__set__
#: In-place writes whose new values are an element-wise function of the tensor's own values (and numbers): into an
#: activation, where autograd does not record them (``c.clamp_(-1, 1)`` under ``torch.no_grad()``,
#: ``c.detach().round_()``), they are the straight-through estimator ``c + (f(c) - c).detach()``, not noted (see
#: ``unrecorded_straight_through`` in :mod:`~tdhook.attribution.rules._in_place_writes`). A tensor autograd saved
#: before the write is refused by torch itself at the backward pass (the version counter moved).
STRAIGHT_THROUGH_WRITES = frozenset(
    getattr(owner, name)
    for owner in (torch.Tensor, torch)
    for name in ("clamp_", "clip_", "clamp_min_", "clamp_max_", "round_", "sign_", "floor_", "ceil_", "trunc_", "fix_")
    if hasattr(owner, name)
)
#: the calls that give a NumPy array sharing a tensor's storage, which writes autograd does not record go through
NUMPY_VIEWS = frozenset({torch.Tensor.numpy, torch.Tensor.__array__})
#: the calls :func:`note_alias` notes: those of :data:`DETACHING` and :data:`NUMPY_VIEWS`, and ``c.data = w``
ALIASING = DETACHING | NUMPY_VIEWS | {_DATA_SET}
# On an alias of a tensor with autograd history (see DETACHING): a weak reference to that tensor (the tensor a view
# of it views). Weak: an alias must not keep a layer's output alive past the call.
ALIAS_OF = "_tdhook_unrecorded_alias_of"
#: Per tensor whose values a write autograd did not record changed (by ``id``): a weak reference to it, and the
#: write; for one a NumPy array shares the storage of, its values when the array was made too (changed, it is
#: written). Empty on the common path, where the modes' check is one test of it.
UNRECORDED: dict[int, tuple[Any, ...]] = {}
_NUMPY_WRITE = "a write through a NumPy array sharing its storage (`.numpy()`, `np.asarray`)"
#: :func:`read_unrecorded`'s answer where the call is to run as the mode runs it
NOT_READ = object()

# Calls that read no values, or give none with gradient: a tensor's base (the modes' own bookkeeping reads it), its
# aliases, and in-place calls that write no values (its flags, its shape, another storage: ``alias.unsqueeze_(0)``).
_NOT_READS = (
    DETACHING
    | {torch.Tensor._base.__get__, torch.Tensor.grad.__get__, _DATA_SET, torch.detach_}
    | frozenset(
        getattr(torch.Tensor, name)
        for name in (
            *("requires_grad_", "detach_", "as_strided_", "squeeze_", "unsqueeze_", "t_", "transpose_", "swapdims_"),
            *("swapaxes_", "resize_", "resize_as_", "share_memory_", "set_", "rename_", "refine_names_"),
        )
        if hasattr(torch.Tensor, name)
    )
)
# Writes that give no result (``None``): what they read goes into the tensor written into.
_SETTING_ITEMS = frozenset({torch.Tensor.__setitem__})
# Writes that replace every element of the tensor written into (``c.copy_(h)``): no read of it.
_WHOLE_WRITES = frozenset({torch.Tensor.copy_, torch.Tensor.fill_, torch.Tensor.zero_, torch.fill_, torch.zero_})


def _root(tensor: torch.Tensor) -> torch.Tensor:
    # Without the modes: ``_base`` is a call they would see (and record as one of the model's own).
    with torch._C.DisableTorchFunction():
        base = tensor._base
    return tensor if base is None else base


def _has_history(tensor: torch.Tensor) -> bool:
    return tensor.requires_grad and not tensor.is_leaf


def assigns_straight_through(func: Any, args: tuple, activation: bool) -> bool:
    """Whether ``func(*args)`` is ``args[0].data = args[1]`` for an activation ``args[0]`` (``activation``: not
    computed from parameters alone) and a tensor ``args[1]`` of its shape, dtype and device: the storage replaced,
    the tensors autograd saved left as they were, it is the straight-through estimator
    ``args[0] + (args[1] - args[0]).detach()``, whose gradient passes through ``args[0]`` to what it was computed
    from.

    Examples:
        >>> h = torch.ones(2, requires_grad=True) * 2
        >>> assigns_straight_through(torch.Tensor.data.__set__, (h, torch.sign(h.detach())), True)
        True
        >>> assigns_straight_through(torch.Tensor.data.__set__, (h, torch.zeros(3)), True)  # another shape
        False
    """
    if func != _DATA_SET or len(args) != 2 or not activation:
        return False
    h, y = args
    if not (isinstance(h, torch.Tensor) and isinstance(y, torch.Tensor) and _has_history(h)):
        return False
    # What autograd took ``h`` for (the call may have run: ``h``'s own shape is then ``y``'s).
    metadata = getattr(h.grad_fn, "_input_metadata", ())
    if h.output_nr >= len(metadata):
        return False
    taken = metadata[h.output_nr]
    return tuple(taken.shape) == tuple(y.shape) and taken.dtype == y.dtype and taken.device == y.device


def note_alias(func: Any, args: tuple, result: Any, activation: bool = False) -> None:
    """Note on ``result``, that of a call ``func`` of :data:`DETACHING` on ``args[0]``, the tensor with autograd
    history whose storage it shares (``args[0]``'s base, or ``args[0]``; that of an alias of an alias too). For
    ``args[0].data = args[1]``, note ``args[0]``'s values changed where autograd does not see it (see
    :func:`note_unrecorded_write`), but where it is a straight-through estimator (``activation``: ``args[0]`` is an
    activation; see :func:`assigns_straight_through`).

    Examples:
        >>> c = torch.ones(2, requires_grad=True) * 2
        >>> alias = c.detach()
        >>> note_alias(torch.Tensor.detach, (c,), alias)
        >>> alias.__dict__[ALIAS_OF]() is c
        True
        >>> note_alias(torch.Tensor.data.__set__, (c, torch.zeros(2)), None, activation=True)  # an estimator
        >>> id(c) in UNRECORDED
        False
        >>> note_alias(torch.Tensor.data.__set__, (c, torch.zeros(2)), None)  # a weight's values: the rules' weight
        >>> id(c) in UNRECORDED
        True
        >>> UNRECORDED.clear()
    """
    source = args[0] if args else None
    if not isinstance(source, torch.Tensor):
        return
    if func in NUMPY_VIEWS:
        _watch_numpy(source)
        return
    if func == _DATA_SET:
        if _has_history(source) and not assigns_straight_through(func, args, activation):
            _poison(source, "a `.data =` assignment")
        return
    if not isinstance(result, torch.Tensor):
        return
    root = _root(source)
    if _has_history(root):
        setattr(result, ALIAS_OF, weakref.ref(root))
    elif ALIAS_OF in root.__dict__:  # ``c.detach().detach()``, ``c.detach()[0].data``
        setattr(result, ALIAS_OF, root.__dict__[ALIAS_OF])


def _forget(key: int) -> None:
    UNRECORDED.pop(key, None)


def _poison(tensor: torch.Tensor, write: str) -> None:
    key = id(tensor)
    entry = UNRECORDED.get(key)
    if entry is None or len(entry) > 2 or entry[0]() is not tensor:  # a NumPy watch: now written, by this write
        UNRECORDED[key] = (weakref.ref(tensor, lambda _, key=key: _forget(key)), write)


def _watch_numpy(tensor: torch.Tensor) -> None:
    """Keep the values of the tensor with autograd history whose storage ``tensor`` (made into a NumPy array) shares:
    ``tensor`` itself (``c.numpy(force=True)``) or the tensor it aliases (``c.detach().numpy()``). None where it is
    not in CPU memory: the array is a copy (``c.numpy(force=True)`` of a CUDA tensor), a clone kept would be waste."""
    with torch._C.DisableTorchFunction():
        if tensor.device.type != "cpu":
            return
    root = _root(tensor)
    link = root.__dict__.get(ALIAS_OF)
    source = root if _has_history(root) else link() if link is not None else None
    if source is None or id(source) in UNRECORDED:
        return
    _keep_values(source)


def _keep_values(source: torch.Tensor) -> None:
    """Watch ``source``: its values and its version counter, which a write through a NumPy array does not move."""
    with torch._C.DisableTorchFunction(), torch.no_grad():
        kept, version = source.detach().clone(), source._version
    key = id(source)
    UNRECORDED[key] = (weakref.ref(source, lambda _, key=key: _forget(key)), _NUMPY_WRITE, kept, version)


def _changed(entry: tuple, tensor: torch.Tensor) -> bool:
    """Whether ``tensor``, noted by ``entry``, was written: noted by a write, or watched and its values not those
    kept (NaN where NaN was) while its version counter stayed. A moved counter is an in-place write autograd saw
    that no mode did (``F.relu(c, inplace=True)``, whose ``relu_`` runs inside the call the modes see): the values
    it wrote are kept instead, and watched from there."""
    if len(entry) == 2:
        return True
    kept, version = entry[2], entry[3]
    with torch._C.DisableTorchFunction(), torch.no_grad():
        if tensor._version != version:
            _keep_values(tensor)
            return False
        if tensor.shape != kept.shape or tensor.dtype != kept.dtype:
            return True
        values = tensor.detach()  # equal (one pass, 6x cheaper than allclose) unless NaN are there
        return not (torch.equal(values, kept) or torch.allclose(values, kept, rtol=0.0, atol=0.0, equal_nan=True))


def settle_numpy_watch(tensor: torch.Tensor) -> None:
    """Before a write the modes see into ``tensor`` (a tensor's base, or a tensor no view of; or the tensor it
    aliases): where a NumPy array shares its storage, note it written if its values changed since the array was
    made, else end the watch (the write changes them; a NumPy write after it is not seen).

    Examples:
        >>> c = torch.ones(2, requires_grad=True) * 2
        >>> array = c.numpy(force=True)
        >>> note_alias(torch.Tensor.numpy, (c,), array)
        >>> array[0] = 5.0
        >>> settle_numpy_watch(c)
        >>> UNRECORDED[id(c)][1]
        'a write through a NumPy array sharing its storage (`.numpy()`, `np.asarray`)'
        >>> UNRECORDED.clear()
    """
    link = tensor.__dict__.get(ALIAS_OF)  # a write into an alias (``c.detach().clamp_()``) writes the tensor it aliases
    tensor = tensor if link is None or link() is None else link()
    key = id(tensor)
    entry = UNRECORDED.get(key)
    if entry is None or len(entry) == 2 or entry[0]() is not tensor:
        return
    if _changed(entry, tensor):
        UNRECORDED[key] = entry[:2]
    else:
        _forget(key)


def unrecorded_source(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor with autograd history whose values a write into ``tensor`` changes where autograd does not record
    it: the tensor that ``tensor``'s base (or ``tensor``) aliases (see :func:`note_alias`), or that base itself under
    ``torch.no_grad()``; ``None`` where there is none (the write is recorded, or the tensor has no history).

    Examples:
        >>> c = torch.ones(2, requires_grad=True) * 2
        >>> with torch.no_grad():
        ...     unrecorded_source(c) is c
        True
        >>> unrecorded_source(c) is None  # with gradient: recorded
        True
    """
    root = _root(tensor)
    link = root.__dict__.get(ALIAS_OF)
    if link is not None:
        return link()
    return root if not torch.is_grad_enabled() and _has_history(root) else None


def note_unrecorded_write(func: Any, args: tuple, root: torch.Tensor, name: str | None = None) -> None:
    """Note the tensor whose values ``func(*args)``, an in-place write into ``args[0]`` (a view of ``root``, or
    ``root``), changes where autograd does not record it: the tensor ``root`` aliases (see :func:`note_alias`), or
    ``root`` itself where it has autograd history and gradient is disabled. Called before the write, where gradient
    is disabled or ``root`` is an alias. ``name`` names the write (``func``'s name by default).

    Examples:
        >>> c = torch.ones(2, requires_grad=True) * 2
        >>> alias = c.detach()
        >>> note_alias(torch.Tensor.detach, (c,), alias)
        >>> note_unrecorded_write(torch.Tensor.copy_, (alias, torch.zeros(2)), alias)
        >>> id(c) in UNRECORDED
        True
        >>> UNRECORDED.clear()
    """
    if func in _NOT_READS:
        return
    name = getattr(func, "__name__", repr(func)) if name is None else name
    link = root.__dict__.get(ALIAS_OF)
    source = link() if link is not None else None
    if source is not None:
        _poison(source, f"{name} through a detached alias of it (`.detach()`, `.data`)")
    elif not torch.is_grad_enabled() and _has_history(root):
        _poison(root, f"{name} under torch.no_grad()")


def note_out_write(func: Any, out: Any) -> None:
    """Note the tensor whose values ``func(..., out=out)`` changes where autograd does not record it: the tensor an
    alias ``out`` (or a view of one) aliases, or one with autograd history written under ``torch.no_grad()`` (with
    gradient enabled, torch refuses an ``out=`` write into a tensor that requires grad). Called before the write.

    Examples:
        >>> c = torch.ones(2, requires_grad=True) * 2
        >>> alias = c.detach()
        >>> note_alias(torch.Tensor.detach, (c,), alias)
        >>> note_out_write(torch.add, alias)
        >>> UNRECORDED[id(c)][1]
        'add(out=...) through a detached alias of it (`.detach()`, `.data`)'
        >>> UNRECORDED.clear()
    """
    name = f"{getattr(func, '__name__', repr(func))}(out=...)"
    for tensor in out if isinstance(out, (list, tuple)) else (out,):
        if isinstance(tensor, torch.Tensor):
            root = _root(tensor)
            if ALIAS_OF in root.__dict__ or not torch.is_grad_enabled():
                note_unrecorded_write(func, (tensor,), root, name)


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    return [
        tensor
        for arg in (*args, *kwargs.values())
        for tensor in (arg if isinstance(arg, (list, tuple)) else (arg,))
        if isinstance(tensor, torch.Tensor)
    ]


def _written(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, str] | None:
    """The first of ``tensors`` whose tensor (it, or the tensor it views) is noted, and the write that changed it. (A
    view is noted itself where ``view.data = w`` replaced its storage alone.)"""
    for tensor in tensors:
        for noted in {id(t): t for t in (_root(tensor), tensor)}.values():
            entry = UNRECORDED.get(id(noted))
            if entry is not None and entry[0]() is noted and _changed(entry, noted):
                return tensor, entry[1]
    return None


def _raise(what: str, write: str) -> None:
    raise RuntimeError(
        f"LRP: {what} reads a tensor with autograd history whose values were changed by {write}, a write autograd "
        "does not record: the tensor's gradient still reaches what its values were computed from before the write, "
        "so relevance cannot follow it (not even the plain gradient is that of the function computed). Write the "
        "new values out of place (`c = torch.where(...)`, `c = w.expand_as(c).clone()`), or into the tensor itself "
        "with gradient enabled (`c.copy_(w)`)"
    )


def read_unrecorded(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` where it reads a tensor :func:`note_unrecorded_write` noted (or a view of it) and
    gives a result without gradient (``c.argmax()``, any call under ``torch.no_grad()``: a constant of the new values);
    :data:`NOT_READ` where it reads none (the mode runs it as it would). Raises where the result has gradient. A
    write replacing the whole tensor with gradient enabled (``c.copy_(h)``) reads none of it, and ends the note.

    Examples:
        >>> c = torch.ones(2, requires_grad=True) * 2
        >>> alias = c.detach()
        >>> note_alias(torch.Tensor.detach, (c,), alias)
        >>> note_unrecorded_write(torch.Tensor.copy_, (alias, torch.zeros(2)), alias)
        >>> read_unrecorded(torch.Tensor.argmax, (c,), {})
        tensor(0)
        >>> read_unrecorded(torch.mul, (c, 3), {})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        RuntimeError: LRP: mul reads a tensor with autograd history whose values were changed by copy_ through ...
        >>> read_unrecorded(torch.Tensor.copy_, (c, torch.ones(2)), {}) is NOT_READ  # replaced whole: a new history
        True
        >>> read_unrecorded(torch.mul, (c, 3), {}) is NOT_READ
        True
    """
    if func in _NOT_READS or not torch.is_grad_enabled():
        return NOT_READ
    tensors = _tensors(args, kwargs)
    if func in _WHOLE_WRITES and tensors and tensors[0] is args[0] and _root(args[0]) is args[0]:
        if _written(tensors[:1]) is not None:
            _forget(id(args[0]))  # every value replaced, with a history of its own
    read = _written(tensors)
    if read is None:
        return NOT_READ
    result = func(*args, **kwargs)
    outputs = result if isinstance(result, (list, tuple)) else (result,)
    if func in _SETTING_ITEMS and read[0] is not args[0]:  # ``buf[...] = c``: gives nothing, reads ``c`` into ``buf``
        outputs = args[:1]
    if any(isinstance(out, torch.Tensor) and out.requires_grad for out in outputs):
        _raise(getattr(func, "__name__", repr(func)), read[1])
    return result


def raise_for_unrecorded_inputs(module: torch.nn.Module, args: tuple) -> None:
    """Raise where ``module``, called with gradient enabled on ``args``, reads a tensor :func:`note_unrecorded_write`
    noted (or a view of it): the modes pause inside it, and do not see its calls.

    Examples:
        >>> raise_for_unrecorded_inputs(torch.nn.Linear(2, 2), (torch.ones(2),))  # nothing noted
    """
    if not torch.is_grad_enabled():
        return
    read = _written(_tensors(args, {}))
    if read is not None:
        _raise(f"{type(module).__name__} (a module with a rule)", read[1])
