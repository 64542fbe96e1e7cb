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


def test_a_wrapper_holding_the_check_pickles_and_the_copy_checks_with_its_tolerances():
    """The check was a closure, which pickle refuses: ``torch.save`` of a wrapper with ``relevance_check``, or a
    collector sending it to worker processes, raised ``Can't pickle local object``."""
    import pickle

    from tensordict import TensorDict

    from tdhook.attribution import LRP, EpsilonRule

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6, bias=False), nn.ReLU(), nn.Linear(6, 2, bias=False)).double()
    td = TensorDict(x=torch.randn(3, 4, dtype=torch.float64), batch_size=[3])
    conserving = LRP(
        net,
        {nn.Linear: EpsilonRule(1e-9)},
        in_keys=["x"],
        out_keys=["y"],
        relevance_check=raise_for_unconserved_rel_factory(),
    )
    copied = pickle.loads(pickle.dumps(conserving))
    torch.testing.assert_close(copied(td.clone())["relevance", "x"], conserving(td.clone())["relevance", "x"])
    losing = LRP(  # ε = 10 absorbs relevance: the copy's check must still raise
        net,
        {nn.Linear: EpsilonRule(10.0)},
        in_keys=["x"],
        out_keys=["y"],
        relevance_check=raise_for_unconserved_rel_factory(),
    )
    with pytest.raises(ValueError, match="relevance is not conserved at module '2' \\(Linear\\)"):
        pickle.loads(pickle.dumps(losing))(td.clone())
