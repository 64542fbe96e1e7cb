"""Dynamically quantized Linear layers: the ε-rule on the dequantized weight, never a silent zero or NaN."""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import CPLRP, LRP, AttnLRP, EpsilonPlus, EpsilonPlusFlat
from tdhook.attribution.rules.basic import EpsilonRule
from tdhook.attribution.rules.quantized import QuantizedLinearRule
from tests.conftest import relative_error, tdhook_relevance


def quantized_mlp() -> tuple[nn.Module, nn.Module]:
    """A float MLP and its dynamically quantized twin."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    return mlp, torch.ao.quantization.quantize_dynamic(mlp, {nn.Linear}, dtype=torch.qint8)


def dequantized(quantized: nn.Module) -> nn.Module:
    """The float MLP with the quantized layers' dequantized weights: the reference the rule must match."""
    layers = []
    for module in quantized:
        if isinstance(module, torch.ao.nn.quantized.dynamic.Linear):
            weight = module.weight().dequantize()
            layer = nn.Linear(weight.shape[1], weight.shape[0])
            with torch.no_grad():
                layer.weight.copy_(weight)
                layer.bias.copy_(module.bias())
            module = layer
        layers.append(module)
    return nn.Sequential(*layers).eval()


@pytest.mark.parametrize("preset", [AttnLRP, CPLRP, EpsilonPlus])
def test_quantized_mlp_gets_the_epsilon_rule_on_its_dequantized_weights(preset):
    _, quantized = quantized_mlp()
    x = torch.randn(5, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "no LRP rule" warning, no backprop through a kernel without autograd
        td = LRP(quantized, preset(), in_keys=["x"], out_keys=["y"])(TensorDict(x=x.clone(), batch_size=[5]))
    relevance = td["relevance", "x"]
    assert torch.isfinite(relevance).all() and relevance.abs().sum() > 0
    assert torch.equal(td["y"], quantized(x))  # the quantized computation, unchanged

    reference = dequantized(quantized)
    stabilizer = preset().stabilizer
    mapper = {nn.Linear: EpsilonRule(stabilizer)}
    expected = LRP(reference, preset(rule_mapper=mapper), in_keys=["x"], out_keys=["y"], target=td["y"].argmax(-1))
    # The dequantized float layer computes what the quantized one does up to the activations' int8 rounding.
    assert relative_error(relevance, expected(TensorDict(x=x, batch_size=[5]))["relevance", "x"]) <= 0.05


def test_a_float_layer_after_a_quantized_one_is_no_first_layer():
    # Quantizing only the first layer: the float layer after it reads a layer's output, so a preset's first-layer
    # rule (Flat) does not go on it (it did, as if the quantized layer were glue: 10 times off, relative).
    mlp, _ = quantized_mlp()
    quantized = torch.ao.quantization.quantize_dynamic(mlp, {"0"}, dtype=torch.qint8)
    assert isinstance(quantized[0], torch.ao.nn.quantized.dynamic.Linear) and type(quantized[2]) is nn.Linear
    td = TensorDict(x=torch.randn(5, 8), batch_size=[5])

    def relevance(mapper) -> torch.Tensor:
        return LRP(quantized, mapper, in_keys=["x"], out_keys=["y"], target=0)(td.clone())["relevance", "x"]

    # No Linear layer is reached first: EpsilonPlusFlat is EpsilonPlus, to the bit.
    assert torch.equal(relevance(EpsilonPlusFlat()), relevance(EpsilonPlus()))


def test_the_rule_on_one_layer_matches_the_epsilon_rule():
    _, quantized = quantized_mlp()
    layer, x = quantized[2], torch.randn(5, 16)
    relevance_out = torch.randn(5, 4)
    float_layer = dequantized(nn.Sequential(layer))[0]
    actual = tdhook_relevance(QuantizedLinearRule(epsilon=0.1), layer, x, relevance_out)
    expected = tdhook_relevance(EpsilonRule(epsilon=0.1), float_layer, x, relevance_out)
    assert relative_error(actual, expected) <= 0.05


def test_a_layer_called_with_its_input_by_keyword_gets_the_rule():
    """``layer(x=x)``: the rule's hook sees the input (it saw none, left the layer, whose kernel has no gradient,
    without its rule, and the call was refused: the target did not depend on the input)."""

    class ByKeyword(nn.Sequential):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for module in self:
                x = module(x=x) if isinstance(module, torch.ao.nn.quantized.dynamic.Linear) else module(x)
            return x

    _, quantized = quantized_mlp()
    x = torch.randn(5, 8)

    def relevance(model: nn.Module) -> torch.Tensor:
        lrp = LRP(model, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
        return lrp(TensorDict(x=x, batch_size=[5]))["relevance", "x"]

    torch.testing.assert_close(relevance(ByKeyword(*quantized)), relevance(quantized), rtol=0, atol=0)


def test_registering_on_another_module_is_an_error_naming_it():
    with pytest.raises(TypeError, match="expects a dynamically quantized Linear.*got Linear"):
        QuantizedLinearRule().register(nn.Linear(2, 2))


def test_a_preset_warns_that_its_first_layer_rule_skips_quantized_layers():
    # EpsilonPlusFlat on a fully quantized MLP gives no layer Flat (the first gets the ε-rule: 2.9 to 3.4 off the float
    # model's relevance, relative); it said nothing. It now warns, naming the preset's rule and the layers.
    _, quantized = quantized_mlp()
    td = TensorDict(x=torch.randn(5, 8), batch_size=[5])
    with pytest.warns(
        UserWarning,
        match=r"EpsilonPlusFlat: its first-layer rule \(FlatRule\) is not applied to "
        r"dynamically quantized Linear layers \('0', '2'\)",
    ):
        LRP(quantized, EpsilonPlusFlat(), in_keys=["x"], out_keys=["y"], target=0)(td)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a preset without a first-layer rule has nothing to say
        LRP(quantized, EpsilonPlus(), in_keys=["x"], out_keys=["y"], target=0)(td.clone())
