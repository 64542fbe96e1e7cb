"""Token values computed from token ids (float64): arithmetic, one-hot codes and lookups by ``gather`` beside their
embedding are refused by name, as the lookup of the ids themselves is.

The ids' relevance is that of their ``nn.Embedding``'s output; a second lookup of the ids (or of values computed from
them) in a parameter has its rows held constant, and its share of the relevance is lost. These ways to it lost it
without a word: the ids' relevance summed to another number than the explained output with biases zeroed (LRP-0).
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.mappers.base import BaseRuleMapper
from tests.attribution.test_numeric_inputs import KeyProduct

F64 = torch.float64


def explain_tokens(net: nn.Module, target=None) -> TensorDict:
    """``net`` (float64, its seed 0) explained from 4 x 5 random token ids under LRP-0."""
    tokens = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(1))
    lrp = LRP(net, BaseRuleMapper(stabilizer=0.0), in_keys=["tokens"], out_keys=["y"], target=target)
    return lrp(TensorDict(tokens=tokens, batch_size=[4]))


LOOKUPS = {
    "plus-zero": lambda ids, table: table[ids + 0],
    "times-one": lambda ids, table: table[1 * ids],
    "remainder": lambda ids, table: table[ids % table.shape[0]],
    "clamp": lambda ids, table: table[ids.clamp(0, table.shape[0] - 1)],
    "offset": lambda ids, table: table[torch.where(ids > 0, ids - 1, 0)],
    "gather": lambda ids, table: table.expand(ids.shape[0], -1, -1).gather(1, ids[..., None].expand(-1, -1, 6)),
    "one-hot": lambda ids, table: F.one_hot(ids, table.shape[0]).to(table.dtype) @ table,
    "one-hot-linear": lambda ids, table: F.linear(F.one_hot(ids, table.shape[0]).to(table.dtype), table.T),
    "as-numbers": lambda ids, table: ids.double()[..., None] * table[0],
    "embedding-bag": lambda ids, table: F.embedding_bag(ids, table, mode="sum")[:, None],
    "torch.embedding": lambda ids, table: torch.embedding(table, ids),
    "sort": lambda ids, table: table[ids.sort(-1).values],
    "searchsorted": lambda ids, table: table[torch.searchsorted(torch.arange(11), ids)],
    "scatter": lambda ids, table: table[torch.zeros_like(ids).scatter(1, torch.arange(5).expand(4, 5), ids)],
    "max": lambda ids, table: table[ids.max(-1, keepdim=True).values.expand_as(ids)],
    "cumsum": lambda ids, table: table[ids.cumsum(-1) % table.shape[0]],
    "new-tensor": lambda ids, table: table[ids.new_tensor(ids)],
    "power": lambda ids, table: table[ids**1],
    "rsub": lambda ids, table: table[torch.rsub(ids, table.shape[0] - 1)],
    "invert": lambda ids, table: table[~~ids],
    "scatter-add-into": lambda ids, table: table[
        torch.zeros_like(ids).scatter_add_(1, torch.arange(5).expand(4, 5), ids)
    ],
    "index-add-into": lambda ids, table: table[torch.zeros_like(ids).index_add_(1, torch.arange(5), ids)],
    "index-put-into": lambda ids, table: table[torch.zeros_like(ids).index_put_((torch.arange(4),), ids)],
    "rows-of-eye": lambda ids, table: torch.eye(table.shape[0], dtype=table.dtype)[ids] @ table,
    "one-hot-scatter-into": lambda ids, table: one_hot_written(ids, table, scatter=True) @ table,
    "one-hot-set-into": lambda ids, table: one_hot_written(ids, table, scatter=False) @ table,
    "one-hot-compared": lambda ids, table: (ids[..., None] == torch.arange(table.shape[0])).to(table.dtype) @ table,
    "one-hot-torch.eq": lambda ids, table: torch.eq(torch.arange(table.shape[0]), ids.unsqueeze(-1)).double() @ table,
    "one-hot-compared-linear": lambda ids, table: F.linear(
        ids[..., None].eq(torch.arange(table.shape[0])).type(table.dtype), table.T
    ),
    "one-hot-compared-where": lambda ids, table: (
        torch.where(
            ids[..., None] == torch.arange(11),
            torch.tensor(1.0, dtype=table.dtype),
            torch.tensor(0.0, dtype=table.dtype),
        )
        @ table
    ),
    "one-hot-compared-transposed": lambda ids, table: (
        (torch.arange(11)[:, None] == ids[:, None, :]).transpose(1, 2).double() @ table
    ),
    "one-hot-compared-mT": lambda ids, table: (torch.arange(11)[:, None] == ids[:, None, :]).mT.double() @ table,
    "one-hot-compared-T": lambda ids, table: (torch.arange(11)[:, None, None] == ids.T[None]).T.double() @ table,
    "ids-T": lambda ids, table: table[ids.T.T],
    "ids-mT": lambda ids, table: table[ids.mT.mT],
    "ids-data": lambda ids, table: table[ids.data + 0],
    "one-hot-compared-sliced": lambda ids, table: (ids[..., None] == torch.arange(12))[..., :11].double() @ table,
    "one-hot-compared-negated": lambda ids, table: (~(ids[..., None] != torch.arange(11))).double() @ table,
    "one-hot-compared-masked": lambda ids, table: (
        ((ids[..., None] == torch.arange(11)) & (ids > 0)[..., None]).double() @ table
    ),
    "thermometer-compared": lambda ids, table: (ids[..., None] >= torch.arange(table.shape[0])).double() @ table,
    "bits-reinterpreted": lambda ids, table: table[ids.view(torch.float64).view(torch.int64)],
}


def one_hot_written(ids: torch.Tensor, table: torch.Tensor, scatter: bool) -> torch.Tensor:
    """A one-hot code of ``ids`` written into zeros at places given by them (``scatter_``, ``z[..., ids] = 1``)."""
    codes = torch.zeros(*ids.shape, table.shape[0], dtype=table.dtype)
    if scatter:
        return codes.scatter_(-1, ids[..., None], 1.0)
    codes[torch.arange(ids.shape[0])[:, None], torch.arange(ids.shape[1]), ids] = 1.0
    return codes


class TableBeside(nn.Module):
    """Token ids embedded by an ``nn.Embedding``, with values computed from them looked up in a parameter too."""

    def __init__(self, lookup: str) -> None:
        super().__init__()
        self.lookup = lookup
        self.embedding, self.head = nn.Embedding(11, 6), nn.Linear(6, 3, bias=False)
        self.table = nn.Parameter(torch.randn(11, 6))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(tokens) + LOOKUPS[self.lookup](tokens, self.table)).sum(1)


@pytest.mark.filterwarnings("ignore:To copy construct from a tensor")  # torch's advice on new_tensor
@pytest.mark.parametrize("lookup", list(LOOKUPS))
def test_values_computed_from_token_ids_and_looked_up_beside_their_embedding_are_refused_naming_the_table(lookup):
    """``table[ids + 0]``, ``table[ids % n]``, ``gather``, a one-hot code times the table, the ids used as numbers
    with a weight, ``F.embedding_bag``: each lost the lookup's share of the relevance without a word. Refused,
    naming the key, the embedding and the parameter."""
    torch.manual_seed(0)
    match = r"input key 'tokens' is embedded by 'embedding' and also indexes (a view of )?parameter 'table'"
    with pytest.raises(ValueError, match=match):
        explain_tokens(TableBeside(lookup).to(F64))


class SecondEmbedding(nn.Module):
    """Token ids embedded by an ``nn.Embedding``, and ids computed from them (hashed into buckets, as hash embeddings
    do) embedded by a second one."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.buckets, self.head = nn.Embedding(11, 6), nn.Embedding(5, 6), nn.Linear(6, 3, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(tokens) + self.buckets((tokens * 7 + 3) % 5)).sum(1)


