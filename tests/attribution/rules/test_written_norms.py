"""Norms written out under the CNN presets (``h / h.norm(...)``, ``h * rsqrt(...)``, ...), in float64.

Oracle: the same model written with ``F.normalize`` (whose held norm ``test_held_norm_calls.py`` checks against its
closed form and zennit), whose relevance a written norm must give to float64's precision, in every call of a context,
warnings included: held where ``F.normalize`` is held, given back its plain gradient where ``F.normalize`` is (its
output reaching a product of two activations: a siamese cosine, a CLIP-style similarity, a cosine attention). A
layer norm written out gets the relevance of an ``nn.LayerNorm`` module. A divisor that is no statistic of the
numerator keeps its plain gradient (LRP-0 is then gradient × input of the model as it is), named in the warning.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP, EpsilonPlus, UniformEpsilon
from tests.attribution.rules.test_held_norm_calls import PRESETS, Encoder, images, lrp0, seeded, target_score
from tests.conftest import relative_error

F64 = torch.float64


def _in_place(h: torch.Tensor) -> torch.Tensor:
    n = h.norm(dim=1, keepdim=True)
    h = h.clone()
    h /= n
    return h


def _through_a_view(h: torch.Tensor) -> torch.Tensor:
    n = h.view(-1, 2, 4).norm(dim=(1, 2), keepdim=True)
    out = h.clone()
    out.view(-1, 2, 4).div_(n)  # written into ``out`` through a view
    return out


# The embedding's normalisation, written out in each of the ways a model may write it.
WRITTEN = {
    "norm": lambda h: h / h.norm(dim=1, keepdim=True),
    "vector_norm": lambda h: h / torch.linalg.vector_norm(h, dim=-1, keepdim=True),
    "pow, sum, sqrt": lambda h: h / h.pow(2).sum(-1, keepdim=True).sqrt(),
    "rsqrt": lambda h: h * torch.rsqrt((h * h).sum(-1, keepdim=True) + 1e-30),
    "rsqrt first": lambda h: torch.rsqrt((h * h).sum(-1, keepdim=True)) * h,
    "norm + eps": lambda h: h / (h.norm(dim=1, keepdim=True) + 1e-30),
    "clamp_min": lambda h: h / h.norm(dim=1, keepdim=True).clamp_min(1e-12),
    "torch.div": lambda h: torch.div(h, h.norm(dim=1, keepdim=True)),
    "torch.div, other=": lambda h: torch.div(h, other=h.norm(dim=1, keepdim=True)),
    "div_": lambda h: h.clone().div_(h.norm(dim=1, keepdim=True)),
    "/=": _in_place,
    "div_ through a view": _through_a_view,
}


class Embedding(nn.Module):
    """The bias-free encoder of ``test_held_norm_calls.py``, its embedding normalised by ``normalize``."""

    def __init__(self, normalize) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.normalize = normalize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalize(self.encoder(x))


def explain_calls(model: nn.Module, mapper, td: TensorDict, calls: int = 3) -> tuple[list[TensorDict], list[str]]:
    """``calls`` calls of one context, and the warnings they gave."""
    lrp = LRP(model, mapper, in_keys=list(td.keys()), out_keys=["y"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with lrp:
            results = [lrp(td.clone()) for _ in range(calls)]
    return results, [str(w.message) for w in caught]


def assert_same_relevance(model: nn.Module, oracle: nn.Module, mapper, td: TensorDict) -> list[str]:
    """Every call's relevance and output equal those of ``oracle`` (the model written with ``F.normalize``), and
    the warnings are as many (they name the calls as each model writes them); the warnings."""
    ours, caught = explain_calls(model, mapper(), td)
    theirs, expected = explain_calls(oracle, mapper(), td)
    assert len(caught) == len(expected), (caught, expected)
    for mine, reference in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine["y"], reference["y"], rtol=1e-12, atol=1e-15)
        for key in td.keys():
            assert relative_error(mine["relevance", key], reference["relevance", key]) <= 1e-12
    return caught


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("form", sorted(WRITTEN))
def test_an_embedding_with_a_written_norm_gets_the_relevance_of_normalize(form: str, preset: str):
    """The normalised embedding's unit explained: the relevance of ``F.normalize``'s held norm, conserved, no
    warning (it was the plain gradient's, about a fifth of the score, and a warning)."""
    model, oracle = seeded(Embedding, WRITTEN[form]), seeded(Embedding, lambda h: F.normalize(h, dim=1))
    assert assert_same_relevance(model, oracle, PRESETS[preset], images("x")) == []


class Siamese(nn.Module):
    """Two images through one encoder, each embedding normalised by ``normalize``, then compared: ``"cosine"``, the
    sum of their product (a score per pair); ``"clip"``, every pair's similarity (a ``B × B`` matrix, CLIP-style)."""

    def __init__(self, normalize, compare: str) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.normalize, self.compare = normalize, compare

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a, b = self.normalize(self.encoder(a)), self.normalize(self.encoder(b))
        return (a * b).sum(1, keepdim=True) if self.compare == "cosine" else a @ b.T


@pytest.mark.parametrize("preset", ["EpsilonPlus", "EpsilonGammaBox", "UniformEpsilon"])
@pytest.mark.parametrize("compare", ["cosine", "clip"])
@pytest.mark.parametrize("form", ["norm", "rsqrt", "/="])
def test_a_written_cosine_falls_back_as_normalize_does_and_creates_nothing(form: str, compare: str, preset: str):
    """Two normalised embeddings multiplied: the norms given back their plain gradient as ``F.normalize``'s are
    (the product, and the norms reaching it, named in the warning), and the relevance sums to about zero instead of
    being created (the held norms would give each image the whole product's relevance: twice the score)."""
    model = seeded(Siamese, WRITTEN[form], compare)
    oracle = seeded(Siamese, lambda h: F.normalize(h, dim=1), compare)
    caught = assert_same_relevance(model, oracle, PRESETS[preset], images("a", "b"))
    assert any("mul" in message or "matmul" in message for message in caught), caught
    (td,), _ = explain_calls(model, PRESETS[preset](), images("a", "b"), calls=1)
    score = target_score(td["y"]).abs()
    for key in ("a", "b"):
        assert (td["relevance", key].flatten(1).sum(1).abs() <= 1e-6 * score).all()


class Prototypes(nn.Module):
    """An embedding compared with learned class prototypes, both normalised by hand: a cosine classifier."""

    def __init__(self, normalize) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.prototypes = nn.Parameter(torch.randn(4, 8))
        self.normalize = normalize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalize(self.encoder(x)) @ self.normalize(self.prototypes).T


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_cosine_against_written_prototypes_keeps_the_norm_held(preset: str):
    """The prototypes are constants: the product takes one activation, the embedding's norm stays held, and the
    image gets the whole score, as with ``F.normalize``."""
    model = seeded(Prototypes, WRITTEN["norm"])
    oracle = seeded(Prototypes, lambda h: F.normalize(h, dim=1))
    assert assert_same_relevance(model, oracle, PRESETS[preset], images("x")) == []
    (td,), _ = explain_calls(model, PRESETS[preset](), images("x"), calls=1)
    torch.testing.assert_close(td["relevance", "x"].flatten(1).sum(1), target_score(td["y"]), rtol=1e-8, atol=0)


class CosineAttention(nn.Module):
    """Tokens through a Linear and ReLU, one head of cosine attention (``softmax(4 q̂ k̂ᵀ) v``, Swin V2's) with q and k
    normalised by ``normalize``, mean pooling, a head whose output is normalised too; bias-free."""

    def __init__(self, normalize) -> None:
        super().__init__()
        self.tokens = nn.Sequential(nn.Linear(6, 8, bias=False), nn.ReLU())
        self.qkv = nn.Linear(8, 24, bias=False)
        self.head = nn.Linear(8, 4, bias=False)
        self.normalize = normalize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.tokens(x)).chunk(3, -1)
        q, k = self.normalize(q), self.normalize(k)
        attended = torch.softmax(4.0 * q @ k.transpose(-2, -1), -1) @ v
        return self.normalize(self.head(attended.mean(1)))


