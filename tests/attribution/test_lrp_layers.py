"""Layer coverage of the LRP wrapper: BatchNorm merging, pooling, transposed and 3-d convolutions,
activations, shape modules, embeddings, torchrl models, shared modules, strict mappers and
inner-layer relevance.

zennit is the oracle wherever it has the same rule; elsewhere the expected value is a closed form
(gradient × input for LRP-0, conservation with zero biases, LRP-ε written out by hand).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule, TensorDictSequential
from torch import nn
from torchrl.modules import MLP, ConvNet
from zennit import composites as zcomposites
from zennit import rules as zrules
from zennit.canonizers import SequentialMergeBatchNorm
from zennit.composites import LayerMapComposite
from zennit.types import Activation

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.rules import (
    AlphaBetaRule,
    BaseRuleMapper,
    EpsilonGammaBox,
    EpsilonPlus,
    EpsilonPlusFlat,
    EpsilonRule,
    FlatRule,
    GammaRule,
    PassRule,
    TaylorDecompositionRule,
    ZBoxRule,
)
from tests.conftest import relative_error, zennit_model_relevance

TOL = 1e-6
F64 = torch.float64


# ----------------------------------------------------------------------------- helpers


def lrp_relevance(model: nn.Module, x: torch.Tensor, relevance_out: torch.Tensor, rule_mapper=None, **kwargs):
    """Input relevance of a plain ``model`` under tdhook for the output relevance ``relevance_out``."""
    lrp = LRP(model, rule_mapper=rule_mapper, in_keys=["x"], out_keys=["y"], target=lambda y: relevance_out, **kwargs)
    return lrp(TensorDict(x=x.detach().clone(), batch_size=[x.shape[0]]))["relevance", "x"]


def zennit_composite_relevance(model, x, relevance_out, layer_map, canonizers=()):
    """Input relevance of ``model`` under a zennit ``LayerMapComposite`` for the output relevance ``relevance_out``."""
    composite = LayerMapComposite(layer_map=list(layer_map), canonizers=list(canonizers))
    leaf = x.detach().clone().requires_grad_(True)
    with composite.context(model) as modified:
        out = modified(leaf)
        (relevance,) = torch.autograd.grad(out, leaf, relevance_out)
    return relevance


def random_relevance(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.randn_like(model(x))


def gradient_times_input(model: nn.Module, x: torch.Tensor, grad_out) -> torch.Tensor:
    """``x * d<out, grad_out>/dx``; ``grad_out`` is a tensor or a function of the output."""
    leaf = x.detach().clone().requires_grad_(True)
    out = model(leaf)
    start = grad_out(out.detach()) if callable(grad_out) else grad_out
    (grad,) = torch.autograd.grad(out, leaf, start)
    return x * grad


def argmax_one_hot(out: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(out).scatter_(-1, out.argmax(-1, keepdim=True), 1.0)


def randomise_batch_norm(norm: nn.modules.batchnorm._BatchNorm) -> nn.Module:
    """Running statistics and affine parameters far from the identity (γ of both signs); ``eps = 0``.

    zennit's canonizer leaves the merged BatchNorm computing ``x / sqrt(1 + eps)``; with ``eps = 0``
    it computes the identity and both libraries explain the same function.
    """
    n = norm.num_features
    norm.eps = 0.0
    with torch.no_grad():
        norm.running_mean.copy_(torch.randn(n, dtype=F64) * 0.5)
        norm.running_var.copy_(torch.rand(n, dtype=F64) * 1.5 + 0.5)
        signs = torch.tensor([(-1.0) ** i for i in range(n)], dtype=F64)  # negative γ flips the layer's signs
        norm.weight.copy_(signs * (torch.rand(n, dtype=F64) + 0.5))
        norm.bias.copy_(torch.randn(n, dtype=F64) * 0.3)
    return norm


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_same_state(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(after[key], value), key


# ----------------------------------------------------------------------------- 1. BatchNorm merging

BN_PAIRS = {
    "linear+bn1d": (lambda: (nn.Linear(6, 5), nn.BatchNorm1d(5)), (4, 6)),
    "conv1d+bn1d": (lambda: (nn.Conv1d(3, 4, 3, padding=1), nn.BatchNorm1d(4)), (2, 3, 9)),
    "conv3d+bn3d": (lambda: (nn.Conv3d(2, 3, 3, padding=1), nn.BatchNorm3d(3)), (2, 2, 4, 4, 4)),
    "convtranspose2d+bn2d": (lambda: (nn.ConvTranspose2d(3, 4, 3, stride=2), nn.BatchNorm2d(4)), (2, 3, 4, 4)),
    "convtranspose1d+bn1d": (lambda: (nn.ConvTranspose1d(3, 4, 3, stride=2), nn.BatchNorm1d(4)), (2, 3, 5)),
    "conv2d-nobias+bn2d": (lambda: (nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4)), (2, 3, 6, 6)),
}


# (tdhook rule, zennit rule) on the Linear / convolution layer.
class Affine(nn.Module):
    """``x · s + t`` per channel (dimension 1) with ``s``, ``t`` fixed: a BatchNorm with its statistics frozen."""

    def __init__(self, scale: torch.Tensor, shift: torch.Tensor) -> None:
        super().__init__()
        self.scale, self.shift = scale, shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (1, -1, *[1] * (x.dim() - 2))
        return x * self.scale.view(shape) + self.shift.view(shape)


def with_batch_statistics_fixed(model: nn.Sequential, x: torch.Tensor) -> nn.Sequential:
    """A copy of ``model`` whose BatchNorms are the affine maps their statistics give on the batch ``x``."""
    layers, h = [], x
    with torch.no_grad():
        for module in copy.deepcopy(model):
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                var, mean = torch.var_mean(h, dim=[0, *range(2, h.dim())], unbiased=False)
                scale = torch.rsqrt(var + module.eps)
                scale = scale if module.weight is None else scale * module.weight
                shift = -mean * scale + (0 if module.bias is None else module.bias)
                module = Affine(scale, shift)
            h = module(h)
            layers.append(module)
    return nn.Sequential(*layers)


MERGE_RULES = {
    "epsilon": (lambda: EpsilonRule(1e-6), lambda: zrules.Epsilon(1e-6)),
    "alpha2beta1": (lambda: AlphaBetaRule(2.0, 1.0), lambda: zrules.AlphaBeta(2.0, 1.0)),
    "gamma": (lambda: GammaRule(0.25), lambda: zrules.Gamma(0.25)),
    "flat": (lambda: FlatRule(), lambda: zrules.Flat()),
    "zbox": (lambda: ZBoxRule(-3.0, 3.0), lambda: zrules.ZBox(-3.0, 3.0)),
}


def bn_model(kind: str) -> tuple[nn.Sequential, torch.Tensor]:
    make, shape = BN_PAIRS[kind]
    layer, norm = make()
    if layer.bias is not None:
        with torch.no_grad():
            layer.bias.normal_()
    model = nn.Sequential(layer, randomise_batch_norm(norm)).double().eval()
    x = torch.randn(shape, dtype=F64).clamp(-2.9, 2.9)  # inside the ZBox bounds
    return model, x


def merged_by_hand(layer: nn.Module, norm: nn.Module) -> nn.Module:
    """The layer with the eval-mode BatchNorm after it folded into its weight and bias (closed form)."""
    merged = copy.deepcopy(layer)
    scale = (norm.running_var + norm.eps).rsqrt()
    if norm.weight is not None:
        scale = scale * norm.weight
    shift = norm.bias if norm.bias is not None else torch.zeros_like(scale)
    with torch.no_grad():
        weight = layer.weight
        if isinstance(layer, nn.ConvTranspose2d):
            # weight (in, out / groups, kh, kw): output channel g * out / groups + j is [group g's rows, j].
            g = layer.groups
            grouped = weight.reshape(g, weight.shape[0] // g, weight.shape[1], *weight.shape[2:])
            merged.weight.copy_((grouped * scale.reshape(g, 1, -1, 1, 1)).reshape(weight.shape))
        else:
            merged.weight.copy_(weight * scale.reshape(-1, *[1] * (weight.dim() - 1)))
        merged.bias.copy_((layer.bias - norm.running_mean) * scale + shift)
    return merged


class TestBatchNormMerging:
    @pytest.mark.parametrize("rule_name", sorted(MERGE_RULES))
    @pytest.mark.parametrize("kind", sorted(BN_PAIRS))
    def test_merged_matches_zennit_canonizer(self, kind: str, rule_name: str):
        ours, theirs = MERGE_RULES[rule_name]
        model, x = bn_model(kind)
        layer_type, norm_type = type(model[0]), type(model[1])
        r_out = random_relevance(model, x)
        before = state(model)
        # The BatchNorm is left to the default mapper: MergeBatchNormRule.
        actual = lrp_relevance(model, x, r_out, rule_mapper={layer_type: ours()})
        assert_same_state(model, before)
        expected = zennit_composite_relevance(
            model, x, r_out, [(layer_type, theirs()), (norm_type, zrules.Pass())], [SequentialMergeBatchNorm()]
        )
        assert_same_state(model, before)
        assert actual.shape == x.shape
        assert relative_error(actual, expected) <= TOL
        if rule_name != "flat":  # Flat sets every weight to one: merged or not, it is the same
            # Without the merge, the result is measurably different: the comparison can tell.
            unmerged = zennit_composite_relevance(model, x, r_out, [(layer_type, theirs()), (norm_type, zrules.Pass())])
            assert relative_error(unmerged, expected) > 1e-3

    @pytest.mark.parametrize("rule_name", sorted(MERGE_RULES))
    def test_grouped_transposed_convolution_matches_the_merged_layer_built_by_hand(self, rule_name: str):
        # zennit's canonizer cannot merge into a grouped transposed convolution (its channel scale does not
        # broadcast over (in, out / groups, ...) weights), so the oracle is zennit's rule on the merged layer.
        ours, theirs = MERGE_RULES[rule_name]
        layer = nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2).double()
        with torch.no_grad():
            layer.bias.normal_()
        norm = randomise_batch_norm(nn.BatchNorm2d(6).double()).eval()
        model = nn.Sequential(layer, norm).eval()
        x = torch.randn(2, 4, 4, 4, dtype=F64).clamp(-2.9, 2.9)
        merged = merged_by_hand(layer, norm)
        with torch.no_grad():
            torch.testing.assert_close(merged(x), model(x), rtol=1e-12, atol=1e-12)
        r_out = random_relevance(model, x)
        actual = lrp_relevance(model, x, r_out, rule_mapper={nn.ConvTranspose2d: ours()})
        expected = zennit_composite_relevance(merged, x, r_out, [(nn.ConvTranspose2d, theirs())])
        assert relative_error(actual, expected) <= TOL
        if rule_name != "flat":
            unmerged = zennit_composite_relevance(
                model, x, r_out, [(nn.ConvTranspose2d, theirs()), (nn.BatchNorm2d, zrules.Pass())]
            )
            assert relative_error(unmerged, expected) > 1e-3

    @pytest.mark.parametrize("rule_name", ["epsilon", "alpha2beta1", "zbox"])
    @pytest.mark.parametrize("kind", ["linear+bn1d", "conv1d+bn1d"])
    def test_training_mode_batch_norm_is_the_affine_map_of_its_batch(self, kind: str, rule_name: str):
        # Not merged: the batch statistics are held constant, and the affine map y = s x + t gets the ε-rule
        # (its shift is a bias). The oracle is zennit's Epsilon on that affine map, written as a module.
        ours, theirs = MERGE_RULES[rule_name]
        model, x = bn_model(kind)
        model[1].eps = 1e-5  # training mode refuses eps = 0
        model.train()
        fixed = with_batch_statistics_fixed(model, x)
        layer_type = type(model[0])
        r_out = random_relevance(model, x)
        actual = lrp_relevance(model, x, r_out, rule_mapper={layer_type: ours()})
        expected = zennit_composite_relevance(fixed, x, r_out, [(layer_type, theirs()), (Affine, zrules.Epsilon(1e-6))])
        assert relative_error(actual, expected) <= TOL
        passed = zennit_composite_relevance(model, x, r_out, [(layer_type, theirs()), (type(model[1]), zrules.Pass())])
        assert relative_error(actual, passed) > 1e-3

    @pytest.mark.parametrize("rule_name", ["epsilon", "alpha2beta1", "gamma"])
    def test_batch_norm_without_affine_parameters_is_merged(self, rule_name: str):
        # zennit's canonizer needs γ and β; the oracle is zennit's rule on the merged layer built by hand.
        # (Not ZBox: it ignores biases and a positive channel scale, so merged and unmerged would agree.)
        ours, theirs = MERGE_RULES[rule_name]
        conv = nn.Conv1d(3, 4, 3, padding=1).double()
        norm = nn.BatchNorm1d(4, affine=False).double().eval()
        with torch.no_grad():
            norm.running_mean.copy_(torch.randn(4, dtype=F64))
            norm.running_var.copy_(torch.rand(4, dtype=F64) * 3 + 0.1)
        model = nn.Sequential(conv, norm)
        x = torch.randn(2, 3, 9, dtype=F64).clamp(-2.9, 2.9)
        merged = merged_by_hand(conv, norm)
        with torch.no_grad():
            torch.testing.assert_close(merged(x), model(x), rtol=1e-12, atol=1e-12)
        r_out = random_relevance(model, x)
        actual = lrp_relevance(model, x, r_out, rule_mapper={nn.Conv1d: ours()})
        expected = zennit_composite_relevance(merged, x, r_out, [(nn.Conv1d, theirs())])
        assert relative_error(actual, expected) <= TOL
        unmerged = zennit_composite_relevance(model, x, r_out, [(nn.Conv1d, theirs()), (nn.BatchNorm1d, zrules.Pass())])
        assert relative_error(unmerged, expected) > 1e-3

    @pytest.mark.parametrize("rule_name", ["epsilon", "alpha2beta1"])
    def test_batch_norm_without_running_statistics_is_the_affine_map_of_its_batch(self, rule_name: str):
        ours, theirs = MERGE_RULES[rule_name]
        model = nn.Sequential(nn.Conv1d(3, 4, 3), nn.BatchNorm1d(4, track_running_stats=False)).double().eval()
        x = torch.randn(3, 3, 9, dtype=F64)
        r_out = random_relevance(model, x)
        actual = lrp_relevance(model, x, r_out, rule_mapper={nn.Conv1d: ours()})
        fixed = with_batch_statistics_fixed(model, x)
        expected = zennit_composite_relevance(fixed, x, r_out, [(nn.Conv1d, theirs()), (Affine, zrules.Epsilon(1e-6))])
        assert relative_error(actual, expected) <= TOL

    @pytest.mark.parametrize("rule_name", ["epsilon", "alpha2beta1", "gamma"])
    def test_batch_norm_after_an_activation_is_not_merged(self, rule_name: str):
        ours, theirs = MERGE_RULES[rule_name]
        conv = nn.Conv1d(3, 4, 3, padding=1)
        model = nn.Sequential(conv, nn.Tanh(), randomise_batch_norm(nn.BatchNorm1d(4))).double().eval()
        x = torch.randn(2, 3, 9, dtype=F64)
        r_out = random_relevance(model, x)
        actual = lrp_relevance(model, x, r_out, rule_mapper={nn.Conv1d: ours()})
        # zennit's canonizer merges only a BatchNorm that directly follows the layer: none here. The BatchNorm
        # is an affine map, with the ε-rule.
        layer_map = [(nn.Conv1d, theirs()), (nn.Tanh, zrules.Pass()), (nn.BatchNorm1d, zrules.Epsilon(1e-6))]
        expected = zennit_composite_relevance(model, x, r_out, layer_map, [SequentialMergeBatchNorm()])
        assert relative_error(actual, expected) <= TOL

    def test_target_all_with_a_merged_batch_norm_equals_stacked_single_targets(self):
        model = nn.Sequential(
            nn.Conv1d(2, 3, 3), randomise_batch_norm(nn.BatchNorm1d(3)), nn.ReLU(), nn.Flatten(), nn.Linear(12, 4)
        ).double()
        model.eval()
        x = torch.randn(3, 2, 6, dtype=F64)
        mapper = {nn.Conv1d: AlphaBetaRule(2.0, 1.0), nn.Linear: EpsilonRule(0.25)}

        def explain(target):
            lrp = LRP(model, rule_mapper=mapper, in_keys=["x"], out_keys=["y"], target=target, layers=["0"])
            return lrp(TensorDict(x=x.clone(), batch_size=[3]))

        every = explain("all")
        for key, shape in ((("relevance", "x"), (3, 4, 2, 6)), (("relevance", "0"), (3, 4, 3, 4))):
            assert every[key].shape == shape
            singles = torch.stack([explain(k)[key] for k in range(4)], dim=1)
            torch.testing.assert_close(every[key], singles, rtol=1e-12, atol=1e-12)

    @pytest.mark.parametrize("rule_name", ["epsilon", "alpha2beta1"])
    def test_layer_output_changed_in_place_is_not_merged(self, rule_name: str):
        class ShiftedConv(nn.Module):
            def __init__(self):
                super().__init__()
                self.conv, self.norm = nn.Conv1d(2, 3, 3), randomise_batch_norm(nn.BatchNorm1d(3))

            def forward(self, x):
                h = self.conv(x)
                h.add_(0.5)  # the BatchNorm no longer reads the layer's own output
                return self.norm(h)

        ours, _ = MERGE_RULES[rule_name]
        model = ShiftedConv().double().eval()
        x = torch.randn(2, 2, 7, dtype=F64)
        r_out = random_relevance(model, x)
        actual = lrp_relevance(model, x, r_out, rule_mapper={nn.Conv1d: ours()})
        # Not merged: the BatchNorm is an affine map under the ε-rule, as EpsilonRule on it says explicitly.
        affine = lrp_relevance(model, x, r_out, rule_mapper={nn.Conv1d: ours(), nn.BatchNorm1d: EpsilonRule(1e-6)})
        assert relative_error(actual, affine) <= 1e-12
        merged = nn.Sequential(merged_by_hand(model.conv, model.norm))
        # The merged layer (shifted by 0.5 s) would give another answer: the test can tell.
        assert relative_error(lrp_relevance(merged, x, r_out, rule_mapper={nn.Conv1d: ours()}), affine) > 1e-3

    @pytest.mark.parametrize("rule_name", sorted(MERGE_RULES))
    def test_layer_output_read_by_the_batch_norm_and_a_skip_equals_two_copies(self, rule_name: str):
        ours, _ = MERGE_RULES[rule_name]

        class Skip(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc, self.head = nn.Linear(4, 5), nn.Linear(5, 3)
                self.norm = randomise_batch_norm(nn.BatchNorm1d(5))

            def forward(self, x):
                h = self.fc(x)
                return self.head((self.norm(h) + h).relu())

        class Unrolled(nn.Module):
            def __init__(self, skip: Skip):
                super().__init__()
                self.merged, self.plain = copy.deepcopy(skip.fc), copy.deepcopy(skip.fc)
                self.norm, self.head = skip.norm, skip.head

            def forward(self, x):
                return self.head((self.norm(self.merged(x)) + self.plain(x)).relu())

        model = Skip().double().eval()
        x = torch.randn(6, 4, dtype=F64).clamp(-2.9, 2.9)
        mapper = {"fc": ours(), "merged": ours(), "plain": ours(), nn.Linear: EpsilonRule(0.25)}

        def explain(net):
            lrp = LRP(net, rule_mapper=mapper, in_keys=["x"], out_keys=["y"])
            return lrp(TensorDict(x=x.clone(), batch_size=[6]))["relevance", "x"]

        assert relative_error(explain(model), explain(Unrolled(model))) <= 1e-10

    @pytest.mark.parametrize("rule_name", ["epsilon", "alpha2beta1", "gamma"])
    def test_batch_norm_over_the_sequence_dimension_is_not_merged(self, rule_name: str):
        # Linear on (N, L, C) with BatchNorm1d(L): the norm scales L, not the layer's output features.
        ours, theirs = MERGE_RULES[rule_name]
        linear = nn.Linear(6, 5)
        with torch.no_grad():
            linear.bias.normal_()
        model = nn.Sequential(linear, randomise_batch_norm(nn.BatchNorm1d(4))).double().eval()
        x = torch.randn(3, 4, 6, dtype=F64)
        r_out = random_relevance(model, x)
        actual = lrp_relevance(model, x, r_out, rule_mapper={nn.Linear: ours()})
        # Not merged: an affine map under the ε-rule, as zennit's Epsilon on it computes.
        layer_map = [(nn.Linear, theirs()), (nn.BatchNorm1d, zrules.Epsilon(1e-6))]
        expected = zennit_composite_relevance(model, x, r_out, layer_map)
        assert actual.shape == x.shape
        assert relative_error(actual, expected) <= TOL


# ----------------------------------------------------------------------------- 2. pooling

AVG_POOLS = {
    "avgpool1d": (lambda: nn.AvgPool1d(3, stride=2, padding=1), (2, 3, 9)),
    "avgpool2d": (lambda: nn.AvgPool2d(2), (2, 3, 6, 6)),
    "avgpool3d": (lambda: nn.AvgPool3d(2, stride=1), (2, 2, 4, 4, 4)),
    "adaptiveavgpool1d": (lambda: nn.AdaptiveAvgPool1d(4), (2, 3, 9)),
    "adaptiveavgpool2d": (lambda: nn.AdaptiveAvgPool2d((2, 3)), (2, 3, 7, 7)),
    "adaptiveavgpool3d": (lambda: nn.AdaptiveAvgPool3d(2), (2, 2, 5, 5, 5)),
}

MAX_POOLS = {
    "maxpool1d": (lambda: nn.MaxPool1d(2), (2, 3, 8)),
    "maxpool2d": (lambda: nn.MaxPool2d(2), (2, 3, 6, 6)),
    "maxpool3d": (lambda: nn.MaxPool3d(2), (2, 2, 4, 4, 4)),
    "adaptivemaxpool2d": (lambda: nn.AdaptiveMaxPool2d(3), (2, 3, 6, 6)),
}


class TestPooling:
    @pytest.mark.parametrize("kind", sorted(AVG_POOLS))
    def test_average_pools_get_norm_by_default(self, kind: str):
        make, shape = AVG_POOLS[kind]
        pool, x = make(), torch.randn(shape, dtype=F64)
        r_out = random_relevance(pool, x)
        actual = lrp_relevance(pool, x, r_out)  # default mapper
        expected = zennit_composite_relevance(pool, x, r_out, [(type(pool), zrules.Norm())])
        assert actual.shape == x.shape
        assert relative_error(actual, expected) <= TOL

    @pytest.mark.parametrize("kind", sorted(AVG_POOLS))
    def test_average_pools_use_the_mappers_stabilizer(self, kind: str):
        # With a tiny stabilizer Norm is close to gradient × input on a pool; a large one sets them apart.
        make, shape = AVG_POOLS[kind]
        pool, x = make(), torch.randn(shape, dtype=F64)
        r_out = random_relevance(pool, x)
        actual = lrp_relevance(pool, x, r_out, rule_mapper=BaseRuleMapper(stabilizer=0.5))
        expected = zennit_composite_relevance(pool, x, r_out, [(type(pool), zrules.Norm(0.5))])
        assert relative_error(actual, expected) <= TOL
        plain = gradient_times_input(pool, x, lambda out: r_out / out)
        assert relative_error(plain, expected) > 1e-2

    @pytest.mark.parametrize("kind", sorted(MAX_POOLS))
    def test_max_pools_are_gradient_times_input(self, kind: str):
        make, shape = MAX_POOLS[kind]
        pool, x = make(), torch.randn(shape, dtype=F64)
        r_out = random_relevance(pool, x)
        actual = lrp_relevance(pool, x, r_out)
        expected = gradient_times_input(pool, x, lambda out: r_out / out)
        assert relative_error(actual, expected) <= 1e-12
        # Non-overlapping windows: each window's winner takes the whole relevance of its output.
        torch.testing.assert_close(actual.flatten(1).sum(1), r_out.flatten(1).sum(1), rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- 3. transposed and 3-d convolutions

CONVOLUTIONS = {
    "convtranspose1d": (lambda bias: nn.ConvTranspose1d(3, 4, 3, stride=2, bias=bias), (2, 3, 6)),
    "convtranspose2d": (lambda bias: nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1, bias=bias), (2, 3, 4, 4)),
    "convtranspose3d": (lambda bias: nn.ConvTranspose3d(2, 3, 2, stride=2, bias=bias), (2, 2, 3, 3, 3)),
    "conv3d": (lambda bias: nn.Conv3d(2, 3, 3, stride=2, padding=1, bias=bias), (2, 2, 5, 5, 5)),
}

CONSERVING_RULES = {
    "zplus": lambda: AlphaBetaRule(1.0, 0.0, stabilizer=1e-12),
    "gamma": lambda: GammaRule(0.25, stabilizer=1e-12),
    "flat": lambda: FlatRule(stabilizer=1e-12),
    "zbox": lambda: ZBoxRule(-3.0, 3.0, stabilizer=1e-12),
}


def conv_net(kind: str, bias: bool = True) -> tuple[nn.Module, torch.Tensor]:
    """``layer → ReLU → Flatten → Linear``, and an input.

    Input channel 0 is positive and so are the weights it meets, so that every output unit has a
    positive contribution: z⁺ never vanishes, and no relevance is dropped for want of a denominator.
    """
    make, shape = CONVOLUTIONS[kind]
    layer = make(bias).double()
    with torch.no_grad():
        if bias:
            layer.bias.normal_()
        # (out, in, ...) for a convolution, (in, out, ...) for a transposed one.
        from_channel_0 = layer.weight[0] if isinstance(layer, nn.modules.conv._ConvTransposeNd) else layer.weight[:, 0]
        from_channel_0.abs_()
    x = torch.randn(shape, dtype=F64).clamp(-2.9, 2.9)
    x[:, 0] = x[:, 0].abs() + 0.1
    with torch.no_grad():
        n_features = layer(x)[0].numel()
    return nn.Sequential(layer, nn.ReLU(), nn.Flatten(), nn.Linear(n_features, 3, bias=bias).double()), x


class TestConvolutions:
    @pytest.mark.parametrize("kind", sorted(CONVOLUTIONS))
    def test_lrp0_is_gradient_times_input(self, kind: str):
        model, x = conv_net(kind)
        lrp0 = EpsilonRule(0.0)
        lrp = LRP(
            model,
            rule_mapper=lambda n, m: lrp0 if isinstance(m, (nn.Linear, type(model[0]))) else None,
            in_keys=["x"],
            out_keys=["y"],
        )
        actual = lrp(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))["relevance", "x"]
        expected = gradient_times_input(model, x, argmax_one_hot)
        assert relative_error(actual, expected) <= 1e-12

    @pytest.mark.parametrize("kind", sorted(CONVOLUTIONS))
    def test_lrp0_on_the_layer_alone_is_gradient_times_input(self, kind: str):
        model, x = conv_net(kind)
        layer = model[0]
        r_out = random_relevance(layer, x)
        actual = lrp_relevance(layer, x, r_out, rule_mapper={type(layer): EpsilonRule(0.0)})
        expected = gradient_times_input(layer, x, lambda out: r_out / out)
        assert relative_error(actual, expected) <= 1e-12

    @pytest.mark.parametrize("rule_name", sorted(CONSERVING_RULES))
    @pytest.mark.parametrize("kind", sorted(CONVOLUTIONS))
    def test_conservation_without_bias(self, kind: str, rule_name: str):
        model, x = conv_net(kind, bias=False)
        layer = model[0]
        r_out = random_relevance(layer, x)
        relevance = lrp_relevance(layer, x, r_out, rule_mapper={type(layer): CONSERVING_RULES[rule_name]()})
        assert relevance.shape == x.shape
        torch.testing.assert_close(relevance.flatten(1).sum(1), r_out.flatten(1).sum(1), rtol=1e-7, atol=1e-7)
        # Not gradient × input: the rule was applied.
        plain = gradient_times_input(layer, x, lambda out: r_out / out)
        assert relative_error(relevance, plain) > 1e-3

    def test_a_convolution_written_with_f_conv2d_is_warned_of_naming_the_module(self):
        """A module of one's own that holds a weight and calls F.conv2d is no convolution layer to the mappers (rules
        go by module type, as zennit's): it keeps its plain gradient, and nothing said so (EpsilonPlus 131 %,
        EpsilonAlpha2Beta1 86 %, EpsilonGammaBox 51 % off the same net with nn.Conv2d). The first call warns, naming
        the module and the rule a Conv2d gets, and coverage() lists the call; a strict mapper refuses it."""
        from tdhook.attribution import EpsilonGammaBox

        functional, plain, x = _functional_conv_net()
        r_out = argmax_one_hot(plain(x).detach()) * plain(x).detach()
        for mapper in (EpsilonPlus(), EpsilonGammaBox(-10.0, 10.0)):
            expected = lrp_relevance(plain, x, r_out, rule_mapper=mapper)
            lrp = LRP(functional, rule_mapper=mapper, in_keys=["x"], out_keys=["y"], target=lambda y: r_out)
            with pytest.warns(UserWarning, match=r"module '2' \(FunctionalConv\) computes conv2d with its own weight"):
                actual = lrp(TensorDict(x=x.clone(), batch_size=[2]))["relevance", "x"]
            assert relative_error(actual, expected) > 0.1  # the plain gradient there: why it is warned of
            assert [(c.module, c.module_type, c.calls) for c in lrp.coverage().plain_gradient] == [
                ("2", "FunctionalConv", 1)
            ]
        with pytest.raises(ValueError, match=r"module '2' \(FunctionalConv\) computes conv2d"):
            lrp_relevance(functional, x, r_out, rule_mapper=EpsilonPlus(strict=True))

    @pytest.mark.parametrize("preset", ["CPLRP", "Epsilon0", "none"])
    def test_a_convolution_written_with_f_conv2d_is_not_warned_of_where_a_layer_would_be_lrp0(self, preset):
        """Where a Conv2d would get LRP-0 too (the transformer presets, a mapper giving ε = 0, no mapper), the plain
        gradient is its rule: no warning, and the relevance is the layer's."""
        from tdhook.attribution import CPLRP

        mappers = {"CPLRP": CPLRP, "Epsilon0": lambda: {nn.Conv2d: EpsilonRule(0.0)}, "none": lambda: None}
        functional, plain, x = _functional_conv_net()
        r_out = argmax_one_hot(plain(x).detach()) * plain(x).detach()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            actual = lrp_relevance(functional, x, r_out, rule_mapper=mappers[preset]())
        expected = lrp_relevance(plain, x, r_out, rule_mapper=mappers[preset]())
        torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-12)

    def test_a_fixed_filter_applied_with_f_conv2d_is_not_warned_of(self):
        """A filter held in a buffer (a blur before pooling) is no layer's weight: no warning."""

        class Blur(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.register_buffer("kernel", torch.full((4, 1, 3, 3), 1 / 9, dtype=F64))

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return nn.functional.conv2d(x, self.kernel, padding=1, groups=4)

        torch.manual_seed(0)
        net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), Blur(), nn.Flatten(), nn.Linear(4 * 36, 3))
        net = net.to(F64).eval()
        x = torch.randn(2, 3, 6, 6, dtype=F64)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            lrp_relevance(net, x, argmax_one_hot(net(x).detach()) * net(x).detach(), rule_mapper=EpsilonPlus())


