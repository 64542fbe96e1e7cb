"""The basic rules (ε, pass, ignore, stop, uniform) against zennit's counterparts (float64) or their closed forms."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn
from zennit import rules as zrules

from tdhook.attribution import LRP, AttnLRP, BaseRuleMapper
from tdhook.attribution.rules.basic import EpsilonRule, IgnoreRule, PassRule, StopRule, UniformEpsilonRule, UniformRule
from tests.attribution._helpers import explain, gradient_times_input
from tests.attribution.rules import _helpers as rule_checks
from tests.attribution.rules._helpers import LAYERS, TOL, make_layer, output_relevance
from tests.attribution.rules._helpers import RULE_PAIRS as ALL_RULE_PAIRS
from tests.conftest import relative_error, tdhook_relevance, zennit_relevance

RULE_PAIRS = {name: ALL_RULE_PAIRS[name] for name in ("epsilon", "epsilon-large")}


class TestAgainstZennit:
    @pytest.mark.parametrize("kind", LAYERS)
    @pytest.mark.parametrize("rule_name", sorted(RULE_PAIRS))
    def test_rule_matches_zennit(self, rule_name: str, kind: str):
        rule_checks.assert_rule_matches_zennit(rule_name, kind)

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


@pytest.mark.parametrize("create_graph", [False, True], ids=["plain", "create_graph"])
@pytest.mark.parametrize("epsilon", [1e-9, 1e-12])
def test_an_epsilon_below_float16s_smallest_step_gives_zero_outputs_no_relevance(epsilon: float, create_graph: bool):
    # z / stabilize(z, ε) is 0 at z = 0; in float16, whose smallest step is 6e-8, such an ε rounded to 0 and the
    # factor was 0 / 0: the relevance of a sample of zeros was NaN (and of the others, float32's cast).
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8, bias=False), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(3, 4)
    x[1] = 0.0
    mapper = {nn.Linear: EpsilonRule(epsilon)}

    def relevance(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        lrp = LRP(model, mapper, in_keys=["x"], out_keys=["y"], create_graph=create_graph)
        return lrp(TensorDict(x=x, batch_size=[3]))["relevance", "x"].detach()

    expected = relevance(net, x)
    actual = relevance(net.half(), x.half())
    assert torch.equal(actual[1], torch.zeros(4, dtype=torch.float16))
    torch.testing.assert_close(actual.float(), expected, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("epsilon", [1e-9, 2e-8])
def test_a_targets_relevance_on_a_zero_output_goes_as_in_float32_where_epsilon_is_below_float16s_step(epsilon: float):
    # zennit's ε-rule sends R / stabilize(0, ε) = R / ε from an output of 0; in float16, where ε rounds to 0, it was
    # R / 0 (inf) at the target's outputs and 0 / 0 (NaN) at the other zero outputs: inf and NaN relevance.
    lin = nn.Linear(3, 2, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[1.0, -1.0, 0.0], [1.0, 2.0, 3.0]]))
    x = torch.tensor([[0.5, 0.5, 0.25], [1.0, 1.0, 0.5]])  # output 0 is exactly 0 in both samples
    mask = torch.tensor([1.0, 0.0])

    def relevance(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        target = lambda y: 2.0**-20 * mask.to(y).expand_as(y)  # noqa: E731
        lrp = LRP(model, {nn.Linear: EpsilonRule(epsilon)}, in_keys=["x"], out_keys=["y"], target=target)
        return lrp(TensorDict(x=x, batch_size=[2]))["relevance", "x"]

    expected = x * lin.weight[0].detach() * (2.0**-20 / epsilon)  # R / ε (R exact in float16), by the weights
    torch.testing.assert_close(relevance(lin.double(), x.double()), expected.double(), rtol=1e-9, atol=0)
    torch.testing.assert_close(relevance(lin.half(), x.half()).float(), expected, rtol=2e-3, atol=0)


class TestFastPaths:
    """The paths that skip autograd or a product, each checked against zennit and shown to be taken."""

    @pytest.mark.parametrize("on_node", [False, True])
    @pytest.mark.parametrize("rule_name", ["epsilon"])
    def test_repeated_backward_over_one_forward_gives_the_same_gradient(self, rule_name, on_node):
        # A backward that frees the graph may write into what the rule saved; one that keeps it must not.
        rule = RULE_PAIRS[rule_name.removesuffix("-positive-outputs")][0]()
        layer, x = make_layer("conv2d")
        x = x.clamp(min=0).requires_grad_(True)
        with rule.register(layer):
            _leave_marks(rule, layer, not on_node)
            out = layer(x)
            assert _on_node(out) == on_node
            grad = torch.randn_like(out)
            if rule_name.endswith("-positive-outputs"):
                grad = grad * (out > 0)
            first = torch.autograd.grad(out, x, grad, retain_graph=True)[0]
            second = torch.autograd.grad(out, x, grad, retain_graph=True)[0]
            last = torch.autograd.grad(out, x, grad)[0]
        assert torch.equal(first, second)
        assert torch.equal(first, last)
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            torch.autograd.grad(out, x, grad)

    @pytest.mark.parametrize("on_node", [False, True])
    @pytest.mark.parametrize("rule_name", ["epsilon"])
    def test_vectorized_jacobian_equals_the_unit_by_unit_one(self, rule_name, on_node):
        # Batched gradients (is_grads_batched) must not be written into the rule's saved tensors.
        net = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)).double()
        x = torch.randn(2, 4, dtype=torch.float64)
        rule, second = RULE_PAIRS[rule_name.removesuffix("-after-relu")][0](), EpsilonRule()
        if rule_name.endswith("-after-relu"):  # the γ paths for inputs x ≥ 0
            rule, second = second, rule
        with rule.register(net[0]), second.register(net[2]):
            _leave_marks(rule, net[0], not on_node)
            _leave_marks(second, net[2], not on_node)
            vectorized = torch.autograd.functional.jacobian(net, x, vectorize=True)
            unit_by_unit = torch.autograd.functional.jacobian(net, x)
            assert _on_node(net[2](net[1](net[0](x)))) == on_node
        assert torch.allclose(vectorized, unit_by_unit, rtol=1e-12, atol=1e-14)

    @pytest.mark.parametrize("inplace", [False, True])
    @pytest.mark.parametrize("kind", ["linear", "conv2d"])
    def test_the_gradient_changed_on_the_layer_node_equals_the_redirect(self, kind, inplace):
        # Where nothing but the rule sees a layer's output (no marks read, no hook before the rule's), the rule
        # changes the gradient on the layer's own autograd node: the same relevance, bit for bit, in-place
        # operations on the output after the rule included.
        layer, x = make_layer(kind)
        net = nn.Sequential(layer, nn.ReLU(inplace=inplace), nn.Flatten(), nn.LazyLinear(3)).double()
        net(x)  # the lazy layer takes its shape
        relevances = []
        for on_node in (False, True):
            rule, x_leaf = EpsilonRule(0.25), x.clone().requires_grad_(True)
            with rule.register(net[0]), rule.register(net[3]):
                _leave_marks(rule, net[0], not on_node)
                _leave_marks(rule, net[3], not on_node)
                out = net(x_leaf)
                assert _on_node(net[0](x_leaf)) == on_node
                relevances.append(x_leaf * torch.autograd.grad(out, x_leaf, torch.ones_like(out))[0])
        assert torch.equal(relevances[0], relevances[1])
        assert relevances[1].abs().sum() > 0

    def test_an_output_seen_before_the_rule_keeps_the_redirect(self):
        # A forward hook that runs before the rule's (prepended after the rule was registered; or a view as the
        # output) sees the output the rule would change on its node: the rule then returns a tensor of its own.
        # The rule's hook goes before the hooks the layer had: those see the rule's output, on its node or not.
        layer, rule = nn.Linear(3, 2), EpsilonRule()
        seen = []
        layer.register_forward_hook(lambda m, args, out: seen.append(out))
        with rule.register(layer):
            _leave_marks(rule, layer, False)
            assert _on_node(layer(torch.ones(1, 3, requires_grad=True)))
            first = layer.register_forward_hook(lambda m, args, out: seen.append(out), prepend=True)
            assert not _on_node(layer(torch.ones(1, 3, requires_grad=True)))
            first.remove()
            assert _on_node(layer(torch.ones(1, 3, requires_grad=True)))
            assert not _on_node(layer(torch.ones(2, 4, 3, requires_grad=True)))  # a view of a matrix product
            assert not _on_node(layer(torch.ones(3, requires_grad=True)))
        assert len(seen) == 6


@pytest.mark.parametrize("activation", [nn.GELU, nn.SiLU, nn.Tanh])
def test_the_pass_rule_in_float16_is_finite_where_the_input_is_exactly_zero(activation):
    # float16's smallest step (6e-8) swallows the stabiliser (1e-12): the factor f(0) / stabilize(0) would be 0 / 0.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6, bias=False), activation(), nn.Linear(6, 3, bias=False))
    x = torch.randn(3, 4)
    x[0] = 0.0  # a row of zeros (a padded position): its pre-activations are exactly 0
    relevances = {}
    for dtype in (torch.float32, torch.float16):
        model, leaf = net.to(dtype), x.to(dtype).requires_grad_(True)
        with PassRule().register(model[1]):
            out = model(leaf)
            relevances[dtype] = leaf * torch.autograd.grad(out, leaf, torch.ones_like(out))[0]
    assert torch.isfinite(relevances[torch.float16]).all()
    torch.testing.assert_close(relevances[torch.float16].float(), relevances[torch.float32], rtol=1e-2, atol=1e-2)


def test_the_pass_rule_in_float16_keeps_a_finite_relevance_with_its_graph():
    # The same 0 / 0 in a call that keeps the relevance's graph (create_graph=True), whose factor is computed apart.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6, bias=False), nn.GELU(), nn.Linear(6, 3, bias=False)).half()
    x = torch.randn(3, 4).half()
    x[0] = 0.0
    td = TensorDict(x=x.requires_grad_(True), batch_size=[3])
    relevance = LRP(net, AttnLRP(), in_keys=["x"], out_keys=["y"], create_graph=True)(td)["relevance", "x"]
    assert relevance.requires_grad and torch.isfinite(relevance).all()


@pytest.mark.parametrize(
    "activation",
    [nn.LeakyReLU(0.1), nn.PReLU(init=0.2), nn.RReLU().eval(), nn.ReLU()],
    ids=["LeakyReLU", "PReLU", "RReLU", "ReLU"],
)
@pytest.mark.parametrize("scale", [1.0, 1e-10, 1e-13])
def test_lrp0_through_a_positively_homogeneous_activation_is_gradient_times_input_at_any_scale(activation, scale):
    # f(x) / x = f'(x): the pass rule is the plain gradient there, with no stabiliser to move it off. Before, the
    # pass rule's own 1e-12 did: 0.13 off gradient × input (relative L2) at inputs of 1e-10, 0.62 at 1e-12, on a
    # leaky ReLU under BaseRuleMapper(stabilizer=0.0).
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 8, bias=False), activation, nn.Linear(8, 3, bias=False)).double()
    x = torch.randn(4, 5, dtype=torch.float64) * scale
    relevance = explain(net, x, rule_mapper=BaseRuleMapper(strict=True, stabilizer=0.0))["relevance", "x"]
    assert relative_error(relevance, gradient_times_input(net, x)) <= 1e-12
    assert torch.allclose(relevance.sum(1), net(x).max(1).values, rtol=1e-12, atol=0)


def _leave_marks(rule: EpsilonRule, layer: nn.Module, marks: bool) -> None:
    """Leave the layer's LayerCall marks (the redirect path) or not (as a context where no rule reads them)."""
    rule._registrations[layer].marks = marks


