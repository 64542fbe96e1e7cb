"""What a forward pass computes outside every rule: calls that are not piecewise linear and keep their plain gradient.

Relevance is input × modified gradient. Where the forward pass is piecewise
linear (linear maps, sums, ReLU, max pooling, reshapes), the plain gradient
is already the right one; elsewhere a rule must say how relevance passes.
:class:`NonlinearCalls` watches one forward pass through a ``TorchFunctionMode``
and records, by module, every call on activations that is neither piecewise
linear nor covered by a rule: not by a module's rule (it is not watched
inside modules that have one), nor by one of the rule mapper's function modes
(a mode covers a call when its ``covers(func, args)`` says so). What it
records is decided by what the forward really runs, not by class names. A
custom ``torch.autograd.Function`` runs its forward without gradients, where
the mode sees nothing: its node is found in the graph of the explained
outputs instead, and the module that applied it from the autograd sequence
numbers of the nodes each module call created.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> class Sine(nn.Module):
    ...     def forward(self, x):
    ...         return torch.sin(x)
    >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), Sine())
    >>> calls = NonlinearCalls()
    >>> with calls.watch(dict(net.named_modules()), ruled=set()):
    ...     _ = net(torch.randn(3, 2, requires_grad=True))
    >>> calls.found()
    {'2': {'sin': 1}}
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import BackwardCFunction
from torch.nn.modules._functions import BackwardHookFunction
from torch.overrides import TorchFunctionMode

from tdhook.attribution._argument_kinds import nonlinear_by_arguments
from tdhook.attribution._broadcast_products import BROADCAST_PRODUCT, BroadcastProducts
from tdhook.attribution._cut_signals import DETACHES_IN_PLACE, CutSignals
from tdhook.attribution._function_kinds import (
    NOT_FACTORS,
    PRODUCT_FACTORS,
    PRODUCTS,
    REAL_ONLY,
    RELU_RECURRENCES,
    function_kind,
    is_linear_operator_function,
)
from tdhook.attribution._gradient_hooks import backward_hooks_checked, is_ours, tensor_hook_checked
from tdhook.attribution._offset_products import OFFSET_PRODUCT, OffsetProducts
from tdhook.attribution._operator_calls import (
    OPERATOR_FORM,
    is_operator,
    operator_name,
    unruled_clip,
    unruled_sum,
)
from tdhook.attribution._quantized_calls import CUT, quantizing_call
from tdhook.attribution._random_calls import RANDOM_CALLS, READS, RandomCalls
from tdhook.attribution._random_modules import draw
from tdhook.attribution._straight_through import STRAIGHT_THROUGH, StraightThrough
from tdhook.attribution._unmapped_layers import (
    LAYER_FUNCTIONS,
    MATRIX_PRODUCTS,
    bilinear_layer,
    is_weight,
    matrix_product_layer,
)
from tdhook.attribution._unmerged_norms import merging_rule
from tdhook.attribution.rules._autograd import (
    call_argument,
    is_activation,
    mark_parameter_derived,
    mark_parameter_slots,
    relevance_pass_edges,
    unwrapped,
)
from tdhook.attribution.rules._copied_gates import written_in_place
from tdhook.attribution.rules._dropout_calls import dropout_probability
from tdhook.attribution.rules._in_place_writes import (
    WRITES_IN_PLACE,
    unrecorded_straight_through,
)
from tdhook.attribution.rules._keeping_graph import graph_kept
from tdhook.attribution.rules._keyword_factors import positional_factors
from tdhook.attribution.rules._layer_nodes import LAYER_MARK
from tdhook.attribution.rules._module_inputs import inputs_in_forward
from tdhook.attribution.rules._unrecorded_writes import (
    NOT_READ,
    STRAIGHT_THROUGH_WRITES,
    UNRECORDED,
    assigns_straight_through,
    note_out_write,
    read_unrecorded,
)
from tdhook.attribution.rules.base import _reaches_model_input

__all__ = ["COMPUTED_WEIGHT", "ROUNDING", "NonlinearCalls", "function_kind"]

# A division given a rounding mode (``torch.div(h, 2, rounding_mode="floor")``) is piecewise constant, as ``floor``.
ROUNDING = "rounding_mode="
# A convolution or linear map whose weight is computed from the explained inputs (CondConv's, a hypernetwork's): a
# product of two activations, which its name alone would report as a curved function.
COMPUTED_WEIGHT = "with a weight computed from the inputs: a product of two activations"


_REGISTER_HOOK = torch.Tensor.register_hook
# The calls that take a gradient: a model's forward taking one (a Hamiltonian's vector field, an energy's gradient)
# goes through the rules' backward, in a call that does not keep the graph.
_GRADIENT_CALLS = {torch.autograd.grad: "torch.autograd.grad", torch.autograd.backward: "torch.autograd.backward"}
_GRADIENT_CALLS |= {torch.Tensor.backward: "Tensor.backward"}


def _activations(args: Sequence[Any]) -> int:
    count = 0
    for arg in args:
        if isinstance(arg, (list, tuple)):
            count += sum(1 for a in arg if is_activation(a))
        elif is_activation(arg):
            count += 1
    return count


def _keyword_factors(name: str, kwargs: dict) -> int:
    """How many activations a call passes by keyword as factors of a product (``torch.mul(a, other=b)``)."""
    added = "input" if name in PRODUCT_FACTORS else None
    return _activations([v for k, v in kwargs.items() if k not in NOT_FACTORS and k != added])


def _is_nonlinear_call(func: Any, args: tuple, kwargs: dict | None = None) -> str | None:
    """The function's name when this call on activations is not piecewise linear, else ``None``; an operator called
    through ``torch.ops`` by its full name (``aten.sin.default``)."""
    found = _nonlinear_name(func, args, kwargs)
    full = operator_name(func)
    if found is None or full is None:
        return found
    name = function_kind(func)[0]
    return full + found[len(name) :] if found.startswith(name) else full


def _nonlinear_name(func: Any, args: tuple, kwargs: dict | None = None) -> str | None:
    name, kind = function_kind(func)
    if name in REAL_ONLY and args and is_activation(args[0]) and args[0].is_complex():
        return f"{name} (of a complex tensor)"
    if kind == "linear":
        return None
    if kind == "by arguments":
        return nonlinear_by_arguments(name, func, args, kwargs or {})
    if not _activations(args) and not (kwargs and _activations(kwargs.values())):
        return None
    if name in RELU_RECURRENCES:
        weights = RELU_RECURRENCES[name]
        weights = args[weights] if isinstance(weights, slice) else [a for a in args if isinstance(a, (list, tuple))]
        return name if _activations(weights) else None
    if kind == "product":
        factors = _activations(args[PRODUCT_FACTORS.get(name, slice(None))]) + (
            _keyword_factors(name, kwargs) if kwargs else 0
        )
        if factors > 1 and name in LAYER_FUNCTIONS:  # a convolution or linear map by a weight computed from the input
            return f"{name} ({COMPUTED_WEIGHT})"
        return name if factors > 1 else None
    if kind == "division" and (mode := call_argument(args, kwargs or {}, 2, "rounding_mode")) is not None:
        return f"{name} ({ROUNDING}{mode!r})"  # rounded to a whole number: piecewise constant in the dividend too
    if kind == "division":
        return name if is_activation(call_argument(args, kwargs or {}, 1, "other")) else None
    if kind == "reflected division":
        return name if is_activation(args[0]) else None
    return name


def _is_layer_call(func: Any, args: tuple) -> tuple[str, torch.Tensor] | None:
    """The name to record this call by, and its activation, when it is a convolution or linear map of an activation
    by a weight computed from parameters (what a convolution or Linear layer computes: ``F.conv2d``, ``F.linear``,
    a matrix product such as ``x @ self.W``, ``F.bilinear`` of one activation and a constant), else ``None``."""
    name = function_kind(func)[0]
    if name in MATRIX_PRODUCTS:
        return matrix_product_layer(name, args)
    if name == "bilinear":
        return bilinear_layer(args)
    if name not in LAYER_FUNCTIONS or len(args) < 2 or not is_activation(args[0]):
        return None
    return (name, args[0]) if is_weight(args[1]) else None


# An ``F.batch_norm`` call in training mode outside a BatchNorm module with a rule: its plain gradient runs through
# the batch's statistics, where a BatchNorm module's rule holds them constant.
_TRAINING_NORM = "batch_norm (in training mode, normalising by the batch's own statistics)"


# The batch norm functions, and where their running mean is: ``F.batch_norm(input, running_mean, running_var, weight,
# bias, training, ...)``; ``torch.batch_norm`` and the ATen operator take ``(input, weight, bias, running_mean,
# running_var, training, ...)``.
_BATCH_NORMS = {
    F.batch_norm: 1,
    torch.batch_norm: 3,
    torch.ops.aten.batch_norm: 3,
    torch.ops.aten.batch_norm.default: 3,
}


def _batch_statistics(func: Any, args: tuple, kwargs: dict | None) -> bool:
    """Whether a batch norm call (one of ``_BATCH_NORMS``) normalises by the batch's statistics: in training mode,
    or without running statistics."""
    training = (kwargs or {}).get("training", args[5] if len(args) > 5 else False)
    position = _BATCH_NORMS[func]
    running_mean = (kwargs or {}).get("running_mean", args[position] if len(args) > position else None)
    return bool(training) or running_mean is None


def _next_sequence_number() -> int:
    """The sequence number autograd gives the next node it creates in this thread (nodes are numbered in order)."""
    return torch._C._autograd._get_sequence_nr()


def _grad_fn(result: Any) -> Any:
    tensors = result if isinstance(result, (tuple, list)) else (result,)
    return next((t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None), None)


def _viewed_node(result: Any) -> Any:
    """For an in-place write into a view (``z[:, :3].mul_(h)``), the node of the tensor viewed, which records the
    write (``CopySlices``): the model reads on from that tensor, and the relevance pass reaches that node, not the
    view's own. ``None`` for a write into a tensor that is no view."""
    if not isinstance(result, torch.Tensor):
        return None
    with torch._C.DisableTorchFunction():  # (read where no mode sees it: the rules' mode would mark what it returns)
        base = result._base
    return None if base is None else base.grad_fn


