"""Recurrent and multi-agent policies in the workflows of torchrl's tutorials, with the LRP wrapper in the loop.

Recurrent DQN: an ``LSTMModule``/``GRUModule`` with its recurrent-state primer on a ``GymEnv("CartPole-v1")``,
rolled out step by step with the wrapper in the policy, then explained in recurrent mode over the rollout, and
trained with ``DQNLoss`` over sequences. Multi-agent PPO: a ``MultiAgentMLP`` actor and a centralised critic on a
small environment with per-agent nested keys, trained with ``ClipPPOLoss`` and GAE. The oracles are plain autograd
(LRP-0 with the recurrence and the activations keeping their plain gradient is gradient × input), the same loop
without the wrapper, and a fresh wrapper on a copy of the network. Heterogeneous agents, lazily stacked, get their
relevance per agent or are refused by key.
"""

from __future__ import annotations

import contextlib
import copy
import re

import pytest
import torch
from tensordict import LazyStackedTensorDict, TensorDict
from tensordict.nn import NormalParamExtractor, TensorDictModule, TensorDictModuleBase, TensorDictSequential
from torch import nn
from torchrl.data import Bounded, Categorical, Composite, Unbounded
from torchrl.envs import Compose, EnvBase, GymEnv, InitTracker, TransformedEnv
from torchrl.modules import (
    MLP,
    GRUModule,
    LSTMModule,
    MultiAgentMLP,
    MultiStepActorWrapper,
    ProbabilisticActor,
    QValueModule,
    TanhNormal,
    set_recurrent_mode,
)

from tdhook.attribution import LRP, BaseRuleMapper, EpsilonPlus, IgnoreRule, Saliency

F64 = torch.float64
N_AGENTS = 3


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value - reference).abs().max() / reference.abs().max()).item()


# ------------------------------------------------------------------------------------------------- recurrent DQN


def plain_recurrence() -> BaseRuleMapper:
    """LRP-0 with the recurrent layers keeping their plain gradient: on a ReLU head, gradient × input."""
    return BaseRuleMapper(stabilizer=0, rule_mapper={nn.LSTM: IgnoreRule(), nn.GRU: IgnoreRule()})


def recurrent_q(kind: str) -> tuple[TensorDictSequential, nn.Module]:
    """The Q-network of torchrl's recurrent DQN tutorial, small: a two-layer LSTM or GRU and a ReLU MLP head."""
    torch.manual_seed(0)
    cls = LSTMModule if kind == "LSTM" else GRUModule
    rnn = cls(input_size=4, hidden_size=6, num_layers=2, in_key="observation", out_key="embed")
    head = MLP(in_features=6, out_features=2, num_cells=[8], activation_class=nn.ReLU)
    return TensorDictSequential(rnn, TensorDictModule(head, ["embed"], ["action_value"])), rnn


def state_keys(kind: str) -> list[str]:
    return ["recurrent_state_h", "recurrent_state_c"] if kind == "LSTM" else ["recurrent_state"]


def cartpole_rollout(core: TensorDictSequential, rnn: nn.Module, policy: nn.Module, steps: int = 16) -> TensorDict:
    """``steps`` greedy steps of CartPole through its resets (the untrained policy drops the pole within them)."""
    env = TransformedEnv(GymEnv("CartPole-v1"), Compose(InitTracker(), rnn.make_tensordict_primer()))
    env.set_seed(0)
    try:
        with torch.no_grad():
            return env.rollout(
                steps, TensorDictSequential(policy, QValueModule(spec=env.action_spec)), break_when_any_done=False
            )
    finally:
        env.close()


def float64(td: TensorDict) -> TensorDict:
    return td.apply(lambda t: t.double() if t.is_floating_point() else t)


