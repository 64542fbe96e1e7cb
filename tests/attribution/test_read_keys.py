"""The entries the perturbed passes of the methods and metrics carry: all that the module reads, declared or not."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule, TensorDictModuleBase, TensorDictSequential
from torch import nn

from tdhook.attribution import LRP, FeatureAblation, IntegratedGradients, Occlusion
from tdhook.attribution._read_keys import carried_inputs, reads_only_in_keys
from tdhook.metrics import pixel_flipping, sensitivity_max


class WeightedSum(TensorDictModuleBase):
    """``y = Σ_i x_i w_i``, ``w`` read from the TensorDict where it is there, else ones: a key read, not declared
    (as a torchrl loss reads ``"advantage"``)."""

    in_keys, out_keys = ["x"], ["y"]

    def forward(self, td):
        weights = td.get("w", None)
        weights = torch.ones_like(td["x"]) if weights is None else weights
        return td.set("y", (td["x"] * weights).sum(-1, keepdim=True))


def _batch() -> TensorDict:
    torch.manual_seed(0)
    x, w = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    return TensorDict(x=x, w=w, batch_size=[4])


@pytest.mark.parametrize("method", [IntegratedGradients, FeatureAblation, Occlusion])
def test_a_key_read_but_not_declared_is_carried_into_every_perturbed_pass(method):
    """The copies held the declared keys alone: the module ran with ones for ``w`` in them, and with the caller's
    ``w`` in the first pass. A linear model's attributions are then ``x * w`` exactly (IntegratedGradients from a
    zero baseline, the ablation of each feature, each its own group, to zero)."""
    td = _batch()
    options = {} if method is IntegratedGradients else {"feature_masks": torch.arange(6)}
    if method is Occlusion:
        options = {"sliding_window_shapes": (1,)}
    out = method(WeightedSum(), in_keys=["x"], **options)(td.clone())
    torch.testing.assert_close(out["attribution", "x"], td["x"] * td["w"], rtol=1e-10, atol=1e-12)


def test_pixel_flipping_scores_the_module_on_the_entries_the_caller_gave():
    """The curve's first column is the module's output on the caller's TensorDict; each step drops the features
    with the largest attributions, here the exact ``x * w``, to zero."""
    td = _batch()
    relevance = td["x"] * td["w"]
    td.set("attribution", TensorDict(x=relevance, batch_size=[4]))
    curve = pixel_flipping(WeightedSum(), td, features_per_step=2)
    order = relevance.argsort(dim=-1, descending=True, stable=True)
    dropped = relevance.gather(-1, order).cumsum(-1)[:, 1::2]
    expected = torch.cat([relevance.sum(-1, keepdim=True), relevance.sum(-1, keepdim=True) - dropped], -1)
    torch.testing.assert_close(curve, expected, rtol=1e-10, atol=1e-12)


def test_sensitivity_max_explains_the_copies_on_the_entries_the_caller_gave():
    """Gradient × input of the linear module is ``x * w`` wherever ``x`` goes: ``x`` shifted by ``r`` moves it by
    ``r * w``, of the caller's ``w`` (the copies ran with ones)."""
    from tdhook.attribution import InputXGradient

    td = _batch()
    method = InputXGradient(WeightedSum(), in_keys=["x"])
    score = sensitivity_max(method, td, perturb_fn=lambda copies, r: copies.apply(lambda x: x + r), perturb_radius=0.1)
    expected = 0.1 * td["w"].norm(dim=-1) / (td["x"] * td["w"]).norm(dim=-1)
    torch.testing.assert_close(score, expected, rtol=1e-10, atol=1e-12)


def test_modules_that_read_their_in_keys_alone_are_narrowed_to_them():
    step = TensorDictModule(nn.Linear(6, 2), ["x"], ["h"])
    sequence = TensorDictSequential(step, TensorDictModule(nn.Tanh(), ["h"], ["y"]))
    td = _batch()
    assert reads_only_in_keys(sequence) and reads_only_in_keys(LRP(sequence))
    assert list(carried_inputs(sequence, td).keys()) == ["x"]
    assert not reads_only_in_keys(TensorDictSequential(step, WeightedSum()))
    assert sorted(carried_inputs(LRP(WeightedSum()), td).keys()) == ["w", "x"]
