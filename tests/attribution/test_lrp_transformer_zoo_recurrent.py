"""Hugging Face's state-space, recurrent and hybrid language models under AttnLRP and CP-LRP, from tiny random configs.

The companion of ``test_lrp_transformer_zoo.py`` (hidden size 32, two layers, batch 2 × 7 tokens, float64, matrices
scaled up, norm scales randomised, ``inputs_embeds`` fed, the next-token logits explained). transformers runs every
mixer below in pure torch here (no ``mamba_ssm`` or ``causal_conv1d`` kernels).

1. LFM2's family mixes tokens by gated short convolutions (``C · conv(B · x)``, products of activations) beside
   attention: explained, as any transformer of the zoo (no warning, output and ``state_dict`` unchanged, CP-LRP
   conserving within 1e-6, eager and sdpa agreeing), and after a cached prefix its new tokens get the relevance the
   whole sequence gives them.
2. The selective scans (Mamba 2, FalconMamba, and the Mamba layers of Jamba, Bamba, Zamba, Zamba 2, Granite 4,
   Falcon-H1 and Nemotron-H), RecurrentGemma's RG-LRU, RWKV's time mixing (and its squared-ReLU channel mixing),
   xLSTM's mLSTM, and the gated delta rules of OLMo-Hybrid, Kimi Linear and Bailing compute ``exp`` of activations
   (decays, cumulative segment sums) and products of activations along the sequence, which no rule follows. Each
   such mixer is named in a warning, and only those; ``strict=True`` raises that error and leaves the caller's
   TensorDict as it was.
3. The rest of each hybrid is explained: with the named mixers silenced (their output projection zeroed, so that
   they add nothing), CP-LRP conserves within 1e-6, and eager and sdpa agree.
4. The gated RMS norms of these mixers (``norm(x · act(z))`` or ``norm(x) · act(z)``, over groups of channels or
   per head) pass relevance on element by element: to ``x`` alone under CP-LRP (the gate held), half to each factor
   under AttnLRP where the gate is a SiLU, all to ``x`` where it is a sigmoid (held by both presets).
"""

from __future__ import annotations

import copy
import re
import warnings
from dataclasses import dataclass

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP
from tests.attribution.test_lrp_transformer_zoo import (
    BATCH,
    F64,
    HIDDEN,
    MOE,
    PRESETS,
    TOKENS,
    Architecture,
    Explained,
    Outcome,
    check_implementations_agree,
    check_outcome,
    model_input,
    outcome_of,
    zero_additive,
)
from tests.conftest import relative_error

NO_ATTENTION = {key: None for key in ("num_attention_heads", "num_key_value_heads", "head_dim")}
TOKEN_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # configs whose defaults lie outside 64 tokens
MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=4, mamba_chunk_size=4)  # Bamba, Granite 4, Falcon-H1
LINEAR_ATTENTION = dict(layer_types=["linear_attention", "full_attention"])
# Multi-head latent attention and experts: Kimi Linear's and Bailing's full-attention layers.
LATENT = dict(MOE, **TOKEN_IDS, num_key_value_heads=4, moe_intermediate_size=16, kv_lora_rank=16, q_lora_rank=16)
LATENT |= dict(qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, num_local_experts=4, **LINEAR_ATTENTION)

# Token mixers that the rules follow: LFM2's gated short convolutions.
CONVOLUTIONAL = {
    "lfm2": Architecture("Lfm2Config", "Lfm2ForCausalLM", dict(head_dim=None, layer_types=["conv", "full_attention"])),
    "lfm2_moe": Architecture(
        "Lfm2MoeConfig",
        "Lfm2MoeForCausalLM",
        dict(MOE, head_dim=None, moe_intermediate_size=32, num_dense_layers=1, layer_types=["conv", "full_attention"]),
    ),
    "lfm3": Architecture("Lfm3Config", "Lfm3ForCausalLM", dict(TOKEN_IDS, layer_types=["conv", "full_attention"])),
}


