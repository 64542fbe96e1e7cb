"""Operators a model calls through ``torch.ops`` (ATen overloads and packets, ``torch.library`` operators) and the
batch norm spelled ``torch.batch_norm``: judged as the torch functions they compute, named in full where no rule
covers them.

The presets' function rules act on ``torch.*`` functions; an operator called through ``torch.ops`` keeps its plain
gradient. Each case either gets the relevance of the same model written with ``torch.*`` calls, or is named in a
warning (an error with ``strict``). Oracles: gradient × input (LRP-0 with the plain gradient, which the warning
announces), and the ``torch.*`` form of the model under the same preset.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.rules import CPLRP, AttnLRP, EpsilonAlpha2Beta1, EpsilonPlus
from tests.conftest import relative_error

F64 = torch.float64
ATEN = torch.ops.aten
WIDTH = 6

# A function that is a product of its two arguments, defined under the name of a linear one, and given no autograd
# formula of its own: its composite kernel runs the product, whose gradient autograd takes.
_LIBRARY = torch.library.Library("tdhook_entry_points", "DEF")
_LIBRARY.define("add(Tensor x, Tensor y) -> Tensor")
_LIBRARY.impl("add", lambda x, y: x * y, "CompositeImplicitAutograd")

PRESETS: dict[str, Callable] = {
    "none": lambda **kw: None,
    "EpsilonPlus": EpsilonPlus,
    "EpsilonAlpha2Beta1": EpsilonAlpha2Beta1,
    "CPLRP": CPLRP,
    "AttnLRP": AttnLRP,
}


class Body(nn.Module):
    """Computes ``call(self, h, g)`` from two activations, with a weight of its own."""

    def __init__(self, call: Callable) -> None:
        super().__init__()
        self.call = call
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH, dtype=F64))

    def forward(self, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return self.call(self, h, g)


class TwoBranches(nn.Module):
    """Two Linear layers, the body on their outputs, a Linear head."""

    def __init__(self, call: Callable) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.h = nn.Linear(WIDTH, WIDTH, dtype=F64)
        self.g = nn.Linear(WIDTH, WIDTH, dtype=F64)
        self.body = Body(call)
        self.head = nn.Linear(WIDTH, 3, dtype=F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.h(x), self.g(x)))


def explained(call: Callable, mapper, x: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
    """The relevance of ``x`` for the first output of the model with ``call`` as its body, and the LRP warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, relevance = LRP(TwoBranches(call), mapper, in_keys=["x"], out_keys=["y"], target=0)(x=x)
    return relevance, [str(w.message) for w in caught if str(w.message).startswith("LRP")]


def gradient_times_input(call: Callable, x: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(TwoBranches(call)(x)[:, 0].sum(), x)
    return x.detach() * grad


def model_input() -> torch.Tensor:
    return torch.randn(4, WIDTH, dtype=F64, generator=torch.Generator().manual_seed(1))


# ---- naming: an operator is named by its full name, and judged as the function it computes -------------------


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda m, h, g: ATEN.sin.default(h), "aten.sin.default"),
        (lambda m, h, g: ATEN.sin(h), "aten.sin"),
        (lambda m, h, g: ATEN._softmax.default(h, -1, False), "aten._softmax.default"),
        (lambda m, h, g: ATEN.mul.Tensor(h, g), "aten.mul.Tensor"),
        (lambda m, h, g: ATEN.bmm.default(h.unsqueeze(-1), g.unsqueeze(-2)).sum(-1), "aten.bmm.default"),
        (lambda m, h, g: torch.ops.tdhook_entry_points.add(h, g), "tdhook_entry_points.add"),
    ],
)
def test_an_operator_without_a_rule_is_named_by_its_full_name(call: Callable, named: str):
    # An ATen overload was named "default" or "Tensor" (its overload's name), and a torch.library operator named
    # after a linear function ("add") was judged linear by that name: its product kept the plain gradient silently.
    x = model_input()
    relevance, messages = explained(call, None, x)
    assert len(messages) == 1 and f"computes {named} in its own forward" in messages[0], messages
    torch.testing.assert_close(relevance, gradient_times_input(call, x))  # the plain gradient, as announced
    with pytest.raises(ValueError, match=rf"module 'body' \(Body\) computes {re.escape(named)} in its own"):
        LRP(TwoBranches(call), EpsilonPlus(strict=True), in_keys=["x"], out_keys=["y"], target=0)(x=x)


