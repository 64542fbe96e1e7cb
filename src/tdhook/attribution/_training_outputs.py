"""The outputs of an explained call carry the plain model's gradient, as the plain call's outputs do.

An LRP call runs the model with its rules, whose gradient is not the model's; the outputs it writes were
therefore cut from that pass, and a caller that trains on them (an LRP-wrapped policy inside torchrl's
``ClipPPOLoss``, ``DQNLoss``, or a plain optimisation step) got no gradient for the model's parameters,
silently. Where the caller's grad mode is on and an input or a parameter of the model requires grad, the
outputs are written through :class:`_PlainGradient` instead: the same values, whose backward runs the model
again, without rules, on the inputs and parameters of the call and sends back the plain gradient (as
``torch.utils.checkpoint`` does). Nothing runs unless a backward pass reaches them, and relevance keys stay
detached.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> from tensordict import TensorDict
    >>> from tensordict.nn import TensorDictModule
    >>> from tdhook.attribution import LRP, EpsilonPlus
    >>> net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    >>> td = LRP(TensorDictModule(net, ["x"], ["y"]), EpsilonPlus())(TensorDict(x=torch.randn(5, 3), batch_size=[5]))
    >>> td["y"].square().sum().backward()
    >>> ours = [p.grad.clone() for p in net.parameters()]
    >>> net.zero_grad()
    >>> net(td["x"]).square().sum().backward()
    >>> all(torch.allclose(a, p.grad) for a, p in zip(ours, net.parameters()))
    True
    >>> td["relevance", "x"].requires_grad
    False
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.utils import NestedKey
from torch.func import functional_call

__all__ = ["with_plain_gradient"]


class _PlainGradient(torch.autograd.Function):
    """``values`` (the outputs of the explained call) as a function of ``tensors`` whose backward is that of
    ``recompute(tensors)``, the model run without rules."""

    @staticmethod
    def forward(ctx: Any, recompute: Callable, n_values: int, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.recompute, ctx.n_values = recompute, n_values
        values, tensors = args[:n_values], args[n_values:]
        ctx.values = tuple(v.detach() for v in values)
        ctx.save_for_backward(*tensors)
        return tuple(v.detach() for v in values)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        tensors = ctx.saved_tensors
        # The rerun leaves running statistics as the explained call left them (restored once its gradient is
        # taken: a batch norm's backward reads them).
        buffers = [(b, b.detach().clone()) for b in ctx.recompute.module.buffers()]
        with _buffers_put_back(buffers), torch.enable_grad():
            leaves = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
            outputs = ctx.recompute(leaves)
            pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if g is not None and o.requires_grad]
            wanted = [i for i, t in enumerate(leaves) if t.requires_grad]
            found = [None] * len(leaves)
            if pairs and wanted:
                got = torch.autograd.grad(
                    [o for o, _ in pairs], [leaves[i] for i in wanted], [g for _, g in pairs], allow_unused=True
                )
                for i, g in zip(wanted, got, strict=True):
                    found[i] = g
        return (None, None, *([None] * ctx.n_values), *found)


@contextlib.contextmanager
def _buffers_put_back(buffers: list[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)


def _rules_off(wrapper: Any) -> contextlib.AbstractContextManager:
    if getattr(wrapper, "_handles", None) is None:
        return contextlib.nullcontext()
    return wrapper.inactive()  # the backward pass runs inside an open context: its rules leave for the rerun


def with_plain_gradient(
    wrapper: Any, tensordict: TensorDictBase, updates: dict[NestedKey, Any]
) -> dict[NestedKey, Any]:
    """``updates`` (the outputs to write) with the floating-point ones carrying the plain model's gradient with
    respect to the inputs in ``tensordict`` and the parameters of ``wrapper.module`` (see the module's
    docstring), where the caller's grad mode is on and one of them requires grad; else ``updates`` as given.

    A backward pass through them runs the model again on the tensors of the call; outputs it finds with
    other values (a random module, an input changed in place since) raise a ``RuntimeError`` naming the key.
    """
    if not torch.is_grad_enabled() or getattr(wrapper, "create_graph", False):
        return updates  # create_graph keeps the outputs' own graph, which is the plain model's
    keys = [k for k in updates if isinstance(updates.get(k), torch.Tensor) and updates[k].is_floating_point()]
    if not keys:
        return updates
    module = wrapper.module
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]  # a loss module's, put in by to_module
    read = {key: tensordict.get(key, None) for key in module.in_keys}  # what the model reads, as it was
    read = {key: value for key, value in read.items() if value is not None}
    inputs = [(k, v) for k, v in read.items() if isinstance(v, torch.Tensor) and v.requires_grad]
    if not named and not inputs:
        return updates
    batch_size, device = tensordict.batch_size, tensordict.device

    def recompute(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        td = TensorDict(batch_size=batch_size, device=device)
        for key, value in read.items():
            td.set(key, value)
        for (key, _), leaf in zip(inputs, leaves[: len(inputs)], strict=True):
            td.set(key, leaf)
        params = {n: leaf for (n, _), leaf in zip(named, leaves[len(inputs) :], strict=True)}
        with _rules_off(wrapper):
            result = functional_call(module, params, (td,), strict=False)
        result = td if result is None else result
        outputs = [result.get(k) for k in keys]
        for key, out, value in zip(keys, outputs, values, strict=True):
            if out.shape != value.shape or not torch.allclose(out, value, rtol=1e-5, atol=1e-6, equal_nan=True):
                raise RuntimeError(
                    f"{type(wrapper).__name__}: the backward pass through the output {key!r} runs the model again "
                    "for its gradient, and got other values than the explained call (a random module, or an input "
                    "or parameter changed in place since the call); compute the training loss from a plain call of "
                    "the model"
                )
        return outputs

    recompute.module = module
    values = [updates[k] for k in keys]
    tensors = [v for _, v in inputs] + [p for _, p in named]
    attached = _PlainGradient.apply(recompute, len(values), *values, *tensors)
    return {**updates, **dict(zip(keys, attached, strict=True))}
