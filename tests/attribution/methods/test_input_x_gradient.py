"""Input × gradient against captum's InputXGradient in float64."""

from __future__ import annotations

import captum.attr
import pytest
import torch
from tensordict import TensorDict

from tdhook.attribution import InputXGradient
from tests.attribution.methods._models import assert_random_mlp_matches, assert_two_key_policy_matches, small_cnn
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
        assert_two_key_policy_matches(InputXGradient, captum.attr.InputXGradient, target=0)

    @pytest.mark.parametrize("seed", range(4))
    @pytest.mark.parametrize("batch", [(5,), (2, 3)])
    def test_random_mlps(self, seed, batch):
        assert_random_mlp_matches(InputXGradient, captum.attr.InputXGradient, seed, batch)
