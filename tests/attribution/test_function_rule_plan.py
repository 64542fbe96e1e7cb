"""Later calls of a context find AttnLRP's products (and CP-LRP's held tensors) in the autograd graph instead of
through the function mode.

The oracles: the uniform rule written into the forward pass of ``out(q(x) * k(x))`` by hand (bias-free layers, so
that the rest is gradient × input), and held tensors detached by hand; and, for Hugging Face's GPT-2 and Llama, a
call that runs in the function mode alone (the one the LXT tests check).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule, TensorDictSequential
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from tdhook.attribution import CPLRP, LRP, AttnLRP, _function_rule_plan
from tdhook.attribution.rules.functional import FunctionalRules
from tdhook.attribution.rules.transformer import PseudoIdentityRule, SoftmaxEpsilonRule
from tests.attribution.test_lrp_huggingface import LastLogits, build
from tests.attribution.test_lrp_transformer_zoo import ZOO, Explained, model_input
from tests.conftest import relative_error

F64 = torch.float64


class Product(nn.Module):
    """``out(a * b)`` with ``a = q(x)``, ``b = k(x)``, no biases; ``a + b`` instead where ``product`` is false, one
    product more (``a * b * v(x)``) with ``extra``, and a copy of ``b`` (one autograd node more, on no path to the
    product) with ``copy``. The flags change the graph between calls on inputs of one shape."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(4, 6, bias=False) for _ in range(3))
        self.out = nn.Linear(6, 3, bias=False)
        self.product, self.extra, self.copy = True, False, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.q(x), self.k(x)
        if self.copy:
            b = b.clone()
        h = a * b if self.product else a + b
        if self.extra:
            h = h * self.v(x)
        return self.out(h)


def halved(t: torch.Tensor) -> torch.Tensor:
    """``t`` with half of its gradient: the uniform rule on a product, written out."""
    return 0.5 * t + 0.5 * t.detach()


def by_hand(model: Product, x: torch.Tensor) -> torch.Tensor:
    """AttnLRP's relevance for ``model``'s argmax logit, with the uniform rule written into the forward pass: each
    product's gradient halved, then gradient × input (every layer is linear and bias-free: LRP-0 is the gradient)."""
    leaf = x.clone().requires_grad_(True)
    a, b = model.q(leaf), model.k(leaf)
    h = halved(a * b) if model.product else a + b
    if model.extra:
        h = halved(h * model.v(leaf))
    logits = model.out(h)
    (grad,) = torch.autograd.grad(logits.max(-1).values.sum(), leaf)
    return leaf.detach() * grad


@pytest.fixture
def applied(monkeypatch) -> list[bool]:
    """Whether each call that had a plan found its recorded graph (and so ran without the mode)."""
    results: list[bool] = []
    apply = _function_rule_plan._Plan.apply

    def watched(self, *args):
        results.append(apply(self, *args))
        return results[-1]

    monkeypatch.setattr(_function_rule_plan._Plan, "apply", watched)
    return results


def call(lrp: LRP, x: torch.Tensor) -> torch.Tensor:
    return lrp(TensorDict(x=x.clone(), batch_size=x.shape[:1]))["relevance", "x"]


def product_model() -> Product:
    torch.manual_seed(0)
    return Product().to(F64)


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

    torch.manual_seed(0)
    model, x = Attention().to(F64), torch.randn(2, 3, 4, dtype=F64)
    lrp = LRP(model, AttnLRP(softmax_epsilon=0.1), in_keys=["x"], out_keys=["y"])
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
        norms = [len(plan.plain) for plan in plans(lrp)]
        starts = [plan.norm_outputs for plan in plans(lrp)]  # paths start from every norm's output too
    # AttnLRP's rules inside these models are the uniform rule on products, and CP-LRP's hold the attention weights
    # and the gates: later calls take the graph's way with both.
    assert applied == [True, True]
    # Llama's RMSNorms (written out) run plainly with their scales cut; GPT-2's LayerNorms (F.layer_norm) run
    # plainly with the rule's hook on their fused node.
    assert norms == [5]
    assert starts == [5]
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
        source = x if reads[self.read]() else self.constant.expand_as(x)
        return self.out(self.q(x) * self.k(source))


def peaked(x: torch.Tensor) -> torch.Tensor:
    """Whether the attention weights ``softmax(x xᵀ)`` have an entry above 0.9."""
    return torch.softmax(x @ x.transpose(-1, -2), dim=-1).max() > 0.9


@pytest.mark.parametrize("read, preset", [("bool", AttnLRP), ("int", AttnLRP), ("item", AttnLRP), ("weights", CPLRP)])
def test_a_forward_that_branches_on_the_inputs_values_keeps_the_mode(applied, read: str, preset):
    """Before, the plan recorded on one branch halved the other branch's product too: half the relevance of the
    fresh wrapper's first call, silently. Attention weights that CP-LRP holds are constants to the rules, but their
    values are the input's too."""
    torch.manual_seed(0)
    model = Branching(read).to(F64)
    inputs = [torch.randn(3, 4, dtype=F64) for _ in range(40)]
    taken = [bool(peaked(x)) if read == "weights" else bool(x.sum() > 0) for x in inputs]
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


