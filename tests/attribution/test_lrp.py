"""The LRP wrapper: the public contract (keys, targets, context) and the identities of LRP (docs/design.md)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from tensordict import TensorDict, tensorclass
from tensordict.nn import TensorDictModule, TensorDictSequential
from torch import nn
from zennit import composites as zcomposites

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.rules import (
    BaseRuleMapper,
    EpsilonAlpha2Beta1,
    EpsilonAlpha2Beta1Flat,
    EpsilonGammaBox,
    EpsilonPlus,
    EpsilonPlusFlat,
    EpsilonRule,
    raise_for_unconserved_rel_factory,
)
from tests.attribution._helpers import ExpectsARefusal, assert_unchanged, explain, mlp, state_snapshot
from tests.conftest import relative_error, zennit_model_relevance


def small_cnn(bias: bool = True) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1, bias=bias),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 8, 3, padding=1, bias=bias),
        nn.ReLU(inplace=True),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * 2 * 2, 10, bias=bias),
        nn.ReLU(),
        nn.Linear(10, 4, bias=bias),
    ).double()


def lrp0_mapper() -> BaseRuleMapper:
    lrp0 = EpsilonRule(0.0)
    return BaseRuleMapper(
        stabilizer=0.0, rule_mapper=lambda n, m: lrp0 if isinstance(m, (nn.Linear, nn.Conv2d)) else None
    )


class TestAgainstZennit:
    @pytest.mark.parametrize("make", [mlp, small_cnn])
    def test_epsilon_plus_matches_zennit(self, make):
        net = make().eval()
        x = torch.randn(4, 5, dtype=torch.float64) if make is mlp else torch.randn(4, 3, 8, 8, dtype=torch.float64)
        expected = zennit_model_relevance(zcomposites.EpsilonPlus(), net, x)
        actual = explain(net, x, rule_mapper=EpsilonPlus())["relevance", "x"]
        assert relative_error(actual, expected) <= 1e-6

    @pytest.mark.parametrize(
        "ours,theirs",
        [
            (lambda: EpsilonPlusFlat(), lambda: zcomposites.EpsilonPlusFlat()),
            (lambda: EpsilonAlpha2Beta1(), lambda: zcomposites.EpsilonAlpha2Beta1()),
            (lambda: EpsilonAlpha2Beta1Flat(), lambda: zcomposites.EpsilonAlpha2Beta1Flat()),
            (lambda: EpsilonGammaBox(-3.0, 3.0), lambda: zcomposites.EpsilonGammaBox(low=-3.0, high=3.0)),
        ],
        ids=["EpsilonPlusFlat", "EpsilonAlpha2Beta1", "EpsilonAlpha2Beta1Flat", "EpsilonGammaBox"],
    )
    def test_presets_match_zennit_on_a_cnn(self, ours, theirs):
        net = small_cnn().eval()
        x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
        expected = zennit_model_relevance(theirs(), net, x)
        actual = explain(net, x, rule_mapper=ours())["relevance", "x"]
        assert relative_error(actual, expected) <= 1e-6


class TestIdentities:
    @pytest.mark.parametrize("make", [mlp, small_cnn])
    def test_lrp0_is_gradient_times_input(self, make):
        net = make()
        x = torch.randn(4, 5, dtype=torch.float64) if make is mlp else torch.randn(4, 3, 8, 8, dtype=torch.float64)
        xg = x.clone().requires_grad_(True)
        out = net(xg)
        (grad,) = torch.autograd.grad(out.max(-1).values.sum(), xg)
        actual = explain(net, x, rule_mapper=lrp0_mapper())["relevance", "x"]
        assert relative_error(actual, x * grad) <= 1e-12

    @pytest.mark.parametrize("make", [mlp, small_cnn])
    def test_conservation_without_bias(self, make):
        net = make(bias=False)
        x = torch.randn(4, 5, dtype=torch.float64) if make is mlp else torch.randn(4, 3, 8, 8, dtype=torch.float64)
        td = explain(net, x, rule_mapper=EpsilonPlus(epsilon=1e-12, stabilizer=1e-12))
        totals = td["relevance", "x"].flatten(1).sum(1)
        torch.testing.assert_close(totals, td["y"].max(-1).values, rtol=1e-9, atol=1e-12)

    def test_conservation_through_sequential_glue_with_two_keys(self):
        encoder_a = nn.Linear(3, 6, bias=False).double()
        encoder_b = nn.Linear(2, 6, bias=False).double()
        head = nn.Sequential(nn.ReLU(), nn.Linear(12, 4, bias=False)).double()
        pipeline = TensorDictSequential(
            TensorDictModule(lambda a: (a - 0.0) * 2.0, in_keys=["a"], out_keys=["a_scaled"]),
            TensorDictModule(encoder_a, in_keys=["a_scaled"], out_keys=["ha"]),
            TensorDictModule(encoder_b, in_keys=["b"], out_keys=["hb"]),
            TensorDictModule(lambda ha, hb: torch.cat([ha, hb], -1), in_keys=["ha", "hb"], out_keys=["h"]),
            TensorDictModule(head, in_keys=["h"], out_keys=["q"]),
        )
        td = TensorDict(
            a=torch.randn(6, 3, dtype=torch.float64), b=torch.randn(6, 2, dtype=torch.float64), batch_size=[6]
        )
        out = LRP(pipeline, rule_mapper=EpsilonPlus(epsilon=1e-12))(td)
        total = out["relevance", "a"].sum(-1) + out["relevance", "b"].sum(-1)
        torch.testing.assert_close(total, out["q"].max(-1).values, rtol=1e-9, atol=1e-12)
        assert out["relevance", "b"].abs().sum() > 0 and out["relevance", "a"].abs().sum() > 0

    def test_batch_time_equals_flat_batch(self):
        net = mlp()
        x = torch.randn(3, 4, 5, dtype=torch.float64)
        lrp = LRP(TensorDictModule(net, in_keys=["x"], out_keys=["y"]), rule_mapper=EpsilonPlus())
        nested = lrp(TensorDict(x=x, batch_size=[3, 4]))
        flat = lrp(TensorDict(x=x.reshape(12, 5), batch_size=[12]))
        torch.testing.assert_close(nested["relevance", "x"].reshape(12, 5), flat["relevance", "x"])
        torch.testing.assert_close(nested["y"].reshape(12, 3), flat["y"])


class TestContract:
    def test_outputs_unchanged_and_nothing_else_left(self):
        net = mlp()
        x = torch.randn(4, 5, dtype=torch.float64)
        td = TensorDict(x=x, batch_size=[4])
        lrp = LRP(TensorDictModule(net, in_keys=["x"], out_keys=["y"]), rule_mapper=EpsilonPlus())
        with lrp:
            out = lrp(td)
        assert out is td
        assert torch.equal(out["y"], net(x))
        assert set(out.keys(include_nested=True, leaves_only=True)) == {"x", "y", ("relevance", "x")}
        assert out["x"] is x
        assert not any(v.requires_grad for v in out.values(include_nested=True, leaves_only=True))
        assert lrp.out_keys == ["y", ("relevance", "x")] and lrp.in_keys == ["x"]

    def test_a_key_named_twice_in_in_keys_is_explained_once_as_gradient_times_input(self):
        """``in_keys=["x", ("x",)]`` names one key: explained once, as the other methods do (it was fed twice, and
        the first copy's relevance was refused as unreached)."""
        net = mlp()
        x = torch.randn(4, 5, dtype=torch.float64)
        lrp = LRP(TensorDictModule(net, ["x"], ["y"]), lrp0_mapper(), in_keys=["x", ("x",)])
        out = lrp(TensorDict(x=x, batch_size=[4]))
        leaf = x.clone().requires_grad_(True)
        y = net(leaf)
        (grad,) = torch.autograd.grad(y.gather(-1, y.argmax(-1, keepdim=True)).sum(), leaf)
        torch.testing.assert_close(out["relevance", "x"], grad * x)
        assert lrp.relevance_keys == [("relevance", "x")] and lrp.in_keys == ["x"]

    @pytest.mark.parametrize("method", ["LRP", "Saliency"])
    def test_a_nested_relevance_key_is_refused_at_construction_naming_it(self, method):
        """A tuple prefix passed the checks of the keys and met tensordict's own errors in the call (a
        ``TypeError`` on nested membership, or a ``KeyError`` once the model had run)."""
        import tdhook.attribution as attribution

        module = TensorDictModule(mlp(), in_keys=["x"], out_keys=["y"])
        key = ("relevance", "lrp")
        with pytest.raises(TypeError, match=rf"{method}: relevance_key must be one key name.*" + re.escape(repr(key))):
            getattr(attribution, method)(module, relevance_key=key)
        # A key of one name is that name: on a key of the model, it is refused as the name is.
        with pytest.raises(ValueError, match="'y'"):
            getattr(attribution, method)(module, relevance_key=("y",))

    def test_plain_module_with_keys_and_keyword_call(self):
        net = mlp()
        lrp = LRP(net, rule_mapper=EpsilonPlus(), in_keys=["x"], out_keys=["y"])
        x = torch.randn(2, 5, dtype=torch.float64)
        y, relevance = lrp(x=x)
        assert torch.equal(y, net(x)) and relevance.shape == x.shape

    def test_plain_module_with_several_outputs(self):
        class TwoHeads(nn.Module):
            def __init__(self):
                super().__init__()
                self.body = mlp()

            def forward(self, x):
                y = self.body(x)
                return y, y.sum(-1, keepdim=True)

        net = TwoHeads()
        x = torch.randn(2, 5, dtype=torch.float64)
        td = LRP(net, in_keys=["x"], out_keys=["y", "total"], target_key="total")(TensorDict(x=x, batch_size=[2]))
        torch.testing.assert_close(td["total"], net(x)[1])
        torch.testing.assert_close(td["relevance", "x"], explain(net.body, x, target=lambda y: y)["relevance", "x"])
        with pytest.raises(RuntimeError, match=r"returned 2 outputs for the 1 out_keys \['y'\]"):
            LRP(net, in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[2]))

    def test_works_inside_a_sequential_and_under_no_grad(self):
        net = mlp()
        lrp = LRP(TensorDictModule(net, in_keys=["x"], out_keys=["y"]), rule_mapper=EpsilonPlus())
        after = TensorDictModule(lambda y: y.argmax(-1), in_keys=["y"], out_keys=["action"])
        pipeline = TensorDictSequential(lrp, after)
        with torch.no_grad():
            td = pipeline(TensorDict(x=torch.randn(3, 5, dtype=torch.float64), batch_size=[3]))
        assert td["relevance", "x"].abs().sum() > 0
        assert torch.equal(td["action"], td["y"].argmax(-1))

    def test_token_relevance_key_sums_the_feature_dimension(self):
        net = mlp()
        x = torch.randn(2, 4, 5, dtype=torch.float64)  # [B, T, H]: one relevance per "token" t
        lrp = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"], target="all", token_relevance_key="tokens")
        td = lrp(TensorDict(x=x, batch_size=[2, 4]))
        assert td["tokens", "x"].shape == (2, 4, 3)  # [B, T, K] for K output units
        torch.testing.assert_close(td["tokens", "x"], td["relevance", "x"].sum(-1), rtol=0, atol=0)
        assert ("tokens", "x") in lrp.out_keys
        with pytest.raises(ValueError, match="token_relevance_key and relevance_key are both 'relevance'"):
            LRP(net, in_keys=["x"], out_keys=["y"], token_relevance_key="relevance")

    def test_relevance_check_passes_on_conserving_net_and_names_a_lossy_layer(self):
        x = torch.randn(3, 5, dtype=torch.float64)
        check = raise_for_unconserved_rel_factory(atol=1e-8, rtol=1e-8)
        explain(mlp(bias=False), x, rule_mapper=EpsilonPlus(epsilon=1e-12), relevance_check=check)
        biased = mlp()
        with torch.no_grad():
            for layer in (biased[0], biased[4]):
                layer.bias.zero_()
            biased[2].bias.fill_(3.0)
        with pytest.raises(ValueError, match=r"module 'module\.2'"):
            explain(biased, x, rule_mapper=EpsilonPlus(epsilon=1e-12), relevance_check=check)


