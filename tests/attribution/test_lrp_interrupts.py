"""An interrupt at any line of tdhook's own code: entering a context, a call, leaving it.

A ``KeyboardInterrupt`` arrives between two lines of Python, wherever the
process happens to be. These tests raise one, through ``sys.settrace``, at
every line tdhook runs in turn (the k-th line event of its source files, for
every k), and check that the model, the caller's TensorDict and torch's global
state are as before, and that the wrapper then gives the relevance it gave
before. Leaving a ``with`` block, the line event of the ``with`` statement comes
before the context manager's ``__exit__`` is called, where no signal handler
runs in CPython; those events are not counted.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule, TensorDictSequential
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution._no_grad_values import caller_grad_enabled
from tdhook.attribution.lrp_helpers.rules import AttnLRP, EpsilonGammaBox, EpsilonPlus, EpsilonRule
from tdhook.attribution.rules import _graph_calls
from tdhook.attribution.rules._first_pass import first_pass
from tdhook.attribution.rules._plain_calls import PLAIN_DEPTH
from tdhook.attribution.rules._wrapper_calls import in_a_wrapper_call
from tests.attribution._interrupts import Interrupt, every_line

F64 = torch.float64


def global_state() -> tuple:
    return (
        torch.is_grad_enabled(),
        torch._C._is_torch_function_enabled(),
        torch._C._is_torch_function_mode_enabled(),
        [type(mode) for mode in torch.overrides._get_current_function_mode_stack()],
        len(torch.nn.modules.module._global_forward_hooks),
        len(torch.nn.modules.module._global_forward_pre_hooks),
        len(torch.nn.modules.module._global_backward_hooks),
        # The thread's state of a call that records or follows a plan of function rules: none between calls.
        _graph_calls.recording(),
        _graph_calls.planned(),
        # The first pass's checks (rules warn once per context there): none between calls.
        first_pass(),
        # No wrapper's call in progress, no block of plain calls: the model's own calls in an open context stay
        # plain, and the wrapper's take the rules.
        in_a_wrapper_call(),
        getattr(PLAIN_DEPTH, "depth", 0),
    )


def module_state(model: nn.Module) -> list:
    """Everything of each module a context could change: its ``__dict__`` entries (hooks, a ``forward`` or
    ``__getstate__`` of its own), training flag, and parameters and buffers (object, version, storage, values,
    ``requires_grad``, ``grad``)."""
    return [
        (
            name,
            module.training,
            sorted(k for k in vars(module) if k not in ("_parameters", "_buffers", "_modules")),
            sorted((k, list(v)) for k, v in vars(module).items() if "hooks" in k and isinstance(v, dict)),
            [
                (k, v, v._version, v.data_ptr(), v.detach().clone(), v.requires_grad, v.grad)
                for k, v in [*module._parameters.items(), *module._buffers.items()]
            ],
        )
        for name, module in model.named_modules()
    ]


def assert_same_state(before: list, after: list, where: str | None = None) -> None:
    assert len(before) == len(after)
    for (name, *old), (_, *new) in zip(before, after, strict=True):
        assert old[:3] == new[:3], (where, name)
        for (k, *a), (_, *b) in zip(old[3], new[3], strict=True):
            assert a[0] is b[0] and a[1:3] == b[1:3] and torch.equal(a[3], b[3]) and a[4:] == b[4:], (where, name, k)


def assert_all_or_nothing(td: TensorDict, entries: dict, expected: torch.Tensor, where: str | None) -> None:
    """``td`` holds its ``entries`` and nothing else, or, where the interrupt came once the call had written its
    results (returning), all of them."""
    now = dict(td.items(include_nested=True, leaves_only=True))
    if now.keys() != entries.keys():  # a call that ended, or was interrupted at ``return out`` or after it
        returning = where is not None and where.startswith("lrp.py") and where.endswith("(forward)")
        # The guards of the running statistics and of the parameters' .grad around the whole call are left after
        # ``return out``.
        guards = ("_batch_statistics.py", "_kept_grads.py")
        # (a comprehension of a guard's runs in a frame of its own: one in its __enter__ comes before any write;
        # _settle is the .grad guard's __exit__'s last step)
        leaving = where is not None and where.startswith(guards)
        leaving = leaving and where.endswith(("(__exit__)", "(<listcomp>)", "(_settle)"))
        assert where is None or returning or leaving, where
        torch.testing.assert_close(td["relevance", "x"], expected, rtol=0, atol=0, msg=where)
    assert all(now[key] is value for key, value in entries.items()), where


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).to(F64)


def cnn() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3)
    ).to(F64)
    with torch.no_grad():
        model[1].running_mean.normal_()
        model[1].running_var.uniform_(0.5, 2.0)
    return model.eval()


def transformer() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.GELU(), nn.Softmax(-1), nn.Linear(8, 3)
    ).to(F64)


class GatedAttention(nn.Module):
    """A Llama-like block: RMS norms written out, attention, a SiLU-gated MLP: AttnLRP's later calls in a context
    follow the first call's plan (products halved and norms' scales cut on the graph, modules run without hooks)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(5, 5) for _ in range(4))
        self.gate, self.up, self.down, self.act = nn.Linear(5, 8), nn.Linear(5, 8), nn.Linear(8, 5), nn.SiLU()
        self.head = nn.Linear(5, 3)

    @staticmethod
    def norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(x.shape[0], -1, 5)
        h = self.norm(x)
        x = x + self.o(torch.softmax(self.q(h) @ self.k(h).transpose(-1, -2), -1) @ self.v(h))
        h = self.norm(x)
        return self.head((x + self.down(self.act(self.gate(h)) * self.up(h)))[:, -1])


