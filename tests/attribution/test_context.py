"""What a context registers: rules left out where nothing reads their marks, modes not paused around one call."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution._context import leave_out_unread_marks, marks_are_read, register_rule
from tdhook.attribution.lrp_helpers.rules import CPLRP, AttnLRP, BaseRuleMapper, EpsilonPlus, EpsilonPlusFlat
from tdhook.attribution.rules import EpsilonRule, IgnoreRule, MergeBatchNormRule, PassRule, layer_call_of


def hook_count(module: nn.Module) -> int:
    return len(module._forward_hooks) + len(module._forward_pre_hooks)


class Attention(nn.Module):
    """A single-head self-attention block with an MLP: products and softmax for AttnLRP's function rules."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)
        self.act = nn.SiLU()
        self.up, self.out = nn.Linear(width, width), nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2), -1)
        h = x + weights @ self.v(x)
        return self.out(self.act(h) * self.up(h)).sum(-2)


class TestUnreadMarks:
    def test_ignore_rules_are_left_out_where_no_rule_reads_layer_marks(self):
        rules = {"fc": IgnoreRule(), "act": PassRule(), "head": EpsilonRule()}
        assert not marks_are_read(rules, checked=False, target=None)
        modules = {"fc": nn.Linear(2, 2), "act": nn.Tanh(), "head": nn.Linear(2, 1)}
        assert set(leave_out_unread_marks(rules, modules)) == {"act", "head"}

    @pytest.mark.parametrize("reader", [MergeBatchNormRule(), EpsilonPlusFlat().first_layer_rule("0", nn.Linear(2, 2))])
    def test_a_rule_that_reads_marks_keeps_every_rule(self, reader):
        assert marks_are_read({"fc": IgnoreRule(), "reader": reader}, checked=False, target=None)

    def test_per_module_checks_and_callable_targets_read_marks(self):
        assert marks_are_read({"fc": IgnoreRule()}, checked=True, target=None)
        assert marks_are_read({"fc": IgnoreRule()}, checked=False, target=lambda out: out)
        assert not marks_are_read({"fc": IgnoreRule()}, checked=False, target="all")

    def test_layers_leave_no_marks_where_nothing_reads_them(self):
        net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2), nn.Identity())
        td = TensorDict(x=torch.randn(2, 3), batch_size=[2])
        seen = []  # what the module after the last layer receives: the layer's output, as its rule returned it
        net[3].register_forward_pre_hook(lambda m, args: seen.append(layer_call_of(args[0])))
        with LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"]) as lrp:
            lrp(td.clone())
        with LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"], target=lambda out: out) as lrp:
            lrp(td.clone())
        assert seen[0] is None and seen[1] is not None and seen[1].module is net[2]

    def test_linear_layers_of_a_transformer_get_no_hooks_and_the_relevance_is_unchanged(self):
        torch.manual_seed(0)
        model = Attention().double()
        x = torch.randn(2, 4, 6, dtype=torch.float64)
        checked = LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"], relevance_check=lambda *args: None)
        with checked:  # per-module checks: the Ignore rules stay registered on every Linear
            assert hook_count(model.q) > 0
            reference = checked(TensorDict(x=x, batch_size=[2]))["relevance", "x"]
        lrp = LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"])
        with lrp:
            assert [hook_count(m) for m in (model.q, model.k, model.v, model.up, model.out)] == [0] * 5
            relevance = lrp(TensorDict(x=x, batch_size=[2]))["relevance", "x"]
        torch.testing.assert_close(relevance, reference, rtol=1e-12, atol=1e-14)

    def test_a_batch_norm_after_a_layer_keeps_the_layer_marked_and_merged(self):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 2)).double().eval()
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
        with LRP(model, BaseRuleMapper(), in_keys=["x"], out_keys=["y"]):
            assert hook_count(model[0]) > 0


