"""Explain a whole replay buffer or memory-mapped TensorDict, batch by batch.

Relevance (of LRP, or the attribution of any method of
:mod:`tdhook.attribution.methods`) is written to memory-mapped files beside
the data, one batch at a time, so memory stays that of one batch however
large the source is.

Under ``torch.distributed`` (a script run by ``torchrun``, any backend), the same
call shares the rows among the ranks by itself: rank 0 creates the output files,
every rank explains its own contiguous share of the batches into them, and the
call returns on every rank once all rows are written. The batches are those a
single process would run, so the result is the same bit for bit::

    torch.distributed.init_process_group()  # torchrun --nproc_per_node=2 explain.py
    out = explain_offline(lrp, source, prefix)  # this rank's rows, then everyone's

Each rank moves its copy of the model to its own device beforehand. Pass
``distributed=False`` to explain only ``start:stop`` on each rank as given.
See the "Offline attribution at scale" page of the documentation.
"""

from __future__ import annotations

import inspect
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
from tensordict import NestedKey, TensorDict, TensorDictBase
from tensordict.nn import ProbabilisticTensorDictModule
from tensordict.utils import unravel_key
from torchrl.data import ListStorage
from torchrl.modules import AdditiveGaussianModule, OrnsteinUhlenbeckProcessModule

from tdhook.attribution._explainer_records import (
    RECORD_FILE,
    check_record,
    explainer_record,
    keep_record,
    record_matches,
)
from tdhook.attribution._inputs import module_in_recurrent_mode
from tdhook.attribution._offline_shards import barrier, process_group, shard_runs
from tdhook.attribution._policy_targets import stored_rows
from tdhook.attribution._row_checksums import CHECKSUM_FILE, checksum_file, row_checksums
from tdhook.attribution.lrp import LRP
from tdhook.attribution.methods._base import AttributionMethod

__all__ = ["DONE_KEY", "drawn_action_keys", "explain_offline"]


#: the key of the output's per-row mask of rows already explained.
DONE_KEY = "explained"


def _storage(source):
    storage = getattr(source, "storage", None)
    if storage is None or inspect.isroutine(storage):  # a tensor's storage() is a method, not a replay buffer's
        raise TypeError(f"explain_offline reads a TensorDict or a torchrl ReplayBuffer, got {type(source).__name__}")
    return storage


def _source_length(source) -> int:
    """The number of rows: the size of the first batch dimension (of a replay buffer's filled storage)."""
    if isinstance(source, TensorDictBase):
        if not source.batch_dims:
            raise ValueError("explain_offline needs a source with at least one batch dimension, got batch_size []")
        return source.batch_size[0]
    storage = _storage(source)
    if isinstance(storage, ListStorage):  # its shape is its capacity, not what it holds
        return len(storage)
    shape = getattr(storage, "shape", None)
    # A storage with several dimensions ([N, T] for ndim=2) holds len(buffer) = N * T elements in N rows.
    return int(shape[0]) if shape is not None and len(shape) else len(source)


def _rows(source, start: int, stop: int) -> TensorDictBase:
    """Rows ``start:stop`` of a TensorDict or a torchrl replay buffer's storage, loaded in memory; a buffer's rows
    as its ``sample()`` hands them to a policy: its transform applied (to a copy: the storage is left as it is)."""
    if isinstance(source, TensorDictBase):
        return source[start:stop].to_tensordict()
    rows = _storage(source)[start:stop]
    if isinstance(rows, list):  # a ListStorage's entries, one TensorDict each
        rows = _stacked_entries(source, rows)
    rows = rows.to_tensordict()
    transform = getattr(source, "transform", None)
    if transform is not None and len(transform):
        with rows.unlock_():
            transformed = transform(rows)
        if transformed.batch_size[:1] != rows.batch_size[:1]:
            raise ValueError(
                f"explain_offline: the replay buffer's transform ({', '.join(type(t).__name__ for t in transform)}) "
                f"turns {rows.batch_size[0]} rows of its "
                f"storage into {transformed.batch_size[0]} (batch size {list(transformed.batch_size)}), so the "
                "relevance cannot be written row for row; explain the transformed rows as a TensorDict, or a buffer "
                "without that transform"
            )
        rows = transformed
    return rows