@pytest.mark.filterwarnings("error:LRP. module .*computes (lstm|gru):UserWarning")
@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_a_recurrent_q_policy_in_a_rollout_acts_as_without_lrp_and_each_step_is_gradient_times_input(kind: str):
    """The wrapper in the policy takes the same actions and writes the same next states, bit for bit, through the
    environment's resets; each step's relevance on the observation and on the recurrent states it read is gradient
    × input of that step's chosen action value (zero on the states a reset replaced by zeros)."""
    core, rnn = recurrent_q(kind)
    plain = cartpole_rollout(core, rnn, core)
    rollout = cartpole_rollout(core, rnn, LRP(core, plain_recurrence()))
    assert plain["is_init"][1:].any()  # a reset inside the rollout
    assert torch.equal(rollout["action"], plain["action"])
    for key in state_keys(kind):
        assert torch.equal(rollout["next", key], plain["next", key]), key
    network = copy.deepcopy(core).double()
    inputs = ["observation", *state_keys(kind)]
    for t in range(rollout.shape[0]):
        step = float64(rollout[t].select("is_init", *inputs)).apply(lambda x: x.requires_grad_(x.is_floating_point()))
        values = network(step.clone(False))["action_value"]
        grads = torch.autograd.grad(values[values.argmax()], [step[key] for key in inputs])
        for key, grad in zip(inputs, grads, strict=True):
            expected = step[key].detach() * grad
            assert not (expected.any() if key != "observation" and step["is_init"].item() else False)
            torch.testing.assert_close(
                rollout["relevance", key][t].double(), expected, rtol=1e-5, atol=1e-6, msg=f"{key} at step {t}"
            )


@pytest.mark.filterwarnings("error:LRP. module .*computes (lstm|gru):UserWarning")
@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_the_rollout_in_recurrent_mode_explains_each_step_on_every_earlier_observation(kind: str):
    """The rollout as one ``[1, T]`` sequence (trajectories split by ``is_init``), in recurrent mode with
    ``split_dim`` over time: the relevance of the action at step ``t`` on the observation at step ``s`` is gradient ×
    input through the unrolled recurrence, zero after ``t`` and across resets."""
    core, rnn = recurrent_q(kind)
    rollout = cartpole_rollout(core, rnn, core)
    sequence = float64(rollout.select("observation", "is_init", *state_keys(kind)).unsqueeze(0))
    network = copy.deepcopy(core).double()
    with set_recurrent_mode(True):
        relevance = LRP(network, plain_recurrence(), split_dim=1)(sequence.clone())["relevance", "observation"][0]
        observation = sequence["observation"].clone().requires_grad_()
        values = network(sequence.clone(False).set("observation", observation))["action_value"][0]
    steps = values.shape[0]
    chosen = values.gather(-1, values.argmax(-1, keepdim=True)).squeeze(-1)
    grads = [torch.autograd.grad(chosen[t], observation, retain_graph=True)[0][0] for t in range(steps)]
    expected = observation[0].detach() * torch.stack(grads)
    torch.testing.assert_close(relevance, expected, rtol=1e-10, atol=1e-12)
    starts = rollout["is_init"].squeeze(-1).nonzero().squeeze(-1).tolist()
    for t in range(steps):
        start = max(s for s in starts if s <= t)
        assert not relevance[t, t + 1 :].any() and not relevance[t, :start].any(), t
        assert relevance[t, start : t + 1].abs().sum(-1).gt(0).all(), t


