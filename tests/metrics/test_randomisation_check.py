"""randomisation_check against Quantus' MPRT, and what it leaves untouched."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModuleBase
from torch import nn
from torchrl.modules import MultiAgentMLP

from tdhook.attribution import LRP, FeatureAblation, InputXGradient
from tdhook.metrics import randomisation_check
from tdhook.metrics._agent_templates import reset_in_template
from tests.metrics._models import conv_net, for_quantus, gradient_times_input, images

quantus = pytest.importorskip("quantus")


def quantus_mprt(net, x, abs_, similarity):
    y = net(x).argmax(-1).numpy()
    metric = quantus.MPRT(
        seed=42,
        abs=abs_,
        normalise=False,
        similarity_func=similarity,
        return_last_correlation=False,
        return_average_correlation=False,
        disable_warnings=True,
        display_progressbar=False,
    )
    a = gradient_times_input(net, x.numpy(), y)
    model, explain = for_quantus(net), gradient_times_input
    scores = metric(model=model, x_batch=x.numpy(), y_batch=y, a_batch=a, explain_func=explain, softmax=False)
    return {name: torch.tensor(np.array(values)) for name, values in scores.items() if name != "original"}


@pytest.mark.parametrize("abs_", [False, True])
@pytest.mark.parametrize("similarity", ["spearman", "pearson"])
def test_equals_quantus_mprt_layer_by_layer(abs_, similarity):
    torch.manual_seed(3)
    net = conv_net()
    x = images(4)
    lrp = LRP(net, in_keys=["x"], out_keys=["y"], relevance_key="attribution")  # gradient x input here
    quantus_similarity = getattr(quantus.similarity_func, f"correlation_{similarity}")
    expected = quantus_mprt(net, x, abs_, quantus_similarity)
    ours = randomisation_check(lrp, TensorDict(x=x, batch_size=[4]), abs=abs_, similarity=similarity)
    assert list(ours) == list(expected) == ["3", "0"]
    for name in ours:
        torch.testing.assert_close(ours[name], expected[name], rtol=0, atol=1e-6)


@pytest.mark.parametrize("similarity", ["spearman", "pearson"])
def test_target_all_compares_every_units_attributions(similarity):
    """``target="all"`` gives each sample an attribution per output unit: the similarity runs over all of them
    together, the cascade as Quantus' MPRT runs it (each layer reset after ``manual_seed(seed + 1)``), with
    captum's gradient x input per unit and scipy's correlations as the oracle. A broadcast error before."""
    from captum.attr import InputXGradient as CaptumInputXGradient
    from scipy import stats

    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).double()
    x = torch.randn(5, 4, dtype=torch.float64)

    def every_unit(model):
        return torch.stack([CaptumInputXGradient(model).attribute(x, target=u) for u in range(3)], 1).flatten(1)

    copied = copy.deepcopy(net)
    original, expected = every_unit(copied).abs().detach(), {}
    correlation = stats.spearmanr if similarity == "spearman" else stats.pearsonr
    for name in ["2", "0"]:
        torch.manual_seed(43)
        copied[int(name)].reset_parameters()
        changed = every_unit(copied).abs().detach()
        expected[name] = torch.tensor([correlation(a, b)[0] for a, b in zip(original, changed, strict=True)])
    method = InputXGradient(net, in_keys=["x"], out_keys=["y"], target="all")
    ours = randomisation_check(method, TensorDict(x=x, batch_size=[5]), similarity=similarity)
    assert list(ours) == ["2", "0"]
    for name in ours:
        torch.testing.assert_close(ours[name], expected[name].to(ours[name].dtype), rtol=0, atol=1e-6, equal_nan=True)


def test_leaves_the_model_the_method_and_the_global_rng_untouched():
    net = conv_net()
    params = {name: p.clone() for name, p in net.state_dict().items()}
    lrp = LRP(net, in_keys=["x"], out_keys=["y"])
    td = TensorDict(x=images(3), batch_size=[3])
    before = td.clone()
    rng = torch.get_rng_state()
    scores = randomisation_check(lrp, td, seed=5)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(net.state_dict()[name], p) for name, p in params.items())
    assert (td == before).all() and set(td.keys()) == {"x"}
    assert lrp.target is None
    again = randomisation_check(lrp, td, seed=5)
    assert all(torch.equal(scores[name], again[name]) for name in scores)


class InputAsAttribution(TensorDictModuleBase):
    """A 'method' that ignores the model's weights: the attribution is the input itself."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.in_keys, self.out_keys = ["x"], ["y", ("attribution", "x")]
        self.target, self.target_key = None, "y"

    def forward(self, td):
        td["y"] = self.module(td["x"])
        td["attribution", "x"] = td["x"]
        return td


