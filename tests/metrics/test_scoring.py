"""Scorer: the target fixed on the unperturbed input, stacks of perturbed inputs scored in one pass."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule, TensorDictModuleBase, TensorDictSequential
from torch import nn

from tdhook.metrics import pixel_flipping
from tdhook.metrics._leading_affine import LeadingAffine
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


def sequence_model() -> nn.Module:
    """A per-step encoder, attention over the time dimension of a ``[B, T]`` batch, and a per-step head."""
    torch.manual_seed(3)
    encoder = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    return nn.Sequential(nn.Linear(4, 8), encoder, nn.Linear(8, 3)).double().eval()


def hooked(net: nn.Module) -> nn.Module:
    """A copy of ``net`` with a hook that changes nothing: the metrics then run it on every perturbed input."""
    net = copy.deepcopy(net)
    net.register_forward_pre_hook(lambda module, args: None)
    return net


@pytest.mark.parametrize("update", [True, False], ids=["first layer updated", "stacked passes"])
@pytest.mark.parametrize("as_module", [True, False], ids=["TensorDictModule", "plain module"])
def test_stacked_steps_keep_the_time_dimension_of_a_sequence_batch(update, as_module):
    """A ``[B, T]`` batch through a model that attends over ``T``: every stack of steps must reach the model (and
    the layers after an updated first layer) as ``[S * B, T]``, never flattened (attention across the samples of
    every step), so that the curve is the one of passes over the batch as it is, one step at a time."""
    net = sequence_model()
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    td = TensorDict(x=x, attribution=TensorDict(x=torch.randn(2, 5, 4, dtype=torch.float64)), batch_size=[2, 5])

    def curve(model, **kwargs):
        if as_module:
            return pixel_flipping(TensorDictModule(model, in_keys=["x"], out_keys=["y"]), td, **kwargs)
        return pixel_flipping(model, td, in_keys=["x"], out_keys=["y"], **kwargs)

    expected = curve(hooked(net), features_per_step=1, steps_per_forward=1)
    with mock.patch.object(LeadingAffine, "outputs", autospec=True, side_effect=LeadingAffine.outputs) as updated:
        stacked = curve(net if update else hooked(net), features_per_step=1)
    assert updated.called == update
    assert stacked.shape == (2, 5, 5)
    torch.testing.assert_close(stacked, expected, rtol=0, atol=1e-12)


class ActsOnce(TensorDictModuleBase):
    """Reads a context and returns one action per sequence, in a TensorDict of the sequences' batch."""

    in_keys, out_keys = ["x"], ["act"]

    def forward(self, td):
        return TensorDict(act=td["x"].sum(-2), batch_size=td.batch_size[:1])


def test_an_output_without_the_batch_shape_is_refused_by_name():
    """A model that reads a ``[B, T]`` context and acts once per sequence: its output has no time dimension, so a
    ``[B, T]`` TensorDict has no score per sample; the error says which batch to give."""
    net = ActsOnce()
    td = TensorDict(x=torch.randn(3, 6, 2), attribution=TensorDict(x=torch.randn(3, 6, 2)), batch_size=[3, 6])
    with pytest.raises(ValueError, match=r"'act' of shape \[3, 2\] does not start with the TensorDict's batch shape"):
        pixel_flipping(net, td)
    flat = TensorDict(x=td["x"], attribution=TensorDict(x=td["attribution", "x"]), batch_size=[3])
    assert pixel_flipping(net, flat, features_per_step=4).shape == (3, 4)
