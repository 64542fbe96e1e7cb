"""Rows of a linear layer's weight picked by token ids (float64): output units where a score sums their product with a
signal, a gate the ids choose where they multiply another input's signal element by element.

The oracle for a gate is the same model explained from what the ids look up (the embedding's rows and the gate's
rows) as inputs: there the product of the gate and the other input's signal shares its relevance between them
(AttnLRP, CP-LRP), while rows held constant give it all to the other input and none to the ids.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import CPLRP, LRP, AttnLRP, EpsilonPlus
from tdhook.attribution.mappers.base import BaseRuleMapper
from tests.conftest import relative_error

F64 = torch.float64


class GatedByIds(nn.Module):
    """Token ids embedded by an ``nn.Embedding``, and rows of a Linear's weight they pick gating the projection of
    another input ``f``: ``embedding(ids) + proj(f) * gate.weight[ids]``."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.gate, self.proj = nn.Embedding(11, 6), nn.Linear(6, 11), nn.Linear(4, 6, bias=False)
        self.head = nn.Sequential(nn.Linear(6, 8, bias=False), nn.ReLU(), nn.Linear(8, 3, bias=False))

    def mix(self, embedded: torch.Tensor, rows: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        return self.head(embedded + self.proj(f) * rows).sum(1)

    def forward(self, ids: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        return self.mix(self.embedding(ids), self.gate.weight[ids], f)


@pytest.mark.parametrize(
    "preset",
    [AttnLRP, CPLRP, EpsilonPlus, lambda: BaseRuleMapper(stabilizer=0.0)],
    ids=["AttnLRP", "CPLRP", "EpsilonPlus", "LRP-0"],
)
def test_rows_picked_by_the_ids_that_gate_another_inputs_signal_are_refused_naming_them(preset):
    """The gate's rows were taken for the Linear's output units and held constant: ``f`` got the whole product's
    relevance and the ids none of it, without a word (AttnLRP: the ids' relevance 9 % off, relative L2, the model
    explained from the embedding's and the gate's rows as inputs, which halves the product). Refused, naming the key,
    the parameter and the other input."""
    torch.manual_seed(0)
    net = GatedByIds().to(F64)
    ids = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(1))
    f = torch.randn(4, 5, 4, dtype=F64, generator=torch.Generator().manual_seed(2))
    lrp = LRP(net, preset(), in_keys=["ids", "f"], out_keys=["y"])
    match = r"input key 'ids' picks rows of parameter 'gate.weight' that multiply, element by element, a signal "
    with pytest.raises(ValueError, match=match + r"computed from input 'f'"):
        lrp(TensorDict(ids=ids, f=f, batch_size=[4]))


class ScoreOfTwoInputs(nn.Module):
    """A score of the next tokens read from the rows of the head ``out`` they pick, element by element then summed,
    of a hidden state computed from the ids and another input ``f``."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.proj, self.out = nn.Embedding(11, 6), nn.Linear(4, 6, bias=False), nn.Linear(6, 11)
        self.body = nn.Sequential(nn.Linear(6, 8, bias=False), nn.ReLU(), nn.Linear(8, 6, bias=False))

    def hidden(self, embedded: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        return self.body(embedded + self.proj(f))[:, :-1]

    def forward(self, ids: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        return (self.hidden(self.embedding(ids), f) * self.out.weight[ids[:, 1:]]).sum(-1)


def test_a_score_summing_the_heads_rows_times_a_signal_of_two_inputs_is_no_gate():
    """The product summed over the features is the head's logits gathered at the next tokens: the rows are output
    units, not a gate, though the hidden state is computed from another input too. Each input gets LRP-0 of the
    model written with ``F.linear`` and a gather (gradient x input)."""
    torch.manual_seed(0)
    net = ScoreOfTwoInputs().to(F64)
    ids = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(1))
    f = torch.randn(4, 5, 4, dtype=F64, generator=torch.Generator().manual_seed(2))
    lrp = LRP(net, BaseRuleMapper(stabilizer=0.0), in_keys=["ids", "f"], out_keys=["y"], target=lambda y: y)
    td = lrp(TensorDict(ids=ids, f=f, batch_size=[4]))
    embedded = net.embedding(ids).detach().requires_grad_(True)
    given = f.clone().requires_grad_(True)
    logits = nn.functional.linear(net.hidden(embedded, given), net.out.weight)
    out = logits.gather(-1, ids[:, 1:, None]).squeeze(-1)
    grads = torch.autograd.grad(out, (embedded, given), torch.ones_like(out))
    assert relative_error(td["relevance", "ids"], (embedded * grads[0]).sum(-1).detach()) <= 1e-12
    assert relative_error(td["relevance", "f"], (given * grads[1]).detach()) <= 1e-12
