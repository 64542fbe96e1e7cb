"""Stacked copies of a batch that change each other's outputs in one forward pass: a model that mixes the samples of
its batch in its own forward.

The methods and the metrics stack perturbed copies of a batch (the points of a path, noisy copies, perturbation
steps) along its first dimension and run them in one pass. A model that treats each sample apart gives every copy the
outputs it gets in a pass of its own. One that computes a statistic of its batch in its forward, where no module
shows it (``F.batch_norm(x, None, None, training=True)``, ``(x - x.mean(0)) / x.std(0)``), normalises every copy
with the statistics of all of them: a function other than the model's on one batch. The first stacked pass of a call
is compared with its first and middle copies run alone (:func:`steps_mixed`), and on a difference beyond rounding the
copies run one per pass, with a warning naming the module that mixes them. A model built of torch's layers that
compute each sample apart is not compared (:func:`samples_apart`). A BatchNorm module in training mode runs one copy
per pass from the start (see :mod:`~tdhook.attribution.methods._batch_statistics`).

Examples:
    >>> from torch import nn
    >>> samples_apart(nn.Sequential(nn.Linear(3, 4), nn.ReLU())), samples_apart(nn.BatchNorm1d(4))
    (True, False)
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from tensordict.nn import TensorDictModule
from torch import nn
from torch.nn.modules import module as module_globals

from tdhook.attribution.methods._random_draws import drew, random_states
from tdhook.attribution.rules._caller import warn_at_caller

__all__ = [
    "TRAILING_LAYERS",
    "checked_for_mixing",
    "copies_apart",
    "copies_mixed",
    "hooked",
    "known_to_mix",
    "samples_apart",
    "steps_mixed",
]

_MIXING: weakref.WeakSet = weakref.WeakSet()  # the methods whose model was found to mix (see known_to_mix)


class _Drew(Exception):
    """A pass of a copy alone moved the global random state: the model draws at random in its forward."""


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def hooked(module: nn.Module) -> bool:
    """Whether ``module`` runs anything besides its class's forward: a hook, or a forward set on the instance (as
    accelerate's hooks and monkeypatching do), which ``module(x)`` calls in place of the class's."""
    return any(getattr(module, name, None) for name in _HOOKS) or "forward" in vars(module)


# torch's own layers that compute each sample of a batch apart (along its first dimension), whatever the rest of the
# batch holds: a plain nn.Sequential of them, with no hook, needs no comparison of its stacked steps.
_APART_LAYERS = frozenset(
    {
        nn.Linear, nn.Identity, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
        nn.ConvTranspose3d, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
        nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
        nn.AdaptiveAvgPool3d, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU,
        nn.Mish, nn.Tanh, nn.Sigmoid, nn.Softplus, nn.Softsign, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid,
        nn.LogSigmoid, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.LayerNorm,
        nn.GroupNorm, nn.RMSNorm,
    }
)  # fmt: skip
# torch's layers that read only the last dimensions of their input, whatever the dimensions before (a leading one
# added included): each sample, and each position of a [B, T] batch, computed from its own features.
TRAILING_LAYERS = frozenset(
    {
        nn.Linear, nn.Identity, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish,
        nn.Tanh, nn.Sigmoid, nn.Softplus, nn.Softsign, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.LogSigmoid,
        nn.Tanhshrink, nn.Dropout, nn.AlphaDropout, nn.LayerNorm, nn.RMSNorm,
    }
)  # fmt: skip
# Apart along a dimension counted from the front after the first (-1 is the first of a batch of values alone).
_ALONG_A_DIMENSION = (nn.Softmax, nn.LogSoftmax)


def samples_apart(model: nn.Module, batch_dims: int = 1) -> bool:
    """Whether ``model`` is one of torch's layers that compute each sample apart (``nn.Linear``, convolutions,
    pooling, element-wise activations, layer and group norms, a BatchNorm with running statistics in eval mode, a
    softmax or flattening after the first dimension), or a plain ``nn.Sequential`` of them, with no hook: its stacked
    steps cannot change each other's outputs.

    With ``batch_dims=0`` (a batch ``[]``: the stacked steps are a new first dimension of one sample, which the
    model's own pass does not have) only the layers that read the last dimensions of their input alone qualify
    (``nn.Linear``, element-wise activations, layer and RMS norms, a softmax or flattening counted from the end):
    the others read the dimensions from the front, and the new one shifts them (``nn.LogSoftmax(dim=1)`` of a
    ``[rows, classes]`` sample would normalise over the rows).

    Examples:
        >>> samples_apart(nn.Sequential(nn.Flatten(), nn.Linear(4, 3), nn.ReLU(), nn.Softmax(1)))
        True
        >>> samples_apart(nn.Softmax(-1)), samples_apart(nn.BatchNorm1d(3)), samples_apart(nn.BatchNorm1d(3).eval())
        (False, False, True)
        >>> samples_apart(nn.Softmax(1), batch_dims=0), samples_apart(nn.Softmax(-1), batch_dims=0)
        (False, True)
    """
    if hooked(model) or module_globals._global_forward_hooks or module_globals._global_forward_pre_hooks:
        return False
    kind = type(model)
    if kind is nn.Sequential:
        return all(samples_apart(layer, batch_dims) for layer in model)
    if not batch_dims:
        if kind is nn.Flatten:
            return model.start_dim < 0 and model.end_dim < 0
        if kind in _ALONG_A_DIMENSION:
            return model.dim is not None and model.dim < 0
        return kind in TRAILING_LAYERS
    if kind in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d):
        return not model.training and model.running_mean is not None and model.running_var is not None
    if kind is nn.Flatten:  # from -1 on, a batch of values alone is left as it is
        return model.start_dim >= 1 or model.start_dim == -1
    if kind in _ALONG_A_DIMENSION:
        return model.dim is not None and model.dim >= 1
    return kind in _APART_LAYERS


def steps_mixed(
    stacked: torch.Tensor,
    alone: Callable[[int], torch.Tensor],
    modules: Callable[[], Mapping[str, nn.Module]],
    rerun: Callable[[], object],
    first: torch.Tensor | None = None,
    owner: str = "metrics",
    step: str = "a step",
    advice: str = "pass steps_per_forward=1 to run so from the start",
    unbatched: bool = False,
) -> str | None:
    """Whether a pass of stacked steps gave its first or its middle step other outputs than that step's own pass:
    the model mixes the samples of its batch, named and warned of; ``None`` where they agree up to rounding.

    A model that treats the samples of its batch apart gives a step the same outputs alone and stacked with others,
    up to the rounding of kernels that depend on the batch size: the difference, relative to the step's largest
    output, must stay within the square root of the dtype's resolution (3.5e-4 in float32, 1.5e-8 in float64).
    Where it does not, the modules are hooked over a second stacked pass and the step's pass: the module that mixes
    is the innermost whose inputs agree and whose outputs differ. Two steps are compared: the first, whose inputs
    differ most from the stack's mean where a curve's steps go ever further from the input, and the middle one,
    whose maximum over the batch is below the stack's once the first steps have taken the largest inputs (the last
    step of a curve, every feature at a zero baseline, shows no scale). A model whose mixing leaves both unchanged
    goes unseen.

    Args:
        stacked: the outputs of the stacked pass, ``[steps, ...]``.
        alone: ``alone(i)``: the outputs of step ``i`` run in a pass of its own, shaped like ``stacked[i]``.
        modules: gives the model's modules by name (``""`` the model itself), where a module is to be found.
        rerun: runs the stacked pass again.
        first: the first step's own outputs where a pass gave them already (``alone(0)`` then runs only to find the
            module that mixes).
        owner: who warns (``"metrics"``, a method's name).
        step: what a step is, with its article (``"a step"``, ``"a copy of the batch"``).
        advice: how to run one step per pass from the start.
        unbatched: whether the steps are of a batch ``[]``, stacked along a new first dimension that a step's own pass
            does not have: the model may read its input's dimensions from the front, and is said to.

    Returns:
        The module, as ``"module 'name' (Type)"`` or ``"the model (Type)"``, or ``None``.

    Examples:
        >>> import warnings
        >>> net = nn.Linear(3, 2)
        >>> x = torch.randn(4, 2, 3)  # 4 steps of a batch of 2
        >>> with torch.no_grad():
        ...     steps_mixed(net(x.flatten(0, 1)).unflatten(0, (4, 2)), lambda i: net(x[i]), dict, None) is None
        True
        >>> standardised = lambda h: (h - h.mean(0)) / h.std(0)
        >>> stacked = standardised(x.flatten(0, 1)).unflatten(0, (4, 2))
        >>> with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     steps_mixed(stacked, lambda i: standardised(x[i]), dict, list)
        'the model'
        >>> "mixes the samples of its batch" in str(caught[0].message)
        True
    """
    steps = stacked.shape[0]
    for index in dict.fromkeys((0, steps // 2)):
        own = (first if index == 0 and first is not None else alone(index)).reshape(stacked[index].shape)
        # A forward that differs between two passes of the same step draws at random: not a mixing (the metrics
        # refuse such a target by what its draws do).
        if (
            not _close(stacked[index], own)
            and not _close(stacked[index], own, _coarsest_precision(modules()))
            and _close(alone(index).reshape(own.shape), own)
        ):
            apart = _apart(stacked[index], own)
            found = _mixing_module(modules(), rerun, functools.partial(alone, index), steps, index)
            plural = step.split(" ", 1)[1].replace("copy", "copies").replace("step", "steps")
            if unbatched:
                warn_at_caller(
                    f"{owner}: {found or 'the model'} reads the dimensions of its input from the front, or mixes the "
                    f"samples of its batch: on a batch [], {step} stacked with others along a new first dimension got "
                    f"other outputs than in a pass of its own at the sample's shape ({apart:.2g} apart, relative to "
                    "its largest output; nn.LogSoftmax(dim=1) of a [rows, classes] sample normalises over the rows "
                    f"once stacked). The {plural} run one per pass, at the sample's shape; where its first dimension "
                    "holds samples, give the TensorDict that batch size (batch_size=[rows]) to explain each row as one"
                )
                return found or "the model"
            warn_at_caller(
                f"{owner}: {found or 'the model'} mixes the samples of its batch in its forward: {step} stacked "
                f"with others in one pass got other outputs than in a pass of its own ({apart:.2g} apart, relative "
                "to its largest output), as a batch statistic computed in the forward gives them (F.batch_norm in "
                f"training mode, x - x.mean(0)). The {plural} run one per pass, each as the batch it is; "
                f"{advice}, or call .eval() where it normalises by the batch in training mode only"
            )
            return found or "the model"
    return None


def _coarsest_precision(modules: Mapping[str, nn.Module]) -> torch.dtype | None:
    """The floating dtype of least resolution among the parameters and buffers of ``modules``: a model that computes
    in float32 and returns float64 (``.double()`` at its end) rounds as float32 does. ``None`` where none floats."""
    dtypes = {
        tensor.dtype
        for module in modules.values()
        for tensor in [*module._parameters.values(), *module._buffers.values()]
        if tensor is not None and tensor.is_floating_point()
    }
    return max(dtypes, key=lambda dtype: torch.finfo(dtype).eps, default=None)


def _tolerance(value: torch.Tensor, precision: torch.dtype | None = None) -> float:
    """The difference between a step alone and stacked that rounding may leave in ``value``: the square root of the
    resolution it is computed in (that of autocast's dtype under autocast, TF32's where CUDA may take it for float32
    products and convolutions, ``precision``'s where given and coarser: the model's own)."""
    if not value.is_floating_point():
        return 0.0
    eps, device = torch.finfo(value.dtype).eps, value.device.type
    if precision is not None:
        eps = max(eps, torch.finfo(precision).eps)
    if torch.is_autocast_enabled(device):
        eps = max(eps, torch.finfo(torch.get_autocast_dtype(device)).eps)
    tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32
    if device == "cuda" and value.dtype == torch.float32 and tf32:
        eps = max(eps, 2.0**-10)  # TF32 keeps 10 bits of mantissa
    return math.sqrt(eps)


def _close(a: torch.Tensor, b: torch.Tensor, precision: torch.dtype | None = None) -> bool:
    """Whether ``a`` and ``b`` differ by at most the rounding :func:`_tolerance` allows, relative to their largest
    finite magnitude (NaN in both, and the same infinity, are the same): :func:`_apart` within it, in a few
    operations."""
    if a.shape != b.shape:
        return False
    if torch.equal(a, b) or not a.is_floating_point():
        return torch.equal(a, b)
    a, b, tolerance = a.detach(), b.detach(), _tolerance(a, precision)
    largest_a, largest_b, worst = torch.stack([a.abs().max(), b.abs().max(), (a - b).abs().max()]).tolist()
    if math.isfinite(largest_a + largest_b + worst):
        return worst <= tolerance * max(largest_a, largest_b)
    return _apart(a, b) <= tolerance  # an infinity or a NaN


def _apart(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference of ``a`` and ``b``, relative to their largest finite magnitude; ``inf`` where they
    differ in shape, or where one is finite and the other not (NaN in both is the same)."""
    if a.shape != b.shape:
        return math.inf
    same = (a == b) | (a.isnan() & b.isnan()) if a.is_floating_point() else a == b
    if bool(same.all()):
        return 0.0
    a, b = a.detach().double(), b.detach().double()
    finite = a.isfinite() & b.isfinite()
    if not bool(finite[~same].all()):
        return math.inf
    scale = max(a[finite].abs().max().item(), b[finite].abs().max().item())
    return (a - b)[~same].abs().max().item() / scale if scale > 0 else math.inf


def _mixing_module(
    modules: Mapping[str, nn.Module], rerun: Callable[[], object], alone: Callable[[], object], steps: int, step: int
) -> str | None:
    """The innermost module whose first call's input has the same rows for ``step`` in the stacked pass as in the
    step's own pass, and whose output has not; ``None`` where none is found. The rows are copied as they come (a
    later layer may change them in place)."""
    own: dict[str, tuple] = {}  # the step's own pass, which runs first
    stacked: dict[str, tuple] = {}
    records = [own]

    def recorder(name: str) -> Callable:
        def record(module: nn.Module, args: tuple, output: object) -> None:
            values = _first_tensor(args), _first_tensor(output)
            if records[0] is own and name not in own:
                own[name] = tuple(None if v is None else v.detach().clone() for v in values)
            elif records[0] is stacked and name in own and name not in stacked:
                stacked[name] = tuple(_rows(v, o, steps, step) for v, o in zip(values, own[name], strict=True))

        return record

    # A TorchScript module takes no hook: it is looked at as a whole, by the module around it.
    handles = [
        module.register_forward_hook(recorder(name))
        for name, module in modules.items()
        if not isinstance(module, torch.jit.ScriptModule)
    ]
    try:
        with torch.no_grad():
            alone()
            records[0] = stacked
            rerun()
    finally:
        for handle in handles:
            handle.remove()
    found = []
    for name, (inputs, output) in stacked.items():
        if inputs is None or output is None or not _close(inputs, own[name][0]):
            continue
        if not _close(output, own[name][1]):
            found.append(name)
    inner = [name for name in found if not any(other.startswith(f"{name}.") or not name and other for other in found)]
    if not inner:
        return None
    module = modules[inner[0]]
    return f"module {inner[0]!r} ({type(module).__name__})" if inner[0] else f"the model ({type(module).__name__})"


def _first_tensor(value: object) -> torch.Tensor | None:
    """``value`` if a tensor, else the first tensor of a tuple or list of them."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((item for item in value if isinstance(item, torch.Tensor)), None)
    return None


def _rows(stacked: object, own: object, steps: int, step: int) -> torch.Tensor | None:
    """A copy of the rows of ``step`` in a tensor of the stacked pass, where it lines up with the step's own (its
    first dimension ``steps`` times the step's, or ``steps`` before the step's shape); ``None`` elsewhere."""
    if not isinstance(stacked, torch.Tensor) or not isinstance(own, torch.Tensor):
        return None
    if own.dim() and stacked.shape[1:] == own.shape[1:] and stacked.shape[0] == steps * own.shape[0]:
        return stacked[step * own.shape[0] : (step + 1) * own.shape[0]].detach().clone()
    if stacked.shape[1:] == own.shape and stacked.shape[0] == steps:
        return stacked[step].detach().clone()
    return None


def copies_apart(module: nn.Module, batch_dims: int = 1) -> bool:
    """Whether ``module`` is a plain ``TensorDictModule`` (no hook) of a model :func:`samples_apart` vouches for on
    a batch of ``batch_dims`` dimensions, or such a model itself: its stacked copies need no comparison.

    Examples:
        >>> copies_apart(TensorDictModule(nn.Linear(3, 2), ["x"], ["y"])), copies_apart(nn.BatchNorm1d(2))
        (True, False)
    """
    if type(module) is TensorDictModule:
        return not hooked(module) and samples_apart(module.module, batch_dims)
    return samples_apart(module, batch_dims)


def copies_mixed(method: Any, call: Any, perturbed: Sequence[torch.Tensor], stacked: torch.Tensor) -> bool:
    """Whether the stacked pass of a method's copies ``perturbed`` (``[copies, *input.shape]`` per explained key),
    which gave ``stacked`` (``[units, copies, *batch]``), gave its first or middle copy other outputs than a pass of
    that copy alone (see :func:`steps_mixed`, which names the module and warns). ``method`` is the
    :class:`~tdhook.attribution.methods._base.AttributionMethod` and ``call`` its call; the copies then run one per
    pass."""
    inputs = [x.detach() for x in perturbed]

    def alone(index: int) -> torch.Tensor:
        before = random_states(method.module)
        with torch.no_grad():
            own = method._run_copies(call, [x[index : index + 1] for x in inputs])[:, 0]
        if drew(method.module, before):  # rare draws may leave two passes of a copy alike and the stack not
            raise _Drew
        return own

    def rerun() -> None:
        with torch.no_grad():
            method._run_copies(call, inputs)

    rows = call.batch_shape.numel()
    advice = (
        f"pass internal_batch_size={rows} to run so from the start"
        if hasattr(method, "internal_batch_size")
        else "pass perturbations_per_eval=1 to run so from the start"
    )
    try:
        found = steps_mixed(
            stacked.detach().transpose(0, 1),
            alone,
            lambda: dict(_model(method.module).named_modules()),
            rerun,
            owner=type(method).__name__,
            step="a copy of the batch",
            advice=advice,
            unbatched=not call.batch_dims,
        )
    except _Drew:  # a model that draws at random is named for its draws (see _random_draws), not compared
        return False
    return found is not None


def checked_for_mixing(
    method: Any, call: Any, perturbed: Sequence[torch.Tensor], stacked: torch.Tensor | None
) -> torch.Tensor | None:
    """``stacked``, the explained quantity of the copies ``perturbed`` in one pass (``[units, copies, *batch]``), or
    ``None`` where it is the call's first stack of several copies and :func:`copies_mixed` finds them mixed: the
    copies then run one per pass (``call.separate_copies``). Later stacks, and a call whose model
    :func:`copies_apart` vouches for (``call.mixing_checked``), are not compared."""
    if stacked is None or stacked.shape[1] < 2 or call.mixing_checked:
        return stacked
    call.mixing_checked = True
    if copies_mixed(method, call, perturbed, stacked):
        call.separate_copies = True
        if call.batch_dims:  # on a batch [] the new first dimension may be why: a batch of samples may stack
            _MIXING.add(method)
        return None
    return stacked


def known_to_mix(method: Any) -> bool:
    """Whether an earlier call of ``method`` found that its model mixes the samples of its batch (see
    :func:`checked_for_mixing`): its later calls run one copy per pass from the start, with no comparison and no
    second warning. One copy per pass is right for any model; a model changed since then is only run slower."""
    return method in _MIXING


def _model(module: nn.Module) -> nn.Module:
    """The model a ``TensorDictModule`` wraps, whose modules a message names as the caller named them."""
    return module.module if isinstance(module, TensorDictModule) else module
