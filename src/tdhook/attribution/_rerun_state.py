"""What a call that runs the model twice must put back in between: the buffers the run let go wrote.

A later call of a context first runs the model without the function mode, on the plan recorded for its inputs'
signature; where its graph is not the recorded one, it runs the model again, in the mode (see
:mod:`~tdhook.attribution._model_run`). A module that writes a buffer in its forward (a BatchNorm in training mode
moving its running statistics, a module counting its calls or keeping a running mean of its own) would write it once
more than the plain call does. :class:`ModelBuffers` keeps, before the first run, the values of the running
statistics of the norms in training mode and of every buffer a forward of the model was seen to write (every
buffer, in a call that records a plan), and puts them back before the second. A buffer the run let go wrote with no
value kept (a branch that no earlier call took) cannot be put back: the call warns, naming it, and later calls keep
it. The global random state (CPU, and the CUDA devices of the model) is kept too: the second run draws what the
first drew (a policy's sampled action, a dropout mask), and the caller's state moves as by one plain call. State a
module holds in Python attributes (``self.calls += 1`` on an int) is beyond reach: it moves twice in such a call.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> norm = nn.BatchNorm1d(3)
    >>> buffers = ModelBuffers(norm)
    >>> kept = buffers.keep()
    >>> _ = norm(torch.randn(4, 3))  # the discarded run
    >>> buffers.put_back(kept)
    >>> int(norm.num_batches_tracked), bool(norm.running_mean.eq(0).all())
    (0, True)
    >>> kept = buffers.keep()
    >>> drawn = torch.rand(2)  # in the discarded run
    >>> buffers.put_back(kept)
    >>> torch.equal(torch.rand(2), drawn)  # the run again draws the same
    True
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.parameter import is_lazy

from tdhook.attribution.methods._global_rng import cuda_devices
from tdhook.attribution.rules._caller import warn_at_caller

__all__ = ["KeptBuffers", "ModelBuffers", "moving_norms", "put_back", "training_statistics"]


def moving_norms(model: nn.Module) -> list[nn.Module]:
    """The normalisations of ``model`` that keep running statistics (BatchNorm, and InstanceNorm with
    ``track_running_stats``): those a run in training mode moves."""
    return [module for module in model.modules() if isinstance(module, _NormBase) and module.track_running_stats]


def training_statistics(norms: Iterable[nn.Module]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each running statistic of the ``norms`` in training mode, with a copy of its values now (none of a lazy norm
    not yet run, whose statistics hold no values)."""
    return [
        (buffer, buffer.clone())
        for norm in norms
        if norm.training
        for buffer in (norm.running_mean, norm.running_var, norm.num_batches_tracked)
        if buffer is not None and not is_lazy(buffer)
    ]


def put_back(kept: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Write the kept values back into their running statistics."""
    with torch.no_grad():
        for buffer, value in kept:
            buffer.copy_(value)


@dataclass
class _Slot:
    """One buffer before a run: where it is held, the tensor, its version, and a copy of its values (or ``None``)."""

    path: str
    module: nn.Module
    name: str
    buffer: torch.Tensor
    version: int
    value: torch.Tensor | None

    def changed(self) -> bool:
        """Whether a run wrote the buffer in place, or put another tensor in its place."""
        return self.module._buffers.get(self.name) is not self.buffer or self.buffer._version != self.version


@dataclass
class KeptBuffers:
    """What :meth:`ModelBuffers.keep` took: the norms' running statistics with their values, every buffer, and the
    global random states (CPU, a copy of its generator; then each CUDA device's of ``devices``)."""

    statistics: list[tuple[torch.Tensor, torch.Tensor]]
    slots: list[_Slot]
    random: torch.Generator
    cuda_random: list[torch.Tensor]
    devices: list[int]


class ModelBuffers:
    """The buffers of one context's model, and those a forward of it was seen to write."""

    def __init__(self, model: nn.Module) -> None:
        self.norms = moving_norms(model)
        self.devices = cuda_devices(model)  # whose random states a run may move
        self._slots = [
            (f"{prefix}.{name}" if prefix else name, module, name)
            for prefix, module in model.named_modules()
            for name, buffer in module._buffers.items()
            if buffer is not None
        ]
        self._written: set[tuple[int, str]] = set()

    def keep(self, every: bool = False) -> KeptBuffers:
        """Before a run that may be let go: the norms' running statistics in training mode with their values, and
        each other buffer with its version, and its values where a forward was seen to write it (or ``every``)."""
        statistics = training_statistics(self.norms)
        held = {id(buffer) for buffer, _ in statistics}
        slots = []
        for path, module, name in self._slots:
            buffer = module._buffers.get(name)
            if buffer is None or id(buffer) in held or is_lazy(buffer):
                continue
            value = buffer.clone() if every or (id(module), name) in self._written else None
            slots.append(_Slot(path, module, name, buffer, buffer._version, value))
        cuda_random = [torch.cuda.get_rng_state(device) for device in self.devices]
        # A copy of the generator, not its state as a tensor: several times cheaper where the run draws nothing
        return KeptBuffers(statistics, slots, torch.default_generator.clone_state(), cuda_random, self.devices)

    def note(self, kept: KeptBuffers) -> None:
        """After a run that was kept: the buffers it wrote are kept with their values before later runs."""
        self._written.update((id(slot.module), slot.name) for slot in kept.slots if slot.changed())

    def put_back(self, kept: KeptBuffers) -> None:
        """Before the run again: every buffer, and the random states, as they were before the run let go; a warning
        naming the buffers whose values were not kept."""
        put_back(kept.statistics)
        torch.default_generator.set_state(kept.random.get_state())
        for device, state in zip(kept.devices, kept.cuda_random, strict=True):
            torch.cuda.set_rng_state(state, device)
        lost = []
        for slot in kept.slots:
            if not slot.changed():
                continue
            self._written.add((id(slot.module), slot.name))
            slot.module._buffers[slot.name] = slot.buffer  # where the run put another tensor in its place
            if slot.buffer._version == slot.version:
                continue
            if slot.value is None:
                lost.append(slot.path)
            else:
                with torch.no_grad():
                    slot.buffer.copy_(slot.value)
        if lost:
            warn_at_caller(
                f"LRP: this call ran the model twice (its graph was not one recorded for its inputs), and the "
                f"run let go wrote the buffers {', '.join(map(repr, lost))} in place, which no earlier call wrote: "
                "their values could not be put back, and they moved twice in this call. Later calls keep them"
            )
