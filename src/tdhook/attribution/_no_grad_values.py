"""Outputs of a wrapper called without gradient: the values the model gives its caller in that mode.

A wrapper runs the model with gradient whatever the mode it is called in (a
collector calls its policy under ``torch.no_grad()``). A few torch modules
take another kernel when no gradient is recorded: the float32 ``nn.LSTM`` on
CPU, and the fast path of ``nn.TransformerEncoderLayer``, ``nn.TransformerEncoder``
and ``nn.MultiheadAttention``. Their values then differ from the plain call's in
the last bits, enough to change a recurrent policy's states and, now and then,
its action. While the caller's mode is ``no_grad``, the outermost such module
(:func:`caller_values`) runs its forward once more without gradient and rules,
and its output takes those values, its gradient still flowing through the ruled
pass. The rules' hooks on its parts are set aside for that run (torch's encoder
layers take their fused kernel only where no module of theirs has a hook). The
caller's forward hooks on that module act once, on those values; the caller's
hooks on the modules inside it run in both passes, as the values are computed
through them (the extra run cannot be avoided: no single pass gives both the
values of the kernels without gradient and a graph).
Where the kernels cannot differ it is not run again: on CPU, ``nn.GRU`` (one
kernel in either mode) and ``nn.LSTM`` on float64 inputs (its other kernel,
oneDNN's, takes only float32, bfloat16 and float16).

Examples:
    >>> import torch
    >>> from torch import nn
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> lstm, x = nn.LSTM(3, 4, num_layers=2, batch_first=True), torch.randn(2, 5, 3)
    >>> with torch.no_grad():
    ...     plain = lstm(x)[0]
    >>> hooks, lock = caller_values({"": lstm}), threading.RLock()  # the lock a wrapper holds for its call
    >>> with torch.no_grad(), lock, called_in_grad_mode(torch.is_grad_enabled(), lock), torch.enable_grad():
    ...     y = lstm(x.requires_grad_())[0]
    >>> torch.equal(y, plain), y.requires_grad
    (True, True)
    >>> for hook in hooks:
    ...     hook.remove()
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence
from torch.utils._pytree import tree_map
from torch.utils.hooks import RemovableHandle

from tdhook.attribution.rules._wrapper_calls import current_call, wrapper_call
from tdhook.attribution.rules.base import plain_calls

__all__ = ["called_in_grad_mode", "caller_grad_enabled", "caller_values", "caller_values_in"]

# torch's own modules whose kernels differ with and without gradient (subclasses with their own forward, such as
# torchrl's Python LSTM, compute the same either way).
_BY_GRAD_MODE = (nn.LSTM, nn.GRU, nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerEncoder)

_LOCAL = threading.local()


class called_in_grad_mode:  # a class, not a generator: it costs less per call
    """Record, for this thread and the ``with`` block, the grad mode the wrapper was called in, and that a wrapper's
    call is in progress, marked with ``lock``, the wrapper's lock, held for the call (see
    :class:`~tdhook.attribution.rules._wrapper_calls.wrapper_call`).

    The mode recorded belongs to that call (see :func:`caller_grad_enabled`): an interrupt (``KeyboardInterrupt``)
    arriving before the thread's state is put back leaves a record that no later call takes for its own."""

    __slots__ = ("_call", "_enabled", "_previous")

    def __init__(self, enabled: bool, lock: Any) -> None:
        self._enabled = enabled
        self._call = wrapper_call(lock)

    def __enter__(self) -> None:
        self._previous = getattr(_LOCAL, "enabled", None)
        self._call.__enter__()  # the wrapper's call: its rules act in the block (see rules._wrapper_calls)
        _LOCAL.enabled = self._enabled, self._call, None

    def __exit__(self, *exc_info: object) -> None:
        _LOCAL.enabled = self._previous
        self._call.__exit__()


def caller_grad_enabled() -> bool:
    """Whether the wrapper running now was called with gradient enabled (True outside any wrapper call).

    A record counts while the wrapper's call it was made in (for :func:`caller_values_in`, the call in progress
    then, or none) is the innermost in progress on the thread, and, for :func:`caller_values_in`, while its block
    holds the lock it took: one an interrupt left behind does not."""
    found = getattr(_LOCAL, "enabled", None)  # (the grad mode, the wrapper call's mark, caller_values_in's lock)
    if found is None or found[1] is not current_call():
        return True
    return found[0] if found[2] is None or found[2]._is_owned() else True


