"""Calling a method for a metric: its target, held and repeated for stacked perturbed copies."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import InputXGradient
from tdhook.metrics import sensitivity_max
from tdhook.metrics._methods import repeat_target


def test_per_sample_indices_with_a_trailing_unit_dimension_are_repeated_too():
    """The methods take indices ``batch + [1]`` as well as ``batch``; both repeat over stacked copies."""
    target = torch.tensor([[0], [2], [1]])
    assert repeat_target(target, torch.Size([3]), 2).tolist() == [[0], [2], [1], [0], [2], [1]]
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)).double()
    td = TensorDict(x=torch.randn(3, 4, dtype=torch.float64), batch_size=[3])
    column = sensitivity_max(InputXGradient(net, in_keys=["x"], out_keys=["y"], target=target), td, seed=0)
    flat = sensitivity_max(InputXGradient(net, in_keys=["x"], out_keys=["y"], target=target[:, 0]), td, seed=0)
    torch.testing.assert_close(column, flat, rtol=0, atol=1e-12)


def test_a_masked_policy_is_explained_for_its_best_allowed_action_throughout():
    """The methods' default target for a masked policy is the best allowed action: sensitivity_max held the plain
    argmax for the perturbed inputs instead (LRP's sensitivity was 0.7 to 4.8 for 0.008 to 0.03)."""
    from torchrl.modules import MaskedCategorical

    from tdhook.attribution import LRP, EpsilonPlus
    from tests.attribution.test_policy_targets import masked_actor, masked_td

    actor = masked_actor(MaskedCategorical)
    td = masked_td(actor)
    with torch.no_grad():
        logits = actor.module[0](td.clone())["logits"]
    allowed = logits.masked_fill(~td["action_mask"], float("-inf")).argmax(-1)
    for make in (lambda **kw: LRP(actor, EpsilonPlus(), **kw), lambda **kw: InputXGradient(actor, **kw)):
        got = sensitivity_max(make(in_keys=["observation"]), td, seed=0, n_perturb_samples=4)
        expected = sensitivity_max(make(in_keys=["observation"], target=allowed), td, seed=0, n_perturb_samples=4)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_a_masked_policy_is_explained_for_the_action_a_transition_holds_throughout():
    """A stored transition holds the action taken, which the methods explain by default: the unperturbed
    explanation was of the best allowed action while the perturbed ones were held at the taken one (sensitivity 3.7
    instead of the figure with either target given)."""
    from torchrl.modules import MaskedCategorical

    from tdhook.attribution import LRP, EpsilonPlus
    from tdhook.metrics import randomisation_check
    from tests.attribution.test_policy_targets import as_transition, masked_actor, masked_td

    actor = masked_actor(MaskedCategorical)
    td = masked_td(actor)
    with torch.no_grad():
        logits = actor.module[0](td.clone())["logits"].masked_fill(~td["action_mask"], float("-inf"))
    best = logits.argmax(-1)
    taken = logits.scatter(-1, best.unsqueeze(-1), float("-inf")).argmax(-1)  # allowed, not the best
    assert td["action_mask"].gather(-1, taken.unsqueeze(-1)).all() and (taken != best).all()
    td = as_transition(td.set("action", taken))
    for make in (lambda **kw: LRP(actor, EpsilonPlus(), **kw), lambda **kw: InputXGradient(actor, **kw)):
        got = sensitivity_max(make(in_keys=["observation"]), td, seed=0, n_perturb_samples=4)
        expected = sensitivity_max(make(in_keys=["observation"], target=taken), td, seed=0, n_perturb_samples=4)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
        got = randomisation_check(make(in_keys=["observation"]), td, similarity="pearson")
        expected = randomisation_check(make(in_keys=["observation"], target=taken), td, similarity="pearson")
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_the_wrapper_inside_a_pipeline_holds_the_target_and_several_are_refused():
    from tensordict.nn import TensorDictModule, TensorDictSequential

    from tdhook.metrics._methods import attribution_wrapper

    net = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)).double()
    first = InputXGradient(net, in_keys=["x"], out_keys=["y"])
    second = InputXGradient(TensorDictModule(net, in_keys=["x"], out_keys=["z"]))
    pipeline = TensorDictSequential(TensorDictModule(lambda x: x, ["x"], ["w"]), first)
    assert attribution_wrapper(pipeline) is first and attribution_wrapper(first) is first
    with pytest.raises(TypeError, match=r"the method holds several attribution wrappers \('module.0', 'module.1'\)"):
        attribution_wrapper(TensorDictSequential(first, second))


