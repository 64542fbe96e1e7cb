"""A coverage report: what an LRP call left to the plain gradient, and how much relevance reached the inputs.

A relevance can be wrong without any error: a nonlinear function that no
rule covers keeps its plain gradient, and a bias or a stabiliser absorbs
relevance. :meth:`tdhook.attribution.LRP.coverage` makes both visible.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> from tensordict import TensorDict
    >>> from tdhook.attribution import LRP, EpsilonPlus
    >>> class SineBlock(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.inner = nn.Linear(4, 4)
    ...     def forward(self, x):
    ...         return torch.sin(self.inner(x))
    >>> net = nn.Sequential(nn.Linear(3, 4), SineBlock(), nn.Linear(4, 2))
    >>> lrp = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
    >>> import warnings
    >>> with warnings.catch_warnings(), lrp:
    ...     warnings.simplefilter("ignore")  # the call warns that SineBlock's sin keeps its plain gradient
    ...     _ = lrp(TensorDict(x=torch.randn(5, 3), batch_size=[5]))
    >>> report = lrp.coverage()
    >>> report.plain_gradient
    (PlainGradientCall(module='1', module_type='SineBlock', function='sin', calls=1),)
    >>> report.reached.shape  # one share per sample: the inputs' relevance over the target's
    torch.Size([5])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Coverage", "PlainGradientCall"]


@dataclass(frozen=True)
class PlainGradientCall:
    """A function that is not piecewise linear, called in ``module``'s own forward with no rule covering it.

    Attributes:
        module: the module's name (``""`` for the model itself).
        module_type: the module's class name.
        function: the torch function (``"sin"``, ``"softmax"``, ``"mul"`` for a product of two activations).
        calls: how many times the watched forward pass called it there.

    Examples:
        >>> call = PlainGradientCall(module="1", module_type="SineBlock", function="sin", calls=1)
        >>> print(Coverage(plain_gradient=(call,), reached=None))
        LRP coverage
        plain gradient on calls that are not piecewise linear:
          '1' (SineBlock): sin x1
    """

    module: str
    module_type: str
    function: str
    calls: int


@dataclass(frozen=True)
class Coverage:
    """What an LRP wrapper's calls left to the plain gradient, and how much relevance reached the inputs.

    Attributes:
        plain_gradient: every call that kept its plain gradient although it is not piecewise linear, from the
            forward passes the wrapper watched (its first of each signature; empty: every nonlinear call had a
            rule, or, with ``reached`` ``None``, no call was watched yet).
        reached: for the last call, the explained inputs' relevance summed per sample, as a share of the target's
            relevance (1 where relevance is conserved; below 1 where biases or stabilisers absorbed some). One
            tensor of the batch's shape, or one per named target; ``None`` before the first call.

    Examples:
        >>> print(Coverage(plain_gradient=(), reached=torch.tensor([1.0, 0.5])))
        LRP coverage
        every call that is not piecewise linear has a rule
        relevance reaching the inputs (target): mean 0.75, min 0.5, max 1 of the target's
        >>> print(Coverage(plain_gradient=(), reached=None))
        LRP coverage
        no call yet: the wrapper watches its first call's forward pass, call it first
    """

    plain_gradient: tuple[PlainGradientCall, ...]
    reached: torch.Tensor | dict[str, torch.Tensor] | None

    def __str__(self) -> str:
        lines = ["LRP coverage"]
        if self.reached is None and not self.plain_gradient:
            # Nothing watched yet: "every call has a rule" would vouch for a forward pass no one has run.
            lines.append("no call yet: the wrapper watches its first call's forward pass, call it first")
        elif self.plain_gradient:
            lines.append("plain gradient on calls that are not piecewise linear:")
            for call in self.plain_gradient:
                where = repr(call.module) if call.module else "the model itself"
                lines.append(f"  {where} ({call.module_type}): {call.function} x{call.calls}")
        else:
            lines.append("every call that is not piecewise linear has a rule")
        shares = self.reached if isinstance(self.reached, dict) else {"target": self.reached}
        for name, share in shares.items():
            if share is None or share.numel() == 0:
                continue
            share = share.double()
            lines.append(
                f"relevance reaching the inputs ({name}): mean {share.mean():.4g}, "
                f"min {share.min():.4g}, max {share.max():.4g} of the target's"
            )
        return "\n".join(lines)


def reached_share(batch_dims: int, target: torch.Tensor, relevances: list[torch.Tensor]) -> torch.Tensor:
    """The inputs' relevance summed per sample, over the target's relevance summed per sample (``target``).

    ``target`` has the batch's shape, or one more dimension of output units (``target="all"``); the relevances
    then hold the units after the batch dimensions, and the share has one value per sample and unit.

    Examples:
        >>> reached_share(1, torch.tensor([2.0]), [torch.tensor([[0.5, 1.0, 0.0]])])
        tensor([0.7500], dtype=torch.float64)
    """
    keep = target.dim()
    total = sum(r.double().flatten(keep).sum(-1) if r.dim() > keep else r.double() for r in relevances)
    return total / target.double()