class TestRestoration:
    @pytest.mark.parametrize("make", [mlp, small_cnn])
    def test_model_restored_after_context(self, make):
        net = make()
        snapshot = state_snapshot(net)
        x = torch.randn(2, 5, dtype=torch.float64) if make is mlp else torch.randn(2, 3, 8, 8, dtype=torch.float64)
        lrp = LRP(TensorDictModule(net, in_keys=["x"], out_keys=["y"]), rule_mapper=EpsilonPlus())
        with lrp:
            lrp(TensorDict(x=x, batch_size=[2]))
            assert any(len(m._forward_hooks) for m in net.modules())
        assert_unchanged(net, snapshot)

    def test_model_restored_after_exception_inside_context(self):
        net = small_cnn()
        snapshot = state_snapshot(net)
        lrp = LRP(TensorDictModule(net, in_keys=["x"], out_keys=["y"]), rule_mapper=EpsilonPlus())
        with pytest.raises(RuntimeError, match="caller"):
            with lrp:
                lrp(TensorDict(x=torch.randn(2, 3, 8, 8, dtype=torch.float64), batch_size=[2]))
                raise RuntimeError("caller failed")
        assert_unchanged(net, snapshot)

    def test_entering_twice_is_refused(self):
        lrp = LRP(mlp(), in_keys=["x"], out_keys=["y"])
        with lrp:
            with pytest.raises(RuntimeError, match="already active"):
                lrp.__enter__()


