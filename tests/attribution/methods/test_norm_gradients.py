"""The gradient methods through a BatchNorm or InstanceNorm whose output is transposed (float64, against finite
differences and the norm written out as elementwise operations).

PyTorch's CPU backward of ``batch_norm`` misreads an incoming gradient laid out unlike the norm's output when a
spatial size of 1 makes the layout ambiguous (a ``[N, C, H, 1]`` output transposed before the head): the input
gradient came out about 1.1 off (relative L2) with no error. Every method that differentiates the model inherited it.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import (
    GradCAM,
    GradientShap,
    GuidedBackprop,
    InputXGradient,
    IntegratedGradients,
    Saliency,
    SmoothGrad,
)
from tdhook.attribution.methods._norm_gradients import norm_gradients_laid_out

F64 = torch.float64


class NormedHead(nn.Module):
    """Conv2d to ``[N, 3, 5, 1]``, a norm, then the head reads the channels last (``transpose``) or the rows first
    (``permute``, a time-major read); with ``written_out`` the norm is computed from elementwise operations."""

    def __init__(self, norm: nn.Module, head: str, written_out: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, (1, 2))
        self.norm = norm
        self.lin = nn.Linear(3, 4)
        self.register_buffer("mask", torch.rand(5, 3, dtype=F64))
        self.head, self.written_out = head, written_out

    def normed(self, z: torch.Tensor) -> torch.Tensor:
        if not self.written_out:
            return self.norm(z)
        norm, dims = self.norm, (2, 3) if isinstance(self.norm, nn.InstanceNorm2d) else (0, 2, 3)
        if norm.training or not norm.track_running_stats:
            mean, var = z.mean(dims, keepdim=True), z.var(dims, unbiased=False, keepdim=True)
        else:
            mean, var = norm.running_mean.view(1, -1, 1, 1), norm.running_var.view(1, -1, 1, 1)
        return (z - mean) / torch.sqrt(var + norm.eps) * norm.weight.view(1, -1, 1, 1) + norm.bias.view(1, -1, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.normed(self.conv(x))  # [N, 3, 5, 1]
        if self.head == "transpose":
            out = self.lin(z.transpose(1, 2).squeeze(-1) * self.mask)  # [N, 5, 4]
        else:  # time-major: [5, N, 4], then batch-major again
            out = self.lin(z.permute(2, 0, 1, 3).squeeze(-1) * self.mask[:, None]).transpose(0, 1)
        return out.pow(2).sum(1)


def models(kind: str, head: str) -> tuple[nn.Module, nn.Module]:
    """The model and its twin with the norm written out (same parameters)."""
    torch.manual_seed(0)
    norm = nn.InstanceNorm2d(3, affine=True) if kind == "instance" else nn.BatchNorm2d(3)
    norm = norm.to(F64)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 2.0)
        norm.bias.uniform_(-1.0, 1.0)
        if kind != "instance":
            norm.running_mean.uniform_(-1.0, 1.0)
            norm.running_var.uniform_(0.5, 2.0)
    model = NormedHead(norm, head).to(F64)
    twin = NormedHead(norm, head, written_out=True).to(F64)
    twin.load_state_dict(model.state_dict())
    training = kind == "batch-train"
    return model.train(training), twin.train(training)


def finite_difference_gradient(model: nn.Module, x: torch.Tensor, unit: int, h: float = 1e-6) -> torch.Tensor:
    """Central differences of ``model(x)[:, unit].sum()`` (the running statistics moved by the probes are put back)."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grad = torch.zeros_like(x)
    with torch.no_grad():
        for i in range(x.numel()):
            step = torch.zeros_like(x).view(-1)
            step[i] = h
            step = step.view_as(x)
            grad.view(-1)[i] = (model(x + step)[:, unit].sum() - model(x - step)[:, unit].sum()) / (2 * h)
    model.load_state_dict(state)
    return grad


