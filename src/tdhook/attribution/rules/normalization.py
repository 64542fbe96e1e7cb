"""Normalisation layers with the normalising scale held constant, whatever their forward computes.

A norm ``y = (x − μ) · w / σ + b`` is linear in ``x`` once ``σ`` is a constant,
and relevance then follows its gradient (AttnLRP's rule for LayerNorm): the
centring by ``μ`` stays, ``σ`` gets no relevance, and with ``b = 0`` the relevance
is conserved. :class:`NormRule` applies this inside the module's own
forward pass, to what the forward really runs rather than to what the class is
called:

* the fused norms ``F.layer_norm``, ``F.rms_norm``, ``F.group_norm``,
  ``F.instance_norm``, ``F.batch_norm``, ``F.normalize`` and ``F.local_response_norm``, over the
  dimensions and groups their arguments name (a channels-first LayerNorm that
  permutes around ``F.layer_norm`` included);
* norms written by hand (Hugging Face's RMSNorm, Gemma's ``x · (1 + w)``, T5's
  norm, Gemma 3n's ``pow(mean(x²) + ε, -0.5)``): the normalising scale, from
  ``rsqrt``, ``sqrt``, ``var``, ``std``, a vector norm or a negative power, is
  held constant, so the rest of the forward is differentiated as it is.

A BatchNorm in eval mode is an affine map per channel, ``y = s x + t``; it is
treated as a layer whose shift is a bias: the ε-rule (see
:class:`~tdhook.attribution.rules.basic.EpsilonRule`). Activations inside the
module (timm's ``BatchNormAct2d``, ``GroupNormAct``) keep their own rules.
"""

from __future__ import annotations

import functools
import inspect
import sys
from types import CodeType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from tdhook.attribution.rules._arguments import nonnegative
from tdhook.attribution.rules._autograd import (
    call_argument,
    first_input_is,
    hold,
    is_activation,
    is_held,
    mark_module_of_parameters_alone,
    mark_parameter_derived,
    pass_no_relevance,
    raise_for_transformed_call,
    raise_for_vmap,
    redirect,
    times_saved,
)
from tdhook.attribution.rules._caller import warn_at_caller
from tdhook.attribution.rules._graph_calls import note_output, planned, recording, runs_plain
from tdhook.attribution.rules._keeping_graph import graph_kept
from tdhook.attribution.rules._layer_norm_gradient import layer_norm_rule_gradient
from tdhook.attribution.rules._layers import LINEAR_LAYERS
from tdhook.attribution.rules._norm_gradient_layout import lay_out_gradient
from tdhook.attribution.rules._numerics import FLOAT16_STEP, epsilon_factor, in_pieces_
from tdhook.attribution.rules._paused_modes import function_modes_paused
from tdhook.attribution.rules._recomputed import saved_tensors_hooked
from tdhook.attribution.rules.base import RemovableRuleHandle, Rule
from tdhook.attribution.tunables import EPSILON

__all__ = ["NormRule", "LayerNormRule", "BatchRenormRule", "is_norm"]

# Where a norm written by hand computes its normalising scale: the results are held constant.
_SCALES = frozenset(
    {torch.rsqrt, torch.Tensor.rsqrt, torch.sqrt, torch.Tensor.sqrt, torch.var, torch.Tensor.var}
    | {torch.std, torch.Tensor.std, torch.norm, torch.Tensor.norm, torch.linalg.vector_norm, torch.linalg.norm}
)
_SCALE_AND_MEAN = frozenset({torch.var_mean, torch.std_mean})
# A negative power is a normalising scale too (Gemma 3n's ``x * torch.pow(mean(x²) + ε, -0.5)``).
_POWERS = frozenset({torch.pow, torch.Tensor.pow, torch.Tensor.__pow__})
# The scales computed element by element (of a reduction, in a norm: a mean square's root): a normalising scale
# unless taken of the norm's input element by element (``sign(x) · sqrt(|x|)``, a power normalisation: no scale to
# hold, and held it gave every input no relevance).
_ELEMENTWISE_SCALES = frozenset({torch.rsqrt, torch.Tensor.rsqrt, torch.sqrt, torch.Tensor.sqrt}) | _POWERS
# Calls in a norm's forward that its rule leaves to the mapper's function modes (AttnLRP's, CP-LRP's): activations,
# and products of two activations (a gated norm's ``h * silu(gate)``, Mamba 2's): the rule holds only the scales.
_SIGNAL_CALLS = frozenset(
    {F.silu, F.gelu, F.mish, F.softplus, F.elu, F.sigmoid, F.hardsigmoid, F.hardswish, F.tanh}
    | {torch.sigmoid, torch.Tensor.sigmoid, torch.tanh, torch.Tensor.tanh}
)
_PRODUCTS = frozenset(
    {torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.matmul, torch.Tensor.matmul}
    | {torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm}
)
_FRAMES = 64  # Python frames walked up at most, to the innermost module call
# Names in a forward's code that make it a norm: fused norms, and rsqrt, the scale of a norm written by hand. Not
# ``batch_norm``: in eval mode it is a per-channel affine map, which a module of one's own calling it on a layer's
# output leaves unmerged, and the watch of the first call names it there (see _unmerged_norms); in training mode the
# watch names it too. Taken for a norm, its module would get the norm rule, under which the watch sees nothing.
_NORM_CALLS = frozenset({"layer_norm", "rms_norm", "group_norm", "instance_norm", "local_response_norm", "rsqrt"})
# timm's FilterResponseNormTlu2d (a filter response norm, then a thresholded linear unit) is named after the unit;
# ``GRN``: a global response norm (ConvNeXt V2's, ``x · w · ‖x‖ / mean ‖x‖ + x``; timm names it ``GlobalResponseNorm``).
_NORM_NAMES = (
    "Norm",
    "Norm1d",
    "Norm2d",
    "Norm3d",
    "NormAct",
    "NormAct1d",
    "NormAct2d",
    "NormAct3d",
    "NormTlu2d",
    "GRN",
)


