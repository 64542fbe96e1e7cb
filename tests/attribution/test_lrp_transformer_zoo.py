"""A zoo of Hugging Face transformers under AttnLRP and CP-LRP, built from tiny random configs.

Every architecture is built untrained (hidden size 32, two layers, batch 2 × 7 tokens or 2 × 3 × 16 × 16 pixels),
in float64, with its matrices scaled up so that attention is far from uniform and every rule matters, and its
one-dimensional scales randomised (Gemma's norms start at zero). Language models are fed ``inputs_embeds``;
vision models ``pixel_values``; speech models a spectrogram (``input_features``) or a waveform
(``input_values``). For each architecture, preset and attention implementation (``"eager"`` and ``"sdpa"``, where
the architecture has both):

1. the wrapper changes neither the output (bit for bit) nor the ``state_dict``, and raises no warning;
2. every relevance is finite;
3. under CP-LRP, with biases and learned additive embeddings (positions, token types, class tokens, relative
   position bias tables) zeroed, relevance sums to the explained logit within 1e-6 of the logit;
4. eager and sdpa attention give the same relevance (up to the float32 arithmetic some norms run in).

A context's later calls equal fresh first calls, and ``target="all"`` equals each unit explained alone, in first
and planned calls.

One bfloat16 case per architecture is finite and agrees with float32 to bfloat16 precision.

The table of docs/transformers.md is printed by ``python -m tests.attribution.test_lrp_transformer_zoo``.
"""

from __future__ import annotations

import copy
import re
import warnings
from dataclasses import dataclass, field

import pytest
import torch
import transformers
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import CPLRP, LRP, AttnLRP
from tests.conftest import relative_error

F64 = torch.float64
BATCH, TOKENS, HIDDEN, IMAGE = 2, 7, 32, 16
MEL_BINS, FRAMES, SAMPLES = 8, 16, 64
CONSERVATION_TOLERANCE = 1e-6
IMPLEMENTATION_TOLERANCE = 1e-6  # several norms compute in float32 whatever the model's dtype
BFLOAT16_SCALE = 3.0  # milder weights: with 10, bfloat16 rounding alone changes the forward pass
PRESETS = {"attnlrp": AttnLRP, "cplrp": CPLRP}
# Parameter names of learned additive embeddings and bias tables, zeroed (with every bias) for conservation.
ADDITIVE = ("bias", "position", "wpe", "token_type", "cls_token", "class_embedding", "distillation_token", "mask_token")
ADDITIVE += ("time_embed",)  # TimeSformer's learned time embedding

