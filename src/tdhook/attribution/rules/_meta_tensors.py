"""A module's call that computed from a parameter or buffer on the ``meta`` device.

torch computes ``F.linear`` of an input on the CPU with a weight on the meta
device and a bias on the CPU, and returns a tensor of whatever the memory held:
no error, and the relevance of those values. A module that holds such a tensor
is not refused before its call, since a network may swap the real tensors in for
the call (torchrl's multi-agent networks call their template network so): the
call that returns an output off the meta device is refused.

LRP checks each ruled module's call in its rule's forward hook, and, where a
layer holds such a tensor when its context opens, the layer's calls in a hook
of :func:`meta_tensor_hooks` (a layer whose rule registers no hook, such as the
plain gradient's in the transformer presets, or one a later call runs without
its hooks); the other
methods and the metrics, which register no rules, run the model under
:func:`meta_tensors_refused`, which watches the torch functions only where the
model holds such a tensor when the call starts (none, on the common path).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

__all__ = ["holds_meta_tensors", "meta_tensor_hooks", "meta_tensors_refused", "raise_for_meta_tensors"]


def raise_for_meta_tensors(module: nn.Module, output: torch.Tensor) -> None:
    """Raise a ``ValueError`` (``error.module`` is ``module``) where ``module`` holds a parameter or buffer on the
    meta device and its ``output`` is not there.

    Examples:
        >>> layer = nn.Linear(2, 1)
        >>> layer.weight = nn.Parameter(torch.empty(1, 2, device="meta"))
        >>> raise_for_meta_tensors(layer, layer(torch.ones(1, 2)))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Linear holds its parameter 'weight' on the meta device, ... output on cpu from it
    """
    if output.is_meta:
        return
    for kind, tensors in (("parameter", module._parameters), ("buffer", module._buffers)):
        for name, tensor in tensors.items():
            if tensor is not None and tensor.is_meta:
                error = ValueError(
                    f"{type(module).__name__} holds its {kind} {name!r} on the meta device, which holds no values, "
                    f"and computed an output on {output.device} from it"
                )
                error.module = module  # type: ignore[attr-defined]
                raise error


@contextlib.contextmanager
def meta_tensors_refused(model: nn.Module) -> Iterator[None]:
    """Within the block, a torch function that computes from a parameter or buffer of ``model`` on the meta device
    (held there when the block is entered) and returns a tensor off it raises as :func:`raise_for_meta_tensors`
    does, naming the module that holds it.

    A model that holds no such tensor (the common path) runs as it is; a tensor held but not computed with (a
    template network whose tensors are swapped in for the call) is no error.

    Examples:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
        >>> net[2].weight = nn.Parameter(torch.empty(1, 2, device="meta"))
        >>> with meta_tensors_refused(net):  # doctest: +ELLIPSIS
        ...     net(torch.ones(1, 2))
        Traceback (most recent call last):
        ...
        ValueError: Linear holds its parameter 'weight' on the meta device, ... output on cpu from it
    """
    owners = {}
    for module in model.modules():  # a plain loop: the common path pays one pass over the tensors
        for tensor in module._parameters.values():
            if tensor is not None and tensor.is_meta:
                owners[id(tensor)] = module
        for tensor in module._buffers.values():
            if tensor is not None and tensor.is_meta:
                owners[id(tensor)] = module
    if not owners:
        yield
        return
    with _MetaRefusal(owners):
        yield


def meta_tensor_hooks(modules: Mapping[str, nn.Module], into: list | None = None) -> list[RemovableHandle]:
    """A forward hook refusing, as :func:`raise_for_meta_tensors` does, a call that computes an output off the meta
    device, on each module of ``modules`` without children that holds a parameter or buffer there (none, on the
    common path); the handles remove them. With ``into``, each handle is appended to it as soon as its hook is
    registered (a registration that fails then leaves none unlisted), and ``into`` is returned.

    Examples:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        >>> net[1].weight = nn.Parameter(torch.empty(1, 2, device="meta"))
        >>> hooks = meta_tensor_hooks(dict(net.named_modules()))
        >>> len(hooks), len(net[1]._forward_hooks)
        (1, 1)
        >>> for hook in hooks:
        ...     hook.remove()
    """
    handles = [] if into is None else into
    for module in modules.values():
        if not module._modules and holds_meta_tensors(module):
            handles.append(module.register_forward_hook(_refuse_meta))
    return handles


def holds_meta_tensors(module: nn.Module) -> bool:
    """Whether ``module`` itself (not its children) holds a parameter or buffer on the meta device.

    Examples:
        >>> holds_meta_tensors(nn.Linear(2, 1)), holds_meta_tensors(nn.Linear(2, 1, device="meta"))
        (False, True)
    """
    for tensors in (module._parameters, module._buffers):
        for tensor in tensors.values():
            if tensor is not None and tensor.is_meta:
                return True
    return False


class _MetaRefusal(TorchFunctionMode):
    """Refuses a torch function computing an output off the meta device from one of ``owners``' tensors there
    (``id(tensor) -> the module holding it``)."""

    def __init__(self, owners: dict[int, nn.Module]) -> None:
        super().__init__()
        self.owners = owners

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        held = [self.owners[id(leaf)] for leaf in tree_leaves((args, kwargs)) if id(leaf) in self.owners]
        if held:
            first = next((leaf for leaf in tree_leaves(out) if isinstance(leaf, torch.Tensor)), None)
            if first is not None:
                raise_for_meta_tensors(held[0], first)
        return out


def _refuse_meta(module: nn.Module, args: tuple, output: Any) -> None:
    """A forward hook: :func:`raise_for_meta_tensors` on the first tensor of ``output``."""
    first = next((leaf for leaf in tree_leaves(output) if isinstance(leaf, torch.Tensor)), None)
    if first is not None:
        raise_for_meta_tensors(module, first)
