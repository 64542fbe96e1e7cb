"""TorchScript modules inside an explained model: refused by name, the model left as it was."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.rules import AttnLRP, EpsilonPlus, EpsilonRule
from tests.attribution._helpers import assert_unchanged, mlp, state_snapshot

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.*` is deprecated:FutureWarning")

MAPPERS = {
    "default": lambda: None,
    "EpsilonPlus": EpsilonPlus,
    "AttnLRP": AttnLRP,
    "callable": lambda: lambda name, module: EpsilonRule(epsilon=0.0) if isinstance(module, nn.Linear) else None,
}


def with_scripted_layer(how: str) -> nn.Sequential:
    net = mlp()
    x = torch.randn(1, 16, dtype=torch.float64)
    net[2] = torch.jit.script(net[2]) if how == "script" else torch.jit.trace(net[2], x)
    return net


@pytest.mark.parametrize("mapper", sorted(MAPPERS))
@pytest.mark.parametrize("how", ["script", "trace"])
def test_a_scripted_layer_is_refused_by_name_and_the_model_left_as_it_was(how: str, mapper: str):
    # TorchScript runs neither forward hooks nor function modes inside it: no rule can act there. Mappers used to
    # fail with an AttributeError of torch's, and a callable mapper left the first call's watch hooks on the model.
    net = with_scripted_layer(how)
    before = state_snapshot(net)
    x = torch.randn(3, 5, dtype=torch.float64)
    td = TensorDict(x=x, batch_size=[3])
    lrp = LRP(net, MAPPERS[mapper](), in_keys=["x"], out_keys=["y"])
    with pytest.raises(TypeError, match=r"module '2' \(Linear compiled by torch\.jit\) is a TorchScript module"):
        lrp(td)
    assert_unchanged(net, before)
    assert list(td.keys()) == ["x"]


def test_a_scripted_model_is_refused_by_name():
    net = torch.jit.script(mlp())
    lrp = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
    with pytest.raises(TypeError, match=r"module 'the model itself' \(Sequential compiled by torch\.jit\)"):
        lrp(TensorDict(x=torch.randn(3, 5, dtype=torch.float64), batch_size=[3]))
