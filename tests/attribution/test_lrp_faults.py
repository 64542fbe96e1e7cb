"""Faults inside an open context: parameters changed between calls, non-finite samples, interrupts, copies.

Each test states what a user does inside ``with lrp:`` and checks that the
result is the one a fresh context (or a batch without the faulty sample) gives,
or that nothing of the context is left behind.
"""

from __future__ import annotations

import contextlib
import copy
import io
import pickle

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.rules import (
    CPLRP,
    AttnLRP,
    EpsilonAlpha2Beta1,
    EpsilonAlpha2Beta1Flat,
    EpsilonGammaBox,
    EpsilonPlus,
    EpsilonPlusFlat,
    FirstLayerRule,
    WSquareRule,
)

F64 = torch.float64

PRESETS = {
    "EpsilonPlus": EpsilonPlus,
    "EpsilonPlusFlat": EpsilonPlusFlat,
    "EpsilonGammaBox": lambda: EpsilonGammaBox(-3.0, 3.0),
    "EpsilonAlpha2Beta1": EpsilonAlpha2Beta1,
    "EpsilonAlpha2Beta1Flat": EpsilonAlpha2Beta1Flat,
    "WSquare first": lambda: EpsilonPlus(
        rule_mapper=lambda name, module: FirstLayerRule(WSquareRule()) if name in ("0", "6") else None
    ),
}


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 6),
        nn.ReLU(),
        nn.Linear(6, 3),
    ).to(F64)
    with torch.no_grad():
        model[1].running_mean.normal_()
        model[1].running_var.uniform_(0.5, 2.0)
    return model.eval()


def explain(lrp: LRP, x: torch.Tensor) -> torch.Tensor:
    return lrp(TensorDict(x=x, batch_size=[len(x)]))["relevance", "x"]


def change_parameters(model: nn.Module, how: str) -> None:
    if how in ("sgd", "adam"):
        optimizer = (
            torch.optim.SGD(model.parameters(), lr=0.5)
            if how == "sgd"
            else torch.optim.Adam(model.parameters(), lr=0.5, foreach=True)
        )
        generator = torch.Generator().manual_seed(1)
        for param in model.parameters():  # as a training step would leave them
            param.grad = torch.randn(param.shape, dtype=param.dtype, generator=generator)
        optimizer.step()
    elif how == "in place":
        with torch.no_grad():
            for module in model:
                if isinstance(module, (nn.Conv2d, nn.Linear)):
                    module.weight.mul_(-2.0)
            model[1].running_var.mul_(3.0)
    elif how == "replaced":
        for module in model:
            if isinstance(module, (nn.Conv2d, nn.Linear, nn.BatchNorm2d)):
                module.weight = nn.Parameter(module.weight.detach() * -1.5 + 0.1)
    elif how == "data":
        for module in model:
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                module.weight.data = module.weight.detach().flip(0).clone()
    elif how == "written through .data":  # in place, where no version counter sees it (the layers' own init does so)
        for module in model:
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                module.weight.data.copy_(module.weight.detach().flip(0))
        model[1].running_var.data.mul_(3.0)
    elif how == "BatchNorm through .data":  # the layer before it unchanged: only the merge changes
        model[1].weight.data.mul_(-3.0)
    elif how in ("soft update", "weight sync"):
        # torchrl's SoftUpdate (``target.data.lerp_(source.data, 1 - eps)``) and its weight sync schemes
        # (``destination.data.update_(weights.data)``) write the parameters through ``.data`` too.
        torch.manual_seed(1)
        counter = ("1", "num_batches_tracked")  # an integer buffer, left out of the update
        source = TensorDict.from_module(small_cnn().apply(_reset)).data.exclude(counter)
        target = TensorDict.from_module(model).data.exclude(counter)
        target.lerp_(source, 0.5) if how == "soft update" else target.update_(source)


def _reset(module: nn.Module) -> None:
    if isinstance(module, (nn.Conv2d, nn.Linear, nn.BatchNorm2d)):
        module.reset_parameters()
        if isinstance(module, nn.BatchNorm2d):
            with torch.no_grad():
                module.weight.uniform_(0.5, 2.0), module.bias.normal_(), module.running_var.uniform_(0.5, 2.0)


