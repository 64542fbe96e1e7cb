"""Straight-through estimators (``x + (y - x).detach()``) are named: the relevance follows x, not the value y; and
so are gradient scalings (``x * s + x.detach() * (1 - s)``): the relevance is s times the model's without it."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import CPLRP, LRP, AttnLRP, BaseRuleMapper, EpsilonPlus
from tdhook.attribution._cut_signals import CUT_SIGNAL

F64 = torch.float64


def _onehot(p: torch.Tensor) -> torch.Tensor:
    return F.one_hot(p.argmax(-1), p.shape[-1]).to(p.dtype)


def _in_place(p: torch.Tensor) -> torch.Tensor:
    p += (_onehot(p) - p).detach()
    return p


# The estimators as models write them: ``p`` the soft activation, the value the next layer reads is the hard one.
ESTIMATORS = {
    "p + (onehot - p).detach()": lambda p: p + (_onehot(p) - p).detach(),
    "(onehot - p).detach() + p": lambda p: (_onehot(p) - p).detach() + p,
    "p - (p - onehot).detach()": lambda p: p - (p - _onehot(p)).detach(),
    "onehot - p.detach() + p": lambda p: _onehot(p) - p.detach() + p,  # F.gumbel_softmax(hard=True) as written
    "torch.add(p, (onehot - p).detach())": lambda p: torch.add(p, torch.sub(_onehot(p), p).detach()),
    "p += (onehot - p).detach()": lambda p: _in_place(p.clone()),
}


class StraightThrough(nn.Module):
    """A discrete latent: a softmax, its one-hot passed on with the softmax's gradient, then a head."""

    def __init__(self, estimator) -> None:
        super().__init__()
        self.a, self.b, self.estimator = nn.Linear(4, 6, bias=False), nn.Linear(6, 3, bias=False), estimator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.estimator(self.a(x).softmax(-1)))


