"""Graph neural networks written as plain torch code (message passing over an edge list): GCN, GraphSAGE and GIN
aggregate by sums, means and maxima and need no rule; edge weights and GAT's attention over edges multiply
activations and are named in the coverage report."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import CPLRP, LRP, AttnLRP, BaseRuleMapper, EpsilonGammaBox, EpsilonPlus, EpsilonPlusFlat

F64 = torch.float64
NODES, FEATURES = 5, 4
# A directed graph's edges, source → target; node 3 has one incoming edge, every node at least one.
SOURCES = torch.tensor([0, 1, 1, 2, 3, 4, 4, 0, 2])
TARGETS = torch.tensor([1, 0, 2, 1, 4, 3, 0, 2, 4])


def gathered(h: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
    """The features of ``nodes`` in a batch of graphs (batch, node, feature)."""
    return h[:, nodes]


def summed(messages: torch.Tensor, how: str) -> torch.Tensor:
    """The messages (batch, edge, feature) summed at their edges' targets, as users write it."""
    batch, edges, width = messages.shape
    zeros = messages.new_zeros(batch, NODES, width)
    if how == "index_add_":
        return zeros.index_add_(1, TARGETS, messages)
    if how == "scatter_add":
        return zeros.scatter_add(1, TARGETS[None, :, None].expand(batch, edges, width), messages)
    return zeros.index_put((torch.arange(batch)[:, None], TARGETS[None]), messages, accumulate=True)


def reduced(messages: torch.Tensor, reduce: str) -> torch.Tensor:
    batch, edges, width = messages.shape
    index = TARGETS[None, :, None].expand(batch, edges, width)
    return messages.new_zeros(batch, NODES, width).scatter_reduce(1, index, messages, reduce, include_self=False)


class GCN(nn.Module):
    """Kipf & Welling: messages scaled by 1 / sqrt(deg(source) · deg(target)) with self-loops, summed."""

    def __init__(self, how: str = "index_add_") -> None:
        super().__init__()
        self.how = how
        self.first, self.second, self.head = nn.Linear(FEATURES, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        degree = torch.zeros(NODES).index_add_(0, TARGETS, torch.ones(len(TARGETS))) + 1
        self.register_buffer("norm", (degree[SOURCES] * degree[TARGETS]).rsqrt()[:, None])
        self.register_buffer("loop", degree.reciprocal()[:, None])

    def propagate(self, h: torch.Tensor) -> torch.Tensor:
        return summed(gathered(h, SOURCES) * self.norm, self.how) + h * self.loop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.propagate(self.first(x)))
        h = F.relu(self.propagate(self.second(h)))
        return self.head(h.mean(1))


class GraphSAGE(nn.Module):
    """Hamilton et al.: a node's features beside the mean (or the maximum) of its neighbours'."""

    def __init__(self, reduce: str = "mean") -> None:
        super().__init__()
        self.reduce = reduce
        self.pool, self.own, self.neighbours = nn.Linear(FEATURES, FEATURES), nn.Linear(FEATURES, 6), nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.own(x) + self.neighbours(reduced(gathered(F.relu(self.pool(x)), SOURCES), self.reduce))
        return self.head(F.relu(h).amax(1))


class GIN(nn.Module):
    """Xu et al.: an MLP of (1 + ε) · h plus the sum of the neighbours' features."""

    def __init__(self) -> None:
        super().__init__()
        self.epsilon = nn.Parameter(torch.tensor(0.1))
        self.mlp = nn.Sequential(nn.Linear(FEATURES, 6), nn.ReLU(), nn.Linear(6, 6), nn.ReLU())
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mlp((1 + self.epsilon) * x + summed(gathered(x, SOURCES), "scatter_add"))
        return self.head(h.sum(1))


PIECEWISE_LINEAR = {
    "GCN index_add_": lambda: GCN("index_add_"),
    "GCN scatter_add": lambda: GCN("scatter_add"),
    "GCN index_put": lambda: GCN("index_put"),
    "GraphSAGE mean": lambda: GraphSAGE("mean"),
    "GraphSAGE max": lambda: GraphSAGE("amax"),
    "GraphSAGE min": lambda: GraphSAGE("amin"),
    "GIN": GIN,
}


def graphs(batch: int = 3) -> torch.Tensor:
    return torch.randn(batch, NODES, FEATURES, dtype=F64)


