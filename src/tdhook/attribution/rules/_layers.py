"""The kinds of layers the rules and mappers tell apart, and a layer's forward pass with other parameters."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from tensordict.nn.utils import biased_softplus
from torch import nn
from torch.func import functional_call
from torch.nn.utils.prune import BasePruningMethod as _PruningHook
from torch.nn.utils.spectral_norm import SpectralNorm as _SpectralNormHook
from torch.nn.utils.weight_norm import WeightNorm as _WeightNormHook
from torchrl.modules.models.utils import SquashDims

from tdhook.attribution.rules._dropout_calls import DropoutCalls
from tdhook.attribution.rules._keeping_graph import graph_kept
from tdhook.attribution.rules._layer_calls import (
    _draws,
    _generator_states,
    _LayerCallCount,
    _probe_input,
    _probed,
    _RecordLayerCall,
    _SubstituteLayerCall,
)
from tdhook.attribution.rules._layer_rays import (
    RULED_EPSILON,
    _batch_statistics_error,
    _bent_error,
    _dropout_error,
    _off_the_map_error,
    _rays_bent,
    _second_map_error,
    _sloped_error,
    _slopes_restabilised,
    _values_off_the_map,
)
from tdhook.attribution.rules._layer_verdicts import checked_once
from tdhook.attribution.rules._plain_calls import run_alone

__all__ = [
    "ACTIVATIONS",
    "AVG_POOLS",
    "BATCH_NORMS",
    "GRADIENT_ROUTED",
    "GRADIENT_ROUTED_NAMES",
    "GRADIENT_ROUTED_SUFFIXES",
    "GATES",
    "PLAIN_CONVOLUTIONS",
    "TRANSPOSED_FORWARDS",
    "TRANSPOSED_INPUT_GRADIENTS",
    "CONVOLUTIONS",
    "LINEAR_LAYERS",
    "forward_with",
    "has_weight",
    "bias_view",
    "effective_parameters",
    "check_layer_forward",
    "check_layer_input",
    "RULED_EPSILON",
]

ACTIVATIONS = (
    nn.ELU,
    nn.Hardshrink,
    nn.Hardsigmoid,
    nn.Hardtanh,
    nn.Hardswish,
    nn.LeakyReLU,
    nn.LogSigmoid,
    nn.PReLU,
    nn.ReLU,
    nn.ReLU6,
    nn.RReLU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.Sigmoid,
    nn.SiLU,
    nn.Mish,
    nn.Softplus,
    nn.Softshrink,
    nn.Softsign,
    nn.Tanh,
    nn.Tanhshrink,
    nn.Threshold,
    biased_softplus,  # the scale mapping of tensordict's NormalParamExtractor
)
AVG_POOLS = (
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AvgPool3d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d,
)
GATES = (nn.Sigmoid, nn.Hardsigmoid)  # activations whose output gates a signal in squeeze-excite blocks
BATCH_NORMS = (nn.modules.batchnorm._BatchNorm,)  # BatchNorm1d/2d/3d, SyncBatchNorm, the lazy ones, subclasses
GRADIENT_ROUTED = (
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.MaxPool3d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d,
    nn.MaxUnpool1d,  # linear in the values it puts back (its indices are integers)
    nn.MaxUnpool2d,
    nn.MaxUnpool3d,
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.Flatten,
    nn.Unflatten,
    nn.Identity,
    nn.Embedding,  # an input layer: LRP gives its tokens the relevance of their embeddings
    SquashDims,
    # Padding, shuffles and resampling copy or average values: their gradient is LRP-0.
    nn.ZeroPad1d,
    nn.ZeroPad2d,
    nn.ZeroPad3d,
    nn.ConstantPad1d,
    nn.ConstantPad2d,
    nn.ConstantPad3d,
    nn.ReflectionPad1d,
    nn.ReflectionPad2d,
    nn.ReflectionPad3d,
    nn.ReplicationPad1d,
    nn.ReplicationPad2d,
    nn.ReplicationPad3d,
    nn.CircularPad1d,
    nn.CircularPad2d,
    nn.CircularPad3d,
    nn.ChannelShuffle,
    nn.PixelShuffle,
    nn.PixelUnshuffle,
    nn.Upsample,
)
# Parameter-free modules of torchvision and timm (not dependencies of tdhook), by class name: stochastic depth
# (the identity in eval mode), reshapes and permutations, and per-channel scales by a parameter (linear).
GRADIENT_ROUTED_NAMES = frozenset(
    {"StochasticDepth", "DropPath", "DropBlock2d", "Permute", "WindowPartition", "WindowDepartition", "SwapAxes"}
    | {"LayerScale", "LayerScale2d", "Scale", "Identity", "ChannelShuffle", "Downsample", "RelPosBias", "RelPosBiasTf"}
)
# The same by the end of the class name, for the models that prefix their own (BeitRelativePositionBias,
# SwinDropPath): a bias table read from parameters alone, and stochastic depth.
GRADIENT_ROUTED_SUFFIXES = ("RelativePositionBias", "DropPath")

PLAIN_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
TRANSPOSED_FORWARDS = {
    nn.ConvTranspose1d: F.conv_transpose1d,
    nn.ConvTranspose2d: F.conv_transpose2d,
    nn.ConvTranspose3d: F.conv_transpose3d,
}

# The input gradient of a transposed convolution is the plain convolution with the same weight.
TRANSPOSED_INPUT_GRADIENTS = {nn.ConvTranspose1d: F.conv1d, nn.ConvTranspose2d: F.conv2d, nn.ConvTranspose3d: F.conv3d}
CONVOLUTIONS = (*PLAIN_CONVOLUTIONS, *TRANSPOSED_FORWARDS)
LINEAR_LAYERS = (*CONVOLUTIONS, nn.Linear)


def forward_with(
    module: nn.Module,
    params: dict[str, torch.Tensor],
    x: torch.Tensor,
    busy: list,
    out_shape: Sequence[int] | None = None,
) -> torch.Tensor:
    """Run ``module`` on ``x`` with ``params`` in place of its own parameters.

    ``out_shape`` is the shape of the output the call being explained gave: a transposed convolution called with
    ``output_size`` chose its output padding from it, and the pass here gives the same shape.
    """
    # Read from the module only where not given: a parametrized weight is computed on each access (spectral_norm's
    # power iteration runs in training mode), which only the module's own call may do.
    weight = params["weight"] if "weight" in params else getattr(module, "weight", None)
    bias = params["bias"] if "bias" in params else getattr(module, "bias", None)
    if isinstance(module, LINEAR_LAYERS) and not _has_torch_forward(module):
        # The layer's own forward (timm's Conv2dSame pads, StdConv2d standardises), with its linear function
        # given these parameters: the rest of what the forward does is kept, and what it sets on the layer is not.
        with torch._C._EnableTorchFunction(), _SubstituteLayerCall(weight, bias), _probed(module):
            return module.forward(x)
    if isinstance(module, nn.Linear):
        return F.linear(x, weight, bias)
    if isinstance(module, PLAIN_CONVOLUTIONS):
        return module._conv_forward(x, weight, bias)
    # By isinstance: a parametrized layer's class is a subclass of the layer's.
    transposed = next((f for kind, f in TRANSPOSED_FORWARDS.items() if isinstance(module, kind)), None)
    if transposed is not None:
        m = module
        output_padding = m.output_padding if out_shape is None else _output_padding(m, x, out_shape)
        return transposed(x, weight, bias, m.stride, m.padding, output_padding, m.groups, m.dilation)
    if nn.utils.parametrize.is_parametrized(module):
        # functional_call would set the values through the parametrization's right_inverse, writing its original.
        raise ValueError(
            f"{type(module).__name__}: a rule's modified pass cannot run a parametrized module of this kind"
        )
    busy.append(threading.get_ident())  # the rule's own hook must not run on this thread's inner call
    try:
        return functional_call(module, params, (x,))
    finally:
        busy.remove(threading.get_ident())


def _output_padding(module: nn.Module, x: torch.Tensor, out_shape: Sequence[int]) -> tuple[int, ...]:
    """The output padding that gives a transposed convolution's output on ``x`` the spatial size of ``out_shape``."""
    dims = len(module.kernel_size)
    m = module
    spans = zip(x.shape[-dims:], out_shape[-dims:], m.stride, m.padding, m.dilation, m.kernel_size, strict=True)
    return tuple(n_out - ((n_in - 1) * s - 2 * p + d * (k - 1) + 1) for n_in, n_out, s, p, d, k in spans)