class HandNorm(nn.Module):
    """An RMS norm written out, as Hugging Face writes Llama's; ``variant`` picks how, ``held`` detaches the scale
    (the rule, written by hand)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, size))
        self.variant, self.held = "rsqrt", False

    def scale(self, t: torch.Tensor, root) -> torch.Tensor:
        s = root(t.pow(2).mean(-1, keepdim=True) + 1e-6)
        return s.detach() if self.held else s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.variant == "sqrt":
            return self.weight * (x / self.scale(x, torch.sqrt))
        if self.variant == "input changed in place":  # after its square was taken: the square's backward reads it
            x = x * 1.0
            s = self.scale(x, torch.rsqrt)
            x.mul_(1.0)
            return self.weight * (x * s)
        if self.variant == "product's input changed in place":  # a plain product's backward reads it for the scale
            y = x * 1.0
            h = y * self.scale(x, torch.rsqrt)
            y.add_(0.0)
            return self.weight * h
        return self.weight * (x * self.scale(x, torch.rsqrt))


class NormedProduct(Product):
    """``out(norm(a * b))``: the uniform rule on the product, the norm's scale held constant."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = HandNorm(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.q(x) * self.k(x)))


def norm_by_hand(model: NormedProduct, x: torch.Tensor, rule: bool = True) -> torch.Tensor:
    """AttnLRP's relevance for ``model``, with the product's gradient halved and the norm's scale detached by hand
    (``rule`` false: the plain gradient of both, gradient × input)."""
    leaf = x.clone().requires_grad_(True)
    product = model.q(leaf) * model.k(leaf)
    model.norm.held = rule
    try:
        logits = model.out(model.norm(halved(product) if rule else product))
    finally:
        model.norm.held = False
    (grad,) = torch.autograd.grad(logits.max(-1).values.sum(), leaf)
    return leaf.detach() * grad


def normed_model() -> NormedProduct:
    torch.manual_seed(0)
    return NormedProduct().to(F64)


def plans(lrp: LRP) -> list:
    return [plan for plan in lrp._function_rule_plan._plans.values() if plan is not None]


@pytest.mark.parametrize("variant", ["rsqrt", "sqrt"])
def test_later_calls_run_a_norm_plainly_and_cut_its_scale_in_the_graph(applied, variant: str):
    model, x = normed_model(), torch.randn(5, 4, dtype=F64)
    model.norm.variant = variant
    expected = norm_by_hand(model, x)
    lrp = LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"])
    with lrp:
        first, *later = (call(lrp, x) for _ in range(3))
        (plan,) = plans(lrp)
    assert applied == [True, True]
    assert plan.plain == {id(model.norm)}  # the norm's forward ran without its mode
    assert relative_error(first, expected) <= 1e-12
    for relevance in later:
        assert torch.equal(relevance, first)  # the mode's relevance, to the last bit
    # The scale's plain gradient gives another relevance: the comparison can fail.
    assert relative_error(norm_by_hand(model, x, rule=False), 2 * expected) > 1e-3


def test_a_norm_whose_graph_changed_runs_again_in_the_mode(applied):
    model, x = normed_model(), torch.randn(5, 4, dtype=F64)
    lrp = LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"])
    with lrp:
        call(lrp, x)
        call(lrp, x)  # by the plan: the norm's rsqrt cut
        model.norm.variant = "sqrt"  # another node where the plan expects rsqrt's
        changed = call(lrp, x)
        again = call(lrp, x)  # by the plan the changed call recorded
    assert applied == [True, False, True]
    expected = norm_by_hand(model, x)
    assert relative_error(changed, expected) <= 1e-12
    assert torch.equal(again, changed)


@pytest.mark.parametrize("variant", ["input changed in place", "product's input changed in place"])
def test_a_norm_whose_plain_backward_would_read_tensors_changed_in_place_keeps_its_mode(applied, variant: str):
    """A plain call runs the backward of the scale's branch and of the product that takes the scale, which read
    tensors that the mode's graph never reads; changed in place, they would raise in the backward pass."""
    model, x = normed_model(), torch.randn(5, 4, dtype=F64)
    model.norm.variant = variant
    lrp = LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"])
    with lrp:
        first, *later = (call(lrp, x) for _ in range(3))
        (plan,) = plans(lrp)
    assert applied == [True, True]  # the product still by the plan
    assert plan.plain == frozenset()  # the norm in its mode
    assert relative_error(first, norm_by_hand(model, x)) <= 1e-12
    for relevance in later:
        assert torch.equal(relevance, first)


class LayerNormedProduct(Product):
    """``out(layer_norm(a * b))`` with a fused layer norm, a module's or called as a function; with ``in_place``,
    the norm's input is changed in place after the norm (its own backward, which reads it, would raise)."""

    def __init__(self, functional: bool = False, in_place: bool = False) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.linspace(0.5, 1.5, 6)), nn.Parameter(torch.linspace(-0.5, 0.5, 6))
        self.norm = None if functional else nn.LayerNorm(6)
        if self.norm is not None:
            self.norm.weight, self.norm.bias = self.weight, self.bias
        self.in_place = in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        product = self.q(x) * self.k(x)
        if self.norm is None:
            normed = F.layer_norm(product, (6,), self.weight, self.bias)
        else:
            normed = self.norm(product)
        if self.in_place:
            product.mul_(1.0)
        return self.out(normed)


def layer_norm_by_hand(model: LayerNormedProduct, x: torch.Tensor) -> torch.Tensor:
    """AttnLRP's relevance for ``model``: the product's gradient halved, the norm's ``σ`` detached, by hand."""
    leaf = x.clone().requires_grad_(True)
    product = halved(model.q(leaf) * model.k(leaf))
    centred = product - product.mean(-1, keepdim=True)
    sigma = (product.detach().var(-1, unbiased=False, keepdim=True) + 1e-5).sqrt()
    logits = model.out(centred / sigma * model.weight + model.bias)
    (grad,) = torch.autograd.grad(logits.max(-1).values.sum(), leaf)
    return leaf.detach() * grad


