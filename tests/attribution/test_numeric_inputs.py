"""Integer or boolean inputs the model computes with as numbers: a torchrl critic's one-hot action, on a rollout."""

import warnings

import pytest
import torch
from tensordict import TensorDict
from torch import nn
from torchrl.envs import GymEnv
from torchrl.modules import MLP, MaskedCategorical, ProbabilisticActor, ValueOperator

from tdhook.attribution import LRP, BaseRuleMapper, EpsilonPlus

F64 = torch.float64


@pytest.fixture(scope="module")
def rollout() -> TensorDict:
    env = GymEnv("CartPole-v1")
    env.set_seed(0)
    torch.manual_seed(0)
    td = env.rollout(6).select("observation", "action")
    assert td["action"].dtype == torch.int64  # torchrl's one-hot action
    return td.set("observation", td["observation"].to(F64))


class Critic(nn.Module):
    """Q(s, a) of a one-hot action, given to its layers as numbers."""

    def __init__(self, as_bool: bool = False) -> None:
        super().__init__()
        self.as_bool = as_bool
        self.net = MLP(in_features=6, out_features=1, num_cells=[8], activation_class=nn.ReLU).to(F64)
        with torch.no_grad():
            for name, parameter in self.net.named_parameters():
                if name.endswith("bias"):
                    parameter.zero_()

    def forward(self, observation: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        action = action.bool() if self.as_bool else action
        return self.net(torch.cat([observation, action.to(observation.dtype)], -1))


def critic(as_bool: bool = False) -> ValueOperator:
    torch.manual_seed(1)
    return ValueOperator(Critic(as_bool), in_keys=["observation", "action"])


def caught(call) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as found:
        warnings.simplefilter("always")
        result = call()
    return result, [str(w.message) for w in found]


def test_an_integer_action_computed_with_as_numbers_is_named_and_explained_once_stored_as_floats(rollout):
    lrp = LRP(critic(), BaseRuleMapper(stabilizer=0))
    out, messages = caught(lambda: lrp(rollout.clone()))
    numeric = [m for m in messages if "enters the model as numbers" in m]
    assert len(numeric) == 1, messages
    assert "'action' (torch.int64)" in numeric[0] and "'module.net.0' (Linear)" in numeric[0]
    assert ("relevance", "action") not in out.keys(True)
    value = out["state_action_value"][:, 0]
    missing = value - out["relevance", "observation"].sum(-1)
    assert missing.abs().max() > 1e-3  # the action's share, which the warning is about
    _, later = caught(lambda: lrp(rollout.clone()))  # the first call's watch only
    assert not [m for m in later if "enters the model as numbers" in m]
    # What the warning advises: stored as floats, the action is explained, and LRP-0 without biases conserves.
    floats = rollout.clone().set("action", rollout["action"].to(F64))
    out, messages = caught(lambda: LRP(critic(), BaseRuleMapper(stabilizer=0))(floats))
    assert not [m for m in messages if "enters the model as numbers" in m]
    total = out["relevance", "observation"].sum(-1) + out["relevance", "action"].sum(-1)
    torch.testing.assert_close(total, out["state_action_value"][:, 0], rtol=1e-10, atol=1e-12)


def test_a_boolean_action_computed_with_as_numbers_is_named(rollout):
    td = rollout.clone().set("action", rollout["action"].bool())
    _, messages = caught(lambda: LRP(critic(as_bool=True), BaseRuleMapper(stabilizer=0))(td))
    assert [m for m in messages if "'action' (torch.bool) enters the model as numbers" in m], messages


def test_an_integer_action_named_in_in_keys_is_refused_saying_how_to_explain_it(rollout):
    lrp = LRP(critic(), BaseRuleMapper(stabilizer=0), in_keys=["observation", "action"])
    with pytest.raises(TypeError, match=r"'action' \(torch.int64\) enters the model as numbers.*\.float\(\)"):
        lrp(rollout.clone())


def test_a_strict_mapper_refuses_an_integer_action_left_out(rollout):
    with pytest.raises(ValueError, match=r"'action' \(torch.int64\) enters the model as numbers"):
        LRP(critic(), BaseRuleMapper(stabilizer=0, strict=True))(rollout.clone())


class IndexedCritic(nn.Module):
    """Q(s, a) picked by the action's index, and zeroed where the episode is done: indices and masks, no numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP(in_features=4, out_features=2, num_cells=[8], activation_class=nn.ReLU).to(F64)

    def forward(self, observation: torch.Tensor, action: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        values = self.net(observation).gather(-1, action.argmax(-1, keepdim=True))
        return values * (1 - done.to(values.dtype))


def test_indices_and_masks_are_not_numbers(rollout):
    td = rollout.clone().set("done", torch.zeros(6, 1, dtype=torch.bool))
    module = ValueOperator(IndexedCritic(), in_keys=["observation", "action", "done"])
    _, messages = caught(lambda: LRP(module, EpsilonPlus())(td))
    assert not [m for m in messages if "enters the model as numbers" in m]
    torch.manual_seed(0)
    net = ValueOperator(MLP(in_features=4, out_features=2, num_cells=[8]).to(F64), out_keys=["logits"])
    actor = ProbabilisticActor(
        net, in_keys={"logits": "logits", "mask": "action_mask"}, distribution_class=MaskedCategorical
    )
    td = rollout.clone().set("action_mask", torch.tensor([[True, False]]).expand(6, 2).clone())
    _, messages = caught(lambda: LRP(actor, EpsilonPlus())(td))
    assert not [m for m in messages if "enters the model as numbers" in m]
