"""Later calls of a context put the identity rule of clipping calls (``clamp``, ``clamp_min``, ``clamp_max``, ``clip``,
``F.hardtanh``, ``F.relu6``, in place too: OLMo's and DBRX's ``clip_qkv``) on their own nodes, which saved their input
(the oracles: the rule written by hand, and a call in the function mode)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tdhook.attribution import CPLRP, LRP, AttnLRP
from tests.attribution._plan_helpers import F64, Product, halved, in_mode_and_in_context, zoo_calls
from tests.conftest import relative_error

CLIPS = {
    "torch.clamp": lambda h: torch.clamp(h, -1.0, 1.0),
    "Tensor.clamp": lambda h: h.clamp(min=-1.0, max=1.0),
    "Tensor.clamp, min only": lambda h: h.clamp(min=-1.0),
    "torch.clip": lambda h: torch.clip(h, min=-1.0, max=1.0),
    "F.hardtanh": F.hardtanh,
    "F.hardtanh in place": lambda h: F.hardtanh(h, inplace=True),
    "F.relu6": lambda h: F.relu6(h * 6.0) / 6.0,
    "F.relu6 in place": lambda h: F.relu6(h * 6.0, inplace=True) / 6.0,
    "Tensor.clamp_": lambda h: h.clamp_(min=-1.0, max=1.0),
    "torch.clip_": lambda h: torch.clip_(h, -1.0, 1.0),
    "Tensor.clamp_min": lambda h: h.clamp_min(-1.0),
    "torch.clamp_max": lambda h: torch.clamp_max(h, 1.0),
    "Tensor.clamp_min_": lambda h: h.clamp_min_(-1.0),
    "Tensor.clamp_max_": lambda h: h.clamp_max_(1.0),
    "nn.Hardtanh": nn.Hardtanh(),  # a module, whose rule the mode leaves alone
}

# The same clips, computed out of place on a copy: what the rule written by hand clips.
PLAIN = dict.fromkeys(["Tensor.clamp, min only", "Tensor.clamp_min", "Tensor.clamp_min_"], lambda h: h.clamp(min=-1.0))
PLAIN |= dict.fromkeys(["torch.clamp_max", "Tensor.clamp_max_"], lambda h: h.clamp(max=1.0))
PLAIN |= dict.fromkeys(["F.relu6", "F.relu6 in place"], lambda h: h.clamp(0.0, 1.0))


def plain_clip(name: str):
    return PLAIN.get(name, lambda h: torch.clamp(h, -1.0, 1.0))


class ClippedProduct(Product):
    """``out(clip(q(x)) * k(x))``, the clip called as a function (as OLMo and DBRX clip queries, keys and values)."""

    def __init__(self, clip) -> None:
        super().__init__()
        self.clip = clip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.clip(self.q(x)) * self.k(x))


def clipped_by_hand(model: ClippedProduct, x: torch.Tensor, clip) -> torch.Tensor:
    """AttnLRP's relevance for ``model``: the clip's input gets ``grad · clip(h) / h``, the product's gradient
    halved."""
    leaf = x.clone().requires_grad_(True)
    h = model.q(leaf)
    clipped = h * (clip(h) / h).detach()  # the identity rule: the relevance passes as it is
    logits = model.out(halved(clipped * model.k(leaf)))
    (grad,) = torch.autograd.grad(logits.max(-1).values.sum(), leaf)
    return leaf.detach() * grad


@pytest.mark.parametrize("preset", [AttnLRP, CPLRP])
@pytest.mark.parametrize("name", sorted(CLIPS))
def test_later_calls_put_a_clipping_calls_rule_on_its_node(applied, name: str, preset):
    """Before, every call of a model that clips ran in the function mode (OLMo and DBRX 1.6-1.9x a gradient pass at
    the tiny size). Later calls take the graph's way, with the mode's relevance to the last bit."""
    torch.manual_seed(0)
    model, x = ClippedProduct(CLIPS[name]).to(F64), torch.randn(5, 4, dtype=F64) * 3
    assert (model.q(x).abs() > 1).float().mean() > 0.3  # many units clipped
    lrp = LRP(model, preset(), in_keys=["x"], out_keys=["y"])
    in_mode, relevances = in_mode_and_in_context(lrp, x, 4)
    assert applied[-2:] == [True, True]
    for relevance in relevances:
        assert torch.equal(relevance, in_mode)
    if preset is AttnLRP:
        assert relative_error(in_mode, clipped_by_hand(model, x, plain_clip(name))) <= 1e-9  # the stabiliser aside
        # The clip's plain gradient (none at the clipped units) gives another relevance: the comparison can fail.
        leaf = x.clone().requires_grad_(True)
        logits = model.out(halved(plain_clip(name)(model.q(leaf)) * model.k(leaf)))
        (grad,) = torch.autograd.grad(logits.max(-1).values.sum(), leaf)
        assert relative_error(leaf.detach() * grad, in_mode) > 1e-2


class ViewClipped(Product):
    """``out(clip(q(x)) * k(x))`` with bounds given as tensors, or clipped in place through a view: nodes that are
    not a plain clip's (the call keeps the mode's rule)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.q(x)
        if self.kind == "tensor bounds":
            h = h.clamp(torch.tensor(-1.0, dtype=h.dtype), torch.tensor(1.0, dtype=h.dtype))
        else:
            h.view(-1).clamp_(-1.0, 1.0)
        return self.out(h * self.k(x))


@pytest.mark.parametrize("kind", ["tensor bounds", "in place through a view"])
def test_a_clip_whose_node_is_not_a_plain_clips_keeps_the_modes_rule(applied, kind: str):
    torch.manual_seed(0)
    model, x = ViewClipped(kind).to(F64), torch.randn(5, 4, dtype=F64) * 3
    lrp = LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"])
    in_mode, relevances = in_mode_and_in_context(lrp, x, 3)
    assert applied == []
    for relevance in relevances:
        assert torch.equal(relevance, in_mode)
    assert relative_error(in_mode, clipped_by_hand(model, x, plain_clip(kind))) <= 1e-9


def test_a_large_clip_keeps_the_modes_rule(applied):
    """A clip of more than 2¹⁴ elements (5 × 600 × 6 here) keeps the mode's rule: at a realistic size the rule on
    the node costs more than the mode saves (see ``functional._LARGEST_CLIP_ON_NODE``)."""
    torch.manual_seed(0)
    model, x = ClippedProduct(CLIPS["Tensor.clamp_"]).to(F64), torch.randn(5, 600, 4, dtype=F64) * 3
    lrp = LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"])
    in_mode, relevances = in_mode_and_in_context(lrp, x, 3)
    assert applied == []
    for relevance in relevances:
        assert torch.equal(relevance, in_mode)
    assert relative_error(in_mode, clipped_by_hand(model, x, plain_clip("Tensor.clamp_"))) <= 1e-6  # the stabiliser


@pytest.mark.parametrize("preset", [AttnLRP, CPLRP])
@pytest.mark.parametrize("name", ["olmo", "dbrx"])
def test_zoo_models_that_clip_qkv_run_later_calls_without_the_mode(applied, name: str, preset):
    """OLMo clips its queries, keys and values in place, DBRX its fused ``Wqkv`` output (``clip_qkv``): later calls
    take the graph's way, with the mode's relevance."""
    in_mode, relevances = zoo_calls(name, "eager", preset, 3)
    assert applied == [True, True]
    for relevance in relevances:
        assert torch.equal(relevance, in_mode)
