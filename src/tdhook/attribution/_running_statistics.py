"""torchrl's ``VecNorm`` inside an explained policy: its statistics move once, with the batch, and are held constant.

A ``VecNorm`` that is not frozen adds the batch it normalises to its running
sums in its forward, then normalises with the sums it just updated. Run on an
input that requires grad, its plain forward would make its running mean and
standard deviation functions of the batch: the relevance of one sample would
take a share of the others' (through the batch's part of the mean), and the
module's state would keep the graph of the call, growing from call to call.
Inside an LRP context, the statistics are updated from the detached input,
exactly as the plain call updates them, once; the output is then the
normalisation by those statistics held constant, as a BatchNorm in training
mode is explained with its batch statistics held constant: per sample, an
affine map whose shift is a bias.

Examples:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from torchrl.envs.transforms import VecNorm
    >>> norm = VecNorm(in_keys=["observation"], decay=0.9)
    >>> _ = norm(TensorDict(observation=torch.randn(8, 2), batch_size=[8]))
    >>> hooks = statistics_held_constant({"norm": norm})
    >>> x = torch.randn(4, 2, requires_grad=True)
    >>> y = norm(TensorDict(observation=x, batch_size=[4]))["observation"]
    >>> norm._td["observation_sum"].requires_grad  # updated from the detached input
    False
    >>> grad = torch.autograd.grad(y[0].sum(), x)[0]
    >>> bool(grad[1:].eq(0).all())  # one sample's output depends on that sample alone
    True
    >>> for hook in hooks:
    ...     hook.remove()
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn
from torch.utils.hooks import RemovableHandle
from torchrl.envs.transforms import VecNorm

from tdhook.attribution.rules._wrapper_calls import rules_act_here

__all__ = ["refuse_moving_statistics", "statistics_held_constant"]


def _tensordict(args: tuple, kwargs: dict) -> TensorDictBase | None:
    found = args[0] if args else kwargs.get("tensordict", kwargs.get("next_tensordict"))
    return found if isinstance(found, TensorDictBase) else None


def _normalised_by_held_statistics(norm: VecNorm, read: dict, batch_size: torch.Size) -> TensorDictBase:
    """``norm``'s own normalisation of the tensors ``read`` (by in_key), with its statistics as they are now, not
    moved: the frozen path of its forward."""
    frozen, lock = norm.frozen, norm.lock
    norm.frozen, norm.lock = True, None  # the lock was held and released by the call being completed
    try:
        return norm._call(TensorDict(read, batch_size=batch_size))
    finally:
        norm.frozen, norm.lock = frozen, lock


def statistics_held_constant(modules: Mapping[str, nn.Module], into: list | None = None) -> list[RemovableHandle]:
    """Make every ``VecNorm`` among ``modules`` that is not frozen update its statistics from the detached input
    and write its output with the gradient of a normalisation by those statistics held constant; the returned hook
    handles end it. With ``into``, each handle is appended to it as soon as its hook is registered (a registration
    that fails then leaves none unlisted), and ``into`` is returned."""
    hooks: list[RemovableHandle] = [] if into is None else into
    for module in modules.values():
        if not isinstance(module, VecNorm):
            continue
        reads: dict[int, dict] = {}

        def before(norm: VecNorm, args: tuple, kwargs: dict, reads: dict = reads) -> None:
            if norm.frozen or not rules_act_here():  # the model's own call, in an open context: as it is
                return
            td = _tensordict(args, kwargs)
            if td is None:
                return
            read = {}
            for key in norm.in_keys:
                value = td.get(key, None)
                if isinstance(value, torch.Tensor) and value.requires_grad:
                    read[key] = value
                    td.set(key, value.detach())  # the statistics move with the values only
            if read:
                reads[id(td)] = read

        def after(norm: VecNorm, args: tuple, kwargs: dict, output: Any, reads: dict = reads) -> None:
            td = _tensordict(args, kwargs)
            read = reads.pop(id(td), None) if td is not None else None
            if read is None or not isinstance(output, TensorDictBase):
                return
            normalised = _normalised_by_held_statistics(norm, read, output.batch_size)
            for key, out_key in zip(norm.in_keys, norm.out_keys, strict=True):
                if key not in read:
                    continue
                if out_key != key:
                    output.set(key, read[key])  # the input as it came, for the modules after this one
                output.set(out_key, normalised.get(out_key))

        hooks.append(module.register_forward_pre_hook(before, with_kwargs=True))
        hooks.append(module.register_forward_hook(after, with_kwargs=True, always_call=True))
    return hooks


def refuse_moving_statistics(who: str, modules: Mapping[str, nn.Module]) -> None:
    """Refuse a ``VecNorm`` that is not frozen among ``modules`` (the model's modules by name), for a method or a
    metric that runs the model on interpolated or perturbed copies of the batch: every pass would move its
    statistics again (fifty times for fifty steps of integrated gradients), each normalising by other statistics.

    Examples:
        >>> norm = VecNorm(in_keys=["observation"])
        >>> refuse_moving_statistics("Saliency", {"0": norm})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Saliency: module '0' (VecNorm) is not frozen: ...
        >>> refuse_moving_statistics("Saliency", {"0": norm.freeze()})
    """
    for name, module in modules.items():
        if isinstance(module, VecNorm) and not module.frozen:
            raise ValueError(
                f"{who}: module {name!r} (VecNorm) is not frozen: it moves its running statistics with every forward "
                f"pass, which the passes of {who} over copies of the batch would move again, each from the last; "
                "freeze it (norm.freeze(), or a norm.frozen_copy() in its place); LRP alone moves them once, as the "
                "plain call does, and holds them constant"
            )