def test_ids_hashed_from_token_ids_into_a_second_embedding_are_refused_naming_it():
    """A second ``nn.Embedding`` of ids hashed from the explained ones held the relevance of its lookup, lost
    without a word; refused as the lookups of shifted or copied ids are."""
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"input key 'tokens' reaches 'buckets' \(Embedding\) through token ids"):
        explain_tokens(SecondEmbedding().to(F64))


class OffsetOwnTable(nn.Embedding):
    """An ``nn.Embedding`` that looks its own table up at ids it computes (an offset of zero, a one-hot code): one
    lookup of the ids."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = (
            F.embedding(ids - 0, self.weight) + F.one_hot(ids, self.num_embeddings).to(self.weight.dtype) @ self.weight
        )
        return rows / 2


class OwnTableNet(nn.Module):
    """The ids embedded by :class:`OffsetOwnTable`, with positions numbered from the padding (``ids.ne(0).cumsum(1)``)
    and steps shaped like the ids (``arange(n).expand_as(ids).type_as(ids)``), each in an embedding of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.positions, self.steps = OffsetOwnTable(11, 6), nn.Embedding(8, 6), nn.Embedding(8, 6)
        self.head = nn.Linear(6, 3, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = tokens.ne(0).long().cumsum(1)
        steps = torch.arange(tokens.shape[1]).expand_as(tokens).type_as(tokens)  # shaped like the ids, no values
        return self.head(self.embedding(tokens) * 2 + self.positions(positions) + self.steps(steps)).sum(1)


def test_values_computed_from_the_ids_inside_their_embedding_and_positions_are_no_lookup_beside_it():
    """Arithmetic and one-hot codes of the ids inside their own embedding, on its own table, are its lookup; positions
    counted from the ids are no token values: the ids get the relevance of their embedding, LRP-0 as gradient x input
    of the embedding's output (the positions' share, an additive embedding, is theirs)."""
    torch.manual_seed(0)
    net = OwnTableNet().to(F64)
    td = explain_tokens(net, target=lambda y: y)
    embedded = net.embedding(td["tokens"]).detach()
    expected = (net.head(embedded * 2).sum(-1)).detach()  # linear in the embedding: its share of each output
    torch.testing.assert_close(td["relevance", "tokens"], expected, rtol=1e-10, atol=1e-12)


class Masked(nn.Module):
    """Token ids embedded, with what models compute from comparisons of them: a padding mask (``ids != 0``) and the
    positions counted from it, a causal mask, a mask of special tokens (``(ids[..., None] == special).any(-1)``),
    pairs of equal tokens, and the pooling at the last end-of-text token (``(ids == eos).int().argmax(-1)``, CLIP's)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.positions, self.head = nn.Embedding(11, 6), nn.Embedding(6, 6), nn.Linear(6, 3, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        padding = tokens != 0
        positions = padding.long().cumsum(1)
        causal = torch.arange(tokens.shape[1])[:, None] >= torch.arange(tokens.shape[1])
        special = (tokens[..., None] == torch.tensor([1, 2])).any(-1)
        pairs = (tokens[:, :, None] == tokens[:, None, :]) & causal
        h = (self.embedding(tokens) + self.positions(positions)) * (padding & ~special)[..., None].to(F64)
        h = pairs.to(F64) @ h + causal.to(F64) @ h
        last = (tokens == 10).int().argmax(-1)
        return self.head(h[torch.arange(tokens.shape[0]), last])


def test_masks_compared_from_token_ids_are_no_lookup_beside_their_embedding():
    """Masks, positions and pooling from comparisons of the ids are not codes of them: the ids get the relevance of
    their embedding, LRP-0 as gradient x input of the embedding's output (the model is linear in it)."""
    torch.manual_seed(0)
    net = Masked().to(F64)
    td = explain_tokens(net, target=lambda y: y)
    leaf = net.embedding(td["tokens"]).detach().requires_grad_()
    handle = net.embedding.register_forward_hook(lambda module, args, out: leaf)
    try:
        (grad,) = torch.autograd.grad(net(td["tokens"]).sum(), leaf)
    finally:
        handle.remove()
    torch.testing.assert_close(td["relevance", "tokens"], (leaf * grad).sum(-1).detach(), rtol=1e-10, atol=1e-12)


class Arithmetic(nn.Module):
    """Token ids embedded (or embeddings given: ``ids=False``), then ``steps`` products and sums of activations."""

    def __init__(self, steps: int, ids: bool) -> None:
        super().__init__()
        self.embedding, self.head, self.steps, self.ids = nn.Embedding(11, 4), nn.Linear(4, 2), steps, ids

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embedding(tokens) if self.ids else tokens
        for _ in range(self.steps):
            h = h * 1.0 + 0.0
        return self.head(h).sum(1)


def python_calls(steps: int, ids: bool) -> int:
    """The Python and builtin calls of one explained call of :class:`Arithmetic`, in an open context (warmed up)."""
    torch.manual_seed(0)
    lrp = LRP(Arithmetic(steps, ids), BaseRuleMapper(), in_keys=["tokens"], out_keys=["y"])
    tokens = torch.tensor([[1, 2, 3]]) if ids else torch.randn(1, 3, 4)
    td = TensorDict(tokens=tokens, batch_size=[1])
    count = [0]

    def profile(frame, event, arg) -> None:
        count[0] += event in ("call", "c_call")

    with lrp:
        lrp(td.clone())
        sys.setprofile(profile)
        try:
            lrp(td.clone())
        finally:
            sys.setprofile(None)
    return count[0]


def test_arithmetic_on_activations_of_a_call_fed_token_ids_costs_few_more_python_calls():
    # The search for token values runs on every arithmetic call of a call fed ids: on activations it may add the mode's
    # own call, the call it wraps and a look at each tensor operand, not more (it made 13 calls on each: 11 of them
    # to find no token values; 10 % more calls on a whole tiny Llama fed ids than before the search, 3 % now).
    steps = 100
    per_call_from_ids = (python_calls(steps, True) - python_calls(0, True)) / (2 * steps)
    per_call_from_embeddings = (python_calls(steps, False) - python_calls(0, False)) / (2 * steps)
    assert per_call_from_ids - per_call_from_embeddings <= 6


PRODUCT_CALLS = {"einsum": "torch.einsum", "@": "torch.matmul", "linear": "F.linear"}


@pytest.mark.parametrize("product", list(PRODUCT_CALLS))
def test_an_action_encoded_and_multiplied_with_a_parameter_is_refused_saying_what_happens(product: str):
    """A one-hot action multiplied with a parameter inside the model (``torch.einsum("bi,ij->bj", one_hot(a).float(),
    W)``) was refused as ids that "index" the parameter "directly, outside an nn.Embedding", advice to hold it in an
    embedding: the message names the key, the call and the parameter, says that its values enter the model as
    numbers and that their share would be lost, and advises the encoding before the model, which explains it: the
    relevance of the observation and the action sums to the value (LRP-0, no biases)."""
    observation = torch.randn(6, 4, dtype=F64, generator=torch.Generator().manual_seed(1))
    td = TensorDict(observation=observation, action=torch.tensor([0, 1, 1, 0, 1, 0]), batch_size=[6])
    module = TensorDictModule(KeyProduct(product, width=2), ["observation", "action"], ["value"])
    with pytest.raises(TypeError) as refused, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the first call's warning of the key's share, before the refusal
        LRP(module, BaseRuleMapper(stabilizer=0.0))(td.clone())
    message = str(refused.value)
    assert "input key 'action' (torch.int64) enters the model as numbers" in message, message
    assert "parameter 'module.w'" in message and f" in {PRODUCT_CALLS[product]} inside the model" in message
    assert "share of the relevance would be lost" in message and "F.one_hot(td['action'], n).float()" in message
    assert "index" not in message and "nn.Embedding" not in message
    encoded = td.clone().set("action", F.one_hot(td["action"], 2).to(F64))  # as the advice says
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = LRP(module, BaseRuleMapper(stabilizer=0.0))(encoded)
    total = out["relevance", "observation"].sum(-1) + out["relevance", "action"].sum(-1)
    torch.testing.assert_close(total, out["value"][:, 0], rtol=1e-10, atol=1e-12)
