"""faithfulness_correlation against Quantus' FaithfulnessCorrelation (same subsets) and against its definition."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

from tdhook.metrics import faithfulness_correlation
from tests.metrics._models import TwoKeys, conv_net, images, quantus_scores

quantus = pytest.importorskip("quantus")


def quantus_subsets(seed, n_features, batch, n_runs, subset_size):
    """The subsets Quantus draws after ``np.random.seed(seed)``: per run, one per sample."""
    np.random.seed(seed)
    runs = [
        np.stack([np.random.choice(n_features, subset_size, replace=False) for _ in range(batch)])
        for _ in range(n_runs)
    ]
    return torch.from_numpy(np.stack(runs, axis=1))


def quantus_correlation(net, x, a, seed, n_runs, subset_size, baseline):
    """Quantus' FaithfulnessCorrelation after ``np.random.seed(seed)``, normalisation and abs off."""
    np.random.seed(seed)
    metric = quantus.FaithfulnessCorrelation(
        nr_runs=n_runs,
        subset_size=subset_size,
        perturb_baseline=baseline,
        normalise=False,
        abs=False,
        return_aggregate=False,
        disable_warnings=True,
        display_progressbar=False,
    )
    return quantus_scores(metric, net, x, a, net(x).argmax(-1))


@pytest.mark.parametrize(("batch", "n_runs", "subset_size"), [(1, 5, 10), (4, 12, 20), (3, 30, 35)])
def test_equals_quantus_given_its_subsets(batch, n_runs, subset_size):
    net = conv_net()
    x, a = images(batch), torch.randn(batch, 3, 6, 6, dtype=torch.float64)
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[batch])
    subsets = quantus_subsets(7, 108, batch, n_runs, subset_size)
    ours = faithfulness_correlation(net, td, subsets=subsets, in_keys=["x"], out_keys=["y"], baseline=0.25)
    expected = quantus_correlation(net, x, a, 7, n_runs, subset_size, 0.25)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)


def test_random_subsets_follow_the_seed_and_equal_the_definition_over_several_keys():
    net = TwoKeys().double()
    policy = TensorDictModule(net, in_keys=["u", "v"], out_keys=["q"])
    u, v = torch.randn(2, 3, 5, dtype=torch.float64), torch.randn(2, 3, 3, dtype=torch.float64)
    au, av = torch.randn(2, 3, 5, dtype=torch.float64), torch.randn(2, 3, 3, dtype=torch.float64)
    td = TensorDict(u=u, v=v, attribution=TensorDict(u=au, v=av), batch_size=[2, 3])
    rng = torch.get_rng_state()
    first = faithfulness_correlation(policy, td, n_runs=15, subset_size=3, seed=3, steps_per_forward=4)
    again = faithfulness_correlation(policy, td, n_runs=15, subset_size=3, seed=3)
    assert torch.equal(torch.get_rng_state(), rng)
    torch.testing.assert_close(first, again, rtol=0, atol=1e-12)
    assert first.shape == (2, 3)
    other = faithfulness_correlation(policy, td, n_runs=15, subset_size=3, seed=4)
    assert not torch.allclose(first, other)

    # The definition, on explicit subsets, sample by sample.
    subsets = torch.stack([torch.randperm(8)[:3] for _ in range(2 * 3 * 6)]).view(2, 3, 6, 3)
    ours = faithfulness_correlation(policy, td, subsets=subsets)
    target = net(u, v).argmax(-1)
    attribution = torch.cat([au, av], -1)
    for i in range(2):
        for j in range(3):
            drops, sums = [], []
            for subset in subsets[i, j]:
                w = torch.cat([u[i, j], v[i, j]]).clone()
                w[subset] = 0.0
                drops.append(net(u[i, j], v[i, j])[target[i, j]] - net(w[:5], w[5:])[target[i, j]])
                sums.append(attribution[i, j, subset].sum())
            expected = torch.corrcoef(torch.stack([torch.stack(sums), torch.stack(drops)]))[0, 1]
            torch.testing.assert_close(ours[i, j], expected, rtol=0, atol=1e-10)


