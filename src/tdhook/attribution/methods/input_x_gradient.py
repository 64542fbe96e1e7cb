"""Input × gradient: each input times the gradient of the explained output with respect to it."""

from __future__ import annotations

import torch

from tdhook.attribution.methods._base import AttributionMethod, Call

__all__ = ["InputXGradient"]


class InputXGradient(AttributionMethod):
    """Each explained input times its gradient, written at ``(relevance_key, *in_key)``.

    Takes the arguments of :class:`~tdhook.attribution.methods._base.AttributionMethod`
    (``module``, ``in_keys``, ``out_keys``, ``target_key``, ``target``, ``relevance_key``).

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tdhook.attribution import InputXGradient
        >>> net = torch.nn.Linear(3, 1, bias=False)
        >>> with torch.no_grad():
        ...     _ = net.weight.copy_(torch.tensor([[1.0, -2.0, 3.0]]))
        >>> td = InputXGradient(net, in_keys=["x"], out_keys=["v"])(TensorDict(x=torch.full((3,), 2.0), batch_size=[]))
        >>> td["attribution", "x"], td["attribution", "x"].sum() == td["v"].sum()
        (tensor([ 2., -4.,  6.]), tensor(True))
    """

    _gradient_at_input = True
    _evaluates_copies = False

    def _attribute(self, call: Call) -> list[torch.Tensor]:
        grads = self._input_gradients(call)
        return [x * g for x, g in zip(call.inputs, grads, strict=True)]
