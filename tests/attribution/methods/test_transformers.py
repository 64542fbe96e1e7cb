"""The methods on tiny Hugging Face transformers wrapped as a user wraps them, against captum (float64).

``inputs_embeds`` is explained with the keys that steer the model left fixed: an attention mask with real padding
(right-padded for BERT, left-padded with position ids for a Llama explained at its last position), token types.
The perturbed copies the methods stack along the batch carry those keys with them: every method equals captum with
the same ``additional_forward_args``, padded positions included, and each sample's attribution equals that of the
sample alone. Eager and sdpa attention give the same attributions.
"""

from __future__ import annotations

import warnings

import captum.attr
import pytest
import torch

from tdhook.attribution.methods._quadrature import quadrature
from tests.attribution.methods._transformers import (
    HIDDEN,
    TOKENS,
    classifier,
    classifier_td,
    next_token,
    next_token_td,
)
from tests.attribution.methods.test_base import METHODS
from tests.conftest import relative_error

TOKEN_GROUPS = torch.arange(TOKENS).view(TOKENS, 1).expand(TOKENS, HIDDEN)  # each token one group
HALVES = TOKEN_GROUPS.div(TOKENS // 2, rounding_mode="floor").contiguous()  # tokens 0 to 2, and 3 to 5


def integrated_gradients(forward, x, args, target, n):
    """Σₖ wₖ ∇F(αₖ x) · x from captum's saliency at the Gauss–Legendre points (float64 weights)."""
    alphas, weights = quadrature("gausslegendre", n)
    saliency = captum.attr.Saliency(forward)
    total = sum(
        w * saliency.attribute(a.item() * x, target=target, additional_forward_args=args, abs=False)
        for a, w in zip(alphas, weights, strict=True)
    )
    return total * x


# name -> (the method's keywords, captum's attribution of (forward, x, args, target))
CASES = {
    "Saliency": (
        {},
        lambda f, x, a, t: captum.attr.Saliency(f).attribute(x, t, abs=True, additional_forward_args=a),
    ),
    "InputXGradient": ({}, lambda f, x, a, t: captum.attr.InputXGradient(f).attribute(x, t, a)),
    "GuidedBackprop": ({}, lambda f, x, a, t: captum.attr.GuidedBackprop(f).attribute(x, t, a)),
    "IntegratedGradients": (
        {"n_steps": 5},
        lambda f, x, a, t: integrated_gradients(f, x, a, t, 5),
    ),
    "SmoothGrad": (  # no noise: saliency at copies of the input, stacked in one pass
        {"n_samples": 2, "stdev": 0.0},
        lambda f, x, a, t: captum.attr.Saliency(f).attribute(x, t, abs=True, additional_forward_args=a),
    ),
    "FeatureAblation": (
        {"feature_masks": TOKEN_GROUPS, "perturbations_per_eval": 3},
        lambda f, x, a, t: captum.attr.FeatureAblation(f).attribute(
            x, target=t, additional_forward_args=a, feature_mask=TOKEN_GROUPS[None], perturbations_per_eval=3
        ),
    ),
    "Occlusion": (
        {"sliding_window_shapes": (2, HIDDEN), "strides": (1, HIDDEN), "perturbations_per_eval": 2},
        lambda f, x, a, t: captum.attr.Occlusion(f).attribute(
            x, (2, HIDDEN), (1, HIDDEN), target=t, additional_forward_args=a, perturbations_per_eval=2
        ),
    ),
    "ShapleyValueSampling": (  # 2 groups, every order: the Shapley values
        {"feature_masks": HALVES, "n_samples": 2, "perturbations_per_eval": 2},
        lambda f, x, a, t: captum.attr.ShapleyValues(f).attribute(
            x, target=t, additional_forward_args=a, feature_mask=HALVES[None], perturbations_per_eval=2
        ),
    ),
}
# captum's occlusion divides by its window counts in float32, and its Shapley values are float32.
TOLERANCE = {"Occlusion": 1e-7, "ShapleyValueSampling": 1e-7}


def method(name, module, target):
    return METHODS[name][0](module, in_keys=["embeds"], target=target, **CASES[name][0])


@pytest.mark.parametrize("name", list(CASES))
def test_a_padded_classifier_equals_captum_and_each_sample_alone(name):
    """BERT with token types and right padding; the padded positions get what captum gives them."""
    module, td = classifier(), classifier_td()
    forward, args = module.module, (td["mask"], td["token_types"])
    target = torch.tensor([0, 2, 1])
    found = method(name, module, target)(td.clone())["attribution", "embeds"]
    expected = CASES[name][1](forward, td["embeds"], args, target).detach()
    assert relative_error(found, expected) <= TOLERANCE.get(name, 1e-12)
    alone = torch.cat(
        [method(name, module, target[i : i + 1])(td[i : i + 1].clone())["attribution", "embeds"] for i in range(3)]
    )
    assert relative_error(found, alone) <= 1e-12


@pytest.mark.parametrize("name", ["Saliency", "IntegratedGradients", "FeatureAblation", "Occlusion"])
def test_a_left_padded_causal_lm_at_its_last_position_in_eager_and_sdpa_attention(name):
    """A Llama explained at its last position, left-padded with the position ids that skip the padding (float32:
    in float64, transformers' eager attention gives NaN logits to left-padded samples). Eager and sdpa attention
    give the same attributions, each sample that of the sample alone."""
    td = next_token_td()
    found = {}
    for implementation in ("eager", "sdpa"):
        module = next_token(implementation)
        with torch.no_grad():
            target = module(td.clone())["y"].argmax(-1)
        found[implementation] = method(name, module, target)(td.clone())["attribution", "embeds"]
        alone = [
            method(name, module, target[i : i + 1])(td[i : i + 1].clone())["attribution", "embeds"] for i in range(3)
        ]
        assert relative_error(found[implementation], torch.cat(alone)) <= 1e-6
    assert relative_error(found["eager"], found["sdpa"]) <= 1e-5


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("name", ["Saliency", "FeatureAblation"])
def test_attention_dropout_in_training_mode_is_warned_of_once(name, implementation):
    """A Llama with attention dropout holds no Dropout module: its attention calls ``F.dropout`` (eager) or passes
    ``dropout_p`` to the fused attention (sdpa). In training mode two calls differed by 1.1 % (Saliency) and 1.4 %
    (FeatureAblation, relative L2) without a word; LRP warned of it. A model in eval mode, or one whose attention
    drops nothing, is not warned of."""
    module, td = next_token(implementation, attention_dropout=0.3), next_token_td()
    cls = METHODS[name][0]
    wrapper = cls(module, in_keys=["embeds"], target=0)
    module.train()
    with pytest.warns(UserWarning, match=rf"{cls.__name__}: the forward pass calls dropout \(p=0.3\) in training mode"):
        wrapper(td.clone())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wrapper(td.clone())  # once per wrapper, as for a Dropout module
        cls(module.eval(), in_keys=["embeds"], target=0)(td.clone())
        module.train().module.model.config.attention_dropout = 0.0
        for layer in module.module.model.model.layers:
            layer.self_attn.attention_dropout = 0.0
        cls(module, in_keys=["embeds"], target=0)(td.clone())
