"""Batch and instance norms called as functions, their ``[N, C, H, 1]`` output transposed or permuted before the head
(float64, against central finite differences and the model with the norm written out element-wise).

PyTorch's CPU ``batch_norm`` backward (``instance_norm`` calls it) misreads a gradient laid out unlike the norm's
output; the hooks on BatchNorm and InstanceNorm modules lay it out, but ``F.batch_norm``, ``torch.batch_norm``,
``F.instance_norm``, ``torch.instance_norm`` and the ATen operators called by the model itself took the faulty
backward: LRP-0 and the gradient methods 1.0 to 3.5 off, with no warning. The group, layer and local response norms
do not use that kernel and were right (checked here too). A norm that only a later call makes (a flag set, a branch
taken for batches of more than one) ran without the first call's mode, as misread (up to 1.2 off, relative L2).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import (
    CPLRP,
    LRP,
    AttnLRP,
    EpsilonPlus,
    GradCAM,
    GradientShap,
    InputXGradient,
    IntegratedGradients,
    Saliency,
    SmoothGrad,
    _explained_call,
    _model_run,
)
from tdhook.attribution.mappers.base import BaseRuleMapper
from tdhook.attribution.methods import _norm_gradients
from tdhook.attribution.rules import _norm_function_layout
from tdhook.attribution.rules._norm_function_layout import NormFunctionLayouts, late_norm_nodes_laid_out
from tdhook.attribution.rules._norm_gradient_layout import NO_NORM_KERNEL_BELOW

F64 = torch.float64
EPS = 1e-5


class BatchNormOwnForward(nn.BatchNorm2d):
    """A BatchNorm subclass whose forward calls ``F.batch_norm`` on its input read channels-first from a
    channels-last layout and gives the result back channels-last: its output is no call's output."""

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        z = z.permute(0, 3, 1, 2)
        out = F.batch_norm(z, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        return out.permute(0, 2, 3, 1)


class FunctionalNorm(nn.Module):
    """Conv2d to ``[N, 3, 5, 1]``, a ReLU, a norm called as a function (``kind``) or written out element-wise
    (``written_out``), then a Linear reads the channels last (``transpose``) or the rows first (``permute``)."""

    def __init__(self, kind: str, head: str, written_out: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, (1, 2))
        self.lin = nn.Linear(3, 4)
        self.weight = nn.Parameter(torch.rand(3) + 0.5)
        self.bias = nn.Parameter(torch.rand(3) - 0.5)
        self.register_buffer("mean", torch.rand(3) - 0.5)
        self.register_buffer("var", torch.rand(3) + 0.5)
        self.own = BatchNormOwnForward(3) if kind == "subclass forward" else None
        self.kind, self.head, self.written_out = kind, head, written_out

    def _statistics(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kind in ("F.instance_norm", "torch.instance_norm"):  # per sample and channel
            return z.mean((2, 3), keepdim=True), z.var((2, 3), unbiased=False, keepdim=True)
        if self.kind == "F.batch_norm training":  # per channel over the batch
            return z.mean((0, 2, 3), keepdim=True), z.var((0, 2, 3), unbiased=False, keepdim=True)
        return self.mean.view(1, -1, 1, 1), self.var.view(1, -1, 1, 1)

    def norm(self, z: torch.Tensor) -> torch.Tensor:
        w, b, m, v = self.weight, self.bias, self.mean, self.var
        if self.written_out:
            mean, var = self._statistics(z)
            return (z - mean) / torch.sqrt(var + EPS) * w.view(1, -1, 1, 1) + b.view(1, -1, 1, 1)
        if self.kind == "F.batch_norm":
            return F.batch_norm(z, m, v, w, b, False, 0.0, EPS)
        if self.kind == "F.batch_norm training":
            return F.batch_norm(z, None, None, w, b, True, 0.0, EPS)
        if self.kind == "torch.batch_norm":
            return torch.batch_norm(z, w, b, m, v, False, 0.0, EPS, False)
        if self.kind == "aten.native_batch_norm":
            return torch.ops.aten.native_batch_norm(z, w, b, m, v, False, 0.0, EPS)[0]
        if self.kind == "F.instance_norm":
            return F.instance_norm(z, weight=w, bias=b, eps=EPS)
        if self.kind == "F.instance_norm running":
            return F.instance_norm(z, m, v, w, b, use_input_stats=False, eps=EPS)
        if self.kind == "torch.instance_norm":
            return torch.instance_norm(z, w, b, None, None, True, 0.0, EPS, False)
        if self.kind == "torch.instance_norm running":
            return torch.instance_norm(z, w, b, m, v, False, 0.0, EPS, False)
        own = self.own
        return own(z.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)  # "subclass forward"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.norm(self.conv(x).relu())  # [N, 3, 5, 1]
        if self.head == "transpose":
            return self.lin(z.transpose(1, 2).squeeze(-1)).flatten(1)
        return self.lin(z.permute(2, 0, 1, 3).squeeze(-1)).transpose(0, 1).flatten(1)


def models(kind: str, head: str) -> tuple[nn.Module, nn.Module]:
    """The model and its twin with the norm written out (same parameters), in eval mode."""
    torch.manual_seed(0)
    model = FunctionalNorm(kind, head).to(F64).eval()
    if model.own is not None:  # the subclass's statistics and affine map are the model's own
        model.own.load_state_dict(
            {
                "weight": model.weight,
                "bias": model.bias,
                "running_mean": model.mean,
                "running_var": model.var,
                "num_batches_tracked": torch.tensor(0),
            }
        )
        model.own.eps = EPS
    twin = FunctionalNorm(kind, head, written_out=True).to(F64).eval()
    twin.load_state_dict(model.state_dict(), strict=False)
    return model, twin


def finite_difference_gradient(model: nn.Module, x: torch.Tensor, unit: int, h: float = 1e-6) -> torch.Tensor:
    grad = torch.zeros_like(x)
    with torch.no_grad():
        for i in range(x.numel()):
            step = torch.zeros_like(x).view(-1)
            step[i] = h
            step = step.view_as(x)
            grad.view(-1)[i] = (model(x + step)[:, unit].sum() - model(x - step)[:, unit].sum()) / (2 * h)
    return grad


KINDS = [
    "F.batch_norm",
    "F.batch_norm training",
    "torch.batch_norm",
    "aten.native_batch_norm",
    "F.instance_norm",
    "F.instance_norm running",
    "torch.instance_norm",
    "torch.instance_norm running",
    "subclass forward",
]
# The norms that are affine maps (running statistics): every preset's rules are those of the model written out.
AFFINE = [kind for kind in KINDS if "instance" not in kind or "running" in kind]
AFFINE.remove("F.batch_norm training")
HEADS = ["transpose", "permute"]
UNIT = 1


def td(x: torch.Tensor) -> TensorDict:
    return TensorDict(x=x.clone(), batch_size=[x.shape[0]])


def lrp_relevances(model: nn.Module, mapper, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The relevance of each input, in one context (the first call finds the calls, the later ones lay them out)."""
    lrp = LRP(model, rule_mapper=mapper, in_keys=["x"], out_keys=["y"], target=UNIT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the norms the watch names (instance_norm, batch_norm in training mode)
        with lrp:
            return [lrp(td(x))["relevance", "x"] for x in xs]


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("kind", KINDS)
def test_saliency_is_the_finite_difference_gradient(kind, head):
    model, twin = models(kind, head)
    saliency = Saliency(model, in_keys=["x"], out_keys=["y"], target=UNIT, abs=False)
    for seed in range(2):  # the first call, and a later one
        x = torch.randn(2, 2, 5, 2, dtype=F64, generator=torch.Generator().manual_seed(seed))
        expected = finite_difference_gradient(model, x, UNIT)
        leaf = x.clone().requires_grad_(True)
        (twin_grad,) = torch.autograd.grad(twin(leaf)[:, UNIT].sum(), leaf)
        torch.testing.assert_close(twin_grad, expected, rtol=1e-6, atol=1e-8)  # the twin: the other tests' oracle
        torch.testing.assert_close(saliency(td(x))["attribution", "x"], expected, rtol=1e-6, atol=1e-8)


METHODS = {
    "InputXGradient": lambda m: InputXGradient(m, in_keys=["x"], out_keys=["y"], target=UNIT),
    "IntegratedGradients": lambda m: IntegratedGradients(m, in_keys=["x"], out_keys=["y"], target=UNIT, n_steps=5),
    "SmoothGrad": lambda m: SmoothGrad(m, in_keys=["x"], out_keys=["y"], target=UNIT, n_samples=3, seed=0),
    "GradCAM": lambda m: GradCAM(m, layer="conv", in_keys=["x"], out_keys=["y"], target=UNIT, relu=False),
}


@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("kind", KINDS)
def test_methods_match_the_norm_written_out(kind, name):
    model, twin = models(kind, "transpose" if "batch" in kind or "subclass" in kind else "permute")
    ours, theirs = METHODS[name](model), METHODS[name](twin)
    key = "conv" if name == "GradCAM" else "x"
    expected = []
    for seed in range(2):
        x = torch.randn(2, 2, 5, 2, dtype=F64, generator=torch.Generator().manual_seed(seed))
        expected.append(theirs(td(x))["attribution", key])
        torch.testing.assert_close(ours(td(x))["attribution", key], expected[-1], rtol=1e-9, atol=1e-12)
    assert max(e.abs().max() for e in expected) > 1e-3


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("kind", KINDS)
def test_lrp0_is_gradient_times_input(kind, head):
    # Every module on its plain gradient (an instance norm's or a training batch norm's included, as the watch says).
    model, _ = models(kind, head)
    xs = [torch.randn(2, 2, 5, 2, dtype=F64, generator=torch.Generator().manual_seed(seed)) for seed in range(2)]
    relevances = lrp_relevances(model, BaseRuleMapper(stabilizer=0.0), xs)
    for x, relevance in zip(xs, relevances, strict=True):
        expected = x * finite_difference_gradient(model, x, UNIT)
        torch.testing.assert_close(relevance, expected, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("preset", [EpsilonPlus, AttnLRP, CPLRP], ids=["EpsilonPlus", "AttnLRP", "CPLRP"])
@pytest.mark.parametrize("kind", AFFINE)
def test_presets_match_the_norm_written_out(kind, preset):
    model, twin = models(kind, "transpose" if "batch" in kind or "subclass" in kind else "permute")
    xs = [torch.randn(2, 2, 5, 2, dtype=F64, generator=torch.Generator().manual_seed(seed)) for seed in range(2)]
    expected = lrp_relevances(twin, preset(), xs)
    assert max(theirs.abs().max() for theirs in expected) > 1e-3
    # The BatchNorm subclass, and F.instance_norm in the function modes, get the norm rule: the ε-rule (ε = 1e-6) of
    # their affine map, about 1e-5 off the plain gradient of the norm written out (the misread gradient was more than
    # its own size off).
    ruled = kind == "subclass forward" or (kind == "F.instance_norm running" and preset is not EpsilonPlus)
    tolerance = {"rtol": 1e-4, "atol": 1e-8} if ruled else {"rtol": 1e-9, "atol": 1e-12}
    for relevance, theirs in zip(lrp_relevances(model, preset(), xs), expected, strict=True):
        torch.testing.assert_close(relevance, theirs, **tolerance)


@pytest.mark.parametrize(
    "call",
    [
        lambda z, w, b: F.group_norm(z, 3, w, b),
        lambda z, w, b: F.layer_norm(z, z.shape[1:]),
        lambda z, w, b: F.local_response_norm(z, 2),
    ],
    ids=["F.group_norm", "F.layer_norm", "F.local_response_norm"],
)
@pytest.mark.parametrize("head", HEADS)
def test_other_norms_called_as_functions_were_right(call, head):
    # Their kernels read a gradient in any layout: Saliency is the finite-difference gradient (on main too).
    class Other(FunctionalNorm):
        def norm(self, z):
            return call(z, self.weight, self.bias)

    torch.manual_seed(0)
    model = Other("F.batch_norm", head).to(F64).eval()
    x = torch.randn(2, 2, 5, 2, dtype=F64)
    saliency = Saliency(model, in_keys=["x"], out_keys=["y"], target=UNIT, abs=False)
    expected = finite_difference_gradient(model, x, UNIT)
    torch.testing.assert_close(saliency(td(x))["attribution", "x"], expected, rtol=1e-6, atol=1e-8)
    assert saliency._norm_calls.found is False


class ModuleNorms(nn.Module):
    """A small CNN whose BatchNorm and InstanceNorm are modules (the hooks cover them)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, (1, 2))
        self.bn = nn.BatchNorm2d(3)
        self.inorm = nn.InstanceNorm2d(3, affine=True)
        self.lin = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.inorm(self.bn(self.conv(x))).transpose(1, 2).squeeze(-1)).flatten(1)


def counting(made: list):
    """A stand-in for :class:`NormFunctionLayouts` that counts the modes made."""

    def make(calls):
        made.append(calls)
        return NormFunctionLayouts(calls)

    return make


def three_calls_of_module_norms() -> tuple[LRP, Saliency, torch.Tensor]:
    """LRP-0 (three calls in one context) and Saliency (three calls) of a model whose norms are all modules, and
    their input."""
    model = ModuleNorms().to(F64).eval()
    x = torch.randn(3, 2, 5, 2, dtype=F64)
    lrp = LRP(model, rule_mapper=BaseRuleMapper(stabilizer=0.0), in_keys=["x"], out_keys=["y"])
    saliency = Saliency(model, in_keys=["x"], out_keys=["y"], target=UNIT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the instance norm the watch names
        with lrp:
            for _ in range(3):
                lrp(td(x))
    for _ in range(3):
        saliency(td(x))
    return lrp, saliency, x


def test_a_model_without_norms_called_as_functions_runs_no_mode_after_its_first_call(monkeypatch):
    made: list = []
    monkeypatch.setattr(_model_run, "NormFunctionLayouts", counting(made))
    monkeypatch.setattr(_norm_gradients, "NormFunctionLayouts", counting(made))
    lrp, saliency, x = three_calls_of_module_norms()
    assert lrp._norm_calls.found is False and saliency._norm_calls.found is False
    assert made == [lrp._norm_calls, saliency._norm_calls]  # the first calls' watches only


def test_a_model_calling_them_runs_the_mode_on_every_call(monkeypatch):
    made: list = []
    monkeypatch.setattr(_model_run, "NormFunctionLayouts", counting(made))
    model, _ = models("F.batch_norm", "transpose")
    lrp = LRP(model, rule_mapper=EpsilonPlus(), in_keys=["x"], out_keys=["y"])
    with lrp:
        for _ in range(3):
            lrp(td(torch.randn(2, 2, 5, 2, dtype=F64)))
    assert lrp._norm_calls.found is True
    assert len(made) == 3


class OwnForwardNorm(nn.Module):
    """A norm of one's own (no BatchNorm) that calls ``F.batch_norm`` with ``norm``'s parameters and statistics."""

    def __init__(self, norm: nn.BatchNorm2d) -> None:
        super().__init__()
        self.weight, self.bias, self.eps = norm.weight, norm.bias, norm.eps
        self.register_buffer("running_mean", norm.running_mean.clone())
        self.register_buffer("running_var", norm.running_var.clone())

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(z, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)


class SwappedNorm(FunctionalNorm):
    """:class:`FunctionalNorm` whose norm is the module ``bn``: torch's ``nn.BatchNorm2d`` (laid out by the module
    hooks) until it is swapped for an :class:`OwnForwardNorm`."""

    def __init__(self, head: str) -> None:
        super().__init__("module", head)
        self.bn = nn.BatchNorm2d(3, eps=EPS)

    def norm(self, z: torch.Tensor) -> torch.Tensor:
        return self.bn(z)

    def swap(self) -> None:
        self.bn = OwnForwardNorm(self.bn)


@pytest.mark.parametrize("when", ["in the open context", "between contexts"])
def test_a_norm_swapped_for_one_calling_them_after_the_first_call_gets_them_laid_out(when):
    """The first call finds whether the model calls the norms as functions; a model whose norm is swapped for one
    that calls ``F.batch_norm`` itself after that call (in the open context, between two, or between two calls of a
    gradient method) is explained as a fresh wrapper explains it: LRP-0 is gradient x input, Saliency the gradient
    (before: the later calls ran without the mode, 1.0 off, relative)."""
    torch.manual_seed(0)
    model = SwappedNorm("transpose").to(F64).eval()
    model.bn.load_state_dict(
        {"weight": model.weight, "bias": model.bias, "running_mean": model.mean, "running_var": model.var},
        strict=False,
    )
    x = torch.randn(2, 2, 5, 2, dtype=F64, generator=torch.Generator().manual_seed(0))
    lrp = LRP(model, rule_mapper=BaseRuleMapper(stabilizer=0.0), in_keys=["x"], out_keys=["y"], target=UNIT)
    saliency = Saliency(model, in_keys=["x"], out_keys=["y"], target=UNIT, abs=False)
    saliency(td(x))
    with lrp:
        lrp(td(x))
        if when == "in the open context":
            model.swap()
            relevance = lrp(td(x))["relevance", "x"]
    if when == "between contexts":
        model.swap()
        with lrp:
            relevance = lrp(td(x))["relevance", "x"]
    expected = finite_difference_gradient(model, x, UNIT)
    assert expected.abs().max() > 1e-2
    torch.testing.assert_close(relevance, x * expected, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(saliency(td(x))["attribution", "x"], expected, rtol=1e-6, atol=1e-8)


class UnregisteredNorm(FunctionalNorm):
    """:class:`FunctionalNorm` whose norm is torch's ``nn.BatchNorm2d`` kept out of the model's modules (in its
    ``__dict__``, as a frozen network is kept out of the state dict): no module hook of a wrapper reaches it."""

    def __init__(self, head: str) -> None:
        super().__init__("module", head)
        self.__dict__["bn"] = nn.BatchNorm2d(3, eps=EPS)

    def norm(self, z: torch.Tensor) -> torch.Tensor:
        return self.__dict__["bn"](z)


def test_a_torch_norm_that_is_no_module_of_the_model_gets_its_gradient_laid_out_on_every_call():
    """A torch ``BatchNorm2d`` outside the model's modules carries no layout hook: its kernel call is one of the
    model's own, laid out by the mode on every call. It was taken for a norm module the hooks cover, so the first call
    (which runs the mode) was right and the later ones misread (LRP-0 and Saliency 1.0 off, relative)."""
    torch.manual_seed(0)
    model = UnregisteredNorm("transpose").to(F64).eval()
    model.__dict__["bn"].to(F64).eval().load_state_dict(
        {"weight": model.weight, "bias": model.bias, "running_mean": model.mean, "running_var": model.var},
        strict=False,
    )
    x = torch.randn(2, 2, 5, 2, dtype=F64, generator=torch.Generator().manual_seed(0))
    expected = finite_difference_gradient(model, x, UNIT)
    assert expected.abs().max() > 1e-2
    saliency = Saliency(model, in_keys=["x"], out_keys=["y"], target=UNIT, abs=False)
    relevances = lrp_relevances(model, BaseRuleMapper(stabilizer=0.0), [x, x])
    for call in range(2):
        torch.testing.assert_close(saliency(td(x))["attribution", "x"], expected, rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(relevances[call], x * expected, rtol=1e-6, atol=1e-8)


class LateNorm(FunctionalNorm):
    """:class:`FunctionalNorm` whose norm runs only where ``when`` says: while its ``normed`` flag is set, or for a
    batch of more than one sample (``"flag"``, ``"batch"``). A first call without it finds no norm called as a
    function."""

    def __init__(self, kind: str, head: str, when: str, written_out: bool = False) -> None:
        super().__init__(kind, head, written_out)
        self.when, self.normed = when, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.conv(x).relu()  # [N, 3, 5, 1]
        if self.normed if self.when == "flag" else x.shape[0] > 1:
            z = self.norm(z)
        if self.head == "transpose":
            return self.lin(z.transpose(1, 2).squeeze(-1)).flatten(1)
        return self.lin(z.permute(2, 0, 1, 3).squeeze(-1)).transpose(0, 1).flatten(1)


def late_models(kind: str, head: str, when: str) -> tuple[LateNorm, LateNorm]:
    """The model whose norm appears after the first call, and its twin with the norm written out (same parameters)."""
    model, _ = models(kind, head)
    late = LateNorm(kind, head, when).to(F64).eval()
    late.load_state_dict(model.state_dict())
    twin = LateNorm(kind, head, when, written_out=True).to(F64).eval()
    twin.load_state_dict(model.state_dict(), strict=False)
    return late, twin


def first_and_later_inputs(when: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The first call's input (one sample where the norm runs for batches of more than one), the later calls'."""
    first = torch.randn(1 if when == "batch" else 2, 2, 5, 2, dtype=F64, generator=torch.Generator().manual_seed(9))
    return first, [torch.randn(2, 2, 5, 2, dtype=F64, generator=torch.Generator().manual_seed(s)) for s in range(2)]


def norm_on(*models: LateNorm) -> None:
    for model in models:
        model.normed = True


WHEN = ["flag", "batch"]


def head_misread(kind: str) -> str:
    """The head whose gradient PyTorch's CPU backward of the norm ``kind`` misreads, where nothing lays it out."""
    return "transpose" if "batch" in kind or "subclass" in kind else "permute"


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("kind", KINDS)
def test_a_norm_appearing_after_the_first_call_gets_the_finite_difference_gradient(kind, when):
    """A norm called as a function that a first call does not make (a flag set later, a branch taken for batches of
    more than one): Saliency is the finite-difference gradient, LRP-0 gradient x input, in an open context and
    outside one (before: without the first call's mode, such a later call was misread)."""
    model, twin = late_models(kind, head_misread(kind), when)
    first, later = first_and_later_inputs(when)
    saliency = Saliency(model, in_keys=["x"], out_keys=["y"], target=UNIT, abs=False)
    lrp = LRP(model, rule_mapper=BaseRuleMapper(stabilizer=0.0), in_keys=["x"], out_keys=["y"], target=UNIT)
    fresh = LRP(model, rule_mapper=BaseRuleMapper(stabilizer=0.0), in_keys=["x"], out_keys=["y"], target=UNIT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the norms the watch names (instance_norm, batch_norm in training mode)
        saliency(td(first))
        fresh(td(first))  # its calls each enter a context: the first found no norm
        with lrp:
            lrp(td(first))
            norm_on(model, twin)
            relevances = [lrp(td(x))["relevance", "x"] for x in later]
        outside = [fresh(td(x))["relevance", "x"] for x in later]
    assert saliency._norm_calls.found is False and lrp._norm_calls.found is False and fresh._norm_calls.found is False
    for x, relevance, other in zip(later, relevances, outside, strict=True):
        expected = finite_difference_gradient(model, x, UNIT)
        leaf = x.clone().requires_grad_(True)
        (twin_grad,) = torch.autograd.grad(twin(leaf)[:, UNIT].sum(), leaf)
        torch.testing.assert_close(twin_grad, expected, rtol=1e-6, atol=1e-8)  # the norm ran: the twin's gradient
        torch.testing.assert_close(saliency(td(x))["attribution", "x"], expected, rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(relevance, x * expected, rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(other, x * expected, rtol=1e-6, atol=1e-8)


LATE_METHODS = {
    **METHODS,
    "GradientShap": lambda m: GradientShap(
        m,
        baselines=torch.randn(3, 2, 5, 2, dtype=F64, generator=torch.Generator().manual_seed(5)),
        in_keys=["x"],
        out_keys=["y"],
        target=UNIT,
        n_samples=3,
        seed=0,
    ),
}


@pytest.mark.parametrize("name", list(LATE_METHODS))
@pytest.mark.parametrize("kind", KINDS)
def test_methods_match_the_norm_written_out_where_it_appears_after_the_first_call(kind, name):
    model, twin = late_models(kind, head_misread(kind), "flag")
    ours, theirs = LATE_METHODS[name](model), LATE_METHODS[name](twin)
    key = "conv" if name == "GradCAM" else "x"
    first, later = first_and_later_inputs("flag")
    torch.testing.assert_close(ours(td(first))["attribution", key], theirs(td(first))["attribution", key])
    norm_on(model, twin)
    expected = []
    for x in later:
        expected.append(theirs(td(x))["attribution", key])
        torch.testing.assert_close(ours(td(x))["attribution", key], expected[-1], rtol=1e-9, atol=1e-12)
    assert max(e.abs().max() for e in expected) > 1e-3


@pytest.mark.parametrize("preset", [EpsilonPlus, AttnLRP, CPLRP], ids=["EpsilonPlus", "AttnLRP", "CPLRP"])
@pytest.mark.parametrize("kind", AFFINE)
def test_presets_match_the_norm_written_out_where_it_appears_after_the_first_call(kind, preset):
    model, twin = late_models(kind, head_misread(kind), "flag")
    first, later = first_and_later_inputs("flag")
    # As in test_presets_match_the_norm_written_out: the ruled norms get the ε-rule of their affine map.
    ruled = kind == "subclass forward" or (kind == "F.instance_norm running" and preset is not EpsilonPlus)
    tolerance = {"rtol": 1e-4, "atol": 1e-8} if ruled else {"rtol": 1e-9, "atol": 1e-12}
    ours = LRP(model, rule_mapper=preset(), in_keys=["x"], out_keys=["y"], target=UNIT)
    theirs = LRP(twin, rule_mapper=preset(), in_keys=["x"], out_keys=["y"], target=UNIT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ours, theirs:
            ours(td(first)), theirs(td(first))
            norm_on(model, twin)
            expected = [theirs(td(x))["relevance", "x"] for x in later]
            relevances = [ours(td(x))["relevance", "x"] for x in later]
    assert max(other.abs().max() for other in expected) > 1e-3
    for relevance, other in zip(relevances, expected, strict=True):
        torch.testing.assert_close(relevance, other, **tolerance)


def test_the_walk_hooks_no_norm_that_a_hook_lays_out(monkeypatch):
    """The later calls' walk finds the nodes of the BatchNorm and InstanceNorm modules laid out by their hooks (the
    instance norm's behind its view) and hooks none of them: it makes no Python call on such a model. It hooks the
    node of a norm called as a function once it appears."""
    hooked: list = []
    original = _norm_function_layout._input_layout_hooked

    def counted(node):
        hooked.append(type(node).__name__)
        return original(node)

    monkeypatch.setattr(_norm_function_layout, "_input_layout_hooked", counted)
    lrp, saliency, x = three_calls_of_module_norms()
    assert hooked == []
    late, _ = late_models("F.batch_norm", "transpose", "flag")
    saliency = Saliency(late, in_keys=["x"], out_keys=["y"], target=UNIT)
    saliency(td(x))
    late.normed = True
    saliency(td(x))
    assert hooked == ["NativeBatchNormBackward0"]


class TimesProjection(nn.Module):
    """``h * proj(h)`` of a model's output ``h``: a product of two activations, which AttnLRP and CP-LRP plan."""

    def __init__(self, model: nn.Module, proj: nn.Linear) -> None:
        super().__init__()
        self.model, self.proj = model, proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.model(x)
        return h * self.proj(h)


@pytest.mark.parametrize("preset", [AttnLRP, CPLRP], ids=["AttnLRP", "CPLRP"])
def test_planned_calls_skip_the_walk_until_a_norm_appears_and_then_lay_it_out(monkeypatch, preset):
    """A planned call whose graph has the recorded shape, without a node of the batch_norm kernel, marks its output,
    and the later calls' walk does not start there; a call whose forward makes a norm has another shape, is not
    planned, is walked, and equals the norm written out."""
    marked: list = []
    original = _explained_call.late_norm_nodes_laid_out

    def noted(*outputs):
        marked.append(all(NO_NORM_KERNEL_BELOW in output.grad_fn.metadata for output in outputs))
        return original(*outputs)

    monkeypatch.setattr(_explained_call, "late_norm_nodes_laid_out", noted)
    model, twin = late_models("F.batch_norm", "transpose", "flag")
    first, later = first_and_later_inputs("flag")
    product = nn.Linear(20, 20).to(F64)
    twin_product = nn.Linear(20, 20).to(F64)
    twin_product.load_state_dict(product.state_dict())
    ours = LRP(TimesProjection(model, product), rule_mapper=preset(), in_keys=["x"], out_keys=["y"], target=UNIT)
    theirs = LRP(TimesProjection(twin, twin_product), rule_mapper=preset(), in_keys=["x"], out_keys=["y"], target=UNIT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ours:
            for _ in range(3):  # the first call finds no norm; the plan recorded, then used
                ours(td(first))
            assert marked == [False, True, True]  # the planned calls: not walked
            model.normed = True
            relevances = [ours(td(x))["relevance", "x"] for x in later]
        # The first call after the norm appeared is walked (its shape is not the recorded one); the misread head
        # makes the norm's gradient wrong wherever that walk is skipped.
        assert marked[3] is False
        with theirs:
            theirs(td(first))
            twin.normed = True
            expected = [theirs(td(x))["relevance", "x"] for x in later]
    for relevance, other in zip(relevances, expected, strict=True):
        torch.testing.assert_close(relevance, other, rtol=1e-9, atol=1e-12)


def test_an_output_marked_without_norm_kernels_below_is_not_walked():
    x = torch.randn(4, 3, 5, 1, dtype=F64, requires_grad=True)
    stats = torch.zeros(3, dtype=F64), torch.ones(3, dtype=F64)
    y, z = (F.batch_norm(x, *stats) * 2 for _ in range(2))
    y.grad_fn.metadata[NO_NORM_KERNEL_BELOW] = True
    assert late_norm_nodes_laid_out(y) == 0 and late_norm_nodes_laid_out(z) == 1
