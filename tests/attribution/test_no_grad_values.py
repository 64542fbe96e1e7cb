"""A wrapper called under no_grad writes the values the model gives without gradient (torch's LSTM and transformer
fast paths compute other bits then), and the relevance of the call with gradient."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import CPLRP, LRP, AttnLRP, EpsilonPlus


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 8, num_layers=2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0])


class Attending(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x)[:, -1])


MODELS = {"lstm": (Recurrent, 4, EpsilonPlus), "transformer": (Attending, 8, AttnLRP)}


@pytest.mark.parametrize("kind", MODELS)
def test_outputs_under_no_grad_are_the_plain_calls_and_relevance_that_of_a_call_with_gradient(kind):
    model_class, features, mapper = MODELS[kind]
    torch.manual_seed(0)
    model = TensorDictModule(model_class().eval(), in_keys=["x"], out_keys=["y"])
    td = TensorDict(x=torch.randn(3, 5, features), batch_size=[3])
    with torch.no_grad():
        plain = model(td.clone())["y"]
    with_grad = LRP(model, mapper())(td.clone())
    assert not torch.equal(with_grad["y"], plain)  # the kernels differ: otherwise this test proves nothing
    lrp = LRP(model, mapper())
    with torch.no_grad(), lrp:
        first, second = lrp(td.clone()), lrp(td.clone())  # the first call watches with a function mode
    for out in (first, second):
        assert torch.equal(out["y"], plain) and not out["y"].requires_grad
        torch.testing.assert_close(out["relevance", "x"], with_grad["relevance", "x"], rtol=1e-5, atol=1e-7)
    assert torch.equal(with_grad["y"], model(td.clone())["y"])  # with gradient, the values of the call with gradient
    assert not model.module._forward_hooks and not any(m._forward_hooks for m in model.module.modules())


class GatedRecurrent(Recurrent):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.GRU(4, 8, num_layers=2, batch_first=True)


@pytest.mark.parametrize(
    ("model_class", "dtype", "runs_again"),
    [(Recurrent, torch.float32, True), (Recurrent, torch.float64, False), (GatedRecurrent, torch.float32, False)],
    ids=["lstm-float32", "lstm-float64", "gru-float32"],
)
def test_a_recurrent_module_runs_again_without_gradient_only_where_its_kernel_can_differ(
    model_class, dtype, runs_again
):
    # On CPU, oneDNN's LSTM kernel (taken without gradient) has no float64, and a GRU has one kernel: neither runs
    # twice; the outputs are still the plain call's under no_grad, bit for bit.
    torch.manual_seed(0)
    model = TensorDictModule(model_class().to(dtype).eval(), in_keys=["x"], out_keys=["y"])
    td = TensorDict(x=torch.randn(3, 5, 4, dtype=dtype), batch_size=[3])
    with torch.no_grad():
        plain = model(td.clone())["y"]
    with_grad = LRP(model, EpsilonPlus())(td.clone())
    runs = []
    kernel = "lstm" if model_class is Recurrent else "gru"
    recurrence = getattr(torch._VF, kernel)
    lrp = LRP(model, EpsilonPlus())
    with mock.patch.object(torch._VF, kernel, lambda *a, **k: runs.append(1) or recurrence(*a, **k)):
        with torch.no_grad(), lrp:
            outs = [lrp(td.clone()), lrp(td.clone())]
    assert len(runs) == (4 if runs_again else 2)
    for out in outs:
        assert torch.equal(out["y"], plain) and not out["y"].requires_grad
        assert torch.equal(out["relevance", "x"], with_grad["relevance", "x"])


def test_a_module_dropping_in_training_mode_writes_the_values_of_the_pass_explained():
    """A second run without gradient would draw other dropout masks: its values would belong to no explained pass.
    (An LSTM dropping between its layers is refused by its rule.)"""
    model_class, features, mapper = MODELS["transformer"]
    torch.manual_seed(0)
    net = model_class()
    for part in net.modules():
        if isinstance(part, nn.Dropout):
            part.p = 0.5
        elif isinstance(getattr(part, "dropout", None), float):
            part.dropout = 0.5
    model = TensorDictModule(net.train(), in_keys=["x"], out_keys=["y"])
    td = TensorDict(x=torch.randn(3, 5, features), batch_size=[3])
    torch.manual_seed(1)
    explained = LRP(model, mapper())(td.clone())  # with gradient: the values of the pass explained
    torch.manual_seed(1)
    with torch.no_grad(), pytest.warns(UserWarning, match="random"):
        out = LRP(model, mapper())(td.clone())
    assert torch.equal(out["y"], explained["y"])
    torch.testing.assert_close(out["relevance", "x"], explained["relevance", "x"], rtol=0, atol=0)


class Hooked:
    """A forward hook that counts its calls and, with ``shift``, adds it to the module's (first) output."""

    def __init__(self, shift: float = 0.0) -> None:
        self.calls, self.shift = 0, shift

    def __call__(self, module: nn.Module, args: tuple, output):
        self.calls += 1
        if not self.shift:
            return None
        return output + self.shift if isinstance(output, torch.Tensor) else (output[0] + self.shift, *output[1:])


