"""Models whose output depends on the other samples of their batch: BatchNorm normalising by the batch's statistics.

The metrics stack perturbed copies of a batch into one pass; through such a layer the copies would change each
other's outputs, so they run one copy per pass. In training mode each pass also updates the layer's running
statistics, with which some layers normalise (torchrl's ``BatchRenorm1d``): every pass of a metric starts from the
statistics the caller left (:func:`statistics_kept`), and the caller's model is left as it was.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    >>> batch_normalising_module(net)
    '1 (BatchNorm1d)'
    >>> @keeps_running_statistics
    ... def passes(model, x):
    ...     return model(x)
    >>> _ = passes(net, torch.randn(5, 3))
    >>> net[1].running_mean.abs().max().item(), int(net[1].num_batches_tracked)
    (0.0, 0)

A model may also mix its samples in its own forward, where no module shows it (``F.batch_norm(x, None, None,
training=True)``, ``(x - x.mean(0)) / x.std(0)``): the first pass of stacked steps of a metric's call is compared
with its first and middle steps run alone (:func:`steps_mixed`; the scorer puts the unperturbed batch first, whose
own pass it has), and on a difference beyond rounding the steps run one per pass, with a warning naming the module
that mixes them. A model built of torch's layers that compute each sample apart is not compared
(:func:`samples_apart`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections.abc import Callable, Mapping
from typing import TypeVar

import torch
from torch import nn
from torch.nn.modules import module as module_globals

from tdhook.attribution._running_statistics import refuse_moving_statistics
from tdhook.attribution.methods._batch_statistics import batch_normalisers, buffers_kept
from tdhook.attribution.rules._caller import warn_at_caller

__all__ = [
    "StepsMixed",
    "batch_normalising_module",
    "hooked",
    "keeps_running_statistics",
    "samples_apart",
    "statistics_kept",
    "steps_mixed",
]

Metric = TypeVar("Metric", bound=Callable)


def batch_normalising_module(module: object, modules: Mapping[str, nn.Module] | None = None) -> str | None:
    """The first module of ``module`` whose output depends on the other samples of its batch, named with its type, or
    ``None`` (see :func:`~tdhook.attribution.methods._batch_statistics.batch_normalisers`: a BatchNorm in training
    mode or without running statistics, torchrl's ``BatchRenorm1d`` in training mode). ``modules``: those of
    ``module`` by name, where the caller has walked them already.

    Examples:
        >>> net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, track_running_stats=False))
        >>> batch_normalising_module(net), batch_normalising_module(nn.BatchNorm1d(4).eval())
        ('1 (BatchNorm1d)', None)
    """
    if not isinstance(module, nn.Module):
        return None
    modules = dict(module.named_modules()) if modules is None else modules
    names = batch_normalisers(modules)
    return f"{names[0] or type(module).__name__} ({type(modules[names[0]]).__name__})" if names else None


def statistics_kept(model: nn.Module) -> contextlib.AbstractContextManager:
    """The context of one pass of a metric through ``model`` (or through a method that runs it): modules in training
    mode update copies of their buffers, so that the next pass starts, as this one did, from the running statistics
    the caller left.

    Examples:
        >>> import torch
        >>> from torchrl.modules import BatchRenorm1d
        >>> norm = BatchRenorm1d(2, warmup_steps=1, momentum=0.5)
        >>> x = torch.randn(4, 2)
        >>> with statistics_kept(norm):
        ...     first = norm(x)
        >>> torch.equal(norm(x), first)  # from the same statistics, the same output
        True
    """
    return buffers_kept(model)


def keeps_running_statistics(metric: Metric) -> Metric:
    """``metric`` leaving the buffers of its model (its first argument) as they were, even on failure: the passes of
    modules in training mode update copies of them (see
    :func:`~tdhook.attribution.methods._batch_statistics.buffers_kept`). A torchrl ``VecNorm`` that is not frozen,
    whose statistics are no buffers, is refused by name."""
    first = next(iter(inspect.signature(metric).parameters))

    @functools.wraps(metric)
    def kept(*args, **kwargs):
        model = args[0] if args else kwargs.get(first)
        if not isinstance(model, nn.Module):
            return metric(*args, **kwargs)
        modules = dict(model.named_modules())
        refuse_moving_statistics(metric.__name__, modules)  # not buffers: kept by no copy
        # Modules in eval mode leave their buffers as they are: with no buffer in a module in training mode there is
        # nothing to keep.
        if not any(module.training and len(module._buffers) for module in modules.values()):
            return metric(*args, **kwargs)
        with buffers_kept(model):
            return metric(*args, **kwargs)

    return kept


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
# Apart along a dimension counted from the front after the first (-1 is the first of a batch of values alone).
_ALONG_A_DIMENSION = (nn.Softmax, nn.LogSoftmax)


def samples_apart(model: nn.Module) -> bool:
    """Whether ``model`` is one of torch's layers that compute each sample apart (``nn.Linear``, convolutions,
    pooling, element-wise activations, layer and group norms, a BatchNorm with running statistics in eval mode, a
    softmax or flattening after the first dimension), or a plain ``nn.Sequential`` of them, with no hook: its stacked
    steps cannot change each other's outputs.

    Examples:
        >>> samples_apart(nn.Sequential(nn.Flatten(), nn.Linear(4, 3), nn.ReLU(), nn.Softmax(1)))
        True
        >>> samples_apart(nn.Softmax(-1)), samples_apart(nn.BatchNorm1d(3)), samples_apart(nn.BatchNorm1d(3).eval())
        (False, False, True)
    """
    if hooked(model) or module_globals._global_forward_hooks or module_globals._global_forward_pre_hooks:
        return False
    kind = type(model)
    if kind is nn.Sequential:
        return all(samples_apart(layer) for layer in model)
    if kind in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d):
        return not model.training and model.running_mean is not None and model.running_var is not None
    if kind is nn.Flatten:  # from -1 on, a batch of values alone is left as it is
        return model.start_dim >= 1 or model.start_dim == -1
    if kind in _ALONG_A_DIMENSION:
        return model.dim is not None and model.dim >= 1
    return kind in _APART_LAYERS


class StepsMixed(Exception):
    """Raised where a stack of steps shows that the model mixes the samples of its batch: ``found`` names the module
    (see :func:`steps_mixed`, which warned of it)."""

    def __init__(self, found: str) -> None:
        super().__init__(found)
        self.found = found


def steps_mixed(
    stacked: torch.Tensor,
    alone: Callable[[int], torch.Tensor],
    modules: Callable[[], Mapping[str, nn.Module]],
    rerun: Callable[[], object],
    first: torch.Tensor | None = None,
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
    for step in dict.fromkeys((0, steps // 2)):
        own = (first if step == 0 and first is not None else alone(step)).reshape(stacked[step].shape)
        # A forward that differs between two passes of the same step draws at random: not a mixing (the metrics
        # refuse such a target by what its draws do).
        if not _close(stacked[step], own) and _close(alone(step).reshape(own.shape), own):
            apart = _apart(stacked[step], own)
            found = _mixing_module(modules(), rerun, functools.partial(alone, step), steps, step)
            warn_at_caller(
                f"metrics: {found or 'the model'} mixes the samples of its batch in its forward: a step stacked with "
                f"other steps in one pass got other outputs than in a pass of its own ({apart:.2g} apart, relative "
                "to its largest output), as a batch statistic computed in the forward gives them (F.batch_norm in "
                "training mode, x - x.mean(0)). The steps run one per pass, each as the batch it is; pass "
                "steps_per_forward=1 to run so from the start, or call .eval() where it normalises by the batch in "
                "training mode only"
            )
            return found or "the model"
    return None


def _tolerance(value: torch.Tensor) -> float:
    """The difference between a step alone and stacked that rounding may leave in ``value``: the square root of the
    resolution it is computed in (that of autocast's dtype under autocast, TF32's where CUDA may take it for float32
    products and convolutions)."""
    if not value.is_floating_point():
        return 0.0
    eps, device = torch.finfo(value.dtype).eps, value.device.type
    if torch.is_autocast_enabled(device):
        eps = max(eps, torch.finfo(torch.get_autocast_dtype(device)).eps)
    tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32
    if device == "cuda" and value.dtype == torch.float32 and tf32:
        eps = max(eps, 2.0**-10)  # TF32 keeps 10 bits of mantissa
    return math.sqrt(eps)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` differ by at most the rounding :func:`_tolerance` allows, relative to their largest
    finite magnitude (NaN in both, and the same infinity, are the same): :func:`_apart` within it, in a few
    operations."""
    if a.shape != b.shape:
        return False
    if torch.equal(a, b) or not a.is_floating_point():
        return torch.equal(a, b)
    a, b, tolerance = a.detach(), b.detach(), _tolerance(a)
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

    handles = [module.register_forward_hook(recorder(name)) for name, module in modules.items()]
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
