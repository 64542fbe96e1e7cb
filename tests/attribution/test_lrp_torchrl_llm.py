"""Token ids read back from a lazy stack as a padded tensor, as torchrl's LLM wrappers read them.

``TransformersWrapper`` (``torchrl.modules.llm``) turns the TensorDict it is given into a lazy stack and reads the
token ids with ``td.get(key, as_padded_tensor=True)``: a ``pad_sequence`` of the ids' slices. Ids of one length
need no padding, and that read is the ids themselves; the lookup of it was refused ("none did" read the ids). The
oracle is the same model written as a plain module reading the ids as given: the relevance is the same. A padded
read of slices of other lengths (ids shifted by the padding) stays refused.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule, TensorDictModuleBase
from tokenizers import Tokenizer, models
from torch import nn
from torchrl.modules.llm import TransformersWrapper

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.rules import CPLRP, AttnLRP
from tdhook.attribution.mappers.base import BaseRuleMapper
from tdhook.attribution.rules.basic import EpsilonRule

F64 = torch.float64
PAD = 60


class PaddedRead(TensorDictModuleBase):
    """A policy that reads its token ids back from a lazy stack as a padded tensor (torchrl's LLM wrappers' read)."""

    def __init__(self, padding_side: str = "left", ragged: bool = False) -> None:
        super().__init__()
        self.in_keys, self.out_keys = ["token"], ["q"]
        self.embedding, self.head = nn.Embedding(PAD + 1, 4), nn.Linear(4, 3)
        self.padding_side, self.ragged = padding_side, ragged

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        if self.ragged:  # the second sample's ids shortened by one: the padding shifts them
            ids = td.get("token")
            read = nn.utils.rnn.pad_sequence([ids[0], ids[1, 1:]], True, PAD, self.padding_side)
        else:
            stack = td if isinstance(td, LazyStackedTensorDict) else td.to_lazystack(0)
            read = stack.get("token", as_padded_tensor=True, padding_side=self.padding_side, padding_value=PAD)
        td.set("q", self.head(self.embedding(read)).sum(-2))
        return td


@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize("mapper", [BaseRuleMapper, lambda: BaseRuleMapper(rule_mapper={nn.Linear: EpsilonRule(0.1)})])
def test_ids_read_back_as_a_padded_tensor_get_the_relevance_of_the_ids_read_as_given(padding_side, mapper):
    torch.manual_seed(0)
    policy = PaddedRead(padding_side).double()
    plain = TensorDictModule(nn.Sequential(policy.embedding, policy.head), in_keys=["token"], out_keys=["q"])
    td = TensorDict(token=torch.randint(0, PAD, (2, 5)), batch_size=[2])
    expected = LRP(plain, mapper(), target=1)(td.clone())
    out = LRP(policy, mapper(), target=1)(td.clone())
    torch.testing.assert_close(out["q"], expected["q"].sum(-2))
    expected_relevance = expected["relevance", "token"]
    torch.testing.assert_close(out["relevance", "token"].sum(-1), expected_relevance.sum(-1), rtol=1e-12, atol=1e-14)
    # Each token's own share: the padded read is the ids in their places (a shifted read would move the shares).
    per_token = LRP(TensorDictModule(_SummedHead(policy), in_keys=["token"], out_keys=["q"]), mapper(), target=1)
    torch.testing.assert_close(
        out["relevance", "token"], per_token(td.clone())["relevance", "token"], rtol=1e-12, atol=1e-14
    )


class _SummedHead(nn.Module):
    def __init__(self, policy: PaddedRead) -> None:
        super().__init__()
        self.embedding, self.head = policy.embedding, policy.head

    def forward(self, token: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(token)).sum(-2)


def test_ids_padded_to_one_length_from_slices_of_other_lengths_are_still_refused():
    policy = PaddedRead(ragged=True).double()
    with pytest.raises(ValueError, match="through token ids computed from it"):
        LRP(policy, target=0)(TensorDict(token=torch.randint(0, PAD, (2, 5)), batch_size=[2]))


def _tiny_causal_lm() -> tuple[nn.Module, transformers.PreTrainedTokenizerFast]:
    vocab = {f"w{i}": i for i in range(PAD)} | {"<pad>": PAD, "<eos>": PAD + 1}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="w0")), pad_token="<pad>", eos_token="<eos>"
    )
    config = transformers.LlamaConfig(
        vocab_size=PAD + 2,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=PAD,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(F64).eval(), tokenizer


class TokenLogProbs(nn.Module):
    """What ``TransformersWrapper`` computes from the ids, written plainly: each token's log-probability given the
    tokens before it, 0 for the first."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.model(tokens, torch.ones_like(tokens)).logits[:, :-1]
        taken = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
        return torch.cat([torch.zeros_like(taken[:, :1]), taken], 1)


@pytest.mark.parametrize("mapper", [AttnLRP, CPLRP])
def test_a_torchrl_llm_policy_explains_its_log_probs_as_the_model_written_plainly(mapper):
    """The log-probabilities of the sequence under ``TransformersWrapper`` (token input, no generation), explained
    on the token ids: the relevance of the same computation written as a plain module. The log-softmax that makes
    them has no rule, and the warning says so."""
    model, tokenizer = _tiny_causal_lm()
    policy = TransformersWrapper(
        model, tokenizer=tokenizer, input_mode="tokens", generate=False, return_log_probs=True, pad_output=True
    )
    tokens = torch.randint(0, PAD, (2, 6), generator=torch.Generator().manual_seed(1))
    td = TensorDict({("tokens", "full"): tokens}, batch_size=[2])
    key = ("log_probs", "full")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = LRP(policy, mapper(), in_keys=[("tokens", "full")], target_key=key, target=lambda y: y)(td.clone())
    assert any("cross_entropy" in str(w.message) for w in caught)
    plain = TensorDictModule(TokenLogProbs(model), in_keys=["tokens"], out_keys=["log_probs"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = LRP(plain, mapper(), target=lambda y: y)(TensorDict(tokens=tokens, batch_size=[2]))
    torch.testing.assert_close(out.get(key), expected["log_probs"], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        out.get(("relevance", "tokens", "full")), expected["relevance", "tokens"], rtol=1e-8, atol=1e-10
    )
    assert torch.equal(td.get(("tokens", "full")), tokens)
