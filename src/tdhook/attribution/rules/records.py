"""What a rule records of its registrations and of the layer calls it marks: :class:`Registration`, the
:class:`LayerCall` a Linear or convolution layer's rule leaves on its output, and the :class:`MergedLayer` a following
BatchNorm folds into it.

Examples:
    >>> lin = nn.Linear(3, 2)
    >>> layer_call_of(lin(torch.randn(1, 3))) is None  # no rule, no mark
    True
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tdhook.attribution.rules._held_parameters import HeldParameters

__all__ = ["Registration", "LayerCall", "MergedLayer", "layer_call_of"]


@dataclass
class Registration:
    """What a rule keeps for one module it is registered on.

    :meth:`Rule.rewrite` receives it with each call of the module; ``state`` holds what :meth:`Rule.prepare`
    returned (modified parameters, for example).

    Examples:
        >>> from tdhook.attribution.rules import Rule
        >>> class KeepsPlainGradient(Rule):
        ...     def prepare(self, module):
        ...         return module.weight.detach().clamp(min=0)
        ...     def rewrite(self, module, registration, inputs, output):
        ...         seen.append(registration.state.shape)
        ...         return None  # the plain gradient
        >>> seen, lin = [], nn.Linear(3, 2)
        >>> with KeepsPlainGradient().register(lin):
        ...     _ = lin(torch.randn(1, 3))
        >>> seen
        [torch.Size([2, 3])]
    """

    state: Any
    hooks: list = field(default_factory=list)
    snapshots: list = field(default_factory=list)
    records: list = field(default_factory=list)
    busy: list = field(default_factory=list)
    merged_by_norm: bool = False  # a BatchNorm took over the module's last call (see MergeBatchNormRule)
    held: HeldParameters | None = None  # the parameters ``state`` was prepared from
    settings: int = -1  # the rule's settings count ``state`` was prepared with (see Rule.__setattr__)
    marks: bool = True  # whether a Linear or convolution layer's output gets its LayerCall (see Rule.reads_layer_marks)
    plain_layer: type | None = None  # the class of a Linear or convolution layer with torch's own forward, else None
    training: bool | None = None  # the layer's mode when its rule last checked its own forward (see EpsilonRule)


class LayerCall:
    """One call of a Linear or convolution layer, attached to the tensor its rule returned.

    A BatchNorm that reads this tensor merges itself into the layer (see
    :class:`MergeBatchNormRule`). ``observers`` are called with the merged
    layer's output when that happens, so that checks and inner-layer relevance
    see the output of the merged layer.

    ``raw`` is the layer's output before its rule. Where the rule kept the plain gradient, the call is attached to
    ``raw`` itself and holds it through a weak reference (see :meth:`held_by_raw`): a reference back to the tensor
    that holds the call would make a cycle, which kept each layer's output and the autograd graph behind it alive
    after the call, until the garbage collector's next full pass (or for good, through the base of a view).

    Examples:
        >>> from tdhook.attribution.rules import EpsilonRule
        >>> lin, x = nn.Linear(3, 2), torch.randn(1, 3)
        >>> with EpsilonRule().register(lin):
        ...     call = layer_call_of(lin(x))
        >>> call.module is lin, torch.equal(call.x, x)
        (True, True)
    """

    __slots__ = ("module", "rule", "registration", "x", "_raw", "version", "observers", "read", "shape")

    def __init__(
        self,
        module: nn.Module,
        rule: Any,  # the Rule whose rewrite returned the tensor (tdhook.attribution.rules.base imports this module)
        registration: Registration,
        x: torch.Tensor,
        raw: torch.Tensor,
        version: int,
        observers: list | None = None,
        # The weight and bias the call read, for a layer with torch's own forward: a call with other parameters
        # than the layer holds (``torch.func.functional_call``) has them back once it returns, before a BatchNorm
        # merges.
        read: tuple | None = None,
    ) -> None:
        self.module, self.rule, self.registration, self.x, self._raw = module, rule, registration, x, raw
        self.version = version
        self.observers = [] if observers is None else observers
        self.read = read
        # The shape of ``raw``, kept where the call is attached to the base of ``raw`` (a view): the base may
        # outlive it.
        self.shape: torch.Size | None = None

    @property
    def raw(self) -> torch.Tensor | None:
        """The layer's output before its rule (``None`` once a weakly held one is gone)."""
        raw = self._raw
        return raw() if type(raw) is weakref.ref else raw

    @raw.setter
    def raw(self, value: torch.Tensor) -> None:
        self._raw = value

    def held_by_raw(self) -> LayerCall:
        """This call, holding ``raw`` through a weak reference: for attaching to ``raw`` (or to its base), which
        then keeps both alive.

        Examples:
            >>> call = LayerCall(nn.Linear(3, 2), None, Registration(None), torch.ones(1, 3), torch.ones(1, 2), 0)
            >>> call.held_by_raw() is call, call.raw is None  # nothing else held that output
            (True, True)
        """
        raw = self._raw
        if type(raw) is not weakref.ref:
            self._raw = weakref.ref(raw)
        return self

    def copy(self, **changes: Any) -> LayerCall:
        """A copy with ``changes`` (``raw=...``), sharing ``observers``.

        Examples:
            >>> call = LayerCall(nn.Linear(3, 2), None, Registration(None), torch.ones(1, 3), torch.ones(1, 2), 0)
            >>> other = call.copy(raw=torch.zeros(1, 2))
            >>> other.observers is call.observers, other.raw.sum().item()
            (True, 0.0)
        """
        raw = changes.pop("raw") if "raw" in changes else self.raw
        copied = LayerCall(
            self.module, self.rule, self.registration, self.x, raw, self.version, self.observers, self.read
        )
        copied.shape = self.shape
        for name, value in changes.items():
            setattr(copied, name, value)
        return copied

    def __repr__(self) -> str:
        raw = self.raw
        return (
            f"LayerCall(module={self.module!r}, rule={self.rule!r}, x={tuple(self.x.shape)}, "
            f"raw={None if raw is None else tuple(raw.shape)}, version={self.version})"
        )


