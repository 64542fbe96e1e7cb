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

Where the mode applies any other rule (a held gate, a softmax with ε, a norm or an activation called as a
function, a fused attention), every later call on inputs of that signature runs in the mode. So do calls that
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
    >>> plan.usable("inputs of shape 3").apply(result, start, plan.sequence_number())
    True
    >>> torch.allclose(torch.autograd.grad(result["y"], x)[0], 6 * x)  # half of the plain gradient, 12 x
    True
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
from tensordict import TensorDictBase

__all__ = ["FunctionRulePlan", "Recording"]

# Input signatures whose plans a wrapper keeps (the shapes of a few sequence lengths); more are run in the mode.
_MOST_PLANS = 16

_sequence_number = torch._C._autograd._get_sequence_nr


class Recording:
    """What the function mode did in one call: the products whose gradient it halved, or that it did more."""

    def __init__(self, key: Hashable) -> None:
        self.key = key
        self.products: list[Any] = []  # the products' autograd nodes, in the order of their calls
        self.factors: dict[int, Any] = {}  # by id: the mode's node after a product, and the product's node
        self.plannable = True

    def scaled(self, product: Any, factor: Any) -> None:
        """The mode halves the gradient of a product (the uniform rule): ``factor``, a node of its own, passes
        half of it to the product's node ``product``."""
        self.products.append(product)
        self.factors[id(factor)] = product

    def other_rule(self) -> None:
        """The mode applied a rule that is not the uniform rule on a product."""
        self.plannable = False


class _Plan:
    """Paths from a call's outputs to its products' nodes, as one program of steps (see the module's docstring).

    Step ``i`` reaches a node: the ``index``-th output's ``grad_fn`` where ``parent`` is -1, else the ``index``-th
    next function of step ``parent``'s node. It expects the node's type, and for a product its sequence number
    (relative to the first number of the call); ``expand`` where later steps start from it.
    """

    def __init__(self, keys: list, steps: list[tuple[int, int, type, int | None, bool]], nodes: int) -> None:
        self.keys = keys  # the keys of the outputs the paths start from
        self.steps = steps
        self.nodes = nodes  # how many nodes the call creates

    def apply(self, result: TensorDictBase, start: int, end: int) -> bool:
        """Put the halving pre-hook on every product's node of a call that created nodes ``start`` to ``end`` and
        returned ``result``; ``False``, and no hook set, where the graph is not the recorded one."""
        if end - start != self.nodes:
            return False
        outputs = [result.get(key, None) for key in self.keys]
        nexts: list[Any] = []  # per step, its node's next functions (where later steps start from it)
        products = []
        try:
            for parent, index, kind, offset, expand in self.steps:
                node = outputs[index].grad_fn if parent < 0 else nexts[parent][index][0]
                if type(node) is not kind:
                    return False
                if offset is not None:
                    if node._sequence_nr() - start != offset:
                        return False
                    products.append(node)
                nexts.append(node.next_functions if expand else None)
        except (IndexError, AttributeError):  # fewer outputs or next functions than recorded
            return False
        for node in products:
            node.register_prehook(_halve)
        return True


def _halve(grads: tuple) -> tuple:
    """The uniform rule on a product's node: half of its gradient (as the mode's ``grad * 0.5``)."""
    grad = grads[0]
    return grads if grad is None else (grad * 0.5, *grads[1:])


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
    """The plan of a recorded call: a breadth-first walk from the outputs in ``result`` to every product's node."""
    keyed = [
        (key, value)
        for key, value in result.items(True, True)
        if isinstance(value, torch.Tensor) and value.grad_fn is not None
    ]
    keys, outputs = [key for key, _ in keyed], [value for _, value in keyed]
    wanted = {id(node): position for position, node in enumerate(recording.products)}
    if not wanted or len(wanted) != len(recording.products):
        return None
    # Breadth first: the shortest path to each node, through the node first reached.
    parents: dict[int, tuple[int | None, int, Any]] = {}  # id -> (parent id, index, node)
    queue: list[Any] = []
    factors = recording.factors
    for index, output in enumerate(outputs):
        node = factors.get(id(output.grad_fn), output.grad_fn)  # a plain call's graph has the product's node there
        if id(node) not in parents:
            parents[id(node)] = (None, index, node)
            queue.append(node)
    for node in queue:  # grows while it is read
        for index, (child, _) in enumerate(node.next_functions):
            child = factors.get(id(child), child)  # a plain call's graph has the product's node there
            if child is not None and id(child) not in parents:
                parents[id(child)] = (id(node), index, child)
                queue.append(child)
    if any(key not in parents for key in wanted):
        return None  # a product no output depends on: nothing to gain
    steps: list[tuple[int, int, type, int | None, bool]] = []
    slots: dict[int, int] = {}

    for product in recording.products:
        chain = []  # the nodes from the product up to the first one with a step, or to an output
        key: int | None = id(product)
        while key is not None and key not in slots:
            chain.append(key)
            key = parents[key][0]
        for key in reversed(chain):
            parent, index, node = parents[key]
            position = wanted.get(key)
            # Each earlier product added a node of the mode's own (its gradient's factor), which a plain call lacks.
            offset = None if position is None else node._sequence_nr() - start - position
            if parent is not None:
                parent_step = steps[slots[parent]]
                steps[slots[parent]] = (*parent_step[:4], True)
            steps.append((-1 if parent is None else slots[parent], index, type(node), offset, False))
            slots[key] = len(steps) - 1
    return _Plan(keys, steps, end - start - len(recording.products))
