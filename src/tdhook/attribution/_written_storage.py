"""Where an integer or boolean input's values were written in place, over the storage written: for views taken before.

A view shares its tensor's storage: a write into the tensor after the view was taken (``v = z[:, 4:]; z[:, 4] =
a.float()``) changes the view too, though no call the view was made by saw the values written. The watch of
:mod:`~tdhook.attribution._numeric_inputs` marks, at each write of an input's values, the elements of the storage
written; a view reaching a layer then holds those inputs' values where it spans a marked element, whenever it was
taken. Values of no input written over them where the write says (an activation, zeros, a gate put over them in
place) unmark those elements; a write whose extent is not known (a ``scatter_`` of an activation) leaves them
marked: a view of them is named, not left silent.

Only a tensor of a dtype written is read against the marks (a recurrent policy's ``is_init`` written into a boolean
tensor leaves its floating-point activations unread), until a tensor is viewed as another dtype in the call
(``z.view(torch.int32)``, ``torch.view_as_real``) or its memory handed out to be (a NumPy array, a DLPack capsule):
a view of any dtype is read from then on. A view as another dtype taken before the call, or made otherwise (a
``set_`` to the storage of a tensor of another dtype, ``torch.frombuffer``), is not followed.

Examples:
    >>> z = torch.zeros(2, 6)
    >>> view, apart = z[:, 1:], z[:, :2]
    >>> writes = StorageWrites()
    >>> z[:, 5] = 1.0
    >>> writes.mark(z, (slice(None), 5), ((0, None),))
    >>> writes.read(view), writes.read(apart), writes.dtypes
    (((0, None),), None, frozenset({torch.float32}))
    >>> writes.mark(z, (slice(None), 5), None)  # written over with values of no input
    >>> writes.read(view)
"""

from __future__ import annotations

import torch

__all__ = ["StorageWrites"]

# What a tensor carries: by input, its position and the encoding its values took on the way (None: none).
Carrier = tuple[tuple[int, str | None], ...]
# Every dtype: those a view of a marked storage may take once a tensor was viewed as another dtype.
_EVERY_DTYPE = frozenset(value for value in vars(torch).values() if isinstance(value, torch.dtype))


class StorageWrites:
    """The elements of each storage written with inputs' values during a call, by what the writes carried."""

    def __init__(self) -> None:
        # By storage address: the tensor first written (held, so that the storage is not freed and its address
        # reused), its element size, and by what a write carried, a mask over the storage's elements written so.
        self._marks: dict[int, tuple[torch.Tensor, int, dict[Carrier, torch.Tensor]]] = {}
        self._reinterpreted = False  # a tensor was viewed as another dtype in the call
        # The dtypes of the tensors that may span a marked element: those of the tensors written, every dtype once
        # a tensor was viewed as another. Read as a plain attribute, without a call, before each lookup.
        self.dtypes: frozenset[torch.dtype] = frozenset()

    def __bool__(self) -> bool:
        return bool(self._marks)

    def reinterpreted(self) -> None:
        """Note that a tensor was viewed as another dtype (``z.view(torch.int32)``): a tensor of any dtype may span
        a marked element from now on."""
        self._reinterpreted = True
        if self._marks:
            self.dtypes = _EVERY_DTYPE

    def mark(self, table: torch.Tensor, index: object, carrier: Carrier | None) -> None:
        """Note that ``table[index]`` (all of ``table`` where ``index`` is ``None`` or cannot be laid over it) now
        holds the values ``carrier`` says: with ``carrier`` ``None``, values of no input (an activation or zeros
        written over them, a gate put over them in place), its elements are no longer marked."""
        with torch._C.DisableTorchFunction():  # an inspection, which the watch's function mode must not see
            try:
                if table.is_meta or table.numel() == 0:
                    return
                storage = table.untyped_storage()
                address = storage.data_ptr()
                if address == 0 or (carrier is None and address not in self._marks):
                    return
                kept, size, writes = self._marks.get(address, (table, table.element_size(), {}))
                if table.element_size() != size:  # written as another dtype than before: every element
                    region, index = _storage_elements(kept), None
                else:
                    region = table
                shown = [
                    flat.as_strided(region.shape, region.stride(), region.storage_offset())
                    for flat in (writes.values() if carrier is None else (_mask(writes, carrier, kept, size),))
                ]
                for elements in shown:
                    _set(elements, index, carrier is not None)
            except (RuntimeError, NotImplementedError):  # no storage to read (under vmap, a tensor subclass)
                return
            self._marks[address] = (kept, size, writes)
            self.dtypes = _EVERY_DTYPE if self._reinterpreted else self.dtypes | {table.dtype}

    def read(self, value: torch.Tensor) -> Carrier | None:
        """What the writes into ``value``'s storage carried, where they reach its elements; ``None`` where none
        does (as for a tensor of none of :attr:`dtypes`)."""
        with torch._C.DisableTorchFunction():
            try:
                if value.dtype not in self.dtypes or value.is_meta or value.numel() == 0:
                    return None
                kept = self._marks.get(value.untyped_storage().data_ptr())
                if kept is None:
                    return None
                _, size, writes = kept
                found: dict[int, str | None] = {}
                for carrier, flat in writes.items():
                    if value.element_size() != size:
                        reached = bool(flat.any())  # viewed as another dtype: any element written reaches it
                    else:
                        reached = bool(flat.as_strided(value.shape, value.stride(), value.storage_offset()).any())
                    if reached:
                        for i, encoding in carrier:
                            found.setdefault(i, encoding)
            except (RuntimeError, NotImplementedError):
                return None
        return tuple(found.items()) or None

    def clear(self) -> None:
        """Forget the call's writes (and release the storages held)."""
        self._marks, self._reinterpreted, self.dtypes = {}, False, frozenset()


def _storage_elements(table: torch.Tensor) -> torch.Tensor:
    """Every element of ``table``'s storage, as a flat view of ``table``'s dtype."""
    count = table.untyped_storage().nbytes() // table.element_size()
    return table.as_strided((count,), (1,), 0)


def _mask(writes: dict[Carrier, torch.Tensor], carrier: Carrier, kept: torch.Tensor, size: int) -> torch.Tensor:
    """The mask of the elements written with ``carrier``'s values, made where none was."""
    flat = writes.get(carrier)
    if flat is None:
        count = kept.untyped_storage().nbytes() // size
        flat = writes[carrier] = torch.zeros(count, dtype=torch.bool, device=kept.device)
    return flat


def _set(elements: torch.Tensor, index: object, written: bool) -> None:
    """Set ``elements[index]`` (all of them where ``index`` is ``None``, or is no index of theirs) to ``written``."""
    if index is not None:
        try:
            elements[index] = written
            return
        except (IndexError, RuntimeError, TypeError, ValueError):  # not an index of the elements
            if not written:  # unmarked, not known where: left marked
                return
    elements.fill_(written)
