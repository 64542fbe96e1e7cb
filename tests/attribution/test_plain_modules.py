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


@pytest.mark.parametrize(("call", "owner"), [(lrp, "LRP"), (saliency, "Saliency"), (metric, "metrics")])
@pytest.mark.parametrize("in_keys", [[("x", 0)], [["x"]], [3]], ids=["tuple-with-int", "list", "int"])
def test_in_keys_that_are_no_keys_are_named(call, owner, in_keys):
    """``("x", 0)`` was read as ``"x"`` (tensordict drops a number inside a tuple), and a list failed with
    tensordict's ``key should be a Sequence<NestedKey>``."""
    module = TensorDictModule(nn.Linear(4, 2), in_keys=["x"], out_keys=["y"])
    with pytest.raises(TypeError, match=rf"^{owner}: in_keys must hold keys \(a str or a tuple of str\), got "):
        call(module, in_keys=in_keys)


@pytest.mark.parametrize("in_keys", ["x", ["x"], [("x",)], [(("x",),)]], ids=["str", "list", "tuple", "nested-tuple"])
def test_in_keys_written_in_any_form_of_one_key_explain_it(in_keys):
    torch.manual_seed(0)
    module = TensorDictModule(nn.Linear(4, 2).double(), in_keys=["x"], out_keys=["y"])
    td = TensorDict(x=torch.randn(3, 4, dtype=torch.float64), batch_size=[3])
    expected = LRP(module)(td.clone())["relevance", "x"]
    assert torch.equal(LRP(module, in_keys=in_keys)(td.clone())["relevance", "x"], expected)