class FunctionalConv(nn.Module):
    """A convolution of one's own: a Conv2d's weight and bias, applied with ``F.conv2d``."""

    def __init__(self, conv: nn.Conv2d) -> None:
        super().__init__()
        self.weight, self.bias = conv.weight, conv.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.conv2d(x, self.weight, self.bias, padding=1)


def _functional_conv_net() -> tuple[nn.Module, nn.Module, torch.Tensor]:
    """A small CNN whose second convolution is a :class:`FunctionalConv`, the same net with its ``nn.Conv2d``, and
    an input."""
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU()]
    plain = nn.Sequential(*layers, nn.Flatten(), nn.Linear(4 * 6 * 6, 3)).to(F64).eval()
    functional = nn.Sequential(plain[0], plain[1], FunctionalConv(plain[2]), *plain[3:]).eval()
    return functional, plain, torch.randn(2, 3, 6, 6, dtype=F64)


# ----------------------------------------------------------------------------- 4. activations and shape modules

ACTIVATIONS = {
    "relu": nn.ReLU,
    "leakyrelu": lambda: nn.LeakyReLU(0.1),
    "elu": nn.ELU,
    "gelu": nn.GELU,
    "silu": nn.SiLU,
    "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
    "softplus": nn.Softplus,
}


class TestActivationsAndShapes:
    @pytest.mark.parametrize("name", sorted(ACTIVATIONS))
    def test_pass_through_activation_matches_zennit(self, name: str):
        model = nn.Sequential(nn.Linear(5, 12), ACTIVATIONS[name](), nn.Linear(12, 4)).double().eval()
        x = torch.randn(6, 5, dtype=F64)
        composite = LayerMapComposite(layer_map=[(Activation, zrules.Pass()), (nn.Linear, zrules.Epsilon(1e-6))])
        expected = zennit_model_relevance(composite, model, x)
        lrp = LRP(model, rule_mapper={nn.Linear: EpsilonRule(1e-6)}, in_keys=["x"], out_keys=["y"])
        actual = lrp(TensorDict(x=x.clone(), batch_size=[6]))["relevance", "x"]
        assert relative_error(actual, expected) <= TOL
        if name != "relu":
            # Passing relevance differs from the activation's gradient: the test can tell.
            gradient = zennit_model_relevance(
                LayerMapComposite(layer_map=[(nn.Linear, zrules.Epsilon(1e-6))]), model, x
            )
            assert relative_error(gradient, expected) > 1e-3

    @pytest.mark.parametrize("mapper", ["default", "epsilon0"])
    def test_shape_modules_and_eval_dropout_are_gradient_times_input(self, mapper: str):
        model = nn.Sequential(
            nn.Linear(12, 24),
            nn.Unflatten(1, (4, 6)),
            nn.Conv1d(4, 3, 3),
            nn.ReLU(),
            nn.Dropout(0.5),
            nn.Identity(),
            nn.Flatten(),
            nn.Linear(12, 3),
        ).double()
        model.eval()
        lrp0 = EpsilonRule(0.0)
        rule_mapper = None if mapper == "default" else {(nn.Linear, nn.Conv1d): lrp0}
        x = torch.randn(5, 12, dtype=F64)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # every module here has a default rule
            td = LRP(model, rule_mapper=rule_mapper, in_keys=["x"], out_keys=["y"])(
                TensorDict(x=x.clone(), batch_size=[5])
            )
        expected = gradient_times_input(model, x, argmax_one_hot)
        assert relative_error(td["relevance", "x"], expected) <= 1e-12


