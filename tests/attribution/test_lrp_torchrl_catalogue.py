"""Every public module class of ``torchrl.modules`` and ``tensordict.nn``, each in a tiny float64 model, under LRP.

Each class is listed once below with what LRP does with it, and the test holds it to that:

* ``LRP0``: LRP-0 (the default rules with no stabilizer) equals gradient × input on every input key, with no word;
* ``CONSERVES``: with every bias zeroed, the ε-rule with ε = 0 conserves the explained value, with no word;
* ``WARNS``: a warning naming the module (its path and class) and what its plain gradient misses;
* ``RAISES``: an error naming the class and what to do instead;
* ``NOT_EXPLAINED``: no model to explain (a base class, a planner, a value normaliser, a search score, ...), with
  the reason; where the reason claims a behaviour (exploration noise switched off when acting deterministically),
  a check holds it.

A class of a newer torchrl or tensordict in none of these lists fails :func:`test_every_public_module_class_is_listed`:
it enters LRP unchecked until it is looked at and listed. The deeper tests of these classes are in
``test_lrp_torchrl.py``, ``test_agents.py``, ``test_lrp_world_models.py`` and ``test_policy_targets.py``.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import tensordict.nn
import torch
import torchrl.modules
from tensordict import TensorDict
from tensordict.nn import TensorDictModule, TensorDictModuleBase, TensorDictSequential
from tensordict.utils import NestedKey
from torch import nn
from torchrl.envs.utils import ExplorationType, set_exploration_type

from tdhook.attribution import LRP, BaseRuleMapper, EpsilonRule
from tdhook.attribution._keys import as_tuple
from tests.attribution.test_lrp_torch_nn import Loop
from tests.attribution.test_lrp_torchrl import network
from tests.attribution.test_lrp_world_models import qmixer, zero_biases

F64 = torch.float64
LRP0, CONSERVES, WARNS, RAISES = "LRP-0", "conserves", "warns", "raises"
NOT_EXPLAINED = "not explained"
Built = tuple[TensorDictModuleBase, TensorDict, NestedKey]


@dataclass(frozen=True)
class Case:
    """What LRP does with a class; ``build`` makes a tiny model with it, its input and the key to explain. For
    ``NOT_EXPLAINED``, ``reason`` says why and ``check`` (if any) holds the behaviour the reason claims."""

    outcome: str
    build: Callable[[], Built] | None = None
    reason: str = ""
    check: Callable[[], None] | None = None
    dtype: torch.dtype = F64  # RSSMPrior runs its GRU cell in float32
    rtol: float = 1e-9  # DreamerV3's norms compute in float32
    in_keys: tuple[NestedKey, ...] | None = None  # where an input is no tensor (a language instruction)


def relu_mlp(out_features: int, in_features: int = 4, cells: int = 8) -> nn.Module:
    return torchrl.modules.MLP(
        in_features=in_features, out_features=out_features, num_cells=[cells], activation_class=nn.ReLU
    ).to(F64)


def obs(batch: int = 3, features: int = 4) -> TensorDict:
    return TensorDict(observation=torch.randn(batch, features, dtype=F64), batch_size=[batch])


def wrapped(net: nn.Module, td: TensorDict | None = None, out: str = "out") -> Built:
    return TensorDictModule(net.to(F64), ["observation"], [out]), obs() if td is None else td, out


def from_network(kind: str) -> Callable[[], Built]:
    return lambda: network(kind)


# ----------------------------------------------------------------------------- builders, torchrl.modules


def _actor() -> Built:
    return torchrl.modules.Actor(relu_mlp(2), in_keys=["observation"]), obs(), "action"


def _probabilistic(kind: str = "actor") -> Built:
    """A Gaussian policy: an MLP, its loc and scale split by NormalParamExtractor; the loc explained."""
    from tensordict.nn import NormalParamExtractor, ProbabilisticTensorDictModule, ProbabilisticTensorDictSequential

    net = TensorDictModule(nn.Sequential(relu_mlp(4), NormalParamExtractor()), ["observation"], ["loc", "scale"])
    dist = {"in_keys": ["loc", "scale"], "out_keys": ["action"], "distribution_class": torchrl.modules.TanhNormal}
    if kind == "actor":
        return torchrl.modules.ProbabilisticActor(net, **dist), obs(), "loc"
    if kind == "safe":
        net = torchrl.modules.SafeModule(net.module, ["observation"], ["loc", "scale"])
        head = torchrl.modules.SafeProbabilisticModule(**dist)
        return torchrl.modules.SafeProbabilisticTensorDictSequential(net, head), obs(), "loc"
    return ProbabilisticTensorDictSequential(net, ProbabilisticTensorDictModule(**dist)), obs(), "loc"


def _state_independent_scale() -> Built:
    from tensordict.nn import AddStateIndependentNormalScale

    net = nn.Sequential(relu_mlp(2), AddStateIndependentNormalScale(2))
    return TensorDictModule(net.to(F64), ["observation"], ["loc", "scale"]), obs(), "loc"


def _q_value_actor(distributional: bool = False) -> Built:
    if distributional:
        support = torch.linspace(-1, 1, 5, dtype=F64)
        net = nn.Sequential(relu_mlp(15), nn.Unflatten(-1, (5, 3)))
        actor = torchrl.modules.DistributionalQValueActor(
            net, in_keys=["observation"], support=support, action_space="one-hot"
        )
        return actor, obs(), "action_value"
    return (
        torchrl.modules.QValueActor(relu_mlp(3), in_keys=["observation"], action_space="one-hot"),
        obs(),
        ("chosen_action_value"),
    )


def _q_value_module(distributional: bool = False) -> Built:
    net = TensorDictModule(relu_mlp(15 if distributional else 3), ["observation"], ["action_value"])
    if distributional:
        layers = nn.Sequential(net.module, nn.Unflatten(-1, (5, 3)), nn.LogSoftmax(-2))
        net = TensorDictModule(layers, ["observation"], ["action_value"])
        head = torchrl.modules.DistributionalQValueModule(
            action_space="one-hot", support=torch.linspace(-1, 1, 5, dtype=F64)
        )
        return TensorDictSequential(net, head), obs(), "action_value"
    head = torchrl.modules.QValueModule(action_space="one-hot")
    return TensorDictSequential(net, head), obs(), "chosen_action_value"


def _heads(kind: str) -> Built:
    common = TensorDictModule(relu_mlp(8), ["observation"], ["hidden"])
    actor = torchrl.modules.Actor(relu_mlp(2, 8), in_keys=["hidden"])
    if kind == "ActorValueOperator":
        critic = torchrl.modules.ValueOperator(relu_mlp(1, 8), in_keys=["hidden"])
        return torchrl.modules.ActorValueOperator(common, actor, critic), obs(), "state_value"
    if kind == "ActorCriticOperator":
        critic = torchrl.modules.ValueOperator(
            TensorDictModule(relu_mlp(1, 10), ["x"], ["y"]).module, in_keys=["hidden", "action"]
        )

        class Cat(nn.Module):
            def __init__(self, net: nn.Module) -> None:
                super().__init__()
                self.net = net

            def forward(self, hidden: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
                return self.net(torch.cat([hidden, action], -1))

        critic = torchrl.modules.ValueOperator(Cat(relu_mlp(1, 10)), in_keys=["hidden", "action"])
        operator = torchrl.modules.ActorCriticOperator(common, actor, critic)
        return operator, obs(), "state_action_value"
    actor = torchrl.modules.Actor(relu_mlp(2), in_keys=["observation"])
    critic = torchrl.modules.ValueOperator(relu_mlp(1), in_keys=["observation"])
    return torchrl.modules.ActorCriticWrapper(actor, critic), obs(), "state_value"


def _in_sequence(*layers: nn.Module, td: TensorDict | None = None) -> Callable[[], Built]:
    """``layers`` before a head, in eval mode once the lazy layers took their shapes and the norms their
    statistics."""

    def build() -> Built:
        for layer in layers:  # drawn at import, from whatever the tests imported before drew: drawn again here
            if type(layer) is nn.Linear:
                layer.reset_parameters()
        module, x, key = wrapped(nn.Sequential(*layers, nn.Flatten(), nn.LazyLinear(3)), td)
        module.train()(x.clone())
        return module.eval(), x, key

    return build


class First(nn.Module):
    """The first output of a module that returns a tuple (ConsistentDropout in training mode, with its mask)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.module(x)
        return out[0] if isinstance(out, tuple) else out