def gated_attention() -> nn.Module:
    torch.manual_seed(0)
    return GatedAttention().to(F64)


CASES: dict[str, tuple[Callable[[], nn.Module], Callable, tuple[int, ...]]] = {
    "MLP under EpsilonPlus (a chain plan)": (mlp, EpsilonPlus, (4, 5)),
    "CNN with BatchNorm under EpsilonGammaBox": (cnn, lambda: EpsilonGammaBox(-3.0, 3.0), (2, 3, 4, 4)),
    "layers with a norm and a softmax under AttnLRP": (transformer, AttnLRP, (4, 5)),
    "a gated attention block under AttnLRP (a planned call)": (gated_attention, AttnLRP, (2, 15)),
}


def explain(lrp: LRP, x: torch.Tensor) -> torch.Tensor:
    return lrp(TensorDict(x=x, batch_size=x.shape[:1]))["relevance", "x"]


def wrapped(case: str) -> tuple[nn.Module, LRP, torch.Tensor, torch.Tensor]:
    """The model of ``case``, its wrapper, an input and its relevance."""
    make, mapper, shape = CASES[case]
    model = make()
    x = torch.randn(shape, dtype=F64)
    lrp = LRP(model, mapper(), in_keys=["x"], out_keys=["y"])
    return model, lrp, x, explain(lrp, x)


# Leaving a context is left out of the calls' tests: an interrupt there can leave part of the context behind. (What
# a hook entered, push and pop, is interrupted at every line in tests/attribution/rules/test_scopes.py.)
CLEANUP = ("__exit__", "_remove")


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_interrupt_at_any_line_while_entering_the_context_leaves_the_model_as_before(case: str):
    model, lrp, x, expected = wrapped(case)
    before, before_global = module_state(model), global_state()

    lines = every_line(lrp.__enter__, start=2)
    lrp.__exit__(None, None, None)
    for at in lines:
        with Interrupt(at) as interrupt:
            lrp.__enter__()
        if interrupt.where is None:
            lrp.__exit__(None, None, None)
        assert global_state() == before_global, interrupt.where
        assert_same_state(before, module_state(model), interrupt.where)
        torch.testing.assert_close(explain(lrp, x), expected, rtol=0, atol=0, msg=interrupt.where)


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_interrupt_at_any_line_of_a_call_leaves_model_and_tensordict_as_before(case: str):
    model, lrp, x, expected = wrapped(case)
    before, before_global = module_state(model), global_state()
    for inside in (False, True):
        if inside:
            lrp.__enter__()
            explain(lrp, x)  # the context's first call is watched; the later ones may take other paths
            inner_before = module_state(model)
        lines = every_line(lambda: explain(lrp, x), CLEANUP, start=1 + inside * 4)
        for at in lines:
            td = TensorDict(x=x.clone(), batch_size=x.shape[:1])
            entries = dict(td.items(include_nested=True, leaves_only=True))
            with Interrupt(at, CLEANUP) as interrupt:
                lrp(td)
            assert_all_or_nothing(td, entries, expected, interrupt.where)
            assert global_state() == before_global, interrupt.where
            assert_same_state(inner_before if inside else before, module_state(model), interrupt.where)
            torch.testing.assert_close(explain(lrp, x), expected, rtol=0, atol=0, msg=interrupt.where)
    lrp.__exit__(None, None, None)
    assert global_state() == before_global
    assert_same_state(before, module_state(model))


