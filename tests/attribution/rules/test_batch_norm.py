"""MergeBatchNormRule: a layer merged with its BatchNorm, and the same layer in a call that is not merged."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP, UniformEpsilon
from tdhook.attribution.rules.basic import EpsilonRule
from tdhook.attribution.rules.batch_norm import MergeBatchNormRule
from tdhook.attribution.rules.modified import GammaRule
from tests.attribution.rules._helpers import CNN_PRESETS, make_layer
from tests.conftest import relative_error


class TestFastPaths:
    """The paths that skip autograd or a product, each checked against zennit and shown to be taken."""

    @pytest.mark.parametrize("in_place", [None, "mul_"])
    def test_a_layer_merged_last_call_but_not_this_one_gets_its_own_output(self, in_place):
        # Merged with its BatchNorm in the last call, the layer skips copying its output; a call that is not
        # merged copies it in the backward pass or, when an in-place operation changed it, recomputes it.
        layer, x = make_layer("conv2d")
        x = x.abs()
        grad_out = torch.randn_like(layer(x))

        def relevance() -> torch.Tensor:
            leaf = x.clone().requires_grad_(True)
            out = layer(leaf)
            if in_place:
                out = getattr(out, in_place)(2.0)
            return leaf.detach() * torch.autograd.grad(out, leaf, grad_out)[0]

        norm = nn.BatchNorm2d(4).double().eval()
        fresh = GammaRule(0.25)
        with fresh.register(layer):
            expected = relevance()
        rule = GammaRule(0.25)
        with rule.register(layer), MergeBatchNormRule().register(norm):
            norm(layer(x.clone().requires_grad_(True)))  # merged: the next call does not copy the output
            actual = relevance()
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-14)


class TestLazyBatchNorm:
    """A lazy BatchNorm (and layer) has no parameters when the rule is registered: the merge is prepared at its
    first call, as for a BatchNorm whose parameters are known."""

    @pytest.mark.parametrize("preset", sorted(CNN_PRESETS))
    @pytest.mark.parametrize("lazy_layer", [False, True], ids=["conv", "lazy-conv"])
    def test_first_call_equals_the_materialised_model(self, preset: str, lazy_layer: bool):
        torch.manual_seed(0)
        conv = nn.LazyConv2d(4, 3) if lazy_layer else nn.Conv2d(3, 4, 3)
        model = nn.Sequential(conv, nn.LazyBatchNorm2d(), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3)).double().eval()
        x = torch.randn(2, 3, 6, 6, dtype=torch.float64).clamp(-2.9, 2.9)

        def relevance(net: nn.Module) -> torch.Tensor:
            lrp = LRP(net, CNN_PRESETS[preset](), in_keys=["x"], out_keys=["y"])
            return lrp(TensorDict(x=x.clone(), batch_size=[2]))["relevance", "x"]

        first = relevance(model)  # materialised in this call, inside the context
        assert type(model[1]) is nn.BatchNorm2d and not torch.equal(first, torch.zeros_like(first))
        # The same model, its parameters known before the context (eval mode: the call changed no statistic).
        assert relative_error(first, relevance(copy.deepcopy(model))) <= 1e-12


class TestBackwardHooksOfTheUser:
    """A full backward hook (or pre-hook) of the user's on the layer or on its BatchNorm makes torch hand on a view
    of the layer's output; the layer is merged all the same (it was not: 0.4 to 1.0 off, relative, under every CNN
    preset, though the hook only looks). The merged pair is one layer of the explanation: a hook of the two whose
    gradient it does not pass through is not called."""

    @pytest.mark.parametrize("preset", sorted(CNN_PRESETS))
    @pytest.mark.parametrize("hooked", ["layer", "batch-norm"])
    @pytest.mark.parametrize("kind", ["full", "pre"])
    def test_the_relevance_is_that_of_the_model_without_the_hook(self, preset: str, hooked: str, kind: str):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))
        model = model.double().eval()
        model[1].running_mean.uniform_(-1.0, 1.0)
        model[1].running_var.uniform_(0.5, 2.0)
        hooked_model = copy.deepcopy(model)
        module = hooked_model[0 if hooked == "layer" else 1]
        if kind == "full":
            module.register_full_backward_hook(lambda module, grad_input, grad_output: None)
        else:
            module.register_full_backward_pre_hook(lambda module, grad_output: None)
        x = torch.randn(2, 3, 6, 6, dtype=torch.float64).clamp(-2.9, 2.9)

        def relevance(net: nn.Module) -> torch.Tensor:
            lrp = LRP(net, CNN_PRESETS[preset](), in_keys=["x"], out_keys=["y"])
            return lrp(TensorDict(x=x.clone(), batch_size=[2]))["relevance", "x"]

        torch.testing.assert_close(relevance(hooked_model), relevance(model), rtol=1e-12, atol=0)


class TokensFlattened(nn.Module):
    """A Linear layer over tokens ``(N, L, C)`` whose BatchNorm1d normalises them flattened to ``(N·L, C)``, then
    shaped back (timm's ``LinearNorm``, in LeViT)."""

    def __init__(self, layer: nn.Linear, norm: nn.BatchNorm1d) -> None:
        super().__init__()
        self.linear, self.bn = layer, norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.linear(x)
        return self.bn(z.flatten(0, 1)).reshape_as(z)


class TestTokensFlattenedIntoTheBatchNorm:
    """A BatchNorm1d over a Linear layer's flattened tokens is merged into the layer, as over its plain output:
    each rule equals zennit's on the merged layer built by hand (left unmerged, the BatchNorm's ε-rule took the
    layer's relevance elsewhere: 29 % off for ε = 0.1, 61-106 % for γ and αβ)."""

    @pytest.mark.parametrize("rule_name", ["epsilon", "alpha2beta1", "gamma"])
    def test_equals_zennit_on_the_merged_layer(self, rule_name: str):
        from zennit import rules as zrules

        from tests.attribution.test_lrp_layers import (
            MERGE_RULES,
            lrp_relevance,
            merged_by_hand,
            randomise_batch_norm,
            zennit_composite_relevance,
        )

        ours, theirs = MERGE_RULES[rule_name]
        torch.manual_seed(0)
        layer = nn.Linear(6, 5).double()
        norm = randomise_batch_norm(nn.BatchNorm1d(5).double()).eval()
        model = nn.Sequential(TokensFlattened(layer, norm), nn.ReLU(), nn.Linear(5, 3).double()).eval()
        merged = nn.Sequential(merged_by_hand(layer, norm), nn.ReLU(), copy.deepcopy(model[2]))
        x = torch.randn(2, 4, 6, dtype=torch.float64)
        with torch.no_grad():
            torch.testing.assert_close(merged(x), model(x), rtol=1e-12, atol=1e-12)
        r_out = torch.randn(2, 4, 3, dtype=torch.float64)
        actual = lrp_relevance(model, x, r_out, rule_mapper={nn.Linear: ours()})
        expected = zennit_composite_relevance(merged, x, r_out, [(nn.Linear, theirs()), (nn.ReLU, zrules.Pass())])
        assert relative_error(actual, expected) <= 1e-6
        unmerged = zennit_composite_relevance(
            model, x, r_out, [(nn.Linear, theirs()), (nn.ReLU, zrules.Pass()), (nn.BatchNorm1d, zrules.Pass())]
        )
        assert relative_error(unmerged, expected) > 1e-3  # the comparison can tell merged from not

    @pytest.mark.parametrize("rule_name", ["epsilon", "alpha2beta1", "gamma"])
    @pytest.mark.parametrize("shape", [(8, 6), (2, 4, 6)], ids=["same-shape", "tokens"])
    def test_a_reshape_to_rows_is_merged_whatever_the_batch_shape(self, rule_name: str, shape: tuple[int, ...]):
        # ``bn(z.reshape(-1, C)).reshape_as(z)``, as code written for any batch shape does: a flat batch makes it a
        # view of the same shape, which was left unmerged (γ 0.36 off the merged layer; only [B, T] merged).
        from zennit import rules as zrules

        from tests.attribution.test_lrp_layers import (
            MERGE_RULES,
            lrp_relevance,
            merged_by_hand,
            randomise_batch_norm,
            zennit_composite_relevance,
        )

        class RowsReshaped(TokensFlattened):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                z = self.linear(x)
                return self.bn(z.reshape(-1, z.shape[-1])).reshape_as(z)

        ours, theirs = MERGE_RULES[rule_name]
        torch.manual_seed(0)
        layer = nn.Linear(6, 5).double()
        norm = randomise_batch_norm(nn.BatchNorm1d(5).double()).eval()
        model = nn.Sequential(RowsReshaped(layer, norm), nn.ReLU(), nn.Linear(5, 3).double()).eval()
        merged = nn.Sequential(merged_by_hand(layer, norm), nn.ReLU(), copy.deepcopy(model[2]))
        x = torch.randn(*shape, dtype=torch.float64)
        r_out = torch.randn(*shape[:-1], 3, dtype=torch.float64)
        actual = lrp_relevance(model, x, r_out, rule_mapper={nn.Linear: ours()})
        expected = zennit_composite_relevance(merged, x, r_out, [(nn.Linear, theirs()), (nn.ReLU, zrules.Pass())])
        assert relative_error(actual, expected) <= 1e-6

    @pytest.mark.parametrize("preset", ["CPLRP", "AttnLRP", *CNN_PRESETS])
    @pytest.mark.parametrize("batch", [[2], [2, 4]], ids=["B", "BT"])
    def test_tokens_of_a_linear_with_bias_merge_under_every_preset(self, preset: str, batch: list[int]):
        # F.linear with a bias on (N, L, C) tokens returns a view of its (N·L, C) product, and the tokens
        # reshaped to rows are a view of that product, not of the layer's output: where the layer's rule leaves
        # its output as it is (LRP-0 in CP-LRP and AttnLRP), the BatchNorm was not merged and got the ε-rule of
        # its affine map at the default stabilizer (3.4e-5 relative off the merged layer, with no warning).
        from tdhook.attribution import CPLRP, AttnLRP
        from tests.attribution.test_lrp_layers import merged_by_hand, randomise_batch_norm

        class RowsReshaped(TokensFlattened):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                z = self.linear(x)
                return self.bn(z.reshape(-1, z.shape[-1])).reshape(z.shape)

        presets = {"CPLRP": CPLRP, "AttnLRP": AttnLRP, **CNN_PRESETS}
        torch.manual_seed(0)
        layer, norm = nn.Linear(6, 5).double(), randomise_batch_norm(nn.BatchNorm1d(5).double()).eval()
        norm.eps = 1e-5
        with torch.no_grad():
            layer.bias.normal_()
        model = nn.Sequential(RowsReshaped(layer, norm), nn.ReLU(), nn.Linear(5, 3).double()).eval()
        merged = nn.Sequential(merged_by_hand(layer, norm), nn.ReLU(), copy.deepcopy(model[2])).eval()
        x = torch.randn(2, 4, 6, dtype=torch.float64)

        def relevance(net: nn.Module) -> torch.Tensor:
            lrp = LRP(net, rule_mapper=presets[preset](), in_keys=["x"], out_keys=["y"])
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                return lrp(TensorDict(x=x.clone(), batch_size=batch))["relevance", "x"]

        assert relative_error(relevance(model), relevance(merged)) <= 1e-10

    def test_tokens_of_a_linear_with_bias_conserve_under_cplrp(self):
        # With every shift zeroed, CP-LRP's LRP-0 on the merged layer conserves the explained logit exactly; the
        # BatchNorm's ε-rule left unmerged lost 5e-7 of it.
        from tdhook.attribution import CPLRP

        class RowsReshaped(TokensFlattened):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                z = self.linear(x)
                return self.bn(z.flatten(0, 1)).reshape(z.shape)

        torch.manual_seed(0)
        layer, norm = nn.Linear(6, 5).double(), nn.BatchNorm1d(5).double().eval()
        with torch.no_grad():
            layer.bias.zero_()  # still a bias: F.linear computes addmm and views its product
            norm.running_var.uniform_(1e-4, 1e-3)  # a small variance: the BatchNorm's output far from its input
            norm.weight.uniform_(0.5, 1.5)
        model = nn.Sequential(RowsReshaped(layer, norm), nn.ReLU(), nn.Linear(5, 3, bias=False).double()).eval()
        x = torch.randn(2, 4, 6, dtype=torch.float64)
        td = LRP(model, rule_mapper=CPLRP(), in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[2, 4]))
        torch.testing.assert_close(td["relevance", "x"].sum(-1), td["y"].max(-1).values, rtol=1e-10, atol=1e-12)

    def test_a_view_of_part_of_the_tokens_is_not_merged(self):
        # The BatchNorm sees the first token of each sample only (a view of part of the layer's rows):
        # no merge, and the BatchNorm gets the ε-rule of its affine map, as zennit's Epsilon on it.
        from zennit import rules as zrules

        from tests.attribution.test_lrp_layers import lrp_relevance, randomise_batch_norm, zennit_composite_relevance

        class FirstSample(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.linear, self.bn = nn.Linear(6, 5), randomise_batch_norm(nn.BatchNorm1d(5).double()).eval()

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.bn(self.linear(x)[:, 0])

        torch.manual_seed(0)
        model = FirstSample().double().eval()
        x = torch.randn(2, 4, 6, dtype=torch.float64)
        r_out = torch.randn(2, 5, dtype=torch.float64)
        actual = lrp_relevance(model, x, r_out, rule_mapper={nn.Linear: GammaRule(0.25)})
        expected = zennit_composite_relevance(
            model, x, r_out, [(nn.Linear, zrules.Gamma(0.25)), (nn.BatchNorm1d, zrules.Epsilon(1e-6))]
        )
        assert relative_error(actual, expected) <= 1e-6


class PerSample(nn.Module):
    """A convolution on unbatched inputs ``(C, *spatial)``, one sample at a time, then a BatchNorm that reads the
    convolution's output as a batch: its dimension 1 is the first spatial one, not the layer's channels."""

    def __init__(self, layer: nn.Module, norm: nn.Module) -> None:
        super().__init__()
        self.layer, self.bn = layer, norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.bn(self.layer(sample)) for sample in x]).flatten(1)


