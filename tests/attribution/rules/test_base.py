"""What a rule is: registration, the handle that removes it, ParamModifier, and the user's forward hooks."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torch.nn.modules.module import register_module_forward_hook

from tdhook.attribution import LRP
from tdhook.attribution.mappers.presets import EpsilonPlus
from tdhook.attribution.rules.base import ParamModifier
from tdhook.attribution.rules.basic import EpsilonRule
from tdhook.attribution.rules.input_layer import ZBoxRule
from tdhook.attribution.rules.modified import AlphaBetaRule, GammaRule
from tdhook.attribution.rules.normalization import NormRule
from tests.attribution.rules._helpers import CNN_PRESETS, F64, make_layer
from tests.attribution.test_lrp_layers import lrp_relevance, randomise_batch_norm
from tests.conftest import relative_error


class TestRegistration:
    def test_double_registration_is_refused(self):
        layer = nn.Linear(2, 2)
        rule = EpsilonRule()
        with rule.register(layer):
            with pytest.raises(ValueError, match="already registered"):
                rule.register(layer)
        assert not layer._forward_hooks

    def test_an_interrupted_removal_is_finished_by_the_next_one(self):
        layer = nn.LayerNorm(3)  # the rule acts in the forward: a pre-hook enters its mode, a forward hook leaves it
        rule = NormRule()
        handle = rule.register(layer)
        hooks = rule._registrations[layer].hooks
        assert len(hooks) == 2

        class Interrupted:
            """A hook handle whose first removal is interrupted before it removes anything."""

            def __init__(self, inner) -> None:
                self.inner, self.calls = inner, 0

            def remove(self) -> None:
                self.calls += 1
                if self.calls == 1:
                    raise KeyboardInterrupt
                self.inner.remove()

        hooks[0] = Interrupted(hooks[0])  # removed last
        with pytest.raises(KeyboardInterrupt):
            handle.remove()
        assert rule.is_registered(layer)  # what is left is still the rule's, to be removed
        handle.remove()
        assert not rule.is_registered(layer) and not layer._forward_hooks and not layer._forward_pre_hooks
        with rule.register(layer):  # registered again, once
            assert len(layer._forward_hooks) == 1 and len(layer._forward_pre_hooks) == 1

    def test_handle_removes_hooks_and_never_writes_parameters(self):
        layer, x = make_layer("conv2d")
        before = {k: v.clone() for k, v in layer.state_dict().items()}
        params = dict(layer.named_parameters())
        with GammaRule().register(layer):
            layer(x.requires_grad_(True)).sum().backward()
        assert not layer._forward_hooks and not layer._forward_pre_hooks
        assert all(params[k] is p for k, p in layer.named_parameters())
        assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())

    def test_param_modifier_context_restores_the_same_objects(self):
        layer = nn.Linear(3, 2)
        weight = layer.weight
        with ParamModifier(lambda n, p: p * 0, lambda n, p: n == "weight")(layer):
            assert torch.count_nonzero(layer.weight) == 0
            assert layer.bias is not None
        assert layer.weight is weight

    def test_param_modifier_restores_after_an_error(self):
        layer = nn.Linear(3, 2)
        weight = layer.weight
        with pytest.raises(RuntimeError, match="boom"):
            with ParamModifier(lambda n, p: p * 0)(layer):
                raise RuntimeError("boom")
        assert layer.weight is weight


class HeldTwice(nn.Module):
    """One weight registered under two names; the forward reads the second (``x @ w2ᵀ``)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, 4, dtype=F64))
        self.register_parameter("w2", self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w2.T


class TestParamModifierOnSharedParameters:
    positive = ParamModifier(lambda n, p: p.clamp(min=0))

    def test_a_parameter_held_under_two_names_is_swapped_under_both(self):
        """Only the first name was swapped: a forward reading the second computed with the plain weight."""
        module, x = HeldTwice(), torch.randn(3, 4, dtype=F64)
        weight, version = module.weight, module.weight._version
        with self.positive(module):
            out = module(x)
        torch.testing.assert_close(out, x @ weight.detach().clamp(min=0).T, rtol=0, atol=0)
        assert module.weight is weight and module.w2 is weight and weight._version == version

    def test_a_parametrized_weight_is_refused_by_the_swap_and_read_by_state_dicts(self):
        """A weight_norm weight lives in no parameter slot of the layer: the swap modified the bias alone, and
        state_dicts left the weight out."""
        layer = nn.utils.parametrizations.weight_norm(nn.Linear(4, 2)).to(F64)
        with pytest.raises(ValueError, match=r"'weight' is computed by a parametrization"):
            with self.positive(layer):
                pass
        assert isinstance(layer.bias, nn.Parameter) and nn.utils.parametrize.is_parametrized(layer, "weight")
        _, modified = self.positive.state_dicts(layer)
        torch.testing.assert_close(modified["weight"], layer.weight.detach().clamp(min=0), rtol=0, atol=0)

    def test_a_weight_tied_to_another_layer_is_modified_for_the_swapped_layer_only(self):
        first, second = nn.Linear(4, 4).to(F64), nn.Linear(4, 4).to(F64)
        second.weight = first.weight
        first.weight.grad = torch.ones_like(first.weight)
        weight, version, x = first.weight, first.weight._version, torch.randn(3, 4, dtype=F64)
        with self.positive(first):
            torch.testing.assert_close(second(x), F.linear(x, weight, second.bias), rtol=0, atol=0)
            torch.testing.assert_close(first(x), F.linear(x, weight.clamp(min=0), first.bias.clamp(min=0)))
        assert first.weight is weight and second.weight is weight and weight._version == version
        assert weight.requires_grad and torch.equal(weight.grad, torch.ones_like(weight))


# ----------------------------------------------------------------------------- forward hooks of the user's


class After(nn.Module):
    """``change(layer(x))``: what a forward hook on ``layer`` does, written as code after the layer."""

    def __init__(self, layer: nn.Module, change) -> None:
        super().__init__()
        self.layer, self.change = layer, change

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.change(self.layer(x))


def hooked_cnn() -> nn.Sequential:
    return (
        nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1),
            randomise_batch_norm(nn.BatchNorm2d(4)),
            nn.ReLU(),
            nn.Conv2d(4, 5, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(5, 3),
        )
        .double()
        .eval()
    )


