"""What explained an offline output's rows, kept beside it, so that a resumed run explains the rest as the first did.

:func:`~tdhook.attribution.offline.explain_offline` writes into an existing output only the rows not marked done. Its
keys, shapes and dtypes say nothing of how the rows were explained: a run resumed with another rule, another method of
the same keys (``Saliency`` after ``InputXGradient``), other options or a model trained further in between would fill
the rest with another explanation, and the output would mix two with no word. The output's folder keeps a record of
the explainer (:func:`explainer_record`): its class and the arguments it was built with, a model by its class, a
digest of its parameters, of its layout (its modules' classes and settings: a ReLU swapped for a Tanh, a LeakyReLU's
slope) and of the buffers of its modules in eval mode (a BatchNorm's running statistics; those of modules in training
mode are left out: a model may update one, a count of its calls, as it runs), a tensor by its values, a function (a
callable target) by its code and the values it closes over. A resumed run whose record differs is refused, naming
what differs. Options that only say how the work
is batched (``internal_batch_size``, ``perturbations_per_eval``, ``memory_budget``, ``progress``) are left out: they
may change from run to run.

Examples:
    >>> import tempfile
    >>> from pathlib import Path
    >>> from torch import nn
    >>> from tdhook.attribution import InputXGradient, Saliency
    >>> net = nn.Linear(3, 2)
    >>> record = explainer_record(Saliency(net, in_keys=["x"], out_keys=["y"]))
    >>> record["explainer"], record["abs"], record["module"][:20]
    ('Saliency', 'True', 'Linear, parameters #')
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     keep_record(Path(folder), record)
    ...     try:
    ...         check_record(Path(folder), explainer_record(InputXGradient(net, in_keys=["x"], out_keys=["y"])))
    ...     except ValueError as error:
    ...         print(str(error).split("; ")[1])
    explainer: Saliency then, InputXGradient now
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import nn

__all__ = ["RECORD_FILE", "check_record", "explainer_record", "keep_record"]

#: The file, in the output's folder, that holds the record of the explainer that wrote it.
RECORD_FILE = "explainer.json"

# Options that say how the work is batched or shown, not what is computed.
_BATCHING = frozenset({"internal_batch_size", "perturbations_per_eval", "memory_budget", "progress"})
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_CODE_PLACE = re.compile(r', file "[^"]*", line \d+')
_ARGUMENTS = "_tunable_init_arguments"


def explainer_record(explainer: nn.Module) -> dict[str, str]:
    """The explainer's class and the arguments it was built with, each described by :func:`_described`."""
    arguments = explainer.__dict__.get(_ARGUMENTS, {})
    record = {"explainer": type(explainer).__name__}
    record.update({name: _described(value) for name, value in arguments.items() if name not in _BATCHING})
    return record


def keep_record(prefix: Path, record: Mapping[str, str]) -> None:
    """Write ``record`` into the output's folder ``prefix``."""
    (prefix / RECORD_FILE).write_text(json.dumps(record, indent=1))


def record_matches(prefix: Path, record: Mapping[str, str]) -> bool:
    """Whether the output at ``prefix`` keeps a record, and it is ``record`` (nothing is written)."""
    path = prefix / RECORD_FILE
    return path.exists() and json.loads(path.read_text()) == dict(record)


def check_record(prefix: Path, record: Mapping[str, str]) -> None:
    """Refuse to resume the output at ``prefix`` with an explainer whose record is not the one kept there.

    An output with no record (written before records were kept) is taken as it is, and given this one.

    Raises:
        ValueError: the records differ, naming each argument that differs with its value then and now.
    """
    path = prefix / RECORD_FILE
    if not path.exists():
        keep_record(prefix, record)
        return
    kept = json.loads(path.read_text())
    differing = [name for name in dict.fromkeys([*kept, *record]) if kept.get(name) != record.get(name)]
    if differing:
        changes = "; ".join(
            f"{name}: {kept.get(name, 'not given')} then, {record.get(name, 'not given')} now" for name in differing
        )
        raise ValueError(
            f"explain_offline: the output at {str(prefix)!r} was written by another explanation than this one; "
            f"{changes}. Its rows not done yet would be explained otherwise than those done: resume with the "
            "explainer that wrote it, or choose another prefix (or delete that one)"
        )


