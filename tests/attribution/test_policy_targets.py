"""Default targets of torchrl pipelines: masked policies explain an allowed action; actor-critic pipelines both;
a decision transformer's inference wrapper the step it acts on."""

from __future__ import annotations

import warnings
from collections import OrderedDict

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import CompositeDistribution, TensorDictModule, TensorDictSequential
from torch import nn
from torch.distributions import Categorical, Normal
from torchrl.data import Bounded
from torchrl.envs.utils import ExplorationType, set_exploration_type
from torchrl.modules import (
    Actor,
    ActorCriticOperator,
    AdditiveGaussianModule,
    DecisionTransformerInferenceWrapper,
    DTActor,
    MaskedCategorical,
    MaskedOneHotCategorical,
    NormalParamExtractor,
    OneHotOrdinal,
    OnlineDTActor,
    Ordinal,
    OrnsteinUhlenbeckProcessModule,
    ProbabilisticActor,
    QValueActor,
    TanhDelta,
    TanhModule,
    TanhNormal,
    ValueOperator,
)

from tdhook.attribution import CPLRP, LRP, AttnLRP, EpsilonPlus, InputXGradient
from tdhook.attribution.mappers.base import BaseRuleMapper
from tdhook.attribution.rules import EpsilonRule, IgnoreRule

F64 = torch.float64


def masked_actor(distribution: type) -> ProbabilisticActor:
    torch.manual_seed(0)
    net = TensorDictModule(nn.Linear(4, 3).double(), in_keys=["observation"], out_keys=["logits"])
    return ProbabilisticActor(net, in_keys={"logits": "logits", "mask": "action_mask"}, distribution_class=distribution)


def masked_td(actor: ProbabilisticActor) -> TensorDict:
    observation = torch.randn(6, 4, dtype=F64)
    logits = actor.module[0](TensorDict(observation=observation, batch_size=[6]))["logits"]
    mask = torch.ones(6, 3, dtype=torch.bool)
    mask[torch.arange(6), logits.argmax(-1)] = False  # the plain argmax is forbidden everywhere
    return TensorDict(observation=observation, action_mask=mask, batch_size=[6])


def as_transition(td: TensorDict) -> TensorDict:
    """``td`` as a stored transition: with a ``"next"`` (its next state), as rollouts, collectors and replay buffers
    store steps. The action such a TensorDict holds is the action taken in its state."""
    return td.set("next", TensorDict(observation=td["observation"] + 1, batch_size=td.batch_size))


@pytest.mark.parametrize("distribution", [MaskedCategorical, MaskedOneHotCategorical], ids=lambda d: d.__name__)
def test_a_masked_policy_explains_the_best_allowed_action(distribution):
    actor = masked_actor(distribution)
    td = masked_td(actor)
    out = LRP(actor, EpsilonPlus(), in_keys=["observation"])(td.clone())
    logits = out["logits"]
    allowed = logits.masked_fill(~td["action_mask"], float("-inf")).argmax(-1)
    assert (allowed != logits.argmax(-1)).all()
    expected = LRP(actor, EpsilonPlus(), in_keys=["observation"], target=allowed)(td.clone())
    torch.testing.assert_close(out["relevance", "observation"], expected["relevance", "observation"])


@pytest.mark.parametrize(  # torchrl's MaskedCategorical reads padded indices with logits only
    ("scores", "allowed_by"),
    [("logits", "mask"), ("probs", "mask"), ("logits", "indices"), ("probs", "indices"), ("logits", "padded indices")],
)
def test_a_masked_policy_reading_probabilities_or_allowed_indices_explains_the_best_allowed_action(scores, allowed_by):
    """The plain argmax, forbidden in every row here, was explained for a distribution given probabilities or the
    allowed actions' indices (0.97 to 1.6 off, relative)."""
    torch.manual_seed(0)
    layers = [nn.Linear(4, 3).double()] + ([nn.Softmax(-1)] if scores == "probs" else [])
    net = TensorDictModule(nn.Sequential(*layers), in_keys=["observation"], out_keys=[scores])
    td = TensorDict(observation=torch.randn(6, 4, dtype=F64), batch_size=[6])
    plain_best = net(td.clone())[scores].argmax(-1)
    mask = torch.ones(6, 3, dtype=torch.bool)
    mask[torch.arange(6), plain_best] = False
    kwargs = {}
    if allowed_by == "mask":
        td["action_mask"] = mask
    else:
        td["action_mask"] = torch.stack([row.nonzero().squeeze(-1) for row in mask])  # the 2 allowed of 3
        if allowed_by == "padded indices":
            td["action_mask"] = torch.cat([td["action_mask"], torch.full((6, 1), -1)], -1)
            kwargs = {"distribution_kwargs": {"padding_value": -1}}
    argument = "mask" if allowed_by == "mask" else "indices"
    actor = ProbabilisticActor(
        net, in_keys={scores: scores, argument: "action_mask"}, distribution_class=MaskedCategorical, **kwargs
    )
    with set_exploration_type(ExplorationType.DETERMINISTIC):
        out = LRP(actor, in_keys=["observation"])(td.clone())
    allowed = out[scores].masked_fill(~mask, float("-inf")).argmax(-1)
    assert (allowed != plain_best).all() and torch.equal(out["action"], allowed)
    expected = LRP(actor, in_keys=["observation"], target=allowed)(td.clone())
    torch.testing.assert_close(out["relevance", "observation"], expected["relevance", "observation"])


@pytest.mark.parametrize("distribution", [MaskedCategorical, MaskedOneHotCategorical], ids=lambda d: d.__name__)
def test_a_masked_policy_explains_the_action_a_transition_holds(distribution):
    """A stored transition (with its ``"next"``) holds the action taken in its state, which is explained; a step
    without ``"next"`` (what a rollout gives the policy, holding the previous step's action) explains the best
    allowed action."""
    actor = masked_actor(distribution)
    td = masked_td(actor)
    logits = actor.module[0](td.clone())["logits"].detach()
    taken = logits.masked_fill(~td["action_mask"], float("inf")).argmin(-1)  # allowed, but not the best allowed
    best = logits.masked_fill(~td["action_mask"], float("-inf")).argmax(-1)
    assert (taken != best).all()
    td["action"] = nn.functional.one_hot(taken, 3).bool() if distribution is MaskedOneHotCategorical else taken
    for step, action in [(as_transition(td.clone()), taken), (td.clone(), best)]:
        out = LRP(actor, EpsilonPlus(), in_keys=["observation"])(step.clone())
        expected = LRP(actor, EpsilonPlus(), in_keys=["observation"], target=action)(step.clone())
        torch.testing.assert_close(out["relevance", "observation"], expected["relevance", "observation"])


