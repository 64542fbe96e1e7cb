"""The watch of a call's nonlinear calls on models that write in place (float64).

The watch names the calls on activations that no rule covers (a product of two activations, a sine). It judges an
in-place write as the function modes do (see ``rules/_in_place_writes.py``) and by its arguments before the write:

* a weight an activation is added to in place (``w += h``) is an activation, as ``w + h`` is: its product with
  another activation, or its sine, is named. With a rule mapper that runs no function mode, the weight kept its
  mark, and the call was silently left out;
* a constant or a weight multiplied in place by an activation (``torch.ones(...).mul_(h)``, ``w.mul_(h)``) is a
  product of one activation, linear as ``torch.ones(...) * h`` is. Judged after the write, which gives the tensor
  written into autograd history, it was named a product of two activations.

Oracles: the same model written out of place (its warnings, its relevance) and LRP-0's gradient x input.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.mappers.presets import EpsilonPlus
from tdhook.attribution.mappers.transformer import AttnLRP
from tdhook.attribution.rules.basic import EpsilonRule

F64 = torch.float64


class WrittenWeight(nn.Module):
    """``lin2(f(w, h1, h2))`` with ``w = 2 * vec`` and ``h1``, ``h2`` linear maps of ``x``; ``f`` in place or not."""

    def __init__(self, form: str, in_place: bool) -> None:
        super().__init__()
        self.lin0, self.lin1, self.lin2 = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 3)
        self.vec = nn.Parameter(torch.randn(6))
        self.form, self.in_place = form, in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h1, h2 = self.lin0(x), self.lin1(x)
        w = (2.0 * self.vec).expand_as(h1).clone()
        if self.form in ("sum times", "sum sine"):
            if self.in_place:
                w += h1
            else:
                w = w + h1
            z = w * h2 if self.form == "sum times" else torch.sin(w)
        elif self.form == "constant times":
            ones = torch.ones_like(h1.detach())
            z = (ones.mul_(h2) if self.in_place else ones * h2) * w
        else:  # weight times
            z = w.mul_(h2) if self.in_place else w * h2
        return self.lin2(z)


def model(form: str, in_place: bool) -> nn.Module:
    torch.manual_seed(0)
    return WrittenWeight(form, in_place).to(F64)


def explain(net: nn.Module, mapper, x: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
    """The relevance of ``x`` and the warnings of the first call (the watched one)."""
    lrp = LRP(net, rule_mapper=mapper, in_keys=["x"], out_keys=["y"])
    with warnings.catch_warnings(record=True) as caught, lrp:
        warnings.simplefilter("always")
        result = lrp(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))["relevance", "x"]
    return result, [str(warning.message) for warning in caught if "no rule covers" in str(warning.message)]


def linear_epsilon(name: str, module: nn.Module) -> EpsilonRule | None:
    """A rule mapper that is a plain function (it runs no function mode): ε on Linear layers, nothing else."""
    return EpsilonRule(epsilon=0.0) if isinstance(module, nn.Linear) else None


MAPPERS = {"a function": lambda: linear_epsilon, "EpsilonPlus": EpsilonPlus, "AttnLRP": AttnLRP}


@pytest.mark.parametrize("mapper", list(MAPPERS))
@pytest.mark.parametrize("form", ["sum times", "sum sine", "constant times", "weight times"])
def test_in_place_writes_are_named_as_the_same_calls_out_of_place(form: str, mapper: str):
    x = torch.randn(5, 4, dtype=F64)
    expected, expected_warnings = explain(model(form, in_place=False), MAPPERS[mapper](), x)
    ours, our_warnings = explain(model(form, in_place=True), MAPPERS[mapper](), x)
    assert our_warnings == expected_warnings
    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-12)
    if mapper == "a function":  # no rule but ε = 0: gradient x input, and a warning where the model is not linear
        assert bool(expected_warnings) == form.startswith("sum")
        leaf = x.clone().requires_grad_(True)
        out = model(form, in_place=True)(leaf)
        (grad,) = torch.autograd.grad(out.gather(1, out.argmax(1, keepdim=True)).sum(), leaf)
        torch.testing.assert_close(ours, x * grad, rtol=1e-10, atol=1e-12)


def test_a_detached_difference_added_in_place_to_an_activation_is_named():
    """``d = (y - h).detach(); d += h`` is the straight-through estimator ``h + (y - h).detach()``: the watch reads
    the detached difference's marks from the tensor written into as it was before the write."""

    class Rounded(nn.Module):
        def __init__(self, in_place: bool) -> None:
            super().__init__()
            self.lin0, self.lin1, self.in_place = nn.Linear(4, 6), nn.Linear(6, 3), in_place

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin0(x)
            if self.in_place:
                z = (torch.round(h) - h).detach()
                z += h
            else:
                z = h + (torch.round(h) - h).detach()
            return self.lin1(z)

    x = torch.randn(5, 4, dtype=F64)
    for in_place in (False, True):
        lrp = LRP(Rounded(in_place).to(F64), rule_mapper=EpsilonPlus(), in_keys=["x"], out_keys=["y"])
        with warnings.catch_warnings(record=True) as caught, lrp:
            warnings.simplefilter("always")
            lrp(TensorDict(x=x.clone(), batch_size=[5]))
        assert any("straight-through estimator" in str(warning.message) for warning in caught), in_place


