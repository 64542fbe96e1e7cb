"""GradientSHAP: exact on linear models (against captum too), and the documented draws with captum's saliency."""

from __future__ import annotations

import captum.attr
import pytest
import torch
from tensordict import TensorDict

from tdhook.attribution import GradientShap
from tests.attribution.methods._models import bfloat16_linear, small_cnn, two_key_policy
from tests.conftest import relative_error

pytestmark = pytest.mark.filterwarnings("ignore:Input Tensor .* did not already require gradients:UserWarning")


def reference(forward, inputs, references, stdevs, n_samples, seed, target):
    """Reproduce the documented draws (with a seed, one per copy that every sample of the batch shares), then average
    captum's gradient at each point times (noisy input − reference)."""
    generator = torch.Generator().manual_seed(seed)
    batch = inputs[0].shape[0]
    indices = torch.randint(references[0].shape[0], (n_samples, 1), generator=generator).expand(n_samples, batch)
    alphas = torch.rand((n_samples, 1), generator=generator, dtype=torch.float64).expand(n_samples, batch)
    noisy = [
        x + s * torch.randn((n_samples, 1, *x.shape[1:]), generator=generator, dtype=x.dtype)
        for x, s in zip(inputs, stdevs, strict=True)
    ]
    totals = [torch.zeros_like(x) for x in inputs]
    for k in range(n_samples):
        drawn = [r[indices[k]] for r in references]
        differences = [n[k] - d for n, d in zip(noisy, drawn, strict=True)]
        points = tuple(
            (d + alphas[k].view(-1, *[1] * (d.dim() - 1)) * diff).clone()
            for d, diff in zip(drawn, differences, strict=True)
        )
        grads = captum.attr.Saliency(forward).attribute(points, target=target, abs=False)
        for total, g, diff in zip(totals, grads, differences, strict=True):
            total += g * diff
    return [t / n_samples for t in totals]


class TestLinearModels:
    def test_one_reference_no_noise_is_exact_and_equals_captum(self):
        torch.manual_seed(0)
        net = torch.nn.Linear(6, 3).double()
        x = torch.randn(5, 6, dtype=torch.float64)
        r = torch.randn(1, 6, dtype=torch.float64)
        td = GradientShap(net, in_keys=["x"], out_keys=["y"], baselines=r, target=2, n_samples=4, seed=0)(
            TensorDict(x=x, batch_size=[5])
        )
        assert relative_error(td["attribution", "x"], net.weight[2].detach() * (x - r)) <= 1e-12
        expected = captum.attr.GradientShap(net).attribute(x.clone(), baselines=r, target=2, n_samples=4)
        assert relative_error(td["attribution", "x"], expected) <= 1e-8

    def test_several_references_and_noise_on_a_linear_model(self):
        torch.manual_seed(1)
        net = torch.nn.Linear(4, 2).double()
        x = torch.randn(3, 4, dtype=torch.float64)
        refs = torch.randn(5, 4, dtype=torch.float64)
        td = GradientShap(
            net, in_keys=["x"], out_keys=["y"], baselines=refs, target=0, n_samples=8, stdevs=0.3, seed=4
        )(TensorDict(x=x, batch_size=[3]))
        generator = torch.Generator().manual_seed(4)
        indices = torch.randint(5, (8, 1), generator=generator)
        torch.rand((8, 1), generator=generator, dtype=torch.float64)
        noisy = x + 0.3 * torch.randn((8, 1, 4), generator=generator, dtype=torch.float64)
        expected = (net.weight[0].detach() * (noisy - refs[indices])).mean(0)
        assert relative_error(td["attribution", "x"], expected) <= 1e-12


class TestNonlinearModels:
    def test_small_cnn(self):
        net = small_cnn()
        x = torch.randn(3, 3, 8, 8, dtype=torch.float64)
        refs = torch.randn(4, 3, 8, 8, dtype=torch.float64)
        target = net(x).argmax(-1)
        td = GradientShap(net, in_keys=["image"], out_keys=["logits"], baselines=refs, n_samples=6, stdevs=0.1, seed=2)(
            TensorDict(image=x, batch_size=[3])
        )
        (expected,) = reference(net, [x], [refs], [0.1], 6, 2, target)
        assert relative_error(td["attribution", "image"], expected) <= 1e-8

    def test_two_key_policy_one_reference_index_for_both_keys(self):
        policy = two_key_policy()
        obs, goal = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
        refs = {"obs": torch.randn(3, 4, dtype=torch.float64), "goal": torch.randn(3, 2, dtype=torch.float64)}
        td = GradientShap(
            policy,
            baselines=refs,
            n_samples=5,
            stdevs={"obs": 0.2, "goal": 0.0},
            seed=9,
            target=1,
            internal_batch_size=7,
        )(TensorDict(obs=obs, goal=goal, batch_size=[5]))
        expected = reference(policy.module, [obs, goal], [refs["obs"], refs["goal"]], [0.2, 0.0], 5, 9, 1)
        assert relative_error(td["attribution", "obs"], expected[0]) <= 1e-8
        assert relative_error(td["attribution", "goal"], expected[1]) <= 1e-8