class TestUnbatchedLayerOutputIsNotMerged:
    """An unbatched convolution's output ``(C_out, L)`` seen by BatchNorm1d(L) is normalised per position, not per
    output channel: folding the BatchNorm into the channels explained another function (190-250 % off LRP-0 =
    gradient × input here). The BatchNorm gets the ε-rule of its affine map, which with ε = 0 is LRP-0."""

    @pytest.mark.parametrize(
        ("layer", "norm", "shape"),
        [
            (nn.Conv1d(2, 4, 3), nn.BatchNorm1d(4), (3, 2, 6)),  # output (4, 4): L == C_out
            (nn.Conv3d(2, 3, 1), nn.BatchNorm2d(3), (3, 2, 3, 2, 2)),  # output (3, 3, 2, 2): D == C_out
            (nn.ConvTranspose1d(2, 3, 2), nn.BatchNorm1d(3), (3, 2, 2)),  # output (3, 3)
        ],
        ids=["conv1d", "conv3d", "convtranspose1d"],
    )
    def test_lrp_0_equals_gradient_times_input(self, layer, norm, shape):
        from tdhook.attribution import BaseRuleMapper, EpsilonRule
        from tests.attribution.test_lrp_layers import lrp_relevance, randomise_batch_norm

        model = PerSample(layer.double(), randomise_batch_norm(norm.double())).eval()
        x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
        y = model(x)
        r_out = torch.randn_like(y)
        (grad,) = torch.autograd.grad(y, x, r_out / y)  # the output relevance is the output times its gradient
        mapper = BaseRuleMapper(stabilizer=0.0, rule_mapper={type(layer): EpsilonRule(0.0)})
        actual = lrp_relevance(model, x, r_out, rule_mapper=mapper)
        assert relative_error(actual, x.detach() * grad) <= 1e-10


