"""Every preset and modified rule against zennit (float64) on randomly built models, with random parameters.

Each seed builds a model from layers users write: Linear; Conv1d/2d/3d with groups, dilation, strides, ``'same'``
and reflect, replicate or circular padding; ConvTranspose1d/2d/3d with output padding; BatchNorm after a layer
(eval mode, random statistics); average, max and adaptive pooling; ReLU, LeakyReLU, Tanh and SiLU; Dropout in eval
mode; residual blocks; a module used twice; weight_norm and spectral_norm weights. zennit explains a twin of the
model that computes the same function in the form its composites need: BatchNorm merged into the layer before it,
the residual sum as zennit's ``Sum`` (under an unstabilised ``Norm``, the exact split tdhook makes), the reused
module as two copies with the same weights (zennit keeps one input per module), plain weights for the
parametrized ones. The seeds are fixed, so CI runs the same models every time.

Left out: activations with ``f(0) != 0`` (Sigmoid, Softplus) where their input can be exactly 0 (after a ReLU),
whose relevance at those entries no ``x · grad`` carries.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from tensordict import TensorDict
from torch import nn
from torch.nn.utils import parametrizations, parametrize
from zennit import composites as zcomposites
from zennit import rules as zrules
from zennit.attribution import Gradient
from zennit.layer import Sum
from zennit.types import Convolution as ZennitConvolution

from tdhook.attribution import (
    LRP,
    AlphaBetaRule,
    BaseRuleMapper,
    EpsilonAlpha2Beta1,
    EpsilonAlpha2Beta1Flat,
    EpsilonGammaBox,
    EpsilonPlus,
    EpsilonPlusFlat,
    GammaRule,
    IgnoreRule,
    UniformEpsilon,
)
from tdhook.attribution.rules._layers import AVG_POOLS
from tests.conftest import relative_error

F64 = torch.float64
SEEDS = range(6)
ACTIVATIONS = {"relu": nn.ReLU, "leaky": lambda: nn.LeakyReLU(0.1), "tanh": nn.Tanh, "silu": nn.SiLU}
CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
CONV_T = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
BATCH_NORM = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
POOLS = {
    "avg": {1: nn.AvgPool1d, 2: nn.AvgPool2d, 3: nn.AvgPool3d},
    "max": {1: nn.MaxPool1d, 2: nn.MaxPool2d, 3: nn.MaxPool3d},
    "adaptive": {1: nn.AdaptiveAvgPool1d, 2: nn.AdaptiveAvgPool2d, 3: nn.AdaptiveAvgPool3d},
}
LAYERS = (nn.Linear, nn.modules.conv._ConvNd)


class Residual(nn.Module):
    """``x + body(x)``; zennit's twin sums with its ``Sum`` module, where its composites put a rule."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body, self.sum, self.as_zennit_sum = body, Sum(), False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.as_zennit_sum:
            return self.sum(torch.stack([x, self.body(x)], -1))
        return x + self.body(x)


def _batch_norm(norm: nn.Module) -> nn.Module:
    with torch.no_grad():
        norm.running_mean.normal_(0, 0.5)
        norm.running_var.uniform_(0.5, 2.0)
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.normal_(0, 0.3)
    return norm


