"""Later calls of a context find AttnLRP's products in the autograd graph instead of through the function mode;
norms, activations and held tensors are in ``test_function_rule_plan_norms.py``, ``…_activations.py`` and
``…_held.py``.

The oracles: the uniform rule written into the forward pass of ``out(q(x) * k(x))`` by hand (bias-free layers, so
that the rest is gradient × input); and, for Hugging Face models, a call that runs in the function mode alone (the
one the LXT tests check).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule, TensorDictSequential
from torch import nn
from torch.nn import functional as F

from tdhook.attribution import CPLRP, LRP, AttnLRP, IgnoreRule, _function_rule_plan
from tdhook.attribution.rules.normalization import is_norm
from tests.attribution._plan_helpers import F64, Product, by_hand, call, plans, product_model, wrapped_on_a_batch
from tests.attribution.test_lrp_huggingface import LastLogits, build
from tests.attribution.test_lrp_transformer_zoo import ZOO, Explained, model_input
from tests.conftest import relative_error


def test_later_calls_halve_the_products_in_the_graph(applied):
    model, x = product_model(), torch.randn(5, 4, dtype=F64)
    expected = by_hand(model, x)
    lrp = LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"])
    with lrp:
        relevances = [call(lrp, x) for _ in range(3)]
    assert applied == [True, True]
    for relevance in relevances:
        assert relative_error(relevance, expected) <= 1e-12
    # Without the rule, gradient × input is twice as large: the comparison can fail.
    leaf = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(model(leaf).max(-1).values.sum(), leaf)
    assert relative_error(leaf.detach() * grad, 2 * expected) <= 1e-12


@pytest.mark.parametrize(
    "change, later",
    [
        # A call with no product to rule records no plan: its inputs' shape keeps the mode from then on.
        pytest.param({"product": False}, [], id="the product becomes a sum"),
        pytest.param({"extra": True}, [True], id="one product more"),
        pytest.param({"copy": True}, [True], id="one node more off the product's path"),
    ],
)
def test_a_call_whose_graph_changed_runs_again_in_the_mode(applied, change: dict, later: list):
    model, x = product_model(), torch.randn(5, 4, dtype=F64)
    lrp = LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"])
    with lrp:
        call(lrp, x)
        call(lrp, x)  # the plan of the first call
        for name, value in change.items():
            setattr(model, name, value)
        changed = call(lrp, x)  # the same shapes, another graph: the plan does not fit, the mode runs
        expected = by_hand(model, x)
        again = call(lrp, x)  # the plan the changed call recorded
    assert applied == [True, False, *later]
    assert relative_error(changed, expected) <= 1e-12
    assert relative_error(again, expected) <= 1e-12


def test_a_graph_that_keeps_changing_keeps_the_mode(applied):
    model, x = product_model(), torch.randn(5, 4, dtype=F64)
    lrp = LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"])
    relevances, expected = [], []
    with lrp:
        for extra in [False, False, True, False, True, False]:
            model.extra = extra
            relevances.append(call(lrp, x))
            expected.append(by_hand(model, x))
    # Planned, then two calls on another graph: each ran twice (without, then in the mode); then the mode alone.
    assert applied == [True, False, False]
    for relevance, oracle in zip(relevances, expected, strict=True):
        assert relative_error(relevance, oracle) <= 1e-12


class Times(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * b


class ProductInModule(Product):
    """``out(q(x) * k(x))``, or ``out(gelu(q(x)) * k(x))`` with ``activation``; with ``in_module`` the product (the
    GELU) is made by a module of its own, which the caller maps to its plain gradient: the same nodes, made where the
    function mode pauses and makes no rule."""

    def __init__(self, activation: bool) -> None:
        super().__init__()
        self.times, self.act = Times(), nn.GELU()
        self.activation, self.in_module = activation, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.q(x), self.k(x)
        if self.activation:
            return self.out((self.act(a) if self.in_module else F.gelu(a)) * b)
        return self.out(self.times(a, b) if self.in_module else a * b)


@pytest.mark.parametrize("activation", [False, True])
def test_a_later_call_that_makes_a_ruled_node_in_a_module_with_its_plain_gradient_runs_again_in_the_mode(
    applied, activation: bool
):
    torch.manual_seed(0)
    model, x = ProductInModule(activation).to(F64), torch.randn(5, 4, dtype=F64)
    mapper = lambda: AttnLRP(rule_mapper={"times": IgnoreRule(), "act": IgnoreRule()})  # noqa: E731
    lrp = LRP(model, mapper(), in_keys=["x"], out_keys=["y"])
    with lrp:
        in_forward = [call(lrp, x) for _ in range(2)]  # the plan halves the product's node (puts the GELU's rule)
        model.in_module = True
        in_module = [call(lrp, x) for _ in range(2)]  # that node made in the module: the mode leaves it plain
    fresh = call(LRP(model, mapper(), in_keys=["x"], out_keys=["y"]), x)
    for relevance in in_module:
        assert relative_error(relevance, fresh) <= 1e-12
    assert relative_error(in_forward[0], fresh) > 1e-3  # the rules differ: the comparison can fail
    assert relative_error(in_forward[1], in_forward[0]) <= 1e-12
    assert applied[:2] == [True, False]  # (a GELU's output times k(x) is a product the next plan halves)


def test_each_input_shape_has_a_plan_of_its_own(applied):
    model = product_model()
    x, y = torch.randn(5, 4, dtype=F64), torch.randn(2, 4, dtype=F64)
    lrp = LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"])
    with lrp:
        results = [call(lrp, inputs) for inputs in (x, y, x, y)]
    assert applied == [True, True]
    for inputs, relevance in zip((x, y, x, y), results, strict=True):
        assert relative_error(relevance, by_hand(model, inputs)) <= 1e-12


def test_a_rule_other_than_the_uniform_product_keeps_the_mode(applied):
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2), dim=-1) @ x

    model, x, lrp = wrapped_on_a_batch(Attention, lambda: AttnLRP(softmax_epsilon=0.1), (2, 3, 4))
    with lrp:
        first, second = call(lrp, x), call(lrp, x)
    assert applied == []  # the softmax's ε changes its gradient: every call runs in the mode
    assert relative_error(second, first) <= 1e-12
    # With ε = 0 the softmax keeps its gradient: the products alone are ruled, and a plan applies.
    lrp = LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"])
    with lrp:
        first, second = call(lrp, x), call(lrp, x)
    assert applied == [True]
    assert relative_error(second, first) <= 1e-12


@pytest.mark.parametrize("preset", [AttnLRP, CPLRP])
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hugging_face_models_calls_in_a_context_equal_a_call_in_the_mode(applied, kind: str, implementation, preset):
    """Under sdpa the fused attention's node scales (AttnLRP) or drops (CP-LRP) the gradients to the query, key
    and value, as the mode's factors on its inputs do."""
    model = build(kind)
    model.set_attn_implementation(implementation)
    model = LastLogits(model)
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(1), dtype=F64)
    lrp = LRP(model, preset(), in_keys=["x"], out_keys=["y"])
    in_mode = call(lrp, x)  # a call that enters its context runs in the mode, with what it holds detached
    with lrp:
        first, *later = (call(lrp, x) for _ in range(3))
        norms = [sum(is_norm(module) for module in plan.modules) for plan in plans(lrp)]
        starts = [plan.norm_outputs for plan in plans(lrp)]  # paths start from every norm's output too
        quiet = [type(module).__name__ for plan in plans(lrp) for module in plan.quiet]
    # AttnLRP's rules inside these models are the uniform rule on products, and CP-LRP's hold the attention weights
    # and the gates: later calls take the graph's way with both.
    assert applied == [True, True]
    # Llama's RMSNorms (written out) run plainly with their scales cut; GPT-2's LayerNorms (F.layer_norm) run
    # plainly with the rule's hook on their fused node.
    assert norms == [5]
    assert starts == [5]  # noted by the norms' calls, which run without their hooks
    # The norms run without their hooks, and so do Llama's SiLU modules, whose identity rule goes on their nodes;
    # GPT-2's GELU is written out (its node saved no input), and keeps its rule in its forward.
    activations = ["SiLUActivation"] * 2 if kind == "llama" else []
    assert sorted(quiet) == sorted(activations + ["LlamaRMSNorm" if kind == "llama" else "LayerNorm"] * 5)
    for relevance in [first, *later]:
        assert torch.equal(relevance, in_mode)  # to the last bit