@pytest.mark.parametrize("functional", [False, True], ids=["module", "function"])
def test_later_calls_run_a_fused_layer_norm_plainly_with_the_rule_on_its_node(applied, functional: bool):
    torch.manual_seed(0)
    model, x = LayerNormedProduct(functional).to(F64), torch.randn(5, 4, dtype=F64)
    lrp = LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"])
    in_mode = call(lrp, x)  # a call that enters its context runs in the mode
    with lrp:
        first, *later = (call(lrp, x) for _ in range(3))
        (plan,) = plans(lrp)
    assert applied == [True, True]
    assert plan.plain == (frozenset() if functional else {id(model.norm)})
    assert relative_error(first, layer_norm_by_hand(model, x)) <= 1e-12
    for relevance in [first, *later]:
        assert torch.equal(relevance, in_mode)  # the mode's relevance, to the last bit
    # The norm's plain gradient gives another relevance: the comparison can fail.
    leaf = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(model(leaf).max(-1).values.sum(), leaf)
    assert relative_error(leaf.detach() * grad / 2, first) > 1e-3


def test_a_fused_layer_norm_whose_input_is_changed_in_place_after_it_keeps_its_mode(applied):
    """The rule on the norm's node runs the node's own backward, which reads the input: changed in place after the
    forward, it would raise. The recording call finds it and runs again in the mode, whose rule does not run it."""
    torch.manual_seed(0)
    model, x = LayerNormedProduct(in_place=True).to(F64), torch.randn(5, 4, dtype=F64)
    leaf = x.clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match="inplace"):  # a plain gradient cannot run at all
        torch.autograd.grad(model(leaf).sum(), leaf)
    lrp = LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"])
    with lrp:
        first, *later = (call(lrp, x) for _ in range(3))
    assert applied == []  # every call in the mode
    model.in_place = False  # the same function: the change in place comes after the norm's output was taken
    assert relative_error(first, layer_norm_by_hand(model, x)) <= 1e-12
    for relevance in later:
        assert torch.equal(relevance, first)


class ConditionedLayerNorm(nn.Module):
    """A fused layer norm over the last dimension with the weight and bias it is given (an adaptive norm's)."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (6,), weight, bias)


class ConditionedNorm(Product):
    """``out(layer_norm(a * b, w, flip(w)))`` with ``w = v(mean of x over the batch)``: a norm whose weight and
    bias are computed from the explained input, in a norm module or a call of the function."""

    def __init__(self, functional: bool) -> None:
        super().__init__()
        self.norm = None if functional else ConditionedLayerNorm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.v(x.mean(0))
        args = (self.q(x) * self.k(x), weight, weight.flip(-1))
        return self.out(F.layer_norm(args[0], (6,), *args[1:]) if self.norm is None else self.norm(*args))


def conditioned_by_hand(model: ConditionedNorm, x: torch.Tensor, constant: bool = True) -> torch.Tensor:
    """AttnLRP's relevance for ``model``, by hand: the product halved, ``σ`` detached, and the norm's weight and
    bias its constants (``constant``), as they are to the rule's node in the mode."""
    leaf = x.clone().requires_grad_(True)
    product = halved(model.q(leaf) * model.k(leaf))
    weight = model.v(leaf.mean(0))
    weight = weight.detach() if constant else weight
    sigma = (product.detach().var(-1, unbiased=False, keepdim=True) + 1e-5).sqrt()
    logits = model.out((product - product.mean(-1, keepdim=True)) / sigma * weight + weight.flip(-1))
    (grad,) = torch.autograd.grad(logits.max(-1).values.sum(), leaf)
    return leaf.detach() * grad


@pytest.mark.parametrize("functional", [False, True], ids=["module", "function"])
def test_a_fused_layer_norms_weight_and_bias_computed_from_the_input_get_no_relevance(applied, functional: bool):
    """The mode's rule passes the norm's input alone a gradient; the hook on the norm's node passes its weight and
    bias none either, though the node computes theirs."""
    torch.manual_seed(0)
    model, x = ConditionedNorm(functional).to(F64), torch.randn(5, 4, dtype=F64)
    lrp = LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"])
    in_mode = call(lrp, x)
    with lrp:
        first, *later = (call(lrp, x) for _ in range(3))
    assert applied == [True, True]
    assert relative_error(first, conditioned_by_hand(model, x)) <= 1e-12
    for relevance in [first, *later]:
        assert torch.equal(relevance, in_mode)
    # The gradient through the weight and bias gives another relevance: the comparison can fail.
    assert relative_error(conditioned_by_hand(model, x, constant=False), first) > 1e-3


class SwitchedLayerNorm(Product):
    """``out(layer_norm(a * b, shape))`` on inputs ``[N, 2, 4]``, over the last dimension or the last two as
    ``shape`` says: the graph's nodes are the same either way."""

    def __init__(self) -> None:
        super().__init__()
        self.out, self.shape = nn.Linear(12, 3, bias=False), (6,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.layer_norm(self.q(x) * self.k(x), self.shape).flatten(-2))


