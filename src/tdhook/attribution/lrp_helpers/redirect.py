"""Autograd functions that let a rule choose the gradient flowing through a module.

Every LRP rule in tdhook is a change of gradient: the relevance of a tensor ``a``
is ``a * grad(a)``. A rule replaces a module's output by a tensor with the same
value (bit for bit, no copy) whose backward is chosen by the rule. Two functions
do this:

* :func:`redirect` hands the output gradient to other tensors (for example the
  output of a forward pass with modified weights) through a function of the
  rule's choice.
* :func:`relevance_proxy` stands for an input whose relevance is not
  proportional to its value (the input-layer rules and the uniform rule). Its
  backward receives gradients for stand-in tensors, turns them into relevance
  and hands the caller both the gradient for the input and the part of the
  relevance a gradient cannot carry (where the input is zero).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["redirect", "relevance_proxy", "backward_keeps_graph", "is_batched_gradient"]


def backward_keeps_graph() -> bool:
    """Whether the running backward pass keeps the graph for another one (``retain_graph`` or ``create_graph``).

    When it does not, the tensors a rule saved for its backward are not needed
    again and the rule may write into them instead of allocating new ones.
    Outside a backward pass, and on a torch without this query, the answer is
    ``True`` (the safe side).

    Examples:
        >>> backward_keeps_graph()
        True
    """
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if query is None else bool(query())


def is_batched_gradient(grad: torch.Tensor) -> bool:
    """Whether ``grad`` is a batch of gradients (``is_grads_batched``, vectorized Jacobians, ``torch.func.vmap``).

    A rule's backward then runs once for the whole batch, and may neither write
    into ``grad`` nor call operations that have no batching rule.

    Examples:
        >>> seen = []
        >>> _ = torch.func.vmap(lambda grad: seen.append(is_batched_gradient(grad)) or grad)(torch.ones(2, 3))
        >>> is_batched_gradient(torch.ones(3)), seen
        (False, [True])
    """
    functorch = getattr(torch._C, "_functorch", None)
    checks = [getattr(functorch, name, None) for name in ("is_legacy_batchedtensor", "is_batchedtensor")]
    return any(check is not None and check(grad) for check in checks)


BackwardFn = Callable[[torch.Tensor], Sequence[torch.Tensor | None]]


_FREED_GRAPH_GUARD = torch.empty(0)


class _Redirect(torch.autograd.Function):
    @staticmethod
    def forward(ctx, backward_fn: BackwardFn, output: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        # ``output`` is a detached alias of the module's output: marking it dirty
        # returns the very same storage with this node as its history, so later
        # in-place operations (ReLU(inplace=True), ``out += identity``) stay legal.
        ctx.mark_dirty(output)
        ctx.backward_fn = backward_fn
        ctx.n_inputs = len(inputs)
        # A saved tensor makes a second backward pass over a freed graph raise torch's own error: rules may
        # have written into what they kept for the first one (see backward_keeps_graph).
        ctx.save_for_backward(_FREED_GRAPH_GUARD)
        return output

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.saved_tensors  # noqa: B018 (raises once the graph is freed)
        grads = tuple(ctx.backward_fn(grad))
        if len(grads) != ctx.n_inputs:
            raise RuntimeError(f"a rule's backward returned {len(grads)} gradients for {ctx.n_inputs} inputs")
        return (None, None, *grads)


def redirect(output: torch.Tensor, inputs: Sequence[torch.Tensor], backward_fn: BackwardFn) -> torch.Tensor:
    """Return ``output``'s value with a backward that sends gradient to ``inputs``.

    The module's own graph behind ``output`` receives no gradient. The value is
    the same storage as ``output``: nothing is copied.

    Args:
        output: the module's output.
        inputs: tensors that receive gradient (they must require grad to be reached).
        backward_fn: maps the gradient of the output to one gradient (or ``None``)
            per tensor in ``inputs``.

    Returns:
        A tensor equal to ``output`` whose gradient flows as ``backward_fn`` says.

    Examples:
        >>> import torch
        >>> x = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> y = redirect(x.exp(), [x], lambda g: [3 * g])
        >>> torch.equal(y, torch.tensor([1.0, 2.0]).exp())
        True
        >>> torch.autograd.grad(y.sum(), x)[0]
        tensor([3., 3.])
    """
    return _Redirect.apply(backward_fn, output.detach(), *inputs)


RelevanceFn = Callable[[Sequence[torch.Tensor]], torch.Tensor]
RecordFn = Callable[[torch.Tensor], None]


class _RelevanceProxy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, relevance_fn: RelevanceFn, record_fn: RecordFn, x: torch.Tensor, *stand_ins: torch.Tensor):
        ctx.relevance_fn = relevance_fn
        ctx.record_fn = record_fn
        ctx.save_for_backward(x)
        outputs = tuple(s.detach().clone() if s is x else s.detach() for s in stand_ins)
        return outputs if len(outputs) > 1 else outputs[0]

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        (x,) = ctx.saved_tensors
        relevance = ctx.relevance_fn(grads)
        grad_x = torch.where(x != 0, relevance / torch.where(x != 0, x, 1), 0)
        ctx.record_fn(relevance - x * grad_x)
        return (None, None, grad_x, *(None for _ in grads))


def relevance_proxy(
    x: torch.Tensor,
    stand_ins: Sequence[torch.Tensor],
    relevance_fn: RelevanceFn,
    record_fn: RecordFn,
) -> tuple[torch.Tensor, ...]:
    """Stand-in tensors for ``x`` whose gradients become ``x``'s relevance.

    The returned tensors have the values of ``stand_ins`` and are connected to
    ``x``. In the backward pass, ``relevance_fn`` turns their gradients into the
    relevance ``R`` of ``x``; ``x`` receives the gradient ``R / x`` (zero where
    ``x`` is zero), and ``record_fn`` receives ``R - x * (R / x)``, the relevance
    that the gradient cannot carry. The LRP wrapper adds it back when ``x`` is
    one of its input keys.

    Args:
        x: the module input the relevance belongs to.
        stand_ins: tensors to compute the modified forward pass with.
        relevance_fn: maps the stand-ins' gradients to the relevance of ``x``.
        record_fn: receives the part of the relevance not carried by the gradient.

    Returns:
        One tensor per stand-in.

    Examples:
        >>> import torch
        >>> x = torch.tensor([0.0, 2.0], requires_grad=True)
        >>> left = []
        >>> (ones,) = relevance_proxy(x, [torch.ones(2)], lambda g: g[0], left.append)
        >>> grad = torch.autograd.grad((ones * torch.tensor([5.0, 4.0])).sum(), x)[0]
        >>> grad, left[0]
        (tensor([0., 2.]), tensor([5., 0.]))
    """
    outputs = _RelevanceProxy.apply(relevance_fn, record_fn, x, *stand_ins)
    return outputs if isinstance(outputs, tuple) else (outputs,)
