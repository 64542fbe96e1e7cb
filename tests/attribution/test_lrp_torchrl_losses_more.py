"""torchrl's loss modules around an LRP wrapper, beyond PPO, DQN, DDPG and SAC: TD3, TD3+BC, IQL, CQL, REDQ, CrossQ,
discrete SAC, CQL and IQL, A2C, REINFORCE, and Dreamer's model-based losses; and collectors feeding replay buffers.

A wrapper with ``create_graph=True`` inside a loss's network trains it as the plain network: the losses and every
parameter's gradient, over Adam steps and target updates, equal those of the same loss on the unwrapped networks
(same seeds, same batches), wherever the loss runs it but under ``torch.func.vmap`` (there it is refused). A wrapper
without it is refused, naming the wrapper and the loss, wherever the loss calls it from (its own code, the loop of
its helpers with ``deactivate_vmap=True``, an imagined rollout in a model-based environment, a torchrl module's
loop).
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Callable

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import NormalParamExtractor, TensorDictModule, TensorDictSequential
from torch import nn
from torchrl.data import Bounded, Composite, Unbounded
from torchrl.modules import MLP, OneHotCategorical, ProbabilisticActor, QValueActor, TanhNormal

from tdhook.attribution import LRP, BaseRuleMapper, EpsilonGammaBox, EpsilonPlus

os.environ.setdefault("RL_WARNINGS", "0")  # the losses built without a target updater warn at each build

F64 = torch.float64
SPEC = Bounded(-1.0, 1.0, (1,), dtype=F64)
Wrap = Callable[[TensorDictModule, str], nn.Module]


def plain(core: TensorDictModule, key: str) -> nn.Module:
    return core


def kept_graph(core: TensorDictModule, key: str) -> nn.Module:
    return LRP(core, EpsilonPlus(), target_key=key, create_graph=True)


def detached(core: TensorDictModule, key: str) -> nn.Module:
    return LRP(core, EpsilonPlus(), target_key=key)


# ----------------------------------------------------------------------------- networks (Pendulum, CartPole sizes)


def gaussian_actor(wrap: Wrap) -> ProbabilisticActor:
    net = nn.Sequential(
        MLP(in_features=3, out_features=2, num_cells=[8], activation_class=nn.Tanh), NormalParamExtractor()
    )
    core = TensorDictModule(net.to(F64), in_keys=["observation"], out_keys=["loc", "scale"])
    return ProbabilisticActor(
        wrap(core, "loc"), in_keys=["loc", "scale"], distribution_class=TanhNormal, return_log_prob=True, spec=SPEC
    )


def deterministic_actor(wrap: Wrap) -> nn.Module:
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1), nn.Tanh()).to(F64)
    return wrap(TensorDictModule(net, in_keys=["observation"], out_keys=["action"]), "action")


def q_value(wrap: Wrap) -> nn.Module:
    net = MLP(in_features=4, out_features=1, num_cells=[8]).to(F64)
    return wrap(
        TensorDictModule(net, in_keys=["observation", "action"], out_keys=["state_action_value"]), "state_action_value"
    )


def state_value(wrap: Wrap, observations: int = 3) -> nn.Module:
    net = MLP(in_features=observations, out_features=1, num_cells=[8]).to(F64)
    return wrap(TensorDictModule(net, in_keys=["observation"], out_keys=["state_value"]), "state_value")


def categorical_actor(wrap: Wrap) -> ProbabilisticActor:
    net = MLP(in_features=4, out_features=2, num_cells=[8], activation_class=nn.Tanh).to(F64)
    core = TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])
    return ProbabilisticActor(
        wrap(core, "logits"), in_keys=["logits"], distribution_class=OneHotCategorical, return_log_prob=True
    )


def action_values(wrap: Wrap, key: str = "action_value") -> nn.Module:
    net = MLP(in_features=4, out_features=2, num_cells=[8]).to(F64)
    return wrap(TensorDictModule(net, in_keys=["observation"], out_keys=[key]), key)


def q_actor(wrap: Wrap) -> QValueActor:
    return QValueActor(action_values(wrap), in_keys=["observation"], action_space="one-hot")


def _objectives():
    import torchrl.objectives as objectives

    return objectives


# name: (build(actor wrap, critic wrap, **options), continuous actions, what runs the critic): "loss", the loss's
# code; "vmap", the loss under torch.func.vmap over stacked parameters; "estimator", the value estimator the loss
# runs, under vmap.
BUILDS: dict[str, tuple[Callable, bool, str]] = {
    "TD3Loss": (
        lambda a, c, **o: _objectives().TD3Loss(deterministic_actor(a), q_value(c), action_spec=SPEC, **o),
        True,
        "vmap",
    ),
    "TD3BCLoss": (
        lambda a, c, **o: _objectives().TD3BCLoss(deterministic_actor(a), q_value(c), action_spec=SPEC, **o),
        True,
        "vmap",
    ),
    "IQLLoss": (
        lambda a, c, **o: _objectives().IQLLoss(gaussian_actor(a), q_value(c), state_value(c), **o),
        True,
        "vmap",
    ),
    "CQLLoss": (
        lambda a, c, **o: _objectives().CQLLoss(gaussian_actor(a), q_value(c), action_spec=SPEC, **o),
        True,
        "vmap",
    ),
    "REDQLoss": (
        lambda a, c, **o: _objectives().REDQLoss(
            gaussian_actor(a), q_value(c), num_qvalue_nets=4, sub_sample_len=2, target_entropy=-1.0, **o
        ),
        True,
        "vmap",
    ),
    "CrossQLoss": (
        lambda a, c, **o: _objectives().CrossQLoss(gaussian_actor(a), q_value(c), target_entropy=-1.0, **o),
        True,
        "vmap",
    ),
    "SACLoss(v1)": (
        lambda a, c, **o: _objectives().SACLoss(
            gaussian_actor(a), q_value(c), state_value(c), target_entropy=-1.0, **o
        ),
        True,
        "vmap",
    ),
    "DiscreteSACLoss": (
        lambda a, c, **o: _objectives().DiscreteSACLoss(
            categorical_actor(a), action_values(c), num_actions=2, target_entropy=-0.5, action_space="one-hot", **o
        ),
        False,
        "vmap",
    ),
    "DiscreteIQLLoss": (
        lambda a, c: _objectives().DiscreteIQLLoss(
            categorical_actor(a), action_values(c, "state_action_value"), state_value(c, 4), action_space="one-hot"
        ),
        False,
        "vmap",
    ),
    "A2CLoss": (lambda a, c: _objectives().A2CLoss(gaussian_actor(a), state_value(c)), True, "estimator"),
    "ReinforceLoss": (lambda a, c: _objectives().ReinforceLoss(gaussian_actor(a), state_value(c)), True, "estimator"),
    "DDPGLoss": (lambda a, c: _objectives().DDPGLoss(deterministic_actor(a), q_value(c)), True, "loss"),
    "DQNLoss": (
        lambda a, c: _objectives().DQNLoss(q_actor(c), action_space="one-hot", delay_value=True),
        False,
        "loss",
    ),
    "DiscreteCQLLoss": (
        lambda a, c: _objectives().DiscreteCQLLoss(q_actor(c), action_space="one-hot", delay_value=True),
        False,
        "loss",
    ),
}
# With deactivate_vmap=True the losses run their Q-networks (and REDQ its actor) in a Python loop of their helpers.
NO_VMAP = ["TD3Loss", "TD3BCLoss", "IQLLoss", "CQLLoss", "REDQLoss", "CrossQLoss", "SACLoss(v1)", "DiscreteSACLoss"]
LOSSES: dict[str, tuple[Callable, bool, str]] = {
    **BUILDS,
    **{
        f"{name}, deactivate_vmap": (
            lambda a, c, build=BUILDS[name][0]: build(a, c, deactivate_vmap=True),
            BUILDS[name][1],
            "loss",
        )
        for name in NO_VMAP
    },
}


def with_estimator_in_a_loop(loss, estimator: str, **hyperparameters):
    """``loss`` with a value estimator that calls the critic in a Python loop (``deactivate_vmap=True``)."""
    from torchrl.objectives import ValueEstimators

    loss.make_value_estimator(getattr(ValueEstimators, estimator), deactivate_vmap=True, **hyperparameters)
    return loss


LOSSES["A2CLoss, deactivate_vmap"] = (
    lambda a, c: with_estimator_in_a_loop(
        _objectives().A2CLoss(gaussian_actor(a), state_value(c)), "GAE", gamma=0.9, lmbda=0.9
    ),
    True,
    "loss",
)
LOSSES["ClipPPOLoss(clip_value), deactivate_vmap"] = (
    lambda a, c: with_estimator_in_a_loop(
        _objectives().ClipPPOLoss(gaussian_actor(a), state_value(c), clip_value=0.05), "TDLambda", gamma=0.9, lmbda=0.9
    ),
    True,
    "loss",
)
WITH_ACTOR = [name for name in LOSSES if name not in ("DQNLoss", "DiscreteCQLLoss")]
# REDQ runs its actor under torch.func.vmap too (its sampled actions for every Q-network at once).
ACTOR_IN_LOSS_CODE = [name for name in WITH_ACTOR if name != "REDQLoss"]
CRITIC_IN_LOSS_CODE = [name for name, (_, _, runs) in LOSSES.items() if runs == "loss"]
CRITIC_UNDER_VMAP = [name for name, (_, _, runs) in LOSSES.items() if runs != "loss"]


def loss_class(name: str) -> str:
    return name.split("(")[0].split(",")[0]


def transitions(step: int, continuous: bool, batch: int = 6) -> TensorDict:
    torch.manual_seed(100 + step)
    observations = 3 if continuous else 4
    if continuous:
        action = torch.rand(batch, 1, dtype=F64) * 1.8 - 0.9
    else:
        action = nn.functional.one_hot(torch.randint(2, (batch,)), 2)
    done = torch.zeros(batch, 1, dtype=torch.bool)
    done[-1] = True
    return TensorDict(
        observation=torch.randn(batch, observations, dtype=F64),
        action=action,
        action_log_prob=0.1 * torch.randn(batch, dtype=F64),
        next=TensorDict(
            observation=torch.randn(batch, observations, dtype=F64),
            reward=torch.randn(batch, 1, dtype=F64),
            done=done,
            terminated=done.clone(),
        ),
        batch_size=[batch],
    )


def is_target(key: str) -> bool:
    """Whether a loss's buffer is one of its target parameters (``target_entropy`` is not)."""
    return key.startswith("target_") and "_params." in key