class Quantised(nn.Module):
    """A vector-quantised code: the nearest codebook entry, passed on with the encoder's gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.decoder = nn.Linear(4, 3, bias=False), nn.Linear(3, 2, bias=False)
        self.codebook = nn.Parameter(torch.randn(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.encoder(x)
        q = self.codebook[torch.cdist(z, self.codebook).argmin(-1)]
        return self.decoder(z + (q - z).detach())


def _explain(model: nn.Module, mapper) -> tuple[LRP, torch.Tensor, TensorDict]:
    torch.manual_seed(1)
    td = TensorDict(x=torch.randn(5, 4, dtype=F64), batch_size=[5])
    lrp = LRP(model, mapper, in_keys=["x"], out_keys=["y"])
    return lrp, td["x"], lrp(td)


class TestStraightThrough:
    @pytest.mark.parametrize("name", sorted(ESTIMATORS))
    def test_a_straight_through_estimator_is_named(self, name: str):
        """``p + (onehot - p).detach()`` passed AttnLRP's relevance through p, not the one-hot the head reads: the
        input relevance summed to -0.088 where the explained logits summed to -0.42, with no word. The first call
        warns, naming the module; coverage() lists it, and a strict mapper refuses it."""
        torch.manual_seed(0)
        model = StraightThrough(ESTIMATORS[name]).double()
        with pytest.warns(UserWarning, match=r"the model itself \(StraightThrough\) adds a detached difference"):
            lrp, _, _ = _explain(model, AttnLRP())
        assert [c.function for c in lrp.coverage().plain_gradient] == [
            "a straight-through estimator (x + (y - x).detach())"
        ]
        with pytest.raises(ValueError, match=r"straight-through estimator.*relevance passed back is that of"):
            _explain(model, AttnLRP(strict=True))

    @pytest.mark.parametrize("preset", [EpsilonPlus, AttnLRP, CPLRP], ids=lambda p: p.__name__)
    def test_a_quantised_code_is_named(self, preset):
        torch.manual_seed(0)
        with pytest.warns(UserWarning, match=r"\(Quantised\) adds a detached difference back to an activation"):
            _explain(Quantised().double(), preset())

    DETACHED_BUT_NO_ESTIMATOR = {
        "a detached copy: h + h.detach()": lambda h: h + h.detach(),
        "a difference without a detach: h + (relu(h) - h)": lambda h: h + (torch.relu(h) - h),
        "a scaled detached copy: h * 0.5 + h.detach()": lambda h: h * 0.5 + h.detach(),
        "a scale detached for a norm": lambda h: h / h.std(-1, keepdim=True).detach(),
    }
    # Parts of the signal computed without gradient and added back: named apart (tests/attribution/test_cut_signals.py).
    CUT_PARTS = {
        "a detached branch as a bias: h + f(h).detach()": lambda h: h + torch.relu(h).detach(),
        "statistics detached for a norm": lambda h: (
            (h - h.mean(-1, keepdim=True).detach()) / h.std(-1, keepdim=True).detach()
        ),
        "another activation's difference: h + (relu(h) - g).detach()": lambda h: h + (torch.relu(h) - 2 * h).detach(),
    }

    @pytest.mark.parametrize("name", sorted(CUT_PARTS))
    def test_a_detached_part_of_another_activation_is_named_as_such_and_not_as_an_estimator(self, name: str):
        torch.manual_seed(0)
        model = StraightThrough(self.CUT_PARTS[name]).double()
        with pytest.warns(UserWarning, match="adds back to the signal a part it computed from the explained inputs"):
            lrp, _, _ = _explain(model, AttnLRP())
        assert [call.function for call in lrp.coverage().plain_gradient] == [CUT_SIGNAL]

    @pytest.mark.parametrize("name", sorted(DETACHED_BUT_NO_ESTIMATOR))
    def test_a_detach_that_is_no_estimator_is_not_named(self, name: str):
        torch.manual_seed(0)
        model = StraightThrough(self.DETACHED_BUT_NO_ESTIMATOR[name]).double()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            lrp, _, _ = _explain(model, AttnLRP(strict=True))
        assert lrp.coverage().plain_gradient == ()

    def test_no_mark_outlives_the_watched_call(self):
        """The marks the first call's watch puts on tensors come off with it: an output the model returns keeps no
        reference to the activations it was computed from."""

        class Difference(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.a = nn.Linear(4, 3, bias=False)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                h = self.a(x)
                return h * h.detach().mean()

        model, returned = Difference().double(), []
        model.register_forward_hook(lambda module, args, output: returned.append(output))
        lrp, _, _ = _explain(model, AttnLRP())
        assert lrp.coverage().plain_gradient == ()
        assert [output.__dict__ for output in returned] == [{}]

    def test_a_transformer_is_not_named(self):
        """AttnLRP's own detaches (held attention, norms) are no estimator."""
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0, batch_first=True).double().eval()
        td = TensorDict(x=torch.randn(2, 3, 4, dtype=F64), batch_size=[2])
        for preset in (AttnLRP, CPLRP):
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                LRP(layer, preset(strict=True), in_keys=["x"], out_keys=["y"])(td.clone())


# MuZero's scale_gradient as world models write it (``s`` a number or a one-element tensor): the value x, the gradient
# s times x's.
SCALINGS = {
    "x * s + x.detach() * (1 - s)": lambda x: x * 0.25 + x.detach() * (1 - 0.25),
    "s * x + (1 - s) * x.detach()": lambda x: 0.25 * x + (1 - 0.25) * x.detach(),
    "x.detach() * (1 - s) + x * s, s a tensor": lambda x: (
        x.detach() * (1 - torch.tensor(0.25)) + x * torch.tensor(0.25)
    ),
    "x * s + x.detach() - x.detach() * s": lambda x: x * 0.25 + x.detach() - x.detach() * 0.25,
    "x.div(4) + x.detach().mul(0.75)": lambda x: x.div(4) + x.detach().mul(0.75),
}


class Dynamics(nn.Module):
    """A world model's step: an encoder, the gradient of its state scaled, and a head."""

    def __init__(self, scaling) -> None:
        super().__init__()
        self.encoder, self.head, self.scaling = nn.Linear(4, 6, bias=False), nn.Linear(6, 3, bias=False), scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.scaling(torch.relu(self.encoder(x))))


