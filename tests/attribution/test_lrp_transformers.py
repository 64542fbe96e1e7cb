"""AttnLRP and CP-LRP on torch's attention modules, against the attention written out by hand.

Each reference below re-implements the model with plain torch operations and
spells the rules out with ``detach``: half of a product's gradient to each factor
(``0.5 * a + 0.5 * a.detach()``), attention weights detached for CP-LRP, the
normalising scale of LayerNorm detached, activations replaced by ``x * (f(x) / x)``
with the ratio detached. Relevance is then gradient × input of the reference.
"""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.rules import CPLRP, AttnLRP
from tests.conftest import relative_error

F64 = torch.float64
VARIANTS = {"attnlrp": AttnLRP, "cp": CPLRP}


def half(t: torch.Tensor) -> torch.Tensor:
    return 0.5 * t + 0.5 * t.detach()


def layer_norm(norm: nn.LayerNorm, h: torch.Tensor) -> torch.Tensor:
    centred = h - h.mean(-1, keepdim=True)
    sigma = (centred.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt().detach()
    return centred / sigma * norm.weight + norm.bias


def identity_rule(f, h: torch.Tensor) -> torch.Tensor:
    return h * (f(h) / h).detach()


def self_attention(mha: nn.MultiheadAttention, h: torch.Tensor, variant: str) -> torch.Tensor:
    embed, heads = mha.embed_dim, mha.num_heads
    batch, length, _ = h.shape
    q, k, v = (h @ mha.in_proj_weight.T + mha.in_proj_bias).split(embed, -1)
    q, k, v = (t.reshape(batch, length, heads, embed // heads).transpose(1, 2) for t in (q, k, v))
    if variant == "attnlrp":
        q, k = half(q), half(k)
    weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(embed // heads), -1)
    out = weights.detach() @ v if variant == "cp" else half(weights) @ half(v)
    return mha.out_proj(out.transpose(1, 2).reshape(batch, length, embed))


def encoder_layer(layer: nn.TransformerEncoderLayer, x: torch.Tensor, variant: str, activation) -> torch.Tensor:
    def feed_forward(h):
        return layer.linear2(identity_rule(activation, layer.linear1(h)))

    if layer.norm_first:
        x = x + self_attention(layer.self_attn, layer_norm(layer.norm1, x), variant)
        return x + feed_forward(layer_norm(layer.norm2, x))
    x = layer_norm(layer.norm1, x + self_attention(layer.self_attn, x, variant))
    return layer_norm(layer.norm2, x + feed_forward(x))


def reference_relevance(forward, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = x.clone().requires_grad_(True)
    out = forward(leaf)
    (grad,) = torch.autograd.grad(out, leaf, torch.zeros_like(out).scatter_(-1, out.argmax(-1, keepdim=True), 1.0))
    return out.detach(), x * grad


def snapshot(model: nn.Module) -> dict:
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "hooks": [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()],
        "forwards": [type(m).forward for m in model.modules()] + [m.__dict__.get("forward") for m in model.modules()],
    }


def assert_restored(model: nn.Module, before: dict) -> None:
    after = snapshot(model)
    assert after["hooks"] == before["hooks"] and after["forwards"] == before["forwards"]
    assert before["state"].keys() == after["state"].keys()
    for key, value in before["state"].items():
        assert torch.equal(value, after["state"][key]), key


class SelfAttention(nn.Module):
    def __init__(self, need_weights: bool) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True, dtype=F64)
        self.need_weights = need_weights

    def forward(self, x):
        return self.mha(x, x, x, need_weights=self.need_weights)[0]


def explain(model: nn.Module, mapper, x: torch.Tensor) -> TensorDict:
    return LRP(model, mapper, in_keys=["x"], out_keys=["y"])(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("need_weights", [True, False], ids=["bmm-softmax", "fused"])
def test_multihead_attention(variant: str, need_weights: bool):
    model = SelfAttention(need_weights).eval()
    x = torch.randn(3, 5, 8, dtype=F64)
    td = explain(model, VARIANTS[variant](), x)
    out, expected = reference_relevance(lambda h: self_attention(model.mha, h, variant), x)
    torch.testing.assert_close(td["y"], out)
    assert relative_error(td["relevance", "x"], expected) <= 1e-12


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_transformer_encoder(variant: str, norm_first: bool, activation: str):
    layer = nn.TransformerEncoderLayer(
        8, 2, 16, dropout=0.0, batch_first=True, norm_first=norm_first, activation=activation, dtype=F64
    )
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(3, 5, 8, dtype=F64)
    plain = model(x)
    before = snapshot(model)

    td = explain(model, VARIANTS[variant](), x)
    assert torch.equal(td["y"], plain)  # the forward pass is not changed, bit for bit
    assert torch.isfinite(td["relevance", "x"]).all()
    assert_restored(model, before)
    assert torch.equal(model(x), plain)

    f = torch.relu if activation == "relu" else nn.functional.gelu

    def reference(h):
        for encoder_layer_ in model.layers:
            h = encoder_layer(encoder_layer_, h, variant, f)
        return h

    out, expected = reference_relevance(reference, x)
    torch.testing.assert_close(out, plain)
    # GELU's identity rule divides by x + 1e-10 (PseudoIdentityRule's stabilizer); the reference divides by x.
    assert relative_error(td["relevance", "x"], expected) <= (1e-12 if activation == "relu" else 1e-8)


def test_cp_lrp_on_an_encoder_is_gradient_times_input_with_attention_weights_detached():
    """With ε → 0 and ReLU, CP-LRP is gradient × input of the encoder with its attention weights detached.

    LayerNorm's scale is made constant (``eps`` far above the variance, the weight
    scaled back up), so that the reference can keep the real LayerNorm modules.
    """
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, layer_norm_eps=1e12, dtype=F64)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    with torch.no_grad():
        for norm in (m for m in model.modules() if isinstance(m, nn.LayerNorm)):
            norm.weight.fill_(1e6)
    x = torch.randn(4, 6, 8, dtype=F64)
    td = explain(model, CPLRP(epsilon=1e-12), x)

    def detached_attention(h):
        for lay in model.layers:
            h = lay.norm1(h + self_attention(lay.self_attn, h, "cp"))
            h = lay.norm2(h + lay.linear2(torch.relu(lay.linear1(h))))
        return h

    _, expected = reference_relevance(detached_attention, x)
    assert relative_error(td["relevance", "x"], expected) <= 1e-9
    # The full gradient (attention weights not detached) is measurably different: the test can tell.
    leaf = x.clone().requires_grad_(True)
    out = model(leaf)
    (grad,) = torch.autograd.grad(out, leaf, torch.zeros_like(out).scatter_(-1, out.argmax(-1, keepdim=True), 1.0))
    assert relative_error(x * grad, expected) > 1e-3


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``, the feed-forward block of Llama-style models."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up, self.down = (
            nn.Linear(6, 12, dtype=F64),
            nn.Linear(6, 12, dtype=F64),
            nn.Linear(12, 6, dtype=F64),
        )
        self.act = nn.SiLU()

    def forward(self, x):
        return self.down(self.act(self.gate(x)) * self.up(x))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gated_mlp_shares_relevance_uniformly_or_holds_the_gate(variant: str):
    """AttnLRP: half of the product's relevance to the gate and half to the up path;
    CP-LRP (as LXT): the gate is held constant, the up path gets it all."""
    model = GatedMLP()
    x = torch.randn(4, 6, dtype=F64)
    td = explain(model, VARIANTS[variant](), x)

    def reference(h):
        gate = identity_rule(nn.functional.silu, model.gate(h))
        gate, up = (gate.detach(), model.up(h)) if variant == "cp" else (half(gate), half(model.up(h)))
        return model.down(gate * up)

    out, expected = reference_relevance(reference, x)
    torch.testing.assert_close(td["y"], out)
    assert relative_error(td["relevance", "x"], expected) <= 1e-8  # SiLU's ratio uses x + 1e-10


def test_function_rules_resume_after_a_module_with_a_rule_raises():
    """Modules with a rule of their own run without the function modes; an exception there must not leak that."""
    model = nn.Sequential(nn.Linear(8, 8, dtype=F64), nn.Linear(4, 2, dtype=F64))  # the second layer cannot run
    lrp = LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"])
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        lrp(TensorDict(x=torch.randn(3, 8, dtype=F64), batch_size=[3]))
    assert torch._C._is_torch_function_enabled() and not torch._C._is_torch_function_mode_enabled()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    # And the next call, with a model that runs, gets the attention rules again.
    test_multihead_attention("attnlrp", need_weights=True)