def _sequence(batch: int = 3, steps: int = 4) -> TensorDict:
    td = TensorDict(observation=torch.randn(batch, steps, 4, dtype=F64), batch_size=[batch, steps])
    td["is_init"] = torch.zeros(batch, steps, 1, dtype=torch.bool)
    td["is_init"][:, 0] = True
    return td


def _ddpg_cnn_actor() -> Built:
    cnn = {"num_cells": [4], "depth": 1, "kernel_sizes": 3, "strides": 2, "paddings": 0, "activation_class": nn.ReLU}
    net = torchrl.modules.DdpgCnnActor(2, cnn, {"num_cells": [8], "depth": 1, "activation_class": nn.ReLU})
    td = TensorDict(observation=torch.randn(3, 2, 8, 8, dtype=F64), batch_size=[3])
    return TensorDictModule(net, ["observation"], ["action", "hidden"]), td, "action"


def _recurrent(kind: str) -> Built:
    """torchrl's recurrent layers (python-based ones too) before a linear head, over the steps of a sequence."""
    from torchrl.modules import GRU, LSTM, GRUCell, GRUModule, LSTMCell, LSTMModule, set_recurrent_mode

    head = TensorDictModule(nn.Linear(6, 3), ["embed"], ["out"])
    if kind in ("GRUModule", "LSTMModule"):
        cls = GRUModule if kind == "GRUModule" else LSTMModule
        rnn = cls(input_size=4, hidden_size=6, in_key="observation", out_key="embed")

        class Sequence(TensorDictSequential):
            def forward(self, td, *args, **kwargs):
                with set_recurrent_mode(True):
                    return super().forward(td, *args, **kwargs)

        return Sequence(rnn, head), _sequence(), "out"
    if kind in ("GRU", "LSTM"):
        net = First((GRU if kind == "GRU" else LSTM)(4, 6, batch_first=True))
    else:
        net = Loop((GRUCell if kind == "GRUCell" else LSTMCell)(4, 6))
    x = TensorDict(observation=torch.randn(3, 4, 4, dtype=F64), batch_size=[3])
    return TensorDictModule(nn.Sequential(net, nn.Flatten(), nn.LazyLinear(3)), ["observation"], ["out"]), x, "out"


