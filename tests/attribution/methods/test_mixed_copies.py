"""A model that mixes the samples of its batch in its own forward (``x - x.mean(0)``, ``F.batch_norm`` in training
mode) gives each stacked copy of the batch the statistics of all of them: the methods that stack copies in one pass
compare the first stack with its copies alone, name the module and run one copy per pass."""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torch.overrides import TorchFunctionMode

from tdhook.attribution import FeatureAblation, GradientShap, IntegratedGradients, Occlusion, SmoothGrad
from tdhook.attribution.methods._mixed_copies import copies_apart
from tests.conftest import relative_error

MIXES = "mixes the samples of its batch"


class Centring(nn.Module):
    """Each sample's features less the batch's mean: a batch statistic no module shows."""

    def __init__(self, how: str = "mean") -> None:
        super().__init__()
        self.how = how

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.how == "batch_norm":
            return nn.functional.batch_norm(h, None, None, training=True)
        return h - h.mean(0)


class Model(nn.Module):
    def __init__(self, how: str = "mean") -> None:
        super().__init__()
        self.first, self.centring, self.head = nn.Linear(4, 8), Centring(how), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.centring(torch.tanh(self.first(x)))))


def module(how: str = "mean") -> TensorDictModule:
    torch.manual_seed(0)
    return TensorDictModule(Model(how).double(), ["x"], ["y"])


def batch(rows: int = 5) -> TensorDict:
    return TensorDict(
        x=torch.randn(rows, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1)), batch_size=[rows]
    )


def explained(method, td: TensorDict) -> tuple[torch.Tensor, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        attribution = method(td.clone())["attribution", "x"]
    return attribution, [str(w.message) for w in caught if MIXES in str(w.message)]


@pytest.mark.parametrize("how", ["mean", "batch_norm"])
def test_integrated_gradients_is_the_path_integral_of_each_point_as_the_batch_it_is(how: str) -> None:
    """The oracle: the Riemann sum written out, each point of the path run as a batch of its own. Stacked, the points
    were centred by the mean of all of them (0.27 off, relative L2, for ``mean``)."""
    td, n = batch(), 4
    attribution, (message,) = explained(
        IntegratedGradients(module(how), n_steps=n, method="riemann_right", target=0), td
    )
    model, x = module(how).module, td["x"]
    expected = torch.zeros_like(x)
    for k in range(1, n + 1):
        point = (x * k / n).requires_grad_(True)
        expected += torch.autograd.grad(model(point)[:, 0].sum(), point)[0] / n
    torch.testing.assert_close(attribution, x * expected, rtol=1e-10, atol=1e-12)
    assert "IntegratedGradients: module 'centring' (Centring)" in message and "internal_batch_size=5" in message


@pytest.mark.parametrize(
    "make",
    [
        lambda m, **kw: SmoothGrad(m, n_samples=6, stdev=0.3, seed=1, target=0, **kw),
        lambda m, **kw: GradientShap(
            m, baselines=torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2)),
            n_samples=4, seed=1, target=0, **kw,
        ),
        lambda m, **kw: Occlusion(m, sliding_window_shapes=(1,), target=0, **kw),
    ],
    ids=["SmoothGrad", "GradientShap", "Occlusion"],
)  # fmt: skip
def test_stacked_copies_give_what_one_copy_per_pass_gives(make, request) -> None:
    one_per_pass = {"Occlusion": {"perturbations_per_eval": 1}}.get(
        request.node.callspec.id, {"internal_batch_size": 5}
    )
    stacked = {"Occlusion": {"perturbations_per_eval": 4}}.get(request.node.callspec.id, {})
    td = batch()
    attribution, (message,) = explained(make(module(), **stacked), td)
    expected, none = explained(make(module(), **one_per_pass), td)
    assert none == [] and expected.abs().max() > 0.01
    torch.testing.assert_close(attribution, expected, rtol=1e-10, atol=1e-12)
    assert message.startswith(f"{request.node.callspec.id}: module 'centring' (Centring) {MIXES}")


class LinearCalls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is nn.functional.linear:
            self.rows.append(args[0].shape[0])
        return func(*args, **(kwargs or {}))


def test_a_model_of_layers_that_keep_samples_apart_runs_no_extra_pass() -> None:
    net = TensorDictModule(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double(), ["x"], ["y"])
    assert copies_apart(net) and not copies_apart(module())
    with LinearCalls() as calls:
        attribution, found = explained(IntegratedGradients(net, n_steps=8, target=0), batch())
    assert found == [] and calls.rows == [5, 5, 40, 40]  # the unperturbed pass, then the 8 points in one pass