def train(name: str, actor: Wrap, critic: Wrap, steps: int = 3):
    """Adam steps of loss ``name`` with a soft target update after each (where it has targets). Returns the losses
    of each step, every parameter's gradient at each step, and the target parameters after the last."""
    from torchrl.objectives import SoftUpdate

    build, continuous, _ = LOSSES[name]
    torch.manual_seed(0)
    loss = build(actor, critic)
    has_targets = any(is_target(key) for key, _ in loss.named_buffers())
    updater = SoftUpdate(loss, eps=0.5) if has_targets else None
    optimizer = torch.optim.Adam(loss.parameters(), lr=0.05)
    values, grads = [], []
    torch.manual_seed(5)
    for step in range(steps):
        out = loss(transitions(step, continuous))
        total = sum(v for k, v in out.items() if (k == "loss" or k.startswith("loss_")) and v.requires_grad)
        optimizer.zero_grad()
        total.backward()
        values.append(total.detach())
        grads.append([None if p.grad is None else p.grad.clone() for p in loss.parameters()])
        optimizer.step()
        if updater is not None:
            updater.step()
    targets = [b.detach().clone() for key, b in loss.named_buffers() if is_target(key)]
    return values, grads, targets, loss


def assert_trains_as_the_plain_loss(name: str, actor: Wrap, critic: Wrap) -> None:
    plain_values, plain_grads, plain_targets, plain_loss = train(name, plain, plain)
    values, grads, targets, _ = train(name, actor, critic)
    torch.testing.assert_close(torch.stack(values), torch.stack(plain_values), rtol=1e-10, atol=1e-12)
    for step, (plain_step, step_grads) in enumerate(zip(plain_grads, grads, strict=True)):
        assert sum(g is not None for g in step_grads) >= 4, step  # the networks are trained
        for plain_grad, grad in zip(plain_step, step_grads, strict=True):
            assert (plain_grad is None) == (grad is None), step
            if grad is not None:
                torch.testing.assert_close(grad, plain_grad, rtol=1e-9, atol=1e-11, msg=f"step {step}")
    for plain_target, target in zip(plain_targets, targets, strict=True):
        torch.testing.assert_close(target, plain_target, rtol=1e-9, atol=1e-11)
    if plain_targets:  # the oracle can tell the target parameters from the live ones
        live = dict(plain_loss.named_parameters())
        names = [key for key, _ in plain_loss.named_buffers() if is_target(key)]
        pairs = [(plain_loss.get_buffer(k), live[k.removeprefix("target_")]) for k in names if k[7:] in live]
        assert pairs and any(not torch.allclose(target, param) for target, param in pairs)