class Branching(nn.Module):
    """``out(q(x) * k(s))``, where ``s`` is the input or a constant by a value the forward reads from the input (a
    Python branch, ``int(...)`` or ``.item()``): the same graph either way, but a product of two activations on
    one branch and of an activation with a value computed from parameters alone on the other, which the uniform
    rule leaves whole."""

    def __init__(self, read: str) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(4, 6, bias=False), nn.Linear(4, 6, bias=False)
        self.out = nn.Linear(6, 3, bias=False)
        self.register_buffer("constant", torch.randn(1, 4))
        self.read = read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        reads = {"bool": lambda: bool(x.sum() > 0), "int": lambda: int(x.sum() > 0), "item": lambda: x.sum().item() > 0}
        reads["weights"] = lambda: peaked(x).item()  # held under CP-LRP, but computed from the input
        reads["indices"] = lambda: bool(x.sum(-1).max(0).indices == 0)  # of a call returning several tensors
        source = x if reads[self.read]() else self.constant.expand_as(x)
        return self.out(self.q(x) * self.k(source))


def peaked(x: torch.Tensor) -> torch.Tensor:
    """Whether the attention weights ``softmax(x xᵀ)`` have an entry above 0.9."""
    return torch.softmax(x @ x.transpose(-1, -2), dim=-1).max() > 0.9


