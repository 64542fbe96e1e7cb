"""The layer norm rule's gradient from a fused layer norm's saved scale by torch's kernel, against its closed form."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tdhook.attribution.rules import _layer_norm_gradient
from tdhook.attribution.rules._layer_norm_gradient import layer_norm_rule_gradient


@pytest.mark.parametrize("shape, normalized", [((2, 7, 32), (32,)), ((3, 4, 5), (4, 5)), ((6,), (6,))])
@pytest.mark.parametrize("affine", [True, False])
def test_equals_the_centred_product(shape: tuple, normalized: tuple, affine: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(normalized, dtype=torch.float64) if affine else None
    node = F.layer_norm(x, normalized, weight, None).grad_fn
    rstd = node._saved_result2
    grad = torch.randn(shape, dtype=torch.float64)
    reduce = tuple(range(-len(normalized), 0))
    h = grad * rstd * (1 if weight is None else weight)
    (got,) = layer_norm_rule_gradient(normalized, rstd, weight, grad)
    torch.testing.assert_close(got, h - h.mean(reduce, keepdim=True), rtol=1e-12, atol=1e-14)
    (twice,) = layer_norm_rule_gradient(normalized, rstd, weight, grad)  # the kept zeros stay zeros
    assert torch.equal(got, twice)


def test_a_transposed_gradient() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    node = F.layer_norm(x, (8,)).grad_fn
    grad = torch.randn(8, 4, dtype=torch.float64).t()
    h = grad * node._saved_result2
    (got,) = layer_norm_rule_gradient((8,), node._saved_result2, None, grad)
    torch.testing.assert_close(got, h - h.mean(-1, keepdim=True), rtol=1e-12, atol=1e-14)


def test_kept_zeros_are_few_and_small() -> None:
    _layer_norm_gradient._zeros.clear()
    rstd = torch.ones(1, 1)
    for n in range(1, 12):
        layer_norm_rule_gradient((n,), rstd, None, torch.randn(1, n))
    assert 0 < len(_layer_norm_gradient._zeros) <= 8
    _layer_norm_gradient._zeros.clear()
    large = 1 << 17
    layer_norm_rule_gradient((large,), rstd, None, torch.randn(1, large))
    assert not _layer_norm_gradient._zeros
