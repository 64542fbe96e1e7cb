"""tune: an explainer's parameters picked with optuna against a metric of the package."""

from __future__ import annotations

import sys
import time

import optuna
import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import LRP, EpsilonGammaBox, InputXGradient, IntegratedGradients, UniformEpsilon, tune
from tdhook.metrics import aopc, pixel_flipping, sensitivity_max


def policy() -> TensorDictModule:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))
    return TensorDictModule(net, in_keys=["observation"], out_keys=["action_value"])


def observations() -> TensorDict:
    return TensorDict(observation=torch.randn(16, 6, generator=torch.Generator().manual_seed(1)), batch_size=[16])


def lrp_aopc(module, td):
    return aopc(pixel_flipping(module, td, relevance_key="relevance"))


def attribution_aopc(module, td):
    return aopc(pixel_flipping(module, td, relevance_key="attribution"))


class TestResult:
    def test_first_trial_is_the_explainer_as_it_is_and_the_best_is_what_the_explainer_gives(self):
        explainer, td = LRP(policy(), rule_mapper=UniformEpsilon(epsilon=0.25)), observations()
        result = tune(explainer, td, lrp_aopc, n_trials=8, progress=False)
        first = result.study.trials[0]
        assert first.params == {"epsilon": 0.25}
        assert first.value == lrp_aopc(explainer.module, explainer(td.clone())).double().mean().item()
        assert len(result.study.trials) == 8
        assert result.best_value >= first.value
        recomputed = lrp_aopc(explainer.module, result.explainer(td.clone())).double().mean().item()
        assert result.best_value == recomputed
        assert result.explainer.tunable_values() == result.best_params
        assert explainer.tunable_values() == {"epsilon": 0.25}  # the explainer itself is left as it was
        assert "relevance" not in td.keys()

    def test_minimize_is_never_worse_than_the_first_trial(self):
        explainer, td = LRP(policy(), rule_mapper=UniformEpsilon(epsilon=0.01)), observations()
        result = tune(explainer, td, lrp_aopc, n_trials=6, direction="minimize", sampler="random", progress=False)
        assert result.best_value <= result.study.trials[0].value
        assert result.best_value == min(t.value for t in result.study.trials)

    def test_the_same_seed_gives_the_same_result(self):
        td = observations()
        runs = [
            tune(LRP(policy(), rule_mapper=UniformEpsilon()), td, lrp_aopc, n_trials=6, seed=s, progress=False)
            for s in (3, 3, 4)
        ]
        params = [[t.params for t in run.study.trials] for run in runs]
        assert params[0] == params[1] and runs[0].best_value == runs[1].best_value
        assert params[0] != params[2]

    def test_a_seeded_random_explainer_gives_the_same_result(self):
        """SmoothGrad draws noise from a generator of its own: with its seed set, every trial draws the same noise,
        the same seed gives the same values, and the best value is what the best explainer gives."""
        from tdhook.attribution import SmoothGrad

        td = observations()
        runs = [tune(SmoothGrad(policy(), seed=0), td, attribution_aopc, n_trials=4, progress=False) for _ in "ab"]
        assert [t.value for t in runs[0].study.trials] == [t.value for t in runs[1].study.trials]
        best = runs[0].explainer
        assert attribution_aopc(best.module, best(td.clone())).double().mean().item() == runs[0].best_value

    def test_a_method_with_an_integer_and_a_categorical_parameter(self):
        explainer, td = IntegratedGradients(policy(), n_steps=8), observations()
        result = tune(explainer, td, attribution_aopc, n_trials=5, progress=False)
        assert set(result.best_params) == {"n_steps", "method"}
        assert result.study.trials[0].params == {"n_steps": 8, "method": "gausslegendre"}
        recomputed = attribution_aopc(explainer.module, result.explainer(td.clone())).double().mean().item()
        assert result.best_value == recomputed

    def test_a_metric_that_explains_again_receives_the_trials_explainer(self):
        explainer, td = LRP(policy(), rule_mapper=UniformEpsilon()), observations()
        seen = []

        def sensitivity(module, td, explainer):
            seen.append(explainer.tunable_values())
            return sensitivity_max(explainer, td, seed=0)

        result = tune(explainer, td, sensitivity, n_trials=3, direction="minimize", progress=False)
        assert seen == [t.params for t in result.study.trials]
        recomputed = sensitivity_max(result.explainer, td, seed=0).double().mean().item()
        assert result.best_value == recomputed <= result.study.trials[0].value

    @pytest.mark.parametrize("given", ["numpy", "tensor"])
    def test_a_current_value_given_as_a_numpy_scalar_or_a_tensor_is_the_first_trial(self, given):
        """A current ε of ``np.float32(1.0)`` or ``torch.tensor(1.0)`` was not taken for a number: the first trial
        was sampled, and a one-trial run scored 3.8 % worse than the explainer as it is."""
        import numpy as np

        value = np.float32(1.0) if given == "numpy" else torch.tensor(1.0)
        explainer, td = LRP(policy(), rule_mapper=UniformEpsilon(epsilon=value)), observations()
        result = tune(explainer, td, lrp_aopc, n_trials=1, direction="minimize", progress=False)
        assert result.study.trials[0].params == {"epsilon": 1.0}
        assert result.best_value == lrp_aopc(explainer.module, explainer(td.clone())).double().mean().item()

    def test_a_current_value_outside_the_range_starts_at_the_end_of_the_range(self):
        explainer, td = LRP(policy(), rule_mapper=UniformEpsilon(epsilon=0.0)), observations()
        result = tune(explainer, td, lrp_aopc, n_trials=3, progress=False)
        assert result.study.trials[0].params == {"epsilon": 1e-6}

    def test_a_timeout_stops_starting_trials(self):
        explainer, td = LRP(policy(), rule_mapper=UniformEpsilon()), observations()

        def slow(module, td):
            time.sleep(0.3)
            return lrp_aopc(module, td)

        result = tune(explainer, td, slow, n_trials=50, timeout=0.1, progress=False)
        assert len(result.study.trials) == 1 and result.best_params == {"epsilon": 0.25}
        with pytest.raises(RuntimeError, match="timeout"):
            tune(explainer, td, slow, n_trials=50, timeout=0.0, progress=False)


