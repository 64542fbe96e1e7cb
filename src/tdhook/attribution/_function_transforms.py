"""A ``torch.func`` transform (``grad``, ``vjp``, ``jvp``, ``vmap``) taken in the model's own forward, through
modules with rules: named in the error.

The rules work through autograd hooks and custom ``torch.autograd.Function``
nodes, which a ``torch.func`` transform does not run: torch refuses the first
rule the transform reaches with an error about ``setup_context`` that names
neither the module nor the transform. A transform around the whole call is
refused before the model runs (:func:`refuse_outer_transform`, asked by
:func:`~tdhook.attribution._inputs.validate_inputs` and before a wrapper's rules are
registered: a rule prepared at registration, as γ and αβ on a Linear layer, would
otherwise fail on the transform's batched parameters with torch's own message);
one inside the model's forward is found here, from the failing call's frames,
and named with the module that takes it and the first module with a rule it
runs through, as ``torch.autograd.grad`` in a forward is refused
(:class:`~tdhook.attribution._nonlinear_calls.NonlinearCalls`).

Examples:
    >>> import torch
    >>> from torch import nn
    >>> class Field(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.energy = nn.Linear(3, 1)
    ...     def forward(self, x):
    ...         return torch.func.grad(lambda x: self.energy(x).sum())(x)
    >>> class Refusing(torch.autograd.Function):  # stands for a rule's node, which torch refuses so
    ...     @staticmethod
    ...     def forward(ctx, x):
    ...         return x
    ...     @staticmethod
    ...     def backward(ctx, grad):
    ...         return grad
    >>> field = Field()
    >>> hook = field.energy.register_forward_hook(lambda m, args, out: Refusing.apply(out))
    >>> try:
    ...     field(torch.randn(3))
    ... except RuntimeError as err:
    ...     refused = transform_refusal(err, dict(field.named_modules()), "LRP", lambda frame: True)
    >>> print(refused)  # doctest: +NORMALIZE_WHITESPACE
    LRP: the model itself (Field) calls torch.func.grad in its own forward through module 'energy' (Linear),
    whose rule works through autograd hooks and Functions that torch.func transforms do not run; take the
    gradient with torch.autograd.grad(..., create_graph=True) instead and call LRP with create_graph=True (the
    rules then act in the relevance pass only), or explain the model outside the transform
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import FrameType, TracebackType

import torch
from torch import nn

from tdhook.attribution._loss_callers import loss_module_transform_advice

__all__ = ["refuse_outer_transform", "transform_refusal"]

# The functions of torch's functorch package that a transform runs through, and the transform users call.
_TRANSFORMS = {
    "grad_impl": "torch.func.grad",
    "grad_and_value_impl": "torch.func.grad",
    "vjp": "torch.func.vjp",
    "_vjp_with_argnums": "torch.func.vjp",
    "_jvp_with_argnums": "torch.func.jvp",
    "vmap_impl": "torch.func.vmap",
}


def refuse_outer_transform(what: str = "the call") -> None:
    """Raise where ``what`` (a wrapper's call, or its context entered) runs under a ``torch.func`` transform.

    Args:
        what: what runs under it, named in the message.

    Raises:
        NotImplementedError: a transform (``grad``, ``vjp``, ``jacrev``, ``jvp``, ``vmap``) is active: it runs
            neither the autograd backward pass nor the hooks the rules work through.

    Examples:
        >>> refuse_outer_transform()  # no transform: nothing to refuse
        >>> try:
        ...     torch.vmap(lambda x: refuse_outer_transform("the context") or x)(torch.ones(2, 3))
        ... except NotImplementedError as err:
        ...     print(str(err)[:62])
        LRP: the context runs under a torch.func transform (grad, vjp,
    """
    if torch._C._are_functorch_transforms_active():
        raise NotImplementedError(
            f"LRP: {what} runs under a torch.func transform (grad, vjp, jacrev, jvp, vmap), which does not run "
            "the autograd backward pass and hooks the rules work through; call the wrapper outside it, and take "
            "the relevance's derivative with LRP(..., create_graph=True) and torch.autograd.grad "
            f"(torch.func.functional_call is fine){loss_module_transform_advice()}"
        )


def _is_rule_frame(frame: FrameType) -> bool:
    """Whether ``frame`` runs tdhook's attribution code (a rule's hook or Function)."""
    return frame.f_globals.get("__name__", "").startswith("tdhook.attribution")


def _frames(err: BaseException) -> list[FrameType]:
    """The frames of ``err``'s traceback, outermost first, followed into the error it was raised from."""
    frames: list[FrameType] = []
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        tb: TracebackType | None = err.__traceback__
        while tb is not None:
            if tb.tb_frame not in frames:
                frames.append(tb.tb_frame)
            tb = tb.tb_next
        err = err.__cause__ or err.__context__  # type: ignore[assignment]
    return frames


def _about_transforms(err: BaseException | None) -> bool:
    """Whether ``err``, or an error it was raised from, is torch's refusal of an autograd Function (or hook) under
    a ``torch.func`` transform (its message names functorch)."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if "functorch" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def transform_refusal(
    err: BaseException,
    modules: Mapping[str, nn.Module],
    owner: str = "LRP",
    is_rule_frame: Callable[[FrameType], bool] = _is_rule_frame,
) -> NotImplementedError | None:
    """The error naming a ``torch.func`` transform that the model's forward took through a module with a rule, when
    that is where ``err`` was raised, else ``None``.

    Args:
        err: the error of the model's run.
        modules: the wrapped model's modules by name (the model itself at ``""``).
        owner: the wrapper's name, at the head of the message.
        is_rule_frame: whether a frame runs a rule (tdhook's attribution code).

    Returns:
        A ``NotImplementedError`` naming the module that takes the transform, the transform and the first module
        with a rule it runs through; ``None`` where no transform ran between the model's forward and a rule.
    """
    if not _about_transforms(err):
        return None
    names = {id(module): name for name, module in modules.items()}
    caller: str | None = None
    transforms: list[str] = []
    ruled: str | None = None
    for frame in _frames(err):
        code = frame.f_code
        module = frame.f_locals.get("self") if code.co_name in ("forward", "_call_impl") else None
        if module is not None and id(module) in names:
            if not transforms:
                caller = names[id(module)]  # the innermost module before the transform: the one that takes it
            else:
                ruled = names[id(module)]  # the innermost module inside the transform: the rule's
        elif code.co_filename.replace("\\", "/").find("torch/_functorch/") >= 0 and code.co_name in _TRANSFORMS:
            if caller is not None and _TRANSFORMS[code.co_name] not in transforms:
                transforms.append(_TRANSFORMS[code.co_name])
        elif transforms and ruled is not None and is_rule_frame(frame):
            where = f"module {caller!r}" if caller else "the model itself"
            return NotImplementedError(
                f"{owner}: {where} ({type(modules[caller]).__name__}) calls {', '.join(transforms)} in its own "
                f"forward through module {ruled!r} ({type(modules[ruled]).__name__}), whose rule works through "
                "autograd hooks and Functions that torch.func transforms do not run; take the gradient with "
                f"torch.autograd.grad(..., create_graph=True) instead and call {owner} with create_graph=True (the "
                "rules then act in the relevance pass only), or explain the model outside the transform"
            )
    return None