@pytest.mark.filterwarnings("error:LRP. module .*computes (lstm|gru):UserWarning")
@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_slices_sampled_mid_trajectory_explain_the_stored_states_they_start_from(kind: str):
    """Slices of a replay buffer start inside a trajectory (no ``is_init`` at their first step), from the recurrent
    states stored there, and may hold a reset: in recurrent mode with ``split_dim`` over time, the relevance of each
    step's action on the observations and on the stored states is gradient × input through the unrolled recurrence."""
    core, _ = recurrent_q(kind)
    core = core.double()
    td = sequences(kind).select("observation", "is_init", *state_keys(kind))
    td["is_init"][:, 0] = False
    keys = ["observation", *state_keys(kind)]
    with set_recurrent_mode(True):
        out = LRP(core, plain_recurrence(), split_dim=1)(td.clone())
        leaves = {key: td[key].clone().requires_grad_() for key in keys}
        values = core(td.clone(False).update(leaves))["action_value"]
    chosen = values.gather(-1, values.argmax(-1, keepdim=True)).squeeze(-1)
    for key, leaf in leaves.items():
        grads = [torch.autograd.grad(chosen[:, t].sum(), leaf, retain_graph=True)[0] for t in range(chosen.shape[1])]
        expected = leaf.detach().unsqueeze(1) * torch.stack(grads, 1)
        torch.testing.assert_close(out["relevance", key], expected, rtol=1e-10, atol=1e-12, msg=key)
        if key != "observation":  # read where each row's trajectories start: its first step and its resets
            starts = td["is_init"].squeeze(-1).clone()
            starts[:, 0] = True
            read = starts.unsqueeze(1).expand(-1, chosen.shape[1], -1)
            assert out["relevance", key][:, :, 0].abs().sum() > 0 and not out["relevance", key][~read].any()


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_a_context_open_across_a_rollout_and_a_recurrent_mode_call_explains_both_as_fresh_wrappers(kind: str):
    """Under the recurrent rule, with one context open across the step-by-step rollout and a recurrent-mode call
    over the rollout: the sequence's relevance is a fresh wrapper's, and the relevance of each step's action on its
    own observation, in recurrent mode with ``split_dim``, is what the rollout wrote at that step."""
    core, rnn = recurrent_q(kind)
    lrp = LRP(core, EpsilonPlus())
    with lrp:
        rollout = cartpole_rollout(core, rnn, lrp)
        sequence = rollout.select("observation", "is_init", *state_keys(kind)).unsqueeze(0)
        with set_recurrent_mode(True):
            whole = lrp(sequence.clone())["relevance", "observation"]
    network = copy.deepcopy(core).double()
    with set_recurrent_mode(True):
        fresh = LRP(network, EpsilonPlus())(float64(sequence))["relevance", "observation"]
        per_step = LRP(network, EpsilonPlus(), split_dim=1)(float64(sequence))["relevance", "observation"][0]
    torch.testing.assert_close(whole.double(), fresh, rtol=1e-5, atol=1e-6)
    own = per_step.diagonal(dim1=0, dim2=1).T  # [t, t]: the action at t on the observation at t
    torch.testing.assert_close(rollout["relevance", "observation"].double(), own, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(per_step.sum(0), fresh[0], rtol=1e-10, atol=1e-12)


def sequences(kind: str) -> TensorDict:
    """Three sampled slices of five transitions, one with a reset inside, with the stored recurrent states."""
    torch.manual_seed(1)
    batch, steps = (3, 5), [3, 5]
    done = torch.zeros(*batch, 1, dtype=torch.bool)
    td = TensorDict(
        observation=torch.randn(*batch, 4, dtype=F64),
        is_init=done.clone(),
        action=nn.functional.one_hot(torch.randint(2, batch), 2),
        next=TensorDict(
            observation=torch.randn(*batch, 4, dtype=F64),
            reward=torch.randn(*batch, 1, dtype=F64),
            done=done.clone(),
            terminated=done.clone(),
            is_init=done.clone(),
            batch_size=steps,
        ),
        batch_size=steps,
    )
    td["is_init"][:, 0] = True
    td["is_init"][1, 2] = True
    for key in state_keys(kind):
        td[key] = torch.randn(*batch, 2, 6, dtype=F64)
        td["next", key] = torch.randn(*batch, 2, 6, dtype=F64)
    return td


def train_recurrent_dqn(kind: str, explained: bool) -> tuple[list, list, TensorDict]:
    """Three Adam steps of ``DQNLoss`` in recurrent mode over sampled sequences, with ``SoftUpdate``; with
    ``explained``, a context open on the Q-network throughout, explaining a sequence and a single step before each
    optimiser step. Returns the gradients of each step and each explained relevance with a copy of the network."""
    from torchrl.objectives import DQNLoss, SoftUpdate

    core, _ = recurrent_q(kind)
    core = core.double()
    policy = TensorDictSequential(core, QValueModule(action_space="one-hot"))
    loss = DQNLoss(policy, action_space="one-hot", delay_value=True)
    updater = SoftUpdate(loss, eps=0.5)
    optimizer = torch.optim.Adam(loss.parameters(), lr=0.05)
    data = sequences(kind)
    lrp = LRP(core, EpsilonPlus()) if explained else None
    grads, relevances = [], []
    with lrp if lrp is not None else contextlib.nullcontext():
        for _ in range(3):
            if lrp is not None:
                with set_recurrent_mode(True):
                    relevances.append((lrp(data.select("observation", "is_init").clone()), copy.deepcopy(core)))
                relevances.append((lrp(data[:, 2].exclude("next", "action").clone()), copy.deepcopy(core)))
            optimizer.zero_grad()
            with set_recurrent_mode(True):
                loss(data.clone())["loss"].backward()
            grads.append([p.grad.clone() for p in loss.parameters() if p.grad is not None])
            optimizer.step()
            updater.step()
    return grads, relevances, data


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_recurrent_dqn_training_with_a_context_open_trains_as_without_it(kind: str):
    """``DQNLoss`` runs the Q-network in recurrent mode with its own functional parameters: in an open context it
    takes the plain gradient every step, and each explained call (a sequence in recurrent mode, a single step with
    its stored states) is a fresh wrapper's on the network as the previous steps left it."""
    plain, _, _ = train_recurrent_dqn(kind, explained=False)
    grads, relevances, data = train_recurrent_dqn(kind, explained=True)
    for index, (expected_step, step) in enumerate(zip(plain, grads, strict=True)):
        assert len(step) == len(expected_step) > 4, index
        for grad, expected in zip(step, expected_step, strict=True):
            torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14, msg=f"step {index}")
    for index, (out, network) in enumerate(relevances):
        inputs = out.select(*network.in_keys, strict=False).exclude("relevance")
        with set_recurrent_mode(index % 2 == 0):
            fresh = LRP(network, EpsilonPlus())(inputs.clone())
        for key in out["relevance"].keys():
            torch.testing.assert_close(out["relevance", key], fresh["relevance", key], rtol=1e-10, atol=1e-12)
    first, last = relevances[0][0], relevances[-2][0]  # the sequence, before the first step and the last
    assert not torch.allclose(first["relevance", "observation"], last["relevance", "observation"])


