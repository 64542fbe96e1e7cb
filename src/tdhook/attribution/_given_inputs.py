"""The inputs a call was given, noted before the model runs, and put back where the model must run again.

A call whose graph was not the recorded one runs the model a second time (see
:mod:`~tdhook.attribution._function_rule_plan`). That run must see what the first saw: the entries of the
TensorDict the model runs on (a step may overwrite the key it reads) and their values (a model may change its
input in place, ``x.mul_(2)`` or an in-place ReLU). An explained input is a copy of its leaf made for the model:
its values are taken from the leaf again. Any other input is the caller's own tensor: changed in place, it cannot
be put back, and the call is refused by name.

Examples:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> leaf = torch.ones(2, requires_grad=True)
    >>> fed = leaf.clone()
    >>> work = TensorDict(x=fed, n=torch.zeros(2), batch_size=[2])
    >>> inputs = given_inputs(work)
    >>> with torch.no_grad():
    ...     _ = fed.mul_(2)  # what a model may do to its input
    >>> restore_inputs(work, inputs, [leaf], [fed])
    >>> work["x"] is fed, fed.tolist()
    (True, [1.0, 1.0])
    >>> work["n"].add_(1)  # the caller's tensor
    tensor([1., 1.])
    >>> restore_inputs(work, inputs, [leaf], [fed])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    RuntimeError: LRP: the model changed its input 'n' in place, in a call that runs it again ...
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDictBase

__all__ = ["given_inputs", "restore_inputs"]


def given_inputs(work: TensorDictBase) -> list[tuple[Any, Any, int | None]]:
    """``(key, value, version)`` for each leaf of ``work``: the version counter of a tensor (``None`` for an
    inference tensor, which cannot be changed outside inference mode, and for any other value)."""
    return [(key, value, _version(value)) for key, value in work.items(include_nested=True, leaves_only=True)]


def restore_inputs(
    work: TensorDictBase,
    inputs: list[tuple[Any, Any, int | None]],
    leaves: Sequence[torch.Tensor | None],
    fed: Sequence[torch.Tensor | None],
) -> None:
    """Put ``inputs`` (from :func:`given_inputs`) back into ``work``, with the values they had.

    Args:
        work: the TensorDict the model runs on.
        inputs: its leaves before the model ran.
        leaves: the explained inputs' leaves.
        fed: the copies of them the model was given (``work`` holds them).

    Raises:
        RuntimeError: the model changed in place an input that is not one of ``fed``, naming its key.
    """
    work.update({key: value for key, value, _ in inputs})
    for key, value, version in inputs:
        if version is None or value._version == version:
            continue
        position = next((i for i, f in enumerate(fed) if f is value), None)
        if position is None or leaves[position] is None:
            raise RuntimeError(
                f"LRP: the model changed its input {key!r} in place, in a call that runs it again (its graph was "
                "not the one recorded for inputs of these shapes): the second run would see the changed values, "
                "and the caller's tensor cannot be put back. Change it out of place in the model, or explain it "
                "(in_keys), which gives the model a copy"
            )
        with torch.enable_grad():  # the copy takes its leaf's values and stays on the leaf's gradient path
            value.copy_(leaves[position])


def _version(value: Any) -> int | None:
    if isinstance(value, torch.Tensor) and not value.is_inference():
        return value._version
    return None
