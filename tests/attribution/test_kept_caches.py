"""The state of the key-value caches a run that may be let go appends to, noted before they change."""

from __future__ import annotations

import torch
from torch import nn

from tdhook.attribution._kept_caches import KeptCaches, cache_receivers
from tests.attribution.test_detached_caches import Cache, Step
from tests.attribution.test_lrp_registration_faults import FailingRegistration


class TwoSteps(nn.Module):
    """Two steps, each handed a cache of its own: two receivers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = Step(), Step()

    def forward(self, x: torch.Tensor, first: Cache, second: Cache) -> torch.Tensor:
        return self.second(self.first(x, past_key_values=first), past_key_values=second)


def test_a_registration_that_fails_leaves_no_hook_and_a_later_watch_puts_the_caches_back():
    """The pre-hook on the second receiver failing to register (an interrupt, a module whose
    ``register_forward_pre_hook`` raises): the first receiver's was left on the model for good."""
    model = TwoSteps()
    kept = KeptCaches(cache_receivers(model))
    assert kept.receivers == [model.first, model.second]
    with FailingRegistration(2) as failing:
        with kept.watching():
            pass
    assert failing.where == "Module.register_forward_pre_hook"
    assert [len(step._forward_pre_hooks) for step in (model.first, model.second)] == [0, 0]
    first, second = Cache(), Cache()
    with kept.watching():
        model(torch.ones(2, 3, dtype=torch.float64), first, second)
    assert first.keys.shape == second.keys.shape == (2, 3)
    kept.put_back()
    assert first.keys.shape == second.keys.shape == (2, 0)
    assert [len(step._forward_pre_hooks) for step in (model.first, model.second)] == [0, 0]