# ----------------------------------------------------------------------------- 5. embeddings


class TokenNet(nn.Module):
    def __init__(self, length: int = 5):
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(4 * length, 8), nn.ReLU(), nn.Linear(8, 3))

    def forward(self, tokens):
        return self.head(self.embed(tokens))


class MaskedTokenNet(TokenNet):
    def forward(self, tokens, mask):
        return self.head(self.embed(tokens) * mask.unsqueeze(-1))


class IntegerFeatureNet(TokenNet):
    def __init__(self, length: int = 5):
        super().__init__(length)
        self.side = nn.Linear(2, 3)

    def forward(self, tokens, counts):
        return self.head(self.embed(tokens)) + self.side(counts)  # a Linear cannot read integers


class TestEmbedding:
    def test_token_relevance_is_the_summed_relevance_of_their_embeddings(self):
        net = TokenNet().double()
        tokens = torch.randint(0, 11, (4, 5))
        before = state(net)
        lrp = LRP(
            TensorDictModule(net, in_keys=["tokens"], out_keys=["logits"]), rule_mapper={nn.Linear: EpsilonRule(0.0)}
        )
        td = lrp(TensorDict(tokens=tokens, batch_size=[4]))
        assert_same_state(net, before)
        relevance = td["relevance", "tokens"]
        assert relevance.shape == tokens.shape and relevance.dtype == F64
        embedded = net.embed(tokens).detach().requires_grad_(True)
        out = net.head(embedded)
        (grad,) = torch.autograd.grad(out, embedded, argmax_one_hot(out.detach()))
        expected = (embedded.detach() * grad).sum(-1)
        assert relative_error(relevance, expected) <= 1e-12
        # The tokens and the outputs are written back as the model sees them.
        assert torch.equal(td["tokens"], tokens)
        assert torch.equal(td["logits"], net(tokens))

    def test_integer_key_not_read_by_an_embedding_is_named_when_asked_for(self):
        net = MaskedTokenNet().double()
        tokens, mask = torch.randint(0, 11, (3, 5)), torch.randint(0, 2, (3, 5))
        before = state(net)
        module = TensorDictModule(net, in_keys=["tokens", "mask"], out_keys=["logits"])
        td = TensorDict(tokens=tokens, mask=mask, batch_size=[3])
        with pytest.raises(TypeError, match="'mask' holds integer tokens"):
            LRP(module, in_keys=["tokens", "mask"])(td.clone())
        assert_same_state(net, before)
        # Taken from the module's in_keys, the mask is an input, not explained: the tokens alone are.
        by_default = LRP(module)(td.clone())
        assert ("relevance", "mask") not in by_default.keys(include_nested=True)
        # Explaining the tokens alone gives the same, and the masked-out tokens get no relevance.
        out = LRP(module, in_keys=["tokens"])(td.clone())
        assert torch.equal(by_default["relevance", "tokens"], out["relevance", "tokens"])
        assert out["relevance", "tokens"].shape == (3, 5)
        assert torch.all(out["relevance", "tokens"][mask == 0] == 0)
        assert out["relevance", "tokens"][mask == 1].abs().sum() > 0
        assert_same_state(net, before)

    def test_target_all_token_relevance_sums_the_embedding_layer_relevance(self):
        net = TokenNet().double()
        tokens = torch.randint(0, 11, (4, 5))
        lrp = LRP(
            TensorDictModule(net, in_keys=["tokens"], out_keys=["logits"]),
            rule_mapper={nn.Linear: EpsilonRule(0.25)},
            target="all",
            layers={"module.embed": "embedded"},
        )
        td = lrp(TensorDict(tokens=tokens, batch_size=[4]))
        assert td["relevance", "tokens"].shape == (4, 3, 5)
        assert td["relevance", "embedded"].shape == (4, 3, 5, 4)
        torch.testing.assert_close(td["relevance", "embedded"].sum(-1), td["relevance", "tokens"])
        single = LRP(
            TensorDictModule(net, in_keys=["tokens"], out_keys=["logits"]),
            rule_mapper={nn.Linear: EpsilonRule(0.25)},
            target=2,
        )(TensorDict(tokens=tokens, batch_size=[4]))
        torch.testing.assert_close(td["relevance", "tokens"][:, 2], single["relevance", "tokens"])

    def test_tokens_embedded_twice_are_refused(self):
        class TwoTables(nn.Module):
            def __init__(self):
                super().__init__()
                self.words, self.positions, self.fc = nn.Embedding(5, 3), nn.Embedding(5, 3), nn.Linear(3, 2)

            def forward(self, tokens):
                return self.fc(self.words(tokens) + self.positions(tokens)).sum(1)

        net = TwoTables().double()
        with pytest.raises(ValueError, match="'tokens' is embedded twice .again by 'positions'"):
            LRP(net, in_keys=["tokens"], out_keys=["y"])(TensorDict(tokens=torch.randint(0, 5, (2, 4)), batch_size=[2]))

    def test_integer_key_that_breaks_the_model_is_named(self):
        net = IntegerFeatureNet().double()
        td = TensorDict(tokens=torch.randint(0, 11, (3, 5)), counts=torch.randint(0, 4, (3, 2)), batch_size=[3])
        before = state(net)
        with pytest.raises(RuntimeError, match="(?s)same dtype.*'counts' holds integer tokens"):  # the model's error
            LRP(TensorDictModule(net, in_keys=["tokens", "counts"], out_keys=["logits"]))(td)
        assert_same_state(net, before)


