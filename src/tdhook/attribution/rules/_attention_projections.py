"""The projections ``nn.MultiheadAttention`` computes with its own parameters: the ε of the dense layers.

``F.multi_head_attention_forward`` projects the queries, keys and values with ``in_proj_weight`` (or
``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight``) and the attended values with ``out_proj.weight``, by
``F.linear`` calls of its own: ``out_proj`` never runs as a module, and the in-projection is no module at all. So
the ε-rule that AttnLRP(epsilon=ε) and CP-LRP(epsilon=ε) give every Linear layer never reached these four maps,
which kept LRP-0 whatever ε was asked for (under ε = 0.5, a relative L2 error of 2.5 to 5.0 on one attention call
against the same attention written with ``nn.Linear`` layers, 31 to 35 on torchrl's ``ACTModel``). Under
those presets the mode runs the attention's body, and each such ``F.linear`` there gets the same ε-rule as the
Linear layer written out: its output gradient rescaled by ``z / stabilize(z, ε)``.

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

from tdhook.attribution.rules._autograd import mark_parameter_derived, scale_gradient
from tdhook.attribution.rules._keeping_graph import graph_kept

if TYPE_CHECKING:
    from tdhook.attribution.rules.basic import EpsilonRule

__all__ = ["ATTENTION_BODIES", "projected"]

#: the functions whose ``F.linear`` calls by parameters are the projections of a module's own layers
ATTENTION_BODIES = (F.multi_head_attention_forward,)


def projected(rule: EpsilonRule, args: tuple, kwargs: dict) -> torch.Tensor:
    """``F.linear(*args, **kwargs)`` by a weight made of parameters, under ``rule`` as its Linear layer would be."""
    output = mark_parameter_derived(args, F.linear(*args, **kwargs), F.linear)
    if output.grad_fn is None:  # of constants alone (the keys of a fixed memory): nothing to rescale
        return output
    if graph_kept() is not None:  # the rule's factor from the output and its history, as the layer's rule takes it
        return rule._redirect_keeping_graph(output, 1)
    return scale_gradient(output, rule._scale_of(output.detach(), 1), in_place=True)