def _stacked_entries(source, entries: list) -> TensorDictBase:
    """The entries of a replay buffer's ``ListStorage`` stacked into rows: they must be TensorDicts."""
    other = next((entry for entry in entries if not isinstance(entry, TensorDictBase)), None)
    if other is not None:
        raise TypeError(
            f"explain_offline reads rows of TensorDicts; the replay buffer's {type(_storage(source)).__name__} "
            f"holds {type(other).__name__} entries. Extend the buffer with TensorDicts (a TensorDictReplayBuffer), "
            "or explain a TensorDict of the data"
        )
    try:
        return torch.stack(entries)
    except RuntimeError as err:  # entries of different batch sizes (trajectories of different lengths)
        shapes = sorted({tuple(entry.batch_size) for entry in entries})
        raise ValueError(
            f"explain_offline: the replay buffer's {type(_storage(source)).__name__} holds TensorDicts of different "
            f"batch sizes {[list(shape) for shape in shapes]}, which do not stack into rows; explain them one by one, "
            "or pad them to one length"
        ) from err


def _missing_runs(done: torch.Tensor | None, start: int, stop: int, batch_size: int) -> list[tuple[int, int]]:
    """The ``begin:end`` batches, at most ``batch_size`` rows each, covering the rows of ``start:stop`` not done.

    Each stretch of consecutive rows not done is cut into batches from its first row on.

    Examples:
        >>> done = torch.tensor([True, False, False, False, True, False, False])
        >>> _missing_runs(done, 0, 7, 2)
        [(1, 3), (3, 4), (5, 7)]
    """
    if done is None or stop == start:
        stretches = [(start, stop)] if stop > start else []
    else:
        missing = ~done[start:stop].as_subclass(torch.Tensor).reshape(stop - start, -1).all(-1)
        edge = torch.zeros(1, dtype=torch.int8)
        # +1 where a stretch of missing rows begins, -1 just after it ends
        changes = torch.cat([edge, missing.to(torch.int8), edge]).diff().nonzero().flatten().tolist()
        stretches = [(start + begin, start + end) for begin, end in zip(changes[::2], changes[1::2], strict=True)]
    return [
        (begin, min(begin + batch_size, end)) for first, end in stretches for begin in range(first, end, batch_size)
    ]


def _check_output(
    output: TensorDictBase, written: TensorDictBase, prefix: Path, length: int, record: dict[str, str]
) -> None:
    """Refuse an output at ``prefix`` that is not this explanation's: other keys, shapes, dtypes or length, or
    another explainer's record (see :mod:`~tdhook.attribution._explainer_records`)."""
    expected = {key: (tuple(value.shape[1:]), value.dtype) for key, value in written.items(True, True)}
    expected[DONE_KEY] = (tuple(written.batch_size[1:]), torch.bool)
    found = {key: (tuple(value.shape[1:]), value.dtype) for key, value in output.items(True, True)}
    if found != expected or output.batch_size[0] != length:
        raise ValueError(
            f"explain_offline: {str(prefix)!r} already holds another memory-mapped TensorDict "
            f"({output.batch_size[0]} rows, entries {found}); this explanation writes {length} rows with entries "
            f"{expected}: choose another prefix, or delete that one"
        )
    check_record(prefix, record)


def _progress_bar(total: int, show: bool):
    try:
        from tqdm import tqdm  # the plain bar: tqdm.auto warns in notebooks without ipywidgets
    except ImportError as err:
        if show:
            raise ImportError(
                "explain_offline's progress bar needs tqdm: pip install tqdm, or pass progress=False"
            ) from err

        class _Silent:
            def update(self, n: int) -> None:
                pass

        return nullcontext(_Silent())
    return tqdm(total=total, disable=not show, desc="LRP", unit="row")


