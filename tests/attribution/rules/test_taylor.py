"""The Taylor rule against its formula, computed here with ``torch.func.jvp`` and ``torch.func.vjp`` in float64."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import LRP, EpsilonPlus
from tdhook.attribution.rules import EpsilonRule, TaylorDecompositionRule
from tests.conftest import relative_error

F64 = torch.float64
TOL = 1e-10


def taylor_formula(
    f: Callable, xs: list[torch.Tensor], refs: list[torch.Tensor], r_out: torch.Tensor, bias: bool, eps: float
) -> list[torch.Tensor]:
    """``x ⊙ J_f(ref)ᵀ (R / stabilize(z))``, with ``z = J_f(ref) x`` or ``f(x)``."""
    with torch.no_grad():
        out = f(*xs)
    _, linear_term = torch.func.jvp(f, tuple(refs), tuple(xs))
    z = out if bias else linear_term
    s = r_out / (z + eps * torch.where(z >= 0, 1.0, -1.0).to(z.dtype))  # sign(0) = 1
    _, vjp_fn = torch.func.vjp(f, *refs)
    return [x * v for x, v in zip(xs, vjp_fn(s), strict=True)]


def rule_relevance(rule, module, xs, grad_out):
    xs = [x.clone().requires_grad_(True) for x in xs]
    with rule.register(module):
        out = module(*xs)
        grads = torch.autograd.grad(out, xs, grad_out)
    return [x.detach() * g for x, g in zip(xs, grads, strict=True)], out.detach() * grad_out


class Bilinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.map = nn.Bilinear(3, 4, 2)
        self.act = nn.Softplus()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.act(self.map(a, b))


class GatedResidual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.value = nn.Linear(4, 5)
        self.gate = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.value(x)
        return h * torch.sigmoid(self.gate(x)) + h


def mlp_block() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3), nn.Sigmoid()).to(F64)


class TestFormula:
    @pytest.mark.parametrize("bias", [False, True])
    @pytest.mark.parametrize("batch", [(5,), (2, 3)])
    @pytest.mark.parametrize("ref", [0.3, "tensor"])
    def test_mlp_block(self, bias, batch, ref):
        torch.manual_seed(0)
        block = mlp_block()
        x = torch.randn(*batch, 4, dtype=F64)
        ref_value = torch.randn(4, dtype=F64) if ref == "tensor" else ref
        out = block(x).detach()
        grad_out = torch.randn_like(out)
        actual, r_out = rule_relevance(TaylorDecompositionRule(ref=ref_value, bias=bias), block, [x], grad_out)
        ref_tensor = torch.as_tensor(ref_value, dtype=F64).expand_as(x).clone()
        (expected,) = taylor_formula(block, [x], [ref_tensor], r_out, bias, 1e-6)
        assert relative_error(actual[0], expected) <= TOL

    @pytest.mark.parametrize("bias", [False, True])
    def test_convolution_block_with_a_reference_image(self, bias):
        torch.manual_seed(6)
        block = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.GELU(), nn.Conv2d(3, 2, 3), nn.Softplus()).to(F64)
        x = torch.randn(2, 2, 6, 6, dtype=F64)
        ref = torch.randn(1, 2, 6, 6, dtype=F64)  # one reference image, broadcast over the batch
        grad_out = torch.randn_like(block(x).detach())
        actual, r_out = rule_relevance(TaylorDecompositionRule(ref=ref, bias=bias), block, [x], grad_out)
        (expected,) = taylor_formula(block, [x], [ref.expand_as(x).clone()], r_out, bias, 1e-6)
        assert relative_error(actual[0], expected) <= TOL

    def test_the_relevance_keeps_its_graph_with_create_graph(self):
        torch.manual_seed(7)
        block = mlp_block()
        x = torch.randn(3, 4, dtype=F64, requires_grad=True)
        with TaylorDecompositionRule(ref=0.2, bias=True).register(block):
            out = block(x)
            (grad,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        (weight_grad,) = torch.autograd.grad((x * grad).sum(), block[0].weight)
        assert weight_grad.abs().sum() > 0  # differentiable through the Jacobian at the reference

    @pytest.mark.parametrize("bias", [False, True])
    def test_bilinear_two_inputs_each_with_its_reference(self, bias):
        torch.manual_seed(1)
        module = Bilinear().to(F64)
        a, b = torch.randn(6, 3, dtype=F64), torch.randn(6, 4, dtype=F64)
        refs = [torch.randn(3, dtype=F64), -0.5]
        grad_out = torch.randn(6, 2, dtype=F64)
        rule = TaylorDecompositionRule(ref=refs, bias=bias, epsilon=1e-3)
        actual, r_out = rule_relevance(rule, module, [a, b], grad_out)
        ref_tensors = [refs[0].expand_as(a).clone(), torch.full_like(b, -0.5)]
        expected = taylor_formula(module, [a, b], ref_tensors, r_out, bias, 1e-3)
        for got, want in zip(actual, expected, strict=True):
            assert relative_error(got, want) <= TOL

    def test_an_input_that_needs_no_grad_is_held_constant(self):
        torch.manual_seed(2)
        module = Bilinear().to(F64)
        a, b = torch.randn(6, 3, dtype=F64, requires_grad=True), torch.randn(6, 4, dtype=F64)
        with TaylorDecompositionRule(ref=0.25).register(module):
            out = module(a, b)
            (grad,) = torch.autograd.grad(out.sum(), a)
        ref = [torch.full_like(a, 0.25)]
        expected = taylor_formula(lambda a_: module(a_, b), [a.detach()], ref, out.detach(), False, 1e-6)
        assert relative_error(a.detach() * grad, expected[0]) <= TOL

    @pytest.mark.parametrize("ref", [0.0, 0.7])
    def test_linear_without_bias_is_the_epsilon_rule_with_the_bias_zeroed(self, ref):
        torch.manual_seed(3)
        layer = nn.Linear(5, 4).to(F64)
        with torch.no_grad():
            layer.bias.zero_()
        x = torch.randn(7, 5, dtype=F64)
        grad_out = torch.randn(7, 4, dtype=F64)
        taylor, _ = rule_relevance(TaylorDecompositionRule(ref=ref, epsilon=0.1), layer, [x], grad_out)
        epsilon, _ = rule_relevance(EpsilonRule(epsilon=0.1), layer, [x], grad_out)
        assert relative_error(taylor[0], epsilon[0]) <= TOL

    def test_distribute_bias_gives_the_relevance(self):
        torch.manual_seed(4)
        block = mlp_block()
        x = torch.randn(5, 4, dtype=F64)
        grad_out = torch.randn(5, 3, dtype=F64)

        def spread_the_rest(inputs, relevances):
            # the output relevance the inputs did not receive, spread evenly over their features
            (r,) = relevances
            rest = r_out.sum(-1, keepdim=True) - r.sum(-1, keepdim=True)
            return [r + rest / r.shape[-1]]

        with torch.no_grad():
            r_out = block(x) * grad_out
        rule = TaylorDecompositionRule(ref=0.1, bias=True, distribute_bias=spread_the_rest)
        (actual,), _ = rule_relevance(rule, block, [x], grad_out)
        (plain,) = taylor_formula(block, [x], [torch.full_like(x, 0.1)], r_out, True, 1e-6)
        assert relative_error(actual, spread_the_rest((x,), [plain])[0]) <= TOL
        assert relative_error(actual.sum(-1), r_out.sum(-1)) <= TOL


class TestInTheWrapper:
    @pytest.mark.parametrize("key", ["by-type", "by-name"])
    def test_mapped_on_a_block_whose_children_have_rules(self, key):
        torch.manual_seed(5)

        class Block(nn.Sequential):
            pass

        block = Block(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Softplus())
        net = nn.Sequential(block, nn.Linear(6, 3)).to(F64)
        rule = TaylorDecompositionRule(ref=-0.2, bias=True)
        mapper = {Block: rule} if key == "by-type" else {"module.0": rule}  # names are relative to the policy
        policy = TensorDictModule(net, in_keys=["observation"], out_keys=["action_value"])
        obs = torch.randn(4, 4, dtype=F64)
        td = LRP(policy, rule_mapper=mapper, target=1)(TensorDict(observation=obs, batch_size=[4]))
        with torch.no_grad():
            hidden = block(obs)
            r_hidden = hidden * net[1].weight[1]  # the last Linear has the plain gradient (LRP-0)
        (expected,) = taylor_formula(block, [obs], [torch.full_like(obs, -0.2)], r_hidden, True, 1e-6)
        assert relative_error(td["relevance", "observation"], expected) <= TOL

    @pytest.mark.parametrize("inner", ["layer-norm", "batch-norm", "gate-and-residual"])
    @pytest.mark.parametrize("mapper", ["default", "EpsilonPlus(stabilize_additions=True)"])
    @pytest.mark.parametrize("bias", [False, True])
    def test_the_jacobian_at_the_reference_is_the_plain_one_whatever_runs_inside(self, inner, mapper, bias):
        # the norms' rules, the held gates and the stabilised sums change the gradient of what they cover: none of
        # them may act in the evaluation at the reference (they made J_f(ref) off by up to 200 %, or raised)
        torch.manual_seed(9)
        block = {
            "layer-norm": lambda: nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Tanh()),
            "batch-norm": lambda: nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Tanh()),
            "gate-and-residual": GatedResidual,
        }[inner]()
        net = nn.Sequential(block, nn.Linear(5, 3)).to(F64).eval()
        if inner == "batch-norm":
            with torch.no_grad():
                block[1].running_var.uniform_(0.5, 2.0)
                block[1].running_mean.normal_()
        rule = TaylorDecompositionRule(ref=0.3, bias=bias)
        rule_mapper = {"module.0": rule}
        if mapper != "default":
            rule_mapper = EpsilonPlus(epsilon=0.0, stabilize_additions=True, rule_mapper=rule_mapper)
        policy = TensorDictModule(net, in_keys=["observation"], out_keys=["action_value"])
        obs = torch.randn(4, 4, dtype=F64)
        td = LRP(policy, rule_mapper=rule_mapper, target=1)(TensorDict(observation=obs, batch_size=[4]))
        with torch.no_grad():
            r_hidden = block(obs) * net[1].weight[1]
        (expected,) = taylor_formula(block, [obs], [torch.full_like(obs, 0.3)], r_hidden, bias, 1e-6)
        assert relative_error(td["relevance", "observation"], expected) <= 1e-9


class TestArguments:
    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"epsilon": -1.0}, "epsilon"),
            ({"distribute_bias": lambda i, r: r}, "distribute_bias"),
            ({"bias": True, "distribute_bias": 3}, "distribute_bias"),
            ({"ref": float("nan")}, "ref"),
            ({"bias": 1}, "bias"),
        ],
    )
    def test_bad_arguments_are_named(self, kwargs, message):
        with pytest.raises(ValueError, match=message):
            TaylorDecompositionRule(**kwargs)

    def test_one_reference_per_input(self):
        module = Bilinear().to(F64)
        a = torch.randn(2, 3, dtype=F64, requires_grad=True)
        b = torch.randn(2, 4, dtype=F64, requires_grad=True)
        with TaylorDecompositionRule(ref=[0.0]).register(module), pytest.raises(ValueError, match="one reference"):
            module(a, b)

    def test_reference_must_broadcast(self):
        block = mlp_block()
        x = torch.randn(2, 4, dtype=F64, requires_grad=True)
        with TaylorDecompositionRule(ref=torch.zeros(3, dtype=F64)).register(block):
            with pytest.raises(ValueError, match="does not broadcast"):
                block(x)


class TestTheModelIsLeftAsItIs:
    @pytest.mark.parametrize("bias", [False, True])
    def test_the_evaluation_at_the_reference_does_not_move_batch_norm_statistics(self, bias):
        # in training mode a BatchNorm's forward updates its running statistics; the rule's extra evaluation at the
        # reference must not add an update of its own (towards the statistics of a batch of references)
        torch.manual_seed(8)
        block = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh()).to(F64).train()
        plain = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh()).to(F64).train()
        plain.load_state_dict(block.state_dict())
        x = torch.randn(5, 4, dtype=F64)
        rule_relevance(TaylorDecompositionRule(ref=0.3, bias=bias), block, [x], torch.ones(5, 6, dtype=F64))
        plain(x)  # the one update the module's own forward makes
        for name, buffer in plain.named_buffers():
            assert torch.equal(block.get_buffer(name), buffer), name


class TestRefused:
    def test_a_module_with_several_outputs_is_refused(self):
        # the rule explains one output tensor; on a module returning a tuple it used to be skipped, silently
        class Pair(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.layer = nn.Linear(4, 4)

            def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                h = self.layer(x)
                return h, torch.tanh(h)

        pair = Pair().to(F64)
        x = torch.randn(2, 4, dtype=F64, requires_grad=True)
        with TaylorDecompositionRule(ref=0.1).register(pair):
            with pytest.raises(ValueError, match=r"TaylorDecompositionRule on Pair: .*tuple"):
                pair(x)

    @pytest.mark.parametrize("in_context", [False, True], ids=["one-call", "in-context"])
    def test_distribute_bias_returning_a_relevance_too_many_is_named_and_leaves_all_as_it_was(self, in_context):
        torch.manual_seed(3)
        net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(F64)
        net[0].weight.grad = torch.ones_like(net[0].weight)
        faults = [True]

        def spread(inputs, relevances):  # one relevance too many on its first call only
            if faults:
                faults.pop()
                return [*relevances, relevances[0]]
            return list(relevances)

        def wrapper(distribute_bias) -> LRP:
            rule = TaylorDecompositionRule(ref=0.1, bias=True, distribute_bias=distribute_bias)
            return LRP(TensorDictModule(net, ["x"], ["y"]), rule_mapper={"module.1": rule, nn.Linear: EpsilonRule()})

        lrp, x = wrapper(spread), torch.randn(5, 4, dtype=F64)
        state = {k: v.clone() for k, v in net.state_dict().items()}
        grad, hooks = net[0].weight.grad, [(dict(m._forward_hooks), dict(m._forward_pre_hooks)) for m in net.modules()]
        td = TensorDict(x=x, batch_size=[5])
        with lrp if in_context else contextlib.nullcontext():
            with pytest.raises(ValueError, match=r"TaylorDecompositionRule on Tanh: distribute_bias returned 2 "):
                lrp(td)
            assert list(td.keys(True, True)) == ["x"] and td["x"] is x
            after = lrp(TensorDict(x=x, batch_size=[5]))["relevance", "x"]
        assert all(torch.equal(net.state_dict()[k], v) for k, v in state.items())
        assert net[0].weight.grad is grad and bool((grad == 1).all()) and net.training
        assert [(dict(m._forward_hooks), dict(m._forward_pre_hooks)) for m in net.modules()] == hooks
        expected = wrapper(lambda inputs, relevances: list(relevances))(TensorDict(x=x, batch_size=[5]))
        assert relative_error(after, expected["relevance", "x"]) <= TOL

    def test_a_module_without_forward_mode_derivatives_is_named_with_bias_false(self):
        class Distances(nn.Module):  # torch.cdist has no forward-mode derivative
            def __init__(self) -> None:
                super().__init__()
                self.centres = nn.Parameter(torch.randn(3, 4, dtype=F64))

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return torch.cdist(x, self.centres)

        module, x = Distances(), torch.randn(2, 4, dtype=F64, requires_grad=True)
        with TaylorDecompositionRule(ref=0.1).register(module):
            with pytest.raises(NotImplementedError, match=r"TaylorDecompositionRule on Distances: .*bias=True"):
                module(x)
        with TaylorDecompositionRule(ref=0.1, bias=True).register(module):
            (grad,) = torch.autograd.grad(module(x).sum(), x)
        assert torch.isfinite(grad).all()


def test_the_first_forward_mode_call_of_a_process_raises_no_warning_from_torch():
    """A fresh process with warnings as errors: torch's loading of its forward-mode decompositions warns
    (torch.jit.script is deprecated), which must not reach the caller of the rule."""
    code = (
        "import torch; from torch import nn; from tdhook.attribution.rules import TaylorDecompositionRule\n"
        "block = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))\n"
        "x = torch.randn(5, 3, requires_grad=True)\n"
        "with TaylorDecompositionRule(ref=0.5).register(block):\n"
        "    torch.autograd.grad(block(x)[:, 0].sum(), x)\n"
    )
    run = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


class _Scaled(nn.Module):
    """A block its parent calls with a keyword: ``block(x, scale=0.5)``."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.out = nn.Linear(4, 3), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, shift: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
        h = self.inner(x) * scale
        return self.out(torch.tanh(h if shift is None else h + shift))


