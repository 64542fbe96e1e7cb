"""Faults inside an open context: parameters changed between calls, non-finite samples, interrupts, copies.

Each test states what a user does inside ``with lrp:`` and checks that the
result is the one a fresh context (or a batch without the faulty sample) gives,
or that nothing of the context is left behind.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.rules import (
    EpsilonAlpha2Beta1,
    EpsilonAlpha2Beta1Flat,
    EpsilonGammaBox,
    EpsilonPlus,
    EpsilonPlusFlat,
    FirstLayerRule,
    WSquareRule,
)

F64 = torch.float64

PRESETS = {
    "EpsilonPlus": EpsilonPlus,
    "EpsilonPlusFlat": EpsilonPlusFlat,
    "EpsilonGammaBox": lambda: EpsilonGammaBox(-3.0, 3.0),
    "EpsilonAlpha2Beta1": EpsilonAlpha2Beta1,
    "EpsilonAlpha2Beta1Flat": EpsilonAlpha2Beta1Flat,
    "WSquare first": lambda: EpsilonPlus(
        rule_mapper=lambda name, module: FirstLayerRule(WSquareRule()) if name in ("0", "6") else None
    ),
}


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 6),
        nn.ReLU(),
        nn.Linear(6, 3),
    ).to(F64)
    with torch.no_grad():
        model[1].running_mean.normal_()
        model[1].running_var.uniform_(0.5, 2.0)
    return model.eval()


def explain(lrp: LRP, x: torch.Tensor) -> torch.Tensor:
    return lrp(TensorDict(x=x, batch_size=[len(x)]))["relevance", "x"]


def change_parameters(model: nn.Module, how: str) -> None:
    if how in ("sgd", "adam"):
        optimizer = (
            torch.optim.SGD(model.parameters(), lr=0.5)
            if how == "sgd"
            else torch.optim.Adam(model.parameters(), lr=0.5, foreach=True)
        )
        generator = torch.Generator().manual_seed(1)
        for param in model.parameters():  # as a training step would leave them
            param.grad = torch.randn(param.shape, dtype=param.dtype, generator=generator)
        optimizer.step()
    elif how == "in place":
        with torch.no_grad():
            for module in model:
                if isinstance(module, (nn.Conv2d, nn.Linear)):
                    module.weight.mul_(-2.0)
            model[1].running_var.mul_(3.0)
    elif how == "replaced":
        for module in model:
            if isinstance(module, (nn.Conv2d, nn.Linear, nn.BatchNorm2d)):
                module.weight = nn.Parameter(module.weight.detach() * -1.5 + 0.1)
    elif how == "data":
        for module in model:
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                module.weight.data = module.weight.detach().flip(0).clone()


@pytest.mark.parametrize("how", ["sgd", "adam", "in place", "replaced", "data"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_rules_follow_parameters_changed_inside_the_context(preset: str, how: str):
    model = small_cnn()
    x = torch.randn(5, 3, 6, 6, dtype=F64)
    lrp = LRP(model, PRESETS[preset](), in_keys=["x"], out_keys=["y"])
    with lrp:
        before = explain(lrp, x)
        change_parameters(model, how)
        after = explain(lrp, x)
    fresh = explain(LRP(model, PRESETS[preset](), in_keys=["x"], out_keys=["y"]), x)
    assert not torch.allclose(before, fresh)  # the change matters
    torch.testing.assert_close(after, fresh, rtol=1e-12, atol=1e-12)


def small_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).to(F64)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("preset", ["EpsilonPlus", "EpsilonPlusFlat", "EpsilonGammaBox", "EpsilonAlpha2Beta1"])
@pytest.mark.parametrize("net", ["cnn", "mlp"])
def test_a_non_finite_sample_leaves_the_other_samples_relevance_alone(net: str, preset: str, bad: float):
    model = small_cnn() if net == "cnn" else small_mlp()
    torch.manual_seed(1)
    x = torch.randn((6, 3, 6, 6) if net == "cnn" else (6, 5), dtype=F64)
    x[1] = x[1].abs()  # a sample without negative entries beside others with some
    lrp = LRP(model, PRESETS[preset](), in_keys=["x"], out_keys=["y"])
    for bad_sample, whole in ((0, False), (3, False), (5, True)):
        faulty = x.clone()
        if whole:
            faulty[bad_sample] = bad  # the whole sample
        else:
            faulty[bad_sample].view(-1)[2] = bad  # one entry
        finite = [i for i in range(len(x)) if i != bad_sample]
        expected = explain(lrp, x[finite])
        with lrp:
            actual = explain(lrp, faulty)
        torch.testing.assert_close(actual[finite], expected, rtol=1e-9, atol=1e-12)
