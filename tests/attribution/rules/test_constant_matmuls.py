"""Matrix products with a factor that joins constants with an activation (a key cache), under AttnLRP and CP-LRP.

``q @ torch.cat([past_k, k], 1).transpose(1, 2)`` with ``past_k`` detached: each score is a query times a past key
(a constant: all of its relevance to the query) or times a new key (the uniform rule). The join was taken as an
activation whole, and the past keys' columns gave half their relevance to nothing (0.20-0.72 off, relative L2). Oracle,
from the definition: the same products taken apart (``torch.cat([q @ past_k.T, q @ k.T], -1)``), float64; for
constants among the features summed over, the product as the sum of its parts.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.mappers.transformer import CPLRP, AttnLRP

F64 = torch.float64
MAPPERS = {"AttnLRP": AttnLRP, "CPLRP": CPLRP}


class Cached(nn.Module):
    """``out(scores)`` of queries and keys of 3 tokens, one factor joined onto 2 cached ones (detached)."""

    def __init__(self, form: str, apart: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.out = nn.Linear(4, 6), nn.Linear(4, 6), nn.LazyLinear(2)
        self.past = torch.randn(1, 2, 4, dtype=F64)
        self.form, self.apart = form, apart

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        tokens = x.view(b, 3, 4)
        q, k = torch.relu(self.q(tokens)), torch.relu(self.k(tokens))
        past_k = self.k(self.past.expand(b, -1, -1)).detach()
        past_q = self.q(self.past.expand(b, -1, -1)).detach()
        if self.form == "keys cached":
            if self.apart:
                scores = torch.cat([q @ past_k.transpose(1, 2), q @ k.transpose(1, 2)], 2)
            else:
                scores = q @ torch.cat([past_k, k], 1).transpose(1, 2)
        elif self.form == "queries cached (bmm)":
            if self.apart:
                scores = torch.cat([torch.bmm(past_q, k.transpose(1, 2)), torch.bmm(q, k.transpose(1, 2))], 1)
            else:
                scores = torch.bmm(torch.cat([past_q, q], 1), k.transpose(1, 2))
        else:  # "features cached": a constant feature beside the queries', summed over in each score
            constant = torch.full((b, 3, 1), 0.7, dtype=F64)
            keys = k[:, :, 3:].transpose(1, 2)
            if self.apart:
                scores = constant @ keys[:, :1] + q[:, :, :2] @ keys[:, 1:]
            else:
                scores = torch.cat([constant, q[:, :, :2]], 2) @ keys
        return self.out(scores.flatten(1))


def relevance(model: nn.Module, mapper: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    model(x)  # the lazy layer's shape
    lrp = LRP(model, rule_mapper=MAPPERS[mapper](), in_keys=["x"], out_keys=["y"])
    with warnings.catch_warnings(), lrp:
        warnings.simplefilter("ignore")
        for _ in range(2):  # the first call records the rules' places, a later one follows them
            td = lrp(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))
    return td["relevance", "x"], td["y"]


@pytest.mark.parametrize("mapper", sorted(MAPPERS))
@pytest.mark.parametrize("form", ["keys cached", "queries cached (bmm)", "features cached"])
def test_a_cache_joined_onto_a_constant_gives_its_constants_part_of_a_matmul_as_a_linear_map(form: str, mapper: str):
    x = torch.randn(4, 12, dtype=F64, generator=torch.Generator().manual_seed(1))
    expected, expected_y = relevance(Cached(form, apart=True).double(), mapper, x)
    ours, y = relevance(Cached(form).double(), mapper, x)
    torch.testing.assert_close(y, expected_y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-12)


class Contracted(nn.Module):
    """Scores (or an attention's output) of queries and keys of 3 tokens after 2 cached ones (detached), the cache
    joined and contracted by an ``einsum``, a ``torch.baddbmm`` or ``F.scaled_dot_product_attention`` (grouped-query:
    4 query heads, 2 key heads); ``apart``: the same with the products taken apart (unfused)."""

    def __init__(self, form: str, apart: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v, self.out = nn.Linear(4, 16), nn.Linear(4, 8), nn.Linear(4, 8), nn.LazyLinear(2)
        self.past = torch.randn(1, 2, 4, dtype=F64)
        self.form, self.apart = form, apart

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        tokens = x.view(b, 3, 4)
        q, k, v = (torch.relu(layer(tokens)) for layer in (self.q, self.k, self.v))
        q = q[..., : 8 if self.form != "sdpa gqa" else 16]
        past_k, past_v = (layer(self.past.expand(b, -1, -1)).detach() for layer in (self.k, self.v))
        if self.form == "einsum":
            if self.apart:
                scores = torch.cat([torch.einsum("bqd,bkd->bqk", q, past_k), torch.einsum("bqd,bkd->bqk", q, k)], 2)
            else:
                scores = torch.einsum("bqd,bkd->bqk", q, torch.cat([past_k, k], 1))
        elif self.form == "baddbmm":
            bias = torch.linspace(-1, 1, 5, dtype=F64).expand(b, 3, 5)
            if self.apart:
                scores = bias * 0.5 + 2 * torch.cat([q @ past_k.transpose(1, 2), q @ k.transpose(1, 2)], 2)
            else:
                scores = torch.baddbmm(bias, q, torch.cat([past_k, k], 1).transpose(1, 2), beta=0.5, alpha=2.0)
        else:  # "sdpa" (4 heads of 2 features), "sdpa gqa" (4 query heads, 2 key heads of 4 features)
            heads = 4 if self.form == "sdpa" else 2
            q = q.view(b, 3, 4, -1).transpose(1, 2)
            k, v, past_k, past_v = (t.view(b, -1, heads, 8 // heads).transpose(1, 2) for t in (k, v, past_k, past_v))
            if self.apart:
                k, v, past_k, past_v = (t.repeat_interleave(4 // heads, 1) for t in (k, v, past_k, past_v))
                scores = torch.cat([q @ past_k.transpose(-1, -2), q @ k.transpose(-1, -2)], -1)
                weights = torch.softmax(scores / q.shape[-1] ** 0.5, -1)
                scores = weights[..., :2] @ past_v + weights[..., 2:] @ v
            else:
                keys, values = torch.cat([past_k, k], 2), torch.cat([past_v, v], 2)
                scores = torch.nn.functional.scaled_dot_product_attention(q, keys, values, enable_gqa=heads != 4)
        return self.out(scores.flatten(1))


@pytest.mark.parametrize("mapper", sorted(MAPPERS))
@pytest.mark.parametrize("form", ["einsum", "baddbmm", "sdpa", "sdpa gqa"])
def test_a_cache_joined_onto_a_constant_and_contracted_otherwise_gives_its_constants_part_as_a_linear_map(
    form: str, mapper: str
):
    """An ``einsum``, a ``baddbmm`` and a fused attention read the join's constants as the matrix products do (they
    were taken as an activation whole: 0.41 off, relative L2, under AttnLRP for the ``einsum`` and the ``baddbmm``,
    0.26 for the attention's cached values)."""
    x = torch.randn(4, 12, dtype=F64, generator=torch.Generator().manual_seed(1))
    expected, expected_y = relevance(Contracted(form, apart=True).double(), mapper, x)
    ours, y = relevance(Contracted(form).double(), mapper, x)
    torch.testing.assert_close(y, expected_y, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours, expected, rtol=1e-9, atol=1e-11)


class WideContraction(nn.Module):
    """Scores of 5 queries and 7 keys over 64 features, half of each query a constant (a padded or cached part):
    by ``form`` a matmul, an ``einsum`` or a ``baddbmm``."""

    def __init__(self, form: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.out = nn.Linear(12, 5 * 32), nn.Linear(12, 7 * 64), nn.Linear(35, 2)
        self.constant = torch.randn(1, 5, 32, dtype=F64)
        self.form = form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        q = torch.cat([self.constant.expand(b, -1, -1), torch.relu(self.q(x)).view(b, 5, 32)], 2)
        k = torch.relu(self.k(x)).view(b, 7, 64)
        if self.form == "matmul":
            scores = q @ k.transpose(1, 2)
        elif self.form == "einsum":
            scores = torch.einsum("bqd,bkd->bqk", q, k)
        else:
            scores = torch.baddbmm(torch.ones(b, 5, 7, dtype=F64), q, k.transpose(1, 2), beta=0.5, alpha=2.0)
        return self.out(scores.flatten(1))


@pytest.mark.parametrize("mapper", sorted(MAPPERS))
@pytest.mark.parametrize("form", ["matmul", "einsum", "baddbmm"])
def test_a_product_ruled_by_its_parts_leaves_the_outputs_as_they_were(form: str, mapper: str):
    """The rule takes such a product as the sum of its parts (and a ``baddbmm`` unfused), which rounds otherwise
    than the product itself: the outputs were an ulp off the model's (PEGASUS-X's attention over a padded block,
    6.7e-16), where the wrapper leaves every output as the model computes it."""
    model = WideContraction(form).double()
    x = torch.randn(16, 12, dtype=F64, generator=torch.Generator().manual_seed(3))
    _, y = relevance(model, mapper, x)
    with torch.no_grad():
        assert torch.equal(y, model(x)), (y - model(x)).abs().max()
