"""Models normalising over their batch: their running statistics are left as they were by every metric."""

from __future__ import annotations

import copy

import pytest
import torch
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
from tests.metrics.test_scoring import batch_normalised


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
