"""pearson and spearman against scipy, ties included."""

from __future__ import annotations

import pytest
import torch

from tdhook.metrics._similarity import average_ranks, pearson, spearman

stats = pytest.importorskip("scipy.stats")


def test_equal_scipy_row_by_row_with_ties():
    a = torch.randint(0, 4, (6, 15)).double()  # many ties
    b = torch.randn(6, 15, dtype=torch.float64)
    for i in range(6):
        assert abs(spearman(a, b)[i].item() - stats.spearmanr(a[i], b[i])[0]) < 1e-12
        assert abs(pearson(a, b)[i].item() - stats.pearsonr(a[i], b[i])[0]) < 1e-12
    torch.testing.assert_close(average_ranks(a[0]), torch.from_numpy(stats.rankdata(a[0])).double())


def test_batched_over_leading_dimensions():
    a, b = torch.randn(2, 3, 9, dtype=torch.float64), torch.randn(2, 3, 9, dtype=torch.float64)
    assert spearman(a, b).shape == (2, 3)
    torch.testing.assert_close(spearman(a, b)[1, 2], spearman(a[1, 2], b[1, 2]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_constant_row_gives_nan_as_scipy_even_where_its_mean_rounds(dtype):
    # The float32 mean of fifty 0.1 is not 0.1: the centred row was rounding noise and the correlation 2e-9.
    a = torch.tensor([[0.1] * 50, [1 / 3] * 50, list(range(50))], dtype=dtype)
    b = torch.randn(3, 50, dtype=dtype)
    r = pearson(a, b)
    assert r[:2].isnan().all() and bool(r[2].isfinite())
    assert pearson(b, a)[:2].isnan().all()
    assert spearman(a, b)[:2].isnan().all()


def test_a_nan_gives_nan_as_scipy_not_a_rank_correlation():
    """A NaN sorted last and took ranks that were not its own: spearman([1, nan, 3, 2], [1, 2, 3, 4]) gave 0.17."""
    a = torch.tensor([[1.0, float("nan"), 3.0, 2.0], [1.0, float("inf"), 3.0, 2.0]], dtype=torch.float64)
    b = torch.tensor([[1.0, 2.0, 3.0, 4.0]] * 2, dtype=torch.float64)
    r = spearman(a, b)
    assert r[0].isnan() and spearman(b, a)[0].isnan()
    assert abs(r[1].item() - stats.spearmanr(a[1], b[1])[0]) < 1e-12  # an infinite value ranks as the largest


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_rows_rank_and_correlate_in_float32(dtype):
    """3000 entries: float16's sum of squared ranks overflowed (NaN) and bfloat16 ranks past 256 rounded to ties."""
    torch.manual_seed(0)
    a = torch.randn(2, 3000).to(dtype)
    b = (a.float() + 0.5 * torch.randn(2, 3000)).to(dtype)
    for similarity in (spearman, pearson):
        got = similarity(a, b)
        assert got.dtype == dtype
        expected = similarity(a.double(), b.double()).to(dtype)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert torch.equal(average_ranks(a), average_ranks(a.double()).float())
