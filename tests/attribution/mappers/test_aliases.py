"""Rules keyed by a name under which the model holds a module it also holds under another name.

``named_modules()`` lists such a module once, under its first name; a rule keyed by its other name must still be
its rule. The oracle is zennit's ``NameMapComposite`` given the module's first name (zennit looks names up in
``named_modules()`` too), with its base layer map elsewhere and the ε-rule on the other Linear layers (by name in
both, so that zennit's relevance reaches the input).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.mappers.presets import EpsilonPlus
from tdhook.attribution.rules.basic import EpsilonRule
from tdhook.attribution.rules.modified import GammaRule
from tests.attribution.mappers.test_presets import zennit_by_name
from tests.conftest import relative_error


class Aliased(nn.Module):
    """A hidden layer registered twice: as ``body.2`` and, later, as ``hidden``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
        self.hidden = self.body[2]
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def relevance(model: nn.Module, mapper, x: torch.Tensor) -> torch.Tensor:
    lrp = LRP(model, mapper, in_keys=["x"], out_keys=["y"])
    return lrp(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))["relevance", "x"]


@pytest.fixture
def model_and_input() -> tuple[nn.Module, torch.Tensor]:
    return Aliased().double().eval(), torch.randn(5, 6, dtype=torch.float64)


# The other Linear layers of ``Aliased``, under the ε-rule in tdhook and in zennit.
OTHERS = {"body.0": EpsilonRule(1e-6), "head": EpsilonRule(1e-6)}


def zennit_gamma_on_hidden(model: nn.Module, x: torch.Tensor, gamma: float) -> torch.Tensor:
    from zennit.rules import Epsilon, Gamma

    return zennit_by_name(model, x, [(list(OTHERS), Epsilon(epsilon=1e-6)), (["body.2"], Gamma(gamma=gamma))])


@pytest.mark.parametrize("key", ["hidden", "hid*"])
def test_a_dict_key_for_the_second_name_applies_the_rule(model_and_input, key):
    model, x = model_and_input
    expected = zennit_gamma_on_hidden(model, x, 0.25)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the name matches a module: no warning that it does not
        actual = relevance(model, {**OTHERS, key: GammaRule(0.25)}, x)
    assert relative_error(actual, expected) < 1e-9
    plain = relevance(model, OTHERS, x)
    assert relative_error(plain, expected) > 1e-3  # the rule changes the result


def test_a_callable_asked_under_the_second_name_applies_the_rule(model_and_input):
    model, x = model_and_input
    expected = zennit_gamma_on_hidden(model, x, 0.25)
    rules = {**OTHERS, "hidden": GammaRule(0.25)}
    actual = relevance(model, lambda name, module: rules.get(name), x)
    assert relative_error(actual, expected) < 1e-9


def test_a_preset_keeps_the_users_rule_under_the_second_name(model_and_input):
    model, x = model_and_input
    by_first = relevance(model, EpsilonPlus(rule_mapper={"body.2": GammaRule(0.25)}), x)
    by_second = relevance(model, EpsilonPlus(rule_mapper={"hidden": GammaRule(0.25)}), x)
    preset = relevance(model, EpsilonPlus(), x)
    assert relative_error(by_second, by_first) < 1e-12
    assert relative_error(preset, by_first) > 1e-3


def test_the_first_dict_entry_matching_any_name_wins(model_and_input):
    model, x = model_and_input
    expected = zennit_gamma_on_hidden(model, x, 0.25)
    mapper = {"hidden": GammaRule(0.25), "body.2": EpsilonRule(0.5), **OTHERS}
    assert relative_error(relevance(model, mapper, x), expected) < 1e-9


def test_a_callable_giving_two_rules_to_one_module_is_refused(model_and_input):
    model, x = model_and_input

    def mapper(name: str, module: nn.Module):
        return {"hidden": GammaRule(0.25), "body.2": EpsilonRule(0.5)}.get(name)

    with pytest.raises(ValueError, match=r"module 'body.2' \(Linear\).*'body.2', 'hidden'.*different rules"):
        relevance(model, mapper, x)
    # The same rule under both names (two equal instances) is one rule.
    rules = {**OTHERS, "hidden": GammaRule(0.25), "body.2": GammaRule(0.25)}
    same = relevance(model, lambda name, module: rules.get(name), x)
    assert relative_error(same, zennit_gamma_on_hidden(model, x, 0.25)) < 1e-9


