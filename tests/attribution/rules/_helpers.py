"""What the rule tests share: layers in float64, random output relevance, the rule pairs (tdhook, zennit), a spy."""

from __future__ import annotations

import torch
from torch import nn
from zennit import rules as zrules

from tdhook.attribution.mappers.presets import EpsilonAlpha2Beta1, EpsilonGammaBox, EpsilonPlus, EpsilonPlusFlat
from tdhook.attribution.rules.basic import EpsilonRule
from tdhook.attribution.rules.input_layer import FlatRule, WSquareRule, ZBoxRule
from tdhook.attribution.rules.modified import AlphaBetaRule, GammaRule

TOL = 1e-6
F64 = torch.float64


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=F64)


def make_layer(kind: str) -> tuple[nn.Module, torch.Tensor]:
    layers = {
        "linear": (nn.Linear(6, 5), (4, 6)),
        "conv1d": (nn.Conv1d(3, 4, 3, padding=1), (2, 3, 9)),
        "conv2d": (nn.Conv2d(3, 4, 3, stride=2, padding=1), (2, 3, 7, 7)),
        "conv3d": (nn.Conv3d(2, 3, 3, padding=1), (2, 2, 4, 4, 4)),
        "convtranspose1d": (nn.ConvTranspose1d(3, 4, 3, stride=2, padding=1), (2, 3, 6)),
        "convtranspose2d": (nn.ConvTranspose2d(3, 2, 3, stride=2), (2, 3, 4, 4)),
        "convtranspose3d": (nn.ConvTranspose3d(2, 3, 3, stride=2, padding=1), (2, 2, 3, 3, 3)),
    }
    layer, shape = layers[kind]
    layer = layer.double()
    with torch.no_grad():
        layer.bias.normal_()
    return layer, torch.randn(shape, dtype=torch.float64)


def output_relevance(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.randn_like(layer(x))


LAYERS = ["linear", "conv1d", "conv2d", "conv3d", "convtranspose1d", "convtranspose2d", "convtranspose3d"]

RULE_PAIRS = {
    "epsilon": (lambda: EpsilonRule(1e-6), lambda: zrules.Epsilon(1e-6)),
    "epsilon-large": (lambda: EpsilonRule(0.5), lambda: zrules.Epsilon(0.5)),
    "zplus": (lambda: AlphaBetaRule(1.0, 0.0), lambda: zrules.ZPlus()),
    "alpha2beta1": (lambda: AlphaBetaRule(2.0, 1.0), lambda: zrules.AlphaBeta(2.0, 1.0)),
    "alpha1beta0": (lambda: AlphaBetaRule(1.0, 0.0), lambda: zrules.AlphaBeta(1.0, 0.0)),
    "gamma": (lambda: GammaRule(0.25), lambda: zrules.Gamma(0.25)),
    "gamma-nobias": (lambda: GammaRule(1.0, zero_params=["bias"]), lambda: zrules.Gamma(1.0, zero_params=["bias"])),
    "flat": (lambda: FlatRule(), lambda: zrules.Flat()),
    "wsquare": (lambda: WSquareRule(), lambda: zrules.WSquare()),
    "zbox": (lambda: ZBoxRule(-2.5, 2.5), lambda: zrules.ZBox(-2.5, 2.5)),
}

# The CNN presets, each a factory of keyword options (ZBox bounds: inputs inside [-3, 3]).
CNN_PRESETS = {
    "EpsilonPlus": lambda **options: EpsilonPlus(**options),
    "EpsilonPlusFlat": lambda **options: EpsilonPlusFlat(**options),
    "EpsilonGammaBox": lambda **options: EpsilonGammaBox(-3.0, 3.0, **options),
    "EpsilonAlpha2Beta1": lambda **options: EpsilonAlpha2Beta1(**options),
}


def spy(monkeypatch, cls: type, name: str) -> list:
    """Record the calls of ``cls.name`` (it still runs)."""
    calls, method = [], getattr(cls, name)

    def recorded(*args, **kwargs):
        calls.append(args)
        return method(*args, **kwargs)

    monkeypatch.setattr(cls, name, recorded)
    return calls
