"""Linear maps computed by modules that are no ``nn.Linear``: ``F.linear`` with a module's own weight.

The convolution case (``F.conv2d``) is tested in ``test_lrp_layers.py::TestConvolutions``.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.fx
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import (
    CPLRP,
    LRP,
    AttnLRP,
    EpsilonAlpha2Beta1Flat,
    EpsilonGammaBox,
    EpsilonPlus,
    EpsilonPlusFlat,
    UniformEpsilon,
)
from tdhook.attribution._unmapped_layers import report_unmapped_layers
from tdhook.attribution.lrp_helpers.rules import (
    AlphaBetaRule,
    EpsilonRule,
    FirstLayerRule,
    FlatRule,
    GammaRule,
    WSquareRule,
)
from tests.attribution.test_lrp_layers import FunctionalConv
from tests.conftest import relative_error

F64 = torch.float64


class OwnLinear(nn.Module):
    """A Linear layer of one's own: an ``nn.Linear``'s weight and bias, applied with ``F.linear``."""

    def __init__(self, layer: nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = layer.weight, layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class ThroughLayers(torch.fx.Tracer):
    """A tracer that keeps no module as a leaf: the graph calls ``F.linear`` with the layers' weights."""

    def is_leaf_module(self, module: nn.Module, name: str) -> bool:
        return False


def _nets() -> tuple[nn.Module, nn.Module, torch.Tensor]:
    """A small MLP whose last layer is an :class:`OwnLinear`, the same MLP with its ``nn.Linear``, and an input."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3)).to(F64)
    return nn.Sequential(plain[0], plain[1], OwnLinear(plain[2])), plain, torch.randn(4, 5, dtype=F64)


def _relevance(model: nn.Module, x: torch.Tensor, mapper) -> tuple[torch.Tensor, LRP]:
    lrp = LRP(model, rule_mapper=mapper, in_keys=["x"], out_keys=["y"])
    return lrp(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))["relevance", "x"], lrp


def _assert_quiet_and_equal(own: nn.Module, plain: nn.Module, x: torch.Tensor, mapper) -> None:
    """``own`` is explained without a warning, with the relevance of ``plain`` (to the effect of an ε of 1e-6)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        actual, _ = _relevance(own, x, mapper())
    expected, _ = _relevance(plain, x, mapper())
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-8)


class TestLinearWrittenWithFLinear:
    def test_is_warned_of_naming_the_module(self):
        """A module of one's own calling F.linear with its weight is no nn.Linear to the mappers (rules go by module
        type): it kept its plain gradient with no word, 57 % off the same net with nn.Linear under UniformEpsilon
        (ε = 0.25). The first call warns, naming the module and the rule a Linear gets, and coverage() lists the
        call; a strict mapper refuses it."""
        own, plain, x = _nets()
        expected, _ = _relevance(plain, x, UniformEpsilon())
        with pytest.warns(UserWarning, match=r"module '2' \(OwnLinear\) computes linear with its own weight.*Linear"):
            actual, lrp = _relevance(own, x, UniformEpsilon())
        assert relative_error(actual, expected) > 0.1  # the plain gradient there: why it is warned of
        assert [(c.module, c.module_type, c.calls) for c in lrp.coverage().plain_gradient] == [("2", "OwnLinear", 1)]
        with pytest.raises(ValueError, match=r"module '2' \(OwnLinear\) computes linear"):
            _relevance(own, x, UniformEpsilon(strict=True))

    @pytest.mark.parametrize(
        "rule",
        [lambda: EpsilonRule(0.25), lambda: GammaRule(0.25), lambda: AlphaBetaRule(2.0, 1.0), FlatRule, WSquareRule],
        ids=["epsilon", "gamma", "alpha2beta1", "flat", "wsquare"],
    )
    def test_is_warned_of_where_a_linear_layer_gets_another_rule(self, rule):
        own, _, x = _nets()
        with pytest.warns(UserWarning, match=r"module '2' \(OwnLinear\) computes linear"):
            _relevance(own, x, {nn.Linear: rule()})

    def test_a_graph_traced_through_its_linear_layers_is_warned_of(self):
        """torch.fx traced with a tracer that keeps no nn.Linear as a leaf: the graph calls F.linear itself
        (130 % off the traced module under UniformEpsilon, with no word)."""
        _, plain, x = _nets()
        traced = torch.fx.GraphModule(plain, ThroughLayers().trace(plain))
        expected, _ = _relevance(plain, x, UniformEpsilon())
        with pytest.warns(UserWarning, match=r"the model itself \(GraphModule\) computes linear with its own weight"):
            actual, _ = _relevance(traced, x, UniformEpsilon())
        assert relative_error(actual, expected) > 0.1

    @pytest.mark.parametrize("preset", ["EpsilonPlus", "AttnLRP", "CPLRP", "Epsilon0", "none"])
    def test_is_not_warned_of_where_a_linear_layer_would_be_near_lrp0(self, preset):
        """Where an nn.Linear would get LRP-0 (the transformer presets, ε = 0, no mapper) or the presets' tiny
        ε (1e-6): no warning, and the relevance is the layer's (to ε's effect)."""
        mappers = {
            "EpsilonPlus": EpsilonPlus,
            "AttnLRP": AttnLRP,
            "CPLRP": CPLRP,
            "Epsilon0": lambda: {nn.Linear: EpsilonRule(0.0)},
            "none": lambda: None,
        }
        own, plain, x = _nets()
        _assert_quiet_and_equal(own, plain, x, mappers[preset])

    def test_a_fixed_projection_in_a_buffer_is_not_warned_of(self):
        """A projection held in a buffer is no layer's weight: no warning."""

        class Project(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.register_buffer("basis", torch.eye(16, dtype=F64)[:8])

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return nn.functional.linear(x, self.basis)

        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), Project(), nn.Linear(8, 3)).to(F64)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _relevance(net, torch.randn(4, 5, dtype=F64), UniformEpsilon())


