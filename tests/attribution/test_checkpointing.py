"""torch.utils.checkpoint in a model's own forward: exact under module rules (use_reentrant=False), refused by
name where a function rule would be recomputed without its mode, and named where the region is re-entrant."""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.rules import CPLRP, AttnLRP, EpsilonGammaBox, EpsilonPlus, EpsilonPlusFlat
from tests.attribution.test_lrp_reliability import assert_model_unchanged, model_snapshot
from tests.conftest import relative_error

F64 = torch.float64


class Checkpointed(nn.Module):
    """``head(block(x))`` with ``block`` run as ``how`` says: directly, or under one of torch's checkpoints."""

    def __init__(self, block: nn.Module, head: nn.Module, how: str = "direct") -> None:
        super().__init__()
        self.block, self.head, self.how = block, head, how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "direct":
            hidden = self.block(x)
        elif self.how == "sequential":
            hidden = checkpoint_sequential(self.block, 2, x, use_reentrant=False)
        else:
            hidden = checkpoint(self.block, x, use_reentrant=self.how == "reentrant")
        return self.head(hidden.flatten(1))


def relevance(model: nn.Module, x: torch.Tensor, mapper, calls: int = 2) -> list[torch.Tensor]:
    lrp = LRP(model, rule_mapper=mapper, in_keys=["x"], out_keys=["y"])
    with lrp:  # the first call of a context watches; the later ones do not
        return [lrp(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))["relevance", "x"] for _ in range(calls)]


def cnn(how: str) -> Checkpointed:
    torch.manual_seed(0)
    block = nn.Sequential(
        nn.Conv1d(2, 4, 3, padding=1), nn.BatchNorm1d(4), nn.ReLU(inplace=True), nn.Conv1d(4, 4, 3, padding=1)
    )
    with torch.no_grad():
        block[1].running_mean.normal_()
        block[1].running_var.uniform_(0.5, 2.0)
    return Checkpointed(block, nn.Linear(32, 3), how).to(F64).eval()


class TestModuleRulesAreRecomputed:
    """Without re-entrance the recomputation runs the module rules' hooks again: the relevance is that of the model
    run directly, bit for bit (that one is checked against zennit elsewhere)."""

    @pytest.mark.parametrize("preset", ["EpsilonPlus", "EpsilonPlusFlat", "EpsilonGammaBox"])
    @pytest.mark.parametrize("how", ["checkpoint", "sequential"])
    def test_equals_the_model_run_directly(self, how: str, preset: str):
        make = {"EpsilonPlus": EpsilonPlus, "EpsilonPlusFlat": EpsilonPlusFlat}.get(preset)
        mapper = make or (lambda: EpsilonGammaBox(-3.0, 3.0))
        x = torch.randn(3, 2, 8, dtype=F64)
        x[x.abs() < 0.4] = 0.0  # the input-layer rules record relevance where the input is 0
        expected = relevance(cnn("direct"), x, mapper())
        for actual, wanted in zip(relevance(cnn(how), x, mapper()), expected, strict=True):
            torch.testing.assert_close(actual, wanted, rtol=0, atol=0)


class Attention(nn.Module):
    """Single-head self-attention with a sigmoid gate, written with functions (what AttnLRP's modes rewrite)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(self.q(x) @ self.k(x).transpose(1, 2), -1)
        return self.out(x + weights @ self.v(x) * torch.sigmoid(x))


class Gated(nn.Module):
    """A convolution gated by a function (``h * sigmoid(fc(h))``): the CNN presets hold the gate by a mode."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc, self.out = nn.Conv1d(2, 4, 3, padding=1), nn.Linear(8, 8), nn.Conv1d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x))
        return self.out(h * torch.sigmoid(self.fc(h)))


class TestFunctionRulesAreRefused:
    """A function mode is on during the wrapper's forward pass only: the recomputation would run the plain
    functions, whose saved tensors the rules' backward then reads by position (AttnLRP was 10 % off here, silently;
    CP-LRP, held gates and stabilised additions stopped in torch's CheckpointError, and would be silently wrong
    where the shapes agree). Such a call is refused, naming the module, and the model is left as it was."""

    @pytest.mark.parametrize(
        ("make", "block", "shape", "features"),
        [
            (AttnLRP, Attention, (2, 5, 8), 40),
            (CPLRP, Attention, (2, 5, 8), 40),
            (EpsilonPlus, Gated, (2, 2, 8), 32),
            (lambda: EpsilonPlus(stabilize_additions=True), Attention, (2, 5, 8), 40),
        ],
        ids=["AttnLRP", "CPLRP", "held-gate", "stabilised-additions"],
    )
    def test_refused_naming_the_module(self, make, block, shape, features):
        torch.manual_seed(0)
        model = Checkpointed(block(), nn.Linear(features, 3), "checkpoint").to(F64).eval()
        x = torch.randn(*shape, dtype=F64)
        direct = Checkpointed(model.block, model.head, "direct")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # EpsilonPlus names the attention's plain-gradient calls
            relevance(direct, x, make(), calls=1)  # runs directly
        before = model_snapshot(model)
        with pytest.raises(ValueError, match="runs inside torch.utils.checkpoint") as caught, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            relevance(model, x, make(), calls=1)
        assert any("'block'" in note for note in caught.value.__notes__)
        assert_model_unchanged(model, before)

    def test_module_rules_of_a_transformer_are_not_refused(self):
        # Linear layers only, without function modes: the recomputation is exact (LRP-0 = gradient x input here).
        torch.manual_seed(0)
        model = Checkpointed(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(40, 3), "checkpoint").to(F64)
        x = torch.randn(2, 5, 8, dtype=F64, requires_grad=True)
        (actual,) = relevance(model, x.detach(), None, calls=1)
        out = model(x)
        expected = x * torch.autograd.grad(out.max(-1).values.sum(), x)[0]
        assert relative_error(actual, expected) <= 1e-12


class TestReentrantRegions:
    """A re-entrant region runs without gradients, and torch.autograd.grad cannot take its backward: the error
    names the checkpointed module instead of torch's message alone."""

    def test_the_error_names_the_module(self):
        model = cnn("reentrant")
        before = model_snapshot(model)
        pattern = r"module 'block' \(Sequential\) runs in a region checkpointed"
        with pytest.raises(ValueError, match=pattern), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the coverage watch names the checkpoint's autograd Function first
            relevance(model, torch.randn(3, 2, 8, dtype=F64), EpsilonPlus(), calls=1)
        assert_model_unchanged(model, before)
