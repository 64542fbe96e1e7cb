"""AttnLRP and CP-LRP: the rules for transformers, and the presets that map a whole model.

Every rule keeps tdhook's convention: the relevance of a tensor ``a`` is
``a * grad(a)``, and a rule only changes the gradient. With ``R = z * g`` the
relevance arriving at an output ``z`` (``g`` its gradient):

* :class:`SoftmaxEpsilonRule`: ``R_x = x ⊙ (R − s · ΣR)`` for ``s = softmax(x)``
  (AttnLRP's softmax rule). Its gradient is ``R_x / x``, which with ``ε = 0`` is
  exactly the plain gradient of the softmax.
* :class:`LayerNormRule`: LayerNorm and RMSNorm with the normalising scale
  ``1 / σ`` held constant, so the layer is linear in its input.
* :class:`PseudoIdentityRule`: an element-wise non-linearity passes its
  relevance on unchanged, ``R_x = R`` (AttnLRP's identity rule).
* The product of two activations (``q · kᵀ``, ``attention · v``, a gate times
  an up-projection) gives each factor half of the product's relevance
  (AttnLRP's uniform rule, :func:`uniform_product`).
* :class:`AHQKVRule`: attention weights carry no relevance; it flows through
  the value path only (CP-LRP).

Products, softmax and attention are functions, not modules: the presets
:class:`~tdhook.attribution.mappers.transformer.AttnLRP` and
:class:`~tdhook.attribution.mappers.transformer.CPLRP` apply them while the
wrapper runs the model's forward pass, through
:class:`~tdhook.attribution.rules.functional.FunctionalRules`,
without changing the model's code or classes.
"""

from __future__ import annotations

import torch
from torch import nn

from tdhook.attribution.rules._arguments import nonnegative
from tdhook.attribution.rules._autograd import PARAMETER_DERIVED, hold, redirect, scale_gradient
from tdhook.attribution.rules._keeping_graph import graph_kept
from tdhook.attribution.rules._numerics import epsilon_factor
from tdhook.attribution.rules.base import RemovableRuleHandle, Rule, _single_input
from tdhook.attribution.rules.basic import RULED_ON_NODE, PassRule
from tdhook.attribution.rules.gates import GATE_MARK, mark_gate, mark_weights
from tdhook.attribution.rules.normalization import LayerNormRule
from tdhook.attribution.tunables import EPSILON

__all__ = [
    "SoftmaxEpsilonRule",
    "LayerNormRule",
    "PseudoIdentityRule",
    "AHQKVRule",
    "uniform_product",
]