@pytest.mark.parametrize("name", ACTOR_IN_LOSS_CODE)
def test_a_create_graph_wrapper_in_the_actor_trains_as_the_plain_actor(name: str):
    assert_trains_as_the_plain_loss(name, kept_graph, plain)


def test_a_wrapper_in_redqs_actor_which_it_runs_under_vmap_is_refused():
    with pytest.raises(NotImplementedError, match=r"^LRP: the call runs under a torch\.func transform"):
        train("REDQLoss", kept_graph, plain, steps=1)
    with pytest.raises(RuntimeError, match=r"^LRP: called by torchrl's REDQLoss as one of its networks"):
        train("REDQLoss", detached, plain, steps=1)


@pytest.mark.parametrize("name", CRITIC_IN_LOSS_CODE)
def test_a_create_graph_wrapper_in_the_critic_trains_as_the_plain_critic(name: str):
    assert_trains_as_the_plain_loss(name, plain if name != "DDPGLoss" else kept_graph, kept_graph)


@pytest.mark.parametrize("name", ACTOR_IN_LOSS_CODE)
def test_a_wrapper_without_create_graph_in_the_actor_is_refused_naming_the_loss(name: str):
    with pytest.raises(RuntimeError, match=rf"^LRP: called by torchrl's {loss_class(name)} as one of its networks"):
        train(name, detached, plain, steps=1)


