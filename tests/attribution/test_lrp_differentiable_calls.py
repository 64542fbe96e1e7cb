"""Differentiable relevance (``create_graph=True``) through what a call adds around the rules: inputs that carry
their own history, token ids, callable targets, inner layers' relevance and the hooks that watch the relevance pass.

The oracle is the ordinary call: its relevance (first order) and central finite differences of it in float64
along one random direction per tensor (second order).
"""

from __future__ import annotations

import contextlib
import gc
import warnings
import weakref
from collections.abc import Callable

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import CPLRP, LRP
from tdhook.attribution.mappers.presets import EpsilonGammaBox, EpsilonPlus, EpsilonPlusFlat
from tdhook.attribution.rules import EpsilonRule, TaylorDecompositionRule
from tests.attribution._helpers import Recorded
from tests.conftest import relative_error

PRESETS = {
    "EpsilonPlus": lambda: EpsilonPlus(epsilon=0.1),
    "EpsilonPlusFlat": lambda: EpsilonPlusFlat(epsilon=0.1),
    "EpsilonGammaBox": lambda: EpsilonGammaBox(low=-3.0, high=3.0, epsilon=0.1),
}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def directional_errors(loss: Callable[[bool], torch.Tensor], tensors: list[torch.Tensor], step: float = 1e-6):
    """Per tensor, the relative error of ``loss(True)``'s derivative along a random direction against central
    differences of ``loss(False)`` (the ordinary call); the tensors are moved in place."""
    generator = torch.Generator().manual_seed(1)
    for tensor in tensors:
        tensor.requires_grad_(True)
    grads = torch.autograd.grad(loss(True), tensors, allow_unused=True, materialize_grads=True)
    errors = []
    for tensor, grad in zip(tensors, grads, strict=True):
        direction = torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
        values = []
        for sign in (1, -1):
            with torch.no_grad():
                tensor.add_(sign * step * direction)
            values.append(loss(False).item())
            with torch.no_grad():
                tensor.sub_(sign * step * direction)
        expected = (values[0] - values[1]) / (2 * step)
        actual = (grad * direction).sum().item()
        errors.append(abs(actual - expected) / max(abs(expected), 1e-8))
    return errors


