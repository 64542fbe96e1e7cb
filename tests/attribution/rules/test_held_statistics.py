"""Norms written out in a forward that is no norm module's: AttnLRP and CP-LRP hold their statistic constant, as the
norm rule holds a norm module's scale (the oracle: the same model with the norm as a module), in float64."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import CPLRP, LRP, AttnLRP
from tdhook.attribution.rules._held_statistics import divides_by_statistic, statistic_factors
from tdhook.attribution.rules._statistics import is_statistic
from tests.attribution.rules._helpers import F64, randn
from tests.conftest import relative_error

PRESETS = {"AttnLRP": AttnLRP, "CPLRP": CPLRP}
EPS = 1e-6


def centred(h: torch.Tensor) -> torch.Tensor:
    return h - h.mean(-1, keepdim=True)


# Norms over the last dimension (6), written out as users and libraries write them, and the module that computes
# the same (``None``: no module does; the relevance must still be conserved).
WRITTEN = {
    "h * h, rsqrt": (lambda h: h * torch.rsqrt((h * h).mean(-1, keepdim=True) + EPS), "rms"),
    "square, rsqrt": (lambda h: h * torch.rsqrt(h.square().mean(-1, keepdim=True) + EPS), "rms"),
    "** 2, / sqrt": (lambda h: h / ((h**2).mean(-1, keepdim=True) + EPS).sqrt(), "rms"),
    "torch.pow(h, 2), pow -1/2": (lambda h: h * torch.pow(torch.pow(h, 2).mean(-1, keepdim=True) + EPS, -0.5), "rms"),
    "h * h, / sqrt": (lambda h: h / torch.sqrt((h * h).mean(-1, keepdim=True) + EPS), "rms"),
    "var, / sqrt": (lambda h: centred(h) / torch.sqrt(h.var(-1, keepdim=True, unbiased=False) + EPS), "layer"),
    "var_mean, rsqrt": (
        lambda h: (lambda v, m: (h - m) * torch.rsqrt(v + EPS))(*torch.var_mean(h, -1, keepdim=True, unbiased=False)),
        "layer",
    ),
    "centred h * h, rsqrt": (
        lambda h: (lambda c: c * torch.rsqrt((c * c).mean(-1, keepdim=True) + EPS))(centred(h)),
        "layer",
    ),
    "std + eps": (lambda h: centred(h) / (h.std(-1, keepdim=True) + EPS), None),
    "norm": (lambda h: h / h.norm(dim=-1, keepdim=True), "l2"),
    "linalg.vector_norm": (lambda h: h / torch.linalg.vector_norm(h, dim=-1, keepdim=True), "l2"),
    "pow(2).sum().sqrt()": (lambda h: h / h.pow(2).sum(-1, keepdim=True).sqrt(), "l2"),
    "F.normalize": (lambda h: F.normalize(h, dim=-1), "l2"),
    "mean absolute deviation": (lambda h: centred(h) / (centred(h).abs().mean(-1, keepdim=True) + EPS), None),
    "largest absolute value": (lambda h: h / h.abs().amax(-1, keepdim=True), None),
    "F.group_norm": (lambda h: F.group_norm(h, 2, eps=EPS), "group"),
    "F.instance_norm": (lambda h: F.instance_norm(h.view(-1, 2, 3), eps=EPS).view(-1, 6), "instance"),
    "F.local_response_norm": (lambda h: F.local_response_norm(h.unsqueeze(-1), 3).squeeze(-1), "response"),
}


class L2Norm(nn.Module):
    """``F.normalize`` in a module named like a norm: the norm rule's."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.normalize(h, dim=-1)


class Instance(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.InstanceNorm1d(2, eps=EPS)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h.view(-1, 2, 3)).view(-1, 6)


class Response(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LocalResponseNorm(3)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h.unsqueeze(-1)).squeeze(-1)