class FailingRemoval(EpsilonRule):
    """The ε-rule, whose removal from a module raises after it removed its hooks (``error`` when armed)."""

    error: BaseException | None = None

    def unregister(self, module: nn.Module) -> None:
        super().unregister(module)
        if self.error is not None:
            raise self.error


@pytest.mark.parametrize("error", [RuntimeError("removal failed"), KeyboardInterrupt()], ids=["error", "interrupt"])
@pytest.mark.parametrize("failing", ["0", "2", "4"])
def test_a_rule_whose_removal_raises_leaves_no_other_hook_and_no_result(failing: str, error: BaseException):
    model = mlp()
    x = torch.randn(4, 5, dtype=F64)
    faulty = FailingRemoval()
    rules = {name: faulty if name == failing else EpsilonRule() for name in ("0", "2", "4")}
    lrp = LRP(model, lambda name, module: rules.get(name), in_keys=["x"], out_keys=["y"])
    expected = explain(lrp, x)
    before = module_state(model)
    faulty.error = error
    td = TensorDict(x=x, batch_size=[4])
    with pytest.raises(type(error)):
        lrp(td)  # the context is entered for the call and left after it
    assert list(td.keys(include_nested=True)) == ["x"]  # a call that raised wrote nothing
    assert_same_state(before, module_state(model))
    with pytest.raises(type(error)):
        with lrp:
            explain(lrp, x)
    assert_same_state(before, module_state(model))
    faulty.error = None
    torch.testing.assert_close(explain(lrp, x), expected, rtol=0, atol=0)


def test_a_pipeline_call_interrupted_anywhere_writes_nothing():
    """A TensorDictSequential: the relevance, the outputs of each step, all or nothing."""
    torch.manual_seed(0)
    pipeline = TensorDictSequential(
        TensorDictModule(nn.Linear(5, 6).to(F64), in_keys=["x"], out_keys=["h"]),
        TensorDictModule(nn.Sequential(nn.ReLU(), nn.Linear(6, 3)).to(F64), in_keys=["h"], out_keys=["y"]),
    )
    lrp = LRP(pipeline, EpsilonPlus())
    x = torch.randn(4, 5, dtype=F64)
    expected = lrp(TensorDict(x=x, batch_size=[4]))["relevance", "x"]
    for at in every_line(lambda: lrp(TensorDict(x=x, batch_size=[4])), start=3):
        td = TensorDict(x=x, batch_size=[4])
        with Interrupt(at) as interrupt:
            lrp(td)
        assert_all_or_nothing(td, {"x": x}, expected, interrupt.where)
        # An interrupt as the call's block ends (in its __exit__ too) leaves no wrapper's call marked on the thread:
        # the model's own calls in an open context would take the rules' gradient from then on.
        assert not in_a_wrapper_call(), interrupt.where
    torch.testing.assert_close(lrp(TensorDict(x=x, batch_size=[4]))["relevance", "x"], expected, rtol=0, atol=0)


class InterruptIn(Interrupt):
    """Counts, and interrupts at, the line events of one file of tdhook's source only (``name``): lines run elsewhere
    (a weak reference's callback that a collection runs in between) do not move the one it interrupts at."""

    def __init__(self, at: int | None, name: str) -> None:
        super().__init__(at)
        self.name = name

    def _local(self, frame, event, arg):
        if frame.f_code.co_filename.rpartition("/")[2] != self.name:
            return self._local
        return super()._local(frame, event, arg)


