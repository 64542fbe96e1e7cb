"""Calls whose linearity depends on their arguments: named in the coverage report where they are not piecewise linear
(a product over groups, a grid computed from activations, a factor given by keyword), left alone where they are."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import CPLRP, LRP, AttnLRP, BaseRuleMapper, EpsilonPlus
from tdhook.attribution._nonlinear_calls import function_kind

F64 = torch.float64
GROUPS = torch.tensor([0, 0, 1, 1, 2, 2])


class Between(nn.Module):
    """Linear(4, 6), a call of its output in the model's own forward, then a head from the call's ``width``."""

    def __init__(self, call: Callable[[torch.Tensor], torch.Tensor], width: int = 3) -> None:
        super().__init__()
        self.inner, self.call, self.head = nn.Linear(4, 6, bias=False), call, nn.Linear(width, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.call(self.inner(x)))


def _groups(h: torch.Tensor) -> torch.Tensor:
    return GROUPS.expand(len(h), 6)


def _zeros(h: torch.Tensor) -> torch.Tensor:
    return torch.zeros(len(h), 3, dtype=h.dtype)


def explain(model: nn.Module, mapper, batch: int = 3) -> tuple[torch.Tensor, torch.Tensor, list[str], LRP]:
    """The relevance of the first output's inputs, the output, the coverage warnings and the wrapper."""
    model = model.double()
    x = torch.randn(batch, 4, dtype=F64)
    lrp = LRP(model, mapper, in_keys=["x"], out_keys=["y"], target=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        relevance = lrp(TensorDict(x=x, batch_size=[batch]))["relevance", "x"]
    messages = [str(w.message) for w in caught if "no rule covers it" in str(w.message)]
    return relevance, model(x)[:, 0].detach(), messages, lrp


def gradient_times_input(model: nn.Module, batch: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(batch, 4, dtype=F64, requires_grad=True)
    output = model(x)[:, 0]
    return x, (x * torch.autograd.grad(output.sum(), x)[0]).detach()


# Products over the groups of a graph's or a set's elements: each group's two factors take the whole output each.
PRODUCT_REDUCTIONS = {
    "Tensor.scatter_reduce": lambda h: _zeros(h).scatter_reduce(-1, _groups(h), h, reduce="prod", include_self=False),
    "Tensor.scatter_reduce_": lambda h: _zeros(h).scatter_reduce_(-1, _groups(h), h, "prod", include_self=False),
    "torch.scatter_reduce": lambda h: torch.scatter_reduce(_zeros(h), -1, _groups(h), h, "prod", include_self=False),
    "Tensor.index_reduce": lambda h: _zeros(h).index_reduce(-1, GROUPS, h, "prod", include_self=False),
    "Tensor.index_reduce_": lambda h: _zeros(h).index_reduce_(-1, GROUPS, h, reduce="prod", include_self=False),
    "torch.segment_reduce": lambda h: torch.segment_reduce(h.T, "prod", lengths=torch.tensor([2, 2, 2])).T,
}


@pytest.mark.parametrize("name", sorted(PRODUCT_REDUCTIONS))
def test_a_product_over_groups_is_named_with_its_reduction(name: str):
    """``scatter_reduce(..., reduce="prod")`` was classed piecewise linear by its name: between two Linear layers,
    the relevance summed to exactly twice the explained output (two factors per group) with no warning."""
    torch.manual_seed(0)
    relevance, output, messages, lrp = explain(Between(PRODUCT_REDUCTIONS[name]), BaseRuleMapper())
    torch.testing.assert_close(relevance.sum(-1), 2 * output)  # gradient × input of a product of two factors
    reduction = name.split(".")[1].rstrip("_")
    assert len(messages) == 1 and f"computes {reduction} (reduce='prod') in its own forward" in messages[0], messages
    assert [call.function for call in lrp.coverage().plain_gradient] == [f"{reduction} (reduce='prod')"]
    strict = LRP(Between(PRODUCT_REDUCTIONS[name]).double(), BaseRuleMapper(strict=True), in_keys=["x"], out_keys=["y"])
    with pytest.raises(ValueError, match=rf"the model itself \(Between\) computes {reduction} \(reduce='prod'\)"):
        strict(TensorDict(x=torch.randn(2, 4, dtype=F64), batch_size=[2]))


PIECEWISE_LINEAR_REDUCTIONS = {
    **{
        f"scatter_reduce {r}": lambda h, r=r: _zeros(h).scatter_reduce(-1, _groups(h), h, r, include_self=False)
        for r in ("sum", "mean", "amax", "amin")
    },
    "scatter_reduce mean, with self": lambda h: h[:, :3].scatter_reduce(-1, _groups(h), h, "mean"),
    "scatter_reduce prod of a constant": lambda h: h[:, :3].scatter_reduce(-1, _groups(h), torch.ones_like(h), "prod"),
    **{
        f"index_reduce {r}": lambda h, r=r: _zeros(h).index_reduce(-1, GROUPS, h, r, include_self=False)
        for r in ("mean", "amax", "amin")
    },
    **{
        f"segment_reduce {r}": lambda h, r=r: torch.segment_reduce(h.T, r, lengths=torch.tensor([2, 2, 2])).T
        for r in ("sum", "mean", "max", "min")
    },
    # Selections of an element, or a fixed mix of two order statistics.
    "kthvalue": lambda h: h.view(-1, 3, 2).kthvalue(1, -1).values,
    "median": lambda h: h.view(-1, 3, 2).median(-1).values,
    "nanmedian": lambda h: h.view(-1, 3, 2).nanmedian(-1).values,
    "quantile": lambda h: h.view(-1, 3, 2).quantile(0.3, dim=-1),
    "cummax": lambda h: h[:, :3].cummax(-1).values,
    "cummin": lambda h: h[:, :3].cummin(-1).values,
    "lerp by a number": lambda h: torch.lerp(h[:, :3], h[:, 3:], 0.3),
    "put": lambda h: _zeros(h).flatten().put(torch.arange(h.numel()) // 2, h.flatten(), accumulate=True).view(-1, 3),
    "affine_grid": lambda h: F.affine_grid(h.view(-1, 2, 3), [len(h), 1, 1, 3], align_corners=False).flatten(1)[:, :3],
}


@pytest.mark.parametrize("name", sorted(PIECEWISE_LINEAR_REDUCTIONS))
def test_sums_means_maxima_and_selections_over_groups_need_no_rule(name: str):
    """A sum, mean or maximum over groups (message passing), a selection and an affine grid's positions are piecewise
    linear: no warning under a strict mapper (index_reduce, segment_reduce, the order statistics, lerp and
    affine_grid were refused by their names), and the relevance is gradient × input, conserved without biases."""
    torch.manual_seed(0)
    model = Between(PIECEWISE_LINEAR_REDUCTIONS[name]).double()
    lrp = LRP(model, BaseRuleMapper(strict=True, stabilizer=0.0), in_keys=["x"], out_keys=["y"], target=0)
    x, expected = gradient_times_input(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        relevance = lrp(TensorDict(x=x.detach(), batch_size=[3]))["relevance", "x"]
    assert lrp.coverage().plain_gradient == ()
    torch.testing.assert_close(relevance, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(relevance.sum(-1), model(x)[:, 0].detach(), rtol=1e-10, atol=1e-12)


class Field(nn.Module):
    """A learned feature grid sampled at positions computed from the input (a neural field's lookup)."""

    def __init__(self, keyword: bool = False) -> None:
        super().__init__()
        self.keyword = keyword
        self.positions, self.head = nn.Linear(4, 2, bias=False), nn.Linear(3, 2, bias=False)
        self.field = nn.Parameter(torch.randn(1, 3, 5, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        field, grid = self.field.expand(len(x), -1, -1, -1), self.positions(x).view(-1, 1, 1, 2)
        sampled = (
            F.grid_sample(field, grid=grid, align_corners=False)
            if self.keyword
            else F.grid_sample(field, grid, align_corners=False)
        )
        return self.head(sampled.flatten(1))


class Transformer(nn.Module):
    """A spatial transformer: the input is sampled at an affine grid computed from it by a localisation layer."""

    def __init__(self) -> None:
        super().__init__()
        self.localise, self.head = nn.Linear(4, 6, bias=False), nn.Linear(4, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        image = x.view(-1, 1, 2, 2)
        grid = F.affine_grid(self.localise(x).view(-1, 2, 3), list(image.shape), align_corners=False)
        return self.head(F.grid_sample(image, grid, align_corners=False).flatten(1))


@pytest.mark.parametrize("preset", [BaseRuleMapper, EpsilonPlus, AttnLRP, CPLRP])
@pytest.mark.parametrize("model", [Field, lambda: Field(keyword=True), Transformer], ids=["field", "keyword", "stn"])
def test_a_grid_computed_from_activations_is_named(model, preset):
    """``grid_sample`` was classed a product, linear in each argument alone: at a grid computed from the input and a
    constant field, no warning, and the relevance summed to 0.80, 0.67 and 1.51 of the explained outputs. Bilinear
    sampling is not piecewise linear in its grid (and a spatial transformer's affine_grid is linear)."""
    torch.manual_seed(0)
    _, _, messages, lrp = explain(model(), preset())
    assert len(messages) == 1, messages
    assert "computes grid_sample (at a grid computed from activations) in its own forward" in messages[0]
    assert [call.function for call in lrp.coverage().plain_gradient] == [
        "grid_sample (at a grid computed from activations)"
    ]


def test_a_fixed_grid_samples_linearly():
    """The sampled values at a grid of constants: linear, no warning, LRP-0 is gradient × input."""
    torch.manual_seed(0)
    grid = torch.rand(1, 2, 2, 2, dtype=F64) * 2 - 1
    model = Between(
        lambda h: F.grid_sample(
            h[:, :4].reshape(-1, 1, 2, 2), grid.expand(len(h), -1, -1, -1), align_corners=False
        ).flatten(1),
        4,
    )
    model = model.double()
    lrp = LRP(model, BaseRuleMapper(strict=True, stabilizer=0.0), in_keys=["x"], out_keys=["y"], target=0)
    x, expected = gradient_times_input(model)
    relevance = lrp(TensorDict(x=x.detach(), batch_size=[3]))["relevance", "x"]
    torch.testing.assert_close(relevance, expected, rtol=1e-12, atol=1e-12)


SECOND_FACTORS = {
    "torch.div(a, other=b)": lambda h: torch.div(h[:, :3], other=h[:, 3:]),
    "F.prelu(a, b)": lambda h: F.prelu(h[:, :3], F.relu(h[0, 3:])),
    "torch.lerp(a, b, c)": lambda h: torch.lerp(h[:, :3], h[:, 3:], h[:, :3]),
    "F.batch_norm(a, weight=b)": lambda h: F.batch_norm(h[:, :3], h.new_zeros(3), h.new_ones(3), weight=h[0, 3:]),
}


@pytest.mark.parametrize("preset", [BaseRuleMapper, AttnLRP])
@pytest.mark.parametrize("name", sorted(SECOND_FACTORS))
def test_a_call_whose_second_factor_is_an_activation_is_named(name: str, preset):
    """A division by an activation given by keyword (``torch.div(a, other=b)``), or a slope or a weight computed
    from activations (PReLU, batch_norm) was taken for piecewise linear: the relevance summed to none of the output
    (the division), to 0.67 of it (PReLU; 4.9 under AttnLRP), to twice it (batch_norm), with no warning. lerp by a
    weight computed from activations stays named."""
    torch.manual_seed(0)
    _, _, messages, _ = explain(Between(SECOND_FACTORS[name]), preset(), batch=1)  # batch 1: PReLU's slope is shared
    function = name.split("(")[0].split(".")[-1]
    assert len(messages) == 1 and f"computes {function}" in messages[0], messages


def test_the_kinds_by_arguments():
    assert function_kind(torch.Tensor.scatter_reduce_) == ("scatter_reduce", "by arguments")
    assert function_kind(F.grid_sample) == ("grid_sample", "by arguments")
    assert function_kind(torch.Tensor.median) == ("median", "linear")
