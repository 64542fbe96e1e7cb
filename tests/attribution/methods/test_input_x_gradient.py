"""Input × gradient against captum's InputXGradient in float64."""

from __future__ import annotations

import captum.attr
import pytest
import torch
from tensordict import TensorDict

from tdhook.attribution import InputXGradient
from tests.attribution.methods._models import flat, random_mlp, small_cnn, two_key_policy
from tests.conftest import relative_error

pytestmark = pytest.mark.filterwarnings("ignore:Input Tensor .* did not already require gradients:UserWarning")


class TestAgainstCaptum:
    @pytest.mark.parametrize("target", [None, 2])
    def test_small_cnn(self, target):
        net = small_cnn()
        x = torch.randn(6, 3, 8, 8, dtype=torch.float64)
        td = InputXGradient(net, in_keys=["image"], out_keys=["logits"], target=target)(
            TensorDict(image=x, batch_size=[6])
        )
        expected = captum.attr.InputXGradient(net).attribute(
            x.clone(), target=net(x).argmax(-1) if target is None else target
        )
        assert relative_error(td["attribution", "image"], expected) <= 1e-8

    def test_two_key_policy(self):
        policy = two_key_policy()
        obs, goal = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
        td = InputXGradient(policy, target=0)(TensorDict(obs=obs, goal=goal, batch_size=[5]))
        expected = captum.attr.InputXGradient(policy.module).attribute((obs.clone(), goal.clone()), target=0)
        assert relative_error(td["attribution", "obs"], expected[0]) <= 1e-8
        assert relative_error(td["attribution", "goal"], expected[1]) <= 1e-8

    @pytest.mark.parametrize("seed", range(4))
    @pytest.mark.parametrize("batch", [(5,), (2, 3)])
    def test_random_mlps(self, seed, batch):
        net = random_mlp(seed)
        x = torch.randn(*batch, 5, dtype=torch.float64)
        td = InputXGradient(net, in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=batch))
        fx = flat(x, len(batch))
        expected = captum.attr.InputXGradient(net).attribute(fx.clone(), target=net(fx).argmax(-1))
        assert relative_error(td["attribution", "x"].reshape(fx.shape), expected) <= 1e-8
