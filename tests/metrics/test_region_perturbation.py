"""region_perturbation against Quantus' RegionPerturbation and against its definition."""

from __future__ import annotations

import itertools

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.metrics import region_perturbation
from tdhook.metrics.region_perturbation import patch_grid
from tests.metrics._models import conv_net, images, quantus_scores

quantus = pytest.importorskip("quantus")


def quantus_region_perturbation(net, x, a, y, patch_size, order, n_regions):
    metric = quantus.RegionPerturbation(
        patch_size=patch_size,
        order=order,
        regions_evaluation=n_regions,
        perturb_baseline=0.0,
        normalise=False,
        abs=False,
        disable_warnings=True,
        display_progressbar=False,
    )
    return quantus_scores(metric, net, x, a, y, device="cpu")


@pytest.mark.parametrize("order", ["morf", "lerf"])
@pytest.mark.parametrize(("size", "patch_size", "n_regions"), [(6, 2, 9), (6, 4, None), (7, 3, 5), (6, 1, 20)])
def test_equals_quantus_as_drops(order, size, patch_size, n_regions):
    net = conv_net(size=size)
    x, a = images(3, size=size), torch.randn(3, 3, size, size, dtype=torch.float64)
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[3])
    curve = region_perturbation(
        net, td, patch_size=patch_size, order=order, n_regions=n_regions, in_keys=["x"], out_keys=["y"]
    )
    n_patches = (-(-size // patch_size)) ** 2
    assert curve.shape == (3, (n_regions or n_patches) + 1)
    expected = quantus_region_perturbation(net, x, a, net(x).argmax(-1), patch_size, order, n_regions or n_patches)
    torch.testing.assert_close(curve[..., :1] - curve[..., 1:], expected, rtol=0, atol=1e-6)


def test_a_pixel_map_ranks_patches_by_its_sum_across_channels():
    net = conv_net(size=4)
    x = images(1, size=4)
    pixel_map = torch.zeros(1, 1, 4, 4, dtype=torch.float64)
    pixel_map[0, 0, 2, 3] = 1.0  # the bottom-right patch is the most relevant
    pixel_map[0, 0, 0, 0] = -1.0  # the top-left one the least
    td = TensorDict(x=x, attribution=TensorDict(x=pixel_map), batch_size=[1])
    target = net(x).argmax(-1)
    morf = region_perturbation(net, td, patch_size=2, n_regions=1, in_keys=["x"], out_keys=["y"])
    lerf = region_perturbation(net, td, patch_size=2, n_regions=1, order="lerf", in_keys=["x"], out_keys=["y"])
    bottom_right, top_left = x.clone(), x.clone()
    bottom_right[..., 2:, 2:] = 0.0
    top_left[..., :2, :2] = 0.0
    torch.testing.assert_close(morf[:, 1], net(bottom_right)[0, target], rtol=0, atol=1e-12)
    torch.testing.assert_close(lerf[:, 1], net(top_left)[0, target], rtol=0, atol=1e-12)


def test_patches_of_several_keys_rank_together():
    def model(p, q):
        return torch.stack([p.sum((1, 2, 3)) + 2 * q.sum((1, 2, 3)), p.sum((1, 2, 3))], -1)

    module = TensorDictModule(model, in_keys=["p", "q"], out_keys=["y"])
    p, q = torch.ones(1, 1, 2, 2, dtype=torch.float64), torch.ones(1, 2, 2, 4, dtype=torch.float64)
    ap = torch.tensor([[[[3.0, 0.0], [0.0, 0.0]]]], dtype=torch.float64)
    aq = torch.zeros(1, 2, 2, 4, dtype=torch.float64)
    aq[0, 0, 0, 3] = 2.0  # the right patch of q: 2, the left one: 0, p's only patch: 3
    td = TensorDict(p=p, q=q, attribution=TensorDict(p=ap, q=aq), batch_size=[1])
    curve = region_perturbation(module, td, patch_size=2, target=0)
    # p's patch (score -4), then q's right patch (-2 * 8), then q's left one (-2 * 8)
    torch.testing.assert_close(curve, torch.tensor([[36.0, 32.0, 16.0, 0.0]], dtype=torch.float64))


def test_patch_grid_splits_the_shortfall_as_the_border_patches():
    assert patch_grid(5, 5, 2).tolist()[0] == [0, 0, 1, 1, 2]  # shortfall 1: none before, 1 after
    assert patch_grid(5, 5, 2)[:, 0].tolist() == [0, 0, 3, 3, 6]
    assert patch_grid(7, 7, 3).tolist()[0] == [0, 0, 1, 1, 1, 2, 2]  # shortfall 2: one padded row on each side
    assert patch_grid(4, 4, 4).unique().tolist() == [0]


def test_errors_name_the_key_and_what_was_expected():
    net = conv_net()
    td = TensorDict(x=images(1), attribution=TensorDict(x=torch.zeros(1, 3, 6, 6)), batch_size=[1])
    with pytest.raises(ValueError, match=r"n_regions must be an int in \[1, 9\], got 10"):
        region_perturbation(net, td, patch_size=2, n_regions=10, in_keys=["x"], out_keys=["y"])
    with pytest.raises(ValueError, match="order must be 'morf' or 'lerf'"):
        region_perturbation(net, td, patch_size=2, order="random", in_keys=["x"], out_keys=["y"])
    with pytest.raises(ValueError, match="patch_size must be a positive int"):
        region_perturbation(net, td, patch_size=0, in_keys=["x"], out_keys=["y"])
    flat = TensorDict(v=torch.ones(1, 4), attribution=TensorDict(v=torch.ones(1, 4)), batch_size=[1])
    with pytest.raises(ValueError, match=r"input 'v' of shape \[1, 4\] needs two dimensions after the batch"):
        region_perturbation(torch.nn.Linear(4, 2), flat, patch_size=2, in_keys=["v"], out_keys=["y"])


def test_a_patch_summing_to_nan_is_refused_by_name():
    """+inf and -inf in one patch sum to NaN, which the sort put first in most-relevant-first order (Quantus last)."""
    net = conv_net(size=4)
    a = torch.randn(1, 3, 4, 4, dtype=torch.float64)
    a[0, 0, 3, 3], a[0, 1, 3, 2] = float("inf"), -float("inf")
    td = TensorDict(x=images(1, size=4), attribution=TensorDict(x=a), batch_size=[1])
    with pytest.raises(ValueError, match=r"attribution of 'x' sums to NaN over a patch \(sample and patch \(0, 3\)"):
        region_perturbation(net, td, patch_size=2, in_keys=["x"], out_keys=["y"])
    a[0, 1, 3, 2] = 0.0  # one infinite feature ranks its patch first
    morf = region_perturbation(net, td, patch_size=2, n_regions=1, in_keys=["x"], out_keys=["y"])
    perturbed = td["x"].clone()
    perturbed[..., 2:, 2:] = 0.0
    target = net(td["x"]).argmax(-1)
    torch.testing.assert_close(morf[:, 1], net(perturbed)[0, target], rtol=0, atol=1e-12)


def by_definition(net, x, a, patch_size, order, n_regions, baseline):
    """One sample at a time: the patches of :func:`patch_grid` ranked by their attribution summed over the channels,
    ties to the lower patch, set to the baseline one after the other."""
    grid = patch_grid(*x.shape[-2:], patch_size)
    n_patches = int(grid.max()) + 1
    full = a.expand_as(x)
    output = net(x)
    rows = []
    for xi, ai, yi, ti in zip(x, full, output, output.argmax(-1), strict=True):
        sums = [ai[:, grid == p].sum().item() for p in range(n_patches)]
        ranked = sorted(range(n_patches), key=lambda p: (-sums[p] if order == "morf" else sums[p], p))
        current, row = xi.clone(), [yi[ti]]
        for p in ranked[:n_regions]:
            current[:, grid == p] = baseline
            row.append(net(current[None])[0, ti])
        rows.append(torch.stack(row))
    return torch.stack(rows)


@pytest.mark.parametrize(("height", "width", "patch_size"), [(5, 7, 2), (6, 9, 4), (7, 5, 3), (4, 9, 5), (5, 5, 7)])
@pytest.mark.parametrize("attribution", ["full", "pixel map", "ties"])
@pytest.mark.parametrize("model", ["conv", "mlp"])
def test_planes_that_are_not_square_with_patches_that_do_not_divide(height, width, patch_size, attribution, model):
    """Against Quantus where the ranking has no ties (its unstable argsort orders tied patches its own way), and
    against the definition always; the mlp takes the path that updates its first layer step by step."""
    torch.manual_seed(height * width + patch_size)
    if model == "conv":
        layers = [nn.Conv2d(3, 2, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(2 * height * width, 5)]
    else:
        layers = [nn.Flatten(), nn.Linear(3 * height * width, 6), nn.ReLU(), nn.Linear(6, 5)]
    net = nn.Sequential(*layers).double().eval()
    x = torch.randn(3, 3, height, width).double()  # exact in float32, which Quantus feeds the model
    a = {
        "full": torch.randn(3, 3, height, width).double(),
        "pixel map": torch.randn(3, 1, height, width).double(),
        "ties": torch.randint(0, 2, (3, 3, height, width)).double(),
    }[attribution]
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[3])
    n_patches = -(-height // patch_size) * -(-width // patch_size)
    n_regions = min(n_patches, 4)
    for order in ("morf", "lerf"):
        curve = region_perturbation(
            net,
            td,
            patch_size=patch_size,
            order=order,
            n_regions=n_regions,
            in_keys=["x"],
            out_keys=["y"],
            baseline=0.0,
        )
        expected = by_definition(net, x, a, patch_size, order, n_regions, 0.0)
        torch.testing.assert_close(curve, expected, rtol=0, atol=1e-12)
        if attribution != "ties":
            quantus_drops = quantus_region_perturbation(net, x, a, net(x).argmax(-1), patch_size, order, n_regions)
            torch.testing.assert_close(curve[..., :1] - curve[..., 1:], quantus_drops, rtol=0, atol=1e-6)


@pytest.mark.parametrize("order", ["morf", "lerf"])
def test_two_keys_of_other_planes_on_a_batch_of_two_dimensions(order):
    """Patches of a ``[2, 5, 3]`` and a ``[1, 3, 7]`` key ranked together, pixel maps for both, a ``[2, 3]`` batch and
    an index target, against the definition sample by sample."""

    def model(p, q):
        return torch.stack(
            [(p**2).sum((-1, -2, -3)) + torch.sin(q).sum((-1, -2, -3)), p.sum((-1, -2, -3)) * q.mean((-1, -2, -3))], -1
        )

    torch.manual_seed(4)
    module = TensorDictModule(model, in_keys=["p", "q"], out_keys=["y"])
    p, q = torch.randn(2, 3, 2, 5, 3, dtype=torch.float64), torch.randn(2, 3, 1, 3, 7, dtype=torch.float64)
    ap, aq = torch.randn(2, 3, 1, 5, 3, dtype=torch.float64), torch.randn(2, 3, 1, 3, 7, dtype=torch.float64)
    attributions = TensorDict(p=ap, q=aq, batch_size=[2, 3])
    td = TensorDict(p=p, q=q, attribution=attributions, batch_size=[2, 3])
    curve = region_perturbation(module, td, patch_size=2, order=order, n_regions=7, target=1, baseline=0.25)
    grids = {"p": patch_grid(5, 3, 2), "q": patch_grid(3, 7, 2)}
    patches = [("p", k) for k in range(int(grids["p"].max()) + 1)] + [
        ("q", k) for k in range(int(grids["q"].max()) + 1)
    ]
    expected = torch.zeros(2, 3, 8, dtype=torch.float64)
    for i, j in itertools.product(range(2), range(3)):
        inputs = {"p": p[i, j].clone(), "q": q[i, j].clone()}
        maps = {"p": ap[i, j].expand_as(inputs["p"]), "q": aq[i, j]}
        sums = [maps[key][:, grids[key] == k].sum().item() for key, k in patches]
        ranked = sorted(range(len(patches)), key=lambda n: (-sums[n] if order == "morf" else sums[n], n))
        expected[i, j, 0] = model(**inputs)[1]
        for step, n in enumerate(ranked[:7]):
            key, k = patches[n]
            inputs[key][:, grids[key] == k] = 0.25
            expected[i, j, step + 1] = model(**inputs)[1]
    torch.testing.assert_close(curve, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_attributions_rank_patches_by_their_sums_in_float32(dtype):
    """Two 2x2 patches of finite float16 attributions: the left sums to 120000, the right to 130000, so the right
    goes first. Summed in float16 both were inf, a tie that went to the left patch (step 1 was 0.024 where the
    right patch first gives 1.139); they are summed in float32 and ranked as the float32 attributions are."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(8, 3)).eval()
    x = torch.randn(1, 1, 2, 4)
    a = torch.tensor([[[[30000.0, 30000.0, 65000.0, 0.0], [30000.0, 30000.0, 65000.0, 0.0]]]])
    curve = {
        d: region_perturbation(
            net,
            TensorDict(x=x, attribution=TensorDict(x=a.to(d)), batch_size=[1]),
            in_keys=["x"],
            out_keys=["y"],
            patch_size=2,
        )
        for d in (torch.float32, dtype)
    }
    torch.testing.assert_close(curve[dtype], curve[torch.float32], rtol=0, atol=0)
    right_first = net(torch.where(torch.arange(4) >= 2, 0.0, x))[0, net(x)[0].argmax()]
    torch.testing.assert_close(curve[dtype][0, 1], right_first.detach(), rtol=0, atol=0)
