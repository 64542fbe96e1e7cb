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
