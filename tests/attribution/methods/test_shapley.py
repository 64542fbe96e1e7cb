"""Shapley value sampling: exact against captum's ShapleyValues and the subset formula; sampled, seeded."""

from __future__ import annotations

import itertools
import math

import captum.attr
import pytest
import torch
from tensordict import TensorDict

from tdhook.attribution import ShapleyValueSampling
from tests.attribution.methods._models import bfloat16_linear, random_mlp, small_cnn, two_key_policy
from tests.conftest import relative_error


def subset_formula(value, groups: int) -> torch.Tensor:
    """Σ over coalitions S not holding i of |S|!(n−|S|−1)!/n! · (v(S ∪ {i}) − v(S)), per group i."""
    n = groups
    out = []
    for i in range(n):
        others = [g for g in range(n) if g != i]
        total = 0.0
        for size in range(n):
            weight = math.factorial(size) * math.factorial(n - size - 1) / math.factorial(n)
            for coalition in itertools.combinations(others, size):
                total = total + weight * (value({*coalition, i}) - value(set(coalition)))
        out.append(total)
    return torch.stack(out)


class TestExact:
    def test_small_cnn_against_captum_shapley_values(self):
        net = small_cnn()
        x = torch.randn(3, 3, 8, 8, dtype=torch.float64)
        mask = (
            torch.arange(8).div(4, rounding_mode="floor").view(-1, 1) * 2
            + torch.arange(8).div(4, rounding_mode="floor").view(1, -1)
        ).unsqueeze(0)
        td = ShapleyValueSampling(
            net, in_keys=["image"], out_keys=["logits"], n_samples=24, feature_masks=mask, baselines=0.1
        )(TensorDict(image=x, batch_size=[3]))
        expected = captum.attr.ShapleyValues(net).attribute(
            x.clone(), target=net(x).argmax(-1), feature_mask=mask.unsqueeze(0), baselines=0.1
        )
        assert relative_error(td["attribution", "image"], expected) <= 1e-6  # captum returns float32
        target = net(x).argmax(-1)

        def value(coalition):
            keep = torch.isin(mask, torch.tensor(sorted(coalition), dtype=torch.long))
            with torch.no_grad():
                return net(torch.where(keep, x, torch.full_like(x, 0.1))).gather(-1, target.unsqueeze(-1)).squeeze(-1)

        shapley = subset_formula(value, 4)  # [groups, batch]
        assert relative_error(td["attribution", "image"], shapley[mask.expand(3, 8, 8)].permute(3, 0, 1, 2)) <= 1e-10

    def test_two_key_policy_against_the_subset_formula(self):
        policy = two_key_policy()
        obs, goal = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
        masks = {"obs": torch.tensor([0, 1, 1, 2]), "goal": torch.tensor([2, 3])}
        td = ShapleyValueSampling(policy, target=2, n_samples=24, feature_masks=masks)(
            TensorDict(obs=obs, goal=goal, batch_size=[4])
        )

        def value(coalition):
            keep_obs = torch.tensor([int(g) in coalition for g in masks["obs"]])
            keep_goal = torch.tensor([int(g) in coalition for g in masks["goal"]])
            with torch.no_grad():
                return policy.module(obs * keep_obs, goal * keep_goal)[:, 2]

        shapley = subset_formula(value, 4)  # [groups, batch]
        assert relative_error(td["attribution", "obs"], shapley[masks["obs"]].T) <= 1e-10
        assert relative_error(td["attribution", "goal"], shapley[masks["goal"]].T) <= 1e-10
        expected = captum.attr.ShapleyValues(policy.module).attribute(
            (obs.clone(), goal.clone()), target=2, feature_mask=(masks["obs"].unsqueeze(0), masks["goal"].unsqueeze(0))
        )
        assert relative_error(td["attribution", "obs"], expected[0]) <= 1e-6  # captum returns float32
        assert relative_error(td["attribution", "goal"], expected[1]) <= 1e-6

    @pytest.mark.parametrize("seed", range(3))
    def test_random_mlps_efficiency(self, seed):
        net = random_mlp(seed)
        x = torch.randn(2, 3, 5, dtype=torch.float64)
        td = ShapleyValueSampling(
            net, in_keys=["x"], out_keys=["y"], n_samples=6, feature_masks=torch.tensor([0, 0, 1, 2, 2]), target=0
        )(TensorDict(x=x, batch_size=[2, 3]))
        attribution = td["attribution", "x"]
        per_group = torch.stack([attribution[..., 0], attribution[..., 2], attribution[..., 3]], -1)
        with torch.no_grad():
            gain = net(x)[..., 0] - net(torch.zeros_like(x))[..., 0]
        assert (per_group.sum(-1) - gain).abs().max() < 1e-12


