"""LRP around real torchrl heads, in real gymnasium rollouts and collectors."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import NormalParamExtractor, TensorDictModule, TensorDictModuleBase, TensorDictSequential
from tensordict.utils import NestedKey
from torch import nn
from torchrl.envs import Compose, EnvBase, GymEnv, InitTracker, TransformedEnv
from torchrl.envs.utils import ExplorationType, set_exploration_type
from torchrl.modules import (
    MLP,
    ActorCriticWrapper,
    ActorValueOperator,
    ConsistentDropoutModule,
    GRUModule,
    LSTMModule,
    NoisyLinear,
    OneHotCategorical,
    ProbabilisticActor,
    QValueActor,
    QValueModule,
    TanhModule,
    TanhNormal,
    ValueOperator,
    set_recurrent_mode,
)

from tdhook.attribution import LRP, BaseRuleMapper, EpsilonRule, InputXGradient
from tdhook.attribution._keys import as_tuple
from tdhook.attribution.lrp_helpers.rules import AlphaBetaRule, EpsilonPlus, FirstLayerRule, WSquareRule
from tests.attribution._cartpole import collected, q_value_actor

F64 = torch.float64


def mlp(out_features: int, in_features: int = 4) -> nn.Module:
    return MLP(in_features=in_features, out_features=out_features, num_cells=[16, 16]).to(F64)


def observations(batch: int = 6, features: int = 4) -> TensorDict:
    return TensorDict(observation=torch.randn(batch, features, dtype=F64), batch_size=[batch])


def network_relevance(net: nn.Module, obs: torch.Tensor, target) -> torch.Tensor:
    """LRP on the bare network: the reference every head must reproduce."""
    lrp = LRP(net, EpsilonPlus(), in_keys=["observation"], out_keys=["out"], target=target)
    return lrp(TensorDict(observation=obs.clone(), batch_size=obs.shape[:1]))["relevance", "observation"]


def zero_biases(net: nn.Module) -> nn.Module:
    with torch.no_grad():
        for module in net.modules():
            if isinstance(module, nn.Linear):
                module.bias.zero_()
    return net


class TestHeads:
    def test_q_value_actor_explains_the_chosen_action_value(self):
        net = mlp(2)
        actor = QValueActor(net, in_keys=["observation"], action_space="one-hot")
        td = observations()
        out = LRP(actor, EpsilonPlus())(td.clone())
        chosen = out["action_value"].argmax(-1)
        assert torch.equal(out["action"].argmax(-1), chosen)
        expected = network_relevance(net, td["observation"], chosen)
        torch.testing.assert_close(out["relevance", "observation"], expected, rtol=1e-6, atol=1e-12)

    @pytest.mark.parametrize("distribution", ["TanhNormal", "OneHotCategorical"])
    def test_probabilistic_actor_explains_the_distribution_parameters(self, distribution: str):
        if distribution == "TanhNormal":
            net = nn.Sequential(mlp(2), NormalParamExtractor())
            keys, dist_class, key = ["loc", "scale"], TanhNormal, "loc"
        else:
            net = mlp(3)
            keys, dist_class, key = ["logits"], OneHotCategorical, "logits"
        actor = ProbabilisticActor(
            TensorDictModule(net, in_keys=["observation"], out_keys=keys),
            in_keys=keys,
            distribution_class=dist_class,
            return_log_prob=True,
        )
        td = observations()
        out = LRP(actor, EpsilonPlus())(td.clone())
        assert "action" in out.keys()
        params = net(td["observation"])
        reference = params[0] if isinstance(params, tuple) else params
        torch.testing.assert_close(out[key], reference)
        bare = LRP(TensorDictModule(net, in_keys=["observation"], out_keys=keys), EpsilonPlus(), target_key=key)(
            td.clone()
        )
        torch.testing.assert_close(out["relevance", "observation"], bare["relevance", "observation"], rtol=1e-6, atol=0)

    def test_value_operator_explains_the_state_value_and_conserves_it(self):
        net = zero_biases(mlp(1))
        critic = ValueOperator(net, in_keys=["observation"])
        td = observations()
        out = LRP(critic, EpsilonPlus(epsilon=0.0, stabilizer=1e-12))(td.clone())
        assert out["relevance", "observation"].shape == (6, 4)
        torch.testing.assert_close(out["relevance", "observation"].sum(-1), out["state_value"].squeeze(-1))

    def test_target_all_gives_every_action_value(self):
        net = mlp(2)
        actor = QValueActor(net, in_keys=["observation"], action_space="one-hot")
        td = observations()
        all_units = LRP(actor, EpsilonPlus(), target_key="action_value", target="all")(td.clone())
        stacked = torch.stack([network_relevance(net, td["observation"], k) for k in range(2)], dim=1)
        torch.testing.assert_close(all_units["relevance", "observation"], stacked, rtol=1e-6, atol=1e-12)


CONSERVING = EpsilonPlus(epsilon=0.0, stabilizer=1e-12)


def head(kind: str) -> tuple[TensorDictModuleBase, dict]:
    """A torchrl head with zero biases, and the explained output each relevance key must sum to."""
    if kind == "QValueActor":
        module = QValueActor(zero_biases(mlp(2)), in_keys=["observation"], action_space="one-hot")
        return module, {("relevance", "observation"): lambda td: td["action_value"].max(-1).values}
    if kind == "TanhNormal":
        net = nn.Sequential(zero_biases(mlp(4)), NormalParamExtractor())
        module = ProbabilisticActor(
            TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"]),
            in_keys=["loc", "scale"],
            distribution_class=TanhNormal,
        )
        return module, {("relevance", "observation"): lambda td: td["loc"].max(-1).values}
    if kind == "OneHotCategorical":
        module = zero_biases(categorical_actor("observation", 4))
        return module, {("relevance", "observation"): lambda td: td["logits"].max(-1).values}
    if kind == "ValueOperator":
        module = ValueOperator(zero_biases(mlp(1)), in_keys=["observation"])
        return module, {("relevance", "observation"): lambda td: td["state_value"].squeeze(-1)}
    common = TensorDictModule(zero_biases(mlp(8)), in_keys=["observation"], out_keys=["hidden"])
    actor = zero_biases(categorical_actor("hidden", 8))
    module = ActorValueOperator(common, actor, ValueOperator(zero_biases(mlp(1, 8)), in_keys=["hidden"]))
    return module, {
        ("relevance", "actor", "observation"): lambda td: td["logits"].max(-1).values,
        ("relevance", "critic", "observation"): lambda td: td["state_value"].squeeze(-1),
    }


@pytest.mark.parametrize("kind", ["QValueActor", "TanhNormal", "OneHotCategorical", "ValueOperator", "ActorValue"])
def test_every_head_conserves_relevance_with_zero_biases(kind: str):
    module, explained = head(kind)
    out = LRP(module, CONSERVING)(observations())
    for key, target in explained.items():
        relevance = out[key]
        assert relevance.shape == (6, 4)
        torch.testing.assert_close(relevance.sum(-1), target(out), rtol=1e-9, atol=1e-12)


def categorical_actor(in_key: str, in_features: int, actions: int = 3) -> ProbabilisticActor:
    head = TensorDictModule(mlp(actions, in_features), in_keys=[in_key], out_keys=["logits"])
    return ProbabilisticActor(head, in_keys=["logits"], distribution_class=OneHotCategorical)


class TestActorCritic:
    def actor_value_operator(self) -> ActorValueOperator:
        common = TensorDictModule(nn.Sequential(mlp(8), nn.Tanh()), in_keys=["observation"], out_keys=["hidden"])
        return ActorValueOperator(common, categorical_actor("hidden", 8), ValueOperator(mlp(1, 8), in_keys=["hidden"]))

    def test_actor_value_operator_gives_actor_and_critic_relevance_in_one_call(self):
        operator = self.actor_value_operator()
        td = observations()
        lrp = LRP(operator, EpsilonPlus())
        assert lrp.relevance_keys == [("relevance", "actor", "observation"), ("relevance", "critic", "observation")]
        out = lrp(td.clone())
        actor = LRP(operator.get_policy_operator(), EpsilonPlus())(td.clone())
        critic = LRP(operator.get_value_operator(), EpsilonPlus())(td.clone())
        torch.testing.assert_close(out["relevance", "actor", "observation"], actor["relevance", "observation"])
        torch.testing.assert_close(out["relevance", "critic", "observation"], critic["relevance", "observation"])
        assert not torch.allclose(out["relevance", "actor", "observation"], out["relevance", "critic", "observation"])

    def test_actor_critic_wrapper_with_named_targets_and_conservation(self):
        actor = categorical_actor("observation", 4)
        critic = ValueOperator(mlp(1), in_keys=["observation"])
        for module in (actor, critic):
            zero_biases(module)
        wrapper = ActorCriticWrapper(actor, critic)
        td = observations()
        out = LRP(wrapper, EpsilonPlus(epsilon=0.0, stabilizer=1e-12))(td.clone())
        logits, value = out["logits"], out["state_value"]
        torch.testing.assert_close(out["relevance", "actor", "observation"].sum(-1), logits.max(-1).values)
        torch.testing.assert_close(out["relevance", "critic", "observation"].sum(-1), value.squeeze(-1))
        named = LRP(wrapper, EpsilonPlus(), target_key={"value": "state_value"})(td.clone())
        assert list(named["relevance"].keys()) == ["value"]

    def test_a_critic_reading_another_key_than_the_actor_explains_each_head_on_its_own_keys(self):
        """An asymmetric actor-critic (the critic reads a state the actor does not see, as MAPPO's centralised
        critic does): each head's relevance is that of the head alone, and zero on the key it does not read. Every
        call was refused, the actor not depending on the critic's state, and leaving that key out of in_keys
        refused the critic in turn. An input that no head reads is refused when the wrapper is built, naming it."""

        def relu_mlp(out_features: int, in_features: int) -> nn.Module:
            return MLP(in_features=in_features, out_features=out_features, num_cells=[8], activation_class=nn.ReLU)

        head = TensorDictModule(relu_mlp(3, 4).to(F64), in_keys=["observation"], out_keys=["logits"])
        actor = ProbabilisticActor(head, in_keys=["logits"], distribution_class=OneHotCategorical)
        critic = ValueOperator(relu_mlp(1, 3).to(F64), in_keys=["state"])
        wrapper = ActorCriticWrapper(actor, critic)
        td = observations().set("state", torch.randn(6, 3, dtype=F64))
        out = LRP(wrapper, BaseRuleMapper(stabilizer=1e-12))(td.clone())
        for head, key, target_key, module in (
            ("actor", "observation", "logits", actor),
            ("critic", "state", "state_value", critic),
        ):
            expected, _ = gradient_times_input(module, td.select(key), target_key)
            torch.testing.assert_close(out["relevance", head, key], expected[key], rtol=1e-10, atol=1e-12)
        assert not out["relevance", "actor", "state"].any() and not out["relevance", "critic", "observation"].any()
        with pytest.raises(ValueError, match=r"LRP: input key 'unread' is not an input of the module"):
            LRP(wrapper, BaseRuleMapper(), in_keys=["observation", "state", "unread"])


def plain_and_explained_rollouts(
    env: EnvBase, actor: TensorDictModuleBase, steps: int
) -> tuple[TensorDict, TensorDict]:
    """Two rollouts of ``steps`` steps from seed 0, by ``actor`` and by an LRP wrapper of it; ``env`` closed after."""
    try:
        env.set_seed(0)
        plain = env.rollout(steps, actor, break_when_any_done=False)
        env.set_seed(0)
        explained = env.rollout(steps, LRP(actor, EpsilonPlus()), break_when_any_done=False)
    finally:
        env.close()
    return plain, explained


class TestRollouts:
    def test_cartpole_rollout_takes_the_same_actions_and_records_relevance(self):
        env = GymEnv("CartPole-v1")
        net = MLP(in_features=4, out_features=2, num_cells=[16])
        actor = QValueActor(net, in_keys=["observation"], spec=env.action_spec)
        plain, explained = plain_and_explained_rollouts(env, actor, 25)
        assert torch.equal(explained["action"], plain["action"])
        assert torch.equal(explained["next", "observation"], plain["next", "observation"])
        relevance = explained["relevance", "observation"]
        assert relevance.shape == plain["observation"].shape == (25, 4)
        assert torch.isfinite(relevance).all() and relevance.abs().sum() > 0

    def test_batched_env_rollout_gives_batch_by_time_relevance(self):
        from torchrl.envs import SerialEnv

        env = SerialEnv(2, lambda: GymEnv("CartPole-v1"))
        actor = q_value_actor()
        plain, explained = plain_and_explained_rollouts(env, actor, 10)
        assert torch.equal(explained["action"], plain["action"])
        relevance = explained["relevance", "observation"]
        assert relevance.shape == (2, 10, 4)
        # Each step's relevance is that of the policy on that step's observation alone.
        step = LRP(actor, EpsilonPlus())(plain[1, 3].select("observation").unsqueeze(0))
        torch.testing.assert_close(relevance[1, 3], step["relevance", "observation"][0])

    def test_parallel_env_rollout_takes_the_same_actions(self):
        from torchrl.envs import ParallelEnv

        actor = q_value_actor()
        env = ParallelEnv(2, functools.partial(GymEnv, "CartPole-v1"))
        plain, explained = plain_and_explained_rollouts(env, actor, 8)
        assert torch.equal(explained["action"], plain["action"])
        assert torch.equal(explained["next", "observation"], plain["next", "observation"])
        relevance = explained["relevance", "observation"]
        assert relevance.shape == (2, 8, 4)
        flat = LRP(actor, EpsilonPlus())(plain.select("observation").reshape(-1))
        torch.testing.assert_close(relevance, flat["relevance", "observation"].reshape(2, 8, 4))

    def test_pendulum_rollout_with_a_sampling_actor_is_unchanged(self):
        torch.manual_seed(0)
        net = nn.Sequential(MLP(in_features=3, out_features=2, num_cells=[16]), NormalParamExtractor())
        env = GymEnv("Pendulum-v1")
        actor = ProbabilisticActor(
            TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"]),
            in_keys=["loc", "scale"],
            distribution_class=TanhNormal,
            distribution_kwargs={"low": env.action_spec.space.low, "high": env.action_spec.space.high},
        )
        runs = {}
        for name, policy in (("plain", actor), ("explained", LRP(actor, EpsilonPlus()))):
            env.set_seed(0)
            torch.manual_seed(1)
            with set_exploration_type(ExplorationType.RANDOM):
                runs[name] = env.rollout(20, policy, break_when_any_done=False)
        assert torch.equal(runs["explained"]["action"], runs["plain"]["action"])
        assert runs["explained"]["relevance", "observation"].shape == (20, 3)

    def test_collector_runs_the_wrapped_policy_under_no_grad(self):
        batches = collected(LRP(q_value_actor(), EpsilonPlus()))
        assert len(batches) == 2
        for batch in batches:
            assert not batch["relevance", "observation"].requires_grad
            relevance = batch["relevance", "observation"]
            assert relevance.shape[-1] == 4 and relevance.numel() == 16 * 4
            assert torch.isfinite(relevance).all() and relevance.abs().sum() > 0

    def test_collector_with_a_sampling_policy_takes_the_same_actions(self):
        from torchrl.collectors import Collector

        actor = categorical_actor("observation", 4, actions=2).float()
        runs = {}
        for name, policy in (("plain", actor), ("explained", LRP(actor, EpsilonPlus()))):
            torch.manual_seed(3)
            collector = Collector(
                lambda: GymEnv("CartPole-v1"),
                policy,
                frames_per_batch=20,
                total_frames=40,
                auto_register_policy_transforms=False,
            )
            collector.set_seed(0)
            try:
                runs[name] = torch.cat(list(collector))
            finally:
                collector.shutdown()
        assert torch.equal(runs["explained"]["action"], runs["plain"]["action"])
        assert torch.equal(runs["explained"]["next", "observation"], runs["plain"]["next", "observation"])
        assert runs["explained"]["relevance", "observation"].shape == (40, 4)


# ----------------------------------------------------------------------------- recurrent policies


def recurrent_policy(
    kind: str, layers: int = 2, python_based: bool = False, actions: int = 3
) -> tuple[TensorDictSequential, nn.Module]:
    """A torchrl LSTMModule or GRUModule followed by a Q-value head, in float64, with its biases zeroed."""
    torch.manual_seed(0)
    cls = LSTMModule if kind == "LSTM" else GRUModule
    rnn = cls(
        input_size=4, hidden_size=6, num_layers=layers, in_key="observation", out_key="embed", python_based=python_based
    ).to(F64)
    head = TensorDictModule(mlp(actions, in_features=6), in_keys=["embed"], out_keys=["action_value"])
    with torch.no_grad():
        for name, p in rnn.named_parameters():
            if "bias" in name:
                p.zero_()
    zero_biases(head)
    return TensorDictSequential(rnn, head), rnn


def recurrent_inputs(kind: str, layers: int = 2, batch: tuple = (3, 5), states: bool = True) -> TensorDict:
    td = TensorDict(
        observation=torch.randn(*batch, 4, dtype=F64),
        is_init=torch.zeros(*batch, 1, dtype=torch.bool),
        batch_size=batch,
    )
    td["is_init"][..., 0, :] = True
    if states:
        for key in ("recurrent_state_h", "recurrent_state_c") if kind == "LSTM" else ("recurrent_state",):
            td[key] = torch.randn(*batch, layers, 6, dtype=F64)
    return td


def state_keys(kind: str) -> tuple[str, ...]:
    return ("recurrent_state_h", "recurrent_state_c") if kind == "LSTM" else ("recurrent_state",)


def chosen(td: TensorDict) -> torch.Tensor:
    return td["action_value"].max(-1).values


def total_relevance(td: TensorDict, keys: tuple) -> torch.Tensor:
    return sum(td["relevance", key].sum() for key in keys)


PRESET = functools.partial(EpsilonPlus, epsilon=1e-9, stabilizer=1e-9)


class TestRecurrentPolicies:
    @pytest.mark.parametrize("kind", ["LSTM", "GRU"])
    @pytest.mark.parametrize("python_based", [False, True])
    def test_recurrent_mode_equals_the_bare_network_and_conserves(self, kind, python_based):
        policy, rnn = recurrent_policy(kind, python_based=python_based)
        td = recurrent_inputs(kind, states=False)
        lrp = LRP(policy, PRESET())
        with set_recurrent_mode(True):
            plain = policy(td.clone())
            out = lrp(td.clone())
        assert torch.equal(out["action_value"], plain["action_value"])
        assert ("relevance", "is_init") not in out.keys(include_nested=True)
        # The default target is the action value, not the next hidden state.
        assert lrp.module is policy and set(out["relevance"].keys()) == {"observation"}
        torch.testing.assert_close(out["relevance", "observation"].sum(), chosen(out).sum(), rtol=1e-6, atol=0)

        class Bare(nn.Module):
            def __init__(self):
                super().__init__()
                self.rnn, self.head = rnn.lstm if kind == "LSTM" else rnn.gru, policy[1].module

            def forward(self, x):
                return self.head(self.rnn(x)[0])

        bare = LRP(Bare(), PRESET(), in_keys=["observation"], out_keys=["action_value"])
        expected = bare(TensorDict(observation=td["observation"], batch_size=td.batch_size))
        torch.testing.assert_close(out["relevance", "observation"], expected["relevance", "observation"])

    @pytest.mark.parametrize("kind", ["LSTM", "GRU"])
    def test_recurrent_states_get_relevance_under_their_own_keys(self, kind):
        policy, _ = recurrent_policy(kind)
        td = recurrent_inputs(kind)
        with set_recurrent_mode(True):
            out = LRP(policy, PRESET())(td.clone())
        keys = ("observation", *state_keys(kind))
        for key in state_keys(kind):
            relevance = out["relevance", key]
            assert relevance.shape == td[key].shape
            assert relevance[:, 0].abs().sum() > 0 and not relevance[:, 1:].any()  # read at the first step only
        torch.testing.assert_close(total_relevance(out, keys), chosen(out).sum(), rtol=1e-6, atol=0)

    @pytest.mark.parametrize("kind", ["LSTM", "GRU"])
    @pytest.mark.parametrize("python_based", [False, True])
    def test_trajectories_packed_in_a_row_conserve_per_trajectory(self, kind, python_based):
        policy, _ = recurrent_policy(kind, python_based=python_based)
        td = recurrent_inputs(kind, batch=(2, 6), states=False)
        td["is_init"][0, 3] = True  # a second trajectory starts at step 3 of row 0
        lrp = LRP(policy, PRESET(), target=lambda q: torch.where(q == q.max(-1, keepdim=True).values, q, 0))
        with set_recurrent_mode(True), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plain = policy(td.clone())
            out = lrp(td.clone())
        # The Python-based cells hold their state where the padded steps' mask says; the state starts as zeros (split
        # by layer, laid out anew), which hold no share of 'is_init' (it was named as an input encoded as numbers).
        assert not [str(w.message) for w in caught], [str(w.message) for w in caught]
        assert torch.equal(out["action_value"], plain["action_value"])
        assert lrp.coverage().plain_gradient == ()  # packing and unpacking the trajectories only moves values
        relevance = out["relevance", "observation"]
        torch.testing.assert_close(relevance.sum(), chosen(out).sum(), rtol=1e-6, atol=0)
        # Nothing crosses the reset: the first trajectory's steps get no relevance from the second's targets.
        split = LRP(policy, PRESET(), target=lambda q: torch.where(q == q.max(-1, keepdim=True).values, q, 0) * mask)
        mask = torch.zeros(2, 6, 1, dtype=F64)
        mask[0, 3:] = 1
        with set_recurrent_mode(True):
            later = split(td.clone())["relevance", "observation"]
        assert not later[0, :3].any()

    @pytest.mark.parametrize("kind", ["LSTM", "GRU"])
    def test_step_mode_explains_the_observation_and_the_states(self, kind):
        policy, _ = recurrent_policy(kind)
        td = recurrent_inputs(kind, batch=(4,))
        td["is_init"][:] = False
        td["is_init"][0] = True  # this sample starts a trajectory: its given states are replaced by zeros
        plain = policy(td.clone())
        out = LRP(policy, PRESET())(td.clone())
        assert torch.equal(out["action_value"], plain["action_value"])
        for key in state_keys(kind):
            assert out["relevance", key].shape == td[key].shape
            assert not out["relevance", key][0].any() and out["relevance", key][1:].abs().sum() > 0
        keys = ("observation", *state_keys(kind))
        torch.testing.assert_close(total_relevance(out, keys), chosen(out).sum(), rtol=1e-6, atol=0)

    @pytest.mark.parametrize("kind", ["LSTM", "GRU"])
    @pytest.mark.parametrize("recurrent_mode", [False, True], ids=["step", "sequence"])
    def test_outputs_under_no_grad_are_those_of_the_policy_under_no_grad(self, kind, recurrent_mode):
        """A collector runs its policy under no_grad, where torch's float32 LSTM takes another kernel than with
        gradient (the values differ in the last bits): the outputs under LRP are those of the plain call in the
        caller's grad mode, so that a rollout takes the same actions and carries the same states."""
        policy, _ = recurrent_policy(kind, python_based=False)
        policy = policy.float()
        td = recurrent_inputs(kind, batch=(3, 5) if recurrent_mode else (1,))
        td = td.apply(lambda t: t.float() if t.is_floating_point() else t)
        lrp = LRP(policy, PRESET())
        with torch.no_grad(), set_recurrent_mode(recurrent_mode):
            plain = policy(td.clone())
            out = lrp(td.clone())
        assert lrp.coverage().plain_gradient == ()
        for key in ("embed", "action_value", *[("next", k) for k in state_keys(kind)]):
            assert torch.equal(out[key], plain[key]), key
        with set_recurrent_mode(recurrent_mode):
            with_grad = LRP(policy, PRESET())(td.clone())
        torch.testing.assert_close(out["relevance", "observation"], with_grad["relevance", "observation"])

    @pytest.mark.parametrize("kind", ["LSTM", "GRU"])
    def test_a_scan_backend_in_recurrent_mode_is_refused_naming_the_module(self, kind):
        """torchrl's ``recurrent_backend="scan"`` runs the recurrence outside the module's nn.LSTM/nn.GRU (a custom
        autograd function for the GRU, a higher-order op for the LSTM): no rule sees it, so it is refused; step
        mode and the pad backend, on the same parameters, are explained."""
        policy, rnn = recurrent_policy(kind)
        rnn.recurrent_backend = "scan"
        td = recurrent_inputs(kind, states=False)
        before = td.clone()
        with set_recurrent_mode(True), pytest.raises(ValueError, match=rf"{kind}Module 'module.0'.*'scan'.*'pad'"):
            LRP(policy, PRESET())(td)
        assert (td == before).all() and set(td.keys(True, True)) == set(before.keys(True, True))
        step = recurrent_inputs(kind, batch=(4,))
        LRP(policy, PRESET())(step)  # step by step: torchrl runs the pad backend
        rnn.recurrent_backend = "pad"
        with set_recurrent_mode(True):
            out = LRP(policy, PRESET())(td.clone())
        torch.testing.assert_close(out["relevance", "observation"].sum(), chosen(out).sum(), rtol=1e-6, atol=0)

    @pytest.mark.parametrize("kind", ["LSTM", "GRU"])
    def test_dropout_between_layers_in_training_mode_is_refused_naming_the_modules_path(self, kind):
        """The error named the class alone (``LSTM``), not which of the model's recurrent layers it was."""
        policy, rnn = recurrent_policy(kind)
        getattr(rnn, kind.lower()).dropout = 0.1  # the module is in training mode
        state = {k: v.clone() for k, v in policy.state_dict().items()}
        td = recurrent_inputs(kind, states=False)
        before = td.clone()
        with set_recurrent_mode(True), pytest.raises(ValueError, match="dropout=0.1") as refusal:
            LRP(policy, PRESET())(td)
        assert f"LRP: the module is 'module.0.{kind.lower()}'" in refusal.value.__notes__
        assert (td == before).all() and set(td.keys(True, True)) == set(before.keys(True, True))
        assert all(torch.equal(policy.state_dict()[k], v) for k, v in state.items())

    def test_rollout_with_a_recurrent_policy_writes_relevance_every_step(self):
        policy, rnn = recurrent_policy("LSTM", actions=2)
        policy = policy.float()  # CartPole's observations are float32
        env = TransformedEnv(GymEnv("CartPole-v1"), Compose(InitTracker(), rnn.make_tensordict_primer()))
        lrp = LRP(policy, PRESET())
        with torch.no_grad():
            rollout = env.rollout(4, policy=TensorDictSequential(lrp, QValueModule(spec=env.action_spec)))
        assert rollout["relevance", "observation"].shape == rollout["observation"].shape
        assert ("relevance", "is_init") not in rollout.keys(include_nested=True)


