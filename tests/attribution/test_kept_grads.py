"""A model whose own backward writes its parameters' ``.grad`` comes out of every call with them as they went in.

A custom ``torch.autograd.Function`` whose backward calls ``torch.autograd.backward`` (as Hugging Face Reformer's
reversible layers do) accumulates into the ``.grad`` of the parameters it reaches; the wrappers take their
gradients with ``torch.autograd.grad``, which writes none, and put back what such a backward wrote.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import (
    CPLRP,
    LRP,
    EpsilonPlus,
    GradCAM,
    GradientShap,
    GuidedBackprop,
    InputXGradient,
    IntegratedGradients,
    Saliency,
    SmoothGrad,
    _kept_grads,
)

F64 = torch.float64


class _ScaledWithOwnBackward(torch.autograd.Function):
    """``x * scale``, whose backward also runs ``torch.autograd.backward`` on a product with ``scale`` (a
    parameter): it accumulates into ``scale.grad``, as a reversible layer's recomputation does."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, scale)
        return x * scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        x, scale = ctx.saved_tensors
        with torch.enable_grad():
            torch.autograd.backward((x.detach() * scale * grad).sum())
        return grad * scale.detach(), None


class OwnBackwardNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(3, 4)
        self.scale = nn.Parameter(torch.rand(4) + 0.5)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(_ScaledWithOwnBackward.apply(torch.relu(self.first(x)), self.scale))


def own_backward_module() -> TensorDictModule:
    torch.manual_seed(0)
    return TensorDictModule(OwnBackwardNet().double(), in_keys=["x"], out_keys=["y"])