# ---------------------------------------------------------------------------------------------- multi-agent PPO


class Agents(EnvBase):
    """Agents on a plane that each observe their own state (3 values) and take a bounded 2-d action, with a reward
    per agent, all under the nested key ``"agents"``, in float64."""

    def __init__(self, max_steps: int = 8) -> None:
        super().__init__(batch_size=[])
        n = N_AGENTS
        self.max_steps = max_steps
        self.observation_spec = Composite(agents=Composite(observation=Unbounded((n, 3), dtype=F64), shape=(n,)))
        self.action_spec = Composite(agents=Composite(action=Bounded(-1.0, 1.0, (n, 2), dtype=F64), shape=(n,)))
        self.reward_spec = Composite(agents=Composite(reward=Unbounded((n, 1), dtype=F64), shape=(n,)))
        flag = Categorical(2, (1,), dtype=torch.bool)
        per_agent = Categorical(2, (n, 1), dtype=torch.bool)
        agents = Composite(done=per_agent, terminated=per_agent.clone(), shape=(n,))
        self.done_spec = Composite(done=flag, terminated=flag.clone(), agents=agents)
        self.generator = torch.Generator().manual_seed(0)

    def _set_seed(self, seed: int | None) -> None:
        self.generator.manual_seed(seed or 0)

    def _reset(self, td: TensorDict | None = None) -> TensorDict:
        self.state, self.steps = torch.randn(N_AGENTS, 3, generator=self.generator, dtype=F64), 0
        return self._observe()

    def _step(self, td: TensorDict) -> TensorDict:
        action = td["agents", "action"]
        pushed = torch.cat([action, action.mean(0, keepdim=True).expand(N_AGENTS, 2)], -1)[:, :3]
        self.state, self.steps = 0.9 * self.state + 0.1 * pushed, self.steps + 1
        return self._observe(reward=-self.state.square().sum(-1, keepdim=True))

    def _observe(self, reward: torch.Tensor | None = None) -> TensorDict:
        done = torch.tensor([self.steps >= self.max_steps])
        out = TensorDict(done=done, terminated=done.clone(), batch_size=[])
        agents = TensorDict(observation=self.state.clone(), batch_size=[N_AGENTS])
        agents["done"] = agents["terminated"] = done.expand(N_AGENTS, 1).clone()
        if reward is not None:
            agents["reward"] = reward
        out["agents"] = agents
        return out


