"""action_fidelity against its definition, state by state."""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.envs.utils import ExplorationType, set_exploration_type
from torchrl.modules import DistributionalQValueActor, OneHotOrdinal, Ordinal, ProbabilisticActor, QValueActor

from tdhook.attribution import LRP
from tdhook.metrics import action_fidelity
from tests.metrics._models import TwoKeys


def changed_share(net, u, v, masks, baseline=0.0):
    """Share of states whose argmax changes when the masked features (over u and v together) go to the baseline."""
    w = torch.cat([u, v], -1)
    perturbed = torch.where(masks, torch.as_tensor(baseline, dtype=w.dtype), w)
    before = net(u, v).argmax(-1)
    after = net(perturbed[..., :5], perturbed[..., 5:]).argmax(-1)
    return (before != after).double().mean()


@pytest.mark.parametrize("k", [1, 3, 8])
def test_equals_the_definition_with_features_ranked_across_keys(k):
    net = TwoKeys().double()
    policy = TensorDictModule(net, in_keys=["u", "v"], out_keys=["q"])
    u, v = torch.randn(4, 6, 5, dtype=torch.float64), torch.randn(4, 6, 3, dtype=torch.float64)
    au, av = torch.randn(4, 6, 5, dtype=torch.float64), torch.randn(4, 6, 3, dtype=torch.float64)
    td = TensorDict(u=u, v=v, attribution=TensorDict(u=au, v=av), batch_size=[4, 6])
    result = action_fidelity(policy, td, k=k, n_random=5, seed=1, baseline=0.5)
    assert result.batch_size == torch.Size([])
    attribution = torch.cat([au, av], -1)
    top = attribution.argsort(dim=-1, descending=True, stable=True)[..., :k]
    relevant = torch.zeros(4, 6, 8, dtype=torch.bool).scatter_(-1, top, True)
    torch.testing.assert_close(result["relevant"], changed_share(net, u, v, relevant, 0.5), rtol=0, atol=1e-12)
    assert 0.0 <= result["random"].item() <= 1.0
    again = action_fidelity(policy, td, k=k, n_random=5, seed=1, baseline=0.5, steps_per_forward=2)
    torch.testing.assert_close(again["random"], result["random"], rtol=0, atol=1e-12)


def test_random_draws_remove_k_distinct_features_per_state():
    # A model whose action flips exactly when feature 0 is removed: the random share is the draws' rate of picking it.
    net = torch.nn.Linear(4, 2, bias=False).double()
    with torch.no_grad():
        net.weight.copy_(torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.1, 0.1, 0.1]]))
    x = torch.ones(2000, 4, dtype=torch.float64)
    td = TensorDict(x=x, attribution=TensorDict(x=torch.rand(2000, 4, dtype=torch.float64)), batch_size=[2000])
    result = action_fidelity(net, td, k=2, n_random=3, seed=0, in_keys=["x"], out_keys=["q"])
    assert abs(result["random"].item() - 0.5) < 0.03  # two of four features: feature 0 is among them half the time


def test_works_on_a_torchrl_q_value_actor_with_lrp_relevance():
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).double()
    actor = QValueActor(net, in_keys=["observation"], spec=None, action_space="one_hot")
    td = TensorDict(observation=torch.randn(10, 6, dtype=torch.float64), batch_size=[10])
    td = LRP(actor, in_keys=["observation"], target_key="action_value")(td)
    before = td.clone()
    result = action_fidelity(actor, td, k=2, relevance_key="relevance", target_key="action_value", seed=0)
    assert set(result.keys()) == {"relevant", "random"}
    assert (td == before).all()
    # The default, the chosen action's value, is read as the action values at the chosen action.
    by_default = action_fidelity(actor, td, k=2, relevance_key="relevance", seed=0)
    assert (by_default == result).all()
    with pytest.raises(ValueError, match=r"k must be an int in \[1, 6\]"):
        action_fidelity(actor, td, k=7, relevance_key="relevance", target_key="action_value")


