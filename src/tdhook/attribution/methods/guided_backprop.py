"""Guided backpropagation: the input gradient with only positive gradients passed back through each ReLU module."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from tdhook.attribution._scripted_modules import refuse_unreachable_relus
from tdhook.attribution.methods._base import AttributionMethod, Call, hooks_removed

__all__ = ["GuidedBackprop"]


class _PositiveGradient(torch.autograd.Function):
    """The identity forward; backward passes the positive part of the incoming gradient.

    The forward returns a copy, not a view: a model may change a ReLU's output in place (``x += 1``, after
    ``ReLU(inplace=True)`` too), which autograd forbids on a view made inside a custom Function.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return grad.clamp(min=0)


def _guide(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return _PositiveGradient.apply(output)


class GuidedBackprop(AttributionMethod):
    """The gradient of the explained output, with every ``nn.ReLU`` module passing back only positive gradients.

    During the call each ``nn.ReLU`` module of the model gets a forward hook
    whose output passes back the positive part of its gradient, so the ReLU's
    gradient becomes ``max(g, 0) * 1[x > 0]``; the hooks are removed when the
    call ends, by error or not. ReLUs called as functions keep their plain
    gradient; a model that runs its ReLUs as TorchScript or ATen operators
    (``torch.jit``, ``torch.export``), where no hook reaches, is refused by
    name. Takes the arguments of
    :class:`~tdhook.attribution.methods._base.AttributionMethod`.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tdhook.attribution import GuidedBackprop
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(2, 2, bias=False), nn.ReLU(), nn.Linear(2, 1, bias=False))
        >>> with torch.no_grad():
        ...     _ = net[0].weight.copy_(torch.eye(2))
        ...     _ = net[2].weight.copy_(torch.tensor([[1.0, -1.0]]))
        >>> td = GuidedBackprop(net, in_keys=["x"], out_keys=["v"])(TensorDict(x=torch.ones(2), batch_size=[]))
        >>> td["attribution", "x"]  # the plain gradient is [1, -1]
        tensor([1., 0.])
    """

    _gradient_at_input = True
    _evaluates_copies = False

    @contextlib.contextmanager
    def _model_context(self) -> Iterator[None]:
        refuse_unreachable_relus(self.named_explained_modules(), "GuidedBackprop")
        with hooks_removed([]) as handles:
            for sub in self.module.modules():
                if isinstance(sub, nn.ReLU):
                    handles.append(sub.register_forward_hook(_guide))
            yield

    def _attribute(self, call: Call) -> list[torch.Tensor]:
        return self._input_gradients(call)
