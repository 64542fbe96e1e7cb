"""Moved: the transformer rules live in :mod:`tdhook.attribution.rules.transformer`, the presets in
:mod:`tdhook.attribution.mappers.transformer`; this path re-exports them."""

from tdhook.attribution.mappers.transformer import CPLRP, AttnLRP
from tdhook.attribution.rules._autograd import scale_gradient
from tdhook.attribution.rules.transformer import (
    AHQKVRule,
    LayerNormRule,
    PseudoIdentityRule,
    SoftmaxEpsilonRule,
    uniform_product,
)

__all__ = [
    "SoftmaxEpsilonRule",
    "LayerNormRule",
    "PseudoIdentityRule",
    "AHQKVRule",
    "uniform_product",
    "scale_gradient",
    "AttnLRP",
    "CPLRP",
]
