"""Clipping calls pass relevance on as ``nn.Hardtanh`` and ``nn.ReLU6`` modules do, whichever the spelling, under the
CNN presets too (the transformer presets: ``test_functional.py``; a maximum or minimum at a constant: both)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import (
    CPLRP,
    LRP,
    AttnLRP,
    BaseRuleMapper,
    EpsilonAlpha2Beta1,
    EpsilonPlus,
    EpsilonPlusFlat,
    UniformEpsilon,
)
from tests.attribution.rules.test_functional import OneSided
from tests.conftest import relative_error

F64 = torch.float64

SPELLINGS = {
    "nn.Hardtanh": lambda block, h: block.hardtanh(h),
    "torch.clamp": lambda block, h: torch.clamp(h, -1.0, 1.0),
    "Tensor.clamp": lambda block, h: h.clamp(min=-1.0, max=1.0),
    "Tensor.clamp_": lambda block, h: h.clamp_(-1.0, 1.0),
    "torch.clip": lambda block, h: torch.clip(h, -1.0, 1.0),
    "F.hardtanh": lambda block, h: F.hardtanh(h),
    "F.hardtanh in place": lambda block, h: F.hardtanh(h, inplace=True),
    "nn.ReLU6": lambda block, h: block.relu6(h * 3.0) / 3.0,
    "F.relu6": lambda block, h: F.relu6(h * 3.0) / 3.0,
    "Tensor.clamp, 0 to 6": lambda block, h: (h * 3.0).clamp(0.0, 6.0) / 3.0,
}
PRESETS = {
    "EpsilonPlus": EpsilonPlus,
    "UniformEpsilon": UniformEpsilon,
    "EpsilonPlusFlat": EpsilonPlusFlat,
    "EpsilonAlpha2Beta1": EpsilonAlpha2Beta1,
}


class Block(nn.Module):
    """A Linear layer and a clip in one module's own forward (the clip is no module of its own but for the module
    spellings), then a Linear head."""

    def __init__(self, spelling: str) -> None:
        super().__init__()
        self.first, self.head = nn.Linear(4, 6, bias=False), nn.Linear(6, 3, bias=False)
        self.hardtanh, self.relu6, self.spelling = nn.Hardtanh(), nn.ReLU6(), spelling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(SPELLINGS[self.spelling](self, self.first(x)))


def _relevances(spelling: str, preset: str, x: torch.Tensor, calls: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(0)
    lrp = LRP(Block(spelling).to(F64), PRESETS[preset](), in_keys=["x"], out_keys=["y"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with lrp:
            return [lrp(TensorDict(x=x.clone(), batch_size=[len(x)]))["relevance", "x"] for _ in range(calls)]


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("spelling", sorted(set(SPELLINGS) - {"nn.Hardtanh", "nn.ReLU6"}))
def test_a_clipping_call_passes_relevance_on_as_the_module_does(spelling: str, preset: str):
    """A clip called as a function in a module's own forward kept its plain gradient under the CNN presets, where
    ``nn.Hardtanh`` and ``nn.ReLU6`` get the pass rule: the two spellings of one computation disagreed, 0.44 to 0.86
    relative (EpsilonPlus, UniformEpsilon), and units clipped at a bound other than zero lost their relevance. The
    call gets the module's pass rule, in every call of a context."""
    torch.manual_seed(0)
    x = torch.randn(5, 4, dtype=F64) * 3
    module = "nn.ReLU6" if "6" in spelling else "nn.Hardtanh"
    (expected, *_) = _relevances(module, preset, x, calls=1)
    for relevance in _relevances(spelling, preset, x):
        assert relative_error(relevance, expected) <= 1e-12
    if preset == "EpsilonPlus":  # the plain gradient (ε = 1e-6 on the layers) gives another: the test can fail
        torch.manual_seed(0)
        block, leaf = Block(spelling).to(F64), x.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(block(leaf).max(-1).values.sum(), leaf)
        assert relative_error(leaf.detach() * grad, expected) > 0.1


class DividedByNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.head = nn.Linear(4, 6, bias=False), nn.Linear(6, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        return self.head(h / torch.clamp(h.norm(dim=-1, keepdim=True), min=1e-6))


def test_a_clip_that_guards_a_divisor_keeps_its_plain_gradient():
    """A norm kept away from zero is no activation's clip: where it is below the bound, ``h / eps`` is linear and its
    plain gradient is LRP-0 (the pass rule there would hand the numerator's relevance back to the norm). The norm
    written out is held, as ``F.normalize``'s: no warning."""
    torch.manual_seed(0)
    model, x = DividedByNorm().to(F64), torch.randn(5, 4, dtype=F64) * 1e-8
    leaf = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(model(leaf).max(-1).values.sum(), leaf)
    lrp = LRP(model, EpsilonPlus(epsilon=0.0), in_keys=["x"], out_keys=["y"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        relevance = lrp(TensorDict(x=x.clone(), batch_size=[5]))["relevance", "x"]
    assert relative_error(relevance, x * grad) <= 1e-9


def _lower(h: torch.Tensor) -> torch.Tensor:
    return torch.tensor(-1.0, dtype=h.dtype)


BOUNDS = {  # a maximum or minimum of an activation and a constant: a clip at the constant (min: -1, max: 1)
    "torch.maximum": (lambda h: torch.maximum(h, _lower(h)), "min"),
    "torch.maximum, bound first": (lambda h: torch.maximum(_lower(h), h), "min"),
    "Tensor.maximum": (lambda h: h.maximum(_lower(h)), "min"),
    "Tensor.maximum, bound's method": (lambda h: _lower(h).maximum(h), "min"),
    "torch.maximum, other=": (lambda h: torch.maximum(h, other=_lower(h)), "min"),
    "torch.maximum, a full bound": (lambda h: torch.maximum(h, torch.full_like(h.detach(), -1.0)), "min"),
    "torch.fmax": (lambda h: torch.fmax(h, _lower(h)), "min"),
    "Tensor.fmax": (lambda h: h.fmax(_lower(h)), "min"),
    "torch.minimum": (lambda h: torch.minimum(h, -_lower(h)), "max"),
    "Tensor.minimum": (lambda h: h.minimum(-_lower(h)), "max"),
    "torch.fmin": (lambda h: torch.fmin(-_lower(h), h), "max"),
    "Tensor.fmin": (lambda h: h.fmin(-_lower(h)), "max"),
    "torch.max of two": (lambda h: torch.max(h, _lower(h)), "min"),
    "Tensor.max of two": (lambda h: h.max(_lower(h)), "min"),
    "torch.min of two": (lambda h: torch.min(-_lower(h), h), "max"),
    "Tensor.min of two": (lambda h: h.min(other=-_lower(h)), "max"),
    # A bound that broadcasts the output beyond the activation's shape (the mean takes it back).
    "torch.maximum, a wider bound": (lambda h: torch.maximum(h, torch.full((2, *h.shape), -1.0)).mean(0), "min"),
    "torch.clamp, a wider bound": (lambda h: torch.clamp(h, min=torch.full((2, *h.shape), -1.0)).mean(0), "min"),
}


@pytest.mark.parametrize("preset", ["AttnLRP", "CPLRP", "EpsilonPlus", "UniformEpsilon"])
@pytest.mark.parametrize("bound", sorted(BOUNDS))
def test_a_maximum_or_minimum_at_a_constant_passes_relevance_on_as_clamp_does(bound: str, preset: str):
    """``torch.maximum(h, c)`` (``minimum``, ``fmax``, ``fmin``, ``max``, ``min``, either order, as methods) with a
    constant ``c`` (or a clamp with a tensor bound that broadcasts the output beyond ``h``'s shape) kept
    its plain gradient, where ``h.clamp(min=c)`` gets the identity (pass) rule: a unit clipped at a bound other than
    zero lost its relevance, with no warning (under AttnLRP and CP-LRP the explained logit's relevance off by up to
    1.55 times the logit at a bound of -1, 0.18 at a bound of 1). It gets the rule of ``clamp`` with the same bound,
    to the last bit, in every call of a context; under the transformer presets it conserves."""
    from tdhook.attribution import CPLRP, AttnLRP

    call, side = BOUNDS[bound]
    torch.manual_seed(0)
    model = OneSided(call).to(F64)
    reference = OneSided(lambda h: torch.clamp(h, **{side: -1.0 if side == "min" else 1.0})).to(F64)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(5, 4, dtype=F64) * 3
    assert (model.first(x).abs() > 1).float().mean() > 0.3  # many units clipped
    presets = {"AttnLRP": AttnLRP, "CPLRP": CPLRP, **PRESETS}
    relevances = []
    for module in (model, reference):
        lrp = LRP(module, presets[preset](), in_keys=["x"], out_keys=["y"])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with lrp:
                relevances += [lrp(TensorDict(x=x.clone(), batch_size=[5]))["relevance", "x"] for _ in range(3)]
    assert all(torch.equal(relevance, relevances[-1]) for relevance in relevances)
    if preset in ("AttnLRP", "CPLRP"):
        logit = reference(x).max(1).values
        assert ((relevances[0].sum(1) - logit).abs() / logit.abs()).max() <= 1e-9


@pytest.mark.parametrize("preset", ["AttnLRP", "CPLRP", "EpsilonPlus"])
def test_a_maximum_of_two_activations_keeps_its_plain_gradient(preset: str):
    """A maximum of two signals is no clip (as ``torch.clamp(x, min=y)`` with an activation bound): its plain
    gradient, LRP-0 here (gradient × input), in and out of a ``torch.utils.checkpoint`` region, where it is not
    refused; nor is a maximum of two constants."""
    from torch.utils.checkpoint import checkpoint

    from tdhook.attribution import CPLRP, AttnLRP

    def both(h: torch.Tensor) -> torch.Tensor:
        constant = torch.maximum(torch.zeros(()), torch.ones(())).to(h.dtype)
        return torch.maximum(h[..., :3], h[..., 3:] - constant)

    class Two(OneSided):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.first(x)
            return self.second(torch.cat([both(h), checkpoint(both, h, use_reentrant=False)], -1))

    torch.manual_seed(0)
    model, x = Two(lambda h: h).to(F64), torch.randn(5, 4, dtype=F64) * 3
    leaf = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(model(leaf).max(-1).values.sum(), leaf)
    presets = {"AttnLRP": AttnLRP, "CPLRP": CPLRP, **PRESETS}
    lrp = LRP(
        model,
        presets[preset](epsilon=0.0) if preset == "EpsilonPlus" else presets[preset](),
        in_keys=["x"],
        out_keys=["y"],
    )
    with lrp:
        for _ in range(2):
            relevance = lrp(TensorDict(x=x.clone(), batch_size=[5]))["relevance", "x"]
            assert relative_error(relevance, x * grad) <= 1e-9


def test_a_maximum_at_a_constant_under_vmap_is_refused_as_clamp_is():
    """Under ``torch.vmap`` tensors report no gradient: a maximum at a constant would silently keep its plain gradient
    (it ran), where ``clamp`` is refused. It is refused as ``clamp`` is; a maximum of two activations still runs."""
    from tdhook.attribution.rules.functional import FunctionalRules
    from tdhook.attribution.rules.transformer import PseudoIdentityRule, SoftmaxEpsilonRule

    mode = FunctionalRules(SoftmaxEpsilonRule(), PseudoIdentityRule())
    h, bound = torch.randn(3, 4, requires_grad=True) * 1, torch.tensor(-1.0)
    for call in (lambda t: t.clamp(min=-1.0), lambda t: torch.maximum(t, bound), lambda t: bound.fmin(t)):
        with pytest.raises(RuntimeError, match="runs under torch.vmap"), mode:
            torch.vmap(call)(h)
    with mode:
        assert torch.equal(torch.vmap(lambda t: torch.maximum(t, t - 1.0))(h), h)


# A ReLU written as a clip: a lower bound of 0 and none above.
RELUS = {
    "clamp(min=0)": lambda h: h.clamp(min=0),
    "clamp(h, 0, inf)": lambda h: torch.clamp(h, 0, float("inf")),
    "clamp(min=tensor(0.), max=tensor(inf))": lambda h: h.clamp(min=torch.tensor(0.0), max=torch.tensor(float("inf"))),
    "clamp_min(0)": lambda h: torch.clamp_min(h, 0),
    "clamp_min_(0) of a copy": lambda h: h.clone().clamp_min_(0.0),
    "maximum(h, zeros)": lambda h: torch.maximum(h, torch.zeros((), dtype=h.dtype)),
    "F.hardtanh(h, 0, inf)": lambda h: F.hardtanh(h, 0.0, float("inf")),
    "nn.Threshold(0, 0)": nn.Threshold(0.0, 0.0),
    "nn.Hardtanh(0, inf)": nn.Hardtanh(0.0, float("inf")),
}


@pytest.mark.parametrize("mapper", ["BaseRuleMapper(stabilizer=0)", "AttnLRP", "CPLRP"])
@pytest.mark.parametrize("spelling", sorted(RELUS))
def test_a_relu_written_as_a_clip_is_gradient_x_input_at_any_scale(spelling: str, mapper: str):
    """A clip to [0, inf) is a ReLU, positively homogeneous: its pass rule is its plain gradient. The pass rule's
    stabiliser moved it off by stabilizer / |h|: 0.05 off gradient x input at inputs of 1e-10 (relative L2), 0.72 at
    1e-12, with no word, where nn.ReLU is exact."""
    mappers = {"BaseRuleMapper(stabilizer=0)": lambda: BaseRuleMapper(stabilizer=0.0), "AttnLRP": AttnLRP}
    mappers["CPLRP"] = CPLRP
    torch.manual_seed(1)
    first, last = nn.Linear(6, 8, bias=False), nn.Linear(8, 3, bias=False)
    act = RELUS[spelling]
    model = nn.Sequential(first, act if isinstance(act, nn.Module) else Lambda(act), last).to(F64)
    x = torch.randn(4, 6, dtype=F64, generator=torch.Generator().manual_seed(0)) * 1e-10
    relevance = LRP(model, mappers[mapper](), in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[4]))
    leaf = x.clone().requires_grad_(True)
    out = model(leaf)
    (gradient,) = torch.autograd.grad(out.gather(-1, out.argmax(-1, keepdim=True)).sum(), leaf)
    assert relative_error(relevance["relevance", "x"], x * gradient) <= 1e-12


class Lambda(nn.Module):
    def __init__(self, function) -> None:
        super().__init__()
        self.function = function

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.function(h)


# Clips of a gated unit's value path that clip nothing: bounds at ±inf (Gemma 4's until a checkpoint sets them) or
# wide, called as a function or as a module.
VALUE_CLIPS = {
    "torch.clamp at inf": lambda unit, z: torch.clamp(z, unit.bounds[0], unit.bounds[1]),
    "torch.clamp at 100": lambda unit, z: torch.clamp(z, -100.0, 100.0),
    "F.hardtanh at 100": lambda unit, z: F.hardtanh(z, -100.0, 100.0),
    "nn.Hardtanh at 100": lambda unit, z: unit.hardtanh(z),
}


class ClippedGatedUnit(nn.Module):
    """A gated unit ``down(gelu(gate(h)) * clip(up(h)))`` beside a residual, its value path clipped (as Gemma 4's
    vision encoder clips its projections' outputs) or not."""

    def __init__(self, clip: str | None) -> None:
        super().__init__()
        self.first, self.head = nn.Linear(4, 6), nn.Linear(6, 3)
        self.gate, self.up, self.down = nn.Linear(6, 8, bias=False), nn.Linear(6, 8, bias=False), nn.Linear(8, 6)
        self.act, self.hardtanh, self.clip = nn.GELU(approximate="tanh"), nn.Hardtanh(-100.0, 100.0), clip
        self.register_buffer("bounds", torch.tensor([-float("inf"), float("inf")]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        value = self.up(h) if self.clip is None else VALUE_CLIPS[self.clip](self, self.up(h))
        return self.head(h + self.down(self.act(self.gate(h)) * value))


@pytest.mark.parametrize("preset", ["CPLRP", "AttnLRP"])
@pytest.mark.parametrize("clip", sorted(VALUE_CLIPS))
def test_a_clip_that_clips_nothing_changes_no_gated_units_relevance(clip: str, preset: str):
    """A clip of a gated unit's value path made the product one of two gates of another kind, so CP-LRP held
    neither: 0.04 off (relative L2) the same unit unclipped, and 0.40 on timm's ``gemma4_vit_167m`` against gradient
    × input with the GELU gate, the norms' scales and the attention weights detached. The clip's output, called as a
    function or as a module, is now the signal and the GELU's the gate, as without the clip; AttnLRP holds no such
    gate either way."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1), dtype=F64)
    relevances = []
    for spelling in (clip, None):
        torch.manual_seed(0)
        mapper = {"CPLRP": CPLRP, "AttnLRP": AttnLRP}[preset]()
        lrp = LRP(ClippedGatedUnit(spelling).to(F64), mapper, in_keys=["x"], out_keys=["y"])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            relevances.append(lrp(TensorDict(x=x, batch_size=[3]))["relevance", "x"])
    assert relative_error(*relevances) <= 1e-9


@pytest.mark.parametrize("preset", ["CPLRP", "AttnLRP"])
def test_a_clip_without_finite_bounds_passes_relevance_on_exactly(preset: str):
    """A clip at ±inf is the identity: its plain gradient, with no stabiliser. Its pass rule moved the relevance off
    by its stabiliser: 2e-11 to 4e-11 (relative L2) off the unclipped unit here, where the clipped values are of
    1e-7, and 6.7e-5 on ``gemma4_vit_167m`` at 32 channels (its RMS norms scale small values up) against gradient ×
    input with the held quantities detached (1.1e-8 now, as with its clips off)."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1), dtype=F64)
    relevances = []
    for spelling in ("torch.clamp at inf", None):
        torch.manual_seed(0)
        unit = ClippedGatedUnit(spelling).to(F64)
        with torch.no_grad():
            unit.up.weight.mul_(1e-6)
        mapper = {"CPLRP": CPLRP, "AttnLRP": AttnLRP}[preset]()
        lrp = LRP(unit, mapper, in_keys=["x"], out_keys=["y"])
        relevances.append(lrp(TensorDict(x=x, batch_size=[3]))["relevance", "x"])
    assert relative_error(*relevances) <= 1e-12