class ViewProduct(nn.Module):
    """``lin2(z)`` with ``z`` a copy of ``h1`` multiplied in place by ``h2``: whole (``z.mul_(h2)``), or its first
    three features through a view (``z[:, :3].mul_(...)``, ``z[:, :3] *= ...``)."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.lin0, self.lin1, self.lin2 = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 3)
        self.form = form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h1, h2 = self.lin0(x), self.lin1(x)
        z = h1.clone()
        if self.form == "whole":
            z.mul_(h2)
        elif self.form == "mul_":
            z[:, :3].mul_(h2[:, :3])
        else:
            view = z[:, :3]
            view *= h2[:, :3]
        return self.lin2(z)


@pytest.mark.parametrize("form", ["mul_", "*="])
def test_a_product_of_two_activations_written_in_place_into_a_view_is_named_as_one_written_whole(form: str):
    """Under the CNN presets a product of two activations written in place keeps its plain gradient, and the warning
    of calls no rule covers names it (AttnLRP and CP-LRP give it the rule of the product out of place). Written into
    a view of a tensor (part of its features), the watch looked for the call's node on the view, which the relevance
    pass does not reach (the model reads on from the tensor viewed): no warning, though the product kept its plain
    gradient all the same."""
    x = torch.randn(5, 4, dtype=F64)
    torch.manual_seed(0)
    _, whole = explain(ViewProduct("whole").to(F64), EpsilonPlus(), x)
    torch.manual_seed(0)
    _, ours = explain(ViewProduct(form).to(F64), EpsilonPlus(), x)
    assert len(whole) == 1 and "computes mul" in whole[0]
    assert len(ours) == 1 and "computes mul" in ours[0]


class _RecurrentByKeyword(nn.Module):
    """An LSTM reading the model's input, called with it by keyword (``lstm(input=x)``), then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.LSTM(4, 5, batch_first=True), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(input=x)[0][:, -1])


def test_a_recurrent_first_layer_called_by_keyword_is_named():
    """The watch read a layer's input from its positional arguments: ``lstm(input=x)`` on the model's input, which
    no first-layer rule covers, was explained as EpsilonPlus's without a word (refused by name when strict)."""
    from tdhook.attribution.mappers.presets import EpsilonPlusFlat

    torch.manual_seed(0)
    model = _RecurrentByKeyword().to(F64)
    x = TensorDict(x=torch.randn(2, 3, 4, dtype=F64), batch_size=[2])
    with pytest.warns(UserWarning, match=r"module 'rnn' \(LSTM\) is the first layer .* \(FlatRule\)"):
        relevance = LRP(model, EpsilonPlusFlat(), in_keys=["x"], out_keys=["y"])(x)["relevance", "x"]
    expected = LRP(model, EpsilonPlus(), in_keys=["x"], out_keys=["y"])(x)["relevance", "x"]
    torch.testing.assert_close(relevance, expected, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match=r"module 'rnn' \(LSTM\) is the first layer .* \(FlatRule\)"):
        LRP(model, EpsilonPlusFlat(strict=True), in_keys=["x"], out_keys=["y"])(x)


class _RecurrentByKeywordWithState(nn.Module):
    """An LSTM reading the model's input, called with its state named first (``lstm(hx=state, input=x)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.LSTM(4, 5, batch_first=True), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = (x.new_zeros(1, x.shape[0], 5), x.new_zeros(1, x.shape[0], 5))
        return self.head(self.rnn(hx=state, input=x)[0][:, -1])


def test_a_recurrent_first_layer_called_with_its_state_named_first_is_named():
    """The keyword values were read in the call's order: the state tuple came first, and the LSTM, which no
    first-layer rule covers, was explained without a word."""
    from tdhook.attribution.mappers.presets import EpsilonPlusFlat

    torch.manual_seed(0)
    model = _RecurrentByKeywordWithState().to(F64)
    x = TensorDict(x=torch.randn(2, 3, 4, dtype=F64), batch_size=[2])
    with pytest.raises(ValueError, match=r"module 'rnn' \(LSTM\) is the first layer .* \(FlatRule\)"):
        LRP(model, EpsilonPlusFlat(strict=True), in_keys=["x"], out_keys=["y"])(x)


class DropConnectLinear(nn.Linear):
    """A Linear layer dropping elements of its weight in training mode (DropConnect) in its own forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, nn.functional.dropout(self.weight, 0.5, self.training), self.bias)


