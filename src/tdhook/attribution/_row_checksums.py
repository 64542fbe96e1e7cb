"""A checksum of each row an offline output explained, kept beside it, so that a row changed since is explained again.

:func:`~tdhook.attribution.offline.explain_offline` explains only the rows its output has not marked done. A source
whose rows change between two runs into one output (a circular replay buffer that kept filling, a data set rewritten
in place) would keep the old rows' relevance for the new rows, with no word. The output's folder keeps, per row, a
checksum of what the explainer reads of it (:func:`row_checksums`: its input keys and the stored actions it explains);
a later run marks the done rows whose checksum changed as not done, and explains them again.

The checksum is a sum, over the rows' bytes read as 32-bit words, of a hash of each word and its position (the word
mixed with a salt of its position and key, times an odd factor, the high bits folded onto the low ones): exact integer
arithmetic, so the same rows give the same checksums whatever the batches they are read in. A plain weighted sum of
the words let changes cancel: a float's sign is its top bit, and two sign flips (a negated observation) moved such a
sum by 2³¹ twice, back to where it was, for half of the rows.

Examples:
    >>> from tensordict import TensorDict
    >>> rows = TensorDict(observation=torch.arange(6.0).reshape(3, 2), batch_size=[3])
    >>> first = row_checksums(rows, ["observation"])
    >>> rows["observation"][1, 0] = -1.0
    >>> (row_checksums(rows, ["observation"]) != first).tolist()
    [False, True, False]
    >>> torch.equal(row_checksums(rows[:2], ["observation"]), row_checksums(rows, ["observation"])[:2])
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from tensordict import MemoryMappedTensor, NestedKey, TensorDictBase

__all__ = ["CHECKSUM_FILE", "checksum_file", "row_checksums"]

#: The file, in the output's folder, that holds the checksum of each explained row.
CHECKSUM_FILE = "row_checksums.memmap"

# A word's salt: its position times the first, plus the second, plus the key's index times the third (wrapping in 32
# bits), so that no two (position, key) pairs of a row get one salt; then the mixing factor, odd and below 2**31, so
# that a salted word (a 32-bit value, signed or not) times it stays inside int64.
_STEP, _OFFSET, _KEY_STEP = 0x01F3D5B7, 0x00012345, 0x2C9277B5
_FACTOR = 0x7FEB352D
_LOW = 0xFFFFFFFF


def _mixed(words: torch.Tensor) -> torch.Tensor:
    """A hash of each of ``words`` (int64 values of 32 bits): a product, then the high bits folded onto the low
    ones, which no sum of the products' changes undoes (two sign flips, each moving a product by 2**31 times the
    factor, no longer cancel)."""
    words = words * _FACTOR
    return words ^ (words >> 29)


def row_checksums(rows: TensorDictBase, keys: Sequence[NestedKey]) -> torch.Tensor:
    """One 64-bit checksum per row (along the first batch dimension) of the tensors at ``keys`` that ``rows`` holds."""
    count = rows.batch_size[0]
    total = torch.zeros(count, dtype=torch.int64)
    present = rows.keys(include_nested=True, leaves_only=True)
    for index, key in enumerate(sorted({key for key in keys if key in present}, key=str)):
        value = rows.get(key)
        if not isinstance(value, torch.Tensor):
            continue
        data = value.detach().cpu().contiguous().reshape(count, -1).view(torch.uint8)
        words = data.view(torch.int32) if data.shape[1] % 4 == 0 else data.to(torch.int32)
        salts = (torch.arange(words.shape[1], dtype=torch.int64) * _STEP + _OFFSET + index * _KEY_STEP) & _LOW
        total += _mixed(words.to(torch.int64) ^ salts).sum(-1)
    return total


def checksum_file(prefix: Path, length: int) -> tuple[torch.Tensor, bool]:
    """The checksums kept at ``prefix`` for its ``length`` rows (a plain tensor over the file), and whether the file
    was there already (else it is created, all zeros: an output written before checksums were kept)."""
    path = prefix / CHECKSUM_FILE
    if path.exists():
        kept = MemoryMappedTensor.from_filename(path, dtype=torch.int64, shape=torch.Size([length]))
        return kept.as_subclass(torch.Tensor), True
    kept = MemoryMappedTensor.empty((length,), dtype=torch.int64, filename=path)
    kept.fill_(0)
    return kept.as_subclass(torch.Tensor), False
