"""What every method shares: keys, batch shapes, pipelines, no_grad, targets, options by key, and refusals."""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule, TensorDictSequential
from torch import nn
from torch.overrides import TorchFunctionMode
from torchrl.envs.utils import ExplorationType, set_exploration_type

import tdhook.attribution
from tdhook.attribution import (
    FeatureAblation,
    GradientShap,
    GuidedBackprop,
    InputXGradient,
    IntegratedGradients,
    Occlusion,
    Saliency,
    ShapleyValueSampling,
    SmoothGrad,
)
from tests.attribution._helpers import assert_unchanged, state_snapshot
from tests.attribution.methods._models import TwoKeyNet, random_mlp, two_key_policy

# name -> constructor keywords; every method of the package is listed (METHODS is extended as they land).
METHODS = {
    "Saliency": (Saliency, {}),
    "InputXGradient": (InputXGradient, {}),
    "GuidedBackprop": (GuidedBackprop, {}),
    "IntegratedGradients": (IntegratedGradients, {"n_steps": 6}),
    "SmoothGrad": (SmoothGrad, {"n_samples": 4, "stdev": 0.3, "seed": 0}),
    "FeatureAblation": (FeatureAblation, {}),
    "GradientShap": (GradientShap, {"n_samples": 3, "seed": 0}),
    "Occlusion": (Occlusion, {"sliding_window_shapes": (2,), "strides": 1}),
    "ShapleyValueSampling": (ShapleyValueSampling, {"n_samples": 3, "seed": 0}),
}


