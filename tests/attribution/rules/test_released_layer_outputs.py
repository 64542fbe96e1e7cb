"""The outputs of a call's layers, and the autograd graph behind them, are freed when the call is over, by reference
counting alone.

A Linear or convolution layer's rule leaves its :class:`LayerCall` on the tensor it returns. Where the rule keeps
the plain gradient (CP-LRP, AttnLRP), that tensor is the layer's own output, which the record held back: a reference
cycle that kept every such output and its graph until the garbage collector's next full pass (some 65 MB per call
on a float32 ResNet-18 with a batch of 4), and for good where the output is a view (a Linear over a sequence, whose
base held the record). The tests run with the collector off and watch the outputs through weak references; the
relevance stays the gradient times the input, which is what CP-LRP and AttnLRP give on these piecewise-linear
models.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import CPLRP, LRP, AttnLRP, EpsilonPlus, UniformEpsilon
from tdhook.attribution.mappers.base import BaseRuleMapper
from tdhook.attribution.rules import EpsilonRule
from tdhook.attribution.rules._autograd import scale_gradient
from tests.attribution._helpers import small_bn_cnn, with_statistics
from tests.conftest import relative_error

F64 = torch.float64


class LinearNorm(nn.Module):
    """A Linear over tokens, normalised by a BatchNorm1d over the flattened tokens (timm's ``LinearNorm``), then a
    head; with ``keep_output=False`` the layer's output is a temporary gone before the BatchNorm runs."""

    def __init__(self, keep_output: bool) -> None:
        super().__init__()
        self.keep_output = keep_output
        self.linear, self.norm, self.head = nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.keep_output:
            z = self.linear(x)
            flat = self.norm(z.reshape(-1, 3))
        else:
            flat = self.norm(self.linear(x).reshape(-1, 3))
        return self.head(flat.reshape(x.shape[0], -1, 3).relu())


def linear_norm(keep_output: bool) -> nn.Module:
    torch.manual_seed(0)
    return with_statistics(LinearNorm(keep_output))


class Concatenated(nn.Module):
    """Two convolutions' outputs concatenated along the channels, then a BatchNorm (DenseNet's pattern): the
    concatenation's node holds each layer's call with the layer's output before its rule, for the merge."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 2, 3, padding=1), nn.Conv2d(3, 2, 3, padding=1)
        self.norm, self.head = nn.BatchNorm2d(4), nn.Linear(4 * 64, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.cat([self.a(x), self.b(x)], dim=1)).relu().flatten(1))


def concatenated() -> nn.Module:
    torch.manual_seed(0)
    return with_statistics(Concatenated())


@pytest.fixture
def no_collector() -> Iterator[None]:
    """The garbage collector off for the test: what is freed is freed by reference counting."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def watch_outputs(model: nn.Module) -> tuple[list[weakref.ref], Callable[[], None]]:
    """Weak references to the output of every call of the model's layers (and to its base, for a view), filled by
    forward hooks; and the function that removes the hooks."""
    refs: list[weakref.ref] = []

    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        refs.append(weakref.ref(output))
        if output._base is not None:
            refs.append(weakref.ref(output._base))

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    return refs, lambda: [handle.remove() for handle in handles]


def gradient_times_input(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """LRP-0's relevance of the first output unit: what CP-LRP and AttnLRP give on a piecewise-linear model with
    merged BatchNorms."""
    x = x.detach().clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(model(x)[..., 0].sum(), x)
    return (x * grad).detach()


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "cnn": (small_bn_cnn, (2, 3, 8, 8)),
    "linear-norm": (lambda: linear_norm(keep_output=True), (2, 5, 4)),
    "linear-norm-temporary": (lambda: linear_norm(keep_output=False), (2, 5, 4)),
    "concatenated": (concatenated, (2, 3, 8, 8)),
}
MAPPERS: dict[str, Callable[[], object]] = {
    "CPLRP": CPLRP,
    "AttnLRP": AttnLRP,
    "EpsilonPlus": EpsilonPlus,
    "LRP-0": lambda: UniformEpsilon(0.0, stabilizer=1e-14),  # the ε-rule on every layer, merged with the norms
}


def explain(model: nn.Module, lrp: LRP, x: torch.Tensor) -> torch.Tensor:
    return lrp(TensorDict(x=x, batch_size=[x.shape[0]]))["relevance", "x"].detach()


@pytest.mark.parametrize("inside", [False, True], ids=["outside-a-context", "inside-a-context"])
@pytest.mark.parametrize("create_graph", [False, True], ids=["plain", "create_graph"])
@pytest.mark.parametrize("mapper", sorted(MAPPERS))
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_a_call_frees_its_layer_outputs_when_it_ends(no_collector, model_name, mapper, create_graph, inside):
    make, shape = MODELS[model_name]
    model = make()
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    lrp = LRP(model, rule_mapper=MAPPERS[mapper](), in_keys=["x"], out_keys=["y"], create_graph=create_graph, target=0)
    refs, remove = watch_outputs(model)
    if inside:
        with lrp:
            relevance = explain(model, lrp, x)
            alive = sum(ref() is not None for ref in refs)
    else:
        relevance = explain(model, lrp, x)
        alive = sum(ref() is not None for ref in refs)
    remove()
    assert len(refs) >= 2, "no layer output was watched"
    assert alive == 0, f"{alive} of {len(refs)} layer outputs (or their bases) outlive the call"
    if mapper != "EpsilonPlus":
        assert relative_error(relevance, gradient_times_input(model, x)) <= 1e-12


@pytest.mark.parametrize("mapper", ["CPLRP", "AttnLRP"])
def test_layer_outputs_over_tokens_are_freed_even_by_the_collector(mapper):
    """A Linear over tokens returns a view of its product, and the record on that base held the view: a cycle through
    the tensors' own references, which the garbage collector cannot see, kept both for good."""
    model = linear_norm(keep_output=True)
    x = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(1), dtype=F64)
    refs, remove = watch_outputs(model)
    with LRP(model, rule_mapper=MAPPERS[mapper](), in_keys=["x"], out_keys=["y"], target=0) as lrp:
        explain(model, lrp, x)
    remove()
    gc.collect()
    assert sum(ref() is not None for ref in refs) == 0


