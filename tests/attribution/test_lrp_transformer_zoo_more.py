"""More Hugging Face architectures under AttnLRP and CP-LRP, from tiny random configs, against an oracle.

The companion of ``test_lrp_transformer_zoo.py`` (hidden size 32, two layers, float64, matrices scaled up tenfold, norm
scales randomised), for architectures its tables do not hold: language models (GPT-J, CodeGen, StarCoder 2, Granite,
StableLM, Persimmon, OLMo 2, GLM-4, Nemotron, Cohere 2, BioGPT, Arcee, SmolLM3, GPT-Neo, MusicGen's decoder), text
encoders (Nomic BERT, XLM, LUKE, SqueezeBERT, I-BERT and the encoders of Pegasus and Marian), speech encoders (HuBERT,
Data2Vec-Audio, SEW, the Audio Spectrogram Transformer, SpeechT5's, SeamlessM4T's and SeamlessM4T v2's conformers,
CLAP's audio Swin) and vision models (DINOv2 with a layer scale and with registers, DINOv3, PVTv2, AIMv2, BiT, DETR,
SAM's image encoder, ViTDet, and the pooled outputs of SigLIP and SigLIP 2, whose attention-pooling head is torch's
``nn.MultiheadAttention``). For each architecture, preset and attention implementation (``"eager"`` and ``"sdpa"``,
where transformers has both):

1. the wrapper changes neither the output (bit for bit) nor the ``state_dict``, and raises no warning;
2. every relevance is finite;
3. under CP-LRP, with biases and learned additive embeddings (and sinusoidal tables) zeroed, relevance sums to the
   explained unit within 1e-6 of it;
4. eager and sdpa attention give the same relevance (up to the float32 arithmetic some norms and softmaxes run in).

CP-LRP is also compared, element by element, with the gradient × input of the same model with the quantities it
holds detached (``test_lrp_transformer_zoo_detached.py``'s oracle, which shares no code with the rules), extended to
what these architectures compute: RMS norms and group norms called as functions, the attention inside
``F.multi_head_attention_forward``, gated linear units (``F.glu``, the sigmoid gate held) and the gates of gated
feed-forward networks (``act(gate(x)) * up(x)``, the activation's output held). Conservation alone would not see
relevance moved between tokens or features; this equality does.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import CPLRP, LRP
from tests.attribution import test_lrp_transformer_zoo as zoo
from tests.attribution import test_lrp_transformer_zoo_detached as detached
from tests.attribution.test_lrp_transformer_zoo import HIDDEN, IMAGE, MOE, UNSET, VISION, WAV2VEC2, Architecture
from tests.attribution.test_lrp_transformer_zoo_detached import Detached, detached_gradient_times_input
from tests.conftest import relative_error

F64 = torch.float64
BATCH = zoo.BATCH
NO_VISION = {key: None for key in VISION}
SEQ2SEQ = dict(d_model=HIDDEN, encoder_layers=2, decoder_layers=1, encoder_attention_heads=4)
SEQ2SEQ |= dict(decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)
SPEECH_TO_TEXT = dict(SEQ2SEQ, speech_encoder_layers=2, speech_encoder_attention_heads=4)
SPEECH_TO_TEXT |= dict(speech_encoder_intermediate_size=64, feature_projection_input_dim=16, num_adapter_layers=1)
SPEECH_TO_TEXT |= dict(adaptor_kernel_size=3, adaptor_stride=2, conv_depthwise_kernel_size=3, t2u_vocab_size=8)
SPEECH_TO_TEXT |= dict(unit_hifi_gan_vocab_size=8, t2u_encoder_layers=1, t2u_decoder_layers=1, vocab_size=64)
# Learned additive parameters beside the zoo's (zeroed for conservation): registers, SpeechT5's scaled positional
# encoding (``x + alpha * table``) and its relative position embeddings.
ADDITIVE = ("register_tokens", "alpha", "pe_k")
ADDITIVE_BUFFERS = ("sinusoidal", "embed_positions")  # sinusoidal tables held as buffers (SpeechT5, MusicGen)
# Where a gated feed-forward network holds its activation: the module that has one of these layers, its child.
# ModernBERT's gated MLP: ``Wi`` gives both halves, ``act`` takes the first.
GATE_LAYERS, GATE_ACTIVATIONS = ("gate_proj", "gate_up_proj", "Wi"), ("act_fn", "activation_fn", "act")
ROUTERS = ("gate", "router")  # the names of a mixture's router module
# The experts and the routers of the mixtures: few and small.
SHARED = dict(n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=16, n_group=1, topk_group=1)
LATENT = dict(SHARED, head_dim=None, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, v_head_dim=8)
LATENT |= dict(qk_rope_head_dim=4, qk_nope_head_dim=4)


def last_position(model: nn.Module, x: torch.Tensor, keyword: str) -> torch.Tensor:
    return model(**{keyword: x}).last_hidden_state[:, -1]


def pooled(model: nn.Module, x: torch.Tensor, keyword: str = "pixel_values", **kwargs) -> torch.Tensor:
    return model(**{keyword: x}, **kwargs).pooler_output


def encoder_last_position(model: nn.Module, x: torch.Tensor, keyword: str) -> torch.Tensor:
    return model.get_encoder()(**{keyword: x}).last_hidden_state[:, -1]


def siglip2_pooled(model: nn.Module, patches: torch.Tensor) -> torch.Tensor:
    """SigLIP 2's pooled output of 16 patches on a 4 × 4 grid (NaFlex: flattened patches, their grid given)."""
    mask, shapes = torch.ones(BATCH, 16, dtype=torch.long), torch.tensor([[4, 4]] * BATCH)
    return model(pixel_values=patches, pixel_attention_mask=mask, spatial_shapes=shapes).pooler_output


