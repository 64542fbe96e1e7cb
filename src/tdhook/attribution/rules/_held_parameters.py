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
_OTHER, _NUMBER, _TENSOR = range(3)


class _Kinds(dict):
    """What each type of attribute value is to a fingerprint: a number it holds the value of (``bool``, ``int``,
    ``float``), a tensor, or neither; learnt once per type (``isinstance(value, torch.Tensor)`` costs ~0.2 µs, and
    a layer's ``__dict__`` holds some 25 values, read at every call)."""

    def __missing__(self, cls: type) -> int:
        kind = _NUMBER if cls in (bool, int, float) else _TENSOR if issubclass(cls, torch.Tensor) else _OTHER
        if len(self) < 4096:  # classes made on the fly are not all kept alive
            self[cls] = kind
        return kind


_KINDS = _Kinds()
_LAZY = nn.parameter.UninitializedTensorMixin  # a lazy module's placeholders: no values yet


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
    return _scan(module)[1]


def _scan(module: nn.Module) -> tuple[tuple, list[torch.Tensor]]:
    """:func:`parameter_fingerprint` and :func:`_tensors` of ``module``, in one pass over its modules' ``__dict__``
    (checked at every call of a ruled layer)."""
    modules = list(module.modules()) if module._modules else (module,)
    # The mode and the number attributes too (a layer's weight may depend on them: ``training``, ``eps``).
    numbers: list = []
    tensors: list = []
    for sub in modules:
        set_here = []
        for name, value in sub.__dict__.items():
            kind = _KINDS[type(value)]
            if kind == _NUMBER:
                numbers.append(value)
            elif kind == _TENSOR:
                set_here.append((name, value))
        tensors += sub._parameters.values()
        tensors += sub._buffers.values()
        if set_here:
            hooks = sub._forward_pre_hooks.values()
            computed = {_computed_name(hook) for hook in hooks if isinstance(hook, _WEIGHT_HOOKS)}
            tensors += (v for name, v in set_here if name not in computed and _read_by_forward(sub, name))
    tensors = [t for t in tensors if t is not None and not isinstance(t, _LAZY)]
    numbers.append(len(numbers))  # where the numbers end and the tensors begin
    # A weight computed by a property on each access (torchrl's NoisyLinear: noise or not by training mode or by
    # the global exploration type) is never the same.
    if _has_weight_property(module):
        numbers.append(next(_NEVER_THE_SAME))
    for tensor in tensors:
        numbers += (id(tensor), tensor._version, tensor.data_ptr())
    return tuple(numbers), tensors


def parameter_fingerprint(module: nn.Module) -> tuple:
    """What tells whether ``module``'s parameters and buffers (its children's included) are the tensors seen, with
    no write that their version counter saw.

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
    return _scan(module)[0]


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

    __slots__ = ("fingerprint", "values", "live")

    def __init__(self, *modules: nn.Module) -> None:
        scans = [_scan(module) for module in modules]
        self.fingerprint = [fingerprint for fingerprint, _ in scans]
        # Which tensors have values (a tensor seen keeps its device while the fingerprint holds: a new ``.data``
        # changes its storage; ``None``: all of them), and a copy of those values.
        live = [[not t.is_meta for t in tensors] for _, tensors in scans]
        self.live = [None if all(row) else row for row in live]
        self.values = [[t.detach().clone() for t in tensors if not t.is_meta] for _, tensors in scans]

    def unchanged(self, *modules: nn.Module) -> bool:
        """Whether ``modules`` (those the record was made of, in the same order) hold the tensors and values seen."""
        for module, fingerprint, live, values in zip(modules, self.fingerprint, self.live, self.values, strict=True):
            now, tensors = _scan(module)
            if now != fingerprint:
                return False
            if live is not None:
                tensors = list(itertools.compress(tensors, live))
            if not all(map(torch.equal, tensors, values)) and not all(map(_same_values, tensors, values)):
                return False
        return True

    def copies_of(self, sources: list[torch.Tensor], module: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(source, copy)`` for each of ``sources`` that views a tensor of ``module`` (the record made of it
        alone) in full: the copy of its values seen.

        Examples:
            >>> lin = nn.Linear(2, 2)
            >>> held = HeldParameters(lin)
            >>> pairs = held.copies_of([lin.weight.detach(), torch.zeros(2)], lin)
            >>> len(pairs), torch.equal(pairs[0][1], lin.weight)
            (1, True)
        """
        (live,), (values,) = self.live, self.values
        _, tensors = _scan(module)
        if live is not None:
            tensors = list(itertools.compress(tensors, live))
        by_place = {(t.data_ptr(), t.shape, t.stride()): value for t, value in zip(tensors, values, strict=True)}
        pairs = []
        for source in sources:
            copy = None if source.is_meta else by_place.get((source.data_ptr(), source.shape, source.stride()))
            if copy is not None:
                pairs.append((source, copy))
        return pairs


def _same_values(live: torch.Tensor, held: torch.Tensor) -> bool:
    """Bit for bit, NaN included (``torch.equal`` calls NaN unequal to itself: a NaN weight would rebuild at every
    call)."""
    if torch.equal(live, held):
        return True
    return live.is_floating_point() and bool(((live == held) | (live.isnan() & held.isnan())).all())