def bias_view(module: nn.Module, bias: torch.Tensor) -> torch.Tensor:
    """``bias`` shaped to broadcast over the output ``z``: its last dimension (Linear) or the channel dimension."""
    return bias if isinstance(module, nn.Linear) else bias.view(-1, *([1] * len(module.kernel_size)))


# The hooks that compute a layer's weight or bias before each call: the older torch.nn.utils.weight_norm and
# spectral_norm, and torch.nn.utils.prune (the original times the mask).
_WEIGHT_HOOKS = (_WeightNormHook, _SpectralNormHook, _PruningHook)


def _computed_name(hook: object) -> str:
    """The attribute a weight hook sets on its layer (``weight``, or ``bias`` for a pruned bias)."""
    return hook._tensor_name if isinstance(hook, _PruningHook) else hook.name


def _holds_its_parameters(module: nn.Module) -> bool:
    """Whether the ``weight`` and ``bias`` the layer's forward reads are its own parameters, not tensors a hook
    computes before each call (``torch.nn.utils.prune`` keeps ``weight_orig`` and sets ``weight``)."""
    shadowed = "weight" in module.__dict__ or "bias" in module.__dict__  # read before the parameters of that name
    return isinstance(module._parameters.get("weight"), nn.Parameter) and not shadowed


