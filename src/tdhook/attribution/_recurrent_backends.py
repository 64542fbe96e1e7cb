"""torchrl's recurrent modules whose recurrent-mode backend runs outside their ``nn.LSTM``/``nn.GRU``: refused.

``LSTMModule`` and ``GRUModule`` run a ``[B, T]`` batch in recurrent mode
through their ``nn.LSTM``/``nn.GRU`` layer (the ``"pad"`` backend), where
:class:`~tdhook.attribution.rules.recurrent.RecurrentRule` applies. Their
``"scan"`` and ``"triton"`` backends (and ``"auto"`` under ``torch.compile``)
compute the recurrence elsewhere, in a custom autograd function or a
higher-order op that no rule sees: the GRU's would keep its plain gradient and
the LSTM's fails inside torch. Inside an LRP context such a module refuses to
run in recurrent mode, naming itself and the way out; step mode always runs
the layer.

Examples:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from torchrl.modules import GRUModule, set_recurrent_mode
    >>> gru = GRUModule(input_size=3, hidden_size=4, in_key="x", out_key="y", recurrent_backend="scan")
    >>> hooks = refuse_bypassing_backends({"gru": gru})
    >>> td = TensorDict(x=torch.randn(2, 5, 3), is_init=torch.zeros(2, 5, 1, dtype=torch.bool), batch_size=[2, 5])
    >>> with set_recurrent_mode(True):
    ...     gru(td)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: LRP: GRUModule 'gru' runs its recurrence with recurrent_backend='scan' in recurrent mode, ...
    >>> for hook in hooks:
    ...     hook.remove()
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.compiler import is_compiling
from torch.utils.hooks import RemovableHandle
from torchrl.modules import GRUModule, LSTMModule

__all__ = ["refuse_bypassing_backends"]

# The backends that run the recurrence through the module's nn.LSTM / nn.GRU layer.
_THROUGH_THE_LAYER = ("pad",)


def _refuse(name: str):
    def hook(module: nn.Module, args: tuple) -> None:
        backend = getattr(module, "recurrent_backend", "pad")
        resolved = ("scan" if is_compiling() else "pad") if backend == "auto" else backend
        if module.recurrent_mode and resolved not in _THROUGH_THE_LAYER:
            layer = "nn.LSTM" if isinstance(module, LSTMModule) else "nn.GRU"
            raise ValueError(
                f"LRP: {type(module).__name__} {name!r} runs its recurrence with recurrent_backend={backend!r} in "
                f"recurrent mode, outside its {layer} layer, where no rule sees it (the recurrent rule applies to "
                f"the layer); set module.recurrent_backend = 'pad' (the same parameters) while explaining it, or "
                "explain step by step outside recurrent mode"
            )

    return hook


def refuse_bypassing_backends(modules: Mapping[str, nn.Module], into: list | None = None) -> list[RemovableHandle]:
    """Make every torchrl ``LSTMModule``/``GRUModule`` among ``modules`` refuse to run in recurrent mode with a
    backend other than ``"pad"``; the returned hook handles end it. With ``into``, each handle is appended to it as
    soon as its hook is registered (a registration that fails then leaves none unlisted), and ``into`` is returned."""
    handles = [] if into is None else into
    for name, module in modules.items():
        if isinstance(module, (LSTMModule, GRUModule)):
            handles.append(module.register_forward_pre_hook(_refuse(name)))
    return handles