@pytest.mark.parametrize(
    "read, preset", [("bool", AttnLRP), ("int", AttnLRP), ("item", AttnLRP), ("weights", CPLRP), ("indices", AttnLRP)]
)
def test_a_forward_that_branches_on_the_inputs_values_keeps_the_mode(applied, read: str, preset):
    """Before, the plan recorded on one branch halved the other branch's product too: half the relevance of the
    fresh wrapper's first call, silently. Attention weights that CP-LRP holds are constants to the rules, but their
    values are the input's too."""
    torch.manual_seed(0)
    model = Branching(read).to(F64)
    inputs = [torch.randn(3, 4, dtype=F64) for _ in range(40)]
    branches = {"weights": lambda x: bool(peaked(x)), "indices": lambda x: bool(x.sum(-1).argmax() == 0)}
    taken = [branches.get(read, lambda x: bool(x.sum() > 0))(x) for x in inputs]
    positive = [x for x, first in zip(inputs, taken, strict=True) if first][:2]
    negative = [x for x, first in zip(inputs, taken, strict=True) if not first][:2]
    xs = [positive[0], negative[0], positive[1], negative[1]]
    lrp = LRP(model, preset(), in_keys=["x"], out_keys=["y"])
    with lrp:
        later = [call(lrp, x) for x in xs]
    assert applied == []
    for x, relevance in zip(xs, later, strict=True):
        fresh = call(LRP(model, preset(), in_keys=["x"], out_keys=["y"]), x)
        assert relative_error(relevance, fresh) <= 1e-12


