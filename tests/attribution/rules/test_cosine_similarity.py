"""``F.cosine_similarity`` and ``nn.CosineSimilarity`` under AttnLRP and CP-LRP, in float64.

Oracle: the same model with the cosine written out by hand, ``(a · b) summed / (max(‖a‖, eps) · max(‖b‖, eps))``
(a spelling other than the rule's own ``normalize(a) · normalize(b)``), which the presets give its norms held and its
product shared; and conservation with the biases zeroed (the held cosine is bilinear in its two inputs, each half of
the score, or all of it for the one input where the other is a constant). The explained output keeps the value of
torch's own kernel. The CNN presets: ``test_held_norm_calls.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import CPLRP, LRP, AttnLRP
from tests.conftest import relative_error

F64 = torch.float64
B = 4
PRESETS = {"AttnLRP": AttnLRP, "CPLRP": CPLRP}


def written_out(a: torch.Tensor, b: torch.Tensor, dim: int = 1, eps: float = 1e-8) -> torch.Tensor:
    """The cosine as users write it: the dot product over each norm clamped at ``eps``, the norms of the inputs
    broadcast to one shape."""
    shape = torch.broadcast_shapes(a.shape, b.shape)
    a, b = a.expand(shape), b.expand(shape)
    norms = a.norm(dim=dim).clamp_min(eps) * b.norm(dim=dim).clamp_min(eps)
    return (a * b).sum(dim) / norms


# How the model compares its two encodings, the encodings (B, 6, 3) and (B, 6, 3): a callable of both.
CALLS = {
    "dim=1": lambda a, b: F.cosine_similarity(a, b),
    "dim=-1": lambda a, b: F.cosine_similarity(a, b, dim=-1),
    "keywords": lambda a, b: F.cosine_similarity(x1=a, x2=b, dim=2, eps=1e-6),
    "module": lambda a, b: nn.CosineSimilarity(dim=-2)(a, b),
    "norm below eps": lambda a, b: F.cosine_similarity(a, b, dim=1, eps=50.0),  # both norms clamped
    "one norm below eps": lambda a, b: F.cosine_similarity(a, 100 * b, dim=1, eps=50.0),
    "broadcast": lambda a, b: F.cosine_similarity(a[:, :, :1], b, dim=1),  # over a dimension it does not reduce
    "broadcast over dim": lambda a, b: F.cosine_similarity(a[:, :1], b, dim=1),  # a's unit repeated six times
}
ORACLES = {
    "dim=1": lambda a, b: written_out(a, b),
    "dim=-1": lambda a, b: written_out(a, b, dim=-1),
    "keywords": lambda a, b: written_out(a, b, dim=2, eps=1e-6),
    "module": lambda a, b: written_out(a, b, dim=-2, eps=1e-8),
    "norm below eps": lambda a, b: written_out(a, b, eps=50.0),
    "one norm below eps": lambda a, b: written_out(a, 100 * b, eps=50.0),
    "broadcast": lambda a, b: written_out(a[:, :, :1], b),
    "broadcast over dim": lambda a, b: written_out(a[:, :1], b),
}


class Siamese(nn.Module):
    """One encoder on two inputs, then their cosine similarity as ``compare`` computes it, and a bias-free head."""

    def __init__(self, compare) -> None:
        super().__init__()
        self.compare = compare
        self.encoder = nn.Sequential(nn.Linear(5, 8, bias=False), nn.ReLU(), nn.Linear(8, 6, bias=False))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a, b = self.encoder(a).transpose(1, 2), self.encoder(b).transpose(1, 2)  # (B, 6, 3)
        return self.compare(a, b)


def models(case: str) -> tuple[Siamese, Siamese]:
    torch.manual_seed(0)
    model = Siamese(CALLS[case]).double()
    oracle = Siamese(ORACLES[case]).double()
    oracle.load_state_dict(model.state_dict())
    return model, oracle


def inputs() -> TensorDict:
    generator = torch.Generator().manual_seed(1)
    a, b = (torch.randn(B, 3, 5, dtype=F64, generator=generator) for _ in range(2))
    return TensorDict(a=a, b=b, batch_size=[B])


def explain(model: nn.Module, mapper, td: TensorDict, **options) -> tuple[TensorDict, list[str]]:
    lrp = LRP(model, mapper, in_keys=["a", "b"], out_keys=["y"], **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = lrp(td.clone())
    return out, [str(w.message) for w in caught]


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("case", sorted(CALLS))
def test_cosine_similarity_gets_the_relevance_of_the_cosine_written_out(case: str, preset: str):
    """Each input gets the relevance the written-out cosine gives it, with no warning, the value is torch's own, and
    the relevance is conserved, each input half of the explained cosine."""
    model, oracle = models(case)
    td, caught = explain(model, PRESETS[preset](), inputs())
    expected, expected_caught = explain(oracle, PRESETS[preset](), inputs())
    assert caught == [] and expected_caught == []
    with torch.no_grad():
        assert relative_error(td["y"], model(*inputs().values())) <= 1e-12  # the same operations, maybe other kernels
    for key in ("a", "b"):
        assert relative_error(td["relevance", key], expected["relevance", key]) <= 1e-10
        share = td["relevance", key].flatten(1).sum(1) / td["y"].amax(-1)
        torch.testing.assert_close(share, torch.full_like(share, 0.5), rtol=0, atol=1e-10)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_cosine_against_a_constant_reference_gives_its_input_all_of_it(preset: str):
    """A learned prototype (a parameter) as the other input: the norms held, the cosine is linear in the one
    activation, which gets all of the score."""
    torch.manual_seed(0)
    prototype = nn.Parameter(torch.randn(6, 1, dtype=F64))

    class Prototype(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(5, 8, bias=False), nn.ReLU(), nn.Linear(8, 6, bias=False))
            self.prototype = prototype

        def forward(self, a: torch.Tensor) -> torch.Tensor:
            return F.cosine_similarity(self.encoder(a).transpose(1, 2), self.prototype, dim=1)

    model = Prototype().double()
    lrp = LRP(model, PRESETS[preset](), in_keys=["a"], out_keys=["y"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        td = lrp(TensorDict(a=inputs()["a"], batch_size=[B]))
    share = td["relevance", "a"].flatten(1).sum(1) / td["y"].amax(-1)
    torch.testing.assert_close(share, torch.ones_like(share), rtol=0, atol=1e-10)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_later_calls_of_a_context_and_a_kept_graph_give_the_first_calls_relevance(preset: str):
    """Calls after the first in one context (which may run without the function mode) and a call that keeps the
    relevance's graph give the relevance of a fresh call; the kept graph's derivative is that of the cosine written
    with ``F.normalize``."""
    model, oracle = models("dim=1")
    oracle.compare = lambda a, b: (F.normalize(a, dim=1) * F.normalize(b, dim=1)).sum(1)
    first, _ = explain(model, PRESETS[preset](), inputs())
    lrp = LRP(model, PRESETS[preset](), in_keys=["a", "b"], out_keys=["y"])
    with lrp:
        calls = [lrp(inputs()) for _ in range(3)]
    for td in calls:
        for key in ("a", "b"):
            assert relative_error(td["relevance", key], first["relevance", key]) <= 1e-12
    td = inputs()
    td["a"].requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kept = LRP(model, PRESETS[preset](), in_keys=["a", "b"], out_keys=["y"], create_graph=True)(td.clone())
    expected_td = inputs()
    expected_td["a"].requires_grad_()
    expected = LRP(oracle, PRESETS[preset](), in_keys=["a", "b"], out_keys=["y"], create_graph=True)(expected_td)
    assert relative_error(kept["relevance", "a"].detach(), first["relevance", "a"]) <= 1e-10
    derivative = torch.autograd.grad(kept["relevance", "b"].pow(2).sum(), td["a"])[0]
    oracle_derivative = torch.autograd.grad(expected["relevance", "b"].pow(2).sum(), expected_td["a"])[0]
    assert relative_error(derivative, oracle_derivative) <= 1e-10


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_the_cosine_written_with_a_product_of_norms_keeps_its_graph_without_a_warning(preset: str):
    """Dividing by the product of the two norms in a call that keeps the relevance's graph: the product of the two
    held norms is a constant, so the division is a linear map that no warning names (it was named, its relevance
    right); the relevance is a fresh call's and its derivative that of the cosine written with ``F.normalize``."""
    _, written = models("dim=1")
    normalized = Siamese(lambda a, b: (F.normalize(a, dim=1) * F.normalize(b, dim=1)).sum(1)).double()
    normalized.load_state_dict(written.state_dict())
    first, _ = explain(written, PRESETS[preset](), inputs())
    derivatives = []
    for model in (written, normalized):
        td = inputs()
        td["a"].requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            kept = LRP(model, PRESETS[preset](), in_keys=["a", "b"], out_keys=["y"], create_graph=True)(td.clone())
        assert relative_error(kept["relevance", "a"].detach(), first["relevance", "a"]) <= 1e-10
        derivatives.append(torch.autograd.grad(kept["relevance", "b"].pow(2).sum(), td["a"])[0])
    assert relative_error(*derivatives) <= 1e-10
