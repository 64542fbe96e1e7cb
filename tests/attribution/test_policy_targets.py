"""Default targets of torchrl pipelines: masked policies explain an allowed action; actor-critic pipelines both."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import CompositeDistribution, TensorDictModule, TensorDictSequential
from torch import nn
from torch.distributions import Categorical, Normal
from torchrl.modules import (
    ActorCriticOperator,
    MaskedCategorical,
    MaskedOneHotCategorical,
    NormalParamExtractor,
    ProbabilisticActor,
    TanhNormal,
    ValueOperator,
)

from tdhook.attribution import LRP, EpsilonPlus

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


@pytest.mark.parametrize("distribution", [MaskedCategorical, MaskedOneHotCategorical], ids=lambda d: d.__name__)
def test_a_masked_policy_explains_the_action_the_tensordict_holds(distribution):
    actor = masked_actor(distribution)
    td = masked_td(actor)
    taken = torch.tensor([0, 1, 2, 2, 1, 0])
    td["action"] = nn.functional.one_hot(taken, 3).bool() if distribution is MaskedOneHotCategorical else taken
    out = LRP(actor, EpsilonPlus(), in_keys=["observation"])(td.clone())
    expected = LRP(actor, EpsilonPlus(), in_keys=["observation"], target=taken)(td.clone())
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
