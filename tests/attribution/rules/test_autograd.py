"""The autograd functions behind every rule: a second backward pass over a freed graph."""

from __future__ import annotations

import pytest
import torch

from tdhook.attribution.rules.input_layer import FlatRule
from tests.attribution.rules._helpers import make_layer


class TestFastPaths:
    """The paths that skip autograd or a product, each checked against zennit and shown to be taken."""

    def test_a_second_backward_over_a_freed_graph_raises_torchs_error(self):
        # The first backward may have written into what the rule saved: a second one must not read it.
        layer, x = make_layer("linear")
        x = x.abs().requires_grad_(True)
        with FlatRule().register(layer):
            out = layer(x)
            torch.autograd.grad(out, x, torch.ones_like(out))
            with pytest.raises(RuntimeError, match="backward through the graph a second time"):
                torch.autograd.grad(out, x, torch.ones_like(out))