@pytest.mark.parametrize("name", CRITIC_IN_LOSS_CODE)
def test_a_wrapper_without_create_graph_in_the_critic_is_refused_naming_the_loss(name: str):
    """With ``deactivate_vmap=True`` the loss calls its Q-networks in a Python loop of its helpers (``_vmap_func``).
    Before, there, no error: the actor's gradient through the Q-network was wrong (TD3: none; TD3+BC: 0.28 off a
    largest entry of 0.42; SAC and CrossQ: 2 %, CQL and REDQ: 0.7 % of the largest entry off) and discrete SAC's
    Q-networks were left untrained, without a word."""
    with pytest.raises(RuntimeError, match=rf"^LRP: called by torchrl's {loss_class(name)} as one of its networks"):
        train(name, plain, detached, steps=1)


@pytest.mark.parametrize("name", CRITIC_UNDER_VMAP)
@pytest.mark.parametrize("wrap", [kept_graph, detached], ids=["create_graph", "without"])
def test_a_wrapper_in_a_critic_run_under_vmap_is_refused(name: str, wrap: Wrap):
    """These losses (or the value estimators they run) call the critic under ``torch.func.vmap`` over stacked
    parameters, which runs no hook: refused by the wrapper, never a wrong gradient (a call without ``create_graph``
    that the loss makes with gradient enabled is refused naming the loss first). The error for the transform names
    the loss (it named none), its value estimator where that runs the vmap, and the option that calls the critic in
    a loop where they have one."""
    message = rf"^LRP: (called by torchrl's {loss_class(name)} as one|the call runs under a torch\.func transform)"
    with pytest.raises((RuntimeError, NotImplementedError), match=message) as raised:
        train(name, plain, wrap, steps=1)
    assert wrap is detached or raised.type is NotImplementedError
    if raised.type is NotImplementedError:
        called = f"; it is called by torchrl's {loss_class(name)}"
        if LOSSES[name][2] == "estimator":
            advice = f"{called} through its value estimator (GAE), which runs the network under torch.func.vmap: make"
            advice += " the estimator with loss.make_value_estimator(..., deactivate_vmap=True)"
        elif name in NO_VMAP:
            advice = (
                f"{called}, which runs its networks under torch.func.vmap: build the loss with deactivate_vmap=True"
            )
        else:
            advice = f"{called}, which runs its networks under torch.func.vmap: give the loss the plain network"
        assert advice in str(raised.value)


def test_a_wrapper_without_create_graph_nested_deep_in_the_actor_is_refused_naming_the_loss():
    """Each ``TensorDictSequential`` around the wrapper puts some six frames of tensordict's between the loss's code
    and the wrapper. Before, from six levels on, the check looked no further than 40 frames: no error, and PPO's actor
    was left untrained (no gradient at all) while the critic's term trained, without a word."""
    from torchrl.objectives import ClipPPOLoss

    torch.manual_seed(0)
    network = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2), NormalParamExtractor()).to(F64)
    nested = detached(TensorDictModule(network, in_keys=["observation"], out_keys=["loc", "scale"]), "loc")
    for _ in range(8):
        nested = TensorDictSequential(nested)
    actor = ProbabilisticActor(nested, in_keys=["loc", "scale"], distribution_class=TanhNormal, return_log_prob=True)
    loss = ClipPPOLoss(actor, state_value(plain))
    batch = transitions(0, continuous=True).set("advantage", torch.randn(6, 1, dtype=F64))
    batch.set("value_target", torch.randn(6, 1, dtype=F64))
    with pytest.raises(RuntimeError, match=r"^LRP: called by torchrl's ClipPPOLoss as one of its networks"):
        loss(batch)


