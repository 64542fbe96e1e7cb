"""The function rules' products, found in the autograd graph instead of through a function mode.

:class:`~tdhook.attribution.rules.functional.FunctionalRules` is a ``TorchFunctionMode``: every torch call of
the model's own code goes through its Python dispatch, a few microseconds each, whether it has a rule or not.
On a small transformer that is a fifth of a gradient pass. In most models every rule it applies is the uniform
rule on a product of two activations (``q · kᵀ``, ``attention · v``, ``silu(gate) * up``), which halves the
gradient that reaches the product's autograd node; the rest of the calls it only lets through.

So a call of a wrapper that runs in the mode records where those products' nodes lie in the graph the forward
pass leaves: the path from the model's outputs to each of them, with the type of every node on the way, and
how many nodes the pass creates before each and in all (autograd numbers the nodes a thread creates). A later
call on inputs of the same shapes runs the model without the mode, follows the recorded paths from its
outputs, checks that every node on them is of the recorded type and number, and puts a pre-hook that halves
the gradient on each product's node: the same factor on the same node, with no Python between the torch
calls. Where anything differs, its hooks are not set, and the call runs again in the mode (and records anew);
inputs whose graph differs twice keep the mode from then on.

Norms written out (Llama's RMSNorm: ``x * rsqrt(mean(x²) + ε)``) get the same treatment: their rule
(:class:`~tdhook.attribution.rules.normalization.NormRule`) holds the normalising scale constant by detaching it
in a mode of its own, nine torch calls of Python dispatch per norm. The recording call notes each held scale's node
and the node of the call that took the scale (see :mod:`~tdhook.attribution.rules._graph_calls`); a later call runs
the norm's forward as it is and puts a pre-hook on the scale's node that passes no gradient, so that the nodes
behind it get none either, as behind the detached scale: the same gradient, bit for bit. A norm whose forward does
more (a fused ``F.layer_norm``, whose rule is a backward of its own) keeps its mode in later calls, and so does one
whose plain backward would read a tensor changed in place after the forward saved it.

Where the mode applies any other rule (a held gate, a softmax with ε, a norm or an activation called as a
function, a fused attention), every later call on inputs of that signature runs in the mode. So does every call
where the forward reads values computed from the explained inputs into Python (``if x.sum() > 0``, ``.item()``,
``int(...)``): on other inputs of the same shapes it may take another branch whose graph has the same nodes, with
a product of two activations on one and of an activation and a constant (which the uniform rule leaves whole) on
the other. Values of inputs that are not explained (masks, token ids) are not followed: a branch on them that
changes which products are of two activations, and nothing else in the graph, is not seen. So do calls that
keep the relevance's graph, that ask for inner layers' relevance or token relevance, and models run with other
function modes. The marks the mode leaves on tensors (computed from parameters alone; gates) are read by the
function modes only, to decide which products are of two activations: the recording holds those decisions.

Examples:
    >>> from tensordict import TensorDict
    >>> from tdhook.attribution.rules._autograd import scale_gradient
    >>> plan, x = FunctionRulePlan(), torch.randn(3, requires_grad=True)
    >>> recording, start = plan.recorder("inputs of shape 3"), plan.sequence_number()
    >>> product = (x * 2) * (x * 3)
    >>> node = product.grad_fn
    >>> halved = scale_gradient(product, 0.5, in_place=True)  # the mode's uniform rule
    >>> recording.scaled(node, halved.grad_fn)
    >>> plan.settle(recording, TensorDict(y=halved.sum()), start)
    >>> start = plan.sequence_number()  # a later call, without the mode
    >>> result = TensorDict(y=((x * 2) * (x * 3)).sum())
    >>> plan.usable("inputs of shape 3").apply(result, start, plan.sequence_number(), [])
    True
    >>> torch.allclose(torch.autograd.grad(result["y"], x)[0], 6 * x)  # half of the plain gradient, 12 x
    True
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import torch
from tensordict import TensorDictBase

__all__ = ["FunctionRulePlan", "Recording"]

# Input signatures whose plans a wrapper keeps (the shapes of a few sequence lengths); more are run in the mode.
_MOST_PLANS = 16

_sequence_number = torch._C._autograd._get_sequence_nr


class _Cut(NamedTuple):
    """A scale a norm's mode held (detached): its node, cut in a later call where the norm runs plainly."""

    module: Any  # the norm
    node: Any  # the scale's node
    inputs: tuple  # the consumer's tensor inputs and their versions: changed in place later, a plain call's
    # consumer node, which saves them to pass the scale its gradient, could not run its backward
    consumer: Any  # the node of the call that took the scale
    index: int  # the scale's place among the consumer's next functions
    earlier: int  # how many products' nodes of the mode's own came before