def explain_offline(
    lrp: LRP | AttributionMethod,
    source,
    prefix: str | Path,
    *,
    batch_size: int = 256,
    start: int = 0,
    stop: int | None = None,
    progress: bool = True,
    distributed: bool | None = None,
) -> TensorDictBase:
    """Run ``lrp`` over ``source`` in batches and store its relevance keys in memory-mapped files.

    Args:
        lrp: the LRP wrapper (its rules are registered once for the whole pass; a context the caller opened
            already is used as it is, and left open; inside ``lrp.inactive()`` the rows get gradient × input), or
            an attribution method (``Saliency``, ``IntegratedGradients``, ``FeatureAblation``, ...), whose
            attribution keys are stored the same way.
        source: a TensorDict (memory-mapped or not) of any batch shape, or a torchrl ``ReplayBuffer``
            (its storage in storage order, a two-dimensional storage included, or a ``ListStorage`` of
            TensorDicts); rows are taken along the first batch dimension. A buffer's rows are explained as its
            ``sample()`` hands them to a policy: with its transform applied (an ``ObservationNorm``), to a
            copy. A two-dimensional storage extended along time (torchrl's default ``dim_extend``) holds time
            first; a policy with an ``LSTMModule`` or ``GRUModule`` in recurrent mode needs trajectories as rows
            (``buffer.storage[:].transpose(0, 1)``), and is refused that storage, or rows of one batch dimension
            (time steps, which batches would cut into sequences of their own), with a ``ValueError`` naming
            the module.
        prefix: folder of the output memory-mapped TensorDict, reopened with
            ``TensorDict.load_memmap(prefix)``. Created on first use; an existing
            one of the right length is written into.
        batch_size: rows per LRP call.
        start, stop: the rows to explain (all by default).
        progress: show a tqdm progress bar (of rank 0's rows under ``torch.distributed``).
        distributed: None (the default) shares the batches of ``start:stop`` among the ranks when a
            ``torch.distributed`` process group is initialised, and explains them all in this process
            otherwise; True requires a process group; False explains ``start:stop`` in this process only,
            for callers who share the rows out themselves. Every rank of the group must make the call, with
            the same arguments, and see the same ``prefix`` (on a file system shared by all nodes).

    Returns:
        The memory-mapped TensorDict of relevance, with the source's length, and at ``"explained"`` a boolean
        mask of the rows written so far. A row is marked once its relevance is on disk, so an interrupted run
        is visibly incomplete (``~out["explained"]``) and running it again explains only the rows not marked, and
        the rows marked whose data changed since they were explained (a checksum of each is kept beside the output).
        A policy that draws its action (a ``ProbabilisticActor``, a perturbing exploration step) has each row's
        action, and its log-probability where the actor returns one, written beside the relevance at the keys
        the policy writes them (see :func:`drawn_action_keys`): the action the row's relevance explains (a
        stored transition's, or the call's own draw under the exploration type in force), so that rows
        explained in different runs each keep the action of their own.

    Raises:
        ValueError: ``prefix`` holds a memory-mapped TensorDict that is not this explanation's output (other
            keys, shapes, dtypes or number of rows), naming it. Under ``torch.distributed`` every rank raises.
            An explainer that would store an entry at ``"explained"`` (``relevance_key="explained"``), the key of
            the output's mask. An output that another explanation wrote (another rule mapper, method or options,
            or the model's parameters changed since), kept in its folder's ``explainer.json``: its rows not done
            would be explained otherwise than those done.
            A source with no rows (an empty replay buffer), which leaves nothing to run the explanation on.
        RuntimeError: ``distributed=True`` without an initialised process group.

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
    if not isinstance(lrp, (LRP, AttributionMethod)):
        raise TypeError(
            "explain_offline runs an LRP wrapper over the rows, LRP(policy, rule_mapper), whose context it holds "
            "open for the whole pass, or an attribution method of tdhook.attribution (Saliency, IntegratedGradients, "
            f"...); got {type(lrp).__name__}"
        )
    _refuse_done_key_taken(lrp)
    _refuse_row_targets(lrp)
    _refuse_time_read_as_rows(lrp, source)
    length = _source_length(source)
    if not length:  # no row to run the explanation on, which sets the output's entries
        raise ValueError(f"explain_offline: the source ({type(source).__name__}) holds no rows to explain")
    stop = length if stop is None else stop
    if not 0 <= start <= stop <= length:
        raise ValueError(f"explain_offline: rows {start}:{stop} are not within the source's {length} rows")
    if batch_size < 1:
        raise ValueError(f"explain_offline: batch_size must be positive, got {batch_size}")
    prefix = Path(prefix)
    group = process_group(distributed)
    output = _existing_output(prefix, length)
    if group is not None:
        return _explain_sharded(lrp, source, prefix, output, length, range(start, stop), batch_size, progress, *group)
    # The rows done, but those changed since they were explained; nothing is written before the output is checked.
    done = None if output is None else _without_changed_rows(lrp, source, prefix, output, start, stop, batch_size)
    if output is not None:
        _unmark_changed_rows(lrp, prefix, output, done, range(start, stop))
    runs = _missing_runs(done, start, stop, batch_size)
    output, checked = _explain_runs(lrp, source, prefix, length, runs, output, False, progress, batch_size)
    if output is None:  # nothing to explain: still leave a valid output behind (every row marked not done)
        output = _create(_one_row_entries(lrp, source), length, prefix, explainer_record(lrp))
    elif not checked:
        _check_output(output, _one_row_entries(lrp, source), prefix, length, explainer_record(lrp))
    return output


def _refuse_done_key_taken(lrp: LRP | AttributionMethod) -> None:
    """The output keeps its mask of rows done at ``DONE_KEY``: an entry it stores there too (a ``relevance_key`` of
    that name, an action key) would clash with it, and the output could not be written."""
    for key in (*_explanation_keys(lrp), *drawn_action_keys(lrp.module)):
        if (key if isinstance(key, str) else key[0]) == DONE_KEY:
            option = "its relevance_key" if key in _explanation_keys(lrp) else "the key of an action it draws"
            raise ValueError(
                f"explain_offline: the output keeps its mask of the rows done at {DONE_KEY!r}, where "
                f"{type(lrp).__name__} would store {key!r} ({option}); name that key otherwise"
            )


def _refuse_row_targets(lrp: LRP | AttributionMethod) -> None:
    """A target tensor of unit indices is the target of one call's rows, which every batch would take as it is (not
    the rows of the source split into batches): the first batch's indices for each batch, or a shape no batch has."""
    target = getattr(lrp, "target", None)
    if isinstance(target, torch.Tensor) and target.dim() > 0:
        raise ValueError(
            f"explain_offline: target is a tensor of shape {tuple(target.shape)}, the targets of one call's rows, "
            "which every batch would take as it is (the source's rows are not split from it); a stored row of a "
            "policy explains the action it holds, or call the wrapper on the rows with their targets"
        )