CHANGES = {  # (the hook's change, returned or made in place; the same change out of place)
    "negate": (lambda o: -o, None),
    "permute": (lambda o: o.flip(1), None),  # the channels in reverse order
    "relu-twice": (lambda o: o.relu() * 2, None),
    "tanh": (torch.tanh, None),
    "shift": (lambda o: o + 0.3, None),
    "in-place-scale": (lambda o: o.mul_(2), lambda o: o * 2),
}


class TestForwardHooksOfTheUser:
    """A forward hook on a layer with a rule runs, and is explained as code after the layer (the rule's own hook
    runs first); the rules once took what it changed for the layer's computation (z⁺ off by up to 1.8e1)."""

    @pytest.mark.parametrize("with_kwargs", [False, True])
    @pytest.mark.parametrize("preset", sorted(CNN_PRESETS))
    @pytest.mark.parametrize("change", sorted(CHANGES))
    @pytest.mark.parametrize("layer", [0, 3], ids=["first-conv", "second-conv"])
    def test_a_hook_that_changes_the_output_equals_the_change_written_after_the_layer(
        self, layer: int, change: str, preset: str, with_kwargs: bool
    ):
        hooked, out_of_place = CHANGES[change]
        model = hooked_cnn()
        reference = copy.deepcopy(model)
        reference[layer] = After(reference[layer], out_of_place or hooked)
        ran = []

        def hook(module, args, *rest):
            ran.append(True)
            output = rest[-1]
            result = hooked(output)
            return None if out_of_place else result

        model[layer].register_forward_hook(hook, with_kwargs=with_kwargs)
        x = torch.randn(2, 3, 6, 6, dtype=F64)
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
        relevance_out = torch.randn(2, 3, dtype=F64)
        ran.clear()
        actual = lrp_relevance(model, x, relevance_out, CNN_PRESETS[preset]())
        assert ran  # the hook ran in the explained call
        expected = lrp_relevance(reference, x, relevance_out, CNN_PRESETS[preset]())
        assert relative_error(actual, expected) <= 1e-10

    @pytest.mark.parametrize("layer", [0, 3], ids=["first-conv", "second-conv"])
    def test_a_function_no_rule_covers_in_a_hook_is_named_as_the_same_code_after_the_layer_is(self, layer: int):
        # Before, the watch took the hook's calls for the layer's own, inside its rule: the hook's tanh kept its plain
        # gradient with no warning, coverage() listed nothing and strict=True passed, where the code written after
        # the layer is named.
        model = hooked_cnn()
        model[layer].register_forward_hook(lambda module, args, output: torch.tanh(output))
        td = TensorDict(x=torch.randn(2, 3, 6, 6, dtype=F64), batch_size=[2])
        lrp = LRP(model, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
        with pytest.warns(UserWarning, match=rf"module '{layer}' \(Conv2d\) computes tanh"):
            lrp(td.clone())
        assert [(call.module, call.function) for call in lrp.coverage().plain_gradient] == [(str(layer), "tanh")]
        before = td.clone()
        with pytest.raises(ValueError, match="computes tanh"):
            LRP(model, EpsilonPlus(strict=True), in_keys=["x"], out_keys=["y"])(td)
        assert set(td.keys()) == set(before.keys()) and torch.equal(td["x"], before["x"])

    def test_a_hook_that_only_looks_sees_the_layers_output(self):
        model, seen = hooked_cnn(), []
        model[3].register_forward_hook(lambda module, args, output: seen.append(output.detach().clone()))
        x = torch.randn(2, 3, 6, 6, dtype=F64)
        relevance_out = torch.randn(2, 3, dtype=F64)
        actual = lrp_relevance(model, x, relevance_out, CNN_PRESETS["EpsilonPlus"]())
        with torch.no_grad():
            assert torch.equal(seen[-1], model[:4](x))
        plain = hooked_cnn()
        plain.load_state_dict(model.state_dict())
        expected = lrp_relevance(plain, x, relevance_out, CNN_PRESETS["EpsilonPlus"]())
        assert relative_error(actual, expected) <= 1e-12


class ByKeyword(nn.Sequential):
    """``hooked_cnn``'s layers, each called with its input by keyword (``layer(input=x)``), as model code may."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self:
            x = layer(input=x)
        return x


class Scaled(nn.Conv2d):
    """A convolution with a forward of its own that reads a second argument, given by keyword."""

    def forward(self, input: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return super().forward(input) * scale


class TestCallsByKeyword:
    """A layer called with its input by keyword gets the rule a positional call gets: the rule's hook sees the
    input (the first-layer rule took such a first layer for a later one, Flat gave way to ε: 3.0 off, relative;
    z⁺ and γ on a later layer raised, seeing no input)."""

    @pytest.mark.parametrize("preset", sorted(CNN_PRESETS))
    @pytest.mark.parametrize("kind", ["cnn", "mlp"])
    def test_the_relevance_is_that_of_positional_calls(self, kind: str, preset: str):
        if kind == "cnn":
            model, x = hooked_cnn(), torch.randn(2, 3, 6, 6, dtype=F64)
        else:
            model, x = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3)).double(), torch.randn(2, 5, dtype=F64)
        by_keyword = ByKeyword(*copy.deepcopy(list(model)))
        relevance_out = torch.randn(2, 3, dtype=F64)
        expected = lrp_relevance(model, x, relevance_out, CNN_PRESETS[preset]())
        actual = lrp_relevance(by_keyword, x, relevance_out, CNN_PRESETS[preset]())
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=0)

    @pytest.mark.parametrize("preset", sorted(CNN_PRESETS))
    def test_a_layer_a_tensordict_module_calls_by_keyword(self, preset: str):
        """``TensorDictModule(layer, in_keys={"input": "x"})`` calls the layer with ``input=`` (EpsilonPlusFlat gave
        it ε, not Flat: 2.3 off, relative)."""
        layer, x = nn.Linear(5, 3).double(), torch.randn(4, 5, dtype=F64)

        def relevance(in_keys) -> torch.Tensor:
            policy = TensorDictModule(layer, in_keys=in_keys, out_keys=["y"])
            return LRP(policy, rule_mapper=CNN_PRESETS[preset]())(TensorDict(x=x, batch_size=[4]))["relevance", "x"]

        torch.testing.assert_close(relevance({"input": "x"}), relevance(["x"]), rtol=0, atol=0)

    @pytest.mark.parametrize("activation", [nn.LeakyReLU(0.1, inplace=True), nn.ELU(inplace=True), nn.SiLU(True)])
    def test_an_activation_in_place_called_by_keyword(self, activation: nn.Module):
        """The rule keeps the input of an activation that overwrites it, given by keyword too (the overwritten
        input was read: 0.2 to 1.4 off, relative, under EpsilonPlus)."""
        model = nn.Sequential(nn.Linear(5, 8), activation, nn.Linear(8, 3)).double()
        x, relevance_out = torch.randn(4, 5, dtype=F64), torch.randn(4, 3, dtype=F64)
        expected = lrp_relevance(model, x, relevance_out, EpsilonPlus())
        actual = lrp_relevance(ByKeyword(*model), x, relevance_out, EpsilonPlus())
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=0)

    def test_a_second_argument_by_keyword_is_refused_as_a_positional_one(self):
        """The modified pass runs the layer on its input alone: a keyword it would leave out (a scale here; 5e-6
        off under γ, silently) is refused, as the same argument given by position is."""

        class Model(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.stem, self.scaled, self.head = nn.Conv2d(3, 4, 3), Scaled(4, 4, 3), nn.Linear(4, 3)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                h = self.scaled(self.stem(x).relu(), scale=3.0)
                return self.head(h.relu().mean((2, 3)))

        x, relevance_out = torch.randn(2, 3, 8, 8, dtype=F64), torch.randn(2, 3, dtype=F64)
        with pytest.raises(ValueError, match="GammaRule expects one tensor input on Scaled, got 2 arguments"):
            lrp_relevance(
                Model().double(), x, relevance_out, lambda name, m: GammaRule(0.25) if name == "scaled" else None
            )


class _NormByKeyword(nn.Module):
    """A linear layer, a norm (``norm``) called with its input by keyword or by position, then a head."""

    def __init__(self, norm: nn.Module, keyword: str | None) -> None:
        super().__init__()
        self.fc, self.norm, self.head = nn.Linear(4, 6), norm, nn.Linear(6, 3)
        self.keyword = keyword

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = self.norm(**{self.keyword: h}) if self.keyword else self.norm(h)
        return self.head(h.relu())


class _ConstantNormGate(nn.Module):
    """A learned vector normalised by a LayerNorm (a weight, to the rules), scaling an activation."""

    def __init__(self, keyword: bool) -> None:
        super().__init__()
        self.query, self.norm = nn.Parameter(torch.randn(6)), nn.LayerNorm(6)
        self.fc, self.head = nn.Linear(4, 6), nn.Linear(6, 3)
        self.keyword = keyword

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.norm(input=self.query) if self.keyword else self.norm(self.query)
        return self.head(self.fc(x) * scale)


class _MaskedNorm(nn.LayerNorm):
    """A LayerNorm whose output a mask given beside its input multiplies."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        y = super().forward(x)
        return y if mask is None else y * mask


class _MaskedConstantNormGate(nn.Module):
    """A learned vector normalised by a :class:`_MaskedNorm`, its mask given by keyword, by position or applied after
    the call (``how``), scaling an activation."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.query, self.norm = nn.Parameter(torch.randn(6)), _MaskedNorm(6)
        self.fc, self.head = nn.Linear(4, 6), nn.Linear(6, 3)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.full((6,), 0.5, dtype=x.dtype)
        calls = {
            "norm(query, mask=m)": lambda: self.norm(self.query, mask=mask),
            "norm(x=query, mask=m)": lambda: self.norm(x=self.query, mask=mask),
            "norm(query, m)": lambda: self.norm(self.query, mask),
            "norm(query) * m": lambda: self.norm(self.query) * mask,
        }
        return self.head(self.fc(x) * calls[self.how]())


def _masked_renorm(features: int) -> nn.Module:
    """torchrl's BatchRenorm1d with a mask multiplying its output, given beside its input."""
    from torchrl.modules import BatchRenorm1d

    class MaskedRenorm(BatchRenorm1d):
        def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
            y = super().forward(x)
            return y if mask is None else y * mask

    return MaskedRenorm(features, warmup_steps=0)


class _MaskedRenormCall(nn.Module):
    """A linear layer, a masked BatchRenorm1d called ``norm(mask=m, x=h)`` (``keyword``) or ``norm(h, m)``, a head."""

    def __init__(self, keyword: bool) -> None:
        super().__init__()
        self.fc, self.norm, self.head = nn.Linear(4, 6), _masked_renorm(6), nn.Linear(6, 3)
        self.keyword = keyword

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, mask = self.fc(x), torch.full((6,), 0.5, dtype=x.dtype)
        h = self.norm(mask=mask, x=h) if self.keyword else self.norm(h, mask)
        return self.head(h.relu())


def _first_and_later(make: Callable[[Any], nn.Module], how: Any, preset: str, x: torch.Tensor) -> list[torch.Tensor]:
    """The relevance of ``make(how)`` (seeded, float64) under ``preset`` in the first call of a context, in the
    function modes, and in a later one, by its plan."""
    import tdhook.attribution as attribution

    torch.manual_seed(0)
    model = make(how).to(F64).eval()
    with LRP(model, getattr(attribution, preset)(), in_keys=["x"], out_keys=["y"]) as lrp:
        return [lrp(TensorDict(x=x, batch_size=[5]))["relevance", "x"] for _ in range(2)]


class TestRulesInTheForwardCalledByKeyword:
    """A rule that acts inside its module's forward (norms, torchrl's BatchRenorm1d, tanh) reads the module's input
    given by keyword (``norm(input=x)``) as it reads a positional one. Its hooks saw positional arguments only."""

    @pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
    def test_batch_renorm_gets_the_epsilon_rule_of_its_affine_map(self, training: bool):
        """``BatchRenorm1d(x=h)``: its ε factor was left out (the plain gradient: 0.78 off, relative L2, with ε = 0.5
        in eval mode, 0.68 in training mode; 2.5e-6 under the presets' ε)."""
        from torchrl.modules import BatchRenorm1d

        from tdhook.attribution.rules.normalization import BatchRenormRule

        x = torch.randn(5, 4, dtype=F64)
        relevance = []
        for keyword in ("x", None):
            torch.manual_seed(0)
            model = _NormByKeyword(BatchRenorm1d(6, warmup_steps=0), keyword).to(F64).train(training)
            mapper = {"norm": BatchRenormRule(epsilon=0.5), nn.Linear: EpsilonRule(0.0)}
            lrp = LRP(model, mapper, in_keys=["x"], out_keys=["y"])
            relevance.append(lrp(TensorDict(x=x, batch_size=[5]))["relevance", "x"])
        assert relative_error(relevance[0], relevance[1]) <= 1e-12

    @pytest.mark.parametrize("preset", ["AttnLRP", "CPLRP"])
    def test_a_norm_of_a_constant_stays_a_weight(self, preset: str):
        """``LayerNorm(input=query)`` of a learned vector is a weight, as positionally: a product with it keeps its
        whole relevance (it was taken for an activation, the product got the uniform rule of two: 0.5 off)."""
        x = torch.randn(5, 4, dtype=F64)
        relevance = [r for keyword in (True, False) for r in _first_and_later(_ConstantNormGate, keyword, preset, x)]
        for by_keyword, by_position in zip(relevance[:2], relevance[2:], strict=True):
            assert relative_error(by_keyword, by_position) <= 1e-12

    @pytest.mark.parametrize("preset", ["AttnLRP", "CPLRP"])
    @pytest.mark.parametrize("how", ["norm(query, mask=m)", "norm(x=query, mask=m)", "norm(query, m)"])
    def test_a_norm_of_a_constant_with_a_mask_beside_it_stays_a_weight(self, how: str, preset: str):
        """A constant mask read beside the learned vector (``norm(query, mask=m)``) left the norm's output unmarked:
        taken for an activation, the product got the uniform rule of two (0.5 off, relative L2; by keyword it had no
        positional input, and by position two)."""
        x = torch.randn(5, 4, dtype=F64)
        calls = (how, "norm(query) * m")
        relevance = [r for called in calls for r in _first_and_later(_MaskedConstantNormGate, called, preset, x)]
        for masked, masked_after in zip(relevance[:2], relevance[2:], strict=True):
            assert relative_error(masked, masked_after) <= 1e-12

    def test_a_keyword_call_is_read_in_the_order_of_the_forward_parameters(self):
        """``norm(mask=m, x=h)`` was read with the mask as the input, in the order the call named them: the ε-rule
        of the affine map took the mask for ``h`` (2.6 off ``norm(h, m)``, relative L2, with ε = 0.5)."""
        from tdhook.attribution.rules.normalization import BatchRenormRule

        x = torch.randn(5, 4, dtype=F64)
        relevance = []
        for keyword in (True, False):
            torch.manual_seed(0)
            model = _MaskedRenormCall(keyword).to(F64).eval()
            mapper = {"norm": BatchRenormRule(epsilon=0.5), nn.Linear: EpsilonRule(0.0)}
            lrp = LRP(model, mapper, in_keys=["x"], out_keys=["y"])
            relevance.append(lrp(TensorDict(x=x, batch_size=[5]))["relevance", "x"])
        assert relative_error(relevance[0], relevance[1]) <= 1e-12


class TestGlobalForwardHooks:
    """torch's global forward hooks run before every module's own hooks, the rule's too."""

    def test_one_that_changes_a_layers_output_is_refused_naming_the_module(self):
        model = hooked_cnn()
        target = model[3]
        handle = register_module_forward_hook(lambda module, args, output: -output if module is target else None)
        try:
            with pytest.raises(ValueError, match="global forward hook") as caught:
                lrp_relevance(model, torch.randn(2, 3, 6, 6, dtype=F64), torch.randn(2, 3, dtype=F64), EpsilonPlus())
        finally:
            handle.remove()
        assert any("'3'" in note for note in caught.value.__notes__)
        assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())

    def test_one_that_only_looks_changes_nothing(self):
        model, seen = hooked_cnn(), []
        x, relevance_out = torch.randn(2, 3, 6, 6, dtype=F64), torch.randn(2, 3, dtype=F64)
        expected = lrp_relevance(model, x, relevance_out, EpsilonPlus())
        handle = register_module_forward_hook(lambda module, args, output: seen.append(type(module)))
        try:
            actual = lrp_relevance(model, x, relevance_out, EpsilonPlus())
        finally:
            handle.remove()
        assert nn.Conv2d in seen and torch.equal(actual, expected)