class TestFirstLayerWrittenWithFLinear:
    """The first-layer rule (Flat) goes by module type too: a first layer of one's own calling F.linear kept LRP-0."""

    @staticmethod
    def _first_own() -> tuple[nn.Module, nn.Module, torch.Tensor]:
        torch.manual_seed(0)
        plain = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3)).to(F64)
        return nn.Sequential(OwnLinear(plain[0]), plain[1], plain[2]), plain, torch.randn(4, 5, dtype=F64)

    @pytest.mark.parametrize("preset", [EpsilonPlusFlat, EpsilonAlpha2Beta1Flat], ids=lambda p: p.__name__)
    def test_is_warned_of_naming_the_first_layer_rule(self, preset):
        """EpsilonPlusFlat's Linear rule is ε = 1e-6 (near LRP-0, not warned of), but the first layer gets Flat: the
        F.linear module there kept LRP-0 with no word, 152 % off the same net with nn.Linear. Its call is in the
        first layer's place at run time (the model's input reaches it through no layer): warned of, naming Flat."""
        own, plain, x = self._first_own()
        expected, _ = _relevance(plain, x, preset())
        with pytest.warns(UserWarning, match=r"module '0' \(OwnLinear\) .* the model's input reaches first gets Flat"):
            actual, lrp = _relevance(own, x, preset())
        assert relative_error(actual, expected) > 1.0  # 1.52: the plain gradient there
        assert [(c.module, c.calls) for c in lrp.coverage().plain_gradient] == [("0", 1)]
        with pytest.raises(ValueError, match=r"module '0' \(OwnLinear\) computes linear .* FlatRule"):
            _relevance(own, x, preset(strict=True))

    def test_a_first_convolution_of_ones_own_names_zbox(self):
        """``F.conv2d`` with a module's own weight as the first layer under EpsilonGammaBox: warned of naming z^B, the
        first layer's rule (before: γ, the later convolutions')."""

        class OwnConv(nn.Module):
            def __init__(self, conv: nn.Conv2d) -> None:
                super().__init__()
                self.weight, self.bias = conv.weight, conv.bias

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return nn.functional.conv2d(x, self.weight, self.bias, padding=1)

        torch.manual_seed(0)
        net = nn.Sequential(OwnConv(nn.Conv2d(3, 4, 3)), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 3)).to(F64)
        with pytest.warns(UserWarning, match=r"module '0' \(OwnConv\) .* reaches first gets ZBoxRule"):
            _relevance(net, torch.randn(2, 3, 6, 6, dtype=F64), EpsilonGammaBox(-3.0, 3.0))

    @pytest.mark.parametrize("preset", [EpsilonPlus, lambda: EpsilonGammaBox(-3.0, 3.0)], ids=["EpsilonPlus", "gamma"])
    def test_a_later_convolution_of_ones_own_is_not_said_to_be_first(self, preset):
        """After an ``nn.Conv2d``, a convolution of one's own gets the later convolutions' rule, and the warning says
        so. Under a preset with no first-layer rule (EpsilonPlus), whose layers mark no outputs, the call was said
        to be where "a Conv2d the model's input reaches first" gets z⁺."""
        torch.manual_seed(0)
        net = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), FunctionalConv(nn.Conv2d(4, 4, 3)), nn.ReLU(), nn.Flatten()
        ).to(F64)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _relevance(net, torch.randn(2, 3, 6, 6, dtype=F64), preset())
        named = [str(w.message) for w in caught if "(FunctionalConv)" in str(w.message)]
        assert len(named) == 1, [str(w.message) for w in caught]
        rule = "AlphaBetaRule" if preset is EpsilonPlus else "GammaRule"
        assert f"where a Conv2d gets {rule}" in named[0], named[0]

    def test_a_users_rule_for_linear_layers_wins_as_on_a_first_layer(self):
        """A user's rule for nn.Linear wins over the first-layer rule (as BaseRuleMapper.rules decides): ε = 0 there
        is LRP-0, which the module's plain gradient is: no warning."""
        own, _, x = self._first_own()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _relevance(own, x, EpsilonPlusFlat(rule_mapper={nn.Linear: EpsilonRule(0.0)}))

    def test_a_later_call_is_judged_by_the_later_layers_rule(self):
        """An F.linear module behind a layer (a head, a tied decoder reading the first layer's weight) is no first
        layer: EpsilonPlusFlat's ε = 1e-6 there, no warning."""

        class Tied(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.stem, self.mid = nn.Linear(5, 16), nn.Linear(16, 16)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return nn.functional.linear(self.mid(self.stem(x).relu()).relu(), self.stem.weight.t())

        own, _, x = _nets()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _relevance(own, x, EpsilonPlusFlat())
            _relevance(Tied().to(F64), x, EpsilonPlusFlat())

    def test_a_first_layer_rule_given_by_the_user_is_judged_by_the_place_of_the_call(self):
        own, _, x = self._first_own()
        rule = FirstLayerRule(FlatRule(), EpsilonRule(0.0))
        with pytest.warns(UserWarning, match=r"module '0' \(OwnLinear\) .* reaches first gets FlatRule"):
            _relevance(own, x, {nn.Linear: rule})
        own, _, x = _nets()  # the F.linear module is last: ε = 0 there
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _relevance(own, x, {nn.Linear: rule})


def test_report_names_the_linear_layer_and_its_rule():
    found, modules = {"head": {"linear": 2}}, {"head": nn.Identity()}
    with pytest.warns(UserWarning, match=r"no Linear layer .* where a Linear gets EpsilonRule"):
        (call,) = report_unmapped_layers(found, modules, UniformEpsilon(), strict=False)
    assert (call.module, call.module_type, call.calls) == ("head", "Identity", 2)
    assert report_unmapped_layers(found, modules, EpsilonPlus(), strict=False) == ()  # ε = 1e-6: near LRP-0


def test_a_tiny_epsilon_on_convolutions_is_near_lrp0_too():
    """The same line for convolutions: ε up to the presets' 1e-6 is not warned of, a larger one is."""
    found, modules = {"conv": {"conv2d": 1}}, {"conv": nn.Identity()}
    assert report_unmapped_layers(found, modules, lambda name, module: EpsilonRule(1e-6), strict=False) == ()
    with pytest.warns(UserWarning, match=r"no convolution layer .* where a Conv2d gets EpsilonRule"):
        report_unmapped_layers(found, modules, lambda name, module: EpsilonRule(1e-3), strict=False)


# A Linear layer's map written as a matrix product with a module's own weight ``w`` (out × in) and bias ``b``.
MATRIX_PRODUCTS = {
    "x @ w.T + b": lambda x, w, b: x @ w.T + b,
    "(w @ x.T).T + b": lambda x, w, b: (w @ x.T).T + b,
    "torch.einsum": lambda x, w, b: torch.einsum("bi,oi->bo", x, w) + b,
    "torch.addmm": lambda x, w, b: torch.addmm(b, x, w.T),
    "torch.mm": lambda x, w, b: torch.mm(x, w.t()) + b,
    "torch.bmm": lambda x, w, b: torch.bmm(x.unsqueeze(1), w.T.expand(len(x), -1, -1)).squeeze(1) + b,
    "torch.tensordot": lambda x, w, b: torch.tensordot(x, w, dims=([1], [1])) + b,
}


class OwnProduct(nn.Module):
    """A Linear layer of one's own: an ``nn.Linear``'s weight and bias, applied by a matrix product."""

    def __init__(self, layer: nn.Linear, product) -> None:
        super().__init__()
        self.weight, self.bias, self.product = layer.weight, layer.bias, product

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.weight, self.bias)