@pytest.mark.parametrize("preset", ["CPLRP", "AttnLRP"])
def test_a_product_written_as_an_operator_is_not_taken_as_linear_by_the_transformer_presets(preset: str):
    # The uniform rule halves a product of two activations written a * b; the same product through a torch.library
    # operator named "add" kept its whole gradient (twice the relevance through it) without a word.
    x = model_input()
    torch_form, _ = explained(lambda m, h, g: h * g, PRESETS[preset](), x)
    operator_form, messages = explained(lambda m, h, g: torch.ops.tdhook_entry_points.add(h, g), PRESETS[preset](), x)
    assert relative_error(operator_form, torch_form) > 0.1  # the warning is needed
    assert any("computes tdhook_entry_points.add in its own forward" in m for m in messages), messages


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize(
    ("operator_form", "torch_form"),
    [
        (lambda m, h, g: ATEN.add.Tensor(h, g), lambda m, h, g: h + g),
        (lambda m, h, g: ATEN.cat.default([h[:, :3], g[:, 3:]], 1), lambda m, h, g: torch.cat([h[:, :3], g[:, 3:]], 1)),
        (lambda m, h, g: ATEN.stack.default([h, g], 1).sum(1), lambda m, h, g: torch.stack([h, g], 1).sum(1)),
        (
            lambda m, h, g: torch.cat(ATEN.split.Tensor(h, 3, 1)[::-1], 1),
            lambda m, h, g: torch.cat(h.split(3, 1)[::-1], 1),
        ),
        (
            lambda m, h, g: torch.cat([ATEN.slice.Tensor(h, 1, 1), g[:, :1]], 1),
            lambda m, h, g: torch.cat([h[:, 1:], g[:, :1]], 1),
        ),
        (lambda m, h, g: ATEN.relu.default(h) - g, lambda m, h, g: torch.relu(h) - g),
        (lambda m, h, g: ATEN.mul.Tensor(h, 3.0), lambda m, h, g: h * 3.0),
    ],
)
def test_a_piecewise_linear_operator_gets_the_relevance_of_its_torch_form_without_a_warning(
    operator_form: Callable, torch_form: Callable, preset: str
):
    # These were named "Tensor" or "default" and reported as not piecewise linear.
    x = model_input()
    expected, _ = explained(torch_form, PRESETS[preset](), x)
    got, messages = explained(operator_form, PRESETS[preset](), x)
    assert messages == []
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize(
    "call", [lambda m, h, g: ATEN.linear.default(h, m.weight), lambda m, h, g: ATEN.mm(h, m.weight)]
)
def test_a_layer_computed_by_an_operator_is_named_as_a_layer_outside_the_layer_rules(call: Callable):
    # As F.linear with a weight of the module's own: its Linear rule (ε) is not applied, and the warning says so.
    x = model_input()
    _, messages = explained(call, EpsilonPlus(epsilon=0.25), x)
    assert len(messages) == 1 and "module 'body' (Body) computes" in messages[0], messages
    assert "with its own weight, but is no Linear layer" in messages[0], messages


# ---- clips: the presets pass relevance through a torch clip; an ATen one keeps its plain gradient ---------------

CLIPS = [
    ("aten.clamp.default", "torch.clamp", lambda m, h, g: ATEN.clamp.default(h, -0.3, 0.3) + g),
    ("aten.clamp", "torch.clamp", lambda m, h, g: ATEN.clamp(h, -0.3, 0.3) + g),
    ("aten.hardtanh.default", "F.hardtanh", lambda m, h, g: ATEN.hardtanh.default(h, -0.3, 0.3) + g),
    ("aten.clamp_min", "torch.clamp_min", lambda m, h, g: ATEN.clamp_min(h, 0.2) + g),
    ("aten.maximum", "torch.maximum", lambda m, h, g: ATEN.maximum(h, torch.tensor(0.2, dtype=F64)) + g),
]
TORCH_CLIPS = {
    "torch.clamp": lambda m, h, g: torch.clamp(h, -0.3, 0.3) + g,
    "F.hardtanh": lambda m, h, g: F.hardtanh(h, -0.3, 0.3) + g,
    "torch.clamp_min": lambda m, h, g: h.clamp_min(0.2) + g,
    "torch.maximum": lambda m, h, g: torch.maximum(h, torch.tensor(0.2, dtype=F64)) + g,
}


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize(("operator", "function", "call"), CLIPS, ids=[c[0] for c in CLIPS])
def test_a_clip_by_an_aten_operator_is_named_where_its_torch_form_has_a_rule(
    operator: str, function: str, call: Callable, preset: str
):
    # torch.clamp in a module's forward gets the pass rule (nn.Hardtanh's); torch.ops.aten.clamp got the plain
    # gradient, which drops the relevance of the clipped units (0.37-0.74 off here), without a word.
    x = model_input()
    torch_form, _ = explained(TORCH_CLIPS[function], PRESETS[preset](), x)
    got, messages = explained(call, PRESETS[preset](), x)
    assert relative_error(got, torch_form) > 0.1  # the warning is needed
    assert len(messages) == 1, messages
    assert f"module 'body' (Body) calls {operator} (the ATen form of {function}) through torch.ops" in messages[0]
    if preset in ("none", "AttnLRP", "CPLRP"):  # LRP-0 on the Linear layers: the plain gradient, as announced
        torch.testing.assert_close(got, gradient_times_input(call, x))


