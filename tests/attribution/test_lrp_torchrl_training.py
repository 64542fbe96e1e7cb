"""Explaining while training: torchrl's loss modules, optimisers and target updates around an LRP wrapper.

A training loop keeps a context open on its policy's network and explains between optimiser steps, while a loss
module (which runs the actor with its own functional parameters) takes the gradient. The oracles are the same loop
without the wrapper (plain autograd), and a fresh wrapper on a copy of the network as it is after each step.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import NormalParamExtractor, TensorDictModule
from torch import nn
from torchrl.envs import GymEnv
from torchrl.modules import MLP, Actor, ProbabilisticActor, QValueActor, TanhNormal, ValueOperator

from tdhook.attribution import LRP, BaseRuleMapper, EpsilonGammaBox, EpsilonPlus, EpsilonPlusFlat

F64 = torch.float64
MAPPERS = {
    "EpsilonPlusFlat": EpsilonPlusFlat,
    "EpsilonGammaBox": lambda: EpsilonGammaBox(-3.0, 3.0),
    "LRP-0": lambda: BaseRuleMapper(stabilizer=0),
}


def float64(td: TensorDict) -> TensorDict:
    return td.apply(lambda t: t.double() if t.is_floating_point() else t)


def ppo_parts(seed: int = 0) -> tuple[ProbabilisticActor, ValueOperator, TensorDictModule]:
    """The actor and critic of torchrl's PPO tutorial, small, for Pendulum (3 observations, 1 action)."""
    torch.manual_seed(seed)
    net = nn.Sequential(
        MLP(in_features=3, out_features=2, num_cells=[8], activation_class=nn.Tanh).to(F64), NormalParamExtractor()
    )
    core = TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"])
    actor = ProbabilisticActor(
        core,
        in_keys=["loc", "scale"],
        distribution_class=TanhNormal,
        distribution_kwargs={"low": -2.0, "high": 2.0},
        return_log_prob=True,
    )
    critic = ValueOperator(MLP(in_features=3, out_features=1, num_cells=[8]).to(F64), in_keys=["observation"])
    return actor, critic, core


@pytest.fixture(scope="module")
def pendulum_batch() -> TensorDict:
    """Six steps of Pendulum-v1 collected by the (float32) actor, in float64."""
    env = GymEnv("Pendulum-v1")
    env.set_seed(0)
    actor, _, _ = ppo_parts(seed=1)
    with torch.no_grad():
        batch = env.rollout(6, actor.float())
    env.close()
    return float64(batch)


def transitions(action: torch.Tensor) -> TensorDict:
    torch.manual_seed(1)
    batch = action.shape[0]
    done = torch.zeros(batch, 1, dtype=torch.bool)
    return TensorDict(
        observation=torch.randn(batch, 4, dtype=F64),
        action=action,
        next=TensorDict(
            observation=torch.randn(batch, 4, dtype=F64),
            reward=torch.randn(batch, 1, dtype=F64),
            done=done,
            terminated=done.clone(),
        ),
        batch_size=[batch],
    )


def ppo_loop(batch: TensorDict):
    from torchrl.objectives import ClipPPOLoss
    from torchrl.objectives.value import GAE

    actor, critic, core = ppo_parts()
    loss = ClipPPOLoss(actor, critic)
    batch = batch.clone()
    GAE(gamma=0.99, lmbda=0.95, value_network=critic)(batch)

    def step() -> None:
        out = loss(batch)
        (out["loss_objective"] + out["loss_critic"] + out["loss_entropy"]).backward()

    return loss, core, batch.select("observation"), step, None


def dqn_loop(_: TensorDict):
    from torchrl.objectives import DQNLoss, SoftUpdate

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(F64)
    actor = QValueActor(net, in_keys=["observation"], action_space="one-hot")
    loss = DQNLoss(actor, action_space="one-hot", delay_value=True)
    updater = SoftUpdate(loss, eps=0.5)
    data = transitions(nn.functional.one_hot(torch.randint(2, (5,)), 2))

    def step() -> None:
        loss(data)["loss"].backward()

    core = TensorDictModule(net, in_keys=["observation"], out_keys=["action_value"])
    return loss, core, data.select("observation"), step, updater


def ddpg_loop(_: TensorDict):
    from torchrl.objectives import DDPGLoss, SoftUpdate

    torch.manual_seed(0)
    actor = Actor(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(F64), in_keys=["observation"])
    qvalue = ValueOperator(MLP(in_features=6, out_features=1, num_cells=[8]).to(F64), in_keys=["observation", "action"])
    loss = DDPGLoss(actor, qvalue, delay_actor=True, delay_value=True)
    updater = SoftUpdate(loss, eps=0.5)
    data = transitions(torch.randn(5, 2, dtype=F64).tanh())

    def step() -> None:
        out = loss(data)
        (out["loss_actor"] + out["loss_value"]).backward()

    return loss, actor, data.select("observation"), step, updater


LOOPS = {"ClipPPOLoss+GAE": ppo_loop, "DQNLoss+SoftUpdate": dqn_loop, "DDPGLoss+SoftUpdate": ddpg_loop}


