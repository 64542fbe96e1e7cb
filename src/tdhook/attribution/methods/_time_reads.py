"""Recurrent layers that read the batch's first dimension as time, where copies of the batch stacked in one pass
would run as one sequence.

The methods and the metrics stack perturbed copies of a batch along its first dimension and run them in one pass. A
torch ``nn.RNN``, ``nn.LSTM`` or ``nn.GRU`` reads the first dimension of its input as time where the input is
unbatched (``[L, F]``) or ``batch_first=False``: where that dimension is the batch's (a ``[T]`` TensorDict of one
trajectory fed to a plain GRU), ``S`` stacked copies run as one sequence ``S`` times longer, each copy starting from
the state the one before it left, and every copy but the first is explained as another input. The time lengths each
recurrent layer sees in the model's own pass are recorded (:func:`time_lengths`); a stacked pass that gives one of
them a length the model's own pass did not give it read the copies as one sequence, and is run again one copy per
pass, as the model on one batch runs.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> gru = nn.GRU(3, 4)
    >>> layers = recurrent_layers(dict(nn.Sequential(gru).named_modules()))
    >>> with time_lengths(layers) as own:
    ...     _ = gru(torch.randn(6, 3))  # a trajectory of 6 steps, unbatched
    >>> with time_lengths(layers) as stacked:
    ...     _ = gru(torch.randn(12, 3))  # two copies of it, stacked along the first dimension
    >>> sorted(own), read_as_one_sequence(own, stacked)
    ([('0', 6)], True)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

__all__ = ["read_as_one_sequence", "recurrent_layers", "time_lengths"]


def recurrent_layers(modules: Mapping[str, nn.Module]) -> dict[str, nn.Module]:
    """The recurrent layers (``nn.RNN``, ``nn.LSTM``, ``nn.GRU`` and their subclasses, torchrl's own included) among
    ``modules``, by name."""
    return {name: module for name, module in modules.items() if isinstance(module, nn.RNNBase)}


def _time_length(layer: nn.RNNBase, x: object) -> int | None:
    """The length of the time dimension of ``x``, the input of ``layer``."""
    if isinstance(x, PackedSequence):
        return len(x.batch_sizes)
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        return None
    return x.shape[1] if x.dim() > 2 and layer.batch_first else x.shape[0]


def _record(seen: set, name: str, layer: nn.Module, args: tuple, kwargs: dict) -> None:
    seen.add((name, _time_length(layer, args[0] if args else kwargs.get("input"))))


@contextlib.contextmanager
def time_lengths(layers: Mapping[str, nn.Module]) -> Iterator[set[tuple[str, int | None]]]:
    """The ``(name, time length)`` of every input the recurrent ``layers`` get in the block, gathered in the set
    yielded (forward pre-hooks, removed on the way out, by error or not; nothing where ``layers`` is empty)."""
    seen: set[tuple[str, int | None]] = set()
    handles = []
    try:
        for name, layer in layers.items():  # each listed as it is made: a registration that fails leaves none
            handles.append(layer.register_forward_pre_hook(functools.partial(_record, seen, name), with_kwargs=True))
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def read_as_one_sequence(own: set, stacked: set) -> bool:
    """Whether a pass of stacked copies gave a recurrent layer a time length (``stacked``) that the model's own pass
    on one batch (``own``) did not give it: the layer read the copies as one sequence."""
    return not stacked <= own
