"""What LRP explains: the target picks the output units and sets the initial relevance; bad targets are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule, TensorDictSequential
from zennit import rules as zrules
from zennit.composites import LayerMapComposite

from tdhook.attribution import LRP, Saliency
from tdhook.attribution.mappers.presets import EpsilonPlus
from tdhook.attribution.rules import AlphaBetaRule, EpsilonRule, FlatRule, GammaRule, WSquareRule, ZBoxRule
from tests.attribution._helpers import ExpectsARefusal, explain, mlp


class TestInitialRelevance:
    @pytest.mark.parametrize(
        "target,index",
        [(1, torch.tensor([1, 1, 1])), (torch.tensor([0, 2, 1]), torch.tensor([0, 2, 1]))],
    )
    def test_int_and_tensor_targets_pick_the_unit(self, target, index):
        net = mlp(bias=False)
        td = explain(net, torch.randn(3, 5, dtype=torch.float64), rule_mapper=EpsilonPlus(epsilon=1e-12), target=target)
        expected = td["y"].gather(-1, index.unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(td["relevance", "x"].sum(-1), expected, rtol=1e-9, atol=1e-12)

    @pytest.mark.parametrize("method", ["LRP", "Saliency"])
    def test_negative_indices_count_from_the_last_unit_for_an_int_and_a_tensor_alike(self, method):
        # Before, an int -1 was the last unit while a LongTensor holding -1 was refused.
        torch.manual_seed(0)
        layer = torch.nn.Linear(5, 3, bias=False).double()
        x = torch.randn(4, 5, dtype=torch.float64)
        module = TensorDictModule(layer, in_keys=["x"], out_keys=["y"])
        wrapper = {"LRP": lambda t: LRP(module, target=t), "Saliency": lambda t: Saliency(module, target=t)}[method]
        key = "relevance" if method == "LRP" else "attribution"
        # Gradient × input of one Linear (LRP-0) is x ⊙ W[unit]; the gradient alone, W[unit] (Saliency's absolute
        # value of it).
        oracle = {"LRP": lambda unit: x * layer.weight[unit], "Saliency": lambda unit: layer.weight[unit].abs()}[method]
        units = torch.tensor([-1, -3, 0, -2])
        for target, unit in [
            (-1, torch.full((4,), 2)),
            (torch.full((4,), -1), torch.full((4,), 2)),
            (units, units % 3),
        ]:
            actual = wrapper(target)(TensorDict(x=x, batch_size=[4]))[key, "x"]
            torch.testing.assert_close(actual, oracle(unit).detach().expand_as(x), rtol=1e-12, atol=1e-14)

    def test_callable_target_sets_initial_relevance(self):
        net = mlp(bias=False)
        td = explain(
            net, torch.randn(3, 5, dtype=torch.float64), rule_mapper=EpsilonPlus(epsilon=1e-12), target=lambda y: y
        )
        torch.testing.assert_close(td["relevance", "x"].sum(-1), td["y"].sum(-1), rtol=1e-9, atol=1e-12)

    def test_target_all_equals_stacked_single_targets(self):
        net = mlp()
        x = torch.randn(3, 5, dtype=torch.float64)
        every = explain(net, x, rule_mapper=EpsilonPlus(), target="all")["relevance", "x"]
        singles = torch.stack(
            [explain(net, x, rule_mapper=EpsilonPlus(), target=k)["relevance", "x"] for k in range(3)], 1
        )
        assert every.shape == (3, 3, 5)
        torch.testing.assert_close(every, singles)


class TestBadTarget(ExpectsARefusal):
    def test_target_out_of_range(self):
        td = TensorDict(x=torch.randn(2, 5, dtype=torch.float64), batch_size=[2])
        self.run_and_expect(td, IndexError, "target 7 is out of range for output 'y' with 3 units", target=7)

    def test_target_indices_out_of_range(self):
        td = TensorDict(x=torch.randn(2, 5, dtype=torch.float64), batch_size=[2])
        self.run_and_expect(td, IndexError, r"\[-3, 3\) for output 'y'", target=torch.tensor([0, 3]))
        self.run_and_expect(td, IndexError, r"\[-3, 3\) for output 'y'.*from -4 to 0", target=torch.tensor([0, -4]))

    def test_an_int_on_a_one_unit_output_says_where_units_are_picked(self):
        """A value head, or a QValueActor's chosen action value (its default target): "with 1 units" before, and
        nothing on how to explain an action's unit."""
        value = TensorDictModule(torch.nn.Linear(5, 1), in_keys=["x"], out_keys=["value"])
        td = TensorDict(x=torch.randn(2, 5), batch_size=[2])
        with pytest.raises(
            IndexError, match=r"output 'value' with 1 unit in its last dimension \(a value, .* target_key, such as"
        ):
            LRP(value, EpsilonPlus(), target=1)(td)

    @pytest.mark.parametrize("given", [[0, 2], (0, 2)], ids=["list", "tuple"])
    def test_a_list_of_indices_points_to_a_long_tensor(self, given):
        """captum takes per-sample targets as a list of ints: "got list" was all it said."""
        td = TensorDict(x=torch.randn(2, 5, dtype=torch.float64), batch_size=[2])
        self.run_and_expect(td, TypeError, r"got (list|tuple); .* LongTensor, torch\.tensor\(\[0, 2\]\)$", target=given)

    def test_a_callable_that_returns_unit_indices_points_to_the_indices_as_target(self):
        td = TensorDict(x=torch.randn(2, 5, dtype=torch.float64), batch_size=[2])
        match = r"shaped like output 'y' \(2, 3\), got torch\.Size\(\[2\]\); it returned unit indices .* target=indices"
        self.run_and_expect(td, ValueError, match, target=lambda y: y.argmax(-1))

    @pytest.mark.parametrize("owner", [LRP, Saliency])
    def test_a_target_key_not_written_is_named_with_the_outputs(self, owner):
        policy = TensorDictSequential(
            TensorDictModule(torch.nn.Linear(5, 3), in_keys=["x"], out_keys=["hidden"]),
            TensorDictModule(torch.nn.Linear(3, 2), in_keys=["hidden"], out_keys=["logits"]),
        )
        with pytest.raises(
            KeyError, match=r"target key 'logit' was not written .*; its outputs are \['hidden', 'logits'\]"
        ):
            owner(policy, target_key="logit")(TensorDict(x=torch.randn(2, 5), batch_size=[2]))


