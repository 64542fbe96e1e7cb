"""The rules for the layer the input reaches first: Flat, w², z^B, and ``FirstLayerRule`` that picks them.

Their relevance is not proportional to the input, so it is set directly: the
gradient carries ``x * grad`` and the rest (where ``x = 0``) is recorded on the
rule's registration for the wrapper to add back. Where glue computes the input
from the model inputs one position each (a normaliser ``(u - mean) / std``),
all of it is recorded, each input position getting the relevance of the value
computed from it (see :func:`~tdhook.attribution.rules._glue.whole_records`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

from tdhook.attribution.rules._arguments import bounds
from tdhook.attribution.rules._autograd import is_plain_gradient, may_overwrite
from tdhook.attribution.rules._caller import warn_at_caller
from tdhook.attribution.rules._glue import note_up_the_glue, rest_records, whole_records
from tdhook.attribution.rules._half_precision import (
    float32_params,
    in_scaled_pass,
    is_half_precision,
    without_autocast,
)
from tdhook.attribution.rules._input_gradients import (
    direct_input_gradient,
    direct_input_gradients,
    has_direct_input_gradient,
)
from tdhook.attribution.rules._layers import bias_view, check_layer_forward, check_layer_input
from tdhook.attribution.rules._numerics import carrying_gradient, pieces, signed_shift, stabilize
from tdhook.attribution.rules.base import (
    _UNPREPARED,
    _ZERO_BIAS,
    ParamModifier,
    Registration,
    Rule,
    _reaches_model_input,
)
from tdhook.attribution.rules.basic import EpsilonRule, IgnoreRule
from tdhook.attribution.rules.modified import _clamp, _ModifiedForwardRule

__all__ = ["FlatRule", "WSquareRule", "ZBoxRule", "FirstLayerRule"]


def _shares(grad: torch.Tensor, z: torch.Tensor, sample: torch.Tensor, epsilon: float | None = None) -> torch.Tensor:
    """``grad · z / d`` for ``d = sample`` or, given ``epsilon``, ``d = stabilize(z − sample, epsilon)``.

    ``sample`` is one sample's tensor (repeated along the batch dimension) or has ``z``'s shape. The work runs
    in cache-sized pieces, and the result is written into ``z`` when :func:`may_overwrite` allows it.
    """
    if not is_plain_gradient(grad, z):
        return grad * z / (sample if epsilon is None else stabilize(z - sample, epsilon))
    share = z if may_overwrite(grad, z) else torch.empty_like(z)
    aligned = pieces(z, grad, share, sample) if sample.shape == z.shape else pieces(z, grad, share, sample=sample)
    for z_, g, s, d, scratch in aligned:
        if epsilon is not None:
            d = torch.sub(z_, d, out=scratch)
            d.add_(signed_shift(d, epsilon))
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

    reads_layer_marks = True  # glue and the first layer: walks that stop at layer outputs
    # The relevance is computed in float32 for a half-precision input, and set at the input itself.
    computes_half_precision_in_float32 = True

    def stand_ins(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [torch.ones_like(x)]

    def modified_output(self, module, registration, params, stand_ins, out_shape) -> torch.Tensor:
        return self._forward(module, registration, params["mod"], stand_ins[0], out_shape)

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
                modified = self._forward(module, registration, params["mod"], ones, z.shape)
                return stabilize(modified, self.stabilizer)

            share = _shares(grad, z, self._for_one_sample(module, params, "denominator", x, z, denominator))
            return direct_input_gradient(module, params["mod"]["weight"], share, x)

    @staticmethod
    def _for_one_sample(
        module, params, name: str, x: torch.Tensor, z: torch.Tensor, compute: Callable[[], torch.Tensor]
    ):
        """``compute()``, a tensor for one sample shaped like those of the output ``z`` for the input ``x``, kept
        while the context lasts (a transposed convolution gives inputs of one shape outputs of several), and for
        calls under the same autocast (a layer computed in bfloat16 there is not the float32 one of other calls)."""
        device = x.device.type
        autocast = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device)
        key = (_one_sample_shape(module, x) or x.shape, z.shape[1:], x.dtype, x.device, autocast)
        kept = params.setdefault("one_sample", {})
        if name not in kept or kept[name][0] != key:  # the latest shape only: memory stays bounded
            kept[name] = (key, compute())
        return kept[name][1]

    def _relevance_by_autograd(self, module, registration, params, x, z, grad) -> torch.Tensor:
        """The relevance from :meth:`stand_ins`, :meth:`modified_output` and :meth:`relevance`."""
        leaves = [s.detach().requires_grad_(True) for s in self.stand_ins(x)]
        z_mod = self.modified_output(module, registration, params, leaves, z.shape)
        start = grad * z / stabilize(z_mod.detach(), self.stabilizer)
        grads = torch.autograd.grad(z_mod, leaves, start, allow_unused=True)
        return self.relevance([s.detach() for s in leaves], grads)

    def input_gradient_keeping_graph(self, module, registration, params, x, z, grad):
        """The relevance ``R`` of ``x`` through autograd, kept in the graph: ``x`` receives ``R / x`` and the
        rest (``R - x · R / x``, where ``x = 0``) is recorded."""
        half = is_half_precision(x)  # in float32 (see _half_precision), set at the input in its dtype
        with without_autocast(x) if half else contextlib.nullcontext():
            wide, params = (x.float(), float32_params(params, keep=False)) if half else (x, params)
            z, grad = (z.float(), grad.float()) if half else (z, grad)
            stand_ins = [s if s is wide else s.detach().requires_grad_(True) for s in self.stand_ins(wide)]
            z_mod = self.modified_output(module, registration, params, stand_ins, z.shape)
            start = grad * z / stabilize(z_mod, self.stabilizer)
            grads = torch.autograd.grad(z_mod, stand_ins, start, create_graph=True, allow_unused=True)
            wide_relevance = self.relevance(stand_ins, grads)
            relevance = set_at_x = wide_relevance.to(x.dtype)
        whole = whole_records(self, module, x, relevance, registration)
        if whole is not None:  # computed by glue position by position, as in input_gradient
            records, relevance = whole
            registration.records.extend(records)
        grad_x = carrying_gradient(relevance, x)
        if half and whole is None and in_scaled_pass():  # scaled down: the rest kept in float32
            rest = wide_relevance - x.float() * grad_x.float()
        else:
            rest = relevance - x * grad_x
        # At a model input, or carried back through the glue before the layer (a Flatten), as without the graph.
        registration.records.extend(rest_records(self, module, x, rest, registration, uncarried=grad_x == 0))
        note_up_the_glue(self, module, x, set_at_x, carried=x * grad_x)
        return grad_x

    def input_gradient(self, module, registration, params, x, z, grad):
        value, wide_relevance = x.detach(), None
        if is_half_precision(value):  # in float32 (see _half_precision), set at the input in its dtype
            with without_autocast(value):
                wide = (float32_params(params), value.float(), z.float(), grad.float())
                wide_relevance = self.direct_relevance(module, registration, *wide)
                relevance = wide_relevance.to(value.dtype)
        else:
            relevance = self.direct_relevance(module, registration, params, value, z, grad)
        set_at_x = relevance
        whole = whole_records(self, module, x, relevance, registration)
        if whole is not None:  # computed by glue position by position: each input position gets its relevance
            records, relevance = whole  # what is left: that of positions mixing several inputs, to the gradient
            registration.records.extend(records)
            if not bool(relevance.any()):
                note_up_the_glue(self, module, x, set_at_x)  # for the relevance of modules named in ``layers``
                return torch.zeros_like(value)
        grad_x = carrying_gradient(relevance, value)
        # The gradient carries R = x * grad_x; what it cannot carry (where x = 0, or R / x overflows) is recorded.
        rest = relevance - value * grad_x
        if wide_relevance is not None and whole is None and in_scaled_pass():  # scaled down: kept in float32
            rest = wide_relevance - value.float() * grad_x.float()
        registration.records.extend(rest_records(self, module, x, rest, registration, uncarried=grad_x == 0))
        note_up_the_glue(self, module, x, set_at_x, carried=value * grad_x)
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

    relevance_from_output_product = True

    def modifiers(self):
        return {"mod": ParamModifier.from_modifiers([ParamModifier(lambda n, p: torch.ones_like(p)), _ZERO_BIAS])}


class WSquareRule(_DirectInputRule):
    """LRP-w²: ``R_i = Σ_j w_ij² R_j / stabilize(Σ_i' w_i'j² + b_j²)`` (zennit squares the bias too).

    Examples:
        >>> WSquareRule(stabilizer=1e-3).stabilizer
        0.001
    """

    relevance_from_output_product = True

    def modifiers(self):
        return {"mod": ParamModifier(lambda n, p: p**2)}


class ZBoxRule(_DirectInputRule):
    """LRP-z^B for inputs bounded in ``[low, high]``.

    ``z^B_j = Σ_i x_i w_ij - l_i w⁺_ij - h_i w⁻_ij`` (biases cancel) and
    ``R_i = Σ_j (x_i w_ij - l_i w⁺_ij - h_i w⁻_ij) R_j / stabilize(z^B_j)``.

    Args:
        low: lowest input value, a float or a tensor broadcastable to one sample.
        high: highest input value, likewise.

    Bounds broadcast against one sample as torch broadcasts, aligned on the input's *last* dimension: a 1-D
    tensor of length ``n`` bounds the last dimension. For an image ``[B, C, H, W]`` per-channel bounds are of shape
    ``[C, 1, 1]`` (or zennit's ``[1, C, 1, 1]``, with the batch dimension); a 1-D tensor of length ``C`` is taken
    per column, and where ``W == C`` nothing else tells, so a convolution given such bounds warns (shape them
    ``[C, 1, 1]`` for channels, or ``[1, W]`` for columns). zennit aligns bounds on the batch dimension instead,
    and refuses a 1-D tensor there.

    Examples:
        >>> ZBoxRule(low=-1.0, high=1.0).low
        -1.0
        >>> mean, std = torch.tensor([0.5, 0.4, 0.3]), torch.tensor([0.2, 0.2, 0.2])
        >>> per_channel = ZBoxRule(low=((0 - mean) / std).view(3, 1, 1), high=((1 - mean) / std).view(3, 1, 1))
    """

    def __init__(
        self,
        low: float | torch.Tensor,
        high: float | torch.Tensor,
        stabilizer: float = 1e-6,
        zero_params: Sequence[str] = (),
    ) -> None:
        bounds(type(self).__name__, low, high)
        super().__init__(stabilizer, zero_params)
        self.low = low
        self.high = high

    def modifiers(self):
        return {"orig": ParamModifier(), "pos": _clamp(min=0.0), "neg": _clamp(max=0.0)}

    def input_gradient(self, module, registration, params, x, z, grad):
        _refuse_bounds_that_do_not_fit(self, module, x)
        _warn_for_bounds_along_columns(self, module, x)
        return super().input_gradient(module, registration, params, x, z, grad)

    def input_gradient_keeping_graph(self, module, registration, params, x, z, grad):
        _refuse_bounds_that_do_not_fit(self, module, x)
        _warn_for_bounds_along_columns(self, module, x)
        return super().input_gradient_keeping_graph(module, registration, params, x, z, grad)

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
            offset = self._forward(module, registration, pos, low, z.shape)
            offset += self._forward(module, registration, neg, high, z.shape)
            for bias, sign in ((params["plain"].get("bias"), 1), (orig.get("bias"), -1)):
                if bias is not None:
                    offset.add_(bias_view(module, bias), alpha=sign)
            return offset

        with torch.no_grad():
            offset = self._for_one_sample(module, params, "offset", x, z, offset)
            share = _shares(grad, z, offset, self.stabilizer)
            through_weight, through_positive = direct_input_gradients(module, [orig["weight"], pos["weight"]], share, x)
            return through_weight.mul_(x - high).add_(through_positive.mul_(high - low))

    def modified_output(self, module, registration, params, stand_ins, out_shape):
        x, low, high = stand_ins
        return (
            self._forward(module, registration, params["orig"], x, out_shape)
            - self._forward(module, registration, params["pos"], low, out_shape)
            - self._forward(module, registration, params["neg"], high, out_shape)
        )

    def relevance(self, stand_ins, grads):
        return sum(s * g for s, g in zip(stand_ins, grads, strict=True) if g is not None)


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
        >>> from tdhook.attribution.rules import EpsilonRule, StopRule
        >>> model, rule = Late(), FirstLayerRule(first=EpsilonRule(), other=StopRule())
        >>> x = torch.randn(2, 3, requires_grad=True)
        >>> with rule.register(model.stem), rule.register(model.head):
        ...     model(x).requires_grad  # the head, declared first, is not the first layer: StopRule
        False
    """

    reads_layer_marks = True  # glue and the first layer: walks that stop at layer outputs

    uses_input = False

    @property
    def differentiable(self) -> bool:  # type: ignore[override]
        return self.first.differentiable and self.other.differentiable

    def __init__(self, first: Rule, other: Rule | None = None) -> None:
        for name, rule in (("first", first), ("other", other if other is not None else Rule())):
            if not isinstance(rule, Rule):
                raise TypeError(f"FirstLayerRule: {name} must be a Rule, got {type(rule).__name__}")
        super().__init__()
        self.first = first
        self.other = other if other is not None else IgnoreRule()

    def _new_registration(self, module: nn.Module) -> Registration:
        if any(type(rule).prepare is not Rule.prepare for rule in self._pair):
            # What the rules will read is prepared in the call; a layer they cannot run is refused now, so that
            # the error names it (a layer whose forward is not linear in its convolution's output).
            check_layer_forward(module)
        for rule in self._pair:
            if isinstance(rule, EpsilonRule):
                # The check the ε-rule runs at its own registration (a tanh, a clip or a norm inside the layer's
                # forward), which the inner registrations below skip: a pair without a modified pass checked nothing.
                check_layer_input(module, rule.epsilon, rule.norms_ruled)
        outer = Registration(None)
        # Both inner registrations share the outer one's records, read by the handle. Their
        # state is prepared at the first call that needs it: most layers never use ``first``. Each notes the
        # layer's mode: a rule that checks the layer's forward in its mode checks it again in a call of the other
        # (EpsilonRule.resolve).
        training = module.training
        outer.state = [
            Registration(_UNPREPARED, records=outer.records, busy=outer.busy, training=training) for _ in self._pair
        ]
        return outer

    @property
    def _pair(self) -> tuple[Rule, Rule]:
        return self.first, self.other

    def resolve(self, module, registration, inputs):
        index = 0 if inputs and isinstance(inputs[0], torch.Tensor) and _reaches_model_input(inputs[0]) else 1
        rule, inner = self._pair[index], registration.state[index]
        rule.prepared_state(module, inner)
        if module.training != inner.training:  # the ε-rule's check of a mode changed since registration
            rule, inner = rule.resolve(module, inner, inputs)
            inner.training = module.training
        return rule, inner


def _refuse_bounds_that_do_not_fit(rule: ZBoxRule, module: nn.Module, x: torch.Tensor) -> None:
    """Refuse a tensor bound that does not broadcast to the layer's input, naming the layer and both shapes (torch's
    own error named neither the rule nor the bound)."""
    for name in ("low", "high"):
        bound = getattr(rule, name)
        if not isinstance(bound, torch.Tensor):
            continue
        try:
            fits = torch.broadcast_shapes(bound.shape, x.shape) == x.shape
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(
                f"ZBoxRule on {type(module).__name__}: the bound {name!r} of shape {list(bound.shape)} does not "
                f"broadcast to the layer's input of shape {list(x.shape)}; give a float, or a tensor shaped like one "
                f"sample {list(x.shape[1:])} or broadcastable to it (per channel: [{x.shape[1]}"
                f"{', 1' * (x.dim() - 2)}])"
            )


def _warn_for_bounds_along_columns(rule: ZBoxRule, module: nn.Module, x: torch.Tensor) -> None:
    """Warn, once per rule, where a convolution's input ``[B, C, ...]`` gets a 1-D bound of length ``C`` that
    broadcasting lays along its last dimension, of the same length: per-channel bounds taken per column."""
    if getattr(rule, "_warned_columns", False) or x.dim() < 3 or not isinstance(module, nn.modules.conv._ConvNd):
        return
    channels, last = x.shape[1], x.shape[-1]
    for name in ("low", "high"):
        bound = getattr(rule, name)
        if isinstance(bound, torch.Tensor) and bound.dim() == 1 and bound.numel() == channels == last > 1:
            rule._warned_columns = True
            warn_at_caller(
                f"ZBoxRule: the bound {name!r} is a 1-D tensor of length {channels}, the input's channel count, but "
                f"broadcasting lays it along the input's last dimension (its width, also {last}): it bounds columns, "
                f"not channels. Give it the shape [{channels}{', 1' * (x.dim() - 2)}] for per-channel bounds, or "
                f"[1, {last}] to mean columns"
            )
            return
