"""``push``, ``pop`` and ``closing_scopes``: what a hook pair enters is left on every exit path of a call, an
interrupt at any of their lines included."""

from __future__ import annotations

import linecache
import sys

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torch.overrides import TorchFunctionMode

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.rules import EpsilonPlus
from tdhook.attribution.rules._scopes import _stack, closing_scopes, pop, push
from tests.attribution._interrupts import Interrupt, every_line

F64 = torch.float64


class Counting(TorchFunctionMode):
    """A function mode that counts the calls it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def torch_function_state() -> tuple:
    return (
        torch._C._is_torch_function_enabled(),
        [type(mode).__name__ for mode in torch.overrides._get_current_function_mode_stack()],
    )


def hook_pairs(pending: list) -> None:
    """What the hooks of three module calls do: a mode and a guard pushed and popped, then a mode pushed that the
    call's end leaves (a forward that raised)."""
    with closing_scopes():
        push(pending, Counting(), enter=True)
        push(pending, torch._C.DisableTorchFunction(), enter=True)
        push(pending, None)
        pop(pending)
        pop(pending)
        pop(pending)
        push(pending, Counting(), enter=True)


def test_what_a_call_pushed_and_did_not_pop_is_left_when_it_ends():
    pending, before = [], torch_function_state()
    hook_pairs(pending)
    assert pending == [] and torch_function_state() == before


def test_an_interrupt_at_any_line_of_push_pop_and_closing_scopes_leaves_no_mode_or_guard_on():
    """An interrupt between entering a mode (or a ``DisableTorchFunction`` guard) and listing it, or between
    unlisting and leaving it, left it on for the rest of the process: a plain gradient computed under the norm
    rule's mode after that was 0.22 off. Every line of the three is interrupted here (including those of the
    closing itself: the rest is closed all the same)."""
    before = torch_function_state()
    lines = every_line(lambda: hook_pairs([]), stride=1, within="_scopes.py")
    assert len(lines) > 20
    for at in lines:
        pending = []
        with Interrupt(at, within="_scopes.py") as interrupt:
            hook_pairs(pending)
        assert interrupt.where is not None and "_scopes.py" in interrupt.where
        assert torch_function_state() == before, interrupt.where
        assert pending == [], interrupt.where
    assert _stack() == []


def norm_model() -> tuple[LRP, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 3)).double()
    return LRP(TensorDictModule(net, in_keys=["x"], out_keys=["y"]), EpsilonPlus()), net, torch.randn(4, 5, dtype=F64)


@pytest.mark.parametrize("in_context", [False, True])
def test_an_interrupt_in_a_norm_rules_scope_leaves_later_plain_gradients_exact(in_context: bool):
    """The norm rule's mode is pushed in the LayerNorm's pre-hook and popped in its forward hook: an interrupt in
    either, at any line of ``_scopes.py``, leaves the model's plain gradient and the relevance as they were."""
    lrp, net, x = norm_model()
    expected = lrp(TensorDict(x=x, batch_size=[4]))["relevance", "x"]
    leaf = x.clone().requires_grad_(True)
    (gradient,) = torch.autograd.grad(net(leaf)[:, 0].sum(), leaf)
    before = torch_function_state()
    if in_context:
        lrp.__enter__()
        lrp(TensorDict(x=x, batch_size=[4]))

    def call() -> None:
        lrp(TensorDict(x=x, batch_size=[4]))

    lines = every_line(call, stride=1, within="_scopes.py")
    assert len(lines) > 10
    for at in lines:
        with Interrupt(at, within="_scopes.py") as interrupt:
            call()
        assert interrupt.where is not None
        assert torch_function_state() == before, interrupt.where
        leaf = x.clone().requires_grad_(True)
        torch.testing.assert_close(torch.autograd.grad(net(leaf)[:, 0].sum(), leaf)[0], gradient, rtol=0, atol=0)
        again = lrp(TensorDict(x=x, batch_size=[4]))["relevance", "x"]
        torch.testing.assert_close(again, expected, rtol=0, atol=0, msg=interrupt.where)
    if in_context:
        lrp.__exit__(None, None, None)
    assert torch_function_state() == before


def _interrupting_at(function: str, text: str, fired: list):
    """A trace function raising KeyboardInterrupt at the line ``text`` of torch's ``function`` (once)."""

    def local(frame, event, arg):
        if (
            event == "line"
            and not fired
            and linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip() == text
        ):
            fired.append(frame.f_code.co_name)
            raise KeyboardInterrupt
        return local

    return lambda frame, event, arg: local if frame.f_code.co_name == function else None


@pytest.mark.parametrize(
    "where", ["pop: torch popped the mode", "push: torch pushed the mode"], ids=["after-pop", "after-push"]
)
def test_an_interrupt_inside_torchs_own_enter_or_exit_leaves_the_mode_once(where: str):
    """An interrupt inside torch's ``TorchFunctionMode.__exit__`` after it popped the mode (or inside ``__enter__``
    after it pushed it) leaves the entry's mark wrong: leaving the mode again popped the caller's mode under it, and
    a mode pushed but unmarked stayed on. The call's end leaves a mode only where it is on top of torch's stack."""
    outer = Counting()
    pending, fired = [], []
    with outer:
        before = torch_function_state()
        with pytest.raises(KeyboardInterrupt), closing_scopes():
            if where.startswith("pop"):
                push(pending, Counting(), enter=True)
                tracer = _interrupting_at("_pop_mode", "return old", fired)
            else:
                tracer = _interrupting_at("__enter__", "return self", fired)
            sys.settrace(tracer)
            try:
                pop(pending) if where.startswith("pop") else push(pending, Counting(), enter=True)
            finally:
                sys.settrace(None)
        assert fired, "torch's line was not reached: the test needs its text updated"
        assert torch_function_state() == before and pending == [] and _stack() == []
    assert torch_function_state() == (True, [])


class RaisingExit:
    """A context manager whose exit raises every time."""

    exits = 0

    def __enter__(self) -> RaisingExit:
        return self

    def __exit__(self, *exc_info: object) -> None:
        RaisingExit.exits += 1
        raise RuntimeError("exit failed")


def test_an_exit_that_raises_is_raised_once_and_the_rest_is_closed():
    """The closing went on by calling itself on the same entry until RecursionError."""
    pending, mode = [], Counting()
    RaisingExit.exits = 0
    with pytest.raises(RuntimeError, match="exit failed"), closing_scopes():
        push(pending, mode, enter=True)
        push(pending, RaisingExit(), enter=True)
    assert RaisingExit.exits == 1 and pending == [] and _stack() == [] and torch_function_state() == (True, [])
