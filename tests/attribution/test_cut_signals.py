"""A part of the signal computed without gradient and added back is named: its relevance stops there, silently."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import CPLRP, LRP, AttnLRP, BaseRuleMapper, EpsilonPlus
from tdhook.attribution._cut_signals import CUT_SIGNAL

F64 = torch.float64
NAMED = "adds back to the signal a part it computed from the explained inputs without gradient"


def _no_grad(f: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return f(h)


def _written(h: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    y = h.clone()
    y[:, :2] = part
    return y


def _detached_in_place(part: torch.Tensor) -> torch.Tensor:
    return part.detach_()


class Residual(nn.Module):
    """``b(part(a(x)) ...)``: a part computed from the hidden state ``h = a(x)``, combined with it by ``join``."""

    def __init__(self, join: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.a, self.mix, self.b = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False), nn.Linear(4, 2, bias=False)
        self.join = join

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.join(self, self.a(x)))


# Each loses the relevance of the part computed without gradient: the input relevance does not sum to the logit.
CUT = {
    "h + mix(h) under no_grad": lambda m, h: h + _no_grad(m.mix, h),
    "h + mix(h).detach()": lambda m, h: h + m.mix(h).detach(),
    "mix(h).detach() - h": lambda m, h: m.mix(h).detach() - h,
    "h += mix(h).detach()": lambda m, h: h.__iadd__(m.mix(h).detach()),
    "a layer run on the detached part: h + mix(relu(h).detach())": lambda m, h: h + m.mix(torch.relu(h).detach()),
    "cat([h, mix(h) under no_grad])[..., :4] + ...": lambda m, h: torch.cat([h, _no_grad(m.mix, h)], -1)[..., ::2] * 2,
    "h + relu(mix(h)) under no_grad": lambda m, h: h + _no_grad(lambda v: torch.relu(m.mix(v)), h),
    "h + mix(h).data": lambda m, h: h + m.mix(h).data,
    "h + softmax(mix(h)) under no_grad": lambda m, h: h + _no_grad(lambda v: torch.softmax(m.mix(v), -1), h),
    "h + softmax(mix(h).detach())": lambda m, h: h + torch.softmax(m.mix(h).detach(), dim=-1),
    "torch.where(h > 0, h, mix(h).detach())": lambda m, h: torch.where(h > 0, h, m.mix(h).detach()),
    "torch.lerp(h, mix(h).detach(), 0.3)": lambda m, h: torch.lerp(h, m.mix(h).detach(), 0.3),
    "h.index_add(1, i, mix(h).detach())": lambda m, h: h.index_add(1, torch.arange(4), m.mix(h).detach()),
    "h + h.new_tensor(mix(h).detach())": lambda m, h: h + h.new_tensor(m.mix(h).detach()),
    "y = h.clone(); y[:, :2] = mix(h).detach()[:, :2]": lambda m, h: _written(h, m.mix(h).detach()[:, :2]),
    "p = mix(h); p.detach_(); h + p": lambda m, h: h + _detached_in_place(m.mix(h)),
}
# None of these loses relevance: a held factor passes it through the other, a shape read carries no value.
KEPT = {
    "a held gate: h * sigmoid(mix(h)).detach()": lambda m, h: h * torch.sigmoid(m.mix(h)).detach(),
    "a held scale: h / h.norm().detach()": lambda m, h: h / h.norm(dim=-1, keepdim=True).detach(),
    "a mask made under no_grad: torch.where(mask, h, 0)": lambda m, h: torch.where(_no_grad(lambda v: v > 0, h), h, 0),
    "zeros_like(h) under no_grad": lambda m, h: h + _no_grad(torch.zeros_like, h),
    "a weight computed under no_grad: h + mix.weight.sum()": lambda m, h: h + _no_grad(lambda _: m.mix.weight.sum(), h),
    "a detached parameter: h * mix.weight[0].detach()": lambda m, h: h * m.mix.weight[0].detach(),
    "a mask cast to h's dtype under no_grad: h * (h > 0).to(h)": lambda m, h: h * _no_grad(lambda v: (v > 0).to(v), h),
    "a constant cast like h under no_grad: h + ones.to(h)": lambda m, h: h + _no_grad(torch.ones(4).to, h),
    "a gate detached in place: g = sigmoid(mix(h)); g.detach_(); h * g": (
        lambda m, h: h * _detached_in_place(torch.sigmoid(m.mix(h)))
    ),
    "a weight detached in place: h + (mix.weight * 2).detach_()": (
        lambda m, h: h + _detached_in_place(m.mix.weight[0] * 2)
    ),
}


def explain(model: nn.Module, mapper) -> tuple[LRP, TensorDict]:
    torch.manual_seed(1)
    lrp = LRP(model, mapper, in_keys=["x"], out_keys=["y"])
    return lrp, lrp(TensorDict(x=torch.randn(5, 4, dtype=F64), batch_size=[5]))


@pytest.mark.parametrize("preset", [EpsilonPlus, AttnLRP, CPLRP, BaseRuleMapper], ids=lambda p: p.__name__)
@pytest.mark.parametrize("name", sorted(CUT))
def test_a_part_computed_without_gradient_and_added_back_is_named(name: str, preset):
    """Such a part is a constant to the relevance pass: what reaches it stops there, as at a bias. A two-layer net
    adding back a part computed under no_grad kept 0.66 to 1.09 of the logit, and -35.7 of it where the part
    cancelled the rest, with no word and strict=True passing."""
    torch.manual_seed(0)
    model = Residual(CUT[name]).double()
    with pytest.warns(UserWarning, match=NAMED):
        lrp, td = explain(model, preset())
    assert CUT_SIGNAL in [call.function for call in lrp.coverage().plain_gradient]
    with pytest.raises(ValueError, match=NAMED):
        explain(Residual(CUT[name]).double(), preset(strict=True))


@pytest.mark.parametrize("name", sorted(KEPT))
def test_a_held_factor_or_a_value_read_for_its_shape_is_not_named(name: str):
    torch.manual_seed(0)
    model = Residual(KEPT[name]).double()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lrp, _ = explain(model, CPLRP(strict=True))
    assert lrp.coverage().plain_gradient == ()


class Cycles(nn.Module):
    """A recurrence whose early cycles run without gradient (as some reasoning models train): the hidden state of
    the last cycle, the only one with gradient, starts from theirs."""

    def __init__(self, cycles_with_gradient: int) -> None:
        super().__init__()
        self.step, self.head = nn.Linear(8, 4, bias=False), nn.Linear(4, 2, bias=False)
        self.cycles_with_gradient = cycles_with_gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.zeros_like(x)
        for cycle in range(3):
            with torch.set_grad_enabled(torch.is_grad_enabled() and cycle >= 3 - self.cycles_with_gradient):
                z = torch.relu(self.step(torch.cat([z, x], -1)))
        return self.head(z)


def test_a_recurrence_whose_first_cycles_run_without_gradient_is_named_and_conserves_with_gradient_everywhere():
    torch.manual_seed(0)
    x = torch.randn(6, 4, dtype=F64)
    for cycles, named in ((1, True), (3, False)):
        model = Cycles(cycles).double()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            td = LRP(model, EpsilonPlus(epsilon=1e-12), in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[6]))
        assert any(NAMED in str(w.message) for w in caught) == named
        if not named:  # every cycle with gradient: the relevance sums to the logit (no biases)
            logit = td["y"].max(-1).values
            torch.testing.assert_close(td["relevance", "x"].sum(-1), logit, rtol=1e-9, atol=1e-12)


class Shifted(nn.Module):
    """A shift constant along the last dimension, detached, before a function its output does not depend on: a
    softmax's stable form (``sim - sim.amax(-1, keepdim=True).detach()``), a mean taken out before a layer norm."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 6, bias=False), nn.Linear(6, 2, bias=False)
        self.norm, self.softmax, self.kind = nn.LayerNorm(6, bias=False), nn.Softmax(-1), kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.kind == "softmax":
            return self.b(h * torch.softmax(h - h.amax(-1, keepdim=True).detach(), dim=-1))
        if self.kind == "nn.Softmax":
            return self.b(h * self.softmax(h - h.amax(-1, keepdim=True).detach()))
        if self.kind == "layer norm":
            return self.b(self.norm(h - h.mean(-1, keepdim=True).detach()))
        if self.kind == "a layer, then a softmax":  # the layer reads the shift first: its share is lost there
            shifted = h - h.amax(-1, keepdim=True).detach()
            return self.b(shifted * 0.5) + self.b(torch.softmax(shifted, -1))
        return self.b(h - h.mean(-1, keepdim=True).detach())  # read by a layer: the mean's share is lost