def _graph_nodes(outputs: Sequence[torch.Tensor]) -> set:
    """Every autograd node the ``outputs`` depend on in the relevance pass (see
    :func:`~tdhook.attribution.rules._autograd.relevance_pass_edges`)."""
    seen: set = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(relevance_pass_edges(node))
    return seen


def _ours_calling() -> bool:
    """Whether the code that called the torch function being handled is this package's (a rule probing a module's
    gradient in its hook), not the model's: the first frame outside torch and this module."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name != __name__ and name.partition(".")[0] != "torch":
            return name.startswith("tdhook.")
        frame = frame.f_back
    return False


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors that require grad in ``value`` (a tensor, or a sequence of them)."""
    values = value if isinstance(value, (tuple, list)) else [value]
    return [v for v in values if isinstance(v, torch.Tensor) and v.requires_grad]


def _nodes_between(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor] | None) -> set:
    """The autograd nodes a backward pass from ``outputs`` to ``inputs`` runs: those on a path from one to the
    other, the inputs' own nodes left out (every node behind ``outputs`` where ``inputs`` is ``None``)."""
    if inputs is None:
        return _graph_nodes(outputs)
    stops = {torch.autograd.graph.get_gradient_edge(t).node for t in inputs}
    parents: dict[Any, list] = {}
    seen: set = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node in seen or node in stops:
            continue
        seen.add(node)
        for child in relevance_pass_edges(node):
            parents.setdefault(child, []).append(node)
            stack.append(child)
    between: set = set()
    stack = [parent for stop in stops for parent in parents.get(stop, ())]
    while stack:
        node = stack.pop()
        if node not in between:
            between.add(node)
            stack.extend(parents.get(node, ()))
    return between


