"""Later calls of a context hold CP-LRP's attention weights and gates in the graph, and put a fused attention's
factors on its nodes (the oracles: held tensors detached by hand, and a call in the function mode)."""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from torch import nn
from torch.nn import functional as F

from tdhook.attribution import CPLRP, LRP, AttnLRP, _function_rule_plan
from tests.attribution._plan_helpers import (
    F64,
    Product,
    call,
    halved,
    in_mode_and_in_context,
    plans,
    product_model,
    wrapped_on_a_batch,
    zoo_calls,
)
from tests.attribution.test_lrp_huggingface import LastLogits, build
from tests.conftest import relative_error


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
    model, x, lrp = wrapped_on_a_batch(BiasedAttention, preset, (3, 5, 4))
    in_mode, relevances = in_mode_and_in_context(lrp, x, 3)
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


class ConditionedBiasAttention(Product):
    """``out(sdpa(q(x), k(x), v(x), mask=r(x)))``: a position bias computed from the hidden states (Inkling's
    relative logits, Wav2Vec2-Conformer's relative position scores), a summand of the scores as ``q · kᵀ`` is."""

    def __init__(self) -> None:
        super().__init__()
        self.r = nn.Linear(4, 5, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.scaled_dot_product_attention(self.q(x), self.k(x), self.v(x), attn_mask=self.r(x)))


@pytest.mark.parametrize("preset", [AttnLRP, CPLRP])
def test_a_fused_attention_with_a_mask_computed_from_activations_is_the_attention_written_out(preset):
    """CP-LRP holds the mask with the attention weights (the fused call passed the mask its plain gradient: CP-LRP
    lost up to 32 % of the logit on a tiny Wav2Vec2-Conformer with sdpa attention); AttnLRP gives it the weights'
    half of ``attention · v``, as the written-out attention does. So in a call that enters its context and in
    later calls of one context, with the output as the plain call's, bit for bit."""
    model, x, lrp = wrapped_on_a_batch(ConditionedBiasAttention, preset, (3, 5, 4))
    in_mode, relevances = in_mode_and_in_context(lrp, x, 3)
    for relevance in relevances:
        assert torch.equal(relevance, in_mode)
    td = lrp(TensorDict(x=x.clone(), batch_size=[3]))
    assert torch.equal(td["y"], model(x))
    leaf = x.clone().requires_grad_(True)
    q, k, v = model.q(leaf), model.k(leaf), model.v(leaf)
    held = preset is CPLRP
    scores = (q @ k.transpose(-2, -1) if held else halved(q @ k.transpose(-2, -1))) / 6**0.5 + model.r(leaf)
    weights = torch.softmax(scores, -1)
    attended = weights.detach() @ v if held else halved(weights @ v)
    logits = model.out(attended).max(-1).values
    (grad,) = torch.autograd.grad(logits.sum(), leaf)
    assert relative_error(in_mode, leaf.detach() * grad) <= 1e-12
    if held:  # bias-free and linear but for the held weights: conserved
        assert torch.allclose(in_mode.sum((1, 2)), logits.detach().sum(1), rtol=1e-12, atol=0)


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


class WrittenGate(Product):
    """``out(gelu(a) * b + 2 a)`` with ``a = q(x)``, ``b = k(x)``, ``a`` doubled into a new tensor or, with
    ``written``, in place after the GELU saved it: CP-LRP holds the gate, but a plain call still runs its node's
    backward, which reads the ``a`` it saved."""

    def __init__(self) -> None:
        super().__init__()
        self.written = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.q(x), self.k(x)
        gate = F.gelu(a)
        a = a.mul_(2.0) if self.written else a.mul(2.0)
        return self.out(gate * b + a)


def test_a_later_call_that_writes_a_tensor_behind_a_held_gate_runs_again_in_the_mode(applied):
    torch.manual_seed(0)
    model, x = WrittenGate().to(F64), torch.randn(5, 4, dtype=F64)
    lrp = LRP(model, CPLRP(), in_keys=["x"], out_keys=["y"])
    with lrp:
        call(lrp, x)
        call(lrp, x)  # by the plan: the product's node passes the gate no gradient
        model.written = True
        written = [call(lrp, x) for _ in range(2)]  # the same graph: its plain backward would raise
    assert applied == [True, False]
    fresh = call(LRP(model, CPLRP(), in_keys=["x"], out_keys=["y"]), x)
    for relevance in written:
        assert relative_error(relevance, fresh) <= 1e-12


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
    model, x, lrp = wrapped_on_a_batch(HeldAttention, CPLRP, (2, 100, 4))  # weights of 2 × 100 × 100 elements
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
    in_mode, relevances = in_mode_and_in_context(lrp, x, 3)
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


