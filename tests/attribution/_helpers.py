"""What the tests of the LRP wrapper and of its targets share: a small MLP, a small transformer encoder, a call, and
the model's state."""

from __future__ import annotations

import weakref

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.mappers.presets import EpsilonPlus


def with_statistics(model: nn.Module) -> nn.Module:
    """``model`` in float64 and eval mode, its BatchNorms given running statistics and affine parameters of their own
    (merged, they then change the layer they fold into)."""
    model = model.to(torch.float64)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            with torch.no_grad():
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
    return model.eval()


def small_bn_cnn() -> nn.Module:
    """Convolutions, one followed by a BatchNorm with statistics, and a Linear head, in float64 (seeded)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Conv2d(6, 4, 3, stride=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 3 * 3, 5),
    )
    return with_statistics(model)


def mlp(bias: bool = True) -> nn.Module:
    return nn.Sequential(
        nn.Linear(5, 16, bias=bias), nn.ReLU(), nn.Linear(16, 8, bias=bias), nn.ReLU(), nn.Linear(8, 3, bias=bias)
    ).double()


class Attending(nn.Module):
    """Two layers of torch's ``TransformerEncoder`` (its fast path runs without gradient) and a head on the last
    position."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x)[:, -1])


def explain(net: nn.Module, x: torch.Tensor, **kwargs) -> TensorDict:
    lrp = LRP(TensorDictModule(net, in_keys=["x"], out_keys=["y"]), **kwargs)
    return lrp(TensorDict(x=x, batch_size=x.shape[:1]))


def state_snapshot(model: nn.Module) -> dict:
    return {
        "tensors": {k: v.clone() for k, v in model.state_dict().items()},
        "objects": {k: v for k, v in model.named_parameters()},
        "hooks": [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)) for m in model.modules()],
        "patched": [("forward" in vars(m)) for m in model.modules()],
    }


def assert_unchanged(model: nn.Module, snapshot: dict) -> None:
    now = state_snapshot(model)
    assert now["tensors"].keys() == snapshot["tensors"].keys()
    for key, value in snapshot["tensors"].items():
        assert torch.equal(now["tensors"][key], value), key
    assert all(now["objects"][k] is v for k, v in snapshot["objects"].items())
    assert now["hooks"] == snapshot["hooks"]
    assert now["patched"] == snapshot["patched"]  # a forward in an instance's dict: only one of its own (TorchScript)


class ExpectsARefusal:
    """A call that raises leaves the model and the caller's TensorDict as they were."""

    def run_and_expect(self, td: TensorDict, error, match: str, **kwargs):
        net = mlp()
        snapshot = state_snapshot(net)
        before = {k: v for k, v in td.items(include_nested=True, leaves_only=True)}
        lrp = LRP(TensorDictModule(net, in_keys=["x"], out_keys=["y"]), rule_mapper=EpsilonPlus(), **kwargs)
        with pytest.raises(error, match=match):
            lrp(td)
        assert_unchanged(net, snapshot)
        after = {k: v for k, v in td.items(include_nested=True, leaves_only=True)}
        assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)


def gradient_times_input(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Gradient × input of each sample's largest output (LRP-0's relevance of the default target)."""
    leaf = x.clone().requires_grad_(True)
    out = model(leaf)
    start = torch.zeros_like(out).scatter_(-1, out.argmax(-1, keepdim=True), 1.0)
    (grad,) = torch.autograd.grad(out, leaf, start)
    return x * grad


class Recorded(nn.Module):
    """The identity, through a product of its own, keeping a weak reference to each output (an intermediate)."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 1.0
        self.outputs.append(weakref.ref(y))
        return y
