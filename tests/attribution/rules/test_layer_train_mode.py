"""The checks of a Linear or convolution layer's own forward run it in the mode of the call (float64).

A forward that acts in training mode alone (an activation, a dropout, a BatchNorm normalising by its batch) is
checked as the call runs it: refused by name where the rules cannot explain it, and explained as the same model
written with a plain layer and modules of their own beside it where they can. A forward that calls a second linear
map of its input (a low-rank adapter, a gate's own convolution) is refused under the modified passes as that.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.rules import EpsilonPlusFlat
from tdhook.attribution.rules._layer_verdicts import clear_verdicts
from tdhook.attribution.rules._layers import check_layer_forward, check_layer_input
from tests.attribution.rules.test_layer_activations import MODIFIED, LowRankAdapted, inputs, models
from tests.attribution.rules.test_layers import TestQuantizationAwareLayers
from tests.attribution.test_lrp_layers import lrp_relevance
from tests.conftest import relative_error

F64 = torch.float64


def layer(kind: str, forward, name: str, **submodules: nn.Module) -> nn.Module:
    """A Linear or Conv2d subclass (4 to 4 features) whose forward is ``forward(self, x, plain_forward)``."""
    base = nn.Linear if kind == "Linear" else nn.Conv2d

    class Layer(base):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return forward(self, x, super().forward)

    Layer.__name__ = name
    torch.manual_seed(2)
    made = Layer(4, 4) if kind == "Linear" else Layer(4, 4, 3, padding=1)
    for attribute, module in submodules.items():
        setattr(made, attribute, module)
    return made.double()


def plain(kind: str, like: nn.Module) -> nn.Module:
    made = (nn.Linear(4, 4) if kind == "Linear" else nn.Conv2d(4, 4, 3, padding=1)).double()
    made.load_state_dict({name: value for name, value in like.state_dict().items() if name in ("weight", "bias")})
    return made


def tanh_in_training(kind: str) -> nn.Module:
    return layer(kind, lambda self, x, f: torch.tanh(f(x)) if self.training else f(x), f"{kind}TanhInTraining")


def dropout_before(kind: str) -> nn.Module:
    return layer(kind, lambda self, x, f: f(self.drop(x)), f"{kind}DropoutBefore", drop=nn.Dropout(0.5))


def explained(model: nn.Module, reference: nn.Module, kind: str, preset: str, seed: int = 7) -> float:
    """The relative L2 between ``model`` and ``reference`` under ``preset``, each call drawing from ``seed``."""
    x, relevance_out = inputs(kind)
    torch.manual_seed(seed)
    actual = lrp_relevance(model, x, relevance_out, MODIFIED[preset]())
    torch.manual_seed(seed)
    return relative_error(actual, lrp_relevance(reference, x, relevance_out, MODIFIED[preset]()))


class TestActivationInTrainingModeAlone:
    """A tanh the forward runs in training mode alone was never refused (the probes ran in eval mode): a model
    explained in training mode was 0.07 to 0.19 off the tanh beside the layer under EpsilonPlus, EpsilonGammaBox and
    UniformEpsilon, silently. It is now refused by name; in eval mode the layer is the plain one."""

    @pytest.mark.parametrize("preset", ["EpsilonPlus", "EpsilonGammaBox", "UniformEpsilon"])
    @pytest.mark.parametrize("kind", ["Linear", "Conv2d"])
    def test_is_refused_by_name_in_training_mode(self, kind: str, preset: str):
        model, _ = models(tanh_in_training(kind), [], kind)
        name = f"{kind}TanhInTraining"
        with pytest.raises(ValueError, match=rf"module '2' \({name}\): {name}: its forward runs an activation"):
            explained(model.train(), model, kind, preset)

    @pytest.mark.parametrize("preset", ["EpsilonPlus", "UniformEpsilon"])
    @pytest.mark.parametrize("kind", ["Linear", "Conv2d"])
    def test_explains_as_the_plain_layer_in_eval_mode(self, kind: str, preset: str):
        inside = tanh_in_training(kind)
        model, reference = models(inside, [plain(kind, inside)], kind)
        assert explained(model, reference, kind, preset) <= 1e-12

    def test_the_verdict_of_eval_mode_is_not_given_in_training_mode(self):
        inside = tanh_in_training("Linear")
        check_layer_input(inside.eval(), 1e-6)  # passes, and its verdict is kept
        with pytest.raises(ValueError, match="LinearTanhInTraining: its forward runs an activation"):
            check_layer_input(inside.train(), 1e-6)
        check_layer_input(inside.eval(), 1e-6)

    def test_the_modified_passes_verdict_of_eval_mode_is_not_given_in_training_mode(self):
        inside = tanh_in_training("Conv2d")
        check_layer_forward(inside.eval())
        with pytest.raises(ValueError, match="Conv2dTanhInTraining: its forward"):
            check_layer_forward(inside.train())


class TestDropoutInside:
    """A dropout in training mode inside the forward: the ε-rule's gradient runs through the call's own mask, and
    is the dropout beside the layer (the probes draw the same mask in each of their runs: no refusal); a modified
    pass runs the forward again and drew another mask (0.60 relative L2 under EpsilonPlus, 7.3 under
    EpsilonGammaBox, silently): refused by name."""

    @pytest.mark.filterwarnings("ignore:LRP.*is in training mode:UserWarning")
    @pytest.mark.parametrize("kind", ["Linear", "Conv2d"])
    def test_under_the_epsilon_rule_explains_as_the_dropout_beside_the_layer(self, kind: str):
        inside = dropout_before(kind)
        model, reference = models(inside, [nn.Dropout(0.5), plain(kind, inside)], kind)
        assert explained(model.train(), reference.train(), kind, "UniformEpsilon") <= 1e-12

    @pytest.mark.parametrize("preset", ["EpsilonPlus", "EpsilonGammaBox"])
    def test_under_a_modified_pass_is_refused_by_name(self, preset: str):
        model, _ = models(dropout_before("Conv2d"), [], "Conv2d")
        with pytest.raises(ValueError, match=r"Conv2dDropoutBefore: its forward drops elements at random"):
            explained(model.train(), model, "Conv2d", preset)

    def test_the_probes_leave_the_global_random_state_as_it_was(self):
        inside = dropout_before("Linear").train()
        clear_verdicts()
        before = torch.get_rng_state()
        check_layer_input(inside, 0.25)
        assert torch.equal(torch.get_rng_state(), before)


def drop_path_after(kind: str) -> nn.Module:
    """timm's drop path (a per-sample mask drawn with ``bernoulli_``) after the layer's linear function."""
    from timm.layers import drop_path

    return layer(kind, lambda self, x, f: drop_path(f(x), 0.5, self.training), f"{kind}DropPathAfter")


def bernoulli_mask_before(kind: str) -> nn.Module:
    """A mask of elements drawn with ``torch.bernoulli`` before the layer's linear function (no dropout call)."""

    def forward(self, x, f):
        return f(x * torch.bernoulli(torch.full_like(x, 0.5)) * 2.0) if self.training else f(x)

    return layer(kind, forward, f"{kind}BernoulliBefore")