def test_an_interrupt_at_any_line_of_the_first_pass_leaves_no_pass_behind():
    """Every line of the first pass's entry and exit (each call of a wrapper outside a context opens one): an
    interrupt as it ends, before the thread's state was put back, left the pass on, and later calls took its
    checks and its record of what was warned about for theirs."""
    torch.manual_seed(0)
    lrp = LRP(TensorDictModule(nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3)).to(F64), ["x"], ["y"]))
    x = torch.randn(4, 5, dtype=F64)
    lrp(TensorDict(x=x, batch_size=[4]))  # the wrapper's first call watches more than the later ones
    with InterruptIn(None, "_first_pass.py") as counting:
        lrp(TensorDict(x=x, batch_size=[4]))
    assert counting.count >= 3  # entering (two lines) and leaving, at least
    for at in range(1, counting.count + 1):
        with InterruptIn(at, "_first_pass.py") as interrupt:
            lrp(TensorDict(x=x, batch_size=[4]))
        assert interrupt.where is not None and "_first_pass.py" in interrupt.where
        assert first_pass() is None, interrupt.where


def test_an_interrupt_at_any_line_of_the_grad_mode_record_leaves_no_mode_behind():
    """Every line of the record of the caller's grad mode (each call of a wrapper keeps one): an interrupt as it
    ended, before the thread's state was put back, left a call under ``no_grad`` recorded, and the model's own calls
    in an open context, with gradient, took the values of a run without gradient from then on."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3)).to(F64)
    lrp = LRP(TensorDictModule(net, ["x"], ["y"]))
    x = torch.randn(4, 5, dtype=F64)
    with torch.no_grad():
        lrp(TensorDict(x=x, batch_size=[4]))
        with InterruptIn(None, "_no_grad_values.py") as counting:
            lrp(TensorDict(x=x, batch_size=[4]))
    assert counting.count >= 3  # entering and leaving, at least
    for at in range(1, counting.count + 1):
        with torch.no_grad(), InterruptIn(at, "_no_grad_values.py") as interrupt:
            lrp(TensorDict(x=x, batch_size=[4]))
        assert interrupt.where is not None and "_no_grad_values.py" in interrupt.where
        assert caller_grad_enabled(), interrupt.where


def test_an_interrupt_while_a_rule_is_removed_leaves_no_mode_open_at_later_plain_calls():
    """Leaving a context is not guarded against interrupts (its leftovers go when the wrapper enters again), but a
    rule removed half-way kept the pre-hook that enters a function mode for a BatchNorm's forward and lost the
    forward hook that leaves it: every later plain call left one more mode open on the thread, which entering again
    did not close (plain gradients 4e-6 off, then a KeyError from a later call)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).double().eval()
    x = torch.randn(4, 6, dtype=torch.float64)
    leaf = x.clone().requires_grad_(True)
    (plain,) = torch.autograd.grad(model(leaf)[:, 0].sum(), leaf)
    counting = LRP(model, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
    counting.__enter__()
    lines = every_line(lambda: counting.__exit__(None, None, None), stride=1)  # the removals are a few lines
    stopped_in_removals = 0
    for at in lines:
        lrp = LRP(model, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
        lrp.__enter__()
        lrp(TensorDict(x=x, batch_size=[4]))
        with Interrupt(at) as interrupt:
            lrp.__exit__(None, None, None)
        stopped_in_removals += interrupt.where is not None and "(unregister)" in interrupt.where
        depth = torch._C._len_torch_function_stack()
        for _ in range(2):  # plain calls: none leaves a mode open
            leaf = x.clone().requires_grad_(True)
            torch.autograd.grad(model(leaf)[:, 0].sum(), leaf)
        assert torch._C._len_torch_function_stack() == depth, interrupt.where
        lrp.__exit__(None, None, None)  # what the interrupt left is removed
        leaf = x.clone().requires_grad_(True)
        (again,) = torch.autograd.grad(model(leaf)[:, 0].sum(), leaf)
        torch.testing.assert_close(again, plain, rtol=0, atol=0, msg=interrupt.where)
    assert stopped_in_removals > 0
