"""Integer or boolean inputs that enter the model as numbers: converted to floating point and mapped linearly.

No gradient reaches an integer tensor, so an input of integers receives relevance only as token ids, through the
``nn.Embedding`` that reads them (:mod:`~tdhook.attribution._tokens`). An integer input that the model converts to
floating point and computes with as numbers (a torchrl critic's one-hot action, ``torch.cat([obs, action.float()])``
into an ``nn.Linear``) holds a share of the relevance that no input receives. The first call of a wrapper watches,
in a function mode, where such inputs go: views, conversions and joins (``cat``, ``stack``) carry their values,
and a linear map (``F.linear``, a convolution, a product with a parameter) that takes them is where their share goes.
Masks (an attention mask turned into additive scores, ``torch.where``, ``masked_fill``) and indices (``gather``,
``index_select``, an embedding's ids) are not values carried that way, and are not reported.

Examples:
    >>> import torch
    >>> layer = torch.nn.Linear(3, 1)
    >>> action = torch.tensor([[0, 1]])
    >>> with NumericInputs({0: action}, {"layer": layer}) as watch:
    ...     _ = layer(torch.cat([torch.ones(1, 1), action.float()], -1))
    >>> watch.found
    {0: "module 'layer' (Linear)"}
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from tensordict.utils import NestedKey
from torch import nn
from torch.overrides import TorchFunctionMode

from tdhook.attribution.mappers.aliases import module_place
from tdhook.attribution.rules._caller import warn_at_caller

__all__ = ["NumericInputs", "report_numeric_inputs", "watch_numeric_inputs"]

Tensor = torch.Tensor

# Calls whose output holds values of their first tensor argument (or of a list of them): views, copies, conversions.
_CARRYING: frozenset[Callable] = frozenset(
    {
        Tensor.to,
        Tensor.float,
        Tensor.double,
        Tensor.half,
        Tensor.bfloat16,
        Tensor.type,
        Tensor.type_as,
        Tensor.view,
        Tensor.reshape,
        Tensor.flatten,
        Tensor.unsqueeze,
        Tensor.squeeze,
        Tensor.permute,
        Tensor.transpose,
        Tensor.contiguous,
        Tensor.clone,
        Tensor.expand,
        Tensor.__getitem__,
        torch.reshape,
        torch.flatten,
        torch.unsqueeze,
        torch.squeeze,
        torch.permute,
        torch.transpose,
        torch.clone,
        torch.cat,
        torch.concat,
        torch.concatenate,
        torch.stack,
        torch.hstack,
        torch.vstack,
        torch.column_stack,
    }
)
_JOINS = frozenset({torch.cat, torch.concat, torch.concatenate, torch.stack, torch.hstack, torch.vstack})
_JOINS |= {torch.column_stack}
# Linear maps whose weight is an argument of their own.
_LAYERS: frozenset[Callable] = frozenset(
    {F.linear, F.bilinear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d}
)
# Products that are a linear map where one factor is a parameter.
_PRODUCTS: frozenset[Callable] = frozenset(
    {torch.matmul, Tensor.matmul, Tensor.__matmul__, Tensor.__rmatmul__, torch.mm, torch.bmm, torch.addmm}
)
_PRODUCTS |= {Tensor.mm, Tensor.bmm}


class NumericInputs(TorchFunctionMode):
    """Follows integer or boolean inputs through views, conversions and joins to the linear maps that take them as
    floating-point numbers.

    Args:
        inputs: by position among the explained keys, the tensor the model is given.
        modules: the model's modules by name, to name the layer of a linear map.

    Attributes:
        found: by input position, the first linear map that took its values as numbers.
    """

    def __init__(self, inputs: Mapping[int, torch.Tensor], modules: Mapping[str, nn.Module]) -> None:
        super().__init__()
        # By id: the input position and the tensor (held, so that its id is not reused during the call).
        self._carriers: dict[int, tuple[int, torch.Tensor]] = {id(t): (i, t) for i, t in inputs.items()}
        self._modules = modules
        self._owners: dict[int, str] | None = None
        self.dtypes = {i: t.dtype for i, t in inputs.items()}
        self.found: dict[int, str] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _CARRYING:
            first = args[0] if args else None
            source = self._source(first) if func not in _JOINS else self._source(*_listed(first))
            if source is not None and isinstance(out, torch.Tensor):
                self._carriers[id(out)] = (source, out)
        elif func in _LAYERS or func in _PRODUCTS:
            self._note(func, args, kwargs or {})
        return out

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._carriers = {}  # the tensors of the call, not kept past it

    def _source(self, *values: object) -> int | None:
        for value in values:
            carrier = self._carriers.get(id(value)) if isinstance(value, torch.Tensor) else None
            if carrier is not None and carrier[1] is value:
                return carrier[0]
        return None

    def _note(self, func: Callable, args: tuple, kwargs: dict) -> None:
        operands = [*args, *kwargs.values()]
        tensors = [v for v in operands if isinstance(v, torch.Tensor)]
        for value in tensors:
            source = self._source(value) if value.is_floating_point() else None
            if source is None or source in self.found:
                continue
            parameters = [t for t in tensors if isinstance(t, nn.Parameter)]
            if func in _PRODUCTS and not parameters:  # a product of activations (attention): no layer
                continue
            self.found[source] = self._where(func, parameters)

    def _where(self, func: Callable, parameters: Sequence[torch.Tensor]) -> str:
        """The module holding the first of ``parameters``, else the function's name."""
        if self._owners is None:
            self._owners = {
                id(p): name for name, module in self._modules.items() for p in module.parameters(recurse=False)
            }
        for parameter in parameters:
            name = self._owners.get(id(parameter))
            if name is not None:
                module = self._modules[name]
                return f"{module_place(name, self._modules)} ({type(module).__name__})"
        return f"{getattr(func, '__name__', func)}"


