"""A layer's output that reaches a BatchNorm as another tensor of the same values: the merge does not follow it.

:class:`~tdhook.attribution.rules.batch_norm.MergeBatchNormRule` merges a BatchNorm into the layer whose output it
reads, by that output tensor. Code between them that hands on the same values as a new tensor hides the layer: a
``clone()`` or ``contiguous()`` copy (a ``channels_last`` model), a view of the same shape, ``z + 0``, a forward
hook of the layer that returns a copy, or the activation observer ``prepare_qat`` puts on the layer (its fake
quantisation off). The BatchNorm then gets the ε-rule of its affine map, unmerged, and the relevance differs from the
same model's with the BatchNorm reading the layer's output (13 % under EpsilonPlus, 29 % under EpsilonAlpha2Beta1,
relative L2, for a ``clone()`` between the first convolution and its BatchNorm of a small CNN; 19 % and 42 % for an
unfused ``prepare_qat`` CNN in eval mode with its fake quantisation and observers off). :func:`copied_layer_call`
finds such a layer, and :func:`warn_of_copied_layer_output` says so where the layer's rule is not (near) the plain
gradient (merged or not is then the same relevance). So does it for a layer's output rearranged, its values moved and
none changed (:func:`rearranged_layer_call`: IBN-Net's split of the channels, a flatten before a ``BatchNorm1d``, a
permutation, crop or nearest upsampling), across which a per-channel affine map could be folded into the layer as
well (0.38 to 1.68 off the folded model under the CNN presets).

Examples:
    >>> import torch
    >>> x = torch.randn(2, 3, requires_grad=True)
    >>> copied_layer_call(x * 2) is None  # no layer's output behind it
    True
    >>> warn_of_copied_layer_output(torch.nn.BatchNorm1d(3).eval(), x.clone(), set())  # nor here: nothing said
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tdhook.attribution.rules._caller import warn_at_caller
from tdhook.attribution.rules._layer_nodes import LAYER_CALL
from tdhook.attribution.rules.basic import EpsilonRule, IgnoreRule

__all__ = ["copied_layer_call", "rearranged_layer_call", "warn_of_copied_layer_output"]

# How far back from the BatchNorm's input the walk looks for a layer's output.
_STEPS = 8
# The operations that make a view of their input: the only ones whose output shares the layer output's memory
# without having written into it.
_VIEWS = frozenset({"view", "alias", "unsafeView", "reshapeAlias"})
# An ε up to this (the presets' default on dense layers) is the plain gradient, merged or not.
_NEGLIGIBLE_EPSILON = 1e-6


def warn_of_copied_layer_output(
    norm: nn.Module, tensor: Any, warned: set[int], merges: Callable[[Any], bool] = lambda call: True
) -> None:
    """Warn, once per BatchNorm (``warned``: the ``id`` of those warned of), where the eval-mode BatchNorm ``norm``,
    not merged, reads the output of a layer whose rule would merge it as a tensor of its own (see
    :func:`copied_layer_call`).

    Args:
        norm: the BatchNorm module.
        tensor: its input.
        warned: the ``id`` of the BatchNorms already warned of; ``norm``'s is added.
        merges: whether ``norm`` would merge into a layer's call, read from its output itself.
    """
    if id(norm) in warned or norm.training or getattr(norm, "running_mean", None) is None:
        return
    found = copied_layer_call(tensor)
    rearranged = None if found is not None else rearranged_layer_call(tensor)
    call = (found or rearranged or (None,))[0]
    if call is None:
        return
    rule = call.rule
    if not getattr(rule, "merges_batch_norm", False) or isinstance(rule, IgnoreRule):
        return
    if type(rule) is EpsilonRule and rule.epsilon <= _NEGLIGIBLE_EPSILON:
        return
    kind, layer = type(norm).__name__, type(call.module).__name__
    if rearranged is not None:
        warn_at_caller(
            f"LRP: the {kind} after {layer} ({type(rule).__name__}) is not merged into it: its input holds the "
            f"{layer}'s output rearranged by {', '.join(rearranged[1])} (a split, permutation, flattening, crop or "
            "nearest upsampling, which move values but change none), which the merge does not follow. The "
            f"{kind} gets the ε-rule of its affine map instead, and the relevance differs from that of the same "
            f"model with the {kind} folded into the {layer} (its weight and bias scaled per output channel by "
            f"γ/√(var + ε), the shift added). Fold it in by hand, or give the {kind} the layer's output itself"
        )
        warned.add(id(norm))
        return
    if not merges(call):
        return  # it would not merge into the layer's output either
    operations = found[1]
    warn_at_caller(
        f"LRP: the {kind} after {layer} ({type(rule).__name__}) is not merged into it: its input holds the "
        f"{layer}'s output unchanged, but as a tensor of its own made by {' then '.join(operations)} (a copy, a view "
        "of the same shape, or the output of a forward hook or observer of the layer), which the merge does not "
        f"follow. The {kind} gets the ε-rule of its affine map instead, and the relevance differs from that of the "
        f"same model whose {kind} reads the layer's output. Give the {kind} the layer's output itself, or fold it "
        "into the layer (torch.nn.utils.fusion.fuse_conv_bn_eval, fuse_linear_bn_eval)"
    )
    warned.add(id(norm))  # once the warning is out: a filter that makes it an error raises again next call


def copied_layer_call(tensor: Any) -> tuple[Any, tuple[str, ...]] | None:
    """The ``LayerCall`` of the layer whose output ``tensor`` holds unchanged as a tensor of its own, made from it by
    a chain of single-input operations, and the names of those operations (first to last); else ``None``.

    The values are compared: an operation that changed them (a ReLU, a scale, a quantisation that rounds) is code
    after the layer, whose relevance a BatchNorm after it does not merge into the layer.

    Args:
        tensor: the BatchNorm's input.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.grad_fn is None:
        return None
    node, names = tensor.grad_fn, []
    for _ in range(_STEPS):
        call = node.metadata.get(LAYER_CALL)
        if call is not None:
            break
        edges = [edge for edge, _ in node.next_functions if edge is not None]
        if len(edges) != 1:
            return None  # another tensor takes part: not the layer's output alone
        names.append(_operation(node))
        node = edges[0]
    else:
        return None
    if not names:
        return None  # the layer's output itself, written into in place since
    raw = getattr(call, "raw", None)
    if not isinstance(raw, torch.Tensor) or raw.shape != tensor.shape or raw.dtype != tensor.dtype:
        return None
    if raw.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr() and not _VIEWS.issuperset(names):
        return None  # the layer's output written in place (a hook's output.mul_(2)): its values changed with it
    with torch.no_grad():
        if not torch.equal(raw, tensor.detach()):
            return None
    return call, tuple(reversed(names))


