"""Calling a method for a metric: its target, held and repeated for stacked perturbed copies."""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import InputXGradient
from tdhook.metrics import sensitivity_max
from tdhook.metrics._methods import repeat_target


def test_per_sample_indices_with_a_trailing_unit_dimension_are_repeated_too():
    """The methods take indices ``batch + [1]`` as well as ``batch``; both repeat over stacked copies."""
    target = torch.tensor([[0], [2], [1]])
    assert repeat_target(target, torch.Size([3]), 2).tolist() == [[0], [2], [1], [0], [2], [1]]
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)).double()
    td = TensorDict(x=torch.randn(3, 4, dtype=torch.float64), batch_size=[3])
    column = sensitivity_max(InputXGradient(net, in_keys=["x"], out_keys=["y"], target=target), td, seed=0)
    flat = sensitivity_max(InputXGradient(net, in_keys=["x"], out_keys=["y"], target=target[:, 0]), td, seed=0)
    torch.testing.assert_close(column, flat, rtol=0, atol=1e-12)


def test_a_masked_policy_is_explained_for_its_best_allowed_action_throughout():
    """The methods' default target for a masked policy is the best allowed action: sensitivity_max held the plain
    argmax for the perturbed inputs instead (LRP's sensitivity was 0.7 to 4.8 for 0.008 to 0.03)."""
    from torchrl.modules import MaskedCategorical

    from tdhook.attribution import LRP, EpsilonPlus
    from tests.attribution.test_policy_targets import masked_actor, masked_td

    actor = masked_actor(MaskedCategorical)
    td = masked_td(actor)
    with torch.no_grad():
        logits = actor.module[0](td.clone())["logits"]
    allowed = logits.masked_fill(~td["action_mask"], float("-inf")).argmax(-1)
    for make in (lambda **kw: LRP(actor, EpsilonPlus(), **kw), lambda **kw: InputXGradient(actor, **kw)):
        got = sensitivity_max(make(in_keys=["observation"]), td, seed=0, n_perturb_samples=4)
        expected = sensitivity_max(make(in_keys=["observation"], target=allowed), td, seed=0, n_perturb_samples=4)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
