"""What the tests of the function rules' plans share: a model with one product, the uniform rule written by
hand, a watch of the plans' applications, a wrapped model and a call of a wrapper."""

from __future__ import annotations

from collections.abc import Callable

import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP

F64 = torch.float64


class Product(nn.Module):
    """``out(a * b)`` with ``a = q(x)``, ``b = k(x)``, no biases; ``a + b`` instead where ``product`` is false, one
    product more (``a * b * v(x)``) with ``extra``, and a copy of ``b`` (one autograd node more, on no path to the
    product) with ``copy``. The flags change the graph between calls on inputs of one shape."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(4, 6, bias=False) for _ in range(3))
        self.out = nn.Linear(6, 3, bias=False)
        self.product, self.extra, self.copy = True, False, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.q(x), self.k(x)
        if self.copy:
            b = b.clone()
        h = a * b if self.product else a + b
        if self.extra:
            h = h * self.v(x)
        return self.out(h)


def halved(t: torch.Tensor) -> torch.Tensor:
    """``t`` with half of its gradient: the uniform rule on a product, written out."""
    return 0.5 * t + 0.5 * t.detach()


def by_hand(model: Product, x: torch.Tensor) -> torch.Tensor:
    """AttnLRP's relevance for ``model``'s argmax logit, with the uniform rule written into the forward pass: each
    product's gradient halved, then gradient × input (every layer is linear and bias-free: LRP-0 is the gradient)."""
    leaf = x.clone().requires_grad_(True)
    a, b = model.q(leaf), model.k(leaf)
    h = halved(a * b) if model.product else a + b
    if model.extra:
        h = halved(h * model.v(leaf))
    logits = model.out(h)
    (grad,) = torch.autograd.grad(logits.max(-1).values.sum(), leaf)
    return leaf.detach() * grad


def call(lrp: LRP, x: torch.Tensor) -> torch.Tensor:
    return lrp(TensorDict(x=x.clone(), batch_size=x.shape[:1]))["relevance", "x"]


def product_model() -> Product:
    torch.manual_seed(0)
    return Product().to(F64)


def plans(lrp: LRP) -> list:
    return [plan for plan in lrp._function_rule_plan._plans.values() if plan is not None]


def wrapped_on_a_batch(
    make: Callable[[], nn.Module], mapper: Callable[[], object], shape: tuple[int, ...] = (5, 4)
) -> tuple[nn.Module, torch.Tensor, LRP]:
    """``make()`` in float64 and a batch of inputs of ``shape``, both drawn after seeding 0, and a wrapper of the model
    under ``mapper()`` (input ``x``, output ``y``)."""
    torch.manual_seed(0)
    model, x = make().to(F64), torch.randn(shape, dtype=F64)
    return model, x, LRP(model, mapper(), in_keys=["x"], out_keys=["y"])


def in_mode_and_in_context(lrp: LRP, x: torch.Tensor, calls: int = 3) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The relevance of a call that enters its context (in the function mode), then of ``calls`` calls in one
    context (the first records, later ones may take the graph's way)."""
    in_mode = call(lrp, x)
    with lrp:
        return in_mode, [call(lrp, x) for _ in range(calls)]


def zoo_calls(name: str, implementation: str, preset: type, calls: int = 3) -> tuple[torch.Tensor, list]:
    """:func:`in_mode_and_in_context` for an architecture of the transformer zoo, on its float64 input."""
    from tests.attribution.test_lrp_transformer_zoo import ZOO, Explained, model_input

    architecture = ZOO[name]
    model = Explained(architecture.build(implementation), architecture.inputs)
    lrp = LRP(model, preset(), in_keys=["x"], out_keys=["y"])
    return in_mode_and_in_context(lrp, model_input(architecture, F64), calls)