def _world_model(kind: str) -> Built:
    from tests.attribution.methods.test_random_draws import inputs
    from tests.attribution.test_lrp_world_models import prior_and_posterior

    td = inputs().to(F64)
    if kind == "DreamerActor":
        net = torchrl.modules.DreamerActor(2, depth=2, num_cells=8).to(F64)
        net(td["state"], td["belief"])  # its MLP is lazy
        return TensorDictModule(net, ["state", "belief"], ["loc", "scale"]), td, "loc"
    if kind == "ObsDecoder":
        net = torchrl.modules.ObsDecoder(channels=2, num_layers=2, latent_dim=10)
        return TensorDictModule(net, ["state", "belief"], ["pixels"]), td, "pixels"
    if kind == "ObsEncoder":
        net = torchrl.modules.ObsEncoder(channels=2, num_layers=2)
        pixels = TensorDict(pixels=torch.randn(2, 3, 64, 64, dtype=F64), batch_size=[2])
        return TensorDictModule(net, ["pixels"], ["embed"]), pixels, "embed"
    prior, posterior = prior_and_posterior()
    if kind == "RSSMPrior":
        td = inputs()
        out_keys = [("next", "prior_mean"), ("next", "prior_std"), ("next", "state"), ("next", "belief")]
        return TensorDictModule(prior, ["state", "belief", "action"], out_keys), td, ("next", "prior_mean")
    td = TensorDict(belief=td["belief"], embedding=torch.randn(3, 5, dtype=F64), batch_size=[3])
    out_keys = ["posterior_mean", "posterior_std", "posterior"]
    return TensorDictModule(posterior, ["belief", "embedding"], out_keys), td, "posterior_mean"


def _multi_agent(kind: str) -> Built:
    from tests.attribution.test_lrp_torchrl import _agents

    relu = {"activation_class": nn.ReLU, "n_agents": 3, "centralized": False, "share_params": False}
    if kind == "MultiAgentMLP":
        net = torchrl.modules.MultiAgentMLP(4, 2, depth=1, num_cells=8, **relu)
        td = _agents((4,))
    else:
        net = torchrl.modules.MultiAgentConvNet(num_cells=[4], kernel_sizes=3, **relu)
        td = _agents((2, 6, 6))
    key = ("agents", "out")
    return TensorDictModule(net.to(F64), [("agents", "observation")], [key]), td, key


def _exploring(kind: str) -> tuple[TensorDictModuleBase, TensorDictModuleBase, TensorDict, NestedKey]:
    """A policy with its exploration module, the policy without it, an input and the key to explain."""
    from torchrl.data import Bounded, OneHot

    td = obs().set("is_init", torch.ones(3, 1, dtype=torch.bool))
    if kind == "EGreedyModule":
        q = TensorDictSequential(
            TensorDictModule(relu_mlp(3), ["observation"], ["action_value"]),
            torchrl.modules.QValueModule(action_space="one-hot"),
        )
        return (
            TensorDictSequential(q, torchrl.modules.EGreedyModule(OneHot(3), eps_init=0.9, eps_end=0.9)),
            q,
            td,
            ("chosen_action_value"),
        )
    spec = Bounded(-1.0, 1.0, (2,), dtype=F64)
    actor = torchrl.modules.Actor(relu_mlp(2), in_keys=["observation"], spec=spec)
    if kind == "AdditiveGaussianModule":
        noise = torchrl.modules.AdditiveGaussianModule(spec=spec, sigma_init=0.5, sigma_end=0.5)
    else:
        noise = torchrl.modules.OrnsteinUhlenbeckProcessModule(spec=spec)
    return TensorDictSequential(actor, noise), actor, td, "action"


def _check_exploration(kind: str) -> Callable[[], None]:
    """Acting deterministically, the exploration module leaves the action alone: the policy's relevance is that of
    the policy without it, with no word. (Exploring at random, its noise is a constant of the call:
    ``test_an_exploring_policy_explains_the_action_it_takes`` in ``test_policy_targets.py``.)"""

    def check() -> None:
        torch.manual_seed(0)
        policy, alone, td, key = _exploring(kind)
        with set_exploration_type(ExplorationType.DETERMINISTIC):
            out, messages = _explain(policy, td, key, BaseRuleMapper(stabilizer=0.0))
            expected, _ = _explain(alone, td, key, BaseRuleMapper(stabilizer=0.0))
            assert torch.equal(out["action"], alone(td.clone())["action"])
        assert messages == []
        torch.testing.assert_close(out["relevance", "observation"], expected["relevance", "observation"])

    return check


def _check_removed(name: str) -> Callable[[], None]:
    def check() -> None:
        with pytest.raises(RuntimeError, match="removed|deprecated"):
            getattr(torchrl.modules, name)(TensorDictModule(nn.Linear(2, 2), ["observation"], ["action"]))

    return check


def _ensemble() -> Built:
    module = TensorDictModule(relu_mlp(2), ["observation"], ["out"])
    return tensordict.nn.EnsembleModule(module, 2), obs(), "out"


def _tanh_module() -> Built:
    net = TensorDictModule(relu_mlp(2), ["observation"], ["param"])
    return (
        TensorDictSequential(net, torchrl.modules.TanhModule(["param"], ["action"], low=-2.0, high=2.0)),
        obs(),
        ("action"),
    )


def _consistent_dropout_module() -> Built:
    return (
        TensorDictSequential(
            TensorDictModule(nn.Sequential(relu_mlp(6), nn.ReLU()), ["observation"], ["h"]),
            torchrl.modules.ConsistentDropoutModule(p=0.5, in_keys=["h", "mask"], out_keys=["h", "mask"]),
            TensorDictModule(nn.Linear(6, 3), ["h"], ["out"]),
        ),
        obs(),
        "out",
    )