def test_a_noisy_linear_is_explained_with_the_weights_its_call_used():
    """NoisyLinear computes with weight_mu + weight_sigma * weight_epsilon in training mode, weight_mu in eval."""
    torch.manual_seed(0)
    noisy = nn.Sequential(NoisyLinear(4, 8, std_init=2.0), nn.ReLU(), NoisyLinear(8, 3, std_init=2.0)).double()
    obs = observations().set("observation", observations()["observation"].double())
    obs["observation"][:, 0] = 0.0  # w² sets relevance at zero inputs too

    def same_as_linear() -> nn.Sequential:
        plain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).double()
        with torch.no_grad():
            for layer, twin in ((noisy[0], plain[0]), (noisy[2], plain[2])):
                twin.weight.copy_(layer.weight)
                twin.bias.copy_(layer.bias)
        return plain

    def relevance() -> torch.Tensor:
        return lrp(TensorDict(observation=obs["observation"], batch_size=obs.batch_size))["relevance", "observation"]

    def rules(name: str, module: nn.Module):  # rules that use the weights: w² first, then αβ
        return FirstLayerRule(WSquareRule(), AlphaBetaRule(2.0, 1.0)) if isinstance(module, nn.Linear) else None

    lrp = LRP(TensorDictModule(noisy, in_keys=["observation"], out_keys=["q"]), rules)
    with lrp:
        for step in ("deterministic", "random", "new noise", "eval", "deterministic again"):
            if step == "new noise":
                noisy.apply(lambda m: m.reset_noise() if isinstance(m, NoisyLinear) else None)
            if step == "eval":
                noisy.eval()
            # Noise is used when exploring at random (or, for layers built so, in training mode).
            kind = ExplorationType.RANDOM if step in ("random", "new noise", "eval") else ExplorationType.DETERMINISTIC
            with set_exploration_type(kind):
                actual = relevance()
                twin = same_as_linear()
            expected = LRP(TensorDictModule(twin, in_keys=["observation"], out_keys=["q"]), rules)(
                TensorDict(observation=obs["observation"], batch_size=obs.batch_size)
            )["relevance", "observation"]
            torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-12, msg=step)
        assert not torch.equal(noisy[0].weight_sigma * noisy[0].weight_epsilon, torch.zeros(8, 4, dtype=F64))


