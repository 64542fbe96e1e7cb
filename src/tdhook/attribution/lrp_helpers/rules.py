"""LRP rules, rule mappers and presets.

Every rule changes the gradient that flows backward through one module, so that
the relevance of any tensor ``a`` is ``a * grad(a)`` (DESIGN §1). With ``z`` the
module's output and ``R = z * grad(z)`` its relevance, each rule's docstring
gives the relevance ``R_i`` it assigns to the module's input ``x``.

A rule is registered on a module with :meth:`Rule.register`, which returns a
:class:`RemovableRuleHandle`. Registration adds forward hooks only: parameters
are never written, and the modified parameters a rule needs are computed once,
when it is registered.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

import torch
import torch.nn.functional as F
from tensordict.nn.utils import biased_softplus
from torch import nn
from torch.func import functional_call
from torchrl.modules.models.utils import SquashDims

from tdhook.attribution.lrp_helpers.input_gradients import (
    direct_input_gradient,
    direct_input_gradients,
    has_direct_input_gradient,
)
from tdhook.attribution.lrp_helpers.redirect import backward_keeps_graph, is_batched_gradient, redirect, relevance_proxy

__all__ = [
    "stabilize",
    "ParamModifier",
    "RemovableRuleHandle",
    "Registration",
    "Rule",
    "LayerCall",
    "MergedLayer",
    "EpsilonRule",
    "UniformEpsilonRule",
    "PassRule",
    "IgnoreRule",
    "StopRule",
    "UniformRule",
    "AlphaBetaRule",
    "GammaRule",
    "FlatRule",
    "WSquareRule",
    "ZBoxRule",
    "FirstLayerRule",
    "MergeBatchNormRule",
    "RuleMapper",
    "rule_mapper_from_dict",
    "BaseRuleMapper",
    "EpsilonPlus",
    "EpsilonPlusFlat",
    "EpsilonAlpha2Beta1",
    "EpsilonAlpha2Beta1Flat",
    "EpsilonGammaBox",
    "raise_for_unconserved_rel_factory",
    "SoftmaxEpsilonRule",
    "LayerNormRule",
    "PseudoIdentityRule",
    "AHQKVRule",
    "AttnLRP",
    "CPLRP",
]


def stabilize(tensor: torch.Tensor, epsilon: float = 1e-6) -> torch.Tensor:
    """Shift ``tensor`` away from zero by ``epsilon``, keeping its sign (zero counts as positive).

    ``stabilize(z) = z + epsilon * sign(z)`` with ``sign(0) = 1``, so that dividing
    by the result is safe.

    Examples:
        >>> stabilize(torch.tensor([-1.0, 0.0, 2.0]), epsilon=0.5)
        tensor([-1.5000,  0.5000,  2.5000])
    """
    return _signed_shift(tensor, epsilon).add_(tensor)


# Elements per piece of :func:`_pieces`: 4 MiB in float32. Much larger temporaries would be fresh
# memory from the operating system on every call (page faults cost as much as the arithmetic).
_PIECE = 1 << 20


def _pieces(*tensors: torch.Tensor, sample: torch.Tensor | None = None) -> Iterator[tuple[torch.Tensor, ...]]:
    """Aligned pieces of same-shape ``tensors``, each with a scratch piece, for element-wise work in cache.

    ``sample`` (one sample, batch size 1) is repeated along the batch dimension. Tensors that are not all
    contiguous and of one shape come as one piece.

    Examples:
        >>> a, b = torch.arange(6.0).view(2, 3), torch.ones(2, 3)
        >>> for a_piece, b_piece, scratch in _pieces(a, b):
        ...     _ = a_piece.add_(torch.mul(b_piece, 2, out=scratch))
        >>> a
        tensor([[2., 3., 4.],
                [5., 6., 7.]])
    """
    first = tensors[0]
    aligned = first.numel() > 0 and all(t.shape == first.shape and t.is_contiguous() for t in tensors)
    if sample is not None:
        aligned = (
            aligned and first.dim() > 0 and sample.is_contiguous() and sample.numel() * len(first) == first.numel()
        )
    if not aligned:
        whole = tensors if sample is None else (*tensors, sample.expand_as(first))
        yield (*whole, torch.empty_like(first))
        return
    rows = [t.view(1 if sample is None else len(t), -1) for t in tensors]
    scratch = first.new_empty(min(_PIECE, rows[0].shape[1]))
    repeated = [] if sample is None else [sample.view(-1).split(_PIECE)]
    for row in zip(*rows, strict=True):
        for piece in zip(*(r.split(_PIECE) for r in row), *repeated, strict=True):
            yield (*piece, scratch[: piece[0].numel()])


def _in_pieces_(tensor: torch.Tensor, update_: Callable[[torch.Tensor], object]) -> torch.Tensor:
    """Apply the element-wise in-place ``update_`` to ``tensor`` piece by piece, so its temporaries stay small."""
    for piece, _ in _pieces(tensor):
        update_(piece)
    return tensor


def _has_negative(x: torch.Tensor) -> bool:
    """Whether ``x`` has a negative entry: one read-only pass (no boolean tensor)."""
    return x.numel() > 0 and bool(x.amin() < 0)


def _nonzero_where_negative(grad: torch.Tensor, z: torch.Tensor) -> bool:
    """Whether ``grad`` is non-zero (or NaN) anywhere ``z < 0``; piece by piece, stopping at the first such piece."""
    return z.numel() > 0 and any(_nonzero(torch.clamp(z_, max=0, out=s).mul_(g)) for g, z_, s in _pieces(grad, z))


def _nonzero(tensor: torch.Tensor) -> bool:
    """Whether a non-empty ``tensor`` has an entry that is not zero (NaN counts): one reduction, five times faster
    than ``any()``, which converts to booleans first."""
    low, high = torch.aminmax(tensor)
    return not bool((low == 0) & (high == 0))


def _is_plain_gradient(grad: torch.Tensor, z: torch.Tensor) -> bool:
    """Whether ``grad`` is one gradient of ``z`` (same shape and dtype, not a batch of gradients as in vectorized
    Jacobians): the element-wise work of the direct paths, which writes with ``out=``, needs that."""
    return grad.dtype == z.dtype and grad.shape == z.shape and not is_batched_gradient(grad)


def _may_overwrite(grad: torch.Tensor, saved: torch.Tensor) -> bool:
    """Whether the backward pass computing with ``grad`` may write into ``saved``: ``grad`` is a plain gradient
    and the pass frees the graph, so ``saved`` is not read again."""
    return _is_plain_gradient(grad, saved) and not backward_keeps_graph()


def _times_saved(grad: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:
    """``grad * saved``, written into ``saved`` when :func:`_may_overwrite` allows it."""
    return saved.mul_(grad) if _may_overwrite(grad, saved) else grad * saved


def _signed_shift(tensor: torch.Tensor, epsilon: float) -> torch.Tensor:
    # ±epsilon as sign(sign(t) + 0.5)·epsilon: +1 for t ≥ 0 (−0.0 included), −1 for t < 0, NaN for NaN; in the
    # tensor's dtype (no float32 rounding of epsilon). Twice as fast as a comparison and a conversion, and several
    # times faster than torch.where on CPU.
    return torch.sign(tensor).add_(0.5).sign_().mul_(epsilon)


# ----------------------------------------------------------------------------- parameters


def _identity_modifier(name: str, param: torch.Tensor) -> torch.Tensor:
    return param


class ParamModifier:
    """A modification of a module's own parameters, applied without touching them.

    Args:
        modify_fn: ``(name, param) -> tensor``, the modified value of a selected parameter.
            Defaults to the identity.
        select_fn: ``(name, param) -> bool``, which parameters to modify. Defaults to
            :meth:`select_all`.

    Examples:
        >>> lin = nn.Linear(2, 1)
        >>> positive = ParamModifier(lambda name, p: p.clamp(min=0))
        >>> original, modified = positive.state_dicts(lin)
        >>> sorted(modified), bool((modified["weight"] >= 0).all())
        (['bias', 'weight'], True)
        >>> with positive(lin):
        ...     bool((lin.weight >= 0).all())
        True
        >>> lin.weight is original["weight"]
        True
    """

    def __init__(
        self,
        modify_fn: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
        select_fn: Callable[[str, torch.Tensor], bool] | None = None,
    ) -> None:
        self.modify_fn = modify_fn or _identity_modifier
        self.select_fn = select_fn or self.select_all

    @staticmethod
    def select_all(name: str, param: torch.Tensor) -> bool:
        """Select every parameter."""
        return True

    @classmethod
    def from_modifiers(cls, modifiers: Sequence[ParamModifier]) -> ParamModifier:
        """Chain modifiers: each applies, in order, to the parameters it selects.

        Examples:
            >>> zero_bias = ParamModifier(lambda n, p: torch.zeros_like(p), lambda n, p: n == "bias")
            >>> ones = ParamModifier(lambda n, p: torch.ones_like(p))
            >>> flat = ParamModifier.from_modifiers([ones, zero_bias])
            >>> _, modified = flat.state_dicts(nn.Linear(2, 1))
            >>> modified["weight"].tolist(), modified["bias"].tolist()
            ([[1.0, 1.0]], [0.0])
        """
        modifiers = list(modifiers)

        def select_fn(name: str, param: torch.Tensor) -> bool:
            return any(m.select_fn(name, param) for m in modifiers)

        def modify_fn(name: str, param: torch.Tensor) -> torch.Tensor:
            for m in modifiers:
                if m.select_fn(name, param):
                    param = m.modify_fn(name, param)
            return param

        return cls(modify_fn, select_fn)

    def modify(self, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The selected entries of ``params``, modified (for example a layer merged with its BatchNorm).

        Examples:
            >>> ParamModifier(lambda n, p: 2 * p).modify({"weight": torch.ones(1)})
            {'weight': tensor([2.])}
        """
        with torch.no_grad():
            return {n: self.modify_fn(n, p.detach()) for n, p in params.items() if self.select_fn(n, p)}

    def state_dicts(self, module: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The selected parameters of ``module`` (not of its children), as they are and as modified."""
        original = {n: p for n, p in module.named_parameters(recurse=False) if self.select_fn(n, p)}
        return original, self.modify(original)

    @contextmanager
    def __call__(self, module: nn.Module) -> Iterator[nn.Module]:
        """Swap in the modified parameters for the ``with`` block; restore the originals after it."""
        original, modified = self.state_dicts(module)
        try:
            for name, value in modified.items():
                module._parameters[name] = value
            yield module
        finally:
            for name, value in original.items():
                module._parameters[name] = value


_ZERO_BIAS = ParamModifier(lambda n, p: torch.zeros_like(p), lambda n, p: n == "bias")


def _zeroing(names: Sequence[str]) -> ParamModifier:
    names = tuple(names)
    return ParamModifier(lambda n, p: torch.zeros_like(p), lambda n, p: n in names)


_TRANSPOSED = {
    nn.ConvTranspose1d: F.conv_transpose1d,
    nn.ConvTranspose2d: F.conv_transpose2d,
    nn.ConvTranspose3d: F.conv_transpose3d,
}


def _forward_with(module: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor, busy: list) -> torch.Tensor:
    """Run ``module`` on ``x`` with ``params`` in place of its own parameters."""
    weight = params.get("weight", getattr(module, "weight", None))
    bias = params.get("bias", getattr(module, "bias", None))
    if type(module) is nn.Linear:
        return F.linear(x, weight, bias)
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return module._conv_forward(x, weight, bias)
    if type(module) in _TRANSPOSED:
        m = module
        return _TRANSPOSED[type(m)](x, weight, bias, m.stride, m.padding, m.output_padding, m.groups, m.dilation)
    busy.append(True)  # the rule's own hook must not run on this inner call
    try:
        return functional_call(module, params, (x,))
    finally:
        busy.pop()


# ----------------------------------------------------------------------------- rule base


@dataclass
class Registration:
    """What a rule keeps for one module it is registered on."""

    state: Any
    hooks: list = field(default_factory=list)
    snapshots: list = field(default_factory=list)
    records: list = field(default_factory=list)
    busy: list = field(default_factory=list)
    merged_by_norm: bool = False  # a BatchNorm took over the module's last call (see MergeBatchNormRule)


@dataclass(eq=False)
class LayerCall:
    """One call of a Linear or convolution layer, attached to the tensor its rule returned.

    A BatchNorm that reads this tensor merges itself into the layer (see
    :class:`MergeBatchNormRule`). ``observers`` are called with the merged
    layer's output when that happens, so that checks and inner-layer relevance
    see the output of the merged layer.
    """

    module: nn.Module
    rule: Rule
    registration: Registration
    x: torch.Tensor
    raw: torch.Tensor
    version: int
    observers: list = field(default_factory=list)


@dataclass(eq=False)
class MergedLayer:
    """A Linear or convolution layer with the following BatchNorm folded in.

    ``params`` holds ``weight`` and ``bias`` of the merged layer, ``channel_scale``
    the BatchNorm's ``γ / sqrt(var + eps)`` per channel, and ``cache`` whatever a
    rule derives from them (computed once per context).
    """

    params: dict[str, torch.Tensor]
    channel_scale: torch.Tensor
    cache: dict = field(default_factory=dict)


_LAYER_CALL = "_tdhook_layer_call"
_LAYER_MARK = "tdhook_layer"


def layer_call_of(tensor: Any) -> LayerCall | None:
    """The :class:`LayerCall` that produced ``tensor``, if it is still unmodified."""
    call = getattr(tensor, _LAYER_CALL, None)
    if call is None or call.version != tensor._version:
        return None
    return call


class RemovableRuleHandle:
    """Undo one :meth:`Rule.register`. Holds the module by weak reference.

    Examples:
        >>> lin = nn.Linear(2, 2)
        >>> with EpsilonRule().register(lin):
        ...     len(lin._forward_hooks)
        1
        >>> len(lin._forward_hooks)
        0
    """

    def __init__(self, rule: Rule, module: nn.Module) -> None:
        self.rule = rule
        self._module_ref = weakref.ref(module)

    @property
    def module(self) -> nn.Module | None:
        """The module, or ``None`` once it has been garbage collected."""
        return self._module_ref()

    def _records(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        module = self.module
        registration = self.rule._registrations.get(module) if module is not None else None
        return registration.records if registration is not None else []

    @property
    def records(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Relevance not carried by the gradient so far, as ``(module input, relevance)`` pairs."""
        return list(self._records())

    def pop_records(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Relevance not carried by the gradient, as ``(module input, relevance)`` pairs, since the last pop."""
        records = self._records()
        popped = list(records)
        records.clear()
        return popped

    def remove(self) -> None:
        """Remove the rule's hooks from the module."""
        module = self.module
        if module is not None:
            self.rule.unregister(module)

    def __enter__(self) -> RemovableRuleHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()


class Rule:
    """Base class of the LRP rules.

    A rule rewrites a module's output into a tensor of the same value whose
    gradient is the rule's. Subclasses implement :meth:`rewrite` and, when they
    need modified parameters, :meth:`prepare` (called once per registration).
    """

    #: whether :meth:`rewrite` reads the module's input (in-place modules then keep a copy of it).
    uses_input: bool = True
    #: whether :meth:`rewrite_merged` is implemented (a following BatchNorm can be merged).
    merges_batch_norm: bool = False

    def __init__(self) -> None:
        self._registrations: weakref.WeakKeyDictionary[nn.Module, Registration] = weakref.WeakKeyDictionary()

    def __getstate__(self) -> dict:
        if len(self._registrations):
            raise RuntimeError(
                f"{type(self).__name__} is registered on {len(self._registrations)} module(s); copy or pickle it "
                "outside the LRP context"
            )
        return {k: v for k, v in self.__dict__.items() if k != "_registrations"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._registrations = weakref.WeakKeyDictionary()

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"

    def prepare(self, module: nn.Module) -> Any:
        """Per-module state computed once at registration (for example modified parameters)."""
        return None

    def rewrite(
        self, module: nn.Module, registration: Registration, inputs: tuple, output: torch.Tensor
    ) -> torch.Tensor | None:
        """Return the module's output with the rule's gradient, or ``None`` to keep it.

        ``registration.state`` holds what :meth:`prepare` returned, and relevance the
        gradient cannot carry goes to ``registration.records``.
        """
        raise NotImplementedError

    def rewrite_merged(self, call: LayerCall, output: torch.Tensor, merged: MergedLayer) -> torch.Tensor | None:
        """Like :meth:`rewrite`, for ``call.module`` merged with the BatchNorm whose output is ``output``.

        The returned tensor replaces the BatchNorm's output. Implemented by the
        rules with ``merges_batch_norm = True``.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot be merged with a BatchNorm")

    def resolve(self, module: nn.Module, registration: Registration, inputs: tuple) -> tuple[Rule, Registration]:
        """The rule that handles this call (a rule that delegates returns another)."""
        return self, registration

    def register(self, module: nn.Module) -> RemovableRuleHandle:
        """Attach the rule to ``module``; the returned handle removes it."""
        if module in self._registrations:
            raise ValueError(f"{self!r} is already registered on this {type(module).__name__}")
        registration = self._new_registration(module)
        if self.uses_input and getattr(module, "inplace", False):
            registration.hooks.append(module.register_forward_pre_hook(self._snapshot_hook(registration)))
        registration.hooks.append(module.register_forward_hook(self._forward_hook(registration)))
        self._registrations[module] = registration
        return RemovableRuleHandle(self, module)

    def _new_registration(self, module: nn.Module) -> Registration:
        # A lazy module (LazyConv2d, LazyLinear) is prepared at its first call, once its shapes are known.
        return Registration(_UNPREPARED if _has_uninitialized_parameters(module) else self.prepare(module))

    def is_registered(self, module: nn.Module) -> bool:
        """Whether the rule has hooks on ``module``."""
        registration = self._registrations.get(module)
        return registration is not None and bool(registration.hooks)

    def unregister(self, module: nn.Module) -> None:
        """Detach the rule from ``module`` (no-op when it is not attached)."""
        registration = self._registrations.pop(module, None)
        if registration is not None:
            for hook in registration.hooks:
                hook.remove()

    @staticmethod
    def _snapshot_hook(registration: Registration) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            if torch.is_grad_enabled() and args and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
                registration.snapshots.append((args[0].clone(), *args[1:]))

        return hook

    def _forward_hook(self, registration: Registration) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            inputs = registration.snapshots.pop() if registration.snapshots else args
            if registration.busy or not torch.is_grad_enabled():
                return None
            if not isinstance(output, torch.Tensor) or not output.requires_grad:
                return None
            if registration.state is _UNPREPARED:
                registration.state = self.prepare(module)
            rule, reg = self.resolve(module, registration, inputs)
            result = rule.rewrite(module, reg, inputs, output)
            if isinstance(module, _LINEAR_LAYERS) and len(inputs) == 1 and isinstance(inputs[0], torch.Tensor):
                _mark(result if result is not None else output, LayerCall(module, rule, reg, inputs[0], output, 0))
            return result

        return hook


def _has_uninitialized_parameters(module: nn.Module) -> bool:
    return any(nn.parameter.is_lazy(p) for p in module.parameters(recurse=False))


def _mark(tensor: torch.Tensor, call: LayerCall) -> None:
    """Attach ``call`` to the layer's output and mark its autograd node as a layer boundary."""
    call.version = tensor._version
    setattr(tensor, _LAYER_CALL, call)
    if tensor.grad_fn is not None:
        tensor.grad_fn.metadata[_LAYER_MARK] = True


def _reaches_model_input(x: torch.Tensor) -> bool:
    """Whether ``x`` depends on a non-parameter leaf without passing through a Linear or convolution layer."""
    if x.grad_fn is None:
        return x.requires_grad and not isinstance(x, nn.Parameter)
    stack, seen = [x.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node.metadata.get(_LAYER_MARK, False):
            continue
        variable = getattr(node, "variable", None)
        if variable is not None:
            if not isinstance(variable, nn.Parameter):
                return True
            continue
        stack.extend(fn for fn, _ in node.next_functions)
    return False


def _single_input(rule: Rule, module: nn.Module, inputs: tuple) -> torch.Tensor:
    if len(inputs) != 1 or not isinstance(inputs[0], torch.Tensor):
        raise ValueError(
            f"{type(rule).__name__} expects one tensor input on {type(module).__name__}, got {len(inputs)} arguments"
        )
    return inputs[0]


# ----------------------------------------------------------------------------- rules


class IgnoreRule(Rule):
    """The plain gradient: ``R_i = x_i * (∂z/∂x)^T (R / z)`` for linear ``z`` (LRP-0).

    For MaxPool, Dropout, Flatten, Identity and other modules whose gradient
    already routes relevance, it registers nothing. On Linear and convolution
    layers it registers a hook that changes nothing but lets a following
    BatchNorm merge into the layer (the merged pair is then differentiated as it is).

    Examples:
        >>> pool = nn.MaxPool1d(2)
        >>> with IgnoreRule().register(pool):
        ...     len(pool._forward_hooks)
        0
    """

    uses_input = False
    merges_batch_norm = True

    def register(self, module: nn.Module) -> RemovableRuleHandle:
        if isinstance(module, _LINEAR_LAYERS):
            return super().register(module)
        return RemovableRuleHandle(self, module)

    def rewrite(self, module, registration, inputs, output):
        return None

    def rewrite_merged(self, call, output, merged):
        return None


class StopRule(Rule):
    """No relevance flows back through the module: ``R_i = 0``.

    Examples:
        >>> x = torch.ones(1, 2, requires_grad=True)
        >>> lin = nn.Linear(2, 2)
        >>> with StopRule().register(lin):
        ...     lin(x).requires_grad
        False
    """

    uses_input = False

    def rewrite(self, module, registration, inputs, output):
        return output.detach()


class EpsilonRule(Rule):
    """LRP-ε: ``R_i = x_i * Σ_j (∂z_j/∂x_i) R_j / stabilize(z_j, ε)``.

    The output gradient is rescaled by ``z / stabilize(z, ε)`` and the module's
    ordinary backward does the rest: no second forward pass. ``ε = 0`` is
    LRP-0, which equals gradient × input. With ``ε`` as a pure stabilizer this
    is zennit's ``Norm`` (used for average pooling).

    Args:
        epsilon: the stabilizer added to ``z`` with its sign.

    Examples:
        >>> lin = nn.Linear(3, 2)
        >>> x = torch.randn(4, 3, requires_grad=True)
        >>> with EpsilonRule(epsilon=0.0).register(lin):
        ...     relevance = x * torch.autograd.grad(lin(x)[:, 0].sum(), x)[0]
        >>> torch.allclose(relevance, x * lin.weight[0])
        True
    """

    uses_input = False
    merges_batch_norm = True

    def __init__(self, epsilon: float = 1e-6) -> None:
        super().__init__()
        self.epsilon = epsilon

    def _scale(self, output: torch.Tensor, n_inputs: int) -> torch.Tensor:
        z = output.detach()
        if self.epsilon == 0:
            scale = (z != 0).to(z.dtype)
        else:
            # z / stabilize(z, ε) is |z| / (|z| + ε) exactly (a sign flip is exact), in three passes.
            scale = _in_pieces_(z.abs(), lambda piece: piece.div_(piece + self.epsilon))
        return scale if n_inputs == 1 else scale.div_(n_inputs)

    def rewrite(self, module, registration, inputs, output):
        scale = self._scale(output, 1)
        return redirect(output, [output], lambda grad: [_times_saved(grad, scale)])

    def rewrite_merged(self, call, output, merged):
        # The merged layer's weights are the layer's times the channel scale: the
        # gradient at the layer's own output is the merged one times that scale.
        channel = _bias_view(call.module, merged.channel_scale)
        scale = self._scale(output, 1).mul_(channel)
        return redirect(output, [call.raw], lambda grad: [_times_saved(grad, scale)])


class UniformEpsilonRule(EpsilonRule):
    """LRP-ε shared evenly among the ``n`` tensor inputs of a multi-input module.

    ``R_i^(k) = x_i^(k) * Σ_j (∂z_j/∂x_i^(k)) R_j / (n * stabilize(z_j, ε))``. For an
    element-wise product ``z = a * b`` each factor gets ``R / 2``.

    Examples:
        >>> class Mul(nn.Module):
        ...     def forward(self, a, b):
        ...         return a * b
        >>> mul, a, b = Mul(), torch.tensor([2.0], requires_grad=True), torch.tensor([3.0], requires_grad=True)
        >>> with UniformEpsilonRule(epsilon=0.0).register(mul):
        ...     ga, gb = torch.autograd.grad(mul(a, b), (a, b))
        >>> (a * ga).item(), (b * gb).item()
        (3.0, 3.0)
    """

    def rewrite(self, module, registration, inputs, output):
        n_inputs = sum(isinstance(i, torch.Tensor) and i.requires_grad for i in inputs)
        scale = self._scale(output, max(n_inputs, 1))
        return redirect(output, [output], lambda grad: [_times_saved(grad, scale)])


class PassRule(Rule):
    """Relevance passes unchanged through an element-wise module: ``R_i = R_i(out)``.

    For activations and un-merged normalisation. The input gradient is
    ``grad(z) * z / stabilize(x)``. On ``nn.ReLU`` this equals the plain
    gradient, so nothing is registered there.

    Examples:
        >>> x = torch.tensor([-1.0, 0.5, 2.0], requires_grad=True)
        >>> act = nn.Tanh()
        >>> with PassRule().register(act):
        ...     z = act(x)
        ...     relevance = x * torch.autograd.grad(z, x, torch.ones(3))[0]
        >>> torch.allclose(relevance, z)
        True
    """

    def __init__(self, stabilizer: float = 1e-12) -> None:
        super().__init__()
        self.stabilizer = stabilizer

    def register(self, module: nn.Module) -> RemovableRuleHandle:
        if type(module) is nn.ReLU:
            return RemovableRuleHandle(self, module)
        return super().register(module)

    def rewrite(self, module, registration, inputs, output):
        x = _single_input(self, module, inputs)
        if x.shape != output.shape:
            raise ValueError(
                f"PassRule needs an element-wise module; {type(module).__name__} maps {tuple(x.shape)} "
                f"to {tuple(output.shape)}"
            )
        return self.apply(output, x) if x.requires_grad else None

    def apply(self, output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``output = f(x)`` for an element-wise ``f``, with the rule's gradient."""
        if not x.requires_grad or x.shape != output.shape:
            return output
        scale = output.detach() / stabilize(x.detach(), self.stabilizer)
        return redirect(output, [x], lambda grad: [grad * scale])


class UniformRule(Rule):
    """Relevance split evenly among the ``n`` inputs of a module: ``R^(k) = R / n``.

    Every input must have the output's shape. The relevance is set directly (it
    is not proportional to the input), so zero-valued inputs keep theirs.

    Examples:
        >>> class Add(nn.Module):
        ...     def forward(self, a, b):
        ...         return a + b
        >>> add, a, b = Add(), torch.tensor([1.0], requires_grad=True), torch.tensor([3.0], requires_grad=True)
        >>> with UniformRule().register(add):
        ...     ga, gb = torch.autograd.grad(add(a, b), (a, b))
        >>> (a * ga).item(), (b * gb).item()
        (2.0, 2.0)
    """

    def rewrite(self, module, registration, inputs, output):
        tensors = [i for i in inputs if isinstance(i, torch.Tensor) and i.requires_grad]
        for t in tensors:
            if t.shape != output.shape:
                raise ValueError(
                    f"UniformRule needs inputs shaped like the output {tuple(output.shape)} on "
                    f"{type(module).__name__}, got {tuple(t.shape)}"
                )
        if not tensors:
            return None
        share = output.detach() / len(tensors)
        stand_ins = []
        for t in tensors:
            (ones,) = relevance_proxy(
                t,
                [torch.ones_like(share)],
                lambda grads: grads[0],
                lambda rest, t=t: registration.records.append((t, rest)),
            )
            stand_ins.append(ones)
        # d(share * ones)/d(ones) = share, so each proxy receives R / n as its gradient.
        return redirect(output, stand_ins, lambda grad: [grad * share] * len(stand_ins))


class _ModifiedForwardRule(Rule):
    """Rules that route relevance through forward passes with modified parameters.

    The modified passes run in the backward pass, only when relevance reaches
    the layer: a layer whose relevance is taken over by a merged BatchNorm, or
    that lies off the explained path, costs nothing but a copy of its output.
    """

    merges_batch_norm = True

    def __init__(self, stabilizer: float = 1e-6, zero_params: Sequence[str] = ()) -> None:
        super().__init__()
        self.stabilizer = stabilizer
        self.zero_params = tuple(zero_params)

    def modifiers(self) -> dict[str, ParamModifier]:
        raise NotImplementedError

    def modified_params(self, params: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """The modified parameter sets of the rule, by name, built from ``params``."""
        zero = _zeroing(self.zero_params)
        modified = {key: ParamModifier.from_modifiers([zero, m]).modify(params) for key, m in self.modifiers().items()}
        modified["plain"] = dict(params)  # the layer's own (or BatchNorm-merged) weight and bias
        return modified

    def prepare(self, module: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
        if not isinstance(getattr(module, "weight", None), torch.Tensor):
            raise ValueError(f"{type(self).__name__} needs a module with a weight; {type(module).__name__} has none")
        return self.modified_params(dict(module.named_parameters(recurse=False)))

    def input_gradient(
        self,
        module: nn.Module,
        registration: Registration,
        params: dict[str, dict[str, torch.Tensor]],
        x: torch.Tensor,
        z: torch.Tensor,
        grad: torch.Tensor,
    ) -> torch.Tensor:
        """The gradient the rule sends to the layer input ``x``, given the output ``z`` and its gradient."""
        raise NotImplementedError

    def rewrite(self, module, registration, inputs, output):
        x = _single_input(self, module, inputs)
        if not x.requires_grad:
            return None
        # When a BatchNorm took over the last call, it most likely takes over this one: this redirect is then
        # never used, and the output is not copied (if it is used after all, z is copied or recomputed then).
        copy_output = not registration.merged_by_norm
        return self._redirect_lazily(module, registration, registration.state, x, output, copy_output)

    def rewrite_merged(self, call, output, merged):
        call.registration.merged_by_norm = True
        params = merged.cache.get(self)
        if params is None:
            params = merged.cache[self] = self.modified_params(merged.params)
        return self._redirect_lazily(call.module, call.registration, params, call.x, output)

    def _redirect_lazily(self, module, registration, params, x, output, copy_output=True):
        version = x._version
        if copy_output:
            z = output.detach().clone()  # later in-place operations (ReLU(inplace=True)) must not change it
        else:
            z, z_version = output.detach(), output._version

        def backward(grad: torch.Tensor) -> list[torch.Tensor]:
            if x._version != version:
                raise RuntimeError(
                    f"{type(self).__name__} on {type(module).__name__}: the layer's input was modified in place "
                    "after the layer ran; make that operation out of place"
                )
            z_now = z
            if not copy_output:  # a copy the rule may write into; the output itself, if it is unchanged
                with torch.no_grad():
                    z_now = (
                        z.clone()
                        if z._version == z_version
                        else self._forward(module, registration, params["plain"], x)
                    )
            with torch.enable_grad():
                return [self.input_gradient(module, registration, params, x, z_now, grad)]

        return redirect(output, [x], backward)

    @staticmethod
    def _forward(module, registration, params, x):
        return _forward_with(module, params, x, registration.busy)

    def _signed_forward(self, module, registration, params, x, pairs: Sequence[tuple[str, str]]) -> list[torch.Tensor]:
        """For each ``(key⁺, key⁻)``: the forward of ``x⁺`` with params ``key⁺`` plus ``x⁻`` with ``key⁻``.

        The ``x⁻`` pass is skipped when ``x`` has no negative entry (after a ReLU): it would add exact zeros.
        """
        has_neg = _has_negative(x)
        x_pos = x.clamp(min=0) if has_neg else x
        x_neg = x.clamp(max=0) if has_neg else None
        outputs = []
        for pos_key, neg_key in pairs:
            out = self._forward(module, registration, params[pos_key], x_pos)
            if has_neg:
                out = out + self._forward(module, registration, params[neg_key], x_neg)
            outputs.append(out)
        return outputs


def _bias_view(module: nn.Module, bias: torch.Tensor) -> torch.Tensor:
    """``bias`` shaped to broadcast over the output ``z``: its last dimension (Linear) or the channel dimension."""
    return bias if type(module) is nn.Linear else bias.view(-1, *([1] * len(module.kernel_size)))


def _clamp(min: float | None = None, max: float | None = None) -> ParamModifier:
    return ParamModifier(lambda n, p: p.clamp(min=min, max=max))


class AlphaBetaRule(_ModifiedForwardRule):
    """LRP-αβ: positive and negative contributions weighted by ``α`` and ``β`` (``α - β = 1``).

    With ``x⁺ = max(x, 0)``, ``x⁻ = min(x, 0)``, ``w⁺``, ``w⁻`` likewise:
    ``z⁺ = w⁺x⁺ + b⁺ + w⁻x⁻`` and ``z⁻ = w⁻x⁺ + b⁻ + w⁺x⁻``;
    ``R_i = α (x⁺_i w⁺_ij + x⁻_i w⁻_ij) R_j / stabilize(z⁺_j) - β (x⁺_i w⁻_ij + x⁻_i w⁺_ij) R_j / stabilize(z⁻_j)``.
    ``α = 1, β = 0`` is z⁺ (zennit's ``ZPlus``, captum's ``Alpha1_Beta0_Rule``).

    Examples:
        >>> AlphaBetaRule(alpha=1.0, beta=0.0)
        AlphaBetaRule(stabilizer=1e-06, zero_params=(), alpha=1.0, beta=0.0)
        >>> AlphaBetaRule(alpha=2.0, beta=2.0)
        Traceback (most recent call last):
        ...
        ValueError: AlphaBetaRule needs alpha - beta == 1 and both non-negative, got alpha=2.0, beta=2.0
    """

    def __init__(
        self, alpha: float = 2.0, beta: float = 1.0, stabilizer: float = 1e-6, zero_params: Sequence[str] = ()
    ) -> None:
        if alpha < 0 or beta < 0 or alpha - beta != 1:
            raise ValueError(
                f"AlphaBetaRule needs alpha - beta == 1 and both non-negative, got alpha={alpha}, beta={beta}"
            )
        super().__init__(stabilizer, zero_params)
        self.alpha = alpha
        self.beta = beta

    def modifiers(self):
        positive, negative = _clamp(min=0.0), _clamp(max=0.0)
        mods = {"pos": positive, "neg_nobias": ParamModifier.from_modifiers([negative, _ZERO_BIAS])}
        if self.beta:
            mods["neg"] = negative
            mods["pos_nobias"] = ParamModifier.from_modifiers([positive, _ZERO_BIAS])
        return mods

    def input_gradient(self, module, registration, params, x, z, grad):
        if not self.beta and has_direct_input_gradient(module) and not _has_negative(x):
            return self._z_plus_of_nonnegative_input(module, registration, params["pos"], x.detach(), z, grad)
        leaf = x.detach().requires_grad_(True)
        pairs = [("pos", "neg_nobias"), ("neg", "pos_nobias")] if self.beta else [("pos", "neg_nobias")]
        modified = self._signed_forward(module, registration, params, leaf, pairs)
        factors = (self.alpha, -self.beta)
        grads = [f * grad * z / stabilize(m.detach(), self.stabilizer) for f, m in zip(factors, modified, strict=False)]
        return torch.autograd.grad(modified, leaf, grads)[0]

    def _z_plus_of_nonnegative_input(self, module, registration, positive, x, z, grad):
        """z⁺ (α = 1, β = 0) for ``x ≥ 0``: the same gradient with fewer passes over the output.

        ``z⁺ = w⁺x + b⁺ ≥ 0``, so ``stabilize(z⁺)`` is ``z⁺ + ε`` exactly, and ``W⁺ᵀ`` is applied directly,
        with no autograd graph behind the modified forward pass.
        """
        with torch.no_grad():
            share = self._forward(module, registration, positive, x)
            if not _is_plain_gradient(grad, z):
                share = grad * z / share.add_(self.stabilizer)
            else:
                for d, z_, g, scratch in _pieces(share, z, grad):
                    torch.div(torch.mul(g, z_, out=scratch), d.add_(self.stabilizer), out=d)  # α = 1
            return direct_input_gradient(module, positive["weight"], share, x)


class GammaRule(_ModifiedForwardRule):
    """LRP-γ, generalised to signed inputs and outputs (zennit's ``Gamma``).

    With ``w^γ⁺ = w + γ w⁺`` and ``w^γ⁻ = w + γ w⁻`` (biases alike):
    ``z^↑ = w^γ⁺ x⁺ + b^γ⁺ + w^γ⁻ x⁻`` serves outputs ``z > 0`` and
    ``z^↓ = w^γ⁻ x⁺ + b^γ⁻ + w^γ⁺ x⁻`` serves ``z < 0``;
    ``R_i = Σ_j [z_j>0] (x⁺_i w^γ⁺_ij + x⁻_i w^γ⁻_ij) R_j / stabilize(z^↑_j)
    + [z_j<0] (x⁺_i w^γ⁻_ij + x⁻_i w^γ⁺_ij) R_j / stabilize(z^↓_j)``.
    ``zero_params=("bias",)`` gives captum's ``GammaRule(set_bias_to_zero=True)``.

    Examples:
        >>> GammaRule(gamma=0.5).gamma
        0.5
    """

    def __init__(self, gamma: float = 0.25, stabilizer: float = 1e-6, zero_params: Sequence[str] = ()) -> None:
        super().__init__(stabilizer, zero_params)
        self.gamma = gamma

    def modifiers(self):
        gamma = self.gamma
        up = ParamModifier(lambda n, p: p + gamma * p.clamp(min=0))
        down = ParamModifier(lambda n, p: p + gamma * p.clamp(max=0))
        return {
            "up": up,
            "down": down,
            "up_nobias": ParamModifier.from_modifiers([up, _ZERO_BIAS]),
            "down_nobias": ParamModifier.from_modifiers([down, _ZERO_BIAS]),
        }

    def modified_params(self, params):
        modified = super().modified_params(params)
        if set(self.zero_params) <= {"bias"}:
            # z^↑ = z + D with D = γ W⁺x + (b^γ⁺ − b): the shift's parameters, for inputs x ≥ 0.
            weight, bias, bias_up = params["weight"], params.get("bias"), modified["up"].get("bias")
            shift = {"weight": weight.detach().clamp(min=0).mul_(self.gamma)}
            if bias is not None or bias_up is not None:
                shift["bias"] = (0 if bias_up is None else bias_up) - (0 if bias is None else bias.detach())
            modified["shift"] = shift
            # D ≥ 0 when its bias is (the default: b^γ⁺ − b = γ b⁺): then z > 0 gives z^↑ > 0 and z < 0 gives z^↓ < 0.
            modified["shift_is_nonnegative"] = "bias" not in shift or bool((shift["bias"] >= 0).all())
        return modified

    def input_gradient(self, module, registration, params, x, z, grad):
        if (
            "shift" in params
            and _is_plain_gradient(grad, z)
            and has_direct_input_gradient(module)
            and not _has_negative(x)
        ):
            with torch.no_grad():
                if not _nonzero_where_negative(grad, z):  # no relevance reaches a negative output (a ReLU follows)
                    return self._positive_outputs_gradient(module, registration, params, x.detach(), z, grad)
                if params["shift_is_nonnegative"]:
                    return self._nonnegative_input_gradient(module, registration, params, x.detach(), z, grad)
        leaf = x.detach().requires_grad_(True)
        pairs = [("up", "down_nobias"), ("down", "up_nobias")]
        z_up, z_down = self._signed_forward(module, registration, params, leaf, pairs)
        grad_up = grad * torch.where(z > 0, z, 0) / stabilize(z_up.detach(), self.stabilizer)
        grad_down = grad * torch.where(z < 0, z, 0) / stabilize(z_down.detach(), self.stabilizer)
        return torch.autograd.grad((z_up, z_down), leaf, (grad_up, grad_down))[0]

    def _positive_outputs_gradient(self, module, registration, params, x, z, grad):
        """The gradient for ``x ≥ 0`` when ``grad`` is zero wherever ``z < 0``: ``W^γ⁺ᵀ a`` alone.

        ``z^↑ = z + D`` (see :meth:`modified_params`): one forward pass for ``D`` and one transposed product,
        with ``a = grad · z / stabilize(z^↑)``. Where ``z ≤ 0``, ``a`` is zero with any non-zero denominator.
        """
        shift = self._forward(module, registration, params["shift"], x)
        nonnegative, epsilon = params["shift_is_nonnegative"], self.stabilizer
        for d, z_, g, scratch in _pieces(shift, z, grad):
            if nonnegative:  # stabilize(z + D) = z + D + ε where z > 0; elsewhere D + ε > 0 does
                d.add_(torch.clamp(z_, min=0, out=scratch)).add_(epsilon)
            else:
                d.add_(z_).add_(_signed_shift(d, epsilon))
            torch.div(torch.mul(g, z_, out=scratch), d, out=d)
        return direct_input_gradient(module, params["up"]["weight"], shift, x)

    def _nonnegative_input_gradient(self, module, registration, params, x, z, grad):
        """The gradient for ``x ≥ 0`` (after a ReLU) and ``D ≥ 0``: one forward pass for ``D``, two products.

        ``z^↑ = z + D`` and ``z^↓ = (1 + γ) z − D`` (see :meth:`modified_params`), so that
        ``|stabilize(z^↑)| = z + D + ε`` where ``z > 0``, ``|stabilize(z^↓)| = −(1 + γ) z + D + ε`` where
        ``z < 0``: both are ``m = max(z, −(1 + γ) z) + D + ε``. With ``r = grad / m`` the shares are
        ``a = z⁺ r`` and ``c = −z⁻ r``, and the input gradient is ``W^γ⁺ᵀ a + W^γ⁻ᵀ c``.
        """
        shift = self._forward(module, registration, params["shift"], x)
        negative_share = shift  # −c is written over D
        positive_share = z if _may_overwrite(grad, z) else torch.empty_like(z)
        scale = -(1 + self.gamma)
        for d, z_, g, a, scratch in _pieces(shift, z, grad, positive_share):
            d.add_(torch.maximum(z_, torch.mul(z_, scale, out=scratch), out=scratch)).add_(self.stabilizer)
            torch.div(g, d, out=d)
            torch.clamp(z_, max=0, out=scratch)
            torch.clamp(z_, min=0, out=a).mul_(d)
            d.mul_(scratch)
        through_up = direct_input_gradient(module, params["up"]["weight"], positive_share, x)
        through_down = direct_input_gradient(module, params["down"]["weight"], negative_share, x)
        return through_up.sub_(through_down)


def _shares(grad: torch.Tensor, z: torch.Tensor, sample: torch.Tensor, epsilon: float | None = None) -> torch.Tensor:
    """``grad · z / d`` for ``d = sample`` or, given ``epsilon``, ``d = stabilize(z − sample, epsilon)``.

    ``sample`` is one sample's tensor (repeated along the batch dimension) or has ``z``'s shape. The work runs
    in cache-sized pieces, and the result is written into ``z`` when :func:`_may_overwrite` allows it.
    """
    if not _is_plain_gradient(grad, z):
        return grad * z / (sample if epsilon is None else stabilize(z - sample, epsilon))
    share = z if _may_overwrite(grad, z) else torch.empty_like(z)
    pieces = _pieces(z, grad, share, sample) if sample.shape == z.shape else _pieces(z, grad, share, sample=sample)
    for z_, g, s, d, scratch in pieces:
        if epsilon is not None:
            d = torch.sub(z_, d, out=scratch)
            d.add_(_signed_shift(d, epsilon))
        torch.div(torch.mul(g, z_, out=s), d, out=s)
    return share


def _one_sample_shape(module: nn.Module, x: torch.Tensor) -> tuple[int, ...] | None:
    """The shape of one sample of the layer input ``x`` (batch size 1); ``None`` when ``x`` has no batch dimension."""
    feature_dims = 1 if type(module) is nn.Linear else len(module.kernel_size) + 1
    return (1, *x.shape[1:]) if x.dim() > feature_dims else None


class _DirectInputRule(_ModifiedForwardRule):
    """Input-layer rules whose relevance is not proportional to the input.

    By default the modified forward pass runs on ones in place of the input
    (the parameters ``"mod"`` carry the rule), and the relevance is the
    gradient those ones receive.
    """

    def stand_ins(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [torch.ones_like(x)]

    def modified_output(self, module, registration, params, stand_ins) -> torch.Tensor:
        return self._forward(module, registration, params["mod"], stand_ins[0])

    def relevance(self, stand_ins, grads) -> torch.Tensor:
        return grads[0]

    def direct_relevance(self, module, registration, params, x, z, grad) -> torch.Tensor:
        """The relevance of the layer input ``x``: ``W_modᵀ (grad · z / stabilize(W_mod 1))`` by default."""
        if not has_direct_input_gradient(module):
            return self._relevance_by_autograd(module, registration, params, x, z, grad)
        with torch.no_grad():
            # The modified output of ones is the same for every sample: computed for one, once per context.
            def denominator() -> torch.Tensor:
                ones = x.new_ones(_one_sample_shape(module, x) or x.shape)
                return stabilize(self._forward(module, registration, params["mod"], ones), self.stabilizer)

            share = _shares(grad, z, self._for_one_sample(module, params, "denominator", x, denominator))
            return direct_input_gradient(module, params["mod"]["weight"], share, x)

    @staticmethod
    def _for_one_sample(module, params, name: str, x: torch.Tensor, compute: Callable[[], torch.Tensor]):
        """``compute()``, a tensor for one sample shaped like those of ``x``, kept while the context lasts."""
        key = (_one_sample_shape(module, x) or x.shape, x.dtype, x.device)
        kept = params.setdefault("one_sample", {})
        if name not in kept or kept[name][0] != key:  # the latest shape only: memory stays bounded
            kept[name] = (key, compute())
        return kept[name][1]

    def _relevance_by_autograd(self, module, registration, params, x, z, grad) -> torch.Tensor:
        """The relevance from :meth:`stand_ins`, :meth:`modified_output` and :meth:`relevance`."""
        leaves = [s.detach().requires_grad_(True) for s in self.stand_ins(x)]
        z_mod = self.modified_output(module, registration, params, leaves)
        start = grad * z / stabilize(z_mod.detach(), self.stabilizer)
        grads = torch.autograd.grad(z_mod, leaves, start, allow_unused=True)
        return self.relevance([s.detach() for s in leaves], grads)

    def input_gradient(self, module, registration, params, x, z, grad):
        value = x.detach()
        relevance = self.direct_relevance(module, registration, params, value, z, grad)
        with torch.no_grad():
            grad_x = torch.where(value != 0, relevance / torch.where(value != 0, value, 1), 0)
        # The gradient carries R = x * grad_x; what it cannot carry (where x = 0) is recorded.
        registration.records.append((x, relevance - value * grad_x))
        return grad_x


class FlatRule(_DirectInputRule):
    """LRP-flat: ``R_i = Σ_j R_j / stabilize(n_j)`` over output ``j``'s receptive field of size ``n_j``.

    Weights set to one, biases to zero and the input to ones; the relevance is
    set directly, so zero-valued inputs get their share.

    Examples:
        >>> lin = nn.Linear(2, 1)
        >>> x = torch.tensor([[0.0, 5.0]], requires_grad=True)
        >>> with FlatRule().register(lin) as handle:
        ...     y = lin(x)
        ...     grad = torch.autograd.grad(y, x, torch.ones_like(y))[0]
        ...     relevance = x * grad + handle.pop_records()[0][1]
        >>> torch.allclose(relevance, y.detach() / 2)
        True
    """

    def modifiers(self):
        return {"mod": ParamModifier.from_modifiers([ParamModifier(lambda n, p: torch.ones_like(p)), _ZERO_BIAS])}


class WSquareRule(_DirectInputRule):
    """LRP-w²: ``R_i = Σ_j w_ij² R_j / stabilize(Σ_i' w_i'j² + b_j²)`` (zennit squares the bias too).

    Examples:
        >>> WSquareRule(stabilizer=1e-3).stabilizer
        0.001
    """

    def modifiers(self):
        return {"mod": ParamModifier(lambda n, p: p**2)}


class ZBoxRule(_DirectInputRule):
    """LRP-z^B for inputs bounded in ``[low, high]``.

    ``z^B_j = Σ_i x_i w_ij - l_i w⁺_ij - h_i w⁻_ij`` (biases cancel) and
    ``R_i = Σ_j (x_i w_ij - l_i w⁺_ij - h_i w⁻_ij) R_j / stabilize(z^B_j)``.

    Args:
        low: lowest input value, a float or a tensor broadcastable to one sample.
        high: highest input value, likewise.

    Examples:
        >>> ZBoxRule(low=-1.0, high=1.0).low
        -1.0
    """

    def __init__(
        self,
        low: float | torch.Tensor,
        high: float | torch.Tensor,
        stabilizer: float = 1e-6,
        zero_params: Sequence[str] = (),
    ) -> None:
        super().__init__(stabilizer, zero_params)
        self.low = low
        self.high = high

    def modifiers(self):
        return {"orig": ParamModifier(), "pos": _clamp(min=0.0), "neg": _clamp(max=0.0)}

    def stand_ins(self, x):
        low = torch.as_tensor(self.low, dtype=x.dtype, device=x.device).expand_as(x)
        high = torch.as_tensor(self.high, dtype=x.dtype, device=x.device).expand_as(x)
        return [x, low, high]

    def direct_relevance(self, module, registration, params, x, z, grad):
        """The relevance without autograd when the bounds are the same for every sample.

        ``z^B = z − b + b_orig − (W⁺l + b⁺) − (W⁻h + b⁻)``, whose last terms are computed for one sample,
        and ``R = x · Wᵀs − l · W⁺ᵀs − h · W⁻ᵀs = (x − h) · Wᵀs + (h − l) · W⁺ᵀs`` (``W⁻ = W − W⁺``) with
        ``s = grad · z / stabilize(z^B)``: two transposed products, stacked into one call.
        """
        if not has_direct_input_gradient(module):
            return self._relevance_by_autograd(module, registration, params, x, z, grad)
        shape = _one_sample_shape(module, x)
        bounds = [torch.as_tensor(b, dtype=x.dtype, device=x.device) for b in (self.low, self.high)]
        if shape is None or any(torch.broadcast_shapes(b.shape, shape) != shape for b in bounds):
            return self._relevance_by_autograd(module, registration, params, x, z, grad)
        low, high = (b.expand(shape).contiguous() for b in bounds)
        orig, pos, neg = params["orig"], params["pos"], params["neg"]

        def offset() -> torch.Tensor:
            offset = self._forward(module, registration, pos, low) + self._forward(module, registration, neg, high)
            for bias, sign in ((params["plain"].get("bias"), 1), (orig.get("bias"), -1)):
                if bias is not None:
                    offset.add_(_bias_view(module, bias), alpha=sign)
            return offset

        with torch.no_grad():
            offset = self._for_one_sample(module, params, "offset", x, offset)
            share = _shares(grad, z, offset, self.stabilizer)
            through_weight, through_positive = direct_input_gradients(module, [orig["weight"], pos["weight"]], share, x)
            return through_weight.mul_(x - high).add_(through_positive.mul_(high - low))

    def modified_output(self, module, registration, params, stand_ins):
        x, low, high = stand_ins
        return (
            self._forward(module, registration, params["orig"], x)
            - self._forward(module, registration, params["pos"], low)
            - self._forward(module, registration, params["neg"], high)
        )

    def relevance(self, stand_ins, grads):
        return sum(s * g for s, g in zip(stand_ins, grads, strict=True) if g is not None)


_UNPREPARED = object()


class FirstLayerRule(Rule):
    """``first`` on calls whose input comes from the model's input, ``other`` on the rest.

    A call counts as a first-layer call when its input depends on a tensor
    that is not a parameter without passing through another Linear or
    convolution layer, so the first layer is the one the input reaches,
    wherever it is declared, and every encoder of a multi-input model gets it.

    Examples:
        >>> class Late(nn.Module):  # declares the output layer before the input layer
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.head, self.stem = nn.Linear(4, 1), nn.Linear(3, 4)
        ...     def forward(self, x):
        ...         return self.head(self.stem(x).relu())
        >>> model, rule = Late(), FirstLayerRule(first=EpsilonRule(), other=StopRule())
        >>> x = torch.randn(2, 3, requires_grad=True)
        >>> with rule.register(model.stem), rule.register(model.head):
        ...     model(x).requires_grad  # the head, declared first, is not the first layer: StopRule
        False
    """

    uses_input = False

    def __init__(self, first: Rule, other: Rule | None = None) -> None:
        super().__init__()
        self.first = first
        self.other = other if other is not None else IgnoreRule()

    def _new_registration(self, module: nn.Module) -> Registration:
        outer = Registration(None)
        # Both inner registrations share the outer one's records, read by the handle. Their
        # state is prepared at the first call that needs it: most layers never use ``first``.
        outer.state = [Registration(_UNPREPARED, records=outer.records, busy=outer.busy) for _ in self._pair]
        return outer

    @property
    def _pair(self) -> tuple[Rule, Rule]:
        return self.first, self.other

    def resolve(self, module, registration, inputs):
        index = 0 if inputs and isinstance(inputs[0], torch.Tensor) and _reaches_model_input(inputs[0]) else 1
        rule, inner = self._pair[index], registration.state[index]
        if inner.state is _UNPREPARED:
            inner.state = rule.prepare(module)
        return rule, inner


class MergeBatchNormRule(PassRule):
    """A BatchNorm in eval mode merged into the Linear or convolution layer that feeds it.

    When the BatchNorm's input is the unmodified output of a layer with a rule
    that supports merging, that rule is applied to the merged layer
    ``W' = W s``, ``b' = (b - μ) s + β`` with ``s = γ / sqrt(var + eps)`` (what
    zennit's BatchNorm canonizers compute), without writing any parameter.
    Otherwise (training mode, no running statistics, another producer) it is
    :class:`PassRule`.

    Examples:
        >>> conv, bn, rule = nn.Conv1d(1, 2, 3), nn.BatchNorm1d(2).eval(), AlphaBetaRule(1.0, 0.0)
        >>> bn.running_mean.fill_(0.5), bn.running_var.fill_(4.0)  # doctest: +ELLIPSIS
        (...)
        >>> by_hand = nn.Conv1d(1, 2, 3)  # the merged layer, built by hand
        >>> with torch.no_grad():
        ...     s = bn.weight / (bn.running_var + bn.eps).sqrt()
        ...     _ = by_hand.weight.copy_(conv.weight * s.view(-1, 1, 1))
        ...     _ = by_hand.bias.copy_((conv.bias - bn.running_mean) * s + bn.bias)
        >>> def relevance(*layers):
        ...     x = torch.randn(1, 1, 5, generator=torch.Generator().manual_seed(0), requires_grad=True)
        ...     out = nn.Sequential(*layers)(x)
        ...     return x * torch.autograd.grad(out, x, out.detach())[0]
        >>> with rule.register(conv), MergeBatchNormRule().register(bn):
        ...     merged = relevance(conv, bn)
        >>> with rule.register(by_hand):
        ...     expected = relevance(by_hand)
        >>> torch.allclose(merged, expected)
        True
    """

    def __init__(self, stabilizer: float = 1e-12) -> None:
        super().__init__(stabilizer)
        self._warned: set[type] = set()

    def prepare(self, module: nn.Module) -> dict:
        return {}

    def rewrite(self, module, registration, inputs, output):
        call = layer_call_of(inputs[0]) if len(inputs) == 1 else None
        if call is None or not _can_merge(call, module):
            return super().rewrite(module, registration, inputs, output)
        if not call.rule.merges_batch_norm:
            if type(call.rule) not in self._warned:
                self._warned.add(type(call.rule))
                warnings.warn(
                    f"{type(call.rule).__name__} on {type(call.module).__name__} cannot be merged with the "
                    f"{type(module).__name__} that follows it; the {type(module).__name__} passes relevance through",
                    stacklevel=2,
                )
            return super().rewrite(module, registration, inputs, output)
        merged = registration.state.get(call.module)
        if merged is None:
            merged = registration.state[call.module] = _merge_batch_norm(call.module, module)
        result = call.rule.rewrite_merged(call, output, merged)
        if result is not None and result.grad_fn is not None:
            result.grad_fn.metadata[_LAYER_MARK] = True  # the merged layer's output is a layer boundary
        for observe in call.observers:
            observe(result if result is not None else output)
        return result


def _can_merge(call: LayerCall, norm: nn.Module) -> bool:
    if norm.training or norm.running_mean is None or norm.running_var is None:
        return False
    raw = call.raw
    if isinstance(call.module, nn.Linear) and raw.dim() != 2:
        return False  # BatchNorm1d on (N, L, C) normalises L, not the layer's features
    return raw.dim() >= 2 and raw.shape[1] == norm.num_features


def _merge_batch_norm(layer: nn.Module, norm: nn.Module) -> MergedLayer:
    with torch.no_grad():
        scale = (norm.running_var + norm.eps).rsqrt()
        shift = torch.zeros_like(scale)
        if norm.weight is not None:
            scale = scale * norm.weight
        if norm.bias is not None:
            shift = norm.bias.detach()
        weight = layer.weight.detach()
        bias = layer.bias.detach() if layer.bias is not None else torch.zeros_like(norm.running_mean)
        if isinstance(layer, tuple(_TRANSPOSED)):
            # (in, out / groups, *kernel): output channel g * out / groups + j sits at [group g's inputs, j].
            groups = layer.groups
            grouped = weight.reshape(groups, weight.shape[0] // groups, *weight.shape[1:])
            per_group = scale.reshape(groups, 1, -1, *[1] * (weight.dim() - 2))
            weight = (grouped * per_group).reshape(weight.shape)
        else:
            weight = weight * scale.view(-1, *[1] * (weight.dim() - 1))
        bias = (bias - norm.running_mean) * scale + shift
    return MergedLayer({"weight": weight, "bias": bias}, scale)


# ----------------------------------------------------------------------------- mappers and presets

RuleMapper = Callable[[str, nn.Module], "Rule | None"]

_ACTIVATIONS = (
    nn.ELU,
    nn.Hardshrink,
    nn.Hardsigmoid,
    nn.Hardtanh,
    nn.Hardswish,
    nn.LeakyReLU,
    nn.LogSigmoid,
    nn.PReLU,
    nn.ReLU,
    nn.ReLU6,
    nn.RReLU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.Sigmoid,
    nn.SiLU,
    nn.Mish,
    nn.Softplus,
    nn.Softshrink,
    nn.Softsign,
    nn.Tanh,
    nn.Tanhshrink,
    nn.Threshold,
    biased_softplus,  # the scale mapping of tensordict's NormalParamExtractor
)
_AVG_POOLS = (
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AvgPool3d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d,
)
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_GRADIENT_ROUTED = (
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.MaxPool3d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d,
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.Flatten,
    nn.Unflatten,
    nn.Identity,
    nn.Embedding,  # an input layer: LRP gives its tokens the relevance of their embeddings
    SquashDims,
)
_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_LINEAR_LAYERS = (*_CONVOLUTIONS, nn.Linear)


def rule_mapper_from_dict(mapping: Mapping[type | tuple[type, ...] | str, Rule]) -> RuleMapper:
    """A rule mapper from a dict keyed by module type(s) or by name pattern.

    String keys match module names with shell-style wildcards (``"features.*"``);
    type keys match with ``isinstance``. The first matching entry, in the
    dict's order, wins.

    Examples:
        >>> mapper = rule_mapper_from_dict({"head": StopRule(), nn.Linear: EpsilonRule(0.25)})
        >>> mapper("head", nn.Linear(2, 2)), mapper("body.0", nn.Linear(2, 2)), mapper("act", nn.Tanh())
        (StopRule(), EpsilonRule(epsilon=0.25), None)
    """
    entries = list(mapping.items())
    for key, rule in entries:
        if not isinstance(rule, Rule):
            raise TypeError(f"rule mapping entry {key!r} must map to a Rule, got {type(rule).__name__}")

    def mapper(name: str, module: nn.Module) -> Rule | None:
        for key, rule in entries:
            if isinstance(key, str) and fnmatchcase(name, key):
                return rule
            if not isinstance(key, str) and isinstance(module, key):
                return rule
        return None

    return mapper


def _is_glue(module: nn.Module) -> bool:
    """TensorDict wrappers of plain functions: their operations are differentiated as they are."""
    from tensordict.nn import TensorDictModuleBase

    return isinstance(module, TensorDictModuleBase)


class BaseRuleMapper:
    """Map ``(name, module)`` to a rule: the user's mapper first, then defaults.

    Defaults: activations → :class:`PassRule`; average pooling → :class:`EpsilonRule`
    with ``stabilizer`` (zennit's ``Norm``); BatchNorm → :class:`MergeBatchNormRule`
    (merged into the layer before it, else passed through); Linear and
    convolution layers, MaxPool, Dropout, Flatten, Unflatten, Identity →
    :class:`IgnoreRule`. Other modules get no rule (plain gradient).
    Subclasses add Linear/Conv rules in :meth:`layer_rule` and a special first
    layer in :meth:`first_layer_rule`, applied by :class:`FirstLayerRule` to
    the layers the model's input reaches first.

    Args:
        stabilizer: stabilizer of the default rules.
        rule_mapper: ``(name, module) -> Rule | None`` consulted first, or a dict
            for :func:`rule_mapper_from_dict`.
        strict: raise on a leaf module that gets no rule, rather than warn
            (once per module name) that it is differentiated as it is.
        stabilize_additions: treat every addition of two activations (residual
            sums) as zennit's ``Sum`` under ``Norm(stabilizer)``, as its ResNet
            canonizer does, instead of splitting it exactly
            (see :class:`~tdhook.attribution.lrp_helpers.additions.StabilizedAdditions`).

    Examples:
        >>> mapper = BaseRuleMapper(rule_mapper=lambda name, m: StopRule() if name == "head" else None)
        >>> mapper("head", nn.Linear(2, 2)), mapper("act", nn.Tanh()), mapper("fc", nn.Linear(2, 2))
        (StopRule(), PassRule(stabilizer=1e-12), IgnoreRule())
    """

    def __init__(
        self,
        stabilizer: float = 1e-6,
        rule_mapper: RuleMapper | Mapping | None = None,
        strict: bool = False,
        stabilize_additions: bool = False,
    ) -> None:
        self.stabilizer = stabilizer
        self.strict = strict
        self.stabilize_additions = stabilize_additions
        self._warned: set[tuple[str, type]] = set()
        self.rule_mapper = rule_mapper_from_dict(rule_mapper) if isinstance(rule_mapper, Mapping) else rule_mapper
        self._pass = PassRule()
        self._norm = EpsilonRule(epsilon=stabilizer)
        self._ignore = IgnoreRule()
        self._merge_batch_norm = MergeBatchNormRule()
        self._first_layer_rules: dict[tuple[int, int], FirstLayerRule] = {}

    def function_modes(self) -> list:
        r"""``TorchFunctionMode``\ s the wrapper runs the forward pass in: rules for calls that are not modules."""
        if not self.stabilize_additions:
            return []
        from tdhook.attribution.lrp_helpers.additions import StabilizedAdditions

        return [StabilizedAdditions(self.stabilizer)]

    def __call__(self, name: str, module: nn.Module) -> Rule | None:
        if self.rule_mapper is not None:
            rule = self.rule_mapper(name, module)
            if rule is not None:
                return rule
        return self.layer_rule(name, module) or self.default_rule(name, module)

    def default_rule(self, name: str, module: nn.Module) -> Rule | None:
        """The rule for activations, pooling, norms, dropout and shape modules."""
        if isinstance(module, _ACTIVATIONS):
            return self._pass
        if isinstance(module, _BATCH_NORMS):
            return self._merge_batch_norm
        if isinstance(module, _AVG_POOLS):
            return self._norm
        if isinstance(module, (*_GRADIENT_ROUTED, *_LINEAR_LAYERS)):
            return self._ignore
        return None

    def layer_rule(self, name: str, module: nn.Module) -> Rule | None:
        """The rule for Linear and convolution layers (none here: LRP-0)."""
        return None

    def first_layer_rule(self, name: str, module: nn.Module) -> Rule | None:
        """The rule for the first Linear or convolution layer, when it differs from the others."""
        return None

    def rules(self, model: nn.Module) -> dict[str, Rule]:
        """The rule of every module of ``model`` that has one, by module name.

        Linear and convolution layers whose :meth:`first_layer_rule` differs
        from their rule get a :class:`FirstLayerRule` choosing between the two
        at each call. A module the user's mapper names keeps the user's rule.
        """
        rules: dict[str, Rule] = {}
        for name, module in model.named_modules():
            rule = None
            if self.rule_mapper is not None:
                rule = self.rule_mapper(name, module)
            if rule is None:
                rule = self.layer_rule(name, module) or self.default_rule(name, module)
                first = self.first_layer_rule(name, module) if isinstance(module, _LINEAR_LAYERS) else None
                if first is not None and first is not rule:
                    rule = self._first_layer_switch(first, rule)
            if rule is not None:
                rules[name] = rule
            elif next(module.children(), None) is None and not _is_glue(module):
                self._unmapped(name, module)
        return rules

    def _unmapped(self, name: str, module: nn.Module) -> None:
        message = (
            f"no LRP rule for module {name!r} ({type(module).__name__}): its plain gradient is used; "
            "map it in rule_mapper (for example to PassRule, UniformRule or IgnoreRule)"
        )
        if self.strict:
            raise ValueError(message)
        if (name, type(module)) not in self._warned:
            self._warned.add((name, type(module)))
            warnings.warn(message, stacklevel=3)

    def _first_layer_switch(self, first: Rule, other: Rule | None) -> FirstLayerRule:
        key = (id(first), id(other))
        if key not in self._first_layer_rules:
            self._first_layer_rules[key] = FirstLayerRule(first, other)
        return self._first_layer_rules[key]


class EpsilonPlus(BaseRuleMapper):
    """z⁺ on convolutions, ε on dense layers (zennit's ``EpsilonPlus``).

    Examples:
        >>> mapper = EpsilonPlus(epsilon=1e-3)
        >>> mapper("conv", nn.Conv2d(1, 1, 3)), mapper("fc", nn.Linear(2, 2))
        (AlphaBetaRule(stabilizer=1e-06, zero_params=(), alpha=1.0, beta=0.0), EpsilonRule(epsilon=0.001))
    """

    def __init__(
        self,
        epsilon: float = 1e-6,
        stabilizer: float = 1e-6,
        rule_mapper: RuleMapper | Mapping | None = None,
        strict: bool = False,
        stabilize_additions: bool = False,
    ):
        super().__init__(stabilizer, rule_mapper, strict, stabilize_additions)
        self.epsilon = epsilon
        self._conv = AlphaBetaRule(alpha=1.0, beta=0.0, stabilizer=stabilizer)
        self._dense = EpsilonRule(epsilon=epsilon)

    def layer_rule(self, name, module):
        if isinstance(module, _CONVOLUTIONS):
            return self._conv
        if isinstance(module, nn.Linear):
            return self._dense
        return None


class EpsilonPlusFlat(EpsilonPlus):
    """:class:`EpsilonPlus` with :class:`FlatRule` on the first layer (zennit's ``EpsilonPlusFlat``).

    Examples:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
        >>> rules = EpsilonPlusFlat().rules(model)
        >>> rules["0"].first, rules["0"].other, rules["1"]
        (FlatRule(stabilizer=1e-06, zero_params=()), EpsilonRule(epsilon=1e-06), PassRule(stabilizer=1e-12))
    """

    def __init__(
        self,
        epsilon: float = 1e-6,
        stabilizer: float = 1e-6,
        rule_mapper: RuleMapper | Mapping | None = None,
        strict: bool = False,
        stabilize_additions: bool = False,
    ):
        super().__init__(epsilon, stabilizer, rule_mapper, strict, stabilize_additions)
        self._first = FlatRule(stabilizer=stabilizer)

    def first_layer_rule(self, name, module):
        return self._first


class EpsilonAlpha2Beta1(BaseRuleMapper):
    """αβ with ``α = 2, β = 1`` on convolutions, ε on dense layers (zennit's ``EpsilonAlpha2Beta1``).

    Examples:
        >>> EpsilonAlpha2Beta1()("conv", nn.Conv1d(1, 1, 3)).alpha
        2.0
    """

    def __init__(
        self,
        epsilon: float = 1e-6,
        stabilizer: float = 1e-6,
        rule_mapper: RuleMapper | Mapping | None = None,
        strict: bool = False,
        stabilize_additions: bool = False,
    ):
        super().__init__(stabilizer, rule_mapper, strict, stabilize_additions)
        self.epsilon = epsilon
        self._conv = AlphaBetaRule(alpha=2.0, beta=1.0, stabilizer=stabilizer)
        self._dense = EpsilonRule(epsilon=epsilon)

    layer_rule = EpsilonPlus.layer_rule


class EpsilonAlpha2Beta1Flat(EpsilonAlpha2Beta1):
    """:class:`EpsilonAlpha2Beta1` with :class:`FlatRule` on the first layer.

    Examples:
        >>> model = nn.Sequential(nn.Conv1d(1, 2, 3), nn.ReLU(), nn.Conv1d(2, 1, 3))
        >>> [type(r).__name__ for r in EpsilonAlpha2Beta1Flat().rules(model).values()]
        ['FirstLayerRule', 'PassRule', 'FirstLayerRule']
    """

    def __init__(
        self,
        epsilon: float = 1e-6,
        stabilizer: float = 1e-6,
        rule_mapper: RuleMapper | Mapping | None = None,
        strict: bool = False,
        stabilize_additions: bool = False,
    ):
        super().__init__(epsilon, stabilizer, rule_mapper, strict, stabilize_additions)
        self._first = FlatRule(stabilizer=stabilizer)

    first_layer_rule = EpsilonPlusFlat.first_layer_rule


class EpsilonGammaBox(BaseRuleMapper):
    """z^B on the first convolution, γ on the others, ε on dense layers (zennit's ``EpsilonGammaBox``).

    Args:
        low: lowest input value (float or tensor broadcastable to one sample).
        high: highest input value.
        epsilon: ε of the dense layers.
        gamma: γ of the convolutions.
        stabilizer: stabilizer of the other rules.

    Examples:
        >>> model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.Flatten(), nn.LazyLinear(2))
        >>> [type(r).__name__ for r in EpsilonGammaBox(-3.0, 3.0).rules(model).values()]
        ['FirstLayerRule', 'PassRule', 'FirstLayerRule', 'IgnoreRule', 'EpsilonRule']
    """

    def __init__(
        self,
        low: float | torch.Tensor,
        high: float | torch.Tensor,
        epsilon: float = 1e-6,
        gamma: float = 0.25,
        stabilizer: float = 1e-6,
        rule_mapper: RuleMapper | Mapping | None = None,
        strict: bool = False,
        stabilize_additions: bool = False,
    ):
        super().__init__(stabilizer, rule_mapper, strict, stabilize_additions)
        self.epsilon = epsilon
        self._conv = GammaRule(gamma=gamma, stabilizer=stabilizer)
        self._dense = EpsilonRule(epsilon=epsilon)
        self._first = ZBoxRule(low, high, stabilizer=stabilizer)

    layer_rule = EpsilonPlus.layer_rule

    def first_layer_rule(self, name, module):
        return self._first if isinstance(module, _CONVOLUTIONS) else None


# ----------------------------------------------------------------------------- checks


def raise_for_unconserved_rel_factory(
    atol: float = 1e-6, rtol: float = 1e-6
) -> Callable[[str, nn.Module, torch.Tensor, torch.Tensor], None]:
    """A layer check that raises where relevance is lost, created, NaN or infinite.

    The check compares the total relevance entering a module (its output's)
    with the total leaving it (its input's). Pass it as ``LRP(...,
    relevance_check=...)``. Biases and ε absorb relevance, so use it with
    zero biases and a small ε, or loose tolerances.

    Examples:
        >>> check = raise_for_unconserved_rel_factory(atol=1e-3)
        >>> check("fc", nn.Linear(2, 2), torch.tensor([0.5, 0.5]), torch.tensor([1.0]))
        >>> check("fc", nn.Linear(2, 2), torch.tensor([0.5, 0.0]), torch.tensor([1.0]))
        Traceback (most recent call last):
        ...
        ValueError: relevance is not conserved at module 'fc' (Linear): input sum 0.5, output sum 1
    """

    def check(name: str, module: nn.Module, relevance_in: torch.Tensor, relevance_out: torch.Tensor) -> None:
        kind = type(module).__name__
        for label, rel in (("input", relevance_in), ("output", relevance_out)):
            if not torch.isfinite(rel).all():
                raise ValueError(f"{label} relevance of module {name!r} ({kind}) has NaN or inf values")
        total_in, total_out = relevance_in.sum().item(), relevance_out.sum().item()
        if abs(total_in - total_out) > atol + rtol * abs(total_out):
            raise ValueError(
                f"relevance is not conserved at module {name!r} ({kind}): "
                f"input sum {total_in:.6g}, output sum {total_out:.6g}"
            )

    return check


# The transformer rules and presets live in their own module; they are part of this public one.
from tdhook.attribution.lrp_helpers.transformer_rules import (  # noqa: E402
    CPLRP,
    AHQKVRule,
    AttnLRP,
    LayerNormRule,
    PseudoIdentityRule,
    SoftmaxEpsilonRule,
)
