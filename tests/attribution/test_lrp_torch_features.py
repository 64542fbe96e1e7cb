"""PyTorch features users put on otherwise plain models, under every CNN preset (float64).

Parametrizations (weight_norm, spectral_norm, orthogonal, a user's, on a BatchNorm's weight or a buffer), the
hook-based weight_norm and spectral_norm, pruning (of weights and biases, before and after ``prune.remove``), the
fusion utilities, lazy modules, in-place forward hooks of the user's, ``parametrize.cached``, changes between the calls
of an open context, and spectral_norm in training mode. The oracle is the same model written plainly (the weights the
feature computes put in plain layers; the unfused model; a module for a hook's change, which is code after the layer),
checked against zennit with its BatchNorm canonizer; the model's outputs and state are unchanged by the call.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.ao.quantization as quantization
from tensordict import TensorDict
from torch import nn
from torch.nn.utils import fusion, parametrizations, parametrize, prune
from zennit import composites as zcomposites
from zennit.canonizers import SequentialMergeBatchNorm

from tdhook.attribution import LRP, UniformEpsilon
from tests.attribution.rules._helpers import CNN_PRESETS
from tests.attribution.test_lrp_layers import randomise_batch_norm
from tests.conftest import relative_error, zennit_model_relevance

F64 = torch.float64
PRESETS: dict[str, Callable[..., object]] = {**CNN_PRESETS, "UniformEpsilon": UniformEpsilon}
ZENNIT = {
    "EpsilonPlus": zcomposites.EpsilonPlus,
    "EpsilonGammaBox": lambda: zcomposites.EpsilonGammaBox(low=-3.0, high=3.0),
    "EpsilonAlpha2Beta1": zcomposites.EpsilonAlpha2Beta1,
}
LAYERS = (0, 4, 8)  # the two convolutions and the Linear head of cnn()


def cnn() -> nn.Sequential:
    """Conv-BN-ReLU-MaxPool, Conv-ReLU-AvgPool, Linear (seeded; the BatchNorm with statistics of its own)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        randomise_batch_norm(nn.BatchNorm2d(6)),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 5, 3, padding=1),
        nn.ReLU(),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(5 * 2 * 2, 4),
    )
    return model.to(F64).eval()


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).to(F64).eval()


def image() -> torch.Tensor:
    return torch.rand(3, 3, 8, 8, generator=torch.Generator().manual_seed(1), dtype=F64) * 4 - 2


def relevance(model: nn.Module, x: torch.Tensor, mapper) -> tuple[torch.Tensor, torch.Tensor]:
    td = LRP(model, rule_mapper=mapper, in_keys=["x"], out_keys=["y"])(TensorDict(x=x.clone(), batch_size=[len(x)]))
    return td["y"], td["relevance", "x"]


def plain_copy(model: nn.Sequential, make: Callable[[], nn.Sequential] = cnn) -> nn.Sequential:
    """``make()`` holding the weights and biases ``model``'s layers compute with, and its BatchNorms' values."""
    plain = make()
    with torch.no_grad():
        for layer, target in zip(model, plain, strict=True):
            if isinstance(target, (nn.Conv2d, nn.Linear, nn.BatchNorm2d)):
                target.weight.copy_(layer.weight)
                target.bias.copy_(layer.bias)
            if isinstance(target, nn.BatchNorm2d):
                target.running_mean.copy_(layer.running_mean)
                target.running_var.copy_(layer.running_var)
    return plain


def assert_explains_as(model: nn.Module, plain: nn.Module, x: torch.Tensor, preset: str, tolerance: float = 1e-12):
    """``model`` explains as ``plain`` under ``preset``, with its output and state unchanged."""
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with torch.no_grad():
        expected_output = model(x)
    output, actual = relevance(model, x, PRESETS[preset]())
    torch.testing.assert_close(output, expected_output, rtol=0, atol=0)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    _, expected = relevance(plain, x, PRESETS[preset]())
    assert relative_error(actual, expected) <= tolerance
    if preset in ZENNIT:  # the plain model's, against zennit's with its BatchNorm merged
        reference = zennit_model_relevance(ZENNIT[preset](), plain, x, canonizers=[SequentialMergeBatchNorm()])
        assert relative_error(actual, reference) <= 1e-6