class TestDefaultTargetKey:
    def test_states_for_the_next_step_come_after_the_action_output(self):
        from tensordict.nn import TensorDictModule, TensorDictSequential

        from tdhook.attribution.targets import resolve_target_key

        # A recurrent core writes its next state under "next" before the head writes the action values.
        core = TensorDictModule(
            lambda x: (x * 2, x + 1), in_keys=["observation"], out_keys=["embed", ("next", "recurrent_state")]
        )
        head = TensorDictModule(lambda e: e.sum(-1, keepdim=True), in_keys=["embed"], out_keys=["action_value"])
        policy = TensorDictSequential(core, head)
        result = policy(TensorDict(observation=torch.ones(2, 3), batch_size=[2]))
        assert resolve_target_key(result, None, policy) == "action_value"
        # With nothing else unread, the next state is still a candidate.
        assert resolve_target_key(core(TensorDict(observation=torch.ones(2, 3), batch_size=[2])), None, core) == "embed"
        alone = TensorDictModule(lambda x: x + 1, in_keys=["observation"], out_keys=[("next", "recurrent_state")])
        result = alone(TensorDict(observation=torch.ones(2, 3), batch_size=[2]))
        assert resolve_target_key(result, None, alone) == ("next", "recurrent_state")


class TestTargetKeyArgument:
    """A ``target_key`` that is no key is refused by name at construction: a list (``["y"]``) failed with
    tensordict's ``key should be a Sequence<NestedKey>``, and a tuple holding a number (``("y", 0)``) was read as
    ``"y"``, the number dropped."""

    @pytest.mark.parametrize("owner", [LRP, Saliency], ids=["LRP", "Saliency"])
    @pytest.mark.parametrize(
        "target_key",
        [["y"], 3, b"y", ("y", 0), ("y", ["z"]), {"a": ["y"]}, {"a": ("y", 1)}],
        ids=["list", "int", "bytes", "tuple-with-int", "tuple-with-list", "dict-of-list", "dict-of-tuple-with-int"],
    )
    def test_a_target_key_that_is_no_key_is_named(self, owner, target_key):
        policy = TensorDictModule(mlp(), in_keys=["x"], out_keys=["y"])
        with pytest.raises(TypeError, match=rf"{owner.__name__}: target_key must be a key \(a str or a tuple of str"):
            owner(policy, target_key=target_key)

    @pytest.mark.parametrize("target_key", ["y", ("y",), (("y",),)])
    def test_keys_written_as_nested_tuples_are_the_same_key(self, target_key):
        policy = TensorDictModule(mlp(), in_keys=["x"], out_keys=["y"])
        x = torch.randn(4, 5, dtype=torch.float64)
        got = LRP(policy, target_key=target_key)(TensorDict(x=x, batch_size=[4]))["relevance", "x"]
        expected = LRP(policy)(TensorDict(x=x, batch_size=[4]))["relevance", "x"]
        assert torch.equal(got, expected)


