"""Products of activations where a factor adds a number (``(up + 1) * glu``) are named: the number takes relevance."""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import CPLRP, LRP, AttnLRP

F64 = torch.float64

# Factors as models write them: ``a`` and ``b`` two activations of the input.
OFFSET = {
    "(a + 1) * b": lambda a, b: (a + 1) * b,  # GPT-OSS's experts
    "b * (1.0 + a)": lambda a, b: b * (1.0 + a),  # an adaptive norm's modulation
    "(a - 0.5) * b": lambda a, b: (a - 0.5) * b,
    "b * torch.add(a, 2).view(...)": lambda a, b: b * torch.add(a, 2).view(b.shape),
    "(a + 1) @ b": lambda a, b: ((a + 1).unsqueeze(-1) @ b.unsqueeze(-2)).sum(-1),
    "(1 + sigmoid(a)) * b": lambda a, b: (1 + torch.sigmoid(a)) * b,  # no gate: sigmoid(a) is, 1 + sigmoid(a) not
    "(a + 1) * sigmoid(b)": lambda a, b: (a + 1) * torch.sigmoid(b),  # the gate held: all of it to a + 1
    "relu(a + 1) * b": lambda a, b: torch.relu(a + 1) * b,  # the number behind a clip: it takes its share all the same
    "b * (relu(a + 1) / 2)": lambda a, b: b * (torch.relu(a + 1) / 2),
}
NO_OFFSET = {
    "a * b": lambda a, b: a * b,
    "(a + b) * b": lambda a, b: (a + b) * b,
    "(a + 0) * b": lambda a, b: (a + 0) * b,
    "(a + 1) * 3": lambda a, b: (a + 1) * 3,  # one activation: linear
    "(1 - sigmoid(a)) * b: a held gate": lambda a, b: (1 - torch.sigmoid(a)) * b,
}


class Offset(nn.Module):
    """``out(product(a(x), b(x)))``, bias-free."""

    def __init__(self, product) -> None:
        super().__init__()
        self.a, self.b, self.out = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False), nn.Linear(4, 3)
        self.product = product

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.product(self.a(x), self.b(x))).flatten(1)


def _explain(product, preset) -> tuple[LRP, torch.Tensor, TensorDict]:
    torch.manual_seed(0)
    model = Offset(product).double()
    nn.init.zeros_(model.out.bias)
    lrp = LRP(model, preset, in_keys=["x"], out_keys=["y"])
    x = torch.randn(5, 4, dtype=F64)
    return lrp, model(x), lrp(TensorDict(x=x, batch_size=[5]))


@pytest.mark.parametrize("preset", [AttnLRP, CPLRP], ids=lambda p: p.__name__)
@pytest.mark.parametrize("name", sorted(OFFSET))
def test_a_factor_that_adds_a_number_is_named(name: str, preset):
    """The product's rule gives ``a + 1`` its share of the relevance and the number keeps part of it: the relevance
    does not sum to the logit (GPT-OSS's experts: CP-LRP kept 0.87 of the logit of a tiny model, with biases zeroed
    and no word). The first call warns, naming the module; coverage() lists it, and a strict preset refuses it."""
    with pytest.warns(UserWarning, match=r"the model itself \(Offset\) multiplies activations where a factor adds"):
        lrp, plain, td = _explain(OFFSET[name], preset())
    logit = plain.max(-1).values
    assert ((td["relevance", "x"].flatten(1).sum(1) - logit).abs() / logit.abs()).max() > 1e-3
    assert [c.function for c in lrp.coverage().plain_gradient] == ["a product whose factor adds a number ((a + 1) * b)"]
    with pytest.raises(ValueError, match=r"multiplies activations where a factor adds a constant"):
        _explain(OFFSET[name], preset(strict=True))


@pytest.mark.parametrize("preset", [AttnLRP, CPLRP], ids=lambda p: p.__name__)
@pytest.mark.parametrize("name", sorted(NO_OFFSET))
def test_a_product_without_a_number_in_a_factor_is_not_named(name: str, preset):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lrp, plain, td = _explain(NO_OFFSET[name], preset(strict=True))
    assert lrp.coverage().plain_gradient == ()
    if "+ 1" not in name and "1 +" not in name:  # bias-free and split or held: conserved
        logit = plain.max(-1).values
        assert ((td["relevance", "x"].flatten(1).sum(1) - logit).abs() / logit.abs()).max() <= 1e-10


@pytest.mark.parametrize("name", ["b * relu6(b + 3) / 6", "b * clamp(b + 3, 0, 6) / 6"])
def test_a_hard_swish_written_out_is_named_where_its_clip_is_no_held_gate(name: str):
    """A hard swish written out (``x * relu6(x + 3) / 6``, MobileNetV3's): AttnLRP splits the product between
    ``x`` and the clip, whose number takes a share (0.45 of the logit lost, bias-free, with no word): warned of.
    CP-LRP holds the clip as a gate, giving all of it to ``x``: conserved, and nothing to say."""
    clip = {"b * relu6(b + 3) / 6": nn.functional.relu6, "b * clamp(b + 3, 0, 6) / 6": lambda t: t.clamp(0, 6)}[name]
    product = lambda a, b: b * clip(b + 3) / 6  # noqa: E731
    with pytest.warns(UserWarning, match=r"the model itself \(Offset\) multiplies activations where a factor adds"):
        lrp, plain, td = _explain(product, AttnLRP())
    logit = plain.max(-1).values
    assert ((td["relevance", "x"].flatten(1).sum(1) - logit).abs() / logit.abs()).max() > 0.1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lrp, plain, td = _explain(product, CPLRP(strict=True))
    logit = plain.max(-1).values
    assert ((td["relevance", "x"].flatten(1).sum(1) - logit).abs() / logit.abs()).max() <= 1e-10
