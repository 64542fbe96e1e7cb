"""Token ids looked up beside their embedding, or carried into another embedding, on one call of a context only.

A model may branch on the values of the ids it is fed: a call of an open context whose ids take the branch looks them
up where an earlier call, with inputs of the same keys, types and shapes and the same modules, did not. Its lookup
is refused as in a call of its own, and the calls that do not take the branch get LRP-0 (gradient × input of the
embedding's output). The ids also reach another embedding through calls that return several integer tensors
(``split``, ``chunk``, ``unbind``): refused by name, as the other ways of carrying them are.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.mappers.base import BaseRuleMapper
from tests.conftest import relative_error

F64 = torch.float64
TRIGGER = 10  # the token whose presence takes the branch


class BranchesOnTheIds(nn.Module):
    """Token ids embedded by an ``nn.Embedding``; where one of them is ``TRIGGER``, they are also looked up beside it:
    in a parameter (``"table"``), or shifted and embedded by a second embedding (``"shifted"``)."""

    def __init__(self, lookup: str) -> None:
        super().__init__()
        self.lookup = lookup
        self.embedding, self.second = nn.Embedding(11, 6), nn.Embedding(11, 6)
        self.table = nn.Parameter(torch.randn(11, 6))
        self.head = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        embedded = self.embedding(tokens)
        if bool((tokens == TRIGGER).any()):
            if self.lookup == "table":
                embedded = embedded + self.table[tokens]
            else:
                embedded = embedded + self.second(tokens.roll(1, 1))
        return self.head(embedded).sum(1)


def lrp0_of_the_embedding(net: BranchesOnTheIds, tokens: torch.Tensor) -> torch.Tensor:
    """LRP-0 of the tokens where the branch is not taken: gradient × input of the embedding's output, per token."""
    embedded = net.embedding(tokens).detach().requires_grad_(True)
    out = net.head(embedded).sum(1)
    (gradient,) = torch.autograd.grad(out.gather(1, out.argmax(1, keepdim=True)).sum(), embedded)
    return (embedded * gradient).sum(-1).detach()


@pytest.mark.parametrize(
    "lookup, match",
    [
        ("table", r"input key 'tokens' is embedded by 'embedding' and also indexes parameter 'table'"),
        ("shifted", r"input key 'tokens' reaches 'second' \(Embedding\) through token ids computed from it"),
    ],
)
def test_a_lookup_only_some_ids_make_is_refused_on_the_call_that_makes_it(lookup: str, match: str):
    """Calls of one context with inputs of the same signature: those without the trigger are explained (LRP-0),
    the one with it is refused, naming the lookup, and the next without it is explained again. A check made once
    per context, or once per signature of the inputs, let the lookup's share of the relevance go without a word."""
    torch.manual_seed(0)
    net = BranchesOnTheIds(lookup).to(F64)
    plain = torch.randint(0, TRIGGER, (4, 5), generator=torch.Generator().manual_seed(1))
    triggering = plain.clone()
    triggering[2, 3] = TRIGGER
    lrp = LRP(net, BaseRuleMapper(stabilizer=0.0), in_keys=["tokens"], out_keys=["y"])
    with lrp:
        for tokens in (plain, triggering, plain.flip(1)):
            if bool((tokens == TRIGGER).any()):
                with pytest.raises(ValueError, match=match):
                    lrp(TensorDict(tokens=tokens, batch_size=[4]))
                continue
            td = lrp(TensorDict(tokens=tokens, batch_size=[4]))
            assert relative_error(td["relevance", "tokens"], lrp0_of_the_embedding(net, tokens)) <= 1e-12


class SplitsTheIds(nn.Module):
    """Token ids embedded as given, and their halves (or rows) put together again by ``how`` and embedded by a second
    embedding: token values carried on by a call that returns several integer tensors."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.embedding, self.second = nn.Embedding(11, 6), nn.Embedding(11, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.how == "split":
            parts = tokens.split(2, dim=1)
        elif self.how == "chunk":
            parts = torch.chunk(tokens, 2, dim=1)
        else:
            parts = [row[None] for row in tokens.unbind(0)]
        again = torch.cat(parts[::-1], dim=0 if self.how == "unbind" else 1)
        return self.head(self.embedding(tokens) + self.second(again)).sum(1)


@pytest.mark.parametrize("how", ["split", "chunk", "unbind"])
def test_ids_carried_through_calls_returning_several_tensors_and_embedded_are_refused_by_name(how: str):
    """The pieces of the ids, put together in another order and embedded by a second embedding, are token values:
    that lookup's relevance could not reach the tokens. Refused by name on every call of a context."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 11, (4, 6), generator=torch.Generator().manual_seed(1))
    lrp = LRP(SplitsTheIds(how).to(F64), BaseRuleMapper(stabilizer=0.0), in_keys=["tokens"], out_keys=["y"])
    with lrp:
        for _ in range(2):
            with pytest.raises(ValueError, match=r"'tokens' reaches 'second' \(Embedding\) through token ids"):
                lrp(TensorDict(tokens=tokens, batch_size=[4]))