MODULES = {
    "rms": lambda: nn.RMSNorm(6, eps=EPS, elementwise_affine=False),
    "layer": lambda: nn.LayerNorm(6, eps=EPS, elementwise_affine=False),
    "l2": L2Norm,
    "group": lambda: nn.GroupNorm(2, 6, eps=EPS, affine=False),
    "instance": Instance,
    "response": Response,
}


class Normed(nn.Module):
    """A linear map, a norm (written out in this forward, or a module), another linear map; no biases."""

    def __init__(self, norm) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 6, bias=False), nn.Linear(6, 3, bias=False)
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.norm(self.first(x)))


def explain(model: nn.Module, x: torch.Tensor, preset: str, calls: int = 2) -> list[torch.Tensor]:
    """The relevance of ``calls`` calls in one context (the later ones run by the recorded plan), with warnings
    raised as errors."""
    lrp = LRP(model, PRESETS[preset](), in_keys=["x"], out_keys=["y"])
    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with lrp:
            for _ in range(calls):
                td = lrp(TensorDict(x=x.clone(), batch_size=[len(x)]))
                assert torch.equal(td["y"], model(x))
                results.append(td["relevance", "x"])
    return results


def assert_conserved(relevance: torch.Tensor, model: nn.Module, x: torch.Tensor) -> None:
    logit = model(x).max(1).values
    assert ((relevance.sum(1) - logit).abs() / logit.abs()).max() <= 1e-9


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("spelling", sorted(WRITTEN))
def test_a_norm_written_out_holds_its_statistic_as_the_module_does(spelling: str, preset: str):
    """A norm written out in a model's own forward kept the plain gradient of its statistic (and AttnLRP's uniform
    rule on ``h * scale`` and ``h * h``), with a warning: 0.25 of the logit's relevance left for ``h * rsqrt(mean(h *
    h))``, 0.5 for ``h / sqrt(mean(h * h))``, about 1e-5 for the other spellings, and for ``F.instance_norm`` 1.5 to
    -1.7 times it. Its statistic is held constant: the relevance of the model with the norm as a module, conserved."""
    function, module = WRITTEN[spelling]
    torch.manual_seed(0)
    model = Normed(function).to(F64)
    x = randn(5, 4)
    first, later = explain(model, x, preset)
    assert_conserved(first, model, x)
    assert relative_error(later, first) <= 1e-12
    if module is not None:
        reference = Normed(MODULES[module]()).to(F64)
        reference.load_state_dict(model.state_dict(), strict=False)
        assert relative_error(first, explain(reference, x, preset, calls=1)[0]) <= 1e-9


