"""Property-based tests over random computation graphs (hypothesis), in float64.

A drawn model's forward is a random DAG over a grammar of operations: Linear and convolution layers (with and
without bias), additions of two branches (in place too), concatenation with split and chunk, reshape, transpose,
permute, flatten, indexing and gather, products with a constant, ReLU as a module, as ``F.relu`` and as ``relu_``,
max and average pooling, means and sums over a dimension, ``torch.where`` on a mask of the input, BatchNorm in eval
mode; and, for the transformer presets, gates (sigmoid, SiLU, GELU, tanh modules times a branch), products and
``matmul`` of two branches, attention (``softmax(q · kᵀ) · v``), LayerNorm and RMSNorm, and GELU, SiLU, tanh and ELU
as modules and as functions. The identities:

* the wrapper leaves the outputs as they are;
* LRP-0 (``BaseRuleMapper(stabilizer=0)``) equals gradient × input on the piecewise linear graphs;
* CP-LRP conserves relevance with biases and shifts zeroed;
* a second call in the open context, and calls on other inputs of the same shapes (which a recorded plan of the
  function rules may take), equal a fresh context's call;
* a ``[B, T]`` batch gives the flat ``[B·T]`` batch's relevance.

The examples are derandomised, so CI runs the same ones every time.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.rules import CPLRP, BaseRuleMapper, EpsilonPlus
from tests.attribution._helpers import gradient_times_input
from tests.conftest import relative_error

F64 = torch.float64
WIDTH = 8  # every node of the graph has 8 features: two channels of 4, or 2 × 2 × 2
PIECEWISE_LINEAR = [
    "linear", "linear_no_bias", "conv1d", "conv2d", "add", "add_", "cat_split", "transpose", "permute_flatten",
    "index", "gather", "times_constant", "relu", "f_relu", "relu_", "leaky_relu", "max_pool", "avg_pool",
    "mean_sum", "where", "batch_norm",
]  # fmt: skip
# Operations CP-LRP conserves on (gates and attention weights held, norms' scales held, activations passed).
CONSERVING = PIECEWISE_LINEAR + [
    "gate_sigmoid", "gate_silu", "gate_gelu", "gate_tanh", "product", "matmul", "attention", "layer_norm",
    "rms_norm", "gelu", "silu", "tanh", "elu", "f_silu", "f_gelu", "t_tanh",
]  # fmt: skip
ARITY = {"add": 2, "add_": 2, "cat_split": 2, "where": 2, "product": 2, "matmul": 2, "attention": 3}
ARITY |= {f"gate_{name}": 2 for name in ("sigmoid", "silu", "gelu", "tanh")}
MODULES = {
    "linear": lambda: nn.Linear(WIDTH, WIDTH),
    "linear_no_bias": lambda: nn.Linear(WIDTH, WIDTH, bias=False),
    "conv1d": lambda: nn.Conv1d(2, 2, 3, padding=1),
    "conv2d": lambda: nn.Conv2d(2, 2, 3, padding=1, bias=False),
    "relu": nn.ReLU,
    "leaky_relu": lambda: nn.LeakyReLU(0.1),
    "max_pool": lambda: nn.MaxPool1d(3, 1, 1),
    "avg_pool": lambda: nn.AvgPool1d(3, 1, 1),
    "batch_norm": lambda: nn.BatchNorm1d(WIDTH),
    "layer_norm": lambda: nn.LayerNorm(WIDTH),
    "rms_norm": lambda: nn.RMSNorm(WIDTH),
    "gelu": nn.GELU,
    "silu": nn.SiLU,
    "tanh": nn.Tanh,
    "elu": nn.ELU,
    "gate_sigmoid": nn.Sigmoid,
    "gate_silu": nn.SiLU,
    "gate_gelu": nn.GELU,
    "gate_tanh": nn.Tanh,
}
FUNCTIONS = {"f_relu": F.relu, "f_silu": F.silu, "f_gelu": F.gelu, "t_tanh": torch.tanh}


class RandomGraph(nn.Module):
    """A forward that runs ``operations`` in order: each ``(name, inputs)`` reads earlier nodes (node 0 is the
    input) and appends one node of ``WIDTH`` features; a Linear head reads the last node."""

    def __init__(self, operations: list[tuple[str, list[int]]], seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.operations = operations
        self.layers = nn.ModuleList(MODULES.get(name, nn.Identity)() for name, _ in operations)
        self.head = nn.Linear(WIDTH, 3)
        self.register_buffer("constant", torch.randn(WIDTH))
        self.register_buffer("permutation", torch.randperm(WIDTH))
        self.register_buffer("gathered", torch.randint(0, WIDTH, (WIDTH,)))
        for norm in (m for m in self.layers if isinstance(m, nn.BatchNorm1d)):
            with torch.no_grad():
                norm.running_mean.normal_()
                norm.running_var.uniform_(0.5, 2.0)
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.normal_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nodes = [x]
        for (name, inputs), layer in zip(self.operations, self.layers, strict=True):
            nodes.append(self._node(name, layer, x, *(nodes[i] for i in inputs)))
        return self.head(nodes[-1])

    def _node(self, name: str, layer: nn.Module, x: torch.Tensor, a: torch.Tensor, *others: torch.Tensor):
        lead = a.shape[:-1]
        if name in FUNCTIONS:
            return FUNCTIONS[name](a)
        if name in ("conv1d", "max_pool", "avg_pool"):
            return layer(a.reshape(-1, 2, 4)).reshape(*lead, WIDTH)
        if name == "conv2d":
            return layer(a.reshape(-1, 2, 2, 2)).reshape(*lead, WIDTH)
        if name == "batch_norm":
            return layer(a.reshape(-1, WIDTH)).reshape(*lead, WIDTH)
        if name.startswith("gate_"):
            return a * layer(others[0])
        if name in MODULES:
            return layer(a)
        if name == "add":
            return a + others[0]
        if name == "add_":
            return (a * 1.0).add_(others[0])
        if name == "relu_":
            return (a * 1.0).relu_()
        if name == "cat_split":
            joined = torch.cat([a, others[0]], -1)
            return joined.flip(-1).chunk(2, -1)[0] + joined.split(WIDTH, -1)[1]
        if name == "transpose":
            return a.reshape(*lead, 2, 4).transpose(-1, -2).reshape(*lead, WIDTH)
        if name == "permute_flatten":
            return a.reshape(*lead, 2, 4).permute(*range(len(lead)), len(lead) + 1, len(lead)).flatten(-2)
        if name == "index":
            return a[..., self.permutation]
        if name == "gather":
            return torch.gather(a, -1, self.gathered.expand(*lead, WIDTH))
        if name == "times_constant":
            return a * self.constant
        if name == "mean_sum":
            halves = a.reshape(*lead, 2, 4)
            return torch.cat([halves.mean(-2), halves.sum(-2)], -1)
        if name == "where":
            return torch.where(x > 0, a, others[0])
        if name == "product":
            return a * others[0]
        if name == "matmul":
            return (a.reshape(*lead, 2, 4).transpose(-1, -2) @ others[0].reshape(*lead, 2, 4)).flatten(-2)[..., :WIDTH]
        if name == "attention":
            q, k, v = (t.reshape(*lead, 4, 2) for t in (a, *others))
            return (torch.softmax(q @ k.transpose(-1, -2), -1) @ v).reshape(*lead, WIDTH)
        raise ValueError(name)


@st.composite
def graphs(draw, grammar: list[str]) -> RandomGraph:
    operations = []
    for node in range(draw(st.integers(1, 6))):
        name = draw(st.sampled_from(grammar))
        others = [draw(st.integers(0, node)) for _ in range(ARITY.get(name, 1) - 1)]
        operations.append((name, [node, *others]))  # a chain through the last node, with branches from earlier ones
    return RandomGraph(operations, draw(st.integers(0, 2**16))).to(F64).eval()


def explain(lrp: LRP, x: torch.Tensor) -> TensorDict:
    return lrp(TensorDict(x=x, batch_size=x.shape[:-1]))


def wrapped(model: nn.Module, mapper) -> LRP:
    return LRP(model, mapper, in_keys=["x"], out_keys=["y"])


def without_shifts(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
            if isinstance(module, nn.BatchNorm1d):
                module.running_mean.zero_()
    return model


PROPERTY = settings(max_examples=30, deadline=None, derandomize=True)


@PROPERTY
@given(graphs(PIECEWISE_LINEAR))
def test_lrp0_is_gradient_times_input_and_outputs_are_unchanged(model):
    x = torch.randn(4, WIDTH, dtype=F64)
    td = explain(wrapped(model, BaseRuleMapper(stabilizer=0.0)), x)
    with torch.no_grad():
        assert torch.equal(td["y"], model(x))
    assert relative_error(td["relevance", "x"], gradient_times_input(model, x)) <= 1e-10


@PROPERTY
@given(graphs(CONSERVING))
def test_cplrp_conserves_without_shifts(model):
    model = without_shifts(model)
    x = torch.randn(4, WIDTH, dtype=F64)
    td = explain(wrapped(model, CPLRP(stabilizer=1e-15)), x)
    torch.testing.assert_close(td["relevance", "x"].sum(-1), td["y"].max(-1).values, rtol=1e-7, atol=1e-10)


@pytest.mark.filterwarnings("ignore:LRP. the model itself")  # LRP-0 and EpsilonPlus: plain gradient of curved calls
@PROPERTY
@given(graphs(CONSERVING), st.sampled_from(["LRP-0", "CPLRP", "EpsilonPlus"]))
def test_later_calls_and_batch_shapes_match_a_fresh_flat_call(model, preset):
    mapper = {"LRP-0": lambda: BaseRuleMapper(stabilizer=0.0), "CPLRP": CPLRP, "EpsilonPlus": EpsilonPlus}[preset]
    x, other = torch.randn(2, 4, WIDTH, dtype=F64).unbind(0)
    lrp = wrapped(model, mapper())
    with lrp:
        first, again, on_other, on_other_again = (explain(lrp, t) for t in (x, x, other, other))
    fresh = explain(wrapped(model, mapper()), other)["relevance", "x"]
    batch_time = explain(wrapped(model, mapper()), x.reshape(2, 2, WIDTH))["relevance", "x"]
    torch.testing.assert_close(again["relevance", "x"], first["relevance", "x"], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(on_other["relevance", "x"], fresh, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(on_other_again["relevance", "x"], fresh, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(batch_time.reshape(4, WIDTH), first["relevance", "x"], rtol=1e-10, atol=1e-12)