def frozen_copy(norm: nn.BatchNorm2d, with_act: bool) -> nn.Module:
    """``norm`` frozen as torchvision's ``FrozenBatchNorm2d`` (what timm's ``freeze_batch_norm_2d`` and
    torchvision's detection backbones hold), or as timm's ``FrozenBatchNormAct2d`` with a ReLU inside."""
    from timm.layers import FrozenBatchNormAct2d
    from torchvision.ops.misc import FrozenBatchNorm2d

    n = norm.num_features
    frozen = (FrozenBatchNormAct2d(n, act_layer=nn.ReLU) if with_act else FrozenBatchNorm2d(n)).double()
    frozen.eps = norm.eps
    for name in ("weight", "bias", "running_mean", "running_var"):
        getattr(frozen, name).copy_(getattr(norm, name).detach())
    return frozen


class TestFrozenBatchNorm:
    """A frozen BatchNorm (torchvision's ``FrozenBatchNorm2d``, timm's ``FrozenBatchNormAct2d``) computes the
    eval-mode BatchNorm from buffers, ``x · s + t``: it is merged into the layer before it as a BatchNorm is. Left
    with its plain gradient, freezing the BatchNorms of a model changed its relevance with no warning (78 % under
    EpsilonPlus on timm's resnet18, 2.3 times it on efficientnet_b0)."""

    @pytest.mark.parametrize("preset", sorted(CNN_PRESETS))
    @pytest.mark.parametrize("with_act", [False, True], ids=["FrozenBatchNorm2d", "FrozenBatchNormAct2d"])
    @pytest.mark.parametrize("after", ["layer", "relu"])
    def test_equals_the_batch_norm_it_freezes(self, preset: str, with_act: bool, after: str):
        from tests.attribution.test_lrp_layers import randomise_batch_norm

        torch.manual_seed(0)
        norm = randomise_batch_norm(nn.BatchNorm2d(4).double()).eval()
        head = [nn.Flatten(), nn.Linear(64, 3)]
        before = [nn.Conv2d(3, 4, 3)] + ([nn.ReLU()] if after == "relu" else [])
        plain = nn.Sequential(*before, norm, nn.ReLU(), *head).double().eval()
        frozen = copy.deepcopy(plain)
        frozen[len(before)] = frozen_copy(norm, with_act)
        if with_act:
            frozen[len(before) + 1] = nn.Identity()
        x = torch.randn(2, 3, 6, 6, dtype=torch.float64).clamp(-2.9, 2.9)
        with torch.no_grad():
            torch.testing.assert_close(frozen(x), plain(x), rtol=1e-12, atol=1e-12)
        state = copy.deepcopy(frozen.state_dict())

        def relevance(net: nn.Module) -> torch.Tensor:
            lrp = LRP(net, CNN_PRESETS[preset](), in_keys=["x"], out_keys=["y"])
            return lrp(TensorDict(x=x.clone(), batch_size=[2]))["relevance", "x"]

        assert relative_error(relevance(frozen), relevance(plain)) <= 1e-10
        assert all(torch.equal(value, frozen.state_dict()[key]) for key, value in state.items())