@dataclass(frozen=True)
class Recurrent:
    """A model whose recurrent mixers no rule follows: how to build it, and each mixer the wrapper names (its path
    in the explained module, its class, the projection whose zeroing silences it)."""

    architecture: Architecture
    mixers: tuple[tuple[str, str, str], ...]


def layers(pattern: str, indices: tuple[int, ...], mixer: str, out: str) -> tuple[tuple[str, str, str], ...]:
    return tuple((pattern.format(i), mixer, out) for i in indices)


RECURRENT = {
    # Mamba 2: the chunked selective scan (exp of segment sums over cumulative decays), a gated RMS norm.
    "mamba2": Recurrent(
        Architecture(
            "Mamba2Config",
            "Mamba2ForCausalLM",
            dict(NO_ATTENTION, num_heads=4, head_dim=16, state_size=4, n_groups=1, chunk_size=4),
            sdpa=False,
        ),
        layers("model.backbone.layers.{}.mixer", (0, 1), "Mamba2Mixer", "out_proj"),
    ),
    # FalconMamba: Mamba's sequential scan, weightless RMS norms on B, C and the time step.
    "falcon_mamba": Recurrent(
        Architecture("FalconMambaConfig", "FalconMambaForCausalLM", dict(NO_ATTENTION, state_size=4), sdpa=False),
        layers("model.backbone.layers.{}.mixer", (0, 1), "FalconMambaMixer", "out_proj"),
    ),
    # Jamba: a Mamba layer, then attention with experts.
    "jamba": Recurrent(
        Architecture(
            "JambaConfig",
            "JambaForCausalLM",
            dict(MOE, head_dim=None, mamba_d_state=4, attn_layer_period=2, attn_layer_offset=1)
            | dict(expert_layer_period=2, expert_layer_offset=1),
        ),
        layers("model.model.layers.{}.mamba", (0,), "JambaMambaMixer", "out_proj"),
    ),
    "bamba": Recurrent(
        Architecture("BambaConfig", "BambaForCausalLM", dict(MAMBA2, head_dim=None, attn_layer_indices=[1])),
        layers("model.model.layers.{}.mamba", (0,), "BambaMixer", "out_proj"),
    ),
    # Zamba: Mamba layers, and one shared transformer block fed the hidden states and the original embeddings.
    "zamba": Recurrent(
        Architecture(
            "ZambaConfig",
            "ZambaForCausalLM",
            dict(head_dim=None, num_key_value_heads=4, attention_hidden_size=64, attention_head_dim=16)
            | dict(
                n_mamba_heads=2, mamba_d_state=4, num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "hybrid"]
            )
            | dict(use_cache=False),
        ),
        (("model.model.layers.0.mamba", "ZambaMambaMixer", "out_proj"),)
        + layers("model.model.layers.{}.mamba_decoder.mamba", (1, 2), "ZambaMambaMixer", "out_proj"),
    ),
    "zamba2": Recurrent(
        Architecture(
            "Zamba2Config",
            "Zamba2ForCausalLM",
            dict(head_dim=None, layers_block_type=["mamba", "hybrid"], n_mamba_heads=4, mamba_d_state=4, chunk_size=4)
            | dict(num_mem_blocks=1),
        ),
        (
            ("model.model.layers.0.mamba", "Zamba2MambaMixer", "out_proj"),
            ("model.model.layers.1.mamba_decoder.mamba", "Zamba2MambaMixer", "out_proj"),
        ),
    ),
    # RecurrentGemma: the RG-LRU (exp of gated decays, a square root under its own autograd Function).
    "recurrent_gemma": Recurrent(
        Architecture(
            "RecurrentGemmaConfig",
            "RecurrentGemmaForCausalLM",
            dict(head_dim=None, num_key_value_heads=1, lru_width=HIDDEN, attention_window_size=4, conv1d_width=3)
            | dict(block_types=["recurrent", "attention"]),
        ),
        (("model.model.layers.0.temporal_block.rg_lru", "RecurrentGemmaRglru", "../linear_out"),),
    ),
    # RWKV: time mixing (exp of decays, a division by the running normaliser), channel mixing by a squared ReLU.
    # Its cache is written in place, where transformers' own backward pass fails: built without it.
    "rwkv": Recurrent(
        Architecture(
            "RwkvConfig",
            "RwkvForCausalLM",
            dict(NO_ATTENTION, max_position_embeddings=None, intermediate_size=None, attention_hidden_size=HIDDEN)
            | dict(context_length=16, use_cache=False),
            sdpa=False,
        ),
        layers("model.rwkv.blocks.{}.attention", (0, 1), "RwkvSelfAttention", "output")
        + layers("model.rwkv.blocks.{}.feed_forward", (0, 1), "RwkvFeedForward", "value"),
    ),
    # xLSTM: the mLSTM's exponential gating (log-sigmoid, exp, a division by the normaliser), native kernels.
    "xlstm": Recurrent(
        Architecture(
            "xLSTMConfig",
            "xLSTMForCausalLM",
            dict(NO_ATTENTION, intermediate_size=None, max_position_embeddings=None, embedding_dim=HIDDEN)
            | dict(num_heads=4, num_blocks=2, chunk_size=8, mode="inference", use_cache=False)
            | dict(chunkwise_kernel="chunkwise--native_autograd", sequence_kernel="native_sequence__native")
            | dict(step_kernel="native"),
            sdpa=False,
        ),
        layers("model.backbone.blocks.{}.mlstm_layer.mlstm_backend", (0, 1), "xLSTMBackend", "../out_proj"),
    ),
    # Granite 4: a Mamba 2 layer, then attention with experts.
    "granite_moe_hybrid": Recurrent(
        Architecture(
            "GraniteMoeHybridConfig",
            "GraniteMoeHybridForCausalLM",
            dict(MAMBA2, head_dim=None, experts_implementation="eager", num_local_experts=4, num_experts_per_tok=2)
            | dict(shared_intermediate_size=32, layer_types=["mamba", "attention"]),
        ),
        layers("model.model.layers.{}.mamba", (0,), "GraniteMoeHybridMambaLayer", "out_proj"),
    ),
    # Falcon-H1: attention and a Mamba 2 mixer in parallel in every layer, scaled by multipliers.
    "falcon_h1": Recurrent(
        Architecture("FalconH1Config", "FalconH1ForCausalLM", dict(MAMBA2, head_dim=None, mamba_d_ssm=64)),
        layers("model.model.layers.{}.mamba", (0, 1), "FalconH1Mixer", "out_proj"),
    ),
    "nemotron_h": Recurrent(
        Architecture(
            "NemotronHConfig",
            "NemotronHForCausalLM",
            dict(layers_block_type=["mamba", "attention"], mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=4)
            | dict(n_groups=1, chunk_size=4),
        ),
        layers("model.model.layers.{}.mixer", (0,), "NemotronHMamba2Mixer", "out_proj"),
    ),
    # The gated delta rule (exp of decays, a triangular solve), beside full attention.
    "olmo_hybrid": Recurrent(
        Architecture(
            "OlmoHybridConfig",
            "OlmoHybridForCausalLM",
            dict(TOKEN_IDS, head_dim=None, linear_num_key_heads=2, linear_num_value_heads=4, **LINEAR_ATTENTION)
            | dict(linear_key_head_dim=8, linear_value_head_dim=8),
        ),
        layers("model.model.layers.{}.linear_attn", (0,), "OlmoHybridGatedDeltaNet", "o_proj"),
    ),
    # Kimi Delta Attention (its forget gate a module of its own: exp, log), beside multi-head latent attention.
    "kimi_linear": Recurrent(
        Architecture(
            "KimiLinearConfig",
            "KimiLinearForCausalLM",
            dict(LATENT, head_dim=None, mlp_layer_types=["dense", "sparse"], linear_head_dim=8, linear_num_heads=4),
        ),
        (
            ("model.model.layers.0.self_attn", "KimiLinearDeltaAttention", "o_proj"),
            ("model.model.layers.0.self_attn.forget_gate", "KimiLinearForgetGate", ""),
        ),
    ),
    "bailing_hybrid": Recurrent(
        Architecture("BailingHybridConfig", "BailingHybridForCausalLM", LATENT),
        layers("model.model.layers.{}.self_attn", (0,), "BailingHybridDeltaAttention", "o_proj"),
    ),
}
NAMED = re.compile(r"module '([^']+)' \((\w+)\) computes ([^']*?) in its own forward")