def is_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a normalisation layer: torch's norms, classes named ``*Norm``, ``*Norm2d``,
    ``*NormAct2d``, ``*NormTlu2d`` and the like (timm's, torchvision's and Hugging Face's; but one that holds a norm
    wraps it), and modules whose forward calls a fused norm or computes a normalising scale with ``rsqrt``, whatever
    their name.

    Examples:
        >>> class ConvNormAct(nn.Sequential):  # a block named like a norm
        ...     pass
        >>> is_norm(nn.GroupNorm(2, 4)), is_norm(nn.Linear(2, 2)), is_norm(ConvNormAct(nn.Conv2d(1, 1, 1)))
        (True, False, False)
        >>> class RootMeanSquare(nn.Module):  # named like no norm, computes one
        ...     def forward(self, x):
        ...         return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        >>> is_norm(RootMeanSquare())
        True
        >>> class ChannelsLastBatchNorm(nn.Module):  # named like a norm, holds one: the child is the norm
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.batchnorm = nn.BatchNorm1d(4)
        ...     def forward(self, x):
        ...         return self.batchnorm(x.transpose(1, 2)).transpose(1, 2)
        >>> is_norm(ChannelsLastBatchNorm()), is_norm(ChannelsLastBatchNorm().batchnorm)
        (False, True)
    """
    torch_norms = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._NormBase)
    if isinstance(module, torch_norms):
        return True
    # By name or by what the forward calls, only a module without layers of its own: timm's ConvNormAct is a
    # block, BatchNormAct2d a norm.
    if any(isinstance(sub, LINEAR_LAYERS) for sub in module.modules()):
        return False
    if _forward_is_element_wise(module):
        return False  # MobileBERT's NoNorm, x · w + b, an input scaling: no call that could compute a scale
    if type(module).__name__.endswith(_NORM_NAMES) and not _holds_a_norm(module):
        return True
    return _forward_normalises(module)


def _holds_a_norm(module: nn.Module) -> bool:
    """Whether one of ``module``'s children is a norm: a module named like a norm that holds one (PatchTST's
    ``PatchTSTBatchNorm`` transposes around an ``nn.BatchNorm1d``) wraps it, and the child gets the rule."""
    return any(is_norm(child) for child in module.children())


def _forward_function(module: nn.Module) -> Any:
    """The module's own forward, past decorators that wrap it (``@torch.autocast(...)``: the wrapper itself names
    nothing)."""
    return inspect.unwrap(type(module).forward)


def _code_names(code: CodeType) -> tuple[str, ...]:
    """The names ``code`` reads (globals and attributes), with those of the code it holds (comprehensions, lambdas)."""
    nested = (_code_names(const) for const in code.co_consts if isinstance(const, CodeType))
    return code.co_names + tuple(name for names in nested for name in names)


def _forward_names(module: nn.Module) -> tuple[str, ...] | None:
    """The names the module's own forward reads (see :func:`_forward_function`); ``None`` where it has no Python
    code."""
    code = getattr(_forward_function(module), "__code__", None)
    return None if code is None else _code_names(code)


def _forward_is_element_wise(module: nn.Module) -> bool:
    """Whether the module's own forward names nothing but its own tensors and constants (parameters, buffers, other
    attributes holding tensors, numbers or strings), constants of its code's module (numbers, tuples of them,
    tensors), and operations element by element or on shapes (:data:`_ELEMENT_WISE_NAMES`), and calls no function
    a closure holds: such a forward (``x * self.weight + self.bias``, ``(x - self.mean.view(1, -1, 1, 1)) /
    self.std.view(1, -1, 1, 1)``, ``x.sub(0.5).div(0.25)``) cannot reduce a position to a scale. A forward that
    reads a closure's variables (a decorator's wrapper whose wrapped forward is not known) may call anything."""
    forward = _forward_function(module)
    code = getattr(forward, "__code__", None)
    if code is None or code.co_freevars:
        return False
    own = dict(module.named_parameters(recurse=False)) | dict(module.named_buffers(recurse=False))
    own |= {name: value for name, value in vars(module).items() if _is_constant(value)}
    constants = getattr(forward, "__globals__", {})
    return all(
        name in own or name in _ELEMENT_WISE_NAMES or (name in constants and _is_constant(constants[name]))
        for name in _code_names(code)
    )


# What an element-wise forward may name besides its constants: building a constant, reshaping, converting, and
# arithmetic element by element (no reduction, no matrix product).
_ELEMENT_WISE_NAMES = frozenset(
    {"torch", "tensor", "as_tensor", "device", "dtype", "to", "type_as", "float", "double", "half", "contiguous"}
    | {"view", "reshape", "view_as", "reshape_as", "unsqueeze", "squeeze", "expand", "expand_as", "flatten"}
    | {"permute", "transpose", "add", "sub", "mul", "div", "subtract", "multiply", "divide", "true_divide", "neg"}
    | {"add_", "sub_", "mul_", "div_", "clamp", "clip", "clamp_", "clamp_min", "clamp_max"}
)


def _is_constant(value: object) -> bool:
    """A number, a string, ``None``, a tensor, or a tuple or list of numbers (a data set's per-channel statistics)."""
    if isinstance(value, (tuple, list)):
        return bool(value) and all(isinstance(item, (int, float)) for item in value)
    return value is None or isinstance(value, (int, float, str, torch.Tensor))


def _forward_normalises(module: nn.Module) -> bool:
    """Whether the module's own forward calls a fused norm or ``rsqrt`` (the scale of a norm written by hand).
    A name that is one of the module's children (``self.layer_norm(x)``) is that child's call, not the function's:
    the child is the norm; so is one left ``None`` (ESM-2's embeddings, whose optional norm is off)."""
    names = _forward_names(module)
    if names is None:
        return False
    unset = {name for name, value in vars(module).items() if value is None}
    called = set(names) - set(module._modules) - unset
    return not _NORM_CALLS.isdisjoint(called)


def _constant(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """What a norm's rule computes its held scale from: ``tensor`` detached, or in a call that keeps the graph a
    copy with its history (the scale is a constant of the rule, but the relevance's derivative runs through it).
    """
    if tensor is None:
        return None
    return tensor.detach() if graph_kept() is None else tensor.clone()


def _channel_view(tensor: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A per-channel tensor shaped to broadcast over ``x`` of shape ``(N, C, *)``."""
    return tensor.view(1, -1, *[1] * (x.dim() - 2))


def _fused_layer_norm_of(output: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``output`` is a fused layer norm's of ``x``, made by its own node, which saved the normalising
    scale in ``x``'s dtype (outside calls that keep the graph, and outside saved-tensor hooks: a checkpoint region
    would run its forward again to give the scale)."""
    node = output.grad_fn
    if type(node).__name__ != "NativeLayerNormBackward0" or graph_kept() is not None or saved_tensors_hooked():
        return False
    return first_input_is(node, x) and node._saved_result2.dtype == x.dtype


def _node_rule(node: Any) -> Any:
    """A fused layer norm's node's rule gradient, from the normalising scale it saved (``1 / σ``, per position) and
    the norm's weight (see :mod:`~tdhook.attribution.rules._layer_norm_gradient`)."""
    weight = node._saved_weight
    weight = None if weight is None else weight.detach()
    return functools.partial(layer_norm_rule_gradient, node._saved_normalized_shape, node._saved_result2, weight)


def hook_layer_norm_rule(node: Any) -> None:
    """Put the layer norm rule on a fused layer norm's node: a hook that replaces the gradient it passes to its
    input by the rule's, over the dimensions the node normalised and with the scale it saved held constant, and
    passes its weight and bias none (they are the rule's constants, as to the mode's own node).

    Examples:
        >>> x = torch.randn(2, 4, requires_grad=True)
        >>> y = F.layer_norm(x, (4,))
        >>> hook_layer_norm_rule(y.grad_fn)
        >>> grad = torch.autograd.grad(y[0, 0], x)[0]
        >>> sigma = (x.detach().var(-1, unbiased=False) + 1e-5).sqrt()
        >>> torch.allclose(grad[0], (torch.tensor([1.0, 0.0, 0.0, 0.0]) - 1 / 4) / sigma[0])
        True
    """
    node.register_hook(functools.partial(_input_gradient_by, _node_rule(node)))
    pass_no_relevance(node, _LAYER_NORM_CONSTANTS)


# The places of a fused layer norm's weight and bias among its node's inputs: the rule passes them no gradient.
_LAYER_NORM_CONSTANTS = (1, 2)


def _input_gradient_by(rule: Any, grad_inputs: tuple, grad_outputs: tuple) -> tuple:
    """A node's post-hook: the gradient to its first input from ``rule``, none to the others."""
    grad = grad_outputs[0]
    return grad_inputs if grad is None else (*rule(grad), *[None] * (len(grad_inputs) - 1))


class _ConstantScale(TorchFunctionMode):
    """The mode a norm's forward runs in: norms get the rule, normalising scales are held constant.

    In a call that records where the rules act in the graph (``record``), each held scale's autograd node is told
    to the recording with the node of the call that takes the scale, and the scale's place among that node's
    inputs (see :mod:`~tdhook.attribution.rules._graph_calls`).
    """

    def __init__(self, rule: NormRule, module: nn.Module, record: Any = None) -> None:
        super().__init__()
        self.rule = rule
        self.module = module
        self.applied = False
        self.called: set = set()  # the norm functions the forward called (those of ``rule.functions``)
        self.record = record
        self.pending: dict[int, tuple[torch.Tensor, Any]] = {}  # held scales no call has taken yet, by id
        self.kept = False  # whether the forward does more than hold scales: later calls keep the mode
        self.unruled: list[str] = []  # activations and products no function mode below rules (see _signal_call)
        self._input: Any = False  # the module's first tensor input (found at the first root: False before)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _signal_call(func, args):  # the modes below give it its rule (a gate's product, an activation)
            self.kept = True  # later calls keep this mode: such a call runs in it as in the modes' plain graph
            # No mode below rules it: its plain gradient, named (not in a child, an activation module, with a rule).
            if not planned() and not _covered(func, args) and _in_own_forward(self.module):
                self.unruled.append(getattr(func, "__name__", str(func)))
            result = func(*args, **kwargs)
            if self.pending:
                self._taken(args, kwargs, result)
            return result
        with torch._C.DisableTorchFunction():  # the mapper's function rules have nothing else to change in here
            handler = self.rule.functions.get(func)
            x = args[0] if args else None
            if handler is not None:
                self.applied = True
                self.called.add(func)
                # Under torch.vmap the input reports no gradient: the fused norm would keep its plain gradient.
                raise_for_transformed_call("the norm's rule", args[:1])
                # A held input (create_graph=True: it requires grad, as a detached one would not) passes no relevance.
                if isinstance(x, torch.Tensor) and x.requires_grad and not is_held(x):
                    output = func(*args, **kwargs)
                    ruled = handler(self.rule, self.module, output, args, kwargs)
                    # A rule found in the plain graph (the fused layer norm's hook) lets later calls run it plainly.
                    self.kept = self.kept or ruled is not output
                    return ruled
            result = func(*args, **kwargs)
            if (func in _SCALES or (func in _POWERS and _negative_exponent(args, kwargs))) and self._scale(func, args):
                self.applied = True
                held = hold(result)
                if self.record is not None and result.grad_fn is not None:
                    self.pending[id(held)] = (held, result.grad_fn)
                return held
            if func in _SCALE_AND_MEAN:
                self.applied = True
                self.kept = True
                return hold(result[0]), result[1]
            if self.pending:
                self._taken(args, kwargs, result)
            # Marked as the function modes mark it: a weight written ``1 + w`` (Gemma's) is no activation to a product.
            return mark_parameter_derived(args, result, func)

    def _scale(self, func: Any, args: tuple) -> bool:
        """Whether the result of a scale's function is a normalising scale: a reduction's (``var``, ``std``, a norm),
        or an element-wise function's (``rsqrt``, ``sqrt``, a negative power) of anything but the module's input
        taken element by element (``sqrt(|x|)`` is an activation of ``x``: held, it left the output constant)."""
        if func not in _ELEMENTWISE_SCALES or not args or not isinstance(args[0], torch.Tensor):
            return True
        if self._input is False:
            self._input = _first_input(self.module)
        return self._input is None or not _element_wise_of(args[0], self._input)

    def _taken(self, args: tuple, kwargs: dict, result: Any) -> None:
        """Tell the recording which held scales this call took: the result's node has no edge where a held scale
        entered, and the plain call's node has the scale's own node there."""
        node = result.grad_fn if isinstance(result, torch.Tensor) else None
        inputs = [value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)]
        for value in inputs:
            entry = self.pending.pop(id(value), None)
            if entry is None:
                continue
            free = [] if node is None else [i for i, (child, _) in enumerate(node.next_functions) if child is None]
            if len(free) == 1:
                self.record.held(self.module, entry[1], inputs, node, free[0])
            else:  # taken by a call whose result is a constant, or where the scale's place is not one
                self.kept = True


def _signal_call(func: Any, args: tuple) -> bool:
    """Whether a call in a norm's forward is an activation of an activation, or a product of two activations (a
    gated norm's ``h * silu(gate)``): no scale of the norm's, and the function modes' to rule (the plain gradient of
    the gate's product created 2.3 to 4.1 times the logit's relevance)."""
    if func in _SIGNAL_CALLS:
        return bool(args) and is_activation(args[0])
    # A square (``h * h``, a mean square's) is the scale's: held with it.
    two = len(args) == 2 and args[0] is not args[1]
    return func in _PRODUCTS and two and is_activation(args[0]) and is_activation(args[1])


_CALL = nn.Module._call_impl.__code__


def _in_own_forward(module: nn.Module) -> bool:
    """Whether the call in progress runs in ``module``'s own forward, not in a child's (timm's ``BatchNormAct2d``
    calls its activation module, whose rule takes its gradient): the innermost module call on the Python stack."""
    frame = sys._getframe(1)
    for _ in range(_FRAMES):
        if frame is None:
            return False
        if frame.f_code is _CALL:
            return frame.f_locals.get("self") is module
        frame = frame.f_back
    return False


def _held_scale_returned(args: tuple, output: Any) -> bool:
    """Whether a norm's forward returned a scale it held (or nothing that depends on its input) where an input
    is an activation (not one computed from parameters alone: an integer image cast in the forward, whose error the
    wrapper gives, feeds a first convolution only its weights' gradient)."""
    if not isinstance(output, torch.Tensor) or not any(
        isinstance(value, torch.Tensor) and is_activation(value) for value in args
    ):
        return False
    return is_held(output) or not output.requires_grad


def _first_input(module: nn.Module) -> torch.Tensor | None:
    """The first tensor given to the call of ``module`` in progress (the innermost on the Python stack), or ``None``."""
    frame = sys._getframe(1)
    for _ in range(_FRAMES):
        if frame is None:
            return None
        if frame.f_code is _CALL and frame.f_locals.get("self") is module:
            given = (*frame.f_locals.get("args", ()), *frame.f_locals.get("kwargs", {}).values())
            return next((value for value in given if isinstance(value, torch.Tensor)), None)
        frame = frame.f_back
    return None


def _element_wise_of(value: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``value`` is computed from ``x`` element by element only: its autograd graph reaches ``x`` through
    element-wise nodes (:data:`ELEMENT_WISE_NODES`) alone. A path through any other node (a mean, a sum, a
    convolution, a pooling: a divisive normalisation's neighbourhood) makes a scale; so does none at all (a scale of
    buffers, of a statistic given beside ``x``)."""
    if not (value.requires_grad and x.requires_grad):
        return False
    target = x.grad_fn
    stack, seen = [value.grad_fn], set()
    while stack and len(seen) < _MOST_NODES:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node is target or (target is None and getattr(node, "variable", None) is x):
            return True
        if type(node).__name__ in ELEMENT_WISE_NODES:
            stack.extend(child for child, _ in node.next_functions)
    return False


# The autograd nodes of element-wise functions and of views, through which a value stays one per element of ``x``.
ELEMENT_WISE_NODES = frozenset(
    {"AbsBackward0", "SgnBackward0", "SignBackward0", "NegBackward0", "ReluBackward0", "ThresholdBackward0"}
    | {"MulBackward0", "AddBackward0", "SubBackward0", "RsubBackward1", "DivBackward0", "PowBackward0"}
    | {"PowBackward1", "ClampBackward1", "ClampMinBackward0", "ClampMaxBackward0", "ExpBackward0", "LogBackward0"}
    | {"SqrtBackward0", "RsqrtBackward0", "ToCopyBackward0", "CloneBackward0", "ViewBackward0", "AliasBackward0"}
    | {"UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1", "SigmoidBackward0", "TanhBackward0"}
    | {"SoftplusBackward0", "AddBackward1", "MulBackward1", "SubBackward1", "DivBackward1"}
)
# The nodes a look for element-wise paths walks at most (beyond: taken for a scale, as before the look).
_MOST_NODES = 64


def _covered(func: Any, args: tuple) -> bool:
    """Whether a function mode below a norm's (on the stack) gives this call a rule (``mode.covers``)."""
    return any(
        getattr(mode, "covers", None) is not None and mode.covers(func, args)
        for mode in torch.overrides._get_current_function_mode_stack()
    )


def _negative_exponent(args: tuple, kwargs: dict) -> bool:
    """Whether a call of ``pow`` raises a tensor to a negative number (``pow(t, -0.5)``: a normalising scale)."""
    exponent = call_argument(args, kwargs, 1, "exponent")
    return isinstance(args[0], torch.Tensor) and isinstance(exponent, (int, float)) and exponent < 0


class _PlainRun:
    """What a norm's forward runs in where a later call's plan cuts its scales' gradient: nothing."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: object) -> None:
        return None


_PLAIN_RUN = _PlainRun()


class NormRule(Rule):
    """Normalisation with the normalising scale held constant (AttnLRP's LayerNorm rule, for every norm).

    LayerNorm ``y = (x − μ) · w / σ + b`` becomes linear in ``x`` with ``σ`` fixed:
    ``grad_x = h − mean(h)`` with ``h = g · w / σ``, the mean over the normalised
    elements. RMSNorm ``y = x · w · r`` with ``r = 1 / rms(x)`` fixed gives
    ``grad_x = g · w · r``; GroupNorm and InstanceNorm centre per group. An
    eval-mode BatchNorm gets the ε-rule of the affine map ``y = s x + t``,
    ``R_x = s x · R / stabilize(y, ε)``; in training mode its batch statistics
    are held constant. The rule acts inside the module's forward (see the module
    docstring), so it holds for channels-first LayerNorms, norms fused with an
    activation, and norms written by hand.

    Args:
        epsilon: ε of the affine (BatchNorm) case.

    Examples:
        >>> norm = nn.LayerNorm(3)
        >>> x = torch.tensor([[1.0, 2.0, 4.0]], requires_grad=True)
        >>> with NormRule().register(norm):
        ...     grad = torch.autograd.grad(norm(x)[0, 0], x)[0]
        >>> sigma = (x.var(-1, unbiased=False) + norm.eps).sqrt()
        >>> torch.allclose(grad, (torch.tensor([1.0, 0.0, 0.0]) - 1 / 3) / sigma)
        True
    """

    uses_input = False
    acts_in_forward = True
    tunables = {"epsilon": EPSILON}
    differentiable = True

    def __init__(self, epsilon: float = 1e-6) -> None:
        nonnegative(type(self).__name__, "epsilon", epsilon)
        super().__init__()
        self.epsilon = epsilon

    def register(self, module: nn.Module) -> RemovableRuleHandle:
        def leave(mod: nn.Module, args: tuple, output: Any, mode: _ConstantScale | _PlainRun) -> None:
            mark_module_of_parameters_alone(args, output)  # a norm of a constant (a time embedding's)
            if mode is _PLAIN_RUN:  # a later call, by the plan of a recorded one
                note_output(output)
                return
            paused = function_modes_paused()
            if not paused:
                self._check_calls(mod, output, mode)
            if not mode.applied and not paused and isinstance(output, torch.Tensor) and output.requires_grad:
                raise ValueError(
                    f"{type(self).__name__} on {type(mod).__name__}: its forward ran no normalisation the rule "
                    "knows (F.layer_norm, F.rms_norm, F.group_norm, F.instance_norm, F.batch_norm, F.normalize, "
                    "F.local_response_norm, or a scale from rsqrt, sqrt, var, std, a norm or a negative power, "
                    "computed out of place, one per normalised position or group: a root taken element by element, "
                    "sqrt(|x|), is none, and one computed in place, v.rsqrt_() or v.sqrt_(), is not followed). Write "
                    "the scale torch.rsqrt(v), or map the module to another rule"
                )
            if mode.applied and _held_scale_returned(args, output):
                raise ValueError(
                    f"{type(self).__name__} on {type(mod).__name__}: its output is a scale its forward computes (a "
                    "norm, a root or a variance of its input), which the rule holds constant, not its input "
                    "normalised by one: no relevance would reach the input. Map the module to another rule (a "
                    "vector's length, such as a capsule's, is no normalisation)"
                )
            if mode.unruled and isinstance(output, torch.Tensor) and output.requires_grad:
                warn_at_caller(
                    f"LRP: {type(self).__name__} on {type(mod).__name__}: its forward computes "
                    f"{', '.join(dict.fromkeys(mode.unruled))} on activations (a gate's product or an activation "
                    "inside the norm), which the norm's rule does not cover and no function rule of the mapper "
                    "does: its plain gradient is used. Use a preset whose function rules cover it (AttnLRP, CPLRP)"
                )
            if mode.record is not None:  # the recording of a call: whether later calls may run this forward plainly
                mode.record.norm_done(mod, plain=not (mode.kept or mode.pending))
            note_output(output)

        def make_mode(mod: nn.Module) -> _ConstantScale | _PlainRun:
            return _PLAIN_RUN if runs_plain(mod) else _ConstantScale(self, mod, recording())

        return self._register_in_forward(module, make_mode, leave)

    def _check_calls(self, module: nn.Module, output: Any, mode: _ConstantScale) -> None:
        """Raise where the norm's forward, run in ``mode``, computed what the rule cannot follow (nothing here)."""

    # ------------------------------------------------------------------ the norms, each with the rule's gradient

    @staticmethod
    def layer_norm(
        output: torch.Tensor, x: torch.Tensor, dims: int, weight: torch.Tensor | None, eps: float
    ) -> torch.Tensor:
        """``output = layer_norm(x)`` over the last ``dims`` dimensions, with the rule's gradient."""
        if not x.requires_grad:
            return output
        reduce = tuple(range(-dims, 0))
        if _fused_layer_norm_of(output, x):
            # The scale torch computed (and saved on the node): in a call that records where the rules act, a hook
            # on the fused norm's own node, which a later call puts on the same node of its plain graph.
            held = recording()
            if held is not None and held.hooked(output.grad_fn, hook_layer_norm_rule, _LAYER_NORM_CONSTANTS):
                return output
            if planned():  # in a norm that keeps its mode for more: the plan puts the hook, as the recording did
                return output
            return redirect(output, [x], _node_rule(output.grad_fn))
        xd = _constant(x)
        inv_sigma = torch.rsqrt(xd.var(reduce, unbiased=False, keepdim=True) + eps)
        scale = inv_sigma if weight is None else inv_sigma * _constant(weight)

        def backward(grad: torch.Tensor) -> list[torch.Tensor]:
            h = grad * scale
            return [h - h.mean(reduce, keepdim=True)]

        return redirect(output, [x], backward)

    @staticmethod
    def rms_norm(
        output: torch.Tensor, x: torch.Tensor, dims: int, weight: torch.Tensor | None, eps: float | None
    ) -> torch.Tensor:
        """``output = rms_norm(x)`` over the last ``dims`` dimensions, with the rule's gradient."""
        if not x.requires_grad:
            return output
        xd = _constant(x)
        eps = torch.finfo(xd.dtype).eps if eps is None else eps
        reduce = tuple(range(-dims, 0))
        scale = torch.rsqrt(xd.pow(2).mean(reduce, keepdim=True) + eps)
        if weight is not None:
            scale = scale * _constant(weight)
        scale = scale.to(output.dtype)
        return redirect(output, [x], lambda grad: [(grad * scale).to(x.dtype)])

    @staticmethod
    def group_norm(
        output: torch.Tensor, x: torch.Tensor, groups: int, weight: torch.Tensor | None, eps: float
    ) -> torch.Tensor:
        """``output = group_norm(x, groups)`` for ``x`` of shape ``(N, C, *)``, with the rule's gradient."""
        if not x.requires_grad:
            return output
        grouped = _constant(x).reshape(x.shape[0], groups, -1)
        inv_sigma = torch.rsqrt(grouped.var(-1, unbiased=False, keepdim=True) + eps)
        keep = graph_kept() is not None

        def backward(grad: torch.Tensor) -> list[torch.Tensor]:
            h = grad if weight is None else grad * _channel_view(weight if keep else weight.detach(), grad)
            h = h.reshape(grouped.shape) * inv_sigma
            return [(h - h.mean(-1, keepdim=True)).reshape(x.shape)]

        return redirect(output, [x], backward)

    def affine(self, output: torch.Tensor, x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """``output = scale · x + shift`` per channel, with the ε-rule's gradient.

        ``scale=None``: the output's own backward gives ``scale`` (an eval-mode BatchNorm).
        """
        if not x.requires_grad:
            return output
        if scale is None:  # the output's own backward runs: PyTorch's CPU batch_norm backward needs it laid out
            lay_out_gradient(output)
        if graph_kept() is not None:  # the factor from the output's copy, with its history
            z = output.clone()
            factor = epsilon_factor(z, self.epsilon)
            if scale is None:
                return redirect(output, [output], lambda grad: [grad * factor])
            factor = factor * _channel_view(scale, z)
            return redirect(output, [x], lambda grad: [grad * factor])
        z = output.detach()
        if z.dtype is torch.float16 and self.epsilon < FLOAT16_STEP:  # ε rounds to 0 in float16: 0 / 0 at z = 0
            factor = epsilon_factor(z, self.epsilon)
        else:
            factor = in_pieces_(z.abs(), lambda piece: piece.div_(piece + self.epsilon))  # z / stabilize(z, ε)
        if scale is None:
            return redirect(output, [output], lambda grad: [times_saved(grad, factor)])
        factor.mul_(_channel_view(scale, z))
        return redirect(output, [x], lambda grad: [times_saved(grad, factor)])

    def batch_norm(self, module: nn.Module, output: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        """``output = F.batch_norm(*args, **kwargs)`` with the rule's gradient."""
        x = args[0]
        weight = call_argument(args, kwargs, 3, "weight")
        training = call_argument(args, kwargs, 5, "training", False)
        eps = call_argument(args, kwargs, 7, "eps", 1e-5)
        if not training:
            return self.affine(output, x, None)
        dims = [0, *range(2, x.dim())]
        scale = torch.rsqrt(_constant(x).var(dims, unbiased=False) + eps)  # the batch statistics, held constant
        return self.affine(output, x, scale if weight is None else scale * _constant(weight))

    def instance_norm(self, module: nn.Module, output: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        """``output = F.instance_norm(*args, **kwargs)`` with the rule's gradient: a group norm of one channel
        per group, or, with running statistics, an affine map."""
        x = args[0]
        if not call_argument(args, kwargs, 5, "use_input_stats", True):
            return self.affine(output, x, None)
        weight, eps = call_argument(args, kwargs, 3, "weight"), call_argument(args, kwargs, 7, "eps", 1e-5)
        return self.group_norm(output, x, x.shape[1], weight, eps)

    @staticmethod
    def _layer_norm_call(rule, module, output, args, kwargs):
        shape = call_argument(args, kwargs, 1, "normalized_shape")
        dims = 1 if isinstance(shape, int) else len(shape)
        return rule.layer_norm(
            output, args[0], dims, call_argument(args, kwargs, 2, "weight"), call_argument(args, kwargs, 4, "eps", 1e-5)
        )

    @staticmethod
    def _rms_norm_call(rule, module, output, args, kwargs):
        shape = call_argument(args, kwargs, 1, "normalized_shape")
        dims = 1 if isinstance(shape, int) else len(shape)
        return rule.rms_norm(
            output, args[0], dims, call_argument(args, kwargs, 2, "weight"), call_argument(args, kwargs, 3, "eps")
        )

    @staticmethod
    def _group_norm_call(rule, module, output, args, kwargs):
        groups = call_argument(args, kwargs, 1, "num_groups")
        return rule.group_norm(
            output,
            args[0],
            groups,
            call_argument(args, kwargs, 2, "weight"),
            call_argument(args, kwargs, 4, "eps", 1e-5),
        )

    @staticmethod
    def _normalize_call(rule, module, output, args, kwargs):
        x = args[0]
        p, dim, eps = (
            call_argument(args, kwargs, 1, "p", 2.0),
            call_argument(args, kwargs, 2, "dim", 1),
            call_argument(args, kwargs, 3, "eps", 1e-12),
        )
        denominator = _constant(x).norm(p, dim, keepdim=True).clamp_min(eps)
        return redirect(output, [x], lambda grad: [grad / denominator])

    @staticmethod
    def _local_response_norm_call(rule, module, output, args, kwargs):
        """``F.local_response_norm``: ``y = x / d`` with ``d = (k + α · mean of x² over the neighbouring channels)^β``
        held constant, so that every element keeps its relevance."""
        x = args[0]
        size = call_argument(args, kwargs, 1, "size")
        alpha, beta, k = (
            call_argument(args, kwargs, i, n, v) for i, n, v in ((2, "alpha", 1e-4), (3, "beta", 0.75), (4, "k", 1.0))
        )
        squares = _constant(x).pow(2).unsqueeze(1)
        # The window of channels c - size // 2 … c + (size - 1) // 2, zero past the ends, as the function sums it.
        padding = (0, 0) * (x.dim() - 2) + (size // 2, (size - 1) // 2)
        padded = F.pad(squares, padding).squeeze(1)
        window = sum(padded.narrow(1, start, x.shape[1]) for start in range(size)) / size
        divisor = window.mul(alpha).add(k).pow(beta)
        return redirect(output, [x], lambda grad: [grad / divisor])

    functions = {
        F.layer_norm: _layer_norm_call,
        F.local_response_norm: _local_response_norm_call,
        F.rms_norm: _rms_norm_call,
        F.group_norm: _group_norm_call,
        F.batch_norm: lambda rule, module, output, args, kwargs: rule.batch_norm(module, output, args, kwargs),
        F.instance_norm: lambda rule, module, output, args, kwargs: rule.instance_norm(module, output, args, kwargs),
        F.normalize: _normalize_call,
    }


class LayerNormRule(NormRule):
    """:class:`NormRule` under the name AttnLRP and LXT give it (for LayerNorm and RMSNorm).

    Examples:
        >>> norm = nn.RMSNorm(3)
        >>> x = torch.tensor([[1.0, 2.0, 4.0]], requires_grad=True)
        >>> with LayerNormRule().register(norm):
        ...     grad = torch.autograd.grad(norm(x)[0, 0], x)[0]
        >>> torch.allclose(grad, torch.tensor([1.0, 0.0, 0.0]) * torch.rsqrt(x.pow(2).mean() + torch.finfo().eps))
        True
    """


# The batch statistics a batch renormalisation computes in its own forward: held constant by BatchRenormRule.
_BATCH_STATISTICS = frozenset({torch.mean, torch.Tensor.mean, torch.var, torch.Tensor.var})


class _HeldBatchStatistics(TorchFunctionMode):
    """The mode a batch renormalisation's forward runs in: its batch mean and variance are held constant."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunction():
            result = func(*args, **kwargs)
            if func in _BATCH_STATISTICS and isinstance(result, torch.Tensor) and result.requires_grad:
                return hold(result)
            return result


class BatchRenormRule(NormRule):
    """torchrl's ``BatchRenorm1d`` (CrossQ's networks): the ε-rule of its affine map, as for an unmerged BatchNorm.

    In eval mode it computes ``y = w (x − μ_run) / σ_run + b``. In training mode it normalises with the batch's
    mean and deviation, corrected by the running ones (``r``, ``d``, constants of its own forward); the batch
    statistics are held constant, as :class:`NormRule` holds a training-mode BatchNorm's, so that each sample is
    explained by the affine map ``y = s x + t`` and no relevance passes between the samples of a batch. With
    ``create_graph=True`` the relevance's derivative is exact in eval mode; in training mode it treats ``r`` and
    ``d`` as constants, as the module's own gradient does (its forward detaches them).

    Args:
        epsilon: ε of the affine map's rule.

    Examples:
        >>> from torchrl.modules import BatchRenorm1d
        >>> norm = BatchRenorm1d(2, warmup_steps=0)
        >>> x = torch.tensor([[1.0, 2.0], [3.0, 6.0]], requires_grad=True)
        >>> with BatchRenormRule(epsilon=0.0).register(norm):
        ...     grad = torch.autograd.grad(norm(x)[0, 0], x)[0]
        >>> grad[1].tolist()  # the other sample of the batch gets nothing
        [0.0, 0.0]
    """

    def register(self, module: nn.Module) -> RemovableRuleHandle:
        def leave(mod: nn.Module, args: tuple, output: Any, mode: _HeldBatchStatistics) -> torch.Tensor | None:
            raise_for_vmap(mod, output)  # its input would report no gradient: the plain gradient, silently
            if not isinstance(output, torch.Tensor) or not args:
                return None
            return self.affine(output, args[0], None)  # the ε factor; the forward's own backward gives the scale

        return self._register_in_forward(module, lambda mod: _HeldBatchStatistics(), leave)