def _frozen_in_place(norm: nn.BatchNorm2d, form: str) -> nn.Module:
    """``norm`` frozen as torchvision's ``FrozenBatchNorm2d``, with its shift added (or its scale multiplied) in place
    in its forward, as some frozen BatchNorms of detection code write it."""
    from torchvision.ops.misc import FrozenBatchNorm2d

    class FrozenBatchNorm2dInPlace(FrozenBatchNorm2d):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            scale = self.weight * (self.running_var + self.eps).rsqrt()
            shift = (self.bias - self.running_mean * scale).reshape(1, -1, 1, 1)
            scale = scale.reshape(1, -1, 1, 1)
            if form == "out *= scale":
                out = x.clone()
                out *= scale
                return out + shift
            out = x * scale
            if form == "out += shift":
                out += shift
            else:
                out.add_(shift)
            return out

    frozen = FrozenBatchNorm2dInPlace(norm.num_features).double()
    frozen.eps = norm.eps
    for name in ("weight", "bias", "running_mean", "running_var"):
        getattr(frozen, name).copy_(getattr(norm, name).detach())
    return frozen


def _plain_and_frozen(freeze: Callable[[nn.BatchNorm2d], nn.Module], eps: float = 0.0) -> tuple:
    """A convolution, a BatchNorm (statistics far from the identity, ``eps``), a ReLU and a head; the same model with
    the BatchNorm frozen by ``freeze``, checked to compute the same function; and an input."""
    from tests.attribution.test_lrp_layers import randomise_batch_norm

    torch.manual_seed(0)
    norm = randomise_batch_norm(nn.BatchNorm2d(4).double()).eval()
    norm.eps = eps
    plain = nn.Sequential(nn.Conv2d(3, 4, 3), norm, nn.ReLU(), nn.Flatten(), nn.Linear(64, 3)).double().eval()
    frozen = copy.deepcopy(plain)
    frozen[1] = freeze(norm)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64).clamp(-2.9, 2.9)
    with torch.no_grad():
        torch.testing.assert_close(frozen(x), plain(x), rtol=1e-12, atol=1e-12)
    return plain, frozen, x


class TestFrozenBatchNormWrittenInPlace:
    """A frozen BatchNorm whose forward adds its shift in place (``out += shift``, ``out.add_(shift)``) was refused
    (its ``x * scale + shift`` not found): it is merged into the layer before it as one written out of place is.
    One that multiplies its scale in place is refused, naming the module and what to do."""

    @pytest.mark.parametrize("preset", sorted(CNN_PRESETS))
    @pytest.mark.parametrize("form", ["out += shift", "out.add_(shift)"])
    def test_equals_the_batch_norm_it_freezes(self, preset: str, form: str):
        plain, frozen, x = _plain_and_frozen(lambda norm: _frozen_in_place(norm, form))

        def relevance(net: nn.Module) -> torch.Tensor:
            lrp = LRP(net, CNN_PRESETS[preset](), in_keys=["x"], out_keys=["y"])
            return lrp(TensorDict(x=x.clone(), batch_size=[2]))["relevance", "x"]

        assert relative_error(relevance(frozen), relevance(plain)) <= 1e-10

    def test_a_scale_multiplied_in_place_is_refused_with_what_to_do(self):
        from tests.attribution.test_lrp_layers import randomise_batch_norm

        torch.manual_seed(0)
        norm = randomise_batch_norm(nn.BatchNorm2d(4).double()).eval()
        model = nn.Sequential(nn.Conv2d(3, 4, 3), _frozen_in_place(norm, "out *= scale"), nn.Flatten()).double()
        x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
        lrp = LRP(model, CNN_PRESETS[sorted(CNN_PRESETS)[0]](), in_keys=["x"], out_keys=["y"])
        with pytest.raises(ValueError, match=r"FrozenBatchNorm2dInPlace.*out \*= scale.*IgnoreRule"):
            lrp(TensorDict(x=x, batch_size=[2]))


def _frozen_without_eps(norm: nn.BatchNorm2d, kind: str) -> nn.Module:
    """``norm`` frozen as Hugging Face's ``DetrFrozenBatchNorm2d`` or ``RTDetrFrozenBatchNorm2d`` (ε 1e-5 written
    in the forward), or as maskrcnn-benchmark's ``FrozenBatchNorm2d`` (no ε at all; its variance raised by the
    BatchNorm's ε here, so that both compute the same map): no ``eps`` attribute."""
    import importlib

    if kind == "maskrcnn":

        class FrozenBatchNorm2d(nn.Module):
            def __init__(self, n: int) -> None:
                super().__init__()
                for name, value in (("weight", 1.0), ("bias", 0.0), ("running_mean", 0.0), ("running_var", 1.0)):
                    self.register_buffer(name, torch.full((n,), value))

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                scale = self.weight * self.running_var.rsqrt()
                shift = self.bias - self.running_mean * scale
                return x * scale.view(1, -1, 1, 1) + shift.view(1, -1, 1, 1)

        frozen = FrozenBatchNorm2d(norm.num_features).double()
    else:
        module = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
        prefix = {"detr": "Detr", "rt_detr": "RTDetr"}[kind]
        frozen = getattr(module, f"{prefix}FrozenBatchNorm2d")(norm.num_features).double()
    assert not hasattr(frozen, "eps")
    for name in ("weight", "bias", "running_mean", "running_var"):
        getattr(frozen, name).copy_(getattr(norm, name).detach())
    if kind == "maskrcnn":
        frozen.running_var += norm.eps
    return frozen