def _decision_transformer(kind: str) -> Built:
    from tests.attribution.test_policy_targets import context, decision_transformer

    net, wrapper = decision_transformer("online" if kind == "OnlineDTActor" else "plain")
    td = context("batched")
    if kind == "DecisionTransformerInferenceWrapper":
        return wrapper, td, "loc" if kind == "OnlineDTActor" else "action"
    if kind == "DecisionTransformer":
        return TensorDictModule(net.transformer, ["observation", "action", "return_to_go"], ["out"]), td, "out"
    keys = ["loc", "scale"] if kind == "OnlineDTActor" else ["action"]
    return TensorDictModule(net, ["observation", "action", "return_to_go"], keys), td, keys[0]


class Centred(nn.Module):
    """DreamerV3's image encoder reads pixels in [0, 1] and takes 0.5 off (a constant shift, a bias of the input):
    given the centred image plus 0.5, its layers read the centred image."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x + 0.5)


class Cell(nn.Module):
    """A recurrent cell's step from a zero state."""

    def __init__(self, cell: nn.Module) -> None:
        super().__init__()
        self.cell = cell

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cell(x, torch.zeros(x.shape[0], 8, dtype=x.dtype))


def _dreamer_v3(kind: str) -> Built:
    """DreamerV3's networks: RMS norms and SiLU activations."""
    if kind == "DreamerV3MLP":
        return wrapped(torchrl.modules.DreamerV3MLP(4, 3, depth=2, num_cells=8))
    if kind == "DreamerV3ImageEncoder":
        net = Centred(torchrl.modules.DreamerV3ImageEncoder(in_channels=2, depth=2, mults=(1, 2), kernel_size=3))
        return wrapped(net, TensorDict(observation=torch.randn(2, 2, 16, 16, dtype=F64), batch_size=[2]))
    if kind == "DreamerV3BlockGRU":
        net = First(torchrl.modules.DreamerV3BlockGRU(4, 8, projection_size=8, num_blocks=2))
        return wrapped(
            nn.Sequential(net, nn.Flatten(), nn.Linear(40, 3)),
            TensorDict(observation=torch.randn(3, 5, 4, dtype=F64), batch_size=[3]),
        )
    if kind == "DreamerV3BlockGRUCell":
        cell = torchrl.modules.DreamerV3BlockGRUCell(4, 8, projection_size=8, num_blocks=2)
        return wrapped(nn.Sequential(Cell(cell), nn.Linear(8, 3)), obs())
    if kind == "DreamerV3DiscreteActor":
        actor = torchrl.modules.DreamerV3DiscreteActor(14, 3, depth=1, num_cells=8, in_keys=["state", "belief"])
        td = TensorDict(state=torch.randn(3, 6, dtype=F64), belief=torch.randn(3, 8, dtype=F64), batch_size=[3])
        return actor, td, "logits"
    if kind == "SymExpTwoHot":
        return wrapped(nn.Sequential(nn.Linear(4, 5), torchrl.modules.SymExpTwoHot(5)))
    net = torchrl.modules.DreamerV3ImageDecoder(
        6, image_shape=(2, 16, 16), depth=2, mults=(1, 2), kernel_size=3, num_blocks=2
    )
    return wrapped(net, obs(2, 6))