def test_an_aten_clip_of_an_activation_by_an_activation_is_no_clip():
    # torch.clamp(h, max=g) keeps its plain gradient under every preset: the same call through torch.ops is no
    # different and is not named.
    x = model_input()
    torch_form, _ = explained(lambda m, h, g: torch.clamp(h, None, g), AttnLRP(), x)
    got, messages = explained(lambda m, h, g: ATEN.clamp.Tensor(h, None, g), AttnLRP(), x)
    assert messages == []
    torch.testing.assert_close(got, torch_form)


# ---- batch norm and dropout called otherwise than by F.batch_norm / F.dropout ----------------------------------


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda m, h, g: torch.batch_norm(h, None, None, None, None, True, 0.1, 1e-5, False), "batch_norm"),
        (lambda m, h, g: ATEN.batch_norm(h, None, None, None, None, True, 0.1, 1e-5, False), "aten.batch_norm"),
        (
            lambda m, h, g: ATEN.batch_norm.default(h, None, None, None, None, True, 0.1, 1e-5, False),
            "aten.batch_norm.default",
        ),
    ],
)
def test_a_batch_norm_by_the_batchs_statistics_is_named_in_every_spelling(call: Callable, named: str):
    # F.batch_norm in training mode was named; torch.batch_norm and the ATen operator (the same normalisation by the
    # batch's own mean and variance, which is not linear in the input) kept their plain gradient without a word.
    x = model_input()
    relevance, messages = explained(call, EpsilonPlus(epsilon=0.0), x)
    assert len(messages) == 1, messages
    assert f"computes {named} (in training mode, normalising by the batch's own statistics)" in messages[0]
    torch.testing.assert_close(relevance, gradient_times_input(call, x))  # the plain gradient, as announced


@pytest.mark.parametrize("spelling", ["torch", "packet", "overload"])
def test_an_eval_batch_norm_scaled_by_an_activation_is_named_in_the_aten_spelling(spelling: str):
    # The ATen operator takes (input, weight, bias, running_mean, running_var, ...) as torch.batch_norm does, not
    # F.batch_norm's order: its weight was read as the running mean, and a weight computed from activations (a
    # product of two activations) went unnamed.
    function = {"torch": torch.batch_norm, "packet": ATEN.batch_norm, "overload": ATEN.batch_norm.default}[spelling]
    mean, variance = torch.zeros(WIDTH, dtype=F64), torch.ones(WIDTH, dtype=F64)

    def call(m, h, g):
        return function(h, g[0], None, mean, variance, False, 0.1, 1e-5, False)

    _, messages = explained(call, None, model_input())
    assert len(messages) == 1 and "(with a weight or variance computed from activations)" in messages[0], messages


@pytest.mark.parametrize(
    "call",
    [
        lambda m, h, g: ATEN.dropout(h, 0.5, True) + g,
        lambda m, h, g: ATEN.dropout.default(h, 0.5, True) + g,
        lambda m, h, g: ATEN.native_dropout.default(h, 0.5, True)[0] + g,
    ],
)
def test_a_dropout_operator_in_training_mode_is_named(call: Callable):
    # F.dropout(h, 0.5, training=True) in a module's forward is named (each call explains another random model);
    # torch.ops.aten.dropout was judged linear by name and went unnamed.
    _, messages = explained(call, EpsilonPlus(), model_input())
    assert len(messages) == 1 and "module 'body' (Body) calls dropout (p=0.5) in its own forward" in messages[0]


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda m, h, g: torch.div(h, 0.5, rounding_mode="floor") + g, "div (rounding_mode='floor')"),
        (lambda m, h, g: h.div(0.5, rounding_mode="trunc") + g, "div (rounding_mode='trunc')"),
        (lambda m, h, g: ATEN.div.Tensor_mode(h, 0.5, rounding_mode="floor") + g, "aten.div.Tensor_mode"),
    ],
)
def test_a_division_rounded_to_whole_numbers_is_named_as_piecewise_constant(call: Callable, named: str):
    # torch.floor(h / 0.5) was named as piecewise constant (a zero gradient: what it reads gets no relevance);
    # torch.div(h, 0.5, rounding_mode="floor"), the same function, was taken as a division by a constant (linear),
    # and h's whole share of the relevance was lost without a word.
    x = model_input()
    relevance, messages = explained(call, None, x)
    assert len(messages) == 1, messages
    assert f"computes {named}" in messages[0] and "which is piecewise constant" in messages[0], messages
    torch.testing.assert_close(relevance, gradient_times_input(call, x))  # the zero gradient through h, as announced
    torch_floor, _ = explained(lambda m, h, g: torch.floor(h / 0.5) + g, None, x)
    torch.testing.assert_close(relevance, torch_floor)