def named(outcome: Outcome) -> set[tuple[str, str]]:
    """The modules that ``outcome``'s warnings name, with their classes."""
    return {match.groups()[:2] for message in outcome.warnings for match in NAMED.finditer(message)}


def silence(explained: nn.Module, mixers: tuple[tuple[str, str, str], ...]) -> None:
    """Zero the output projection of each mixer: it adds nothing, and the rest of the model is explained alone."""
    with torch.no_grad():
        for path, _, out in mixers:
            if out.startswith("../"):  # a projection of the mixer's parent layer
                path, out = path.rsplit(".", 1)[0], out[3:]
            if out:
                explained.get_submodule(f"{path}.{out}").weight.zero_()


def explain(
    architecture: Architecture, preset: str, implementation: str = "eager", mixers: tuple | None = None
) -> Outcome:
    """One call of the wrapper with biases and additive embeddings zeroed; with ``mixers``, those silenced."""
    model = architecture.build(implementation)
    zero_additive(model)
    explained, x = Explained(model), model_input(architecture)
    if mixers is not None:
        silence(explained, mixers)
    return outcome_of(explained, model, x, preset)


def check_explained(outcome: Outcome, where: str, preset: str, warned: set[tuple[str, str]] = frozenset()) -> None:
    assert named(outcome) == set(warned), (where, outcome.warnings)
    assert len(outcome.warnings) == len(warned), (where, outcome.warnings)
    check_outcome(outcome, where, preset)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("name", sorted(CONVOLUTIONAL))
