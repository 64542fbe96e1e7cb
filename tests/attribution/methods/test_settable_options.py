"""Options set on a method after it is built: checked and read as the constructor checks and reads them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from tdhook.attribution import (
    FeatureAblation,
    GradCAM,
    GradientShap,
    IntegratedGradients,
    Occlusion,
    Saliency,
    ShapleyValueSampling,
    SmoothGrad,
)
from tests.attribution.methods._models import small_cnn

KEYS = {"in_keys": ["image"], "out_keys": ["logits"]}

# Per method: how to build it, an option, and a value its constructor refuses.
REFUSED = {
    "SmoothGrad nt_type": (lambda net: SmoothGrad(net, **KEYS, seed=0), "nt_type", "vargrad_sq"),
    "SmoothGrad n_samples": (lambda net: SmoothGrad(net, **KEYS, seed=0), "n_samples", 0),
    "SmoothGrad abs": (lambda net: SmoothGrad(net, **KEYS, seed=0), "abs", "False"),
    "SmoothGrad internal_batch_size": (lambda net: SmoothGrad(net, **KEYS, seed=0), "internal_batch_size", 0),
    "GradientShap n_samples": (
        lambda net: GradientShap(net, **KEYS, baselines=torch.zeros(2, 3, 8, 8), seed=0),
        "n_samples",
        0,
    ),
    "IntegratedGradients internal_batch_size": (
        lambda net: IntegratedGradients(net, **KEYS),
        "internal_batch_size",
        -1,
    ),
    "Occlusion perturbations_per_eval": (
        lambda net: Occlusion(net, **KEYS, sliding_window_shapes=(3, 2, 2)),
        "perturbations_per_eval",
        0,
    ),
    "FeatureAblation perturbations_per_eval": (lambda net: FeatureAblation(net, **KEYS), "perturbations_per_eval", 0),
    "ShapleyValueSampling n_samples": (lambda net: ShapleyValueSampling(net, **KEYS, seed=0), "n_samples", 0),
    "Saliency abs": (lambda net: Saliency(net, **KEYS), "abs", 1),
    "GradCAM relu": (lambda net: GradCAM(net, layer="3", **KEYS), "relu", "yes"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_value_the_constructor_refuses_is_refused_when_set(case):
    """An option set after construction ran unchecked: ``smooth.nt_type = "vargrad_sq"`` gave an attribution of
    zeros with no word, ``n_samples = 0`` or ``perturbations_per_eval = 0`` failed in ``range()``, a string taken
    for a flag was read by its truth. The value is refused as the constructor refuses it, naming the method and
    the option, and the option is left as it was."""
    make, name, value = REFUSED[case]
    method = make(small_cnn())
    before = getattr(method, name)
    with pytest.raises((ValueError, TypeError), match=rf"{type(method).__name__}: {name}"):
        setattr(method, name, value)
    assert getattr(method, name) == before


def test_a_value_set_holds_for_the_next_call():
    net = small_cnn()
    td = TensorDict(image=torch.randn(2, 3, 8, 8, dtype=torch.float64), batch_size=[2])
    smooth = SmoothGrad(net, **KEYS, n_samples=4, stdev=0.2, seed=0)
    smooth.nt_type, smooth.n_samples = "vargrad", 6
    expected = SmoothGrad(net, **KEYS, n_samples=6, stdev=0.2, seed=0, nt_type="vargrad")(td.clone())
    got = smooth(td.clone())
    torch.testing.assert_close(got["attribution", "image"], expected["attribution", "image"], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["relevance_key", "target_key"])
def test_the_keys_it_writes_are_fixed(name):
    """``saliency.relevance_key = "saliency"`` changed nothing the calls did (the attribution was still written at
    ``("attribution", key)``), with no word: the keys a wrapper reads and writes are fixed when it is built."""
    saliency = Saliency(small_cnn(), **KEYS)
    before = getattr(saliency, name)
    with pytest.raises(AttributeError, match=rf"Saliency: {name} is fixed when the wrapper is built; build a new"):
        setattr(saliency, name, "other")
    assert getattr(saliency, name) == before


def test_a_refused_value_is_not_recorded_for_set_kwargs():
    """The record ``set_kwargs`` and ``explain_offline`` read took a value set as an attribute before the attribute
    checked it: a refused ``n_samples`` would have been built anew by the next ``set_kwargs``."""
    from tdhook.attribution.tunables import _ARGUMENTS

    smooth = SmoothGrad(small_cnn(), **KEYS, n_samples=4, seed=0)
    with pytest.raises(ValueError, match="SmoothGrad: n_samples must be a positive int, got 0"):
        smooth.n_samples = 0
    assert smooth.__dict__[_ARGUMENTS]["n_samples"] == 4
    assert smooth.set_kwargs(stdev=0.5).n_samples == 4


# Per method taking a seed: how to build it with the seed given as keywords.
SEEDED = {
    "SmoothGrad": lambda net, **seed: SmoothGrad(net, **KEYS, n_samples=3, stdev=0.2, **seed),
    "GradientShap": lambda net, **seed: GradientShap(
        net, **KEYS, baselines=torch.zeros(2, 3, 8, 8, dtype=torch.float64), n_samples=3, **seed
    ),
    "ShapleyValueSampling": lambda net, **seed: ShapleyValueSampling(net, **KEYS, n_samples=2, **seed),
}


@pytest.mark.parametrize("method", sorted(SEEDED))
@pytest.mark.parametrize("seed", ["0", 1.5, True, 2**64, -(2**63) - 1])
def test_a_seed_that_is_no_int_is_refused_by_name(method, seed):
    """A seed that is no int torch's generators take ran, or failed at the call with a message that named no option:
    ``seed="0"`` with Python's "invalid literal for int()", ``seed=1.5`` drew as ``seed=1`` (1.2 and 1.7 the same
    draws, with no word), ``seed=2**64`` with torch's "Overflow when unpacking long". It is refused where it is given,
    to the constructor or set later, naming the method and the option; the option is left as it was."""
    make = SEEDED[method]
    with pytest.raises(ValueError, match=rf"{method}: seed must be None or an int in \[-2\*\*63, 2\*\*64\)"):
        make(small_cnn(), seed=seed)
    built = make(small_cnn(), seed=0)
    with pytest.raises(ValueError, match=rf"{method}: seed must be None or an int"):
        built.seed = seed
    assert built.seed == 0


@pytest.mark.parametrize("method", sorted(SEEDED))
def test_a_numpy_integer_seed_draws_as_the_same_int(method):
    net = small_cnn()
    td = TensorDict(image=torch.randn(2, 3, 8, 8, dtype=torch.float64), batch_size=[2])
    expected = SEEDED[method](net, seed=3)(td.clone())["attribution", "image"]
    built = SEEDED[method](net, seed=np.int64(3))
    assert type(built.seed) is int
    got = built(td.clone())["attribution", "image"]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
