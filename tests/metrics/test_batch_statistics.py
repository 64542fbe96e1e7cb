"""Models normalising over their batch: their running statistics are left as they were by every metric."""

from __future__ import annotations

import copy
import re
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn
from torchrl.modules import BatchRenorm1d

from tdhook.attribution import InputXGradient, Saliency
from tdhook.metrics import (
    action_fidelity,
    faithfulness_correlation,
    infidelity,
    pixel_flipping,
    randomisation_check,
    region_perturbation,
    sensitivity_max,
)
from tdhook.metrics._similarity import spearman
from tests.attribution.methods._models import FromCallersStatistics
from tests.metrics.test_scoring import batch_normalised, step_by_step


def test_the_running_statistics_of_a_model_in_training_mode_are_left_as_they_were():
    """Each pass of a BatchNorm in training mode updates its running statistics: the metrics' perturbed passes
    (hundreds for a curve) would leave the caller's model with those of perturbed inputs."""
    net = batch_normalised("linear")
    td = TensorDict(x=torch.randn(4, 3, 4, 4, dtype=torch.float64), batch_size=[4])
    td["attribution", "x"] = torch.randn(4, 3, 4, 4, dtype=torch.float64)
    before = copy.deepcopy(net.state_dict())
    kwargs = dict(in_keys=["x"], out_keys=["y"])
    pixel_flipping(module=net, td=td, features_per_step=8, **kwargs)
    region_perturbation(net, td, patch_size=2, **kwargs)
    faithfulness_correlation(net, td, n_runs=3, subset_size=4, seed=0, **kwargs)
    action_fidelity(net, td, k=3, n_random=2, seed=0, **kwargs)
    infidelity(net, td, perturb_fn=lambda r: (r, r.apply(torch.zeros_like)), n_perturb_samples=2, **kwargs)
    sensitivity_max(InputXGradient(net, in_keys=["x"], out_keys=["y"]), td, n_perturb_samples=2, seed=0)
    with pytest.raises(ValueError, match="normalises over the batch"):
        pixel_flipping(net, td, steps_per_forward=2, **kwargs)
    after = net.state_dict()
    assert net.training and all(torch.equal(after[name], value) for name, value in before.items())


def renorm_net(leading_linear: bool) -> nn.Module:
    """A model whose output in training mode depends on its running statistics (torchrl's BatchRenorm1d after
    warmup), which every pass moves a lot; with a leading linear layer, curves update that layer step by step."""
    torch.manual_seed(5)
    first = [nn.Flatten(), nn.Linear(48, 8)] if leading_linear else [nn.Flatten(), nn.Tanh(), nn.Linear(48, 8)]
    layers = [*first, BatchRenorm1d(8, warmup_steps=1, momentum=0.5), nn.Tanh(), nn.Linear(8, 3)]
    net = nn.Sequential(*layers).double().train()
    net(torch.randn(6, 3, 4, 4, dtype=torch.float64))  # past warmup
    return net


METRICS = {
    "pixel_flipping": lambda net, td, kw: pixel_flipping(net, td, features_per_step=8, **kw),
    "region_perturbation": lambda net, td, kw: region_perturbation(net, td, patch_size=2, **kw),
    "faithfulness_correlation": lambda net, td, kw: faithfulness_correlation(
        net, td, n_runs=4, subset_size=4, seed=0, **kw
    ),
    "action_fidelity": lambda net, td, kw: torch.stack(
        list(action_fidelity(net, td, k=3, n_random=2, seed=0, **kw).values())
    ),
    "infidelity": lambda net, td, kw: infidelity(
        net, td, perturb_fn=lambda r: (r, r.apply(lambda v: v * 0.5)), n_perturb_samples=3, **kw
    ),
    "sensitivity_max": lambda net, td, kw: sensitivity_max(InputXGradient(net, **kw), td, n_perturb_samples=3, seed=0),
}