@dataclass(frozen=True)
class Case:
    """One architecture: how the zoo builds it, the explained input's shape and how the model is called on it
    (the zoo's ``Explained`` by default)."""

    architecture: Architecture
    shape: tuple[int, ...] | None = None  # the zoo's shape for the architecture's kind of input by default
    call: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None
    tolerance: float = 1e-6  # eager against sdpa
    conservation: float = zoo.CONSERVATION_TOLERANCE
    held: tuple = ()  # functions whose outputs the oracle detaches: gates the presets hold (an attention output's)

    def explained(self, model: nn.Module) -> nn.Module:
        return Called(model, self.call) if self.call is not None else zoo.Explained(model, self.architecture.inputs)

    def input(self) -> torch.Tensor:
        shape = self.shape or zoo.INPUTS[self.architecture.inputs][1]
        return torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=F64)


class Called(nn.Module):
    def __init__(self, model: nn.Module, call: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.model, self.call = model, call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.call(self.model, x)


def text(config: str, model: str, sdpa: bool = True, held: tuple = (), tolerance: float = 1e-6, **values) -> Case:
    return Case(Architecture(config, model, values, sdpa=sdpa), held=held, tolerance=tolerance)


def image(config: str, model: str, sdpa: bool = True, **values) -> Case:
    return Case(Architecture(config, model, dict(values), inputs="image", sdpa=sdpa))


def waveform(config: str, model: str, sdpa: bool = True, **values) -> Case:
    return Case(Architecture(config, model, dict(WAV2VEC2, **values), inputs="waveform", sdpa=sdpa))


VIT = dict(image_size=IMAGE, patch_size=4)
SIGMOIDS = (torch.sigmoid, torch.Tensor.sigmoid)
FULL_ATTENTION = ["full_attention", "full_attention"]
CASES = {
    # Language models, fed ``inputs_embeds``; the next-token logits explained.
    "gptj": text("GPTJConfig", "GPTJForCausalLM", **UNSET, n_embd=HIDDEN, n_layer=2, n_head=4, rotary_dim=4),
    "codegen": text("CodeGenConfig", "CodeGenForCausalLM", **UNSET, n_embd=HIDDEN, n_layer=2, n_head=4, rotary_dim=4),
    "starcoder2": text("Starcoder2Config", "Starcoder2ForCausalLM", head_dim=None),
    # Granite: the embeddings, residual branches, attention scores and logits scaled by constants.
    "granite": text(
        "GraniteConfig",
        "GraniteForCausalLM",
        head_dim=None,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.3,
        logits_scaling=2.0,
    ),
    # Mixtures of experts routed by sigmoid scores with a selection bias, top-k renormalised and scaled, beside shared
    # experts (DeepSeek-V3 with multi-head latent attention, GLM-4.5, dots.llm1, MiniMax-M2, EXAONE MoE, Solar Open),
    # by a softmax (ERNIE 4.5, Granite MoE), and AFMoE's router with its bias as an argument and gated attention.
    "deepseek_v3": text("DeepseekV3Config", "DeepseekV3ForCausalLM", **MOE, **LATENT, first_k_dense_replace=1),
    "glm4_moe": text("Glm4MoeConfig", "Glm4MoeForCausalLM", **MOE, **SHARED, head_dim=None, first_k_dense_replace=1),
    "dots1": text("Dots1Config", "Dots1ForCausalLM", **MOE, **SHARED, head_dim=None, first_k_dense_replace=1),
    "minimax_m2": text("MiniMaxM2Config", "MiniMaxM2ForCausalLM", **MOE, num_local_experts=4),
    "exaone_moe": text("ExaoneMoeConfig", "ExaoneMoeForCausalLM", **MOE, moe_intermediate_size=16),
    "solar_open": text("SolarOpenConfig", "SolarOpenForCausalLM", **MOE, **SHARED),
    "ernie4_5_moe": text(
        "Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", **MOE, moe_num_experts=4, moe_k=2, moe_intermediate_size=16
    ),
    "granitemoe": text("GraniteMoeConfig", "GraniteMoeForCausalLM", **MOE, num_local_experts=4),
    "afmoe": text("AfmoeConfig", "AfmoeForCausalLM", **MOE, moe_intermediate_size=16),
    # Dense language models of the newest releases: Seed-OSS, EXAONE 4 (norms after the blocks), Apertus (xIELU),
    # OLMo 3, VaultGemma (eager attention only), nanochat, Ministral 3, Jais 2.
    "seed_oss": text("SeedOssConfig", "SeedOssForCausalLM"),
    "exaone4": text("Exaone4Config", "Exaone4ForCausalLM"),
    "apertus": text("ApertusConfig", "ApertusForCausalLM"),
    "olmo3": text("Olmo3Config", "Olmo3ForCausalLM"),
    "vaultgemma": text("VaultGemmaConfig", "VaultGemmaForCausalLM", sdpa=False),
    "nanochat": text("NanoChatConfig", "NanoChatForCausalLM"),
    "ministral3": text("Ministral3Config", "Ministral3ForCausalLM"),
    "jais2": text("Jais2Config", "Jais2ForCausalLM"),
    # Gemma 4's text models (the unified one's RMS norms by a power -0.5), Qwen 3.5's attention layers (an output gate,
    # a sigmoid the presets hold; beside experts in its mixture), Laguna (an attention output gate by a softplus, held
    # too), ModernBERT's decoder (its gated MLP's activation on the first half), DiffLlama (two softmaxes subtracted,
    # an RMS norm of the heads), DeepSeek-V3.2 (a top-k indexer of the keys, run without gradient), BitNet (RMS norms
    # inside attention and MLP) and MiMo-V2-Flash (attention sinks in its sliding-window layers; eager only).
    "gemma4_text": text("Gemma4TextConfig", "Gemma4ForCausalLM", hidden_size_per_layer_input=0),
    "gemma4_unified_text": text("Gemma4UnifiedTextConfig", "Gemma4UnifiedForCausalLM"),
    # Gemma 4 with its mixture of experts beside the MLP: the router's own RMS norm (scale-free, a power -0.5) runs
    # where the router's rule pauses the function modes; experts gated by GELU. Its norms compute in float32 (eight
    # per layer): eager and sdpa agree to 1.1e-6.
    "gemma4_moe_text": text(
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        tolerance=2e-6,
        hidden_size_per_layer_input=0,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=16,
        experts_implementation="eager",
    ),
    "qwen3_5": text("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", held=SIGMOIDS, layer_types=FULL_ATTENTION),
    "qwen3_5_moe": text(
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        held=SIGMOIDS,
        layer_types=FULL_ATTENTION,
        **MOE,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
    ),
    "laguna": text("LagunaConfig", "LagunaForCausalLM", held=(F.softplus,), **MOE, moe_intermediate_size=16),
    "modernbert_decoder": text("ModernBertDecoderConfig", "ModernBertDecoderForCausalLM", pad_token_id=0),
    "diffllama": text("DiffLlamaConfig", "DiffLlamaForCausalLM"),
    # Its eager and sdpa attention agree to 2e-6 under AttnLRP (the eager attention's softmax in float32).
    "deepseek_v32": text(
        "DeepseekV32Config", "DeepseekV32ForCausalLM", tolerance=1e-5, **MOE, **LATENT, first_k_dense_replace=1
    ),
    "bitnet": text("BitNetConfig", "BitNetForCausalLM"),
    "mimo_v2_flash": text(
        "MiMoV2FlashConfig", "MiMoV2FlashForCausalLM", sdpa=False, **MOE, **SHARED, v_head_dim=8, sliding_window=4
    ),
    # StableLM: LayerNorms on queries and keys per head, partial rotary embeddings.
    "stablelm": text("StableLmConfig", "StableLmForCausalLM", head_dim=None, qk_layernorm=True),
    # Persimmon: a squared ReLU, LayerNorms on queries and keys.
    "persimmon": text("PersimmonConfig", "PersimmonForCausalLM", head_dim=None, num_key_value_heads=None),
    # OLMo 2: RMS norms after attention and MLP, and on the whole queries and keys.
    "olmo2": text("Olmo2Config", "Olmo2ForCausalLM"),
    # GLM-4: gate and up projections in one layer (``gate_up_proj``), norms after attention and MLP.
    "glm4": text("Glm4Config", "Glm4ForCausalLM", pad_token_id=0),
    # Nemotron: a LayerNorm computing x · (1 + w), a squared ReLU without a gate.
    "nemotron": text("NemotronConfig", "NemotronForCausalLM", partial_rotary_factor=0.5),
    # Cohere 2: sliding-window and global layers, a LayerNorm written by hand, attention and MLP in parallel.
    "cohere2": text(
        "Cohere2Config", "Cohere2ForCausalLM", layer_types=["sliding_attention", "full_attention"], sliding_window=4
    ),
    "biogpt": text("BioGptConfig", "BioGptForCausalLM", **UNSET),
    # Arcee: a squared ReLU in an MLP without a gate.
    "arcee": text("ArceeConfig", "ArceeForCausalLM"),
    "smollm3": text("SmolLM3Config", "SmolLM3ForCausalLM", head_dim=None, pad_token_id=0),
    # GPT-Neo: global and local (windowed) attention layers; eager only.
    "gpt_neo": text(
        "GPTNeoConfig",
        "GPTNeoForCausalLM",
        sdpa=False,
        **UNSET,
        num_layers=2,
        num_heads=4,
        attention_types=[[["global", "local"], 1]],
        window_size=4,
    ),
    # MusicGen's decoder: two codebooks' embeddings summed, a sinusoidal table (zeroed); the first codebook's logits.
    "musicgen_decoder": Case(
        Architecture("MusicgenDecoderConfig", "MusicgenForCausalLM", dict(UNSET, ffn_dim=64, num_codebooks=2)),
        call=lambda model, x: model(inputs_embeds=x).logits.reshape(BATCH, 2, x.shape[1], -1)[:, 0, -1],
    ),
    # Text encoders; the classifier's logits explained.
    "nomic_bert": text("NomicBertConfig", "NomicBertForSequenceClassification", **UNSET),
    "xlm": text(
        "XLMConfig", "XLMForSequenceClassification", sdpa=False, **UNSET, emb_dim=HIDDEN, n_layers=2, n_heads=4
    ),
    "luke": text(
        "LukeConfig", "LukeForSequenceClassification", sdpa=False, **UNSET, entity_vocab_size=8, entity_emb_size=HIDDEN
    ),
    # DeBERTa: disentangled attention (content and relative-position scores), its layer norm written out with a
    # ``sqrt`` (which the oracle detaches here); eager only.
    "deberta": text(
        "DebertaConfig",
        "DebertaForSequenceClassification",
        sdpa=False,
        held=(torch.sqrt,),
        **UNSET,
        relative_attention=True,
        pos_att_type=["c2p", "p2c"],
    ),
    # ESM-2 (protein language model): rotary positions, a GELU written out with ``erf`` (its factor a gate, held).
    "esm": text(
        "EsmConfig", "EsmForSequenceClassification", held=(torch.erf,), pad_token_id=0, position_embedding_type="rotary"
    ),
    # SqueezeBERT: grouped one-dimensional convolutions in place of the dense layers; eager only.
    "squeezebert": text(
        "SqueezeBertConfig",
        "SqueezeBertForSequenceClassification",
        sdpa=False,
        **UNSET,
        embedding_size=HIDDEN,
        q_groups=2,
        k_groups=2,
        v_groups=2,
        post_attention_groups=2,
        intermediate_groups=4,
        output_groups=4,
    ),
    "pegasus_encoder": Case(
        Architecture("PegasusConfig", "PegasusModel", dict(UNSET, **SEQ2SEQ)),
        call=lambda model, x: encoder_last_position(model, x, "inputs_embeds"),
    ),
    "marian_encoder": Case(
        Architecture("MarianConfig", "MarianMTModel", dict(UNSET, **SEQ2SEQ, pad_token_id=0, decoder_start_token_id=0)),
        call=lambda model, x: encoder_last_position(model, x, "inputs_embeds"),
    ),
    # Speech encoders on a waveform of 64 samples (the zoo's wav2vec 2.0 feature encoder).
    "hubert": waveform("HubertConfig", "HubertForSequenceClassification"),
    "data2vec_audio": waveform(
        "Data2VecAudioConfig",
        "Data2VecAudioForSequenceClassification",
        num_conv_pos_embeddings=2,
        conv_pos_kernel_size=3,
    ),
    # SEW: the sequence squeezed by a strided convolution before the transformer and upsampled after it.
    "sew": waveform("SEWConfig", "SEWForSequenceClassification", squeeze_factor=2),
    # SpeechT5's encoder: its speech prenet (convolutions, a scaled sinusoidal table) and relative position keys.
    "speecht5_encoder": Case(
        Architecture(
            "SpeechT5Config",
            "SpeechT5ForSpeechToText",
            dict(UNSET, **SEQ2SEQ, **WAV2VEC2, encoder_max_relative_position=8),
            inputs="waveform",
            sdpa=False,
        ),
        call=lambda model, x: encoder_last_position(model, x, "input_values"),
    ),
    # SeamlessM4T's conformer speech encoder over 8 frames of 16 features: gated linear units, depth-wise
    # convolutions, BatchNorm, relative position scores, a strided adaptor; v2 with chunked attention.
    "seamless_m4t_speech": Case(
        Architecture("SeamlessM4TConfig", "SeamlessM4TForSpeechToText", SPEECH_TO_TEXT, sdpa=False),
        shape=(BATCH, 8, 16),
        call=lambda model, x: encoder_last_position(model, x, "input_features"),
    ),
    "seamless_m4t_v2_speech": Case(
        Architecture(
            "SeamlessM4Tv2Config",
            "SeamlessM4Tv2ForSpeechToText",
            dict(SPEECH_TO_TEXT, speech_encoder_chunk_size=4, speech_encoder_left_chunk_num=1),
            sdpa=False,
        ),
        shape=(BATCH, 8, 16),
        call=lambda model, x: encoder_last_position(model, x, "input_features"),
    ),
    # The Audio Spectrogram Transformer on 8 frames of 16 mel bins (patches of 4 × 4).
    "ast": Case(
        Architecture(
            "ASTConfig",
            "ASTForAudioClassification",
            dict(num_mel_bins=16, max_length=8, patch_size=4, frequency_stride=4, time_stride=4),
        ),
        shape=(BATCH, 8, 16),
        call=lambda model, x: model(input_values=x).logits,
    ),
    # CLAP's audio encoder: a BatchNorm over the mel bins of the transposed spectrogram, a Swin, a pooled output.
    "clap_audio": Case(
        Architecture(
            "ClapAudioConfig",
            "ClapAudioModel",
            dict(
                patch_embeds_hidden_size=16,
                depths=[1, 1],
                num_attention_heads=[2, 2],
                window_size=2,
                spec_size=16,
                num_mel_bins=16,
                patch_size=4,
                patch_stride=[4, 4],
                enable_fusion=False,
                projection_dim=16,
            ),
            sdpa=False,
        ),
        shape=(BATCH, 1, 16, 16),
        call=lambda model, x: pooled(model, x, "input_features"),
        # That BatchNorm follows no layer it could merge into: the ε-rule of its affine map, whose stabiliser (1e-6,
        # absolute) costs 1.5e-6 of the score here (4e-11 with a stabiliser of 1e-12).
        conservation=1e-5,
    ),
    # Vision encoders on 16 × 16 pixels.
    "dinov2": image("Dinov2Config", "Dinov2ForImageClassification", **VIT, layerscale_value=1.0),
    "dinov2_with_registers": image(
        "Dinov2WithRegistersConfig",
        "Dinov2WithRegistersForImageClassification",
        **VIT,
        num_register_tokens=2,
        layerscale_value=1.0,
    ),
    # DINOv3: rotary position embeddings over the patch grid, register tokens, a layer scale.
    "dinov3_vit": image("DINOv3ViTConfig", "DINOv3ViTModel", **VIT, num_register_tokens=2, layerscale_value=1.0),
    # PVTv2: spatial-reduction attention (keys and values from a strided convolution), depth-wise convolutions.
    "pvt_v2": image(
        "PvtV2Config",
        "PvtV2ForImageClassification",
        sdpa=False,
        **NO_VISION
        | dict(
            image_size=IMAGE,
            num_encoder_blocks=2,
            depths=[1, 1],
            sr_ratios=[2, 1],
            hidden_sizes=[16, 32],
            patch_sizes=[3, 3],
            strides=[2, 2],
            num_attention_heads=[1, 2],
            mlp_ratios=[2, 2],
        ),
    ),
    "aimv2": image("Aimv2VisionConfig", "Aimv2VisionModel", **VIT),
    # BiT: weight-standardised convolutions and group norms, pre-activation blocks; eager only.
    "bit": image(
        "BitConfig",
        "BitForImageClassification",
        sdpa=False,
        **NO_VISION,
        embedding_size=32,
        hidden_sizes=[32, 64],
        depths=[1, 1],
        layer_type="preactivation",
        num_groups=8,
    ),
    # DETR: a ResNet backbone (frozen BatchNorms), sine position embeddings added to queries and keys, learned object
    # queries (zeroed, additive); the first query's class logits.
    "detr": Case(
        Architecture(
            "DetrConfig",
            "DetrForObjectDetection",
            dict(NO_VISION, use_timm_backbone=False, use_pretrained_backbone=False, d_model=HIDDEN, num_queries=4)
            | dict(encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4)
            | dict(encoder_ffn_dim=64, decoder_ffn_dim=64)
            | dict(backbone_config=dict(model_type="resnet", embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1])),
            inputs="image",
            sdpa=False,
        ),
        shape=(BATCH, 3, 32, 32),
        call=lambda model, x: model(pixel_values=x).logits[:, 0],
    ),
    # SAM's image encoder and ViTDet: windowed and global attention with decomposed relative positions; SAM's neck
    # (convolutions, channel-wise LayerNorms). A few units of the output feature map explained.
    "sam_vision": Case(
        Architecture(
            "SamVisionConfig",
            "SamVisionModel",
            dict(image_size=32, patch_size=8, output_channels=8, window_size=2, global_attn_indexes=[1], mlp_dim=64)
            | dict(num_pos_feats=8),
            inputs="image",
            sdpa=False,
        ),
        shape=(BATCH, 3, 32, 32),
        call=lambda model, x: model(pixel_values=x).last_hidden_state.flatten(1)[:, :6],
    ),
    "vitdet": Case(
        Architecture(
            "VitDetConfig",
            "VitDetModel",
            dict(mlp_ratio=2, image_size=32, pretrain_image_size=32, patch_size=8, window_size=2)
            | dict(window_block_indices=[0], use_relative_position_embeddings=True),
            inputs="image",
            sdpa=False,
        ),
        shape=(BATCH, 3, 32, 32),
        call=lambda model, x: model(pixel_values=x).last_hidden_state.flatten(1)[:, :6],
    ),
    # SigLIP's pooled output: a learned probe (zeroed) attending over the patches through nn.MultiheadAttention.
    "siglip_pooled": Case(
        Architecture("SiglipVisionConfig", "SiglipVisionModel", VIT, inputs="image"),
        call=pooled,
        tolerance=1e-5,  # the float32 softmax of the eager attention
    ),
    # Swin V2: cosine attention scaled by a learned, clamped and exponentiated logit scale, and a continuous relative
    # position bias from a small MLP squashed by 16 · sigmoid; ImageGPT: its hand-written layer norm (no mean
    # subtracted), its sequence classifier's mean pooling over tokens.
    "swinv2": image(
        "Swinv2Config",
        "Swinv2ForImageClassification",
        sdpa=False,
        patch_size=2,
        embed_dim=16,
        depths=[1, 1],
        num_heads=[2, 2],
        window_size=4,
        num_hidden_layers=None,
        num_attention_heads=None,
        intermediate_size=None,
    ),
    "imagegpt": text(
        "ImageGPTConfig",
        "ImageGPTForImageClassification",
        sdpa=False,
        held=(torch.sqrt,),  # its norm's scale, written as a division by a sqrt
        vocab_size=17,
        n_positions=16,
        n_embd=HIDDEN,
        n_layer=2,
        n_head=4,
        n_inner=64,
        hidden_size=None,
        num_hidden_layers=None,
        num_attention_heads=None,
        intermediate_size=None,
        max_position_embeddings=None,
        num_key_value_heads=None,
        head_dim=None,
    ),
    # I-BERT out of its integer mode: its layer norm written out, the mean subtracted and a division by a `sqrt`.
    "ibert": text(
        "IBertConfig",
        "IBertForSequenceClassification",
        sdpa=False,
        held=(torch.sqrt,),
        **UNSET,
        max_position_embeddings=64,
    ),
    "siglip2_pooled": Case(
        Architecture("Siglip2VisionConfig", "Siglip2VisionModel", dict(num_patches=16, patch_size=4), inputs="image"),
        shape=(BATCH, 16, 48),
        call=siglip2_pooled,
        tolerance=1e-5,
    ),
}


