"""A model that reads across the last batch dimension: each position perturbed alone, the others as given.

A tiny Llama over the time steps of a ``[B, T]`` TensorDict (each step one sample, as torchrl's decision
transformers run) gives the output at a step from the other steps' features too. FeatureAblation, Occlusion and
ShapleyValueSampling perturbed every step at once and wrote each step's drop on its own features, with no word: 0.7 %
(FeatureAblation, Occlusion) and 41 % (ShapleyValueSampling) off, relative L2, the step alone here, and 52 % with each
step's features one group. Each now equals, in float64, the method's definition for each step
perturbed alone (the Shapley values exact with two groups), with a warning; a model that computes each step apart,
or that only draws at random, runs as before, without one.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torch.overrides import TorchFunctionMode
from torchrl.modules import MLP

from tdhook.attribution import FeatureAblation, Occlusion, ShapleyValueSampling
from tdhook.attribution.methods._positions_alone import (
    own_positions,
    position_splits,
    positions_alone,
    read_across,
)
from tests.attribution.test_lrp_transformer_zoo import COMMON, HIDDEN
from tests.conftest import relative_error

F64 = torch.float64
B, T, UNITS = 2, 4, 3
HALVES = torch.arange(HIDDEN) // (HIDDEN // 2)  # two groups of each step's features
READS_ACROSS = "reads across the last batch dimension"


class Steps(nn.Module):
    """A causal Llama over the steps of its input ``[B, T, H]``: ``UNITS`` values per step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).eval().double()

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        return self.model(inputs_embeds=embeds).logits[..., :UNITS]


def steps_td() -> TensorDict:
    embeds = torch.randn(B, T, HIDDEN, dtype=F64, generator=torch.Generator().manual_seed(1))
    return TensorDict(embeds=embeds, batch_size=[B, T])


def alone(net: nn.Module, embeds: torch.Tensor, b: int, t: int, present: list[int]) -> torch.Tensor:
    """The output at step ``(b, t)`` with that step's feature groups not in ``present`` at 0, the others as given."""
    x = embeds.clone()
    x[b, t] = torch.where(torch.isin(HALVES, torch.tensor(present)), x[b, t], 0.0)
    with torch.no_grad():
        return net(x)[b, t]


def by_definition(name: str, net: nn.Module, embeds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Each step's attribution with that step alone perturbed: the drops of its two halves, or their exact Shapley
    values."""
    expected = torch.zeros_like(embeds)
    for b in range(B):
        for t in range(T):
            full, none, first, second = (alone(net, embeds, b, t, p)[target[b, t]] for p in ([0, 1], [], [0], [1]))
            if name == "ShapleyValueSampling":
                gains = ((first - none + full - second) / 2, (second - none + full - first) / 2)
            else:
                gains = (full - second, full - first)
            for group, gain in enumerate(gains):
                expected[b, t, HALVES == group] = gain
    return expected


METHODS = {
    "FeatureAblation": lambda module, target: FeatureAblation(module, target=target, feature_masks=HALVES),
    "Occlusion": lambda module, target: Occlusion(
        module, target=target, sliding_window_shapes=(HIDDEN // 2,), strides=(HIDDEN // 2,), perturbations_per_eval=2
    ),
    "ShapleyValueSampling": lambda module, target: ShapleyValueSampling(
        module, target=target, feature_masks=HALVES, n_samples=2, seed=0, perturbations_per_eval=3
    ),
}


@pytest.mark.parametrize("name", list(METHODS))
def test_each_step_of_a_transformer_over_the_batch_is_perturbed_alone(name):
    net = Steps()
    module, td = TensorDictModule(net, in_keys=["embeds"], out_keys=["y"]), steps_td()
    with torch.no_grad():
        target = net(td["embeds"]).argmax(-1)
    method = METHODS[name](module, target)
    with pytest.warns(UserWarning, match=rf"{name}: the model {READS_ACROSS} \(of \[2, 4\]\)"):
        found = method(td.clone())["attribution", "embeds"]
    assert relative_error(found, by_definition(name, net, td["embeds"], target)) <= 1e-12
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per wrapper
        assert torch.equal(method(td.clone())["attribution", "embeds"], found)


class Apart(nn.Module):
    """Each step on its own, through a dropout: random in training mode, but reading no other step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(HIDDEN, 8), nn.Dropout(0.5), nn.Linear(8, UNITS)).double()

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        return self.net(embeds)