def test_a_method_that_ignores_the_weights_scores_one_and_stored_attributions_are_used():
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).double()
    td = TensorDict(x=torch.randn(5, 4, dtype=torch.float64), batch_size=[5])
    scores = randomisation_check(InputAsAttribution(net), td)
    assert list(scores) == ["2", "0"]
    for value in scores.values():
        torch.testing.assert_close(value, torch.ones(5, dtype=torch.float64))
    td["attribution", "x"] = -td["x"]  # a stored explanation is compared as it is
    negative = randomisation_check(InputAsAttribution(net), td, abs=False, similarity="pearson")
    torch.testing.assert_close(negative["0"], -torch.ones(5, dtype=torch.float64))


def mlp() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).double()


@pytest.mark.parametrize("method", ["lrp", "saliency"])
def test_a_parametrized_layer_is_reset_as_the_plain_layer(method):
    """``reset_parameters`` on a parametrized layer wrote into a temporary: its weight stayed, and a gradient method
    scored 1 at that layer, as if it ignored the weights. The layer now computes with the plain layer's draws."""
    from torch.nn.utils import parametrizations

    from tdhook.attribution import Saliency

    torch.manual_seed(0)
    plain = mlp()
    normed = mlp()
    normed.load_state_dict(plain.state_dict())
    parametrizations.weight_norm(normed[2])
    parametrizations.weight_norm(normed[0])
    td = TensorDict(x=torch.randn(6, 4, dtype=torch.float64), batch_size=[6])

    def wrap(net):
        if method == "lrp":
            return LRP(net, in_keys=["x"], out_keys=["y"])
        return Saliency(net, in_keys=["x"], out_keys=["y"])

    expected = randomisation_check(wrap(plain), td, abs=False, similarity="pearson")
    weights = [p.clone() for p in normed.parameters()]
    ours = randomisation_check(wrap(normed), td, abs=False, similarity="pearson")
    assert list(ours) == list(expected) == ["2", "0"]
    for name in ours:
        torch.testing.assert_close(ours[name], expected[name], rtol=0, atol=1e-10)
    assert bool((ours["2"] < 0.99).any())  # the weights changed
    assert all(torch.equal(p, w) for p, w in zip(normed.parameters(), weights, strict=True))  # the caller's model


@pytest.mark.parametrize(
    "hook",
    [
        lambda layer: torch.nn.utils.weight_norm(layer),
        lambda layer: torch.nn.utils.spectral_norm(layer),
        lambda layer: torch.nn.utils.prune.random_unstructured(layer, "weight", 0.3),
    ],
    ids=["weight_norm", "spectral_norm", "prune"],
)
def test_a_weight_recomputed_in_a_pre_hook_is_refused_by_name(hook):
    """The pre-hook recomputes the weight from other parameters at every call: a reset never reached it."""
    import warnings

    net = mlp()
    with torch.no_grad(), warnings.catch_warnings():  # made under no_grad, the model can be copied
        warnings.simplefilter("ignore", FutureWarning)
        hook(net[2])
    lrp = LRP(net, in_keys=["x"], out_keys=["y"])
    with pytest.raises(ValueError, match=r"randomisation_check: module '2' \(Linear\) recomputes 'weight'"):
        randomisation_check(lrp, TensorDict(x=torch.randn(3, 4, dtype=torch.float64), batch_size=[3]))


