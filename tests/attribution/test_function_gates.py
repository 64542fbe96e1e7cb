"""Gates computed by functions in models with no sigmoid module: held (signal-take-all) from the first call on.

The oracle is the closed form of signal-take-all: for ``z = a * sigmoid(W2 a)`` with ``a = W1 x`` and relevance
``R`` at ``z``, the gate gets nothing and ``R_x = x ⊙ W1ᵀ (R / a)``; and, for networks, the same network with its
gate detached by hand.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import CPLRP, LRP, AttnLRP, BaseRuleMapper, EpsilonGammaBox, EpsilonPlus, EpsilonPlusFlat
from tdhook.attribution._function_gates import FunctionGates
from tests.conftest import relative_error

F64 = torch.float64
GATES = {"torch.sigmoid": torch.sigmoid, "Tensor.sigmoid": torch.Tensor.sigmoid, "F.hardsigmoid": F.hardsigmoid}


class FunctionGated(nn.Module):
    """``a * gate(fc(a))`` with ``a = inp(x)``, no bias: the gate is a function call, no module."""

    def __init__(self, gate=torch.sigmoid, held: bool = False) -> None:
        super().__init__()
        self.inp, self.fc = nn.Linear(4, 6, bias=False), nn.Linear(6, 6, bias=False)
        self.gate, self.held = gate, held

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.inp(x)
        gate = self.gate(self.fc(a) * 2)
        return a * (gate.detach() if self.held else gate)


class FunctionSqueezeExcite(nn.Module):
    """A convolution net whose squeeze-excite gate is ``torch.sigmoid``; ``held``: detached by hand (the oracle)."""

    def __init__(self, held: bool = False) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.reduce, self.expand = nn.Conv2d(8, 4, 1), nn.Conv2d(4, 8, 1)
        self.head = nn.Sequential(nn.Conv2d(8, 6, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 3))
        self.held = held

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        gate = torch.sigmoid(self.expand(torch.relu(self.reduce(h.mean((2, 3), keepdim=True)))))
        return self.head(h * (gate.detach() if self.held else gate))


def explain_twice(model: nn.Module, x: torch.Tensor, mapper, relevance_out: torch.Tensor | None = None):
    """The relevance of a first and a second call of one wrapper, and the warnings of the first."""
    target = None if relevance_out is None else (lambda y: relevance_out)
    lrp = LRP(model, mapper, in_keys=["x"], out_keys=["y"], target=target)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = lrp(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))["relevance", "x"]
    second = lrp(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))["relevance", "x"]
    return first, second, [str(w.message) for w in caught if "no rule covers it" in str(w.message)]


class TestClosedForm:
    @pytest.mark.parametrize("gate", sorted(GATES))
    def test_signal_takes_all(self, gate: str):
        torch.manual_seed(0)
        model = FunctionGated(GATES[gate]).double()
        x, relevance_out = torch.randn(5, 4, dtype=F64), torch.randn(5, 6, dtype=F64)
        a = model.inp(x).detach()
        expected = x * ((relevance_out / a) @ model.inp.weight.detach())
        first, second, messages = explain_twice(model, x, BaseRuleMapper(stabilizer=1e-12), relevance_out)
        assert relative_error(first, expected) <= 1e-10
        assert relative_error(second, expected) <= 1e-10
        assert messages == []


class TestSqueezeExciteWrittenWithFunctions:
    @pytest.mark.parametrize("mapper", [EpsilonPlus, EpsilonPlusFlat, lambda: EpsilonGammaBox(-3.0, 3.0)])
    def test_equals_the_gate_detached_by_hand_on_every_call(self, mapper):
        torch.manual_seed(1)
        model = FunctionSqueezeExcite().double().eval()
        oracle = FunctionSqueezeExcite(held=True).double().eval()
        oracle.load_state_dict(model.state_dict())
        x = torch.randn(2, 3, 6, 6, dtype=F64).clamp(-2.9, 2.9)
        expected, _, _ = explain_twice(oracle, x, mapper())
        first, second, _ = explain_twice(model, x, mapper())
        assert relative_error(first, expected) <= 1e-12
        assert relative_error(second, expected) <= 1e-12


class ModeSpy(nn.Module):
    """Records whether a torch function mode is on while the model runs."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body, self.modes_on = body, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.modes_on.append(torch._C._is_torch_function_mode_enabled())
        return self.body(x)


