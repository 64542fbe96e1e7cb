"""Integer or boolean inputs that enter the model as numbers: converted to floating point and mapped linearly.

No gradient reaches an integer tensor, so an input of integers receives relevance only as token ids, through the
``nn.Embedding`` that reads them (:mod:`~tdhook.attribution._tokens`). An integer input that the model converts to
floating point and computes with as numbers (a torchrl critic's one-hot action, ``torch.cat([obs, action.float()])``
into an ``nn.Linear``) holds a share of the relevance that no input receives. The first call of a wrapper watches,
in a function mode, where such inputs go: views, repeats, pads, splits, conversions, joins (``cat``, ``stack``),
elementwise activations and functions (a sinusoidal encoding's ``sin``, a clamp), reductions, dropout and norms (a
norm's statistic written out too), running sums (positions counted from a mask, ``mask.long().cumsum(-1)``) and
writes into a tensor (``z[:, 4] = a.float()``, ``index_put_``, ``masked_scatter_``, ``scatter_``, ``index_copy``,
``copy_`` into a view; a view taken before the write too, where it spans what was written) carry their values, and
a linear map (``F.linear``, a convolution, a product with a parameter, ``einsum`` or ``tensordot`` included) that
takes them is where their share goes.
Arithmetic carries them too (``2 * a.float() - 1``, ``a.float() / n``, a sum with an activation, a sum of two
inputs, which carries both) except a product with an activation: that is a gate (a done mask), and the activation
it scales takes the product's relevance whole. A parameter, even seen through a view or computed from parameters
alone (``w.expand(...)``, ``-w``), is not an activation.
Encodings carry them with no gradient to pass on: ``F.one_hot``, a comparison (``a == 3``), index arithmetic
(``a % n``, ``a // 2``, a rounded ``torch.div``), logical and bitwise operations (``&``, ``|``, ``^``, ``~``, ``>>``,
``<<``), buckets (``torch.bucketize``, ``torch.searchsorted``, ``sign``), the positions of their non-zero values
(``a.nonzero()``, ``torch.where(a)``),
constants chosen by them (``torch.where(a == 1, 1.0, -1.0)``, ``masked_fill``), and a constant table read or written
at them (``torch.eye(n)[a]``, ``torch.zeros(...).scatter_(-1, a, 1.0)``, ``z[torch.arange(n), a] = 1.0``). Masks (an
attention mask turned into additive scores or put over them, which ``softmax`` ends, activations chosen between,
zeroed or laid out where a mask says, ``h[done] = 0.0``, ``h.masked_fill(done, 0.0)``; other constants put over them
there, ``h[a == 1] = 1.0``, ``h.masked_fill(a == 1, 1.0)``, encode it) and indices into activations
(``gather``, ``index_select``, an ``nn.Embedding``'s ids, which it explains) are not reported, nor are zeros
made in the call whatever the input's values (``torch.zeros(...) * (1 - done)``, ``torch.where(done, 0.0,
h.new_zeros(n))``): they hold no share. A buffer of zeros is not taken for one: the model may write to it.

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

from tdhook.attribution._written_storage import StorageWrites
from tdhook.attribution.mappers.aliases import module_place
from tdhook.attribution.rules._caller import warn_at_caller

__all__ = ["NumericInputs", "report_numeric_inputs", "watch_numeric_inputs"]

Tensor = torch.Tensor
# What a tensor carries: by input, its position and the encoding its values took on the way (None: none).
Carrier = tuple[tuple[int, str | None], ...]

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
        Tensor.bool,
        Tensor.long,
        Tensor.int,
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
        Tensor.expand_as,
        Tensor.repeat,
        Tensor.tile,
        torch.tile,
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
# Elementwise activations, dropout and norms: what their input holds of an input's values reaches the next layer.
_PASSING: frozenset[Callable] = frozenset(
    {F.relu, torch.relu, Tensor.relu, F.relu6, F.leaky_relu, F.elu, F.selu, F.celu, F.gelu, F.silu, F.mish}
    | {F.softplus, F.hardtanh, F.hardswish, F.hardsigmoid, torch.tanh, Tensor.tanh, torch.sigmoid, Tensor.sigmoid}
    | {F.dropout, F.layer_norm, F.batch_norm, F.group_norm, F.instance_norm, F.rms_norm}
)
# Elementwise functions and reductions that carry their first argument's values: a sinusoidal encoding of a
# timestep (``torch.sin(t.float()[..., None] * freqs)``), the statistic of a norm written out (``x *
# torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)``).
_PASSING |= {torch.sin, Tensor.sin, torch.cos, Tensor.cos, torch.exp, Tensor.exp, torch.log, Tensor.log}
_PASSING |= {torch.sqrt, Tensor.sqrt, torch.rsqrt, Tensor.rsqrt, torch.square, Tensor.square, torch.abs, Tensor.abs}
_PASSING |= {torch.pow, Tensor.pow, Tensor.__pow__, Tensor.__rpow__, torch.mean, Tensor.mean, torch.sum, Tensor.sum}
_PASSING |= {torch.log1p, Tensor.log1p, torch.expm1, Tensor.expm1, torch.clamp, Tensor.clamp, torch.clip, Tensor.clip}
_PASSING |= {F.normalize, F.pad}
# Running sums and products: positions counted from a mask (``mask.long().cumsum(-1)``) hold its values.
_PASSING |= {torch.cumsum, Tensor.cumsum, torch.cumprod, Tensor.cumprod}
# Calls that split their first argument into a tuple of tensors: each holds its values.
_PARTS = frozenset({torch.split, Tensor.split, torch.chunk, Tensor.chunk, torch.unbind, Tensor.unbind})
_PASSING |= _PARTS
# Joins along a dimension of their own: a part of the join (a split, a slice) holds the values of the pieces it spans.
_CATS = frozenset({torch.cat, torch.concat, torch.concatenate})
_CARRYING |= _PASSING
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
_PRODUCTS |= {Tensor.mm, Tensor.bmm, torch.einsum, torch.tensordot}  # einsum's operands: listed, or one by one
# Elementwise arithmetic: sums carry an input's values whatever they add, scalings unless they scale an activation.
_SUMS: frozenset[Callable] = frozenset(
    {Tensor.add, Tensor.__add__, Tensor.__radd__, Tensor.__iadd__, Tensor.add_, torch.add}
    | {Tensor.sub, Tensor.__sub__, Tensor.__rsub__, Tensor.__isub__, Tensor.sub_, torch.sub, torch.rsub}
)
_SCALINGS: frozenset[Callable] = frozenset(
    {Tensor.mul, Tensor.__mul__, Tensor.__rmul__, Tensor.__imul__, Tensor.mul_, torch.mul}
    | {Tensor.div, Tensor.__truediv__, Tensor.__rtruediv__, Tensor.__itruediv__, Tensor.div_, torch.div}
    | {Tensor.neg, Tensor.__neg__, torch.neg}
)
# Products of factors: a constant zero among them makes the product nothing, whatever the others.
_PRODUCTS_OF_FACTORS = frozenset({Tensor.mul, Tensor.__mul__, Tensor.__rmul__, Tensor.__imul__, Tensor.mul_, torch.mul})
# Calls that make zeros whatever their arguments' values.
_ZEROS: frozenset[Callable] = frozenset({torch.zeros, torch.zeros_like, Tensor.new_zeros, Tensor.zero_})
# Encodings: the output is a function of an input's values that no gradient passes, read from its first argument.
_COMPARISONS: frozenset[Callable] = frozenset(
    {Tensor.__eq__, Tensor.__ne__, Tensor.__lt__, Tensor.__le__, Tensor.__gt__, Tensor.__ge__}
    | {Tensor.eq, Tensor.ne, Tensor.lt, Tensor.le, Tensor.gt, Tensor.ge}
    | {torch.eq, torch.ne, torch.lt, torch.le, torch.gt, torch.ge}
    | {Tensor.__invert__, Tensor.logical_not, torch.logical_not}
)
# Logical and bitwise operations on masks (``(torch.arange(n) == 4) & (a[:, None] == 1)``): of every operand's values.
_LOGICAL: frozenset[Callable] = frozenset(
    {Tensor.__and__, Tensor.__rand__, Tensor.__iand__, Tensor.bitwise_and, Tensor.bitwise_and_, torch.bitwise_and}
    | {Tensor.__or__, Tensor.__ror__, Tensor.__ior__, Tensor.bitwise_or, Tensor.bitwise_or_, torch.bitwise_or}
    | {Tensor.__xor__, Tensor.__rxor__, Tensor.__ixor__, Tensor.bitwise_xor, Tensor.bitwise_xor_, torch.bitwise_xor}
    | {Tensor.logical_and, Tensor.logical_and_, torch.logical_and, Tensor.logical_or, Tensor.logical_or_}
    | {torch.logical_or, Tensor.logical_xor, Tensor.logical_xor_, torch.logical_xor}
    | {Tensor.bitwise_not, Tensor.bitwise_not_, torch.bitwise_not, Tensor.logical_not_}
    | {Tensor.__rshift__, Tensor.__rrshift__, Tensor.__irshift__, Tensor.bitwise_right_shift, torch.bitwise_right_shift}
    | {Tensor.__lshift__, Tensor.__rlshift__, Tensor.__ilshift__, Tensor.bitwise_left_shift, torch.bitwise_left_shift}
    | {Tensor.bitwise_right_shift_, Tensor.bitwise_left_shift_}
)
# The positions of an input's non-zero values (``a.nonzero()``, ``torch.where(a)``), as indices: an encoding of them.
_POSITIONS: frozenset[Callable] = frozenset({torch.nonzero, Tensor.nonzero, torch.argwhere, Tensor.argwhere})
# Index arithmetic (``a % n``, ``a // 2``, ``a.nonzero() % n``): rounded, its values pass no gradient either.
_ROUNDINGS: frozenset[Callable] = frozenset(
    {Tensor.__mod__, Tensor.__rmod__, Tensor.__imod__, Tensor.remainder, Tensor.remainder_, torch.remainder}
    | {Tensor.fmod, Tensor.fmod_, torch.fmod, Tensor.floor_divide, Tensor.floor_divide_, torch.floor_divide}
    | {Tensor.__floordiv__, Tensor.__rfloordiv__, Tensor.__ifloordiv__}
)
# Divisions that round where ``rounding_mode`` is given (``torch.div(a, 2, rounding_mode="floor")``).
_DIVISIONS = frozenset({Tensor.div, Tensor.div_, torch.div})
# The bucket of each value (``torch.bucketize(a, edges)``, ``torch.searchsorted(edges, a)``, ``a.sign()``).
_BUCKETS: frozenset[Callable] = frozenset({torch.bucketize, torch.searchsorted, torch.sign, Tensor.sign, Tensor.sign_})
_ENCODINGS: frozenset[Callable] = _COMPARISONS | _LOGICAL | _POSITIONS | _ROUNDINGS | _BUCKETS | {F.one_hot}
# Selections between values by a condition: the position of the condition, then of the values.
_SELECTIONS: dict[Callable, tuple[int, tuple[int, ...]]] = {
    torch.where: (0, (1, 2)),
    Tensor.where: (1, (0, 2)),
    torch.masked_fill: (1, (0, 2)),
    Tensor.masked_fill: (1, (0, 2)),
    Tensor.masked_fill_: (1, (0, 2)),
}
# Their arguments' keywords, by position (``h.masked_fill(mask=m, value=1.0)``, ``torch.where(condition=c, ...)``).
_SELECTION_NAMES: dict[Callable, tuple[str, ...]] = {
    torch.where: ("condition", "input", "other"),
    Tensor.where: ("self", "condition", "other"),
    torch.masked_fill: ("input", "mask", "value"),
    Tensor.masked_fill: ("self", "mask", "value"),
    Tensor.masked_fill_: ("self", "mask", "value"),
}
# Reads and writes of a table at an input's values: the position and keyword of the table, then of the index.
_LOOKUPS: dict[Callable, tuple[int, str, int, str]] = {
    Tensor.__getitem__: (0, "self", 1, "indices"),
    Tensor.index_select: (0, "self", 2, "index"),
    torch.index_select: (0, "input", 2, "index"),
    Tensor.gather: (0, "self", 2, "index"),
    torch.gather: (0, "input", 2, "index"),
    F.embedding: (1, "weight", 0, "input"),
}
# Writes of values into their first argument, in place (``z[:, 4] = a.float()``, ``z.narrow(1, 4, 1).copy_(...)``)
# or into a copy of it (``torch.index_copy``): the position and keyword of the index or mask that says where (none:
# ``copy_`` and the ``*_scatter`` of a slice), then of the values written.
_WRITES: dict[Callable, tuple[int | None, str, int, str]] = {
    Tensor.__setitem__: (1, "indices", 2, "value"),
    Tensor.copy_: (None, "", 1, "src"),
    **dict.fromkeys((Tensor.index_put_, Tensor.index_put, torch.index_put), (1, "indices", 2, "values")),
    **dict.fromkeys((Tensor.masked_scatter_, Tensor.masked_scatter, torch.masked_scatter), (1, "mask", 2, "source")),
    **dict.fromkeys((Tensor.put_, Tensor.put, torch.put), (1, "index", 2, "source")),
    **dict.fromkeys((Tensor.scatter_, Tensor.scatter, torch.scatter), (2, "index", 3, "src")),
    **dict.fromkeys((Tensor.scatter_add_, Tensor.scatter_add, torch.scatter_add), (2, "index", 3, "src")),
    **dict.fromkeys((Tensor.scatter_reduce_, Tensor.scatter_reduce, torch.scatter_reduce), (2, "index", 3, "src")),
    **dict.fromkeys((Tensor.index_copy_, Tensor.index_copy, torch.index_copy), (2, "index", 3, "source")),
    **dict.fromkeys((Tensor.index_add_, Tensor.index_add, torch.index_add), (2, "index", 3, "source")),
    **dict.fromkeys((Tensor.index_reduce_, Tensor.index_reduce, torch.index_reduce), (2, "index", 3, "source")),
    **dict.fromkeys((Tensor.index_fill_, Tensor.index_fill, torch.index_fill), (2, "index", 3, "value")),
    **dict.fromkeys((torch.select_scatter, torch.slice_scatter, torch.diagonal_scatter), (None, "", 1, "src")),
}
# The writes among them made in place: the tensor written (and the tensor it views) holds the values written.
_IN_PLACE = frozenset(func for func in _WRITES if func is Tensor.__setitem__ or func.__name__.endswith("_"))
# Calls that view a tensor as another dtype (``torch.view_as_real``, a complex tensor's ``real``), as ``Tensor.view``
# does given a dtype (``z.view(torch.int32)``, ``torch.ops.aten.view.dtype``), or hand its memory out to be viewed so
# unseen (a NumPy array or a DLPack capsule, read back as another dtype): a view of any dtype may then span an element
# written with an input's. A tensor's storage is not one (the rules compare storages): a ``set_`` to it is not followed.
_RETYPING: frozenset[Callable] = frozenset(
    {
        *(torch.view_as_real, torch.view_as_complex, torch.real, torch.imag, Tensor.real.__get__, Tensor.imag.__get__),
        *(torch.ops.aten.view.dtype, Tensor.numpy, Tensor.__dlpack__),
    }
)


class NumericInputs(TorchFunctionMode):
    """Follows integer or boolean inputs through views, conversions, joins, arithmetic and encodings to the linear
    maps that take them as floating-point numbers.

    Args:
        inputs: by position among the explained keys, the tensor the model is given.
        modules: the model's modules by name, to name the layer of a linear map.

    Attributes:
        found: by input position, the first linear map that took its values as numbers.
        encodings: by input position among ``found``, the encoding its values took on the way, where one did.
    """

    def __init__(self, inputs: Mapping[int, torch.Tensor], modules: Mapping[str, nn.Module]) -> None:
        super().__init__()
        # By id: what the tensor carries, and the tensor (held, so that its id is not reused during the call).
        self._carriers: dict[int, tuple[Carrier, torch.Tensor]] = {id(t): (((i, None),), t) for i, t in inputs.items()}
        self._modules = modules
        self._owners: dict[int, str] | None = None
        self._parameter_nodes: set = set()  # autograd nodes of values computed from parameters alone
        self._activation_nodes: set = set()  # autograd nodes of values found to hold an activation's
        self._zeros: dict[int, torch.Tensor] = {}  # by id: zeros made in the call, whatever the inputs
        # By id: a join of inputs' values, and its dimension with the size and carrier of each piece along it.
        self._joins: dict[int, tuple[torch.Tensor, tuple[int, tuple[tuple[int, Carrier | None], ...]]]] = {}
        self._writes = StorageWrites()  # the storage written in place with inputs' values: read by earlier views
        self.dtypes = {i: t.dtype for i, t in inputs.items()}
        self.found: dict[int, str] = {}
        self.encodings: dict[int, str] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Read before the call: a scaling in place makes the tensor it writes require grad.
        rounded = func in _DIVISIONS and kwargs.get("rounding_mode") is not None  # index arithmetic: an encoding
        scaled = self._scaled(func, args, kwargs) if func in _SCALINGS and not rounded else None
        out = func(*args, **kwargs)
        if func in _RETYPING or (
            func is Tensor.view and ("dtype" in kwargs or (args[1:] and isinstance(args[1], torch.dtype)))
        ):
            self._writes.reinterpreted()
        if scaled is not None:
            if scaled[0] is None and self._carrier(out) is not None:  # a gate written in place: it carries none
                self._carriers.pop(id(out), None)
                if self._writes and args and out is args[0]:  # nor do the elements of its storage it spans
                    self._writes.mark(out, None, None)
            self._carry(out, scaled[0])
        elif func in _CARRYING:
            first = args[0] if args else None
            if (func not in _PASSING or func in _PARTS) and self._zeros.get(id(first)) is first:
                for part in _listed(out):  # a view or copy of zeros, or the parts of a split of them
                    if isinstance(part, torch.Tensor):
                        self._zeros[id(part)] = part
            carrier = self._carrier(first) if func not in _JOINS else self._carried(*_listed(first))
            if carrier is None and func in _LOOKUPS:
                carrier = self._looked_up(func, args, kwargs)
            self._carry(out, carrier)
            if carrier is not None and func in _CATS and isinstance(out, torch.Tensor):
                self._joins[id(out)] = (out, self._layout(out, args, kwargs))
            elif carrier is not None and (func in _PARTS or func is Tensor.__getitem__) and id(first) in self._joins:
                self._narrow(first, out)
        elif func in _LAYERS or func in _PRODUCTS:
            self._note(func, args, kwargs)
        elif func in _SUMS:  # a sum carries its operands' values
            self._carry(out, self._carried(*args, *kwargs.values()))
        elif func in _ENCODINGS or rounded or (func is torch.where and len(args) + len(kwargs) == 1):
            carrier = self._carried(*args, *kwargs.values())  # where(a): positions
            if carrier is not None:  # named only for an input's values (not the rules' sign of each activation)
                self._carry(out, _encoded(carrier, _encoding(func)))
        elif func in _LOOKUPS:
            self._carry(out, self._looked_up(func, args, kwargs))
        elif func in _WRITES:
            self._written(func, args, kwargs, out)
            if func is Tensor.copy_ and isinstance(out, torch.Tensor):  # written whole: zeros where its source is
                self._copied(out, args[1] if len(args) > 1 else kwargs.get("src"))
        elif func in _SELECTIONS:
            if kwargs:  # by keyword: read in the order of the positions
                names = _SELECTION_NAMES[func][len(args) :]
                args = (*args, *(kwargs[name] for name in names if name in kwargs))
            carrier = self._selected(func, args)
            if func is Tensor.masked_fill_ and carrier is not None:
                self._hold(args[0], dict(carrier))
            if func is Tensor.masked_fill_ and (carrier is not None or self._writes):  # for views taken before
                self._writes.mark(args[0], None if carrier else args[1], carrier)
            self._carry(out, carrier)
        elif func in _ZEROS and isinstance(out, torch.Tensor):
            self._zeros[id(out)] = out
            if func is Tensor.zero_:
                self._overwritten(out)
        elif func is Tensor.fill_ and self._carried(*args[1:], *kwargs.values()) is None:
            self._overwritten(out)  # a constant written over it whole
        return out

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._carriers = {}  # the tensors of the call, not kept past it
        self._parameter_nodes, self._activation_nodes = set(), set()
        self._zeros, self._joins = {}, {}
        self._writes.clear()

    def _carrier(self, *values: object) -> Carrier | None:
        """What the first of ``values`` that carries an input's values carries."""
        for value in values:
            carrier = self._carriers.get(id(value))  # no other object shares the id of a tensor held
            if carrier is not None and carrier[1] is value:
                return carrier[0]
        dtypes = self._writes.dtypes  # a view taken before a write of an input's values into its storage holds them
        if dtypes:  # read only for a tensor of a dtype written (a boolean is_init's marks: no activation read)
            with torch._C.DisableTorchFunction():  # its dtype read unseen by the modes below
                for value in values:
                    spans = isinstance(value, torch.Tensor) and value.dtype in dtypes
                    carrier = self._writes.read(value) if spans else None
                    if carrier is not None:
                        self._carriers[id(value)] = (carrier, value)
                        return carrier
        return None

    def _carried(self, *values: object) -> Carrier | None:
        """What ``values`` carry together (``a.float() + t.float()``, a join of both): each input once, with the
        encoding it took in the first of them that carries it."""
        found: dict[int, str | None] = {}
        for value in values:
            for i, encoding in self._carrier(value) or ():
                found.setdefault(i, encoding)
        return tuple(found.items()) or None

    def _carry(self, out: object, carrier: Carrier | None) -> None:
        if carrier is not None and isinstance(out, torch.Tensor):
            self._carriers[id(out)] = (carrier, out)
        elif carrier is not None and isinstance(out, (tuple, list)):  # the parts of a split
            for part in out:
                self._carry(part, carrier)

    def _layout(
        self, out: torch.Tensor, args: tuple, kwargs: dict
    ) -> tuple[int, tuple[tuple[int, Carrier | None], ...]]:
        """The dimension of a ``cat`` and, along it, the size and carrier of each piece."""
        pieces = _listed(args[0] if args else kwargs.get("tensors"))
        dim = args[1] if len(args) > 1 else kwargs.get("dim", kwargs.get("axis", 0))
        dim = dim % out.dim() if isinstance(dim, int) and out.dim() else 0
        sizes = [p.shape[dim] if isinstance(p, torch.Tensor) and p.dim() == out.dim() else 0 for p in pieces]
        return dim, tuple((size, self._carrier(p)) for size, p in zip(sizes, pieces, strict=True))

    def _narrow(self, joined: torch.Tensor, out: object) -> None:
        """The parts of a join that span only some of its pieces (``torch.cat([obs, done.float()], -1).split([3,
        1], -1)``, ``x[..., :3]``) carry the values of those pieces only: each part a slice along the join's
        dimension, read from its place in the join's storage; any other part keeps the whole join's carrier."""
        kept, (dim, pieces) = self._joins[id(joined)]
        if kept is not joined:
            return
        for part in _listed(out):
            if not isinstance(part, torch.Tensor):
                continue
            span = _span(joined, part, dim)
            if span is None:
                continue
            found: dict[int, str | None] = {}
            start = 0
            for size, carrier in pieces:
                if carrier is not None and start < span[1] and span[0] < start + size:
                    for i, encoding in carrier:
                        found.setdefault(i, encoding)
                start += size
            if found:
                self._carriers[id(part)] = (tuple(found.items()), part)
            else:
                self._carriers.pop(id(part), None)

    def _scaled(self, func: Callable, args: tuple, kwargs: dict) -> tuple[Carrier | None] | None:
        """What a scaling's product carries, ``None`` where no operand carries an input's values. A scaling of an
        activation is a gate (the activation takes the relevance of the product whole): the product carries none,
        in place neither; nor does a product with a constant zero (``torch.zeros(...) * (1 - done)``), whose
        values, nothing whatever the input's, hold no share. A scaling of values that hold an activation's too
        (``(1 - done) * torch.cat([obs, one_hot])``) carries theirs, not the gate's."""
        operands = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
        carrier = self._carrier(*operands)
        if carrier is None:
            return None
        if any(self._is_activation(v) for v in operands):
            return (None,)
        if func in _PRODUCTS_OF_FACTORS and any(self._is_zero(v) for v in (*args, *kwargs.values())):
            return (None,)
        scaled = [v for v in operands if v.requires_grad and not isinstance(v, nn.Parameter)]
        return (self._carried(*scaled) or self._carried(*operands),)

    def _is_zero(self, value: object) -> bool:
        """Whether ``value`` is a constant zero whatever the inputs: the number, or zeros made in the call
        (``torch.zeros``, ``zeros_like``, ``new_zeros``, ``zero_``, and views of them), holding zeros only. Batch
        data that holds zeros (a first step's reward) is not one, nor are zeros a module holds (a buffer, or a
        state made on the first call, ``self.state = torch.zeros(...)``) and may write after the call: either may
        hold more on a later call, which is not watched."""
        if not isinstance(value, torch.Tensor):
            return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0
        if value.requires_grad or self._carrier(value) is not None:
            return False
        if self._zeros.get(id(value)) is not value or value.is_meta:
            return False
        try:
            zero = not bool(value.any())  # as it is now: written in place since, it may hold more
        except RuntimeError:  # values not to be read here (under vmap): not known to be zeros
            return False
        return zero and not self._held(value)

    def _held(self, value: torch.Tensor) -> bool:
        """Whether a module holds ``value``, or the tensor it views, as a buffer or an attribute."""
        base = value._base if value._base is not None else value
        for module in self._modules.values():
            for kept in (*module._buffers.values(), *vars(module).values()):
                if kept is value or kept is base:
                    return True
        return False

    def _is_activation(self, value: torch.Tensor) -> bool:
        """Whether ``value`` holds an activation's values: it requires grad, carries no input's values and is
        not a parameter or computed from parameters alone (``w.expand(...)``, ``-w``)."""
        if not value.requires_grad or isinstance(value, nn.Parameter) or self._carrier(value) is not None:
            return False
        return not self._from_parameters(value)

    def _from_parameters(self, value: torch.Tensor) -> bool:
        """Whether every leaf of ``value``'s autograd graph is a parameter. The nodes found so, and the first node of
        a value found not so, are kept for the call: a recurrent state's graph is not walked again at every step."""
        root = value.grad_fn
        if root is None:  # a leaf that requires grad: an input unless a parameter
            return False
        stack, seen = [root], set()
        while stack:
            node = stack.pop()
            if node is None or node in seen or node in self._parameter_nodes:
                continue
            variable = getattr(node, "variable", None)  # a leaf's node holds it
            if node in self._activation_nodes or (variable is not None and not isinstance(variable, nn.Parameter)):
                self._activation_nodes.add(root)
                return False
            seen.add(node)
            stack.extend(child for child, _ in node.next_functions)
        self._parameter_nodes |= seen
        return True

    def _looked_up(self, func: Callable, args: tuple, kwargs: dict) -> Carrier | None:
        """An input's values as the index into a constant table (``torch.eye(n)[a]``, a ``scatter_`` into zeros):
        an encoding of them. An activation read at them, or a parameter (an embedding's table), is not one."""
        table_at, table_name, index_at, index_name = _LOOKUPS[func]
        table = args[table_at] if len(args) > table_at else kwargs.get(table_name)
        index = args[index_at] if len(args) > index_at else kwargs.get(index_name)
        carrier = self._carried(*_listed(index))
        if carrier is None or not isinstance(table, torch.Tensor):
            return None
        others = [table, *args[index_at + 1 :], *(v for k, v in kwargs.items() if k in ("src", "value"))]
        if any(isinstance(v, torch.Tensor) and (v.requires_grad or isinstance(v, nn.Parameter)) for v in others):
            return None
        return _encoded(carrier, _encoding(func))

    def _written(self, func: Callable, args: tuple, kwargs: dict, out: object) -> None:
        """A write of values into a tensor (``z[:, 4] = a.float()``, ``index_put_``, ``masked_scatter_``,
        ``scatter_``, ``index_copy``, ``z.narrow(1, 4, 1).copy_(...)``): the tensor written (in place, and the tensor
        it views, whose storage it writes) or the copy made carries what it carried and what the values written
        carry. Constants written at an input's values into a constant tensor (``z[torch.arange(n), a] = 1.0``, a
        ``scatter_`` into zeros, ones written over an activation, ``h[a == 1] = 1.0``) are an encoding of them; a
        write of an activation at them (``padded[mask] = h``), or of zeros over one (``h[done] = 0.0``), is a gate:
        the index carries nothing, nor does a zero written into zeros."""
        index_at, index_name, value_at, value_name = _WRITES[func]
        table = args[0] if args else kwargs.get("input", kwargs.get("self"))
        value = args[value_at] if len(args) > value_at else kwargs.get(value_name, kwargs.get("value"))
        if not isinstance(table, torch.Tensor):
            return
        found: dict[int, str | None] = {}
        for i, encoding in self._carried(table, value) or ():
            found.setdefault(i, encoding)
        index = None if index_at is None else args[index_at] if len(args) > index_at else kwargs.get(index_name)
        indexed = self._carried(*_listed(index)) if index is not None else None
        # Constants written at the input's values encode them, into an activation too (``h[a == 1] = 1.0``: the
        # ones hold the key's share); zeros written over an activation (``h[done] = 0.0``) or into zeros do not.
        constant, into_constant = (
            not (isinstance(v, torch.Tensor) and (v.requires_grad or isinstance(v, nn.Parameter)))
            for v in (value, table)
        )
        nothing = self._is_zero(value) and (not into_constant or self._is_zero(table))
        written = dict(self._carried(value) or ())  # what the elements written hold
        if indexed is not None and constant and not nothing:
            for i, encoding in _encoded(indexed, _encoding(func)) or ():
                found.setdefault(i, encoding)
                written.setdefault(i, encoding)
        if func in _IN_PLACE and (written or self._writes):
            self._mark(func, table, index, written)
        if not found:
            return
        if func not in _IN_PLACE:
            self._carry(out, tuple(found.items()))
            return
        self._hold(table, found)

    def _copied(self, table: torch.Tensor, source: object) -> None:
        """``table``, written whole in place with ``source`` (``copy_``), holds zeros made in the call where ``source``
        does (torchrl's recurrent modules lay out an initial state of zeros anew, ``torch.empty_like(h).copy_(h)``),
        and no longer where it does not."""
        if self._is_zero(source):
            self._zeros[id(table)] = table
        else:
            self._zeros.pop(id(table), None)

    def _overwritten(self, table: torch.Tensor) -> None:
        """``table``, written over whole in place with a constant (``zero_``, ``fill_``), holds no input's values,
        nor do the elements of its storage it spans (for views of it taken before)."""
        self._carriers.pop(id(table), None)
        if self._writes:
            self._writes.mark(table, None, None)

    def _mark(self, func: Callable, table: torch.Tensor, index: object, written: dict[int, str | None]) -> None:
        """Mark the elements of ``table``'s storage written in place as holding ``written`` (none: no input's
        values, written over them) for views of it taken before: where an index says (a list of indices, each of a
        dimension, for ``index_put_``), else all of ``table``, but for values of no input, which leave the marks
        where the write is not known to cover them (``scatter_``)."""
        at = index if func is Tensor.__setitem__ else tuple(index) if func is Tensor.index_put_ else None
        if written or at is not None or func is Tensor.copy_:
            self._writes.mark(table, at, tuple(written.items()) or None)

    def _hold(self, table: torch.Tensor, found: dict[int, str | None]) -> None:
        """``table``, written in place, and the tensor it views (whose storage it writes) carry ``found`` too."""
        for target in (table, table._base):
            if isinstance(target, torch.Tensor):  # each keeps what it carried (a base more than its view written)
                held = dict(self._carrier(target) or ())
                for i, encoding in found.items():
                    held.setdefault(i, encoding)
                self._carriers[id(target)] = (tuple(held.items()), target)
                self._joins.pop(id(target), None)  # the pieces written over: its parts carry the whole

    def _selected(self, func: Callable, args: tuple) -> Carrier | None:
        """Constants chosen by an input's values (``torch.where(a == 1, 1.0, -1.0)``), put over an activation too
        (``h.masked_fill(a.bool(), 1.0)``, ``torch.where(a == 1, 1.0, h)``: they hold the key's share), or an input's
        values chosen, beside an activation too (``torch.where(m, a.float(), h)``): they carry them. An activation
        chosen, or put over with zeros or another activation, where a condition says (a done gate, a mask of
        attention scores) carries none of the condition's; nor do zeros chosen whatever the condition."""
        condition_at, values_at = _SELECTIONS[func]
        values = [args[i] for i in values_at if i < len(args)]
        carrier = self._carried(*values)
        chosen = self._carrier(args[condition_at]) if condition_at < len(args) else None
        # The condition's share is held by what it picks that is neither an activation, an input's values nor zeros.
        if chosen is None or not any(
            not (isinstance(v, torch.Tensor) and (self._is_activation(v) or self._carrier(v) is not None))
            and not self._is_zero(v)
            for v in values
        ):
            return carrier
        found = dict(carrier or ())
        for i, encoding in _encoded(chosen, getattr(func, "__name__", str(func))) or ():
            found.setdefault(i, encoding)
        return tuple(found.items())

    def _note(self, func: Callable, args: tuple, kwargs: dict) -> None:
        operands = [v for value in (*args, *kwargs.values()) for v in _listed(value)]
        tensors = [v for v in operands if isinstance(v, torch.Tensor)]
        for value in tensors:
            carrier = self._carrier(value) if value.is_floating_point() else None
            if carrier is None or all(i in self.found for i, _ in carrier):
                continue
            parameters = [t for t in tensors if self._is_weight(t)]
            if func in _PRODUCTS and not parameters:  # a product of activations (attention): no layer
                continue
            for i, encoding in carrier:
                if i not in self.found:
                    self.found[i] = self._where(func, parameters)
                    if encoding is not None:
                        self.encodings[i] = encoding

    def _is_weight(self, value: torch.Tensor) -> bool:
        """Whether ``value`` is a parameter, seen through a view (``x @ w.T``) or computed from parameters alone."""
        if isinstance(value, nn.Parameter) or isinstance(value._base, nn.Parameter):
            return True
        return value.requires_grad and self._carrier(value) is None and self._from_parameters(value)

    def _where(self, func: Callable, parameters: Sequence[torch.Tensor]) -> str:
        """The module holding the first of ``parameters`` (or the parameter it views), else the function's name."""
        if self._owners is None:
            self._owners = {
                id(p): name for name, module in self._modules.items() for p in module.parameters(recurse=False)
            }
        for parameter in parameters:
            name = self._owners.get(id(parameter), self._owners.get(id(parameter._base)))  # or the one it views
            if name is not None:
                module = self._modules[name]
                return f"{module_place(name, self._modules)} ({type(module).__name__})"
        return f"{getattr(func, '__name__', func)}"


