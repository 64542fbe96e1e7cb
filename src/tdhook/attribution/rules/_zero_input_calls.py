"""A warning for activations called as functions whose input is exactly 0 where their output is not.

The identity rule that :class:`~tdhook.attribution.rules.functional.FunctionalRules` gives an activation called
as a function (``torch.sigmoid(h)``, ``F.softplus(h)``, a clip ``h.clamp(0.1, 1.0)``) passes the gradient
``grad · f(x) / stabilize(x)``: at an input of exactly 0 (behind a ReLU, a padded position) the input's relevance
``x · gradient`` is 0, and the relevance of an output ``f(0) != 0`` is lost. An activation module under the pass
rule warns about it (see :func:`~tdhook.attribution.rules.basic.warn_if_zero_inputs_drop`); a call warns the same
way, naming the function, in a context's first pass (see :mod:`~tdhook.attribution.rules._first_pass`), once per
function where relevance reaches such an output.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from tdhook.attribution.rules._caller import warn_at_caller
from tdhook.attribution.rules._first_pass import first_pass
from tdhook.attribution.rules._set_relevance import probing

__all__ = ["watch_zero_inputs"]

# What a call notes in the first pass's set (see :func:`first_pass`), with the function's name, once it warned.
_ZERO_INPUT_CALLS = "identity rule of a call at zero inputs"


def watch_zero_inputs(rule: Any, func: Any, x: torch.Tensor, output: torch.Tensor, result: torch.Tensor) -> None:
    """In a context's first pass, warn in the backward pass where relevance reaches an output of ``func`` (an
    element-wise activation called as a function, under ``rule``) whose input ``x`` is exactly 0 and whose value
    ``output`` is not: ``result`` (``output`` with the rule's gradient) gets a hook that checks its gradient there.

    Examples:
        >>> import warnings
        >>> from tdhook.attribution.rules._first_pass import watching_first_pass
        >>> from tdhook.attribution.rules.transformer import PseudoIdentityRule
        >>> x = torch.tensor([0.0, 1.0], requires_grad=True)
        >>> with watching_first_pass(), warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     out = torch.sigmoid(x)
        ...     watch_zero_inputs(PseudoIdentityRule(), torch.sigmoid, x, out, out)
        ...     out.sum().backward()
        >>> "sigmoid(0) != 0" in str(caught[0].message)
        True
    """
    warned = first_pass()
    name = getattr(func, "__name__", str(func))
    if warned is None or (_ZERO_INPUT_CALLS, name) in warned or not result.requires_grad:
        return
    if x.shape != output.shape:
        return
    with torch.no_grad():
        at_zero = (x == 0) & (output != 0)
        if not bool(at_zero.any()):
            return
    checked: list = []
    result.register_hook(functools.partial(_check, type(rule).__name__, name, at_zero, warned, checked))


def _check(rule_name: str, name: str, at_zero: torch.Tensor, warned: set, checked: list, grad: torch.Tensor) -> None:
    """The hook of :func:`watch_zero_inputs`: in the first backward pass through the output (the relevance pass, not
    a probe of the glue before a first layer), warn where its gradient is nonzero at ``at_zero``."""
    if checked or probing() or (_ZERO_INPUT_CALLS, name) in warned:
        return
    checked.append(True)
    with torch.no_grad():
        lost = int((at_zero & (grad != 0)).sum())
    if lost:
        warned.add((_ZERO_INPUT_CALLS, name))
        warn_at_caller(
            f"{rule_name} on a call of {name}: {lost} of its inputs are exactly 0 where its output is not "
            f"({name}(0) != 0), and the relevance of those outputs cannot pass back (an input relevance of input x "
            "gradient is 0 there): it is dropped. Call it through a module mapped to another rule (EpsilonRule, "
            "IgnoreRule), or explain at its input"
        )