class ShapedRoutingWeights(nn.Module):
    """``out(e(x) * w)`` with routing weights ``w = softmax(g(x))`` shaped or cast after an activation (JetMoE's
    router: ``softmax(logits.float()).type_as(hidden_states)``); ``held`` detaches them (CP-LRP's rule, by hand)."""

    def __init__(self, shaping: str) -> None:
        super().__init__()
        self.g, self.e = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
        self.out = nn.Linear(4, 3, bias=False)
        self.shaping, self.held = shaping, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        signal = self.e(x)
        weights = torch.softmax(self.g(x).float(), dim=-1)
        weights = weights.detach() if self.held else weights
        if self.shaping == "type_as":
            weights = weights.type_as(signal)
        elif self.shaping == "to":
            weights = weights.to(signal)
        else:  # the same shape: the template gives its shape only
            weights = getattr(weights.double(), self.shaping)(signal)
        return self.out(signal * weights)


@pytest.mark.parametrize("shaping", ["type_as", "to", "view_as", "reshape_as", "expand_as"])
def test_held_weights_shaped_after_an_activation_stay_constants(applied, shaping: str):
    """A method that takes only the shape, dtype or device of its other tensor (``w.type_as(x)``) makes a
    constant of held weights, as of detached ones: their product with the signal is no product of two activations
    (the uniform rule halved it in a recording call, half the relevance lost)."""
    torch.manual_seed(0)
    model, x = ShapedRoutingWeights(shaping).to(F64), torch.randn(2, 3, 4, dtype=F64)
    expected = held_by_hand(model, x)
    lrp = LRP(model, CPLRP(), in_keys=["x"], out_keys=["y"])
    assert relative_error(call(lrp, x), expected) <= 1e-6  # float32 weights
    with lrp:
        relevances = [call(lrp, x) for _ in range(3)]
    for relevance in relevances:
        assert relative_error(relevance, expected) <= 1e-6


# Zoo configurations whose later calls take the graph's way under both presets (the others keep the mode: a
# functional activation whose node keeps no input and whose input is no module's output (Gemma 2's softcapping tanh),
# a gate, a recurrent mixer, relative position biases read by value, ...).


class GatedMatmul(Product):
    """``out(sum(q(x)ᵀ @ silu(k(x))))``, per position of a ``[batch, positions, features]`` input: a ``matmul`` of
    an activation and a gate (an activation function's output), which torch computes by a ``bmm`` of reshaped
    factors and CP-LRP holds its gate in (MiniMax's lightning attention holds its values so)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.matmul(self.q(x).unsqueeze(-1), F.silu(self.k(x)).unsqueeze(-2)).sum(-1))


def test_later_calls_hold_cplrps_gate_in_a_matmul_in_the_graph(applied):
    """A gate held in a ``matmul`` kept every call of MiniMax in the function mode under CP-LRP (1.5x a gradient pass
    at the tiny size, AttnLRP 1.2x): the node that takes it in the ``matmul``'s own graph passes it no gradient."""
    model, x, lrp = wrapped_on_a_batch(GatedMatmul, CPLRP, (5, 2, 4))
    in_mode, relevances = in_mode_and_in_context(lrp, x, 3)
    assert applied == [True, True]
    for relevance in relevances:
        assert torch.equal(relevance, in_mode)
    leaf = x.clone().requires_grad_(True)  # by hand: the gate detached
    product = torch.matmul(model.q(leaf).unsqueeze(-1), F.silu(model.k(leaf)).detach().unsqueeze(-2))
    (grad,) = torch.autograd.grad(model.out(product.sum(-1)).max(-1).values.sum(), leaf)
    assert relative_error(in_mode, leaf.detach() * grad) <= 1e-8
    (plain,) = torch.autograd.grad(model(leaf).max(-1).values.sum(), leaf)  # the gate not held: the test can fail
    assert relative_error(in_mode, leaf.detach() * plain) > 1e-3


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_minimax_under_cplrp_runs_later_calls_without_the_mode(applied, implementation: str):
    in_mode, relevances = zoo_calls("minimax", implementation, CPLRP, 3)
    assert applied == [True, True]
    for relevance in relevances:
        assert torch.equal(relevance, in_mode)