def rearranged_layer_call(tensor: Any) -> tuple[Any, tuple[str, ...]] | None:
    """The ``LayerCall`` of the layer whose output ``tensor`` holds rearranged: made from it alone by operations that
    move values and change none (:data:`_REARRANGING`: views, permutations, splits, slices, nearest upsampling,
    pixel and channel shuffles, concatenations of such pieces), and the names of those operations (sorted); else
    ``None``. A per-channel affine map after such operations is one before them: a BatchNorm there could be folded
    into the layer.

    Examples:
        >>> rearranged_layer_call(torch.randn(2, 3, requires_grad=True).t()) is None  # no layer behind it
        True
    """
    if not isinstance(tensor, torch.Tensor) or tensor.grad_fn is None:
        return None
    calls, names, pending, seen = set(), set(), [tensor.grad_fn], 0
    while pending:
        node = pending.pop()
        seen += 1
        if seen > _REARRANGING_NODES:
            return None
        call = node.metadata.get(LAYER_CALL)
        if call is not None:
            calls.add(call)
            continue
        name = _operation(node)
        if name not in _REARRANGING:
            return None
        names.add(name)
        pending.extend(edge for edge, _ in node.next_functions if edge is not None)
    if len(calls) != 1 or not names:
        return None
    return calls.pop(), tuple(sorted(names))


# The operations that move values and change none (by the name :func:`_operation` gives their nodes).
_REARRANGING = frozenset(
    {
        "view", "unsafeView", "alias", "reshapeAlias", "permute", "transpose", "t", "split", "splitWithSizes",
        "unbind", "slice", "select", "unsqueeze", "squeeze", "clone", "expand", "repeat", "flip", "roll",
        "pixelShuffle", "pixelUnshuffle", "channelShuffle", "nativeChannelShuffle", "upsampleNearest1D",
        "upsampleNearest2D", "upsampleNearest3D", "upsampleNearestExact1D", "upsampleNearestExact2D",
        "upsampleNearestExact3D", "indexSelect", "cat", "stack",
    }
)  # fmt: skip
# How many nodes the walk of :func:`rearranged_layer_call` reads at most.
_REARRANGING_NODES = 32


def _operation(node: Any) -> str:
    """``CloneBackward0`` → ``clone``: the operation an autograd node differentiates."""
    name = type(node).__name__
    stem = name[: name.rfind("Backward")] if "Backward" in name else name
    return stem[:1].lower() + stem[1:]
