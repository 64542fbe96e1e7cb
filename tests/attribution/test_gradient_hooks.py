"""Hooks of the caller's that change a gradient (a module's backward hooks, torch's global ones, a tensor's hook put by
the model's forward) are refused by name: relevance is input × modified gradient, and their change would be taken
into it. Hooks that only read the gradient run, and the relevance is the model's without them."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn
from torch.nn.modules.module import register_module_full_backward_hook, register_module_full_backward_pre_hook

from tdhook.attribution import LRP, BaseRuleMapper, EpsilonPlus

from ._helpers import assert_unchanged, state_snapshot

F64 = torch.float64
MAPPERS = {"EpsilonPlus": EpsilonPlus, "LRP-0": BaseRuleMapper}


class Body(nn.Module):
    def __init__(self, tensor_hook=None) -> None:
        super().__init__()
        self.a, self.b, self.act = nn.Linear(4, 6), nn.Linear(6, 6), nn.ReLU()
        self.tensor_hook = tensor_hook

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.a(x))
        if self.tensor_hook is not None:
            h.register_hook(self.tensor_hook)  # a gradient clip or scale, as a world model's dynamics put one
        return self.act(self.b(h))


class Net(nn.Module):
    def __init__(self, tensor_hook=None) -> None:
        super().__init__()
        self.body, self.head = Body(tensor_hook), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _model(tensor_hook=None) -> Net:
    torch.manual_seed(0)
    return Net(tensor_hook).double()


def _explain(model: nn.Module | LRP, mapper: str) -> tuple[TensorDict, TensorDict]:
    torch.manual_seed(1)
    td = TensorDict(x=torch.randn(5, 4, dtype=F64), batch_size=[5])
    lrp = model if isinstance(model, LRP) else LRP(model, MAPPERS[mapper](), in_keys=["x"], out_keys=["y"])
    return td, lrp(td)


def _refused_twice(model: nn.Module, mapper: str, match: str) -> None:
    """Each call of one wrapper is refused (the second is checked again), and leaves the caller's TensorDict as it
    was."""
    lrp = LRP(model, MAPPERS[mapper](), in_keys=["x"], out_keys=["y"])
    for _ in range(2):
        td = TensorDict(x=torch.randn(5, 4, dtype=F64), batch_size=[5])
        with pytest.raises(ValueError, match=match):
            lrp(td)
        assert list(td.keys()) == ["x"]


def _halved(module, *grads):
    return tuple(None if g is None else g * 0.5 for g in grads[0])


def _halved_in_place(module, *grads):
    for g in grads[0]:
        if g is not None:
            g.mul_(0.5)


def _hooks(halved) -> dict:
    return {
        "full backward hook": lambda m: m.body.b.register_full_backward_hook(halved),
        "full backward pre-hook": lambda m: m.body.b.register_full_backward_pre_hook(halved),
        "backward hook (not full)": lambda m: m.body.act.register_backward_hook(halved),
        "global full backward hook": lambda m: register_module_full_backward_hook(
            lambda module, grad_in, grad_out: halved(module, grad_in) if module is m.body.b else None
        ),
        "global full backward pre-hook": lambda m: register_module_full_backward_pre_hook(
            lambda module, grad_out: halved(module, grad_out) if module is m.body.b else None
        ),
    }


HOOKS, HOOKS_IN_PLACE = _hooks(_halved), _hooks(_halved_in_place)
NAMED = {
    "full backward hook": r"the full backward hook _halved\w* registered on module 'body.b' \(Linear\)",
    "full backward pre-hook": r"the full backward pre-hook _halved\w* registered on module 'body.b' \(Linear\)",
    "backward hook (not full)": r"the backward hook _halved\w* registered on module 'body.act' \(ReLU\)",
    "global full backward hook": r"a global hook \(register_module_full_backward_hook: .*\), called on module 'body.b'",
    "global full backward pre-hook": r"a global hook \(register_module_full_backward_pre_hook: .*\), called on module",
}


@pytest.mark.filterwarnings("ignore:Using a non-full backward hook")
@pytest.mark.filterwarnings("ignore:For backward hooks to be called")  # global hooks on the TensorDictModule
class TestModuleBackwardHooks:
    @pytest.mark.parametrize("mapper", sorted(MAPPERS))
    @pytest.mark.parametrize("kind", sorted(HOOKS))
    @pytest.mark.parametrize("in_place", [False, True], ids=["returned", "in place"])
    def test_a_hook_that_changes_the_gradient_is_refused_by_name(self, kind: str, mapper: str, in_place: bool):
        """A hook halving the gradient at a hidden layer halved the relevance (0.5 off, relative L2, the model
        without it; 0.75 for the hook that is not full, on a ReLU called twice), with no word; so did one halving the
        gradient it is given in place (``grad.mul_(0.5)``, returning ``None``). Each call is refused, the model and
        the caller's TensorDict left as they were."""
        model = _model()
        handle = (HOOKS_IN_PLACE if in_place else HOOKS)[kind](model)
        said = "changes the gradient it was given in place" if in_place else "returns a gradient other than the one"
        try:
            snapshot = state_snapshot(model)
            hooks = [dict(m._backward_hooks) | dict(m._backward_pre_hooks) for m in model.modules()]
            _refused_twice(model, mapper, NAMED[kind] + r".* " + said)
            assert_unchanged(model, snapshot)
            assert [dict(m._backward_hooks) | dict(m._backward_pre_hooks) for m in model.modules()] == hooks
        finally:
            handle.remove()
        td, out = _explain(model, mapper)
        _, expected = _explain(_model(), mapper)
        torch.testing.assert_close(out["relevance", "x"], expected["relevance", "x"], rtol=0, atol=0)

    @pytest.mark.parametrize("mapper", sorted(MAPPERS))
    def test_hooks_that_read_the_gradient_run_and_change_nothing(self, mapper: str):
        model, seen = _model(), []
        handles = [
            model.body.b.register_full_backward_hook(lambda m, grad_in, grad_out: seen.append("hook")),
            model.body.b.register_full_backward_pre_hook(lambda m, grad_out: seen.append("pre-hook")),
            model.body.act.register_full_backward_hook(lambda m, grad_in, grad_out: grad_in),  # the same tensors
        ]
        try:
            _, out = _explain(model, mapper)
        finally:
            for handle in handles:
                handle.remove()
        _, expected = _explain(_model(), mapper)
        assert sorted(seen) == ["hook", "pre-hook"]
        torch.testing.assert_close(out["relevance", "x"], expected["relevance", "x"], rtol=0, atol=0)


