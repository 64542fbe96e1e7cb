"""``F.normalize`` and ``F.cosine_similarity`` under the CNN presets: norms held constant, a cosine's product shared.

Embedding networks end in ``F.normalize`` (metric learning, face verification, CLIP-style image towers), and siamese
networks compare two embeddings with ``F.cosine_similarity`` (or ``nn.CosineSimilarity``, whose forward calls it).
Both are invariant to the scale of their inputs, so their plain gradient gives every input relevance summing to
zero (a function of degree 0 has ``⟨∇f(x), x⟩ = 0``), and zennit, which has no rule for a call that is no module,
leaves them so. LRP treats a norm's scale as a constant of the sample, as the norm rules do (see
:class:`~tdhook.attribution.rules.normalization.NormRule`): held, ``x / max(‖x‖, eps)`` is linear in ``x`` and
conserves its relevance. The cosine, each norm held, is ``Σ â · b̂`` over ``dim``, a product of two activations
(bilinear): each input gets half of each element's relevance, as AttnLRP's uniform rule gives it and as
:mod:`~tdhook.attribution.rules._cosine_similarity` computes it under AttnLRP and CP-LRP; where one input is a
constant (a learned prototype, a stored reference embedding), the other gets all of it. A second-order explanation
of the pair (BiLRP) sums, over either input, to the whole score: the first-order relevance here is half of it.

The CNN presets' :class:`~tdhook.attribution.rules.gates.HeldGates` gives these calls the rule
(:func:`held_norm_call`) through :class:`HeldNormCalls`, which keeps each call's value (torch's own) and gives a
call back its plain gradient where what it computed reaches a product of two activations that keeps its plain
gradient (:data:`TWO_FACTOR_CALLS`: a cosine attention's ``normalize(q) @ normalize(k).transpose(-2, -1)``, Swin
V2's). The CNN presets have no rule for such a product, whose plain gradient gives each factor the whole product's
relevance: with the norms held, the product's relevance would be created twice over (Swin V2 gave 2.8 and -18
times its logit); with their plain gradient, a scale-invariant normalisation passes on relevance summing to zero,
as before the held norms.

Examples:
    >>> import torch
    >>> x = torch.randn(2, 3, requires_grad=True)
    >>> h = 2 * x
    >>> y = held_norm_call(F.normalize, (h,), {"dim": 1})
    >>> torch.allclose(y, F.normalize(h, dim=1))
    True
    >>> relevance = x * torch.autograd.grad(y[:, 0].sum(), x)[0]  # the held norm: linear, conserved
    >>> torch.allclose(relevance.sum(1), y[:, 0])
    True
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F

from tdhook.attribution.rules._autograd import (
    call_argument,
    is_activation,
    redirect,
    relevance_pass_edges,
    scale_gradient,
)
from tdhook.attribution.rules._cosine_similarity import COSINE_SIMILARITY, cosine_inputs
from tdhook.attribution.rules._keyword_factors import positional_factors
from tdhook.attribution.rules._written_norms import HeldPlace, held_written_norm
from tdhook.attribution.rules.normalization import NormRule

__all__ = ["NORMALIZING_CALLS", "TWO_FACTOR_CALLS", "HeldNormCalls", "held_norm_call", "normalized_inputs"]

#: the calls :func:`held_norm_call` gives a rule
NORMALIZING_CALLS = frozenset({F.normalize, COSINE_SIMILARITY})

_T = torch.Tensor
#: calls that multiply two of their tensor arguments, or divide one by another: where two are activations, the CNN
#: presets keep their plain gradient, which gives each factor the whole product's relevance
TWO_FACTOR_CALLS = frozenset(
    {torch.mul, torch.multiply, _T.mul, _T.multiply, _T.__mul__, _T.__rmul__, _T.mul_, _T.__imul__, _T.multiply_}
    | {torch.matmul, _T.matmul, _T.__matmul__, _T.__rmatmul__, torch.mm, _T.mm, torch.bmm, _T.bmm, torch.einsum}
    | {torch.mv, _T.mv, torch.dot, _T.dot, torch.vdot, torch.inner, _T.inner, torch.outer, _T.outer, torch.kron}
    | {torch.tensordot, torch.linalg.vecdot, torch.linalg.multi_dot, torch.chain_matmul, F.bilinear}
    | {torch.div, torch.divide, torch.true_divide, _T.div, _T.divide, _T.true_divide, _T.__truediv__}
    | {_T.__rtruediv__, _T.div_, _T.__itruediv__, _T.true_divide_}
    | {F.scaled_dot_product_attention, F.multi_head_attention_forward}
    | {torch.addmm, _T.addmm, torch.baddbmm, _T.baddbmm, torch.addbmm, _T.addbmm, torch.addmv, _T.addmv}
    | {torch.addcmul, _T.addcmul, torch.addcdiv, _T.addcdiv, torch.addr, _T.addr}
    | {F.linear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d}
)
# Where the factors are among the arguments: an added term (``addmm``'s input) and a bias are none.
_FACTORS = dict.fromkeys(
    (torch.addmm, _T.addmm, torch.baddbmm, _T.baddbmm, torch.addbmm, _T.addbmm, torch.addmv, _T.addmv), slice(1, 3)
)
_FACTORS |= dict.fromkeys((torch.addcmul, _T.addcmul, torch.addcdiv, _T.addcdiv, torch.addr, _T.addr), slice(1, 3))
_FACTORS |= dict.fromkeys((F.linear, F.conv1d, F.conv2d, F.conv3d), slice(0, 2))
_FACTORS |= dict.fromkeys((F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d), slice(0, 2))
_NOT_FACTORS = frozenset({"bias", "out"})  # by keyword, a bias, an output: no factor

# The norm rule of ``F.normalize`` (its ε is no part of it: the call's own ``eps`` clamps the norm).
_RULE = NormRule()
_NORMALIZE = NormRule.functions[F.normalize]


def normalized_inputs(func: Callable, args: tuple, kwargs: dict) -> list[object]:
    """What a call of ``func`` (one of :data:`NORMALIZING_CALLS`) normalises: ``F.normalize``'s input, the two
    inputs of ``F.cosine_similarity``; nothing for any other call.

    Examples:
        >>> h = torch.randn(2, 3, requires_grad=True) * 1
        >>> [is_activation(x) for x in normalized_inputs(COSINE_SIMILARITY, (h,), {"x2": torch.ones(3)})]
        [True, False]
    """
    if func is F.normalize:
        inputs = [call_argument(args, kwargs, 0, "input")]
    elif func is COSINE_SIMILARITY:
        inputs = [call_argument(args, kwargs, 0, "x1"), call_argument(args, kwargs, 1, "x2")]
    else:
        return []
    return inputs


def held_norm_call(func: Callable, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """A call of ``F.normalize`` or ``F.cosine_similarity`` with each norm of an activation held constant and a
    cosine's product of two activations shared (half of its relevance to each input); ``None`` where the call
    normalises no activation (it keeps its plain gradient)."""
    if not any(is_activation(x) for x in normalized_inputs(func, args, kwargs)):
        return None
    if func is F.normalize:
        return _held_normalize(
            call_argument(args, kwargs, 0, "input"),
            call_argument(args, kwargs, 1, "p", 2.0),
            call_argument(args, kwargs, 2, "dim", 1),
            call_argument(args, kwargs, 3, "eps", 1e-12),
            call_argument(args, kwargs, 4, "out"),
        )
    x1, x2 = call_argument(args, kwargs, 0, "x1"), call_argument(args, kwargs, 1, "x2")
    dim, eps = call_argument(args, kwargs, 2, "dim", 1), call_argument(args, kwargs, 3, "eps", 1e-8)
    factors = []
    for given, x in zip((x1, x2), cosine_inputs(x1, x2), strict=True):
        # An input that is a constant (a prototype) stays one: its norm is no statistic of the sample.
        factors.append(_held_normalize(x, 2.0, dim, eps) if is_activation(given) else F.normalize(x, 2.0, dim, eps))
    if is_activation(x1) and is_activation(x2):  # a product of two activations: the uniform rule
        factors = [scale_gradient(factor, 0.5) for factor in factors]
    return (factors[0] * factors[1]).sum(dim)


def _held_normalize(x: torch.Tensor, p: float, dim: int, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``F.normalize(x, p, dim, eps, out)`` with the norm rule's gradient: ``x`` over its norm held constant."""
    return _NORMALIZE(_RULE, None, F.normalize(x, p, dim, eps, out), (x, p, dim, eps), {})