def _rule_hooks(module: nn.Module) -> dict[str, int]:
    return {k: len(v) for k, v in vars(module).items() if "hooks" in k and isinstance(v, dict) and v}


class TestInterruptedRegistration:
    """``Rule.register`` records the registration before it adds a hook: an interrupt at any line leaves either
    nothing on the module, or a registration the rule knows, which ``unregister`` removes. Recorded last, a hook
    added before the interrupt stayed on the module unseen (``is_registered`` false, ``unregister`` a no-op): the
    rule went on changing the module's gradient, training included, and registering it again doubled it."""

    @pytest.mark.parametrize(
        ("make_rule", "make_module"),
        [
            (lambda: EpsilonRule(), lambda: nn.ELU(inplace=True)),  # the in-place snapshot pre-hook, then the hook
            (lambda: GammaRule(0.25), lambda: nn.Linear(2, 2)),
            (lambda: NormRule(), lambda: nn.LayerNorm(2)),  # a rule that acts inside the forward
        ],
        ids=["in-place", "modified", "in-forward"],
    )
    def test_no_hook_is_left_that_the_rule_does_not_know(self, make_rule, make_module):
        from tests.attribution._interrupts import Interrupt, every_line

        x = torch.randn(4, 2)

        def gradient(module: nn.Module) -> torch.Tensor:
            leaf = x.clone().requires_grad_(True)
            return torch.autograd.grad(module(leaf * 1.0).pow(2).sum(), leaf)[0]

        for at in every_line(lambda: make_rule().register(make_module()).remove(), stride=1):
            rule, module = make_rule(), make_module()
            plain = gradient(copy.deepcopy(module))
            with Interrupt(at) as interrupt:
                rule.register(module)
            rule.unregister(module)  # what the caller can still do without the handle
            assert _rule_hooks(module) == {}, interrupt.where
            assert len(rule._registrations) == 0, interrupt.where
            torch.testing.assert_close(gradient(module), plain, rtol=0, atol=0, msg=interrupt.where)


