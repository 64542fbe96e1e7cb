"""The modified parameter sets a context holds: built at their first read, shared where equal by construction.

The copies are counted as the distinct storages of live tensors shaped like each layer's weight (found through the
garbage collector, whatever holds them), and the relevance is checked against zennit on the same model."""

from __future__ import annotations

import gc

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from zennit import composites as zcomposites
from zennit.canonizers import SequentialMergeBatchNorm

from tdhook.attribution import LRP
from tdhook.attribution.mappers.presets import EpsilonAlpha2Beta1, EpsilonGammaBox
from tdhook.attribution.rules.modified import AlphaBetaRule, GammaRule
from tests.attribution._helpers import with_statistics
from tests.conftest import relative_error, zennit_model_relevance

F64 = torch.float64


def conv_bn_net() -> nn.Sequential:
    """A first convolution (z^B), a γ convolution merged with its BatchNorm, a γ convolution on its own, each
    followed by a ReLU, and a Linear head; float64, weights of distinct shapes, BatchNorm with statistics (``eps=0``:
    zennit's merge then computes the same function)."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 6, 3, padding=1),
        nn.BatchNorm2d(6, eps=0.0),
        nn.ReLU(),
        nn.Conv2d(6, 5, 3, stride=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(5 * 3 * 3, 3),
    )
    return with_statistics(net)


def weight_storages(net: nn.Module) -> dict[str, set[int]]:
    """For each convolution, the storages of live float64 tensors shaped like its weight, the weight's own left out.
    Tensors without a shape or a storage to read (the fake tensors of a trace, the uninitialised parameters of a lazy
    layer, that another test of the process left alive) are no copies."""
    gc.collect()
    own = {p.untyped_storage().data_ptr() for p in net.parameters()}
    shapes = {tuple(m.weight.shape): name for name, m in net.named_modules() if isinstance(m, nn.Conv2d)}
    storages: dict[str, set[int]] = {name: set() for name in shapes.values()}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):
            continue
        try:
            if obj.is_meta or tuple(obj.shape) not in shapes or obj.dtype != F64:
                continue
            ptr = obj.untyped_storage().data_ptr()
        except (RuntimeError, ValueError, NotImplementedError):
            continue
        if ptr not in own:
            storages[shapes[tuple(obj.shape)]].add(ptr)
    return storages


def weight_copies(net: nn.Module, before: dict[str, set[int]]) -> dict[str, int]:
    """For each convolution, the number of storages shaped like its weight that were not alive at ``before`` (what
    other tests of the process left alive is no copy of this context's)."""
    return {name: len(ptrs - before[name]) for name, ptrs in weight_storages(net).items()}


def test_a_context_holds_the_sets_its_calls_read_and_one_tensor_for_equal_weights():
    net = conv_bn_net()
    x = torch.randn(2, 3, 8, 8, dtype=F64)
    lrp = LRP(TensorDictModule(net, in_keys=["x"], out_keys=["y"]), rule_mapper=EpsilonGammaBox(-3.0, 3.0))
    before = weight_storages(net)
    with lrp:
        relevance = lrp(TensorDict(x=x.clone(), batch_size=[2]))["relevance", "x"]
        copies = weight_copies(net, before)
    # Each layer keeps one copy of its own values (HeldParameters: a write through ``.data`` is seen by them).
    # The γ layer merged with its BatchNorm: that copy, the merged weight, and its γ sets built from the merged
    # weight, of which a call followed by a ReLU reads two (γ W⁺ for z^↑ = z + D, and W^γ⁺ for the transposed
    # product): 4 (12 when every set was built, the layer's own sets too, and ``up_nobias`` held apart from ``up``).
    assert copies["2"] == 4, copies
    # The γ layer on its own: its copy and the same two sets; its plain weight is its own (3, before 6).
    assert copies["5"] == 3, copies
    # z^B on the first layer reads W⁺ and W⁻ (its ``orig`` set is the layer's weight itself): 3.
    assert copies["0"] == 3, copies
    expected = zennit_model_relevance(
        zcomposites.EpsilonGammaBox(low=-3.0, high=3.0), net, x, canonizers=[SequentialMergeBatchNorm()]
    )
    assert relative_error(relevance, expected) <= 1e-10


def test_sets_without_bias_share_the_weight_of_their_set_and_equal_the_chained_modifiers():
    """``pos_nobias`` is ``pos`` with a zero bias: the same weight tensor, bit for bit what chaining the modifier
    with a zeroed bias builds."""
    layer = nn.Conv2d(3, 4, 3).to(F64)
    params = {name: p.detach() for name, p in layer.named_parameters()}
    sets = AlphaBetaRule(alpha=2.0, beta=1.0).modified_params(params)
    assert sets["pos_nobias"]["weight"] is sets["pos"]["weight"]
    assert sets["neg_nobias"]["weight"] is sets["neg"]["weight"]
    torch.testing.assert_close(sets["pos"]["weight"], params["weight"].clamp(min=0), rtol=0, atol=0)
    torch.testing.assert_close(sets["neg_nobias"]["bias"], torch.zeros(4, dtype=F64), rtol=0, atol=0)
    gamma = GammaRule(gamma=0.5).modified_params(params)
    assert gamma["down_nobias"]["weight"] is gamma["down"]["weight"]
    w = params["weight"]
    torch.testing.assert_close(gamma["down"]["weight"], w + 0.5 * w.clamp(max=0), rtol=0, atol=0)
    torch.testing.assert_close(gamma["up_nobias"]["bias"], torch.zeros(4, dtype=F64), rtol=0, atol=0)


@pytest.mark.parametrize("through_data", [False, True], ids=["in_place", "through_data"])
@pytest.mark.parametrize("preset", ["EpsilonGammaBox", "EpsilonAlpha2Beta1"])
def test_a_layer_written_in_place_between_its_call_and_the_relevance_pass_is_refused(preset: str, through_data: bool):
    """A set built in the relevance pass from the layer's own parameters would read values written after the layer
    ran: the call fails, naming the rule and the layer, instead of mixing two sets of weights. A write through
    ``.data`` (no version counter sees it) is refused too: the relevance was 0.62 off with it, silently."""
    net = conv_bn_net()
    head = net[8]

    def write(module, args, output):
        with torch.no_grad():
            (net[5].weight.data if through_data else net[5].weight).mul_(2.0)

    head.register_forward_hook(write)
    mapper = EpsilonGammaBox(-3.0, 3.0) if preset == "EpsilonGammaBox" else EpsilonAlpha2Beta1()
    lrp = LRP(TensorDictModule(net, in_keys=["x"], out_keys=["y"]), rule_mapper=mapper)
    with pytest.raises(RuntimeError, match=r"(GammaRule|AlphaBetaRule) on Conv2d: the layer's parameters were writ"):
        lrp(TensorDict(x=torch.randn(2, 3, 8, 8, dtype=F64), batch_size=[2]))
