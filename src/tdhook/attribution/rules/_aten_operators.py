"""The ATen operators of a name, as the function modes see them called through ``torch.ops.aten``."""

from __future__ import annotations

import torch

__all__ = ["aten_operators"]


def aten_operators(*names: str) -> frozenset:
    """The ATen operators ``torch.ops.aten.<name>`` of each of ``names``, as packets and as each of their overloads.

    Examples:
        >>> ops = aten_operators("gather")
        >>> torch.ops.aten.gather in ops, torch.ops.aten.gather.default in ops
        (True, True)
    """
    packets = [getattr(torch.ops.aten, name) for name in names]
    return frozenset(op for packet in packets for op in (packet, *(getattr(packet, o) for o in packet.overloads())))
