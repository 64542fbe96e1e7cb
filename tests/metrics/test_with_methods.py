"""Every metric on the output of every method: LRP, IntegratedGradients, Saliency and Occlusion.

The metrics that call a method (``sensitivity_max``, ``randomisation_check``) are checked against their
definitions computed with fresh wrappers, one perturbed sample at a time; the metrics that read a method's output
are checked to read it at the method's keys; and the target a metric scores is checked to be the quantity the
method explains, on a small CNN (a plain ``nn.Module``) and on a two-key TensorDict policy.
"""

from __future__ import annotations

import copy

import pytest
import torch
from scipy.stats import spearmanr
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

from tdhook.attribution import CPLRP, LRP, EpsilonPlus, IntegratedGradients, Occlusion, Saliency
from tdhook.metrics import (
    action_fidelity,
    aopc,
    faithfulness_correlation,
    infidelity,
    pixel_flipping,
    randomisation_check,
    region_perturbation,
    sensitivity_max,
)
from tests.metrics._models import TwoKeys, conv_net, images
from tests.metrics.test_pixel_flipping import by_definition

METHODS = ["lrp", "integrated_gradients", "saliency", "occlusion"]
MODELS = ["cnn", "two_keys"]


def cnn_case():
    torch.manual_seed(3)
    net = conv_net()
    return net, {"in_keys": ["x"], "out_keys": ["y"]}, TensorDict(x=images(3), batch_size=[3])


def two_keys_case():
    torch.manual_seed(4)
    policy = TensorDictModule(TwoKeys().double(), in_keys=["u", "v"], out_keys=["q"])
    td = TensorDict(u=torch.randn(4, 5, dtype=torch.float64), v=torch.randn(4, 3, dtype=torch.float64), batch_size=[4])
    return policy, {}, td


CASES = {"cnn": cnn_case, "two_keys": two_keys_case}


def make(name: str, model, keys: dict, **kwargs):
    """A fresh wrapper of ``model`` for method ``name``."""
    if name == "lrp":
        return LRP(model, EpsilonPlus(), **keys, **kwargs)
    if name == "integrated_gradients":
        return IntegratedGradients(model, n_steps=8, **keys, **kwargs)
    if name == "saliency":
        return Saliency(model, **keys, **kwargs)
    windows = {"x": (3, 2, 2)} if keys else {"u": (2,), "v": (1,)}
    return Occlusion(model, sliding_window_shapes=windows, strides=windows, **keys, **kwargs)


def prefix(name: str) -> str:
    return "relevance" if name == "lrp" else "attribution"


def explained_keys(td: TensorDict) -> list[str]:
    return sorted(td.keys())


def targets_of(model, keys: dict, td: TensorDict) -> torch.Tensor:
    """The argmax of the model's output on ``td``."""
    with torch.no_grad():
        if keys:
            return model(td["x"]).argmax(-1)
        return model(td.clone())["q"].argmax(-1)


def flat_attribution(name: str, model, keys: dict, td: TensorDict, target) -> torch.Tensor:
    """A fresh wrapper's attributions of all keys of ``td``, concatenated per sample."""
    out = make(name, model, keys, target=target)(td.clone())
    return torch.cat([out[prefix(name), k].flatten(1) for k in explained_keys(td)], dim=-1)


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("name", METHODS)
def test_sensitivity_max_equals_its_definition_with_the_original_targets(name, model_name):
    model, keys, td = CASES[model_name]()
    n, radius = 3, 0.8
    rng = torch.Generator().manual_seed(0)
    noise = {
        k: (torch.rand(*td[k].shape[:1], n, *td[k].shape[1:], generator=rng, dtype=torch.float64) * 2 - 1) * radius
        for k in explained_keys(td)
    }

    def perturb(repeated, r):
        return repeated.apply(lambda x, e: x + e, TensorDict(noise, batch_size=repeated.batch_size))

    method = make(name, model, keys)
    ours = sensitivity_max(method, td, perturb_fn=perturb, perturb_radius=radius, n_perturb_samples=n)
    assert method.target is None and set(td.keys()) == set(explained_keys(td))

    original = targets_of(model, keys, td)
    reference = flat_attribution(name, model, keys, td, original)
    flipped = 0
    expected = []
    for b in range(td.shape[0]):
        ratios = []
        for j in range(n):
            moved = {k: td[k][b : b + 1] + noise[k][b, j][None] for k in explained_keys(td)}
            sample = TensorDict(moved, batch_size=[1])
            flipped += int(targets_of(model, keys, sample)[0] != original[b])
            changed = flat_attribution(name, model, keys, sample, original[b : b + 1])
            ratios.append((changed[0] - reference[b]).norm() / reference[b].norm())
        expected.append(torch.stack(ratios).max())
    assert flipped, "the noise must move some argmax for the test to see that the target is held"
    torch.testing.assert_close(ours, torch.stack(expected), rtol=1e-9, atol=1e-12)


