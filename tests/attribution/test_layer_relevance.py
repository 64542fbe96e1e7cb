"""Relevance at inner modules (``layers``) where the layer after them sets its input's relevance directly.

Flat, w² and z^B set the relevance of the first layer's input, zero entries included, and the gradient carries
only ``x · grad`` of it. The output of the module before that layer (a ``Flatten``, a normaliser, an ``Identity``)
is that input: its relevance is the layer's whole input relevance, which the rest of the model, explained on that
tensor as its input, gives too.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.rules import EpsilonGammaBox, EpsilonPlus, EpsilonPlusFlat, WSquareRule
from tests.conftest import relative_error

F64 = torch.float64


class Normaliser(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - 0.5) / 2.0


def mlp_on_images() -> nn.Sequential:
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 6), nn.ReLU(), nn.Linear(6, 3))


def cnn(glue: nn.Module) -> nn.Sequential:
    return nn.Sequential(glue, nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(48, 3))


MODELS = {
    "flatten-mlp": (mlp_on_images, (4, 1, 4, 4)),
    "identity-cnn": (lambda: cnn(nn.Identity()), (4, 2, 4, 4)),
    "normaliser-cnn": (lambda: cnn(Normaliser()), (4, 2, 4, 4)),
}
PRESETS = {
    "EpsilonPlusFlat": lambda first: EpsilonPlusFlat(),
    "w2": lambda first: EpsilonPlus(rule_mapper={first: WSquareRule()}),
    "EpsilonGammaBox": lambda first: EpsilonGammaBox(-3.0, 3.0),
}


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_the_module_before_a_first_layer_gets_its_whole_input_relevance(model_name: str, preset: str):
    make, shape = MODELS[model_name]
    torch.manual_seed(0)
    model = make().to(F64).eval()
    x = torch.randn(shape, dtype=F64).clamp(-3, 3)
    x[x.abs() < 0.6] = 0.5 if model_name == "normaliser-cnn" else 0.0  # zero entries of the first layer's input
    td = TensorDict(x=x, batch_size=[shape[0]])
    with torch.no_grad():
        target = model(x).argmax(-1)
    lrp = LRP(model, PRESETS[preset]("1"), in_keys=["x"], out_keys=["y"], target=target, layers=["0"])
    ours = lrp(td)["relevance", "0"]
    # The oracle: the layers after the module, explained on its output as their input (the same rules).
    rest = nn.Sequential(*model[1:])
    given = TensorDict(x=model[0](x), batch_size=[shape[0]])
    expected = LRP(rest, PRESETS[preset]("0"), in_keys=["x"], out_keys=["y"], target=target)(given)["relevance", "x"]
    assert relative_error(ours, expected) <= 1e-12


@pytest.mark.parametrize("preset", ["EpsilonPlusFlat", "w2"])  # first-layer rules of a Linear layer
def test_modules_that_return_one_tensor_each_get_its_whole_relevance(preset: str):
    # An Identity, a Dropout in eval mode or a Flatten of a flat input returns its input itself: every module named
    # in layers whose output is that tensor gets the relevance the first layer sets there, not only the first one
    # read (the others had none of it: 100 % off where the gradient carries none).
    torch.manual_seed(0)
    glue = [nn.Tanh(), nn.Identity(), nn.Dropout(0.2), nn.Flatten()]
    model = nn.Sequential(*glue, nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)).to(F64).eval()
    x = torch.randn(4, 6, dtype=F64)
    x[x.abs() < 0.6] = 0.0  # zero entries of the first layer's input
    with torch.no_grad():
        target = model(x).argmax(-1)
    names = [str(i) for i in range(len(glue))]
    lrp = LRP(model, PRESETS[preset]("4"), in_keys=["x"], out_keys=["y"], target=target, layers=names)
    td = lrp(TensorDict(x=x, batch_size=[4]))
    rest = nn.Sequential(*model[len(glue) :])
    given = TensorDict(x=torch.tanh(x), batch_size=[4])
    expected = LRP(rest, PRESETS[preset]("0"), in_keys=["x"], out_keys=["y"], target=target)(given)["relevance", "x"]
    for name in names:
        assert relative_error(td["relevance", name], expected) <= 1e-12, name
