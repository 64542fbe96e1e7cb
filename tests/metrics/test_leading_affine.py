"""Curves through a model that starts with a linear layer: its output updated step by step equals direct passes.

The direct passes are the same metric with the update switched off (a hook on the model that does nothing), and,
for pixel flipping, Quantus.
"""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torch.overrides import TorchFunctionMode

from tdhook.metrics import pixel_flipping, region_perturbation
from tdhook.metrics._leading_affine import LeadingAffine, _in_order
from tests.metrics._models import images, mlp_net
from tests.metrics.test_pixel_flipping import by_definition, quantus_pixel_flipping


def direct(net: nn.Module) -> nn.Module:
    """``net`` with a hook that changes nothing: the metrics then run it on every perturbed input."""
    net.register_forward_pre_hook(lambda module, args: None)
    return net


def flipping(net, td, **kwargs):
    return pixel_flipping(net, td, in_keys=["x"], out_keys=["y"], **kwargs)


def watched_flipping(net, td, **kwargs):
    """The curve, and the mock of :meth:`LeadingAffine.outputs` that says whether (and how) it was updated."""
    with mock.patch.object(LeadingAffine, "outputs", autospec=True, side_effect=LeadingAffine.outputs) as updated:
        return flipping(net, td, **kwargs), updated


@pytest.mark.parametrize(
    ("batch", "map_channels", "features_per_step", "baseline"),
    [((4,), 3, 1, 0.0), ((3,), 3, 10, 0.5), ((2, 3), 1, 5, "minimum"), ((1,), 1, 36, "tensor")],
)
def test_pixel_flipping_equals_direct_passes(batch, map_channels, features_per_step, baseline):
    torch.manual_seed(0)
    net, shape = mlp_net(), (3, 6, 6)
    if len(batch) > 1:  # the model sees the batch as it is: it reads flat samples
        net, shape = nn.Sequential(*list(net)[1:]), (108,)
    x = torch.randn(*batch, *shape).double()
    a = torch.randn(*batch, *((map_channels, 6, 6) if len(shape) == 3 else shape)).double()
    if baseline == "minimum":
        baseline = x.flatten(len(batch)).min(-1).values.view(*batch, *[1] * len(shape))
    elif baseline == "tensor":
        baseline = torch.randn(shape).double()
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=batch)
    curve, updated = watched_flipping(net, td, features_per_step=features_per_step, baseline=baseline)
    assert updated.called
    expected = flipping(direct(net), td, features_per_step=features_per_step, baseline=baseline)
    torch.testing.assert_close(curve, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("steps_per_forward", [1, 3])
def test_stacks_of_a_few_steps_carry_the_sum_from_one_stack_to_the_next(steps_per_forward):
    torch.manual_seed(7)
    net = mlp_net()
    x, a = images(3), torch.randn(3, 1, 6, 6, dtype=torch.float64)
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[3])
    curve, updated = watched_flipping(net, td, features_per_step=5, steps_per_forward=steps_per_forward)
    assert updated.call_args.args[5] == steps_per_forward  # (self, x, baseline, positions, thresholds, size, batch)
    torch.testing.assert_close(curve, flipping(direct(net), td, features_per_step=5), rtol=0, atol=1e-12)


def test_pixel_flipping_equals_quantus_and_its_definition():
    torch.manual_seed(1)
    net = mlp_net()
    x, a = images(4), torch.randn(4, 3, 6, 6, dtype=torch.float64)
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[4])
    curve = flipping(net, td, features_per_step=9)
    target = net(x).argmax(-1)
    torch.testing.assert_close(curve[..., 1:], quantus_pixel_flipping(net, x, a, target, 9), rtol=0, atol=1e-6)
    torch.testing.assert_close(curve, by_definition(net, x, a, target, 9), rtol=0, atol=1e-10)


