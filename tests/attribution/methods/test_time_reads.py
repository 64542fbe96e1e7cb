"""Recurrent layers that read the batch's first dimension as time: stacked copies run one per pass instead."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution.methods._time_reads import read_as_one_sequence, recurrent_layers, time_lengths
from tests.attribution.methods.test_base import make
from tests.attribution.methods.test_batch_statistics import STACKED
from tests.attribution.test_lrp_registration_faults import FailingRegistration
from tests.conftest import relative_error


class Trajectory(nn.Module):
    """A GRU over its input's first dimension: unbatched ``[L, 3]`` (one trajectory), or ``[L, B, 3]``."""

    def __init__(self, batch_first: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn, self.head = nn.GRU(3, 5, batch_first=batch_first), nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


class Counted(nn.Module):
    """Counts the forward passes of the model it wraps."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net, self.passes = net, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.passes += 1
        return self.net(x)


def options(name: str, stacked: bool, sample: tuple[int, ...] = (3,), samples: int = 6) -> dict:
    """The options of one copy of the batch (of ``samples``) per pass, or of all copies in one pass."""
    option, together = STACKED[name]
    masks = {"feature_masks": torch.arange(3)} if name in ("FeatureAblation", "ShapleyValueSampling") else {}
    windows = {"sliding_window_shapes": (1,) * len(sample)} if name == "Occlusion" else {}
    draws = torch.Generator().manual_seed(1)
    references = {"baselines": torch.randn(2, *sample, dtype=torch.float64, generator=draws)}
    references = references if name == "GradientShap" else {}
    one = samples if option == "internal_batch_size" else 1
    return {option: together if stacked else one, **masks, **windows, **references}


@pytest.mark.parametrize("name", list(STACKED))
def test_a_trajectory_read_as_time_equals_one_copy_per_pass(name):
    """A TensorDict of one trajectory ``[6]`` fed to a plain GRU, which reads its unbatched input's first dimension
    as time: copies stacked along it ran as one sequence, each starting from the state the copy before it left.
    The attributions were off by a relative L2 error of 0.21 (ShapleyValueSampling) to 0.68 (IntegratedGradients).
    The first stacked pass shows it, and the copies run one per pass: as one copy per pass."""
    net = Trajectory().double()
    td = TensorDict(x=torch.randn(6, 3, dtype=torch.float64), batch_size=[6])
    expected = make(name, net, in_keys=["x"], out_keys=["y"], target=0, **options(name, stacked=False))
    got = make(name, net, in_keys=["x"], out_keys=["y"], target=0, **options(name, stacked=True))
    expected, got = expected(td.clone())["attribution", "x"], got(td.clone())["attribution", "x"]
    assert relative_error(got, expected) <= 1e-12
    assert expected.abs().max() > 1e-2  # not a comparison of zeros


@pytest.mark.parametrize("name", list(STACKED))
def test_a_batch_the_recurrent_layer_reads_as_its_batch_keeps_the_stacked_passes(name):
    """``[B, T]`` sequences, the GRU batch-first: the copies stack along the GRU's batch, which keeps them apart, and
    run in as few passes as before."""
    counted = Counted(Trajectory(batch_first=True).double())
    td = TensorDict(x=torch.randn(2, 6, 3, dtype=torch.float64), batch_size=[2])
    alone = make(name, counted, in_keys=["x"], out_keys=["y"], target=0, **options(name, False, (6, 3), 2))
    expected = alone(td.clone())["attribution", "x"]
    one_per_pass, counted.passes = counted.passes, 0
    got = make(name, counted, in_keys=["x"], out_keys=["y"], target=0, **options(name, True, (6, 3), 2))
    assert relative_error(got(td.clone())["attribution", "x"], expected) <= 1e-12
    # The model's own pass and one of every copy (Shapley sampling: one more, at the baselines), and the first and
    # middle copies alone, which show that the model (a module of the caller's) keeps the copies apart: no more
    # passes than one copy per pass with these two or three copies, fewer with more.
    assert counted.passes == 2 + int(name == "ShapleyValueSampling") + 2 <= one_per_pass
    assert not counted.net.rnn._forward_pre_hooks  # the recording hooks are gone


def test_time_lengths_of_packed_and_batch_first_inputs():
    gru, lstm = nn.GRU(3, 4), nn.LSTM(3, 4, batch_first=True)
    layers = recurrent_layers({"gru": gru, "lstm": lstm, "head": nn.Linear(4, 1)})
    assert list(layers) == ["gru", "lstm"]
    packed = nn.utils.rnn.pack_sequence([torch.randn(5, 3), torch.randn(2, 3)])
    with time_lengths(layers) as own:
        gru(torch.randn(7, 2, 3))
        gru(packed)
        lstm(torch.randn(2, 9, 3))
        lstm(torch.randn(4, 3))  # unbatched: time first, batch_first or not
    assert own == {("gru", 7), ("gru", 5), ("lstm", 9), ("lstm", 4)}
    assert not gru._forward_pre_hooks and not lstm._forward_pre_hooks
    assert not read_as_one_sequence(own, {("gru", 7)}) and read_as_one_sequence(own, {("gru", 14)})


def test_a_registration_that_fails_leaves_no_hook_on_the_layers_before_it():
    """The hook on a second recurrent layer failing to register (an interrupt, a layer whose
    ``register_forward_pre_hook`` raises): the first layer's was left on the model for good."""
    net = nn.Sequential(nn.GRU(3, 4), nn.GRU(4, 2))
    layers = recurrent_layers(dict(net.named_modules()))
    with FailingRegistration(2) as failing:
        with time_lengths(layers):
            pass
    assert failing.where == "Module.register_forward_pre_hook"
    assert [len(layer._forward_pre_hooks) for layer in net] == [0, 0]
    with time_lengths(layers) as lengths:
        net[1](net[0](torch.randn(6, 3))[0])
    assert sorted(lengths) == [("0", 6), ("1", 6)] and [len(layer._forward_pre_hooks) for layer in net] == [0, 0]
