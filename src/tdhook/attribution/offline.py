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

import torch
from tensordict import TensorDict, TensorDictBase

from tdhook.attribution.lrp import LRP

__all__ = ["DONE_KEY", "explain_offline"]


#: the key of the output's per-row mask of rows already explained.
DONE_KEY = "explained"


def _storage(source):
    storage = getattr(source, "storage", None)
    if storage is None:
        raise TypeError(f"explain_offline reads a TensorDict or a torchrl ReplayBuffer, got {type(source).__name__}")
    return storage


def _source_length(source) -> int:
    """The number of rows: the size of the first batch dimension (of a replay buffer's filled storage)."""
    if isinstance(source, TensorDictBase):
        if not source.batch_dims:
            raise ValueError("explain_offline needs a source with at least one batch dimension, got batch_size []")
        return source.batch_size[0]
    shape = getattr(_storage(source), "shape", None)
    # A storage with several dimensions ([N, T] for ndim=2) holds len(buffer) = N * T elements in N rows.
    return int(shape[0]) if shape is not None and len(shape) else len(source)


def _rows(source, start: int, stop: int) -> TensorDictBase:
    """Rows ``start:stop`` of a TensorDict or a torchrl replay buffer's storage, loaded in memory."""
    if isinstance(source, TensorDictBase):
        return source[start:stop].to_tensordict()
    return _storage(source)[start:stop].to_tensordict()


def _missing_runs(done: torch.Tensor | None, start: int, stop: int, batch_size: int) -> list[tuple[int, int]]:
    """The ``begin:end`` batches, at most ``batch_size`` rows each, covering the rows of ``start:stop`` not done."""
    if done is None:
        missing = torch.ones(stop - start, dtype=torch.bool)
    else:
        missing = ~done[start:stop].reshape(stop - start, -1).all(-1)
    runs, begin = [], None
    for offset, row_missing in enumerate([*missing.tolist(), False]):
        row = start + offset
        if row_missing and begin is None:
            begin = row
        if begin is not None and (not row_missing or row - begin == batch_size):
            runs.append((begin, row))
            begin = row if row_missing else None
    return runs


def _check_output(output: TensorDictBase, relevance: TensorDictBase, prefix: Path, length: int) -> None:
    """Refuse an output at ``prefix`` that is not this explanation's: other keys, shapes, dtypes or length."""
    expected = {key: (tuple(value.shape[1:]), value.dtype) for key, value in relevance.items(True, True)}
    expected[DONE_KEY] = (tuple(relevance.batch_size[1:]), torch.bool)
    found = {key: (tuple(value.shape[1:]), value.dtype) for key, value in output.items(True, True)}
    if found != expected or output.batch_size[0] != length:
        raise ValueError(
            f"explain_offline: {str(prefix)!r} already holds another memory-mapped TensorDict "
            f"({output.batch_size[0]} rows, entries {found}); this explanation writes {length} rows with entries "
            f"{expected}: choose another prefix, or delete that one"
        )


def _progress_bar(total: int, show: bool):
    try:
        from tqdm import tqdm  # the plain bar: tqdm.auto warns in notebooks without ipywidgets
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
        source: a TensorDict (memory-mapped or not) of any batch shape, or a torchrl ``ReplayBuffer``
            (its storage in storage order, a two-dimensional ``[N, T]`` storage included); rows are taken
            along the first batch dimension.
        prefix: folder of the output memory-mapped TensorDict, reopened with
            ``TensorDict.load_memmap(prefix)``. Created on first use; an existing
            one of the right length is written into.
        batch_size: rows per LRP call.
        start, stop: the rows to explain (all by default).
        progress: show a tqdm progress bar.

    Returns:
        The memory-mapped TensorDict of relevance, with the source's length, and at ``"explained"`` a boolean
        mask of the rows written so far. A row is marked once its relevance is on disk, so an interrupted run
        is visibly incomplete (``~out["explained"]``) and running it again explains only the rows not marked.

    Raises:
        ValueError: ``prefix`` holds a memory-mapped TensorDict that is not this explanation's output (other
            keys, shapes, dtypes or number of rows), naming it.

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
        ...     out.is_memmap(), out["relevance", "observation"].shape, bool(out["explained"].all())
        (True, torch.Size([10, 3]), True)
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
    if output is not None and DONE_KEY not in output.keys():
        raise ValueError(
            f"explain_offline: {str(prefix)!r} already holds a memory-mapped TensorDict that explain_offline did not "
            f"write (it has no {DONE_KEY!r} mask); choose another prefix, or delete that one"
        )
    done = output.get(DONE_KEY) if output is not None else None
    runs = _missing_runs(done, start, stop, batch_size)
    checked = False
    with lrp, _progress_bar(sum(end - begin for begin, end in runs), progress) as bar:
        for begin, end in runs:
            relevance = lrp(_rows(source, begin, end)).select(*lrp.relevance_keys)
            if output is None:
                output = _create(relevance, length, prefix)
            if not checked:
                _check_output(output, relevance, prefix, length)
                checked = True
            output[begin:end] = relevance.set(DONE_KEY, torch.ones(relevance.batch_size, dtype=torch.bool))
            bar.update(end - begin)
    if output is None:  # nothing to explain: still leave a valid output behind (every row marked not done)
        with lrp:
            relevance = lrp(_rows(source, 0, 1)).select(*lrp.relevance_keys)
        output = _create(relevance, length, prefix)
    elif not checked:
        with lrp:
            _check_output(output, lrp(_rows(source, 0, 1)).select(*lrp.relevance_keys), prefix, length)
    return output


def _create(relevance: TensorDictBase, length: int, prefix: Path) -> TensorDictBase:
    """Files of the full length with a mask of the rows done, all False, created without materialising them."""
    template = relevance[:1].clone().set(DONE_KEY, torch.zeros((1, *relevance.batch_size[1:]), dtype=torch.bool))
    output = template.expand(length, *relevance.batch_size[1:]).memmap_like(prefix)
    output.get(DONE_KEY).fill_(False)
    return output
