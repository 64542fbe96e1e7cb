"""Reliability: bad input gets a clear error, and no failure leaves the model or the caller's TensorDict changed.

The fault-injection tests raise at every stage of an explanation (entering the
context, the model's forward pass, a rule's rewrite, a rule's backward pass, the
relevance check, writing the results, the caller's own code inside ``with``),
with ordinary exceptions and with ``KeyboardInterrupt``, and check afterwards
that parameters, buffers, forward methods and hooks are exactly as before, that
the caller's TensorDict holds no partial result, that no global state leaked,
and that the wrapper still gives the right answer.
"""

from __future__ import annotations

import copy
import pickle
import re
import warnings

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import LRP, AttnLRP
from tdhook.attribution.lrp_helpers.redirect import redirect
from tdhook.attribution.lrp_helpers.rules import (
    EpsilonAlpha2Beta1,
    EpsilonGammaBox,
    EpsilonPlus,
    EpsilonPlusFlat,
    EpsilonRule,
    Rule,
    raise_for_unconserved_rel_factory,
)

F64 = torch.float64


class Fault(nn.Module):
    """Identity, or raises ``error`` when armed: in the forward pass or when the backward pass reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.stage: str | None = None
        self.error: BaseException = RuntimeError("injected fault")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stage == "forward":
            raise self.error
        if self.stage == "backward" and x.requires_grad:
            x = x.clone()
            x.register_hook(self._raise)
        return x

    def _raise(self, grad: torch.Tensor) -> None:
        raise self.error


class FaultyRule(EpsilonRule):
    """ε, or raises in its rewrite (forward pass) or in the gradient it hands back (backward pass)."""

    def __init__(self) -> None:
        super().__init__(1e-6)
        self.stage: str | None = None
        self.error: BaseException = RuntimeError("injected fault in a rule")

    def rewrite(self, module, registration, inputs, output):
        if self.stage == "rule-rewrite":
            raise self.error
        if self.stage == "rule-backward":
            return redirect(output, [inputs[0]], self._fail)
        return super().rewrite(module, registration, inputs, output)

    def _fail(self, grad: torch.Tensor) -> list[torch.Tensor]:
        raise self.error


def model_with_faults() -> tuple[nn.Module, Fault]:
    torch.manual_seed(0)
    fault = Fault()
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(inplace=True),
        fault,
        nn.Conv2d(4, 4, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 3),
    ).to(F64)
    with torch.no_grad():
        model[1].running_mean.normal_()
        model[1].running_var.uniform_(0.5, 2.0)
    return model.eval(), fault


def hook_counts(module: nn.Module) -> list[tuple[str, int]]:
    return sorted((k, len(v)) for k, v in vars(module).items() if "hooks" in k and isinstance(v, dict))


def model_snapshot(model: nn.Module) -> dict:
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "objects": dict(model.named_parameters()) | dict(model.named_buffers()),
        "hooks": [
            sorted((k, len(v)) for k, v in vars(m).items() if "hooks" in k and isinstance(v, dict))
            for m in model.modules()
        ],
        "forwards": [vars(m).get("forward") for m in model.modules()] + [type(m).forward for m in model.modules()],
        "training": [m.training for m in model.modules()],
        "global": (
            torch.is_grad_enabled(),
            torch._C._is_torch_function_enabled(),
            torch._C._is_torch_function_mode_enabled(),
            len(torch.nn.modules.module._global_forward_hooks),
            len(torch.nn.modules.module._global_forward_pre_hooks),
        ),
    }


def assert_model_unchanged(model: nn.Module, before: dict) -> None:
    after = model_snapshot(model)
    assert after["state"].keys() == before["state"].keys()
    for key, value in before["state"].items():
        assert torch.equal(after["state"][key], value), key
    assert all(after["objects"][k] is v for k, v in before["objects"].items())
    for key in ("hooks", "forwards", "training", "global"):
        assert after[key] == before[key], key


def td_snapshot(td: TensorDict) -> dict:
    return {k: (v, v.clone()) for k, v in td.items(include_nested=True, leaves_only=True)}


def assert_td_unchanged(td: TensorDict, before: dict) -> None:
    now = dict(td.items(include_nested=True, leaves_only=True))
    assert now.keys() == before.keys()
    for key, (obj, value) in before.items():
        assert now[key] is obj and torch.equal(now[key], value), key


# A failing write is tested on its own below (the error is tensordict's, and cannot be an interrupt).
STAGES = ["forward", "backward", "rule-rewrite", "rule-backward", "relevance-check", "caller", "enter"]


@pytest.mark.parametrize("error", [RuntimeError("injected fault"), KeyboardInterrupt()], ids=["error", "interrupt"])
@pytest.mark.parametrize("stage", STAGES)
def test_a_fault_at_any_stage_changes_nothing(stage: str, error: BaseException):
    model, fault = model_with_faults()
    rule = FaultyRule()
    mapper = EpsilonPlusFlat(rule_mapper=lambda name, module: rule if name == "7" else None)
    x = torch.randn(2, 3, 6, 6, dtype=F64)
    expected = LRP(copy.deepcopy(model), mapper, in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[2]))

    def check(name, module, relevance_in, relevance_out):
        if stage == "relevance-check":
            raise error

    lrp = LRP(model, mapper, in_keys=["x"], out_keys=["y"], relevance_check=check)
    td = TensorDict(x=x.clone(), other=torch.zeros(2), batch_size=[2])
    before_model, before_td = model_snapshot(model), td_snapshot(td)

    fault.stage, fault.error = stage, error
    rule.stage, rule.error = stage, error
    raises = pytest.raises(type(error))
    if stage == "enter":
        mapper_error = error

        def failing_mapper(name, module):
            if name == "4":  # after the rules of the first layers are registered
                raise mapper_error
            return EpsilonPlusFlat()(name, module)

        lrp = LRP(model, failing_mapper, in_keys=["x"], out_keys=["y"])
    with raises:
        with lrp:
            lrp(td)
            if stage == "caller":
                raise error
    assert_model_unchanged(model, before_model)
    if stage == "caller":  # the call itself had finished: its results are whole, and nothing else changed
        torch.testing.assert_close(td.pop(("relevance", "x")), expected["relevance", "x"], rtol=0, atol=0)
        torch.testing.assert_close(td.pop("y"), expected["y"], rtol=0, atol=0)
        del td["relevance"]
    assert_td_unchanged(td, before_td)

    # The wrapper (and the model) still give the right answer.
    fault.stage, rule.stage = None, None
    again = LRP(model, mapper, in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[2]))
    torch.testing.assert_close(again["relevance", "x"], expected["relevance", "x"], rtol=0, atol=0)


def test_a_failed_write_leaves_no_partial_result():
    model, _ = model_with_faults()
    # A sub-TensorDict at "relevance" whose batch size [2, 4] the relevance [2, 3, 6, 6] does not fit.
    td = TensorDict(x=torch.randn(2, 3, 6, 6, dtype=F64), relevance=TensorDict(batch_size=[2, 4]), batch_size=[2])
    before = td_snapshot(td)
    with pytest.raises(RuntimeError, match="batch dimension mismatch"):  # tensordict's own error
        LRP(model, EpsilonPlus(), in_keys=["x"], out_keys=["y"])(td)
    assert "y" not in td.keys()  # written first, then taken back
    assert_td_unchanged(td, before)


class TestClearErrors:
    def policy(self) -> TensorDictModule:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3)).to(F64)
        return TensorDictModule(net, in_keys=["observation"], out_keys=["action_value"])

    def test_wrong_shaped_input_names_the_key_and_its_shape(self):
        lrp = LRP(self.policy(), EpsilonPlus())
        with pytest.raises(RuntimeError) as info:
            lrp(TensorDict(observation=torch.randn(2, 4, dtype=F64), batch_size=[2]))
        assert "'observation': torch.float64 [2, 4]" in "\n".join(info.value.__notes__)

    @pytest.mark.parametrize("dtype", [torch.long, torch.bool])
    def test_integer_or_boolean_target_output(self, dtype: torch.dtype):
        policy = self.policy()
        act = TensorDictModule(lambda q: (q.argmax(-1) > 0).to(dtype), in_keys=["action_value"], out_keys=["action"])
        from tensordict.nn import TensorDictSequential

        lrp = LRP(TensorDictSequential(policy, act), EpsilonPlus(), target_key="action")
        with pytest.raises(TypeError, match=rf"target 'action' is {dtype} \[2\]; relevance explains a floating"):
            lrp(TensorDict(observation=torch.randn(2, 5, dtype=F64), batch_size=[2]))

    def test_two_wrappers_on_one_model_at_once(self):
        policy = self.policy()
        first, second = LRP(policy, EpsilonPlus()), LRP(policy, EpsilonPlusFlat())
        td = TensorDict(observation=torch.randn(2, 5, dtype=F64), batch_size=[2])
        with first:
            with pytest.raises(
                RuntimeError, match=r"module 'the model itself' \(TensorDictModule\) is already inside another LRP"
            ):
                second(td.clone())
            # An overlapping wrapper (on a part of the same model) is refused too.
            part = LRP(policy.module[2], in_keys=["h"], out_keys=["q"])
            with pytest.raises(RuntimeError, match=r"module 'the model itself' \(Linear\) is already inside another"):
                part.__enter__()
            first(td.clone())  # the first wrapper is untouched by the refusals
        second(td.clone())  # and the second works once the first has left

    def test_dropout_in_training_mode_warns_once_with_its_name(self):
        net = nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.5), nn.ReLU(), nn.Linear(8, 3)).to(F64)
        lrp = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
        td = TensorDict(x=torch.randn(2, 5, dtype=F64), batch_size=[2])
        with pytest.warns(UserWarning, match=r"module '1' \(Dropout, p=0.5\) is in training mode"):
            with lrp:
                lrp(td.clone())
                lrp(td.clone())
        net.eval()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning in eval mode
            with lrp:
                lrp(td.clone())

    def test_dropout_put_in_training_mode_inside_an_open_context_warns_at_the_next_call(self):
        # The calls of a context on an eval-mode model check the modes in one pass; a train() between two calls, or
        # a pooling that draws in eval mode, is still found at the next call.
        net = nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.5), nn.ReLU(), nn.Linear(8, 3)).to(F64).eval()
        lrp = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
        td = TensorDict(x=torch.randn(2, 5, dtype=F64), batch_size=[2])
        with lrp:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                lrp(td.clone())
                lrp(td.clone())
            net[1].train()
            with pytest.warns(UserWarning, match=r"module '1' \(Dropout, p=0.5\) is in training mode"):
                lrp(td.clone())
        pool = nn.Sequential(nn.Conv2d(1, 2, 3), nn.FractionalMaxPool2d(2, output_size=3), nn.Flatten()).eval()
        lrp = LRP(pool, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
        with pytest.warns(UserWarning, match=r"module '1' \(FractionalMaxPool2d.*draws in eval mode too"):
            with lrp:
                lrp(TensorDict(x=torch.randn(2, 1, 8, 8), batch_size=[2]))

    @pytest.mark.parametrize("kind", ["DropPath", "StochasticDepth", "DropBlock2d"])
    def test_stochastic_depth_in_training_mode_warns_with_its_name(self, kind: str):
        # timm's DropPath and DropBlock2d, torchvision's StochasticDepth drop whole residual branches or blocks in
        # training mode: the relevance of two calls differed by 34-110 % on a small residual net, with no warning.
        from timm.layers import DropBlock2d, DropPath
        from torchvision.ops import StochasticDepth

        drop = {"DropPath": DropPath(0.5), "StochasticDepth": StochasticDepth(0.5, "row")}.get(kind)
        drop = DropBlock2d(0.5, block_size=1) if drop is None else drop

        class Residual(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.conv, self.drop, self.head = nn.Conv2d(2, 2, 1), drop, nn.Linear(2 * 3 * 3, 3)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.head((x + self.drop(torch.relu(self.conv(x)))).flatten(1))

        net = Residual().to(F64)
        lrp = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
        td = TensorDict(x=torch.randn(4, 2, 3, 3, dtype=F64), batch_size=[4])
        with pytest.warns(UserWarning, match=rf"module 'drop' \({kind}, p=0.5\) is in training mode"):
            lrp(td.clone())
        net.eval()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the identity in eval mode: no warning
            lrp(td.clone())

    def test_token_dropout_in_training_mode_warns_with_its_name(self):
        # timm's PatchDropout keeps a random subset of a ViT's tokens in training mode.
        from timm.layers import PatchDropout

        class MeanOfTokens(nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return x.mean(1)  # of the tokens kept

        net = nn.Sequential(nn.Linear(4, 4), PatchDropout(0.5, num_prefix_tokens=0), MeanOfTokens(), nn.Linear(4, 3))
        net = net.to(F64).eval()
        td = TensorDict(x=torch.randn(2, 6, 4, dtype=F64), batch_size=[2])
        lrp = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the identity in eval mode: no warning
            lrp(td.clone())
        net.train()
        with pytest.warns(UserWarning, match=r"module '1' \(PatchDropout, p=0.5\) is in training mode"):
            lrp(td.clone())

    def test_dropout_called_as_a_function_in_training_mode_warns_with_the_modules_name(self):
        """``F.dropout(h, 0.5, self.training)`` in a module's own forward is no Dropout module: under the CNN presets
        its relevance moved by 0.97 of its norm from seed to seed, without a word. A Dropout module is named once,
        as before, not again for the function it calls."""

        class Body(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.fc, self.drop, self.head = nn.Linear(5, 8), nn.Dropout(0.3), nn.Linear(8, 3)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.head(self.drop(nn.functional.dropout(torch.relu(self.fc(x)), 0.5, self.training)))

        net = nn.Sequential(Body()).to(F64)
        td = TensorDict(x=torch.randn(2, 5, dtype=F64), batch_size=[2])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"])(td.clone())
        messages = [str(w.message) for w in caught]
        called = [m for m in messages if m.startswith("LRP: module '0' (Body) calls dropout (p=0.5) in its own")]
        assert len(called) == 1 and len(messages) == 2, messages  # and the Dropout module's, by name
        assert "module '0.drop' (Dropout, p=0.3) is in training mode" in messages[0]
        net.eval()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"])(td.clone())

    @pytest.mark.parametrize("preset", ["AttnLRP", "CPLRP"])
    def test_attention_dropout_of_a_multihead_attention_is_warned_of_once_by_name(self, preset: str):
        """nn.MultiheadAttention with a dropout of its own in training mode was warned of twice under the transformer
        presets: by name, and again by the function rules as dropout "outside any Dropout module". Once, by name."""
        from tdhook.attribution.mappers import CPLRP

        class Attending(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.a, self.h = nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True), nn.Linear(8, 2)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.h(self.a(x, x, x)[0].mean(1))

        net = TensorDictModule(Attending().train(), ["x"], ["y"])
        td = TensorDict(x=torch.randn(3, 4, 8), batch_size=[3])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            LRP(net, AttnLRP() if preset == "AttnLRP" else CPLRP())(td)
        messages = [str(w.message) for w in caught]
        assert len(messages) == 1, messages
        assert "module 'module.a' (MultiheadAttention, attention dropout p=0.5) is in training mode" in messages[0]

    def test_dropout_between_the_layers_of_an_rnn_in_training_mode_warns_with_its_name(self):
        """nn.RNN of two layers with dropout drops other units between them at every pass in training mode: its
        relevance moved by 2.3 of its norm from seed to seed, and the only word was that the RNN computes rnn_tanh.
        (LSTM and GRU layers are refused by their rule; attention dropout is warned of by the function rules.)"""

        class Recurrent(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.rnn, self.head = nn.RNN(4, 5, num_layers=2, dropout=0.5, batch_first=True), nn.Linear(15, 3)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.head(self.rnn(x)[0].flatten(1))

        net = Recurrent().to(F64).train()
        lrp = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
        td = TensorDict(x=torch.randn(2, 3, 4, dtype=F64), batch_size=[2])
        with pytest.warns(UserWarning, match=r"module 'rnn' \(RNN, dropout p=0.5 between layers\) is in training mode"):
            lrp(td.clone())

    @pytest.mark.parametrize("dims", [2, 3])
    def test_fractional_max_pooling_warns_in_eval_mode_with_its_name(self, dims: int):
        """nn.FractionalMaxPool2d and 3d draw their pooling regions at every forward pass, in eval mode too: the
        relevance of two calls differed by 34 % of its norm, and the only word was that the pooling "is not
        piecewise linear" (a max over regions is). Regions fixed with ``_random_samples`` draw nothing."""
        pool = nn.FractionalMaxPool2d(2, output_size=3) if dims == 2 else nn.FractionalMaxPool3d(2, output_size=3)
        conv = nn.Conv2d(1, 2, 3, padding=1) if dims == 2 else nn.Conv3d(1, 2, 3, padding=1)
        net = nn.Sequential(conv, nn.ReLU(), pool, nn.Flatten(), nn.Linear(2 * 3**dims, 3)).to(F64).eval()
        td = TensorDict(x=torch.randn(2, 1, *[6] * dims, dtype=F64), batch_size=[2])
        lrp = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
        kind = type(pool).__name__
        expected = rf"LRP: module '2' \({kind}, pooling regions drawn at random\) draws in eval mode too"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with lrp:
                lrp(td.clone())
                lrp(td.clone())
        messages = [str(w.message) for w in caught]
        assert len([m for m in messages if re.match(expected, m)]) == 1, messages  # once per context
        assert not any("piecewise linear" in m for m in messages), messages
        pool._random_samples = torch.rand(2, 2, dims, dtype=F64)
        relevance = []
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for seed in (0, 1):
                torch.manual_seed(seed)
                relevance.append(lrp(td.clone())["relevance", "x"])
        torch.testing.assert_close(relevance[0], relevance[1], rtol=0, atol=0)

    def test_copy_and_pickle_outside_the_context_only(self):
        lrp = LRP(self.policy(), EpsilonGammaBox(-3.0, 3.0))
        td = TensorDict(observation=torch.randn(2, 5, dtype=F64), batch_size=[2])
        expected = lrp(td.clone())["relevance", "observation"]
        for clone in (copy.deepcopy(lrp), pickle.loads(pickle.dumps(lrp))):
            torch.testing.assert_close(clone(td.clone())["relevance", "observation"], expected)
        with lrp:
            with pytest.raises(RuntimeError, match="leave the wrapper's context before copying or pickling it"):
                copy.deepcopy(lrp)


