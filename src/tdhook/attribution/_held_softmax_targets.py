"""A target whose relevance CP-LRP's held softmax drops: every softmax output is a constant to CP-LRP (it takes
them for attention weights), so the units of an output computed from a softmax, beside units that are not (a
mixture density head's weights concatenated with its means, an actor's probabilities with a value), get no
relevance at all. A target made of such units alone is refused as not depending on the inputs; one sharing its
output tensor with other units reaches the inputs by the graph, through zeros, and is warned of here.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch
from tensordict.utils import NestedKey

from tdhook.attribution._backward_passes import InputsReached, target_relevance
from tdhook.attribution.rules.transformer import AHQKVRule
from tdhook.attribution.targets import EveryUnit, TargetWithoutGradient

__all__ = ["checked_relevance", "warn_for_a_held_softmax_target", "with_held_softmax_cause"]


def holds_softmax(mapper: object) -> bool:
    """Whether ``mapper``'s function modes hold softmax outputs constant (CP-LRP's :class:`AHQKVRule`).

    Examples:
        >>> from tdhook.attribution import CPLRP, AttnLRP, EpsilonPlus
        >>> holds_softmax(CPLRP()), holds_softmax(AttnLRP()), holds_softmax(EpsilonPlus())
        (True, False, False)
    """
    modes = getattr(mapper, "function_modes", list)()
    return any(isinstance(getattr(mode, "softmax", None), AHQKVRule) for mode in modes)


def warn_for_a_held_softmax_target(
    mapper: object,
    key: NestedKey,
    output: torch.Tensor,
    grad_outputs: torch.Tensor | EveryUnit,
    relevances: Sequence[torch.Tensor | None],
) -> None:
    """Warn where the explained inputs' ``relevances`` of target ``key`` are zero everywhere, though its initial
    relevance (``output`` times ``grad_outputs``) is not, and ``mapper`` holds softmax outputs constant.

    Examples:
        >>> from tdhook.attribution import CPLRP
        >>> output = torch.tensor([[0.3, 0.7]])
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_for_a_held_softmax_target(CPLRP(), "y", output, torch.tensor([[1.0, 0.0]]), [torch.zeros(1, 3)])
        >>> "target 'y' gets no relevance" in str(caught[0].message)
        True
    """
    if not holds_softmax(mapper):  # first: the checks below read every relevance, a pass over the input's size
        return
    explained = [r for r in relevances if r is not None]
    if not explained or any(bool(r.detach().any()) for r in explained):
        return
    initial = output.detach() if isinstance(grad_outputs, EveryUnit) else output.detach() * grad_outputs.detach()
    if not bool(initial.any()):
        return
    warnings.warn(
        f"LRP: target {key!r} gets no relevance at any explained input, though its initial relevance is not 0. "
        "CP-LRP holds every softmax output constant (it takes them for attention weights): if the target is computed "
        "from a softmax (a classifier's probabilities, a mixture density head's weights), its units pass no "
        "relevance back (unless every unit between is dead); explain the logits before the softmax, or use AttnLRP, "
        "whose softmax rule passes relevance. A value the model selects from constants (torch.where over a mask "
        "filled with a constant) gets none under any preset",
        stacklevel=4,
    )


def checked_relevance(
    mapper: object,
    one_pass: Callable[[list, bool], tuple[list, list[bool]]],
    output: torch.Tensor,
    grad_outputs: torch.Tensor | EveryUnit,
    extra: list[tuple[torch.Tensor, torch.Tensor]],
    key: NestedKey,
    split_dim: int | None,
    retain: bool,
    reach: InputsReached,
    leaves: list[torch.Tensor | None],
    memory_budget: int,
) -> list[torch.Tensor | None]:
    """:func:`~tdhook.attribution._backward_passes.target_relevance` of the other arguments, warned of where
    ``mapper`` holds a softmax at which the target drops all its relevance (see
    :func:`warn_for_a_held_softmax_target`).

    Examples:
        >>> from tdhook.attribution import CPLRP
        >>> leaf = torch.ones(2, 3, requires_grad=True)
        >>> def one_pass(seeds, keep):
        ...     (output, seed), *_ = seeds
        ...     return [leaf.detach() * torch.autograd.grad(output, leaf, seed, retain_graph=keep)[0]], [True]
        >>> output = leaf * 2
        >>> reach = InputsReached(["x"])
        >>> checked_relevance(CPLRP(), one_pass, output, torch.ones(2, 3), [], "y", None, False, reach, [leaf], 2**20)
        [tensor([[2., 2., 2.],
                [2., 2., 2.]])]
    """
    passes = (extra, key, split_dim, retain, reach)
    relevances = target_relevance(one_pass, output, grad_outputs, *passes, leaves, memory_budget)
    warn_for_a_held_softmax_target(mapper, key, output, grad_outputs, relevances[: len(leaves)])
    return relevances


def with_held_softmax_cause(err: ValueError, mapper: object) -> ValueError:
    """The refusal ``err`` of a target that does not depend on the explained inputs, completed, where ``mapper``
    holds every softmax output constant (CP-LRP), with what that does to a target computed from a softmax; left as
    it is where it names the cause already (statically quantized modules, tensordict's skip of existing keys).

    Examples:
        >>> from tdhook.attribution import CPLRP, EpsilonPlus
        >>> err = TargetWithoutGradient("LRP: target 'y' does not depend on the explained inputs ['x']")
        >>> with_held_softmax_cause(err, EpsilonPlus()) is err
        True
        >>> completed = with_held_softmax_cause(err, CPLRP())
        >>> "CP-LRP holds every softmax output constant" in str(completed), type(completed).__name__
        (True, 'TargetWithoutGradient')
    """
    if not holds_softmax(mapper) or getattr(err, "cause_known", False):
        return err
    return TargetWithoutGradient(
        f"{err}; if it is computed from a softmax (a classifier's probabilities, an nn.Softmax last layer): CP-LRP "
        "holds every softmax output constant (it takes them for attention weights), which cuts such a target from "
        "the inputs. Explain the logits before the softmax, or use AttnLRP, whose softmax rule passes relevance"
    )