# ----------------------------------------------------------------------------- 6. torchrl models


def plain_relevance(model: nn.Module, x: torch.Tensor, rule_mapper) -> torch.Tensor:
    lrp = LRP(model, rule_mapper=rule_mapper, in_keys=["x"], out_keys=["y"])
    return lrp(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))["relevance", "x"]


TORCHRL_PRESETS = {
    "EpsilonPlusFlat": (lambda: EpsilonPlusFlat(), lambda: zcomposites.EpsilonPlusFlat()),
    "EpsilonGammaBox": (lambda: EpsilonGammaBox(-3.0, 3.0), lambda: zcomposites.EpsilonGammaBox(low=-3.0, high=3.0)),
}


class TestTorchRL:
    @pytest.mark.parametrize("preset", sorted(TORCHRL_PRESETS))
    def test_mlp_with_batch_and_time_dims(self, preset: str):
        ours, theirs = TORCHRL_PRESETS[preset]
        net = MLP(in_features=5, out_features=4, num_cells=[8, 8]).double()
        x = torch.randn(3, 4, 5, dtype=F64).clamp(-2.9, 2.9)
        policy = TensorDictModule(net, in_keys=["observation"], out_keys=["action_value"])
        td = LRP(policy, rule_mapper=ours())(TensorDict(observation=x, batch_size=[3, 4]))
        relevance = td["relevance", "observation"]
        assert relevance.shape == x.shape
        plain = nn.Sequential(*net.children())
        flat_x = x.reshape(12, 5)
        expected = plain_relevance(plain, flat_x, ours())
        assert relative_error(relevance.reshape(12, 5), expected) <= TOL
        zennit = zennit_model_relevance(theirs(), plain, flat_x)
        assert relative_error(relevance.reshape(12, 5), zennit) <= TOL

    @pytest.mark.parametrize("preset", sorted(TORCHRL_PRESETS))
    def test_lazy_convnet_squashes_batch_and_time_dims(self, preset: str):
        ours, theirs = TORCHRL_PRESETS[preset]
        convnet = ConvNet(num_cells=[4, 6], kernel_sizes=3, strides=2).double()  # LazyConv2d first
        head = MLP(in_features=6 * 1 * 1, out_features=3, num_cells=[8]).double()
        actor = TensorDictSequential(
            TensorDictModule(convnet, in_keys=["pixels"], out_keys=["features"]),
            TensorDictModule(head, in_keys=["features"], out_keys=["action_value"]),
        )
        x = torch.randn(2, 3, 2, 7, 7, dtype=F64).clamp(-2.9, 2.9)
        # The lazy convolution is materialised inside the LRP context, on its first call; strict: every
        # module of the actor (SquashDims included) has a rule.
        mapper = ours()
        mapper.strict = True
        td = LRP(actor, rule_mapper=mapper)(TensorDict(pixels=x, batch_size=[2, 3]))
        relevance = td["relevance", "pixels"]
        assert relevance.shape == x.shape
        assert isinstance(convnet[0], nn.Conv2d) and not isinstance(convnet[0], nn.LazyConv2d)
        plain = nn.Sequential(*convnet.children(), *head.children())
        flat_x = x.reshape(6, 2, 7, 7)
        torch.testing.assert_close(td["action_value"].reshape(6, 3), plain(flat_x))
        expected = plain_relevance(plain, flat_x, ours())
        assert relative_error(relevance.reshape(6, 2, 7, 7), expected) <= TOL
        zennit = zennit_model_relevance(theirs(), plain, flat_x)
        assert relative_error(relevance.reshape(6, 2, 7, 7), zennit) <= TOL


