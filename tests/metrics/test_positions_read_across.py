"""Metrics on a [B, T] batch of a model that reads across T: warned of, naming the metric."""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.metrics import action_fidelity, faithfulness_correlation, infidelity, pixel_flipping, region_perturbation


class CausalMean(nn.Module):
    """Each step's output from the mean of the steps up to it: the model reads across the batch's last dimension."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 3)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        obs = obs.flatten(-2)  # [..., T, 2, 2]: a 2 x 2 map a step
        steps = torch.arange(1, obs.shape[-2] + 1, dtype=obs.dtype).unsqueeze(-1)
        return self.layer(torch.tanh(obs.cumsum(-2) / steps))


class EachStep(nn.Module):
    """Each step from its own features alone, in a forward of one's own (not known to compute positions apart)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 3)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.layer(torch.tanh(obs.flatten(-2)))


def rollout(net: nn.Module) -> tuple[TensorDictModule, TensorDict]:
    torch.manual_seed(3)
    x, attribution = torch.randn(2, 4, 2, 2, dtype=torch.float64), torch.randn(2, 4, 2, 2, dtype=torch.float64)
    td = TensorDict(obs=x, attribution=TensorDict(obs=attribution, batch_size=[2, 4]), batch_size=[2, 4])
    return TensorDictModule(net.double(), in_keys=["obs"], out_keys=["q"]), td


def noise(repeated: TensorDict) -> tuple[TensorDict, TensorDict]:
    """infidelity's perturbation: a fixed draw, subtracted."""
    perturbation = repeated.apply(lambda x: torch.randn(x.shape, generator=torch.Generator().manual_seed(0)).to(x))
    return perturbation, repeated - perturbation


CURVES = {
    "pixel_flipping": lambda module, td: pixel_flipping(module, td, progress=False),
    "region_perturbation": lambda module, td: region_perturbation(module, td, patch_size=2, progress=False),
    "faithfulness_correlation": lambda module, td: faithfulness_correlation(
        module, td, n_runs=4, subset_size=2, seed=0, progress=False
    ),
    "action_fidelity": lambda module, td: action_fidelity(module, td, k=1, n_random=2, seed=0, progress=False),
    "infidelity": lambda module, td: infidelity(module, td, perturb_fn=noise, n_perturb_samples=3),
}


@pytest.mark.parametrize("metric", sorted(CURVES))
def test_a_model_reading_across_the_positions_is_named(metric):
    """On a [B, T] batch of a model that reads across T with no recurrent module of torchrl's (which is refused), a
    curve perturbed every position at once, each position's curve holding the effect of the others' features (0.85
    off the curve of each position alone on a causal toy model), with no word, where the methods warn and perturb each
    position alone."""
    module, td = rollout(CausalMean())
    with pytest.warns(UserWarning, match=rf"{metric}: the model reads across the last batch dimension \(of \[2, 4\]\)"):
        CURVES[metric](module, td)


@pytest.mark.parametrize(
    "net", [EachStep, lambda: nn.Sequential(nn.Flatten(-2), nn.Tanh(), nn.Linear(4, 3))], ids=["own", "torch"]
)
@pytest.mark.parametrize("metric", sorted(CURVES))
def test_a_model_of_each_position_alone_is_not_named(metric, net):
    module, td = rollout(net())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        curve = CURVES[metric](module, td)
    if metric in ("pixel_flipping", "region_perturbation"):  # the same curves as the positions in a flat batch
        flat = TensorDict(obs=td["obs"].flatten(0, 1), attribution=td["attribution"].flatten(0, 1), batch_size=[8])
        torch.testing.assert_close(curve.flatten(0, 1), CURVES[metric](module, flat), rtol=1e-12, atol=1e-12)