class TestBadInput(ExpectsARefusal):
    def test_missing_key(self):
        self.run_and_expect(TensorDict(obs=torch.randn(2, 5), batch_size=[2]), KeyError, "input key 'x' is missing")

    def test_non_floating_input(self):
        td = TensorDict(x=torch.ones(2, 5, dtype=torch.long), batch_size=[2])
        # The model's own error first (a Linear cannot read integers), with a note naming the key.
        expected = "(?s)mat1 and mat2 must have the same dtype.*'x' holds integer tokens .torch.int64., which receive"
        self.run_and_expect(td, RuntimeError, expected)
        td = TensorDict(x=torch.ones(2, 5, dtype=torch.bool), batch_size=[2])
        self.run_and_expect(td, TypeError, "'x' must be a floating-point tensor .or integer tokens")

    def test_inference_mode_is_named(self):
        td = TensorDict(x=torch.randn(2, 5, dtype=torch.float64), batch_size=[2])
        with torch.inference_mode():
            self.run_and_expect(td, RuntimeError, r"torch.inference_mode\(\) is active .* blocks the gradients")

    def test_an_input_on_the_meta_device_is_named(self):
        # Before, the model ran on the shapes alone: a relevance of no values under LRP-0, and under z⁺ a bare
        # "Tensor.item() cannot be called on meta tensors" from inside a rule.
        td = TensorDict(x=torch.randn(2, 5, device="meta"), batch_size=[2])
        self.run_and_expect(td, ValueError, "input key 'x' is on the meta device, which holds shapes but no values")

    @pytest.mark.parametrize("layout", [torch.jagged, torch.strided], ids=["jagged", "strided"])
    def test_a_nested_tensor_input_is_named(self, layout):
        # Before, a bare "aten.scatter_.value" (jagged) or "NestedTensorImpl doesn't support sizes" (strided).
        samples = [torch.randn(3, 5, dtype=torch.float64), torch.randn(1, 5, dtype=torch.float64)]
        td = TensorDict(x=torch.nested.nested_tensor(samples, layout=layout), batch_size=[2])
        self.run_and_expect(td, TypeError, "input key 'x' holds a nested tensor .* pad the samples to one length")

    def test_a_masked_tensor_input_is_named(self):
        # Before, a bare "Multiple dispatch failed for 'torch._ops.aten.addmm.default'".
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch's note that MaskedTensor is a prototype
            x = torch.masked.masked_tensor(torch.randn(2, 5, dtype=torch.float64), torch.rand(2, 5) > 0.5)
            td = TensorDict(x=x, batch_size=[2])
            self.run_and_expect(td, TypeError, "input key 'x' holds a torch.masked.MaskedTensor, .*get_mask")

    def test_inputs_made_in_inference_mode_are_explained(self):
        with torch.inference_mode():
            x = torch.randn(2, 5, dtype=torch.float64)
        net = mlp()
        actual = LRP(TensorDictModule(net, in_keys=["x"], out_keys=["y"]))(TensorDict(x=x, batch_size=[2]))
        expected = LRP(TensorDictModule(net, in_keys=["x"], out_keys=["y"]))(TensorDict(x=x.clone(), batch_size=[2]))
        torch.testing.assert_close(actual["relevance", "x"], expected["relevance", "x"])

    def test_a_tensorclass_is_refused_or_explained_by_its_fields(self):
        @tensorclass
        class Observation:
            x: torch.Tensor

        observation = Observation(x=torch.randn(2, 5, dtype=torch.float64), batch_size=[2])
        self.run_and_expect(observation, TypeError, r"the input is a tensorclass \(Observation\), whose fields")
        td = TensorDict(x=observation, batch_size=[2])
        self.run_and_expect(td, TypeError, r"input key 'x' holds a Observation.*in_keys=\[\('x', 'x'\)\]")
        net = mlp()
        module = TensorDictModule(lambda o: net(o.x), in_keys=["x"], out_keys=["y"])
        out = LRP(module, in_keys=[("x", "x")])(td)
        expected = LRP(TensorDictModule(net, in_keys=["x"], out_keys=["y"]))(observation.to_tensordict())
        torch.testing.assert_close(out["relevance", "x", "x"], expected["relevance", "x"])


