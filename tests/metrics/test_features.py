"""Features: attributions read per key, concatenated in order, and the masks that perturb them."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tdhook.metrics import pixel_flipping
from tdhook.metrics._features import Features, explained_keys, sort_positions


def test_keys_concatenate_in_order_and_masks_split_back():
    td = TensorDict(
        a=torch.zeros(2, 3),
        nested=TensorDict(b=torch.ones(2, 2, 2), batch_size=[2]),
        scores=TensorDict(a=torch.arange(6.0).view(2, 3), nested=TensorDict(b=torch.ones(2, 1, 2), batch_size=[2])),
        batch_size=[2],
    )
    features = Features.read(td, [("nested", "b"), "a"], "scores")
    assert features.sizes == [2, 3] and features.values.shape == (2, 5)
    torch.testing.assert_close(features.values[:, 2:], td["scores", "a"])
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[:, 0] = True  # the first column of b: both rows of it (a size-1 dimension broadcasts)
    perturbed = features.perturb(mask.unsqueeze(0), {"a": 0.0, ("nested", "b"): torch.tensor(-1.0)})
    assert perturbed[("nested", "b")][0, 0].tolist() == [[-1.0, 1.0], [-1.0, 1.0]]
    assert torch.equal(perturbed["a"][0], td["a"])


def test_sort_positions_is_stable_descending_and_ascending():
    values = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    assert sort_positions(values).tolist() == [[2, 0, 1, 3]]
    assert sort_positions(values, descending=False).tolist() == [[1, 2, 3, 0]]


def test_errors_name_the_key_and_what_was_expected():
    td = TensorDict(x=torch.zeros(2, 3), attribution=TensorDict(x=torch.zeros(2, 3, dtype=torch.long)), batch_size=[2])
    with pytest.raises(TypeError, match=r"attribution \('attribution', 'x'\) must be a floating-point tensor"):
        Features.read(td, ["x"], "attribution")
    with pytest.raises(KeyError, match="input key .*y.* is missing from the TensorDict"):
        Features.read(td, ["y"], "attribution")
    td["attribution", "x"] = torch.zeros(2, 2)
    with pytest.raises(ValueError, match=r"\[2, 2\] does not .* expected the batch \[2\] followed by each dimension"):
        Features.read(td, ["x"], "attribution")
    td["attribution", "x"] = torch.zeros(2, 3)
    with pytest.raises(KeyError, match="baseline dict has no entry for input 'x'"):
        Features.read(td, ["x"], "attribution").baselines({"z": 0.0})
    with pytest.raises(ValueError, match="in_keys is empty"):
        explained_keys([], ["x"])


def test_inputs_and_attributions_that_require_grad_give_scores_that_do_not():
    """Attributions a caller computed with autograd, still in its graph: they are read out of it, so the scores
    built from them carry no graph (the correlation of faithfulness_correlation did)."""
    from tdhook.metrics import faithfulness_correlation

    net = torch.nn.Linear(6, 2).double()
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    td = TensorDict(x=x, attribution=TensorDict(x=2 * x), batch_size=[3])
    features = Features.read(td, ["x"], "attribution")
    assert not features.values.requires_grad and not features.inputs[0].requires_grad
    correlation = faithfulness_correlation(net, td, n_runs=4, subset_size=2, seed=0, in_keys=["x"], out_keys=["y"])
    assert not correlation.requires_grad


@pytest.mark.parametrize("metric", ["pixel_flipping", "region_perturbation", "action_fidelity"])
def test_an_attribution_holding_nan_is_refused_where_features_are_ranked(metric):
    """NaN has no rank: a descending sort put it first (Quantus' ``argsort(-a)`` puts it last), so the curve was
    the one of an order the attribution does not give."""
    from tdhook import metrics

    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(32, 3)).double()
    x, a = torch.randn(2, 2, 4, 4, dtype=torch.float64), torch.randn(2, 2, 4, 4, dtype=torch.float64)
    a[1, 0, 2, 3] = float("nan")
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[2])
    kwargs = {"region_perturbation": dict(patch_size=2), "action_fidelity": dict(k=2)}.get(metric, {})
    with pytest.raises(
        ValueError, match=rf"{metric}: attribution \('attribution', 'x'\) holds NaN \(at \(1, 0, 2, 3\)\)"
    ):
        getattr(metrics, metric)(net, td, in_keys=["x"], out_keys=["y"], **kwargs)


def test_infinities_of_both_signs_are_ranked_not_refused_as_nan():
    """The NaN check first looks at the attribution's sum, which is NaN too where +inf and -inf meet: such an
    attribution holds no NaN, and its infinities are ranked first and last."""
    from tdhook.metrics import pixel_flipping

    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(8, 3))
    x, a = torch.randn(2, 2, 2, 2), torch.randn(2, 2, 2, 2)
    a[:, 0, 0, 0], a[:, 1, 1, 1] = float("-inf"), float("inf")
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[2])
    features = Features.read(td, ["x"], "attribution")
    assert bool(features.values.sum(-1).isnan().all())
    features.refuse_nan("pixel_flipping")  # no error
    assert sort_positions(features.values)[:, [0, 7]].tolist() == [[7, 0], [7, 0]]
    curve = pixel_flipping(net, td, in_keys=["x"], out_keys=["y"], features_per_step=7)
    target = net(x).argmax(-1)
    last = net(torch.where(torch.arange(8).view(1, 2, 2, 2) == 0, x, 0.0))[torch.arange(2), target]
    torch.testing.assert_close(curve[:, 1], last, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("metric", ["pixel_flipping", "faithfulness_correlation", "action_fidelity"])
def test_a_baseline_shaped_like_the_batch_is_refused_as_ambiguous(metric):
    """A per-sample value of shape ``[B]`` (``x.min(1).values``) broadcasts, by torch's rule, along the input's last
    dimension: one value per feature, silently, where that dimension has B entries. Refused, naming the key and the
    unambiguous forms."""
    from tdhook import metrics

    net = torch.nn.Linear(3, 2).double()
    x = torch.randn(3, 3, dtype=torch.float64)
    td = TensorDict(x=x, attribution=TensorDict(x=torch.randn(3, 3, dtype=torch.float64)), batch_size=[3])
    kwargs = {"faithfulness_correlation": dict(n_runs=2, subset_size=2, seed=0), "action_fidelity": dict(k=1)}
    kwargs = dict(in_keys=["x"], out_keys=["y"], relevance_key="attribution", **kwargs.get(metric, {}))
    with pytest.raises(
        ValueError,
        match=r"baseline of shape \[3\] for input 'x' of shape \[3, 3\] has the batch's"
        r" shape.*\.view\(3, 1\).*\.view\(1, 3\)",
    ):
        getattr(metrics, metric)(net, td, baseline=x.min(1).values, **kwargs)
    getattr(metrics, metric)(net, td, baseline=x.min(1).values.view(3, 1), **kwargs)


def test_a_per_sample_baseline_goes_to_each_sample():
    # The curve against a brute force: the top k features of each sample set to that sample's minimum.
    from tdhook.metrics import pixel_flipping

    net = torch.nn.Linear(4, 2).double()
    x, a = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[3])
    low = x.min(1).values.view(3, 1)
    curve = pixel_flipping(net, td, in_keys=["x"], out_keys=["y"], relevance_key="attribution", baseline=low)
    order, target = a.argsort(1, descending=True), net(x).argmax(1, keepdim=True)
    for k in range(5):
        perturbed = x.clone()
        for i in range(3):
            perturbed[i, order[i, :k]] = low[i, 0]
        torch.testing.assert_close(curve[:, k], net(perturbed).gather(1, target).squeeze(1).detach())


def test_an_attribution_per_unit_is_read_with_its_unit_dimension_and_named_otherwise():
    """A method with ``target="all"`` writes ``batch + [units] + input``: the metrics that compare explanations read
    it so; the others refuse it, saying what the extra dimension is."""
    x, a = torch.randn(2, 3), torch.randn(2, 4, 3)
    td = TensorDict(x=x, attribution=TensorDict(x=a, batch_size=[2]), batch_size=[2])
    assert Features.read(td, ["x"], "attribution", unit_dims=1).attributions[0] is not None
    with pytest.raises(ValueError, match=r"of shape \[2, 4, 3\] .* or 1 \(one dimension more than the input: .*"):
        Features.read(td, ["x"], "attribution")
    td["attribution", "x"] = torch.randn(2, 3)
    with pytest.raises(ValueError, match=r"expected the batch \[2\] and the explained units' dimensions followed"):
        Features.read(td, ["x"], "attribution", unit_dims=1)


@pytest.mark.parametrize(
    "relevance_key", [("attribution", 0), ["attribution"], 3], ids=["tuple-with-int", "list", "int"]
)
def test_a_relevance_key_that_is_no_key_is_named(relevance_key):
    """``("attribution", 0)`` was read as ``"attribution"`` (tensordict drops a number inside a tuple)."""
    net = torch.nn.Linear(6, 3).double()
    td = TensorDict(x=torch.randn(4, 6, dtype=torch.float64), batch_size=[4])
    td["attribution"] = TensorDict(x=torch.randn(4, 6, dtype=torch.float64), batch_size=[4])
    with pytest.raises(TypeError, match=r"^metrics: relevance_key must be a key \(a str or a tuple of str\)"):
        pixel_flipping(net, td, in_keys=["x"], out_keys=["y"], relevance_key=relevance_key)
