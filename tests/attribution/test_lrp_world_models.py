"""LRP on torchrl's model-based and mixing networks: Dreamer's world model (RSSMPrior, RSSMPosterior, RSSMRollout,
ObsEncoder, ObsDecoder, DreamerActor) and QMIX's hypernetwork mixer (QMixer)."""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.data import Unbounded
from torchrl.modules import DreamerActor, ObsDecoder, QMixer, RSSMPosterior, RSSMPrior, RSSMRollout

from tdhook.attribution import LRP, AttnLRP, BaseRuleMapper, EpsilonPlus, EpsilonRule
from tests.attribution.methods.test_random_draws import inputs as step

F64 = torch.float64
# The ε-rule with ε = 0 on every layer: with zero biases, relevance is conserved through Linear layers, the pass rule
# on ELU, and the signal-take-all rule on the GRU cell.
CONSERVING = {(nn.Linear, nn.Conv2d, nn.ConvTranspose2d): EpsilonRule(0.0)}


def zero_biases(module: nn.Module) -> nn.Module:
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if name.rsplit(".", 1)[-1].startswith("bias"):
                parameter.zero_()
    return module


def prior_and_posterior() -> tuple[RSSMPrior, RSSMPosterior]:
    torch.manual_seed(0)
    prior = RSSMPrior(Unbounded(2), hidden_dim=6, rnn_hidden_dim=6, state_dim=4, action_dim=2, scale_lb=0.0)
    posterior = RSSMPosterior(hidden_dim=8, state_dim=4, rnn_hidden_dim=6, obs_embed_dim=5, scale_lb=0.0)
    return zero_biases(prior), zero_biases(posterior)


def conserved(out: TensorDict, key) -> None:
    total = sum(relevance.sum() for relevance in out["relevance"].values(True, True))
    torch.testing.assert_close(total, out[key].sum(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("key", [("next", "prior_mean"), ("next", "belief")])
def test_the_prior_conserves_its_mean_and_belief_through_its_gru_cell(key):
    """float32, as the prior runs its GRU cell; nothing is warned about."""
    prior, _ = prior_and_posterior()
    out_keys = [("next", "prior_mean"), ("next", "prior_std"), ("next", "state"), ("next", "belief")]
    module = TensorDictModule(prior, in_keys=["state", "belief", "action"], out_keys=out_keys)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = LRP(module, BaseRuleMapper(stabilizer=1e-12, rule_mapper=CONSERVING), target_key=key, target=lambda y: y)(
            step()
        )
    conserved(out, key)


@pytest.mark.parametrize("kind", ["DreamerActor", "ObsDecoder", "RSSMPosterior"])
def test_dreamers_heads_conserve(kind):
    torch.manual_seed(0)
    td = step()
    if kind == "DreamerActor":
        net = DreamerActor(2, depth=2, num_cells=8)
        net(td["state"], td["belief"])  # its MLP is lazy
        module, key = TensorDictModule(zero_biases(net), ["state", "belief"], ["loc", "scale"]), "loc"
    elif kind == "ObsDecoder":
        net = ObsDecoder(channels=2, num_layers=2, latent_dim=10)
        module, key = TensorDictModule(zero_biases(net), ["state", "belief"], ["pixels"]), "pixels"
    else:
        _, net = prior_and_posterior()
        td = TensorDict(belief=td["belief"], embedding=torch.randn(3, 5), batch_size=[3])
        module = TensorDictModule(net, ["belief", "embedding"], ["posterior_mean", "posterior_std", "posterior"])
        key = "posterior_mean"
    out = LRP(module, BaseRuleMapper(stabilizer=1e-12, rule_mapper=CONSERVING), target_key=key, target=lambda y: y)(td)
    conserved(out, key)


def test_a_rollout_explains_the_first_state_and_belief_and_the_noise_is_a_constant_of_the_call():
    """The rollout carries the state and belief from step to step: the inputs at later steps are overwritten and
    get no relevance. The outputs are those of the plain rollout under the same seed (the prior and posterior draw
    once per step, as without LRP); the posterior's softplus scale is named as not piecewise linear."""
    prior, posterior = prior_and_posterior()
    rollout = RSSMRollout(
        TensorDictModule(
            prior,
            ["state", "belief", "action"],
            [("next", "prior_mean"), ("next", "prior_std"), "_", ("next", "belief")],
        ),
        TensorDictModule(
            posterior,
            [("next", "belief"), ("next", "encoded_latents")],
            [("next", "posterior_mean"), ("next", "posterior_std"), ("next", "state")],
        ),
    )
    generator = torch.Generator().manual_seed(3)
    td = TensorDict(
        state=torch.randn(2, 4, 4, generator=generator),
        belief=torch.randn(2, 4, 6, generator=generator),
        action=torch.randn(2, 4, 2, generator=generator),
        next=TensorDict(encoded_latents=torch.randn(2, 4, 5, generator=generator), batch_size=[2, 4]),
        batch_size=[2, 4],
    )
    torch.manual_seed(5)
    plain = rollout(td.clone())
    torch.manual_seed(5)
    with pytest.warns(UserWarning, match=r"NormalParamExtractor\) computes softplus"):
        out = LRP(rollout, EpsilonPlus(), target_key=("next", "posterior_mean"))(td.clone())
    assert torch.equal(out["next", "posterior_mean"], plain["next", "posterior_mean"])
    for key in ("state", "belief"):
        assert out["relevance", key][:, 0].abs().sum() > 0
        assert not out["relevance", key][:, 1:].any()
    assert out["relevance", "action"][:, :-1].abs().sum() > 0


def qmixer() -> tuple[TensorDictModule, TensorDict]:
    torch.manual_seed(0)
    mixer = QMixer(state_shape=(5,), mixing_embed_dim=4, n_agents=3, device="cpu").to(F64)
    module = TensorDictModule(mixer, [("agents", "chosen_action_value"), "state"], ["q_total"])
    generator = torch.Generator().manual_seed(1)
    agents = TensorDict(chosen_action_value=torch.randn(4, 3, 1, generator=generator, dtype=F64), batch_size=[4, 3])
    td = TensorDict(agents=agents, state=torch.randn(4, 5, generator=generator, dtype=F64), batch_size=[4])
    return module, td


def test_qmixers_hypernetwork_products_are_named_under_the_cnn_presets():
    """QMIX multiplies the agents' values by weights its hypernetworks compute from the state (``bmm`` of two
    explained inputs) and mixes through an ELU called as a function: under the CNN presets both keep their plain
    gradient, and the warning names them."""
    module, td = qmixer()
    with pytest.warns(UserWarning, match=r"'module' \(QMixer\) computes bmm, elu in its own forward"):
        LRP(module, EpsilonPlus())(td)


def test_qmixer_conserves_under_attnlrp():
    """AttnLRP shares each product of two activations between its factors and passes the ELU: with every bias
    zeroed, the agents' values and the state share the total value, with no warning."""
    module, td = qmixer()
    zero_biases(module)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = LRP(module, AttnLRP(), target=lambda y: y)(td)
    total = out["relevance", "agents", "chosen_action_value"].sum() + out["relevance", "state"].sum()
    torch.testing.assert_close(total, out["q_total"].sum(), rtol=1e-9, atol=1e-12)
    assert out["relevance", "agents", "chosen_action_value"].abs().sum() > 0