def _convolution(rng: random.Random, dims: int, channels: int, size: int, kind: str) -> nn.Module:
    """A convolution of ``kind`` ``"same"`` (shape-preserving), ``"conv"`` or ``"transposed"``."""
    out = channels if kind == "same" else rng.randint(1, 6)
    groups = rng.choice([g for g in range(1, channels + 1) if channels % g == 0 and out % g == 0])
    bias = rng.random() < 0.7
    if kind == "same":
        kernel = rng.choice([1, 3])
        return CONV[dims](channels, out, kernel, padding=kernel // 2, groups=groups, bias=bias)
    kernel, stride, dilation = rng.randint(1, 3), rng.randint(1, 2), rng.randint(1, 2)
    if kind == "transposed":
        padding = rng.randint(0, dilation * (kernel - 1))
        output_padding = rng.randint(0, max(stride, dilation) - 1)
        return CONV_T[dims](
            channels, out, kernel, stride, padding, output_padding, groups, bias=bias, dilation=dilation
        )
    mode = rng.choice(["zeros", "zeros", "reflect", "replicate", "circular"])
    padding = "same" if stride == 1 and rng.random() < 0.3 else rng.randint(0, min(2, size - 1))
    return CONV[dims](
        channels, out, kernel, stride, padding, dilation, groups, bias=bias, padding_mode=mode
    )  # fmt: skip


def _output_shape(layers: list[nn.Module], x: torch.Tensor) -> torch.Size | None:
    try:
        with torch.no_grad():
            shape = nn.Sequential(*layers).to(F64).eval()(x).shape
    except RuntimeError:
        return None
    return shape if min(shape[2:], default=1) >= 1 else None


def build_model(seed: int, activations: dict = ACTIVATIONS) -> tuple[nn.Module, torch.Tensor]:
    """A random CNN (1, 2 or 3 spatial dimensions) or MLP and an input batch of random size."""
    rng = random.Random(seed)

    def _activation(rng: random.Random) -> nn.Module:
        return activations[rng.choice(sorted(activations))]()

    torch.manual_seed(seed)
    dims = rng.choice([0, 1, 2, 2, 3])
    if dims == 0:
        x = torch.randn(rng.randint(1, 4), rng.randint(1, 7), dtype=F64)
        layers: list[nn.Module] = [nn.Linear(x.shape[1], rng.randint(2, 8))]
    else:
        size = [rng.randint(4, 8 if dims < 3 else 5) for _ in range(dims)]
        x = torch.randn(rng.randint(1, 3), rng.randint(1, 3), *size, dtype=F64).clamp(-3, 3)
        layers = [_convolution(rng, dims, x.shape[1], min(size), rng.choice(["conv", "conv", "transposed"]))]
    blocks = ["batchnorm", "activation", "dropout", "residual", "shared", "parametrized"]
    blocks += ["layer"] if dims == 0 else ["conv", "transposed", "pool", "pool"]
    for _ in range(rng.randint(1, 4)):
        shape = _output_shape(layers, x)
        if shape is None:
            layers.pop()
            continue
        channels, size = shape[1], min(shape[2:], default=0)
        block = rng.choice(blocks)
        if block == "batchnorm" and isinstance(layers[-1], LAYERS):
            layers.append(_batch_norm((nn.BatchNorm1d if dims == 0 else BATCH_NORM[dims])(channels)))
        elif block == "activation":
            layers.append(_activation(rng))
        elif block == "dropout":
            layers.append(nn.Dropout(0.3))
        elif block == "layer":
            layers.append(nn.Linear(channels, rng.randint(2, 8)))
        elif block in ("conv", "transposed"):
            layers.append(_convolution(rng, dims, channels, size, block))
        elif block == "pool" and size >= 2:
            kind = rng.choice(sorted(POOLS))
            pool = POOLS[kind][dims]
            layers.append(pool(size - 1) if kind == "adaptive" else pool(2, ceil_mode=rng.random() < 0.5))
        elif block in ("residual", "shared"):
            same = (lambda: nn.Linear(channels, channels)) if dims == 0 else None
            first = same() if same else _convolution(rng, dims, channels, size, "same")
            if block == "shared":
                layers += [first, _activation(rng), first]
            else:
                second = same() if same else _convolution(rng, dims, channels, size, "same")
                layers.append(Residual(nn.Sequential(first, _activation(rng), second)))
        elif block == "parametrized":
            layer = (
                nn.Linear(channels, rng.randint(2, 8)) if dims == 0 else _convolution(rng, dims, channels, size, "conv")
            )
            layers.append(rng.choice([parametrizations.weight_norm, parametrizations.spectral_norm])(layer))
    shape = _output_shape(layers, x)
    if shape is None:
        layers.pop()
        shape = _output_shape(layers, x)
    if rng.random() < 0.5:
        layers.append(_activation(rng))
    layers += [nn.Flatten(), nn.Linear(shape[1:].numel(), rng.randint(1, 5))]
    model = nn.Sequential(*layers).to(F64).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LAYERS) and module.bias is not None:
                module.bias.normal_(0, 0.3)
        parametrized = [m for m in model.modules() if parametrize.is_parametrized(m)]
        for module in parametrized:
            module.train()
        for _ in range(3 if parametrized else 0):
            model(x)  # spectral_norm's power iterations
        model.eval()
    return model, x


def _merged(layer: nn.Module, norm: nn.Module) -> nn.Module:
    """``layer`` with the eval-mode BatchNorm after it merged into its weight and bias, written out."""
    layer = copy.deepcopy(layer)
    scale = norm.weight / (norm.running_var + norm.eps).sqrt()
    with torch.no_grad():
        weight = layer.weight
        if isinstance(layer, nn.modules.conv._ConvTransposeNd):  # (in, out / groups, *kernel), output channels second
            grouped = weight.view(layer.groups, -1, *weight.shape[1:])
            grouped.mul_(scale.view(layer.groups, 1, weight.shape[1], *[1] * (weight.dim() - 2)))
        else:
            weight.mul_(scale.view(-1, *[1] * (weight.dim() - 1)))
        bias = layer.bias if layer.bias is not None else torch.zeros_like(scale)
        layer.bias = nn.Parameter((bias - norm.running_mean) * scale + norm.bias)
    return layer


