"""torchrl's tutorials rebuilt as their users write them (random weights, gymnasium's classic control), explained by
LRP inside the workflows they run: ``env.rollout``, a collector, an advantage estimator and a loss step.

PPO on Pendulum-v1 (an MLP, ``NormalParamExtractor``, a ``TanhNormal`` actor explained on its ``loc`` or its
``scale``; a ``ValueOperator``; GAE and ``ClipPPOLoss``); DQN on CartPole-v1 and Acrobot-v1 (``DuelingMlpDQNet``, an
MLP of ``NoisyLinear`` layers, ``EGreedyModule`` in the policy; ``DQNLoss``); DDPG and TD3 on Pendulum-v1 (an
``Actor`` squashed by a ``TanhModule`` or a ``TanhDelta`` distribution, ``AdditiveGaussianModule`` and
``OrnsteinUhlenbeckProcessModule`` exploration, a Q-value operator of the observation and the action); SAC's
``TanhNormal`` actor explained on the action it samples and in its actor loss Q(s, π(s)); a recurrent
DQN (``GRUModule`` with its primer) in a collector; MADDPG's centralised critic (``MultiAgentMLP`` after a
``torch.cat`` in a lambda) on nested per-agent keys; an Atari-style ``ConvNet`` DQN on pixels.

The oracles: the rollouts and collected batches of the bare policy under the same seeds (every key but the
relevance, bit for bit); LRP-0 equals gradient × input where the network is piecewise linear (ReLU); with every
bias zeroed and the ε-rule with ε = 0 on the layers, the relevance sums to the explained value.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import NormalParamExtractor, TensorDictModule, TensorDictModuleBase, TensorDictSequential
from tensordict.utils import NestedKey
from torch import nn
from torchrl.collectors import Collector
from torchrl.data import Bounded
from torchrl.envs import (
    Compose,
    DoubleToFloat,
    EnvBase,
    GymEnv,
    InitTracker,
    ObservationNorm,
    StepCounter,
    TransformedEnv,
)
from torchrl.envs.utils import ExplorationType, set_exploration_type
from torchrl.modules import (
    MLP,
    Actor,
    AdditiveGaussianModule,
    ConvNet,
    EGreedyModule,
    GRUModule,
    MultiAgentMLP,
    NoisyLinear,
    OrnsteinUhlenbeckProcessModule,
    ProbabilisticActor,
    QValueActor,
    QValueModule,
    TanhDelta,
    TanhModule,
    TanhNormal,
    ValueOperator,
)
from torchrl.modules.models.models import DuelingMlpDQNet
from torchrl.objectives import ClipPPOLoss, DQNLoss
from torchrl.objectives.value import GAE

from tdhook.attribution import LRP, BaseRuleMapper, EpsilonRule
from tdhook.attribution._keys import as_tuple
from tdhook.attribution.mappers import EpsilonAlpha2Beta1, EpsilonGammaBox, EpsilonPlus, EpsilonPlusFlat
from tests.attribution.test_lrp_world_models import zero_biases

F64 = torch.float64
RELU = {"activation_class": nn.ReLU}
LRP0 = BaseRuleMapper(stabilizer=0.0)
LINEAR_EPSILON_ZERO = BaseRuleMapper(
    stabilizer=1e-12, rule_mapper={(nn.Linear, nn.Conv1d, nn.Conv2d): EpsilonRule(0.0)}
)
PRESETS = {
    "EpsilonPlus": EpsilonPlus,
    "EpsilonPlusFlat": EpsilonPlusFlat,
    "EpsilonAlpha2Beta1": EpsilonAlpha2Beta1,
    "EpsilonGammaBox": lambda: EpsilonGammaBox(-3.0, 3.0),
    "LRP-0": lambda: BaseRuleMapper(stabilizer=0.0),
}
RELEVANCE = ("relevance", "observation")


# ----------------------------------------------------------------------------- oracles


def rollout(env: EnvBase, policy: TensorDictModuleBase, steps: int, seed: int = 0) -> TensorDict:
    """``steps`` steps of ``policy`` sampling its actions, through the environment's resets, from fixed seeds."""
    env.set_seed(seed)
    torch.manual_seed(seed)
    with set_exploration_type(ExplorationType.RANDOM):
        return env.rollout(steps, policy, break_when_any_done=False)