def test_float32_agrees_with_direct_float32_passes():
    torch.manual_seed(2)
    net = mlp_net(size=16, hidden=64).float()
    x, a = torch.randn(8, 3, 16, 16), torch.randn(8, 3, 16, 16)
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[8])
    curve = flipping(net, td, features_per_step=16)
    expected = flipping(direct(net), td, features_per_step=16)
    assert curve.dtype == torch.float32
    torch.testing.assert_close(curve, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize(
    ("size", "patch_size", "n_regions", "steps_per_forward"), [(7, 3, 5, None), (6, 2, None, None), (7, 2, 11, 3)]
)
def test_region_perturbation_with_uneven_patches_equals_direct_passes(size, patch_size, n_regions, steps_per_forward):
    """Uneven patches give steps of different sizes; with ``n_regions`` some features never go, and they stay in
    every step (stacks of 3 steps: they enter with the last stack, the first computed)."""
    torch.manual_seed(3)
    net = mlp_net(size=size)
    x, a = images(3, size=size), torch.randn(3, 3, size, size, dtype=torch.float64)
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[3])
    kwargs = dict(patch_size=patch_size, n_regions=n_regions, in_keys=["x"], out_keys=["y"])
    with mock.patch.object(LeadingAffine, "outputs", autospec=True, side_effect=LeadingAffine.outputs) as updated:
        curve = region_perturbation(net, td, **kwargs, steps_per_forward=steps_per_forward)
    assert updated.called
    torch.testing.assert_close(curve, region_perturbation(direct(net), td, **kwargs), rtol=0, atol=1e-12)


def test_a_policy_on_a_flat_observation_in_a_tensordict_module():
    torch.manual_seed(4)
    policy = TensorDictModule(
        nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3)).double(), in_keys=["obs"], out_keys=["q"]
    )
    obs = torch.randn(5, 6).double().requires_grad_(True)
    td = TensorDict(obs=obs, attribution=TensorDict(obs=torch.randn(5, 6).double()), batch_size=[5])
    before = td.clone()
    curve = pixel_flipping(policy, td, features_per_step=4)
    assert LeadingAffine.find(policy.module) is not None
    assert not curve.requires_grad and torch.is_grad_enabled()
    assert (td == before).all() and set(td.keys(True, True)) == set(before.keys(True, True))
    policy.register_forward_pre_hook(lambda module, args: None)
    torch.testing.assert_close(curve, pixel_flipping(policy, td, features_per_step=4), rtol=0, atol=1e-12)


def test_a_forward_set_on_the_tensordict_module_runs_every_perturbed_input():
    torch.manual_seed(4)
    net = mlp_net()
    policy = TensorDictModule(net, in_keys=["x"], out_keys=["y"])
    plain = policy.forward
    policy.forward = lambda td: plain(td.set("x", 2 * td.get("x")))
    x, a = images(2), torch.randn(2, 3, 6, 6, dtype=torch.float64)
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[2])
    curve = pixel_flipping(policy, td, features_per_step=9)
    torch.testing.assert_close(curve, by_definition(net, 2 * x, a, net(2 * x).argmax(-1), 9), rtol=0, atol=1e-10)