def zennit_twin(model: nn.Module) -> nn.Module:
    """The same function in the form zennit's composites explain (see the module's docstring)."""
    twin = copy.deepcopy(model)
    for module in list(twin.modules()):
        if parametrize.is_parametrized(module):  # a plain weight holding the computed one (the class is not shared)
            values = {name: getattr(module, name).detach().clone() for name in module.parametrizations}
            module.__class__ = module.__class__.__bases__[0]
            del module._modules["parametrizations"]
            for name, value in values.items():
                module.register_parameter(name, nn.Parameter(value))
        if isinstance(module, Residual):
            module.as_zennit_sum = True
    for sequence in [m for m in twin.modules() if isinstance(m, nn.Sequential)]:
        children, seen = list(sequence), set()
        for i, child in enumerate(children):
            if id(child) in seen:
                children[i] = copy.deepcopy(child)
            seen.add(id(child))
        for i in range(len(children) - 1):
            if isinstance(children[i], LAYERS) and isinstance(children[i + 1], nn.modules.batchnorm._BatchNorm):
                children[i], children[i + 1] = _merged(children[i], children[i + 1]), nn.Identity()
        for i, child in enumerate(children):
            sequence[i] = child
    return twin


def initial_relevance(out: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(out).scatter_(-1, out.argmax(-1, keepdim=True), 1.0) * out


def zennit_relevance(composite, twin: nn.Module, x: torch.Tensor, layers=()) -> tuple[torch.Tensor, dict]:
    """Input relevance, and the relevance at the outputs of the modules named in ``layers``."""
    with torch.no_grad():
        start = initial_relevance(twin(x))
    modules, inner = dict(twin.named_modules()), {}

    def keep(name: str):
        def hook(module, args, out):
            out.register_hook(lambda grad: inner.__setitem__(name, grad.clone()))  # zennit's relevance there

        return hook

    with Gradient(model=twin, composite=composite) as attributor:
        handles = [modules[name].register_forward_hook(keep(name)) for name in layers]
        try:
            _, relevance = attributor(x.clone(), start)
        finally:
            for handle in handles:
                handle.remove()
    return relevance, inner


def tdhook_relevance(mapper, model: nn.Module, x: torch.Tensor, layers=()) -> TensorDict:
    target = lambda y: initial_relevance(y.detach())  # noqa: E731
    lrp = LRP(model, mapper, in_keys=["x"], out_keys=["y"], target=target, layers=list(layers) or None)
    return lrp(TensorDict(x=x.clone(), batch_size=x.shape[:1]))


def pairs(rng: random.Random, x: torch.Tensor) -> dict:
    """(tdhook mapper, zennit composite) for every preset and modified rule, with random parameters."""
    epsilon = rng.choice([0.0, 1e-6, 1e-3, 0.1, 0.5, 2.0])
    stabilizer = rng.choice([1e-9, 1e-6, 1e-3, 0.1])
    gamma = rng.choice([0.0, 0.1, 0.25, 1.0, 3.0])
    alpha = rng.choice([1.0, 1.5, 2.0, 3.0])
    low, high = float(x.min()) - rng.random(), float(x.max()) + rng.random()
    exact_sum = (Sum, zrules.Norm(0.0))  # tdhook splits a residual sum exactly by default
    options = {"epsilon": epsilon, "stabilizer": stabilizer}
    zoptions = {**options, "layer_map": [exact_sum]}
    base = [exact_sum, *zcomposites.layer_map_base(stabilizer)]

    def on_layers(rule, zrule):
        mapper = BaseRuleMapper(stabilizer=stabilizer, rule_mapper={LAYERS: rule})
        return mapper, zcomposites.LayerMapComposite([*base, ((ZennitConvolution, nn.Linear), zrule)])

    return {
        "EpsilonPlus": (EpsilonPlus(**options), zcomposites.EpsilonPlus(**zoptions)),
        "EpsilonPlusFlat": (EpsilonPlusFlat(**options), zcomposites.EpsilonPlusFlat(**zoptions)),
        "EpsilonAlpha2Beta1": (EpsilonAlpha2Beta1(**options), zcomposites.EpsilonAlpha2Beta1(**zoptions)),
        "EpsilonAlpha2Beta1Flat": (EpsilonAlpha2Beta1Flat(**options), zcomposites.EpsilonAlpha2Beta1Flat(**zoptions)),
        "EpsilonGammaBox": (
            EpsilonGammaBox(low, high, gamma=gamma, **options),
            zcomposites.EpsilonGammaBox(low, high, gamma=gamma, **zoptions),
        ),
        "UniformEpsilon": (
            UniformEpsilon(**options),
            zcomposites.LayerMapComposite([*base, ((ZennitConvolution, nn.Linear), zrules.Epsilon(epsilon))]),
        ),
        "AlphaBeta": on_layers(
            AlphaBetaRule(alpha, alpha - 1, stabilizer=stabilizer),
            zrules.AlphaBeta(alpha, alpha - 1, stabilizer=stabilizer),
        ),
        "Gamma": on_layers(GammaRule(gamma, stabilizer=stabilizer), zrules.Gamma(gamma, stabilizer=stabilizer)),
        "Gamma-without-bias": on_layers(
            GammaRule(gamma, stabilizer=stabilizer, zero_params=["bias"]),
            zrules.Gamma(gamma, stabilizer=stabilizer, zero_params=["bias"]),
        ),
        "ZPlus-without-bias": on_layers(
            AlphaBetaRule(1.0, 0.0, stabilizer=stabilizer, zero_params=["bias"]),
            zrules.ZPlus(stabilizer=stabilizer, zero_params=["bias"]),
        ),
    }


@pytest.mark.parametrize("seed", SEEDS)
def test_every_preset_and_rule_matches_zennit_on_a_random_model(seed: int):
    model, x = build_model(seed)
    twin = zennit_twin(model)
    with torch.no_grad():
        torch.testing.assert_close(twin(x), model(x), rtol=1e-10, atol=1e-12)
    rng = random.Random(seed + 1000)
    for name, (mapper, composite) in sorted(pairs(rng, x).items())[seed % 2 :: 2]:  # each preset on every other seed
        expected, _ = zennit_relevance(composite, twin, x)
        actual = tdhook_relevance(mapper, model, x)["relevance", "x"]
        assert relative_error(actual, expected) <= 1e-6, (name, relative_error(actual, expected))


@pytest.mark.parametrize("seed", range(100, 103))
def test_inner_layers_match_zennit_on_a_random_model(seed: int):
    model, x = build_model(seed)
    twin = zennit_twin(model)
    twin_names = dict(twin.named_modules())
    used = [m for s in model.modules() if isinstance(s, nn.Sequential) for m in s]
    names = [
        name
        for name, module in model.named_modules()
        if name in twin_names and used.count(module) == 1 and not isinstance(module, (nn.Flatten, Sum))
    ]
    rng = random.Random(seed)
    layers = rng.sample(names, min(3, len(names)))
    for name, (mapper, composite) in sorted(pairs(rng, x).items())[seed % 3 :: 3]:
        _, expected = zennit_relevance(composite, twin, x, layers)
        td = tdhook_relevance(mapper, model, x, layers)
        for layer in expected:
            assert relative_error(td["relevance", layer], expected[layer]) <= 1e-6, (name, layer)


@pytest.mark.parametrize("seed", range(200, 204))
def test_lrp0_is_gradient_times_input_on_a_random_piecewise_linear_model(seed: int):
    model, x = build_model(seed, {"relu": nn.ReLU, "leaky": lambda: nn.LeakyReLU(0.1)})
    relevance = tdhook_relevance(BaseRuleMapper(rule_mapper={AVG_POOLS: IgnoreRule()}), model, x)["relevance", "x"]
    leaf = x.clone().requires_grad_(True)
    out = model(leaf)
    (grad,) = torch.autograd.grad(out, leaf, initial_relevance(out.detach()) / out.detach())
    assert relative_error(relevance, x * grad) <= 1e-8


def test_the_models_cover_the_pool():
    """The seeds above build every kind of layer the module's docstring names."""
    kinds = set()
    for seed in [*SEEDS, *range(100, 103), *range(200, 204)]:
        model, x = build_model(seed)
        kinds |= {type(m).__name__.removeprefix("Parametrized") for m in model.modules()}
        kinds |= {f"{type(m).__name__}-{m.padding_mode}" for m in model.modules() if isinstance(m, CONV[2])}
        kinds.add(f"input-{x.dim()}d")
        kinds |= {"parametrized"} if any(parametrize.is_parametrized(m) for m in model.modules()) else set()
        children = [m for s in model.modules() if isinstance(s, nn.Sequential) for m in s]
        kinds |= {"shared"} if len(children) > len({id(m) for m in children}) else set()
    assert {"Linear", "Conv1d", "Conv2d", "Conv3d", "Residual", "parametrized", "shared", "Dropout"} <= kinds
    assert {"input-2d", "input-3d", "input-4d", "input-5d"} <= kinds
    assert {"Conv2d-reflect", "Conv2d-replicate", "Conv2d-circular"} & kinds
    assert kinds & {"ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d"}
    assert kinds & {"BatchNorm1d", "BatchNorm2d", "BatchNorm3d"}