class _Switch:
    """Whether a call whose norms are held takes its plain gradient after all: read in the backward pass, after the
    forward pass has seen every product its output reaches."""

    __slots__ = ("plain",)

    def __init__(self) -> None:
        self.plain = False

    def route(self, grad: torch.Tensor) -> list[torch.Tensor | None]:
        """The gradient to the held call's output, or to the plain call's."""
        return [None, grad] if self.plain else [grad, None]

    def release(self) -> None:
        """Route the gradient to the plain call's output."""
        self.plain = True


class HeldNormCalls:
    """The ``F.normalize`` and ``F.cosine_similarity`` calls of one forward pass whose norms are held, each given
    back its plain gradient where what it computed reaches a product of two activations (see the module's
    docstring).

    Examples:
        >>> x = torch.randn(2, 3, requires_grad=True)
        >>> calls = HeldNormCalls()
        >>> q = calls.call(F.normalize, (x * 1,), {"dim": 1})
        >>> len(calls.held_nodes())
        1
        >>> calls.release_reached(torch.matmul, (q, q.T), {})  # a cosine attention's product: the plain gradient
        >>> len(calls.held_nodes())
        0
    """

    def __init__(self) -> None:
        self._switches: dict[Any, _Switch | HeldPlace] = {}  # by the autograd node of each call's output
        self._statistics: list[torch.Tensor] = []  # the statistics of the norms written out that are held
        self.held = 0  # how many of them hold their norms still (none: no product to look at)
        self._seen: set = set()  # the nodes walked from products: what they reach has been given back already

    def call(self, func: Callable, args: tuple, kwargs: dict) -> torch.Tensor:
        """``func(*args, **kwargs)`` (one of :data:`NORMALIZING_CALLS`, of an activation), its value torch's own,
        its gradient that of :func:`held_norm_call` unless :meth:`release_reached` gives it back."""
        plain = func(*args, **kwargs)
        held = held_norm_call(func, args, kwargs)
        switch = _Switch()
        result = redirect(plain, [held.to(plain.dtype), plain], switch.route)
        self._switches[result.grad_fn] = switch
        self.held += 1
        return result

    def written(self, func: Callable, args: tuple, kwargs: dict, place: int) -> torch.Tensor:
        """``func(*args, **kwargs)``, a norm written out (``h / h.norm(...)``, ``h * rsqrt(...)``) whose statistic
        ``args[place]`` is held constant as :meth:`call` holds ``F.normalize``'s norm (see
        :mod:`~tdhook.attribution.rules._written_norms`), unless :meth:`release_reached` gives it back.

        Examples:
            >>> calls = HeldNormCalls()
            >>> h = torch.randn(2, 3, requires_grad=True) * 1
            >>> n = h.norm(dim=1, keepdim=True)
            >>> y = calls.written(torch.Tensor.__truediv__, (h, n), {}, 1)
            >>> len(calls.held_nodes()), calls.holds_statistic((h, n))
            (1, True)
        """
        result, held = held_written_norm(func, args, kwargs, place)
        if held is not None:
            self._switches[held.node] = held
            self._statistics.append(args[place])
            self.held += 1
        return result

    def holds_statistic(self, args: tuple) -> bool:
        """Whether a tensor among ``args`` is the statistic of a norm written out that :meth:`written` held (the
        coverage watch asks after the call, which may have written into its other argument in place)."""
        return any(x is statistic for x in args for statistic in self._statistics)

    def held_nodes(self) -> list:
        """The autograd nodes of the calls that hold their norms still."""
        return [node for node, switch in self._switches.items() if not switch.plain]

    def gave_back(self, node: Any) -> bool:
        """Whether the call whose output's autograd node is ``node`` held its norms, then was given back its plain
        gradient by :meth:`release_reached` (the coverage report names it)."""
        switch = self._switches.get(node)
        return switch is not None and switch.plain

    def release_reached(self, func: Callable, args: tuple, kwargs: dict) -> None:
        """Give the plain gradient back to every held call that a factor of ``func`` (one of
        :data:`TWO_FACTOR_CALLS`, keeping its plain gradient) is computed from, where two of its factors are
        activations."""
        if not self.held or func not in TWO_FACTOR_CALLS:
            return
        args, kwargs = positional_factors(func, args, kwargs)  # ``torch.matmul(input=a, other=b)``: by position
        factors = [x for x in _tensors(args[_FACTORS.get(func, slice(None))]) if is_activation(x)]
        factors += [x for k, x in kwargs.items() if k not in _NOT_FACTORS and is_activation(x)]
        if len(factors) >= 2:
            self.release_from(factors)

    def release_from(self, values: Iterable) -> None:
        """Give the plain gradient back to every held call that an activation among ``values`` (or in a list or
        tuple among them) is computed from.

        Examples:
            >>> calls = HeldNormCalls()
            >>> q = calls.call(F.normalize, (torch.randn(2, 3, requires_grad=True) * 1,), {"dim": 1})
            >>> calls.release_from([q + 1])
            >>> calls.held
            0
        """
        stack = [x.grad_fn for x in _tensors(values) if is_activation(x)]
        while stack and self.held:
            node = stack.pop()
            if node is None or node in self._seen:
                continue
            self._seen.add(node)
            switch = self._switches.get(node)
            if switch is not None and not switch.plain:
                switch.release()
                self.held -= 1
            stack.extend(relevance_pass_edges(node))


def _tensors(values: Iterable) -> list[torch.Tensor]:
    """The tensors among ``values``, and in the lists and tuples among them (``torch.einsum(eq, [a, b])``)."""
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found += [v for v in value if isinstance(v, torch.Tensor)]
    return found
