"""Scorer: the target fixed on the unperturbed input, stacks of perturbed inputs scored in one pass."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule, TensorDictSequential

from tdhook.metrics._scoring import Scorer, chunks


def test_the_argmax_is_fixed_on_the_unperturbed_input():
    net = torch.nn.Linear(2, 2, bias=False).double()
    with torch.no_grad():
        net.weight.copy_(torch.eye(2, dtype=torch.float64))
    td = TensorDict(x=torch.tensor([[1.0, 0.0]], dtype=torch.float64), batch_size=[1])
    scorer = Scorer(net, td, in_keys=["x"], out_keys=["y"])
    assert scorer.target_index.tolist() == [0]
    flipped = scorer.scores({"x": torch.tensor([[[0.0, 5.0]]], dtype=torch.float64)})
    assert flipped.tolist() == [[0.0]]  # still unit 0, although unit 1 is now the largest


def test_pipelines_keep_their_other_inputs_and_any_batch_shape():
    pipeline = TensorDictSequential(
        TensorDictModule(lambda x, s: x * s, in_keys=["x", "scale"], out_keys=["h"]),
        TensorDictModule(lambda h: h.sum(-1, keepdim=True), in_keys=["h"], out_keys=["value"]),
    )
    td = TensorDict(x=torch.ones(2, 3, 4), scale=torch.full((2, 3, 1), 2.0), batch_size=[2, 3])
    scorer = Scorer(pipeline, td, in_keys=["x"])
    assert scorer.target_key == "value" and scorer.reference.shape == (2, 3)
    stack = torch.zeros(5, 2, 3, 4)
    stack[1] = 1.0
    scores = scorer.scores({"x": stack})
    assert scores.shape == (5, 2, 3) and scores[1].eq(8.0).all() and scores[0].eq(0.0).all()


def test_a_callable_target_is_summed_and_its_shape_checked():
    td = TensorDict(x=torch.ones(2, 3), batch_size=[2])
    scorer = Scorer(torch.nn.Identity(), td, in_keys=["x"], out_keys=["y"], target=lambda out: out * 2)
    assert scorer.reference.tolist() == [6.0, 6.0]
    with pytest.raises(ValueError, match="a callable target must return a tensor shaped like output 'y'"):
        Scorer(torch.nn.Identity(), td, in_keys=["x"], out_keys=["y"], target=lambda out: out.sum(-1))
    with pytest.raises(TypeError, match="metrics needs in_keys and out_keys"):
        Scorer(torch.nn.Identity(), td, in_keys=["x"])


def test_chunks_cover_the_range():
    assert list(chunks(7, 3)) == [(0, 3), (3, 6), (6, 7)]
