"""SmoothGrad: captum's Saliency at the same noisy points, aggregated as documented; Saliency at stdev 0."""

from __future__ import annotations

import captum.attr
import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import Saliency, SmoothGrad
from tests.attribution.methods._models import bfloat16_linear, random_mlp, small_cnn, two_key_policy
from tests.conftest import relative_error

pytestmark = pytest.mark.filterwarnings("ignore:Input Tensor .* did not already require gradients:UserWarning")


def reference(forward, inputs, stdevs, n_samples, seed, target, nt_type, abs_):
    """Draw the noise as SmoothGrad documents (with a seed, one draw per copy that every sample of the batch
    shares), then aggregate captum's saliency at every noisy copy."""
    generator = torch.Generator().manual_seed(seed)
    noisy = [
        x.unsqueeze(0) + s * torch.randn((n_samples, 1, *x.shape[1:]), generator=generator, dtype=x.dtype)
        for x, s in zip(inputs, stdevs, strict=True)
    ]
    per_sample = []
    for k in range(n_samples):
        points = tuple(n[k].clone() for n in noisy)
        saliency = captum.attr.Saliency(forward).attribute(points, target=target, abs=abs_)
        per_sample.append(saliency)
    stacked = [torch.stack([s[i] for s in per_sample]) for i in range(len(inputs))]
    if nt_type == "smoothgrad":
        return [s.mean(0) for s in stacked]
    if nt_type == "smoothgrad_sq":
        return [(s * s).mean(0) for s in stacked]
    # vargrad by its definition, the mean squared deviation (captum computes mean(s²) − mean(s)², which cancels).
    return [(s - s.mean(0)).square().mean(0) for s in stacked]


class TestAgainstCaptumSaliency:
    @pytest.mark.parametrize("nt_type", ["smoothgrad", "smoothgrad_sq", "vargrad"])
    @pytest.mark.parametrize("abs_", [True, False])
    def test_small_cnn(self, nt_type, abs_):
        net = small_cnn()
        x = torch.randn(3, 3, 8, 8, dtype=torch.float64)
        target = net(x).argmax(-1)
        td = SmoothGrad(
            net, in_keys=["image"], out_keys=["logits"], n_samples=6, stdev=0.2, seed=3, nt_type=nt_type, abs=abs_
        )(TensorDict(image=x, batch_size=[3]))
        (expected,) = reference(net, [x], [0.2], 6, 3, target, nt_type, abs_)
        assert relative_error(td["attribution", "image"], expected) <= 1e-8

    def test_two_key_policy_with_stdev_by_key(self):
        policy = two_key_policy()
        obs, goal = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
        td = SmoothGrad(
            policy, n_samples=7, stdev={"obs": 0.1, "goal": 0.5}, seed=11, target=2, internal_batch_size=10
        )(TensorDict(obs=obs, goal=goal, batch_size=[5]))
        expected = reference(policy.module, [obs, goal], [0.1, 0.5], 7, 11, 2, "smoothgrad", True)
        assert relative_error(td["attribution", "obs"], expected[0]) <= 1e-8
        assert relative_error(td["attribution", "goal"], expected[1]) <= 1e-8

    @pytest.mark.parametrize("seed", range(3))
    def test_random_mlps(self, seed):
        net = random_mlp(seed)
        x = torch.randn(6, 5, dtype=torch.float64)
        td = SmoothGrad(net, in_keys=["x"], out_keys=["y"], n_samples=5, stdev=0.4, seed=seed, nt_type="vargrad")(
            TensorDict(x=x, batch_size=[6])
        )
        (expected,) = reference(net, [x], [0.4], 5, seed, net(x).argmax(-1), "vargrad", True)
        assert relative_error(td["attribution", "x"], expected) <= 1e-8


class TestNoise:
    def test_stdev_zero_is_saliency(self):
        net = small_cnn()
        td = TensorDict(image=torch.randn(3, 3, 8, 8, dtype=torch.float64), batch_size=[3])
        smooth = SmoothGrad(net, in_keys=["image"], out_keys=["logits"], n_samples=4, stdev=0.0)(td.clone())
        plain = Saliency(net, in_keys=["image"], out_keys=["logits"])(td.clone())
        assert relative_error(smooth["attribution", "image"], plain["attribution", "image"]) <= 1e-12

    def test_fixed_seed_is_deterministic_and_leaves_the_global_rng_alone(self):
        net = random_mlp(0)
        td = TensorDict(x=torch.randn(4, 5, dtype=torch.float64), batch_size=[4])
        state = torch.get_rng_state()
        first = SmoothGrad(net, in_keys=["x"], out_keys=["y"], stdev=0.5, seed=7)(td.clone())["attribution", "x"]
        second = SmoothGrad(net, in_keys=["x"], out_keys=["y"], stdev=0.5, seed=7)(td.clone())["attribution", "x"]
        assert torch.equal(torch.get_rng_state(), state)
        assert torch.equal(first, second)
        other = SmoothGrad(net, in_keys=["x"], out_keys=["y"], stdev=0.5, seed=8)(td.clone())["attribution", "x"]
        assert not torch.equal(first, other)

    def test_unseeded_calls_differ_without_touching_the_global_rng(self):
        net = random_mlp(0)
        td = TensorDict(x=torch.randn(4, 5, dtype=torch.float64), batch_size=[4])
        smooth = SmoothGrad(net, in_keys=["x"], out_keys=["y"], stdev=0.5)
        state = torch.get_rng_state()
        first, second = smooth(td.clone())["attribution", "x"], smooth(td.clone())["attribution", "x"]
        assert torch.equal(torch.get_rng_state(), state)
        assert not torch.equal(first, second)