def _refuse_time_read_as_rows(lrp: LRP | AttributionMethod, source) -> None:
    """A replay buffer whose storage has several dimensions and was extended along a later one (``dim_extend``,
    torchrl's default for ``ndim=2``: time) holds time first, so its rows are time steps of every environment;
    a torchrl LSTMModule or GRUModule in recurrent mode reads the last batch dimension as time and would run the
    environments as the steps of one trajectory. Rows of one batch dimension are themselves its time steps."""
    # Named as the rule mappers name modules (a method names them within its TensorDictModule).
    found = module_in_recurrent_mode(lrp.named_explained_modules()[""] if isinstance(lrp, LRP) else lrp.module)
    if found is None:
        return
    name = found[0]
    if _source_length(source) and _rows(source, 0, 1).batch_dims == 1:
        # Rows of one batch dimension are the time steps of one sequence: batches would cut it, each part
        # starting again from the stored or zero recurrent states, relevance through time to earlier parts lost.
        raise ValueError(
            f"explain_offline: the source's rows have one batch dimension, which {type(found[1]).__name__} "
            f"{name!r} in recurrent mode reads as time: each batch would be run as a sequence of its own. Pass "
            "the trajectory as one row, source.unsqueeze(0) (trajectories as rows, [N, T]), or explain step by "
            "step outside recurrent mode"
        )
    storage = getattr(source, "storage", None) if not isinstance(source, TensorDictBase) else None
    if storage is not None and getattr(storage, "ndim", 1) >= 2 and getattr(source, "dim_extend", 0):
        raise ValueError(
            f"explain_offline: the replay buffer's storage (shape {list(storage.shape)}) holds time first "
            f"(extended along dim_extend={source.dim_extend}), and {type(found[1]).__name__} {name!r} runs in "
            "recurrent mode, reading the last batch dimension as time: it would take the environments for "
            "time steps. Pass the trajectories as rows, buffer.storage[:].transpose(0, 1), or explain step "
            "by step outside recurrent mode with the recurrent states stored"
        )