def test_q_networks_run_with_a_loss_modules_parameters_are_explained_without_a_false_alarm():
    """SACLoss keeps its Q-networks' parameters stacked; ``params[i].to_module(net)`` puts non-leaf views of them in
    the layers' parameter slots. They are parameters all the same: LRP-0 is gradient × input, and ``strict`` has no
    nonlinear call to refuse."""
    from torchrl.objectives import SACLoss

    torch.manual_seed(0)
    actor = ProbabilisticActor(
        TensorDictModule(
            nn.Sequential(mlp(4), NormalParamExtractor()), in_keys=["observation"], out_keys=["loc", "scale"]
        ),
        in_keys=["loc", "scale"],
        distribution_class=TanhNormal,
    )
    qvalue = ValueOperator(
        MLP(in_features=6, out_features=1, num_cells=[8], activation_class=nn.ReLU).to(F64),
        in_keys=["observation", "action"],
    )
    loss = SACLoss(actor, qvalue, num_qvalue_nets=2)
    td = observations().set("action", torch.randn(6, 2, dtype=F64))
    for params in loss.qvalue_network_params.unbind(0):
        with params.to_module(loss.qvalue_network):
            out = LRP(loss.qvalue_network, BaseRuleMapper(strict=True))(td.clone())
            x = td.clone()
            inputs = [x["observation"].requires_grad_(), x["action"].requires_grad_()]
            grads = torch.autograd.grad(loss.qvalue_network(x)["state_action_value"].sum(), inputs)
        for key, value, grad in zip(("observation", "action"), inputs, grads, strict=True):
            torch.testing.assert_close(out["relevance", key], value.detach() * grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("update", ["SoftUpdate", "HardUpdate"])
def test_a_target_network_updated_in_an_open_context_is_explained_with_its_new_parameters(update: str):
    """torchrl's target updates write the target parameters through ``.data`` (``lerp_``, ``copy_``), which no
    version counter sees: a target Q-network explained in an open context kept the modified weights of the first
    call (6.4 times off after a SoftUpdate, relative L2, 2.4 times after a HardUpdate, under EpsilonGammaBox)."""
    import copy

    from torchrl.objectives import DQNLoss, HardUpdate, SoftUpdate

    from tdhook.attribution import EpsilonGammaBox

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16, 3))
    loss = DQNLoss(
        QValueActor(net.to(F64), in_keys=["pixels"], action_space="one-hot"), action_space="one-hot", delay_value=True
    )
    updater = SoftUpdate(loss, eps=0.5) if update == "SoftUpdate" else HardUpdate(loss, value_network_update_interval=0)
    with torch.no_grad():
        loss.value_network_params.apply_(lambda p: p.mul_(-1.5))  # the online network moves away from the target
    td = TensorDict(pixels=torch.randn(5, 2, 6, 6, dtype=F64), batch_size=[5])
    lrp = LRP(loss.value_network, EpsilonGammaBox(-3.0, 3.0))
    with lrp:
        with loss.target_value_network_params.to_module(loss.value_network):
            before = lrp(td.clone())["relevance", "pixels"]
        updater.step()
        with loss.target_value_network_params.to_module(loss.value_network):
            after = lrp(td.clone())["relevance", "pixels"]
    target = copy.deepcopy(loss.value_network)
    loss.target_value_network_params.to_module(target)
    expected = LRP(target, EpsilonGammaBox(-3.0, 3.0))(td.clone())["relevance", "pixels"]
    assert not torch.allclose(before, expected)  # the update matters
    torch.testing.assert_close(after, expected, rtol=1e-10, atol=1e-12)