def test_a_held_callable_target_with_relevance_on_a_zero_output_is_refused_by_name():
    """LRP seeds such relevance at the zero outputs of the unperturbed input; the weights held for the perturbed
    ones dropped it, and the two explanations compared were of different targets."""
    from tdhook.attribution import LRP, EpsilonPlus

    net = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2))  # the ε-rule carries it from a zero output
    with torch.no_grad():
        net[0].weight.copy_(torch.eye(3))
        net[2].weight.copy_(torch.tensor([[1.0, 1.0, 1.0], [1.0, -1.0, 0.0]]))
        net[0].bias.zero_()
        net[2].bias.zero_()
    td = TensorDict(x=torch.ones(2, 3), batch_size=[2])  # outputs [3, 0]
    lrp = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"], target=lambda y: torch.ones_like(y))
    lrp(td.clone())  # LRP explains it
    with pytest.raises(ValueError, match=r"callable target puts relevance on 2 entries of output 'y' that are exactly"):
        sensitivity_max(lrp, td, seed=0)


@pytest.mark.parametrize("metric", ["sensitivity_max", "randomisation_check"])
def test_a_grad_cam_map_of_a_layer_alone_is_refused_and_its_upsampled_map_scored(metric):
    """Without ``upsample``, GradCAM writes no attribution of the input keys, which these metrics compare: it is
    refused by name (the metrics reported a missing key and asked to run an attribution method first)."""
    from tdhook import metrics
    from tdhook.attribution import GradCAM

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 5 * 5, 4)).double()
    td = TensorDict(x=torch.randn(3, 2, 5, 5, dtype=torch.float64), batch_size=[3])
    score = getattr(metrics, metric)
    with pytest.raises(ValueError, match=rf"{metric}: GradCAM writes its map of layer '0'.*upsample=True"):
        score(GradCAM(net, in_keys=["x"], out_keys=["y"], layer="0"), td)
    scored = score(GradCAM(net, in_keys=["x"], out_keys=["y"], layer="0", upsample=True), td)
    assert all(value.shape == (3,) for value in (scored.values() if isinstance(scored, dict) else [scored]))
    assert set(td.keys()) == {"x"}


@pytest.mark.parametrize("metric", ["sensitivity_max", "randomisation_check"])
def test_the_model_in_place_of_its_method_is_refused_by_name(metric):
    """The model itself (a policy) writes no attribution: the metrics reported a missing attribution key and asked to
    run an attribution method first, though the TensorDict held one and the method was what was missing."""
    from tensordict.nn import TensorDictModule, TensorDictSequential

    from tdhook import metrics
    from tdhook.attribution import LRP, EpsilonPlus

    policy = TensorDictModule(nn.Linear(3, 2), in_keys=["observation"], out_keys=["action_value"])
    td = LRP(policy, EpsilonPlus())(TensorDict(observation=torch.randn(4, 3), batch_size=[4]))
    score = getattr(metrics, metric)
    for model in (policy, TensorDictSequential(policy)):
        with pytest.raises(
            TypeError,
            match=rf"^{metric}: method must be an attribution wrapper, .* got {type(model).__name__} "
            r"\(out_keys \['action_value'\]\), .* for example LRP\(module, EpsilonPlus\(\)\)$",
        ):
            score(model, td, relevance_key="relevance")


