"""Differentiable relevance: ``LRP(..., create_graph=True)`` and ``lrp.inactive()``.

The oracles, in float64: central finite differences of the relevance (the
ordinary, first-order call) with respect to the input and to every parameter,
at points away from kinks; zennit's second-order gradient with respect to the
input; and, for LRP-0 on a ReLU network, autograd's double backward of
``x ⊙ ∇f(x)``.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.mappers.base import BaseRuleMapper
from tdhook.attribution.mappers.presets import EpsilonGammaBox, EpsilonPlus, EpsilonPlusFlat
from tests.conftest import relative_error

EPSILON = 0.1  # large enough that the ε-rule's gradient differs from the plain one beyond the tolerances
PRESETS = {
    "EpsilonPlus": lambda: EpsilonPlus(epsilon=EPSILON),
    "EpsilonPlusFlat": lambda: EpsilonPlusFlat(epsilon=EPSILON),
    "EpsilonGammaBox": lambda: EpsilonGammaBox(low=-3.0, high=3.0, epsilon=EPSILON),
}


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 6), nn.ReLU(), nn.Linear(6, 3)).double()


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(3, 4, 3, stride=2),
        nn.ReLU(),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(4, 3),
    ).double()


def cnn_with_batch_norm() -> nn.Module:
    """BatchNorm in eval mode after each convolution (merged into it), with statistics of their own."""
    net = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.BatchNorm2d(3),
        nn.ReLU(),
        nn.Conv2d(3, 4, 3, stride=2),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16, 3),
    ).double()
    for norm in (net[1], net[4]):
        with torch.no_grad():
            norm.running_mean.uniform_(-0.5, 0.5)
            norm.running_var.uniform_(0.5, 2.0)
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.3, 0.3)
    return net.eval()


MODELS = {"mlp": (mlp, (4, 5)), "cnn": (cnn, (2, 2, 6, 6)), "cnn+bn": (cnn_with_batch_norm, (2, 2, 6, 6))}


def smooth_point(name: str, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    """A model and an input (in [-3, 3], no zeros) whose layer outputs all keep away from 0: no kink within reach
    of the finite differences."""
    make, shape = MODELS[name]
    for attempt in range(200):
        torch.manual_seed(seed + attempt)
        net, x = make(), torch.randn(*shape, dtype=torch.float64).clamp(-2.9, 2.9)
        if margin(net, x) > 1e-3 and x.abs().min() > 1e-3:
            return net, x
    raise AssertionError("no point away from kinks")


def margin(net: nn.Module, x: torch.Tensor) -> float:
    """The smallest absolute output of a Linear or convolution layer (the ReLU kinks and the sign switches)."""
    outputs = []
    hooks = [
        m.register_forward_hook(lambda m, a, out: outputs.append(out.abs().min()))
        for m in net.modules()
        if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.BatchNorm2d))
    ]
    with torch.no_grad():
        net(x)
    for hook in hooks:
        hook.remove()
    return min(o.item() for o in outputs)


def relevance(lrp: LRP, x: torch.Tensor) -> torch.Tensor:
    return lrp(TensorDict(x=x, batch_size=x.shape[:1]))["relevance", "x"]


def finite_differences(net: nn.Module, mapper, x: torch.Tensor, weights: torch.Tensor, step: float = 1e-6):
    """Central differences of ``(relevance · weights).sum()`` with respect to ``x`` and to every parameter."""
    lrp = LRP(net, mapper, in_keys=["x"], out_keys=["y"])

    def loss(value: torch.Tensor) -> float:
        return (relevance(lrp, value) * weights).sum().item()

    def central(tensor: torch.Tensor, evaluate) -> torch.Tensor:
        result = torch.zeros_like(tensor)
        flat = tensor.detach().view(-1)
        for i in range(flat.numel()):
            with torch.no_grad():
                flat[i] += step
            up = evaluate()
            with torch.no_grad():
                flat[i] -= 2 * step
            down = evaluate()
            with torch.no_grad():
                flat[i] += step
            result.view(-1)[i] = (up - down) / (2 * step)
        return result

    with lrp:  # parameter writes are seen by the rules (their fingerprint changes)
        point = x.clone()
        by_input = central(point, lambda: loss(point))
        by_params = [central(p, lambda: loss(x)) for p in net.parameters()]
    return by_input, by_params


def second_order(net: nn.Module, mapper, x: torch.Tensor, weights: torch.Tensor, **kwargs):
    """The derivative of ``(relevance · weights).sum()`` from ``LRP(..., create_graph=True)``."""
    lrp = LRP(net, mapper, in_keys=["x"], out_keys=["y"], create_graph=True, **kwargs)
    x = x.clone().requires_grad_(True)
    rel = relevance(lrp, x)
    inputs = [x, *net.parameters()]
    return rel, torch.autograd.grad((rel * weights).sum(), inputs, allow_unused=True, materialize_grads=True)


def assert_close_to(actual: list[torch.Tensor], expected: list[torch.Tensor], tolerance: float) -> None:
    """Each tensor within ``tolerance`` of the norm of all of ``expected`` (a tiny bias gradient, mostly
    finite-difference noise, is not held to a relative bound of its own)."""
    scale = torch.cat([e.reshape(-1) for e in expected]).norm()
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert (a - e).norm() <= tolerance * scale, f"tensor {i}: {(a - e).norm() / scale:.2e}"


class TestFiniteDifferences:
    @pytest.mark.parametrize("preset", sorted(PRESETS))
    @pytest.mark.parametrize("model", sorted(MODELS))
    def test_inputs_and_every_parameter(self, model, preset):
        net, x = smooth_point(model)
        weights = torch.randn_like(x)
        rel, (by_input, *by_params) = second_order(net, PRESETS[preset](), x, weights)
        fd_input, fd_params = finite_differences(net, PRESETS[preset](), x, weights)
        assert relative_error(by_input, fd_input) < 1e-6
        assert_close_to(by_params, fd_params, 1e-6)
        for grad in by_params:  # every parameter is reached
            assert grad.abs().sum() > 0

    @pytest.mark.parametrize("model", sorted(MODELS))
    def test_first_order_values_unchanged(self, model):
        net, x = smooth_point(model)
        for preset in PRESETS.values():
            plain = relevance(LRP(net, preset(), in_keys=["x"], out_keys=["y"]), x)
            kept = relevance(LRP(net, preset(), in_keys=["x"], out_keys=["y"], create_graph=True), x)
            assert kept.requires_grad and not plain.requires_grad
            assert torch.allclose(kept, plain, rtol=1e-12, atol=1e-14)

    def test_alpha_beta_and_wsquare_rules(self):
        """Rules beyond the presets' (α2β1, w² on the first layer), on a batch of another shape."""
        from tdhook.attribution.mappers.presets import EpsilonAlpha2Beta1
        from tdhook.attribution.rules import FirstLayerRule, WSquareRule

        net, x = smooth_point("cnn", seed=7)
        x = torch.cat([x, x.flip(0)])
        weights = torch.randn_like(x)
        first = FirstLayerRule(WSquareRule(), None)
        mapper = EpsilonAlpha2Beta1(rule_mapper={"0": first})
        _, (by_input, *by_params) = second_order(net, mapper, x, weights)
        fd_input, fd_params = finite_differences(net, EpsilonAlpha2Beta1(rule_mapper={"0": first}), x, weights)
        assert relative_error(by_input, fd_input) < 1e-6
        assert_close_to(by_params, fd_params, 1e-6)

    @pytest.mark.parametrize("preset", sorted(PRESETS))
    @pytest.mark.parametrize("case", ["conv1d with weight_norm", "mlp on a [B, T] batch"])
    def test_other_layers_and_batch_shapes(self, case, preset):
        """A 1-D convolution whose weight is parametrized (weight_norm: the derivative reaches its ``original0``
        and ``original1``), and an MLP on a ``[B, T]`` batch."""
        from torch.nn.utils.parametrizations import weight_norm

        def conv1d() -> nn.Module:
            return nn.Sequential(
                weight_norm(nn.Conv1d(2, 3, 3, padding=1)), nn.ReLU(), nn.Conv1d(3, 2, 3), nn.Flatten()
            ).double()

        make, shape, batch = {
            "conv1d with weight_norm": (conv1d, (3, 2, 5), [3]),
            "mlp on a [B, T] batch": (mlp, (2, 3, 5), [2, 3]),
        }[case]
        MODELS["other"] = (make, shape)
        try:
            net, x = smooth_point("other")
        finally:
            del MODELS["other"]
        weights = torch.randn_like(x)
        lrp = LRP(net, PRESETS[preset](), in_keys=["x"], out_keys=["y"], create_graph=True)
        point = x.clone().requires_grad_(True)
        rel = lrp(TensorDict(x=point, batch_size=batch))["relevance", "x"]
        grads = torch.autograd.grad((rel * weights).sum(), [point, *net.parameters()])
        plain = LRP(net, PRESETS[preset](), in_keys=["x"], out_keys=["y"])
        step, expected = 1e-6, []
        for tensor in [point.detach(), *net.parameters()]:
            result = torch.zeros_like(tensor)
            for i in range(tensor.numel()):
                values = []
                for sign in (1, -1):
                    with torch.no_grad():
                        tensor.view(-1)[i] += sign * step
                    td = plain(TensorDict(x=point.detach(), batch_size=batch))
                    values.append((td["relevance", "x"] * weights).sum().item())
                    with torch.no_grad():
                        tensor.view(-1)[i] -= sign * step
                result.view(-1)[i] = (values[0] - values[1]) / (2 * step)
            expected.append(result)
        assert_close_to(list(grads), expected, 1e-6)
        assert all(g.abs().sum() > 0 for g in grads[1:])

    def test_modified_weights_are_on_the_path(self):
        """Cutting the paths through z⁺'s W⁺ (as a cached detached copy would) is visibly wrong: the oracle can
        tell the two apart."""
        net, x = smooth_point("cnn")
        weights = torch.randn_like(x)
        _, (_, *by_params) = second_order(net, EpsilonPlus(), x, weights)
        _, fd_params = finite_differences(net, EpsilonPlus(), x, weights)
        lrp = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"], create_graph=True)
        from tdhook.attribution.rules import base

        modify = base.ParamModifier.modify
        try:  # modified weights detached from the parameters
            base.ParamModifier.modify = lambda self, params: modify(self, {n: p.detach() for n, p in params.items()})
            rel = relevance(lrp, x)
            cut = torch.autograd.grad((rel * weights).sum(), list(net.parameters()), allow_unused=True)
        finally:
            base.ParamModifier.modify = modify
        conv = relative_error(cut[2], fd_params[2])  # the second convolution's weight, under z⁺
        assert conv > 1e-2 and relative_error(by_params[2], fd_params[2]) < 1e-6