def _differs_by_grad_mode(module: nn.Module) -> bool:
    return any(type(module).forward is kind.forward for kind in _BY_GRAD_MODE)


def _same_kernel_either_way(module: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether ``module`` runs the same kernel with and without gradient on these inputs: on CPU, a GRU (torch has
    one CPU kernel for it), or an LSTM on float64 (its oneDNN kernel, the other one, has no float64)."""
    if not isinstance(module, (nn.LSTM, nn.GRU)):
        return False
    data = args[0] if args else kwargs.get("input")
    data = data.data if isinstance(data, PackedSequence) else data
    if not isinstance(data, torch.Tensor) or data.device.type != "cpu":
        return False
    return isinstance(module, nn.GRU) or data.dtype == torch.float64


def _draws_dropout(module: nn.Module) -> bool:
    """Whether a call of ``module`` draws dropout masks (a part in training mode with a dropout probability above
    0): another run would draw other masks, and its values would not be those of the pass explained."""
    for part in module.modules():
        if not part.training:
            continue
        p = part.p if isinstance(part, nn.modules.dropout._DropoutNd) else getattr(part, "dropout", None)
        if isinstance(p, (int, float)) and not isinstance(p, bool) and p > 0:
            return True
    return False


class _CallerValues(torch.autograd.Function):
    """``value``'s numbers with ``output``'s gradient, in every backward pass: the relevance pass's and, in a call
    that keeps the graph, any later one (the derivative of a loss on the relevance or on the outputs)."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        ctx.mark_dirty(value)  # the very storage of the values, with this node as its history
        return value

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, grad


def _route(value: Any, output: Any) -> Any:
    if isinstance(output, torch.Tensor) and output.requires_grad and isinstance(value, torch.Tensor):
        return _CallerValues.apply(value.detach(), output)
    return output


def _caller_values_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    if caller_grad_enabled() or not torch.is_grad_enabled() or _same_kernel_either_way(module, args, kwargs):
        return None
    if _draws_dropout(module):  # the values written are those of the pass explained (random either way)
        return None
    # No rules, and no function modes (a mode active keeps the transformer layers off their fast path). The module's
    # forward alone: its own hooks act once, on the routed output (see caller_values); ``args`` are those its
    # pre-hooks gave.
    with torch.no_grad(), plain_calls(), torch._C.DisableTorchFunction(), _hooks_set_aside(module):
        values = module.forward(*args, **kwargs)
        padded = _padded_constants(module, args, kwargs, values)
    if padded is not None and isinstance(output, torch.Tensor):
        output = output.masked_fill(padded.unsqueeze(-1), 0.0)  # constants there: no gradient reaches the inputs
    return tree_map(_route, values, output)


@contextlib.contextmanager
def _hooks_set_aside(module: nn.Module) -> Iterator[None]:
    """Inside the block, the forward hooks and pre-hooks of this package on ``module``'s parts are set aside, the
    caller's kept. torch's ``nn.TransformerEncoderLayer`` takes its fused kernel without gradient only where none of
    its modules has a hook: the rules' hooks, which do nothing in a run without gradient, would keep it off the
    kernel the plain call takes (a layer run by itself looks at its own hooks too, though its forward alone runs
    here). A hook of the caller's keeps the plain call off it too, and stays."""
    set_aside: list[tuple[nn.Module, str, OrderedDict]] = []
    try:
        for part in module.modules():
            for attribute in ("_forward_hooks", "_forward_pre_hooks"):
                hooks = getattr(part, attribute)
                if any(_ours(hook) for hook in hooks.values()):
                    set_aside.append((part, attribute, hooks))
                    setattr(part, attribute, OrderedDict((k, h) for k, h in hooks.items() if not _ours(h)))
        yield
    finally:
        try:
            _put_back(set_aside)
        finally:
            _put_back(set_aside)  # what an interrupt of the first pass left


def _put_back(set_aside: list[tuple[nn.Module, str, OrderedDict]]) -> None:
    while set_aside:
        part, attribute, hooks = set_aside[-1]
        setattr(part, attribute, hooks)
        set_aside.pop()


def _padded_constants(module: nn.Module, args: tuple, kwargs: dict, values: Any) -> torch.Tensor | None:
    """The padded positions of an ``nn.TransformerEncoder`` that ran on nested tensors without gradient, or ``None``.

    Given a key padding mask (its default ``enable_nested_tensor=True``, ``batch_first``, eval mode), the encoder
    runs without gradient on the unpadded positions only and writes zeros at the padded ones (its final norm's output
    for zeros, if it has one), where the pass with gradient computes values there from the other positions. Those
    written values are constants of the call: the gradient routed to them must be zero, or the relevance would
    explain values that were not written. Found by the values themselves: every padded position holds that constant.
    """
    if not isinstance(module, nn.TransformerEncoder) or not isinstance(values, torch.Tensor) or values.dim() != 3:
        return None
    padding = kwargs.get("src_key_padding_mask", args[2] if len(args) > 2 else None)
    if not isinstance(padding, torch.Tensor) or padding.shape != values.shape[:2] or values.is_nested:
        return None
    if not module.layers[0].self_attn.batch_first:
        return None
    padded = padding if padding.dtype == torch.bool else padding != 0  # a float mask pads where it is not 0
    if not padded.any():
        return None
    constant = values.new_zeros(1, values.shape[-1])
    if module.norm is not None:
        constant = module.norm.forward(constant)
    return padded if torch.equal(values[padded], constant.expand(int(padded.sum()), -1)) else None


def caller_values(modules: Mapping[str, nn.Module], into: list | None = None) -> list[RemovableHandle]:
    """Make the outermost modules among ``modules`` whose kernels depend on the grad mode give, when the wrapper
    was called without gradient, the values of that mode; the returned hook handles end it. With ``into``, each
    handle is appended to it as soon as its hook is registered (an interrupt then leaves none unlisted), and
    ``into`` is returned.

    The hook runs after the wrapper's own hooks on the module and before the caller's (those put there before the
    context, moved behind it in their order, and those put there later), so that the caller's hooks act once, on
    the values written."""
    found = {name: m for name, m in modules.items() if _differs_by_grad_mode(m)}
    outermost = [
        m for name, m in found.items() if not any(name.startswith(f"{o}.") or o == "" for o in found if o != name)
    ]
    handles = [] if into is None else into
    for module in outermost:
        handles.append(module.register_forward_hook(_caller_values_hook, with_kwargs=True))
        handle = handles[-1]
        hooks = module._forward_hooks
        for key in [key for key in hooks if key != handle.id and not _ours(hooks[key])]:
            hooks.move_to_end(key)  # the caller's, in their order, after ours
    return handles


def _ours(hook: Any) -> bool:
    """Whether ``hook`` is one of this package's (a rule's, the wrapper's), by the module defining it."""
    return getattr(hook, "__module__", "").startswith("tdhook.")


@contextlib.contextmanager
def caller_values_in(modules: Mapping[str, nn.Module]) -> Iterator[None]:
    """For a wrapper without rules (the methods other than LRP) that runs the model with gradient: inside the block,
    entered in the caller's grad mode, :func:`caller_values` for ``modules`` where that mode is ``no_grad``, so that
    the outputs it writes are those of the plain call in that mode. Nothing where the caller records gradients.

    Unlike :class:`called_in_grad_mode`, it does not mark a wrapper's call: the rules of an LRP context open on the
    same model do not act in it.

    Examples:
        >>> lstm, x = nn.LSTM(3, 4), torch.randn(5, 2, 3)
        >>> with torch.no_grad():
        ...     plain = lstm(x)[0]
        >>> with torch.no_grad(), caller_values_in({"": lstm}), torch.enable_grad():
        ...     y = lstm(x.requires_grad_())[0]
        >>> torch.equal(y, plain), y.requires_grad
        (True, True)
    """
    if torch.is_grad_enabled():
        yield
        return
    # The record counts while this block holds ``held`` (see caller_grad_enabled), and each hook is listed as soon
    # as it is registered: an interrupt anywhere leaves no record that counts and no hook on the model.
    held, handles = threading.RLock(), []
    with held:
        previous = getattr(_LOCAL, "enabled", None)
        try:
            caller_values(modules, handles)
            _LOCAL.enabled = False, current_call(), held
            yield
        finally:
            try:
                _end_caller_values(previous, handles)
            finally:
                _end_caller_values(previous, handles)  # what an interrupt of the first pass left


def _end_caller_values(previous: Any, handles: list[RemovableHandle]) -> None:
    _LOCAL.enabled = previous
    while handles:  # each listed until it is removed (removing again does nothing)
        handles[-1].remove()
        handles.pop()