@pytest.mark.parametrize("train", [False, True])
def test_a_model_computing_each_step_apart_is_not_taken_for_one(train):
    """In eval mode every step's drop equals the step alone with no warning; a dropout in training mode moves every
    output between passes, which is warned of as before, not taken for a reading across steps."""
    net = Apart().train(train)
    module, td = TensorDictModule(net, in_keys=["embeds"], out_keys=["y"]), steps_td()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = FeatureAblation(module, target=1, feature_masks=HALVES)(td.clone())["attribution", "embeds"]
    assert not [w for w in caught if READS_ACROSS in str(w.message)]
    assert any("Dropout" in str(w.message) for w in caught) == train
    if not train:
        with torch.no_grad():
            full = net(td["embeds"])[..., 1:2]
            drops = [full - net(torch.where(HALVES == g, 0.0, td["embeds"]))[..., 1:2] for g in (0, 1)]
        expected = torch.where(HALVES == 0, drops[0], drops[1])
        assert relative_error(found, expected) <= 1e-12


def test_the_copies_and_their_own_positions():
    x, original = torch.arange(6.0).view(2, 3), torch.zeros(2, 3)
    copies = positions_alone(x, original, 2)
    assert copies.shape == (3, 2, 3)
    for t in range(3):
        assert torch.equal(copies[t, :, t], x[:, t]) and not copies[t].sum(0)[torch.arange(3) != t].any()
    assert torch.equal(own_positions(copies.unsqueeze(0), 2)[0], x)
    same, splits = torch.ones(1, 2, 4), position_splits(4)
    changed = same.unsqueeze(1).expand(1, len(splits), 2, 4)
    assert read_across(same, changed.clone(), splits, lambda: same, 2) is None
    assert read_across(same, changed * 1.5, splits, lambda: same * 1.5, 2) is None  # moves unchanged too
    assert read_across(same, changed * 1.5, splits, lambda: same, 2) == 0.5
    # Only the positions each split perturbs moved: each position reads itself alone.
    perturbed_only = torch.where(splits.view(1, len(splits), 1, 4), 3.0, 1.0)
    assert read_across(same, perturbed_only, splits, lambda: same, 2) is None


@pytest.mark.parametrize("length", [2, 3, 4, 5, 7, 8, 9])
def test_for_any_two_positions_a_split_perturbs_the_first_and_leaves_the_second(length):
    splits = position_splits(length)
    for s in range(length):
        for t in range(length):
            if s != t:
                assert (splits[:, s] & ~splits[:, t]).any(), (s, t)


class _Lagged(nn.Module):
    """``y_t = w·x_t + v·x_{t−lag}`` over the positions of a ``[B, T, F]`` input: a causal dilated convolution."""

    def __init__(self, lag: int) -> None:
        super().__init__()
        self.lag = lag
        generator = torch.Generator().manual_seed(3)
        self.w = nn.Parameter(torch.randn(HIDDEN, dtype=F64, generator=generator))
        self.v = nn.Parameter(torch.randn(HIDDEN, dtype=F64, generator=generator))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shifted = torch.zeros_like(x)
        shifted[:, self.lag :] = x[:, : -self.lag]
        return ((x * self.w).sum(-1) + (shifted * self.v).sum(-1)).unsqueeze(-1)


