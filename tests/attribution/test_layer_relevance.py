"""Relevance at inner modules (``layers``) where the layer after them sets its input's relevance directly.

Flat, w² and z^B set the relevance of the first layer's input, zero entries included, and the gradient carries
only ``x · grad`` of it. The output of the module before that layer (a ``Flatten``, a normaliser, an ``Identity``)
is that input: its relevance is the layer's whole input relevance, which the rest of the model, explained on that
tensor as its input, gives too.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
import weakref

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.rules import EpsilonGammaBox, EpsilonPlus, EpsilonPlusFlat, WSquareRule
from tdhook.attribution.rules.checks import raise_for_unconserved_rel_factory
from tests.attribution._helpers import Recorded
from tests.conftest import relative_error

F64 = torch.float64


class Normaliser(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - 0.5) / 2.0


def mlp_on_images() -> nn.Sequential:
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 6), nn.ReLU(), nn.Linear(6, 3))


def cnn(glue: nn.Module) -> nn.Sequential:
    return nn.Sequential(glue, nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(48, 3))


MODELS = {
    "flatten-mlp": (mlp_on_images, (4, 1, 4, 4)),
    "identity-cnn": (lambda: cnn(nn.Identity()), (4, 2, 4, 4)),
    "normaliser-cnn": (lambda: cnn(Normaliser()), (4, 2, 4, 4)),
}
PRESETS = {
    "EpsilonPlusFlat": lambda first: EpsilonPlusFlat(),
    "w2": lambda first: EpsilonPlus(rule_mapper={first: WSquareRule()}),
    "EpsilonGammaBox": lambda first: EpsilonGammaBox(-3.0, 3.0),
}


def rest_explained(model: nn.Sequential, mapper, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The oracle: the modules after the first, explained on its output as their input (``mapper``'s rules)."""
    given = TensorDict(x=model[0](x), batch_size=[len(x)])
    rest = nn.Sequential(*model[1:])
    return LRP(rest, mapper, in_keys=["x"], out_keys=["y"], target=target)(given)["relevance", "x"]


def summed_checks() -> tuple[dict, object]:
    """A relevance check that keeps each module's first (relevance in, relevance out), summed, by name."""
    checks: dict = {}
    return checks, lambda name, module, rin, rout: checks.setdefault(name, (rin.sum(), rout.sum()))


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_the_module_before_a_first_layer_gets_its_whole_input_relevance(model_name: str, preset: str):
    make, shape = MODELS[model_name]
    torch.manual_seed(0)
    model = make().to(F64).eval()
    x = torch.randn(shape, dtype=F64).clamp(-3, 3)
    x[x.abs() < 0.6] = 0.5 if model_name == "normaliser-cnn" else 0.0  # zero entries of the first layer's input
    td = TensorDict(x=x, batch_size=[shape[0]])
    with torch.no_grad():
        target = model(x).argmax(-1)
    lrp = LRP(model, PRESETS[preset]("1"), in_keys=["x"], out_keys=["y"], target=target, layers=["0"])
    ours = lrp(td)["relevance", "0"]
    # The oracle: the layers after the module, explained on its output as their input (the same rules).
    rest = nn.Sequential(*model[1:])
    given = TensorDict(x=model[0](x), batch_size=[shape[0]])
    expected = LRP(rest, PRESETS[preset]("0"), in_keys=["x"], out_keys=["y"], target=target)(given)["relevance", "x"]
    assert relative_error(ours, expected) <= 1e-12