def has_weight(module: nn.Module) -> bool:
    """Whether ``module`` has a tensor ``weight``, told without computing a parametrized one (see
    :func:`forward_with`)."""
    if nn.utils.parametrize.is_parametrized(module, "weight"):
        return True
    return isinstance(getattr(module, "weight", None), torch.Tensor)


def _has_torch_forward(module: nn.Module) -> bool:
    """Whether the layer's forward is torch's own (a parametrized layer's class keeps it): its linear function of
    the input, the weight and the bias, and nothing else. A forward set on the instance (``conv.forward = ...``, a
    weight mask or a low-rank adapter patched in) is one of its own, as the same forward in a subclass is, and so is
    a convolution's ``_conv_forward`` of its own (a weight standardised there): torch's forward hands it the stored
    weight, which it may change, so the rules' modified weights cannot be passed to it. A transposed convolution's
    ``_output_padding`` of its own is not: the modified passes take the output padding from the explained call's
    output."""
    base = next(cls for cls in (nn.Linear, *PLAIN_CONVOLUTIONS, *TRANSPOSED_FORWARDS) if isinstance(module, cls))
    if base in PLAIN_CONVOLUTIONS and (
        type(module)._conv_forward is not base._conv_forward or "_conv_forward" in module.__dict__
    ):
        return False
    return type(module).forward is base.forward and "forward" not in module.__dict__


def _has_plain_forward(module: nn.Module) -> bool:
    return _has_torch_forward(module) and not nn.utils.parametrize.is_parametrized(module)


def _has_weight_property(module: nn.Module) -> bool:
    """Whether the layer's class computes ``weight`` in a property of its own (not a parametrization's)."""
    return isinstance(getattr(type(module), "weight", None), property) and not nn.utils.parametrize.is_parametrized(
        module
    )


