"""What LRP, the other methods and the metrics wrap: a TensorDict module, or a plain ``nn.Module`` with its keys;
anything else is refused naming the caller and what it takes."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import LRP, Saliency
from tdhook.metrics import pixel_flipping


def lrp(module, **keys):
    return LRP(module, **keys)


def saliency(module, **keys):
    return Saliency(module, **keys)


def metric(module, **keys):
    td = TensorDict(x=torch.ones(2, 4), attribution=TensorDict(x=torch.ones(2, 4)), batch_size=[2])
    return pixel_flipping(module, td, **keys)


@pytest.mark.parametrize(("call", "owner"), [(lrp, "LRP"), (saliency, "Saliency"), (metric, "metrics")])
def test_something_that_is_no_module_is_named(call, owner):
    with pytest.raises(TypeError, match=rf"^{owner} wraps a TensorDictModuleBase or an nn.Module, got function"):
        call(lambda x: x, in_keys=["x"], out_keys=["y"])


@pytest.mark.parametrize(("call", "owner"), [(lrp, "LRP"), (saliency, "Saliency"), (metric, "metrics")])
def test_out_keys_given_to_a_tensordict_module_are_named(call, owner):
    module = TensorDictModule(nn.Linear(4, 2), in_keys=["x"], out_keys=["y"])
    with pytest.raises(TypeError, match=rf"^{owner}: out_keys is only for a plain nn.Module"):
        call(module, out_keys=["z"])
    td = TensorDict(x=torch.ones(2, 4), batch_size=[2])
    assert module(td)["y"].shape == (2, 2) and module.out_keys == ["y"]
