"""The gradient that reaches a BatchNorm or InstanceNorm, laid out in memory as the norm's output is.

PyTorch's CPU kernel for the backward of ``batch_norm`` (which ``instance_norm``
calls) reads the incoming gradient in the wrong order when the input and that
gradient are laid out differently and a spatial size of 1 makes the layout
ambiguous: a ``[N, C, H, 1]`` output followed by a transpose or a permute gets
an input gradient about 1.3 off (relative L2), in eval and in training mode
alike, with no error. The methods that differentiate the model would pass it on
to their attributions. While :func:`norm_gradients_laid_out` is active, the
gradient of every such module's output is copied into the output's own strides
before the module's backward reads it (only where the strides differ); the
hooks are gone on the way out. Given a wrapper's :class:`NormFunctionCalls`, the gradient reaching
``F.batch_norm``, ``F.instance_norm`` and the like called as functions is laid out as well: on the first call, which
finds whether the model makes such calls outside the modules hooked, and on later calls where it does; where it
found none, a later call lays out the gradient reaching such a call that the first did not make (a branch, a flag)
before its backward (see :mod:`~tdhook.attribution.rules._norm_function_layout`).

Examples:
    >>> import torch
    >>> bn = torch.nn.BatchNorm2d(3).eval()
    >>> x = torch.randn(4, 3, 5, 1, requires_grad=True)
    >>> with norm_gradients_laid_out(bn):
    ...     y = bn(x)
    >>> grad = torch.randn(4, 5, 1, 3).permute(0, 3, 1, 2)  # laid out channels-last, unlike y
    >>> (gx,) = torch.autograd.grad(y, x, grad)
    >>> scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    >>> torch.allclose(gx, grad * scale.view(1, 3, 1, 1))
    True
    >>> len(bn._forward_hooks)
    0
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from tdhook.attribution.rules._norm_function_layout import NormFunctionCalls, NormFunctionLayouts
from tdhook.attribution.rules._norm_gradient_layout import norm_gradient_hooks

__all__ = ["norm_gradients_laid_out"]


@contextlib.contextmanager
def norm_gradients_laid_out(model: nn.Module, calls: NormFunctionCalls | None = None) -> Iterator[None]:
    """Within the block, the gradient reaching every BatchNorm and InstanceNorm of ``model`` is laid out as its output.

    Args:
        model: the model whose modules are hooked (itself included); TorchScript modules, which take no hooks, are
            left as they are.
        calls: what the wrapper knows of the model's norms called as functions: where it does not know yet, or knows
            of some, the block runs in a :class:`NormFunctionLayouts` mode that lays out their gradient too.

    Examples:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 1), torch.nn.BatchNorm2d(2))
        >>> with norm_gradients_laid_out(net):
        ...     len(net[1]._forward_hooks)
        1
        >>> len(net[1]._forward_hooks)
        0
    """
    handles = []
    try:
        modules = list(model.modules())
        if calls is not None:  # what the first call found holds for the same modules only
            calls.follow(modules)
        norm_gradient_hooks(modules, handles=handles)  # listed as made: an interrupt leaves none
        if calls is None or calls.found is False:
            yield
        else:
            with NormFunctionLayouts(calls):
                yield
    finally:
        for handle in handles:
            handle.remove()
