"""Forward hooks that run before a rule's own: one put first on a layer in an open context (prepend=True), which the
context's next call, watched, puts after the rule's."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP, EpsilonPlus, EpsilonPlusFlat, UniformEpsilon
from tests.attribution._helpers import assert_unchanged, state_snapshot
from tests.conftest import relative_error

F64 = torch.float64
MAPPERS = {"EpsilonPlus": EpsilonPlus, "EpsilonPlusFlat": EpsilonPlusFlat, "UniformEpsilon": UniformEpsilon}


class Affine(nn.Module):
    """What the hooks below compute, written as a module after the layer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 0.3


def changes(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output * 2 + 0.3


def cnn() -> nn.Sequential:
    torch.manual_seed(0)
    convolutions = [nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 6, 3, stride=2), nn.ReLU()]
    return nn.Sequential(*convolutions, nn.Flatten(), nn.Linear(54, 5)).to(F64).eval()


def explain(net: nn.Module, mapper, x: torch.Tensor) -> torch.Tensor:
    return LRP(net, mapper, in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[2]))["relevance", "x"]


@pytest.mark.parametrize("mapper", sorted(MAPPERS))
@pytest.mark.parametrize("layer", [0, 2, 5])
def test_a_hook_put_first_in_an_open_context_is_followed_as_one_put_before_it(layer: int, mapper: str):
    # The rule took the hook's change for the layer's own computation: 5e-6 (the last Linear under ε = 1e-6) to 0.81
    # (the second convolution under UniformEpsilon) off, relative L2, the same model with the hook written as a module;
    # then it was refused by name. The context now follows a hook registered in it (see
    # tdhook.attribution._model_changes): its next call is watched as a first one, which puts the caller's hooks after
    # the rule's, and explains the hook as one registered before the context, as code after the layer.
    net, x = cnn(), torch.randn(2, 3, 8, 8, dtype=F64)
    written = nn.Sequential(*net[: layer + 1], Affine(), *net[layer + 1 :])
    expected = explain(written, MAPPERS[mapper](), x)
    lrp = LRP(net, MAPPERS[mapper](), in_keys=["x"], out_keys=["y"])
    with lrp:
        lrp(TensorDict(x=x, batch_size=[2]))
        handle = net[layer].register_forward_hook(changes, prepend=True)
        before = state_snapshot(net)
        got = [lrp(TensorDict(x=x, batch_size=[2]))["relevance", "x"] for _ in range(2)]
        assert_unchanged(net, before)
        handle.remove()
    for relevance in got:
        assert relative_error(relevance, expected) < 1e-12
    # The same hook, registered before the context or without prepend: code after the layer, as a module there.
    for hook in (net[layer].register_forward_hook(changes, prepend=True), None):
        with lrp:
            lrp(TensorDict(x=x, batch_size=[2]))
            if hook is None:
                hook = net[layer].register_forward_hook(changes)
            got = lrp(TensorDict(x=x, batch_size=[2]))["relevance", "x"]
        hook.remove()
        assert relative_error(got, expected) < 1e-12


def test_a_hook_put_first_that_only_looks_changes_nothing():
    net, x, seen = cnn(), torch.randn(2, 3, 8, 8, dtype=F64), []
    expected = explain(net, EpsilonPlus(), x)
    lrp = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
    with lrp:
        lrp(TensorDict(x=x, batch_size=[2]))
        handle = net[2].register_forward_hook(lambda module, args, output: seen.append(output.shape), prepend=True)
        got = lrp(TensorDict(x=x, batch_size=[2]))["relevance", "x"]
    handle.remove()
    assert seen and torch.equal(got, expected)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_global_hook_that_only_looks_is_not_taken_for_a_change_by_a_non_finite_sample(bad: float):
    # The layer's output was compared with its own by a tolerance over the whole batch, which a NaN or inf sample
    # made NaN: every call with such a sample was refused, naming a hook that changed nothing.
    net, x = cnn(), torch.randn(3, 3, 8, 8, dtype=F64)
    x[1, 0, 2, 2] = bad
    expected = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"])(TensorDict(x=x[[0, 2]], batch_size=[2]))
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, output: None)
    try:
        got = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[3]))
    finally:
        handle.remove()
    assert relative_error(got["relevance", "x"][[0, 2]], expected["relevance", "x"]) <= 1e-12
