"""Modules put into the model, replaced or taken out in an open LRP context: followed (see _model_changes)."""

from __future__ import annotations

import copy

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torch.nn.utils import parametrizations, prune

from tdhook.attribution import LRP, EpsilonPlus, EpsilonPlusFlat, UniformEpsilon
from tests.conftest import relative_error

F64 = torch.float64


def cnn() -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 6, 3, padding=1, stride=2),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(24, 5),
    )
    return net.to(F64).eval()


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3)).to(F64)


def fresh(net: nn.Module, mapper, x: torch.Tensor) -> torch.Tensor:
    return LRP(net, mapper, in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=x.shape[:1]))["relevance", "x"]


def negated_copy(layer: nn.Module) -> nn.Module:
    other = copy.deepcopy(layer)
    with torch.no_grad():
        other.weight.neg_()
    return other


CASES = {
    # Explained with the new layer (its weight negated) left to its plain gradient, the CNN was 118 % off (relative
    # L2) the changed model explained in a context entered after the change, the MLP 57 % off.
    "cnn": (cnn, EpsilonPlus, (2, 3, 8, 8)),
    "mlp": (mlp, UniformEpsilon, (4, 5)),
}


def no_hooks(net: nn.Module) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in net.modules())


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_module_replaced_in_an_open_context_gets_its_rule(case: str):
    make, mapper, shape = CASES[case]
    net = make()
    x = torch.randn(*shape, dtype=F64)
    lrp = LRP(net, mapper(), in_keys=["x"], out_keys=["y"])
    old = net[2]
    with lrp:
        lrp(TensorDict(x=x, batch_size=shape[:1]))
        lrp(TensorDict(x=x, batch_size=shape[:1]))  # a later call, on a plan where the model allows one
        net[2] = negated_copy(net[2])
        td = TensorDict(x=x, batch_size=shape[:1])
        got = [lrp(td)["relevance", "x"] for _ in range(2)]
        assert no_hooks(old)  # the module taken out keeps nothing of the context
    assert no_hooks(net)
    expected = fresh(net, mapper(), x)
    assert all(torch.equal(one, expected) for one in got)


def test_a_module_put_in_or_taken_out_is_followed():
    net, x = mlp(), torch.randn(4, 5, dtype=F64)
    lrp = LRP(net, UniformEpsilon(), in_keys=["x"], out_keys=["y"])
    with lrp:
        lrp(TensorDict(x=x, batch_size=[4]))
        net.append(nn.ReLU()).append(nn.Linear(3, 2).to(F64))
        put_in = lrp(TensorDict(x=x, batch_size=[4]))["relevance", "x"]
        assert torch.equal(put_in, fresh(copy.deepcopy(net), UniformEpsilon(), x))
        del net[5:]
        taken_out = lrp(TensorDict(x=x, batch_size=[4]))["relevance", "x"]
        assert torch.equal(taken_out, fresh(copy.deepcopy(net), UniformEpsilon(), x))
    assert no_hooks(net)


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")
@pytest.mark.parametrize("how", ["weight_norm", "spectral_norm", "legacy weight_norm", "prune"])
def test_a_layer_parametrized_in_an_open_context_is_no_change(how: str):
    # The modules of a parametrization compute a layer's weight, which its rule reads at every call.
    net, x = cnn(), torch.randn(2, 3, 8, 8, dtype=F64)
    lrp = LRP(net, EpsilonPlusFlat(), in_keys=["x"], out_keys=["y"])
    with lrp:
        lrp(TensorDict(x=x, batch_size=[2]))
        if how == "weight_norm":
            parametrizations.weight_norm(net[2])
        elif how == "spectral_norm":
            parametrizations.spectral_norm(net[2]).eval()
        elif how == "legacy weight_norm":
            torch.nn.utils.weight_norm(net[2])
        else:
            prune.l1_unstructured(net[2], "weight", 0.5)
        got = lrp(TensorDict(x=x, batch_size=[2]))["relevance", "x"]
        if how == "weight_norm":  # and taken off again
            assert relative_error(got, fresh(copy.deepcopy(net), EpsilonPlusFlat(), x)) < 1e-12
            torch.nn.utils.parametrize.remove_parametrizations(net[2], "weight")
            got = lrp(TensorDict(x=x, batch_size=[2]))["relevance", "x"]
    assert relative_error(got, fresh(net, EpsilonPlusFlat(), x)) < 1e-12


def test_a_first_layer_moved_into_the_wrapper_is_followed():
    # The wrapper's own module gains the model's first layer as the model loses it: every module's children, in a
    # row, read as before (the buffer holders' check, which stands for the context's, sees no change), but the
    # model's own children differ: the context is entered again.
    net = nn.Sequential(nn.Linear(5, 5), nn.ReLU(), nn.Linear(5, 3)).to(F64)
    x = torch.randn(4, 5, dtype=F64)
    lrp = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
    with lrp:
        lrp(TensorDict(x=x, batch_size=[4]))
        lrp(TensorDict(x=x, batch_size=[4]))
        handles = lrp._handles
        lrp.module.extra = net[0]
        del net[0]
        got = lrp(TensorDict(x=x, batch_size=[4]))["relevance", "x"]
        assert lrp._handles is not handles
    assert torch.equal(got, fresh(copy.deepcopy(net), EpsilonPlus(), x))
    assert no_hooks(net)


def _policy(net: nn.Module) -> TensorDictModule:
    return TensorDictModule(net, in_keys=["x"], out_keys=["y"])


def _other_mlp() -> nn.Sequential:
    return nn.Sequential(*(negated_copy(m) if isinstance(m, nn.Linear) else m for m in mlp()))


GIVEN = {
    # The chain plan ran the old policy (outputs and relevance), the general path the new one without rules.
    "another policy": lambda lrp: setattr(lrp, "module", _policy(_other_mlp())),
    "another plain model": lambda lrp: setattr(lrp.module, "module", _other_mlp()),
    "another rule mapper": lambda lrp: setattr(lrp, "rule_mapper", UniformEpsilon(epsilon=0.5)),
    "the mapper built anew": lambda lrp: lrp.rule_mapper.set_kwargs(epsilon=0.5),
}


@pytest.mark.parametrize("change", sorted(GIVEN))
def test_a_model_or_mapper_given_to_the_wrapper_in_an_open_context_is_followed(change: str):
    """The wrapper's model, or the rule mapper, replaced inside the context (or the mapper built anew by its
    ``set_kwargs``): later calls kept the rules and the plan of the old ones, with no word."""
    x = torch.randn(4, 5, dtype=F64)
    plain = change == "another plain model"
    options = {"in_keys": ["x"], "out_keys": ["y"]} if plain else {}
    lrp = LRP(mlp() if plain else _policy(mlp()), UniformEpsilon(), **options)
    with lrp:
        for _ in range(2):  # the second call runs the chain's plan
            lrp(TensorDict(x=x, batch_size=[4]))
        old = lrp.module.module if plain else lrp.module
        GIVEN[change](lrp)
        got = [lrp(TensorDict(x=x, batch_size=[4])) for _ in range(2)]
        assert no_hooks(old) == ("mapper" not in change)  # a model given before keeps nothing of the context
    model = copy.deepcopy(lrp.module.module if plain else lrp.module)
    expected = LRP(model, lrp.rule_mapper, **options)(TensorDict(x=x, batch_size=[4]))
    for one in got:
        for key in ("y", ("relevance", "x")):
            torch.testing.assert_close(one[key], expected[key], rtol=1e-12, atol=1e-12)
