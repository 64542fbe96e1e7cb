"""The sweep of hooks a failure left without a handle takes out only those its own thread made."""

from __future__ import annotations

import threading

import pytest
import torch
from tensordict import TensorDict
from torch import nn
from torch.utils.hooks import RemovableHandle

from tdhook.attribution._orphan_hooks import HooksMade, is_ours, noting_installed, orphans_removed, remove_orphans


def _hook_of_ours(module: nn.Module, args: tuple, output: object) -> None:
    """A forward hook of the tests' own."""


def test_hooks_made_notes_its_own_thread_only():
    layer = nn.Linear(2, 2)
    other: list[int] = []
    inside, done = threading.Event(), threading.Event()

    def register_elsewhere() -> None:
        assert inside.wait(10)
        other.append(layer.register_forward_hook(is_ours).id)
        done.set()

    thread = threading.Thread(target=register_elsewhere)
    thread.start()
    with HooksMade() as made:
        own = layer.register_forward_pre_hook(is_ours).id
        inside.set()
        assert done.wait(10)
    thread.join()
    after = layer.register_forward_hook(is_ours).id  # the record is closed
    assert made.ids == {own}
    assert other[0] not in made.ids and after not in made.ids


@pytest.mark.parametrize("sweep", ["orphans_removed", "remove_orphans"])
def test_another_threads_hook_made_during_a_failure_survives_the_sweep(sweep: str):
    """Thread A makes a hook and loses its handle, thread B then registers one of tdhook's on the same layer and
    holds its handle, then A's block fails: A's orphan goes, B's hook stays (it acts in B's calls)."""
    layer = nn.Linear(2, 2)
    registered, held = threading.Event(), []

    def other_thread() -> None:  # e.g. a GradCAM call of another thread recording this layer
        held.append(layer.register_forward_hook(is_ours))
        registered.set()

    def failing_block() -> None:
        layer.register_forward_pre_hook(is_ours)  # its handle lost
        thread = threading.Thread(target=other_thread)
        thread.start()
        assert registered.wait(10)
        thread.join()
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        if sweep == "orphans_removed":
            with orphans_removed(lambda: [layer], list):
                failing_block()
        else:
            made = HooksMade().open()
            try:
                failing_block()
            except BaseException:
                remove_orphans([layer], made.ids)
                raise
            finally:
                made.close()
    assert len(layer._forward_pre_hooks) == 0  # the orphan is removed
    assert list(layer._forward_hooks) == [held[0].id]  # the other thread's hook is kept
    held[0].remove()
    assert len(layer._forward_hooks) == 0


def test_hooks_made_records_nest_and_close_in_any_order():
    layer = nn.Linear(2, 2)
    outer, inner = HooksMade().open(), HooksMade().open()
    first = layer.register_forward_hook(_hook_of_ours).id
    outer.close()
    second = layer.register_forward_hook(_hook_of_ours).id
    inner.close()
    layer.register_forward_hook(_hook_of_ours)
    assert outer.ids == {first} and inner.ids == {first, second}


def _torch_init_in_place() -> bool:
    """Whether ``RemovableHandle.__init__`` is torch's own (not wrapped)."""
    return RemovableHandle.__dict__["__init__"].__module__ == "torch.utils.hooks"


class _FailingModel(nn.Module):
    """A Linear layer whose call fails when ``fail`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2).double()
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("the model failed")
        return self.fc(x)


@pytest.mark.parametrize("entry", ["lrp call", "lrp context", "failing lrp call", "saliency", "failing saliency"])
def test_torch_hooks_are_registered_by_torch_alone_outside_tdhooks_calls(entry: str):
    """The first context or method call replaced torch's ``RemovableHandle.__init__`` for the whole process, for
    good: every hook registered anywhere afterwards went through tdhook's code. It is wrapped only while a record
    is open now, and torch's own is back once the call (or the entering of the context) ends, failing or not."""
    from tdhook.attribution import LRP, Saliency
    from tdhook.attribution.lrp_helpers.rules import EpsilonPlus

    model = _FailingModel()
    td = TensorDict(x=torch.randn(4, 3, dtype=torch.float64), batch_size=[4])
    if entry.startswith("lrp") or entry == "failing lrp call":
        wrapper = LRP(model, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
    else:
        wrapper = Saliency(model, in_keys=["x"], out_keys=["y"])
    model.fail = entry.startswith("failing")
    if entry == "lrp context":
        with wrapper:
            assert _torch_init_in_place()  # between calls too
            wrapper(td.clone())
            assert _torch_init_in_place()
    elif model.fail:
        with pytest.raises(RuntimeError, match="the model failed"):
            wrapper(td.clone())
    else:
        wrapper(td.clone())
    assert _torch_init_in_place()
    assert not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in model.modules())


def test_the_noting_stays_while_another_thread_has_a_record_open():
    """A record closing in one thread leaves the noting in place for a record still open in another, whose ids are
    still noted; once both are closed, torch's ``__init__`` is back."""
    layer = nn.Linear(2, 2)
    opened, closed, made, ids = threading.Event(), threading.Event(), [], []

    def other() -> None:
        with HooksMade() as record:
            opened.set()
            assert closed.wait(10)
            ids.append(layer.register_forward_hook(is_ours).id)
        made.append(record)

    thread = threading.Thread(target=other)
    thread.start()
    assert opened.wait(10)
    with HooksMade() as own:
        own_id = layer.register_forward_pre_hook(is_ours).id
    assert noting_installed()  # the other thread's record is open
    closed.set()
    thread.join()
    assert own.ids == {own_id} and made[0].ids == {ids[0]}
    assert not noting_installed() and _torch_init_in_place()


def test_a_wrapper_put_over_the_noting_is_left_in_place_and_still_notes():
    """Another library (a debugger) wrapping ``RemovableHandle.__init__`` while a record is open wraps the noting:
    the noting is not put back over it (which would call itself through theirs), and ids are still noted."""
    original, calls = RemovableHandle.__dict__["__init__"], []
    assert _torch_init_in_place()
    layer = nn.Linear(2, 2)
    try:
        with HooksMade():
            noting = RemovableHandle.__dict__["__init__"]

            def theirs(handle, *args, **kwargs):
                calls.append(1)
                noting(handle, *args, **kwargs)

            RemovableHandle.__init__ = theirs
        assert RemovableHandle.__dict__["__init__"] is theirs
        with HooksMade() as made:
            handle = layer.register_forward_hook(is_ours)
        assert made.ids == {handle.id} and calls == [1]
    finally:
        RemovableHandle.__init__ = original  # as the other library would
    with HooksMade() as made:
        handle = layer.register_forward_hook(is_ours)
    assert made.ids == {handle.id} and calls == [1] and _torch_init_in_place()