class Positive(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.exp()


class Halved(nn.Module):
    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        return 0.5 * tensor


def on_layers(change: Callable[[nn.Module], object], layers: tuple[int, ...] = LAYERS) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        model = cnn()
        for index in layers:
            change(model[index])
        return model.eval()

    return make


def weight_norm(layer: nn.Module) -> None:
    parametrizations.weight_norm(layer)
    with torch.no_grad():  # magnitudes away from the direction's norms they start at
        magnitude = layer.parametrizations.weight.original0
        magnitude.mul_(torch.rand(magnitude.shape, generator=torch.Generator().manual_seed(2), dtype=F64) + 0.5)


def pruned_then_removed(layer: nn.Module) -> None:
    prune.l1_unstructured(layer, "weight", 0.4)
    prune.remove(layer, "weight")


FEATURES: dict[str, Callable[[], nn.Module]] = {
    "weight_norm": on_layers(weight_norm),
    "weight_norm-first-layer": on_layers(weight_norm, (0,)),
    "spectral_norm": on_layers(parametrizations.spectral_norm),
    "orthogonal": on_layers(parametrizations.orthogonal, (8,)),
    "positive-weight": on_layers(
        lambda layer: parametrize.register_parametrization(layer, "weight", Positive()), (0, 4)
    ),
    "halved-bias": on_layers(lambda layer: parametrize.register_parametrization(layer, "bias", Halved())),
    "legacy-weight_norm": on_layers(torch.nn.utils.weight_norm),
    "legacy-spectral_norm": on_layers(torch.nn.utils.spectral_norm),
    "l1_unstructured": on_layers(lambda layer: prune.l1_unstructured(layer, "weight", 0.4)),
    "random_structured": on_layers(lambda layer: prune.random_structured(layer, "weight", 0.3, dim=0), (0, 4)),
    "pruned-bias": on_layers(lambda layer: prune.l1_unstructured(layer, "bias", 0.5)),
    "pruned-then-removed": on_layers(pruned_then_removed, (0, 4)),
    "batch-norm-weight-parametrized": on_layers(
        lambda norm: parametrize.register_parametrization(norm, "weight", Positive()), (1,)
    ),
    "batch-norm-weight-pruned": on_layers(lambda norm: prune.l1_unstructured(norm, "weight", 0.5), (1,)),
}


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")
@pytest.mark.parametrize("preset", sorted(set(PRESETS) - {"EpsilonPlusFlat"}))  # its rules are those of two others
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_weights_a_feature_computes_explain_as_plain_weights(feature: str, preset: str):
    torch.manual_seed(3)
    model = FEATURES[feature]()
    x = image()
    with torch.no_grad():
        model(x)  # the hook-based features set their weight in the forward
    assert_explains_as(model, plain_copy(model), x, preset)


def test_a_parametrized_buffer_of_a_batch_norm_explains_as_the_plain_one():
    model, plain = cnn(), cnn()
    parametrize.register_parametrization(model[1], "running_var", Halved(), unsafe=True)
    with torch.no_grad():
        plain[1].running_var.mul_(0.5)
    assert_explains_as(model, plain, image(), "EpsilonPlus")


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_parametrize_cached_around_the_call(preset: str):
    model = on_layers(weight_norm, (0, 4))()
    with parametrize.cached():
        assert_explains_as(model, plain_copy(model), image(), preset)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("how", ["fuse_conv_bn_eval", "fuse_modules"])
def test_a_fused_model_explains_as_the_unfused_one(how: str, preset: str):
    model = cnn()
    if how == "fuse_conv_bn_eval":
        fused = nn.Sequential(fusion.fuse_conv_bn_eval(model[0], model[1]), *list(model)[2:]).eval()
    else:
        fused = quantization.fuse_modules(copy.deepcopy(model), [["0", "1", "2"], ["4", "5"]])
    assert_explains_as(fused, cnn(), image(), preset, tolerance=1e-12)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_fuse_linear_bn_eval_explains_as_the_unfused_model(preset: str):
    def unfused() -> nn.Sequential:
        torch.manual_seed(0)
        layers = [nn.Linear(6, 8), randomise_batch_norm(nn.BatchNorm1d(8)), nn.ReLU(), nn.Linear(8, 3)]
        return nn.Sequential(*layers).to(F64).eval()

    model = unfused()
    fused = nn.Sequential(fusion.fuse_linear_bn_eval(model[0], model[1]), *list(model)[2:]).eval()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1), dtype=F64)
    _, expected = relevance(unfused(), x, PRESETS[preset]())
    assert relative_error(relevance(fused, x, PRESETS[preset]())[1], expected) <= 1e-12


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_lazy_modules_explain_as_the_model_they_become(preset: str):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.LazyConv2d(6, 3, padding=1, dtype=F64),
        nn.LazyBatchNorm2d(dtype=F64),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.LazyConv2d(5, 3, padding=1, dtype=F64),
        nn.ReLU(),
        nn.Flatten(),
        nn.LazyLinear(4, dtype=F64),
    ).eval()
    x = image()
    output, actual = relevance(model, x, PRESETS[preset]())
    assert not any(isinstance(m, nn.modules.lazy.LazyModuleMixin) for m in model.modules())
    materialised = copy.deepcopy(model)
    with torch.no_grad():
        torch.testing.assert_close(output, materialised(x), rtol=0, atol=0)
    assert relative_error(actual, relevance(materialised, x, PRESETS[preset]())[1]) <= 1e-12


class Shift(nn.Module):
    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor + 0.3


class Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor * self.factor


def with_hook(index: int, hook: str) -> nn.Sequential:
    model = cnn()
    if hook == "output.mul_":
        model[index].register_forward_hook(lambda module, args, output: output.mul_(2.0))
    elif hook == "output.add_":
        model[index].register_forward_hook(lambda module, args, output: output.add_(0.3))
    else:  # input.mul_
        model[index].register_forward_pre_hook(halve_in_place)
    return model