KINDS = ["batch-eval", "batch-train", "instance"]
HEADS = ["transpose", "permute"]
METHODS = {
    "Saliency": lambda m: Saliency(m, in_keys=["x"], out_keys=["y"], target=1, abs=False),
    "InputXGradient": lambda m: InputXGradient(m, in_keys=["x"], out_keys=["y"], target=1),
    "IntegratedGradients": lambda m: IntegratedGradients(m, in_keys=["x"], out_keys=["y"], target=1, n_steps=6),
    "GradientShap": lambda m: GradientShap(
        m, in_keys=["x"], out_keys=["y"], target=1, baselines=torch.zeros(1, 2, 5, 2, dtype=F64), n_samples=3, seed=0
    ),
    "SmoothGrad": lambda m: SmoothGrad(m, in_keys=["x"], out_keys=["y"], target=1, n_samples=3, seed=0),
    "GuidedBackprop": lambda m: GuidedBackprop(m, in_keys=["x"], out_keys=["y"], target=1),
    "GradCAM": lambda m: GradCAM(m, layer="conv", in_keys=["x"], out_keys=["y"], target=1, relu=False),
}


def attribution(method: nn.Module, x: torch.Tensor) -> torch.Tensor:
    td = method(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))
    return td["attribution", "conv" if isinstance(method, GradCAM) else "x"]


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("kind", KINDS)
def test_saliency_is_the_finite_difference_gradient(kind, head):
    model, twin = models(kind, head)
    x = torch.randn(4, 2, 5, 2, dtype=F64)
    expected = finite_difference_gradient(model, x, unit=1)
    # The twin's autograd gradient is the oracle of the other methods: it is the finite differences' too.
    leaf = x.clone().requires_grad_(True)
    (twin_grad,) = torch.autograd.grad(twin(leaf)[:, 1].sum(), leaf)
    torch.testing.assert_close(twin_grad, expected, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(attribution(METHODS["Saliency"](model), x), expected, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("name", [name for name in METHODS if name != "Saliency"])
@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("kind", KINDS)
def test_methods_match_the_norm_written_out(kind, head, name):
    if kind == "instance" and name == "GradCAM":
        pytest.skip("an InstanceNorm's output is shift-invariant per channel: the spatial mean of its gradient is 0")
    model, twin = models(kind, head)
    x = torch.randn(4, 2, 5, 2, dtype=F64)
    expected = attribution(METHODS[name](twin), x)
    assert expected.abs().max() > 1e-3
    torch.testing.assert_close(attribution(METHODS[name](model), x), expected, rtol=1e-9, atol=1e-12)


def test_nothing_is_left_on_the_model():
    model, _ = models("batch-eval", "transpose")
    x = torch.randn(4, 2, 5, 2, dtype=F64)
    attribution(METHODS["Saliency"](model), x)
    assert all(not m._forward_hooks for m in model.modules())
    with pytest.raises(RuntimeError, match="boom"), norm_gradients_laid_out(model):
        assert len(model.norm._forward_hooks) == 1
        raise RuntimeError("boom")
    assert not model.norm._forward_hooks


def test_gradient_laid_out_unlike_the_output_reaches_the_norm_as_the_output():
    norm = nn.BatchNorm3d(3).to(F64).eval()
    with torch.no_grad():
        norm.running_var.uniform_(0.5, 2.0)
        norm.weight.uniform_(0.5, 2.0)
    x = torch.randn(2, 3, 4, 1, 1, dtype=F64, requires_grad=True)
    grad = torch.randn(2, 4, 1, 1, 3, dtype=F64).permute(0, 4, 1, 2, 3)  # channels last, unlike the output
    with norm_gradients_laid_out(norm):
        out = norm(x)
    (gx,) = torch.autograd.grad(out, x, grad)
    scale = (norm.weight / torch.sqrt(norm.running_var + norm.eps)).view(1, 3, 1, 1, 1)
    torch.testing.assert_close(gx, grad * scale, rtol=1e-12, atol=1e-14)


def test_an_interrupt_while_the_hooks_are_put_leaves_none_on_the_model(monkeypatch):
    """An interrupt as the second norm takes its hook: the first norm's hook is removed all the same (it was left on
    the model, laying out every later gradient that reaches it)."""
    model = nn.Sequential(nn.BatchNorm1d(3), nn.Linear(3, 3), nn.BatchNorm1d(3))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(model[2], "register_forward_hook", interrupted)
    with pytest.raises(KeyboardInterrupt), norm_gradients_laid_out(model):
        pass
    assert not model[0]._forward_hooks
