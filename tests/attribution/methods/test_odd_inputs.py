"""The perturbation methods on inputs the other tests do not use, against captum or the definition, in float64.

Windows and strides that do not divide the sample, baselines of one sample's shape or per sample, channels-last and
strided inputs, feature ids with gaps, negative ids and ids shared across keys.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from captum.attr import FeatureAblation as CaptumFeatureAblation
from tensordict import TensorDict

from tdhook.attribution import FeatureAblation, Occlusion, ShapleyValueSampling
from tests.attribution.methods._models import small_cnn, two_key_policy


def occlusion_by_definition(net, x, window, strides, baseline):
    """Each window (the last one along a dimension cut at its end) set to the baseline, its drop of the argmax logit
    spread on its elements, and each element's mean over the windows that cover it."""
    rows = torch.arange(len(x))
    target = net(x).argmax(-1)
    reference = net(x)[rows, target]
    total, count = torch.zeros_like(x), torch.zeros_like(x)
    starts = [
        range(0, max(size - w, 0) + s, s) if size > w else [0]
        for size, w, s in zip(x.shape[1:], window, strides, strict=True)
    ]
    for corner in itertools.product(*starts):
        where = (slice(None), *(slice(a, a + w) for a, w in zip(corner, window, strict=True)))
        occluded = x.clone()
        occluded[where] = baseline.expand_as(x)[where]
        drop = reference - net(occluded)[rows, target]
        total[where] += drop.view(-1, 1, 1, 1)
        count[where] += 1
    return total / count


@pytest.mark.parametrize(
    ("window", "strides"), [((3, 3, 3), (1, 3, 3)), ((2, 5, 5), (1, 2, 3)), ((1, 3, 2), (1, 2, 2)), ((3, 8, 3), 3)]
)
@pytest.mark.parametrize("baseline", ["number", "one sample", "per sample"])
@pytest.mark.parametrize("layout", ["contiguous", "channels last", "strided view"])
def test_occlusion_with_windows_and_strides_that_do_not_divide_the_sample(window, strides, baseline, layout):
    torch.manual_seed(0)
    net = small_cnn()
    x = torch.randn(3, 3, 8, 8, dtype=torch.float64)
    if layout == "channels last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "strided view":
        x = torch.randn(3, 3, 8, 16, dtype=torch.float64)[..., ::2]
    given = {
        "number": 0.3,
        "one sample": torch.randn(3, 8, 8, dtype=torch.float64),
        "per sample": torch.randn(3, 3, 8, 8, dtype=torch.float64),
    }[baseline]
    occlusion = Occlusion(
        net, in_keys=["x"], out_keys=["y"], sliding_window_shapes=window, strides=strides, baselines=given
    )
    ours = occlusion(TensorDict(x=x, batch_size=[3]))["attribution", "x"]
    per_dim = strides if isinstance(strides, tuple) else (strides,) * 3
    expected = occlusion_by_definition(net, x, window, per_dim, torch.as_tensor(given, dtype=torch.float64))
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "mask",
    [
        torch.tensor([-5, -5, 7, 7, 7, 100, 100, 3]).expand(8, 8)[None],  # gaps and a negative id, per column
        torch.randint(-3, 9, (3, 8, 8)),  # one sample's shape: a group per id across the channels it covers
        torch.randint(-3, 9, (3, 3, 8, 8)),  # per sample
    ],
)
@pytest.mark.parametrize("per_sample_baseline", [False, True])
def test_feature_ablation_with_ids_that_have_gaps_and_signs_equals_captum(mask, per_sample_baseline):
    torch.manual_seed(1)
    net = small_cnn()
    x = torch.randn(3, 3, 8, 8, dtype=torch.float64)
    baseline = torch.randn(3, 3, 8, 8, dtype=torch.float64) if per_sample_baseline else 0.0
    ablation = FeatureAblation(net, in_keys=["x"], out_keys=["y"], feature_masks=mask, baselines=baseline)
    ours = ablation(TensorDict(x=x, batch_size=[3]))["attribution", "x"]
    _, captum_ids = torch.unique(mask.expand(3, 3, 8, 8), return_inverse=True)  # captum's ids: 0 .. n - 1
    expected = CaptumFeatureAblation(net).attribute(
        x, feature_mask=captum_ids, baselines=baseline, target=net(x).argmax(-1)
    )
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("extra", [0, 3])
def test_shapley_values_of_ids_shared_across_keys_with_gaps_and_signs_are_exact_with_every_order(extra):
    """Four groups (ids -2, 4 and 9, two of them in both keys): with ``n_samples >= 4!`` every order is used once, and
    each element gets its group's Shapley value by the subset formula, with a baseline per key."""
    torch.manual_seed(2)
    policy = two_key_policy()
    obs, goal = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    masks = {"obs": torch.tensor([-2, 4, 4, 9]), "goal": torch.tensor([9, -2])}
    baselines = {"obs": 0.5, "goal": torch.tensor([1.0, -1.0], dtype=torch.float64)}
    groups = [-2, 4, 9]
    shapley = ShapleyValueSampling(
        policy, feature_masks=masks, baselines=baselines, n_samples=math.factorial(len(groups)) + extra
    )
    ours = shapley(TensorDict(obs=obs, goal=goal, batch_size=[5]))
    target = policy.module(obs, goal).argmax(-1)

    def value(present: tuple[int, ...]) -> torch.Tensor:
        kept = torch.tensor(present, dtype=torch.long)
        o = torch.where(torch.isin(masks["obs"], kept), obs, baselines["obs"])
        g = torch.where(torch.isin(masks["goal"], kept), goal, baselines["goal"])
        return policy.module(o, g)[torch.arange(5), target]

    n = len(groups)
    phi = {}
    for group in groups:
        others = [g for g in groups if g != group]
        phi[group] = sum(
            math.factorial(k) * math.factorial(n - k - 1) / math.factorial(n) * (value((*s, group)) - value(s))
            for k in range(n)
            for s in itertools.combinations(others, k)
        )
    for key in ("obs", "goal"):
        expected = torch.stack([phi[int(i)] for i in masks[key]], -1)
        torch.testing.assert_close(ours["attribution", key], expected, rtol=0, atol=1e-12)