# ----------------------------------------------------------------------------- 7. modules called twice


class TwiceInSequence(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(4, 6)
        self.shared = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = self.stem(x).relu()
        return self.head(self.shared(self.shared(h).relu()).relu())


class UnrolledSequence(nn.Module):
    def __init__(self, twice: TwiceInSequence):
        super().__init__()
        self.stem, self.head = twice.stem, twice.head
        self.first, self.second = copy.deepcopy(twice.shared), copy.deepcopy(twice.shared)

    def forward(self, x):
        return self.head(self.second(self.first(self.stem(x).relu()).relu()).relu())


class TwoBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(4, 5)
        self.head = nn.Linear(10, 3)

    def forward(self, a, b):
        return self.head(torch.cat([self.shared(a).relu(), self.shared(b).relu()], -1))


class UnrolledBranches(nn.Module):
    def __init__(self, shared: TwoBranches):
        super().__init__()
        self.head = shared.head
        self.for_a, self.for_b = copy.deepcopy(shared.shared), copy.deepcopy(shared.shared)

    def forward(self, a, b):
        return self.head(torch.cat([self.for_a(a).relu(), self.for_b(b).relu()], -1))


SHARED_RULES = {
    "epsilon": lambda: EpsilonRule(0.1),
    "alpha2beta1": lambda: AlphaBetaRule(2.0, 1.0),
    "zplus": lambda: AlphaBetaRule(1.0, 0.0),
}


class TestSharedModules:
    @pytest.mark.parametrize("rule_name", sorted(SHARED_RULES))
    def test_applied_twice_in_sequence_equals_two_copies(self, rule_name: str):
        model = TwiceInSequence().double()
        unrolled = UnrolledSequence(model)
        x = torch.randn(5, 4, dtype=F64)
        rule = SHARED_RULES[rule_name]
        actual = plain_relevance(model, x, {nn.Linear: rule()})
        expected = plain_relevance(unrolled, x, {nn.Linear: rule()})
        assert relative_error(actual, expected) <= 1e-10
        # Applying the rule only once would differ: the test sees both calls.
        once = plain_relevance(model, x, {"stem": rule(), "head": rule()})
        assert relative_error(once, expected) > 1e-3

    def test_first_layer_rule_is_chosen_per_call(self):
        model = TwiceInSequence().double()
        unrolled = UnrolledSequence(model)
        x = torch.randn(5, 4, dtype=F64)
        # Flat applies to the stem only: the shared layer is never reached first, on either call.
        actual = plain_relevance(model, x, EpsilonPlusFlat(epsilon=0.1))
        expected = plain_relevance(unrolled, x, {"stem": FlatRule(), nn.Linear: EpsilonRule(0.1)})
        assert relative_error(actual, expected) <= 1e-10

    @pytest.mark.parametrize("rule_name", sorted(SHARED_RULES))
    def test_shared_on_two_branches_equals_two_copies(self, rule_name: str):
        model = TwoBranches().double()
        unrolled = UnrolledBranches(model)
        td = TensorDict(a=torch.randn(5, 4, dtype=F64), b=torch.randn(5, 4, dtype=F64), batch_size=[5])
        rule = SHARED_RULES[rule_name]

        def explain(net):
            lrp = LRP(net, rule_mapper={nn.Linear: rule()}, in_keys=["a", "b"], out_keys=["y"])
            return lrp(td.clone())

        actual, expected = explain(model), explain(unrolled)
        for key in ("a", "b"):
            assert relative_error(actual["relevance", key], expected["relevance", key]) <= 1e-10
            assert expected["relevance", key].abs().sum() > 0

    def test_shared_encoder_is_a_first_layer_on_both_branches(self):
        model = TwoBranches().double()
        unrolled = UnrolledBranches(model)
        td = TensorDict(a=torch.randn(5, 4, dtype=F64), b=torch.randn(5, 4, dtype=F64), batch_size=[5])
        ours = LRP(model, rule_mapper=EpsilonPlusFlat(epsilon=0.1), in_keys=["a", "b"], out_keys=["y"])(td.clone())
        by_name = {"for_*": FlatRule(), nn.Linear: EpsilonRule(0.1)}
        theirs = LRP(unrolled, rule_mapper=by_name, in_keys=["a", "b"], out_keys=["y"])(td.clone())
        for key in ("a", "b"):
            assert relative_error(ours["relevance", key], theirs["relevance", key]) <= 1e-10
            rel = ours["relevance", key]  # Flat: one value per sample over the encoder's inputs
            torch.testing.assert_close(rel, rel[:, :1].expand_as(rel))

    def test_layer_relevance_of_a_shared_module_sums_both_calls(self):
        model = TwoBranches().double()
        unrolled = UnrolledBranches(model)
        td = TensorDict(a=torch.randn(5, 4, dtype=F64), b=torch.randn(5, 4, dtype=F64), batch_size=[5])
        mapper = {nn.Linear: EpsilonRule(0.1)}
        ours = LRP(model, rule_mapper=mapper, in_keys=["a", "b"], out_keys=["y"], layers=["shared"])(td.clone())
        theirs = LRP(unrolled, rule_mapper=mapper, in_keys=["a", "b"], out_keys=["y"], layers=["for_a", "for_b"])(
            td.clone()
        )
        expected = theirs["relevance", "for_a"] + theirs["relevance", "for_b"]
        assert relative_error(ours["relevance", "shared"], expected) <= 1e-10


# ----------------------------------------------------------------------------- 8. strict and warning mappers


def with_softmax() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 3), nn.Softmax(-1)).double()