class TestModesAroundLayers:
    def test_plain_linear_layers_under_the_epsilon_rule_are_not_paused(self):
        model = Attention()
        lrp = LRP(model, AttnLRP(epsilon=1e-6), in_keys=["x"], out_keys=["y"])
        with lrp:
            # The ε-rule's forward hook and nothing else: no pre-hook pausing the function rules.
            assert len(model.q._forward_pre_hooks) == 0 and len(model.q._forward_hooks) == 1
            # An activation module is paused: its rule decides its gradient, not the mode's activation rule. SiLU
            # may run in place: a second pre-hook copies its input for the rule in a call where it does.
            assert len(model.act._forward_pre_hooks) == 2

    def test_a_linear_subclass_with_its_own_forward_is_not_paused(self):
        # The calls its forward makes besides the linear function (a gate, an activation) get the function rules
        # they would get beside the layer (see tests/attribution/rules/test_layer_activations.py).
        class Gated(nn.Linear):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return super().forward(x) * torch.sigmoid(x.sum(-1, keepdim=True))

        model = nn.Sequential(Gated(3, 3), nn.Tanh(), nn.Linear(3, 2))
        with LRP(model, AttnLRP(epsilon=1e-6), in_keys=["x"], out_keys=["y"]):
            assert len(model[0]._forward_pre_hooks) == 0

    def test_unpaused_epsilon_layers_give_the_epsilon_rule_and_nothing_more(self):
        # Without the pause, F.linear runs in the function mode; the ε-rule must stay the only rule on it.
        torch.manual_seed(1)
        net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
        x = torch.randn(5, 4, dtype=torch.float64)
        td = TensorDict(x=x, batch_size=[5])
        relevance = LRP(net, AttnLRP(epsilon=0.1), in_keys=["x"], out_keys=["y"])(td.clone())["relevance", "x"]
        explicit = BaseRuleMapper(rule_mapper=lambda name, m: EpsilonRule(0.1) if isinstance(m, nn.Linear) else None)
        explicit.default_rule = lambda name, m: AttnLRP().default_rule(name, m)
        expected = LRP(net, explicit, in_keys=["x"], out_keys=["y"])(td.clone())["relevance", "x"]
        torch.testing.assert_close(relevance, expected, rtol=1e-12, atol=1e-14)


class ConstantQuery(nn.Module):
    """``out(q(x) * c(pos))`` with ``pos`` a buffer: a linear map of ``x`` (``c(pos)`` is a constant of the call)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.c, self.out = nn.Linear(4, 5, bias=False), nn.Linear(3, 5, bias=False), nn.Linear(5, 2, bias=False)
        self.register_buffer("pos", torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.q(x) * self.c(self.pos))


class GatedLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * torch.sigmoid(x.sum(-1, keepdim=True))


class TestLayersOfConstants:
    @pytest.mark.parametrize(
        "mapper", [AttnLRP(), AttnLRP(epsilon=1e-12), CPLRP()], ids=["AttnLRP", "AttnLRP-eps", "CPLRP"]
    )
    @pytest.mark.parametrize("checked", [False, True], ids=["unchecked", "checked"])
    def test_a_product_with_a_layer_of_constants_is_linear_and_gets_all_relevance(self, mapper, checked: bool):
        # The model is linear in x, so every rule set must give gradient x input; the uniform rule on a product
        # of an activation and a constant would send half of the relevance to the constant, and lose it.
        torch.manual_seed(0)
        model = ConstantQuery().double()
        x = torch.randn(3, 4, dtype=torch.float64)
        check = (lambda *args: None) if checked else None
        lrp = LRP(model, mapper, in_keys=["x"], out_keys=["y"], relevance_check=check)
        relevance = lrp(TensorDict(x=x, batch_size=[3]))["relevance", "x"]
        leaf = x.clone().requires_grad_(True)
        out = model(leaf)
        (grad,) = torch.autograd.grad(out, leaf, torch.zeros_like(out).scatter_(-1, out.argmax(-1, keepdim=True), 1))
        torch.testing.assert_close(relevance, leaf.detach() * grad, rtol=1e-9, atol=1e-12)

    def test_a_linear_subclass_with_its_own_forward_keeps_its_rule_with_or_without_checks(self):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), GatedLinear(3, 3), nn.Tanh(), nn.Linear(3, 2)).double()
        x = torch.randn(3, 4, dtype=torch.float64)
        td = TensorDict(x=x, batch_size=[3])
        plain = LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"])(td.clone())["relevance", "x"]
        checked = LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"], relevance_check=lambda *args: None)
        torch.testing.assert_close(plain, checked(td.clone())["relevance", "x"], rtol=1e-12, atol=1e-14)
        with LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"]):
            assert len(model[1]._forward_pre_hooks) == 0 and len(model[0]._forward_pre_hooks) == 0


def test_a_callable_target_set_in_an_open_context_gets_the_marks_it_reads():
    # Relevance on an output that is exactly 0 goes to the ε-rule of the layer that made it: the layer must mark it.
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    with torch.no_grad():
        net[2].weight.zero_()
        net[2].bias.copy_(torch.tensor([0.0, 1.0], dtype=torch.float64))
    td = TensorDict(x=torch.randn(2, 3, dtype=torch.float64), batch_size=[2])
    target = lambda out: torch.ones_like(out)  # noqa: E731 (relevance 1 on the output that is 0, too)
    expected = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"], target=target)(td.clone())["relevance", "x"]
    lrp = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
    with lrp:
        lrp(td.clone())
        lrp.target = target
        relevance = lrp(td.clone())["relevance", "x"]
    torch.testing.assert_close(relevance, expected, rtol=1e-12, atol=1e-14)


class KeywordCall(nn.Module):
    """``out(a(input=x) * b(x))``: a product of two activations, one of them from a layer called by keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.out = nn.Linear(4, 5, bias=False), nn.Linear(4, 5, bias=False), nn.Linear(5, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.a(input=x) * self.b(x))