def test_a_critic_reading_uint8_pixels_is_refused_by_key():
    """A network that casts uint8 pixels itself leaves nothing that can take relevance: the error names the key."""

    class Scale(nn.Module):
        def forward(self, pixels: torch.Tensor) -> torch.Tensor:
            return pixels.to(F64) / 255

    critic = ValueOperator(
        nn.Sequential(Scale(), nn.Conv2d(3, 2, 3, dtype=F64), nn.ReLU(), nn.Flatten(), nn.LazyLinear(1, dtype=F64)),
        in_keys=["pixels"],
    )
    td = TensorDict(pixels=torch.randint(0, 256, (2, 3, 6, 6), dtype=torch.uint8), batch_size=[2])
    critic(td.clone())
    before = td.clone()
    with pytest.raises(TypeError, match=r"'pixels'.*torch.uint8.*ToTensorImage"):
        LRP(critic, EpsilonPlus())(td)
    assert set(td.keys()) == {"pixels"} and torch.equal(td["pixels"], before["pixels"])


@pytest.mark.parametrize("low, high", [(-2.0, 2.0), (-1.0, 3.0)])
def test_a_tanh_module_passes_relevance_through_its_tanh(low: float, high: float):
    """TD3's and DDPG's actors end in a TanhModule: the pass rule on its tanh, as on an nn.Tanh; the offset of
    asymmetric bounds is a bias."""
    net = zero_biases(mlp(2))
    actor = TensorDictSequential(
        TensorDictModule(net, in_keys=["observation"], out_keys=["param"]),
        TanhModule(in_keys=["param"], out_keys=["action"], low=low, high=high),
    )
    td = observations()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no module computes a function without a rule
        out = LRP(actor, CONSERVING)(td.clone())
    assert torch.equal(out["action"], actor(td.clone())["action"])
    squashed = LRP(nn.Sequential(net, nn.Tanh()), CONSERVING, in_keys=["observation"], out_keys=["action"])
    expected = squashed(td.clone())["relevance", "observation"] * (high - low) / 2
    torch.testing.assert_close(out["relevance", "observation"], expected, rtol=1e-10, atol=1e-12)
    if low == -high:  # no offset: the action's relevance is conserved
        torch.testing.assert_close(out["relevance", "observation"].sum(-1), out["action"].max(-1).values)


