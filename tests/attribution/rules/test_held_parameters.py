"""HeldParameters: what tells a rule that the parameters it built from changed, writes through ``.data`` included."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution.rules import AlphaBetaRule
from tdhook.attribution.rules._held_parameters import HeldParameters

F64 = torch.float64


def writes() -> dict:
    return {
        "through .data": lambda m: m.weight.data.mul_(-2.0),
        "a buffer through .data": lambda m: m.running_var.data.mul_(3.0) if hasattr(m, "running_var") else None,
        "TensorDict.data.update_": lambda m: TensorDict.from_module(m).data.update_(
            TensorDict.from_module(m).data.apply(lambda t: t.flip(0) if t.is_floating_point() else t)
        ),
    }


@pytest.mark.parametrize(
    "kind, how", [("BatchNorm1d", how) for how in sorted(writes())] + [("Linear", "through .data")]
)
def test_a_write_no_version_counter_sees_is_seen_by_the_values(kind: str, how: str):
    torch.manual_seed(0)
    module = nn.Linear(3, 4) if kind == "Linear" else nn.BatchNorm1d(4)
    if kind == "BatchNorm1d":
        with torch.no_grad():
            module.weight.uniform_(0.5, 2.0), module.running_var.uniform_(0.5, 2.0)
    held = HeldParameters(module)
    assert held.unchanged(module)
    versions = [t._version for t in module.state_dict(keep_vars=True).values()]
    writes()[how](module)
    assert [t._version for t in module.state_dict(keep_vars=True).values()] == versions  # unseen by the counters
    assert not held.unchanged(module)


def test_values_compare_bit_for_bit_and_nan_equals_nan():
    """A NaN weight is the value it was (``torch.equal`` alone would rebuild the state at every call)."""
    lin = nn.Linear(2, 2)
    with torch.no_grad():
        lin.weight[0, 0] = float("nan")
    held = HeldParameters(lin)
    assert held.unchanged(lin)
    lin.weight.data[1, 1] = torch.nextafter(lin.weight[1, 1].detach(), torch.tensor(10.0))  # one ulp
    assert not held.unchanged(lin)


def test_several_modules_are_held_together():
    conv, norm = nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)
    held = HeldParameters(conv, norm)
    assert held.unchanged(conv, norm)
    norm.bias.data.add_(1.0)
    assert not held.unchanged(conv, norm)


def test_the_prepared_state_follows_a_write_through_data_and_is_kept_while_nothing_changes():
    torch.manual_seed(0)
    lin, rule = nn.Linear(3, 2).to(F64), AlphaBetaRule(1.0, 0.0)
    with rule.register(lin):
        registration = rule._registrations[lin]
        first = rule.prepared_state(lin, registration)
        assert rule.prepared_state(lin, registration) is first  # not rebuilt while nothing changes
        lin.weight.data.copy_(-lin.weight.detach())
        positive = rule.prepared_state(lin, registration)["pos"]["weight"]
    torch.testing.assert_close(positive, lin.weight.detach().clamp(min=0), rtol=0, atol=0)


def test_tensors_set_in_the_modules_dict_are_held():
    """tensordict's ``to_module(..., preserve_module_state=False)`` leaves no parameter in the module: the tensors the
    forward reads are in its ``__dict__``, one set per agent or ensemble member."""
    template = nn.Linear(3, 2)
    members = TensorDict.from_modules(nn.Linear(3, 2), nn.Linear(3, 2)).data
    with members[0].to_module(template, preserve_module_state=False):
        assert not template._parameters
        held = HeldParameters(template)
        assert held.unchanged(template)
    with members[1].to_module(template, preserve_module_state=False):
        assert not held.unchanged(template)


def test_a_weight_a_hook_computes_at_each_call_is_held_through_what_it_is_computed_from():
    """``torch.nn.utils.prune`` sets ``weight`` (the original times the mask) before each call: the record follows the
    original and the mask, and is not made anew at every call."""
    lin, rule = nn.utils.prune.l1_unstructured(nn.Linear(3, 2), "weight", amount=0.5), AlphaBetaRule(1.0, 0.0)
    x = torch.randn(4, 3, requires_grad=True)
    with rule.register(lin):
        lin(x)
        first = rule._registrations[lin].state
        lin(x)
        assert rule._registrations[lin].state is first
        lin.weight_orig.data.mul_(-1.0)
        lin(x)
        assert rule._registrations[lin].state is not first


def test_activations_a_hook_keeps_on_a_torch_layer_make_no_new_record_at_each_call():
    """A forward hook that keeps a layer's input and output on it (``module.input0 = ...``, as BackPACK and
    curvature estimators do) sets new tensors in the layer's ``__dict__`` at every call, which torch's forward never
    reads: the prepared state is kept, and the kept activations are not copied."""
    torch.manual_seed(0)
    lin, rule = nn.Linear(3, 2).to(F64), AlphaBetaRule(1.0, 0.0)
    lin.register_forward_hook(lambda m, args, out: m.__dict__.update(input0=args[0], output=out))
    x = torch.randn(4, 3, dtype=F64, requires_grad=True)
    with rule.register(lin):
        lin(x)
        first = rule._registrations[lin].state
        for _ in range(3):
            lin(x * 1.0)
        assert rule._registrations[lin].state is first
        assert all(t.shape != (4, 2) for t in rule._registrations[lin].held.values[0])  # no copy of the output
        lin.weight.data.mul_(-1.0)
        lin(x)
        assert rule._registrations[lin].state is not first


def test_a_tensor_a_layers_own_forward_reads_from_its_dict_is_held_whatever_its_name():
    """A layer with a forward of its own may read any tensor set on it (a weight a hypernetwork sets per call)."""

    class Dynamic(nn.Linear):
        def forward(self, x):
            return nn.functional.linear(x, self.weight * self.scale, self.bias)

    lin = Dynamic(3, 2)
    lin.scale = torch.ones(2, 1)
    held = HeldParameters(lin)
    lin.scale = torch.full((2, 1), 2.0)
    assert not held.unchanged(lin)


def test_meta_tensors_are_skipped_and_the_others_compared():
    """A module partly on the meta device: its real tensors are compared, the meta ones (no values) are not."""
    lin = nn.Linear(2, 2)
    lin.weight = nn.Parameter(torch.empty(2, 2, device="meta"))  # listed before the bias
    held = HeldParameters(lin)
    assert held.unchanged(lin)
    lin.bias.data.add_(1.0)
    assert not held.unchanged(lin)


def test_tensor_subclasses_set_in_the_modules_dict_are_held():
    """Attribute types are classified once per type: a subclass of ``torch.Tensor`` set in ``__dict__`` is held."""

    class Marked(torch.Tensor):
        pass

    lin = nn.Linear(2, 2)
    lin.__dict__["weight"] = torch.zeros(2, 2).as_subclass(Marked)
    held = HeldParameters(lin)
    lin.__dict__["weight"].data.add_(1.0)
    assert not held.unchanged(lin)
