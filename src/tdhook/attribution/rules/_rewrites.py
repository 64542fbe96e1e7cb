"""What a rule's :meth:`~tdhook.attribution.rules.base.Rule.rewrite` must return, and what the backward it hands
to :func:`~tdhook.attribution.rules.redirect` must give, checked with errors that name the rule and the module.

A rule changes the gradient through a module and never its value: the tensor its ``rewrite`` returns replaces
the module's output in the model, so another value (``2 * output``, ``redirect(output + 1, ...)``) would change
the model's output and every relevance after it without a word. For the rules written outside tdhook (a rule of
one's own), the returned tensor is checked against the module's output: a tensor, of the same shape, dtype and
device, and the same value up to rounding. The rules of :mod:`tdhook.attribution.rules` are tested against their
references and are not checked on every call.

A backward handed to ``redirect`` gives one gradient (or ``None``) per tensor it sends gradient to, each of that
tensor's shape (or one that torch sums down to it, as it does for broadcasting); where it does not, the error
names the rule and the module whose ``rewrite`` called ``redirect``.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> from tdhook.attribution.rules import EpsilonRule
    >>> layer = nn.Linear(2, 2)
    >>> output = layer(torch.ones(1, 2))
    >>> raise_for_rewritten(EpsilonRule(), layer, output, output.detach().clone())  # the same value: nothing to say
    >>> try:
    ...     raise_for_rewritten(EpsilonRule(), layer, output, 2 * output)
    ... except ValueError as err:
    ...     print(str(err)[:84])
    EpsilonRule on Linear: rewrite returned a tensor whose value differs from the module
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from tdhook.attribution.rules._scopes import pop, push

__all__ = [
    "RUNNING",
    "checked_rewrite",
    "running_rewrite",
    "raise_for_detached",
    "rewrites",
    "is_own_rewrite",
    "given_inputs",
    "note_overwritten",
    "raise_for_rewritten",
    "raise_for_gradients",
]


class _Running(threading.local):
    """The rewrites of rules of one's own running on this thread, innermost last, as ``(rule, module, inputs)``
    (empty, and falsy, for all others): :func:`checked_rewrite` pushes a rewrite with
    :func:`~tdhook.attribution.rules._scopes.push` and pops it when the rewrite returns (or, where an interrupt skips
    that, the wrapper's call pops it as it ends)."""

    def __init__(self) -> None:
        self.stack: list = []


RUNNING = _Running()  # ``RUNNING.stack``: read directly on the hot paths, where it is empty


def running_rewrite() -> tuple[type, type] | None:
    """The classes of the rule and the module whose rewrite runs innermost on this thread, or ``None``.

    Examples:
        >>> from tdhook.attribution.rules._scopes import pop, push
        >>> running_rewrite() is None
        True
        >>> push(RUNNING.stack, ("rule", nn.Linear(1, 1), ()))
        >>> running_rewrite() == (str, nn.Linear)
        True
        >>> _ = pop(RUNNING.stack)
    """
    stack = RUNNING.stack
    if not stack:
        return None
    rule, module, _ = stack[-1]
    return type(rule), type(module)  # the classes: a graph holds them, not the module


def rewrites(module: nn.Module) -> bool:
    """Whether a rule's rewrite of ``module`` runs on this thread: a call of ``module`` that it makes (a modified
    pass through ``torch.func.functional_call(module, ...)``) is then a plain call, not one more for the rule.

    Examples:
        >>> from tdhook.attribution.rules._scopes import pop, push
        >>> layer = nn.Linear(1, 1)
        >>> push(RUNNING.stack, ("rule", layer, ()))
        >>> rewrites(layer), rewrites(nn.Linear(1, 1))
        (True, False)
        >>> _ = pop(RUNNING.stack)
    """
    stack = RUNNING.stack
    return bool(stack) and any(entry[1] is module for entry in stack)


def raise_for_detached(tensors: Sequence[Any]) -> tuple[bool, ...] | None:
    """Check ``tensors``, those a rule of one's own hands to ``redirect``, against the input of the module of the
    innermost running rewrite, and return whether a gradient for each of them is kept (``None`` where that module
    read no tensor that requires grad: a module of constants, nothing to check).

    A tensor leads back to the input where its autograd history reaches a module input that requires grad. Raise
    where none of ``tensors`` does (an empty list, a rule that cuts the branch, excepted): the redirect's gradient
    would reach no input, and the relevance through the module would be lost without a word (the input was
    detached, or the tensors computed under ``torch.no_grad()``). The error carries the module (``err.module``), so
    that the LRP wrapper names its path. A gradient for a tensor that does not lead back is lost too: it is kept
    (see :func:`raise_for_gradients`) only where the module also read a tensor that does not require grad (a mask,
    an input left unexplained, whose share of the relevance goes nowhere) and the tensor is no detached alias of
    an input that requires grad (``x.detach()``, a view of it).

    Examples:
        >>> from tdhook.attribution.rules import EpsilonRule
        >>> from tdhook.attribution.rules._scopes import pop, push
        >>> layer, x = nn.Linear(2, 2), torch.ones(1, 2, requires_grad=True)
        >>> push(RUNNING.stack, (EpsilonRule(), layer, (x,)))
        >>> raise_for_detached([layer(x), layer(x.detach()), torch.ones(2)])  # the second reaches the weight only
        (True, False, False)
        >>> try:
        ...     raise_for_detached([layer(x.detach())])
        ... except ValueError as err:
        ...     print(str(err)[:80])
        EpsilonRule on Linear: redirect was given tensors none of which leads back to th
        >>> _ = pop(RUNNING.stack)
    """
    stack = RUNNING.stack
    if not stack:
        return None
    rule, module, inputs = stack[-1]
    tensor_inputs = [t for t in inputs if isinstance(t, torch.Tensor)]
    read = tuple(t for t in tensor_inputs if t.requires_grad)
    if not read:
        return None
    leads = tuple(_reaches(t, read) for t in tensors)
    if tensors and not any(leads):
        error = ValueError(
            f"{type(rule).__name__} on {type(module).__name__}: redirect was given tensors none of which leads back "
            "to the module's input (they do not require grad, or only through parameters: the input was detached, "
            "or they were computed under torch.no_grad()), while the input requires grad: the gradient the redirect "
            "sends would reach no input, and the relevance through the module would be lost. Build them from the "
            "input without detaching it (detach the weights or the output instead)"
        )
        error.module = module  # type: ignore[attr-defined]  # the wrapper names its path
        raise error
    if len(read) == len(tensor_inputs):  # every input requires grad: what does not lead back is relevance lost
        return leads
    return tuple(lead or not _aliases(t, read) for lead, t in zip(leads, tensors, strict=True))


def _aliases(tensor: Any, inputs: tuple[torch.Tensor, ...]) -> bool:
    """Whether ``tensor`` shares the memory of one of ``inputs`` (``x.detach()``, a view of it)."""
    if not isinstance(tensor, torch.Tensor):
        return False
    try:
        pointer = tensor.untyped_storage().data_ptr()
        return any(t.untyped_storage().data_ptr() == pointer for t in inputs)
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a functorch wrapper)
        return False


