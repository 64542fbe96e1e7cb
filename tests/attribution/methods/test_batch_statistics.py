"""Models that normalise over the batch (BatchNorm in training mode): each copy alone, running statistics kept."""

from __future__ import annotations

import copy

import pytest
import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torch import nn
from torchrl.modules import BatchRenorm1d

from tdhook.attribution import LRP, EpsilonPlus, IntegratedGradients, Saliency
from tdhook.attribution.methods._batch_statistics import (
    BufferHolders,
    BufferValues,
    batch_normalisers,
    buffers_kept,
    buffers_restored_on_error,
)
from tdhook.attribution.methods._quadrature import quadrature
from tests.attribution._interrupts import Interrupt, every_line
from tests.attribution.methods._models import FromCallersStatistics
from tests.attribution.methods.test_base import METHODS, make
from tests.conftest import relative_error


def batch_norm_mlp(norm: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), norm, nn.Tanh(), nn.Linear(6, 3)).double().train()


NORMS = {
    "training": lambda: nn.BatchNorm1d(6),
    "no running statistics": lambda: nn.BatchNorm1d(6, track_running_stats=False).eval(),
    "batch renorm": lambda: BatchRenorm1d(6, warmup_steps=0),
}
# Each method with the option that puts several copies of the batch in one forward pass, and one copy per pass.
STACKED = {
    "IntegratedGradients": ("internal_batch_size", None),
    "SmoothGrad": ("internal_batch_size", None),
    "GradientShap": ("internal_batch_size", None),
    "FeatureAblation": ("perturbations_per_eval", 100),
    "Occlusion": ("perturbations_per_eval", 100),
    "ShapleyValueSampling": ("perturbations_per_eval", 100),
}


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in module.state_dict().items()}


@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize("name", list(STACKED))
def test_stacked_copies_equal_one_copy_per_pass(name, norm):
    """The batch statistics of a perturbed pass are those of one perturbed batch, however many run at once."""
    net = batch_norm_mlp(NORMS[norm]())
    td = TensorDict(x=torch.randn(4, 5, dtype=torch.float64), batch_size=[4])
    option, stacked = STACKED[name]
    one = {option: 4 if option == "internal_batch_size" else 1}  # a copy of the batch of 4 per pass
    if name in ("FeatureAblation", "ShapleyValueSampling"):
        one["feature_masks"] = torch.tensor([0, 0, 1, 2, 3])  # 4 groups: several perturbed copies
    alone = make(name, copy.deepcopy(net), in_keys=["x"], out_keys=["y"], **one)  # each call moves the statistics
    together = make(name, net, in_keys=["x"], out_keys=["y"], **{**one, option: stacked})
    expected = alone(td.clone())["attribution", "x"]
    assert relative_error(together(td.clone())["attribution", "x"], expected) <= 1e-12


def renorm_mlp() -> nn.Module:
    """A model whose output in training mode depends on its running statistics (torchrl's BatchRenorm1d after
    warmup), which its passes move a lot (momentum 0.5), and whose last input feature has no effect."""
    net = batch_norm_mlp(BatchRenorm1d(6, warmup_steps=1, momentum=0.5))
    net(torch.randn(8, 5, dtype=torch.float64))  # past warmup: r and d read the running statistics
    with torch.no_grad():
        net[0].weight[:, 4] = 0.0
    return net


@pytest.mark.parametrize("name", list(METHODS))
def test_every_pass_starts_from_the_callers_running_statistics(name):
    """BatchRenorm1d in training mode normalises with its running statistics: every perturbed pass runs from the
    statistics as the caller left them, not as the unperturbed pass moved them (the perturbation and path
    methods were 0.4 to 2.4 off, relative; FeatureAblation gave the feature without effect a nonzero share)."""
    net = renorm_mlp()
    x = torch.randn(4, 5, dtype=torch.float64)
    stacked = dict([STACKED[name]]) if name in STACKED else {}  # several copies per pass, where they may be
    masks = {"feature_masks": torch.arange(5)} if name in ("FeatureAblation", "ShapleyValueSampling") else {}
    expected = make(name, FromCallersStatistics(net), in_keys=["x"], out_keys=["y"], **stacked, **masks)
    expected = expected(TensorDict(x=x, batch_size=[4]))["attribution", "x"]
    got = make(name, net, in_keys=["x"], out_keys=["y"], **stacked, **masks)(TensorDict(x=x, batch_size=[4]))
    assert relative_error(got["attribution", "x"], expected) <= 1e-12
    if masks:
        assert got["attribution", "x"][:, 4].abs().max() <= 1e-12