def no_rule_warnings(record) -> list:
    return [w for w in record if "no rule covers it" in str(w.message)]


class TestStrictMapper:
    def test_strict_base_mapper_names_the_unmapped_module(self):
        model = with_softmax()
        lrp = LRP(model, rule_mapper=BaseRuleMapper(strict=True), in_keys=["x"], out_keys=["y"])
        before = state(model)
        with pytest.raises(ValueError, match=r"module '3' \(Softmax\)"):
            lrp(TensorDict(x=torch.randn(2, 4, dtype=F64), batch_size=[2]))
        assert_same_state(model, before)
        assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())

    def test_strict_preset_names_the_unmapped_module(self):
        class Normed(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 6)
                self.norm = nn.Softmax(dim=-1)
                self.out = nn.Linear(6, 2)

            def forward(self, x):
                return self.out(self.norm(self.fc(x)))

        module = TensorDictModule(Normed().double(), in_keys=["x"], out_keys=["y"])
        lrp = LRP(module, rule_mapper=EpsilonPlus(strict=True))
        with pytest.raises(ValueError, match=r"module 'module\.norm' \(Softmax\)"):
            lrp(TensorDict(x=torch.randn(2, 4, dtype=F64), batch_size=[2]))
        # Mapping it explicitly satisfies the strict mapper.
        ok = LRP(module, rule_mapper=EpsilonPlus(strict=True, rule_mapper={nn.Softmax: PassRule()}))
        assert ok(TensorDict(x=torch.randn(2, 4, dtype=F64), batch_size=[2]))["relevance", "x"].shape == (2, 4)

    def test_non_strict_mapper_warns_once_per_module(self):
        model = with_softmax()
        mapper = BaseRuleMapper()
        lrp = LRP(model, rule_mapper=mapper, in_keys=["x"], out_keys=["y"])
        td = TensorDict(x=torch.randn(2, 4, dtype=F64), batch_size=[2])
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            lrp(td.clone())
        first = no_rule_warnings(record)
        assert len(first) == 1
        assert issubclass(first[0].category, UserWarning)
        assert "'3' (Softmax)" in str(first[0].message)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            lrp(td.clone())
            mapper.rules(model)
        assert no_rule_warnings(record) == []

    def test_a_wrapper_warns_on_its_first_call_only_across_contexts(self):
        model = with_softmax()
        lrp = LRP(model, rule_mapper=EpsilonPlus(), in_keys=["x"], out_keys=["y"])
        td = TensorDict(x=torch.randn(2, 4, dtype=F64), batch_size=[2])
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            EpsilonPlus().rules(model)  # choosing rules does not judge the forward pass
            for _ in range(2):
                with lrp:
                    lrp(td.clone())
                    lrp(td.clone())
        assert len(no_rule_warnings(record)) == 1

    @pytest.mark.parametrize("strict", [False, True])
    def test_tensordict_glue_modules_need_no_rule(self, strict: bool):
        pipeline = TensorDictSequential(
            TensorDictModule(lambda x: x * 2.0, in_keys=["x"], out_keys=["scaled"]),
            TensorDictModule(nn.Sequential(nn.Linear(4, 5), nn.Tanh()).double(), in_keys=["scaled"], out_keys=["h"]),
            TensorDictModule(lambda h: h.flip(-1), in_keys=["h"], out_keys=["y"]),
        )
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            td = LRP(pipeline, rule_mapper=BaseRuleMapper(strict=strict))(
                TensorDict(x=torch.randn(2, 4, dtype=F64), batch_size=[2])
            )
        assert no_rule_warnings(record) == []
        assert td["relevance", "x"].abs().sum() > 0