def ordinal_action(scores: torch.Tensor) -> torch.Tensor:
    """The action of an ordinal distribution: the argmax of its log-probabilities, the log-sigmoid of the scores up
    to the action plus that of minus the scores after it."""
    ranks = torch.arange(scores.shape[-1])
    up_to = (ranks[None, :] <= ranks[:, None]).to(scores.dtype)
    log_sigmoid = nn.functional.logsigmoid
    return (log_sigmoid(scores) @ up_to.T + log_sigmoid(-scores) @ (1 - up_to).T).argmax(-1)


@pytest.mark.parametrize("distribution", [Ordinal, OneHotOrdinal], ids=lambda d: d.__name__)
def test_an_ordinal_policy_explains_the_action_it_takes(distribution):
    """Its action is the argmax of the ordinal log-probabilities made from the scores, not of the scores: the
    scores' argmax was explained, another action in 37 (Ordinal) and 26 (OneHotOrdinal) of 64 states (0.75 and 0.61
    off the gradient x input of the action taken). A stored transition explains the action it holds."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 5)).double()
    module = TensorDictModule(net, in_keys=["observation"], out_keys=["scores"])
    actor = ProbabilisticActor(module, in_keys=["scores"], distribution_class=distribution)
    td = TensorDict(observation=torch.randn(64, 4, dtype=F64), batch_size=[64])
    scores = net(td["observation"]).detach()
    action = ordinal_action(scores)
    assert (action != scores.argmax(-1)).sum() > 10
    with warnings.catch_warnings(), set_exploration_type(ExplorationType.DETERMINISTIC):
        warnings.simplefilter("ignore")  # tensordict's: the distribution has no deterministic_sample, its mode is used
        out = LRP(actor, BaseRuleMapper(), in_keys=["observation"])(td.clone())
        taken = out["action"].argmax(-1) if distribution is OneHotOrdinal else out["action"]
        assert torch.equal(taken, action)
        x = td["observation"].clone().requires_grad_(True)
        (gradient,) = torch.autograd.grad(net(x).gather(-1, action[:, None]).sum(), x)
        torch.testing.assert_close(out["relevance", "observation"], gradient * x.detach(), rtol=1e-12, atol=1e-12)
        saliency = InputXGradient(actor, in_keys=["observation"])(td.clone())
        torch.testing.assert_close(saliency["attribution", "observation"], gradient * x.detach())
        held = (action + 1) % 5  # a transition's action, not the mode
        td["action"] = nn.functional.one_hot(held, 5) if distribution is OneHotOrdinal else held
        out = LRP(actor, BaseRuleMapper(), in_keys=["observation"])(as_transition(td.clone()))
        expected = LRP(actor, BaseRuleMapper(), in_keys=["observation"], target=held)(as_transition(td.clone()))
    torch.testing.assert_close(out["relevance", "observation"], expected["relevance", "observation"])


class Critic(nn.Module):
    def __init__(self, features: int) -> None:
        super().__init__()
        self.layer = nn.Linear(features + 1, 1)

    def forward(self, state: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        return self.layer(torch.cat([state, action], -1))


def tanh_normal_actor(in_key: str, features: int) -> ProbabilisticActor:
    net = nn.Sequential(nn.Linear(features, 2), NormalParamExtractor())
    return ProbabilisticActor(
        TensorDictModule(net, in_keys=[in_key], out_keys=["loc", "scale"]),
        in_keys=["loc", "scale"],
        distribution_class=TanhNormal,
        default_interaction_type="deterministic",
    )


def test_an_actor_followed_by_its_critic_explains_both():
    torch.manual_seed(0)
    actor = tanh_normal_actor("observation", 4)
    critic = ValueOperator(Critic(4), in_keys=["observation", "action"])
    pipeline = TensorDictSequential(actor, critic).double()
    td = TensorDict(observation=torch.randn(5, 4, dtype=F64), batch_size=[5])
    out = LRP(pipeline, EpsilonPlus(), in_keys=["observation"])(td.clone())
    for name, key in {"actor": "loc", "critic": "state_action_value"}.items():
        alone = LRP(pipeline, EpsilonPlus(), in_keys=["observation"], target_key=key)(td.clone())
        torch.testing.assert_close(out["relevance", name, "observation"], alone["relevance", "observation"])


def test_steps_given_by_name_explain_as_steps_given_in_order():
    """``TensorDictSequential`` takes its steps as an ordered dict of names too (its ``module`` is then a
    ``ModuleDict``): the actor followed by its critic explains both, as with the steps given in order."""
    torch.manual_seed(0)
    actor = tanh_normal_actor("observation", 4)
    critic = ValueOperator(Critic(4), in_keys=["observation", "action"])
    named = TensorDictSequential(OrderedDict(actor=actor, critic=critic)).double()
    td = TensorDict(observation=torch.randn(5, 4, dtype=F64), batch_size=[5])
    out = LRP(named, EpsilonPlus(), in_keys=["observation"])(td.clone())
    expected = LRP(TensorDictSequential(actor, critic), EpsilonPlus(), in_keys=["observation"])(td.clone())
    for name in ("actor", "critic"):
        torch.testing.assert_close(out["relevance", name, "observation"], expected["relevance", name, "observation"])


def test_a_pipeline_of_named_steps_explains_its_last_output():
    """The default target of steps given by name is the last step's output, as for steps given in order."""
    torch.manual_seed(0)
    first = TensorDictModule(nn.Linear(3, 4).double(), in_keys=["x"], out_keys=["h"])
    last = TensorDictModule(nn.Linear(4, 2).double(), in_keys=["h"], out_keys=["y"])
    td = TensorDict(x=torch.randn(5, 3, dtype=F64), batch_size=[5])
    named = LRP(TensorDictSequential(OrderedDict(first=first, last=last)))(td.clone())
    ordered = LRP(TensorDictSequential(first, last))(td.clone())
    torch.testing.assert_close(named["relevance", "x"], ordered["relevance", "x"])


def test_actor_critic_operator_explains_both_heads():
    torch.manual_seed(0)
    common = TensorDictModule(nn.Linear(4, 8), in_keys=["observation"], out_keys=["hidden"])
    operator = ActorCriticOperator(
        common, tanh_normal_actor("hidden", 8), ValueOperator(Critic(8), in_keys=["hidden", "action"])
    ).double()
    td = TensorDict(observation=torch.randn(5, 4, dtype=F64), batch_size=[5])
    out = LRP(operator, EpsilonPlus())(td.clone())
    for name, key in {"actor": "loc", "critic": "state_action_value"}.items():
        alone = LRP(operator, EpsilonPlus(), target_key=key)(td.clone())
        torch.testing.assert_close(out["relevance", name, "observation"], alone["relevance", "observation"])