@pytest.mark.parametrize("when", ["before", "in the context"])
@pytest.mark.parametrize("kind", MODELS)
def test_the_callers_hooks_on_the_module_run_again_act_once(kind, when):
    """The module whose kernels depend on the grad mode runs once more without gradient; the caller's forward hooks
    on it act once per call, as in the plain call: a counter counts 1 (2 before), and a hook put there inside an
    open context that shifts the output by 1 shifts the written output once (1.28 off the plain call's before)."""
    model_class, features, mapper = MODELS[kind]
    torch.manual_seed(0)
    net = model_class().eval()
    module = net.lstm if kind == "lstm" else net.encoder
    td = TensorDict(x=torch.randn(3, 5, features), batch_size=[3])
    counter, shifting = Hooked(), Hooked(1.0)
    handles = [module.register_forward_hook(counter)]
    if kind == "transformer":  # the recurrent rule refuses a hook changing the LSTM's output
        handles.append(module.register_forward_hook(shifting))
    with torch.no_grad():
        plain = net(td["x"])
    counter.calls = 0
    lrp = LRP(net, mapper(), in_keys=["x"], out_keys=["y"])
    if when == "before":
        with torch.no_grad():
            out = lrp(td.clone())
    else:
        for handle in handles:
            handle.remove()
        with lrp:
            handles = [module.register_forward_hook(counter)]
            if kind == "transformer":
                handles.append(module.register_forward_hook(shifting))
            with torch.no_grad():
                out = lrp(td.clone())
    assert counter.calls == 1
    assert torch.equal(out["y"], plain)
    assert list(module._forward_hooks) == [handle.id for handle in handles]  # the caller's, in their order


class PaddedSequences(nn.Module):
    """torch's ``TransformerEncoder`` with its default ``enable_nested_tensor=True`` and a key padding mask: without
    gradient it runs on nested tensors and gives the padded positions zeros (its final norm's output for zeros),
    where the pass with gradient computes values there; a head reads every position. ``as_nested`` writes that pass
    out as the pass with gradient: the padded positions set to zeros before the final norm."""

    def __init__(self, final_norm: bool) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(8) if final_norm else None)
        self.head = nn.Linear(5 * 8, 3)
        self.as_nested = False

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        if not self.as_nested:
            return self.head(self.encoder(x, src_key_padding_mask=padding).flatten(1))
        for layer in self.encoder.layers:
            x = layer(x, src_key_padding_mask=padding)
        x = x.masked_fill((padding != 0).unsqueeze(-1), 0.0)
        return self.head((x if self.encoder.norm is None else self.encoder.norm(x)).flatten(1))