def assert_same_but_relevance(explained: TensorDict, plain: TensorDict, relevance_keys: set) -> None:
    """Every key of the bare policy's run, bit for bit; besides them only the relevance keys, shaped as their
    inputs."""
    plain_keys = set(plain.keys(include_nested=True, leaves_only=True))
    assert set(explained.keys(include_nested=True, leaves_only=True)) == plain_keys | relevance_keys
    for key in plain_keys:
        assert torch.equal(explained[key], plain[key]), key
    for key in relevance_keys:
        relevance = explained[key]
        assert relevance.shape == explained[key[1:]].shape and not relevance.requires_grad, key
        assert torch.isfinite(relevance).all() and relevance.abs().sum() > 0, key


def gradient_times_input(
    module: TensorDictModuleBase, td: TensorDict, key: NestedKey, seed: Callable | None = None
) -> tuple[dict, float]:
    """Each floating-point input the output depends on, times the gradient of the explained units (the largest of
    each row, or those ``seed`` gives); and their total value."""
    x = td.clone()
    leaves = {k: v.requires_grad_() for k, v in x.items(True, True) if v.is_floating_point()}
    output = module(x).get(key)
    if seed is not None:
        weights = seed(output.detach())
    elif output.shape[-1] == 1:
        weights = torch.ones_like(output)
    else:
        weights = (output.detach() == output.detach().max(-1, keepdim=True).values).to(output.dtype)
    grads = torch.autograd.grad(output, list(leaves.values()), weights, allow_unused=True)
    relevance = {k: leaf.detach() * g for (k, leaf), g in zip(leaves.items(), grads, strict=True) if g is not None}
    return relevance, (output * weights).sum().item()


def assert_lrp0_and_conservation(
    module: TensorDictModuleBase, td: TensorDict, key: NestedKey, seed: Callable | None = None, lrp0: bool = True
) -> None:
    """LRP-0 is gradient × input on every input key (where the network is piecewise linear), the outputs are the
    module's, nothing is warned about; with the biases zeroed, the ε-rule with ε = 0 conserves the explained value."""
    target = {} if seed is None else {"target": lambda output: output * seed(output.detach())}
    with set_exploration_type(ExplorationType.DETERMINISTIC), warnings.catch_warnings():
        warnings.simplefilter("error")
        plain = module(td.clone())
        if lrp0:
            out = LRP(module, LRP0, target_key=key, **target)(td.clone())
            for name in plain.keys(include_nested=True, leaves_only=True):
                assert torch.equal(out[name], plain[name]), name
            expected, _ = gradient_times_input(module, td, key, seed)
            assert set(out["relevance"].keys(include_nested=True, leaves_only=True)) == set(expected)
            for name, relevance in expected.items():
                torch.testing.assert_close(out["relevance", *as_tuple(name)], relevance, rtol=1e-10, atol=1e-12)
        zero_biases(module)
        out = LRP(module, LINEAR_EPSILON_ZERO, target_key=key, **target)(td.clone())
        total = sum(r.sum() for r in out["relevance"].values(include_nested=True, leaves_only=True))
        _, explained = gradient_times_input(module, td, key, seed)
        torch.testing.assert_close(total.item(), explained, rtol=1e-9, atol=1e-12)


# ----------------------------------------------------------------------------- PPO on Pendulum-v1


def pendulum(normalise: bool = True) -> TransformedEnv:
    """The PPO tutorial's environment: the observation normalised (fixed statistics), cast to float32, steps counted."""
    statistics = {"loc": torch.tensor([0.0, 0.0, 0.0]), "scale": torch.tensor([1.0, 1.0, 0.25])}
    norm = [ObservationNorm(**statistics, in_keys=["observation"])] * normalise
    return TransformedEnv(GymEnv("Pendulum-v1"), Compose(*norm, DoubleToFloat(), StepCounter()))


def ppo_actor(env: EnvBase, activation: type[nn.Module] = nn.Tanh, cells: int = 16) -> ProbabilisticActor:
    """The PPO tutorial's policy: lazy layers, the loc and the scale of a TanhNormal split by NormalParamExtractor."""
    layers = [nn.LazyLinear(cells), activation(), nn.LazyLinear(cells), activation()]
    net = nn.Sequential(*layers, nn.LazyLinear(2 * env.action_spec.shape[-1]), NormalParamExtractor())
    actor = ProbabilisticActor(
        TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"]),
        spec=env.action_spec,
        in_keys=["loc", "scale"],
        distribution_class=TanhNormal,
        distribution_kwargs={"low": env.action_spec.space.low, "high": env.action_spec.space.high},
        return_log_prob=True,
    )
    actor(env.reset())  # the lazy layers take their shapes
    return actor


