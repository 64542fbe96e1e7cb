"""A rule of one's own that returns another value than the module's output, or whose backward gives the wrong
gradients, is refused with an error naming the rule, the module and what was expected; the model and the caller's
TensorDict are left as they were. Rules that recompute the output with other rounding are accepted."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.rules import EpsilonRule, Rule, redirect, stabilize


class Authored(Rule):
    """A rule whose rewrite is ``fn(module, inputs, output)``."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def rewrite(self, module, registration, inputs, output):
        return self.fn(module, inputs, output)


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).double()


def _explain(net: nn.Module, rule: Rule, x: torch.Tensor, **kwargs) -> TensorDict:
    lrp = LRP(net, rule_mapper={nn.Linear: rule}, in_keys=["x"], out_keys=["y"], target=0, **kwargs)
    return lrp(TensorDict(x=x, batch_size=[x.shape[0]]))


def _epsilon_relevance(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """LRP-ε (ε = 1e-6) for output 0 of ``_net``, written out."""
    with torch.no_grad():
        h = net[0](x)
        out = net[2](net[1](h))
        r_out = torch.zeros_like(out)
        r_out[:, 0] = out[:, 0]
        r_hidden = net[1](h) * ((r_out / stabilize(out, 1e-6)) @ net[2].weight)
        return x * ((r_hidden / stabilize(h, 1e-6)) @ net[0].weight)


def _assert_left_as_it_was(net: nn.Module, td: TensorDict, x: torch.Tensor, before: torch.Tensor) -> None:
    """A refused call wrote nothing into ``td``, left no hook on ``net``, and ``net(x)`` still gives ``before``."""
    assert list(td.keys(True)) == ["x"]  # nothing written
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in net.modules())
    torch.testing.assert_close(net(x), before, rtol=0, atol=0)


WRONG_OUTPUTS = {
    "scaled": (lambda m, i, o: 2 * o, ValueError, "value differs from the module's output"),
    "shifted redirect": (
        lambda m, i, o: redirect(o + 1, [o], lambda g: [g]),
        ValueError,
        "value differs from the module's output",
    ),
    "other shape": (lambda m, i, o: o[:, :1], ValueError, r"shape \[5, 1\].*expected the module's output"),
    "other dtype": (lambda m, i, o: o.float(), ValueError, r"torch.float32.*expected the module's output"),
    "not a tensor": (lambda m, i, o: [o], TypeError, "an object of type list"),
}


@pytest.mark.parametrize("case", sorted(WRONG_OUTPUTS))
def test_a_rewrite_with_another_output_is_refused(case):
    fn, kind, message = WRONG_OUTPUTS[case]
    net = _net()
    x = torch.randn(5, 4, dtype=torch.float64)
    before = net(x).detach()
    td = TensorDict(x=x, batch_size=[5])
    lrp = LRP(net, rule_mapper={nn.Linear: Authored(fn)}, in_keys=["x"], out_keys=["y"], target=0)
    with pytest.raises(kind, match=f"Authored on Linear: rewrite returned .*{message}") as info:
        lrp(td)
    assert any("the module is '0'" in note for note in getattr(info.value, "__notes__", []))
    _assert_left_as_it_was(net, td, x, before)


def test_a_rewrite_that_recomputes_the_output_with_other_rounding_is_accepted():
    """The output computed again (another order of the sum, float32) is the output's value up to rounding."""

    def recomputed(module, inputs, output):
        (x,) = inputs
        again = (x.flip(-1) @ module.weight.flip(-1).T + module.bias).detach()
        z = output.detach()
        return redirect(again, [output], lambda g: [g * z / stabilize(z, 1e-6)])

    net = _net().float()
    x = torch.randn(5, 4)
    relevance = _explain(net, Authored(recomputed), x)["relevance", "x"]
    expected = _explain(net, EpsilonRule(1e-6), x)["relevance", "x"]
    torch.testing.assert_close(relevance, expected, rtol=1e-5, atol=1e-6)


WRONG_GRADIENTS = {
    "two for one": (lambda o: lambda g: [g, g], RuntimeError, "2 gradients for the 1 tensors"),
    "none for one": (lambda o: lambda g: [], RuntimeError, "0 gradients for the 1 tensors"),
    "other shape": (lambda o: lambda g: [g[:, :1]], ValueError, r"shape \[5, 1\] for tensor 0.*shape \[5, 3\]"),
    "a number": (lambda o: lambda g: [3.0], TypeError, "an object of type float for tensor 0"),
}


