"""Low-rank adapters (LoRA): a Linear layer plus a low-rank branch added to it, ``W x + b + s·B(A x)``.

The three Linear modules each get their rule, and the sum of the branches is glue (its plain gradient). Under
LRP-0 that is gradient × input, the relevance of the merged layer ``W + s·B·A``. A rule with a stabiliser or
modified weights (ε, γ, z⁺, αβ) on each branch is not that rule on the merged layer: each branch is rescaled by
its own output, which the other branch may cancel. The merged layer is the one zennit explains once the adapter
is merged (peft's ``merge_and_unload()``); zennit on the unmerged module is no oracle, since it passes relevance
through the sum and the scaling as a gradient (the branches' relevance then counts twice). These tests pin both
facts, and the way to the merged layer's ε-rule without merging.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn
from zennit import rules as zrules
from zennit.composites import LayerMapComposite

from tdhook.attribution import LRP, AlphaBetaRule, EpsilonRule, GammaRule, IgnoreRule
from tests.conftest import relative_error

F64 = torch.float64


class LoRALinear(nn.Module):
    """``base(x) + scaling · lora_B(lora_A(x))``, as peft's LoRA layer computes it (dropout off)."""

    def __init__(self, in_features: int, out_features: int, rank: int = 2, scaling: float = 2.0) -> None:
        super().__init__()
        self.base = nn.Linear(in_features, out_features)
        self.lora_A = nn.Linear(in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, out_features, bias=False)
        self.scaling = scaling
        nn.init.normal_(self.lora_B.weight, std=0.5)  # trained: not peft's zero initialisation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scaling

    def merged(self) -> nn.Linear:
        layer = nn.Linear(self.base.in_features, self.base.out_features).to(self.base.weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(self.base.weight + self.scaling * self.lora_B.weight @ self.lora_A.weight)
            layer.bias.copy_(self.base.bias)
        return layer


def models() -> tuple[nn.Module, nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    adapted = nn.Sequential(LoRALinear(6, 8), nn.ReLU(), LoRALinear(8, 3)).to(F64)
    merged = nn.Sequential(adapted[0].merged(), nn.ReLU(), adapted[2].merged())
    x = torch.randn(5, 6, dtype=F64)
    with torch.no_grad():
        torch.testing.assert_close(adapted(x), merged(x), rtol=1e-12, atol=1e-12)
    return adapted, merged, x, torch.randn(5, 3, dtype=F64)


def ours(model: nn.Module, x: torch.Tensor, r_out: torch.Tensor, mapper) -> torch.Tensor:
    lrp = LRP(model, rule_mapper=mapper, in_keys=["x"], out_keys=["y"], target=lambda y: r_out)
    return lrp(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))["relevance", "x"]


def zennit_merged(model: nn.Module, x: torch.Tensor, r_out: torch.Tensor, rule) -> torch.Tensor:
    leaf = x.clone().requires_grad_(True)
    with LayerMapComposite([(nn.Linear, rule), (nn.ReLU, zrules.Pass())]).context(model) as modified:
        return torch.autograd.grad(modified(leaf), leaf, r_out)[0]


RULES = {
    "epsilon": (lambda: EpsilonRule(0.1), lambda: zrules.Epsilon(0.1)),
    "gamma": (lambda: GammaRule(0.25), lambda: zrules.Gamma(0.25)),
    "zplus": (lambda: AlphaBetaRule(1.0, 0.0), lambda: zrules.ZPlus()),
}


class TestLowRankAdapters:
    def test_lrp0_per_branch_is_the_merged_layer_and_gradient_times_input(self):
        adapted, merged, x, r_out = models()
        actual = ours(adapted, x, r_out, {nn.Linear: EpsilonRule(0.0)})
        leaf = x.clone().requires_grad_(True)
        out = merged(leaf)  # the target sets relevance r_out at the output: the gradient there is r_out / out
        expected = x * torch.autograd.grad(out, leaf, r_out / out.detach())[0]
        assert relative_error(actual, expected) <= 1e-12
        assert relative_error(ours(merged, x, r_out, {nn.Linear: EpsilonRule(0.0)}), expected) <= 1e-12

    @pytest.mark.parametrize("rule", sorted(RULES))
    def test_a_rule_per_branch_is_not_the_rule_on_the_merged_layer(self, rule: str):
        # The documented semantics: each of the three Linear modules gets the rule. On the merged layer, the
        # relevance is zennit's (the oracle); per branch it differs (ε = 0.1: 45 %, γ: 21 %, z⁺: 25 times).
        mine, theirs = RULES[rule]
        adapted, merged, x, r_out = models()
        on_merged = ours(merged, x, r_out, {nn.Linear: mine()})
        assert relative_error(on_merged, zennit_merged(merged, x, r_out, theirs())) <= 1e-6
        assert relative_error(ours(adapted, x, r_out, {nn.Linear: mine()}), on_merged) > 0.1

    def test_the_epsilon_rule_on_the_adapter_module_is_the_merged_layers(self):
        # The ε-rule needs no weights: on the adapter module as a whole, with its Linear modules left to their
        # plain gradient, it is the ε-rule of the merged layer.
        adapted, merged, x, r_out = models()

        def adapter_as_one_layer(name: str, module: nn.Module):
            if isinstance(module, LoRALinear):
                return EpsilonRule(0.1)
            return IgnoreRule() if isinstance(module, nn.Linear) else None

        actual = ours(adapted, x, r_out, adapter_as_one_layer)
        assert relative_error(actual, zennit_merged(merged, x, r_out, zrules.Epsilon(0.1))) <= 1e-6
