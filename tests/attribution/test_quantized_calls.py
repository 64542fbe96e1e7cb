"""Statically quantized parts of a model: the relevance they cut off is named, never lost in silence.

A model converted by torch.ao's static quantization computes its quantized part on quantized tensors, which carry no
gradient. Where a float path runs beside that part (a quantized block next to a float skip connection), relevance
reaches the input through the float path alone: the quantized block's share of the explained output was lost with no
warning (the relevance summed to -3.1 and 2.3 times the logit on the model below, under every preset). The call that
quantizes an activation is now named, and where every path is quantized the error names the quantized modules.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torch.ao import quantization

from tdhook.attribution import CPLRP, LRP, BaseRuleMapper, EpsilonPlus
from tdhook.attribution.targets import TargetWithoutGradient

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.ao's eager quantization API

ENGINE = "x86" if "x86" in torch.backends.quantized.supported_engines else "fbgemm"
PRESETS = {"LRP-0": lambda **kw: BaseRuleMapper(stabilizer=1e-9, **kw), "EpsilonPlus": EpsilonPlus, "CPLRP": CPLRP}


class Branch(nn.Module):
    """A block quantized on its own: ``QuantStub`` → Linear → ``DeQuantStub``."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.fc, self.dequant = (
            quantization.QuantStub(),
            nn.Linear(4, 4, bias=False),
            quantization.DeQuantStub(),
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.fc(self.quant(h)))


class FloatSkip(nn.Module):
    """``out(h + branch(h))`` with ``h = relu(inp(x))``, no biases: the branch quantized, the rest float."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.branch, self.out = nn.Linear(3, 4, bias=False), Branch(), nn.Linear(4, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        return self.out(h + self.branch(h))


def converted(model: nn.Module, quantized: nn.Module, inputs: int) -> nn.Module:
    """``model`` with its part ``quantized`` statically quantized (observed on random inputs, then converted)."""
    torch.backends.quantized.engine = ENGINE
    quantized.qconfig = quantization.get_default_qconfig(ENGINE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantization.prepare(model.eval(), inplace=True)
        model(torch.randn(32, inputs, generator=torch.Generator().manual_seed(1)))
        return quantization.convert(model, inplace=True)


def explain(model: nn.Module, x: torch.Tensor, mapper) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    lrp = LRP(TensorDictModule(model, in_keys=["x"], out_keys=["y"]), rule_mapper=mapper)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        td = lrp(TensorDict(x=x, batch_size=[x.shape[0]]))
    return td["relevance", "x"], td["y"], [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


@pytest.mark.parametrize("preset", PRESETS)
def test_a_quantized_block_beside_a_float_path_is_named(preset: str):
    torch.manual_seed(0)
    model = FloatSkip()
    model = converted(model, model.branch, 3)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(2))
    relevance, y, messages = explain(model, x, PRESETS[preset]())
    named = [m for m in messages if "module 'module.branch.quant' (Quantize) quantizes an activation" in m]
    assert len(named) == 1 and "quantize_per_tensor" in named[0], messages
    # What the warning says is lost: the relevance is that of the float path alone, out(h) at the explained logit
    # (LRP-0 and every preset's rule on these bias-free ReLU layers conserve it), the quantized block's share missing.
    with torch.no_grad():
        unit = y.argmax(-1, keepdim=True)
        float_path = model.out(torch.relu(model.inp(x))).gather(-1, unit).squeeze(-1)
    assert not torch.allclose(float_path, y.gather(-1, unit).squeeze(-1), rtol=0.1)  # the block weighs in
    torch.testing.assert_close(relevance.sum(-1), float_path, rtol=1e-3, atol=1e-4)  # float32, ε = 1e-6


def test_a_strict_mapper_refuses_the_quantized_block():
    torch.manual_seed(0)
    model = FloatSkip()
    model = converted(model, model.branch, 3)
    with pytest.raises(ValueError, match=r"'module.branch.quant' \(Quantize\) quantizes an activation"):
        explain(model, torch.randn(4, 3), BaseRuleMapper(strict=True))


def test_a_model_quantized_throughout_is_refused_naming_its_quantized_modules():
    torch.manual_seed(0)
    model = nn.Sequential(
        quantization.QuantStub(), nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2), quantization.DeQuantStub()
    )
    model = converted(model, model, 3)
    with pytest.raises(
        ValueError, match=r"does not depend on .*statically quantized modules \('module.0' \(Quantize\)"
    ):
        explain(model, torch.randn(4, 3), EpsilonPlus())


@pytest.mark.parametrize("preset", PRESETS)
def test_the_refusal_of_a_quantized_model_is_the_same_under_every_preset(preset: str):
    """Under CP-LRP the refusal took a hint of its own, that the target may be computed from a softmax CP-LRP holds
    (no softmax here: the quantized modules are the cause it names), and became a plain ValueError."""
    torch.manual_seed(0)
    model = nn.Sequential(
        quantization.QuantStub(), nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2), quantization.DeQuantStub()
    )
    model = converted(model, model, 3)
    with pytest.raises(TargetWithoutGradient, match=r"statically quantized modules") as caught:
        explain(model, torch.randn(4, 3), PRESETS[preset]())
    assert "softmax" not in str(caught.value)


def test_a_dynamically_quantized_model_quantizes_nothing_the_watch_names():
    torch.manual_seed(0)
    model = quantization.quantize_dynamic(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)), {nn.Linear})
    _, _, messages = explain(model, torch.randn(4, 3), EpsilonPlus())
    assert not any("quantizes an activation" in m for m in messages), messages


def test_a_block_quantized_in_graph_mode_is_named_at_the_graph():
    """``torch.ao``'s FX graph mode writes the quantization into the traced forward: the graph module is named."""
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    torch.manual_seed(0)
    torch.backends.quantized.engine = ENGINE
    model = FloatSkip().eval()
    model.branch = model.branch.fc  # the block, a plain Linear, quantized by its name in the mapping
    mapping = quantization.QConfigMapping().set_module_name("branch", quantization.get_default_qconfig(ENGINE))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare_fx(model, mapping, example_inputs=(torch.randn(4, 3),))
        prepared(torch.randn(32, 3, generator=torch.Generator().manual_seed(1)))
        graph = convert_fx(prepared)
    _, _, messages = explain(graph, torch.randn(4, 3), EpsilonPlus())
    assert any("module 'module' (GraphModule) quantizes an activation" in m for m in messages), messages
