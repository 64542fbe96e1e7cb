"""Modules run without their hooks for a block: only those whose every hook is the wrapper's own, and all of them back
on torch's way when the block ends, however it ends."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from tdhook.attribution._quiet_modules import QuietModules


def watched() -> tuple[nn.Module, list[str], set[int]]:
    """A GELU with a pre-hook and a hook that note their calls, and the ids of both."""
    module, calls = nn.GELU(), []
    pre = module.register_forward_pre_hook(lambda m, args: calls.append("pre"))
    post = module.register_forward_hook(lambda m, args, out: calls.append("post"))
    return module, calls, {pre.id, post.id}


def test_a_module_whose_hooks_are_all_own_runs_without_them_in_the_block():
    module, calls, own = watched()
    x = torch.randn(3)
    with QuietModules(own).running([module]):
        inside = module(x)
    assert calls == []
    assert torch.equal(inside, nn.functional.gelu(x))
    module(x)
    assert calls == ["pre", "post"]
    assert "_call_impl" not in vars(module)


def test_a_module_with_any_other_hook_keeps_them_all():
    module, calls, own = watched()
    foreign = module.register_forward_hook(lambda m, args, out: calls.append("foreign"))
    with QuietModules(own).running([module]):
        module(torch.randn(3))
    assert calls == ["pre", "post", "foreign"]
    foreign.remove()
    backward = module.register_full_backward_hook(lambda m, gin, gout: None)
    with QuietModules(own).running([module]):
        module(torch.randn(3, requires_grad=True))
    assert calls[3:] == ["pre", "post"]
    backward.remove()


def test_a_global_module_hook_keeps_every_module_on_torchs_way():
    module, calls, own = watched()
    seen = []
    handle = nn.modules.module.register_module_forward_hook(lambda m, args, out: seen.append(type(m)))
    try:
        with QuietModules(own).running([module]):
            module(torch.randn(3))
    finally:
        handle.remove()
    assert calls == ["pre", "post"] and seen == [nn.GELU]


@pytest.mark.parametrize("error", [RuntimeError("failed"), KeyboardInterrupt()], ids=["error", "interrupt"])
def test_a_block_that_raises_leaves_every_module_as_before(error: BaseException):
    module, calls, own = watched()
    before = dict(vars(module))
    with pytest.raises(type(error)), QuietModules(own).running([module]):
        assert "_call_impl" in vars(module)
        raise error
    assert vars(module) == before
    module(torch.randn(3))
    assert calls == ["pre", "post"]


def test_what_an_interrupted_end_left_is_put_back_by_the_next_block_and_by_remove():
    module, calls, own = watched()
    quiet = QuietModules(own)
    quiet.running([module]).__enter__()  # a block whose end never ran
    module(torch.randn(3))
    assert calls == []
    with quiet.running([]):
        module(torch.randn(3))
    assert calls == ["pre", "post"]
    quiet.running([module]).__enter__()
    quiet.remove()
    quiet.remove()  # idempotent, as a hook handle's
    module(torch.randn(3))
    assert calls == ["pre", "post"] * 2


class Passing(TorchFunctionMode):
    """A caller's function mode that lets every call through."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_a_call_under_a_function_mode_takes_torchs_way():
    """The hooks that pause the function modes in a ruled module pause a caller's mode too: a call made while one is
    entered, around the block or inside it, runs the module's hooks."""
    module, calls, own = watched()
    with Passing(), QuietModules(own).running([module]):
        module(torch.randn(3))
    assert calls == ["pre", "post"]
    x = torch.randn(3)
    with QuietModules(own).running([module]):
        module(x)  # quiet
        with Passing():
            inside = module(x)
    assert calls == ["pre", "post"] * 2 and "_call_impl" not in vars(module)
    assert torch.equal(inside, nn.functional.gelu(x))
