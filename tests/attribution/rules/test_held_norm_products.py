"""Held norms that reach a product of two activations, under the CNN presets, in float64.

The CNN presets hold the norms of ``F.normalize`` and ``F.cosine_similarity`` (see
``tests/attribution/rules/test_held_norm_calls.py``), and have no rule for a product of two activations: its plain
gradient gives each factor the whole product's relevance. A cosine attention (``normalize(q) @ normalize(k)^T``,
Swin V2's) with its norms held would create relevance; its normalisations keep their plain gradient instead (a
scale-invariant map: the relevance through the attention scores sums to zero, as before the held norms), and the
warning names them with the product. A norm whose output reaches no such product stays held.

Oracles: conservation with the biases zeroed (the attention's values carry the whole relevance), and LRP-0 (ε = 0
on every layer) equal to gradient × input of the same model with the norms that stay held detached and the others
as written (the closed form).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import (
    LRP,
    IgnoreRule,
    UniformEpsilon,
)
from tests.attribution.rules.test_held_norm_calls import PRESETS
from tests.conftest import relative_error

F64 = torch.float64


def scores(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, form: str) -> torch.Tensor:
    """A cosine attention's output: ``softmax(τ · q̂ k̂^T) v`` with ``q̂ @ k̂^T`` written in ``form``."""
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    if form == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, scale=4.0)
    logits = {
        "matmul": lambda: q @ k.transpose(-2, -1),
        "keywords": lambda: torch.matmul(input=q, other=k.transpose(-2, -1)),
        "bmm": lambda: torch.bmm(q, k.transpose(-2, -1)),
        "einsum": lambda: torch.einsum("bid,bjd->bij", q, k),
        "mul": lambda: (q.unsqueeze(2) * k.unsqueeze(1)).sum(-1),
    }[form]()
    return torch.softmax(4.0 * logits, -1) @ v


FORMS = ["matmul", "keywords", "bmm", "einsum", "mul", "sdpa"]


class CosineAttention(nn.Module):
    """Tokens through a Linear and ReLU, one head of cosine attention, mean pooling, a head; bias-free. With
    ``embed``, the head's output is normalised too (an embedding network's last call)."""

    def __init__(self, form: str, embed: bool = False) -> None:
        super().__init__()
        self.tokens = nn.Sequential(nn.Linear(6, 8, bias=False), nn.ReLU())
        self.qkv = nn.Linear(8, 24, bias=False)
        self.head = nn.Linear(8, 4, bias=False)
        self.form, self.embed = form, embed

    def forward(self, x: torch.Tensor, detach_last: bool = False) -> torch.Tensor:
        h = self.tokens(x)
        q, k, v = self.qkv(h).chunk(3, -1)
        y = self.head(scores(q, k, v, self.form).mean(1))
        if not self.embed:
            return y
        if detach_last:  # the closed form of the held norm
            return y / y.norm(dim=-1, keepdim=True).clamp_min(1e-12).detach()
        return F.normalize(y, dim=-1)


def tokens() -> TensorDict:
    generator = torch.Generator().manual_seed(1)
    return TensorDict({"x": torch.randn(3, 5, 6, dtype=F64, generator=generator)}, [3])


def seeded(model_class, *args, **kwargs) -> nn.Module:
    torch.manual_seed(0)
    return model_class(*args, **kwargs).double()