def test_under_autocast_every_perturbed_input_runs_as_the_model_runs_it():
    """Under autocast the model's own passes run the leading layer in bfloat16, the step-by-step sums in float32:
    the curve was 0.002 off those passes (its scores up to 0.55). Autocast takes the stacked passes, equal to them."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 3))
    x, a = torch.randn(4, 64), torch.randn(4, 64)
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[4])
    order = torch.sort(a, dim=-1, descending=True, stable=True).indices
    with torch.autocast("cpu", dtype=torch.bfloat16):
        curve = pixel_flipping(net, td, in_keys=["x"], out_keys=["y"], target=0, features_per_step=4)
        with torch.no_grad():  # the definition: one pass per step
            steps = [net(x.scatter(-1, order[:, : 4 * k], 0.0))[:, 0] for k in range(17)]
    torch.testing.assert_close(curve, torch.stack(steps, -1), rtol=0, atol=0)


class Doubled(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


def _hooked_first_layer() -> nn.Module:
    net = mlp_net()
    net[1].register_forward_hook(lambda module, args, output: 3 * output)
    return net


def _forward_set_on(index: int | None) -> nn.Module:
    """``mlp_net`` with a forward of its own set on the instance (as accelerate's hooks do) of the model or a layer."""
    net = mlp_net()
    module = net if index is None else net[index]
    plain = module.forward
    module.forward = lambda x: 3 * plain(x)
    return net


@pytest.mark.parametrize(
    "make",
    [
        _hooked_first_layer,  # a hook on the skipped layer must run
        lambda: Doubled(*mlp_net()),  # its own forward
        lambda: _forward_set_on(None),  # a forward set on the model itself
        lambda: _forward_set_on(0),  # ... on the flatten
        lambda: _forward_set_on(1),  # ... on the linear layer
        lambda: nn.Sequential(nn.Flatten(start_dim=2), nn.Flatten(), *list(mlp_net())[1:]),  # another flatten
        lambda: nn.Sequential(nn.ReLU(), *mlp_net()),  # a nonlinear first layer
    ],
)
def test_models_it_cannot_split_run_every_perturbed_input(make):
    torch.manual_seed(5)
    net = make()
    x, a = images(2), torch.randn(2, 3, 6, 6, dtype=torch.float64)
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[2])
    curve, updated = watched_flipping(net, td, features_per_step=9)
    assert not updated.called
    torch.testing.assert_close(curve, by_definition(net, x, a, net(x).argmax(-1), 9), rtol=0, atol=1e-10)


def test_a_linear_layer_over_the_last_dimension_only_runs_every_perturbed_input():
    torch.manual_seed(6)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Flatten(), nn.Linear(24, 2)).double()
    x, a = torch.randn(2, 3, 4).double(), torch.randn(2, 3, 4).double()
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[2])
    curve, updated = watched_flipping(net, td, features_per_step=5)
    assert not updated.called
    torch.testing.assert_close(curve, by_definition(net, x, a, net(x).argmax(-1), 5), rtol=0, atol=1e-10)


def _in_place_images(batch: int) -> tuple[nn.Module, TensorDict]:
    net = mlp_net()
    net[2] = nn.ReLU(inplace=True)
    x, a = images(batch), torch.randn(batch, 3, 6, 6, dtype=torch.float64)
    return net, TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[batch])


def _in_place_long_vector() -> tuple[nn.Module, TensorDict]:
    """One sample of 6000 features through 64 units: stacks of 4096 steps by default, so two stacks."""
    net = nn.Sequential(nn.Linear(6000, 64), nn.ReLU(inplace=True), nn.Linear(64, 1)).double()
    x, a = torch.randn(1, 6000, dtype=torch.float64), torch.randn(1, 6000, dtype=torch.float64)
    return net, TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[1])


@pytest.mark.parametrize(
    ("make", "steps_per_forward"),
    [(lambda: _in_place_images(1), 3), (lambda: _in_place_images(2), 1), (_in_place_long_vector, None)],
)
def test_an_in_place_activation_after_the_layer_leaves_the_carried_sum_alone(make, steps_per_forward):
    """``ReLU(inplace=True)`` right after the layer works on the stack of summed outputs; where that stack is what
    the next stack starts from (one sample, or one step a stack), it must not be rectified with it."""
    torch.manual_seed(8)
    net, td = make()
    kwargs = dict(features_per_step=1, steps_per_forward=steps_per_forward)
    curve, updated = watched_flipping(net, td, **kwargs)
    assert updated.called
    torch.testing.assert_close(curve, flipping(direct(net), td, **kwargs), rtol=0, atol=1e-12)


def test_long_stacks_of_steps_take_memory_linear_in_their_length():
    """One sample through a layer of one unit: a stack holds 65536 steps. Their running sum must not build a
    steps x steps matrix (32 GiB at that length; 128 MiB for the 4096 steps here)."""
    torch.manual_seed(9)
    net = nn.Sequential(nn.Linear(4096, 1)).double()
    x, a = torch.randn(1, 4096, dtype=torch.float64), torch.randn(1, 4096, dtype=torch.float64)
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[1])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profiler:
        curve, updated = watched_flipping(net, td, features_per_step=1)
    assert updated.called
    largest = max(event.cpu_memory_usage for event in profiler.events())
    assert largest < 4 << 20, f"one operation allocated {largest / 2**20:.0f} MiB"
    torch.testing.assert_close(curve, flipping(direct(net), td, features_per_step=1), rtol=0, atol=1e-12)


