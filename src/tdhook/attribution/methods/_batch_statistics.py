"""Modules that normalise with the statistics of the batch they see (BatchNorm in training mode).

A method that stacks perturbed copies of the batch in one forward pass would
normalise every copy with the statistics of all of them, a function other than
the model's on one batch; such models get one copy per pass. Every pass
would also move the running statistics, which some layers normalise with in
training mode (torchrl's ``BatchRenorm1d``): every perturbed pass starts from
the statistics the caller left (not those the unperturbed pass moved), and
the call leaves the model as one plain forward pass on the caller's input does.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    >>> batch_normalisers(dict(net.named_modules())), batch_normalisers(dict(net.eval().named_modules()))
    (['1'], [])
    >>> with buffers_kept(net.train()):
    ...     _ = net(torch.randn(4, 2))
    >>> int(net[1].num_batches_tracked)
    0
"""

from __future__ import annotations

import contextlib
import itertools
import operator
from collections.abc import Iterator, Mapping
from types import TracebackType

import torch
from torch import nn
from torch.nn.parameter import UninitializedTensorMixin
from torchrl.modules import BatchRenorm1d

__all__ = ["BufferHolders", "BufferValues", "batch_normalisers", "buffers_kept", "buffers_restored_on_error"]


def batch_normalisers(modules: Mapping[str, nn.Module]) -> list[str]:
    """The names of the modules that normalise with the statistics of the batch they are given.

    A BatchNorm does in training mode, or in eval mode without running
    statistics; torchrl's ``BatchRenorm1d`` does in training mode.
    """
    names = []
    for name, module in modules.items():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            if module.training or module.running_mean is None or module.running_var is None:
                names.append(name)
        elif isinstance(module, BatchRenorm1d) and module.training:
            names.append(name)
    return names


_CHILDREN, _BUFFERS = operator.attrgetter("_modules"), operator.attrgetter("_buffers")
# A TorchScript module keeps its children in a mapping of its own, not a dict: its own ``values`` reads both.
_VALUES = operator.methodcaller("values")
_chained = itertools.chain.from_iterable


def _children(modules: list[nn.Module]) -> list[nn.Module | None]:
    """The children of each of ``modules``, in a row."""
    try:
        return [*_chained(map(dict.values, map(_CHILDREN, modules)))]
    except TypeError:  # a TorchScript module's mapping: dict.values, the fast way for the others, refuses it
        return [*_chained(map(_VALUES, map(_CHILDREN, modules)))]


class BufferHolders:
    """The modules of a model that hold buffers, found again only where the model's structure changed since.

    Walking every module of a model for its buffers on every call costs a few microseconds per module; a call
    checks instead, in a few C-level passes over the modules found last time, that each still has the same
    children (the same objects) and the same number of buffers, and walks the model again where one differs (a
    module put in, replaced or removed anywhere, by any means, a buffer registered or deleted). Which of the
    holders are in training mode, and their buffers, are read on every call.

    After each :meth:`of`, :attr:`checked` holds what it found (the model, its modules and their children in a
    row, as they are at that moment) until :meth:`take_checked` takes it: another check of the same structure in
    the same call reads it instead of passing over the modules again (see ``tdhook.attribution._model_changes``).

    Examples:
        >>> net = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
        >>> holders = BufferHolders()
        >>> holders.of(net) == [net[1]]
        True
        >>> _ = net.append(nn.BatchNorm1d(3))
        >>> holders.of(net) == [net[1], net[2]]
        True
    """

    def __init__(self) -> None:
        self._found: tuple[nn.Module, list[nn.Module], list[nn.Module | None], list[nn.Module], list] | None = None
        self.checked: tuple | None = None

    def take_checked(self) -> tuple | None:
        """What the last :meth:`of` found, once: ``None`` where it was taken already (a check of an earlier call
        says nothing about the model now)."""
        checked, self.checked = self.checked, None
        return checked

    def of(self, model: nn.Module) -> list[nn.Module]:
        """The modules of ``model`` (itself included) that hold at least one buffer."""
        found = self._found
        if found is not None and found[0] is model:
            _, modules, children, holders, others = found
            # Every module's children, in a row: unchanged, they are the modules found (the root aside), and no
            # other module is reached; the modules that held no buffer still hold none.
            if not any(map(_BUFFERS, others)) and _children(modules) == children:
                self.checked = found
                return holders
        modules = list(model.modules())
        children = _children(modules)
        holders = [module for module in modules if module._buffers]
        others = [module for module in modules if not module._buffers]
        # One tuple: an interrupt leaves the last one whole.
        self._found = self.checked = (model, modules, children, holders, others)
        return holders

    def modules(self, model: nn.Module) -> list[nn.Module]:
        """The modules of ``model`` (itself first) that the last :meth:`of` found, for a step of the same call."""
        found = self._found
        return found[1] if found is not None and found[0] is model else list(model.modules())

    def __reduce__(self) -> tuple:
        return BufferHolders, ()  # a copy finds its model's modules again


