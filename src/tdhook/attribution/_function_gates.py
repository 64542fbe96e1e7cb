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
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from tdhook.attribution.mappers.base import BaseRuleMapper
from tdhook.attribution.rules._autograd import relevance_pass_edges
from tdhook.attribution.rules.gates import HeldGates
from tdhook.attribution.targets import resolve_target_key

__all__ = ["FunctionGates"]


class FunctionGates:
    """Whether one wrapper's model computes gates with functions, decided by its first call of each signature, which
    holds them."""

    def __init__(self) -> None:
        self.found: bool | None = None  # None: not known yet
        self._probe: HeldGates | None = None
        self._probed: set[Hashable] = set()  # the signatures of the forward passes completed in the probe
        self._signature: Hashable = None  # that of the call in the probe

    def modes(self, mapper: Any, rule_modes: Sequence[Any], signature: Hashable = None) -> list[HeldGates]:
        """The mode to add to the mapper's ``rule_modes`` for this call: ``HeldGates`` or nothing.

        Args:
            mapper: the wrapper's rule mapper; only a :class:`BaseRuleMapper` (the presets) holds gates.
            rule_modes: the mapper's function modes for this call; one that covers sigmoid already holds gates.
            signature: the call's (see :mod:`~tdhook.attribution._call_signatures`): a call of a signature no
                forward pass completed with is probed, as the first: another branch of the forward may gate.
        """
        self._probe = None
        if not isinstance(mapper, BaseRuleMapper) or _covers_gates(rule_modes):
            return []
        if not self.found and signature not in self._probed:  # until a forward pass has completed in it
            self._probe, self._signature = HeldGates(probe=True), signature
            return [self._probe]
        return [HeldGates()] if self.found else []

    def may_hold(self, mapper: Any, signature: Hashable = None) -> bool:
        """Whether a call of ``signature`` in a context of ``mapper`` (with no function modes of its own) enters
        ``HeldGates``: gates were found, or no forward pass of that signature has completed yet."""
        return isinstance(mapper, BaseRuleMapper) and (bool(self.found) or signature not in self._probed)

    def settle(self, outputs: object = None, lrp: Any = None) -> None:
        """After a forward pass that completed: whether it held a gate, or gave a clipping call whose output the
        explained outputs depend on the pass rule, decides the later calls. ``outputs``: what the model returned;
        ``lrp``: the wrapper, whose targets are the explained outputs (every tensor of ``outputs`` without it). A
        clip inside a module with a rule of its own (``nn.Hardtanh``) is not reached: the module's rule takes the
        gradient past it; nor is one only an output that is not explained reads (a policy's scale, for its loc)."""
        if self._probe is not None:
            probe, self._probe = self._probe, None
            ruled = [
                *probe.clips,
                *probe.norm_calls.held_nodes(),
            ]  # calls whose rule the explained outputs may not reach
            found = probe.held or (bool(ruled) and _reaches(_explained(outputs, lrp), set(ruled)))
            self.found = bool(self.found) or found
            self._probed.add(self._signature)


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
    if isinstance(outputs, torch.Tensor):
        tensors = [outputs]
    elif isinstance(outputs, (tuple, list)):
        tensors = [t for t in outputs if isinstance(t, torch.Tensor)]
    elif hasattr(outputs, "values"):
        tensors = [t for t in outputs.values(True, True) if isinstance(t, torch.Tensor)]
    else:
        return True  # nothing to walk from: as if reached
    stack, seen = [t.grad_fn for t in tensors if t.requires_grad and t.grad_fn is not None], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        if node in nodes:
            return True
        seen.add(node)
        stack.extend(relevance_pass_edges(node))
    return False
