"""infidelity against captum's, given the same perturbations."""

from __future__ import annotations

import copy

import pytest
import torch
from captum.metrics import infidelity as captum_infidelity
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

from tdhook.metrics import infidelity
from tests.metrics._models import TwoKeys, conv_net, images


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize(("batch", "n"), [(1, 3), (6, 7)])
def test_equals_captum_over_two_keys(normalize, batch, n):
    net = TwoKeys().double()
    u, v = torch.randn(batch, 5, dtype=torch.float64), torch.randn(batch, 3, dtype=torch.float64)
    au, av = torch.randn(batch, 5, dtype=torch.float64), torch.randn(batch, 3, dtype=torch.float64)
    noise_u, noise_v = torch.randn(batch * n, 5, dtype=torch.float64), torch.randn(batch * n, 3, dtype=torch.float64)
    target = net(u, v).argmax(-1)

    def captum_perturb(inputs):
        return (noise_u, noise_v), (inputs[0] - noise_u, inputs[1] - noise_v)

    def perturb(repeated):
        assert repeated.batch_size == torch.Size([batch, n])
        noise = TensorDict(u=noise_u.view(batch, n, 5), v=noise_v.view(batch, n, 3), batch_size=[batch, n])
        return noise, repeated - noise

    expected = captum_infidelity(
        net, captum_perturb, (u, v), (au, av), target=target, n_perturb_samples=n, normalize=normalize
    )
    td = TensorDict(u=u, v=v, attribution=TensorDict(u=au, v=av), batch_size=[batch])
    policy = TensorDictModule(net, in_keys=["u", "v"], out_keys=["q"])
    ours = infidelity(policy, td, perturb_fn=perturb, n_perturb_samples=n, normalize=normalize)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)


def test_equals_captum_on_images_with_a_pixel_map_and_an_index_target():
    net = conv_net()
    x, pixel_map, n = images(3), torch.randn(3, 1, 6, 6, dtype=torch.float64), 4
    masks = (torch.rand(3 * n, 3, 6, 6) < 0.3).double()
    target = torch.tensor([0, 4, 2])

    def captum_perturb(inputs):
        return masks, inputs * (1 - masks)

    def perturb(repeated):
        m = masks.view(3, n, 3, 6, 6)
        return TensorDict(x=m, batch_size=[3, n]), TensorDict(x=repeated["x"] * (1 - m), batch_size=[3, n])

    expected = captum_infidelity(
        net, captum_perturb, x, pixel_map.expand(3, 3, 6, 6), target=target, n_perturb_samples=n
    )
    td = TensorDict(x=x, attribution=TensorDict(x=pixel_map), batch_size=[3])
    ours = infidelity(net, td, perturb_fn=perturb, n_perturb_samples=n, target=target, in_keys=["x"], out_keys=["y"])
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)


def test_a_bad_perturb_fn_is_named():
    net = conv_net()
    td = TensorDict(x=images(2), attribution=TensorDict(x=torch.zeros(2, 3, 6, 6)), batch_size=[2])
    with pytest.raises(TypeError, match="must return a tuple \\(perturbation, perturbed\\)"):
        infidelity(net, td, perturb_fn=lambda r: r, in_keys=["x"], out_keys=["y"])
    with pytest.raises(ValueError, match=r"perturbation at 'x' must be shaped like the repeated input \[2, 10, 3, 6,"):
        infidelity(net, td, perturb_fn=lambda r: (r[:, :1], r), in_keys=["x"], out_keys=["y"])


def test_inputs_that_require_grad_give_gaps_that_do_not():
    """The repeated inputs given to ``perturb_fn`` are out of the caller's graph: a perturbation built from them (here
    the input itself) leaves no graph in the result."""
    net = torch.nn.Linear(6, 2).double()
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    td = TensorDict(x=x, attribution=TensorDict(x=2 * x), batch_size=[3])
    gaps = infidelity(
        net, td, perturb_fn=lambda r: (r, r.apply(torch.zeros_like)), n_perturb_samples=2, in_keys=["x"], out_keys=["y"]
    )
    assert not gaps.requires_grad


