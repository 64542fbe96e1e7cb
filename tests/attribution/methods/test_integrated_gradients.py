"""Integrated gradients: the quadrature written out here (float64, ≤ 1e-10) and captum (float32 weights)."""

from __future__ import annotations

import captum.attr
import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import IntegratedGradients
from tdhook.attribution.methods._quadrature import quadrature
from tests.attribution.methods._models import (
    assert_two_key_policy_matches,
    bfloat16_linear,
    flat,
    random_mlp,
    small_cnn,
    two_key_policy,
)
from tests.conftest import relative_error

METHODS = ["gausslegendre", "riemann_trapezoid", "riemann_left", "riemann_right", "riemann_middle"]


def nodes_and_weights(method: str, n: int) -> tuple[list[float], list[float]]:
    """The quadrature as documented, from numpy's Gauss–Legendre and the Riemann formulas."""
    if method == "gausslegendre":
        x, w = np.polynomial.legendre.leggauss(n)
        return list(0.5 * (x + 1)), list(0.5 * w)
    if method == "riemann_trapezoid":
        w = [1 / n] * n
        w[0] /= 2
        w[-1] /= 2
        return [k / (n - 1) for k in range(n)], w
    offset = {"riemann_left": 0.0, "riemann_right": 1.0, "riemann_middle": 0.5}[method]
    return [(k + offset) / n for k in range(n)], [1 / n] * n


def reference(forward, inputs, baselines, target, method, n):
    """Σₖ wₖ ∇F(b + αₖ(x − b)) · (x − b), one gradient per point, for a tuple of inputs."""
    alphas, weights = nodes_and_weights(method, n)
    totals = [torch.zeros_like(x) for x in inputs]
    for alpha, weight in zip(alphas, weights, strict=False):
        points = [(b + alpha * (x - b)).requires_grad_(True) for x, b in zip(inputs, baselines, strict=False)]
        out = forward(*points)
        explained = out.gather(-1, target.unsqueeze(-1)).sum()
        for total, grad in zip(totals, torch.autograd.grad(explained, points), strict=False):
            total += weight * grad
    return [t * (x - b) for t, x, b in zip(totals, inputs, baselines, strict=False)]


class TestQuadrature:
    @pytest.mark.parametrize("method", METHODS)
    @pytest.mark.parametrize("n", [2, 5, 32, 50])
    def test_nodes_and_weights(self, method, n):
        alphas, weights = quadrature(method, n)
        expected_alphas, expected_weights = nodes_and_weights(method, n)
        assert torch.allclose(alphas, torch.tensor(expected_alphas, dtype=torch.float64), rtol=0, atol=1e-14)
        assert torch.allclose(weights, torch.tensor(expected_weights, dtype=torch.float64), rtol=0, atol=1e-14)

    @pytest.mark.parametrize(
        "bad", [("simpson", 5), ("gausslegendre", 0), ("riemann_trapezoid", 1), ("riemann_left", 2.0)]
    )
    def test_refused_at_construction(self, bad):
        with pytest.raises(ValueError, match="IntegratedGradients: (method|n_steps)"):
            IntegratedGradients(random_mlp(0), in_keys=["x"], out_keys=["y"], method=bad[0], n_steps=bad[1])