def _described(value: Any, depth: int = 0) -> str:
    """A description of an argument that is the same from process to process for the same value: a module by its
    class and a digest of its state, a tensor by its values, an object built from arguments by those. ``depth``
    counts the functions passed through (a function closing over a list that holds it ends there).

    Examples:
        >>> def target():
        ...     targets = []
        ...     targets.append(lambda y: targets and y)
        ...     return targets[0]
        >>> _described(target()).startswith(__name__)
        True
    """
    if isinstance(value, nn.Module):
        # Its layout (the modules' classes and settings, a LeakyReLU's slope) and the buffers of the modules in eval
        # mode, which a call leaves as they are (a BatchNorm's running statistics).
        layout = hashlib.blake2b(_ADDRESS.sub("", repr(value)).encode(), digest_size=8).hexdigest()
        buffers = [b for m in value.modules() if not m.training for b in m._buffers.values() if b is not None]
        return (
            f"{type(value).__name__}, parameters #{_digest(list(value.parameters()))}, layout #{layout}, "
            f"buffers in eval mode #{_digest(buffers)}"
        )
    if isinstance(value, torch.Tensor):
        return f"tensor {str(value.dtype).removeprefix('torch.')} {list(value.shape)} #{_digest([value])}"
    if isinstance(value, TensorDictBase):
        return f"TensorDict {sorted(map(str, value.keys(True, True)))} #{_digest(list(value.values(True, True)))}"
    arguments = getattr(value, "__dict__", {}).get(_ARGUMENTS)
    if arguments is not None:  # a rule mapper or a rule of this package: its class and arguments
        inner = ", ".join(f"{name}={_described(argument, depth)}" for name, argument in arguments.items())
        return f"{type(value).__name__}({inner})"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{key!r}: {_described(item, depth)}" for key, item in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_described(item, depth) for item in value) + "]"
    if callable(value) and hasattr(value, "__qualname__"):  # a target function, a class
        name = f"{getattr(value, '__module__', '')}.{value.__qualname__}"
        code = getattr(value, "__code__", None)
        if code is None or depth > 3:
            return name
        # Two lambdas, or a function defined again under its name, by what they compute: the code, its constants,
        # the defaults and the values the function closes over (a unit k of ``lambda y: y[:, k]``).
        cells = [cell.cell_contents for cell in value.__closure__ or () if cell.cell_contents is not value]
        parts = [code.co_code.hex(), repr(code.co_consts), *(_described(v, depth + 1) for v in cells)]
        parts += [_described(v, depth + 1) for v in value.__defaults__ or ()]
        text = _CODE_PLACE.sub("", _ADDRESS.sub("", ";".join(parts)))  # where nested code lies is not what it does
        return f"{name} #{hashlib.blake2b(text.encode(), digest_size=8).hexdigest()}"
    return _ADDRESS.sub("", repr(value))


def _digest(tensors: list[torch.Tensor]) -> str:
    """A digest of the tensors' dtypes, shapes and values, in order (not of their names: a module without parameters
    put into a model leaves it as it is)."""
    digest = hashlib.blake2b(digest_size=8)
    for tensor in tensors:
        digest.update(f"{tensor.dtype} {list(tensor.shape)};".encode())
        if isinstance(tensor, nn.parameter.UninitializedTensorMixin) or tensor.is_quantized or tensor.is_meta:
            continue  # no values to read (a lazy layer before its first call); its kind and shape are described
        try:
            data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        except (RuntimeError, TypeError):  # a layout with no plain storage (sparse, nested): described by its kind
            continue
        digest.update(data.numpy().tobytes())
    return digest.hexdigest()
