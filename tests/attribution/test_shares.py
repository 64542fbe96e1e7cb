"""Multi-key observations: relevance per key and per-key shares."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule, TensorDictSequential
from torchrl.modules import MLP, ConvNet

from tdhook.attribution import LRP, relevance_shares
from tdhook.attribution.lrp_helpers.rules import EpsilonPlus


def two_encoder_policy() -> TensorDictSequential:
    """Pixels and a state vector, each with its own encoder, concatenated into a Q-value head."""
    pixels = TensorDictModule(ConvNet(num_cells=[4], kernel_sizes=3, strides=2), ["pixels"], ["pixel_features"])
    state = TensorDictModule(MLP(in_features=3, out_features=8, num_cells=[8]), ["state"], ["state_features"])
    join = TensorDictModule(lambda a, b: torch.cat([a, b], -1), ["pixel_features", "state_features"], ["features"])
    head = TensorDictModule(MLP(out_features=2, num_cells=[16]), ["features"], ["action_value"])
    return TensorDictSequential(pixels, state, join, head)


def batch(steps: int = 5) -> TensorDict:
    return TensorDict(pixels=torch.randn(steps, 3, 9, 9), state=torch.randn(steps, 3), batch_size=[steps])


def test_each_key_gets_its_relevance_and_the_shares_split_the_total():
    policy = two_encoder_policy()
    policy(batch())  # initialise the lazy layers
    td = LRP(policy, EpsilonPlus(epsilon=0.0))(batch())
    assert td["relevance", "pixels"].shape == (5, 3, 9, 9)
    assert td["relevance", "state"].shape == (5, 3)
    shares = relevance_shares(td)
    torch.testing.assert_close(shares["pixels"] + shares["state"], torch.ones(5))
    pixel_total = td["relevance", "pixels"].abs().flatten(1).sum(1)
    state_total = td["relevance", "state"].abs().sum(1)
    torch.testing.assert_close(shares["state"], state_total / (pixel_total + state_total))
    signed = relevance_shares(td, signed=True)
    signed_state = td["relevance", "state"].sum(1)
    torch.testing.assert_close(
        signed["state"], signed_state / (signed_state + td["relevance", "pixels"].flatten(1).sum(1))
    )


def test_shares_of_a_rollout_keep_batch_and_time():
    td = TensorDict(relevance=TensorDict(a=torch.randn(2, 4, 3), batch_size=[2, 4]), batch_size=[2, 4])
    td["relevance", "b"] = torch.zeros(2, 4)
    shares = relevance_shares(td)
    assert shares.batch_size == (2, 4)
    torch.testing.assert_close(shares["a"], torch.ones(2, 4))
    torch.testing.assert_close(shares["b"], torch.zeros(2, 4))


def test_missing_relevance_is_named():
    with pytest.raises(KeyError, match="no 'relevance' entry; run it through LRP first"):
        relevance_shares(TensorDict(x=torch.ones(2), batch_size=[2]))


def test_a_method_s_output_is_named_with_the_key_it_writes():
    """A gradient or perturbation method writes under "attribution": "run it through LRP first" was all it said."""
    from tdhook.attribution import IntegratedGradients

    policy = TensorDictModule(torch.nn.Linear(3, 2), ["x"], ["y"])
    explained = IntegratedGradients(policy, n_steps=2)(TensorDict(x=torch.randn(4, 3), batch_size=[4]))
    with pytest.raises(KeyError, match="no 'relevance' entry; it holds 'attribution', .*relevance_key='attribution'"):
        relevance_shares(explained)
    torch.testing.assert_close(relevance_shares(explained, relevance_key="attribution")["x"], torch.ones(4))


def test_an_actor_critic_pipeline_gets_the_shares_of_each_target_within_that_target():
    """Relevance of two targets (an actor's logits and a critic's value) does not add up: each target's shares
    are taken from its own relevance, named by its nested relevance key."""
    from torchrl.modules import ActorValueOperator, OneHotCategorical, ProbabilisticActor, ValueOperator

    torch.manual_seed(0)
    common = TensorDictModule(lambda a, b: torch.cat([a, b], -1), ["a", "b"], ["hidden"])
    actor_net = MLP(in_features=6, out_features=2, num_cells=[8], activation_class=torch.nn.ReLU)
    actor = ProbabilisticActor(
        TensorDictModule(actor_net, ["hidden"], ["logits"]), in_keys=["logits"], distribution_class=OneHotCategorical
    )
    critic = ValueOperator(
        MLP(in_features=6, out_features=1, num_cells=[8], activation_class=torch.nn.ReLU), ["hidden"]
    )
    td = LRP(ActorValueOperator(common, actor, critic))(
        TensorDict(a=torch.randn(5, 2), b=torch.randn(5, 4), batch_size=[5])
    )
    for target in ("actor", "critic"):
        shares = relevance_shares(td, relevance_key=("relevance", target))
        assert set(shares.keys()) == {"a", "b"}
        a_total, b_total = (td["relevance", target, key].abs().sum(-1) for key in ("a", "b"))
        torch.testing.assert_close(shares["a"], a_total / (a_total + b_total))
        torch.testing.assert_close(shares["a"] + shares["b"], torch.ones(5))
    # Taken under the common prefix, the shares split the sum of the two totals (the actor's a-share was 0.44
    # to 0.58 where its own was another), with no word; and under target="all" they summed every unit.
    with pytest.raises(
        ValueError, match=r"several targets \('actor', 'critic'\).*relevance_key=\('relevance', 'actor'\)"
    ):
        relevance_shares(td)


def test_a_relevance_entry_without_keys_is_named():
    td = TensorDict(x=torch.ones(2), relevance=TensorDict(batch_size=[2]), batch_size=[2])
    with pytest.raises(KeyError, match="relevance_shares: 'relevance' holds no relevance keys"):
        relevance_shares(td)
    assert list(td.keys(True, True)) == ["x"]


def test_the_relevance_of_inner_layers_is_no_share():
    """``layers=`` writes an inner layer's relevance beside the inputs': another split of the same total. It was
    counted as a key of its own (the inputs' shares fell from 0.72 / 0.28 to 0.44 / 0.17 in a two-key net)."""
    policy = two_encoder_policy()
    policy(batch())
    steps = batch()
    plain = relevance_shares(LRP(policy, EpsilonPlus(epsilon=0.0))(steps.clone()))
    td = LRP(policy, EpsilonPlus(epsilon=0.0), layers={"module.0.module": "pixel_encoder"})(steps.clone())
    assert ("relevance", "pixel_encoder") in td.keys(True)
    shares = relevance_shares(td)
    assert set(shares.keys()) == {"pixels", "state"}
    torch.testing.assert_close(shares, plain)
    chosen = relevance_shares(td, keys=["pixel_encoder", "state"])
    assert set(chosen.keys()) == {"pixel_encoder", "state"}
    with pytest.raises(KeyError, match=r"holds no relevance at \['layer'\]"):
        relevance_shares(td, keys=["layer"])


def two_key_policy() -> TensorDictModule:
    class Two(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.obs, self.goal = torch.nn.Linear(4, 8), torch.nn.Linear(2, 8)
            self.head = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(8, 3))

        def forward(self, obs: torch.Tensor, goal: torch.Tensor) -> torch.Tensor:
            return self.head(self.obs(obs) + self.goal(goal))

    return TensorDictModule(Two().double(), ["obs", "goal"], ["q"])


def test_every_units_shares_under_target_all_are_that_units_own():
    """``target="all"`` writes ``[B, units, F]``; the shares summed over every dimension after the batch's, and so
    added the units' relevance into one share of no unit (0.49 for the obs of a sample whose units' own shares were
    0.73, 0.39 and 0.18), with no word."""
    torch.manual_seed(0)
    policy = two_key_policy()
    td = TensorDict(
        obs=torch.randn(5, 4, dtype=torch.float64), goal=torch.randn(5, 2, dtype=torch.float64), batch_size=[5]
    )
    every = LRP(policy, EpsilonPlus(), target="all")(td.clone())
    with pytest.raises(ValueError, match=r"relevance at 'obs' has shape \[5, 3, 4\] for an input of shape \[5, 4\]"):
        relevance_shares(every)
    shares = relevance_shares(every, units=1)
    assert shares.batch_size == (5,) and shares["obs"].shape == (5, 3)
    for unit in range(3):
        alone = relevance_shares(LRP(policy, EpsilonPlus(), target=unit)(td.clone()))
        for key in ("obs", "goal"):
            torch.testing.assert_close(shares[key][:, unit], alone[key], rtol=1e-10, atol=1e-12)
    assert (shares["obs"].amax(-1) - shares["obs"].amin(-1)).max() > 0.05  # the units' shares differ


def test_each_explained_positions_shares_under_split_dim_cover_every_input_step():
    """``split_dim`` writes ``[B, T, T, F]`` (the target's step, then the input's): with ``units=0`` each explained
    step's shares are taken over every input step, and under ``target="all"`` as well ``units=1`` gives each unit
    of each step its own."""
    torch.manual_seed(1)
    policy = two_key_policy()
    td = TensorDict(
        obs=torch.randn(2, 6, 4, dtype=torch.float64), goal=torch.randn(2, 6, 2, dtype=torch.float64), batch_size=[2, 6]
    )
    split = LRP(policy, EpsilonPlus(), split_dim=1)(td.clone())
    with pytest.raises(ValueError, match="units=0 for LRP"):
        relevance_shares(split)
    shares = relevance_shares(split, units=0)
    obs, goal = (split["relevance", key].abs().flatten(2).sum(-1) for key in ("obs", "goal"))
    torch.testing.assert_close(shares["obs"], obs / (obs + goal))
    both = LRP(policy, EpsilonPlus(), split_dim=1, target="all")(td.clone())
    per_unit = relevance_shares(both, units=1)
    assert per_unit["obs"].shape == (2, 6, 3)
    for unit in range(3):
        alone = relevance_shares(LRP(policy, EpsilonPlus(), split_dim=1, target=unit)(td.clone()), units=0)
        torch.testing.assert_close(per_unit["obs"][..., unit], alone["obs"], rtol=1e-10, atol=1e-12)