class TestConsistentDropout:
    """A ConsistentDropoutModule multiplies by a mask that the TensorDict carries (or that it draws when there is
    none): the mask steers the call, it is no evidence, and it is not an input to explain."""

    def policy(self) -> TensorDictSequential:
        torch.manual_seed(0)
        return TensorDictSequential(
            TensorDictModule(nn.Sequential(zero_biases(mlp(8)), nn.ReLU()), in_keys=["observation"], out_keys=["h"]),
            ConsistentDropoutModule(p=0.5, in_keys=["h", "mask"], out_keys=["h", "mask"]),
            TensorDictModule(zero_biases(nn.Linear(8, 3, dtype=F64)), in_keys=["h"], out_keys=["action_value"]),
        )

    def test_a_given_mask_is_a_constant_of_the_call(self):
        policy = self.policy().train()
        td = observations().set("mask", (torch.rand(6, 8) > 0.5).to(F64) * 2)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a given mask draws nothing: no random explanation to warn about
            out = LRP(policy, CONSERVING)(td.clone())
            InputXGradient(policy)(td.clone())
        # Without a mask the module draws one: the warning says which key would have given it.
        with pytest.warns(UserWarning, match="training mode and the TensorDict holds no mask at 'mask'"):
            LRP(policy, CONSERVING)(td.exclude("mask"))
        assert list(out["relevance"].keys()) == ["observation"]
        masked = TensorDictSequential(
            policy[0], TensorDictModule(lambda h, m: h * m, in_keys=["h", "mask"], out_keys=["h"]), policy[2]
        )
        expected = LRP(masked, CONSERVING, in_keys=["observation"])(td.clone())
        torch.testing.assert_close(out["relevance", "observation"], expected["relevance", "observation"])
        torch.testing.assert_close(out["relevance", "observation"].sum(-1), out["action_value"].max(-1).values)

    def test_without_a_mask_the_module_runs_as_it_does_alone(self):
        policy = self.policy().eval()
        out = LRP(policy, CONSERVING)(observations())
        assert list(out["relevance"].keys()) == ["observation"]
        torch.testing.assert_close(out["relevance", "observation"].sum(-1), out["action_value"].max(-1).values)