@pytest.mark.parametrize("preset", [EpsilonPlus, AttnLRP, CPLRP], ids=lambda p: p.__name__)
@pytest.mark.parametrize("kind", ["softmax", "nn.Softmax", "layer norm", "a layer", "a layer, then a softmax"])
def test_a_detached_shift_is_named_only_where_a_function_that_ignores_it_does_not_read_it(kind: str, preset):
    """A stable softmax's detached maximum (transformers' Evolla computes its attention so) was named, and refused
    with strict=True, though the softmax's output does not depend on it and the relevance equals that of the model
    without the shift (0.0 apart)."""
    torch.manual_seed(0)
    model = Shifted(kind).double()
    if kind in ("a layer", "a layer, then a softmax"):
        with pytest.warns(UserWarning, match=NAMED):
            explain(model, preset())
        return
    if kind in ("softmax", "nn.Softmax") and preset is EpsilonPlus:  # the softmax keeps its plain gradient there
        with pytest.warns(UserWarning) as caught:
            explain(model, preset())
        assert not any(NAMED in str(w.message) for w in caught)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lrp, _ = explain(model, preset(strict=True))
    assert lrp.coverage().plain_gradient == ()


class Chunked(nn.Module):
    """A sequence run by an LSTM in two chunks, the state detached between them (truncated backpropagation)."""

    def __init__(self, detached: bool) -> None:
        super().__init__()
        self.lstm, self.head, self.detached = nn.LSTM(4, 5, batch_first=True), nn.Linear(5, 2, bias=False), detached

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, (h, c) = self.lstm(x[:, :3])
        state = (h.detach(), c.detach()) if self.detached else (h, c)
        out, _ = self.lstm(x[:, 3:], state)
        return self.head(out[:, -1])


@pytest.mark.parametrize("detached", [True, False])
def test_a_recurrent_state_computed_without_gradient_is_named(detached: bool):
    torch.manual_seed(0)
    model = Chunked(detached).double()
    x = torch.randn(3, 6, 4, dtype=F64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        LRP(model, EpsilonPlus(), in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[3]))
    assert any(NAMED in str(w.message) and "'lstm' (LSTM)" in str(w.message) for w in caught) == detached
