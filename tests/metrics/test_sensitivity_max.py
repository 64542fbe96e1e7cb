"""sensitivity_max against captum's, given the same perturbations."""

from __future__ import annotations

import pytest
import torch
from captum.attr import InputXGradient
from captum.metrics import sensitivity_max as captum_sensitivity_max
from tensordict import TensorDict

from tdhook.attribution import LRP, GradientShap, SmoothGrad
from tdhook.attribution import InputXGradient as tdhook_input_x_gradient
from tdhook.attribution import Saliency as tdhook_saliency
from tdhook.metrics import sensitivity_max
from tests.attribution.methods._transformers import image_pairs, similarity
from tests.metrics._models import Trajectory, TwoKeys, conv_net, images


@pytest.mark.parametrize(("batch", "n"), [(1, 4), (5, 6)])
def test_equals_captum_over_two_keys_with_lrp_as_gradient_times_input(batch, n):
    net = TwoKeys().double()
    u, v = torch.randn(batch, 5, dtype=torch.float64), torch.randn(batch, 3, dtype=torch.float64)
    noise_u = torch.rand(batch * n, 5, dtype=torch.float64) * 0.2 - 0.1
    noise_v = torch.rand(batch * n, 3, dtype=torch.float64) * 0.2 - 0.1

    def captum_perturb(inputs, radius):
        return inputs[0] + noise_u, inputs[1] + noise_v

    def perturb(repeated, radius):
        assert radius == 0.1 and repeated.batch_size == torch.Size([batch, n])
        noise = TensorDict(u=noise_u.view(batch, n, 5), v=noise_v.view(batch, n, 3), batch_size=[batch, n])
        return repeated + noise

    target = net(u, v).argmax(-1)
    expected = captum_sensitivity_max(
        InputXGradient(net).attribute,
        (u, v),
        perturb_func=captum_perturb,
        perturb_radius=0.1,
        n_perturb_samples=n,
        target=target,
    )
    lrp = LRP(net, in_keys=["u", "v"], out_keys=["q"])  # LRP-0 on Linear and ReLU: gradient x input
    td = TensorDict(u=u, v=v, batch_size=[batch])
    ours = sensitivity_max(lrp, td, perturb_fn=perturb, perturb_radius=0.1, n_perturb_samples=n)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)
    assert lrp.target is None and set(td.keys()) == {"u", "v"}


@pytest.mark.parametrize("method", ["InputXGradient", "LRP"])
def test_target_all_compares_every_units_attributions_as_captum_does(method):
    """``target="all"`` gives each sample an attribution per output unit: the norm runs over all of them, as captum's
    sensitivity_max flattens each example's explanation (per-unit gradient x input stacked). A broadcast error
    before."""
    batch, n = 3, 4
    net = TwoKeys().double()
    u, v = torch.randn(batch, 5, dtype=torch.float64), torch.randn(batch, 3, dtype=torch.float64)
    noise_u = torch.rand(batch * n, 5, dtype=torch.float64) * 0.2 - 0.1
    noise_v = torch.rand(batch * n, 3, dtype=torch.float64) * 0.2 - 0.1

    def every_unit(inputs):
        per_unit = [InputXGradient(net).attribute(inputs, target=unit) for unit in range(4)]
        return tuple(torch.stack(parts, dim=1) for parts in zip(*per_unit, strict=True))

    def perturb(repeated, radius):
        noise = TensorDict(u=noise_u.view(batch, n, 5), v=noise_v.view(batch, n, 3), batch_size=[batch, n])
        return repeated + noise

    expected = captum_sensitivity_max(
        every_unit,
        (u, v),
        perturb_func=lambda inputs, radius: (inputs[0] + noise_u, inputs[1] + noise_v),
        perturb_radius=0.1,
        n_perturb_samples=n,
    )
    if method == "LRP":  # LRP-0 on Linear and ReLU: gradient x input
        wrapper = LRP(net, in_keys=["u", "v"], out_keys=["q"], target="all")
    else:
        wrapper = tdhook_input_x_gradient(net, in_keys=["u", "v"], out_keys=["q"], target="all")
    td = TensorDict(u=u, v=v, batch_size=[batch])
    ours = sensitivity_max(wrapper, td, perturb_fn=perturb, perturb_radius=0.1, n_perturb_samples=n)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)
    assert wrapper.target == "all" and set(td.keys()) == {"u", "v"}