class Recording:
    """What the function mode did in one call: the products whose gradient it halved, or that it did more; and the
    scales that norms' modes held constant."""

    def __init__(self, key: Hashable) -> None:
        self.key = key
        self.products: list[Any] = []  # the products' autograd nodes, in the order of their calls
        self.factors: dict[int, Any] = {}  # by id: the mode's node after a product, and the product's node
        self.plannable = True
        self.cuts: list[_Cut] = []
        self.norms: dict[int, Any] = {}  # by id: norms whose every call only held scales taken by one node each
        self.moded: set[int] = set()  # ids of norms with a call that did more: later calls keep their mode
        self.outputs: list[Any] = []  # the nodes of the norms' outputs, in the order of their calls

    def scaled(self, product: Any, factor: Any) -> None:
        """The mode halves the gradient of a product (the uniform rule): ``factor``, a node of its own, passes
        half of it to the product's node ``product``."""
        self.products.append(product)
        self.factors[id(factor)] = product

    def other_rule(self) -> None:
        """The mode applied a rule that is not the uniform rule on a product."""
        self.plannable = False

    def read_values(self) -> None:
        """The forward read values computed from the explained inputs into Python (``if x.sum() > 0``,
        ``.item()``): on other inputs of the same shapes it may take another way, whose graph may look the same."""
        self.plannable = False

    def held(self, module: Any, node: Any, inputs: Sequence[torch.Tensor], consumer: Any, index: int) -> None:
        """A norm's mode held a scale (``node`` made it) constant, and the call whose node is ``consumer`` took it,
        with the tensors ``inputs``, as its ``index``-th input with a gradient in a plain call."""
        versions = tuple((tensor, tensor._version) for tensor in inputs)
        self.cuts.append(_Cut(module, node, versions, consumer, index, len(self.products)))

    def norm_done(self, module: Any, plain: bool) -> None:
        """A norm's forward ended: ``plain`` where it did nothing but hold scales that one node each took."""
        if plain:
            self.norms[id(module)] = module
        else:
            self.moded.add(id(module))