def _model_based(kind: str) -> Built:
    """torchrl's other model-based modules."""
    if kind == "DreamerV3SeededPolicy":
        return torchrl.modules.DreamerV3SeededPolicy(_actor()[0], seed=0), obs(), "action"
    if kind == "WorldModelWrapper":
        transition = TensorDictModule(relu_mlp(4), ["observation"], [("next", "observation")])
        reward = TensorDictModule(relu_mlp(1), [("next", "observation")], ["reward"])
        return torchrl.modules.WorldModelWrapper(transition, reward), obs(), "reward"
    if kind == "WorldModel":
        encoder = TensorDictModule(relu_mlp(6), ["observation"], ["latent"])
        dynamics = TensorDictModule(relu_mlp(6, 6), ["latent"], [("next", "latent")])
        reward = TensorDictModule(relu_mlp(1, 6), [("next", "latent")], ["reward"])
        return torchrl.modules.WorldModel(encoder, dynamics, reward), obs(), "reward"
    if kind == "RBFController":

        class Mean(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.controller = torchrl.modules.RBFController(4, 2, 1.0, n_basis=3)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.controller(x, torch.zeros(*x.shape, x.shape[-1], dtype=x.dtype))[0]

        return wrapped(Mean())
    if kind == "DiffusionActor":
        # ReLU in the score network (SiLU by default); its input holds the step's index, a constant like a bias.
        score = nn.Sequential(nn.Linear(7, 8), nn.ReLU(), nn.Linear(8, 2))
        actor = torchrl.modules.DiffusionActor(2, score_network=score, num_steps=3, in_keys=["observation"])
        return actor, obs(), "action"
    if kind == "TinyVLA":
        vla = torchrl.modules.TinyVLA(action_dim=2, chunk_size=2, hidden_dim=8, text_dim=4, use_state=False)
        with torch.no_grad():  # the instruction's embedding, an input not explained, adds nothing
            vla.text_embedding.weight.zero_()
        td = TensorDict(
            observation=TensorDict(image=torch.rand(2, 3, 16, 16), batch_size=[2]),
            language_instruction=["push", "pull"],
            batch_size=[2],
        )
        return vla, td, ("vla_action", "chunk")

    torch.manual_seed(0)
    if kind == "RSSMStateEstimatorV3":
        prior = torchrl.modules.RSSMPriorV3(
            hidden_dim=8, rnn_hidden_dim=8, num_categoricals=2, num_classes=3, action_dim=2
        )
        posterior = torchrl.modules.RSSMPosteriorV3(
            hidden_dim=8, num_categoricals=2, num_classes=3, rnn_hidden_dim=8, obs_embed_dim=5
        )
        estimator = torchrl.modules.RSSMStateEstimatorV3(prior, posterior, out_keys=["next_state", "next_belief"])
        td = TensorDict(
            state=torch.randn(3, 6),
            belief=torch.randn(3, 8),
            previous_action=torch.randn(3, 2),
            encoded_latents=torch.randn(3, 5),
            is_init=torch.zeros(3, 1, dtype=torch.bool),
            batch_size=[3],
        )
        return estimator, td, "next_state"
    if kind in ("RSSMPriorV3", "RSSMRolloutV3"):
        prior = torchrl.modules.RSSMPriorV3(
            hidden_dim=8, rnn_hidden_dim=8, num_categoricals=2, num_classes=3, action_dim=2
        )
        td = TensorDict(state=torch.randn(3, 6), belief=torch.randn(3, 8), action=torch.randn(3, 2), batch_size=[3])
        return (
            TensorDictModule(prior, ["state", "belief", "action"], ["logits", "next_state", "next_belief"]),
            td,
            "logits",
        )
    posterior = torchrl.modules.RSSMPosteriorV3(
        hidden_dim=8, num_categoricals=2, num_classes=3, rnn_hidden_dim=8, obs_embed_dim=5
    )
    td = TensorDict(belief=torch.randn(3, 8, dtype=F64), embed=torch.randn(3, 5, dtype=F64), batch_size=[3])
    return TensorDictModule(posterior, ["belief", "embed"], ["logits", "state"]), td, "logits"


def _rollout(kind: str) -> Built:
    """Dreamer's rollout of the prior and posterior over the steps of a sequence (float32: their GRU cells)."""
    if kind == "RSSMRollout":
        from tests.attribution.test_lrp_world_models import prior_and_posterior

        prior, posterior = prior_and_posterior()
        prior_keys = [("next", "prior_mean"), ("next", "prior_std"), "_", ("next", "belief")]
        posterior_keys = [("next", "posterior_mean"), ("next", "posterior_std"), ("next", "state")]
        rollout = torchrl.modules.RSSMRollout
        key = ("next", "posterior_mean")
    else:
        prior = torchrl.modules.RSSMPriorV3(
            hidden_dim=8, rnn_hidden_dim=6, num_categoricals=2, num_classes=2, action_dim=2
        )
        posterior = torchrl.modules.RSSMPosteriorV3(
            hidden_dim=8, num_categoricals=2, num_classes=2, rnn_hidden_dim=6, obs_embed_dim=5
        )
        prior_keys = [("next", "prior_logits"), "_", ("next", "belief")]
        posterior_keys = [("next", "posterior_logits"), ("next", "state")]
        rollout = torchrl.modules.RSSMRolloutV3
        key = ("next", "posterior_logits")
    module = rollout(
        TensorDictModule(prior, ["state", "belief", "action"], prior_keys),
        TensorDictModule(posterior, [("next", "belief"), ("next", "encoded_latents")], posterior_keys),
    )
    generator = torch.Generator().manual_seed(3)
    td = TensorDict(
        state=torch.randn(2, 3, 4, generator=generator),
        belief=torch.randn(2, 3, 6, generator=generator),
        action=torch.randn(2, 3, 2, generator=generator),
        next=TensorDict(encoded_latents=torch.randn(2, 3, 5, generator=generator), batch_size=[2, 3]),
        batch_size=[2, 3],
    )
    return module, td, key


def _act_model() -> Built:
    """torchrl's action chunking transformer (a robot policy) in inference mode: ``nn.TransformerDecoder`` layers
    over the observation's token."""
    from torchrl.modules.models import ACTModel

    net = ACTModel(4, 2, 3, hidden_dim=8, nheads=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=8)
    return TensorDictModule(net, ["observation"], ["action_pred", "mu", "log_var"]), obs(), "action_pred"


def _gpt2_reward_model() -> Built:
    """torchrl's GPT-2 reward model, on a GPT-2 of one small layer (the class builds GPT-2's default configuration
    where no checkpoint is named): the reward of the last token before the padding, explained on the token ids."""
    from unittest import mock

    from torchrl.modules.models import GPT2RewardModel
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_head=2, n_embd=8, n_positions=8, vocab_size=16, bos_token_id=1, eos_token_id=1)
    with mock.patch.object(GPT2LMHeadModel, "config_class", lambda: config):
        net = GPT2RewardModel(pad_token_id=0)
    ids = torch.tensor([[3, 5, 7, 0], [2, 4, 6, 8]])
    td = TensorDict(input_ids=ids, attention_mask=(ids != 0).long(), batch_size=[2])
    return TensorDictModule(net, ["input_ids", "attention_mask"], ["rewards", "end_scores"]), td, "end_scores"


BASE_CLASS = "a base class: its subclasses are listed"
VALUE_TARGET = "transforms or normalises the value targets of a loss, no model's forward"