class TestGradientScaling:
    @pytest.mark.parametrize("name", sorted(SCALINGS))
    def test_a_gradient_scaling_is_named(self, name: str):
        """``x * s + x.detach() * (1 - s)`` with s = 0.25 passed a quarter of the relevance back (LRP-0 and
        EpsilonPlus 0.75 off, relative L2, the model without it), with no word. The first call warns, naming the
        module and the scaling; coverage() lists it, and a strict mapper refuses it."""
        torch.manual_seed(0)
        model = Dynamics(SCALINGS[name]).double()
        with pytest.warns(UserWarning, match=r"the model itself \(Dynamics\) scales the gradient through an activat"):
            lrp, _, scaled = _explain(model, BaseRuleMapper())
        assert [c.function for c in lrp.coverage().plain_gradient] == [
            "a gradient scaling (x * s + x.detach() * (1 - s))"
        ]
        model.scaling = lambda x: x
        _, _, plain = _explain(model, BaseRuleMapper())
        torch.testing.assert_close(scaled["relevance", "x"], 0.25 * plain["relevance", "x"])  # what the warning says
        model.scaling = SCALINGS[name]
        with pytest.raises(ValueError, match=r"scales the gradient through an activation"):
            _explain(model, AttnLRP(strict=True))


def _written_into_a_copy(z: torch.Tensor, q: torch.Tensor, write) -> torch.Tensor:
    y = z.clone()
    write(y)
    return y


def _negated_copy(z: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    y = torch.clone(z)
    y.neg_()  # a write the marks do not follow: ``y`` no longer holds ``z``
    y += (q - z).detach()
    return y


# A codebook's straight-through estimator written into a copy of the code, each with the out-of-place form it computes.
IN_PLACE_FORMS = {
    "y = z.clone(); y += (q - z).detach()": (
        lambda z, q: _written_into_a_copy(z, q, lambda y: y.__iadd__((q - z).detach())),
        lambda z, q: z + (q - z).detach(),
    ),
    "y = z.clone(); y.add_((q - z).detach())": (
        lambda z, q: _written_into_a_copy(z, q, lambda y: y.add_((q - z).detach())),
        lambda z, q: z + (q - z).detach(),
    ),
    "y = torch.clone(z); y.sub_((z - q).detach())": (
        lambda z, q: _written_into_a_copy(torch.clone(z), q, lambda y: y.sub_((z - q).detach())),
        lambda z, q: z - (z - q).detach(),
    ),
    "y = z.clone(memory_format=...); y -= (z - q).detach()": (
        lambda z, q: _written_into_a_copy(
            z.clone(memory_format=torch.contiguous_format), q, lambda y: y.__isub__((z - q).detach())
        ),
        lambda z, q: z - (z - q).detach(),
    ),
    "y = z.clone(); y.neg_(); y += (q - z).detach() (no estimator)": (
        _negated_copy,
        lambda z, q: torch.neg(z) + (q - z).detach(),
    ),
}


class Coded(nn.Module):
    """A vector-quantised code behind a tanh, the estimator given as a function of the code and its codebook entry."""

    def __init__(self, estimator) -> None:
        super().__init__()
        self.encoder, self.decoder = nn.Linear(4, 3, bias=False), nn.Linear(3, 2, bias=False)
        self.codebook = nn.Parameter(torch.randn(8, 3))
        self.estimator = estimator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.tanh(self.encoder(x))
        return self.decoder(self.estimator(z, self.codebook[torch.cdist(z, self.codebook).argmin(-1)]))


class TestWrittenInPlace:
    @pytest.mark.parametrize("preset", [EpsilonPlus, AttnLRP, CPLRP], ids=lambda p: p.__name__)
    @pytest.mark.parametrize("name", sorted(IN_PLACE_FORMS))
    def test_an_estimator_written_into_a_copy_is_named_as_its_out_of_place_form(self, name: str, preset):
        """``y = z.clone(); y += (q - z).detach()`` went unnamed where ``z + (q - z).detach()`` was named (the same
        relevance, through ``z`` alone, with no word): the copy holds what ``z`` holds. A write the marks do not follow
        (``y.neg_()``) leaves the copy no estimator, as ``torch.neg(z) + (q - z).detach()`` is none."""
        in_place, out_of_place = IN_PLACE_FORMS[name]
        found = {}
        for form, estimator in (("in place", in_place), ("out of place", out_of_place)):
            torch.manual_seed(0)
            model = Coded(estimator).double()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                lrp, _, explained = _explain(model, preset())
            found[form] = (
                [c.function for c in lrp.coverage().plain_gradient],
                sorted(str(w.message) for w in caught),
                explained["relevance", "x"],
            )
        calls, messages, relevance = found["in place"]
        assert (calls, messages) == found["out of place"][:2]
        torch.testing.assert_close(relevance, found["out of place"][2], rtol=1e-12, atol=1e-12)
        estimator = "a straight-through estimator (x + (y - x).detach())"
        assert (estimator in calls) == ("no estimator" not in name)