class TestAgainstTheQuadrature:
    @pytest.mark.parametrize("method", METHODS)
    def test_small_cnn(self, method):
        net = small_cnn()
        x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
        baseline = torch.randn(3, 8, 8, dtype=torch.float64)
        ig = IntegratedGradients(
            net, in_keys=["image"], out_keys=["logits"], baselines=baseline, n_steps=7, method=method
        )
        td = ig(TensorDict(image=x, batch_size=[4]))
        target = net(x).argmax(-1)
        (expected,) = reference(net, [x], [baseline.expand_as(x)], target, method, 7)
        assert relative_error(td["attribution", "image"], expected) <= 1e-10

    @pytest.mark.parametrize("method", ["gausslegendre", "riemann_trapezoid"])
    def test_two_key_policy_with_baselines_by_key(self, method):
        policy = two_key_policy()
        obs, goal = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
        baselines = {"obs": 0.5, "goal": torch.tensor([1.0, -1.0], dtype=torch.float64)}
        ig = IntegratedGradients(
            policy, baselines=baselines, n_steps=9, method=method, target=torch.tensor([0, 1, 2, 0, 1])
        )
        td = ig(TensorDict(obs=obs, goal=goal, batch_size=[5]))
        expected = reference(
            policy.module,
            [obs, goal],
            [torch.full_like(obs, 0.5), baselines["goal"].expand_as(goal)],
            torch.tensor([0, 1, 2, 0, 1]),
            method,
            9,
        )
        assert relative_error(td["attribution", "obs"], expected[0]) <= 1e-10
        assert relative_error(td["attribution", "goal"], expected[1]) <= 1e-10

    @pytest.mark.parametrize("seed", range(3))
    @pytest.mark.parametrize("batch", [(), (4,), (2, 3)])
    def test_random_mlps_and_batch_shapes(self, seed, batch):
        net = random_mlp(seed)
        x = torch.randn(*batch, 5, dtype=torch.float64)
        td = IntegratedGradients(net, in_keys=["x"], out_keys=["y"], n_steps=11)(TensorDict(x=x, batch_size=batch))
        fx = flat(x, len(batch))
        (expected,) = reference(net, [fx], [torch.zeros_like(fx)], net(fx).argmax(-1), "gausslegendre", 11)
        assert relative_error(td["attribution", "x"].reshape(fx.shape), expected) <= 1e-10

    @pytest.mark.parametrize("method", ["IntegratedGradients", "SmoothGrad", "GradientShap"])
    def test_an_internal_batch_size_below_the_batch_is_warned_of_and_changes_nothing(self, method):
        """A pass holds at least one point per sample: 2 rows asked, 3 run in each pass. Before, silently (captum
        warns alike); the result is the one of all points at once."""
        from tdhook import attribution

        net, rows = small_cnn(), []
        net.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0]))
        td = TensorDict(image=torch.randn(3, 3, 8, 8, dtype=torch.float64), batch_size=[3])
        shap = dict(n_samples=4, seed=0, baselines=torch.zeros(2, 3, 8, 8, dtype=torch.float64))
        options = {
            "IntegratedGradients": dict(n_steps=4),
            "SmoothGrad": dict(n_samples=4, seed=0),
            "GradientShap": shap,
        }
        options = dict(in_keys=["image"], out_keys=["logits"], **options[method])
        whole = getattr(attribution, method)(net, **options)(td.clone())
        rows.clear()
        with pytest.warns(
            UserWarning,
            match=rf"{method}: internal_batch_size=2 is less than the 3 samples of the "
            r"batch: each forward pass runs one .* for every sample, 3 rows",
        ):
            pieces = getattr(attribution, method)(net, internal_batch_size=2, **options)(td.clone())
        assert max(rows) == 3
        torch.testing.assert_close(pieces["attribution", "image"], whole["attribution", "image"], rtol=1e-12, atol=0)

    @pytest.mark.parametrize("internal_batch_size", [3, 7, 1000])
    def test_internal_batch_size_changes_nothing(self, internal_batch_size):
        net = small_cnn()
        td = TensorDict(image=torch.randn(3, 3, 8, 8, dtype=torch.float64), batch_size=[3])
        whole = IntegratedGradients(net, in_keys=["image"], out_keys=["logits"], n_steps=10)(td.clone())
        pieces = IntegratedGradients(
            net, in_keys=["image"], out_keys=["logits"], n_steps=10, internal_batch_size=internal_batch_size
        )(td.clone())
        assert relative_error(pieces["attribution", "image"], whole["attribution", "image"]) <= 1e-12

    def test_completeness(self):
        net = random_mlp(3)
        x = torch.randn(6, 5, dtype=torch.float64)
        td = IntegratedGradients(net, in_keys=["x"], out_keys=["y"], target=1, n_steps=40)(
            TensorDict(x=x, batch_size=[6])
        )
        gain = net(x)[:, 1] - net(torch.zeros_like(x))[:, 1]
        assert (td["attribution", "x"].sum(-1) - gain).abs().max() < 1e-6


class TestAgainstCaptum:
    @pytest.mark.parametrize("method", METHODS)
    def test_small_cnn(self, method):
        net = small_cnn()
        x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
        td = IntegratedGradients(net, in_keys=["image"], out_keys=["logits"], target=2, n_steps=16, method=method)(
            TensorDict(image=x, batch_size=[4])
        )
        expected = captum.attr.IntegratedGradients(net).attribute(x.clone(), target=2, n_steps=16, method=method)
        # captum rounds its quadrature weights to float32.
        assert relative_error(td["attribution", "image"], expected) <= 1e-6

    def test_float32_keeps_its_dtype(self):
        net = small_cnn().float()
        x = torch.randn(4, 3, 8, 8)
        td = IntegratedGradients(net, in_keys=["image"], out_keys=["logits"], target=1, n_steps=16)(
            TensorDict(image=x, batch_size=[4])
        )
        expected = captum.attr.IntegratedGradients(net).attribute(x.clone(), target=1, n_steps=16)
        assert td["attribution", "image"].dtype == torch.float32
        assert relative_error(td["attribution", "image"], expected) <= 1e-6

    def test_two_key_policy(self):
        assert_two_key_policy_matches(
            IntegratedGradients, captum.attr.IntegratedGradients, target=1, tolerance=1e-6, n_steps=20
        )


