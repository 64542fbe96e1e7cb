"""Gates computed by functions: held from a wrapper's first call on, where that call (or the first of another
signature) finds one.

The CNN presets hold squeeze-excite gates constant (signal-take-all) through
:class:`~tdhook.attribution.rules.gates.HeldGates`, a ``TorchFunctionMode``
that their mappers turn on only where a sigmoid-like module has a
:class:`~tdhook.attribution.rules.gates.GateRule`: a mode on every call costs
Python dispatch on every operation and keeps ``torch.compile`` from tracing the
model. A model that computes its gate with a function
(``x * torch.sigmoid(self.fc(x))``) has no such module, and its gate would keep
the plain gradient, which creates relevance: both factors of the product get
all of it.

So the first call of a wrapper, which runs in the watch of
:mod:`~tdhook.attribution._nonlinear_calls` anyway, runs in ``HeldGates`` too,
and its relevance is right; later calls run in it only if that first call held a
gate, or gave a clipping call the model's outputs depend on the pass rule
(``torch.clamp`` in a module's own forward: the rule ``nn.Hardtanh`` gets; a clip
inside an ``nn.Hardtanh``, whose own rule takes the gradient past it, is no
reason), or held the norms of an ``F.normalize`` or ``F.cosine_similarity`` call
they depend on (an embedding network's last call, a siamese network's score) and
did not give them back their plain gradient (a cosine attention's). A call of
another signature (see :mod:`~tdhook.attribution._call_signatures`) is probed as
the first was: the forward may branch on its inputs' shapes or keys to a gate.
The decision is the wrapper's (one model), not the mapper's, which may serve
several models.

A forward may also branch on a flag of the model or on its inputs' values, at
one signature (``torch.sigmoid(s) if self.gated else torch.tanh(s)``): a later
call would take a gate the probe never saw without the mode. So the probe keeps
the shape of the graph its explained outputs reach (see
:func:`~tdhook.attribution._graph_shape.shape_through_views`; a walk costs a
small part of the call), and a later call of its signature that runs without
the mode compares its own (:meth:`FunctionGates.changed`): where it differs,
the model runs again, in the probe, from the same inputs and state (see
:func:`~tdhook.attribution._model_run.run_model`), and the shape is kept as one
with no gate where the probe found none. A signature whose graph took more than
a few shapes runs its later calls in ``HeldGates``.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> from tdhook.attribution.mappers.base import BaseRuleMapper
    >>> gates = FunctionGates()
    >>> (probe,) = gates.modes(BaseRuleMapper(), [])
    >>> x = torch.randn(3, 4, requires_grad=True)
    >>> with probe:
    ...     h = x * 2
    ...     z = h * torch.sigmoid(h @ torch.randn(4, 4))
    >>> gates.settle()
    >>> gates.found, len(gates.modes(BaseRuleMapper(), []))
    (True, 1)

    A model with no gate found, whose graph then changes (a flag switched on), runs that call again in the probe:

    >>> gates = FunctionGates()
    >>> (probe,) = gates.modes(BaseRuleMapper(), [])
    >>> with probe:
    ...     z = torch.tanh(x * 2) * x
    >>> gates.settle(z)
    >>> gates.modes(BaseRuleMapper(), []), gates.changed(torch.tanh(x * 2) * x)
    ([], None)
    >>> gates.modes(BaseRuleMapper(), []), gates.changed(torch.sigmoid(x * 2) * x) is not None
    ([], True)
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from tdhook.attribution._graph_shape import shape_through_views
from tdhook.attribution.mappers.base import BaseRuleMapper
from tdhook.attribution.rules._autograd import relevance_pass_edges
from tdhook.attribution.rules.gates import HeldGates
from tdhook.attribution.targets import resolve_target_key

__all__ = ["FunctionGates"]

# Shapes of one signature's graph with no gate that a wrapper keeps; a signature whose graph takes more runs in the mode
_MOST_SHAPES = 8


class FunctionGates:
    """Whether one wrapper's model computes gates with functions, decided by its first call of each signature, which
    holds them; later calls of a signature with no gate found are checked against the shapes of its graph."""

    def __init__(self) -> None:
        self.found: bool | None = None  # None: not known yet
        self.checks = False  # whether the call in flight runs without the mode, its graph to be checked
        self._probe: HeldGates | None = None
        # By signature of the forward passes completed in the probe: the shapes of their graphs found to hold no gate
        self._shapes: dict[Hashable, set[tuple]] = {}
        self._held: set[Hashable] = set()  # signatures whose graph took too many shapes: every call in HeldGates
        self._signature: Hashable = None  # that of the call in flight
        self._seen: tuple | None = None  # in a call run again in the probe: the shape of its plain graph

    def __getstate__(self) -> dict:
        """A copy (a deep copy or a pickle of the wrapper) starts as a new wrapper does, its first calls probed: the
        shapes kept hold autograd's node classes, which do not pickle."""
        return vars(FunctionGates()).copy()

    def modes(
        self, mapper: Any, rule_modes: Sequence[Any], signature: Hashable = None, seen: tuple | None = None
    ) -> list[HeldGates]:
        """The mode to add to the mapper's ``rule_modes`` for this call: ``HeldGates`` or nothing.

        Args:
            mapper: the wrapper's rule mapper; only a :class:`BaseRuleMapper` (the presets) holds gates.
            rule_modes: the mapper's function modes for this call; one that covers sigmoid already holds gates.
            signature: the call's (see :mod:`~tdhook.attribution._call_signatures`): a call of a signature no
                forward pass completed with is probed, as the first: another branch of the forward may gate.
            seen: for a call run again, the shape of its graph that :meth:`changed` gave: it is probed.
        """
        self._probe, self.checks, self._signature, self._seen = None, False, signature, seen
        if not isinstance(mapper, BaseRuleMapper) or _covers_gates(rule_modes):
            return []
        if self.found or signature in self._held:
            return [HeldGates()]
        if signature not in self._shapes or seen is not None:  # until a forward pass has completed in it
            self._probe = HeldGates(probe=True)
            return [self._probe]
        self.checks = True
        return []

    def hold(self) -> HeldGates:
        """The mode for a call that :meth:`modes` would check but that cannot run again: its gates held, unchecked."""
        self.checks = False
        return HeldGates()

    @property
    def probes(self) -> bool:
        """Whether the call in flight runs in the probe."""
        return self._probe is not None

    def may_hold(self, mapper: Any, signature: Hashable = None) -> bool:
        """Whether a call of ``signature`` in a context of ``mapper`` (with no function modes of its own) enters
        ``HeldGates``: gates were found, or no forward pass of that signature has completed yet, or its graph took
        too many shapes."""
        found = bool(self.found) or signature in self._held or signature not in self._shapes
        return isinstance(mapper, BaseRuleMapper) and found

    def changed(self, outputs: object, lrp: Any = None) -> tuple | None:
        """After a forward pass run without the mode (:attr:`checks`): ``None`` where the graph its explained
        outputs reach has a shape a probe of its signature found no gate in; else that shape, and the call must run
        again, given it as :meth:`modes`' ``seen`` (in the probe; in ``HeldGates`` once its signature's graph took
        too many shapes)."""
        if not self.checks:
            return None
        self.checks = False
        shape = shape_through_views(_roots(_explained(outputs, lrp)) or [])
        shapes = self._shapes[self._signature]
        if shape in shapes:
            return None
        if len(shapes) >= _MOST_SHAPES:
            self._held.add(self._signature)
        return shape

    def settle(self, outputs: object = None, lrp: Any = None) -> None:
        """After a forward pass that completed: whether it held a gate, or gave a clipping call whose output the
        explained outputs depend on the pass rule, decides the later calls. ``outputs``: what the model returned;
        ``lrp``: the wrapper, whose targets are the explained outputs (every tensor of ``outputs`` without it). A
        clip inside a module with a rule of its own (``nn.Hardtanh``) is not reached: the module's rule takes the
        gradient past it; nor is one only an output that is not explained reads (a policy's scale, for its loc)."""
        if self._probe is not None:
            probe, self._probe = self._probe, None
            explained = _explained(outputs, lrp)
            ruled = [
                *probe.clips,
                *probe.norm_calls.held_nodes(),
            ]  # calls whose rule the explained outputs may not reach
            found = probe.held or (bool(ruled) and _reaches(explained, set(ruled)))
            self.found = bool(self.found) or found
            # The shape of the plain graph the probe ran again for, else the probe's own (a plain call's, but where
            # the probe gave a call a rule the explained outputs do not reach: a later call runs again, once).
            shape = self._seen if self._seen is not None else shape_through_views(_roots(explained) or [])
            self._shapes.setdefault(self._signature, set()).add(shape)