class SequenceNet(nn.Module):
    """Five features read as a sequence of five steps of one, through a layer with a dropout probability of its own
    (attention dropout, dropout between recurrent layers), then a Linear head."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.embed = nn.Linear(1, 4)
        if kind == "MultiheadAttention":
            self.layer = nn.MultiheadAttention(4, 2, dropout=0.5, batch_first=True)
        else:
            self.layer = getattr(nn, kind)(4, 4, num_layers=2, dropout=0.5, batch_first=True)
        self.head = nn.Linear(20, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.unsqueeze(-1))
        out = self.layer(h, h, h) if isinstance(self.layer, nn.MultiheadAttention) else self.layer(h)
        return self.head(out[0].flatten(1))


# GradientShap's reference samples, per key of the models below (two references each).
_DRAWS = torch.Generator().manual_seed(0)
REFERENCES = {
    "x": torch.randn(2, 5, dtype=torch.float64, generator=_DRAWS),
    "obs": torch.randn(2, 4, dtype=torch.float64, generator=_DRAWS),
    "goal": torch.randn(2, 2, dtype=torch.float64, generator=_DRAWS),
    ("agents", "obs"): torch.randn(2, 5, dtype=torch.float64, generator=_DRAWS),
    "hidden": torch.randn(2, 6, dtype=torch.float64, generator=_DRAWS),
    "extra": torch.randn(2, 2, dtype=torch.float64, generator=_DRAWS),
}


def make(name: str, module, **kwargs):
    cls, defaults = METHODS[name]
    if name == "GradientShap" and "baselines" not in kwargs:
        keys = kwargs.get("in_keys") or getattr(module, "in_keys", [])
        kwargs["baselines"] = {key: REFERENCES[key] for key in keys}
    return cls(module, **{**defaults, **kwargs})


def policy_td(batch=(4,)) -> TensorDict:
    return TensorDict(
        obs=torch.randn(*batch, 4, dtype=torch.float64),
        goal=torch.randn(*batch, 2, dtype=torch.float64),
        batch_size=batch,
    )


@pytest.mark.parametrize("name", list(METHODS))
class TestKeysAndShapes:
    @pytest.mark.parametrize("batch", [(), (3,), (2, 3)])
    def test_any_batch_shape_matches_the_flattened_batch(self, name, batch):
        net = random_mlp(1)
        x = torch.randn(*batch, 5, dtype=torch.float64)
        method = make(name, net, in_keys=["x"], out_keys=["y"])
        td = method(TensorDict(x=x, batch_size=batch))
        assert td["attribution", "x"].shape == x.shape
        assert torch.equal(td["y"], net(x).detach())
        flat = method(TensorDict(x=x.reshape(-1, 5), batch_size=[max(1, x.numel() // 5)]))
        torch.testing.assert_close(
            td["attribution", "x"].reshape(-1, 5), flat["attribution", "x"], rtol=1e-10, atol=1e-12
        )

    def test_two_keys_and_a_key_left_fixed(self, name):
        policy = two_key_policy()
        td = policy_td()
        both = make(name, policy)(td.clone())
        assert both["attribution", "obs"].shape == (4, 4) and both["attribution", "goal"].shape == (4, 2)
        only_obs = make(name, policy, in_keys=["obs"])(td.clone())
        assert ("attribution", "goal") not in only_obs.keys(include_nested=True)
        assert only_obs["attribution", "obs"].shape == (4, 4)
        assert torch.equal(only_obs["action_value"], policy(td.clone())["action_value"])

    def test_nested_keys_and_relevance_key(self, name):
        net = random_mlp(2)
        td = TensorDict({("agents", "obs"): torch.randn(3, 5, dtype=torch.float64)}, batch_size=[3])
        out = make(name, net, in_keys=[("agents", "obs")], out_keys=["y"], relevance_key="expl")(td)
        assert out["expl", "agents", "obs"].shape == (3, 5)

    def test_under_no_grad_nothing_requires_grad(self, name):
        policy = two_key_policy()
        with torch.no_grad():
            td = make(name, policy)(policy_td())
        assert not any(v.requires_grad for v in td.values(include_nested=True, leaves_only=True))
        assert td["attribution", "obs"].abs().sum() > 0

    def test_under_no_grad_an_lstm_policy_writes_the_plain_calls_outputs(self, name):
        """torch's float32 LSTM on CPU takes another kernel without gradient: the outputs written under the caller's
        no_grad are the plain call's in that mode, bit for bit, as LRP's (the gradient methods wrote those of the
        call with gradient, 1.5e-8 off), and the attribution is that of a call with gradient."""
        torch.manual_seed(0)
        lstm, head = nn.LSTM(2, 8, num_layers=2, batch_first=True), nn.Linear(8, 3)
        net = nn.Sequential(lstm, _FirstOutput(), head).eval()
        td = TensorDict(x=torch.randn(4, 3, 2), batch_size=[4])
        with torch.no_grad():
            plain = net(td["x"])
        options = {"GradientShap": {"baselines": torch.zeros(2, 3, 2)}, "Occlusion": {"sliding_window_shapes": (1, 2)}}
        method = make(name, net, in_keys=["x"], out_keys=["y"], **options.get(name, {}))
        with_grad = method(td.clone())
        with torch.no_grad():
            out = method(td.clone())
        assert torch.equal(out["y"], plain)
        torch.testing.assert_close(out["attribution", "x"], with_grad["attribution", "x"], rtol=1e-5, atol=1e-7)
        assert not any(m._forward_hooks for m in net.modules())

    def test_another_default_device_changes_nothing(self, name):
        """Built and called under another default device (``torch.set_default_device("cuda")``; ``"meta"`` here), a
        method computes what it does without one: its draws and quadrature are made on the CPU, as documented
        (SmoothGrad and GradientShap drew on the default device, IntegratedGradients built its points there)."""
        net = random_mlp(3)
        td = TensorDict(x=torch.randn(2, 5, dtype=torch.float64), batch_size=[2])
        expected = make(name, net, in_keys=["x"], out_keys=["y"])(td.clone())["attribution", "x"]
        with torch.device("meta"):
            actual = make(name, net, in_keys=["x"], out_keys=["y"])(td.clone())["attribution", "x"]
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)

    def test_parameters_get_no_grad(self, name):
        net = random_mlp(3)
        make(name, net, in_keys=["x"], out_keys=["y"])(
            TensorDict(x=torch.randn(2, 5, dtype=torch.float64), batch_size=[2])
        )
        assert all(p.grad is None for p in net.parameters())

    def test_wrapping_a_sequential_and_as_its_step(self, name):
        torch.manual_seed(0)
        first = TensorDictModule(nn.Linear(5, 6).double(), in_keys=["x"], out_keys=["hidden"])
        second = TensorDictModule(
            nn.Sequential(nn.Tanh(), nn.Linear(6, 3)).double(), in_keys=["hidden"], out_keys=["logits"]
        )
        pipeline = TensorDictSequential(first, second)
        x = torch.randn(4, 5, dtype=torch.float64)
        wrapped = make(name, pipeline)(TensorDict(x=x, batch_size=[4]))
        assert wrapped["attribution", "x"].shape == (4, 5)
        assert torch.equal(wrapped["logits"], pipeline(TensorDict(x=x, batch_size=[4]))["logits"])
        # As a step: explain the second module's input inside a bigger pipeline.
        outer = TensorDictSequential(first, make(name, second))
        td = outer(TensorDict(x=x, batch_size=[4]))
        assert td["attribution", "hidden"].shape == (4, 6)
        direct = make(name, second)(TensorDict(hidden=td["hidden"], batch_size=[4]))
        assert torch.equal(td["attribution", "hidden"], direct["attribution", "hidden"])
        assert set(make(name, second).out_keys) == {"logits", ("attribution", "hidden")}

    def test_keyword_call(self, name):
        net = random_mlp(4)
        # Keyword tensors come without a batch size: the whole tensor is one sample.
        extra = {"sliding_window_shapes": (1, 2)} if name == "Occlusion" else {}
        if name == "GradientShap":
            extra = {"baselines": torch.zeros(1, 3, 5, dtype=torch.float64)}
        method = make(name, TensorDictModule(net, in_keys=["x"], out_keys=["y"]), **extra)
        mixing = name in ("FeatureAblation", "Occlusion", "ShapleyValueSampling")  # its groups span the 3 rows
        with pytest.warns(UserWarning, match="have 3 leading rows") if mixing else warnings.catch_warnings():
            if not mixing:
                warnings.simplefilter("error")
            y, attribution = method(x=torch.randn(3, 5, dtype=torch.float64))
        assert y.shape == (3, 3) and attribution.shape == (3, 5)


@pytest.mark.parametrize("name", list(METHODS))
class TestTargets:
    def test_int_and_tensor_targets_agree(self, name):
        net = random_mlp(5)
        td = TensorDict(x=torch.randn(4, 5, dtype=torch.float64), batch_size=[4])
        by_int = make(name, net, in_keys=["x"], out_keys=["y"], target=2)(td.clone())
        by_tensor = make(name, net, in_keys=["x"], out_keys=["y"], target=torch.full((4,), 2))(td.clone())
        assert torch.equal(by_int["attribution", "x"], by_tensor["attribution", "x"])

    def test_all_stacks_every_unit_after_the_batch_dims(self, name):
        net = random_mlp(6)
        td = TensorDict(x=torch.randn(2, 3, 5, dtype=torch.float64), batch_size=[2, 3])
        every = make(name, net, in_keys=["x"], out_keys=["y"], target="all")(td.clone())["attribution", "x"]
        assert every.shape == (2, 3, 3, 5)
        for unit in range(3):
            one = make(name, net, in_keys=["x"], out_keys=["y"], target=unit)(td.clone())["attribution", "x"]
            torch.testing.assert_close(every[:, :, unit], one, rtol=1e-10, atol=1e-12)

    def test_callable_target_weights_the_output(self, name):
        net = random_mlp(7)
        td = TensorDict(x=torch.randn(4, 5, dtype=torch.float64), batch_size=[4])
        weights = torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64)
        by_callable = make(name, net, in_keys=["x"], out_keys=["y"], target=lambda y: y * weights)(td.clone())
        by_int = make(name, net, in_keys=["x"], out_keys=["y"], target=1)(td.clone())
        torch.testing.assert_close(by_callable["attribution", "x"], by_int["attribution", "x"], rtol=1e-10, atol=1e-12)

    def test_callable_target_relevance_on_a_zero_output_is_refused(self, name):
        """``output × weight`` cannot carry relevance from an output that is exactly 0: an error, not a zero map."""
        net = nn.Sequential(nn.Linear(5, 3), nn.ReLU()).double()
        with torch.no_grad():
            net[0].bias.copy_(torch.tensor([5.0, -50.0, 5.0]))  # unit 1 is 0 for every sample
        td = TensorDict(x=torch.randn(2, 5, dtype=torch.float64), batch_size=[2])
        x = td["x"].clone()
        with pytest.raises(ValueError, match=rf"{name}: the callable target puts relevance on 2 entries of output 'y'"):
            make(name, net, in_keys=["x"], out_keys=["y"], target=torch.ones_like)(td)
        assert list(td.keys()) == ["x"] and torch.equal(td["x"], x)

    def test_default_target_is_the_argmax_on_the_unperturbed_input(self, name):
        net = random_mlp(8)
        x = torch.randn(6, 5, dtype=torch.float64)
        default = make(name, net, in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[6]))
        chosen = make(name, net, in_keys=["x"], out_keys=["y"], target=net(x).argmax(-1))(
            TensorDict(x=x, batch_size=[6])
        )
        assert torch.equal(default["attribution", "x"], chosen["attribution", "x"])


class _FirstOutput(nn.Module):
    """The last step of an LSTM's output sequence."""

    def forward(self, out: tuple) -> torch.Tensor:
        return out[0][:, -1]


