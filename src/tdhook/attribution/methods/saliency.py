"""Saliency: the gradient of the explained output with respect to each input, in absolute value by default."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import nn

from tdhook.attribution.methods._base import AttributionMethod, Call
from tdhook.attribution.methods._options import checked_flag
from tdhook.attribution.methods._settable_options import CheckedOption
from tdhook.attribution.targets import Target

__all__ = ["Saliency"]


class Saliency(AttributionMethod):
    """The input gradient of the explained output, written at ``(relevance_key, *in_key)``.

    Args:
        module: a ``TensorDictModuleBase``, or a plain ``nn.Module`` with ``in_keys`` and ``out_keys``.
        in_keys: see :class:`~tdhook.attribution.methods._base.AttributionMethod`.
        out_keys: the output keys of a plain module.
        target_key: the output to explain.
        target: ``None``, an int, a LongTensor, a callable or ``"all"`` (as for LRP).
        relevance_key: the prefix of the attribution keys.
        abs: whether to write the gradient's absolute value.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tdhook.attribution import Saliency
        >>> net = torch.nn.Linear(3, 2)
        >>> with torch.no_grad():
        ...     _ = net.weight.copy_(torch.tensor([[1.0, -2.0, 3.0], [0.0, 0.0, 0.0]]))
        >>> td = Saliency(net, in_keys=["x"], out_keys=["y"], target=0)(TensorDict(x=torch.ones(2, 3), batch_size=[2]))
        >>> td["attribution", "x"]
        tensor([[1., 2., 3.],
                [1., 2., 3.]])
    """

    tunables = {"abs": (bool, {"choices": [True, False]})}

    _gradient_at_input = True
    _evaluates_copies = False

    abs = CheckedOption(checked_flag)  # checked whenever set, as the constructor checks it

    def __init__(
        self,
        module: TensorDictModuleBase | nn.Module,
        *,
        in_keys: Sequence[NestedKey] | None = None,
        out_keys: Sequence[NestedKey] | None = None,
        target_key: NestedKey | None = None,
        target: Target = None,
        relevance_key: str = "attribution",
        abs: bool = True,
    ) -> None:
        super().__init__(
            module,
            in_keys=in_keys,
            out_keys=out_keys,
            target_key=target_key,
            target=target,
            relevance_key=relevance_key,
        )
        self.abs = abs

    def _attribute(self, call: Call) -> list[torch.Tensor]:
        grads = self._input_gradients(call)
        return [g.abs() for g in grads] if self.abs else grads
