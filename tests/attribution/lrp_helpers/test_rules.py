"""Every rule against zennit's counterpart (float64) or its closed form."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from zennit import rules as zrules

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.rules import (
    AlphaBetaRule,
    EpsilonRule,
    FlatRule,
    GammaRule,
    IgnoreRule,
    MergeBatchNormRule,
    ParamModifier,
    PassRule,
    StopRule,
    UniformEpsilonRule,
    UniformRule,
    WSquareRule,
    ZBoxRule,
    raise_for_unconserved_rel_factory,
    stabilize,
)
from tests.conftest import relative_error, tdhook_relevance, zennit_relevance

TOL = 1e-6


def make_layer(kind: str) -> tuple[nn.Module, torch.Tensor]:
    layers = {
        "linear": (nn.Linear(6, 5), (4, 6)),
        "conv1d": (nn.Conv1d(3, 4, 3, padding=1), (2, 3, 9)),
        "conv2d": (nn.Conv2d(3, 4, 3, stride=2, padding=1), (2, 3, 7, 7)),
        "conv3d": (nn.Conv3d(2, 3, 3, padding=1), (2, 2, 4, 4, 4)),
        "convtranspose1d": (nn.ConvTranspose1d(3, 4, 3, stride=2, padding=1), (2, 3, 6)),
        "convtranspose2d": (nn.ConvTranspose2d(3, 2, 3, stride=2), (2, 3, 4, 4)),
        "convtranspose3d": (nn.ConvTranspose3d(2, 3, 3, stride=2, padding=1), (2, 2, 3, 3, 3)),
    }
    layer, shape = layers[kind]
    layer = layer.double()
    with torch.no_grad():
        layer.bias.normal_()
    return layer, torch.randn(shape, dtype=torch.float64)


def output_relevance(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.randn_like(layer(x))


LAYERS = ["linear", "conv1d", "conv2d", "conv3d", "convtranspose1d", "convtranspose2d", "convtranspose3d"]

RULE_PAIRS = {
    "epsilon": (lambda: EpsilonRule(1e-6), lambda: zrules.Epsilon(1e-6)),
    "epsilon-large": (lambda: EpsilonRule(0.5), lambda: zrules.Epsilon(0.5)),
    "zplus": (lambda: AlphaBetaRule(1.0, 0.0), lambda: zrules.ZPlus()),
    "alpha2beta1": (lambda: AlphaBetaRule(2.0, 1.0), lambda: zrules.AlphaBeta(2.0, 1.0)),
    "alpha1beta0": (lambda: AlphaBetaRule(1.0, 0.0), lambda: zrules.AlphaBeta(1.0, 0.0)),
    "gamma": (lambda: GammaRule(0.25), lambda: zrules.Gamma(0.25)),
    "gamma-nobias": (lambda: GammaRule(1.0, zero_params=["bias"]), lambda: zrules.Gamma(1.0, zero_params=["bias"])),
    "flat": (lambda: FlatRule(), lambda: zrules.Flat()),
    "wsquare": (lambda: WSquareRule(), lambda: zrules.WSquare()),
    "zbox": (lambda: ZBoxRule(-2.5, 2.5), lambda: zrules.ZBox(-2.5, 2.5)),
}


class TestAgainstZennit:
    @pytest.mark.parametrize("kind", LAYERS)
    @pytest.mark.parametrize("rule_name", sorted(RULE_PAIRS))
    def test_rule_matches_zennit(self, rule_name: str, kind: str):
        ours, theirs = RULE_PAIRS[rule_name]
        layer, x = make_layer(kind)
        r_out = output_relevance(layer, x)
        expected = zennit_relevance(theirs(), layer, x, r_out)
        actual = tdhook_relevance(ours(), layer, x, r_out)
        assert actual.shape == x.shape
        assert relative_error(actual, expected) <= TOL

    @pytest.mark.parametrize("kind", LAYERS)
    @pytest.mark.parametrize("rule_name", ["gamma", "gamma-nobias", "zplus", "alpha2beta1"])
    def test_rule_matches_zennit_on_nonnegative_inputs(self, rule_name: str, kind: str):
        """Inputs after a ReLU: the rules skip the x⁻ pass, and γ computes its transposed products directly."""
        ours, theirs = RULE_PAIRS[rule_name]
        layer, x = make_layer(kind)
        x = x.clamp(min=0)
        r_out = output_relevance(layer, x)
        expected = zennit_relevance(theirs(), layer, x, r_out)
        assert relative_error(tdhook_relevance(ours(), layer, x, r_out), expected) <= TOL

    @pytest.mark.parametrize(
        "layer,shape",
        [
            (nn.Linear(5, 3), (2, 4, 5)),  # a sequence: the bias broadcasts over the last dimension
            (nn.Conv2d(3, 4, 3, padding="same"), (2, 3, 5, 5)),
            (nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), (2, 3, 5, 5)),
        ],
        ids=["linear-sequence", "conv-same", "conv-reflect"],
    )
    def test_gamma_on_nonnegative_inputs_of_other_layouts(self, layer: nn.Module, shape: tuple):
        layer = layer.double()
        with torch.no_grad():
            layer.bias.normal_()
        x = torch.randn(shape, dtype=torch.float64).clamp(min=0)
        r_out = output_relevance(layer, x)
        expected = zennit_relevance(zrules.Gamma(0.25), layer, x, r_out)
        assert relative_error(tdhook_relevance(GammaRule(0.25), layer, x, r_out), expected) <= TOL

    def test_zbox_with_tensor_bounds(self):
        layer, x = make_layer("conv2d")
        low = -torch.rand(1, 3, 1, 1, dtype=torch.float64) - 2
        high = torch.rand(1, 3, 1, 1, dtype=torch.float64) + 2
        r_out = output_relevance(layer, x)
        expected = zennit_relevance(zrules.ZBox(low, high), layer, x, r_out)
        actual = tdhook_relevance(ZBoxRule(low, high), layer, x, r_out)
        assert relative_error(actual, expected) <= TOL

    @pytest.mark.parametrize("activation", [nn.Tanh(), nn.ELU(), nn.Sigmoid(), nn.SiLU(), nn.ReLU(), nn.GELU()])
    def test_pass_matches_zennit(self, activation: nn.Module):
        x = torch.randn(3, 7, dtype=torch.float64)
        # Relevance at a tensor is the tensor times its gradient, so it vanishes where the output does.
        with torch.no_grad():
            r_out = activation(x) * torch.randn_like(x)
        expected = zennit_relevance(zrules.Pass(), activation, x, r_out)
        actual = tdhook_relevance(PassRule(), activation, x, r_out)
        assert relative_error(actual, expected) <= TOL

    @pytest.mark.parametrize("pool", [nn.AvgPool2d(2), nn.AdaptiveAvgPool2d(3)])
    def test_norm_on_avg_pool_matches_zennit(self, pool: nn.Module):
        x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
        r_out = output_relevance(pool, x)
        expected = zennit_relevance(zrules.Norm(1e-6), pool, x, r_out)
        actual = tdhook_relevance(EpsilonRule(1e-6), pool, x, r_out)
        assert relative_error(actual, expected) <= TOL

    def test_flat_gives_relevance_to_zero_inputs(self):
        layer, x = make_layer("linear")
        x[:, :2] = 0.0
        r_out = output_relevance(layer, x)
        expected = zennit_relevance(zrules.Flat(), layer, x, r_out)
        actual = tdhook_relevance(FlatRule(), layer, x, r_out)
        assert expected[:, :2].abs().sum() > 0
        assert relative_error(actual, expected) <= TOL


class TestFastPaths:
    """The paths that skip autograd or a product, each checked against zennit and shown to be taken."""

    @pytest.mark.parametrize("kind", LAYERS)
    @pytest.mark.parametrize("rule_name", ["gamma", "gamma-nobias"])
    def test_gamma_without_relevance_on_negative_outputs_matches_zennit(self, rule_name, kind, monkeypatch):
        # After a ReLU no relevance reaches a negative output: one transposed product suffices.
        taken = spy(monkeypatch, GammaRule, "_positive_outputs_gradient")
        ours, theirs = RULE_PAIRS[rule_name]
        layer, x = make_layer(kind)
        x = x.clamp(min=0)
        with torch.no_grad():
            r_out = output_relevance(layer, x) * (layer(x) > 0)
        expected = zennit_relevance(theirs(), layer, x, r_out)
        assert relative_error(tdhook_relevance(ours(), layer, x, r_out), expected) <= TOL
        assert taken

    @pytest.mark.parametrize("rule_name", ["gamma", "gamma-nobias"])
    def test_gamma_with_relevance_on_negative_outputs_takes_both_products(self, rule_name, monkeypatch):
        one_product = spy(monkeypatch, GammaRule, "_positive_outputs_gradient")
        two_products = spy(monkeypatch, GammaRule, "_nonnegative_input_gradient")
        ours, theirs = RULE_PAIRS[rule_name]
        layer, x = make_layer("conv2d")
        x = x.clamp(min=0)
        r_out = output_relevance(layer, x)
        expected = zennit_relevance(theirs(), layer, x, r_out)
        assert relative_error(tdhook_relevance(ours(), layer, x, r_out), expected) <= TOL
        assert not one_product
        # A zeroed bias can make D = γW⁺x − b negative: the signs of z^↑ and z^↓ are then unknown (autograd path).
        assert bool(two_products) == (rule_name == "gamma")

    @pytest.mark.parametrize("rule_name", ["zplus", "gamma", "flat", "zbox"])
    def test_an_expanded_output_gradient_gives_the_contiguous_result(self, rule_name):
        # out.sum() sends back an expanded gradient: the element-wise work then runs on whole tensors.
        layer, x = make_layer("conv2d")
        x = x.clamp(min=0)

        def relevance(expanded: bool) -> torch.Tensor:
            rule, leaf = RULE_PAIRS[rule_name][0](), x.clone().requires_grad_(True)
            with rule.register(layer) as handle:
                out = layer(leaf)
                grad_out = torch.ones(()).double().expand_as(out) if expanded else torch.ones_like(out)
                assert grad_out.is_contiguous() != expanded
                grad = torch.autograd.grad(out, leaf, grad_out)[0]
                return leaf.detach() * grad + sum(rest for _, rest in handle.pop_records())

        torch.testing.assert_close(relevance(expanded=True), relevance(expanded=False), rtol=1e-12, atol=1e-14)

    def test_zbox_with_bounds_per_sample_matches_zennit(self, monkeypatch):
        # Bounds that differ between samples cannot be computed for one sample: the autograd path runs.
        taken = spy(monkeypatch, ZBoxRule, "_relevance_by_autograd")
        layer, x = make_layer("conv2d")
        low = -torch.rand(2, 3, 1, 1, dtype=torch.float64) - 2
        high = torch.rand(2, 3, 1, 1, dtype=torch.float64) + 2
        r_out = output_relevance(layer, x)
        expected = zennit_relevance(zrules.ZBox(low, high), layer, x, r_out)
        assert relative_error(tdhook_relevance(ZBoxRule(low, high), layer, x, r_out), expected) <= TOL
        assert taken

    @pytest.mark.parametrize("kind", LAYERS)
    @pytest.mark.parametrize("rule_name", ["flat", "wsquare", "zbox"])
    def test_input_layer_rules_skip_autograd_and_match_zennit(self, rule_name, kind, monkeypatch):
        taken = spy(monkeypatch, type(RULE_PAIRS[rule_name][0]()), "_relevance_by_autograd")
        ours, theirs = RULE_PAIRS[rule_name]
        layer, x = make_layer(kind)
        r_out = output_relevance(layer, x)
        expected = zennit_relevance(theirs(), layer, x, r_out)
        assert relative_error(tdhook_relevance(ours(), layer, x, r_out), expected) <= TOL
        assert not taken

    @pytest.mark.parametrize("rule_name", ["flat", "wsquare", "zbox", "zplus", "gamma"])
    @pytest.mark.parametrize("kind", ["linear", "conv2d"])
    def test_an_unbatched_input_gives_the_batched_result(self, rule_name, kind):
        layer, x = make_layer(kind)
        x = x.clamp(min=0)  # the z⁺ and γ paths without a forward pass for x⁻
        sample = x[1] if kind == "conv2d" else x[1, :]
        r_out = output_relevance(layer, x)
        batched = tdhook_relevance(RULE_PAIRS[rule_name][0](), layer, x, r_out)
        rule = RULE_PAIRS[rule_name][0]()
        lrp = LRP(
            layer,
            rule_mapper=lambda n, m: rule if m is layer else None,
            in_keys=["x"],
            out_keys=["y"],
            target=lambda y: r_out[1],
        )
        single = lrp(TensorDict(x=sample.clone()))["relevance", "x"]
        assert relative_error(single, batched[1]) <= 1e-12

    @pytest.mark.parametrize(
        "rule_name", ["epsilon", "zplus", "gamma", "gamma-positive-outputs", "flat", "wsquare", "zbox"]
    )
    def test_repeated_backward_over_one_forward_gives_the_same_gradient(self, rule_name):
        # A backward that frees the graph may write into what the rule saved; one that keeps it must not.
        rule = RULE_PAIRS[rule_name.removesuffix("-positive-outputs")][0]()
        layer, x = make_layer("conv2d")
        x = x.clamp(min=0).requires_grad_(True)
        with rule.register(layer):
            out = layer(x)
            grad = torch.randn_like(out)
            if rule_name.endswith("-positive-outputs"):
                grad = grad * (out > 0)
            first = torch.autograd.grad(out, x, grad, retain_graph=True)[0]
            second = torch.autograd.grad(out, x, grad, retain_graph=True)[0]
            last = torch.autograd.grad(out, x, grad)[0]
        assert torch.equal(first, second)
        assert torch.equal(first, last)

    def test_a_second_backward_over_a_freed_graph_raises_torchs_error(self):
        # The first backward may have written into what the rule saved: a second one must not read it.
        layer, x = make_layer("linear")
        x = x.abs().requires_grad_(True)
        with FlatRule().register(layer):
            out = layer(x)
            torch.autograd.grad(out, x, torch.ones_like(out))
            with pytest.raises(RuntimeError, match="backward through the graph a second time"):
                torch.autograd.grad(out, x, torch.ones_like(out))

    @pytest.mark.parametrize("rule_name", ["epsilon", "zplus", "flat", "zbox", "gamma-after-relu"])
    def test_vectorized_jacobian_equals_the_unit_by_unit_one(self, rule_name):
        # Batched gradients (is_grads_batched) must not be written into the rule's saved tensors.
        net = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)).double()
        x = torch.randn(2, 4, dtype=torch.float64)
        rule, second = RULE_PAIRS[rule_name.removesuffix("-after-relu")][0](), EpsilonRule()
        if rule_name.endswith("-after-relu"):  # the γ paths for inputs x ≥ 0
            rule, second = second, rule
        with rule.register(net[0]), second.register(net[2]):
            vectorized = torch.autograd.functional.jacobian(net, x, vectorize=True)
            unit_by_unit = torch.autograd.functional.jacobian(net, x)
        assert torch.allclose(vectorized, unit_by_unit, rtol=1e-12, atol=1e-14)

    @pytest.mark.parametrize("rule_name", ["flat", "wsquare", "zbox", "zplus", "gamma"])
    def test_transposed_convolution_with_output_padding_past_the_stride_matches_zennit(self, rule_name):
        # Its transposed product runs past the input's end; the direct paths keep the input's positions.
        layer = nn.ConvTranspose1d(2, 3, 3, stride=1, dilation=2, output_padding=1).double()
        x = torch.randn(2, 2, 6, dtype=torch.float64).abs()
        ours, theirs = RULE_PAIRS[rule_name]
        r_out = output_relevance(layer, x)
        expected = zennit_relevance(theirs(), layer, x, r_out)
        assert relative_error(tdhook_relevance(ours(), layer, x, r_out), expected) <= TOL

    @pytest.mark.parametrize("in_place", [None, "mul_"])
    def test_a_layer_merged_last_call_but_not_this_one_gets_its_own_output(self, in_place):
        # Merged with its BatchNorm in the last call, the layer skips copying its output; a call that is not
        # merged copies it in the backward pass or, when an in-place operation changed it, recomputes it.
        layer, x = make_layer("conv2d")
        x = x.abs()
        grad_out = torch.randn_like(layer(x))

        def relevance() -> torch.Tensor:
            leaf = x.clone().requires_grad_(True)
            out = layer(leaf)
            if in_place:
                out = getattr(out, in_place)(2.0)
            return leaf.detach() * torch.autograd.grad(out, leaf, grad_out)[0]

        norm = nn.BatchNorm2d(4).double().eval()
        fresh = GammaRule(0.25)
        with fresh.register(layer):
            expected = relevance()
        rule = GammaRule(0.25)
        with rule.register(layer), MergeBatchNormRule().register(norm):
            norm(layer(x.clone().requires_grad_(True)))  # merged: the next call does not copy the output
            actual = relevance()
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-14)

    def test_zbox_on_a_linear_subclass_matches_zennit(self):
        class SubclassedLinear(nn.Linear):
            pass

        layer = SubclassedLinear(6, 5).double()
        x = torch.randn(4, 6, dtype=torch.float64)
        r_out = output_relevance(layer, x)
        expected = zennit_relevance(zrules.ZBox(-2.5, 2.5), layer, x, r_out)
        assert relative_error(tdhook_relevance(ZBoxRule(-2.5, 2.5), layer, x, r_out), expected) <= TOL


def spy(monkeypatch, cls: type, name: str) -> list:
    """Record the calls of ``cls.name`` (it still runs)."""
    calls, method = [], getattr(cls, name)

    def recorded(*args, **kwargs):
        calls.append(args)
        return method(*args, **kwargs)

    monkeypatch.setattr(cls, name, recorded)
    return calls


class TestClosedForms:
    def test_stabilize_keeps_sign_and_treats_zero_as_positive(self):
        out = stabilize(torch.tensor([-2.0, -0.0, 0.0, 3.0, float("nan")], dtype=torch.float64), 0.25)
        assert out[:4].tolist() == [-2.25, 0.25, 0.25, 3.25]  # -0.0 counts as zero, as in zennit
        assert out[4].isnan()

    def test_epsilon_zero_is_gradient_times_input(self):
        layer, x = make_layer("conv2d")
        r_out = output_relevance(layer, x)
        with torch.no_grad():
            z = layer(x)
        xg = x.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(layer(xg), xg, r_out / z)
        actual = tdhook_relevance(EpsilonRule(0.0), layer, x, r_out)
        assert relative_error(actual, x * grad) <= 1e-12

    def test_uniform_rule_splits_relevance_evenly(self):
        class Mul(nn.Module):
            def forward(self, a, b):
                return a * b

        a = torch.tensor([[0.0, 2.0, -1.0]], dtype=torch.float64, requires_grad=True)
        b = torch.tensor([[3.0, 0.5, 4.0]], dtype=torch.float64, requires_grad=True)
        mul, r_out = Mul(), torch.tensor([[1.0, -2.0, 3.0]], dtype=torch.float64)
        with UniformRule().register(mul) as handle:
            z = mul(a, b)
            ga, gb = torch.autograd.grad(z, (a, b), r_out / z.detach().where(z != 0, 1.0))
            records = handle.pop_records()
        extra = {id(t): rest for t, rest in records}
        ra = a.detach() * ga + extra[id(a)]
        rb = b.detach() * gb + extra[id(b)]
        # z is zero in the first unit, so r_out / z is zeroed there: the split concerns the others.
        expected = torch.tensor([[0.0, -1.0, 1.5]], dtype=torch.float64)
        torch.testing.assert_close(ra, expected)
        torch.testing.assert_close(rb, expected)

    def test_uniform_epsilon_halves_the_product_rule(self):
        class Mul(nn.Module):
            def forward(self, a, b):
                return a * b

        a = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
        b = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
        mul = Mul()
        with UniformEpsilonRule(0.0).register(mul):
            z = mul(a, b)
            ga, gb = torch.autograd.grad(z, (a, b), torch.ones_like(z))
        torch.testing.assert_close(a.detach() * ga, z.detach() / 2)
        torch.testing.assert_close(b.detach() * gb, z.detach() / 2)

    def test_stop_rule_blocks_relevance(self):
        layer, x = make_layer("linear")
        r = tdhook_relevance
        with pytest.raises(ValueError, match="does not depend"):
            r(StopRule(), layer, x, output_relevance(layer, x))

    def test_ignore_rule_is_the_plain_gradient(self):
        layer, x = make_layer("linear")
        r_out = output_relevance(layer, x)
        torch.testing.assert_close(
            tdhook_relevance(IgnoreRule(), layer, x, r_out), tdhook_relevance(EpsilonRule(0.0), layer, x, r_out)
        )

    def test_pass_on_inplace_activation_keeps_input_intact(self):
        act = nn.ELU(inplace=True)
        x = torch.randn(4, 6, dtype=torch.float64)
        r_out = output_relevance(nn.ELU(), x)
        expected = zennit_relevance(zrules.Pass(), nn.ELU(), x, r_out)
        lin = nn.Identity()
        model = nn.Sequential(lin, act)
        from tensordict import TensorDict

        from tdhook.attribution import LRP

        lrp = LRP(
            model,
            rule_mapper=lambda n, m: PassRule() if m is act else None,
            in_keys=["x"],
            out_keys=["y"],
            target=lambda y: r_out,
        )
        td = lrp(TensorDict(x=x.clone() * 1, batch_size=[4]))
        assert relative_error(td["relevance", "x"], expected) <= TOL


class TestRegistration:
    def test_alpha_beta_refuses_unbalanced_parameters(self):
        with pytest.raises(ValueError, match="alpha - beta == 1"):
            AlphaBetaRule(alpha=1.0, beta=1.0)

    def test_weight_rule_on_module_without_weight_names_it(self):
        with pytest.raises(ValueError, match="ReLU has none"):
            AlphaBetaRule(1.0, 0.0).register(nn.ReLU())

    def test_double_registration_is_refused(self):
        layer = nn.Linear(2, 2)
        rule = EpsilonRule()
        with rule.register(layer):
            with pytest.raises(ValueError, match="already registered"):
                rule.register(layer)
        assert not layer._forward_hooks

    def test_handle_removes_hooks_and_never_writes_parameters(self):
        layer, x = make_layer("conv2d")
        before = {k: v.clone() for k, v in layer.state_dict().items()}
        params = dict(layer.named_parameters())
        with GammaRule().register(layer):
            layer(x.requires_grad_(True)).sum().backward()
        assert not layer._forward_hooks and not layer._forward_pre_hooks
        assert all(params[k] is p for k, p in layer.named_parameters())
        assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())

    def test_param_modifier_context_restores_the_same_objects(self):
        layer = nn.Linear(3, 2)
        weight = layer.weight
        with ParamModifier(lambda n, p: p * 0, lambda n, p: n == "weight")(layer):
            assert torch.count_nonzero(layer.weight) == 0
            assert layer.bias is not None
        assert layer.weight is weight

    def test_param_modifier_restores_after_an_error(self):
        layer = nn.Linear(3, 2)
        weight = layer.weight
        with pytest.raises(RuntimeError, match="boom"):
            with ParamModifier(lambda n, p: p * 0)(layer):
                raise RuntimeError("boom")
        assert layer.weight is weight


class TestUnconservedCheck:
    def test_accepts_conserved_and_rejects_lost_relevance(self):
        check = raise_for_unconserved_rel_factory(atol=1e-6, rtol=1e-6)
        check("a", nn.Linear(1, 1), torch.tensor([0.25, 0.75]), torch.tensor([1.0]))
        with pytest.raises(ValueError, match="'a'"):
            check("a", nn.Linear(1, 1), torch.tensor([0.25, 0.5]), torch.tensor([1.0]))

    def test_rejects_nan(self):
        check = raise_for_unconserved_rel_factory()
        with pytest.raises(ValueError, match="NaN or inf"):
            check("layer", nn.Tanh(), torch.tensor([float("nan")]), torch.tensor([1.0]))


class TestMappers:
    def test_dict_mapper_matches_names_before_types_in_order(self):
        from tdhook.attribution.lrp_helpers.rules import BaseRuleMapper, rule_mapper_from_dict

        stop, eps = StopRule(), EpsilonRule(0.5)
        mapper = rule_mapper_from_dict({"features.*": stop, nn.Linear: eps})
        assert mapper("features.3", nn.Linear(1, 1)) is stop
        assert mapper("classifier.0", nn.Linear(1, 1)) is eps
        assert mapper("classifier.1", nn.ReLU()) is None
        base = BaseRuleMapper(rule_mapper={nn.Linear: eps})
        assert base("fc", nn.Linear(1, 1)) is eps and isinstance(base("act", nn.Tanh()), PassRule)

    def test_dict_mapper_rejects_non_rules(self):
        from tdhook.attribution.lrp_helpers.rules import rule_mapper_from_dict

        with pytest.raises(TypeError, match="'head' must map to a Rule"):
            rule_mapper_from_dict({"head": "epsilon"})

    def test_lrp_accepts_a_dict_and_it_changes_the_result(self):
        from tensordict import TensorDict
        from tensordict.nn import TensorDictModule

        from tdhook.attribution import LRP

        net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).double()
        td = TensorDict(x=torch.randn(3, 4, dtype=torch.float64), batch_size=[3])
        module = TensorDictModule(net, in_keys=["x"], out_keys=["y"])
        flat = LRP(module, rule_mapper={"module.0": FlatRule()})(td.clone())["relevance", "x"]
        plain = LRP(module)(td.clone())["relevance", "x"]
        assert relative_error(flat, plain) > 1e-3
        # Flat spreads each unit's relevance evenly over the 4 inputs: all four columns are equal.
        torch.testing.assert_close(flat, flat[:, :1].expand_as(flat))

    def test_first_layer_rule_stays_on_the_first_layer_when_the_user_maps_it(self):
        from tdhook.attribution.lrp_helpers.rules import EpsilonPlusFlat

        model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 1)).double()
        epsilon = EpsilonRule()
        rules = EpsilonPlusFlat(rule_mapper={"0": epsilon}).rules(model)
        assert rules["0"] is epsilon
        # Layers 2 and 3 are not reached first by the input: they keep ε, never Flat.
        td = TensorDict(x=torch.randn(5, 3, dtype=torch.float64), batch_size=[5])
        keys = {"in_keys": ["x"], "out_keys": ["y"]}
        ours = LRP(model, EpsilonPlusFlat(rule_mapper={"0": epsilon}), **keys)(td.clone())["relevance", "x"]
        all_epsilon = LRP(model, {nn.Linear: EpsilonRule()}, **keys)(td.clone())["relevance", "x"]
        torch.testing.assert_close(ours, all_epsilon, rtol=1e-12, atol=1e-12)

    def test_first_layer_is_the_one_the_input_reaches(self):
        from tdhook.attribution.lrp_helpers.rules import EpsilonPlusFlat

        class TwoEncoders(nn.Module):
            """Declares the head first; each input has its own encoder."""

            def __init__(self):
                super().__init__()
                self.head = nn.Linear(6, 2)
                self.encode_a, self.encode_b = nn.Linear(3, 3), nn.Linear(2, 3)

            def forward(self, a, b):
                return self.head(torch.cat([self.encode_a(a), self.encode_b(b)], -1).relu())

        model = TwoEncoders().double()
        td = TensorDict(a=torch.randn(4, 3).double(), b=torch.randn(4, 2).double(), batch_size=[4])
        module = TensorDictModule(model, in_keys=["a", "b"], out_keys=["y"])
        ours = LRP(module, rule_mapper=EpsilonPlusFlat(epsilon=0.1))(td.clone())
        # Names are those of the object passed: here the TensorDictModule, which holds the model as "module".
        flat, eps = FlatRule(), EpsilonRule(0.1)
        by_name = {"module.encode_a": flat, "module.encode_b": flat, "module.head": eps}
        expected = LRP(module, rule_mapper=by_name)(td.clone())
        for key in ("a", "b"):
            torch.testing.assert_close(ours["relevance", key], expected["relevance", key], rtol=1e-12, atol=1e-12)
        # Flat gives every input of an encoder the same relevance within a sample.
        for key in ("a", "b"):
            rel = ours["relevance", key]
            torch.testing.assert_close(rel, rel[:, :1].expand_as(rel))