@pytest.mark.parametrize("case", sorted(WRONG_GRADIENTS))
def test_a_backward_with_the_wrong_gradients_is_refused(case):
    make, kind, message = WRONG_GRADIENTS[case]
    net = _net()
    x = torch.randn(5, 4, dtype=torch.float64)
    td = TensorDict(x=x, batch_size=[5])
    rule = Authored(lambda m, i, o: redirect(o, [o], make(o)))
    lrp = LRP(net, rule_mapper={nn.Linear: rule}, in_keys=["x"], out_keys=["y"], target=0)
    with pytest.raises(kind, match=f"Authored on Linear: the backward given to redirect returned .*{message}"):
        lrp(td)
    assert list(td.keys(True)) == ["x"]
    assert all(not m._forward_hooks for m in net.modules())


def test_a_backward_may_return_the_one_gradient_as_a_tensor():
    """A tensor for a redirect of one tensor is its gradient (it was read as a sequence of its rows)."""

    def epsilon(module, inputs, output):
        z = output.detach()
        return redirect(output, [output], lambda g: g * z / stabilize(z, 1e-6))

    net = _net()
    x = torch.randn(5, 4, dtype=torch.float64)
    relevance = _explain(net, Authored(epsilon), x)["relevance", "x"]
    torch.testing.assert_close(relevance, _epsilon_relevance(net, x), rtol=1e-10, atol=1e-12)


def test_a_rule_on_a_module_of_ones_own_that_calls_linear_with_its_own_parameters():
    """A module of the user's class computing ``F.linear`` with its own parameters, under a rule that redirects
    to its input: LRP-ε written out."""

    class MyLinear(nn.Module):
        def __init__(self, layer: nn.Linear) -> None:
            super().__init__()
            self.w, self.b = nn.Parameter(layer.weight.detach().clone()), nn.Parameter(layer.bias.detach().clone())

        def forward(self, x):
            return F.linear(x, self.w, self.b)

    def epsilon_to_input(module, inputs, output):
        (x,), z = inputs, output.detach()
        return redirect(output, [x], lambda g: [(g * z / stabilize(z, 1e-6)) @ module.w])

    net = _net()
    mine = nn.Sequential(MyLinear(net[0]), nn.ReLU(), MyLinear(net[2]))
    x = torch.randn(5, 4, dtype=torch.float64)
    lrp = LRP(mine, rule_mapper={MyLinear: Authored(epsilon_to_input)}, in_keys=["x"], out_keys=["y"], target=0)
    relevance = lrp(TensorDict(x=x, batch_size=[5]))["relevance", "x"]
    torch.testing.assert_close(relevance, _epsilon_relevance(net, x), rtol=1e-10, atol=1e-12)


def test_a_rule_of_ones_own_on_a_module_with_several_outputs_is_refused():
    """Skipped, the rule would leave the module its plain gradient (gradient × input) without a word."""

    class LinearWithAux(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 3)

        def forward(self, x):
            y = self.layer(x)
            return y, y.tanh()

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = LinearWithAux()

        def forward(self, x):
            return self.body(x)[0]

    def epsilon(module, inputs, output):
        z = output.detach()
        return redirect(output, [output], lambda g: [g * z / stabilize(z, 0.5)])

    net = Head().double()
    td = TensorDict(x=torch.randn(5, 4, dtype=torch.float64), batch_size=[5])
    lrp = LRP(net, rule_mapper={LinearWithAux: Authored(epsilon)}, in_keys=["x"], out_keys=["y"], target=0)
    with pytest.raises(ValueError, match="Authored on LinearWithAux: .*returns a tuple") as info:
        lrp(td)
    assert any("the module is 'body'" in note for note in getattr(info.value, "__notes__", []))
    assert list(td.keys(True)) == ["x"]


def test_a_rule_declaring_uses_input_false_on_an_in_place_module_does_not_read_the_overwritten_input():
    """In place, the module's input holds its output: a rule that reads it while declaring ``uses_input = False``
    would compute with the output's values. It gets ``None`` and an error saying so; declared, it reads the input."""

    class ReadsInput(Rule):
        uses_input = False

        def rewrite(self, module, registration, inputs, output):
            (x,) = inputs
            slope = torch.where(x.detach() > 0, 1.0, 0.0).to(x)  # ReLU's own gradient: reads the input's sign
            return redirect(output, [x], lambda g: [g * slope])

    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(inplace=True), nn.Linear(6, 2)).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    lrp = LRP(net, rule_mapper={nn.ReLU: ReadsInput()}, in_keys=["x"], out_keys=["y"], target=0)
    with pytest.raises(AttributeError) as info:
        lrp(TensorDict(x=x, batch_size=[5]))
    assert any("ReadsInput on ReLU: the module ran in place" in note for note in info.value.__notes__)

    ReadsInput.uses_input = True
    lrp = LRP(net, rule_mapper={nn.ReLU: ReadsInput()}, in_keys=["x"], out_keys=["y"], target=0)
    relevance = lrp(TensorDict(x=x, batch_size=[5]))["relevance", "x"]
    x_ = x.clone().requires_grad_()
    (grad,) = torch.autograd.grad(net(x_)[:, 0].sum(), x_)
    torch.testing.assert_close(relevance, x * grad, rtol=1e-10, atol=1e-12)  # ε = 0 and ReLU's gradient: LRP-0


