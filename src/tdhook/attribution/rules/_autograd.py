"""The autograd functions that rewrite a gradient, each written once.

Every LRP rule in tdhook is a change of gradient: the relevance of a tensor ``a``
is ``a * grad(a)``. A rule replaces a module's output by a tensor with the same
value (bit for bit, no copy) whose backward is chosen by the rule:

* :func:`redirect` hands the output gradient to other tensors (for example the
  output of a forward pass with modified weights) through a function of the
  rule's choice.
* :func:`relevance_proxy` stands for an input whose relevance is not
  proportional to its value (the input-layer rules and the uniform rule). Its
  backward receives gradients for stand-in tensors, turns them into relevance
  and hands the caller both the gradient for the input and the part of the
  relevance a gradient cannot carry (where the input is zero).
* :func:`scale_gradient` multiplies the gradient through a tensor by a factor
  (the uniform rule on products, the stabilised residual sums).
* :func:`hold` holds a tensor constant for the relevance (a gate, a normalising
  scale, attention weights under CP-LRP).

In a call that keeps the graph (see :mod:`~tdhook.attribution.rules._keeping_graph`)
each of them changes the gradient during the wrapper's relevance pass only, and
passes the plain gradient in every other backward pass: the model's own
derivative, and the derivative of the relevance through the values the rule
computed with (a held gate is a coefficient of the relevance, and its
derivative reaches the gate's parameters).

The questions a rule's backward asks about the pass it runs in
(:func:`backward_keeps_graph`, :func:`is_batched_gradient`,
:func:`is_plain_gradient`) live here too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import Parameter

from tdhook.attribution.rules._activation_writes import MASKS_MADE, PARAMETER_DERIVED, marked_parameter_derived
from tdhook.attribution.rules._keeping_graph import RelevancePass, graph_kept
from tdhook.attribution.rules._numerics import carrying_gradient, uncarried_rest
from tdhook.attribution.rules._recomputed import error_in_running_module
from tdhook.attribution.rules._rewrites import RUNNING, raise_for_detached, raise_for_gradients, running_rewrite
from tdhook.attribution.rules._same_strides import same_strides
from tdhook.attribution.rules._unrecorded_writes import ALIASING, note_alias

__all__ = [
    "redirect",
    "scale_at_node",
    "first_input_is",
    "relevance_proxy",
    "scale_gradient",
    "hold",
    "is_held",
    "relevance_pass_edges",
    "pass_no_relevance",
    "mark_parameter_slots",
    "from_parameters_alone",
    "mark_module_of_parameters_alone",
    "marked_parameter_derived",
    "backward_keeps_graph",
    "is_batched_gradient",
    "is_plain_gradient",
    "may_overwrite",
    "times_saved",
    "is_activation",
    "mark_parameter_derived",
    "TEMPLATED",
    "call_argument",
    "raise_for_vmap",
    "raise_for_transformed_call",
    "unwrapped",
]


# The questions asked in every rule's backward, looked up once (``None``, or left out, on a torch without them).
_KEEP_GRAPH_QUERY = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
_FUNCTORCH = getattr(torch._C, "_functorch", None)
_BATCHED_CHECKS = tuple(
    check
    for check in (getattr(_FUNCTORCH, name, None) for name in ("is_legacy_batchedtensor", "is_batchedtensor"))
    if check is not None
)


def backward_keeps_graph() -> bool:
    """Whether the running backward pass keeps the graph for another one (``retain_graph`` or ``create_graph``).

    When it does not, the tensors a rule saved for its backward are not needed
    again and the rule may write into them instead of allocating new ones.
    Outside a backward pass, and on a torch without this query, the answer is
    ``True`` (the safe side).

    Examples:
        >>> backward_keeps_graph()
        True
    """
    if torch.compiler.is_compiling():
        return True  # the safe side: a compiled graph is not asked
    return True if _KEEP_GRAPH_QUERY is None else bool(_KEEP_GRAPH_QUERY())


def is_batched_gradient(grad: torch.Tensor) -> bool:
    """Whether ``grad`` is a batch of gradients (``is_grads_batched``, vectorized Jacobians, ``torch.func.vmap``).

    A rule's backward then runs once for the whole batch, and may neither write
    into ``grad`` nor call operations that have no batching rule.

    Examples:
        >>> seen = []
        >>> _ = torch.func.vmap(lambda grad: seen.append(is_batched_gradient(grad)) or grad)(torch.ones(2, 3))
        >>> is_batched_gradient(torch.ones(3)), seen
        (False, [True])
    """
    if torch.compiler.is_compiling():
        return False  # a compiled backward is not a batch of gradients
    for check in _BATCHED_CHECKS:
        if check(grad):
            return True
    return False


BackwardFn = Callable[[torch.Tensor], Sequence[torch.Tensor | None]]


_FREED_GRAPH_GUARD = torch.empty(0)

# A node's metadata key: the positions of its next nodes that only passes other than the relevance pass reach.
_PLAIN_EDGES = "tdhook_plain_edges"
# The attribute that marks what :func:`hold` returned in a call that keeps the graph.
_HELD = "_tdhook_held"


class _Redirect(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, backward_fn: BackwardFn, kept: tuple[bool, ...] | None, output: torch.Tensor, *inputs: torch.Tensor
    ) -> torch.Tensor:
        # ``output`` is a detached alias of the module's output: marking it dirty
        # returns the very same storage with this node as its history, so later
        # in-place operations (ReLU(inplace=True), ``out += identity``) stay legal.
        ctx.mark_dirty(output)
        ctx.backward_fn = backward_fn
        ctx.n_inputs = len(inputs)
        ctx.where = where = running_rewrite() if RUNNING.stack else None  # a rule of one's own: checked
        ctx.shapes = None if where is None else _described(ctx, inputs, kept)
        # A saved tensor makes a second backward pass over a freed graph raise torch's own error: rules may
        # have written into what they kept for the first one (see backward_keeps_graph).
        ctx.save_for_backward(_FREED_GRAPH_GUARD)
        return output

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.saved_tensors  # noqa: B018 (raises once the graph is freed)
        grads = tuple(ctx.backward_fn(grad)) if ctx.shapes is None else _checked_gradients(ctx, ctx.backward_fn(grad))
        if len(grads) != ctx.n_inputs:  # tdhook's own rules (tested against their references): the count only
            raise RuntimeError(f"a rule's backward returned {len(grads)} gradients for {ctx.n_inputs} inputs")
        return (None, None, None, *grads)


class _GraphKeepingRedirect(torch.autograd.Function):
    """:class:`_Redirect` in a call that keeps the graph (see :mod:`~tdhook.attribution.rules._keeping_graph`).

    The module's own output is one more input: the wrapper's relevance pass sends the rule's gradient to
    ``inputs``; every other backward pass (the derivative of a loss on the relevance, a plain gradient) sends
    the incoming gradient to the module's output, through the plain model. The rule's backward runs with torch
    operations only, so that a pass with ``create_graph=True`` records it.
    """

    @staticmethod
    def forward(
        ctx,
        backward_fn: BackwardFn,
        kept: tuple[bool, ...] | None,
        relevance_pass: RelevancePass,
        output: torch.Tensor,
        plain: torch.Tensor,
        *inputs: torch.Tensor,
    ) -> torch.Tensor:
        ctx.mark_dirty(output)
        ctx.backward_fn = backward_fn
        ctx.relevance_pass = relevance_pass
        ctx.n_inputs = len(inputs)
        ctx.where = where = running_rewrite() if RUNNING.stack else None
        ctx.shapes = None if where is None else _described(ctx, inputs, kept)
        return output

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if not ctx.relevance_pass.is_running:
            return (None, None, None, None, grad, *(None for _ in range(ctx.n_inputs)))
        grads = tuple(ctx.backward_fn(grad)) if ctx.shapes is None else _checked_gradients(ctx, ctx.backward_fn(grad))
        if len(grads) != ctx.n_inputs:  # tdhook's own rules (tested against their references): the count only
            raise RuntimeError(f"a rule's backward returned {len(grads)} gradients for {ctx.n_inputs} inputs")
        return (None, None, None, None, None, *grads)


def _described(ctx: Any, inputs: tuple, kept: tuple[bool, ...] | None) -> tuple[torch.Size, ...]:
    """The shapes of a checked redirect's ``inputs``; their dtypes and whether each leads back to the module's input
    (``kept``) are kept on ``ctx`` for :func:`_checked_gradients`."""
    ctx.dtypes = tuple(t.dtype for t in inputs)
    ctx.kept = kept  # a gradient for a tensor that does not lead back to the input is relevance lost
    return tuple(t.shape for t in inputs)


def _checked_gradients(ctx: Any, returned: Any) -> tuple:
    """What a rule's backward returned, as a tuple; an error naming the rule and the module where it gives other
    gradients than its redirect's tensors take: another count, shape or dtype, or a gradient for a tensor without
    history (see :func:`~tdhook.attribution.rules._rewrites.raise_for_gradients`).
    """
    shapes, dtypes, kept = ctx.shapes, ctx.dtypes, ctx.kept
    # A tensor for one tensor is its gradient (not a sequence of its rows); for several, a stack of their gradients.
    grads = (returned,) if len(shapes) == 1 and isinstance(returned, torch.Tensor) else tuple(returned)
    if len(grads) != len(shapes) or not all(
        g is None
        or (isinstance(g, torch.Tensor) and g.shape == shapes[i] and g.dtype == dtypes[i] and (kept is None or kept[i]))
        for i, g in enumerate(grads)
    ):
        raise_for_gradients(ctx.where, shapes, grads, dtypes, kept)
    return grads


def redirect(output: torch.Tensor, inputs: Sequence[torch.Tensor], backward_fn: BackwardFn) -> torch.Tensor:
    """Return ``output``'s value with a backward that sends gradient to ``inputs``.

    The module's own graph behind ``output`` receives no gradient. The value is
    the same storage as ``output``: nothing is copied. In a call that keeps the
    graph (see :mod:`~tdhook.attribution.rules._keeping_graph`), the value is a
    copy, the module's graph receives the gradient in every
    backward pass but the wrapper's relevance pass, and ``backward_fn`` is
    recorded by autograd: it must then use torch operations only, on tensors
    that keep their history.

    Args:
        output: the module's output.
        inputs: tensors that receive gradient (they must require grad to be reached). For a rule of one's own,
            whose module's input requires grad, tensors none of which leads back to that input are refused, and so
            is a gradient for one that does not: the relevance it carries would be lost.
        backward_fn: maps the gradient of the output to one gradient (or ``None``)
            per tensor in ``inputs``, of that tensor's dtype.

    Returns:
        A tensor equal to ``output`` whose gradient flows as ``backward_fn`` says.

    Examples:
        >>> import torch
        >>> x = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> y = redirect(x.exp(), [x], lambda g: [3 * g])
        >>> torch.equal(y, torch.tensor([1.0, 2.0]).exp())
        True
        >>> torch.autograd.grad(y.sum(), x)[0]
        tensor([3., 3.])
    """
    kept = None
    if RUNNING.stack:  # a rule of one's own: tensors none of which leads back to the module's input lose the relevance
        kept = raise_for_detached(inputs)
    relevance_pass = graph_kept()
    if relevance_pass is not None:
        # A copy: rebasing an alias would raise the version of the module's own output, which its backward (a
        # softmax's, a tanh's) may have saved for the plain passes.
        result = _GraphKeepingRedirect.apply(
            backward_fn, kept, relevance_pass, output.detach().clone(), output, *inputs
        )
        result.grad_fn.metadata[_PLAIN_EDGES] = (1,)  # after the copy (no edge): the module's own output
        return result
    value = output.detach()
    if output.grad_fn is not None and hasattr(output.grad_fn, "_saved_result") and any(t is output for t in inputs):
        # The gradient goes on to the output's own node, which saved the output (a tanh's, a softmax's): marking an
        # alias of it dirty would raise the version that node checks.
        value = value.clone()
    return _Redirect.apply(backward_fn, kept, value, *inputs)


def scale_at_node(output: torch.Tensor, scale: torch.Tensor) -> None:
    """Multiply the gradient that reaches ``output``'s autograd node by ``scale`` (see :func:`times_saved`).

    What :func:`redirect` does with a backward ``grad -> [times_saved(grad, scale)]`` towards ``output``
    itself, for less: a hook on the node that made ``output`` (its only output), in place of an autograd
    function of its own. Tensor hooks on ``output`` run before it and see the gradient that reaches
    ``output``, as they would on :func:`redirect`'s result; in-place operations on ``output`` keep the node
    behind their own. Only for a fresh tensor (not a view) that nothing but the rule has seen (see
    :func:`~tdhook.attribution.rules.base.output_seen_by_rule_alone`).

    Examples:
        >>> x = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> y = x * 3
        >>> scale_at_node(y, torch.tensor([0.5, 0.25]))
        >>> torch.autograd.grad(y.relu_().sum(), x)[0]
        tensor([1.5000, 0.7500])
    """

    def hook(grads: tuple) -> tuple:
        (grad,) = grads
        return (None if grad is None else times_saved(grad, scale),)

    output.grad_fn.register_prehook(hook)


def first_input_is(node: Any, x: torch.Tensor) -> bool:
    """Whether ``x`` is what the autograd ``node`` passes its first gradient to (its first next function is
    ``x``'s node, or for a leaf ``x``'s accumulator).

    Examples:
        >>> x = torch.ones(2, requires_grad=True)
        >>> h = x * 2
        >>> first_input_is(torch.tanh(h).grad_fn, h), first_input_is(torch.tanh(h).grad_fn, x)
        (True, False)
    """
    nexts = node.next_functions
    if not nexts:
        return False
    child, index = nexts[0]
    if x.grad_fn is None:
        return getattr(child, "variable", None) is x
    return child is x.grad_fn and index == x.output_nr


RelevanceFn = Callable[[Sequence[torch.Tensor]], torch.Tensor]
RecordFn = Callable[[torch.Tensor], None]


class _RelevanceProxy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, relevance_fn: RelevanceFn, record_fn: RecordFn, x: torch.Tensor, *stand_ins: torch.Tensor):
        ctx.relevance_fn = relevance_fn
        ctx.record_fn = record_fn
        ctx.save_for_backward(x)
        outputs = tuple(s.detach().clone() if s is x else s.detach() for s in stand_ins)
        return outputs if len(outputs) > 1 else outputs[0]

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        (x,) = ctx.saved_tensors
        relevance = ctx.relevance_fn(grads)
        grad_x = carrying_gradient(relevance, x)
        ctx.record_fn(uncarried_rest(relevance, x, grad_x))
        return (None, None, grad_x, *(None for _ in grads))


def relevance_proxy(
    x: torch.Tensor,
    stand_ins: Sequence[torch.Tensor],
    relevance_fn: RelevanceFn,
    record_fn: RecordFn,
) -> tuple[torch.Tensor, ...]:
    """Stand-in tensors for ``x`` whose gradients become ``x``'s relevance.

    The returned tensors have the values of ``stand_ins`` and are connected to
    ``x``. In the backward pass, ``relevance_fn`` turns their gradients into the
    relevance ``R`` of ``x``; ``x`` receives the gradient ``R / x`` (zero where
    ``x`` is zero or the quotient overflows, see :func:`carrying_gradient`), and
    ``record_fn`` receives ``R - x * (R / x)``, the relevance that the gradient
    cannot carry. The LRP wrapper adds it back when ``x`` is
    one of its input keys, and refuses the call where ``x`` is computed from
    them and that part is not zero (it would be lost).

    Args:
        x: the module input the relevance belongs to.
        stand_ins: tensors to compute the modified forward pass with.
        relevance_fn: maps the stand-ins' gradients to the relevance of ``x``.
        record_fn: receives the part of the relevance not carried by the gradient.

    Returns:
        One tensor per stand-in.

    Examples:
        >>> import torch
        >>> x = torch.tensor([0.0, 2.0], requires_grad=True)
        >>> left = []
        >>> (ones,) = relevance_proxy(x, [torch.ones(2)], lambda g: g[0], left.append)
        >>> grad = torch.autograd.grad((ones * torch.tensor([5.0, 4.0])).sum(), x)[0]
        >>> grad, left[0]
        (tensor([0., 2.]), tensor([5., 0.]))
    """
    outputs = _RelevanceProxy.apply(relevance_fn, record_fn, x, *stand_ins)
    return outputs if isinstance(outputs, tuple) else (outputs,)


def is_plain_gradient(grad: torch.Tensor, z: torch.Tensor) -> bool:
    """Whether ``grad`` is one gradient of ``z`` (same shape and dtype, not a batch of gradients as in vectorized
    Jacobians): the element-wise work of the direct paths, which writes with ``out=``, needs that.

    Examples:
        >>> is_plain_gradient(torch.ones(2), torch.zeros(2)), is_plain_gradient(torch.ones(1), torch.zeros(2))
        (True, False)
    """
    return grad.dtype == z.dtype and grad.shape == z.shape and not is_batched_gradient(grad)


def may_overwrite(grad: torch.Tensor, saved: torch.Tensor) -> bool:
    """Whether the backward pass computing with ``grad`` may write into ``saved``: ``grad`` is a plain gradient
    and the pass frees the graph, so ``saved`` is not read again.

    Examples:
        >>> may_overwrite(torch.ones(2), torch.zeros(2))  # outside a backward pass: no
        False
    """
    return is_plain_gradient(grad, saved) and not backward_keeps_graph()


def times_saved(grad: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:
    """``grad * saved``, written into ``saved`` when :func:`may_overwrite` allows it.

    Examples:
        >>> times_saved(torch.tensor([2.0]), torch.tensor([3.0]))
        tensor([6.])
    """
    return saved.mul_(grad) if may_overwrite(grad, saved) else grad * saved


def is_activation(value: Any) -> bool:
    """Whether ``value`` is a tensor computed with autograd history (an activation), as opposed to a parameter,
    a buffer, a constant or a tensor marked as computed from parameters alone (see
    :func:`mark_parameter_derived`). The functional rules change only calls on activations.

    Examples:
        >>> x = torch.ones(2, requires_grad=True)
        >>> is_activation(x), is_activation(2 * x), is_activation(torch.ones(2))
        (False, True, False)
    """
    # requires_grad and not a leaf: the same as having a grad_fn, and cheaper to ask.
    if not (isinstance(value, torch.Tensor) and value.requires_grad and not value.is_leaf):
        return False
    # (The mark read inline where no write mask exists: this runs on every argument of every call.)
    return not (marked_parameter_derived(value) if MASKS_MADE else getattr(value, PARAMETER_DERIVED, False))


def mark_parameter_slots(module: nn.Module) -> None:
    """Mark the tensors in ``module``'s own parameter slots that are computed from parameters alone as parameters.

    ``params.to_module(net)`` (tensordict) and ``torch.func.functional_call`` put tensors into a module's parameter
    slots; torchrl's loss modules do so with views of parameters stacked over an ensemble of Q-networks
    (``loss.qvalue_network_params[i]``), which have autograd history. They are the layer's parameters all the
    same: ``linear(x, weight)`` with such a weight is a linear map of ``x``, not a product of two activations.
    A weight a hypernetwork computes from an input is an activation, and stays one.

    Examples:
        >>> layer = nn.Linear(2, 2)
        >>> stacked = nn.Parameter(torch.ones(3, 2, 2))
        >>> layer._parameters["weight"] = stacked[0]
        >>> is_activation(layer.weight)
        True
        >>> mark_parameter_slots(layer)
        >>> is_activation(layer.weight)
        False
        >>> layer._parameters["weight"] = stacked[0] * torch.ones(2, requires_grad=True)  # from an input
        >>> mark_parameter_slots(layer)
        >>> is_activation(layer.weight)
        True
    """
    for value in module._parameters.values():
        if isinstance(value, torch.Tensor) and value.requires_grad and not value.is_leaf:
            if from_parameters_alone(value):
                setattr(value, PARAMETER_DERIVED, True)


def from_parameters_alone(tensor: torch.Tensor) -> bool:
    """Whether every leaf of ``tensor``'s autograd history that requires grad is an ``nn.Parameter``.

    Examples:
        >>> weight = Parameter(torch.ones(2, 3))
        >>> from_parameters_alone(weight.T * 2), from_parameters_alone(weight * torch.ones(3, requires_grad=True))
        (True, False)
    """
    pending, seen = [tensor.grad_fn], set()
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # an AccumulateGrad node: the leaf itself
        if leaf is not None:
            if not isinstance(leaf, Parameter):
                return False
            continue
        pending.extend(next_node for next_node, _ in node.next_functions)
    return True


def mark_module_of_parameters_alone(args: tuple, output: Any) -> None:
    """Mark ``output`` computed from parameters alone where a module called on tensors that are no activation (a
    time embedding's SiLU, a norm of a learned query, masked or not: modes do not see inside) returned one of those.

    Examples:
        >>> gamma, x = Parameter(torch.ones(3)), torch.ones(3, requires_grad=True)
        >>> doubled = mark_parameter_derived((gamma,), gamma * 2)
        >>> scale, y = torch.sigmoid(doubled), torch.sigmoid(x)
        >>> mark_module_of_parameters_alone((doubled,), scale), mark_module_of_parameters_alone((x,), y)
        (None, None)
        >>> is_activation(scale), is_activation(y)  # y: of the explained input x, no parameter
        (False, True)
    """
    tensors = [arg for arg in args if isinstance(arg, torch.Tensor)]  # ``norm(query, mask=m)``: two constants
    if tensors and not any(map(is_activation, tensors)) and is_activation(output) and from_parameters_alone(output):
        setattr(output, PARAMETER_DERIVED, True)


# Methods whose tensor arguments after the first give only a shape, dtype or device (``w.type_as(x)``): what they
# return is made of the first alone.
TEMPLATED = frozenset(
    {torch.Tensor.type_as, torch.Tensor.to, torch.Tensor.view_as, torch.Tensor.reshape_as, torch.Tensor.expand_as}
)

# Functions that return one tensor per tensor argument, each made of its own argument alone
# (``torch.broadcast_tensors(h, w)``: ``w`` expanded stays a parameter).
PER_ARGUMENT = frozenset(
    {torch.broadcast_tensors, torch.functional.atleast_1d, torch.functional.atleast_2d, torch.functional.atleast_3d}
)


def mark_parameter_derived(args: tuple, result: Any, func: Any = None) -> Any:
    """``result``, marked as computed from parameters alone where every tensor in ``args`` that requires grad is
    an ``nn.Parameter`` or already so marked.

    A layer scale reshaped for broadcasting (``x * gamma.reshape(1, -1, 1, 1)``) or a norm weight written as
    ``1 + weight`` has autograd history, but it is a parameter, not an activation: a product with it is a
    linear map of ``x``, not a product of two activations. The function modes mark such results as they see them.

    Examples:
        >>> gamma = torch.nn.Parameter(torch.ones(3))
        >>> x = torch.ones(2, 3, requires_grad=True) * 1
        >>> is_activation(mark_parameter_derived((gamma, (1, 3)), gamma.reshape(1, 3)))
        False
        >>> is_activation(mark_parameter_derived((x, gamma), x * gamma))
        True
        >>> beta = torch.nn.Parameter(torch.ones(3))
        >>> is_activation(mark_parameter_derived(([gamma, beta],), torch.cat([gamma, beta])))  # a list of them
        False
        >>> [is_activation(piece) for piece in mark_parameter_derived((gamma, 3), gamma.chunk(3))]  # pieces
        [False, False, False]

    ``func``, where given, is the call that made ``result``: for one of :data:`TEMPLATED` (``lam.type_as(q)``, a
    parameter-derived scalar cast to an activation's dtype) only its first argument counts.

        >>> lam = mark_parameter_derived((gamma,), gamma.sum().double())
        >>> is_activation(mark_parameter_derived((lam, x), lam.type_as(x), torch.Tensor.type_as))
        False

    For one of :data:`PER_ARGUMENT`, each output counts its own argument alone.

        >>> pieces = mark_parameter_derived((x, gamma), torch.broadcast_tensors(x, gamma), torch.broadcast_tensors)
        >>> [is_activation(piece) for piece in pieces]
        [True, False]
        >>> pieces = mark_parameter_derived(([x, gamma],), torch.atleast_2d([x, gamma]), torch.atleast_2d)
        >>> [is_activation(piece) for piece in pieces]
        [True, False]
    """
    if func in ALIASING:  # ``c.detach()``, ``c.data``: writes into them autograd does not record (_unrecorded_writes)
        note_alias(func, args, result, bool(args) and is_activation(args[0]))
    if func in TEMPLATED:
        args = args[:1]
    if func in PER_ARGUMENT and len(args) == 1 and isinstance(args[0], (tuple, list)):
        args = tuple(args[0])  # ``torch.atleast_2d((h, w))``: the tensors of one sequence
    if func in PER_ARGUMENT and isinstance(result, (tuple, list)) and len(result) == len(args) > 1:
        for arg, piece in zip(args, result, strict=True):
            mark_parameter_derived((arg,), piece)
        return result
    if isinstance(result, torch.Tensor):
        if not result.requires_grad:
            return result
        outputs = (result,)
    elif isinstance(result, (tuple, list)):  # the pieces of chunk, split or unbind, topk's values
        outputs = [piece for piece in result if isinstance(piece, torch.Tensor) and piece.requires_grad]
        if not outputs:
            return result
    else:
        return result
    derived, held = False, True
    for arg in args:
        # The tensors of a list (torch.cat's, torch.stack's) count as arguments of their own.
        for tensor in arg if isinstance(arg, (list, tuple)) else (arg,):
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                # An activation (the common case) ends the loop at the first attribute test; a leaf that requires
                # grad is a parameter or an input, and only leaves pay for the (Python-level) Parameter test.
                marked = marked_parameter_derived(tensor) if MASKS_MADE else getattr(tensor, PARAMETER_DERIVED, False)
                if not (marked if not tensor.is_leaf else isinstance(tensor, Parameter)):
                    return result
                derived = True
                held = held and getattr(tensor, _HELD, False)
    if derived:
        for output in outputs:
            setattr(output, PARAMETER_DERIVED, True)
            if held:  # made of held tensors alone: held too, as what is made of detached ones needs no grad
                setattr(output, _HELD, True)
    return result


class _ScaledGradient(torch.autograd.Function):
    """Identity on ``x`` whose backward multiplies the gradient by ``factor`` (a number or a tensor).

    ``in_place`` rebases ``x`` itself (every reference to it sees the new history, as an in-place sum needs);
    otherwise the result is a view of ``x``.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float | torch.Tensor, in_place: bool) -> torch.Tensor:
        ctx.factor = factor
        if in_place:
            ctx.mark_dirty(x)
            return x
        return same_strides(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None, None


class _GraphKeepingScaledGradient(torch.autograd.Function):
    """:class:`_ScaledGradient` in a call that keeps the graph: the factor applies in the relevance pass only."""

    @staticmethod
    def forward(ctx, relevance_pass: RelevancePass, x: torch.Tensor, factor: float | torch.Tensor, in_place: bool):
        ctx.relevance_pass = relevance_pass
        return _ScaledGradient.forward(ctx, x, factor, in_place)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, grad * ctx.factor if ctx.relevance_pass.is_running else grad, None, None


class _Held(torch.autograd.Function):
    """A view of ``x`` that passes no gradient in the relevance pass, and the plain gradient in any other."""

    @staticmethod
    def forward(ctx, relevance_pass: RelevancePass, x: torch.Tensor) -> torch.Tensor:
        ctx.relevance_pass = relevance_pass
        return same_strides(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, None if ctx.relevance_pass.is_running else grad


def hold(x: torch.Tensor) -> torch.Tensor:
    """``x`` held constant for the relevance: ``x.detach()``, marked as no activation (see :func:`is_activation`).

    In a call that keeps the graph it is a view of ``x`` that passes no gradient
    in the wrapper's relevance pass and the plain gradient in every other pass,
    so the derivative of the relevance reaches what ``x`` is computed from.

    Examples:
        >>> x = torch.tensor([2.0], requires_grad=True)
        >>> held = hold(x * 3)
        >>> held.requires_grad, is_activation(held)
        (False, False)
    """
    relevance_pass = graph_kept()
    if relevance_pass is None or not x.requires_grad:
        return x.detach()
    held = _Held.apply(relevance_pass, x)
    held.grad_fn.metadata[_PLAIN_EDGES] = (0,)
    setattr(held, PARAMETER_DERIVED, True)  # a constant of the rule, as a parameter is: no activation
    setattr(held, _HELD, True)
    return held


def is_held(x: Any) -> bool:
    """Whether ``x`` is what :func:`hold` returned in a call that keeps the graph (it requires grad, but no
    relevance flows through it: the rules of the modules it enters have nothing to change).

    Examples:
        >>> is_held(hold(torch.ones(1, requires_grad=True) * 2))  # an ordinary call: a detached tensor
        False
    """
    return getattr(x, _HELD, False)


def relevance_pass_edges(node: Any) -> list:
    """The autograd nodes that the wrapper's relevance pass reaches from ``node``: all of its next nodes, but for
    the rules' nodes in a call that keeps the graph, which reach the plain model only in other passes.

    Examples:
        >>> x = torch.ones(2, requires_grad=True)
        >>> [type(n).__name__ for n in relevance_pass_edges((x * 2).grad_fn)]
        ['AccumulateGrad']
    """
    skipped = node.metadata.get(_PLAIN_EDGES, ())
    if not skipped:
        return [n for n, _ in node.next_functions if n is not None]
    return [n for i, (n, _) in enumerate(node.next_functions) if n is not None and i not in skipped]


def pass_no_relevance(node: Any, places: Sequence[int]) -> None:
    """Tell :func:`relevance_pass_edges` that ``node`` passes no relevance to its inputs at ``places`` (a hook of a
    rule stops the gradient there).

    Examples:
        >>> x = torch.ones(2, requires_grad=True)
        >>> node = (x * 2).grad_fn
        >>> pass_no_relevance(node, [0])
        >>> relevance_pass_edges(node)
        []
    """
    node.metadata[_PLAIN_EDGES] = tuple(places)


def scale_gradient(x: torch.Tensor, factor: float | torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """``x`` with its gradient multiplied by ``factor``; a view of ``x``, or ``x`` itself rebased with ``in_place``.

    Examples:
        >>> x = torch.tensor([2.0], requires_grad=True)
        >>> torch.autograd.grad(scale_gradient(x, 0.5) * 3, x)[0]
        tensor([1.5000])
        >>> y = 3 * x
        >>> scale_gradient(y, torch.tensor([0.25]), in_place=True) is y
        True
        >>> torch.autograd.grad(y, x)[0]
        tensor([0.7500])
    """
    if not in_place and isinstance(factor, (int, float)) and factor == 1:
        return x
    relevance_pass = graph_kept()
    if relevance_pass is not None:  # the factor in the relevance pass only (see the module's docstring)
        return _GraphKeepingScaledGradient.apply(relevance_pass, x, factor, in_place)
    return _ScaledGradient.apply(x, factor, in_place)


def call_argument(args: tuple, kwargs: dict, position: int, name: str, default: Any = None) -> Any:
    """The argument at ``position``, or named ``name``, of a call a function mode intercepts.

    Examples:
        >>> call_argument((1,), {"dim": 2}, 1, "dim"), call_argument((1, 3), {}, 1, "dim")
        (2, 3)
    """
    return args[position] if len(args) > position else kwargs.get(name, default)


def raise_for_vmap(module: torch.nn.Module, output: Any) -> None:
    """Raise if ``output`` comes from a call under ``torch.vmap``: tensors there report no gradient, so the rule
    of ``module`` would not see the call and the relevance would silently be the plain gradient.

    Examples:
        >>> torch.vmap(lambda x: raise_for_vmap(torch.nn.Identity(), x) or x)(torch.ones(2, 3))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        RuntimeError: LRP: module Identity runs under torch.vmap, ...
    """
    if torch.compiler.is_compiling():
        return  # a compiled graph holds no vmap of the model's own
    if _FUNCTORCH is not None and isinstance(output, torch.Tensor) and _FUNCTORCH.is_batchedtensor(output):
        error = RuntimeError(
            f"LRP: module {type(module).__name__} runs under torch.vmap, where its rule cannot see the call's "
            "gradient (the relevance would be the plain gradient); call it outside torch.vmap (LRP does so itself "
            "for torchrl's multi-agent networks)"
        )
        error.module = module  # type: ignore[attr-defined]
        error.vmapped = True  # type: ignore[attr-defined]  # the wrapper names the module's path
        raise error


def unwrapped(value: Any) -> Any:
    """``value`` without the wrappers of ``torch.func`` transforms (a BatchedTensor under ``torch.vmap``): the
    tensor whose autograd history the relevance pass follows.

    Examples:
        >>> x, seen = torch.ones(2, 3, requires_grad=True) * 1, []
        >>> _ = torch.vmap(lambda t: seen.append((t.requires_grad, unwrapped(t).requires_grad)) or t)(x)
        >>> seen
        [(False, True)]
    """
    while _FUNCTORCH is not None and isinstance(value, torch.Tensor) and _FUNCTORCH.is_functorch_wrapped_tensor(value):
        value = _FUNCTORCH.get_unwrapped(value)
    return value


def raise_for_transformed_call(what: str, args: Sequence[Any], needs: int = 1) -> None:
    """Raise where a call a function rule would change runs under a ``torch.func`` transform (``torch.vmap``) on
    an activation: there tensors report no gradient, so the rule would not see the call and its relevance would
    silently be the plain gradient.

    Args:
        what: the rule that would change the call, for the message.
        args: the call's arguments.
        needs: how many of them must be activations for the rule to change the call (2 for a product).

    Raises:
        RuntimeError: naming the module that makes the call (its path is added by the LRP wrapper through the
            error's ``module``).

    Examples:
        >>> a = torch.randn(2, 3, requires_grad=True) * 1
        >>> raise_for_transformed_call("a product's rule", (a, a))  # not transformed: nothing to refuse
        >>> try:
        ...     torch.vmap(lambda x: raise_for_transformed_call("a product's rule", (x, x)) or x)(a)
        ... except RuntimeError as err:
        ...     print(str(err)[:58])
        LRP: a call runs under torch.vmap (or another torch.func t
    """
    if not torch._C._are_functorch_transforms_active():
        return
    if sum(is_activation(unwrapped(a)) for a in args if isinstance(a, torch.Tensor)) < needs:
        return
    raise error_in_running_module(
        RuntimeError,
        "runs under torch.vmap (or another torch.func transform) on an activation, where the function rules "
        f"({what}) cannot see the call's gradient: the relevance would be the plain gradient. Compute it outside "
        "the transform (a loop, or a batched call without torch.vmap) while explaining it",
    )