class TestBatchNorm:
    def test_epsilon_rule_merged(self):
        """The ε-rule on convolutions merged with their BatchNorm (the presets' convolutions take z⁺ or γ)."""
        from tdhook.attribution.rules import EpsilonRule

        net, x = smooth_point("cnn+bn")
        weights = torch.randn_like(x)
        _, (by_input, *by_params) = second_order(net, {nn.Conv2d: EpsilonRule(0.1)}, x, weights)
        fd_input, fd_params = finite_differences(net, {nn.Conv2d: EpsilonRule(0.1)}, x, weights)
        assert relative_error(by_input, fd_input) < 1e-6
        assert_close_to(by_params, fd_params, 1e-6)

    @pytest.mark.parametrize("where", ["training mode", "first layer", "after a ReLU"])
    def test_a_batch_norm_left_unmerged_keeps_the_derivative(self, where: str):
        """A BatchNorm that merges into no layer (in training mode; in eval mode as the model's first layer, or
        after a ReLU) takes NormRule's way, which keeps the graph: the derivative is the finite differences' (it
        was refused as if its ε-rule could not keep the graph)."""
        net, x = smooth_point("cnn+bn")
        if where == "training mode":
            net.train()
        else:
            norm = net[1] if where == "first layer" else net[4]
            at = 0 if where == "first layer" else 3
            features = 2 if where == "first layer" else 3
            layers = [*net]
            layers.insert(at, nn.BatchNorm2d(features).double())
            layers.remove(norm)
            net = nn.Sequential(*layers).eval()
            with torch.no_grad():
                layers[at].running_mean.uniform_(-0.5, 0.5)
                layers[at].running_var.uniform_(0.5, 2.0)
                layers[at].weight.uniform_(0.5, 1.5)
        weights = torch.randn_like(x)
        rel, (by_input, *by_params) = second_order(net, EpsilonPlus(), x, weights)
        plain = relevance(LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"]), x)
        torch.testing.assert_close(rel.detach(), plain, rtol=1e-12, atol=1e-14)
        fd_input, fd_params = finite_differences(net, EpsilonPlus(), x, weights)
        assert relative_error(by_input, fd_input) < 1e-6
        assert_close_to(by_params, fd_params, 1e-6)


class TestZennit:
    @pytest.mark.parametrize("preset", sorted(PRESETS))
    @pytest.mark.parametrize("model", ["cnn", "mlp"])  # zennit merges BatchNorm only through canonizers
    def test_input_gradient(self, model, preset):
        from zennit import composites
        from zennit.attribution import Gradient

        net, x = smooth_point(model)
        weights = torch.randn_like(x)
        rel, (by_input, *_) = second_order(net, PRESETS[preset](), x, weights)
        composite = {
            "EpsilonPlus": lambda: composites.EpsilonPlus(epsilon=EPSILON),
            "EpsilonPlusFlat": lambda: composites.EpsilonPlusFlat(epsilon=EPSILON),
            "EpsilonGammaBox": lambda: composites.EpsilonGammaBox(low=-3.0, high=3.0, epsilon=EPSILON),
        }[preset]()
        with torch.no_grad():
            onehot = torch.zeros_like(net(x)).scatter_(1, net(x).argmax(1, keepdim=True), 1.0)
        point = x.clone().requires_grad_(True)
        with Gradient(model=net, composite=composite, create_graph=True) as attributor:
            _, zennit_relevance = attributor(point, lambda out: onehot * out)
            with composite.inactive():
                (zennit_by_input,) = torch.autograd.grad((zennit_relevance * weights).sum(), point)
        assert relative_error(rel.detach(), zennit_relevance.detach()) < 1e-9
        assert relative_error(by_input, zennit_by_input) < 1e-9


class TestLRP0:
    @pytest.mark.parametrize("model", sorted(MODELS))
    def test_double_backward_of_gradient_times_input(self, model):
        net, x = smooth_point(model)
        weights = torch.randn_like(x)
        mapper = BaseRuleMapper(stabilizer=0.0)  # LRP-0, average pooling included
        rel, grads = second_order(net, mapper, x, weights)
        point = x.clone().requires_grad_(True)
        out = net(point)
        onehot = torch.zeros_like(out).scatter_(1, out.argmax(1, keepdim=True), 1.0)
        (grad,) = torch.autograd.grad(out, point, onehot, create_graph=True)
        inputs = [point, *net.parameters()]
        loss = (point * grad * weights).sum()
        expected = torch.autograd.grad(loss, inputs, allow_unused=True, materialize_grads=True)
        assert torch.allclose(rel, point * grad, rtol=1e-12, atol=1e-14)
        for actual, wanted in zip(grads, expected, strict=True):
            assert torch.allclose(actual, wanted, rtol=1e-10, atol=1e-13)


class TestNoSpecialContext:
    def test_inside_and_outside_the_context(self):
        net, x = smooth_point("cnn")
        weights = torch.randn_like(x)
        lrp = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"], create_graph=True)
        with lrp:
            rel = relevance(lrp, x)
            loss = (rel * weights).sum()
            inside = torch.autograd.grad(loss, list(net.parameters()), retain_graph=True)
        outside = torch.autograd.grad(loss, list(net.parameters()), retain_graph=True)
        with lrp, lrp.inactive():
            under_inactive = torch.autograd.grad(loss, list(net.parameters()))
        for a, b, c in zip(inside, outside, under_inactive, strict=True):
            assert torch.equal(a, b) and torch.equal(a, c)

    def test_outputs_keep_their_plain_graph(self):
        """A task loss on the written outputs has the plain model's gradient, next to the relevance's."""
        net, x = smooth_point("cnn")
        lrp = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"], create_graph=True)
        td = lrp(TensorDict(x=x, batch_size=[2]))
        got = torch.autograd.grad(td["y"].sum(), list(net.parameters()))
        wanted = torch.autograd.grad(net(x).sum(), list(net.parameters()))
        assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-15) for a, b in zip(got, wanted, strict=True))

    def test_split_and_all_targets(self):
        """Several backward passes from one forward pass (``target="all"``) keep the graph too."""
        net, x = smooth_point("mlp")
        lrp = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"], create_graph=True, target="all")
        rel = relevance(lrp, x)
        assert rel.shape == (4, 3, 5)
        weights = torch.randn_like(rel)
        by_params = torch.autograd.grad((rel * weights).sum(), list(net.parameters()))
        for unit in range(3):
            single = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"], create_graph=True, target=unit)
            one = relevance(single, x)
            assert torch.allclose(one, rel[:, unit])
        assert all(g.abs().sum() > 0 for g in by_params)