@pytest.mark.parametrize("preset", ["EpsilonPlusFlat", "w2"])  # first-layer rules of a Linear layer
def test_modules_that_return_one_tensor_each_get_its_whole_relevance(preset: str):
    # An Identity, a Dropout in eval mode or a Flatten of a flat input returns its input itself: every module named
    # in layers whose output is that tensor gets the relevance the first layer sets there, not only the first one
    # read (the others had none of it: 100 % off where the gradient carries none).
    torch.manual_seed(0)
    glue = [nn.Tanh(), nn.Identity(), nn.Dropout(0.2), nn.Flatten()]
    model = nn.Sequential(*glue, nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)).to(F64).eval()
    x = torch.randn(4, 6, dtype=F64)
    x[x.abs() < 0.6] = 0.0  # zero entries of the first layer's input
    with torch.no_grad():
        target = model(x).argmax(-1)
    names = [str(i) for i in range(len(glue))]
    lrp = LRP(model, PRESETS[preset]("4"), in_keys=["x"], out_keys=["y"], target=target, layers=names)
    td = lrp(TensorDict(x=x, batch_size=[4]))
    rest = nn.Sequential(*model[len(glue) :])
    given = TensorDict(x=torch.tanh(x), batch_size=[4])
    expected = LRP(rest, PRESETS[preset]("0"), in_keys=["x"], out_keys=["y"], target=target)(given)["relevance", "x"]
    for name in names:
        assert relative_error(td["relevance", name], expected) <= 1e-12, name


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("glue", ["normaliser", "tanh"])
def test_a_module_further_up_the_glue_gets_its_whole_output_relevance(glue: str, preset: str):
    # A normaliser (or an activation) before a Flatten and the first layer: its output is not the layer's input, and
    # the relevance the rule sets at that input reached it through no gradient (it had none: 100 % off).
    torch.manual_seed(0)
    first = {"normaliser": Normaliser, "tanh": nn.Tanh}[glue]()
    model = cnn(nn.Identity())
    model = nn.Sequential(first, nn.Flatten(2), nn.Unflatten(2, (4, 4)), *model[1:]).to(F64).eval()
    x = torch.randn(4, 2, 4, 4, dtype=F64).clamp(-3, 3)
    x[x.abs() < 0.6] = 0.5 if glue == "normaliser" else 0.0  # zero entries of the first layer's input
    with torch.no_grad():
        target = model(x).argmax(-1)
    lrp = LRP(model, PRESETS[preset]("3"), in_keys=["x"], out_keys=["y"], target=target, layers=["0", "1"])
    td = lrp(TensorDict(x=x, batch_size=[4]))
    expected = rest_explained(model, PRESETS[preset]("2"), x, target)
    assert relative_error(td["relevance", "0"], expected) <= 1e-12
    assert relative_error(td["relevance", "1"], expected.flatten(2)) <= 1e-12


def test_a_relevance_check_sees_each_module_once_when_relevance_is_carried_up_the_glue():
    # Reading the glue's Jacobian runs backward passes through the first layer's input: the check's hook there must
    # not take them for the relevance pass (it ran once more, on a zero gradient).
    torch.manual_seed(0)
    model = nn.Sequential(Normaliser(), nn.Flatten(2), nn.Unflatten(2, (4, 4)), *cnn(nn.Identity())[1:]).to(F64)
    x = torch.randn(2, 2, 4, 4, dtype=F64)
    x[x.abs() < 0.6] = 0.5  # zero entries of the first layer's input
    checks = []
    lrp = LRP(
        model.eval(),
        EpsilonPlusFlat(),
        in_keys=["x"],
        out_keys=["y"],
        layers=["0"],
        relevance_check=lambda name, module, relevance_in, relevance_out: checks.append(name),
    )
    lrp(TensorDict(x=x, batch_size=[2]))
    assert sorted(checks) == ["3", "6"]


class Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 3.0


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("glue", ["normaliser", "tanh", "scale"])
def test_a_relevance_check_sees_the_relevance_a_first_layer_sets_behind_glue(glue: str, preset: str):
    # Glue that computes the first layer's input (a normaliser, an activation, a scale before a Flatten): the rule
    # sets that input's relevance on the explained inputs, by position, and not through the gradient, so the check
    # read 0 for the layer's input relevance and raise_for_unconserved_rel_factory raised where relevance is
    # conserved (its whole output relevance off). It sees what the rule set there: the input key's relevance.
    torch.manual_seed(0)
    first = {"normaliser": Normaliser, "tanh": nn.Tanh, "scale": Scale}[glue]()
    model = nn.Sequential(first, nn.Flatten(2), nn.Unflatten(2, (4, 4)), *cnn(nn.Identity())[1:]).to(F64).eval()
    x = torch.randn(4, 2, 4, 4, dtype=F64).clamp(-3, 3)
    if glue == "normaliser":
        x[x.abs() < 0.6] = 0.5  # zero entries of the first layer's input
    checks, check = summed_checks()
    relevance = LRP(model, PRESETS[preset]("3"), in_keys=["x"], out_keys=["y"], relevance_check=check)(
        TensorDict(x=x, batch_size=[4])
    )["relevance", "x"]
    into_first, out_of_first = checks["3"]
    assert abs(into_first - relevance.sum()) <= 1e-12 * relevance.abs().sum()
    if preset == "EpsilonPlusFlat":  # Flat conserves at the layer (w² gives padding a share, z^B its bias)
        assert abs(into_first - out_of_first) <= 1e-6 * abs(out_of_first)  # Flat's stabiliser
    if glue == "tanh":  # the activation before it, under the pass rule, sees the same
        assert abs(checks["0"][0] - checks["0"][1]) <= 1e-12 * abs(checks["0"][1])


def test_the_conservation_check_passes_where_a_normaliser_precedes_a_flat_first_layer():
    # EpsilonPlusFlat with ε = 0 and no biases conserves at every layer: the check raised at the first layer, whose
    # input relevance it read as 0 (100 % off).
    torch.manual_seed(0)
    model = nn.Sequential(
        Normaliser(), nn.Flatten(), nn.Linear(16, 4, bias=False), nn.ReLU(), nn.Linear(4, 3, bias=False)
    ).to(F64)
    x = torch.randn(5, 4, 4, dtype=F64)
    check = raise_for_unconserved_rel_factory(1e-4, 1e-4)
    lrp = LRP(model, EpsilonPlusFlat(epsilon=0), in_keys=["x"], out_keys=["y"], relevance_check=check)
    td = lrp(TensorDict(x=x, batch_size=[5]))
    logit = td["y"].max(-1).values
    assert relative_error(td["relevance", "x"].sum((1, 2)), logit) <= 1e-5  # Flat's stabiliser aside


@pytest.mark.parametrize("preset", ["EpsilonPlusFlat", "w2"])
def test_layers_and_a_relevance_check_each_read_their_own(preset: str):
    # The check reads the relevance set at the first layer's input from an alias of it, layers from the module output
    # itself: neither takes the other's.
    torch.manual_seed(0)
    model = nn.Sequential(Normaliser(), *mlp_on_images()).to(F64).eval()
    x = torch.randn(4, 1, 4, 4, dtype=F64)
    x[x.abs() < 0.6] = 0.5  # zero entries of the first layer's input
    with torch.no_grad():
        target = model(x).argmax(-1)
    checks, check = summed_checks()
    layers = ["0", "1"]
    lrp = LRP(
        model, PRESETS[preset]("2"), in_keys=["x"], out_keys=["y"], target=target, layers=layers, relevance_check=check
    )
    td = lrp(TensorDict(x=x, batch_size=[4]))
    expected = rest_explained(model, PRESETS[preset]("1"), x, target)
    assert relative_error(td["relevance", "0"], expected) <= 1e-12
    assert relative_error(td["relevance", "1"], expected.flatten(1)) <= 1e-12
    assert abs(checks["2"][0] - expected.sum()) <= 1e-12 * expected.abs().sum()


def _relevance_seen(seen: list):
    """A relevance check that keeps each module's relevance out, detached."""

    def check(name: str, module: nn.Module, relevance_in: torch.Tensor, relevance_out: torch.Tensor) -> None:
        seen.append(relevance_out.detach())

    return check


