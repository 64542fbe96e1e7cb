"""Later calls of a context put the identity rule of a ``tanh`` called as a function on its node, from its input kept
as a module's output, and halve an ``einsum`` of two activations on its own node (the oracles: the rules written by
hand, and a call in the function mode, to the last bit)."""

from __future__ import annotations

import copy

import pytest
import torch
from tensordict import TensorDict

from tdhook.attribution import CPLRP, LRP, AttnLRP
from tests.attribution._plan_helpers import F64, Product, call, halved, wrapped_on_a_batch
from tests.conftest import relative_error


class TanhProduct(Product):
    """``out(tanh(q(x)) * k(x))``, ``tanh`` called as a function; with ``where``: ``"in place"`` changes ``q``'s output
    in place before the ``tanh``, ``"computed"`` takes the ``tanh`` of ``2 · q(x)`` (no module's output), ``"twice"``
    calls ``q`` again after taking the ``tanh`` of its first output. ``2 · q(x)`` is computed as ``q(x) + q(x)``, a
    sum, which the nodes below the ``tanh`` do not compute again (see ``test_graph_inputs``)."""

    def __init__(self, where: str = "") -> None:
        super().__init__()
        self.where = where

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.q(x)
        if self.where == "in place":
            h.add_(h)
        activated = torch.tanh(h + h if self.where == "computed" else h)
        if self.where == "twice":
            activated = activated + 0.0 * self.q(x)
        return self.out(activated * self.k(x))


def tanh_by_hand(model: TanhProduct, x: torch.Tensor) -> torch.Tensor:
    """AttnLRP's relevance for ``model``: the ``tanh``'s input gets ``grad · tanh(h) / h``, the product's gradient
    halved (every layer bias-free: LRP-0 is the gradient)."""
    leaf = x.clone().requires_grad_(True)
    h = model.q(leaf) * (2.0 if model.where in ("in place", "computed") else 1.0)
    activated = h * (torch.tanh(h) / h).detach()  # the identity rule: the relevance passes as it is
    if model.where == "twice":
        activated = activated + 0.0 * model.q(leaf)
    logits = model.out(halved(activated * model.k(leaf)))
    (grad,) = torch.autograd.grad(logits.max(-1).values.sum(), leaf)
    return leaf.detach() * grad


def test_later_calls_put_tanhs_rule_on_its_node_from_the_modules_kept_output(applied):
    model, x, lrp = wrapped_on_a_batch(TanhProduct, AttnLRP)
    in_mode = call(lrp, x)  # a call that enters its context runs in the mode
    with lrp:
        relevances = [call(lrp, x) for _ in range(4)]
        assert len(model.q._forward_hooks) == 1  # the hook that keeps the tanh's input
        assert not copy.deepcopy(model).q._forward_hooks  # left out of copies made in the context
    # The first call finds an input it cannot name, the second records with every module's output: the later calls
    # run without the mode.
    assert applied == [True, True]
    assert not model.q._forward_hooks  # removed with the context
    assert relative_error(in_mode, tanh_by_hand(model, x)) <= 1e-9  # the stabiliser's 1e-10 aside
    for relevance in relevances:
        assert torch.equal(relevance, in_mode)  # the mode's relevance, to the last bit
    # The tanh's plain gradient gives another relevance: the comparison can fail.
    leaf = x.clone().requires_grad_(True)
    logits = model.out(halved(torch.tanh(model.q(leaf)) * model.k(leaf)))
    (grad,) = torch.autograd.grad(logits.max(-1).values.sum(), leaf)
    assert relative_error(leaf.detach() * grad, in_mode) > 1e-3


@pytest.mark.parametrize("where", ["in place", "computed", "twice"])
def test_a_tanh_whose_input_is_no_kept_output_keeps_its_mode(applied, where: str):
    """An input changed in place after its module returned it, computed after it, or a module called again after the
    ``tanh`` took its first output: no later call could find the input, and every call runs in the mode."""
    model, x, lrp = wrapped_on_a_batch(lambda: TanhProduct(where), AttnLRP)
    with lrp:
        relevances = [call(lrp, x) for _ in range(4)]
    assert applied == []
    expected = tanh_by_hand(model, x)
    for relevance in relevances:
        assert relative_error(relevance, expected) <= 1e-9


