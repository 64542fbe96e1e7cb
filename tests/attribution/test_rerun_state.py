"""A call run again when its graph is not its plan's: the buffers its model writes move once, as in a plain call.

The oracle is the same model called plainly on the same inputs, in float64: its outputs and its buffers.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import CPLRP, LRP, AttnLRP

F64 = torch.float64


class CountingProduct(nn.Module):
    """Counts its calls and keeps a running mean of its input in buffers of its own, which the output reads; a flag
    detaches one factor of a product, so calls with and without it differ in their graph."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("mean", torch.zeros(4))

    def forward(self, x: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        with torch.no_grad():
            self.mean.mul_(0.5).add_(0.5 * x.mean(0))
        g = self.b(x)
        return self.out(self.a(x - self.mean) * (g.detach() if bool(flag.any()) else g))


def calls_of(flags: list[bool]) -> list[TensorDict]:
    torch.manual_seed(1)
    return [
        TensorDict(x=torch.randn(3, 4, dtype=F64), flag=torch.tensor([flag]).expand(3), batch_size=[3])
        for flag in flags
    ]


def explained_and_plain(model: nn.Module, preset: type, calls: list[TensorDict]) -> tuple[list, nn.Module]:
    plain = type(model)().to(F64)
    plain.load_state_dict(model.state_dict())
    lrp = LRP(TensorDictModule(model, in_keys=["x", "flag"], out_keys=["y"]), preset(), in_keys=["x"])
    pairs = []
    with lrp:
        for td in calls:
            out = lrp(td.clone())
            pairs.append((out["y"], plain(td["x"], td["flag"])))
    return pairs, plain


@pytest.mark.parametrize("preset", [AttnLRP, CPLRP])
def test_a_call_run_again_writes_a_modules_own_buffers_once(preset):
    # The run let go counted the call and moved the mean: `calls` ran ahead of the plain calls' and the output, which
    # reads the mean, was that of a mean moved twice.
    torch.manual_seed(0)
    model = CountingProduct().to(F64)
    pairs, plain = explained_and_plain(model, preset, calls_of([False, True, False, True, False, True]))
    assert int(model.calls) == int(plain.calls) == 6
    torch.testing.assert_close(model.mean, plain.mean, rtol=1e-12, atol=1e-12)
    for explained, expected in pairs:
        torch.testing.assert_close(explained, expected, rtol=1e-12, atol=1e-12)


class StepsOnFlag(CountingProduct):
    """Counts only the calls with the flag: the first call, which records the plan, does not write the count."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
        if bool(flag.any()):
            self.steps += 1
        g = self.b(x)
        return self.out(self.a(x) * (g.detach() if bool(flag.any()) else g))


def test_a_buffer_no_earlier_call_wrote_is_named_where_the_run_let_go_writes_it():
    torch.manual_seed(0)
    model = StepsOnFlag().to(F64)
    warned = r"run let go wrote the buffers 'module.steps' in place, which no earlier call"
    with pytest.warns(UserWarning, match=warned):
        _, plain = explained_and_plain(model, AttnLRP, calls_of([False, False, True]))
    assert int(model.steps) == int(plain.steps) + 1 == 2  # moved twice in the call warned of, not silently