class TestFrozenBatchNormWithoutEps:
    """A frozen BatchNorm whose class holds no ``eps`` (Hugging Face's DETR-family backbones write theirs in the
    forward) or is not named ``FrozenBatchNorm*`` went unmerged with a norm's rule and no word: 0.89 off the
    BatchNorm it freezes under EpsilonPlus, 1.55 under EpsilonAlpha2Beta1, on DETR's backbone 0.81 and 1.37. It is
    merged with the scale and shift its forward computes."""

    @pytest.mark.parametrize("preset", sorted(CNN_PRESETS))
    @pytest.mark.parametrize("kind", ["detr", "rt_detr", "maskrcnn"])
    def test_equals_the_batch_norm_it_freezes(self, preset: str, kind: str):
        # ε 1e-5: the one Hugging Face's classes add in their forward
        plain, frozen, x = _plain_and_frozen(lambda norm: _frozen_without_eps(norm, kind), eps=1e-5)
        lrp = LRP(frozen, CNN_PRESETS[preset](), in_keys=["x"], out_keys=["y"])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with lrp:  # the first call records, the later ones run by the plan
                found = [lrp(TensorDict(x=x.clone(), batch_size=[2]))["relevance", "x"] for _ in range(3)]
        expected = LRP(plain, CNN_PRESETS[preset](), in_keys=["x"], out_keys=["y"])(
            TensorDict(x=x.clone(), batch_size=[2])
        )["relevance", "x"]
        for relevance in found:
            assert relative_error(relevance, expected) <= 1e-10

    def test_a_scale_that_broadcasts_along_another_dimension_is_refused_by_name(self):
        """A ``[C]`` scale of a ``[N, C, H, W]`` input broadcasts along ``W``: where ``W == C`` it has one value per
        channel in number, but it is no per-channel map, and was merged as one."""

        class WidthFrozenBatchNorm2d(nn.Module):
            def __init__(self, n: int) -> None:
                super().__init__()
                for name in ("weight", "bias", "running_mean", "running_var"):
                    self.register_buffer(name, torch.linspace(0.5, 2.0, n, dtype=torch.float64))

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return x * self.weight + self.bias.view(1, -1, 1, 1)

        model = nn.Sequential(nn.Conv2d(3, 4, 3), WidthFrozenBatchNorm2d(4), nn.Flatten()).double()
        lrp = LRP(model, CNN_PRESETS[sorted(CNN_PRESETS)[0]](), in_keys=["x"], out_keys=["y"])
        with pytest.raises(ValueError, match=r"WidthFrozenBatchNorm2d: a frozen BatchNorm without an eps.*channel"):
            lrp(TensorDict(x=torch.randn(2, 3, 6, 6, dtype=torch.float64), batch_size=[2]))

    def test_a_scale_of_other_than_one_value_per_channel_is_refused_by_name(self):
        class ScaledFrozenBatchNorm2d(nn.Module):
            """Holds a frozen BatchNorm's buffers but scales by one number: nothing per channel to merge."""

            def __init__(self, n: int) -> None:
                super().__init__()
                for name in ("weight", "bias", "running_mean", "running_var"):
                    self.register_buffer(name, torch.ones(n, dtype=torch.float64))

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return x * self.weight.sum() + self.bias.view(1, -1, 1, 1)

        model = nn.Sequential(nn.Conv2d(3, 4, 3), ScaledFrozenBatchNorm2d(4), nn.Flatten()).double()
        lrp = LRP(model, CNN_PRESETS[sorted(CNN_PRESETS)[0]](), in_keys=["x"], out_keys=["y"])
        with pytest.raises(ValueError, match=r"ScaledFrozenBatchNorm2d: a frozen BatchNorm without an eps.*channel"):
            lrp(TensorDict(x=torch.randn(2, 3, 6, 6, dtype=torch.float64), batch_size=[2]))


class TestChangedInAnOpenContext:
    """The merged layer follows the BatchNorm's ``eps`` set between two calls of one context, as it follows its
    statistics: it was kept from the first call (6 % to 17 % off under the CNN presets)."""

    @pytest.mark.parametrize("preset", sorted(CNN_PRESETS))
    def test_a_new_eps_is_merged(self, preset: str):
        from tests.attribution.test_lrp_layers import randomise_batch_norm

        torch.manual_seed(0)
        norm = randomise_batch_norm(nn.BatchNorm2d(4).double()).eval()
        layers = [nn.Conv2d(3, 3, 3, padding=1), nn.ReLU(), nn.Conv2d(3, 4, 3), norm, nn.ReLU()]
        model = nn.Sequential(*layers, nn.Flatten(), nn.Linear(64, 3)).double()
        x = torch.randn(2, 3, 6, 6, dtype=torch.float64).clamp(-2.9, 2.9)

        def call(lrp: LRP) -> torch.Tensor:
            return lrp(TensorDict(x=x.clone(), batch_size=[2]))["relevance", "x"]

        lrp = LRP(model, CNN_PRESETS[preset](), in_keys=["x"], out_keys=["y"])
        with lrp:
            call(lrp)
            norm.eps = 0.5
            actual = call(lrp)
        expected = call(LRP(model, CNN_PRESETS[preset](), in_keys=["x"], out_keys=["y"]))
        assert relative_error(actual, expected) <= 1e-12


class MixedConv(nn.Module):
    """Convolutions of different kernel sizes on groups of channels, their outputs concatenated along the channels
    (timm's ``MixedConv2d``, in MixNet), then a BatchNorm over the concatenation."""

    def __init__(self, convs: list[nn.Conv2d], norm: nn.BatchNorm2d, splits: list[int]) -> None:
        super().__init__()
        self.convs, self.bn, self.splits = nn.ModuleList(convs), norm, splits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = torch.split(x, self.splits, dim=1)
        return self.bn(torch.cat([conv(part) for conv, part in zip(self.convs, parts, strict=True)], dim=1))


