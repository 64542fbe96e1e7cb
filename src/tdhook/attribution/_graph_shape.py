"""The shape of a call's autograd graph: which node takes its inputs from which, for the plans' check.

A plan (see :mod:`~tdhook.attribution._function_rule_plan`) follows the paths to its products' nodes and counts the
nodes a call creates. A later call can create as many nodes, with the same types on those paths, and still be
another graph: a branch the forward takes on a value the mode does not follow (a flag, a mask) that feeds a product
a detached factor, a buffer or a tensor computed from parameters alone instead of an activation, or that feeds a
gate held in every product to one product more that does not hold it. The mode's rules would differ there (no
uniform rule on the product; the gate's own rule), and the plan's hooks would not. So a recording call keeps the
shape of its graph as a plain call would leave it, and a later call compares its own: every node reached from the
outputs, in the order a breadth-first walk reaches them, with its type and the places of the nodes it takes its
inputs from; a leaf's parameter, or none for an input's. A walk costs far less than the call it checks (a few
hundred nodes in a small transformer: a fraction of a percent of its call).

Examples:
    >>> import torch
    >>> x, w = torch.randn(3, requires_grad=True), torch.nn.Parameter(torch.randn(3))
    >>> a = x * 2
    >>> graph_shape([(a * (x * 3)).grad_fn]) == graph_shape([(a * (w * 3)).grad_fn])  # the same nodes
    False
    >>> graph_shape([(a * (x * 3)).grad_fn]) == graph_shape([(a * (x * 4)).grad_fn])
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["graph_shape", "shape_through_views"]

_LEAF = torch._C._functions.AccumulateGrad
_VIEW = type(torch.zeros(1, requires_grad=True).view(1).grad_fn)  # the node of ``x.view(...)``, ``x.view_as(y)``
_PARAMETER = torch.nn.Parameter
_NONE_HELD: dict = {}  # read only


def graph_shape(
    roots: Sequence[Any],
    factors: dict[int, Any] | None = None,
    scales: dict | None = None,
    walked: list[Any] | None = None,
) -> tuple:
    """The shape of the graph reached from the nodes ``roots``, flat: the place of each root's node (-1 for a root
    without one), then per node, in the order a breadth-first walk reaches them, its type, the places of its inputs'
    nodes (-1 for an input without one) and, for a leaf, the id of its parameter (``None`` for a tensor that is no
    parameter: an input). A node's type, the only entry that is a class, begins its part: two graphs have equal
    shapes exactly where their nodes have equal types, inputs and parameters, one by one (a tuple per node would say
    no more, and made a walk about a quarter longer).

    In a recording call the function mode's graph stands for a plain call's: ``factors`` (by id) maps a node of the
    mode's own to the product's node it follows, ``scales`` (by the id of a node, then by place) gives the node of a
    scale the mode detached where the node took it. ``walked``, where given (empty), receives the nodes in the
    walk's order: in two graphs of one shape, the nodes at one place there stand for each other.

    >>> x = torch.randn(3, requires_grad=True)
    >>> walked = []
    >>> shape = graph_shape([(x * 2).sum().grad_fn], walked=walked)
    >>> [type(node).__name__ for node in walked]
    ['SumBackward0', 'MulBackward0', 'AccumulateGrad']
    >>> [entry if type(entry) is int else entry.__name__ for entry in shape[:-1]], shape[-1]  # the input: None
    ([0, 'SumBackward0', 1, 'MulBackward0', 2, -1, 'AccumulateGrad'], None)
    """
    nodes: list[Any] = [] if walked is None else walked
    if not (factors or scales):
        return _plain_shape(roots, nodes)
    places: dict[Any, int] = {}  # by node (autograd gives a node the same Python object while it lives)
    shape: list[Any] = []
    factors, scales = factors or {}, scales or {}
    for root in roots:
        root = factors.get(id(root), root)
        shape.append(-1 if root is None else _place(root, places, nodes))
    for node in nodes:  # grows while it is read
        # One loop over the next functions, without a list of them (a comprehension is a call of its own).
        held = scales.get(id(node), _NONE_HELD)
        kind = type(node)
        shape.append(kind)
        for index, (child, _) in enumerate(node.next_functions):
            child = held.get(index) if child is None else factors.get(id(child), child)
            if child is None:
                shape.append(-1)
                continue
            place = places.get(child)
            if place is None:
                place = places[child] = len(nodes)
                nodes.append(child)
            shape.append(place)
        if kind is _LEAF:
            shape.append(_parameter_id(node.variable))
    return tuple(shape)


def _plain_shape(roots: Sequence[Any], nodes: list[Any]) -> tuple:
    """:func:`graph_shape` of a plain call's graph (no node of a mode's own to map), the nodes walked put in
    ``nodes``. The same walk, with less work per input of a node (the shape a later planned call compares at every
    call): no index of the input, ``None`` placed at -1 from the start, and the lists' methods bound once."""
    places: dict[Any, int] = {None: -1}  # by node (autograd gives a node the same Python object while it lives)
    shape: list[Any] = []
    add, reach = shape.append, nodes.append
    for root in roots:
        if root not in places:
            places[root] = len(nodes)
            reach(root)
        add(places[root])
    for node in nodes:  # grows while it is read
        kind = type(node)
        add(kind)
        for child, _ in node.next_functions:  # membership, then a subscript: no method call per input
            if child in places:
                add(places[child])
            else:
                place = places[child] = len(nodes)
                add(place)
                reach(child)
        if kind is _LEAF:
            variable = node.variable
            # isinstance(variable, Parameter), without Parameter's own (slower) check for a parameter itself
            add(id(variable) if type(variable) is _PARAMETER or isinstance(variable, _PARAMETER) else None)
    return tuple(shape)


