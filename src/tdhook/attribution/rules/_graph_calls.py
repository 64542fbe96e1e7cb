"""What a norm's rule tells a call that records its rules' places in the graph, and which norms run without a mode.

A wrapper's call may record where its rules act in the autograd graph, so that later calls on inputs of the same
shapes run the model without function modes and put the rules there as hooks (see
:mod:`tdhook.attribution._function_rule_plan`). A norm's rule
(:class:`~tdhook.attribution.rules.normalization.NormRule`) holds the normalising scale constant in a function mode
of its own, by detaching it. In a recording call the mode also tells where the scale's autograd node lies: behind
the node of the call that takes the scale (``x * rsqrt(...)``), at the scale's place among that node's inputs. A
later call runs such a norm's forward as it is (this thread reads :func:`runs_plain`) and stops the gradient at the
scale's node, which then passes none, as the detached scale passes none. The nodes of the norms' outputs, noted in
every such call (by the norm's hook, or by its call without hooks: see :mod:`~tdhook.attribution._quiet_modules`),
are where the paths to the ruled nodes may start: a few steps from each, through the norm's own call.

Examples:
    >>> import torch
    >>> norm = torch.nn.RMSNorm(3)
    >>> outputs = []
    >>> with graph_call(plain={id(norm)}, outputs=outputs):
    ...     note_output(norm(torch.ones(2, 3, requires_grad=True)))
    ...     runs_plain(norm)
    True
    >>> runs_plain(norm), recording() is None, type(outputs[0]).__name__
    (False, True, 'MulBackward0')
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from typing import Any

import torch
from torch import nn

__all__ = [
    "KeptOutputs",
    "graph_call",
    "keep_output",
    "note_output",
    "note_region",
    "planned",
    "recording",
    "runs_plain",
]

_LOCAL = threading.local()
_sequence_number = torch._C._autograd._get_sequence_nr


def recording() -> Any:
    """The recording of this thread's call in the modes, where a later call may run its norms plainly, or ``None``."""
    return getattr(_LOCAL, "recording", None)


def planned() -> bool:
    """Whether this thread's call runs by the plan of a recorded one, which puts the rules it recorded on the nodes
    of the graph after the forward (a norm that keeps its mode leaves a fused layer norm's node to it)."""
    return recording() is None and getattr(_LOCAL, "outputs", None) is not None


def runs_plain(module: nn.Module) -> bool:
    """Whether ``module``'s rule is put on the graph by this thread's call's plan: a norm's forward runs without its
    rule's mode (the plan cuts the gradient of the scale it holds); an activation's rule goes on its node."""
    plain = getattr(_LOCAL, "plain", None)
    return plain is not None and id(module) in plain


def note_region(module: nn.Module | None) -> None:
    """A module that the function modes pause in (see :func:`~tdhook.attribution._context.suspend_function_modes_in`)
    starts its forward (``module``) or ends it (``None``): noted with the number of the next node of the call, less
    the nodes of the mode's own (see :meth:`~tdhook.attribution._function_rule_plan.Recording.scaled`), where this
    thread's call notes them. A later call whose nodes are the recorded ones, but made in other modules (a flag that
    runs a product in a module mapped to its plain gradient instead of in the forward around it), is another call."""
    regions = getattr(_LOCAL, "regions", None)
    if regions is not None:
        record = getattr(_LOCAL, "recording", None)
        number = _sequence_number() - (0 if record is None else len(record.products))
        regions.append((None if module is None else id(module), number))


def note_output(output: Any) -> None:
    """A norm's forward returned ``output``: its node is noted, where the call notes them (a recording call's paths
    to the nodes it rules start from the norms' outputs as well as from the model's, and so are they followed)."""
    noted = getattr(_LOCAL, "outputs", None)
    if noted is not None:
        noted.append(output.grad_fn if isinstance(output, torch.Tensor) else None)


class KeptOutputs:
    """The last output of each module of ``modules`` (ids; ``None``: of every module with a rule) in one call, with
    its version when the module returned it: the input of an activation whose node saves its output, not its input
    (``torch.tanh``), for the identity rule's factor ``tanh(x) / x`` (see
    :mod:`tdhook.attribution._function_rule_plan`).

    Examples:
        >>> layer, kept = torch.nn.Linear(2, 2), KeptOutputs(None)
        >>> with graph_call(outputs=[], kept=kept):
        ...     keep_output(layer, layer(torch.ones(2)))
        >>> kept.output(id(layer)).shape
        torch.Size([2])
    """

    __slots__ = ("modules", "outputs")

    def __init__(self, modules: Collection[int] | None) -> None:
        self.modules = modules
        self.outputs: dict[int, tuple[Any, torch.Tensor, int]] = {}  # by module id: (module, output, version)

    def keep(self, module: nn.Module, output: torch.Tensor) -> None:
        """``module`` returned ``output``: kept where its module is one of those kept."""
        if self.modules is None or id(module) in self.modules:
            self.outputs[id(module)] = (module, output, output._version)

    def module_of(self, tensor: torch.Tensor) -> Any:
        """The module whose last output is ``tensor`` itself, unchanged in place since; or ``None``."""
        for module, output, version in self.outputs.values():
            if output is tensor:
                return module if tensor._version == version else None
        return None

    def output(self, key: int) -> torch.Tensor | None:
        """The last output of the module whose id is ``key``, where it is unchanged in place since; or ``None``."""
        entry = self.outputs.get(key)
        return None if entry is None or entry[1]._version != entry[2] else entry[1]


def keep_output(module: nn.Module, output: Any) -> None:
    """A module whose rule is a hook on it returned ``output`` (what its later hooks and its caller see, but for
    hooks registered after the rule's): kept where this thread's call keeps that module's outputs."""
    kept = getattr(_LOCAL, "kept", None)
    if kept is not None and isinstance(output, torch.Tensor):
        kept.keep(module, output)


class graph_call:  # noqa: N801 (used as a function: ``with graph_call(...):``)
    """A call in the block whose norms tell ``record`` where their scales' nodes are (a recording call), or in which
    the modules whose ids are in ``plain`` have their rules put on the graph by the call's plan (a later call); the
    nodes of the norms' outputs are appended to ``outputs``, ``kept`` keeps the outputs of modules with a rule
    (see :class:`KeptOutputs`), and the calls of the modules the function modes pause in are noted in ``regions``
    (see :func:`note_region`).

    A class rather than a generator: it wraps every call that records or follows a plan, and its state is put back
    by ``__exit__`` alone (a generator's ``finally``, an interrupt could skip).
    """

    def __init__(
        self,
        record: Any = None,
        plain: Collection[int] = (),
        outputs: list | None = None,
        kept: KeptOutputs | None = None,
        regions: list | None = None,
    ) -> None:
        self._state = record, plain, outputs, kept, regions

    def __enter__(self) -> None:
        local = _LOCAL
        self._before = recording(), getattr(local, "plain", None), getattr(local, "outputs", None)
        self._before += (getattr(local, "kept", None), getattr(local, "regions", None))
        local.recording, local.plain, local.outputs, local.kept, local.regions = self._state

    def __exit__(self, *exc_info: object) -> None:
        # As they were: a wrapper called inside another one's model leaves the outer call's state.
        _LOCAL.recording, _LOCAL.plain, _LOCAL.outputs, _LOCAL.kept, _LOCAL.regions = self._before
