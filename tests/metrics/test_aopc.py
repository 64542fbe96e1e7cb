"""aopc: the mean drop below the first point, over any batch shape."""

from __future__ import annotations

import pytest
import torch

from tdhook.metrics import aopc


def test_is_the_mean_drop_including_the_first_point():
    curve = torch.randn(2, 3, 7, dtype=torch.float64)
    expected = torch.empty(2, 3, dtype=torch.float64)
    for i in range(2):
        for j in range(3):
            expected[i, j] = sum(curve[i, j, 0] - curve[i, j, k] for k in range(7)) / 7
    torch.testing.assert_close(aopc(curve), expected, rtol=0, atol=1e-12)


def test_a_single_point_gives_zero_and_bad_curves_are_refused():
    assert aopc(torch.tensor([3.0])).item() == 0.0
    with pytest.raises(ValueError, match=r"curve must be a floating-point tensor batch \+ \[L \+ 1\]"):
        aopc(torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="got torch.float32 \\[2, 0\\]"):
        aopc(torch.ones(2, 0))
