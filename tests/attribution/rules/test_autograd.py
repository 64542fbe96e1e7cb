"""The autograd functions behind every rule: a second backward pass over a freed graph."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tdhook.attribution.rules.input_layer import FlatRule
from tests.attribution.rules._helpers import make_layer


class TestFastPaths:
    """The paths that skip autograd or a product, each checked against zennit and shown to be taken."""

    def test_a_second_backward_over_a_freed_graph_raises_torchs_error(self):
        # The first backward may have written into what the rule saved: a second one must not read it.
        layer, x = make_layer("linear")
        x = x.abs().requires_grad_(True)
        with FlatRule().register(layer):
            out = layer(x)
            torch.autograd.grad(out, x, torch.ones_like(out))
            with pytest.raises(RuntimeError, match="backward through the graph a second time"):
                torch.autograd.grad(out, x, torch.ones_like(out))


class TestKeepingGraph:
    """In a call that keeps the graph, ``hold``, ``scale_gradient`` and ``redirect`` change the gradient in the
    relevance pass only; every other pass gets the plain one."""

    def test_hold_and_scale_gradient(self):
        from tdhook.attribution.rules import hold, scale_gradient
        from tdhook.attribution.rules._autograd import is_activation
        from tdhook.attribution.rules._keeping_graph import keeping_graph

        x = torch.tensor([1.5, -2.0], dtype=torch.float64, requires_grad=True)
        with keeping_graph() as relevance_pass:
            gate = torch.sigmoid(x * 1)
            held = hold(gate)
            y = scale_gradient(x * 1, 0.5) * held
        assert held.requires_grad and not is_activation(held)
        with relevance_pass.running():  # half of the gradient, the gate held: 0.5 · gate
            (relevance_grad,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        assert torch.allclose(relevance_grad, 0.5 * gate)
        (plain,) = torch.autograd.grad(y.sum(), x, retain_graph=True)  # the plain product's gradient
        assert torch.allclose(plain, gate + x * gate * (1 - gate))
        # The relevance pass's gradient keeps the gate's derivative: d(0.5 · sigmoid(x)) / dx.
        (second,) = torch.autograd.grad(relevance_grad.sum(), x)
        assert torch.allclose(second, 0.5 * gate * (1 - gate))

    def test_relevance_pass_edges_leave_the_plain_output_out(self):
        from tdhook.attribution.rules import hold, redirect
        from tdhook.attribution.rules._autograd import relevance_pass_edges
        from tdhook.attribution.rules._keeping_graph import keeping_graph

        x = torch.ones(2, requires_grad=True)
        with keeping_graph():
            inner = x * 2
            out = redirect(x.exp(), [inner], lambda grad: [grad])
            held = hold(x.exp())
        assert relevance_pass_edges(out.grad_fn) == [inner.grad_fn]
        assert relevance_pass_edges(held.grad_fn) == []
        assert len([n for n, _ in out.grad_fn.next_functions if n is not None]) == 2  # the plain edge is there


class TestRedirectToTheOutput:
    @pytest.mark.parametrize("function", [torch.tanh, torch.sigmoid, torch.exp, lambda t: t.softmax(-1)])
    def test_a_module_whose_backward_saves_its_output(self, function):
        # the ε-rule sends its gradient on to the module's own output; marking an alias of it dirty raised the
        # version of the output that the module's backward had saved (torch's in-place modification error)
        from tdhook.attribution.rules import EpsilonRule

        class Activation(torch.nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return function(x)

        module, x = Activation(), torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
        with EpsilonRule(epsilon=0.1).register(module):
            out = module(x)
            (grad,) = torch.autograd.grad(out, x, torch.ones_like(out))
        y = x.detach().clone().requires_grad_(True)
        z = function(y)
        (expected,) = torch.autograd.grad(z, y, z.detach() / (z.detach() + 0.1 * z.detach().sign()))
        assert torch.allclose(grad, expected, rtol=1e-12, atol=0)


class TestCallsUnderTorchFuncTransforms:
    """Under ``torch.vmap`` tensors report no gradient, so the function rules (and the coverage watch) saw no
    activation and left the call its plain gradient, silently: a vmapped attention was 121 % off under AttnLRP
    and 46 % under CP-LRP, a vmapped sigmoid gate 9.8 % off under EpsilonPlus. Such a call is refused naming the
    module; one the rules would not change (a linear map under vmap) runs as before."""

    @staticmethod
    def attend(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2), -1) @ v

    @staticmethod
    def gate(h, g):
        return h * torch.sigmoid(g)

    def models(self, vmapped: bool):
        from torch import nn

        attend, gate = self.attend, self.gate

        class Attention(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.q, self.k, self.v, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)

            def forward(self, x):
                q, k, v = self.q(x), self.k(x), self.v(x)
                return self.head((torch.vmap(attend) if vmapped else attend)(q, k, v).mean(1))

        class Gated(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.fc, self.g, self.head = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)

            def forward(self, x):
                h = torch.relu(self.fc(x))
                return self.head((torch.vmap(gate) if vmapped else gate)(h, self.g(h)))

        torch.manual_seed(0)
        return Attention().double(), Gated().double()

    @pytest.mark.parametrize("preset", ["AttnLRP", "CPLRP", "EpsilonPlus"])
    def test_refused_naming_the_module(self, preset: str):
        from tensordict import TensorDict

        from tdhook.attribution import LRP
        from tdhook.attribution.lrp_helpers.rules import CPLRP, AttnLRP, EpsilonPlus
        from tests.attribution.test_lrp_reliability import assert_model_unchanged, model_snapshot

        mapper = {"AttnLRP": AttnLRP, "CPLRP": CPLRP, "EpsilonPlus": EpsilonPlus}[preset]()
        attention, gated = self.models(vmapped=True)
        model, x = (gated, torch.randn(4, 6)) if preset == "EpsilonPlus" else (attention, torch.randn(2, 5, 8))
        before = model_snapshot(model)
        lrp = LRP(model, mapper, in_keys=["x"], out_keys=["y"])
        refused = r"module (Attention|Gated) runs under torch.vmap .* would be the plain gradient"
        with pytest.raises(RuntimeError, match=refused):
            lrp(TensorDict(x=x.double(), batch_size=x.shape[:1]))
        assert_model_unchanged(model, before)

    def test_a_linear_map_under_vmap_is_not_refused(self):
        from tensordict import TensorDict
        from torch import nn

        from tdhook.attribution import LRP
        from tdhook.attribution.lrp_helpers.rules import AttnLRP

        class Scaled(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.fc, self.w = nn.Linear(4, 4), nn.Parameter(torch.randn(4, 2))

            def forward(self, x):
                return torch.vmap(lambda h: h @ self.w)(self.fc(x))

        model = Scaled().double()
        x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
        relevance = LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"])(TensorDict(x=x.detach(), batch_size=[3]))[
            "relevance", "x"
        ]
        out = model(x)
        expected = x * torch.autograd.grad(out.max(-1).values.sum(), x)[0]  # LRP-0: gradient x input
        torch.testing.assert_close(relevance, expected.detach(), rtol=1e-10, atol=1e-12)


class TestParameterDerivedThroughTemplates:
    """A scalar computed from parameters and cast to an activation's dtype (``lam.type_as(q)``, as timm's
    ``DiffAttention`` does) is still a parameter: a product with it is a linear map, not a product of two
    activations. Before, the cast's template argument (an activation) made it one: CP-LRP then split ``attn @ v``
    uniformly, and the attention half was lost, 0.5 of the logit with no warning."""

    def test_a_parameter_scalar_cast_to_an_activations_dtype_stays_a_parameter(self):
        from tdhook.attribution.rules._autograd import is_activation, mark_parameter_derived

        weights = nn.Parameter(torch.tensor([0.3, 0.4], dtype=torch.float64))
        lam = mark_parameter_derived((weights,), weights.sum().float())
        assert not is_activation(lam)
        q = torch.ones(2, dtype=torch.float64, requires_grad=True) * 1
        assert not is_activation(mark_parameter_derived((lam, q), lam.type_as(q), torch.Tensor.type_as))
        assert is_activation(mark_parameter_derived((lam, q), lam * q, torch.Tensor.__mul__))

    @pytest.mark.parametrize("fused", [True, False], ids=["sdpa", "softmax"])
    def test_cplrp_conserves_on_a_differential_attention(self, fused: bool):
        from tensordict import TensorDict

        from tdhook.attribution import CPLRP, LRP

        diff_attention = pytest.importorskip("timm.layers.diff_attention")

        class Head(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.attn = diff_attention.DiffAttention(16, num_heads=2, depth=1, proj_bias=False)
                self.attn.fused_attn = fused
                self.head = nn.Linear(16 * 5, 1, bias=False)

            def forward(self, x):
                return self.head(self.attn(x).flatten(1))

        torch.manual_seed(0)
        model = Head().double().eval()
        with torch.no_grad():
            for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                getattr(model.attn, name).normal_(0, 0.5)
        x = torch.randn(2, 5, 16, dtype=torch.float64)
        td = LRP(model, CPLRP(), in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[2]))
        ratios = td["relevance", "x"].flatten(1).sum(1) / td["y"].squeeze(-1)
        torch.testing.assert_close(ratios, torch.ones(2, dtype=torch.float64), rtol=0, atol=1e-10)


class TestParameterDerivedThroughBroadcasts:
    """``torch.broadcast_tensors(h, w)`` (and ``torch.atleast_2d(h, w)``, or of the tuple or list ``(h, w)``) of an
    activation and a parameter returns each made of its own argument: the parameter broadcast is still a parameter,
    and ``h * w`` a linear map of ``h``. Before, the activation among the arguments made both activations: AttnLRP
    and CP-LRP split the product uniformly, and half of the logit was lost, with no warning."""

    @pytest.mark.parametrize("preset", ["AttnLRP", "CPLRP"])
    @pytest.mark.parametrize(
        "how", ["broadcast_tensors", "atleast_2d", "atleast_2d of a tuple", "atleast_3d of a list"]
    )
    def test_a_product_with_a_broadcast_parameter_is_gradient_times_input(self, how: str, preset: str):
        from tensordict import TensorDict

        import tdhook.attribution as attribution

        class Weighted(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.encoder = nn.Sequential(nn.Linear(5, 6, bias=False), nn.ReLU())
                self.w = nn.Parameter(torch.randn(6))

            def forward(self, x):
                h = self.encoder(x)
                if how == "broadcast_tensors":
                    h, w = torch.broadcast_tensors(h, self.w)
                elif how == "atleast_2d":
                    h, w = torch.atleast_2d(h, self.w)
                elif how == "atleast_2d of a tuple":
                    h, w = torch.atleast_2d((h, self.w))
                else:
                    h, w = torch.atleast_3d([h, self.w])
                return (h * w).sum(-1, keepdim=True)

        torch.manual_seed(0)
        model = Weighted().double()
        x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
        lrp = attribution.LRP(model, getattr(attribution, preset)(), in_keys=["x"], out_keys=["y"])
        with lrp:  # the first call, and later ones (which may run without the function mode)
            results = [lrp(TensorDict(x=x.detach(), batch_size=[3]))["relevance", "x"] for _ in range(2)]
        expected = x * torch.autograd.grad(model(x).sum(), x)[0]  # linear in x past the ReLU: gradient x input
        for relevance in results:
            torch.testing.assert_close(relevance, expected.detach(), rtol=1e-10, atol=1e-12)