def layers_top_down(model) -> list[tuple[str, torch.nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if callable(getattr(m, "reset_parameters", None))][::-1]


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("name", METHODS)
def test_randomisation_check_equals_the_cascade_by_hand(name, model_name):
    model, keys, td = CASES[model_name]()
    before = copy.deepcopy(model.state_dict())
    method = make(name, model, keys)
    rng = torch.get_rng_state()
    scores = randomisation_check(method, td, seed=7)
    assert torch.equal(torch.get_rng_state(), rng) and method.target is None
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())

    original = targets_of(model, keys, td)
    reference = flat_attribution(name, model, keys, td, original).abs()
    copied = copy.deepcopy(model)
    expected = {}
    for layer_name, layer in layers_top_down(copied):
        torch.manual_seed(8)
        with torch.no_grad():
            layer.reset_parameters()
        changed = flat_attribution(name, copied, keys, td, original).abs()
        expected[layer_name] = torch.tensor(
            [spearmanr(reference[b].numpy(), changed[b].numpy()).statistic for b in range(td.shape[0])],
            dtype=torch.float64,
        )
    torch.set_rng_state(rng)
    assert list(scores) == list(expected)
    for layer_name, value in expected.items():
        torch.testing.assert_close(scores[layer_name], value, rtol=0, atol=1e-9)


@pytest.mark.parametrize("name", METHODS)
def test_the_perturbation_metrics_read_each_methods_output_on_the_cnn(name):
    net, keys, td = cnn_case()
    out = make(name, net, keys)(td.clone())
    a = out[prefix(name), "x"]
    assert a.shape == td["x"].shape
    common = {**keys, "relevance_key": prefix(name)}
    curve = pixel_flipping(net, out, features_per_step=9, **common)
    expected = by_definition(net, td["x"], a, net(td["x"]).argmax(-1), 9).detach()
    torch.testing.assert_close(curve, expected, rtol=0, atol=1e-10)
    assert aopc(curve).shape == (3,)
    assert region_perturbation(net, out, patch_size=2, **common).shape == (3, 10)
    assert faithfulness_correlation(net, out, n_runs=6, subset_size=12, seed=0, **common).isfinite().all()

    def perturb(td_):
        noise = td_.apply(lambda x: torch.full_like(x, 0.1))
        return noise, td_ - noise

    assert infidelity(net, out, perturb_fn=perturb, n_perturb_samples=2, **common).shape == (3,)
    other = "relevance" if name != "lrp" else "attribution"
    with pytest.raises(KeyError):  # a metric reading the other family's prefix finds nothing
        pixel_flipping(net, out, features_per_step=9, **keys, relevance_key=other)


@pytest.mark.parametrize("name", METHODS)
def test_action_fidelity_and_pixel_flipping_rank_both_keys_of_each_methods_output(name):
    policy, _, td = two_keys_case()
    out = make(name, policy, {})(td.clone())
    fidelity = action_fidelity(policy, out, k=3, n_random=4, seed=0, relevance_key=prefix(name))
    assert 0.0 <= fidelity["relevant"].item() <= 1.0 and 0.0 <= fidelity["random"].item() <= 1.0
    curve = pixel_flipping(policy, out, relevance_key=prefix(name))
    a = torch.cat([out[prefix(name), "u"], out[prefix(name), "v"]], dim=-1)
    net = policy.module

    def joined(x):
        return net(x[:, :5], x[:, 5:])

    x = torch.cat([td["u"], td["v"]], dim=-1)
    torch.testing.assert_close(curve, by_definition(joined, x, a, joined(x).argmax(-1), 1).detach(), rtol=0, atol=1e-10)


