"""The probes of a layer's own forward run once per unchanged layer: counted, and probed again on every change that
could change their verdict (a patched forward, an attribute, a buffer's values, the dtype, the class of ε)."""

from __future__ import annotations

import gc
import sys
import threading
import types
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import pytest
import timm.layers
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP, AttnLRP, EpsilonGammaBox, EpsilonPlus, UniformEpsilon
from tdhook.attribution.rules import _layers
from tdhook.attribution.rules.basic import EpsilonRule
from tdhook.attribution.rules.modified import AlphaBetaRule

BENT = "not piecewise linear"


class PaddedConv(nn.Conv2d):
    """A convolution with a forward of its own (a padding before it, as timm's ``Conv2dSame``), linear."""

    def __init__(self) -> None:
        super().__init__(2, 2, 3)
        self.activation = "none"
        self.register_buffer("limit", torch.tensor(1e9))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = super().forward(F.pad(x, (1, 1, 1, 1)))
        if self.activation == "tanh":
            z = z.tanh()
        return torch.minimum(z, self.limit)  # a learnt clip threshold (PACT): no clip while it is large


class ClippedConv(PaddedConv):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).clamp(-1.0, 1.0)


@contextmanager
def counted(name: str) -> Iterator[list[int]]:
    """The number of runs of ``_layers.<name>`` in the block."""
    runs = [0]
    original = getattr(_layers, name)

    def spy(*args, **kwargs):
        runs[0] += 1
        return original(*args, **kwargs)

    with mock.patch.object(_layers, name, spy):
        yield runs


def wrapper(model: nn.Module, mapper) -> LRP:
    return LRP(model, mapper, in_keys=["x"], out_keys=["y"])


def enter(lrp: LRP) -> None:
    with lrp:
        pass


@pytest.mark.parametrize("layer", [timm.layers.StdConv2dSame, timm.layers.ScaledStdConv2d])
def test_second_entry_probes_no_layer(layer):
    model = nn.Sequential(*[layer(2, 2, 3) for _ in range(4)]).eval()
    lrp = wrapper(model, UniformEpsilon())
    with counted("_rays_bent") as runs:
        enter(lrp)
        assert runs[0] == 4
        enter(lrp)
        lrp(TensorDict(x=torch.randn(1, 2, 8, 8), batch_size=[1]))  # a call without an open context
        assert runs[0] == 4


def test_modified_rules_probe_no_layer_again():
    model = nn.Sequential(*[timm.layers.StdConv2dSame(2, 2, 3) for _ in range(3)], nn.Flatten()).eval()
    lrp = wrapper(model, EpsilonPlus())
    with counted("_check_linear_after_layer_call") as runs:
        enter(lrp)
        first = runs[0]
        enter(lrp)
        assert first == 3 and runs[0] == first


def test_a_layer_the_first_layer_rules_prepare_in_the_call_is_probed_once():
    # EpsilonGammaBox's first-layer switch prepares its rule in the call: the layer was checked at registration
    # (no function mode) and in the call (the preset's function modes, the copy methods the context sets on each
    # module), and the verdict kept by one was not the other's: each call probed every layer again (a later call
    # of timm's resnetv2_50x1_bit made 318597 Python calls, 241853 once probed no more).
    model = nn.Sequential(*[timm.layers.StdConv2dSame(2, 2, 3) for _ in range(3)], nn.Flatten()).eval()
    lrp = wrapper(model, EpsilonGammaBox(-3.0, 3.0))
    with counted("_check_linear_after_layer_call") as runs:
        lrp(TensorDict(x=torch.randn(1, 2, 8, 8), batch_size=[1]))
        first = runs[0]
        for _ in range(2):
            lrp(TensorDict(x=torch.randn(1, 2, 8, 8), batch_size=[1]))
        assert first == 3 and runs[0] == first


def test_forward_patched_after_an_entry_is_refused():
    layer = PaddedConv()
    with counted("_rays_bent") as runs:
        with EpsilonRule(0.25).register(layer):
            pass
        layer.forward = lambda x: torch.tanh(PaddedConv.forward(layer, x))
        with pytest.raises(ValueError, match=BENT), EpsilonRule(0.25).register(layer):
            pass
        del layer.forward
        layer.forward = types.MethodType(lambda self, x: PaddedConv.forward(self, x) ** 3, layer)
        with pytest.raises(ValueError, match=BENT), EpsilonRule(0.25).register(layer):
            pass
    assert runs[0] == 3


def test_attribute_or_buffer_changed_after_an_entry_is_refused():
    layer = PaddedConv()
    with EpsilonRule(0.25).register(layer):
        pass
    layer.activation = "tanh"
    with pytest.raises(ValueError, match=BENT), EpsilonRule(0.25).register(layer):
        pass
    layer.activation = "none"
    with EpsilonRule(0.25).register(layer):
        pass
    layer.limit.data.fill_(0.5)  # through .data: no version counter sees it
    with pytest.raises(ValueError, match=BENT), EpsilonRule(0.25).register(layer):
        pass


