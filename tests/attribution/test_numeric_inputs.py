"""Integer or boolean inputs the model computes with as numbers: a torchrl critic's one-hot action, on a rollout."""

import re
import warnings

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule, TensorDictSequential
from torch import nn
from torchrl.envs import GymEnv
from torchrl.modules import MLP, MaskedCategorical, ProbabilisticActor, QValueActor, ValueOperator

from tdhook.attribution import LRP, BaseRuleMapper, EpsilonPlus

F64 = torch.float64


@pytest.fixture(scope="module")
def rollout() -> TensorDict:
    env = GymEnv("CartPole-v1")
    env.set_seed(0)
    torch.manual_seed(0)
    td = env.rollout(6).select("observation", "action")
    assert td["action"].dtype == torch.int64  # torchrl's one-hot action
    return td.set("observation", td["observation"].to(F64))


class Critic(nn.Module):
    """Q(s, a) of a one-hot action, given to its layers as numbers."""

    def __init__(self, as_bool: bool = False) -> None:
        super().__init__()
        self.as_bool = as_bool
        self.net = MLP(in_features=6, out_features=1, num_cells=[8], activation_class=nn.ReLU).to(F64)
        with torch.no_grad():
            for name, parameter in self.net.named_parameters():
                if name.endswith("bias"):
                    parameter.zero_()

    def forward(self, observation: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        action = action.bool() if self.as_bool else action
        return self.net(torch.cat([observation, action.to(observation.dtype)], -1))


def critic(as_bool: bool = False) -> ValueOperator:
    torch.manual_seed(1)
    return ValueOperator(Critic(as_bool), in_keys=["observation", "action"])


def caught(call) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as found:
        warnings.simplefilter("always")
        result = call()
    return result, [str(w.message) for w in found]


def test_an_integer_action_computed_with_as_numbers_is_named_and_explained_once_stored_as_floats(rollout):
    lrp = LRP(critic(), BaseRuleMapper(stabilizer=0))
    out, messages = caught(lambda: lrp(rollout.clone()))
    numeric = [m for m in messages if "enters the model as numbers" in m]
    assert len(numeric) == 1, messages
    assert "'action' (torch.int64)" in numeric[0] and "'module.net.0' (Linear)" in numeric[0]
    assert ("relevance", "action") not in out.keys(True)
    value = out["state_action_value"][:, 0]
    missing = value - out["relevance", "observation"].sum(-1)
    assert missing.abs().max() > 1e-3  # the action's share, which the warning is about
    _, later = caught(lambda: lrp(rollout.clone()))  # the first call's watch only
    assert not [m for m in later if "enters the model as numbers" in m]
    # What the warning advises: stored as floats, the action is explained, and LRP-0 without biases conserves.
    floats = rollout.clone().set("action", rollout["action"].to(F64))
    out, messages = caught(lambda: LRP(critic(), BaseRuleMapper(stabilizer=0))(floats))
    assert not [m for m in messages if "enters the model as numbers" in m]
    total = out["relevance", "observation"].sum(-1) + out["relevance", "action"].sum(-1)
    torch.testing.assert_close(total, out["state_action_value"][:, 0], rtol=1e-10, atol=1e-12)


def test_a_boolean_action_computed_with_as_numbers_is_named(rollout):
    td = rollout.clone().set("action", rollout["action"].bool())
    _, messages = caught(lambda: LRP(critic(as_bool=True), BaseRuleMapper(stabilizer=0))(td))
    assert [m for m in messages if "'action' (torch.bool) enters the model as numbers" in m], messages


def test_an_integer_action_named_in_in_keys_is_refused_saying_how_to_explain_it(rollout):
    lrp = LRP(critic(), BaseRuleMapper(stabilizer=0), in_keys=["observation", "action"])
    with pytest.raises(TypeError, match=r"'action' \(torch.int64\) enters the model as numbers.*\.float\(\)"):
        lrp(rollout.clone())


def test_a_strict_mapper_refuses_an_integer_action_left_out(rollout):
    with pytest.raises(ValueError, match=r"'action' \(torch.int64\) enters the model as numbers"):
        LRP(critic(), BaseRuleMapper(stabilizer=0, strict=True))(rollout.clone())


class IndexedCritic(nn.Module):
    """Q(s, a) picked by the action's index, and zeroed where the episode is done: indices and masks, no numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP(in_features=4, out_features=2, num_cells=[8], activation_class=nn.ReLU).to(F64)

    def forward(self, observation: torch.Tensor, action: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        values = self.net(observation).gather(-1, action.argmax(-1, keepdim=True))
        return values * (1 - done.to(values.dtype))


def test_indices_and_masks_are_not_numbers(rollout):
    td = rollout.clone().set("done", torch.zeros(6, 1, dtype=torch.bool))
    module = ValueOperator(IndexedCritic(), in_keys=["observation", "action", "done"])
    _, messages = caught(lambda: LRP(module, EpsilonPlus())(td))
    assert not [m for m in messages if "enters the model as numbers" in m]
    torch.manual_seed(0)
    net = ValueOperator(MLP(in_features=4, out_features=2, num_cells=[8]).to(F64), out_keys=["logits"])
    actor = ProbabilisticActor(
        net, in_keys={"logits": "logits", "mask": "action_mask"}, distribution_class=MaskedCategorical
    )
    td = rollout.clone().set("action_mask", torch.tensor([[True, False]]).expand(6, 2).clone())
    _, messages = caught(lambda: LRP(actor, EpsilonPlus())(td))
    assert not [m for m in messages if "enters the model as numbers" in m]


@pytest.fixture(scope="module")
def categorical() -> TensorDict:
    env = GymEnv("CartPole-v1", categorical_action_encoding=True)
    env.set_seed(0)
    torch.manual_seed(0)
    td = env.rollout(8).select("observation", "action")
    assert td["action"].dtype == torch.int64 and td["action"].shape == (8,)  # an index, as a Categorical spec gives
    return td.set("observation", td["observation"].to(F64))


def _encoded(how: str, action: torch.Tensor, observation: torch.Tensor) -> torch.Tensor:
    """The two-action index ``action`` given to a layer as numbers, the way ``how`` says."""
    if how == "one_hot.float":
        return torch.nn.functional.one_hot(action, 2).float().to(F64)
    if how == "one_hot.to":
        return torch.nn.functional.one_hot(action, 2).to(observation.dtype)
    if how == "one_hot.type_as":
        return torch.nn.functional.one_hot(action, 2).type_as(observation)
    if how == "scatter_":
        return torch.zeros(*action.shape, 2, dtype=F64).scatter_(-1, action.unsqueeze(-1), 1.0)
    if how == "eye":
        return torch.eye(2, dtype=F64)[action]
    if how == "2a-1":
        return (2 * action.to(observation.dtype) - 1).unsqueeze(-1).expand(*action.shape, 2)
    if how == "a/n":
        return (action.to(observation.dtype) / 2).unsqueeze(-1).expand(*action.shape, 2)
    if how == "obs+a":  # added to an activation, the sum keeps the action's values
        return observation[..., :2] + action.to(observation.dtype).unsqueeze(-1)
    if how == "where":
        return torch.where(action == 1, 1.0, -1.0).to(F64).unsqueeze(-1).expand(*action.shape, 2)
    if how == "masked_fill":
        return torch.zeros(*action.shape, 2, dtype=F64).masked_fill((action == 1).unsqueeze(-1), 1.0)
    assert how == "(a==1)*w"
    return (action == 1).to(observation.dtype).unsqueeze(-1) * torch.tensor([0.5, 2.0], dtype=F64)


class EncodedCritic(Critic):
    """Q(s, a) of an action index encoded in the model (one-hot, or arithmetic on it); no biases: LRP-0 conserves."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, observation: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        if action.dim() == observation.dim():  # already encoded, as the advice says
            return self.net(torch.cat([observation, action], -1))
        return self.net(torch.cat([observation, _encoded(self.how, action, observation)], -1))


def _lost(out: TensorDict) -> float:
    value = out["state_action_value"][:, 0]
    return ((value - out["relevance", "observation"].sum(-1)).norm() / value.norm()).item()


ENCODINGS = {"one_hot.float": "one_hot", "one_hot.to": "one_hot", "one_hot.type_as": "one_hot"}
ENCODINGS |= {"scatter_": r"a constant table written at its values \(scatter_\)"}
ENCODINGS |= {"eye": r"a constant table read at its values \(indexing\)", "(a==1)*w": "a comparison"}
ENCODINGS |= {"where": "a comparison", "masked_fill": "a comparison"}


@pytest.mark.parametrize("how", [*ENCODINGS, "2a-1", "a/n", "obs+a"])
def test_an_action_index_encoded_or_computed_with_in_the_model_is_named(categorical, how):
    """Its share was lost with no word (0.83-1.61 of the value, relative L2, on this critic): named, with the remedy
    that explains it (encoded before the model as floats, or stored as floats where arithmetic alone reads it)."""
    torch.manual_seed(1)
    module = ValueOperator(EncodedCritic(how), in_keys=["observation", "action"])
    out, messages = caught(lambda: LRP(module, BaseRuleMapper(stabilizer=0))(categorical.clone()))
    numeric = [m for m in messages if "enters the model as numbers" in m]
    assert len(numeric) == 1, messages
    assert "'action' (torch.int64)" in numeric[0] and "'module.net.0' (Linear)" in numeric[0]
    assert _lost(out) > 0.5  # the action's share, which the warning is about
    encoding = ENCODINGS.get(how)
    if encoding is not None:
        assert re.search(f"encoded by {encoding}, ", numeric[0]) and "F.one_hot(td['action'], n).float()" in numeric[0]
        given = _encoded(how, categorical["action"], categorical["observation"])  # as the advice says
    else:
        assert "converted to floating point" in numeric[0] and "td['action'].float()" in numeric[0]
        given = categorical["action"].to(F64)
    with pytest.raises(TypeError, match="'action' .* enters the model as numbers"):
        LRP(module, BaseRuleMapper(stabilizer=0), in_keys=["observation", "action"])(categorical.clone())
    out, messages = caught(lambda: LRP(module, BaseRuleMapper(stabilizer=0))(categorical.clone().set("action", given)))
    assert not [m for m in messages if "enters the model as numbers" in m]
    if encoding is not None:
        total = out["relevance", "observation"].sum(-1) + out["relevance", "action"].sum(-1)
        torch.testing.assert_close(total, out["state_action_value"][:, 0], rtol=1e-10, atol=1e-12)


class GatedCritic(nn.Module):
    """Integers that reach layers only as gates of activations, additive masks of softmax logits, or indices into
    activations: every relevance goes to the activations, so nothing of theirs is lost."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.encoder = nn.Linear(4, 6, bias=False).to(F64)
        self.head = nn.Linear(6, 1, bias=False).to(F64)

    def forward(self, observation: torch.Tensor, action: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.encoder(observation))
        if self.how == "done gate":  # a recurrent policy's reset: the hidden state zeroed where an episode ended
            hidden = hidden * (1 - done.to(hidden.dtype))
        elif self.how == "q of the action":  # a DQN's Q(s, a): the action's one-hot picks a value
            hidden = hidden * torch.nn.functional.one_hot(action, 6).to(hidden.dtype)
        elif self.how == "gathered":
            hidden = hidden.gather(-1, action.unsqueeze(-1)).expand(-1, 6)
        elif self.how == "attention mask":  # keys masked additively, as Hugging Face models do
            keys = hidden.unsqueeze(-1)  # (batch, 6 positions, 1 feature)
            mask = torch.nn.functional.one_hot(action, 6).to(hidden.dtype)
            scores = keys @ keys.transpose(-1, -2) + (1.0 - mask[:, None, :]) * -1e9
            hidden = (torch.softmax(scores, -1) @ keys).squeeze(-1)
        elif self.how == "masked scores":  # keys masked by selection
            keys = hidden.unsqueeze(-1)
            scores = (keys @ keys.transpose(-1, -2)).masked_fill(action[:, None, None] == 0, -1e9)
            scores = torch.where(done[:, :, None], -1e9, scores)
            hidden = (torch.softmax(scores, -1) @ keys).squeeze(-1)
        return self.head(hidden)


@pytest.mark.parametrize("how", ["done gate", "q of the action", "gathered", "attention mask", "masked scores"])
def test_gates_masks_and_indices_into_activations_are_not_numbers(categorical, how):
    td = categorical.clone().set("done", torch.tensor([False, True] * 4).unsqueeze(-1))
    module = ValueOperator(GatedCritic(how), in_keys=["observation", "action", "done"])
    out, messages = caught(lambda: LRP(module, BaseRuleMapper(stabilizer=0))(td))
    assert not [m for m in messages if "enters the model as numbers" in m], messages
    if "mask" not in how:  # LRP-0 of linear maps, ReLU, gates and picks without biases: nothing is lost
        assert _lost(out) < 1e-10


class ResetCritic(EncodedCritic):
    """Q(s, a) of a one-hot action joined to the observation, the join reset where an episode ended: ``done`` is a
    gate of the join (its activation takes the product's relevance whole), the action is what is lost."""

    def forward(self, observation: torch.Tensor, action: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        encoded = action if action.dim() == observation.dim() else _encoded("one_hot.to", action, observation)
        joined = torch.cat([observation, encoded], -1)
        keep = 1 - done.to(observation.dtype)
        if self.how == "keep * joined":
            joined = keep * joined
        elif self.how == "joined * keep":
            joined = joined * keep
        elif self.how == "joined.mul_(keep)":
            joined = joined.clone().mul_(keep)
        else:
            joined = keep.expand_as(joined).clone().mul_(joined)
        return self.net(joined)


@pytest.mark.parametrize("how", ["keep * joined", "joined * keep", "joined.mul_(keep)", "keep.mul_(joined)"])
def test_a_done_gate_of_a_join_holding_an_encoded_action_names_the_action_not_the_gate(categorical, how):
    """The gate first in the product was named as the key whose share is lost, and the action not at all (2.01 of
    the value missed, relative L2): the action is named; encoded before the model as the advice says, the
    relevance of the observation and the action sums to the value, the gate's share is nothing."""
    td = categorical.clone().set("done", (torch.arange(8) % 3 == 0).unsqueeze(-1))
    torch.manual_seed(1)
    module = ValueOperator(ResetCritic(how), in_keys=["observation", "action", "done"])
    out, messages = caught(lambda: LRP(module, BaseRuleMapper(stabilizer=0))(td.clone()))
    numeric = [m for m in messages if "enters the model as numbers" in m]
    assert len(numeric) == 1 and "'action' (torch.int64)" in numeric[0] and "encoded by one_hot" in numeric[0], numeric
    assert _lost(out) > 0.5  # the action's share, which the warning is about
    given = td.set("action", _encoded("one_hot.to", td["action"], td["observation"]))
    out, messages = caught(lambda: LRP(module, BaseRuleMapper(stabilizer=0))(given))
    assert not [m for m in messages if "enters the model as numbers" in m], messages
    total = out["relevance", "observation"].sum(-1) + out["relevance", "action"].sum(-1)
    torch.testing.assert_close(total, out["state_action_value"][:, 0], rtol=1e-10, atol=1e-12)


class PassedCritic(EncodedCritic):
    """Q(s, a) of a one-hot action added to part of the observation, through an activation, dropout or a norm
    before the layers."""

    def forward(self, observation: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        encoded = action if action.dim() == observation.dim() else _encoded("one_hot.to", action, observation)
        summed = observation[..., :2] + encoded
        if self.how == "relu":
            passed = nn.ReLU()(summed)
        elif self.how == "dropout":
            passed = nn.Dropout(0.5).eval()(summed)
        elif self.how == "tanh":
            passed = torch.tanh(summed)
        else:
            passed = torch.nn.functional.layer_norm(summed, (2,))
        return self.net(torch.cat([observation, passed], -1))


@pytest.mark.parametrize("how", ["relu", "dropout", "tanh", "layer_norm"])
def test_an_encoded_action_through_an_activation_dropout_or_a_norm_before_a_layer_is_named(categorical, how):
    """A sum of an encoded action and an activation lost the action's share with no word where an activation,
    dropout or a norm stood between it and the layer: named; under ReLU and dropout, the action encoded before the
    model as the advice says takes its share, and the relevance sums to the value."""
    torch.manual_seed(1)
    module = ValueOperator(PassedCritic(how), in_keys=["observation", "action"])
    out, messages = caught(lambda: LRP(module, BaseRuleMapper(stabilizer=0))(categorical.clone()))
    numeric = [m for m in messages if "enters the model as numbers" in m]
    assert len(numeric) == 1 and "'action' (torch.int64)" in numeric[0] and "encoded by one_hot" in numeric[0], numeric
    assert "'module.net.0' (Linear)" in numeric[0]
    assert _lost(out) > 0.1  # the action's share, which the warning is about
    given = categorical.clone().set("action", _encoded("one_hot.to", categorical["action"], categorical["observation"]))
    out, messages = caught(lambda: LRP(module, BaseRuleMapper(stabilizer=0))(given))
    assert not [m for m in messages if "enters the model as numbers" in m], messages
    if how in ("relu", "dropout"):  # positively homogeneous without biases: LRP-0 conserves
        total = out["relevance", "observation"].sum(-1) + out["relevance", "action"].sum(-1)
        torch.testing.assert_close(total, out["state_action_value"][:, 0], rtol=1e-10, atol=1e-12)


def test_an_embedded_action_is_explained_not_named(categorical):
    """An nn.Embedding is the way an index is explained: its output stands in for it."""

    class Embedded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = nn.Embedding(2, 2).to(F64)
            self.net = MLP(in_features=6, out_features=1, num_cells=[8]).to(F64)

        def forward(self, observation: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
            return self.net(torch.cat([observation, self.embedding(action)], -1))

    torch.manual_seed(1)
    module = ValueOperator(Embedded(), in_keys=["observation", "action"])
    out, messages = caught(lambda: LRP(module, EpsilonPlus())(categorical.clone()))
    assert not [m for m in messages if "enters the model as numbers" in m]
    assert ("relevance", "action") in out.keys(True)


class OneHot(nn.Module):
    def forward(self, action: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot(action, 2).to(F64)


def test_a_previous_action_one_hot_encoded_by_a_module_of_the_sequence_is_named(categorical):
    """A DQN given the one-hot previous action, encoded by a module of its own before torchrl's QValueActor."""
    td = categorical.clone().set("prev_action", torch.roll(categorical["action"], 1, 0))
    torch.manual_seed(1)
    net = MLP(in_features=6, out_features=2, num_cells=[8]).to(F64)
    actor = QValueActor(net, in_keys=["observation", "prev_onehot"], action_space="categorical")
    policy = TensorDictSequential(TensorDictModule(OneHot(), ["prev_action"], ["prev_onehot"]), actor)
    _, messages = caught(lambda: LRP(policy, EpsilonPlus())(td))
    numeric = [m for m in messages if "enters the model as numbers" in m]
    assert len(numeric) == 1 and "'prev_action' (torch.int64)" in numeric[0] and "encoded by one_hot" in numeric[0]


class KeyedCritic(Critic):
    """Q(s, a) of an action index (or of the done flag) the model encodes itself with parameters, sinusoids,
    repeats or a norm written out, added to part of the observation; no biases."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.w = nn.Parameter(torch.tensor([0.5, 2.0], dtype=F64))
        self.register_buffer("freqs", torch.tensor([0.3, 1.1], dtype=F64))
        self.register_buffer("state", torch.zeros(2, dtype=F64) if "zero" in how else torch.ones(2, dtype=F64))
        self.lazy: torch.Tensor | None = None  # a state made on the first call

    def encoding(self, action: torch.Tensor, done: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        signed = (2 * action.to(F64) - 1)[..., None]
        if self.how == "w.expand * (a == 1)":
            return self.w.expand(action.shape[0], 2) * (action == 1).to(F64).unsqueeze(-1)
        if self.how == "where(a == 1, w, -w)":
            return torch.where((action == 1).unsqueeze(-1), self.w, -self.w)
        if self.how == "sin(a * freqs)":
            return torch.sin(action.to(F64)[..., None] * self.freqs)
        if self.how == "expand_as":
            return signed.expand_as(hidden)
        if self.how == "repeat":
            return signed.repeat(1, 2)
        if self.how == "tile":
            return torch.tile(signed, (1, 2))
        if self.how == "clamp":
            return torch.clamp(signed, -0.5, 1.0).expand_as(hidden)
        if self.how == "log1p":
            return torch.log1p(action.to(F64))[..., None].expand_as(hidden)
        if self.how == "pad":
            return torch.nn.functional.pad(signed, (1, 0))
        if self.how == "split":
            return torch.cat([hidden, signed.expand_as(hidden)], -1).split(2, -1)[1]
        if self.how == "normalize":
            return torch.nn.functional.normalize(hidden + signed, dim=-1)
        if self.how == "rms norm":
            summed = hidden + torch.nn.functional.one_hot(action, 2).to(F64)
            return summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6) - hidden
        if self.how == "a + done":
            return (action.to(F64) + done.squeeze(-1).to(F64))[..., None].expand(-1, 2)
        if self.how == "zeros * (1 - done)":
            return torch.zeros(action.shape[0], 2, dtype=F64) * (1 - done.to(F64))
        if self.how == "new_zeros.masked_fill(done, 0)":
            return hidden.new_zeros(action.shape[0], 2).masked_fill(done, 0.0)
        if self.how == "where(done, h, unbound zeros)":  # a recurrent module's initial state, one per layer
            (state,) = torch.zeros(1, action.shape[0], 2, dtype=F64).unbind(0)
            return torch.where(done, hidden, state) - hidden
        if self.how == "where(done, h, copied zeros)":  # the same state laid out anew
            zeros = torch.zeros(action.shape[0], 2, dtype=F64)
            return torch.where(done, hidden, torch.empty_like(zeros).copy_(zeros)) - hidden
        if self.how == "where(done, 0, written lazy state)":
            if self.lazy is None:
                self.lazy = torch.zeros(2, dtype=F64)
            return torch.where(done, 0.0, self.lazy)
        return torch.where(done, 0.0, self.state)  # a recurrent state's buffer reset where an episode ended

    def forward(self, observation: torch.Tensor, action: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        hidden = observation[..., :2]
        value = self.net(torch.cat([observation, hidden + self.encoding(action, done, hidden)], -1))
        if "written" in self.how:  # the state kept for the next call
            self.state, self.lazy = hidden.detach().mean(0), hidden.detach().mean(0)
        return value


def _keyed(categorical: TensorDict, how: str) -> tuple[TensorDict, list[str]]:
    td = categorical.clone().set("done", (torch.arange(8) % 3 == 0).unsqueeze(-1))
    torch.manual_seed(1)
    module = ValueOperator(KeyedCritic(how), in_keys=["observation", "action", "done"])
    out, messages = caught(lambda: LRP(module, BaseRuleMapper(stabilizer=0))(td))
    return out, [m for m in messages if "enters the model as numbers" in m]


KEYED = {"w.expand * (a == 1)": "a comparison", "where(a == 1, w, -w)": "a comparison", "rms norm": "one_hot"}
KEYED |= {"sin(a * freqs)": None, "expand_as": None, "repeat": None, "tile": None, "clamp": None, "log1p": None}
KEYED |= {"pad": None, "split": None, "normalize": None}


@pytest.mark.parametrize("how", KEYED)
def test_an_action_encoded_with_parameters_sinusoids_repeats_or_a_written_out_norm_is_named(categorical, how):
    """A comparison's encoding scaled or chosen by a parameter seen through a view or a negation was taken as a
    gate of an activation, and a sinusoid, ``expand_as``, ``repeat``, ``tile``, ``clamp``, ``log1p``, ``F.pad``,
    ``split``, ``F.normalize`` or a norm's statistic written out ended the follow: 0.68-1.87 of the value lost
    (relative L2) with no word. Named, with the encoding it took."""
    out, numeric = _keyed(categorical, how)
    assert len(numeric) == 1 and "'action' (torch.int64)" in numeric[0], numeric
    assert "'module.net.0' (Linear)" in numeric[0]
    encoding = KEYED[how]
    assert f"encoded by {encoding}, " in numeric[0] if encoding else "converted to floating point" in numeric[0]
    assert _lost(out) > 0.1  # the action's share, which the warning is about


def test_two_keys_summed_before_a_layer_are_both_named(categorical):
    """A sum of two integer keys named the first only (the done flag's share, lost as well, had no word)."""
    out, numeric = _keyed(categorical, "a + done")
    assert len(numeric) == 2, numeric
    assert "'action' (torch.int64)" in numeric[0] and "'done' (torch.bool)" in numeric[1]
    assert all("converted to floating point" in m and "'module.net.0' (Linear)" in m for m in numeric)
    assert _lost(out) > 0.1


@pytest.mark.parametrize(
    "how",
    [
        "zeros * (1 - done)",
        "new_zeros.masked_fill(done, 0)",
        "where(done, h, unbound zeros)",
        "where(done, h, copied zeros)",
    ],
)
def test_zeros_scaled_or_chosen_by_a_key_hold_no_share_and_are_not_named(categorical, how):
    """Zeros whatever the key's values hold none of the relevance: the done flag was named though nothing is lost
    (the observation's relevance sums to the value). Zeros split into parts (``unbind``) or copied into a tensor
    made for them (``empty_like(z).copy_(z)``), as torchrl's recurrent modules lay out an initial state, are zeros
    too."""
    out, numeric = _keyed(categorical, how)
    assert not numeric, numeric
    assert _lost(out) < 1e-10


def test_a_state_buffer_chosen_by_a_key_is_named(categorical):
    """A buffer of ones chosen by the done flag holds a share that no input receives: still named."""
    out, numeric = _keyed(categorical, "where(done, 0, state)")
    assert len(numeric) == 1 and "'done' (torch.bool)" in numeric[0] and "encoded by where" in numeric[0], numeric
    assert _lost(out) > 0.1


@pytest.mark.parametrize("how", ["where(done, 0, written zero state)", "where(done, 0, written lazy state)"])
def test_a_state_of_zeros_the_model_writes_is_named(categorical, how):
    """A state of zeros (a buffer, or a tensor made on the first call) chosen by the done flag holds no share on the
    first call, the one watched, but the model writes its state to it: the next call lost 0.43 of the value
    (relative L2) with no word. Named as a state of values is."""
    td = categorical.clone().set("done", (torch.arange(8) % 3 == 0).unsqueeze(-1))
    torch.manual_seed(1)
    module = ValueOperator(KeyedCritic(how), in_keys=["observation", "action", "done"])
    lrp = LRP(module, BaseRuleMapper(stabilizer=0))
    first, messages = caught(lambda: lrp(td.clone()))
    numeric = [m for m in messages if "enters the model as numbers" in m]
    assert len(numeric) == 1 and "'done' (torch.bool)" in numeric[0] and "encoded by where" in numeric[0], numeric
    assert _lost(first) < 1e-10  # nothing lost yet: the buffer holds zeros
    later, _ = caught(lambda: lrp(td.clone()))
    assert _lost(later) > 0.1  # the share the warning is about


class SplitGate(nn.Module):
    """A value of the observation part of ``torch.cat([observation, done.float()], -1)``, gated by the done part
    (nothing of the done flag enters a layer: the observation's relevance sums to the value), or, ``"key into
    layer"``, with the done part given to a layer too; no biases."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        torch.manual_seed(0)
        self.first, self.last = nn.Linear(4, 2, bias=False).to(F64), nn.Linear(2, 1, bias=False).to(F64)
        self.flag = nn.Linear(1, 2, bias=False).to(F64)

    def forward(self, observation: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        joined = torch.cat([observation, done.to(F64)], -1)
        if self.how in ("split", "key into layer"):
            kept, flag = joined.split([4, 1], -1)
        elif self.how == "slices":
            kept, flag = joined[..., :4], joined[..., 4:]
        else:  # unbind
            parts = joined.unbind(-1)
            kept, flag = torch.stack(parts[:4], -1), parts[4].unsqueeze(-1)
        hidden = self.first(kept) * (1 - flag)
        return self.last(hidden + self.flag(flag) if self.how == "key into layer" else hidden)


@pytest.mark.parametrize("how", ["split", "slices", "unbind", "key into layer"])
def test_the_parts_of_a_join_carry_the_keys_of_the_pieces_they_span(categorical, how):
    """A split, slice or unbind of ``torch.cat([observation, done.float()], -1)`` marked every part as holding the
    done flag's values: its observation part, given to a layer, named the flag though nothing is lost (the
    observation's relevance sums to the value, 1e-16). The part holding the flag, given to a layer, is named."""
    td = categorical.clone().set("done", (torch.arange(8) % 3 == 0).unsqueeze(-1))
    module = TensorDictModule(SplitGate(how), in_keys=["observation", "done"], out_keys=["state_action_value"])
    out, messages = caught(lambda: LRP(module, BaseRuleMapper(stabilizer=0))(td))
    numeric = [m for m in messages if "enters the model as numbers" in m]
    if how == "key into layer":
        assert len(numeric) == 1 and "'done' (torch.bool)" in numeric[0] and "'module.flag' (Linear)" in numeric[0]
        assert _lost(out) > 0.1
    else:
        assert not numeric, numeric
        assert _lost(out) < 1e-10


class WrittenCritic(nn.Module):
    """Q(s, a) of the observation and the action index written into a tensor of zeros (by assignment, a write of
    a copy, or a one-hot code written at the action), or of a done flag that only gates activations written over;
    no biases."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        torch.manual_seed(1)
        self.net = MLP(in_features=5, out_features=1, num_cells=[8], activation_class=nn.ReLU, bias_last_layer=False)
        self.net = self.net.to(F64)
        with torch.no_grad():
            for name, parameter in self.net.named_parameters():
                if name.endswith("bias"):
                    parameter.zero_()

    def forward(self, observation: torch.Tensor, action: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        n, how = observation.shape[0], self.how
        z = observation.new_zeros(n, 5)
        z[:, :4] = observation
        column = action.to(F64)[:, None]
        if how == "z[:, 4] = a":
            z[:, 4] = column[:, 0]
        elif how == "index_put_":
            z.index_put_((torch.arange(n), torch.full((n,), 4)), column[:, 0])
        elif how == "masked_scatter_":
            z.masked_scatter_(torch.arange(5).expand(n, 5) == 4, column)
        elif how == "scatter_":
            z.scatter_(1, torch.full((n, 1), 4), column)
        elif how == "index_copy":
            z = torch.index_copy(z, 1, torch.tensor([4]), column)
        elif how == "narrow.copy_":
            z.narrow(1, 4, 1).copy_(column)
        elif how == "z[:, 4] = a, no cast":  # the values cast by the write itself
            z[:, 4] = action
        elif how == "a view's copy_":  # the view taken before the write
            view = z[:, 4:]
            view.copy_(column)
        elif how == "index_add_":
            z.index_add_(1, torch.tensor([4]), column)
        elif how == "scatter_add_":
            z.scatter_add_(1, torch.full((n, 1), 4), column)
        elif how == "put_":
            z.put_(torch.arange(n) * 5 + 4, column[:, 0])
        elif how == "written into a view of a join":  # the done flag joined, the action written over the first column
            z = torch.cat([observation, done.to(F64)], -1)
            z.narrow(1, 0, 1).copy_(column)
        elif how == "z[rows, a] = 1":
            code = observation.new_zeros(n, 5)
            code[torch.arange(n), action] = 1.0
            z = z + code
        elif how == "h[a] = 1":  # ones written over an activation where the action says: they hold its share
            z = z * 2.0
            z[action.bool(), 4] = 1.0
        elif how == "h[done] = 0":  # a gate: the activation written over where an episode ended
            z = z * 2.0
            z[done[:, 0]] = 0.0
        elif how == "padded[mask] = h":  # activations laid out where a mask of the key says (a padded sequence)
            padded = observation.new_zeros(n, 5)
            padded[(action == 1)[:, None].expand(n, 5)] = z[action == 1].flatten()
            z = z + padded
        elif how == "zeros[done] = 0":  # zeros written into zeros: nothing whatever the key
            zeros = observation.new_zeros(n, 5)
            zeros[done[:, 0]] = 0.0
            z = z + zeros
        return self.net(z)


WRITTEN = ["z[:, 4] = a", "index_put_", "masked_scatter_", "scatter_", "index_copy", "narrow.copy_"]
WRITTEN += ["z[:, 4] = a, no cast", "a view's copy_", "index_add_", "scatter_add_", "put_"]


def _written(categorical: TensorDict, how: str, **changes: torch.Tensor) -> tuple[TensorDict, list[str]]:
    td = categorical.clone().set("done", (torch.arange(8) % 3 == 0).unsqueeze(-1))
    for key, value in changes.items():
        td.set(key, value)
    module = ValueOperator(WrittenCritic(how), in_keys=["observation", "action", "done"])
    out, messages = caught(lambda: LRP(module, BaseRuleMapper(stabilizer=0))(td))
    return out, [m for m in messages if "enters the model as numbers" in m]


@pytest.mark.parametrize("how", [*WRITTEN, "z[rows, a] = 1", "h[a] = 1"])
def test_an_action_written_into_a_tensor_before_a_layer_is_named(categorical, how):
    """An action index written into a float tensor (``z[:, 4] = a.float()``, ``index_put_``, ``masked_scatter_``,
    ``scatter_``, ``torch.index_copy``, ``z.narrow(...).copy_``, or a one-hot code written at it) was not followed:
    1.25 of the value lost (0.84 for the code; relative L2) with no word; nor were ones written over an activation
    where the action is 1 (``h[a.bool(), 4] = 1.0``, taken for a gate like ``h[done] = 0.0``: 1.38 lost). Named;
    stored as floats as the advice says, the relevance of the observation and the action sums to the value."""
    out, numeric = _written(categorical, how)
    assert len(numeric) == 1 and "'action' (torch.int64)" in numeric[0], numeric
    assert "'module.net.0' (Linear)" in numeric[0]
    if how in ("z[rows, a] = 1", "h[a] = 1"):
        assert "encoded by a constant table written at its values (indexing), " in numeric[0]
    else:
        assert "converted to floating point" in numeric[0] and "td['action'].float()" in numeric[0]
    assert _lost(out) > 0.5  # the action's share, which the warning is about
    if how in WRITTEN:
        out, numeric = _written(categorical, how, action=categorical["action"].to(F64))
        assert not numeric, numeric
        total = out["relevance", "observation"].sum(-1) + out["relevance", "action"]  # one number per action
        torch.testing.assert_close(total, out["state_action_value"][:, 0], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("how", ["h[done] = 0", "padded[mask] = h", "zeros[done] = 0"])
def test_writes_that_gate_or_lay_out_activations_at_a_key_are_not_numbers(categorical, how):
    """Activations written over where a key says, activations laid out by a mask of a key, or zeros written into
    zeros hold none of the key's share: not named, and the observation's relevance sums to the value."""
    out, numeric = _written(categorical, how)
    assert not numeric, numeric
    assert _lost(out) < 1e-10


class KeyProduct(nn.Module):
    """A value of the observation plus an integer or boolean key the model takes as numbers (converted, or one-hot
    encoded where ``width`` > 1) and multiplies with a parameter in ``product``: ``torch.einsum`` (its operands one
    by one, or listed), ``torch.tensordot``, ``@`` (of the parameter, a view of it or a copy) or ``F.linear``; a key
    given as floats is taken as it is. No biases."""

    def __init__(self, product: str, width: int = 1) -> None:
        super().__init__()
        self.product, self.width = product, width
        torch.manual_seed(0)
        self.encoder = nn.Linear(4, 3, bias=False).to(F64)
        self.w = nn.Parameter(torch.randn(width, 3, dtype=F64))

    def forward(self, observation: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        if key.is_floating_point():
            code = key
        else:
            code = torch.nn.functional.one_hot(key, self.width).to(F64) if self.width > 1 else key.to(F64)
        if self.product == "einsum":
            taken = torch.einsum("bi,ij->bj", code, self.w)
        elif self.product == "einsum of a list":
            taken = torch.einsum("bi,ij->bj", [code, self.w])
        elif self.product == "tensordot":
            taken = torch.tensordot(code, self.w, dims=1)
        elif self.product == "@":
            taken = code @ self.w
        elif self.product == "@ a view":
            taken = code @ self.w[:, :]
        elif self.product == "@ a copy":
            taken = code @ (self.w * 1.0)
        else:
            taken = torch.nn.functional.linear(code, self.w.T)
        return (torch.relu(self.encoder(observation)) + taken).sum(-1, keepdim=True)


@pytest.mark.parametrize("product", ["einsum", "einsum of a list", "tensordot", "@ a view", "@ a copy"])
def test_a_flag_multiplied_with_a_parameter_in_einsum_or_tensordot_is_named(categorical, product):
    """A boolean key taken as a number into ``torch.einsum`` or ``torch.tensordot`` with a parameter, or into a
    matrix product with a view or a copy of one (``x @ w.T``), lost its share with no word (0.62 of the value,
    relative L2): named, as through ``torch.matmul`` with the parameter."""
    td = categorical.clone().set("done", (torch.arange(8) % 3 == 0).unsqueeze(-1))
    module = TensorDictModule(KeyProduct(product), ["observation", "done"], ["state_action_value"])
    out, messages = caught(lambda: LRP(module, BaseRuleMapper(stabilizer=0))(td))
    numeric = [m for m in messages if "enters the model as numbers" in m]
    assert len(numeric) == 1 and "'done' (torch.bool)" in numeric[0] and "converted to floating point" in numeric[0]
    where = "matmul" if product == "@ a copy" else "module 'module' (KeyProduct)"  # a copy has no module
    assert f"through {where}, " in numeric[0], numeric
    assert _lost(out) > 0.1  # the flag's share, which the warning is about


class CountedPositions(nn.Module):
    """The observation plus the positions counted from a mask of valid features (``mask.long().cumsum(-1)``), scaled
    into a layer, or looked up in an embedding of positions and summed; no biases."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        torch.manual_seed(0)
        self.first, self.last = nn.Linear(4, 3, bias=False).to(F64), nn.Linear(3, 1, bias=False).to(F64)
        self.positions = nn.Embedding(5, 4).to(F64)

    def forward(self, observation: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        counted = valid.long().cumsum(-1)
        if self.how == "embedded":
            return self.last(torch.relu(self.first(observation + self.positions(counted).sum(-1))))
        return self.last(torch.relu(self.first(observation + 0.5 * counted.to(F64) - 1.0)))


@pytest.mark.parametrize("how", ["scaled", "embedded"])
def test_positions_counted_from_a_mask_are_named_where_a_layer_takes_them_as_numbers(categorical, how):
    """Positions counted from a mask by ``cumsum``, given to a layer as numbers, lost the mask's share with no word
    (0.65 of the value, relative L2): named. Looked up in an embedding of positions (as transformers number their
    tokens), they are indices: not named."""
    valid = torch.rand(8, 4, generator=torch.Generator().manual_seed(3)) > 0.4
    td = categorical.clone().set("valid", valid)
    module = TensorDictModule(CountedPositions(how), ["observation", "valid"], ["state_action_value"])
    out, messages = caught(lambda: LRP(module, BaseRuleMapper(stabilizer=0))(td))
    numeric = [m for m in messages if "enters the model as numbers" in m]
    if how == "embedded":
        assert not numeric, numeric
        return
    assert len(numeric) == 1 and "'valid' (torch.bool)" in numeric[0] and "'module.first' (Linear)" in numeric[0]
    assert "converted to floating point" in numeric[0], numeric
    assert _lost(out) > 0.1  # the mask's share, which the warning is about


def test_an_action_written_into_a_view_of_a_join_holding_a_flag_names_both(categorical):
    """A write into a view of a tensor keeps what the tensor carried: the done flag joined to it and the action
    written over one of its columns both reach the layer, and both are named."""
    out, numeric = _written(categorical, "written into a view of a join")
    assert len(numeric) == 2, numeric
    assert sum("'action' (torch.int64)" in m for m in numeric) == 1, numeric
    assert sum("'done' (torch.bool)" in m for m in numeric) == 1, numeric
    assert _lost(out) > 0.1


class _Called(nn.Module):
    """A causal language model called with token ids, an integer attention mask and positions counted from it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits[:, -1]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_an_integer_attention_mask_and_positions_counted_from_it_are_not_named(name: str):
    """A left-padded batch given to a tiny GPT-2 (its head tied to the embedding) or Llama with every key explained:
    the integer attention mask (made into additive scores), and positions counted from it by ``cumsum`` (looked up in
    an embedding, or turned into rotary angles that scale activations) hold no share of the relevance: nothing is
    named, under strict=True neither. In float32: in float64, Llama's eager softmax (computed in float32) turns a
    fully padded query's scores to NaN, which is refused (``rules/_narrowed_softmax.py``)."""
    from tests.attribution.test_lrp_transformer_zoo import PRESETS, ZOO

    model = ZOO[name].build("eager").float()
    ids = torch.randint(3, 60, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :2] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    td = TensorDict(input_ids=ids, attention_mask=mask, position_ids=positions, batch_size=[2])
    keys = ["input_ids", "attention_mask", "position_ids"]
    module = TensorDictModule(_Called(model), keys, ["logits"])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*enters the model as numbers")
        out = LRP(module, PRESETS["attnlrp"](strict=True))(td)
    assert ("relevance", "input_ids") in out.keys(True)
    assert torch.isfinite(out["relevance", "input_ids"]).all()