@pytest.mark.parametrize(
    "how",
    [
        "sgd",
        "adam",
        "in place",
        "replaced",
        "data",
        "written through .data",
        "BatchNorm through .data",
        "soft update",
        "weight sync",
    ],
)
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_rules_follow_parameters_changed_inside_the_context(preset: str, how: str):
    model = small_cnn()
    x = torch.randn(5, 3, 6, 6, dtype=F64)
    lrp = LRP(model, PRESETS[preset](), in_keys=["x"], out_keys=["y"])
    with lrp:
        before = explain(lrp, x)
        change_parameters(model, how)
        after = explain(lrp, x)
    fresh = explain(LRP(model, PRESETS[preset](), in_keys=["x"], out_keys=["y"]), x)
    assert not torch.allclose(before, fresh)  # the change matters
    torch.testing.assert_close(after, fresh, rtol=1e-12, atol=1e-12)


def small_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).to(F64)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("preset", ["EpsilonPlus", "EpsilonPlusFlat", "EpsilonGammaBox", "EpsilonAlpha2Beta1"])
@pytest.mark.parametrize("net", ["cnn", "mlp"])
def test_a_non_finite_sample_leaves_the_other_samples_relevance_alone(net: str, preset: str, bad: float):
    model = small_cnn() if net == "cnn" else small_mlp()
    torch.manual_seed(1)
    x = torch.randn((6, 3, 6, 6) if net == "cnn" else (6, 5), dtype=F64)
    x[1] = x[1].abs()  # a sample without negative entries beside others with some
    lrp = LRP(model, PRESETS[preset](), in_keys=["x"], out_keys=["y"])
    for bad_sample, whole in ((0, False), (3, False), (5, True)):
        faulty = x.clone()
        if whole:
            faulty[bad_sample] = bad  # the whole sample
        else:
            faulty[bad_sample].view(-1)[2] = bad  # one entry
        finite = [i for i in range(len(x)) if i != bad_sample]
        expected = explain(lrp, x[finite])
        with lrp:
            actual = explain(lrp, faulty)
        torch.testing.assert_close(actual[finite], expected, rtol=1e-9, atol=1e-12)


class Interrupting(nn.LayerNorm):
    """A LayerNorm that raises ``error`` in its forward pass when armed."""

    error: BaseException | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.error is not None:
            raise self.error
        return super().forward(x)


