"""Weight sharing and module reuse: relevance of a model whose modules or parameters serve several calls.

A module called twice is two layers with the same weights, and a parameter held by two modules (tied weights) is
a parameter of each: each module's rule reads it as its own, and the other module's rule never sees the
modification. The oracle is zennit explaining a twin of the model in which every module is called once and holds
parameters of its own (copies of the shared module, of the tied parameter): zennit's hooks keep one input per
module, so zennit itself is wrong on a module called twice (its γ-rule relevance some 75 % off on such a model),
and the twin is the definition. The twins join branches by concatenation, which zennit explains as tdhook does
(it passes relevance through a sum written in a forward as if it were a gradient). The derivative of a relevance
with respect to a tied parameter is that of the untied twin summed over the copies. The shared parameter is left
as it was: the same object, version counter, ``requires_grad`` and ``.grad``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tensordict import TensorDict
from torch import nn
from torch.func import functional_call
from zennit import rules as zrules
from zennit.canonizers import SequentialMergeBatchNorm
from zennit.composites import EpsilonGammaBox as ZennitEpsilonGammaBox
from zennit.composites import EpsilonPlusFlat as ZennitEpsilonPlusFlat
from zennit.composites import NameMapComposite

from tdhook.attribution import LRP
from tdhook.attribution.mappers.presets import EpsilonGammaBox, EpsilonPlusFlat
from tdhook.attribution.rules.basic import EpsilonRule, IgnoreRule
from tdhook.attribution.rules.input_layer import FlatRule, ZBoxRule
from tdhook.attribution.rules.modified import AlphaBetaRule, GammaRule
from tests.attribution.test_lrp_layers import randomise_batch_norm
from tests.conftest import relative_error, zennit_model_relevance

F64 = torch.float64
TOL = 1e-10


def relevance(model: nn.Module, mapper, x: torch.Tensor, **kwargs) -> torch.Tensor:
    lrp = LRP(model, mapper, in_keys=["x"], out_keys=["y"], **kwargs)
    return lrp(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))["relevance", "x"]


def zennit_by_name(model: nn.Module, x: torch.Tensor, names_to_rules: list) -> torch.Tensor:
    """zennit's relevance of the argmax logit, rules given by module name; no rule elsewhere (plain gradient)."""
    return zennit_model_relevance(NameMapComposite(names_to_rules), model, x)


def untied(model: nn.Module, *paths: str) -> nn.Module:
    """A copy of ``model`` in which each parameter at ``paths`` is a parameter of its own, of the same values."""
    twin = copy.deepcopy(model)
    for path in paths:
        owner, _, name = path.rpartition(".")
        module = twin.get_submodule(owner)
        setattr(module, name, nn.Parameter(getattr(module, name).detach().clone()))
    return twin


def parameter_state(parameter: nn.Parameter) -> tuple:
    grad = None if parameter.grad is None else parameter.grad.clone()
    return parameter, parameter._version, parameter.requires_grad, parameter.detach().clone(), grad


def assert_parameter_untouched(parameter: nn.Parameter, before: tuple) -> None:
    same, version, requires_grad, values, grad = before
    assert parameter is same and parameter._version == version and parameter.requires_grad == requires_grad
    assert torch.equal(parameter, values)
    assert torch.equal(parameter.grad, grad) if grad is not None else parameter.grad is None


# ----------------------------------------------------------------------------- tied parameters