def _encoding(func: Callable) -> str:
    """How ``func`` encodes an input's values, for the report."""
    if func is F.one_hot:
        return "one_hot"
    if func in (Tensor.__invert__, Tensor.logical_not, torch.logical_not):
        return "a logical not"
    if func in _COMPARISONS:
        return "a comparison"
    if func in _LOGICAL:
        return "a logical or bitwise operation"
    if func in _ROUNDINGS or func in _DIVISIONS:
        return f"a remainder or rounded division ({func.__name__})"
    if func in _BUCKETS:
        return f"the buckets of its values ({func.__name__})"
    if func in _POSITIONS or func is torch.where:
        return f"the positions of its non-zero values ({func.__name__})"
    name = "indexing" if func in (Tensor.__getitem__, Tensor.__setitem__) else getattr(func, "__name__", str(func))
    return f"a constant table {'written' if func in _WRITES else 'read'} at its values ({name})"


def _encoded(carrier: Carrier | None, encoding: str) -> Carrier | None:
    """``carrier`` once its values take ``encoding``: each input keeps the first encoding it took."""
    return None if carrier is None else tuple((i, first or encoding) for i, first in carrier)


def _span(joined: torch.Tensor, part: torch.Tensor, dim: int) -> tuple[int, int] | None:
    """Where ``part`` lies along ``dim`` of ``joined`` (first, end), if it is a slice of it along ``dim`` alone
    (with step 1, or one index of it); else ``None``."""
    others = [d for d in range(joined.dim()) if d != dim]
    try:
        if joined.numel() == 0 or part.numel() == 0 or joined.untyped_storage().data_ptr() == 0:
            return None
        if part.untyped_storage().data_ptr() != joined.untyped_storage().data_ptr():
            return None
        if part.dim() == joined.dim():
            shape, strides, length = [part.shape[d] for d in others], [part.stride(d) for d in others], part.shape[dim]
            if length > 1 and part.stride(dim) != joined.stride(dim):
                return None
        elif part.dim() == joined.dim() - 1:
            shape, strides, length = list(part.shape), list(part.stride()), 1
        else:
            return None
        if shape != [joined.shape[d] for d in others] or strides != [joined.stride(d) for d in others]:
            return None
        shift, step = part.storage_offset() - joined.storage_offset(), joined.stride(dim)
    except (RuntimeError, NotImplementedError):  # no storage to read (a meta tensor, under vmap)
        return None
    if step <= 0 or shift % step or not 0 <= shift // step <= joined.shape[dim] - length:
        return None
    return shift // step, shift // step + length


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
        if not left_out and watch.dtypes[i] == torch.uint8 and i not in watch.encodings:
            continue  # pixels, refused next by the token inputs' check with the advice for pixels
        message = _message(lrp.explained_keys[i], watch.dtypes[i], where, left_out, watch.encodings.get(i))
        if not left_out:
            raise TypeError(message)
        if strict:
            raise ValueError(message)
        warn_at_caller(message)


def _message(key: NestedKey, dtype: torch.dtype, where: str, defaulted: bool, encoding: str | None = None) -> str:
    start = f"LRP: input key {key!r} ({dtype}) enters the model as numbers"
    if encoding is None:
        head = f"{start}, converted to floating point, through {where}"
        advice = f"store it as a floating-point tensor (for example td[{key!r}] = td[{key!r}].float()) to explain it"
    else:  # the encoding passes no gradient, whatever the key's dtype: the model must read the encoded key
        head = f"{start}, encoded by {encoding}, through {where}"
        advice = (
            "encode it before the model and give the model the encoding as a floating-point tensor (for example "
            f"td[{key!r}] = F.one_hot(td[{key!r}], n).float() for a one-hot encoding) to explain it"
        )
    if defaulted:
        return (
            f"{head}, and is not explained: no gradient reaches integers or booleans, so its share of the relevance "
            f"is not shown and the inputs' relevance does not add up to the output; {advice}, or pass in_keys=[...] "
            "to say that it is left out"
        )
    reason = "no gradient reaches integers or booleans, so it cannot be explained as it is"
    return f"{head}: {reason}; {advice}, or leave it out of in_keys"