class ScalesItsInputs(nn.Module):
    """A policy that scales its observation and goal first, in place (``obs /= 255``) or not."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.in_place = in_place
        torch.manual_seed(3)
        self.net = TwoKeyNet().double()

    def forward(self, obs: torch.Tensor, goal: torch.Tensor) -> torch.Tensor:
        if self.in_place:
            obs /= 255.0
            goal /= 2.0
        else:
            obs, goal = obs / 255.0, goal / 2.0
        return self.net(obs * 100.0, goal)


@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("explained", [["goal"], ["obs", "goal"]])
def test_a_model_that_scales_its_inputs_in_place(name, explained):
    """Every perturbed pass sees the caller's values, also of a key left fixed that the model scales in place."""
    td = TensorDict(
        obs=torch.rand(3, 4, dtype=torch.float64) * 255, goal=torch.randn(3, 2, dtype=torch.float64), batch_size=[3]
    )
    results = [
        make(name, TensorDictModule(ScalesItsInputs(in_place), ["obs", "goal"], ["q"]), in_keys=explained)(td.clone())
        for in_place in (False, True)
    ]
    for key in explained:
        torch.testing.assert_close(results[1]["attribution", key], results[0]["attribution", key], rtol=1e-12, atol=0)
    torch.testing.assert_close(results[1]["q"], results[0]["q"], rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", list(METHODS))
class TestRefusals:
    def run_and_expect(self, name, td, error, match, **kwargs):
        net = random_mlp(9)
        snapshot = state_snapshot(net)
        before = dict(td.items(include_nested=True, leaves_only=True))
        method = make(name, net, out_keys=["y"], **{"in_keys": ["x"], **kwargs})
        with pytest.raises(error, match=match):
            method(td)
        assert_unchanged(net, snapshot)
        after = dict(td.items(include_nested=True, leaves_only=True))
        assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)

    def test_missing_key(self, name):
        self.run_and_expect(
            name, TensorDict(z=torch.randn(2, 5), batch_size=[2]), KeyError, f"{name}: input key 'x' is missing"
        )

    def test_integer_input(self, name):
        self.run_and_expect(
            name, TensorDict(x=torch.ones(2, 5, dtype=torch.long), batch_size=[2]), TypeError, f"{name}: input key 'x'"
        )

    def test_target_out_of_range(self, name):
        td = TensorDict(x=torch.randn(2, 5, dtype=torch.float64), batch_size=[2])
        self.run_and_expect(name, td, IndexError, f"{name}: target 7 is out of range for output 'y'", target=7)

    def test_a_model_that_raises(self, name):
        td = TensorDict(x=torch.randn(2, 4, dtype=torch.float64), batch_size=[2])
        self.run_and_expect(name, td, RuntimeError, "shapes cannot be multiplied")

    def test_output_key_taken_by_a_leaf(self, name):
        td = TensorDict(x=torch.randn(2, 5, dtype=torch.float64), attribution=torch.zeros(2), batch_size=[2])
        self.run_and_expect(name, td, KeyError, f"{name}: the TensorDict holds a Tensor at 'attribution', where")

    @pytest.mark.parametrize("key", ["x", "y"])
    def test_a_relevance_key_on_a_key_of_the_model(self, name, key):
        with pytest.raises(ValueError, match=rf"{name}: the relevance key \('{key}', 'x'\) would .* key '{key}'"):
            make(name, random_mlp(9), in_keys=["x"], out_keys=["y"], relevance_key=key)

    def test_an_input_of_another_dtype_than_the_model(self, name):
        td = TensorDict(x=torch.randn(2, 5), batch_size=[2])  # random_mlp is float64
        expected = f"{name}: input 'x' is torch.float32, the model's parameters torch.float64"
        self.run_and_expect(name, td, RuntimeError, expected)

    def test_one_target_key_only(self, name):
        with pytest.raises(ValueError, match=f"{name}: explains one output; pass target_key=<key>"):
            make(name, two_key_policy(), target_key={"a": "action_value", "b": "action_value"})

    @pytest.mark.parametrize(
        "draws, expected",
        [
            (lambda: nn.Dropout(0.5), r"Dropout, p=0.5"),
            (lambda: nn.RReLU(0.1, 0.9), r"RReLU, negative slopes drawn from \[0.1, 0.9\]"),
        ],
        ids=["dropout", "rrelu"],
    )
    def test_a_module_that_draws_in_training_mode_warns_once(self, name, draws, expected):
        """nn.RReLU in training mode draws its negative slopes anew at every pass, as dropout drops other units: it
        went without a word (Occlusion's attribution moved by 0.28, its range 0.34, from call to call)."""
        net = nn.Sequential(nn.Linear(5, 8), draws(), nn.Linear(8, 3)).double()
        method = make(name, net, in_keys=["x"], out_keys=["y"])
        td = TensorDict(x=torch.randn(2, 5, dtype=torch.float64), batch_size=[2])
        with pytest.warns(UserWarning, match=f"{name}: module '1' \\({expected}\\) is in training mode"):
            method(td.clone())
        net.eval()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            method(td.clone())

    @pytest.mark.parametrize("kind", ["MultiheadAttention", "LSTM", "GRU", "RNN"])
    def test_a_layer_with_a_dropout_probability_of_its_own_warns_in_training_mode(self, name, kind):
        """nn.MultiheadAttention's attention dropout and the dropout between the layers of an nn.LSTM, nn.GRU or
        nn.RNN are no Dropout module: in training mode every pass drew other units without a word (Occlusion's
        attribution moved by 0.82 to 1.2 of its norm from seed to seed, Saliency's by 0.46 to 1.4)."""
        net = SequenceNet(kind).double().train()
        method = make(name, net, in_keys=["x"], out_keys=["y"])
        td = TensorDict(x=torch.randn(2, 5, dtype=torch.float64), batch_size=[2])
        what = "attention dropout p=0.5" if kind == "MultiheadAttention" else "dropout p=0.5 between layers"
        with pytest.warns(UserWarning, match=rf"{name}: module 'layer' \({kind}, {what}\) is in training mode"):
            method(td.clone())
        net.eval()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            method(td.clone())

    def test_a_fractional_max_pooling_warns_in_eval_mode_too(self, name):
        """nn.FractionalMaxPool2d draws its pooling regions at every forward pass, in eval mode too: the methods that
        make several passes mixed those draws into the attribution without a word (Occlusion's moved by 1.02 of its
        norm from seed to seed). Regions fixed with ``_random_samples`` draw nothing."""
        pool = nn.FractionalMaxPool2d(2, output_size=2)
        net = nn.Sequential(nn.Linear(5, 32), nn.Unflatten(1, (2, 4, 4)), pool, nn.Flatten(), nn.Linear(8, 3))
        net = net.double().eval()
        method = make(name, net, in_keys=["x"], out_keys=["y"])
        td = TensorDict(x=torch.randn(2, 5, dtype=torch.float64), batch_size=[2])
        expected = rf"{name}: module '2' \(FractionalMaxPool2d, pooling regions drawn at random\) draws in eval mode"
        with pytest.warns(UserWarning, match=expected):
            method(td.clone())
        pool._random_samples = torch.rand(4096, 2, 2, dtype=torch.float64)  # rows for every pass's batch
        attributions = []
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for seed in (0, 1):
                torch.manual_seed(seed)
                attributions.append(make(name, net, in_keys=["x"], out_keys=["y"])(td.clone())["attribution", "x"])
        torch.testing.assert_close(attributions[0], attributions[1], rtol=0, atol=0)

    def test_a_key_the_module_does_not_read_or_fills_itself(self, name):
        """Its attribution would be zero whatever the model does (LRP refuses it too): refused, naming the key."""
        first = TensorDictModule(nn.Linear(5, 6).double(), in_keys=["x"], out_keys=["hidden"])
        second = TensorDictModule(nn.Linear(6, 3).double(), in_keys=["hidden"], out_keys=["logits"])
        for key in ["hidden", "extra"]:
            with pytest.raises(ValueError, match=rf"{name}: input key '{key}' is not an input of the module"):
                make(name, TensorDictSequential(first, second), in_keys=["x", key])

    def test_under_inference_mode(self, name):
        """The perturbation methods need no gradient and run; the others refuse, naming the method."""
        net = random_mlp(3)
        td = TensorDict(x=torch.randn(3, 5, dtype=torch.float64), batch_size=[3])
        method = make(name, net, in_keys=["x"], out_keys=["y"])
        if name in ("FeatureAblation", "Occlusion", "ShapleyValueSampling"):
            expected = method(td.clone())["attribution", "x"]
            with torch.inference_mode():
                result = method(td.clone())["attribution", "x"]
            assert torch.equal(result, expected)
        else:
            with pytest.raises(RuntimeError, match=f"^{name}: torch.inference_mode\\(\\) is active"):
                with torch.inference_mode():
                    method(td)
            assert list(td.keys()) == ["x"]

    def test_plain_module_needs_keys(self, name):
        with pytest.raises(TypeError, match=f"{name} needs in_keys and out_keys"):
            make(name, nn.Linear(2, 2), in_keys=["x"])

    def test_a_weight_on_the_meta_device_is_named(self, name):
        """torch computes a linear layer from a weight on the meta device and a bias on the CPU, and returns what
        the memory held (attributions up to 1e35, or NaN, before): refused as LRP refuses it, naming the module."""
        net = random_mlp(9)
        net[2].weight = nn.Parameter(torch.empty_like(net[2].weight, device="meta"))
        hooks = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in net.modules()]
        td = TensorDict(x=torch.randn(2, 5, dtype=torch.float64), batch_size=[2])
        expected = rf"^{name}: the module '2' \(Linear\) holds its parameter 'weight' on the meta device, .* on cpu"
        with pytest.raises(ValueError, match=expected):
            make(name, net, in_keys=["x"], out_keys=["y"])(td)
        assert [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in net.modules()] == hooks
        assert list(td.keys()) == ["x"] and net[2].weight.is_meta

    def test_a_meta_tensor_held_but_not_computed_with_is_no_error(self, name):
        """A template's tensor that the model holds on the meta device and never reads leaves the call as it is."""
        net = random_mlp(9)
        td = TensorDict(x=torch.randn(2, 5, dtype=torch.float64), batch_size=[2])
        expected = make(name, net, in_keys=["x"], out_keys=["y"])(td.clone())["attribution", "x"]
        net.register_buffer("template", torch.empty(3, device="meta"))
        result = make(name, net, in_keys=["x"], out_keys=["y"])(td.clone())["attribution", "x"]
        torch.testing.assert_close(result, expected, rtol=0, atol=0)