def test_a_parametrized_submodule_of_a_reset_layer_takes_the_plain_draws():
    from torch.nn.utils import parametrizations

    from tdhook.metrics._layer_reset import reset_layer

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.other = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)

        def reset_parameters(self) -> None:
            self.inner.reset_parameters()
            self.other.reset_parameters()

    plain, normed = Block(), Block()
    normed.load_state_dict(plain.state_dict())
    parametrizations.weight_norm(normed.inner)
    torch.manual_seed(0)
    plain.reset_parameters()
    torch.manual_seed(0)
    reset_layer("block", normed)
    torch.testing.assert_close(normed.inner.weight, plain.inner.weight, rtol=0, atol=1e-6)
    assert torch.equal(normed.other.weight, plain.other.weight) and torch.equal(normed.inner.bias, plain.inner.bias)


def test_a_float16_model_is_compared_without_overflow():
    """200 features: the Spearman correlation of float16 attributions was NaN for every layer and sample (the sum of
    squared ranks overflowed float16)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(200, 16), nn.ReLU(), nn.Linear(16, 3)).half()
    method = InputXGradient(net, in_keys=["x"], out_keys=["y"])
    scores = randomisation_check(method, TensorDict(x=torch.randn(4, 200).half(), batch_size=[4]))
    assert list(scores) == ["2", "0"]
    assert all(score.dtype == torch.float16 and bool(score.isfinite().all()) for score in scores.values())


class AttentionWithScale(nn.Module):
    """An attention block, then a learnt scale held by the model itself (no module of its own resets it)."""

    def __init__(self) -> None:
        super().__init__()
        self.att = nn.MultiheadAttention(8, 2, batch_first=True)
        self.scale = nn.Parameter(torch.randn(8))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.att(x, x, x, need_weights=False)
        return self.head((h * self.scale).mean(1))


def test_an_attentions_input_projection_is_reset_and_parameters_no_layer_resets_are_named():
    """nn.MultiheadAttention draws its input projection (three quarters of its weights) in ``_reset_parameters``,
    not ``reset_parameters``: the cascade left it, and a parameter of the model's own, trained, without a word (the
    last layer reset was the attention's output projection). It is now a layer of the cascade, reset as torch
    initialises it, and the parameters no layer resets are named in a warning. The oracle: the cascade written out."""
    from tdhook.attribution import Saliency
    from tdhook.metrics._similarity import spearman

    torch.manual_seed(0)
    net = AttentionWithScale().double().eval()
    td = TensorDict(x=torch.randn(3, 4, 8, dtype=torch.float64), batch_size=[3])
    saliency = Saliency(net, in_keys=["x"], out_keys=["y"])
    with pytest.warns(UserWarning, match=r"re-initialises the parameters 'scale': they keep their trained values"):
        scores = randomisation_check(saliency, td, seed=7)
    assert list(scores) == ["head", "att.out_proj", "att"]
    copied = copy.deepcopy(net)
    original = saliency(td.clone())["attribution", "x"].flatten(1).abs()
    target = net(td["x"]).argmax(-1)
    with torch.random.fork_rng():
        for name in ["head", "att.out_proj", "att"]:
            torch.manual_seed(8)
            layer = copied.get_submodule(name)
            with torch.no_grad():
                layer.reset_parameters() if name != "att" else layer._reset_parameters()
            method = Saliency(copied, in_keys=["x"], out_keys=["y"], target=target)
            changed = method(td.clone())["attribution", "x"].flatten(1).abs()
            torch.testing.assert_close(scores[name], spearman(original, changed), rtol=1e-12, atol=1e-12)


def _agents(share_params: bool) -> MultiAgentMLP:
    torch.manual_seed(0)
    return MultiAgentMLP(
        4, 2, n_agents=3, centralized=False, share_params=share_params, depth=2, num_cells=6, activation_class=nn.Tanh
    ).double()


def test_layers_of_a_multi_agent_template_with_shared_parameters_equal_the_plain_network():
    """torchrl's ``MultiAgentMLP`` keeps its values in ``params`` and its template layers on the meta device: their
    reset drew meta tensors and left the network as it was, so every template layer scored 1 (explanations equal),
    as if the method ignored the weights. With shared parameters the network is the plain MLP applied to every agent:
    the scores equal that MLP's, layer by layer, under the same seeds."""
    net = _agents(share_params=True)
    plain = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    plain.load_state_dict(dict(net.params.flatten_keys(".").items()))
    td = TensorDict(obs=torch.randn(5, 3, 4, dtype=torch.float64), batch_size=[5])
    kwargs = dict(in_keys=["obs"], out_keys=["q"], target=lambda y: y)
    scores = randomisation_check(InputXGradient(net, **kwargs), td, similarity="pearson")
    expected = randomisation_check(InputXGradient(plain, **kwargs), td, similarity="pearson")
    for layer in ["4", "2", "0"]:
        torch.testing.assert_close(scores[f"_empty_net.{layer}"], expected[layer], rtol=0, atol=1e-12)
        assert (scores[f"_empty_net.{layer}"] < 0.99).all()


