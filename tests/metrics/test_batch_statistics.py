"""Models normalising over their batch: their running statistics are left as they were by every metric."""

from __future__ import annotations

import copy

import pytest
import torch
from tensordict import TensorDict

from tdhook.attribution import InputXGradient
from tdhook.metrics import (
    action_fidelity,
    faithfulness_correlation,
    infidelity,
    pixel_flipping,
    region_perturbation,
    sensitivity_max,
)
from tests.metrics.test_scoring import batch_normalised


def test_the_running_statistics_of_a_model_in_training_mode_are_left_as_they_were():
    """Each pass of a BatchNorm in training mode updates its running statistics: the metrics' perturbed passes
    (hundreds for a curve) would leave the caller's model with those of perturbed inputs."""
    net = batch_normalised("linear")
    td = TensorDict(x=torch.randn(4, 3, 4, 4, dtype=torch.float64), batch_size=[4])
    td["attribution", "x"] = torch.randn(4, 3, 4, 4, dtype=torch.float64)
    before = copy.deepcopy(net.state_dict())
    kwargs = dict(in_keys=["x"], out_keys=["y"])
    pixel_flipping(module=net, td=td, features_per_step=8, **kwargs)
    region_perturbation(net, td, patch_size=2, **kwargs)
    faithfulness_correlation(net, td, n_runs=3, subset_size=4, seed=0, **kwargs)
    action_fidelity(net, td, k=3, n_random=2, seed=0, **kwargs)
    infidelity(net, td, perturb_fn=lambda r: (r, r.apply(torch.zeros_like)), n_perturb_samples=2, **kwargs)
    sensitivity_max(InputXGradient(net, in_keys=["x"], out_keys=["y"]), td, n_perturb_samples=2, seed=0)
    with pytest.raises(ValueError, match="normalises over the batch"):
        pixel_flipping(net, td, steps_per_forward=2, **kwargs)
    after = net.state_dict()
    assert net.training and all(torch.equal(after[name], value) for name, value in before.items())