class GatedProduct(nn.Module):
    """``out(gelu(q(x)) * k(x))``: a product of two activations and a GELU module, whose rules a context's later calls
    find in the autograd graph (plans that hold autograd node types and hooks)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.out = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 3)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.q(x)) * self.k(x))


def test_a_wrapper_copies_and_pickles_after_a_context_whose_calls_followed_plans():
    """The plans a context's calls made are the context's own: a copy or a pickle made after it leaves them out, and
    its calls, in a context of its own or out of one, give the original's relevance."""
    torch.manual_seed(0)
    lrp = LRP(GatedProduct().to(F64), AttnLRP(), in_keys=["x"], out_keys=["y"])
    td = TensorDict(x=torch.randn(5, 4, dtype=F64), batch_size=[5])
    expected = lrp(td.clone())["relevance", "x"]
    with lrp:
        for _ in range(3):
            lrp(td.clone())
    for clone in (copy.deepcopy(lrp), pickle.loads(pickle.dumps(lrp))):
        assert torch.equal(clone(td.clone())["relevance", "x"], expected)
        with clone:
            for _ in range(3):
                assert torch.equal(clone(td.clone())["relevance", "x"], expected)


MAPPERS = {
    "EpsilonPlus": EpsilonPlus,
    "EpsilonPlusFlat": EpsilonPlusFlat,
    "EpsilonAlpha2Beta1": EpsilonAlpha2Beta1,
    "EpsilonGammaBox": lambda: EpsilonGammaBox(-3.0, 3.0),
}


