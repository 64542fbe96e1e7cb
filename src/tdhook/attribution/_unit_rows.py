"""Rows of a linear layer's weight picked by token ids: output units where they multiply a signal, an input otherwise.

``(h * head.weight[ids]).sum(-1)`` is ``head(h)`` without its bias, gathered at ``ids``: the ids choose the units
explained, and the rows, a constant factor of the signal ``h``, hold no relevance. The same rows added to an
embedding (``embedding(ids) + adapter.weight[ids]``) are an input of the model beside the embedding, whose relevance
would be lost. :class:`RowUse` records, for one lookup, how the forward used the rows it picked: as a factor of a
signal, or otherwise; :func:`note_row_uses`, called by a function mode on every call, fills it in.

Examples:
    >>> weight, h = torch.nn.Parameter(torch.randn(5, 3)), torch.randn(2, 3, requires_grad=True) * 1
    >>> use = RowUse()
    >>> rows = weight[torch.tensor([1, 4])]
    >>> watch_rows(rows, use)
    >>> note_row_uses("__mul__", (h, rows), {}, h * rows)
    >>> use.as_factor
    True
    >>> note_row_uses("__add__", (h, rows), {}, h + rows)
    >>> use.as_factor
    False
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import nn

from tdhook.attribution.rules._autograd import from_parameters_alone

__all__ = [
    "RowUse",
    "gate_error",
    "gated_inputs",
    "linear_parameters",
    "note_row_uses",
    "rows_of_output_units",
    "watch_rows",
]

_ROWS = "_tdhook_rows_of_units"  # the RowUse of the rows a tensor is (a view or copy of)
_GATED = "_tdhook_gated_by_rows"  # on a product of rows and signals element by element: (its RowUse, the signals)

# Calls that give the rows another shape, layout or dtype (their first argument): what they return is the rows still.
_SHAPING = frozenset(
    {
        "view", "reshape", "unsqueeze", "squeeze", "expand", "expand_as", "flatten", "unflatten", "transpose",
        "permute", "movedim", "t", "__get__", "to", "type_as", "contiguous", "clone", "detach", "__getitem__",
        "narrow", "select", "view_as", "reshape_as", "float", "double", "half", "bfloat16",
    }
)  # fmt: skip
# Products: the rows, one factor, multiply the other (a signal, where it is one).
_PRODUCTS = frozenset(
    {"mul", "__mul__", "__rmul__", "matmul", "__matmul__", "__rmatmul__", "bmm", "mm", "mv", "einsum", "linear"}
)
# Products element by element: the rows, each element a factor of one element of the signal, gate it.
_ELEMENTWISE = frozenset({"mul", "__mul__", "__rmul__", "multiply"})


class RowUse:
    """How a forward used the rows one lookup picked: ``factor``, whether a use multiplied a signal by them;
    ``other``, whether another use read them (an addition, a layer's input); ``gated``, the signals they multiplied
    element by element (a gate's product, or a score's before its sum).

    Examples:
        >>> RowUse().as_factor  # not used yet
        False
    """

    def __init__(self) -> None:
        self.factor = False
        self.other = False
        self.gated: list[torch.Tensor] = []

    @property
    def as_factor(self) -> bool:
        """Whether the rows were used, and every use multiplied a signal by them."""
        return self.factor and not self.other


def watch_rows(rows: object, use: RowUse) -> None:
    """Mark ``rows``, what a lookup returned, so that :func:`note_row_uses` records its uses in ``use``.

    Examples:
        >>> rows = torch.ones(2, 3)
        >>> watch_rows(rows, RowUse())
    """
    if isinstance(rows, torch.Tensor):
        setattr(rows, _ROWS, use)


def _tensors(values: Iterator[object]) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors(iter(value))


def _is_signal(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is computed from the inputs: it requires grad, and is neither a parameter nor computed from
    parameters alone."""
    if not tensor.requires_grad:
        return False
    if tensor.grad_fn is None:
        return not isinstance(tensor, nn.Parameter)
    return not from_parameters_alone(tensor)


def note_row_uses(name: str, args: tuple, kwargs: dict, out: object) -> None:
    """Record, for a call of the function ``name`` on ``args`` and ``kwargs`` that returned ``out``, how it used the
    rows watched (see :func:`watch_rows`) among its arguments: reshaped (``out`` is the rows still), a factor of a
    signal, or another use. A call of a watched tensor as a template only (``h.expand_as(rows)``) is no use.

    Examples:
        >>> use, rows = RowUse(), torch.ones(2, 3)
        >>> watch_rows(rows, use)
        >>> note_row_uses("view", (rows, 6), {}, rows.view(6))
        >>> use.factor, use.other
        (False, False)
    """
    tensors = list(_tensors(iter((*args, *kwargs.values()))))
    uses = [(tensor, getattr(tensor, _ROWS)) for tensor in tensors if hasattr(tensor, _ROWS)]
    if name == "sum" and args and hasattr(args[0], _GATED):
        with torch._C.DisableTorchFunction():  # an inspection, which a function mode of the call must not see
            _summed(args[0], args[1] if len(args) > 1 else kwargs.get("dim"))
    if not uses:
        return
    with torch._C.DisableTorchFunction():  # an inspection, which a function mode of the call must not see
        if name in _SHAPING:
            first = args[0] if args else None
            use = getattr(first, _ROWS, None) if isinstance(first, torch.Tensor) else None
            for result in out if isinstance(out, (list, tuple)) else (out,):
                if use is not None:
                    watch_rows(result, use)
            return
        signals = [t for t in tensors if not hasattr(t, _ROWS) and _is_signal(t)] if name in _PRODUCTS else []
        for _, use in uses:
            if signals:
                use.factor = True
                if name in _ELEMENTWISE:
                    use.gated += signals
                    if isinstance(out, torch.Tensor):
                        setattr(out, _GATED, (use, signals))
            else:
                use.other = True


def _summed(product: torch.Tensor, dim: object) -> None:
    """A product of rows and signals element by element, summed over its last dimension (or whole): a score, the
    rows' layer's outputs (``(h * head.weight[ids]).sum(-1)``), not a gate; its signals are no gated ones."""
    use, signals = getattr(product, _GATED)
    last = product.dim() - 1
    dims = dim if isinstance(dim, (list, tuple)) else (dim,)
    if dim is None or any(isinstance(d, int) and d % max(product.dim(), 1) == last for d in dims):
        use.gated = [tensor for tensor in use.gated if all(tensor is not signal for signal in signals)]


def linear_parameters(modules: Mapping[str, nn.Module]) -> frozenset[int]:
    """The ids of the parameters of the ``nn.Linear`` layers among ``modules``: the tables whose rows' uses a lookup
    by token ids watches.

    Examples:
        >>> layer = nn.Linear(2, 3)
        >>> id(layer.weight) in linear_parameters({"head": layer, "embedding": nn.Embedding(4, 2)})
        True
    """
    return frozenset(
        id(value)
        for module in modules.values()
        if isinstance(module, nn.Linear)
        for value in module._parameters.values()
        if value is not None
    )


def rows_of_output_units(
    index: int,
    table: torch.Tensor,
    modules: Mapping[str, nn.Module],
    tables: Sequence[tuple[int, torch.Tensor, tuple[str, ...], RowUse | None]],
) -> bool:
    """Whether ``table``, looked up by the ids of input ``index``, is the weight or the bias of an ``nn.Linear`` among
    ``modules`` whose rows are that layer's output units: ``(h * head.weight[ids]).sum(-1)`` is ``head(h)`` without
    its bias, gathered at ``ids``, which chooses the units explained (a target), not an input of the model, as in a
    sequence's likelihood computed from the rows of its language-model head. The relevance reaches ``h`` through the
    product, and no share of it is held by the rows. So only where every lookup of the weight's rows by the ids
    (``tables``: input, table, embeddings running, the rows' uses) had each use multiply a signal by them; the bias
    counts with its weight. Rows added to the embedding or to a score (``embedding(ids) + adapter.weight[ids]``)
    are an input beside the embedding, whose relevance would be lost.

    Examples:
        >>> head, use = nn.Linear(3, 5), RowUse()
        >>> use.factor = True
        >>> rows_of_output_units(0, head.bias, {"head": head}, [(0, head.weight, (), use)])
        True
        >>> use.other = True  # also added somewhere
        >>> rows_of_output_units(0, head.bias, {"head": head}, [(0, head.weight, (), use)])
        False
    """
    for module in modules.values():
        if not isinstance(module, nn.Linear):
            continue
        if table is module.weight or table is module.bias:
            uses = [rows for i, looked_up, _, rows in tables if i == index and looked_up is module.weight]
            return bool(uses) and all(rows is not None and rows.as_factor for rows in uses)
    return False


def gated_inputs(use: RowUse, index: int, fed: Sequence[torch.Tensor | None]) -> list[int]:
    """The explained inputs other than ``index`` (by the tensors ``fed`` to the model in their place) that a signal
    the rows multiplied element by element (``use.gated``) is computed from: ``proj(f) * gate.weight[ids]``, a gate
    the ids pick for another input's signal. Held constant, the rows would give that input the product's relevance,
    and the ids none of it; the same model explained from the rows as an input shares it between them.

    Examples:
        >>> weight, f = nn.Parameter(torch.randn(5, 3)), torch.randn(2, 3, requires_grad=True)
        >>> fed = [None, f.clone()]
        >>> use = RowUse()
        >>> rows = weight[torch.tensor([1, 4])]
        >>> watch_rows(rows, use)
        >>> note_row_uses("__mul__", (fed[1] * 2, rows), {}, fed[1] * 2 * rows)
        >>> gated_inputs(use, 0, fed)
        [1]
    """
    if not use.gated:
        return []
    nodes = {tensor.grad_fn: i for i, tensor in enumerate(fed) if i != index and tensor is not None}
    variables = {id(tensor): i for i, tensor in enumerate(fed) if i != index and tensor is not None}
    found: set[int] = set()
    pending, seen = [signal.grad_fn for signal in use.gated], set()
    found.update(variables[id(signal)] for signal in use.gated if id(signal) in variables)
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node in nodes:
            found.add(nodes[node])
            continue
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: an input fed as a leaf
        if variable is not None and id(variable) in variables:
            found.add(variables[id(variable)])
        pending.extend(next_node for next_node, _ in node.next_functions)
    return sorted(found)


def gate_error(key: object, table: str, others: list) -> ValueError:
    """The error for rows of ``table`` (in words) that token ids at input ``key`` pick to gate the signal of the
    inputs ``others`` (see :func:`gated_inputs`).

    Examples:
        >>> str(gate_error("ids", "parameter 'gate.weight'", ["f"]))[:60]
        "LRP: input key 'ids' picks rows of parameter 'gate.weight' t"
    """
    return ValueError(
        f"LRP: input key {key!r} picks rows of {table} that multiply, element by element, a signal computed from "
        f"input {', '.join(map(repr, others))}: a gate the ids choose, whose rows would be held constant, so that the "
        "ids would get none of that product's relevance (explained from the rows as an input, the product shares it "
        "between them); explain the embeddings and the rows the model computes as inputs"
    )
