"""The gradient reaching ``batch_norm`` or ``instance_norm`` called as a function, laid out as the call's output.

PyTorch's CPU backward of ``batch_norm`` (which ``instance_norm`` calls) misreads an incoming gradient laid out
unlike the norm's output where a spatial size of 1 makes the layout ambiguous (see
:mod:`~tdhook.attribution.rules._norm_gradient_layout`). The hooks on BatchNorm and InstanceNorm modules lay out
the gradient reaching a module's output; a model that calls ``F.batch_norm``, ``F.instance_norm``,
``torch.batch_norm``, ``torch.instance_norm`` or their ATen operators itself (a functional model, a norm of its own,
a subclass with a forward of its own) got an input gradient 1.0 to 1.6 off (relative L2), with no warning.

:class:`NormFunctionLayouts` is a ``TorchFunctionMode`` that lays out the gradient reaching each such call's output.
A mode costs a Python call per torch call of the forward, so a wrapper runs it on its first call only, which finds
whether the model makes such calls outside the modules the hooks cover (:attr:`NormFunctionCalls.found`), and on
later calls only where it does: a model without such calls runs as before. Such a call can appear after the first
call (a branch taken for some inputs only, a flag set on a module): where the first call found none, a later call
walks the graph behind the outputs its backward starts from, and :func:`late_norm_nodes_laid_out` lays out the
gradient reaching each node of the kernel that no hook lays out (before, such a call was up to 1.2 off, relative L2).

Examples:
    >>> import torch.nn.functional as F
    >>> x = torch.randn(4, 3, 5, 1, dtype=torch.float64, requires_grad=True)
    >>> stats = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    >>> calls = NormFunctionCalls()
    >>> with NormFunctionLayouts(calls):
    ...     y = F.batch_norm(x, *stats, eps=0.0)  # eval mode, zero mean and unit variance: the identity
    >>> calls.found
    True
    >>> grad = torch.randn(4, 5, 1, 3, dtype=torch.float64).permute(0, 3, 1, 2)  # channels last, unlike y
    >>> torch.allclose(torch.autograd.grad(y, x, grad)[0], grad)
    True
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from tdhook.attribution.rules._norm_gradient_layout import (
    BATCH_NORM_KERNEL_NODES,
    BATCH_NORM_KERNEL_USERS,
    LAID_OUT,
    NO_NORM_KERNEL_BELOW,
    laid_out_as,
    lay_out_gradient,
)

__all__ = [
    "NORM_KERNEL_FUNCTIONS",
    "NormFunctionCalls",
    "NormFunctionLayouts",
    "late_norm_nodes_laid_out",
    "norm_call_laid_out",
]

_ATEN_NORMS = (
    "batch_norm",
    "instance_norm",
    "native_batch_norm",
    "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training",
    "_batch_norm_impl_index",
    "_batch_norm_with_update",
    "_batch_norm_no_update",
)


def _aten_forms() -> set[Any]:
    """The ATen operators of ``_ATEN_NORMS``: each packet and its overloads (a mode is handed either)."""
    forms: set[Any] = set()
    for name in _ATEN_NORMS:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            forms |= {packet, *(getattr(packet, overload) for overload in packet.overloads())}
    return forms


# The functions that run PyTorch's batch_norm kernel, whose CPU backward misreads a gradient laid out otherwise.
NORM_KERNEL_FUNCTIONS = frozenset(
    {F.batch_norm, F.instance_norm, torch.batch_norm, torch.instance_norm, torch.native_batch_norm}
    | {getattr(torch, name) for name in _ATEN_NORMS[3:6] if hasattr(torch, name)}
    | _aten_forms()
)

_CALL = nn.Module._call_impl.__code__
_FRAMES = 64  # Python frames walked up at most, to the innermost module call


def _in_torch_norm_module() -> bool:
    """Whether the call in progress runs in the forward of a BatchNorm or InstanceNorm whose forward is torch's own
    (the innermost module call on the Python stack), and that has forward hooks: its output is the call's, and the
    module hooks lay it out. A norm that is no module of the model (held in a list, or kept out of its state dict)
    has none of them."""
    frame = sys._getframe(1)
    for _ in range(_FRAMES):
        if frame is None:
            return False
        if frame.f_code is _CALL:
            module = frame.f_locals.get("self")
            return (
                isinstance(module, BATCH_NORM_KERNEL_USERS)
                and type(module).forward.__module__.startswith("torch.nn.")
                and bool(module._forward_hooks)
            )
        frame = frame.f_back
    return False


def norm_call_laid_out(result: Any) -> bool:
    """Lay out the gradient reaching the output of a call of :data:`NORM_KERNEL_FUNCTIONS` (a tensor, or the first
    of the tensors it returns) as that output; whether the call is one the module hooks do not cover.

    Examples:
        >>> y = torch.ones(2, 3, 4, requires_grad=True) * 2
        >>> norm_call_laid_out((y, torch.ones(3))), len(y._backward_hooks)
        (True, 1)
    """
    output = result[0] if isinstance(result, (tuple, list)) and result else result
    if not isinstance(output, torch.Tensor) or not output.requires_grad:
        return False
    lay_out_gradient(output)
    return not _in_torch_norm_module()


class NormFunctionCalls:
    """What a wrapper knows of its model's calls of :data:`NORM_KERNEL_FUNCTIONS`: ``found`` is ``None`` before a
    first call has run to its end, then whether it made one that the module hooks do not cover.

    Examples:
        >>> NormFunctionCalls().found is None
        True
    """

    def __init__(self) -> None:
        self.found: bool | None = None
        self._modules: tuple = ()

    def follow(self, modules: list[nn.Module]) -> None:
        """Forget what was found where the model's ``modules`` are not those of the call that found it (a norm
        replaced by one that calls ``F.batch_norm`` itself): the next call finds it again.

        Examples:
            >>> calls, norm = NormFunctionCalls(), nn.BatchNorm2d(3)
            >>> calls.follow([norm])
            >>> calls.found = False
            >>> calls.follow([norm]), calls.found
            (None, False)
            >>> calls.follow([nn.BatchNorm2d(3)]), calls.found
            (None, None)
        """
        seen = tuple((id(module), type(module)) for module in modules)
        if seen != self._modules:
            self.found, self._modules = None, seen


class NormFunctionLayouts(TorchFunctionMode):
    """Lay out the gradient reaching every call of :data:`NORM_KERNEL_FUNCTIONS` as the call's output; on leaving
    without an error, tell ``calls`` whether one was outside the modules the hooks cover (where it did not know).

    Examples:
        >>> calls = NormFunctionCalls()
        >>> with NormFunctionLayouts(calls):
        ...     _ = torch.randn(2, 3, requires_grad=True) * 2
        >>> calls.found
        False
    """

    def __init__(self, calls: NormFunctionCalls) -> None:
        super().__init__()
        self.calls = calls
        self.found = False

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: D105
        result = func(*args, **(kwargs or {}))
        if func in NORM_KERNEL_FUNCTIONS and norm_call_laid_out(result):
            self.found = True
        return result

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        super().__exit__(exc_type, exc_value, traceback)
        if exc_type is None and self.calls.found is None:
            self.calls.found = self.found


def late_norm_nodes_laid_out(*outputs: torch.Tensor) -> int:
    """Lay out the gradient reaching every node of the ``batch_norm`` kernel behind ``outputs`` (see
    :data:`~tdhook.attribution.rules._norm_gradient_layout.BATCH_NORM_KERNEL_NODES`) that no hook lays out: a norm
    called as a function that the first call did not make. A pre-hook on the node copies the gradient into the
    layout of the norm's input, which its backward reads right (as it reads one laid out as its output). The number
    of nodes hooked.

    The walk makes no Python call but for such a node: it runs on every call of a wrapper whose first call found none.

    Examples:
        >>> import torch.nn.functional as F
        >>> x = torch.randn(4, 3, 5, 1, dtype=torch.float64, requires_grad=True)
        >>> stats = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
        >>> y = F.batch_norm(x, *stats, eps=0.0)  # eval mode, zero mean and unit variance: the identity
        >>> late_norm_nodes_laid_out(y), late_norm_nodes_laid_out(y)  # hooked once
        (1, 0)
        >>> grad = torch.randn(4, 5, 1, 3, dtype=torch.float64).permute(0, 3, 1, 2)  # channels last, unlike y
        >>> torch.allclose(torch.autograd.grad(y, x, grad)[0], grad)
        True
    """
    seen: dict = {}
    nodes: list = []
    for output in outputs:
        node = output.grad_fn
        # A planned call's output whose graph has the recorded shape, which holds no such node, is not walked.
        if node is not None and node not in seen and NO_NORM_KERNEL_BELOW not in node.metadata:
            seen[node] = None
            nodes += (node,)
    hooked = 0
    for node in nodes:  # grows while it is read
        if type(node) in BATCH_NORM_KERNEL_NODES and LAID_OUT not in node.metadata:
            hooked += _input_layout_hooked(node)
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen[child] = None
                nodes += (child,)
    return hooked


def _input_layout_hooked(node: Any) -> int:
    """Put on a ``batch_norm`` node a pre-hook copying its incoming gradient into its input's layout, and mark it;
    1, or 0 where its input cannot be read (changed in place since: its backward raises as it would have)."""
    try:
        saved = node._saved_input
    except RuntimeError:
        return 0
    # The strides of a tensor laid out as the input (its own where dense, else contiguous): no memory taken.
    lay_out = laid_out_as(saved.shape, torch.empty_like(saved, device="meta").stride())
    node.register_prehook(lambda grads: None if grads[0] is None else (lay_out(grads[0]), *grads[1:]))
    node.metadata[LAID_OUT] = True
    return 1