def agents_core(net: nn.Module) -> TensorDictModule:
    """``net`` in float64, its outputs split into the agents' ``loc`` and ``scale``."""
    return TensorDictModule(
        nn.Sequential(net.to(F64), NormalParamExtractor()),
        in_keys=[("agents", "observation")],
        out_keys=[("agents", "loc"), ("agents", "scale")],
    )


def agents_actor(inner: TensorDictModuleBase, **kwargs) -> ProbabilisticActor:
    """A ``TanhNormal`` actor on the agents' ``loc`` and ``scale`` that ``inner`` writes, its action in
    ``("agents", "action")``; ``kwargs``: ``ProbabilisticActor``'s other keywords."""
    return ProbabilisticActor(
        inner,
        in_keys=[("agents", "loc"), ("agents", "scale")],
        out_keys=[("agents", "action")],
        spec=Agents().action_spec,
        distribution_class=TanhNormal,
        **kwargs,
    )


def per_agent_gradient_times_input(outputs: torch.Tensor, observation: torch.Tensor) -> torch.Tensor:
    """The gradient × input of each agent's output ``outputs[:, i]`` (summed over the batch) on ``observation``,
    stacked on dimension 1."""
    return torch.stack(
        [
            observation.detach() * torch.autograd.grad(outputs[:, i].sum(), observation, retain_graph=True)[0]
            for i in range(N_AGENTS)
        ],
        1,
    )


def mappo(share_params: bool, wrapped: bool = False) -> tuple:
    """The actor and the centralised critic of torchrl's multi-agent PPO tutorial, small, and their ``ClipPPOLoss``
    with keys set for the nested per-agent entries and GAE; ``wrapped`` puts a wrapper of ``create_graph=True``
    around the actor's network."""
    from torchrl.objectives import ClipPPOLoss, ValueEstimators

    torch.manual_seed(0)
    core = agents_core(
        MultiAgentMLP(3, 4, N_AGENTS, centralized=False, share_params=share_params, depth=2, num_cells=8)
    )
    inner = LRP(core, EpsilonPlus(), target_key=("agents", "loc"), create_graph=True) if wrapped else core
    actor = agents_actor(inner, return_log_prob=True, log_prob_key=("agents", "sample_log_prob"))
    critic_net = MultiAgentMLP(
        3, 1, N_AGENTS, centralized=True, share_params=share_params, depth=2, num_cells=8, activation_class=nn.ReLU
    )
    critic = TensorDictModule(critic_net.to(F64), [("agents", "observation")], [("agents", "state_value")])
    loss = ClipPPOLoss(actor, critic, entropy_coeff=1e-3, normalize_advantage=False)
    loss.set_keys(
        reward=("agents", "reward"),
        action=("agents", "action"),
        sample_log_prob=("agents", "sample_log_prob"),
        value=("agents", "state_value"),
        done=("agents", "done"),
        terminated=("agents", "terminated"),
    )
    loss.make_value_estimator(ValueEstimators.GAE, gamma=0.99, lmbda=0.95)
    return loss, core, critic, actor


@pytest.fixture(scope="module")
def agents_batch() -> TensorDict:
    """Eight steps of the agents' environment, collected by another actor."""
    actor = mappo(share_params=True)[3]
    torch.manual_seed(3)
    with torch.no_grad():
        return Agents().rollout(8, actor)