@pytest.mark.parametrize("final_norm", [False, True], ids=["no-final-norm", "final-norm"])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32], ids=["bool-mask", "float-mask"])
def test_padded_positions_that_run_on_nested_tensors_without_gradient_are_explained_as_the_constants_written(
    final_norm, mask_dtype
):
    """Under no_grad the written outputs are the nested pass's, and the relevance explains them: it equals the
    relevance of that pass written out with gradient, leaves the padded positions none (0.38 there before) and, with
    zero biases, CP-LRP conserves the written target (one sample's relevance summed to 2.76 times it before)."""
    torch.manual_seed(0)
    net = PaddedSequences(final_norm).eval()
    with torch.no_grad():
        for name, parameter in net.named_parameters():
            if name.endswith("bias"):
                parameter.zero_() if not name.startswith("encoder.norm") else parameter.normal_()
    padded = torch.zeros(3, 5, dtype=torch.bool)
    padded[0, -2:], padded[2, -1] = True, True
    padding = padded if mask_dtype == torch.bool else torch.zeros(3, 5).masked_fill(padded, float("-inf"))
    td = TensorDict(x=torch.randn(3, 5, 8), padding=padding, batch_size=[3])
    model = TensorDictModule(net, in_keys=["x", "padding"], out_keys=["y"])
    with torch.no_grad():
        plain = model(td.clone())["y"]
        out = LRP(model, CPLRP(), in_keys=["x"])(td.clone())
    assert (model(td.clone())["y"].detach() - plain).abs().max() > 0.1  # with gradient the padded values differ
    net.as_nested = True
    written_out = LRP(model, CPLRP(), in_keys=["x"])(td.clone())
    torch.testing.assert_close(written_out["y"], plain, rtol=1e-5, atol=1e-6)

    assert torch.equal(out["y"], plain)
    relevance = out["relevance", "x"]
    torch.testing.assert_close(relevance, written_out["relevance", "x"], rtol=1e-5, atol=1e-6)
    assert relevance[padded].abs().max() == 0
    if not final_norm:  # the final norm's bias takes a share
        torch.testing.assert_close(relevance.flatten(1).sum(1), plain.max(-1).values, rtol=1e-5, atol=1e-6)


class Masked(nn.Module):
    """Encoder layers given a key padding mask, without nested tensors: without gradient each layer takes torch's
    fused kernel, which it does only where none of its modules has a forward hook or pre-hook."""

    def __init__(self, norm_first: bool) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, dropout=0.0, norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x, src_key_padding_mask=padding)[:, 0])


def _padded_call(net: nn.Module, padded: bool) -> tuple[TensorDict, TensorDictModule, torch.Tensor, TensorDict]:
    """A batch whose second sequence ends in two padded positions (if ``padded``), the model reading it, its plain
    outputs under no_grad and an AttnLRP call with gradient."""
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[1, -2:] = padded
    td = TensorDict(x=torch.randn(3, 5, 8), padding=padding, batch_size=[3])
    model = TensorDictModule(net, in_keys=["x", "padding"], out_keys=["y"])
    with torch.no_grad():
        plain = model(td.clone())["y"]
    return td, model, plain, LRP(model, AttnLRP(), in_keys=["x"])(td.clone())


