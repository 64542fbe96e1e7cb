"""Later calls of one context on other inputs of the same shapes, against the same calls in the function mode.

A plan (see :mod:`tdhook.attribution._function_rule_plan`) checks the paths to its products' nodes and the number
of nodes a call creates. A branch the forward takes on a value the mode does not follow (a flag of the model, a
mask that is not explained) can make a graph of as many nodes, with the same types on those paths, where a product
takes a constant instead of an activation, or a held gate reaches one product more: the mode rules them otherwise.

The oracles: the uniform rule written into the forward pass by hand (bias-free linear layers, so that the rest is
gradient × input), and a fresh context's first call, which runs in the mode.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import CPLRP, LRP, AttnLRP
from tests.attribution._plan_helpers import F64, halved
from tests.conftest import relative_error


class Factors(nn.Module):
    """``out(q(x) * f)``: ``f`` is ``k(x)`` where the mask ``m`` sums above zero, else (``kind``) ``k(x)`` detached,
    a buffer, or a tensor computed from a parameter alone, with as many autograd nodes of the same types."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.out = nn.Linear(4, 6, bias=False), nn.Linear(4, 6, bias=False), nn.Linear(6, 3, bias=False)
        self.p = nn.Parameter(torch.randn(5, 6))
        self.register_buffer("c", torch.randn(5, 6))
        self.kind = kind

    def factor(self, b: torch.Tensor, activation: bool) -> torch.Tensor:
        if self.kind == "detached":
            return b if activation else b.detach()
        if self.kind == "buffer":
            return b if activation else self.c + 0.0 * b.detach()
        return b * 1.0 + 0.0 if activation else self.p * 1.0 + 0.0 * b.detach()  # from a parameter alone

    def forward(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        a, b = self.q(x), self.k(x)
        return self.out(a * self.factor(b, bool(m.sum() > 0)))

    def by_hand(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """The uniform rule on the product of two activations, none on a product with a constant."""
        leaf = x.clone().requires_grad_(True)
        a, b = self.q(leaf), self.k(leaf)
        activation = bool(m.sum() > 0)
        product = a * self.factor(b, activation)
        logits = self.out(halved(product) if activation else product)
        (grad,) = torch.autograd.grad(logits.max(-1).values.sum(), leaf)
        return leaf.detach() * grad


class GateSignal(nn.Module):
    """A sigmoid gate held in ``q(x) · g``; where the mask sums above two, it also gates ``k(x)``, else ``k(x)`` takes
    it detached: the same nodes, but a gradient reaches the gate's node where the mode holds it in both products."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v = (nn.Linear(4, 6, bias=False) for _ in range(3))
        self.out = nn.Linear(6, 3, bias=False)

    def forward(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        g = torch.sigmoid(self.v(x))
        return self.out(self.q(x) * g + self.k(x) * (g if m.sum() > 2 else g.detach()))


class MaskedAttention(nn.Module):
    """Two heads of fused attention under a mask that changes from call to call (the graph does not)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v = (nn.Linear(4, 6, bias=False) for _ in range(3))
        self.out = nn.Linear(6, 3, bias=False)

    def forward(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.view(5, 2, 3).transpose(0, 1) for t in (self.q(x), self.k(x), self.v(x)))
        mask = (m > 0).unsqueeze(0).expand(5, 5)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(F.silu(out.transpose(0, 1).reshape(5, 6)) * self.q(x))


def inputs(masks: list[list[float]]) -> list[TensorDict]:
    generator = torch.Generator().manual_seed(1)
    return [
        TensorDict(x=torch.randn(5, 4, generator=generator, dtype=F64), m=torch.tensor(m, dtype=F64), batch_size=[5])
        for m in masks
    ]


def in_context_and_in_mode(model: nn.Module, preset: type, calls: list[TensorDict]) -> tuple[list, list]:
    """The relevance of ``calls`` made in one context, and of each made in a fresh context (in the mode)."""
    explained = TensorDictModule(model.to(F64), in_keys=["x", "m"], out_keys=["y"])
    lrp = LRP(explained, preset(), in_keys=["x"])
    with lrp:
        in_context = [lrp(td.clone())["relevance", "x"] for td in calls]
    in_mode = [LRP(explained, preset(), in_keys=["x"])(td.clone())["relevance", "x"] for td in calls]
    return in_context, in_mode


@pytest.mark.parametrize("preset", [AttnLRP, CPLRP])
@pytest.mark.parametrize("kind", ["detached", "buffer", "parameter"])
def test_a_product_fed_a_constant_on_a_branch_the_plan_does_not_see_runs_in_the_mode(applied, kind: str, preset):
    """The first two calls multiply two activations (the second follows the plan); the third, on a mask that sums
    below zero, multiplies an activation by a constant: the plan halved that product's gradient, half the
    relevance of the mode's."""
    model = Factors(kind)
    calls = inputs([[1, 0, 0, 0, 0], [1, 0, 0, 0, 0], [-1, 0, 0, 0, 0], [1, 0, 0, 0, 0]])
    in_context, in_mode = in_context_and_in_mode(model, preset, calls)
    for relevance, oracle, td in zip(in_context, in_mode, calls, strict=True):
        expected = model.by_hand(td["x"], td["m"])
        assert relative_error(oracle, expected) <= 1e-12
        assert relative_error(relevance, expected) <= 1e-10
    assert applied[0] is True and applied[1] is False  # the second call follows the plan, the third refuses it


@pytest.mark.parametrize("preset", [AttnLRP, CPLRP])
def test_a_held_gate_that_reaches_one_product_more_runs_in_the_mode(applied, preset):
    """A gate the recording call gave to one product, detached to the other, that a later call gives to both: the
    plan let the second product pass the gate a gradient (0.16 off the mode's relevance)."""
    calls = inputs([[1, 0, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0]])
    in_context, in_mode = in_context_and_in_mode(GateSignal(), preset, calls)
    for relevance, oracle in zip(in_context, in_mode, strict=True):
        assert relative_error(relevance, oracle) <= 1e-10
    assert False in applied
    assert relative_error(in_mode[1], in_mode[0]) > 1e-3  # the calls' relevance differ: the comparison can fail


@pytest.mark.parametrize("preset", [AttnLRP, CPLRP])
def test_calls_on_other_inputs_and_masks_of_the_same_shapes_follow_the_plan(applied, preset):
    """Masks and inputs that change from call to call, with the same graph: every later call follows the plan and
    equals the mode's."""
    masks = [[1, 1, 0, 1, 0], [1, 0, 0, 0, 1], [1, 1, 1, 1, 1], [1, 0, 1, 0, 1]]
    in_context, in_mode = in_context_and_in_mode(MaskedAttention(), preset, inputs(masks))
    assert applied == [True, True, True]
    for relevance, oracle in zip(in_context, in_mode, strict=True):
        assert relative_error(relevance, oracle) <= 1e-10


class NormedProduct(nn.Module):
    """A BatchNorm (in training mode) on one factor of a product whose other factor a flag detaches."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
        g = self.b(x)
        return self.out(self.norm(self.a(x)) * (g.detach() if bool(flag.any()) else g))


@pytest.mark.parametrize("preset", [AttnLRP, CPLRP])
def test_a_call_run_again_moves_running_statistics_once(preset):
    """A call whose graph is not the plan's runs the model again: the run let go must not move a BatchNorm's running
    statistics (it moved them twice: ``num_batches_tracked`` one ahead of the plain calls' per such call)."""
    torch.manual_seed(0)
    model = NormedProduct().to(F64).train()
    plain = NormedProduct().to(F64).train()
    plain.load_state_dict(model.state_dict())
    lrp = LRP(TensorDictModule(model, in_keys=["x", "flag"], out_keys=["y"]), preset(), in_keys=["x"])
    with lrp:
        for i in range(6):
            x, flag = torch.randn(3, 4, dtype=F64), torch.tensor([i % 2 == 1]).expand(3)
            lrp(TensorDict(x=x, flag=flag, batch_size=[3]))
            plain(x, flag)
    assert int(model.norm.num_batches_tracked) == int(plain.norm.num_batches_tracked) == 6
    torch.testing.assert_close(model.norm.running_mean, plain.norm.running_mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(model.norm.running_var, plain.norm.running_var, rtol=1e-12, atol=1e-12)


class LazyNormedProduct(nn.Module):
    """A lazy BatchNorm (in training mode) on one factor of a product: its statistics hold no values before its first
    run."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.norm = nn.LazyBatchNorm1d()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.a(x)) * self.b(x))


def test_a_lazy_norm_not_yet_run_is_explained_and_moves_once_a_call():
    """Keeping the running statistics of a first call that may run again copied a lazy norm's uninitialised ones,
    which raised before the model ran."""
    torch.manual_seed(0)
    model = LazyNormedProduct().to(F64).train()
    lrp = LRP(model, CPLRP(), in_keys=["x"], out_keys=["y"])
    with lrp:
        for _ in range(3):
            lrp(TensorDict(x=torch.randn(3, 4, dtype=F64), batch_size=[3]))
    assert int(model.norm.num_batches_tracked) == 3
