"""The parameters and buffers in a model's modules, put back where a call fails after something swapped them.

A model may swap its own parameters in its forward: a custom ensemble that runs one network under ``torch.vmap`` with
each member's parameters put in by tensordict's ``to_module``. A rule refuses the vmapped call from inside (no rule
sees a call there), and tensordict's ``to_module`` does not put the module's own parameters back when its block
raises: the module is left with the transform's batched tensors in its parameter slots (or in its ``__dict__``, with
``preserve_module_state=False``), and its own parameters lost. A call takes :class:`ParameterSlots` as it starts (a
copy of each module's ``_parameters`` and ``_buffers`` dicts: references only) and, where it fails, puts back every
entry that changed and removes the tensors left in a module's ``__dict__`` under those names; a caller's own
``to_module`` around the call (inside an open context or not) was in place when the call started, and stays.

Examples:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(3, 2))
    >>> weight = net[0].weight
    >>> slots = ParameterSlots(list(net.modules()))
    >>> swap = TensorDict.from_module(net).apply(torch.zeros_like).to_module(net)  # left in place, as a raise does
    >>> net[0].weight is weight
    False
    >>> slots.restore()
    >>> net[0].weight is weight, sorted(net[0]._parameters)
    (True, ['bias', 'weight'])
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Iterable, Sequence

import torch
from torch import nn

__all__ = ["ParameterSlots", "TransformedSlots"]

_PARAMETERS, _BUFFERS = operator.attrgetter("_parameters"), operator.attrgetter("_buffers")
_MISSING = object()


class ParameterSlots:
    """The ``_parameters`` and ``_buffers`` entries of ``modules`` as they are now (the dicts copied, no tensor).

    Args:
        modules: the model's modules (a TorchScript module's mappings are not dicts: nothing is kept, and
            :meth:`restore` does nothing; the wrapper refuses such a model anyway).
    """

    __slots__ = ("buffers", "modules", "parameters")

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.modules = modules
        try:  # C-level passes: a microsecond for some fifty modules
            self.parameters: list[dict] = [*map(dict.copy, map(_PARAMETERS, modules))]
            self.buffers: list[dict] = [*map(dict.copy, map(_BUFFERS, modules))]
        except TypeError:
            self.modules, self.parameters, self.buffers = (), [], []

    def restore(self) -> None:
        """Put back every entry of the modules' ``_parameters`` and ``_buffers`` that is not the one kept (the same
        dicts, in their order), and remove a tensor a module holds in its ``__dict__`` under one of their names
        (where ``to_module(..., preserve_module_state=False)`` puts a tensor that is not a parameter)."""
        for module, parameters, buffers in zip(self.modules, self.parameters, self.buffers, strict=True):
            own = module.__dict__
            for kept, now in ((parameters, own.get("_parameters")), (buffers, own.get("_buffers"))):
                if not isinstance(now, dict):
                    continue
                if len(now) != len(kept) or any(now.get(name, _MISSING) is not value for name, value in kept.items()):
                    now.clear()
                    now.update(kept)
                for name in kept:
                    if isinstance(own.get(name), torch.Tensor):
                        del own[name]


class TransformedSlots:
    """Weak references to the tensors in a model's parameter and buffer slots, taken outside any ``torch.func``
    transform when the wrapper is made or copied (the model's own, not those a caller swaps in later for a call),
    to put back those that a caller's ``to_module`` under ``torch.vmap`` swapped out when the wrapper refuses to run
    there.

    torchrl's ``SACLoss`` calls its Q-network under ``torch.vmap`` with each stacked set of parameters put in by
    ``to_module(..., preserve_module_state=False)``: the wrapper refuses that call before it runs anything, and
    tensordict's ``to_module`` does not put the network's parameters back when its block raises. Only slots that
    hold a tensor of a transform (a ``BatchedTensor``, unusable once the transform returns) are put back, with the
    tensor kept for that slot where it is still alive and has the slot's shape and dtype. A copy of the wrapper
    keeps none of the original's (its model's tensors are others): it takes its own.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torch import nn
        >>> net = nn.Linear(3, 2)
        >>> weight, slots = net.weight, TransformedSlots()
        >>> slots.take([net])
        >>> def member(params, x):
        ...     _ = params.to_module(net, preserve_module_state=False)  # a block that raises leaves it so
        ...     slots.restore([net])  # as the wrapper does before it refuses
        ...     return x
        >>> _ = torch.vmap(member, (0, None))(TensorDict.from_modules(net, net), torch.ones(3))
        >>> net.weight is weight, sorted(net._parameters)
        (True, ['bias', 'weight'])
    """

    __slots__ = ("_kept",)

    def __init__(self) -> None:
        self._kept: dict[int, tuple[weakref.ref, dict, dict]] = {}

    def take(self, modules: Iterable[nn.Module]) -> None:
        """Keep weak references to the tensors in the slots of ``modules`` (called outside any transform)."""
        self._kept = {
            id(module): (
                weakref.ref(module),
                _references(module.__dict__.get("_parameters")),
                _references(module.__dict__.get("_buffers")),
            )
            for module in modules
        }

    def restore(self, modules: Iterable[nn.Module]) -> None:
        """Put back, in the slots of ``modules`` that hold a transform's tensor (or in whose place a module's
        ``__dict__`` holds one), the tensor kept for it (called on the refusal's path only)."""
        for module in modules:
            kept = self._kept.get(id(module))
            if kept is None or kept[0]() is not module:
                continue
            own = module.__dict__
            for name, references in (("_parameters", kept[1]), ("_buffers", kept[2])):
                slots = own.get(name)
                if isinstance(slots, dict) and references:
                    _put_back(own, slots, references)

    def __reduce__(self) -> tuple:
        return TransformedSlots, ()  # a copy's model holds other tensors


def _references(slots: object) -> dict[str, weakref.ref]:
    """Weak references to the tensors of a module's ``_parameters`` or ``_buffers`` (none for another mapping)."""
    if not isinstance(slots, dict):
        return {}
    return {name: weakref.ref(tensor) for name, tensor in slots.items() if isinstance(tensor, torch.Tensor)}


def _put_back(own: dict, slots: dict, references: dict[str, weakref.ref]) -> None:
    """Put the kept tensors back in ``slots`` where a transform's tensor stands for them (in ``slots`` or ``own``)."""
    changed = False
    for name, reference in references.items():
        current = slots.get(name, own.get(name))
        tensor = reference()
        if (
            tensor is None
            or not isinstance(current, torch.Tensor)
            or not torch._C._functorch.is_functorch_wrapped_tensor(current)
            or current.shape != tensor.shape
            or current.dtype != tensor.dtype
        ):
            continue
        if isinstance(own.get(name), torch.Tensor):
            del own[name]
        slots[name] = tensor
        changed = True
    if changed and list(slots) != [name for name in references if name in slots]:  # their order, for state_dict
        ordered = {name: slots[name] for name in references if name in slots}
        ordered.update(slots)
        slots.clear()
        slots.update(ordered)