class CountLayerCalls:
    """Counts calls of the dense and convolution kernels, in the forward and the backward pass."""

    def __init__(self):
        self.calls = 0
        self._patches = []

    def _counting(self, func):
        def counted(*args, **kwargs):
            self.calls += 1
            return func(*args, **kwargs)

        return counted

    def __enter__(self):
        import torch.nn.functional as F

        for name in ("linear", "conv2d"):
            original = getattr(F, name)
            self._patches.append((name, original))
            setattr(F, name, self._counting(original))
        return self

    def __exit__(self, *exc_info):
        import torch.nn.functional as F

        for name, original in self._patches:
            setattr(F, name, original)
        self._patches = []


class TestCost:
    def count(self, net: nn.Module, x: torch.Tensor, rule_mapper) -> int:
        lrp = LRP(TensorDictModule(net, in_keys=["x"], out_keys=["y"]), rule_mapper=rule_mapper)
        with lrp:
            with CountLayerCalls() as counter:
                lrp(TensorDict(x=x, batch_size=[2]))
        return counter.calls

    def test_epsilon_runs_no_second_forward(self):
        net = small_cnn()
        x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
        epsilon_only = BaseRuleMapper(
            rule_mapper=lambda n, m: EpsilonRule() if isinstance(m, (nn.Linear, nn.Conv2d)) else None
        )
        with CountLayerCalls() as plain:
            net(x)
        assert plain.calls == 4
        assert self.count(net, x, epsilon_only) == plain.calls

    def test_zplus_adds_one_forward_per_convolution_after_relu(self):
        net = small_cnn()
        x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
        # The first convolution sees signed inputs (two extra passes), the second only ReLU outputs (one).
        assert self.count(net, x, EpsilonPlus()) == 4 + 2 + 1


