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
from tensordict.nn import TensorDictModule, TensorDictSequential
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


class Pairs(nn.Module):
    """Products of neighbouring features: not element-wise, though its Jacobian at zero is (all zero)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * torch.tanh(x.roll(1, -1))


@pytest.mark.parametrize("preset", ["EpsilonPlus", "EpsilonPlusFlat", "CPLRP"])
def test_a_first_call_on_zeros_does_not_make_a_mixing_module_element_wise(preset: str):
    """A first call on zeros (a reset observation, a warm-up call) gave a module mixing its entries a zero Jacobian,
    diagonal: it got the pass rule for the context's later calls (0.43 to 1.9 off a fresh context's relevance,
    relative L2, with no word)."""
    torch.manual_seed(0)
    net = nn.Sequential(Pairs(), nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)).to(F64).eval()
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(5), dtype=F64)
    expected = explain(net, x, PRESETS[preset]())
    lrp = LRP(net, PRESETS[preset](), in_keys=["x"], out_keys=["y"])
    with lrp:
        explain(net, torch.zeros_like(x), None, lrp)
        later = explain(net, x, None, lrp)
    assert relative_error(later, expected) <= TOLERANCE


class HandDropout(nn.Module):
    """A dropout written by hand: it draws from the global random state."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (torch.rand_like(x) > 0.3) / 0.7


def test_deciding_a_module_that_draws_leaves_the_models_draws_as_in_a_plain_call():
    """Deciding whether a module is element-wise runs its forward again; a module that draws drew once more there, so
    the modules after it drew other masks than in a plain call under the same seed (other outputs, other actions)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), HandDropout(), nn.ReLU(), nn.Linear(6, 6), HandDropout(), nn.Linear(6, 3))
    net, x = net.to(F64), torch.randn(3, 4, dtype=F64)
    torch.manual_seed(1)
    plain = net(x)
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[3]))
    assert torch.equal(out["y"], plain)


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


# ----------------------------------------------------------------------------- samples, batch shapes, targets, calls


def mlp_policy() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)).to(F64).eval()


def cnn_policy() -> nn.Module:
    """A CNN with BatchNorm in eval mode, its statistics calibrated on random batches."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(16, 5),
    ).to(F64)
    with torch.no_grad():
        for _ in range(3):
            net(torch.randn(8, 3, 6, 6, dtype=F64))
    return net.eval()


MODELS = {"mlp": (mlp_policy, (6,)), "cnn": (cnn_policy, (3, 6, 6))}
# Every preset on the MLP; on the CNN those whose convolution rules differ (z+, gamma with z^B, alpha-beta with Flat).
CASES = [("mlp", name) for name in sorted(PRESETS)]
CASES += [("cnn", name) for name in ("EpsilonPlus", "EpsilonGammaBox", "EpsilonAlpha2Beta1Flat")]


def batch_of(shape: tuple[int, ...], n: int = 6, seed: int = 1) -> torch.Tensor:
    # within EpsilonGammaBox's bounds (-3, 3)
    return torch.randn(n, *shape, generator=torch.Generator().manual_seed(seed), dtype=F64).clamp(-2.9, 2.9)


