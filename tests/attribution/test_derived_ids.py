"""A lookup of ids that the model computes from an explained mask (positions counted from an attention mask given
among the explained keys) is refused saying so."""

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import LRP, EpsilonPlus

transformers = pytest.importorskip("transformers")


class CountedPositions(nn.Module):
    """A Hugging Face model given the positions of a left-padded batch, counted from its attention mask."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions)
        return out.last_hidden_state[:, -1, :1]


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(
            n_layer=1, n_head=2, n_embd=8, n_positions=16, vocab_size=16, bos_token_id=1, eos_token_id=1
        )
        return transformers.GPT2Model(config).eval()
    config = transformers.BertConfig(
        num_hidden_layers=1, num_attention_heads=2, hidden_size=8, intermediate_size=16, vocab_size=16
    )
    return transformers.BertModel(config).eval()


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_positions_counted_from_an_explained_mask_are_refused_saying_so(name):
    """GPT-2 and BERT given ``position_ids = (mask.cumsum(-1) - 1).clamp(min=0)`` with the mask explained were
    refused as ids "sliced, shifted or copied" from it, the wording of an encoder-decoder's shifted decoder input:
    right to refuse (the position lookup's share would reach no input), but not saying what. The message says the
    key is a mask, that ids computed from it are not supported, and what to do."""
    ids = torch.randint(2, 16, (2, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    td = TensorDict(input_ids=ids, attention_mask=mask, batch_size=[2])
    module = TensorDictModule(CountedPositions(_model(name)), in_keys=["input_ids", "attention_mask"], out_keys=["y"])
    lrp = LRP(module, EpsilonPlus(), in_keys=["input_ids", "attention_mask"])
    with pytest.raises(ValueError) as raised:
        lrp(td)
    message = str(raised.value)
    assert "input key 'attention_mask' reaches 'module.model." in message
    assert "'attention_mask' holds only zeros and ones, as a mask does" in message
    assert "ids computed from it are not supported" in message and "(mask.cumsum(-1) - 1)" in message
    assert "where 'attention_mask' is a mask, leave it out of in_keys" in message
    assert "sliced, shifted or copied" not in message


class BinaryChoiceCritic(nn.Module):
    """Q(s, a) of a CartPole-like observation and an action of two values (0 or 1), whose row of a table is looked up
    at ``a % 2``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Embedding(2, 4, dtype=torch.float64)
        self.head = nn.Linear(4, 1, bias=False, dtype=torch.float64)

    def forward(self, observation: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(observation + self.table(action % 2)))


def _refusal_of_an_action_looked_up_at_a_remainder(action: torch.Tensor) -> str:
    observation = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    td = TensorDict(observation=observation, action=action, batch_size=[6])
    module = TensorDictModule(BinaryChoiceCritic(), in_keys=["observation", "action"], out_keys=["value"])
    with pytest.raises(ValueError) as raised:
        LRP(module, EpsilonPlus())(td)
    message = str(raised.value)
    assert "input key 'action' reaches 'module.table' (Embedding)" in message
    return message


def test_ids_computed_from_a_binary_action_are_refused_without_calling_it_a_mask():
    """A CartPole action holds only zeros and ones, as a mask does: its lookup at ``a % 2`` was refused saying the
    action is "(a mask)", that the ids were "positions counted from a mask", and to leave it out of in_keys since "a
    mask holds no share of the relevance", all wrong of an action. The values cannot tell the two apart: the message
    says that zeros and ones may be either, names arithmetic on the key, and gives the advice for a mask as such."""
    message = _refusal_of_an_action_looked_up_at_a_remainder(torch.tensor([0, 1, 1, 0, 1, 0]))
    assert "'action' holds only zeros and ones, as a mask does (or a binary choice" in message
    assert "arithmetic on it (a % n)" in message and "where 'action' is a mask, leave it out" in message
    assert "(a mask)" not in message and "the model computed those ids from it (positions" not in message


def test_ids_computed_by_arithmetic_on_an_action_are_refused_saying_so():
    """An action of four values looked up at ``a % 2`` was refused only as ids "sliced, shifted or copied, as an
    encoder-decoder makes its decoder's input": the message names arithmetic on the key too."""
    message = _refusal_of_an_action_looked_up_at_a_remainder(torch.tensor([0, 1, 3, 2, 1, 0]))
    assert "computed by arithmetic on it, as a % n" in message and "zeros and ones" not in message
