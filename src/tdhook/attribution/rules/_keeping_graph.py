"""Differentiable relevance: the switch an LRP call with ``create_graph=True`` turns on while it runs.

Relevance is a function of the inputs and of the parameters. To differentiate
it, a call must build two things the ordinary call leaves out:

* the relevance pass itself inside the autograd graph: every rule computes its
  gradient from tensors that keep their history (the layer's output, its
  input, modified weights built from the live parameters), with no in-place
  writes and no ``torch.no_grad``;
* the plain model behind every rule's output: a later backward pass (a loss on
  the relevance) must see the model's true derivative, not the rule's.

While :func:`keeping_graph` is open, :func:`graph_kept` returns the
:class:`RelevancePass` of the call, and the rules build both. The pass is
:meth:`~RelevancePass.running` only during the wrapper's own backward pass
that computes the relevance: then the rules' gradients flow; in every other
backward pass through the same graph, the plain gradient does. The flag lives
on the pass object captured by the graph (not in a thread-local), so it holds
in autograd's worker threads too.

Examples:
    >>> graph_kept() is None
    True
    >>> with keeping_graph() as relevance_pass:
    ...     graph_kept() is relevance_pass, relevance_pass.is_running
    (True, False)
    >>> with relevance_pass.running():
    ...     relevance_pass.is_running
    True
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

__all__ = ["RelevancePass", "graph_kept", "keeping_graph"]


class RelevancePass:
    """One differentiable LRP call: whether its relevance pass runs, and what its rules prepared for it.

    ``states`` holds, per rule and module, the modified parameters built from the
    live ones for this call (see :meth:`state`): a copy cached across calls is
    detached from the parameters, and would cut the derivative through them.
    """

    def __init__(self) -> None:
        self.is_running = False
        self.states: dict[tuple[int, int, tuple], tuple[object, object, Any]] = {}

    @contextmanager
    def running(self) -> Iterator[None]:
        """Mark the wrapper's backward pass: the rules' gradients flow while it lasts."""
        self.is_running = True
        try:
            yield
        finally:
            self.is_running = False

    def state(self, rule: object, module: object, prepare: Callable[[], Any], parameters: tuple = ()) -> Any:
        """``prepare()``, computed once per call for ``rule`` on ``module`` with the parameters told by
        ``parameters`` (a fingerprint of them): a module called twice with the same parameters reuses it; one run
        with another set in one of its calls (``torch.func.functional_call``, ``TensorDict.to_module``: an ensemble
        through one module) has it prepared from that set.

        Examples:
            >>> calls, relevance_pass = [], RelevancePass()
            >>> rule, module = object(), object()
            >>> [relevance_pass.state(rule, module, lambda: calls.append(1) or len(calls)) for _ in range(2)]
            [1, 1]
            >>> relevance_pass.state(rule, module, lambda: calls.append(1) or len(calls), parameters=(7,))
            2
        """
        key = (id(rule), id(module), parameters)
        kept = self.states.get(key)
        if kept is None or kept[0] is not rule or kept[1] is not module:
            kept = self.states[key] = (rule, module, prepare())
        return kept[2]


_CURRENT: ContextVar[RelevancePass | None] = ContextVar("tdhook_relevance_pass", default=None)


def graph_kept() -> RelevancePass | None:
    """The differentiable call under way in this thread's forward pass, or ``None`` (an ordinary call)."""
    return _CURRENT.get()


@contextmanager
def keeping_graph(relevance_pass: RelevancePass | None = None) -> Iterator[RelevancePass]:
    """Make the rules keep the graph (see the module's docstring) until the block ends."""
    relevance_pass = relevance_pass or RelevancePass()
    token = _CURRENT.set(relevance_pass)
    try:
        yield relevance_pass
    finally:
        _CURRENT.reset(token)
