"""What tells whether a module's parameters still hold the values a rule's prepared state was built from.

A rule keeps what it derives from a layer's parameters (the modified weights of z⁺, αβ, γ, Flat, w², a BatchNorm
merged into the layer before it) and builds it anew only when they change. Identity, version counter and storage
(:func:`parameter_fingerprint`) see an optimizer step, an in-place write and a parameter replaced or given new
``.data``. A write *through* ``.data`` (``weight.data.copy_(...)``) goes to the same storage without raising the
parameter's version counter: torchrl's target updates (``SoftUpdate``, ``HardUpdate``), its weight sync schemes and
tensordict's ``TensorDict.data`` write so, as layers' own initialisations do. :class:`HeldParameters` also keeps a
copy of the values, compared with the live ones while the fingerprint is unchanged. The tensors a forward reads from
the module's ``__dict__`` count as its parameters: torchrl's multi-agent networks put each agent's there for its call.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from tdhook.attribution.rules._layers import _WEIGHT_HOOKS, _computed_name, _has_weight_property

__all__ = ["HeldParameters", "parameter_fingerprint"]

_NEVER_THE_SAME = itertools.count()
_NUMBERS = frozenset({bool, int, float})  # the attribute types a fingerprint holds the values of


# The tensors torch's own forwards of layers and norms read by name: a tensor set in such a module's ``__dict__``
# under another name (an activation a hook keeps on the layer, as BackPACK's ``input0`` and ``output``) is never read.
_READ_BY_TORCH = frozenset({"weight", "bias", "running_mean", "running_var", "num_batches_tracked"})


def _read_by_forward(module: nn.Module, name: str) -> bool:
    """Whether ``module``'s forward may read the tensor set in its ``__dict__`` under ``name``: any name for a
    forward of one's own; for torch's own, the names of its parameters and buffers."""
    forward = getattr(type(module), "forward", None)
    if "forward" in module.__dict__ or not getattr(forward, "__module__", "").startswith("torch.nn.modules."):
        return True
    return name in _READ_BY_TORCH or name in module._parameters or name in module._buffers


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    """The parameters and buffers of ``module`` and its children (a lazy one's placeholders left out), and the
    tensors set in their ``__dict__`` that the forward may read, before any parameter of the same name: tensordict's
    ``to_module(..., preserve_module_state=False)`` puts an agent's or an ensemble member's parameters there, with
    no parameter left in the module (those a weight hook computes at each call from parameters listed here, as
    ``torch.nn.utils.prune`` does, are left out, and so are activations a hook keeps on a layer of torch's: new
    tensors at every call, which would make the state anew at each)."""
    modules = list(module.modules()) if module._modules else [module]
    tensors = []
    for sub in modules:
        tensors += (t for t in (*sub._parameters.values(), *sub._buffers.values()) if t is not None)
        set_here = [(name, value) for name, value in sub.__dict__.items() if isinstance(value, torch.Tensor)]
        if set_here:
            hooks = sub._forward_pre_hooks.values()
            computed = {_computed_name(hook) for hook in hooks if isinstance(hook, _WEIGHT_HOOKS)}
            tensors += (v for name, v in set_here if name not in computed and _read_by_forward(sub, name))
    return [t for t in tensors if not nn.parameter.is_lazy(t)]


def parameter_fingerprint(module: nn.Module, tensors: list[torch.Tensor] | None = None) -> tuple:
    """What tells whether ``module``'s parameters and buffers (its children's included) are the tensors seen, with
    no write that their version counter saw (``tensors``: those of :func:`_tensors`, if already listed).

    For each tensor: its identity, its version counter (raised by every in-place
    write: ``optimizer.step()``, ``weight.mul_(2)``) and its storage (new after
    ``weight.data = ...``). A parameter replaced by another changes the identity,
    and a switch between training and eval mode changes the fingerprint; a layer
    whose weight is a property has a new fingerprint at every call. The number
    attributes of the module and its children are part of it too: what is derived
    from the parameters may read them (a BatchNorm's ``eps``, timm's
    ``ScaledStdConv2d.scale``). Cheap enough to check at every call of a ruled layer.
    A write through ``.data`` leaves it as it was (see :class:`HeldParameters`).

    Examples:
        >>> lin = nn.Linear(2, 2)
        >>> before = parameter_fingerprint(lin)
        >>> before == parameter_fingerprint(lin)
        True
        >>> with torch.no_grad():
        ...     _ = lin.weight.mul_(2)
        >>> before == parameter_fingerprint(lin)
        False
        >>> norm = nn.BatchNorm1d(2)
        >>> before = parameter_fingerprint(norm)
        >>> norm.eps = 0.5
        >>> before == parameter_fingerprint(norm)
        False
    """
    modules = list(module.modules()) if module._modules else [module]
    # The mode and the number attributes too (a layer's weight may depend on them: ``training``, ``eps``); a weight
    # computed by a property on each access (torchrl's NoisyLinear: noise or not by training mode or by the global
    # exploration type) is never the same.
    fingerprint: list = [value for sub in modules for value in sub.__dict__.values() if type(value) in _NUMBERS]
    fingerprint.append(len(fingerprint))  # where the numbers end and the tensors begin
    if _has_weight_property(module):
        fingerprint.append(next(_NEVER_THE_SAME))
    for tensor in _tensors(module) if tensors is None else tensors:
        fingerprint += (id(tensor), tensor._version, tensor.data_ptr())
    return tuple(fingerprint)


class HeldParameters:
    """The parameters and buffers of modules as a state was built from them: their fingerprint and their values.

    :meth:`unchanged` is ``True`` while every tensor is the one seen, with the values seen: a write its version
    counter saw changes the fingerprint, and one through ``.data`` the values. The values are compared only while the
    fingerprint is the same, one pass over the tensors, never on the meta device (no values to compare).

    Examples:
        >>> lin = nn.Linear(2, 2)
        >>> held = HeldParameters(lin)
        >>> held.unchanged(lin)
        True
        >>> _ = lin.weight.data.mul_(2)  # no version counter sees it
        >>> held.unchanged(lin), HeldParameters(lin).unchanged(lin)
        (False, True)
    """

    __slots__ = ("fingerprint", "values")

    def __init__(self, *modules: nn.Module) -> None:
        tensors = [_tensors(module) for module in modules]
        self.fingerprint = [parameter_fingerprint(m, t) for m, t in zip(modules, tensors, strict=True)]
        self.values = [[t.detach().clone() for t in row if not t.is_meta] for row in tensors]

    def unchanged(self, *modules: nn.Module) -> bool:
        """Whether ``modules`` (those the record was made of, in the same order) hold the tensors and values seen."""
        for module, fingerprint, values in zip(modules, self.fingerprint, self.values, strict=True):
            tensors = _tensors(module)
            if parameter_fingerprint(module, tensors) != fingerprint:
                return False
            if not all(map(_same_values, [t for t in tensors if not t.is_meta], values)):
                return False
        return True


def _same_values(live: torch.Tensor, held: torch.Tensor) -> bool:
    """Bit for bit, NaN included (``torch.equal`` calls NaN unequal to itself: a NaN weight would rebuild at every
    call)."""
    if torch.equal(live, held):
        return True
    return live.is_floating_point() and bool(((live == held) | (live.isnan() & held.isnan())).all())
