"""A target drawn at random anew in every forward pass (a sampled action under InteractionType.RANDOM): warned."""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import (
    InteractionType,
    NormalParamExtractor,
    TensorDictModule,
    TensorDictSequential,
    set_interaction_type,
)
from torch import nn
from torchrl.modules import ProbabilisticActor, TanhNormal

from tdhook.attribution import FeatureAblation, IntegratedGradients, Saliency
from tdhook.attribution.methods._sampled_targets import sampled_target


def actor() -> ProbabilisticActor:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4), NormalParamExtractor()).double()
    module = TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"])
    return ProbabilisticActor(module, in_keys=["loc", "scale"], distribution_class=TanhNormal, return_log_prob=True)


def observations() -> TensorDict:
    return TensorDict(observation=torch.randn(5, 4, dtype=torch.float64), batch_size=[5])


def caught(method, td: TensorDict, interaction: InteractionType | None) -> list[str]:
    with warnings.catch_warnings(record=True) as found, set_interaction_type(interaction):
        warnings.simplefilter("always")
        method(td)
    return [str(w.message) for w in found]


@pytest.mark.parametrize("cls", [FeatureAblation, IntegratedGradients])
def test_a_sampled_action_is_warned_once(cls):
    """Under RANDOM sampling (a collector's default) every pass draws another action: two calls of
    FeatureAblation on the same input gave attributions 2.45 apart, and nothing said so."""
    method = cls(actor(), target_key="action", target=0)
    messages = caught(method, observations(), InteractionType.RANDOM)
    assert len(messages) == 1
    assert messages[0].startswith(f"{cls.__name__}: the target 'action' is drawn at random (module 'module.1' ")
    assert caught(method, observations(), InteractionType.RANDOM) == []  # once per wrapper


@pytest.mark.parametrize("target_key", ["action", "loc"])
@pytest.mark.parametrize("cls", [FeatureAblation, Saliency])
def test_no_warning_where_no_pass_compares_draws(cls, target_key):
    """Deterministic sampling, the distribution's parameters, or one pass (the gradient of the draw) are fine."""
    assert caught(cls(actor(), target_key=target_key, target=1), observations(), InteractionType.DETERMINISTIC) == []
    if target_key == "loc" or cls is Saliency:
        assert caught(cls(actor(), target_key=target_key, target=1), observations(), InteractionType.RANDOM) == []


def test_a_key_computed_from_the_draw_is_drawn_at_random():
    critic = TensorDictModule(nn.Linear(6, 1).double(), in_keys=["joint"], out_keys=["value"])
    joint = TensorDictModule(lambda o, a: torch.cat([o, a], -1), in_keys=["observation", "action"], out_keys=["joint"])
    pipeline = TensorDictSequential(actor(), joint, critic)
    with set_interaction_type(InteractionType.RANDOM):
        assert sampled_target(pipeline, "value") == "module 'module.0.module.1' (SafeProbabilisticModule) draws " + (
            "'action' at random"
        )
        assert sampled_target(pipeline, "loc") is None
    assert sampled_target(pipeline, "value") is None


def noisy_actor(step: str) -> TensorDictSequential:
    from torchrl.data import Bounded
    from torchrl.modules import Actor, AdditiveGaussianModule, OrnsteinUhlenbeckProcessModule

    torch.manual_seed(0)
    spec = Bounded(-2.0, 2.0, (1,), dtype=torch.float64)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1), nn.Tanh()).double()
    noise = (
        AdditiveGaussianModule(spec=spec, sigma_init=0.5)
        if step == "gaussian"
        else OrnsteinUhlenbeckProcessModule(spec=spec)
    )
    return TensorDictSequential(Actor(net, in_keys=["observation"], spec=spec), noise)


@pytest.mark.parametrize("step", ["gaussian", "ou"])
def test_an_action_an_exploration_step_perturbs_is_warned(step):
    """An exploration step in the explained model draws new noise in every perturbed pass while exploration is random
    or unset (as in env.rollout and collectors): FeatureAblation of the noisy action was 1.4 off that of the actor's
    action (AdditiveGaussianModule, sigma 0.5), and nothing said so."""
    policy = noisy_actor(step)
    td = observations().set("is_init", torch.zeros(5, 1, dtype=torch.bool))
    for interaction in (InteractionType.RANDOM, None):
        found = caught(FeatureAblation(policy, target_key="action"), td.clone(), interaction)
        messages = [m for m in found if m.startswith("FeatureAblation")]  # not torchrl's own on its copies' is_init
        assert len(messages) == 1, messages
        name = "AdditiveGaussianModule" if step == "gaussian" else "OrnsteinUhlenbeckProcessModule"
        expected = f"FeatureAblation: the target 'action' is drawn at random (module 'module.1' ({name})"
        assert messages[0].startswith(expected)
    assert caught(FeatureAblation(policy, target_key="action"), td.clone(), InteractionType.DETERMINISTIC) == []
    with set_interaction_type(InteractionType.RANDOM):  # the actor's output before the step is not drawn
        assert sampled_target(TensorDictSequential(policy[0]), "action") is None


def test_a_sampled_action_warning_made_an_error_is_given_at_every_call():
    """A caller's filter that makes the warning an error raises it at every call, not only the first: the warning is
    counted as given once it is out."""
    method = FeatureAblation(actor(), target_key="action", target=0)
    for _ in range(2):
        with warnings.catch_warnings(), set_interaction_type(InteractionType.RANDOM):
            warnings.simplefilter("error")
            with pytest.raises(UserWarning, match="FeatureAblation: the target 'action' is drawn at random"):
                method(observations())
    assert len(caught(method, observations(), InteractionType.RANDOM)) == 1
    assert caught(method, observations(), InteractionType.RANDOM) == []