@pytest.mark.parametrize("norm", ["batch norm", "batch renorm"])
@pytest.mark.parametrize("name", list(METHODS))
def test_running_statistics_as_after_one_forward_pass(name, norm):
    """The call leaves the model as one plain forward pass on the caller's input would: perturbed passes count not."""
    net = batch_norm_mlp(nn.BatchNorm1d(6)) if norm == "batch norm" else renorm_mlp()
    x = torch.randn(4, 5, dtype=torch.float64)
    plain = copy.deepcopy(net)
    plain(x.clone())
    make(name, net, in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[4]))
    for key, value in state(plain).items():
        torch.testing.assert_close(net.state_dict()[key], value, rtol=0, atol=0, msg=key)


class LastStepOfContext(TensorDictModuleBase):
    """Reads a ``[B, T]`` context and acts once per context: it returns a TensorDict of batch ``[B]``."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net, self.in_keys, self.out_keys = net, ["x"], ["y"]

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        x = td["x"]
        return TensorDict(x=x, y=self.net(x[:, -1] if x.dim() == 3 else x), batch_size=td.batch_size[:1])


@pytest.mark.parametrize("name", ["Saliency", "FeatureAblation"])
def test_a_module_returning_fewer_batch_dimensions_moves_the_statistics_once(name):
    """The call explains again in the module's batch, running its own pass again: the first is undone (the
    statistics moved twice, 0.03 to 0.08 off one plain pass)."""
    net = batch_norm_mlp(nn.BatchNorm1d(6))
    x = torch.randn(4, 2, 5, dtype=torch.float64)
    plain = copy.deepcopy(net)
    plain(x[:, -1].clone())
    make(name, LastStepOfContext(net), in_keys=["x"])(TensorDict(x=x, batch_size=[4, 2]))
    for key, value in state(plain).items():
        torch.testing.assert_close(net.state_dict()[key], value, rtol=1e-12, atol=1e-12, msg=key)


@pytest.mark.parametrize("name", list(METHODS))
def test_a_failed_call_leaves_the_running_statistics(name):
    """A call that fails after the model's own pass (here a key the target does not come from) moves nothing."""
    net = batch_norm_mlp(nn.BatchNorm1d(6))
    before = state(net)
    td = TensorDict(x=torch.randn(4, 5, dtype=torch.float64), batch_size=[4])
    with pytest.raises(IndexError, match=f"{name}: target 7 is out of range"):
        make(name, net, in_keys=["x"], out_keys=["y"], target=7)(td)
    for key, value in before.items():
        torch.testing.assert_close(net.state_dict()[key], value, rtol=0, atol=0, msg=key)
    assert list(td.keys()) == ["x"]


@pytest.mark.parametrize("name", list(METHODS))
def test_a_call_whose_write_fails_leaves_the_running_statistics(name):
    """The results cannot be written (the caller's TensorDict holds a tensor where their branch goes): the model's
    pass is undone too."""
    net = batch_norm_mlp(nn.BatchNorm1d(6))
    before = state(net)
    td = TensorDict(x=torch.randn(4, 5, dtype=torch.float64), attribution=torch.zeros(4), batch_size=[4])
    with pytest.raises(Exception):  # noqa: B017 (tensordict's own error)
        make(name, net, in_keys=["x"], out_keys=["y"])(td)
    for key, value in before.items():
        torch.testing.assert_close(net.state_dict()[key], value, rtol=0, atol=0, msg=key)
    assert sorted(td.keys()) == ["attribution", "x"]


@pytest.mark.parametrize("name", ["Saliency", "IntegratedGradients", "Occlusion"])
def test_a_call_interrupted_at_any_line_leaves_the_running_statistics(name):
    """A ``KeyboardInterrupt`` at any line of tdhook's code in the call (every STRIDE-th line; every line checked by
    hand) but those of the outer scope that puts the buffers back when the call fails."""
    net = batch_norm_mlp(nn.BatchNorm1d(6))
    method = make(name, net, in_keys=["x"], out_keys=["y"])
    x = torch.randn(4, 5, dtype=torch.float64)
    skip = ("buffers_restored_on_error",)
    for at in every_line(lambda: method(TensorDict(x=x, batch_size=[4])), skip, start=1):
        before, td = state(net), TensorDict(x=x, batch_size=[4])
        with Interrupt(at, skip) as interrupt:
            method(td)
        if interrupt.where is not None and list(td.keys()) == ["x"]:  # a call that raised and wrote nothing
            for key, value in before.items():
                torch.testing.assert_close(net.state_dict()[key], value, rtol=0, atol=0, msg=interrupt.where)


