"""Token ids through another integer dtype beside their embedding (float64): the mark of token values follows them.

A second lookup of the ids in a parameter, beside their ``nn.Embedding``, is refused naming it (see
``tests/attribution/test_tokens.py``); ids converted to an unsigned dtype and back lost their mark, and the lookup's
share of the relevance was lost without a word.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.mappers.base import BaseRuleMapper

F64 = torch.float64


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
    tokens = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(1))
    lrp = LRP(net, BaseRuleMapper(stabilizer=0.0), in_keys=["tokens"], out_keys=["y"])
    with pytest.raises(ValueError, match=r"embedded by 'embedding' and also indexes parameter 'table'"):
        lrp(TensorDict(tokens=tokens, batch_size=[4]))