@dataclass(eq=False)
class MergedLayer:
    """A Linear or convolution layer with the following BatchNorm folded in.

    ``params`` holds ``weight`` and ``bias`` of the merged layer, ``channel_scale``
    the BatchNorm's ``γ / sqrt(var + eps)`` per channel, and ``cache`` whatever a
    rule derives from them (computed once per context, and again when the parameters change).
    :meth:`Rule.rewrite_merged` receives it.

    Examples:
        >>> merged = MergedLayer({"weight": torch.ones(2, 3), "bias": torch.zeros(2)}, torch.full((2,), 0.5))
        >>> merged.params["weight"].shape, merged.channel_scale.tolist()
        (torch.Size([2, 3]), [0.5, 0.5])
    """

    params: dict[str, torch.Tensor]
    channel_scale: torch.Tensor
    cache: dict = field(default_factory=dict)
    held: HeldParameters | None = None  # the BatchNorm's parameters it was built from, and the layer's unless ``layer``
    layer: HeldParameters | None = None  # the layer's rule's record of the layer's parameters, where it keeps one


_LAYER_CALL = "_tdhook_layer_call"


def layer_call_of(tensor: Any) -> LayerCall | None:
    """The :class:`LayerCall` that produced ``tensor``, if it is still unmodified.

    Layers leave these marks only in a context where some rule reads them: a rule of one's own that calls this
    sets :attr:`Rule.reads_layer_marks` to ``True``, or it gets ``None``.

    Examples:
        >>> from tdhook.attribution.rules import EpsilonRule
        >>> lin = nn.Linear(3, 2)
        >>> with EpsilonRule().register(lin):
        ...     z = lin(torch.randn(1, 3))
        ...     marked, after_relu = layer_call_of(z), layer_call_of(z.relu())
        >>> marked.module is lin, after_relu
        (True, None)
    """
    call = getattr(tensor, _LAYER_CALL, None)
    if call is None and _through_backward_hook(tensor):
        # A full backward hook of the layer, or of the module it feeds, hands on a view of the layer's output.
        tensor = tensor._base
        call = getattr(tensor, _LAYER_CALL, None)
    if call is None or call.version != tensor._version:
        return None
    if call.raw is None:
        # Attached to the base of the layer's output, a view that is gone since (``lin(x).reshape(-1, C)``), or to a
        # view of that base that the rule returned: the same memory, unmodified, read from the base (the layer's own
        # history, not the rule's) in that output's shape.
        shape, base = call.shape, tensor if tensor._base is None else tensor._base
        return call.copy(raw=base.view(shape)) if shape is not None and base.numel() == shape.numel() else None
    return call


def _through_backward_hook(tensor: Any) -> bool:
    """Whether ``tensor`` is the view of a module's output or input that torch makes for the module's full
    backward hooks (``register_full_backward_hook``, ``register_full_backward_pre_hook``): the same values."""
    return (
        isinstance(tensor, torch.Tensor)
        and tensor._is_view()
        and type(tensor.grad_fn).__name__ == "BackwardHookFunctionBackward"
    )