# The most autograd nodes walked from one redirected tensor to the module's input; a longer history (a rule that
# redirects to the output of a whole block) is taken to reach it.
_WALK_LIMIT = 10_000


def _reaches(tensor: Any, inputs: tuple[torch.Tensor, ...]) -> bool:
    if not isinstance(tensor, torch.Tensor) or not tensor.requires_grad:
        return False
    if any(tensor is t for t in inputs):
        return True
    nodes = {t.grad_fn for t in inputs if t.grad_fn is not None}
    leaves = [t for t in inputs if t.grad_fn is None]
    pending, seen = [tensor.grad_fn], set()
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        if node in nodes or any(getattr(node, "variable", None) is t for t in leaves):
            return True
        seen.add(node)
        if len(seen) > _WALK_LIMIT:
            return True
        pending.extend(child for child, _ in node.next_functions)
    return False


def _named(where: tuple[type, type] | None) -> str:
    if where is None:
        return "a rule"
    rule, module = where
    return f"{rule.__name__} on {module.__name__}"


def is_own_rewrite(rule: Any) -> bool:
    """Whether the ``rewrite`` of ``rule`` (a rule or a rule class) is written outside tdhook (a rule of one's own):
    the class that defines it is not one of tdhook's.

    Examples:
        >>> from tdhook.attribution.rules import EpsilonRule
        >>> class Mine(EpsilonRule):
        ...     __module__ = "my_rules"
        ...
        ...     def rewrite(self, module, registration, inputs, output):
        ...         return None
        >>> class Tuned(EpsilonRule):
        ...     __module__ = "my_rules"
        >>> is_own_rewrite(EpsilonRule()), is_own_rewrite(Mine()), is_own_rewrite(Tuned()), Mine.own_rewrite
        (False, True, False, True)
    """
    return _rewrite_outside_tdhook(rule if isinstance(rule, type) else type(rule))


@functools.cache
def _rewrite_outside_tdhook(kind: type) -> bool:
    owner = next(cls for cls in kind.__mro__ if "rewrite" in vars(cls))
    return not owner.__module__.startswith("tdhook.")


