"""The rules that need no modified parameters: ε (and LRP-0), pass, ignore, stop and the uniform split.

With ``z`` the module's output and ``R = z * grad(z)`` its relevance, each
rule's docstring gives the relevance ``R_i`` it assigns to the module's input.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from tdhook.attribution.rules._arguments import nonnegative
from tdhook.attribution.rules._autograd import (
    first_input_is,
    hold,
    redirect,
    relevance_proxy,
    scale_at_node,
    times_saved,
)
from tdhook.attribution.rules._caller import warn_at_caller
from tdhook.attribution.rules._clips import mark_clipped
from tdhook.attribution.rules._first_pass import first_pass
from tdhook.attribution.rules._graph_calls import recording, runs_plain
from tdhook.attribution.rules._keeping_graph import graph_kept
from tdhook.attribution.rules._layers import LINEAR_LAYERS, bias_view, check_layer_input
from tdhook.attribution.rules._numerics import FLOAT16_STEP, PIECE, epsilon_factor, in_pieces_, stabilize
from tdhook.attribution.rules._recomputed import saved_tensors_hooked
from tdhook.attribution.rules._set_relevance import probing
from tdhook.attribution.rules.base import RemovableRuleHandle, Rule, _single_input, output_seen_by_rule_alone
from tdhook.attribution.rules.records import Registration
from tdhook.attribution.tunables import EPSILON

__all__ = [
    "IgnoreRule",
    "StopRule",
    "EpsilonRule",
    "UniformEpsilonRule",
    "PassRule",
    "UniformRule",
    "RefuseRule",
    "pass_rule_on_node",
    "clipped_on_node",
    "hook_pass_rule",
    "PassRuleOnNode",
    "pass_rule_given_input",
    "hook_pass_rule_given",
    "RULED_ON_NODE",
]


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
    differentiable = True
    only_marks = True
    # Whether the mapper's function modes pause inside a module this rule registers nothing on, so that all it
    # computes keeps its plain gradient (a layer norm or a GELU mapped here by the caller); the presets' own instance
    # for the modules whose gradient routes relevance (pooling, dropout, reshapes) leaves them running.
    _plain_inside = True

    def register(self, module: nn.Module) -> RemovableRuleHandle:
        if isinstance(module, LINEAR_LAYERS):
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
    differentiable = True

    def rewrite(self, module, registration, inputs, output):
        return hold(output)


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
    # Whether the mapper's function rules hold a layer norm (or a group, RMS... norm) a layer's own forward calls.
    norms_ruled = False
    tunables = {"epsilon": EPSILON}
    differentiable = True

    def __init__(self, epsilon: float = 1e-6) -> None:
        nonnegative(type(self).__name__, "epsilon", epsilon)
        super().__init__()
        self.epsilon = epsilon

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "epsilon" and len(self.__dict__.get("_registrations", ())):
            # The check at registration depends on ε's class (a clip inside a layer is ruled only under a small ε):
            # an ε set while the rule is registered is checked against each layer before it is taken.
            for module in list(self._registrations):
                check_layer_input(module, value, self.norms_ruled)
        super().__setattr__(name, value)

    def _new_registration(self, module: nn.Module) -> Registration:
        # A Linear or convolution layer whose own forward runs tanh or a clamp around its linear function: the
        # rule's gradient would run through it, refused now so that the error names the layer.
        check_layer_input(module, self.epsilon, self.norms_ruled)
        registration = super()._new_registration(module)
        registration.training = module.training
        return registration

    def resolve(self, module: nn.Module, registration: Registration, inputs: tuple) -> tuple[Rule, Registration]:
        # The check at registration ran the layer's forward in the mode it had then: a forward that acts in training
        # mode alone (a tanh) is checked again where a call runs in the other mode.
        if registration.training is not None and module.training != registration.training:
            try:
                check_layer_input(module, self.epsilon, self.norms_ruled)
            except ValueError as error:
                error.module = module  # type: ignore[attr-defined]  # the wrapper names its path
                raise
            registration.training = module.training
        return self, registration

    def _scale(self, output: torch.Tensor, n_inputs: int) -> torch.Tensor:
        return self._scale_of(output.detach(), n_inputs)

    def _scale_of(self, z: torch.Tensor, n_inputs: int) -> torch.Tensor:
        """:meth:`_scale` of an output ``z`` that has no history (one computed under ``no_grad``)."""
        epsilon = self.epsilon
        if epsilon == 0:
            scale = (z != 0).to(z.dtype)
        elif z.dtype is torch.float16 and epsilon < FLOAT16_STEP:  # ε rounds to 0 in float16: 0 / 0 at z = 0
            scale = epsilon_factor(z, epsilon)
        elif z.numel() <= PIECE:  # small enough to stay in cache whole (in_pieces_ without its call)
            # z / stabilize(z, ε) is |z| / (|z| + ε) exactly (a sign flip is exact), in three passes.
            scale = z.abs()
            scale.div_(scale + epsilon)
        else:
            scale = in_pieces_(z.abs(), lambda piece: piece.div_(piece + epsilon))
        return scale if n_inputs == 1 else scale.div_(n_inputs)

    def _redirect_keeping_graph(self, output: torch.Tensor, n_inputs: int) -> torch.Tensor:
        """The rule in a call that keeps the graph: ``z / stabilize(z, ε)`` from the output and its history."""
        z, epsilon = output.clone(), self.epsilon  # a copy: later in-place operations must not reach it

        def backward(grad: torch.Tensor) -> list[torch.Tensor]:
            scale = (z != 0).to(z.dtype) if epsilon == 0 else epsilon_factor(z, epsilon)
            return [grad * scale if n_inputs == 1 else grad * scale / n_inputs]

        return redirect(output, [output], backward)

    def rewrite(self, module, registration, inputs, output):
        if graph_kept() is not None:
            return self._redirect_keeping_graph(output, 1)
        scale = self._scale(output, 1)
        if output_seen_by_rule_alone(module, registration, output):
            scale_at_node(output, scale)  # the same gradient as the redirect below, for less
            return None
        return redirect(output, [output], lambda grad: [times_saved(grad, scale)])

    def zero_output_seeds(self, call, relevance):
        """``R / stabilize(z, ε)`` through the layer's own gradient (its output ``z`` before the rule), as zennit's
        ε-rule sends it: ``R / ε`` at ``z = 0``, ``±R / ε`` at a ``z`` of that sign too small for ``R / z`` (1e-310);
        none for LRP-0 (``R / 0``).

        Examples:
            >>> from tdhook.attribution.rules.base import layer_call_of
            >>> lin, x = nn.Linear(2, 1, bias=False), torch.tensor([[1.0, 1.0]], requires_grad=True)
            >>> _ = lin.weight.data.copy_(torch.tensor([[2.0, -2.0]]))
            >>> rule = EpsilonRule(epsilon=0.5)
            >>> with rule.register(lin):
            ...     out = lin(x)  # exactly 0
            ...     [(start, grad)] = rule.zero_output_seeds(layer_call_of(out), torch.ones(1, 1))
            ...     x.detach() * torch.autograd.grad(start, x, grad)[0]  # R_i = x_i w_i R / ε
            tensor([[ 4., -4.]])
        """
        if self.epsilon == 0 or call.raw.shape != relevance.shape:
            return None
        z = call.raw.detach()
        if z.dtype is torch.float16 and self.epsilon < FLOAT16_STEP:  # ε rounds to 0 in float16: R / 0 at z = 0
            return [(call.raw, (relevance.float() / stabilize(z.float(), self.epsilon)).to(z.dtype))]
        return [(call.raw, relevance / stabilize(z, self.epsilon))]

    def rewrite_merged(self, call, output, merged):
        # The merged layer's weights are the layer's times the channel scale: the
        # gradient at the layer's own output is the merged one times that scale.
        channel = bias_view(call.module, merged.channel_scale)
        if graph_kept() is not None:
            z, epsilon = output.clone(), self.epsilon

            def backward(grad: torch.Tensor) -> list[torch.Tensor]:
                scale = (z != 0).to(z.dtype) if epsilon == 0 else epsilon_factor(z, epsilon)
                return [grad * scale * channel]

            return redirect(output, [call.raw], backward)
        scale = self._scale(output, 1).mul_(channel)
        return redirect(output, [call.raw], lambda grad: [times_saved(grad, scale)])


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
        if graph_kept() is not None:
            return self._redirect_keeping_graph(output, max(n_inputs, 1))
        scale = self._scale(output, max(n_inputs, 1))
        return redirect(output, [output], lambda grad: [times_saved(grad, scale)])


# Activations whose pass rule is their plain gradient: f(x) / x = f'(x) wherever x != 0, and f(0) = 0.
_HOMOGENEOUS_ACTIVATIONS = frozenset({nn.ReLU, nn.LeakyReLU, nn.PReLU, nn.RReLU})


def is_homogeneous_activation(module: nn.Module) -> bool:
    """Whether ``module`` is one of torch's positively homogeneous activations (``f(x) = f'(x) x``, ``f(0) = 0``),
    whose pass rule is its plain gradient: a ReLU, a leaky or parametric one, and ``nn.Threshold(0, 0)`` and
    ``nn.Hardtanh(0, inf)``, ReLUs written otherwise. Exactly these classes: a subclass may compute something else.

    Examples:
        >>> is_homogeneous_activation(nn.Threshold(0.0, 0.0)), is_homogeneous_activation(nn.Threshold(0.1, 0.0))
        (True, False)
    """
    kind = type(module)
    if kind in _HOMOGENEOUS_ACTIVATIONS:
        return True
    if kind is nn.Threshold:
        return module.threshold == 0 and module.value == 0
    return kind is nn.Hardtanh and module.min_val == 0 and module.max_val == float("inf")


class PassRule(Rule):
    """Relevance passes unchanged through an element-wise module: ``R_i = R_i(out)``.

    For activations and un-merged normalisation. The input gradient is
    ``grad(z) * z / stabilize(x)``. On ``nn.ReLU``, ``nn.LeakyReLU``, ``nn.PReLU``
    and ``nn.RReLU`` (positively homogeneous: ``f(x) = f'(x) x``, and ``f(0) = 0``)
    this equals the plain gradient, so nothing is registered there: the
    stabiliser would only move it off, by ``stabilizer / |x|`` (LRP-0 stays
    gradient × input at inputs of any size).

    Examples:
        >>> x = torch.tensor([-1.0, 0.5, 2.0], requires_grad=True)
        >>> act = nn.Tanh()
        >>> with PassRule().register(act):
        ...     z = act(x)
        ...     relevance = x * torch.autograd.grad(z, x, torch.ones(3))[0]
        >>> torch.allclose(relevance, z)
        True
    """

    differentiable = True

    def __init__(self, stabilizer: float = 1e-12) -> None:
        nonnegative(type(self).__name__, "stabilizer", stabilizer)
        super().__init__()
        self.stabilizer = stabilizer

    def register(self, module: nn.Module) -> RemovableRuleHandle:
        if is_homogeneous_activation(module):
            return RemovableRuleHandle(self, module)
        if isinstance(module, LINEAR_LAYERS) and not _scales_each_channel(module):
            raise ValueError(
                f"PassRule needs an element-wise module; {type(module).__name__} mixes its inputs with its weight "
                "even where its output has its input's shape: map it to EpsilonRule (LRP-0 with epsilon=0) or "
                "IgnoreRule (its plain gradient)"
            )
        return super().register(module)

    def rewrite(self, module, registration, inputs, output):
        x = _single_input(self, module, inputs)
        if x.shape != output.shape:
            raise ValueError(
                f"PassRule needs an element-wise module; {type(module).__name__} maps {tuple(x.shape)} "
                f"to {tuple(output.shape)}"
            )
        if not x.requires_grad:
            return None
        warned = first_pass()  # checked in a context's first pass only
        at_zero = None
        if warned is not None and (_ZERO_INPUTS, id(module)) not in warned:
            warned.add((_ZERO_INPUTS, id(module)))
            with torch.no_grad():
                at_zero = (x == 0) & (output != 0)
        result = self._rewritten(module, output, x)
        if isinstance(module, nn.Hardtanh) and not is_homogeneous_activation(module):
            mark_clipped(result)  # as the same clip called as a function (see gates.held_factors)
        if at_zero is not None and result.requires_grad and bool(at_zero.any()):
            # Whether relevance reaches those outputs is known in the backward pass: none does where a first
            # layer's rule after this module hands what it sets at them to the model input (see ``_glue``).
            checked: list = []
            result.register_hook(functools.partial(_check_zero_inputs, self, module, at_zero, checked))
        return result

    def _rewritten(self, module: nn.Module, output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``output`` with the rule's gradient, on its node or through :meth:`apply`."""
        record = recording()
        if record is None:
            if runs_plain(module) and pass_rule_on_node(output, x):
                return self.on_node(output, x)  # a call by a plan, which puts the rule on the node as recorded
            return self.apply(output, x)
        if self._ruled_on_node(record, output, x):
            record.rule_on_node(module)  # later calls may run the module without its hooks
            return self.on_node(output, x)
        record.rule_applied(module)
        return self.apply(output, x)

    def _ruled_on_node(self, record: Any, output: torch.Tensor, x: torch.Tensor) -> bool:
        """In a call that records its rules' places in the graph: whether the rule went on the node of ``output``,
        an activation of ``x`` whose node saved ``x`` (see :func:`pass_rule_on_node`), where a later call puts it
        too. Only for this class's own :meth:`apply`, whose arithmetic :func:`hook_pass_rule` repeats."""
        if type(self).apply is not type(self).apply_on_node or not pass_rule_on_node(output, x):
            return False
        if not record.hooked(output.grad_fn, PassRuleOnNode(self.stabilizer)):
            return False
        setattr(output, RULED_ON_NODE, self.stabilizer)
        return True

    def on_node(self, output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """What the rule returns for ``output = f(x)`` once its gradient is on ``output``'s node."""
        return output

    def apply(self, output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``output = f(x)`` for an element-wise ``f``, with the rule's gradient."""
        if not x.requires_grad or x.shape != output.shape:
            return output
        if graph_kept() is not None:  # the scale from the output and the input, with their history
            z, stabilizer = output.clone(), self.stabilizer
            return redirect(output, [x], lambda grad: [grad if probing() else grad * pass_factor(z, x, stabilizer)])
        scale = pass_factor(output.detach(), x.detach(), self.stabilizer)
        return redirect(output, [x], lambda grad: [times_pass_factor(scale, grad)])

    # The apply whose gradient :func:`hook_pass_rule` puts on an activation's node: a subclass with an apply of its
    # own keeps it (the rule's gradient then comes from its apply in every call).
    apply_on_node = apply


# What a PassRule notes in the first pass's set (see :func:`first_pass`), with the module's id, once it checked it.
_ZERO_INPUTS = "pass rule at zero inputs"


def warn_if_zero_inputs_drop(rule: Rule, module: nn.Module, at_zero: torch.Tensor, grad: torch.Tensor) -> bool:
    """Warn, naming ``module``, where the gradient ``grad`` of an output ``f(x)`` is nonzero at ``at_zero``, the
    outputs that are nonzero at an input of exactly 0: their relevance is lost, since the pass rule's gradient
    ``f(x) / stabilize(x)`` times ``x = 0`` is 0 (zennit's pass rule hands it on to the layer before). Returns
    whether it warned.

    Examples:
        >>> import warnings
        >>> x = torch.tensor([0.0, 1.0])
        >>> at_zero = (x == 0) & (torch.sigmoid(x) != 0)
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_if_zero_inputs_drop(PassRule(), nn.Sigmoid(), at_zero, torch.ones(2))
        True
        >>> warn_if_zero_inputs_drop(PassRule(), nn.Sigmoid(), at_zero, torch.tensor([0.0, 1.0]))  # none reaches it
        False
    """
    with torch.no_grad():
        lost = int((at_zero & (grad != 0)).sum())
    if lost:
        name = type(module).__name__
        warn_at_caller(
            f"{type(rule).__name__} on {name}: {lost} of its inputs are exactly 0 where its output is not "
            f"({name}(0) != 0), and the relevance of those outputs cannot pass back (an input relevance of "
            "input x gradient is 0 there): it is dropped, where zennit's Pass hands it to the layer before. Map "
            f"the {name} to another rule (EpsilonRule, IgnoreRule), or explain at its input (the pre-activation)"
        )
    return bool(lost)


def _check_zero_inputs(rule: Rule, module: nn.Module, at_zero: torch.Tensor, checked: list, grad: torch.Tensor):
    """A hook on the output of a module under the pass rule: :func:`warn_if_zero_inputs_drop` in the first backward
    pass through it (the relevance pass), not in later ones (a loss's on a relevance kept in the graph)."""
    if not checked and not probing():
        checked.append(True)
        warn_if_zero_inputs_drop(rule, module, at_zero, grad)


def pass_factor(output: torch.Tensor, x: torch.Tensor, stabilizer: float) -> torch.Tensor:
    """The pass rule's factor ``f(x) / stabilize(x)`` for ``output = f(x)``, in float32 for float16 tensors (whose
    smallest step, 6e-8, is far above the stabilisers of 1e-10 and 1e-12: an input of exactly 0 would give 0 / 0),
    returned in ``x``'s dtype.

    Examples:
        >>> x = torch.tensor([0.0, 2.0], dtype=torch.float16)
        >>> pass_factor(torch.nn.functional.gelu(x), x, 1e-10)
        tensor([0.0000, 0.9771], dtype=torch.float16)
    """
    if x.dtype == torch.float16:
        return (output.float() / stabilize(x.float(), stabilizer)).to(x.dtype)
    return output / stabilize(x, stabilizer)


def _recomputed_gelu(node: Any, x: torch.Tensor) -> torch.Tensor:
    return nn.functional.gelu(x, approximate=node._saved_approximate)


def _recomputed_silu(node: Any, x: torch.Tensor) -> torch.Tensor:
    return nn.functional.silu(x)


def _recomputed_erf(node: Any, x: torch.Tensor) -> torch.Tensor:
    return torch.erf(x)


def _recomputed_clamp(node: Any, x: torch.Tensor) -> torch.Tensor:
    return torch.clamp(x, node._saved_min, node._saved_max)


def _recomputed_clamp_min(node: Any, x: torch.Tensor) -> torch.Tensor:
    return torch.clamp_min(x, node._saved_min)


def _recomputed_clamp_max(node: Any, x: torch.Tensor) -> torch.Tensor:
    return torch.clamp_max(x, node._saved_max)


def _recomputed_hardtanh(node: Any, x: torch.Tensor) -> torch.Tensor:
    return nn.functional.hardtanh(x, node._saved_min_val, node._saved_max_val)


# Marks an activation's output whose own node holds the pass rule (see :func:`hook_pass_rule`): the rule's
# stabiliser. A call without the function mode makes no such output, and a module's rule meets the plain one.
RULED_ON_NODE = "_tdhook_pass_rule_on_node"

# The activations whose autograd node saves their input, by the node's type: the function, from the node and its
# saved input.
_SAVING_THEIR_INPUT = {
    "GeluBackward0": _recomputed_gelu,
    "SiluBackward0": _recomputed_silu,
    "ErfBackward0": _recomputed_erf,
}

# Clipping calls' nodes (``clamp``, ``clamp_min``, ``clamp_max`` and ``clip`` with bounds that are numbers,
# ``F.hardtanh``, ``F.relu6``, in place too), which save their input as well (in place, a copy of it as it was): the
# function mode puts the pass rule on them (see ``FunctionalRules``), a module's rule does not (see
# :func:`pass_rule_on_node`).
_CLIPPING = {"ClampBackward1": _recomputed_clamp, "HardtanhBackward0": _recomputed_hardtanh}
_CLIPPING |= {"ClampMinBackward0": _recomputed_clamp_min, "ClampMaxBackward0": _recomputed_clamp_max}
_RECOMPUTED = _SAVING_THEIR_INPUT | _CLIPPING


def clipped_on_node(node: Any) -> bool:
    """Whether ``node`` is a clipping call's whose input :func:`hook_pass_rule` recomputes the output from.

    Examples:
        >>> x = torch.randn(3, requires_grad=True)
        >>> clipped_on_node(x.clamp(-1.0, 1.0).grad_fn), clipped_on_node(x.clamp(torch.tensor(-1.0)).grad_fn)
        (True, False)
    """
    return type(node).__name__ in _CLIPPING


def pass_rule_on_node(output: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether :func:`hook_pass_rule` can put the pass rule on ``output``'s own node: an activation of ``x`` whose
    node saved ``x`` (GELU, SiLU), ``output`` fresh (no view, no marks), outside calls that keep the graph and
    outside saved-tensor hooks (a checkpoint region would run its forward again to give ``x``).

    Examples:
        >>> x = torch.randn(3, requires_grad=True)
        >>> pass_rule_on_node(nn.functional.gelu(x), x), pass_rule_on_node(torch.tanh(x), x)
        (True, False)
    """
    node = output.grad_fn
    return (
        type(node).__name__ in _SAVING_THEIR_INPUT
        and graph_kept() is None
        and not saved_tensors_hooked()
        and not output._is_view()
        and not output.__dict__
        and first_input_is(node, x)
    )


# The activations whose autograd node saves their output, not their input, by the node's type: their rule needs the
# input kept apart (see :func:`hook_pass_rule_given`).
_SAVING_THEIR_OUTPUT = frozenset({"TanhBackward0", "SigmoidBackward0"})


def pass_rule_given_input(output: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether :func:`hook_pass_rule_given` can put the pass rule on ``output``'s own node, given ``x``: an
    activation of ``x`` whose node saved ``output`` (tanh, sigmoid), with the conditions of
    :func:`pass_rule_on_node`.

    Examples:
        >>> x = torch.randn(3, requires_grad=True)
        >>> pass_rule_given_input(torch.tanh(x), x), pass_rule_given_input(nn.functional.gelu(x), x)
        (True, False)
    """
    node = output.grad_fn
    return (
        type(node).__name__ in _SAVING_THEIR_OUTPUT
        and x.shape == output.shape
        and graph_kept() is None
        and not saved_tensors_hooked()
        and not output._is_view()
        and not output.__dict__
        and first_input_is(node, x)
    )


def hook_pass_rule_given(stabilizer: float, x: torch.Tensor, node: Any) -> None:
    """Put the pass rule (stabiliser ``stabilizer``) on the node of an activation of ``x`` that saved its output
    (see :func:`pass_rule_given_input`): a hook that passes ``grad · f(x) / stabilize(x)`` to ``x``, the node's own
    gradient dropped; ``f(x)`` is the output the node saved.

    Examples:
        >>> x = torch.tensor([-1.0, 0.5, 2.0], requires_grad=True)
        >>> h = x * 1
        >>> z = torch.tanh(h)
        >>> hook_pass_rule_given(1e-10, h.detach(), z.grad_fn)
        >>> relevance = x * torch.autograd.grad(z, x, torch.ones(3))[0]
        >>> torch.allclose(relevance, z)
        True
    """
    scale = pass_factor(node._saved_result.detach(), x.detach(), stabilizer)
    node.register_hook(functools.partial(_input_gradient_times, scale))


def hook_pass_rule(stabilizer: float, node: Any, output: torch.Tensor | None = None) -> None:
    """Put the pass rule (stabiliser ``stabilizer``) on an activation's node that saved its input (see
    :func:`pass_rule_on_node`, :func:`clipped_on_node`): a hook that passes ``grad · f(x) / stabilize(x)`` to
    ``x``, the node's own gradient dropped; ``f(x)`` is the node's ``output`` where it is given, else recomputed from
    the saved input (the output's values, bit for bit).

    Examples:
        >>> x = torch.tensor([-1.0, 0.5, 2.0], requires_grad=True)
        >>> z = nn.functional.gelu(x)
        >>> hook_pass_rule(1e-10, z.grad_fn)
        >>> relevance = x * torch.autograd.grad(z, x, torch.ones(3))[0]
        >>> torch.allclose(relevance, z)
        True
    """
    x = node._saved_self.detach()
    f_x = _RECOMPUTED[type(node).__name__](node, x) if output is None else output.detach()
    node.register_hook(functools.partial(_input_gradient_times, pass_factor(f_x, x, stabilizer)))


def _hook_pass_rule_paused(stabilizer: float, node: Any, output: torch.Tensor | None = None) -> None:
    """:func:`hook_pass_rule` as a module's rule computes its factor: in the module's forward hook, where the function
    modes are paused (a caller's mode too), whether it runs there (a recording call) or from a plan after the call;
    from the node's ``output`` where it is given (see :meth:`PassRuleOnNode.given`)."""
    if not torch._C._is_torch_function_mode_enabled():
        hook_pass_rule(stabilizer, node, output)
        return
    with torch._C.DisableTorchFunction():
        hook_pass_rule(stabilizer, node, output)


class PassRuleOnNode(NamedTuple):
    """What puts a module's pass rule (stabiliser ``stabilizer``) on its activation's node, a node that saved its
    input (see :func:`pass_rule_on_node`): ``self(node)`` computes ``f(x)`` again from the saved input, as
    :func:`hook_pass_rule` does; a later call that ran the module without its hooks kept its output, which
    :meth:`given` takes instead (the same values, bit for bit: one kernel call fewer per activation).

    Examples:
        >>> x = torch.tensor([-1.0, 0.5, 2.0], requires_grad=True)
        >>> z = nn.functional.gelu(x)
        >>> PassRuleOnNode(1e-10).given(z.grad_fn, [(z, z._version)])(z.grad_fn)
        >>> torch.equal(x * torch.autograd.grad(z, x, torch.ones(3))[0], z / (x + 1e-10 * x.sign()) * x)
        True
    """

    stabilizer: float

    def __call__(self, node: Any) -> None:
        _hook_pass_rule_paused(self.stabilizer, node)

    def given(self, node: Any, outputs: Sequence[tuple[torch.Tensor, int]]) -> Any:
        """What puts the rule on ``node``: from the output among ``outputs`` (each with its version when its module
        returned it) whose node it is, unchanged in place since; else from the saved input (``self``)."""
        for output, version in outputs:
            if output.grad_fn is node and output._version == version:
                return functools.partial(_hook_pass_rule_paused, self.stabilizer, output=output)
        return self


def times_pass_factor(scale: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``grad · scale``, the pass rule's gradient; in a probe of the glue before a first layer (see
    :func:`~tdhook.attribution.rules._set_relevance.glue_probe`) ``grad`` itself: the rule hands each output's
    relevance to the input at its position whole, an input of 0 included, where its factor ``f(0) / stabilize(0)``
    is 0 and the probe would find that position owned by no input (zennit's pass rule hands it on).

    Examples:
        >>> from tdhook.attribution.rules._set_relevance import glue_probe
        >>> scale, grad = torch.tensor([0.0, 0.5]), torch.tensor([2.0, 2.0])
        >>> times_pass_factor(scale, grad)
        tensor([0., 1.])
        >>> with glue_probe():
        ...     times_pass_factor(scale, grad)
        tensor([2., 2.])
    """
    return grad if probing() else grad * scale


def _input_gradient_times(scale: torch.Tensor, grad_inputs: tuple, grad_outputs: tuple) -> tuple:
    grad = grad_outputs[0]
    return (None if grad is None else times_pass_factor(scale, grad),)


def _scales_each_channel(layer: nn.Module) -> bool:
    """Whether a convolution scales each channel on its own: depthwise, with a kernel of size one, no stride and
    no padding (a string padding, ``"same"`` or ``"valid"``, pads nothing with such a kernel)."""
    if isinstance(layer, nn.Linear) or not hasattr(layer, "groups"):
        return False
    padding = layer.padding if isinstance(layer.padding, tuple) else (0,)
    return (
        layer.groups == layer.in_channels == layer.out_channels
        and all(k == 1 for k in layer.kernel_size)
        and all(s == 1 for s in layer.stride)
        and all(p == 0 for p in padding)
    )


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

    differentiable = True

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
        # In a call that keeps the graph: from a copy of the output with its history (see EpsilonRule).
        share = (output.detach() if graph_kept() is None else output.clone()) / len(tensors)
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


class RefuseRule(Rule):
    """A module the mapper has no rule for: registering it raises, with ``reason``, so nothing is silently wrong.

    The LRP wrapper names the module's path in the error.

    Examples:
        >>> RefuseRule("no rule for attention").register(nn.MultiheadAttention(4, 2))
        Traceback (most recent call last):
        ...
        ValueError: no rule for attention
    """

    #: never in the way of ``create_graph=True``: registering it raises its own reason first
    differentiable = True

    def __init__(self, reason: str) -> None:
        super().__init__()
        self.reason = reason

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def register(self, module: nn.Module) -> RemovableRuleHandle:
        raise ValueError(self.reason)