def test_a_rule_may_call_its_module_for_a_modified_pass():
    """``torch.func.functional_call(module, modified, ...)`` inside the module's own rewrite is a plain call of the
    module (it recursed into the rule without end): z⁺ written out."""

    class ZPlusByCall(Rule):
        def rewrite(self, module, registration, inputs, output):
            (x,), z = inputs, output.detach()
            positive = {"weight": module.weight.clamp(min=0), "bias": module.bias.clamp(min=0)}
            zp = torch.func.functional_call(module, positive, (x.clamp(min=0),))
            return redirect(output, [zp], lambda g: [g * z / stabilize(zp.detach(), 1e-6)])

    torch.manual_seed(0)
    net = nn.Sequential(nn.ReLU(), nn.Linear(4, 3)).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    lrp = LRP(net, rule_mapper={nn.Linear: ZPlusByCall()}, in_keys=["x"], out_keys=["y"], target=0)
    relevance = lrp(TensorDict(x=x, batch_size=[5]))["relevance", "x"]
    with torch.no_grad():
        layer, a = net[1], x.clamp(min=0)
        out = layer(a)
        r_out = torch.zeros_like(out)
        r_out[:, 0] = out[:, 0]
        w, b = layer.weight.clamp(min=0), layer.bias.clamp(min=0)
        expected = a * ((r_out / stabilize(F.linear(a, w, b), 1e-6)) @ w)
    torch.testing.assert_close(relevance, expected, rtol=1e-10, atol=1e-12)


def test_a_rule_on_a_module_called_twice_gets_each_call():
    """One Linear run twice in a forward: LRP-ε (ε = 0.5) through both calls, written out."""

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 4)

        def forward(self, x):
            return self.layer(torch.relu(self.layer(x)))

    def epsilon(module, inputs, output):
        z = output.detach()
        return redirect(output, [output], lambda g: [g * z / stabilize(z, 0.5)])

    torch.manual_seed(0)
    net = Twice().double()
    x = torch.randn(5, 4, dtype=torch.float64)
    lrp = LRP(net, rule_mapper={nn.Linear: Authored(epsilon)}, in_keys=["x"], out_keys=["y"], target=0)
    relevance = lrp(TensorDict(x=x, batch_size=[5]))["relevance", "x"]
    with torch.no_grad():
        layer = net.layer
        h = layer(x)
        a = torch.relu(h)
        out = layer(a)
        r_out = torch.zeros_like(out)
        r_out[:, 0] = out[:, 0]
        r_a = a * ((r_out / stabilize(out, 0.5)) @ layer.weight)
        expected = x * ((r_a / stabilize(h, 0.5)) @ layer.weight)
    torch.testing.assert_close(relevance, expected, rtol=1e-10, atol=1e-12)


class _TwoInputs(nn.Module):
    """``x @ A.T + y @ B.T``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(3, 2))

    def forward(self, x, y):
        return x @ self.a.T + y @ self.b.T


def _epsilon_to_inputs(second=lambda y: y):
    """A rewrite of :class:`_TwoInputs` with the ε-rule (ε = 0.1) split over its two inputs, whose redirect goes to
    ``x`` and ``second(y)``."""

    def rewrite(module, inputs, output):
        (x, y), z = inputs, output.detach()

        def backward(g):
            s = g * z / stabilize(z, 0.1)
            return [s @ module.a, s @ module.b]

        return redirect(output, [x, second(y)], backward)

    return rewrite


def _two_inputs_and_shares() -> tuple[_TwoInputs, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A :class:`_TwoInputs` in float64, its inputs, and ``R / stabilize(z, 0.1)`` for ``R`` its output 0 alone."""
    torch.manual_seed(0)
    net = _TwoInputs().double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    with torch.no_grad():
        z = net(x, y)
        r_out = torch.zeros_like(z)
        r_out[:, 0] = z[:, 0]
        return net, x, y, r_out / stabilize(z, 0.1)