def test_forward_patched_after_an_entry_is_refused_by_modified_rules():
    layer = PaddedConv()
    with AlphaBetaRule(1.0, 0.0).register(layer):
        pass
    layer.forward = lambda x: PaddedConv.forward(layer, x).relu()
    with pytest.raises(ValueError, match="not affine"), AlphaBetaRule(1.0, 0.0).register(layer):
        pass


class BiasAfterConv(nn.Conv2d):
    """A convolution that adds its bias after its convolution function: a shift the modified passes keep."""

    def __init__(self) -> None:
        super().__init__(2, 2, 3, padding=1)
        nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self.weight, None) + self.bias.view(-1, 1, 1)


def test_bias_written_after_an_entry_is_refused():
    layer = BiasAfterConv()
    with AlphaBetaRule(1.0, 0.0).register(layer):  # a zero bias: no shift yet
        pass
    layer.bias.data.normal_()
    with pytest.raises(ValueError, match="adds a shift"), AlphaBetaRule(1.0, 0.0).register(layer):
        pass


def test_dtype_change_probes_again():
    model = nn.Sequential(PaddedConv(), PaddedConv())
    lrp = wrapper(model, UniformEpsilon())
    with counted("_rays_bent") as runs:
        enter(lrp)
        enter(lrp)
        assert runs[0] == 2
        model.double()
        enter(lrp)
        assert runs[0] == 4
        enter(lrp)
        assert runs[0] == 4


def test_epsilon_raised_while_registered_is_checked():
    layer = ClippedConv()
    rule = EpsilonRule(1e-6)
    with rule.register(layer):  # a small ε: the clip inside the layer is the function rules'
        with pytest.raises(ValueError, match=f"ClippedConv: its forward runs an activation that is {BENT}"):
            rule.epsilon = 0.25
        assert rule.epsilon == 1e-6
        rule.epsilon = 1e-5  # the same class of ε
    with pytest.raises(ValueError, match=BENT), EpsilonRule(0.25).register(layer):  # never the small ε's verdict
        pass


def test_two_classes_of_epsilon_in_turn_probe_once_each():
    layer = ClippedConv()
    with counted("_rays_bent") as runs:
        for _ in range(2):
            with EpsilonRule(1e-6).register(layer):
                pass
            with pytest.raises(ValueError, match=BENT), EpsilonRule(0.25).register(layer):
                pass
    assert runs[0] == 2


def test_verdicts_keep_no_model_alive():
    model = nn.Sequential(PaddedConv(), ClippedConv())
    layer = model[0]
    layer.forward = types.MethodType(lambda self, x: PaddedConv.forward(self, x), layer)
    enter(wrapper(model, UniformEpsilon(epsilon=1e-6)))
    with pytest.raises(ValueError, match=BENT):
        enter(wrapper(model, UniformEpsilon()))
    references = [weakref.ref(model), weakref.ref(layer)]
    del model, layer
    gc.collect()
    assert all(reference() is None for reference in references)