@pytest.mark.parametrize(
    "name",
    ["TD3Loss", "SACLoss(v1)", "IQLLoss", "CQLLoss", "REDQLoss", "DiscreteSACLoss", "SACLoss(v1), deactivate_vmap"],
)
def test_contexts_open_on_the_plain_networks_train_as_without_them_and_explain_as_fresh_wrappers(name: str):
    """The documented pattern: the loss gets the plain networks; contexts stay open on them (the Q-networks that the
    loss runs under vmap with its own parameters included) and explain between steps."""
    from torchrl.objectives import SoftUpdate

    def run(explain: bool):
        build, continuous, _ = LOSSES[name]
        cores: list[tuple[TensorDictModule, str]] = []
        torch.manual_seed(0)
        loss = build(*[lambda core, key: (cores.append((core, key)), core)[1]] * 2)
        updater = SoftUpdate(loss, eps=0.5)
        optimizer = torch.optim.Adam(loss.parameters(), lr=0.05)
        wrappers = [LRP(core, EpsilonPlus(), target_key=key) for core, key in cores] if explain else []
        explained = []
        torch.manual_seed(5)
        with contextlib.ExitStack() as stack:
            for wrapper in wrappers:
                stack.enter_context(wrapper)
            for step in range(3):
                data = transitions(step, continuous)
                for wrapper, (core, key) in zip(wrappers, cores if explain else [], strict=True):
                    inputs = data.select(*core.in_keys)
                    explained.append((wrapper(inputs.clone()), copy.deepcopy(core), key, inputs))
                out = loss(data)
                total = sum(v for k, v in out.items() if k.startswith("loss_") and v.requires_grad)
                optimizer.zero_grad()
                total.backward()
                optimizer.step()
                updater.step()
        return [p.detach().clone() for p in loss.parameters()], explained

    plain_params, _ = run(explain=False)
    params, explained = run(explain=True)
    for plain_param, param in zip(plain_params, params, strict=True):
        torch.testing.assert_close(param, plain_param, rtol=1e-9, atol=1e-11)
    assert len(explained) >= 6
    for td, network, key, inputs in explained:
        fresh = LRP(network, EpsilonPlus(), target_key=key)(inputs.clone())
        for in_key in network.in_keys:
            torch.testing.assert_close(td["relevance", in_key], fresh["relevance", in_key], rtol=1e-9, atol=1e-11)


# ----------------------------------------------------------------------------- Dreamer: networks run through torchrl


class Joined(nn.Module):
    """A layer on its inputs concatenated (and flattened over their last three dimensions where they have more)."""

    def __init__(self, layer: nn.Module, unflatten: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.layer, self.unflatten = layer, unflatten

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        out = self.layer(torch.cat([x.flatten(-3) if x.ndim > 3 else x for x in inputs], -1))
        return out if self.unflatten is None else out.unflatten(-1, self.unflatten)


def imagined_actor_loss(wrap: Wrap, where: str):
    """``DreamerActorLoss`` of a deterministic actor in a small model-based environment (state 3, belief 2, action
    1), with ``wrap`` around the actor or around the world model's transition."""
    from torchrl.envs.model_based import ModelBasedEnvBase
    from torchrl.modules import WorldModelWrapper
    from torchrl.objectives import DreamerActorLoss

    class ImaginedEnv(ModelBasedEnvBase):
        def __init__(self, world_model: nn.Module) -> None:
            super().__init__(world_model)
            self.observation_spec = Composite(state=Unbounded((3,), dtype=F64), belief=Unbounded((2,), dtype=F64))
            self.state_spec = self.observation_spec.clone()
            self.action_spec = Unbounded((1,), dtype=F64)
            self.reward_spec = Unbounded((1,), dtype=F64)

        def _reset(self, tensordict: TensorDict) -> TensorDict:
            return tensordict.select("state", "belief").clone()

    torch.manual_seed(0)
    transition = TensorDictModule(
        Joined(nn.Sequential(nn.Linear(6, 5), nn.Tanh()).to(F64)),
        in_keys=["state", "belief", "action"],
        out_keys=["hidden"],
    )
    world_model = WorldModelWrapper(
        TensorDictSequential(
            wrap(transition, "hidden") if where == "world model" else transition,
            TensorDictModule(lambda h: (h[..., :3], h[..., 3:]), in_keys=["hidden"], out_keys=["state", "belief"]),
        ),
        TensorDictModule(nn.Linear(5, 1).to(F64), in_keys=["hidden"], out_keys=["reward"]),
    )
    actor_net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1), nn.Tanh()).to(F64)
    core = TensorDictModule(Joined(actor_net), in_keys=["state", "belief"], out_keys=["action"])
    actor = wrap(core, "action") if where == "actor" else core
    value = TensorDictModule(Joined(nn.Linear(5, 1).to(F64)), in_keys=["state", "belief"], out_keys=["state_value"])
    return DreamerActorLoss(actor, value, ImaginedEnv(world_model), imagination_horizon=3), actor_net, value