def _unwrapped_all(value: Any) -> Any:
    """``value`` without the wrappers of ``torch.func`` transforms: a tensor, or the tensors of a tuple or list
    (a list of the same length), and of the tuples or lists in it (``torch.cat``'s)."""
    if isinstance(value, (tuple, list)):
        return [[unwrapped(u) for u in v] if isinstance(v, (tuple, list)) else unwrapped(v) for v in value]
    return unwrapped(value)


def _is_activation_result(result: Any) -> bool:
    if isinstance(result, (tuple, list)):
        return any(isinstance(r, torch.Tensor) and r.requires_grad for r in result)
    return isinstance(result, torch.Tensor) and result.requires_grad


def _written_in_place(func: Any, args: tuple, kwargs: dict) -> tuple[Any, tuple]:
    """``func(*args, **kwargs)``, an in-place write into ``args[0]``, marked as the function modes mark it (an
    activation written into a weight makes it one; see :mod:`~tdhook.attribution.rules._in_place_writes`), and the
    arguments to judge the call by: ``args[0]`` as it was before the write, a constant where it was no activation
    (``torch.ones(...).mul_(h)`` is a product of a constant and ``h``, as ``torch.ones(...) * h`` is)."""
    target = args[0] if args else None
    if not isinstance(target, torch.Tensor) or is_activation(target):
        return written_in_place(func, args, kwargs), args
    before = target.detach()  # no activation, with the marks the watch reads (a detached term's)
    before.__dict__.update(target.__dict__)
    return written_in_place(func, args, kwargs), (before, *args[1:])


