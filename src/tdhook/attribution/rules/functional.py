"""Rules for functions that are not modules: products, softmax, attention, functional activations and norms.

Transformers compute attention with ``torch.matmul``, ``torch.bmm``,
``F.softmax`` or a fused ``F.scaled_dot_product_attention``, inside a module's
``forward``. :class:`FunctionalRules` is a ``TorchFunctionMode``: while the LRP
wrapper runs the model's forward pass inside it, it gives those calls the
transformer rules (see :mod:`~tdhook.attribution.rules.transformer`).
Nothing in the model, its classes or the process is patched, and the mode
ends with the forward pass.

Only calls on *activations* are changed: tensors with autograd history, as
opposed to parameters, buffers and constants.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tdhook.attribution.rules._attention_calls import attention, attention_in_graph, held_in_graph
from tdhook.attribution.rules._attention_projections import ATTENTION_BODIES, projected
from tdhook.attribution.rules._autograd import (
    PARAMETER_DERIVED,
    call_argument,
    first_input_is,
    hold,
    is_activation,
    mark_parameter_derived,
    raise_for_transformed_call,
    scale_gradient,
)
from tdhook.attribution.rules._clips import (
    BOUNDS,
    CLIPS,
    CLIPS_IN_PLACE,
    bound_passing,
    bounded_signal,
    clip_bounds,
    clip_passing,
    clips_a_signal,
    clips_at_zero_only,
    clips_in_place,
    clips_nothing,
    mark_clipped,
)
from tdhook.attribution.rules._constant_elements import CONSTANT_MASKS_MADE
from tdhook.attribution.rules._constant_matmuls import MATMULS, constant_baddbmm, constant_einsum, constant_matmul
from tdhook.attribution.rules._cosine_similarity import COSINE_SIMILARITY, cosine_as_products
from tdhook.attribution.rules._dropout_calls import DROPOUTS, dropout_probability, warn_random_dropout
from tdhook.attribution.rules._filled_gates import WHERES
from tdhook.attribution.rules._first_pass import first_pass
from tdhook.attribution.rules._fused_products import FUSED_PRODUCTS, fused_factors, fused_product
from tdhook.attribution.rules._gate_writes import GATE_MASKS_MADE
from tdhook.attribution.rules._generated_linear import generated_linear, linear_as_product
from tdhook.attribution.rules._held_following import follow_held
from tdhook.attribution.rules._held_statistics import (
    DIVISIONS,
    NORM_CALLS,
    STATISTICS_AND_MEANS,
    divides_by_statistic,
    mean_apart,
    norm_call,
    statistic_factors,
)
from tdhook.attribution.rules._held_values import WEIGHTS_KEPT, weights_kept
from tdhook.attribution.rules._in_place_activations import (
    IN_PLACE_FORMS,
    activation_in_place,
    calls_in_place,
)
from tdhook.attribution.rules._in_place_products import PRODUCTS_IN_PLACE, product_in_place, two_activations_in_place
from tdhook.attribution.rules._input_values import INPUT_VALUES, watch_values
from tdhook.attribution.rules._joined_gates import OTHER_MASKS_MADE
from tdhook.attribution.rules._joined_weights import (
    WEIGHTS_MASKS_MADE,
    mixed_weights_product,
    weights_held_where_mixed,
    weights_shown,
)
from tdhook.attribution.rules._keeping_graph import graph_kept
from tdhook.attribution.rules._kept_constants import CONSTANTS_KEPT
from tdhook.attribution.rules._keyword_factors import positional_factors
from tdhook.attribution.rules._mixed_gate_products import mixed_gate_product
from tdhook.attribution.rules._narrowed_softmax import raise_for_unseen_rows
from tdhook.attribution.rules._odd_unit_gates import ERFS, ODD_UNITS, mark_odd_unit
from tdhook.attribution.rules._recomputed import raise_for_checkpoint, saved_tensors_hooked
from tdhook.attribution.rules._self_gates import mark_self_gated
from tdhook.attribution.rules._unrecorded_writes import NOT_READ, UNRECORDED, note_out_write, read_unrecorded
from tdhook.attribution.rules._whole_choices import choice_follows_values
from tdhook.attribution.rules._zero_input_calls import watch_zero_inputs
from tdhook.attribution.rules.basic import (
    RULED_ON_NODE,
    clipped_on_node,
    hook_pass_rule,
    pass_rule_given_input,
    pass_rule_on_node,
)
from tdhook.attribution.rules.gates import (
    ELEMENTWISE_PRODUCTS,
    GATE_FUNCTIONS,
    GATE_MULTIPLICATIONS,
    GATE_PRESERVING,
    held_factors,
    held_gate_product,
    held_glu,
    keep_gate_mark,
    keep_held_product_mark,
    mark_gate,
    mark_weights,
    marked_call,
    weighing_factors,
)
from tdhook.attribution.rules.transformer import (
    AHQKVRule,
    LayerNormRule,
    PseudoIdentityRule,
    SoftmaxEpsilonRule,
    uniform_product,
)

if TYPE_CHECKING:
    from tdhook.attribution._function_rule_plan import Recording
    from tdhook.attribution.rules.basic import EpsilonRule

__all__ = ["FunctionalRules"]

_PRODUCTS = frozenset(
    {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm, torch.mm, torch.Tensor.mm}
    | {torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.multiply, torch.Tensor.multiply}
)
_SOFTMAX = frozenset({F.softmax, torch.softmax, torch.Tensor.softmax})
_ACTIVATION_FUNCTIONS = frozenset(
    {F.gelu, F.silu, F.mish, F.elu, F.selu, F.celu, F.softplus, F.sigmoid, F.hardsigmoid, F.tanh, F.hardswish}
    | {F.leaky_relu}
    | {torch.tanh, torch.sigmoid, torch.Tensor.tanh, torch.Tensor.sigmoid}
    | ERFS
    | set(IN_PLACE_FORMS)
)


# Clipping calls on up to this many elements get their rule on their node in a recording call; larger ones keep the
# mode's rule (and every call its mode): at a realistic size (an OLMo of hidden size 256, 4 layers, 4 × 128 tokens,
# 131k elements in each clipped projection) AttnLRP took 1.20-1.24x a gradient pass with the rule on the nodes,
# 1.12-1.17x in the mode (one CPU thread); at the tiny size (448 elements) 1.38-1.50x against 1.79-1.98x.
_LARGEST_CLIP_ON_NODE = 2**14

_BADDBMM = frozenset({torch.baddbmm, torch.Tensor.baddbmm})
# What :meth:`FunctionalRules._other_rules` returns for a call none of them changes.
_NO_RULE = object()

_HANDLED = frozenset(
    _PRODUCTS
    | _SOFTMAX
    | _ACTIVATION_FUNCTIONS
    | set(DROPOUTS)
    | {torch.baddbmm, torch.Tensor.baddbmm, torch.einsum, F.scaled_dot_product_attention, F.layer_norm, F.rms_norm}
    | {F.multi_head_attention_forward}
    | CLIPS
    | set(CLIPS_IN_PLACE)
    | BOUNDS
    | {F.glu}
    | FUSED_PRODUCTS
    | DIVISIONS
    | set(NORM_CALLS)
    | STATISTICS_AND_MEANS
    | {COSINE_SIMILARITY}
)


def _body_of(func: Callable) -> Callable:
    """``func`` without its own ``__torch_function__`` dispatch, so that the mode sees the calls inside it.

    A Python function of ``torch.nn.functional`` hands itself whole to the active
    mode; a copy whose ``has_torch_function`` is false runs its body instead,
    and every torch call in the body still goes through the mode.
    """
    namespace = {**func.__globals__, "has_torch_function": lambda *_: False}
    body = types.FunctionType(func.__code__, namespace, func.__name__, func.__defaults__, func.__closure__)
    body.__kwdefaults__ = func.__kwdefaults__
    return body


# Python functions made of other torch calls: the mode runs their bodies, whose calls it then sees.
_COMPOSITES = {F.multi_head_attention_forward: _body_of(F.multi_head_attention_forward)}
# ``F.cosine_similarity``: its value, written out (``normalize(x1) · normalize(x2)`` summed), whose calls get the rules.
_COMPOSITES[COSINE_SIMILARITY] = cosine_as_products


class FunctionalRules(TorchFunctionMode):
    """Apply AttnLRP's (or CP-LRP's) rules to functional calls during a forward pass.

    * products of two activations (``a * b``, ``a @ b``, ``torch.multiply``, ``mm``, ``torch.bmm``,
      ``torch.baddbmm``, an ``einsum`` of two operands, ``F.linear`` by a weight computed from activations): the
      uniform rule, half of the relevance to each factor;
      with ``hold_gates``, a factor that is an activation function's output
      (a gate) is held constant instead and the other factor gets it all;
    * a sigmoid-like gate (the output of a sigmoid or hard sigmoid, a module under
      :class:`~tdhook.attribution.rules.gates.GateRule` included) times an activation:
      the gate is held constant under AttnLRP too (signal-take-all). A gate is
      no signal: sigmoid(0) is ½, so the identity rule would pass the gate's half
      back through a gradient scaled by sigmoid(s) / s, unbounded as s → 0, and
      relevance that cancels only in exact arithmetic would grow with every
      squeeze-excite block;
    * ``softmax``: ``softmax`` (a :class:`SoftmaxEpsilonRule`, or an
      :class:`AHQKVRule` for CP-LRP, which holds the attention weights constant);
    * ``F.scaled_dot_product_attention``: the same rules as the unfused
      ``softmax(q · kᵀ) · v``; with a non-zero softmax ε, or in a call that keeps the
      relevance's graph (the fused kernels have no second derivative), it is computed unfused;
    * functional activations (``F.gelu``, ``F.silu``, ``torch.tanh``, …, in place too: ``h.sigmoid_()``,
      ``F.elu_``) and clipping calls (``clamp``, ``clamp_min``, ``clamp_max``, ``clip``, ``F.hardtanh``,
      ``F.relu6``, in place too; ``torch.maximum``,
      ``minimum``, ``fmax``, ``fmin`` of an activation and a constant): ``activation`` (a
      :class:`PseudoIdentityRule`); a clip of a statistic that normalises (``norm.clamp_min(eps)``, a divisor's
      guard) keeps its plain gradient (see :mod:`~tdhook.attribution.rules._statistics`);
    * ``F.glu`` (``a · sigmoid(b)``): its gate held constant, ``a`` gets all the relevance;
    * ``F.layer_norm`` and ``F.rms_norm``: :class:`LayerNormRule`; ``F.normalize``, ``F.group_norm``,
      ``F.instance_norm`` and ``F.local_response_norm``: the norm rule; a statistic that normalises (a norm written
      out, ``h * rsqrt(mean(h * h) + ε)``, ``h / h.norm(...)``) where it scales an activation, as a factor of an
      element-wise product or a divisor: held constant (see :mod:`~tdhook.attribution.rules._held_statistics`);
      ``F.cosine_similarity`` as it is written out (:mod:`~tdhook.attribution.rules._cosine_similarity`).

    Args:
        softmax: the rule for softmax and attention weights.
        activation: the rule for element-wise activations.
        hold_gates: hold gates constant in products (CP-LRP) rather than
            sharing relevance uniformly (AttnLRP).
        projection: the ε-rule of the dense layers, for the projections ``nn.MultiheadAttention`` computes with
            its parameters by ``F.linear`` calls of its own (``None``: their plain gradient, LRP-0).

    Examples:
        >>> q = torch.randn(1, 2, 3, 4, requires_grad=True)
        >>> k, v = (torch.randn(1, 2, 3, 4, requires_grad=True) for _ in range(2))
        >>> with FunctionalRules(SoftmaxEpsilonRule(), PseudoIdentityRule()):
        ...     out = F.scaled_dot_product_attention(q * 1, k * 1, v * 1)
        >>> torch.equal(out, F.scaled_dot_product_attention(q, k, v))
        True
        >>> grad_v = torch.autograd.grad(out.sum(), v)[0]  # half of the plain gradient
        >>> torch.allclose(grad_v, torch.autograd.grad(F.scaled_dot_product_attention(q, k, v).sum(), v)[0] / 2)
        True
    """

    #: the rules keep the graph in a call that asks for it (``LRP(..., create_graph=True)``)
    differentiable = True
    #: clipping calls get the identity rule (the watch of nonlinear calls names those made by ATen operators)
    passes_clips = True

    def __init__(
        self,
        softmax: SoftmaxEpsilonRule,
        activation: PseudoIdentityRule,
        hold_gates: bool = False,
        projection: EpsilonRule | None = None,
    ) -> None:
        expected = (("softmax", softmax, SoftmaxEpsilonRule), ("activation", activation, PseudoIdentityRule))
        for name, value, kind in expected:
            if not isinstance(value, kind):
                raise TypeError(f"FunctionalRules: {name} must be a {kind.__name__}, got {type(value).__name__}")
        super().__init__()
        self.softmax = softmax
        self.activation = activation
        self.hold_gates = hold_gates
        #: the rule of the projections an attention module computes with its parameters (see _attention_projections)
        self.projection = projection
        self._in_attention = 0
        #: where a call records what the mode does (see :mod:`tdhook.attribution._function_rule_plan`)
        self.recording = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs and func in _HANDLED:  # ``alibi.baddbmm(batch1=q, batch2=k)``, ``gelu(input=h)``: read by position
            args, kwargs = positional_factors(func, args, kwargs)
        if kwargs and "out" in kwargs:  # an ``out=`` write into an alias, or under no_grad: see _unrecorded_writes
            note_out_write(func, kwargs["out"])
        if UNRECORDED and (read := read_unrecorded(func, args, kwargs)) is not NOT_READ:  # see _unrecorded_writes
            return read
        if self.recording is not None and self.recording.follows:  # tensors held in the graph exist: follow them
            return follow_held(self, func, types, args, kwargs, self.recording)
        if func is F.linear and self._in_attention and self.projection is not None:
            if not generated_linear(func, args, kwargs):  # by parameters: the projection's ε, as its layer's
                return projected(self.projection, args, kwargs)
        # Most calls, and a maximum or minimum that clips no activation at a constant: run, and mark what the rules
        # read later (no rule of their own).
        if (
            (
                func not in _HANDLED
                and not (func is F.linear and generated_linear(func, args, kwargs))
                and not two_activations_in_place(func, args, kwargs)
            )
            or (func in BOUNDS and bounded_signal(func, args, kwargs) is None)
            or (func in DIVISIONS and not divides_by_statistic(args, kwargs))
        ):
            result = marked_call(func, args, kwargs)  # (an in-place write judged by what it writes)
            if self.recording is not None:
                watch_values(self.recording, func, args, result)
                if func in WHERES and choice_follows_values(func, args, kwargs):  # see _whole_choices
                    self.recording.other_rule()  # (its gates follow the condition's values, which no plan follows)
            kept = func in GATE_PRESERVING or func in WEIGHTS_KEPT or (CONSTANT_MASKS_MADE and func in CONSTANTS_KEPT)
            return keep_gate_mark(func, args, result, kwargs) if kept else result
        what = "the transformer rules on products, softmax, attention, activations and norms"
        raise_for_checkpoint(what)
        raise_for_transformed_call(what, args, needs=2 if func in _PRODUCTS or func in PRODUCTS_IN_PLACE else 1)
        recording = self.recording
        if recording is None:
            return self._ruled(func, args, kwargs)
        self.recording = None  # the calls a rule makes are its own
        try:
            return self._ruled(func, args, kwargs, recording)
        finally:
            self.recording = recording

    def _ruled(self, func, args: tuple, kwargs: dict, recording: Recording | None = None):
        """A call of a function the mode has rules for (products, softmax, attention, activations, norms); what
        the rule did, told to ``recording`` (a call whose rules a later call may apply without the mode)."""
        if func in DIVISIONS:  # by a statistic (``h / h.norm(...)``): held constant, as a norm's scale
            return weights_kept(args, (), _held_product(func, args, kwargs, [False, True], recording))
        if func in PRODUCTS_IN_PLACE:  # ``a.mul_(b)``, ``a *= b``: the rule of ``a * b``
            return product_in_place(func, *args, hold_gates=self.hold_gates, recording=recording)
        if func in _PRODUCTS and len(args) == 2 and is_activation(args[0]) and is_activation(args[1]):
            if CONSTANT_MASKS_MADE and func in MATMULS:  # a factor with constants in part (a key cache's join)
                mixed = constant_matmul(func, args, kwargs, _uniform_product(func, kwargs))
                if mixed is not None:
                    if recording is not None:  # (a rule a later call does not plan: it runs in the mode)
                        recording.other_rule()
                    return mixed
            # A statistic (a norm written out: ``h * rsqrt(mean(h²) + ε)``) held constant, as a norm's scale; a gate.
            statistics = statistic_factors(func, args)
            # (CP-LRP: gates of another kind; constants in part, their gates' note maybe gone with a join)
            masks = GATE_MASKS_MADE or (OTHER_MASKS_MADE and self.hold_gates) or CONSTANT_MASKS_MADE
            if statistics is None and masks and func in ELEMENTWISE_PRODUCTS:
                # A factor a gate in some elements only (a join of gates and other activations): element by element.
                # (Its elements no gate a join's weights in part: held there too, see _joined_weights.)
                ungated = weights_held_where_mixed(func, args, kwargs, _ungated_product(func, args, kwargs))
                mixed = mixed_gate_product(func, args, kwargs, self.hold_gates, ungated)
                if mixed is not None:
                    if recording is not None:  # (a rule a later call does not plan: it runs in the mode)
                        recording.other_rule()
                    return mixed
            gates = statistics or held_factors(args, any_gate=self.hold_gates)
            if gates is None and WEIGHTS_MASKS_MADE and func in ELEMENTWISE_PRODUCTS:
                # A factor a softmax's weights in some elements only (a join of weights and other activations).
                mixed = mixed_weights_product(func, args, kwargs, _uniform_product(func, kwargs))
                if mixed is not None:
                    if recording is not None:  # (a rule a later call does not plan: it runs in the mode)
                        recording.other_rule()
                    return mixed
            if gates is None and func in ELEMENTWISE_PRODUCTS:  # a softmax's weights mixing branches: held
                gates = weighing_factors(args)
            if gates is not None:
                product = _held_product(func, args, kwargs, gates, recording)
            else:
                # Halving the product's gradient halves both factors' gradients: the uniform rule, in one step.
                # The product is a fresh tensor: rebased in place, so that later in-place operations stay legal.
                product = func(*args, **kwargs)
                node = product.grad_fn
                product = scale_gradient(product, 0.5, in_place=True)
                if recording is not None:
                    recording.scaled(node, product.grad_fn)
            if func in ELEMENTWISE_PRODUCTS:  # of two factors that products hold: one too (see _held_values)
                keep_held_product_mark(args, product, self.hold_gates)
                if gates is not None:  # x * sigmoid(x) written out: an activation's output (see _self_gates)
                    mark_self_gated(args, product)
            return product
        if CONSTANT_MASKS_MADE and (func is torch.einsum or func in _BADDBMM):  # a factor with constants in part
            mixed = _constant_bilinear(func, args, kwargs)
            if mixed is not None:
                if recording is not None:  # (a rule a later call does not plan: it runs in the mode)
                    recording.other_rule()
                return mixed
        if func is torch.einsum and recording is not None:
            operands = _einsum_operands(args)
            two = len(operands) == 2 and all(is_activation(operand) for operand in operands)
            weights = _elementwise(args[0]) and weighing_factors(tuple(operands), broadcast=False)
            two = two and not weights  # (weights: held)
            if two and held_factors(tuple(operands), any_gate=self.hold_gates) is None:
                # A product of two activations (Funnel's relative attention), often a view: its own node halves the
                # gradient it passes (the uniform rule), in this call and in a later one.
                product = torch.einsum(args[0], *operands, **kwargs)
                if recording.halved(product.grad_fn):
                    return product
                return scale_gradient(product, 0.5, in_place=True)
        if func in _SOFTMAX and args and is_activation(args[0]):
            dim = call_argument(args, kwargs, 1, "dim")
            output = func(*args, **kwargs)
            if output.dtype != args[0].dtype:  # computed in another dtype: a mask's lowest value may become -inf
                raise_for_unseen_rows(args[0], output, dim)
            if recording is not None and isinstance(self.softmax, AHQKVRule) and held_in_graph(output):
                # Held whole without a detach (see _function_rule_plan): a constant to the rules, as a parameter is.
                recording.held_output(output)
                setattr(output, PARAMETER_DERIVED, True)
                setattr(output, INPUT_VALUES, True)  # a constant to the rules, but its values are the inputs'
                return mark_weights(output)  # weights, as AHQKVRule marks them (see _joined_weights)
            ruled = self.softmax.apply(output, args[0], dim)
            if recording is not None and ruled is not output:  # but for ε = 0 (the plain gradient)
                recording.other_rule()
            return ruled
        if func in DROPOUTS:
            p = dropout_probability(func, args, kwargs)
            warn_random_dropout(p)
            if recording is not None and p:  # random: every later call runs in the mode, and warns
                recording.other_rule()
            return mark_parameter_derived(args, func(*args, **kwargs), func)
        if func is F.scaled_dot_product_attention and recording is not None:
            attended = attention_in_graph(self, args, kwargs, recording)
            if attended is not None:
                return attended
        result = self._other_rules(func, args, kwargs, recording)
        if result is _NO_RULE:
            result = mark_parameter_derived(args, func(*args, **kwargs), func)
            result = keep_gate_mark(func, args, result, kwargs) if func in GATE_MULTIPLICATIONS else result
        elif recording is not None and not _ruled_on_own_node(recording, result):
            recording.other_rule()
        if func in CLIPS or func in CLIPS_IN_PLACE:  # weights clipped at numbers: weights (see _held_values)
            weights_kept(args, clip_bounds(args, kwargs), result)
        elif func is F.normalize:  # weights divided by their norm, held constant: weights
            weights_kept(args, (), result)
        return result

    def _other_rules(self, func, args: tuple, kwargs: dict, recording: Recording | None = None):
        """The rules but those for products and softmax; ``_NO_RULE`` where none applies. An activation whose node
        saved its input gets the rule on that node in a recording call (a later call puts it there as well)."""
        if func is torch.einsum:
            operands = _einsum_operands(args)
            if len(operands) == 2 and all(is_activation(operand) for operand in operands):
                return self._einsum(args, kwargs)
            return _NO_RULE
        if func in _BADDBMM and len(args) >= 3 and is_activation(args[1]) and is_activation(args[2]):
            return _batched_product(func, args, kwargs, self.hold_gates, recording)
        if func in FUSED_PRODUCTS:  # ``torch.addcmul(h, g, n)``, ``torch.lerp(h, n, z)``: the product's rule
            return _fused(func, args, kwargs, self.hold_gates, recording)
        if func is F.scaled_dot_product_attention:
            return attention(self, *args, **kwargs)
        if func in _ACTIVATION_FUNCTIONS and args and is_activation(args[0]):
            result = _activation(self, func, args, kwargs, recording)
            return mark_odd_unit(result) if func in ODD_UNITS else result  # 1 + tanh(h): a gate (_odd_unit_gates)
        if func in CLIPS or func in CLIPS_IN_PLACE:
            # Of a statistic, a divisor's guard (``norm.clamp_min(eps)``): its plain gradient.
            return self._clip(func, args, kwargs, recording) if clips_a_signal(func, args) else _NO_RULE
        if func in BOUNDS:  # ``torch.maximum(h, c)`` with a constant ``c``: a clip (two activations: not here)
            signal = bounded_signal(func, args, kwargs)
            return bound_passing(func, args, kwargs, signal, self.activation.apply, self.activation)
        if func is F.glu and is_activation(args[0]):
            return held_glu(args[0], call_argument(args, kwargs, 1, "dim", -1))
        if func is F.layer_norm and is_activation(args[0]):
            shape = call_argument(args, kwargs, 1, "normalized_shape")
            weight = call_argument(args, kwargs, 2, "weight")
            eps = call_argument(args, kwargs, 4, "eps", 1e-5)
            return LayerNormRule.layer_norm(func(*args, **kwargs), args[0], len(shape), weight, eps)
        if func is F.rms_norm and is_activation(args[0]):
            shape = call_argument(args, kwargs, 1, "normalized_shape")
            weight = call_argument(args, kwargs, 2, "weight")
            eps = call_argument(args, kwargs, 3, "eps")
            return LayerNormRule.rms_norm(func(*args, **kwargs), args[0], len(shape), weight, eps)
        if func in NORM_CALLS and is_activation(args[0]):
            return norm_call(func, args, kwargs)
        if func in STATISTICS_AND_MEANS and is_activation(args[0]):
            return mean_apart(func, args, kwargs)
        if func in _COMPOSITES:
            self._in_attention += func in ATTENTION_BODIES
            try:
                with self:
                    return _COMPOSITES[func](*args, **kwargs)
            finally:
                self._in_attention -= func in ATTENTION_BODIES
        if func is F.linear:  # by a weight computed from activations: the product of two activations it is
            with self:
                return linear_as_product(*args, **kwargs)
        return _NO_RULE

    def _clip(self, func: Callable, args: tuple, kwargs: dict, recording: Recording | None = None):
        """A clipping call on an activation (``clamp``, ``clamp_min``, ``clamp_max``, ``clip``, ``F.hardtanh``,
        ``F.relu6``, in place or not): the identity rule, as ``nn.Hardtanh`` and ``nn.ReLU6`` get it, so that a unit
        clipped at a bound other than zero passes its relevance on (its gradient is zero). Bounds that are activations
        (``torch.clamp(x, min=y)``: a maximum of two signals) keep the plain gradient. In place, the rule's output is
        copied into the argument. In a recording call, the rule goes on the call's own node where it can (see
        :meth:`_clip_on_node`)."""
        x = args[0]
        bounds = clip_bounds(args, kwargs)
        if any(is_activation(bound) for bound in bounds):
            return mark_parameter_derived(args, func(*args, **kwargs), func)
        if clips_at_zero_only(func, args, kwargs) or clips_nothing(func, args, kwargs):  # a ReLU or the identity:
            return func(*args, **kwargs)  # its plain gradient, exact at any scale
        in_place = clips_in_place(func, args, kwargs)
        if recording is not None and self._clips_on_node(x, bounds, in_place, recording):
            return self._clip_on_node(func, args, kwargs, in_place, recording)
        return clip_passing(func, args, kwargs, self.activation.apply, self.activation)

    def _clips_on_node(self, x: torch.Tensor, bounds: list, in_place: bool, recording: Recording) -> bool:
        """Whether a clipping call of ``x`` in a recording call can get the identity rule on its own node, which
        saved ``x`` (see :func:`~tdhook.attribution.rules.basic.clipped_on_node`): bounds that are numbers, no kept
        graph nor saved-tensor hooks (as for GELU, see :func:`~tdhook.attribution.rules.basic.pass_rule_on_node`),
        the rule's own arithmetic (a rule of one's own keeps the mode), no more elements than the mode costs more
        on (see ``_LARGEST_CLIP_ON_NODE``); in place, on a tensor that is no view and has a node (else the call's
        node would not be the plain call's)."""
        return (
            type(self.activation).apply is PseudoIdentityRule.apply
            and not recording.settled
            and torch.is_grad_enabled()
            and graph_kept() is None
            and not saved_tensors_hooked()
            and not any(isinstance(bound, torch.Tensor) for bound in bounds)
            and x.numel() <= _LARGEST_CLIP_ON_NODE
            and (not in_place or (x.grad_fn is not None and not x._is_view()))
        )

    def _clip_on_node(self, func: Callable, args: tuple, kwargs: dict, in_place: bool, recording: Recording):
        """A clipping call as a plain call makes it, with the identity rule on its node (a hook that computes the
        factor from the input the node saved, the same values as the mode's), where a later call puts it as well.
        Marked as :meth:`_clip` marks its result: a new output as the rule's, an argument changed in place as it
        was. Not in place, a node of another kind gets the rule as :meth:`_clip` gives it."""
        x = args[0]
        edge = (x.grad_fn, x.output_nr)
        before = x.detach().clone() if in_place and first_pass() is not None else x  # watched for units at 0
        output = func(*args, **kwargs)
        node = output.grad_fn
        stabilizer = self.activation.stabilizer
        if not in_place:
            if clipped_on_node(node) and not output._is_view() and not output.__dict__ and first_input_is(node, x):
                recording.hooked(node, functools.partial(hook_pass_rule, stabilizer))
                setattr(output, RULED_ON_NODE, stabilizer)
                watch_zero_inputs(self.activation, func, x, output, output)
                return mark_clipped(mark_gate(output, x))
            result = self.activation.apply(output, x)
            watch_zero_inputs(self.activation, func, x, output, result)
            return mark_clipped(result)
        if not clipped_on_node(node) or node.next_functions[0] != edge:  # not reached: bounds that are numbers
            raise RuntimeError(f"FunctionalRules: {func.__name__} in place made a {type(node).__name__} node")
        recording.hooked(node, functools.partial(hook_pass_rule, stabilizer))
        watch_zero_inputs(self.activation, func, before, output, output)
        return output

    def covers(self, func: Callable, args: tuple) -> bool:
        """Whether this mode gives ``func`` a rule (products, softmax, attention, activations, norms); an
        ``einsum`` of more than two operands has none."""
        if func in DIVISIONS:
            return divides_by_statistic(args)
        if func in STATISTICS_AND_MEANS:  # its statistic keeps its plain gradient where it scales no activation
            return False
        if func is F.linear:
            return generated_linear(func, args, {})
        if func in PRODUCTS_IN_PLACE:
            return two_activations_in_place(func, args, {})
        if func in FUSED_PRODUCTS:
            return fused_factors(func, args, {}, _held_in_fused(self.hold_gates)) is not None
        return func in _HANDLED and (func is not torch.einsum or len(_einsum_operands(args)) == 2)

    def _einsum(self, args: tuple, kwargs: dict) -> torch.Tensor:
        """``torch.einsum(equation, a, b)`` of two activations: a product, as ``a @ b`` is (bilinear, so the uniform
        rule gives each factor half); of other operands, the plain call."""
        operands = _einsum_operands(args)
        if len(operands) != 2 or not all(is_activation(operand) for operand in operands):
            return mark_parameter_derived(args, torch.einsum(*args, **kwargs))
        equation = args[0]

        def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.einsum(equation, a, b, **kwargs)

        held = held_gate_product(product, tuple(operands), {}, any_gate=self.hold_gates)
        weights = (
            weighing_factors(tuple(operands), broadcast=False) if held is None and _elementwise(equation) else None
        )
        if weights is not None:  # ``einsum("bi,bi->bi", w, h)``: a softmax's weights held, as in ``w * h``
            return _held_product(product, tuple(operands), {}, weights, None)
        return held if held is not None else scale_gradient(product(*operands), 0.5, in_place=True)


def _activation(mode: FunctionalRules, func, args: tuple, kwargs: dict, recording: Recording | None):
    """An activation function called on an activation (``F.gelu(h)``, ``torch.tanh(h)``): the mode's activation rule,
    on the node where a later call can put it too (see :mod:`tdhook.attribution._function_rule_plan`); a sigmoid-like
    gate marked, and left without its rule where a product holds it."""
    if calls_in_place(func, args, kwargs):  # the rule on a copy of the input: the call overwrites it
        return activation_in_place(func, args, kwargs, mode.activation.apply, mode.activation)
    output = func(*args, **kwargs)
    if recording is not None and func in GATE_FUNCTIONS and graph_kept() is None and output.grad_fn is not None:
        # A sigmoid-like gate, held where a product takes it: its own rule would change nothing there.
        recording.unruled_gate(output.grad_fn)
        return mark_gate(output, args[0], sigmoid=True)
    # The node's hook is the identity rule's own: a rule of one's own (another ``apply``) keeps the mode.
    own = type(mode.activation).apply is PseudoIdentityRule.apply
    if recording is not None and own and pass_rule_on_node(output, args[0]):
        stabilizer = mode.activation.stabilizer
        if recording.hooked(output.grad_fn, functools.partial(hook_pass_rule, stabilizer)):
            setattr(output, RULED_ON_NODE, stabilizer)
            watch_zero_inputs(mode.activation, func, args[0], output, output)
            return mark_gate(output, args[0])  # marked as the rule marks its output (see PseudoIdentityRule)
    # A node that saved its output (tanh): the input is a module's output, which later calls keep for it;
    # or else the nodes below it compute the input again (Gemma 2's softcapping).
    if recording is not None and own and pass_rule_given_input(output, args[0]):
        stabilizer = mode.activation.stabilizer
        if recording.hooked_given(output.grad_fn, args[0], stabilizer) or recording.hooked_recomputed(
            output.grad_fn, args[0], stabilizer
        ):
            setattr(output, RULED_ON_NODE, mode.activation.stabilizer)
            watch_zero_inputs(mode.activation, func, args[0], output, output)
            return mark_gate(output, args[0])
    result = mode.activation.apply(output, args[0])
    watch_zero_inputs(mode.activation, func, args[0], output, result)
    return mark_gate(result, args[0], sigmoid=True) if func in GATE_FUNCTIONS else result


def _elementwise(equation: Any) -> bool:
    """Whether the ``einsum`` ``equation`` of two operands multiplies them element by element (``"bi,bi->bi"``)."""
    if not isinstance(equation, str):  # (operands and their sublists: no such product read)
        return False
    inputs, _, output = equation.replace(" ", "").partition("->")
    return bool(output) and all(term == output for term in inputs.split(","))


def _constant_bilinear(func: Callable, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """An ``einsum`` of two activations or a ``baddbmm`` of two activations' batches, one of which holds
    constants beside an activation (a key cache joined onto detached past keys): the constants' part a linear
    map of the other factor, as a matrix product's (see :mod:`~tdhook.attribution.rules._constant_matmuls`);
    ``None`` where none does."""
    if func is torch.einsum:
        operands = _einsum_operands(args)
        if len(operands) != 2 or not all(is_activation(operand) for operand in operands):
            return None
        equation = args[0]

        def uniform(factors: tuple) -> torch.Tensor:
            return scale_gradient(torch.einsum(equation, *factors, **kwargs), 0.5)

        return constant_einsum(equation, operands, kwargs, uniform)
    if len(args) < 3 or not (is_activation(args[1]) and is_activation(args[2])):
        return None
    return constant_baddbmm(func, args, kwargs, _uniform_product(torch.bmm, {}))


def _fused(func: Callable, args: tuple, kwargs: dict, hold_gates: bool, recording: Recording | None) -> Any:
    """A product fused with a sum (``torch.addcmul``, ``torch.lerp``: see _fused_products) under the rule of the
    product it computes: its gate held, else (``addcmul``) the uniform rule; ``_NO_RULE`` where none applies."""

    gates = fused_factors(func, args, kwargs, _held_in_fused(hold_gates))
    if gates is None:
        return _NO_RULE
    if recording is not None:  # (a rule a later call does not plan: it runs in the mode)
        recording.other_rule()
    return fused_product(func, args, kwargs, gates, uniform=True)


def _held_in_fused(hold_gates: bool) -> Callable[[tuple], list[bool]]:
    """Which of a fused product's two factors to hold: a gate, else a softmax's weights (as ``w * h`` holds them)."""
    return lambda pair: held_factors(pair, any_gate=hold_gates) or weighing_factors(pair) or [False, False]


def _batched_product(func: Callable, args: tuple, kwargs: dict, hold_gates: bool, recording: Recording | None) -> Any:
    """``torch.baddbmm(c, a, b)`` of two activations' batches: a gate among them held, as in ``torch.bmm(a, b)`` (it
    took the uniform rule: 0.25 off, relative L2, float64, under AttnLRP and CP-LRP), else the uniform rule."""
    gates = held_factors(args[1:3], any_gate=hold_gates)
    if gates is None:
        return func(args[0], *uniform_product(args[1], args[2]), *args[3:], **kwargs)
    if recording is not None:  # (a rule a later call does not plan: it runs in the mode)
        recording.other_rule()
    factors = [hold(a) if gate else a for a, gate in zip(args[1:3], gates, strict=True)]
    return func(args[0], *factors, *args[3:], **kwargs)


def _held_product(func: Callable, args: tuple, kwargs: dict, gates: list[bool], recording: Recording | None):
    """A product of two activations with the factor ``gates`` marks held constant (signal-take-all). In a recording
    call an element-wise product keeps the gate attached and its node passes the gate no gradient, as later calls
    without the mode do (see :mod:`~tdhook.attribution._function_rule_plan`). A division by a statistic holds it as
    a product holds its gate; two statistics are both held (a product of scales is a constant)."""
    one = not all(gates)
    if recording is not None and one and (func in ELEMENTWISE_PRODUCTS or func in DIVISIONS):
        product = func(*args, **kwargs)
        if recording.held_factor(product, args[gates.index(True)]):
            return product
    elif recording is not None and one and graph_kept() is None:  # a matmul: the gate's place in the nodes it makes
        start = torch._C._autograd._get_sequence_nr()
        product = func(*args, **kwargs)
        if recording.held_in_call(product, args[gates.index(True)], start):
            return product
    if recording is not None:
        recording.other_rule()
    factors = tuple(hold(a) if gate else a for a, gate in zip(args, gates, strict=True))
    return mark_parameter_derived(factors, func(*factors, **kwargs))  # of held factors alone: a constant


def _uniform_product(func: Callable, kwargs: dict) -> Callable[[tuple], torch.Tensor]:
    """The product ``func(*factors, **kwargs)`` of two factors under the uniform rule, half its gradient to each."""
    return lambda factors: scale_gradient(func(*factors, **kwargs), 0.5)


def _ungated_product(func: Callable, args: tuple, kwargs: dict) -> Callable[[tuple], torch.Tensor]:
    """The rule of the product ``func(*args, **kwargs)`` where no gate decides: a softmax's weights held where a factor
    is one (see :func:`~tdhook.attribution.rules.gates.weighing_factors`), as a product without gates holds them (in
    the elements of a gate in part that are none, ``torch.where(c, sigmoid(a), h) * softmax(b)``, the weights took the
    uniform rule: 0.18-0.55 off, relative L2, under AttnLRP); else the uniform rule."""
    weighing = weighing_factors(args)
    if weighing is None or any(weights_shown(factor) is not None for factor in args):  # (weights in part: their own)
        return _uniform_product(func, kwargs)
    return lambda factors: func(*(hold(f) if held else f for f, held in zip(factors, weighing, strict=True)), **kwargs)


def _einsum_operands(args: tuple) -> tuple:
    """The operands of ``torch.einsum(equation, *operands)``, given one by one or as one list."""
    operands = args[1:]
    return tuple(operands[0]) if len(operands) == 1 and isinstance(operands[0], (list, tuple)) else operands


def _ruled_on_own_node(recording: Recording, result: object) -> bool:
    """Whether the rule just applied put its gradient on ``result``'s own node, and the recording holds it (a fused
    layer norm's), or left a gate without its rule on the recording's condition: a later call can do the same on
    its plain graph."""
    node = getattr(result, "grad_fn", None)
    if node is None:
        return False
    return (bool(recording.holds) and recording.holds[-1].node is node) or (
        bool(recording.unruled) and recording.unruled[-1] is node
    )