class WeightDropout(nn.Module):
    """DropConnect as a parametrization of a layer's weight."""

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(weight, 0.5, self.training)


def drop_connect_network(kind: str) -> nn.Sequential:
    torch.manual_seed(0)
    middle = DropConnectLinear(8, 8) if kind == "subclass" else nn.Linear(8, 8)
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), middle, nn.ReLU(), nn.Linear(8, 3)).to(F64)
    if kind == "parametrization":
        nn.utils.parametrize.register_parametrization(net[2], "weight", WeightDropout())
    return net


class TestDropoutOfAWeightInARuledLayer:
    """A dropout of a layer's weight in training mode, in the layer's own forward or its weight's parametrization,
    makes the relevance random from call to call (1.0 and 2.2 of its norm between two calls): it was not named, the
    calls inside a layer with a rule being left to that rule, where the same dropout in a module without a rule
    (fastai's ``WeightDropout``) was. It is named once, by the module that calls it; in eval mode nothing is said."""

    @pytest.mark.parametrize("preset", ["EpsilonPlus", "UniformEpsilon"])
    @pytest.mark.parametrize(
        ("kind", "named"),
        [("subclass", "'2' (DropConnectLinear)"), ("parametrization", "'2.parametrizations.weight.0' (WeightDropout)")],
    )
    def test_it_is_named_once_in_training_mode(self, kind: str, named: str, preset: str):
        from tdhook.attribution.mappers import presets

        net = drop_connect_network(kind)
        td = TensorDict(x=torch.randn(4, 6, dtype=F64), batch_size=[4])
        lrp = LRP(net.train(), getattr(presets, preset)(), in_keys=["x"], out_keys=["y"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lrp(td.clone())
        messages = [str(w.message) for w in caught]
        assert len(messages) == 1 and messages[0].startswith(f"LRP: module {named} calls dropout (p=0.5) in its own")
        net.eval()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            LRP(net, getattr(presets, preset)(), in_keys=["x"], out_keys=["y"])(td.clone())


class ComputedKernel(nn.Module):
    """A convolution or linear map by a weight computed from the input (CondConv's routing, a hypernetwork)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.route = kind, nn.Linear(4, 2)
        self.experts = nn.Parameter(torch.randn(2, 3 * 4 * (3 if kind == "conv1d" else 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = torch.sigmoid(self.route(x.mean(-1) if self.kind == "conv1d" else x)).mean(0)
        weight = routing @ self.experts
        if self.kind == "conv1d":
            return nn.functional.conv1d(x, weight.view(3, 4, 3)).flatten(1)
        return nn.functional.linear(x, weight.view(3, 4))


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_a_layer_function_of_a_weight_computed_from_the_input_is_named_as_a_product(kind: str):
    """CondConv computes its kernels from the input (routing weights times expert kernels): the warning said the
    convolution "is not piecewise linear", as of a curved function, where it is a product of two activations."""
    torch.manual_seed(0)
    x = torch.randn(2, 4, 5, dtype=F64) if kind == "conv1d" else torch.randn(2, 4, dtype=F64)
    _, found = explain(ComputedKernel(kind).to(F64), EpsilonPlus(), x)
    assert any(
        f"{kind} (with a weight computed from the inputs: a product of two activations) in its own forward" in message
        for message in found
    ), found


class ComputedBias(nn.Module):
    """A linear map or convolution whose bias, not weight, is computed from the input: affine in it."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.layer, self.shift = (
            kind,
            (nn.Conv1d(4, 3, 1) if kind == "conv1d" else nn.Linear(4, 3)),
            nn.Linear(4, 3),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "conv1d":
            bias = self.shift(x.mean((0, -1)))
            return nn.functional.conv1d(x, self.layer.weight, bias).flatten(1)
        return nn.functional.linear(x, self.layer.weight, self.shift(x.mean(0)))


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_a_bias_computed_from_the_input_is_no_product(kind: str):
    """A bias is added, not multiplied: a bias computed from the input was counted as a factor, and the call named as
    a product of two activations (a weight computed from the inputs) that is not piecewise linear."""
    torch.manual_seed(0)
    x = torch.randn(2, 4, 5, dtype=F64) if kind == "conv1d" else torch.randn(2, 4, dtype=F64)
    _, found = explain(ComputedBias(kind).to(F64), EpsilonPlus(), x)
    assert not any(kind in message for message in found), found
