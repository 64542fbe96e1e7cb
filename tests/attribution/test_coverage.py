"""The coverage report and strict mode: nonlinear calls without a rule are found from what the forward runs."""

from __future__ import annotations

import warnings

import pytest
import torch
import torchvision
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import (
    CPLRP,
    LRP,
    AttnLRP,
    BaseRuleMapper,
    EpsilonGammaBox,
    EpsilonPlus,
    EpsilonPlusFlat,
    PassRule,
)
from tdhook.attribution._nonlinear_calls import function_kind
from tests.conftest import relative_error

F64 = torch.float64


class SineBlock(nn.Module):
    """A container whose own forward computes ``torch.sin`` between two children."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.outer = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(torch.sin(self.inner(x)))


class Bilinear(nn.Module):
    """The product of two activations: not piecewise linear, and no CNN rule covers it."""

    def __init__(self) -> None:
        super().__init__()
        self.left, self.right, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.left(x) * self.right(x))


class LinearOnly(nn.Module):
    """Scales, pads, permutes, drops paths and reshapes: nothing to explain beyond the plain gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.gamma = nn.Parameter(torch.rand(6) + 0.5)
        self.empty = nn.Sequential()
        self.pad = nn.ConstantPad1d((1, 1), 0.0)
        self.depth = torchvision.ops.StochasticDepth(0.2, "row")
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.empty(self.fc(x)) * self.gamma.reshape(1, -1) / 2.0
        h = self.depth(torch.relu(h)).unsqueeze(1).permute(0, 2, 1).flatten(1)
        return self.head(self.pad(h))


