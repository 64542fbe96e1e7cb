"""Guided backpropagation: the input gradient with only positive gradients passed back through each ReLU."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tdhook.attribution._scripted_modules import refuse_unreachable_relus
from tdhook.attribution.methods._base import AttributionMethod, Call

__all__ = ["GuidedBackprop"]


class _PositiveGradient(torch.autograd.Function):
    """The identity forward; backward passes the positive part of the incoming gradient.

    The forward returns a copy, not a view: a model may change a ReLU's output in place (``x += 1``, after
    ``ReLU(inplace=True)`` too), which autograd forbids on a view made inside a custom Function. It runs under
    ``torch.vmap`` too (the agents of torchrl's multi-agent networks), with the rule vmap derives from it.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:  # noqa: D102
        pass

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return grad.clamp(min=0)


# The ReLU calls of torch, out of place and in place: ``nn.ReLU`` calls ``F.relu``, which a model may call itself, as it
# may ``torch.relu``, ``Tensor.relu`` and their in-place forms (``F.relu(x, inplace=True)``, ``x.relu_()``).
_RELUS = {F.relu, torch.relu, torch.Tensor.relu}
_RELUS_IN_PLACE = {torch.relu_, torch.Tensor.relu_}


def _requires_grad(x: torch.Tensor) -> bool:
    """Whether ``x`` is recorded by autograd, under ``torch.vmap`` too: a tensor batched by vmap (torchrl's
    ``MultiAgentMLP`` and ``MultiAgentConvNet`` with ``share_params=False`` run their agents so) reports no gradient
    of its own; the tensor it wraps does."""
    while torch._C._functorch.is_batchedtensor(x):
        x = torch._C._functorch.get_unwrapped(x)
    return x.requires_grad


class _GuidedReLUs(TorchFunctionMode):
    """Every ReLU call of the forward passes, module or function, returns its output through
    :class:`_PositiveGradient`; an in-place call writes that output into its input, whose later readers then pass
    back through it. Calls without gradient run as they are."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        in_place = func in _RELUS_IN_PLACE or (func is F.relu and bool(kwargs.get("inplace", args[1:2] == (True,))))
        if func not in _RELUS and not in_place:
            return func(*args, **kwargs)
        x = args[0] if args else kwargs.get("input")
        if not (torch.is_grad_enabled() and isinstance(x, torch.Tensor) and _requires_grad(x)):
            return func(*args, **kwargs)
        guided = _PositiveGradient.apply(torch.relu(x))
        return x.copy_(guided) if in_place else guided


class GuidedBackprop(AttributionMethod):
    """The gradient of the explained output, with every ReLU passing back only positive gradients.

    During the call every ReLU of the model's forward passes, an ``nn.ReLU``
    module or a call of ``F.relu``, ``torch.relu``, ``Tensor.relu`` or their
    in-place forms (a ``TorchFunctionMode`` sees them all), gives an output
    that passes back the positive part of its gradient, so the ReLU's gradient
    becomes ``max(g, 0) * 1[x > 0]``; the mode ends with the call, by error or
    not. A model that runs its ReLUs as TorchScript or ATen operators
    (``torch.jit``, ``torch.export``), which the mode does not see, is refused
    by name. Takes the arguments of
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
        with _GuidedReLUs():
            yield

    def _attribute(self, call: Call) -> list[torch.Tensor]:
        return self._input_gradients(call)