def switched_by_hand(model: SwitchedLayerNorm, x: torch.Tensor) -> torch.Tensor:
    """AttnLRP's relevance for ``model``, by hand: the product halved, ``σ`` detached, over ``model.shape``."""
    leaf, dims = x.clone().requires_grad_(True), tuple(range(-len(model.shape), 0))
    product = halved(model.q(leaf) * model.k(leaf))
    sigma = (product.detach().var(dims, unbiased=False, keepdim=True) + 1e-5).sqrt()
    logits = model.out(((product - product.mean(dims, keepdim=True)) / sigma).flatten(-2))
    (grad,) = torch.autograd.grad(logits.max(-1).values.sum(), leaf)
    return leaf.detach() * grad


def test_a_fused_layer_norm_takes_its_normalised_dimensions_from_its_node(applied):
    """A norm whose normalised dimensions change between calls on inputs of one shape (a module's attribute): the
    graph's nodes are the recorded ones, and the rule's hook centres over the dimensions the node normalised."""
    torch.manual_seed(0)
    model, x = SwitchedLayerNorm().to(F64), torch.randn(5, 2, 4, dtype=F64)
    lrp = LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"])
    with lrp:
        for shape in [(6,), (2, 6)]:
            model.shape = shape
            relevances = [call(lrp, x) for _ in range(2)]
            expected = switched_by_hand(model, x)
            for relevance in relevances:
                assert relative_error(relevance, expected) <= 1e-12
    assert applied[-1] is True  # the last call by the plan the first ones recorded
    assert relative_error(switched_by_hand(model, x), expected) <= 1e-12
    model.shape = (6,)  # the other dimensions give another relevance: the comparison can fail
    assert relative_error(switched_by_hand(model, x), expected) > 1e-3


class RenormalisedLayerNorm(nn.Module):
    """A fused layer norm whose output is normalised again with ``torch.var_mean``, whose variance the rule holds:
    the norm keeps its mode in every call."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.layer_norm(x, (6,), self.weight)
        var, mean = torch.var_mean(h, -1, keepdim=True)
        return (h - mean) * torch.rsqrt(var + 1e-5)


class RenormalisedProduct(Product):
    """``out(norm(a * b))`` with a :class:`RenormalisedLayerNorm`."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = RenormalisedLayerNorm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.q(x) * self.k(x)))


def test_a_norm_that_keeps_its_mode_leaves_its_fused_layer_norm_to_the_plan(applied):
    """The recording call puts the rule on the fused layer norm's node, inside a norm whose mode holds more: in a
    later call the norm's mode leaves that node plain, and the plan puts the same hook on it."""
    torch.manual_seed(0)
    model, x = RenormalisedProduct().to(F64), torch.randn(5, 4, dtype=F64)
    lrp = LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"])
    in_mode = call(lrp, x)
    with lrp:
        first, *later = (call(lrp, x) for _ in range(3))
        norms = [plan.plain for plan in plans(lrp)]
    assert applied == [True, True]
    assert norms == [frozenset()]  # the norm in its mode
    leaf = x.clone().requires_grad_(True)
    product = halved(model.q(leaf) * model.k(leaf))
    sigma = (product.detach().var(-1, unbiased=False, keepdim=True) + 1e-5).sqrt()
    h = (product - product.mean(-1, keepdim=True)) / sigma * model.norm.weight
    renormalised = (h - h.mean(-1, keepdim=True)) * torch.rsqrt(h.detach().var(-1, keepdim=True) + 1e-5)
    (grad,) = torch.autograd.grad(model.out(renormalised).max(-1).values.sum(), leaf)
    assert relative_error(first, leaf.detach() * grad) <= 1e-12
    for relevance in [first, *later]:
        assert torch.equal(relevance, in_mode)