CASES: dict[str, Case] = {
    "Actor": Case(LRP0, _actor),
    "MLP": Case(LRP0, lambda: wrapped(relu_mlp(3))),
    "ConvNet": Case(LRP0, from_network("ConvNet")),
    "Conv3dNet": Case(LRP0, from_network("Conv3dNet")),
    "DuelingCnnDQNet": Case(LRP0, from_network("DuelingCnnDQNet")),
    "DdpgMlpQNet": Case(LRP0, from_network("DdpgMlpQNet")),
    "DdpgCnnQNet": Case(LRP0, from_network("DdpgCnnQNet")),
    "CrossGroupCritic": Case(LRP0, from_network("CrossGroupCritic")),
    "VDNMixer": Case(LRP0, from_network("VDNMixer")),
    "SafeSequential": Case(LRP0, from_network("SafeSequential")),
    "SafeModule": Case(LRP0, lambda: (torchrl.modules.SafeModule(relu_mlp(2), ["observation"], ["out"]), obs(), "out")),
    "ValueOperator": Case(
        LRP0, lambda: (torchrl.modules.ValueOperator(relu_mlp(1), ["observation"]), obs(), "state_value")
    ),
    "DdpgMlpActor": Case(
        LRP0,
        lambda: wrapped(torchrl.modules.DdpgMlpActor(2, {"num_cells": [8], "depth": 1, "activation_class": nn.ReLU})),
    ),
    "DdpgCnnActor": Case(LRP0, _ddpg_cnn_actor),
    "ProbabilisticActor": Case(LRP0, _probabilistic),
    "SafeProbabilisticModule": Case(LRP0, lambda: _probabilistic("safe")),
    "SafeProbabilisticTensorDictSequential": Case(LRP0, lambda: _probabilistic("safe")),
    "ProbabilisticTensorDictModule": Case(LRP0, lambda: _probabilistic("tensordict")),
    "ProbabilisticTensorDictSequential": Case(LRP0, lambda: _probabilistic("tensordict")),
    "NormalParamExtractor": Case(LRP0, _probabilistic),
    "AddStateIndependentNormalScale": Case(LRP0, _state_independent_scale),
    "QValueActor": Case(LRP0, _q_value_actor),
    "QValueModule": Case(LRP0, _q_value_module),
    "DistributionalQValueActor": Case(WARNS, lambda: _q_value_actor(True)),
    "DistributionalQValueModule": Case(WARNS, lambda: _q_value_module(True)),
    "ActorValueOperator": Case(LRP0, lambda: _heads("ActorValueOperator")),
    "ActorCriticOperator": Case(LRP0, lambda: _heads("ActorCriticOperator")),
    "ActorCriticWrapper": Case(LRP0, lambda: _heads("ActorCriticWrapper")),
    "SqueezeLayer": Case(LRP0, _in_sequence(nn.Linear(4, 1), nn.Unflatten(-1, (1, 1)), torchrl.modules.SqueezeLayer())),
    "Squeeze2dLayer": Case(
        LRP0, _in_sequence(nn.Linear(4, 6), nn.Unflatten(-1, (6, 1, 1)), torchrl.modules.Squeeze2dLayer())
    ),
    "NoisyLinear": Case(LRP0, _in_sequence(torchrl.modules.NoisyLinear(4, 6), nn.ReLU())),
    "NoisyLazyLinear": Case(LRP0, _in_sequence(torchrl.modules.NoisyLazyLinear(6), nn.ReLU())),
    "BatchRenorm1d": Case(LRP0, _in_sequence(nn.Linear(4, 6), torchrl.modules.BatchRenorm1d(6), nn.ReLU())),
    "ConsistentDropout": Case(
        LRP0, _in_sequence(nn.Linear(4, 6), nn.ReLU(), First(torchrl.modules.ConsistentDropout()))
    ),
    # Recurrent layers: the signal-take-all rule on their gates.
    **{kind: Case(CONSERVES, lambda kind=kind: _recurrent(kind)) for kind in "GRU GRUCell LSTM LSTMCell".split()},
    "GRUModule": Case(CONSERVES, lambda: _recurrent("GRUModule")),
    "LSTMModule": Case(CONSERVES, lambda: _recurrent("LSTMModule")),
    # Dreamer's world model: ELU activations (the pass rule) and a GRU cell.
    **{
        kind: Case(CONSERVES, lambda kind=kind: _world_model(kind))
        for kind in "DreamerActor ObsDecoder ObsEncoder RSSMPosterior".split()
    },
    "MultiAgentMLP": Case(LRP0, lambda: _multi_agent("MultiAgentMLP")),
    "MultiAgentConvNet": Case(LRP0, lambda: _multi_agent("MultiAgentConvNet")),
    "RSSMPrior": Case(CONSERVES, lambda: _world_model("RSSMPrior"), dtype=torch.float32),
    # Exploration: off when acting deterministically; a constant of the call when drawing.
    **{
        kind: Case(NOT_EXPLAINED, reason="exploration: perturbs the action", check=_check_exploration(kind))
        for kind in ("EGreedyModule", "AdditiveGaussianModule", "OrnsteinUhlenbeckProcessModule")
    },
    **{
        name: Case(NOT_EXPLAINED, reason="removed from torchrl: constructing it raises", check=_check_removed(name))
        for name in (
            "AdditiveGaussianWrapper",
            "EGreedyWrapper",
            "OrnsteinUhlenbeckProcessWrapper",
            "NormalParamWrapper",
        )
    },
    "TanhModule": Case(CONSERVES, _tanh_module),
    "ConsistentDropoutModule": Case(LRP0, _consistent_dropout_module),
    "VmapModule": Case(
        LRP0,
        lambda: (torchrl.modules.VmapModule(TensorDictModule(relu_mlp(2), ["observation"], ["out"]), 0), obs(), "out"),
    ),
    "EnsembleModule": Case(RAISES, _ensemble),
    "DistributionalDQNnet": Case(WARNS, lambda: _q_value_actor(True)),  # a log-softmax over the atoms
    # Classes of torchrl.modules.models that torchrl.modules does not export.
    "Conv2dNet": Case(LRP0, from_network("ConvNet")),  # ConvNet's other name
    "DuelingMlpDQNet": Case(LRP0, from_network("DuelingMlpDQNet")),
    # Attention under the CNN presets; under AttnLRP and CP-LRP: rules/test_attention_projections.py.
    "ACTModel": Case(WARNS, _act_model),
    "GPT2RewardModel": Case(WARNS, _gpt2_reward_model, in_keys=("input_ids",)),
    # QMIX's hypernetwork products and function-call ELU: test_lrp_world_models.py (conserves under AttnLRP).
    "QMixer": Case(WARNS, lambda: (*qmixer(), "q_total")),
    # GPT-2's attention and softmax under the CNN presets (under the transformer presets: test_policy_targets.py).
    **{
        kind: Case(WARNS, lambda kind=kind: _decision_transformer(kind))
        for kind in ("DTActor", "OnlineDTActor", "DecisionTransformer", "DecisionTransformerInferenceWrapper")
    },
    "MultiAgentNetBase": Case(NOT_EXPLAINED, reason=BASE_CLASS),
    "TensorDictModuleBase": Case(NOT_EXPLAINED, reason=BASE_CLASS),
    "TensorClassModuleBase": Case(NOT_EXPLAINED, reason=BASE_CLASS),
    "MPCPlannerBase": Case(NOT_EXPLAINED, reason=BASE_CLASS),
    "VLAWrapperBase": Case(NOT_EXPLAINED, reason=BASE_CLASS),
    "MCTSScore": Case(NOT_EXPLAINED, reason=BASE_CLASS),
    "ValueTransform": Case(NOT_EXPLAINED, reason=BASE_CLASS),
    "ValueNorm": Case(NOT_EXPLAINED, reason=BASE_CLASS),
    "TensorDictParams": Case(NOT_EXPLAINED, reason="holds parameters, computes nothing"),
    **{
        name: Case(NOT_EXPLAINED, reason=VALUE_TARGET)
        for name in "ComposeValueTransform IdentityValueTransform SignedHyperbolicValueTransform SymLogValueTransform "
        "PercentileValueNorm PopArtValueNorm RunningValueNorm".split()
    },
    **{
        name: Case(NOT_EXPLAINED, reason="a tree-search score over visit counts and values, no model")
        for name in "EXP3Score PUCTScore UCB1TunedScore UCBScore".split()
    },
    **{
        name: Case(NOT_EXPLAINED, reason="a planner: searches actions by rolling out an environment's model")
        for name in ("CEMPlanner", "MPPIPlanner")
    },
    **{
        kind: Case(CONSERVES, lambda kind=kind: _dreamer_v3(kind), rtol=1e-6)
        for kind in ("DreamerV3MLP", "DreamerV3ImageEncoder")
    },
    # Gates, norms and activations computed as functions in their own forward (and the actor's unimix softmax).
    **{
        kind: Case(WARNS, lambda kind=kind: _dreamer_v3(kind))
        for kind in ("DreamerV3ImageDecoder", "DreamerV3BlockGRU", "DreamerV3BlockGRUCell", "DreamerV3DiscreteActor")
    },
    "SymExpTwoHot": Case(WARNS, lambda: _dreamer_v3("SymExpTwoHot")),  # a softmax over the bins
    **{
        kind: Case(LRP0, lambda kind=kind: _model_based(kind))
        for kind in ("DreamerV3SeededPolicy", "WorldModelWrapper", "WorldModel")
    },
    **{kind: Case(CONSERVES, lambda kind=kind: _model_based(kind)) for kind in ("RSSMPosteriorV3",)},
    "RSSMPriorV3": Case(CONSERVES, lambda: _model_based("RSSMPriorV3"), dtype=torch.float32),
    # The posterior's straight-through sample is named (test_lrp_world_models.py: RSSMRollout's softplus scale).
    **{
        kind: Case(WARNS, lambda kind=kind: _rollout(kind), dtype=torch.float32)
        for kind in ("RSSMRollout", "RSSMRolloutV3")
    },
    "RSSMStateEstimatorV3": Case(WARNS, lambda: _model_based("RSSMStateEstimatorV3"), dtype=torch.float32),
    "DiffusionActor": Case(LRP0, lambda: _model_based("DiffusionActor")),
    "RBFController": Case(WARNS, lambda: _model_based("RBFController")),  # exp, sin and a solve in its forward
    "TinyVLA": Case(  # its image in float32; ELU and tanh (the pass rule)
        CONSERVES, lambda: _model_based("TinyVLA"), dtype=torch.float32, in_keys=(("observation", "image"),)
    ),
    "MultiStepActorWrapper": Case(
        NOT_EXPLAINED, reason="replays, step by step, a chunk of actions its actor computed earlier: explain the actor"
    ),
    "LMHeadActorValueOperator": Case(
        NOT_EXPLAINED, reason="builds on a Hugging Face causal LM (transformers under LRP: test_lrp_huggingface.py)"
    ),
    "LeRobotPolicyWrapper": Case(NOT_EXPLAINED, reason="wraps an external LeRobot policy object, no torch layers"),
    "GPWorldModel": Case(NOT_EXPLAINED, reason="a Gaussian process fitted by exact inference (botorch, gpytorch)"),
    "TensorClassModuleWrapper": Case(
        NOT_EXPLAINED, reason="puts a module of tensorclasses (TensorClassModuleBase, a base class) in TensorDicts"
    ),
    "biased_softplus": Case(CONSERVES, _in_sequence(nn.Linear(4, 6), tensordict.nn.biased_softplus(1.0))),  # pass rule
    "TensorDictModule": Case(LRP0, lambda: wrapped(relu_mlp(3))),
    "TensorDictSequential": Case(
        LRP0,
        lambda: (
            TensorDictSequential(
                TensorDictModule(relu_mlp(6), ["observation"], ["h"]), TensorDictModule(relu_mlp(2, 6), ["h"], ["out"])
            ),
            obs(),
            "out",
        ),
    ),
    "WrapModule": Case(
        LRP0,
        lambda: (
            TensorDictSequential(
                TensorDictModule(relu_mlp(3), ["observation"], ["h"]),
                tensordict.nn.WrapModule(lambda td: td.set("out", td["h"] * 2)),
            ),
            obs(),
            "out",
        ),
    ),
    "TensorDictModuleWrapper": Case(
        LRP0, lambda: (tensordict.nn.TensorDictModuleWrapper(wrapped(relu_mlp(3))[0]), obs(), "out")
    ),
}


