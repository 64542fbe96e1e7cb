"""pixel_flipping against Quantus' PixelFlipping and against its definition."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

from tdhook.attribution import LRP
from tdhook.metrics import pixel_flipping, region_perturbation
from tests.metrics._models import TwoKeys, conv_net, images, quantus_scores

quantus = pytest.importorskip("quantus")


def quantus_pixel_flipping(net, x, a, y, features_per_step, baseline=0.0):
    metric = quantus.PixelFlipping(
        features_in_step=features_per_step,
        perturb_baseline=baseline,
        normalise=False,
        abs=False,
        disable_warnings=True,
        display_progressbar=False,
    )
    return quantus_scores(metric, net, x, a, y, device="cpu")


def by_definition(net, x, a, target, features_per_step, baseline=0.0):
    """One sample at a time, one step at a time."""
    rows = []
    for xi, ai, ti in zip(x, a, target, strict=True):
        order = sorted(range(ai.numel()), key=lambda i: (-ai.flatten()[i].item(), i))
        flat = xi.flatten().clone()
        row = [net(xi[None])[0, ti].item()]
        for start in range(0, len(order), features_per_step):
            flat[order[start : start + features_per_step]] = baseline
            row.append(net(flat.view_as(xi)[None])[0, ti].item())
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize(("batch", "features_per_step"), [(1, 1), (4, 9), (3, 36)])
def test_equals_quantus_after_the_first_column(batch, features_per_step):
    net = conv_net()
    x, a = images(batch), torch.randn(batch, 3, 6, 6, dtype=torch.float64)
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[batch])
    curve = pixel_flipping(net, td, in_keys=["x"], out_keys=["y"], features_per_step=features_per_step)
    assert curve.shape == (batch, 108 // features_per_step + 1)
    expected = quantus_pixel_flipping(net, x, a, net(x).argmax(-1), features_per_step)
    torch.testing.assert_close(curve[..., 1:], expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(curve[..., 0], net(x).max(-1).values, rtol=0, atol=1e-12)


def test_a_per_sample_minimum_baseline_equals_quantus_black():
    net = conv_net()
    x, a = images(3), torch.randn(3, 3, 6, 6, dtype=torch.float64)
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[3])
    minimum = x.flatten(1).min(-1).values.view(3, 1, 1, 1)
    curve = pixel_flipping(net, td, in_keys=["x"], out_keys=["y"], features_per_step=12, baseline=minimum)
    expected = quantus_pixel_flipping(net, x, a, net(x).argmax(-1), 12, baseline="black")
    torch.testing.assert_close(curve[..., 1:], expected, rtol=0, atol=1e-6)


def test_equals_its_definition_for_index_targets_and_a_remainder_step():
    net = conv_net()
    x, a = images(2), torch.randn(2, 3, 6, 6, dtype=torch.float64)
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[2])
    target = torch.tensor([3, 1])
    curve = pixel_flipping(net, td, in_keys=["x"], out_keys=["y"], target=target, features_per_step=10, baseline=0.5)
    assert curve.shape == (2, 12)  # 108 features: ten steps of 10 and one of 8
    torch.testing.assert_close(curve, by_definition(net, x, a, target, 10, 0.5), rtol=0, atol=1e-10)
    by_int = pixel_flipping(net, td, in_keys=["x"], out_keys=["y"], target=2, features_per_step=10, baseline=0.5)
    torch.testing.assert_close(by_int, by_definition(net, x, a, [2, 2], 10, 0.5), rtol=0, atol=1e-10)


def test_a_channel_map_ranks_whole_pixels_and_ties_go_to_the_lower_index():
    net = conv_net()
    x = images(2)
    pixel_map = torch.randn(2, 1, 6, 6, dtype=torch.float64)
    pixel_map[:, :, 0, :2] = 5.0  # a tie: pixel (0, 0) before (0, 1)
    td = TensorDict(x=x, attribution=TensorDict(x=pixel_map), batch_size=[2])
    curve = pixel_flipping(net, td, in_keys=["x"], out_keys=["y"])
    assert curve.shape == (2, 37)
    target = net(x).argmax(-1)
    first = x.clone()
    first[:, :, 0, 0] = 0.0
    torch.testing.assert_close(curve[:, 1], net(first)[torch.arange(2), target], rtol=0, atol=1e-12)


def test_keys_concatenate_in_in_keys_order_over_any_batch_shape():
    net = TwoKeys().double()
    u, v = torch.randn(2, 3, 5, dtype=torch.float64), torch.randn(2, 3, 3, dtype=torch.float64)
    au, av = torch.randn(2, 3, 5, dtype=torch.float64), torch.randn(2, 3, 3, dtype=torch.float64)
    td = TensorDict(u=u, v=v, attribution=TensorDict(u=au, v=av), batch_size=[2, 3])
    policy = TensorDictModule(net, in_keys=["u", "v"], out_keys=["q"])
    curve = pixel_flipping(policy, td, features_per_step=3)
    assert curve.shape == (2, 3, 4)

    # The same model on the concatenated features: the curve of one key.
    def joint(w):
        return net(w[..., :5], w[..., 5:])

    single = TensorDict(w=torch.cat([u, v], -1), attribution=TensorDict(w=torch.cat([au, av], -1)), batch_size=[2, 3])
    expected = pixel_flipping(TensorDictModule(joint, in_keys=["w"], out_keys=["q"]), single, features_per_step=3)
    torch.testing.assert_close(curve, expected, rtol=0, atol=1e-12)
    reversed_keys = pixel_flipping(policy, td, in_keys=["v", "u"], features_per_step=3)
    torch.testing.assert_close(reversed_keys[..., [0, -1]], curve[..., [0, -1]], rtol=0, atol=1e-12)


def test_steps_per_forward_changes_only_the_speed():
    net = conv_net()
    x, a = images(3), torch.randn(3, 3, 6, 6, dtype=torch.float64)
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[3])
    curves = [
        pixel_flipping(net, td, in_keys=["x"], out_keys=["y"], features_per_step=4, steps_per_forward=s)
        for s in (None, 1, 5)
    ]
    for curve in curves[1:]:
        torch.testing.assert_close(curve, curves[0], rtol=0, atol=1e-12)


def test_scores_lrp_relevance_and_leaves_everything_as_it_was():
    net = conv_net()
    lrp = LRP(net, in_keys=["x"], out_keys=["y"])
    td = lrp(TensorDict(x=images(2), batch_size=[2]))
    before = td.clone()
    params = [p.clone() for p in net.parameters()]
    rng = torch.get_rng_state()
    curve = pixel_flipping(net, td, in_keys=["x"], out_keys=["y"], relevance_key="relevance", features_per_step=27)
    assert curve.shape == (2, 5)
    assert (td == before).all() and set(td.keys(True, True)) == set(before.keys(True, True))
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), params, strict=True))
    assert torch.equal(torch.get_rng_state(), rng)


def test_errors_name_the_key_and_what_was_expected():
    net = conv_net()
    td = TensorDict(x=images(2), batch_size=[2])
    with pytest.raises(KeyError, match=r"\('attribution', 'x'\).*relevance_key"):
        pixel_flipping(net, td, in_keys=["x"], out_keys=["y"])
    td["attribution", "x"] = torch.zeros(2, 3, 5, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"does not broadcast to input 'x' of shape \[2, 3, 6, 6\]"):
        pixel_flipping(net, td, in_keys=["x"], out_keys=["y"])
    td["attribution", "x"] = torch.zeros(2, 3, 6, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match="baseline of shape \\[4\\] does not broadcast to input 'x'"):
        pixel_flipping(net, td, in_keys=["x"], out_keys=["y"], baseline=torch.zeros(4))
    with pytest.raises(ValueError, match="features_per_step must be a positive int"):
        pixel_flipping(net, td, in_keys=["x"], out_keys=["y"], features_per_step=0)
    with pytest.raises(IndexError, match="metrics: target 7 is out of range for output 'y'"):
        pixel_flipping(net, td, in_keys=["x"], out_keys=["y"], target=7)
    # The wrapper's name was left in it: "LRP: target key 'logits' was not written by the wrapped module".
    with pytest.raises(
        KeyError, match=r"^\"metrics: target key 'logits' was not written .*; its outputs are \['y'\]\"$"
    ):
        pixel_flipping(net, td, in_keys=["x"], out_keys=["y"], target_key="logits")
    with pytest.raises(ValueError, match="target must be None, an int, a LongTensor or a callable"):
        pixel_flipping(net, td, in_keys=["x"], out_keys=["y"], target="all")


def test_nested_keys_a_baseline_dict_a_callable_target_and_no_batch_dimension():
    net = TwoKeys().double()
    policy = TensorDictModule(net, in_keys=[("obs", "u"), ("obs", "v")], out_keys=["q"])
    u, v = torch.randn(5, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    au, av = torch.randn(5, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    td = TensorDict(obs={"u": u, "v": v}, scores={"obs": {"u": au, "v": av}}, batch_size=[])
    baseline = {("obs", "u"): 1.0, ("obs", "v"): torch.full((3,), -1.0, dtype=torch.float64)}

    def softmax_target(out):  # weights resolved once, on the unperturbed output, as the methods do
        return torch.softmax(out, -1) * torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=out.dtype)

    curve = pixel_flipping(policy, td, relevance_key="scores", baseline=baseline, target=softmax_target, progress=True)
    assert curve.shape == (9,)
    w, order = torch.cat([u, v]), torch.cat([au, av]).argsort(descending=True, stable=True)
    fill = torch.tensor([1.0] * 5 + [-1.0] * 3, dtype=torch.float64)
    y = net(u, v).detach()
    weights = softmax_target(y) / y
    expected = [torch.softmax(y, -1)[1]]
    for k in range(1, 9):
        perturbed = w.clone()
        perturbed[order[:k]] = fill[order[:k]]
        expected.append((net(perturbed[:5], perturbed[5:]) * weights).sum().detach())
    torch.testing.assert_close(curve, torch.stack(expected), rtol=0, atol=1e-12)


def test_one_step_per_forward_keeps_the_batch_shape_the_model_needs():
    def per_row(x):  # needs the [B, T, F] layout: a mean over T
        assert x.dim() == 3
        return x.mean(1).sum(-1, keepdim=True).expand(-1, 3).unsqueeze(1).expand(-1, x.shape[1], -1)

    module = TensorDictModule(per_row, in_keys=["x"], out_keys=["y"])
    x = torch.randn(2, 4, 3, dtype=torch.float64)
    td = TensorDict(x=x, attribution=TensorDict(x=torch.randn(2, 4, 3, dtype=torch.float64)), batch_size=[2, 4])
    curve = pixel_flipping(module, td, target=0, steps_per_forward=1)
    assert curve.shape == (2, 4, 4)
    torch.testing.assert_close(curve[..., -1], torch.zeros(2, 4, dtype=torch.float64))


def test_an_unbatched_tensordict_scores_the_argmax_of_a_vector_output():
    torch.manual_seed(3)
    net = torch.nn.Linear(4, 3).double()
    x, a = torch.randn(4).double(), torch.tensor([0.1, 0.4, -0.2, 0.3]).double()
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[])
    curve = pixel_flipping(net, td, in_keys=["x"], out_keys=["y"], features_per_step=2)
    unit = net(x).argmax()
    expected = [
        net(x)[unit],
        net(x * torch.tensor([1.0, 0.0, 1.0, 0.0]).double())[unit],
        net(torch.zeros(4).double())[unit],
    ]
    torch.testing.assert_close(curve, torch.stack(expected).detach(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("batch", [(0,), (2, 0)])
@pytest.mark.parametrize("first", ["linear", "convolution"])
def test_an_empty_batch_gives_empty_curves(batch, first):
    """No sample (the last, empty, slice of a dataset): curves ``batch + [L + 1]`` with nothing in them, through the
    first-layer update and through stacked passes alike."""
    if first == "linear":
        net = torch.nn.Sequential(torch.nn.Linear(48, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3)).double()
        shape = (48,)
    else:
        net, shape = conv_net(size=4, classes=3), (3, 4, 4)
        batch = batch[-1:]
    x, a = torch.randn(*batch, *shape, dtype=torch.float64), torch.randn(*batch, *shape, dtype=torch.float64)
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=batch)
    curve = pixel_flipping(net, td, in_keys=["x"], out_keys=["y"], features_per_step=5)
    assert curve.shape == (*batch, 11) and curve.dtype == torch.float64
    if len(shape) == 3:
        regions = region_perturbation(net, td, patch_size=2, in_keys=["x"], out_keys=["y"])
        assert regions.shape == (*batch, 5)


def test_a_tensordict_of_baselines_with_nested_keys_gives_each_key_its_leaf():
    """A baseline given as a TensorDict of nested keys (one per sample) gives each input key its leaf, as a dict
    keyed by the nested keys does; before, its top-level key was read as the input key and refused."""
    torch.manual_seed(0)
    module = TensorDictModule(torch.nn.Linear(3, 2).double(), in_keys=[("o", "x")], out_keys=["y"])
    x, b = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    td = TensorDict({"o": {"x": x}, "attribution": {"o": {"x": torch.randn(4, 3, dtype=torch.float64)}}}, [4])
    got = pixel_flipping(module, td, baseline=TensorDict({"o": {"x": b}}, batch_size=[4]))
    assert torch.equal(got, pixel_flipping(module, td, baseline={("o", "x"): b}))
    with torch.no_grad():
        assert torch.equal(got[:, -1], module.module(b)[torch.arange(4), module.module(x).argmax(-1)])