class TestInputsWithHistory:
    @pytest.mark.parametrize("preset", sorted(PRESETS))
    def test_an_input_computed_from_a_leaf(self, preset):
        """An input that is no leaf (``x0 + delta``, as an attack on the explanation computes it): the relevance is
        the ordinary call's, and its derivative reaches ``delta`` and the parameters."""
        net = mlp()
        x0 = torch.randn(4, 5, dtype=torch.float64)
        delta = torch.zeros(4, 5, dtype=torch.float64)
        weights = torch.randn(4, 5, dtype=torch.float64)
        plain = LRP(net, PRESETS[preset](), in_keys=["x"], out_keys=["y"])
        kept = LRP(net, PRESETS[preset](), in_keys=["x"], out_keys=["y"], create_graph=True)

        def loss(graph: bool) -> torch.Tensor:
            lrp = kept if graph else plain
            return (lrp(TensorDict(x=x0 + delta, batch_size=[4]))["relevance", "x"] * weights).sum()

        expected = plain(TensorDict(x=x0, batch_size=[4]))["relevance", "x"]
        got = kept(TensorDict(x=x0 + delta.clone().requires_grad_(True), batch_size=[4]))["relevance", "x"]
        assert relative_error(got.detach(), expected) < 1e-12
        assert max(directional_errors(loss, [delta, *net.parameters()])) < 1e-6

    def test_one_tensor_under_two_keys(self):
        """Each key gets the relevance of its own use of the tensor, as in an ordinary call."""

        class Two(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.linear = nn.Linear(10, 2).double()

            def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
                return self.linear(torch.cat([a, b], -1))

        torch.manual_seed(0)
        model = TensorDictModule(Two(), in_keys=["a", "b"], out_keys=["y"])
        x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
        plain = LRP(model)(TensorDict(a=x.detach(), b=x.detach(), batch_size=[3]))
        kept = LRP(model, create_graph=True)(TensorDict(a=x, b=x, batch_size=[3]))
        for key in ("a", "b"):
            assert relative_error(kept["relevance", key].detach(), plain["relevance", key]) < 1e-12


class TestTokenIds:
    @staticmethod
    def model(embedding: str) -> nn.Module:
        torch.manual_seed(0)
        table = nn.Embedding(10, 4) if embedding == "Embedding" else nn.EmbeddingBag(10, 4, mode="sum")
        head = [nn.Flatten(), nn.Linear(12, 5)] if embedding == "Embedding" else [nn.Linear(4, 5)]
        return nn.Sequential(table, *head, nn.Tanh(), nn.Linear(5, 2)).double()

    def test_the_derivative_of_the_relevance_reaches_the_embedding_table(self):
        """Token ids stand for their embeddings' rows: the relevance's derivative reaches the table as it reaches
        every other parameter."""
        model = self.model("Embedding")
        ids = torch.randint(0, 10, (3, 3))
        weights = torch.randn(3, 3, dtype=torch.float64)

        def loss(graph: bool) -> torch.Tensor:
            lrp = LRP(model, EpsilonPlus(epsilon=0.1), in_keys=["ids"], out_keys=["y"], create_graph=graph)
            return (lrp(TensorDict(ids=ids, batch_size=[3]))["relevance", "ids"] * weights).sum()

        assert max(directional_errors(loss, list(model.parameters()))) < 1e-6

    @pytest.mark.parametrize("embedding", ["Embedding", "EmbeddingBag"])
    def test_the_outputs_derivative_reaches_the_embedding_table(self, embedding):
        model = self.model(embedding)
        ids = torch.randint(0, 10, (3, 3))
        lrp = LRP(model, EpsilonPlus(epsilon=0.1), in_keys=["ids"], out_keys=["y"], create_graph=True)
        (got,) = torch.autograd.grad(lrp(TensorDict(ids=ids, batch_size=[3]))["y"].sum(), model[0].weight)
        (expected,) = torch.autograd.grad(model(ids).sum(), model[0].weight)
        assert relative_error(got, expected) < 1e-12

    def test_embeddings_summed_with_what_is_computed_from_them_give_no_warning(self):
        """The copy of the embedding rows fed to the model was taken for a part of the signal the model computed
        without gradient, and a residual sum on it (GPT-2 and Llama called with ids, any block ``h + f(h)``) warned
        that the relevance stopped there; the relevance was the ordinary call's all along."""

        class Residual(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.table, self.inner, self.head = nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 3)

            def forward(self, ids: torch.Tensor) -> torch.Tensor:
                h = self.table(ids)
                return self.head(h + self.inner(h)).sum(1)

        torch.manual_seed(0)
        model, ids = Residual().double(), torch.randint(0, 10, (2, 5))
        relevances = []
        for graph in (False, True):
            lrp = LRP(model, EpsilonPlus(epsilon=0.1), in_keys=["ids"], out_keys=["y"], create_graph=graph)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                relevances.append(lrp(TensorDict(ids=ids, batch_size=[2]))["relevance", "ids"].detach())
        assert relative_error(relevances[1], relevances[0]) < 1e-12


def margin(output: torch.Tensor) -> torch.Tensor:
    """The margin of unit 0 over unit 1, put on unit 0 (a callable target)."""
    relevance = torch.zeros_like(output)
    relevance[..., 0] = output[..., 0] - output[..., 1]
    return relevance


class TestCallableTargets:
    @pytest.mark.parametrize("target", [margin, lambda output: output**2], ids=["margin", "square"])
    @pytest.mark.parametrize("split_dim", [None, 1])
    def test_the_derivative_runs_through_the_target(self, target, split_dim):
        """The initial relevance a callable target computes from the output is part of the relevance: its
        derivative runs through it."""
        net = mlp()
        x = torch.randn(2, 3, 5, dtype=torch.float64)
        weights = torch.randn(2, 3, 5, dtype=torch.float64) if split_dim is None else torch.randn(2, 3, 3, 5)

        def loss(graph: bool) -> torch.Tensor:
            lrp = LRP(net, PRESETS["EpsilonPlus"](), in_keys=["x"], out_keys=["y"], target=target,
                      split_dim=split_dim, create_graph=graph)  # fmt: skip
            return (lrp(TensorDict(x=x, batch_size=[2, 3]))["relevance", "x"] * weights.double()).sum()

        assert max(directional_errors(loss, [x, *net.parameters()])) < 1e-6


class TestInnerLayers:
    @pytest.mark.parametrize("preset", sorted(PRESETS))
    def test_the_derivative_of_an_inner_layers_relevance(self, preset):
        net = mlp()
        x = torch.randn(4, 5, dtype=torch.float64)
        weights = torch.randn(4, 7, dtype=torch.float64)

        def loss(graph: bool) -> torch.Tensor:
            lrp = LRP(net, PRESETS[preset](), in_keys=["x"], out_keys=["y"], layers=["1", "2"], create_graph=graph)
            td = lrp(TensorDict(x=x, batch_size=[4]))
            return (td["relevance", "1"] * weights).sum() + (td["relevance", "2"] ** 2).sum()

        assert max(directional_errors(loss, [x, *net.parameters()])) < 1e-6


def taylor_block_net() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5))
    return nn.Sequential(block, nn.ReLU(), nn.Linear(5, 3)).double(), block.double()


