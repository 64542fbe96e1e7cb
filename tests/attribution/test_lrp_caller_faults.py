"""Failures that come from the caller's side of a call: a hook of the user's own that raises in the forward or the
backward pass, an interrupt in the backward pass, a module that writes into the TensorDict it is given and then fails,
a later step of a ``TensorDictSequential`` that fails.

After each, the model (parameters, buffers, version counters, ``requires_grad``, ``.grad``, every hook dict), the
caller's TensorDict (keys, tensors, values, versions, ``requires_grad``, hooks) and torch's global state are as
before, and the next call, with the fault gone, gives the relevance of a fresh wrapper: for LRP called on its own and
in an open context, and for a gradient method (Saliency).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule, TensorDictSequential
from torch import nn

from tdhook.attribution import LRP, EpsilonPlus, Saliency
from tests.attribution.test_lrp_interrupts import assert_same_state, global_state, module_state
from tests.attribution.test_lrp_registration_faults import assert_same_tensordict, tensordict_state

F64 = torch.float64


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)).to(F64)


class Switch:
    """Whether the fault is on (it is turned off for the calls that check the wrapper works afterwards)."""

    on = True

    def raise_if_on(self, error: BaseException) -> None:
        if self.on:
            raise error


class Failing(nn.Module):
    """A step that raises while ``switch`` is on, else sums its input."""

    def __init__(self, switch: Switch) -> None:
        super().__init__()
        self.switch = switch

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.switch.raise_if_on(RuntimeError("a later step failed"))
        return h.sum(-1, keepdim=True)


class WritesThenFails(TensorDictModule):
    """A module that writes a key and overwrites its input in the TensorDict it is given, then raises."""

    def __init__(self, net: nn.Module, switch: Switch) -> None:
        super().__init__(net, in_keys=["x"], out_keys=["y"])
        self.switch = switch

    def forward(self, tensordict: TensorDictBase, *args: object, **kwargs: object) -> TensorDictBase:
        tensordict.set("scratch", torch.zeros(tensordict.batch_size, dtype=F64))
        tensordict.set("x", tensordict["x"] * 3)
        self.switch.raise_if_on(RuntimeError("failed after writing"))
        return super().forward(tensordict, *args, **kwargs)


def forward_hook(switch: Switch) -> tuple[nn.Module, TensorDictModule, type]:
    net = mlp()
    net[2].register_forward_hook(lambda module, args, out: switch.raise_if_on(ValueError("the user's hook failed")))
    return net, TensorDictModule(net, in_keys=["x"], out_keys=["y"]), ValueError


def backward_hook(switch: Switch) -> tuple[nn.Module, TensorDictModule, type]:
    net = mlp()
    net[2].register_full_backward_hook(lambda module, gi, go: switch.raise_if_on(KeyboardInterrupt("backward hook")))
    return net, TensorDictModule(net, in_keys=["x"], out_keys=["y"]), KeyboardInterrupt


class HookedInForward(nn.Module):
    """Puts a tensor hook that raises ``KeyboardInterrupt`` on an activation in its forward pass (the backward pass
    is interrupted between two of the rules' gradients)."""

    def __init__(self, switch: Switch) -> None:
        super().__init__()
        self.net, self.switch = mlp(), switch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.net[0](x)
        h.register_hook(lambda grad: self.switch.raise_if_on(KeyboardInterrupt("interrupted in the backward pass")))
        return self.net[2](self.net[1](h))


def interrupted_backward(switch: Switch) -> tuple[nn.Module, TensorDictModule, type]:
    net = HookedInForward(switch)
    return net, TensorDictModule(net, in_keys=["x"], out_keys=["y"]), KeyboardInterrupt


def writes_then_fails(switch: Switch) -> tuple[nn.Module, TensorDictModule, type]:
    net = mlp()
    return net, WritesThenFails(net, switch), RuntimeError


def later_step_fails(switch: Switch) -> tuple[nn.Module, TensorDictSequential, type]:
    net = mlp()
    steps = TensorDictModule(net, in_keys=["x"], out_keys=["h"]), TensorDictModule(Failing(switch), ["h"], ["y"])
    return net, TensorDictSequential(*steps), RuntimeError


FAULTS: dict[str, Callable[[Switch], tuple]] = {
    "the user's forward hook raises": forward_hook,
    "the user's full backward hook is interrupted": backward_hook,
    "a tensor hook of the model's interrupts the backward pass": interrupted_backward,
    "a module writes into the TensorDict, then raises": writes_then_fails,
    "a later step of a TensorDictSequential raises": later_step_fails,
}
WRAPPERS = {
    "LRP": lambda module: LRP(module, EpsilonPlus(), target_key="y"),
    "LRP in an open context": lambda module: LRP(module, EpsilonPlus(), target_key="y"),
    "Saliency": lambda module: Saliency(module, target_key="y"),
}


def inputs() -> TensorDict:
    return TensorDict(x=torch.randn(3, 4, dtype=F64, generator=torch.Generator().manual_seed(1)), batch_size=[3])


def relevance(out: TensorDictBase) -> torch.Tensor:
    return out["relevance" if ("relevance", "x") in out.keys(True) else "attribution", "x"]


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_fault_of_the_callers_side_leaves_model_and_tensordict_as_before(fault: str, wrapper: str):
    switch = Switch()
    model, module, error = FAULTS[fault](switch)
    explainer = WRAPPERS[wrapper](module)
    outside, before_global = module_state(model), global_state()
    td = inputs()
    entries = tensordict_state(td)
    with explainer if wrapper.endswith("open context") else contextlib.nullcontext():
        before = module_state(model)  # with the open context's hooks
        with pytest.raises(error):
            explainer(td)
        assert_same_tensordict(entries, td, fault)
        assert_same_state(before, module_state(model), fault)
        switch.on = False
        after_fault = relevance(explainer(inputs()))
    assert global_state() == before_global
    assert_same_state(outside, module_state(model), fault)
    expected = relevance(WRAPPERS[wrapper](module)(inputs()))
    torch.testing.assert_close(after_fault, expected, rtol=1e-12, atol=1e-12)