def test_gated_short_convolutions_are_explained(name: str, preset: str):
    outcomes = {impl: explain(CONVOLUTIONAL[name], preset, impl) for impl in ("eager", "sdpa")}
    for implementation, outcome in outcomes.items():
        check_explained(outcome, f"{name} {preset} {implementation}", preset)
    check_implementations_agree(outcomes, f"{name} {preset}")


class CachedStep(nn.Module):
    """The next-token logits of the tokens after a cached prefix."""

    def __init__(self, model: nn.Module, cache) -> None:
        super().__init__()
        self.model, self.cache = model, cache

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(inputs_embeds=x, use_cache=True, past_key_values=self.cache).logits[:, -1]


class WholeSequence(nn.Module):
    """The next-token logits of the prefix and the tokens after it, without a cache."""

    def __init__(self, model: nn.Module, prefix: torch.Tensor) -> None:
        super().__init__()
        self.model, self.prefix = model, prefix

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(inputs_embeds=torch.cat([self.prefix, x], 1), use_cache=False).logits[:, -1]


def cache_tensors(cache) -> list[torch.Tensor]:
    """Every tensor a cache holds: the convolutions' states, the attention's keys and values."""
    found = []
    for layer in cache.layers:
        for value in vars(layer).values():
            values = value.values() if isinstance(value, dict) else [value]
            found += [tensor for tensor in values if isinstance(tensor, torch.Tensor)]
    return found


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("new_tokens", [1, 2])
def test_a_convolution_cache_is_a_constant_of_the_step(new_tokens: int, preset: str):
    """LFM2 explained on tokens after a cached prefix (its convolutions' states and the attention's keys and values,
    written in place by each call; one new token takes the single-step path): the new tokens get the relevance that
    the whole sequence gives them, the output is the plain call's and the cache ends as the plain call leaves it."""
    model = CONVOLUTIONAL["lfm2"].build("eager")
    zero_additive(model)
    generator = torch.Generator().manual_seed(4)
    prefix = torch.randn(BATCH, TOKENS - new_tokens, HIDDEN, generator=generator, dtype=F64)
    x = torch.randn(BATCH, new_tokens, HIDDEN, generator=generator, dtype=F64)
    with torch.no_grad():
        cache = model(inputs_embeds=prefix, use_cache=True).past_key_values
    plain_cache, explained_cache = copy.deepcopy(cache), copy.deepcopy(cache)
    plain = CachedStep(model, plain_cache)(x)
    relevance = {}
    for key, module in (("step", CachedStep(model, explained_cache)), ("whole", WholeSequence(model, prefix))):
        lrp = LRP(module, PRESETS[preset](), in_keys=["x"], out_keys=["y"])
        td = lrp(TensorDict(x=x.clone(), batch_size=[BATCH]))
        relevance[key] = td["relevance", "x"]
        if key == "step":
            assert torch.equal(td["y"], plain)
    assert relative_error(relevance["step"], relevance["whole"]) <= 1e-10
    after, expected = cache_tensors(explained_cache), cache_tensors(plain_cache)
    # One convolution's state, one attention's keys and values (and, from transformers 5.25, the linear layer's
    # length counter).
    assert len(after) == len(expected) >= 3
    assert all(torch.equal(a, b) for a, b in zip(after, expected, strict=True))


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("name", sorted(RECURRENT))
def test_a_recurrent_mixer_is_named_and_strict_refuses_it(name: str, preset: str):
    """Each recurrent mixer, and nothing else, is named in a warning with what it computes (``exp`` of activations,
    RWKV's channel mixing a ``square``); the output and the ``state_dict`` are unchanged. With ``strict=True`` the
    call raises that error and writes nothing into the caller's TensorDict."""
    recurrent = RECURRENT[name]
    outcome = explain(recurrent.architecture, preset)
    expected = {(path, mixer) for path, mixer, _ in recurrent.mixers}
    assert named(outcome) == expected, outcome.warnings
    assert len(outcome.warnings) == len(expected), outcome.warnings
    computed = {match.group(1): match.group(3) for message in outcome.warnings for match in NAMED.finditer(message)}
    for path, mixer, _ in recurrent.mixers:
        assert re.search(r"\bexp\b" if mixer != "RwkvFeedForward" else r"\bsquare\b", computed[path]), computed
    assert torch.equal(outcome.output, outcome.plain)
    assert outcome.state_unchanged
    assert torch.isfinite(outcome.relevance).all()

    model = recurrent.architecture.build("eager")
    strict = LRP(Explained(model), PRESETS[preset](strict=True), in_keys=["x"], out_keys=["y"])
    td = TensorDict(x=model_input(recurrent.architecture), batch_size=[BATCH])
    first = "|".join(re.escape(f"module '{path}' ({mixer}) computes") for path, mixer in expected)
    with pytest.raises(ValueError, match=first):
        strict(td)
    assert set(td.keys()) == {"x"}


