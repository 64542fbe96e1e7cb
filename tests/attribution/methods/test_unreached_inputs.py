"""An explained input that does not reach the target through the gradient: refused by name, by LRP and by every
gradient method alike.

The model ignores the input, or cuts its path to the target (``detach()``, ``.item()``, a conversion to integers):
its gradient is zero everywhere, whatever the input's effect on the output, so a gradient attribution of zeros would
be an artefact of the cut, not an answer. LRP and the gradient methods raise a ``ValueError`` naming the target, the
input and why; the perturbation methods evaluate the model, see the paths the gradient does not, and give the
input's effect (zero where the model ignores it).
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import LRP, EpsilonPlus
from tests.attribution._helpers import assert_unchanged, state_snapshot
from tests.attribution.methods.test_base import REFERENCES, make

F64 = torch.float64


class CutPath(nn.Module):
    """``a(x) + b(z')``, where ``z'`` is ``z`` with its path to the output cut as ``how`` says."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.how = nn.Linear(5, 3), nn.Linear(2, 3), how

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if self.how == "ignored":
            cut = torch.zeros_like(z)
        elif self.how == "detached":
            cut = z.detach()
        elif self.how == "item":
            cut = z.new_tensor([[value.item() for value in row] for row in z])
        else:  # integers: rounding through an integer dtype
            cut = (z * 4).round().long().to(z.dtype) / 4
        return self.a(x) + self.b(cut)


WAYS = ("ignored", "detached", "item", "integer")
GRADIENT_METHODS = ("Saliency", "InputXGradient", "GuidedBackprop", "IntegratedGradients", "SmoothGrad", "GradientShap")


def inputs() -> TensorDict:
    draws = torch.Generator().manual_seed(1)
    x, z = torch.randn(1, 5, dtype=F64, generator=draws), torch.randn(1, 2, dtype=F64, generator=draws)
    return TensorDict(x=x, z=z, batch_size=[1])


def refused(wrapper, model: nn.Module, name: str) -> None:
    td = inputs()
    before, snapshot = dict(td.items()), state_snapshot(model)
    with pytest.raises(ValueError, match=f"{name}: target 'y' does not depend on the explained input 'z' through"):
        wrapper(td)
    assert dict(td.items()).keys() == before.keys() and all(td[k] is v for k, v in before.items())
    assert_unchanged(model, snapshot)


@pytest.mark.parametrize("how", WAYS)
@pytest.mark.parametrize("name", GRADIENT_METHODS)
def test_a_gradient_method_refuses_an_input_cut_from_the_target_as_lrp_does(name: str, how: str):
    model = CutPath(how).to(F64)
    policy = TensorDictModule(model, in_keys=["x", "z"], out_keys=["y"])
    references = {"x": REFERENCES["x"], "z": REFERENCES["goal"]}  # GradientShap's: two samples of each shape
    refused(make(name, policy, **({"baselines": references} if name == "GradientShap" else {})), model, name)
    refused(LRP(policy, EpsilonPlus()), model, "LRP")


@pytest.mark.parametrize("how", ["ignored", "detached"])
def test_a_perturbation_method_gives_the_effect_of_an_input_cut_from_the_gradient(how: str):
    """Feature ablation (``z`` set to zero as one group) of a model linear in ``z``: ``sum_j b.weight[t, j] * z_j`` on
    every element where the model reads ``z`` (through a detached path), zero where it ignores it."""
    model = CutPath(how).to(F64)
    policy = TensorDictModule(model, in_keys=["x", "z"], out_keys=["y"])
    td = inputs()
    target = int(model(td["x"], td["z"]).argmax(-1))
    attribution = make("FeatureAblation", policy)(td.clone())["attribution", "z"]
    effect = (model.b.weight[target].detach() * td["z"]).sum(-1, keepdim=True).expand_as(td["z"])
    expected = effect if how == "detached" else torch.zeros_like(td["z"])
    torch.testing.assert_close(attribution, expected, rtol=1e-12, atol=1e-12)


class GatedPath(nn.Module):
    """``a(x)``, plus ``b(z)`` where the sum of the whole pass's ``x`` goes past ``threshold`` (a branch of the model's
    own code): ``z`` reaches the output in some passes and not in others. ``taken`` counts the passes reading ``z``."""

    def __init__(self, threshold: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.threshold, self.taken = nn.Linear(5, 3), nn.Linear(2, 3), threshold, 0

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if float(x.detach().sum()) > self.threshold:
            self.taken += 1
            return self.a(x) + self.b(z)
        return self.a(x)


def test_integrated_gradients_takes_an_input_reached_at_some_points_of_the_path_only():
    """Baseline zero, one point per pass, ``z`` read where ``alpha * sum(x) > sum(x) / 2``: the points past the
    middle, which carry half of Gauss-Legendre's weights for an even number of points. ``b`` is linear: the
    attribution of ``z`` is ``b.weight[t] * z / 2``, and no pass's lack of a path refuses it."""
    from tdhook.attribution import IntegratedGradients

    td = inputs()
    td["x"] = td["x"].abs()  # a positive sum
    model = GatedPath(0.5 * float(td["x"].sum())).to(F64)
    policy = TensorDictModule(model, in_keys=["x", "z"], out_keys=["y"])
    method = IntegratedGradients(policy, target=1, n_steps=8, internal_batch_size=1)
    attribution = method(td.clone())["attribution", "z"]
    expected = model.b.weight[1].detach() * td["z"] / 2
    torch.testing.assert_close(attribution, expected, rtol=1e-12, atol=1e-12)


def test_smooth_grad_takes_an_input_reached_in_some_noisy_copies_only():
    """``x`` zero and noised, ``z`` not noised, one copy per pass; ``z`` read where the noisy ``x``'s sum goes past 0.5:
    the gradient of the target in ``z`` is ``b.weight[t]`` in the passes that read it, zero in the others, so the
    mean is ``b.weight[t]`` times the share of the copies that read it."""
    from tdhook.attribution import SmoothGrad

    td = inputs()
    td["x"] = torch.zeros_like(td["x"])
    model = GatedPath(0.5).to(F64)
    policy = TensorDictModule(model, in_keys=["x", "z"], out_keys=["y"])
    n = 16
    method = SmoothGrad(policy, target=1, n_samples=n, stdev={"x": 1.0, "z": 0.0}, seed=0, internal_batch_size=1)
    attribution = method(td.clone())["attribution", "z"]
    assert 0 < model.taken < n  # some copies read z, some do not
    expected = model.b.weight[1].detach().expand_as(td["z"]) * model.taken / n
    torch.testing.assert_close(attribution, expected, rtol=1e-12, atol=1e-12)