class _Plan:
    """Paths from a call's outputs to its products' and held scales' nodes, as one program of steps (see the
    module's docstring).

    Step ``i`` reaches a node: the ``index``-th root where ``parent`` is -1 (the outputs' ``grad_fn``, then the
    nodes of the norms' outputs), else the ``index``-th next function of step ``parent``'s node. It expects the
    node's type, and for a product or a scale its sequence number (relative to the first number of the call) and
    the pre-hook it gets; ``expand`` where later steps start from it. ``plain``: the ids of the norms that run
    without their mode.
    """

    def __init__(
        self,
        keys: list,
        norm_outputs: int,
        steps: list[tuple[int, int, type, int | None, bool, Any]],
        nodes: int,
        plain: tuple,
    ) -> None:
        self.keys = keys  # the keys of the outputs the paths start from
        self.norm_outputs = norm_outputs  # how many norm outputs the call notes, where paths start too
        self.steps = steps
        self.nodes = nodes  # how many nodes the call creates
        self.norms = plain  # the norms themselves, kept alive while their ids stand for them
        self.plain = frozenset(id(module) for module in plain)

    def apply(self, result: TensorDictBase, start: int, end: int, norm_outputs: list) -> bool:
        """Put the pre-hooks on the nodes of the products and held scales of a call that created nodes ``start`` to
        ``end``, returned ``result`` and whose norms returned tensors of the nodes ``norm_outputs``; ``False``, and
        no hook set, where the graph is not the recorded one."""
        if end - start != self.nodes or len(norm_outputs) != self.norm_outputs:
            return False
        nexts: list[Any] = []  # per step, its node's next functions (where later steps start from it)
        hooked = []
        try:
            roots = [result.get(key, None).grad_fn for key in self.keys] + norm_outputs
            for parent, index, kind, offset, expand, hook in self.steps:
                node = roots[index] if parent < 0 else nexts[parent][index][0]
                if type(node) is not kind:
                    return False
                if offset is not None:
                    if node._sequence_nr() - start != offset:
                        return False
                    hooked.append((node, hook))
                nexts.append(node.next_functions if expand else None)
        except (IndexError, AttributeError):  # fewer outputs or next functions than recorded
            return False
        for node, hook in hooked:
            node.register_prehook(hook)
        return True


def _halve(grads: tuple) -> tuple:
    """The uniform rule on a product's node: half of its gradient (as the mode's ``grad * 0.5``)."""
    grad = grads[0]
    return grads if grad is None else (grad * 0.5, *grads[1:])


def _cut(grads: tuple) -> tuple:
    """A held scale's node: no gradient (as none reaches a detached scale); the nodes behind it get none either."""
    return (None, *grads[1:])


class FunctionRulePlan:
    """One wrapper's plans, by the signature of the inputs of the call that recorded them (see the module).

    Not shared between threads: the wrapper runs one call at a time.
    """

    def __init__(self) -> None:
        self._plans: dict[Hashable, _Plan | None] = {}
        self._changed: set[Hashable] = set()  # signatures whose graph differed from their plan's once

    @staticmethod
    def sequence_number() -> int:
        """The number autograd gives the next node this thread creates."""
        return _sequence_number()

    def usable(self, key: Hashable) -> _Plan | None:
        """The plan for a call on inputs of signature ``key``, if one was recorded."""
        return self._plans.get(key)

    def recorder(self, key: Hashable) -> Recording | None:
        """A recording for a call in the mode on inputs of signature ``key``, where a plan may come of it."""
        if key in self._plans:
            return None if self._plans[key] is None else Recording(key)  # None: the mode changes more
        return Recording(key) if len(self._plans) < _MOST_PLANS else None

    def settle(self, recording: Recording, result: TensorDictBase, start: int) -> None:
        """After a call in the mode that completed and returned ``result``: the plan for its signature (``None``:
        the mode for good)."""
        end = _sequence_number()
        self._plans[recording.key] = _build(recording, result, start, end) if recording.plannable else None

    def forget(self, key: Hashable) -> None:
        """Drop the plan for ``key``, whose call's graph was another: the next call records again; the second
        time, the mode for good (a graph that changes from call to call would run every forward pass twice)."""
        if key in self._changed:
            self._plans[key] = None
        else:
            self._changed.add(key)
            self._plans.pop(key, None)