def test_a_large_raw_feature_leaves_no_rounding_behind_once_it_is_at_the_baseline():
    """A float32 policy on a tabular observation with one raw feature near 1e6 (a price): once that feature is
    flipped, the curve is the output of the small features alone, as exact as a direct float32 pass (the update
    in float32 kept an error of about 0.03 from the large feature's rounding)."""
    torch.manual_seed(10)
    net = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 1))
    x, a = torch.randn(64, 20), torch.randn(64, 20)
    x[:, 0], a[:, 0] = 1e6 * (1 + torch.rand(64)), 100.0  # the large feature goes first
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[64])
    curve, updated = watched_flipping(net, td, features_per_step=1)
    assert updated.called
    td64 = TensorDict(x=x.double(), attribution=TensorDict(x=a.double()), batch_size=[64])
    exact = flipping(direct(net.double()), td64, features_per_step=1)
    torch.testing.assert_close(curve[:, 2:].double(), exact[:, 2:], rtol=0, atol=1e-6)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_an_input_that_is_not_finite_is_gone_from_the_curve_once_it_is_at_the_baseline(value):
    """Step by step, the unperturbed output would carry the NaN (or inf - inf) to the end of the curve."""
    torch.manual_seed(11)
    net = mlp_net()
    x, a = images(2), torch.randn(2, 3, 6, 6, dtype=torch.float64)
    x[:, 0, 0, 0], a[:, 0, 0, 0] = value, 100.0  # it goes first
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[2])
    curve = flipping(net, td, features_per_step=9)
    assert torch.isfinite(curve[:, 1:]).all()
    expected = flipping(direct(net), td, features_per_step=9)  # the unperturbed score is NaN or inf in both
    torch.testing.assert_close(curve, expected, rtol=0, atol=1e-12, equal_nan=True)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    batch=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    width=st.integers(1, 9),
    per_pixel=st.booleans(),
    features_per_step=st.integers(1, 40),
    baseline=st.sampled_from(["zero", "number", "per sample", "per element"]),
    region=st.booleans(),
    stack=st.sampled_from([None, 1, 2, 5]),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_curves_equal_direct_passes(
    batch, width, per_pixel, features_per_step, baseline, region, stack, bias, seed
):
    """Random batch shapes, widths, maps (per element or per pixel), steps, baselines, stack sizes, first layers with
    and without bias, and both curves: the updated first layer equals the model run on every perturbed input."""
    torch.manual_seed(seed)
    first = nn.Linear(2 * 4 * 4, width, bias=bias)
    net = nn.Sequential(nn.Flatten(), first, nn.Tanh(), nn.Linear(width, 3)).double()
    if len(batch) != 1:  # images flattened from dim 1 need one batch dimension: other batches read flat samples
        net = nn.Sequential(*list(net)[1:])
    shape = (2, 4, 4) if len(batch) == 1 else (32,)
    x = torch.randn(*batch, *shape, dtype=torch.float64)
    map_shape = (1, 4, 4) if per_pixel and len(shape) == 3 else shape
    a = torch.randn(*batch, *map_shape, dtype=torch.float64)
    values = {
        "zero": 0.0,
        "number": 0.3,
        "per sample": torch.randn(*batch, *[1] * len(shape), dtype=torch.float64),
        "per element": torch.randn(shape, dtype=torch.float64),
    }
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=batch)
    kwargs = dict(baseline=values[baseline], steps_per_forward=stack, in_keys=["x"], out_keys=["y"], progress=False)
    if region and len(shape) == 3:
        kwargs.update(patch_size=1 + features_per_step % 3, n_regions=None if features_per_step % 2 else 3)
        metric = region_perturbation
    else:
        kwargs.update(features_per_step=features_per_step)
        metric = pixel_flipping
    with mock.patch.object(LeadingAffine, "outputs", autospec=True, side_effect=LeadingAffine.outputs) as updated:
        curve = metric(net, td, **kwargs)
    assert updated.called
    torch.testing.assert_close(curve, metric(direct(net), td, **kwargs), rtol=0, atol=1e-10)