class TestSampled:
    def test_seeded_and_global_rng_untouched(self):
        net = random_mlp(0)
        td = TensorDict(x=torch.randn(4, 5, dtype=torch.float64), batch_size=[4])
        state = torch.get_rng_state()

        def make(seed):
            return ShapleyValueSampling(
                net, in_keys=["x"], out_keys=["y"], n_samples=5, feature_masks=torch.arange(5), seed=seed
            )

        first, second = make(1)(td.clone())["attribution", "x"], make(1)(td.clone())["attribution", "x"]
        assert torch.equal(torch.get_rng_state(), state)
        assert torch.equal(first, second)
        assert not torch.equal(first, make(2)(td.clone())["attribution", "x"])

    def test_linear_model_is_exact_for_any_order(self):
        torch.manual_seed(0)
        net = torch.nn.Linear(6, 3).double()
        x = torch.randn(5, 6, dtype=torch.float64)
        td = ShapleyValueSampling(
            net, in_keys=["x"], out_keys=["y"], n_samples=3, feature_masks=torch.arange(6), target=1, seed=0
        )(TensorDict(x=x, batch_size=[5]))
        assert relative_error(td["attribution", "x"], net.weight[1].detach() * x) <= 1e-12

    def test_refuses_no_samples(self):
        with pytest.raises(ValueError, match="ShapleyValueSampling: n_samples must be a positive int"):
            ShapleyValueSampling(random_mlp(0), in_keys=["x"], out_keys=["y"], n_samples=0)


def test_bfloat16_gains_of_many_orders_are_summed_in_float32():
    """On a linear model every order gives a group its own w · x; in bfloat16 the gains of 300 orders, summed, were
    10 % off it."""
    net, w = bfloat16_linear(64)
    x = torch.randn(2, 64).to(torch.bfloat16)
    groups = torch.arange(64) // 8
    shapley = ShapleyValueSampling(
        net,
        in_keys=["x"],
        out_keys=["y"],
        target=0,
        n_samples=300,
        seed=0,
        feature_masks=groups,
        perturbations_per_eval=300,
    )
    got = shapley(TensorDict(x=x, batch_size=[2]))["attribution", "x"]
    exact = (w * x.double()).view(2, 8, 8).sum(-1, keepdim=True).expand(2, 8, 8).reshape(2, 64)
    assert got.dtype == torch.bfloat16
    assert relative_error(got.double(), exact) < 1e-2


def test_an_infinite_gain_stays_on_its_own_group():
    """``1e308 x0 + 2 x1 + 3 x2`` from the baseline ``[-1, 0, 0]`` to ``[1, 1, 1]``: x0's gain (2e308) overflows to
    inf in every order, the others' are finite (0: 2 and 3 are below 1e308's rounding step), as the subset formula
    gives. Each group's value was put on its elements by a product with its mask, so ``inf * 0`` made every other
    group NaN."""

    class Overflowing(torch.nn.Module):
        def forward(self, x):
            return 1e308 * x[..., :1] + 2 * x[..., 1:2] + 3 * x[..., 2:3]

    net, x = Overflowing(), torch.ones(1, 3, dtype=torch.float64)
    baselines = torch.tensor([-1.0, 0.0, 0.0], dtype=torch.float64)
    td = ShapleyValueSampling(
        net, in_keys=["x"], out_keys=["y"], feature_masks=torch.arange(3), n_samples=6, baselines=baselines, seed=0
    )(TensorDict(x=x, batch_size=[1]))

    def value(coalition):
        keep = torch.tensor([g in coalition for g in range(3)])
        return net(torch.where(keep, x, baselines))[:, 0]

    expected = subset_formula(value, 3).T  # [batch, groups]: inf, 0, 0
    assert expected.isinf().sum() == 1
    torch.testing.assert_close(td["attribution", "x"], expected, rtol=0, atol=0)
