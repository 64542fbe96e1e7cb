"""Hugging Face's time-series transformers under AttnLRP and CP-LRP, built from tiny random configs.

The companion of ``test_lrp_transformer_zoo.py`` (hidden size 32, two layers, float64, norm scales randomised), for
forecasters explained on their four inputs at once: the past values (with their lags), the past and future time
features, and the future values the decoder is fed (teacher forcing). The explained output is the decoder's last
hidden state at the last step. For each model and preset (eager attention: transformers has no other for them):

1. the wrapper changes neither the output nor the ``state_dict``, and raises no warning but, for ProbSparse
   attention, the one that names the keys it samples at random in each call;
2. every relevance is finite, and the past values get some;
3. under CP-LRP, with biases and learned additive embeddings zeroed, the relevance of the four inputs together sums
   to the explained unit within 1e-6 of it (1e-4 for Autoformer, which runs in float32 only).

The models scale the series by its own statistics by default (``scaling="mean"`` or ``"std"``): a division by the
series' mean absolute value or standard deviation, whose logarithm is also fed as a feature. No rule follows that,
and the wrapper names it; the models are explained here without a scaler.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field

import pytest
import torch
import transformers
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP
from tests.attribution.test_lrp_transformer_zoo import PRESETS, scaled_up, zero_additive
from tests.conftest import relative_error

BATCH, CONTEXT, HORIZON, LAGS = 2, 8, 4, (1, 2)
TIME_SERIES = dict(prediction_length=HORIZON, context_length=CONTEXT, lags_sequence=list(LAGS), num_time_features=1)
TIME_SERIES |= dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4)
TIME_SERIES |= dict(decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64)
KEYS = ("past_values", "past_time_features", "future_time_features", "future_values")


@dataclass(frozen=True)
class Forecaster:
    """One model: its config and model classes, the config's values, the dtype it runs in."""

    config: str
    model: str
    values: dict = field(default_factory=dict)
    dtype: torch.dtype = torch.float64
    tolerance: float = 1e-6  # of conservation

    def build(self, scaling: str | bool = False) -> nn.Module:
        config = getattr(transformers, self.config)(**TIME_SERIES, **self.values, scaling=scaling)
        config._attn_implementation = "eager"
        torch.manual_seed(0)
        return scaled_up(getattr(transformers, self.model)(config).eval(), 3.0).to(self.dtype)

    def inputs(self) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(1)
        steps = dict(zip(KEYS, (CONTEXT + max(LAGS), CONTEXT + max(LAGS), HORIZON, HORIZON), strict=True))
        shapes = {key: (BATCH, length, 1) if "features" in key else (BATCH, length) for key, length in steps.items()}
        values = {key: torch.randn(shape, generator=generator, dtype=torch.float64) for key, shape in shapes.items()}
        values["past_values"] += 3.0  # a series away from zero, as a scaler expects
        return {key: value.to(self.dtype) for key, value in values.items()}


MODELS = {
    # The vanilla encoder-decoder over lagged values and time features.
    "time_series_transformer": Forecaster("TimeSeriesTransformerConfig", "TimeSeriesTransformerModel"),
    # Informer: full attention, its encoder distilled between layers (convolution, BatchNorm, ELU, max pooling).
    "informer": Forecaster("InformerConfig", "InformerModel", dict(attention_type="full", distil=True)),
    # Informer's ProbSparse attention: the queries whose scores against randomly sampled keys are the most peaked
    # attend, the others take the mean of the values (the random keys drawn again in each call: seeded alike).
    "informer_prob": Forecaster("InformerConfig", "InformerModel", dict(attention_type="prob", sampling_factor=1)),
    # Autoformer: series decomposition by moving averages, attention by autocorrelation (Fourier transforms, the top
    # lags' correlations under a softmax, the values rolled by them). transformers runs it in float32 only.
    "autoformer": Forecaster(
        "AutoformerConfig",
        "AutoformerModel",
        dict(moving_average=3, autocorrelation_factor=1, label_length=4),
        dtype=torch.float32,
        tolerance=1e-4,
    ),
}