def test_a_model_that_keeps_samples_apart_is_compared_once_per_call_and_not_named() -> None:
    """A model no list vouches for (a module of the caller's) is compared: its first and middle copies alone."""

    class Tanh(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(x)

    net = TensorDictModule(nn.Sequential(nn.Linear(4, 8), Tanh(), nn.Linear(8, 3)).double(), ["x"], ["y"])
    with LinearCalls() as calls:
        attribution, found = explained(IntegratedGradients(net, n_steps=8, target=0), batch())
    assert found == [] and calls.rows == [5, 5, 40, 40, 5, 5, 5, 5]
    expected = explained(IntegratedGradients(net, n_steps=8, target=0, internal_batch_size=5), batch())[0]
    torch.testing.assert_close(attribution, expected, rtol=1e-10, atol=1e-12)


def test_a_model_that_computes_coarser_than_it_returns_is_not_named() -> None:
    """float32 layers returning float64: a float32 product's rounding depends on the rows of the pass (7e-8 here),
    far above float64's tolerance. The model was named as mixing its samples, and ran one copy per pass."""

    class Wide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(64, 1024), nn.Linear(1024, 1024), nn.Linear(1024, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c(torch.relu(self.b(torch.relu(self.a(x))))).double()

    torch.manual_seed(0)
    net = TensorDictModule(Wide(), ["x"], ["y"])
    td = TensorDict(x=torch.randn(7, 64), batch_size=[7])
    with LinearCalls() as calls:
        found = explained(IntegratedGradients(net, n_steps=50, target=0), td)[1]
    assert found == [] and max(calls.rows) == 7 * 50  # the path in one pass


class Centred(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h - h.mean(0)


def test_a_scripted_module_that_mixes_is_named_by_the_module_around_it() -> None:
    """A TorchScript module takes no forward hook: the search for the module that mixes failed with a RuntimeError."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), torch.jit.script(Centred()), nn.Tanh(), nn.Linear(8, 3)).double()
    make = lambda **kw: IntegratedGradients(TensorDictModule(model, ["x"], ["y"]), n_steps=4, target=0, **kw)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.script's deprecation
        attribution, (message,) = explained(make(), batch())
    assert message.startswith(f"IntegratedGradients: the model (Sequential) {MIXES}")
    torch.testing.assert_close(attribution, explained(make(internal_batch_size=5), batch())[0], rtol=1e-10, atol=1e-12)


class RareExploration(nn.Module):
    """Each sample's units replaced by zeros with probability 0.03, each sample apart: two passes of one copy often
    draw nothing, a stacked pass of many copies almost always something."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.where(torch.rand(h.shape[0], 1) < 0.03, torch.zeros_like(h), h)


def test_a_model_drawing_rarely_at_random_is_not_named_as_mixing() -> None:
    """Named as mixing in 10 of 40 seeds: the draws, not the batch, made the stack differ."""
    net = TensorDictModule(
        nn.Sequential(nn.Linear(4, 8), nn.Tanh(), RareExploration(), nn.Linear(8, 2)).double(), ["x"], ["y"]
    )
    td = TensorDict(x=torch.randn(3, 4, dtype=torch.float64), batch_size=[3])
    named = 0
    for seed in range(40):
        torch.manual_seed(seed)
        named += bool(explained(IntegratedGradients(net, n_steps=32, target=0), td)[1])
    assert named == 0


def test_a_wrapper_whose_model_mixes_warns_once_and_runs_one_copy_per_pass_from_then_on() -> None:
    """Every call compared its stack again (three passes more) and warned again (the figure in the message differs
    from call to call, so Python's filter let each through)."""
    method, td = IntegratedGradients(module(), n_steps=8, target=0), batch()
    first, (message,) = explained(method, td)
    with LinearCalls() as calls:
        second, found = explained(method, td)
    assert found == [] and max(calls.rows) == 5  # one copy of the batch per pass, no stacked pass
    torch.testing.assert_close(second, first, rtol=1e-12, atol=1e-14)


# A batch [] holds one sample, which the model's own pass reads at its shape; stacked, the copies are a new first
# dimension of it. A classifier of [rows, classes] normalising over dim=1, or a GRU over an unbatched [T, F]
# trajectory, then reads the copies otherwise: IntegratedGradients was 0.087 off captum's (whose batch is the rows)
# and FeatureAblation 1.7 (the classifier) and 0.46 (the GRU, even one copy per pass, run as [1, T, F]) off the
# definition, with no warning.
N_ROWS, N_FEATURES = 4, 5


def _rows_classifier() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(N_FEATURES, 8), nn.Tanh(), nn.Linear(8, 3), nn.LogSoftmax(dim=1)).double().eval()


class _Trajectory(nn.Module):
    """A GRU over one unbatched trajectory ``[T, F]`` (time first), a score per step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gru, self.head = nn.GRU(N_FEATURES, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(x)[0])


def _ablated_one_by_one(net: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """FeatureAblation's definition, each element its own group, by direct passes at the sample's shape."""
    expected = torch.zeros_like(x)
    with torch.no_grad():
        full = net(x).gather(-1, target[:, None]).sum()
        for index in range(x.numel()):
            changed = x.clone()
            changed.view(-1)[index] = 0.0
            expected.view(-1)[index] = full - net(changed).gather(-1, target[:, None]).sum()
    return expected


@pytest.mark.parametrize("per_eval", [1, 3])
@pytest.mark.parametrize("kind", ["classifier", "trajectory"])
def test_the_copies_of_a_batch_of_none_run_at_the_samples_shape(kind, per_eval):
    net = _rows_classifier() if kind == "classifier" else _Trajectory().double().eval()
    x = torch.randn(N_ROWS, N_FEATURES, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        target = net(x).argmax(-1)
    method = FeatureAblation(
        net, in_keys=["x"], out_keys=["y"], target=target, feature_masks=torch.arange(x.numel()).view_as(x),
        perturbations_per_eval=per_eval,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = method(TensorDict(x=x, batch_size=[]))["attribution", "x"]
    assert relative_error(found, _ablated_one_by_one(net, x, target)) <= 1e-12
    told = [str(w.message) for w in caught if "reads the dimensions of its input from the front" in str(w.message)]
    assert len(told) == (per_eval > 1 and kind == "classifier"), told  # the GRU is told apart by its time lengths


class AddsItsBatch(nn.Module):
    """A model of one unbatched sample ``[C, L]`` that adds the batch dimension itself (a wrapper around a Hugging
    Face model fed ``embeds[None]``): copies stacked along a new first dimension make its convolution's input 4-D."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv1d(2, 3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.conv(x[None]))[0].sum(-1)


@pytest.mark.parametrize("method", [IntegratedGradients, SmoothGrad, GradientShap, FeatureAblation])
def test_a_model_that_cannot_take_a_samples_stacked_copies_is_told_how_to_run_them_one_per_pass(method):
    """The error came from inside the model with no word of the stacking; a note says what to pass."""
    net = AddsItsBatch().double()
    x = torch.randn(2, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    options = {
        IntegratedGradients: {"n_steps": 4},
        SmoothGrad: {"n_samples": 3, "stdev": 0.1, "seed": 0},
        GradientShap: {"baselines": torch.zeros(1, 2, 6, dtype=torch.float64), "n_samples": 3, "seed": 0},
        FeatureAblation: {"feature_masks": torch.arange(12).view(2, 6), "perturbations_per_eval": 4},
    }[method]
    option = "perturbations_per_eval" if method is FeatureAblation else "internal_batch_size"
    with pytest.raises(RuntimeError) as info:
        method(net, in_keys=["x"], out_keys=["y"], target=1, **options)(TensorDict(x=x, batch_size=[]))
    assert any("stacked along a new first dimension" in note and f"{option}=1" in note for note in info.value.__notes__)
    one_per_pass = {**options, option: 1}
    found = method(net, in_keys=["x"], out_keys=["y"], target=1, **one_per_pass)(TensorDict(x=x, batch_size=[]))
    # The same model taking a batch, on a batch of the one sample: what the advice gives.
    batched = {**options, "feature_masks": options["feature_masks"][None]} if "feature_masks" in options else options
    taking_a_batch = BatchOf(net)
    expected = method(taking_a_batch, in_keys=["x"], out_keys=["y"], target=1, **batched)(
        TensorDict(x=x[None], batch_size=[1])
    )
    torch.testing.assert_close(found["attribution", "x"], expected["attribution", "x"][0], rtol=1e-12, atol=1e-14)


class BatchOf(nn.Module):
    """``AddsItsBatch``'s layers on a batch."""

    def __init__(self, net: AddsItsBatch) -> None:
        super().__init__()
        self.conv = net.conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.conv(x)).sum(-1)


def test_integrated_gradients_of_keyword_rows_equal_captums_attribute():
    """``method(x=x)`` is captum's ``attribute(x)`` (docs/methods.md): the gradient methods explain each row."""
    from captum import attr as captum

    net = _rows_classifier()
    x = torch.randn(N_ROWS, N_FEATURES, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        target = net(x).argmax(-1)
    _, found = IntegratedGradients(net, in_keys=["x"], out_keys=["y"], target=target, n_steps=16)(x=x)
    expected = captum.IntegratedGradients(net).attribute(x, target=target, n_steps=16)
    assert relative_error(found, expected) <= 1e-9  # captum's Gauss-Legendre weights are float32


@pytest.mark.parametrize(
    ("layer", "apart"),
    [
        (nn.LogSoftmax(dim=1), False), (nn.LogSoftmax(dim=-1), True), (nn.Flatten(), False),
        (nn.Flatten(-2), True), (nn.BatchNorm1d(4).eval(), False), (nn.GroupNorm(2, 4), False),
        (nn.Conv1d(4, 4, 1), False), (nn.LayerNorm(4), True), (nn.Linear(4, 4), True),
    ],
)  # fmt: skip
def test_on_a_batch_of_none_only_layers_that_read_the_last_dimensions_are_vouched_for(layer, apart):
    assert copies_apart(nn.Sequential(nn.Linear(4, 4), layer), 0) is apart