class AtomValues(torch.nn.Module):
    """Log-probabilities of 7 atoms for each of 3 actions: ``[*batch, atoms, actions]``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Linear(32, 21))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).unflatten(-1, (7, 3)).log_softmax(-2)


@pytest.mark.parametrize("action_space", ["one_hot", "categorical"])
def test_a_distributional_q_value_actors_greedy_action_is_the_one_it_takes(action_space):
    """Its greedy action has the highest expected return over the support. The argmax of the last dimension took the
    action most likely at each atom, and counted a state as changed where any atom's did: 0.89 of the states against
    0.20 whose action changes, on 64 states."""
    torch.manual_seed(0)
    support = torch.linspace(-5.0, 5.0, 7, dtype=torch.float64)
    actor = DistributionalQValueActor(
        AtomValues().double(), in_keys=["observation"], support=support, action_space=action_space
    )
    x = torch.randn(64, 6, dtype=torch.float64)
    attribution = torch.randn(64, 6, dtype=torch.float64)
    td = TensorDict(observation=x, attribution=TensorDict(observation=attribution), batch_size=[64])
    result = action_fidelity(actor, td, k=2, n_random=2, seed=0, target_key="action_value")
    top = attribution.argsort(dim=-1, descending=True, stable=True)[:, :2]
    removed = x.scatter(-1, top, 0.0)
    before = actor(TensorDict(observation=x, batch_size=[64]))["action"]
    after = actor(TensorDict(observation=removed, batch_size=[64]))["action"]
    changed = (before != after).reshape(64, -1).any(-1).double().mean()
    assert 0.0 < changed < 0.5  # some states change their action, not most
    torch.testing.assert_close(result["relevant"], changed, rtol=0, atol=1e-12)


@pytest.mark.parametrize("distribution", [Ordinal, OneHotOrdinal], ids=lambda d: d.__name__)
def test_an_ordinal_policys_greedy_action_is_the_one_it_takes(distribution):
    """Its action is the argmax of the ordinal log-probabilities, not of the scores (0.297 of the states counted
    against 0.281 whose action changes)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5)).double()
    module = TensorDictModule(net, in_keys=["observation"], out_keys=["scores"])
    actor = ProbabilisticActor(module, in_keys=["scores"], distribution_class=distribution)
    x, attribution = torch.randn(64, 6, dtype=torch.float64), torch.randn(64, 6, dtype=torch.float64)
    td = TensorDict(observation=x, attribution=TensorDict(observation=attribution), batch_size=[64])
    result = action_fidelity(actor, td, k=2, n_random=2, seed=0, target_key="scores")
    removed = x.scatter(-1, attribution.argsort(dim=-1, descending=True, stable=True)[:, :2], 0.0)
    with warnings.catch_warnings(), set_exploration_type(ExplorationType.DETERMINISTIC):
        warnings.simplefilter("ignore")  # tensordict's: the distribution has no deterministic_sample, its mode is used
        before = actor(TensorDict(observation=x, batch_size=[64]))["action"]
        after = actor(TensorDict(observation=removed, batch_size=[64]))["action"]
    changed = (before != after).reshape(64, -1).any(-1).double().mean()
    torch.testing.assert_close(result["relevant"], changed, rtol=0, atol=1e-12)