def ppo_critic(env: EnvBase, cells: int = 16) -> ValueOperator:
    net = nn.Sequential(nn.LazyLinear(cells), nn.Tanh(), nn.LazyLinear(cells), nn.Tanh(), nn.LazyLinear(1))
    critic = ValueOperator(net, in_keys=["observation"])
    critic(env.reset())
    return critic


@pytest.mark.parametrize("key", ["loc", "scale"])
def test_ppo_rollout_explained_on_loc_or_scale_samples_the_same_actions(key: str):
    """The sampling actor in the rollout: the same actions, log-probabilities and trajectory, bit for bit; each
    step's relevance is that of the actor explained on that step's observation alone."""
    torch.manual_seed(0)
    env = pendulum()
    actor = ppo_actor(env)
    plain = rollout(env, actor, 12)
    explained = rollout(env, LRP(actor, EpsilonPlus(), target_key=key), 12)
    assert_same_but_relevance(explained, plain, {RELEVANCE})
    alone = LRP(actor, EpsilonPlus(), target_key=key)(plain[5:6].select("observation"))
    torch.testing.assert_close(explained[RELEVANCE][5:6], alone[RELEVANCE])


def test_ppo_collector_gae_and_clip_loss_on_explained_batches_train_as_on_plain_ones():
    """The collector with the wrapper as its policy gathers the bare policy's batches, relevance besides; GAE and
    ClipPPOLoss on them give the same advantages, losses and gradients."""
    torch.manual_seed(0)
    env = pendulum()
    actor, critic = ppo_actor(env), ppo_critic(env)
    batches = {}
    for name, policy in (("plain", actor), ("explained", LRP(actor, EpsilonPlus(), target_key="loc"))):
        env.set_seed(0)
        torch.manual_seed(1)
        collector = Collector(env, policy, frames_per_batch=10, total_frames=20, auto_register_policy_transforms=False)
        try:
            batches[name] = list(collector)
        finally:
            collector.shutdown()
    estimator = GAE(gamma=0.99, lmbda=0.95, value_network=critic, average_gae=True)
    loss = ClipPPOLoss(actor_network=actor, critic_network=critic, clip_epsilon=0.2, entropy_coeff=1e-4)
    for plain, explained in zip(batches["plain"], batches["explained"], strict=True):
        assert_same_but_relevance(explained, plain, {RELEVANCE})
        grads = []
        for batch in (plain, explained):
            data = estimator(batch.clone())
            torch.manual_seed(2)  # a TanhNormal's entropy is estimated from samples
            losses = loss(data)
            total = sum(value for name, value in losses.items() if name.startswith("loss_"))
            grads.append((data["advantage"], total, torch.autograd.grad(total, list(loss.parameters()))))
        torch.testing.assert_close(grads[1][0], grads[0][0], rtol=0, atol=0)
        torch.testing.assert_close(grads[1][1], grads[0][1], rtol=0, atol=0)
        for plain_grad, grad in zip(grads[0][2], grads[1][2], strict=True):
            torch.testing.assert_close(grad, plain_grad, rtol=0, atol=0)


@pytest.mark.parametrize("key", ["loc", "scale"])
def test_ppo_actor_and_critic_in_float64_give_gradient_times_input_and_conserve(key: str):
    """With ReLU layers: LRP-0 is gradient × input of the loc (the scale's biased softplus gets the pass rule, so
    only its conservation is checked); with the biases zeroed the relevance sums to the loc or the scale, and to the
    critic's value."""
    torch.manual_seed(0)
    env = pendulum(normalise=False)
    actor = ppo_actor(env, nn.ReLU).double()
    td = TensorDict(observation=torch.randn(6, 3, dtype=F64), batch_size=[6])
    assert_lrp0_and_conservation(actor, td, key, lrp0=key == "loc")
    critic = ValueOperator(MLP(in_features=3, out_features=1, num_cells=[16, 16], **RELU).double(), ["observation"])
    assert_lrp0_and_conservation(critic, td, "state_value")


# ----------------------------------------------------------------------------- DQN on CartPole-v1 and Acrobot-v1


