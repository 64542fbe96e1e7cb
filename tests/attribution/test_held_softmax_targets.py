"""CP-LRP holds every softmax output constant: a target unit computed from a softmax, in an output tensor it shares
with units that are not (a mixture density head, probabilities concatenated with a value), gets no relevance, and
is warned of; the other units, and AttnLRP, are not."""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import CPLRP, LRP, AttnLRP, EpsilonPlus

F64 = torch.float64


class MixtureDensity(nn.Module):
    """Mixture weights (a softmax), means and scales, concatenated."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.weights, self.means, self.scales = nn.Linear(8, 3), nn.Linear(8, 2), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return torch.cat(
            [torch.softmax(self.weights(h), -1), self.means(h), nn.functional.softplus(self.scales(h))], -1
        )


def explained(preset, target) -> tuple[torch.Tensor, list[str]]:
    torch.manual_seed(0)
    lrp = LRP(MixtureDensity().double(), preset, in_keys=["x"], out_keys=["y"], target=target)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        relevance = lrp(TensorDict(x=torch.randn(3, 4, dtype=F64), batch_size=[3]))["relevance", "x"]
    return relevance, [str(w.message) for w in caught if "gets no relevance" in str(w.message)]


@pytest.mark.parametrize(
    "target", [0, 2, torch.tensor([0, 1, 2]), "callable"], ids=["0", "2", "per sample", "callable"]
)
def test_a_mixture_weight_under_cplrp_is_warned_of(target):
    """Its relevance is zero everywhere, where the weight it explains is about a third (before: with no word)."""
    if isinstance(target, str):
        target = lambda y: y * torch.tensor([1.0, 1, 1, 0, 0, 0, 0], dtype=F64)  # noqa: E731 the mixture weights alone
    relevance, caught = explained(CPLRP(), target)
    assert not relevance.any()
    assert len(caught) == 1 and "target 'y' gets no relevance at any explained input" in caught[0]
    assert "CP-LRP holds every softmax output constant" in caught[0]


@pytest.mark.parametrize("preset, target", [(CPLRP, 3), (AttnLRP, 0), (EpsilonPlus, 0)], ids=["mean", "AttnLRP", "CNN"])
def test_a_target_that_gets_relevance_is_not_warned_of(preset, target):
    """A mean under CP-LRP, and the mixture weights under AttnLRP's softmax rule or a CNN preset (which name the
    softmax as no rule of theirs)."""
    relevance, caught = explained(preset(), target)
    assert relevance.any() and caught == []


class _Probabilities(nn.Module):
    """A classifier returning its probabilities: an ``nn.Softmax`` last layer, or ``F.softmax`` in the forward."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form, self.linear, self.softmax = form, nn.Linear(4, 5), nn.Softmax(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.linear(x)
        return self.softmax(logits) if self.form == "module" else torch.softmax(logits, -1)


@pytest.mark.parametrize("form", ["module", "function"])
def test_a_probability_target_under_cplrp_is_refused_saying_why(form):
    """A target made only of a softmax's outputs is cut from the inputs by CP-LRP's held softmax: the refusal said
    the target "does not depend on the explained inputs", which the model's own gradient contradicts. It now says
    what CP-LRP does with a softmax and what to explain instead; under AttnLRP the same target gets relevance."""
    torch.manual_seed(0)
    net = _Probabilities(form).double()
    td = TensorDict(x=torch.randn(2, 4, dtype=torch.float64), batch_size=[2])
    with pytest.raises(
        ValueError, match=r"does not depend on the explained inputs.*CP-LRP holds every softmax.*AttnLRP"
    ):
        LRP(net, CPLRP(), in_keys=["x"], out_keys=["y"], target=1)(td.clone())
    assert LRP(net, AttnLRP(), in_keys=["x"], out_keys=["y"], target=1)(td.clone())["relevance", "x"].any()


class _MaskedScores(nn.Module):
    """Scores replaced by a constant wherever a mask is off (OWL-ViT's ``finfo.min`` for masked queries): here all."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3, dtype=F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(torch.zeros(3, dtype=torch.bool), self.linear(x), -1.0)


def test_a_target_selected_from_constants_is_not_blamed_on_a_softmax():
    """No softmax in the model: the warning said CP-LRP's held softmax cut the target, where a mask selects a constant
    (and would give it no relevance under any preset)."""
    lrp = LRP(_MaskedScores(), CPLRP(), in_keys=["x"], out_keys=["y"], target=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        relevance = lrp(TensorDict(x=torch.randn(3, 4, dtype=F64), batch_size=[3]))["relevance", "x"]
    messages = [str(w.message) for w in caught if "gets no relevance" in str(w.message)]
    assert not relevance.any() and len(messages) == 1
    assert "if the target is computed from a softmax" in messages[0] and "torch.where over a mask" in messages[0]
