"""Modules that draw anew at every forward pass in training mode (dropout, and stochastic depth: timm's ``DropPath``
and ``DropBlock2d``, torchvision's ``StochasticDepth``; timm's ``PatchDropout`` of tokens; ``nn.RReLU``, whose
negative slopes are drawn per element; ``nn.MultiheadAttention`` and ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` of
several layers with a dropout probability of their own), or in any mode (``nn.FractionalMaxPool2d`` and ``3d``, whose
pooling regions are drawn at every call unless fixed by ``_random_samples``): an explanation of such a model is random
from call to call, and the user is told once. A torchrl ``ConsistentDropoutModule`` whose mask the call's TensorDict
holds drops the same units at every call: it draws nothing, and is no reason to warn.

Examples:
    >>> import warnings
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     remaining = warn_for_random_modules("LRP", random_modules(dict(net.named_modules())))
    >>> remaining, "module '1' (Dropout, p=0.5) is in training mode" in str(caught[0].message)
    ([], True)
"""

from __future__ import annotations

from collections.abc import Mapping

from tensordict import TensorDictBase
from tensordict.utils import NestedKey
from torch import nn
from torchrl.modules import ConsistentDropoutModule

from tdhook.attribution.rules._caller import warn_at_caller

__all__ = [
    "deterministic",
    "draw",
    "draws_anew",
    "draws_now",
    "drop_probability",
    "in_mode",
    "random_modules",
    "warn_for_random_modules",
]

# Stochastic depth of timm and torchvision, and timm's dropout of tokens (not dependencies of tdhook), by class name
# (and by its end, for the models that prefix their own: SwinDropPath): the attribute holding the probability of a drop.
_STOCHASTIC_DEPTH = {"DropBlock2d": "drop_prob", "StochasticDepth": "p", "PatchDropout": "prob"}
_STOCHASTIC_DEPTH_SUFFIX = ("DropPath", "drop_prob")
# Poolings that draw their regions at every forward pass, in eval mode too.
_RANDOM_REGIONS = (nn.FractionalMaxPool2d, nn.FractionalMaxPool3d)


def drop_probability(module: nn.Module) -> float:
    """The probability that ``module`` drops a unit, a sample's branch or a block in training mode: a dropout's
    ``p``, stochastic depth's; ``0`` for any other module.

    Examples:
        >>> drop_probability(nn.Dropout(0.25)), drop_probability(nn.Linear(2, 2))
        (0.25, 0.0)
    """
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return module.p
    name = type(module).__name__
    attribute = _STOCHASTIC_DEPTH.get(name)
    if attribute is None and name.endswith(_STOCHASTIC_DEPTH_SUFFIX[0]):
        attribute = _STOCHASTIC_DEPTH_SUFFIX[1]
    probability = getattr(module, attribute, None) if attribute is not None else None
    return float(probability) if isinstance(probability, (int, float)) else 0.0


def draw(module: nn.Module | None) -> str | None:
    """What ``module`` draws at every forward pass in training mode (in any mode where :func:`draws_now` says so), for
    a message (``"p=0.5"`` for a dropout or stochastic depth, the range of an ``nn.RReLU``'s negative slopes, a
    fractional max pooling's regions, the dropout an ``nn.MultiheadAttention`` or a recurrent layer of several layers
    applies with a probability of its own); ``None`` where it draws nothing.

    Examples:
        >>> draw(nn.Dropout(0.25)), draw(nn.RReLU(0.1, 0.3)), draw(nn.RReLU(0.2, 0.2)), draw(nn.ReLU())
        ('p=0.25', 'negative slopes drawn from [0.1, 0.3]', None, None)
        >>> draw(nn.FractionalMaxPool2d(2, output_size=3))
        'pooling regions drawn at random'
        >>> draw(nn.MultiheadAttention(4, 2, dropout=0.1)), draw(nn.LSTM(2, 3, num_layers=2, dropout=0.2))
        ('attention dropout p=0.1', 'dropout p=0.2 between layers')
    """
    if isinstance(module, _RANDOM_REGIONS):  # regions given in _random_samples are fixed
        return "pooling regions drawn at random" if module._random_samples is None else None
    if isinstance(module, nn.MultiheadAttention):  # a probability of its own, no Dropout module
        return f"attention dropout p={module.dropout}" if module.dropout > 0 else None
    if isinstance(module, nn.RNNBase):  # dropout on the outputs of each layer but the last
        return f"dropout p={module.dropout} between layers" if module.dropout > 0 and module.num_layers > 1 else None
    if isinstance(module, nn.RReLU):  # lower == upper draws one value only: a fixed LeakyReLU
        return f"negative slopes drawn from [{module.lower}, {module.upper}]" if module.lower != module.upper else None
    probability = drop_probability(module)
    return f"p={probability}" if probability > 0 else None