def numerically_hard_model(case: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16, 6), nn.Tanh(), nn.Linear(6, 3))
    x = torch.randn(3, 2, 4, 4)
    with torch.no_grad():
        if case == "zero input":
            x.zero_()
        elif case == "dead relus":
            model[0].bias.fill_(-1e3)  # every ReLU is off: no relevance reaches the input, and none is NaN
        elif case == "saturated tanh":
            model[3].weight.mul_(1e4)
        elif case == "huge logits":
            model[5].weight.mul_(1e30)
        elif case == "zero weights":
            model[3].weight.zero_()
    return model.eval(), x


@pytest.mark.parametrize("case", ["zero input", "dead relus", "saturated tanh", "huge logits", "zero weights"])
@pytest.mark.parametrize("mapper", sorted(MAPPERS))
def test_relevance_is_finite_where_the_numbers_are_hard(case: str, mapper: str):
    model, x = numerically_hard_model(case)
    td = LRP(model, MAPPERS[mapper](), in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[3]))
    assert torch.isfinite(td["relevance", "x"]).all()


def test_the_opt_in_check_names_the_layer_where_relevance_stops_being_finite():
    model, x = numerically_hard_model("zero input")
    check = raise_for_unconserved_rel_factory(atol=1e30)
    with torch.no_grad():
        model[5].weight.fill_(float("inf"))  # the explained logits are infinite
    with pytest.raises(ValueError, match=r"relevance of module '5' \(Linear\) has NaN or inf values"):
        LRP(model, EpsilonPlus(), in_keys=["x"], out_keys=["y"], relevance_check=check)(
            TensorDict(x=x + 1, batch_size=[3])
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_dtypes_agree_with_float64(dtype: torch.dtype):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    x = torch.randn(8, 6)
    reference = LRP(copy.deepcopy(net).double(), EpsilonPlusFlat(), in_keys=["x"], out_keys=["y"])(
        TensorDict(x=x.double(), batch_size=[8])
    )["relevance", "x"]
    low = LRP(copy.deepcopy(net).to(dtype), EpsilonPlusFlat(), in_keys=["x"], out_keys=["y"])(
        TensorDict(x=x.to(dtype), batch_size=[8])
    )["relevance", "x"]
    assert low.dtype == dtype and torch.isfinite(low).all()
    cosine = nn.functional.cosine_similarity(low.double().flatten(1), reference.flatten(1), dim=1)
    assert (cosine > 0.99).all(), cosine


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_agrees_with_cpu():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3)).eval()
    x = torch.randn(2, 3, 6, 6)
    cpu = LRP(copy.deepcopy(net), EpsilonGammaBox(-3.0, 3.0), in_keys=["x"], out_keys=["y"])(
        TensorDict(x=x, batch_size=[2])
    )["relevance", "x"]
    gpu = LRP(copy.deepcopy(net).cuda(), EpsilonGammaBox(-3.0, 3.0), in_keys=["x"], out_keys=["y"])(
        TensorDict(x=x.cuda(), batch_size=[2], device="cuda")
    )["relevance", "x"]
    assert gpu.device.type == "cuda"
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-4, atol=1e-5)


