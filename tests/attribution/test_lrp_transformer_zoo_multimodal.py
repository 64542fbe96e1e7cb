"""Encoder-decoders and multimodal Hugging Face models under AttnLRP and CP-LRP, built from tiny random configs.

The companion of ``test_lrp_transformer_zoo.py``, whose conventions it keeps (hidden size 32, two layers, float64,
matrices scaled up tenfold, norm scales randomised), for models explained on two inputs at once: an encoder-decoder
on the encoder's input and the decoder's ``decoder_inputs_embeds``, a vision-language model on the pixels and the
text's token ids (explained through the token embedding; the image tokens' embeddings are replaced by the image's
features and get none). Each model's two inputs are two in_keys of one wrapper. For each model, preset and attention
implementation:

1. the wrapper changes neither the output nor the ``state_dict``, and raises no warning;
2. every relevance is finite, and each of the two inputs gets some;
3. under CP-LRP, with biases and learned additive embeddings zeroed, the relevance of the two inputs together sums
   to the explained logit within 1e-6 of it; under AttnLRP its sum is at most the logit's magnitude (the softmax
   rule loses relevance, it creates none here);
4. eager and sdpa attention give the same relevance (up to the float32 softmax of CLIP's and SigLIP's towers).

An encoder-decoder's relevance does not leak across its cross-attention: the source's relevance is the encoder's
relevance for the relevance that a call of the decoder alone gives the encoder's output.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import transformers
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP
from tests.attribution.test_lrp_transformer_zoo import ADDITIVE, COMMON, HIDDEN, PRESETS, VISION, scaled_up
from tests.conftest import relative_error

F64 = torch.float64
IMAGE_TOKEN = 60
VIT = dict(VISION, image_size=16, patch_size=4)  # 16 patches
LLAMA = dict(COMMON, model_type="llama")
SEQ2SEQ = dict(vocab_size=64, d_model=HIDDEN, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4)
SEQ2SEQ |= dict(decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64)
T5 = dict(vocab_size=64, d_model=HIDDEN, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0)
GPT2_DECODER = dict(vocab_size=64, n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=64)
GPT2_DECODER |= dict(add_cross_attention=True, is_decoder=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(1)


def source_embeds() -> torch.Tensor:
    return torch.randn(1, 7, HIDDEN, generator=_generator(), dtype=F64)


def decoder_embeds() -> torch.Tensor:
    return torch.randn(1, 4, HIDDEN, generator=_generator().manual_seed(2), dtype=F64)


def pixels() -> torch.Tensor:
    return torch.randn(1, 3, 16, 16, generator=_generator(), dtype=F64)


def tokens_after_image(image_tokens: int, text: int = 5) -> torch.Tensor:
    words = torch.randint(3, 50, (1, text), generator=_generator())
    return torch.cat([torch.full((1, image_tokens), IMAGE_TOKEN), words], 1)


def with_config(config: str, model: str, **values) -> Callable[[], nn.Module]:
    return lambda: getattr(transformers, model)(getattr(transformers, config)(**values))


def encoder_decoder(encoder: dict, decoder: dict, kind: str = "EncoderDecoder") -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        config = getattr(transformers, f"{kind}Config").from_encoder_decoder_configs(
            transformers.AutoConfig.for_model(**encoder), transformers.AutoConfig.for_model(**decoder)
        )
        return getattr(transformers, f"{kind}Model")(config=config)

    return build


def mllama() -> nn.Module:
    vision = dict(VIT, num_global_layers=1, vision_output_dim=3 * HIDDEN, max_num_tiles=1)
    vision |= dict(attention_heads=4, intermediate_layers_indices=[0, 1], supported_aspect_ratios=[[1, 1]])
    text = dict(LLAMA, cross_attention_layers=[1], pad_token_id=0)
    config = transformers.MllamaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN)
    model = transformers.MllamaForConditionalGeneration(config)
    with torch.no_grad():  # the gates of the cross-attention start closed (tanh(0)): the image would not count
        for name, param in model.named_parameters():
            if name.endswith("_gate"):
                param.fill_(0.7)
    return model


def qwen2_vl() -> nn.Module:
    vision = dict(depth=2, embed_dim=HIDDEN, hidden_size=HIDDEN, num_heads=4, patch_size=2, spatial_merge_size=2)
    vision |= dict(temporal_patch_size=2, in_channels=3, mlp_ratio=2)
    rope = dict(rope_type="default", mrope_section=[1, 1, 2], rope_theta=10000.0)
    text = {key: value for key, value in LLAMA.items() if key != "model_type"} | dict(rope_parameters=rope)
    config = transformers.Qwen2VLConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN)
    config.vision_start_token_id, config.vision_end_token_id, config.video_token_id = 61, 62, 63
    return transformers.Qwen2VLForConditionalGeneration(config)


QWEN_GRID = torch.tensor([[1, 4, 4]])  # 16 patches of 2 × 2 pixels, merged 2 × 2: four image tokens
QWEN_TOKENS = torch.tensor([[5, 61, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, 62, 7, 9, 11]])


def qwen2_vl_call(model: nn.Module, patches: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    mm_token_type_ids = (ids == IMAGE_TOKEN).long()
    kwargs = dict(image_grid_thw=QWEN_GRID, mm_token_type_ids=mm_token_type_ids)
    return model(pixel_values=patches[0], input_ids=ids, **kwargs).logits[:, -1]


def pix2struct_patches() -> torch.Tensor:
    """16 flattened 4 × 4 patches, each with its row and column (1-based) in front."""
    patches = torch.randn(1, 16, 50, generator=_generator(), dtype=F64)
    patches[..., 0], patches[..., 1] = torch.arange(16) // 4 + 1, torch.arange(16) % 4 + 1
    return patches


def seq2seq_call(model: nn.Module, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return model(inputs_embeds=source, decoder_inputs_embeds=target, use_cache=False).logits[:, -1]


def pixels_to_text(model: nn.Module, pixel_values: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return model(pixel_values=pixel_values, decoder_inputs_embeds=target, use_cache=False).logits[:, -1]


def image_and_text(model: nn.Module, pixel_values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return model(pixel_values=pixel_values, input_ids=ids).logits[:, -1]


@dataclass(frozen=True)
class Model:
    """One model of this zoo: how to build it, its two inputs, and how it is called on them."""

    build: Callable[[], nn.Module]
    inputs: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    call: Callable[..., torch.Tensor]
    sdpa: bool = True
    additive: tuple[str, ...] = ()  # learned additive embeddings beside ADDITIVE's, zeroed for conservation
    tolerance: float = 1e-10  # eager against sdpa

    def built(self, implementation: str) -> nn.Module:
        torch.manual_seed(0)
        model = self.build()
        model.set_attn_implementation(implementation)
        return scaled_up(model.eval(), 10.0).to(F64)

    def implementations(self) -> tuple[str, ...]:
        return ("eager", "sdpa") if self.sdpa else ("eager",)


def decision_transformer_call(model: nn.Module, states: torch.Tensor, returns: torch.Tensor) -> torch.Tensor:
    """The next action's prediction from the states and returns-to-go of four steps, the actions taken zero."""
    steps = states.shape[1]
    actions = torch.zeros(1, steps, 3, dtype=states.dtype)
    timesteps, mask = torch.arange(steps)[None], torch.ones(1, steps, dtype=torch.long)
    out = model(states=states, actions=actions, returns_to_go=returns, timesteps=timesteps, attention_mask=mask)
    return out.action_preds[:, -1]


