"""A BatchNorm computed by ``F.batch_norm`` outside a BatchNorm module, on a layer's output: not merged, and named.

A ``torch.fx`` trace inlines every module that is not one of torch's own: timm's ``BatchNormAct2d`` becomes an
``F.batch_norm`` call in the graph's forward, right after the convolution. The layer's rule (z⁺, αβ, γ) is then applied
to the convolution alone and the batch norm keeps its plain gradient, where the model with the module merges the two:
on ``efficientnet_b0`` traced, with BatchNorm scales of both signs, EpsilonPlus's relevance was 99 % away from the
untraced model's, with no warning. The wrapper now warns, naming the module and the layer. So it does for an
``F.batch_norm`` in training mode, whose plain gradient runs through the batch's statistics, where a BatchNorm
module's rule holds them constant.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import CPLRP, LRP, BaseRuleMapper, EpsilonGammaBox, EpsilonPlus
from tdhook.attribution._unmerged_norms import report_unmerged_norms


class ScaledNorm(nn.BatchNorm2d):
    """An eval-mode BatchNorm2d defined outside torch (as timm's ``BatchNormAct2d``): ``torch.fx`` traces through
    it into ``F.batch_norm``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)


def model() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1, bias=False),
        ScaledNorm(6),
        nn.ReLU(),
        nn.Conv2d(6, 4, 3, padding=1, bias=False),
        ScaledNorm(4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    ).double()
    with torch.no_grad():
        for norm in (net[1], net[4]):
            norm.weight.copy_(torch.linspace(-1.5, 1.0, norm.num_features))  # scales of both signs
            norm.running_var.uniform_(0.5, 2.0)
            norm.running_mean.normal_()
    return net.eval()