class BernoulliMask(nn.Module):
    """:func:`bernoulli_mask_before`'s mask as a module of its own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.bernoulli(torch.full_like(x, 0.5)) * 2.0


class TestRandomMasksInside:
    """A mask drawn inside the forward without a dropout call (timm's drop path, ``torch.bernoulli``): a modified
    pass runs the forward again and drew another mask (0.60 to 7.3 relative L2 under EpsilonPlus and EpsilonGammaBox
    against the mask beside the layer, 1.0 with a drop path after the convolution, silently): refused by name as a
    dropout is. The ε-rule's gradient runs through the call's own mask: explained as the mask beside the layer."""

    @pytest.mark.parametrize("preset", ["EpsilonPlus", "EpsilonGammaBox"])
    @pytest.mark.parametrize("make", [drop_path_after, bernoulli_mask_before])
    def test_under_a_modified_pass_is_refused_by_name(self, make, preset: str):
        inside = make("Conv2d")
        model, _ = models(inside, [], "Conv2d")
        name = type(inside).__name__
        with pytest.raises(ValueError, match=rf"module '2' \({name}\): {name}: its forward drops elements at random"):
            explained(model.train(), model, "Conv2d", preset)

    @pytest.mark.filterwarnings("ignore:LRP.*is in training mode:UserWarning")
    @pytest.mark.parametrize("kind", ["Linear", "Conv2d"])
    def test_under_the_epsilon_rule_explains_as_the_mask_beside_the_layer(self, kind: str):
        inside = bernoulli_mask_before(kind)
        model, reference = models(inside, [BernoulliMask(), plain(kind, inside)], kind)
        assert explained(model.train(), reference.train(), kind, "UniformEpsilon") <= 1e-12

    @pytest.mark.parametrize("preset", ["EpsilonPlus", "UniformEpsilon"])
    def test_in_eval_mode_explains_as_the_plain_layer(self, preset: str):
        inside = drop_path_after("Conv2d")
        model, reference = models(inside, [plain("Conv2d", inside)], "Conv2d")
        assert explained(model, reference, "Conv2d", preset) <= 1e-12


class TestBatchNormInTrainingMode:
    """torch.ao's QAT ConvBn2d in training mode normalises by the statistics of its batch: the modified passes run
    its forward again (statistics of what they pass), and the ε-rule's gradient runs through them, where a
    BatchNorm beside the layer has them held. It was refused as a shift or an activation, whichever the probes in
    eval mode saw; it is now refused as what it is, by name. In eval mode, as before."""

    @pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
    @pytest.mark.parametrize("preset", ["EpsilonPlus", "EpsilonGammaBox", "EpsilonAlpha2Beta1", "UniformEpsilon"])
    @pytest.mark.parametrize("shift", [False, True])
    def test_is_refused_by_name(self, shift: bool, preset: str):
        qat = TestQuantizationAwareLayers.qat_layer("ConvBn2d", shift=shift)
        qat.bn.eps = 1e-5  # a positive eps: batch statistics may be computed
        model = TestQuantizationAwareLayers.model(qat).train()
        x = torch.randn(4, 3, 5, 5, dtype=F64)
        with pytest.raises(ValueError, match=r"ConvBn2d: its forward normalises by the statistics of the batch"):
            lrp_relevance(model, x, torch.randn(4, 3, dtype=F64), MODIFIED[preset]())


class TestSecondLinearMap:
    """A forward with a second linear map of its input (a low-rank adapter, a gate's own convolution run first) was
    refused under the modified passes as adding a shift (a BatchNorm) or running an activation: it is refused as a
    second map, by name, with the calls it makes."""

    @staticmethod
    def low_rank_conv() -> nn.Module:
        adapter = nn.Sequential(nn.Conv2d(4, 2, 3, padding=1, bias=False), nn.Conv2d(2, 4, 1, bias=False))
        return layer("Conv2d", lambda self, x, f: f(x) + self.adapter(x), "LowRankConv", adapter=adapter)

    @staticmethod
    def gated_conv() -> nn.Module:
        gate = nn.Conv2d(4, 4, 1)
        return layer("Conv2d", lambda self, x, f: torch.sigmoid(self.gate(x)) * f(x), "GatedConv", gate=gate)

    @pytest.mark.parametrize("preset", ["EpsilonPlus", "EpsilonGammaBox", "ZPlus"])
    @pytest.mark.parametrize(("make", "calls"), [("low_rank_conv", 3), ("gated_conv", 2)])
    def test_a_convolution_is_refused_as_a_second_map(self, make: str, calls: int, preset: str):
        inside = getattr(self, make)()
        model, _ = models(inside, [], "Conv2d")
        name = type(inside).__name__
        what = rf"{name}: its forward calls {calls} linear or convolution functions \(F.conv2d"
        with pytest.raises(ValueError, match=rf"module '2' \({name}\): {what}"):
            explained(model, model, "Conv2d", preset)

    def test_a_linear_layer_is_refused_as_a_second_map_under_z_plus(self):
        model, _ = models(LowRankAdapted().double(), [], "Linear")
        with pytest.raises(ValueError, match=r"LowRankAdapted: its forward calls 3 linear or convolution functions"):
            explained(model, model, "Linear", "ZPlus")

    def test_a_low_rank_adapter_explains_as_its_merged_weight_under_the_epsilon_rule(self):
        torch.manual_seed(2)
        inside = LowRankAdapted().double()
        merged = copy.deepcopy(plain("Linear", inside))
        with torch.no_grad():
            merged.weight.copy_(inside.merged())
        model, reference = models(inside, [merged], "Linear")
        assert explained(model, reference, "Linear", "EpsilonPlus") <= 1e-12


class TestNoFalseRefusalInTrainingMode:
    """Layers that the rules explain in training mode as in eval mode are not refused there."""

    @pytest.mark.parametrize("preset", ["EpsilonPlus", "EpsilonGammaBox", "UniformEpsilon"])
    @pytest.mark.parametrize("kind", ["Linear", "Conv2d"])
    def test_a_scaled_layer_explains_as_in_eval_mode(self, kind: str, preset: str):
        model, _ = models(layer(kind, lambda self, x, f: 2.0 * f(x), f"{kind}Doubled"), [], kind)
        evaluated = copy.deepcopy(model)
        assert explained(model.train(), evaluated.eval(), kind, preset) <= 1e-12


class TestModeSetInAnOpenContext:
    """The ε-rule checks a layer at registration, in its mode then: a model set to training mode inside an open
    context was explained through the tanh its forward runs in training mode alone, silently. The call checks the
    layer again where its mode changed, and refuses it by name."""

    # EpsilonPlusFlat gives each Linear layer a FirstLayerRule whose other rule is the ε-rule: its delegation skipped
    # the ε-rule's check of the mode, and the layer was explained through its tanh (0.093 relative L2 against the
    # tanh beside the layer, silently).
    @pytest.mark.parametrize("preset", ["EpsilonPlus", "UniformEpsilon", "EpsilonPlusFlat"])
    def test_a_layer_set_to_training_mode_is_refused_by_name_in_the_call(self, preset: str):
        model, _ = models(tanh_in_training("Linear"), [], "Linear")
        x, relevance_out = inputs("Linear")
        mapper = EpsilonPlusFlat() if preset == "EpsilonPlusFlat" else MODIFIED[preset]()
        lrp = LRP(model, mapper, in_keys=["x"], out_keys=["y"], target=lambda y: relevance_out)
        with lrp:
            lrp(TensorDict(x=x, batch_size=[2]))  # in eval mode: the plain layer
            model.train()
            with pytest.raises(ValueError, match="LinearTanhInTraining: its forward runs an activation") as error:
                lrp(TensorDict(x=x, batch_size=[2]))
        assert "the module is '2'" in "".join(getattr(error.value, "__notes__", []))

    def test_a_layer_under_a_first_layer_rule_set_back_to_eval_mode_explains_as_the_plain_layer(self):
        inside = tanh_in_training("Linear")
        model, reference = models(inside, [plain("Linear", inside)], "Linear")
        x, relevance_out = inputs("Linear")
        lrp = LRP(model, EpsilonPlusFlat(), in_keys=["x"], out_keys=["y"], target=lambda y: relevance_out)
        with lrp:
            lrp(TensorDict(x=x, batch_size=[2]))
            model.train()
            with pytest.raises(ValueError, match="LinearTanhInTraining"):
                lrp(TensorDict(x=x, batch_size=[2]))
            model.eval()
            actual = lrp(TensorDict(x=x, batch_size=[2]))["relevance", "x"]
        expected = lrp_relevance(reference, x, relevance_out, EpsilonPlusFlat())
        assert relative_error(actual, expected) <= 1e-12


def drop_connect(kind: str) -> nn.Module:
    """DropConnect: a dropout in training mode on the weight the layer's linear function is given (the weight it
    used is kept as ``used``)."""

    def forward(self, x, f):
        weight = torch.nn.functional.dropout(self.weight, 0.5, self.training)
        self.used = weight.detach().clone()
        if kind == "Linear":
            return torch.nn.functional.linear(x, weight, self.bias)
        return self._conv_forward(x, weight, self.bias)

    return layer(kind, forward, f"{kind}DropConnect")


class TestDropConnect:
    """DropConnect in training mode: the weight its call uses is not the weight the layer holds (0.69 relative L2
    apart on a Linear layer, 1.9 on a convolution, under UniformEpsilon). The ε-rule's gradient runs through the
    call's own weight: it is the ε-rule on that weight. The modified passes, and a BatchNorm merged into the layer
    (which reads the layer's weight), would use another: refused by name."""

    @staticmethod
    def model(inside: nn.Module, kind: str, norm: bool = False) -> nn.Sequential:
        model, _ = models(inside, [], kind)
        if norm:
            batch_norm = (nn.BatchNorm1d(4) if kind == "Linear" else nn.BatchNorm2d(4)).double()
            with torch.no_grad():
                batch_norm.running_mean.uniform_(-1.0, 1.0)
                batch_norm.running_var.uniform_(0.5, 2.0)
            model.insert(3, batch_norm.eval())
        return model

    @pytest.mark.filterwarnings("ignore:LRP.*is in training mode:UserWarning")
    @pytest.mark.parametrize(("kind", "preset"), [("Linear", "EpsilonPlus"), ("Linear", "UniformEpsilon")])
    def test_under_the_epsilon_rule_is_the_epsilon_rule_on_the_weight_its_call_used(self, kind: str, preset: str):
        self._check_used_weight(kind, preset)

    @pytest.mark.filterwarnings("ignore:LRP.*is in training mode:UserWarning")
    def test_a_convolution_under_the_epsilon_rule_is_the_epsilon_rule_on_the_weight_its_call_used(self):
        self._check_used_weight("Conv2d", "UniformEpsilon")

    def _check_used_weight(self, kind: str, preset: str) -> None:
        inside = drop_connect(kind)
        model = self.model(inside, kind).train()
        x, relevance_out = inputs(kind)
        torch.manual_seed(7)
        actual = lrp_relevance(model, x, relevance_out, MODIFIED[preset]())
        twin = plain(kind, inside)
        with torch.no_grad():
            twin.weight.copy_(inside.used)
        assert not torch.equal(inside.used, inside.weight)  # elements dropped, the rest scaled
        reference = nn.Sequential(*[twin if module is inside else module for module in model]).eval()
        assert relative_error(actual, lrp_relevance(reference, x, relevance_out, MODIFIED[preset]())) <= 1e-12

    @pytest.mark.filterwarnings("ignore:LRP.*is in training mode:UserWarning")
    @pytest.mark.parametrize(
        ("kind", "preset", "norm"),
        [("Conv2d", "EpsilonPlus", False), ("Conv2d", "EpsilonGammaBox", False), ("Linear", "ZPlus", False)]
        + [("Linear", "UniformEpsilon", True), ("Conv2d", "UniformEpsilon", True)],
    )
    def test_under_a_modified_pass_or_merged_with_a_batch_norm_is_refused_by_name(self, kind, preset, norm):
        model = self.model(drop_connect(kind), kind, norm).train()
        model[3].train(not norm)  # a BatchNorm in eval mode holds its statistics: merged into the layer
        with pytest.raises(ValueError, match=rf"{kind}DropConnect: its forward drops elements at random"):
            explained(model, model, kind, preset)

    @pytest.mark.filterwarnings("ignore:LRP.*is in training mode:UserWarning")
    @pytest.mark.parametrize("preset", ["EpsilonPlus", "UniformEpsilon"])
    def test_a_noisy_linear_in_training_mode_is_the_epsilon_rule_on_its_noisy_weight(self, preset: str):
        from torchrl.envs.utils import ExplorationType, set_exploration_type
        from torchrl.modules import NoisyLinear

        torch.manual_seed(0)
        noisy = nn.Sequential(NoisyLinear(3, 4, std_init=2.0), nn.ReLU(), NoisyLinear(4, 3, std_init=2.0))
        noisy = noisy.double().train()
        x, relevance_out = inputs("Linear")
        with set_exploration_type(ExplorationType.RANDOM):  # the noise is used when exploring at random
            twin = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 3)).double()
            with torch.no_grad():
                for layer_, plain_ in ((noisy[0], twin[0]), (noisy[2], twin[2])):
                    plain_.weight.copy_(layer_.weight)
                    plain_.bias.copy_(layer_.bias)
            assert not torch.equal(noisy[0].weight, noisy[0].weight_mu)
            actual = lrp_relevance(noisy, x, relevance_out, MODIFIED[preset]())
        assert relative_error(actual, lrp_relevance(twin, x, relevance_out, MODIFIED[preset]())) <= 1e-12
