"""Gallery models as users rebuild them: traced by ``torch.fx``, cut by a feature extractor, or built by timm with
``features_only=True`` and explained with ``layers=``.

A traced model computes what the model computes, with the modules torch's tracer keeps as leaves (torch's own:
``nn.Conv2d``, ``nn.BatchNorm2d``, ``nn.ReLU``) and every other module inlined into the graph's forward as the
functions it calls. Under every CNN preset, CP-LRP and LRP-0, its relevance must equal the untraced model's
(relative L2 error ≤ 1e-6: timm's ``convnext_atto`` traced through its blocks' Mlp differs by 1.1e-7 under CP-LRP, a
stabiliser's order, both conserving to 1e-9), or the call must warn naming the module whose calls no rule
covers. timm's BatchNormAct2d, inlined, is an ``F.batch_norm`` call on a convolution's output that no rule merges:
on ``test_efficientnet`` with BatchNorm scales of both signs the relevance was 64–99 % away from the untraced
model's under z⁺ and α2β1 (9.6 % under EpsilonGammaBox), with no warning.

timm's feature models return a list of feature maps, taken from the modules (``FeatureListNet``) or by forward
hooks on them (``FeatureHookNet``). Each map is explained (its sum, ``target=lambda y: y``) with the relevance of an
inner convolution asked for by ``layers=``: both kinds give the same relevance, LRP-0 is gradient × input at the
input and at the layer, and with zero biases every preset conserves.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.fx
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import LRP, BaseRuleMapper
from tests.attribution.test_lrp_gallery import (
    BATCH,
    CNN_PRESETS,
    F64,
    PRESETS,
    RECTIFIED,
    Case,
    build,
    calibrate,
    randomise_zero_initialised,
    timm_case,
    tm,
    torchvision_case,
    zero_biases,
)

torchvision = pytest.importorskip("torchvision")
timm = pytest.importorskip("timm")

MAPPERS = {"LRP-0": lambda: BaseRuleMapper(stabilizer=1e-12), **{p: PRESETS[p] for p in (*CNN_PRESETS, "CPLRP")}}
# For the traced models: z⁺ (EpsilonPlusFlat's later layers), γ, αβ's neighbour left out, and CP-LRP.
TRACED_MAPPERS = {p: MAPPERS[p] for p in ("LRP-0", "EpsilonPlus", "EpsilonGammaBox", "CPLRP")}


def explain(model: nn.Module, x: torch.Tensor, mapper, out_keys=("y",), **kwargs) -> tuple[TensorDict, list[str]]:
    lrp = LRP(TensorDictModule(model, in_keys=["x"], out_keys=list(out_keys)), rule_mapper=mapper, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        td = lrp(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))
    return td, [str(w.message) for w in caught]


class Picked(nn.Module):
    """One output of a feature extractor's dict."""

    def __init__(self, extractor: nn.Module, key: str) -> None:
        super().__init__()
        self.extractor, self.key = extractor, key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.extractor(x)[self.key]


def mixed_sign_scales(model: nn.Module) -> nn.Module:
    """BatchNorm scales of both signs, as trained models have: a BatchNorm left unmerged then changes z⁺."""
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator, dtype=module.weight.dtype))
    return model


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).norm() / expected.norm().clamp_min(1e-300)).item()


def fx_traced(model: nn.Module) -> nn.Module:
    return torch.fx.symbolic_trace(model)


def torchvision_extractor(model: nn.Module) -> nn.Module:
    from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names

    last = get_graph_node_names(model)[1][-1]
    return Picked(create_feature_extractor(model, {last: "out"}), "out")


def timm_extractor(model: nn.Module) -> nn.Module:
    """timm's extractor keeps its own norm and activation layers (BatchNormAct2d) as leaves."""
    from timm.models._features_fx import create_feature_extractor, get_graph_node_names

    last = get_graph_node_names(model)[1][-1]
    return Picked(create_feature_extractor(model, {last: "out"}), "out")


TRACED = {
    # Squeeze-excite blocks inlined: their gates are functions in the graph, held as the modules' are.
    "torchvision/mobilenet_v3_small fx": (torchvision_case("mobilenet_v3_small"), fx_traced),
    # Channel shuffles and splits as functions in the graph.
    "torchvision/shufflenet_v2_x0_5 extractor": (torchvision_case("shufflenet_v2_x0_5"), torchvision_extractor),
    "timm/test_efficientnet fx": (timm_case("test_efficientnet", RECTIFIED), fx_traced),
    "timm/test_efficientnet extractor": (timm_case("test_efficientnet", RECTIFIED), timm_extractor),
    # timm's LayerNorm2d inlined: the CNN presets warn of its layer_norm; CP-LRP's function rules cover it.
    "timm/test_convnext fx": (Case("timm/test_convnext", tm("test_convnext"), 32, RECTIFIED), fx_traced),
}