class TwoHeads(torch.nn.Module):
    """A policy with two heads of three actions each: output ``batch + [2, 3]``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).unflatten(-1, (2, 3))


def test_a_multi_head_policy_counts_states_whose_action_changes_in_any_head():
    """The share was taken over (state, head) pairs: 0.14 where 0.26 of the states changed their action."""
    torch.manual_seed(0)
    net = TwoHeads().double()
    x, a = torch.randn(50, 4, dtype=torch.float64), torch.randn(50, 4, dtype=torch.float64)
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[50])
    result = action_fidelity(net, td, k=1, seed=0, in_keys=["x"], out_keys=["q"])
    top = a.argsort(dim=-1, descending=True, stable=True)[:, :1]
    mask = torch.zeros(50, 4, dtype=torch.bool).scatter_(-1, top, True)
    changed = net(x).argmax(-1) != net(torch.where(mask, 0.0, x)).argmax(-1)
    expected = changed.any(-1).double().mean()
    assert expected != changed.double().mean()  # the case tells the two apart
    torch.testing.assert_close(result["relevant"], expected, rtol=0, atol=1e-12)


def test_a_continuous_policy_is_refused_and_a_categorical_one_scored():
    from tensordict.nn import NormalParamExtractor
    from torchrl.data import Bounded
    from torchrl.modules import Actor, OneHotCategorical, ProbabilisticActor, TanhNormal

    x = torch.randn(8, 4, dtype=torch.float64)
    td = TensorDict(observation=x, attribution=TensorDict(observation=x.flip(-1)), batch_size=[8])
    body = torch.nn.Sequential(torch.nn.Linear(4, 4), NormalParamExtractor()).double()
    params = TensorDictModule(body, ["observation"], ["loc", "scale"])
    gaussian = ProbabilisticActor(params, in_keys=["loc", "scale"], distribution_class=TanhNormal)
    for target_key in (None, "loc"):
        with pytest.raises(ValueError, match=r"output 'loc' is a parameter of the TanhNormal distribution"):
            action_fidelity(gaussian, td, k=1, seed=0, target_key=target_key)
    deterministic = Actor(torch.nn.Linear(4, 2).double(), spec=Bounded(-1.0, 1.0, (2,), dtype=torch.float64))
    with pytest.raises(ValueError, match=r"output 'action' is an action whose spec is continuous"):
        action_fidelity(deterministic, td, k=1, seed=0)
    logits = TensorDictModule(torch.nn.Linear(4, 3).double(), ["observation"], ["logits"])
    categorical = ProbabilisticActor(logits, in_keys=["logits"], distribution_class=OneHotCategorical)
    result = action_fidelity(categorical, td, k=1, seed=0, target_key="logits")
    top = x.flip(-1).argsort(dim=-1, descending=True, stable=True)[:, :1]
    perturbed = torch.where(torch.zeros(8, 4, dtype=torch.bool).scatter_(-1, top, True), 0.0, x)
    net = logits.module
    expected = (net(x).argmax(-1) != net(perturbed).argmax(-1)).double().mean()
    torch.testing.assert_close(result["relevant"], expected, rtol=0, atol=1e-12)


def test_continuous_heads_without_a_continuous_spec_are_refused_by_name():
    """A composite distribution's Normal part, a torchrl ``Actor`` without a spec and a ``TanhModule`` are
    continuous actions: before, the argmax of their last dimension was scored as a greedy action, silently."""
    from tensordict.nn import CompositeDistribution, TensorDictSequential
    from torchrl.data import OneHot
    from torchrl.modules import Actor, ProbabilisticActor, TanhModule

    x = torch.randn(8, 4, dtype=torch.float64)
    td = TensorDict(observation=x, attribution=TensorDict(observation=x.flip(-1)), batch_size=[8])
    heads = TensorDictSequential(
        TensorDictModule(torch.nn.Linear(4, 3).double(), ["observation"], [("params", "move", "loc")]),
        TensorDictModule(lambda loc: torch.ones_like(loc), [("params", "move", "loc")], [("params", "move", "scale")]),
        TensorDictModule(torch.nn.Linear(4, 3).double(), ["observation"], [("params", "pick", "logits")]),
    )
    maps = {"move": torch.distributions.Normal, "pick": torch.distributions.Categorical}
    composite = ProbabilisticActor(
        heads,
        in_keys=["params"],
        out_keys=["move", "pick"],
        distribution_class=CompositeDistribution,
        distribution_kwargs={"distribution_map": maps},
    )
    with pytest.raises(
        ValueError,
        match=r"output \('params', 'move', 'loc'\) is a parameter of the Normal "
        r"distribution 'move' of the CompositeDistribution",
    ):
        action_fidelity(composite, td, k=1, seed=0, in_keys=["observation"], target_key=("params", "move", "loc"))
    pick = ("params", "pick", "logits")
    picked = action_fidelity(composite, td, k=1, seed=0, in_keys=["observation"], target_key=pick)
    top = x.flip(-1).argsort(dim=-1, descending=True, stable=True)[:, :1]
    perturbed = torch.where(torch.zeros(8, 4, dtype=torch.bool).scatter_(-1, top, True), 0.0, x)
    net = heads[2].module
    expected = (net(x).argmax(-1) != net(perturbed).argmax(-1)).double().mean()
    torch.testing.assert_close(picked["relevant"], expected, rtol=0, atol=1e-12)

    with pytest.raises(ValueError, match=r"output 'action' is the action of a torchrl Actor with no spec"):
        action_fidelity(Actor(torch.nn.Linear(4, 2).double()), td, k=1, seed=0)
    raw = TensorDictModule(torch.nn.Linear(4, 2).double(), ["observation"], ["raw"])
    squashed = TensorDictSequential(raw, TanhModule(in_keys=["raw"], out_keys=["action"], low=-1.0, high=1.0))
    with pytest.raises(ValueError, match=r"output 'action' is the bounded action of a TanhModule"):
        action_fidelity(squashed, td, k=1, seed=0)
    values = Actor(net, spec=OneHot(3, dtype=torch.float64))  # an Actor that says its output is discrete: scored
    torch.testing.assert_close(action_fidelity(values, td, k=1, seed=0)["relevant"], expected, rtol=0, atol=1e-12)