class TestLaterCalls:
    def test_a_model_without_gates_runs_its_later_calls_without_a_mode(self):
        spy = ModeSpy(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))).double()
        explain_twice(spy, torch.randn(3, 4, dtype=F64), EpsilonPlus())
        assert spy.modes_on == [True, False]  # the first call is watched; the second runs plain (torch.compile)

    def test_a_model_with_function_gates_keeps_them_held(self):
        spy = ModeSpy(FunctionGated()).double()
        explain_twice(spy, torch.randn(3, 4, dtype=F64), EpsilonPlus())
        assert spy.modes_on == [True, True]

    def test_a_model_that_clips_with_a_function_keeps_the_mode(self):
        # A clip called as a function gets the pass rule of nn.Hardtanh from the mode: later calls keep it.
        body = nn.Sequential(nn.Linear(4, 6), ClipCall(), nn.Linear(6, 2))
        spy = ModeSpy(body).double()
        explain_twice(spy, torch.randn(3, 4, dtype=F64) * 3, EpsilonPlus())
        assert spy.modes_on == [True, True]

    def test_a_model_with_clipping_modules_runs_its_later_calls_without_a_mode(self):
        # nn.Hardtanh and nn.ReLU6 have the pass rule of their own, which takes the gradient past the F.hardtanh
        # inside: the mode passing that call is no reason to run later calls in it.
        body = nn.Sequential(nn.Linear(4, 6), nn.Hardtanh(), nn.Linear(6, 6), nn.ReLU6(), nn.Linear(6, 2))
        spy = ModeSpy(body).double()
        explain_twice(spy, torch.randn(3, 4, dtype=F64) * 3, EpsilonPlus())
        assert spy.modes_on == [True, False]

    @pytest.mark.parametrize("target_key", ["loc", "scale"])
    def test_a_clip_only_an_unexplained_output_reads_is_no_reason_for_the_mode(self, target_key: str):
        # NormalParamExtractor keeps the scale of a Gaussian policy away from zero with clamp_min: explained at its
        # loc, later calls run without the mode, as before; explained at the scale, the clip's pass rule needs it.
        from tensordict.nn import NormalParamExtractor, TensorDictModule

        spy = ModeSpy(nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 4), NormalParamExtractor())).double()
        lrp = LRP(TensorDictModule(spy, in_keys=["x"], out_keys=["loc", "scale"]), EpsilonPlus(), target_key=target_key)
        for _ in range(2):
            lrp(TensorDict(x=torch.randn(3, 4, dtype=F64) * 3, batch_size=[3]))
        assert spy.modes_on == [True, target_key == "scale"]


class ClipCall(nn.Module):
    """A Linear layer's output clipped by a function in a module with a parameter (so no rule of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.clamp(h * self.scale, -1.0, 1.0)


class SigmoidMLP(nn.Module):
    """A sigmoid as an MLP's activation, computed by the model's own forward: no gate."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 6), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.sigmoid(self.fc1(x)))


def test_a_sigmoid_that_gates_nothing_is_still_reported():
    _, _, messages = explain_twice(SigmoidMLP().double(), torch.randn(3, 4, dtype=F64), EpsilonPlus())
    assert len(messages) == 1 and "computes sigmoid" in messages[0]


def test_decided_by_a_completed_forward_pass_only():
    gates = FunctionGates()
    assert len(gates.modes(EpsilonPlus(), [])) == 1 and gates.found is None
    assert len(gates.modes(EpsilonPlus(), [])) == 1  # the first pass raised: the next one decides
    gates.settle()
    assert gates.found is False and gates.modes(EpsilonPlus(), []) == []
    assert gates.modes(lambda name, module: None, []) == []  # a plain mapper chooses every rule itself


# Gates at exact zeros: ``F.hardsigmoid`` saturates to exactly 0 and 1, the signal behind a ReLU is exactly 0 in
# places, and a gate of the signal itself (``a * sigmoid(a)``) meets it at 0. Held, the gate passes no ratio: the
# signal's relevance is ``a · g · ∂R`` = the product's, so nothing is lost wherever either factor is 0.
SATURATING_GATES = {
    "F.hardsigmoid": lambda a, s: a * F.hardsigmoid(s),
    "Tensor.mul": lambda a, s: a.mul(F.hardsigmoid(s)),
    "gate first": lambda a, s: F.hardsigmoid(s) * a,
    "torch.sigmoid": lambda a, s: a * torch.sigmoid(s),
    "of the signal": lambda a, s: a * torch.sigmoid(a),
    "hard of the signal": lambda a, s: a * F.hardsigmoid(a * 4),
    "F.glu": lambda a, s: F.glu(torch.cat([a, s], -1), -1),
}
GATED_PRESETS = {
    "CPLRP": lambda: CPLRP(stabilizer=1e-15),
    "AttnLRP": lambda: AttnLRP(stabilizer=1e-15),
    "LRP-0": lambda: BaseRuleMapper(stabilizer=0.0),
    "EpsilonPlus": lambda: EpsilonPlus(epsilon=1e-15, stabilizer=1e-15),
}


