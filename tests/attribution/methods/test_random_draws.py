"""A model that draws at random in its own forward (torchrl's RSSMPrior samples its state): the methods that compare
forward passes warn where the explained output changes from one pass to the next on the same input."""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.data import Unbounded
from torchrl.modules import RSSMPrior

import tdhook.attribution as attribution

STATE, PRIOR_MEAN, BELIEF = ("next", "state"), ("next", "prior_mean"), ("next", "belief")
METHODS = {
    "FeatureAblation": {},
    "Occlusion": {"sliding_window_shapes": {"state": (1,), "belief": (1,), "action": (1,)}},
    "IntegratedGradients": {"n_steps": 4},
    "ShapleyValueSampling": {"n_samples": 2},
    "SmoothGrad": {"n_samples": 2},
}


def rssm_prior() -> TensorDictModule:
    """Dreamer's prior: ``state = mean + torch.randn_like(std) * std``, drawn in its own forward."""
    torch.manual_seed(0)
    prior = RSSMPrior(Unbounded(2), hidden_dim=6, rnn_hidden_dim=6, state_dim=4, action_dim=2)
    out_keys = [PRIOR_MEAN, ("next", "prior_std"), STATE, BELIEF]
    return TensorDictModule(prior, in_keys=["state", "belief", "action"], out_keys=out_keys)


def inputs() -> TensorDict:
    generator = torch.Generator().manual_seed(1)
    return TensorDict(
        state=torch.randn(3, 4, generator=generator),
        belief=torch.randn(3, 6, generator=generator),
        action=torch.randn(3, 2, generator=generator),
        batch_size=[3],
    )


def caught(method, td: TensorDict) -> list[str]:
    with warnings.catch_warnings(record=True) as found:
        warnings.simplefilter("always")
        method(td)
    return [str(w.message) for w in found]


@pytest.mark.parametrize("name", list(METHODS))
def test_a_sampled_state_is_warned_of_naming_the_module_that_draws(name):
    """The attribution of the sampled state compares independent draws: two calls differ by far more than the
    attribution of the state's mean is large (FeatureAblation: by 1.7, the mean's attribution at most 0.014), and
    nothing said so."""
    method = getattr(attribution, name)(rssm_prior(), target_key=STATE, target=0, **METHODS[name])
    messages = caught(method, inputs())
    assert len(messages) == 1
    assert messages[0].startswith(f"{name}: the target ('next', 'state') differs between two forward passes")
    assert "module 'module' (RSSMPrior) drew at random in its own forward" in messages[0]
    assert caught(method, inputs()) == []  # once per wrapper


@pytest.mark.parametrize("target_key", [PRIOR_MEAN, BELIEF])
@pytest.mark.parametrize("name", ["FeatureAblation", "IntegratedGradients"])
def test_outputs_computed_before_the_draw_are_not_warned_of(name, target_key):
    method = getattr(attribution, name)(rssm_prior(), target_key=target_key, target=0, **METHODS[name])
    assert caught(method, inputs()) == []


@pytest.mark.parametrize("name", ["FeatureAblation", "IntegratedGradients"])
def test_the_check_leaves_the_callers_random_state_and_the_attribution_as_they_were(name):
    """It runs on the method's fork of the random state: the caller's moves as one plain call moves it. The
    attribution of an output before the draw is the one the method gave without the check."""
    module, td = rssm_prior(), inputs()
    torch.manual_seed(3)
    module(td.clone())
    expected_next = torch.rand(4)
    method = getattr(attribution, name)(module, target_key=PRIOR_MEAN, target=0, **METHODS[name])
    torch.manual_seed(3)
    out = method(td.clone())
    assert torch.equal(torch.rand(4), expected_next)
    baseline = getattr(attribution, name)(module, target_key=PRIOR_MEAN, target=0, **METHODS[name])
    if hasattr(baseline, "_draws"):
        baseline._draws.checked = True  # no check: the passes the method itself runs
    torch.manual_seed(3)
    again = baseline(td.clone())
    for key in ("state", "belief", "action"):
        torch.testing.assert_close(out["attribution", key], again["attribution", key])


def test_a_deterministic_model_runs_no_extra_pass():
    net = nn.Linear(3, 2).double()
    passes = []
    net.register_forward_hook(lambda *_: passes.append(1))
    method = attribution.FeatureAblation(net, in_keys=["x"], out_keys=["y"], feature_masks=torch.arange(3))
    method(TensorDict(x=torch.randn(4, 3, dtype=torch.float64), batch_size=[4]))
    assert len(passes) == 1 + 3  # the caller's pass, one per group


def test_dropout_in_training_mode_is_told_by_its_own_warning_alone():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 2)).double().train()
    method = attribution.FeatureAblation(net, in_keys=["x"], out_keys=["y"])
    messages = caught(method, TensorDict(x=torch.randn(4, 3, dtype=torch.float64), batch_size=[4]))
    assert len(messages) == 1 and "differs between two forward passes" not in messages[0]


def test_the_innermost_modules_that_draw_are_named():
    from tdhook.attribution.methods._random_draws import drawing_modules

    class Noisy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.randn_like(x)

    net = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), Noisy()), Noisy())
    _, drawers = drawing_modules(dict(net.named_modules()), lambda: net(torch.randn(3, 2)))
    assert drawers == ["1.1", "2"]
    _, drawers = drawing_modules(dict(net[0].named_modules()), lambda: net[0](torch.randn(3, 2)))
    assert drawers == []


def test_a_draw_warning_made_an_error_is_given_at_every_call():
    """A caller's filter that makes the warning an error raises it at every call, not only the first (the next calls
    were no longer checked); once given, it is not repeated."""
    method = attribution.FeatureAblation(rssm_prior(), target_key=STATE, target=0)
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(UserWarning, match=r"FeatureAblation: the target \('next', 'state'\) differs between"):
                method(inputs())
    assert len(caught(method, inputs())) == 1
    assert caught(method, inputs()) == []