def test_a_tanh_input_changed_in_place_in_a_later_call_runs_it_in_the_mode(applied):
    """A branch the recording call did not take changes the kept output in place after the ``tanh`` took it: the
    factor from the changed values would be wrong, and the call runs in the mode."""

    class Late(TanhProduct):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.q(x)
            activated = torch.tanh(h)
            if self.where == "late":
                h.mul_(2.0)
            return self.out(activated * self.k(x))

    model, x, lrp = wrapped_on_a_batch(Late, AttnLRP)
    with lrp:
        planned = [call(lrp, x) for _ in range(3)]
        model.where = "late"
        changed = call(lrp, x)
    assert applied == [True, False]
    model.where = ""
    expected = tanh_by_hand(model, x)  # the tanh took h before the change
    for relevance in [*planned, changed]:
        assert relative_error(relevance, expected) <= 1e-9


class EinsumProduct(Product):
    """``out(einsum(q(x), k(x)))``, a product of two activations as an ``einsum`` whose output is a view."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.q(x).unflatten(-1, (2, 3)), self.k(x).unflatten(-1, (2, 3))
        return self.out(torch.einsum("bij,bij->bji", a, b).flatten(1))


def test_later_calls_halve_an_einsum_of_two_activations_on_its_node(applied):
    model, x, lrp = wrapped_on_a_batch(EinsumProduct, AttnLRP)
    in_mode = call(lrp, x)
    with lrp:
        relevances = [call(lrp, x) for _ in range(3)]
    assert applied == [True, True]
    leaf = x.clone().requires_grad_(True)
    a, b = model.q(leaf).unflatten(-1, (2, 3)), model.k(leaf).unflatten(-1, (2, 3))
    logits = model.out(halved(torch.einsum("bij,bij->bji", a, b)).flatten(1))
    (grad,) = torch.autograd.grad(logits.max(-1).values.sum(), leaf)
    assert torch.allclose(in_mode, leaf.detach() * grad, rtol=1e-12, atol=0)
    for relevance in relevances:
        assert torch.equal(relevance, in_mode)


@pytest.mark.parametrize("preset", ["attnlrp", "cplrp"])
@pytest.mark.parametrize("name", ["roberta", "mobilebert", "funnel"])
def test_zoo_models_with_a_tanh_head_run_later_calls_without_the_mode(applied, name: str, preset: str):
    """RoBERTa's, MobileBERT's and Funnel's classification heads call ``torch.tanh`` on a ``Linear``'s output (and
    Funnel's attention takes ``einsum`` products): later calls take the graph's way, with the mode's relevance."""
    from tests.attribution.test_lrp_transformer_zoo import ZOO, Explained, model_input

    architecture = ZOO[name]
    model = Explained(architecture.build("eager"), architecture.inputs)
    x = model_input(architecture, F64)
    lrp = LRP(model, (AttnLRP if preset == "attnlrp" else CPLRP)(), in_keys=["x"], out_keys=["y"])
    in_mode = lrp(TensorDict(x=x.clone(), batch_size=x.shape[:1]))["relevance", "x"]
    with lrp:
        relevances = [lrp(TensorDict(x=x.clone(), batch_size=x.shape[:1]))["relevance", "x"] for _ in range(3)]
    assert applied == [True]
    for relevance in relevances:
        assert torch.equal(relevance, in_mode)
    assert not any(module._forward_hooks for module in model.modules())


def test_keepers_of_a_wrapper_whose_plan_is_dropped_go_with_the_context():
    """A context left with a plan that keeps outputs removes the hooks; the next context starts without any."""
    model, x, lrp = wrapped_on_a_batch(TanhProduct, AttnLRP)
    for _ in range(2):
        with lrp:
            assert not any(hook for hook in model.q._forward_hooks.values())
            relevances = [call(lrp, x) for _ in range(3)]
        assert not model.q._forward_hooks
        assert torch.equal(relevances[-1], relevances[0])
