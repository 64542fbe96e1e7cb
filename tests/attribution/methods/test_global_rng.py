"""The global random state across a method's call: a rollout with the method as its policy takes the bare policy's
actions when the policy samples (a ProbabilisticActor under random interaction, an EGreedyModule inside it)."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule, TensorDictModuleBase, TensorDictSequential

from tdhook.attribution.methods._global_rng import global_rng_kept
from tests.attribution.methods.test_base import METHODS, make

# The methods that run the model again after the unperturbed pass.
COPIES = ["IntegratedGradients", "SmoothGrad", "GradientShap", "FeatureAblation", "Occlusion", "ShapleyValueSampling"]


def test_draws_inside_leave_the_global_state():
    model = torch.nn.Linear(2, 2)
    torch.manual_seed(3)
    expected = torch.rand(2)
    torch.manual_seed(3)
    with global_rng_kept(model):
        torch.rand(5)
    assert torch.equal(torch.rand(2), expected)


def sampling_actor():
    from torchrl.envs import GymEnv, StepCounter, TransformedEnv
    from torchrl.modules import MLP, NormalParamExtractor, ProbabilisticActor, TanhNormal

    torch.manual_seed(0)
    env = TransformedEnv(GymEnv("Pendulum-v1"), StepCounter())
    net = torch.nn.Sequential(MLP(in_features=3, out_features=2, num_cells=[16]), NormalParamExtractor())
    space = env.action_spec.space
    actor = ProbabilisticActor(
        TensorDictModule(net, ["observation"], ["loc", "scale"]),
        in_keys=["loc", "scale"],
        distribution_class=TanhNormal,
        distribution_kwargs={"low": space.low, "high": space.high},
        spec=env.action_spec,
        return_log_prob=True,
    )
    return env, actor


def egreedy_policy():
    from torchrl.envs import GymEnv
    from torchrl.modules import MLP, EGreedyModule, QValueActor

    torch.manual_seed(0)
    env = GymEnv("CartPole-v1")
    actor = QValueActor(
        MLP(in_features=4, out_features=2, num_cells=[16]), in_keys=["observation"], spec=env.action_spec
    )
    return env, TensorDictSequential(actor, EGreedyModule(spec=env.action_spec, eps_init=0.5))


def rollout(env, policy, steps=8):
    env.set_seed(0)
    torch.manual_seed(0)
    with torch.no_grad():
        return env.rollout(steps, policy, break_when_any_done=False)


@pytest.mark.parametrize("policy", ["TanhNormal", "EGreedyModule"])
@pytest.mark.parametrize("name", COPIES)
def test_a_sampling_policy_takes_the_bare_policys_actions(name, policy):
    """The perturbed passes drew from the global random state: from the second step on, the rollout's actions were
    not the bare policy's (Pendulum's torque off by up to 3.9, CartPole's actions and episodes different)."""
    from torchrl.envs.utils import ExplorationType, set_exploration_type

    assert set(COPIES) <= set(METHODS)
    env, bare = sampling_actor() if policy == "TanhNormal" else egreedy_policy()
    features = 3 if policy == "TanhNormal" else 4
    options = {"baselines": torch.randn(2, features)} if name == "GradientShap" else {}
    target = "loc" if policy == "TanhNormal" else "action_value"
    method = make(name, bare, in_keys=["observation"], target_key=target, **options)
    with set_exploration_type(ExplorationType.RANDOM):
        plain = rollout(env, bare)
        explained = rollout(env, method)
    assert torch.equal(explained["action"], plain["action"])
    assert torch.equal(explained["next", "observation"], plain["next", "observation"])
    attribution = explained["attribution", "observation"]
    assert torch.isfinite(attribution).all() and not attribution.requires_grad


class Cut(TensorDictModuleBase):
    """One output per row of a ``[B, T]`` context (as torchrl's DecisionTransformerInferenceWrapper), with a draw."""

    def __init__(self):
        super().__init__()
        self.in_keys, self.out_keys = ["x"], ["y"]
        self.linear = torch.nn.Linear(3, 2).double()

    def forward(self, td):
        y = self.linear(td["x"].sum(1)) + 0.1 * torch.rand(td.shape[0], 1, dtype=torch.float64)
        return TensorDict(x=td["x"], y=y, batch_size=td.shape[:1])


@pytest.mark.parametrize("name", ["Saliency", "FeatureAblation"])
def test_a_module_returning_fewer_batch_dims_draws_as_one_plain_call(name):
    """Such a call runs the model again in the module's batch: from the random state the first run started from."""
    module, x = Cut(), torch.randn(2, 4, 3, dtype=torch.float64)
    torch.manual_seed(1)
    module(TensorDict(x=x, batch_size=[2, 4]))
    expected = torch.rand(3)
    torch.manual_seed(1)
    out = make(name, module, target_key="y")(TensorDict(x=x, batch_size=[2, 4]))
    assert out.batch_size == (2,) and torch.equal(torch.rand(3), expected)