class GatedNet(nn.Module):
    """A norm, a sigmoid gate (HeldGates under the CNN presets) and ruled Linear layers around them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.norm, self.body, self.gate, self.head = (
            nn.Linear(5, 8),
            Interrupting(8),
            nn.Linear(8, 8),
            nn.Sigmoid(),
            nn.Linear(8, 3),
        )
        self.to(F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.relu(self.inp(x)))
        return self.head(torch.relu(self.body(h)) * self.gate(self.body(h)))


def global_state() -> tuple:
    return (
        torch.is_grad_enabled(),
        torch._C._is_torch_function_enabled(),
        torch._C._is_torch_function_mode_enabled(),
        len(torch.overrides._get_current_function_mode_stack()),
        len(torch.nn.modules.module._global_forward_hooks),
        len(torch.nn.modules.module._global_forward_pre_hooks),
        len(torch.nn.modules.module._global_backward_hooks),
    )


def module_state(model: nn.Module) -> list:
    return [
        (
            sorted((k, list(v)) for k, v in vars(m).items() if "hooks" in k and isinstance(v, dict)),
            vars(m).get("forward"),
            {k: (v, v._version, v.data_ptr()) for k, v in [*m._parameters.items(), *m._buffers.items()]},
        )
        for m in model.modules()
    ]


MAPPERS_WITH_MODES = {
    "EpsilonPlus": EpsilonPlus,  # HeldGates for the sigmoid gate
    "EpsilonGammaBox": lambda: EpsilonGammaBox(-3.0, 3.0),
    "AttnLRP": AttnLRP,  # FunctionalRules, paused inside ruled modules
    "CPLRP": CPLRP,
    "AttnLRP stabilised": lambda: AttnLRP(stabilize_additions=True),
}


def arm(model: GatedNet, where: str, error: BaseException) -> list:
    """Make the model raise ``error`` at ``where``; returns hook handles to remove afterwards."""
    if where == "norm forward":
        model.norm.error = error
        return []

    def hook(*args):
        raise error

    if where == "forward hook":
        return [model.body.register_forward_hook(hook)]
    if where == "forward pre-hook":
        return [model.head.register_forward_pre_hook(hook)]
    if where == "gate forward hook":
        return [model.gate.register_forward_hook(hook)]
    raise AssertionError(where)


@pytest.mark.parametrize("error", [KeyboardInterrupt, GeneratorExit, SystemExit, RuntimeError])
@pytest.mark.parametrize("where", ["norm forward", "forward hook", "forward pre-hook", "gate forward hook"])
@pytest.mark.parametrize("mapper", sorted(MAPPERS_WITH_MODES))
def test_an_interrupt_inside_the_model_leaves_everything_as_before(mapper: str, where: str, error: type):
    model = GatedNet()
    x = torch.randn(4, 5, dtype=F64)
    lrp = LRP(model, MAPPERS_WITH_MODES[mapper](), in_keys=["x"], out_keys=["y"])
    expected = explain(lrp, x)
    before_global, before_model = global_state(), module_state(model)
    handles = arm(model, where, error())
    with lrp:
        with pytest.raises(error):
            explain(lrp, x)
        assert global_state() == before_global  # inside the context too: nothing of the call is left
    with pytest.raises(error):
        explain(lrp, x)  # the context entered for the call alone
    for handle in handles:
        handle.remove()
    model.norm.error = None
    assert global_state() == before_global
    assert module_state(model) == before_model
    torch.testing.assert_close(explain(lrp, x), expected, rtol=0, atol=0)
    with lrp:
        torch.testing.assert_close(explain(lrp, x), expected, rtol=0, atol=0)


class ProbedConv(nn.Conv2d):
    """A convolution with a forward of its own: entering a context runs it once on a probe input (to read the
    weight it computes with), and it raises ``error`` there when armed."""

    error: BaseException | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.error is not None:
            raise self.error
        return super().forward(x)


@pytest.mark.parametrize("error", [KeyboardInterrupt, GeneratorExit, RuntimeError])
@pytest.mark.parametrize("mapper", ["EpsilonPlus", "AttnLRP"])
def test_an_interrupt_while_entering_the_context_leaves_everything_as_before(mapper: str, error: type):
    torch.manual_seed(0)
    model = nn.Sequential(
        ProbedConv(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16, 4), nn.Sigmoid(), nn.LayerNorm(4), nn.Linear(4, 2)
    ).to(F64)
    conv_rule = EpsilonPlus()("0", model[0])  # z+ on the convolution: its modified weights are built when entering
    lrp = LRP(
        model,
        MAPPERS_WITH_MODES[mapper](rule_mapper=lambda name, module: conv_rule if name == "0" else None),
        in_keys=["x"],
        out_keys=["y"],
    )
    x = torch.randn(3, 3, 4, 4, dtype=F64)
    expected = explain(lrp, x)
    before_global, before_model = global_state(), module_state(model)
    model[0].error = error()
    with pytest.raises(error):
        lrp.__enter__()
    assert global_state() == before_global
    assert module_state(model) == before_model
    model[0].error = None
    torch.testing.assert_close(explain(lrp, x), expected, rtol=0, atol=0)


def copies_of(model: nn.Module, how: str) -> nn.Module:
    if how == "deepcopy":
        return copy.deepcopy(model)
    if how == "pickle":
        return pickle.loads(pickle.dumps(model))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
@pytest.mark.parametrize("mapper", ["EpsilonPlusFlat", "EpsilonGammaBox", "AttnLRP"])
def test_a_copy_made_inside_the_context_has_no_rules(mapper: str, how: str):
    model = GatedNet()
    reference = copy.deepcopy(model)  # outside any context
    mappers = {**PRESETS, **MAPPERS_WITH_MODES}
    wrapped = TensorDictModule(model, in_keys=["x"], out_keys=["y"])
    lrp = LRP(wrapped, mappers[mapper](), relevance_check=lambda *args: None, layers=["module.body"])
    x = torch.randn(4, 5, dtype=F64)
    before = module_state(model)
    expected = explain(lrp, x)
    with lrp:
        copied = copies_of(model, how)
        # No hook of the context and no method of its own in the copy: its output and gradient are the plain ones.
        for module in copied.modules():
            hooks = [k for k, v in vars(module).items() if "hooks" in k and isinstance(v, dict) and v]
            assert not hooks and "__getstate__" not in vars(module) and "forward" not in vars(module), module
        for net in (copied, copy.deepcopy(copied)):
            x_copy, x_reference = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
            y_copy, y_reference = net(x_copy), reference(x_reference)
            torch.testing.assert_close(y_copy, y_reference, rtol=0, atol=0)
            grad_copy = torch.autograd.grad(y_copy.sum(), x_copy)[0]
            grad_reference = torch.autograd.grad(y_reference.sum(), x_reference)[0]
            torch.testing.assert_close(grad_copy, grad_reference, rtol=0, atol=0)
        # The original keeps its rules: the same relevance as before the copy.
        torch.testing.assert_close(explain(lrp, x), expected, rtol=0, atol=0)
        # The copy is explained in a context of its own while the original's is open.
        copy_lrp = LRP(TensorDictModule(copied, in_keys=["x"], out_keys=["y"]), mappers[mapper]())
        torch.testing.assert_close(explain(copy_lrp, x), expected, rtol=0, atol=0)
    assert module_state(model) == before
    assert not any("__getstate__" in vars(module) for module in model.modules())


class SnapshotNet(nn.Module):
    """``head(gelu(q(x)) * k(x))`` whose forward copies the whole model when ``how`` is set: a copy made in the
    middle of a call, while a later call of a context runs the GELU module without its hooks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.act, self.head = nn.Linear(5, 8), nn.Linear(5, 8), nn.GELU(), nn.Linear(8, 3)
        self.to(F64)
        self.how, self.copies = None, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.head(self.act(self.q(x)) * self.k(x))
        if self.how is not None:
            how, self.how = self.how, None
            self.copies.append(copies_of(self, how))
        return y


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_a_copy_made_during_a_later_call_runs_its_activations_own_way(how: str):
    """A copy made while a later call of a context runs an activation module without its hooks leaves that out: the
    copy's module runs its own hooks, and its own wrapper explains it as the original."""
    model, x = SnapshotNet(), torch.randn(4, 5, dtype=F64)
    lrp = LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"])
    expected = explain(lrp, x)
    with lrp:
        for _ in range(3):
            explain(lrp, x)
        model.how = how  # copied in the middle of the next call
        explain(lrp, x)
    (copied,) = model.copies
    assert not any("_call_impl" in vars(module) for module in copied.modules())
    seen = []
    copied.act.register_forward_hook(lambda module, args, output: seen.append(output.shape))
    copied(x)
    assert seen == [torch.Size([4, 8])]
    copy_lrp = LRP(copied, AttnLRP(), in_keys=["x"], out_keys=["y"])
    with copy_lrp:
        for _ in range(3):
            torch.testing.assert_close(explain(copy_lrp, x), expected, rtol=0, atol=0)