class SaturatedGate(nn.Module):
    """``head(gate(a, 8 · fc(a)))`` with ``a = relu(inp(x))``, no biases; ``held``: the gate's factor detached by
    hand, each gate written as the product of its signal and a gate that a context holds."""

    def __init__(self, gate: str, held: bool = False) -> None:
        super().__init__()
        self.inp, self.fc, self.head = nn.Linear(4, 6, bias=False), nn.Linear(6, 6, bias=False), nn.Linear(6, 3, False)
        self.gate, self.held = gate, held

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.inp(x))
        s = self.fc(a) * 8
        if not self.held:
            return self.head(SATURATING_GATES[self.gate](a, s))
        gate = {"of the signal": torch.sigmoid(a), "hard of the signal": F.hardsigmoid(a * 4)}.get(self.gate)
        if gate is None:
            gate = torch.sigmoid(s) if self.gate in ("torch.sigmoid", "F.glu") else F.hardsigmoid(s)
        return self.head(a * gate.detach())


@pytest.mark.parametrize("preset", sorted(GATED_PRESETS))
@pytest.mark.parametrize("gate", sorted(SATURATING_GATES))
def test_a_held_gate_at_exact_zeros_is_the_gate_detached_by_hand(gate: str, preset: str):
    # Oracle: gradient × input of the model with its gate detached by hand (every layer is LRP-0 here, ReLU passes
    # the gradient), and conservation, all biases being zero. F.hardsigmoid called as a function kept its plain
    # gradient under CP-LRP and AttnLRP (0.87 off, with a warning that named it), where nn.Hardsigmoid is held.
    torch.manual_seed(0)
    model, oracle = SaturatedGate(gate).double(), SaturatedGate(gate, held=True).double()
    oracle.load_state_dict(model.state_dict())
    x = torch.randn(6, 4, dtype=F64)
    with torch.no_grad():
        a = torch.relu(model.inp(x))
        s = model.fc(a) * 8
    assert bool((a == 0).any()) and bool((F.hardsigmoid(s) == 0).any()) and bool((F.hardsigmoid(s) == 1).any())
    lrp = LRP(model, GATED_PRESETS[preset](), in_keys=["x"], out_keys=["y"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with lrp:
            first, second = (lrp(TensorDict(x=x.clone(), batch_size=[6])) for _ in range(2))
    leaf = x.clone().requires_grad_(True)
    out = oracle(leaf)
    logit = out.gather(-1, out.argmax(-1, keepdim=True)).sum()
    expected = x * torch.autograd.grad(logit, leaf)[0]
    for td in (first, second):
        assert relative_error(td["relevance", "x"], expected) <= 1e-12
        torch.testing.assert_close(td["relevance", "x"].sum(-1), td["y"].max(-1).values, rtol=1e-10, atol=1e-12)


# A forward that branches on a flag of the model (or on its input's values), at one call signature: the first call
# took the first branch, a later call of the same signature the second. ``a = relu(inp(x))``, ``s = fc(a)``.
BRANCHES = {
    "tanh": lambda a, s: a * torch.tanh(s),  # no gate: the product keeps its plain gradient
    "sigmoid": lambda a, s: a * torch.sigmoid(s),  # a gate, with as many nodes as the tanh
    "sum": lambda a, s: a + s,
    "clip": lambda a, s: a + torch.clamp(s, -0.3, 0.3),  # the pass rule of nn.Hardtanh
    "normalize": lambda a, s: a + F.normalize(s, dim=-1),  # its norm held
}
SWITCHES = [("tanh", "sigmoid"), ("sum", "sigmoid"), ("sum", "clip"), ("sum", "normalize")]
SWITCHED_PRESETS = {
    "EpsilonPlus": lambda: EpsilonPlus(epsilon=1e-15, stabilizer=1e-15),
    "LRP-0": lambda: BaseRuleMapper(stabilizer=0.0),
}


class Switched(nn.Module):
    """``head(BRANCHES[branch](a, fc(a)))`` with ``a = relu(inp(x))``, no biases: ``branch`` a flag of the model,
    which no call signature shows; ``noisy``: the output draws noise, and a buffer counts the forward passes."""

    def __init__(self, branch: str, noisy: bool = False) -> None:
        super().__init__()
        self.inp, self.fc, self.head = nn.Linear(4, 6, bias=False), nn.Linear(6, 6, bias=False), nn.Linear(6, 3, False)
        self.branch, self.noisy = branch, noisy
        self.register_buffer("passes", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.inp(x))
        y = self.head(BRANCHES[self.branch](a, self.fc(a)))
        if self.noisy:
            self.passes += 1
            y = y + 0.1 * torch.randn_like(y)
        return y


def first_then(model: nn.Module, mapper, x: torch.Tensor, switch, in_context: bool) -> TensorDict:
    """A first call of a wrapper of ``model``, then ``switch(model)``, then the call explained (within one context,
    or each call entering its own)."""
    lrp = LRP(model, mapper, in_keys=["x"], out_keys=["y"])

    def call() -> TensorDict:
        return lrp(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tanh's product, which no rule covers
        if not in_context:
            call()
            switch(model)
            return call()
        with lrp:
            call()
            switch(model)
            return call()


def fresh_call(model: nn.Module, mapper, x: torch.Tensor) -> TensorDict:
    """The first call of a fresh wrapper: probed, the oracle of a later call that takes the same branch."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LRP(model, mapper, in_keys=["x"], out_keys=["y"])(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))


@pytest.mark.parametrize("in_context", [True, False], ids=["in a context", "a context per call"])
@pytest.mark.parametrize("preset", sorted(SWITCHED_PRESETS))
@pytest.mark.parametrize("switch", SWITCHES, ids=[f"{a} to {b}" for a, b in SWITCHES])
def test_a_branch_switched_by_a_flag_gets_the_rules_of_a_fresh_call(switch, preset: str, in_context: bool):
    # Before, a later call of the first call's signature ran without the gates' mode where the first had no gate,
    # clip or norm: the gate switched on kept its plain gradient (0.12 off a fresh call, relative L2, under
    # EpsilonPlus for tanh to sigmoid), and so did the clip and the norm, with no word.
    before, after = switch
    torch.manual_seed(0)
    model, oracle = Switched(before).double(), Switched(after).double()
    oracle.load_state_dict(model.state_dict())
    x = torch.randn(6, 4, dtype=F64)
    expected = fresh_call(oracle, SWITCHED_PRESETS[preset](), x)
    out = first_then(model, SWITCHED_PRESETS[preset](), x, lambda m: setattr(m, "branch", after), in_context)
    torch.testing.assert_close(out["y"], expected["y"], rtol=0, atol=0)
    assert relative_error(out["relevance", "x"], expected["relevance", "x"]) <= 1e-12
    if after != "clip":  # the gate and the norm held, no biases: the explained logit is conserved
        torch.testing.assert_close(out["relevance", "x"].sum(-1), out["y"].max(-1).values, rtol=1e-10, atol=1e-12)


def test_a_call_run_again_starts_from_the_state_the_first_run_found():
    # The run let go moved the model's buffer and drew from the global random state: the call run again in the
    # probe draws the same noise, and the caller's state moves as by one plain call.
    torch.manual_seed(0)
    model, oracle = Switched("sum", noisy=True).double(), Switched("sigmoid", noisy=True).double()
    oracle.load_state_dict(model.state_dict())
    x = torch.randn(6, 4, dtype=F64)
    torch.manual_seed(1)
    expected, expected_draw = fresh_call(oracle, EpsilonPlus(), x), torch.rand(3)
    lrp = LRP(model, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
    with lrp:
        lrp(TensorDict(x=x.clone(), batch_size=[6]))
        model.branch = "sigmoid"
        torch.manual_seed(1)
        out = lrp(TensorDict(x=x.clone(), batch_size=[6]))
        draw = torch.rand(3)
    assert torch.equal(out["y"], expected["y"]) and torch.equal(draw, expected_draw)
    assert relative_error(out["relevance", "x"], expected["relevance", "x"]) <= 1e-12
    assert int(model.passes) == 2  # once per call


def test_a_model_whose_graph_does_not_change_runs_once_per_call_without_a_mode():
    spy = ModeSpy(Switched("tanh")).double()
    lrp = LRP(spy, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            lrp(TensorDict(x=torch.randn(5, 4, dtype=F64), batch_size=[5]))
        spy.body.branch = "sigmoid"
        lrp(TensorDict(x=torch.randn(5, 4, dtype=F64), batch_size=[5]))
        lrp(TensorDict(x=torch.randn(5, 4, dtype=F64), batch_size=[5]))
    # The probe, two plain calls; the switched call plain, then again in the probe, which finds the gate: held after.
    assert spy.modes_on == [True, False, False, False, True, True]


class Repeated(nn.Module):
    """A layer applied ``self.times`` times (a loop on a flag or a value), then ``a * tanh(fc(a))``, no gate."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.fc = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
        self.times = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x
        for _ in range(self.times):
            a = torch.relu(self.inp(a))
        return a * torch.tanh(self.fc(a))


def test_a_signature_whose_graph_takes_many_shapes_keeps_the_mode():
    spy = ModeSpy(Repeated()).double()
    lrp = LRP(spy, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
    x = torch.randn(5, 4, dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for times in range(1, 12):
            spy.body.times = times
            lrp(TensorDict(x=x.clone(), batch_size=[5]))
        spy.body.times = 3  # a shape seen before: no run again
        lrp(TensorDict(x=x.clone(), batch_size=[5]))
    # Eight shapes with no gate (one probed, seven plain calls run again in the probe), then the mode at every call.
    assert spy.modes_on == [True] + [False, True] * 7 + [False, True, True, True, True]


class SwitchedTokens(nn.Module):
    """Token ids embedded, then :class:`Switched`'s branch on the mean embedding."""

    def __init__(self, branch: str) -> None:
        super().__init__()
        self.words = nn.Embedding(11, 4)
        self.body = Switched(branch)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.body(self.words(tokens).mean(1))


def test_token_ids_and_layers_are_explained_in_a_call_run_again():
    # The run let go embedded the tokens and watched the layer: the call run again embeds and watches anew.
    torch.manual_seed(0)
    model, oracle = SwitchedTokens("tanh").double(), SwitchedTokens("sigmoid").double()
    oracle.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 11, (4, 5))

    def wrapper(net: nn.Module) -> LRP:
        return LRP(net, EpsilonPlus(), in_keys=["tokens"], out_keys=["y"], layers=["body.inp"])

    lrp, fresh = wrapper(model), wrapper(oracle)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = fresh(TensorDict(tokens=tokens, batch_size=[4]))
        with lrp:
            lrp(TensorDict(tokens=tokens, batch_size=[4]))
            model.body.branch = "sigmoid"
            out = lrp(TensorDict(tokens=tokens, batch_size=[4]))
    for key in [("relevance", "tokens"), ("relevance", "body.inp")]:
        assert relative_error(out[key], expected[key]) <= 1e-12, key


class ValueBranch(Switched):
    """:class:`Switched` whose branch follows its input's values: a gate where their mean is positive."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.branch = "sigmoid" if bool(x.mean() > 0) else "tanh"
        return super().forward(x)


def test_a_branch_on_the_inputs_values_gets_the_rules_of_a_fresh_call():
    torch.manual_seed(0)
    model, mapper = ValueBranch("tanh").double(), SWITCHED_PRESETS["EpsilonPlus"]
    x = torch.randn(6, 4, dtype=F64)
    x = x - x.mean() + 0.5  # the gated branch; -x takes the other
    expected = fresh_call(model, mapper(), x)
    lrp = LRP(model, mapper(), in_keys=["x"], out_keys=["y"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with lrp:
            lrp(TensorDict(x=-x, batch_size=[6]))
            out = lrp(TensorDict(x=x.clone(), batch_size=[6]))
    assert relative_error(out["relevance", "x"], expected["relevance", "x"]) <= 1e-12
    torch.testing.assert_close(out["relevance", "x"].sum(-1), out["y"].max(-1).values, rtol=1e-10, atol=1e-12)


def test_a_lazy_stack_whose_branch_switched_gets_the_rules_of_a_fresh_call():
    # The entries of a lazy stack are not kept to run the model again: its calls keep the gates' mode.
    from tensordict import LazyStackedTensorDict

    torch.manual_seed(0)
    model, oracle = Switched("sum").double(), Switched("sigmoid").double()
    oracle.load_state_dict(model.state_dict())
    x = torch.randn(6, 4, dtype=F64)

    def stacked() -> LazyStackedTensorDict:
        return LazyStackedTensorDict(*[TensorDict(x=row.clone()) for row in x])

    expected = LRP(oracle, EpsilonPlus(), in_keys=["x"], out_keys=["y"])(stacked())
    lrp = LRP(model, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
    with lrp:
        lrp(stacked())
        model.branch = "sigmoid"
        out = lrp(stacked())
    assert relative_error(out["relevance", "x"], expected["relevance", "x"]) <= 1e-12