# What reads relevance inside the model: a module that computes no layer, a ruled Linear (a layer call whose merged
# outputs are watched too), a relevance check on every ruled module.
WATCHERS = {
    "layers-inner": lambda seen: {"layers": ["1"]},
    "layers-ruled": lambda seen: {"layers": ["0"]},
    "relevance-check": lambda seen: {"relevance_check": _relevance_seen(seen)},
}


@pytest.mark.parametrize("in_context", [False, True])
@pytest.mark.parametrize("create_graph", [False, True])
@pytest.mark.parametrize("watcher", list(WATCHERS))
def test_a_call_holds_no_output_nor_input_once_its_results_are_dropped(watcher, create_graph, in_context):
    # The gradient hooks reading a module's relevance held its output from inside the output's graph, out of the
    # garbage collector's reach: every call left the output, and with create_graph its whole graph and the input,
    # alive.
    recorded = Recorded()
    net = nn.Sequential(nn.Linear(3, 4), recorded, nn.ReLU(), nn.Linear(4, 2)).to(F64)
    seen, seen_plainly = [], []
    lrp = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"], create_graph=create_graph, **WATCHERS[watcher](seen))
    reference = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"], **WATCHERS[watcher](seen_plainly))
    keys = [key for key in reference.out_keys if key[0] == "relevance"]
    inputs = [torch.randn(5, 3, dtype=F64) for _ in range(3)]
    expected = [reference(TensorDict(x=x.clone(), batch_size=[5])).select(*keys) for x in inputs]
    recorded.outputs.clear()
    leaves, found = [], []
    with lrp if in_context else contextlib.nullcontext():
        for x in inputs:
            leaf = x.clone().requires_grad_(True)
            leaves.append(weakref.ref(leaf))
            found.append(lrp(TensorDict(x=leaf, batch_size=[5])).select(*keys).detach())
            del leaf
        gc.collect()
        assert [ref() for ref in leaves] == [None] * len(inputs)
        assert [ref() for ref in recorded.outputs] == [None] * len(recorded.outputs)
    for value, want in zip(found, expected, strict=True):
        for key in keys:
            torch.testing.assert_close(value[key], want[key], rtol=1e-12, atol=1e-14)
    assert len(seen) == len(seen_plainly)
    for value, want in zip(seen, seen_plainly, strict=True):
        torch.testing.assert_close(value, want, rtol=1e-12, atol=1e-14)


class _ByKeyword(nn.Module):
    """A linear layer, a LayerNorm, a tanh and a head, each called with its input by keyword or by position."""

    def __init__(self, keyword: bool) -> None:
        super().__init__()
        self.fc, self.norm, self.act, self.head = nn.Linear(4, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 3)
        self.keyword = keyword

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.keyword:
            return self.head(input=self.act(input=self.norm(input=self.fc(input=x))))
        return self.head(self.act(self.norm(self.fc(x))))


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_relevance_check_sees_modules_called_with_their_input_by_keyword(preset: str):
    """``layer(input=x)``: the check's hooks read positional inputs only, and skipped every such module without a
    word (no module was checked). It sees each, with the relevance a positional call gives."""
    x = torch.randn(5, 4, dtype=F64)
    seen = []
    for keyword in (True, False):
        torch.manual_seed(0)
        checks, check = summed_checks()
        model = _ByKeyword(keyword).to(F64)
        lrp = LRP(model, PRESETS[preset]("fc"), in_keys=["x"], out_keys=["y"], relevance_check=check)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the tanh's plain gradient under the CNN presets
            relevance = lrp(TensorDict(x=x, batch_size=[5]))["relevance", "x"]
        seen.append((checks, relevance))
    (by_keyword, relevance), (by_position, expected) = seen
    assert sorted(by_keyword) == sorted(by_position) == ["act", "fc", "head", "norm"]
    for name, (into, out_of) in by_position.items():
        assert abs(by_keyword[name][0] - into) <= 1e-12 * abs(into)
        assert abs(by_keyword[name][1] - out_of) <= 1e-12 * abs(out_of)
    assert relative_error(relevance, expected) <= 1e-12