def shape_through_views(roots: Sequence[Any]) -> tuple:
    """:func:`graph_shape` of the graph reached from the nodes ``roots`` with each view taken as the tensor it views:
    the first call of a context may give a module its input as a fresh view (see
    :class:`~tdhook.attribution.rules.elementwise.ElementwiseRule`), which later calls do not, and a view changes no
    product, gate, clip or norm of the graph.

    >>> x = torch.randn(3, requires_grad=True)
    >>> h = x * 2
    >>> shape_through_views([h.view_as(h).sigmoid().grad_fn]) == shape_through_views([h.sigmoid().grad_fn])
    True
    >>> shape_through_views([h.tanh().grad_fn]) == shape_through_views([h.sigmoid().grad_fn])
    False
    """
    places: dict[Any, int] = {None: -1}
    nodes: list[Any] = []

    def place(node: Any) -> int:
        """The place of ``node`` in the walk (a new one at the end where it is first reached), a view's that of the
        tensor it views."""
        while type(node) is _VIEW:
            node = node.next_functions[0][0]
        if node not in places:
            places[node] = len(nodes)
            nodes.append(node)
        return places[node]

    shape: list[Any] = [place(root) for root in roots]
    for node in nodes:  # grows while it is read
        entry = [type(node), *(place(child) for child, _ in node.next_functions)]
        if entry[0] is _LEAF:
            entry.append(_parameter_id(node.variable))
        shape.append(tuple(entry))
    return tuple(shape)


def _parameter_id(variable: torch.Tensor) -> int | None:
    """The id of a leaf's tensor where it is a parameter, else ``None`` (an input's)."""
    # isinstance(variable, Parameter), without Parameter's own (slower) check for a parameter itself
    is_parameter = type(variable) is _PARAMETER or isinstance(variable, _PARAMETER)
    return id(variable) if is_parameter else None


def _place(node: Any, places: dict[Any, int], nodes: list) -> int:
    """The place of ``node`` in the walk (a new one at the end where it is first reached)."""
    place = places.get(node)
    if place is None:
        place = places[node] = len(nodes)
        nodes.append(node)
    return place