@pytest.mark.parametrize(("dtype", "scale", "atol"), [(torch.float64, 1e8, 1e-13), (torch.float32, 1e12, 1e-6)])
def test_a_large_feature_flipped_inside_a_stack_leaves_no_rounding_behind(dtype, scale, atol):
    """All the steps in one stack (the default for this small layer): once the large feature (a raw timestamp, a
    price in cents) is at the baseline, each step's output is the sum of the features still there, summed from the
    last step back, with nothing of the large feature left to cancel; as exact as a direct pass of the model. The
    running sum from the first step of the stack kept about ``scale * 1e-16`` (1e-8 in float64, 1e-4 in float32)."""
    torch.manual_seed(12)
    net = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 1)).to(dtype)
    x, a = torch.randn(64, 20, dtype=dtype), torch.randn(64, 20, dtype=dtype)
    x[:, 0], a[:, 0] = scale * (1 + torch.rand(64, dtype=dtype)), 100.0  # it goes first
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[64])
    curve, updated = watched_flipping(net, td, features_per_step=1)
    assert updated.called and updated.call_args.args[5] >= 20  # one stack
    expected = flipping(direct(net), td, features_per_step=1)
    torch.testing.assert_close(curve[:, 1:], expected[:, 1:], rtol=0, atol=atol)


def test_a_baseline_that_is_not_finite_runs_every_perturbed_input():
    """A baseline of inf in one element: the output with every element at the baseline (where the update starts)
    is not finite, and it would spread to every step; the direct passes stay finite until that element goes."""
    torch.manual_seed(13)
    net = mlp_net()
    x, a = images(2), torch.randn(2, 3, 6, 6, dtype=torch.float64)
    a[:, 0, 0, 0] = -100.0  # the element goes last
    baseline = torch.zeros(3, 6, 6, dtype=torch.float64)
    baseline[0, 0, 0] = float("inf")
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[2])
    curve = flipping(net, td, features_per_step=9, baseline=baseline)
    assert torch.isfinite(curve[:, :-1]).all()
    expected = flipping(direct(net), td, features_per_step=9, baseline=baseline)
    torch.testing.assert_close(curve, expected, rtol=0, atol=1e-12, equal_nan=True)


def test_float32_outputs_are_summed_in_float64_and_rounded_once():
    """A float32 layer whose output is 1e8 (one feature, the last to go) plus one for each of 40 small features still
    there: each step's output is that sum rounded once to float32 (a multiple of 8 there). A running sum in float32
    would stay at 1e8, as 1e8 + 1 rounds back to 1e8 (and a float32 pass of the model is off by up to 16 here)."""
    net = nn.Sequential(nn.Linear(41, 1, bias=False))
    with torch.no_grad():
        net[0].weight.fill_(1.0)
    x = torch.ones(1, 41)
    x[0, 0] = 1e8
    a = torch.arange(41.0, 0.0, -1.0).unsqueeze(0)  # the small features first, in order; the large one last
    a[0, 0] = -1.0
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[1])
    curve, updated = watched_flipping(net, td, features_per_step=1)
    assert updated.called
    still_there = torch.arange(39, -2, -1, dtype=torch.float64)  # small features at steps 1 .. 41
    expected = torch.where(still_there >= 0, 1e8 + still_there, 0.0).float()
    assert torch.equal(curve[0, 1:], expected)