class TestSettingsChangedInAnOpenContext:
    """A rule's setting assigned while its context is open (``rule.gamma = 0.9``) is used by the next call, as by a
    fresh wrapper with that setting. The modified weights (γ, αβ, z^B) were kept from the old setting: γ changed
    from 0.1 to 0.9 on a Linear layer gave the relevance of 0.1, without a word."""

    @pytest.mark.parametrize("batch_norm", [False, True], ids=["linear", "linear-batchnorm"])
    @pytest.mark.parametrize(
        ("make", "change", "make_changed"),
        [
            (lambda: GammaRule(gamma=0.1), {"gamma": 0.9}, lambda: GammaRule(gamma=0.9)),
            (lambda: GammaRule(gamma=0.1), {"stabilizer": 0.5}, lambda: GammaRule(gamma=0.1, stabilizer=0.5)),
            (lambda: AlphaBetaRule(2.0, 1.0), {"alpha": 3.0, "beta": 2.0}, lambda: AlphaBetaRule(3.0, 2.0)),
            (lambda: ZBoxRule(low=-1.0, high=1.0), {"low": -3.0}, lambda: ZBoxRule(low=-3.0, high=1.0)),
        ],
        ids=["gamma", "stabilizer", "alpha-beta", "zbox-low"],
    )
    def test_the_next_call_uses_the_new_setting(self, batch_norm: bool, make, change: dict, make_changed):
        torch.manual_seed(0)
        norm = [randomise_batch_norm(nn.BatchNorm1d(8))] if batch_norm else []
        net = nn.Sequential(nn.Linear(6, 8), *norm, nn.ReLU(), nn.Linear(8, 3)).to(F64).eval()
        policy = TensorDictModule(net, in_keys=["x"], out_keys=["y"])
        x = torch.randn(4, 6, dtype=F64)

        def relevance(lrp: LRP) -> torch.Tensor:
            return lrp(TensorDict(x=x, batch_size=[4]))["relevance", "x"]

        def mapper(rule) -> dict:
            return {"module.0": rule, nn.Linear: EpsilonRule()}

        rule = make()
        lrp = LRP(policy, rule_mapper=mapper(rule))
        with lrp:
            before = relevance(lrp)
            for name, value in change.items():
                setattr(rule, name, value)
            after = relevance(lrp)
        assert relative_error(before, relevance(LRP(policy, rule_mapper=mapper(make())))) <= 1e-12
        assert relative_error(after, relevance(LRP(policy, rule_mapper=mapper(make_changed())))) <= 1e-12
        assert relative_error(after, before) > 1e-3


