"""A softmax's weights multiplied element by element with an activation (selective-kernel and split attention) are
held constant under AttnLRP, as CP-LRP holds them: the branches they mix take all of the mixture's relevance.

The oracle is the same network with the weights detached by hand; with no bias-like terms, relevance is conserved.
Attention's matrix product with its weights keeps the uniform rule; over one key, the weights are the constant 1,
and the value takes all of the output's relevance.
"""

from __future__ import annotations

import pytest
import timm.layers
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.mappers.transformer import CPLRP, AttnLRP
from tdhook.attribution.rules import gates
from tdhook.attribution.rules._in_place_products import product_in_place
from tests.attribution._helpers import with_statistics
from tests.attribution.rules._helpers import randn
from tests.conftest import relative_error


class MixedPaths(nn.Module):
    """Two convolution paths mixed per channel by a softmax over the paths (SK-ResNet's selective kernel), written
    out; ``held`` detaches the weights (the oracle), ``reshaped`` computes them flat and reshapes them (ResNeSt's
    radix softmax)."""

    def __init__(self, held: bool = False, reshaped: bool = False) -> None:
        super().__init__()
        self.paths = nn.ModuleList(nn.Conv2d(3, 4, k, padding=k // 2, bias=False) for k in (1, 3))
        self.reduce, self.select = nn.Linear(4, 6, bias=False), nn.Linear(6, 8, bias=False)
        self.head = nn.Linear(4, 3, bias=False)
        self.held, self.reshaped = held, reshaped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        paths = torch.stack([torch.relu(path(x)) for path in self.paths], 1)  # (B, 2, 4, H, W)
        logits = self.select(torch.relu(self.reduce(paths.sum(1).mean((2, 3)))))
        if self.reshaped:
            weights = torch.softmax(logits.view(-1, 2, 4), 1).reshape(-1, 8).view(-1, 2, 4, 1, 1)
        else:
            weights = logits.view(-1, 2, 4, 1, 1).softmax(dim=1)
        mixed = (paths * (weights.detach() if self.held else weights)).sum(1)
        return self.head(mixed.mean((2, 3)))


def relevances(model: nn.Module, x: torch.Tensor, mapper, calls: int = 2) -> list[torch.Tensor]:
    """The input relevance of the largest output, from ``calls`` calls in one context (a first call records the
    rules' places, later ones may run without the function rules)."""
    lrp = LRP(TensorDictModule(model, in_keys=["x"], out_keys=["y"]), rule_mapper=mapper)
    with lrp:
        return [lrp(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))["relevance", "x"] for _ in range(calls)]


def largest(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x).max(-1).values


def assert_relevance_of(model: nn.Module, oracle: nn.Module, mapper) -> None:
    """``model``'s relevance, in each call of a context, is ``oracle``'s (given ``model``'s parameters) to 1e-12, and
    sums to the largest output (no bias-like terms)."""
    oracle.load_state_dict(model.state_dict())
    x = randn(2, 3, 5, 5)
    expected = relevances(oracle, x, mapper(), calls=1)[0]
    for relevance in relevances(model, x, mapper()):
        assert relative_error(relevance, expected) <= 1e-12
        torch.testing.assert_close(relevance.flatten(1).sum(1), largest(model, x), rtol=1e-10, atol=0)


@pytest.mark.parametrize("reshaped", [False, True], ids=["softmax over the paths", "flat, reshaped"])
@pytest.mark.parametrize("mapper", [AttnLRP, CPLRP])
def test_weights_mixing_paths_are_held_and_relevance_is_conserved(mapper, reshaped: bool):
    # AttnLRP shared the product uniformly: on SK-ResNet18 it summed to 0.02-0.05 of the logit, on ResNeSt-14 0.1.
    torch.manual_seed(0)
    model, oracle = MixedPaths(reshaped=reshaped).double(), MixedPaths(held=True, reshaped=reshaped).double()
    assert_relevance_of(model, oracle, mapper)


def test_timm_selective_kernel_conserves_under_attnlrp():
    torch.manual_seed(0)
    model = nn.Sequential(timm.layers.SelectiveKernel(4, 6), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 3))
    model = with_statistics(model)
    with torch.no_grad():  # no bias-like terms: relevance sums to the output
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("bias", "running_mean")):
                tensor.zero_()
    x = randn(2, 4, 6, 6)
    for relevance in relevances(model, x, AttnLRP()):
        torch.testing.assert_close(relevance.flatten(1).sum(1), largest(model, x), rtol=1e-10, atol=0)