# ----------------------------------------------------------------------------- torchrl's network builders


def _agents(shape: tuple[int, ...], key: str = "observation") -> TensorDict:
    return TensorDict(
        {"agents": TensorDict({key: torch.randn(3, 3, *shape, dtype=F64)}, batch_size=[3, 3])}, batch_size=[3]
    )


def _pixels(channels: int = 2, size: int = 8) -> TensorDict:
    return TensorDict(observation=torch.randn(3, channels, size, size, dtype=F64), batch_size=[3])


def _with_action(td: TensorDict) -> TensorDict:
    return td.set("action", torch.randn(*td.batch_size, 2, dtype=F64))


class _Impala(nn.Module):
    """torchrl's IMPALA network (residual blocks that open with an in-place ReLU), its logits as output."""

    def __init__(self) -> None:
        super().__init__()
        from torchrl.modules.models.recipes.impala import ImpalaNet

        self.net = ImpalaNet(num_actions=3, channels=(4, 4), out_features=8)

    def forward(self, pixels: torch.Tensor, reward: torch.Tensor) -> torch.Tensor:
        return self.net(pixels, reward, torch.zeros_like(reward, dtype=torch.bool))[0][1]


def network(kind: str) -> tuple[TensorDictModuleBase, TensorDict, NestedKey]:
    """A network as torchrl's builders make it, with ReLU activations (piecewise linear); its inputs; the key its
    relevance explains by default."""
    from torchrl.modules import (
        Conv3dNet,
        ConvNet,
        DdpgCnnQNet,
        DdpgMlpQNet,
        DuelingCnnDQNet,
        MultiAgentConvNet,
        SafeModule,
        SafeSequential,
        VDNMixer,
    )
    from torchrl.modules.models.models import DuelingMlpDQNet

    relu = {"activation_class": nn.ReLU}
    if kind == "ConvNet":
        net = ConvNet(num_cells=[4, 4], kernel_sizes=3, **relu)
        return TensorDictModule(net, ["observation"], ["out"]), _pixels(), "out"
    if kind == "Conv3dNet":
        td = TensorDict(observation=torch.randn(2, 1, 5, 5, 5, dtype=F64), batch_size=[2])
        return (
            TensorDictModule(Conv3dNet(num_cells=[3, 3], kernel_sizes=3, **relu), ["observation"], ["out"]),
            td,
            "out",
        )
    if kind == "DuelingMlpDQNet":
        net = DuelingMlpDQNet(3, 1, {"num_cells": [8], **relu}, {"num_cells": [8], **relu})
        return QValueActor(net, in_keys=["observation"], action_space="one-hot"), observations(), "chosen_action_value"
    if kind == "DuelingCnnDQNet":
        cnn = {"num_cells": [4], "kernel_sizes": 3, "strides": 1, **relu}
        net = DuelingCnnDQNet(3, 1, cnn_kwargs=cnn, mlp_kwargs={"num_cells": [8], **relu})
        return QValueActor(net, in_keys=["observation"], action_space="one-hot"), _pixels(), "chosen_action_value"
    if kind == "DdpgMlpQNet":
        layer = {"num_cells": [8], "depth": 1, **relu}
        net = DdpgMlpQNet(mlp_net_kwargs_net1={**layer, "activate_last_layer": True}, mlp_net_kwargs_net2=layer)
        return ValueOperator(net, ["observation", "action"]), _with_action(observations()), "state_action_value"
    if kind == "DdpgCnnQNet":
        cnn = {"num_cells": [4], "depth": 1, "kernel_sizes": 3, "strides": 2, "paddings": 0, **relu}
        net = DdpgCnnQNet(conv_net_kwargs=cnn, mlp_net_kwargs={"num_cells": [8], "depth": 1, **relu})
        return ValueOperator(net, ["observation", "action"]), _with_action(_pixels()), "state_action_value"
    if kind == "centralised MultiAgentConvNet":
        net = MultiAgentConvNet(n_agents=3, centralized=True, share_params=True, num_cells=[4], kernel_sizes=3, **relu)
        value = ("agents", "state_value")
        return TensorDictModule(net, [("agents", "observation")], [value]), _agents((2, 6, 6)), value
    if kind == "CrossGroupCritic":
        return cross_group_critic(), teams(), ("red", "state_value")
    if kind == "VDNMixer":
        mixer = TensorDictModule(VDNMixer(n_agents=3, device="cpu"), [("agents", "q")], ["q_total"])
        return mixer, _agents((1,), "q"), "q_total"
    if kind == "SafeSequential":
        head = SafeModule(MLP(in_features=4, out_features=8, num_cells=[8], **relu), ["observation"], ["hidden"])
        return SafeSequential(head, SafeModule(nn.Linear(8, 2), ["hidden"], ["out"])), observations(), "out"
    td = TensorDict(pixels=torch.randn(2, 3, 3, 12, 12, dtype=F64), reward=torch.rand(2, 3, dtype=F64) - 0.5)
    return TensorDictModule(_Impala(), ["pixels", "reward"], ["logits"]), td.auto_batch_size_(2), "logits"


