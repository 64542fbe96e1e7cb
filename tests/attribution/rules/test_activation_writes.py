"""Views of a tensor computed from parameters alone, taken before an activation is written into it (float64).

``c = s * torch.ones(...)`` is a constant to the rules (a product with it is linear), and so is a view of it. After
``c.copy_(h)`` (or a write through another view) the view shows an activation: a product ``v * g`` of it and a
sigmoid gate is a product of two activations, as out of place. The view kept its mark: AttnLRP and CP-LRP passed all
of the product's relevance to the gate (1.4 off, max abs, on sums near 2), the CNN presets let the gate keep its plain
gradient (0.08 off, the sigmoid named as if it gated nothing). Oracle: the same model written out of place
(``torch.cat``), its coverage record too. A view of elements no activation was written into stays a constant, and
so does one whose elements a weight's values replaced after the activation (it was taken for an activation: half of
the gate's relevance lost under AttnLRP, 0.5 off in relative L2).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import CPLRP, LRP, AttnLRP, EpsilonAlpha2Beta1, EpsilonPlus

F64 = torch.float64


def _viewed_then_copied(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = s * torch.ones_like(h)
    v = c.view(h.shape)
    c.copy_(h)
    return v * g


def _viewed_then_written_through_another_view(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = s * torch.ones_like(h)
    v = c[:, :3]
    c[:, 1:4].copy_(h[:, 1:4])
    return v * g[:, :3]


def _viewed_then_set(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = s * torch.ones_like(h)
    v = c.T
    c[:, :2] = h[:, :2]
    return v.T * g


def _part_not_written(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = s * torch.ones_like(h)
    v = c[:, 3:]
    c[:, :3] = h[:, :3]
    return v * g[:, 3:]


def _added(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = s * torch.ones_like(h)
    v = c.view(h.shape)
    c.add_(h)
    return v * g


def _written_then_weight_again(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = s * torch.ones_like(h)
    v = c.view(h.shape)
    c.copy_(h)
    c.copy_(3 * s * torch.ones_like(h))  # every element a weight's again
    return v * g


def _written_then_set_to_a_weight(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = s * torch.ones_like(h)
    v = c[:, :3]
    c.copy_(h)
    c[...] = 3 * s * torch.ones_like(h)
    return v * g[:, :3]


def _activation_viewed_then_copied_over(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = h.clone()
    v = c[:, :2]
    c.copy_(3 * s * torch.ones_like(h))  # every element a weight's: v shows one
    return v * g[:, :2]


def _activation_viewed_then_set(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = h.clone()
    v = c.T
    c[...] = 3 * s * torch.ones_like(h)
    return v.T * g


def _written_region_set_to_a_weight(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = s * torch.ones_like(h)
    v = c[:, :3]
    c[:, :3] = h[:, :3]
    c[:, :3] = 3 * s * torch.ones_like(h[:, :3])  # the region the activation went to, a weight's again
    return v * g[:, :3]


def _written_region_set_to_a_weight_whole(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = s * torch.ones_like(h)
    v = c[:, 1:]
    c[:, :3] = h[:, :3]
    c[:, :3] = 3 * s * torch.ones_like(h[:, :3])
    return c * g + v.sum(1, keepdim=True)  # the tensor itself: no activation left in it


def _activation_set_in_part(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = h.clone()
    v = c[:, :3]
    c[:, :3] = 3 * s * torch.ones_like(h[:, :3])
    return (v * g[:, :3]).sum(1, keepdim=True) + c * g  # c still holds the activation's other columns


def _view_copied_over(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = h.clone()
    v = c[:, :3]
    v.copy_(3 * s * torch.ones_like(v))  # written through the view itself
    return v * g[:, :3]


def _chain_of_views_copied_over(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = h.clone()
    v = c.unflatten(1, (2, 3)).mT.view_as(torch.empty(5, 3, 2)).as_strided((5, 2, 3), (6, 3, 1))[:, :1]
    c.view(-1).copy_(3 * s * torch.ones_like(h).reshape(-1))  # through another view
    return v.flatten(1) * g[:, :3]


def _weighted_then_activation_added(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = h.clone()
    v = c[:, :2]
    c[:, :2] = 3 * s * torch.ones_like(h[:, :2])
    c.add_(h)  # an activation into every element again
    return v * g[:, :2]


def _real_view_of_a_complex_activation(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = torch.view_as_complex(h.clone().view(5, 3, 2))  # a view of the clone, as a dtype twice the size
    v = torch.view_as_real(c)[:, :1]
    c.copy_(torch.view_as_complex((3 * s * torch.ones_like(h)).view(5, 3, 2)))
    return v.flatten(1) * g[:, :2]


def _computed_from_a_view_of_an_activation(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = h.clone()
    v = c[:, :2]
    c.copy_(3 * s * torch.ones_like(h))
    return (v * 2) * g[:, :2]  # computed from what v shows: a weight


def _computed_from_a_view_of_a_weight(s: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    c = s * torch.ones_like(h)
    v = c[:, :2]
    c.copy_(h)
    return torch.cat([v * 2, v.reshape(10).reshape(5, 2)], 1) * g[:, :4]  # from what v shows: an activation


# Each form, with the same computation out of place (``s`` a learned scalar, ``h`` an activation, ``g`` a gate).
FORMS = {
    "v = c.view(...); c.copy_(h)": (_viewed_then_copied, lambda s, h, g: h * g),
    "v = c[:, :3]; c[:, 1:4].copy_(h[:, 1:4])": (
        _viewed_then_written_through_another_view,
        lambda s, h, g: torch.cat([s * torch.ones_like(h[:, :1]), h[:, 1:3]], 1) * g[:, :3],
    ),
    "v = c.T; c[:, :2] = h[:, :2]": (
        _viewed_then_set,
        lambda s, h, g: torch.cat([h[:, :2], s * torch.ones_like(h[:, 2:])], 1) * g,
    ),
    "v = c.view(...); c.add_(h)": (_added, lambda s, h, g: (s * torch.ones_like(h) + h) * g),
    "v = c.view(...); c.copy_(h); c.copy_(3s) (a weight again)": (
        _written_then_weight_again,
        lambda s, h, g: (3 * s * torch.ones_like(h)) * g,
    ),
    "v = c[:, :3]; c.copy_(h); c[...] = 3s (a weight again)": (
        _written_then_set_to_a_weight,
        lambda s, h, g: (3 * s * torch.ones_like(h[:, :3])) * g[:, :3],
    ),
    "v = h.clone()[:, :2]; c.copy_(3s)": (
        _activation_viewed_then_copied_over,
        lambda s, h, g: (3 * s * torch.ones_like(h[:, :2])) * g[:, :2],
    ),
    "v = h.clone().T; c[...] = 3s": (_activation_viewed_then_set, lambda s, h, g: (3 * s * torch.ones_like(h)) * g),
    "v = c[:, :3]; c[:, :3] = h; c[:, :3] = 3s": (
        _written_region_set_to_a_weight,
        lambda s, h, g: (3 * s * torch.ones_like(h[:, :3])) * g[:, :3],
    ),
    "c[:, :3] = h; c[:, :3] = 3s (c itself)": (
        _written_region_set_to_a_weight_whole,
        lambda s, h, g: (
            torch.cat([3 * s * torch.ones_like(h[:, :3]), s * torch.ones_like(h[:, 3:])], 1) * g
            + torch.cat([3 * s * torch.ones_like(h[:, 1:3]), s * torch.ones_like(h[:, 3:])], 1).sum(1, keepdim=True)
        ),
    ),
    "v = h.clone()[:, :3]; c[:, :3] = 3s": (
        _activation_set_in_part,
        lambda s, h, g: (
            ((3 * s * torch.ones_like(h[:, :3])) * g[:, :3]).sum(1, keepdim=True)
            + torch.cat([3 * s * torch.ones_like(h[:, :3]), h[:, 3:]], 1) * g
        ),
    ),
    "v = h.clone()[:, :3]; v.copy_(3s)": (
        _view_copied_over,
        lambda s, h, g: (3 * s * torch.ones_like(h[:, :3])) * g[:, :3],
    ),
    "v = c.unflatten().mT.view_as().as_strided()[:, :1]; c.view(-1).copy_(3s)": (
        _chain_of_views_copied_over,
        lambda s, h, g: (3 * s * torch.ones_like(h[:, :3])) * g[:, :3],
    ),
    "v = h.clone()[:, :2]; c[:, :2] = 3s; c.add_(h)": (
        _weighted_then_activation_added,
        lambda s, h, g: (3 * s * torch.ones_like(h[:, :2]) + h[:, :2]) * g[:, :2],
    ),
    "v = view_as_real(c)[:, :1]; c.copy_(3s) (c complex)": (
        _real_view_of_a_complex_activation,
        lambda s, h, g: (3 * s * torch.ones_like(h[:, :2])) * g[:, :2],
    ),
    "v = h.clone()[:, :2]; c.copy_(3s); v * 2": (
        _computed_from_a_view_of_an_activation,
        lambda s, h, g: (3 * s * torch.ones_like(h[:, :2]) * 2) * g[:, :2],
    ),
    "v = c[:, :2]; c.copy_(h); cat([v * 2, v.reshape()])": (
        _computed_from_a_view_of_a_weight,
        lambda s, h, g: torch.cat([h[:, :2] * 2, h[:, :2]], 1) * g[:, :4],
    ),
    "v = c[:, 3:]; c[:, :3] = h[:, :3] (v not written)": (
        _part_not_written,
        lambda s, h, g: (s * torch.ones_like(h[:, 3:])) * g[:, 3:],
    ),
}


class Gated(nn.Module):
    """``out(form(s, p(x), sigmoid(q(x))))``."""

    def __init__(self, form) -> None:
        super().__init__()
        self.p, self.q = nn.Linear(4, 6), nn.Linear(4, 6)
        self.out = nn.LazyLinear(3)
        self.s = nn.Parameter(torch.tensor(0.7))
        self.form = form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.form(self.s, self.p(x), torch.sigmoid(self.q(x))))


def _explained(form, preset) -> tuple[torch.Tensor, list[str]]:
    torch.manual_seed(0)
    model = Gated(form).to(F64)
    x = torch.randn(5, 4, dtype=F64)
    model(x)  # the lazy layer's shape
    lrp = LRP(model, preset(), in_keys=["x"], out_keys=["y"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        relevance = lrp(TensorDict(x=x, batch_size=[5]))["relevance", "x"]
    return relevance, [c.function for c in lrp.coverage().plain_gradient]


def assert_explained_as_out_of_place(in_place, out_of_place, preset) -> None:
    """The relevance and the calls left their plain gradient of the model with ``in_place`` equal those with
    ``out_of_place`` (float64, ≤ 1e-12)."""
    relevance, calls = _explained(in_place, preset)
    expected, expected_calls = _explained(out_of_place, preset)
    assert calls == expected_calls
    torch.testing.assert_close(relevance, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("preset", [AttnLRP, CPLRP, EpsilonPlus, EpsilonAlpha2Beta1], ids=lambda p: p.__name__)
@pytest.mark.parametrize("name", sorted(FORMS))
def test_a_view_taken_before_an_activation_is_written_shows_an_activation(name: str, preset):
    assert_explained_as_out_of_place(*FORMS[name], preset)