def uniform_product(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The factors of a product, each with half of the product's relevance (AttnLRP's uniform rule).

    For ``z = a * b`` (or ``a @ b``) the plain gradient gives each factor the
    whole ``R = z · g``; halving both gradients gives ``R_a = R_b = R / 2``.

    Examples:
        >>> a = torch.tensor([2.0], requires_grad=True)
        >>> b = torch.tensor([3.0], requires_grad=True)
        >>> ha, hb = uniform_product(a, b)
        >>> ga, gb = torch.autograd.grad(ha * hb, (a, b))
        >>> (a * ga).item(), (b * gb).item()
        (3.0, 3.0)
    """
    return scale_gradient(a, 0.5), scale_gradient(b, 0.5)


class SoftmaxEpsilonRule(Rule):
    """AttnLRP's softmax rule: ``R_x = x ⊙ (R − s · ΣR)`` with ``s = softmax(x)`` and ``R = s ⊙ g``.

    The gradient handed to ``x`` is ``R_x / stabilize(x, ε)``; with ``ε = 0`` it
    is ``R − s · ΣR``, the plain gradient of the softmax, so nothing is changed.
    Masked logits (``-inf`` or the dtype's lowest value) receive no relevance.
    Registered on ``nn.Softmax`` modules; :class:`AttnLRP` also applies it to
    ``torch.softmax`` and ``F.softmax`` calls.

    Args:
        epsilon: stabilizer of the division by ``x``.

    Examples:
        >>> from torch import nn
        >>> x = torch.tensor([[1.0, -2.0, 0.5]], requires_grad=True)
        >>> softmax = nn.Softmax(dim=-1)
        >>> with SoftmaxEpsilonRule(epsilon=0.1).register(softmax):
        ...     s = softmax(x)
        ...     relevance_out = torch.tensor([[0.3, -0.1, 0.6]])
        ...     relevance = x * torch.autograd.grad(s, x, relevance_out / s)[0]
        >>> closed = x * (relevance_out - s * relevance_out.sum(-1, keepdim=True))
        >>> torch.allclose(relevance, closed * x / (x + 0.1 * x.sign()))
        True
    """

    tunables = {"epsilon": EPSILON}
    differentiable = True

    def __init__(self, epsilon: float = 0.0) -> None:
        nonnegative(type(self).__name__, "epsilon", epsilon)
        super().__init__()
        self.epsilon = epsilon

    def apply(self, output: torch.Tensor, x: torch.Tensor, dim: int) -> torch.Tensor:
        """``output = softmax(x, dim)`` with the rule's gradient, marked as weights: held where it multiplies an
        activation element by element (see :func:`~tdhook.attribution.rules.gates.weighing_factors`).

        Over one element the softmax is the constant 1, whatever its input (its gradient is zero): a constant, as a
        parameter is, so that a product with it (attention over one key) is a linear map of the other factor, which
        takes all of its relevance. The uniform rule gave the constant half of it, which it passed to nothing."""
        if isinstance(dim, int) and output.dim() > 0 and output.shape[dim] == 1:
            setattr(output, PARAMETER_DERIVED, True)
            return output
        if self.epsilon == 0 or not x.requires_grad:
            return mark_weights(output)
        if graph_kept() is not None:
            return mark_weights(self._redirect_keeping_graph(output, x, dim))
        return mark_weights(self._redirect(output, x, dim))

    def _redirect(self, output: torch.Tensor, x: torch.Tensor, dim: int) -> torch.Tensor:
        """``output`` with the rule's gradient to ``x``, from detached copies of the output and the logits."""
        s = output.detach()
        logits = x.detach()
        masked = logits <= torch.finfo(logits.dtype).min

        def backward(grad: torch.Tensor) -> list[torch.Tensor]:
            relevance = s * grad
            # x · (…) / stabilize(x, ε) as factor · (…): in float32 for float16 logits and an ε below its step
            grad_in = epsilon_factor(logits, self.epsilon) * (relevance - s * relevance.sum(dim, keepdim=True))
            return [torch.where(masked, 0, grad_in).to(grad.dtype)]

        return redirect(output, [x], backward)

    def _redirect_keeping_graph(self, output: torch.Tensor, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The rule in a call that keeps the graph: from copies of the output and the logits, with their history.

        Masked logits enter as 0 (their relevance is 0 either way), so that no infinity reaches the derivative.
        """
        s, epsilon = output.clone(), self.epsilon
        masked = x.detach() <= torch.finfo(x.dtype).min
        logits = torch.where(masked, 0, x)

        def backward(grad: torch.Tensor) -> list[torch.Tensor]:
            relevance = s * grad
            grad_in = epsilon_factor(logits, epsilon) * (relevance - s * relevance.sum(dim, keepdim=True))
            return [torch.where(masked, 0, grad_in).to(grad.dtype)]

        return redirect(output, [x], backward)

    def register(self, module: nn.Module) -> RemovableRuleHandle:
        """Attach the rule to an ``nn.Softmax`` module; any other module is refused, naming its class.

        Raises:
            TypeError: ``module`` is not an ``nn.Softmax`` (a container, a layer, ``nn.LogSoftmax``, ...): the
                rule rewrites the module's output as ``softmax(input, module.dim)``, which only a softmax computes.
        """
        if not isinstance(module, nn.Softmax):
            raise TypeError(
                f"{type(self).__name__} expects an nn.Softmax module (it treats the module's output as "
                f"softmax(input, dim=module.dim)), got {type(module).__name__}; softmax calls inside other modules "
                "are covered by the function rules of the AttnLRP and CPLRP presets"
            )
        return super().register(module)

    def rewrite(self, module, registration, inputs, output):
        return self.apply(output, _single_input(self, module, inputs), module.dim)


class AHQKVRule(SoftmaxEpsilonRule):
    """CP-LRP: attention weights are constants, so relevance flows through the value path only.

    ``softmax`` outputs get no gradient; for a fused attention
    (``F.scaled_dot_product_attention``) the query and key get none. The
    product ``attention · v`` then hands all its relevance to ``v``.

    Examples:
        >>> from torch import nn
        >>> x = torch.tensor([[1.0, -2.0]], requires_grad=True)
        >>> softmax = nn.Softmax(dim=-1)
        >>> with AHQKVRule().register(softmax):
        ...     softmax(x).requires_grad
        False
    """

    tunables = {}

    def __init__(self) -> None:
        super().__init__(epsilon=0.0)

    def apply(self, output, x, dim):
        # Marked as weights still: joined with other activations (``torch.cat([softmax(a), h], 1) * s``), their
        # elements are held, as the product with them apart is linear in the other factor (see _joined_weights).
        return mark_weights(hold(output))


class PseudoIdentityRule(PassRule):
    """AttnLRP's identity rule for element-wise non-linearities: ``R_x = R``.

    The input gradient is ``g · f(x) / stabilize(x)``; with a tiny stabilizer
    ``x · grad = f(x) · g = R``. :class:`AttnLRP` also applies it to functional
    activations (``F.gelu``, ``F.silu``, ``torch.tanh``, …).

    Examples:
        >>> from torch import nn
        >>> x = torch.tensor([-1.0, 0.5, 2.0], requires_grad=True)
        >>> act = nn.GELU()
        >>> with PseudoIdentityRule().register(act):
        ...     z = act(x)
        ...     relevance = x * torch.autograd.grad(z, x, torch.ones(3))[0]
        >>> torch.allclose(relevance, z)
        True
    """

    def __init__(self, stabilizer: float = 1e-10) -> None:
        super().__init__(stabilizer)

    def apply(self, output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if getattr(output, GATE_MARK, None) is x and getattr(output, RULED_ON_NODE, None) != self.stabilizer:
            return output  # the functional activation inside this module already has the rule
        # An activation whose node holds the rule, with this rule's stabiliser, gets it here as well (the same
        # factor, and its node no gradient): a later call, without the function mode, finds the graph it records.
        result = super().apply(output, x)
        if result.requires_grad:
            # Marked as an activation's output: CP-LRP holds such a tensor constant where it gates another one.
            mark_gate(result, x)
        return result

    apply_on_node = apply

    def on_node(self, output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return mark_gate(output, x)  # marked as apply marks it
