"""``F.scaled_dot_product_attention`` under the transformer rules, fused where they allow it, unfused else.

:class:`~tdhook.attribution.rules.functional.FunctionalRules` gives a fused attention the rules of the unfused
``softmax(q · kᵀ) · v``: under AttnLRP, the uniform rule on both products as factors of the gradients the fused
call passes to the query, key and value (:func:`attention`); under CP-LRP, the query and the key held (the weights
a constant). With a non-zero softmax ε, or in a call that keeps the relevance's graph (the fused kernels have no
second derivative), it is computed unfused in the mode (:func:`unfused_attention`). A recording call puts the
factors on the fused call's own nodes where it can (:func:`attention_in_graph`), as a later call without the mode
does.

The ``mode`` these functions take is the ``FunctionalRules`` the call runs in: its ``softmax`` rule decides.

Examples:
    >>> q, k, v = (torch.randn(1, 2, 3, 4, requires_grad=True) * 1 for _ in range(3))
    >>> _attention_factors(q, k, v)  # a quarter to the query and the key, a half to the value
    (0.25, 0.25, 0.5)
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tdhook.attribution.rules._autograd import (
    PARAMETER_DERIVED,
    call_argument,
    hold,
    is_activation,
    redirect,
    scale_gradient,
)
from tdhook.attribution.rules._constant_elements import CONSTANT_MASKS_MADE, repeated_constants
from tdhook.attribution.rules._constant_matmuls import shows_constants
from tdhook.attribution.rules._dropout_calls import warn_random_dropout
from tdhook.attribution.rules._keeping_graph import graph_kept
from tdhook.attribution.rules.transformer import AHQKVRule

if TYPE_CHECKING:
    from tdhook.attribution._function_rule_plan import Recording

__all__ = ["LARGEST_GRAPH_HOLD", "attention", "attention_in_graph", "held_in_graph", "unfused_attention"]

# Attention weights of up to this many elements are held without a detach in a call that records its rules' places
# (later calls then run without the mode); larger ones are detached, and every call runs in the mode: a plain call
# computes their gradient and then drops it, which on one CPU thread costs what the mode saves at about 32k elements
# (a Llama of 2 layers, 2 × 64 tokens, 4 heads) and more beyond.
LARGEST_GRAPH_HOLD = 2**14


def attention(
    mode: TorchFunctionMode, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs
):
    """``F.scaled_dot_product_attention`` of the arguments, fused, with the rules' factors on the gradients it passes
    (unfused where ``mode``'s softmax has an ε or the call keeps the relevance's graph); a warning where it drops."""
    fused = F.scaled_dot_product_attention
    warn_random_dropout(dropout_p)
    # A mask computed from activations (a position bias conditioned on the hidden states) is a summand of the
    # scores, as the query-key product is: CP-LRP holds it, AttnLRP passes it the weights' share of the output.
    mask_activation = is_activation(attn_mask)
    if isinstance(mode.softmax, AHQKVRule) and graph_kept() is None:
        query, key = hold(query), hold(key)
        if mask_activation:  # held; still asking for a gradient, so that torch picks the plain call's kernel
            attn_mask = hold(attn_mask).requires_grad_()
        return fused(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, **kwargs)
    # (The fused kernels have no second derivative; a key or a value holding constants beside an activation, a cache
    # joined onto detached past keys, takes the matrix products' rules per element, see _constant_matmuls.)
    if mode.softmax.epsilon != 0 or graph_kept() is not None or (CONSTANT_MASKS_MADE and shows_constants(key, value)):
        return unfused_attention(mode, query, key, value, attn_mask, dropout_p, is_causal, scale, **kwargs)
    qk, _, v = _attention_factors(query, key, value, attn_mask)
    query, key, value = scale_gradient(query, qk), scale_gradient(key, qk), scale_gradient(value, v)
    attn_mask = scale_gradient(attn_mask, v) if mask_activation else attn_mask  # the weights' share, as v's
    return fused(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, **kwargs)


def attention_in_graph(mode: TorchFunctionMode, args: tuple, kwargs: dict, recording: Recording) -> torch.Tensor | None:
    """A fused attention in a recording call, as a plain call computes it, with the rules' factors on the
    gradients its node passes to the query, key and value (see :func:`attention`); ``None`` where the
    call needs more (dropout, an ε or a kept graph: the unfused rules) or its node is not the fused call's."""
    query, key, value = (call_argument(args, kwargs, i, name) for i, name in enumerate(("query", "key", "value")))
    if is_activation(call_argument(args, kwargs, 3, "attn_mask")):
        return None  # a mask computed from activations takes a rule too: the mode's (see attention)
    if isinstance(mode.softmax, AHQKVRule) and (not value.requires_grad or id(value) in recording.held_alone):
        # Held query and key, and values made of held tensors alone: a constant, as a detached call's output.
        recording.other_rule()
        output = attention(mode, *args, **kwargs)
        if output.requires_grad:
            setattr(output, PARAMETER_DERIVED, True)
            recording.made_of_held(output, alone=True)
        return output
    if call_argument(args, kwargs, 4, "dropout_p", 0.0) or graph_kept() is not None or mode.softmax.epsilon:
        return None
    if CONSTANT_MASKS_MADE and not isinstance(mode.softmax, AHQKVRule) and shows_constants(key, value):
        return None  # (the unfused rules, see attention)
    if isinstance(mode.softmax, AHQKVRule):  # held weights: no gradient to the query and the key
        weights = query.shape[:-1].numel() * key.shape[-2]
        if weights > LARGEST_GRAPH_HOLD:
            return None
        factors = (0.0, 0.0, None)
    else:
        factors = _attention_factors(query, key, value)
    output = F.scaled_dot_product_attention(*args, **kwargs)
    if recording.scaled_inputs(output, (query, key, value), factors, (0, 1, 2)):
        return output
    # Computed by several nodes (torch's math path: a mask that requires grad, as a learned position bias):
    # the factors on the nodes that take the query, key and value.
    places = _taking_nodes(output, (query, key, value), call_argument(args, kwargs, 3, "attn_mask"))
    if places is None:
        return None
    scaled = [
        (node, place, tensor, factor)
        for (node, place), tensor, factor in zip(places, (query, key, value), factors, strict=True)
    ]
    return output if recording.scaled_at(scaled) else None


