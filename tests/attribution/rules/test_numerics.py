"""The numerics every rule shares: the stabilizer."""

from __future__ import annotations

import torch

from tdhook.attribution.rules._numerics import stabilize


class TestClosedForms:
    def test_stabilize_keeps_sign_and_treats_zero_as_positive(self):
        out = stabilize(torch.tensor([-2.0, -0.0, 0.0, 3.0, float("nan")], dtype=torch.float64), 0.25)
        assert out[:4].tolist() == [-2.25, 0.25, 0.25, 3.25]  # -0.0 counts as zero, as in zennit
        assert out[4].isnan()
