"""Property-based tests over randomly built MLPs and CNNs (hypothesis).

For every drawn architecture (depth, widths, activations, pooling, BatchNorm,
residual additions), in float64:

* LRP-0 equals gradient × input;
* with zero biases (and BatchNorm without shift), relevance is conserved: the
  input relevance sums to the explained output;
* a ``[B, T]`` batch gives the same relevance as the flat ``[B·T]`` batch;
* the model is left exactly as it was;
* an exception or ``KeyboardInterrupt`` raised by a hook at a random module,
  under a random preset, inside a context or not, leaves the parameters and
  buffers bit for bit, no hook, and torch's global state (grad mode, torch
  function switches, the function-mode stack) as before, and the wrapper
  usable.

The examples are derandomised, so CI runs the same ones every time.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.rules import (
    BaseRuleMapper,
    EpsilonAlpha2Beta1,
    EpsilonGammaBox,
    EpsilonPlus,
    EpsilonPlusFlat,
    IgnoreRule,
)
from tests.attribution._helpers import gradient_times_input
from tests.attribution.test_lrp_faults import global_state, module_state
from tests.attribution.test_lrp_reliability import assert_model_unchanged, model_snapshot
from tests.conftest import relative_error

F64 = torch.float64
PROPERTY = settings(max_examples=40, deadline=None, derandomize=True)
ACTIVATIONS = {"relu": nn.ReLU, "leaky": lambda: nn.LeakyReLU(0.1), "tanh": nn.Tanh, "none": nn.Identity}
PIECEWISE_LINEAR = ["relu", "leaky", "none"]  # where LRP-0 (Pass on activations) is exactly the gradient


class Residual(nn.Module):
    """``x + conv(act(conv(x)))``, shape-preserving."""

    def __init__(self, channels: int, activation: str) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1), ACTIVATIONS[activation](), nn.Conv2d(channels, channels, 1)
        )

    def forward(self, x):
        return x + self.body(x)


@st.composite
def mlps(draw, activations=tuple(ACTIVATIONS)) -> tuple[nn.Module, int]:
    widths = draw(st.lists(st.integers(2, 10), min_size=1, max_size=3))
    features = draw(st.integers(1, 6))
    layers, previous = [], features
    for width in widths:
        layers += [nn.Linear(previous, width), ACTIVATIONS[draw(st.sampled_from(activations))]()]
        previous = width
    layers.append(nn.Linear(previous, draw(st.integers(1, 4))))
    torch.manual_seed(draw(st.integers(0, 2**16)))
    return nn.Sequential(*layers).to(F64).eval(), features


@st.composite
def cnns(draw, activations=tuple(ACTIVATIONS)) -> nn.Module:
    channels = draw(st.integers(1, 4))
    layers: list[nn.Module] = [nn.Conv2d(2, channels, draw(st.sampled_from([1, 3])), padding=1)]
    for _ in range(draw(st.integers(0, 2))):
        block = draw(st.sampled_from(["batchnorm", "activation", "residual", "maxpool", "avgpool"]))
        activation = draw(st.sampled_from(activations))
        if block == "batchnorm":
            layers.append(nn.BatchNorm2d(channels))
        elif block == "activation":
            layers.append(ACTIVATIONS[activation]())
        elif block == "residual":
            layers.append(Residual(channels, activation))
        elif block == "maxpool":
            layers.append(nn.MaxPool2d(2, ceil_mode=True))
        else:
            layers.append(nn.AvgPool2d(2, ceil_mode=True))
    layers += [ACTIVATIONS[draw(st.sampled_from(activations))](), nn.AdaptiveAvgPool2d(2), nn.Flatten()]
    layers.append(nn.Linear(4 * channels, draw(st.integers(1, 4))))
    torch.manual_seed(draw(st.integers(0, 2**16)))
    model = nn.Sequential(*layers).to(F64).eval()
    with torch.no_grad():
        for norm in (m for m in model.modules() if isinstance(m, nn.BatchNorm2d)):
            norm.running_mean.normal_()
            norm.running_var.uniform_(0.5, 2.0)
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.normal_()
    return model


def explain(model: nn.Module, x: torch.Tensor, mapper, batch_dims: int = 1) -> TensorDict:
    lrp = LRP(model, mapper, in_keys=["x"], out_keys=["y"])
    return lrp(TensorDict(x=x, batch_size=x.shape[:batch_dims]))


def lrp0() -> BaseRuleMapper:
    # LRP-0 everywhere: the default mapper, with average pooling's ε stabilizer replaced by the plain gradient.
    return BaseRuleMapper(rule_mapper={nn.AvgPool2d: IgnoreRule(), nn.AdaptiveAvgPool2d: IgnoreRule()})


def without_shift(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.zero_()
    return model


@PROPERTY
@given(st.one_of(mlps(PIECEWISE_LINEAR), cnns(PIECEWISE_LINEAR).map(lambda m: (m, None))), st.integers(1, 4))
def test_lrp0_is_gradient_times_input(drawn, batch):
    model, features = drawn
    x = torch.randn(batch, features, dtype=F64) if features else torch.randn(batch, 2, 5, 5, dtype=F64)
    relevance = explain(model, x, lrp0())["relevance", "x"]
    # Exact but for PassRule's stabilizer on LeakyReLU (its ratio f(x)/x is taken at x + 1e-12).
    assert relative_error(relevance, gradient_times_input(model, x)) <= 1e-8


@PROPERTY
@given(st.one_of(mlps(), cnns().map(lambda m: (m, None))), st.integers(1, 4))
def test_relevance_is_conserved_without_biases(drawn, batch):
    model, features = drawn
    model = without_shift(model)
    x = torch.randn(batch, features, dtype=F64) if features else torch.randn(batch, 2, 5, 5, dtype=F64)
    td = explain(model, x, lrp0())
    explained = td["y"].max(-1).values
    total = td["relevance", "x"].flatten(1).sum(1)
    torch.testing.assert_close(total, explained, rtol=1e-8, atol=1e-10)


@PROPERTY
@given(mlps(), st.integers(1, 3), st.integers(1, 3), st.sampled_from(["EpsilonPlus", "EpsilonPlusFlat"]))
def test_batch_time_equals_flat_batch_and_model_is_restored(drawn, batch, time, preset):
    model, features = drawn
    mapper = {"EpsilonPlus": EpsilonPlus, "EpsilonPlusFlat": EpsilonPlusFlat}[preset]
    x = torch.randn(batch, time, features, dtype=F64)
    before = model_snapshot(model)
    nested = explain(model, x, mapper(), batch_dims=2)["relevance", "x"]
    flat = explain(model, x.reshape(batch * time, features), mapper())["relevance", "x"]
    torch.testing.assert_close(nested.reshape(batch * time, features), flat, rtol=1e-12, atol=1e-14)
    assert_model_unchanged(model, before)


FAULT_PRESETS = {
    "LRP-0": lrp0,
    "EpsilonPlus": EpsilonPlus,
    "EpsilonPlusFlat": EpsilonPlusFlat,
    "EpsilonGammaBox": lambda: EpsilonGammaBox(-3.0, 3.0),
    "EpsilonAlpha2Beta1": EpsilonAlpha2Beta1,
}


class Fault(Exception):
    """Raised by the test's hook at the drawn module."""


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    st.one_of(mlps().map(lambda drawn: drawn[0]), cnns()),
    st.sampled_from(sorted(FAULT_PRESETS)),
    st.integers(0, 10**6),
    st.sampled_from(["forward hook", "pre-hook", "interrupt"]),
    st.booleans(),
)
def test_a_fault_at_a_random_module_leaves_model_and_torch_state_as_before(model, preset, where, kind, inside):
    modules = list(model.modules())
    target = modules[where % len(modules)]
    features = model[0].in_features if isinstance(model[0], nn.Linear) else None
    x = torch.randn((3, features) if features else (3, 2, 5, 5), dtype=F64)
    lrp = LRP(model, FAULT_PRESETS[preset](), in_keys=["x"], out_keys=["y"])
    expected = lrp(TensorDict(x=x, batch_size=[3]))["relevance", "x"]
    state, params, torch_state = model.state_dict(), module_state(model), global_state()
    state = {k: v.clone() for k, v in state.items()}
    error = KeyboardInterrupt if kind == "interrupt" else Fault

    def hook(*args):
        raise error

    handle = target.register_forward_pre_hook(hook) if kind == "pre-hook" else target.register_forward_hook(hook)
    td = TensorDict(x=x, batch_size=[3])
    try:
        with pytest.raises(error):
            if inside:
                with lrp:
                    lrp(td)
            else:
                lrp(td)
    finally:
        handle.remove()
    assert global_state() == torch_state
    assert module_state(model) == params  # hooks, forward methods, parameter and buffer identities and versions
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert set(td.keys()) == {"x"}
    # The wrapper is still usable and gives what it gave before.
    torch.testing.assert_close(lrp(TensorDict(x=x, batch_size=[3]))["relevance", "x"], expected, rtol=0, atol=0)
