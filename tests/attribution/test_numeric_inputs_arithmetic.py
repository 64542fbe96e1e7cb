"""Integer or boolean inputs that reach a layer through index arithmetic (``a % n``, ``a // 2``, ``torch.remainder``,
``torch.floor_divide``, a rounded ``torch.div``), selections by keyword (``h.masked_fill(mask=m, value=v)``,
``torch.where(condition=c, input=x, other=y)``) and views taken before a write into the tensor they view. A
CartPole-like critic ``Q(obs, action)``, in float64, without biases."""

import re

import pytest
import torch
from tensordict import TensorDict

from tests.attribution.test_numeric_inputs_masks import MaskedCritic, _lost
from tests.attribution.test_numeric_inputs_masks import _explained as explained

F64 = torch.float64


class ArithmeticCritic(MaskedCritic):
    """Q(s, a) of the observation (padded with a fifth feature, doubled: an activation), where the action reaches
    what the first layer takes the way ``how`` says."""

    def forward(self, observation: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        n, how, eye = observation.shape[0], self.how, torch.eye(5, dtype=F64)
        h = torch.cat([observation, observation.new_zeros(n, 1)], -1) * 2.0
        last = torch.arange(5) == 4  # a constant mask: the fifth feature
        chosen = action[:, None] == 1
        if how == "eye[a % 4]":
            h = h + eye[action % 4]
        elif how == "eye[a // 2]":
            h = h + eye[action // 2]
        elif how == "eye[remainder]":
            h = h + eye[torch.remainder(action, 4)]
        elif how == "eye[fmod]":
            h = h + eye[action.fmod(4)]
        elif how == "eye[floor_divide]":
            h = h + eye[torch.floor_divide(action, 2)]
        elif how == "eye[div floor]":
            h = h + eye[torch.div(action, 2, rounding_mode="floor")]
        elif how == "eye[a >> 1]":
            h = h + eye[action >> 1]
        elif how == "eye[bitwise_left_shift]":
            h = h + eye[torch.bitwise_left_shift(action, 1).clamp(max=4)]
        elif how == "eye[bucketize]":
            h = h + eye[torch.bucketize(action, torch.tensor([0, 2]))]
        elif how == "eye[searchsorted]":
            h = h + eye[torch.searchsorted(torch.tensor([0, 2]), action)]
        elif how == "eye[a.sign()]":
            h = h + eye[action.sign()]
        elif how == "(a % 2) as numbers":
            h = torch.cat([h[:, :4], (action % 2).to(F64)[:, None]], -1)
        elif how == "h[nonzero % n, 4] = 1":
            h[action.nonzero()[:, 0] % n, 4] = 1.0
        elif how == "h.masked_fill(mask=, value=)":
            h = h.masked_fill(mask=last & chosen, value=1.0)
        elif how == "torch.masked_fill(h, mask=, value=)":
            h = torch.masked_fill(h, mask=last & chosen, value=1.0)
        elif how == "where(condition=, input=, other=)":
            h = torch.where(condition=last & chosen, input=torch.tensor(1.0, dtype=F64), other=h)
        elif how == "h.where(condition=, other=)":
            h = h.where(condition=~(last & chosen), other=torch.tensor(1.0, dtype=F64))
        elif how == "h[where(condition=)] = 1":
            h[torch.where(condition=action == 1)[0], 4] = 1.0
        elif how == "view before a write":
            z = h.new_zeros(n, 6)
            view = z[:, 1:]  # taken before the write: it shows the key's values written into z
            z[:, 5] = action.to(F64)
            h = torch.cat([h[:, :4], view[:, 4:]], -1)
        elif how == "view before index_put_":
            z = h.new_zeros(n, 2)
            view = z[:, 1]
            z.index_put_((torch.arange(n), torch.ones(n, dtype=torch.long)), action.to(F64))
            h = torch.cat([h[:, :4], view[:, None]], -1)
        elif how == "view beside a write":  # the write does not reach it
            z = h.new_zeros(n, 6)
            view = z[:, :2]
            z[:, 5] = action.to(F64)
            h = torch.cat([h[:, :4], view[:, 1:]], -1)
        elif how == "view before zeros written":  # zeros written where the key says: nothing
            z = h.new_zeros(n, 6)
            view = z[:, 1:]
            z[action == 1] = 0.0
            h = torch.cat([h[:, :4], view[:, 4:]], -1)
        elif how == "view before a write written over":  # an activation written over the key's values
            z = h.new_zeros(n, 6)
            view = z[:, 1:]
            z[:, 5] = action.to(F64)
            z[:, 5] = h[:, 0]
            h = torch.cat([h[:, :4], view[:, 4:]], -1)
        elif how == "view before a gate in place":  # the key's values scale an activation: a gate
            z = h.new_zeros(n, 6)
            view = z[:, 1:]
            z[:, 5] = action.to(F64)
            z.mul_(torch.cat([h, h[:, :1]], -1))
            h = torch.cat([h[:, :4], view[:, 4:]], -1)
        elif how in ("view before zero_", "view before fill_", "zeroed after a write", "written after zero_"):
            z = h.new_zeros(n, 5)
            view = z[:, :]  # taken before the writes
            if how == "written after zero_":  # the key's ones written over zeros: they reach the layer
                z.zero_()
            z[torch.arange(n), action] = 1.0
            if how == "view before fill_":
                z.fill_(0.0)
            elif how != "written after zero_":  # written over whole with zeros: nothing of the key is left
                z.zero_()
            h = h + (z if how == "zeroed after a write" else view)
        elif how == "h[:, a % 5]":  # activations read at the key's values: an index
            h = h[:, action % 5].diagonal()[:, None].expand(n, 5)
        elif how == "h * (a >> 1) and h[:, bucketize]":  # a gate, and activations read at the key's buckets
            h = h * (action >> 1).to(F64)[:, None]
            h = h[:, torch.bucketize(action, torch.tensor([0, 2]))].diagonal()[:, None].expand(n, 5)
        elif how == "h * (a % 2)":  # a gate
            h = h * (action % 2).to(F64)[:, None]
        elif how == "h.masked_fill(mask=a == 1, value=0)":  # a gate by keyword
            h = h.masked_fill(mask=chosen, value=0.0)
        elif how == "where(condition=, input=h, other=2h)":  # activations chosen between, by keyword
            h = torch.where(condition=chosen & last, input=h, other=2.0 * h)
        return self.net(h)


def _explained(how: str, action: torch.Tensor) -> tuple[TensorDict, list[str]]:
    return explained(how, action, ArithmeticCritic)


ACTION = torch.tensor([0, 1, 1, 0, 3, 0, 2, 1])
ROUNDED = r"a remainder or rounded division \({}\)"
NAMED = {
    "eye[a % 4]": ROUNDED.format("remainder"),
    "eye[a // 2]": ROUNDED.format("__floordiv__"),
    "eye[remainder]": ROUNDED.format("remainder"),
    "eye[fmod]": ROUNDED.format("fmod"),
    "eye[floor_divide]": ROUNDED.format("floor_divide"),
    "eye[div floor]": ROUNDED.format("div"),
    "eye[a >> 1]": "a logical or bitwise operation",
    "eye[bitwise_left_shift]": "a logical or bitwise operation",
    "eye[bucketize]": r"the buckets of its values \(bucketize\)",
    "eye[searchsorted]": r"the buckets of its values \(searchsorted\)",
    "eye[a.sign()]": r"the buckets of its values \(sign\)",
    "(a % 2) as numbers": ROUNDED.format("remainder"),
    "h[nonzero % n, 4] = 1": r"the positions of its non-zero values \(nonzero\)",
}


@pytest.mark.parametrize("how", NAMED)
def test_a_key_reaching_a_layer_through_index_arithmetic_is_named(how):
    """``a % n``, ``a // 2``, ``torch.remainder``, ``fmod``, ``torch.floor_divide``, ``a.nonzero() % n``, shifts
    (``a >> 1``, ``bitwise_left_shift``) and buckets (``torch.bucketize``, ``torch.searchsorted``, ``a.sign()``), as
    an index into a constant table or a write, or as numbers, lost the key's share with no word (0.19-0.4 of the
    value, relative L2; a rounded ``torch.div`` was named as the table's read, not as what it is). Named, with the
    arithmetic as the encoding: stored as floats, the key would pass no gradient through it either."""
    out, numeric = _explained(how, ACTION)
    assert len(numeric) == 1 and "'action' (torch.int64)" in numeric[0], numeric
    assert "'module.net.0' (Linear)" in numeric[0], numeric
    assert re.search(f"encoded by {NAMED[how]}, ", numeric[0]), numeric
    assert _lost(out) > 0.1  # the action's share, which the warning is about


KEYWORDS = [
    "h.masked_fill(mask=, value=)",
    "torch.masked_fill(h, mask=, value=)",
    "where(condition=, input=, other=)",
    "h.where(condition=, other=)",
    "h[where(condition=)] = 1",
]


VIEWS = ["view before a write", "view before index_put_"]


@pytest.mark.parametrize("how", KEYWORDS + VIEWS)
def test_a_mask_given_by_keyword_or_a_view_taken_before_a_write_of_the_key_is_followed(how):
    """``masked_fill`` and ``torch.where`` read their mask or condition by position only: ones put over an
    activation where the key says, given by keyword, lost its share with no word (0.30 of the value). A view of a
    tensor, taken before the key's values were written into the tensor (``__setitem__``, ``index_put_``), shows
    them: the layer that takes the view took the key's share with no word (0.59). Both are named; where the key
    puts nothing there (every action 0), nothing is lost."""
    out, numeric = _explained(how, ACTION)
    assert len(numeric) == 1 and "'action' (torch.int64)" in numeric[0], numeric
    assert "'module.net.0' (Linear)" in numeric[0], numeric
    assert how in KEYWORDS or "converted to floating point" in numeric[0], numeric
    assert _lost(out) > 0.1
    out, _ = _explained(how, torch.zeros_like(ACTION))
    assert _lost(out) < 1e-10


@pytest.mark.parametrize(
    "how",
    [
        "view beside a write",
        "view before zeros written",
        "view before a write written over",
        "view before a gate in place",
        "h[:, a % 5]",
        "h * (a % 2)",
        "h * (a >> 1) and h[:, bucketize]",
        "view before zero_",
        "view before fill_",
        "zeroed after a write",
        "h.masked_fill(mask=a == 1, value=0)",
        "where(condition=, input=h, other=2h)",
    ],
)
def test_indices_gates_and_views_the_key_does_not_reach_are_not_named(how):
    """A view beside the part written, zeros written, a tensor (or a view of it taken before) written over whole
    with zeros (``zero_``, ``fill_``) after the key's ones were written in it (named, though nothing of the key was
    left), a view whose part written with the key was written over with an activation, or scaled by one in place (a
    gate), activations read at ``a % n`` or at its buckets, gates of ``a % 2`` and ``a >> 1`` and gates by keyword
    hold none of the key's share: not named, and LRP-0 conserves the value in the observation's relevance."""
    out, numeric = _explained(how, ACTION)
    assert not numeric, numeric
    assert _lost(out) < 1e-10


def test_the_key_written_after_zero_is_named_in_a_view_taken_before():
    """Zeros written over a tensor whole clear what it held of the key: the key's ones written into it after that are
    still named in a view taken before (0.25 of the value lost)."""
    out, numeric = _explained("written after zero_", ACTION)
    assert len(numeric) == 1 and "'module.net.0' (Linear)" in numeric[0], numeric
    assert "encoded by a constant table written at its values (indexing)" in numeric[0], numeric
    assert _lost(out) > 0.1
