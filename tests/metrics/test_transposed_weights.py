"""The kept transpose of a layer's weights is used only while the weights are bit for bit those it came from."""

from __future__ import annotations

import gc

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.metrics import _transposed_weights, pixel_flipping
from tdhook.metrics._transposed_weights import transposed


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_transpose_is_kept_while_the_weights_stay_the_same(dtype):
    layer = nn.Linear(5, 3).to(dtype)
    rows = transposed(layer.weight)
    assert torch.equal(rows, layer.weight.t()) and rows.is_contiguous() and not rows.requires_grad
    assert transposed(layer.weight) is rows
    assert transposed(nn.Linear(5, 3).to(dtype).weight) is not rows  # another layer


@pytest.mark.parametrize(
    "change",
    [
        lambda w: w.data.copy_(torch.randn_like(w)),  # no new version
        lambda w: w.data.__setitem__((0, 0), -w.data[0, 0]),
        lambda w: w.data.__setitem__((2, 4), -0.0 if w.data[2, 4] == 0.0 else 0.0),
        lambda w: w.data.__setitem__((1, 1), float("nan")),
    ],
)
def test_weights_changed_in_any_way_get_their_own_transpose(change):
    layer = nn.Linear(5, 3)
    with torch.no_grad():
        layer.weight[2, 4] = 0.0
    kept = transposed(layer.weight)
    change(layer.weight)
    rows = transposed(layer.weight)
    assert rows is not kept
    assert torch.equal(rows.view(torch.int32), layer.weight.detach().t().contiguous().view(torch.int32))


def test_large_layers_are_not_kept_and_a_layer_gone_takes_its_transpose_with_it():
    big = nn.Linear(1100, 1000, bias=False)  # above 2**20 weights
    assert transposed(big.weight) is not transposed(big.weight)
    layer = nn.Linear(5, 3)
    transposed(layer.weight)
    assert len(_transposed_weights._kept) == 1
    del layer
    gc.collect()
    assert _transposed_weights._kept == []


def test_a_curve_after_the_weights_changed_in_place_uses_the_new_weights():
    """``weight.data.copy_`` leaves the version counter as it was: a cache keyed on it would use the old weights."""
    torch.manual_seed(15)
    net = nn.Sequential(nn.Flatten(), nn.Linear(12, 6), nn.ReLU(), nn.Linear(6, 2)).double()
    x, a = torch.randn(3, 3, 2, 2, dtype=torch.float64), torch.randn(3, 3, 2, 2, dtype=torch.float64)
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[3])
    kwargs = dict(in_keys=["x"], out_keys=["y"], features_per_step=2, target=0)
    before = pixel_flipping(net, td, **kwargs)
    with torch.no_grad():
        net[1].weight.data.copy_(torch.randn(6, 12, dtype=torch.float64))
    after = pixel_flipping(net, td, **kwargs)
    direct = net.register_forward_pre_hook(lambda module, args: None)  # every perturbed input through the model
    expected = pixel_flipping(net, td, **kwargs)
    direct.remove()
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, expected, rtol=0, atol=1e-12)