def given_inputs(rule: Any, module: nn.Module, inputs: tuple, output: Any) -> tuple:
    """The inputs handed to ``rule``'s rewrite of ``module`` (a rule of one's own, from :func:`checked_rewrite`):
    ``inputs``, but where the rule declares ``uses_input = False`` and the module ran in place (its input is its
    output, overwritten), ``None`` for that input, so that a rule reading it fails (see :func:`note_overwritten`)
    rather than read the output's values.

    Examples:
        >>> from tdhook.attribution.rules import Rule
        >>> class OutputOnly(Rule):
        ...     __module__ = "my_rules"
        ...     uses_input = False
        ...
        ...     def rewrite(self, module, registration, inputs, output):
        ...         return None
        >>> relu, x = nn.ReLU(inplace=True), torch.tensor([-1.0, 2.0])
        >>> out = relu(x)
        >>> given_inputs(OutputOnly(), relu, (x,), out)
        (None,)
    """
    if rule.uses_input or not getattr(module, "inplace", False) or not inputs or inputs[0] is not output:
        return inputs
    return (None, *inputs[1:])


def note_overwritten(error: BaseException, rule: Any, module: nn.Module, given: tuple, inputs: tuple) -> None:
    """Add a note to ``error``, raised by ``rule``'s rewrite, where :func:`given_inputs` held back an input."""
    if given is not inputs:
        if getattr(error, "module", None) is None:
            error.module = module  # type: ignore[attr-defined]  # the wrapper names its path
        error.add_note(
            f"{type(rule).__name__} on {type(module).__name__}: the module ran in place, so its input holds its "
            "output's values, and the rule declares uses_input = False: its rewrite gets None for that input. A rule "
            "that reads the input sets uses_input = True (the input is then kept before the module overwrites it)"
        )


def checked_rewrite(rule: Any, module: nn.Module, registration: Any, inputs: tuple, output: torch.Tensor) -> Any:
    """``rule.rewrite(module, registration, inputs, output)`` for a rule of one's own (see :func:`is_own_rewrite`),
    checked: an input the module overwrote in place is held back where the rule declares it does not read it
    (:func:`given_inputs`, :func:`note_overwritten`), the rewrite is named to the backward it hands to ``redirect``
    (:func:`running_rewrite`), and what it returns must be the output's value (:func:`raise_for_rewritten`).

    Examples:
        >>> from tdhook.attribution.rules import Rule
        >>> class Doubling(Rule):
        ...     __module__ = "my_rules"
        ...
        ...     def rewrite(self, module, registration, inputs, output):
        ...         return 2 * output
        >>> layer = nn.Linear(2, 2)
        >>> x = torch.ones(1, 2)
        >>> try:
        ...     checked_rewrite(Doubling(), layer, None, (x,), layer(x))
        ... except ValueError as err:
        ...     print(str(err)[:70])
        Doubling on Linear: rewrite returned a tensor whose value differs from
    """
    given = given_inputs(rule, module, inputs, output)
    rewriting = RUNNING.stack
    push(rewriting, (rule, module, inputs))
    try:
        result = rule.rewrite(module, registration, given, output)
    except Exception as err:
        note_overwritten(err, rule, module, given, inputs)
        raise
    finally:
        pop(rewriting)
    if result is not None:
        raise_for_rewritten(rule, module, output, result)
    return result


def raise_for_rewritten(rule: Any, module: nn.Module, output: torch.Tensor, result: Any) -> None:
    """Raise where ``result``, what ``rule``'s rewrite of ``module`` returned, is not ``output``'s value.

    The same storage is the same value; otherwise the values are compared with a tolerance of the dtype's
    ``sqrt(eps)``, relative to each value and to the largest magnitude of ``output`` (a rule may compute the output
    again, in another order of rounding). The error carries the module (``err.module``), so that the LRP wrapper
    names its path.

    Raises:
        TypeError: ``result`` is not a tensor.
        ValueError: its shape, dtype, device or value is not the output's.
    """
    what = f"{type(rule).__name__} on {type(module).__name__}: rewrite returned"
    expected = f"expected the module's output ({_describe(output)}) or None"
    fix = "a rule changes the gradient only: return redirect(output, tensors, backward) or output itself"
    error: Exception | None = None
    if not isinstance(result, torch.Tensor):
        error = TypeError(f"{what} an object of type {type(result).__name__}, {expected}")
    elif result.shape != output.shape or result.dtype != output.dtype or result.device != output.device:
        error = ValueError(f"{what} a tensor ({_describe(result)}), {expected}; {fix}")
    elif not _same_value(result, output):
        with torch.no_grad():
            off = (result - output).abs().nan_to_num(nan=float("inf")).max().item()
        error = ValueError(
            f"{what} a tensor whose value differs from the module's output (by up to {off:.3g}), which would change "
            f"the model's output; {fix}"
        )
    if error is not None:
        error.module = module  # type: ignore[attr-defined]
        raise error