def cross_group_critic(detach_groups: list[str] | None = None) -> TensorDictModuleBase:
    """torchrl's critic over two teams of agents with observations of different sizes."""
    from torchrl.modules import CrossCriticGroupSpec, CrossGroupCritic

    groups = {
        team: CrossCriticGroupSpec(size, agents, (team, "observation"), (team, "state_value"))
        for team, size, agents in (("red", 3, 2), ("blue", 4, 3))
    }
    critic = CrossGroupCritic(
        groups, d_model=8, trunk_depth=1, trunk_cells=8, activation_class=nn.ReLU, detach_groups=detach_groups
    )
    return critic.to(F64)


def teams() -> TensorDict:
    red = TensorDict(observation=torch.randn(4, 2, 3, dtype=F64), batch_size=[4, 2])
    return TensorDict(
        red=red, blue=TensorDict(observation=torch.randn(4, 3, 4, dtype=F64), batch_size=[4, 3]), batch_size=[4]
    )


def test_a_cross_group_critic_that_detaches_a_group_is_refused_naming_it():
    """The critic reads the detached team's observations, but no gradient reaches them: LRP says so by key, and
    explains the other team alone when asked to."""
    critic, td = cross_group_critic(detach_groups=["blue"]), teams()
    with pytest.raises(ValueError, match=r"\('blue', 'observation'\) through its gradient.*detach_groups"):
        LRP(critic, BaseRuleMapper(stabilizer=1e-12))(td.clone())
    out = LRP(critic, BaseRuleMapper(stabilizer=1e-12), in_keys=[("red", "observation")])(td.clone())
    x = td.clone()
    red = x["red", "observation"].requires_grad_()
    value = critic(x)["red", "state_value"]
    torch.testing.assert_close(
        out["relevance", "red", "observation"], red.detach() * torch.autograd.grad(value.sum(), red)[0]
    )


