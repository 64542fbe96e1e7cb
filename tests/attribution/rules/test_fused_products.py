"""Products fused with a sum (``torch.addcmul``, ``torch.lerp``) and a batched product with a sum
(``torch.baddbmm``), their gate a sigmoid's output (float64).

A gated update written with them (``torch.lerp(h, n, z)``, ``h.addcmul_(z, n)``) is the update written with ``*``
(``h + z * (n - h)``, ``h + z * n``), whose gate each preset holds. Oracle: that update written out, on the same
layers. They kept their plain gradient, with a warning naming the call (the gate took part of the relevance); the
batched product gave the gate the uniform rule, with no warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP
from tests.attribution.rules.test_filled_constants import MAPPERS, assert_like_apart

Update = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# Each update of ``h`` by ``n`` through the gate ``z``, and the same update written with ``*``
UPDATES: dict[str, tuple[Update, Update]] = {
    "torch.lerp(h, n, z)": (lambda h, n, z: torch.lerp(h, n, z), lambda h, n, z: h + z * (n - h)),
    "h.lerp(n, weight=z)": (lambda h, n, z: h.lerp(n, weight=z), lambda h, n, z: h + z * (n - h)),
    "h.clone().lerp_(n, z)": (lambda h, n, z: h.clone().lerp_(n, z), lambda h, n, z: h + z * (n - h)),
    "torch.addcmul(h, z, n)": (lambda h, n, z: torch.addcmul(h, z, n), lambda h, n, z: h + z * n),
    "torch.addcmul(h, n, z, value=2.0)": (
        lambda h, n, z: torch.addcmul(h, n, z, value=2.0),
        lambda h, n, z: h + 2.0 * (n * z),
    ),
    "torch.addcmul(h, tensor1=z, tensor2=n)": (
        lambda h, n, z: torch.addcmul(h, tensor1=z, tensor2=n),
        lambda h, n, z: h + z * n,
    ),
    "h.clone().addcmul_(z, n)": (lambda h, n, z: h.clone().addcmul_(z, n), lambda h, n, z: h + z * n),
    "torch.baddbmm(h, z, diag(n))": (
        lambda h, n, z: torch.baddbmm(h[:, None], z[:, None], torch.diag_embed(n)).squeeze(1),
        lambda h, n, z: h + z * n,
    ),
}
GATES = {"sigmoid": torch.sigmoid, "relu": torch.relu}


class Updated(nn.Module):
    """``out(update(relu(a(x)), relu(b(x)), gate(c(x))))``, or (``apart``) the update written with ``*``."""

    def __init__(self, update: str, gate: str = "sigmoid", apart: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c, self.out = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 3)
        self.update, self.gate, self.apart = update, gate, apart

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, n, z = torch.relu(self.a(x)), torch.relu(self.b(x)), GATES[self.gate](self.c(x))
        return self.out(UPDATES[self.update][1 if self.apart else 0](h, n, z))


# (A batched matrix product has no rule of the CNN presets: EpsilonPlus names it, and keeps its plain gradient.)
CASES = [
    (update, mapper)
    for update in UPDATES
    for mapper in sorted(MAPPERS)
    if "baddbmm" not in update or mapper != "EpsilonPlus"
]


@pytest.mark.parametrize(("update", "mapper"), CASES)
def test_a_gated_update_fused_in_one_call_holds_its_gate_as_written_with_products(update: str, mapper: str):
    # lerp: 0.76 off, relative L2, under AttnLRP and CP-LRP, 0.18 under EpsilonPlus; addcmul 0.56-0.87 and 0.09-0.13;
    # baddbmm 0.25 under AttnLRP and CP-LRP.
    assert_like_apart(Updated(update).double(), Updated(update, apart=True).double(), mapper)


@pytest.mark.parametrize("mapper", sorted(MAPPERS))
def test_a_fused_update_with_its_gate_held_is_named_no_more(mapper: str):
    model = Updated("torch.lerp(h, n, z)").double()
    lrp = LRP(model, rule_mapper=MAPPERS[mapper](), in_keys=["x"], out_keys=["y"])
    with warnings.catch_warnings(record=True) as caught, lrp:
        warnings.simplefilter("always")
        lrp(TensorDict(x=torch.randn(5, 4, dtype=torch.float64), batch_size=[5]))
    assert not [w for w in caught if "lerp" in str(w.message)], [str(w.message) for w in caught]


@pytest.mark.parametrize("mapper", ["AttnLRP", "CPLRP"])
@pytest.mark.parametrize("update", ["torch.addcmul(h, z, n)", "torch.baddbmm(h, z, diag(n))"])
def test_a_fused_product_of_two_activations_gets_the_uniform_rule(update: str, mapper: str):
    assert_like_apart(Updated(update, "relu").double(), Updated(update, "relu", apart=True).double(), mapper)


def test_a_lerp_whose_weight_is_no_gate_is_still_named():
    model = Updated("torch.lerp(h, n, z)", "relu").double()
    lrp = LRP(model, rule_mapper=MAPPERS["AttnLRP"](), in_keys=["x"], out_keys=["y"])
    with pytest.warns(UserWarning, match=r"lerp \(with a weight computed from activations\)"), lrp:
        lrp(TensorDict(x=torch.randn(5, 4, dtype=torch.float64), batch_size=[5]))
