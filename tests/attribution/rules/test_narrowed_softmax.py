"""A softmax computed in a narrower dtype than its logits, where the mask's lowest value becomes -inf: refused where
a row's weights turn NaN, left alone otherwise."""

from __future__ import annotations

import pytest
import torch

from tdhook.attribution.rules._narrowed_softmax import raise_for_unseen_rows

F64 = torch.float64


def scores_with_unseen_row(dtype: torch.dtype) -> torch.Tensor:
    """Two samples × three queries × four keys, causal; the first sample's first query sees no key (left padding)."""
    lowest = torch.finfo(dtype).min
    scores = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0), dtype=F64).to(dtype)
    scores = scores.masked_fill(torch.ones(3, 4, dtype=torch.bool).triu(2), lowest)
    scores[0, 0] = lowest
    return scores


@pytest.mark.parametrize("wide, narrow", [(F64, torch.float32), (F64, torch.float16), (torch.float32, torch.float16)])
def test_a_row_the_cast_turns_to_minus_infinity_is_refused(wide: torch.dtype, narrow: torch.dtype):
    scores = scores_with_unseen_row(wide)
    weights = torch.softmax(scores, -1, dtype=narrow)
    assert weights[0, 0].isnan().all() and weights[1:].isfinite().all()  # what the refusal is about
    name = str(wide).removeprefix("torch.")
    with pytest.raises(FloatingPointError, match=rf"over {name} scores in .*left padding: 1 such rows.*\(0, 0\)"):
        raise_for_unseen_rows(scores, weights, -1)


def test_finite_weights_a_wider_dtype_and_the_models_own_infinities_pass():
    scores = scores_with_unseen_row(F64)
    seen = scores.clone()
    seen[0, 0, 0] = 0.5  # the padded query sees one key
    # the same dtype, or a wider one: the lowest value stays finite, the weights too
    low = scores_with_unseen_row(torch.float32)
    for logits, dtype in ((seen, torch.float32), (scores, None), (low, F64)):
        weights = torch.softmax(logits, -1, dtype=dtype)
        assert weights.isfinite().all()
        raise_for_unseen_rows(logits, weights, -1)
    # a row the model itself fills with -inf: its own choice (it may clean the NaN it gets), not the cast's
    own = scores.masked_fill(scores <= torch.finfo(F64).min, float("-inf"))
    weights = torch.softmax(own, -1, dtype=torch.float32)
    assert weights[0, 0].isnan().all()
    raise_for_unseen_rows(own, weights, -1)