class TestInputsNotExplained:
    """Keys taken from the module's in_keys that steer the model (booleans, integers no embedding reads) or that a
    torchrl recurrent module does without are inputs, not explained; keys the caller names always are."""

    @staticmethod
    def masked_policy() -> TensorDictModule:
        net = nn.Linear(5, 3).double()
        return TensorDictModule(
            lambda x, mask, steps: net(x).masked_fill(~mask, 0) + 0 * steps, ["x", "mask", "steps"], ["y"]
        )

    def test_boolean_and_integer_keys_get_no_relevance_by_default(self):
        td = TensorDict(
            x=torch.randn(4, 5, dtype=torch.float64),
            mask=torch.rand(4, 3) > 0.3,
            steps=torch.arange(4).unsqueeze(-1),
            batch_size=[4],
        )
        policy = self.masked_policy()
        out = LRP(policy)(td.clone())
        assert set(out["relevance"].keys()) == {"x"}
        assert torch.equal(out["relevance", "x"], LRP(policy, in_keys=["x"])(td.clone())["relevance", "x"])
        with pytest.raises(TypeError, match="'mask' must be a floating-point tensor"):
            LRP(policy, in_keys=["x", "mask"])(td.clone())

    def test_missing_recurrent_state_is_skipped_but_a_missing_input_is_named(self):
        from torchrl.modules import LSTMModule

        rnn = LSTMModule(input_size=5, hidden_size=4, in_key="x", out_key="y").double()
        td = TensorDict(
            x=torch.randn(3, 5, dtype=torch.float64), is_init=torch.ones(3, 1, dtype=torch.bool), batch_size=[3]
        )
        assert set(LRP(rnn)(td.clone())["relevance"].keys()) == {"x"}
        with pytest.raises(KeyError, match="input key 'x' is missing"):
            LRP(rnn)(td.exclude("x"))