class _CallsByKeyword(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block, self.head = _Scaled(), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x, scale=0.5))


class TestCalledByKeyword:
    @pytest.mark.parametrize("bias", [False, True])
    def test_the_evaluation_at_the_reference_gets_the_arguments_by_keyword(self, bias):
        """``block(x, scale=0.5)`` was evaluated at the reference as ``block(ref, 0.5)``: the scale taken for the
        shift, the Jacobian another function's (0.94 off the formula with bias=False, 0.35 with bias=True)."""
        torch.manual_seed(1)
        net = _CallsByKeyword().to(F64)
        x = torch.randn(5, 4, dtype=F64)
        mapper = {"block": TaylorDecompositionRule(ref=0.2, bias=bias), "head": EpsilonRule(0.0)}
        actual = LRP(net, mapper, in_keys=["x"], out_keys=["y"], target=0)(TensorDict(x=x, batch_size=[5]))
        with torch.no_grad():
            r_out = net.block(x, scale=0.5) * net.head.weight[0]
        block = lambda v: net.block(v, scale=0.5)  # noqa: E731
        (expected,) = taylor_formula(block, [x], [torch.full_like(x, 0.2)], r_out, bias, 1e-6)
        assert relative_error(actual["relevance", "x"], expected) <= TOL


def _finite_difference_check(block: nn.Module, parameter: torch.Tensor) -> tuple[float, float]:
    """The derivative of a weighted sum of the input relevance (Taylor with bias=False on ``block``, create_graph)
    along a random direction of ``parameter``, and its central finite difference over fresh calls."""
    net = nn.Sequential(block, nn.Linear(6, 3)).to(F64)
    x = torch.randn(4, 4, dtype=F64, generator=torch.Generator().manual_seed(3))
    w = torch.randn(4, 4, dtype=F64, generator=torch.Generator().manual_seed(4))

    def loss(create_graph: bool) -> torch.Tensor:
        mapper = {"0": TaylorDecompositionRule(ref=0.2, bias=False), "1": EpsilonRule(0.1)}
        lrp = LRP(net, mapper, in_keys=["x"], out_keys=["y"], create_graph=create_graph, target=0)
        return (lrp(TensorDict(x=x.clone(), batch_size=[4]))["relevance", "x"] * w).sum()

    (grad,) = torch.autograd.grad(loss(True), [parameter])
    direction = torch.randn(parameter.shape, dtype=F64, generator=torch.Generator().manual_seed(5))
    step, values = 1e-6, []
    for shift in (step, -2 * step):
        with torch.no_grad():
            parameter.add_(shift * direction)
        values.append(loss(False).item())
    with torch.no_grad():
        parameter.add_(step * direction)  # back where it was
    return (grad * direction).sum().item(), (values[0] - values[1]) / (2 * step)