class CheckpointedBody(nn.Module):
    def __init__(self, net: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.net, self.reentrant = net, reentrant

    def forward(self, x):
        hidden = torch.utils.checkpoint.checkpoint(self.net[:4], x, use_reentrant=self.reentrant)
        return self.net[4](hidden)


def small_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).to(F64)


def test_activation_checkpointing_works_or_raises_clearly():
    net = small_mlp()
    td = TensorDict(x=torch.randn(4, 5, dtype=F64), batch_size=[4])
    expected = LRP(net, EpsilonPlusFlat(), in_keys=["x"], out_keys=["y"])(td.clone())["relevance", "x"]
    checkpointed = LRP(CheckpointedBody(net, reentrant=False), EpsilonPlusFlat(), in_keys=["x"], out_keys=["y"])
    torch.testing.assert_close(checkpointed(td.clone())["relevance", "x"], expected, rtol=0, atol=0)
    # The re-entrant variant cannot serve torch.autograd.grad at all; the error names the checkpointed module, and
    # the model is left as it was.
    reentrant_model = CheckpointedBody(net, reentrant=True)
    before = model_snapshot(reentrant_model)
    pattern = r"module 'net.0' \(Linear\) runs in a region checkpointed .*use_reentrant=True"
    with pytest.raises(ValueError, match=pattern):
        LRP(reentrant_model, EpsilonPlusFlat(), in_keys=["x"], out_keys=["y"])(td.clone())
    assert_model_unchanged(reentrant_model, before)