def set_some_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Give every other parameter a ``.grad`` (the model's own ``scale`` among them); the ``.grad`` of each, as set."""
    for i, (_, p) in enumerate(model.named_parameters()):
        p.grad = torch.randn_like(p) if i % 2 == 0 or p.ndim == 1 and p.shape[0] == 4 else None
    return {name: p.grad for name, p in model.named_parameters()}


def assert_grads_as_set(model: nn.Module, grads: dict[str, torch.Tensor | None], values: dict) -> None:
    for name, p in model.named_parameters():
        if grads[name] is None:
            assert p.grad is None, f"{name}: .grad set by the call"
        else:
            assert p.grad is grads[name], f"{name}: .grad replaced by the call"
            assert torch.equal(p.grad, values[name]), f"{name}: .grad off by {(p.grad - values[name]).abs().max()}"


def batch() -> TensorDict:
    return TensorDict(x=torch.randn(5, 3, dtype=F64), batch_size=[5])


def test_the_model_writes_its_grads_without_the_wrapper():
    """The premise: the model's own backward writes ``scale.grad``, even under ``torch.autograd.grad``."""
    model = own_backward_module()
    x = torch.randn(5, 3, dtype=F64, requires_grad=True)
    torch.autograd.grad(model.module(x).sum(), x)
    assert model.module.scale.grad is not None


def wrappers() -> dict:
    return {
        "LRP": lambda m: LRP(m, EpsilonPlus()),
        "Saliency": Saliency,
        "InputXGradient": InputXGradient,
        "IntegratedGradients": lambda m: IntegratedGradients(m, n_steps=4),
        "SmoothGrad": lambda m: SmoothGrad(m, n_samples=3),
        "GradientShap": lambda m: GradientShap(m, baselines=torch.zeros(2, 3, dtype=F64), n_samples=3),
        "GuidedBackprop": GuidedBackprop,
        "GradCAM": lambda m: GradCAM(m, layer="module.first"),
    }


@pytest.mark.parametrize("name", list(wrappers()))
@pytest.mark.parametrize("preset", [False, True])
def test_a_call_leaves_the_parameters_grad_as_it_found_it(name: str, preset: bool):
    """``None`` stays ``None``; a ``.grad`` that was set is the same tensor with the same values. Before, the
    call wrote ``scale.grad`` (set from ``None``, or added into: off by the call's whole gradient to ``scale``)."""
    model = own_backward_module()
    grads = set_some_grads(model.module) if preset else {n: None for n, _ in model.module.named_parameters()}
    values = {n: None if g is None else g.clone() for n, g in grads.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the custom Function keeps its plain gradient, which LRP names
        wrappers()[name](model)(batch())
    assert_grads_as_set(model.module, grads, values)


def test_every_call_of_an_open_context_leaves_the_grads_as_they_were():
    """The first call finds that the model's backward writes a ``.grad``: the later calls keep them too."""
    model = own_backward_module()
    lrp = LRP(model, EpsilonPlus())
    with warnings.catch_warnings(), lrp:
        warnings.simplefilter("ignore")
        for _ in range(3):
            grads = set_some_grads(model.module)
            values = {n: None if g is None else g.clone() for n, g in grads.items()}
            lrp(batch())
            assert_grads_as_set(model.module, grads, values)


def test_the_relevance_is_the_same_with_the_grads_set_or_not():
    model = own_backward_module()
    td = batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = LRP(model, EpsilonPlus())(td.clone())["relevance", "x"]
        set_some_grads(model.module)
        assert torch.equal(LRP(model, EpsilonPlus())(td.clone())["relevance", "x"], plain)


class Failing(Exception):
    pass


def test_a_failing_call_puts_the_grads_back():
    model = own_backward_module()
    grads = set_some_grads(model.module)
    values = {n: None if g is None else g.clone() for n, g in grads.items()}

    def fail(*_):
        raise Failing

    model.module.head.register_forward_hook(fail)
    with pytest.raises(Failing):
        LRP(model, EpsilonPlus())(batch())
    assert_grads_as_set(model.module, grads, values)


def test_later_calls_of_a_context_skip_the_check_where_the_first_wrote_no_grad(monkeypatch):
    """On a model whose backward writes no ``.grad``, only the context's first call walks the parameters."""
    torch.manual_seed(0)
    model = TensorDictModule(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double(), ["x"], ["y"])
    entered = []
    enter = _kept_grads._SetAside.__enter__
    monkeypatch.setattr(_kept_grads._SetAside, "__enter__", lambda self: entered.append(1) or enter(self))
    lrp = LRP(model, EpsilonPlus())
    with lrp:
        for _ in range(3):
            lrp(batch())
    assert len(entered) == 1
    with lrp:  # a new context checks again
        lrp(batch())
    assert len(entered) == 2


def test_reformers_reversible_layers_leave_the_grads_as_they_were():
    """Hugging Face Reformer's reversible layers recompute their forward in their backward and call
    ``torch.autograd.backward``: before, one CP-LRP call set the ``.grad`` of 16 of the model's 31 parameters."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.ReformerConfig(
        hidden_size=32,
        attn_layers=["local", "local"],
        axial_pos_embds=False,
        local_attn_chunk_length=4,
        is_decoder=True,
        vocab_size=50,
        num_attention_heads=2,
        attention_head_size=16,
        feed_forward_size=32,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        local_attention_probs_dropout_prob=0.0,
        lsh_attention_probs_dropout_prob=0.0,
    )
    reformer = transformers.ReformerModelWithLMHead(config).double().train()

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = reformer

        def forward(self, embeds: torch.Tensor) -> torch.Tensor:
            return self.model(inputs_embeds=embeds).logits

    model = TensorDictModule(Logits(), in_keys=["x"], out_keys=["y"])
    set_before = dict(list(reformer.named_parameters())[-8:])  # some of the reversible layers' own among them
    for p in set_before.values():
        p.grad = torch.randn_like(p)
    grads = {name: set_before[name].grad if name in set_before else None for name, _ in reformer.named_parameters()}
    values = {n: None if g is None else g.clone() for n, g in grads.items()}
    td = TensorDict(x=torch.randn(2, 8, 32, dtype=F64), batch_size=[2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reversible layers keep their plain gradient, which LRP names
        LRP(model, CPLRP(), target=3)(td)
    assert_grads_as_set(reformer, grads, values)
