"""explain_offline under ``torch.distributed``: which rank explains which batches, and waiting for the others."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["barrier", "process_group", "shard_runs"]


def process_group(distributed: bool | None) -> tuple[int, int] | None:
    """``(rank, world_size)`` of the default process group when explain_offline shards its rows, else None.

    Args:
        distributed: None shards when a process group is initialised; True requires one; False never shards.

    Raises:
        RuntimeError: ``distributed=True`` and no process group is initialised.
    """
    initialised = dist.is_available() and dist.is_initialized()
    if distributed and not initialised:
        raise RuntimeError(
            "explain_offline(distributed=True) needs an initialised torch.distributed process group: call "
            "torch.distributed.init_process_group() first (torchrun sets up its environment), or pass distributed=None"
        )
    if distributed is False or not initialised:
        return None
    return dist.get_rank(), dist.get_world_size()


def shard_runs(runs: list[tuple[int, int]], rank: int, world_size: int) -> list[tuple[int, int]]:
    """The batches of ``runs`` that ``rank`` explains: a contiguous share, balanced by rows.

    Batches are never split, so every rank calls the model on exactly the batches a single process would call
    it on, and the result is the same bit for bit. A batch goes to the rank whose share of the rows holds the
    batch's middle row; with fewer batches than ranks, some ranks have nothing to do.

    Examples:
        >>> runs = [(0, 8), (8, 16), (16, 24), (24, 32), (32, 36)]
        >>> shard_runs(runs, 0, 2), shard_runs(runs, 1, 2)
        ([(0, 8), (8, 16)], [(16, 24), (24, 32), (32, 36)])
    """
    total = sum(end - begin for begin, end in runs)
    mine, before = [], 0
    for begin, end in runs:
        # The middle row is before + (end - begin) / 2; its rank is middle * world_size // total, in integers.
        if (2 * before + end - begin) * world_size // (2 * total) == rank:
            mine.append((begin, end))
        before += end - begin
    return mine


def barrier() -> None:
    """Wait until every rank of the default process group gets here."""
    dist.barrier()