class TiedLinear(nn.Module):
    """``b`` holds ``a``'s weight: ``head(relu(b(relu(a(x)))))``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(self.a(x).relu()).relu())


# (tdhook rule of ``a``, of ``b``), and zennit's; ε = 0.1 on the head.
TIED_RULES = {
    "gamma/alpha2beta1": (
        lambda: (GammaRule(0.5), AlphaBetaRule(2.0, 1.0)),
        lambda: (zrules.Gamma(gamma=0.5), zrules.AlphaBeta(alpha=2.0, beta=1.0)),
    ),
    "zplus/gamma": (
        lambda: (AlphaBetaRule(1.0, 0.0), GammaRule(0.25)),
        lambda: (zrules.AlphaBeta(alpha=1.0, beta=0.0), zrules.Gamma(gamma=0.25)),
    ),
    "epsilon/gamma": (lambda: (EpsilonRule(0.1), GammaRule(1.0)), lambda: (zrules.Epsilon(0.1), zrules.Gamma(1.0))),
    "flat/gamma": (lambda: (FlatRule(), GammaRule(0.5)), lambda: (zrules.Flat(), zrules.Gamma(gamma=0.5))),
    "zbox/zplus": (
        lambda: (ZBoxRule(-3.0, 3.0), AlphaBetaRule(1.0, 0.0)),
        lambda: (zrules.ZBox(-3.0, 3.0), zrules.AlphaBeta(alpha=1.0, beta=0.0)),
    ),
    # The plain gradient (LRP-0): zennit's ε-rule as ε → 0 (a module without a zennit rule passes relevance on as
    # if it were a gradient, another thing).
    "gamma/ignore": (lambda: (GammaRule(0.5), IgnoreRule()), lambda: (zrules.Gamma(gamma=0.5), zrules.Epsilon(1e-12))),
}


class TestTiedParameters:
    @pytest.mark.parametrize("pair", sorted(TIED_RULES))
    def test_each_module_applies_its_own_rule_to_the_tied_weight(self, pair: str):
        model = TiedLinear().to(F64)
        twin = untied(model, "b.weight")
        ours, theirs = (make() for make in TIED_RULES[pair])
        x = torch.randn(5, 6, dtype=F64)
        model.a.weight.grad = torch.ones_like(model.a.weight)
        before = parameter_state(model.a.weight)
        actual = relevance(model, {"a": ours[0], "b": ours[1], "head": EpsilonRule(0.1)}, x)
        named = [(["a"], theirs[0]), (["b"], theirs[1]), (["head"], zrules.Epsilon(0.1))]
        expected = zennit_by_name(twin, x, named)
        assert relative_error(actual, expected) <= TOL
        assert_parameter_untouched(model.a.weight, before)
        assert model.b.weight is model.a.weight

    def test_the_tied_weight_is_followed_inside_one_context(self):
        """Calls in one context, then an in-place write to the tied weight: the modified weights of both rules
        follow it."""
        model = TiedLinear().to(F64)
        twin = untied(model, "b.weight")
        mapper = {"a": GammaRule(0.5), "b": AlphaBetaRule(2.0, 1.0), "head": EpsilonRule(0.1)}
        lrp = LRP(model, mapper, in_keys=["x"], out_keys=["y"])
        named = [(["a"], zrules.Gamma(gamma=0.5)), (["b"], zrules.AlphaBeta(2.0, 1.0)), (["head"], zrules.Epsilon(0.1))]
        with lrp:
            for _ in range(3):
                x = torch.randn(4, 6, dtype=F64)
                actual = lrp(TensorDict(x=x, batch_size=[4]))["relevance", "x"]
                assert relative_error(actual, zennit_by_name(twin, x, named)) <= TOL
                with torch.no_grad():
                    model.a.weight.mul_(-1.5)
                    twin.a.weight.mul_(-1.5)
                    twin.b.weight.mul_(-1.5)

    @pytest.mark.parametrize("preset", ["EpsilonGammaBox", "EpsilonPlusFlat"])
    def test_a_convolution_and_its_tied_transpose(self, preset: str):
        """A tied autoencoder: the decoder's transposed convolution holds the encoder's weight."""

        class TiedAutoencoder(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.encoder, self.decoder = nn.Conv2d(3, 4, 3), nn.ConvTranspose2d(4, 3, 3)
                self.decoder.weight = self.encoder.weight
                self.head = nn.Linear(3 * 8 * 8, 5)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.head(self.decoder(self.encoder(x).relu()).relu().flatten(1))

        model = TiedAutoencoder().to(F64)
        twin = untied(model, "decoder.weight")
        x = torch.randn(2, 3, 8, 8, dtype=F64)
        before = parameter_state(model.encoder.weight)
        ours, theirs = {
            "EpsilonGammaBox": (EpsilonGammaBox(-3.0, 3.0), ZennitEpsilonGammaBox(low=-3.0, high=3.0)),
            "EpsilonPlusFlat": (EpsilonPlusFlat(), ZennitEpsilonPlusFlat()),
        }[preset]
        expected = zennit_model_relevance(theirs, twin, x)
        assert relative_error(relevance(model, ours, x), expected) <= TOL
        assert_parameter_untouched(model.encoder.weight, before)

    def test_the_derivative_with_respect_to_a_tied_weight_sums_both_uses(self):
        """``create_graph=True``: the derivative of a loss of the relevance with respect to the tied weight is
        the sum of those with respect to the two copies of the untied twin (paths through both rules' modified
        weights)."""
        model = TiedLinear().to(F64)
        twin = untied(model, "b.weight")
        mapper = {"a": GammaRule(0.5), "b": AlphaBetaRule(2.0, 1.0), "head": EpsilonRule(0.1)}
        x = torch.randn(5, 6, dtype=F64)

        def derivative(net: nn.Module, parameters: list) -> tuple:
            loss = relevance(net, mapper, x, create_graph=True).pow(2).sum()
            return torch.autograd.grad(loss, parameters)

        (tied,) = derivative(model, [model.a.weight])
        first, second = derivative(twin, [twin.a.weight, twin.b.weight])
        assert relative_error(tied, first + second) <= TOL
        assert relative_error(first, second) > 1e-2  # both uses count


# ----------------------------------------------------------------------------- a module called twice


class LinearTwice(nn.Module):
    """``lin`` called twice: the first call followed by a BatchNorm, the second not (``norm_first``), or the
    other way round."""

    def __init__(self, norm_first: bool) -> None:
        super().__init__()
        self.stem, self.lin, self.head = nn.Linear(4, 5), nn.Linear(5, 5), nn.Linear(5, 3)
        self.norm = randomise_batch_norm(nn.BatchNorm1d(5).to(F64)).eval()
        self.norm_first = norm_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x).relu()
        h = self.lin(h)
        h = (self.norm(h) if self.norm_first else h).relu()
        h = self.lin(h)
        return self.head((h if self.norm_first else self.norm(h)).relu())

    def unrolled(self) -> nn.Sequential:
        first, second = copy.deepcopy(self.lin), copy.deepcopy(self.lin)
        calls = [first, self.norm, nn.ReLU(), second] if self.norm_first else [first, nn.ReLU(), second, self.norm]
        return nn.Sequential(self.stem, nn.ReLU(), *calls, nn.ReLU(), self.head)


class NormTwice(nn.Module):
    """One BatchNorm after two different Linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.head = nn.Linear(4, 5), nn.Linear(5, 5), nn.Linear(5, 3)
        self.norm = randomise_batch_norm(nn.BatchNorm1d(5).to(F64)).eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.second(self.norm(self.first(x)).relu())).relu())

    def unrolled(self) -> nn.Sequential:
        norms = copy.deepcopy(self.norm), copy.deepcopy(self.norm)
        return nn.Sequential(self.first, norms[0], nn.ReLU(), self.second, norms[1], nn.ReLU(), self.head)