class EqualLearningRate:
    """The equalised learning rate of progressive-GAN and StyleGAN code: the layer's ``weight`` parameter deleted,
    ``weight_orig`` kept, and ``weight`` set before each call by a forward pre-hook: ``weight_orig`` times a number."""

    def __init__(self, module: nn.Module) -> None:
        weight = module.weight
        del module._parameters["weight"]
        module.register_parameter("weight_orig", nn.Parameter(weight.data))
        module.register_forward_pre_hook(self)

    @staticmethod
    def computed(module: nn.Module) -> torch.Tensor:
        weight = module.weight_orig
        return weight * (2 / weight[0].numel()) ** 0.5

    def __call__(self, module: nn.Module, args: tuple) -> None:
        module.weight = self.computed(module)


def equal_learning_rate_networks() -> tuple[nn.Sequential, nn.Sequential]:
    """A CNN whose convolutions have their weight set by :class:`EqualLearningRate`, never run, and its plain twin
    holding the weights they compute."""
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU()]
    plain = nn.Sequential(*layers, nn.Flatten(), nn.Linear(4 * 6 * 6, 3)).to(F64).eval()
    model = copy.deepcopy(plain)
    for index in (0, 2):
        EqualLearningRate(model[index])
        with torch.no_grad():
            plain[index].weight.copy_(EqualLearningRate.computed(model[index]))
    return model, plain