def mixed_conv_model() -> tuple[nn.Module, nn.Module, list[nn.Conv2d], nn.BatchNorm2d]:
    """A MixedConv model, and the same model with the BatchNorm's channels folded into the convolutions by hand."""
    from tests.attribution.test_lrp_layers import merged_by_hand, randomise_batch_norm

    torch.manual_seed(0)
    convs = [nn.Conv2d(2, 3, 3, padding=1), nn.Conv2d(3, 2, 5, padding=2)]
    norm = randomise_batch_norm(nn.BatchNorm2d(5).double()).eval()
    head = [nn.ReLU(), nn.Flatten(), nn.Linear(5 * 16, 3)]
    model = nn.Sequential(MixedConv(convs, norm, [2, 3]), *head).double().eval()
    folded = []
    for conv, channels in zip(convs, (slice(0, 3), slice(3, 5)), strict=True):
        part = nn.BatchNorm2d(conv.out_channels).double().eval()
        part.eps = norm.eps
        for name in ("weight", "bias", "running_mean", "running_var"):
            getattr(part, name).data.copy_(getattr(norm, name)[channels])
        folded.append(merged_by_hand(conv.double(), part))

    class Folded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.convs = nn.ModuleList(folded)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            parts = torch.split(x, [2, 3], dim=1)
            return torch.cat([conv(part) for conv, part in zip(self.convs, parts, strict=True)], dim=1)

    merged = nn.Sequential(Folded(), *copy.deepcopy(head)).double().eval()
    return model, merged, convs, norm