MODELS = {
    # T5 v1.1 (as mT5 and UMT5): gated-GELU feed-forward, untied head; a relative position bias shared by layers.
    "t5_v1_1": Model(
        with_config("T5Config", "T5ForConditionalGeneration", **T5, feed_forward_proj="gated-gelu"),
        lambda: (source_embeds(), decoder_embeds()),
        seq2seq_call,
    ),
    "whisper": Model(
        with_config(
            "WhisperConfig",
            "WhisperForConditionalGeneration",
            **SEQ2SEQ,
            **SPECIAL,
            num_mel_bins=8,
            max_source_positions=8,
            max_target_positions=16,
            suppress_tokens=None,
            begin_suppress_tokens=None,
        ),
        lambda: (torch.randn(1, 8, 16, generator=_generator(), dtype=F64), decoder_embeds()),
        lambda model, features, target: model(
            input_features=features, decoder_inputs_embeds=target, use_cache=False
        ).logits[:, -1],
        additive=("embed_positions",),
    ),
    "bert2gpt2": Model(
        encoder_decoder(dict(model_type="bert", vocab_size=64, **VISION), dict(model_type="gpt2", **GPT2_DECODER)),
        lambda: (source_embeds(), decoder_embeds()),
        seq2seq_call,
    ),
    "vit2gpt2": Model(
        encoder_decoder(dict(model_type="vit", **VIT), dict(model_type="gpt2", **GPT2_DECODER), "VisionEncoderDecoder"),
        lambda: (pixels(), decoder_embeds()),
        pixels_to_text,
        tolerance=1e-6,  # ViT's eager softmax
    ),
    # Pix2Struct: a T5-like encoder over flattened patches with learned row and column embeddings; eager only.
    "pix2struct": Model(
        lambda: transformers.Pix2StructForConditionalGeneration(
            transformers.Pix2StructConfig(
                vision_config=dict(VISION, patch_embed_hidden_size=48, d_ff=64, d_kv=8, seq_len=16, patch_size=4),
                text_config=dict(T5, hidden_size=HIDDEN),
            )
        ),
        lambda: (pix2struct_patches(), decoder_embeds()),
        lambda model, patches, target: model(
            flattened_patches=patches, decoder_inputs_embeds=target, use_cache=False
        ).logits[:, -1],
        sdpa=False,
        additive=("row_embedder", "column_embedder"),
    ),
    # CLIP's image-text score: the product of the two L2-normalised embeddings, scaled.
    "clip": Model(
        lambda: transformers.CLIPModel(
            transformers.CLIPConfig(
                text_config=dict(VISION, vocab_size=64, max_position_embeddings=16, eos_token_id=2),
                vision_config=VIT,
                projection_dim=16,
            )
        ),
        lambda: (pixels(), torch.cat([torch.randint(3, 60, (1, 6), generator=_generator()), torch.tensor([[2]])], 1)),
        lambda model, pixel_values, ids: model(pixel_values=pixel_values, input_ids=ids).logits_per_image,
        tolerance=1e-6,  # CLIP's eager softmax in float32
    ),
    "llava": Model(
        with_config(
            "LlavaConfig",
            "LlavaForConditionalGeneration",
            vision_config=dict(VIT, model_type="clip_vision_model"),
            text_config=LLAMA,
            image_token_id=IMAGE_TOKEN,
            vision_feature_layer=-1,
        ),
        lambda: (pixels(), tokens_after_image(16)),
        image_and_text,
        tolerance=1e-4,  # CLIP's eager softmax in float32 (2.4e-5 under AttnLRP; 1e-7 with it in float64)
    ),
    # Qwen2-VL: flattened patches merged 2 × 2, 3-D (multimodal) rotary positions.
    "qwen2_vl": Model(
        qwen2_vl,
        lambda: (torch.randn(1, 16, 24, generator=_generator(), dtype=F64), QWEN_TOKENS),
        qwen2_vl_call,
        tolerance=1e-6,  # the norms' float32
    ),
    # Idefics3: a SigLIP tower, pixel shuffle (16 patches into 4 tokens), a Llama.
    "idefics3": Model(
        with_config(
            "Idefics3Config",
            "Idefics3ForConditionalGeneration",
            vision_config=VIT,
            text_config=LLAMA,
            image_token_id=IMAGE_TOKEN,
            scale_factor=2,
        ),
        lambda: (pixels()[:, None], tokens_after_image(4)),
        image_and_text,
        tolerance=1e-6,
    ),
    # BLIP-2: a Q-Former (learned queries, zeroed; cross-attention to the image) feeding OPT.
    "blip2": Model(
        with_config(
            "Blip2Config",
            "Blip2ForConditionalGeneration",
            vision_config=dict(VIT, initializer_range=0.02),
            qformer_config=dict(VISION, vocab_size=64, encoder_hidden_size=HIDDEN, max_position_embeddings=64),
            text_config=dict(
                model_type="opt", ffn_dim=64, word_embed_proj_dim=HIDDEN, max_position_embeddings=64, **VISION
            )
            | dict(vocab_size=64),
            num_query_tokens=4,
            image_token_index=IMAGE_TOKEN,
        ),
        lambda: (pixels(), tokens_after_image(4)),
        image_and_text,
        additive=("query_tokens",),
        tolerance=1e-6,
    ),
    # Decision Transformer: a GPT-2 over interleaved returns-to-go, states and actions, a tanh action head; the
    # states and the returns explained together (its learned timestep embedding zeroed, additive).
    "decision_transformer": Model(
        with_config(
            "DecisionTransformerConfig",
            "DecisionTransformerModel",
            state_dim=5,
            act_dim=3,
            hidden_size=HIDDEN,
            n_layer=2,
            n_head=4,
            n_inner=64,
            max_ep_len=16,
            n_positions=64,
        ),
        lambda: (torch.randn(1, 4, 5, generator=_generator(), dtype=F64), decoder_embeds()[..., :1]),
        decision_transformer_call,
        additive=("embed_timestep",),
    ),
    # Mllama: a tiled vision tower with gated positions, cross-attention layers gated by tanh.
    "mllama": Model(
        mllama,
        lambda: (pixels()[:, None, None], tokens_after_image(1, 6)),
        lambda model, pixel_values, ids: model(
            pixel_values=pixel_values,
            input_ids=ids,
            aspect_ratio_ids=torch.tensor([[1]]),
            aspect_ratio_mask=torch.ones(1, 1, 1, dtype=torch.long),
            cross_attention_mask=torch.ones(1, 7, 1, 1, dtype=torch.long),
        ).logits[:, -1],
        tolerance=1e-6,
    ),
}