def _build(recording: Recording, result: TensorDictBase, start: int, end: int) -> _Plan | None:
    """The plan of a recorded call: a breadth-first walk from the outputs in ``result`` to every product's node and
    held scale's node."""
    keyed = [
        (key, value)
        for key, value in result.items(True, True)
        if isinstance(value, torch.Tensor) and value.grad_fn is not None
    ]
    keys, outputs = [key for key, _ in keyed], [value for _, value in keyed]
    wanted = {id(node): position for position, node in enumerate(recording.products)}
    if len(wanted) != len(recording.products):
        return None
    norms = {key: module for key, module in recording.norms.items() if key not in recording.moded}
    cuts = [cut for cut in recording.cuts if id(cut.module) in norms]
    # A held scale's node is no next function of its consumer in the mode's graph: a plain call's has it there.
    held = {id(cut.node) for cut in cuts}
    extra: dict[int, dict[int, Any]] = {}
    for cut in cuts:
        extra.setdefault(id(cut.consumer), {})[cut.index] = cut.node
    # Breadth first: the shortest path to each node, through the node first reached.
    parents: dict[int, tuple[int | None, int, Any]] = {}  # id -> (parent id, index, node)
    queue: list[Any] = []
    factors = recording.factors
    # The paths start from the outputs and from the norms' outputs (the shortest then take a few steps each).
    for index, root in enumerate([output.grad_fn for output in outputs] + recording.outputs):
        node = factors.get(id(root), root)  # a plain call's graph has the product's node there
        if node is not None and id(node) not in parents:
            parents[id(node)] = (None, index, node)
            queue.append(node)
    for node in queue:  # grows while it is read
        if id(node) in held:
            continue  # what is behind a scale is no part of the mode's graph
        scales = extra.get(id(node), {})
        for index, (child, _) in enumerate(node.next_functions):
            child = scales.get(index) if child is None else factors.get(id(child), child)
            if child is not None and id(child) not in parents:
                parents[id(child)] = (id(node), index, child)
                queue.append(child)
    if any(key not in parents for key in wanted):
        return None  # a product no output depends on: nothing to gain
    # A norm keeps its mode where a scale's node is on no path from the outputs, where its consumer's inputs were
    # changed in place after the call, or where the scale's branch saved tensors that were (a plain call runs the
    # consumer's backward towards the scale, and the branch's with no gradient: they would raise).
    for cut in cuts:
        changed = any(tensor._version != version for tensor, version in cut.inputs)
        if changed or id(cut.node) not in parents or not _branch_intact(cut.node, parents):
            norms.pop(id(cut.module), None)
    cuts = [cut for cut in cuts if id(cut.module) in norms]
    if not wanted and not cuts:
        return None
    steps: list[tuple[int, int, type, int | None, bool, Any]] = []
    slots: dict[int, int] = {}
    # Each earlier product added a node of the mode's own (its gradient's factor), which a plain call lacks.
    targets = {id(node): (position, _halve) for position, node in enumerate(recording.products)}
    targets |= {id(cut.node): (cut.earlier, _cut) for cut in cuts}
    for target in targets:
        chain = []  # the nodes from the target up to the first one with a step, or to an output
        key: int | None = target
        while key is not None and key not in slots:
            chain.append(key)
            key = parents[key][0]
        for key in reversed(chain):
            parent, index, node = parents[key]
            earlier, hook = targets.get(key, (None, None))
            offset = None if earlier is None else node._sequence_nr() - start - earlier
            if parent is not None:
                parent_step = steps[slots[parent]]
                steps[slots[parent]] = (*parent_step[:4], True, parent_step[5])
            steps.append((-1 if parent is None else slots[parent], index, type(node), offset, False, hook))
            slots[key] = len(steps) - 1
    nodes = end - start - len(recording.products)
    return _Plan(keys, len(recording.outputs), steps, nodes, tuple(norms.values()))


def _branch_intact(node: Any, graph: dict) -> bool:
    """Whether the backward of ``node`` and of the nodes behind it that are not in ``graph`` can run: none of the
    tensors they saved was changed in place since (reading a saved tensor checks its version)."""
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen or (current is not node and id(current) in graph):
            continue
        seen.add(id(current))
        for name in _saved_names(type(current)):
            try:
                getattr(current, name)
            except RuntimeError:
                return False
        stack.extend(child for child, _ in current.next_functions)
    return True


@functools.cache
def _saved_names(kind: type) -> tuple[str, ...]:
    """The attributes through which a node of type ``kind`` gives the tensors and values it saved."""
    return tuple(name for name in dir(kind) if name.startswith("_saved_"))