class CheckpointedLayerNorm(nn.Module):
    """``out(norm(lin(x)))`` with the norm in a ``torch.utils.checkpoint`` region; ``runs`` counts its forwards."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm, self.out = nn.Linear(4, 6, bias=False), nn.LayerNorm(6), nn.Linear(6, 3, bias=False)
        self.runs = 0

    def region(self, h: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        return self.norm(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(checkpoint(self.region, self.lin(x), use_reentrant=False))


def test_a_fused_layer_norm_in_a_checkpoint_region_computes_its_own_scale(applied):
    """The scale its node saved would be read through the region's saved-tensor hooks, which run the region's
    forward again to give it: the rule computes the scale itself, and the region runs once in each forward and
    once in each backward pass."""
    torch.manual_seed(0)
    model, x = CheckpointedLayerNorm().to(F64), torch.randn(5, 4, dtype=F64)
    lrp = LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"])
    in_mode = call(lrp, x)
    with lrp:
        relevances = [call(lrp, x) for _ in range(3)]
    assert model.runs == 2 * 4
    leaf = x.clone().requires_grad_(True)
    h = model.lin(leaf)
    sigma = (h.detach().var(-1, unbiased=False, keepdim=True) + 1e-5).sqrt()
    logits = model.out((h - h.mean(-1, keepdim=True)) / sigma * model.norm.weight + model.norm.bias)
    (grad,) = torch.autograd.grad(logits.max(-1).values.sum(), leaf)
    for relevance in [in_mode, *relevances]:
        assert relative_error(relevance, leaf.detach() * grad) <= 1e-12
        assert torch.equal(relevance, in_mode)


class ActivatedProduct(Product):
    """``out(f(q(x)) * k(x))`` with ``f`` an activation called as a function; with ``in_place``, ``f``'s input is
    changed in place after the call (its node's own backward, which reads it, would raise)."""

    def __init__(self, activation, in_place: bool = False) -> None:
        super().__init__()
        self.activation, self.in_place = activation, in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.q(x)
        activated = self.activation(h)
        if self.in_place:
            h.mul_(1.0)
        return self.out(activated * self.k(x))


def activated_by_hand(model: ActivatedProduct, x: torch.Tensor) -> torch.Tensor:
    """AttnLRP's relevance for ``model``: ``f``'s input gets ``grad · f(h) / h``, the product's gradient halved."""
    leaf = x.clone().requires_grad_(True)
    h = model.q(leaf)
    activated = h * (model.activation(h) / h).detach()  # the identity rule: the relevance passes as it is
    logits = model.out(halved(activated * model.k(leaf)))
    (grad,) = torch.autograd.grad(logits.max(-1).values.sum(), leaf)
    return leaf.detach() * grad


@pytest.mark.parametrize("activation", [F.gelu, F.silu], ids=["gelu", "silu"])
def test_later_calls_put_a_functional_activations_rule_on_its_node(applied, activation):
    torch.manual_seed(0)
    model, x = ActivatedProduct(activation).to(F64), torch.randn(5, 4, dtype=F64)
    lrp = LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"])
    in_mode = call(lrp, x)  # a call that enters its context runs in the mode
    with lrp:
        first, *later = (call(lrp, x) for _ in range(3))
    assert applied == [True, True]
    assert relative_error(first, activated_by_hand(model, x)) <= 1e-9  # the stabiliser's 1e-10 aside
    for relevance in [first, *later]:
        assert torch.equal(relevance, in_mode)  # the mode's relevance, to the last bit
    # The activation's plain gradient gives another relevance: the comparison can fail.
    leaf = x.clone().requires_grad_(True)
    logits = model.out(halved(activation(model.q(leaf)) * model.k(leaf)))
    (grad,) = torch.autograd.grad(logits.max(-1).values.sum(), leaf)
    assert relative_error(leaf.detach() * grad, first) > 1e-3


def test_a_functional_activation_whose_input_is_changed_in_place_after_it_keeps_its_mode(applied):
    torch.manual_seed(0)
    model, x = ActivatedProduct(F.gelu, in_place=True).to(F64), torch.randn(5, 4, dtype=F64)
    lrp = LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"])
    with lrp:
        first, *later = (call(lrp, x) for _ in range(3))
    assert applied == []  # every call in the mode: the recording call ran again there
    model.in_place = False  # the same function: the change comes after the activation was taken
    assert relative_error(first, activated_by_hand(model, x)) <= 1e-9
    for relevance in later:
        assert torch.equal(relevance, first)


class SigmoidGated(Product):
    """``out(sigmoid(q(x)) * v(x))``, the gate called as a function (a mixture of experts' shared-expert gate); with
    ``reused``, the gate is also added to the output as a signal, which its own rule then reaches."""

    def __init__(self, reused: bool = False) -> None:
        super().__init__()
        self.reused = reused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.q(x))
        return self.out(gate * self.v(x) + (gate if self.reused else 0.0))


@pytest.mark.parametrize("preset", [AttnLRP, CPLRP])
@pytest.mark.parametrize("reused", [False, True], ids=["held", "reused"])
def test_a_functional_sigmoid_gate_needs_no_rule_where_every_product_holds_it(applied, preset, reused: bool):
    torch.manual_seed(0)
    model, x = SigmoidGated(reused).to(F64), torch.randn(5, 4, dtype=F64)
    lrp = LRP(model, preset(), in_keys=["x"], out_keys=["y"])
    in_mode = call(lrp, x)  # a call that enters its context runs in the mode
    with lrp:
        relevances = [call(lrp, x) for _ in range(3)]
    # Held alone, the gate takes no gradient: later calls run without the mode. Reused, its rule matters: the
    # recording call runs again in the mode, and so do the later ones.
    assert applied == ([] if reused else [True, True])
    for relevance in relevances:
        assert torch.equal(relevance, in_mode)
    # By hand: the gate held (no gradient into it) in the product; reused, the identity rule on its other path.
    leaf = x.clone().requires_grad_(True)
    h = model.q(leaf)
    gate = torch.sigmoid(h)
    signal = h * (gate / h).detach() if reused else 0.0
    logits = model.out(gate.detach() * model.v(leaf) + signal)
    (grad,) = torch.autograd.grad(logits.max(-1).values.sum(), leaf)
    assert relative_error(in_mode, leaf.detach() * grad) <= 1e-8  # the identity rule's stabiliser (1e-10) aside
    assert (
        relative_error(in_mode, leaf.detach() * torch.autograd.grad(model(leaf).max(-1).values.sum(), leaf)[0]) > 1e-3
    )