def _public_module_classes(package) -> list[str]:
    """The names in ``package.__all__`` that are module classes."""
    names = []
    for name in package.__all__:
        value = getattr(package, name, None)
        if isinstance(value, type) and issubclass(value, nn.Module):
            names.append(name)
    return names


PACKAGES = {
    "torchrl.modules": torchrl.modules,
    "torchrl.modules.models": torchrl.modules.models,  # exports classes torchrl.modules does not (ACTModel)
    "tensordict.nn": tensordict.nn,
}


def test_every_public_module_class_is_listed():
    """A module class of a newer torchrl or tensordict enters LRP unchecked: look at it in a model, and list it."""
    for label, package in PACKAGES.items():
        unlisted = [name for name in _public_module_classes(package) if name not in CASES]
        assert unlisted == [], f"{label} module classes not checked under LRP: {unlisted}; check each and list it"
    stale = [name for name in CASES if not any(hasattr(p, name.split(" ")[0]) for p in PACKAGES.values())]
    assert stale == [], f"listed but not in this torchrl/tensordict: {stale}"


def _gradient_times_input(module: TensorDictModuleBase, td: TensorDict, key: NestedKey) -> tuple[dict, float]:
    """The oracle: each floating-point input the output depends on, times the gradient of the largest output unit
    of each row; and the total value of those units."""
    x = td.clone()
    leaves = {
        k: v.requires_grad_() for k, v in x.items(True, True) if isinstance(v, torch.Tensor) and v.is_floating_point()
    }
    output = module(x).get(key)
    seed = (output.detach() == output.detach().max(-1, keepdim=True).values).to(output.dtype)
    grads = torch.autograd.grad(output, list(leaves.values()), seed, allow_unused=True)
    relevance = {k: leaf.detach() * g for (k, leaf), g in zip(leaves.items(), grads, strict=True) if g is not None}
    return relevance, (output * seed).sum().item()


