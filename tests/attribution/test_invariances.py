"""Invariances a relevance must respect, checked across the presets on small models, in float64.

A sample's relevance is the same alone, in a batch (permuted, duplicated, beside extreme, zero or NaN samples),
under any batch shape, for every spelling of the same target, in the first and later calls of a context (with
other input shapes explained in between), with other keys explained beside it or not, under renamed and nested
keys, and called with tensors. The oracle is a fresh wrapper's call on the reference batch (or the sample alone),
and LRP-0 is gradient × input.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import (
    CPLRP,
    LRP,
    AttnLRP,
    BaseRuleMapper,
    EpsilonAlpha2Beta1,
    EpsilonAlpha2Beta1Flat,
    EpsilonGammaBox,
    EpsilonPlus,
    EpsilonPlusFlat,
    PassRule,
    UniformEpsilon,
)
from tdhook.attribution.rules.transformer import PseudoIdentityRule
from tests.conftest import relative_error

F64 = torch.float64
TOLERANCE = 1e-10
PRESETS = {
    "BaseRuleMapper": BaseRuleMapper,
    "EpsilonPlus": EpsilonPlus,
    "EpsilonPlusFlat": EpsilonPlusFlat,
    "EpsilonGammaBox": lambda **options: EpsilonGammaBox(-3.0, 3.0, **options),
    "EpsilonAlpha2Beta1": EpsilonAlpha2Beta1,
    "EpsilonAlpha2Beta1Flat": EpsilonAlpha2Beta1Flat,
    "UniformEpsilon": UniformEpsilon,
    "AttnLRP": AttnLRP,
    "CPLRP": CPLRP,
}


def explain(model: nn.Module, x: torch.Tensor, mapper, lrp: LRP | None = None, **kwargs) -> torch.Tensor:
    lrp = lrp if lrp is not None else LRP(model, mapper, in_keys=["x"], out_keys=["y"], **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lrp(TensorDict(x=x.clone(), batch_size=x.shape[:1]))["relevance", "x"]


# ----------------------------------------------------------------------------- hand-written partly linear activations


class ELU(nn.Module):
    """An ELU written by hand: the identity for positive inputs, curved below zero."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, x, torch.expm1(x.clamp(max=0)))