def draws_now(module: nn.Module) -> bool:
    """Whether ``module`` draws anew at its next forward pass: one that draws (see :func:`draw`) in training mode,
    or in any mode for a fractional max pooling.

    Examples:
        >>> draws_now(nn.Dropout(0.5).eval()), draws_now(nn.FractionalMaxPool2d(2, output_size=3).eval())
        (False, True)
    """
    # The mode first: a model in eval mode, checked at every call of a context, builds no message.
    return (module.training or isinstance(module, _RANDOM_REGIONS)) and draw(module) is not None


def random_modules(modules: Mapping[str, nn.Module]) -> list[tuple[str, nn.Module, NestedKey | None]]:
    """The modules among ``modules`` that draw in training mode (see :func:`draw`: a dropout or stochastic depth
    that drops anything, ``p > 0``; an ``nn.RReLU``), by name, each with the key its mask is read from where a
    torchrl ``ConsistentDropoutModule`` runs it (``None`` for the others)."""
    masks = {id(m.consistent_dropout): m.in_keys[1] for m in modules.values() if isinstance(m, ConsistentDropoutModule)}
    return [(n, m, masks.get(id(m))) for n, m in modules.items() if draw(m) is not None]


def warn_for_random_modules(who: str, candidates: list[tuple], tensordict: TensorDictBase | None = None) -> list[tuple]:
    """Warn if one of ``candidates`` draws now (see :func:`draws_now`; no mask of its own in ``tensordict``); the
    candidates left to watch (none once warned)."""
    for name, module, mask in candidates:
        given = mask is not None and tensordict is not None and tensordict.get(mask, None) is not None
        if draws_now(module) and not given:
            if mask is not None:  # a torchrl ConsistentDropoutModule: it draws only where no mask is given
                warn_at_caller(
                    f"{who}: module {name!r} ({type(module).__name__}, {draw(module)}) {in_mode(module)} and the "
                    f"TensorDict holds no mask at {mask!r}, so the call draws one and the explanation is random "
                    "from call to call; pass the mask its rollout stored at that key for the units it dropped, or "
                    "call .eval() on the model for a deterministic one"
                )
                return []
            warn_at_caller(
                f"{who}: module {name!r} ({type(module).__name__}, {draw(module)}) {in_mode(module)}, so each "
                f"forward pass {draws_anew(module)} and the explanation is random from call to call; "
                f"{deterministic(module)}"
            )
            return []
    return candidates


def in_mode(module: nn.Module) -> str:
    """When ``module`` draws, for a message: ``"is in training mode"``, or ``"draws in eval mode too"``.

    Examples:
        >>> in_mode(nn.Dropout()), in_mode(nn.FractionalMaxPool3d(2, output_ratio=0.5))
        ('is in training mode', 'draws in eval mode too')
    """
    return "draws in eval mode too" if isinstance(module, _RANDOM_REGIONS) else "is in training mode"


def draws_anew(module: nn.Module) -> str:
    """What each forward pass of ``module`` does when it draws, for a message.

    Examples:
        >>> draws_anew(nn.Dropout()), draws_anew(nn.FractionalMaxPool2d(2, output_size=3))
        ('drops other units', 'draws other pooling regions')
    """
    if isinstance(module, _RANDOM_REGIONS):
        return "draws other pooling regions"
    return "draws other negative slopes" if isinstance(module, nn.RReLU) else "drops other units"


def deterministic(module: nn.Module) -> str:
    """How to make ``module`` draw nothing, for a message.

    Examples:
        >>> deterministic(nn.Dropout())
        'call .eval() on the model for a deterministic one'
    """
    if isinstance(module, _RANDOM_REGIONS):
        return (
            "fix its regions with _random_samples (a tensor of shape (batch, channels, dims) in [0, 1)), or use "
            "nn.MaxPool or nn.AdaptiveMaxPool"
        )
    return "call .eval() on the model for a deterministic one"
