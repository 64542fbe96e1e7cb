"""Saliency against captum's Saliency in float64, on a small CNN, a two-key policy and random MLPs."""

from __future__ import annotations

import captum.attr
import pytest
import torch
from tensordict import TensorDict

from tdhook.attribution import Saliency
from tests.attribution.methods._models import (
    assert_random_mlp_matches,
    assert_two_key_policy_matches,
    random_mlp,
    small_cnn,
)
from tests.conftest import relative_error

pytestmark = pytest.mark.filterwarnings("ignore:Input Tensor .* did not already require gradients:UserWarning")


class TestAgainstCaptum:
    @pytest.mark.parametrize("abs_", [True, False])
    @pytest.mark.parametrize("target", [None, 3, "tensor"])
    def test_small_cnn(self, abs_, target):
        net = small_cnn()
        x = torch.randn(6, 3, 8, 8, dtype=torch.float64)
        if target == "tensor":
            target = torch.tensor([0, 1, 2, 3, 4, 0])
        td = Saliency(net, in_keys=["image"], out_keys=["logits"], target=target, abs=abs_)(
            TensorDict(image=x, batch_size=[6])
        )
        captum_target = net(x).argmax(-1) if target is None else target
        expected = captum.attr.Saliency(net).attribute(x.clone(), target=captum_target, abs=abs_)
        assert relative_error(td["attribution", "image"], expected) <= 1e-8

    def test_two_key_policy(self):
        assert_two_key_policy_matches(Saliency, captum.attr.Saliency, target=1, abs=False)

    @pytest.mark.parametrize("seed", range(4))
    @pytest.mark.parametrize("batch", [(5,), (2, 3)])
    def test_random_mlps(self, seed, batch):
        assert_random_mlp_matches(Saliency, captum.attr.Saliency, seed, batch)

    def test_abs_changes_the_result(self):
        net = random_mlp(0)
        x = torch.randn(8, 5, dtype=torch.float64)
        signed = Saliency(net, in_keys=["x"], out_keys=["y"], abs=False)(TensorDict(x=x, batch_size=[8]))
        assert (signed["attribution", "x"] < 0).any()