COMMON = dict(
    vocab_size=64,
    hidden_size=HIDDEN,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
    head_dim=8,
)
VISION = dict(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
UNSET = {key: None for key in ("num_key_value_heads", "head_dim")}  # configs without them
T5 = dict(d_model=HIDDEN, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
MOE = dict(num_experts=4, num_experts_per_tok=2, experts_implementation="eager")
# A wav2vec 2.0 feature encoder for 64 samples: two strided convolutions, a small convolutional position embedding.
WAV2VEC2 = dict(
    conv_dim=(8, 8),
    conv_stride=(2, 2),
    conv_kernel=(3, 3),
    num_conv_pos_embeddings=4,
    num_conv_pos_embedding_groups=2,
    classifier_proj_size=8,
)
# The explained input of each kind of model: the keyword it is fed by and its shape.
INPUTS = {
    "text": ("inputs_embeds", (BATCH, TOKENS, HIDDEN)),
    "image": ("pixel_values", (BATCH, 3, IMAGE, IMAGE)),
    "spectrogram": ("input_features", (BATCH, MEL_BINS, FRAMES)),
    "waveform": ("input_values", (BATCH, SAMPLES)),
    "long_text": ("inputs_embeds", (BATCH, 16, HIDDEN)),  # long enough for BigBird's block-sparse attention
    "video": ("pixel_values", (BATCH, 4, 3, IMAGE, IMAGE)),
}


@dataclass(frozen=True)
class Architecture:
    """How to build one architecture of the zoo: its config and model classes and the config's values."""

    config: str
    model: str
    values: dict = field(default_factory=dict)
    inputs: str = "text"  # a key of INPUTS
    sdpa: bool = True  # whether transformers offers sdpa attention for it
    bfloat16: bool = True  # whether it runs in bfloat16 (torch.fft does not)

    def build(self, implementation: str, dtype: torch.dtype = F64, scale: float = 10.0) -> nn.Module:
        values = {**(COMMON if self.inputs == "text" else VISION), **self.values}
        values = {key: value for key, value in values.items() if value is not None}  # None: not for this config
        config = getattr(transformers, self.config)(**values)
        config._attn_implementation = implementation
        config.num_labels = 3
        torch.manual_seed(0)
        return scaled_up(getattr(transformers, self.model)(config).eval(), scale).to(dtype)

    def implementations(self) -> tuple[str, ...]:
        return ("eager", "sdpa") if self.sdpa else ("eager",)


def scaled_up(model: nn.Module, scale: float) -> nn.Module:
    """``model`` with its matrices scaled by ``scale`` (attention far from uniform: every rule matters) and its
    one-dimensional scales randomised (Gemma's norms start at zero)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1 and "embed" not in name:
                param.mul_(scale)
            elif param.dim() == 1 and name.endswith("weight"):
                param.add_(0.3 * torch.randn_like(param))
    return model


ZOO = {
    "gpt2": Architecture("GPT2Config", "GPT2LMHeadModel", dict(n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=64)),
    "llama": Architecture("LlamaConfig", "LlamaForCausalLM"),
    "mistral": Architecture("MistralConfig", "MistralForCausalLM"),
    "qwen2": Architecture("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": Architecture("Qwen3Config", "Qwen3ForCausalLM"),
    "phi3": Architecture("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0)),
    "phi": Architecture("PhiConfig", "PhiForCausalLM", dict(partial_rotary_factor=0.5)),
    "gpt_neox": Architecture("GPTNeoXConfig", "GPTNeoXForCausalLM"),
    "opt": Architecture("OPTConfig", "OPTForCausalLM", dict(ffn_dim=64, word_embed_proj_dim=HIDDEN)),
    "falcon": Architecture("FalconConfig", "FalconForCausalLM", dict(head_dim=None, multi_query=True)),
    # transformers' eager and sdpa ALiBi paths of Falcon compute different functions: eager only.
    "falcon_alibi": Architecture("FalconConfig", "FalconForCausalLM", dict(head_dim=None, alibi=True), sdpa=False),
    # Bloom's MLP activation is BloomGelu, a hand-written GELU module: the pass rule, as the first call proves it.
    "bloom": Architecture("BloomConfig", "BloomForCausalLM", dict(n_layer=2, n_head=4, vocab_size=100), sdpa=False),
    "mixtral": Architecture("MixtralConfig", "MixtralForCausalLM", dict(MOE, num_local_experts=4)),
    "qwen2_moe": Architecture(
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(MOE, moe_intermediate_size=32, shared_expert_intermediate_size=32),
    ),
    "olmoe": Architecture("OlmoeConfig", "OlmoeForCausalLM", MOE),
    "qwen3_moe": Architecture("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(MOE, moe_intermediate_size=32)),
    # Llama 4: a router that is a Linear itself, its sigmoid scores scaling the experts' input; an L2 norm on
    # queries and keys; rotary embeddings as complex products.
    "llama4": Architecture(
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        dict(MOE, num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=64),
    ),
    # PhiMoE: a router that selects experts by max and scatter (no topk), returning routing weights and indices.
    "phimoe": Architecture("PhimoeConfig", "PhimoeForCausalLM", dict(MOE, head_dim=None, num_local_experts=4)),
    # JetMoE: a mixture of attention heads beside the mixture of experts, routing weights cast with type_as.
    "jetmoe": Architecture(
        "JetMoeConfig",
        "JetMoeForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, kv_channels=8, num_key_value_heads=None, head_dim=None),
    ),
    # DeepSeek-V2: multi-head latent attention (low-rank queries and keys, rotary part apart), grouped routing.
    "deepseek_v2": Architecture(
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(
            MOE,
            head_dim=None,
            num_key_value_heads=4,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
            n_routed_experts=4,
            n_shared_experts=1,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        ),
    ),
    # DBRX: a router that holds its projection and returns logits; the mixture weighs them (softmax, top k, norm).
    # Queries, keys and values clipped to ±clip_qkv by Tensor.clamp, a bound that clips many units here.
    "dbrx": Architecture(
        "DbrxConfig",
        "DbrxForCausalLM",
        dict(
            d_model=HIDDEN,
            n_heads=4,
            n_layers=2,
            max_seq_len=64,
            attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=0.5),
            ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2),
        ),
    ),
    # MiniMax: lightning attention (linear attention with decay) beside softmax attention, and experts.
    "minimax": Architecture(
        "MiniMaxConfig",
        "MiniMaxForCausalLM",
        dict(MOE, num_local_experts=4, layer_types=["linear_attention", "full_attention"], block_size=4),
    ),
    # OLMo: queries, keys and values clipped in place (Tensor.clamp_) to ±clip_qkv; LayerNorms without parameters.
    "olmo": Architecture("OlmoConfig", "OlmoForCausalLM", dict(clip_qkv=0.5)),
    # Cohere: a LayerNorm written by hand (mean and variance), attention and MLP in parallel, scaled logits.
    "cohere": Architecture("CohereConfig", "CohereForCausalLM"),
    "gemma": Architecture("GemmaConfig", "GemmaForCausalLM"),
    "gemma2": Architecture("Gemma2Config", "Gemma2ForCausalLM", sdpa=False),
    "gemma3": Architecture("Gemma3TextConfig", "Gemma3ForCausalLM"),
    # Gemma 3n: AltUp (its modality router's coefficients mix the stacked streams: held as routing weights, the
    # `+ 1.0` of the correction's coefficients included), LAuReL, per-layer inputs gated by the hidden states;
    # no activation sparsity (its Gaussian top-k computes `erfinv`, which a warning names).
    "gemma3n": Architecture(
        "Gemma3nTextConfig",
        "Gemma3nForCausalLM",
        dict(
            layer_types=["sliding_attention", "full_attention"],
            num_kv_shared_layers=0,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=64,
            laurel_rank=8,
            altup_num_inputs=2,
            activation_sparsity_pattern=[0.0, 0.0],
        ),
    ),
    "bert": Architecture("BertConfig", "BertForSequenceClassification"),
    "roberta": Architecture("RobertaConfig", "RobertaForSequenceClassification", dict(pad_token_id=1)),
    "distilbert": Architecture(
        "DistilBertConfig", "DistilBertForSequenceClassification", dict(dim=HIDDEN, n_layers=2, n_heads=4)
    ),
    "electra": Architecture("ElectraConfig", "ElectraForSequenceClassification", dict(embedding_size=HIDDEN)),
    # ModernBERT: GeGLU, local (sliding-window) and global attention, LayerNorms without bias.
    "modernbert": Architecture(
        "ModernBertConfig",
        "ModernBertForSequenceClassification",
        dict(head_dim=None, num_key_value_heads=None, pad_token_id=0, global_attn_every_n_layers=2, local_attention=4),
    ),
    # MobileBERT: bottlenecks, stacked feed-forward networks and NoNorm, an element-wise affine map named a norm.
    "mobilebert": Architecture(
        "MobileBertConfig",
        "MobileBertForSequenceClassification",
        dict(embedding_size=HIDDEN, intra_bottleneck_size=16, true_hidden_size=16, num_feedforward_networks=2),
    ),
    # ConvBERT: span-based dynamic convolution, its kernels from torch.multiply of two activations; eager only.
    "convbert": Architecture(
        "ConvBertConfig", "ConvBertForSequenceClassification", dict(embedding_size=HIDDEN), sdpa=False
    ),
    # Funnel: relative attention scores written as einsums, the sequence pooled between blocks; eager only.
    "funnel": Architecture(
        "FunnelConfig",
        "FunnelForSequenceClassification",
        dict(num_hidden_layers=None, d_model=HIDDEN, n_head=4, d_head=8, d_inner=64, block_sizes=[1, 1]),
        sdpa=False,
    ),
    # GPT-BigCode: multi-query attention (one key and value head for all query heads).
    "gpt_bigcode": Architecture(
        "GPTBigCodeConfig",
        "GPTBigCodeForCausalLM",
        dict(n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=64, multi_query=True),
    ),
    # DeBERTa-v2: disentangled attention (content-to-position and position-to-content scores); eager only.
    "deberta_v2": Architecture("DebertaV2Config", "DebertaV2ForSequenceClassification", sdpa=False),
    # LayoutLM: BERT with 2-D position embeddings of the words' boxes (zero boxes here: additive, zeroed).
    "layoutlm": Architecture("LayoutLMConfig", "LayoutLMForSequenceClassification", dict(UNSET)),
    # XLNet: two-stream relative attention, its scores from einsums with learned biases (zeroed); eager only.
    "xlnet": Architecture(
        "XLNetConfig",
        "XLNetLMHeadModel",
        dict(UNSET, max_position_embeddings=None, d_model=HIDDEN, n_layer=2, n_head=4, d_inner=64),
        sdpa=False,
    ),
    # MPT: ALiBi attention, LayerNorms without bias; eager only.
    "mpt": Architecture(
        "MptConfig",
        "MptForCausalLM",
        dict(UNSET, d_model=HIDDEN, n_heads=4, n_layers=2, max_seq_len=64, expansion_ratio=2),
        sdpa=False,
    ),
    # RoFormer: rotary position embeddings from a sinusoidal table; eager only.
    "roformer": Architecture(
        "RoFormerConfig", "RoFormerForSequenceClassification", dict(UNSET, embedding_size=HIDDEN), sdpa=False
    ),
    # ALBERT: one group of two layers, its weights shared by all three layers (each module called three times).
    "albert": Architecture(
        "AlbertConfig",
        "AlbertForSequenceClassification",
        dict(UNSET, embedding_size=HIDDEN, num_hidden_layers=3, num_hidden_groups=1, inner_group_num=2),
    ),
    # XLM-RoBERTa-XL: RoBERTa with its LayerNorms before attention and feed-forward (pre-norm).
    "xlm_roberta_xl": Architecture(
        "XLMRobertaXLConfig", "XLMRobertaXLForSequenceClassification", dict(UNSET, pad_token_id=1)
    ),
    # MPNet: a relative position bias (zeroed) added to the scores; eager only.
    "mpnet": Architecture("MPNetConfig", "MPNetForSequenceClassification", dict(UNSET), sdpa=False),
    # FNet: token mixing by a two-dimensional Fourier transform (its real part), no attention.
    "fnet": Architecture(
        "FNetConfig",
        "FNetForSequenceClassification",
        dict(UNSET, num_attention_heads=None),
        sdpa=False,
        bfloat16=False,
    ),
    # BigBird: block-sparse attention (sliding, global and random blocks of 2 tokens over 16); eager only. GELU in
    # place of its default gelu_new, which its classification head calls through a module it does not hold.
    "bigbird": Architecture(
        "BigBirdConfig",
        "BigBirdForSequenceClassification",
        dict(UNSET, hidden_act="gelu", attention_type="block_sparse", block_size=2, num_random_blocks=1),
        inputs="long_text",
        sdpa=False,
    ),
    # Switch Transformers: a top-1 router (argmax, no topk) and expert capacity, in a T5 encoder.
    "switch": Architecture(
        "SwitchTransformersConfig",
        "SwitchTransformersEncoderModel",
        dict(UNSET, **T5, num_experts=4, expert_capacity=64, num_sparse_encoder_layers=2),
        sdpa=False,
    ),
    "t5_encoder": Architecture("T5Config", "T5EncoderModel", T5),
    "vit": Architecture("ViTConfig", "ViTForImageClassification", dict(image_size=IMAGE, patch_size=4), inputs="image"),
    "deit": Architecture(
        "DeiTConfig", "DeiTForImageClassification", dict(image_size=IMAGE, patch_size=4), inputs="image"
    ),
    "beit": Architecture(
        "BeitConfig",
        "BeitForImageClassification",
        dict(image_size=IMAGE, patch_size=4, use_relative_position_bias=True),
        inputs="image",
    ),
    # YOLOS: a ViT with detection tokens appended to the patches (learned, additive: zeroed).
    "yolos": Architecture(
        "YolosConfig",
        "YolosModel",
        dict(image_size=[IMAGE, IMAGE], patch_size=4, num_detection_tokens=2),
        inputs="image",
    ),
    # Hiera: a hierarchical ViT, queries pooled by max over windows between stages; eager only.
    "hiera": Architecture(
        "HieraConfig",
        "HieraForImageClassification",
        dict(
            {key: None for key in VISION},
            image_size=[IMAGE, IMAGE],
            patch_size=[3, 3],
            patch_stride=[2, 2],
            patch_padding=[1, 1],
            embed_dim=16,
            depths=[1, 1],
            num_heads=[1, 2],
            query_stride=[2, 2],
            masked_unit_size=[2, 2],
            num_query_pool=1,
        ),
        inputs="image",
        sdpa=False,
    ),
    # ConvNeXt (v1): depth-wise convolutions, channels-last LayerNorms, a layer scale (1 here, not 1e-6).
    "convnext": Architecture(
        "ConvNextConfig",
        "ConvNextForImageClassification",
        dict(
            {key: None for key in VISION},
            hidden_sizes=[8, 16],
            depths=[1, 1],
            patch_size=2,
            num_stages=2,
            layer_scale_init_value=1.0,
        ),
        inputs="image",
        sdpa=False,
    ),
    # Whisper's encoder: two 1-D convolutions over a spectrogram, then a transformer.
    "whisper": Architecture(
        "WhisperConfig",
        "WhisperForAudioClassification",
        dict(
            {key: None for key in VISION},
            num_mel_bins=MEL_BINS,
            max_source_positions=FRAMES // 2,
            d_model=HIDDEN,
            encoder_layers=2,
            encoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_layers=1,
            decoder_attention_heads=4,
            decoder_ffn_dim=64,
            vocab_size=64,
        ),
        inputs="spectrogram",
    ),
    # wav2vec 2.0: convolutions over the waveform (the first one group-normed), a weight-normed convolution as
    # position embedding.
    "wav2vec2": Architecture(
        "Wav2Vec2Config",
        "Wav2Vec2ForSequenceClassification",
        WAV2VEC2,
        inputs="waveform",
    ),
    # Wav2Vec2-Conformer: relative position scores computed from the queries, which the sdpa attention takes as
    # its mask; gated linear units and a depth-wise convolution in its convolution module.
    "wav2vec2_conformer": Architecture(
        "Wav2Vec2ConformerConfig",
        "Wav2Vec2ConformerForSequenceClassification",
        dict(WAV2VEC2, position_embeddings_type="relative", conv_depthwise_kernel_size=3),
        inputs="waveform",
    ),
    # Video: ViViT's tubelets of 2 frames, TimeSformer's attention divided between time and space (its learned
    # time embedding zeroed, additive).
    "vivit": Architecture(
        "VivitConfig",
        "VivitForVideoClassification",
        dict(image_size=IMAGE, num_frames=4, tubelet_size=[2, 4, 4]),
        inputs="video",
    ),
    "timesformer": Architecture(
        "TimesformerConfig",
        "TimesformerForVideoClassification",
        dict(image_size=IMAGE, patch_size=4, num_frames=4),
        inputs="video",
        sdpa=False,
    ),
    "swin": Architecture(
        "SwinConfig",
        "SwinForImageClassification",
        dict(
            {key: None for key in VISION},
            image_size=IMAGE,
            patch_size=2,
            embed_dim=16,
            depths=[1, 1],
            num_heads=[2, 2],
            window_size=4,
            drop_path_rate=0.1,
        ),
        inputs="image",
    ),
}


class Explained(nn.Module):
    """The explained output: a language model's next-token logits, a classifier's logits, an encoder's last
    hidden state at the last position."""

    def __init__(self, model: nn.Module, inputs: str = "text") -> None:
        super().__init__()
        self.model = model
        self.input_name = INPUTS[inputs][0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.model(**{self.input_name: x})
        if getattr(out, "logits", None) is None:
            return out.last_hidden_state[:, -1]
        return out.logits[:, -1] if out.logits.dim() == 3 else out.logits


def model_input(architecture: Architecture, dtype: torch.dtype = F64) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(INPUTS[architecture.inputs][1], generator=generator, dtype=F64).to(dtype)


def zero_additive(model: nn.Module) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(part in name for part in ADDITIVE):
                param.zero_()


@dataclass
class Outcome:
    """What one explained call gave."""

    relevance: torch.Tensor
    output: torch.Tensor
    plain: torch.Tensor
    state_unchanged: bool
    warnings: list[str]

    def conservation_error(self) -> float:
        """The largest ``|Σ relevance − logit| / |logit|`` over the batch."""
        logit = self.plain.gather(1, self.plain.argmax(1, keepdim=True)).squeeze(1)
        total = self.relevance.flatten(1).sum(1)
        return ((total - logit).abs() / logit.abs()).max().item()


def explain(name: str, preset: str, implementation: str, zeroed: bool | None = None) -> Outcome:
    """One call of the wrapper on the architecture ``name``; with ``zeroed`` (by default under CP-LRP), its
    biases and additive embeddings zeroed."""
    architecture = ZOO[name]
    model = architecture.build(implementation)
    if preset == "cplrp" if zeroed is None else zeroed:
        zero_additive(model)
    return outcome_of(Explained(model, architecture.inputs), model, model_input(architecture), preset)


def outcome_of(explained: nn.Module, model: nn.Module, x: torch.Tensor, preset: str) -> Outcome:
    """One call of the wrapper on ``explained`` (``model`` called on ``x``), with the warnings it gave and whether
    ``model``'s state is unchanged."""
    plain = explained(x)
    state = {key: value.clone() for key, value in model.state_dict().items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lrp = LRP(explained, PRESETS[preset](), in_keys=["x"], out_keys=["y"])
        td = lrp(TensorDict(x=x.clone(), batch_size=[BATCH]))
    after = model.state_dict()
    unchanged = state.keys() == after.keys() and all(torch.equal(state[k], after[k]) for k in state)
    return Outcome(td["relevance", "x"], td["y"], plain, unchanged, [str(w.message) for w in caught])


def check_outcome(outcome: Outcome, where: str, preset: str, conservation: float = CONSERVATION_TOLERANCE) -> None:
    """The call left the output (bit for bit) and the model's state as they were, and gave a finite relevance, not all
    zero, that under CP-LRP sums to the explained logit within ``conservation`` of it."""
    assert torch.equal(outcome.output, outcome.plain), where
    assert outcome.state_unchanged, where
    assert torch.isfinite(outcome.relevance).all(), where
    assert outcome.relevance.abs().sum() > 0, where
    if preset == "cplrp":
        error = outcome.conservation_error()
        assert error <= conservation, (where, error)


def check_implementations_agree(
    outcomes: dict[str, Outcome], where: str, tolerance: float = IMPLEMENTATION_TOLERANCE
) -> None:
    """Eager and sdpa attention, where both ran, gave the same relevance within ``tolerance``."""
    if len(outcomes) == 2:
        error = relative_error(outcomes["sdpa"].relevance, outcomes["eager"].relevance)
        assert error <= tolerance, (where, error)


def check_zoo_outcomes(
    outcomes: dict[str, Outcome],
    name: str,
    preset: str,
    conservation: float = CONSERVATION_TOLERANCE,
    tolerance: float = IMPLEMENTATION_TOLERANCE,
) -> None:
    """Every implementation's call raised no warning and passed :func:`check_outcome`; the implementations agree."""
    for implementation, outcome in outcomes.items():
        where = f"{name} {preset} {implementation}"
        assert outcome.warnings == [], where
        check_outcome(outcome, where, preset, conservation)
    check_implementations_agree(outcomes, f"{name} {preset}", tolerance)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo(name: str, preset: str):
    check_zoo_outcomes({impl: explain(name, preset, impl) for impl in ZOO[name].implementations()}, name, preset)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("name", sorted(ZOO))
def test_later_calls_of_a_context_equal_first_calls(name: str, preset: str):
    """A context's later calls of a signature replay its first call's plan (no function modes: hooks put on the
    nodes a walk of the graph finds, modules run without theirs): on other inputs of the same shapes, and again
    after a call of another batch size (a signature of its own), each equals a fresh wrapper's first call on the
    same input (a router's choice of experts, a padding mask's, all follow the inputs)."""
    architecture = ZOO[name]
    explained = Explained(architecture.build(architecture.implementations()[0]), architecture.inputs)
    x = model_input(architecture)
    inputs = [x, x.flip(0) * 0.9, x[:1], x * 1.1 + 0.05]

    def explain_with(lrp: LRP, value: torch.Tensor) -> torch.Tensor:
        return lrp(TensorDict(x=value.clone(), batch_size=value.shape[:1]))["relevance", "x"]

    lrp = LRP(explained, PRESETS[preset](), in_keys=["x"], out_keys=["y"])
    with lrp:
        later = [explain_with(lrp, value) for value in inputs]
    for i, (value, relevance) in enumerate(zip(inputs, later, strict=True)):
        first = explain_with(LRP(explained, PRESETS[preset](), in_keys=["x"], out_keys=["y"]), value)
        torch.testing.assert_close(relevance, first, rtol=1e-12, atol=0.0, msg=lambda m, i=i: f"call {i}: {m}")


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("name", sorted(ZOO))
def test_every_unit_at_once_equals_each_unit_alone(name: str, preset: str):
    """``target="all"`` (one forward pass, a backward pass per unit over its retained graph), in a context's first
    and planned calls, gives each unit the relevance a call explaining that unit alone gives: no rule's state is
    spent by the first unit's pass (a record popped, a held value consumed, a hook removed)."""
    architecture = ZOO[name]
    explained = Explained(architecture.build(architecture.implementations()[0]), architecture.inputs)
    x = model_input(architecture)

    def explain_with(lrp: LRP, value: torch.Tensor) -> torch.Tensor:
        return lrp(TensorDict(x=value.clone(), batch_size=value.shape[:1]))["relevance", "x"]

    lrp = LRP(explained, PRESETS[preset](), in_keys=["x"], out_keys=["y"], target="all")
    with lrp:
        every = [explain_with(lrp, value) for value in (x, x * 1.1)]  # recorded, then planned
    units = every[0].shape[1]
    for call, (value, relevance) in enumerate(zip((x, x * 1.1), every, strict=True)):
        for unit in (0, units // 2, units - 1):
            alone = explain_with(LRP(explained, PRESETS[preset](), in_keys=["x"], out_keys=["y"], target=unit), value)
            torch.testing.assert_close(
                relevance[:, unit],
                alone,
                rtol=1e-10,
                atol=1e-12 * alone.abs().max().item(),
                msg=lambda m, call=call, unit=unit: f"call {call}, unit {unit}: {m}",
            )


def cosine_per_sample(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return nn.functional.cosine_similarity(a.flatten(1).double(), b.flatten(1).double(), dim=1)


@pytest.mark.parametrize("name", sorted(name for name, architecture in ZOO.items() if architecture.bfloat16))
def test_bfloat16_agrees_with_float32(name: str):
    """bfloat16 relevance is finite and close to float32's (MoE experts on their default kernels)."""
    architecture = ZOO[name]
    implementation = architecture.implementations()[-1]
    values = {k: v for k, v in architecture.values.items() if k != "experts_implementation"}
    default_experts = Architecture(architecture.config, architecture.model, values, architecture.inputs)
    results, target = {}, None
    for dtype in (torch.float32, torch.bfloat16):
        model = default_experts.build(implementation, dtype, scale=BFLOAT16_SCALE)
        explained, x = Explained(model, architecture.inputs), model_input(architecture, dtype)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lrp = LRP(explained, AttnLRP(), in_keys=["x"], out_keys=["y"], target=target)
            td = lrp(TensorDict(x=x, batch_size=[BATCH]))
        assert [str(w.message) for w in caught] == [], dtype
        results[dtype] = td["relevance", "x"]
        target = td["y"].argmax(-1)  # bfloat16 explains the logit float32 explained, even where its argmax differs
    assert results[torch.bfloat16].dtype == torch.bfloat16
    assert torch.isfinite(results[torch.bfloat16]).all()
    cosine = cosine_per_sample(results[torch.bfloat16], results[torch.float32])
    assert (cosine >= 0.95).all(), cosine


def zoo_table() -> str:
    """The markdown table of docs/transformers.md: the largest ``|Σ relevance − logit| / |logit|`` over the batch
    per architecture and attention implementation, biases and additive embeddings zeroed, under CP-LRP and, for
    comparison, AttnLRP (which does not conserve by design)."""
    lines = [
        "| architecture | attention | CP-LRP | AttnLRP |",
        "| --- | --- | --- | --- |",
    ]
    for name, architecture in ZOO.items():
        for implementation in architecture.implementations():
            cp = explain(name, "cplrp", implementation).conservation_error()
            attn = explain(name, "attnlrp", implementation, zeroed=True).conservation_error()
            lines.append(f"| {name} | {implementation} | {cp:.1e} | {attn:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(zoo_table())


class DetachedRouter(nn.Module):
    """A router whose outputs are detached by hand: the reference for routing weights held constant."""

    def __init__(self, router: nn.Module) -> None:
        super().__init__()
        self.router = router

    def forward(self, hidden: torch.Tensor) -> tuple:
        return tuple(out.detach() if isinstance(out, torch.Tensor) else out for out in self.router(hidden))


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "olmoe", "qwen3_moe", "jetmoe"])
def test_routing_weights_are_held_constant(name: str, preset: str):
    """A mixture of experts: all relevance flows through the experts (the routing weights held constant), and
    it is conserved through the mixture. (JetMoE's router is a gate named ``TopKGating`` that holds its projection.)"""
    model = ZOO[name].build("eager")
    zero_additive(model)
    block = model.model.layers[0].mlp
    reference, router = copy.deepcopy(block), "router" if name == "jetmoe" else "gate"
    setattr(reference, router, DetachedRouter(getattr(reference, router)))
    x = model_input(ZOO[name])
    relevance = {}
    for kind, moe in (("rules", block), ("reference", reference)):
        td = LRP(moe, PRESETS[preset](), in_keys=["x"], out_keys=["y"])(TensorDict(x=x.clone(), batch_size=[BATCH]))
        relevance[kind] = td["relevance", "x"]
    assert torch.equal(td["y"], block(x))  # the routing is unchanged
    assert relative_error(relevance["rules"], relevance["reference"]) <= 1e-12
    out = block(x)
    explained = out.gather(-1, out.argmax(-1, keepdim=True)).sum((1, 2))
    total = relevance["rules"].sum((1, 2))
    assert ((total - explained).abs() / explained.abs()).max() <= CONSERVATION_TOLERANCE


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("implementation", ["flash_attention_2", "flex_attention", "kernels-community/flash-attn"])
def test_attention_the_rules_cannot_follow_is_an_error_saying_how_to_switch(implementation: str, preset: str):
    model = ZOO["llama"].build("eager")
    model.config._attn_implementation = implementation
    x = model_input(ZOO["llama"])
    lrp = LRP(Explained(model), PRESETS[preset](), in_keys=["x"], out_keys=["y"])
    with pytest.raises(ValueError, match=f"'model' \\(LlamaForCausalLM\\).*'{implementation}'.*attn_implementation"):
        lrp(TensorDict(x=x, batch_size=[BATCH]))
    model.config._attn_implementation = "sdpa"  # switched as the message says: explained
    assert torch.isfinite(lrp(TensorDict(x=x, batch_size=[BATCH]))["relevance", "x"]).all()


# Mixers that carry a state along the sequence: Mamba's selective scan and Qwen3-Next's gated delta rule.
RECURRENT_MIXERS = {
    "mamba": (
        Architecture(
            "MambaConfig",
            "MambaForCausalLM",
            dict({key: None for key in ("num_attention_heads", "num_key_value_heads", "head_dim")}, state_size=4),
            sdpa=False,
        ),
        "model.backbone.layers.0.mixer",
        "MambaMixer",
    ),
    "qwen3_next": (
        Architecture(
            "Qwen3NextConfig",
            "Qwen3NextForCausalLM",
            dict(
                MOE,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=32,
                linear_num_value_heads=4,
                linear_num_key_heads=2,
                linear_key_head_dim=8,
                linear_value_head_dim=8,
                layer_types=["linear_attention", "full_attention"],
            ),
        ),
        "model.model.layers.0.linear_attn",
        "Qwen3NextGatedDeltaNet",
    ),
}


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("name", sorted(RECURRENT_MIXERS))
def test_a_recurrent_mixer_no_rule_follows_is_named(name: str, preset: str):
    """A state-space or linear-attention recurrence (``exp`` of input-dependent decays, products of activations
    along the sequence) has no rule: its plain gradient does not conserve. The wrapper names the mixer: in a
    warning, or in an error with ``strict=True``, leaving the caller's TensorDict as it was."""
    architecture, module, module_class = RECURRENT_MIXERS[name]
    model, x = architecture.build("eager"), model_input(architecture)
    named = f"module '{module}' \\({module_class}\\) computes [a-z_, ]*exp"
    lrp = LRP(Explained(model), PRESETS[preset](), in_keys=["x"], out_keys=["y"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lrp(TensorDict(x=x, batch_size=[BATCH]))
    assert any(re.search(named, str(w.message)) for w in caught), [str(w.message) for w in caught]
    strict = LRP(Explained(model), PRESETS[preset](strict=True), in_keys=["x"], out_keys=["y"])
    td = TensorDict(x=x, batch_size=[BATCH])
    with pytest.raises(ValueError, match=named):
        strict(td)
    assert set(td.keys()) == {"x"}


@pytest.mark.parametrize(
    "name, norm_class",
    [
        ("gemma", "GemmaRMSNorm"),  # x · rsqrt(mean(x²) + ε) · (1 + w)
        ("gemma2", "Gemma2RMSNorm"),
        ("gemma3", "Gemma3RMSNorm"),
        ("t5_encoder", "T5LayerNorm"),  # named a LayerNorm, computes an RMS norm (no centring)
        ("llama", "LlamaRMSNorm"),
    ],
)
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_rms_norms_pass_relevance_on_element_by_element(name: str, norm_class: str, preset: str):
    """An RMS norm with its normalising scale held constant is a per-element scaling: each element's relevance
    passes on unchanged, whatever the scale (``w`` or Gemma's ``1 + w``). A mean-centring rule would spread it."""
    modules = ZOO[name].build("eager").modules()
    norm = next(m for m in modules if type(m).__name__ == norm_class and m.weight.numel() == HIDDEN)
    assert norm.weight.abs().mean() > 0.1  # randomised scales, away from Gemma's initial zero
    x = model_input(ZOO[name])
    relevance_out = torch.randn(x.shape, dtype=F64)
    lrp = LRP(norm, PRESETS[preset](), in_keys=["x"], out_keys=["y"], target=lambda y: relevance_out)
    relevance = lrp(TensorDict(x=x, batch_size=[BATCH]))["relevance", "x"]
    assert relative_error(relevance, relevance_out) <= 1e-6  # the norm computes in float32
