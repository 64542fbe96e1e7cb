"""A hook registration of a method's call that fails: the model and the caller's TensorDict come out as before.

The failure (an interrupt or an error) is made to arrive at the k-th hook registration of a call, for every k,
before torch puts the hook into its dict, or after it (the handle never comes back: a registration that fails once
the hook is in, or an interrupt before the method lists the handle). The model then holds no hook of the call, the
TensorDict holds what it held, and the next call gives a fresh method's attribution.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import GradCAM, GuidedBackprop, IntegratedGradients, Saliency
from tests.attribution._helpers import small_bn_cnn
from tests.attribution.test_lrp_interrupts import global_state, module_state
from tests.attribution.test_lrp_registration_faults import fail_each_registration

F64 = torch.float64

METHODS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "Saliency": lambda model: Saliency(model, in_keys=["x"], out_keys=["y"]),
    "GuidedBackprop": lambda model: GuidedBackprop(model, in_keys=["x"], out_keys=["y"]),
    "GradCAM": lambda model: GradCAM(model, layer="3", in_keys=["x"], out_keys=["y"]),
    "IntegratedGradients": lambda model: IntegratedGradients(model, in_keys=["x"], out_keys=["y"], n_steps=3),
}


def inputs() -> TensorDict:
    x = torch.randn(2, 3, 8, 8, dtype=F64, generator=torch.Generator().manual_seed(1))
    return TensorDict(x=x, batch_size=[2])


def attribution(out: TensorDict) -> dict:
    return {key: value for key, value in out.items(include_nested=True, leaves_only=True) if key[0] == "attribution"}


@pytest.mark.parametrize("after", [False, True], ids=["before insertion", "after insertion"])
@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("name", sorted(METHODS))
def test_a_failing_registration_during_a_call_leaves_model_and_tensordict_as_before(
    name: str, error: type, after: bool
):
    model = small_bn_cnn()
    expected = attribution(METHODS[name](model)(inputs()))
    method = METHODS[name](model)
    method(inputs())  # a wrapper's first call checks more than the later ones
    before, before_global = module_state(model), global_state()

    def next_call(where: str) -> None:
        actual = attribution(method(inputs()))
        assert actual.keys() == expected.keys(), where
        for key, value in expected.items():
            torch.testing.assert_close(actual[key], value, rtol=1e-10, atol=1e-12, msg=lambda m: f"{where} {key}: {m}")

    fail_each_registration(method, model, inputs, (before, before_global), next_call, error, after)
