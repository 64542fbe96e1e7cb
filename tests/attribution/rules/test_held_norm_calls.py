"""``F.normalize``, ``F.cosine_similarity`` and ``nn.CosineSimilarity`` under the CNN presets, in float64.

Oracles: conservation with the biases zeroed (the explained score's relevance sums to the score: each norm held, the
embedding is linear in the features, and the cosine bilinear in its two inputs, each half of the score), and LRP-0
(ε = 0 on every layer) equal to gradient × input of the same model written with each norm detached (the closed form:
half of it for each input of a cosine of two activations, the uniform rule on the product). The explained output
keeps the model's value. The AttnLRP rules give the cosine of a Linear encoder the same relevance, and zennit's
composites the encoder of a normalised embedding the same relevance from the normalised unit's value.
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
    AttnLRP,
    EpsilonAlpha2Beta1,
    EpsilonGammaBox,
    EpsilonPlus,
    EpsilonPlusFlat,
    IgnoreRule,
    UniformEpsilon,
)
from tests.conftest import relative_error

F64 = torch.float64
B = 3
TINY = {"epsilon": 1e-12, "stabilizer": 1e-12}
# The CNN presets, with ε and the stabilizer small enough that conservation is exact to float64's precision.
PRESETS = {
    "EpsilonPlus": lambda: EpsilonPlus(**TINY),
    "EpsilonPlusFlat": lambda: EpsilonPlusFlat(**TINY),
    "EpsilonGammaBox": lambda: EpsilonGammaBox(-4.0, 4.0, **TINY),
    "EpsilonAlpha2Beta1": lambda: EpsilonAlpha2Beta1(**TINY),
    "UniformEpsilon": lambda: UniformEpsilon(**TINY),
}


def lrp0() -> UniformEpsilon:
    """LRP-0: ε = 0 on every Linear and convolution layer, the pass rule on ReLU (gradient × input)."""
    return UniformEpsilon(epsilon=0.0, stabilizer=0.0)


class Encoder(nn.Module):
    """A small bias-free CNN: two convolutions with ReLU and max pooling, a Linear to an embedding of 8."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 4, 3, bias=False),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(4, 6, 3, bias=False),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(6 * 2 * 2, 8, bias=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)


def detached_normalize(h: torch.Tensor, dim: int = 1, eps: float = 1e-12) -> torch.Tensor:
    """``F.normalize(h, dim=dim)`` with its norm detached: the closed form of the held norm."""
    return h / h.norm(dim=dim, keepdim=True).clamp_min(eps).detach()


class Embedding(nn.Module):
    """An embedding network ending in ``normalize`` (``F.normalize`` by default) over its features."""

    def __init__(self, normalize=lambda h: F.normalize(h, dim=1)) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.normalize = normalize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalize(self.encoder(x))


# How a siamese network compares its two embeddings (B, 8): a callable of both, and its closed form with each norm
# detached.
COMPARE = {
    "F.cosine_similarity": lambda a, b: F.cosine_similarity(a, b),
    "nn.CosineSimilarity": nn.CosineSimilarity(dim=-1, eps=1e-6),
    "keywords": lambda a, b: F.cosine_similarity(x1=a, x2=b, dim=1),
}


def detached_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).sum(1) / (a.norm(dim=1).clamp_min(1e-8) * b.norm(dim=1).clamp_min(1e-8)).detach()


class Siamese(nn.Module):
    """One encoder on two images, their embeddings compared by ``compare``: a score per pair, shape ``(B, 1)``."""

    def __init__(self, compare) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.compare = compare

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.compare(self.encoder(a), self.encoder(b)).unsqueeze(-1)


def images(*keys: str) -> TensorDict:
    generator = torch.Generator().manual_seed(1)
    return TensorDict({key: torch.randn(B, 3, 10, 10, dtype=F64, generator=generator) for key in keys}, [B])