class TestCallsAtTheTaylorReference:
    """The Taylor rule evaluates its module at the reference point: that call is no call of the model."""

    @pytest.mark.parametrize("create_graph", [False, True])
    def test_the_relevance_of_the_explained_module_is_its_output_relevance(self, create_graph):
        net, block = taylor_block_net()
        x = torch.randn(6, 4, dtype=torch.float64)
        mapper = {"0": TaylorDecompositionRule(ref=0.3), nn.Linear: EpsilonRule(0.01)}
        lrp = LRP(net, mapper, in_keys=["x"], out_keys=["y"], layers=["0"], create_graph=create_graph)
        got = lrp(TensorDict(x=x, batch_size=[6]))["relevance", "0"]
        tail = LRP(nn.Sequential(net[1], net[2]), {nn.Linear: EpsilonRule(0.01)}, in_keys=["h"], out_keys=["y"])
        with torch.no_grad():
            expected = tail(TensorDict(h=block(x), batch_size=[6]))["relevance", "h"]
        assert relative_error(got.detach(), expected) < 1e-12

    def test_a_relevance_check_sees_the_models_calls_only(self):
        net, _ = taylor_block_net()
        seen = []
        mapper = {"0": TaylorDecompositionRule(ref=0.3), nn.Linear: EpsilonRule(0.01)}

        def check(name, module, relevance_in, relevance_out):
            seen.append((name, float(relevance_in.sum()), float(relevance_out.sum())))

        lrp = LRP(net, mapper, in_keys=["x"], out_keys=["y"], relevance_check=check)
        td = lrp(TensorDict(x=torch.randn(6, 4, dtype=torch.float64), batch_size=[6]))
        block = [(r_in, r_out) for name, r_in, r_out in seen if name == "0"]
        assert len(block) == 1
        assert abs(block[0][0] - td["relevance", "x"].sum().item()) < 1e-12


