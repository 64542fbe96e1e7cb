"""How a torch function is classed by its name: piecewise linear, a product, a division, piecewise constant, nonlinear,
or decided by its arguments.

The watch of the first call (:class:`~tdhook.attribution._nonlinear_calls.NonlinearCalls`) asks
:func:`function_kind` of every call it sees; the tables here say which names are which. A function is known by the
name torch resolves it to (``torch.Tensor.__iadd__`` is ``add``, ``torch.spmm`` is ``mm``), so the in-place,
reflected and method forms of one function are classed alike.

Examples:
    >>> import torch
    >>> function_kind(torch.relu), function_kind(torch.Tensor.__rmul__), function_kind(torch.floor)
    (('relu', 'linear'), ('mul', 'product'), ('floor', 'constant'))
"""

from __future__ import annotations

from typing import Any

from torch.overrides import resolve_name

from tdhook.attribution._argument_kinds import BY_ARGUMENTS
from tdhook.attribution._operator_calls import aten_function, is_operator, operator_name

__all__ = [
    "LINEAR_OPERATORS",
    "NOT_FACTORS",
    "PIECEWISE_CONSTANT",
    "PRODUCTS",
    "PRODUCT_FACTORS",
    "REAL_ONLY",
    "RELU_RECURRENCES",
    "function_kind",
    "is_linear_operator_function",
]

# Calls that are linear or piecewise linear in each activation argument: their plain gradient is exact LRP-0.
_PIECEWISE_LINEAR = frozenset(
    "add sub rsub neg negative positive sum mean nansum cumsum diff trace cat concat concatenate stack hstack "
    "vstack dstack split split_with_sizes chunk unbind tensor_split view view_as reshape reshape_as flatten "
    "unflatten squeeze unsqueeze permute transpose swapaxes swapdims movedim moveaxis t T mT H mH expand "
    "expand_as broadcast_to repeat repeat_interleave tile roll flip fliplr flipud rot90 narrow select "
    "index_select gather take take_along_dim masked_select masked_fill masked_scatter index_put index_add "
    "index_copy index_fill scatter scatter_add where getitem setitem contiguous clone to type "
    "type_as float double half bfloat16 cpu cuda copy fill zero pad constant_pad_nd relu relu6 leaky_relu "
    "hardtanh hardshrink softshrink threshold rrelu clamp clip clamp_min clamp_max abs max min amax amin maximum "
    "minimum fmax fmin sort topk max_pool1d max_pool2d max_pool3d max_pool1d_with_indices max_pool2d_with_indices "
    "max_pool3d_with_indices max_unpool1d max_unpool2d max_unpool3d adaptive_max_pool1d adaptive_max_pool2d "
    "adaptive_max_pool3d fractional_max_pool2d fractional_max_pool3d fractional_max_pool2d_with_indices "
    "fractional_max_pool3d_with_indices "
    "adaptive_max_pool1d_with_indices adaptive_max_pool2d_with_indices adaptive_max_pool3d_with_indices "
    "avg_pool1d avg_pool2d avg_pool3d adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d dropout "
    "dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout interpolate upsample upsample_nearest "
    "upsample_bilinear pixel_shuffle pixel_unshuffle channel_shuffle native_channel_shuffle unfold "
    "fold diagonal diag diag_embed tril triu as_strided nan_to_num "
    "embedding one_hot detach broadcast_tensors atleast_1d atleast_2d atleast_3d pack_padded_sequence "
    "pad_packed_sequence pack_sequence pad_sequence view_as_complex view_as_real real imag".split()
)
# Selections of one element (an order statistic, a running maximum) or of a fixed mix of two (a quantile between
# two order statistics), an affine grid's positions (linear in its matrix), ``put``'s writes.
_PIECEWISE_LINEAR |= frozenset("kthvalue median nanmedian quantile nanquantile cummax cummin affine_grid put".split())
# ATen's own names of views, copies and indexing, for operators called through ``torch.ops`` (``aten.slice.Tensor``
# is ``h[:, 1:]``, ``aten.index.Tensor`` an advanced index, ``aten._to_copy`` a ``.to``).
_PIECEWISE_LINEAR |= frozenset("slice slice_scatter select_scatter unsafe_view to_copy alias index".split())
# The discrete Fourier transforms (``torch.fft``): linear maps, as a global filter's ``irfft(rfft(x) * w)``.
_FOURIER = frozenset(
    "fft ifft fft2 ifft2 fftn ifftn rfft irfft rfft2 irfft2 rfftn irfftn hfft ihfft hfft2 ihfft2 hfftn ihfftn "
    "fftshift ifftshift".split()
)
_PIECEWISE_LINEAR |= _FOURIER
# The complex conjugate (``Q * K.conj()`` of an autocorrelation): linear over the reals, as the real and imaginary
# parts are.
_PIECEWISE_LINEAR |= frozenset("conj conj_physical resolve_conj resolve_neg adjoint".split())
# Joins the table left out (``column_stack``, and ``row_stack``, ``vstack``'s alias): copies of their pieces' values,
# as ``cat`` and ``hstack`` are (they were named uncovered: a warning, a ValueError under strict=True).
_PIECEWISE_LINEAR |= frozenset("column_stack row_stack".split())
# Calls piecewise linear on real activations only: the magnitude of a complex one (``rfft(x).abs()``) is curved.
REAL_ONLY = frozenset({"abs"})
# Calls that are piecewise constant in their activation: their gradient is zero, and no relevance passes back.
PIECEWISE_CONSTANT = frozenset("round floor ceil trunc fix sign sgn heaviside".split())
# Products and maps that are linear in each factor: piecewise linear as long as at most one factor is an activation.
PRODUCTS = frozenset(
    "mul rmul multiply matmul rmatmul mm bmm einsum bilinear tensordot kron outer dot vdot inner mv addcmul baddbmm "
    "addbmm addmm addmv linear conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d conv_tbc "
    "grouped_mm scaled_mm scaled_grouped_mm embedding_bag".split()
)
# Where a product's factors are: an added term (addmm's input) is not a factor.
PRODUCT_FACTORS = {"addmm": slice(1, 3), "addmv": slice(1, 3), "baddbmm": slice(1, 3), "addbmm": slice(1, 3)}
PRODUCT_FACTORS |= {"addcmul": slice(1, 3)}
# A convolution's or linear map's factors are its input and its weight: a bias computed from the inputs is added.
PRODUCT_FACTORS |= {name: slice(0, 2) for name in ("linear", "conv1d", "conv2d", "conv3d")}
PRODUCT_FACTORS |= {f"conv_transpose{n}d": slice(0, 2) for n in (1, 2, 3)}
# Arguments passed by keyword that are no factor of a product: an added term, a bias, an output buffer.
NOT_FACTORS = frozenset({"bias", "out"})
# A recurrence of linear maps through a ReLU (``nn.RNN`` and ``nn.RNNCell`` with ``nonlinearity="relu"``): piecewise
# linear in its input and hidden state together, as long as no weight is an activation. Where its weights are: the
# layer's list of parameters, the cell's arguments after the hidden state.
RELU_RECURRENCES = {"rnn_relu": "list", "rnn_relu_cell": slice(2, None)}
_DIVISIONS = frozenset({"div", "divide", "true_divide", "truediv", "floor_divide", "floordiv"})
# The in-place and reflected forms of Python's operators (``__iadd__``, ``__rmul__``): the same function.
_OPERATORS = frozenset({"add", "sub", "mul", "matmul", "truediv", "floordiv", "div", "pow", "mod"})
# Custom operators (called through ``torch.ops``) that are linear or piecewise linear in their features: torchvision's
# pooling of boxes, RoIAlign and RoIPool and their position-sensitive forms (``MultiScaleRoIAlign`` in the R-CNN
# detectors). Each output is a bilinear sample or a maximum of the features at fixed positions: the boxes get no
# gradient from the backward torchvision registers.
LINEAR_OPERATORS = frozenset(f"torchvision.{name}" for name in ("roi_align", "ps_roi_align", "roi_pool", "ps_roi_pool"))
# Functions torch names otherwise than users call them: ``torch.mm`` resolves to ``torch.spmm``.
_ALIASES = {"spmm": "mm"}


