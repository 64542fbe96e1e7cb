"""Writes into a tensor with autograd history that autograd does not record, then the tensor read (float64).

``c.detach().copy_(w)``, ``c.data.copy_(w)``, ``c.data[...] = w``, ``c.data = w`` and a write into ``c`` under
``torch.no_grad()``: ``c``'s gradient still reaches what its values were computed from before the write. Reading
``c`` afterwards was explained silently wrong (against the same model written out of place: 1.0 off, relative L2,
under AttnLRP for an activation overwritten with a weight's values, 11.4 for the reverse; 0.78 and 1.0 under
EpsilonPlus), and now raises at the read, naming the call and the write. The writes themselves stay allowed: a
straight-through estimator written in place, an alias written and read alone, a fresh buffer written through any
path, a tensor replaced whole with gradient enabled afterwards: each is explained as its out-of-place form.

``out=`` writes into an alias (``torch.mul(w, 1, out=c.detach()[:, :3])``) or under ``torch.no_grad()``, and writes
through a NumPy array sharing ``c``'s storage (``c.detach().numpy()[:, :3] = 5``), were not seen at all (against
the same model with ``c`` taking the values out of place: 1.0 off under AttnLRP and CP-LRP and 0.78 under
EpsilonPlus for ``c`` overwritten whole, 2.2 for three of its six columns); they are refused at the read as well. A
NumPy array only read (a log of the values) refuses nothing.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import CPLRP, LRP, AttnLRP, EpsilonPlus
from tests.attribution.rules.test_activation_writes import _explained
from tests.attribution.test_coverage import CubeOfSum

F64 = torch.float64
PRESETS = [AttnLRP, CPLRP, EpsilonPlus]


def _weight(s: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    return 3 * s * torch.ones_like(h)


def _no_grad_copy(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = h.clone()
    with torch.no_grad():
        c.copy_(_weight(s, h))
    return c * g


def _no_grad_scaled(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = h * 1
    with torch.no_grad():
        c.mul_(2)
    return c * g


def _no_grad_gated(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = h * 1
    with torch.no_grad():
        c *= g  # a product with a gate: no rule holds it where autograd records nothing
    return c


def _data_set(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = h.clone()
    c.data = _weight(s, h).detach()
    return c * g


def _weight_data_set(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = s * torch.ones_like(h)  # a weight, to the rules
    c.data = h.detach().clone()  # an activation's values in its place
    return c * g


def _data_set_reshaped(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = h.clone()
    c.data = _weight(s, h).detach()[:, :3]
    return c[:, :3] * g[:, :3]


def _set_into(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = h.clone()
    c.detach().copy_(_weight(s, h))
    b = g * 1
    b[...] = c  # c read into b by a call that gives no result
    return b * g


def _weight_view_data_set(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = (s * torch.ones_like(h))[:, :3]  # a view of a weight, to the rules
    c.data = h.detach()[:, :3].clone()  # an activation's values in its place (the view's storage alone)
    return c * g[:, :3]


def _through(alias, write, read=lambda c, g: c * g):
    """The form ``read(c, g)`` after ``write(alias(c), s, h)``, ``c`` a copy of ``h``."""

    def form(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        c = h.clone()
        write(alias(c), s, h)
        return read(c, g)

    return form


def _weight_through_alias(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = s * torch.ones_like(h)  # a weight, to the rules
    c.detach().copy_(h)  # an activation's values over it
    return c * g


def _view_taken_before(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = h.clone()
    v = c[:, :3]
    c.detach().copy_(_weight(s, h))
    return v * g[:, :3]


def _out_into_alias(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = h.clone()
    torch.mul(_weight(s, h).detach()[:, :3], 1.0, out=c.detach()[:, :3])  # torch allows it: the alias has no grad
    return c * g


def _out_without_gradient(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = h.clone()
    with torch.no_grad():
        torch.add(_weight(s, h), 1.0, out=c)
    return c * g


def _numpy_written(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = h.clone()
    c.detach().numpy()[:, :3] = 5.0  # no mode sees the write, nor the version counter
    return c * g


def _numpy_forced(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = h.clone()
    np.asarray(c.numpy(force=True))[:, 1] = 0.0
    return c * g


def _numpy_of_view(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = h.clone()
    v = c[:, 2:]
    np.asarray(c.detach()[:, 2:])[...] = _weight(s, h).detach()[:, 2:].numpy()
    return v * g[:, 2:]


def _numpy_written_then_rectified(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = h.clone()
    c.detach().numpy()[:, :3] = 5.0
    F.relu(c, inplace=True)  # relu_ runs inside the call the modes see: it reads c
    return c * g


def _rectified_then_numpy_written(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = h.clone()
    array = c.detach().numpy()
    F.relu(c, inplace=True)  # autograd records it; no mode sees the write inside
    array[:, :3] = 5.0
    return c * g


# name: (form, the call named, the write named)
UNRECORDED = {
    "NumPy write, then F.relu(c, inplace=True)": (_numpy_written_then_rectified, "relu", "NumPy array"),
    "F.relu(c, inplace=True), then a NumPy write": (_rectified_then_numpy_written, "mul", "NumPy array"),
    "torch.mul(w, 1, out=c.detach()[:, :3])": (_out_into_alias, "mul", "mul(out=...) through"),
    "no_grad: torch.add(w, 1, out=c)": (_out_without_gradient, "mul", "add(out=...) under torch.no_grad()"),
    "c.detach().numpy()[:, :3] = 5": (_numpy_written, "mul", "NumPy array"),
    "np.asarray(c.numpy(force=True))[:, 1] = 0": (_numpy_forced, "mul", "NumPy array"),
    "v = c[:, 2:], then np.asarray(c.detach()[:, 2:])[...] = w": (_numpy_of_view, "mul", "NumPy array"),
    "c.detach().copy_(w)": (_through(torch.Tensor.detach, lambda a, s, h: a.copy_(_weight(s, h))), "mul", "copy_"),
    "c.data.copy_(w)": (_through(lambda c: c.data, lambda a, s, h: a.copy_(_weight(s, h))), "mul", "copy_"),
    "c.data[:, :2] = w": (
        _through(lambda c: c.data, lambda a, s, h: a.__setitem__(slice(0, 2), 3 * s)),
        "mul",
        "__setitem__",
    ),
    "torch.detach(c).mul_(2)": (_through(torch.detach, lambda a, s, h: a.mul_(2)), "mul", "mul_"),
    "c.detach().detach()[:, 1:].zero_()": (
        _through(lambda c: c.detach().detach()[:, 1:], lambda a, s, h: a.zero_()),
        "mul",
        "zero_",
    ),
    "c.detach().copy_(w), then c read by a layer": (
        _through(torch.Tensor.detach, lambda a, s, h: a.copy_(_weight(s, h)), lambda c, g: c),
        "linear",
        "copy_",
    ),
    "weight c, c.data = h": (_weight_data_set, "mul", "`.data =`"),
    "weight view c, c.data = h": (_weight_view_data_set, "mul", "`.data =`"),
    "c.data = w of another shape": (_data_set_reshaped, "__getitem__", "`.data =`"),
    "weight c, c.detach().copy_(h)": (_weight_through_alias, "mul", "copy_"),
    "v = c[:, :3], then c.detach().copy_(w)": (_view_taken_before, "mul", "copy_"),
    "b = g * 1; b[...] = c after c.detach().copy_(w)": (_set_into, "__setitem__", "copy_"),
    "no_grad: c.copy_(w)": (_no_grad_copy, "mul", "copy_ under torch.no_grad()"),
    "no_grad: c.mul_(2)": (_no_grad_scaled, "mul", "mul_ under torch.no_grad()"),
    "no_grad: c *= g": (_no_grad_gated, "linear", "under torch.no_grad()"),
}


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.__name__)
@pytest.mark.parametrize("name", sorted(UNRECORDED))
def test_a_read_after_a_write_autograd_does_not_record_raises(name: str, preset):
    form, read, write = UNRECORDED[name]
    with pytest.raises(RuntimeError, match="a write autograd does not record") as error:
        _explained(form, preset)
    message = str(error.value)
    assert message.startswith(f"LRP: {read} reads a tensor") or f"{read} (a module" in message
    assert write in message


def _straight_through(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    z = (torch.round(h) - h).detach()
    z += h  # autograd records z's own write
    return z * g


def _alias_read_alone(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = h.clone()
    alias = c.detach()
    alias.mul_(2)
    return alias * g + h


def _fresh_buffer(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    buffer = torch.zeros_like(h)
    buffer.detach().copy_(h.detach())
    buffer.data.add_(1)
    with torch.no_grad():
        buffer.mul_(2)
    return buffer * g + h


def _replaced_whole(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = h.clone()
    c.detach().mul_(2)
    c.copy_(h * 3)  # every value replaced, with gradient: a history of its own
    return c * g


def _read_without_gradient(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = h.clone()
    c.detach().mul_(2)
    picked = c.argmax(-1, keepdim=True)  # an integer: no gradient
    with torch.no_grad():
        total = c.sum(-1, keepdim=True)  # a constant of the new values
    return h * g + picked + total


def _alias_reshaped(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = h.clone()
    alias = c.detach()
    alias.unsqueeze_(0)  # no values written
    alias.requires_grad_(True)
    return c * g


def _numpy_read(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = h.clone()
    total = float(c.detach().numpy().sum()) + float(np.asarray(c.detach()).max())  # read, as a log of it does
    return c * g + total


def _numpy_then_recorded(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = h.clone()
    array = c.numpy(force=True)
    shift = float(array[0, 0])
    c += h  # recorded; the array's values change with c's
    return c * g + shift + float(array[0, 0])


def _out_into_fresh(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    buffer = torch.empty_like(h)
    with torch.no_grad():
        torch.mul(h, 2.0, out=buffer)  # a buffer without history: a constant of h's values
    torch.add(h.detach(), 1.0, out=buffer.detach())
    return buffer * g + h


LOGGED: list = []


def _numpy_logged_then(write):
    """``c`` logged as a NumPy array (``c.detach().numpy()``, as a forward hook logs it), then ``write(c)``."""

    def form(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        c = h + 0
        LOGGED[:] = [c.detach().numpy()]  # the latest kept
        c = write(c)
        return c * g

    return form


ALLOWED = {
    "c logged as NumPy, then F.relu(c, inplace=True)": (
        _numpy_logged_then(lambda c: F.relu(c, inplace=True)),
        lambda s, h, g: F.relu(h) * g,
    ),
    "c logged as NumPy, then nn.ReLU(inplace=True)(c)": (
        _numpy_logged_then(nn.ReLU(inplace=True)),
        lambda s, h, g: F.relu(h) * g,
    ),
    "c logged as NumPy, then F.hardtanh(c, -0.2, 0.2, inplace=True)": (
        _numpy_logged_then(lambda c: F.hardtanh(c, -0.2, 0.2, inplace=True)),
        lambda s, h, g: F.hardtanh(h, -0.2, 0.2) * g,
    ),
    "c logged as NumPy, then c.detach().clamp_(-0.3, 0.3)": (
        _numpy_logged_then(lambda c: (c.detach().clamp_(-0.3, 0.3), c)[1]),
        lambda s, h, g: (h + (h.clamp(-0.3, 0.3) - h).detach()) * g,
    ),
    "c.detach().numpy() read, then c": (_numpy_read, lambda s, h, g: h * g + (h.sum() + h.max()).item()),
    "c.numpy(force=True), then c += h": (
        _numpy_then_recorded,
        lambda s, h, g: (2 * h) * g + h[0, 0].item() + 2 * h[0, 0].item(),
    ),
    "out= into a buffer without history": (_out_into_fresh, lambda s, h, g: (h.detach() + 1) * g + h),
    "c.detach() reshaped and made a leaf in place": (_alias_reshaped, lambda s, h, g: h * g),
    "z = (round(h) - h).detach(); z += h": (_straight_through, lambda s, h, g: (h + (torch.round(h) - h).detach()) * g),
    "an alias written, and only it read": (_alias_read_alone, lambda s, h, g: (2 * h).detach() * g + h),
    "a fresh buffer written through .detach(), .data, no_grad": (
        _fresh_buffer,
        lambda s, h, g: (2 * (h.detach() + 1)) * g + h,
    ),
    "c replaced whole with gradient after": (_replaced_whole, lambda s, h, g: (h * 3) * g),
    "c read without gradient": (
        _read_without_gradient,
        lambda s, h, g: h * g + (2 * h).argmax(-1, keepdim=True) + (2 * h).sum(-1, keepdim=True).detach(),
    ),
}


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.__name__)
@pytest.mark.parametrize("name", sorted(ALLOWED))
def test_writes_whose_tensor_is_not_read_with_gradient_are_explained_as_out_of_place(name: str, preset):
    in_place, out_of_place = ALLOWED[name]
    relevance, calls = _explained(in_place, preset)
    expected, expected_calls = _explained(out_of_place, preset)
    assert calls == expected_calls
    torch.testing.assert_close(relevance, expected, rtol=1e-12, atol=1e-12)


def _overwritten(c: torch.Tensor, g: torch.Tensor, weight: torch.Tensor) -> None:
    c.detach().copy_(weight[:, :1].T.expand_as(c))


def _gated_without_gradient(c: torch.Tensor, g: torch.Tensor, weight: torch.Tensor) -> None:
    with torch.no_grad():
        c.mul_(g)


class _LaterWrite(nn.Module):
    """A gated block whose first projection ``write`` writes into once ``writes`` is set, then read by a LayerNorm (a
    module with a rule: the modes do not see its calls)."""

    def __init__(self, write) -> None:
        super().__init__()
        self.p, self.q = nn.Linear(4, 6), nn.Linear(4, 6)
        self.norm, self.out = nn.LayerNorm(6), nn.Linear(6, 3)
        self.write, self.writes = write, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, g = self.p(x), torch.sigmoid(self.q(x))
        if self.writes:
            self.write(c, g, self.q.weight)
        return self.out(self.norm(c) * g)


@pytest.mark.parametrize(
    "preset, write, named",
    [
        *((preset, _overwritten, "copy_ through") for preset in PRESETS),
        (EpsilonPlus, _gated_without_gradient, "mul_ under torch.no_grad()"),  # the gate mode runs on every call
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_a_read_by_a_module_with_a_rule_in_a_later_call_raises(preset, write, named: str):
    torch.manual_seed(0)
    model = _LaterWrite(write).to(F64)
    x = TensorDict(x=torch.randn(5, 4, dtype=F64), batch_size=[5])
    with warnings.catch_warnings(), LRP(model, preset(), in_keys=["x"], out_keys=["y"]) as lrp:
        warnings.simplefilter("ignore")
        lrp(x)  # the first call, watched, writes nothing
        model.writes = True
        with pytest.raises(
            RuntimeError, match=r"LayerNorm \(a module with a rule\) reads a tensor .*" + re.escape(named)
        ):
            lrp(x)


class _LaterWriteByKeyword(_LaterWrite):
    """:class:`_LaterWrite` with its LayerNorm called with its input by keyword (``norm(input=c)``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, g = self.p(x), torch.sigmoid(self.q(x))
        if self.writes:
            self.write(c, g, self.q.weight)
        return self.out(self.norm(input=c) * g)


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.__name__)
def test_a_read_by_keyword_by_a_module_with_a_rule_in_a_later_call_raises(preset):
    """The norm's rule hooks saw positional arguments only: ``norm(input=c)`` after ``c.detach().copy_(w)`` was
    explained without a word."""
    torch.manual_seed(0)
    model = _LaterWriteByKeyword(_overwritten).to(F64)
    x = TensorDict(x=torch.randn(5, 4, dtype=F64), batch_size=[5])
    with warnings.catch_warnings(), LRP(model, preset(), in_keys=["x"], out_keys=["y"]) as lrp:
        warnings.simplefilter("ignore")
        lrp(x)
        model.writes = True
        with pytest.raises(RuntimeError, match=r"LayerNorm \(a module with a rule\) reads a tensor .*copy_ through"):
            lrp(x)