def test_a_compiled_model_gives_the_same_relevance():
    net = small_mlp()
    td = TensorDict(x=torch.randn(4, 5, dtype=F64), batch_size=[4])
    expected = LRP(net, EpsilonPlusFlat(), in_keys=["x"], out_keys=["y"])(td.clone())["relevance", "x"]
    compiled = torch.compile(net, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = LRP(compiled, EpsilonPlusFlat(), in_keys=["x"], out_keys=["y"])(td.clone())["relevance", "x"]
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    # No warning from torch.compile about the wrapper's hooks or the rules' queries.
    assert [str(w.message) for w in caught] == []


@pytest.mark.parametrize("part", ["model", "layer"])
@pytest.mark.parametrize("preset", [EpsilonPlus, EpsilonPlusFlat])
def test_a_model_compiled_in_place_gives_the_same_relevance(part: str, preset: type):
    """``module.compile()`` compiles the call where it stands (no ``_orig_mod``): run as written, like
    ``torch.compile(module)``, even after the compiled call was cached by a plain pass (a later call of a
    context was 6e-5 off under EpsilonPlus; EpsilonPlusFlat raised a SystemError)."""
    net = small_mlp()
    td = TensorDict(x=torch.randn(4, 5, dtype=F64), batch_size=[4])
    expected = LRP(net, preset(), in_keys=["x"], out_keys=["y"])(td.clone())["relevance", "x"]
    torch._dynamo.reset()
    (net if part == "model" else net[2]).compile(backend="eager")
    net(td["x"].requires_grad_(True)).sum().backward()  # the compiled call, cached before the rules exist
    td["x"] = td["x"].detach()
    explained = LRP(net, preset(), in_keys=["x"], out_keys=["y"])
    with explained:
        for _ in range(2):
            torch.testing.assert_close(explained(td.clone())["relevance", "x"], expected, rtol=0, atol=0)


def test_a_compiled_wrapper_gives_the_same_relevance():
    """``torch.compile(lrp)`` (as a collector's ``compile_policy`` does): the wrapper's call runs as written (traced,
    it raised a SystemError from a rule's autograd function)."""
    net = small_mlp()
    td = TensorDict(x=torch.randn(4, 5, dtype=F64), batch_size=[4])
    expected = LRP(net, EpsilonPlusFlat(), in_keys=["x"], out_keys=["y"])(td.clone())["relevance", "x"]
    torch._dynamo.reset()
    compiled = torch.compile(LRP(net, EpsilonPlusFlat(), in_keys=["x"], out_keys=["y"]), backend="eager")
    for _ in range(2):
        torch.testing.assert_close(compiled(td.clone())["relevance", "x"], expected, rtol=0, atol=0)


def test_a_compiled_model_with_a_gate_written_as_a_function_gives_the_eager_relevance():
    class Gated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.gate, self.head = nn.Linear(5, 6), nn.Linear(6, 6), nn.Linear(6, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.fc(x))
            return self.head(h * torch.sigmoid(self.gate(h)))

    torch.manual_seed(0)
    net = Gated().to(F64)
    td = TensorDict(x=torch.randn(4, 5, dtype=F64), batch_size=[4])
    expected = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"])(td.clone())["relevance", "x"]
    explained = LRP(torch.compile(net, backend="eager"), EpsilonPlus(), in_keys=["x"], out_keys=["y"])
    for _ in range(2):  # the first call finds the gate; later calls hold it too
        torch.testing.assert_close(explained(td.clone())["relevance", "x"], expected, rtol=0, atol=0)


def test_a_module_called_twice_gets_its_rule_on_each_call():
    """Weight sharing: every rule runs per call, and the relevance of both calls adds up at the input."""
    torch.manual_seed(0)
    shared = nn.Linear(4, 4).to(F64)

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared, self.head = shared, nn.Linear(4, 2).to(F64)

        def forward(self, x):
            return self.head(torch.relu(self.shared(torch.relu(self.shared(x)))))

    class Unrolled(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second, self.head = copy.deepcopy(shared), copy.deepcopy(shared), Twice().head

        def forward(self, x):
            return self.head(torch.relu(self.second(torch.relu(self.first(x)))))

    twice = Twice()
    unrolled = Unrolled()
    unrolled.head = twice.head
    x = torch.randn(3, 4, dtype=F64)
    for mapper in (EpsilonPlus(), EpsilonPlusFlat(), EpsilonAlpha2Beta1(), EpsilonGammaBox(-3.0, 3.0)):
        ours = LRP(twice, mapper, in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[3]))
        reference = LRP(unrolled, mapper, in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[3]))
        torch.testing.assert_close(ours["relevance", "x"], reference["relevance", "x"])


def test_custom_rule_subclass_of_rule_is_refused_when_incomplete():
    class Incomplete(Rule):
        pass

    net = small_mlp()
    lrp = LRP(net, lambda name, module: Incomplete() if name == "0" else None, in_keys=["x"], out_keys=["y"])
    before = model_snapshot(net)
    with pytest.raises(NotImplementedError):
        lrp(TensorDict(x=torch.randn(2, 5, dtype=F64), batch_size=[2]))
    assert_model_unchanged(net, before)