class DroppedProduct(Product):
    """``out(dropout(a * b))`` with a dropout function, as eager attention drops its weights."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(nn.functional.dropout(self.q(x) * self.k(x), 0.5, training=self.training))


def test_a_dropout_call_that_drops_keeps_every_call_in_the_mode_and_warned_of(applied):
    """A random call is a rule of its own (a warning at each call), which the graph path would skip."""
    torch.manual_seed(0)
    model = DroppedProduct().double()
    lrp = LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"])
    td = TensorDict(x=torch.randn(5, 4, dtype=F64), batch_size=[5])
    with lrp:
        for _ in range(3):
            with pytest.warns(UserWarning, match="calls dropout"):
                lrp(td.clone())
    assert applied == []  # no call had a plan: each ran in the mode
    model.eval()  # nothing dropped: the later calls take the graph path, with no warning
    with lrp:
        first = lrp(td.clone())["relevance", "x"]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            later = lrp(td.clone())["relevance", "x"]
    assert applied == [True]  # the later call ran by its plan, without the mode
    assert relative_error(later, by_hand(model, td["x"])) < 1e-12
    assert relative_error(later, first) < 1e-12


class Doubling(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x


def test_a_call_run_again_in_the_mode_starts_from_the_inputs_it_was_given(monkeypatch):
    """A first step that overwrites the key it reads (``x -> 2 x``) must not run twice when the graph differs."""
    model = product_model()
    pipeline = TensorDictSequential(
        TensorDictModule(Doubling(), in_keys=["x"], out_keys=["x"]),
        TensorDictModule(model, in_keys=["x"], out_keys=["y"]),
    )
    x = torch.randn(5, 4, dtype=F64)
    lrp = LRP(pipeline, AttnLRP(), in_keys=["x"])
    with lrp:
        call(lrp, x)
        monkeypatch.setattr(_function_rule_plan._Plan, "apply", lambda self, *args: False)  # as if the graph changed
        again = lrp(TensorDict(x=x.clone(), batch_size=[5]))
    assert torch.equal(again["y"], model(2 * x))
    assert relative_error(again["relevance", "x"], by_hand(model, 2 * x)) < 1e-12  # x times the gradient in x


class ScalingInPlace(nn.Module):
    """``x.mul_(2)`` on its input, then a counter of calls ``steps.add_(1)`` where it is given one."""

    def __init__(self) -> None:
        super().__init__()
        self.model = product_model()

    def forward(self, x: torch.Tensor, steps: torch.Tensor | None = None) -> torch.Tensor:
        x.mul_(2.0)
        if steps is not None:
            steps.add_(1)
        return self.model(x)


def test_a_call_run_again_in_the_mode_starts_from_the_values_it_was_given(applied):
    """A model that changes its explained input in place (``x.mul_(2)``) must not see it changed twice when the
    graph differs: the second run saw ``4 x``, the output 0.53 and the relevance 1.1 off (relative) on a softmax
    attention model under AttnLRP."""
    net = ScalingInPlace()
    x = torch.randn(5, 4, dtype=F64)
    lrp = LRP(net, AttnLRP(), in_keys=["x"], out_keys=["y"])
    with lrp:
        call(lrp, x)
        call(lrp, x)  # the plan of the first call
        net.model.extra = True
        again = lrp(TensorDict(x=x.clone(), batch_size=[5]))  # the same shapes, another graph: runs again
    assert applied == [True, False]
    assert torch.equal(again["y"], net.model(2 * x))
    assert relative_error(again["relevance", "x"], by_hand(net.model, 2 * x)) < 1e-12  # x · gradient in x


class Noisy(nn.Module):
    """A product model whose output draws noise from the global random state (a policy's sampled action)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = product_model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.model(x)
        return y + 0.1 * torch.randn_like(y)


def test_a_call_run_again_in_the_mode_draws_what_the_run_let_go_drew(monkeypatch):
    """The second run drew the next numbers: another output than the plain call's under the same seed, and the
    caller's random state moved twice."""
    net, x = Noisy(), torch.randn(5, 4, dtype=F64)
    lrp = LRP(net, AttnLRP(), in_keys=["x"], out_keys=["y"])
    with lrp:
        call(lrp, x)
        call(lrp, x)  # the plan of the first call
        monkeypatch.setattr(_function_rule_plan._Plan, "apply", lambda self, *args: False)  # as if the graph changed
        torch.manual_seed(3)
        again, draw = lrp(TensorDict(x=x.clone(), batch_size=[5])), torch.rand(3)
    torch.manual_seed(3)
    with torch.no_grad():
        expected = net(x)
    assert torch.equal(again["y"], expected) and torch.equal(draw, torch.rand(3))


def test_a_model_that_changes_an_input_it_is_not_explained_for_in_place_is_refused_where_the_call_runs_again(applied):
    """An input that is not explained is the caller's tensor: a call that runs the model again would change it
    twice (``steps`` counted 2 for one call), and nothing can put it back."""
    net = ScalingInPlace()
    x = torch.randn(5, 4, dtype=F64)
    lrp = LRP(TensorDictModule(net, in_keys=["x", "steps"], out_keys=["y"]), AttnLRP(), in_keys=["x"])
    with lrp:
        for _ in range(2):
            td = TensorDict(x=x.clone(), steps=torch.zeros(5, dtype=torch.long), batch_size=[5])
            lrp(td)
            assert td["steps"].tolist() == [1] * 5
        net.model.extra = True
        td = TensorDict(x=x.clone(), steps=torch.zeros(5, dtype=torch.long), batch_size=[5])
        with pytest.raises(RuntimeError, match=r"changed its input 'steps' in place"):
            lrp(td)
    assert td["steps"].tolist() == [1] * 5  # one run's change, as the model's own call makes
    assert set(td.keys()) == {"x", "steps"}


PLANNED = {("bert", "sdpa"), ("mixtral", "eager"), ("gemma3", "sdpa"), ("falcon", "eager"), ("deit", "sdpa")}
PLANNED |= {("whisper", "sdpa"), ("deberta_v2", "eager"), ("convbert", "eager")}  # F.gelu called as a function


@pytest.mark.parametrize("preset", [AttnLRP, CPLRP])
@pytest.mark.parametrize(
    ("name", "implementation"),
    [(name, implementation) for name in sorted(ZOO) for implementation in ZOO[name].implementations()],
)
def test_zoo_models_calls_in_a_context_equal_a_call_in_the_mode(applied, name: str, implementation: str, preset):
    """Every call of a context (the recording one, then those that may take the graph's way) equals a call that
    runs in the mode, to the last bit, with no warning, on every architecture of the transformer zoo; an encoder, a
    mixture of experts, Gemma 3, multi-query attention and a vision transformer take the graph's way."""
    architecture = ZOO[name]
    explained, x = Explained(architecture.build(implementation), architecture.inputs), model_input(architecture)
    lrp = LRP(explained, preset(), in_keys=["x"], out_keys=["y"])
    in_mode = call(lrp, x)
    with lrp, warnings.catch_warnings():
        warnings.simplefilter("error")
        relevances = [call(lrp, x) for _ in range(3)]
    if (name, implementation) in PLANNED:
        assert applied == [True, True]
    for relevance in relevances:
        assert torch.equal(relevance, in_mode)


def test_a_lazy_stack_with_entries_of_different_shapes_is_explained_in_a_context(applied):
    """The signature of a call's inputs stacked every entry of a ``LazyStackedTensorDict``: one whose stacked
    TensorDicts hold entries of different shapes failed before the model ran. Such a call runs in the mode."""
    from tensordict import LazyStackedTensorDict

    model, x = product_model(), torch.randn(5, 4, dtype=F64)
    lrp = LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"])
    with lrp:
        for _ in range(3):
            parts = [TensorDict(x=x[i].clone(), extra=torch.zeros(i + 1), batch_size=[]) for i in range(5)]
            out = lrp(LazyStackedTensorDict.lazy_stack(parts, 0))
            assert relative_error(out["relevance", "x"], by_hand(model, x)) < 1e-12