def _training_buffers(
    model: nn.Module, holders: BufferHolders | None = None
) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """The buffers of ``model``'s modules in training mode, the only ones a forward pass updates (found by
    ``holders`` where given); not those still uninitialized (a lazy module's, torchrl's ``CatFrames``' frame buffer,
    which its offline forward never fills): they hold no value to keep."""
    return [
        (module, name, buffer)
        for module in (model.modules() if holders is None else holders.of(model))
        if module.training
        for name, buffer in module._buffers.items()
        if isinstance(buffer, torch.Tensor) and not isinstance(buffer, UninitializedTensorMixin)
    ]


class BufferValues:
    """The values of the buffers of a model's modules in training mode, as they were at one moment.

    A method takes them before the model's own pass (which moves running statistics) and runs every perturbed
    pass from them, as the caller left the model, and puts them back where the call fails.

    Examples:
        >>> norm = nn.BatchNorm1d(2)
        >>> before = BufferValues(norm)
        >>> _ = norm(torch.randn(4, 2))
        >>> before.restore()
        >>> int(norm.num_batches_tracked)
        0
    """

    def __init__(self, model: nn.Module, holders: BufferHolders | None = None) -> None:
        kept = _training_buffers(model, holders)
        self._kept = {(module, name): (buffer, buffer.clone(), _version(buffer)) for module, name, buffer in kept}

    def value(self, module: nn.Module, name: str, default: torch.Tensor) -> torch.Tensor:
        """The value the buffer ``name`` of ``module`` had (``default`` for one that was not kept)."""
        kept = self._kept.get((module, name))
        return default if kept is None else kept[1]

    def restore(self) -> None:
        """Give every kept buffer its value back, in its own place in its module (where a :func:`buffers_kept`
        was stopped before it put it back), and its version counter: a graph of the caller's that saved the buffer
        (batch norm's backward in training mode saves the running statistics) checks it when it runs backward, and
        the buffer then holds the values it saved. The values are written through ``.data``, which moves no version
        counter (as torch's batch norm moves its running statistics), and a counter the model's own in-place writes
        moved (a batch counter's ``+= 1``) is set back. A buffer that holds its value still (a call that failed
        before the model ran) is left as it is."""
        with torch.no_grad():
            for (module, name), (buffer, value, version) in self._kept.items():
                module._buffers[name] = buffer
                if buffer.is_meta or not torch.equal(buffer, value):  # a meta tensor holds no value to compare
                    buffer.data.copy_(value)
                if version is not None and buffer._version != version:
                    torch._C._autograd._unsafe_set_version_counter((buffer,), (version,))


def _version(tensor: torch.Tensor) -> int | None:
    """The version counter of ``tensor`` (``None`` for an inference tensor, which has none)."""
    return None if tensor.is_inference() else tensor._version


class _RestoredOnError:
    """Puts ``values`` back where the block raises (a class, not a generator: entered on every call)."""

    __slots__ = ("values",)

    def __init__(self, values: BufferValues) -> None:
        self.values = values

    def __enter__(self) -> BufferValues:
        return self.values

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if kind is not None:
            self.values.restore()


_NOTHING_KEPT = _RestoredOnError(BufferValues(nn.Module().eval()))  # no module in training mode holds a buffer


def buffers_restored_on_error(
    model: nn.Module, holders: BufferHolders | None = None
) -> contextlib.AbstractContextManager[BufferValues]:
    """Give the buffers of ``model``'s modules in training mode their values back if the block raises (and their
    places in the modules, where a :func:`buffers_kept` inside was stopped before it put them back).

    Args:
        model: the model.
        holders: where given, finds the modules that hold buffers (once per structure of the model: see
            :class:`BufferHolders`); else every module is looked at.

    Returns:
        A context manager that yields the values the buffers had on entry, for :func:`buffers_kept` to start
        passes from (a shared one that keeps nothing where no module in training mode holds a buffer).

    Examples:
        >>> norm = nn.BatchNorm1d(2)
        >>> try:
        ...     with buffers_restored_on_error(norm):
        ...         _ = norm(torch.randn(4, 2))
        ...         raise RuntimeError("a later step failed")
        ... except RuntimeError:
        ...     pass
        >>> int(norm.num_batches_tracked)
        0
    """
    before = BufferValues(model, holders)
    return _RestoredOnError(before) if before._kept else _NOTHING_KEPT


@contextlib.contextmanager
def buffers_kept(model: nn.Module, start: BufferValues | None = None) -> Iterator[None]:
    """Run the block on copies of the buffers of ``model``'s modules in training mode, and put the originals back.

    Modules in eval mode do not update their buffers; those in training mode
    (running statistics, batch counters) update copies, which a backward pass
    may still read, and get their own buffers back, untouched, on the way out
    (by error or not).

    Args:
        model: the model.
        start: the values the copies start from (the caller's, taken before a pass that moved the buffers);
            ``None``: the buffers' current values.

    Examples:
        >>> norm = nn.BatchNorm1d(2)
        >>> before = BufferValues(norm)
        >>> _ = norm(torch.randn(4, 2))  # the model's own pass
        >>> with buffers_kept(norm, before):  # a pass as if the first had not run
        ...     int(norm.num_batches_tracked)
        0
        >>> int(norm.num_batches_tracked)
        1
    """
    kept = _training_buffers(model)
    try:
        for module, name, buffer in kept:
            module._buffers[name] = (buffer if start is None else start.value(module, name, buffer)).clone()
        yield
    finally:
        for module, name, buffer in kept:
            module._buffers[name] = buffer
