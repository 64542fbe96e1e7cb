"""The parameters' ``.grad`` kept through a call: a backward pass that accumulates into them is undone.

The wrappers take gradients with ``torch.autograd.grad``, which writes no ``.grad``. A model's own backward can
all the same: a custom ``torch.autograd.Function`` whose backward recomputes its forward and calls
``torch.autograd.backward`` (Hugging Face Reformer's reversible layers) accumulates into the ``.grad`` of every
parameter it reaches, so an explanation made between two training steps would add into the optimiser's
gradients. Around a call, the parameters' gradients are set aside (``.grad`` set to ``None``, no copy), and put
back when the call ends, however it ends: what the call's backward wrote is dropped, and each parameter gets back
the very tensor it had (or ``None``).

Setting aside and putting back cost a walk over the parameters. Inside an open context that walk runs on the first
call that completes; where that call's backward wrote no ``.grad``, the later calls of the context skip it. A
call outside a context (one that enters its own) is always kept. Another thread's backward into the same
parameters while a kept call runs accumulates into the set-aside state and is dropped with it.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> net = nn.Linear(2, 1)
    >>> net.weight.grad = torch.ones(1, 2)
    >>> with KeptGrads(net).kept(None):
    ...     net(torch.ones(3, 2)).sum().backward()  # what a model's own backward may do
    >>> net.weight.grad, net.bias.grad
    (tensor([[1., 1.]]), None)
"""

from __future__ import annotations

import contextlib
from types import TracebackType

import torch
from torch import nn

__all__ = ["KeptGrads"]

_NOTHING = contextlib.nullcontext()


class KeptGrads:
    """Per wrapper: keeps the parameters' ``.grad`` through its calls (see the module's docstring).

    ``context`` is an object standing for the open context (the LRP wrapper's rule handles), or ``None`` for a
    call that has none: the check made in a context's first completed call holds for its later calls.
    """

    __slots__ = ("_module", "_context", "_writes")

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self._context: object = None
        self._writes = True  # whether the context's backward writes a .grad (unknown: kept)

    def kept(self, context: object) -> contextlib.AbstractContextManager:
        """Keep the module's parameters' ``.grad`` in the block; nothing in a context whose first completed call
        wrote none.

        Examples:
            >>> net, handles = nn.Linear(2, 1), []
            >>> grads = KeptGrads(net)
            >>> with grads.kept(handles):  # the first call of a context checks
            ...     _ = torch.autograd.grad(net(torch.ones(1, 2)).sum(), net.weight)
            >>> type(grads.kept(handles)).__name__  # later calls of the context run as they are
            'nullcontext'
        """
        if context is not None and context is self._context and not self._writes:
            return _NOTHING
        return _SetAside(self, self._module, context)

    def __getstate__(self) -> dict:
        # A copy or a pickle of the wrapper has no open context: its first call checks again.
        return {"_module": self._module}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["_module"])

    def _settle(self, context: object, wrote: bool) -> None:
        if context is None:
            return
        if context is not self._context:
            self._context, self._writes = context, wrote
        else:
            self._writes = self._writes or wrote


class _SetAside:
    """The block runs with every leaf parameter's ``.grad`` set to ``None``; the ones it had are put back."""

    __slots__ = ("_owner", "_module", "_context", "_parameters", "_held")

    def __init__(self, owner: KeptGrads, module: nn.Module, context: object) -> None:
        self._owner, self._module, self._context = owner, module, context
        self._parameters: list[torch.Tensor] = []
        self._held: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __enter__(self) -> None:
        # A parameter that is no leaf (a view a torchrl loss module put in) gets no .grad from a backward pass.
        self._parameters = [p for p in self._module.parameters() if p.is_leaf]
        self._held = [(p, p.grad) for p in self._parameters if p.grad is not None]
        for p, _ in self._held:
            p.grad = None

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        written = [p for p in self._parameters if p.grad is not None]
        for p in written:
            p.grad = None
        for p, grad in self._held:
            p.grad = grad
        self._held = []
        if kind is None:
            self._owner._settle(self._context, bool(written))