def test_a_float16_model_over_many_draws_sums_in_float32():
    """A perfect attribution of a linear float16 model: with 300 draws the sum of squared dot products (near 15
    each) overflowed float16, and the normalised infidelity was NaN instead of about 0."""
    torch.manual_seed(0)
    net = torch.nn.Linear(64, 1, bias=False).half()
    with torch.no_grad():
        net.weight.fill_(0.5)
    x = (torch.rand(2, 64) * 2).half()
    td = TensorDict(x=x, attribution=TensorDict(x=x * net.weight.detach()), batch_size=[2])
    generator = torch.Generator().manual_seed(0)

    def drop_half(repeated):
        mask = (torch.rand(repeated["x"].shape, generator=generator) < 0.5).half()
        return repeated.apply(lambda v: mask), repeated.apply(lambda v: v * (1 - mask))

    gaps = infidelity(
        net, td, perturb_fn=drop_half, n_perturb_samples=300, normalize=True, in_keys=["x"], out_keys=["y"]
    )
    assert gaps.dtype == torch.float16
    assert bool((gaps.abs() < 1e-3).all())


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        (
            {"perturb_fn": lambda r: (1, r)},
            TypeError,
            "infidelity: perturb_fn must return perturbation as a TensorDict, got int",
        ),
        (
            {"perturb_fn": lambda r: (TensorDict(batch_size=r.batch_size), r)},
            KeyError,
            "infidelity: the perturbation returned by perturb_fn has no key 'x'",
        ),
        (
            {"perturb_fn": lambda r: (r, r), "n_perturb_samples": 0},
            ValueError,
            "n_perturb_samples must be a positive int, got 0",
        ),
    ],
    ids=["not-a-tensordict", "missing-key", "no-samples"],
)
def test_a_failed_call_leaves_model_data_and_random_state_as_they_were(options, error, match):
    """On a model normalising over the batch (BatchNorm in training mode): the statistics, the caller's TensorDict
    and the global random state are as before, and the next call is a fresh model's."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    net = net.double().train()
    twin = copy.deepcopy(net)
    td = TensorDict(x=torch.randn(4, 6, dtype=torch.float64), batch_size=[4])
    td["attribution"] = TensorDict(x=torch.randn(4, 6, dtype=torch.float64), batch_size=[4])
    entries = {k: v for k, v in td.items(True, True)}
    buffers, rng = {k: b.clone() for k, b in net.named_buffers()}, torch.get_rng_state()
    with pytest.raises(error, match=match):
        infidelity(net, td, in_keys=["x"], out_keys=["y"], **options)
    assert all(torch.equal(net.get_buffer(k), b) for k, b in buffers.items())
    assert torch.equal(torch.get_rng_state(), rng) and net.training
    assert dict(td.items(True, True)).keys() == entries.keys() and all(td.get(k) is v for k, v in entries.items())

    def perturb(repeated):
        noise = torch.randn(repeated.batch_size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        noise = TensorDict(x=noise.unsqueeze(-1).expand(*repeated.batch_size, 6), batch_size=repeated.batch_size)
        return noise, repeated - noise

    score = infidelity(net, td, perturb_fn=perturb, n_perturb_samples=3, in_keys=["x"], out_keys=["y"])
    expected = infidelity(twin, td, perturb_fn=perturb, n_perturb_samples=3, in_keys=["x"], out_keys=["y"])
    torch.testing.assert_close(score, expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("normalize", ["False", 1, None])
def test_normalize_that_is_no_bool_is_refused_by_name(normalize):
    net = conv_net()
    td = TensorDict(x=images(2), attribution=TensorDict(x=torch.zeros(2, 3, 6, 6)), batch_size=[2])
    with pytest.raises(TypeError, match="infidelity: normalize must be True or False, got"):
        infidelity(net, td, perturb_fn=lambda r: (r, r), normalize=normalize, in_keys=["x"], out_keys=["y"])