def test_a_composite_distribution_actor_needs_no_manual_keys():
    class Heads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 5)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            h = self.layer(x)
            return h[..., :3], h[..., 3:4], nn.functional.softplus(h[..., 4:5]) + 0.1

    keys = [("params", "cat", "logits"), ("params", "normal", "loc"), ("params", "normal", "scale")]
    net = TensorDictModule(Heads().double(), in_keys=["observation"], out_keys=keys)
    actor = ProbabilisticActor(
        net,
        in_keys=["params"],  # filled by the network itself
        distribution_class=CompositeDistribution,
        distribution_kwargs={"distribution_map": {"cat": Categorical, "normal": Normal}},
        return_log_prob=True,
    )
    td = TensorDict(observation=torch.randn(5, 4, dtype=F64), batch_size=[5])
    lrp = LRP(actor, EpsilonPlus())
    assert lrp.explained_keys == ["observation"]
    out = lrp(td.clone())
    expected = LRP(net, EpsilonPlus(), target_key=keys[0])(td.clone())
    torch.testing.assert_close(out["relevance", "observation"], expected["relevance", "observation"])


# A decision transformer (torchrl's, on a GPT-2 from a tiny random config) reads a context of T steps and its
# inference wrapper outputs the action of the last one.
CONTEXT_KEYS = ("observation", "action", "return_to_go")
CONTEXT, SHOWN = 6, 4  # steps in the context; steps the wrapper leaves unmasked
# The actor's output explained by default, per kind of actor: a DTActor's action (under TanhDelta, its parameter),
# an OnlineDTActor's mean, or the action a bare DTActor writes.
DEFAULT_KEY = {"tanh_delta": "param", "online": "loc", "plain": "action"}


def decision_transformer(kind: str) -> tuple[nn.Module, DecisionTransformerInferenceWrapper]:
    torch.manual_seed(0)
    config = DTActor.default_config()
    for name, value in dict(n_embd=16, n_layer=2, n_head=2, n_inner=32, n_positions=32).items():
        setattr(config, name, value)
    config.resid_pdrop = config.attn_pdrop = 0.0
    if kind == "online":
        net = OnlineDTActor(state_dim=4, action_dim=2, transformer_config=config)
        module = TensorDictModule(net, in_keys=list(CONTEXT_KEYS), out_keys=["loc", "scale"])
        actor = ProbabilisticActor(
            module, in_keys=["loc", "scale"], distribution_class=TanhNormal, default_interaction_type="deterministic"
        )
    else:
        net = DTActor(state_dim=4, action_dim=2, transformer_config=config)
        module = TensorDictModule(net, in_keys=list(CONTEXT_KEYS), out_keys=[DEFAULT_KEY[kind]])
        bounds = {"low": -1.0, "high": 1.0}
        actor = (
            ProbabilisticActor(module, in_keys=["param"], distribution_class=TanhDelta, distribution_kwargs=bounds)
            if kind == "tanh_delta"
            else module
        )
    net.double().eval()  # eval: GPT-2's embedding dropout
    return net, DecisionTransformerInferenceWrapper(actor, inference_context=SHOWN)


def context(layout: str, batch: int = 3) -> TensorDict:
    generator = torch.Generator().manual_seed(1)
    values = {
        k: torch.randn(batch, CONTEXT, n, generator=generator, dtype=F64)
        for k, n in zip(CONTEXT_KEYS, (4, 2, 1), strict=True)
    }
    return TensorDict(values, batch_size=[batch] if layout == "[B]" else [batch, CONTEXT])


def last_step_by_hand(
    wrapper: DecisionTransformerInferenceWrapper, td: TensorDict, key: str
) -> tuple[dict, torch.Tensor]:
    """Gradient x input of the last step's largest unit of ``key``, and that unit's value, from plain autograd."""
    td = td.clone()
    leaves = {k: td[k].detach().requires_grad_(True) for k in CONTEXT_KEYS}
    td.update(leaves)
    output = wrapper(td)[key]
    output = output if key == "action" else output[..., -1, :]  # the wrapper cuts its action to the last step
    chosen = output.gather(-1, output.argmax(-1, keepdim=True)).squeeze(-1)
    chosen.sum().backward()
    return {k: v.detach() * v.grad for k, v in leaves.items()}, chosen.detach()


@pytest.mark.parametrize("layout", ["[B]", "[B, T]"])
@pytest.mark.parametrize("kind", sorted(DEFAULT_KEY))
def test_a_decision_transformer_explains_the_step_it_acts_on(kind, layout):
    """LRP-0 (every module on the plain gradient) is gradient x input of the last step's prediction, on every
    context key, in the context's shape; on a [B, T] layout the result has the wrapper's batch [B] and the
    caller's TensorDict is left as the wrapper leaves it (unchanged)."""
    _, wrapper = decision_transformer(kind)
    td = context(layout)
    before = td.clone()
    expected, _ = last_step_by_hand(wrapper, td, DEFAULT_KEY[kind])
    lrp = LRP(wrapper, BaseRuleMapper(rule_mapper=lambda name, module: IgnoreRule()))
    assert lrp.explained_keys == list(CONTEXT_KEYS)
    with warnings.catch_warnings(record=True) as caught:  # LayerNorm and attention on their plain gradient: as
        warnings.simplefilter("always")  # asked, so no word of it; only of the default target among the action's
        out = lrp(td)  # dimensions, the one of largest value in each sample
    continuous = (
        [] if kind == "plain" else [f"LRP: target=None explains, in each sample, the unit of {DEFAULT_KEY[kind]!r}"]
    )
    assert [str(w.message)[: len(continuous[0])] if continuous else str(w.message) for w in caught] == continuous
    assert out.batch_size == torch.Size([3])
    assert out["action"].shape == (3, 2)
    for key in CONTEXT_KEYS:
        assert out["relevance", key].shape == before[key].shape
        torch.testing.assert_close(out["relevance", key], expected[key], rtol=1e-10, atol=1e-12)
    # The wrapper masks all but the last SHOWN steps (actions: one step fewer, shifted by one): they get nothing.
    assert (out["relevance", "observation"][:, : CONTEXT - SHOWN] == 0).all()
    assert out["relevance", "observation"][:, CONTEXT - SHOWN :].abs().sum() > 0
    if layout == "[B, T]":
        assert td.batch_size == (3, CONTEXT) and "relevance" not in td.keys()
        assert (td == before).all()


