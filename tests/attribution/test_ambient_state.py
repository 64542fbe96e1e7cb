"""The caller's torch state around a call: the same relevance as without it, or an error that names the state.

States that torch keeps per thread or process (autocast, anomaly detection, saved-tensor hooks, the default dtype,
deterministic algorithms, flushed denormals, the caller's own function and dispatch modes, profilers, forked random
state, warning filters, forward-mode AD) are set around a call, around the context's entry only, or around a later
call in an open context. The oracle is the same call without the state (float64), LRP-0 against gradient × input,
and float32 for autocast, to bfloat16 precision.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.autograd.forward_ad as forward_ad
import transformers
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from tdhook.attribution import CPLRP, LRP, AttnLRP, BaseRuleMapper, EpsilonAlpha2Beta1, EpsilonPlus, EpsilonRule
from tests.attribution._helpers import assert_unchanged, state_snapshot
from tests.attribution.test_rule_use import Attending
from tests.conftest import relative_error

F64 = torch.float64


def cnn(dtype: torch.dtype = F64) -> nn.Module:
    """A small CNN with eval-mode BatchNorms whose statistics and affine maps are far from the identity."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 5),
    )  # fmt: skip
    with torch.no_grad():
        for norm in (net[1], net[4]):
            norm.running_mean.normal_()
            norm.running_var.uniform_(0.5, 2.0)
            norm.weight.normal_()
            norm.bias.normal_()
    return net.eval().to(dtype)


def mlp(dtype: torch.dtype = F64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).to(dtype)


class NextToken(nn.Module):
    """A tiny random Llama (hidden 32, two layers) fed ``inputs_embeds``: its next-token logits."""

    def __init__(self, dtype: torch.dtype = F64) -> None:
        super().__init__()
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, attn_implementation="eager",
        )  # fmt: skip
        torch.manual_seed(0)
        self.lm = transformers.LlamaForCausalLM(config).eval().to(dtype)
        with torch.no_grad():
            for name, param in self.lm.named_parameters():
                if param.dim() > 1 and "embed" not in name:
                    param.mul_(3.0)  # attention far from uniform: every rule matters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(inputs_embeds=x).logits[:, -1]


MODELS = {
    "cnn": (cnn, (4, 3, 8, 8), (EpsilonPlus, EpsilonAlpha2Beta1)),
    "mlp": (mlp, (8, 6), (EpsilonPlus, EpsilonAlpha2Beta1)),
    "llama": (NextToken, (2, 7, 32), (CPLRP, AttnLRP)),
}


def model_and_input(name: str, dtype: torch.dtype = F64) -> tuple[nn.Module, torch.Tensor]:
    build, shape, _ = MODELS[name]
    return build(dtype), torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=F64).to(dtype)


def wrapper(net: nn.Module, preset: Callable, **kwargs) -> LRP:
    return LRP(TensorDictModule(net, in_keys=["observation"], out_keys=["y"]), preset(), **kwargs)


def batch(x: torch.Tensor) -> TensorDict:
    return TensorDict(observation=x.clone(), batch_size=x.shape[:1])


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@contextlib.contextmanager
def deterministic_algorithms() -> Iterator[None]:
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


@contextlib.contextmanager
def flushed_denormals() -> Iterator[None]:
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class CountingFunctions(TorchFunctionMode):
    """A caller's own function mode: counts the calls it sees and changes nothing."""

    calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


class CountingKernels(TorchDispatchMode):
    """A caller's own dispatch mode: counts the kernels it sees and changes nothing."""

    calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