class TestRefusals:
    @pytest.mark.parametrize(
        "kwargs, match",
        [
            ({"n_samples": 0}, "n_samples must be a positive int"),
            ({"nt_type": "mean"}, "nt_type must be one of"),
            ({"stdev": -1.0}, "the stdev of input key 'x' must be a number >= 0"),
            ({"stdev": {"z": 1.0}}, r"stdev must have one entry per explained input key \['x'\]"),
            ({"internal_batch_size": 0}, "internal_batch_size must be a positive int"),
        ],
    )
    def test_at_construction(self, kwargs, match):
        with pytest.raises((ValueError, KeyError), match=f"SmoothGrad: {match}"):
            SmoothGrad(random_mlp(0), in_keys=["x"], out_keys=["y"], **kwargs)


def test_bfloat16_copies_one_per_pass_sum_to_saliency_at_stdev_zero():
    """The copies are summed in float32: in bfloat16, 100 copies summed one pass at a time drifted up to 8 % from
    Saliency."""
    net, _ = bfloat16_linear(64)
    td = TensorDict(x=torch.randn(2, 64).to(torch.bfloat16), batch_size=[2])
    kwargs = dict(in_keys=["x"], out_keys=["y"], target=0)
    smooth = SmoothGrad(net, **kwargs, n_samples=100, stdev=0.0, seed=0, internal_batch_size=2)
    got = smooth(td.clone())["attribution", "x"]
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, Saliency(net, **kwargs)(td.clone())["attribution", "x"], rtol=0, atol=0)


@pytest.mark.parametrize("batch", [(4,), (2, 3)])
@pytest.mark.parametrize("name", ["SmoothGrad", "GradientShap"])
def test_with_a_seed_a_samples_attribution_does_not_depend_on_its_batch(name, batch):
    """Every sample takes the same draws: a sample explained alone, in its batch, or in a larger one (a metric
    stacks perturbed copies so) gets the same attribution (0.014 apart alone and in a batch of 4 before)."""
    from tdhook.attribution import GradientShap

    net = random_mlp(2)
    x = torch.randn(*batch, 5, dtype=torch.float64)
    if name == "SmoothGrad":
        method = SmoothGrad(net, in_keys=["x"], out_keys=["y"], n_samples=6, stdev=0.4, seed=5)
    else:
        baselines = torch.randn(3, 5, dtype=torch.float64)
        method = GradientShap(net, in_keys=["x"], out_keys=["y"], baselines=baselines, n_samples=6, seed=5)
    whole = method(TensorDict(x=x, batch_size=list(batch)))["attribution", "x"]
    alone = method(TensorDict(x=x[(0,) * len(batch)], batch_size=[]))["attribution", "x"]
    larger = method(TensorDict(x=torch.cat([x, x.flip(0)]), batch_size=[2 * batch[0], *batch[1:]]))
    torch.testing.assert_close(alone, whole[(0,) * len(batch)], rtol=0, atol=1e-12)
    torch.testing.assert_close(larger["attribution", "x"][: batch[0]], whole, rtol=0, atol=1e-12)


@pytest.mark.parametrize("internal_batch_size", [None, 8, 12])
def test_vargrad_of_a_saliency_that_does_not_vary_is_zero_never_negative(internal_batch_size):
    """A linear model's gradient does not depend on the noise: the variance is exactly 0. The definition, the mean
    of the squared deviations from the mean, is the oracle; captum computes ``mean(s²) − mean(s)²``, which cancels
    in float32 to negative numbers (down to -4.9e-4 at saliencies up to 37, 84 of 256 entries negative
    over 50 copies), and so did SmoothGrad. Whole, or summed over passes of 2 and 3 copies."""
    torch.manual_seed(0)
    net = nn.Linear(64, 3)
    with torch.no_grad():
        net.weight.mul_(300.0)
    td = TensorDict(x=torch.randn(4, 64), batch_size=[4])
    for n_samples in (5, 7, 50):
        got = SmoothGrad(
            net,
            in_keys=["x"],
            out_keys=["y"],
            n_samples=n_samples,
            stdev=0.1,
            seed=0,
            nt_type="vargrad",
            target=0,
            internal_batch_size=internal_batch_size,
        )(td.clone())["attribution", "x"]
        assert got.min() >= 0
        assert got.max() <= 1e-9 * net.weight[0].abs().max() ** 2


def test_a_stdev_set_as_an_attribute_is_used():
    """``stdev`` is the constructor's name (and the tunable's), but the noise was drawn from ``stdevs``, per key,
    fixed in the constructor: ``smooth.stdev = 0.5`` on a wrapper built with 0.1 was ignored (off by 0.022, the
    attributions up to 0.27), without a word. The attribute now sets the noise of the next call."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    td = TensorDict(x=torch.randn(4, 3, dtype=torch.float64), batch_size=[4])
    smooth = SmoothGrad(net, in_keys=["x"], out_keys=["y"], n_samples=8, stdev=0.1, seed=0)
    smooth.stdev = 0.5
    expected = SmoothGrad(net, in_keys=["x"], out_keys=["y"], n_samples=8, stdev=0.5, seed=0)(td.clone())
    torch.testing.assert_close(smooth(td.clone())["attribution", "x"], expected["attribution", "x"], rtol=0, atol=0)
    assert smooth.stdev == 0.5 and smooth.stdevs == [0.5]
    with pytest.raises(ValueError, match="SmoothGrad: the stdev of input key 'x' must be a number >= 0, got -1"):
        smooth.stdev = -1
    assert smooth.stdevs == [0.5]