class Attention(nn.Module):
    """One head of attention over 5 tokens whose query and key are normalised before their product: QK-norm (RMS,
    ``qk="rms"``) or cosine attention (``"cosine"``, Swin V2's ``normalize(q) · normalize(k)ᵀ · scale``); written
    out in this forward, or (``modules``) by norm modules."""

    def __init__(self, qk: str, modules: bool) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(4, 4, bias=False) for _ in range(4))
        self.qk, self.modules_ = qk, modules
        norm = (lambda: nn.RMSNorm(4, eps=EPS, elementwise_affine=False)) if qk == "rms" else L2Norm
        self.q_norm, self.k_norm = norm(), norm()

    def normed(self, t: torch.Tensor, module: nn.Module) -> torch.Tensor:
        if self.modules_:
            return module(t)
        if self.qk == "rms":
            return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + EPS)
        return F.normalize(t, dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(-1, 5, 4)
        q, k = self.normed(self.q(x), self.q_norm), self.normed(self.k(x), self.k_norm)
        scores = q @ k.transpose(-2, -1) * (10.0 if self.qk == "cosine" else 0.5)
        return self.o(torch.softmax(scores, -1) @ self.v(x)).flatten(1)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("qk", ["rms", "cosine"])
def test_a_query_and_key_normalised_before_their_product_as_by_modules(qk: str, preset: str):
    """QK-norm and cosine attention written out in the attention's forward: the relevance of the same attention with
    the norms as modules (before: the norms' plain gradient, with a warning)."""
    torch.manual_seed(0)
    model = Attention(qk, modules=False).to(F64)
    reference = Attention(qk, modules=True).to(F64)
    reference.load_state_dict(model.state_dict())
    x = randn(3, 20)
    first, later = explain(model, x, preset)
    assert relative_error(first, explain(reference, x, preset, calls=1)[0]) <= 1e-9
    assert relative_error(later, first) <= 1e-12


class OtherTensor(nn.Module):
    """An RMS norm's scale computed on one linear map's output and applied to another's."""

    def __init__(self) -> None:
        super().__init__()
        self.u, self.v, self.out = nn.Linear(4, 6, bias=False), nn.Linear(4, 6, bias=False), nn.Linear(6, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.u(x)
        return self.out(self.v(x) * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + EPS))


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_scale_computed_on_another_tensor_is_held(preset: str):
    """The scale is held constant whatever tensor it scales: the scaled one gets the relevance, conserved (before:
    5e-6 of the logit, with a warning), and what the scale was computed from gets none."""
    torch.manual_seed(0)
    model, x = OtherTensor().to(F64), randn(5, 4)
    relevance = explain(model, x, preset)[0]
    assert_conserved(relevance, model, x)
    leaf = x.clone().requires_grad_(True)
    scale = torch.rsqrt(model.u(x).pow(2).mean(-1, keepdim=True) + EPS)
    (grad,) = torch.autograd.grad(model.out(model.v(leaf) * scale).max(1).values.sum(), leaf)
    assert relative_error(relevance, x * grad) <= 1e-9


class NormAsOutput(nn.Module):
    def __init__(self, statistic: str) -> None:
        super().__init__()
        self.first = nn.Linear(4, 6, bias=False)
        self.statistic = statistic

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        if self.statistic == "var_mean":
            var, mean = torch.var_mean(h, -1, keepdim=True)
            return torch.cat([var, mean], -1)
        return torch.cat([h.norm(dim=-1, keepdim=True), h.sum(-1, keepdim=True)], -1)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("statistic", ["norm", "var_mean"])
def test_a_statistic_that_scales_nothing_keeps_its_plain_gradient_and_is_named(statistic: str, preset: str):
    """A norm or variance that is an output (a capsule's length) normalises nothing: its plain gradient, and the
    warning."""
    torch.manual_seed(0)
    model, x = NormAsOutput(statistic).to(F64), randn(5, 4)
    lrp = LRP(model, PRESETS[preset](), in_keys=["x"], out_keys=["y"], target=0)
    with pytest.warns(UserWarning, match=rf"computes {statistic}"):
        relevance = lrp(TensorDict(x=x.clone(), batch_size=[5]))["relevance", "x"]
    leaf = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(model(leaf)[:, 0].sum(), leaf)
    assert relative_error(relevance, x * grad) <= 1e-12


def test_what_is_a_statistic_that_scales():
    h = randn(2, 6).requires_grad_(True) * 1
    scale = torch.rsqrt((h * h).mean(-1, keepdim=True) + EPS)
    assert statistic_factors(torch.Tensor.__mul__, (h, scale)) == [False, True]
    assert statistic_factors(torch.matmul, (h, scale)) is None  # a matmul takes no scale
    assert statistic_factors(torch.mul, (h, h.sum(-1, keepdim=True))) is None
    assert divides_by_statistic((h, h.norm(dim=-1, keepdim=True).clamp_min(EPS)))
    assert not divides_by_statistic((h, h.norm(dim=-1, keepdim=True)), {"rounding_mode": "floor"})
    assert not divides_by_statistic((h, torch.sqrt(h * h)))  # element-wise: no reduction
    assert not divides_by_statistic((h, 2.0))
    assert is_statistic(h.norm(dim=-1).mean(-1))  # a mean of norms (ConvNeXt V2's global response norm)
    assert not is_statistic(h.norm(dim=-1) * h.sum(-1))