# ----------------------------------------------------------------------------- 9. inner-layer relevance


def mlp(bias: bool = True) -> nn.Sequential:
    model = nn.Sequential(
        nn.Linear(5, 8, bias=bias), nn.ReLU(), nn.Linear(8, 6, bias=bias), nn.ReLU(), nn.Linear(6, 3, bias=bias)
    ).double()
    if bias:
        with torch.no_grad():
            for layer in model[::2]:
                layer.bias.normal_(std=0.5)
    return model


def epsilon_by_hand(model: nn.Sequential, x: torch.Tensor, epsilon: float) -> dict[str, torch.Tensor]:
    """LRP-ε written out on ``Linear, ReLU, Linear, ReLU, Linear``: the relevance at each layer's output."""

    def stab(z):
        return z + epsilon * torch.where(z >= 0, 1.0, -1.0).to(z.dtype)

    with torch.no_grad():
        acts, h = [x], x
        for module in model:
            h = module(h)
            acts.append(h)
        y = acts[-1]
        relevance = {"4": argmax_one_hot(y) * y}
        r = relevance["4"]
        for index in (4, 2, 0):
            layer, a_in, z = model[index], acts[index], acts[index + 1]
            r = a_in * ((r / stab(z)) @ layer.weight)  # relevance at the layer's input
            # The ReLU before the layer passes it on to the previous layer's output.
            relevance[str(index - 2) if index else "x"] = r
    return relevance