def test_buffers_kept_interrupted_while_swapping_copies_in_leaves_the_models_own():
    """The metrics run their passes in ``buffers_kept`` alone: an interrupt while it swaps the copies in (every line
    of entering it) leaves the model's own buffers in place."""
    net = batch_norm_mlp(nn.BatchNorm1d(6))
    own = [id(buffer) for buffer in net.buffers()]
    for at in every_line(lambda: buffers_kept(net).__enter__(), stride=1):
        kept = buffers_kept(net)
        with Interrupt(at) as interrupt:
            kept.__enter__()
        if interrupt.where is None:
            kept.__exit__(None, None, None)
        assert [id(buffer) for buffer in net.buffers()] == own, interrupt.where


def test_integrated_gradients_against_the_quadrature_of_whole_batches():
    """Each point of the path is a batch normalised by its own statistics: the quadrature written out."""
    net = batch_norm_mlp(nn.BatchNorm1d(6))
    x = torch.randn(4, 5, dtype=torch.float64)
    baseline = torch.randn(5, dtype=torch.float64)
    td = IntegratedGradients(net, in_keys=["x"], out_keys=["y"], baselines=baseline, n_steps=5, target=1)(
        TensorDict(x=x, batch_size=[4])
    )
    alphas, weights = quadrature("gausslegendre", 5)
    reference = copy.deepcopy(net)
    total = torch.zeros_like(x)
    for alpha, weight in zip(alphas.tolist(), weights.tolist(), strict=True):
        point = (baseline + alpha * (x - baseline)).requires_grad_(True)
        (gradient,) = torch.autograd.grad(reference(point)[:, 1].sum(), point)
        total += weight * gradient
    assert relative_error(td["attribution", "x"], total * (x - baseline)) <= 1e-12


def test_helpers_name_the_normalisers_and_restore_buffers():
    net = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3), nn.Sequential(nn.BatchNorm1d(3).eval())).train()
    net[2].eval()
    assert batch_normalisers(dict(net.named_modules())) == ["1"]
    before = state(net)
    with pytest.raises(RuntimeError, match="inside"), buffers_kept(net):
        net(torch.randn(4, 2))
        raise RuntimeError("inside")
    for key, value in before.items():
        assert torch.equal(net.state_dict()[key], value), key


MEAN_VAR = ["running_mean", "running_var"]


def _holder_names(model: nn.Module, holders: BufferHolders) -> list[str]:
    names = {module: name for name, module in model.named_modules()}
    return sorted(names[module] for module in holders.of(model) if module in names)


def test_buffer_holders_follow_every_change_of_the_model():
    """The modules holding buffers are found again after a module is put in, replaced or removed by any means
    (registration or a write into ``_modules``), or a buffer registered, written in or deleted."""
    net = nn.Sequential(nn.Linear(2, 3), nn.Identity(), nn.Sequential(nn.Tanh()))
    holders = BufferHolders()
    assert _holder_names(net, holders) == []
    net.insert(1, nn.BatchNorm1d(3))  # writes into _modules
    assert _holder_names(net, holders) == ["1"]
    net[3]._modules["0"] = nn.BatchNorm1d(3)  # a deeper child replaced, same number of children
    assert _holder_names(net, holders) == ["1", "3.0"]
    net[2]._buffers["count"] = torch.zeros(())
    assert _holder_names(net, holders) == ["1", "2", "3.0"]
    del net[3]
    net[0].register_buffer("mask", torch.ones(3))
    assert _holder_names(net, holders) == ["0", "1", "2"]
    del net[2]._buffers["count"]  # a module listed with no buffer left: its buffers are read on every call
    assert sorted(name for _, name in BufferValues(net, holders)._kept) == ["mask", "num_batches_tracked", *MEAN_VAR]
    other = copy.deepcopy(net)
    assert _holder_names(other, holders) == ["0", "1"]  # another model: found anew


def test_buffer_holders_copied_with_a_wrapper_start_anew():
    holders = BufferHolders()
    net = nn.Sequential(nn.BatchNorm1d(3))
    holders.of(net)
    copied = copy.deepcopy((net, holders))
    assert copied[1]._found is None
    assert copied[1].of(copied[0]) == [copied[0][0]]


def test_a_model_without_buffers_in_training_mode_shares_one_context_that_keeps_nothing():
    holders = BufferHolders()
    net = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3)).eval()
    first, second = buffers_restored_on_error(net, holders), buffers_restored_on_error(net, holders)
    assert first is second
    net.train()
    with pytest.raises(RuntimeError):
        with buffers_restored_on_error(net, holders):
            net(torch.randn(4, 2))
            raise RuntimeError("a later step failed")
    assert int(net[1].num_batches_tracked) == 0