def _existing_output(prefix: Path, length: int) -> TensorDictBase | None:
    """The output already at ``prefix``, refused if it has another length or is not explain_offline's (a folder of
    other files: an output is written into a new or empty folder)."""
    if not (prefix / "meta.json").exists():
        ours = {RECORD_FILE, CHECKSUM_FILE}  # written first: what a creation stopped early leaves
        others = sorted(entry.name for entry in prefix.iterdir() if entry.name not in ours) if prefix.is_dir() else []
        if others:
            raise ValueError(
                f"explain_offline: {str(prefix)!r} holds files that are not a memory-mapped TensorDict "
                f"({', '.join(others[:5])}{', ...' if len(others) > 5 else ''}); an output is written into a new or "
                "empty folder: choose another prefix"
            )
        return None
    try:
        output = TensorDict.load_memmap(prefix)
    except Exception as err:  # a meta.json of something else: tensordict's own error names neither
        raise ValueError(
            f"explain_offline: {str(prefix)!r} holds a meta.json that is not a memory-mapped TensorDict's "
            f"({type(err).__name__}: {err}); choose another prefix, or delete that one"
        ) from err
    if output is not None and output.batch_size[0] != length:
        raise ValueError(
            f"explain_offline: the output at {str(prefix)!r} has {output.batch_size[0]} rows, the source {length}; "
            "an output keeps the number of rows its source had at its first run (a replay buffer still filling "
            "has more at each epoch): explain the source into a new prefix, or a buffer once it is full"
        )
    if output is not None and DONE_KEY not in output.keys():
        raise ValueError(
            f"explain_offline: {str(prefix)!r} already holds a memory-mapped TensorDict that explain_offline did not "
            f"write (it has no {DONE_KEY!r} mask); choose another prefix, or delete that one"
        )
    return output


def _explain_runs(
    lrp: LRP | AttributionMethod,
    source,
    prefix: Path,
    length: int,
    runs: list[tuple[int, int]],
    output: TensorDictBase | None,
    checked: bool,
    progress: bool,
    batch_size: int,
) -> tuple[TensorDictBase | None, bool]:
    """Explain and write the batches ``runs``, creating the output at the first one if there is none yet.

    Returns the output (None if there was none and nothing to explain) and whether it has been checked.
    """
    leaves, done = (None, None) if output is None else _writable(output)
    sums = _checksums(lrp, source, prefix, output, batch_size) if checked else None
    keys = _read_keys(lrp)
    with _opened(lrp), stored_rows(), _progress_bar(sum(end - begin for begin, end in runs), progress) as bar:
        for begin, end in runs:
            rows = _rows(source, begin, end)
            rows_sums = row_checksums(rows, keys)  # of the rows as read, before the model may write into them
            try:
                result = lrp(rows)
            except Exception as err:  # the error names a key or module; which rows, and what is kept, said here
                err.add_note(
                    f"explain_offline: in rows {begin}:{end} of the source, explained into '{prefix}'; the rows "
                    "explained before are kept and marked done, and a later run over that prefix goes on from there"
                )
                raise
            if not checked:  # after the first call, which sets a lazy layer's parameters that the record digests
                written, record = _written_entries(lrp, result), explainer_record(lrp)
                if output is None:
                    output = _create(written, length, prefix, record)
                    leaves, done = _writable(output)
                _check_output(output, written, prefix, length, record)
                checked, sums = True, _checksums(lrp, source, prefix, output, batch_size)
            with torch.no_grad():  # relevance with a graph (create_graph=True) is stored, its graph is not
                for key, leaf in leaves:
                    leaf[begin:end].copy_(result.get(key))
                sums[begin:end] = rows_sums
                done[begin:end] = True  # only once the batch's relevance is written
            bar.update(end - begin)
    return output, checked


def _read_keys(lrp: LRP | AttributionMethod) -> list[NestedKey]:
    """What the explainer reads of a row: its input keys, and the stored actions a policy's relevance explains."""
    return [*map(unravel_key, lrp.in_keys), *drawn_action_keys(lrp.module)]


def _done_rows(output: TensorDictBase, length: int) -> torch.Tensor:
    """Per row (along the first dimension), whether any of its entries is marked done."""
    return output.get(DONE_KEY).as_subclass(torch.Tensor).reshape(length, -1).any(-1)