def test_a_rule_on_a_module_with_two_inputs_redirects_to_both():
    """``x @ A.T + y @ B.T`` with the ε-rule (ε = 0.1) split over its two inputs, written out per input key."""
    net, x, y, s = _two_inputs_and_shares()
    mapper = {_TwoInputs: Authored(_epsilon_to_inputs())}
    lrp = LRP(net, rule_mapper=mapper, in_keys=["x", "y"], out_keys=["out"], target=0)
    td = lrp(TensorDict(x=x, y=y, batch_size=[5]))
    torch.testing.assert_close(td["relevance", "x"], x * (s @ net.a), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(td["relevance", "y"], y * (s @ net.b), rtol=1e-10, atol=1e-12)


class _Residual(nn.Module):
    """``b(x + a(x))``: the branch through ``a`` is half of what reaches ``b``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        return self.b(x + self.a(x))


def _epsilon_to(tensors):
    """A rewrite with the ε-rule (ε = 1e-6) whose redirect goes to ``tensors(module, x, output)``."""

    def rewrite(module, inputs, output):
        z = output.detach()
        return redirect(output, tensors(module, inputs[0], output), lambda g: [g * z / stabilize(z, 1e-6)])

    return rewrite


def _under_no_grad(module, x, output):
    with torch.no_grad():
        return [F.linear(x, module.weight, module.bias)]


DETACHED_REDIRECTS = {
    "detached input": _epsilon_to(lambda m, x, o: [F.linear(x.detach(), m.weight, m.bias)]),  # the weights only
    "all detached": _epsilon_to(lambda m, x, o: [o.detach()]),
    "under no_grad": _epsilon_to(_under_no_grad),
}


@pytest.mark.parametrize("case", sorted(DETACHED_REDIRECTS))
def test_a_redirect_to_tensors_that_do_not_lead_back_to_the_input_is_refused(case):
    """The gradient would reach no input: the branch through ``a`` would lose its relevance without a word (0.29
    off on this net, as the other branch still reaches the input)."""
    torch.manual_seed(0)
    net = _Residual().double()
    x = torch.randn(5, 4, dtype=torch.float64)
    before = net(x).detach()
    td = TensorDict(x=x, batch_size=[5])
    mapper = {"a": Authored(DETACHED_REDIRECTS[case]), nn.Linear: EpsilonRule(1e-6)}
    lrp = LRP(net, rule_mapper=mapper, in_keys=["x"], out_keys=["y"], target=0)
    with pytest.raises(
        ValueError, match="Authored on Linear: redirect was given tensors none of which leads back"
    ) as i:
        lrp(td)
    assert any("the module is 'a'" in note for note in getattr(i.value, "__notes__", []))
    _assert_left_as_it_was(net, td, x, before)


def test_a_gradient_for_a_detached_alias_of_the_input_is_refused():
    """Half the relevance sent to ``x.detach()``: torch drops it (LRP-ε gave half the relevance, 0.096 off)."""

    def halves(module, inputs, output):
        (x,), z = inputs, output.detach()

        def backward(g):
            s = g * z / stabilize(z, 1e-6) / 2
            return [s, s @ module.weight]

        return redirect(output, [output, x.detach()], backward)

    net = _net()
    x = torch.randn(5, 4, dtype=torch.float64)
    with pytest.raises(
        ValueError, match="Authored on Linear: .* for tensor 1 of the redirect, which does not lead back"
    ):
        _explain(net, Authored(halves), x)


def test_a_gradient_of_another_dtype_is_refused():
    """A float32 gradient for a float64 tensor, which torch casts without a word (9e-9 off LRP-ε in float64)."""

    def in_float32(module, inputs, output):
        z = output.detach()
        return redirect(output, [output], lambda g: [(g * z / stabilize(z, 1e-6)).float()])

    net = _net()
    x = torch.randn(5, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"Authored on Linear: .* dtype torch.float32 for tensor 0 .* torch.float64"):
        _explain(net, Authored(in_float32), x)


def test_a_gradient_for_an_input_left_unexplained_and_a_cut_branch_are_accepted():
    """What goes nowhere on purpose: a gradient for a module input that does not require grad (``y`` left out of
    in_keys), and an empty redirect (the branch cut). LRP-ε for ``x`` and gradient × input of ``b`` alone, written
    out."""
    net, x, y, s = _two_inputs_and_shares()
    module = TensorDictModule(net, in_keys=["x", "y"], out_keys=["out"])
    rule = Authored(_epsilon_to_inputs(lambda y: y.clamp(min=0)))
    lrp = LRP(module, rule_mapper={_TwoInputs: rule}, in_keys=["x"], target=0)
    relevance = lrp(TensorDict(x=x, y=y, batch_size=[5]))["relevance", "x"]
    torch.testing.assert_close(relevance, x * (s @ net.a), rtol=1e-10, atol=1e-12)

    residual = _Residual().double()
    cut = Authored(lambda m, i, o: redirect(o, [], lambda g: []))
    lrp = LRP(residual, rule_mapper={"a": cut}, in_keys=["x"], out_keys=["y"], target=0)
    relevance = lrp(TensorDict(x=x, batch_size=[5]))["relevance", "x"]
    torch.testing.assert_close(relevance, x * residual.b.weight[0], rtol=1e-10, atol=1e-12)