@pytest.mark.parametrize("preset", ["EpsilonPlus", "UniformEpsilon"])
@pytest.mark.parametrize("form", ["norm", "rsqrt"])
def test_a_written_cosine_attention_gives_its_norms_back_and_keeps_the_last_held(form: str, preset: str):
    """The query's and key's norms reach ``q̂ @ k̂ᵀ``: their plain gradient, as ``F.normalize``'s (the warning names
    them); the head's norm, which reaches no such product, stays held."""

    def normalize(h: torch.Tensor) -> torch.Tensor:
        return WRITTEN[form](h.reshape(-1, h.shape[-1])).view(h.shape)  # over the last dimension, any rank

    generator = torch.Generator().manual_seed(1)
    td = TensorDict({"x": torch.randn(3, 5, 6, dtype=F64, generator=generator)}, [3])
    model = seeded(CosineAttention, normalize)
    oracle = seeded(CosineAttention, lambda h: F.normalize(h, dim=-1))
    caught = assert_same_relevance(model, oracle, PRESETS[preset], td)
    assert any("matmul" in message for message in caught), caught


class Divided(nn.Module):
    """An encoder's embedding divided by ``divisor(h, g)`` of it and of a second branch ``g``."""

    def __init__(self, divisor) -> None:
        super().__init__()
        self.encoder, self.other = Encoder(), Encoder()
        self.divisor = divisor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x)
        return h / self.divisor(h, self.other(x))