@pytest.mark.parametrize("name", sorted(RECURRENT))
def test_the_rest_of_a_recurrent_model_conserves(name: str):
    """With its recurrent mixers silenced (adding nothing), the rest of the model (attention, experts, Zamba's
    shared block fed the original embeddings, Falcon-H1's multipliers, the norms, the head) conserves under
    CP-LRP; only the mixers are named, and eager and sdpa agree."""
    recurrent = RECURRENT[name]
    expected = {(path, mixer) for path, mixer, _ in recurrent.mixers}
    implementations = recurrent.architecture.implementations()
    outcomes = {impl: explain(recurrent.architecture, "cplrp", impl, recurrent.mixers) for impl in implementations}
    for implementation, outcome in outcomes.items():
        check_explained(outcome, f"{name} {implementation}", "cplrp", expected)
    check_implementations_agree(outcomes, name)


# Gated RMS norms: the model, the norm's path, whether its gate is a SiLU (else a sigmoid).
GATED_NORMS = {
    # norm(x · silu(z)) over four groups of 16 channels.
    "mamba2_groups": (
        Architecture(
            "Mamba2Config",
            "Mamba2ForCausalLM",
            dict(NO_ATTENTION, num_heads=4, head_dim=16, state_size=4, n_groups=4, chunk_size=4),
            sdpa=False,
        ),
        "backbone.layers.0.mixer.norm",
        True,
    ),
    # norm(x) · silu(z) (the gate after the norm) and norm(x · silu(z)).
    "falcon_h1_gate_after": (
        Architecture(
            "FalconH1Config", "FalconH1ForCausalLM", dict(MAMBA2, head_dim=None, mamba_d_ssm=64, mamba_rms_norm=True)
        ),
        "model.layers.0.mamba.norm",
        True,
    ),
    "falcon_h1_gate_before": (
        Architecture(
            "FalconH1Config",
            "FalconH1ForCausalLM",
            dict(MAMBA2, head_dim=None, mamba_d_ssm=64, mamba_rms_norm=True, mamba_norm_before_gate=False),
        ),
        "model.layers.0.mamba.norm",
        True,
    ),
    # Per head: norm(x) · silu(z) and norm(x) · sigmoid(z).
    "olmo_hybrid": (RECURRENT["olmo_hybrid"].architecture, "model.layers.0.linear_attn.o_norm", True),
    "kimi_linear": (RECURRENT["kimi_linear"].architecture, "model.layers.0.self_attn.o_norm", False),
}