class TestTorchRL:
    def test_q_value_actor_default_target_and_action_values(self):
        from torchrl.modules import MLP, QValueActor

        net = MLP(in_features=4, out_features=3, num_cells=[16]).double()
        actor = QValueActor(net, in_keys=["observation"], action_space="one-hot")
        obs = torch.randn(6, 4, dtype=torch.float64)
        chosen = net(obs).argmax(-1)
        td = Saliency(actor, abs=False)(TensorDict(observation=obs, batch_size=[6]))
        direct = Saliency(net, in_keys=["observation"], out_keys=["q"], target=chosen, abs=False)
        expected = direct(TensorDict(observation=obs, batch_size=[6]))["attribution", "observation"]
        torch.testing.assert_close(td["attribution", "observation"], expected, rtol=1e-12, atol=0)
        assert torch.equal(td["action"].argmax(-1), chosen)
        # Path methods name the action values, so that the action explained is the one chosen at the input.
        ig = IntegratedGradients(actor, target_key="action_value", n_steps=8)
        by_actor = ig(TensorDict(observation=obs, batch_size=[6]))["attribution", "observation"]
        by_net = IntegratedGradients(net, in_keys=["observation"], out_keys=["q"], target=chosen, n_steps=8)
        expected = by_net(TensorDict(observation=obs, batch_size=[6]))["attribution", "observation"]
        torch.testing.assert_close(by_actor, expected, rtol=1e-12, atol=0)

    @pytest.mark.parametrize("name", list(METHODS))
    def test_the_default_chosen_action_value_is_held_at_the_action_chosen_on_the_input(self, name):
        """Path, sampling and perturbation methods explained the greedy action of each perturbed input (the max of
        the action values there): 0.19 off the action chosen on the input for FeatureAblation, as LRP explains it."""
        from torchrl.modules import QValueActor

        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3)).double()
        actor = QValueActor(net, in_keys=["observation"], action_space="one-hot")
        obs = 2 * torch.randn(6, 4, dtype=torch.float64)
        chosen = net(obs).argmax(-1)
        references = {"baselines": REFERENCES["obs"]} if name == "GradientShap" else {}
        td = make(name, actor, **references)(TensorDict(observation=obs, batch_size=[6]))
        assert torch.equal(td["chosen_action_value"], net(obs).max(-1, keepdim=True).values.detach())
        direct = make(name, net, in_keys=["observation"], out_keys=["q"], target=chosen, **references)
        expected = direct(TensorDict(observation=obs, batch_size=[6]))["attribution", "observation"]
        torch.testing.assert_close(td["attribution", "observation"], expected, rtol=1e-12, atol=1e-14)

    @pytest.mark.parametrize("name", ["IntegratedGradients", "Occlusion"])
    def test_rollout_takes_the_same_actions(self, name):
        from torchrl.envs import GymEnv
        from torchrl.modules import MLP, QValueActor

        env = GymEnv("CartPole-v1")
        actor = QValueActor(
            MLP(in_features=4, out_features=2, num_cells=[16]), in_keys=["observation"], spec=env.action_spec
        )
        env.set_seed(0)
        plain = env.rollout(20, actor, break_when_any_done=False)
        env.set_seed(0)
        method = make(name, actor, target_key="action_value")
        explained = env.rollout(20, method, break_when_any_done=False)
        assert torch.equal(explained["action"], plain["action"])
        attribution = explained["attribution", "observation"]
        assert attribution.shape == (20, 4) and torch.isfinite(attribution).all() and attribution.abs().sum() > 0

    def test_collector_under_no_grad(self):
        from tests.attribution._cartpole import collected, q_value_actor

        policy = SmoothGrad(q_value_actor(), target_key="action_value", n_samples=3, stdev=0.1, seed=0)
        batches = collected(policy)
        assert len(batches) == 2
        for batch in batches:
            attribution = batch["attribution", "observation"]
            assert not attribution.requires_grad and attribution.numel() == 16 * 4 and attribution.abs().sum() > 0