def explain_twice(model: nn.Module, mapper) -> tuple[list[TensorDict], list[str]]:
    """Two calls in one context (the later one decided by the first), and the warnings of both."""
    lrp = LRP(model, mapper, in_keys=["x"], out_keys=["y"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with lrp:
            calls = [lrp(tokens()) for _ in range(2)]
    return calls, [str(w.message) for w in caught]


def target_score(y: torch.Tensor) -> torch.Tensor:
    return y.gather(-1, y.argmax(-1, keepdim=True)).squeeze(-1)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("form", FORMS)
def test_a_cosine_attention_conserves_and_names_its_normalize(form: str, preset: str):
    """Its normalisations keep their plain gradient: the relevance sums to the logit (held, it was created), and
    the warning names ``normalize`` with the product, in later calls of a context too."""
    model = seeded(CosineAttention, form)
    calls, caught = explain_twice(model, PRESETS[preset]())
    assert any("normalize" in message for message in caught), caught
    for td in calls:
        torch.testing.assert_close(td["y"], model(tokens()["x"]), rtol=1e-12, atol=0)
        torch.testing.assert_close(td["relevance", "x"].flatten(1).sum(1), target_score(td["y"]), rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("form", FORMS)
def test_lrp0_of_an_embedding_after_a_cosine_attention_holds_its_last_norm_alone(form: str):
    """LRP-0 is gradient × input of the model with the last ``F.normalize``'s norm detached and the attention's
    normalisations as written: the one held, the others given back their plain gradient."""
    model = seeded(CosineAttention, form, embed=True)
    calls, _ = explain_twice(model, UniformEpsilon(epsilon=0.0, stabilizer=0.0))
    x = tokens()["x"].requires_grad_()
    score = target_score(model(x, detach_last=True))
    expected = x * torch.autograd.grad(score.sum(), x)[0]
    for td in calls:
        assert relative_error(td["relevance", "x"], expected) <= 1e-10


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_an_embedding_after_a_cosine_attention_conserves_its_unit(preset: str):
    """The normalised embedding's explained unit: the last norm held, its relevance sums to the unit's value."""
    model = seeded(CosineAttention, "matmul", embed=True)
    calls, _ = explain_twice(model, PRESETS[preset]())
    for td in calls:
        torch.testing.assert_close(td["relevance", "x"].flatten(1).sum(1), target_score(td["y"]), rtol=1e-8, atol=1e-12)


class Scaled(nn.Module):
    """An embedding normalised, then multiplied by what holds no relevance of its own: a gate (held by the CNN
    presets), a learned scale, or normalised learned prototypes (a CLIP-style logit)."""

    def __init__(self, by: str) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(6, 8, bias=False), nn.ReLU(), nn.Linear(8, 8, bias=False))
        self.gate = nn.Linear(6, 8, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(1.5))
        self.prototypes = nn.Parameter(torch.randn(4, 8))
        self.by = by

    def forward(self, x: torch.Tensor, detach: bool = False) -> torch.Tensor:
        h = self.encoder(x)
        e = h / h.norm(dim=-1, keepdim=True).detach() if detach else F.normalize(h, dim=-1)
        if self.by == "gate":
            gate = torch.sigmoid(self.gate(x))
            return e * (gate.detach() if detach else gate)
        return self.logit_scale.exp() * e @ F.normalize(self.prototypes, dim=-1).T


@pytest.mark.parametrize("by", ["gate", "prototypes"])
def test_a_norm_whose_product_is_linear_in_it_stays_held(by: str):
    """A product with a held gate or with parameters is linear in the embedding: its norm stays held, and LRP-0 is
    gradient × input with the norm (and the gate) detached, in later calls of a context too."""
    model = seeded(Scaled, by)
    generator = torch.Generator().manual_seed(2)
    td = TensorDict({"x": torch.randn(3, 6, dtype=F64, generator=generator)}, [3])
    lrp = LRP(model, UniformEpsilon(epsilon=0.0, stabilizer=0.0), in_keys=["x"], out_keys=["y"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with lrp:
            calls = [lrp(td.clone()) for _ in range(2)]
    x = td["x"].clone().requires_grad_()
    score = target_score(model(x, detach=True))
    expected = x * torch.autograd.grad(score.sum(), x)[0]
    for out in calls:
        assert relative_error(out["relevance", "x"], expected) <= 1e-10


class SelfAttend(nn.Module):
    """Attention of its input with itself, ``softmax(τ e e^T) e``: products of two activations."""

    def forward(self, e: torch.Tensor) -> torch.Tensor:
        return torch.softmax(4.0 * e @ e.transpose(-2, -1), -1) @ e


class NormalisedTokens(nn.Module):
    """Tokens normalised, then attended by :class:`SelfAttend`, pooled and read by a head; bias-free."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Sequential(nn.Linear(6, 8, bias=False), nn.ReLU())
        self.attend = SelfAttend()
        self.head = nn.Linear(8, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attend(F.normalize(self.tokens(x), dim=-1)).mean(1))


def test_a_norm_entering_a_module_mapped_to_ignore_rule_gets_its_plain_gradient_back():
    """The caller maps the attending module to IgnoreRule: its products, run with the modes paused, are not seen,
    so the norm that enters it keeps its plain gradient, named in the warning; LRP-0 is gradient × input of the
    model as written, in later calls of a context too."""
    model = seeded(NormalisedTokens)
    calls, caught = explain_twice(
        model, UniformEpsilon(epsilon=0.0, stabilizer=0.0, rule_mapper={"attend": IgnoreRule()})
    )
    assert any("computes normalize" in message for message in caught), caught
    x = tokens()["x"].requires_grad_()
    expected = x * torch.autograd.grad(target_score(model(x)).sum(), x)[0]
    for td in calls:
        assert relative_error(td["relevance", "x"], expected) <= 1e-10