class TestLinearWrittenAsAMatrixProduct:
    """``x @ self.W`` (or einsum, addmm, mm, bmm, tensordot) with a module's own weight is a Linear layer's map that
    no mapper sees: as the first layer under EpsilonPlusFlat it kept LRP-0 where nn.Linear gets Flat, 2.01 times the
    relevance off (relative L2), with no word."""

    @pytest.mark.parametrize("name", sorted(MATRIX_PRODUCTS))
    def test_a_first_layer_of_ones_own_is_warned_of_naming_flat(self, name):
        own, plain, x = TestFirstLayerWrittenWithFLinear._first_own()
        own[0] = OwnProduct(plain[0], MATRIX_PRODUCTS[name])
        expected, _ = _relevance(plain, x, EpsilonPlusFlat())
        with pytest.warns(UserWarning, match=r"module '0' \(OwnProduct\) computes \w+ with its own weight.* gets Flat"):
            actual, lrp = _relevance(own, x, EpsilonPlusFlat())
        assert relative_error(actual, expected) > 1.0  # 1.5: the plain gradient there
        assert [(c.module, c.module_type) for c in lrp.coverage().plain_gradient] == [("0", "OwnProduct")]
        with pytest.raises(ValueError, match=r"module '0' \(OwnProduct\) computes .* FlatRule"):
            _relevance(own, x, EpsilonPlusFlat(strict=True))

    @pytest.mark.parametrize("preset", ["EpsilonPlus", "AttnLRP", "CPLRP", "none"])
    def test_a_later_layer_near_lrp0_is_not_warned_of(self, preset):
        """Behind the first layer a Linear gets ε = 1e-6 or LRP-0: nothing to say, ``torch.mm`` included (it was
        named ``spmm``, a function no rule covers, under the CNN presets)."""
        mappers = {"EpsilonPlus": EpsilonPlus, "AttnLRP": AttnLRP, "CPLRP": CPLRP, "none": lambda: None}
        own, plain, x = _nets()
        for product in MATRIX_PRODUCTS.values():
            own[2] = OwnProduct(plain[2], product)
            _assert_quiet_and_equal(own, plain, x, mappers[preset])

    def test_a_product_of_two_activations_or_by_a_buffer_is_no_layer(self):
        """Attention scores (``q @ k.T``) and a fixed projection held in a buffer are no layer: not named as one."""

        class Scores(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.q, self.k = nn.Linear(5, 4), nn.Linear(5, 4)
                self.register_buffer("basis", torch.eye(4)[:3])

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return (self.q(x) @ self.k(x).T) @ (self.q(x) @ self.basis.T)

        torch.manual_seed(0)
        _, lrp = _relevance(Scores().to(F64), torch.randn(4, 5, dtype=F64), CPLRP())
        assert lrp.coverage().plain_gradient == ()

    def test_a_convolution_written_with_unfold_and_matmul_is_warned_of_naming_zplus(self):
        """``w.view(out, -1) @ F.unfold(x, k)``, a convolution written out: it kept LRP-0 where EpsilonPlus gives
        a convolution z⁺, 2.1 times the relevance off, with no word. Warned of as a convolution, naming z⁺."""

        class UnfoldConv(nn.Module):
            def __init__(self, conv: nn.Conv2d) -> None:
                super().__init__()
                self.weight, self.bias = conv.weight, conv.bias

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                patches = nn.functional.unfold(x, 3, padding=1)
                out = self.weight.view(len(self.weight), -1) @ patches + self.bias.view(1, -1, 1)
                return out.view(len(x), -1, *x.shape[2:])

        torch.manual_seed(0)
        plain = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU())
        plain = nn.Sequential(*plain, nn.Flatten(), nn.Linear(4 * 25, 3)).to(F64)
        own = nn.Sequential(*plain)
        own[2] = UnfoldConv(plain[2])
        x = torch.randn(3, 2, 5, 5, dtype=F64)
        expected, _ = _relevance(plain, x, EpsilonPlus())
        match = r"module '2' \(UnfoldConv\) computes matmul of F.unfold patches .* no convolution layer .* AlphaBeta"
        with pytest.warns(UserWarning, match=match):
            actual, _ = _relevance(own, x, EpsilonPlus())
        assert relative_error(actual, expected) > 0.5