class TestRefusals:
    def test_a_rule_that_cannot_keep_the_graph(self):
        from tdhook.attribution.rules import QuantizedLinearRule

        net = mlp()
        lrp = LRP(net, {"2": QuantizedLinearRule()}, in_keys=["x"], out_keys=["y"], create_graph=True)
        with pytest.raises(NotImplementedError, match="QuantizedLinearRule.*'2'"):
            lrp(TensorDict(x=torch.randn(2, 5, dtype=torch.float64), batch_size=[2]))
        assert all(not m._forward_hooks for m in net.modules())


class TestInactive:
    def plain(self, net, x):
        point = x.clone().requires_grad_(True)
        out = net(point)
        return out, torch.autograd.grad(out.sum(), [point, *net.parameters()])

    @pytest.mark.parametrize("create_graph", [False, True])
    def test_plain_model_and_gradient_times_input(self, create_graph):
        net, x = smooth_point("cnn")
        lrp = LRP(net, EpsilonGammaBox(low=-3.0, high=3.0), in_keys=["x"], out_keys=["y"], create_graph=create_graph)
        out, expected = self.plain(net, x)
        with lrp:
            before = relevance(lrp, x)
            with lrp.inactive():
                got_out, got = self.plain(net, x)
                rel = relevance(lrp, x)
            after = relevance(lrp, x)
        assert torch.equal(got_out, out) and all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        point = x.clone().requires_grad_(True)
        y = net(point)
        onehot = torch.zeros_like(y).scatter_(1, y.argmax(1, keepdim=True), 1.0)
        assert torch.allclose(rel, x * torch.autograd.grad(y, point, onehot)[0], rtol=1e-12, atol=1e-14)
        assert torch.equal(before, after) and not torch.allclose(before, rel)

    def test_outside_the_context(self):
        net, x = smooth_point("mlp")
        lrp = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
        with lrp.inactive():
            rel = relevance(lrp, x)
            assert all(not m._forward_hooks for m in net.modules())
        point = x.clone().requires_grad_(True)
        y = net(point)
        onehot = torch.zeros_like(y).scatter_(1, y.argmax(1, keepdim=True), 1.0)
        assert torch.allclose(rel, x * torch.autograd.grad(y, point, onehot)[0])
        assert lrp._handles is None and not lrp._inactive

    @pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
    def test_restored_whatever_ends_the_block(self, error):
        net, x = smooth_point("cnn")
        lrp = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
        with lrp:
            before = relevance(lrp, x)
            hooks = [len(m._forward_hooks) for m in net.modules()]
            with pytest.raises(error), lrp.inactive():
                assert sum(len(m._forward_hooks) for m in net.modules()) == 0
                raise error("stop")
            assert [len(m._forward_hooks) for m in net.modules()] == hooks
            assert torch.equal(relevance(lrp, x), before)
        assert all(not m._forward_hooks for m in net.modules())

    def test_nested(self):
        net, x = smooth_point("mlp")
        lrp = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
        with lrp:
            with lrp.inactive(), lrp.inactive():
                pass
            assert lrp._handles is not None and not lrp._inactive

    @pytest.mark.parametrize("entered", [False, True])
    def test_a_first_call_without_rules_is_not_watched_and_the_first_with_rules_warns(self, entered: bool):
        """A first call in ``inactive()`` was watched for calls no rule covers, with no rule on: it warned that the
        softmax and even the convolutions kept their plain gradient, though every module does there as asked, and
        the next call with the rules on, the one whose warning means something, was not watched and said nothing.
        The block's calls now warn nothing and write gradient × input; the first call with the rules on warns."""
        torch.manual_seed(0)
        net = nn.Sequential(
            nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(48, 4), nn.Softmax(-1)
        )
        net = net.double().eval()
        x = torch.randn(3, 2, 6, 6, dtype=torch.float64)
        lrp = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
        with lrp if entered else contextlib.nullcontext():
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                with lrp.inactive():
                    plain = relevance(lrp, x)
            with pytest.warns(UserWarning, match=r"'5' \(Softmax\) computes softmax"):
                relevance(lrp, x)
        assert [call.module for call in lrp.coverage().plain_gradient] == ["5"]
        point = x.clone().requires_grad_(True)
        y = net(point)
        onehot = torch.zeros_like(y).scatter_(1, y.argmax(1, keepdim=True), 1.0)
        assert relative_error(plain, x * torch.autograd.grad(y, point, onehot)[0]) <= 1e-12