def test_the_default_noise_stays_in_the_ball_follows_the_seed_and_leaves_the_global_rng():
    net = conv_net()
    lrp = LRP(net, in_keys=["x"], out_keys=["y"], relevance_key="attribution")
    td = TensorDict(x=images(3), batch_size=[3])
    rng = torch.get_rng_state()
    first = sensitivity_max(lrp, td, seed=0, perturb_radius=1e-3)
    assert torch.equal(torch.get_rng_state(), rng)
    torch.testing.assert_close(first, sensitivity_max(lrp, td, seed=0, perturb_radius=1e-3), rtol=0, atol=1e-12)
    assert first.shape == (3,) and (first >= 0).all()
    seen = []

    def spy(repeated, radius):
        perturbed = repeated.apply(lambda x: x + radius)
        seen.append(perturbed["x"] - repeated["x"])
        return perturbed

    sensitivity_max(lrp, td, perturb_fn=spy, perturb_radius=0.5, n_perturb_samples=2)
    assert torch.allclose(seen[0], torch.full_like(seen[0], 0.5))
    assert sensitivity_max(lrp, td, perturb_radius=0.0, n_perturb_samples=2, seed=1).abs().max() < 1e-12


@pytest.mark.parametrize("name", ["SmoothGrad", "GradientShap"])
def test_a_seeded_sampling_method_at_radius_zero_scores_zero(name):
    """sensitivity_max stacks the perturbed copies into a larger batch: a seeded method's draws must not depend on
    the batch, or its explanation of an unperturbed copy differs from the original (0.08 to 1.47 before)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()
    td = TensorDict(x=torch.randn(4, 3, dtype=torch.float64), batch_size=[4])
    if name == "SmoothGrad":
        method = SmoothGrad(net, in_keys=["x"], out_keys=["y"], n_samples=8, stdev=0.3, seed=0)
    else:
        baselines = torch.randn(5, 3, dtype=torch.float64)
        method = GradientShap(net, in_keys=["x"], out_keys=["y"], baselines=baselines, n_samples=8, seed=0)
    assert sensitivity_max(method, td, perturb_radius=0.0, seed=0).abs().max() < 1e-12


def test_a_plain_model_is_refused():
    with pytest.raises(TypeError, match="method must be an attribution wrapper"):
        sensitivity_max(torch.nn.Linear(3, 2), TensorDict(x=torch.ones(2, 3), batch_size=[2]))


def test_a_sequence_batch_keeps_its_time_dimension_in_the_perturbed_calls():
    """A ``[B, T]`` batch through a model that attends over ``T``: each perturbed copy must reach the method as a
    ``[B, T]`` batch (stacked along ``B``), and the result equals one call of the method per copy."""
    torch.manual_seed(4)
    encoder = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), encoder, torch.nn.Linear(8, 3)).double().eval()
    method = tdhook_input_x_gradient(net, in_keys=["x"], out_keys=["y"])
    td = TensorDict(x=torch.randn(2, 5, 4, dtype=torch.float64), batch_size=[2, 5])
    noise = torch.rand(2, 5, 3, 4, dtype=torch.float64) * 0.2 - 0.1

    def perturb(repeated, radius):
        return TensorDict(x=repeated["x"] + noise, batch_size=repeated.batch_size)

    ours = sensitivity_max(method, td, perturb_fn=perturb, n_perturb_samples=3)
    reference = method(td.clone())
    target = reference["y"].argmax(-1)
    method.target = target
    changes = []
    for i in range(3):
        copy = method(TensorDict(x=td["x"] + noise[:, :, i], batch_size=[2, 5]))
        changes.append((copy["attribution", "x"] - reference["attribution", "x"]).norm(dim=-1))
    expected = torch.stack(changes, -1).amax(-1) / reference["attribution", "x"].norm(dim=-1)
    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=0)


def test_a_model_normalising_over_the_batch_explains_each_perturbed_copy_alone():
    """BatchNorm without running statistics normalises each call by its batch: the copies stacked in one call
    would change each other's explanations, so each copy is explained as the batch it is."""
    torch.manual_seed(5)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3),
        torch.nn.BatchNorm2d(4, track_running_stats=False),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(16, 3),
    ).double()
    method = tdhook_input_x_gradient(net, in_keys=["x"], out_keys=["y"])
    td = TensorDict(x=torch.randn(3, 3, 4, 4, dtype=torch.float64), batch_size=[3])
    noise = torch.rand(3, 4, 3, 4, 4, dtype=torch.float64) * 0.2 - 0.1

    def perturb(repeated, radius):
        return TensorDict(x=repeated["x"] + noise, batch_size=repeated.batch_size)

    ours = sensitivity_max(method, td, perturb_fn=perturb, n_perturb_samples=4)
    reference = method(td.clone())
    method.target = reference["y"].argmax(-1)
    changes = []
    for i in range(4):
        copy = method(TensorDict(x=td["x"] + noise[:, i], batch_size=[3]))
        changes.append((copy["attribution", "x"] - reference["attribution", "x"]).flatten(1).norm(dim=-1))
    expected = torch.stack(changes, -1).amax(-1) / reference["attribution", "x"].flatten(1).norm(dim=-1)
    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=0)