def explain(net: nn.Module, mapper, x: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
    lrp = LRP(net, rule_mapper=mapper, in_keys=["x"], out_keys=["y"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        td = lrp(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))
    return td["relevance", "x"], [str(w.message) for w in caught]


@pytest.fixture
def x() -> torch.Tensor:
    return torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


@pytest.mark.parametrize("mapper", [EpsilonPlus, lambda: EpsilonGammaBox(-3.0, 3.0)], ids=["EpsilonPlus", "gamma"])
def test_a_functional_batch_norm_on_a_layer_output_is_named(mapper, x):
    net = model()
    traced = torch.fx.symbolic_trace(net)
    assert any(n.op == "call_function" and "batch_norm" in str(n.target) for n in traced.graph.nodes)
    merged, merged_warnings = explain(net, mapper(), x)
    unmerged, caught = explain(traced, mapper(), x)
    # What the warning is about: the relevance is not the module's (117 % away under EpsilonPlus, 48 % under γ).
    assert (unmerged - merged).norm() / merged.norm() > 0.01
    assert merged_warnings == []
    named = [m for m in caught if "batch_norm" in m and "not merged" in m]
    assert len(named) == 1, caught
    assert "the model itself" in named[0] and "layer '0' (" in named[0] and "layer '3' (" in named[0]


def test_strict_mapper_refuses(x):
    with pytest.raises(ValueError, match="outside a BatchNorm module, on the output of layer '0'"):
        explain(torch.fx.symbolic_trace(model()), EpsilonPlus(strict=True), x)


@pytest.mark.parametrize("mapper", [lambda: BaseRuleMapper(stabilizer=1e-12), CPLRP], ids=["LRP-0", "CPLRP"])
def test_no_warning_where_the_layer_rule_is_the_plain_gradient(mapper, x):
    # LRP-0 merged or not is the same relevance: nothing to say.
    net = model()
    merged, _ = explain(net, mapper(), x)
    unmerged, caught = explain(torch.fx.symbolic_trace(net), mapper(), x)
    assert [m for m in caught if "batch_norm" in m] == []
    torch.testing.assert_close(unmerged, merged, rtol=1e-9, atol=1e-12)


def test_report_lists_the_calls():
    found = {"": {"batch_norm on the output of layer 'conv' (AlphaBetaRule)": 2}}
    calls = report_unmerged_norms(found, {"": nn.Identity()}, strict=False)
    assert [(c.module, c.function, c.calls) for c in calls] == [
        ("", "batch_norm on the output of layer 'conv' (AlphaBetaRule)", 2)
    ]


class BatchStatisticsNorm(nn.BatchNorm2d):
    """A BatchNorm2d that normalises by the batch's statistics (training mode, no running statistics)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)


@pytest.mark.parametrize(
    "mapper", [lambda: BaseRuleMapper(stabilizer=1e-12), EpsilonPlus, CPLRP], ids=["LRP-0", "EpsilonPlus", "CPLRP"]
)
def test_a_functional_batch_norm_in_training_mode_is_named(mapper, x):
    # A BatchNorm module in training mode holds its batch statistics constant; the function's plain gradient runs
    # through them: 15 % (LRP-0, CP-LRP) and 29 % (EpsilonPlus) away from the module's relevance here, 92-108 % with
    # two such layers, with no warning before.
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), BatchStatisticsNorm(6), nn.ReLU(), nn.Flatten(), nn.Linear(384, 3)
    ).double()
    net.train()
    batch = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    held, held_warnings = explain(net, mapper(), batch)
    traced = torch.fx.symbolic_trace(net).train()
    plain, caught = explain(traced, mapper(), batch)
    assert (plain - held).norm() / held.norm() > 0.1
    # The module's training mode itself is told (its statistics are the batch's), and nothing else.
    assert [m for m in held_warnings if "module '1' (BatchStatisticsNorm) is in training mode" not in m] == []
    assert len(held_warnings) == 1
    assert [m for m in caught if "batch_norm (in training mode" in m and "the model itself" in m], caught


class ChannelStatistics(nn.Module):
    """An eval-mode batch norm of one's own, on buffers and parameters of its own, under a name that is no norm's."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.linspace(-0.5, 0.5, channels))
        self.register_buffer("var", torch.linspace(0.5, 2.0, channels))
        self.weight = nn.Parameter(torch.linspace(-1.5, 1.0, channels))  # scales of both signs
        self.bias = nn.Parameter(torch.linspace(-0.2, 0.3, channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, self.mean, self.var, self.weight, self.bias, False, 0.0, 1e-5)


@pytest.mark.parametrize("strict", [False, True])
def test_a_module_of_ones_own_calling_batch_norm_on_a_layer_output_is_named(strict: bool, x):
    """Taken for a norm by its call of ``F.batch_norm``, such a module got the norm rule, under which the first call's
    watch sees no call: the batch norm was left unmerged with no word (EpsilonPlus 109 % away from the same model with
    ``nn.BatchNorm2d``, and ``strict=True`` passed)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), ChannelStatistics(6), nn.ReLU(), nn.Flatten(), nn.Linear(384, 3))
    net = net.double().eval()
    if strict:
        with pytest.raises(ValueError, match=r"module '1' \(ChannelStatistics\) computes batch_norm .* layer '0'"):
            explain(net, EpsilonPlus(strict=True), x)
        return
    _, caught = explain(net, EpsilonPlus(), x)
    named = [m for m in caught if "not merged" in m]
    assert len(named) == 1 and "module '1' (ChannelStatistics)" in named[0], caught


def test_a_batch_norm_module_a_mapping_function_gave_no_rule_is_named_with_the_fix(x):
    """A function as the rule mapper gets none of BaseRuleMapper's defaults: a BatchNorm module it gave no rule
    stays unmerged, and the warning said it computed batch_norm "outside a BatchNorm module" and told to keep it a
    module, which it was. It names the mapper and the fixes (5.6 % off zennit on a small CNN under γ)."""

    def mapping(name: str, module: nn.Module):
        return EpsilonPlus()(name, module) if not isinstance(module, nn.BatchNorm2d) else None

    net = (
        nn.Sequential(
            nn.Conv2d(3, 6, 3, padding=1, bias=False),
            nn.BatchNorm2d(6),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(6 * 8 * 8, 2),
        )
        .double()
        .eval()
    )
    with torch.no_grad():
        net[1].running_var.uniform_(0.5, 2.0)
        net[1].weight.normal_()
    with pytest.warns(UserWarning, match=r"module '1' \(BatchNorm2d\) has no rule \(the rule mapper gave it none\)"):
        LRP(net, mapping, in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=x.shape[:1]))