class _ViewsItsInput(nn.Module):
    """A layer of the caller's that merges its input's last two dimensions with ``view`` (and splits them back)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:-2], -1).view(x.shape)


def test_a_layer_of_the_callers_after_the_first_gets_a_contiguous_stack():
    """The summed outputs are rows of a padded buffer; torch's layers read them as they are, a layer of the
    caller's that calls ``view`` gets a contiguous copy."""
    torch.manual_seed(14)
    net = nn.Sequential(nn.Linear(8, 5), _ViewsItsInput(), nn.Tanh(), nn.Linear(5, 3)).double()
    x, a = torch.randn(2, 3, 8, dtype=torch.float64), torch.randn(2, 3, 8, dtype=torch.float64)
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[2, 3])
    curve, updated = watched_flipping(net, td, features_per_step=3)
    assert updated.called
    torch.testing.assert_close(curve, flipping(direct(net), td, features_per_step=3), rtol=0, atol=1e-12)


class _FirstLayerPasses(TorchFunctionMode):
    """Counts the passes of one linear layer (``nn.functional.linear`` with its weights)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight, self.count = weight, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is nn.functional.linear and (args[1] if len(args) > 1 else kwargs.get("weight")) is self.weight:
            self.count += 1
        return func(*args, **kwargs)


@pytest.mark.parametrize(
    "target", [None, 3, torch.tensor([0, 4, 2]), lambda y: y * torch.linspace(0.5, 2.0, 5, dtype=y.dtype)]
)
@pytest.mark.parametrize("steps_per_forward", [None, 2])
def test_the_unperturbed_output_comes_from_the_sums_with_the_target_fixed_on_it(target, steps_per_forward):
    """Column 0 and the target come from the first layer's summed outputs at step 0: the layer never runs on the
    unperturbed input (with a zero baseline, not at all), and the curve, its first column included, equals direct
    passes whatever the target."""
    torch.manual_seed(3)
    net, x, a = mlp_net(), images(3), images(3)
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[3])
    kwargs = {"features_per_step": 10, "target": target, "steps_per_forward": steps_per_forward}
    with _FirstLayerPasses(net[1].weight) as passes:
        curve, updated = watched_flipping(net, td, **kwargs)
    assert updated.called and passes.count == 0
    expected = flipping(direct(net), td, **kwargs)
    torch.testing.assert_close(curve, expected, rtol=0, atol=1e-12)
    with torch.no_grad():
        y = net(x)
    if callable(target):
        reference = target(y).sum(-1)
    else:
        reference = y.max(-1).values if target is None else y[torch.arange(3), target]
    torch.testing.assert_close(curve[:, 0], reference, rtol=0, atol=1e-12)


def test_a_refused_target_is_refused_as_before_with_the_unperturbed_output_from_the_sums():
    """The target's checks run on the summed unperturbed output: a callable that puts relevance where the output is
    0 (a ReLU output) is refused, and so is an index past the output's units."""
    torch.manual_seed(3)
    net = nn.Sequential(nn.Flatten(), nn.Linear(108, 4), nn.ReLU()).double().eval()
    x = images(2)
    with torch.no_grad():
        net[1].bias.fill_(-100.0)  # every output 0
    td = TensorDict(x=x, attribution=TensorDict(x=images(2)), batch_size=[2])
    with pytest.raises(ValueError, match="callable target puts relevance on"):
        flipping(net, td, target=lambda y: y + 1.0)
    with pytest.raises((IndexError, ValueError), match="metrics"):
        flipping(net, td, target=7)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_order_of_the_sort_is_read_as_it_is_where_each_element_has_its_own_rank(dtype):
    """Pixel flipping gives the first layer the features in the order of its sort: with one feature per element, the
    ranks are not inverted back into that order (``_in_order`` does not run), and the curve equals direct passes; a
    map of pixels (one rank for three channels) still sorts the ranks."""
    torch.manual_seed(15)
    net = mlp_net().to(dtype)
    x = images(3).to(dtype)
    tolerance = dict(rtol=0, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    for channels, inverted in [(3, False), (1, True)]:
        a = torch.randn(3, channels, 6, 6, dtype=dtype)
        td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[3])
        with mock.patch("tdhook.metrics._leading_affine._in_order", side_effect=_in_order) as in_order:
            curve, updated = watched_flipping(net, td, features_per_step=7)
        assert updated.called and in_order.called == inverted
        expected = flipping(direct(copy.deepcopy(net)), td, features_per_step=7)
        torch.testing.assert_close(curve, expected, **tolerance)


