"""Explain a whole replay buffer or memory-mapped TensorDict, batch by batch.

Relevance is written to memory-mapped files beside the data, one batch at a
time, so memory stays that of one batch however large the source is.

When one machine is not enough, split the rows across processes or GPUs with
``torch.distributed``: every rank explains its own ``start:stop`` slice into
the same ``prefix``, after rank 0 has created the output files::

    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        explain_offline(lrp, source, prefix, start=0, stop=0)  # creates the files only
    dist.barrier()
    rows = -(-len(source) // world)
    explain_offline(lrp, source, prefix, start=min(rank * rows, len(source)),
                    stop=min((rank + 1) * rows, len(source)))

Each rank moves its copy of the model to its own device beforehand.
"""

from __future__ import annotations

from pathlib import Path

from tensordict import TensorDict, TensorDictBase

from tdhook.attribution.lrp import LRP

__all__ = ["explain_offline"]


def _source_length(source) -> int:
    if isinstance(source, TensorDictBase):
        if not source.batch_dims:
            raise ValueError("explain_offline needs a source with at least one batch dimension, got batch_size []")
        return source.batch_size[0]
    return len(source)


def _rows(source, start: int, stop: int) -> TensorDictBase:
    """Rows ``start:stop`` of a TensorDict or a torchrl replay buffer's storage, loaded in memory."""
    if isinstance(source, TensorDictBase):
        return source[start:stop].to_tensordict()
    storage = getattr(source, "storage", None)
    if storage is None:
        raise TypeError(f"explain_offline reads a TensorDict or a torchrl ReplayBuffer, got {type(source).__name__}")
    return storage[start:stop].to_tensordict()


def _progress_bar(total: int, show: bool):
    try:
        from tqdm.auto import tqdm
    except ImportError as err:
        if show:
            raise ImportError(
                "explain_offline's progress bar needs tqdm: pip install tqdm, or pass progress=False"
            ) from err
        from contextlib import nullcontext

        class _Silent:
            def update(self, n: int) -> None:
                pass

        return nullcontext(_Silent())
    return tqdm(total=total, disable=not show, desc="LRP", unit="row")


def explain_offline(
    lrp: LRP,
    source,
    prefix: str | Path,
    *,
    batch_size: int = 256,
    start: int = 0,
    stop: int | None = None,
    progress: bool = True,
) -> TensorDictBase:
    """Run ``lrp`` over ``source`` in batches and store its relevance keys in memory-mapped files.

    Args:
        lrp: the LRP wrapper (its rules are registered once for the whole pass).
        source: a TensorDict (memory-mapped or not) or a torchrl ``ReplayBuffer``;
            rows are taken along its first batch dimension.
        prefix: folder of the output memory-mapped TensorDict, reopened with
            ``TensorDict.load_memmap(prefix)``. Created on first use; an existing
            one of the right length is written into.
        batch_size: rows per LRP call.
        start, stop: the rows to explain (all by default).
        progress: show a tqdm progress bar.

    Returns:
        The memory-mapped TensorDict of relevance, with the source's length.

    Examples:
        >>> import tempfile
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tdhook.attribution import LRP
        >>> net = torch.nn.Linear(3, 2)
        >>> lrp = LRP(net, in_keys=["observation"], out_keys=["action_value"])
        >>> data = TensorDict(observation=torch.randn(10, 3), batch_size=[10])
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     out = explain_offline(lrp, data, folder, batch_size=4, progress=False)
        ...     out.is_memmap(), out["relevance", "observation"].shape
        (True, torch.Size([10, 3]))
    """
    length = _source_length(source)
    stop = length if stop is None else stop
    if not 0 <= start <= stop <= length:
        raise ValueError(f"explain_offline: rows {start}:{stop} are not within the source's {length} rows")
    if batch_size < 1:
        raise ValueError(f"explain_offline: batch_size must be positive, got {batch_size}")
    prefix = Path(prefix)
    output = TensorDict.load_memmap(prefix) if (prefix / "meta.json").exists() else None
    if output is not None and output.batch_size[0] != length:
        raise ValueError(
            f"explain_offline: the output at {str(prefix)!r} has {output.batch_size[0]} rows, the source {length}"
        )
    with lrp, _progress_bar(stop - start, progress) as bar:
        for begin in range(start, stop, batch_size):
            end = min(begin + batch_size, stop)
            batch = _rows(source, begin, end)
            relevance = lrp(batch).select(*lrp.relevance_keys)
            if output is None:
                # Files of the full length, created without materialising them in memory.
                output = relevance[:1].expand(length, *relevance.batch_size[1:]).memmap_like(prefix)
            output[begin:end] = relevance
            bar.update(end - begin)
    if output is None:  # nothing to explain: still leave a valid (empty) output behind
        with lrp:
            relevance = lrp(_rows(source, 0, 1)).select(*lrp.relevance_keys)
        output = relevance.expand(length, *relevance.batch_size[1:]).memmap_like(prefix)
    return output