def dqn_policy(env: EnvBase, kind: str) -> TensorDictSequential:
    """The DQN tutorial's policy: a Q-value actor (dueling heads, or noisy layers), then epsilon-greedy exploration."""
    observations, actions = env.observation_spec["observation"].shape[-1], env.action_spec.shape[-1]
    if kind == "DuelingMlpDQNet":
        net = DuelingMlpDQNet(actions, 1, {"num_cells": [16], **RELU}, {"num_cells": [16], **RELU})
        net(torch.zeros(1, observations))  # its lazy layers take their shapes
    else:
        net = MLP(in_features=observations, out_features=actions, num_cells=[16, 16], layer_class=NoisyLinear, **RELU)
    actor = QValueActor(net, in_keys=["observation"], spec=env.action_spec)
    return TensorDictSequential(actor, EGreedyModule(env.action_spec, eps_init=0.5, eps_end=0.5))


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("kind", ["DuelingMlpDQNet", "NoisyLinear"])
def test_dqn_rollout_with_epsilon_greedy_exploration_acts_as_the_bare_policy(kind: str, preset: str):
    """The wrapper around the whole exploring policy: the same random and greedy actions, the same trajectory; the
    relevance of each step explains the greedy action's value."""
    torch.manual_seed(0)
    env = TransformedEnv(GymEnv("Acrobot-v1" if kind == "NoisyLinear" else "CartPole-v1"), DoubleToFloat())
    policy = dqn_policy(env, kind)
    plain = rollout(env, policy, 10)
    explained = rollout(env, LRP(policy, PRESETS[preset]()), 10)
    assert_same_but_relevance(explained, plain, {RELEVANCE})


def test_dqn_loss_on_explained_batches_gives_the_plain_loss_and_gradients():
    torch.manual_seed(0)
    env = GymEnv("CartPole-v1")
    policy = dqn_policy(env, "DuelingMlpDQNet")
    batches = {}
    for name, wrapper in (("plain", policy), ("explained", LRP(policy, EpsilonPlus()))):
        env.set_seed(0)
        torch.manual_seed(1)
        collector = Collector(env, wrapper, frames_per_batch=12, total_frames=12, auto_register_policy_transforms=False)
        try:
            batches[name] = next(iter(collector))
        finally:
            collector.shutdown()
    assert_same_but_relevance(batches["explained"], batches["plain"], {RELEVANCE})
    loss = DQNLoss(policy[0], action_space=env.action_spec, delay_value=False)
    results = []
    for batch in (batches["plain"], batches["explained"]):
        value = loss(batch.clone())["loss"]
        results.append((value, torch.autograd.grad(value, list(policy[0].parameters()))))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0)
    for plain_grad, grad in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(grad, plain_grad, rtol=0, atol=0)


def test_atari_style_conv_dqn_on_pixels_gives_gradient_times_input_and_conserves():
    """ConvNet (its SquashDims flattening the feature maps) and an MLP head, as a Q-value actor on pixels."""
    torch.manual_seed(0)
    cnn = ConvNet(num_cells=[4, 4], kernel_sizes=[3, 3], strides=[2, 1], **RELU)
    net = nn.Sequential(cnn, MLP(out_features=3, num_cells=[16], **RELU)).double()
    td = TensorDict(pixels=torch.rand(2, 3, 12, 12, dtype=F64), batch_size=[2])
    actor = QValueActor(net, in_keys=["pixels"], action_space="one-hot")
    actor(td.clone())  # lazy layers
    assert_lrp0_and_conservation(actor, td, "chosen_action_value")


# ----------------------------------------------------------------------------- DDPG and TD3 on Pendulum-v1


def ddpg_actor(spec: Bounded, dtype: torch.dtype = torch.float32) -> TensorDictSequential:
    """TD3's actor: an MLP whose output a TanhModule maps onto the action bounds."""
    net = MLP(in_features=3, out_features=spec.shape[-1], num_cells=[16, 16], **RELU).to(dtype)
    return TensorDictSequential(
        Actor(net, in_keys=["observation"], out_keys=["param"]), TanhModule(["param"], ["action"], spec=spec)
    )


def ddpg_critic(dtype: torch.dtype = torch.float32) -> ValueOperator:
    """A Q-value operator of the observation and the action: torchrl's MLP concatenates its inputs."""
    net = MLP(in_features=4, out_features=1, num_cells=[16, 16], **RELU).to(dtype)
    return ValueOperator(net, in_keys=["observation", "action"])