def test_errors_name_what_was_expected():
    net = conv_net()
    td = TensorDict(x=images(2), attribution=TensorDict(x=torch.zeros(2, 3, 6, 6)), batch_size=[2])
    with pytest.raises(ValueError, match=r"subset_size must be an int in \[1, 108\]"):
        faithfulness_correlation(net, td, subset_size=224, in_keys=["x"], out_keys=["y"])
    with pytest.raises(ValueError, match=r"subsets must be integer feature indices of shape batch \+ \[n_runs"):
        faithfulness_correlation(net, td, subsets=torch.zeros(3, 4, 5, dtype=torch.long), in_keys=["x"], out_keys=["y"])
    with pytest.raises(ValueError, match=r"subsets must index the 108 features"):
        faithfulness_correlation(net, td, subsets=torch.full((2, 4, 5), 108), in_keys=["x"], out_keys=["y"])


def test_a_subset_naming_a_feature_twice_is_refused():
    """A subset is a set: a feature named twice would count twice in the attribution sum of the definition (and in
    Quantus, which sums ``a[indices]``) but go to the baseline once, and the subset would be smaller than its size."""
    net = conv_net()
    td = TensorDict(x=images(2), attribution=TensorDict(x=torch.randn(2, 3, 6, 6)), batch_size=[2])
    subsets = torch.arange(2 * 4 * 5).view(2, 4, 5)
    subsets[1, 2, 3] = subsets[1, 2, 0]
    with pytest.raises(ValueError, match=r"subsets must name distinct features in each run: sample \(1,\), run 2"):
        faithfulness_correlation(net, td, subsets=subsets, in_keys=["x"], out_keys=["y"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_constant_attributions_give_nan_as_quantus_not_a_correlation_of_rounding(dtype):
    """Equal attributions make every subset's sum the same: the correlation is undefined (Quantus: NaN). A masked
    sum over all features rounded differently from subset to subset, which gave correlations like 0.3."""
    net = conv_net()
    x = images(3)
    a = torch.full((3, 3, 6, 6), 0.1, dtype=dtype)
    a[2] = torch.randn(3, 6, 6, dtype=dtype)  # Quantus refuses a batch of attributions that are all equal
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[3])
    subsets = quantus_subsets(7, 108, 3, 20, 30)
    ours = faithfulness_correlation(net, td, subsets=subsets, in_keys=["x"], out_keys=["y"])
    expected = quantus_correlation(net, x, a, 7, 20, 30, 0.0)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6, equal_nan=True)
    assert ours[:2].isnan().all()
    drawn = faithfulness_correlation(net, td, n_runs=20, subset_size=30, seed=0, in_keys=["x"], out_keys=["y"])
    assert drawn[:2].isnan().all() and not drawn[2].isnan()


def test_a_nan_attribution_is_refused_by_name():
    net = conv_net()
    a = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    a[1, 0, 2, 3] = float("nan")
    td = TensorDict(x=images(2), attribution=TensorDict(x=a), batch_size=[2])
    with pytest.raises(ValueError, match=r"faithfulness_correlation: attribution \('attribution', 'x'\) holds NaN"):
        faithfulness_correlation(net, td, n_runs=4, subset_size=5, seed=0, in_keys=["x"], out_keys=["y"])


def test_fewer_than_two_runs_are_refused_by_name():
    net = conv_net()
    td = TensorDict(x=images(2), attribution=TensorDict(x=torch.randn(2, 3, 6, 6)), batch_size=[2])
    with pytest.raises(ValueError, match="faithfulness_correlation: n_runs must be an int of at least 2, got 1"):
        faithfulness_correlation(net, td, n_runs=1, subset_size=3, in_keys=["x"], out_keys=["y"])


def test_half_precision_attributions_are_summed_in_float32():
    """Subsets of 100 finite float16 attributions (500 to 1500 each) sum past float16's 65504: every sum was inf
    and every correlation NaN. They are summed in float32, as the float32 copy of the same values is."""
    torch.manual_seed(0)
    net = torch.nn.Linear(300, 2)
    x = torch.randn(2, 300)
    a = (torch.rand(2, 300) * 1000 + 500).half()
    kwargs = dict(in_keys=["x"], out_keys=["y"], n_runs=20, subset_size=100, seed=0)
    half = faithfulness_correlation(net, TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[2]), **kwargs)
    wide = faithfulness_correlation(net, TensorDict(x=x, attribution=TensorDict(x=a.float()), batch_size=[2]), **kwargs)
    assert half.isfinite().all()
    torch.testing.assert_close(half, wide, rtol=0, atol=0)
