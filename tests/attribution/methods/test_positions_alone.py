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
from tdhook.attribution.methods._positions_alone import own_positions, positions_alone, read_across
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
    same = torch.ones(1, 2, 4)
    assert read_across(same, same.clone(), lambda: same, 2) is None
    assert read_across(same, same * 1.5, lambda: same * 1.5, 2) is None  # moves on the unchanged inputs too
    assert read_across(same, same * 1.5, lambda: same, 2) == 0.5


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
    for a reading across the steps. A forward hook on the policy may read anything: the look is kept there."""
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
    assert counter.calls == (6 if kind == "hooked" else 4)
    with torch.no_grad():
        expected = (net(td["embeds"]) - net(torch.zeros_like(td["embeds"])))[..., 1:2].expand_as(found)
    assert relative_error(found, expected) <= 1e-12
