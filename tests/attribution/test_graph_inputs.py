"""Later calls of a context put the identity rule of a ``tanh`` whose input no node saved and no module returned
(Gemma 2's softcapping, ``tanh(a / c) · c``) on its node, its input computed again from the nodes below (the
oracles: the rule written by hand, and a call in the function mode)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tdhook.attribution import CPLRP, LRP, AttnLRP
from tdhook.attribution._graph_inputs import chain_of, computed_again
from tests.attribution._plan_helpers import F64, Product, halved, in_mode_and_in_context, wrapped_on_a_batch, zoo_calls
from tests.conftest import relative_error


class Softcapped(nn.Module):
    """Attention logits ``q · kᵀ · s`` capped as ``tanh(l / c) · c`` (a ``bmm``), the capped weights times ``q``,
    then a head without a bias whose logits are capped too (an ``mm``), as Gemma 2 caps them; with ``summed``, the
    attention logits are ``q + k`` (element-wise weights), which no chain computes again."""

    def __init__(self, summed: bool = False) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(4, 6, bias=False), nn.Linear(4, 6, bias=False)
        self.head = nn.Linear(6, 3, bias=False)
        self.summed = summed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.q(x), self.k(x)
        if self.summed:
            h = torch.tanh((q + k) / 2.0) * 2.0 * q
        else:
            h = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * 0.5 / 2.0) * 2.0 @ q
        return torch.tanh(self.head(h) / 3.0) * 3.0


def capped_by_hand(model: Softcapped, x: torch.Tensor) -> torch.Tensor:
    """AttnLRP's relevance: each tanh's input ``t`` gets ``grad · tanh(t) / t``, each product of two activations
    half its gradient (``q · kᵀ`` and the capped weights times ``q``)."""
    leaf = x.clone().requires_grad_(True)
    q, k = model.q(leaf), model.k(leaf)
    t = halved(torch.matmul(q, k.transpose(-1, -2))) * 0.5 / 2.0
    weights = t * (torch.tanh(t) / t).detach() * 2.0
    logits = model.head(halved(weights @ q)) / 3.0
    out = logits * (torch.tanh(logits) / logits).detach() * 3.0
    (grad,) = torch.autograd.grad(out.max(-1).values.sum(), leaf)
    return leaf.detach() * grad


def test_chain_computes_a_matmuls_quotient_again_to_the_last_bit():
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 4, requires_grad=True), torch.randn(2, 4, 3, requires_grad=True)
    x = torch.matmul(q, k) * 0.5 / 30.0
    chain = chain_of(x, {})
    assert chain == ("DivBackward0", "MulBackward0", "UnsafeViewBackward0", "BmmBackward0")
    assert torch.equal(computed_again(torch.tanh(x).grad_fn, chain, x.shape), x)
    assert chain_of((q + 1.0) / 30.0, {}) is None  # a sum: no saved tensors compute it
    assert computed_again(torch.tanh((q * 1.0) / 30.0).grad_fn, chain, q.shape) is None  # another chain


@pytest.mark.parametrize("preset", [AttnLRP, CPLRP])
def test_later_calls_put_a_softcapping_tanhs_rule_on_its_node(applied, preset):
    """Every call of a model that caps its logits (Gemma 2: AttnLRP 1.6x a gradient pass at the tiny size) ran in
    the function mode: later calls take the graph's way, with the mode's relevance to the last bit."""
    torch.manual_seed(0)
    model, x = Softcapped().to(F64), torch.randn(5, 4, 4, dtype=F64) * 3
    lrp = LRP(model, preset(), in_keys=["x"], out_keys=["y"])
    in_mode, relevances = in_mode_and_in_context(lrp, x, 4)
    assert applied == [True, True]  # the second call records again, keeping the modules' outputs (none is a tanh's)
    for relevance in relevances:
        assert torch.equal(relevance, in_mode)
    if preset is AttnLRP:
        assert relative_error(in_mode, capped_by_hand(model, x)) <= 1e-8  # the stabiliser aside
        # The tanhs' plain gradients give another relevance: the comparison can fail.
        leaf = x.clone().requires_grad_(True)
        q, k = model.q(leaf), model.k(leaf)
        weights = torch.tanh(halved(torch.matmul(q, k.transpose(-1, -2))) * 0.5 / 2.0) * 2.0
        logits = torch.tanh(model.head(halved(weights @ q)) / 3.0) * 3.0
        (grad,) = torch.autograd.grad(logits.max(-1).values.sum(), leaf)
        assert relative_error(leaf.detach() * grad, in_mode) > 1e-3


def test_a_tanh_whose_input_no_chain_computes_keeps_the_mode(applied):
    model, x, lrp = wrapped_on_a_batch(lambda: Softcapped(summed=True), AttnLRP, (5, 4, 4))
    in_mode, relevances = in_mode_and_in_context(lrp, x, 4)
    assert applied == []
    for relevance in relevances:
        assert torch.equal(relevance, in_mode)


def test_a_large_tanh_input_keeps_the_mode(applied):
    """Attention logits of more than 2¹⁴ elements (5 × 64 × 64 here) are not computed again: at a realistic size the
    extra ``bmm`` costs more than the mode (see ``_graph_inputs._LARGEST``)."""
    model, x, lrp = wrapped_on_a_batch(Softcapped, AttnLRP, (5, 64, 4))
    in_mode, relevances = in_mode_and_in_context(lrp, x, 4)
    assert applied == []
    for relevance in relevances:
        assert torch.equal(relevance, in_mode)
    small = torch.randn(5, 4, 4, dtype=F64)
    assert chain_of(model.q(small) @ model.k(small).transpose(-1, -2) / 2.0, {}) is not None
    assert chain_of(model.q(x) @ model.k(x).transpose(-1, -2) / 2.0, {}) is None


@pytest.mark.parametrize("preset", [AttnLRP, CPLRP])
def test_gemma2_runs_later_calls_without_the_mode(applied, preset):
    in_mode, relevances = zoo_calls("gemma2", "eager", preset, 4)
    assert applied == [True, True]  # the second call records again, keeping the modules' outputs (none is a tanh's)
    for relevance in relevances:
        assert torch.equal(relevance, in_mode)


class ScaledTanh(Product):
    """``out(tanh(h) * k(x))`` with ``h = 2 · q(x)``, computed anew or (``in_place``) in ``q``'s output: no module's
    output, but the nodes below compute it again (a product by a number over the ``Linear``'s ``mm``)."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.in_place = in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.q(x)
        h = h.mul_(2.0) if self.in_place else h * 2.0
        return self.out(torch.tanh(h) * self.k(x))


@pytest.mark.parametrize("in_place", [False, True], ids=["computed", "in place"])
def test_a_tanh_of_a_modules_output_times_a_number_takes_the_graphs_way(applied, in_place: bool):
    model, x, lrp = wrapped_on_a_batch(lambda: ScaledTanh(in_place), AttnLRP)
    in_mode, relevances = in_mode_and_in_context(lrp, x, 4)
    assert applied == [True, True]
    for relevance in relevances:
        assert torch.equal(relevance, in_mode)
    leaf = x.clone().requires_grad_(True)  # by hand: the identity rule on the tanh, the product's gradient halved
    h = model.q(leaf) * 2.0
    logits = model.out(halved(h * (torch.tanh(h) / h).detach() * model.k(leaf)))
    (grad,) = torch.autograd.grad(logits.max(-1).values.sum(), leaf)
    assert relative_error(in_mode, leaf.detach() * grad) <= 1e-9