class EluPlusOne(nn.Module):
    """``elu(x) + 1``, the feature map of linear attention: ``x + 1`` for positive inputs, curved below zero."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, x + 1, torch.exp(x.clamp(max=0)))


ACTIVATIONS = {"ELU": ELU, "EluPlusOne": EluPlusOne}


def activation_net(act: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), act, nn.Linear(5, 3)).to(F64).eval()
    with torch.no_grad():
        net[0].bias.fill_(3.0)  # small inputs reach the activation's linear part only
    return net


def by_hand(preset: str, act: type[nn.Module]):
    """The preset with the activation mapped to its pass rule by hand: the oracle."""
    kind = PseudoIdentityRule() if preset in ("AttnLRP", "CPLRP") else PassRule()
    return PRESETS[preset](rule_mapper={act: kind})


@pytest.mark.parametrize("preset", ["EpsilonPlus", "EpsilonGammaBox", "AttnLRP"])
@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_a_first_call_in_the_linear_part_does_not_decide_an_activation_for_the_later_calls(act: str, preset: str):
    """A hand-written activation was decided at its first call in a context: with every input of that call in its
    linear part it showed no curvature and kept its plain gradient for the later calls of the context, which
    reached its curved part (0.11 to 0.17 off a fresh context's relevance, relative L2, with no word)."""
    net = activation_net(ACTIVATIONS[act]())
    small, large = (
        0.1 * torch.rand(2, 4, dtype=F64),
        20 * torch.randn(2, 4, generator=torch.Generator().manual_seed(3), dtype=F64),
    )
    assert (net[0](small) > 0).all() and (net[0](large) < 0).any()
    expected = explain(net, large, by_hand(preset, ACTIVATIONS[act]))
    lrp = LRP(net, PRESETS[preset](), in_keys=["x"], out_keys=["y"])
    with lrp:
        explain(net, small, None, lrp)
        later = explain(net, large, None, lrp)
    assert relative_error(later, expected) <= TOLERANCE
    assert relative_error(explain(net, large, PRESETS[preset]()), expected) <= TOLERANCE


@pytest.mark.parametrize("preset", ["EpsilonPlus", "AttnLRP"])
def test_a_sample_in_the_linear_part_gets_the_same_relevance_alone_and_in_a_batch(preset: str):
    """``elu(x) + 1`` is not homogeneous in its linear part, so its pass rule and its plain gradient differ there: a
    sample whose inputs all fell there got the plain gradient alone and the pass rule beside a sample reaching the
    curved part (0.25 off, relative L2)."""
    net = activation_net(EluPlusOne())
    small, large = (
        0.1 * torch.rand(1, 4, dtype=F64),
        20 * torch.randn(1, 4, generator=torch.Generator().manual_seed(3), dtype=F64),
    )
    expected = explain(net, small, by_hand(preset, EluPlusOne))
    alone = explain(net, small, PRESETS[preset]())
    batched = explain(net, torch.cat([small, large]), PRESETS[preset]())[:1]
    assert relative_error(alone, expected) <= TOLERANCE
    assert relative_error(batched, expected) <= TOLERANCE


# ----------------------------------------------------------------------------- keys explained together or alone


class FiLM(nn.Module):
    """A goal-conditioned policy: the observation's features scaled and shifted by the goal's (FiLM)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.gamma, self.beta = nn.Linear(4, 8), nn.Linear(3, 8), nn.Linear(3, 8)
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(8, 3))

    def forward(self, obs: torch.Tensor, goal: torch.Tensor) -> torch.Tensor:
        return self.head(self.gamma(goal) * self.enc(obs) + self.beta(goal))


class WithGoal(nn.Module):
    """The FiLM policy with the goal held as a buffer: the oracle for a call that does not explain ``goal``."""

    def __init__(self, film: FiLM, goal: torch.Tensor) -> None:
        super().__init__()
        self.film = film
        self.register_buffer("goal", goal)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.film(obs, self.goal)


def film_inputs() -> tuple[TensorDictModule, TensorDict]:
    torch.manual_seed(0)
    policy = TensorDictModule(FiLM().to(F64).eval(), in_keys=["obs", "goal"], out_keys=["action_value"])
    generator = torch.Generator().manual_seed(9)
    obs, goal = (torch.randn(5, n, generator=generator, dtype=F64) for n in (4, 3))
    return policy, TensorDict(obs=obs, goal=goal, batch_size=[5])


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_key_left_out_of_in_keys_is_a_constant_of_the_model(preset: str):
    """``in_keys=["obs"]`` explains ``obs`` with ``goal`` a constant of the model, as the same model holding ``goal``
    as a buffer; the caller's entries stay its own, and only ``obs`` gets a relevance key."""
    policy, td = film_inputs()
    given = td["goal"]
    out = LRP(policy, PRESETS[preset](), in_keys=["obs"])(td)
    held = TensorDictModule(WithGoal(policy.module, given.clone()), in_keys=["obs"], out_keys=["action_value"])
    expected = LRP(held, PRESETS[preset]())(TensorDict(obs=td["obs"], batch_size=[5]))
    assert relative_error(out["relevance", "obs"], expected["relevance", "obs"]) <= TOLERANCE
    assert set(out["relevance"].keys()) == {"obs"} and out["goal"] is given and not given.requires_grad


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_the_order_of_the_explained_keys_changes_nothing(preset: str):
    policy, td = film_inputs()
    forward = LRP(policy, PRESETS[preset](), in_keys=["obs", "goal"])(td.clone())["relevance"]
    backward = LRP(policy, PRESETS[preset](), in_keys=["goal", "obs"])(td.clone())["relevance"]
    default = LRP(policy, PRESETS[preset]())(td.clone())["relevance"]
    for key in ("obs", "goal"):
        assert relative_error(backward[key], forward[key]) <= TOLERANCE
        assert relative_error(default[key], forward[key]) <= TOLERANCE