def _on_node(output: torch.Tensor) -> bool:
    """Whether the ε-rule changed the gradient on the layer's own node, not through a redirect of its own."""
    return "Redirect" not in type(output.grad_fn).__name__


class Sum(nn.Module):
    """A sum of two tensors, as a module a rule can be mapped to."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b


class TestClosedForms:
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

    def test_uniform_rule_gives_a_subnormal_input_its_half(self):
        # The half the rule sets at each input reaches it through the gradient R / x, which overflowed at a
        # subnormal input (1e-320): its relevance was NaN; it is now recorded whole, as at a zero input.
        a = torch.tensor([[1e-320, 0.0, -1.0]], dtype=torch.float64, requires_grad=True)
        b = torch.tensor([[3.0, 0.5, 4.0]], dtype=torch.float64, requires_grad=True)
        add, r_out = Sum(), torch.tensor([[1.0, -2.0, 3.0]], dtype=torch.float64)
        with UniformRule().register(add) as handle:
            z = add(a, b)
            ga, gb = torch.autograd.grad(z, (a, b), r_out / z.detach())
            records = handle.pop_records()
        extra = {id(t): rest for t, rest in records}
        torch.testing.assert_close(a.detach() * ga + extra[id(a)], r_out / 2)
        torch.testing.assert_close(b.detach() * gb + extra.get(id(b), 0), r_out / 2)

    def test_uniform_rule_on_a_sum_with_zeros_in_a_hidden_input_is_refused(self):
        """The half the uniform rule sets at a zero entry of an input is recorded, and the wrapper adds records to
        the explained inputs only: at a ReLU's output it was dropped, with no word (a bias-free model's relevance
        then summed to -0.137 for a logit of -0.119). Refused by name; a sum of two inputs the model reads as they
        are keeps all of it."""

        class Net(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.l1, self.l2 = nn.Linear(4, 6, bias=False), nn.Linear(4, 6, bias=False)
                self.l3, self.add = nn.Linear(6, 2, bias=False), Sum()

            def forward(self, x):
                return self.l3(self.add(torch.relu(self.l1(x)), self.l2(x)))

        torch.manual_seed(0)
        net, x = Net().double(), torch.randn(3, 4, dtype=torch.float64)
        mapper = {"add": UniformRule(), nn.Linear: EpsilonRule(1e-12)}
        lrp = LRP(net, mapper, in_keys=["x"], out_keys=["y"], target=0)
        with pytest.raises(ValueError, match=r"UniformRule on module 'add' \(Sum\) set relevance at entries .* 0"):
            lrp(TensorDict(x=x, batch_size=[3]))
        a, b = x.clone(), torch.randn(3, 4, dtype=torch.float64)
        a[:, 0] = 0.0
        add = LRP(Sum(), {"": UniformRule()}, in_keys=["a", "b"], out_keys=["y"], target=lambda y: y)
        out = add(TensorDict(a=a, b=b, batch_size=[3]))
        torch.testing.assert_close(out["relevance", "a"], (a + b) / 2, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out["relevance", "b"], (a + b) / 2, rtol=1e-12, atol=1e-12)

    @pytest.mark.parametrize("case", ["subnormal entries, carried", "small entries, overflowing"])
    def test_uniform_rule_in_float16_tells_carried_from_lost_by_the_gradient(self, case):
        """At a hidden input's float16-subnormal entries (2e-5) the gradient R / x carries the relevance and only
        rounding is recorded: such a call was refused as losing relevance. At small normal entries (1e-4) under a
        large relevance, R / x overflows and the whole relevance there is recorded: it was dropped, with no word.
        What the gradient did not carry decides, not the input's size."""

        class Net(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.l1, self.l2, self.head, self.add = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 2), Sum()

            def forward(self, x):
                return self.head(self.add(torch.tanh(self.l1(x)), torch.tanh(self.l2(x))))

        torch.manual_seed(0)
        net = Net()
        with torch.no_grad():  # three units of l1 near a constant, never 0
            net.l1.weight[:3] = 1e-6
            subnormal = case == "subnormal entries, carried"
            net.l1.bias[:3] = torch.tensor([3e-5, 1.7e-5, 4.4e-5] if subnormal else [1e-4, 2e-4, 1.5e-4])
            if not subnormal:
                net.head.weight.mul_(3000)
        net, x = net.half(), torch.randn(64, 4).half()
        lrp = LRP(net, {"add": UniformRule(), nn.Linear: EpsilonRule(1e-3)}, in_keys=["x"], out_keys=["y"], target=0)
        td = TensorDict(x=x, batch_size=[64])
        if subnormal:
            assert lrp(td)["relevance", "x"].isfinite().all()
        else:
            with pytest.raises(ValueError, match=r"UniformRule on module 'add' \(Sum\) set relevance at entries"):
                lrp(td)

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