class TestArguments:
    @pytest.mark.parametrize(
        ("kwargs", "named"),
        [
            ({"direction": "up"}, "direction"),
            ({"sampler": "grid"}, "sampler"),
            ({"n_trials": 0}, "n_trials"),
            ({"seed": None}, "seed"),  # optuna would draw a seed: a result no call could repeat
            ({"seed": 1.5}, "seed"),
            ({"timeout": "10"}, "timeout"),
            ({"timeout": float("nan")}, "timeout"),
            ({"timeout": -5}, r"timeout must be a number of seconds >= 0"),  # was "no trial started before"
            ({"metric": None}, r"metric must be a callable .* got NoneType"),  # was "'NoneType' is not callable"
            ({"metric": "aopc"}, r"metric must be a callable .* got str"),
        ],
    )
    def test_bad_arguments_are_named(self, kwargs, named):
        kwargs = dict(kwargs)
        metric = kwargs.pop("metric", lrp_aopc)
        with pytest.raises(ValueError, match=named):
            tune(LRP(policy(), rule_mapper=UniformEpsilon()), observations(), metric, progress=False, **kwargs)

    def test_a_metric_that_is_never_finite_is_named_and_leaves_the_explainer(self):
        explainer, td = LRP(policy(), rule_mapper=UniformEpsilon(epsilon=0.25)), observations()
        before = {k: v.clone() for k, v in explainer.module.state_dict().items()}
        with pytest.raises(ValueError, match="tune: the metric was not finite in any trial"):
            tune(explainer, td, lambda m, td: torch.tensor(float("nan")), n_trials=3, progress=False)
        assert explainer.tunable_values() == {"epsilon": 0.25}
        assert all(torch.equal(explainer.module.state_dict()[k], v) for k, v in before.items())
        assert list(td.keys()) == ["observation"]
        fresh = LRP(policy(), rule_mapper=UniformEpsilon(epsilon=0.25))(td.clone())["relevance", "observation"]
        assert torch.equal(explainer(td.clone())["relevance", "observation"], fresh)

    def test_an_explainer_without_tunables(self):
        with pytest.raises(ValueError, match="no tunable parameters"):
            tune(InputXGradient(policy()), observations(), attribution_aopc, progress=False)

    @pytest.mark.parametrize(
        ("explainer", "named"),
        [
            (policy, "got TensorDictModule$"),  # was "'Sequential' object has no attribute 'get_tunables'"
            (lambda: policy().module, "got Sequential$"),
            (
                UniformEpsilon,
                r"got UniformEpsilon, a rule mapper: wrap the model with it, LRP\(policy, UniformEpsilon\(\)\)",
            ),
        ],
        ids=["policy", "plain module", "preset"],
    )
    def test_what_is_no_explainer_is_named(self, explainer, named):
        with pytest.raises(TypeError, match=r"^tune: explainer must be an attribution wrapper .*" + named):
            tune(explainer(), observations(), lrp_aopc, progress=False)

    def test_without_optuna_the_error_names_the_extra(self, monkeypatch):
        monkeypatch.setitem(sys.modules, "optuna", None)
        with pytest.raises(ImportError, match=r"tdhook\[tune\]"):
            tune(LRP(policy(), rule_mapper=UniformEpsilon()), observations(), lrp_aopc)