def _checksums(lrp, source, prefix: Path, output: TensorDictBase, batch_size: int) -> torch.Tensor:
    """The output's row checksums, to write beside each batch. An output written before they were kept gets them,
    for its rows done, from the rows as they are now: whether those changed since cannot be told, and they are
    taken as they are."""
    length = output.batch_size[0]
    sums, existed = checksum_file(prefix, length)
    if not existed:
        for begin, end in _missing_runs(~_done_rows(output, length), 0, length, batch_size):  # the runs of done rows
            sums[begin:end] = row_checksums(_rows(source, begin, end), _read_keys(lrp))
    return sums


def _without_changed_rows(
    lrp, source, prefix: Path, output: TensorDictBase, start: int, stop: int, batch_size: int
) -> torch.Tensor:
    """The output's mask of rows done, without the rows of ``start:stop`` whose checksum differs from the one kept
    when they were explained (see :mod:`~tdhook.attribution._row_checksums`): those are explained again. The
    output is not written: a run that stops before them leaves them to the next, which finds them changed too."""
    length = output.batch_size[0]
    done = output.get(DONE_KEY).as_subclass(torch.Tensor).clone()
    if not (prefix / CHECKSUM_FILE).exists():  # written before checksums were kept: taken as it is
        return done
    sums = checksum_file(prefix, length)[0]
    for begin, end in _missing_runs(~_done_rows(output, length), start, stop, batch_size):  # runs of done rows
        changed = row_checksums(_rows(source, begin, end), _read_keys(lrp)) != sums[begin:end]
        done[begin:end][changed] = False
    return done


def _unmark_changed_rows(
    lrp: LRP | AttributionMethod,
    prefix: Path,
    output: TensorDictBase,
    done: torch.Tensor,
    rows: range,
    checked: bool = False,
) -> None:
    """Mark not done, on disk, the rows of ``rows`` marked done whose data changed since they were explained
    (``done`` leaves them out), before any row is explained again: a run stopped before it reaches them leaves them
    visibly not done, where their relevance is still the old rows'. Rows outside ``rows`` are never looked at:
    another process may be marking its own rows of the output meanwhile (``distributed=False`` by hand), which
    ``done``, read before, does not hold. No output is written before it is checked: one not ``checked`` yet must
    keep this explainer's record (an output kept without one, or a model whose lazy layers have not run, keeps its
    marks until its rows are written)."""
    marks = _writable(output)[1][rows.start : rows.stop]
    stale = marks & ~done[rows.start : rows.stop]
    if stale.any() and (checked or record_matches(prefix, explainer_record(lrp))):
        marks[stale] = False


def _writable(output: TensorDictBase) -> tuple[list[tuple[NestedKey, torch.Tensor]], torch.Tensor]:
    """Plain tensors over the output's files: its relevance and action entries by key, and its mask of rows done.

    Writing rows into them skips the TensorDict and memory-mapped tensor indexing that costs more than the
    copy of a batch.
    """
    leaves = [(key, output.get(key).as_subclass(torch.Tensor)) for key in output.keys(True, True) if key != DONE_KEY]
    return leaves, output.get(DONE_KEY).as_subclass(torch.Tensor)


def _explain_sharded(
    lrp: LRP | AttributionMethod,
    source,
    prefix: Path,
    output: TensorDictBase | None,
    length: int,
    rows: range,
    batch_size: int,
    progress: bool,
    rank: int,
    world_size: int,
) -> TensorDictBase:
    """Every rank's part of a run under torch.distributed; returns once all ranks have written their rows.

    Every rank checks an existing output itself, so a refused prefix raises on all ranks instead of leaving
    the others waiting at a barrier.
    """
    template, record = _one_row_entries(lrp, source), explainer_record(lrp)
    if output is not None:
        _check_output(output, template, prefix, length, record)
    barrier()  # every rank has looked at the prefix before rank 0 creates files there
    if rank == 0 and output is None:
        _create(template, length, prefix, record)
    elif rank == 0:
        _checksums(lrp, source, prefix, output, batch_size)  # kept for an output written before they were
    barrier()
    output = TensorDict.load_memmap(prefix)
    done = _without_changed_rows(lrp, source, prefix, output, rows.start, rows.stop, batch_size)
    if rank == 0:  # checked by every rank above; a rank reading the mask meanwhile leaves those rows out either way
        _unmark_changed_rows(lrp, prefix, output, done, rows, checked=True)
    barrier()  # every rank has read the same mask, so the same batches, before any rank marks rows
    runs = shard_runs(_missing_runs(done, rows.start, rows.stop, batch_size), rank, world_size)
    _explain_runs(lrp, source, prefix, length, runs, output, True, progress and rank == 0, batch_size)
    barrier()  # on return, every rank's rows are written
    return output


