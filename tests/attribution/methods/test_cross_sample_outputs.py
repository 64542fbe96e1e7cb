"""A target that scores the samples of its batch against each other: stacked copies run one per pass instead."""

from __future__ import annotations

import pytest
import torch

from tdhook.attribution.methods._cross_sample_outputs import scored_across_copies
from tests.attribution.methods._transformers import F64, IMAGE, image_pairs, similarity
from tests.attribution.methods.test_base import make
from tests.attribution.methods.test_batch_statistics import STACKED


def options(name: str, stacked: bool) -> dict:
    """The options of one copy of the batch (of 3 pairs) per pass, or of all copies in one pass."""
    option, together = STACKED[name]
    one = 3 if option == "internal_batch_size" else 1
    extra: dict = {"n_steps": 3} if name == "IntegratedGradients" else {}
    halves = torch.arange(2).repeat_interleave(IMAGE // 2)
    if name in ("FeatureAblation", "ShapleyValueSampling"):  # the left and right halves of a, the top and bottom of b
        extra["feature_masks"] = {"a": halves.view(1, 1, IMAGE), "b": 2 + halves.view(1, IMAGE, 1)}
    if name == "Occlusion":
        extra = {"sliding_window_shapes": (3, IMAGE, IMAGE)}  # one window per key: two copies
    if name == "GradientShap":
        references = torch.randn(2, 3, IMAGE, IMAGE, dtype=F64, generator=torch.Generator().manual_seed(2))
        extra = {"baselines": {"a": references, "b": references.flip(0)}, "n_samples": 2, "seed": 0}
    if name == "SmoothGrad":
        extra = {"stdev": 0.1, "n_samples": 2, "seed": 0}
    return {option: together if stacked else one, **extra}


@pytest.mark.parametrize("name", list(STACKED))
def test_similarities_of_stacked_copies_equal_one_copy_per_pass(name):
    """A model returning the ``[B, B]`` similarities of two batches of images returns ``[S * B, S * B]`` for ``S``
    stacked copies: every copy scored against every other. The stacked copies raised a reshape error
    (``shape '[S, 3, 3]' is invalid``); the first stacked pass shows it, and the copies run one per pass."""
    module, td = similarity(), image_pairs()
    expected = make(name, module, in_keys=["a", "b"], **options(name, stacked=False))(td.clone())
    found = make(name, module, in_keys=["a", "b"], **options(name, stacked=True))(td.clone())
    for key in ("a", "b"):
        torch.testing.assert_close(found["attribution", key], expected["attribution", key], rtol=0, atol=1e-12)


def test_scored_across_copies():
    own = torch.zeros(3, 3)
    assert scored_across_copies(torch.zeros(6, 6), 1, own, 1)
    assert not scored_across_copies(torch.zeros(6, 3), 1, own, 1)
    assert not scored_across_copies(torch.zeros(4, 3, 5), 2, torch.zeros(2, 3, 5), 2)
    assert not scored_across_copies(torch.zeros(4, 5), 1, torch.zeros(5), 0)  # copies of an unbatched sample
    assert scored_across_copies(torch.zeros(()), 1, torch.zeros(()), 0)  # copies reduced together (a mean)


def _mean_dqn_loss_and_batch():
    """torchrl's DQN loss with ``reduction="mean"``: one number for the whole batch, which is one sample."""
    from tensordict import TensorDict
    from torchrl.modules import QValueActor
    from torchrl.objectives import DQNLoss

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to(F64)
    actor = QValueActor(net, in_keys=["observation"], action_space="one-hot")
    loss = DQNLoss(actor, action_space="one-hot", reduction="mean")
    g = torch.Generator().manual_seed(1)
    td = TensorDict(
        {
            "observation": torch.randn(5, 4, dtype=F64, generator=g),
            "action": torch.nn.functional.one_hot(torch.randint(0, 2, (5,), generator=g), 2),
            ("next", "observation"): torch.randn(5, 4, dtype=F64, generator=g),
            ("next", "reward"): torch.randn(5, 1, dtype=F64, generator=g),
            ("next", "done"): torch.zeros(5, 1, dtype=torch.bool),
            ("next", "terminated"): torch.zeros(5, 1, dtype=torch.bool),
        },
        batch_size=[5],
    )
    return loss, td


def test_a_loss_that_reduces_its_batch_runs_the_copies_one_per_pass():
    """A loss with ``reduction="mean"`` returns one number for the stacked copies of an integral's path, their
    mean: IntegratedGradients raised ``shape '[50]' is invalid for input of size 1`` (FeatureAblation likewise
    with ``perturbations_per_eval`` above 1). The copies run one per pass; the attributions are those of the
    mean loss, every sample's observation scaled along the path together."""
    import numpy as np

    from tdhook.attribution import FeatureAblation, IntegratedGradients

    loss, td = _mean_dqn_loss_and_batch()
    x = td["observation"]

    def mean_loss(observation: torch.Tensor) -> torch.Tensor:
        return loss(td.clone().set("observation", observation))["loss"]

    nodes, weights = np.polynomial.legendre.leggauss(8)
    path = torch.zeros_like(x)
    for node, weight in zip(nodes, weights, strict=True):
        scaled = (x * float((node + 1) / 2)).requires_grad_(True)
        path += float(weight / 2) * torch.autograd.grad(mean_loss(scaled), scaled)[0]
    out = IntegratedGradients(loss, in_keys=["observation"], target_key="loss", n_steps=8)(td.clone())
    torch.testing.assert_close(out["attribution", "observation"], path * x, rtol=1e-10, atol=1e-12)

    with torch.no_grad():
        drops = [mean_loss(x) - mean_loss(x * (torch.arange(4) != j)) for j in range(4)]
    ablation = FeatureAblation(
        loss, in_keys=["observation"], target_key="loss", feature_masks=torch.arange(4), perturbations_per_eval=3
    )
    out = ablation(td.clone())
    torch.testing.assert_close(out["attribution", "observation"], torch.stack(drops).expand(5, 4), rtol=1e-10, atol=0)
