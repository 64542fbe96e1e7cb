"""Explained inputs that share memory with another key of the caller's TensorDict (the same tensor under two keys, a
view of another key): explained as the plain model computes, and refused by key where the model writes into the
shared memory in place, which the copy an explained input is given would hide."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule, TensorDictSequential
from torch import nn

import tdhook.attribution as attribution
from tdhook.attribution import LRP
from tests.attribution._helpers import assert_unchanged, state_snapshot

METHODS = ["LRP", "InputXGradient", "Saliency", "IntegratedGradients"]


def _net(bias: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8, bias=bias), nn.ReLU(), nn.Linear(8, 2, bias=bias)).double()


def _gradient_times_input(function, *inputs: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Gradient × input of each of ``inputs`` (the caller's values) for the output at its argmax, and the output."""
    copies = [x.detach().clone().requires_grad_(True) for x in inputs]
    output = function(*copies)
    chosen = output.gather(-1, output.argmax(-1, keepdim=True))
    grads = torch.autograd.grad(chosen.sum(), copies)
    return [g * x for g, x in zip(grads, inputs, strict=True)], chosen.detach().squeeze(-1)


def _doubling(t: torch.Tensor) -> torch.Tensor:
    return t.mul_(2)  # in place, as an in-place normaliser writes


@pytest.mark.parametrize("method", METHODS)
def test_a_model_writing_in_place_into_a_view_of_an_explained_input_is_refused_naming_both(method):
    """``y`` is a view of the explained ``x``; the first step doubles it in place, the second reads ``x``. A plain
    call reads the doubled values; the explained call gives the model a copy of ``x`` made before, and took the
    relevance on the caller's memory, doubled meanwhile: outputs and relevance of another function."""
    net = _net()
    model = TensorDictSequential(
        TensorDictModule(_doubling, in_keys=["y"], out_keys=["y2"]), TensorDictModule(net, ["x"], ["av"])
    )
    x = torch.randn(4, 3, dtype=torch.float64)
    td = TensorDict(x=x, y=x[:, :2], batch_size=[4])
    values, snapshot = x.clone(), state_snapshot(net)
    with pytest.raises(
        RuntimeError,
        match=rf"{method}: the model changed 'y' in place, which shares memory with the "
        "explained input 'x'",
    ):
        getattr(attribution, method)(model, in_keys=["x"], target_key="av")(td)
    assert sorted(td.keys()) == ["x", "y"] and torch.equal(td["x"], values) and td["x"] is x  # put back
    assert_unchanged(net, snapshot)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shared", ["view", "same tensor"])
def test_a_model_writing_in_place_into_its_copy_of_an_input_another_key_shares_is_refused(method, shared):
    """The first step doubles the explained ``x`` in place (its copy), the second reads ``y``, which holds the
    caller's memory of ``x``: a plain call reads the doubled values there, the explained one would not."""
    net = _net()
    head = nn.Linear(3, 2).double()

    def add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return net(x) + head(torch.cat([y[:, :2], y[:, :1]], -1))

    model = TensorDictSequential(
        TensorDictModule(_doubling, in_keys=["x"], out_keys=["x"]), TensorDictModule(add, ["x", "y"], ["av"])
    )
    x = torch.randn(4, 3, dtype=torch.float64)
    td = TensorDict(x=x, y=x[:, :2] if shared == "view" else x, batch_size=[4])
    values = x.clone()
    with pytest.raises(
        RuntimeError,
        match=rf"{method}: the model changed its copy of the explained input 'x' in "
        "place, which shares memory with 'y'",
    ):
        getattr(attribution, method)(model)(td)
    assert sorted(td.keys()) == ["x", "y"] and torch.equal(td["x"], values)


@pytest.mark.parametrize("shared", ["same tensor", "view", "disjoint slices written in place"])
def test_keys_sharing_memory_are_each_explained_as_gradient_times_input_and_conserve(shared):
    """Nothing written in place into memory two inputs share (or the written slice touches no other input): each
    key gets LRP-0's gradient × input of its own tensor, the outputs are the plain call's, and, biases zeroed, the
    relevance of the two keys adds up to the output."""
    net, head = _net(bias=False), nn.Linear(2, 2, bias=False).double()
    store = torch.randn(4, 6, dtype=torch.float64)
    x = store[:, :3]
    if shared == "same tensor":
        y = x
    elif shared == "view":
        y = x[:, 1:]
    else:
        y = store[:, 4:]  # the same storage, not the same memory as x: written in place, no other key sees it
    x_in, y_in = x.clone(), y.clone()

    def add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return net(x) + head(y[:, :2])

    steps = [TensorDictModule(add, ["x", "y"], ["av"])]
    function = add
    if shared.startswith("disjoint"):  # before the read, in place: only y sees it
        steps.insert(0, TensorDictModule(_doubling, in_keys=["y"], out_keys=["y"]))
        function = lambda x, y: add(x, 2 * y)  # noqa: E731
    td = TensorDict(x=x, y=y, batch_size=[4])
    out = LRP(TensorDictSequential(*steps), target_key="av")(td)
    (rx, ry), chosen = _gradient_times_input(function, x_in, y_in)
    torch.testing.assert_close(out["relevance", "x"], rx)
    torch.testing.assert_close(out["relevance", "y"], ry)
    torch.testing.assert_close(out["av"].gather(-1, out["av"].argmax(-1, keepdim=True)).squeeze(-1), chosen)
    total = out["relevance", "x"].sum(-1) + out["relevance", "y"].sum(-1)
    torch.testing.assert_close(total, chosen)


@pytest.mark.parametrize("method", METHODS)
def test_a_consolidated_tensordict_whose_counter_the_model_increments_is_explained(method):
    """``consolidate()`` puts every entry in one storage, at places apart: a counter (int32) the model increments in
    place shares no memory with the explained observations (float64), and the call is explained as on the TensorDict
    before consolidation (it was refused, the entries' dtypes being taken to share)."""
    net = _net()

    def count(step: torch.Tensor) -> torch.Tensor:
        return step.add_(1)

    model = TensorDictSequential(
        TensorDictModule(count, in_keys=["step"], out_keys=["step"]), TensorDictModule(net, ["x"], ["av"])
    )
    x = torch.randn(4, 3, dtype=torch.float64)
    td = TensorDict(x=x, step=torch.zeros(4, 1, dtype=torch.int32), batch_size=[4]).consolidate().unlock_()
    assert td["x"].untyped_storage().data_ptr() == td["step"].untyped_storage().data_ptr()
    out = getattr(attribution, method)(model, in_keys=["x"], target_key="av")(td)
    relevance_key = "relevance" if method == "LRP" else "attribution"
    expected = _gradient_times_input(net, x)[0][0]
    if method == "Saliency":
        expected = (expected / x).abs()
    elif method == "IntegratedGradients":
        expected = None  # the path integral: compared with its own call on the plain TensorDict below
    plain = TensorDict(x=x.clone(), step=torch.zeros(4, 1, dtype=torch.int32), batch_size=[4])
    again = getattr(attribution, method)(model, in_keys=["x"], target_key="av")(plain)
    torch.testing.assert_close(out[relevance_key, "x"], again[relevance_key, "x"], rtol=1e-12, atol=1e-12)
    if expected is not None:
        torch.testing.assert_close(out[relevance_key, "x"], expected, rtol=1e-10, atol=1e-12)
    assert torch.equal(out["step"], torch.ones(4, 1, dtype=torch.int32))