STATES: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "detect_anomaly": lambda: torch.autograd.set_detect_anomaly(True, check_nan=True),
    "save_on_cpu": torch.autograd.graph.save_on_cpu,
    "saved_tensors_hooks": lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t),
    "disable_saved_tensors_hooks": lambda: torch.autograd.graph.disable_saved_tensors_hooks("not here"),
    "default_dtype_float32": lambda: default_dtype(torch.float32),
    "deterministic_algorithms": deterministic_algorithms,
    "flush_denormal": flushed_denormals,
    "one_thread": one_thread,
    "no_grad": torch.no_grad,
    "function_mode": CountingFunctions,
    "dispatch_mode": CountingKernels,
    "flop_counter": lambda: FlopCounterMode(display=False),
    "record_function": lambda: torch.autograd.profiler.record_function("caller"),
    "fork_rng": torch.random.fork_rng,
    "dual_level": forward_ad.dual_level,
}


def relevance_under(lrp: LRP, x: torch.Tensor, state: Callable, where: str) -> torch.Tensor:
    """The relevance of a call with ``state`` set around the call, around the context's entry only, or around a
    later call of an open context."""
    if where == "call":
        with state():
            return lrp(batch(x))["relevance", "observation"]
    if where == "entry":
        with contextlib.ExitStack() as stack:
            with state():
                stack.enter_context(lrp)
            return lrp(batch(x))["relevance", "observation"]
    with lrp:
        lrp(batch(x))
        with state():
            return lrp(batch(x))["relevance", "observation"]


@pytest.mark.parametrize("where", ["call", "entry", "later"])
@pytest.mark.parametrize("state", sorted(STATES))
def test_lrp0_is_gradient_times_input_under_the_callers_state(state: str, where: str):
    net, x = model_and_input("mlp")
    x.requires_grad_(True)
    (grad,) = torch.autograd.grad(net(x)[:, 1].sum(), x)
    relevance = relevance_under(wrapper(net, BaseRuleMapper, target=1), x.detach(), STATES[state], where)
    assert relative_error(relevance, grad * x.detach()) <= 1e-12


# The transformer under AttnLRP (the most function rules), with the states that reach the autograd graph or the
# function and dispatch modes, at a later call of an open context: the call that follows the first's plans.
GRAPH_STATES = ("detect_anomaly", "saved_tensors_hooks", "function_mode", "dispatch_mode", "flop_counter", "no_grad")
CASES = [("cnn", where, state) for where in ("call", "entry", "later") for state in sorted(STATES)]
CASES += [("llama", "later", state) for state in (*GRAPH_STATES, "default_dtype_float32")]


@pytest.mark.parametrize(("name", "where", "state"), CASES)
def test_the_callers_state_leaves_the_relevance_as_it_is(name: str, where: str, state: str):
    for preset in MODELS[name][2] if name == "cnn" else (AttnLRP,):
        net, x = model_and_input(name)
        expected = wrapper(net, preset, target=0)(batch(x))["relevance", "observation"]
        snapshot = state_snapshot(net)
        relevance = relevance_under(wrapper(net, preset, target=0), x, STATES[state], where)
        assert relative_error(relevance, expected) <= 1e-12, preset.__name__
        assert_unchanged(net, snapshot)