def test_layers_of_a_multi_agent_template_reach_every_agents_values():
    """With ``share_params=False`` each agent draws its own values (as the network's own ``reset_parameters``): the
    reset of a template layer changes that layer of every agent, and no other layer."""
    net = _agents(share_params=False)
    td = TensorDict(obs=torch.randn(5, 3, 4, dtype=torch.float64), batch_size=[5])
    method = InputXGradient(net, in_keys=["obs"], out_keys=["q"], target=lambda y: y)
    before = net.params.detach().clone()
    scores = randomisation_check(method, td, similarity="pearson")
    assert list(scores) == ["_empty_net.4", "_empty_net.2", "_empty_net.0", ""]
    for layer in ["_empty_net.4", "_empty_net.2", "_empty_net.0"]:
        assert (scores[layer] < 0.99).all(), layer
    assert (net.params.detach() == before).all()  # the caller's network is left alone
    copied = copy.deepcopy(net)
    reset_in_template(copied, copied._empty_net[4].reset_parameters)
    for layer in ["0", "2", "4"]:
        changed = (copied.params[layer, "weight"] != before[layer, "weight"]).flatten(1).all(1)
        assert changed.tolist() == [layer == "4"] * 3, layer
    assert not torch.equal(copied.params["4", "weight"][0], copied.params["4", "weight"][1])  # drawn per agent


@pytest.mark.parametrize("stored", [(2, 1, 6, 6), (2, 3, 1, 1)])
def test_a_stored_attribution_of_another_shape_than_the_methods_is_refused_by_name(stored):
    """A stored pixel map broadcasts to its input, but the explanations of the randomised models, of the input's shape,
    are compared with it element by element: torch's broadcasting error named neither the key nor the shapes."""
    net = conv_net()
    td = TensorDict(x=images(2), attribution=TensorDict(x=torch.randn(stored, dtype=torch.float64)), batch_size=[2])
    expected = rf"stored attribution \('attribution', 'x'\) has shape {list(stored)}".replace("[", r"\[")
    with pytest.raises(ValueError, match=expected + r", but the method writes \[2, 3, 6, 6\]"):
        randomisation_check(InputXGradient(net, in_keys=["x"], out_keys=["y"]), td)


@pytest.mark.parametrize("abs_", ["False", 0, None])
def test_abs_that_is_no_bool_is_refused_by_name(abs_):
    lrp = LRP(conv_net(), in_keys=["x"], out_keys=["y"])
    with pytest.raises(TypeError, match="randomisation_check: abs must be True or False, got"):
        randomisation_check(lrp, TensorDict(x=images(2), batch_size=[2]), abs=abs_)


def test_under_inference_mode_a_method_that_needs_no_gradient_scores_as_outside_it():
    """The copy of the method made under ``torch.inference_mode()`` held inference tensors, whose version counters
    the check reads: the call failed deep inside with "Inference tensors do not track version counter"."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    method = FeatureAblation(net, in_keys=["x"], out_keys=["y"], feature_masks=torch.arange(4))
    x = torch.randn(5, 4, dtype=torch.float64)
    outside = randomisation_check(method, TensorDict(x=x, batch_size=[5]), progress=False)
    with torch.inference_mode():
        inside = randomisation_check(method, TensorDict(x=x.clone(), batch_size=[5]), progress=False)
    assert list(inside) == list(outside) == ["2", "0"]
    for name in outside:
        torch.testing.assert_close(inside[name].clone(), outside[name], rtol=1e-12, atol=1e-12)
