"""Hugging Face speech encoders, audio codecs and a vocoder beyond the zoos, from tiny random configs in float64.

1. Speech encoders (WavLM and UniSpeech on a waveform; Wav2Vec2-BERT with relative-key and rotary
   positions, Parakeet's conformer, Qwen2-Audio's encoder on filter-bank features; Moonshine's encoder on a raw
   waveform) pass the zoo's checks under AttnLRP and CP-LRP: no warning, the output (bit for bit) and the
   ``state_dict`` unchanged, finite relevance, CP-LRP conserving within 1e-6 with biases and additive embeddings
   zeroed, eager and sdpa agreeing. WavLM's gated relative position bias multiplies a sigmoid by ``(sigmoid · c −
   1)``: AttnLRP names the product in a warning (its constant takes a share); CP-LRP holds it with the attention
   weights and warns of nothing.
2. On each of them, CP-LRP equals the gradient × input of the same model with its attention weights, norms' scales
   and activation ratios detached (WavLM's attention is ``F.multi_head_attention_forward`` with separate projection
   weights, written out in the oracle).
3. EnCodec's and Mimi's encoders (weight-normed causal convolutions, reflect padding, ELU, an LSTM with a residual
   sum; a time-group norm; Mimi's transformer with a layer scale) and SpeechT5's HiFi-GAN vocoder (transposed
   convolutions, leaky ReLU, multi-receptive-field residual blocks, ``tanh``): CP-LRP, with its stabilisers at
   1e-12, equals the gradient × input of the same model with the held quantities detached and its LSTM written as a
   loop with gates detached and ``tanh`` passing relevance on (signal-take-all).
4. What no rule covers is named: SEW-D's attention computes its masked softmax in an autograd Function of its own
   (``XSoftmax``), and DAC's Snake activation ``x + sin²(αx) / α`` computes ``sin``.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
import transformers
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import CPLRP, LRP
from tdhook.attribution.lrp_helpers.rules import EpsilonPlus
from tests.attribution import test_lrp_transformer_zoo as zoo
from tests.attribution import test_lrp_transformer_zoo_detached as detached
from tests.attribution import test_lrp_transformer_zoo_more as more
from tests.attribution.test_lrp_transformer_zoo import HIDDEN, UNSET, Architecture
from tests.attribution.test_lrp_transformer_zoo_more import Case, waveform
from tests.conftest import relative_error

F64 = torch.float64
BATCH = zoo.BATCH
FEATURES = (BATCH, 8, 16)  # 8 frames of 16 filter-bank features


def logits(keyword: str) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    return lambda model, x: model(**{keyword: x}).logits


def last_position(keyword: str) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    return lambda model, x: model(**{keyword: x}).last_hidden_state[:, -1]


W2V_BERT = dict(feature_projection_input_dim=16, conv_depthwise_kernel_size=3, classifier_proj_size=8)
CASES = {
    # WavLM: relative position buckets, a gate computed from the queries scaling the position bias; eager only.
    "wavlm": waveform("WavLMConfig", "WavLMForSequenceClassification", sdpa=False, num_buckets=16),
    "unispeech": waveform("UniSpeechConfig", "UniSpeechForSequenceClassification"),
    # Wav2Vec2-BERT: a conformer on filter-bank features (GLU, depth-wise convolutions), relative keys or rotary.
    "wav2vec2_bert": Case(
        Architecture(
            "Wav2Vec2BertConfig",
            "Wav2Vec2BertForSequenceClassification",
            dict(
                W2V_BERT,
                position_embeddings_type="relative_key",
                left_max_position_embeddings=8,
                right_max_position_embeddings=8,
            ),
        ),
        shape=FEATURES,
        call=logits("input_features"),
    ),
    "wav2vec2_bert_rotary": Case(
        Architecture(
            "Wav2Vec2BertConfig",
            "Wav2Vec2BertForSequenceClassification",
            dict(W2V_BERT, position_embeddings_type="rotary"),
        ),
        shape=FEATURES,
        call=logits("input_features"),
    ),
    # Parakeet: a strided convolutional subsampling of 16 frames of 16 mel bins, then a conformer.
    "parakeet": Case(
        Architecture(
            "ParakeetEncoderConfig",
            "ParakeetEncoder",
            dict(num_mel_bins=16, subsampling_conv_channels=8, conv_kernel_size=3),
        ),
        shape=(BATCH, 16, 16),
        call=last_position("input_features"),
    ),
    # Moonshine's encoder: convolutions over 2000 samples (tanh, a GroupNorm, GELU), rotary attention.
    "moonshine_encoder": Case(
        Architecture(
            "MoonshineConfig",
            "MoonshineModel",
            dict(
                UNSET,
                encoder_num_hidden_layers=2,
                decoder_num_hidden_layers=1,
                encoder_num_attention_heads=4,
                decoder_num_attention_heads=4,
                vocab_size=64,
                max_position_embeddings=64,
            ),
        ),
        shape=(BATCH, 2000),
        call=lambda model, x: model.encoder(input_values=x).last_hidden_state[:, -1],
    ),
    # Qwen2-Audio's encoder: Whisper's convolutions and transformer with an average pooling after it.
    "qwen2_audio_encoder": Case(
        Architecture(
            "Qwen2AudioEncoderConfig",
            "Qwen2AudioEncoder",
            dict(
                num_mel_bins=8,
                encoder_layers=2,
                encoder_attention_heads=4,
                encoder_ffn_dim=64,
                d_model=HIDDEN,
                max_source_positions=8,
            ),
        ),
        shape=FEATURES,
        call=last_position("input_features"),
    ),
}
# The warnings a preset gives on an architecture (a pattern each warning matches); none elsewhere.
EXPECTED_WARNINGS = {
    ("wavlm", "attnlrp"): r"'model\.wavlm\.encoder\.layers\.\d\.attention' \(WavLMAttention\) multiplies activations "
    r"where a factor adds a constant",
}


def explain(name: str, preset: str, implementation: str) -> zoo.Outcome:
    case = CASES[name]
    model = case.architecture.build(implementation)
    if preset == "cplrp":
        more.zero_additive(model)
    return zoo.outcome_of(case.explained(model), model, case.input(), preset)


@pytest.mark.parametrize("preset", sorted(zoo.PRESETS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_speech_encoders(name: str, preset: str):
    outcomes = {impl: explain(name, preset, impl) for impl in CASES[name].architecture.implementations()}
    expected = EXPECTED_WARNINGS.get((name, preset))
    for implementation, outcome in outcomes.items():
        where = f"{name} {preset} {implementation}"
        if expected is None:
            assert outcome.warnings == [], where
        else:
            assert outcome.warnings and all(re.search(expected, w) for w in outcome.warnings), outcome.warnings
        zoo.check_outcome(outcome, where, preset)
    zoo.check_implementations_agree(outcomes, f"{name} {preset}")


class AudioDetached(more.DetachedMore):
    """The zoo's oracle mode, with ``F.multi_head_attention_forward``'s separate projection weights packed into
    one (WavLM's call)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is F.multi_head_attention_forward and kwargs.pop("use_separate_proj_weight", False):
            weights = [kwargs.pop(f"{part}_proj_weight") for part in "qkv"]
            args = (*args[:5], torch.cat(weights), *args[6:])
        return super().__torch_function__(func, types, args, kwargs)


@pytest.mark.parametrize("name", sorted(CASES))
def test_cplrp_is_gradient_times_input_with_the_held_quantities_detached(name: str, monkeypatch):
    monkeypatch.setattr(detached, "Detached", AudioDetached)  # what detached_gradient_times_input runs in
    case = CASES[name]
    model, x = case.architecture.build("eager"), case.input()
    explained = case.explained(model)
    td = LRP(explained, CPLRP(), in_keys=["x"], out_keys=["y"])(TensorDict(x=x.clone(), batch_size=[BATCH]))
    replaced = more.gates_held(model)
    try:
        (expected,) = detached.detached_gradient_times_input(explained, (x,), td["y"].argmax(-1))
    finally:
        for parent, child, module in replaced:
            setattr(parent, child, module)
    assert relative_error(td["relevance", "x"], expected) <= 1e-7


# --- Codecs and a vocoder ----------------------------------------------------------------------------------------


def passed_on(f, x: torch.Tensor) -> torch.Tensor:
    return x * (f(x) / x).detach()


class HeldLSTM(nn.Module):
    """A time-major, one-directional ``nn.LSTM`` without initial states, written as a loop with its gates detached
    and its ``tanh`` passing relevance on: the network whose gradient × input is signal-take-all LRP-0."""

    def __init__(self, lstm: nn.LSTM) -> None:
        super().__init__()
        assert not lstm.batch_first and not lstm.bidirectional and lstm.proj_size == 0
        self.lstm = lstm

    def forward(self, x: torch.Tensor, state: None = None) -> tuple[torch.Tensor, None]:
        assert state is None
        size = self.lstm.hidden_size
        for layer in range(self.lstm.num_layers):
            w_ih, w_hh = getattr(self.lstm, f"weight_ih_l{layer}"), getattr(self.lstm, f"weight_hh_l{layer}")
            bias = getattr(self.lstm, f"bias_ih_l{layer}") + getattr(self.lstm, f"bias_hh_l{layer}")
            h, c, outputs = x.new_zeros(x.shape[1], size), x.new_zeros(x.shape[1], size), []
            for step in x.unbind(0):
                i, f, g, o = (step @ w_ih.T + h @ w_hh.T + bias).chunk(4, -1)
                i, f, o = (torch.sigmoid(gate).detach() for gate in (i, f, o))
                c = f * c + i * passed_on(torch.tanh, g)
                h = o * passed_on(torch.tanh, c)
                outputs.append(h)
            x = torch.stack(outputs)
        return x, None


def with_held_lstms(model: nn.Module) -> nn.Module:
    held = copy.deepcopy(model)
    for parent in list(held.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.LSTM):
                setattr(parent, name, HeldLSTM(child))
    return held


class Called(nn.Module):
    def __init__(self, model: nn.Module, call: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.model, self.call = model, call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.call(self.model, x)


@dataclass(frozen=True)
class Codec:
    """A model built from its config's values, the input's shape, the explained output, and the factor its
    matrices are scaled by (HiFi-GAN's initialisation gives outputs of 1e-6)."""

    config: str
    model: str
    values: dict
    shape: tuple[int, ...]
    call: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    scale: float = 1.0

    def build(self) -> nn.Module:
        torch.manual_seed(0)
        model = getattr(transformers, self.model)(getattr(transformers, self.config)(**self.values)).to(F64).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.dim() > 1:
                    param.mul_(self.scale)
                elif name.endswith("weight"):  # norm scales away from one
                    param.add_(0.3 * torch.randn_like(param))
        return model

    def input(self) -> torch.Tensor:
        return torch.randn(self.shape, generator=torch.Generator().manual_seed(1), dtype=F64)


SEANET = dict(hidden_size=16, num_filters=4, upsampling_ratios=[2, 2], codebook_size=16, codebook_dim=16)
SEANET |= dict(kernel_size=3, last_kernel_size=3)
ENCODEC = dict(SEANET, num_lstm_layers=1)
CODECS = {
    "encodec": Codec("EncodecConfig", "EncodecModel", ENCODEC, (BATCH, 1, 32), lambda m, x: m.encoder(x)[:, :, -1]),
    "encodec_time_group_norm": Codec(
        "EncodecConfig",
        "EncodecModel",
        dict(ENCODEC, norm_type="time_group_norm", use_causal_conv=False),
        (BATCH, 1, 32),
        lambda m, x: m.encoder(x)[:, :, -1],
    ),
    "mimi": Codec(
        "MimiConfig",
        "MimiModel",
        dict(
            SEANET,
            num_quantizers=2,
            vector_quantization_hidden_dimension=16,
            num_hidden_layers=1,
            intermediate_size=32,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=8,
            upsample_groups=16,
            sliding_window=8,
        ),
        (BATCH, 1, 32),
        lambda m, x: m.encoder(x).latents[:, :, -1],
    ),
    "hifigan": Codec(
        "SpeechT5HifiGanConfig",
        "SpeechT5HifiGan",
        dict(
            model_in_dim=8,
            upsample_initial_channel=16,
            upsample_rates=[2, 2],
            upsample_kernel_sizes=[4, 4],
            resblock_kernel_sizes=[3, 5],
            resblock_dilation_sizes=[[1, 3], [1, 3]],
        ),
        (BATCH, 6, 8),
        lambda m, x: m(x),
        scale=8.0,
    ),
}


@pytest.mark.parametrize("name", sorted(CODECS))
def test_cplrp_on_codecs_is_gradient_times_input_with_the_held_quantities_detached(name: str, monkeypatch):
    monkeypatch.setattr(detached, "Detached", AudioDetached)
    codec = CODECS[name]
    model, x = codec.build(), codec.input()
    explained = Called(model, codec.call)
    plain = explained(x)
    state = {key: value.clone() for key, value in model.state_dict().items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lrp = LRP(explained, CPLRP(epsilon=1e-12, stabilizer=1e-12), in_keys=["x"], out_keys=["y"])
        td = lrp(TensorDict(x=x.clone(), batch_size=[BATCH]))
    assert [str(w.message) for w in caught] == []
    assert torch.equal(td["y"], plain)
    assert all(torch.equal(state[key], value) for key, value in model.state_dict().items())
    held = with_held_lstms(explained)
    assert torch.allclose(held(x), plain)
    (expected,) = detached.detached_gradient_times_input(held, (x,), td["y"].argmax(-1))
    assert relative_error(td["relevance", "x"], expected) <= 1e-6


# --- What no rule covers -----------------------------------------------------------------------------------------

SEW_D = waveform("SEWDConfig", "SEWDForSequenceClassification", sdpa=False, squeeze_factor=2)
XSOFTMAX = (
    r"'model\.sew_d\.encoder\.encoder\.layer\.\d\.attention\.self' \(DisentangledSelfAttention\) computes XSoftmax"
)


@pytest.mark.parametrize("preset", sorted(zoo.PRESETS))
def test_the_masked_softmax_function_of_sew_d_is_named(preset: str):
    model = SEW_D.architecture.build("eager")
    outcome = zoo.outcome_of(SEW_D.explained(model), model, SEW_D.input(), preset)
    assert torch.isfinite(outcome.relevance).all()
    assert any(re.search(XSOFTMAX, w) for w in outcome.warnings), outcome.warnings


@pytest.mark.parametrize("preset", [EpsilonPlus, CPLRP], ids=lambda preset: preset.__name__)
def test_the_snake_activation_of_dac_is_named(preset):
    dac = Codec(
        "DacConfig",
        "DacModel",
        dict(
            encoder_hidden_size=4,
            downsampling_ratios=[2, 2],
            decoder_hidden_size=16,
            upsampling_ratios=[2, 2],
            hidden_size=16,
            n_codebooks=2,
            codebook_size=16,
            codebook_dim=4,
            hop_length=4,
        ),
        (BATCH, 1, 32),
        lambda m, x: m.encoder(x)[:, :, -1],
    )
    explained = Called(dac.build(), dac.call)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        td = LRP(explained, preset(), in_keys=["x"], out_keys=["y"])(TensorDict(x=dac.input(), batch_size=[BATCH]))
    assert torch.isfinite(td["relevance", "x"]).all()
    messages = [str(w.message) for w in caught]
    assert any("module 'model.encoder.snake1' (Snake1d) computes sin" in message for message in messages), messages