def explicit_epsilon_lrp(layers: list[torch.nn.Module], x: torch.Tensor, relevance: torch.Tensor, eps: float):
    """ε-LRP written out layer by layer (zennit's formula): R_in = a · Wᵀ (R / stabilize(z, ε))."""
    activations = [x]
    for layer in layers:
        activations.append(layer(activations[-1]))
    for layer, a, z in zip(reversed(layers), reversed(activations[:-1]), reversed(activations[1:]), strict=True):
        if isinstance(layer, torch.nn.Linear):
            stabilized = z + eps * torch.where(z >= 0, 1.0, -1.0).to(z.dtype)
            relevance = a * ((relevance / stabilized) @ layer.weight)
    return relevance


ZERO_OUTPUT_RULES = {  # tdhook's rule and zennit's, by name
    "zplus": (lambda: AlphaBetaRule(1.0, 0.0), lambda: zrules.ZPlus()),
    "alpha2beta1": (lambda: AlphaBetaRule(2.0, 1.0), lambda: zrules.AlphaBeta(2.0, 1.0)),
    "epsilon": (lambda: EpsilonRule(1e-2), lambda: zrules.Epsilon(1e-2)),
    "flat": (lambda: FlatRule(), lambda: zrules.Flat()),
    "wsquare": (lambda: WSquareRule(), lambda: zrules.WSquare()),
}


def assert_zero_outputs_relevance_is_zennits(net, layer, rule, x, start, create_graph=False):
    """The relevance of a callable target ``start`` equals zennit's with ``rule`` on every ``layer``, and would
    not without the relevance put on the outputs that are exactly 0."""
    ours, theirs = (make() for make in ZERO_OUTPUT_RULES[rule])
    mapper = {layer: ours}
    relevance = explain(net, x, rule_mapper=mapper, target=lambda y: start.clone(), create_graph=create_graph)
    leaf = x.clone().requires_grad_(True)
    with LayerMapComposite([(layer, theirs)]).context(net):
        (expected,) = torch.autograd.grad(net(leaf), leaf, start)  # zennit's input gradient is the relevance
    without = explain(net, x, rule_mapper=mapper, target=lambda y: start * (y != 0))["relevance", "x"]
    assert (expected - without).abs().max() > 0.1
    torch.testing.assert_close(relevance["relevance", "x"].detach(), expected, rtol=1e-10, atol=1e-10)


