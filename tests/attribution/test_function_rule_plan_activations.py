"""Later calls of a context put the identity rule of activations called as functions on their own nodes, and leave
sigmoid gates that every product holds without their rule (the oracles: the rules written by hand, and a call in
the function mode)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from tensordict import TensorDict
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from tdhook.attribution import CPLRP, LRP, AttnLRP
from tdhook.attribution.rules import basic
from tdhook.attribution.rules.basic import PassRule
from tdhook.attribution.rules.functional import FunctionalRules
from tdhook.attribution.rules.transformer import PseudoIdentityRule, SoftmaxEpsilonRule
from tests.attribution._plan_helpers import F64, Product, call, halved, plans, wrapped_on_a_batch
from tests.conftest import relative_error


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
    model, x, lrp = wrapped_on_a_batch(lambda: ActivatedProduct(activation), AttnLRP)
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
    model, x, lrp = wrapped_on_a_batch(lambda: ActivatedProduct(F.gelu, in_place=True), AttnLRP)
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
    model, x, lrp = wrapped_on_a_batch(lambda: SigmoidGated(reused), preset)
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


class PlainActivations(PseudoIdentityRule):
    """A rule of one's own for activations called as functions: their plain gradient."""

    def apply(self, output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return output


class PlainActivationsLRP(AttnLRP):
    """AttnLRP whose function rules give activations :class:`PlainActivations`."""

    def function_modes(self) -> list:
        return [FunctionalRules(SoftmaxEpsilonRule(), PlainActivations())]


def test_an_identity_rule_of_ones_own_keeps_its_gradient_on_functional_activations(applied):
    model, x, lrp = wrapped_on_a_batch(lambda: ActivatedProduct(F.gelu), PlainActivationsLRP)
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
    model, x, lrp = wrapped_on_a_batch(lambda: ChangedAfterActivation(activation), AttnLRP)
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
    model, x, lrp = wrapped_on_a_batch(lambda: ActivatedProduct(FunctionalGelu()), preset)
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


@pytest.fixture
def rewrites(monkeypatch) -> list[nn.Module]:
    """The activation modules whose pass rule's hook ran, one entry per run."""
    seen: list[nn.Module] = []
    rewrite = PassRule.rewrite

    def watched(self, module, *args):
        seen.append(module)
        return rewrite(self, module, *args)

    monkeypatch.setattr(PassRule, "rewrite", watched)
    return seen


@pytest.mark.parametrize("activation", [nn.GELU, nn.SiLU])
@pytest.mark.parametrize("preset", [AttnLRP, CPLRP])
def test_later_calls_run_an_activation_module_without_its_hooks(applied, rewrites, preset, activation):
    """The identity rule of a GELU or SiLU module goes on its node, from the plan: a later call runs the module
    straight to its forward (its hooks, the rule's and those pausing the function modes, stay off), and the relevance
    is the mode's to the last bit."""
    model, x, lrp = wrapped_on_a_batch(lambda: ActivatedProduct(activation()), preset)
    in_mode = call(lrp, x)
    with lrp:
        rewrites.clear()
        relevances = [call(lrp, x) for _ in range(4)]
        assert [type(m) for plan in plans(lrp) for m in plan.quiet] == [activation]
    assert applied[-2:] == [True, True]
    assert len(rewrites) == len(relevances) - len(applied)  # the recording calls' alone
    assert "_call_impl" not in vars(model.activation)
    for relevance in relevances:
        assert torch.equal(relevance, in_mode)
    if preset is AttnLRP:
        assert relative_error(in_mode, activated_by_hand(model, x)) <= 1e-9
    _ = call(lrp, x)  # the context left: the module's hooks run again, and leave with the call
    assert rewrites[-1] is model.activation and not model.activation._forward_hooks


class TwiceActivated(ActivatedProduct):
    """``out(f(h) * k(x))`` where ``f`` runs twice on ``h = q(x)``: once as ``ActivatedProduct`` does, once under
    ``torch.no_grad`` (its value unused), where its rule's hook lets the call be."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.activation(self.q(x))
        return super().forward(x)


@pytest.mark.parametrize(
    "make",
    [
        lambda: ActivatedProduct(nn.Tanh()),  # its node saved its output: no hook can compute the rule from it
        lambda: TwiceActivated(nn.GELU()),  # one call with the rule on the node, one its hook let be
    ],
    ids=["tanh", "called twice"],
)
def test_an_activation_module_whose_rule_is_not_on_its_node_keeps_its_hooks(applied, rewrites, make):
    model, x, lrp = wrapped_on_a_batch(make, AttnLRP)
    in_mode = call(lrp, x)
    with lrp:
        rewrites.clear()
        relevances = [call(lrp, x) for _ in range(4)]
        assert all(plan.quiet == () for plan in plans(lrp))
    assert applied[-2:] == [True, True]  # later calls take the graph's way all the same
    assert rewrites.count(model.activation) == len(relevances)  # the rule's hook acted in every call
    for relevance in relevances:
        assert torch.equal(relevance, in_mode)


def test_an_activation_module_with_a_hook_of_the_callers_keeps_its_hooks(applied):
    """A module with a hook that is not the wrapper's runs torch's way: the caller's hook runs in every call."""
    model, x, lrp = wrapped_on_a_batch(lambda: ActivatedProduct(nn.GELU()), AttnLRP)
    in_mode = call(lrp, x)
    seen = []
    hook = model.activation.register_forward_hook(lambda module, args, output: seen.append(output.shape))
    with lrp:
        relevances = [call(lrp, x) for _ in range(4)]
    hook.remove()
    assert applied[-2:] == [True, True]
    assert len(seen) == len(relevances)
    for relevance in relevances:
        assert torch.equal(relevance, in_mode)


class OwnPass(PassRule):
    """The pass rule with an apply of its own: the plain gradient."""

    def apply(self, output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return output


def test_a_pass_rule_with_an_apply_of_its_own_keeps_it_in_every_call(rewrites):
    model, x, lrp = wrapped_on_a_batch(
        lambda: ActivatedProduct(nn.GELU()), lambda: AttnLRP(rule_mapper={"activation": OwnPass()})
    )
    with lrp:
        relevances = [call(lrp, x) for _ in range(4)]
    assert rewrites.count(model.activation) == len(relevances)
    leaf = x.clone().requires_grad_(True)  # by hand: the activation's plain gradient, the product's halved
    logits = model.out(halved(F.gelu(model.q(leaf)) * model.k(leaf)))
    (grad,) = torch.autograd.grad(logits.max(-1).values.sum(), leaf)
    for relevance in relevances:
        assert relative_error(relevance, leaf.detach() * grad) <= 1e-12


class PartlyCheckpointed(ActivatedProduct):
    """``out(f(h) * f(h2) * k(x))``-like: ``f`` runs on ``h = q(x)`` plainly and on ``h2 = v(x)`` inside a
    (non-reentrant) checkpoint region, whose saved-tensor hooks keep its rule in its forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plain = self.activation(self.q(x))
        checkpointed = torch.utils.checkpoint.checkpoint(self.activation, self.v(x), use_reentrant=False)
        return self.out(plain * checkpointed + self.k(x))


def test_an_activation_module_ruled_on_its_node_in_one_call_and_in_its_forward_in_another(applied, rewrites):
    model, x, lrp = wrapped_on_a_batch(lambda: PartlyCheckpointed(nn.GELU()), AttnLRP)
    in_mode = call(lrp, x)
    with lrp:
        relevances = [call(lrp, x) for _ in range(4)]
    assert applied == []  # no plan: a later call could not tell its calls apart
    for relevance in relevances:
        assert torch.equal(relevance, in_mode)
    leaf = x.clone().requires_grad_(True)  # by hand: the identity rule on both calls, the product's halved
    h, h2 = model.q(leaf), model.v(leaf)
    passed = [t * (F.gelu(t) / t).detach() for t in (h, h2)]
    logits = model.out(halved(passed[0] * passed[1]) + model.k(leaf))
    (grad,) = torch.autograd.grad(logits.max(-1).values.sum(), leaf)
    assert relative_error(in_mode, leaf.detach() * grad) <= 1e-9


class TanhGelu(TorchFunctionMode):
    """A function mode that changes what ``F.gelu`` computes (its tanh approximation): the function modes are
    paused inside a ruled module, a caller's or the model's own as well as the rules'."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is F.gelu:
            kwargs["approximate"] = "tanh"
        return func(*args, **kwargs)


class ModeInside(ActivatedProduct):
    """``ActivatedProduct`` whose forward enters :class:`TanhGelu` around its activation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with TanhGelu():
            activated = self.activation(self.q(x))
        return self.out(activated * self.k(x))


@pytest.mark.parametrize("where", ["around the call", "around the call, a hook of the callers", "inside the model"])
def test_a_function_mode_stays_paused_in_an_activation_module_in_later_calls(applied, where):
    """Out of context a function mode is paused inside the GELU module, in its forward and in its rule: later calls
    give the same output and relevance, whether the module could run without its hooks or not, and whether the
    caller or the model entered the mode."""
    torch.manual_seed(0)
    inside = where == "inside the model"
    model, x = (ModeInside if inside else ActivatedProduct)(nn.GELU()).to(F64), torch.randn(5, 4, dtype=F64)
    lrp = LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"])
    if where.endswith("hook of the callers"):
        model.activation.register_forward_hook(lambda module, args, output: None)
    td = TensorDict(x=x, batch_size=[5])
    with contextlib.nullcontext() if inside else TanhGelu():
        expected = lrp(td.clone())
        with lrp:
            results = [lrp(td.clone()) for _ in range(4)]
    assert applied[-2:] == [True, True]  # later calls take the graph's way all the same
    for result in results:
        assert torch.equal(result["y"], expected["y"])
        assert torch.equal(result["relevance", "x"], expected["relevance", "x"])
    assert relative_error(expected["relevance", "x"], activated_by_hand(model, x)) <= 1e-9  # the exact GELU's


@pytest.fixture
def recomputed(monkeypatch) -> list[str]:
    """The activations' nodes whose input the identity rule's hook ran the activation on again, one entry a node."""
    seen: list[str] = []
    for name, compute in list(basic._RECOMPUTED.items()):

        def watched(node, x, name=name, compute=compute):
            seen.append(name)
            return compute(node, x)

        monkeypatch.setitem(basic._RECOMPUTED, name, watched)
    return seen


class ChangedAfter(ActivatedProduct):
    """``ActivatedProduct`` whose activation's output is changed in place after the module returned it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        activated = self.activation(self.q(x))
        activated.mul_(1.0)
        return self.out(activated * self.k(x))


@pytest.mark.parametrize("activation", [nn.GELU, nn.SiLU])
@pytest.mark.parametrize("preset", [AttnLRP, CPLRP])
def test_later_calls_take_an_activation_modules_factor_from_its_output(applied, recomputed, preset, activation):
    """A later call that runs a GELU or SiLU module without its hooks keeps its output, from which the identity
    rule's factor is computed: the activation is not run again on its node's saved input, and the relevance is the
    mode's to the last bit."""
    model, x, lrp = wrapped_on_a_batch(lambda: ActivatedProduct(activation()), preset)
    in_mode = call(lrp, x)
    with lrp:
        relevances = [call(lrp, x) for _ in range(4)]
        recomputed.clear()
        relevances.append(call(lrp, x))
        assert recomputed == []
        assert not lrp._function_rule_plan.quiet.taken_outputs()  # the call's outputs are not held after it
    assert applied[-3:] == [True, True, True]
    for relevance in relevances:
        assert torch.equal(relevance, in_mode)


def test_an_activation_output_changed_in_place_after_its_module_gives_the_factor_from_the_saved_input(
    applied, recomputed
):
    model, x, lrp = wrapped_on_a_batch(lambda: ChangedAfter(nn.GELU()), AttnLRP)
    in_mode = call(lrp, x)
    with lrp:
        relevances = [call(lrp, x) for _ in range(4)]
        recomputed.clear()
        relevances.append(call(lrp, x))
    assert applied[-3:] == [True, True, True]
    assert recomputed == ["GeluBackward0"]  # the kept output is no longer the node's as it returned it
    for relevance in relevances:
        assert torch.equal(relevance, in_mode)
    assert relative_error(in_mode, activated_by_hand(model, x)) <= 1e-9
