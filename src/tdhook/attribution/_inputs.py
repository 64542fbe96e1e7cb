"""The explained inputs of one call: checked, then fed to the model as copies of the leaves the relevance is taken for.

Examples:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from tdhook.attribution._tokens import TokenInputs
    >>> td = TensorDict(x=torch.ones(2, 3), batch_size=[2])
    >>> validate_inputs(td, ["x"])
    >>> work = td.copy()
    >>> with torch.enable_grad():
    ...     leaves, fed = feed_inputs(work, ["x"], TokenInputs(["x"]))
    >>> leaves[0].requires_grad, work["x"] is fed[0], describe(td["x"])
    (True, True, 'torch.float32 [2, 3]')
    >>> validate_inputs(td, ["y"])
    Traceback (most recent call last):
    ...
    KeyError: "LRP: input key 'y' is missing from the TensorDict (keys: ['x'])"
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.autograd.forward_ad as forward_ad
from tensordict import TensorDictBase, is_tensorclass
from tensordict.nn import TensorDictModuleBase, TensorDictSequential
from tensordict.utils import NestedKey, unravel_key_list
from torch import nn
from torch.masked import MaskedTensor
from torchrl.modules import GRUModule, LSTMModule

from tdhook.attribution._function_transforms import refuse_outer_transform
from tdhook.attribution._keys import as_tuple
from tdhook.attribution._tokens import TokenInputs
from tdhook.attribution.rules._linked_inputs import linked_input

__all__ = [
    "dtype_mismatch",
    "module_in_recurrent_mode",
    "describe",
    "explained_in_call",
    "feed_inputs",
    "optional_inputs",
    "validate_inputs",
]


def optional_inputs(module: TensorDictModuleBase) -> set[NestedKey]:
    """The input keys ``module`` reads but does without: the recurrent states of torchrl's ``LSTMModule`` and
    ``GRUModule`` (zeros when the TensorDict has none), and the input keys of a ``TensorDictSequential`` built with
    ``partial_tolerant=True`` (it runs the modules whose inputs the TensorDict holds, and skips the others).

    Examples:
        >>> from torchrl.modules import LSTMModule
        >>> sorted(optional_inputs(LSTMModule(input_size=3, hidden_size=4, in_key="obs", out_key="h")))
        ['recurrent_state_c', 'recurrent_state_h']
        >>> from tensordict.nn import TensorDictModule, TensorDictSequential
        >>> heads = [TensorDictModule(torch.nn.Linear(3, 1), [key], [f"{key}_value"]) for key in ("obs", "goal")]
        >>> sorted(optional_inputs(TensorDictSequential(*heads, partial_tolerant=True)))
        ['goal', 'obs']
    """
    keys: set[NestedKey] = set()
    for sub in module.modules():
        if isinstance(sub, (LSTMModule, GRUModule)):
            keys.update(k for k in sub.in_keys[1:] if k != "is_init")
        elif isinstance(sub, TensorDictSequential) and sub.partial_tolerant:
            keys.update(unravel_key_list(list(sub.in_keys)))
    return keys


def module_in_recurrent_mode(module: TensorDictModuleBase) -> tuple[str, TensorDictModuleBase] | None:
    """The name and module of the first torchrl ``LSTMModule``/``GRUModule`` in ``module`` that runs in recurrent
    mode now (reading the last batch dimension as time), or ``None``.

    Examples:
        >>> from torchrl.modules import GRUModule, set_recurrent_mode
        >>> gru = GRUModule(input_size=3, hidden_size=4, in_key="obs", out_key="h")
        >>> module_in_recurrent_mode(gru) is None
        True
        >>> with set_recurrent_mode(True):
        ...     module_in_recurrent_mode(gru)[0]
        ''
    """
    for name, sub in module.named_modules():
        if isinstance(sub, (LSTMModule, GRUModule)) and sub.recurrent_mode:
            return name, sub
    return None


def explained_in_call(
    tensordict: TensorDictBase, keys: Sequence[NestedKey], defaulted: bool, optional: set[NestedKey]
) -> list[bool]:
    """Per key, whether this call explains it.

    Keys the caller named in ``in_keys`` always are. Keys taken from the
    module's ``in_keys`` (``defaulted``) are not when they hold booleans (masks,
    ``is_init``: inputs that steer the model, not evidence), or when they are
    ``optional`` and absent. Integer keys are decided after the forward pass:
    tokens an ``nn.Embedding`` or ``nn.EmbeddingBag`` reads are explained, other integers are not.
    Where that would leave nothing to explain, every key is, so that
    :func:`validate_inputs` names the key that cannot be.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> td = TensorDict(obs=torch.ones(2, 3), is_init=torch.ones(2, 1, dtype=torch.bool), batch_size=[2])
        >>> explained_in_call(td, ["obs", "is_init", "state"], True, {"state"})
        [True, False, False]
        >>> explained_in_call(td, ["obs", "is_init"], False, set())
        [True, True]
    """
    if not defaulted:
        return [True] * len(keys)
    flags = []
    for key in keys:
        value = tensordict.get(key, None)
        if value is None:
            flags.append(key not in optional)
        else:
            flags.append(not (isinstance(value, torch.Tensor) and value.dtype == torch.bool))
    return flags if any(flags) else [True] * len(keys)


def validate_inputs(tensordict: TensorDictBase, keys: Sequence[NestedKey], differentiable: bool = False) -> None:
    """Check that every explained input is there and can receive relevance.

    Args:
        tensordict: the caller's TensorDict.
        keys: the explained input keys.
        differentiable: the call keeps its results differentiable (``create_graph=True``): an input that carries a
            forward-mode tangent is refused, since the results would carry none.

    Raises:
        KeyError: an input is missing.
        TypeError: an input is not a floating-point or integer tensor (a tensorclass or TensorDict is named
            with its entries' keys), is a nested tensor (jagged or strided) or a ``MaskedTensor``, or the
            TensorDict is a tensorclass (its fields cannot take the results).
        RuntimeError: ``torch.inference_mode()`` is active: no gradient, so no relevance.
        NotImplementedError: the call runs under a ``torch.func`` transform (``grad``, ``vmap``, ...).
        ValueError: an input is on the meta device (no values to explain).
        NotImplementedError: ``differentiable`` and an input is a forward-mode dual tensor.
    """
    refuse_outer_transform()
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            "LRP: torch.inference_mode() is active around the call; inference mode blocks the gradients that "
            "relevance is computed from: call the wrapper outside it (torch.no_grad() around it is fine)"
        )
    if is_tensorclass(tensordict):
        raise TypeError(
            f"LRP: the input is a tensorclass ({type(tensordict).__name__}), whose fields are fixed, so the outputs "
            "and relevance keys cannot be written into it; pass a TensorDict (tc.to_tensordict(), or a TensorDict "
            "holding the tensorclass)"
        )
    for key in keys:
        value = tensordict.get(key, None)
        if value is None:
            raise KeyError(
                f"LRP: input key {key!r} is missing from the TensorDict "
                f"(keys: {sorted(map(str, tensordict.keys(include_nested=True, leaves_only=True)))})"
            )
        if is_tensorclass(value) or isinstance(value, TensorDictBase):
            fields = sorted(map(str, value.keys(include_nested=True, leaves_only=True)))[:4]
            # A dict given positionally, lrp({"observation": obs}), is put by tensordict's dispatch at the first
            # in_key, where it holds the in_keys themselves.
            positional = (
                "; a dict given as the call's argument lands at the first in_key: pass a TensorDict, "
                "lrp(TensorDict(..., batch_size=[B])), or keyword tensors, lrp(observation=obs)"
                if isinstance(key, str) and key in value.keys()
                else ""
            )
            raise TypeError(
                f"LRP: input key {key!r} holds a {type(value).__name__}, not a tensor; explain its floating-point "
                f"entries by their nested keys, for example in_keys={[(key, f) for f in fields]!r}{positional}"
            )
        if not isinstance(value, torch.Tensor) or value.dtype == torch.bool or value.is_complex():
            dtype = getattr(value, "dtype", type(value).__name__)
            raise TypeError(
                f"LRP: input key {key!r} must be a floating-point tensor (or integer tokens read by an "
                f"nn.Embedding or nn.EmbeddingBag) to receive relevance, got {dtype}; pass in_keys=[...] to explain "
                "only those inputs"
            )
        if value.is_nested:
            layout = "jagged" if value.layout == torch.jagged else "strided"
            raise TypeError(
                f"LRP: input key {key!r} holds a nested tensor ({layout} layout, one length per sample), which the "
                "relevance's gradient and the target's selection cannot take; pad the samples to one length "
                "(torch.nested.to_padded_tensor, with a mask key the model reads) or explain them one sample at a time"
            )
        if isinstance(value, MaskedTensor):
            raise TypeError(
                f"LRP: input key {key!r} holds a torch.masked.MaskedTensor, which the relevance's gradient cannot "
                "take; pass its data (value.get_data()) with the masked entries filled, and the mask "
                "(value.get_mask()) under a key of its own that the model reads"
            )
        if value.is_meta:
            raise ValueError(
                f"LRP: input key {key!r} is on the meta device, which holds shapes but no values: there is no "
                "relevance to compute from it; pass the input (and the model) on a real device"
            )
        if differentiable and forward_ad.unpack_dual(value).tangent is not None:
            raise NotImplementedError(
                f"LRP: input key {key!r} is a forward-mode dual tensor (torch.autograd.forward_ad.make_dual); the "
                "rules work through the reverse-mode backward pass, so neither the outputs nor the relevance would "
                "carry its tangent: pass its primal (forward_ad.unpack_dual(x).primal) with requires_grad=True and "
                "take the relevance's derivative with torch.autograd.grad"
            )


def feed_inputs(
    work: TensorDictBase,
    keys: Sequence[NestedKey],
    tokens: TokenInputs,
    explained: Sequence[bool] | None = None,
    keep_graph: bool = False,
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Replace each explained input in ``work`` by what the model is to see, with gradients enabled.

    A floating-point input becomes a copy of a fresh leaf: in-place operations
    on it are legal and never reach the caller's data. Integer tokens go to
    ``tokens``, whose embedding hooks fill their places later.

    Args:
        work: the copy of the caller's TensorDict that the model runs on.
        keys: the explained input keys.
        tokens: the wrapper's token inputs, cleared for this call.
        explained: per key, whether this call explains it (see :func:`explained_in_call`); the others are
            left as they are. Defaults to all.
        keep_graph: feed an input that requires grad linked to the caller's tensor (differentiable relevance: its
            derivative reaches that tensor; see :func:`~tdhook.attribution.rules._linked_inputs.linked_input`).

    Returns:
        The leaves the relevance is taken for and the tensors fed to the
        model, one per key (``None`` for tokens until embedded, and for the keys not explained).
    """
    leaves: list[torch.Tensor | None] = []
    fed: list[torch.Tensor | None] = []
    for i, key in enumerate(keys):
        if explained is not None and not explained[i]:
            leaves.append(None)
            fed.append(None)
            continue
        value = work.get(key)
        if not value.is_floating_point():
            work.set(key, tokens.feed(i, value, leaves, fed))
            continue
        if value.is_inference():  # made under torch.inference_mode(): a normal copy can require grad
            value = value.clone()
        if keep_graph and value.requires_grad:  # a fresh leaf all the same, linked to the caller's tensor
            leaf, copy = linked_input(value)
        else:
            leaf = value.detach().requires_grad_(True)
            copy = leaf.clone()
        fed.append(copy)
        # A copy of the value ``work`` holds at ``key``: checked already (batch size, device), set as it is.
        work._set_tuple(as_tuple(key), fed[-1], inplace=False, validated=True, non_blocking=False)
        leaves.append(leaf)
    return leaves, fed


def dtype_mismatch(
    tensordict: TensorDictBase, keys: Sequence[NestedKey], model: nn.Module, owner: str = "LRP"
) -> str | None:
    """A note for an error of the model's run: the floating-point inputs whose dtype is not that of the model's
    parameters (where they all share one), or ``None``.

    Args:
        tensordict: the caller's TensorDict.
        keys: the explained input keys.
        model: the wrapped model.
        owner: the wrapper's name, at the head of the note.

    Examples:
        >>> from tensordict import TensorDict
        >>> dtype_mismatch(TensorDict(x=torch.ones(2, 3), batch_size=[2]), ["x"], nn.Linear(3, 1).double())
        "LRP: input 'x' is torch.float32, the model's parameters torch.float64: cast one to the other's dtype \
(td.to(torch.float64) or model.to(torch.float32))"
        >>> dtype_mismatch(TensorDict(x=torch.ones(2, 3), batch_size=[2]), ["x"], nn.Linear(3, 1)) is None
        True
    """
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(dtypes) != 1:
        return None
    (dtype,) = dtypes
    values = [(key, tensordict.get(key, None)) for key in keys]
    odd = [
        (k, v.dtype) for k, v in values if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != dtype
    ]
    if not odd:
        return None
    inputs = ", ".join(f"{key!r} is {value}" for key, value in odd)
    return (
        f"{owner}: input {inputs}, the model's parameters {dtype}: cast one to the other's dtype "
        f"(td.to({dtype}) or model.to({odd[0][1]}))"
    )


def describe(value: Any) -> str:
    """``value`` for an error message: a tensor's dtype and shape, or the type's name.

    Args:
        value: a tensor or any other value.

    Returns:
        For example ``"torch.float32 [2, 3]"`` or ``"TensorDict"``.
    """
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {list(value.shape)}"
    return type(value).__name__