class Attending(nn.Module):
    """``softmax(q · kᵀ) @ v`` over 3 tokens: the weights times the values is a matrix product (attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(4, 4, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(self.q(x) @ self.k(x).transpose(-2, -1), -1)
        return (weights @ self.v(x)).sum((1, 2)).unsqueeze(-1)


def test_attention_weights_in_a_matrix_product_keep_the_uniform_rule():
    torch.manual_seed(0)
    model, x = Attending().double(), randn(2, 3, 4)
    relevance = relevances(model, x, AttnLRP(), calls=1)[0]
    held = relevances(model, x, CPLRP(), calls=1)[0]
    assert relative_error(relevance, held) > 0.1  # AttnLRP passes half to the weights, CP-LRP holds them


class AttendingWrittenOut(Attending):
    """:class:`Attending` with the weights' product with the values written as a broadcast product, summed over the
    keys."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(self.q(x) @ self.k(x).transpose(-2, -1), -1)
        return (weights.unsqueeze(-1) * self.v(x).unsqueeze(-3)).sum(-2).sum((1, 2)).unsqueeze(-1)


@pytest.mark.parametrize("mapper", [AttnLRP, CPLRP])
def test_attention_weights_in_a_broadcast_product_keep_the_matrix_products_rule(mapper):
    # Written out, the product was taken for weights mixing branches and held under AttnLRP: 0.11 relative L2 from
    # the matrix product's relevance (0.20 over two blocks), with no warning.
    torch.manual_seed(0)
    model, written = Attending().double(), AttendingWrittenOut().double()
    written.load_state_dict(model.state_dict())
    x = randn(2, 3, 4)
    expected = relevances(model, x, mapper(), calls=1)[0]
    for relevance in relevances(written, x, mapper()):
        assert relative_error(relevance, expected) <= 1e-12


def test_weighing_factors_need_two_activations_one_of_them_weights():
    x = randn(2, 3).requires_grad_(True)
    mark_weights, weighing_factors = gates.mark_weights, gates.weighing_factors
    weights = mark_weights(torch.softmax(x * 1, -1))
    assert weighing_factors((x * 2, weights)) == [False, True]
    assert weighing_factors((weights, x * 2)) == [True, False]
    assert weighing_factors((weights, weights)) is None
    assert weighing_factors((x * 2, x * 3)) is None
    assert weighing_factors((x, weights)) is None  # a leaf is no activation


class OneKey(nn.Module):
    """Tokens attending to one key, their mean (a pooled query's attention): ``softmax(q · kᵀ)`` over one key is the
    constant 1. ``fused``: ``F.scaled_dot_product_attention``; ``oracle``: the value itself, broadcast."""

    def __init__(self, fused: bool = False, oracle: bool = False) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(4, 4, bias=False) for _ in range(3))
        self.head = nn.Linear(12, 3, bias=False)
        self.fused, self.oracle = fused, oracle

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = x.mean(1, keepdim=True)
        q, k, v = self.q(torch.relu(x)), self.k(pooled), self.v(pooled)
        if self.oracle:
            out = v.expand(-1, 3, -1)
        elif self.fused:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        else:
            out = torch.softmax(q @ k.transpose(-2, -1), -1) @ v
        return self.head(out.flatten(1))


