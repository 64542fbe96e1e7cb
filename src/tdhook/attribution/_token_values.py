"""Token values computed from token ids: element-wise arithmetic, dtype round trips, one-hot codes.

The mark of token values (see :meth:`tdhook.attribution._tokens.TokenInputs.tracking`) follows the ids through the
calls that keep their values (copies, views, concatenation); here are the others that still hold them in some form:
element-wise arithmetic (``ids + 1``, ``ids % buckets``, ``ids.clamp(0, n)``), a round trip through a floating-point
or another integer dtype (``ids.double().long()``, ``ids.float().round().long()``, ``ids.short()``), and a one-hot
code (``F.one_hot(ids, n)``, or the ids compared with a set of values: ``ids[..., None] == torch.arange(n)``). A
floating-point tensor that holds token values is marked too, so that its way back to integers keeps the mark, and a
product of it with a weight (``F.one_hot(ids, n).float() @ table``, the ids fed to a layer as numbers) is a lookup of
that weight by the ids.

Looking for a marked operand reads Python attributes only: no torch call, which the model's function modes would
see, and little cost on the many arithmetic calls of a model.

Examples:
    >>> ids = torch.tensor([3, 1])
    >>> ids._tdhook_tokens_of = 0
    >>> marked_operand((ids, 1), {}), marked_operand((torch.ones(2), 1), {})
    (0, None)
    >>> converted = ids.double()
    >>> mark_values(converted, 0), getattr(converted, "_tdhook_tokens_of", None)
    (True, 0)
    >>> mask = ids > 2
    >>> mark_values(mask, 0), getattr(mask, "_tdhook_tokens_of", None)
    (False, None)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from tdhook.attribution.rules._autograd import from_parameters_alone

__all__ = [
    "CODING",
    "COMPARISONS",
    "COMPUTED",
    "PRODUCTS",
    "TEMPLATES",
    "ProductLookup",
    "is_weight_table",
    "mark_values",
    "marked_operand",
    "taken_values",
    "weight_met",
]

_DERIVED = "_tdhook_tokens_of"  # the attribute that marks a tensor holding the token values of an explained input

# Calls whose result, computed from token ids, still holds their values in some form: element-wise arithmetic, a
# conversion to another dtype (and back), rounding, a one-hot code, sorting, writes into a new tensor, reductions of
# the values. Comparisons (``ids.ne(pad)``, a boolean mask: positions and lengths counted from it are no token values)
# and the positions of values (``argmax``, ``argsort``, ``nonzero``) are not among them.
COMPUTED = frozenset(
    {
        "add", "__add__", "__radd__", "__iadd__", "add_", "sub", "__sub__", "__rsub__", "__isub__", "sub_", "subtract",
        "mul", "__mul__", "__rmul__", "__imul__", "mul_", "multiply", "remainder", "__mod__", "__rmod__", "fmod",
        "floor_divide", "__floordiv__", "__rfloordiv__", "div", "__truediv__", "divide", "neg", "__neg__", "negative",
        "abs", "__abs__", "clamp", "clip", "clamp_min", "clamp_max", "minimum", "maximum", "bitwise_and", "__and__",
        "bitwise_or", "__or__", "bitwise_xor", "__xor__", "__lshift__", "__rshift__", "bitwise_left_shift",
        "bitwise_right_shift", "float", "double", "half", "bfloat16", "short", "char", "byte", "type", "type_as",
        "round", "floor", "ceil", "trunc", "fix", "one_hot", "lerp", "sign", "new_tensor", "sort", "msort", "unique",
        "unique_consecutive", "bucketize", "searchsorted", "scatter", "scatter_add", "scatter_reduce", "index_fill",
        "index_add", "index_copy", "index_put", "masked_scatter", "put", "diag_embed", "diag", "diagonal", "triu",
        "tril", "sum", "max", "min", "amax", "amin", "cumsum", "cumprod", "cummax", "cummin", "topk", "kthvalue",
        "mode", "median", "take_along_dim", "unfold", "expand_as", "view_as", "reshape_as", "broadcast_to",
        "pow", "__pow__", "__rpow__", "square", "rsub", "true_divide", "bitwise_not", "__invert__", "scatter_add_",
        "scatter_reduce_", "index_add_", "index_put_",
    }
)  # fmt: skip
# Comparisons, whose boolean result holds token values only as a code of them: the ids compared with a set of values
# (``(ids[..., None] == torch.arange(n)).float() @ table``, a one-hot code); a mask of the ids' own places
# (``ids != pad``, ``ids == eos``) holds none.
COMPARISONS = frozenset(
    {
        "eq", "__eq__", "ne", "__ne__", "not_equal", "lt", "__lt__", "less", "le", "__le__", "less_equal", "gt",
        "__gt__", "greater", "ge", "__ge__", "greater_equal",
    }
)  # fmt: skip
# Calls of ``COMPUTED`` with a template among their arguments, whose values they do not take: ``x.type_as(ids)``,
# ``torch.arange(n).expand_as(ids)`` (positions shaped like the ids), ``ids.new_tensor(data)``; the positions of the
# arguments that hold the values taken.
_TAKEN = {name: slice(0, 1) for name in ("type_as", "expand_as", "view_as", "reshape_as")}
_TAKEN["new_tensor"] = slice(1, None)
TEMPLATES = frozenset(_TAKEN)
# Writes into a floating-point tensor at places given by token ids (``z.scatter_(-1, ids[..., None], 1.0)``,
# ``z[rows, ids] = 1``): a one-hot code of them; the position of the places among the arguments.
CODING = {"__setitem__": 1, "scatter_": 2}
# Arguments that hold no token values, told by their class alone, and the classes of lists of arguments.
_PLAIN = frozenset({int, float, bool, complex, type(None), str, torch.dtype, torch.device, torch.Size, slice})
_SEQUENCES = (list, tuple)
# Products in which a floating-point tensor holding token values, met with a weight, looks the weight up by the ids
# (``F.one_hot(ids, n).float() @ table``) or uses the ids as numbers (``F.linear(ids.float()[..., None], w)``).
PRODUCTS = frozenset(
    {"matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "mv", "einsum", "linear", "mul", "__mul__", "__rmul__"}
)
_VALUES = frozenset(
    {
        torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64,
        torch.float16, torch.bfloat16, torch.float32, torch.float64,
    }
)  # fmt: skip


def marked_operand(args: tuple, fed: Mapping[int, int]) -> int | None:
    """The explained input whose token values a tensor among ``args`` (and one level of lists) holds: one of the fed
    ids (``fed``, by ``id``) or a tensor marked; Python attributes only, no torch call.

    It runs on most of a model's arithmetic: plain numbers are passed over by their class, and a list is told by its
    class (``list`` or ``tuple``, not a subclass), with no call of ``isinstance``.

    Examples:
        >>> ids = torch.tensor([1, 2])
        >>> marked_operand((2, [torch.ones(1), ids]), {id(ids): 1})
        1
    """
    for value in args:
        kind = value.__class__
        if kind in _PLAIN:
            continue
        if kind is list or kind is tuple:
            index = marked_operand(value, fed) if value and value[0].__class__ not in _SEQUENCES else None
        else:
            key = id(value)
            index = fed[key] if key in fed else getattr(value, _DERIVED, None)
        if index is not None:
            return index
    return None


def taken_values(name: str, args: tuple, kwargs: dict) -> tuple:
    """The arguments of a call of ``name`` (one of ``COMPUTED``) whose values its result takes: all of them, but for a
    call with a template (``x.type_as(ids)``, ``positions.expand_as(ids)``, ``ids.new_tensor(data)``).

    Examples:
        >>> ids, positions = torch.tensor([4, 2]), torch.arange(2)
        >>> len(taken_values("expand_as", (positions, ids), {})), len(taken_values("add", (ids, 1), {"alpha": 2}))
        (1, 3)
    """
    taken = _TAKEN.get(name)
    if taken is not None:
        return args[taken]
    return (*args, *kwargs.values()) if kwargs else args


def mark_values(out: object, index: int) -> bool:
    """Mark ``out``, a result computed from the token values of explained input ``index``, where it holds them: an
    integer or a floating-point tensor that requires no grad, not a boolean mask (read with the function modes off,
    which would see the reads of a dtype).

    Returns:
        Whether a floating-point tensor was marked (the products of such tensors are then looked at).

    Examples:
        >>> mark_values(torch.tensor([1, 2]), 0), mark_values(torch.ones(2), 0), mark_values(3, 0)
        (False, True, False)
    """
    if isinstance(out, (list, tuple)):  # values and indices (``sort``, ``max(dim)``): both marked, as a split's parts
        return any([mark_values(part, index) for part in out])
    with torch._C.DisableTorchFunction():
        if not isinstance(out, torch.Tensor) or out.dtype not in _VALUES or out.requires_grad:
            return False  # a signal (``h * ids``) holds no token values: it is computed from an input
        setattr(out, _DERIVED, index)
        return out.is_floating_point()


def is_weight_table(table: object) -> bool:
    """Whether ``table``, indexed by token ids, is a weight: a floating-point parameter, a view of one
    (``self.lora_A.T``), or a tensor computed from parameters alone; an activation indexed by the ids (the logits of
    the given tokens) is none.

    Examples:
        >>> weight = nn.Parameter(torch.randn(3, 4))
        >>> is_weight_table(weight), is_weight_table(weight.T), is_weight_table(weight * 2)
        (True, True, True)
        >>> is_weight_table(weight.detach()), is_weight_table(torch.randn(3, 4, requires_grad=True) * 2)
        (False, False)
    """
    if not isinstance(table, torch.Tensor) or not table.is_floating_point():
        return False
    with torch._C.DisableTorchFunction():  # an inspection, which a function mode of the call must not see
        if isinstance(table, nn.Parameter) or isinstance(table._base, nn.Parameter):
            return True
        return table.grad_fn is not None and from_parameters_alone(table)


class ProductLookup(tuple):
    """A weight multiplied, in a product, by token values taken as numbers (``F.one_hot(ids, n).float() @ table``):
    the lookup ``(input, weight, embeddings running, None)`` of the weight by the ids, which names the product's call
    when it refuses the input (:meth:`refusal`).

    Examples:
        >>> table = nn.Parameter(torch.randn(3, 4))
        >>> lookup = ProductLookup(0, table, (), "einsum")
        >>> index, weight, inside, rows = lookup
        >>> index, weight is table, inside, rows, lookup.call
        (0, True, (), None, 'torch.einsum')
    """

    call: str

    def __new__(cls, index: int, weight: torch.Tensor, inside: tuple[str, ...], name: str) -> ProductLookup:
        lookup = super().__new__(cls, (index, weight, inside, None))
        lookup.call = _CALLS.get(name, f"torch.{name}")
        return lookup

    def refusal(self, key: object, dtype: torch.dtype, weight: str) -> str:
        """Why the input ``key`` (of ``dtype``), left out of the explanation, is refused: its values, taken as numbers
        inside the model, are multiplied with ``weight`` (the weight in words) in the product's call, and no gradient
        reaches them; what to do instead."""
        return (
            f"LRP: input key {key!r} ({dtype}) enters the model as numbers (converted to floating point, or encoded "
            f"as by F.one_hot) and is multiplied with {weight} (shape {tuple(self[1].shape)}) in {self.call} inside "
            "the model: no gradient reaches integers or booleans, so its share of the relevance would be lost and "
            f"('relevance', {key!r}) would not be written; encode it before the model and give the model the "
            f"encoding as a floating-point tensor (for example td[{key!r}] = F.one_hot(td[{key!r}], n).float() for a "
            f"one-hot encoding, td[{key!r}] = td[{key!r}].float() for its values) to explain it, or pass in_keys "
            "without it to explain the other inputs with its share left out"
        )


# The products written as operators or as functions of ``torch.nn.functional``, in words.
_CALLS = {"__matmul__": "the @ operator", "__rmatmul__": "the @ operator", "__mul__": "the * operator"}
_CALLS |= {"__rmul__": "the * operator", "linear": "F.linear"}


def weight_met(
    name: str, args: tuple, kwargs: dict, fed: Mapping[int, int], inside: Sequence[str] = ()
) -> ProductLookup | None:
    """A weight that a call of a product (one of ``PRODUCTS``, by ``name``) multiplies by a floating-point tensor
    holding token values (``F.one_hot(ids, n).float() @ table``, ids fed to a layer as numbers): a lookup of it by the
    ids, made while the embeddings ``inside`` run; ``None`` for most products, of no such tensor.

    Examples:
        >>> codes, table = torch.eye(3)[[2, 0]], nn.Parameter(torch.randn(3, 4))
        >>> codes._tdhook_tokens_of = 0
        >>> index, weight, inside, rows = weight_met("matmul", (codes, table), {}, {})
        >>> index, weight is table, weight_met("matmul", (torch.ones(2, 3), table), {}, {})
        (0, True, None)
    """
    tensors = [
        tensor
        for value in (*args, *kwargs.values())
        for tensor in (value if isinstance(value, (list, tuple)) else (value,))
        if isinstance(tensor, torch.Tensor)
    ]
    index = marked_operand(tuple(tensors), fed)
    if index is None:
        return None
    for tensor in tensors:
        if getattr(tensor, _DERIVED, None) is None and id(tensor) not in fed and is_weight_table(tensor):
            return ProductLookup(index, tensor, tuple(inside), name)
    return None