def effective_parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    """The weight and bias a Linear or convolution layer really computes with, detached (except in a call
    that keeps the graph, see :mod:`~tdhook.attribution.rules._keeping_graph`).

    Its own parameters for a plain layer. A layer whose forward rewrites its weight
    (timm's weight-standardised ``StdConv2d`` and ``ScaledStdConv2d``), whose weight
    is parametrized (``weight_norm``, ``spectral_norm``, ``orthogonal``) or whose
    weight or bias is computed by a hook (the older ``torch.nn.utils.weight_norm``
    and ``spectral_norm``, ``torch.nn.utils.prune``'s original times mask) is run
    once on a probe input, in eval mode and without its other hooks, and the weight
    and bias it hands to ``F.conv2d`` (or ``F.linear``, …) are taken; the tensors
    the hooks set are put back as the layer's last call left them. A layer whose
    weight is a property (torchrl's ``NoisyLinear``, noisy in training mode or
    under a random exploration type) gives what that property returns now. Nothing in the module
    changes.

    Examples:
        >>> from torch.nn.utils.parametrizations import weight_norm
        >>> layer = weight_norm(nn.Linear(3, 2))
        >>> params = effective_parameters(layer)
        >>> torch.equal(params["weight"], layer.weight.detach()), sorted(params)
        (True, ['bias', 'weight'])
    """
    # In a call that keeps the graph, the live tensors: the derivative of the relevance runs through them.
    keep = graph_kept() is not None
    if _has_weight_property(module):
        # A weight computed from parameters and buffers on each access, as the forward reads it, in the layer's
        # current mode: torchrl's NoisyLinear gives weight_mu + weight_sigma * weight_epsilon when it explores.
        computed = {"weight": module.weight, "bias": getattr(module, "bias", None)}
        return {n: t if keep else t.detach() for n, t in computed.items() if isinstance(t, torch.Tensor)}
    own = dict(module.named_parameters(recurse=False))
    if _has_plain_forward(module) and _holds_its_parameters(module):
        return dict(own) if keep else {name: param.detach() for name, param in own.items()}
    recorder = _RecordLayerCall()
    modes = {sub: sub.training for sub in module.modules()}
    hooks = [hook for hook in module._forward_pre_hooks.values() if isinstance(hook, _WEIGHT_HOOKS)]
    computed = {name: module.__dict__[name] for name in map(_computed_name, hooks) if name in module.__dict__}
    try:
        module.eval()  # no state may change: spectral_norm's power iteration runs in training mode only
        with torch.enable_grad() if keep else torch.no_grad():
            for hook in hooks:
                hook(module, ())
            probe = _probe_input(module, module.weight)
            # Seen by the recorder even inside a rule's function mode, which runs with torch functions off.
            with torch._C._EnableTorchFunction(), recorder, _probed(module):
                module.forward(probe)
    finally:
        for sub, training in modes.items():
            sub.training = training
        # The tensors the hooks set, as the layer's last call left them (with their graph, not detached copies).
        for name in map(_computed_name, hooks):
            if name in computed:
                module.__dict__[name] = computed[name]
    if recorder.params is None:
        raise ValueError(f"{type(module).__name__}: its forward called no linear or convolution function")
    weight = recorder.params["weight"]
    # Probed once while the layer is unchanged (its weight's values are not the verdict's: the probe replaces them).
    check = ("linear after layer call", weight.dtype, weight.device, tuple(weight.shape))
    checked_once(module, check, lambda: _check_linear_after_layer_call(module, weight))
    return {name: tensor if keep else tensor.detach() for name, tensor in recorder.params.items()}


def check_layer_forward(module: nn.Module) -> None:
    """Raise, as :func:`effective_parameters` would, where a Linear or convolution layer's own forward is not
    linear in its linear function's output; nothing to check on a layer with torch's forward, a weight property
    or parameters not yet initialised (a lazy layer).

    Examples:
        >>> class ConvReLU(nn.Conv2d):
        ...     def forward(self, x):
        ...         return super().forward(x).relu()
        >>> check_layer_forward(nn.Conv2d(1, 1, 3))
        >>> try:
        ...     check_layer_forward(ConvReLU(1, 1, 3))
        ... except ValueError as error:
        ...     print(str(error).split(" (")[0])
        ConvReLU: its forward is not affine in the output of its linear or convolution function
    """
    if not isinstance(module, LINEAR_LAYERS) or _has_plain_forward(module) or _has_weight_property(module):
        return
    if any(isinstance(p, nn.parameter.UninitializedParameter) for p in module.parameters(recurse=False)):
        return
    effective_parameters(module)