def test_a_layer_shared_by_two_blocks_takes_the_rule_keyed_by_the_second_block():
    class TwoBlocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            shared = nn.Linear(8, 8)
            self.first = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), shared)
            self.second = nn.Sequential(shared, nn.ReLU(), nn.Linear(8, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.second[2](self.second[1](self.first(x)))  # the shared layer is called once

    from zennit.rules import Epsilon

    model, x = TwoBlocks().double().eval(), torch.randn(5, 6, dtype=torch.float64)
    outer = ["first.0", "second.2"]
    expected = zennit_by_name(model, x, [(outer, Epsilon(epsilon=1e-6)), (["first.2"], Epsilon(epsilon=0.5))])
    actual = relevance(model, {"second.0": EpsilonRule(0.5), **dict.fromkeys(outer, EpsilonRule(1e-6))}, x)
    assert relative_error(actual, expected) < 1e-9


def lrp0_layer_relevance(model: Aliased, x: torch.Tensor) -> torch.Tensor:
    """Closed form of LRP-0 at the hidden layer's output: h ⊙ ∂y_target/∂h (gradient × activation)."""
    h = model.body[:3](x).detach().requires_grad_(True)
    y = model.head(model.body[3](h))
    target = y.gather(-1, y.argmax(-1, keepdim=True))
    (grad,) = torch.autograd.grad(target.sum(), h)
    return h.detach() * grad


@pytest.mark.parametrize(("layers", "key"), [(["hidden"], "hidden"), ({"hidden": "h"}, "h"), (["body.2"], "body.2")])
def test_layer_relevance_is_asked_by_any_name_of_the_module(model_and_input, layers, key):
    # The second name was refused as "not a module of the model", in a list of first names only.
    model, x = model_and_input
    lrp = LRP(model, in_keys=["x"], out_keys=["y"], layers=layers)
    td = lrp(TensorDict(x=x.clone(), batch_size=[5]))
    assert relative_error(td["relevance", key], lrp0_layer_relevance(model, x)) < 1e-12
    assert set(td["relevance"].keys()) == {"x", key}


def test_both_names_of_one_module_in_layers_give_the_same_relevance(model_and_input):
    model, x = model_and_input
    td = LRP(model, in_keys=["x"], out_keys=["y"], layers=["body.2", "hidden"])(TensorDict(x=x, batch_size=[5]))
    expected = lrp0_layer_relevance(model, x)
    assert relative_error(td["relevance", "body.2"], expected) < 1e-12
    assert relative_error(td["relevance", "hidden"], expected) < 1e-12


def test_an_unknown_layer_name_lists_every_name_of_the_modules(model_and_input):
    model, _ = model_and_input
    with pytest.raises(KeyError, match=r"LRP: layers names 'hiden', which is not a module.*'body.2'.*'hidden'"):
        LRP(model, in_keys=["x"], out_keys=["y"], layers=["hiden"])


def test_grad_cam_takes_the_layer_by_its_second_name(model_and_input):
    from tdhook.attribution import GradCAM

    model, x = model_and_input
    by_first = GradCAM(model, layer="body.2", in_keys=["x"], out_keys=["y"])(TensorDict(x=x.clone(), batch_size=[5]))
    by_second = GradCAM(model, layer="hidden", in_keys=["x"], out_keys=["y"])(TensorDict(x=x.clone(), batch_size=[5]))
    assert by_first["attribution", "body.2"].abs().sum() > 0
    torch.testing.assert_close(by_second["attribution", "hidden"], by_first["attribution", "body.2"])


class AliasedOwnLinear(nn.Module):
    """A module computing F.linear with its own weight (no nn.Linear to a mapper), held as ``own`` and ``alias``."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 8)
        self.own = OwnLinear()
        self.alias = self.own
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.alias(torch.relu(self.first(x)))))


class OwnLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)


def test_warnings_about_a_module_name_every_name_it_is_held_under():
    model, x = AliasedOwnLinear().double(), torch.randn(4, 6, dtype=torch.float64)
    with pytest.warns(UserWarning, match=r"module 'own' \(also named 'alias'\) \(OwnLinear\) computes linear"):
        relevance(model, EpsilonPlus(epsilon=0.25), x)