class TestCallableTargets:
    def zero_output_net(self) -> torch.nn.Sequential:
        net = torch.nn.Sequential(
            torch.nn.Linear(2, 2, bias=False), torch.nn.ReLU(), torch.nn.Linear(2, 2, bias=False)
        ).double()
        with torch.no_grad():
            net[0].weight.copy_(torch.tensor([[1.0, 0.5], [0.5, 1.0]]))
            net[2].weight.copy_(torch.tensor([[1.0, -1.0], [1.0, 2.0]]))
        return net

    def test_relevance_put_on_an_output_that_is_exactly_zero_is_kept(self):
        net = self.zero_output_net()
        x = torch.tensor([[2.0, 2.0], [4.0, 4.0]], dtype=torch.float64)  # equal hidden units: output 0 is exactly 0
        assert (net(x)[:, 0] == 0).all()
        start = torch.tensor([[1.0, 0.5], [-2.0, 0.0]], dtype=torch.float64)
        td = explain(net, x, rule_mapper=EpsilonPlus(epsilon=1e-3), target=lambda y: start.clone())
        expected = explicit_epsilon_lrp(list(net), x, start, 1e-3)
        assert expected.abs().min() > 1  # R / ε at the zero output dominates
        torch.testing.assert_close(td["relevance", "x"], expected, rtol=1e-10, atol=1e-10)

    @staticmethod
    def signed_zero_output_net() -> torch.nn.Sequential:
        """Output 0 is exactly 0 for inputs with x_0 = x_1 (hidden units 0 and 1 equal), of either sign."""
        net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 2)).double()
        with torch.no_grad():
            net[0].weight.copy_(torch.tensor([[1.0, 0.5], [0.5, 1.0], [1.0, -0.75]]))
            net[0].bias.copy_(torch.tensor([0.25, 0.25, -0.5]))
            net[1].weight.copy_(torch.tensor([[1.0, -1.0, 0.0], [1.0, 2.0, -1.5]]))
            net[1].bias.copy_(torch.tensor([0.0, 0.5]))
        return net

    @pytest.mark.parametrize("rule", ["zplus", "alpha2beta1", "epsilon"])
    @pytest.mark.parametrize("inputs", ["signed", "after a ReLU"])  # z⁺'s general path, and its path for x ≥ 0
    @pytest.mark.parametrize("create_graph", [False, True])
    def test_relevance_on_a_zero_output_flows_as_zennits_rule_sends_it(self, rule, inputs, create_graph):
        if inputs == "signed":
            net = self.signed_zero_output_net()
            x = torch.tensor([[2.0, 2.0], [-1.0, -1.0], [3.0, -1.0]], dtype=torch.float64)
        else:
            net = self.zero_output_net()
            x = torch.tensor([[2.0, 2.0], [4.0, 4.0], [1.0, 3.0]], dtype=torch.float64)
        assert (net(x)[:2, 0] == 0).all() and (net(x)[2] != 0).all()  # rows 0 and 1: output 0 is exactly 0
        start = torch.tensor([[1.0, 0.5], [-2.0, 0.25], [0.5, 1.0]], dtype=torch.float64)
        assert_zero_outputs_relevance_is_zennits(net, torch.nn.Linear, rule, x, start, create_graph)

    @pytest.mark.parametrize("rule", ["flat", "wsquare", "zplus"])
    @pytest.mark.parametrize("create_graph", [False, True])
    def test_relevance_on_zero_outputs_of_a_first_layer_flows_as_zennits_rule_sends_it(self, rule, create_graph):
        net = torch.nn.Linear(2, 2).double()  # the layer that reads the input makes the output
        with torch.no_grad():
            net.weight.copy_(torch.tensor([[1.0, -1.0], [1.0, 2.0]]))
            net.bias.copy_(torch.tensor([0.0, 0.5]))
        x = torch.tensor([[2.0, 2.0], [0.0, 0.0], [-1.0, -1.0], [3.0, -1.0]], dtype=torch.float64)
        assert (net(x)[:3, 0] == 0).all() and (net(x)[3] != 0).all()  # row 1: zero inputs too
        start = torch.tensor([[1.0, 0.5], [-2.0, 0.25], [0.75, -1.0], [0.5, 1.0]], dtype=torch.float64)
        assert_zero_outputs_relevance_is_zennits(net, torch.nn.Linear, rule, x, start, create_graph)

    @pytest.mark.parametrize("rule", ["zplus", "alpha2beta1", "epsilon"])
    @pytest.mark.parametrize("create_graph", [False, True])
    def test_relevance_on_outputs_too_small_to_divide_by_flows_as_zennits_rule_sends_it(self, rule, create_graph):
        # Outputs of ±1e-310: relevance / output overflows, and the relevance of every sample was inf or NaN
        # where zennit's is finite; such outputs now go as outputs of 0 do (Rule.zero_output_seeds).
        net = self.signed_zero_output_net()
        with torch.no_grad():
            net[1].weight[0] *= 1e-310
            net[1].bias.zero_()
        x = torch.tensor([[2.0, 1.0], [-1.0, 3.0], [3.0, -1.0]], dtype=torch.float64)
        y = net(x).detach()
        assert (y[:, 0] != 0).all() and (y[:, 0].abs() < 1e-300).all() and (y[:, 0] < 0).any() and (y[:, 0] > 0).any()
        start = torch.tensor([[1.0, 0.5], [-2.0, 0.25], [0.5, 1.0]], dtype=torch.float64)
        ours, theirs = (make() for make in ZERO_OUTPUT_RULES[rule])
        relevance = explain(net, x, rule_mapper={torch.nn.Linear: ours}, target=lambda y: start.clone(),
                            create_graph=create_graph)["relevance", "x"].detach()  # fmt: skip
        leaf = x.clone().requires_grad_(True)
        with LayerMapComposite([(torch.nn.Linear, theirs)]).context(net):
            (expected,) = torch.autograd.grad(net(leaf), leaf, start)
        torch.testing.assert_close(relevance, expected, rtol=1e-10, atol=1e-10)

    @pytest.mark.parametrize("rule", ["zplus", "alpha2beta1", "epsilon"])
    def test_relevance_on_zero_outputs_of_a_convolution_flows_as_zennits_rule_sends_it(self, rule):
        torch.manual_seed(0)
        net = torch.nn.Sequential(
            torch.nn.Conv2d(1, 2, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(2, 1, (1, 2))
        ).double()
        with torch.no_grad():  # positive hidden maps; horizontal differences: 0 where a hidden row is constant
            net[0].weight.abs_()
            net[0].bias.fill_(0.1)
            net[2].weight.copy_(torch.tensor([[[[1.0, -1.0]], [[0.5, -0.5]]]]))
            net[2].bias.zero_()
        x = torch.ones(2, 1, 5, 5, dtype=torch.float64)
        x[1] = torch.randn(5, 5, dtype=torch.float64)
        assert 5 < int((net(x) == 0).sum()) < net(x).numel()
        start = torch.randn(2, 1, 5, 4, dtype=torch.float64)
        assert_zero_outputs_relevance_is_zennits(net, torch.nn.Conv2d, rule, x, start)

    @pytest.mark.parametrize(
        ("last", "made_by"),
        [
            ("tanh", "its producer"),
            ("lrp0", "Linear with EpsilonRule"),
            ("gamma", "Linear with GammaRule"),
            ("zbox", "Linear with ZBoxRule"),
        ],
    )
    def test_relevance_on_a_zero_output_no_rule_carries_is_refused_naming_the_entries(self, last, made_by):
        net = self.zero_output_net()
        mapper = EpsilonPlus()
        if last == "tanh":
            net = torch.nn.Sequential(*net, torch.nn.Tanh())
        elif last == "zbox":  # its denominator z - l w⁺ - h w⁻ is taken from the output: not carried (yet)
            net = net[2]
            mapper = {"module": ZBoxRule(low=-10.0, high=10.0)}
        else:
            mapper = {"module.2": EpsilonRule(0.0) if last == "lrp0" else GammaRule(0.25)}
        x = torch.tensor([[2.0, 2.0], [1.0, 3.0], [4.0, 4.0]], dtype=torch.float64)  # rows 0 and 2: output 0 is 0
        td = TensorDict(x=x, batch_size=[3])
        lrp = LRP(TensorDictModule(net, in_keys=["x"], out_keys=["y"]), rule_mapper=mapper, target=torch.ones_like)
        match = rf"puts relevance 2 on 2 entries of output 'y' that are exactly 0 \(at \(0, 0\), \(2, 0\)\); {made_by}"
        with pytest.raises(ValueError, match=match):
            lrp(td)
        assert list(td.keys()) == ["x"]
        td = lrp(TensorDict(x=x[1:2], batch_size=[1]))  # no zero output: explained
        assert td["relevance", "x"].shape == (1, 2)

    def test_a_nan_from_a_callable_target_is_refused_naming_it(self):
        def nan_for_the_first_unit(y):
            return y.clone().index_fill_(-1, torch.tensor([0]), float("nan"))

        with pytest.raises(ValueError, match=r"callable target .*nan_for_the_first_unit returned nan at \(0, 0\)"):
            explain(mlp(), torch.randn(3, 5, dtype=torch.float64), target=nan_for_the_first_unit)


class TestUnreachedInputs(ExpectsARefusal):
    def test_a_target_that_ignores_an_explained_key_is_refused_naming_both(self):
        net = mlp()
        module = TensorDictModule(lambda x, z: net(x), in_keys=["x", "z"], out_keys=["y"])
        td = TensorDict(
            x=torch.randn(2, 5, dtype=torch.float64), z=torch.randn(2, 5, dtype=torch.float64), batch_size=[2]
        )
        with pytest.raises(ValueError, match=r"target 'y' does not depend on the explained input 'z'"):
            LRP(module)(td)
        assert "relevance" not in td.keys()

    def test_an_output_made_of_parameters_alone_is_refused(self):
        bias = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
        module = TensorDictModule(lambda x: bias.expand(*x.shape[:-1], 3), in_keys=["x"], out_keys=["y"])
        td = TensorDict(x=torch.randn(2, 5, dtype=torch.float64), batch_size=[2])
        with pytest.raises(ValueError, match=r"target 'y' does not depend on the explained input 'x'"):
            LRP(module)(td)

    def test_a_query_cp_lrp_holds_constant_is_refused_saying_so(self):
        """A cross-attention's query reaches its output only through the attention weights, which CP-LRP holds
        constant: the refusal says so (it named only a model that does not read the key or detaches it)."""
        from tdhook.attribution import CPLRP

        class CrossAttention(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.attention = torch.nn.MultiheadAttention(8, 2, batch_first=True)

            def forward(self, query: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
                return self.attention(query, memory, memory)[0].sum(1)

        module = TensorDictModule(CrossAttention().eval(), in_keys=["query", "memory"], out_keys=["y"])
        td = TensorDict(query=torch.randn(2, 3, 8), memory=torch.randn(2, 4, 8), batch_size=[2])
        with pytest.raises(ValueError, match=r"explained input 'query'.*a rule holds constant.*CP-LRP's attention"):
            LRP(module, CPLRP())(td)
        assert "relevance" not in td.keys()

    def test_per_sample_weights_beside_explained_tokens_are_refused_saying_so(self):
        """An ``nn.EmbeddingBag`` whose tokens are explained holds its per-sample weights constant (the tokens take
        the relevance): the refusal says so."""

        class Bag(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.bag, self.head = torch.nn.EmbeddingBag(10, 4, mode="sum"), torch.nn.Linear(4, 2)

            def forward(self, tokens: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
                return self.head(self.bag(tokens, per_sample_weights=weights))

        module = TensorDictModule(Bag(), in_keys=["tokens", "weights"], out_keys=["y"])
        td = TensorDict(tokens=torch.randint(0, 10, (2, 3)), weights=torch.rand(2, 3), batch_size=[2])
        with pytest.raises(ValueError, match=r"explained input 'weights'.*per_sample_weights"):
            LRP(module, EpsilonPlus())(td)


def test_target_all_holds_the_result_once():
    """Each unit's relevance is written into its place in the result: memory is the result and one unit, not the
    result twice (all units, then their stack). Peak resident memory is measured in a fresh process."""
    import subprocess
    import sys

    script = """
import resource, torch
from torch import nn
from tensordict import TensorDict
from tdhook.attribution import LRP, Saliency
torch.set_num_threads(1)
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(20000, 8), nn.ReLU(), nn.Linear(8, 20))
x = torch.randn(64, 20000)
lrp = LRP(net, in_keys=["x"], out_keys=["y"], target="all")
lrp(TensorDict(x=x[:2], batch_size=[2]))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = lrp(TensorDict(x=x, batch_size=[64]))["relevance", "x"]
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) * 1024 / (out.numel() * out.element_size()))
"""
    ratio = float(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout)
    assert ratio < 1.8, f"target='all' grew the peak memory by {ratio:.2f} times its result"


def _append_step(pipeline: TensorDictSequential) -> None:
    pipeline.module.append(TensorDictModule(torch.nn.Linear(2, 5, bias=False).double(), in_keys=["y"], out_keys=["z"]))


def _rename_output(pipeline: TensorDictSequential) -> None:
    pipeline.module[-1].out_keys = ["z"]


@pytest.mark.parametrize("change", [_append_step, _rename_output], ids=["a step appended", "the output renamed"])
def test_the_default_target_follows_a_pipeline_changed_inside_the_context(change):
    """The default target keys are kept while a context is open, and found again where the pipeline's modules or
    keys change: the call explains what the same call outside the context explains."""
    torch.manual_seed(9)
    pipeline = TensorDictSequential(
        TensorDictModule(torch.nn.Linear(3, 4, bias=False).double(), in_keys=["x"], out_keys=["h"]),
        TensorDictModule(torch.nn.Linear(4, 2, bias=False).double(), in_keys=["h"], out_keys=["y"]),
    )
    td = TensorDict(x=torch.randn(6, 3, dtype=torch.float64), batch_size=[6])
    lrp = LRP(pipeline)
    with lrp:
        lrp(td.clone())
        change(pipeline)
        inside = lrp(td.clone())
    outside = lrp(td.clone())
    assert "z" in outside.keys()
    torch.testing.assert_close(inside["relevance", "x"], outside["relevance", "x"], rtol=1e-12, atol=1e-12)
    # LRP-0 on Linear layers without bias: the relevance sums to the explained output, the last step's maximum.
    total = outside["z"].max(-1).values
    torch.testing.assert_close(inside["relevance", "x"].sum(-1), total, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    ("numpy_target", "torch_target"),
    [
        (np.int64(2), 2),
        (np.uint8(1), 1),
        (np.array([0, 3, 1]), torch.tensor([0, 3, 1])),
        (np.array([[2], [0], [1]], dtype=np.int32), torch.tensor([[2], [0], [1]])),
        # Unsigned indices compared with the lower bound -units wrapped it: refused as out of range [-4, 4).
        (np.array([0, 3, 1], dtype=np.uint8), torch.tensor([0, 3, 1])),
        (torch.tensor([2, 0, 1], dtype=torch.uint8), torch.tensor([2, 0, 1])),
    ],
    ids=["int64", "uint8", "array", "column", "uint8-array", "uint8-tensor"],
)
@pytest.mark.parametrize("method", [LRP, Saliency])
def test_a_numpy_action_is_a_target(method, numpy_target, torch_target):
    """Actions from a gymnasium environment or a numpy argmax index the output as ints and LongTensors do."""
    torch.manual_seed(0)
    policy = TensorDictModule(torch.nn.Linear(3, 4).double(), in_keys=["observation"], out_keys=["action_value"])
    td = TensorDict(observation=torch.randn(3, 3, dtype=torch.float64), batch_size=[3])
    key = "relevance" if method is LRP else "attribution"
    got = method(policy, target=numpy_target)(td.clone())[key, "observation"]
    torch.testing.assert_close(got, method(policy, target=torch_target)(td.clone())[key, "observation"])


def test_a_numpy_array_of_floats_is_no_target():
    policy = TensorDictModule(torch.nn.Linear(3, 4), in_keys=["observation"], out_keys=["action_value"])
    with pytest.raises(TypeError, match="target must be None, an int, a LongTensor"):
        LRP(policy, target=np.array([0.5, 1.0]))(TensorDict(observation=torch.randn(2, 3), batch_size=[2]))


@pytest.mark.parametrize("method", [LRP, Saliency])
@pytest.mark.parametrize(
    ("target", "dtype"),
    [(torch.tensor([0.0, 1.0]), "torch.float32"), (torch.tensor([True, False]), "torch.bool")],
    ids=["float", "bool"],
)
def test_a_tensor_of_floats_or_bools_as_target_is_named_with_its_dtype_and_output(method, target, dtype):
    """A one-hot or weight tensor from captum's habits is not a tensor of unit indices: the refusal said only
    ``got Tensor``, with neither the dtype nor the output key."""
    policy = TensorDictModule(torch.nn.Linear(3, 4), in_keys=["observation"], out_keys=["action_value"])
    with pytest.raises(TypeError, match=rf"target for output 'action_value' .* got a {dtype} tensor.*target=lambda"):
        method(policy, target=target)(TensorDict(observation=torch.randn(2, 3), batch_size=[2]))


def test_a_default_target_left_out_of_the_pipelines_result_is_named_absent():
    """``selected_out_keys`` can leave the pipeline's final output out of its result: the error said it was not a
    floating-point tensor."""
    body = TensorDictModule(torch.nn.Linear(3, 4), in_keys=["observation"], out_keys=["hidden"])
    head = TensorDictModule(torch.nn.Linear(4, 2), in_keys=["hidden"], out_keys=["action_value"])
    pipeline = TensorDictSequential(body, head, selected_out_keys=["hidden"])
    td = TensorDict(observation=torch.randn(2, 3), batch_size=[2])
    with pytest.raises(KeyError, match=r"in its result \('action_value': absent\); pass target_key"):
        LRP(pipeline)(td)
    assert list(td.keys()) == ["observation"]


class Detections(torch.nn.Module):
    """A detector's output as torchvision's detection models give it: a list of dicts, one per image."""

    def __init__(self) -> None:
        super().__init__()
        self.score = torch.nn.Linear(4, 3)

    def forward(self, images: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        return [{"scores": self.score(image)} for image in images]


def test_outputs_that_hold_python_objects_are_named_with_the_way_to_explain_them():
    """A list of dicts was refused with "pass target_key", which no key of the result can satisfy."""
    detector = TensorDictModule(Detections(), in_keys=["images"], out_keys=["detections"])
    td = TensorDict(images=torch.randn(2, 4), batch_size=[])
    with pytest.raises(KeyError, match=r"'detections': NonTensor.*Python objects .* wrap the model in a module that"):
        LRP(detector)(td)
    assert list(td.keys()) == ["images"]


@pytest.mark.parametrize("target_key", [None, "logits"])
def test_an_output_left_out_by_selected_out_keys_is_named_with_what_to_do(target_key):
    """A policy built with ``selected_out_keys=["action"]`` computes its logits and drops them from its result. The
    refusal said that ``'logits'`` was not written by the module, which it is; it now names the selection that leaves
    it out. Selected too, the logits are explained as the same network's (≤ 1e-12)."""
    from tensordict.nn import ProbabilisticTensorDictModule, ProbabilisticTensorDictSequential
    from torch.distributions import Categorical

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    td = TensorDict(obs=torch.randn(5, 4, dtype=torch.float64), batch_size=[5])

    def policy(selected: list[str]) -> ProbabilisticTensorDictSequential:
        sample = ProbabilisticTensorDictModule(["logits"], ["action"], distribution_class=Categorical)
        return ProbabilisticTensorDictSequential(
            TensorDictModule(net, ["obs"], ["logits"]), sample, selected_out_keys=selected
        )

    message = r"selected out keys \['action'\] of ProbabilisticTensorDictSequential leave out \['logits'\]"
    for method in (lambda m, **kw: LRP(m, EpsilonPlus(), **kw), Saliency):
        with pytest.raises(KeyError, match=message):
            method(policy(["action"]), target_key=target_key)(td.clone())
        got = method(policy(["logits", "action"]), target_key=target_key)(td.clone())
        expected = method(TensorDictModule(net, ["obs"], ["logits"]))(td.clone())
        key = "relevance" if "relevance" in got.keys() else "attribution"
        torch.testing.assert_close(got[key, "obs"], expected[key, "obs"], rtol=0, atol=1e-12)


@pytest.mark.parametrize("wrapper", ["LRP", "Saliency"])
def test_a_module_skipped_under_set_skip_existing_is_named_and_nothing_is_changed(wrapper):
    """Under tensordict's ``set_skip_existing(True)`` a module whose output keys the TensorDict holds skips its call:
    the target is the value held, with no gradient, and the error said only that it did not depend on the inputs."""
    from tensordict.nn import set_skip_existing

    net = torch.nn.Linear(4, 3)
    module = TensorDictModule(net, ["obs"], ["y"])
    make = {"LRP": lambda: LRP(module, EpsilonPlus()), "Saliency": lambda: Saliency(module)}[wrapper]
    td = TensorDict(obs=torch.randn(2, 4), y=torch.zeros(2, 3), batch_size=[2])
    before = td.clone()
    with set_skip_existing(True), pytest.raises(ValueError, match=r"target 'y' .* set_skip_existing\(True\) is in"):
        make()(td)
    assert (td == before).all() and set(td.keys(True, True)) == set(before.keys(True, True))
    with set_skip_existing(True):  # without the output key, the module runs and is explained
        out = make()(TensorDict(obs=before["obs"], batch_size=[2]))
    assert out["y"].abs().sum() > 0
