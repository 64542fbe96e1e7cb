"""Integer or boolean inputs that reach a layer through masks: logical operations on masks of a key, constants put over
an activation where a key says (``masked_fill``, ``torch.where``), a key's non-zero positions used as indices, and a
key's values chosen beside an activation. A CartPole-like critic ``Q(obs, action)``, in float64, without biases."""

import re
import warnings

import pytest
import torch
from tensordict import TensorDict
from torch import nn
from torchrl.modules import MLP, ValueOperator

from tdhook.attribution import LRP, BaseRuleMapper
from tdhook.attribution._numeric_inputs import NumericInputs

F64 = torch.float64


class MaskedCritic(nn.Module):
    """Q(s, a) of the observation (padded with a fifth feature, doubled: an activation) where the action index, a
    mask of it or its non-zero positions say what the layer takes, the way ``how`` says."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        torch.manual_seed(1)
        self.net = MLP(in_features=5, out_features=1, num_cells=[8], activation_class=nn.ReLU).to(F64)
        with torch.no_grad():
            for name, parameter in self.net.named_parameters():
                if name.endswith("bias"):
                    parameter.zero_()

    def forward(self, observation: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        n, how = observation.shape[0], self.how
        h = torch.cat([observation, observation.new_zeros(n, 1)], -1) * 2.0
        last = torch.arange(5) == 4  # a constant mask: the fifth feature
        chosen = action[:, None] == 1
        if how == "masked_fill_(last & a == 1)":
            h = h.masked_fill_(last & chosen, 1.0)
        elif how == "masked_fill(last & (a == 1 | a == 2))":
            h = h.masked_fill(last & (chosen | (action[:, None] == 2)), 1.0)
        elif how == "masked_fill(last & ~(a == 0 ^ ~last))":
            h = h.masked_fill(last & ~((action[:, None] == 0) ^ ~last), 1.0)
        elif how == "masked_fill(a.bool() & last)":
            h = h.masked_fill(action.bool()[:, None] & last, 1.0)
        elif how == "logical_and":
            h = h.masked_fill(torch.logical_and(last, chosen), 1.0)
        elif how == "a view's masked_fill_":
            h[:, 4:].masked_fill_(chosen, 1.0)
        elif how == "h.masked_fill(a.bool())":
            h = h.masked_fill(action[:, None].bool(), 1.0)
        elif how == "where(a == 1, 1, h)":
            h = torch.where(chosen, 1.0, h)
        elif how == "h.index_fill_(a.nonzero())":
            h.index_fill_(1, action[:5].nonzero()[:, 0], 1.0)
        elif how == "h[where(a)] = 1":
            h[torch.where(action == 1)[0], 4] = 1.0
        elif how == "where(last, a, h)":
            h = torch.where(last, action[:, None].to(F64), h)
        elif how == "h.masked_fill(a == 1, 0)":  # a gate: the activation zeroed where the key says
            h = h.masked_fill(chosen, 0.0)
        elif how == "where(a == 1, h, 2h)":  # activations chosen between: a gate
            h = torch.where(chosen & last, h, 2.0 * h)
        elif how == "h[:, a.nonzero()]":  # an index into activations
            h = h[:, action[:5].nonzero()[:, 0]].sum(-1, keepdim=True).expand(n, 5)
        elif how == "scores masked by a & causal":  # an attention mask as Hugging Face builds it
            causal = torch.ones(5, 5, dtype=torch.bool).tril()
            keys = h.unsqueeze(-1)
            scores = (keys @ keys.transpose(-1, -2)).masked_fill(~(causal & chosen[:, :, None]), torch.finfo(F64).min)
            h = (torch.softmax(scores, -1) @ keys).squeeze(-1)
        elif how == "where(a & causal, 0, min) + scores":
            causal = torch.ones(5, 5, dtype=torch.bool).tril()
            keys = h.unsqueeze(-1)
            additive = torch.where(causal & chosen[:, :, None], torch.tensor(0.0, dtype=F64), torch.finfo(F64).min)
            h = (torch.softmax(keys @ keys.transpose(-1, -2) + additive, -1) @ keys).squeeze(-1)
        return self.net(h)


def _explained(how: str, action: torch.Tensor) -> tuple[TensorDict, list[str]]:
    observation = torch.randn(8, 4, dtype=F64, generator=torch.Generator().manual_seed(0))
    td = TensorDict(observation=observation, action=action, batch_size=[8])
    module = ValueOperator(MaskedCritic(how), in_keys=["observation", "action"])
    with warnings.catch_warnings(record=True) as found:
        warnings.simplefilter("always")
        out = LRP(module, BaseRuleMapper(stabilizer=0))(td)
    return out, [str(w.message) for w in found if "enters the model as numbers" in str(w.message)]


def _lost(out: TensorDict) -> float:
    """The share of the value missing from the observation's relevance (relative L2): LRP-0 without biases
    conserves it whole where nothing but the observation holds one."""
    value = out["state_action_value"][:, 0]
    return ((value - out["relevance", "observation"].sum(-1)).norm() / value.norm()).item()


ACTION = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])
LOGICAL = "a comparison"  # the first encoding the key took: its comparison, before the logical operation
NAMED = {
    "masked_fill_(last & a == 1)": LOGICAL,
    "masked_fill(last & (a == 1 | a == 2))": LOGICAL,
    "masked_fill(last & ~(a == 0 ^ ~last))": LOGICAL,
    "masked_fill(a.bool() & last)": "a logical or bitwise operation",
    "logical_and": LOGICAL,
    "a view's masked_fill_": LOGICAL,
    "h.masked_fill(a.bool())": "masked_fill",
    "where(a == 1, 1, h)": LOGICAL,
    "h.index_fill_(a.nonzero())": r"the positions of its non-zero values \(nonzero\)",
    "h[where(a)] = 1": LOGICAL,
    "where(last, a, h)": None,
}


@pytest.mark.parametrize("how", NAMED)
def test_a_key_reaching_a_layer_through_masks_positions_or_a_choice_beside_an_activation_is_named(how):
    """A mask of the key combined by ``&``, ``|``, ``^``, ``~`` or ``logical_and``, ones put over an activation where
    the key says (``masked_fill``, ``torch.where``, a view's ``masked_fill_``), its non-zero positions used as an
    index (``nonzero``, ``torch.where(a)``), or its values chosen beside an activation by a constant mask lost the
    key's share with no word (0.30-0.55 of the value, relative L2). Named, with the encoding it took; where the key
    puts nothing there (every action 0), nothing is lost: the share is the key's."""
    out, numeric = _explained(how, ACTION)
    assert len(numeric) == 1 and "'action' (torch.int64)" in numeric[0], numeric
    assert "'module.net.0' (Linear)" in numeric[0], numeric
    encoding = NAMED[how]
    if encoding is None:
        assert "converted to floating point" in numeric[0], numeric
    else:
        assert re.search(f"encoded by {encoding}, ", numeric[0]), numeric
    assert _lost(out) > 0.1  # the action's share, which the warning is about
    if how != "where(last, a, h)":  # a zero action writes nothing: the observation's relevance sums to the value
        out, _ = _explained(how, torch.zeros_like(ACTION))
        assert _lost(out) < 1e-10


@pytest.mark.parametrize(
    "how",
    [
        "h.masked_fill(a == 1, 0)",
        "where(a == 1, h, 2h)",
        "h[:, a.nonzero()]",
        "scores masked by a & causal",
        "where(a & causal, 0, min) + scores",
    ],
)
def test_gates_indices_and_attention_masks_built_from_a_key_are_not_named(how):
    """An activation zeroed, chosen between activations or read at the key's non-zero positions, and an attention
    mask built from the key with ``&`` and ``~`` (put over the scores with the dtype's minimum, or added), which the
    softmax ends, hold none of the key's share: not named."""
    out, numeric = _explained(how, ACTION)
    assert not numeric, numeric
    if "scores" not in how:  # LRP-0 of linear maps, ReLU, gates and picks without biases: nothing is lost
        assert _lost(out) < 1e-10


def test_a_flag_choosing_between_a_key_and_a_constant_is_named_with_the_key():
    """``torch.where(done, a.float(), 1.0)`` named the action only: the ones the flag chooses hold its share, which no
    input receives (a Linear without bias takes them). Both are named, the flag as encoded by ``where``."""
    layer = nn.Linear(2, 1, bias=False).to(F64)
    action, done = torch.tensor([[0, 1], [1, 1]]), torch.tensor([[True, False], [False, True]])
    with NumericInputs({0: action, 1: done}, {"layer": layer}) as watch:
        layer(torch.where(done, action.to(F64), 1.0))
    assert watch.found == {0: "module 'layer' (Linear)", 1: "module 'layer' (Linear)"}
    assert watch.encodings == {1: "where"}
    with NumericInputs({0: action, 1: done}, {"layer": layer}) as watch:
        layer(torch.where(done, action.to(F64), 0.0))  # zeros chosen: the flag holds no share
    assert watch.found == {0: "module 'layer' (Linear)"} and not watch.encodings