class TestArguments:
    @pytest.mark.parametrize(
        ("make", "match"),
        [
            (lambda: EpsilonRule(epsilon=-1), "EpsilonRule: epsilon must be a finite number >= 0, got -1"),
            (lambda: EpsilonRule(epsilon=float("nan")), "EpsilonRule: epsilon must be a finite number"),
            (lambda: EpsilonRule(epsilon=float("inf")), "EpsilonRule: epsilon must be a finite number"),
            (lambda: EpsilonRule(epsilon="0.1"), "EpsilonRule: epsilon must be a finite number"),
            (lambda: UniformEpsilonRule(epsilon=-1e-6), "UniformEpsilonRule: epsilon must be"),
            (lambda: PassRule(stabilizer=-1e-12), "PassRule: stabilizer must be a finite number >= 0"),
        ],
    )
    def test_wrong_numbers_are_refused_at_construction(self, make, match: str):
        with pytest.raises(ValueError, match=match):
            make()

    @pytest.mark.parametrize("epsilon", [0, 0.0, 1e-9, 0.25, torch.tensor(0.5)])
    def test_legitimate_numbers_are_accepted(self, epsilon):
        assert EpsilonRule(epsilon=epsilon).epsilon is epsilon  # epsilon = 0 is LRP-0
        assert UniformEpsilonRule(epsilon=epsilon).epsilon is epsilon
        assert PassRule(stabilizer=epsilon).stabilizer is epsilon