class TestConcatenatedLayersIntoTheBatchNorm:
    """A BatchNorm over the channel-wise concatenation of several layers' outputs (timm's ``MixedConv2d`` in
    MixNet) is merged into each layer, channel by channel: each rule equals zennit's on the model with the
    BatchNorm folded into the layers by hand. Left unmerged, the BatchNorm got the ε-rule of its affine map and the
    layers' rules acted on the layers alone, with no warning: on ``mixnet_s`` with BatchNorm scales of both signs,
    EpsilonPlus was 103 % and EpsilonGammaBox 30 % away from the folded model's relevance."""

    @pytest.mark.parametrize("rule_name", ["alpha2beta1", "epsilon", "gamma", "zbox"])
    def test_equals_zennit_on_the_merged_layers(self, rule_name: str):
        from zennit import rules as zrules

        from tests.attribution.test_lrp_layers import MERGE_RULES, lrp_relevance, zennit_composite_relevance

        ours, theirs = MERGE_RULES[rule_name]
        model, merged, _, _ = mixed_conv_model()
        x = torch.randn(2, 5, 4, 4, dtype=torch.float64).clamp(-2.9, 2.9)
        with torch.no_grad():
            torch.testing.assert_close(merged(x), model(x), rtol=1e-12, atol=1e-12)
        r_out = torch.randn(2, 3, dtype=torch.float64)
        actual = lrp_relevance(model, x, r_out, rule_mapper={nn.Conv2d: ours(), nn.Linear: EpsilonRule(1e-6)})
        layer_map = [(nn.Conv2d, theirs()), (nn.Linear, zrules.Epsilon(1e-6)), (nn.ReLU, zrules.Pass())]
        expected = zennit_composite_relevance(merged, x, r_out, layer_map)
        assert relative_error(actual, expected) <= 1e-6
        if rule_name == "epsilon":  # linear up to its stabiliser: merged or not, the same (5e-6 apart); lost, not
            return
        unmerged = zennit_composite_relevance(model, x, r_out, [*layer_map, (nn.BatchNorm2d, zrules.Epsilon(1e-6))])
        assert relative_error(unmerged, expected) > 1e-3  # the comparison can tell merged from not

    @pytest.mark.parametrize("preset", sorted(CNN_PRESETS))
    def test_presets_equal_the_folded_model(self, preset: str):
        model, merged, _, _ = mixed_conv_model()
        x = torch.randn(2, 5, 4, 4, dtype=torch.float64).clamp(-2.9, 2.9)

        def relevance(net: nn.Module) -> torch.Tensor:
            lrp = LRP(net, CNN_PRESETS[preset](), in_keys=["x"], out_keys=["y"])
            return lrp(TensorDict(x=x.clone(), batch_size=[2]))["relevance", "x"]

        state = copy.deepcopy(model.state_dict())
        assert relative_error(relevance(model), relevance(merged)) <= 1e-10
        assert all(torch.equal(value, model.state_dict()[key]) for key, value in state.items())

    def test_create_graph_matches_finite_differences(self):
        # Merged from the live parameters in such a call: the relevance's derivative along random directions of the
        # input and of every parameter (the BatchNorm's too) equals central finite differences.
        from tdhook.attribution import EpsilonPlus
        from tests.attribution.test_lrp_differentiable_rules import assert_exact, directional_errors

        model, _, _, _ = mixed_conv_model()
        x = torch.randn(2, 5, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        assert_exact(directional_errors(model, lambda: EpsilonPlus(epsilon=0.1), x))

    def test_a_concatenation_with_one_other_tensor_is_merged_into_the_layers(self):
        # One part of the concatenation is the input itself, no layer's output (InceptionNeXt passes most channels
        # through so): the BatchNorm's channels of the convolution are merged into it, the others get the ε-rule of
        # their affine map, as zennit's on the block with the convolution's channels folded by hand.
        from zennit import rules as zrules

        from tests.attribution.test_lrp_layers import (
            lrp_relevance,
            merged_by_hand,
            randomise_batch_norm,
            zennit_composite_relevance,
        )

        def channels_of(norm: nn.BatchNorm2d, channels: slice) -> nn.BatchNorm2d:
            part = nn.BatchNorm2d(channels.stop - channels.start).double().eval()
            part.eps = norm.eps
            for name in ("weight", "bias", "running_mean", "running_var"):
                getattr(part, name).data.copy_(getattr(norm, name)[channels])
            return part

        class WithInput(nn.Module):
            def __init__(self, conv: nn.Module, norm: nn.Module, other: nn.Module | None = None) -> None:
                super().__init__()
                self.conv, self.bn, self.other = conv, norm, other

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                if self.other is not None:  # the BatchNorm folded: into the convolution, and on the input alone
                    return torch.cat([self.conv(x), self.other(x)], dim=1)
                return self.bn(torch.cat([self.conv(x), x], dim=1))

        torch.manual_seed(0)
        conv = nn.Conv2d(2, 3, 3, padding=1).double()
        norm = randomise_batch_norm(nn.BatchNorm2d(5).double()).eval()
        model = WithInput(conv, norm).eval()
        folded = WithInput(merged_by_hand(conv, channels_of(norm, slice(0, 3))), None, channels_of(norm, slice(3, 5)))
        x = torch.randn(2, 2, 4, 4, dtype=torch.float64)
        with torch.no_grad():
            torch.testing.assert_close(folded(x), model(x), rtol=1e-12, atol=1e-12)
        r_out = torch.randn(2, 5, 4, 4, dtype=torch.float64)
        actual = lrp_relevance(model, x, r_out, rule_mapper={nn.Conv2d: GammaRule(0.25)})
        layer_map = [(nn.Conv2d, zrules.Gamma(0.25)), (nn.BatchNorm2d, zrules.Epsilon(1e-6))]
        expected = zennit_composite_relevance(folded.eval(), x, r_out, layer_map)
        assert relative_error(actual, expected) <= 1e-6
        unmerged = zennit_composite_relevance(model, x, r_out, layer_map)
        assert relative_error(unmerged, expected) > 1e-3  # the comparison can tell merged from not


class DenseBlock(nn.Module):
    """DenseNet's pattern: the outputs of two convolutions (and, with ``other``, the block's input after a ReLU)
    concatenated along the channels, then a BatchNorm and a ReLU."""

    def __init__(self, other: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 2, 3, padding=1), nn.Conv2d(3, 2, 3, padding=1)
        self.other = other
        self.bn = nn.BatchNorm2d(7 if other else 4)
        self.head = nn.Linear((7 if other else 4) * 16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = [self.a(x), self.b(x), *([torch.relu(x)] if self.other else [])]
        return self.head(torch.relu(self.bn(torch.cat(parts, dim=1))).flatten(1))


@pytest.mark.parametrize("other", [False, True], ids=["layers only", "with another tensor"])
def test_lrp_0_through_a_batch_norm_over_concatenated_layers_is_the_gradient_times_input(other: bool):
    """The ε-rule of a layer merged with a BatchNorm sends the gradient back to the layer's output before its rule.
    Over a concatenation that output came from the concatenation's node, which held it detached: the relevance of
    those channels was lost (DenseNet-121 under LRP-0: 100 % off gradient × input, a sum of 0.72 for -13.45 with no
    word, the other part's relevance alone), or, with no other part, the target was refused as independent of the
    input. In a context's later calls too."""
    from tests.attribution.test_lrp_layers import randomise_batch_norm

    torch.manual_seed(0)
    model = DenseBlock(other).double().eval()
    randomise_batch_norm(model.bn)
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    leaf = x.clone().requires_grad_()
    y = model(leaf)
    target = y.argmax(-1)
    (grad,) = torch.autograd.grad(y, leaf, torch.zeros_like(y).scatter_(-1, target[:, None], 1.0))
    lrp = LRP(model, UniformEpsilon(0.0, stabilizer=1e-14), in_keys=["x"], out_keys=["y"], target=target)
    with lrp:
        for _ in range(3):  # the recording call, then planned ones
            relevance = lrp(TensorDict(x=x.clone(), batch_size=[2]))["relevance", "x"]
            assert relative_error(relevance, grad * x) <= 1e-10


class DomainBatchNorm(nn.BatchNorm2d):
    """A BatchNorm keeping a second domain's statistics: in eval mode it normalises with those of ``domain``; with
    ``batch_statistics``, with those of its batch in either mode (AdaBN's), its running statistics left as they are."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels)
        self.register_buffer("mean_b", torch.zeros(channels))
        self.register_buffer("var_b", torch.ones(channels))
        self.domain, self.batch_statistics = "b", False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean, var = (self.running_mean, self.running_var) if self.domain == "a" else (self.mean_b, self.var_b)
        return F.batch_norm(x, mean, var, self.weight, self.bias, self.batch_statistics, 0.0, self.eps)


def domain_networks() -> tuple[nn.Sequential, nn.Sequential]:
    """A network with a :class:`DomainBatchNorm` after a convolution, in domain ``b``, and its plain twin: an
    ``nn.BatchNorm2d`` holding the statistics of domain ``b``."""
    from tests.attribution.test_lrp_layers import randomise_batch_norm

    torch.manual_seed(0)
    norm = randomise_batch_norm(DomainBatchNorm(4).double())
    with torch.no_grad():
        norm.mean_b.uniform_(-0.5, 0.5)
        norm.var_b.uniform_(0.5, 2.0)
    layers = [nn.Conv2d(3, 3, 3, padding=1), nn.ReLU(), nn.Conv2d(3, 4, 3), norm, nn.ReLU()]
    model = nn.Sequential(*layers, nn.Flatten(), nn.Linear(64, 3)).double().eval()
    plain = copy.deepcopy(model)
    plain[3] = nn.BatchNorm2d(4, eps=norm.eps).double().eval()
    with torch.no_grad():
        for name, source in [
            ("weight", "weight"),
            ("bias", "bias"),
            ("running_mean", "mean_b"),
            ("running_var", "var_b"),
        ]:
            getattr(plain[3], name).copy_(getattr(norm, source))
    return model, plain


class TestStatisticsOfTheCall:
    """A BatchNorm subclass whose forward calls ``F.batch_norm`` with other statistics than its buffers (a domain's)
    was merged with its buffers (0.41 off, relative L2, with no word): it is merged with the statistics, affine
    parameters and ε the call passes, and one normalising by its batch in eval mode gets the rule of batch
    statistics, as a BatchNorm without running statistics does."""

    @staticmethod
    def relevance(model: nn.Module, preset: str, x: torch.Tensor) -> torch.Tensor:
        lrp = LRP(model, CNN_PRESETS[preset](), in_keys=["x"], out_keys=["y"])
        return lrp(TensorDict(x=x.clone(), batch_size=[2]))["relevance", "x"]

    @pytest.mark.parametrize("preset", sorted(CNN_PRESETS))
    def test_a_domain_s_statistics_are_merged(self, preset: str):
        model, plain = domain_networks()
        x = torch.randn(2, 3, 6, 6, dtype=torch.float64).clamp(-2.9, 2.9)
        torch.testing.assert_close(model(x), plain(x), rtol=1e-12, atol=1e-12)
        assert relative_error(self.relevance(model, preset, x), self.relevance(plain, preset, x)) <= 1e-10

    @pytest.mark.parametrize("preset", sorted(CNN_PRESETS))
    def test_a_domain_switched_in_an_open_context_is_followed(self, preset: str):
        model, _ = domain_networks()
        x = torch.randn(2, 3, 6, 6, dtype=torch.float64).clamp(-2.9, 2.9)
        lrp = LRP(model, CNN_PRESETS[preset](), in_keys=["x"], out_keys=["y"])
        with lrp:
            lrp(TensorDict(x=x.clone(), batch_size=[2]))
            model[3].domain = "a"
            actual = lrp(TensorDict(x=x.clone(), batch_size=[2]))["relevance", "x"]
        assert relative_error(actual, self.relevance(model, preset, x)) <= 1e-12

    @pytest.mark.parametrize("preset", sorted(CNN_PRESETS))
    def test_batch_statistics_in_eval_mode_are_not_merged(self, preset: str):
        model, plain = domain_networks()
        model[3].batch_statistics, model[3].eps = True, 1e-5  # ε > 0: torch refuses 0 with batch statistics
        plain[3] = nn.BatchNorm2d(4, track_running_stats=False).double().eval()
        plain[3].load_state_dict({"weight": model[3].weight, "bias": model[3].bias})
        x = torch.randn(2, 3, 6, 6, dtype=torch.float64).clamp(-2.9, 2.9)
        torch.testing.assert_close(model(x), plain(x), rtol=1e-12, atol=1e-12)
        assert relative_error(self.relevance(model, preset, x), self.relevance(plain, preset, x)) <= 1e-10


class FoldedBatchNorm(nn.BatchNorm2d):
    """A BatchNorm whose forward computes its eval-mode affine map by hand, with no ``F.batch_norm`` call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight * (self.running_var + self.eps).rsqrt()
        shift = self.bias - self.running_mean * scale
        return x * scale[None, :, None, None] + shift[None, :, None, None]


class TestNoBatchNormCall:
    """A BatchNorm subclass whose forward makes no ``F.batch_norm`` call had nothing merged, and its arithmetic kept
    its plain gradient (1.8 times off the BatchNorm it computes, with no word, ``strict=True`` too): it is refused,
    naming the module and what to do."""

    @pytest.mark.parametrize("strict", [False, True])
    @pytest.mark.parametrize("preset", sorted(CNN_PRESETS))
    def test_it_is_refused_naming_the_module(self, preset: str, strict: bool):
        from tests.attribution.test_lrp_layers import randomise_batch_norm

        torch.manual_seed(0)
        norm = randomise_batch_norm(FoldedBatchNorm(4).double())
        norm.eps = 1e-5
        model = nn.Sequential(nn.Conv2d(3, 4, 3), norm, nn.ReLU(), nn.Flatten(), nn.Linear(64, 3)).double().eval()
        lrp = LRP(model, CNN_PRESETS[preset](strict=strict), in_keys=["x"], out_keys=["y"])
        what = r"MergeBatchNormRule on FoldedBatchNorm: its forward made no F.batch_norm call.*IgnoreRule"
        with pytest.raises(ValueError, match=what) as caught:
            lrp(TensorDict(x=torch.randn(2, 3, 6, 6, dtype=torch.float64), batch_size=[2]))
        assert "LRP: the module is '1'" in getattr(caught.value, "__notes__", [])


class TestUnmergedWarning:
    """The warning that a layer's rule cannot merge the BatchNorm after it is given once per rule type, and counted
    as given only once it is out."""

    def test_a_warning_turned_into_an_error_is_given_again_next_call(self):
        from tensordict.nn import TensorDictModule

        from tdhook.attribution.mappers.base import rule_mapper_from_dict

        class NotMerging(EpsilonRule):
            merges_batch_norm = False

        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2)).double().eval()
        mapper = rule_mapper_from_dict(
            {"module.0": NotMerging(0.0), nn.BatchNorm1d: MergeBatchNormRule(), nn.Linear: EpsilonRule(0.0)}
        )
        lrp = LRP(TensorDictModule(net, in_keys=["x"], out_keys=["y"]), rule_mapper=mapper)
        x = torch.randn(5, 3, dtype=torch.float64)
        for _ in range(2):  # the caller's filter makes the warning an error: each call raises it
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                with pytest.raises(UserWarning, match="NotMerging on Linear cannot be merged with the BatchNorm1d"):
                    lrp(TensorDict(x=x, batch_size=[5]))
        with pytest.warns(UserWarning, match="cannot be merged") as caught:
            first = lrp(TensorDict(x=x, batch_size=[5]))["relevance", "x"]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # told once the warning went out: no warning again
            second = lrp(TensorDict(x=x, batch_size=[5]))["relevance", "x"]
        assert len([w for w in caught if "cannot be merged" in str(w.message)]) == 1
        torch.testing.assert_close(second, first, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("why", ["training", "no running statistics"])
def test_an_unmerged_batch_norm_keeps_the_graph_under_create_graph(why: str):
    """A BatchNorm the rule cannot merge takes NormRule's way, which keeps the graph: the call that keeps it gives
    the ordinary call's relevance (it was refused, as if that rule could not keep the graph)."""
    norm = nn.BatchNorm1d(4, track_running_stats=why == "training")
    net = nn.Sequential(nn.Linear(3, 4), nn.Sequential(norm), nn.ReLU(), nn.Linear(4, 2)).double()
    net.train(why == "training")
    x = torch.randn(5, 3, dtype=torch.float64)
    state = {name: value.clone() for name, value in net.state_dict().items()}
    plain = LRP(net, CNN_PRESETS["EpsilonPlus"](), in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[5]))
    net.load_state_dict(state)  # the running statistics the first call moved
    lrp = LRP(net, CNN_PRESETS["EpsilonPlus"](), in_keys=["x"], out_keys=["y"], create_graph=True)
    kept = lrp(TensorDict(x=x.clone().requires_grad_(True), batch_size=[5]))["relevance", "x"]
    assert kept.requires_grad
    torch.testing.assert_close(kept.detach(), plain["relevance", "x"], rtol=1e-12, atol=1e-14)
