"""CondConv layers (timm's ``CondConv2d``): routing weights held, the convolution rule applied with each sample's
kernel, in float64 against zennit's rules on a plain convolution carrying that kernel."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import CPLRP, LRP, AttnLRP, BaseRuleMapper
from tdhook.attribution.mappers.presets import EpsilonAlpha2Beta1, EpsilonGammaBox, EpsilonPlus, UniformEpsilon
from tdhook.attribution.rules.basic import EpsilonRule, IgnoreRule
from tdhook.attribution.rules.cond_conv import CondConvRule, is_cond_conv
from tdhook.attribution.rules.input_layer import FlatRule
from tests.attribution.rules._helpers import RULE_PAIRS
from tests.conftest import relative_error, zennit_relevance

timm = pytest.importorskip("timm")
from timm.layers import CondConv2d, pad_same  # noqa: E402

F64 = torch.float64
EXPERTS = 4

# (in, out, kernel, stride, padding, groups): a full 3×3 convolution with a bias, a depthwise one padded as
# TensorFlow's "same" at stride 2 (timm's tf_ models: padded in the forward, dynamically) and a pointwise one.
LAYERS = {
    "full": dict(in_channels=3, out_channels=5, kernel_size=3, stride=1, padding=1, bias=True),
    "depthwise-same": dict(in_channels=4, out_channels=4, kernel_size=3, stride=2, padding="same", groups=4),
    "pointwise": dict(in_channels=4, out_channels=6, kernel_size=1),
}


class Routed(nn.Module):
    """A CondConv layer with its routing weights computed from its input, as timm's ``CondConvResidual`` computes
    them; ``detached`` cuts the routing's gradient (the reference of LRP-0)."""

    def __init__(self, **layer: object) -> None:
        super().__init__()
        self.route = nn.Linear(layer["in_channels"], EXPERTS)
        self.conv = CondConv2d(num_experts=EXPERTS, **layer)
        self.detached = False

    def routing(self, x: torch.Tensor) -> torch.Tensor:
        routing = torch.sigmoid(self.route(F.adaptive_avg_pool2d(x, 1).flatten(1)))
        return routing.detach() if self.detached else routing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x, self.routing(x))


def routed(kind: str) -> tuple[Routed, torch.Tensor]:
    torch.manual_seed(0)
    model = Routed(**LAYERS[kind]).to(F64)
    if model.conv.bias is not None:
        with torch.no_grad():
            model.conv.bias.normal_()
    return model, torch.randn(3, model.conv.in_channels, 9, 9, dtype=F64)


def explained(model: nn.Module, mapper, x: torch.Tensor, relevance_out: torch.Tensor | None = None) -> TensorDict:
    target = None if relevance_out is None else (lambda y: relevance_out)
    lrp = LRP(TensorDictModule(model, in_keys=["x"], out_keys=["y"]), rule_mapper=mapper, target=target)
    return lrp(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))


def per_sample_oracle(model: Routed, theirs, x: torch.Tensor, relevance_out: torch.Tensor) -> torch.Tensor:
    """zennit's rule on a plain ``Conv2d`` with sample ``b``'s kernel ``Σ_e r_be W_e``, one sample at a time."""
    layer = model.conv
    with torch.no_grad():
        routing = model.routing(x)
    relevance = []
    for b in range(x.shape[0]):
        same = layer.dynamic_padding
        conv = nn.Conv2d(
            layer.in_channels,
            layer.out_channels,
            layer.kernel_size,
            layer.stride,
            0 if same else layer.padding,
            layer.dilation,
            layer.groups,
            bias=layer.bias is not None,
        ).to(F64)
        with torch.no_grad():
            conv.weight.copy_((routing[b] @ layer.weight).view(layer.weight_shape))
            if layer.bias is not None:
                conv.bias.copy_(routing[b] @ layer.bias)
        sample = x[b : b + 1]
        padded = pad_same(sample, layer.kernel_size, layer.stride, layer.dilation) if same else sample
        found = zennit_relevance(theirs(), conv, padded, relevance_out[b : b + 1])
        if same:  # the padding (left and top: half of it, rounded down) has zero values, and zero relevance
            rows, columns = (found.shape[-2] - sample.shape[-2]) // 2, (found.shape[-1] - sample.shape[-1]) // 2
            inside = (..., slice(rows, rows + sample.shape[-2]), slice(columns, columns + sample.shape[-1]))
            border = found.clone()
            border[inside] = 0
            assert not border.any()
            found = found[inside]
        relevance.append(found)
    return torch.cat(relevance)


@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize("rule_name", ["epsilon", "epsilon-large", "zplus", "alpha2beta1", "gamma"])
def test_the_rule_of_each_samples_kernel_matches_zennit_on_a_plain_convolution(rule_name: str, kind: str):
    """The routing weights held, the layer is a convolution of each sample by ``Σ_e r_be W_e``: its relevance is that
    convolution's under the rule (zennit's, sample by sample), and none reaches the routing branch."""
    ours, theirs = RULE_PAIRS[rule_name]
    model, x = routed(kind)
    with torch.no_grad():
        relevance_out = torch.randn_like(model(x))
    rule = CondConvRule(ours())
    relevance = explained(model, lambda name, m: rule if is_cond_conv(m) else None, x, relevance_out)
    assert relative_error(relevance["relevance", "x"], per_sample_oracle(model, theirs, x, relevance_out)) <= 1e-10