def explain(model: nn.Module, mapper, td: TensorDict, **options) -> tuple[TensorDict, list[str]]:
    lrp = LRP(model, mapper, in_keys=list(td.keys()), out_keys=["y"], **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = lrp(td.clone())
    return out, [str(w.message) for w in caught]


def seeded(model_class, *args) -> nn.Module:
    torch.manual_seed(0)
    return model_class(*args).double()


def target_score(y: torch.Tensor) -> torch.Tensor:
    """The explained score of each sample: the output at the argmax of the last dimension (the default target)."""
    return y.gather(-1, y.argmax(-1, keepdim=True)).squeeze(-1)


def total(td: TensorDict, *keys: str) -> torch.Tensor:
    return sum(td["relevance", key].flatten(1).sum(1) for key in keys)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_an_embedding_ending_in_normalize_conserves_the_score(preset: str):
    """The normalised embedding's explained unit: its relevance sums to its value, no warning, the value unchanged."""
    model = seeded(Embedding)
    td, caught = explain(model, PRESETS[preset](), images("x"))
    assert caught == []
    with torch.no_grad():
        torch.testing.assert_close(td["y"], model(images("x")["x"]), rtol=1e-12, atol=0)
    score = target_score(td["y"])
    torch.testing.assert_close(total(td, "x"), score, rtol=1e-8, atol=0)


@pytest.mark.parametrize("dim", [1, -1])
@pytest.mark.parametrize("p", [2.0, 1.0])
def test_lrp0_of_normalize_is_gradient_times_input_with_the_norm_detached(p: float, dim: int):
    """LRP-0 of the embedding (``F.normalize`` of any order and dim) equals gradient × input of the model whose
    norm is detached, and later calls of one context (which the first call's finding decides) give the same."""
    model = seeded(Embedding, lambda h: F.normalize(h, p=p, dim=dim))
    lrp = LRP(model, lrp0(), in_keys=["x"], out_keys=["y"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with lrp:
            calls = [lrp(images("x")) for _ in range(3)]
    x = images("x")["x"].requires_grad_()
    h = model.encoder(x)
    y = h / h.norm(p=p, dim=dim, keepdim=True).clamp_min(1e-12).detach()
    score = target_score(y)
    expected = x * torch.autograd.grad(score.sum(), x)[0]
    for td in calls:
        assert relative_error(td["relevance", "x"], expected) <= 1e-10


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("case", sorted(COMPARE))
def test_a_siamese_cosine_gives_each_image_half_of_the_score(case: str, preset: str):
    """Two in_keys: each image's relevance sums to half of the cosine (their sum to all of it), no warning, the
    value the model's own."""
    model = seeded(Siamese, COMPARE[case])
    td, caught = explain(model, PRESETS[preset](), images("a", "b"))
    assert caught == []
    with torch.no_grad():
        torch.testing.assert_close(td["y"], model(*images("a", "b").values()), rtol=1e-12, atol=1e-15)
    score = td["y"][:, 0]
    for key in ("a", "b"):
        torch.testing.assert_close(total(td, key), score / 2, rtol=1e-8, atol=0)


@pytest.mark.parametrize("case", sorted(COMPARE))
def test_lrp0_of_a_siamese_cosine_is_half_of_gradient_times_input_with_the_norms_detached(case: str):
    """LRP-0 of each image is half of gradient × input of the cosine written with both norms detached (the uniform
    rule on the product of the two normalised embeddings)."""
    model = seeded(Siamese, COMPARE[case])
    td, caught = explain(model, lrp0(), images("a", "b"))
    assert caught == []
    a, b = (image.requires_grad_() for image in images("a", "b").values())
    score = detached_cosine(model.encoder(a), model.encoder(b))
    gradients = torch.autograd.grad(score.sum(), (a, b))
    for key, image, gradient in zip(("a", "b"), (a, b), gradients, strict=True):
        assert relative_error(td["relevance", key], image * gradient / 2) <= 1e-10


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_cosine_against_a_learned_prototype_gives_the_image_all_of_it(preset: str):
    """The other input a parameter (a class prototype): the held cosine is linear in the one embedding, which gets
    the whole score; LRP-0 is gradient × input with the norm detached."""

    class Prototype(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = Encoder()
            self.prototypes = nn.Parameter(torch.randn(4, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.cosine_similarity(self.encoder(x).unsqueeze(1), self.prototypes, dim=-1)  # (B, 4)

    model = seeded(Prototype)
    td, caught = explain(model, PRESETS[preset](), images("x"))
    assert caught == []
    torch.testing.assert_close(total(td, "x"), target_score(td["y"]), rtol=1e-8, atol=0)
    zero, _ = explain(model, lrp0(), images("x"))
    x = images("x")["x"].requires_grad_()
    h = model.encoder(x).unsqueeze(1)
    prototypes = F.normalize(model.prototypes, dim=-1)
    score = target_score((h * prototypes).sum(-1) / h.norm(dim=-1).clamp_min(1e-8).detach())
    assert relative_error(zero["relevance", "x"], x * torch.autograd.grad(score.sum(), x)[0]) <= 1e-10


def test_the_cosine_of_a_linear_encoder_gets_attnlrps_relevance():
    """On a Linear and ReLU encoder, UniformEpsilon and AttnLRP give ε to the same layers: the cosine's relevance
    under one equals the other's (the written-out cosine's under the transformer rules)."""

    class LinearSiamese(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(5, 8, bias=False), nn.ReLU(), nn.Linear(8, 6, bias=False))

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return nn.CosineSimilarity(dim=-1)(self.encoder(a), self.encoder(b)).unsqueeze(-1)

    model = seeded(LinearSiamese)
    generator = torch.Generator().manual_seed(2)
    td = TensorDict({key: torch.randn(B, 5, dtype=F64, generator=generator) for key in "ab"}, [B])
    cnn, caught = explain(model, UniformEpsilon(epsilon=0.1), td)
    transformer, _ = explain(model, AttnLRP(epsilon=0.1), td)
    assert caught == []
    for key in "ab":
        assert relative_error(cnn["relevance", key], transformer["relevance", key]) <= 1e-10


@pytest.mark.parametrize("preset", ["EpsilonPlus", "UniformEpsilon"])
def test_a_kept_graph_gives_a_fresh_calls_relevance_and_its_finite_difference_derivative(preset: str):
    """``create_graph=True``: the relevance of a call that does not keep the graph, and its derivative with respect
    to the input that of the relevance as a function of the input (central differences)."""
    model = seeded(Siamese, COMPARE["F.cosine_similarity"])
    first, _ = explain(model, PRESETS[preset](), images("a", "b"))
    td = images("a", "b")
    td["a"].requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kept = LRP(model, PRESETS[preset](), in_keys=["a", "b"], out_keys=["y"], create_graph=True)(td.clone())
    for key in ("a", "b"):
        assert relative_error(kept["relevance", key].detach(), first["relevance", key]) <= 1e-10
    direction = torch.randn(td["a"].shape, dtype=F64, generator=torch.Generator().manual_seed(3))
    derivative = torch.autograd.grad(kept["relevance", "b"].pow(2).sum(), td["a"])[0]
    step, values = 1e-5, []
    for sign in (1, -1):
        moved = images("a", "b")
        moved["a"] = moved["a"] + sign * step * direction
        values.append(explain(model, PRESETS[preset](), moved)[0]["relevance", "b"].pow(2).sum())
    finite = (values[0] - values[1]) / (2 * step)
    torch.testing.assert_close((derivative * direction).sum(), finite, rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize(
    ("written", "named"),
    [
        # a norm written out, held, then given back: its output reaches a product of two activations
        (lambda a, b: (a / a.norm(dim=1, keepdim=True) * b).sum(1), "norm, mul, div"),
        (lambda a, b: (F.normalize(a, dim=1) * F.normalize(b, dim=1)).sum(1), "mul"),  # a product of two activations
    ],
)
def test_what_the_cnn_presets_have_no_rule_for_keeps_its_warning(written, named: str):
    """A product of two activations (a cosine written with ``F.normalize`` or a norm written out, and ``*``) has no
    rule under the CNN presets: its plain gradient, and the norm's that reaches it, named in the warning."""
    model = seeded(Siamese, written)
    _, caught = explain(model, EpsilonPlus(), images("a", "b"))
    assert any(f"computes {named}" in message for message in caught), caught


@pytest.mark.parametrize("preset", ["EpsilonPlus", "UniformEpsilon"])
def test_a_module_mapped_to_ignore_rule_keeps_the_plain_gradient_of_its_normalize(preset: str):
    """The caller maps the module that calls ``F.normalize`` to IgnoreRule: the plain gradient inside it, as asked
    (LRP-0 is then gradient × input of the model as it is), in later calls of a context too."""

    class Project(nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return F.normalize(h, dim=1)

    model = seeded(Embedding, Project())
    mapper = {"EpsilonPlus": EpsilonPlus, "UniformEpsilon": UniformEpsilon}[preset]
    lrp = LRP(
        model, mapper(epsilon=0.0, stabilizer=0.0, rule_mapper={Project: IgnoreRule()}), in_keys=["x"], out_keys=["y"]
    )
    with lrp:
        calls = [lrp(images("x")) for _ in range(2)]
    x = images("x")["x"].requires_grad_()
    score = target_score(model(x))
    expected = x * torch.autograd.grad(score.sum(), x)[0]
    held, _ = explain(model, mapper(epsilon=0.0, stabilizer=0.0), images("x"))
    assert relative_error(held["relevance", "x"], expected) > 1e-2  # the held norm's relevance differs
    if preset == "UniformEpsilon":  # LRP-0 on every layer: gradient × input
        for td in calls:
            assert relative_error(td["relevance", "x"], expected) <= 1e-10
    else:  # z⁺ on the convolutions: the plain gradient of the normalize sums to about zero
        for td in calls:
            assert td["relevance", "x"].flatten(1).sum(1).abs().max() <= 1e-6 * score.abs().max()


ZENNIT = {
    "EpsilonPlus": (EpsilonPlus, lambda zc: zc.EpsilonPlus()),
    "EpsilonPlusFlat": (EpsilonPlusFlat, lambda zc: zc.EpsilonPlusFlat()),
    "EpsilonAlpha2Beta1": (EpsilonAlpha2Beta1, lambda zc: zc.EpsilonAlpha2Beta1()),
    "EpsilonGammaBox": (lambda: EpsilonGammaBox(-4.0, 4.0), lambda zc: zc.EpsilonGammaBox(low=-4.0, high=4.0)),
}


@pytest.mark.parametrize("preset", sorted(ZENNIT))
def test_an_embedding_ending_in_normalize_gets_zennits_relevance_of_the_encoder(preset: str):
    """The held norm passes each unit its own relevance (``h_k · ∂y_k/∂h_k = y_k``): the preset's relevance is
    zennit's composite's (its defaults on both sides) on the encoder alone, from the normalised unit's value at the
    encoder's unit (zennit has no rule for ``F.normalize``, and reads the gradient a call that is no module passes
    on as relevance)."""
    from zennit import composites
    from zennit.attribution import Gradient

    model = seeded(Embedding)
    ours, theirs = ZENNIT[preset]
    td, caught = explain(model, ours(), images("x"))
    assert caught == []
    x = images("x")["x"]
    with torch.no_grad():
        y = model(x)
    unit = y.argmax(1, keepdim=True)
    start = torch.zeros_like(y).scatter_(1, unit, y.gather(1, unit))
    with Gradient(model=model.encoder, composite=theirs(composites)) as attributor:
        _, expected = attributor(x.clone(), start)
    assert relative_error(td["relevance", "x"], expected) <= 1e-6