@pytest.mark.parametrize(
    "divisor",
    [
        lambda h, g: g.norm(dim=1, keepdim=True),  # another tensor's norm
        lambda h, g: h[:, :4].norm(dim=1, keepdim=True),  # a slice's
        lambda h, g: (h * h + g * g).sum(1, keepdim=True).sqrt(),  # of both
    ],
    ids=["another tensor", "a slice", "both"],
)
def test_a_divisor_that_is_no_statistic_of_the_numerator_keeps_its_plain_gradient(divisor):
    """Not a normalisation of the numerator: no rule, its plain gradient (LRP-0 is gradient × input of the model as
    it is), and the warning names the division."""
    model = seeded(Divided, divisor)
    (td,), caught = explain_calls(model, lrp0(), images("x"), calls=1)
    assert any("div" in message for message in caught), caught
    x = images("x")["x"].requires_grad_()
    expected = x * torch.autograd.grad(target_score(model(x)).sum(), x)[0]
    assert relative_error(td["relevance", "x"], expected) <= 1e-10


class Standardised(nn.Module):
    """A Linear and ReLU, a layer norm without affine parameters (``nn.LayerNorm`` or ``normalize``), a head."""

    def __init__(self, normalize=None) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8))
        self.norm = nn.LayerNorm(8, elementwise_affine=False) if normalize is None else normalize
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.first(x)))


def _var_mean_rsqrt(h: torch.Tensor, dim: int = -1) -> torch.Tensor:
    var, mean = torch.var_mean(h, dim, keepdim=True, unbiased=False)
    return (h - mean) * torch.rsqrt(var + 1e-5)


def _var_mean_sqrt(h: torch.Tensor) -> torch.Tensor:
    var, mean = torch.var_mean(h, dim=-1, correction=0, keepdim=True)
    return (h - mean) / (var + 1e-5).sqrt()


