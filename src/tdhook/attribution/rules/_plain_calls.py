"""A block in which modules run as they are, without the rules registered on them (this thread only)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["PLAIN_DEPTH", "plain_calls", "run_alone"]

# The depth of plain_calls blocks in this thread (its ``depth``, read where a call's cost counts: rules_apply).
PLAIN_DEPTH = threading.local()


@contextmanager
def plain_calls() -> Iterator[None]:
    """Run modules as they are, without their rules, inside the ``with`` block (this thread only).

    A rule that evaluates the module it is registered on at another point (the
    Taylor rule at its reference point) needs the plain function and its plain
    Jacobian, not the rules of the modules inside it; so do the probes of a
    layer's own forward (:mod:`~tdhook.attribution.rules._layers`), which may
    run inside a call, when a rule prepares there.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from tdhook.attribution.rules import PassRule
        >>> tanh, x = nn.Tanh(), torch.tensor([0.5], requires_grad=True)
        >>> with PassRule().register(tanh), plain_calls():
        ...     torch.autograd.grad(tanh(x), x)[0] == 1 - torch.tanh(x) ** 2
        tensor([True])
    """
    PLAIN_DEPTH.depth = getattr(PLAIN_DEPTH, "depth", 0) + 1
    try:
        yield
    finally:
        PLAIN_DEPTH.depth -= 1


@contextmanager
def run_alone() -> Iterator[None]:
    """Run a module's forward as it is, inside the ``with`` block: in :func:`plain_calls`, and without the torch
    function modes active around the block (taken off the stack, put back after it).

    The probes of a layer's own forward (:mod:`~tdhook.attribution.rules._layers`) compare its plain gradients. A
    rule prepared in a call (the first-layer rules) probes there, where the rules of the modules inside the layer
    and the call's function modes act: the BatchNorm inside QAT's ``ConvBn2d`` ran its own rule in the probes, whose
    stabilised gradient differed at ``2x`` from ``x`` (by up to 2e-3 at inputs of 1e-3), and the layer was refused.

    Examples:
        >>> import torch
        >>> from torch.overrides import TorchFunctionMode
        >>> with TorchFunctionMode(), run_alone():
        ...     len(torch.overrides._get_current_function_mode_stack()), PLAIN_DEPTH.depth
        (0, 1)
    """
    modes = []
    try:
        while torch._C._len_torch_function_stack() > 0:
            modes.append(torch._C._pop_torch_function_stack())
        with plain_calls():
            yield
    finally:
        for mode in reversed(modes):
            torch._C._push_on_torch_function_stack(mode)