def _check_linear_after_layer_call(module: nn.Module, weight: torch.Tensor) -> None:
    """Raise where the layer's forward is not linear in its linear function's output.

    The rules run the layer's own forward with other weights and bias (:func:`forward_with`): what the forward
    does around its linear function must then be linear in that function's output (a padding before it, as
    timm's ``Conv2dSame``; a weight standardised before it, as ``StdConv2d``), or the modified passes are not the
    rule's. An activation inside the layer (torch.ao's QAT ``ConvReLU2d``, ``ConvBnReLU2d``, ``LinearReLU``) would
    clip them; a shift added after it (the BatchNorm inside QAT's ``ConvBn2d``) would stay unmodified. Told apart
    by the forward itself, on a random input with weights ``W``, ``-W`` and ``0`` and no bias: a linear map ``g``
    gives ``g(z) = -g(-z)`` and ``g(0) = 0``. A forward that calls more than one linear or convolution function
    fails one of these where the others are a second map of the input (a low-rank adapter's ``B(A x)``, which the
    modified passes would leave unmodified, or a gate's own convolution run first, taken for the layer's): it is
    refused as that, by name. A dropout in training mode inside the forward is refused (the modified passes would
    drop other elements), and so is a forward whose output follows the random numbers it draws (a drop path's mask,
    ``torch.bernoulli``: :func:`_follows_its_draws`) and a BatchNorm normalising by its batch
    (:func:`_normalises_by_its_batch`); the forward runs in the call's mode.
    """
    if _normalises_by_its_batch(module):
        raise _batch_statistics_error(module)
    generator = torch.Generator().manual_seed(0)
    shape = _probe_input(module, weight).shape
    probe = torch.randn(shape, generator=generator, dtype=weight.dtype).to(weight.device)
    signed = torch.randn(weight.shape, generator=generator, dtype=weight.dtype).to(weight.device)
    outputs, drew = [], False
    with torch.no_grad(), run_alone(), torch._C._EnableTorchFunction():
        with _probed(module, parametrizations_eval=True) as rewind:  # the rest in the call's mode
            for w in (signed, -signed, torch.zeros_like(signed)):
                rewind()  # the same draws in each run (a dropout in training mode)
                before = _generator_states(probe.device)
                with _LayerCallCount() as calls, _SubstituteLayerCall(w, None), DropoutCalls() as dropped:
                    outputs.append(module.forward(probe))
                if dropped.found:
                    raise _dropout_error(module)
                drew = drew or _draws(probe.device, before)
            if drew and _follows_its_draws(module, probe, signed):
                raise _dropout_error(module)
    plus, minus, zero = outputs
    scale = plus.abs().amax().clamp(min=torch.finfo(plus.dtype).tiny)
    if ((plus + minus - 2 * zero).abs().amax() / scale).item() > 1e-3:
        what = "is not affine in the output of its linear or convolution function (an activation runs inside it"
        what += ", as in torch.ao's QAT ConvReLU2d and ConvBnReLU2d): the modified passes would run through it"
    elif (zero.abs().amax() / scale).item() > 1e-3:
        what = "adds a shift after its linear or convolution function (a BatchNorm inside it, as in torch.ao's QAT"
        what += " ConvBn2d): the modified passes would keep it unmodified"
    else:
        # An odd activation (tanh, hardtanh, a cube) passes the test above: g(z) = -g(-z), g(0) = 0.
        _check_homogeneous_input(module, weight)
        return
    if len(calls.names) > 1:
        raise _second_map_error(module, calls.names)
    raise ValueError(
        f"{type(module).__name__}: its forward {what}; map this layer to EpsilonRule in rule_mapper, or explain "
        "the model before such layers are fused (or after torch.ao's fuse_model in eval mode, which folds the "
        "BatchNorm into the convolution)"
    )