LAYER_NORMS = {
    "var, sqrt": lambda h: (h - h.mean(-1, keepdim=True)) / (h.var(-1, keepdim=True, unbiased=False) + 1e-5).sqrt(),
    "rsqrt": lambda h: (h - h.mean(-1, keepdim=True)) * torch.rsqrt(h.var(-1, keepdim=True, unbiased=False) + 1e-5),
    "centred, pow": lambda h: (c := h - h.mean(-1, keepdim=True)) / (c.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt(),
    # The mean and the variance from one call: no warning names it (its variance held, its mean linear).
    "var_mean, rsqrt": _var_mean_rsqrt,
    "var_mean, sqrt": _var_mean_sqrt,
}


@pytest.mark.parametrize("preset", ["EpsilonPlus", "UniformEpsilon"])
@pytest.mark.parametrize("form", sorted(LAYER_NORMS))
def test_a_layer_norm_written_out_gets_the_relevance_of_a_layer_norm_module(form: str, preset: str):
    """``(h - mean(h)) / std(h)`` written out: its deviation held, the centring linear, as the norm rule holds an
    ``nn.LayerNorm`` module's (it was the plain gradient's, 58 % to 83 % off, and a warning)."""

    def module(normalize):
        return lambda: Standardised(normalize)

    generator = torch.Generator().manual_seed(1)
    td = TensorDict({"x": torch.randn(3, 6, dtype=F64, generator=generator)}, [3])
    model, oracle = seeded(module(LAYER_NORMS[form])), seeded(module(None))
    assert assert_same_relevance(model, oracle, PRESETS[preset], td) == []


def test_a_norm_centred_over_the_batch_keeps_its_plain_gradient():
    """``(h - h.mean(0)) / h.std(0)``, a batch norm written out: its centring passes gradient between samples, which
    the norm rule of a batch norm holds as well; not held here, its plain gradient (LRP-0 is gradient × input of the
    model as it is), and the warning names it."""
    model = seeded(Standardised, lambda h: (h - h.mean(0, keepdim=True)) / (h.var(0, keepdim=True) + 1e-5).sqrt())
    td = TensorDict({"x": torch.randn(3, 6, dtype=F64, generator=torch.Generator().manual_seed(1))}, [3])
    (explained,), caught = explain_calls(model, lrp0(), td, calls=1)
    assert any("div" in message for message in caught), caught
    x = td["x"].clone().requires_grad_()
    expected = x * torch.autograd.grad(target_score(model(x)).sum(), x)[0]
    assert relative_error(explained["relevance", "x"], expected) <= 1e-10


def _variance_added(h: torch.Tensor) -> torch.Tensor:
    var, mean = torch.var_mean(h, -1, keepdim=True)
    return h - mean + var


# ``torch.var_mean`` whose variance keeps its plain gradient: an output term, a norm centred over the batch, a layer
# norm whose output reaches a product of two activations (its statistic given back, as F.normalize's).
VARIANCES_NOT_HELD = {
    "variance added": _variance_added,
    "over the batch": lambda h: _var_mean_rsqrt(h, 0),
    "output squared": lambda h: (n := _var_mean_rsqrt(h)) * n,
}


@pytest.mark.parametrize("form", sorted(VARIANCES_NOT_HELD))
def test_a_var_mean_whose_variance_is_not_held_is_named_and_keeps_its_plain_gradient(form: str):
    """The warning still names ``var_mean`` where its variance is not held (LRP-0 is then gradient × input of the
    model as it is)."""
    model = seeded(Standardised, VARIANCES_NOT_HELD[form])
    td = TensorDict({"x": torch.randn(3, 6, dtype=F64, generator=torch.Generator().manual_seed(1))}, [3])
    (explained,), caught = explain_calls(model, lrp0(), td, calls=1)
    assert any("var_mean" in message for message in caught), caught
    x = td["x"].clone().requires_grad_()
    expected = x * torch.autograd.grad(target_score(model(x)).sum(), x)[0]
    assert relative_error(explained["relevance", "x"], expected) <= 1e-10


def test_a_kept_graph_gives_a_fresh_calls_relevance_and_the_true_derivative():
    """``create_graph=True``: the relevance of a call that does not keep the graph, and the statistic's path in the
    derivative (it equals that of the model written with ``F.normalize``)."""
    model, oracle = seeded(Embedding, WRITTEN["rsqrt"]), seeded(Embedding, lambda h: F.normalize(h, dim=1))
    results = []
    for net in (model, oracle):
        td = images("x")
        td["x"].requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            kept = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"], create_graph=True)(td.clone())
        derivative = torch.autograd.grad(kept["relevance", "x"].pow(2).sum(), td["x"])[0]
        results.append((kept["relevance", "x"].detach(), derivative))
    (fresh,), _ = explain_calls(model, EpsilonPlus(), images("x"), calls=1)
    assert relative_error(results[0][0], fresh["relevance", "x"]) <= 1e-12
    assert relative_error(results[0][1], results[1][1]) <= 1e-10


def test_a_model_without_a_written_norm_leaves_the_mode_off_in_later_calls():
    """A product of two activations whose factor is no statistic of the other (``h * g``) is no norm: nothing held,
    and a context's later calls run without the mode, as before."""

    class Product(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder, self.other = Encoder(), Encoder()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.encoder(x) * self.other(x).norm(dim=1, keepdim=True)

    lrp = LRP(seeded(Product), UniformEpsilon(), in_keys=["x"], out_keys=["y"])
    with warnings.catch_warnings(record=True), lrp:
        lrp(images("x"))
        assert lrp._function_gates.found is False
