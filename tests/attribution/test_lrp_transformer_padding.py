"""Hugging Face models called on a left-padded batch (one sample padded, one not), in float64.

Oracles: each sample explained alone (its relevance on its own tokens within 1e-6, none on the padding), CP-LRP's
conservation with biases and learned additive embeddings zeroed, and the plain model's output, bit for bit. Where
transformers' own forward pass is NaN for the padded sample (its eager attention computes a float64 model's softmax
in float32, where the mask's lowest value becomes -inf), the call is refused, naming the attention module.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import LRP
from tests.attribution.test_lrp_transformer_zoo import BATCH, PRESETS, ZOO, model_input, zero_additive
from tests.conftest import relative_error

F64 = torch.float64
PADDED = 3  # left padding of the first sample


class Masked(nn.Module):
    """The explained logits (the next token's, a classifier's) of embeddings fed with a mask and position ids."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        logits = self.model(inputs_embeds=x, attention_mask=mask, position_ids=positions).logits
        return logits[:, -1] if logits.dim() == 3 else logits


def padded_batch(x: torch.Tensor, padded: int = PADDED) -> TensorDict:
    mask = torch.ones(x.shape[:2], dtype=torch.long)
    mask[0, :padded] = 0
    return TensorDict(x=x.clone(), mask=mask, positions=(mask.cumsum(-1) - 1).clamp(min=0), batch_size=[BATCH])


def explainer(model: nn.Module, preset: str) -> LRP:
    module = TensorDictModule(Masked(model), in_keys=["x", "mask", "positions"], out_keys=["y"])
    return LRP(module, PRESETS[preset](), in_keys=["x"])  # the mask and the positions fed, not explained


def alone(lrp: LRP, x: torch.Tensor) -> torch.Tensor:
    """The relevance of one sample's tokens ``x`` explained without padding or another sample."""
    mask = torch.ones(1, x.shape[0], dtype=torch.long)
    td = TensorDict(x=x[None].clone(), mask=mask, positions=torch.arange(x.shape[0])[None], batch_size=[1])
    return lrp(td)["relevance", "x"][0]


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize(
    "name, implementation",
    [("gpt2", "eager"), ("llama", "sdpa"), ("qwen2", "sdpa"), ("gemma", "sdpa"), ("falcon", "eager")],
)
def test_a_left_padded_batch_explains_each_sample_as_alone(name: str, implementation: str, preset: str):
    """The padded sample's tokens and the other sample get the relevance they get alone, the padding none, and
    under CP-LRP each sample's relevance sums to its logit."""
    model = ZOO[name].build(implementation)
    if preset == "cplrp":
        zero_additive(model)
    x, lrp = model_input(ZOO[name]), explainer(model, preset)
    with torch.no_grad():
        batch = padded_batch(x)
        own = Masked(model)(x, batch["mask"], batch["positions"])
    if own.isnan().any():  # Falcon's eager attention from transformers 5.25: its softmax in float32, as Llama's
        with pytest.raises(FloatingPointError, match=r"softmax over float64 scores in float32"):
            lrp(padded_batch(x))
        return
    td = lrp(padded_batch(x))
    relevance = td["relevance", "x"]
    assert torch.equal(td["y"], Masked(model)(x, td["mask"], td["positions"]))
    assert torch.isfinite(relevance).all()
    assert torch.equal(relevance[0, :PADDED], torch.zeros_like(relevance[0, :PADDED]))
    assert relative_error(relevance[0, PADDED:], alone(lrp, x[0, PADDED:])) <= 1e-6
    assert relative_error(relevance[1], alone(lrp, x[1])) <= 1e-6
    if preset == "cplrp":
        logit = td["y"].max(-1).values
        assert ((relevance.flatten(1).sum(1) - logit).abs() <= 1e-6 * logit.abs()).all()


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_an_encoder_padded_at_the_start_conserves_on_both_samples(preset: str):
    """BERT masks keys only: every query, a padded one too, sees the real tokens, and the classifier reads the first
    position (a padded one here). The unpadded sample is explained as alone; under CP-LRP both conserve."""
    model = ZOO["bert"].build("sdpa")
    if preset == "cplrp":
        zero_additive(model)
    x, lrp = model_input(ZOO["bert"]), explainer(model, preset)
    td = lrp(padded_batch(x))
    relevance = td["relevance", "x"]
    assert torch.isfinite(relevance).all()
    assert relative_error(relevance[1], alone(lrp, x[1])) <= 1e-6
    if preset == "cplrp":
        logit = td["y"].max(-1).values
        assert ((relevance.flatten(1).sum(1) - logit).abs() <= 1e-6 * logit.abs()).all()


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_an_eager_softmax_that_makes_the_mask_minus_infinity_is_refused_naming_the_module(name: str, preset: str):
    """transformers' eager attention computes a float64 model's softmax in float32: the mask's lowest float64 value
    becomes -inf there, so a query the mask leaves no key (a left-padded position) gets NaN weights, and the model's
    own output is NaN for that sample. The relevance was NaN; the call is refused, naming the attention module and
    how to switch (float32 or sdpa). Unpadded, the model is explained."""
    model = ZOO[name].build("eager")
    x, lrp = model_input(ZOO[name]), explainer(model, preset)
    with torch.no_grad():
        batch = padded_batch(x)
        assert Masked(model)(x, batch["mask"], batch["positions"])[0].isnan().all()  # the model's own output
    assert torch.isfinite(lrp(padded_batch(x, padded=0))["relevance", "x"]).all()  # unpadded
    with lrp:
        for _ in range(2):  # the first call of a context, and the next one (which records again)
            with pytest.raises(FloatingPointError, match=r"softmax over float64 scores in float32.*sdpa") as caught:
                lrp(padded_batch(x))
            assert any("'module.model.model.layers.0.self_attn'" in note for note in caught.value.__notes__)
