"""Relevance a rule sets at its input directly, kept for the inner-layer relevance of the tensor it was set at.

Flat, w² and z^B set the relevance of their layer's input ``x``, zero entries included; the gradient carries only
``x · grad`` of it, and the rest goes to the explained inputs as records. The wrapper's inner-layer relevance
(``layers``) of a module whose output is ``x`` (a ``Flatten``, a normaliser before the first layer) reads
``x · grad`` at ``x``: it marks such a tensor as watched, and the rule leaves what the gradient does not carry on
it, for the watcher to add. A watched tensor further up the glue (a normaliser's output before a ``Flatten`` and
the layer) gets its share carried back through the glue (see :func:`~tdhook.attribution.rules._glue.note_up_the_glue`),
from the tensors :func:`watched_tensors` gives.

Examples:
    >>> x = torch.tensor([0.0, 2.0])
    >>> watch(x)
    >>> note_set_relevance(x, torch.tensor([1.0, 3.0]), carried=torch.tensor([0.0, 3.0]))
    >>> pop_set_relevance(x), pop_set_relevance(x)
    (tensor([1., 0.]), None)
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = [
    "watch",
    "watched_tensors",
    "forget_watched",
    "glue_probe",
    "probing",
    "note_set_relevance",
    "pop_set_relevance",
]

_WATCHED = "_tdhook_watched"
_SET = "_tdhook_set_relevance"
_POPPED = "_tdhook_popped_relevance"
_LOCAL = threading.local()  # this thread's watched tensors, held weakly: those of finished calls go with them


def watch(tensor: torch.Tensor) -> None:
    """Mark ``tensor`` (a module's output whose relevance the wrapper reads) for :func:`note_set_relevance`."""
    setattr(tensor, _WATCHED, True)
    alive = [ref for ref in getattr(_LOCAL, "watched", []) if ref() is not None]
    if not any(ref() is tensor for ref in alive):
        alive.append(weakref.ref(tensor))
    _LOCAL.watched = alive


def forget_watched() -> None:
    """Forget this thread's watched tensors (a call of the wrapper starts or ends)."""
    _LOCAL.watched = []


@contextmanager
def glue_probe() -> Iterator[None]:
    """Backward passes through the glue that read its Jacobian (see :func:`~tdhook.attribution.rules._glue.carry_back`):
    the hooks of the tensors they pass, which read the relevance pass's gradients, skip them (see :func:`probing`)."""
    previous = getattr(_LOCAL, "probing", False)
    _LOCAL.probing = True
    try:
        yield
    finally:
        _LOCAL.probing = previous


def probing() -> bool:
    """Whether this thread runs a backward pass of :func:`glue_probe`, not a pass of relevance."""
    return getattr(_LOCAL, "probing", False)


def watched_tensors() -> list[torch.Tensor]:
    """The tensors this thread watches that are still alive, in the order they were watched."""
    return [t for t in (ref() for ref in getattr(_LOCAL, "watched", [])) if t is not None]


def note_set_relevance(x: torch.Tensor, whole: torch.Tensor, carried: torch.Tensor | None = None) -> None:
    """Leave on ``x`` and on the tensor it is an alias of, each if it is watched, the relevance ``whole`` a rule set at
    it less what its gradient carries (``carried``, ``x · grad``; none where ``None``), added to what is there. (A
    relevance check watches the alias of its module's input, ``layers`` the module output it is made from: each reads
    its own.)"""
    source = getattr(x, "_tdhook_alias_of", x)
    rest = None
    for tensor in (x, source) if source is not x else (x,):
        if not getattr(tensor, _WATCHED, False):
            continue
        if rest is None:
            rest = whole if carried is None else whole - carried
        prior = tensor.__dict__.get(_SET)
        setattr(tensor, _SET, rest if prior is None else prior + rest)


def pop_set_relevance(tensor: torch.Tensor, grad: torch.Tensor | None = None) -> torch.Tensor | None:
    """What :func:`note_set_relevance` left on ``tensor`` since the last pop (``None`` if nothing).

    Several readers of one tensor (modules that return their input itself, an ``Identity`` and a ``Dropout`` in
    eval mode, each named in ``layers``) pop it from their hooks on that tensor, which all see the same ``grad`` in
    one backward pass: given ``grad``, the readers after the first get what the first popped.

    Examples:
        >>> x, grad = torch.tensor([0.0, 2.0]), torch.ones(2)
        >>> watch(x)
        >>> note_set_relevance(x, torch.tensor([1.0, 3.0]), carried=torch.tensor([0.0, 3.0]))
        >>> pop_set_relevance(x, grad), pop_set_relevance(x, grad), pop_set_relevance(x, torch.ones(2))
        (tensor([1., 0.]), tensor([1., 0.]), None)
    """
    value = tensor.__dict__.pop(_SET, None)
    if grad is None:
        return value
    if value is not None:
        setattr(tensor, _POPPED, (grad, value))  # the gradient is held, so that no later one takes its identity
        return value
    popped = tensor.__dict__.get(_POPPED)
    return popped[1] if popped is not None and popped[0] is grad else None