def _listed(value: object) -> tuple:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


# By wrapper: what its first call found (see watch_numeric_inputs), until report_numeric_inputs takes it.
_FOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def watch_numeric_inputs(lrp: Any, work: Any) -> NumericInputs | None:
    """The watch for ``lrp``'s call on ``work``: its explained keys holding integers or booleans; ``None`` where
    none does. What it finds is kept for :func:`report_numeric_inputs`."""
    inputs = {}
    for i, key in enumerate(lrp.explained_keys):
        value = work.get(key, None)
        if isinstance(value, torch.Tensor) and not (value.is_floating_point() or value.is_complex()):
            inputs[i] = value
    if not inputs:
        return None
    watch = NumericInputs(inputs, lrp.named_explained_modules())
    _FOUND[lrp] = watch
    return watch


def report_numeric_inputs(lrp: Any, leaves: Sequence[torch.Tensor | None]) -> None:
    """Warn of (or, with a ``strict`` rule mapper, refuse) the inputs of ``lrp``'s last watched call that entered
    the model as numbers and are not explained (no embedding read them: their leaf is ``None``); where the caller
    named them in ``in_keys``, refuse them, saying what to do.

    Raises:
        TypeError: an input the caller named enters the model as numbers (or one taken from the module's
            ``in_keys`` where no other input is explained).
        ValueError: the same for an input taken from the module's ``in_keys``, with a ``strict`` rule mapper.
    """
    watch = _FOUND.pop(lrp, None)
    if watch is None or not watch.found:
        return
    strict = bool(getattr(lrp.rule_mapper, "strict", False))
    # Taken from the module's in_keys, and other inputs are explained: it is left out (else nothing is explained).
    left_out = lrp._defaulted_inputs and any(leaf is not None for leaf in leaves)
    for i, where in watch.found.items():
        if leaves[i] is not None:
            continue
        message = _message(lrp.explained_keys[i], watch.dtypes[i], where, left_out)
        if not left_out:
            raise TypeError(message)
        if strict:
            raise ValueError(message)
        warn_at_caller(message)


def _message(key: NestedKey, dtype: torch.dtype, where: str, defaulted: bool) -> str:
    head = f"LRP: input key {key!r} ({dtype}) enters the model as numbers, converted to floating point, through {where}"
    advice = f"store it as a floating-point tensor (for example td[{key!r}] = td[{key!r}].float()) to explain it"
    if defaulted:
        return (
            f"{head}, and is not explained: no gradient reaches integers or booleans, so its share of the relevance "
            f"is not shown and the inputs' relevance does not add up to the output; {advice}, or pass in_keys=[...] "
            "to say that it is left out"
        )
    reason = "no gradient reaches integers or booleans, so it cannot be explained as it is"
    return f"{head}: {reason}; {advice}, or leave it out of in_keys"