class TestPassRuleOnLayers:
    """PassRule is for element-wise modules. A Linear or convolution layer whose output has its input's shape
    (``Linear(5, 5)``, a convolution with padding) mixes positions all the same: passing relevance through it
    unchanged ignored the weights (134-147 % off LRP-0 on these layers) where ``Linear(4, 5)``
    was refused. Both are refused now, naming the module; a per-channel scale (a depthwise 1×1 convolution) is
    element-wise and keeps the rule."""

    @pytest.mark.parametrize(
        "layer",
        [nn.Linear(5, 5), nn.Conv1d(4, 4, 3, padding=1), nn.Conv1d(4, 4, 1), nn.ConvTranspose1d(4, 4, 1)],
        ids=["linear", "conv3", "conv1x1", "convtranspose1x1"],
    )
    def test_a_layer_that_mixes_positions_is_refused_by_name(self, layer):
        from tensordict import TensorDict

        from tdhook.attribution import LRP

        model = nn.Sequential(layer, nn.ReLU(), nn.Flatten(), nn.LazyLinear(2)).double()
        x = torch.randn(3, 4, 5, dtype=torch.float64)
        model(x)
        lrp = LRP(model, {"0": PassRule()}, in_keys=["x"], out_keys=["y"])
        with pytest.raises(ValueError, match=rf"module '0' \({type(layer).__name__}\).*element-wise"):
            lrp(TensorDict(x=x, batch_size=[3]))

    def test_a_per_channel_scale_passes_relevance_on(self):
        layer = nn.Conv1d(4, 4, 1, groups=4, bias=False).double()
        x = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
        with PassRule().register(layer):
            z = layer(x)
            relevance = x * torch.autograd.grad(z, x, torch.ones_like(z))[0]
        torch.testing.assert_close(relevance, z.detach())