@pytest.mark.parametrize("name", ["F.linear", "x @ w.T + b", "torch.addmm"])
def test_a_frozen_first_layer_of_ones_own_is_warned_of_and_takes_no_rule_of_another(name):
    """``model.requires_grad_(False)`` before explaining: the weight of a first layer of one's own is then a constant
    to autograd, like a buffer. Its call was not named, and the first-layer walks went through it, so EpsilonPlusFlat
    put Flat on the next Linear (0.95 off the same model with trainable weights, with no word of it). A parameter
    (or a view of one) is a weight, frozen or not: warned of, and the relevance is the trainable model's."""
    own, plain, x = TestFirstLayerWrittenWithFLinear._first_own()
    if name != "F.linear":
        own[0] = OwnProduct(plain[0], MATRIX_PRODUCTS[name])
    with pytest.warns(UserWarning, match=r"module '0' \(Own\w+\) computes \w+ with its own weight.* gets Flat"):
        expected, _ = _relevance(own, x, EpsilonPlusFlat())
    own.requires_grad_(False)
    with pytest.warns(UserWarning, match=r"module '0' \(Own\w+\) computes \w+ with its own weight.* gets Flat"):
        actual, _ = _relevance(own, x, EpsilonPlusFlat())
    assert relative_error(actual, expected) <= 1e-12