@pytest.mark.parametrize("preset", ["EpsilonPlus", "AttnLRP"])
def test_a_residual_sum_by_an_aten_operator_is_named_where_additions_are_stabilised(preset: str):
    # With stabilize_additions, h + g has its gradient rescaled by (h + g) / stabilize(h + g), as zennit's Sum under
    # Norm; torch.ops.aten.add.Tensor(h, g) is no torch.add to the mode and kept the exact split.
    x = model_input()
    torch_form, _ = explained(lambda m, h, g: h + g, PRESETS[preset](stabilize_additions=True, stabilizer=0.5), x)
    call = lambda m, h, g: ATEN.add.Tensor(h, g)  # noqa: E731
    got, messages = explained(call, PRESETS[preset](stabilize_additions=True, stabilizer=0.5), x)
    assert relative_error(got, torch_form) > 0.01  # the warning is needed
    assert len(messages) == 1, messages
    assert "calls aten.add.Tensor (the ATen form of torch.add) through torch.ops" in messages[0]
    plain, messages = explained(call, PRESETS[preset](stabilizer=0.5), x)  # no stabilised sums: nothing to name
    assert messages == []
    torch.testing.assert_close(got, plain)


GATED = {
    "view": lambda m, h, g: h * ATEN.view.default(torch.sigmoid(g), [-1, WIDTH]),
    "clone": lambda m, h, g: h * ATEN.clone.default(torch.sigmoid(g)),
    "expand": lambda m, h, g: h * ATEN.expand.default(torch.sigmoid(g[:, :1]), [-1, WIDTH]),
    "mul by 2": lambda m, h, g: h * ATEN.mul.Tensor(torch.sigmoid(g), 2.0),
    "split": lambda m, h, g: torch.cat(
        [a * b for a, b in zip(h.split(3, 1), ATEN.split.Tensor(torch.sigmoid(g), 3, 1), strict=True)], 1
    ),
}
TORCH_GATED = {
    "view": lambda m, h, g: h * torch.sigmoid(g).view(-1, WIDTH),
    "clone": lambda m, h, g: h * torch.sigmoid(g).clone(),
    "expand": lambda m, h, g: h * torch.sigmoid(g[:, :1]).expand(-1, WIDTH),
    "mul by 2": lambda m, h, g: h * (torch.sigmoid(g) * 2.0),
    "split": lambda m, h, g: torch.cat(
        [a * b for a, b in zip(h.split(3, 1), torch.sigmoid(g).split(3, 1), strict=True)], 1
    ),
}
DETACHED_GATES = {
    "view": lambda m, h, g: h * torch.sigmoid(g).detach(),
    "clone": lambda m, h, g: h * torch.sigmoid(g).detach(),
    "expand": lambda m, h, g: h * torch.sigmoid(g[:, :1]).detach().expand(-1, WIDTH),
    "mul by 2": lambda m, h, g: h * (torch.sigmoid(g) * 2.0).detach(),
    "split": lambda m, h, g: h * torch.sigmoid(g).detach(),
}


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("how", sorted(GATED))
def test_a_gate_passed_through_an_aten_operator_is_held_as_through_its_torch_form(how: str, preset: str):
    # A sigmoid gate reshaped, copied or scaled by an ATen operator lost its gate mark: under CP-LRP and AttnLRP the
    # product then took the uniform rule (half the relevance to the gate) instead of holding the gate, 0.79 off (16
    # off for an expanded gate), without a word. Checked over two calls of one context (the second may run the
    # rules recorded by the first).
    x = model_input()
    model = TwoBranches(GATED[how])
    lrp = LRP(model, PRESETS[preset](), in_keys=["x"], out_keys=["y"], target=0)
    expected, _ = explained(TORCH_GATED[how], PRESETS[preset](), x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CNN presets name the sigmoid of a gate in both forms
        with lrp:
            first = lrp(x=x)[1]
            second = lrp(x=x)[1]
    torch.testing.assert_close(first, expected)
    torch.testing.assert_close(second, expected)
    if preset == "CPLRP":  # gradient × input with the gate held constant
        torch.testing.assert_close(first, gradient_times_input(DETACHED_GATES[how], x))
