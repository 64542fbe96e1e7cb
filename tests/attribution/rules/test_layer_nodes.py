"""The first-layer walks stop at layers without a rule: nn.RNN, nn.Bilinear, a weight product of one's own."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP, EpsilonPlus, EpsilonPlusFlat
from tdhook.attribution.rules import FlatRule
from tdhook.attribution.rules._layer_nodes import is_layer_node


class OwnConv(nn.Module):
    """A convolution of one's own: ``F.conv1d`` with its own weight."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3, 2))

    def forward(self, x):
        return F.conv1d(x.transpose(1, 2), self.weight).relu().flatten(1)


class OwnLinear(nn.Module):
    """A dense layer of one's own: ``F.linear`` with its own weight (put through a weight norm)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3))

    def forward(self, x):
        return F.linear(x[:, -1], self.weight / self.weight.norm()).relu()


class Bilinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.bilinear = nn.Bilinear(3, 3, 4)

    def forward(self, x):
        return self.bilinear(x[:, -1], x[:, 0]).relu()


class RNN(nn.Module):
    def __init__(self, nonlinearity: str, cell: bool):
        super().__init__()
        self.cell = cell
        self.rnn = nn.RNNCell(3, 4, nonlinearity=nonlinearity) if cell else nn.RNN(3, 4, nonlinearity=nonlinearity)

    def forward(self, x):
        return self.rnn(x[:, -1]) if self.cell else self.rnn(x.transpose(0, 1))[0][-1]


BODIES = {
    "rnn-tanh": lambda: RNN("tanh", cell=False),
    "rnn-relu": lambda: RNN("relu", cell=False),
    "rnn-cell": lambda: RNN("tanh", cell=True),
    "bilinear": Bilinear,
    "own-conv": OwnConv,
    "own-linear": OwnLinear,
}


class Net(nn.Module):
    """An optional encoder Linear, the body, and a Linear head."""

    def __init__(self, body: str, encoder: bool):
        super().__init__()
        self.encoder = nn.Linear(3, 3) if encoder else nn.Identity()
        self.body = BODIES[body]()
        self.head = nn.LazyLinear(2)

    def forward(self, x):
        return self.head(self.body(self.encoder(x)))


def relevance(net: nn.Module, mapper, x: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the body keeps its plain gradient, and is warned of: not tested here
        td = LRP(net, mapper, in_keys=["x"], out_keys=["y"], target=0)(TensorDict(x=x, batch_size=[x.shape[0]]))
    return td["relevance", "x"]


@pytest.mark.parametrize("body", BODIES)
def test_the_layer_after_a_layer_without_a_rule_is_no_first_layer(body: str):
    # The head reads the body's output, not the model's input: EpsilonPlusFlat gives it no Flat (it did, the
    # body taken for glue: 0.47 to 15 off, relative).
    torch.manual_seed(0)
    x = torch.randn(2, 6, 3, dtype=torch.float64)
    net = Net(body, encoder=False).double().eval()
    net(x)  # the lazy head's shape
    assert torch.equal(relevance(net, EpsilonPlusFlat(), x), relevance(net, EpsilonPlus(), x))
    # An encoder before the body is the first layer, and keeps Flat.
    net = Net(body, encoder=True).double().eval()
    net(x)
    expected = relevance(net, EpsilonPlus(rule_mapper={"encoder": FlatRule()}), x)
    assert torch.equal(relevance(net, EpsilonPlusFlat(), x), expected)


def test_a_product_with_a_constant_or_of_two_activations_is_glue():
    x = torch.randn(2, 3, requires_grad=True)
    assert not is_layer_node((x @ torch.randn(3, 3)).grad_fn)  # a constant matrix: glue
    assert not is_layer_node((x @ (2 * x).T).grad_fn)  # two activations: no weight
    assert is_layer_node((x @ nn.Parameter(torch.randn(3, 3))).grad_fn)