@pytest.mark.parametrize("held", [False, True])
@pytest.mark.parametrize("name", list(METHODS))
def test_a_masked_policy_explains_the_held_or_best_allowed_action(name, held):
    """As LRP: the default target of a masked policy's logits is the action a transition holds, else the best
    allowed one (the methods explained the plain argmax, forbidden everywhere here: 0.3 to 1.7 off)."""
    from torchrl.modules import MaskedCategorical

    from tests.attribution.test_policy_targets import as_transition, masked_actor, masked_td

    actor = masked_actor(MaskedCategorical)
    td = masked_td(actor)
    with torch.no_grad():
        logits = actor.module[0](td.clone())["logits"]
    action = logits.masked_fill(~td["action_mask"], float("-inf")).argmax(-1)
    if held:
        action = logits.masked_fill(~td["action_mask"], float("inf")).argmin(-1)  # allowed, not the best allowed
        td = as_transition(td.set("action", action))
    references = {"observation": torch.randn(2, 4, dtype=torch.float64)}
    options = {"baselines": references} if name == "GradientShap" else {}
    got = make(name, actor, in_keys=["observation"], **options)(td.clone())["attribution", "observation"]
    expected = make(name, actor, in_keys=["observation"], target=action, **options)(td.clone())
    torch.testing.assert_close(got, expected["attribution", "observation"], rtol=0, atol=0)


@pytest.mark.parametrize("name", list(METHODS))
def test_default_keys_leave_out_flags_and_absent_recurrent_states(name):
    """As LRP: by default a call explains neither boolean inputs (an action mask, is_init) nor the recurrent states
    the TensorDict lacks (the methods refused such policies unless in_keys named the observation)."""
    from torchrl.modules import MaskedCategorical

    from tests.attribution.test_policy_targets import masked_actor, masked_td

    def attributions(module, td, *keys, **options):
        if name == "GradientShap":
            features, draws = 4 if "observation" in td.keys() else 3, torch.Generator().manual_seed(0)
            options["baselines"] = torch.randn(2, features, dtype=torch.float64, generator=draws)
        if name == "Occlusion":
            options["sliding_window_shapes"] = (2,)
        in_keys = {"in_keys": list(keys)} if keys else {}
        return make(name, module, **in_keys, **options)(td.clone())["attribution"]

    actor = masked_actor(MaskedCategorical)
    td = masked_td(actor)
    got = attributions(actor, td)
    assert list(got.keys()) == ["observation"]
    torch.testing.assert_close(got["observation"], attributions(actor, td, "observation")["observation"])
    policy, steps = recurrent_policy(), trajectories(1)[:, 0]  # step mode, no recurrent state yet
    got = attributions(policy, steps, target_key="q")
    assert list(got.keys()) == ["obs"]
    torch.testing.assert_close(got["obs"], attributions(policy, steps, "obs", target_key="q")["obs"])