@pytest.mark.parametrize("leading_linear", [True, False])
@pytest.mark.parametrize("metric", list(METRICS))
def test_every_pass_starts_from_the_callers_running_statistics(metric, leading_linear):
    """BatchRenorm1d in training mode normalises with its running statistics: every pass of a metric (and every
    call of the method it scores) runs from the statistics the caller left, not from those earlier passes moved
    (0.16 to 80 off, relative, and action fidelity 2 off of 1)."""
    net = renorm_net(leading_linear)
    torch.manual_seed(1)
    td = TensorDict(x=torch.randn(4, 3, 4, 4, dtype=torch.float64), batch_size=[4])
    td["attribution", "x"] = torch.randn(4, 3, 4, 4, dtype=torch.float64)
    kwargs = dict(in_keys=["x"], out_keys=["y"])
    expected = METRICS[metric](FromCallersStatistics(net), td, kwargs)
    torch.testing.assert_close(METRICS[metric](net, td, kwargs), expected, rtol=1e-12, atol=1e-12)


def test_randomisation_check_explains_every_layer_from_the_callers_running_statistics():
    """The cascade's explanations each start from the statistics of the caller's model (of its copy), not from
    those the explanations before moved."""
    net = renorm_net(False)
    td = TensorDict(x=torch.randn(4, 3, 4, 4, dtype=torch.float64), batch_size=[4])
    kwargs = dict(in_keys=["x"], out_keys=["y"])
    with pytest.warns(UserWarning, match=r"re-initialises the parameters '3.weight', '3.bias'"):  # BatchRenorm1d's
        scores = randomisation_check(Saliency(net, **kwargs), td, seed=3)
    copied = copy.deepcopy(net)
    original = Saliency(FromCallersStatistics(copied), **kwargs)(td.clone())["attribution", "x"].flatten(1).abs()
    with torch.no_grad():
        target = FromCallersStatistics(copied)(td["x"]).argmax(-1)
    with torch.random.fork_rng():
        for name in ["5", "2"]:  # the layers with reset_parameters, from the top
            torch.manual_seed(4)
            with torch.no_grad():
                copied.get_submodule(name).reset_parameters()
            method = Saliency(FromCallersStatistics(copied), target=target, **kwargs)
            changed = method(td.clone())["attribution", "x"].flatten(1).abs()
            torch.testing.assert_close(scores[name], spearman(original, changed), rtol=1e-12, atol=1e-12)
    assert list(scores) == ["5", "2"]


def vec_norm_net(frozen: bool) -> nn.Module:
    """A torchrl ``VecNorm`` before a small head, its statistics taken from a first batch; its statistics are no
    buffers, so no copy keeps them."""
    import warnings

    from tensordict.nn import TensorDictModule, TensorDictSequential
    from torchrl.envs.transforms import VecNorm

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        norm = VecNorm(in_keys=["x"], decay=0.9)
    norm(TensorDict(x=torch.randn(10, 3, 4, 4, dtype=torch.float64), batch_size=[10]))
    head = nn.Sequential(nn.Flatten(), nn.Linear(48, 3)).double()
    net = TensorDictSequential(norm.freeze() if frozen else norm, TensorDictModule(head, ["x"], ["y"]))
    return net


@pytest.mark.parametrize("metric", list(METRICS))
def test_a_vec_norm_that_is_not_frozen_is_refused_by_name(metric):
    """Every pass of a VecNorm that is not frozen moves its statistics (kept by no copy, being no buffers): a curve's
    passes would each normalise by other statistics and leave them moved many times. Refused by name; frozen, the
    metric runs and leaves them as they were."""
    td = TensorDict(x=torch.randn(4, 3, 4, 4, dtype=torch.float64), batch_size=[4])
    td["attribution", "x"] = torch.randn(4, 3, 4, 4, dtype=torch.float64)
    kwargs = {"in_keys": ["x"], "target_key": "y"}
    net = vec_norm_net(frozen=False)
    with pytest.raises(ValueError, match=r"module '[\w.]*0' \(VecNorm\) is not frozen"):
        METRICS[metric](net, td, kwargs)
    net = vec_norm_net(frozen=True)
    before = {k: v.clone() for k, v in net[0]._td.items()}
    METRICS[metric](net, td, kwargs)
    assert all(torch.equal(v, before[k]) for k, v in net[0]._td.items())