class Normalised(nn.Module):
    """A linear layer, a BatchNorm (in training mode: it moves its running statistics) and a head; ``n`` is read
    by the pipeline but not by the layers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer, self.norm, self.head = nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.layer(x)))


FAILING_CALLS = {
    "integer input no embedding reads": dict(in_keys=["x", "n"]),
    "target out of range": dict(target=7),
    "callable target that raises": dict(target=lambda y: y[..., 99]),
    "split_dim past the output's dimensions": dict(split_dim=3),
}


@pytest.mark.parametrize("in_context", [False, True])
@pytest.mark.parametrize("case", sorted(FAILING_CALLS))
def test_a_call_that_fails_after_the_forward_pass_leaves_the_running_statistics(case: str, in_context: bool):
    """A BatchNorm in training mode moves its running statistics in the forward pass: a call that failed after it
    (a target, an input found unexplainable) left them moved and ``num_batches_tracked`` counted one up. Their version
    counters are as before too (a graph of the caller's that saved them checks them in its backward pass)."""
    model = Normalised().train()
    pipeline = TensorDictModule(model, in_keys=["x", "n"], out_keys=["out"])
    before = {name: (buffer, buffer.clone(), buffer._version) for name, buffer in model.named_buffers()}
    td = TensorDict(x=torch.randn(5, 3), n=torch.arange(5), batch_size=[5])
    kwargs = {"in_keys": ["x"], **FAILING_CALLS[case]}
    lrp = LRP(pipeline, EpsilonPlus(), **kwargs)
    with pytest.raises((TypeError, IndexError, ValueError, KeyError, RuntimeError)):
        if in_context:
            with lrp:
                lrp(td)
        else:
            lrp(td)
    for name, buffer in model.named_buffers():
        assert buffer is before[name][0] and torch.equal(buffer, before[name][1]), name
        assert buffer._version == before[name][2], name
    assert model.training


class Counting(nn.Module):
    """Counts its calls in training mode in a buffer ``count``, once it has one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        count = self._buffers.get("count")
        if count is not None and self.training:
            count.add_(1)
        return x


def _insert_norm(net: nn.Sequential) -> None:
    net.insert(1, nn.BatchNorm1d(4))  # nn.Sequential.insert writes into _modules without registration hooks


def _replace_identity(net: nn.Sequential) -> None:
    net._modules["1"] = nn.BatchNorm1d(4)  # same number of children, another object


def _register_buffer(net: nn.Sequential) -> None:
    net[2].register_buffer("count", torch.zeros(()))


def _write_buffer(net: nn.Sequential) -> None:
    net[2]._buffers["count"] = torch.zeros(())


def _train(net: nn.Sequential) -> None:
    net.train()


STRUCTURE_CHANGES = {
    "BatchNorm inserted": _insert_norm,
    "Identity replaced by a BatchNorm": _replace_identity,
    "buffer registered": _register_buffer,
    "buffer written into _buffers": _write_buffer,
    "train() switched on": _train,
}


@pytest.mark.parametrize("in_context", [False, True])
@pytest.mark.parametrize("change", sorted(STRUCTURE_CHANGES))
def test_a_failing_call_after_the_model_changed_puts_its_buffers_back(change: str, in_context: bool):
    """The modules holding buffers are found once per structure of the model: a module put in or replaced, a buffer
    added or training switched on between two calls (by any means) is seen by the next call, whose failure after the
    forward pass puts the moved buffers back."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Identity(), Counting(), nn.Linear(4, 2))
    if change == "train() switched on":
        net.insert(1, nn.BatchNorm1d(4))
    net.eval()
    if change != "train() switched on":
        net.train()  # training mode throughout; the model holds no buffer before the change
    lrp = LRP(TensorDictModule(net, in_keys=["x"], out_keys=["y"]), EpsilonPlus())
    td = TensorDict(x=torch.randn(5, 3), batch_size=[5])
    with lrp if in_context else contextlib.nullcontext():
        lrp(td.clone())
        lrp(td.clone())
        STRUCTURE_CHANGES[change](net)
        before = {name: (buffer, buffer.clone()) for name, buffer in net.named_buffers()}
        assert before
        lrp.target = 7  # out of range: the call fails after the forward pass
        with pytest.raises(IndexError):
            lrp(td.clone())
        for name, buffer in net.named_buffers():
            assert buffer is before[name][0] and torch.equal(buffer, before[name][1]), name
        lrp.target = None
        lrp(td.clone())  # the same call that succeeds moves them
        assert any(not torch.equal(buffer, before[name][1]) for name, buffer in net.named_buffers())
