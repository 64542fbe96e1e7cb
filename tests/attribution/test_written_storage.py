"""The marks of the storage written with an integer or boolean key, read by views taken before the write: only for a
tensor of a dtype written, or of any dtype once a tensor was viewed as another (``z.view(torch.int64)``,
``torch.view_as_real``). A CartPole-like critic ``Q(obs, action)`` and torchrl's recurrent modules, in float64."""

import warnings

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchrl.modules import GRUModule, LSTMModule

from tdhook.attribution import LRP, BaseRuleMapper
from tdhook.attribution._written_storage import StorageWrites
from tests.attribution.test_numeric_inputs_masks import ACTION, MaskedCritic, _lost
from tests.attribution.test_numeric_inputs_masks import _explained as explained

F64 = torch.float64


class WrittenCritic(MaskedCritic):
    """Q(s, a) of the observation (padded with a fifth feature, doubled: an activation), whose fifth feature is read
    from a view taken before the action was written into the tensor it views, the way ``how`` says."""

    def forward(self, observation: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        n, how = observation.shape[0], self.how
        h = torch.cat([observation, observation.new_zeros(n, 1)], -1) * 2.0
        if how == "bool view before a bool write":
            flags = torch.zeros(n, 3, dtype=torch.bool)
            view = flags[:, 1:]
            flags[:, 2] = action.bool()
            fifth = view[:, 1:].to(F64)
        elif how == "long view before a long write":
            slots = torch.zeros(n, 2, dtype=torch.long)
            view = slots[:, 1]
            slots[:, 1] = action
            fifth = view[:, None].to(F64)
        elif how == "long view of float64 before a write":  # the bits of the key's values, as integers
            z = h.new_zeros(n, 2)
            bits = z.view(torch.int64)
            z[:, 1] = action.to(F64)
            fifth = bits[:, 1:].to(F64)
        elif how in RETYPED_UNSEEN:  # its bits, viewed as integers otherwise than by Tensor.view
            z = h.new_zeros(n, 2)
            if how == "long NumPy view of float64 before a write":
                bits = torch.from_numpy(z.numpy().view(np.int64))
            else:
                bits = torch.ops.aten.view.dtype(z, torch.int64)
            z[:, 1] = action.to(F64)
            fifth = bits[:, 1:].to(F64)
        elif how == "float64 view of long before a write":
            slots = torch.zeros(n, 2, dtype=torch.long)
            as_float = slots.view(dtype=F64)
            slots[:, 1] = action
            fifth = as_float[:, 1:] * 1e300
        elif how == "view_as_real before a complex write":
            z = torch.zeros(n, 2, dtype=torch.complex128)
            parts = torch.view_as_real(z)
            z[:, 1] = action.to(torch.complex128)
            fifth = parts[:, 1, :1]
        else:
            raise ValueError(how)
        return self.net(torch.cat([h[:, :4], fifth], -1))


RETYPED_UNSEEN = (
    "long NumPy view of float64 before a write",
    "long aten view.dtype of float64 before a write",
)


def _read_dtypes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.dtype, bool]]:
    """The dtype of each tensor read against the marks, and whether a write reached it, as the watch reads them."""
    read, found = StorageWrites.read, []

    def recorded(self: StorageWrites, value: torch.Tensor):
        carrier = read(self, value)
        with torch._C.DisableTorchFunction():
            found.append((value.dtype, carrier is not None))
        return carrier

    monkeypatch.setattr(StorageWrites, "read", recorded)
    return found


@pytest.mark.parametrize(
    "how",
    [
        "bool view before a bool write",
        "long view before a long write",
        "long view of float64 before a write",
        "float64 view of long before a write",
        "view_as_real before a complex write",
        *RETYPED_UNSEEN,
    ],
)
def test_a_view_taken_before_a_write_of_the_key_is_named_whatever_its_dtype(how, monkeypatch):
    """A view of a boolean or integer tensor taken before the key was written into it, converted to floating point,
    holds the key's values; so does a view of the storage as another dtype (its bits), taken by ``Tensor.view``, an
    aten op or through NumPy: the layer that takes it is named. Where the key is all zeros, nothing is
    lost."""
    reads = _read_dtypes(monkeypatch)
    out, numeric = explained(how, ACTION, WrittenCritic)
    assert len(numeric) == 1 and "'module.net.0' (Linear)" in numeric[0], numeric
    assert "'action' (torch.int64)" in numeric[0], numeric
    assert any(reached for _, reached in reads)
    if how != "float64 view of long before a write":  # its bits, read as floating point, hold almost nothing
        assert _lost(out) > 0.1
    out, _ = explained(how, torch.zeros_like(ACTION), WrittenCritic)
    assert _lost(out) < 1e-10


@pytest.mark.parametrize("how", ["bool view before a bool write", "long view before a long write"])
def test_floating_point_tensors_are_not_read_against_the_marks_of_a_boolean_or_integer_write(how, monkeypatch):
    """The key written into a boolean or integer tensor marks a storage of that dtype: the activations, parameters and
    layers' outputs of floating point after it (a view of another dtype taken of none) are not read against the
    marks, each a storage lookup; the view of the tensor written is, and is named."""
    reads = _read_dtypes(monkeypatch)
    _, numeric = explained(how, ACTION, WrittenCritic)
    assert len(numeric) == 1, numeric
    assert reads and all(not dtype.is_floating_point for dtype, _ in reads), reads
    assert any(reached for _, reached in reads)


@pytest.mark.parametrize("recurrent", [LSTMModule, GRUModule])
def test_a_recurrent_policys_is_init_written_leaves_its_activations_unread(recurrent, monkeypatch):
    """torchrl's recurrent modules write constants where ``is_init`` (an input key) says into a boolean and an
    integer tensor, read by views of them: the floating-point steps that follow (a stabilizer's sign, the gates'
    products, the cells' layers) are not read against those marks (about 1,000 lookups, 5 to 8 % of the Python calls
    of the call); the views of the tensors written still are."""
    reads = _read_dtypes(monkeypatch)
    torch.manual_seed(0)
    module = recurrent(
        input_size=4, hidden_size=8, in_key="obs", out_key="h", python_based=True, default_recurrent_mode=True
    ).to(F64)
    is_init = torch.zeros(4, 20, 1, dtype=torch.bool)
    is_init[:, [0, 7]] = True
    obs = torch.randn(4, 20, 4, dtype=F64, generator=torch.Generator().manual_seed(0))
    td = TensorDict(obs=obs, is_init=is_init, batch_size=[4, 20])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = LRP(module, BaseRuleMapper(stabilizer=0))(td)
    assert out["relevance", "obs"].shape == obs.shape and bool(out["relevance", "obs"].isfinite().all())
    assert any(reached for _, reached in reads), reads
    assert all(not dtype.is_floating_point for dtype, _ in reads), sorted({str(d) for d, _ in reads})