class Normalise(nn.Module):
    """``(x - mean) / std`` per feature: glue with a shift between the explained input and the first layer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = torch.linspace(-0.5, 0.5, x.shape[-1], dtype=x.dtype)
        return (x - mean) / torch.linspace(0.5, 2.0, x.shape[-1], dtype=x.dtype)


@pytest.mark.parametrize("preset", ["EpsilonPlusFlat"])
def test_a_first_layer_behind_a_normaliser_keeps_the_derivative_of_its_relevance(preset: str):
    # The relevance the first layer sets is given to the input positions whole through the normaliser; its
    # derivative runs through the normaliser and every parameter.
    for attempt in range(200):
        torch.manual_seed(attempt)
        net, x = nn.Sequential(Normalise(), *mlp()), torch.randn(4, 5, dtype=torch.float64)
        if margin(net, x) > 1e-3:
            break
    weights = torch.randn_like(x)
    _, (by_input, *by_params) = second_order(net, PRESETS[preset](), x, weights)
    fd_input, fd_params = finite_differences(net, PRESETS[preset](), x, weights)
    assert relative_error(by_input, fd_input) < 1e-6
    assert_close_to(by_params, fd_params, 1e-6)


class TwoEncoders(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a, self.b, self.head = nn.Linear(5, 4), nn.Linear(5, 4), nn.Linear(4, 3)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.a(a)) + torch.relu(self.b(b)))


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("history", ["leaf", "non-leaf"])
def test_one_tensor_under_two_input_keys_gets_each_keys_relevance_and_derivative(preset: str, history: str):
    """The tensor the caller gives is the leaf of a differentiable call: one object under two keys was one leaf,
    and each key got the gradient of both paths (EpsilonPlus: 1.05 and 0.95 off, relative)."""
    net = TwoEncoders().double()
    x = torch.randn(4, 5, dtype=torch.float64)

    def explain(a: torch.Tensor, b: torch.Tensor) -> TensorDict:
        lrp = LRP(net, PRESETS[preset](), in_keys=["a", "b"], out_keys=["y"], create_graph=True)
        return lrp(TensorDict(a=a, b=b, batch_size=[4]))

    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    apart = explain(xa, xb)
    source = x.clone().requires_grad_(True)
    shared = source if history == "leaf" else source * 1.0
    together = explain(shared, shared)
    for key in ("a", "b"):
        assert relative_error(together["relevance", key], apart["relevance", key]) <= 1e-12
    weights = torch.randn(4, 5, dtype=torch.float64)
    (got,) = torch.autograd.grad(
        ((together["relevance", "a"] + 2 * together["relevance", "b"]) * weights).sum(), source
    )
    expected = torch.autograd.grad(((apart["relevance", "a"] + 2 * apart["relevance", "b"]) * weights).sum(), (xa, xb))
    assert relative_error(got, expected[0] + expected[1]) <= 1e-12


@pytest.mark.parametrize("preset", ["EpsilonPlusFlat", "EpsilonGammaBox"])
def test_an_input_with_a_history_behind_a_normaliser_keeps_the_relevance_glue_carries_back(preset: str):
    """Relevance a first-layer rule sets is carried back through glue to the leaves of the layer's input: for an
    input the caller computed (``x = source * 3``), the walk went past it to ``source``, and the whole relevance
    of Flat behind a normaliser was dropped (1.0 off, relative: zero everywhere)."""
    torch.manual_seed(0)
    net = nn.Sequential(Normalise(), *mlp())
    x = torch.randn(4, 5, dtype=torch.float64)
    lrp = LRP(net, PRESETS[preset](), in_keys=["x"], out_keys=["y"], create_graph=True)
    leaf = x.clone().requires_grad_(True)
    expected = lrp(TensorDict(x=leaf, batch_size=[4]))["relevance", "x"]
    source = (x / 3).requires_grad_(True)
    got = lrp(TensorDict(x=source * 3, batch_size=[4]))["relevance", "x"]
    assert relative_error(got, expected) <= 1e-12
    weights = torch.randn_like(x)
    (by_source,) = torch.autograd.grad((got * weights).sum(), source)
    (by_leaf,) = torch.autograd.grad((expected * weights).sum(), leaf)
    assert relative_error(by_source, 3 * by_leaf) <= 1e-12