@pytest.mark.parametrize("preset", [CPLRP, AttnLRP], ids=lambda p: p.__name__)
@pytest.mark.parametrize("kind", ["tanh_delta", "online"])
def test_a_decision_transformer_under_transformer_presets(kind, preset):
    """With biases and the position embeddings zeroed, CP-LRP conserves the last step's prediction over the
    whole context; AttnLRP's softmax rule does not conserve by design (0.4 % here), so it is only held to 5 %."""
    net, wrapper = decision_transformer(kind)
    with torch.no_grad():
        for name, parameter in net.named_parameters():
            if "bias" in name or "wpe" in name:
                parameter.zero_()
    td = context("[B]")
    _, chosen = last_step_by_hand(wrapper, td, DEFAULT_KEY[kind])
    out = LRP(wrapper, preset())(td.clone())
    relevance = [out["relevance", key] for key in CONTEXT_KEYS]
    assert all(r.isfinite().all() for r in relevance)
    total = sum(r.flatten(1).sum(1) for r in relevance)
    error = ((total - chosen).abs() / chosen.abs()).max()
    assert error <= (1e-10 if preset is CPLRP else 0.05), error


@pytest.mark.parametrize("layout", ["[B]", "[B, T]"])
def test_the_other_methods_explain_the_same_step(layout):
    _, wrapper = decision_transformer("tanh_delta")
    td = context(layout)
    expected, _ = last_step_by_hand(wrapper, td, "param")
    out = InputXGradient(wrapper)(td)
    assert out.batch_size == torch.Size([3]) and td.batch_size == context(layout).batch_size
    for key in CONTEXT_KEYS:
        torch.testing.assert_close(out["attribution", key], expected[key], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("exploration", ["OrnsteinUhlenbeck", "AdditiveGaussian"])
def test_an_exploring_policy_explains_the_action_it_takes(exploration):
    """DDPG's and TD3's exploring policies add noise to the actor's action; the noise process's own state keys
    (``_ou_prev_noise``, ``_ou_steps``) are no output to explain. The action taken is: its relevance is the
    actor's, the noise being a constant of the call."""
    torch.manual_seed(0)
    spec = Bounded(-2.0, 2.0, (1,), dtype=F64)
    actor = TensorDictSequential(
        Actor(
            nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1)).double(),
            in_keys=["observation"],
            out_keys=["param"],
        ),
        TanhModule(in_keys=["param"], out_keys=["action"], spec=spec),
    )
    noise = OrnsteinUhlenbeckProcessModule(spec=spec) if exploration == "OrnsteinUhlenbeck" else None
    noise = noise or AdditiveGaussianModule(spec=spec, sigma_init=0.5, sigma_end=0.5)
    policy = TensorDictSequential(actor, noise)
    td = TensorDict(
        observation=torch.randn(5, 3, dtype=F64), is_init=torch.ones(5, 1, dtype=torch.bool), batch_size=[5]
    )
    with set_exploration_type(ExplorationType.RANDOM):
        torch.manual_seed(1)
        plain = policy(td.clone())
        torch.manual_seed(1)
        out = LRP(policy, EpsilonPlus())(td.clone())
    assert torch.equal(out["action"], plain["action"])
    assert not torch.equal(out["action"], actor(td.clone())["action"])  # the noise is there
    assert list(out["relevance"].keys()) == ["observation"]
    alone = LRP(actor, EpsilonPlus())(td.clone())
    torch.testing.assert_close(out["relevance", "observation"], alone["relevance", "observation"])


def exploring_to_the_bounds(exploration: str, activation: nn.Module) -> tuple[nn.Module, Actor, TensorDictSequential]:
    """An actor of two actions bound to [-1, 1] (its network: two Linear layers around ``activation``) and its
    exploring policy, whose noise (σ = 5) often reaches the bounds: the network, the actor and the policy."""
    torch.manual_seed(0)
    spec = Bounded(-1.0, 1.0, (2,), dtype=F64)
    net = nn.Sequential(nn.Linear(3, 8), activation, nn.Linear(8, 2)).double()
    actor = Actor(net, in_keys=["observation"], spec=spec)
    if exploration == "OrnsteinUhlenbeck":
        noise = OrnsteinUhlenbeckProcessModule(spec=spec, sigma=5.0, theta=0.0)
    else:
        noise = AdditiveGaussianModule(spec=spec, sigma_init=5.0, sigma_end=5.0)
    return net, actor, TensorDictSequential(actor, noise)