def zero_additive(model: nn.Module) -> None:
    zoo.zero_additive(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(part in name for part in ADDITIVE):
                param.zero_()
        for name, buffer in model.named_buffers():
            if any(part in name for part in ADDITIVE_BUFFERS):
                buffer.zero_()


def explain(name: str, preset: str, implementation: str) -> zoo.Outcome:
    case = CASES[name]
    model = case.architecture.build(implementation)
    if preset == "cplrp":
        zero_additive(model)
    return zoo.outcome_of(case.explained(model), model, case.input(), preset)


@pytest.mark.parametrize("preset", sorted(zoo.PRESETS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_more_architectures(name: str, preset: str):
    case = CASES[name]
    outcomes = {impl: explain(name, preset, impl) for impl in case.architecture.implementations()}
    zoo.check_zoo_outcomes(outcomes, name, preset, case.conservation, case.tolerance)


class DetachedMore(Detached):
    """The zoo's oracle mode, extended: ``F.rms_norm`` and ``F.group_norm`` with their scales detached, the
    attention of ``F.multi_head_attention_forward`` (which a mode sees as one call) written out with its softmax
    detached, ``F.glu`` with its sigmoid gate detached, and a power -0.5 (an RMS norm's scale) detached."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.rms_norm:
            return held_rms_norm(*args, **kwargs)
        if func in (torch.pow, torch.Tensor.pow) and len(args) > 1 and isinstance(args[1], float) and args[1] == -0.5:
            return func(*args, **kwargs).detach()  # an RMS norm's scale as a power (Gemma 4's)
        if func is F.group_norm:
            return held_group_norm(*args, **kwargs)
        if func is F.multi_head_attention_forward:
            return held_multi_head_attention(*args, **kwargs)
        if func is F.glu:
            first, second = args[0].chunk(2, args[1] if len(args) > 1 else kwargs.get("dim", -1))
            return first * torch.sigmoid(second).detach()
        return super().__torch_function__(func, types, args, kwargs)


def held_rms_norm(x, normalized_shape, weight=None, eps=None):
    dims = tuple(range(-len(normalized_shape), 0))
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    y = x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps).detach()
    return y if weight is None else y * weight


def held_group_norm(x, num_groups, weight=None, bias=None, eps=1e-5):
    grouped = x.reshape(x.shape[0], num_groups, -1)
    centred = grouped - grouped.mean(-1, keepdim=True)
    y = (centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + eps).detach()).reshape(x.shape)
    channels = (1, -1) + (1,) * (x.dim() - 2)
    y = y if weight is None else y * weight.reshape(channels)
    return y if bias is None else y + bias.reshape(channels)


def held_multi_head_attention(query, key, value, embed_dim, num_heads, in_proj_weight, in_proj_bias, *args, **kwargs):
    """Attention over ``(length, batch, features)`` tensors with packed input projections and no added key and value
    biases (SigLIP's pooling heads), written out with its attention weights detached."""
    names = ("bias_k", "bias_v", "add_zero_attn", "dropout_p", "out_proj_weight", "out_proj_bias", "training")
    names += ("key_padding_mask", "need_weights", "attn_mask")
    given = dict(zip(names, args, strict=False)) | kwargs
    assert given.get("bias_k") is None and not given.get("add_zero_attn"), "not written out"
    head = embed_dim // num_heads

    def heads(t: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return F.linear(t, weight, bias).reshape(t.shape[0], t.shape[1] * num_heads, head).transpose(0, 1)

    weights, biases = in_proj_weight.chunk(3), in_proj_bias.chunk(3)
    q, k, v = (heads(t, w, b) for t, w, b in zip((query, key, value), weights, biases, strict=True))
    scores = q @ k.transpose(1, 2) / head**0.5
    padding = given.get("key_padding_mask")
    if padding is not None:  # (batch, keys): each sample's mask for all its heads
        padding = padding.repeat_interleave(num_heads, 0)[:, None, :]
    for mask in (given.get("attn_mask"), padding):
        if mask is not None:
            scores = scores.masked_fill(mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    out = (torch.softmax(scores, -1).detach() @ v).transpose(0, 1).reshape(query.shape[0], query.shape[1], embed_dim)
    return F.linear(out, given["out_proj_weight"], given["out_proj_bias"]), None


class HeldOutput(nn.Module):
    """A module whose output (or each tensor of it) is detached: a gated feed-forward network's gate, a router's
    routing weights, held as CP-LRP holds them."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        out = self.module(*args, **kwargs)
        if isinstance(out, tuple):
            return tuple(part.detach() if isinstance(part, torch.Tensor) else part for part in out)
        return out.detach()


def gates_held(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """Put a :class:`HeldOutput` around the activation of every gated feed-forward network of ``model``, and around
    every mixture's router (its routing weights held, as the presets hold them: a sigmoid router's scores are no
    softmax the oracle detaches); the replaced ``(parent, name, module)`` triples, to put them back."""
    replaced = []
    for parent in list(model.modules()):
        names = GATE_ACTIVATIONS if any(hasattr(parent, layer) for layer in GATE_LAYERS) else ()
        names += tuple(name for name in ROUTERS if type(getattr(parent, name, None)).__name__.endswith("Router"))
        for name in names:
            if isinstance(getattr(parent, name, None), nn.Module):
                replaced.append((parent, name, getattr(parent, name)))
                setattr(parent, name, HeldOutput(getattr(parent, name)))
    return replaced


# Where the oracle does not apply: the BatchNorm of CLAP's transposed
# spectrogram, whose plain gradient PyTorch computes wrongly (see test_the_batch_norm_of_a_transposed_input...).
NO_ORACLE = {"clap_audio"}
# Where the oracle's ratio f(x) / x of an activation is 0 / 0: AFMoE's router starts at zero, and one channel of
# VaultGemma's MLP input is zero everywhere.
NO_ORACLE |= {"afmoe", "vaultgemma"}
# Where the oracle's ratio f(x) / x is 0 / 0 in its forward pass itself: Swin V2's 16 · sigmoid of its position-bias
# MLP's output, whose input holds zeros (the relative coordinates of a token with itself).
NO_ORACLE |= {"swinv2"}


@pytest.mark.parametrize("name", sorted(set(CASES) - NO_ORACLE))
def test_cplrp_is_gradient_times_input_with_the_held_quantities_detached(name: str, monkeypatch):
    monkeypatch.setattr(detached, "Detached", DetachedMore)  # what detached_gradient_times_input runs in
    case = CASES[name]
    monkeypatch.setattr(DetachedMore, "held", case.held)
    model, x = case.architecture.build("eager"), case.input()
    explained = case.explained(model)
    td = LRP(explained, CPLRP(), in_keys=["x"], out_keys=["y"])(TensorDict(x=x.clone(), batch_size=[BATCH]))
    replaced = gates_held(model)
    try:
        (expected,) = detached_gradient_times_input(explained, (x,), td["y"].argmax(-1))
    finally:
        for parent, child, module in replaced:
            setattr(parent, child, module)
    assert relative_error(td["relevance", "x"], expected) <= 1e-6, relative_error(td["relevance", "x"], expected)


# The mixtures above whose routers the presets hold, and the name of their last layer's mixture of experts.
MIXTURES = {name: "mlp" for name in ("deepseek_v3", "glm4_moe", "dots1", "minimax_m2", "exaone_moe", "solar_open")}
MIXTURES |= {"ernie4_5_moe": "mlp", "afmoe": "mlp", "granitemoe": "block_sparse_moe"}


@pytest.mark.parametrize("preset", sorted(zoo.PRESETS))
@pytest.mark.parametrize("name", sorted(MIXTURES))
def test_the_routers_of_more_mixtures_are_held_constant(name: str, preset: str):
    """All relevance flows through the experts: the relevance of the last layer's mixture equals that of the same
    mixture with its router's outputs detached, and the routing is unchanged."""
    case = CASES[name]
    model = case.architecture.build("eager")
    zoo.zero_additive(model)
    block = getattr(model.model.layers[-1], MIXTURES[name])
    reference = copy.deepcopy(block)
    routers = [router for router in ROUTERS if type(getattr(block, router, None)).__name__.endswith("Router")]
    assert len(routers) == 1, routers
    setattr(reference, routers[0], HeldOutput(getattr(reference, routers[0])))
    x = zoo.model_input(case.architecture)
    relevance = {}
    for kind, moe in (("rules", block), ("reference", reference)):
        td = LRP(moe, zoo.PRESETS[preset](), in_keys=["x"], out_keys=["y"])(TensorDict(x=x.clone(), batch_size=[BATCH]))
        relevance[kind] = td["relevance", "x"]
    assert torch.equal(td["y"], block(x))
    assert relative_error(relevance["rules"], relevance["reference"]) <= 1e-12


class TransposedBatchNorm(nn.Module):
    """CLAP's front end: a BatchNorm over the last dimension of a ``(batch, 1, time, bins)`` spectrogram, applied to
    the transposed input made contiguous, transposed back, then a Linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.linear = nn.BatchNorm2d(6).eval(), nn.Linear(24, 3)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 2.0)
            self.norm.running_var.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = self.norm(x.transpose(1, 3).contiguous()).transpose(1, 3)
        return self.linear(normed.flatten(1))


@pytest.mark.parametrize("preset", sorted(zoo.PRESETS))
def test_the_batch_norm_of_a_transposed_input_gets_the_closed_form_relevance(preset: str):
    """The gradient reaching the BatchNorm's output is a transposed view whose strides PyTorch's CPU BatchNorm
    backward misreads when its input is contiguous (its plain gradient is then wrong by more than its own size).
    The rules hand that backward a gradient of the output's layout: the relevance is the closed form
    ``x · s · w_target`` with ``s = γ / sqrt(var + ε)``, up to the ε-rule's stabiliser."""
    torch.manual_seed(0)
    model = TransposedBatchNorm().double()
    x = torch.randn(BATCH, 1, 4, 6, dtype=F64)
    td = LRP(model, zoo.PRESETS[preset](), in_keys=["x"], out_keys=["y"])(TensorDict(x=x.clone(), batch_size=[BATCH]))
    norm = model.norm
    scale = (norm.weight / (norm.running_var + norm.eps).sqrt()).detach()
    weights = model.linear.weight.detach()[td["y"].argmax(-1)].reshape(BATCH, 1, 4, 6)
    closed_form = x * weights * scale
    assert relative_error(td["relevance", "x"], closed_form) <= 1e-5
