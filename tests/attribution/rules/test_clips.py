"""Clipping calls pass relevance on as ``nn.Hardtanh`` and ``nn.ReLU6`` modules do, whichever the spelling, under the
CNN presets too (the transformer presets: ``test_functional.py``)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP, EpsilonAlpha2Beta1, EpsilonPlus, EpsilonPlusFlat, UniformEpsilon
from tests.conftest import relative_error

F64 = torch.float64

SPELLINGS = {
    "nn.Hardtanh": lambda block, h: block.hardtanh(h),
    "torch.clamp": lambda block, h: torch.clamp(h, -1.0, 1.0),
    "Tensor.clamp": lambda block, h: h.clamp(min=-1.0, max=1.0),
    "Tensor.clamp_": lambda block, h: h.clamp_(-1.0, 1.0),
    "torch.clip": lambda block, h: torch.clip(h, -1.0, 1.0),
    "F.hardtanh": lambda block, h: F.hardtanh(h),
    "F.hardtanh in place": lambda block, h: F.hardtanh(h, inplace=True),
    "nn.ReLU6": lambda block, h: block.relu6(h * 3.0) / 3.0,
    "F.relu6": lambda block, h: F.relu6(h * 3.0) / 3.0,
    "Tensor.clamp, 0 to 6": lambda block, h: (h * 3.0).clamp(0.0, 6.0) / 3.0,
}
PRESETS = {
    "EpsilonPlus": EpsilonPlus,
    "UniformEpsilon": UniformEpsilon,
    "EpsilonPlusFlat": EpsilonPlusFlat,
    "EpsilonAlpha2Beta1": EpsilonAlpha2Beta1,
}


class Block(nn.Module):
    """A Linear layer and a clip in one module's own forward (the clip is no module of its own but for the module
    spellings), then a Linear head."""

    def __init__(self, spelling: str) -> None:
        super().__init__()
        self.first, self.head = nn.Linear(4, 6, bias=False), nn.Linear(6, 3, bias=False)
        self.hardtanh, self.relu6, self.spelling = nn.Hardtanh(), nn.ReLU6(), spelling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(SPELLINGS[self.spelling](self, self.first(x)))


def _relevances(spelling: str, preset: str, x: torch.Tensor, calls: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(0)
    lrp = LRP(Block(spelling).to(F64), PRESETS[preset](), in_keys=["x"], out_keys=["y"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with lrp:
            return [lrp(TensorDict(x=x.clone(), batch_size=[len(x)]))["relevance", "x"] for _ in range(calls)]


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("spelling", sorted(set(SPELLINGS) - {"nn.Hardtanh", "nn.ReLU6"}))
def test_a_clipping_call_passes_relevance_on_as_the_module_does(spelling: str, preset: str):
    """A clip called as a function in a module's own forward kept its plain gradient under the CNN presets, where
    ``nn.Hardtanh`` and ``nn.ReLU6`` get the pass rule: the two spellings of one computation disagreed, 0.44 to 0.86
    relative (EpsilonPlus, UniformEpsilon), and units clipped at a bound other than zero lost their relevance. The
    call gets the module's pass rule, in every call of a context."""
    torch.manual_seed(0)
    x = torch.randn(5, 4, dtype=F64) * 3
    module = "nn.ReLU6" if "6" in spelling else "nn.Hardtanh"
    (expected, *_) = _relevances(module, preset, x, calls=1)
    for relevance in _relevances(spelling, preset, x):
        assert relative_error(relevance, expected) <= 1e-12
    if preset == "EpsilonPlus":  # the plain gradient (ε = 1e-6 on the layers) gives another: the test can fail
        torch.manual_seed(0)
        block, leaf = Block(spelling).to(F64), x.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(block(leaf).max(-1).values.sum(), leaf)
        assert relative_error(leaf.detach() * grad, expected) > 0.1


class DividedByNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.head = nn.Linear(4, 6, bias=False), nn.Linear(6, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        return self.head(h / torch.clamp(h.norm(dim=-1, keepdim=True), min=1e-6))


def test_a_clip_that_guards_a_divisor_keeps_its_plain_gradient():
    """A norm kept away from zero is no activation's clip: where it is below the bound, ``h / eps`` is linear and its
    plain gradient is LRP-0 (the pass rule there would hand the numerator's relevance back to the norm)."""
    torch.manual_seed(0)
    model, x = DividedByNorm().to(F64), torch.randn(5, 4, dtype=F64) * 1e-8
    leaf = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(model(leaf).max(-1).values.sum(), leaf)
    lrp = LRP(model, EpsilonPlus(epsilon=0.0), in_keys=["x"], out_keys=["y"])
    with pytest.warns(UserWarning, match="plain gradient is used"):  # the norm and the division
        relevance = lrp(TensorDict(x=x.clone(), batch_size=[5]))["relevance", "x"]
    assert relative_error(relevance, x * grad) <= 1e-9