@pytest.mark.parametrize(("model", "preset"), CASES)
def test_a_samples_relevance_is_its_own(model: str, preset: str):
    """Alone, permuted, duplicated, beside an extreme, a zero and a NaN sample: the same relevance."""
    make, shape = MODELS[model]
    net, x = make(), batch_of(shape)
    mapper = PRESETS[preset]
    expected = explain(net, x, mapper())
    chosen = net(x).argmax(-1)
    for i in (0, 4):
        alone = explain(net, x[i : i + 1], mapper(), target=int(chosen[i]))
        assert relative_error(alone[0], expected[i]) <= TOLERANCE
    order = torch.tensor([3, 1, 5, 0, 2, 4])
    assert relative_error(explain(net, x[order], mapper())[order.argsort()], expected) <= TOLERANCE
    assert relative_error(explain(net, torch.cat([x, x]), mapper())[6:], expected) <= TOLERANCE
    odd = torch.stack([torch.full(shape, 1e4, dtype=F64), torch.zeros(shape, dtype=F64), torch.full(shape, torch.nan)])
    assert relative_error(explain(net, torch.cat([odd, x]), mapper())[3:], expected) <= TOLERANCE


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_batch_shapes_and_target_spellings_agree(preset: str):
    """``[6]``, ``[2, 3]``, ``[1, 6]`` and unbatched samples; the target as None, an int, a LongTensor, a callable and
    ``"all"``: the same relevance, in the shapes documented."""
    net, x = mlp_policy(), batch_of((6,))
    mapper = PRESETS[preset]
    module = TensorDictModule(net, in_keys=["x"], out_keys=["y"])

    def call(inputs: torch.Tensor, batch: list[int], **kwargs) -> torch.Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return LRP(module, mapper(), **kwargs)(TensorDict(x=inputs, batch_size=batch))["relevance", "x"]

    expected = call(x, [6])
    assert relative_error(call(x.reshape(2, 3, 6), [2, 3]).reshape(6, 6), expected) <= TOLERANCE
    assert relative_error(call(x.reshape(1, 6, 6), [1, 6]).reshape(6, 6), expected) <= TOLERANCE
    for i in range(6):
        assert relative_error(call(x[i], []), expected[i]) <= TOLERANCE
    chosen = net(x).argmax(-1)
    assert relative_error(call(x, [6], target=chosen), expected) <= TOLERANCE
    for unit in chosen.unique().tolist():
        assert relative_error(call(x, [6], target=unit)[chosen == unit], expected[chosen == unit]) <= TOLERANCE
    one_hot = lambda y: y * nn.functional.one_hot(y.argmax(-1), y.shape[-1])  # noqa: E731
    assert relative_error(call(x, [6], target=one_hot), expected) <= TOLERANCE
    every = call(x.reshape(2, 3, 6), [2, 3], target="all")
    assert every.shape == (2, 3, 4, 6)
    assert relative_error(every.reshape(6, 4, 6)[torch.arange(6), chosen], expected) <= TOLERANCE


@pytest.mark.parametrize(("model", "preset"), CASES)
def test_later_calls_of_a_context_equal_a_fresh_call(model: str, preset: str):
    """The first and later calls of one context, after inputs of another batch size, image size, and zeros."""
    make, shape = MODELS[model]
    net, x = make(), batch_of(shape)
    other = batch_of(shape if model == "mlp" else (3, 10, 10), n=3, seed=2)
    expected = explain(net, x, PRESETS[preset]())
    lrp = LRP(net, PRESETS[preset](), in_keys=["x"], out_keys=["y"])
    with lrp:
        for inputs in (x, x, other, x[:1], torch.zeros_like(x[:2]), x):
            relevance = explain(net, inputs, None, lrp)
            if inputs is x:
                assert relative_error(relevance, expected) <= TOLERANCE


@pytest.mark.parametrize("pair", [("EpsilonPlus", "EpsilonGammaBox"), ("EpsilonAlpha2Beta1Flat", "CPLRP")])
def test_one_module_under_two_wrappers_used_alternately_and_in_one_pipeline(pair: tuple[str, str]):
    net, x = cnn_policy(), batch_of((3, 6, 6))
    module = TensorDictModule(net, in_keys=["x"], out_keys=["y"])
    expected = [explain(net, x, PRESETS[name]()) for name in pair]
    first, second = (LRP(module, PRESETS[name](), relevance_key=f"r{i}") for i, name in enumerate(pair))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):  # first, second, first, second
            for i, lrp in enumerate((first, second)):
                assert relative_error(lrp(TensorDict(x=x, batch_size=[6]))[f"r{i}", "x"], expected[i]) <= TOLERANCE
        both = TensorDictSequential(first, second)(TensorDict(x=x, batch_size=[6]))
    for i in range(2):
        assert relative_error(both[f"r{i}", "x"], expected[i]) <= TOLERANCE


@pytest.mark.parametrize("preset", ["EpsilonPlusFlat", "CPLRP"])
def test_renamed_nested_keys_and_a_call_with_tensors(preset: str):
    net, x = mlp_policy(), batch_of((6,))
    expected = explain(net, x, PRESETS[preset]())
    nested = TensorDictModule(net, in_keys=[("agents", "observation")], out_keys=[("agents", "action_value")])
    td = TensorDict({"agents": TensorDict(observation=x, batch_size=[6])}, batch_size=[6])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = LRP(nested, PRESETS[preset]())(td)
        _, relevance = LRP(TensorDictModule(net, in_keys=["observation"], out_keys=["q"]), PRESETS[preset]())(
            observation=x
        )
    assert relative_error(out["relevance", "agents", "observation"], expected) <= TOLERANCE
    assert relative_error(relevance, expected) <= TOLERANCE