class TestDerivativeOfTheLinearTerm:
    @pytest.mark.parametrize("inside", ["layer_norm", "softmax", "log_softmax", "rms_norm"])
    def test_the_relevances_derivative_equals_finite_differences(self, inside):
        """With bias=False the derivative went through the forward-mode tangent ``J_f(ref) · x``, whose own
        derivative torch gets wrong for ``layer_norm`` (6.9 % to 87 % off) and cannot take for a softmax (raised)."""
        torch.manual_seed(2)
        last = {"layer_norm": nn.LayerNorm(6), "softmax": nn.Softmax(-1), "log_softmax": nn.LogSoftmax(-1)}
        block = nn.Sequential(nn.Linear(4, 6), last.get(inside, nn.RMSNorm(6)), nn.Tanh()).to(F64)
        if inside == "layer_norm":
            with torch.no_grad():
                block[1].weight.normal_(), block[1].bias.normal_()
        analytic, finite = _finite_difference_check(block, block[0].weight)
        assert abs(analytic - finite) <= 1e-6 * max(1.0, abs(finite))


def test_epsilon_zero_takes_a_zero_share_for_a_zero_output():
    """ε = 0 divided 0 by 0 where the block's output is 0 (a ReLU at its end): every relevance NaN, no word. A zero
    share there, as the ε-rule takes 0 / 0, is the limit as ε goes to 0."""
    torch.manual_seed(3)
    block = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).to(F64)
    x = torch.randn(3, 4, dtype=F64)
    grad_out = torch.ones(3, 4, dtype=F64)
    actual, _ = rule_relevance(TaylorDecompositionRule(ref=0.1, bias=True, epsilon=0.0), block, [x], grad_out)
    limit, _ = rule_relevance(TaylorDecompositionRule(ref=0.1, bias=True, epsilon=1e-200), block, [x], grad_out)
    assert bool((block(x) == 0).any()) and torch.isfinite(actual[0]).all()
    assert relative_error(actual[0], limit[0]) <= 1e-12


@pytest.mark.parametrize(
    ("returned", "named"),
    [(lambda xs, rs: [r[:, :2] for r in rs], r"returned \(3, 2\)"), (lambda xs, rs: [1.0], "returned float"),
     (lambda xs, rs: [r[0] for r in rs], r"returned \(4,\)")],
    ids=["too-few-features", "a-number", "one-row"],
)  # fmt: skip
def test_distribute_bias_returning_another_shape_is_named(returned, named):
    block = nn.Sequential(nn.Linear(4, 4), nn.Tanh()).to(F64)
    x = torch.randn(3, 4, dtype=F64, requires_grad=True)
    rule = TaylorDecompositionRule(ref=0.1, bias=True, distribute_bias=returned)
    with rule.register(block), pytest.raises(ValueError, match=rf"distribute_bias {named} for an input of shape"):
        torch.autograd.grad(block(x).sum(), x)
