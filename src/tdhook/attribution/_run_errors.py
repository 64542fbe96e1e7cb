"""The error a failing run of the wrapped model raises: the module, the inputs and what was expected.

An error raised inside the model's run gets notes naming the module that raised
it (where the error says), the inputs' dtypes and shapes, and a dtype the inputs
do not share with the parameters. A parameter or buffer left on the ``meta``
device (a model built with ``device="meta"`` whose weights were never loaded)
fails in torch with "Tensor on device meta is not on the expected device cpu!"
and no module: that error is replaced by one naming the module and the tensor.
Such parameters are not refused before the call, since a network may hold them
without computing with them (torchrl's multi-agent networks keep their template
network's parameters so).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey
from torch import nn

from tdhook.attribution._function_transforms import transform_refusal
from tdhook.attribution._inputs import describe, dtype_mismatch

__all__ = ["run_error"]


# How tensordict refuses a module's output that lacks the TensorDict's batch dimensions, as it writes it.
_BATCH_MISMATCH = "batch dimension mismatch"


def run_error(
    err: Exception,
    tensordict: TensorDictBase,
    keys: Sequence[NestedKey],
    modules: Mapping[str, nn.Module],
    owner: str = "LRP",
) -> Exception:
    """What to raise for ``err``, raised while running the wrapped model on ``tensordict``.

    ``err`` with its notes added (the module that raised it, the inputs, a dtype
    the inputs do not share with the parameters), or, where it is about the
    ``meta`` device and a module holds a tensor there, a ``ValueError`` naming
    that module and tensor, with ``err`` as its cause; where the model's forward
    took a ``torch.func`` transform through a module with a rule, a
    ``NotImplementedError`` naming both (:mod:`._function_transforms`).

    Args:
        err: the error of the model's run.
        tensordict: the caller's TensorDict.
        keys: the explained input keys.
        modules: the wrapped model's modules by name (the model itself at ``""``).
        owner: the wrapper's name, at the head of the notes and of the message.

    Examples:
        >>> from tensordict import TensorDict
        >>> model = nn.Sequential(nn.Linear(2, 2, device="meta"))
        >>> td = TensorDict(x=torch.ones(1, 2), batch_size=[1])
        >>> try:
        ...     model(td["x"] + 0)
        ... except Exception as err:
        ...     error = run_error(err, td, ["x"], dict(model.named_modules()))
        >>> print(error)  # doctest: +NORMALIZE_WHITESPACE
        LRP: the module '0' (Linear) holds its parameter 'weight' on the meta device, which holds shapes but no
        values, while the inputs are on cpu: its parameters and buffers are expected on cpu (load them, for example
        model.to_empty(device='cpu') then model.load_state_dict(...))
    """
    refused = transform_refusal(err, modules, owner)  # a torch.func transform in the forward, through a rule
    if refused is not None:
        refused.__cause__ = err
        return refused
    path = [name for name, module in modules.items() if module is getattr(err, "module", None)]
    if path and getattr(err, "vmapped", False):  # a rule's refusal under torch.vmap: the module by its path
        err = _vmapped(err, path[0], modules, owner)
    elif path:
        err.add_note(f"{owner}: the module is {path[0] or 'the model itself'!r}")
    shapes = ", ".join(f"{key!r}: {describe(tensordict.get(key, None))}" for key in keys)
    err.add_note(f"{owner}: raised while running the wrapped module on the inputs {shapes}")
    model = modules.get("")
    if model is not None and (mismatch := dtype_mismatch(tensordict, keys, model, owner)) is not None:
        err.add_note(mismatch)
    if isinstance(err, RuntimeError) and str(err).startswith(_BATCH_MISMATCH):
        err.add_note(
            f"{owner}: the module returned an output that does not start with the TensorDict's batch shape "
            f"{list(tensordict.batch_size)}: one output per sample is expected (a loss with reduction='mean' is one "
            "number for the whole batch: build it with reduction='none'; or call on a TensorDict whose batch size "
            "the outputs have)"
        )
    on_meta = _on_meta(modules, getattr(err, "module", None)) if "meta" in str(err) else None
    if on_meta is None:
        return err
    name, module, tensor = on_meta
    kind = "parameter" if tensor in module._parameters else "buffer"
    values = [tensordict.get(key, None) for key in keys]
    devices = {str(v.device) for v in values if isinstance(v, torch.Tensor) and not v.is_meta}
    device = devices.pop() if len(devices) == 1 else "the inputs' device"
    where = f"while the inputs are on {device}" if device != "the inputs' device" else "unlike the inputs"
    error = ValueError(
        f"{owner}: the module {name or 'the model itself'!r} ({type(module).__name__}) holds its {kind} {tensor!r} "
        f"on the meta device, which holds shapes but no values, {where}: its parameters and buffers are expected "
        f"on {device} (load them, for example model.to_empty(device={device!r}) then model.load_state_dict(...))"
    )
    error.__cause__ = err
    return error


def _vmapped(err: Exception, path: str, modules: Mapping[str, nn.Module], owner: str) -> Exception:
    """The refusal ``err`` of a rule under ``torch.vmap`` in the model's forward, naming the module by ``path`` (and,
    where a torchrl ``VmapModule`` around it takes the vmap, its ``mock_()``, which calls its module in a loop)."""
    module = modules[path]
    where = f"module {path or 'the model itself'!r} ({type(module).__name__})"
    vmapping = [
        name
        for name, outer in modules.items()
        if type(outer).__name__ == "VmapModule"
        and type(outer).__module__.startswith("torchrl.")
        and (name == "" or path == name or path.startswith(f"{name}."))
    ]
    if vmapping:
        name = vmapping[-1]  # the innermost
        advice = (
            f"; it runs inside torchrl's VmapModule {name or 'the model itself'!r}: call its mock_() before explaining "
            "(it then runs its module on each slice in a loop, which the rules see)"
        )
    else:
        advice = "; call it outside torch.vmap (LRP does so itself for torchrl's multi-agent networks)"
    error = type(err)(
        f"{owner}: {where} runs under torch.vmap in the model's forward, where its rule cannot see the call's "
        f"gradient (the relevance would be the plain gradient){advice}"
    )
    error.module = module  # type: ignore[attr-defined]
    error.vmapped = True  # type: ignore[attr-defined]
    error.__cause__ = err
    return error


def _on_meta(modules: Mapping[str, nn.Module], raising: nn.Module | None) -> tuple[str, nn.Module, str] | None:
    """The first module holding a parameter or buffer on the meta device (the one that raised first, where
    known), its name and the tensor's, or ``None``."""
    named = list(modules.items())
    named.sort(key=lambda item: item[1] is not raising)  # stable: the raising module first, then in order
    for name, module in named:
        for own in (module._parameters, module._buffers):
            for tensor_name, tensor in own.items():
                if tensor is not None and tensor.is_meta:
                    return name, module, tensor_name
    return None