def dreamer_actor_gradients(wrap: Wrap, where: str) -> list[torch.Tensor | None]:
    """The actor's gradients of Dreamer's actor and value losses summed, as a training step may sum them."""
    from torchrl.objectives import DreamerValueLoss

    loss, actor_net, value = imagined_actor_loss(wrap, where)
    torch.manual_seed(1)
    start = TensorDict(state=torch.randn(4, 3, dtype=F64), belief=torch.randn(4, 2, dtype=F64), batch_size=[4])
    out, imagined = loss(start)
    (out["loss_actor"] + DreamerValueLoss(value)(imagined)[0]["loss_value"]).backward()
    return [p.grad for p in actor_net.parameters()]


@pytest.mark.parametrize("where", ["actor", "world model"])
def test_dreamers_actor_loss_with_a_wrapper_without_create_graph_is_refused_naming_it(where: str):
    """The loss rolls the actor out in its model-based environment: the wrapper is called from torchrl's environment
    code, not the loss's. Before, no error: the actor's loss had no gradient, and summed with the value loss the
    actor's parameters were left untrained without a word (gradients of up to 1.0 in this case: none)."""
    with pytest.raises(RuntimeError, match=r"^LRP: called by torchrl's DreamerActorLoss as one of its networks"):
        dreamer_actor_gradients(detached, where)


@pytest.mark.parametrize("where", ["actor", "world model"])
def test_dreamers_actor_loss_with_a_create_graph_wrapper_gives_the_plain_gradients(where: str):
    expected = dreamer_actor_gradients(plain, where)
    assert all(g is not None and g.abs().max() > 1e-3 for g in expected)
    for grad, plain_grad in zip(dreamer_actor_gradients(kept_graph, where), expected, strict=True):
        torch.testing.assert_close(grad, plain_grad, rtol=1e-10, atol=1e-12)


class Prior(nn.Module):
    """A small RSSM prior: the next belief from state, belief and action, and a Gaussian's mean and scale."""

    def __init__(self) -> None:
        super().__init__()
        self.belief, self.head = nn.Sequential(nn.Linear(6, 3), nn.Tanh()), nn.Linear(3, 4)

    def forward(self, state, belief, action):
        belief = self.belief(torch.cat([state, belief, action], -1))
        mean, scale = self.head(belief).chunk(2, -1)
        return mean, nn.functional.softplus(scale) + 0.1, belief