def _follows_its_draws(module: nn.Module, probe: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether two runs of the layer's forward that draw other random numbers give other outputs, on
    :data:`_DRAWN_SAMPLES` copies of ``probe`` (a drop path's mask of one sample is the same in two draws at odds of
    ``p² + (1 - p)²``): a mask drawn without a dropout call, and not a noise scaled by 0. Run inside the probes."""
    many = probe.expand(_DRAWN_SAMPLES, *probe.shape[1:]).contiguous()
    runs = []
    for _ in range(2):
        with _SubstituteLayerCall(weight, None):
            runs.append(module.forward(many))
    return not torch.equal(*runs)


# The copies of a probe :func:`_follows_its_draws` runs the forward on.
_DRAWN_SAMPLES = 64


def _normalises_by_its_batch(module: nn.Module) -> bool:
    """Whether a BatchNorm inside the layer normalises by the statistics of its batch (in training mode, or without
    running statistics; torch.ao's QAT ``ConvBn2d`` in training mode): the modified passes run the layer's forward
    again, where it would compute them from what they pass, and the ε-rule's gradient runs through them, where a
    BatchNorm beside the layer has them held (``NormRule``)."""
    inside = (sub for sub in module.modules() if sub is not module and isinstance(sub, BATCH_NORMS))
    return any(sub.training or sub.running_mean is None for sub in inside)


def check_layer_input(module: nn.Module, epsilon: float = 0.0, norms_ruled: bool = False) -> None:
    """Raise where a Linear or convolution layer's own forward runs, before or after its linear function, an
    activation whose derivative is not the same at ``2z`` as at ``z`` (tanh, a clamp, a power, a gate computed from
    the input); nothing to check on a layer with torch's forward, a weight property, parameters not yet initialised
    (a lazy layer) or on the meta device, or a forward that does not run on the layer's smallest input.

    A clip or a softmax the forward calls is the function rules' (the CNN presets pass a clip, the presets' softmax
    rules a softmax) where the rule's ``epsilon`` is at most :data:`RULED_EPSILON`: the ε-rule then stabilises that
    function's output in place of the linear function's, a difference of the order of ε. Above it (UniformEpsilon's
    0.25: 0.35 relative L2 with a clip, 0.40 with a softmax, against the function as a module beside the layer) the
    layer is refused, and so it is with a gate or a norm inside it (0.05 to 0.81), or an activation after its linear
    function with a slope other than 0 and 1 (a leaky ReLU: 0.03 to 0.06). A layer, group, instance, batch, RMS or
    local response norm of an activation is the function rules' only where ``norms_ruled`` (the transformer
    presets' rules hold it; the CNN presets' hold ``F.normalize`` and ``F.cosine_similarity`` alone, and a layer
    norm inside a layer under EpsilonPlus kept its plain gradient: 0.13 to 1.7 relative L2 against the norm's rule
    beside the layer, a total relevance of 1e-4 of the output's, silently).

    The check the ε-rule needs: its relevance is ``x · ∂z/∂x · R / z`` through the layer's forward, where an
    activation inside the layer is passed as the rule passes a ReLU module only where its derivative is constant
    along a ray (ReLU, leaky ReLU, a straight-through estimator of the input or weight, not of the output). The
    rules with modified passes check it as part of :func:`effective_parameters`. Both probes run once while the
    layer is unchanged: their verdicts are kept per layer, weakly, and per class of ε
    (:mod:`~tdhook.attribution.rules._layer_verdicts`).

    Examples:
        >>> class LinearTanh(nn.Linear):
        ...     def forward(self, x):
        ...         return super().forward(x).tanh()
        >>> check_layer_input(nn.Linear(2, 3))
        >>> try:
        ...     check_layer_input(LinearTanh(2, 3))
        ... except ValueError as error:
        ...     print(str(error).split(" (")[0])
        LinearTanh: its forward runs an activation that is not piecewise linear through 0
    """
    if not isinstance(module, LINEAR_LAYERS) or _has_torch_forward(module) or _has_weight_property(module):
        return
    tensors = [*module.parameters(), *module.buffers()]
    if any(nn.parameter.is_lazy(t) or t.is_meta for t in tensors) or not any(t.is_floating_point() for t in tensors):
        return
    # The presets' function rules pass a clip or a softmax the layer's forward calls (its output, the ε-rule's z):
    # the verdict is kept per class of ε, and the layer probed once while it is unchanged (see _layer_verdicts).
    clips_ruled = float(epsilon) <= RULED_EPSILON
    checked_once(
        module,
        ("layer input", clips_ruled, norms_ruled),
        lambda: _probe_layer_input(module, tensors, clips_ruled, norms_ruled),
    )


def _probe_layer_input(
    module: nn.Module, tensors: list[torch.Tensor], clips_ruled: bool, norms_ruled: bool = False
) -> None:
    """:func:`check_layer_input`'s probe of a layer with a forward of its own."""
    if _normalises_by_its_batch(module):
        raise _batch_statistics_error(module)
    reference = next(t for t in tensors if t.is_floating_point())
    recorder = _RecordLayerCall()
    try:
        with torch.no_grad(), run_alone(), torch._C._EnableTorchFunction(), recorder:
            with _probed(module, parametrizations_eval=True):  # the rest in the call's mode
                module.forward(_probe_input(module, reference))
    except Exception:  # noqa: BLE001 (a forward that needs more than the smallest input: not checked here)
        return
    if recorder.params is None:
        return
    try:
        # The function rules' calls (a clip, a softmax, a gate, a norm) are stabilised at the order of ε where small.
        weight = recorder.params["weight"]
        ruled, noted = {"clips_ruled": clips_ruled, "calls_ruled": clips_ruled, "norms_ruled": norms_ruled}, []
        bent = _rays_bent(module, weight, **ruled, noted=noted)
        sloped = not clips_ruled and _slopes_restabilised(module, weight)
        off = not bent and not sloped and _values_off_the_map(module, weight, clips_ruled)
    except Exception:  # noqa: BLE001 (as above)
        return
    if bent:
        raise _bent_error(module, noted)
    if sloped:
        raise _sloped_error(module)
    if off:
        raise _off_the_map_error(module)


def _check_homogeneous_input(module: nn.Module, weight: torch.Tensor) -> None:
    """Raise where :func:`_rays_bent`, gates, products and norms counted (no function rule holds them in the modified
    passes: a gate, ``F.normalize`` or a layer norm inside a convolution gave 0.15 to 22 relative L2 under the CNN
    presets against it beside the layer, silently), or where :func:`_values_off_the_map`."""
    noted: list = []
    if _rays_bent(module, weight, calls_ruled=False, noted=noted):
        raise _bent_error(module, noted)
    if _values_off_the_map(module, weight):
        raise _off_the_map_error(module)