@pytest.mark.parametrize("size", [2, 3, 6])
def test_outputs_from_the_order_equal_those_from_the_ranks(size):
    """The layer's outputs from the elements' order and from their ranks (its inverse) are the same tensors, in stacks
    of ``size`` steps, the unperturbed one included."""
    torch.manual_seed(16)
    net = nn.Sequential(nn.Linear(12, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    x, base = torch.randn(4, 12, dtype=torch.float64), torch.randn(12, dtype=torch.float64)
    order = torch.stack([torch.randperm(12) for _ in range(4)])
    ranks = torch.empty_like(order).scatter_(-1, order, torch.arange(12).expand(4, -1))
    thresholds = torch.tensor([2, 5, 6, 9, 12, 14])
    split = LeadingAffine.find(net)
    from_ranks = list(split.outputs(x, base, ranks, thresholds, size, unperturbed=True))
    from_order = list(split.outputs(x, base, None, thresholds, size, unperturbed=True, order=order))
    assert [start for start, _ in from_order] == [start for start, _ in from_ranks]
    for (_, expected), (_, found) in zip(from_ranks, from_order, strict=True):
        assert torch.equal(found, expected)
    direct_steps = [net(torch.where(ranks < limit, base, x)) for limit in [0, *thresholds.tolist()]]
    steps = torch.cat([found for _, found in sorted(from_order, key=lambda pair: pair[0])])
    torch.testing.assert_close(steps, torch.stack(direct_steps), rtol=0, atol=1e-12)


def test_finite_inputs_whose_sum_overflows_run_every_perturbed_input():
    """Whether the inputs are finite is read from their sum: float32 features near the largest float sum to inf, and
    the curve then comes from passes of the model, as it does for an input that is not finite."""
    torch.manual_seed(17)
    net = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 2))
    with torch.no_grad():
        net[0].weight.mul_(1e-38)
    x, a = torch.full((2, 6), 3e38), torch.randn(2, 6)
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[2])
    curve, updated = watched_flipping(net, td, features_per_step=2)
    assert not updated.called and torch.isfinite(curve).all()
    expected = by_definition(net, x, a, net(x).argmax(-1), 2)
    torch.testing.assert_close(curve.double(), expected, rtol=1e-5, atol=1e-5)