@pytest.mark.parametrize("fused", [False, True], ids=["softmax", "scaled_dot_product_attention"])
def test_attention_over_one_key_passes_all_relevance_to_the_value(fused: bool):
    # The uniform rule gave the constant weights half of the output's relevance, which they passed to nothing: on
    # iFormer at 16 pixels (one token per attention) AttnLRP summed to 1.05 and -14.4 times the logit (1.00 now).
    torch.manual_seed(0)
    model, oracle = OneKey(fused=fused).double(), OneKey(oracle=True).double()
    oracle.load_state_dict(model.state_dict())
    x = randn(2, 3, 4)
    expected = relevances(oracle, x, AttnLRP(), calls=1)[0]
    for relevance in relevances(model, x, AttnLRP()):
        assert relative_error(relevance, expected) <= 1e-12
        torch.testing.assert_close(relevance.flatten(1).sum(1), largest(model, x), rtol=1e-10, atol=0)


class MixedInPlace(MixedPaths):
    """:class:`MixedPaths` with the branches weighed by a product spelled as ``form``: in place, with ``multiply``,
    or as ``"paths * weights"`` and ``"weights * paths"`` (the oracles)."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        paths = torch.stack([torch.relu(path(x)) for path in self.paths], 1)  # (B, 2, 4, H, W)
        logits = self.select(torch.relu(self.reduce(paths.sum(1).mean((2, 3)))))
        weights = logits.view(-1, 2, 4, 1, 1).softmax(dim=1)
        if self.form == "paths * weights":
            mixed = paths * weights
        elif self.form == "paths.mul_(weights)":
            mixed = paths.mul_(weights)
        elif self.form == "paths *= weights":
            paths *= weights
            mixed = paths
        elif self.form == "paths.multiply_(weights)":
            mixed = paths.multiply_(weights)
        elif self.form == "torch.multiply(paths, weights)":
            mixed = torch.multiply(paths, weights)
        elif self.form == "paths.multiply(weights)":
            mixed = paths.multiply(weights)
        else:  # the weights written into, a copy of them (the softmax's backward reads its own output)
            weights = weights.expand_as(paths).clone()
            mixed = weights * paths if self.form == "weights * paths" else weights.mul_(paths)
        return self.head(mixed.sum(1).mean((2, 3)))


@pytest.mark.parametrize(
    ("form", "oracle"),
    [
        ("paths.mul_(weights)", "paths * weights"),
        ("paths *= weights", "paths * weights"),
        ("paths.multiply_(weights)", "paths * weights"),
        ("weights.mul_(paths)", "weights * paths"),
        ("torch.multiply(paths, weights)", "paths * weights"),
        ("paths.multiply(weights)", "paths * weights"),
    ],
)
@pytest.mark.parametrize("mapper", [AttnLRP, CPLRP])
def test_weights_mixing_paths_in_any_spelling_get_the_relevance_of_paths_times_weights(mapper, form: str, oracle: str):
    # Written in place, or with ``mul``'s alias ``multiply``, the product of the weights and the branches got the
    # uniform rule under AttnLRP: 0.49-0.50 relative error against the relevance of ``paths * weights``.
    torch.manual_seed(0)
    assert_relevance_of(MixedInPlace(form).double(), MixedInPlace(oracle).double(), mapper)


def test_weights_written_into_are_no_weights_after_the_write():
    # The product of the weights and a signal mixes nothing further: a later product with it gets its own rule.
    x = randn(2, 3).requires_grad_(True)
    weights = gates.mark_weights(torch.softmax(x * 1, -1).clone())
    held = weights.detach().clone()
    written = product_in_place(torch.Tensor.mul_, weights, x * 2, hold_gates=False)
    assert written is weights and not getattr(written, gates.WEIGHTS_MARK, False)
    (grad,) = torch.autograd.grad(written.sum(), x)
    torch.testing.assert_close(grad, 2 * held, rtol=1e-12, atol=0)  # the weights held: the signal's gradient alone
