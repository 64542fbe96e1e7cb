"""Options that switch a method's result: anything but a bool is refused by name, as the truth of a string such as
``"False"`` would otherwise switch it silently."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tdhook.attribution import GradCAM, Saliency, SmoothGrad
from tests.attribution.methods._models import small_cnn


def _saliency(**kwargs):
    return Saliency(small_cnn(), in_keys=["image"], out_keys=["logits"], **kwargs)


def _smooth_grad(**kwargs):
    return SmoothGrad(small_cnn(), in_keys=["image"], out_keys=["logits"], stdev=0.0, n_samples=2, **kwargs)


def _grad_cam(**kwargs):
    return GradCAM(small_cnn(), layer="0", in_keys=["image"], out_keys=["logits"], **kwargs)


SWITCHES = [(_saliency, "abs"), (_smooth_grad, "abs"), (_grad_cam, "relu"), (_grad_cam, "upsample")]


@pytest.mark.parametrize("value", ["False", "True", 0, 1.0, None, torch.tensor(False)])
@pytest.mark.parametrize(("build", "name"), SWITCHES)
def test_a_switch_that_is_no_bool_is_refused_by_name(build, name, value):
    with pytest.raises(TypeError, match=rf"{name} must be True or False, got "):
        build(**{name: value})


@pytest.mark.parametrize(("build", "name"), SWITCHES)
def test_a_bool_switch_switches(build, name):
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))  # fixed input
    on = build(**{name: True})(TensorDict(image=x, batch_size=[2])).select("attribution")
    off = build(**{name: False})(TensorDict(image=x, batch_size=[2])).select("attribution")
    different_keys = set(on.keys(True, True)) != set(off.keys(True, True))
    assert different_keys or not all(torch.equal(on[key], off[key]) for key in on.keys(True, True))