class TestFirstAttempts(ExpectsARefusal):
    """What a first attempt gets wrong is named, with what was expected, before anything is run or written."""

    def test_a_plain_module_without_keys_is_shown_the_keys_to_give(self):
        with pytest.raises(TypeError, match=r"plain Sequential; give both, .* \(in_keys=\['x'\], out_keys=\['y'\]"):
            LRP(mlp(), EpsilonPlus())

    def test_a_dict_given_as_the_calls_argument_is_pointed_to_a_tensordict_or_keywords(self):
        """tensordict's dispatch puts a positional dict at the first in_key: the error spoke only of nested keys,
        ``in_keys=[('x', 'x')]``, not of the dict the caller passed."""
        lrp = LRP(TensorDictModule(mlp(), in_keys=["x"], out_keys=["y"]))
        with pytest.raises(
            TypeError, match=r"input key 'x' holds a TensorDict.*lrp\(TensorDict\(.*lrp\(observation=obs\)"
        ):
            lrp({"x": torch.randn(2, 5, dtype=torch.float64)})

    def test_a_tensor_in_the_way_of_the_relevance_keys_is_named(self):
        td = TensorDict(x=torch.randn(2, 5, dtype=torch.float64), relevance=torch.zeros(2), batch_size=[2])
        expected = r"holds a Tensor at 'relevance', where the relevance key \('relevance', 'x'\)"
        self.run_and_expect(td, KeyError, expected)
        td = TensorDict(x=torch.randn(2, 5, dtype=torch.float64), scores=torch.zeros(2), batch_size=[2])
        self.run_and_expect(td, KeyError, "relevance_key=", relevance_key="scores")

    @pytest.mark.parametrize("key", ["x", "y"])
    def test_a_relevance_key_on_a_key_of_the_model_is_refused(self, key):
        with pytest.raises(ValueError, match=f"relevance key \\('{key}', 'x'\\) .* the model's key '{key}'"):
            LRP(TensorDictModule(mlp(), in_keys=["x"], out_keys=["y"]), relevance_key=key)

    @pytest.mark.parametrize("key", ["hidden", "extra"])
    def test_a_key_the_module_fills_itself_or_does_not_read_is_refused_when_built(self, key):
        """Its relevance would be zero whatever the model does: refused when built, naming the key, as the methods
        refuse it (before, only when called)."""
        first = TensorDictModule(nn.Linear(5, 6).double(), in_keys=["x"], out_keys=["hidden"])
        second = TensorDictModule(nn.Linear(6, 3).double(), in_keys=["hidden"], out_keys=["y"])
        expected = rf"LRP: input key '{key}' is not an input of the module \(it reads \['x'\]"
        with pytest.raises(ValueError, match=expected):
            LRP(TensorDictSequential(first, second), in_keys=["x", key])

    def test_an_input_of_another_dtype_than_the_model_is_named(self):
        td = TensorDict(x=torch.randn(2, 5), batch_size=[2])  # mlp() is float64
        self.run_and_expect(td, RuntimeError, r"'x' is torch.float32, the model's parameters torch.float64")

    def test_a_rule_mapper_that_is_not_one_is_named(self):
        policy = TensorDictModule(mlp(), in_keys=["x"], out_keys=["y"])
        with pytest.raises(TypeError, match=r"the class EpsilonPlus; pass an instance, EpsilonPlus\(\)"):
            LRP(policy, EpsilonPlus)
        with pytest.raises(TypeError, match=r"zennit composite .* tdhook.attribution.EpsilonPlus\(\)"):
            LRP(policy, zcomposites.EpsilonPlus())
        with pytest.raises(TypeError, match="rule_mapper must be .* got str"):
            LRP(policy, "EpsilonPlus")
        with pytest.raises(TypeError, match=r"a single rule \(EpsilonRule\); map it .* \{nn.Linear: rule\}"):
            LRP(policy, EpsilonRule(0.25))


