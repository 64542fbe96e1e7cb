"""Rows of samples given as one sample (keyword tensors) to a method that perturbs groups of features: warned of."""

from __future__ import annotations

import warnings

import pytest
import torch
from captum.attr import FeatureAblation as CaptumFeatureAblation
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import FeatureAblation, IntegratedGradients, Occlusion, ShapleyValueSampling


def policy() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()


KEYS = {"in_keys": ["x"], "out_keys": ["y"]}


@pytest.mark.parametrize("target", [1, "rows"], ids=["int", "per-row"])
def test_rows_given_as_keywords_are_warned_of_once_as_one_sample(target):
    """captum's ``attribute(x, target=t)`` written as ``method(x=x)``: the 8 rows are one sample, each group spans
    them all and every row's attribution holds the others' drops (0.35 off captum's, with no word before)."""
    net, x = policy(), torch.randn(8, 4, dtype=torch.float64)
    target = torch.randint(0, 3, (8,)) if target == "rows" else target
    method = FeatureAblation(net, feature_masks=torch.arange(4), target=target, **KEYS)
    with pytest.warns(
        UserWarning, match=r"FeatureAblation: the call was given tensors as keywords, .* have 8 leading"
    ) as got:
        _, as_one = method(x=x)
    assert "batch_size=[8]" in str(got[0].message)
    expected = CaptumFeatureAblation(net).attribute(x, target=target)
    assert (as_one - expected).abs().max() > 1e-2  # one sample of 8 rows: not the rows' own attributions
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        method(x=x)  # once per wrapper
        by_rows = method(TensorDict(x=x, batch_size=[8]))["attribution", "x"]
    torch.testing.assert_close(by_rows, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("method", "x"),
    [
        (lambda net: FeatureAblation(net, target=0, **KEYS), torch.randn(4)),
        (lambda net: Occlusion(net, sliding_window_shapes=(1, 2), target=0, **KEYS), torch.randn(1, 4)),
        (lambda net: ShapleyValueSampling(net, target=0, **KEYS), torch.randn(4)),
        (lambda net: IntegratedGradients(net, target=torch.zeros(8, dtype=torch.long), **KEYS), torch.randn(8, 4)),
    ],
    ids=["one-sample", "one-row", "shapley-one-sample", "gradients-do-not-mix-rows"],
)
def test_one_sample_and_methods_whose_rows_do_not_mix_are_not_warned_of(method, x):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        method(policy())(x=x.double())


@pytest.mark.parametrize("batch", [[8], []], ids=["batch", "one-sample-by-choice"])
def test_a_call_on_a_tensordict_is_not_warned_of(batch):
    """A TensorDict of batch [] is one sample by the caller's choice: a multi-agent step (agents as rows), one image
    with a dense output."""
    net = policy()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FeatureAblation(net, target=0, **KEYS)(TensorDict(x=torch.randn(8, 4, dtype=torch.float64), batch_size=batch))


def test_one_observation_whose_first_dimension_matches_the_actions_is_not_warned_of():
    """Four stacked frames and four action values: the output is one sample's units, not rows (it was warned of)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(-3), nn.Linear(4 * 6 * 6, 4)).double()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Occlusion(net, sliding_window_shapes=(1, 3, 3), strides=(1, 3, 3), target=0, **KEYS)(
            x=torch.randn(4, 6, 6, dtype=torch.float64)
        )


class RowsAndContext(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return self.layer(torch.cat([x, context.expand(*x.shape[:-1], -1)], -1))


def test_a_target_with_one_index_per_row_is_warned_of_where_the_inputs_share_no_rows():
    """The target's rows alone tell: the context [2] has none (the target's own check read the target operator,
    not the target, and never fired)."""
    torch.manual_seed(0)
    method = FeatureAblation(
        RowsAndContext().double(), in_keys=["x", "context"], out_keys=["y"], target=torch.randint(0, 3, (8,))
    )
    with pytest.warns(UserWarning, match="have 8 leading rows"):
        method(x=torch.randn(8, 4, dtype=torch.float64), context=torch.randn(2, dtype=torch.float64))
