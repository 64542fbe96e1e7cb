"""Where an integer or boolean input's values were written in place, over the storage written: for views taken before.

A view shares its tensor's storage: a write into the tensor after the view was taken (``v = z[:, 4:]; z[:, 4] =
a.float()``) changes the view too, though no call the view was made by saw the values written. The watch of
:mod:`~tdhook.attribution._numeric_inputs` marks, at each write of an input's values, the elements of the storage
written; a view reaching a layer then holds those inputs' values where it spans a marked element, whenever it was
taken. An element written holds them until the call ends, even if written again since (a write over it is not
tracked): a view of it is named, not left silent.

Examples:
    >>> z = torch.zeros(2, 6)
    >>> view, apart = z[:, 1:], z[:, :2]
    >>> writes = StorageWrites()
    >>> z[:, 5] = 1.0
    >>> writes.mark(z, (slice(None), 5), ((0, None),))
    >>> writes.read(view), writes.read(apart)
    (((0, None),), None)
"""

from __future__ import annotations

import torch

__all__ = ["StorageWrites"]

# What a tensor carries: by input, its position and the encoding its values took on the way (None: none).
Carrier = tuple[tuple[int, str | None], ...]


class StorageWrites:
    """The elements of each storage written with inputs' values during a call, and what each write carried."""

    def __init__(self) -> None:
        # By storage address: the tensor written (held, so that the storage is not freed and its address reused),
        # its element size, and for each write a mask over the storage's elements with what the write carried.
        self._marks: dict[int, tuple[torch.Tensor, int, list[tuple[torch.Tensor, Carrier]]]] = {}

    def __bool__(self) -> bool:
        return bool(self._marks)

    def mark(self, table: torch.Tensor, index: object, carrier: Carrier) -> None:
        """Note that ``table[index]`` (all of ``table`` where ``index`` is ``None`` or cannot be laid over it) now
        holds the values ``carrier`` says."""
        with torch._C.DisableTorchFunction():  # an inspection, which the watch's function mode must not see
            try:
                if table.is_meta or table.numel() == 0:
                    return
                storage = table.untyped_storage()
                address, size = storage.data_ptr(), table.element_size()
                if address == 0:
                    return
                kept, size, writes = self._marks.get(address, (table, size, []))
                flat = torch.zeros(storage.nbytes() // size, dtype=torch.bool, device=table.device)
                if table.element_size() != size:  # written as another dtype than before: all of it, as marked
                    flat.fill_(True)
                elif index is None:
                    region = flat.as_strided(table.shape, table.stride(), table.storage_offset())
                    region.fill_(True)
                else:
                    region = flat.as_strided(table.shape, table.stride(), table.storage_offset())
                    try:
                        region[index] = True
                    except (IndexError, RuntimeError, TypeError, ValueError):  # not an index of the region
                        region.fill_(True)
            except (RuntimeError, NotImplementedError):  # no storage to read (under vmap, a tensor subclass)
                return
            writes.append((flat, carrier))
            self._marks[address] = (kept, size, writes)

    def read(self, value: torch.Tensor) -> Carrier | None:
        """What the writes into ``value``'s storage carried, where they reach its elements; ``None`` where none
        does."""
        with torch._C.DisableTorchFunction():
            try:
                if value.is_meta or value.numel() == 0:
                    return None
                kept = self._marks.get(value.untyped_storage().data_ptr())
                if kept is None:
                    return None
                _, size, writes = kept
                found: dict[int, str | None] = {}
                for flat, carrier in writes:
                    if value.element_size() != size:
                        reached = True  # viewed as another dtype: any write reaches it
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
        self._marks = {}