@pytest.mark.parametrize("name", sorted(TRACED))
def test_traced_model_explains_as_the_model_or_names_the_module(name: str):
    case, trace = TRACED[name]
    model = zero_biases(mixed_sign_scales(build(case)))
    traced = trace(model)
    x = torch.randn(BATCH, 3, case.size, case.size, generator=torch.Generator().manual_seed(2), dtype=F64)
    failures = {}
    for preset, mapper in TRACED_MAPPERS.items():
        expected, _ = explain(model, x, mapper())
        got, caught = explain(traced, x, mapper())
        torch.testing.assert_close(got["y"], expected["y"], rtol=0, atol=0)
        error = relative_error(got["relevance", "x"], expected["relevance", "x"])
        named = any(m.startswith("LRP: module ") or m.startswith("LRP: the model itself") for m in caught)
        if not error <= 1e-6 and not named:
            failures[preset] = f"relative error {error:.2e}, no warning naming a module"
    assert failures == {}


# --- timm's feature models --------------------------------------------------------------------------------------


class Listed(nn.Module):
    """A feature model's list of maps, as the tuple a TensorDictModule writes to its out_keys."""

    def __init__(self, features: nn.Module) -> None:
        super().__init__()
        self.features = features

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.features(x))


SIZE, OUT_INDICES = 32, (1, 2, 3)


def feature_model(feature_cls: str, source: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    features = timm.create_model(
        "resnet10t", pretrained=False, features_only=True, out_indices=OUT_INDICES, feature_cls=feature_cls
    ).to(F64)
    state = source.state_dict()
    wanted = features.state_dict()
    features.load_state_dict({k: state[k.removeprefix("body.")] for k in wanted})
    return Listed(features.eval())


@pytest.fixture(scope="module")
def resnet10t() -> nn.Module:
    torch.manual_seed(0)
    model = timm.create_model("resnet10t", pretrained=False, num_classes=0).to(F64)
    randomise_zero_initialised(model)
    return zero_biases(calibrate(model, SIZE))


def inner_layer(model: nn.Module) -> str:
    return next(name for name, _ in model.named_modules() if name.endswith("layer2.0.conv2"))


@pytest.mark.parametrize("preset", list(MAPPERS))
def test_features_only_maps_and_layers(resnet10t: nn.Module, preset: str):
    x = torch.randn(BATCH, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(2), dtype=F64)
    keys = [f"f{i}" for i in OUT_INDICES]
    results = {}
    for feature_cls in ("list", "hook"):
        model = feature_model(feature_cls, resnet10t)
        layer = "module." + inner_layer(model)
        for key in keys:
            td, caught = explain(
                model, x, MAPPERS[preset](), keys, target_key=key, target=lambda y: y, layers={layer: "layer"}
            )
            assert caught == []
            results[feature_cls, key] = (td["relevance", "x"], td["relevance", "layer"], td[key])
    for key in keys:
        (relevance, layer_relevance, output), (hooked, hooked_layer, _) = results["list", key], results["hook", key]
        torch.testing.assert_close(hooked, relevance, rtol=1e-12, atol=0)
        torch.testing.assert_close(hooked_layer, layer_relevance, rtol=1e-12, atol=0)
        ratio = relevance.flatten(1).sum(1) / output.flatten(1).sum(1)
        torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=1e-3, atol=0)
    if preset == "LRP-0":  # gradient × input, at the input and at the inner layer (f1 lies before it)
        model, store = feature_model("list", resnet10t), {}
        conv = model.get_submodule(inner_layer(model))
        handle = conv.register_forward_hook(lambda m, a, out: store.update(out=out) or out.retain_grad())
        leaf = x.clone().requires_grad_(True)
        outputs = model(leaf)
        handle.remove()
        for key, out in zip(keys, outputs, strict=True):
            leaf.grad = store["out"].grad = None
            out.sum().backward(retain_graph=True)
            relevance, layer_relevance, _ = results["list", key]
            assert relative_error(relevance, x * leaf.grad) <= 1e-9
            grad = store["out"].grad if store["out"].grad is not None else torch.zeros_like(store["out"])
            assert relative_error(layer_relevance, store["out"].detach() * grad) <= 1e-9