def train_mappo(batch: TensorDict, share_params: bool, mode: str | None) -> tuple[list, list]:
    """Three Adam steps of the multi-agent PPO loss; ``mode``: ``"open"`` keeps contexts open on the actor's network
    (the agents' ``loc``, one agent at a time) and on the critic (LRP-0, one agent's value at a time), explaining
    before each step; ``"wrapped"`` trains the actor with a ``create_graph=True`` wrapper inside."""
    loss, core, critic, _ = mappo(share_params, wrapped=mode == "wrapped")
    optimizer = torch.optim.Adam(loss.parameters(), lr=0.05)
    open_ = mode == "open"
    actor_lrp = LRP(core, EpsilonPlus(), target_key=("agents", "loc"), split_dim=-2) if open_ else None
    critic_lrp = LRP(critic, BaseRuleMapper(stabilizer=0), split_dim=-2) if open_ else None
    grads, explained = [], []
    observations = batch.select(("agents", "observation"))
    with actor_lrp if open_ else contextlib.nullcontext(), critic_lrp if open_ else contextlib.nullcontext():
        for _ in range(3):
            data = batch.clone()
            with torch.no_grad():
                loss.value_estimator(
                    data, params=loss.critic_network_params, target_params=loss.target_critic_network_params
                )
            if open_:
                actor_relevance = actor_lrp(observations.clone())["relevance", "agents", "observation"]
                critic_relevance = critic_lrp(observations.clone())["relevance", "agents", "observation"]
                explained.append((actor_relevance, copy.deepcopy(core), critic_relevance, copy.deepcopy(critic)))
            optimizer.zero_grad()
            out = loss(data)
            (out["loss_objective"] + out["loss_critic"] + out["loss_entropy"]).backward()
            grads.append([p.grad.clone() for p in loss.parameters()])
            optimizer.step()
    return grads, explained


@pytest.mark.parametrize("share_params", [False, True], ids=["own parameters", "shared parameters"])
@pytest.mark.parametrize("mode", ["open", "wrapped"])
def test_multi_agent_ppo_trains_as_without_lrp(agents_batch: TensorDict, share_params: bool, mode: str):
    """``ClipPPOLoss`` over nested per-agent keys, with GAE, gives every parameter of the actor and of the critic
    the gradient of the same loop without LRP: with contexts open on both (explaining before each step), and with a
    ``create_graph=True`` wrapper inside the actor. Before, that wrapper around agents with their own parameters
    (run under ``torch.vmap``) gave the actor's parameters a zero gradient: its outputs carried the gradient of the
    vmapped values, computed without one."""
    expected, _ = train_mappo(agents_batch, share_params, mode=None)
    grads, _ = train_mappo(agents_batch, share_params, mode=mode)
    for index, (step, expected_step) in enumerate(zip(grads, expected, strict=True)):
        assert all(g.any() for g in expected_step), index  # every layer of the actor and of the critic is trained
        for grad, reference in zip(step, expected_step, strict=True):
            torch.testing.assert_close(grad, reference, rtol=1e-10, atol=1e-14, msg=f"step {index}")


@pytest.mark.parametrize("share_params", [False, True], ids=["own parameters", "shared parameters"])
def test_multi_agent_ppo_explained_between_steps_gives_each_agent_pair(agents_batch: TensorDict, share_params: bool):
    """With contexts open while training: the centralised critic's relevance of agent ``i``'s value on agent
    ``j``'s observation is gradient × input (LRP-0, ReLU), and the actor's is a fresh wrapper's, on the networks as
    the previous steps left them; a decentralised actor gives nothing on the other agents' observations."""
    _, explained = train_mappo(agents_batch, share_params, mode="open")
    observation = agents_batch["agents", "observation"].clone().requires_grad_()
    others = ~torch.eye(N_AGENTS, dtype=torch.bool)
    for index, (actor_relevance, core, critic_relevance, critic) in enumerate(explained):
        expected = per_agent_gradient_times_input(critic.module(observation), observation)
        assert critic_relevance.shape == (8, N_AGENTS, N_AGENTS, 3)
        assert critic_relevance[:, others].abs().sum(-1).gt(0).all()  # centralised: every agent on every agent
        torch.testing.assert_close(critic_relevance, expected, rtol=1e-10, atol=1e-12, msg=f"critic, call {index}")
        fresh = LRP(core, EpsilonPlus(), target_key=("agents", "loc"), split_dim=-2)
        fresh_relevance = fresh(agents_batch.select(("agents", "observation")))["relevance", "agents", "observation"]
        torch.testing.assert_close(actor_relevance, fresh_relevance, rtol=1e-10, atol=1e-12, msg=f"actor {index}")
        assert not actor_relevance[:, others].any()