def _binarized(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = torch.tanh(h)
    c.data = torch.sign(c.data)  # a binarised network's activation
    return c * g


def _binarized_out_of_place(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = torch.tanh(h)
    return (c + (torch.sign(c) - c).detach()) * g


class _BinarizeLinear(nn.Linear):
    """A linear layer that binarises its input in place, as binarised networks write it."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        input.data = torch.sign(input.data)
        return nn.functional.linear(input, self.weight, self.bias)


class _Binarized(nn.Module):
    def __init__(self, binarize: bool) -> None:
        super().__init__()
        self.fc1, self.act = nn.Linear(4, 6), nn.Hardtanh()
        self.fc2 = _BinarizeLinear(6, 3) if binarize else nn.Linear(6, 3)
        self.binarize = binarize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1(x))
        if self.binarize:
            h.data = torch.sign(h.data)
        else:
            h = h + (torch.sign(h) - h).detach()
        return self.fc2(h)


def _data_set_out_of_place(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = h.clone()
    return (c + (_weight(s, h) - c).detach()) * g


def _flattened_binarized(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = torch.tanh(h).unflatten(1, (2, 3)).flatten(1)  # a view, as a flattened feature map is
    c.data = torch.sign(c.data)
    return c * g


def _flattened_binarized_out_of_place(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = torch.tanh(h).unflatten(1, (2, 3)).flatten(1)
    return (c + (torch.sign(c) - c).detach()) * g


ASSIGNED = {
    "c = tanh(h); c.data = sign(c.data)": (_binarized, _binarized_out_of_place),
    "c = tanh(h).unflatten().flatten(); c.data = sign(c.data)": (
        _flattened_binarized,
        _flattened_binarized_out_of_place,
    ),
    "c = h.clone(); c.data = w": (_data_set, _data_set_out_of_place),
}


def _assert_explained_as_straight_through(in_place, out_of_place, preset) -> None:
    """The relevance and the calls left their plain gradient equal those of ``out_of_place``, which names a
    straight-through estimator (float64, ≤ 1e-12)."""
    relevance, calls = _explained(in_place, preset)
    expected, expected_calls = _explained(out_of_place, preset)
    assert calls == expected_calls
    assert "a straight-through estimator (x + (y - x).detach())" in calls
    torch.testing.assert_close(relevance, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.__name__)
@pytest.mark.parametrize("name", sorted(ASSIGNED))
def test_an_activation_assigned_through_data_is_explained_as_a_straight_through_estimator(name: str, preset):
    """``h.data = y`` (y of h's shape) replaces h's storage, not the values autograd saved: it is
    ``h + (y - h).detach()``, explained as that sum and named as one (it was refused)."""
    in_place, out_of_place = ASSIGNED[name]
    _assert_explained_as_straight_through(in_place, out_of_place, preset)


def _clamped_without_gradient(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = h + 0  # nothing saved for backward
    with torch.no_grad():
        c.clamp_(-0.3, 0.3)
    return c * g


def _rounded_through_data(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = h * 2
    c.data.round_()
    return c * g


def _floored_through_detach(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = h.clone()
    c.detach().clamp_min_(0.1)
    return c * g


def _straight_through_of(f):
    def form(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        c = h + 0
        return (c + (f(c) - c).detach()) * g

    return form


WRITTEN_STRAIGHT_THROUGH = {
    "no_grad: c.clamp_(-0.3, 0.3)": (_clamped_without_gradient, _straight_through_of(lambda c: c.clamp(-0.3, 0.3))),
    "c.data.round_()": (_rounded_through_data, lambda s, h, g: (2 * h + (torch.round(2 * h) - 2 * h).detach()) * g),
    "c.detach().clamp_min_(0.1)": (_floored_through_detach, _straight_through_of(lambda c: c.clamp_min(0.1))),
}


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.__name__)
@pytest.mark.parametrize("name", sorted(WRITTEN_STRAIGHT_THROUGH))
def test_a_clamp_or_rounding_of_an_activation_autograd_does_not_record_is_a_straight_through_estimator(
    name: str, preset
):
    """``c.clamp_(...)`` under no_grad, ``c.data.round_()``: the values ``f(c)``, the gradient passed to ``c``, as in
    ``c + (f(c) - c).detach()``, explained and named as that sum (they were refused as any unrecorded write, though
    the relevance equals the out-of-place estimator's, 0.0 off)."""
    in_place, out_of_place = WRITTEN_STRAIGHT_THROUGH[name]
    _assert_explained_as_straight_through(in_place, out_of_place, preset)


def _saved_then_clamped(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = torch.exp(h)  # its node saves c
    with torch.no_grad():
        c.clamp_(max=1.5)
    return c * g


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.__name__)
def test_a_clamp_without_gradient_of_a_tensor_autograd_saved_is_refused_by_torch(preset):
    """The version counter moved: the backward pass refuses it, as the model's own backward does."""
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _explained(_saved_then_clamped, preset)


def _saved_then_clamped_through_data(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = torch.exp(h)  # its node saves c
    c.data.clamp_(max=1.5)  # ``.data`` has a version counter of its own
    return c * g


def _rectified_then_floored_through_data(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = torch.relu(h)  # its node saves c, and reads its signs from it
    c.data.clamp_min_(0.1)
    return c * g


SAVED_WRITTEN_THROUGH_DATA = {
    "c = exp(h); c.data.clamp_(max=1.5)": _saved_then_clamped_through_data,
    "c = relu(h); c.data.clamp_min_(0.1)": _rectified_then_floored_through_data,
}


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.__name__)
@pytest.mark.parametrize("name", sorted(SAVED_WRITTEN_THROUGH_DATA))
def test_a_clamp_through_data_of_a_tensor_autograd_saved_is_refused_by_torch(name: str, preset):
    """``c.data`` keeps a version counter of its own: torch's backward did not see the write, and used the clamped
    values where the node saved ``c`` (0.35 off the estimator ``c + (clamp(c) - c).detach()`` for ``exp``, 0.22 for
    ``relu``, relative L2, under each preset), reported as that estimator. The counter is moved as the write is."""
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _explained(SAVED_WRITTEN_THROUGH_DATA[name], preset)


def _gate_clamped_through_alias(alias):
    def form(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        c = torch.sigmoid(h)  # a gate
        alias(c).clamp_(0.3, 0.6)
        return c * g

    return form


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.__name__)
@pytest.mark.parametrize("alias", ["detach", "data"])
def test_a_gate_clamped_through_an_alias_is_refused_at_the_read(alias: str, preset):
    """A sigmoid gate's marks follow writes into the gate alone: ``g.detach().clamp_(0.3, 0.6)`` was reported as a
    straight-through estimator, 2.3 off its relevance under AttnLRP and CP-LRP (relative L2); it is refused at the
    read, as any write through an alias (under ``torch.no_grad()`` the gate itself is written: explained)."""
    form = _gate_clamped_through_alias(torch.Tensor.detach if alias == "detach" else lambda c: c.data)
    with pytest.raises(RuntimeError, match=r"mul reads a tensor .*clamp_ through a detached alias"):
        _explained(form, preset)


def _gate_binarized(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    g.data = torch.round(g.data)
    return h * g


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.__name__)
def test_a_gate_assigned_through_data_is_held_with_its_new_values(preset):
    """``g.data = round(g)`` for a sigmoid gate: the gate is held constant, with the values the model computes with
    (as ``h * round(g).detach()``; it was refused)."""
    relevance, calls = _explained(_gate_binarized, preset)
    expected, expected_calls = _explained(lambda s, h, g: h * torch.round(g).detach(), preset)
    assert calls == expected_calls
    torch.testing.assert_close(relevance, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.__name__)
def test_a_binarised_network_assigning_data_in_and_around_a_layer_is_explained(preset):
    """A binarised network's ``input.data = sign(input.data)``, in the model's forward and in a layer's with a rule,
    against the same model written with out-of-place straight-through estimators (it was refused)."""
    explained = []
    for binarize in (True, False):
        torch.manual_seed(0)
        model = _Binarized(binarize).to(F64)
        x = TensorDict(x=torch.randn(5, 4, dtype=F64), batch_size=[5])
        lrp = LRP(model, preset(), in_keys=["x"], out_keys=["y"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            relevance = lrp(x)["relevance", "x"]
        assert any("straight-through estimator" in str(w.message) for w in caught)
        explained.append(relevance)
    torch.testing.assert_close(explained[0], explained[1], rtol=1e-12, atol=1e-12)


_KEPT: list[torch.Tensor] = []


def _written_and_kept(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = h.clone()
    _KEPT.append(c)  # alive after the call, as a tensor held by a traceback or a cache is
    c.detach().mul_(2)
    return c * g


def _function_explained() -> tuple[torch.Tensor, list[str]]:
    """A model applying an autograd Function (named by the coverage report), and the calls the report names."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), CubeOfSum(), nn.Linear(4, 2)).to(F64)
    lrp = LRP(model, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        relevance = lrp(TensorDict(x=torch.randn(3, 4, dtype=F64), batch_size=[3]))["relevance", "x"]
    return relevance, [c.function for c in lrp.coverage().plain_gradient]


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.__name__)
def test_a_tensor_noted_and_kept_alive_changes_no_later_call(preset):
    """A refused call's tensor kept alive: the next call, of another model, has each call's tensors looked up, and
    the lookup of their bases (``_base``) was reported as a call of its own that no rule covers (strict: raised)."""
    expected, expected_calls = _function_explained()
    with pytest.raises(RuntimeError, match="a write autograd does not record"):
        _explained(_written_and_kept, preset)
    try:
        relevance, calls = _function_explained()
    finally:
        _KEPT.clear()
    assert calls == expected_calls
    torch.testing.assert_close(relevance, expected, rtol=1e-12, atol=1e-12)


def test_an_array_of_a_tensor_not_in_cpu_memory_keeps_no_copy():
    """``c.numpy(force=True)`` of a tensor on another device copies it to the CPU: no NumPy write reaches ``c``, and
    a clone of ``c`` was kept (on its device) and compared at each read with gradient all the same."""
    from tdhook.attribution.rules import _unrecorded_writes

    c = torch.ones(3, device="meta", requires_grad=True) * 2  # the array of a CUDA tensor is a copy alike
    _unrecorded_writes.note_alias(torch.Tensor.numpy, (c,), None)
    try:
        assert id(c) not in _unrecorded_writes.UNRECORDED
    finally:
        _unrecorded_writes.UNRECORDED.pop(id(c), None)