def zero_every_bias(module: nn.Module) -> nn.Module:
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if name.rsplit(".", 1)[-1] == "bias":
                parameter.zero_()
    return module


def gradient_times_input(module: TensorDictModuleBase, td: TensorDict, target_key: NestedKey) -> tuple[dict, float]:
    """The oracle: each input times the gradient of the chosen output unit (the output itself for one unit); and
    the total value of the chosen units."""
    x = td.clone()
    leaves = {key: x.get(key).requires_grad_() for key in td.keys(include_nested=True, leaves_only=True)}
    output = module(x).get(target_key)
    seed = (output.detach() == output.detach().max(-1, keepdim=True).values).to(F64)
    grads = torch.autograd.grad(output, list(leaves.values()), seed)
    relevance = {key: leaf.detach() * grad for (key, leaf), grad in zip(leaves.items(), grads, strict=True)}
    return relevance, (output * seed).sum().item()


LINEAR_EPSILON_ZERO = {(nn.Linear, nn.Conv2d, nn.Conv3d): EpsilonRule(0.0)}
NETWORKS = [
    "ConvNet",
    "Conv3dNet",
    "DuelingMlpDQNet",
    "DuelingCnnDQNet",
    "DdpgMlpQNet",
    "DdpgCnnQNet",
    "centralised MultiAgentConvNet",
    "CrossGroupCritic",
    "VDNMixer",
    "SafeSequential",
    "ImpalaNet",
]


@pytest.mark.parametrize("kind", NETWORKS)
def test_torchrl_networks_give_gradient_times_input_under_lrp0_and_conserve_relevance(kind: str):
    """LRP-0 is gradient × input on every input key; with every bias zeroed the ε-rule with ε = 0 on every layer
    conserves the explained value; the outputs are the module's, and nothing is warned about."""
    torch.manual_seed(0)
    module, td, target_key = network(kind)
    module = module.to(F64)
    plain = module(td.clone())  # lazy layers take their shapes
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = LRP(module, BaseRuleMapper(stabilizer=1e-12))(td.clone())
    assert torch.equal(out[target_key], plain[target_key])
    expected, _ = gradient_times_input(module, td, target_key)
    assert set(out["relevance"].keys(include_nested=True, leaves_only=True)) == set(expected)
    for key, relevance in expected.items():
        torch.testing.assert_close(out["relevance", *as_tuple(key)], relevance, rtol=1e-10, atol=1e-12)
    zero_every_bias(module)
    out = LRP(module, BaseRuleMapper(stabilizer=1e-12, rule_mapper=LINEAR_EPSILON_ZERO))(td.clone())
    total = sum(r.sum() for r in out["relevance"].values(include_nested=True, leaves_only=True))
    torch.testing.assert_close(total.item(), gradient_times_input(module, td, target_key)[1], rtol=1e-9, atol=1e-12)