def test_lrp_on_a_recurrent_policy_is_scored_on_the_keys_it_explains():
    """LRP leaves out ``is_init`` and the recurrent states the TensorDict does not hold; so does the metric."""
    from tensordict.nn import TensorDictModule, TensorDictSequential
    from torchrl.modules import MLP, GRUModule

    torch.manual_seed(0)
    rnn = GRUModule(input_size=4, hidden_size=6, in_key="observation", out_key="embed").double()
    head = TensorDictModule(MLP(in_features=6, out_features=3, num_cells=[8]).double(), ["embed"], ["action_value"])
    lrp = LRP(TensorDictSequential(rnn, head))
    td = TensorDict(
        observation=torch.randn(5, 4, dtype=torch.float64), is_init=torch.zeros(5, 1, dtype=torch.bool), batch_size=[5]
    )
    by_default = sensitivity_max(lrp, td, n_perturb_samples=3, seed=0)
    by_name = sensitivity_max(lrp, td, n_perturb_samples=3, seed=0, in_keys=["observation"])
    torch.testing.assert_close(by_default, by_name)


@pytest.mark.parametrize("batch", [(3,), (2, 3)])
@pytest.mark.parametrize("name", ["IntegratedGradients", "Occlusion", "FeatureAblation", "ShapleyValueSampling"])
def test_per_sample_baselines_and_masks_go_with_each_perturbed_copy(name, batch):
    """A baseline or feature mask with the batch's shape holds one value per sample: every perturbed copy of a
    sample is explained with that sample's."""
    from tdhook import attribution

    torch.manual_seed(2)
    net = TwoKeys().double()
    u, v = torch.randn(*batch, 5, dtype=torch.float64), torch.randn(*batch, 3, dtype=torch.float64)
    options = {
        "IntegratedGradients": {"baselines": {"u": u.amin(-1, keepdim=True), "v": 0.5}, "n_steps": 8},
        "Occlusion": {"sliding_window_shapes": (2,), "baselines": torch.randn(*batch, 1, dtype=torch.float64)},
        "FeatureAblation": {"feature_masks": {"u": torch.randint(0, 3, (*batch, 5)), "v": None}},
        "ShapleyValueSampling": {
            "feature_masks": torch.randint(0, 2, (*batch, 1)),
            "baselines": {"u": torch.randn(*batch, 5, dtype=torch.float64), "v": 0.0},
            "n_samples": 4,
            "seed": 0,
        },
    }[name]
    method = getattr(attribution, name)(net, in_keys=["u", "v"], out_keys=["q"], **options)
    td = TensorDict(u=u, v=v, batch_size=batch)
    noise = TensorDict(
        u=torch.rand(*batch, 4, 5, dtype=torch.float64) * 0.2 - 0.1,
        v=torch.rand(*batch, 4, 3, dtype=torch.float64) * 0.2 - 0.1,
        batch_size=[*batch, 4],
    )

    given = {name: getattr(method, name) for name in ("baselines", "feature_masks") if hasattr(method, name)}
    ours = sensitivity_max(method, td, perturb_fn=lambda repeated, radius: repeated + noise, n_perturb_samples=4)
    assert all(getattr(method, name) is value for name, value in given.items())
    reference = method(td.clone())
    flat = lambda out: torch.cat([out["attribution", k].flatten(len(batch)) for k in ("u", "v")], -1)  # noqa: E731
    method.target = reference["q"].argmax(-1)
    changes = [(flat(method(td.clone() + noise[(Ellipsis, i)])) - flat(reference)).norm(dim=-1) for i in range(4)]
    expected = torch.stack(changes, -1).amax(-1) / flat(reference).norm(dim=-1)
    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=0)


