"""Gated norms (Mamba 2's ``MambaRMSNormGated``: ``rms_norm(h · silu(gate))``): the norm rule holds the scale, and the
gate's product and activation get the function modes' rules, as outside the norm (the oracle: the same model with the
product computed before an RMS norm that takes no gate), in float64."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn
from transformers.models.mamba2 import modeling_mamba2

from tdhook.attribution import CPLRP, LRP, AttnLRP
from tests.attribution.rules._helpers import F64, randn
from tests.conftest import relative_error

PRESETS = {"AttnLRP": AttnLRP, "CPLRP": CPLRP}
# Mamba 2's gated RMS norm, renamed ``Mamba2RMSNormGated`` in transformers 5.25.
MambaRMSNormGated = getattr(modeling_mamba2, "Mamba2RMSNormGated", None) or modeling_mamba2.MambaRMSNormGated


class GatedMixer(nn.Module):
    """A signal and a gate from two linear maps, a gated RMS norm (``gated``: the gate given to the norm; else the
    product computed before it, the same values), a head; no biases."""

    def __init__(self, gated: bool) -> None:
        super().__init__()
        self.signal, self.gate = nn.Linear(4, 6, bias=False), nn.Linear(4, 6, bias=False)
        self.norm, self.head = MambaRMSNormGated(6, group_size=3), nn.Linear(6, 3, bias=False)
        self.gated = gated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, g = self.signal(x), self.gate(x)
        return self.head(self.norm(h, g) if self.gated else self.norm(h * F.silu(g)))


def explain(model: nn.Module, x: torch.Tensor, preset: str) -> list[torch.Tensor]:
    lrp = LRP(model, PRESETS[preset](), in_keys=["x"], out_keys=["y"])
    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with lrp:
            for _ in range(2):  # the second call by the recorded plan
                td = lrp(TensorDict(x=x.clone(), batch_size=[len(x)]))
                assert torch.equal(td["y"], model(x))
                results.append(td["relevance", "x"])
    return results


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_gated_norms_product_gets_the_function_rules(preset: str):
    """The norm's rule ran its forward with the function modes off: the gate's product and its ``silu`` kept their
    plain gradient, with no warning (with biases zeroed, 2.3 to 4.1 times the explained logit's relevance, under
    AttnLRP and CP-LRP alike; 0.79 to 0.93 relative off the product computed outside). They get the modes' rules:
    the relevance of the product computed before the norm, conserved, in later calls of a context too."""
    torch.manual_seed(0)
    model, reference = GatedMixer(gated=True).to(F64), GatedMixer(gated=False).to(F64)
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
    reference.load_state_dict(model.state_dict())
    x = randn(5, 4)
    first, later = explain(model, x, preset)
    expected = explain(reference, x, preset)[0]
    assert relative_error(first, expected) <= 1e-6  # the norm computes in float32, the gate's product there too
    assert relative_error(later, first) <= 1e-12
    logit = model(x).max(1).values
    assert ((first.sum(1) - logit).abs() / logit.abs()).max() <= 1e-6


def test_a_gated_norms_product_no_function_rule_covers_is_named():
    """Under a CNN preset no function rule covers the gate's product: its plain gradient (2.3 to 4.1 times the
    logit's relevance), which the wrapper named outside the norm and not inside it. The norm's rule names it."""
    from tdhook.attribution import EpsilonPlus

    torch.manual_seed(0)
    model, x = GatedMixer(gated=True).to(F64), randn(5, 4)
    lrp = LRP(model, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
    with pytest.warns(
        UserWarning, match=rf"on {MambaRMSNormGated.__name__}: its forward computes silu, mul on activations"
    ):
        lrp(TensorDict(x=x.clone(), batch_size=[len(x)]))