def mixes(h: torch.Tensor, how: str) -> torch.Tensor:
    """A statistic of the batch taken in a forward, with no module to show it."""
    if how == "batch_norm":
        return F.batch_norm(h, None, None, training=True)
    if how == "standardised":
        return (h - h.mean(0)) / (h.std(0) + 0.1)
    return h / (h.abs().amax(0) + 0.1)  # max-normalised


class MixesInItsForward(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(mixes(x, self.how))


class Mixing(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return mixes(h, self.how)


@pytest.mark.parametrize("where", ["in its forward", "after a leading linear layer"])
@pytest.mark.parametrize("how", ["batch_norm", "standardised", "max-normalised"])
def test_a_model_mixing_its_batch_with_no_module_to_show_it_is_scored_one_step_per_pass(how, where):
    """``F.batch_norm`` in training mode, ``(h - mean) / std`` or ``h / max`` over the batch in a forward: stacked
    steps changed each other's scores (the curve 0.07 to 0.69 off its definition here, the correlations 0.07 to 1.3),
    with no word. The first stack is compared with its first and middle steps alone (through the layers after a
    leading linear layer, which a curve updates step by step; elsewhere the first is the unperturbed batch, added to
    the stack): the steps then run one per pass, with a warning naming the module, and the scores are those of the
    definition."""
    torch.manual_seed(0)
    if where == "in its forward":
        net, name = MixesInItsForward(how).double(), "the model (MixesInItsForward)"
    else:
        net, name = (
            nn.Sequential(nn.Linear(6, 8), Mixing(how), nn.Tanh(), nn.Linear(8, 3)).double(),
            "module '1' (Mixing)",
        )
    x, a = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[4])
    kwargs = dict(in_keys=["x"], out_keys=["y"])
    with torch.no_grad():
        target = net(x).argmax(-1)
    expected = step_by_step(net, x, a, lambda y: y[torch.arange(4), target], 1)
    warned = rf"^metrics: {re.escape(name)} mixes the samples of its batch in its forward"
    with pytest.warns(UserWarning, match=warned):
        curve = pixel_flipping(net, td, **kwargs)
    torch.testing.assert_close(curve, expected, rtol=0, atol=1e-12)
    one_per_pass = faithfulness_correlation(net, td, n_runs=6, subset_size=2, seed=0, steps_per_forward=1, **kwargs)
    with pytest.warns(UserWarning, match=warned):
        correlation = faithfulness_correlation(net, td, n_runs=6, subset_size=2, seed=0, **kwargs)
    torch.testing.assert_close(correlation, one_per_pass, rtol=0, atol=0)


def test_the_comparison_costs_one_pass_of_the_batch_per_call_and_samples_apart_are_not_warned_of():
    """The first stack of a call also holds the unperturbed batch, compared with the pass that fixed the target, and
    its middle step runs alone: one pass of the batch more per call. A float32 CNN, whose kernels round by the batch
    size, treats its samples apart and is not warned of; built of torch's own layers with no hook, it is not even
    compared."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(128, 5)
    )
    td = TensorDict(x=torch.randn(8, 3, 6, 6), attribution=TensorDict(x=torch.randn(8, 3, 6, 6)), batch_size=[8])
    kwargs = dict(in_keys=["x"], out_keys=["y"], features_per_step=4)
    with mock.patch("tdhook.metrics._scoring.steps_mixed") as compared:
        plain = pixel_flipping(net, td, steps_per_forward=10, **kwargs)
    assert not compared.called
    passes = []
    net.register_forward_pre_hook(lambda module, args: passes.append(args[0].shape[0]))  # no longer plain
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*mixes the samples of its batch")
        curve = pixel_flipping(net, td, steps_per_forward=10, **kwargs)
    assert passes == [8, 88, 8, 80, 56]  # 27 steps in stacks of 10, the first after the unperturbed batch
    torch.testing.assert_close(curve, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(curve, pixel_flipping(net, td, steps_per_forward=1, **kwargs), rtol=1e-5, atol=1e-5)
