"""TorchScript modules inside an explained model, refused by name when a context is entered.

A module compiled by ``torch.jit.script`` or ``torch.jit.trace`` runs its forward
as TorchScript: neither forward hooks nor torch function modes reach what it
computes, so no rule can act inside it, and its submodules are not the
``nn.Linear`` or ``nn.Conv2d`` a rule mapper looks for. The wrapper refuses such
a model before it registers anything, naming the module.

A module exported to ATen operators (``torch.export.export(...).module()``,
``torch.export.unflatten``, ``make_fx``) is refused alike: its graph calls
``torch.ops.aten.conv2d`` and the like on parameters read by ``get_attr``, so
its layers are no longer the modules a rule mapper maps, and no function rule
matches an ATen operator; its relevance would silently be the plain gradient's.
A graph of ``torch.fx.symbolic_trace`` calls the model's layers as modules and
is explained as the model.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

__all__ = ["refuse_scripted_modules", "refuse_unreachable_relus"]


def refuse_scripted_modules(modules: Mapping[str, nn.Module]) -> None:
    """Raise where one of ``modules`` (the model's, by name) is a TorchScript module or computes with ATen operators.

    Args:
        modules: the wrapped model's modules by name.

    Raises:
        TypeError: naming the first TorchScript module, the class it was compiled from, and what to do; or the
            first module whose graph computes with ATen operators, the operators, and what to do.

    Examples:
        >>> from torch import nn
        >>> refuse_scripted_modules(dict(nn.Sequential(nn.Linear(2, 2), nn.ReLU()).named_modules()))
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> traced = make_fx(nn.Linear(2, 2))(torch.ones(1, 2))
        >>> refuse_scripted_modules(dict(traced.named_modules()))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: LRP: module 'the model itself' (GraphModule) computes with ATen operators (aten.t, ...
    """
    for name, module in modules.items():
        if isinstance(module, torch.jit.ScriptModule):
            path = name or "the model itself"
            origin = getattr(module, "original_name", type(module).__name__)
            raise TypeError(
                f"LRP: module {path!r} ({origin} compiled by torch.jit) is a TorchScript module: its forward runs as "
                "TorchScript, which no forward hook or function mode reaches, so no LRP rule can act inside it. "
                "Explain the module as it was before torch.jit.script or torch.jit.trace."
            )
        operators = _aten_operators(module)
        if operators:
            path = name or "the model itself"
            kind = "GraphModule" if isinstance(module, torch.fx.GraphModule) else type(module).__name__
            raise TypeError(
                f"LRP: module {path!r} ({kind}) computes with ATen operators "
                f"({', '.join(operators[:4])}{', ...' if len(operators) > 4 else ''}), as a model from torch.export "
                "(ExportedProgram.module(), torch.export.unflatten) or make_fx does: its layers are not the modules "
                "a rule mapper maps and no function rule matches an ATen operator, so no LRP rule can act inside "
                "it. Explain the module as it was before it was exported (torch.fx.symbolic_trace keeps the layers)."
            )


def _aten_operators(module: nn.Module) -> list[str]:
    """The ATen operators a module's fx graph calls (``torch.export``, ``make_fx``), in graph order, once each."""
    graph = getattr(module, "graph", None)
    if not isinstance(graph, torch.fx.Graph):
        return []
    found = dict.fromkeys(
        str(node.target.overloadpacket if isinstance(node.target, torch._ops.OpOverload) else node.target)
        for node in graph.nodes
        if node.op == "call_function" and _is_aten(node.target)
    )
    return list(found)


def _is_aten(target: object) -> bool:
    """Whether a graph node's target is an ATen operator (not a custom operator of ``torch.library``, which an
    eager model calls alike)."""
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace == "aten"
    return isinstance(target, torch._ops.OpOverloadPacket) and target._qualified_op_name.startswith("aten::")


def refuse_unreachable_relus(modules: Mapping[str, nn.Module], owner: str) -> None:
    """Raise where one of ``modules`` computes ReLU as TorchScript or as an ATen operator, which neither a forward
    hook on an ``nn.ReLU`` nor a ``TorchFunctionMode`` over Python's ReLU calls reaches (a method that guides each
    ReLU's gradient would leave it plain).

    Args:
        modules: the model's modules by name.
        owner: the method's name, at the head of the message.

    Raises:
        TypeError: naming the first such module and what to do.

    Examples:
        >>> from torch import nn
        >>> scripted = torch.jit.script(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
        >>> refuse_unreachable_relus(dict(scripted.named_modules()), "GuidedBackprop")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: GuidedBackprop: module 'the model itself' (Sequential compiled by torch.jit) computes ReLU ...
        >>> refuse_unreachable_relus(dict(nn.Sequential(nn.Linear(2, 2), nn.ReLU()).named_modules()), "GuidedBackprop")
    """
    for name, module in modules.items():
        if isinstance(module, torch.jit.ScriptModule):
            kind = f"{getattr(module, 'original_name', type(module).__name__)} compiled by torch.jit"
            computes = "aten::relu" in str(module.inlined_graph)
        else:
            kind = "GraphModule" if isinstance(module, torch.fx.GraphModule) else type(module).__name__
            computes = any(op.startswith("aten.relu") for op in _aten_operators(module))
        if computes:
            raise TypeError(
                f"{owner}: module {name or 'the model itself'!r} ({kind}) computes ReLU as TorchScript or an ATen "
                "operator, which neither a hook on an nn.ReLU nor a ReLU call in Python reaches: its ReLUs would keep "
                "their plain gradient. Explain the module as it was before torch.jit or torch.export."
            )