class TestRefusals:
    def test_baseline_of_the_wrong_shape_names_the_key(self):
        ig = IntegratedGradients(two_key_policy(), baselines={"obs": torch.zeros(3), "goal": 0.0})
        td = TensorDict(
            obs=torch.randn(2, 4, dtype=torch.float64), goal=torch.randn(2, 2, dtype=torch.float64), batch_size=[2]
        )
        with pytest.raises(ValueError, match=r"baseline of input key 'obs' has shape \[3\].*one sample's shape \[4\]"):
            ig(td)
        assert set(td.keys()) == {"obs", "goal"}

    def test_baselines_dict_must_name_every_explained_key(self):
        ig = IntegratedGradients(two_key_policy(), baselines={"obs": 0.0})
        td = TensorDict(
            obs=torch.randn(2, 4, dtype=torch.float64), goal=torch.randn(2, 2, dtype=torch.float64), batch_size=[2]
        )
        with pytest.raises(
            KeyError, match=r"baselines must have one entry per explained input key.*missing \['goal'\]"
        ):
            ig(td)

    def test_internal_batch_size(self):
        with pytest.raises(ValueError, match="internal_batch_size must be a positive int"):
            IntegratedGradients(random_mlp(0), in_keys=["x"], out_keys=["y"], internal_batch_size=0)


def test_bfloat16_points_one_per_pass_sum_in_float32():
    """On a linear model IG is w · x; in bfloat16, 100 points summed one pass at a time were 5 % off it."""
    net, w = bfloat16_linear(64)
    x = torch.randn(2, 64).to(torch.bfloat16)
    ig = IntegratedGradients(
        net, in_keys=["x"], out_keys=["y"], target=0, n_steps=100, method="riemann_middle", internal_batch_size=2
    )
    got = ig(TensorDict(x=x, batch_size=[2]))["attribution", "x"]
    assert got.dtype == torch.bfloat16
    assert relative_error(got.double(), w * x.double()) < 2**-8


def test_a_tensordict_of_baselines_with_nested_keys_gives_each_key_its_leaf():
    """Baselines as a TensorDict give each (nested) input key its leaf, as a dict keyed by the nested keys does,
    with one baseline per sample of a ``[2, 3]`` batch; before, the TensorDict's top-level key was read as an input
    key and refused."""
    from tensordict.nn import TensorDictModule

    from tests.attribution.methods._models import TwoKeyNet

    torch.manual_seed(0)
    policy = TensorDictModule(TwoKeyNet().double(), in_keys=[("o", "obs"), ("o", "goal")], out_keys=["q"])
    obs, goal = torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(2, 3, 2, dtype=torch.float64)
    b_obs, b_goal = torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(2, dtype=torch.float64)
    nested = TensorDict({"o": {"obs": b_obs, "goal": b_goal.expand(2, 3, 2)}}, batch_size=[2, 3])
    by_key = {("o", "obs"): b_obs, ("o", "goal"): b_goal}
    td = TensorDict({"o": {"obs": obs, "goal": goal}}, batch_size=[2, 3])
    got = IntegratedGradients(policy, target=1, baselines=nested, n_steps=8)(td.clone())
    expected = IntegratedGradients(policy, target=1, baselines=by_key, n_steps=8)(td.clone())
    for key in [("o", "obs"), ("o", "goal")]:
        assert torch.equal(got["attribution", *key], expected["attribution", *key])


@pytest.mark.parametrize("change", [{"n_steps": 20}, {"n_steps": 80}, {"method": "riemann_left"}])
def test_steps_and_method_set_as_attributes_are_used(change):
    """The quadrature points were drawn once, in the constructor: ``ig.n_steps = 20`` on a wrapper built with 50
    integrated over the first 20 of its 50 Gauss-Legendre points (off by 0.18, the attributions up to 0.29), 80
    stayed at 50 points, and ``ig.method = ...`` was ignored, without a word. They follow the attributes now, as
    set_kwargs's do."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    td = TensorDict(x=torch.randn(3, 4, dtype=torch.float64), batch_size=[3])
    ig = IntegratedGradients(net, in_keys=["x"], out_keys=["y"], target=1, n_steps=50)
    ig(td.clone())
    for name, value in change.items():
        setattr(ig, name, value)
    expected = IntegratedGradients(net, in_keys=["x"], out_keys=["y"], target=1, **{"n_steps": 50, **change})
    torch.testing.assert_close(ig(td.clone())["attribution", "x"], expected(td.clone())["attribution", "x"])
    ig.n_steps = 0
    with pytest.raises(ValueError, match="IntegratedGradients: n_steps must be an int of at least 1, got 0"):
        ig(td.clone())