def _covers_gates(modes: Sequence[Any]) -> bool:
    """Whether one of the mapper's modes holds gates already (HeldGates, or AttnLRP's rules, which cover sigmoid)."""
    return any(
        isinstance(mode, HeldGates) or (hasattr(mode, "covers") and mode.covers(torch.sigmoid, ())) for mode in modes
    )


def _explained(outputs: object, lrp: Any) -> object:
    """The outputs ``lrp`` explains in the TensorDict ``outputs`` (all of it where they cannot be told)."""
    if lrp is None or not hasattr(outputs, "get"):
        return outputs
    try:
        keys = [resolve_target_key(outputs, *lrp.targets[name], lrp._candidates.of(lrp, name)) for name in lrp.targets]
    except Exception:  # noqa: BLE001 (the call reports a target it cannot find itself, right after)
        return outputs
    return [outputs.get(key) for key in keys]


def _reaches(outputs: object, nodes: set) -> bool:
    """Whether the relevance pass from the tensors in ``outputs`` (a tensor, a TensorDict or a tuple of them) reaches
    one of ``nodes``."""
    roots = _roots(outputs)
    if roots is None:
        return True  # nothing to walk from: as if reached
    stack, seen = list(roots), set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        if node in nodes:
            return True
        seen.add(node)
        stack.extend(relevance_pass_edges(node))
    return False


def _roots(outputs: object) -> list | None:
    """The autograd nodes of the tensors in ``outputs`` (a tensor, a TensorDict or a tuple of them); ``None`` for
    no such container."""
    if isinstance(outputs, torch.Tensor):
        tensors = [outputs]
    elif isinstance(outputs, (tuple, list)):
        tensors = [t for t in outputs if isinstance(t, torch.Tensor)]
    elif hasattr(outputs, "values"):
        try:
            tensors = [t for t in outputs.values(True, True) if isinstance(t, torch.Tensor)]
        except RuntimeError:  # a lazy stack of entries of different shapes: read from the TensorDicts it stacks
            stacked = [_roots(part) for part in getattr(outputs, "tensordicts", ())]
            return None if not stacked or None in stacked else [node for roots in stacked for node in roots]
    else:
        return None
    return [t.grad_fn for t in tensors if t.grad_fn is not None]
