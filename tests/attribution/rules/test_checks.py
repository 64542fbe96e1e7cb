"""raise_for_unconserved_rel_factory: the relevance check raises where relevance is lost or not finite."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tdhook.attribution.rules.checks import raise_for_unconserved_rel_factory


class TestUnconservedCheck:
    def test_accepts_conserved_and_rejects_lost_relevance(self):
        check = raise_for_unconserved_rel_factory(atol=1e-6, rtol=1e-6)
        check("a", nn.Linear(1, 1), torch.tensor([0.25, 0.75]), torch.tensor([1.0]))
        with pytest.raises(ValueError, match="'a'"):
            check("a", nn.Linear(1, 1), torch.tensor([0.25, 0.5]), torch.tensor([1.0]))

    def test_rejects_nan(self):
        check = raise_for_unconserved_rel_factory()
        with pytest.raises(ValueError, match="NaN or inf"):
            check("layer", nn.Tanh(), torch.tensor([float("nan")]), torch.tensor([1.0]))


@pytest.mark.parametrize("tolerance", ["atol", "rtol"])
def test_negative_tolerances_are_refused(tolerance: str):
    with pytest.raises(ValueError, match=f"raise_for_unconserved_rel_factory: {tolerance} must be a finite number"):
        raise_for_unconserved_rel_factory(**{tolerance: -1e-6})
    raise_for_unconserved_rel_factory(**{tolerance: 0.0})