LAYER_RULES = {
    "gamma": (lambda: GammaRule(0.5), lambda: zrules.Gamma(gamma=0.5)),
    "alpha2beta1": (lambda: AlphaBetaRule(2.0, 1.0), lambda: zrules.AlphaBeta(alpha=2.0, beta=1.0)),
    "epsilon": (lambda: EpsilonRule(0.1), lambda: zrules.Epsilon(0.1)),
}


def zennit_on_linear_layers(model: nn.Sequential, x: torch.Tensor, rule, canonizers=()) -> torch.Tensor:
    names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    composite = NameMapComposite([(names, rule)], canonizers=list(canonizers))
    return zennit_model_relevance(composite, model, x)


class TestModuleCalledTwice:
    def test_gamma_on_a_module_called_twice_is_zennits_on_the_unrolled_model(self):
        """zennit keeps one input per module, so it is no oracle on the model itself: the unrolled twin is."""
        model = LinearTwice(norm_first=False).to(F64)
        model.norm = nn.Identity()
        x = torch.randn(5, 4, dtype=F64)
        expected = zennit_on_linear_layers(model.unrolled(), x, zrules.Gamma(gamma=0.5))
        assert relative_error(relevance(model, {nn.Linear: GammaRule(0.5)}, x), expected) <= TOL

    @pytest.mark.parametrize("norm_first", [True, False], ids=["norm-after-first-call", "norm-after-second-call"])
    @pytest.mark.parametrize("rule", sorted(LAYER_RULES))
    def test_a_batch_norm_merges_into_the_call_it_follows(self, rule: str, norm_first: bool):
        model = LinearTwice(norm_first).to(F64)
        ours, theirs = (make() for make in LAYER_RULES[rule])
        x = torch.randn(5, 4, dtype=F64)
        expected = zennit_on_linear_layers(model.unrolled(), x, theirs, [SequentialMergeBatchNorm()])
        assert relative_error(relevance(model, {nn.Linear: ours}, x), expected) <= TOL

    @pytest.mark.parametrize("rule", sorted(LAYER_RULES))
    def test_one_batch_norm_merges_into_each_layer_it_follows(self, rule: str):
        model = NormTwice().to(F64)
        ours, theirs = (make() for make in LAYER_RULES[rule])
        x = torch.randn(5, 4, dtype=F64)
        expected = zennit_on_linear_layers(model.unrolled(), x, theirs, [SequentialMergeBatchNorm()])
        assert relative_error(relevance(model, {nn.Linear: ours}, x), expected) <= TOL

    @pytest.mark.parametrize("preset", ["EpsilonPlusFlat", "EpsilonGammaBox"])
    def test_a_layer_the_input_reaches_first_on_one_branch_only(self, preset: str):
        """``shared`` reads the input on the first branch (the first-layer rule) and the stem's output on the
        second (the layer rule), in either order of the calls."""

        class Branches(nn.Module):
            def __init__(self, later_first: bool) -> None:
                super().__init__()
                self.stem, self.shared = nn.Conv1d(2, 2, 3, padding=1), nn.Conv1d(2, 3, 3)
                self.head = nn.Linear(2 * 3 * 6, 3)
                self.later_first = later_first

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                later = self.shared(self.stem(x[:, 2:]).relu()).relu() if self.later_first else None
                first = self.shared(x[:, :2]).relu()
                later = self.shared(self.stem(x[:, 2:]).relu()).relu() if later is None else later
                return self.head(torch.cat([first, later], 1).flatten(1))

        class Unrolled(nn.Module):
            def __init__(self, model: Branches) -> None:
                super().__init__()
                self.stem, self.head = model.stem, model.head
                self.on_input, self.inner = copy.deepcopy(model.shared), copy.deepcopy(model.shared)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                first, later = self.on_input(x[:, :2]).relu(), self.inner(self.stem(x[:, 2:]).relu()).relu()
                return self.head(torch.cat([first, later], 1).flatten(1))

        ours, first_rule, inner_rule = {
            "EpsilonPlusFlat": (EpsilonPlusFlat(epsilon=0.1), zrules.Flat(), zrules.ZPlus()),
            "EpsilonGammaBox": (
                EpsilonGammaBox(-3.0, 3.0, epsilon=0.1),
                zrules.ZBox(-3.0, 3.0),
                zrules.Gamma(gamma=0.25),
            ),
        }[preset]
        named = [(["on_input", "stem"], first_rule), (["inner"], inner_rule), (["head"], zrules.Epsilon(0.1))]
        x = torch.randn(5, 4, 8, dtype=F64)
        for later_first in (False, True):
            model = Branches(later_first).to(F64)
            expected = zennit_by_name(Unrolled(model), x, named)
            assert relative_error(relevance(model, ours, x), expected) <= TOL