class TestTensorHooks:
    @pytest.mark.parametrize("mapper", sorted(MAPPERS))
    @pytest.mark.parametrize(
        ("hook", "said"),
        [
            (lambda g: g * 0.5, "returns a gradient other"),
            (lambda g: g.clamp(-1e-3, 1e-3), "returns a gradient other"),
            (lambda g: g.mul_(0.5), "changes the gradient it was given in place"),
            (lambda g: [g.clamp_(-1e-3, 1e-3)] and None, "changes the gradient it was given in place"),
            (lambda g: [g.data.mul_(0.5)] and None, "changes the gradient it was given in place"),
        ],
        ids=[
            "scaled by 0.5",
            "clamped to 1e-3",
            "scaled in place",
            "clamped in place, returning None",
            "scaled through .data (its version counter unchanged)",
        ],
    )
    def test_a_hook_put_in_the_forward_that_changes_the_gradient_is_refused_by_name(self, hook, said, mapper: str):
        """``h.register_hook(lambda g: g * 0.5)`` in a forward halved the relevance (0.5 off, relative L2, the model
        without it; the clamp to 1e-3 0.99 off), with no word; so did the same change made in place. Each call is
        refused."""
        model = _model(hook)
        snapshot = state_snapshot(model)
        _refused_twice(
            model, mapper, r"a hook that module 'body' \(Body\) puts on a tensor in its own forward .* " + said
        )
        assert_unchanged(model, snapshot)

    @pytest.mark.parametrize("mapper", sorted(MAPPERS))
    def test_a_hook_that_reads_the_gradient_runs_and_changes_nothing(self, mapper: str):
        seen = []
        _, out = _explain(_model(lambda g: seen.append(g.shape)), mapper)
        _, expected = _explain(_model(), mapper)
        assert seen == [torch.Size([5, 6])]
        torch.testing.assert_close(out["relevance", "x"], expected["relevance", "x"], rtol=0, atol=0)


class TestHooksAddedInAnOpenContext:
    @pytest.mark.parametrize("mapper", sorted(MAPPERS))
    @pytest.mark.parametrize(
        "kind", ["full backward hook", "global full backward hook", "tensor hook put by a forward hook"]
    )
    def test_a_hook_that_changes_the_gradient_is_refused_after_the_first_call(self, kind: str, mapper: str):
        """The first call of a context watches the hooks; one registered after it (between two calls of a rollout)
        halved the relevance of every later call, with no word. The context follows it as a change of the model:
        the next call is watched and refused, and once the hook is removed the relevance is the model's again."""
        model = _model()
        lrp = LRP(model, MAPPERS[mapper](), in_keys=["x"], out_keys=["y"])
        with lrp:
            _, before = _explain(lrp, mapper)
            handle = {
                "full backward hook": lambda: model.body.b.register_full_backward_hook(_halved),
                "global full backward hook": lambda: register_module_full_backward_hook(
                    lambda module, grad_in, grad_out: _halved(module, grad_in) if module is model.body.b else None
                ),
                "tensor hook put by a forward hook": lambda: model.body.b.register_forward_hook(
                    lambda module, args, out: [out.register_hook(lambda g: g * 0.5)] and None
                ),
            }[kind]()
            try:
                td = TensorDict(x=torch.randn(5, 4, dtype=F64), batch_size=[5])
                with pytest.raises(ValueError, match="returns a gradient other than the one it was given"):
                    lrp(td)
                assert list(td.keys()) == ["x"]
            finally:
                handle.remove()
            _, after = _explain(lrp, mapper)
        torch.testing.assert_close(after["relevance", "x"], before["relevance", "x"], rtol=0, atol=0)

    def test_a_hook_that_reads_the_gradient_runs_in_every_later_call(self):
        model, seen = _model(), []
        lrp = LRP(model, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
        with lrp:
            _, before = _explain(lrp, "EpsilonPlus")
            handle = model.body.b.register_full_backward_hook(lambda m, grad_in, grad_out: seen.append(1))
            try:
                outs = [_explain(lrp, "EpsilonPlus")[1] for _ in range(3)]
            finally:
                handle.remove()
        assert len(seen) == 3
        for out in outs:
            torch.testing.assert_close(out["relevance", "x"], before["relevance", "x"], rtol=0, atol=0)