@pytest.mark.parametrize("exploration", ["AdditiveGaussianModule", "OrnsteinUhlenbeckProcessModule"])
def test_ddpg_rollout_with_exploration_noise_acts_as_the_bare_policy(exploration: str):
    """The noisy action the environment gets is the bare policy's, bit for bit; the relevance explains the action
    the actor computed (the noise is a constant of the call)."""
    torch.manual_seed(0)
    env = TransformedEnv(GymEnv("Pendulum-v1"), Compose(DoubleToFloat(), InitTracker()))
    actor = ddpg_actor(env.action_spec)
    noise = {
        "AdditiveGaussianModule": AdditiveGaussianModule,
        "OrnsteinUhlenbeckProcessModule": OrnsteinUhlenbeckProcessModule,
    }
    policy = TensorDictSequential(actor, noise[exploration](spec=env.action_spec))
    plain = rollout(env, policy, 10)
    explained = rollout(env, LRP(policy, EpsilonPlus(), target_key="action"), 10)
    assert_same_but_relevance(explained, plain, {RELEVANCE})


def test_ddpg_critic_explains_the_observation_and_the_action():
    torch.manual_seed(0)
    td = TensorDict(
        observation=torch.randn(6, 3, dtype=F64), action=torch.rand(6, 1, dtype=F64) * 4 - 2, batch_size=[6]
    )
    assert_lrp0_and_conservation(ddpg_critic(F64), td, "state_action_value")


def test_ddpg_actor_loss_pipeline_conserves_the_value_of_the_actors_action():
    """DDPG's actor loss runs the critic on the actor's action, Q(s, π(s)): the relevance reaches the observation
    through both; the TanhModule's tanh gets the pass rule, so the value is conserved with the biases zeroed."""
    torch.manual_seed(0)
    spec = Bounded(-1.0, 1.0, (1,), dtype=F64)
    pipeline = TensorDictSequential(ddpg_actor(spec, F64), ddpg_critic(F64))
    td = TensorDict(observation=torch.randn(6, 3, dtype=F64), batch_size=[6])
    assert_lrp0_and_conservation(pipeline, td, "state_action_value", lrp0=False)


def tanh_delta_actor(low: float, high: float) -> ProbabilisticActor:
    """The DDPG tutorial's actor: the MLP's ``param`` squashed onto the bounds by a TanhDelta distribution."""
    net = MLP(in_features=3, out_features=1, num_cells=[16], **RELU).double()
    return ProbabilisticActor(
        TensorDictModule(net, ["observation"], ["param"]),
        in_keys=["param"],
        spec=Bounded(low, high, (1,), dtype=F64),
        distribution_class=TanhDelta,
        distribution_kwargs={"low": low, "high": high},
    )


def test_a_tanh_delta_actor_explains_its_param_as_gradient_times_input():
    torch.manual_seed(0)
    td = TensorDict(observation=torch.randn(6, 3, dtype=F64), batch_size=[6])
    assert_lrp0_and_conservation(tanh_delta_actor(-2.0, 2.0), td, "param")


@pytest.mark.parametrize("explained", ["action", "state_action_value"])
def test_a_tanh_delta_actor_explained_on_its_action_conserves_it(explained: str):
    """The action the TanhDelta squashes onto the bounds (its tanh a custom autograd Function of torchrl's), alone
    and in DDPG's actor loss Q(s, π(s)): the tanh gets the pass rule, so with the biases zeroed the relevance sums
    to the action (bounds symmetric about zero) and to the value, with no warning. Its plain gradient was used, with
    a warning naming the module, and the sum was off by the tanh's curvature."""
    torch.manual_seed(0)
    td = TensorDict(observation=torch.randn(6, 3, dtype=F64) * 2, batch_size=[6])
    actor = tanh_delta_actor(-2.0, 2.0)
    if explained == "action":
        assert_lrp0_and_conservation(actor, td, "action", lrp0=False)
    else:
        assert_lrp0_and_conservation(TensorDictSequential(actor, ddpg_critic(F64)), td, explained, lrp0=False)


