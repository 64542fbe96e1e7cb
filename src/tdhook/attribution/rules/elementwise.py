"""Modules of one's own that compute an element-wise function: relevance passes through them unchanged.

A hand-written activation is often a module with no parameters and no children:
Bloom's ``BloomGelu`` computes ``x * 0.5 * (1 + tanh(...))``, a ``Swish`` computes
``x * sigmoid(x)``. No class name says it is an activation, and the product rules
of AttnLRP and CP-LRP would split its products as if they joined two signals (CP-LRP
then misses conservation by 7.6e-2 on Bloom). What the module computes says it:
its output has its input's shape, each output element depends on the input
element at the same place only (the Jacobian is diagonal), and it is curved (a
module computing ``x / 2`` or ``(x - m) / s`` is glue whose plain gradient is exact). Curved means curved at
the call's input or at fixed probe points spanning ±16, so that the decision does not hang on the samples of
the first call: an ELU (or ``elu(x) + 1``) whose first inputs all fall in its linear part is an activation
still, and gets the pass rule in the context's later calls, as a fresh context gives it.

:class:`ElementwiseRule` is registered on every module without parameters or
children that no other rule claims (:func:`may_be_elementwise`). At its first call in
a context on inputs of a shape (a module may mix what a dimension of size 1 kept apart: the tokens of a
longer sequence) it tests the Jacobian on the call's own autograd graph: for two random
output gradients ``u`` and ``v``, a diagonal Jacobian ``J`` gives
``(Jᵀu) ⊙ v = (Jᵀv) ⊙ u``, and any other almost surely does not; the same test runs at the probe points
above (a module mixing its entries has a zero, diagonal, Jacobian at zeros: a first call on zeros says
nothing). An element-wise module then gets the pass rule it wraps (:class:`PassRule`, or AttnLRP's
:class:`~tdhook.attribution.rules.transformer.PseudoIdentityRule`) on every call,
the first one included; any other module keeps the gradient it had without the rule,
with the function rules acting inside it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from tdhook.attribution.rules.base import RemovableRuleHandle, Rule, rules_apply
from tdhook.attribution.rules.basic import PassRule

__all__ = ["ElementwiseRule", "may_be_elementwise", "is_diagonal", "diagonal_at_probes", "is_curved", "state_kept"]

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
# Where an element-wise module's curvature is looked for besides the call's own input: both signs, from 1/8 to 16.
_PROBE_POINTS = tuple(sign * 2.0**power for power in range(-3, 5) for sign in (-1.0, 1.0))


def may_be_elementwise(module: nn.Module) -> bool:
    """Whether ``module`` is a candidate for :class:`ElementwiseRule`: no parameters and no children (an empty
    container, which returns its input, is none).

    Examples:
        >>> class Swish(nn.Module):
        ...     def forward(self, x):
        ...         return x * torch.sigmoid(x)
        >>> may_be_elementwise(Swish()), may_be_elementwise(nn.Linear(2, 2)), may_be_elementwise(nn.Sequential())
        (True, False, False)
    """
    if isinstance(module, _CONTAINERS):
        return False
    return next(module.parameters(), None) is None and next(module.children(), None) is None


def is_diagonal(output: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``output`` (of ``x``'s shape) depends element by element on ``x``, judged from two
    vector-Jacobian products over the autograd graph between them (kept for the backward pass).

    Examples:
        >>> x = torch.randn(3, 4, requires_grad=True)
        >>> is_diagonal(torch.tanh(x) * x, x), is_diagonal(torch.softmax(x, -1), x)
        (True, False)
    """
    if output.shape != x.shape or not (output.requires_grad and x.requires_grad) or output.numel() == 0:
        return False
    return bool(_diagonal(output, x))


def _diagonal(output: torch.Tensor, x: torch.Tensor) -> bool | None:
    """Whether two vector-Jacobian products from ``output`` to ``x`` say the Jacobian is diagonal; ``None`` where they
    say nothing (no differentiable path, nothing finite)."""
    generator = torch.Generator(device=output.device).manual_seed(0)
    u, v = (torch.rand(output.shape, generator=generator, device=output.device, dtype=output.dtype) + 0.5 for _ in "uv")
    try:
        ju, jv = (torch.autograd.grad(output, x, w, retain_graph=True, allow_unused=True)[0] for w in (u, v))
    except RuntimeError:  # no differentiable path (an integer step, a detached result)
        return None
    if ju is None or jv is None:
        return None
    left, right = ju * v, jv * u
    # A sample that is not finite (NaN, ±inf) says nothing about the function: the other entries decide (a NaN in
    # one sample made every module non-diagonal, and the batch's other samples lost the pass rule).
    finite = left.isfinite() & right.isfinite()
    if not bool(finite.any()):
        return None
    left, right = left.where(finite, 0), right.where(finite, 0)
    scale = left.abs().max().clamp_min(torch.finfo(left.dtype).tiny)
    return bool(((left - right).abs().max() / scale) <= 64 * torch.finfo(left.dtype).eps)


