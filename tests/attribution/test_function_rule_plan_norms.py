"""Later calls of a context run norms plainly: a written-out norm's scale cut at its node, a fused layer norm's rule
as a hook on its own node (the oracles: the norms' rules written by hand, and a call in the function mode)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from tdhook.attribution import LRP, AttnLRP
from tests.attribution._plan_helpers import F64, Product, call, halved, plans, wrapped_on_a_batch
from tests.conftest import relative_error


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
        if self.variant == "scale times weight":  # a statistic no longer once scaled by a parameter
            return x * (self.scale(x, torch.rsqrt) * self.weight)
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


class WrittenNorm(HandNorm):
    """An RMS norm whose input is multiplied by one after its square was taken: into a new tensor, or in place where
    ``written``. The graphs have the same nodes, but in the second the square's backward reads a tensor written
    since, which a plain call runs and the mode's graph (its scale detached) does not."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.written = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 1.0
        s = self.scale(x, torch.rsqrt)
        x = x.mul_(1.0) if self.written else x.mul(1.0)
        return self.weight * (x * s)


def test_a_later_call_that_writes_a_tensor_behind_a_cut_scale_runs_again_in_the_mode(applied):
    model, x = normed_model(), torch.randn(5, 4, dtype=F64)
    model.norm = WrittenNorm(6).to(F64)
    lrp = LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"])
    with lrp:
        call(lrp, x)
        call(lrp, x)  # by the plan: the norm run plainly, its scale cut
        model.norm.written = True
        written = [call(lrp, x) for _ in range(2)]  # the same graph: its plain backward would raise
        (plan,) = plans(lrp)
    assert applied == [True, False, True]
    assert plan.plain == frozenset()  # the norm in its mode, as in a call that writes its input from the start
    for relevance in written:
        assert relative_error(relevance, norm_by_hand(model, x)) <= 1e-12


class BatchNormedProduct(Product):
    """``out(bn(q(x)) * k(x))``: in eval mode the BatchNorm merges into ``q`` (under LRP-0 its plain gradient, which
    a plan runs plainly); in training mode its rule holds the batch's statistics constant, on nodes of the same kind."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.bn(self.q(x)) * self.k(x))


def test_a_batch_norm_run_plainly_in_eval_mode_keeps_its_rule_in_a_later_call_in_training_mode(applied):
    torch.manual_seed(0)
    model, x = BatchNormedProduct().to(F64).eval(), torch.randn(5, 4, dtype=F64)
    lrp = LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"])
    with pytest.warns(UserWarning, match="is in training mode"):
        with lrp:
            call(lrp, x)
            call(lrp, x)  # by the plan: the BatchNorm run plainly
            (plan,) = plans(lrp)
            assert plan.plain == {id(model.bn)}
            model.train()
            training = [call(lrp, x) for _ in range(2)]  # the same graph: the statistics held by the rule
        fresh = call(LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"]), x)
    for relevance in training:
        assert relative_error(relevance, fresh) <= 1e-12
    assert applied[:2] == [True, False]


class BypassedNorm(NormedProduct):
    """``out(norm(a * b))``, or with ``bypassed`` the norm's forward called directly (``norm.forward(a * b)``): the
    same graph, node for node, but without the norm's rule. Its scale is multiplied by the weight before it scales
    the product: no statistic the function mode holds in its own right."""

    def __init__(self) -> None:
        super().__init__()
        self.bypassed = False
        self.norm.variant = "scale times weight"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        product = self.q(x) * self.k(x)
        return self.out(self.norm.forward(product) if self.bypassed else self.norm(product))


def test_a_later_call_that_bypasses_a_norm_the_plan_runs_plainly_runs_again_in_the_mode(applied):
    """The plan cuts a scale that a norm's rule held: a later call whose graph is the same, but whose scale no norm's
    rule holds (a forward called directly), runs again in the mode, which keeps its scale's gradient. The norms a
    later call runs without their hooks still note their outputs, as their hooks did, where the paths start."""
    model, x, lrp = wrapped_on_a_batch(BypassedNorm, AttnLRP)
    with lrp:
        call(lrp, x)
        call(lrp, x)  # by the plan: the norm run without its hooks, its scale cut
        model.bypassed = True
        bypassed = call(lrp, x)
    assert applied == [True, False]
    # A call that enters its context runs in the mode (and warns: the norm did not run, its scale has no rule).
    with pytest.warns(UserWarning):
        in_mode = call(LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"]), x)
    assert torch.equal(bypassed, in_mode)
    # The scale held gives another relevance: the comparison can fail.
    assert relative_error(norm_by_hand(model, x), in_mode) > 1e-3


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
    model, x, lrp = wrapped_on_a_batch(lambda: LayerNormedProduct(functional), AttnLRP)
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
    model, x, lrp = wrapped_on_a_batch(lambda: ConditionedNorm(functional), AttnLRP)
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
    model, x, lrp = wrapped_on_a_batch(SwitchedLayerNorm, AttnLRP, (5, 2, 4))
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
    model, x, lrp = wrapped_on_a_batch(RenormalisedProduct, AttnLRP)
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
    model, x, lrp = wrapped_on_a_batch(CheckpointedLayerNorm, AttnLRP)
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


class CheckpointedNorm(NormedProduct):
    """``out(norm(a * b))`` with the written-out norm in a ``torch.utils.checkpoint`` region."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(checkpoint(self.norm, self.q(x) * self.k(x), use_reentrant=False))


def test_a_written_out_norm_in_a_checkpoint_region_gives_the_modes_relevance_in_later_calls():
    """The backward pass runs the region's forward again, after the call: with the norm's rule, which holds its
    scale. A later call that ran the norm plainly saved more tensors in its forward than that run does (torch raised
    a CheckpointError); such a call runs in the mode."""
    model, x, lrp = wrapped_on_a_batch(CheckpointedNorm, AttnLRP)
    in_mode = call(lrp, x)
    with lrp:
        relevances = [call(lrp, x) for _ in range(3)]
    assert relative_error(in_mode, norm_by_hand(model, x)) <= 1e-12
    for relevance in relevances:
        assert torch.equal(relevance, in_mode)