@pytest.mark.parametrize("exploration", ["OrnsteinUhlenbeck", "AdditiveGaussian"])
@pytest.mark.parametrize("calls", [1, 3], ids=["one-call", "three-calls-in-a-context"])
def test_an_exploring_policy_whose_noise_reaches_the_bounds_still_explains_the_actor(exploration, calls):
    """The exploration step projects the noisy action into the spec (a clamp). That projection is part of the
    perturbation, a constant of the call like the noise: a clamped step keeps the actor's relevance instead of
    getting none."""
    net, _, policy = exploring_to_the_bounds(exploration, nn.ReLU())
    td = TensorDict(
        observation=torch.randn(16, 3, dtype=F64), is_init=torch.ones(16, 1, dtype=torch.bool), batch_size=[16]
    )
    lrp = LRP(policy, target="all")
    with set_exploration_type(ExplorationType.RANDOM), lrp:
        for _ in range(calls):
            torch.manual_seed(1)
            plain = policy(td.clone())
            torch.manual_seed(1)
            out = lrp(td.clone())
    assert torch.equal(out["action"], plain["action"])
    assert (out["action"].abs() == 1).any() and (out["action"].abs() < 1).any()  # some steps hit the bounds
    x = td["observation"].clone().requires_grad_(True)
    expected = torch.stack([x.detach() * torch.autograd.grad(net(x)[:, unit].sum(), x)[0] for unit in range(2)], 1)
    torch.testing.assert_close(out["relevance", "observation"], expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("exploration", ["OrnsteinUhlenbeck", "AdditiveGaussian"])
def test_an_exploring_policy_kept_differentiable_gives_its_action_the_plain_gradient(exploration):
    """With ``create_graph=True`` the action taken keeps its graph: a loss on it gives the actor's parameters and
    the observation the plain gradient, the projection into the spec included (zero at a bound), while the relevance
    still holds the perturbation constant. Before, the action taken carried no gradient but the relevance pass's: a
    loss on it gave every parameter a zero gradient."""
    net, actor, policy = exploring_to_the_bounds(exploration, nn.Tanh())
    observation = torch.randn(16, 3, dtype=F64)

    def run(module: nn.Module) -> tuple[TensorDict, list[torch.Tensor]]:
        x = observation.clone().requires_grad_()
        td = TensorDict(observation=x, is_init=torch.ones(16, 1, dtype=torch.bool), batch_size=[16])
        with set_exploration_type(ExplorationType.RANDOM):
            torch.manual_seed(1)
            out = module(td)
        return out, list(torch.autograd.grad(out["action"].square().sum(), [x, *net.parameters()]))

    plain, expected = run(policy)
    out, grads = run(LRP(policy, EpsilonPlus(), target_key="action", target="all", create_graph=True))
    assert torch.equal(out["action"].detach(), plain["action"])
    assert (plain["action"].abs() == 1).any() and (plain["action"].abs() < 1).any()  # some steps hit the bounds
    for grad, reference in zip(grads, expected, strict=True):
        assert reference.any()
        torch.testing.assert_close(grad, reference, rtol=1e-12, atol=1e-14)
    alone = LRP(actor, EpsilonPlus(), target="all")(TensorDict(observation=observation.clone(), batch_size=[16]))
    torch.testing.assert_close(out["relevance", "observation"].detach(), alone["relevance", "observation"])


@pytest.mark.parametrize("distribution", [MaskedCategorical, MaskedOneHotCategorical], ids=lambda d: d.__name__)
@pytest.mark.parametrize("held", [False, True], ids=["best-allowed", "held-action"])
def test_masked_agents_explain_each_agents_allowed_or_held_action(distribution, held):
    """The logits, mask and action of a multi-agent policy live under the agents' key, with the agents in its
    batch: each agent's action (the one the TensorDict holds, else its best allowed one) is explained."""
    from torchrl.modules import MultiAgentMLP

    torch.manual_seed(0)
    batch, agents, actions = 4, 3, 5
    net = MultiAgentMLP(
        4, actions, n_agents=agents, centralized=True, share_params=False, depth=1, activation_class=nn.ReLU
    ).double()
    actor = ProbabilisticActor(
        TensorDictModule(net, in_keys=[("agents", "observation")], out_keys=[("agents", "logits")]),
        in_keys={"logits": ("agents", "logits"), "mask": ("agents", "action_mask")},
        out_keys=[("agents", "action")],
        distribution_class=distribution,
    )
    observation = torch.randn(batch, agents, 4, dtype=F64)
    mask = torch.rand(batch, agents, actions) > 0.5
    mask[..., 0] = True
    logits = net(observation).detach()
    chosen = torch.multinomial(mask.double().flatten(0, 1), 1).reshape(batch, agents)
    if not held:
        chosen = logits.masked_fill(~mask, float("-inf")).argmax(-1)
    agents_td = TensorDict(observation=observation, action_mask=mask, batch_size=[batch, agents])
    if held:
        one_hot = distribution is MaskedOneHotCategorical
        agents_td["action"] = nn.functional.one_hot(chosen, actions) if one_hot else chosen
    td = TensorDict(agents=agents_td, batch_size=[batch])
    if held:  # a stored transition, with its next state
        td["next"] = TensorDict(agents=agents_td.select("observation").apply(lambda t: t + 1), batch_size=[batch])
    out = LRP(actor)(td)
    x = observation.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(net(x).gather(-1, chosen.unsqueeze(-1)).sum(), x)
    torch.testing.assert_close(out["relevance", "agents", "observation"], x.detach() * grad, rtol=1e-10, atol=1e-12)


def test_a_one_hot_action_held_for_an_index_policy_is_told_how_to_explain_it():
    """A one-hot environment's random frames (a collector's init_random_frames) store one-hot actions; an index
    policy (MaskedCategorical) explaining them was refused with the keys and shapes only. The error now says what the
    action looks like and what to pass, and that target explains the stored action."""
    actor = masked_actor(MaskedCategorical)
    td = masked_td(actor)
    allowed = td["action_mask"].double().argmax(-1)
    td = as_transition(td.set("action", nn.functional.one_hot(allowed, 3)))
    with pytest.raises(ValueError, match=r"\(shape \[6, 3\]\) is not one action per row.* looks one-hot.*argmax"):
        LRP(actor)(td.clone())
    out = LRP(actor, target=td["action"].argmax(-1))(td.clone())
    x = td["observation"].clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(actor.module[0].module(x).gather(-1, allowed.unsqueeze(-1)).sum(), x)
    torch.testing.assert_close(out["relevance", "observation"], x.detach() * grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("distribution", [MaskedCategorical, MaskedOneHotCategorical], ids=lambda d: d.__name__)
def test_a_held_action_that_is_not_one_per_row_of_logits_is_named(distribution):
    actor = masked_actor(distribution)
    td = masked_td(actor)
    td = as_transition(td.set("action", torch.zeros(6, 2, 2, dtype=torch.long)))  # two actions per sample
    before = td.clone()
    with pytest.raises(ValueError, match=r"action at 'action' \(shape \[6, 2, 2\]\) is not one action per row"):
        LRP(actor)(td)
    assert set(td.keys()) == set(before.keys()) and (td == before).all()


@pytest.mark.parametrize("distribution", [MaskedCategorical, MaskedOneHotCategorical], ids=lambda d: d.__name__)
def test_a_held_action_the_mask_forbids_is_refused_naming_both_keys(distribution):
    """No policy took an action its mask forbids: explaining it as the action taken was silently wrong."""
    actor = masked_actor(distribution)
    td = masked_td(actor)
    held = (~td["action_mask"]).long().argmin(-1)  # the first allowed action of each row
    td["action_mask"][-1] = False  # a row that allows nothing (padding) has no action taken to tell apart
    one_hot = distribution is MaskedOneHotCategorical

    def holding(actions: torch.Tensor) -> TensorDict:
        return as_transition(td.clone().set("action", nn.functional.one_hot(actions, 3).bool() if one_hot else actions))

    out = LRP(actor)(holding(held))
    expected = LRP(actor, target=held)(holding(held))
    torch.testing.assert_close(out["relevance", "observation"], expected["relevance", "observation"])
    forbidden = held.clone()
    forbidden[0] = (~td["action_mask"][0]).long().argmax()
    stale = holding(forbidden)
    before = stale.clone()
    message = r"action at 'action'.* forbidden by the mask at 'action_mask' at rows \[\(0,\)\]"
    with pytest.raises(ValueError, match=message):
        LRP(actor)(stale)
    assert set(stale.keys()) == set(before.keys()) and (stale == before).all()


def _masked_cartpole(parity: bool):
    """CartPole with an action mask: both actions allowed, or (``parity``) the left one at even steps and the right
    one at odd steps, so that the previous step's action is always forbidden."""
    from torchrl.data import Binary
    from torchrl.envs import GymEnv, StepCounter, Transform, TransformedEnv

    class ActionMask(Transform):
        def __init__(self) -> None:
            super().__init__(in_keys=["step_count"], out_keys=["action_mask"])

        def _call(self, td: TensorDict) -> TensorDict:
            even = td["step_count"] % 2 == 0
            return td.set("action_mask", torch.cat([even, ~even], -1) if parity else torch.ones_like(even).expand(2))

        def _reset(self, td: TensorDict, reset: TensorDict) -> TensorDict:
            return self._call(reset)

        def transform_observation_spec(self, spec):
            spec["action_mask"] = Binary(n=2, shape=(2,), dtype=torch.bool)
            return spec

    env = TransformedEnv(GymEnv("CartPole-v1", categorical_action_encoding=True), StepCounter())
    env.append_transform(ActionMask())
    env.set_seed(0)
    return env


def _masked_cartpole_actor() -> ProbabilisticActor:
    net = nn.Linear(4, 2, bias=False)
    with torch.no_grad():  # push towards where the pole falls: the greedy action changes every few steps
        net.weight.copy_(torch.tensor([[0.0, 0.0, -1.0, -1.0], [0.0, 0.0, 1.0, 1.0]]))
    net = TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])
    keys = {"logits": "logits", "mask": "action_mask"}
    return ProbabilisticActor(net, in_keys=keys, distribution_class=MaskedCategorical)