class _Centred(nn.Module):
    """``h - mean(h)`` over the batch: a layer of the caller's that reads every sample of its batch."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h - h.mean(0, keepdim=True)


def test_one_step_per_forward_pass_keeps_the_unperturbed_input_in_a_pass_of_its_own():
    """With ``steps_per_forward=1`` the model sees the TensorDict's own batch in every pass: a layer after the first
    that reads the whole batch then gives each step's score as a pass over that step alone. Before, the unperturbed
    output came from the sums in one pass with step 1 (twice the batch): its first two columns off by up to 9 %
    of a score, silently."""
    torch.manual_seed(5)
    net = nn.Sequential(nn.Linear(6, 5), _Centred(), nn.ReLU(), nn.Linear(5, 3)).double().eval()
    x, a = torch.randn(3, 6, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[3])
    curve, updated = watched_flipping(net, td, steps_per_forward=1)
    assert updated.called
    with torch.no_grad():
        target = net(x).argmax(-1, keepdim=True)
        order = a.argsort(dim=-1, descending=True, stable=True)
        steps = [torch.zeros(3, 6, dtype=torch.bool).scatter_(-1, order[:, :k], True) for k in range(7)]
        expected = torch.stack([net(torch.where(mask, 0.0, x)).gather(-1, target).squeeze(-1) for mask in steps], -1)
    torch.testing.assert_close(curve, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("steps_per_forward", [1, 2])
def test_a_pass_of_one_step_of_a_sample_without_batch_runs_it_unbatched(steps_per_forward):
    """On a TensorDict of batch ``[]`` a pass of one step runs the sample as it is, ``[features]``, as the model's
    own passes do; a layer after the first that reads its first dimension (here: centres over it) then sees the
    features, not a batch of one. Before, the steps of such passes ran ``[1, width]``: every column after the first
    was that of a layer centred to zero, off by up to 0.89 (the unperturbed score is 1.33)."""
    torch.manual_seed(5)
    net = nn.Sequential(nn.Linear(6, 5), _Centred(), nn.Tanh(), nn.Linear(5, 3)).double().eval()
    x, a = torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[])
    # 3 steps: with 2 per pass, the first pass holds the unperturbed input and step 1, the last one step 3 alone.
    curve, updated = watched_flipping(net, td, features_per_step=2, steps_per_forward=steps_per_forward)
    assert updated.called
    with torch.no_grad():
        target = net(x).argmax(-1)
        order = a.argsort(descending=True, stable=True)
        steps = [torch.zeros(6, dtype=torch.bool).scatter_(-1, order[: 2 * k], True) for k in range(4)]
        alone = torch.stack([net(torch.where(mask, 0.0, x))[target] for mask in steps])
    if steps_per_forward == 1:  # as the passes without the update
        direct_curve = flipping(direct(copy.deepcopy(net)), td, features_per_step=2, steps_per_forward=1)
        torch.testing.assert_close(curve, direct_curve, rtol=0, atol=1e-12)
        torch.testing.assert_close(curve, alone, rtol=0, atol=1e-12)
    else:  # the first pass stacks three steps (a layer that reads them all sees them together), the last runs alone
        torch.testing.assert_close(curve[-1], alone[-1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("batch", [[2, 3], []])
def test_a_flatten_first_on_a_batch_of_other_than_one_dimension_is_run_as_the_model_runs(batch):
    """``nn.Flatten()`` flattens every dimension after the first, which is a sample's only on a batch of one
    dimension: on a ``[2, 3]`` batch it takes the second batch dimension into the features, on a batch ``[]`` it
    leaves the first feature dimension out. The model refuses such inputs, and so does the metric, as the model's
    own passes do (the curve was that of samples flattened one by one, which the model does not compute)."""
    torch.manual_seed(7)
    net = nn.Sequential(nn.Flatten(), nn.Linear(12, 3), nn.ReLU(), nn.Linear(3, 2)).double().eval()
    x = torch.randn(*batch, 3, 4, dtype=torch.float64)
    td = TensorDict(x=x, attribution=TensorDict(x=torch.randn_like(x), batch_size=batch), batch_size=batch)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        net(x)
    for steps_per_forward in (None, 2):
        with pytest.raises(RuntimeError, match="cannot be multiplied"):
            flipping(net, td, features_per_step=5, steps_per_forward=steps_per_forward)


def test_a_large_baseline_leaves_no_rounding_in_the_steps_before_it_comes():
    """A float32 model with inputs near 1 and a baseline of 1e6: the layer's output with every element at the
    baseline is near 1e7, and ``x - b`` near -1e6. Taken in float32, their sum at step 0 (and at the first steps)
    carries their rounding, about 1, far above the output itself, and the target fixed there is another unit. In
    float64 the curve is the definition's, rounded once to float32; the target is the model's argmax."""
    torch.manual_seed(11)
    net = nn.Sequential(nn.Linear(12, 9, bias=False), nn.ReLU(), nn.Linear(9, 4)).eval()
    x, a = torch.randn(5, 12), torch.randn(5, 12)
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[5])
    curve, updated = watched_flipping(net, td, features_per_step=7, baseline=1e6)
    assert updated.called
    wide = copy.deepcopy(net).double()
    target = wide(x.double()).argmax(-1)
    assert torch.equal(target, net(x).argmax(-1))
    expected = by_definition(wide, x.double(), a.double(), target, 7, baseline=1e6)
    torch.testing.assert_close(curve.double(), expected, rtol=1e-6, atol=1e-5)
