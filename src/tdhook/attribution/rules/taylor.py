"""The first-order Taylor rule: relevance from the Jacobian of any differentiable module at a reference point.

For a module ``f`` with inputs ``x`` and output relevance ``R``:

``R(x) = x ⊙ J_f(ref)ᵀ · (R / stabilize(z, ε))``

where ``J_f(ref)`` is the Jacobian of ``f`` at the reference point and ``z``
the part of the output the relevance is shared by: the linear term
``J_f(ref) · x`` (``bias=False``, the constant ``f(ref)`` left out) or the
output ``f(x)`` itself (``bias=True``). For a linear ``f`` with ``bias=False``
this is the ε-rule on ``f`` with its bias left out of the denominator.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from tdhook.attribution.rules._arguments import finite_number, nonnegative
from tdhook.attribution.rules._autograd import redirect
from tdhook.attribution.rules._keeping_graph import graph_kept
from tdhook.attribution.rules._numerics import carrying_gradient, safe_divide, stabilize, uncarried_rest
from tdhook.attribution.rules._plain_calls import run_alone
from tdhook.attribution.rules.base import Registration, Rule, plain_calls
from tdhook.attribution.tunables import EPSILON

__all__ = ["TaylorDecompositionRule"]

Reference = float | torch.Tensor | Sequence[float | torch.Tensor]
BiasDistribution = Callable[[tuple[torch.Tensor, ...], list[torch.Tensor]], Sequence[torch.Tensor]]


class TaylorDecompositionRule(Rule):
    """First-order Taylor decomposition of a module at a reference point.

    ``R(x_k) = x_k ⊙ J_k(ref)ᵀ · (R / stabilize(z, ε))`` for every floating input
    ``x_k`` that requires grad, with ``J_k(ref)`` the Jacobian of the module's
    output with respect to ``x_k`` at the reference point (the other arguments
    as given) and ``R`` the output's relevance. ``z = Σ_k J_k(ref) · x_k`` with
    ``bias=False``; ``z = f(x)``, the output, with ``bias=True``. The module is
    evaluated at the reference as it is: rules of the modules inside it take
    no part.

    Args:
        ref: the reference point: a number, a tensor broadcastable to every
            input, or one number or tensor per floating input that needs a gradient, in order.
        bias: share the relevance by the output ``f(x)`` (which holds the bias
            ``f(ref)``) instead of by the linear term ``J_f(ref) · x``.
        distribute_bias: with ``bias=True``, ``(inputs, relevances) -> relevances``
            called with the floating inputs and their relevances; what it
            returns is used instead (for example the bias's share spread over
            the inputs).
        epsilon: the stabilizer of ``z``.

    Examples:
        >>> block = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
        >>> x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
        >>> with TaylorDecompositionRule(ref=0.5).register(block):
        ...     out = block(x)
        ...     relevance = x * torch.autograd.grad(out[:, 0].sum(), x)[0]
        >>> ref = torch.full((3,), 0.5, dtype=torch.float64)
        >>> jacobian = torch.func.jacrev(block)(ref)  # J_f(ref), the same for every sample
        >>> z = x.detach() @ jacobian.T
        >>> expected = x.detach() * (out.detach()[:, :1] / (z[:, :1] + 1e-6 * z[:, :1].sign())) * jacobian[0]
        >>> torch.allclose(relevance, expected)
        True
    """

    tunables = {"epsilon": EPSILON, "bias": (bool, {"choices": [False, True]})}
    differentiable = True
    one_output_only = True
    # The rules inside the module act in its forward as they would (a norm's rule checks that it ran); the
    # evaluation at the reference leaves them out.
    pauses_function_modes = False
    reaches_inner_modules = False  # their outputs get no gradient: their relevance (``layers``) is refused

    def __init__(
        self,
        ref: Reference = 0.0,
        bias: bool = False,
        distribute_bias: BiasDistribution | None = None,
        epsilon: float = 1e-6,
    ) -> None:
        nonnegative(type(self).__name__, "epsilon", epsilon)
        if not isinstance(bias, bool):
            raise ValueError(f"{type(self).__name__}: bias must be True or False, got {bias!r}")
        if distribute_bias is not None and not callable(distribute_bias):
            raise ValueError(
                f"{type(self).__name__}: distribute_bias must be a callable (inputs, relevances) -> relevances, "
                f"got {type(distribute_bias).__name__}"
            )
        if distribute_bias is not None and not bias:
            raise ValueError(
                f"{type(self).__name__}: distribute_bias is only used with bias=True (with bias=False the bias "
                "receives no relevance)"
            )
        _check_reference(type(self).__name__, ref)
        super().__init__()
        self.ref = ref
        self.bias = bias
        self.distribute_bias = distribute_bias
        self.epsilon = epsilon

    def _references(self, module: nn.Module, xs: list[torch.Tensor], keep: bool = False) -> list[torch.Tensor]:
        """One reference per input in ``xs``, expanded to its shape; in a call that keeps the graph (``keep``), a
        reference that requires grad (a parameter of the model's) keeps its history, so that the relevance's
        derivative reaches it."""
        refs = self.ref if isinstance(self.ref, (list, tuple)) else [self.ref] * len(xs)
        if len(refs) != len(xs):
            raise ValueError(
                f"{type(self).__name__}: ref must hold one reference per floating input of "
                f"{type(module).__name__} that needs a gradient ({len(xs)}), got {len(refs)}"
            )
        references = []
        for ref, x in zip(refs, xs, strict=True):
            ref = torch.as_tensor(ref, dtype=x.dtype, device=x.device)
            try:
                references.append((ref if keep and ref.requires_grad else ref.detach()).expand_as(x).clone())
            except RuntimeError:
                raise ValueError(
                    f"{type(self).__name__}: ref of shape {tuple(ref.shape)} does not broadcast to the input of "
                    f"{type(module).__name__} of shape {tuple(x.shape)}"
                ) from None
        return references

    def rewrite(self, module, registration: Registration, inputs, output):
        positions = [
            i for i, a in enumerate(inputs) if isinstance(a, torch.Tensor) and a.is_floating_point() and a.requires_grad
        ]
        if not positions:
            return None
        # In a call that keeps the graph: the inputs, the output and J_f(ref) · x with their history.
        keep = graph_kept() is not None
        xs = [inputs[i].clone() if keep else inputs[i].detach() for i in positions]
        leaves = [ref.requires_grad_(True) for ref in self._references(module, xs, keep)]
        at_ref, linear_term = self._evaluate(module, registration, inputs, positions, leaves, xs, keep)
        relevance_out_value = output.clone() if keep else output.detach()
        z = relevance_out_value if self.bias else linear_term
        if self.epsilon:
            scale = relevance_out_value / stabilize(z, self.epsilon)
        else:  # a share of a zero z is 0 (0 / 0 taken as 0, as the ε-rule takes it), not NaN
            scale = safe_divide(relevance_out_value, z)
        targets = [inputs[i] for i in positions]

        def backward(grad: torch.Tensor) -> list[torch.Tensor | None]:
            vjps = torch.autograd.grad(
                at_ref,
                leaves,
                grad * scale,
                retain_graph=True,
                allow_unused=True,
                create_graph=torch.is_grad_enabled(),
            )
            grads = [torch.zeros_like(x) if g is None else g for g, x in zip(vjps, xs, strict=True)]
            if self.distribute_bias is None:
                return grads
            relevances = [x * g for x, g in zip(xs, grads, strict=True)]
            relevances = list(self.distribute_bias(tuple(xs), relevances))
            if len(relevances) != len(xs):
                raise ValueError(
                    f"{type(self).__name__} on {type(module).__name__}: distribute_bias returned {len(relevances)} "
                    f"relevances for its {len(xs)} inputs (one per floating input that needs a gradient)"
                )
            for x, relevance in zip(xs, relevances, strict=True):
                if not isinstance(relevance, torch.Tensor) or relevance.shape != x.shape:
                    got = tuple(relevance.shape) if isinstance(relevance, torch.Tensor) else type(relevance).__name__
                    raise ValueError(
                        f"{type(self).__name__} on {type(module).__name__}: distribute_bias returned {got} for an "
                        f"input of shape {tuple(x.shape)}; it must return one relevance per input, each a tensor of "
                        "its input's shape"
                    )
            grads = []
            for x, target, relevance in zip(xs, targets, relevances, strict=True):
                grad_x = carrying_gradient(relevance, x)
                registration.records.append((target, uncarried_rest(relevance, x, grad_x)))
                grads.append(grad_x)
            return grads

        return redirect(output, targets, backward)

    def _evaluate(
        self,
        module: nn.Module,
        registration: Registration,
        inputs: tuple,
        positions: list[int],
        leaves: list[torch.Tensor],
        xs: list[torch.Tensor],
        keep: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``f(ref)`` with its graph to the reference leaves, and ``J_f(ref) · x`` (with ``bias=False``)."""
        registration.busy.append(threading.get_ident())  # its own hook must not run on this thread's inner call
        try:
            keywords = getattr(inputs, "keywords", ())  # the arguments the call gave by keyword, last
            if keep and not self.bias:  # J_f(ref) · x with its graph: see _linear_term
                with torch.enable_grad(), run_alone(), _LayerNormWrittenOut():
                    at_ref = _call_at_reference(module, _replaced(inputs, positions, leaves), keywords)
                    return at_ref, _linear_term(at_ref, leaves, xs)
            # plain_calls: the rules of the modules inside take no part; no torch function mode either (the
            # mapper's held gates and stabilised sums, the norms' held scales): the Jacobian is the plain one.
            with torch.enable_grad(), plain_calls(), torch._C.DisableTorchFunction():
                if self.bias:
                    return _call_at_reference(module, _replaced(inputs, positions, leaves), keywords), None
                _load_forward_ad()
                with forward_ad.dual_level():
                    duals = [forward_ad.make_dual(ref, x) for ref, x in zip(leaves, xs, strict=True)]
                    try:
                        at_ref = _call_at_reference(module, _replaced(inputs, positions, duals), keywords)
                    except NotImplementedError as err:
                        raise NotImplementedError(
                            f"{type(self).__name__} on {type(module).__name__}: with bias=False the rule takes "
                            f"J_f(ref) · x by forward-mode differentiation, which an operation of the module lacks "
                            f"({str(err).splitlines()[0]}); use bias=True, which needs only the backward pass"
                        ) from err
                    primal, tangent = forward_ad.unpack_dual(at_ref)
                    tangent = torch.zeros_like(primal) if tangent is None else tangent.detach()
                return primal, tangent
        finally:
            registration.busy.remove(threading.get_ident())


class _LayerNormWrittenOut(TorchFunctionMode):
    """``F.layer_norm`` as the operations it stands for (mean, variance, ``rsqrt``): the derivative of torch's fused
    kernel's double backward is off (1e-3 to 87 % against finite differences), and a relevance that keeps its graph
    takes it through ``J_f(ref) · x`` (see :func:`_linear_term`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.layer_norm:
            return _layer_norm(*args, **kwargs)
        return func(*args, **kwargs)


def _layer_norm(
    input: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``F.layer_norm`` written out.

    Examples:
        >>> h, w = torch.randn(2, 5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
        >>> torch.allclose(_layer_norm(h, (5,), w), F.layer_norm(h, (5,), w))
        True
    """
    dims = tuple(range(-len(normalized_shape), 0))
    centred = input - input.mean(dims, keepdim=True)
    out = centred * torch.rsqrt((centred * centred).mean(dims, keepdim=True) + eps)
    out = out if weight is None else out * weight
    return out if bias is None else out + bias


def _linear_term(at_ref: torch.Tensor, leaves: list[torch.Tensor], xs: list[torch.Tensor]) -> torch.Tensor:
    """``J_f(ref) · x`` with its graph, for a call that keeps it: by backward passes alone, as the derivative of
    ``u ↦ Σ_k (J_k(ref)ᵀ u) · x_k`` (which is linear in ``u``). The forward-mode tangent's own derivative is not
    reliable (torch's ``layer_norm`` gave a derivative 7 % to 87 % off its finite differences, its softmax raised)."""
    probe = torch.zeros_like(at_ref, requires_grad=True)
    pulled = torch.autograd.grad(at_ref, leaves, probe, create_graph=True, allow_unused=True)
    paired = sum((g * x).sum() for g, x in zip(pulled, xs, strict=True) if g is not None)
    if not isinstance(paired, torch.Tensor) or not paired.requires_grad:
        return torch.zeros_like(at_ref)  # the output does not depend on the inputs
    (term,) = torch.autograd.grad(paired, probe, create_graph=True, allow_unused=True)
    return torch.zeros_like(at_ref) if term is None else term


def _call_at_reference(module: nn.Module, args: tuple, keywords: tuple[str, ...] = ()) -> torch.Tensor:
    """The module at the reference, on copies of its buffers where it has any; the last ``len(keywords)`` of
    ``args`` given by those keywords, as the call gave them.

    A module in training mode updates buffers in its forward (a BatchNorm's
    running statistics); the evaluation at the reference is no forward of the
    model's and must leave them as they are.
    """
    split = len(args) - len(keywords)
    positional, named = args[:split], dict(zip(keywords, args[split:], strict=True))
    buffers = {name: buffer.detach().clone() for name, buffer in module.named_buffers()}
    if not buffers:
        return module(*positional, **named)
    return torch.func.functional_call(module, buffers, positional, named)


def _replaced(inputs: tuple, positions: list[int], values: list[torch.Tensor]) -> tuple:
    args = list(inputs)
    for i, value in zip(positions, values, strict=True):
        args[i] = value
    return tuple(args)


def _check_reference(owner: str, ref: object) -> None:
    for value in ref if isinstance(ref, (list, tuple)) else [ref]:
        if isinstance(value, torch.Tensor):
            if not (value.is_floating_point() and bool(torch.isfinite(value).all())):
                raise ValueError(f"{owner}: ref must hold finite floating-point numbers, got {value!r}")
        else:
            finite_number(owner, "ref", value)


@functools.cache
def _load_forward_ad() -> None:
    """Load what forward-mode differentiation needs, once, with the warnings of the loading silenced.

    Its first use in a process loads torch's decompositions for it, which script functions with ``torch.jit``, and
    ``torch.jit.script`` warns (``FutureWarning``) in the torch versions that deprecate it: a warning from torch's own
    code, which a caller running with ``-W error`` would get as an error from the rule.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with forward_ad.dual_level():
            forward_ad.make_dual(torch.zeros(1), torch.zeros(1))