@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize("mapper", [BaseRuleMapper, CPLRP, AttnLRP], ids=lambda m: m.__name__)
def test_lrp0_is_gradient_times_input_with_the_routing_detached(kind: str, mapper):
    """LRP-0 on the convolution (the plain presets' and the transformer presets'): the gradient of the layer with its
    routing weights detached, times the input, where the model is the layer and a ReLU after it."""
    model, x = routed(kind)
    relu = nn.Sequential(model, nn.ReLU())
    relevance = explained(relu, mapper(stabilizer=1e-12), x)["relevance", "x"]
    model.detached = True
    leaf = x.clone().requires_grad_(True)
    out = relu(leaf)
    (grad,) = torch.autograd.grad(out.max(-1).values.sum(), leaf)  # the target: the argmax of the last dimension
    assert relative_error(relevance, x * grad) <= 1e-10


@pytest.mark.parametrize(
    ("preset", "inner"),
    [
        (EpsilonPlus, "AlphaBetaRule"),
        (EpsilonAlpha2Beta1, "AlphaBetaRule"),
        (lambda: EpsilonGammaBox(-3.0, 3.0), "GammaRule"),
        (UniformEpsilon, "EpsilonRule"),
        (CPLRP, "IgnoreRule"),
        (AttnLRP, "IgnoreRule"),
    ],
)
def test_presets_give_a_cond_conv_layer_their_convolution_rule(preset, inner: str):
    model, _ = routed("full")
    mapper = preset()
    rule = mapper("conv", model.conv)
    assert isinstance(rule, CondConvRule) and type(rule.rule).__name__ == inner
    plain = mapper("conv", nn.Conv2d(3, 5, 3))
    assert rule.rule is plain or (inner == "IgnoreRule" and isinstance(plain, IgnoreRule))


def test_other_rules_and_other_modules_are_refused():
    with pytest.raises(TypeError, match="CondConvRule applies a convolution rule"):
        CondConvRule(FlatRule())
    with pytest.raises(TypeError, match="expects a CondConv layer"):
        CondConvRule(EpsilonRule()).register(nn.Conv2d(2, 2, 1))


def test_the_routing_given_by_keyword_is_held_too():
    model, x = routed("full")
    leaf = x.clone().requires_grad_(True)
    with CondConvRule().register(model.conv):
        out = model.conv(leaf, routing_weights=model.routing(leaf))
    model.detached = True
    expected = model(leaf)
    grads = [torch.autograd.grad(y.sum(), leaf)[0] for y in (out, expected)]
    assert relative_error(*grads) <= 1e-12


def efficientnet_cc(name: str) -> tuple[nn.Module, torch.Tensor]:
    """timm's CondConv EfficientNet in float64 with random weights, BatchNorm calibrated, bias-like terms zeroed."""
    from tests.attribution.test_lrp_gallery import calibrate, randomise_zero_initialised, zero_biases

    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False).to(F64)
    randomise_zero_initialised(model)
    zero_biases(calibrate(model, 32))
    return model, torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2), dtype=F64)


@pytest.mark.parametrize(
    ("preset", "tolerance"),
    [(lambda: EpsilonGammaBox(-10.0, 10.0), 1e-4), (CPLRP, 1e-6), (AttnLRP, 1e-6)],
    ids=["EpsilonGammaBox", "CPLRP", "AttnLRP"],
)
def test_efficientnet_cc_conserves_relevance_and_warns_of_nothing(preset, tolerance: float):
    """With its routing held, a CondConv block conserves relevance as a convolution block does: the whole model's
    relevance sums to the logit (CP-LRP gave 1.9·10⁴ to 1.5·10⁵ times it, and warned of each CondConv2d)."""
    model, x = efficientnet_cc("efficientnet_cc_b0_4e")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        td = explained(model, preset(), x)
    ratios = td["relevance", "x"].flatten(1).sum(1) / td["y"].max(-1).values
    assert torch.allclose(ratios, torch.ones_like(ratios), rtol=0, atol=tolerance), ratios.tolist()


def test_create_graph_refuses_the_rule_naming_the_module():
    """Each sample's kernel is built outside the graph: a derivative of the relevance would miss its paths."""
    model, x = routed("full")
    lrp = LRP(TensorDictModule(model, in_keys=["x"], out_keys=["y"]), rule_mapper=CPLRP(), create_graph=True)
    with pytest.raises(NotImplementedError, match=r"CondConvRule\(rule=IgnoreRule\(\)\) on module 'module.conv'"):
        lrp(TensorDict(x=x, batch_size=[x.shape[0]]))
