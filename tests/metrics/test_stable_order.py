"""The order from unique integer keys equals torch's stable sort, ties, signed zeros and infinities included."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tdhook.metrics._stable_order import stable_order


def torch_order(values: torch.Tensor, descending: bool) -> torch.Tensor:
    return torch.sort(values, dim=-1, descending=descending, stable=True).indices


# Few distinct values, so that most rows hold ties; both zeros, both infinities, the extremes and subnormals.
_SPECIAL = [0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45, 3.4e38, -3.4e38, float("inf"), float("-inf"), 0.5, -2.5]


@settings(max_examples=200, deadline=None)
@given(
    shape=st.lists(st.integers(0, 5), min_size=1, max_size=3).map(lambda s: [*s[:-1], s[-1] * 7 + s[-1] % 3]),
    pool=st.lists(st.sampled_from(_SPECIAL) | st.floats(-1e6, 1e6, width=32), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
    descending=st.booleans(),
)
def test_equals_torchs_stable_sort(shape, pool, seed, descending):
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(pool), shape, generator=generator)
    values = torch.tensor(pool, dtype=torch.float32)[picks]
    assert torch.equal(stable_order(values, descending), torch_order(values, descending))
    assert torch.equal(stable_order(values, descending, nan_free=True), torch_order(values, descending))


@pytest.mark.parametrize("descending", [True, False])
def test_random_values_and_views(descending):
    values = torch.randn(6, 2, 300)
    strided = values.transpose(0, 1)  # not contiguous
    assert torch.equal(stable_order(strided, descending), torch_order(strided, descending))
    assert torch.equal(stable_order(values[..., 0], descending), torch_order(values[..., 0], descending))


@pytest.mark.parametrize(
    "values",
    [
        torch.tensor([[1.0, float("nan"), -float("nan"), 2.0, float("nan")]]),  # NaN: torch's order, all NaN first
        torch.tensor([[1.0, 0.5, 1.0]], dtype=torch.float64),
        torch.tensor([[1.0, 0.5, 1.0]], dtype=torch.bfloat16),
        torch.tensor([[3, 1, 3, 2]]),
    ],
    ids=["nan", "float64", "bfloat16", "int64"],
)
@pytest.mark.parametrize("descending", [True, False])
def test_what_the_keys_do_not_fit_is_sorted_by_torch(values, descending):
    assert torch.equal(stable_order(values, descending), torch_order(values, descending))


def test_a_broken_key_would_be_seen():
    """Ties of 0.0 and -0.0 go by index, as torch's sort has them: a key from the raw bits would put -0.0 after 0.0
    in a descending sort."""
    values = torch.tensor([-0.0, 0.0, -0.0, 0.0])
    assert stable_order(values).tolist() == [0, 1, 2, 3]
    assert stable_order(values, descending=False).tolist() == [0, 1, 2, 3]
