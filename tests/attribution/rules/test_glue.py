"""carry_back: relevance at a layer's input given to the inputs it was computed from, position by position."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from tdhook.attribution.rules._glue import GlueError, carry_back, input_leaves, whole_records


def carried(x: torch.Tensor, relevance: torch.Tensor) -> list[torch.Tensor]:
    return [r for _, r in carry_back(x, relevance, "rule on layer")]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_elementwise_affine_glue_keeps_positions(dtype):
    torch.manual_seed(0)
    u = torch.randn(3, 700, dtype=dtype, requires_grad=True)  # more positions than one probe digit holds
    scale = torch.rand(700, dtype=dtype) + 0.5
    relevance = torch.randn(3, 700, dtype=dtype)
    (back,) = carried(u * scale - 1.0, relevance)
    torch.testing.assert_close(back, relevance, rtol=0, atol=0)


def test_reshapes_permutations_and_concatenations_map_each_position():
    a = torch.randn(2, 3, requires_grad=True)
    b = torch.randn(2, 4, requires_grad=True)
    x = torch.cat([a.flip(-1) * 2, b.t().reshape(2, 4)], dim=-1)
    relevance = torch.arange(1.0, 15.0).view(2, 7)
    back = {id(leaf): r for leaf, r in carry_back(x, relevance, "rule on layer")}
    back_a, back_b = back[id(a)], back[id(b)]
    torch.testing.assert_close(back_a, relevance[:, :3].flip(-1))
    torch.testing.assert_close(back_b.t().reshape(2, 4), relevance[:, 3:])


def test_a_broadcast_input_collects_its_copies_and_constants_keep_theirs():
    u = torch.randn(2, 1, requires_grad=True)
    x = F.pad(u.expand(2, 3), (1, 0))  # a padded constant column, then three copies of u
    relevance = torch.ones(2, 4)
    (back,) = carried(x, relevance)
    torch.testing.assert_close(back, torch.full((2, 1), 3.0))


@pytest.mark.parametrize("glue", ["sum", "difference", "matmul", "mean"])
def test_glue_mixing_positions_raises(glue):
    torch.manual_seed(0)
    u = torch.randn(2, 4, requires_grad=True)
    x = {
        "sum": lambda: u + u.roll(1, -1),
        "difference": lambda: u - u.roll(1, -1),
        "matmul": lambda: u @ torch.randn(4, 4),
        "mean": lambda: u.mean(-1, keepdim=True).expand(2, 4),
    }[glue]()
    with pytest.raises(GlueError, match="rule on layer: .* several input positions"):
        carry_back(x, torch.ones(2, 4), "rule on layer")


def test_leaves_and_layers_are_found_through_the_graph():
    u = torch.randn(2, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(2))
    leaves, through_layer = input_leaves(u * w)
    assert [leaf is u for leaf in leaves] == [True] and not through_layer


class TestWholeRecords:
    """Which first-layer inputs give all their relevance to the input positions through glue."""

    def test_a_shifted_input_gives_each_position_its_relevance(self):

        u = torch.randn(2, 3, requires_grad=True)
        relevance = torch.randn(2, 3)
        ((leaf, carried),), left = whole_records(object(), nn.Identity(), (u - 0.5) * 4, relevance)
        assert leaf is u and torch.equal(carried, relevance)
        assert not left.any()

    def test_positions_that_mix_inputs_are_left_to_the_gradient_and_only_they(self):
        # One mixed feature beside a normaliser once sent every position to the gradient, where the shift's
        # positions got R (x - b) / x: the fix of the normaliser undone by a feature beside it.
        u = torch.randn(2, 3, requires_grad=True)
        x = torch.cat([(u - 0.5) * 4, u.mean(-1, keepdim=True)], -1)
        relevance = torch.randn(2, 4)
        ((leaf, carried),), left = whole_records(object(), nn.Identity(), x, relevance)
        assert leaf is u and torch.equal(carried, relevance[:, :3])
        assert torch.equal(left, torch.cat([torch.zeros(2, 3), relevance[:, 3:]], -1))

    @pytest.mark.parametrize(
        "move",
        [lambda u: u.flatten(1), lambda u: u.clone().transpose(1, 2).flip(-1), lambda u: u.unsqueeze(0)],
        ids=["flatten", "transpose-flip", "unsqueeze"],
    )
    def test_values_moved_without_a_shift_are_left_to_the_gradient(self, move):
        # x * grad carries the relevance exactly there: no Jacobian probes on every call (an MLP's nn.Flatten)

        u = torch.randn(2, 3, 4, requires_grad=True)
        x = move(u)
        assert whole_records(object(), nn.Identity(), x, torch.randn_like(x)) is None


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("positions", [700, 5000])
def test_a_normalisers_division_keeps_positions_in_every_float_type(dtype, positions: int):
    # Each rounding in the glue (the shift, the division by a deviation) shifts the digits its forward products
    # give back: read with too little headroom, a plain (u - mean) / std in float32 looked like mixed positions.
    torch.manual_seed(0)
    u = torch.rand(2, positions, dtype=dtype, requires_grad=True)
    mean, std = torch.rand(positions, dtype=dtype), torch.rand(positions, dtype=dtype) * 0.3 + 0.2
    relevance = torch.randn(2, positions, dtype=dtype)
    (back,) = carried(((u - mean) / std * 0.7 + 0.1) / 1.3, relevance)
    torch.testing.assert_close(back, relevance, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [3, 5])
def test_a_mean_of_neighbours_is_not_read_as_the_middle_one(dtype, window: int):
    # An average pool gives each affine probe the middle position's value back: its relevance went, whole and
    # silently, to the middle input. The hashed checks tell it from one owner.
    u = torch.randn(2, 1, 9, dtype=dtype, requires_grad=True)
    x = F.avg_pool1d(u, window, stride=1) - 0.5  # no edge: every position a mean of its neighbours
    with pytest.raises(GlueError, match="several input positions"):
        carried(x, torch.ones_like(x))


class TestZeroedByTheGlue:
    """A first-layer rule's relevance at entries a ReLU before the layer zeroed reaches no model input (the glue's
    gradient is 0 there; zennit's Pass hands it on): the wrapper warns once per context, naming the layer."""

    @staticmethod
    def _explain(net: nn.Module, x: torch.Tensor, calls: int = 3) -> torch.Tensor:
        from tensordict import TensorDict

        from tdhook.attribution import LRP, EpsilonPlusFlat

        first = lambda y: torch.zeros_like(y).index_fill_(1, torch.tensor([0]), 1.0) * y  # noqa: E731
        with LRP(net, rule_mapper=EpsilonPlusFlat(), in_keys=["x"], out_keys=["y"], target=first) as lrp:
            for _ in range(calls):
                relevance = lrp(TensorDict(x=x, batch_size=[x.shape[0]]))["relevance", "x"]
        return relevance

    def test_a_relu_before_the_first_layer_warns_by_name_once(self):
        torch.manual_seed(0)
        net = nn.Sequential(nn.ReLU(), nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
        x = torch.randn(5, 3, dtype=torch.float64)
        with pytest.warns(UserWarning, match=r"FlatRule on Linear: .* zeroed \(Relu") as caught:
            self._explain(net, x)
        assert sum("zeroed" in str(w.message) for w in caught) == 1

    def test_calls_outside_a_context_warn_once(self):
        """Each call outside a context enters one of its own: the warning came again at every call (a rollout
        heard it at every step), where the wrapper's other warnings about its model come once. The relevance stays
        zennit's LRP with the zeroed entries' share dropped: the same in every call."""
        import warnings

        from tensordict import TensorDict

        from tdhook.attribution import LRP, EpsilonPlusFlat

        torch.manual_seed(0)
        net = nn.Sequential(nn.ReLU(), nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
        x = torch.randn(5, 3, dtype=torch.float64)
        lrp = LRP(net, rule_mapper=EpsilonPlusFlat(), in_keys=["x"], out_keys=["y"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            relevances = [lrp(TensorDict(x=x, batch_size=[5]))["relevance", "x"] for _ in range(3)]
            with lrp:
                relevances.append(lrp(TensorDict(x=x, batch_size=[5]))["relevance", "x"])
        assert sum("zeroed" in str(w.message) for w in caught) == 1
        for relevance in relevances[1:]:
            torch.testing.assert_close(relevance, relevances[0])

    @pytest.mark.parametrize(
        "glue", [nn.Identity(), nn.ReLU(), nn.Tanh(), nn.ZeroPad1d(1)], ids=["none", "relu-on-positive", "tanh", "pad"]
    )
    def test_no_warning_where_nothing_is_zeroed(self, glue):
        import warnings

        from zennit import composites as zcomposites
        from zennit.attribution import Gradient

        from tests.conftest import relative_error

        torch.manual_seed(0)
        width = 5 if isinstance(glue, nn.ZeroPad1d) else 3
        net = nn.Sequential(glue, nn.Linear(width, 4), nn.ReLU(), nn.Linear(4, 2)).double().eval()
        x = torch.randn(5, 3, dtype=torch.float64)
        x = x.abs() + 0.1 if isinstance(glue, nn.ReLU) else x
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            actual = self._explain(net, x)
        if isinstance(glue, nn.ZeroPad1d):
            return  # a padding's entries keep their relevance, as a bias does (zennit hands it to no input either)
        with torch.no_grad():
            out = net(x)
        with Gradient(model=net, composite=zcomposites.EpsilonPlusFlat()) as attributor:
            _, expected = attributor(x.clone(), torch.zeros_like(out).index_fill_(1, torch.tensor([0]), 1.0) * out)
        assert relative_error(actual, expected) <= 1e-6


class _Clipped(nn.Module):
    """A clip in the forward before the first layer, as preprocessing is often written."""

    def __init__(self, clip, rest: nn.Module) -> None:
        super().__init__()
        self.clip, self.rest = clip, rest

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rest(self.clip(x))


class TestPassRuleInTheGlue:
    """A pass-rule activation before a first layer hands the relevance the layer's rule sets at each of its inputs to
    the input at its position, exact zeros included (where the rule's factor ``f(0) / stabilize(0)`` is 0): zennit's
    Pass, float64, is the oracle. The inputs hold exact zeros, whose relevance was dropped silently before (up to all
    of a sample's relevance on the functional clips). No warning: none is lost, also where ``f(0) != 0`` (Sigmoid,
    Softplus), whose outputs at exact zeros lose their relevance under the pass rule elsewhere."""

    @staticmethod
    def _layers(glue: bool) -> list[nn.Module]:
        torch.manual_seed(0)
        reshape = [nn.Flatten(2), nn.Unflatten(2, (4, 4))] if glue else []
        return [*reshape, nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(48, 3)]

    @staticmethod
    def _inputs() -> torch.Tensor:
        torch.manual_seed(1)
        x = 1.5 * torch.randn(4, 2, 4, 4, dtype=torch.float64)
        return torch.where(x.abs() < 0.6, 0.0, x)  # a third of the entries exactly 0

    @staticmethod
    def _compare(net: nn.Module, oracle: nn.Module, preset: str, x: torch.Tensor) -> None:
        import warnings

        from tensordict import TensorDict
        from zennit import composites as zcomposites
        from zennit.attribution import Gradient

        from tdhook.attribution import LRP
        from tdhook.attribution.lrp_helpers import rules
        from tests.conftest import relative_error

        options = {"low": -4.0, "high": 4.0} if preset == "EpsilonGammaBox" else {}
        with torch.no_grad():
            out = oracle(x)
        target = out.argmax(1)
        with Gradient(model=oracle, composite=getattr(zcomposites, preset)(**options)) as attributor:
            _, expected = attributor(x.clone(), torch.eye(3, dtype=x.dtype)[target] * out)
        lrp = LRP(net, rule_mapper=getattr(rules, preset)(**options), in_keys=["x"], out_keys=["y"], target=target)
        with warnings.catch_warnings(), lrp:
            warnings.simplefilter("error")
            for _ in range(3):  # the call that records the rules' places, and the planned calls after it
                actual = lrp(TensorDict(x=x, batch_size=[x.shape[0]]))["relevance", "x"]
                assert relative_error(actual, expected) <= 1e-10

    @pytest.mark.parametrize("preset", ["EpsilonPlusFlat", "EpsilonGammaBox", "EpsilonAlpha2Beta1Flat"])
    @pytest.mark.parametrize("glue", [False, True], ids=["alone", "reshaped"])
    @pytest.mark.parametrize(
        "activation",
        [nn.Tanh, nn.GELU, nn.SiLU, nn.ELU, nn.LeakyReLU, nn.Hardtanh, nn.ReLU6, nn.Hardswish, nn.Sigmoid, nn.Softplus],
        ids=lambda a: a.__name__,
    )
    def test_an_activation_module_passes_the_zeros_relevance(self, activation, glue: bool, preset: str):
        net = nn.Sequential(activation(), *self._layers(glue)).double().eval()
        self._compare(net, net, preset, self._inputs())

    @pytest.mark.parametrize("preset", ["EpsilonPlusFlat", "EpsilonGammaBox"])
    @pytest.mark.parametrize(
        "clip, module",
        [
            (lambda x: x.clamp(-0.5, 0.5), nn.Hardtanh(-0.5, 0.5)),
            (F.hardtanh, nn.Hardtanh()),
            (F.relu6, nn.ReLU6()),
        ],
        ids=["clamp", "hardtanh", "relu6"],
    )
    def test_a_functional_clip_passes_them_as_its_module_does(self, clip, module: nn.Module, preset: str):
        rest = nn.Sequential(*self._layers(glue=False)).double().eval()
        self._compare(_Clipped(clip, rest), nn.Sequential(module, rest), preset, self._inputs())