def diagonal_at_probes(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether the module's Jacobian is diagonal at the probe points too (tensors of ``x``'s shape holding the points
    :func:`is_curved` probes): :func:`is_diagonal` at the call's own input may not see a module mix its entries
    (``x * x.roll(1, -1)`` on zeros has a zero Jacobian, diagonal). A probe that fails or gives nothing finite says
    nothing; the module's forward runs on each probe without its hooks and without any function mode.

    Examples:
        >>> class Pairs(nn.Module):
        ...     def forward(self, x):
        ...         return x * x.roll(1, -1)
        >>> class Swish(nn.Module):
        ...     def forward(self, x):
        ...         return x * torch.sigmoid(x)
        >>> zeros = torch.zeros(2, 4, requires_grad=True)
        >>> is_diagonal(Pairs()(zeros), zeros), diagonal_at_probes(Pairs(), zeros), diagonal_at_probes(Swish(), zeros)
        (True, False, True)
    """
    for point in _probes(x):
        probe = point.requires_grad_(True)
        try:
            with torch.enable_grad(), torch._C.DisableTorchFunction():
                output = module.forward(probe)
        except Exception:  # noqa: BLE001 (a probe the module refuses says nothing)
            continue
        if not isinstance(output, torch.Tensor) or output.shape != probe.shape or not output.requires_grad:
            continue
        if _diagonal(output, probe) is False:
            return False
    return True


def is_curved(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether the element-wise ``module`` is curved (a non-zero second derivative somewhere) at ``x`` or at fixed
    probe points spanning ±16: an affine or piecewise-linear one (``x / 2``, ``(x - m) / s``, ``relu``) is not,
    and its plain gradient is exact. The probe points make the answer the same whatever samples ``x`` holds: an
    ELU is curved though every entry of ``x`` is positive.

    The module's own forward runs once more on a copy of ``x`` (and, where ``x`` shows no curvature, on tensors of
    ``x``'s shape holding the probe points), without its hooks and without any function mode (a mode holding a
    gate constant would hide the curve). A probe that fails (a module that refuses negative inputs) says nothing.

    Examples:
        >>> class Swish(nn.Module):
        ...     def forward(self, x):
        ...         return x * torch.sigmoid(x)
        >>> class Scale(nn.Module):
        ...     def forward(self, x):
        ...         return (x - 1) / 2
        >>> class ELU(nn.Module):
        ...     def forward(self, x):
        ...         return torch.where(x > 0, x, torch.expm1(x.clamp(max=0)))
        >>> x = torch.randn(3, 4)
        >>> is_curved(Swish(), x), is_curved(Scale(), x), is_curved(nn.ReLU(), x), is_curved(ELU(), x.abs() + 1)
        (True, False, False, True)
    """
    curved = _curvature_at(module, x)
    if curved is not False:
        return curved is not None
    for probe in _probes(x):
        if _curvature_at(module, probe, failing=False):
            return True
    return False


def _curvature_at(module: nn.Module, x: torch.Tensor, failing: bool = True) -> bool | None:
    """Whether ``module`` is curved at ``x``: ``None`` where its slope does not depend on its input (affine
    everywhere), ``failing`` where it is not twice differentiable there."""
    probe = x.detach().requires_grad_(True)
    try:
        with torch.enable_grad(), torch._C.DisableTorchFunction():
            output = module.forward(probe)
            ones = torch.ones_like(output)
            (slope,) = torch.autograd.grad(output, probe, ones, create_graph=True)
            if not slope.requires_grad:
                return None  # the slope does not depend on x: affine
            (curvature,) = torch.autograd.grad(slope, probe, ones, allow_unused=True)
    except RuntimeError:  # not twice differentiable here: not a plain affine map
        return failing
    except Exception:  # a probe the module refuses (not the call's input, whose errors are the model's own)
        if failing:
            raise
        return False
    # Any non-zero entry, NaN aside (a sample that is not finite), an infinite one included.
    return curvature is not None and bool((curvature.abs() > 0).any())


@contextlib.contextmanager
def state_kept(module: nn.Module) -> Iterator[None]:
    """Run the block with ``module``'s own state put back after it: its buffers (the same tensors, with the values
    they had) and its plain attributes. The probes of :func:`is_curved` and :func:`diagonal_at_probes` run the
    module's forward again, which would otherwise count as calls of a module that keeps a count or a running mean.

    Examples:
        >>> class Counted(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.register_buffer("mean", torch.zeros(3))
        ...         self.calls = 0
        ...     def forward(self, x):
        ...         self.calls += 1
        ...         self.mean.add_(x.detach().mean(0))
        ...         return torch.tanh(x - self.mean)
        >>> counted = Counted()
        >>> _ = counted(torch.ones(2, 3))
        >>> with state_kept(counted):
        ...     _ = counted(torch.full((2, 3), 5.0))
        >>> counted.calls, counted.mean.tolist()
        (1, [1.0, 1.0, 1.0])
    """
    attributes = dict(module.__dict__)
    buffers = dict(module._buffers)
    values = {name: buffer.clone() for name, buffer in buffers.items() if buffer is not None and not is_lazy(buffer)}
    try:
        yield
    finally:
        for name in [name for name in module.__dict__ if name not in attributes]:
            del module.__dict__[name]
        module.__dict__.update(attributes)
        module._buffers.clear()
        module._buffers.update(buffers)
        with torch.no_grad():
            for name, value in values.items():
                if not torch.equal(buffers[name], value):  # left alone where the probes changed nothing
                    buffers[name].copy_(value)