@pytest.mark.parametrize("mapper", ["CPLRP", "AttnLRP"])
def test_a_norm_merges_into_a_layer_whose_output_is_gone(mapper):
    """The BatchNorm reads a view of the base of the layer's output, the output itself gone (``lin(x).reshape``):
    it is still merged into the layer, as where the output is kept; its ε-rule would give another relevance."""
    x = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(1), dtype=F64)
    results = []
    for keep_output in (True, False):
        model = linear_norm(keep_output)
        results.append(
            explain(model, LRP(model, rule_mapper=MAPPERS[mapper](), in_keys=["x"], out_keys=["y"], target=0), x)
        )
    assert relative_error(results[1], results[0]) <= 1e-12
    assert relative_error(results[1], gradient_times_input(model, x)) <= 1e-12


class ViewEpsilonRule(EpsilonRule):
    """The ε-rule of a rule of one's own that returns its output rescaled through :func:`scale_gradient`: a view of
    the layer's output, which over tokens is itself a view of the layer's product (a sibling view of one base)."""

    def rewrite(self, module, registration, inputs, output):
        return scale_gradient(output, self._scale(output, 1))


@pytest.mark.parametrize("keep_output", [True, False], ids=["kept", "temporary"])
def test_a_norm_merges_into_a_layer_whose_rule_returns_a_view_of_its_output(keep_output):
    """A layer's rule of one's own that returns a view of the layer's output over tokens (``scale_gradient``) left its
    record holding that output weakly, attached to the view and the base neither of which holds it: once the output
    was gone, the BatchNorm after it found no layer to merge into and took its own ε-rule (0.72 off the same rule
    returning a fresh tensor, relative L2, ε = 0.5). It merges as with the built-in ε-rule."""
    x = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(1), dtype=F64)
    results = []
    for rule in (EpsilonRule(epsilon=0.5), ViewEpsilonRule(epsilon=0.5)):
        model = linear_norm(keep_output)
        mapper = BaseRuleMapper(rule_mapper={nn.Linear: rule}, stabilizer=0.5)
        results.append(explain(model, LRP(model, rule_mapper=mapper, in_keys=["x"], out_keys=["y"], target=0), x))
    assert relative_error(results[1], results[0]) <= 1e-12
    assert relative_error(results[0], gradient_times_input(linear_norm(keep_output), x)) > 1e-3  # the ε-rule tells
