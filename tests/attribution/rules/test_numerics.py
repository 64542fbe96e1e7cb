"""The numerics every rule shares: the stabilizer, the gradient that carries a relevance, the ε-rule's factor."""

from __future__ import annotations

import torch

from tdhook.attribution.rules._numerics import carrying_gradient, epsilon_factor, stabilize


class TestClosedForms:
    def test_stabilize_keeps_sign_and_treats_zero_as_positive(self):
        out = stabilize(torch.tensor([-2.0, -0.0, 0.0, 3.0, float("nan")], dtype=torch.float64), 0.25)
        assert out[:4].tolist() == [-2.25, 0.25, 0.25, 3.25]  # -0.0 counts as zero, as in zennit
        assert out[4].isnan()

    def test_carrying_gradient_is_zero_where_the_quotient_cannot_carry_and_propagates_nan(self):
        relevance = torch.tensor([1.0, 2.0, 0.0, float("nan"), 3.0], dtype=torch.float64)
        x = torch.tensor([0.0, 1e-310, 0.0, 2.0, 4.0], dtype=torch.float64)
        grad = carrying_gradient(relevance, x)
        assert grad[[0, 1, 2]].tolist() == [0.0, 0.0, 0.0] and grad[3].isnan() and grad[4] == 0.75
        # with a history (create_graph): the same values, and a finite derivative where x = 0 or is subnormal
        leaf = x.clone().requires_grad_(True)
        kept = carrying_gradient(relevance[[0, 1, 2, 4]], leaf[[0, 1, 2, 4]])
        assert kept.tolist() == [0.0, 0.0, 0.0, 0.75]
        (derivative,) = torch.autograd.grad(kept.sum(), leaf)
        assert derivative.isfinite().all()

    def test_epsilon_factor_is_zero_at_zero_in_float16_below_its_smallest_step(self):
        z = torch.tensor([0.0, -1e-3, 2.0], dtype=torch.float16)
        assert epsilon_factor(z, 1e-9).tolist() == [0.0, 1.0, 1.0]
        wide = z.double()
        torch.testing.assert_close(epsilon_factor(wide, 0.5), wide.abs() / (wide.abs() + 0.5), rtol=1e-15, atol=0)