def drawn_action_keys(module: torch.nn.Module) -> list[NestedKey]:
    """The keys where ``module`` writes what it draws at random: the action a sampling step (a torchrl
    ``ProbabilisticActor``'s) draws and its log-probability where it returns one, and the action a perturbing
    exploration step (``AdditiveGaussianModule``, ``OrnsteinUhlenbeckProcessModule``) adds noise to.

    Under ``ExplorationType.RANDOM`` these change from call to call, and with them the action a categorical
    policy's relevance explains by default. An ``EGreedyModule`` is left out: its random action is not the one
    explained (the greedy action's value is).

    Examples:
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl.modules import ProbabilisticActor
        >>> net = TensorDictModule(torch.nn.Linear(4, 3), in_keys=["observation"], out_keys=["logits"])
        >>> actor = ProbabilisticActor(
        ...     net, in_keys=["logits"], distribution_class=torch.distributions.Categorical, return_log_prob=True
        ... )
        >>> drawn_action_keys(actor), drawn_action_keys(net)
        (['action', 'action_log_prob'], [])
    """
    keys: list[NestedKey] = []
    for sub in module.modules():
        if isinstance(sub, ProbabilisticTensorDictModule):
            keys += sub.out_keys
        elif isinstance(sub, (AdditiveGaussianModule, OrnsteinUhlenbeckProcessModule)):
            keys.append(sub.in_keys[0])
    return list(dict.fromkeys(unravel_key(key) for key in keys))


def _written_entries(lrp: LRP | AttributionMethod, result: TensorDictBase) -> TensorDictBase:
    """What the output keeps of a call: the relevance keys it wrote (those of inputs the data leaves out, the
    recurrent states of a torchrl LSTMModule, which then starts from zeros, are not), and the actions the policy
    drew (see :func:`drawn_action_keys`), the one the relevance explains among them, as the call wrote them: a
    stored transition's action where the call explains it, else the call's own draw."""
    return result.select(*_explanation_keys(lrp), *drawn_action_keys(lrp.module), strict=False)


def _explanation_keys(lrp: LRP | AttributionMethod) -> list[NestedKey]:
    """The keys the explainer writes besides its model's outputs: the relevance of the explained inputs and of the
    layers asked for (LRP's ``layers``), GradCAM's map of its layer at its own key."""
    outputs = set(map(unravel_key, lrp.module.out_keys))
    return [key for key in map(unravel_key, lrp.out_keys) if key not in outputs]


def _one_row_entries(lrp: LRP | AttributionMethod, source) -> TensorDictBase:
    """The entries written for the source's first row: what the output's entries must hold."""
    with _opened(lrp), stored_rows():
        return _written_entries(lrp, lrp(_rows(source, 0, 1)))


def _opened(lrp: LRP | AttributionMethod) -> AbstractContextManager:
    """The wrapper's context to hold open for a pass: the caller's, left open, where they entered it already;
    none inside its ``inactive()`` block, whose calls write gradient × input as the block asks, nor for a method,
    which holds no context."""
    if not isinstance(lrp, LRP):
        return nullcontext()
    return nullcontext() if lrp._handles is not None or lrp._inactive else lrp


def _create(written: TensorDictBase, length: int, prefix: Path, record: dict[str, str]) -> TensorDictBase:
    """Files of the full length with a mask of the rows done, all False, created without materialising them."""
    template = written[:1].clone().set(DONE_KEY, torch.zeros((1, *written.batch_size[1:]), dtype=torch.bool))
    prefix.mkdir(parents=True, exist_ok=True)
    keep_record(prefix, record)  # before the TensorDict's files: a process that finds those finds these too
    checksum_file(prefix, length)
    output = template.expand(length, *written.batch_size[1:]).memmap_like(prefix)
    output.get(DONE_KEY).fill_(False)
    return output