class TestOutput:
    def test_optuna_is_quiet_unless_asked_and_its_verbosity_is_restored(self, caplog):
        before = optuna.logging.get_verbosity()
        explainer, td = LRP(policy(), rule_mapper=EpsilonGammaBox(-3.0, 3.0)), observations()
        with caplog.at_level("INFO", logger="optuna"):
            tune(explainer, td, lrp_aopc, n_trials=2, progress=False)
            assert not [r for r in caplog.records if r.name.startswith("optuna")]
            tune(explainer, td, lrp_aopc, n_trials=2, progress=False, verbose=True)
            assert any("Trial 1 finished" in r.getMessage() for r in caplog.records)
        assert optuna.logging.get_verbosity() == before

    def test_a_progress_bar(self, capsys):
        tune(LRP(policy(), rule_mapper=UniformEpsilon()), observations(), lrp_aopc, n_trials=2)
        assert "tune" in capsys.readouterr().err


class TestNonFiniteMetric:
    @pytest.mark.parametrize("direction, bad", [("maximize", float("inf")), ("minimize", float("-inf"))])
    def test_an_infinite_trial_is_failed_and_the_result_is_one_trial(self, direction, bad):
        # an infinite value must neither be reported as the best nor pair one trial's parameters with another's
        # explainer
        explainer, td = LRP(policy(), rule_mapper=UniformEpsilon(epsilon=0.25)), observations()
        calls = []

        def metric(module, td):
            calls.append(None)
            return torch.tensor(bad) if len(calls) == 2 else lrp_aopc(module, td)

        result = tune(explainer, td, metric, n_trials=4, direction=direction, sampler="random", progress=False)
        assert result.study.trials[1].state == optuna.trial.TrialState.FAIL
        assert result.best_value not in (float("inf"), float("-inf"))
        assert result.explainer.tunable_values() == result.best_params
        assert result.best_value == lrp_aopc(explainer.module, result.explainer(td.clone())).double().mean().item()


@pytest.mark.parametrize(
    ("td", "metric", "error", "named"),
    [
        ({"observation": torch.randn(4, 6)}, lrp_aopc, TypeError, "td must be a TensorDict .* got dict"),
        (torch.randn(4, 6), lrp_aopc, TypeError, "td must be a TensorDict .* got Tensor"),
        (None, lambda m, td: {"relevant": torch.ones(1)}, TypeError, "the metric returned dict; it must return a"),
    ],
    ids=["dict", "tensor", "metric-returns-a-dict"],
)
def test_what_is_no_td_or_no_score_is_named(td, metric, error, named):
    """A dict or a tensor as ``td`` and a metric returning a dict failed deep inside ("'dict' object has no attribute
    'clone'", "Could not infer dtype of dict")."""
    explainer = LRP(policy(), rule_mapper=UniformEpsilon())
    with pytest.raises(error, match=named):
        tune(explainer, observations() if td is None else td, metric, n_trials=1, progress=False)