def unfused_attention(
    mode: TorchFunctionMode, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa=False
):
    """The attention computed unfused (``softmax(q · kᵀ · scale) · v``) in ``mode``, whose rules its products and
    softmax get; its value the fused call's, bit for bit, where the call keeps no graph."""
    if dropout_p:
        raise ValueError("LRP: attention dropout must be off (call the model in eval mode)")
    plain = None
    if graph_kept() is None:  # the fused call's values, bit for bit; the unfused rules give the gradient
        with torch.no_grad():
            plain = F.scaled_dot_product_attention(
                query, key, value, attn_mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa
            )
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeats = query.shape[-3] // key.shape[-3]
        key, value = (repeated_constants(t, repeats, -3) for t in (key, value))
    with mode:
        scores = query @ key.transpose(-2, -1) * (1 / math.sqrt(query.shape[-1]) if scale is None else scale)
        length, source = query.shape[-2], key.shape[-2]
        if is_causal:
            keep = torch.ones(length, source, dtype=torch.bool, device=query.device).tril()
            scores = scores.masked_fill(~keep, float("-inf"))
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                scores = scores.masked_fill(~attn_mask, float("-inf"))
            else:
                scores = scores + attn_mask
        # A query that sees no key (left padding) gets zeros, as from the fused kernels: its softmax is NaN.
        unseen = torch.isneginf(scores.detach()).all(-1, keepdim=True)
        out = torch.softmax(scores, dim=-1).masked_fill(unseen, 0.0) @ value
    return out if plain is None or not out.requires_grad else redirect(plain, [out], lambda grad: [grad])


# The most nodes a fused attention computed by several nodes may take (torch's math path takes about twenty).
_MOST_ATTENTION_NODES = 64


def _taking_nodes(output: torch.Tensor, inputs: tuple, mask: object) -> list[tuple[object, int]] | None:
    """For each of ``inputs``, the one node of ``output``'s graph that takes it and its place there, walking from
    ``output``'s node down to the inputs and ``mask``; ``None`` where an input is taken by none or by more than one
    node, or where the walk goes past ``_MOST_ATTENTION_NODES`` nodes (not an attention computed from these alone).

    Examples:
        >>> q, k, v, bias = (torch.randn(1, 2, 3, 4, requires_grad=True) * 1 for _ in range(4))
        >>> out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[..., :3])
        >>> [type(node).__name__ for node, _ in _taking_nodes(out, (q, k, v), bias[..., :3])]
        ['MulBackward1', 'TransposeBackward0', 'ExpandBackward0']
    """
    edges = {(t.grad_fn, t.output_nr): i for i, t in enumerate(inputs) if t.grad_fn is not None}
    if len(edges) != len(inputs):
        return None
    stops = set(edges)
    if isinstance(mask, torch.Tensor) and mask.grad_fn is not None:
        stops.add((mask.grad_fn, mask.output_nr))
    found: list[list[tuple[object, int]]] = [[] for _ in inputs]
    queue, seen = [output.grad_fn], set()
    while queue:
        node = queue.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if len(seen) > _MOST_ATTENTION_NODES:
            return None
        for place, edge in enumerate(node.next_functions):
            if edge in edges:
                found[edges[edge]].append((node, place))
            elif edge not in stops:
                queue.append(edge[0])
    return [places[0] for places in found] if all(len(places) == 1 for places in found) else None


def _attention_factors(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: object = None
) -> tuple[float, float, float]:
    """The uniform rule on ``q · kᵀ`` and on ``attention · v`` as factors of a fused attention's gradients to the
    query, key and value: a half for each product of two activations the gradient passes through. The weights are
    an activation where the query, the key or the mask (a position bias computed from activations) is one; the
    mask, a summand of the scores, takes the value's factor (the weights' half of ``attention · v``).

    Examples:
        >>> q, k, v, bias = (torch.randn(1, 2, 3, 4, requires_grad=True) * 1 for _ in range(4))
        >>> _attention_factors(q, k, v), _attention_factors(q.detach(), k.detach(), v, bias[..., :3])
        ((0.25, 0.25, 0.5), (0.5, 0.5, 0.5))
        >>> _attention_factors(q, k[..., :1, :], v[..., :1, :])  # one key: weights of 1, a constant
        (0.5, 0.5, 1.0)
    """
    scores_product = is_activation(query) and is_activation(key)
    # Over one key the weights are the constant 1 (a softmax over one element): the value takes all of the output's.
    weights_activation = key.shape[-2] != 1 and (is_activation(query) or is_activation(key) or is_activation(attn_mask))
    value_product = weights_activation and is_activation(value)
    qk = (0.5 if scores_product else 1.0) * (0.5 if value_product else 1.0)
    return qk, qk, 0.5 if value_product else 1.0


def held_in_graph(weights: torch.Tensor) -> bool:
    """Whether a recording call holds CP-LRP's attention ``weights`` without a detach, so that later calls may run
    without the mode (see :mod:`~tdhook.attribution._function_rule_plan`): up to ``LARGEST_GRAPH_HOLD`` elements."""
    return weights.grad_fn is not None and weights.numel() <= LARGEST_GRAPH_HOLD
