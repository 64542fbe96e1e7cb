"""Differentiable relevance beyond the dense-layer rules: transformers (AttnLRP, CP-LRP), held gates and routers,
norms, recurrent layers, stopped branches, uniform splits and stabilised additions.

The oracle, in float64: central finite differences of ``(relevance · weights).sum()`` (the ordinary call) along
random directions, one tensor at a time (the input and every parameter), at points away from kinks; and the
relevance of ``create_graph=True`` equal to the ordinary relevance.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn
from torchrl.modules import BatchRenorm1d

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.rules import CPLRP, AttnLRP
from tdhook.attribution.mappers.presets import EpsilonPlus, UniformEpsilon
from tdhook.attribution.rules import (
    EpsilonRule,
    FlatRule,
    NormRule,
    RecurrentRule,
    StopRule,
    TaylorDecompositionRule,
    UniformEpsilonRule,
    UniformRule,
)

F64 = torch.float64
STEP = 1e-6
TOLERANCE = 1e-6


def explain(lrp: LRP, x: torch.Tensor, key: str = "x") -> torch.Tensor:
    return lrp(TensorDict({key: x}, batch_size=x.shape[:1]))["relevance", key]


def directional_errors(
    net: nn.Module,
    mapper: Callable[[], object],
    x: torch.Tensor,
    key: str = "x",
    directions: int = 2,
    step: float = STEP,
) -> dict[str, float]:
    """The relative error of ``LRP(..., create_graph=True)``'s derivative along random directions, per tensor (the
    input and every parameter), against central finite differences of the ordinary call; ``"values"`` compares the
    relevance of the two calls. An error is relative to the derivative's size, or to a hundredth of the largest
    one where it is smaller (a tiny derivative is mostly finite-difference noise)."""
    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(x.shape, generator=generator, dtype=x.dtype)
    plain = LRP(net, mapper(), in_keys=[key], out_keys=["y"])
    kept = LRP(net, mapper(), in_keys=[key], out_keys=["y"], create_graph=True)
    point = x.clone().requires_grad_(True)
    relevance = explain(kept, point, key)
    named = {"input": point, **dict(net.named_parameters())}
    grads = torch.autograd.grad((relevance * weights).sum(), list(named.values()), allow_unused=True)
    values = relevance.detach()
    rows = []
    with plain:  # parameter writes are seen by the rules (their fingerprint changes)
        reference = explain(plain, x, key)
        for (name, tensor), grad in zip(named.items(), grads, strict=True):
            target = x if name == "input" else tensor
            for _ in range(directions):
                direction = torch.randn(target.shape, generator=generator, dtype=target.dtype)
                losses = []
                for sign in (1.0, -1.0):
                    with torch.no_grad():
                        target.add_(sign * step * direction)
                    losses.append((explain(plain, x, key) * weights).sum().item())
                    with torch.no_grad():
                        target.sub_(sign * step * direction)
                expected = (losses[0] - losses[1]) / (2 * step)
                actual = 0.0 if grad is None else (grad * direction).sum().item()
                rows.append((name, expected, actual))
    largest = max(abs(expected) for _, expected, _ in rows)
    errors = {"values": ((values - reference).norm() / reference.norm()).item()}
    for name, expected, actual in rows:
        error = abs(actual - expected) / max(abs(expected), 1e-2 * largest)
        errors[name] = max(errors.get(name, 0.0), error)
    return errors


def assert_exact(errors: dict[str, float], values: float = 1e-12) -> None:
    assert errors.pop("values") < values
    worst = max(errors, key=errors.get)
    assert errors[worst] < TOLERANCE, f"{worst}: {errors[worst]:.2e}"


def layer_margin(net: nn.Module, run: Callable[[], object], kinds: tuple = (nn.Linear,)) -> float:
    """The smallest absolute output of the ``kinds`` layers and input of a softmax in ``run()`` (where the ε-rules
    switch sign), masked logits left out."""
    seen: list[float] = []

    class Softmaxes(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (F.softmax, torch.softmax, torch.Tensor.softmax):
                logits = args[0].detach()
                seen.append(logits[logits > torch.finfo(logits.dtype).min].abs().min().item())
            return func(*args, **(kwargs or {}))

    hooks = [
        m.register_forward_hook(lambda m, a, out: seen.append(out.abs().min().item()))
        for m in net.modules()
        if isinstance(m, kinds)
    ]
    try:
        with torch.no_grad(), Softmaxes():
            run()
    finally:
        for hook in hooks:
            hook.remove()
    return min(seen)


def smooth(make: Callable[[int], tuple[nn.Module, torch.Tensor]], kinds: tuple = (nn.Linear,), margin: float = 1e-3):
    """The first model and input (by seed) whose ε-ruled outputs and softmax logits keep ``margin`` away from 0."""
    for seed in range(100):
        net, x = make(seed)
        if layer_margin(net, lambda net=net, x=x: net(x), kinds) > margin:
            return net, x
    raise AssertionError("no point away from kinks")


# ---------------------------------------------------------------------------------------------- transformers


def encoder(seed: int, norm_first: bool = True) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(
        8, 2, 16, dropout=0.0, batch_first=True, norm_first=norm_first, activation="gelu"
    )
    net = nn.Sequential(layer, nn.Flatten(), nn.Linear(24, 3)).to(F64).eval()
    return net, torch.randn(2, 3, 8, dtype=F64)


TRANSFORMER_PRESETS = {
    "AttnLRP(ε=0.1, softmax ε=0.1)": lambda: AttnLRP(epsilon=0.1, softmax_epsilon=0.1),
    "AttnLRP()": lambda: AttnLRP(),
    "CPLRP(ε=0.1)": lambda: CPLRP(epsilon=0.1),
}


class TestTransformers:
    @pytest.mark.filterwarnings("ignore:LRP. EpsilonRule")  # out_proj, computed by its parent (a known warning)
    @pytest.mark.parametrize("norm_first", [True, False])
    @pytest.mark.parametrize("preset", sorted(TRANSFORMER_PRESETS))
    def test_encoder_layer(self, preset, norm_first):
        """nn.TransformerEncoderLayer: LayerNormRule, the uniform (AttnLRP) or held (CP-LRP) attention, the
        softmax rule, the identity rule on GELU; the fused attention is computed unfused here."""
        net, x = smooth(lambda seed: encoder(seed, norm_first))
        assert_exact(directional_errors(net, TRANSFORMER_PRESETS[preset], x))

    @pytest.mark.parametrize("preset", ["AttnLRP(ε=0.1, softmax ε=0.1)", "CPLRP(ε=0.1)"])
    @pytest.mark.parametrize("kind", ["gpt2", "llama"])
    def test_hugging_face(self, kind, preset):
        """Tiny random GPT-2 (eager attention, Conv1D) and Llama (sdpa attention, grouped keys and values, rotary
        embeddings, RMSNorm, a gated MLP), both with causal masks."""
        pytest.importorskip("transformers")
        net, x = smooth_language_model(kind)
        errors = directional_errors(net, TRANSFORMER_PRESETS[preset], x, key="embeds", directions=1, step=1e-7)
        assert_exact(errors)

    @pytest.mark.filterwarnings("ignore:LRP. EpsilonRule")
    def test_values_of_every_attention_path(self):
        """With ``create_graph`` the relevance equals the ordinary call's, where the ordinary call uses the fused
        attention kernel (AttnLRP with softmax ε = 0, CP-LRP)."""
        net, x = encoder(0)
        for preset in TRANSFORMER_PRESETS.values():
            plain = explain(LRP(net, preset(), in_keys=["x"], out_keys=["y"]), x)
            kept = explain(LRP(net, preset(), in_keys=["x"], out_keys=["y"], create_graph=True), x)
            assert kept.requires_grad and torch.allclose(kept, plain, rtol=1e-10, atol=1e-13)

    @pytest.mark.parametrize("preset", [AttnLRP, CPLRP])
    def test_values_of_routing_weights_selected_after_the_router(self, preset):
        """DBRX weighs its router's held logits outside the router (softmax, ``topk``, a norm): ``topk``'s values,
        made of held tensors alone, stay constants with ``create_graph`` (they were taken for activations: the
        relevance was 22-26 % off the ordinary call's, and the norm was reported as not piecewise linear)."""
        pytest.importorskip("transformers")
        from tests.attribution.test_lrp_transformer_zoo import ZOO, Explained, model_input

        net, x = Explained(ZOO["dbrx"].build("eager")), model_input(ZOO["dbrx"])
        plain = explain(LRP(net, preset(), in_keys=["x"], out_keys=["y"]), x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            kept = explain(LRP(net, preset(), in_keys=["x"], out_keys=["y"], create_graph=True), x)
        assert kept.requires_grad and torch.allclose(kept, plain, rtol=1e-10, atol=1e-13)


class TestSeveralPasses:
    @pytest.mark.filterwarnings("ignore:LRP. EpsilonRule")
    def test_every_unit_at_once(self):
        """``target="all"`` (one relevance pass per unit over one forward pass) through the function rules: each
        unit's relevance and its derivative are those of a call for that unit alone."""
        net, x = smooth(encoder)
        weights = torch.randn(2, 3, 3, 8, dtype=F64)
        kept = LRP(net, CPLRP(epsilon=0.1), in_keys=["x"], out_keys=["y"], create_graph=True, target="all")
        every = explain(kept, x)
        assert every.shape == (2, 3, 3, 8)
        params = list(net.parameters())
        together = torch.autograd.grad((every * weights).sum(), params, allow_unused=True, materialize_grads=True)
        alone = [torch.zeros_like(p) for p in params]
        for unit in range(3):
            single = LRP(net, CPLRP(epsilon=0.1), in_keys=["x"], out_keys=["y"], create_graph=True, target=unit)
            one = explain(single, x)
            assert torch.allclose(one, every[:, unit], rtol=1e-10, atol=1e-13)
            grads = torch.autograd.grad(
                (one * weights[:, unit]).sum(), params, allow_unused=True, materialize_grads=True
            )
            alone = [a + g for a, g in zip(alone, grads, strict=True)]
        for a, b in zip(together, alone, strict=True):
            assert torch.allclose(a, b, rtol=1e-9, atol=1e-12)


def smooth_language_model(kind: str) -> tuple[nn.Module, torch.Tensor]:
    """A tiny random GPT-2 or Llama (next-token logits from embeddings) and embeddings away from kinks."""
    from tests.attribution.test_lrp_huggingface import LastLogits, build

    model = build(kind)
    if kind == "llama":  # its RMSNorm and eager softmax compute in float32: too coarse for the oracle
        model.config._attn_implementation = "sdpa"
        for module in model.modules():
            if type(module).__name__ == "LlamaRMSNorm":
                module.forward = _rms_norm_in_float64.__get__(module)

    def make(seed: int) -> tuple[nn.Module, torch.Tensor]:
        torch.manual_seed(seed)
        return LastLogits(model), model.get_input_embeddings()(torch.randint(0, 64, (2, 5))).detach()

    # Thousands of outputs: some come within 1e-3 of a sign switch, so the steps are smaller.
    return smooth(make, (nn.Linear, *_hf_conv1d()), margin=2e-4)


def _rms_norm_in_float64(self, hidden: torch.Tensor) -> torch.Tensor:
    return self.weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _hf_conv1d() -> tuple:
    from transformers.pytorch_utils import Conv1D

    return (Conv1D,)


# ---------------------------------------------------------------------------------------------- gates and routers


class SqueezeExcite(nn.Module):
    """A convolution whose channels are gated by a sigmoid of their pooled values (a module or a function)."""

    def __init__(self, functional: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.fc1, self.fc2 = nn.Linear(4, 3), nn.Linear(3, 4)
        self.sigmoid = None if functional else nn.Sigmoid()
        self.head = nn.Linear(4 * 5 * 5, 3)
        self.act1, self.act2 = nn.Tanh(), nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act1(self.conv(x))
        s = self.fc2(self.act2(self.fc1(h.mean((2, 3)))))
        gate = torch.sigmoid(s) if self.sigmoid is None else self.sigmoid(s)
        return self.head((h * gate[:, :, None, None]).flatten(1))


class Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.topk(torch.softmax(F.linear(x, self.weight), -1), 2, dim=-1)


class Mixture(nn.Module):
    """Two of three experts per sample, weighted by the router's softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.router = Router()
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, index = self.router(x)
        outputs = torch.stack([expert(x) for expert in self.experts], 1)  # [B, experts, 4]
        chosen = outputs.gather(1, index[..., None].expand(-1, -1, 4))
        return self.head((weights[..., None] * chosen).sum(1))


def mixture(seed: int) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    return Mixture().to(F64), torch.randn(4, 4, dtype=F64)


def squeeze_excite(functional: bool) -> Callable[[int], tuple[nn.Module, torch.Tensor]]:
    def make(seed: int) -> tuple[nn.Module, torch.Tensor]:
        torch.manual_seed(seed)
        return SqueezeExcite(functional).to(F64), torch.randn(3, 2, 5, 5, dtype=F64)

    return make


class TestGates:
    @pytest.mark.parametrize("functional", [False, True], ids=["GateRule module", "sigmoid function"])
    def test_squeeze_excite(self, functional):
        """The gate is held for the relevance, and its derivative reaches fc1 and fc2 through its value."""
        net, x = smooth(squeeze_excite(functional), (nn.Linear, nn.Conv2d))
        errors = directional_errors(net, lambda: EpsilonPlus(epsilon=0.1), x)
        assert_exact(errors)

    def test_a_detached_gate_is_visibly_wrong(self, monkeypatch):
        """The oracle tells a held gate from a detached one: detaching cuts the derivative through the gate."""
        from tdhook.attribution.rules import gates

        net, x = smooth(squeeze_excite(False), (nn.Linear, nn.Conv2d))
        monkeypatch.setattr(gates, "hold", lambda tensor: tensor.detach())
        errors = directional_errors(net, lambda: EpsilonPlus(epsilon=0.1), x)
        assert errors["fc1.weight"] > 1e-2 and errors["fc2.bias"] > 1e-2

    def test_router(self):
        """RouterRule holds the routing weights; the derivative reaches the router's weight through them."""
        net, x = smooth(mixture)
        errors = directional_errors(net, lambda: EpsilonPlus(epsilon=0.1), x)
        assert_exact(errors)


# ---------------------------------------------------------------------------------------------- other rules


class TwoBranches(nn.Module):
    """``head(a(x) ⊕ b(x))`` with ``⊕`` a module of its own (for UniformRule) or a residual sum."""

    def __init__(self, add_module: bool) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(4, 5), nn.Linear(4, 5), nn.Linear(5, 2)
        self.add = Add() if add_module else None
        self.act_a, self.act_b = nn.Tanh(), nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.act_a(self.a(x)), self.act_b(self.b(x))
        return self.head(a + b if self.add is None else self.add(a, b))


class Add(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b


class StoppedBeforeBatchNorm(nn.Module):
    """A branch stopped at its Linear layer, before an eval-mode BatchNorm, beside a branch that is explained."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b, self.head = nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Linear(4, 5), nn.Linear(5, 2)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.norm(self.a(x))) + self.b(x))


def stopped_before_batch_norm(seed: int) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    net = StoppedBeforeBatchNorm().to(F64).eval()
    with torch.no_grad():
        net.norm.running_mean.uniform_(-0.5, 0.5)
        net.norm.running_var.uniform_(0.5, 2.0)
    return net, torch.randn(3, 4, dtype=F64)


def two_branches(add_module: bool) -> Callable[[int], tuple[nn.Module, torch.Tensor]]:
    def make(seed: int) -> tuple[nn.Module, torch.Tensor]:
        torch.manual_seed(seed)
        return TwoBranches(add_module).to(F64), torch.randn(3, 4, dtype=F64)

    return make


class Swish(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(x)


def normed_cnn(norm: str) -> Callable[[int], tuple[nn.Module, torch.Tensor]]:
    def make(seed: int) -> tuple[nn.Module, torch.Tensor]:
        torch.manual_seed(seed)
        layer = {
            "GroupNorm": lambda: nn.GroupNorm(2, 4),
            "LayerNorm": lambda: nn.LayerNorm([4, 5, 5]),
            "BatchNorm (training)": lambda: nn.BatchNorm2d(4),
            "BatchRenorm1d (eval)": lambda: BatchRenorm1d(4, warmup_steps=0).eval(),
        }[norm]()
        if isinstance(layer, BatchRenorm1d):
            with torch.no_grad():
                layer.running_mean.normal_(), layer.running_var.uniform_(0.5, 2.0), layer.weight.uniform_(0.5, 2.0)
            net = nn.Sequential(nn.Linear(3, 4), layer, Swish(), nn.Linear(4, 3))
            return net.to(F64), torch.randn(5, 3, dtype=F64)
        net = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), layer, Swish(), nn.Flatten(), nn.Linear(100, 3))
        return net.to(F64), torch.randn(3, 2, 5, 5, dtype=F64)

    return make


def recurrent(kind: str) -> Callable[[int], tuple[nn.Module, torch.Tensor]]:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = getattr(nn, kind)(3, 4, batch_first=True)
            self.head = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.rnn(x)[0][:, -1])

    def make(seed: int) -> tuple[nn.Module, torch.Tensor]:
        torch.manual_seed(seed)
        return Net().to(F64), torch.randn(2, 4, 3, dtype=F64)

    return make


def tanh_mlp(seed: int) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(F64), torch.randn(3, 3, dtype=F64)


def taylor_block(seed: int) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    block = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 4))
    return nn.Sequential(nn.Linear(3, 4), block, nn.Linear(4, 2)).to(F64), torch.randn(3, 3, dtype=F64)


def taylor_block_with_batch_norm(seed: int) -> tuple[nn.Module, torch.Tensor]:
    """A Taylor block holding a BatchNorm in training mode, whose own rule (the default MergeBatchNormRule, which
    cannot merge it) refused the call that keeps the graph, though the block's rule ignores it."""
    torch.manual_seed(seed)
    block = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 4))
    net = nn.Sequential(nn.Linear(3, 4), block, nn.Linear(4, 2)).to(F64).train()
    return net, torch.randn(6, 3, dtype=F64)


def flattened_with_zeros(seed: int) -> tuple[nn.Module, torch.Tensor]:
    """A first Linear behind a Flatten, on inputs with zeros: the relevance a flat rule sets there is the part
    ``x · gradient`` cannot carry, recorded and carried back through the Flatten."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Flatten(), nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(F64)
    x = torch.randn(3, 2, 2, dtype=F64)
    x[:, 0, 0] = 0.0
    return net, x


def spread_bias(inputs: tuple[torch.Tensor, ...], relevances: list[torch.Tensor]) -> list[torch.Tensor]:
    """A ``distribute_bias`` that depends on the inputs (their records then keep the graph too)."""
    return [r + 0.1 * torch.tanh(x) for x, r in zip(inputs, relevances, strict=True)]


def taylor(bias: bool, distribute_bias=None) -> Callable[[], dict]:
    def mapper() -> dict:
        rule = TaylorDecompositionRule(ref=0.3, bias=bias, distribute_bias=distribute_bias, epsilon=0.1)
        return {"1": rule, nn.Linear: EpsilonRule(0.1)}

    return mapper


OTHER_CASES = {
    "PassRule on Tanh (whose backward saves its output)": (tanh_mlp, lambda: EpsilonPlus(epsilon=0.1)),
    "StopRule on a branch": (two_branches(False), lambda: {"b": StopRule(), nn.Linear: EpsilonRule(0.1)}),
    "StopRule before a BatchNorm": (
        stopped_before_batch_norm,
        lambda: EpsilonPlus(epsilon=0.1, rule_mapper={"a": StopRule()}),
    ),
    "UniformRule": (two_branches(True), lambda: {"add": UniformRule(), nn.Linear: EpsilonRule(0.1)}),
    "UniformEpsilonRule": (two_branches(True), lambda: {"add": UniformEpsilonRule(0.1), nn.Linear: EpsilonRule(0.1)}),
    "Taylor, bias=False": (taylor_block, taylor(False)),
    "Taylor, bias=True": (taylor_block, taylor(True)),
    "Taylor, bias=True, distribute_bias": (taylor_block, taylor(True, spread_bias)),
    "stabilised additions": (two_branches(False), lambda: EpsilonPlus(epsilon=0.1, stabilize_additions=True)),
    "GroupNorm": (normed_cnn("GroupNorm"), lambda: EpsilonPlus(epsilon=0.1)),
    "LayerNorm over (C, H, W)": (normed_cnn("LayerNorm"), lambda: EpsilonPlus(epsilon=0.1)),
    "BatchNorm in training mode": (
        normed_cnn("BatchNorm (training)"),
        lambda: EpsilonPlus(epsilon=0.1, rule_mapper={nn.BatchNorm2d: NormRule(0.1)}),
    ),
    "BatchRenorm1d in eval mode": (normed_cnn("BatchRenorm1d (eval)"), lambda: EpsilonPlus(epsilon=0.1)),
    # Its records at the zero inputs were dropped where the graph is kept (0.5 off, relative L2, the call without).
    "FlatRule behind a Flatten, zero inputs": (
        flattened_with_zeros,
        lambda: {"1": FlatRule(), nn.Linear: EpsilonRule(0.1)},
    ),
    "LSTM": (recurrent("LSTM"), lambda: {nn.LSTM: RecurrentRule(0.1), nn.Linear: EpsilonRule(0.1)}),
    "GRU": (recurrent("GRU"), lambda: {nn.GRU: RecurrentRule(0.1), nn.Linear: EpsilonRule(0.1)}),
    "UniformEpsilon preset on an LSTM": (recurrent("LSTM"), lambda: UniformEpsilon(epsilon=0.25)),
}


# The rules of each case, as the docs' table names them.
RULES_OF_CASE = {
    "PassRule on Tanh (whose backward saves its output)": "EpsilonPlus(ε=0.1): PassRule",
    "StopRule on a branch": "StopRule, EpsilonRule(0.1)",
    "StopRule before a BatchNorm": "EpsilonPlus(ε=0.1), StopRule",
    "UniformRule": "UniformRule, EpsilonRule(0.1)",
    "UniformEpsilonRule": "UniformEpsilonRule(0.1), EpsilonRule(0.1)",
    "Taylor, bias=False": "TaylorDecompositionRule(ref=0.3)",
    "Taylor, bias=True": "TaylorDecompositionRule(ref=0.3, bias=True)",
    "Taylor, bias=True, distribute_bias": "TaylorDecompositionRule(ref=0.3, bias=True, distribute_bias=...)",
    "stabilised additions": "EpsilonPlus(ε=0.1, stabilize_additions=True)",
    "GroupNorm": "EpsilonPlus(ε=0.1): NormRule, ElementwiseRule",
    "LayerNorm over (C, H, W)": "EpsilonPlus(ε=0.1): NormRule",
    "BatchNorm in training mode": "EpsilonPlus(ε=0.1), NormRule(0.1) (batch statistics held)",
    "BatchRenorm1d in eval mode": "EpsilonPlus(ε=0.1)",
    "FlatRule behind a Flatten, zero inputs": "FlatRule, EpsilonRule(0.1)",
    "LSTM": "RecurrentRule(0.1), EpsilonRule(0.1)",
    "GRU": "RecurrentRule(0.1), EpsilonRule(0.1)",
    "UniformEpsilon preset on an LSTM": "UniformEpsilon(ε=0.25) (pnpxai's preset)",
}


class TestOtherRules:
    @pytest.mark.parametrize("case", sorted(OTHER_CASES))
    def test_against_finite_differences(self, case):
        make, mapper = OTHER_CASES[case]
        assert case in RULES_OF_CASE  # the docs' table names its rules
        net, x = smooth(make, (nn.Linear, nn.Conv2d))
        assert_exact(directional_errors(net, mapper, x))

    def test_a_stopped_branch_still_moves_the_relevance(self, monkeypatch):
        """No relevance flows through the stopped branch, but its value enters the head's ε-rule: the derivative
        reaches the branch's parameters, which a detached branch would cut."""
        from tdhook.attribution.rules import basic

        net, x = smooth(two_branches(False))
        errors = directional_errors(net, OTHER_CASES["StopRule on a branch"][1], x, directions=1)
        monkeypatch.setattr(basic, "hold", lambda tensor: tensor.detach())
        cut = directional_errors(net, OTHER_CASES["StopRule on a branch"][1], x, directions=1)
        assert errors["b.weight"] < TOLERANCE and cut["b.weight"] > 1e-2


@pytest.mark.parametrize("bias", [False, True])
def test_a_taylor_reference_that_is_a_parameter_gets_its_derivative(bias: bool):
    """A reference the model learns (a parameter of its own) is on the relevance's path: its derivative is the
    finite differences' (it was 0, the reference detached, with no word)."""

    def make(seed: int) -> tuple[nn.Module, torch.Tensor]:
        net, x = taylor_block(seed)
        net.register_parameter("ref", nn.Parameter(torch.linspace(-0.3, 0.4, 4, dtype=F64)))
        return net, x

    net, x = smooth(make)
    rule = lambda: {"1": TaylorDecompositionRule(ref=net.ref, bias=bias, epsilon=0.1), nn.Linear: EpsilonRule(0.1)}  # noqa: E731
    errors = directional_errors(net, rule, x)
    assert errors["ref"] < TOLERANCE
    assert_exact(errors)


@pytest.mark.parametrize("bias", [False, True])
def test_a_taylor_block_holding_a_batch_norm_in_training_mode_keeps_the_graph(bias: bool):
    """The block's BatchNorm, under the default MergeBatchNormRule that cannot merge it, refused the call as if its
    rule could not keep the graph, though the block's rule ignores it. The relevance is the ordinary call's and
    keeps its graph; a loss on it would take torch's third derivative of the block's batch_norm, which torch
    does not give (a RuntimeError naming batch_norm at that loss's backward)."""
    net, x = taylor_block_with_batch_norm(0)
    state = {name: value.clone() for name, value in net.state_dict().items()}
    plain = explain(LRP(net, taylor(bias)(), in_keys=["x"], out_keys=["y"]), x)
    net.load_state_dict(state)  # the running statistics the first call moved
    kept = explain(LRP(net, taylor(bias)(), in_keys=["x"], out_keys=["y"], create_graph=True), x.requires_grad_())
    assert kept.requires_grad
    torch.testing.assert_close(kept.detach(), plain, rtol=1e-12, atol=1e-14)


class TestRefusals:
    def test_rules_that_cannot_keep_the_graph_are_named(self):
        from tdhook.attribution.rules import QuantizedLinearRule

        net = nn.Sequential(nn.Linear(3, 2))
        lrp = LRP(net, {"0": QuantizedLinearRule()}, in_keys=["x"], out_keys=["y"], create_graph=True)
        with pytest.raises(NotImplementedError, match="QuantizedLinearRule.*'0'"):
            lrp(TensorDict(x=torch.randn(2, 3), batch_size=[2]))

    def test_a_module_without_a_rule_keeps_its_own_reason(self):
        """A preset's refusal of a module (UniformEpsilon on attention) is raised, not hidden by this check."""
        net, x = encoder(0)
        lrp = LRP(net, UniformEpsilon(), in_keys=["x"], out_keys=["y"], create_graph=True)
        with pytest.raises(ValueError, match="UniformEpsilon has no rule for attention"):
            explain(lrp, x)

    def test_a_function_mode_of_ones_own_is_refused(self):
        class Mode(torch.overrides.TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {}))

        class Mapper(EpsilonPlus):
            def function_modes(self):
                return [*super().function_modes(), Mode()]

        lrp = LRP(nn.Sequential(nn.Linear(3, 2)), Mapper(), in_keys=["x"], out_keys=["y"], create_graph=True)
        with pytest.raises(NotImplementedError, match=r"function rules of Mapper \(Mode\)"):
            lrp(TensorDict(x=torch.randn(2, 3), batch_size=[2]))


def measured_errors() -> list[tuple[str, str, float, float, float]]:
    """Per case: the relevance's relative difference between the two calls, and the worst error with respect to the
    input and to a parameter (the figures of the docs' page on differentiable relevance)."""
    rows = []
    for preset in sorted(TRANSFORMER_PRESETS):
        net, x = smooth(encoder)
        rows.append(("TransformerEncoderLayer", preset, directional_errors(net, TRANSFORMER_PRESETS[preset], x)))
    for kind in ("gpt2", "llama"):
        net, x = smooth_language_model(kind)
        for preset in ("AttnLRP(ε=0.1, softmax ε=0.1)", "CPLRP(ε=0.1)"):
            errors = directional_errors(net, TRANSFORMER_PRESETS[preset], x, key="embeds", directions=1, step=1e-7)
            rows.append((f"tiny {kind}", preset, errors))
    for functional in (False, True):
        net, x = smooth(squeeze_excite(functional), (nn.Linear, nn.Conv2d))
        name = "squeeze-excite, " + ("sigmoid function" if functional else "nn.Sigmoid")
        rows.append((name, "EpsilonPlus(ε=0.1)", directional_errors(net, lambda: EpsilonPlus(epsilon=0.1), x)))
    net, x = smooth(mixture)
    rows.append(
        ("mixture of experts", "EpsilonPlus(ε=0.1)", directional_errors(net, lambda: EpsilonPlus(epsilon=0.1), x))
    )
    for case, (make, mapper) in sorted(OTHER_CASES.items()):
        net, x = smooth(make, (nn.Linear, nn.Conv2d))
        rows.append((case, RULES_OF_CASE[case], directional_errors(net, mapper, x)))
    table = []
    for model, preset, errors in rows:
        values = errors.pop("values")
        by_input = errors.pop("input")
        table.append((model, preset, values, by_input, max(errors.values())))
    return table


if __name__ == "__main__":
    print("| model | rules | relevance vs create_graph=False | input | worst parameter |")
    print("| --- | --- | --- | --- | --- |")
    for model, preset, values, by_input, by_param in measured_errors():
        print(f"| {model} | {preset} | {values:.1e} | {by_input:.1e} | {by_param:.1e} |")