def halve_in_place(module: nn.Module, args: tuple) -> None:
    args[0].mul_(0.5)


def as_module(index: int, hook: str) -> nn.Sequential:
    model = cnn()
    around = {"output.mul_": (None, Scale(2.0)), "output.add_": (None, Shift()), "input.mul_": (Scale(0.5), None)}
    before, after = around[hook]
    model[index] = nn.Sequential(*(m for m in (before, model[index], after) if m is not None))
    return model


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize(
    ("index", "hook"), [(0, "output.mul_"), (4, "output.add_"), (1, "output.mul_"), (4, "input.mul_")]
)
def test_an_in_place_hook_of_the_user_explains_as_a_module_around_the_layer(index: int, hook: str, preset: str):
    x = image()
    _, expected = relevance(as_module(index, hook), x, PRESETS[preset]())
    assert relative_error(relevance(with_hook(index, hook), x, PRESETS[preset]())[1], expected) <= 1e-12


def update(get: Callable[[nn.Module], torch.Tensor]) -> Callable[[nn.Module], None]:
    def change(model: nn.Module) -> None:
        with torch.no_grad():
            tensor = get(model)
            tensor.add_(0.3 * torch.randn(tensor.shape, generator=torch.Generator().manual_seed(7), dtype=F64))

    return change


CHANGES: dict[str, tuple[Callable[[], nn.Module], Callable[[nn.Module], object]]] = {
    "weight_norm-direction": (on_layers(weight_norm, (0, 4)), update(lambda m: m[4].parametrizations.weight.original1)),
    "weight_norm-magnitude": (on_layers(weight_norm, (0, 4)), update(lambda m: m[0].parametrizations.weight.original0)),
    "pruned-weight_orig": (
        on_layers(lambda layer: prune.l1_unstructured(layer, "weight", 0.3)),
        update(lambda m: m[4].weight_orig),
    ),
    "pruning-mask": (
        on_layers(lambda layer: prune.l1_unstructured(layer, "weight", 0.3)),
        lambda m: m[4].weight_mask[:2].zero_(),
    ),
    "pruned-again": (
        on_layers(lambda layer: prune.l1_unstructured(layer, "weight", 0.3)),
        lambda m: prune.l1_unstructured(m[4], "weight", 0.5),
    ),
    "weight_norm-added": (cnn, lambda m: parametrizations.weight_norm(m[4])),
    "batch-norm-statistics": (cnn, update(lambda m: m[1].running_mean)),
    "mlp-pre-hook-added": (mlp, lambda m: m[2].register_forward_pre_hook(lambda module, args: (args[0] * 0.5,))),
    "mlp-pruned": (mlp, lambda m: prune.l1_unstructured(m[2], "weight", 0.5)),
}


@pytest.mark.parametrize("preset", ["EpsilonPlus", "EpsilonGammaBox", "UniformEpsilon"])
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_change_between_calls_of_an_open_context_is_seen(change: str, preset: str):
    make, apply = CHANGES[change]
    x = image() if change[:3] != "mlp" else torch.randn(4, 6, generator=torch.Generator().manual_seed(1), dtype=F64)
    model = make()
    lrp = LRP(model, rule_mapper=PRESETS[preset](), in_keys=["x"], out_keys=["y"])
    with lrp:
        lrp(TensorDict(x=x.clone(), batch_size=[len(x)]))
        apply(model)
        td = lrp(TensorDict(x=x.clone(), batch_size=[len(x)]))
    changed = make()
    apply(changed)
    output, expected = relevance(changed, x, PRESETS[preset]())
    torch.testing.assert_close(td["y"], output, rtol=0, atol=0)
    assert relative_error(td["relevance", "x"], expected) <= 1e-12


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.spectral_norm`:FutureWarning")
@pytest.mark.parametrize("preset", ["EpsilonPlus", "UniformEpsilon"])
@pytest.mark.parametrize("kind", ["parametrization", "legacy"])
def test_spectral_norm_in_training_mode_steps_once_and_explains_with_the_weight_it_used(kind: str, preset: str):
    model = mlp()
    for index in (0, 2, 4):
        (parametrizations.spectral_norm if kind == "parametrization" else torch.nn.utils.spectral_norm)(model[index])
    model.train()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1), dtype=F64)
    stepped = copy.deepcopy(model)
    with torch.no_grad():
        expected_output = stepped(x)  # one power iteration per layer
    output, actual = relevance(model, x, PRESETS[preset]())
    torch.testing.assert_close(output, expected_output, rtol=0, atol=0)
    after, once = model.state_dict(), stepped.state_dict()
    assert after.keys() == once.keys() and all(torch.equal(after[k], v) for k, v in once.items())
    plain = mlp()
    with torch.no_grad():  # the weights that call used: those of the model stepped once, in eval mode
        used = copy.deepcopy(stepped).eval()
        for index in (0, 2, 4):
            plain[index].weight.copy_(used[index].weight)
    assert relative_error(actual, relevance(plain, x, PRESETS[preset]())[1]) <= 1e-12
