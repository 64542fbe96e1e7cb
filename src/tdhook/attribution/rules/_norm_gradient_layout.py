"""The gradient that reaches a BatchNorm's or InstanceNorm's own backward, laid out in memory as the norm's output is.

PyTorch's CPU kernel for the backward of ``batch_norm`` (which ``instance_norm`` calls) reads the incoming gradient
in the wrong order when the input and that gradient are laid out differently and a spatial size of 1 makes the
layout ambiguous: a ``[N, C, H, 1]`` output followed by a transpose or a permute gets an input gradient about 1.3
off (relative L2), with no error. :func:`lay_out_gradient` puts a hook on such an output that copies the gradient
into the output's own strides (only where they differ) before the norm's backward reads it. The rules that leave a
norm's own backward to run (an unmerged BatchNorm, an InstanceNorm with running statistics) and the gradient
methods call it.

Examples:
    >>> import torch
    >>> bn = torch.nn.BatchNorm2d(3).eval()
    >>> x = torch.randn(4, 3, 5, 1, requires_grad=True)
    >>> y = bn(x)
    >>> lay_out_gradient(y)
    >>> grad = torch.randn(4, 5, 1, 3).permute(0, 3, 1, 2)  # laid out channels-last, unlike y
    >>> (gx,) = torch.autograd.grad(y, x, grad)
    >>> scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    >>> torch.allclose(gx, grad * scale.view(1, 3, 1, 1))
    True
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = [
    "BATCH_NORM_KERNEL_NODES",
    "BATCH_NORM_KERNEL_USERS",
    "LAID_OUT",
    "NO_NORM_KERNEL_BELOW",
    "lay_out_gradient",
    "laid_out_as",
    "norm_gradient_hooks",
    "output_gradient_laid_out",
]

# The modules whose forward calls the batch_norm kernel: BatchNorm1d/2d/3d, SyncBatchNorm and the lazy ones,
# InstanceNorm1d/2d/3d, and their subclasses.
BATCH_NORM_KERNEL_USERS = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)

# The autograd nodes whose backward is that kernel's (``batch_norm``, ``instance_norm`` and their ATen forms make one
# of these; ``instance_norm`` makes it behind a view of its output), by type: a walk tests every node of a graph.
BATCH_NORM_KERNEL_NODES = frozenset(
    getattr(torch._C._functions, name)
    for name in (
        "NativeBatchNormBackward0",
        "NativeBatchNormLegitBackward0",
        "NativeBatchNormLegitBackward1",
        "NativeBatchNormLegitNoTrainingBackward0",
        "BatchNormWithUpdateBackward0",
        "BatchNormNoUpdateBackward0",
    )
    if hasattr(torch._C._functions, name)
)
_VIEW_NODE = getattr(torch._C._functions, "ViewBackward0", None)

# The key of a node's ``metadata`` marking a norm's node whose incoming gradient is laid out already.
LAID_OUT = "tdhook.norm_gradient_laid_out"
# The key of a node's ``metadata`` marking an output's node with no node of the batch_norm kernel behind it (a planned
# call whose graph has the recorded shape, which holds none): a walk for such nodes need not start there.
NO_NORM_KERNEL_BELOW = "tdhook.no_norm_kernel_below"


def laid_out_as(size: torch.Size, strides: tuple[int, ...]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A gradient hook copying a gradient of ``size`` into ``strides`` where it is laid out otherwise.

    Examples:
        >>> grad = torch.ones(2, 3).t()
        >>> laid_out_as(torch.Size([3, 2]), (2, 1))(grad).stride()
        (2, 1)
    """

    def hook(grad: torch.Tensor | None) -> torch.Tensor | None:
        # None: no gradient reaches the norm (a branch that computes a gate held in a product, see rules.gates).
        if grad is None or grad.stride() == strides or grad.shape != size:
            return grad
        return torch.empty_strided(size, strides, dtype=grad.dtype, device=grad.device).copy_(grad)

    return hook


def lay_out_gradient(output: torch.Tensor) -> None:
    """Copy the gradient that reaches ``output`` (a norm's output, whose own backward will read it) into
    ``output``'s strides, where it is laid out otherwise (see the module docstring).

    Examples:
        >>> y = torch.ones(2, 3, requires_grad=True) * 2
        >>> lay_out_gradient(y)
        >>> len(y._backward_hooks)
        1
    """
    if output.requires_grad:
        # The size and strides only: a hook holding the output would hold it, and the graph, from the graph itself.
        output.register_hook(laid_out_as(output.shape, output.stride()))
        node = output.grad_fn
        if node is not None:  # marked, for the walk that finds the norms no hook lays out (inline: once per norm call)
            node.metadata[LAID_OUT] = True
            if type(node) is _VIEW_NODE and node.next_functions:  # instance_norm's output
                inner = node.next_functions[0][0]
                if type(inner) in BATCH_NORM_KERNEL_NODES:
                    inner.metadata[LAID_OUT] = True


def output_gradient_laid_out(module: nn.Module, args: Any, output: Any) -> None:
    """A forward hook: :func:`lay_out_gradient` on the module's output, where it is a tensor.

    Examples:
        >>> bn = torch.nn.BatchNorm1d(2)
        >>> handle = bn.register_forward_hook(output_gradient_laid_out)
        >>> bn(torch.ones(3, 2, requires_grad=True)).shape
        torch.Size([3, 2])
        >>> handle.remove()
    """
    if isinstance(output, torch.Tensor):
        lay_out_gradient(output)


def norm_gradient_hooks(
    modules: Iterable[nn.Module], skip: Collection[int] = (), handles: list[RemovableHandle] | None = None
) -> list[RemovableHandle]:
    """Put :func:`output_gradient_laid_out` on each BatchNorm and InstanceNorm among ``modules`` but those whose ids
    are in ``skip`` (once per module, and first among its forward hooks: it sees the output the norm's own forward
    computed, before a rule replaces it); TorchScript modules, which take no hooks, are left as they are. Each
    handle goes into ``handles`` (a new list by default) as it is made, so that an interrupt leaves none unlisted.

    Examples:
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 1), torch.nn.BatchNorm2d(2))
        >>> handles = norm_gradient_hooks(net.modules())
        >>> len(handles), len(net[1]._forward_hooks)
        (1, 1)
        >>> for handle in handles:
        ...     handle.remove()
        >>> norm_gradient_hooks(net.modules(), skip={id(net[1])})
        []
    """
    handles = [] if handles is None else handles
    hooked: set[int] = set()
    for module in modules:
        if isinstance(module, BATCH_NORM_KERNEL_USERS) and id(module) not in skip and id(module) not in hooked:
            hooked.add(id(module))
            if not isinstance(module, torch.jit.ScriptModule):
                handles.append(module.register_forward_hook(output_gradient_laid_out, prepend=True))
    return handles