@pytest.mark.parametrize("norm", [False, True], ids=["", "norm"])
@pytest.mark.parametrize("kind", ["functional_call", "to_module"])
@pytest.mark.parametrize("rule", sorted(LAYER_RULES))
class TestTwoParameterSetsThroughOneModule:
    """An ensemble through one module: its own parameters in one call, a second set put in for another
    (``torch.func.functional_call``, ``TensorDict.to_module``), each call's output through a BatchNorm of its own
    where ``norm``, applied once the call returned. Each call's rule computes with the parameters of that call,
    merged with the BatchNorm that follows it. The twin holds the second set in a layer of its own."""

    class Ensemble(nn.Module):
        def __init__(self, kind: str, norm: bool) -> None:
            super().__init__()
            self.member, self.head, self.kind = nn.Linear(6, 6), nn.Linear(12, 3), kind
            self.weight, self.bias = nn.Parameter(torch.randn(6, 6)), nn.Parameter(torch.randn(6))
            norms = [randomise_batch_norm(nn.BatchNorm1d(6).to(F64)).eval() for _ in range(2)] if norm else []
            self.norms = nn.ModuleList(norms or [nn.Identity(), nn.Identity()])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            params = {"weight": self.weight, "bias": self.bias}
            if self.kind == "functional_call":
                other = functional_call(self.member, params, (x,))
            else:
                with TensorDict(params).to_module(self.member):
                    other = self.member(x)
            own = self.norms[0](self.member(x)).relu()
            return self.head(torch.cat([own, self.norms[1](other).relu()], -1))

    class Members(nn.Module):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            other = nn.Linear(6, 6).to(F64)
            with torch.no_grad():
                other.weight.copy_(model.weight)
                other.bias.copy_(model.bias)
            self.own, self.other = nn.Sequential(model.member, model.norms[0]), nn.Sequential(other, model.norms[1])
            self.head = model.head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.cat([self.own(x).relu(), self.other(x).relu()], -1))

    def test_relevance_is_zennits_on_the_twin(self, rule: str, kind: str, norm: bool):
        """Under ``create_graph=True`` the second call reused the modified weights prepared for the first (γ: 2.0
        relative error), and a BatchNorm after a ``functional_call`` merged the layer's own weight (γ: 1.6, z⁺ on a
        convolution 1.1), with or without the graph kept."""
        model = self.Ensemble(kind, norm).to(F64)
        ours, theirs = (make() for make in LAYER_RULES[rule])
        x = torch.randn(5, 6, dtype=F64)
        composite = NameMapComposite([(["own.0", "other.0", "head"], theirs)], canonizers=[SequentialMergeBatchNorm()])
        expected = zennit_model_relevance(composite, self.Members(model), x)
        for create_graph in (False, True):
            actual = relevance(model, {nn.Linear: ours}, x, create_graph=create_graph)
            assert relative_error(actual, expected) <= TOL
        assert not any(name in vars(model.member) for name in ("weight", "bias"))  # its own parameters back

    def test_the_derivative_follows_each_parameter_set(self, rule: str, kind: str, norm: bool):
        model = self.Ensemble(kind, norm).to(F64)
        twin = self.Members(model)
        mapper = {nn.Linear: LAYER_RULES[rule][0]()}
        x = torch.randn(5, 6, dtype=F64)

        def derivative(net: nn.Module, parameters: list) -> tuple:
            loss = relevance(net, mapper, x, create_graph=True).pow(2).sum()
            return torch.autograd.grad(loss, parameters)

        ours = derivative(model, [model.member.weight, model.weight, model.bias])
        theirs = derivative(twin, [twin.own[0].weight, twin.other[0].weight, twin.other[0].bias])
        for actual, expected in zip(ours, theirs, strict=True):
            assert relative_error(actual, expected) <= 1e-9