@pytest.mark.parametrize("parity", [False, True], ids=["both-allowed", "previous-forbidden"])
def test_a_masked_policy_in_a_rollout_explains_the_action_of_each_step(parity):
    """torchrl's env.rollout gives the policy each step's TensorDict holding the previous step's action (with
    ``parity``, always forbidden by the new mask): that action was explained in place of the step's own (2.0 off,
    relative, with both allowed), or refused as forbidden."""
    actor = _masked_cartpole_actor()
    with set_exploration_type(ExplorationType.DETERMINISTIC):
        rollout = _masked_cartpole(parity=parity).rollout(20, LRP(actor), break_when_any_done=False)
    assert rollout["action"].unique().numel() == 2  # the action changes along the rollout
    assert (rollout["action"][1:] != rollout["action"][:-1]).any()
    steps = rollout.exclude("relevance", "next")  # each step with its own action
    expected = LRP(actor, target=rollout["action"])(steps)["relevance", "observation"]
    torch.testing.assert_close(rollout["relevance", "observation"], expected)
    # The collected TensorDict, a transition per step, explains the same actions.
    again = LRP(actor)(rollout.exclude("relevance"))["relevance", "observation"]
    torch.testing.assert_close(again, expected)


@pytest.mark.parametrize("method", ["Saliency", "IntegratedGradients", "Occlusion"])
def test_the_other_methods_explain_the_allowed_action_of_a_masked_policy_as_lrp(method):
    """They explained the plain argmax, a forbidden action, where LRP explains the highest allowed logit: a metric
    could not score the unit both explained."""
    import tdhook.attribution as attribution

    actor = masked_actor(MaskedCategorical)
    td = masked_td(actor)
    kwargs = {"sliding_window_shapes": {"observation": (1,)}} if method == "Occlusion" else {}
    wrapper = getattr(attribution, method)
    out = wrapper(actor, in_keys=["observation"], target_key="logits", **kwargs)(td.clone())
    allowed = out["logits"].masked_fill(~td["action_mask"], float("-inf")).argmax(-1)
    expected = wrapper(actor, in_keys=["observation"], target_key="logits", target=allowed, **kwargs)(td.clone())
    torch.testing.assert_close(out["attribution", "observation"], expected["attribution", "observation"])


def distributional_actor(action_space: str = "categorical", atoms: int = 5, actions: int = 3):
    """torchrl's distributional DQN policy: an MLP of ReLUs whose output is read as ``atoms x actions`` logits,
    log-softmaxed over the atoms."""
    from torchrl.modules import MLP, DistributionalQValueActor

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = MLP(in_features=4, out_features=atoms * actions, num_cells=[16], activation_class=nn.ReLU)

        def forward(self, observation: torch.Tensor) -> torch.Tensor:
            return self.mlp(observation).unflatten(-1, (atoms, actions))

    torch.manual_seed(0)
    net = TensorDictModule(Net(), in_keys=["observation"], out_keys=["action_value"])
    support = torch.linspace(-1.0, 1.0, atoms, dtype=F64)
    return DistributionalQValueActor(net, support=support, action_space=action_space).to(F64)


def greedy_distributional(out: TensorDict, support: torch.Tensor) -> torch.Tensor:
    """The action whose expected return over the support is highest, at every atom."""
    expected = (out["action_value"].exp() * support[:, None]).sum(-2)
    return expected.argmax(-1, keepdim=True).expand(out["action_value"].shape[:-1])


@pytest.mark.filterwarnings("ignore:LRP. module .* computes log_softmax")
def test_a_distributional_q_actor_explains_its_greedy_action_at_every_atom():
    """The action values are ``[batch, atoms, actions]``: the argmax of the last dimension took at each atom the
    action most likely there (a mix of actions; 1.6 off, relative, on this batch); the greedy action, whose expected
    return is highest, is explained at every atom, as a ``QValueActor`` explains its chosen action."""
    actor = distributional_actor()
    observation = torch.randn(16, 4, dtype=F64, generator=torch.Generator().manual_seed(1))
    td = TensorDict(observation=observation, batch_size=[16])
    out = LRP(actor, BaseRuleMapper(stabilizer=1e-12), target_key="action_value")(td.clone())
    greedy = greedy_distributional(out, actor.support)
    assert (out["action_value"].argmax(-1) != greedy).any()  # the per-atom argmax mixes in other actions
    assert torch.equal(greedy[:, 0], out["action"])  # the action the actor takes
    # LRP-0 on ReLUs (the log-softmax keeps its plain gradient): gradient × input of the greedy action's values.
    x = td["observation"].clone().requires_grad_()
    values = actor.module[0](TensorDict(observation=x, batch_size=[16]))["action_value"]
    log_probs = torch.log_softmax(values, -2)
    seed = torch.zeros_like(log_probs).scatter_(-1, greedy.unsqueeze(-1), 1.0)
    expected = x.detach() * torch.autograd.grad(log_probs, x, seed)[0]
    torch.testing.assert_close(out["relevance", "observation"], expected, rtol=1e-10, atol=1e-12)
    by_index = LRP(actor, BaseRuleMapper(stabilizer=1e-12), target_key="action_value", target=greedy)(td.clone())
    torch.testing.assert_close(out["relevance", "observation"], by_index["relevance", "observation"])


