"""Token ids through another dtype beside their embedding (float64): the mark of token values follows them.

A second lookup of the ids in a parameter, beside their ``nn.Embedding``, is refused naming it (see
``tests/attribution/test_tokens.py``); ids converted to an unsigned dtype, to a floating-point one or to a narrower
integer one and back lost their mark, and the lookup's share of the relevance was lost without a word.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.mappers.base import BaseRuleMapper

F64 = torch.float64


def explained(net: nn.Module, target=None) -> TensorDict:
    """``net`` explained from 4 x 5 random token ids under LRP-0."""
    tokens = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(1))
    lrp = LRP(net, BaseRuleMapper(stabilizer=0.0), in_keys=["tokens"], out_keys=["y"], target=target)
    return lrp(TensorDict(tokens=tokens, batch_size=[4]))


class TableThroughUnsigned(nn.Module):
    """Token ids embedded by an ``nn.Embedding``, and looked up again in a parameter after a round trip through an
    unsigned integer dtype (ids stored compactly)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.embedding, self.head = nn.Embedding(11, 6), nn.Linear(6, 3)
        self.table = nn.Parameter(torch.randn(11, 6))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(tokens) + self.table[tokens.to(self.dtype).long()]).sum(1)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16], ids=str)
def test_token_ids_through_an_unsigned_dtype_looked_up_beside_their_embedding_are_refused_naming_it(dtype):
    """The ids converted to an unsigned dtype and back still carry the token values: their second lookup, in a
    parameter, had its rows held constant and its share of the relevance lost without a word. Refused, as the
    lookup of the ids themselves is."""
    torch.manual_seed(0)
    net = TableThroughUnsigned(dtype).to(F64)
    with pytest.raises(ValueError, match=r"embedded by 'embedding' and also indexes parameter 'table'"):
        explained(net)


ROUND_TRIPS = {
    "double": lambda ids: ids.double().long(),
    "float-to": lambda ids: ids.float().to(torch.int64),
    "float32-round": lambda ids: ids.to(torch.float32).round().long(),
    "half": lambda ids: ids.half().long(),
    "bfloat16-floor": lambda ids: ids.bfloat16().floor().long(),
    "type": lambda ids: ids.type(torch.float64).type(torch.long),
    "short": lambda ids: ids.short().long(),
    "char-int": lambda ids: ids.char().int(),
    "float-view": lambda ids: ids.double().view(-1).view(ids.shape).long(),
    "float-copy": lambda ids: torch.zeros(ids.shape, dtype=torch.float64).copy_(ids).long(),
}


class TableThroughRoundTrip(nn.Module):
    """Token ids embedded by an ``nn.Embedding``, and looked up again in a parameter (``how="table"``) or in a second
    ``nn.Embedding`` (``how="embedding"``) after a round trip through another dtype (``trip``)."""

    def __init__(self, trip: str, how: str) -> None:
        super().__init__()
        self.trip, self.how = trip, how
        self.embedding, self.other, self.head = nn.Embedding(11, 6), nn.Embedding(11, 6), nn.Linear(6, 3)
        self.table = nn.Parameter(torch.randn(11, 6))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        again = ROUND_TRIPS[self.trip](tokens)
        beside = self.table[again] if self.how == "table" else self.other(again)
        return self.head(self.embedding(tokens) + beside).sum(1)


@pytest.mark.parametrize("how", ["table", "embedding"])
@pytest.mark.parametrize("trip", list(ROUND_TRIPS))
def test_token_ids_through_a_round_trip_of_dtypes_looked_up_beside_their_embedding_are_refused_naming_it(trip, how):
    """Ids converted to a floating-point dtype (or a narrower integer one) and back hold the token values still:
    their second lookup had its rows held constant, and the ids' relevance summed to another number than the
    explained output with biases zeroed, without a word (LRP-0: 6.7 for 14.5 through ``double``). Refused, naming the
    table, or the second embedding, as the lookup of the ids themselves is."""
    torch.manual_seed(0)
    net = TableThroughRoundTrip(trip, how).to(F64)
    match = r"also indexes parameter 'table'" if how == "table" else r"reaches 'other' \(Embedding\) through token ids"
    with pytest.raises(ValueError, match=match):
        explained(net)


class FloatIdsAsMask(nn.Module):
    """Token ids converted to floating point for a comparison only (a mask of the padding): no token values reach a
    lookup, and the model is explained through its embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.head = nn.Embedding(11, 6), nn.Linear(6, 3, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        keep = (tokens.double() > 0).to(F64)
        return self.head(self.embedding(tokens) * keep[..., None]).sum(1)


def test_token_ids_converted_to_floating_point_for_a_mask_are_explained_through_their_embedding():
    """A mask computed from the ids converted to floating point is no lookup: the ids get the relevance of their
    embeddings, which conserves the explained output (no biases, LRP-0)."""
    torch.manual_seed(0)
    net = FloatIdsAsMask().to(F64)
    td = explained(net, target=lambda y: y)
    torch.testing.assert_close(td["relevance", "tokens"].sum(1), net(td["tokens"]).sum(1), rtol=1e-10, atol=1e-12)


class TableThroughDevice(TableThroughUnsigned):
    """Token ids embedded by an ``nn.Embedding``, and looked up again in a parameter after a move to a CUDA device and
    back (``move``: by ``cuda()`` and ``cpu()``, or by ``to``)."""

    def __init__(self, move: str) -> None:
        super().__init__(torch.int64)
        self.move = move

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        moved = tokens.cuda().cpu() if self.move == "cuda" else tokens.to("cuda").to("cpu")
        return self.head(self.embedding(tokens) + self.table[moved]).sum(1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="moves the ids to a CUDA device and back")
@pytest.mark.parametrize("move", ["cuda", "to"])
def test_token_ids_moved_to_another_device_and_back_looked_up_beside_their_embedding_are_refused(move):
    """Ids moved to a GPU and back (``ids.cuda().cpu()``) are new tensors holding the token values: their second
    lookup was not refused, as ``cuda`` and ``cpu`` did not carry the mark. Refused, naming the table."""
    torch.manual_seed(0)
    net = TableThroughDevice(move).to(F64)
    with pytest.raises(ValueError, match=r"embedded by 'embedding' and also indexes parameter 'table'"):
        explained(net)
