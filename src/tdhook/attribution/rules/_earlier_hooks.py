"""Forward hooks that run before a rule's own and change a layer's output: refused by name.

A rule's forward hook is registered first among the module's own (``prepend=True``) when a context opens: the
module's forward hooks then act on the rule's output, as code after the layer would, and their change keeps its
plain gradient. Two kinds of hooks still run before it: torch's global forward hooks
(``register_module_forward_hook``), and a hook registered on the module with ``prepend=True`` after the context was
entered. What such a hook changes, the rule would take for the layer's own computation (a hook ``o * 2 + 0.3`` put
first on a small CNN's second convolution in an open context left ``UniformEpsilon`` 0.81 off, relative L2, the same
model explained with the hook written as a module after the layer). Where one is there, the layer is run again on
its input and the outputs compared; a hook that changed nothing (one that records) is let be.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> layer, x = nn.Linear(2, 2), torch.ones(1, 2)
    >>> raise_if_an_earlier_hook_changed(layer, None, (x,), layer(x), global_hook=False)  # the layer's own output
    >>> raise_if_an_earlier_hook_changed(layer, None, (x,), layer(x) * 2, global_hook=False)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: LRP: a forward hook registered with prepend=True after the LRP context was entered changed the ...
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tdhook.attribution.rules._layers import effective_parameters, forward_with

__all__ = ["raise_if_an_earlier_hook_changed"]


def raise_if_an_earlier_hook_changed(
    module: nn.Module, busy: Any, inputs: tuple, output: torch.Tensor, global_hook: bool
) -> None:
    """Raise where a hook that runs before the rule's (``global_hook``: one of torch's global forward hooks; else one
    registered on ``module`` with ``prepend=True``) changed the output of the Linear or convolution layer ``module``.

    Args:
        module: the layer.
        busy: the rule's registration's ``busy`` list (a layer run again inside its rule's own pass).
        inputs: the arguments of the call.
        output: the output the rule's hook was given.
        global_hook: whether torch's global forward hooks are the hooks that ran first.

    Raises:
        ValueError: the output is not the layer's own, naming the kind of hook and what to do instead (the wrapper
            names the module's path from the error's ``module``).
    """
    if len(inputs) != 1 or not isinstance(inputs[0], torch.Tensor):
        return
    if any(nn.parameter.is_lazy(p) for p in module.parameters(recurse=False)):
        return
    with torch.no_grad():
        own = forward_with(module, effective_parameters(module), inputs[0], busy)
    seen = output.detach()
    if own.shape == seen.shape and _same(own, seen):
        return
    kind = type(module).__name__
    if global_hook:
        what = (
            f"a global forward hook (torch.nn.modules.module.register_module_forward_hook) changed the output of {kind}"
        )
        instead = "Register the hook on the module itself (module.register_forward_hook: it then acts after the rule"
    else:
        what = (
            "a forward hook registered with prepend=True after the LRP context was entered changed the output of "
            f"{kind}"
        )
        instead = "Register it without prepend=True, or before entering the context (it then acts after the rule"
    error = ValueError(
        f"LRP: {what} before its rule saw it; the rule would take the hook's change for the layer's own computation. "
        f"{instead}, as code after the layer would), or remove it while explaining."
    )
    error.module = module  # the wrapper names the module's path
    raise error


def _same(own: torch.Tensor, seen: torch.Tensor) -> bool:
    """Whether ``seen`` is ``own`` up to rounding, entry by entry; the tolerance is taken from the finite entries, and
    non-finite ones (a sample holding NaN or inf) must be equal or both NaN.

    Examples:
        >>> own = torch.tensor([1.0, float("nan"), float("inf")])
        >>> _same(own, own.clone()), _same(own, torch.tensor([1.5, float("nan"), float("inf")]))
        (True, False)
    """
    tolerance = 1e-6 * own.abs().where(own.isfinite(), 0).amax() + 1e-30
    close = ((own - seen).abs() <= tolerance) | (own == seen) | (own.isnan() & seen.isnan())
    return bool(close.all())