def test_a_distributional_q_actor_without_a_target_key_is_refused_naming_its_action_values():
    """Its default output is the integer action: the refusal asked for a target_key without naming the output a
    user means, the float ``action_value``."""
    actor = distributional_actor()
    td = TensorDict(observation=torch.randn(3, 4, dtype=F64), batch_size=[3])
    with pytest.raises(KeyError, match=r"pass target_key \(its floating-point outputs: 'action_value'\)"):
        LRP(actor, BaseRuleMapper())(td)


@pytest.mark.filterwarnings("ignore:LRP. module .* computes log_softmax")
@pytest.mark.parametrize("method", ["Saliency", "IntegratedGradients", "Occlusion"])
def test_the_other_methods_explain_a_distributional_q_actors_greedy_action(method):
    import tdhook.attribution as attribution

    actor = distributional_actor()
    observation = torch.randn(8, 4, dtype=F64, generator=torch.Generator().manual_seed(2))
    td = TensorDict(observation=observation, batch_size=[8])
    kwargs = {"sliding_window_shapes": {"observation": (1,)}} if method == "Occlusion" else {}
    wrapper = getattr(attribution, method)
    out = wrapper(actor, target_key="action_value", **kwargs)(td.clone())
    greedy = greedy_distributional(out, actor.support)
    assert (out["action_value"].argmax(-1) != greedy).any()
    expected = wrapper(actor, target_key="action_value", target=greedy, **kwargs)(td.clone())
    torch.testing.assert_close(out["attribution", "observation"], expected["attribution", "observation"])


@pytest.mark.filterwarnings("ignore:LRP. module .* computes log_softmax")
def test_a_distributional_q_actor_in_a_cartpole_rollout_explains_the_action_of_each_step():
    """Run by torchrl's env.rollout on CartPole, each step explains the action it takes, at every atom."""
    from torchrl.envs import GymEnv

    env = GymEnv("CartPole-v1", categorical_action_encoding=True)
    env.set_seed(0)
    actor = distributional_actor(atoms=5, actions=2).to(torch.float32)
    rollout = env.rollout(12, LRP(actor, target_key="action_value"), break_when_any_done=False)
    greedy = rollout["action"][:, None].expand(rollout["action_value"].shape[:-1])
    assert (rollout["action_value"].argmax(-1) != greedy).any()  # the per-atom argmax differs somewhere
    steps = rollout.exclude("relevance", "next")
    expected = LRP(actor, target_key="action_value", target=greedy)(steps)["relevance", "observation"]
    torch.testing.assert_close(rollout["relevance", "observation"], expected)


def test_a_distributional_q_actor_with_several_one_hot_actions_is_refused_naming_the_module():
    """Its action is several units of each row: no per-row index names it, so a target is asked for."""
    from torchrl.modules import MLP, DistributionalQValueActor

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = MLP(in_features=4, out_features=3 * 5, num_cells=[8])

        def forward(self, observation: torch.Tensor) -> torch.Tensor:
            return self.mlp(observation).unflatten(-1, (3, 5))

    support = torch.linspace(-1.0, 1.0, 3)
    actor = DistributionalQValueActor(
        Net(), in_keys=["observation"], support=support, action_space="mult_one_hot", var_nums=[2, 3]
    )
    td = TensorDict(observation=torch.randn(2, 4), batch_size=[2])
    with pytest.raises(ValueError, match=r"DistributionalQValueModule with action space 'mult_one_hot'.*pass a target"):
        LRP(actor, target_key="action_value")(td.clone())
    assert set(td.keys()) == {"observation"}


@pytest.mark.parametrize(
    "distribution", [MaskedCategorical, MaskedOneHotCategorical, Ordinal], ids=lambda d: d.__name__
)
@pytest.mark.parametrize("wrapper", ["LRP", "InputXGradient"])
def test_a_transition_keeps_the_action_it_holds_and_a_metric_scores_it(distribution, wrapper):
    """The action explained is the transition's; the call's own draw was written over it (a new sample, another
    action in 59 to 65 of 96 rows here), so the output held an action no relevance was computed for, and pixel
    flipping of that output scored it (0.15 to 0.18 off, relative). The log-probability written is the held
    action's."""
    from tdhook.metrics import pixel_flipping

    torch.manual_seed(0)
    scores = "scores" if distribution is Ordinal else "logits"
    net = TensorDictModule(nn.Linear(4, 3).double(), in_keys=["observation"], out_keys=[scores])
    keys = {scores: scores} if distribution is Ordinal else {"logits": "logits", "mask": "action_mask"}
    actor = ProbabilisticActor(net, in_keys=keys, distribution_class=distribution, return_log_prob=True)
    td = TensorDict(observation=torch.randn(96, 4, dtype=F64), action_mask=torch.ones(96, 3, dtype=torch.bool))
    log_prob_key = actor.module[-1].out_keys[1]
    with set_exploration_type(ExplorationType.RANDOM):
        td = as_transition(td.set("action", actor(td.clone())["action"]))  # what a collector stored
        held = td["action"].argmax(-1) if distribution is MaskedOneHotCategorical else td["action"]
        explainer = LRP(actor, in_keys=["observation"]) if wrapper == "LRP" else InputXGradient(actor)
        out = explainer(td.clone())
        assert torch.equal(out["action"], td["action"]) and log_prob_key not in td.keys()
        dist = actor.get_dist(out)
        torch.testing.assert_close(out[log_prob_key], dist.log_prob(td["action"].to(out["action"].dtype)))
        relevance_key = "relevance" if wrapper == "LRP" else "attribution"
        scored = pixel_flipping(actor, out, in_keys=["observation"], relevance_key=relevance_key)
        expected = pixel_flipping(actor, out, in_keys=["observation"], relevance_key=relevance_key, target=held)
    torch.testing.assert_close(scored, expected)