@pytest.mark.parametrize("explained", ["action", "state_action_value"])
@pytest.mark.parametrize("mode", [ExplorationType.RANDOM, ExplorationType.DETERMINISTIC])
def test_a_sac_actor_conserves_the_action_it_samples_and_its_value(mode: ExplorationType, explained: str):
    """SAC's TanhNormal actor, sampling (loc + scale × noise, the noise a constant of the call) or acting
    deterministically, alone and in SAC's actor loss Q(s, π(s)): the action the bare actor takes under the same
    seed, and with the biases zeroed the relevance sums to it (the scale's biased softplus and the tanh get the pass
    rule), and to its value."""
    torch.manual_seed(0)
    net = nn.Sequential(MLP(in_features=3, out_features=2, num_cells=[16], **RELU), NormalParamExtractor()).double()
    actor = ProbabilisticActor(
        TensorDictModule(net, ["observation"], ["loc", "scale"]),
        in_keys=["loc", "scale"],
        spec=Bounded(-2.0, 2.0, (1,), dtype=F64),
        distribution_class=TanhNormal,
        distribution_kwargs={"low": -2.0, "high": 2.0},
        return_log_prob=True,
    )
    module = zero_biases(actor if explained == "action" else TensorDictSequential(actor, ddpg_critic(F64)))
    td = TensorDict(observation=torch.randn(6, 3, dtype=F64), batch_size=[6])
    with set_exploration_type(mode), warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.manual_seed(3)
        plain = module(td.clone())
        torch.manual_seed(3)
        out = LRP(module, LINEAR_EPSILON_ZERO, target_key=explained)(td.clone())
    assert torch.equal(out["action"], plain["action"])
    total = out[RELEVANCE].sum(-1)
    torch.testing.assert_close(total, out[explained].squeeze(-1), rtol=1e-8, atol=1e-9)


# ----------------------------------------------------------------------------- recurrent DQN in a collector


def test_recurrent_dqn_in_a_collector_gathers_the_bare_policys_batches():
    """A GRUModule with its primer in the environment, an MLP, a QValueModule and epsilon-greedy exploration: the
    wrapper around the Q-network gathers the same batches (actions, recurrent states, resets), relevance besides on
    the observation and the recurrent state."""
    torch.manual_seed(0)
    env = TransformedEnv(GymEnv("CartPole-v1"), Compose(InitTracker(), StepCounter()))
    gru = GRUModule(input_size=4, hidden_size=8, in_key="observation", out_key="embed")
    env.append_transform(gru.make_tensordict_primer())
    head = TensorDictModule(MLP(in_features=8, out_features=2, num_cells=[8], **RELU), ["embed"], ["action_value"])
    q_network = TensorDictSequential(gru, head, QValueModule(spec=env.action_spec))
    explore = EGreedyModule(env.action_spec, eps_init=0.3, eps_end=0.3)
    batches = {}
    for name, network in (("plain", q_network), ("explained", LRP(q_network, EpsilonPlus()))):
        env.set_seed(0)
        torch.manual_seed(1)
        collector = Collector(env, TensorDictSequential(network, explore), frames_per_batch=12, total_frames=24)
        try:
            batches[name] = list(collector)
        finally:
            collector.shutdown()
    assert torch.cat([b["is_init"] for b in batches["plain"]])[1:].any()  # a reset inside the batches
    for plain, explained in zip(batches["plain"], batches["explained"], strict=True):
        assert_same_but_relevance(explained, plain, {RELEVANCE, ("relevance", "recurrent_state")})


# ----------------------------------------------------------------------------- MADDPG's centralised critic


@pytest.mark.parametrize("share_params", [True, False])
@pytest.mark.parametrize("centralised", [True, False])
def test_maddpg_critic_on_nested_agent_keys_explains_every_agents_observation_and_action(
    centralised: bool, share_params: bool
):
    """The tutorial's critic: a lambda module concatenating each agent's observation and action, then a
    MultiAgentMLP; every agent's value is explained at once (the sum over agents, a VMAS-like layout)."""
    torch.manual_seed(0)
    agents, features, actions = 3, 4, 2
    group = TensorDict(
        observation=torch.randn(5, agents, features, dtype=F64),
        action=torch.rand(5, agents, actions, dtype=F64) * 2 - 1,
        batch_size=[5, agents],
    )
    td = TensorDict({"agents": group}, batch_size=[5])
    cat = TensorDictModule(
        lambda observation, action: torch.cat([observation, action], dim=-1),
        in_keys=[("agents", "observation"), ("agents", "action")],
        out_keys=[("agents", "obs_action")],
    )
    net = MultiAgentMLP(
        n_agent_inputs=features + actions,
        n_agent_outputs=1,
        n_agents=agents,
        centralised=centralised,
        share_params=share_params,
        depth=2,
        num_cells=8,
        **RELU,
    ).double()
    critic = TensorDictModule(net, in_keys=[("agents", "obs_action")], out_keys=[("agents", "state_action_value")])
    assert_lrp0_and_conservation(
        TensorDictSequential(cat, critic), td, ("agents", "state_action_value"), seed=torch.ones_like
    )