@pytest.mark.parametrize("name", ["LRP", *(name for name in METHODS if name != "GradientShap")])  # its baselines: 'obs'
def test_a_buffer_not_yet_initialised_is_passed_over(name):
    """A lazy BatchNorm in training mode before its first call holds uninitialised buffers, which hold no value to
    keep: the first call runs, gives the plain model's output, and leaves the statistics one plain pass leaves."""

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 6), nn.LazyBatchNorm1d(), nn.ReLU(), nn.Linear(6, 2)).double()

    x = torch.randn(5, 4, dtype=torch.float64)
    plain = model()
    expected = plain(x)
    if name == "LRP":
        from tdhook.attribution import LRP, EpsilonPlus

        explainer = LRP(model(), EpsilonPlus(), in_keys=["x"], out_keys=["y"])
    else:
        explainer = make(name, model(), in_keys=["x"], out_keys=["y"])
    out = explainer(TensorDict(x=x, batch_size=[5]))
    torch.testing.assert_close(out["y"], expected.detach(), rtol=0, atol=0)
    relevance = out["relevance" if name == "LRP" else "attribution", "x"]
    assert relevance.shape == x.shape and bool(relevance.isfinite().all())
    torch.testing.assert_close(explainer.module.module[1].running_mean, plain[1].running_mean, rtol=0, atol=0)


@pytest.mark.parametrize("wrapper", ["LRP", "Saliency"])
def test_a_call_refused_before_the_model_runs_leaves_the_buffers_version_counters_as_they_were(wrapper):
    """A locked TensorDict is refused before the model runs: the buffers of a BatchNorm in training mode were
    written back all the same (their values unchanged, their version counters moved, which a tensor saved for a
    backward pass of the caller's checks); a call that fails after the model ran gives the values back."""
    from tensordict.nn import TensorDictModule

    from tdhook.attribution import LRP, Saliency

    torch.manual_seed(0)
    net = batch_norm_mlp(nn.BatchNorm1d(6)).train()
    module = TensorDictModule(net, in_keys=["x"], out_keys=["y"])
    make_wrapper = {"LRP": LRP, "Saliency": Saliency}[wrapper]
    buffers = dict(net.named_buffers())
    before = {name: (buffer.clone(), buffer._version) for name, buffer in buffers.items()}
    td = TensorDict(x=torch.randn(5, 5, dtype=torch.float64), batch_size=[5]).lock_()
    with pytest.raises(RuntimeError, match="locked"):
        make_wrapper(module, target=0)(td)
    for name, buffer in buffers.items():
        assert torch.equal(buffer, before[name][0]) and buffer._version == before[name][1], name
    with pytest.raises(IndexError, match="target 7 is out of range"):
        make_wrapper(module, target=7)(td.unlock_())
    for name, buffer in buffers.items():
        assert torch.equal(buffer, before[name][0]), name


@pytest.mark.parametrize("wrapper", ["LRP", "Saliency"])
def test_a_call_failing_after_the_forward_leaves_the_callers_graph_able_to_run_backward(wrapper: str):
    """A graph of the caller's through a BatchNorm in training mode saves its running statistics, and torch checks
    their version counters in the backward pass. A call that fails once the model has run (a target out of range)
    gives the buffers their values and their version counters back: the caller's backward pass runs, with the
    gradient of a copy of the model that no call touched (putting the values back with ``copy_`` moved the counters,
    and the caller's backward pass raised that a saved tensor had been modified in place)."""
    model = batch_norm_mlp(nn.BatchNorm1d(6))
    untouched = copy.deepcopy(model)
    x = torch.randn(8, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    leaf, twin = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss, expected = model(leaf).square().sum(), untouched(twin).square().sum()
    buffers = {name: (buffer.clone(), buffer._version) for name, buffer in model.named_buffers()}
    bad = (
        LRP(model, EpsilonPlus(), in_keys=["x"], out_keys=["y"], target=10)
        if wrapper == "LRP"
        else Saliency(model, in_keys=["x"], out_keys=["y"], target=10)
    )
    with pytest.raises(IndexError, match="target 10 is out of range"):
        bad(TensorDict(x=x, batch_size=[8]))
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, buffers[name][0]) and buffer._version == buffers[name][1], name
    loss.backward()
    expected.backward()
    torch.testing.assert_close(leaf.grad, twin.grad, rtol=1e-12, atol=1e-12)
    for (name, parameter), other in zip(model.named_parameters(), untouched.parameters(), strict=True):
        torch.testing.assert_close(parameter.grad, other.grad, rtol=1e-12, atol=1e-12, msg=name)
