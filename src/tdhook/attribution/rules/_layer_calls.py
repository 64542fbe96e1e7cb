"""Running a Linear or convolution layer's own forward with the weight and bias of its linear function recorded or
replaced, on probe inputs, and putting back what such a run sets on the layer."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

_LAYER_FUNCTIONS = frozenset({F.linear, F.conv1d, F.conv2d, F.conv3d})
_LAYER_FUNCTIONS |= frozenset({F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d})


class _RecordLayerCall(TorchFunctionMode):
    """Record the weight and bias of the first linear or convolution function a forward pass calls."""

    def __init__(self) -> None:
        super().__init__()
        self.params: dict[str, torch.Tensor] | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _LAYER_FUNCTIONS and self.params is None:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            self.params = {"weight": weight} if bias is None else {"weight": weight, "bias": bias}
        return func(*args, **kwargs)


class _SubstituteLayerCall(TorchFunctionMode):
    """Give the first linear or convolution function a forward pass calls the weight and bias given here."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight, self.bias, self.done = weight, bias, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _LAYER_FUNCTIONS and not self.done:
            self.done = True
            args = list(args)
            for position, name, value in ((1, "weight", self.weight), (2, "bias", self.bias)):
                if len(args) > position:
                    args[position] = value
                else:
                    kwargs[name] = value
        return func(*args, **kwargs)


# The inputs :func:`_rays_bent` tries at once, of sizes spread from 1e-3 to 1e3.
_RAY_PROBES = 13


def _probe_input(module: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """The smallest batched input ``module`` accepts."""
    if isinstance(module, nn.Linear):
        return weight.new_zeros(1, module.in_features)
    extent = [(k - 1) * d + 1 for k, d in zip(module.kernel_size, module.dilation, strict=True)]
    if getattr(module, "padding_mode", "zeros") != "zeros":
        # A padding that copies the input (reflect, circular) needs an input longer than the padding.
        longest = max(getattr(module, "_reversed_padding_repeated_twice", None) or [0]) + 1
        extent = [max(size, longest) for size in extent]
    return weight.new_zeros(1, module.in_channels, *extent)


@contextmanager
def _probed(module: nn.Module, parametrizations_eval: bool = False) -> Iterator[Callable[[], None]]:
    """Run probes of the layer's own forward, then put back what they set: the attributes, submodules, parameters
    and buffers a forward assigns on the layer or its submodules (timm's ``Conv2dSameExport`` builds its padding
    for the first input size it sees, which would be the probe's), the values of its buffers (the observers of a
    quantization-aware layer's fake quantization, which move towards each weight they see, and its scale with them),
    the modes of the layer and its submodules, and the random number generators' states (a forward that draws
    noise). Where ``parametrizations_eval``, the probes run with the parametrizations in eval mode and the rest in
    the mode of the call (see :func:`_parametrizations_eval`).

    Gives a function to call before each probe of a comparison: the first call notes the generators' states, each
    later one puts them back, so that each probe draws the same numbers (a dropout in training mode drops the same
    elements at ``x`` and ``2x``)."""
    modes = {sub: sub.training for sub in module.modules()}
    saved = [(m, dict(m.__dict__), dict(m._modules), dict(m._parameters), dict(m._buffers)) for m in module.modules()]
    values = [(buffer, buffer.detach().clone()) for buffer in module.buffers()]
    tensors = [*module.parameters(), *module.buffers()]
    devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        states: list = []

        def rewind() -> None:
            if not states:  # the first, before any draw: noted (a pass of forward_with reads none)
                states.extend([torch.get_rng_state(), *(torch.cuda.get_rng_state(device) for device in devices)])
                return
            torch.set_rng_state(states[0])
            for device, state in zip(devices, states[1:], strict=True):
                torch.cuda.set_rng_state(state, device)

        try:
            if parametrizations_eval:
                _parametrizations_eval(module)
            yield rewind
        finally:
            with torch.no_grad():
                for buffer, value in values:  # only those a probe wrote: no write where nothing changed
                    if buffer.shape != value.shape or not torch.equal(buffer, value):
                        buffer.data = value
            for m, attributes, modules, parameters, buffers in saved:
                for table, kept in ((m._modules, modules), (m._parameters, parameters), (m._buffers, buffers)):
                    table.clear()
                    table.update(kept)
                for name in [name for name in m.__dict__ if name not in attributes]:
                    del m.__dict__[name]
                m.__dict__.update(attributes)
            for sub, training in modes.items():
                sub.training = training


def _generator_states(device: torch.device) -> list[torch.Tensor]:
    """The states of the random number generators a forward on ``device`` draws from (the CPU's, and the device's
    where it is a GPU): a forward that drew numbers changed one of them."""
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def _draws(device: torch.device, before: list[torch.Tensor]) -> bool:
    """Whether a generator's state on ``device`` is no longer ``before`` (see :func:`_generator_states`)."""
    return any(not torch.equal(a, b) for a, b in zip(before, _generator_states(device), strict=True))


def _ray_probes(
    module: nn.Module, weight: torch.Tensor, seed: int
) -> tuple[torch.Generator, torch.Tensor, torch.Tensor]:
    """A generator seeded with ``seed``, :data:`_RAY_PROBES` random inputs of the layer of sizes from 1e-3 to 1e3,
    and a random weight of ``weight``'s shape, drawn from it."""
    generator = torch.Generator().manual_seed(seed)
    shape = (_RAY_PROBES, *_probe_input(module, weight).shape[1:])
    probe = torch.randn(shape, generator=generator, dtype=torch.float64)
    probe *= torch.logspace(-3, 3, _RAY_PROBES, dtype=torch.float64).view(-1, *[1] * (probe.dim() - 1))
    signed = torch.randn(weight.shape, generator=generator, dtype=weight.dtype).to(weight.device)
    return generator, probe.to(weight.device, weight.dtype), signed


class _LayerOutputLeaf(_SubstituteLayerCall):
    """Give the first linear or convolution function a forward pass calls ``weight`` and no bias, and hand on its
    output as a leaf of its own (``leaf``): what the forward computes after that function is a function of it."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight, None)
        self.leaf: torch.Tensor | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _LAYER_FUNCTIONS and not self.done:
            with torch.no_grad():
                self.leaf = super().__torch_function__(func, types, args, kwargs).requires_grad_(True)
            return self.leaf
        return super().__torch_function__(func, types, args, kwargs)


def _parametrizations_eval(module: nn.Module) -> None:
    """Put the parametrizations of ``module`` and its submodules in eval mode, and nothing else: the probes run the
    forward in the mode of the call (a forward may act in training mode alone), but a parametrization's power
    iteration (``spectral_norm``) ran in the call already. :func:`_probed` puts the modes back."""
    for sub in module.modules():
        if isinstance(sub, nn.utils.parametrize.ParametrizationList):
            sub.eval()


class _LayerCallCount(TorchFunctionMode):
    """Count the linear and convolution functions a forward pass calls (``names``: theirs, in call order)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _LAYER_FUNCTIONS:
            self.names.append(f"F.{func.__name__}")
        return func(*args, **(kwargs or {}))
