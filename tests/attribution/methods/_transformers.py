"""Tiny random Hugging Face models (hidden size 32, two layers, no download) wrapped as a user wraps them.

Each wrapper is a ``TensorDictModule`` reading the explained embeddings (or pixels) and the keys that steer the
model (an attention mask with real padding, token types, position ids), as in :mod:`tests.attribution.
test_lrp_transformer_zoo`.
"""

from __future__ import annotations

import torch
import transformers
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tests.attribution.test_lrp_transformer_zoo import COMMON, HIDDEN

F64 = torch.float64
BATCH, TOKENS = 3, 6
IMAGE = 8


class Classifier(nn.Module):
    """A BERT sequence classifier fed ``inputs_embeds``, its attention mask and token types: 3 logits."""

    def __init__(self, implementation: str) -> None:
        super().__init__()
        shared = {key: value for key, value in COMMON.items() if key not in ("num_key_value_heads", "head_dim")}
        config = transformers.BertConfig(**shared, num_labels=3)
        config._attn_implementation = implementation
        torch.manual_seed(0)
        self.model = transformers.BertForSequenceClassification(config).eval().double()

    def forward(self, embeds: torch.Tensor, mask: torch.Tensor, token_types: torch.Tensor) -> torch.Tensor:
        return self.model(inputs_embeds=embeds, attention_mask=mask, token_type_ids=token_types).logits


class NextToken(nn.Module):
    """A Llama causal LM fed ``inputs_embeds``, its attention mask and position ids: the last position's logits."""

    def __init__(self, implementation: str, **values: object) -> None:
        super().__init__()
        config = transformers.LlamaConfig(**{**COMMON, **values})
        config._attn_implementation = implementation
        torch.manual_seed(0)
        self.model = transformers.LlamaForCausalLM(config).eval()

    def forward(self, embeds: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions).logits[:, -1]


def classifier(implementation: str = "sdpa") -> TensorDictModule:
    return TensorDictModule(Classifier(implementation), in_keys=["embeds", "mask", "token_types"], out_keys=["logits"])


def classifier_td() -> TensorDict:
    """Three sequences of 6 tokens, the second and third right-padded (2 and 4 padding tokens), two segments."""
    generator = torch.Generator().manual_seed(1)
    mask = torch.ones(BATCH, TOKENS, dtype=torch.long)
    mask[1, 4:] = 0
    mask[2, 2:] = 0
    token_types = torch.zeros(BATCH, TOKENS, dtype=torch.long)
    token_types[:, 3:] = 1
    embeds = torch.randn(BATCH, TOKENS, HIDDEN, dtype=F64, generator=generator)
    return TensorDict(embeds=embeds, mask=mask, token_types=token_types, batch_size=[BATCH])


def next_token(implementation: str = "sdpa", **values: object) -> TensorDictModule:
    keys = ["embeds", "mask", "positions"]
    return TensorDictModule(NextToken(implementation, **values), in_keys=keys, out_keys=["y"])


def next_token_td(dtype: torch.dtype = torch.float32) -> TensorDict:
    """Three sequences of 6 tokens, the second and third left-padded (2 and 4 padding tokens), with the position ids
    that skip the padding."""
    generator = torch.Generator().manual_seed(1)
    mask = torch.ones(BATCH, TOKENS, dtype=torch.long)
    mask[1, :2] = 0
    mask[2, :4] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    embeds = torch.randn(BATCH, TOKENS, HIDDEN, dtype=dtype, generator=generator)
    return TensorDict(embeds=embeds, mask=mask, positions=positions, batch_size=[BATCH])


class Similarity(nn.Module):
    """The similarities of every image of ``a`` with every image of ``b`` under a CLIP vision tower: ``[B, B]``, a
    model that scores the samples of its batch against each other (as CLIP's ``logits_per_image`` does)."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.CLIPVisionConfig(
            hidden_size=HIDDEN,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            image_size=IMAGE,
            patch_size=4,
            projection_dim=16,
        )
        torch.manual_seed(0)
        self.tower = transformers.CLIPVisionModelWithProjection(config).eval().double()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.tower(pixel_values=a).image_embeds @ self.tower(pixel_values=b).image_embeds.T


def similarity() -> TensorDictModule:
    return TensorDictModule(Similarity(), in_keys=["a", "b"], out_keys=["similarity"])


def image_pairs() -> TensorDict:
    generator = torch.Generator().manual_seed(1)
    a, b = (torch.randn(BATCH, 3, IMAGE, IMAGE, dtype=F64, generator=generator) for _ in range(2))
    return TensorDict(a=a, b=b, batch_size=[BATCH])
