"""BatchNorm in eval mode, merged into the Linear or convolution layer before it for that layer's rule."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from tdhook.attribution.rules._autograd import call_argument
from tdhook.attribution.rules._caller import warn_at_caller
from tdhook.attribution.rules._concatenated_layers import concatenated_layer_calls
from tdhook.attribution.rules._copied_layer_outputs import warn_of_copied_layer_output
from tdhook.attribution.rules._graph_calls import note_output, recording
from tdhook.attribution.rules._held_parameters import HeldParameters
from tdhook.attribution.rules._keeping_graph import graph_kept
from tdhook.attribution.rules._layers import BATCH_NORMS, TRANSPOSED_FORWARDS, effective_parameters
from tdhook.attribution.rules._norm_gradient_layout import lay_out_gradient
from tdhook.attribution.rules._paused_modes import function_modes_paused
from tdhook.attribution.rules.base import (
    _LAYER_MARK,
    _UNPREPARED,
    LayerCall,
    MergedLayer,
    RemovableRuleHandle,
    layer_call_of,
)
from tdhook.attribution.rules.normalization import NormRule, _ConstantScale

__all__ = ["MergeBatchNormRule", "is_batch_norm", "is_frozen_batch_norm"]

# The buffers a frozen BatchNorm computes its affine map from (torchvision's FrozenBatchNorm2d, timm's
# FrozenBatchNormAct2d): no parameters, and no statistics that a call updates.
_FROZEN_BUFFERS = ("weight", "bias", "running_mean", "running_var")


def is_frozen_batch_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a frozen BatchNorm: a class whose name holds ``FrozenBatchNorm`` (torchvision's
    ``FrozenBatchNorm2d``, which timm's ``freeze_batch_norm_2d`` and torchvision's detection backbones put in place
    of BatchNorm2d; timm's ``FrozenBatchNormAct2d``; Hugging Face's ``DetrFrozenBatchNorm2d``,
    ``RTDetrFrozenBatchNorm2d`` and their kin, whose ε is written in their forward) holding the eval-mode statistics
    as buffers.

    Examples:
        >>> from torchvision.ops.misc import FrozenBatchNorm2d
        >>> is_frozen_batch_norm(FrozenBatchNorm2d(4)), is_frozen_batch_norm(nn.BatchNorm2d(4))
        (True, False)
    """
    buffers = module._buffers
    return "FrozenBatchNorm" in type(module).__name__ and all(
        isinstance(buffers.get(name), torch.Tensor) for name in _FROZEN_BUFFERS
    )


