"""Feature ablation against captum's FeatureAblation in float64, and the definition for masks left out."""

from __future__ import annotations

import captum.attr
import pytest
import torch
from tensordict import TensorDict

from tdhook.attribution import FeatureAblation
from tests.attribution.methods._models import assert_random_mlp_matches, random_mlp, small_cnn, two_key_policy
from tests.conftest import relative_error


def patches(height: int, width: int, size: int) -> torch.Tensor:
    """Group ids ``[1, H, W]``: square patches of ``size`` pixels, every channel of a pixel in one group."""
    rows = torch.arange(height).div(size, rounding_mode="floor").view(-1, 1)
    cols = torch.arange(width).div(size, rounding_mode="floor").view(1, -1)
    return (rows * ((width + size - 1) // size) + cols).unsqueeze(0)


class TestAgainstCaptum:
    @pytest.mark.parametrize("target", [None, 4])
    def test_small_cnn_with_pixel_patches(self, target):
        net = small_cnn()
        x = torch.randn(5, 3, 8, 8, dtype=torch.float64)
        mask = patches(8, 8, 2)
        td = FeatureAblation(
            net, in_keys=["image"], out_keys=["logits"], target=target, feature_masks=mask, baselines=0.3
        )(TensorDict(image=x, batch_size=[5]))
        expected = captum.attr.FeatureAblation(net).attribute(
            x.clone(),
            target=net(x).argmax(-1) if target is None else target,
            feature_mask=mask.unsqueeze(0),
            baselines=0.3,
        )
        assert relative_error(td["attribution", "image"], expected) <= 1e-8

    def test_two_key_policy_with_groups_across_keys(self):
        policy = two_key_policy()
        obs, goal = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
        masks = {"obs": torch.tensor([0, 1, 2, 2]), "goal": torch.tensor([2, 3])}
        baselines = {"obs": torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64), "goal": -1.0}
        td = FeatureAblation(policy, target=1, feature_masks=masks, baselines=baselines)(
            TensorDict(obs=obs, goal=goal, batch_size=[6])
        )
        expected = captum.attr.FeatureAblation(policy.module).attribute(
            (obs.clone(), goal.clone()),
            target=1,
            feature_mask=(masks["obs"].unsqueeze(0), masks["goal"].unsqueeze(0)),
            baselines=(baselines["obs"].unsqueeze(0), -1.0),
            enable_cross_tensor_attribution=True,
        )
        assert relative_error(td["attribution", "obs"], expected[0]) <= 1e-8
        assert relative_error(td["attribution", "goal"], expected[1]) <= 1e-8
        # Group 2 spans both keys: the same value on obs[2:] and goal[0].
        assert torch.equal(td["attribution", "obs"][:, 2], td["attribution", "goal"][:, 0])

    @pytest.mark.parametrize("seed", range(3))
    def test_random_mlps_every_element_its_group(self, seed):
        assert_random_mlp_matches(
            FeatureAblation, captum.attr.FeatureAblation, seed, (2, 3), feature_masks=torch.arange(5)
        )

    def test_masks_that_differ_per_sample(self):
        net = random_mlp(4)
        x = torch.randn(3, 5, dtype=torch.float64)
        mask = torch.tensor([[0, 0, 1, 1, 2], [0, 1, 1, 2, 2], [2, 2, 2, 0, 1]])
        td = FeatureAblation(net, in_keys=["x"], out_keys=["y"], feature_masks=mask)(TensorDict(x=x, batch_size=[3]))
        expected = captum.attr.FeatureAblation(net).attribute(x.clone(), target=net(x).argmax(-1), feature_mask=mask)
        assert relative_error(td["attribution", "x"], expected) <= 1e-8


class TestDefinition:
    def test_no_mask_is_one_group_per_key(self):
        policy = two_key_policy()
        obs, goal = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
        td = FeatureAblation(policy, target=0)(TensorDict(obs=obs, goal=goal, batch_size=[4]))
        net = policy.module
        with torch.no_grad():
            full = net(obs, goal)[:, 0]
            obs_drop = full - net(torch.zeros_like(obs), goal)[:, 0]
            goal_drop = full - net(obs, torch.zeros_like(goal))[:, 0]
        assert relative_error(td["attribution", "obs"], obs_drop.unsqueeze(-1).expand(4, 4)) <= 1e-12
        assert relative_error(td["attribution", "goal"], goal_drop.unsqueeze(-1).expand(4, 2)) <= 1e-12

    def test_one_forward_per_group_for_the_whole_batch(self):
        net = small_cnn()
        calls = []
        handle = net.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
        try:
            FeatureAblation(net, in_keys=["image"], out_keys=["logits"], feature_masks=patches(8, 8, 4))(
                TensorDict(image=torch.randn(7, 3, 8, 8, dtype=torch.float64), batch_size=[7])
            )
        finally:
            handle.remove()
        assert calls == [7] * 5  # the unperturbed pass, then one per group

    def test_an_infinite_drop_stays_on_its_own_group(self):
        """``log(x0) + 2 x1 + 3 x2`` with x0 ablated to 0 drops by inf: the other groups keep their drops, 2 and 3, as
        Occlusion's do. The drop was put on each group by a product with its mask, so ``inf * 0`` made every other
        group NaN (captum's FeatureAblation does the same)."""

        class LogFirst(torch.nn.Module):
            def forward(self, x):
                return torch.log(x[..., :1]) + 2 * x[..., 1:2] + 3 * x[..., 2:3]

        x = torch.tensor([[2.0, 1.0, 1.0], [0.5, 2.0, 1.0]], dtype=torch.float64)
        td = FeatureAblation(LogFirst(), in_keys=["x"], out_keys=["y"], feature_masks=torch.arange(3))(
            TensorDict(x=x, batch_size=[2])
        )
        expected = torch.tensor([[float("inf"), 2.0, 3.0], [float("inf"), 4.0, 3.0]], dtype=torch.float64)
        torch.testing.assert_close(td["attribution", "x"], expected, rtol=0, atol=0)

    def test_progress_bar(self, capsys):
        net = random_mlp(0)
        FeatureAblation(net, in_keys=["x"], out_keys=["y"], feature_masks=torch.arange(5), progress=True)(
            TensorDict(x=torch.randn(2, 5, dtype=torch.float64), batch_size=[2])
        )
        assert "FeatureAblation" in capsys.readouterr().err


class TestRefusals:
    @pytest.mark.parametrize(
        "mask, error, match",
        [
            (
                torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0]),
                TypeError,
                "the feature mask of input key 'x' must be an integer tensor",
            ),
            (torch.arange(4), ValueError, r"the feature mask of input key 'x' has shape \[4\].*one sample's \[5\]"),
            ({"z": torch.arange(5)}, KeyError, "feature_masks must have one entry per explained input key"),
        ],
    )
    def test_bad_masks_name_the_key_and_leave_the_tensordict(self, mask, error, match):
        td = TensorDict(x=torch.randn(2, 5, dtype=torch.float64), batch_size=[2])
        with pytest.raises(error, match=f"FeatureAblation: {match}"):
            FeatureAblation(random_mlp(0), in_keys=["x"], out_keys=["y"], feature_masks=mask)(td)
        assert list(td.keys()) == ["x"]
