"""MergeBatchNormRule: a layer merged with its BatchNorm, and the same layer in a call that is not merged."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tdhook.attribution.rules.batch_norm import MergeBatchNormRule
from tdhook.attribution.rules.modified import GammaRule
from tests.attribution.rules._helpers import make_layer


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