def is_batch_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a BatchNorm (torch's, and its subclasses) or a frozen one: what
    :class:`MergeBatchNormRule` merges into the layer before it.

    Examples:
        >>> is_batch_norm(nn.BatchNorm1d(3)), is_batch_norm(nn.LayerNorm(3))
        (True, False)
    """
    return isinstance(module, BATCH_NORMS) or is_frozen_batch_norm(module)


class _Statistics(NamedTuple):
    """What an ``F.batch_norm`` call normalises with: its running statistics, affine parameters, mode and ε."""

    mean: torch.Tensor | None
    var: torch.Tensor | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    training: bool
    eps: float

    @classmethod
    def of_call(cls, args: tuple, kwargs: dict) -> _Statistics:
        """The arguments of ``F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum,
        eps)``: those the call normalised with, whatever the module holds (a subclass normalising each domain with
        its own statistics)."""
        names = ("running_mean", "running_var", "weight", "bias")
        tensors = [call_argument(args, kwargs, position, name) for position, name in enumerate(names, 1)]
        training = bool(call_argument(args, kwargs, 5, "training", False))
        return cls(*tensors, training, call_argument(args, kwargs, 7, "eps", 1e-5))

    def held_by(self, norm: nn.Module) -> bool:
        """Whether these are ``norm``'s own tensors and ε (as torch's forward passes them): the merge built from them
        is kept, and rebuilt when they change."""
        own = (norm.running_mean, norm.running_var, norm.weight, norm.bias)
        return all(a is b for a, b in zip(self[:4], own, strict=True)) and self.eps == norm.eps


class MergeBatchNormRule(NormRule):
    """A BatchNorm in eval mode merged into the Linear or convolution layer that feeds it.

    When the BatchNorm's input is the unmodified output of a layer with a rule
    that supports merging, that rule is applied to the merged layer
    ``W' = W s``, ``b' = (b - μ) s + β`` with ``s = γ / sqrt(var + eps)`` (what
    zennit's BatchNorm canonizers compute), without writing any parameter.
    Otherwise (training mode, no running statistics, another producer) it is
    :class:`~tdhook.attribution.rules.normalization.NormRule`: the ε-rule of the
    affine map in eval mode, the batch statistics held constant in training mode.
    The merge happens at the ``F.batch_norm`` call inside the module's forward,
    so a BatchNorm fused with an activation (timm's ``BatchNormAct2d``) keeps
    its activation and that activation's rule.

    Examples:
        >>> from tdhook.attribution.rules import AlphaBetaRule
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

    reads_layer_marks = True

    def __init__(self, epsilon: float = 1e-6) -> None:
        super().__init__(epsilon)
        self._warned: set[type] = set()
        self._warned_copies: set[int] = set()  # BatchNorms reading a layer's output as a copy (warned of once)

    @property
    def differentiable(self) -> bool:  # type: ignore[override]
        return True  # merged from the live parameters (see _rewrite), else NormRule's, which keeps the graph too

    def prepare(self, module: nn.Module) -> dict:
        return {}

    def register(self, module: nn.Module) -> RemovableRuleHandle:
        if not is_frozen_batch_norm(module):
            return super().register(module)

        def leave(mod: nn.Module, args: tuple, output: Any, mode: _FrozenAffine) -> None:
            unread = not mode.applied and not function_modes_paused()
            if unread and isinstance(output, torch.Tensor) and output.requires_grad:
                raise ValueError(
                    f"{type(self).__name__} on {type(mod).__name__}: its forward computed no x * scale + shift (nor "
                    "F.batch_norm) from its input, which the rule merges into the layer before it (a shift added in "
                    "place, out += shift, is followed; a scale multiplied in place, out *= scale, or another "
                    "computation is not). Write it x * scale + shift, or map the module to another rule (IgnoreRule: "
                    "the plain gradient of what it computes, unmerged)"
                )
            if mode.record is not None:  # the BatchNorm keeps its mode in later calls, as a merged one does
                mode.record.norm_done(mod, plain=False)
            note_output(output)

        return self._register_in_forward(module, lambda mod: _FrozenAffine(self, mod, recording()), leave)

    def _check_calls(self, module: nn.Module, output: Any, mode: _ConstantScale) -> None:
        # A forward of its own that makes no F.batch_norm call (x * scale + shift computed by hand) has nothing the
        # rule merges: its arithmetic kept its plain gradient, 1.8 times off the merged BatchNorm's, with no word.
        computed = isinstance(output, torch.Tensor) and output.requires_grad
        if computed and F.batch_norm not in mode.called and _forward_of_its_own(module):
            raise ValueError(
                f"{type(self).__name__} on {type(module).__name__}: its forward made no F.batch_norm call, which the "
                "rule merges into the layer before it (or gives the ε-rule of its affine map); what it computes "
                "instead (x * scale + shift by hand) would keep its plain gradient, unmerged. Call F.batch_norm "
                "in its forward (with the statistics it normalises by), or map the module to another rule (NormRule: "
                "the normalising scales it computes held constant; IgnoreRule: the plain gradient, unmerged)"
            )

    def batch_norm(self, module: nn.Module, output: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        # Merged with what the call normalised with, which a subclass's forward may take from elsewhere than the
        # module's buffers (a domain's statistics: merged with the module's own, 0.41 off before).
        statistics = _Statistics.of_call(args, kwargs)
        call = layer_call_of(args[0])
        parts = concatenated_layer_calls(args[0]) if call is None else None
        if parts is not None and _can_merge_parts(parts, statistics, output.shape[1]):
            return self._merge_parts(module, output, args, kwargs, parts)
        flattened = call is None and (call := _flattened_layer_call(args[0])) is not None
        if call is None or not _can_merge(call, statistics, flattened):
            if call is None and parts is None:
                warn_of_copied_layer_output(
                    module, args[0], self._warned_copies, lambda copied: _can_merge(copied, statistics)
                )
            return super().batch_norm(module, output, args, kwargs)
        if not call.rule.merges_batch_norm:
            if type(call.rule) not in self._warned:
                warn_at_caller(
                    f"{type(call.rule).__name__} on {type(call.module).__name__} cannot be merged with the "
                    f"{type(module).__name__} that follows it; the {type(module).__name__} gets the ε-rule"
                )
                # Recorded once the warning is out: a warning filter that makes it an error warns again next call.
                self._warned.add(type(call.rule))
            return super().batch_norm(module, output, args, kwargs)
        # A flattened layer output is merged in the layer's own shape, and the result flattened as the input was.
        seen = output.view(call.raw.shape) if flattened else output
        result = self._rewrite(module, call, seen, slice(None), statistics)
        if result is seen:  # the layer's rule keeps the plain gradient: the BatchNorm's own backward runs
            lay_out_gradient(output)
        return result.view(output.shape) if flattened else result

    def _merge_parts(
        self, module: nn.Module, output: torch.Tensor, args: tuple, kwargs: dict, parts: list[LayerCall | None]
    ) -> torch.Tensor:
        """The BatchNorm over the concatenation of the layers' outputs ``parts``, merged into each layer; on the
        channels of the one other part (``None``), if any, the ε-rule of its affine map."""
        other = output.shape[1] - sum(call.raw.shape[1] for call in parts if call is not None)
        plain = super().batch_norm(module, output, args, kwargs) if None in parts else None
        statistics = _Statistics.of_call(args, kwargs)
        results, start = [], 0
        for call in parts:
            channels = slice(start, start + (other if call is None else call.raw.shape[1]))
            seen = output[:, channels]
            if call is None:
                results.append(plain[:, channels])
            else:
                results.append(self._rewrite(module, call, seen, channels, statistics))
            start = channels.stop
        return torch.cat(results, dim=1)

    def _rewrite(
        self, module: nn.Module, call: LayerCall, seen: torch.Tensor, channels: slice, statistics: _Statistics
    ) -> torch.Tensor:
        """The output ``seen`` of the BatchNorm's ``channels``, from ``call``'s layer merged with them (with the
        ``statistics`` its ``F.batch_norm`` call normalised with)."""
        if graph_kept() is not None:  # from the live parameters, every call: the kept merge is detached
            merged = _merge_batch_norm(call.module, statistics, channels, call.read)
        elif call.read is not None and not _holds_what_it_read(call):
            # The layer ran with other parameters than it holds now (torch.func.functional_call: an ensemble
            # through one layer): merged from those, and not kept.
            merged = _merge_batch_norm(call.module, statistics, channels, call.read)
        elif not statistics.held_by(module):
            # The forward normalised with other tensors than the module's own (a domain's statistics, chosen by an
            # attribute no parameter check sees): merged from those, and not kept.
            merged = _merge_batch_norm(call.module, statistics, channels)
        else:
            registration = self._registrations[module]
            if registration.state is _UNPREPARED:  # a lazy BatchNorm: no parameters when the rule was registered
                self.prepared_state(module, registration)
            state = registration.state
            key = call.module if channels == slice(None) else (call.module, channels.start, channels.stop)
            merged = state.get(key)
            # Rebuilt when the layer's or the BatchNorm's parameters or statistics changed (an optimizer step).
            # The layer's own rule, where it derives a state, checked the layer at this call (a new record where
            # it changed): the merge then holds the BatchNorm alone, with no second copy of the layer's values.
            layer = call.registration.held
            held = (module,) if layer is not None else (call.module, module)
            if merged is None or merged.layer is not layer or not merged.held.unchanged(*held):
                merged = state[key] = _merge_batch_norm(call.module, statistics, channels)
                merged.held, merged.layer = HeldParameters(*held), layer
        result = call.rule.rewrite_merged(call, seen, merged)
        if result is not None and result.grad_fn is not None:
            result.grad_fn.metadata[_LAYER_MARK] = True  # the merged layer's output is a layer boundary
        result = seen if result is None else result
        for observe in call.observers:
            observe(result)
        return result


def _forward_of_its_own(module: nn.Module) -> bool:
    """Whether the BatchNorm's forward is not torch's own: a subclass's, or one set on the instance."""
    forward = getattr(type(module), "forward", None)
    return "forward" in module.__dict__ or not getattr(forward, "__module__", "").startswith("torch.nn.modules.")


def _flattened_layer_call(x: torch.Tensor) -> LayerCall | None:
    """The call of the Linear layer whose output ``(..., C)`` the BatchNorm's input ``x`` holds flattened to
    ``(M, C)`` (a view of the same memory, rows in order: timm's ``LinearNorm`` normalises a token sequence so; code
    written for any batch shape, ``z.reshape(-1, C)``, makes a view of the same shape of a flat batch's output),
    else ``None``."""
    if not x._is_view() or x.dim() != 2:
        return None
    base = x._base
    call = layer_call_of(base)
    if call is None or not isinstance(call.module, nn.Linear) or base.dim() < 2 or not base.is_contiguous():
        return None
    features = base.shape[-1]
    rows_in_order = x.shape == (base.numel() // features, features) and x.stride() == (features, 1)
    return call if rows_in_order and x.data_ptr() == base.data_ptr() else None


def _can_merge_parts(parts: list[LayerCall | None], statistics: _Statistics, features: int) -> bool:
    """Whether a batch norm with ``statistics`` over the concatenated outputs of the layers ``parts`` (and of one
    other tensor, ``None``) merges into each layer."""
    layers = [call for call in parts if call is not None]
    width = sum(call.raw.shape[1] for call in layers)
    mean = statistics.mean
    if mean is None or mean.numel() != features or width > features - (None in parts):
        return False
    if None not in parts and width != features:
        return False
    merges = (_can_merge(call, statistics, features=call.raw.shape[1]) for call in layers)
    return all(call.rule.merges_batch_norm for call in layers) and all(merges)


def _can_merge(call: LayerCall, statistics: _Statistics, flattened: bool = False, features: int | None = None) -> bool:
    """Whether a batch norm call with ``statistics`` of ``call``'s layer output merges into the layer: running
    statistics, in eval mode (as the call runs: a frozen BatchNorm normalises by its buffers in either mode)."""
    if statistics.mean is None or statistics.var is None or statistics.training:
        return False
    raw = call.raw
    if features is None:
        features = statistics.mean.numel()
    if flattened:
        return raw.shape[-1] == features
    if isinstance(call.module, nn.Linear):
        if raw.dim() != 2:
            return False  # BatchNorm1d on (N, L, C) normalises L, not the layer's features
    elif raw.dim() != len(call.module.kernel_size) + 2:
        return False  # an unbatched convolution's (C, *spatial): the BatchNorm's dimension 1 is spatial
    return raw.shape[1] == features


def _holds_what_it_read(call: LayerCall) -> bool:
    """Whether ``call``'s layer holds the weight and bias its call read (``call.read``)."""
    weight, bias = call.read
    return call.module.weight is weight and call.module.bias is bias


def _merge_batch_norm(
    layer: nn.Module, statistics: _Statistics, channels: slice = slice(None), read: tuple | None = None
) -> MergedLayer:
    """``layer`` with the batch norm of ``statistics``' ``channels`` (as many as the layer's outputs) folded in; with
    the weight and bias of ``read`` where given (those a call of the layer read), else with the layer's own."""
    # Detached, except in a call that keeps the graph: there the merged parameters are functions of the live ones.
    keep = graph_kept() is not None
    with torch.enable_grad() if keep else torch.no_grad():
        mean = statistics.mean[channels]
        scale = (statistics.var[channels] + statistics.eps).rsqrt()
        shift = torch.zeros_like(scale)
        if statistics.weight is not None:
            scale = scale * statistics.weight[channels]
        if statistics.bias is not None:
            shift = (statistics.bias if keep else statistics.bias.detach())[channels]
        if read is None:
            params = effective_parameters(layer)
        else:
            given = {"weight": read[0], "bias": read[1]}
            params = {name: t if keep else t.detach() for name, t in given.items() if t is not None}
        weight = params["weight"]
        bias = params["bias"] if "bias" in params else torch.zeros_like(mean)
        if isinstance(layer, tuple(TRANSPOSED_FORWARDS)):
            # (in, out / groups, *kernel): output channel g * out / groups + j sits at [group g's inputs, j].
            groups = layer.groups
            grouped = weight.reshape(groups, weight.shape[0] // groups, *weight.shape[1:])
            per_group = scale.reshape(groups, 1, -1, *[1] * (weight.dim() - 2))
            weight = (grouped * per_group).reshape(weight.shape)
        else:
            weight = weight * scale.view(-1, *[1] * (weight.dim() - 1))
        bias = (bias - mean) * scale + shift
    return MergedLayer({"weight": weight, "bias": bias}, scale)


# How a frozen BatchNorm's forward scales its input and adds the shift (``x * scale + shift``).
_PRODUCTS = frozenset({torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__})
_SUMS = frozenset({torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__})
# ``out += shift``, ``out.add_(shift)`` (a function mode sees the first as the second): the forward goes on with
# ``out`` itself, which takes the rule's output's history (see :class:`_Rebased`).
_SUMS_IN_PLACE = frozenset({torch.Tensor.add_, torch.Tensor.__iadd__})


def _per_channel(factor: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``factor`` holds one value per channel of ``x`` (dimension 1) as it broadcasts against ``x``: a
    ``[C]`` factor of a ``[N, C, H, W]`` input, which broadcasts along ``W``, does not (even where ``W == C``).

    Examples:
        >>> x, pooled = torch.zeros(2, 3, 3, 3), torch.zeros(2, 3)
        >>> _per_channel(torch.ones(1, 3, 1, 1), x), _per_channel(torch.ones(3), x), _per_channel(torch.ones(3), pooled)
        (True, False, True)
    """
    if factor.dim() > x.dim():
        return False
    shape = (1,) * (x.dim() - factor.dim()) + tuple(factor.shape)
    channels = x.shape[1] if x.dim() > 1 else 1
    return all(size == 1 for dim, size in enumerate(shape) if dim != min(1, x.dim() - 1)) and factor.numel() == channels


class _Rebased(torch.autograd.Function):
    """``written`` (a frozen BatchNorm's ``x * scale`` with its shift added in place) rebased in place onto the
    history of ``ruled``, the rule's output of the same values: the gradient goes to ``ruled`` alone."""

    @staticmethod
    def forward(ctx, written: torch.Tensor, ruled: torch.Tensor) -> torch.Tensor:
        ctx.mark_dirty(written)
        return written

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, grad


class _FrozenAffine(TorchFunctionMode):
    """The mode a frozen BatchNorm's forward runs in: its ``x * scale + shift`` (or an eval-mode ``F.batch_norm``)
    on the module's input is the BatchNorm's output, merged into the layer before it or given the ε-rule of its
    affine map, as :meth:`MergeBatchNormRule.batch_norm` does for a BatchNorm. What the forward does after it (timm's
    activation inside ``FrozenBatchNormAct2d``) runs on that output, with its own rules."""

    def __init__(self, rule: MergeBatchNormRule, module: nn.Module, record: Any = None) -> None:
        super().__init__()
        self.rule, self.module, self.record = rule, module, record
        self.applied = False
        self.scaled: tuple[torch.Tensor, torch.Tensor] | None = None  # (input, input * scale)
        self._product: list = []  # the arguments of that product

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunction():
            result = func(*args, **kwargs)
            if self.applied:
                return result
            if func is F.batch_norm and args and args[0].requires_grad:
                self.applied = True
                return self.rule.batch_norm(self.module, result, args, kwargs)
            if self.scaled is None and func in _PRODUCTS and len(args) == 2:
                inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
                if len(inputs) == 1 and inputs[0].shape == result.shape:
                    self.scaled, self._product = (inputs[0], result), list(args)
            elif self.scaled is not None and func in _SUMS and any(a is self.scaled[1] for a in args):
                self.applied = True
                statistics = self._statistics(args)
                return self.rule.batch_norm(self.module, result, (self.scaled[0], *statistics), {})
            elif self.scaled is not None and func in _SUMS_IN_PLACE and args and args[0] is self.scaled[1]:
                self.applied = True  # ``out += shift``: ``out`` itself takes the rule's output's history
                statistics = self._statistics(args)
                ruled = self.rule.batch_norm(self.module, result, (self.scaled[0], *statistics), {})
                return result if ruled is result else _Rebased.apply(result, ruled)
            return result

    def _statistics(self, sum_args: tuple) -> tuple:
        """The arguments after the input of the ``F.batch_norm`` call the forward's ``x * scale + shift`` stands for:
        the module's buffers and ε where it holds one (torchvision's, timm's); where it holds none (an ε written in
        its forward, as Hugging Face's ``DetrFrozenBatchNorm2d``, or none at all), the scale and shift the forward
        computed, as the weight and bias of statistics that normalise nothing (mean 0, variance 1, ε 0)."""
        m = self.module
        eps = getattr(m, "eps", None)
        if isinstance(eps, float):
            return (m.running_mean, m.running_var, m.weight, m.bias, False, 0.0, eps)
        x, scaled = self.scaled
        product = [a for a in self._product if a is not x]
        shift = [a for a in sum_args if a is not scaled]
        channels = x.shape[1] if x.dim() > 1 else 1
        factors = [a for a in product + shift if isinstance(a, torch.Tensor)]
        if len(product) != 1 or len(shift) != 1 or len(factors) != 2 or not all(_per_channel(a, x) for a in factors):
            raise ValueError(
                f"MergeBatchNormRule on {type(m).__name__}: a frozen BatchNorm without an eps attribute computed its "
                "x * scale + shift with a scale or shift of other than one value per channel (dimension 1 of its "
                f"input, {channels}), which the rule cannot merge into the layer before it. Give the module an eps "
                "attribute (the ε its forward adds to running_var), or map it to another rule (IgnoreRule: the plain "
                "gradient, unmerged)"
            )
        scale, shift = (a.detach().reshape(channels) for a in factors)
        return (torch.zeros_like(scale), torch.ones_like(scale), scale, shift, False, 0.0, 0.0)
