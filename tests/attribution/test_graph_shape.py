"""The shape of a plain call's graph (the walk a planned call makes) equals the general walk's, node for node."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tdhook.attribution._graph_shape import graph_shape

# A mapping that maps no node (no id is -1): the general walk, as a recording call takes it, on a plain graph.
_MAPS_NOTHING = {-1: None}


def _both(roots: list) -> tuple[tuple, list, tuple, list]:
    plain_walked: list = []
    general_walked: list = []
    plain = graph_shape(roots, walked=plain_walked)
    general = graph_shape(roots, factors=_MAPS_NOTHING, walked=general_walked)
    return plain, plain_walked, general, general_walked


def _graphs() -> dict[str, list]:
    torch.manual_seed(0)
    x = torch.randn(2, 3, requires_grad=True)
    w = nn.Parameter(torch.randn(3, 3))
    constant = torch.randn(2, 3)  # an input of a node that requires no gradient: an edge to no node
    a = x @ w
    shared = a.tanh()
    joined = shared * shared + a * constant  # one node reached from several
    norm = nn.LayerNorm(3)
    out = norm(joined).sum(-1)
    other = (x * 2).sum()
    return {
        "shared nodes and a constant input": [joined.grad_fn],
        "a module, parameters and an input leaf": [out.grad_fn],
        "several roots, one of them missing": [out.grad_fn, None, other.grad_fn, out.grad_fn],
        "a leaf itself": [torch.randn(3, requires_grad=True).expand(2, 3).grad_fn],
    }


@pytest.mark.parametrize("name", list(_graphs()))
def test_plain_walk_equals_the_general_walk(name: str) -> None:
    plain, plain_walked, general, general_walked = _both(_graphs()[name])
    assert plain == general
    assert plain_walked == general_walked  # the same nodes at the same places: a plan's hooks find them there
    assert len(plain_walked) > 1


def test_plain_walk_equals_the_general_walk_on_a_small_transformer_block() -> None:
    torch.manual_seed(0)
    block = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True).eval()
    x = torch.randn(2, 5, 8, requires_grad=True)
    out = block(x)
    plain, plain_walked, general, general_walked = _both([out.grad_fn])
    assert plain == general
    assert plain_walked == general_walked
    # Parameters are named by their ids, the input by None.
    leaf = torch._C._functions.AccumulateGrad  # a leaf's entries: its type, then its parameter's id
    leaves = [plain[place + 1] for place, entry in enumerate(plain) if entry is leaf]
    assert None in leaves
    assert {id(p) for p in block.parameters()} <= set(leaves)


def test_plain_walks_of_two_graphs_differ_where_the_graphs_do() -> None:
    torch.manual_seed(0)
    x, w = torch.randn(3, requires_grad=True), nn.Parameter(torch.randn(3))
    a = x * 2
    same = graph_shape([(a * (x * 3)).grad_fn]) == graph_shape([(a * (x * 4)).grad_fn])
    other_leaf = graph_shape([(a * (x * 3)).grad_fn]) == graph_shape([(a * (w * 3)).grad_fn])
    shared = graph_shape([(a * a).grad_fn]) == graph_shape([(a * (x * 2)).grad_fn])
    assert same and not other_leaf and not shared
