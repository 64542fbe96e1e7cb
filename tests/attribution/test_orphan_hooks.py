"""The sweep of hooks a failure left without a handle takes out only those its own thread made."""

from __future__ import annotations

import threading

import pytest
from torch import nn

from tdhook.attribution._orphan_hooks import HooksMade, is_ours, orphans_removed, remove_orphans


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
