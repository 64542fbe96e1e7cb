"""One backward pass of a call: the relevance of the explained inputs' leaves, records added back.

The gradient carries ``leaf * grad``; what it cannot carry (relevance a rule
set at zero inputs, recorded on the rule's registration) is added to the input
it was recorded at, or, carried back through glue, at the input's leaf.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

from tdhook.attribution._checkpointing import reentrant_checkpoint_error
from tdhook.attribution._scaled_passes import relevance_product
from tdhook.attribution.rules._glue import GlueError
from tdhook.attribution.rules._keeping_graph import RelevancePass
from tdhook.attribution.rules._linked_inputs import linked_source
from tdhook.attribution.rules._numerics import UNCARRIED
from tdhook.attribution.rules.base import RemovableRuleHandle

__all__ = ["drop_records", "leaf_relevance"]


def leaf_relevance(
    seeds: Sequence[tuple[torch.Tensor, torch.Tensor]],
    leaves: list[torch.Tensor | None],
    fed: list[torch.Tensor],
    handles: Sequence[RemovableRuleHandle],
    modules: Callable[[], dict[str, nn.Module]],
    retain: bool,
    create_graph: bool = False,
    relevance_pass: RelevancePass | None = None,
) -> tuple[list[torch.Tensor | None], list[bool]]:
    """The relevance of each leaf for the backward pass started at ``seeds``, and whether the leaf was reached
    (``None`` and reached for a leaf that is ``None``: an input the call does not explain).

    Args:
        seeds: ``(tensor, gradient)`` pairs the backward pass starts from (the target output first).
        leaves: the explained inputs' leaves (``None`` for an input the call does not explain).
        fed: the tensors fed to the model, one per leaf.
        handles: the rule handles of the context, whose records are popped.
        modules: the model's modules by name, for naming a layer in an error.
        retain: whether the graph is kept for a later backward pass.
        create_graph: the relevances keep their graph (the graph is then always kept).
        relevance_pass: run while the gradients are taken (see :mod:`~tdhook.attribution.rules._keeping_graph`).

    Examples:
        >>> leaf = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> fed = leaf.clone()
        >>> relevance, reached = leaf_relevance([(fed * 3, torch.ones(2))], [leaf], [fed], [], dict, False)
        >>> relevance, reached
        ([tensor([3., 6.])], [True])
    """
    tensors, grads_out = zip(*seeds, strict=True)
    taken = [leaf for leaf in leaves if leaf is not None]
    keep = retain or create_graph
    try:
        with relevance_pass.running() if relevance_pass is not None else contextlib.nullcontext():
            taken_grads = iter(
                torch.autograd.grad(
                    tensors, taken, grads_out, retain_graph=keep, create_graph=create_graph, allow_unused=True
                )
            )
    except GlueError as err:
        names = {id(m): n for n, m in modules().items()}
        if id(err.module) in names:
            err.add_note(f"LRP: the layer is module {names[id(err.module)]!r}")
        raise
    except RuntimeError as err:
        checkpointed = reentrant_checkpoint_error(err, tensors, modules())
        if checkpointed is not None:
            raise checkpointed from err
        raise
    grads = [None if leaf is None else next(taken_grads) for leaf in leaves]
    relevances: list[torch.Tensor | None] = [
        None
        if leaf is None
        else relevance_product(linked_source(leaf) if create_graph else leaf.detach(), g)
        if g is not None
        else torch.zeros_like(leaf)
        for leaf, g in zip(leaves, grads, strict=True)
    ]
    for handle in holding_records(handles):
        for x, rest in handle.pop_records():
            x = getattr(x, "_tdhook_alias_of", x)
            # At a fed input, or (carried back through glue before the layer) at its leaf.
            matched = False
            for i, (model_input, leaf) in enumerate(zip(fed, leaves, strict=True)):
                if leaf is not None and (x is model_input or x is leaf):
                    relevances[i], matched = relevances[i] + rest, True
            if not matched and x.grad_fn is not None and _uncarried(x, rest):
                raise _lost_record_error(handle, modules)
    return relevances, [leaf is None or g is not None for leaf, g in zip(leaves, grads, strict=True)]


def holding_records(handles: Sequence[RemovableRuleHandle]) -> list[RemovableRuleHandle]:
    """The handles of ``handles`` that hold records, found in one pass without a call per handle (most rules record
    nothing in a call; a transformer's context holds some twenty handles, popped twice a call).

    Examples:
        >>> holding_records([])
        []
    """
    return [h for h in handles if h._registration is not None and h._registration.records]


def drop_records(handles: Sequence[RemovableRuleHandle]) -> None:
    """Pop the records ``handles`` hold, dropping them (the end of a call, however it ended).

    Examples:
        >>> drop_records([])
    """
    for handle in holding_records(handles):
        handle.pop_records()


def _uncarried(x: torch.Tensor, rest: torch.Tensor) -> bool:
    """Whether the record ``rest`` at ``x`` holds relevance the gradient did not carry: at the entries its
    :data:`~tdhook.attribution.rules._numerics.UNCARRIED` mask gives (a record of ``relevance_proxy`` or a built-in
    rule), or else where ``x`` is 0. Elsewhere a record holds the rounding of ``R - x * (R / x)`` alone.

    Examples:
        >>> _uncarried(torch.tensor([0.0, 2.0]), torch.tensor([0.0, 1e-17])), _uncarried(torch.zeros(1), torch.ones(1))
        (False, True)
    """
    mask = getattr(rest, UNCARRIED, None)
    if mask is None:
        mask = x.detach() == 0
    return bool((rest.detach().ne(0) & mask).any())


def _lost_record_error(handle: RemovableRuleHandle, modules: Callable[[], dict[str, nn.Module]]) -> ValueError:
    """The error for relevance a rule set at zero entries of a tensor computed from the inputs, not of an explained
    input: the wrapper adds such records to the inputs they are made at only, and this one would be lost."""
    names = {id(m): n for n, m in modules().items()}
    module = handle.module
    where = f"module {names.get(id(module), '?')!r} ({type(module).__name__})"
    return ValueError(
        f"LRP: {type(handle.rule).__name__} on {where} set relevance at entries of its input where it is 0 (or "
        "where the relevance over it overflows), which the gradient cannot carry back (its registration's records), "
        "and that input is computed from the explained "
        "inputs (by other layers, or by glue such as a Flatten or a concatenation) rather than being one: the "
        "wrapper adds such relevance to an explained input only, so it would be lost. Map the module to a rule whose "
        "relevance is proportional to its input (EpsilonRule; for a sum, stabilize_additions), put the rule on a "
        "layer that reads an explained input key as it is, or, for a first layer behind glue, use FlatRule, "
        "WSquareRule or ZBoxRule, which carry it back through the glue"
    )
