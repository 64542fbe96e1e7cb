"""Row checksums of an offline output: any change to the rows' keys read changes the row's checksum."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tdhook.attribution._row_checksums import row_checksums

F64 = torch.float64


def test_whole_features_swapped_between_two_keys_change_the_checksum():
    """Keys 0 and 1 (in sorted order) shared the weight of every other 32-bit word: a float64 feature with a zero low
    word (a whole number: a grid position, a goal) swapped between them left the checksum as it was, and the
    rewritten row kept its old relevance."""
    rows = TensorDict(
        goal=torch.tensor([[1.0, 2.0]], dtype=F64), pos=torch.tensor([[3.0, 4.0]], dtype=F64), batch_size=[1]
    )
    before = row_checksums(rows, ["goal", "pos"])
    rows["goal"][0, 0], rows["pos"][0, 0] = 3.0, 1.0
    assert not torch.equal(row_checksums(rows, ["goal", "pos"]), before)


@pytest.mark.parametrize("keys", [2, 3, 7])
def test_each_word_swapped_between_any_two_keys_changes_the_checksum(keys: int):
    """Every pair of (key, word position) of a row gets its own weight: a swap of any two words is seen."""
    names = [f"k{i}" for i in range(keys)]
    rows = TensorDict(
        {name: torch.arange(4, dtype=torch.int32).reshape(1, 4) + 10 * i for i, name in enumerate(names)}, [1]
    )
    before = row_checksums(rows, names)
    for a in range(keys):
        for b in range(keys):
            for i in range(4):
                for j in range(4):
                    if (a, i) == (b, j):
                        continue
                    swapped = rows.clone()
                    swapped[names[a]][0, i], swapped[names[b]][0, j] = rows[names[b]][0, j], rows[names[a]][0, i]
                    assert not torch.equal(row_checksums(swapped, names), before), (a, i, b, j)


def test_the_checksums_do_not_depend_on_the_batches_the_rows_are_read_in():
    rows = TensorDict(a=torch.randn(10, 3, dtype=F64), b=torch.randn(10, 2, 2), batch_size=[10])
    whole = row_checksums(rows, ["a", "b"])
    torch.testing.assert_close(
        torch.cat([row_checksums(rows[:4], ["a", "b"]), row_checksums(rows[4:], ["a", "b"])]), whole
    )


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("change", ["negated", "two features negated", "absolute value"])
def test_sign_flips_change_every_row_s_checksum(dtype, change: str):
    """A float's sign is its top bit: two sign flips moved a weighted sum of the words by 2**31 twice, back to where
    it was, so a negated source kept the old relevance for 38 to 50 % of its rows (float64 and float32 alike)."""
    torch.manual_seed(0)
    rows = TensorDict(observation=torch.randn(2000, 4, dtype=dtype), batch_size=[2000])
    before = row_checksums(rows, ["observation"])
    value = rows["observation"]
    changed = {"negated": -value, "two features negated": value * torch.tensor([-1, -1, 1, 1], dtype=dtype)}
    changed["absolute value"] = value.abs()
    after = row_checksums(TensorDict(observation=changed[change], batch_size=[2000]), ["observation"])
    moved = (changed[change] != value).any(-1)
    assert bool(moved.sum() > 1000)
    assert bool((after != before)[moved].all())
    assert bool((after == before)[~moved].all())