class FixedGate(nn.Module):
    """A gated norm with its gate given: for CP-LRP, which holds the gate, so that no relevance could reach it."""

    def __init__(self, norm: nn.Module, gate: torch.Tensor) -> None:
        super().__init__()
        self.norm, self.gate = norm, gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, self.gate)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("name", sorted(GATED_NORMS))
def test_gated_rms_norms_pass_relevance_on_element_by_element(name: str, preset: str):
    """The normalising scale held, a gated RMS norm is a per-element product of ``x`` and the gate: under CP-LRP
    (the gate held) ``x`` takes each element's relevance; under AttnLRP a SiLU gate takes half of it (the product
    rule, then the SiLU's identity rule) and a sigmoid gate is held. Whether the gate comes before or after the
    norm, and whatever the groups the norm runs over."""
    architecture, path, silu = GATED_NORMS[name]
    norm = architecture.build("eager").get_submodule(path)
    size = norm.weight.shape[-1]
    generator = torch.Generator().manual_seed(3)
    x, gate, relevance_out = (torch.randn(BATCH, TOKENS, size, generator=generator, dtype=F64) for _ in range(3))
    shared = preset == "attnlrp" and silu
    module = norm if shared else FixedGate(norm, gate)
    keys = ["x", "gate"] if shared else ["x"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lrp = LRP(module, PRESETS[preset](), in_keys=keys, out_keys=["y"], target=lambda y: relevance_out)
        td = lrp(TensorDict(x=x, gate=gate, batch_size=[BATCH]))
    assert [str(w.message) for w in caught] == []
    share = 0.5 if shared else 1.0
    assert relative_error(td["relevance", "x"], share * relevance_out) <= 1e-6  # the norms compute in float32
    if shared:
        assert relative_error(td["relevance", "gate"], share * relevance_out) <= 1e-6