def train(loop: str, batch: TensorDict, mapper: str | None, steps: int = 3):
    """Adam steps of ``loop`` on ``batch``; with ``mapper``, a context on the actor's network open throughout,
    explaining before each step. Returns the gradients of each step, the parameters, and the relevance of each
    explained call with the network it explained (a copy)."""
    loss, core, inputs, step, updater = LOOPS[loop](batch)
    optimizer = torch.optim.Adam(loss.parameters(), lr=0.05)
    lrp = LRP(core, MAPPERS[mapper]()) if mapper else None
    grads, explained = [], []
    with lrp if lrp is not None else torch.enable_grad():
        for _ in range(steps):
            if lrp is not None:
                explained.append((lrp(inputs.clone())["relevance", "observation"], copy.deepcopy(core)))
            optimizer.zero_grad()
            step()
            grads.append([None if p.grad is None else p.grad.clone() for p in loss.parameters()])
            optimizer.step()
            if updater is not None:
                updater.step()
    return grads, [p.detach().clone() for p in loss.parameters()], explained, inputs


@pytest.mark.parametrize("mapper", list(MAPPERS))
@pytest.mark.parametrize("loop", list(LOOPS))
def test_a_training_loop_explaining_in_an_open_context_trains_as_without_it(
    loop: str, mapper: str, pendulum_batch: TensorDict
):
    """The loss module's calls of the actor, with its functional parameters swapped in, take the plain gradient in
    an open context, every step; each explained call gives the relevance of a fresh wrapper on the network as the
    previous steps (Adam, the target update) left it."""
    plain_grads, plain_params, _, _ = train(loop, pendulum_batch, mapper=None)
    grads, params, explained, inputs = train(loop, pendulum_batch, mapper=mapper)
    for index, (plain_step, step) in enumerate(zip(plain_grads, grads, strict=True)):
        assert sum(g is not None for g in step) > 2, index  # the actor's layers are trained
        for plain, grad in zip(plain_step, step, strict=True):
            assert (plain is None) == (grad is None), index
            if grad is not None:
                torch.testing.assert_close(grad, plain, rtol=1e-12, atol=1e-14, msg=f"step {index}")
    for plain, param in zip(plain_params, params, strict=True):
        torch.testing.assert_close(param, plain, rtol=1e-12, atol=1e-14)
    for index, (relevance, network) in enumerate(explained):
        fresh = LRP(network, MAPPERS[mapper]())(inputs.clone())["relevance", "observation"]
        torch.testing.assert_close(relevance, fresh, rtol=1e-10, atol=1e-12, msg=f"call {index}")
    assert not torch.allclose(explained[0][0], explained[-1][0])  # the steps changed what is explained


def test_lrp0_in_an_open_context_between_steps_is_gradient_times_input(pendulum_batch: TensorDict):
    """After Adam steps and soft target updates taken in the open context, LRP-0 on the DQN's ReLU Q-network is
    gradient × input of its chosen action value, with the network as it now is."""
    _, _, explained, inputs = train("DQNLoss+SoftUpdate", pendulum_batch, mapper="LRP-0")
    relevance, network = explained[-1]
    observation = inputs["observation"].clone().requires_grad_()
    values = network.module(observation)
    chosen = values.gather(-1, values.argmax(-1, keepdim=True))
    (grad,) = torch.autograd.grad(chosen.sum(), observation)
    torch.testing.assert_close(relevance, observation.detach() * grad, rtol=1e-10, atol=1e-12)


def ppo_gradients(batch: TensorDict, wrapped: bool) -> tuple[list[torch.Tensor], TensorDict | None]:
    from torchrl.objectives import ClipPPOLoss
    from torchrl.objectives.value import GAE

    actor, critic, core = ppo_parts()
    network = core.module
    if wrapped:  # the same actor with the wrapper around its network
        actor = ProbabilisticActor(
            LRP(core, EpsilonPlus(), target_key="loc", create_graph=True),
            in_keys=["loc", "scale"],
            distribution_class=TanhNormal,
            distribution_kwargs={"low": -2.0, "high": 2.0},
            return_log_prob=True,
        )
    loss = ClipPPOLoss(actor, critic)
    batch = batch.clone()
    GAE(gamma=0.99, lmbda=0.95, value_network=critic)(batch)
    out = loss(batch)
    (out["loss_objective"] + out["loss_critic"] + out["loss_entropy"]).backward()
    explained = actor(batch.select("observation").clone()) if wrapped else None
    return [p.grad.clone() for p in network.parameters()], explained


def test_a_create_graph_wrapper_inside_the_actor_gives_the_ppo_loss_the_plain_gradients(pendulum_batch: TensorDict):
    """``create_graph=True`` writes outputs that keep their graph with the plain gradient: an actor with the
    wrapper inside trains as the plain actor, and its relevance is that of the wrapper without the flag."""
    plain, _ = ppo_gradients(pendulum_batch, wrapped=False)
    grads, explained = ppo_gradients(pendulum_batch, wrapped=True)
    for grad, expected in zip(grads, plain, strict=True):
        torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)
    _, _, core = ppo_parts()
    expected = LRP(core, EpsilonPlus(), target_key="loc")(pendulum_batch.select("observation").clone())
    torch.testing.assert_close(
        explained["relevance", "observation"].detach(), expected["relevance", "observation"], rtol=1e-10, atol=1e-12
    )
