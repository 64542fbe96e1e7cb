"""The hook that lays out the gradient reaching a norm's output: a norm no gradient reaches is left alone."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.mappers.transformer import CPLRP, AttnLRP
from tdhook.attribution.rules._norm_gradient_layout import laid_out_as
from tests.attribution._helpers import with_statistics
from tests.attribution.rules._helpers import randn


class NormedGate(nn.Module):
    """A squeeze-excite gate whose branch holds a BatchNorm (timm's selective-kernel and split attention do):
    ``y · sigmoid(bn(conv(mean(y))))``, the gate held, so that no gradient reaches the BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.reduce = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 1)
        self.norm, self.head = nn.BatchNorm2d(4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(x))
        gate = torch.sigmoid(self.norm(self.reduce(y.mean((2, 3), keepdim=True))))
        return self.head((y * gate).mean((2, 3)))


@pytest.mark.parametrize("mapper", [AttnLRP, CPLRP])
def test_a_norm_in_a_held_gate_branch_gets_no_gradient_and_no_error(mapper):
    # The hook read the gradient's strides: None there raised AttributeError on every call.
    torch.manual_seed(0)
    model = with_statistics(NormedGate())
    x = randn(2, 3, 5, 5)
    lrp = LRP(TensorDictModule(model, in_keys=["x"], out_keys=["y"]), rule_mapper=mapper())
    with lrp:
        relevances = [lrp(TensorDict(x=x.clone(), batch_size=[2]))["relevance", "x"] for _ in range(2)]
    detached = with_statistics(NormedGate())
    detached.load_state_dict(model.state_dict())
    leaf = x.clone().requires_grad_(True)
    y = torch.relu(detached.conv(leaf))
    gate = torch.sigmoid(detached.norm(detached.reduce(y.mean((2, 3), keepdim=True)))).detach()
    out = detached.head((y * gate).mean((2, 3)))
    (grad,) = torch.autograd.grad(out.max(-1).values.sum(), leaf)
    for relevance in relevances:  # the gate held: LRP-0 through the rest, gradient × input of the gate-detached net
        torch.testing.assert_close(relevance, leaf.detach() * grad, rtol=1e-9, atol=1e-12)


def test_the_hook_passes_none_on():
    assert laid_out_as(torch.Size([2, 3]), (3, 1))(None) is None
