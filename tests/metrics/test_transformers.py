"""The metrics on a tiny BERT wrapped as a user wraps it: ``inputs_embeds`` perturbed, the padded attention mask and
the token types left fixed. The perturbed copies the metrics stack carry those keys with them: each sample's scores
equal those of the sample alone, by the metric's definition."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from tdhook.attribution import Saliency
from tdhook.metrics import pixel_flipping, sensitivity_max
from tests.attribution.methods._transformers import TOKENS, classifier, classifier_td


def test_pixel_flipping_of_tokens_equals_its_definition_for_each_padded_sample_alone():
    """Per-token attributions ``[B, T, 1]``: a token goes to the zero embedding at each step, padding included."""
    module, td = classifier(), classifier_td()
    tokens = torch.randn(3, TOKENS, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    td["attribution", "embeds"] = tokens
    curve = pixel_flipping(module, td, in_keys=["embeds"])
    forward = module.module
    expected = torch.zeros(3, TOKENS + 1, dtype=torch.float64)
    with torch.no_grad():
        for i in range(3):
            embeds, args = td["embeds"][i : i + 1].clone(), (td["mask"][i : i + 1], td["token_types"][i : i + 1])
            target = forward(embeds, *args).argmax(-1)
            order = sorted(range(TOKENS), key=lambda t: (-tokens[i, t, 0].item(), t))
            for step in range(TOKENS + 1):
                embeds[0, order[:step]] = 0.0
                expected[i, step] = forward(embeds, *args)[0, target]
    torch.testing.assert_close(curve, expected, rtol=0, atol=1e-12)


def test_sensitivity_max_equals_its_definition_for_each_padded_sample_alone():
    module, td = classifier(), classifier_td()
    noise = torch.rand(3, 4, TOKENS, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * 0.1 - 0.05
    saliency = Saliency(module, in_keys=["embeds"])
    found = sensitivity_max(
        saliency,
        td,
        perturb_fn=lambda repeated, radius: repeated + TensorDict(embeds=noise, batch_size=[3, 4]),
        n_perturb_samples=4,
    )
    expected = torch.zeros(3, dtype=torch.float64)
    for i in range(3):
        sample = td[i : i + 1]
        reference = saliency(sample.clone())["attribution", "embeds"]
        saliency.target = module(sample.clone())["logits"].argmax(-1)  # held at the unperturbed argmax
        for k in range(4):
            moved = sample.clone()
            moved["embeds"] = moved["embeds"] + noise[i, k]
            change = (saliency(moved)["attribution", "embeds"] - reference).norm() / reference.norm()
            expected[i] = max(expected[i], change)
        saliency.target = None
    torch.testing.assert_close(found, expected, rtol=1e-12, atol=1e-15)
