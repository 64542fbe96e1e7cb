"""Modules without parameters or children that compute an element-wise function get the pass rule.

The oracle is the same network with the module mapped to the pass rule by hand (``rule_mapper``); a module that
is not element-wise keeps the gradient it has without a rule, function rules inside it included (the oracle:
the same computation written inline in the parent's forward).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import (
    CPLRP,
    LRP,
    AttnLRP,
    BaseRuleMapper,
    EpsilonGammaBox,
    EpsilonPlus,
    EpsilonPlusFlat,
    IgnoreRule,
    PassRule,
)
from tdhook.attribution.rules.elementwise import ElementwiseRule, is_curved, is_diagonal, may_be_elementwise
from tdhook.attribution.rules.transformer import PseudoIdentityRule
from tests.conftest import relative_error

F64 = torch.float64


class Swish(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(x)


class TanhGelu(nn.Module):
    """A GELU written by hand, as Bloom's ``BloomGelu``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


class ScaledGelu(nn.Module):
    """A scaled GELU that says it works in place but does not (timm's ``GammaAct``: ``gelu(x).mul_(gamma)``, with
    ``inplace=True`` in NFNet-F0's stem)."""

    inplace = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x).mul_(1.7)


class Mixing(nn.Module):
    """No parameters, the input's shape, but not element-wise: each output mixes two features."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x.flip(-1)


class Net(nn.Module):
    def __init__(self, act: nn.Module | None) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(5, 6), act, nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(self.act(h) if self.act is not None else h * h.flip(-1))


PRESETS = {
    "BaseRuleMapper": BaseRuleMapper,
    "EpsilonPlus": EpsilonPlus,
    "EpsilonPlusFlat": EpsilonPlusFlat,
    "EpsilonGammaBox": lambda **options: EpsilonGammaBox(-3.0, 3.0, **options),
    "AttnLRP": AttnLRP,
    "CPLRP": CPLRP,
}
ACTIVATIONS = {"Swish": Swish, "TanhGelu": TanhGelu, "ScaledGelu": ScaledGelu}


def relevance(model: nn.Module, x: torch.Tensor, mapper, calls: int = 2, **kwargs) -> list[torch.Tensor]:
    """The input relevance of ``calls`` calls of one wrapper (and the layer relevances asked in ``kwargs``)."""
    lrp = LRP(model, mapper, in_keys=["x"], out_keys=["y"], **kwargs)
    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(calls):
            results.append(lrp(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))["relevance"])
    return results


class TestHandWrittenActivations:
    @pytest.mark.parametrize("preset", sorted(PRESETS))
    @pytest.mark.parametrize("act", sorted(ACTIVATIONS))
    def test_equal_the_pass_rule_mapped_by_hand(self, act: str, preset: str):
        torch.manual_seed(0)
        model, x = Net(ACTIVATIONS[act]()).double(), torch.randn(4, 5, dtype=F64)
        kind = PseudoIdentityRule() if preset in ("AttnLRP", "CPLRP") else PassRule()
        expected = relevance(model, x, PRESETS[preset](rule_mapper={ACTIVATIONS[act]: kind}), calls=1)[0]
        for actual in relevance(model, x, PRESETS[preset]()):  # the first call and a later one
            assert relative_error(actual["x"], expected["x"]) <= 1e-12
        # (Swish's sigmoid is a gate held on the signal, and F.gelu has a function rule under AttnLRP and CP-LRP:
        # the same relevance unruled there)
        if act == "TanhGelu" or (act == "ScaledGelu" and preset not in ("AttnLRP", "CPLRP")):
            plain = relevance(model, x, PRESETS[preset](rule_mapper={ACTIVATIONS[act]: IgnoreRule()}), calls=1)[0]
            assert relative_error(plain["x"], expected["x"]) > 1e-3

    @pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
    @pytest.mark.parametrize("preset", ["EpsilonPlus", "AttnLRP"])
    def test_a_non_finite_sample_in_the_first_call_changes_no_other_samples_relevance(self, preset: str, bad: float):
        # The module is decided at its first call from its Jacobian and curvature over the whole batch: a NaN there
        # made it neither diagonal nor curved, so it kept its plain gradient for every sample, in that call and the
        # context's later ones (0.28 off under EpsilonPlus, 0.50 under AttnLRP, relative, for the finite samples).
        torch.manual_seed(0)
        model, x = Net(TanhGelu()).double(), torch.randn(4, 5, dtype=F64)
        bad_x = x.clone()
        bad_x[1, 2] = bad
        lrp = LRP(model, PRESETS[preset](), in_keys=["x"], out_keys=["y"])
        finite = [0, 2, 3]
        expected = lrp(TensorDict(x=x[finite], batch_size=[3]))["relevance", "x"]
        with lrp:
            first = lrp(TensorDict(x=bad_x, batch_size=[4]))["relevance", "x"]
            later = lrp(TensorDict(x=x[finite], batch_size=[3]))["relevance", "x"]
        assert relative_error(first[finite], expected) <= 1e-12
        assert relative_error(later, expected) <= 1e-12

    def test_relevance_passes_through_unchanged(self):
        x = torch.randn(3, 4, dtype=F64, requires_grad=True)
        swish, relevance_out = Swish(), torch.randn(3, 4, dtype=F64)
        with ElementwiseRule(PassRule()).register(swish):
            z = swish(x * 1)
            (grad,) = torch.autograd.grad(z, x, relevance_out / z)
        assert relative_error(x.detach() * grad, relevance_out) <= 1e-10

    def test_the_test_runs_no_hook_of_the_input(self):
        # The relevance of the layer before the module (a hook on the module's input) is the backward pass's only.
        torch.manual_seed(1)
        model, x = Net(Swish()).double(), torch.randn(4, 5, dtype=F64)
        expected = relevance(model, x, EpsilonPlus(rule_mapper={Swish: PassRule()}), calls=1, layers=["fc1"])[0]
        (actual,) = relevance(model, x, EpsilonPlus(), calls=1, layers=["fc1"])
        assert relative_error(actual["fc1"], expected["fc1"]) <= 1e-12

    def test_no_longer_reported_by_coverage(self):
        lrp = LRP(Net(Swish()).double(), EpsilonPlus(strict=True), in_keys=["x"], out_keys=["y"])
        lrp(TensorDict(x=torch.randn(2, 5, dtype=F64), batch_size=[2]))
        assert lrp.coverage().plain_gradient == ()


class TestOtherModulesKeepTheirGradient:
    @pytest.mark.parametrize("preset", ["AttnLRP", "CPLRP", "EpsilonPlus"])
    def test_equal_the_same_computation_written_inline(self, preset: str):
        torch.manual_seed(2)
        model, inline, x = Net(Mixing()).double(), Net(None).double(), torch.randn(4, 5, dtype=F64)
        inline.load_state_dict(model.state_dict())
        (expected,) = relevance(inline, x, PRESETS[preset](), calls=1)
        for actual in relevance(model, x, PRESETS[preset]()):
            assert relative_error(actual["x"], expected["x"]) <= 1e-12

    def test_still_reported_by_coverage(self):
        lrp = LRP(Net(Mixing()).double(), EpsilonPlus(), in_keys=["x"], out_keys=["y"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lrp(TensorDict(x=torch.randn(2, 5, dtype=F64), batch_size=[2]))
        assert [(c.module, c.function) for c in lrp.coverage().plain_gradient] == [("act", "mul")]
        assert any("module 'act' (Mixing) computes mul" in str(w.message) for w in caught)


FUNCTIONS = {
    "tanh": (lambda x: torch.tanh(x), True),
    "x * sigmoid(x)": (lambda x: x * torch.sigmoid(x), True),
    "2 * x + 1": (lambda x: 2 * x + 1, True),
    "x * constant": (lambda x: x * torch.linspace(-1, 1, x.shape[-1], dtype=x.dtype), True),
    "softmax": (lambda x: torch.softmax(x, -1), False),
    "x - mean": (lambda x: x - x.mean(-1, keepdim=True), False),
    "flip": (lambda x: x.flip(-1), False),
    "cumsum": (lambda x: x.cumsum(-1), False),
    "sum": (lambda x: x.sum(-1), False),
    "detached": (lambda x: x.detach() * 2, False),
}


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf")], ids=["finite", "nan", "inf"])
@pytest.mark.parametrize("function", sorted(FUNCTIONS))
def test_is_diagonal(function: str, bad: float | None):
    # A sample that is not finite says nothing; the others decide (a NaN made every function non-diagonal).
    f, expected = FUNCTIONS[function]
    x = torch.randn(3, 5, dtype=F64)
    if bad is not None:
        x[1, 2] = bad
    x.requires_grad_(True)
    assert is_diagonal(f(x * 1), x) is expected


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_is_curved_by_the_finite_samples(bad: float):
    x = torch.randn(3, 5, dtype=F64)
    x[1, 2] = bad
    assert is_curved(TanhGelu(), x) and not is_curved(nn.ReLU(), x)


def test_candidates_have_no_parameters_and_no_children():
    assert may_be_elementwise(Swish()) and not may_be_elementwise(Net(Swish()))
    assert not may_be_elementwise(nn.Linear(2, 2))
    assert type(EpsilonPlus()("act", Swish())) is ElementwiseRule
    assert type(AttnLRP()("act", Swish())).__name__ == "ElementwiseRule"
    assert type(AttnLRP()("act", Swish()).rule) is PseudoIdentityRule
    with pytest.raises(TypeError, match="must be a PassRule"):
        ElementwiseRule(IgnoreRule())


def test_a_module_returning_a_view_of_its_input_keeps_it_and_is_decided():
    class Rows(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.view_as(x)

    rows, rule = Rows(), ElementwiseRule(PassRule())
    x = torch.randn(2, 3, dtype=F64, requires_grad=True)
    with rule.register(rows):
        h = x * 1
        out = rows(h)
        assert rule._registrations[rows].state == {h.shape: False}  # decided, for inputs of this shape
        assert out.untyped_storage().data_ptr() == h.untyped_storage().data_ptr()
        assert rows(h)._base is h  # decided: no alias of the input any more


class GatedByTheMeanToken(nn.Module):
    """``x · tanh(mean of the tokens)``: element-wise on one token, mixing the tokens of a longer sequence."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.tanh(x.mean(1, keepdim=True))


class TokenNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.act, self.head = nn.Linear(3, 4), GatedByTheMeanToken(), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.embed(x)).sum(1))


@pytest.mark.parametrize("preset", ["EpsilonPlus", "CPLRP"])
def test_a_call_on_inputs_of_another_shape_is_decided_anew(preset: str):
    """Decided element-wise on one token, the module kept the pass rule for later calls of the same context on
    longer sequences, which it mixes: 47 % off the relevance a fresh context gives them (with a warning there,
    none in the context)."""
    torch.manual_seed(0)
    net, short, long = TokenNet().double().eval(), torch.randn(2, 1, 3, dtype=F64), torch.randn(2, 4, 3, dtype=F64)
    fresh = LRP(net, PRESETS[preset](), in_keys=["x"], out_keys=["y"], target=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = fresh(TensorDict(x=long, batch_size=[2]))["relevance", "x"]
        lrp = LRP(net, PRESETS[preset](), in_keys=["x"], out_keys=["y"], target=0)
        with lrp:
            lrp(TensorDict(x=short, batch_size=[2]))
            actual = lrp(TensorDict(x=long, batch_size=[2]))["relevance", "x"]
            again = lrp(TensorDict(x=short, batch_size=[2]))["relevance", "x"]
    assert relative_error(actual, expected) <= 1e-12
    first = LRP(net, PRESETS[preset](), in_keys=["x"], out_keys=["y"], target=0)
    assert relative_error(again, first(TensorDict(x=short, batch_size=[2]))["relevance", "x"]) <= 1e-12


class CountedSquash(nn.Module):
    """A hand-written activation that keeps a running mean of its inputs (a buffer) and counts its calls (a plain
    attribute): its state is what its calls made of it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(width, dtype=torch.float64))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        with torch.no_grad():
            self.mean += (x.mean(0) - self.mean) / self.calls
        return torch.tanh(x - self.mean)


@pytest.mark.parametrize("preset", ["EpsilonPlus", "CPLRP"])
def test_the_decision_leaves_the_module_state_as_the_plain_calls_do(preset: str):
    """The decision runs the module's forward again (on the call's input, then on probe points): a module that keeps a
    running mean took those in (the probes' ±16 among them) and counted them as calls."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), CountedSquash(4), nn.Linear(4, 2)).double()
    plain = copy.deepcopy(model)
    inputs = [torch.randn(5, 4, dtype=torch.float64) for _ in range(3)]
    for x in inputs:
        plain(x)
    lrp = LRP(model, {"EpsilonPlus": EpsilonPlus, "CPLRP": CPLRP}[preset](), in_keys=["x"], out_keys=["y"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with lrp:
            for x in inputs:
                lrp(TensorDict(x=x, batch_size=[5]))
    assert model[1].calls == plain[1].calls == 3
    torch.testing.assert_close(model[1].mean, plain[1].mean, rtol=1e-12, atol=1e-12)