@pytest.mark.parametrize("callers_hook", [False, True], ids=["rules-only", "callers-hook-inside"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_encoder_layers_given_a_padding_mask_write_the_fused_kernels_values(norm_first, callers_hook):
    """The run without gradient sets the rules' hooks aside, so that each layer takes the kernel the plain call takes
    (it took the other one: up to 3.6e-7 off the plain call's outputs, 1.4e-6 relative); a hook of the caller's
    inside the encoder keeps the plain call off that kernel, and the run too."""
    torch.manual_seed(0)
    net = Masked(norm_first).eval()
    calls = []
    if callers_hook:
        net.encoder.layers[0].linear1.register_forward_hook(lambda *args: calls.append(1))
    td, model, plain, with_grad = _padded_call(net, padded=True)
    lrp = LRP(model, AttnLRP(), in_keys=["x"])
    with torch.no_grad(), lrp:
        outs = [lrp(td.clone()) for _ in range(2)]
    for out in outs:
        assert torch.equal(out["y"], plain)
        torch.testing.assert_close(out["relevance", "x"], with_grad["relevance", "x"], rtol=1e-5, atol=1e-7)
    assert all(not m._forward_pre_hooks for m in net.modules())
    hooked = net.encoder.layers[0].linear1 if callers_hook else None
    assert [len(m._forward_hooks) for m in net.modules()] == [int(m is hooked) for m in net.modules()]


class BareLayer(nn.Module):
    """An ``nn.TransformerEncoderLayer`` called by itself (no encoder around it): torch's check for hooks looks at
    the layer's own hooks too."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, dropout=0.0)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x, src_key_padding_mask=padding)[:, 0])


@pytest.mark.parametrize("padded", [False, True], ids=["no-padding", "padding"])
def test_a_layer_run_by_itself_writes_the_fused_kernels_values(padded):
    """The rules' hooks on the layer itself are set aside for the run without gradient too (its outputs were 1.2e-7
    and 2.4e-7 off the plain call's, with or without padding)."""
    torch.manual_seed(0)
    net = BareLayer().eval()
    td, model, plain, with_grad = _padded_call(net, padded)
    assert not torch.equal(with_grad["y"], plain)  # the kernels differ: otherwise this test proves nothing
    with torch.no_grad():
        out = LRP(model, AttnLRP(), in_keys=["x"])(td.clone())
    assert torch.equal(out["y"], plain)
    torch.testing.assert_close(out["relevance", "x"], with_grad["relevance", "x"], rtol=1e-5, atol=1e-7)


def test_an_interrupt_in_the_run_without_gradient_gives_the_rules_hooks_back():
    """A ``KeyboardInterrupt`` raised inside the run without gradient (by a hook of the caller's) leaves every hook
    of the context in place: the next call gives the relevance of a call before it, bit for bit."""
    torch.manual_seed(0)
    net = Masked(norm_first=False).eval()
    raising = [False]

    def hook(*args):
        if raising[0] and not torch.is_grad_enabled():
            raise KeyboardInterrupt

    net.encoder.layers[1].linear2.register_forward_hook(hook)
    padding = torch.zeros(3, 5, dtype=torch.bool)
    td = TensorDict(x=torch.randn(3, 5, 8), padding=padding, batch_size=[3])
    lrp = LRP(TensorDictModule(net, in_keys=["x", "padding"], out_keys=["y"]), AttnLRP(), in_keys=["x"])
    with torch.no_grad(), lrp:
        before = lrp(td.clone())
        hooks = {name: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for name, m in net.named_modules()}
        raising[0] = True
        with pytest.raises(KeyboardInterrupt):
            lrp(td.clone())
        raising[0] = False
        assert hooks == {name: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for name, m in net.named_modules()}
        after = lrp(td.clone())
    assert torch.equal(after["y"], before["y"])
    assert torch.equal(after["relevance", "x"], before["relevance", "x"])


def test_an_interrupt_at_any_line_of_a_methods_no_grad_record_leaves_no_record_and_no_hook_behind():
    """Every line of ``caller_values_in`` (the methods' record of the caller's ``no_grad``): an interrupt before its
    ``try`` left the hook on the LSTM and the thread recorded as under ``no_grad``, so that the model's own calls
    with gradient, outside any wrapper, took the values of a run without gradient from then on."""
    from tdhook.attribution import Saliency
    from tdhook.attribution._no_grad_values import _caller_values_hook, caller_grad_enabled
    from tests.attribution.test_lrp_interrupts import InterruptIn

    torch.manual_seed(0)
    net = Recurrent()
    saliency = Saliency(TensorDictModule(net, in_keys=["x"], out_keys=["y"]), target=0)
    td = TensorDict(x=torch.randn(2, 5, 4), batch_size=[2])
    with torch.no_grad(), InterruptIn(None, "_no_grad_values.py") as counting:
        saliency(td.clone())
    assert counting.count >= 3
    for at in range(1, counting.count + 1):
        with torch.no_grad(), InterruptIn(at, "_no_grad_values.py") as interrupt:
            saliency(td.clone())
        assert interrupt.where is not None, at
        assert caller_grad_enabled(), interrupt.where
        assert all(hook is not _caller_values_hook for hook in net.lstm._forward_hooks.values()), interrupt.where