def zero_additive(model: nn.Module, additive: tuple[str, ...]) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(part in name for part in ADDITIVE + additive):
                param.zero_()


class Called(nn.Module):
    def __init__(self, model: nn.Module, call: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.call = call

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.call(self.model, *inputs)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_two_inputs_explained_together(name: str, preset: str):
    case = MODELS[name]
    first, second = case.inputs()
    relevance = {}
    for implementation in case.implementations():
        model = case.built(implementation)
        zero_additive(model, case.additive)
        explained = Called(model, case.call)
        plain = explained(first, second).detach()
        state = {key: value.clone() for key, value in model.state_dict().items()}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lrp = LRP(explained, PRESETS[preset](), in_keys=["first", "second"], out_keys=["y"])
            td = lrp(TensorDict({"first": first.clone(), "second": second.clone()}, batch_size=[1]))
        where = f"{name} {preset} {implementation}"
        assert [str(w.message) for w in caught] == [], where
        assert torch.equal(td["y"], plain), where
        after = model.state_dict()
        assert state.keys() == after.keys() and all(torch.equal(state[k], after[k]) for k in state), where
        parts = [td["relevance", key].flatten(1) for key in ("first", "second")]
        assert all(torch.isfinite(part).all() and part.abs().sum() > 0 for part in parts), where
        total, logit = sum(part.sum(1) for part in parts), plain.max(-1).values
        if preset == "cplrp":
            assert ((total - logit).abs() / logit.abs()).max() <= 1e-6, (where, total, logit)
        else:
            assert (total.abs() <= logit.abs()).all(), (where, total, logit)
        relevance[implementation] = torch.cat(parts, 1)
    if len(relevance) == 2:
        error = relative_error(relevance["sdpa"], relevance["eager"])
        assert error <= case.tolerance, (name, preset, error)


CROSS_ATTENTION = ["whisper", "bert2gpt2", "vit2gpt2", "t5_v1_1"]


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("name", CROSS_ATTENTION)
def test_no_relevance_leaks_across_the_cross_attention(name: str, preset: str):
    """The full call's relevance is that of its two halves: the decoder explained on the encoder's output (an input
    key beside the decoder's input) gives the decoder's input the full call's relevance, and the encoder explained
    for the relevance its output got gives the source the full call's relevance."""
    case = MODELS[name]
    source, target = case.inputs()
    model = case.built("sdpa")
    zero_additive(model, case.additive)
    encoder = model.get_encoder()
    source_keyword = {"whisper": "input_features", "vit2gpt2": "pixel_values"}.get(name, "inputs_embeds")

    def run(module: nn.Module, inputs: dict[str, torch.Tensor], **options) -> TensorDict:
        lrp = LRP(module, PRESETS[preset](), in_keys=list(inputs), out_keys=["y"], **options)
        return lrp(TensorDict({key: value.clone() for key, value in inputs.items()}, batch_size=[1]))

    full = run(Called(model, case.call), {"first": source, "second": target})
    encoded = encoder(**{source_keyword: source}).last_hidden_state.detach()
    decoder = Called(
        model,
        lambda m, e, t: m(encoder_outputs=(e,), decoder_inputs_embeds=t, use_cache=False).logits[:, -1],
    )
    halves = run(decoder, {"first": encoded, "second": target})
    at_encoder_output = halves["relevance", "first"]
    encoder_alone = Called(encoder, lambda m, s: m(**{source_keyword: s}).last_hidden_state)
    through_encoder = run(encoder_alone, {"first": source}, target=lambda output: at_encoder_output)
    assert relative_error(halves["relevance", "second"], full["relevance", "second"]) <= 1e-10
    assert relative_error(through_encoder["relevance", "first"], full["relevance", "first"]) <= 1e-10