class _LastReadsAll(nn.Module):
    """Each position's own score, and the last position's the mean of every position's too (a summary at the end)."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(4)
        self.w = nn.Parameter(torch.randn(HIDDEN, dtype=F64, generator=generator))
        self.v = nn.Parameter(torch.randn(HIDDEN, dtype=F64, generator=generator))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (x * self.w).sum(-1)
        summary = torch.zeros_like(y)
        summary[:, -1] = (x.mean(1) * self.v).sum(-1)
        return (y + summary).unsqueeze(-1)


def _each_position_alone(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """FeatureAblation's definition with one group per feature, each position perturbed alone."""
    expected = torch.zeros_like(x)
    with torch.no_grad():
        full = net(x)[..., 0]
        for t in range(x.shape[1]):
            for f in range(x.shape[2]):
                changed = x.clone()
                changed[:, t, f] = 0.0
                expected[:, t, f] = full[:, t] - net(changed)[:, t, 0]
    return expected


@pytest.mark.parametrize(
    ("net", "length"),
    [(_Lagged(2), 4), (_Lagged(3), 5), (_LastReadsAll(), 3), (nn.Sequential(nn.LayerNorm((4, HIDDEN))), 4)],
    ids=["step_t_reads_t-2", "step_t_reads_t-3", "last_of_three_reads_all", "layer_norm_over_the_positions"],
)
def test_a_model_that_reads_other_positions_than_the_neighbours_is_found(net, length):
    """Every other position perturbed left a step that reads the step two (or four) before it, and the last of an odd
    number that reads them all, as they were (0.98 and 0.50 off the definition, no warning), and a plain
    ``nn.Sequential`` of a LayerNorm over ``(T, F)`` was taken for one that reads each position alone (0.39 off)."""
    if isinstance(net, nn.Sequential):
        net = nn.Sequential(net[0].double(), nn.Linear(HIDDEN, 1).double())
    x = torch.randn(B, length, HIDDEN, dtype=F64, generator=torch.Generator().manual_seed(5))
    method = FeatureAblation(TensorDictModule(net, ["x"], ["y"]), feature_masks=torch.arange(HIDDEN))
    with pytest.warns(UserWarning, match=READS_ACROSS):
        found = method(TensorDict(x=x, batch_size=[B, length]))["attribution", "x"]
    assert relative_error(found, _each_position_alone(net, x)) <= 1e-12


class _Linears(TorchFunctionMode):
    """Counts the linear layers' calls: two per forward pass of the policies below."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += func is nn.functional.linear
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["sequential", "torchrl_mlp", "hooked"])
def test_a_policy_of_layers_that_read_each_step_alone_takes_no_pass_more(kind):
    """An MLP policy over a [B, T] rollout (a plain ``nn.Sequential`` or torchrl's ``MLP``) cannot read across the
    steps: FeatureAblation with one group runs its two passes (the unperturbed one and the step), not a third to look
    for a reading across the steps. A forward hook on the policy may read anything: the look is kept there (one pass
    of the stacked splits of the steps, and the first and middle split alone, as any first stack of a call is
    compared with its copies alone)."""
    torch.manual_seed(0)
    if kind == "torchrl_mlp":
        net = MLP(in_features=HIDDEN, out_features=UNITS, num_cells=[8], activation_class=nn.Tanh).double()
    else:
        net = nn.Sequential(nn.Linear(HIDDEN, 8), nn.Tanh(), nn.Linear(8, UNITS)).double()
    if kind == "hooked":
        net.register_forward_hook(lambda module, args, output: None)
    module, td = TensorDictModule(net, in_keys=["embeds"], out_keys=["y"]), steps_td()
    counter = _Linears()
    with counter:
        found = FeatureAblation(module, target=1)(td.clone())["attribution", "embeds"]
    assert counter.calls == (10 if kind == "hooked" else 4)
    with torch.no_grad():
        expected = (net(td["embeds"]) - net(torch.zeros_like(td["embeds"])))[..., 1:2].expand_as(found)
    assert relative_error(found, expected) <= 1e-12
