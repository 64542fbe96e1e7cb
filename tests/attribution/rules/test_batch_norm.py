"""MergeBatchNormRule: a layer merged with its BatchNorm, and the same layer in a call that is not merged."""

from __future__ import annotations

import copy

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.rules.batch_norm import MergeBatchNormRule
from tdhook.attribution.rules.modified import GammaRule
from tests.attribution.rules._helpers import CNN_PRESETS, make_layer
from tests.conftest import relative_error


class TestFastPaths:
    """The paths that skip autograd or a product, each checked against zennit and shown to be taken."""

    @pytest.mark.parametrize("in_place", [None, "mul_"])
    def test_a_layer_merged_last_call_but_not_this_one_gets_its_own_output(self, in_place):
        # Merged with its BatchNorm in the last call, the layer skips copying its output; a call that is not
        # merged copies it in the backward pass or, when an in-place operation changed it, recomputes it.
        layer, x = make_layer("conv2d")
        x = x.abs()
        grad_out = torch.randn_like(layer(x))

        def relevance() -> torch.Tensor:
            leaf = x.clone().requires_grad_(True)
            out = layer(leaf)
            if in_place:
                out = getattr(out, in_place)(2.0)
            return leaf.detach() * torch.autograd.grad(out, leaf, grad_out)[0]

        norm = nn.BatchNorm2d(4).double().eval()
        fresh = GammaRule(0.25)
        with fresh.register(layer):
            expected = relevance()
        rule = GammaRule(0.25)
        with rule.register(layer), MergeBatchNormRule().register(norm):
            norm(layer(x.clone().requires_grad_(True)))  # merged: the next call does not copy the output
            actual = relevance()
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-14)


class TestLazyBatchNorm:
    """A lazy BatchNorm (and layer) has no parameters when the rule is registered: the merge is prepared at its
    first call, as for a BatchNorm whose parameters are known."""

    @pytest.mark.parametrize("preset", sorted(CNN_PRESETS))
    @pytest.mark.parametrize("lazy_layer", [False, True], ids=["conv", "lazy-conv"])
    def test_first_call_equals_the_materialised_model(self, preset: str, lazy_layer: bool):
        torch.manual_seed(0)
        conv = nn.LazyConv2d(4, 3) if lazy_layer else nn.Conv2d(3, 4, 3)
        model = nn.Sequential(conv, nn.LazyBatchNorm2d(), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3)).double().eval()
        x = torch.randn(2, 3, 6, 6, dtype=torch.float64).clamp(-2.9, 2.9)

        def relevance(net: nn.Module) -> torch.Tensor:
            lrp = LRP(net, CNN_PRESETS[preset](), in_keys=["x"], out_keys=["y"])
            return lrp(TensorDict(x=x.clone(), batch_size=[2]))["relevance", "x"]

        first = relevance(model)  # materialised in this call, inside the context
        assert type(model[1]) is nn.BatchNorm2d and not torch.equal(first, torch.zeros_like(first))
        # The same model, its parameters known before the context (eval mode: the call changed no statistic).
        assert relative_error(first, relevance(copy.deepcopy(model))) <= 1e-12
