"""Activations called as functions at inputs of exactly 0: the relevance their identity rule drops is warned about.

The identity rule passes ``grad · f(x) / x``, so an output ``f(0) != 0`` (``torch.sigmoid``, ``F.softplus`` behind
a ReLU) keeps its relevance: the input relevance falls short of the explained output by exactly the relevance of
those outputs. An activation module warns about it; a call must too, naming the function.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.rules import CPLRP, AttnLRP

F64 = torch.float64
ACTIVATIONS = {"sigmoid": torch.sigmoid, "softplus": F.softplus}


class ActivatedHead(nn.Module):
    """``head(f(relu(x)))`` with ``f`` called as a function: no module holds a rule but the head."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.head = nn.Linear(4, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(ACTIVATIONS[self.name](F.relu(x)))


def _explained(model: nn.Module, mapper, x: torch.Tensor, calls: int = 1) -> tuple[TensorDict, list[str]]:
    lrp = LRP(model, mapper, in_keys=["x"], out_keys=["y"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with lrp:
            for _ in range(calls):
                td = lrp(TensorDict(x=x, batch_size=[x.shape[0]]))
    return td, [str(w.message) for w in caught if "exactly 0" in str(w.message)]


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
@pytest.mark.parametrize("preset", [AttnLRP, CPLRP], ids=["AttnLRP", "CPLRP"])
def test_a_call_at_zero_inputs_warns_once_and_loses_exactly_their_relevance(name, preset):
    torch.manual_seed(0)
    model = ActivatedHead(name).to(F64)
    x = torch.randn(6, 4, dtype=F64)
    td, caught = _explained(model, preset(stabilizer=1e-15), x, calls=3)
    assert len(caught) == 1 and f"call of {name}" in caught[0] and f"{name}(0) != 0" in caught[0]
    # Closed form: the head's relevance of each activation output, f(h) · w_target, is lost where h = 0.
    h = F.relu(x)
    target = td["y"].argmax(-1)
    out_relevance = ACTIVATIONS[name](h) * model.head.weight.detach()[target]
    lost = (out_relevance * (h == 0)).sum(-1)
    explained = td["y"].gather(-1, target[:, None])[:, 0]
    torch.testing.assert_close(td["relevance", "x"].sum(-1), explained - lost, rtol=1e-9, atol=1e-12)
    assert lost.abs().max() > 0.1 * explained.abs().max()  # the loss is not small: the warning matters


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_no_warning_where_no_input_is_zero_and_relevance_is_conserved(name):
    torch.manual_seed(0)
    model = ActivatedHead(name).to(F64)
    x = torch.rand(6, 4, dtype=F64) + 0.1
    td, caught = _explained(model, AttnLRP(stabilizer=1e-15), x)
    assert caught == []
    torch.testing.assert_close(td["relevance", "x"].sum(-1), td["y"].max(-1).values, rtol=1e-9, atol=1e-12)


def test_no_warning_for_a_held_gate_at_zero_inputs():
    # sigmoid(relu(x)) gating a signal is held constant: no relevance reaches its outputs, none is lost.
    class Gated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.head = nn.Linear(4, 4, bias=False), nn.Linear(4, 3, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.up(x) * torch.sigmoid(F.relu(x)))

    torch.manual_seed(0)
    x = torch.randn(6, 4, dtype=F64)
    td, caught = _explained(Gated().to(F64), CPLRP(stabilizer=1e-15), x)
    assert caught == []
    torch.testing.assert_close(td["relevance", "x"].sum(-1), td["y"].max(-1).values, rtol=1e-9, atol=1e-12)