def test_a_tensordict_of_per_sample_baselines_with_nested_keys_is_repeated_for_the_perturbed_copies():
    """A method's baselines given as a TensorDict of nested keys, one per sample of a ``[2, 3]`` batch, are read by
    their leaves and repeated for the perturbed copies, as a dict keyed by the nested keys is; before, the method
    refused the TensorDict's top-level key."""
    from tensordict.nn import TensorDictModule

    from tdhook.attribution import IntegratedGradients

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()
    module = TensorDictModule(net, in_keys=[("o", "x")], out_keys=["y"])
    x, b = torch.randn(2, 3, 3, dtype=torch.float64), torch.randn(2, 3, 3, dtype=torch.float64)
    td = TensorDict({"o": {"x": x}}, batch_size=[2, 3])
    nested = TensorDict({"o": {"x": b}}, batch_size=[2, 3])
    got = sensitivity_max(IntegratedGradients(module, baselines=nested, n_steps=5), td, seed=0)
    expected = sensitivity_max(IntegratedGradients(module, baselines={("o", "x"): b}, n_steps=5), td, seed=0)
    assert got.shape == (2, 3) and torch.equal(got, expected)


@pytest.mark.parametrize("wrapper", ["IntegratedGradients", "LRP"])
def test_a_trajectory_read_as_time_is_explained_one_copy_per_call(wrapper):
    """A TensorDict of one trajectory ``[6]`` fed to a plain GRU, which reads the batch's dimension as time: the
    perturbed copies, stacked in one call of the method, ran as one sequence (each copy from the state the one
    before it left): IntegratedGradients' 0.018 off (22% relative), LRP's 2.3 (of 2.5). The stacked call's time
    lengths show it, and each copy is explained in a call of its own: the definition, written out."""
    from tdhook.attribution import IntegratedGradients
    from tdhook.metrics._random import generator

    net = Trajectory().double()
    x = torch.randn(6, 3, dtype=torch.float64)
    if wrapper == "LRP":
        method, key = LRP(net, in_keys=["x"], out_keys=["y"], target=0), "relevance"
    else:
        method, key = IntegratedGradients(net, in_keys=["x"], out_keys=["y"], target=0, n_steps=8), "attribution"
    got = sensitivity_max(method, TensorDict(x=x, batch_size=[6]), seed=0, n_perturb_samples=4, perturb_radius=0.2)
    noise = torch.rand(6, 4, 3, generator=generator(0), dtype=torch.float64) * 2 - 1  # the default noise's draws
    original = method(TensorDict(x=x, batch_size=[6]))[key, "x"]
    changes = []
    for i in range(4):
        perturbed = method(TensorDict(x=x + 0.2 * noise[:, i], batch_size=[6]))[key, "x"]
        changes.append((perturbed - original).norm(dim=-1) / original.norm(dim=-1))
    torch.testing.assert_close(got, torch.stack(changes, -1).amax(-1), rtol=0, atol=1e-12)