def test_a_rule_mapper_set_on_the_wrapper_is_made_a_mapper_as_the_constructors():
    """``lrp.rule_mapper = {...}`` (a dict, as the constructor takes) was kept as the dict, and every later call
    failed with "'dict' object is not callable". It is now the mapper the constructor makes of it, its keys that
    match no module warned of, in a context too (the context follows the new mapper)."""
    from tdhook.attribution.lrp_helpers.rules import EpsilonRule

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    td = TensorDict(x=torch.randn(2, 3, dtype=torch.float64), batch_size=[2])

    def relevance(lrp: LRP) -> torch.Tensor:
        return lrp(td.clone())["relevance", "x"]

    wrapper = LRP(net, in_keys=["x"], out_keys=["y"])
    wrapper.rule_mapper = {"0": EpsilonRule(0.5)}
    expected = relevance(LRP(net, rule_mapper={"0": EpsilonRule(0.5)}, in_keys=["x"], out_keys=["y"]))
    plain = relevance(LRP(net, in_keys=["x"], out_keys=["y"]))
    assert not torch.allclose(expected, plain)
    torch.testing.assert_close(relevance(wrapper), expected, rtol=0, atol=0)
    with wrapper:
        relevance(wrapper)
        wrapper.rule_mapper = None
        torch.testing.assert_close(relevance(wrapper), plain, rtol=0, atol=0)
    with pytest.warns(UserWarning, match="'9'"):
        wrapper.rule_mapper = {"9": EpsilonRule(0.5)}


class TestOptionsSetAfterConstruction:
    """Options set on the wrapper after it is built ran unchecked: ``lrp.relevance_key = "rel"`` and
    ``lrp.target_key = ...`` changed nothing the calls did (the relevance was still written at
    ``("relevance", "x")``, the default target explained), with no word; ``memory_budget = -1`` was kept,
    ``create_graph = "no"`` and ``relevance_check = 3`` failed inside the call with Python's bare errors."""

    @staticmethod
    def wrapper() -> LRP:
        return LRP(TensorDictModule(mlp(), in_keys=["x"], out_keys=["y"]), rule_mapper=EpsilonPlus())

    @pytest.mark.parametrize("name", ["relevance_key", "target_key", "token_relevance_key"])
    def test_the_keys_it_writes_are_fixed(self, name):
        lrp = self.wrapper()
        before = getattr(lrp, name)
        with pytest.raises(AttributeError, match=rf"LRP: {name} is fixed when the wrapper is built; build a new"):
            setattr(lrp, name, "other")
        assert getattr(lrp, name) == before

    @pytest.mark.parametrize(
        ("name", "value", "error", "match"),
        [
            ("memory_budget", -1, ValueError, "LRP: memory_budget must be a positive number of bytes, got -1"),
            ("memory_budget", "1GB", TypeError, "LRP: memory_budget must be an int"),
            ("create_graph", "no", TypeError, "LRP: create_graph must be True or False"),
            ("relevance_check", 3, TypeError, "LRP: relevance_check must be a callable"),
        ],
    )
    def test_a_value_the_constructor_refuses_is_refused_when_set(self, name, value, error, match):
        from tdhook.attribution.tunables import _ARGUMENTS

        lrp = self.wrapper()
        before, recorded = getattr(lrp, name), lrp.__dict__[_ARGUMENTS].get(name)
        with pytest.raises(error, match=match):
            setattr(lrp, name, value)
        assert getattr(lrp, name) == before and lrp.__dict__[_ARGUMENTS].get(name) == recorded
        with pytest.raises(error, match=match):
            LRP(TensorDictModule(mlp(), in_keys=["x"], out_keys=["y"]), rule_mapper=EpsilonPlus(), **{name: value})