class MaskedMean(nn.Module):
    """A layer over embeddings averaged where an integer attention mask (Hugging Face's int64) says."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 3).double()

    def forward(self, embeds: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        weights = mask.to(embeds.dtype).unsqueeze(-1)
        return self.layer((embeds * weights).sum(1) / weights.sum(1))


def test_an_integer_key_explained_by_default_is_named_with_the_keys_to_pass():
    """The mask was refused as "must be a floating-point tensor" though the caller never chose to explain it."""
    module = TensorDictModule(MaskedMean(), in_keys=["embeds", "mask"], out_keys=["y"])
    td = TensorDict(embeds=torch.randn(2, 5, 4, dtype=torch.float64), mask=torch.ones(2, 5, dtype=torch.long))
    td.batch_size = [2]
    with pytest.raises(
        TypeError,
        match=r"'mask' must be a floating-point .* it is explained by default .* "
        r"in_keys=\['embeds'\]",
    ):
        Saliency(module)(td.clone())
    with pytest.raises(TypeError, match=r"got torch.int64 \[2, 5\]$"):  # named by the caller: nothing to add
        Saliency(module, in_keys=["embeds", "mask"])(td.clone())
    assert Saliency(module, in_keys=["embeds"])(td.clone())["attribution", "embeds"].shape == (2, 5, 4)


def recurrent_policy() -> TensorDictSequential:
    from torchrl.modules import LSTMModule

    torch.manual_seed(0)
    lstm = LSTMModule(input_size=3, hidden_size=5, in_key="obs", out_key="h")
    return TensorDictSequential(lstm, TensorDictModule(nn.Linear(5, 2), in_keys=["h"], out_keys=["q"])).double()


def trajectories(steps: int) -> TensorDict:
    is_init = torch.zeros(2, steps, 1, dtype=torch.bool)
    is_init[:, 0] = True
    return TensorDict(obs=torch.randn(2, steps, 3, dtype=torch.float64), is_init=is_init, batch_size=[2, steps])


class TestRecurrentMode:
    @pytest.mark.parametrize("name", ["FeatureAblation", "Occlusion", "ShapleyValueSampling"])
    def test_perturbations_of_every_step_at_once_are_refused(self, name):
        """In recurrent mode a step's output depends on the steps before it; a perturbation of every step at once
        wrote only the step's own drop on its features (an ablation of the first step lost its effect on the
        later ones): refused, naming the module, before the model runs."""
        from torchrl.modules import set_recurrent_mode

        policy = recurrent_policy()
        td = trajectories(4)
        before = state_snapshot(policy)
        with set_recurrent_mode(True), pytest.raises(ValueError, match=f"^{name}: LSTMModule 'module.0' runs in "):
            make(name, policy, target_key="q", in_keys=["obs"])(td)
        assert_unchanged(policy, before)
        assert sorted(td.keys()) == ["is_init", "obs"]
        with set_recurrent_mode(True):  # one step: nothing read across steps
            one = make(name, policy, target_key="q", in_keys=["obs"])(trajectories(1))
        assert one["attribution", "obs"].shape == (2, 1, 3)

    @pytest.mark.parametrize("name", ["Saliency", "IntegratedGradients"])
    def test_gradient_methods_explain_the_sum_over_the_steps(self, name):
        """As LRP without split_dim: the gradient of every step's target output, summed over the steps."""
        from torchrl.modules import set_recurrent_mode

        policy, td = recurrent_policy(), trajectories(4)
        with set_recurrent_mode(True):
            x = td["obs"].clone().requires_grad_(True)
            out = policy(td.clone().set("obs", x))["q"]
            chosen = out.argmax(-1, keepdim=True)
            (gradient,) = torch.autograd.grad(out.gather(-1, chosen).sum(), x)
            options = {"n_steps": 50} if name == "IntegratedGradients" else {}
            attribution = make(name, policy, target_key="q", in_keys=["obs"], **options)(td.clone())
            if name == "IntegratedGradients":  # completeness per trajectory
                with torch.no_grad():
                    at_zero = policy(td.clone().set("obs", torch.zeros_like(x)))["q"].gather(-1, chosen)
                total = attribution["attribution", "obs"].sum((-1, -2))
                expected = (out.gather(-1, chosen) - at_zero).sum((-1, -2)).detach()
                torch.testing.assert_close(total, expected, rtol=1e-8, atol=1e-10)
            else:
                torch.testing.assert_close(attribution["attribution", "obs"], gradient.abs(), rtol=1e-12, atol=0)