def test_two_threads_on_two_models():
    bent, plain = PaddedConv(), PaddedConv()
    bent.activation = "tanh"
    barrier, results = threading.Barrier(2), {}

    def entries(name: str, layer: nn.Module) -> None:
        barrier.wait()
        outcomes = []
        for _ in range(10):
            try:
                with EpsilonRule(0.25).register(layer):
                    outcomes.append("passed")
            except ValueError:
                outcomes.append("refused")
        results[name] = outcomes

    threads = [threading.Thread(target=entries, args=item) for item in (("bent", bent), ("plain", plain))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == {"bent": ["refused"] * 10, "plain": ["passed"] * 10}


# What the forwards below read besides their layer: a flag and a helper of this module, a module used as a
# configuration, a class attribute, a method of a base class and a closure's cell (set back by monkeypatch). Each is
# a mixin before a Linear or Conv2d layer (AttnLRP maps convolutions to no ε-rule).
_SQUASH = False
_CONFIG = types.ModuleType("layer_config")
_CONFIG.squash = False


def _kept(z: torch.Tensor) -> torch.Tensor:
    return z


class GlobalFlag:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = super().forward(x)
        return z.tanh() if _SQUASH else z


class GlobalHelper:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _kept(super().forward(x))


class ConfigModule:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = super().forward(x)
        return z.tanh() if _CONFIG.squash else z


class ClassFlag:
    squash = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = super().forward(x)
        return z.tanh() if self.squash else z


class Helper:
    def after(self, z: torch.Tensor) -> torch.Tensor:
        return z

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.after(super().forward(x))


class HelperChild(Helper):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


def closure_mixin() -> tuple[type, types.FunctionType]:
    squash = False

    class Closure:
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            z = super().forward(x)
            return z.tanh() if squash else z

    def squashed() -> None:
        nonlocal squash
        squash = True

    return Closure, squashed


def _read_changes(case: str, base: type[nn.Module], monkeypatch: pytest.MonkeyPatch) -> tuple[type, types.FunctionType]:
    """A layer class whose forward reads something outside the layer, and the change that puts a tanh inside."""
    if case == "closure cell":
        mixin, change = closure_mixin()
    else:
        here = sys.modules[__name__]
        mixin, target, name, value = {
            "global flag": (GlobalFlag, here, "_SQUASH", True),
            "global function": (GlobalHelper, here, "_kept", torch.tanh),
            "configuration module": (ConfigModule, _CONFIG, "squash", True),
            "class attribute": (ClassFlag, ClassFlag, "squash", True),
            "base class method": (HelperChild, Helper, "after", lambda self, z: z.tanh()),
        }[case]
        change = lambda: monkeypatch.setattr(target, name, value)  # noqa: E731
    return type(f"{mixin.__name__}{base.__name__}", (mixin, base), {}), change


def _layers_of(layer_class: type[nn.Module], base: type[nn.Module], count: int) -> nn.Sequential:
    if base is nn.Linear:
        return nn.Sequential(*[layer_class(4, 4) for _ in range(count)]).eval()
    return nn.Sequential(*[layer_class(2, 2, 3, padding=1) for _ in range(count)], nn.Flatten()).eval()


READS = ["global flag", "global function", "configuration module", "class attribute", "base class method"]
READ_PRESETS = {
    "UniformEpsilon": UniformEpsilon,
    "EpsilonPlus": EpsilonPlus,
    "EpsilonGammaBox": lambda: EpsilonGammaBox(low=-3.0, high=3.0),
    "AttnLRP": lambda: AttnLRP(epsilon=1e-6),
}


@pytest.mark.parametrize("preset", sorted(READ_PRESETS))
@pytest.mark.parametrize("case", [*READS, "closure cell"])
def test_what_the_forward_reads_outside_the_layer_changed_after_an_entry_is_refused(case, preset, monkeypatch):
    """A verdict kept for a forward whose code reads a global, a class attribute or a closure was given again after
    that changed: a tanh inside the layer passed silently."""
    base = nn.Linear if preset == "AttnLRP" else nn.Conv2d
    layer_class, change = _read_changes(case, base, monkeypatch)
    model = _layers_of(layer_class, base, 2)
    lrp = wrapper(nn.Sequential(base(4, 4) if base is nn.Linear else base(2, 2, 1), model), READ_PRESETS[preset]())
    enter(lrp)
    enter(lrp)
    change()
    with pytest.raises(ValueError, match=layer_class.__name__):
        enter(lrp)


@pytest.mark.parametrize("base", [nn.Linear, nn.Conv2d])
@pytest.mark.parametrize("case", [*READS, "closure cell"])
def test_what_the_forward_reads_unchanged_probes_once(case, base, monkeypatch):
    layer_class, _ = _read_changes(case, base, monkeypatch)
    lrp = wrapper(_layers_of(layer_class, base, 3), UniformEpsilon())
    with counted("_rays_bent") as runs:
        enter(lrp)
        enter(lrp)
    assert runs[0] == 3


class NamesLibraryClasses(nn.Linear):
    """A forward that names torch's and Python's classes (whose attributes are not kept: the layer still is)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or isinstance(x, (OrderedDict, F.__class__)):
            raise TypeError("a tensor")
        return super().forward(x)


def test_a_forward_naming_library_classes_probes_once():
    lrp = wrapper(nn.Sequential(NamesLibraryClasses(4, 4), NamesLibraryClasses(4, 4)).eval(), UniformEpsilon())
    with counted("_rays_bent") as runs:
        enter(lrp)
        enter(lrp)
    assert runs[0] == 2


def _quantization_aware_conv_bn(channels: int) -> nn.Module:
    """torch.ao's QAT ``ConvBn2d`` in eval mode, fake quantisation off (float64): a linear layer with a BatchNorm
    inside, whose rule registers on the BatchNorm at each context entry."""
    from torch.ao import quantization
    from torch.ao.nn import intrinsic
    from torch.ao.nn.intrinsic import qat

    norm = nn.BatchNorm2d(channels)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.running_var.uniform_(0.5, 1.5)
    fused = intrinsic.ConvBn2d(nn.Conv2d(channels, channels, 3, padding=1, bias=False), norm)
    for module in fused.modules():
        module.qconfig = quantization.get_default_qat_qconfig("x86")
    layer = qat.ConvBn2d.from_float(fused)
    layer.eval()(torch.randn(2, channels, 5, 5))
    layer.apply(quantization.disable_observer)
    layer.apply(quantization.disable_fake_quant)
    return layer.double().eval()


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
def test_a_layer_whose_submodule_has_a_rule_is_probed_once():
    # The rule hooks on the BatchNorm inside, new at each entry, and the quantization configuration (not comparable)
    # were in the verdict's key: each entry, and each call made without an open context, probed every ConvBn2d.
    layers = [_quantization_aware_conv_bn(3) for _ in range(3)]
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten()).double().eval()
    lrp = wrapper(model, EpsilonPlus())
    with counted("_check_linear_after_layer_call") as runs:
        enter(lrp)
        assert runs[0] == 3
        enter(lrp)
        lrp(TensorDict(x=torch.randn(2, 3, 5, 5, dtype=torch.float64), batch_size=[2]))
        assert runs[0] == 3
