"""The action a sampling policy takes is explained however its keys are spelled, refused where it is no action of
the logits, and scored by the metrics as explained."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torch.distributions import Categorical
from torchrl.envs.utils import ExplorationType, set_exploration_type
from torchrl.modules import MaskedCategorical, ProbabilisticActor

from tdhook.attribution import LRP, BaseRuleMapper
from tdhook.metrics import pixel_flipping

F64 = torch.float64
B, AGENTS = 32, 2


def agents_batch(**entries: torch.Tensor) -> TensorDict:
    torch.manual_seed(1)
    obs = torch.randn(B, AGENTS, 4, dtype=F64)
    return TensorDict({"agents": TensorDict(observation=obs, **entries, batch_size=[B, AGENTS])}, batch_size=[B])


def by_hand(layer: nn.Linear, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    """LRP-0 of a linear layer without bias at unit ``action``: its weight row times the input."""
    return layer.weight[action].detach() * obs


@pytest.mark.parametrize("spelling", ["list", "dict"])
def test_a_policy_whose_keys_are_nested_and_listed_explains_the_action_it_takes(spelling):
    """torchrl's multi-agent examples list the nested key (``in_keys=[("agents", "logits")]``); the distribution's
    argument was then not recognised, and the argmax explained: under random exploration beside another action
    drawn (and over a stored transition's action), for a masked policy an action the mask forbids, in every row."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 3, bias=False).double()
    net = TensorDictModule(layer, [("agents", "observation")], [("agents", "logits")])
    logits = ("agents", "logits")
    keys = [logits] if spelling == "list" else {"logits": logits}
    actor = ProbabilisticActor(net, in_keys=keys, out_keys=[("agents", "action")], distribution_class=Categorical)
    with set_exploration_type(ExplorationType.RANDOM):
        out = LRP(actor, BaseRuleMapper())(agents_batch())
    drawn = out["agents", "action"]
    assert (drawn != out["agents", "logits"].argmax(-1)).sum() > 10
    torch.testing.assert_close(
        out["relevance", "agents", "observation"], by_hand(layer, out["agents", "observation"], drawn)
    )
    held = torch.randint(0, 3, (B, AGENTS))
    stored = agents_batch(action=held)
    stored["next"] = agents_batch()
    out = LRP(actor, BaseRuleMapper())(stored)
    assert torch.equal(out["agents", "action"], held)
    torch.testing.assert_close(
        out["relevance", "agents", "observation"], by_hand(layer, out["agents", "observation"], held)
    )
    mask_keys = [logits, ("agents", "mask")] if spelling == "list" else {"logits": logits, "mask": ("agents", "mask")}
    masked = ProbabilisticActor(
        net, in_keys=mask_keys, out_keys=[("agents", "action")], distribution_class=MaskedCategorical
    )
    plain = net(agents_batch())["agents", "logits"].argmax(-1, keepdim=True)
    mask = torch.ones(B, AGENTS, 3, dtype=torch.bool).scatter(-1, plain, False)  # the plain argmax forbidden
    out = LRP(masked, BaseRuleMapper())(agents_batch(mask=mask))
    taken = out["agents", "action"]
    assert mask.gather(-1, taken[..., None]).all()
    torch.testing.assert_close(
        out["relevance", "agents", "observation"], by_hand(layer, out["agents", "observation"], taken)
    )


@pytest.mark.parametrize("held", [-1, 3])
def test_a_stored_action_outside_the_logits_is_refused_naming_the_keys(held):
    """A padding value (-1) was explained as the last unit, silently; an action past the last unit raised an error
    about target indices though no target was given (a masked policy: an index error naming no key)."""
    torch.manual_seed(0)
    net = TensorDictModule(nn.Linear(4, 3).double(), ["observation"], ["logits"])
    for actor in [
        ProbabilisticActor(net, in_keys=["logits"], distribution_class=Categorical),
        ProbabilisticActor(net, in_keys={"logits": "logits", "mask": "mask"}, distribution_class=MaskedCategorical),
    ]:
        action = torch.zeros(6, dtype=torch.long)
        action[2] = held
        td = TensorDict(
            observation=torch.randn(6, 4, dtype=F64), action=action, mask=torch.ones(6, 3, dtype=torch.bool)
        )
        td["next"] = td.select("observation")
        before = td.clone()
        with pytest.raises(ValueError, match=rf"the action at 'action'.* holds \[{held}\] in rows \[\[2\]\].*'logits'"):
            LRP(actor, BaseRuleMapper())(td)
        assert (td == before).all()


def test_a_metric_scores_the_action_a_live_step_was_explained_for():
    """The metric ran the policy again and scored its new draw, another action than the one explained beside the
    relevance in 29 of 64 rows (a live step, under random exploration)."""
    torch.manual_seed(0)
    net = TensorDictModule(nn.Linear(4, 2).double(), ["observation"], ["logits"])
    with torch.no_grad():
        net.module.weight.mul_(0.01)  # a nearly uniform policy: its draws are often not the argmax
    actor = ProbabilisticActor(net, in_keys=["logits"], distribution_class=Categorical, return_log_prob=True)
    live = TensorDict(observation=torch.randn(64, 4, dtype=F64), batch_size=[64])
    with set_exploration_type(ExplorationType.RANDOM):
        out = LRP(actor, BaseRuleMapper())(live)
        curve = pixel_flipping(actor, out, relevance_key="relevance")
        expected = pixel_flipping(actor, out, relevance_key="relevance", target=out["action"])
    torch.testing.assert_close(curve, expected)
    torch.testing.assert_close(curve[:, 0], out["logits"].gather(-1, out["action"][:, None]).squeeze(-1))