class NonlinearCalls(TorchFunctionMode):
    """Records, per module, the calls of one forward pass that are not piecewise linear and that no rule covers.

    Args:
        modes: the rule mapper's function modes; a call one of them covers (``mode.covers(func, args)``) has a rule.
        refused: called where a hook of the caller's that changes a gradient is refused in the backward pass (see
            :mod:`~tdhook.attribution._gradient_hooks`), after the watch has ended.

    """

    def __init__(self, modes: Sequence[Any] = (), refused: Callable[[], None] = lambda: None) -> None:
        super().__init__()
        self._refused = refused
        self._covering = [mode for mode in modes if hasattr(mode, "covers")]
        # Whether a mode passes relevance through clips: the ATen operators that clip keep their plain gradient.
        self._passes_clips = any(getattr(mode, "passes_clips", False) for mode in modes)
        self._stabilizes_sums = any(getattr(mode, "stabilizes_sums", False) for mode in modes)
        self._calls: list[tuple[str, str, Any]] = []
        # Calls a mode covers that it may give back their plain gradient later in the pass (the CNN presets' held
        # norms, where a product of two activations takes their output): named if it does.
        self._giving_back = [mode for mode in self._covering if hasattr(mode, "gave_back")]
        self._covered_for_now: list[tuple[str, str, Any]] = []
        self._straight_through = StraightThrough()  # sums that part value and gradient with a detached term
        self._cut_signals = CutSignals(self._calls)  # sums with a part of the signal computed without gradient
        self._offsets = OffsetProducts()  # products with a factor that adds a number (``(up + 1) * glu``)
        self._broadcasts = BroadcastProducts()  # Linear layers written ``(x.unsqueeze(-2) * self.W).sum(-1)``
        self._layer_calls: list[tuple[str, str, Any]] = []  # convolutions and linear maps outside layers
        # The outputs of layers whose rule merges a BatchNorm (by autograd node: the layer's name and rule), and the
        # ``F.batch_norm`` calls on them outside a BatchNorm module, which no rule merges.
        self._layer_outputs: dict[Any, tuple[str, Any]] = {}
        self._unmerged_norms: list[tuple[str, str, Any]] = []
        self._first_layer_calls: list[tuple[str, str, Any]] = []  # those of them the model's input reaches first
        self._first_recurrent: list[tuple[str, str, Any]] = []  # recurrent layers the model's input reaches first
        self._dropouts: list[tuple[str, str, Any]] = []  # dropout functions that drop, outside Dropout modules
        self._ruled_dropouts: list[tuple[str, str]] = []  # those in a ruled module's forward, until its output
        self._random_calls = RandomCalls()  # torch's random functions called in the model's own forward
        self._modules: Mapping[str, nn.Module] = {}
        self._stack: list[str] = []
        self._ruled_depth = 0
        self._plain_depth = 0  # inside modules the caller mapped to IgnoreRule: their plain gradient is asked for
        # Per module call: its name, the autograd sequence numbers of the nodes it created (from, to), whether a
        # rule covers it, whether the caller asked for its plain gradient, and for a module with a rule of its own
        # the number where its rule's part ended (its caller's forward hooks run after it: ``None`` before). An
        # autograd Function's node is found in the graph, and its module from these.
        self._spans: list[list] = []
        self._open: list[list] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs and "out" in kwargs:  # an ``out=`` write into an alias, or under no_grad: see _unrecorded_writes
            note_out_write(func, kwargs["out"])
        if UNRECORDED and (read := read_unrecorded(func, args, kwargs or {})) is not NOT_READ:  # _unrecorded_writes
            return read
        if func is _REGISTER_HOOK and len(args) == 2 and is_activation(args[0]) and not is_ours(args[1]):
            where = self._stack[-1] if self._stack else ""  # a gradient clip or scale: refused where it changes one
            args = (args[0], tensor_hook_checked(args[1], where, self._modules.get(where), self._refused))
        elif func in _GRADIENT_CALLS and not self._ruled_depth and graph_kept() is None and not _ours_calling():
            kwargs = kwargs or {}
            outputs = args[0] if args else kwargs.get("outputs", kwargs.get("tensors"))
            inputs = args[1] if func is torch.autograd.grad and len(args) > 1 else kwargs.get("inputs")
            self._raise_for_rules_in(func, outputs, inputs)
        node = None
        cut = func in DETACHES_IN_PLACE and bool(args) and self._cut_signals.carries_signal(args[0])
        if func in WRITES_IN_PLACE:
            result, args = _written_in_place(func, args, kwargs or {})
            node = _viewed_node(result)
        else:
            result = mark_parameter_derived(args, func(*args, **(kwargs or {})), func)
        if not ((func in RANDOM_CALLS or func in READS) and _ours_calling()):  # a draw, or a call computing with one
            self._random_calls.follow(func, args, kwargs, result, self._stack, self._modules)
        if torch._C._are_functorch_transforms_active():  # under torch.vmap: the tensors the graph holds
            self._record(func, _unwrapped_all(args), _unwrapped_all(result), kwargs)
        else:
            self._record(func, args, result, kwargs, node)
        if cut and not (self._plain_depth or self._ruled_depth):  # ``h.detach_()``: a part without gradient now
            self._cut_signals.note_detached(args[0])
        return result

    def _note_ruled_dropout(self, func: Any, args: tuple, result: Any, kwargs: dict) -> None:
        """Note a dropout function that drops in a ruled module's forward (DropConnect's dropout of a weight, in a
        layer's forward or its weight's parametrization): the rule leaves it random from call to call. Reported by
        the ruled module's output, once known; a fused attention's dropout is its rule's to warn of."""
        p = 0.0 if func is F.scaled_dot_product_attention else dropout_probability(func, args, kwargs)
        if not p or not _is_activation_result(result) or any(mode.covers(func, args) for mode in self._covering):
            return
        where = self._stack[-1] if self._stack else ""
        if draw(self._modules.get(where)) is None:  # a module that draws is warned of by name
            self._ruled_dropouts.append((where, f"dropout (p={p})"))

    def _raise_for_rules_in(self, func: Any, outputs: Any, inputs: Any) -> None:
        """Raise where the model's forward takes a gradient (``func``) of ``outputs`` (with respect to ``inputs``,
        or to the leaves where ``None``) through a rule's nodes: the rule would change it, and with it the values
        the model computes from it."""
        now = _next_sequence_number()
        spans = [(s[0], s[1], now if any(s is o for o in self._open) else s[2]) for s in self._spans if s[3]]
        ruled, changed = [], False
        for node in _nodes_between(_tensors(outputs), None if inputs is None else _tensors(inputs)):
            function = getattr(node, "_forward_cls", None) if isinstance(node, BackwardCFunction) else None
            changed |= function is not None and function.__module__.startswith("tdhook.")
            number = node._sequence_nr()
            ruled += [span for span in spans if span[1] <= number < span[2] and span not in ruled]
        if not (ruled or changed):
            return
        where = self._stack[-1] if self._stack else ""
        place = f"module {where!r}" if where else "the model itself"
        kind = f" ({type(self._modules[where]).__name__})" if where in self._modules else ""
        names = sorted(ruled, key=lambda span: span[1])
        plural = "s" if len(names) > 1 else ""
        through = f" through module{plural} {', '.join(repr(name) for name, _, _ in names)}" if names else ""
        raise ValueError(
            f"LRP: {place}{kind} calls {_GRADIENT_CALLS[func]} in its own forward{through}, whose rules change the "
            "gradient: the values the model computes from that gradient would not be its own. Call LRP with "
            "create_graph=True (the rules then act in the relevance pass only), or map the modules the gradient is "
            "taken through to no rule"
        )

    def _record(self, func: Any, args: tuple, result: Any, kwargs: dict | None = None, node: Any = None) -> None:
        """Note the call ``func(*args, **kwargs)`` that returned ``result``, by the autograd node ``node`` (the
        result's own by default) that tells whether the relevance pass reaches it."""
        if self._ruled_depth:
            self._note_ruled_dropout(func, args, result, kwargs or {})
            return
        node = _grad_fn(result) if node is None else node
        if kwargs:  # a product's factors, a function's input, given by keyword: where the function modes read them
            args, kwargs = positional_factors(func, args, kwargs)
        plain = self._plain_depth > 0
        if func in _ASSIGNING and not plain and assigns_straight_through(func, args, is_activation(args[0])):
            # ``h.data = y``: ``h + (y - h).detach()`` written in place (see _unrecorded_writes), named as that sum
            self._calls.append((self._stack[-1] if self._stack else "", STRAIGHT_THROUGH, args[0].grad_fn))
            return
        if func in STRAIGHT_THROUGH_WRITES and not plain:
            source = unrecorded_straight_through(func, args, kwargs or {})
            if source is not None:  # ``c.clamp_(-1, 1)`` under no_grad: ``c + (clamp(c) - c).detach()`` in place
                self._calls.append((self._stack[-1] if self._stack else "", STRAIGHT_THROUGH, source.grad_fn))
                return
        # Read before the straight-through marks: a write in place marks its result, the tensor it read, anew.
        cut_sum = None if plain else self._cut_signals.note(func, args, result, kwargs)
        if not plain and (detached_sum := self._straight_through.note(func, args, result, kwargs)) is not None:
            self._calls.append((self._stack[-1] if self._stack else "", detached_sum, node))
            return
        if cut_sum is not None:  # a sum with a part of the signal computed without gradient, but no estimator
            written = node if node is not None or not args else _grad_fn(args[0])  # ``y[i] = part``: y's node
            self._cut_signals.add(self._stack[-1] if self._stack else "", written, cut_sum)
            return
        if not plain and (quantizing := quantizing_call(function_kind(func)[0], args, result)) is not None:
            self._calls.append((self._stack[-1] if self._stack else "", quantizing, CUT))
            return
        if not _is_activation_result(result):
            return
        p = dropout_probability(func, args, kwargs or {})
        if p and not any(mode.covers(func, args) for mode in self._covering):
            where = self._stack[-1] if self._stack else ""
            if draw(self._modules.get(where)) is None:  # a Dropout module (or one that draws) is warned of by name
                self._dropouts.append((where, f"dropout (p={p})", node))
            return
        if plain:  # in a module the caller mapped to IgnoreRule: the plain gradient it asked for, no call to report
            return
        self._offsets.note(function_kind(func)[0], args, result)
        self._broadcasts.note(function_kind(func)[0], args, result)
        if func in _BATCH_NORMS:
            if _batch_statistics(
                func, args, kwargs
            ):  # normalised by the batch's own statistics: not linear in the input
                if not any(mode.covers(func, args) for mode in self._covering):
                    norm = (
                        operator_name(func) + _TRAINING_NORM[len("batch_norm") :]
                        if is_operator(func)
                        else _TRAINING_NORM
                    )
                    self._calls.append((self._stack[-1] if self._stack else "", norm, node))
                return
            if (layer := self._layer_outputs.get(getattr(args[0], "grad_fn", None) if args else None)) is not None:
                name, rule = layer
                function = f"batch_norm on the output of layer {name!r} ({type(rule).__name__})"
                self._unmerged_norms.append((self._stack[-1] if self._stack else "", function, node))
                return
        name = _is_nonlinear_call(func, args, kwargs)
        if name is not None and not self._covers(func, args, kwargs):
            self._calls.append((self._stack[-1] if self._stack else "", name, node))
        elif name is not None and self._giving_back and node is not None:
            self._covered_for_now.append((self._stack[-1] if self._stack else "", name, node))
        elif name is None and (form := self._unruled_form(func, args, kwargs or {})) is not None:
            call = f"{operator_name(func)} ({OPERATOR_FORM} {form})"
            self._calls.append((self._stack[-1] if self._stack else "", call, node))
        elif name is not None and self._offset_product(name, args):
            self._calls.append((self._stack[-1] if self._stack else "", OFFSET_PRODUCT, node))
        elif name is None and (layer := self._layer_call(func, args, kwargs)) is not None:
            call = (self._stack[-1] if self._stack else "", layer[0], node)
            self._layer_calls.append(call)
            if layer[0] == BROADCAST_PRODUCT and call[2] is not None:  # its sum is a layer's output, as x @ W's is
                call[2].metadata[LAYER_MARK] = True
            if _reaches_model_input(layer[1]):  # as the first-layer rule decides it for a layer: at this call
                self._first_layer_calls.append(call)

    def _unruled_form(self, func: Any, args: tuple, kwargs: dict) -> str | None:
        """For an ATen operator whose torch form a mode gives a rule (a clip, a residual sum): that torch form."""
        if not is_operator(func):
            return None
        clip = unruled_clip(func, args, kwargs) if self._passes_clips else None
        return clip if clip is not None or not self._stabilizes_sums else unruled_sum(func, args, kwargs)

    def _covers(self, func: Any, args: tuple, kwargs: dict | None) -> bool:
        """Whether a mode's rule covers this call, which is not piecewise linear: the rules read a product's factors
        and a division's divisor by position (or by the keywords :mod:`~tdhook.attribution.rules._keyword_factors`
        puts in place), so that another one given by keyword (``torch.addcmul(h, tensor1=a, tensor2=b)``) keeps its
        plain gradient."""
        if kwargs and function_kind(func)[1] in ("product", "division") and _activations(kwargs.values()):
            return False
        return any(mode.covers(func, args) for mode in self._covering)

    def _layer_call(self, func: Any, args: tuple, kwargs: dict | None) -> tuple[str, torch.Tensor] | None:
        """As :func:`_is_layer_call`, and a sum of a broadcast product of an activation by a weight that computes a
        Linear layer's map (see :mod:`~tdhook.attribution._broadcast_products`)."""
        activation = self._broadcasts.layer(function_kind(func)[0], args, kwargs)
        return (BROADCAST_PRODUCT, activation) if activation is not None else _is_layer_call(func, args)

    def found_unmerged_norms(self, targets: Sequence[torch.Tensor] | None = None) -> dict[str, dict[str, int]]:
        """Module name → ``"batch_norm on the output of layer '<name>' (<rule>)"`` → number of calls: eval-mode
        ``F.batch_norm`` calls outside a BatchNorm module on the output of a layer whose rule would merge a
        BatchNorm module there (see :mod:`~tdhook.attribution._unmerged_norms`); ``targets`` as for :meth:`found`."""
        return _count(self._unmerged_norms, None if targets is None else _graph_nodes(targets))

    def _offset_product(self, name: str, args: tuple) -> bool:
        """Whether this product, which a mode's rule covers, has a factor that adds a number to an activation and
        that the rule does not hold (see :mod:`~tdhook.attribution._offset_products`)."""
        if name not in PRODUCTS:
            return False
        factors = tuple(arg for arg in args[PRODUCT_FACTORS.get(name, slice(None))] if is_activation(arg))
        return self._offsets.unheld(factors, any(getattr(mode, "hold_gates", False) for mode in self._covering))

    def found(self, targets: Sequence[torch.Tensor] | None = None) -> dict[str, dict[str, int]]:
        """Module name → function name → number of calls (the model itself is ``""``).

        Args:
            targets: count only the calls whose results these tensors depend on (the explained outputs: a
                distribution built from the logits after them is not explained); ``None``: every call.
        """
        reached = None if targets is None else _graph_nodes(targets)
        given_back = [c for c in self._covered_for_now if any(m.gave_back(c[2]) for m in self._giving_back)]
        return _count([*self._calls, *given_back, *self._function_calls(reached or ())], reached)

    def found_layers(self, targets: Sequence[torch.Tensor] | None = None) -> dict[str, dict[str, int]]:
        """Module name → layer function → number of calls: convolutions and linear maps of activations by weights
        computed from parameters, in modules without a rule (see :mod:`~tdhook.attribution._unmapped_layers`);
        ``targets`` as for :meth:`found`."""
        return _count(self._layer_calls, None if targets is None else _graph_nodes(targets))

    def found_first_layers(self, targets: Sequence[torch.Tensor] | None = None) -> dict[str, dict[str, int]]:
        """Those of :meth:`found_layers` whose activation the model's input reaches through no layer: calls in the
        first layer's place, where a preset puts its first-layer rule (Flat, z^B); ``targets`` as for
        :meth:`found`."""
        return _count(self._first_layer_calls, None if targets is None else _graph_nodes(targets))

    def found_dropouts(self, targets: Sequence[torch.Tensor] | None = None) -> dict[str, dict[str, int]]:
        """Module name → ``"dropout (p=…)"`` → number of calls: dropout functions that drop (training mode, ``p > 0``)
        in a module's own forward, outside any Dropout module and any mode's rule; ``targets`` as for :meth:`found`."""
        return _count(self._dropouts, None if targets is None else _graph_nodes(targets))

    def found_random_calls(self, targets: Sequence[torch.Tensor]) -> dict[str, dict[str, int]]:
        """Module name → random function → number of its draws that reach ``targets`` (see
        :class:`~tdhook.attribution._random_calls.RandomCalls`)."""
        return self._random_calls.found(_graph_nodes(targets))

    def found_first_recurrent(self, targets: Sequence[torch.Tensor] | None = None) -> dict[str, dict[str, int]]:
        """Module name → its class name → number of calls: recurrent layers with a rule (LSTM, GRU, their cells) and
        ReLU RNNs (their plain gradient) whose input the model's input reaches through no layer, where a preset's
        first-layer rule (Flat, z^B) has no form (see
        :func:`~tdhook.attribution._unmapped_layers.report_recurrent_first_layers`); ``targets`` as for
        :meth:`found`."""
        return _count(self._first_recurrent, None if targets is None else _graph_nodes(targets))

    def _function_calls(self, nodes: Iterable[Any]) -> list[tuple[str, str, Any]]:
        """The nodes of custom autograd Functions among ``nodes`` that a module outside every rule applied: their
        backward is the plain gradient, and the mode cannot see into their forward (it runs without gradients)."""
        calls = []
        for node in nodes:
            function = getattr(node, "_forward_cls", None) if isinstance(node, BackwardCFunction) else None
            if function is None or function.__module__.startswith("tdhook.") or function is BackwardHookFunction:
                continue  # not a custom Function, one of the rules' own, or the identity of full backward hooks
            if is_linear_operator_function(function):
                continue  # a linear custom operator's (torchvision's RoIAlign): its plain gradient is LRP-0
            number = node._sequence_nr()
            # The innermost module call whose span holds the node: the one that started last among them, and of
            # those that started with the same number (a module whose first node is its first child's), the one
            # called last (the spans are in the order of the calls).
            spans = [span for span in self._spans if span[1] <= number < span[2]]
            if spans:
                name, _, _, ruled, plain, rule_end = max(reversed(spans), key=lambda span: span[1])
                # In a forward hook of the caller's on a module with a rule (after the rule's part): no rule's.
                covered = ruled and (rule_end is None or number < rule_end)
                if not (covered or plain):
                    calls.append((name, f"{function.__name__} (an autograd.Function with its own backward)", node))
        return calls

    @contextlib.contextmanager
    def watch(
        self,
        modules: Mapping[str, nn.Module],
        ruled: set[int],
        layer_rules: Mapping[int, Any] | None = None,
        plain: set[int] | frozenset[int] = frozenset(),
    ) -> Iterator[NonlinearCalls]:
        """Run the block in this mode, knowing which module runs each call.

        Args:
            modules: the model's modules by name.
            ruled: ``id`` of every module that has a rule of its own (calls inside it are not watched).
            layer_rules: ``id`` of a Linear or convolution layer → its rule, for the layers whose rule would merge
                a BatchNorm module that follows them into the layer (see :meth:`found_unmerged_norms`).
            plain: ``id`` of every module the caller mapped to the plain gradient (an
                :class:`~tdhook.attribution.rules.basic.IgnoreRule` of its own): the nonlinear calls inside it are
                what was asked for, and are not reported.
        """
        layer_rules = layer_rules or {}
        self._modules = modules
        hooks = []

        def enter(name: str, has_rule: bool, is_plain: bool):
            def hook(module: nn.Module, args: tuple) -> None:
                mark_parameter_slots(module)  # parameters put in by ``to_module`` are parameters, not activations
                self._cut_signals.note_module_input(module, args)
                self._stack.append(name)
                self._ruled_depth += has_rule
                self._plain_depth += is_plain
                number = _next_sequence_number()
                span = [name, number, number, self._ruled_depth > 0, self._plain_depth > 0, None]
                self._spans.append(span)
                self._open.append(span)

            return hook

        def rule_done(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            # A ruled module's forward and its rule's hook are over: its caller's forward hooks, which run next,
            # compute as code after the module does (their calls are watched, under the module's name, and so are
            # the nodes of the autograd Functions they apply).
            self._ruled_depth -= 1
            if self._open:
                self._open[-1][5] = _next_sequence_number()

        def leave(name: str, has_rule: bool, is_plain: bool):
            rule = layer_rules.get(id(modules[name]))
            # A recurrent layer with a rule, or a ReLU RNN (LRP-0 by its plain gradient): no first-layer rule.
            is_recurrent = isinstance(modules[name], (nn.RNNBase, nn.RNNCellBase)) and (
                has_rule or getattr(modules[name], "nonlinearity", None) == "relu"
            )

            def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
                if kwargs and not args:  # the input by keyword (``layer(input=x)``, ``lstm(hx=state, input=x)``)
                    args = inputs_in_forward(module, (), kwargs)
                if rule is not None and isinstance(output, torch.Tensor) and output.grad_fn is not None:
                    acting = merging_rule(rule, args)
                    if acting is not None:
                        self._layer_outputs[output.grad_fn] = (name, acting)
                if is_recurrent and args and isinstance(args[0], torch.Tensor) and _reaches_model_input(args[0]):
                    self._first_recurrent.append((name, type(module).__name__, _grad_fn(output)))
                if (joined := self._cut_signals.note_module(module, args, output, has_rule)) is not None:
                    self._cut_signals.add(
                        name, _grad_fn(output if isinstance(output, torch.Tensor) else output[0]), joined
                    )
                if has_rule and not self._ruled_depth and self._ruled_dropouts:  # the outermost ruled module's
                    self._dropouts += [(where, what, _grad_fn(output)) for where, what in self._ruled_dropouts]
                    self._ruled_dropouts.clear()
                if self._stack:
                    self._stack.pop()
                self._plain_depth -= is_plain
                if self._open:
                    self._open.pop()[2] = _next_sequence_number()

            return hook

        try:
            for name, module in modules.items():
                has_rule, is_plain = id(module) in ruled, id(module) in plain
                hooks.append(module.register_forward_pre_hook(enter(name, has_rule, is_plain)))
                if has_rule:
                    hooks.append(module.register_forward_hook(rule_done, with_kwargs=True, always_call=True))
                    _before_callers_hooks(module, hooks[-1])
                hooks.append(
                    module.register_forward_hook(leave(name, has_rule, is_plain), with_kwargs=True, always_call=True)
                )
            with self, backward_hooks_checked(modules, self._refused):
                yield self
        finally:
            for hook in hooks:
                hook.remove()
            self._stack.clear()
            self._modules = {}
            self._open.clear()
            self._ruled_depth = self._plain_depth = 0
            self._ruled_dropouts.clear()
            self._straight_through.forget()
            self._cut_signals.forget()
            self._layer_outputs.clear()
            self._offsets.forget()
            self._broadcasts.forget()


def _before_callers_hooks(module: nn.Module, handle: Any) -> None:
    """Move the forward hooks the caller put on ``module`` after the one of ``handle`` (registered last), keeping
    their order: this package's own (a rule's, first) run before it."""
    forward_hooks = module._forward_hooks
    for key in [key for key, hook in forward_hooks.items() if key != handle.id and not is_ours(hook)]:
        forward_hooks.move_to_end(key)


def _count(calls: Iterable[tuple[str, str, Any]], reached: set | None) -> dict[str, dict[str, int]]:
    """Module name → function name → number of ``calls`` (``(module, function, node)``) whose node is ``reached``
    (every call where it is ``None``)."""
    found: dict[str, dict[str, int]] = {}
    for module, name, node in calls:
        if reached is None or node in reached or node is CUT:  # a cut branch: its node is never reached
            per_module = found.setdefault(module, {})
            per_module[name] = per_module.get(name, 0) + 1
    return found


# ``h.data = y``: a straight-through estimator where ``h`` is an activation (see _unrecorded_writes).
_ASSIGNING = frozenset({torch.Tensor.data.__set__})