@pytest.mark.parametrize("epsilon", [None, 1e-12], ids=["AttnLRP", "AttnLRP-eps"])
def test_a_layer_called_by_keyword_is_an_activation_of_a_product(epsilon):
    # Its hooks see no positional input; it must not be taken for a layer of constants. The model is
    # homogeneous of degree 2 without biases, so the uniform rule conserves: the relevance sums to the logit,
    # half of gradient x input.
    torch.manual_seed(0)
    model = KeywordCall().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    relevance = LRP(model, AttnLRP(epsilon=epsilon), in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[3]))
    logits = model(x).max(-1).values
    torch.testing.assert_close(relevance["relevance", "x"].sum(-1), logits, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("mapper", [EpsilonPlus, AttnLRP, lambda: EpsilonPlusFlat(stabilize_additions=True)])
def test_a_wrapper_dropped_with_its_context_open_gives_the_model_back(mapper):
    """``lrp.__enter__()`` with no ``__exit__``, and the wrapper dropped (a notebook cell run again): once it is
    garbage collected its hooks are gone and another wrapper explains the model, as a fresh one does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 3)).double()
    x = torch.randn(3, 5, dtype=torch.float64)
    expected = LRP(model, mapper(), in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[3]))["relevance", "x"]
    before = [vars(m).keys() for m in model.modules()]
    dropped = LRP(model, mapper(), in_keys=["x"], out_keys=["y"], layers=["2"])
    dropped.__enter__()
    dropped(TensorDict(x=x, batch_size=[3]))
    assert sum(hook_count(m) for m in model.modules())
    del dropped
    gc.collect()
    assert sum(hook_count(m) for m in model.modules()) == 0
    assert [vars(m).keys() for m in model.modules()] == before  # no __getstate__ of the context's left either
    again = LRP(model, mapper(), in_keys=["x"], out_keys=["y"])
    with again:
        torch.testing.assert_close(again(TensorDict(x=x, batch_size=[3]))["relevance", "x"], expected, rtol=0, atol=0)


class TestIgnoreRuleAsked:
    """A module the caller maps to IgnoreRule gets its plain gradient under the presets that run function modes:
    the modes (AttnLRP's identity rule on a GELU, the norm rule on a layer norm's call) no longer act inside it,
    where they kept the preset's rule against the caller's mapping (the same relevance as without the mapping)."""

    @staticmethod
    def _net() -> nn.Sequential:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8, bias=False), nn.LayerNorm(8, bias=False), nn.GELU(), nn.Linear(8, 3))
        return net.double().eval()

    @staticmethod
    def _oracle(net: nn.Sequential, x: torch.Tensor, plain_norm: bool, plain_gelu: bool) -> torch.Tensor:
        """Gradient x input of the model with the rules written out: the norm's deviation held constant, the GELU's
        factor ``gelu(h) / h`` held constant (the identity rule), unless plain."""
        x = x.clone().requires_grad_(True)
        h = net[0](x)
        if plain_norm:
            h = net[1](h)
        else:
            centred = h - h.mean(-1, keepdim=True)
            h = centred / torch.sqrt(centred.detach().pow(2).mean(-1, keepdim=True) + net[1].eps) * net[1].weight
        h = net[2](h) if plain_gelu else h * (net[2](h) / h).detach()
        (grad,) = torch.autograd.grad(net[3](h)[:, 0].sum(), x)
        return x.detach() * grad

    @pytest.mark.parametrize("preset", [AttnLRP, CPLRP])
    @pytest.mark.parametrize("ignored", [(nn.LayerNorm,), (nn.GELU,), (nn.LayerNorm, nn.GELU)], ids=str)
    def test_it_gets_its_plain_gradient_and_the_others_their_rules(self, ignored, preset):
        net, x = self._net(), torch.randn(5, 4, dtype=torch.float64)
        expected = self._oracle(net, x, nn.LayerNorm in ignored, nn.GELU in ignored)
        lrp = LRP(
            net, preset(rule_mapper=dict.fromkeys(ignored, IgnoreRule())), in_keys=["x"], out_keys=["y"], target=0
        )
        with lrp:
            for _ in range(3):  # the call that records, and the planned ones after it
                relevance = lrp(TensorDict(x=x, batch_size=[5]))["relevance", "x"]
                torch.testing.assert_close(relevance, expected, rtol=1e-6, atol=1e-9)  # the GELU rule's ε: 1e-10


class _FailsAfterAnotherThreadsHook(EpsilonRule):
    """Registers, lets another thread put a hook of its own on the module, then fails."""

    def __init__(self, other: list) -> None:
        super().__init__()
        self.other = other

    def register(self, module: nn.Module):
        super().register(module)
        thread = threading.Thread(target=lambda: self.other.append(module.register_forward_hook(lambda *a: None)))
        thread.start()
        thread.join()
        raise RuntimeError("the registration failed")


def test_a_failing_registration_keeps_the_hook_another_thread_put_on_the_module():
    """A rule whose registration failed had every hook that appeared on its module meanwhile deleted: a hook of
    another thread's (a user's, a GradCAM call's) went too, with its handle still held. Only this thread's go now."""
    layer, other = nn.Linear(2, 2), []
    with pytest.raises(RuntimeError, match="the registration failed"):
        register_rule(_FailsAfterAnotherThreadsHook(other), "fc", layer)
    assert list(layer._forward_hooks) == [other[0].id]
    assert not layer._forward_pre_hooks


class _Squared(nn.Module):
    """A block with a product of its input with itself: the caller maps it to its plain gradient."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * h.sum(-1, keepdim=True)


class _WrittenIntoBlock(nn.Module):
    """``c.detach().mul_(2)`` (a write autograd does not record), then ``c`` read by a block called by keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.p, self.block, self.out = nn.Linear(4, 6), _Squared(), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.p(x)
        c.detach().mul_(2)
        return self.out(self.block(h=c))


@pytest.mark.parametrize("preset", [AttnLRP, CPLRP, EpsilonPlus], ids=lambda p: p.__name__)
def test_a_module_the_modes_pause_in_sees_its_input_given_by_keyword(preset):
    """The modes pause inside a block mapped to IgnoreRule, and the hook that pauses them checks what enters it:
    it read positional arguments only, and ``block(h=c)`` after a write autograd does not record was explained
    without a word."""
    torch.manual_seed(0)
    model = _WrittenIntoBlock().double()
    lrp = LRP(model, preset(rule_mapper={"block": IgnoreRule()}), in_keys=["x"], out_keys=["y"])
    with pytest.raises(RuntimeError, match=r"_Squared \(a module with a rule\) reads a tensor .*mul_ through"):
        lrp(TensorDict(x=torch.randn(5, 4, dtype=torch.float64), batch_size=[5]))