# A Linear layer's map written as a broadcast product with a module's own weight ``w`` (out × in), summed over ``in``.
BROADCAST_PRODUCTS = {
    "(x.unsqueeze(-2) * w).sum(-1)": lambda x, w, b: (x.unsqueeze(-2) * w).sum(-1) + b,
    "(x[..., None, :] * w).sum(-1)": lambda x, w, b: (x[..., None, :] * w).sum(-1) + b,
    "torch.sum(x.unsqueeze(1) * w, dim=-1)": lambda x, w, b: torch.sum(x.unsqueeze(1) * w, dim=-1) + b,
    "(w.T * x.unsqueeze(-1)).sum(1)": lambda x, w, b: (w.T * x.unsqueeze(-1)).sum(1) + b,
    "(x.unsqueeze(-2) * w).mean(-1)": lambda x, w, b: (x.unsqueeze(-2) * w).mean(-1) * w.shape[1] + b,
}


class TestLinearWrittenAsABroadcastProduct:
    """``(x.unsqueeze(-2) * self.W).sum(-1)`` is a Linear layer's map made of two piecewise-linear calls: as the
    first layer under EpsilonPlusFlat it kept LRP-0, and the first-layer walk went through it to put Flat on the next
    Linear, 2.82 times the relevance off the same net with nn.Linear (relative L2), with no word."""

    @pytest.mark.parametrize("name", sorted(BROADCAST_PRODUCTS))
    def test_a_first_layer_of_ones_own_is_warned_of_naming_flat(self, name):
        own, plain, x = TestFirstLayerWrittenWithFLinear._first_own()
        own[0] = OwnProduct(plain[0], BROADCAST_PRODUCTS[name])
        expected, _ = _relevance(plain, x, EpsilonPlusFlat())
        match = r"module '0' \(OwnProduct\) computes sum of a broadcast product with its own weight.* gets Flat"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            actual, lrp = _relevance(own, x, EpsilonPlusFlat())
        assert [str(w.message)[:40] for w in caught] == [str(caught[0].message)[:40]]  # that warning alone
        assert caught and re.search(match, str(caught[0].message))
        # As x @ W.T: the plain gradient at the first layer (1.52 off), and no Flat on the next Linear.
        own_matmul = nn.Sequential(OwnProduct(plain[0], MATRIX_PRODUCTS["x @ w.T + b"]), plain[1], plain[2])
        with pytest.warns(UserWarning):
            as_matmul, _ = _relevance(own_matmul, x, EpsilonPlusFlat())
        torch.testing.assert_close(actual, as_matmul)
        assert relative_error(actual, expected) > 1.0
        assert [(c.module, c.module_type) for c in lrp.coverage().plain_gradient] == [("0", "OwnProduct")]
        with pytest.raises(ValueError, match=r"module '0' \(OwnProduct\) computes sum of a broadcast .* FlatRule"):
            _relevance(own, x, EpsilonPlusFlat(strict=True))

    @pytest.mark.parametrize("preset", ["EpsilonPlus", "CPLRP", "none"])
    def test_a_later_layer_near_lrp0_is_not_warned_of(self, preset):
        mappers = {"EpsilonPlus": EpsilonPlus, "CPLRP": CPLRP, "none": lambda: None}
        own, plain, x = _nets()
        for product in BROADCAST_PRODUCTS.values():
            own[2] = OwnProduct(plain[2], product)
            _assert_quiet_and_equal(own, plain, x, mappers[preset])

    @pytest.mark.parametrize(
        "product",
        [
            lambda x, w, b: x * b[:5],  # a layer scale
            lambda x, w, b: (x * w[0]).sum(-1, keepdim=True) * b[:1],  # a scale summed: no broadcast output
            lambda x, w, b: x.unsqueeze(-2) * w,  # broadcast, not summed
            lambda x, w, b: (x.unsqueeze(-2) * w).sum(-2),  # summed over the broadcast outputs
            lambda x, w, b: (x.unsqueeze(-2) * x.unsqueeze(-1)).sum(-1),  # two activations
        ],
        ids=["scale", "scale summed", "not summed", "outputs summed", "activations"],
    )
    def test_no_layer_is_named_where_none_is(self, product):
        own, plain, x = TestFirstLayerWrittenWithFLinear._first_own()
        head = nn.LazyLinear(3).to(F64)
        model = nn.Sequential(OwnProduct(plain[0], product), nn.Flatten(), head)
        model(x)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, lrp = _relevance(model, x, EpsilonPlusFlat())
        assert [str(w.message) for w in caught if "broadcast" in str(w.message)] == []
        assert [c for c in lrp.coverage().plain_gradient if "broadcast" in c.function] == []  # two activations: mul