class Posterior(nn.Module):
    """A small RSSM posterior: a Gaussian's mean and scale from the belief and the encoded pixels; its mean as the
    state."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(5, 4)

    def forward(self, belief, latents):
        mean, scale = self.head(torch.cat([belief, latents], -1)).chunk(2, -1)
        return mean, nn.functional.softplus(scale) + 0.1, mean


def world_model_gradients(wrap: Wrap) -> dict[str, torch.Tensor | None]:
    """Every gradient of ``DreamerModelLoss`` (KL, reconstruction and reward terms summed) on a world model whose
    ``RSSMRollout`` calls the prior (with ``wrap`` around it) and the posterior at each time step."""
    from torchrl.modules import RSSMRollout, WorldModelWrapper
    from torchrl.objectives import DreamerModelLoss

    torch.manual_seed(0)
    prior_keys = [("next", "prior_mean"), ("next", "prior_std"), ("next", "belief")]
    prior = TensorDictModule(Prior().to(F64), in_keys=["state", "belief", "action"], out_keys=prior_keys)
    posterior = TensorDictModule(
        Posterior().to(F64),
        in_keys=[("next", "belief"), ("next", "encoded_latents")],
        out_keys=[("next", "posterior_mean"), ("next", "posterior_std"), ("next", "state")],
    )
    latent = [("next", "state"), ("next", "belief")]
    world_model = WorldModelWrapper(
        TensorDictSequential(
            TensorDictModule(Joined(nn.Linear(4, 2).to(F64)), [("next", "pixels")], [("next", "encoded_latents")]),
            RSSMRollout(wrap(prior, ("next", "prior_mean")), posterior),
            TensorDictModule(Joined(nn.Linear(5, 4).to(F64), (1, 2, 2)), latent, [("next", "reco_pixels")]),
        ),
        TensorDictModule(Joined(nn.Linear(5, 1).to(F64)), latent, [("next", "reward")]),
    )
    loss = DreamerModelLoss(world_model)
    torch.manual_seed(1)
    batch, steps = 3, 4
    data = TensorDict(
        state=torch.randn(batch, steps, 2, dtype=F64),
        belief=torch.randn(batch, steps, 3, dtype=F64),
        action=torch.randn(batch, steps, 1, dtype=F64),
        next=TensorDict(
            pixels=torch.randn(batch, steps, 1, 2, 2, dtype=F64),
            reward=torch.randn(batch, steps, 1, dtype=F64),
            batch_size=[batch, steps],
        ),
        batch_size=[batch, steps],
    )
    out = loss(data)[0]
    (out["loss_model_kl"] + out["loss_model_reco"] + out["loss_model_reward"]).backward()
    return {name.replace("module.module.", "module."): p.grad for name, p in loss.named_parameters()}


def test_a_prior_wrapper_without_create_graph_inside_rssm_rollout_is_refused_naming_the_loss():
    """``RSSMRollout`` (torchrl's module) calls the prior at each step. Before, no error: the prior's parameters were
    left untrained, and the encoder's and posterior's gradients were wrong, without a word."""
    with pytest.raises(RuntimeError, match=r"^LRP: called by torchrl's DreamerModelLoss as one of its networks"):
        world_model_gradients(lambda core, key: LRP(core, EpsilonPlus(), target_key=key))


def test_a_create_graph_prior_wrapper_inside_rssm_rollout_gives_the_plain_gradients():
    expected = world_model_gradients(plain)
    got = world_model_gradients(lambda core, key: LRP(core, EpsilonPlus(), target_key=key, create_graph=True))
    assert got.keys() == expected.keys() and all(g is not None for g in expected.values())
    for name, grad in got.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-10, atol=1e-12, msg=name)


# ----------------------------------------------------------------------------- collectors and replay buffers

# torchrl advises its contiguous layout over split_trajs' padded one: the padded layout is the case under test.
SPLIT_TRAJS = pytest.mark.filterwarnings("ignore:split_trajs=True:UserWarning")


def cartpole():
    """CartPole-v1 with float64 observations."""
    from torchrl.envs import DTypeCastTransform, GymEnv, TransformedEnv

    return TransformedEnv(GymEnv("CartPole-v1"), DTypeCastTransform(torch.float32, F64, in_keys=["observation"]))


def chosen_gradient_times_input(network: nn.Module, observation: torch.Tensor) -> torch.Tensor:
    """LRP-0's oracle on a ReLU Q-network: gradient × input of the chosen (largest) action value."""
    observation = observation.clone().requires_grad_()
    values = network(observation)
    (grad,) = torch.autograd.grad(values.max(-1).values.sum(), observation)
    return observation.detach() * grad


def collect(mapper: Callable, batches: int = 3, replay_buffers: dict | None = None):
    """An in-process ``Collector`` with ``split_trajs=True`` running a wrapper on a Q-network, with its context open
    across the collection; after each batch, an Adam step on a copy of the wrapper (the learner's) and
    ``update_policy_weights_`` from it. Returns each batch with a copy of the network that collected it; each batch's
    valid steps go into ``replay_buffers`` with their batch's number."""
    from torchrl.collectors import Collector

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).to(F64)
    policy = LRP(QValueActor(net, in_keys=["observation"], spec=cartpole().action_spec), mapper())
    learner = copy.deepcopy(policy)
    optimizer = torch.optim.Adam(learner.parameters(), lr=0.1)
    collector = Collector(
        cartpole, policy, frames_per_batch=40, total_frames=40 * batches, split_trajs=True,
        auto_register_policy_transforms=False,
    )  # fmt: skip
    collector.set_seed(0)
    collected = []
    try:
        with policy:
            for index, batch in enumerate(collector):
                collected.append((batch, copy.deepcopy(net)))
                valid = batch[batch["collector", "mask"]]
                valid["batch"] = torch.full(valid.shape, index)
                valid["priority"] = torch.rand(valid.shape)  # float32: the priorities' type
                for buffer in (replay_buffers or {}).values():
                    buffer.extend(valid)
                values = learner.module.module[0](valid["observation"])  # the learner's Q-network
                optimizer.zero_grad()
                (values - valid["next", "reward"]).pow(2).mean().backward()
                optimizer.step()
                collector.update_policy_weights_(TensorDict.from_module(learner))
    finally:
        collector.shutdown()
    return collected