def _explainer(net: nn.Module, mapper):
    """An LRP wrapper on ``net`` that explains the first logit."""
    from tdhook.attribution import LRP

    first = lambda y: torch.zeros_like(y).index_fill_(1, torch.tensor([0]), 1.0) * y  # noqa: E731
    return LRP(net, rule_mapper=mapper, in_keys=["x"], out_keys=["y"], target=first)


def _relevance(lrp, x: torch.Tensor) -> torch.Tensor:
    from tensordict import TensorDict

    return lrp(TensorDict(x=x, batch_size=[x.shape[0]]))["relevance", "x"]


class TestPassRuleAtZeroInputs:
    """An activation with f(0) != 0 under the pass rule drops the relevance of its outputs at exactly-zero inputs
    (input x gradient is 0 there; zennit's Pass hands it to the layer before): the wrapper warns, naming it."""

    @pytest.mark.parametrize("activation", [nn.Sigmoid(), nn.Softplus(), nn.Hardsigmoid()], ids=type)
    def test_an_activation_behind_a_relu_warns_by_name_once(self, activation):
        from tdhook.attribution import EpsilonPlus

        net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), activation, nn.Linear(4, 2)).double()
        x = torch.randn(5, 3, dtype=torch.float64)
        mapper = EpsilonPlus()
        with pytest.warns(UserWarning, match=f"on {type(activation).__name__}: .* exactly 0") as caught:
            with _explainer(net, mapper) as lrp:
                for _ in range(3):  # the first call warns, later calls of the context do not check again
                    _relevance(lrp, x)
        assert sum("exactly 0" in str(w.message) for w in caught) == 1

    @pytest.mark.parametrize(
        "activations",
        [(nn.Sigmoid(),), (nn.ReLU(), nn.Tanh()), (nn.ReLU(), nn.SiLU()), (nn.ReLU(), nn.GELU())],
        ids=["sigmoid-on-nonzero", "relu-tanh", "relu-silu", "relu-gelu"],
    )
    def test_no_warning_without_the_pattern(self, activations):
        import warnings

        from zennit import composites as zcomposites

        from tdhook.attribution import EpsilonPlus

        net = nn.Sequential(nn.Linear(3, 4), *activations, nn.Linear(4, 2)).double().eval()
        x = torch.randn(5, 3, dtype=torch.float64)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with _explainer(net, EpsilonPlus()) as lrp:
                actual = _relevance(lrp, x)
                for _ in range(2):  # later calls of the context too
                    _relevance(lrp, x)
        with torch.no_grad():
            out = net(x)
        from zennit.attribution import Gradient

        with Gradient(model=net, composite=zcomposites.EpsilonPlus()) as attributor:
            _, expected = attributor(x.clone(), torch.zeros_like(out).index_fill_(1, torch.tensor([0]), 1.0) * out)
        assert relative_error(actual, expected) <= 1e-6