class TestLayerRelevance:
    def test_list_and_dict_keys_match_lrp_epsilon_by_hand(self):
        model = mlp()
        x = torch.randn(6, 5, dtype=F64)
        mapper = {nn.Linear: EpsilonRule(0.25)}
        td = TensorDict(x=x.clone(), batch_size=[6])
        by_list = LRP(model, rule_mapper=mapper, in_keys=["x"], out_keys=["y"], layers=["0", "2"])(td.clone())
        by_dict = LRP(model, rule_mapper=mapper, in_keys=["x"], out_keys=["y"], layers={"2": "hidden", "4": "top"})(
            td.clone()
        )
        expected = epsilon_by_hand(model, x, 0.25)
        for name in ("0", "2"):
            assert by_list["relevance", name].shape == expected[name].shape
            assert relative_error(by_list["relevance", name], expected[name]) <= 1e-12
        assert relative_error(by_dict["relevance", "hidden"], expected["2"]) <= 1e-12
        assert relative_error(by_dict["relevance", "top"], expected["4"]) <= 1e-12
        assert ("relevance", "2") not in by_dict.keys(include_nested=True)
        assert relative_error(by_list["relevance", "x"], expected["x"]) <= 1e-12

    @pytest.mark.parametrize("mapper", ["epsilon0", "lrp0"])
    def test_zero_bias_layers_conserve_the_explained_output(self, mapper: str):
        model = mlp(bias=False)
        rule_mapper = {nn.Linear: EpsilonRule(0.0)} if mapper == "epsilon0" else BaseRuleMapper(stabilizer=0.0)
        x = torch.randn(6, 5, dtype=F64)
        td = LRP(model, rule_mapper=rule_mapper, in_keys=["x"], out_keys=["y"], layers=["0", "1", "2", "4"])(
            TensorDict(x=x, batch_size=[6])
        )
        explained = td["y"].max(-1).values
        for key in ("0", "1", "2", "4", "x"):
            torch.testing.assert_close(td["relevance", key].sum(-1), explained, rtol=1e-10, atol=1e-12)

    def test_conv_merged_with_batch_norm_reports_the_merged_output(self):
        conv = nn.Conv2d(2, 3, 3, padding=1)
        model = nn.Sequential(conv, randomise_batch_norm(nn.BatchNorm2d(3)), nn.ReLU(), nn.Flatten(), nn.Linear(48, 3))
        model = model.double().eval()
        x = torch.randn(2, 2, 4, 4, dtype=F64)
        td = LRP(model, rule_mapper=BaseRuleMapper(stabilizer=0.0), in_keys=["x"], out_keys=["y"], layers=["0"])(
            TensorDict(x=x, batch_size=[2])
        )
        # LRP-0 everywhere: the relevance of a tensor is the tensor times its plain gradient.
        leaf = x.clone().requires_grad_(True)
        z_conv = model[0](leaf)
        z_norm = model[1](z_conv)
        out = model[4](model[3](model[2](z_norm)))
        g_conv, g_norm = torch.autograd.grad(out, (z_conv, z_norm), argmax_one_hot(out.detach()))
        merged_output = (z_norm * g_norm).detach()
        conv_output = (z_conv * g_conv).detach()
        assert relative_error(td["relevance", "0"], merged_output) <= 1e-12
        assert relative_error(conv_output, merged_output) > 1e-3  # the two are told apart

    def test_target_all_stacks_units_after_the_batch_dims(self):
        model = mlp()
        x = torch.randn(2, 3, 5, dtype=F64)
        mapper = {nn.Linear: EpsilonRule(0.1)}

        def explain(target):
            lrp = LRP(model, rule_mapper=mapper, in_keys=["x"], out_keys=["y"], layers={"2": "hidden"}, target=target)
            return lrp(TensorDict(x=x.clone(), batch_size=[2, 3]))

        every = explain("all")
        assert every["relevance", "hidden"].shape == (2, 3, 3, 6)
        assert every["relevance", "x"].shape == (2, 3, 3, 5)
        for key in (("relevance", "hidden"), ("relevance", "x")):
            singles = torch.stack([explain(k)[key] for k in range(3)], dim=2)
            torch.testing.assert_close(every[key], singles, rtol=1e-12, atol=1e-12)

    def test_unknown_layer_name_is_named(self):
        with pytest.raises(KeyError, match="'decoder.1'"):
            LRP(mlp(), in_keys=["x"], out_keys=["y"], layers=["0", "decoder.1"])

    @pytest.mark.parametrize("inner", ["1.0", "1.2", "shared"])
    def test_a_module_inside_a_taylor_block_is_refused_by_name(self, inner: str):
        # The Taylor rule takes the block's input gradient from its own evaluation at the reference: the modules inside
        # get no gradient, and their relevance read as zeros before.
        torch.manual_seed(0)
        block = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        model = nn.Sequential(nn.Linear(3, 4), block, nn.Linear(4, 2)).double()
        model.shared = block[0]  # the same Linear under a second name
        before = copy.deepcopy(model.state_dict())
        lrp = LRP(
            model,
            rule_mapper={"1": TaylorDecompositionRule(ref=0.1, bias=True)},
            in_keys=["x"],
            out_keys=["y"],
            layers=[inner],
        )
        td = TensorDict(x=torch.randn(3, 3, dtype=F64), batch_size=[3])
        kept = td.clone()
        with pytest.raises(ValueError, match=rf"module '{inner}' \(Linear\), inside module '1' \(Sequential\)"):
            lrp(td)
        assert (td == kept).all() and set(td.keys()) == {"x"}
        assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())
        assert not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in model.modules())

    def test_a_taylor_block_and_the_modules_around_it_get_their_relevance(self):
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(3, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)), nn.Linear(4, 2)
        ).double()
        lrp = LRP(
            model,
            rule_mapper={"1": TaylorDecompositionRule(ref=0.0), nn.Linear: EpsilonRule(0.0)},
            in_keys=["x"],
            out_keys=["y"],
            layers=["0", "1"],
            target=0,
        )
        td = lrp(TensorDict(x=torch.randn(3, 3, dtype=F64), batch_size=[3]))
        x = td["x"].clone().requires_grad_(True)
        hidden = model[0](x)
        block_out = model[1](hidden)
        (grad,) = torch.autograd.grad(model[2](block_out)[:, 0].sum(), block_out)
        assert relative_error(td["relevance", "1"], block_out.detach() * grad) <= 1e-12
        assert td["relevance", "0"].abs().sum() > 0  # the block passed relevance on to its input

    def test_epsilon_not_representable_in_float32_is_exact_in_float64(self):
        model = mlp()
        x = torch.randn(6, 5, dtype=F64)
        td = LRP(model, rule_mapper={nn.Linear: EpsilonRule(0.1)}, in_keys=["x"], out_keys=["y"], layers=["0"])(
            TensorDict(x=x.clone(), batch_size=[6])
        )
        expected = epsilon_by_hand(model, x, 0.1)
        assert relative_error(td["relevance", "0"], expected["0"]) <= 1e-12
        assert relative_error(td["relevance", "x"], expected["x"]) <= 1e-12


class CountedLinear(nn.Linear):
    """A Linear subclass whose forward is its own (it counts its calls)."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        return super().forward(x)


class InheritedLinear(nn.Linear):
    """A Linear subclass that keeps nn.Linear's forward."""


@pytest.mark.parametrize("kind", [CountedLinear, InheritedLinear])
def test_a_linear_subclass_under_flat_runs_its_forward_once_more_only_if_it_has_its_own(kind):
    """Flat's modified pass (on ones, with unit weights) goes through a forward of the layer's own, so that what
    it does around its linear function is in that pass too; nn.Linear's forward is replaced by F.linear."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)).to(F64)
    sub = copy.deepcopy(plain)
    sub[0] = kind(4, 6).to(F64)
    sub[0].load_state_dict(plain[0].state_dict())
    x = torch.randn(3, 4, dtype=F64)
    x[:, 0] = 0.0
    lrp = LRP(sub, EpsilonPlusFlat(), in_keys=["x"], out_keys=["y"])
    with lrp:
        lrp(TensorDict(x=x, batch_size=[3]))  # the first call prepares the rule (a probe call for own forwards)
        CountedLinear.calls = 0
        actual = lrp(TensorDict(x=x, batch_size=[3]))["relevance", "x"]
        assert CountedLinear.calls == (2 if kind is CountedLinear else 0)
    expected = LRP(plain, EpsilonPlusFlat(), in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[3]))
    torch.testing.assert_close(actual, expected["relevance", "x"], rtol=1e-12, atol=1e-12)