class TestWeightSetByAPreHook:
    """A layer whose weight a forward pre-hook sets has none until its first call: the modified rules, prepared at
    registration, refused such a model never run ("AlphaBetaRule needs a module with a weight; Conv2d has none").
    It is prepared at its first call, once the hook ran, as a lazy layer is."""

    @staticmethod
    def relevance(lrp: LRP, x: torch.Tensor) -> torch.Tensor:
        return lrp(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))["relevance", "x"]

    @pytest.mark.parametrize("preset", sorted(CNN_PRESETS))
    def test_a_model_never_run_explains_as_the_plain_twin(self, preset: str):
        model, plain = equal_learning_rate_networks()
        x = torch.randn(2, 3, 6, 6, dtype=F64, generator=torch.Generator().manual_seed(1)).clamp(-2.9, 2.9)
        actual = self.relevance(LRP(model, CNN_PRESETS[preset](), in_keys=["x"], out_keys=["y"]), x)
        expected = self.relevance(LRP(plain, CNN_PRESETS[preset](), in_keys=["x"], out_keys=["y"]), x)
        assert relative_error(actual, expected) <= 1e-10

    @pytest.mark.parametrize("preset", sorted(CNN_PRESETS))
    def test_a_weight_changed_in_an_open_context_is_followed(self, preset: str):
        model, _ = equal_learning_rate_networks()
        x = torch.randn(2, 3, 6, 6, dtype=F64, generator=torch.Generator().manual_seed(1)).clamp(-2.9, 2.9)
        lrp = LRP(model, CNN_PRESETS[preset](), in_keys=["x"], out_keys=["y"])
        with lrp:
            self.relevance(lrp, x)
            with torch.no_grad():
                model[2].weight_orig.mul_(-0.5)
            actual = self.relevance(lrp, x)
        expected = self.relevance(LRP(model, CNN_PRESETS[preset](), in_keys=["x"], out_keys=["y"]), x)
        assert relative_error(actual, expected) <= 1e-12