def test_similarities_scored_across_stacked_copies_explain_each_copy_alone():
    """A model returning the ``[B, B]`` similarities of two batches of images (as CLIP's ``logits_per_image``) returns
    ``[n * B, n * B]`` for ``n`` stacked copies, and the explained target (each image's best match, held at the
    original index) picked the first copy's images for every copy: 2.79 where each copy alone gives 0.050. The
    stacked call shows it, and each copy is explained alone, as the definition has it."""
    module, td = similarity(), image_pairs()
    draws = torch.Generator().manual_seed(3)
    noise = {key: (torch.rand(3, 4, 3, 8, 8, dtype=torch.float64, generator=draws) * 2 - 1) * 0.1 for key in "ab"}
    saliency = tdhook_saliency(module, in_keys=["a", "b"])
    added = TensorDict(noise, batch_size=[3, 4])
    found = sensitivity_max(saliency, td, perturb_fn=lambda repeated, radius: repeated + added, n_perturb_samples=4)

    def flat(result):
        return torch.cat([result["attribution", key].flatten(1) for key in "ab"], 1)

    reference = flat(saliency(td.clone()))
    saliency.target = module(td.clone())["similarity"].argmax(-1)
    expected = torch.zeros(3, dtype=torch.float64)
    for k in range(4):
        copy = TensorDict({key: td[key] + noise[key][:, k] for key in "ab"}, batch_size=[3])
        change = (flat(saliency(copy)) - reference).norm(dim=-1) / reference.norm(dim=-1)
        expected = torch.maximum(expected, change)
    torch.testing.assert_close(found, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["IntegratedGradients", "Occlusion", "FeatureAblation"])
@pytest.mark.parametrize("shape", [(2, 1, 5), (2, 1, 1)])
def test_per_sample_options_broadcast_along_the_second_batch_dimension_go_with_each_perturbed_copy(name, shape):
    """A baseline (or feature mask) of one value per row of a ``[2, 3]`` batch, ``[2, 1, ...]``, broadcasts to the
    input as the method reads it. The stacked call of the perturbed copies, ``[n * 2, 3, ...]``, left it unrepeated,
    and the method refused it there (a shape the caller never gave) though it explains the batch itself."""
    from tdhook import attribution

    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Softplus(), torch.nn.Linear(7, 3)).double()
    x = torch.randn(2, 3, 5, dtype=torch.float64)
    per_row = torch.randn(*shape, dtype=torch.float64)
    options = {
        "IntegratedGradients": {"baselines": per_row, "n_steps": 6},
        "Occlusion": {"sliding_window_shapes": (2,), "strides": 2, "baselines": per_row},
        "FeatureAblation": {"feature_masks": torch.randint(-2, 3, shape), "baselines": per_row.flip(0)},
    }[name]
    method = getattr(attribution, name)(net, in_keys=["x"], out_keys=["y"], **options)
    td = TensorDict(x=x, batch_size=[2, 3])
    noise = torch.rand(2, 3, 4, 5, dtype=torch.float64) * 0.1 - 0.05
    perturb = lambda repeated, radius: repeated.apply(lambda v: v + noise)  # noqa: E731
    ours = sensitivity_max(method, td, perturb_fn=perturb, n_perturb_samples=4)
    reference = method(td.clone())["attribution", "x"]
    method.target = net(x).argmax(-1)  # the original targets, held for the perturbed inputs
    changes = [
        (method(TensorDict(x=x + noise[:, :, i], batch_size=[2, 3]))["attribution", "x"] - reference).norm(dim=-1)
        for i in range(4)
    ]
    expected = torch.stack(changes, -1).amax(-1) / reference.norm(dim=-1)
    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=0)


def test_no_perturbed_samples_are_refused_by_name():
    method = tdhook_saliency(conv_net(), in_keys=["x"], out_keys=["y"])
    with pytest.raises(ValueError, match="sensitivity_max: n_perturb_samples must be a positive int, got 0"):
        sensitivity_max(method, TensorDict(x=images(2), batch_size=[2]), n_perturb_samples=0)