def softmax_of_unit_1(out: torch.Tensor) -> torch.Tensor:
    return torch.softmax(out, -1) * torch.nn.functional.one_hot(torch.tensor(1), out.shape[-1]).to(out.dtype)


@pytest.mark.parametrize(
    "target", [None, 2, torch.tensor([4, 0, 1]), softmax_of_unit_1], ids=["argmax", "int", "indices", "callable"]
)
def test_a_metric_scores_the_quantity_the_method_explains(target):
    """Occlusion by one window over the whole input gives every element f(x) - f(baseline) for the method's target;
    pixel flipping all features at once drops the metric's score by the same amount only if the two agree."""
    net, keys, td = cnn_case()
    method = Occlusion(net, sliding_window_shapes=(3, 6, 6), **keys, target=target)
    out = method(td.clone())
    drop = out["attribution", "x"].flatten(1)
    assert torch.allclose(drop, drop[:, :1].expand_as(drop))
    curve = pixel_flipping(net, out, target=target, features_per_step=108, **keys)
    torch.testing.assert_close(curve[:, 0] - curve[:, 1], drop[:, 0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", METHODS)
def test_sensitivity_max_holds_the_weights_of_a_callable_target_found_on_the_unperturbed_input(name):
    net, keys, td = cnn_case()
    n, radius = 2, 0.8
    noise = torch.rand(3, n, 3, 6, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 1.6 - 0.8

    def perturb(repeated, r):
        return repeated.apply(lambda x: x + noise)

    method = make(name, net, keys, target=softmax_of_unit_1)
    ours = sensitivity_max(method, td, perturb_fn=perturb, perturb_radius=radius, n_perturb_samples=n)
    assert method.target is softmax_of_unit_1

    with torch.no_grad():
        y = net(td["x"])
    weights = softmax_of_unit_1(y) / y  # what every method explains at x, held for the perturbed inputs
    reference = flat_attribution(name, net, keys, td, softmax_of_unit_1)
    expected = []
    for b in range(3):
        held = weights[b : b + 1]
        ratios = []
        for j in range(n):
            sample = TensorDict(x=td["x"][b : b + 1] + noise[b, j][None], batch_size=[1])
            changed = flat_attribution(name, net, keys, sample, lambda out, held=held: out * held)
            ratios.append((changed[0] - reference[b]).norm() / reference[b].norm())
        expected.append(torch.stack(ratios).max())
    torch.testing.assert_close(ours, torch.stack(expected), rtol=1e-9, atol=1e-12)


def test_pixel_flipping_of_a_decision_transformer_over_its_context_keys():
    """torchrl's decision-transformer wrapper reads a ``[B]`` batch of contexts (observations, actions and
    returns-to-go over ``T`` steps) and acts once per context: the curve ranks the elements of the three keys
    together and equals, step by step, the wrapper's held action unit with those elements at 0."""
    from tests.attribution.test_policy_targets import CONTEXT_KEYS, context, decision_transformer

    _, wrapper = decision_transformer("plain")
    td = context("[B]")
    td.update(LRP(wrapper, CPLRP(), in_keys=list(CONTEXT_KEYS))(td.clone()).select("relevance"))
    curve = pixel_flipping(wrapper, td, relevance_key="relevance", features_per_step=5)

    values = torch.cat([td["relevance", k].flatten(1) for k in CONTEXT_KEYS], -1)
    sizes = [td[k][0].numel() for k in CONTEXT_KEYS]
    unit = wrapper(td.clone())["action"].argmax(-1)
    expected = []
    for b in range(td.batch_size[0]):
        order = sorted(range(values.shape[1]), key=lambda i: (-values[b, i].item(), i))
        flat = torch.cat([td[k][b].flatten() for k in CONTEXT_KEYS])
        row = []
        for start in range(0, len(order) + 5, 5):
            perturbed = flat.clone()
            perturbed[order[:start]] = 0.0
            one = TensorDict(
                {k: p.view_as(td[k][b]) for k, p in zip(CONTEXT_KEYS, perturbed.split(sizes), strict=True)}, []
            )
            row.append(wrapper(one.unsqueeze(0))["action"][0, unit[b]].item())
            if start >= len(order):
                break
        expected.append(row)
    torch.testing.assert_close(curve, torch.tensor(expected, dtype=curve.dtype), rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", ["lrp", "saliency"])
def test_a_method_inside_a_pipeline_is_held_at_its_original_targets(name):
    """A pipeline has no ``target`` of its own: the wrapper inside explained each perturbed or randomised input at
    its own argmax (1.2 off the wrapper scored alone), and LRP's relevance key went unread."""
    from tensordict.nn import TensorDictSequential

    model, keys, td = two_keys_case()
    method = make(name, model, keys)
    total = TensorDictModule(lambda q: q.sum(-1, keepdim=True), in_keys=["q"], out_keys=["total"])
    pipeline = TensorDictSequential(method, total)
    alone = sensitivity_max(method, td, seed=0, perturb_radius=0.5)
    torch.testing.assert_close(sensitivity_max(pipeline, td, seed=0, perturb_radius=0.5), alone, rtol=0, atol=1e-12)
    assert method.target is None
    alone = randomisation_check(method, td)
    inside = randomisation_check(pipeline, td)
    assert [layer.rsplit(".", 1)[-1] for layer in inside] == [layer.rsplit(".", 1)[-1] for layer in alone]
    for ours, expected in zip(inside.values(), alone.values(), strict=True):
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-12)


def test_a_masked_policy_is_scored_at_the_allowed_action_the_methods_explain():
    """Every metric took the plain argmax of a masked policy's logits, a forbidden action, where the methods explain
    the highest allowed logit: pixel flipping tracked another logit than the one explained, and sensitivity_max
    compared the explanation of the allowed action with those of the forbidden one."""
    from torchrl.modules import MaskedCategorical, ProbabilisticActor

    torch.manual_seed(5)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).double()
    actor = ProbabilisticActor(
        TensorDictModule(net, in_keys=["observation"], out_keys=["logits"]),
        in_keys={"logits": "logits", "mask": "action_mask"},
        distribution_class=MaskedCategorical,
    )
    observation = torch.randn(6, 4, dtype=torch.float64)
    logits = net(observation).detach()
    mask = torch.ones(6, 3, dtype=torch.bool)
    mask[torch.arange(6), logits.argmax(-1)] = False  # the plain argmax is forbidden everywhere
    td = TensorDict(observation=observation, action_mask=mask, batch_size=[6])
    allowed = logits.masked_fill(~mask, float("-inf")).argmax(-1)
    keys = {"in_keys": ["observation"], "target_key": "logits"}
    explained = Saliency(actor, **keys)(td.clone())

    curve = pixel_flipping(actor, explained, **keys)
    torch.testing.assert_close(curve, pixel_flipping(actor, explained, target=allowed, **keys), rtol=0, atol=0)
    torch.testing.assert_close(curve[:, 0], logits.gather(-1, allowed[:, None])[:, 0], rtol=0, atol=1e-12)

    fidelity = action_fidelity(actor, explained, k=2, seed=0, **keys)
    top = explained["attribution", "observation"].argsort(dim=-1, descending=True, stable=True)[:, :2]
    perturbed = observation.scatter(-1, top, 0.0)
    after = net(perturbed).detach().masked_fill(~mask, float("-inf")).argmax(-1)
    torch.testing.assert_close(fidelity["relevant"], (after != allowed).double().mean(), rtol=0, atol=0)

    for make_method in (
        lambda **kw: Saliency(actor, **keys, **kw),
        lambda **kw: LRP(actor, EpsilonPlus(), **keys, **kw),
    ):
        ours = sensitivity_max(make_method(), td, seed=0, perturb_radius=0.5)
        expected = sensitivity_max(make_method(target=allowed), td, seed=0, perturb_radius=0.5)
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-12)
        ours, expected = randomisation_check(make_method(), td), randomisation_check(make_method(target=allowed), td)
        for layer in expected:
            torch.testing.assert_close(ours[layer], expected[layer], rtol=0, atol=1e-12)
