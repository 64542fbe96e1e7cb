"""Grad-CAM: an inner layer's activation weighted, channel by channel, by the mean gradient of the explained output."""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import nn

from tdhook.attribution._keys import layer_keys
from tdhook.attribution.mappers.aliases import every_named_module
from tdhook.attribution.methods._base import AttributionMethod, Call, hooks_removed
from tdhook.attribution.methods._options import checked_flag
from tdhook.attribution.methods._settable_options import CheckedOption
from tdhook.attribution.rules._identity import IdentityWeakKeyDict
from tdhook.attribution.targets import Target

__all__ = ["GradCAM"]

_MODES = {1: "linear", 2: "bilinear", 3: "trilinear"}
_NOTHING = contextlib.nullcontext()
_VMAPPED = object()  # recorded in place of a layer's output computed under torch.vmap


def _record_nothing(module: nn.Module, args: tuple, output: object) -> None:
    """The forward hook a copy of the layer made during a call has in place of the recorder."""


def _nothing_recorded() -> Callable[[nn.Module, tuple, object], None]:
    return _record_nothing


class _Recorder:
    """The forward hook on the layer for one call: records the layer's output in ``activations`` and has the model
    go on with a copy of it (an in-place operation after the layer, a ``ReLU(inplace=True)``, must not overwrite the
    activation the map is made of).

    A copy of the layer made during the call, by the model's forward (an EMA teacher) or by another thread, copies its
    hooks: it gets :func:`_record_nothing` (deep copy, pickle), or shares this hook, which records the layer alone
    (shallow copy). Otherwise the copy run in a later call made the layer seem called twice, a copy run outside calls
    kept its outputs and their graphs in the method, and the copy could not be pickled.

    It acts in the calls of the thread it was made in only: another thread's call of the model meanwhile (an LRP
    wrapper's, whose rules read the layer's own output; another GradCAM's) runs as it would without it.

    Examples:
        >>> import copy
        >>> layer, activations = nn.Linear(2, 2), []
        >>> handle = layer.register_forward_hook(_Recorder(activations, layer))
        >>> twin = copy.deepcopy(layer)
        >>> _, _ = layer(torch.ones(1, 2)), twin(torch.ones(1, 2))
        >>> len(activations), list(twin._forward_hooks.values()) == [_record_nothing]
        (1, True)
    """

    def __init__(self, activations: list, layer: nn.Module) -> None:
        self._activations = activations
        self._layer = layer
        self._thread = threading.get_ident()

    def __call__(self, module: nn.Module, args: tuple, output: object) -> torch.Tensor | None:
        # Under no_grad: a run for the values of the caller's no_grad (see _no_grad_values).
        if module is not self._layer or not torch.is_grad_enabled() or threading.get_ident() != self._thread:
            return None
        if isinstance(output, torch.Tensor) and torch._C._functorch.is_batchedtensor(output):
            # Under torch.vmap (the agents of a torchrl multi-agent network with share_params=False): a value of
            # one vmapped call, which no gradient outside it reaches.
            self._activations.append(_VMAPPED)
            return None
        if isinstance(output, torch.Tensor) and not output.requires_grad and output.is_floating_point():
            # Nothing before the layer needs a gradient (token ids into a frozen model): the map's own leaf, as
            # captum's LayerGradCam makes it.
            output = output.detach().requires_grad_(True)
        self._activations.append(output)
        return output.clone() if isinstance(output, torch.Tensor) else None

    def __deepcopy__(self, memo: dict) -> Callable[[nn.Module, tuple, object], None]:
        return _record_nothing

    def __reduce__(self) -> tuple:
        return _nothing_recorded, ()


_LOCKS: IdentityWeakKeyDict = IdentityWeakKeyDict()  # per GradCAM: the lock its calls hold (none to copy or pickle)
_MAKING = threading.Lock()


def _call_lock(method: GradCAM) -> threading.RLock:
    """The lock that ``method``'s calls hold from its model's run to the write of the map."""
    with _MAKING:
        lock = _LOCKS.get(method)
        if lock is None:
            lock = _LOCKS[method] = threading.RLock()
        return lock