@SPLIT_TRAJS
def test_a_split_trajs_collector_with_weight_updates_writes_the_relevance_of_the_weights_that_acted():
    """LRP-0 on the ReLU Q-network: each valid step's relevance is gradient × input of the network as it was when it
    collected that batch (updated from the learner through ``update_policy_weights_`` in an open context), the
    padding is zero, and the network of another batch gives another relevance."""
    collected = collect(lambda: BaseRuleMapper(stabilizer=0))
    for index, (batch, network) in enumerate(collected):
        mask = batch["collector", "mask"]
        relevance = batch["relevance", "observation"]
        assert relevance.dtype == F64 and not relevance.requires_grad and (relevance[~mask] == 0).all()
        expected = chosen_gradient_times_input(network, batch["observation"][mask])
        torch.testing.assert_close(relevance[mask], expected, rtol=1e-10, atol=1e-12, msg=f"batch {index}")
        chosen = network(batch["observation"][mask]).argmax(-1)
        assert torch.equal(batch["action"][mask].argmax(-1), chosen)
        if index:
            stale = chosen_gradient_times_input(collected[index - 1][1], batch["observation"][mask])
            assert not torch.allclose(relevance[mask], stale, rtol=1e-3)


@SPLIT_TRAJS
def test_a_split_trajs_collector_with_weight_updates_explains_as_a_fresh_wrapper_under_the_gamma_rule():
    """EpsilonGammaBox keeps its modified weights across calls of an open context: ``update_policy_weights_``
    writes the new weights through their storage, and each batch equals a fresh wrapper on the weights that acted."""
    collected = collect(lambda: EpsilonGammaBox(-3.0, 3.0))
    for batch, network in collected:
        mask = batch["collector", "mask"]
        fresh = LRP(network, EpsilonGammaBox(-3.0, 3.0), in_keys=["observation"], out_keys=["values"])
        expected = fresh(TensorDict(observation=batch["observation"][mask], batch_size=[int(mask.sum())]))
        relevance = batch["relevance", "observation"][mask]
        torch.testing.assert_close(relevance, expected["relevance", "observation"], rtol=1e-10, atol=1e-12)


@SPLIT_TRAJS
@pytest.mark.parametrize("storage", ["LazyTensorStorage", "LazyMemmapStorage"])
def test_replay_buffers_give_back_the_relevance_they_stored(storage: str, tmp_path):
    """Uniform, prioritized (with priorities updated) and slice sampling of the collected steps: each sampled step's
    relevance is gradient × input of the network that collected it."""
    from torchrl.data import (
        LazyMemmapStorage,
        LazyTensorStorage,
        TensorDictPrioritizedReplayBuffer,
        TensorDictReplayBuffer,
    )
    from torchrl.data.replay_buffers import SliceSampler

    def make_storage(name: str):
        if storage == "LazyMemmapStorage":
            return LazyMemmapStorage(200, scratch_dir=tmp_path / name)
        return LazyTensorStorage(200)

    buffers = {
        "uniform": TensorDictReplayBuffer(storage=make_storage("uniform"), batch_size=24),
        "prioritized": TensorDictPrioritizedReplayBuffer(
            alpha=0.7, beta=0.5, storage=make_storage("prioritized"), batch_size=24, priority_key="priority"
        ),
        "slices": TensorDictReplayBuffer(
            storage=make_storage("slices"),
            sampler=SliceSampler(slice_len=4, traj_key=("collector", "traj_ids")),
            batch_size=24,
        ),
    }
    networks = [network for _, network in collect(lambda: BaseRuleMapper(stabilizer=0), replay_buffers=buffers)]
    torch.manual_seed(3)
    for name, buffer in buffers.items():
        for draw in range(3):
            sample = buffer.sample()
            if name == "prioritized":
                buffer.update_tensordict_priority(sample.set("priority", torch.rand(sample.shape)))
            relevance = sample["relevance", "observation"]
            assert relevance.dtype == F64 and not relevance.requires_grad
            for index, network in enumerate(networks):
                rows = sample["batch"] == index
                expected = chosen_gradient_times_input(network, sample["observation"][rows])
                torch.testing.assert_close(relevance[rows], expected, rtol=1e-10, atol=1e-12, msg=f"{name} {draw}")