class Forecast(nn.Module):
    """The decoder's last hidden state at the last step, from the four inputs."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, past, past_features, future_features, future) -> torch.Tensor:
        observed = torch.ones_like(past)
        out = self.model(
            past_values=past,
            past_time_features=past_features,
            past_observed_mask=observed,
            future_time_features=future_features,
            future_values=future,
            use_cache=False,
        )
        return out.last_hidden_state[:, -1]


def explain(forecaster: Forecaster, model: nn.Module, preset) -> tuple[TensorDict, torch.Tensor, list[str]]:
    inputs = forecaster.inputs()
    torch.manual_seed(2)  # ProbSparse attention samples keys in each call: the same ones in both calls
    plain = Forecast(model)(*inputs.values()).detach()
    torch.manual_seed(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lrp = LRP(Forecast(model), preset, in_keys=list(KEYS), out_keys=["y"])
        td = lrp(TensorDict({key: value.clone() for key, value in inputs.items()}, batch_size=[BATCH]))
    return td, plain, [str(w.message) for w in caught]


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_four_inputs_explained_together(name: str, preset: str):
    forecaster = MODELS[name]
    model = forecaster.build()
    if preset == "cplrp":
        zero_additive(model)
    state = {key: value.clone() for key, value in model.state_dict().items()}
    td, plain, caught = explain(forecaster, model, PRESETS[preset]())
    draws = [message for message in caught if "draws at random in its own forward" in message]
    assert [message for message in caught if message not in draws] == []
    if name == "informer_prob":  # the queries that attend depend on the keys sampled
        assert draws and all("(InformerProbSparseAttention)" in m and "torch.randint" in m for m in draws), draws
    else:
        assert draws == []
    assert torch.equal(td["y"], plain)
    after = model.state_dict()
    assert state.keys() == after.keys() and all(torch.equal(state[k], after[k]) for k in state)
    parts = [td["relevance", key].flatten(1) for key in KEYS]
    assert all(torch.isfinite(part).all() for part in parts)
    assert parts[0].abs().sum() > 0
    if preset == "cplrp":
        total, explained = sum(part.sum(1) for part in parts), plain.max(-1).values
        error = ((total - explained).abs() / explained.abs()).max()
        assert error <= forecaster.tolerance, error


@pytest.mark.parametrize(
    "scaling, named",
    [
        ("mean", r"module 'model' \(TimeSeriesTransformerModel\) computes div, log"),
        ("std", r"module 'model.scaler' \(TimeSeriesStdScaler\) computes pow, sqrt"),
    ],
)
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_scaler_by_the_series_own_statistics_is_named(scaling: str, named: str, preset: str):
    """``x / mean(|x|)`` and ``(x − mean) / std`` over the series, and the logarithm of the scale fed as a feature:
    no rule follows them; a warning names the module, and ``strict=True`` raises that error instead."""
    forecaster = MODELS["time_series_transformer"]
    model = forecaster.build(scaling)
    _, _, caught = explain(forecaster, model, PRESETS[preset]())
    assert any(re.search(named, message) for message in caught), caught
    with pytest.raises(ValueError, match=named):
        explain(forecaster, model, PRESETS[preset](strict=True))


def timesfm(implementation: str) -> nn.Module:
    """TimesFM: patches of the series standardised by the mean and standard deviation of its first patch, a
    decoder-only transformer, its forecast scaled back (``forecast · σ + μ``). Without positional embeddings (a
    sinusoidal table, added), its frequency embedding zeroed."""
    config = transformers.TimesFmConfig(
        patch_length=4,
        context_length=16,
        horizon_length=4,
        hidden_size=32,
        intermediate_size=64,
        head_dim=8,
        num_attention_heads=4,
        num_hidden_layers=2,
        use_positional_embedding=False,
    )
    config._attn_implementation = implementation
    torch.manual_seed(0)
    model = scaled_up(transformers.TimesFmModelForPrediction(config).eval(), 3.0).double()
    zero_additive(model)
    with torch.no_grad():
        model.decoder.freq_emb.weight.zero_()
    return model


class Forecasts(nn.Module):
    """TimesFM's mean forecast of the next steps."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, past: torch.Tensor) -> torch.Tensor:
        return self.model(past_values=past, freq=torch.zeros(past.shape[0], dtype=torch.long)).mean_predictions


@pytest.mark.filterwarnings("ignore:To copy construct from a tensor")  # transformers' own torch.tensor(tensor)
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_timesfm_holds_its_standardisation_as_a_norm(preset: str):
    """TimesFM standardises the series by its first patch's statistics, ``(x − μ) / σ``, and scales the forecast
    back: the standard deviation is held constant at both places, as a norm's scale is, and the mean keeps its plain
    (linear) gradient. No warning; CP-LRP conserves; eager and sdpa agree; under CP-LRP the relevance is the gradient
    × input of the model with its attention weights, norms' scales and activations' ratios, and σ, detached."""
    from tests.attribution.test_lrp_transformer_zoo_detached import Detached, detached_gradient_times_input

    past = torch.randn(BATCH, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64) + 3.0
    relevance, explained = {}, {}
    for implementation in ("eager", "sdpa"):
        explained[implementation] = Forecasts(timesfm(implementation))
        plain = explained[implementation](past).detach()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            td = LRP(explained[implementation], PRESETS[preset](), in_keys=["x"], out_keys=["y"])(
                TensorDict(x=past.clone(), batch_size=[BATCH])
            )
        assert [str(w.message) for w in caught if str(w.message).startswith("LRP")] == []
        assert torch.equal(td["y"], plain)
        relevance[implementation] = td["relevance", "x"]
        if preset == "cplrp":
            explained_unit = plain.max(-1).values
            assert ((relevance[implementation].sum(1) - explained_unit).abs() / explained_unit.abs()).max() <= 1e-6
    assert relative_error(relevance["sdpa"], relevance["eager"]) <= 1e-6
    if preset == "cplrp":
        Detached.held = (torch.sqrt,)  # σ = sqrt(variance); the eager model, whose softmax the mode sees
        try:
            (expected,) = detached_gradient_times_input(explained["eager"], (past,), td["y"].argmax(-1))
        finally:
            Detached.held = ()
        assert relative_error(relevance["eager"], expected) <= 1e-8