class GradCAM(AttributionMethod):
    """Grad-CAM of one inner layer, written at ``(relevance_key, layer)`` with the layer's spatial shape.

    With ``A`` the layer's output ``[*batch, C, *spatial]`` and ``g`` the
    gradient of the explained output with respect to it, the map is
    ``Σ_c mean_spatial(g_c) · A_c`` (``[*batch, *spatial]``), clamped at 0
    when ``relu``. With ``upsample=True`` the map is also resized
    (bilinearly for two spatial dimensions, linearly or trilinearly for one or
    three, ``align_corners=False``) to the spatial shape of every explained
    input ``[*batch, C_in, *spatial_in]`` and written, repeated over its
    channels, at ``(relevance_key, *in_key)``.

    Args:
        module: a ``TensorDictModuleBase``, or a plain ``nn.Module`` with ``in_keys`` and ``out_keys``.
        layer: the inner module's name, as :class:`~tdhook.attribution.LRP`'s ``layers`` names modules
            (those of ``module.named_modules()`` for the object passed).
        in_keys: see :class:`~tdhook.attribution.methods._base.AttributionMethod`.
        out_keys: the output keys of a plain module.
        target_key: the output to explain.
        target: ``None``, an int, a LongTensor, a callable or ``"all"`` (as for LRP).
        relevance_key: the prefix of the attribution keys.
        relu: whether to keep only the positive part of the map.
        upsample: whether to write the map resized to each explained input too.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tdhook.attribution import GradCAM
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
        >>> cam = GradCAM(net, layer="1", in_keys=["image"], out_keys=["logits"], upsample=True)
        >>> td = cam(TensorDict(image=torch.randn(5, 3, 6, 6), batch_size=[5]))
        >>> td["attribution", "1"].shape, td["attribution", "image"].shape
        (torch.Size([5, 6, 6]), torch.Size([5, 3, 6, 6]))
    """

    tunables = {"relu": (bool, {"choices": [True, False]})}

    _gradient_at_input = True
    _evaluates_copies = False

    # Checked whenever set, as the constructor checks them.
    relu = CheckedOption(checked_flag)
    upsample = CheckedOption(checked_flag)

    def __init__(
        self,
        module: TensorDictModuleBase | nn.Module,
        *,
        layer: str,
        in_keys: Sequence[NestedKey] | None = None,
        out_keys: Sequence[NestedKey] | None = None,
        target_key: NestedKey | None = None,
        target: Target = None,
        relevance_key: str = "attribution",
        relu: bool = True,
        upsample: bool = False,
    ) -> None:
        super().__init__(
            module,
            in_keys=in_keys,
            out_keys=out_keys,
            target_key=target_key,
            target=target,
            relevance_key=relevance_key,
        )
        self.relu = relu
        self.upsample = upsample
        if not upsample:
            self.relevance_keys = []
        self.layer = layer
        self._activations: list[torch.Tensor] = []
        self._cam: torch.Tensor | None = None

    @property
    def _floating_inputs(self) -> str | None:  # the map at the layer alone: inputs of any dtype (token ids)
        if not self.upsample:
            return None
        return (
            ": upsample=True resizes the map onto each explained input; pass upsample=False for the map at the layer "
            "alone, which takes inputs of any dtype (token ids)"
        )

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "layer":  # nn.Module's would take a module given for it as a child, past the property's check
            object.__setattr__(self, name, value)
            return
        super().__setattr__(name, value)

    @property
    def layer(self) -> str:
        """The inner module's name; set, the map of the new layer is written at its own key (``layer_key``, and
        ``out_keys`` with it)."""
        return self._layer

    @layer.setter
    def layer(self, layer: str) -> None:
        if not isinstance(layer, str):
            raise TypeError(f"GradCAM: layer must be a module name (a string), got {type(layer).__name__}")
        try:
            keys = layer_keys([layer], self.named_explained_modules(), self.explained_keys)
        except (KeyError, ValueError) as err:
            raise type(err)(str(err.args[0]).replace("LRP: layers names", "GradCAM: layer is", 1)) from None
        self._layer = layer
        self.layer_key = (self.relevance_key, *keys[layer])
        self.out_keys = [*self.module.out_keys, self.layer_key, *self.relevance_keys]

    @contextlib.contextmanager
    def _model_context(self) -> Iterator[None]:
        # One call at a time: a call's activations and map stay the call's until its attributions are made.
        with _call_lock(self):
            yield from self._recording()

    def _recording(self) -> Iterator[None]:
        self._activations = []
        from tdhook.attribution.lrp import _compiled  # lrp imports the methods' package

        modules = self.named_explained_modules()
        # A compiled graph does not pass through the output the hook gives back (the map would not be reached from
        # the target): parts compiled by torch.compile run as written, as they do under LRP.
        eager = torch.compiler.set_stance("force_eager") if any(map(_compiled, modules.values())) else _NOTHING
        try:
            layer = every_named_module(modules[""])[self.layer]  # by any of its names
            with eager, hooks_removed([layer.register_forward_hook(_Recorder(self._activations, layer))]):
                yield
        finally:
            self._activations = []

    def _attribute(self, call: Call) -> list[torch.Tensor]:
        if _VMAPPED in self._activations:
            raise ValueError(
                f"GradCAM: layer {self.layer!r} runs under torch.vmap (the agents of a torchrl MultiAgentMLP or "
                "MultiAgentConvNet with share_params=False run so), where its output has no gradient of the explained "
                "output; pass a layer outside the vmapped network, or build it with share_params=True"
            )
        if len(self._activations) != 1 or not isinstance(self._activations[0], torch.Tensor):
            got = (
                f"it returned {type(self._activations[0]).__name__}"
                if len(self._activations) == 1
                else f"it was called {len(self._activations)} times"
            )
            raise ValueError(f"GradCAM: layer {self.layer!r} must return one tensor in one call per pass, {got}")
        activation = self._activations[0]
        batch = tuple(call.batch_shape)
        if activation.dim() <= call.batch_dims or tuple(activation.shape[: call.batch_dims]) != batch:
            samples, leading = math.prod(batch), activation.shape[0] if activation.dim() else 0
            folded = ""
            if samples and leading > samples and leading % samples == 0:
                folded = (
                    f"; its first dimension ({leading}) holds the batch's {samples} samples folded with other "
                    "dimensions (a torchrl MultiAgentConvNet with share_params=True folds its agents into its "
                    "convolutions' batch), which GradCAM cannot split back: name a layer whose output keeps the "
                    "batch in front"
                )
            elif leading == samples and len(batch) > 1:
                folded = (
                    f"; its first dimension holds the batch's {list(batch)} flattened (a model that flattens the "
                    "batch's dimensions, as torchrl's ConvNet does): give the TensorDict a batch of one dimension "
                    "(td.reshape(-1))"
                )
            raise ValueError(
                f"GradCAM: the output of layer {self.layer!r} has shape {list(activation.shape)}; expected the "
                f"batch shape {list(batch)} followed by channels and spatial dimensions{folded}"
            )
        unreached: list[bool] = []
        with torch.enable_grad():
            (gradient,) = self._gradients(self._contract(call, call.output, None), [activation], unreached)
        if unreached[0]:  # a layer of another branch (a critic's, for the actor's output): its map would be 0
            raise ValueError(
                f"GradCAM: target {call.target_key!r} does not depend on the output of layer {self.layer!r}; "
                "pass a layer on the way to the target (or target_key=<an output that reads it>)"
            )
        spatial = tuple(range(call.batch_dims + 2, gradient.dim()))
        weights = gradient.mean(spatial, keepdim=True) if spatial else gradient
        cam = (weights * activation.detach().unsqueeze(0)).sum(call.batch_dims + 1)
        self._cam = cam.clamp(min=0) if self.relu else cam
        return (
            [
                self._resized(call, key, x, activation.shape)
                for key, x in zip(self.explained_keys, call.inputs, strict=True)
            ]
            if self.upsample
            else []
        )

    def _resized(self, call: Call, key: NestedKey, x: torch.Tensor, layer_shape: torch.Size) -> torch.Tensor:
        cam = self._cam  # [units, *batch, *spatial]
        spatial = cam.shape[1 + call.batch_dims :]
        target = x.shape[call.batch_dims + 1 :]
        if not spatial:
            raise ValueError(
                f"GradCAM: the output of layer {self.layer!r} has no spatial dimensions to upsample: its shape "
                f"{list(layer_shape)} is the batch {list(call.batch_shape)} and its channels; pick a layer with "
                "spatial dimensions [*batch, channels, *spatial] (a convolution's output, before any flattening), "
                "or pass upsample=False for the map at the layer alone"
            )
        if len(spatial) not in _MODES:
            raise ValueError(
                f"GradCAM: the output of layer {self.layer!r} of shape {list(layer_shape)} has {len(spatial)} "
                f"spatial dimensions {list(spatial)}; upsample resizes 1 to 3 (pass upsample=False)"
            )
        if len(target) != len(spatial):
            raise ValueError(
                f"GradCAM: cannot resize the map of layer {self.layer!r} (spatial shape {list(spatial)}) to input key "
                f"{key!r} of shape {list(x.shape)}; upsample needs inputs [*batch, channels, *spatial] with the "
                f"layer's {len(spatial)} spatial dimensions"
            )
        flat = cam.reshape(-1, 1, *spatial)
        resized = F.interpolate(flat, size=tuple(target), mode=_MODES[len(spatial)], align_corners=False)
        resized = resized.reshape(*cam.shape[: 1 + call.batch_dims], 1, *target)
        return resized.expand(*cam.shape[: 1 + call.batch_dims], x.shape[call.batch_dims], *target)

    def _extra_updates(self, call: Call) -> dict:
        cam, self._cam = self._cam, None
        return {self.layer_key: self._per_unit(call, cam)}