@pytest.mark.parametrize("where", ["call", "later"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_default_dtype_set_after_building_keeps_a_float32_call_in_float32(name: str, where: str):
    for preset in MODELS[name][2]:
        net, x = model_and_input(name, torch.float32)
        expected = wrapper(net, preset, target=0)(batch(x))["relevance", "observation"]
        relevance = relevance_under(wrapper(net, preset, target=0), x, lambda: default_dtype(F64), where)
        assert relevance.dtype == torch.float32
        assert relative_error(relevance, expected) <= 1e-6, preset.__name__


@pytest.mark.parametrize("where", ["call", "later"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_autocast_agrees_with_float32_to_its_precision(name: str, dtype: torch.dtype, where: str):
    for preset in MODELS[name][2]:
        net, x = model_and_input(name, torch.float32)
        expected = wrapper(net, preset, target=0)(batch(x))["relevance", "observation"]
        relevance = relevance_under(
            wrapper(net, preset, target=0), x, lambda: torch.autocast("cpu", dtype=dtype), where
        )
        assert torch.isfinite(relevance).all()
        assert relative_error(relevance.float(), expected) <= 2e-2, preset.__name__


class Curved(nn.Module):
    """A module whose own forward computes ``sin``: no rule covers it, and the first call warns."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(torch.sin(h) + torch.relu(h))


class TestWarningsTurnedIntoErrors:
    """A warning of the first call that the caller's filter turned into an error (``simplefilter("error")``, pytest's
    ``-W error``) left the call counted as watched: no later call warned, and ``coverage()`` reported every call
    covered while a ``sin`` kept its plain gradient. The next call now warns, and ``coverage()`` lists the call."""

    CASES = {
        "plain gradient": (Curved, EpsilonPlus, (5, 6), "computes sin in its own forward"),
        "rule without effect": (
            Attending,
            lambda: BaseRuleMapper(rule_mapper={nn.Linear: EpsilonRule(0.1)}),
            (2, 5, 8),
            "has no effect",
        ),
    }

    @staticmethod
    def calls(case: str, error_first: bool, in_context: bool) -> tuple[list[str], object, nn.Module]:
        build, mapper, shape, _ = TestWarningsTurnedIntoErrors.CASES[case]
        torch.manual_seed(0)
        net = build().double().eval()
        lrp = LRP(net, mapper(), in_keys=["x"], out_keys=["y"], target=0)
        td = TensorDict(x=torch.randn(shape, dtype=F64), batch_size=shape[:1])
        snapshot = state_snapshot(net)
        with lrp if in_context else contextlib.nullcontext():
            if error_first:
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    with pytest.raises(UserWarning):
                        lrp(td)
                assert list(td.keys()) == ["x"]  # no partial result
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                lrp(td)
            coverage = lrp.coverage()
        assert_unchanged(net, snapshot)
        return [str(w.message) for w in caught], coverage, net

    @pytest.mark.parametrize("in_context", [True, False])
    @pytest.mark.parametrize("case", sorted(CASES))
    def test_the_next_call_warns_as_a_first_call_does(self, case: str, in_context: bool):
        expected, expected_coverage, _ = self.calls(case, error_first=False, in_context=in_context)
        messages, coverage, _ = self.calls(case, error_first=True, in_context=in_context)
        phrase = self.CASES[case][3]
        assert [m for m in expected if phrase in m] != []
        assert [m for m in messages if phrase in m] == [m for m in expected if phrase in m]
        assert coverage.plain_gradient == expected_coverage.plain_gradient


class TestForwardModeDualInputs:
    """A forward-mode dual input: with ``create_graph=True`` (differentiable results) its tangent was silently
    dropped, the outputs and relevance carrying none (a zero directional derivative); it is refused naming the
    key. Without it, results are written detached, as for reverse mode, and the relevance is that of the primal."""

    @pytest.mark.parametrize("name", sorted(MODELS))
    def test_refused_naming_the_key_with_create_graph(self, name: str):
        net, x = model_and_input(name)
        snapshot = state_snapshot(net)
        lrp = wrapper(net, MODELS[name][2][0], create_graph=True)
        with forward_ad.dual_level():
            td = TensorDict(observation=forward_ad.make_dual(x, torch.ones_like(x)), batch_size=x.shape[:1])
            with pytest.raises(NotImplementedError, match=r"input key 'observation' is a forward-mode dual tensor"):
                lrp(td)
            assert list(td.keys()) == ["observation"]
        assert_unchanged(net, snapshot)

    @pytest.mark.parametrize("name", sorted(MODELS))
    def test_without_create_graph_the_relevance_is_the_primals(self, name: str):
        net, x = model_and_input(name)
        expected = wrapper(net, MODELS[name][2][0], target=0)(batch(x))["relevance", "observation"]
        with forward_ad.dual_level():
            dual = forward_ad.make_dual(x, torch.ones_like(x))
            relevance = wrapper(net, MODELS[name][2][0], target=0)(observation=dual)[-1]
            assert forward_ad.unpack_dual(relevance).tangent is None  # written detached
        assert relative_error(relevance, expected) <= 1e-12