def _describe(tensor: torch.Tensor) -> str:
    return f"shape {list(tensor.shape)}, {tensor.dtype}, {tensor.device}"


def _same_value(result: torch.Tensor, output: torch.Tensor) -> bool:
    if (
        result.data_ptr() == output.data_ptr()
        and result.stride() == output.stride()
        and result.storage_offset() == output.storage_offset()
    ):
        return True
    if not output.is_floating_point() and not output.is_complex():
        return torch.equal(result, output)
    with torch.no_grad():
        tolerance = torch.finfo(output.dtype).eps ** 0.5
        scale = output.detach().abs().nan_to_num(posinf=0.0, neginf=0.0).max().item() if output.numel() else 0.0
        return torch.allclose(result.detach(), output.detach(), rtol=tolerance, atol=tolerance * scale, equal_nan=True)


def raise_for_gradients(
    where: tuple[type, type] | None,
    shapes: tuple[torch.Size, ...],
    grads: tuple,
    dtypes: tuple[torch.dtype, ...] | None = None,
    kept: tuple[bool, ...] | None = None,
) -> None:
    """Raise where ``grads``, what a rule's backward gave for tensors of ``shapes``, is not one gradient (or
    ``None``) per tensor, each of that tensor's shape or one torch sums down to it. ``where`` holds the classes
    of the rule and the module whose rewrite called ``redirect`` (:func:`running_rewrite`), named in the error.

    With ``dtypes`` (the tensors' dtypes), a gradient of another dtype is refused: torch would cast it without a
    word (a float32 gradient for a float64 tensor carries float32's precision only). With ``kept`` (whether each
    tensor's gradient is kept, see :func:`raise_for_detached`), a gradient for a tensor that does not lead back to
    the module's input is refused: torch drops it, or hands it to the parameters only, and the relevance it carries
    is lost.

    Examples:
        >>> from tdhook.attribution.rules import EpsilonRule
        >>> where = (EpsilonRule, nn.Linear)
        >>> raise_for_gradients(where, (torch.Size([1, 3]),), (torch.ones(2, 3),))  # summed down by torch
        >>> try:
        ...     raise_for_gradients(where, (torch.Size([2, 3]),), (torch.ones(2, 1),))
        ... except ValueError as err:
        ...     print(err)  # doctest: +NORMALIZE_WHITESPACE
        EpsilonRule on Linear: the backward given to redirect returned a gradient of shape [2, 1] for tensor 0 of the
        redirect, which has shape [2, 3]
        >>> try:
        ...     raise_for_gradients(where, (torch.Size([2]),), (torch.ones(2),), kept=(False,))
        ... except ValueError as err:
        ...     print(str(err)[:103])
        EpsilonRule on Linear: the backward given to redirect returned a gradient for tensor 0 of the redirect,
    """
    name = _named(where)
    if len(grads) != len(shapes):
        raise RuntimeError(
            f"{name}: the backward given to redirect returned {len(grads)} gradients for the {len(shapes)} tensors "
            "it sends gradient to (one gradient or None each, in their order)"
        )
    for i, (grad, shape) in enumerate(zip(grads, shapes, strict=True)):
        if grad is None:
            continue
        if not isinstance(grad, torch.Tensor):
            raise TypeError(
                f"{name}: the backward given to redirect returned an object of type {type(grad).__name__} for "
                f"tensor {i} of the redirect, expected a tensor or None"
            )
        if grad.shape != shape and not _sums_down(grad.shape, shape):
            raise ValueError(
                f"{name}: the backward given to redirect returned a gradient of shape {list(grad.shape)} for tensor "
                f"{i} of the redirect, which has shape {list(shape)}"
            )
        if dtypes is not None and grad.dtype != dtypes[i]:
            raise ValueError(
                f"{name}: the backward given to redirect returned a gradient of dtype {grad.dtype} for tensor {i} of "
                f"the redirect, which has dtype {dtypes[i]}: torch would cast it without a word, and the relevance "
                "would carry the precision of the gradient's dtype; compute it in the tensor's dtype"
            )
        if kept is not None and not kept[i]:
            raise ValueError(
                f"{name}: the backward given to redirect returned a gradient for tensor {i} of the redirect, which "
                "does not lead back to the module's input (it does not require grad, or only through parameters: "
                "the input was detached, or it was computed under torch.no_grad()): the gradient and the relevance "
                "it carries would be lost. Build the tensor from the module's input without detaching it, or "
                "return None for it"
            )


def _sums_down(grad_shape: torch.Size, shape: torch.Size) -> bool:
    """Whether torch sums a gradient of ``grad_shape`` down to ``shape`` (``shape`` broadcasts to it)."""
    if len(shape) > len(grad_shape):
        return False
    return all(s == g or s == 1 for s, g in zip(reversed(shape), reversed(grad_shape), strict=False))