def _probes(x: torch.Tensor) -> list[torch.Tensor]:
    """Tensors of ``x``'s shape, dtype and device that together hold every probe point (several where ``x`` has
    fewer entries than there are points)."""
    count = x.numel()
    if count == 0:
        return []
    points = torch.tensor(_PROBE_POINTS, dtype=x.dtype, device=x.device)
    chunks = points.split(count)
    return [chunk.repeat(-(-count // len(chunk)))[:count].reshape(x.shape) for chunk in chunks]


class ElementwiseRule(Rule):
    """The pass rule on a module that proves element-wise at its first call (see the module's docstring).

    Args:
        rule: the pass rule applied to element-wise modules (:class:`PassRule` under the CNN presets,
            :class:`~tdhook.attribution.rules.transformer.PseudoIdentityRule` under AttnLRP and CP-LRP).

    Examples:
        >>> class Swish(nn.Module):
        ...     def forward(self, x):
        ...         return x * torch.sigmoid(x)
        >>> x = torch.tensor([[-1.0, 0.5, 2.0]], requires_grad=True)
        >>> swish = Swish()
        >>> with ElementwiseRule(PassRule()).register(swish):
        ...     z = swish(x * 1)
        ...     relevance = x * torch.autograd.grad(z, x, torch.ones_like(z))[0]
        >>> torch.allclose(relevance, z)  # relevance passes through unchanged
        True
    """

    # Function modes act inside the module: where it is not element-wise, it keeps the gradient it had unruled.
    acts_in_forward = True
    # The module's own input, not a copy, even where it says it works in place: the test needs the input the
    # output was computed from (timm's ``GammaAct`` has ``inplace=True`` but returns ``gelu(x).mul_(gamma)``, a new
    # tensor), and a module that does change its input in place is decided at once (its plain gradient).
    uses_input = False
    #: some calls keep their own gradient: the coverage watch looks inside modules with this rule.
    decides_every_call = False

    def __init__(self, rule: PassRule) -> None:
        if not isinstance(rule, PassRule):
            raise TypeError(f"ElementwiseRule: rule must be a PassRule, got {type(rule).__name__}")
        super().__init__()
        self.rule = rule

    @property
    def differentiable(self) -> bool:  # type: ignore[override]
        return self.rule.differentiable

    def prepare(self, module: nn.Module) -> dict:
        """Whether the module is element-wise, by the shape of its inputs: not known until its first call on inputs of
        that shape in the context."""
        return {}

    def register(self, module: nn.Module) -> RemovableRuleHandle:
        handle = super().register(module)
        try:
            registration = self._registrations[module]
            registration.hooks.append(module.register_forward_pre_hook(partial(self._alias_input, registration.state)))
        except BaseException:  # an interrupt: the hooks added so far removed, as Rule.register does for its own
            self.unregister(module)
            raise
        return handle

    @staticmethod
    def _alias_input(decided: dict, module: nn.Module, args: tuple) -> tuple | None:
        """Until the module is decided for inputs of this shape: its input as a fresh view, so that the test's two
        products end there and run no hook of the input's own (the relevance of a layer named in ``layers``, a
        relevance check)."""
        if len(args) != 1 or not rules_apply(module):
            return None
        x = args[0]
        if not isinstance(x, torch.Tensor) or not x.requires_grad or x.shape in decided:
            return None
        alias = x.view_as(x)
        alias.__dict__.update(x.__dict__)  # the marks the rules set on the input (a gate, parameter-derived)
        return (alias,)

    def rewrite(self, module: nn.Module, registration: Any, inputs: tuple, output: torch.Tensor) -> torch.Tensor | None:
        if len(inputs) != 1 or not isinstance(inputs[0], torch.Tensor) or not inputs[0].requires_grad:
            return None
        x, decided = inputs[0], registration.state
        if output.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
            decided.setdefault(x.shape, False)  # a view or an in-place change of the input: its plain gradient is exact
            return None
        if x.shape not in decided:  # element-wise and curved: an activation; affine glue keeps its exact gradient
            # The module's forward runs again on probes: on a fork of the global random state (a module that draws,
            # a dropout written by hand, leaves the draws of the model's later modules as in a plain call).
            # Its buffers and attributes come back as the call left them (a module that counts its calls or keeps a
            # running mean would take the probes in).
            with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []), state_kept(module):
                decided[x.shape] = is_diagonal(output, x) and diagonal_at_probes(module, x) and is_curved(module, x)
        return self.rule.apply(output, x) if decided[x.shape] else None