@pytest.mark.parametrize("share_params", [False, True], ids=["own parameters", "shared parameters"])
def test_a_centralised_actor_in_a_rollout_explains_each_agents_action_on_every_agent(share_params: bool):
    """A centralised ``MultiAgentMLP`` actor wrapped with ``split_dim=-2`` (the agents' dimension, in a rollout step
    and in a batch alike) takes the actions of the plain actor, and writes per step the relevance of agent ``i``'s
    ``loc`` on agent ``j``'s observation: gradient × input under LRP-0 (ReLU)."""
    torch.manual_seed(0)
    net = MultiAgentMLP(
        3, 4, N_AGENTS, centralized=True, share_params=share_params, depth=2, num_cells=8, activation_class=nn.ReLU
    )
    core = agents_core(net)
    rollouts = {}
    for name, inner in [
        ("plain", core),
        ("explained", LRP(core, BaseRuleMapper(stabilizer=0), target_key=("agents", "loc"), split_dim=-2)),
    ]:
        actor = agents_actor(inner)
        torch.manual_seed(5)
        with torch.no_grad():
            rollouts[name] = Agents().rollout(6, actor)
    assert torch.equal(rollouts["explained"]["agents", "action"], rollouts["plain"]["agents", "action"])
    observation = rollouts["plain"]["agents", "observation"].clone().requires_grad_()
    loc = net(observation)[..., :2]
    chosen = loc.gather(-1, loc.argmax(-1, keepdim=True)).squeeze(-1)
    expected = per_agent_gradient_times_input(chosen, observation)
    relevance = rollouts["explained"]["relevance", "agents", "observation"]
    assert relevance.shape == (6, N_AGENTS, N_AGENTS, 3)
    torch.testing.assert_close(relevance, expected, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------------------ heterogeneous agents


class HeterogeneousAgents(TensorDictModuleBase):
    """One ReLU network per agent, each reading its own entry of the lazily stacked ``"agents"`` (observations of
    ``sizes``) and writing its action values (``actions`` of them) there."""

    in_keys = [("agents", "observation")]
    out_keys = [("agents", "action_value")]

    def __init__(self, sizes: list[int], actions: list[int]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.nets = nn.ModuleList(
            nn.Sequential(nn.Linear(size, 8), nn.ReLU(), nn.Linear(8, n)).to(F64)
            for size, n in zip(sizes, actions, strict=True)
        )

    def forward(self, td: TensorDict) -> TensorDict:
        for net, agent in zip(self.nets, td["agents"].tensordicts, strict=True):
            agent["action_value"] = net(agent["observation"])
        return td


def heterogeneous(sizes: list[int], goal: bool = False) -> TensorDict:
    """A batch of 4 with the agents' entries lazily stacked; ``goal``: the first agent holds a key of its own."""
    torch.manual_seed(1)
    agents = [TensorDict(observation=torch.randn(4, size, dtype=F64), batch_size=[4]) for size in sizes]
    if goal:
        agents[0]["goal"] = torch.randn(4, 2, dtype=F64)
    return TensorDict(agents=LazyStackedTensorDict.lazy_stack(agents, dim=1), batch_size=[4])


def test_lazily_stacked_agents_of_one_shape_get_each_their_gradient_times_input():
    """Agents stacked lazily, one of them with a key of its own, each read by its own network: the relevance of each
    agent's chosen action value on its observation is gradient × input (LRP-0)."""
    module, td = HeterogeneousAgents([3, 3], [2, 2]), heterogeneous([3, 3], goal=True)
    relevance = LRP(module, BaseRuleMapper(stabilizer=0))(td.clone())["relevance", "agents", "observation"]
    assert relevance.shape == (4, 2, 3)
    for index, (net, agent) in enumerate(zip(module.nets, td["agents"].tensordicts, strict=True)):
        x = agent["observation"].clone().requires_grad_()
        values = net(x)
        (grad,) = torch.autograd.grad(values.gather(-1, values.argmax(-1, keepdim=True)).sum(), x)
        torch.testing.assert_close(relevance[:, index], x.detach() * grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "sizes, actions, key",
    [([3, 5], [2, 2], "input ('agents', 'observation')"), ([3, 3], [2, 4], "output ('agents', 'action_value')")],
    ids=["observations", "action values"],
)
def test_lazily_stacked_agents_of_different_shapes_are_refused_naming_the_key(sizes, actions, key):
    """An input or target whose agents' entries differ in shape reads as no one tensor: tensordict's error named no
    key; the wrapper names the key and the entries' shapes, and leaves the caller's TensorDict as it was."""
    td = heterogeneous(sizes)
    before = set(td.keys(True, True))
    with pytest.raises(ValueError, match=rf"LRP: the {re.escape(key)}: entries of shapes \[\(4, \d\), \(4, \d\)\]"):
        LRP(HeterogeneousAgents(sizes, actions), BaseRuleMapper(stabilizer=0))(td)
    assert set(td.keys(True, True)) == before


@pytest.mark.parametrize("method", ["LRP", "Saliency"])
def test_a_replayed_step_of_an_action_chunk_is_refused_naming_the_wrapper(method: str):
    """torchrl's MultiStepActorWrapper runs its actor at a chunk's first step and replays the chunk's actions at the
    steps after, which their inputs do not reach: the refusal said only that the target does not depend on the
    inputs, in the middle of a rollout."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 3), nn.Unflatten(-1, (3, 1)))
    chunked = MultiStepActorWrapper(TensorDictModule(net, ["observation"], ["action"]), n_steps=3)
    wrapper = (lambda: LRP(chunked, BaseRuleMapper())) if method == "LRP" else (lambda: Saliency(chunked))
    first = TensorDict(observation=torch.randn(2, 3), is_init=torch.ones(2, 1, dtype=torch.bool), batch_size=[2])
    explained = wrapper()(first.clone())  # the actor acts at the chunk's first step: explained
    assert explained.get(("relevance" if method == "LRP" else "attribution", "observation")).abs().sum() > 0
    replayed = explained.exclude("relevance", "attribution").set("is_init", torch.zeros(2, 1, dtype=torch.bool))
    replayed["observation"] = torch.randn(2, 3)
    with pytest.raises(ValueError, match=r"\(MultiStepActorWrapper\) replays: it runs its actor once per chunk"):
        wrapper()(replayed.clone())


@pytest.mark.parametrize("distribution", ["Categorical", "OneHotCategorical"])
def test_a_sampling_policy_explains_the_action_it_draws_and_its_transitions_the_action_they_hold(distribution):
    """The relevance beside each step's action explains that action: the argmax of the logits was explained where
    the policy drew another action (28 of 64 steps of a collector, with no word), and again when the collected
    TensorDict was explained afterwards."""
    from torch.distributions import Categorical as Draw
    from torchrl.envs.utils import ExplorationType, set_exploration_type
    from torchrl.modules import OneHotCategorical

    torch.manual_seed(0)
    net = TensorDictModule(nn.Linear(4, 2), in_keys=["observation"], out_keys=["logits"])
    kind = Draw if distribution == "Categorical" else OneHotCategorical
    actor = ProbabilisticActor(net, in_keys=["logits"], distribution_class=kind, return_log_prob=True)
    env = GymEnv("CartPole-v1", categorical_action_encoding=distribution == "Categorical")
    env.set_seed(0)
    with set_exploration_type(ExplorationType.RANDOM):
        rollout = env.rollout(40, LRP(actor, BaseRuleMapper()), break_when_any_done=False)
        again = LRP(actor, BaseRuleMapper())(rollout.exclude("relevance"))  # stored transitions
    action = rollout["action"].argmax(-1) if distribution == "OneHotCategorical" else rollout["action"]
    assert (action != rollout["logits"].argmax(-1)).sum() >= 5  # the draws are not all the argmax
    x = rollout["observation"].clone().requires_grad_(True)
    (gradient,) = torch.autograd.grad(net.module(x).gather(-1, action[:, None]).sum(), x)
    torch.testing.assert_close(rollout["relevance", "observation"], gradient * x.detach())
    torch.testing.assert_close(again["relevance", "observation"], gradient * x.detach())
    assert torch.equal(again["action"], rollout["action"])  # the held action stays beside its relevance
