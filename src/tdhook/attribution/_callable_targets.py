"""A callable target that computes a nonlinear function of the output: warned of, as its value is not differentiated.

A callable target ``output -> relevance`` gives the relevance put on the output: the backward pass starts from the
gradient ``relevance / output``, which the output's decomposition (the rules, or the plain gradient of a method)
shares among the inputs. That is what a part of the output (``lambda y: y * mask``, the greedy action's value) or a
constant relevance (a one-hot seed, ``torch.ones_like``) means. A callable that computes something else from the
output, such as ``log_softmax(y, -1) * one_hot`` for a token's log-probability, is not differentiated: the
explanation is the logit's, scaled by ``log p / logit`` (103 times off the log-probability's gradient on a tiny
GPT-2, with the opposite sign for some tokens). The first call of each callable checks which it is, from its value
at twice the output (``R(2y) = 2 R(y)``: a part; ``R(2y) = R(y)``: a constant), and warns of any other.

Examples:
    >>> import warnings
    >>> y = torch.tensor([[1.0, -2.0, 0.5]])
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warn_for_nonlinear_target(lambda out: out * (out > 0), y, "logits")
    ...     warn_for_nonlinear_target(lambda out: out.log_softmax(-1), y, "logits")
    >>> for warning in caught:
    ...     print(str(warning.message).split(":")[0])
    the callable target <lambda> computes a function of output 'logits' that is neither a part of it nor a constant
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from tensordict.utils import NestedKey

from tdhook.attribution.rules._caller import warn_at_caller

__all__ = ["warn_for_nonlinear_target"]

_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # callables checked, by themselves


def warn_for_nonlinear_target(target: Callable, output: torch.Tensor, key: NestedKey) -> None:
    """Warn, once per callable, where ``target`` is neither a part of ``output`` nor a constant relevance.

    Args:
        target: the callable target.
        output: the output it is given (detached).
        key: the output's key, for the message.
    """
    try:
        if target in _CHECKED:
            return
        _CHECKED[target] = True
    except TypeError:  # not weakly referenced nor hashable: checked at every call
        pass
    if not output.is_floating_point() or output.numel() == 0:
        return
    with torch.no_grad():
        relevance, doubled = target(output), target(output * 2)
    if not all(isinstance(r, torch.Tensor) and r.shape == output.shape for r in (relevance, doubled)):
        return  # refused by the caller, naming the shape
    relevance, doubled = relevance.to(output.dtype), doubled.to(output.dtype)
    finite = relevance.isfinite() & doubled.isfinite()
    relevance, doubled = relevance[finite], doubled[finite]
    tolerance = 1e3 * torch.finfo(output.dtype).eps * (relevance.abs().max() if relevance.numel() else 0.0)
    part = bool(((doubled - 2 * relevance).abs() <= 2 * tolerance).all())
    constant = bool(((doubled - relevance).abs() <= tolerance).all())
    if part or constant:
        return
    name = getattr(target, "__qualname__", None) or type(target).__name__
    warn_at_caller(
        f"the callable target {name} computes a function of output {key!r} that is neither a part of it nor a "
        "constant: what it returns is taken as the relevance put on the output, shared as the output is "
        "(the backward pass starts from relevance / output), not differentiated, so the explanation is not that of "
        "the function it computes (a log-probability, a loss). To explain such a function, compute it in the model "
        "and explain that output (target_key), or pass the units it picks (target=<indices>)"
    )