def zero_biases(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.bias.zero_()
    return model


@pytest.mark.parametrize("name", sorted(PIECEWISE_LINEAR))
def test_message_passing_by_sums_means_and_maxima_is_gradient_times_input(name: str):
    """No warning under a strict mapper, and LRP-0 is gradient × input."""
    torch.manual_seed(0)
    model, x = PIECEWISE_LINEAR[name]().double(), graphs()
    lrp = LRP(model, BaseRuleMapper(strict=True, stabilizer=0.0), in_keys=["x"], out_keys=["y"], target=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        relevance = lrp(TensorDict(x=x, batch_size=[3]))["relevance", "x"]
    assert lrp.coverage().plain_gradient == ()
    leaf = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(model(leaf)[:, 0].sum(), leaf)
    torch.testing.assert_close(relevance, x * grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "preset",
    [
        BaseRuleMapper(stabilizer=1e-12),
        EpsilonPlusFlat(epsilon=0.0, stabilizer=1e-12),
        EpsilonGammaBox(-3.0, 3.0, epsilon=0.0, stabilizer=1e-12),
    ],
    ids=["lrp0", "EpsilonPlusFlat", "EpsilonGammaBox"],
)
@pytest.mark.parametrize("name", sorted(PIECEWISE_LINEAR))
def test_message_passing_conserves_relevance_without_biases(name: str, preset):
    torch.manual_seed(0)
    model, x = zero_biases(PIECEWISE_LINEAR[name]().double()), graphs()
    relevance = LRP(model, preset, in_keys=["x"], out_keys=["y"], target=0)(TensorDict(x=x, batch_size=[3]))
    torch.testing.assert_close(relevance["relevance", "x"].sum((1, 2)), model(x)[:, 0].detach(), rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("preset", [EpsilonPlus, AttnLRP, CPLRP])
def test_a_product_of_the_messages_is_named(preset):
    """GraphSAGE with a product of the neighbours' features (``scatter_reduce(..., "prod")``): classed piecewise
    linear by its name, it passed no warning, and the relevance summed to 1.02–1.10 times the explained output
    without biases under EpsilonPlus (each of a node's factors took its whole share). Named under every preset."""
    torch.manual_seed(0)
    model, x = zero_biases(GraphSAGE("prod").double()), graphs()
    lrp = LRP(model, preset(), in_keys=["x"], out_keys=["y"], target=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lrp(TensorDict(x=x, batch_size=[3]))
    assert [call.function for call in lrp.coverage().plain_gradient] == ["scatter_reduce (reduce='prod')"]
    assert any("(GraphSAGE) computes scatter_reduce (reduce='prod')" in str(w.message) for w in caught)


class EdgeWeighted(nn.Module):
    """Messages weighed by a weight computed from both ends of each edge (an edge network's): a gate (sigmoid) or
    an unbounded weight (ReLU)."""

    def __init__(self, gate: bool) -> None:
        super().__init__()
        self.activation = torch.sigmoid if gate else F.relu
        self.nodes, self.edges, self.head = nn.Linear(FEATURES, 6), nn.Linear(12, 1), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.nodes(x))
        weights = self.activation(self.edges(torch.cat([gathered(h, SOURCES), gathered(h, TARGETS)], -1)))
        return self.head(summed(gathered(h, SOURCES) * weights, "index_add_").sum(1))


class GAT(nn.Module):
    """Veličković et al.: attention over each node's incoming edges, a softmax per target written out (the
    maximum per target subtracted, exponentials divided by their sum per target)."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes, self.attention, self.head = nn.Linear(FEATURES, 6), nn.Linear(12, 1), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.nodes(x)
        scores = F.leaky_relu(self.attention(torch.cat([gathered(h, TARGETS), gathered(h, SOURCES)], -1)), 0.2)
        exponentials = torch.exp(scores - gathered(reduced(scores, "amax"), TARGETS))
        weights = exponentials / gathered(summed(exponentials, "index_add_"), TARGETS)
        return self.head(F.relu(summed(weights * gathered(h, SOURCES), "index_add_")).sum(1))


@pytest.mark.parametrize("gate", [True, False], ids=["sigmoid gate", "relu weight"])
@pytest.mark.parametrize("preset", [EpsilonPlus, AttnLRP, CPLRP])
def test_edge_weights_computed_from_the_nodes_are_held_split_or_named(preset, gate: bool):
    """A product of messages and weights computed from activations: a sigmoid gate held constant under every
    preset; an unbounded weight named under a CNN preset, split between the factors by AttnLRP's and CP-LRP's
    product rule. Where it has a rule, the relevance is conserved without biases."""
    torch.manual_seed(0)
    model, x = zero_biases(EdgeWeighted(gate).double()), graphs()
    lrp = LRP(model, preset(), in_keys=["x"], out_keys=["y"], target=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        relevance = lrp(TensorDict(x=x, batch_size=[3]))["relevance", "x"]
    functions = [call.function for call in lrp.coverage().plain_gradient]
    if preset is EpsilonPlus and not gate:
        assert functions == ["mul"] and any("(EdgeWeighted) computes mul" in str(w.message) for w in caught)
    else:
        assert functions == []
        # conserved up to the ε of the ε-rule on the Linear layers
        torch.testing.assert_close(relevance.sum((1, 2)), model(x)[:, 0].detach(), rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize("preset", [EpsilonPlus, AttnLRP, CPLRP])
def test_attention_over_edges_is_named(preset):
    """GAT's softmax over each target's edges, written out, is named (exp, the division by the sum per target),
    under every preset: the function rules know torch.softmax, not its parts."""
    torch.manual_seed(0)
    lrp = LRP(GAT().double(), preset(), in_keys=["x"], out_keys=["y"], target=0)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        lrp(TensorDict(x=graphs(), batch_size=[3]))
    assert {"exp", "div"} <= {call.function for call in lrp.coverage().plain_gradient}