def test_a_relevance_check_is_not_called_by_later_backward_passes():
    """A loss on the relevance runs a backward pass through the graph the call kept: the check watches the
    relevance pass only."""
    net = mlp()
    seen = []
    lrp = LRP(net, PRESETS["EpsilonPlus"](), in_keys=["x"], out_keys=["y"], create_graph=True, layers=["2"],
              relevance_check=lambda *args: seen.append(args[0]))  # fmt: skip
    td = lrp(TensorDict(x=torch.randn(4, 5, dtype=torch.float64), batch_size=[4]))
    calls = len(seen)
    (td["relevance", "x"].sum() + td["relevance", "2"].sum()).backward()
    assert calls == 5 and len(seen) == calls  # the three Linear layers and the two Tanh


@pytest.mark.parametrize("transform", ["grad", "vmap", "jvp", "jacrev"])
@pytest.mark.parametrize("create_graph", [False, True])
def test_a_call_under_a_torch_func_transform_is_refused(transform, create_graph):
    net = mlp()
    lrp = LRP(net, PRESETS["EpsilonPlusFlat"](), in_keys=["x"], out_keys=["y"], create_graph=create_graph)
    x = torch.randn(4, 5, dtype=torch.float64)

    def total(x: torch.Tensor) -> torch.Tensor:
        return lrp(TensorDict(x=x, batch_size=x.shape[:1]))["relevance", "x"].sum()

    run = {
        "grad": lambda: torch.func.grad(total)(x),
        "vmap": lambda: torch.func.vmap(lambda row: total(row.unsqueeze(0)))(x),
        "jvp": lambda: torch.func.jvp(total, (x,), (torch.ones_like(x),)),
        "jacrev": lambda: torch.func.jacrev(total)(x),
    }[transform]
    with pytest.raises(NotImplementedError, match="torch.func transform"):
        run()
    assert all(not m._forward_hooks for m in net.modules())


def test_functional_call_reaches_the_parameters_it_is_given():
    net = mlp()
    x = torch.randn(4, 5, dtype=torch.float64)
    weights = torch.randn(4, 5, dtype=torch.float64)
    lrp = LRP(net, PRESETS["EpsilonGammaBox"](), in_keys=["x"], out_keys=["y"], create_graph=True)
    given = {f"module.{name}": p.detach() * 1.5 for name, p in net.named_parameters()}
    for p in given.values():
        p.requires_grad_(True)
    rel = torch.func.functional_call(lrp, given, (TensorDict(x=x, batch_size=[4]),))["relevance", "x"]
    got = torch.autograd.grad((rel * weights).sum(), list(given.values()))
    with torch.no_grad():
        for p in net.parameters():
            p.mul_(1.5)
    expected_rel = lrp(TensorDict(x=x, batch_size=[4]))["relevance", "x"]
    expected = torch.autograd.grad((expected_rel * weights).sum(), list(net.parameters()))
    assert relative_error(rel.detach(), expected_rel.detach()) < 1e-12
    assert all(relative_error(a, b) < 1e-12 for a, b in zip(got, expected, strict=True))


class TestSwitchedOnInAnOpenContext:
    def test_the_relevance_keeps_its_graph(self):
        """``create_graph`` set on a wrapper whose context is open: later calls keep the graph (the plan the
        context made for ordinary calls does not)."""
        net = mlp()
        x = torch.randn(4, 5, dtype=torch.float64)
        weights = torch.randn(4, 5, dtype=torch.float64)
        lrp = LRP(net, PRESETS["EpsilonPlus"](), in_keys=["x"], out_keys=["y"])
        expected = LRP(net, PRESETS["EpsilonPlus"](), in_keys=["x"], out_keys=["y"], create_graph=True)
        (wanted,) = torch.autograd.grad((expected(TensorDict(x=x, batch_size=[4]))["relevance", "x"] * weights).sum(),
                                        net[0].weight)  # fmt: skip
        with lrp:
            for _ in range(3):
                lrp(TensorDict(x=x, batch_size=[4]))
            lrp.create_graph = True
            rel = lrp(TensorDict(x=x, batch_size=[4]))["relevance", "x"]
        assert rel.requires_grad
        (got,) = torch.autograd.grad((rel * weights).sum(), net[0].weight)
        assert relative_error(got, wanted) < 1e-12

    def test_a_rule_that_cannot_keep_the_graph_is_refused(self):
        class FirstOrderOnly(EpsilonRule):
            differentiable = False

        net = mlp()
        lrp = LRP(net, {"2": FirstOrderOnly()}, in_keys=["x"], out_keys=["y"])
        with lrp:
            lrp.create_graph = True
            with pytest.raises(NotImplementedError, match="FirstOrderOnly.*Linear"):
                lrp(TensorDict(x=torch.randn(2, 5, dtype=torch.float64), batch_size=[2]))


