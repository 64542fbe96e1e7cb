"""A BatchNorm that normalises with the batch's statistics is told of: each sample's relevance depends on the rest
of the batch, silently before (a relevance 2.0 off the one of the model in eval mode, relative)."""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP, EpsilonPlus


def net(track_running_stats: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 16), nn.BatchNorm1d(16, track_running_stats=track_running_stats), nn.Linear(16, 2)
    )


def batch(size: int = 8) -> TensorDict:
    return TensorDict(obs=torch.randn(size, 4, generator=torch.Generator().manual_seed(1)), batch_size=[size])


def test_a_batch_norm_in_training_mode_is_told_once_per_context():
    model = net()
    with pytest.warns(UserWarning, match=r"module '1' \(BatchNorm1d\) is in training mode and moves its running"):
        whole = LRP(model, EpsilonPlus(), in_keys=["obs"], out_keys=["y"])(batch())["relevance", "obs"]
    lrp = LRP(model, EpsilonPlus(), in_keys=["obs"], out_keys=["y"])
    with warnings.catch_warnings(record=True) as caught, lrp:
        warnings.simplefilter("always")
        first = lrp(batch()[:4])["relevance", "obs"]
        lrp(batch()[:4])
    assert [str(w.message) for w in caught if "training mode" in str(w.message)] == [
        "LRP: module '1' (BatchNorm1d) is in training mode and moves its running statistics, so it normalises with "
        "the statistics of the batch it is given, as a plain call does: each sample's relevance depends on the other "
        "samples of the batch; call .eval() on the model to explain it with its running statistics"
    ]
    assert (whole[:4] - first).abs().max() > 1e-3  # the batch's other samples move a sample's relevance
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LRP(model.eval(), EpsilonPlus(), in_keys=["obs"], out_keys=["y"])(batch())


def test_a_batch_norm_without_running_statistics_is_told_in_eval_mode_too():
    with pytest.warns(UserWarning, match=r"\(BatchNorm1d\) keeps no running statistics"):
        LRP(net(track_running_stats=False).eval(), EpsilonPlus(), in_keys=["obs"], out_keys=["y"])(batch())