def test_half_precision_attributions_are_compared_in_float32():
    """InputXGradient of a float16 linear model with weights near 3000 over 1000 features: the attribution's norm
    (about 1e5) overflowed float16 to inf, and every score was 0 (a change over inf) where the definition gives
    0.11. The norms are taken in float32, rounded once to float16."""
    torch.manual_seed(0)
    net = torch.nn.Linear(1000, 2, bias=False)
    with torch.no_grad():
        net.weight.copy_(torch.rand(2, 1000) * 1000 + 2500)
    net = net.half()
    x = torch.rand(2, 1000).half() + 0.5
    noise = (torch.rand(2, 3, 1000) * 0.4 - 0.2).half()
    method = tdhook_input_x_gradient(net, in_keys=["x"], out_keys=["y"], target=0)
    perturb = lambda repeated, radius: repeated.apply(lambda v: v + noise)  # noqa: E731
    ours = sensitivity_max(method, TensorDict(x=x, batch_size=[2]), perturb_fn=perturb, n_perturb_samples=3)
    reference = method(TensorDict(x=x, batch_size=[2]))["attribution", "x"].double()
    changes = [
        (method(TensorDict(x=x + noise[:, i], batch_size=[2]))["attribution", "x"].double() - reference).norm(dim=-1)
        for i in range(3)
    ]
    expected = torch.stack(changes, -1).amax(-1) / reference.norm(dim=-1)
    assert ours.dtype == torch.float16
    torch.testing.assert_close(ours, expected.half(), rtol=2e-3, atol=0)


def test_a_loss_that_reduces_its_batch_is_refused_by_name():
    """A loss with ``reduction="mean"`` is one number for the whole batch: its explanation is of one sample, and
    the perturbed copies stacked along the batch were explained as their mean, each sample's row then compared
    with the unperturbed one: a ratio per sample that was none of the explanation's, without a word. It is
    refused, as the other metrics refuse such an output; with
    ``reduction="none"`` each sample's ratio is that of its own loss, computed here by hand."""
    from tests.attribution.methods.test_cross_sample_outputs import _mean_dqn_loss_and_batch

    loss, td = _mean_dqn_loss_and_batch()
    shifts = torch.randn(5, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * 0.05

    def shift(repeated, radius):
        return repeated.apply(lambda x: x + shifts)

    with pytest.raises(ValueError, match="one output per sample"):
        sensitivity_max(tdhook_input_x_gradient(loss, in_keys=["observation"], target_key="loss"), td, perturb_fn=shift)

    loss.reduction = "none"

    def explained(observation):
        observation = observation.clone().requires_grad_(True)
        per_sample = loss(td.clone().set("observation", observation))["loss"]
        return observation * torch.autograd.grad(per_sample.sum(), observation)[0]

    method = tdhook_input_x_gradient(loss, in_keys=["observation"], target_key="loss")
    score = sensitivity_max(method, td, perturb_fn=shift, n_perturb_samples=3)
    own = explained(td["observation"])
    moved = torch.stack([(explained(td["observation"] + shifts[:, k]) - own).norm(dim=-1) for k in range(3)])
    torch.testing.assert_close(score, moved.amax(0) / own.norm(dim=-1), rtol=1e-10, atol=1e-12)


def test_copies_of_a_batch_of_none_are_explained_at_the_samples_shape():
    """Perturbed by nothing, every copy is the input and its saliency the input's: 0. The copies of a batch []
    sample ``[rows, classes]`` ran stacked, a new first dimension over which ``nn.LogSoftmax(dim=1)`` then normalised
    (0.64); a classifier normalising over ``dim=-1`` stacks, as before."""
    for dim in (1, -1):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        net = torch.nn.Sequential(*net, torch.nn.LogSoftmax(dim=dim)).double()
        x = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        method = tdhook_saliency(net, in_keys=["x"], out_keys=["y"], target=net(x).argmax(-1))
        found = sensitivity_max(method, TensorDict(x=x, batch_size=[]), perturb_radius=0.0, n_perturb_samples=3)
        assert found.item() == 0.0, dim