@pytest.mark.filterwarnings("ignore:LRP. EpsilonRule")  # out_proj, computed by its parent (a known warning)
@pytest.mark.parametrize("kind", ["TransformerEncoderLayer", "LSTM"])
def test_a_caller_without_gradient_gets_the_same_derivative(kind):
    """A collector's ``torch.no_grad()`` around the call: the modules whose kernels depend on the grad mode give
    that mode's values, and the derivative still runs through them."""
    torch.manual_seed(0)
    if kind == "LSTM":

        class Model(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lstm, self.head = nn.LSTM(4, 6, batch_first=True), nn.Linear(6, 2)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.head(self.lstm(x)[0][:, -1])

        model, x = Model(), torch.randn(3, 5, 4)  # float32: another kernel without gradient
    else:
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).eval()
        model, x = nn.Sequential(layer, nn.Flatten(), nn.Linear(24, 3)), torch.randn(2, 3, 8)
    weights = torch.randn_like(x)
    grads = []
    for grad_mode in (torch.enable_grad, torch.no_grad):
        mapper = CPLRP(epsilon=0.1) if kind == "TransformerEncoderLayer" else PRESETS["EpsilonPlus"]()
        lrp = LRP(model, mapper, in_keys=["x"], out_keys=["y"], create_graph=True)
        with grad_mode():
            td = lrp(TensorDict(x=x, batch_size=x.shape[:1]))
        loss = (td["relevance", "x"] * weights).sum() + td["y"].sum()
        grads.append(torch.autograd.grad(loss, list(model.parameters())))
    for got, expected in zip(*grads, strict=True):
        assert relative_error(got, expected) < 1e-5


@pytest.mark.parametrize("in_context", [False, True])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_calls_under_no_grad_keep_their_graph_on_their_results_only(preset, in_context):
    """Under a collector's ``torch.no_grad()`` the results keep their graph (as documented), with the ordinary
    call's relevance; once the caller drops them, nothing of the call (input, intermediates) is held."""
    recorded = Recorded()
    net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), recorded, nn.Linear(7, 3)).double()
    lrp = LRP(net, PRESETS[preset](), in_keys=["x"], out_keys=["y"], create_graph=True)
    plain = LRP(net, PRESETS[preset](), in_keys=["x"], out_keys=["y"])
    inputs = [torch.randn(4, 5, dtype=torch.float64) for _ in range(3)]
    expected = [plain(TensorDict(x=x.clone(), batch_size=[4]))["relevance", "x"] for x in inputs]
    recorded.outputs.clear()
    leaves = []
    with lrp if in_context else contextlib.nullcontext():
        for x, want in zip(inputs, expected, strict=True):
            leaf = x.clone().requires_grad_(True)
            leaves.append(weakref.ref(leaf))
            with torch.no_grad():
                td = lrp(TensorDict(x=leaf, batch_size=[4]))
            assert td["relevance", "x"].requires_grad and td["y"].requires_grad
            assert relative_error(td["relevance", "x"].detach(), want) < 1e-12
            del td, leaf
        gc.collect()
        assert [ref() for ref in leaves] == [None] * len(inputs)
        assert [ref() for ref in recorded.outputs] == [None] * len(recorded.outputs)
