"""The probes that tell whether a Linear or convolution layer's own forward bends its input's gradient along a ray,
restabilises a sloped activation, or gives values off its linear map, and the errors that name what they found."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from tdhook.attribution.rules._layer_calls import (
    _RAY_PROBES,
    _LayerOutputLeaf,
    _probed,
    _ray_probes,
    _SubstituteLayerCall,
)
from tdhook.attribution.rules._plain_calls import run_alone


def _rays_bent(
    module: nn.Module,
    weight: torch.Tensor,
    clips_ruled: bool = False,
    calls_ruled: bool = True,
    norms_ruled: bool = True,
    noted: list | None = None,
) -> bool:
    """Whether the layer's forward, with a random weight in its linear function and no bias, has another gradient
    with respect to its input at ``2x`` than at ``x`` (random inputs of sizes from 1e-3 to 1e3, a random output
    gradient): an activation inside it whose derivative changes along a ray (tanh, a clamp, a power, a gate
    computed from the input), before or after that function. A linear map, a ReLU and a straight-through estimator
    (the identity's gradient) give the same gradient at both, exactly (a doubling rounds nothing): one of the input
    or the weight (``input.data = sign(input.data)``) is the layer's, one after the map :func:`_values_off_the_map`
    refuses. A call the function rules may cover is not this check's: a product
    or division of two activations, a norm, and where ``clips_ruled`` a clip or a softmax (the modified passes run
    through it); none where not ``calls_ruled`` (an ε-rule above :data:`RULED_EPSILON` stabilises their output in
    place of the linear function's: a gate inside a Linear layer gave 0.07 relative L2 under UniformEpsilon's 0.25,
    a layer norm 0.30, against them beside the layer, silently); of the norms, ``F.normalize`` and
    ``F.cosine_similarity`` alone where not ``norms_ruled``. The call found is added to ``noted``. The probes run
    :func:`~tdhook.attribution.rules._plain_calls.run_alone`."""
    generator, probe, signed = _ray_probes(module, weight, 1)
    grads, seed = [], None
    with torch.enable_grad(), run_alone(), torch._C._EnableTorchFunction():
        with _probed(module, parametrizations_eval=True) as rewind:  # the rest in the call's mode
            for x in (probe, 2 * probe):
                rewind()  # the same draws in each run (a dropout in training mode)
                leaf = x.clone().requires_grad_(True)
                # The substitution first: the calls noted are those of the random weight, which has no gradient.
                with _FunctionRuled(clips_ruled, norms_ruled) as ruled, _SubstituteLayerCall(signed, None):
                    out = module.forward(leaf)
                if ruled.found and calls_ruled:  # a gate, a product or a norm: the function rules' to follow
                    return False
                if ruled.found and noted is not None and ruled.call not in noted:
                    noted.append(ruled.call)
                if not isinstance(out, torch.Tensor) or not out.requires_grad:
                    return False
                if seed is None:
                    seed = torch.randn(out.shape, generator=generator, dtype=out.dtype).to(out.device)
                (grad,) = torch.autograd.grad(out, leaf, seed, allow_unused=True)
                if grad is None:
                    return False
                grads.append(grad)
    one, two = grads
    scale = one.flatten(1).abs().amax(1).clamp(min=torch.finfo(one.dtype).tiny)  # per probe: sizes differ
    tolerance = max(1e-3, 16 * torch.finfo(one.dtype).eps)
    return bool(((two - one).flatten(1).abs().amax(1) / scale > tolerance).any())


# Calls of two activations that stay linear: sums and joins.
_LINEAR_JOINS = frozenset({torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__, torch.sub})
_LINEAR_JOINS |= frozenset({torch.Tensor.sub, torch.Tensor.__sub__, torch.Tensor.__rsub__, torch.cat, torch.stack})
# Norms called as functions, whose scales the presets' function rules may hold inside a layer.
_NORM_FUNCTIONS = frozenset(
    {F.layer_norm, F.group_norm, F.instance_norm, F.batch_norm, F.rms_norm, F.normalize, F.local_response_norm}
) | frozenset({F.cosine_similarity})
# The norms every preset's function rules hold (the CNN presets' too); the others, the transformer presets' alone.
_HELD_NORM_FUNCTIONS = frozenset({F.normalize, F.cosine_similarity})


# Clips called as functions, which the CNN presets' function rules pass as nn.Hardtanh's rule does, and softmaxes,
# which the presets' softmax rules explain as nn.Softmax's.
_CLIP_FUNCTIONS = frozenset({torch.clamp, torch.clip, torch.Tensor.clamp, torch.Tensor.clip, F.hardtanh, F.relu6})
_CLIP_FUNCTIONS |= frozenset({F.softmax, torch.softmax, torch.Tensor.softmax})
_CLIP_FUNCTIONS |= frozenset({F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax})
# The largest ε of an ε-rule under which those are passed inside its layer (see :func:`check_layer_input`).
RULED_EPSILON = 1e-4


class _FunctionRuled(TorchFunctionMode):
    """Note whether a forward pass calls a function of two activations other than a sum (a gate's product, a
    division by a norm), a norm, or where ``clips`` a clip or a softmax: calls the function rules of a preset may
    give a rule inside a layer.

    A call on tensors computed from the layer's parameters alone is none of these: the norm of timm's
    ``StdConv2d`` and ``ScaledStdConv2d`` standardises the weight, and the rest of the forward is checked (a tanh
    after it gave 0.35 to 0.81 relative L2 against a tanh beside the layer, silently)."""

    def __init__(self, clips: bool = False, norms: bool = True) -> None:
        super().__init__()
        self.found, self.call = False, None
        self._ruled = _NORM_FUNCTIONS if norms else _HELD_NORM_FUNCTIONS
        self._ruled = self._ruled | _CLIP_FUNCTIONS if clips else self._ruled
        self._of_parameters: dict[int, torch.Tensor] = {}  # by id, each held while the probe runs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = [*args, *kwargs.values()]
        flat = [t for item in flat for t in (item if isinstance(item, (list, tuple)) else [item])]
        with_grad = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
        of_parameters = all(isinstance(t, nn.Parameter) or id(t) in self._of_parameters for t in with_grad)
        if not self.found and func not in _LINEAR_JOINS and not of_parameters:
            activations = sum(not isinstance(t, nn.Parameter) for t in with_grad)
            self.found = activations >= 2 or (func in self._ruled and activations >= 1)
            self.call = func if self.found else None
        out = func(*args, **kwargs)
        if with_grad and of_parameters:
            for t in out if isinstance(out, (list, tuple)) else [out]:
                if isinstance(t, torch.Tensor):
                    self._of_parameters[id(t)] = t
        return out


def _slopes_restabilised(module: nn.Module, weight: torch.Tensor) -> bool:
    """Whether what the layer's forward computes after its linear function ``h(z)`` is not linear and sends
    relevance otherwise than a module beside the layer would under a large ε: the ε-rule on the layer gives ``z``
    the gradient ``Jᵀ (R / stabilize(h(z)))``, the ε-rule on ``z`` with ``h`` passed ``z ⊙ Jᵀ (R / h(z)) /
    stabilize(z)`` (``J`` the Jacobian of ``h``). A leaky ReLU or a PReLU (a slope other than 0 and 1 on the
    negative side, positively homogeneous: the rays of :func:`_rays_bent` do not see it) differs by the order of ε
    over ``z`` (0.03 to 0.06 relative L2 under UniformEpsilon's 0.25 with a slope of 0.1, silently); a ReLU and a
    max pooling (slopes 0 and 1) agree, and a linear ``h`` (at ``z`` and ``-z`` the same gradient) is the layer's.

    Told on random weights and inputs of sizes from 1e-3 to 1e3, with ε the mean size of ``z`` in each."""
    generator, probe, signed = _ray_probes(module, weight, 2)
    runs = []
    with torch.enable_grad(), run_alone(), torch._C._EnableTorchFunction():
        with _probed(module, parametrizations_eval=True) as rewind:  # the rest in the call's mode
            for w in (signed, -signed):
                rewind()  # the same draws in each run (a dropout in training mode)
                with _LayerOutputLeaf(w) as found:
                    out = module.forward(probe)
                if found.leaf is None or not isinstance(out, torch.Tensor) or not out.requires_grad:
                    return False
                runs.append((found.leaf, out))
    seed = torch.randn(runs[0][1].shape, generator=generator, dtype=runs[0][1].dtype).to(runs[0][1].device)
    (plus, _), (minus, _) = runs
    if plus.shape[0] != _RAY_PROBES or runs[0][1].shape[0] != _RAY_PROBES:
        return False
    grads = [torch.autograd.grad(out, leaf, seed, retain_graph=True, allow_unused=True)[0] for leaf, out in runs]
    if any(grad is None for grad in grads):
        return False
    tolerance = max(1e-3, 16 * torch.finfo(weight.dtype).eps)

    def apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # per probe: sizes differ
        scale = torch.maximum(a.flatten(1).abs().amax(1), b.flatten(1).abs().amax(1))
        return (a - b).flatten(1).abs().amax(1) > tolerance * scale.clamp(min=torch.finfo(a.dtype).tiny)

    if not apart(*grads).any():
        return False  # a linear map after the linear function: the layer's
    for leaf, out in runs:
        z, h = leaf.detach(), out.detach()
        epsilon = z.flatten(1).abs().mean(1).view(-1, *[1] * (z.dim() - 1))
        given = torch.where(h != 0, seed, torch.zeros_like(seed))  # no relevance on an output of 0
        quotient = torch.where(h != 0, given / torch.where(h != 0, h, torch.ones_like(h)), torch.zeros_like(h))
        stabilised = given / (h + torch.where(h >= 0, 1.0, -1.0) * epsilon.view(-1, *[1] * (h.dim() - 1)))
        (layer,) = torch.autograd.grad(out, leaf, stabilised, retain_graph=True)
        (passed,) = torch.autograd.grad(out, leaf, quotient, retain_graph=True)
        beside = z * passed / (z + torch.where(z >= 0, 1.0, -1.0) * epsilon)
        if apart(layer, beside).any():
            return True
    return False


def _sloped_error(module: nn.Module) -> ValueError:
    return ValueError(
        f"{type(module).__name__}: its forward runs, after its linear or convolution function, an activation with a "
        f"slope other than 0 or 1 (such as a leaky ReLU): the ε-rule (ε above {RULED_EPSILON}) would stabilise that "
        "activation's output in place of the linear function's; write the activation as a module of its own beside "
        f"the layer, or use an ε of at most {RULED_EPSILON}"
    )


def _values_off_the_map(module: nn.Module, weight: torch.Tensor, clips_ruled: bool = False) -> bool:
    """Whether the layer's forward, its linear function given a random ``W``, ``2W`` and ``0``, gives outputs off a
    line (``f(2W) - f(0) ≠ 2 (f(W) - f(0))``) with no call the function rules hold: a straight-through estimator
    after the map (``z + (round(z) - z).detach()``), whose output the rules took for the map's (0.10 to 0.17
    relative L2 under UniformEpsilon, 0.05 to 2.6e5 under z⁺ and αβ, against it beside the layer). One of the input
    or the weight is linear in ``W``. Told by the largest output (a shift after the map rounds at its size)."""
    _, probe, signed = _ray_probes(module, weight, 3)
    outputs = []
    with torch.enable_grad(), run_alone(), torch._C._EnableTorchFunction():
        with _probed(module, parametrizations_eval=True) as rewind:  # the rest in the call's mode
            for w in (signed, 2 * signed, torch.zeros_like(signed)):  # the input a leaf: the calls on it are noted
                rewind()  # the same draws in each run (a dropout in training mode)
                with _FunctionRuled(clips_ruled) as ruled, _SubstituteLayerCall(w, None):
                    outputs.append(module.forward(probe.clone().requires_grad_(True)))
                if ruled.found or not isinstance(outputs[-1], torch.Tensor):
                    return False
    one, two, zero = (out.detach() for out in outputs)
    if one.shape != two.shape or one.shape != zero.shape or one.dim() == 0 or one.shape[0] != _RAY_PROBES:
        return False
    line, twice = (one - zero).flatten(1), (two - zero).flatten(1)
    scale = torch.stack([one, two, zero]).flatten(2).abs().amax((0, 2)).clamp(min=torch.finfo(line.dtype).tiny)
    tolerance = max(1e-3, 16 * torch.finfo(line.dtype).eps)
    return bool(((twice - 2 * line).abs().amax(1) > tolerance * 2 * scale).any())


def _off_the_map_error(module: nn.Module) -> ValueError:
    return ValueError(
        f"{type(module).__name__}: its forward gives, after its linear or convolution function, values its gradient "
        "does not follow (a straight-through estimator, such as z + (round(z) - z).detach()): a layer rule would "
        "take those values for the linear function's output; write the estimator as a module of its own after the "
        "layer"
    )


def _bent_error(module: nn.Module, noted: Sequence = ()) -> ValueError:
    names = [f"{'F' if f in _NORM_FUNCTIONS else 'torch'}.{getattr(f, '__name__', f).strip('_')}" for f in noted]
    called = f" (it calls {', '.join(names)}, which no function rule holds inside a layer here)" if noted else ""
    return ValueError(
        f"{type(module).__name__}: its forward runs an activation that is not piecewise linear through 0 (such as "
        "tanh, a clamp, a power or a gate computed from its input) before or after its linear or convolution "
        f"function{called}: a layer rule would send the relevance through that activation's gradient, which is no "
        "rule's relevance; write the activation as a module of its own beside the layer"
    )


def _batch_statistics_error(module: nn.Module) -> ValueError:
    return ValueError(
        f"{type(module).__name__}: its forward normalises by the statistics of the batch (a BatchNorm in training "
        "mode inside it, as in torch.ao's QAT ConvBn2d in training mode): the rules would run through those "
        "statistics, computed again from what they pass, where a BatchNorm beside the layer has them held; explain "
        "the model in eval mode, or with the BatchNorm as a module of its own after the layer"
    )


def _dropout_error(module: nn.Module) -> ValueError:
    return ValueError(
        f"{type(module).__name__}: its forward drops elements at random (a dropout in training mode inside it, or "
        "another draw of random numbers, such as a drop path's mask): the modified passes run that forward again, "
        "and a BatchNorm merged into the layer reads its weight without the call's draws (a dropout of the weight), "
        "so either would drop other elements than the call did; explain the model in eval mode, or with the dropout "
        "as a module of its own beside the layer"
    )


def _second_map_error(module: nn.Module, calls: Sequence[str]) -> ValueError:
    if nn.utils.parametrize.is_parametrized(module):  # the calls may be the parametrization's, on the weight
        return ValueError(
            f"{type(module).__name__}: its forward calls {len(calls)} linear or convolution functions "
            f"({', '.join(calls)}): a second linear map of the input inside the layer (a low-rank adapter's B(A x)), "
            "or linear functions its parametrization calls in computing its weight (a low-rank update W + B(A W) "
            "written as one), which a rule with a modified pass cannot tell from the layer's own call; remove the "
            "parametrization before explaining (torch.nn.utils.parametrize.remove_parametrizations(layer, 'weight', "
            "leave_parametrized=True)), write a second map as modules of their own beside the layer, or map this layer "
            "to EpsilonRule in rule_mapper"
        )
    return ValueError(
        f"{type(module).__name__}: its forward calls {len(calls)} linear or convolution functions "
        f"({', '.join(calls)}): a second linear map of the input inside the layer (a low-rank adapter's B(A x), a "
        "gate's own convolution), which a rule with a modified pass cannot give its weights (it modifies the first "
        "call alone, taken for the layer's); merge a low-rank adapter into the weight (W + B A), write the other "
        "map as modules of their own beside the layer, or map this layer to EpsilonRule in rule_mapper"
    )