class BiasedAttention(Product):
    """``out(sdpa(q(x), k(x), v(x), mask=bias))`` with a learned bias as the mask: a mask that requires grad makes
    torch compute the fused attention by several nodes (its math path)."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(1, 5, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.scaled_dot_product_attention(self.q(x), self.k(x), self.v(x), attn_mask=self.bias))


@pytest.mark.parametrize("preset", [AttnLRP, CPLRP])
def test_a_fused_attention_computed_by_several_nodes_takes_the_graph_s_way(applied, preset):
    torch.manual_seed(0)
    model, x = BiasedAttention().to(F64), torch.randn(3, 5, 4, dtype=F64)
    lrp = LRP(model, preset(), in_keys=["x"], out_keys=["y"])
    in_mode = call(lrp, x)  # a call that enters its context runs in the mode
    with lrp:
        relevances = [call(lrp, x) for _ in range(3)]
    assert applied == [True, True]
    for relevance in relevances:
        assert torch.equal(relevance, in_mode)
    # By hand: AttnLRP halves q · kᵀ and attention · v; CP-LRP holds the attention weights.
    leaf = x.clone().requires_grad_(True)
    q, k, v = model.q(leaf), model.k(leaf), model.v(leaf)
    held = preset is CPLRP
    scores = (q @ k.transpose(-2, -1) if held else halved(q @ k.transpose(-2, -1))) / 6**0.5 + model.bias
    weights = torch.softmax(scores, -1)
    attended = weights.detach() @ v if held else halved(weights @ v)
    (grad,) = torch.autograd.grad(model.out(attended).max(-1).values.sum(), leaf)
    assert relative_error(in_mode, leaf.detach() * grad) <= 1e-12
    plain = torch.autograd.grad(model(leaf).max(-1).values.sum(), leaf)[0]
    assert relative_error(in_mode, leaf.detach() * plain) > 1e-3


class PlainActivations(PseudoIdentityRule):
    """A rule of one's own for activations called as functions: their plain gradient."""

    def apply(self, output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return output


class PlainActivationsLRP(AttnLRP):
    """AttnLRP whose function rules give activations :class:`PlainActivations`."""

    def function_modes(self) -> list:
        return [FunctionalRules(SoftmaxEpsilonRule(), PlainActivations())]


def test_an_identity_rule_of_ones_own_keeps_its_gradient_on_functional_activations(applied):
    torch.manual_seed(0)
    model, x = ActivatedProduct(F.gelu).to(F64), torch.randn(5, 4, dtype=F64)
    lrp = LRP(model, PlainActivationsLRP(), in_keys=["x"], out_keys=["y"])
    in_mode = call(lrp, x)
    with lrp:
        relevances = [call(lrp, x) for _ in range(3)]
    leaf = x.clone().requires_grad_(True)  # by hand: the plain gradient of the activation, the product's halved
    logits = model.out(halved(F.gelu(model.q(leaf)) * model.k(leaf)))
    (grad,) = torch.autograd.grad(logits.max(-1).values.sum(), leaf)
    assert relative_error(in_mode, leaf.detach() * grad) <= 1e-12
    for relevance in relevances:
        assert torch.equal(relevance, in_mode)


class ChangedAfterActivation(ActivatedProduct):
    """``out(f(h) * k(x) + h + 1)`` with ``h = q(x)``: ``h + 1`` computed anew, or with ``in_place`` in place in
    ``h``, which ``f``'s node saved; one node either way, so that the graph differs in that tensor's version alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.q(x)
        activated = self.activation(h)
        h = h.add_(1.0) if self.in_place else h + 1.0
        return self.out(activated * self.k(x) + h)


@pytest.mark.parametrize(
    "activation", [F.gelu, F.silu, lambda h: F.layer_norm(h, (6,))], ids=["gelu", "silu", "layer norm"]
)
def test_a_later_call_that_changes_a_ruled_nodes_saved_input_runs_in_the_mode(applied, activation):
    """A branch the recording call did not take changes the input of an activation (or fused layer norm) whose node
    holds the rule in place, in a graph of the recorded shape: the node's own backward, which the mode never runs,
    could not read it. The call runs in the mode instead of raising."""
    torch.manual_seed(0)
    model, x = ChangedAfterActivation(activation).to(F64), torch.randn(5, 4, dtype=F64)
    lrp = LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"])
    model.in_place = True
    in_mode = call(lrp, x)
    model.in_place = False
    with lrp:
        call(lrp, x)
        call(lrp, x)  # the graph's way
        model.in_place = True
        relevance = call(lrp, x)
    assert applied == [True, False]
    assert torch.equal(relevance, in_mode)
    if activation is not F.gelu:
        return
    leaf = x.clone().requires_grad_(True)  # by hand: the identity rule on f, the product's gradient halved
    h = model.q(leaf)
    logits = model.out(halved(h * (F.gelu(h) / h).detach() * model.k(leaf)) + h + 1.0)
    (grad,) = torch.autograd.grad(logits.max(-1).values.sum(), leaf)
    assert relative_error(relevance, leaf.detach() * grad) <= 1e-9


class FunctionalGelu(nn.Module):
    """A hand-written activation: a module of its own (the element-wise rule's, the mode acting inside it) whose
    forward calls ``F.gelu``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x)


@pytest.mark.parametrize("preset", [AttnLRP, CPLRP])
def test_a_hand_written_activation_calling_gelu_takes_the_graphs_way(applied, preset):
    """The module's rule meets the activation whose node holds the rule in a recording call, and a plain activation
    in a later call: it puts the rule on both alike, so that the later call finds the recorded graph."""
    torch.manual_seed(0)
    model, x = ActivatedProduct(FunctionalGelu()).to(F64), torch.randn(5, 4, dtype=F64)
    lrp = LRP(model, preset(), in_keys=["x"], out_keys=["y"])
    in_mode = call(lrp, x)
    with lrp:
        relevances = [call(lrp, x) for _ in range(4)]
    # The first call of a context tests that the module is element-wise (nodes of its own): the next one records
    # again, and the later ones take the graph's way.
    assert applied[1:] == [True, True]
    if preset is AttnLRP:
        assert relative_error(in_mode, activated_by_hand(model, x)) <= 1e-9
    for relevance in relevances:
        assert torch.equal(relevance, in_mode)


class HeldAttention(nn.Module):
    """``softmax(q(x) k(x)ᵀ) v(x)`` then ``out``, bias-free, with the attention weights also returned through a
    second consumer (``weights * 1`` added to nothing the output reads) and, with ``in_place``, scaled in place
    after the softmax; ``gated`` multiplies the output by ``silu(g(x))`` (a gate under CP-LRP); ``curved`` puts a
    ``sin`` (no rule covers it) on the query."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.g = (nn.Linear(4, 4, bias=False) for _ in range(4))
        self.out = nn.Linear(4, 3, bias=False)
        self.silu = nn.SiLU()
        self.in_place, self.gated, self.held, self.curved = False, False, False, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        query = torch.sin(self.q(x)) if self.curved else self.q(x)
        weights = torch.softmax(query @ self.k(x).transpose(-1, -2), dim=-1)
        if self.held:
            weights = weights.detach()
        if self.in_place:
            weights.mul_(1.0)
        self.seen = weights * 1
        h = weights @ self.v(x)
        if self.gated:
            gate = self.silu(self.g(x))
            h = (gate.detach() if self.held else gate) * h
        return self.out(h)


def held_by_hand(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """CP-LRP's relevance for ``model``'s argmax logit with what its ``held`` flag holds (attention weights, gates)
    detached by hand (the rest is linear and bias-free: LRP-0 is the gradient)."""
    model.held = True
    try:
        leaf = x.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(model(leaf).max(-1).values.sum(), leaf)
    finally:
        model.held = False
    return leaf.detach() * grad


@pytest.mark.parametrize("gated", [False, True])
def test_later_calls_hold_cplrps_attention_weights_and_gates_in_the_graph(applied, gated: bool):
    """The softmax's node passes no gradient, and the product's node none to the gate: what detaching them does."""
    torch.manual_seed(0)
    model, x = HeldAttention().to(F64), torch.randn(2, 3, 4, dtype=F64)
    model.gated = gated
    expected = held_by_hand(model, x)
    lrp = LRP(model, CPLRP(), in_keys=["x"], out_keys=["y"])
    with lrp:
        relevances = [call(lrp, x) for _ in range(3)]
    assert applied == [True, True]
    for relevance in relevances:
        assert relative_error(relevance, expected) <= 1e-12


def test_attention_weights_changed_in_place_run_again_detached(applied):
    """Held without a detach, weights scaled in place leave a softmax node whose backward would raise: the call runs
    again in the mode (weights detached), and so do the later calls."""
    torch.manual_seed(0)
    model, x = HeldAttention().to(F64), torch.randn(2, 3, 4, dtype=F64)
    model.in_place = True
    expected = held_by_hand(model, x)
    lrp = LRP(model, CPLRP(), in_keys=["x"], out_keys=["y"])
    with lrp:
        relevances = [call(lrp, x) for _ in range(3)]
        assert plans(lrp) == []
    assert applied == []
    for relevance in relevances:
        assert relative_error(relevance, expected) <= 1e-12


def test_a_call_that_enters_its_context_records_no_plan(applied):
    """Its context ends with it: a plan would serve no later call."""
    lrp = LRP(product_model(), AttnLRP(), in_keys=["x"], out_keys=["y"])
    recorder = _function_rule_plan.FunctionRulePlan.recorder
    calls = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_function_rule_plan.FunctionRulePlan, "recorder", lambda *a: calls.append(1) or recorder(*a))
        call(lrp, torch.randn(5, 4, dtype=F64))
        assert calls == []
        with lrp:
            call(lrp, torch.randn(5, 4, dtype=F64))
        assert calls == [1]


def test_what_a_held_tensor_is_computed_from_is_not_reported_as_explained():
    """Behind held attention weights and a held gate no relevance flows: a call there that no rule covers (a ``sin``
    on the query, ``silu`` as a function on the gate's input) is not reported, in the first call of a context."""
    torch.manual_seed(0)
    model, x = HeldAttention().to(F64), torch.randn(2, 3, 4, dtype=F64)
    model.curved, model.gated = True, True
    lrp = LRP(model, CPLRP(), in_keys=["x"], out_keys=["y"])
    with lrp, warnings.catch_warnings():
        warnings.simplefilter("error")
        relevance = call(lrp, x)
    assert lrp.coverage().plain_gradient == ()
    assert relative_error(relevance, held_by_hand(model, x)) <= 1e-12


def test_large_attention_weights_are_detached_and_every_call_runs_in_the_mode(applied):
    """Past 2**14 elements, the gradient a plain call would compute for the weights (and drop) costs more than the
    mode: the weights are detached, as in a call that records nothing."""
    torch.manual_seed(0)
    model, x = HeldAttention().to(F64), torch.randn(2, 100, 4, dtype=F64)  # weights of 2 × 100 × 100 elements
    lrp = LRP(model, CPLRP(), in_keys=["x"], out_keys=["y"])
    with lrp:
        relevances = [call(lrp, x) for _ in range(2)]
        assert plans(lrp) == []
    assert applied == []
    for relevance in relevances:
        assert relative_error(relevance, held_by_hand(model, x)) <= 1e-12


class WithAttentions(nn.Module):
    """Next-token logits of a language model asked to return its attention weights too (the held tensors are then
    outputs of the model as well)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.model(inputs_embeds=x, output_attentions=True)
        return (out.logits[:, -1], *out.attentions)


@pytest.mark.parametrize("preset", [AttnLRP, CPLRP])
def test_returned_attention_weights_change_no_call_in_a_context(applied, preset):
    model = build("llama")
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(1), dtype=F64)
    lrp = LRP(WithAttentions(model), preset(), in_keys=["x"], out_keys=["y", "a0", "a1"], target_key="y")
    in_mode = call(lrp, x)
    with lrp:
        relevances = [call(lrp, x) for _ in range(3)]
    assert applied == [True, True]
    for relevance in relevances:
        assert torch.equal(relevance, in_mode)
    assert torch.equal(in_mode, call(LRP(LastLogits(model), preset(), in_keys=["x"], out_keys=["y"]), x))


class CombinedWeights(nn.Module):
    """Attention weights computed head by head (two heads of two features), then combined before they meet the
    values: stacked, copied into a buffer, or written into one by index; with ``mixed``, the buffer then takes the
    scores (an activation) in place too, so that its product with the values is one of two activations. ``held``
    detaches each head's weights (CP-LRP's rule, by hand)."""

    def __init__(self, combine: str, mixed: bool = False) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(4, 4, bias=False) for _ in range(3))
        self.out = nn.Linear(4, 3, bias=False)
        self.combine, self.mixed, self.held = combine, mixed, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (layer(x).unflatten(-1, (2, 2)).transpose(1, 2) for layer in (self.q, self.k, self.v))
        ruled = self.held and self.mixed  # the uniform rule by hand on the products the relevance then reaches
        scores = q @ k.transpose(-1, -2)
        scores = halved(scores) if ruled else scores
        heads = [torch.softmax(scores[:, head], dim=-1) for head in range(2)]
        heads = [weights.detach() for weights in heads] if self.held else heads
        if self.combine == "stack":
            weights = torch.stack(heads, 1)
        else:
            weights = scores.new_zeros(scores.shape)
            for head, head_weights in enumerate(heads):
                if self.combine == "copy":
                    weights[:, head].copy_(head_weights)
                else:
                    weights[:, head] = head_weights
        if self.mixed:
            weights.add_(scores)
        h = weights @ v
        return self.out((halved(h) if ruled else h).transpose(1, 2).flatten(-2))


@pytest.mark.parametrize(
    "combine, mixed", [("stack", False), ("copy", False), ("index", False), ("index", True), ("copy", True)]
)
def test_held_weights_combined_into_new_tensors_stay_constants(applied, combine: str, mixed: bool):
    """Held without a detach, the weights require grad, and so does what is made of them alone (a stack, a buffer
    they are copied or written into): constants all the same, as made of detached weights, whose products with the
    values the uniform rule leaves whole. A buffer that also takes an activation in place is none: that call runs
    again with the weights detached, and keeps the mode."""
    torch.manual_seed(0)
    model, x = CombinedWeights(combine, mixed).to(F64), torch.randn(2, 3, 4, dtype=F64)
    expected = held_by_hand(model, x)  # each head's weights detached, the uniform rule where mixed
    lrp = LRP(model, CPLRP(), in_keys=["x"], out_keys=["y"])
    in_mode = call(lrp, x)
    with lrp, warnings.catch_warnings():
        warnings.simplefilter("error")
        relevances = [call(lrp, x) for _ in range(3)]
    assert applied == ([] if mixed else [True, True])
    assert relative_error(in_mode, expected) <= 1e-12
    for relevance in relevances:
        assert relative_error(relevance, expected) <= 1e-12


class ConstantValues(nn.Module):
    """``out(x · (1 + attention(q(x), k(x), values)))``: fused attention over constant values (a buffer, or
    ``softmax``'s held weights times a buffer), which under CP-LRP gives a constant: its product with ``x`` is no
    product of two activations, nor is that of what is made of it alone (a concatenation)."""

    def __init__(self, values: str) -> None:
        super().__init__()
        self.q, self.k, self.out = (nn.Linear(4, size, bias=False) for size in (4, 4, 3))
        self.values = values
        self.register_buffer("table", torch.randn(3, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.q(x).unsqueeze(1), self.k(x).unsqueeze(1)  # one head
        values = self.table.expand_as(q)
        if self.values != "buffer":
            values = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ values
        attended = F.scaled_dot_product_attention(q, k, values)
        if self.values == "held, concatenated":  # the same values, made of the constant anew
            attended = torch.cat([attended, attended], 1)[:, :1]
        return self.out(x * (1 + attended.squeeze(1)))


@pytest.mark.parametrize("values", ["buffer", "held", "held, concatenated"])
def test_fused_attention_over_constant_values_is_a_constant(applied, values: str):
    torch.manual_seed(0)
    model, x = ConstantValues(values).to(F64), torch.randn(2, 3, 4, dtype=F64)
    with torch.no_grad():
        q, k = model.q(x).unsqueeze(1), model.k(x).unsqueeze(1)
        table = model.table.expand_as(q)
        table = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ table if values != "buffer" else table
        attended = F.scaled_dot_product_attention(q, k, table).squeeze(1)
    leaf = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(model.out(leaf * (1 + attended)).max(-1).values.sum(), leaf)
    expected = leaf.detach() * grad  # a linear map of x: LRP-0 is the gradient
    lrp = LRP(model, CPLRP(), in_keys=["x"], out_keys=["y"])
    with lrp:
        relevances = [call(lrp, x) for _ in range(3)]
    for relevance in relevances:
        assert relative_error(relevance, expected) <= 1e-12


# Zoo configurations whose later calls take the graph's way under both presets (the others keep the mode: a
# functional activation whose node keeps no input (tanh) or gate, a recurrent mixer, relative position biases read by
# value, ...).
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