class Conditioned(nn.Module):
    """``f(relu(bilinear(x, c)))`` with ``c`` a buffer: ``nn.Bilinear`` is then a linear map of ``x``."""

    def __init__(self) -> None:
        super().__init__()
        self.bilinear, self.head = nn.Bilinear(6, 3, 5), nn.Linear(5, 3)
        self.register_buffer("context", torch.randn(1, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bilinear(x, self.context.expand(x.shape[0], 3))))

    def as_linear(self) -> nn.Sequential:
        """The same function with the bilinear map written as the ``nn.Linear`` it is for this context."""
        layer = nn.Linear(6, 5).to(self.head.weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(torch.einsum("oij,j->oi", self.bilinear.weight, self.context[0]))
            layer.bias.copy_(self.bilinear.bias)
        return nn.Sequential(layer, nn.ReLU(), self.head)


class Paired(Conditioned):
    """``f(relu(bilinear(x, x[:, :3])))``: both inputs of the bilinear map are activations."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bilinear(x, x[:, :3])))


class TestBilinearOfOneActivation:
    """``nn.Bilinear(x, c)`` with ``c`` no activation (a buffer, an input that is not explained) is a Linear layer's
    map of ``x``: where a Linear gets another rule than LRP-0 (Flat in the first layer's place, a user's ε), it kept
    its plain gradient without a word (EpsilonPlusFlat's relevance 6.7 off that of the same model written with an
    ``nn.Linear``, relative, an ε of 0.25 on Linear layers' 0.41), where ``F.linear`` with a module's own weight is
    warned of."""

    @pytest.mark.parametrize(
        "mapper, rule",
        [(EpsilonPlusFlat, "FlatRule"), (lambda: {nn.Linear: EpsilonRule(0.25)}, "EpsilonRule")],
        ids=["first layer", "users epsilon"],
    )
    def test_is_warned_of_naming_the_module_and_the_rule(self, mapper, rule):
        torch.manual_seed(0)
        model, x = Conditioned().to(F64).eval(), torch.randn(4, 6, dtype=F64)
        expected = rf"module 'bilinear' \(Bilinear\) computes bilinear of one activation and a constant .* gets {rule}"
        with pytest.warns(UserWarning, match=expected):
            _relevance(model, x, mapper())
        with pytest.raises(ValueError, match=expected.replace(rule, "FlatRule")):
            _relevance(model, x, EpsilonPlusFlat(strict=True))

    def test_mapped_to_the_epsilon_rule_it_is_that_linear_maps_epsilon_rule(self):
        torch.manual_seed(0)
        model, x = Conditioned().to(F64).eval(), torch.randn(4, 6, dtype=F64)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            mapped, _ = _relevance(model, x, {"bilinear": EpsilonRule(0.25)})
        expected, _ = _relevance(model.as_linear(), x, {"0": EpsilonRule(0.25)})
        assert relative_error(mapped, expected) < 1e-12

    @pytest.mark.parametrize("preset", [EpsilonPlus, EpsilonGammaBox], ids=["EpsilonPlus", "EpsilonGammaBox"])
    def test_not_warned_of_where_a_linear_layer_would_be_near_lrp0_or_of_two_activations(self, preset):
        torch.manual_seed(0)
        model, x = Conditioned().to(F64).eval(), torch.randn(4, 6, dtype=F64)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _relevance(model, x, preset(-3.0, 3.0) if preset is EpsilonGammaBox else preset())
        paired = Paired().to(F64).eval()  # both inputs activations: a product of two signals, warned of as not linear
        with pytest.warns(UserWarning, match=r"module 'bilinear' \(Bilinear\) computes bilinear in its own forward"):
            _relevance(paired, x, EpsilonPlusFlat())


class HandAttention(nn.Module):
    """Attention written out, its weights reshaped or cast by ``change`` before they weigh the values."""

    def __init__(self, change: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(4, 4) for _ in range(4))
        self.change = change

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2), -1)
        return self.o(torch.matmul(self.change(weights), self.v(x))).sum(1)


@pytest.mark.parametrize(
    "change",
    [
        lambda a: a,
        lambda a: a.transpose(-1, -2).contiguous().transpose(-1, -2),
        lambda a: a.float().double(),  # GPT-2's eager attention casts them to the values' dtype
        lambda a: a * 1.0,
        nn.Dropout(0.1).eval(),
    ],
    ids=["as is", "copied", "cast", "scaled", "dropout"],
)
def test_attention_weights_held_where_the_graph_is_kept_are_no_weight_of_the_module(change):
    """Under CP-LRP with an ε the Linear layers feel, the held attention weights, which require grad where the call
    keeps the graph, were taken for a weight of the module's own: its product with the values was warned of as a
    Linear layer's product outside a layer (the relevance was right, as the call without the graph gives it)."""
    torch.manual_seed(0)
    model, x = HandAttention(change).to(F64).eval(), torch.randn(2, 3, 4, dtype=F64)
    plain, _ = _relevance(model, x, CPLRP(epsilon=0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lrp = LRP(model, CPLRP(epsilon=0.1), in_keys=["x"], out_keys=["y"], create_graph=True)
        kept = lrp(TensorDict(x=x, batch_size=[2]))["relevance", "x"]
    assert relative_error(kept.detach(), plain) < 1e-12
