"""The projections ``nn.MultiheadAttention`` computes with its own parameters: the ε of the dense layers.

``F.multi_head_attention_forward`` projects the queries, keys and values with ``in_proj_weight`` (or
``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight``) and the attended values with ``out_proj.weight``, by
``F.linear`` calls of its own: ``out_proj`` never runs as a module, and the in-projection is no module at all. So
the ε-rule that AttnLRP(epsilon=ε) and CP-LRP(epsilon=ε) give every Linear layer never reached these four maps,
which kept LRP-0 whatever ε was asked for (under ε = 0.5, a relative L2 error of 2.5 to 5.0 on one attention call
against the same attention written with ``nn.Linear`` layers, 31 to 35 on torchrl's ``ACTModel``). Under
those presets the mode runs the attention's body, and each such ``F.linear`` there gets the same ε-rule as the
Linear layer written out: its output gradient rescaled by ``z / stabilize(z, ε)``.

``out_proj`` keeps the dense layers' rule as a module all the same: called as a module (by a subclass that computes
with it, as ``torch.ao.nn.quantizable.MultiheadAttention`` does, or by the user's code elsewhere) it takes the ε as
any Linear layer. In a context's first pass each projection notes its weight with the rule it got (see
:func:`projected_with`), so that a module whose weight its parent projected with the module's own rule is not named
as a rule without effect.

Examples:
    >>> import torch
    >>> import torch.nn.functional as F
    >>> from tdhook.attribution.rules.basic import EpsilonRule
    >>> x, weight = torch.ones(1, 2, requires_grad=True), torch.tensor([[0.5, 0.5]])
    >>> z = projected(EpsilonRule(epsilon=1.0), (x, weight), {})
    >>> z.item(), torch.autograd.grad(z.sum(), x)[0].tolist()  # z / (z + ε) = 1 / 2 of the plain gradient
    (1.0, [[0.25, 0.25]])
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tdhook.attribution.rules._autograd import call_argument, is_activation, mark_parameter_derived, scale_gradient
from tdhook.attribution.rules._first_pass import first_pass
from tdhook.attribution.rules._keeping_graph import graph_kept

if TYPE_CHECKING:
    from tdhook.attribution.rules.basic import EpsilonRule

__all__ = ["ATTENTION_BODIES", "projected", "projected_with"]

#: the functions whose ``F.linear`` calls by parameters are the projections of a module's own layers
ATTENTION_BODIES = (F.multi_head_attention_forward,)

# What a projection notes in the first pass's set (see :func:`first_pass`), with its weight's id and its rule's.
_PROJECTED = "a weight projected with a rule"


def projected(rule: EpsilonRule, args: tuple, kwargs: dict) -> torch.Tensor:
    """``F.linear(*args, **kwargs)`` by a weight made of parameters, under ``rule`` as its Linear layer would be."""
    output = mark_parameter_derived(args, F.linear(*args, **kwargs), F.linear)
    noted = first_pass()
    if noted is not None:  # the weight got the rule here, whether or not its module runs (see projected_with)
        noted.add((_PROJECTED, id(call_argument(args, kwargs, 1, "weight")), id(rule)))
    if not is_activation(output):  # of constants and parameters alone (a query not explained): no relevance passes
        return output  # (a rule there would make it an activation, which the products after it would share with)
    if graph_kept() is not None:  # the rule's factor from the output and its history, as the layer's rule takes it
        return rule._redirect_keeping_graph(output, 1)
    return scale_gradient(output, rule._scale_of(output.detach(), 1), in_place=True)


def projected_with(noted: set | None, module: torch.nn.Module, rule: EpsilonRule) -> bool:
    """Whether, in the first pass whose notes are ``noted``, a projection took ``module``'s weight with ``rule``.

    Examples:
        >>> from tdhook.attribution.rules._first_pass import watching_first_pass
        >>> from tdhook.attribution.rules.basic import EpsilonRule
        >>> layer, rule = torch.nn.Linear(2, 2), EpsilonRule(epsilon=1.0)
        >>> with watching_first_pass():
        ...     noted = first_pass()
        ...     _ = projected(rule, (torch.ones(1, 2, requires_grad=True), layer.weight, layer.bias), {})
        >>> projected_with(noted, layer, rule), projected_with(noted, layer, EpsilonRule(epsilon=1.0))
        (True, False)
    """
    weight = getattr(module, "weight", None)
    return noted is not None and weight is not None and (_PROJECTED, id(weight), id(rule)) in noted