def function_kind(func: Any) -> tuple[str, str]:
    """The name of a torch function and its kind: ``"linear"``, ``"product"``, ``"division"``,
    ``"reflected division"``, ``"constant"`` (piecewise constant: a zero gradient), ``"nonlinear"`` or
    ``"by arguments"`` (a reduction's kind, the tensor an argument names: see
    :mod:`~tdhook.attribution._argument_kinds`).

    Examples:
        >>> import torch
        >>> function_kind(torch.Tensor.__iadd__), function_kind(torch.sin), function_kind(torch.Tensor.__rtruediv__)
        (('add', 'linear'), ('sin', 'nonlinear'), ('truediv', 'reflected division'))
    """
    kind = _KINDS.get(func)
    if kind is None:
        kind = _KINDS[func] = _classify(func)
    return kind


_KINDS: dict[Any, tuple[str, str]] = {}


def _classify(func: Any) -> tuple[str, str]:
    if is_operator(func):  # through ``torch.ops``: an ATen operator is the function it computes, a custom one curved
        full = aten_function(func)
        if full is None:
            name = operator_name(func)
            return name, "linear" if ".".join(name.split(".")[:2]) in LINEAR_OPERATORS else "nonlinear"
    else:
        try:
            full = resolve_name(func) or getattr(func, "__name__", repr(func))
        except Exception:  # noqa: BLE001 (a callable torch cannot name: judged by its own name)
            full = getattr(func, "__name__", repr(func))
    parts = full.split(".")
    name = parts[-2] if parts[-1] == "__get__" and len(parts) > 1 else parts[-1]
    name = _ALIASES.get(name, name)
    reflected = False
    if name.startswith("__") and name.endswith("__"):
        name = name.strip("_")
        if name[:1] in "ri" and name[1:] in _OPERATORS:
            reflected, name = name[0] == "r", name[1:]
    name = name.rstrip("_") if name.endswith("_") and not name.startswith("_") else name.strip("_")
    if name in _DIVISIONS:
        return name, "reflected division" if reflected else "division"
    if name in BY_ARGUMENTS:
        return name, "by arguments"
    if name in PRODUCTS:
        return name, "product"
    if name in _PIECEWISE_LINEAR:
        return name, "linear"
    if name in PIECEWISE_CONSTANT:
        return name, "constant"
    return name, "nonlinear"


def is_linear_operator_function(function: type) -> bool:
    """Whether a custom autograd Function is the one ``torch.library.register_autograd`` makes for an operator of
    :data:`LINEAR_OPERATORS` (``GeneratedBackwardFor_torchvision_roi_align_default``): its backward is the plain
    gradient of a linear map.

    Examples:
        >>> import torch
        >>> class GeneratedBackwardFor_torchvision_roi_align_default(torch.autograd.Function):
        ...     pass
        >>> is_linear_operator_function(GeneratedBackwardFor_torchvision_roi_align_default)
        True
        >>> is_linear_operator_function(torch.autograd.Function)
        False
    """
    name = function.__name__
    return any(name.startswith(f"GeneratedBackwardFor_{op.replace('.', '_')}_") for op in LINEAR_OPERATORS)