def test_a_per_sample_baseline_for_every_key_is_repeated_though_a_flag_of_other_shape_is_left_out():
    """With default keys, a call leaves out a boolean flag; one per-sample baseline for every key goes with each
    perturbed copy of its sample whatever the flag's shape (it was left as it was, and the method refused it)."""
    from tensordict.nn import TensorDictModule

    from tdhook.attribution import Occlusion

    class Flagged(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(6, 3)

        def forward(self, obs: torch.Tensor, goal: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
            return self.body(torch.cat([obs, goal], -1)) * (~done).unsqueeze(-1)

    torch.manual_seed(0)
    module = TensorDictModule(Flagged().double(), in_keys=["obs", "goal", "done"], out_keys=["q"])
    td = TensorDict(
        obs=torch.randn(3, 4, dtype=torch.float64),
        goal=torch.randn(3, 2, dtype=torch.float64),
        done=torch.zeros(3, dtype=torch.bool),
        batch_size=[3],
    )
    baselines = torch.randn(3, 1, dtype=torch.float64)
    by_default = Occlusion(module, sliding_window_shapes=(1,), baselines=baselines)
    by_name = Occlusion(module, in_keys=["obs", "goal"], sliding_window_shapes=(1,), baselines=baselines)
    torch.testing.assert_close(sensitivity_max(by_default, td, seed=0), sensitivity_max(by_name, td, seed=0))


@pytest.mark.parametrize("batch", [[4], []])
def test_one_index_per_head_is_repeated_for_every_perturbed_copy(batch):
    """An output ``batch + [heads, units]`` (torchrl's ``MultiAgentMLP``) has its default target held at one index
    per sample and head, ``batch + [heads]``; only indices ``batch`` or ``batch + [1]`` were repeated for the
    stacked copies, and sensitivity_max refused the method's own target ("target indices of shape (4, 3) do not
    match output 'y' of shape (8, 3, 2)"). Each copy is explained here on its own, for the original argmax."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6), nn.Unflatten(-1, (3, 2))).double()
    td = TensorDict(x=torch.randn(*batch, 4, dtype=torch.float64), batch_size=batch)
    noise = torch.randn(*batch, 2, 4, dtype=torch.float64) * 0.1

    def perturb(repeated: TensorDict, radius: float) -> TensorDict:
        return repeated.set("x", repeated["x"] + noise)

    method = InputXGradient(net, in_keys=["x"], out_keys=["y"])
    got = sensitivity_max(method, td, perturb_fn=perturb, n_perturb_samples=2)
    held = net(td["x"]).argmax(-1)  # batch + [heads]

    def explained(x: torch.Tensor) -> torch.Tensor:
        x = x.clone().requires_grad_()
        net(x).gather(-1, held.unsqueeze(-1)).sum().backward()
        return (x * x.grad).detach()

    reference = explained(td["x"])
    ratios = [
        (explained(td["x"] + noise[..., i, :]) - reference).norm(dim=-1) / reference.norm(dim=-1) for i in range(2)
    ]
    torch.testing.assert_close(got, torch.stack(ratios).amax(0), rtol=0, atol=1e-12)


class _LastStep(nn.Module):
    """A decision transformer's last-step prediction written out: the inference wrapper's masking of all but the
    last ``shown`` steps (the actions shifted by one step), then the network, at the last step."""

    def __init__(self, net: nn.Module, shown: int) -> None:
        super().__init__()
        self.net, self.shown = net, shown

    def forward(self, observation: torch.Tensor, action: torch.Tensor, return_to_go: torch.Tensor) -> torch.Tensor:
        def kept(x: torch.Tensor, n: int) -> torch.Tensor:
            return torch.cat([torch.zeros_like(x[..., :-n, :]), x[..., -n:, :]], -2)

        action = kept(action, self.shown - 1)
        action = torch.cat([action[..., 1:, :], torch.zeros_like(action[..., :1, :])], -2)
        return self.net(kept(observation, self.shown), action, kept(return_to_go, self.shown))[..., -1, :]


@pytest.mark.filterwarnings("ignore:randomisation_check. no layer's reset_parameters")  # GPT-2's Conv1D layers
@pytest.mark.parametrize("layout", ["[B]", "[B, T]"])
def test_a_decision_transformer_is_scored_on_the_context_it_was_given(layout):
    """torchrl's ``DecisionTransformerInferenceWrapper`` writes the last step's ``action`` and ``return_to_go`` over
    the context's: sensitivity_max and randomisation_check read the method's attributions against those, and refused
    them ("attribution ('attribution', 'action') of shape [3, 6, 2] does not broadcast to input 'action' of shape
    [3, 2]"). They equal the metrics of the same prediction written as a plain module of the context. A context
    given as ``[B, T]`` (a replay buffer's slices) is ``B`` samples, as the methods read it: the metrics refused it
    with the same message."""
    from tensordict.nn import TensorDictModule

    from tdhook.attribution import FeatureAblation, Saliency
    from tdhook.metrics import randomisation_check
    from tests.attribution.test_policy_targets import CONTEXT_KEYS, SHOWN, context, decision_transformer

    net, wrapper = decision_transformer("tanh_delta")
    plain = TensorDictModule(_LastStep(net, SHOWN), in_keys=list(CONTEXT_KEYS), out_keys=["param"])
    td, given = context("[B]"), context(layout)
    torch.testing.assert_close(wrapper(td.clone())["param"][:, -1], plain(td.clone())["param"], rtol=0, atol=0)
    for method in (Saliency, FeatureAblation):
        got = sensitivity_max(method(wrapper), given, seed=0, n_perturb_samples=3)
        expected = sensitivity_max(method(plain), td, seed=0, n_perturb_samples=3)
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    assert given.batch_size == context(layout).batch_size  # the caller's TensorDict keeps its batch
    got = randomisation_check(Saliency(wrapper), given, similarity="pearson")
    expected = randomisation_check(Saliency(plain), td, similarity="pearson")
    assert [name.split("module.0.module.")[-1] for name in got] == [name.split("net.")[-1] for name in expected]
    for score, expected_score in zip(got.values(), expected.values(), strict=True):
        torch.testing.assert_close(score, expected_score, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("metric", ["sensitivity_max", "randomisation_check"])
def test_a_method_explaining_both_heads_of_an_actor_value_operator_is_refused_by_name(metric):
    """LRP explains both heads of an ``ActorValueOperator`` by default, writing under ``"actor"`` and ``"critic"``;
    sensitivity_max read the attributions before looking at the target, and reported a missing attribution key with
    the advice to run an attribution method first. Both metrics now name the outputs and what to pass."""
    from tensordict.nn import TensorDictModule
    from torch.distributions import Categorical
    from torchrl.modules import ActorValueOperator, ProbabilisticActor, ValueOperator

    from tdhook import metrics
    from tdhook.attribution import LRP, EpsilonPlus

    body = TensorDictModule(nn.Linear(4, 8), in_keys=["observation"], out_keys=["hidden"])
    head = TensorDictModule(nn.Linear(8, 3), in_keys=["hidden"], out_keys=["logits"])
    actor = ProbabilisticActor(head, in_keys=["logits"], distribution_class=Categorical)
    operator = ActorValueOperator(body, actor, ValueOperator(nn.Linear(8, 1), in_keys=["hidden"]))
    td = TensorDict(observation=torch.randn(5, 4), batch_size=[5])
    with pytest.raises(TypeError, match=r"explains several outputs at once \(\['actor', 'critic'\].* target_key= one"):
        getattr(metrics, metric)(LRP(operator, EpsilonPlus()), td)
    scores = getattr(metrics, metric)(LRP(operator, EpsilonPlus(), target_key="state_value"), td)
    assert all(value.shape == (5,) for value in (scores.values() if isinstance(scores, dict) else [scores]))


def test_a_key_a_pipeline_computes_before_its_wrapper_is_refused_by_sensitivity_max():
    """In ``TensorDictSequential(scale, Saliency(policy))`` the explained ``obs`` is computed from ``raw`` by the
    step before the wrapper, which overwrote every perturbed ``obs``: sensitivity_max scored 0 for every sample (it is
    0.003 to 0.014 for the wrapper on the same ``obs``), or, without ``obs`` in the TensorDict, reported it missing.
    It is refused, naming the key and the step; the wrapper itself is scored on the pipeline's output."""
    from tensordict.nn import TensorDictModule, TensorDictSequential

    from tdhook.attribution import Saliency

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    wrapper = Saliency(TensorDictModule(net, in_keys=["obs"], out_keys=["q"]))
    pipeline = TensorDictSequential(TensorDictModule(lambda raw: raw * 2.0, ["raw"], ["obs"]), wrapper)
    td = TensorDict(raw=torch.randn(5, 4, dtype=torch.float64), batch_size=[5])
    output = pipeline(td.clone())
    message = r"^sensitivity_max: the method explains 'obs', which step 'module.0' \(TensorDictModule\) .* \['raw'\]"
    for given in (td, output.select("raw", "obs")):
        with pytest.raises(ValueError, match=message):
            sensitivity_max(pipeline, given, seed=0)
    scores = sensitivity_max(wrapper, output.select("obs"), seed=0)
    assert (scores > 1e-3).all()