class Mixing(nn.Module):
    """A module of one weight slot, with no rule of its own: its forward calls ``linear`` on that weight."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)


class HyperNetwork(nn.Module):
    """A hypernetwork: the mixing weight is computed from the input ``z`` and put in the slot by functional_call."""

    def __init__(self) -> None:
        super().__init__()
        self.generate, self.mixing = nn.Linear(3, 8), Mixing()

    def forward(self, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        weight = self.generate(z).view(2, 4)
        return torch.func.functional_call(self.mixing, {"weight": weight}, (x,))


def call(model: nn.Module, mapper, batch: int = 3) -> tuple[LRP, TensorDict, list[str]]:
    lrp = LRP(model.double().eval(), mapper, in_keys=["x"], out_keys=["y"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        td = lrp(TensorDict(x=torch.randn(batch, 4, dtype=F64), batch_size=[batch]))
    return lrp, td, [str(w.message) for w in caught if "no rule covers it" in str(w.message)]


class TestStrictMode:
    def test_a_container_computing_sin_is_refused_by_name(self):
        model = nn.Sequential(SineBlock())
        before = {k: v.clone() for k, v in model.state_dict().items()}
        lrp = LRP(model.double(), EpsilonPlus(strict=True), in_keys=["x"], out_keys=["y"])
        td = TensorDict(x=torch.randn(3, 4, dtype=F64), batch_size=[3])
        with pytest.raises(ValueError, match=r"module '0' \(SineBlock\) computes sin"):
            lrp(td)
        assert set(td.keys()) == {"x"}  # nothing written
        assert all(torch.equal(v, before[k].double()) for k, v in model.state_dict().items())
        assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())

    def test_modules_that_only_scale_pad_or_reshape_need_no_rule(self):
        _, td, messages = call(LinearOnly(), EpsilonPlus(strict=True))
        assert messages == []
        assert torch.isfinite(td["relevance", "x"]).all()

    @pytest.mark.parametrize("dims", [1, 2, 3])
    def test_max_unpooling_needs_no_rule(self, dims: int):
        """SegNet's decoder puts each pooled value back where its window's maximum was: linear in the values, its
        plain gradient is LRP-0."""

        class PoolUnpool(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.shape, features = (1, *[4] * dims), 4**dims
                self.first, self.head = nn.Linear(4, features), nn.Linear(features, 2)
                self.pool = getattr(nn, f"MaxPool{dims}d")(2, return_indices=True)
                self.unpool = getattr(nn, f"MaxUnpool{dims}d")(2)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                pooled, indices = self.pool(self.first(x).relu().reshape(len(x), *self.shape))
                return self.head(self.unpool(pooled, indices).flatten(1))

        _, td, messages = call(PoolUnpool(), EpsilonPlus(strict=True))
        assert messages == [] and torch.isfinite(td["relevance", "x"]).all()

    def test_mapping_the_module_satisfies_strict_mode(self):
        class Sine(nn.Module):
            # Not element-wise (an element-wise module without parameters gets the pass rule by itself).
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return torch.sin(x.flip(-1))

        model = nn.Sequential(nn.Linear(4, 4), Sine(), nn.Linear(4, 2))
        with pytest.raises(ValueError, match=r"module '1' \(Sine\) computes sin"):
            call(model, EpsilonPlus(strict=True))
        _, td, messages = call(model, EpsilonPlus(strict=True, rule_mapper={Sine: PassRule()}))
        assert messages == [] and torch.isfinite(td["relevance", "x"]).all()

    def test_a_product_of_two_activations_is_named_under_a_cnn_preset_and_covered_by_attnlrp(self):
        _, _, messages = call(Bilinear(), EpsilonPlus())
        assert len(messages) == 1 and "the model itself (Bilinear) computes mul" in messages[0]
        for preset in (AttnLRP, CPLRP):
            _, _, messages = call(Bilinear(), preset())
            assert messages == []

    @pytest.mark.parametrize("grid_from_the_input", [False, True], ids=["constant grid", "grid from the input"])
    def test_grid_sample_is_named_where_its_grid_is_computed_from_the_input(self, grid_from_the_input: bool):
        class Warp(nn.Module):
            """Samples its features at positions computed from them, or at fixed positions."""

            def __init__(self) -> None:
                super().__init__()
                self.features, self.offsets, self.head = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(8, 2)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                features = self.features(x).view(-1, 2, 2, 2)
                grid = torch.tanh(self.offsets(x)) if grid_from_the_input else torch.linspace(-0.9, 0.9, 8, dtype=F64)
                grid = grid.expand(x.shape[0], 8).reshape(-1, 2, 2, 2)
                return self.head(torch.nn.functional.grid_sample(features, grid, align_corners=False).flatten(1))

        _, _, messages = call(Warp(), EpsilonPlus())
        named = [m for m in messages if "grid_sample" in m]
        assert len(named) == (1 if grid_from_the_input else 0), messages

    def test_calls_after_the_target_are_not_reported(self):
        class Probabilities(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.fc = nn.Linear(4, 3)

            def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                logits = self.fc(x)
                return logits, torch.softmax(logits, -1)  # computed from the target, not before it

        explained = LRP(
            Probabilities().double(),
            EpsilonPlus(strict=True),
            in_keys=["x"],
            out_keys=["logits", "p"],
            target_key="logits",
        )
        td = explained(TensorDict(x=torch.randn(2, 4, dtype=F64), batch_size=[2]))
        assert td["relevance", "x"].shape == (2, 4)
        with pytest.raises(ValueError, match="computes softmax"):
            LRP(
                Probabilities().double(),
                EpsilonPlus(strict=True),
                in_keys=["x"],
                out_keys=["logits", "p"],
                target_key="p",
            )(TensorDict(x=torch.randn(2, 4, dtype=F64), batch_size=[2]))

    def test_a_weight_computed_from_an_input_is_an_activation_in_its_slot(self):
        """A tensor in a parameter slot counts as a parameter only where it comes from parameters alone (a view
        of stacked parameters, as torchrl's loss modules put there): a hypernetwork's weight depends on ``z``, and
        ``linear(x, weight(z))`` is a product of two activations."""
        lrp = LRP(HyperNetwork().double(), EpsilonPlus(strict=True), in_keys=["z", "x"], out_keys=["y"])
        td = TensorDict(z=torch.randn(3, dtype=F64), x=torch.randn(4, dtype=F64), batch_size=[])
        with pytest.raises(ValueError, match=r"module 'mixing' \(Mixing\) computes linear"):
            lrp(td)

    def test_transformer_presets_cover_an_encoder(self):
        encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), 2)
        model = nn.Sequential(encoder, nn.Flatten(), nn.Linear(40, 2)).double().eval()
        for preset in (AttnLRP, CPLRP):
            lrp = LRP(model, preset(strict=True), in_keys=["x"], out_keys=["y"])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # out_proj's rule has no effect: named elsewhere
                lrp(TensorDict(x=torch.randn(2, 5, 8, dtype=F64), batch_size=[2]))
            assert lrp.coverage().plain_gradient == ()


class _CubeOfSum(torch.autograd.Function):
    """``x · Σx`` along the last dimension, with its exact backward: an autograd ``Function`` the mode cannot see
    into (its forward runs without gradients)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x.sum(-1, keepdim=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * x.sum(-1, keepdim=True) + (grad * x).sum(-1, keepdim=True)


class CubeOfSum(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _CubeOfSum.apply(x)


class FunctionInItsForward(nn.Module):
    """Applies the Function in its own forward, between two layers of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(_CubeOfSum.apply(self.first(x)))


class TestAutogradFunctions:
    """A custom ``torch.autograd.Function`` runs its own backward: the watch names it, as it does a nonlinear call."""

    def test_a_module_applying_one_is_named(self):
        model = nn.Sequential(nn.Linear(4, 4), CubeOfSum(), nn.Linear(4, 2))
        _, _, messages = call(model, EpsilonPlus())
        assert (
            len(messages) == 1
            and "module '1' (CubeOfSum) computes _CubeOfSum (an autograd.Function with its own backward)" in messages[0]
        )
        with pytest.raises(ValueError, match=r"module '1' \(CubeOfSum\) computes _CubeOfSum"):
            call(model, EpsilonPlus(strict=True))

    def test_the_model_applying_one_in_its_own_forward_is_named(self):
        with pytest.raises(ValueError, match=r"the model itself \(FunctionInItsForward\) computes _CubeOfSum"):
            call(FunctionInItsForward(), EpsilonPlus(strict=True))

    def test_one_applied_in_a_forward_hook_on_a_layer_with_a_rule_is_named(self):
        """A Function applied to a layer's output by the caller's forward hook on that layer (a gradient reversal, as
        in domain-adversarial training) runs after the layer's rule: its backward enters the relevance as it is, and
        the layer's rule covers none of it. It was taken for part of the layer's ruled call and named nowhere."""
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        model[0].register_forward_hook(lambda module, args, output: _CubeOfSum.apply(output))
        _, _, messages = call(model, EpsilonPlus())
        assert len(messages) == 1 and "module '0' (Linear) computes _CubeOfSum" in messages[0]
        with pytest.raises(ValueError, match=r"module '0' \(Linear\) computes _CubeOfSum"):
            call(model, EpsilonPlus(strict=True))

    def test_a_rule_on_the_module_covers_it(self):
        model = nn.Sequential(nn.Linear(4, 4), CubeOfSum(), nn.Linear(4, 2))
        _, td, messages = call(model, EpsilonPlus(strict=True, rule_mapper={CubeOfSum: PassRule()}))
        assert messages == [] and torch.isfinite(td["relevance", "x"]).all()

    def test_the_rules_own_functions_are_not_named(self):
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        for mapper in (EpsilonPlus(strict=True), EpsilonPlusFlat(strict=True), AttnLRP(strict=True)):
            _, _, messages = call(model, mapper)
            assert messages == []

    def test_the_users_full_backward_hooks_are_not_named(self):
        # register_full_backward_hook and _pre_hook wrap the module's inputs and outputs in an identity Function
        # whose backward runs the hooks: no call of the model's, so strict mode runs, with the hooks' relevance.
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        torch.manual_seed(0)  # the input call() draws
        _, expected, _ = call(model, EpsilonPlus(strict=True))
        ran = []
        model[0].register_full_backward_hook(lambda module, grad_in, grad_out: ran.append("hook"))
        model[2].register_full_backward_pre_hook(lambda module, grad_out: ran.append("pre-hook"))
        torch.manual_seed(0)
        lrp, td, messages = call(model, EpsilonPlus(strict=True))
        assert messages == [] and lrp.coverage().plain_gradient == ()
        assert sorted(ran) == ["hook", "pre-hook"]
        torch.testing.assert_close(td["relevance", "x"], expected["relevance", "x"], rtol=0, atol=0)


class VmappedSine(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.vmap(torch.sin)(self.fc(x))


def test_a_call_under_vmap_is_named_as_the_same_call_outside():
    # Under torch.vmap tensors report no gradient: the watch looks at the tensors the graph holds, and names the
    # sine as it does outside vmap (it went unreported, with its plain gradient).
    _, _, messages = call(nn.Sequential(VmappedSine(), nn.Linear(4, 2)), EpsilonPlus())
    assert len(messages) == 1 and "module '0' (VmappedSine) computes sin" in messages[0]


class Cube(torch.autograd.Function):
    """A custom autograd Function: its forward runs without gradient, its backward is its own."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * 3 * x**2


class CubeBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Cube.apply(self.layer(x)).flip(-1)


class TestCustomAutogradFunctions:
    def test_a_custom_function_keeps_its_own_backward_and_is_reported_by_its_module(self):
        lrp, _, messages = call(nn.Sequential(CubeBlock(), nn.Linear(4, 2)), EpsilonPlus())
        found = {(c.module, c.module_type, c.function, c.calls) for c in lrp.coverage().plain_gradient}
        # CubeBlock's first node is its Linear's: the innermost call that holds the Function's node is CubeBlock's
        assert found == {("0", "CubeBlock", "Cube (an autograd.Function with its own backward)", 1)}
        with pytest.raises(ValueError, match=r"module '0' \(CubeBlock\) computes Cube"):
            call(nn.Sequential(CubeBlock(), nn.Linear(4, 2)), EpsilonPlus(strict=True))

    def test_a_tanh_normal_actors_deterministic_action_is_covered_and_its_log_probability_reported(self):
        """torchrl's TanhNormal computes its action's tanh in a custom Function (``safetanh``), which gets the pass
        rule (SafeTanhCallsRule): explaining the action reports nothing. Its log-probability keeps the plain
        gradient of its softplus and logarithm, which the report says."""
        from tensordict.nn import NormalParamExtractor, TensorDictModule
        from torchrl.envs.utils import ExplorationType, set_exploration_type
        from torchrl.modules import ProbabilisticActor, TanhNormal

        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(3, 2), NormalParamExtractor()).double()
        actor = ProbabilisticActor(
            TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"]),
            in_keys=["loc", "scale"],
            distribution_class=TanhNormal,
            return_log_prob=True,
        )
        td = TensorDict(observation=torch.randn(4, 3, dtype=F64), batch_size=[4])
        with set_exploration_type(ExplorationType.DETERMINISTIC):
            lrp = LRP(actor, EpsilonPlus(), target_key="action")
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                lrp(td.clone())
            assert lrp.coverage().plain_gradient == ()
            by_log_prob = LRP(actor, EpsilonPlus(), target_key="action_log_prob")
            with pytest.warns(UserWarning, match=r"module 'module.1' \(SafeProbabilisticModule\) computes .*softplus"):
                by_log_prob(td.clone())
            assert by_log_prob.coverage().plain_gradient != ()
            by_loc = LRP(actor, EpsilonPlus())
            by_loc(td.clone())
            assert by_loc.coverage().plain_gradient == ()  # the tanh comes after the explained loc


class TestCoverage:
    def test_lists_the_plain_gradient_calls_by_module(self):
        lrp, _, _ = call(nn.Sequential(SineBlock(), nn.ReLU(), Bilinear()), EpsilonPlus())
        found = {(c.module, c.module_type, c.function, c.calls) for c in lrp.coverage().plain_gradient}
        assert found == {("0", "SineBlock", "sin", 1), ("2", "Bilinear", "mul", 1)}
        assert "'0' (SineBlock): sin x1" in str(lrp.coverage())

    def test_a_report_before_any_call_vouches_for_nothing(self):
        """Asked before the first call, the report said "every call that is not piecewise linear has a rule" of a
        model whose sine no call had watched yet."""
        lrp = LRP(nn.Sequential(SineBlock(), nn.ReLU()), EpsilonPlus(), in_keys=["x"], out_keys=["y"])
        report = lrp.coverage()
        assert report.plain_gradient == () and report.reached is None
        assert "has a rule" not in str(report) and "no call yet" in str(report)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the call warns of the sine
            lrp(TensorDict(x=torch.randn(2, 4), batch_size=[2]))
        assert "'0' (SineBlock): sin x1" in str(lrp.coverage())

    def test_reached_is_one_where_relevance_is_conserved_and_below_where_biases_absorb(self):
        net = nn.Sequential(nn.Linear(4, 8, bias=False), nn.ReLU(), nn.Linear(8, 3, bias=False))
        lrp, td, _ = call(net, BaseRuleMapper(), batch=5)  # LRP-0 conserves without biases
        torch.testing.assert_close(lrp.coverage().reached, torch.ones(5, dtype=F64))
        assert "mean 1" in str(lrp.coverage())
        # With biases, the share is what the relevance really sums to: the report tells the two apart.
        with_bias = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        lrp, td, _ = call(with_bias, EpsilonGammaBox(low=-5.0, high=5.0), batch=5)
        logit = td["y"].double().max(-1).values
        torch.testing.assert_close(lrp.coverage().reached, td["relevance", "x"].sum(-1) / logit)

    def test_per_unit_and_named_targets(self):
        net = nn.Sequential(nn.Linear(4, 3, bias=False)).double()
        all_units = LRP(net, BaseRuleMapper(), in_keys=["x"], out_keys=["y"], target="all")
        all_units(TensorDict(x=torch.randn(2, 4, dtype=F64), batch_size=[2]))
        torch.testing.assert_close(all_units.coverage().reached, torch.ones(2, 3, dtype=F64))
        before = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
        assert before.coverage().reached is None

    def test_every_call_of_a_wrapper_is_watched_once(self):
        lrp = LRP(nn.Sequential(SineBlock()).double(), EpsilonPlus(), in_keys=["x"], out_keys=["y"])
        td = TensorDict(x=torch.randn(2, 4, dtype=F64), batch_size=[2])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                lrp(td.clone())
        assert sum("no rule covers it" in str(w.message) for w in caught) == 1
        assert len(lrp.coverage().plain_gradient) == 1


@pytest.mark.parametrize(
    ("func", "expected"),
    [
        (torch.Tensor.__iadd__, ("add", "linear")),
        (torch.Tensor.__rmul__, ("mul", "product")),
        (torch.Tensor.__rtruediv__, ("truediv", "reflected division")),
        (torch.nn.functional.relu, ("relu", "linear")),
        (torch.nn.functional.gelu, ("gelu", "nonlinear")),
        (torch.nn.functional.hardshrink, ("hardshrink", "linear")),  # x where |x| > λ, else 0
        (torch.Tensor.hardshrink, ("hardshrink", "linear")),
        (torch.exp, ("exp", "nonlinear")),
        (torch.Tensor.T.__get__, ("T", "linear")),
        (torch.Tensor.add_, ("add", "linear")),
        (torch._grouped_mm, ("grouped_mm", "product")),  # mixture-of-experts kernels: linear in the activation
        (torch.view_as_complex, ("view_as_complex", "linear")),  # rotary embeddings as complex products
        (torch.view_as_real, ("view_as_real", "linear")),
        # linear in the sampled input, not in the grid: decided by which argument is an activation
        (torch.nn.functional.grid_sample, ("grid_sample", "by arguments")),
    ],
)
def test_function_kinds(func, expected):
    assert function_kind(func) == expected


class Shrunk(nn.Module):
    """A Linear layer, a function of its output in the module's own forward, then a head."""

    def __init__(self, function) -> None:
        super().__init__()
        self.inner, self.head, self.function = nn.Linear(4, 6, bias=False), nn.Linear(6, 3, bias=False), function

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.function(self.inner(x)))


HARD_SHRINKS = {
    "F.hardshrink": lambda h: torch.nn.functional.hardshrink(h, 0.3),
    "Tensor.hardshrink": lambda h: h.hardshrink(0.3),
    "nn.Hardshrink": nn.Hardshrink(0.3),  # a module: PassRule, whose y / x is the gradient (1 or 0)
}


_FILTER = torch.randn(4, dtype=torch.complex128, generator=torch.Generator().manual_seed(1))
PIECEWISE_LINEAR_CALLS = HARD_SHRINKS | {
    "F.softshrink": lambda h: torch.nn.functional.softshrink(h, 0.3),  # x ∓ λ where |x| > λ, else 0
    "irfft(rfft(h) * w)": lambda h: torch.fft.irfft(torch.fft.rfft(h) * _FILTER, n=6),  # a global filter
    "fft(h).real": lambda h: torch.fft.fft(h.to(torch.complex128)).real,
    "irfft(rfft(h).conj() * w)": lambda h: torch.fft.irfft(torch.fft.rfft(h).conj() * _FILTER, n=6),
    "fft(h).conj().imag": lambda h: torch.fft.fft(h.to(torch.complex128)).conj().imag,
}


@pytest.mark.parametrize("name", sorted(PIECEWISE_LINEAR_CALLS))
def test_shrinks_and_fourier_transforms_are_piecewise_linear(name: str):
    """hardshrink (x where |x| > λ, else 0) and softshrink were warned of as not piecewise linear under LRP-0, and
    torch.fft's transforms as nonlinear, though their plain gradient is exact LRP-0: no warning, nothing in
    coverage(), and the relevance is gradient × input."""
    torch.manual_seed(0)
    model, x = Shrunk(PIECEWISE_LINEAR_CALLS[name]).double(), torch.randn(5, 4, dtype=F64)
    lrp = LRP(model, BaseRuleMapper(strict=True), in_keys=["x"], out_keys=["y"], target=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        relevance = lrp(TensorDict(x=x, batch_size=[5]))["relevance", "x"]
    assert lrp.coverage().plain_gradient == ()
    x = x.clone().requires_grad_(True)
    expected = x * torch.autograd.grad(model(x)[:, 0].sum(), x)[0]
    torch.testing.assert_close(relevance, expected.detach(), rtol=1e-12, atol=1e-12)


class AutoCorrelation(nn.Module):
    """Autoformer's attention, in short: the correlation of queries and keys at every lag, a softmax over the lags
    (their mean over channels), and the values rolled by each lag weighed by it. ``fourier`` computes the
    correlation as Autoformer does, ``irfft(rfft(q) · conj(rfft(k)))``; otherwise as a sum of products of the
    queries and the rolled keys (the oracle: real products, whose rules are tested elsewhere)."""

    def __init__(self, fourier: bool) -> None:
        super().__init__()
        self.fourier = fourier
        self.q, self.k, self.v, self.head = (nn.Linear(4, 4, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        length = x.shape[1]
        if self.fourier:
            products = torch.fft.rfft(q, dim=1) * torch.conj(torch.fft.rfft(k, dim=1))
            correlation = torch.fft.irfft(products, n=length, dim=1)
        else:
            correlation = torch.stack([(q * torch.roll(k, lag, 1)).sum(1) for lag in range(length)], 1)
        weights = torch.softmax(correlation.mean(-1), dim=1)
        rolled = torch.stack([torch.roll(v, -lag, 1) for lag in range(length)], 1)
        return self.head((weights[:, :, None, None] * rolled).sum(1)).flatten(1)


@pytest.mark.parametrize("preset", [AttnLRP, CPLRP])
def test_an_autocorrelation_by_fourier_transforms_is_the_one_by_products(preset):
    """Autoformer's autocorrelation multiplies the queries' transform by the conjugate of the keys': ``conj`` was
    warned of as nonlinear (an error under strict), though it is linear over the reals. The complex product takes
    the rule of a product of two activations, as the real products of the same correlation do."""
    torch.manual_seed(0)
    fourier, products = AutoCorrelation(True).double(), AutoCorrelation(False).double()
    products.load_state_dict(fourier.state_dict())
    x = 3 * torch.randn(2, 6, 4, dtype=F64)
    torch.testing.assert_close(fourier(x), products(x), rtol=1e-12, atol=1e-12)
    relevance = {}
    for name, model in (("fourier", fourier), ("products", products)):
        lrp = LRP(model, preset(strict=True), in_keys=["x"], out_keys=["y"])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            relevance[name] = lrp(TensorDict(x=x, batch_size=[2]))["relevance", "x"]
    assert relative_error(relevance["fourier"], relevance["products"]) <= 1e-10
    x = x.clone().requires_grad_(True)
    y = fourier(x)
    plain = x * torch.autograd.grad(y.gather(1, y.argmax(1, keepdim=True)).sum(), x)[0]
    assert relative_error(relevance["fourier"], plain.detach()) > 0.01  # the rules matter here


def test_the_magnitude_of_a_fourier_transform_is_named():
    """``rfft(h).abs()`` (a spectrum's magnitude) is not piecewise linear, though ``abs`` of a real tensor is."""
    torch.manual_seed(0)
    model = Shrunk(lambda h: torch.fft.rfft(h).abs().repeat(1, 2)[:, :6]).double()
    lrp = LRP(model, BaseRuleMapper(), in_keys=["x"], out_keys=["y"], target=0)
    with pytest.warns(UserWarning, match=r"computes abs \(of a complex tensor\) in its own forward"):
        lrp(TensorDict(x=torch.randn(5, 4, dtype=F64), batch_size=[5]))
    assert [c.function for c in lrp.coverage().plain_gradient] == ["abs (of a complex tensor)"]


class Rounded(nn.Module):
    """A Linear layer whose output is added to a piecewise constant function of itself (``h + f(h)``), then a head:
    the function's branch passes no relevance back."""

    def __init__(self, function) -> None:
        super().__init__()
        self.inner, self.head, self.function = nn.Linear(4, 6, bias=False), nn.Linear(6, 3, bias=False), function

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inner(x)
        return self.head(h + self.function(h))


PIECEWISE_CONSTANT = {
    "round": torch.round,
    "floor": torch.floor,
    "ceil": torch.ceil,
    "trunc": torch.trunc,
    "sign": torch.sign,
    "Tensor.round": lambda h: h.round(),
}


class TestPiecewiseConstantCalls:
    @pytest.mark.parametrize("preset", [EpsilonPlus, AttnLRP, CPLRP], ids=lambda p: p.__name__)
    @pytest.mark.parametrize("name", sorted(PIECEWISE_CONSTANT))
    def test_a_call_whose_gradient_is_zero_is_named(self, name: str, preset):
        """round, floor, sign and the like were classed piecewise linear: their zero gradient dropped the relevance
        of their branch with no word (``h + round(h)`` then a head: the input relevance 0.38 of the logit under
        EpsilonPlus and AttnLRP, ``h + sign(h)`` 780 times it). The first call warns, naming the module and the
        function; coverage() lists the call, and a strict mapper refuses it."""
        function = name.split(".")[-1]
        torch.manual_seed(0)
        model, x = Rounded(PIECEWISE_CONSTANT[name]).double(), torch.randn(5, 4, dtype=F64) * 3
        lrp = LRP(model, preset(), in_keys=["x"], out_keys=["y"])
        with pytest.warns(UserWarning, match=rf"the model itself \(Rounded\) computes {function} .* constant"):
            lrp(TensorDict(x=x, batch_size=[5]))
        assert [(c.module, c.function) for c in lrp.coverage().plain_gradient] == [("", function)]
        if preset is EpsilonPlus:
            with pytest.raises(ValueError, match=rf"computes {function} .* its gradient is zero"):
                LRP(model, EpsilonPlus(strict=True), in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[5]))

    def test_a_detached_rounding_is_named_a_straight_through_estimator(self):
        """A straight-through estimator, ``h + (round(h) - h).detach()``: the explained output does not depend on the
        rounding's gradient, so the rounding is not named; the estimator is, since the head reads round(h) but the
        relevance passes through h (see tests/attribution/test_straight_through.py)."""
        torch.manual_seed(0)
        model = Rounded(lambda h: (h.round() - h).detach()).double()
        with pytest.warns(UserWarning, match=r"\(Rounded\) adds a detached difference") as caught:
            LRP(model, EpsilonPlus(), in_keys=["x"], out_keys=["y"])(
                TensorDict(x=torch.randn(5, 4, dtype=F64), batch_size=[5])
            )
        assert not any("computes round" in str(w.message) for w in caught)


class Hamiltonian(nn.Module):
    """A step along the gradient of a learned energy (a Hamiltonian network's vector field), then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.energy = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            (field,) = torch.autograd.grad(self.energy(x).sum(), x, create_graph=True)
        return self.head(x + 0.5 * field)


class SquaredNorm(nn.Module):
    """The gradient of ``|h|^2`` (``2 h``) taken in the forward, through no module with a rule."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        (twice,) = torch.autograd.grad((h * h).sum(), h, create_graph=True)
        return self.b(twice)


class TestGradientsTakenInTheForward:
    @pytest.mark.parametrize("mapper", [EpsilonPlus, BaseRuleMapper, AttnLRP], ids=lambda m: m.__name__)
    def test_a_gradient_through_the_rules_is_refused_by_name(self, mapper):
        """The model's own torch.autograd.grad ran through the rules' backward: the output written was not the
        model's (0.022 off, absolute, under each preset: LRP-0 passes its Tanh's gradient as 1) and its relevance
        0.022 off gradient × input (relative L2), under a warning that said its plain gradient was used. It is
        refused, naming the module; with create_graph=True the rules act in the relevance pass only, and both are
        the model's."""
        torch.manual_seed(0)
        model = Hamiltonian().double()
        x = torch.randn(5, 4, dtype=F64)
        lrp = LRP(model, mapper(), in_keys=["x"], out_keys=["y"])
        for _ in range(2):  # each call
            td = TensorDict(x=x.clone(), batch_size=[5])
            with pytest.raises(ValueError, match=r"the model itself \(Hamiltonian\) calls torch.autograd.grad in its "):
                lrp(td)
            assert list(td.keys()) == ["x"]
        with pytest.warns(UserWarning, match="computes grad in its own forward"):
            td = LRP(model, mapper(), in_keys=["x"], out_keys=["y"], create_graph=True)(TensorDict(x=x, batch_size=[5]))
        leaf = x.clone().requires_grad_(True)
        y = model(leaf)
        (grad,) = torch.autograd.grad(y.max(-1).values.sum(), leaf)
        torch.testing.assert_close(td["y"], y.detach(), rtol=0, atol=0)
        if mapper is BaseRuleMapper:  # LRP-0 through the plain gradient of the field
            torch.testing.assert_close(td["relevance", "x"], grad * x)

    def test_a_gradient_through_no_rule_is_not_refused(self):
        torch.manual_seed(0)
        model = SquaredNorm().double()
        x = torch.randn(5, 4, dtype=F64)
        with pytest.warns(UserWarning, match="computes grad in its own forward"):
            td = LRP(model, BaseRuleMapper(), in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[5]))
        leaf = x.clone().requires_grad_(True)
        y = model(leaf)
        (grad,) = torch.autograd.grad(y.max(-1).values.sum(), leaf)
        torch.testing.assert_close(td["y"], y.detach(), rtol=0, atol=0)
        torch.testing.assert_close(td["relevance", "x"], grad * x)


def test_a_plain_gradient_warning_made_an_error_is_given_at_every_call():
    """A caller's filter that makes the warning of a call without a rule an error raises it at every call, not only
    the first (the next call was no longer checked); once given, the warning is not repeated, and the relevance of a
    call after the errors is that of a fresh wrapper."""
    torch.manual_seed(0)
    model = nn.Sequential(SineBlock()).double()
    lrp = LRP(model, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
    x = torch.randn(3, 4, dtype=F64)
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(UserWarning, match=r"module '0' \(SineBlock\) computes sin"):
                lrp(TensorDict(x=x, batch_size=[3]))
    with pytest.warns(UserWarning, match="computes sin"):
        after = lrp(TensorDict(x=x, batch_size=[3]))["relevance", "x"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lrp(TensorDict(x=x, batch_size=[3]))  # given once: not again
    with pytest.warns(UserWarning, match="computes sin"):
        fresh = LRP(model, EpsilonPlus(), in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[3]))
    torch.testing.assert_close(after, fresh["relevance", "x"], rtol=1e-12, atol=1e-14)
    assert "sin" in str(lrp.coverage())