def gaussian_actor(dimensions: int) -> ProbabilisticActor:
    net = nn.Sequential(nn.Linear(4, 2 * dimensions), NormalParamExtractor()).double()
    module = TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"])
    return ProbabilisticActor(module, in_keys=["loc", "scale"], distribution_class=TanhNormal)


def target_words(explainer, **options) -> list[str]:
    td = TensorDict(observation=torch.randn(5, 4, dtype=torch.float64), batch_size=[5])
    with warnings.catch_warnings(record=True) as caught, set_exploration_type(ExplorationType.DETERMINISTIC):
        warnings.simplefilter("always")
        explainer(td)
    return [str(w.message) for w in caught if "target=None explains" in str(w.message)]


@pytest.mark.parametrize("method", [LRP, InputXGradient], ids=["lrp", "method"])
def test_the_default_target_among_a_continuous_actions_dimensions_is_warned_of(method):
    """``target=None`` explains the unit of largest value, which is the action taken for action values and logits;
    among the dimensions of a continuous action (a TanhNormal's ``loc``, a DDPG actor's output) no dimension is, and
    each sample explained the dimension whose mean was largest with no word."""
    torch.manual_seed(0)
    gaussian = gaussian_actor(3)
    ddpg = Actor(nn.Linear(4, 3).double(), spec=Bounded(-1.0, 1.0, (3,), dtype=torch.float64))
    (message,) = target_words(method(gaussian))
    assert message.startswith(f"{method.__name__}: target=None explains")  # the method names itself
    assert "unit of 'loc'" in message and "3 dimensions of a continuous action (the TanhNormal parameter" in message
    assert "target='all'" in message
    (message,) = target_words(method(ddpg))
    assert "unit of 'action'" in message and "(the output of Actor under a BoundedContinuous action spec)" in message
    (message,) = target_words(method(gaussian, target_key="action"))
    assert "(the TanhNormal sample of" in message
    # An explicit target, one dimension (Pendulum's), a categorical head and a Q-value actor say nothing.
    assert target_words(method(gaussian, target=1)) == target_words(method(gaussian, target="all")) == []
    assert target_words(method(gaussian_actor(1))) == []
    categorical = ProbabilisticActor(
        TensorDictModule(nn.Linear(4, 3).double(), ["observation"], ["logits"]),
        ["logits"],
        distribution_class=Categorical,
    )
    q_values = QValueActor(nn.Linear(4, 3).double(), in_keys=["observation"], action_space="one-hot")
    assert target_words(method(categorical)) == target_words(method(q_values)) == []


def hybrid_actor(body: nn.Module, continuous: int, **options) -> ProbabilisticActor:
    """A torchrl actor of a hybrid action: a ``CompositeDistribution`` of a categorical part of 3 actions (``disc``)
    and a Normal part of ``continuous`` dimensions (``cont``), its parameters read from ``body``'s output."""
    cut = 3 + continuous
    heads = TensorDictModule(
        lambda h: (h[..., :3], h[..., 3:cut], nn.functional.softplus(h[..., cut:]) + 0.1),
        in_keys=["hidden"],
        out_keys=[("params", "disc", "logits"), ("params", "cont", "loc"), ("params", "cont", "scale")],
    )
    return ProbabilisticActor(
        TensorDictSequential(TensorDictModule(body, ["observation"], ["hidden"]), heads),
        in_keys=["params"],
        distribution_class=CompositeDistribution,
        distribution_kwargs={
            "distribution_map": {"disc": Categorical, "cont": Normal},
            "name_map": {"disc": ("action", "disc"), "cont": ("action", "cont")},
        },
        **options,
    )


@pytest.mark.parametrize("method", [LRP, InputXGradient], ids=["lrp", "method"])
def test_the_default_target_among_a_composite_distributions_continuous_dimensions_is_warned_of(method):
    """A hybrid action's continuous part (a ``Normal`` in a ``CompositeDistribution``): the default target explained
    the largest of its ``loc`` dimensions, another dimension from sample to sample, with no word (a plain Normal
    actor's head is warned of); its parameters and its sample are warned of now, its categorical logits are not."""
    torch.manual_seed(0)
    actor = hybrid_actor(nn.Linear(4, 7).double(), 2, out_keys=[("action", "disc"), ("action", "cont")])
    (message,) = target_words(method(actor, target_key=("params", "cont", "loc")))
    assert "2 dimensions of a continuous action (the Normal parameter of the part 'cont' of a Composite" in message
    (message,) = target_words(method(actor, target_key=("action", "cont")))
    assert "(the Normal sample of the part 'cont' of a CompositeDistribution)" in message
    assert target_words(method(actor, target_key=("params", "disc", "logits"))) == []
    assert target_words(method(actor, target_key=("params", "cont", "loc"), target=1)) == []


def test_a_composite_distributions_drawn_categorical_part_is_not_taken_for_its_argmax():
    """A hybrid action's categorical part (``CompositeDistribution``): the default target explained the argmax of its
    logits where the action taken was drawn at random (another action in 4 rows of 8, 1.09 off its gradient × input)
    or a stored transition's (ignored): refused, naming the part and what to pass; the action taken as the target is
    explained (LRP-0: gradient × input of its logit), and a deterministic policy's argmax is its action."""
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 5)).double()
    actor = hybrid_actor(body, 1)
    x = torch.randn(8, 4, dtype=F64, generator=torch.Generator().manual_seed(1))
    td = TensorDict(observation=x, batch_size=[8])
    mapper = {nn.Linear: EpsilonRule(0.0)}
    with set_exploration_type(ExplorationType.RANDOM), pytest.raises(ValueError, match=r"categorical part 'disc'"):
        LRP(actor, mapper)(td.clone())
    stored = td.clone().set(("action", "disc"), torch.zeros(8, dtype=torch.long))
    stored.set("next", td.select("observation").clone())
    with pytest.raises(ValueError, match=r"categorical part 'disc' of a CompositeDistribution"):
        LRP(actor, mapper)(stored)
    with set_exploration_type(ExplorationType.RANDOM):
        taken = actor(td.clone())["action", "disc"]
        found = LRP(actor, mapper, target=taken)(td.clone())["relevance", "observation"]
    leaf = x.clone().requires_grad_(True)
    expected = x * torch.autograd.grad(body(leaf)[..., :3].gather(-1, taken[:, None]).sum(), leaf)[0]
    torch.testing.assert_close(found, expected, rtol=1e-10, atol=1e-12)
    with set_exploration_type(ExplorationType.DETERMINISTIC):
        LRP(actor, mapper)(td.clone())  # the action is the argmax: nothing refused
