"""Differentiable relevance for the LRP wrapper: checking the rules, keeping the graph, and switching rules off.

``LRP(..., create_graph=True)`` writes relevance whose derivative with respect
to the inputs and to every parameter is the true one (see
:mod:`~tdhook.attribution.rules._keeping_graph` for how the rules build it).
:func:`check_differentiable` refuses a rule that cannot keep its graph, and
:func:`rules_off` is ``LRP.inactive()``.

Examples:
    >>> from tdhook.attribution.rules import EpsilonRule, QuantizedLinearRule
    >>> check_differentiable({"0": EpsilonRule()})
    >>> check_differentiable({"0": QuantizedLinearRule()})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    NotImplementedError: LRP(create_graph=True): the rule QuantizedLinearRule(epsilon=1e-06) on module '0' cannot ...
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from tdhook.attribution.methods._norm_gradients import norm_gradients_laid_out
from tdhook.attribution.rules._keeping_graph import RelevancePass, keeping_graph
from tdhook.attribution.rules.base import RemovableRuleHandle, Rule

__all__ = ["check_differentiable", "relevance_graph", "rules_off"]


def check_differentiable(rules: Mapping[str, Rule], mapper: object = None) -> None:
    """Raise for the first rule of ``rules`` (by module name) whose relevance cannot keep its graph, or for
    function modes of the rule ``mapper`` that cannot (the package's own can: they say so with ``differentiable``).

    Raises:
        NotImplementedError: naming the rule and the module; its relevance would be differentiated wrongly.
    """
    refused = [mode for mode in getattr(mapper, "function_modes", list)() if not getattr(mode, "differentiable", False)]
    if refused:
        raise NotImplementedError(
            f"LRP(create_graph=True): the function rules of {type(mapper).__name__} "
            f"({', '.join(type(mode).__name__ for mode in refused)}) cannot keep the relevance's graph"
        )
    for name, rule in rules.items():
        if not rule.differentiable:
            raise NotImplementedError(
                f"LRP(create_graph=True): the rule {rule!r} on module {name or 'the model itself'!r} cannot keep "
                "the relevance's graph, so its derivative would be wrong; map that module to a rule that can "
                "(one whose `differentiable` is true: every rule of the package but QuantizedLinearRule, whose "
                "dynamically quantized layer has no derivative, and CondConvRule, which builds each sample's kernel "
                "outside the graph)"
            )


def relevance_graph(
    keep: bool, handles: Sequence[RemovableRuleHandle] | None = None
) -> AbstractContextManager[RelevancePass | None]:
    """The call's :class:`~tdhook.attribution.rules._keeping_graph.RelevancePass` while the block runs when
    ``keep`` (``create_graph=True``), else ``None`` and nothing changed.

    Raises:
        NotImplementedError: ``keep``, and a rule of ``handles`` (the open context's, registered before
            ``create_graph`` was switched on) cannot keep the relevance's graph.

    Examples:
        >>> with relevance_graph(False) as relevance_pass:
        ...     relevance_pass is None
        True
    """
    if not keep:
        return _NO_GRAPH
    for handle in handles or ():
        if not handle.rule.differentiable:
            raise NotImplementedError(
                f"LRP(create_graph=True): the rule {handle.rule!r} on a {type(handle.module).__name__} cannot keep "
                "the relevance's graph, so its derivative would be wrong; map that module to a rule that can"
            )
    return keeping_graph()


_NO_GRAPH = nullcontext()  # reusable: entering it does nothing (cheaper than a generator's context per call)


@contextmanager
def rules_off(wrapper: Any) -> Iterator[None]:
    """Switch the rules of an LRP ``wrapper`` off for the block (see ``LRP.inactive``).

    An open context is left for the block and entered again after it, whatever ends the block (an error, an
    interrupt); calls of the wrapper in the block write gradient × input.
    """
    if wrapper._inactive:  # nested: the outer block restores
        yield
        return
    was_open = wrapper._handles is not None
    if was_open:
        wrapper.__exit__(None, None, None)
    wrapper._inactive = True
    try:
        with norm_gradients_laid_out(wrapper.module):  # the plain backward: PyTorch's CPU BatchNorm needs it laid out
            yield
    finally:
        wrapper._inactive = False
        if was_open:
            wrapper.__enter__()