class FirstLayerRows(TorchFunctionMode):
    """The rows of every pass through a linear layer, seen without a hook (a hook makes a model one whose stacked
    copies are compared with copies alone)."""

    def __init__(self, layer: torch.nn.Linear) -> None:
        super().__init__()
        self.weight, self.rows = layer.weight, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.linear and args[1] is self.weight:
            self.rows.append(args[0].shape[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["FeatureAblation", "Occlusion", "ShapleyValueSampling"])
class TestPerturbationsPerEval:
    def options(self, name):
        if name == "Occlusion":
            return {"sliding_window_shapes": (2,), "strides": 1}  # 4 windows on 5 features
        return {"feature_masks": torch.tensor([0, 0, 1, 2, 3])}  # 4 groups

    @pytest.mark.parametrize("per_eval", [3, 100])
    def test_same_result_fewer_forward_passes(self, name, per_eval):
        net = random_mlp(10)  # torch's layers alone, no hook: its stacked copies need no comparison
        td = TensorDict(x=torch.randn(2, 5, dtype=torch.float64), batch_size=[2])
        with FirstLayerRows(net[0]) as calls:
            one = make(name, net, in_keys=["x"], out_keys=["y"], **self.options(name))(td.clone())
        one_calls = calls.rows
        with FirstLayerRows(net[0]) as calls:
            many = make(
                name, net, in_keys=["x"], out_keys=["y"], perturbations_per_eval=per_eval, **self.options(name)
            )(td.clone())
        calls = calls.rows
        torch.testing.assert_close(many["attribution", "x"], one["attribution", "x"], rtol=1e-12, atol=1e-14)
        assert len(calls) < len(one_calls) and max(calls) <= 2 * per_eval
        assert sum(calls) == sum(one_calls)  # the same rows, in fewer passes

    def test_refused_at_construction(self, name):
        with pytest.raises(ValueError, match=f"{name}: perturbations_per_eval must be a positive int"):
            make(name, random_mlp(0), in_keys=["x"], out_keys=["y"], perturbations_per_eval=0, **self.options(name))


def test_inputs_the_module_fills_itself_are_not_explained_by_default():
    # As for LRP: a composite-distribution actor reads "params", which its own network writes.
    from tensordict.nn import CompositeDistribution
    from torch.distributions import Categorical, Normal
    from torchrl.modules import ProbabilisticActor

    from tdhook.attribution import Saliency

    class Heads(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 5)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            h = self.layer(x)
            return h[..., :3], h[..., 3:4], torch.nn.functional.softplus(h[..., 4:5]) + 0.1

    keys = [("params", "cat", "logits"), ("params", "normal", "loc"), ("params", "normal", "scale")]
    net = TensorDictModule(Heads().double(), in_keys=["observation"], out_keys=keys)
    actor = ProbabilisticActor(
        net,
        in_keys=["params"],
        distribution_class=CompositeDistribution,
        distribution_kwargs={"distribution_map": {"cat": Categorical, "normal": Normal}},
    )
    saliency = Saliency(actor, target_key=keys[0])
    assert saliency.explained_keys == ["observation"]
    td = TensorDict(observation=torch.randn(3, 4, dtype=torch.float64), batch_size=[3])
    expected = Saliency(net, target_key=keys[0])(td.clone())["attribution", "observation"]
    torch.testing.assert_close(saliency(td.clone())["attribution", "observation"], expected)


class _MaskedTwoKeyNet(nn.Module):
    """Action values from an observation and a goal, those of the actions a boolean mask forbids pushed down."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, obs: torch.Tensor, goal: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.body(torch.cat([obs, goal], -1)).masked_fill(~mask, -10.0)


_OPTIONS_BY_KEY = {
    "IntegratedGradients": {"baselines": {"obs": 0.5, "goal": -0.2}},
    "SmoothGrad": {"stdev": {"obs": 0.1, "goal": 0.3}},
    "GradientShap": {
        "baselines": {"obs": REFERENCES["obs"], "goal": REFERENCES["goal"]},
        "stdevs": {"obs": 0.1, "goal": 0.0},
    },
    "Occlusion": {"sliding_window_shapes": {"obs": (2,), "goal": (1,)}, "baselines": {"obs": 0.5, "goal": 0.0}},
    "FeatureAblation": {"feature_masks": {"obs": torch.tensor([0, 0, 1, 1]), "goal": torch.tensor([1, 2])}},
    "ShapleyValueSampling": {
        "feature_masks": {"obs": torch.tensor([0, 0, 1, 1]), "goal": None},
        "baselines": {"obs": 1.0, "goal": 0.0},
    },
}


@pytest.mark.parametrize("name", list(_OPTIONS_BY_KEY))
def test_options_by_key_name_the_keys_a_call_explains_by_default(name):
    """With default keys, a call leaves out the boolean mask: options given by key name the keys it explains (and
    may name the mask too); the methods whose options are lists by key asked for an entry for the mask, the others
    refused one."""
    torch.manual_seed(0)
    module = TensorDictModule(_MaskedTwoKeyNet().double(), in_keys=["obs", "goal", "mask"], out_keys=["q"])
    mask = torch.ones(4, 3, dtype=torch.bool)
    mask[:, 0] = False
    td = TensorDict(
        obs=torch.randn(4, 4, dtype=torch.float64),
        goal=torch.randn(4, 2, dtype=torch.float64),
        mask=mask,
        batch_size=[4],
    )
    options = _OPTIONS_BY_KEY[name]
    expected = make(name, module, in_keys=["obs", "goal"], **options)(td.clone())["attribution"]
    got = make(name, module, **options)(td.clone())["attribution"]
    assert set(got.keys()) == {"obs", "goal"}
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    with_mask = {option: {**value, "mask": next(iter(value.values()))} for option, value in options.items()}
    torch.testing.assert_close(make(name, module, **with_mask)(td.clone())["attribution"], expected, rtol=0, atol=0)
    incomplete = {option: {"obs": value["obs"]} for option, value in options.items()}
    with pytest.raises(KeyError, match="'goal'"):
        make(name, module, **incomplete)(td.clone())


class _DropsInItsForward(nn.Module):
    """Dropout called as a function in training mode, outside any Dropout module (attention dropout, mostly)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(nn.functional.dropout(x, 0.3, training=self.training))


def test_a_dropout_call_warning_made_an_error_is_given_at_every_call():
    """A caller's filter that makes the warning of a dropout call an error raises it at every call, not only the
    first: the warning is counted as given once it is out."""
    torch.manual_seed(0)
    method = Saliency(TensorDictModule(_DropsInItsForward().double().train(), ["x"], ["y"]))
    td = TensorDict(x=torch.randn(3, 4, dtype=torch.float64), batch_size=[3])
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(UserWarning, match=r"Saliency: the forward pass calls dropout \(p=0.3\)"):
                method(td.clone())
    with pytest.warns(UserWarning, match="calls dropout"):
        method(td.clone())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        method(td.clone())  # once given, not again


@pytest.mark.parametrize("name", ["LRP", "Saliency", "Occlusion"])
def test_a_relevance_key_that_is_not_one_key_name_is_refused_by_name(name):
    """The relevance keys are ``(relevance_key, *in_key)``: a nested prefix, or a number, was taken, and the first
    call failed in tensordict with a message about membership checks that named neither the option nor the method."""
    from tdhook.attribution import LRP

    method, options = {"LRP": (LRP, {}), **METHODS}[name]
    net = random_mlp(0)
    for bad in [("explanations", "lrp"), 3, ("a", 1)]:
        with pytest.raises(TypeError, match=rf"{name}: relevance_key must be one key name \(a str\)"):
            method(net, in_keys=["x"], out_keys=["y"], relevance_key=bad, **options)
    x = torch.randn(4, 5, dtype=torch.float64)
    one = method(net, in_keys=["x"], out_keys=["y"], relevance_key=("rel",), **options)(TensorDict(x=x, batch_size=[4]))
    plain = method(net, in_keys=["x"], out_keys=["y"], relevance_key="rel", **options)(TensorDict(x=x, batch_size=[4]))
    torch.testing.assert_close(one["rel", "x"], plain["rel", "x"], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["LRP", *METHODS])
def test_a_partial_tolerant_sequence_explains_the_modules_whose_inputs_are_given(name):
    """tensordict's ``TensorDictSequential(partial_tolerant=True)`` runs the modules whose inputs the TensorDict
    holds and skips the others. With default keys, a call on a TensorDict without a head's input was refused as
    missing that key: it now explains the heads that ran, as the sequence alone on its keys (and, for LRP-0, the
    closed form ``x * W[target]``); a target whose head was skipped is refused, naming the missing key."""
    from tdhook.attribution import LRP

    method, options = {"LRP": (LRP, {}), **METHODS}[name]
    torch.manual_seed(0)
    head = TensorDictModule(nn.Linear(5, 3).double(), in_keys=["x"], out_keys=["y"])
    other = TensorDictModule(nn.Linear(2, 1).double(), in_keys=["extra"], out_keys=["value"])
    sequence = TensorDictSequential(head, other, partial_tolerant=True)
    if name == "GradientShap":
        options = {**options, "baselines": {"x": REFERENCES["x"], "extra": REFERENCES["extra"]}}
    td = TensorDict(x=torch.randn(4, 5, dtype=torch.float64), batch_size=[4])
    key = "relevance" if name == "LRP" else "attribution"
    actual = method(sequence, target_key="y", **options)(td.clone())
    assert set(actual[key].keys()) == {"x"} and "value" not in actual.keys()
    alone_options = {**options, "baselines": {"x": REFERENCES["x"]}} if name == "GradientShap" else options
    expected = method(head, **alone_options)(td.clone())[key, "x"]
    torch.testing.assert_close(actual[key, "x"], expected, rtol=1e-12, atol=1e-12)
    if name in ("LRP", "InputXGradient"):
        units = head.module(td["x"]).argmax(-1)
        torch.testing.assert_close(actual[key, "x"], td["x"] * head.module.weight[units].detach())
    with pytest.raises(
        KeyError, match=r"target key 'value' was not written .*partial_tolerant=True.* lacks \['extra'\]"
    ):
        method(sequence, target_key="value", **options)(td.clone())


@pytest.mark.parametrize("kind", ["tanh_delta", "online"])
def test_a_decision_transformer_is_explained_under_the_callers_no_grad(kind):
    """The explained output of a decision transformer is its actor's output at the last context step, a slice taken
    after the model's pass. Under the caller's ``torch.no_grad()`` (a collector's mode) that slice had no graph, and
    Saliency and InputXGradient refused every context key as one the target does not depend on. Plain autograd of
    the last step's largest unit gives the gradient."""
    from tests.attribution.test_policy_targets import (
        CONTEXT_KEYS,
        DEFAULT_KEY,
        context,
        decision_transformer,
        last_step_by_hand,
    )

    _, wrapper = decision_transformer(kind)
    td = context("[B]")
    expected, _ = last_step_by_hand(wrapper, td, DEFAULT_KEY[kind])
    with torch.no_grad():
        products = InputXGradient(wrapper)(td.clone())
        magnitudes = Saliency(wrapper)(td.clone())
    for key in CONTEXT_KEYS:
        torch.testing.assert_close(products["attribution", key], expected[key], rtol=1e-10, atol=1e-12)
        magnitude = magnitudes["attribution", key] * td[key].abs()
        torch.testing.assert_close(magnitude, expected[key].abs(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["plain", "tanh_delta", "online"])
def test_a_decision_transformer_on_a_context_takes_a_unit_index_as_target(kind):
    """On a ``[B, T]`` context the wrapper returns one action per context (``[B]``): the target's index was read
    against the caller's two batch dimensions, which left the action none for its units, and every method refused
    ``target=1`` as indexing "an output with no unit dimension" (LRP took it). Plain autograd of unit 1 of the
    step the wrapper acts on gives the gradient."""
    from tests.attribution.test_policy_targets import CONTEXT_KEYS, DEFAULT_KEY, context, decision_transformer

    _, wrapper = decision_transformer(kind)
    td = context("[B, T]")
    key = DEFAULT_KEY[kind]
    leaves = {k: td[k].detach().clone().requires_grad_(True) for k in CONTEXT_KEYS}
    with set_exploration_type(ExplorationType.DETERMINISTIC):
        output = wrapper(td.clone().update(leaves))[key]
        output = output if key == "action" else output[..., -1, :]  # the wrapper cuts its action to the last step
        output[..., 1].sum().backward()
        products = InputXGradient(wrapper, target=1)(td.clone())
    assert products.batch_size == torch.Size([3])
    for name in CONTEXT_KEYS:
        expected = leaves[name].detach() * leaves[name].grad
        torch.testing.assert_close(products["attribution", name], expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("method", ["Saliency", "IntegratedGradients", "FeatureAblation"])
def test_a_mean_over_the_batch_that_needs_a_batch_is_refused_naming_why_and_what_explains_each_sample(method):
    """A loss's mean over the batch is one output: the methods explain it as one sample, running the module again
    on the inputs as one sample (batch size []). torchrl's PPO loss without a given advantage computes it with its
    value estimator, which needs a batch, and raised from deep inside torchrl; the error now says why the module ran
    so, and what explains each sample."""
    import tdhook.attribution as attribution
    from tests.attribution._losses import ppo_loss_and_batch

    loss, td = ppo_loss_and_batch(5)
    loss.reduction = "mean"
    del td["advantage"]
    wrapper = getattr(attribution, method)(loss, in_keys=["observation"], target_key="loss_objective")
    given = td.clone()
    with pytest.raises(RuntimeError, match=rf"^{method}: the module returned one output for the whole batch \[5\]"):
        wrapper(given)
    assert set(given.keys(True, True)) == set(td.keys(True, True))  # nothing written


@pytest.mark.parametrize("method", ["IntegratedGradients", "SmoothGrad", "GradientShap"])
def test_a_forward_hooking_a_tensor_is_told_the_first_pass_runs_without_gradient(method):
    """A model putting a hook on a tensor in its forward (to keep a gradient) failed in the methods whose first pass
    runs without gradient with torch's "cannot register a hook on a tensor that doesn't require gradient", the note
    naming the inputs only; a note now says why, and what to write instead."""
    net = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    kept = []
    net[0].register_forward_hook(lambda module, args, out: [kept.append(out.register_hook(lambda g: None))] and None)
    options = {"GradientShap": {"baselines": torch.zeros(2, 6)}}.get(method, {})
    wrapper = getattr(tdhook.attribution, method)(net, in_keys=["x"], out_keys=["y"], **options)
    with pytest.raises(RuntimeError, match="doesn't require gradient") as caught:
        wrapper(TensorDict(x=torch.randn(4, 6), batch_size=[4]))
    assert any(
        "first pass on the caller's inputs" in note and "h.requires_grad" in note for note in caught.value.__notes__
    )


@pytest.mark.parametrize(
    "method", ["Saliency", "InputXGradient", "GuidedBackprop", "IntegratedGradients", "SmoothGrad", "GradientShap"]
)
@pytest.mark.parametrize("in_place", [False, True], ids=["returned", "in place"])
def test_a_backward_hook_that_changes_the_gradient_is_refused_by_name(method, in_place):
    """A hook tripling the gradient at a hidden layer tripled every gradient method's attribution (IntegratedGradients'
    sum three times F(x) - F(0)), with no word, where LRP refuses it by name. Refused likewise; a hook that only reads
    the gradient runs, and the attribution is the model's without it."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    options = {"GradientShap": {"baselines": torch.zeros(2, 6, dtype=torch.float64), "seed": 0}}.get(method, {})
    options |= {"SmoothGrad": {"seed": 0}}.get(method, {})
    make = getattr(tdhook.attribution, method)
    x = torch.randn(4, 6, dtype=torch.float64)
    expected = make(net, in_keys=["x"], out_keys=["y"], **options)(TensorDict(x=x, batch_size=[4]))["attribution", "x"]

    def triple(module, grad_in, grad_out):
        if in_place:
            grad_in[0].mul_(3.0)
            return None
        return (grad_in[0] * 3.0,)

    handle = net[2].register_full_backward_hook(triple)
    try:
        with pytest.raises(ValueError, match=rf"{method}: the full backward hook .*triple registered on module '2'"):
            make(net, in_keys=["x"], out_keys=["y"], **options)(TensorDict(x=x, batch_size=[4]))
    finally:
        handle.remove()
    seen = []
    handle = net[2].register_full_backward_hook(lambda module, grad_in, grad_out: seen.append(1))
    try:
        got = make(net, in_keys=["x"], out_keys=["y"], **options)(TensorDict(x=x, batch_size=[4]))["attribution", "x"]
    finally:
        handle.remove()
    assert seen
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