def _explain(
    module: TensorDictModuleBase, td: TensorDict, key: NestedKey, mapper, in_keys: tuple | None = None
) -> tuple[TensorDict, list[str]]:
    keys = {} if in_keys is None else {"in_keys": list(in_keys)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = LRP(module, mapper, target_key=key, **keys)(td.clone())
    # The default target among a continuous action's dimensions, or on the rows of a map (ObsDecoder's pixels), is
    # warned of for every such output (as the oracle, the unit of largest value is explained): a word on the target,
    # not on the module, which is what is checked.
    return out, [str(w.message) for w in caught if not str(w.message).startswith("LRP: target=None ")]


@pytest.mark.parametrize("name", list(CASES))
def test_each_module_class(name: str):
    case = CASES[name]
    if case.outcome == NOT_EXPLAINED:
        assert case.reason
        if case.check is not None:
            case.check()
        return
    torch.manual_seed(0)
    module, td, key = case.build()
    module = module.to(case.dtype).eval()
    tolerance = {"rtol": case.rtol, "atol": 1e-12} if case.dtype == F64 else {"rtol": 1e-5, "atol": 1e-6}
    with set_exploration_type(ExplorationType.DETERMINISTIC):
        plain = module(td.clone())  # lazy layers take their shapes
        if case.outcome == RAISES:
            with pytest.raises((ValueError, TypeError), match=name):
                _explain(module, td, key, BaseRuleMapper(stabilizer=0.0), case.in_keys)
            return
        if case.outcome == WARNS:
            _, messages = _explain(module, td, key, BaseRuleMapper(stabilizer=0.0), case.in_keys)
            assert any(re.search(r"module '[\w.]*' \(\w+\)", m) for m in messages), messages
            return
        if case.outcome == LRP0:
            out, messages = _explain(module, td, key, BaseRuleMapper(stabilizer=0.0), case.in_keys)
            assert messages == []
            assert torch.equal(out[key], plain[key]), f"{key} left out of LRP's result"
            expected, _ = _gradient_times_input(module, td, key)
            assert set(out["relevance"].keys(True, True)) == set(expected)
            for k, relevance in expected.items():
                torch.testing.assert_close(out["relevance", *as_tuple(k)], relevance, **tolerance)
            return
        zero_biases(module)
        linear = {(nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d): EpsilonRule(0.0)}
        out, messages = _explain(module, td, key, BaseRuleMapper(stabilizer=1e-12, rule_mapper=linear), case.in_keys)
        assert messages == []
        assert torch.equal(out[key], module(td.clone())[key]), f"{key} left out of LRP's result"
        total = sum(r.sum() for r in out["relevance"].values(True, True))
        _, explained = _gradient_times_input(module, td, key)
        torch.testing.assert_close(total.item(), explained, **tolerance)