class TestRefusals:
    def test_reference_shape_names_the_key(self):
        shap = GradientShap(two_key_policy(), baselines={"obs": torch.zeros(2, 3), "goal": torch.zeros(2, 2)})
        td = TensorDict(
            obs=torch.randn(2, 4, dtype=torch.float64), goal=torch.randn(2, 2, dtype=torch.float64), batch_size=[2]
        )
        with pytest.raises(ValueError, match=r"GradientShap: the baselines of input key 'obs' have shape \[2, 3\]"):
            shap(td)
        assert set(td.keys()) == {"obs", "goal"}

    @pytest.mark.parametrize(
        "kwargs, error, match",
        [
            ({"baselines": 0.0}, TypeError, "the baselines of input key 'obs' must be a floating-point tensor"),
            (
                {"baselines": torch.zeros(1, 4, dtype=torch.long)},  # token ids as references: their dtype is named
                TypeError,
                r"the baselines of input key 'obs' must be a floating-point .*, got torch.int64 \[1, 4\]",
            ),
            (
                {"baselines": {"obs": torch.zeros(2, 4), "goal": torch.zeros(3, 2)}},
                ValueError,
                "every key needs the same number R > 0",
            ),
            ({"baselines": torch.zeros(1, 4), "n_samples": 0}, ValueError, "n_samples must be a positive int"),
            ({"baselines": torch.zeros(1, 4), "stdevs": -0.1}, ValueError, "the stdev of input key 'obs'"),
        ],
    )
    def test_at_construction(self, kwargs, error, match):
        with pytest.raises(error, match=f"GradientShap: {match}"):
            GradientShap(two_key_policy(), **kwargs)


def test_bfloat16_copies_one_per_pass_sum_in_float32():
    """On a linear model with one reference r it is w · (x − r); in bfloat16, 100 copies summed one pass at a time
    were 4 % off it."""
    net, w = bfloat16_linear(64)
    x, reference = torch.randn(2, 64).to(torch.bfloat16), torch.randn(1, 64).to(torch.bfloat16)
    shap = GradientShap(
        net, in_keys=["x"], out_keys=["y"], target=0, baselines=reference, n_samples=100, seed=0, internal_batch_size=2
    )
    got = shap(TensorDict(x=x, batch_size=[2]))["attribution", "x"]
    assert got.dtype == torch.bfloat16
    assert relative_error(got.double(), w * (x - reference).double()) < 2**-8


def test_options_set_as_attributes_are_read_as_the_constructor_reads_them():
    """``baselines`` and ``stdevs`` set after construction were kept as given and read as one entry per input key:
    ``stdevs = 0.3`` failed in a bare ``zip`` (``'float' object is not iterable``), and a tensor of reference samples
    was taken for its first row. They are now read, and checked, as the constructor reads them."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()
    td = TensorDict(x=torch.randn(4, 3, dtype=torch.float64), batch_size=[4])
    references = torch.randn(3, 3, dtype=torch.float64)
    shap = GradientShap(net, in_keys=["x"], out_keys=["y"], baselines=torch.zeros(2, 3), n_samples=6, seed=0)
    shap.baselines, shap.stdevs = references, 0.3
    expected = GradientShap(net, in_keys=["x"], out_keys=["y"], baselines=references, stdevs=0.3, n_samples=6, seed=0)(
        td.clone()
    )
    torch.testing.assert_close(shap(td.clone())["attribution", "x"], expected["attribution", "x"], rtol=0, atol=0)
    assert shap.baselines is references and shap.stdevs == 0.3
    with pytest.raises(ValueError, match="GradientShap: the stdev of input key 'x' must be a number >= 0, got -1"):
        shap.stdevs = -1
    with pytest.raises(TypeError, match="GradientShap: the baselines of input key 'x' must be a floating-point"):
        shap.baselines = torch.zeros(2, 3, dtype=torch.long)
    assert shap.stdevs == 0.3 and shap.baselines is references  # a refused value leaves the option as it was