# ----------------------------------------------------------------------------- one layer, two wrappers


def test_a_rule_shared_by_two_wrappers_over_a_shared_layer_follows_each_model():
    """One GammaRule object in two wrappers whose models share a Linear layer, followed by a BatchNorm in one model
    (merged: the rule's weights are those of the merged layer) and not in the other: calls in turn, outside and
    inside contexts, each match zennit on its model."""
    layer = nn.Linear(6, 6).to(F64)
    norm = randomise_batch_norm(nn.BatchNorm1d(6).to(F64)).eval()
    with_norm = nn.Sequential(layer, norm, nn.ReLU(), nn.Linear(6, 3).to(F64))
    without = nn.Sequential(layer, nn.ReLU(), nn.Linear(6, 3).to(F64))
    gamma = GammaRule(0.5)
    mapper = {"0": gamma, nn.Linear: EpsilonRule(0.1)}
    wrappers = [LRP(model, mapper, in_keys=["x"], out_keys=["y"]) for model in (with_norm, without)]
    x = torch.randn(5, 6, dtype=F64)
    merged = NameMapComposite(
        [(["0"], zrules.Gamma(gamma=0.5)), (["3"], zrules.Epsilon(0.1))], canonizers=[SequentialMergeBatchNorm()]
    )
    expected = [
        zennit_model_relevance(merged, with_norm, x),
        zennit_by_name(without, x, [(["0"], zrules.Gamma(gamma=0.5)), (["2"], zrules.Epsilon(0.1))]),
    ]
    assert relative_error(expected[0], expected[1]) > 1e-2
    for _ in range(2):
        for wrapper, reference in zip(wrappers, expected, strict=True):
            assert relative_error(wrapper(TensorDict(x=x, batch_size=[5]))["relevance", "x"], reference) <= TOL
            with wrapper:
                actual = wrapper(TensorDict(x=x, batch_size=[5]))["relevance", "x"]
            assert relative_error(actual, reference) <= TOL
