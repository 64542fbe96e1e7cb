"""Gates: in a product of an activation and a sigmoid-like gate, the gate is held constant (signal-take-all).

The oracle is the same network with the gate detached by hand, ``x * gate.detach()``: all of the product's
relevance reaches the signal, none the gate's branch. A sigmoid whose output gates nothing is an activation
(:class:`PassRule`).
"""

from __future__ import annotations

import warnings

import pytest
import timm.layers
import torch
import torch.nn.functional as F
import torchvision
from tensordict import TensorDict
from timm.models._efficientnet_blocks import SqueezeExcite as EfficientNetSqueezeExcite
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.mappers.base import BaseRuleMapper
from tdhook.attribution.mappers.transformer import CPLRP, AttnLRP
from tdhook.attribution.rules.basic import EpsilonRule, IgnoreRule, PassRule
from tdhook.attribution.rules.gates import GateRule, HeldGates, RouterRule, is_gate, is_router
from tests.attribution.rules._helpers import CNN_PRESETS, F64, randn
from tests.attribution.test_lrp_layers import lrp_relevance
from tests.conftest import relative_error, tdhook_relevance

MAPPERS = {**CNN_PRESETS, "BaseRuleMapper": lambda **options: BaseRuleMapper(**options)}

# ----------------------------------------------------------------------------- squeeze-excite blocks and their oracle

SQUEEZE_EXCITES = {
    "torchvision-sigmoid": lambda: torchvision.ops.SqueezeExcitation(8, 4),
    "torchvision-hardsigmoid": lambda: torchvision.ops.SqueezeExcitation(8, 4, scale_activation=nn.Hardsigmoid),
    "timm-sigmoid": lambda: timm.layers.SqueezeExcite(8, rd_channels=4),
    "timm-hardsigmoid": lambda: timm.layers.SqueezeExcite(8, rd_channels=4, gate_layer="hard_sigmoid"),
    "timm-efficientnet": lambda: EfficientNetSqueezeExcite(8, rd_channels=4),
    # ECA reshapes its gate (view, expand_as) before the product: the gate stays a gate through that.
    "timm-eca": lambda: timm.layers.EcaModule(8, kernel_size=3),
}


def gate_of(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The gate a squeeze-excite block multiplies ``x`` by, computed with the block's own layers."""
    if isinstance(block, torchvision.ops.SqueezeExcitation):
        return block._scale(x)
    if isinstance(block, timm.layers.EcaModule):
        y = block.conv(x.mean((2, 3)).view(x.shape[0], 1, -1))
        return block.gate(y).view(x.shape[0], -1, 1, 1)
    if isinstance(block, EfficientNetSqueezeExcite):
        return block.gate(block.conv_expand(block.act1(block.conv_reduce(x.mean((2, 3), keepdim=True)))))
    return block.gate(block.fc2(block.act(block.bn(block.fc1(x.mean((2, 3), keepdim=True))))))


def gate_module(block: nn.Module) -> nn.Module:
    return block.scale_activation if isinstance(block, torchvision.ops.SqueezeExcitation) else block.gate


class HeldByHand(nn.Module):
    """The oracle: ``block``'s product with its gate detached by hand."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * gate_of(self.block, x).detach()


class SENet(nn.Module):
    """A convolution, a squeeze-excite block, and a small head."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.se = block
        self.head = nn.Sequential(nn.Conv2d(8, 6, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.se(self.stem(x)))


def se_nets(kind: str, bias: bool = True) -> tuple[SENet, SENet, torch.Tensor]:
    """The network with ``kind``'s block, the same network with its gate held by hand, and an input."""
    model = SENet(SQUEEZE_EXCITES[kind]()).double().eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                module.weight.mul_(2.0)  # gates away from 1/2
                module.bias.normal_() if bias else module.bias.zero_()
    oracle = SENet(HeldByHand(model.se)).double().eval()
    oracle.stem, oracle.head = model.stem, model.head
    x = torch.randn(2, 3, 6, 6, dtype=F64).clamp(-2.9, 2.9)
    torch.testing.assert_close(oracle(x), model(x))
    return model, oracle, x


class TestSqueezeExcite:
    @pytest.mark.parametrize("mapper", sorted(MAPPERS))
    @pytest.mark.parametrize("kind", sorted(SQUEEZE_EXCITES))
    def test_equals_the_gate_detached_by_hand(self, kind: str, mapper: str):
        model, oracle, x = se_nets(kind)
        relevance_out = torch.randn(2, 3, dtype=F64)
        actual = lrp_relevance(model, x, relevance_out, MAPPERS[mapper]())
        expected = lrp_relevance(oracle, x, relevance_out, MAPPERS[mapper]())
        assert relative_error(actual, expected) <= 1e-12
        # The gate as a plain activation: both factors of the product get its relevance, another answer.
        passed = {type(gate_module(model.se)): PassRule()}
        assert (
            relative_error(lrp_relevance(model, x, relevance_out, MAPPERS[mapper](rule_mapper=passed)), expected) > 1e-3
        )

    @pytest.mark.parametrize("mapper", sorted(MAPPERS))
    @pytest.mark.parametrize("kind", sorted(SQUEEZE_EXCITES))
    def test_zero_biases_conserve_relevance(self, kind: str, mapper: str):
        model, _, x = se_nets(kind, bias=False)
        with torch.no_grad():
            relevance_out = torch.rand_like(model(x)) + 0.5
        options = {"epsilon": 0.0} if mapper != "BaseRuleMapper" else {}
        relevance = lrp_relevance(model, x, relevance_out, MAPPERS[mapper](stabilizer=1e-12, **options))
        assert relative_error(relevance.flatten(1).sum(1), relevance_out.sum(1)) <= 1e-9
        passed = {type(gate_module(model.se)): PassRule()}
        created = lrp_relevance(
            model, x, relevance_out, MAPPERS[mapper](stabilizer=1e-12, rule_mapper=passed, **options)
        )
        assert relative_error(created.flatten(1).sum(1), relevance_out.sum(1)) > 1e-3

    @pytest.mark.parametrize("kind", sorted(SQUEEZE_EXCITES))
    def test_mappers_give_the_gate_the_gate_rule(self, kind: str):
        assert type(BaseRuleMapper()("se.gate", gate_module(SQUEEZE_EXCITES[kind]()))) is GateRule


class SENetStack(nn.Module):
    """Squeeze-excite blocks one after another, each behind a convolution and a ReLU (RegNetY's blocks, shortened)."""

    def __init__(self, kind: str, blocks: int = 4) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(blocks):
            layers += [nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), SQUEEZE_EXCITES[kind]()]
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), *layers)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class TestGatesUnderTransformerPresets:
    """AttnLRP shares products of two signals uniformly, but holds a sigmoid-like gate as CP-LRP does: sigmoid(0)
    is ½, so the identity rule through the gate's branch scales the gradient by sigmoid(s) / s, unbounded, and
    relevance that cancels only in exact arithmetic grows with each block (RegNetY: 1e13 times the logit inside
    its blocks, −1.4e4 at the input)."""

    @pytest.mark.parametrize("mapper", [AttnLRP, CPLRP], ids=lambda m: m.__name__)
    @pytest.mark.parametrize("kind", sorted(SQUEEZE_EXCITES))
    def test_equals_the_gate_detached_by_hand(self, kind: str, mapper: type):
        model, oracle, x = se_nets(kind)
        relevance_out = torch.randn(2, 3, dtype=F64)
        actual = lrp_relevance(model, x, relevance_out, mapper())
        expected = lrp_relevance(oracle, x, relevance_out, mapper())
        assert relative_error(actual, expected) <= 1e-12

    @pytest.mark.parametrize("kind", ["torchvision-sigmoid", "timm-sigmoid", "timm-hardsigmoid"])
    def test_chained_gates_conserve_under_attnlrp(self, kind: str):
        torch.manual_seed(3)
        model = SENetStack(kind).double().eval()
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("bias"):
                    parameter.zero_()
        x = torch.randn(2, 3, 6, 6, dtype=F64)
        with torch.no_grad():
            relevance_out = model(x)
        relevance = lrp_relevance(model, x, relevance_out, AttnLRP())
        assert relative_error(relevance.flatten(1).sum(1), relevance_out.sum(1)) <= 1e-9


# ----------------------------------------------------------------------------- a sigmoid that gates nothing


class ScaledSigmoid(nn.Module):
    """A sigmoid times a parameter: no activation is gated."""

    def __init__(self) -> None:
        super().__init__()
        self.act = nn.Sigmoid()
        self.scale = nn.Parameter(torch.linspace(-2.0, 2.0, 6, dtype=F64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x) * self.scale


SIGMOID_ACTIVATIONS = {
    "nn.Sigmoid": nn.Sigmoid,
    "nn.Hardsigmoid": nn.Hardsigmoid,
    "timm-Sigmoid": timm.layers.activations.Sigmoid,
    "times-parameter": ScaledSigmoid,
}


class GateSigmoid(nn.Module):
    """Named like timm's gates, an activation: ``x · sigmoid(x)`` (SiLU), whose values leave ``[0, 1]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(x)


class GatedUnit(nn.Module):
    """``x · act(W x)``: a product of the input and an activation of it."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.act, self.gate = act, nn.Linear(5, 5, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.act(self.gate(x))


@pytest.mark.parametrize("mapper", [*sorted(MAPPERS), "AttnLRP", "CPLRP"])
def test_a_module_named_like_a_gate_whose_values_leave_zero_to_one_is_refused_naming_it(mapper: str):
    """Modules of other libraries are taken for sigmoid-like gates by their class name (timm's ``Sigmoid``,
    ``HardSigmoid``, ``GateSigmoid``). One computing SiLU under such a name was held as a gate in its product, its
    relevance given to the other factor with no word (0.53 relative L2 off the same product with ``nn.SiLU`` under
    AttnLRP); its values leaving ``[0, 1]`` show it is none, and the call names it. A real gate under such a name
    (timm's ``Sigmoid``) still runs."""
    make = {**MAPPERS, "AttnLRP": lambda **options: AttnLRP(**options), "CPLRP": lambda **options: CPLRP(**options)}
    torch.manual_seed(0)
    x = randn(4, 5)
    with pytest.raises(ValueError, match=r"GateRule on GateSigmoid: taken for a sigmoid-like gate .* outside \[0, 1\]"):
        lrp_relevance(nn.Sequential(GatedUnit(GateSigmoid()), nn.Linear(5, 3)).double(), x, randn(4, 3), make[mapper]())
    model = nn.Sequential(GatedUnit(timm.layers.activations.Sigmoid()), nn.Linear(5, 3)).double()
    assert torch.isfinite(lrp_relevance(model, x, randn(4, 3), make[mapper]())).all()


class TestSigmoidActivation:
    """Linear → sigmoid → Linear: the sigmoid passes its relevance on, exactly as PassRule does."""

    @pytest.mark.parametrize("mapper", sorted(MAPPERS))
    @pytest.mark.parametrize("kind", sorted(SIGMOID_ACTIVATIONS))
    def test_gets_pass_rule_relevance(self, kind: str, mapper: str):
        act = SIGMOID_ACTIVATIONS[kind]()
        model = nn.Sequential(nn.Linear(5, 6), act, nn.Linear(6, 3)).double().eval()
        x, relevance_out = randn(4, 5) * 2, randn(4, 3)
        gate_type = nn.Sigmoid if kind == "times-parameter" else type(act)
        actual = lrp_relevance(model, x, relevance_out, MAPPERS[mapper]())
        expected = lrp_relevance(model, x, relevance_out, MAPPERS[mapper](rule_mapper={gate_type: PassRule()}))
        assert relative_error(actual, expected) <= 1e-12
        plain = lrp_relevance(model, x, relevance_out, MAPPERS[mapper](rule_mapper={gate_type: IgnoreRule()}))
        assert relative_error(plain, expected) > 1e-3

    @pytest.mark.parametrize("cls", [nn.Sigmoid, nn.Hardsigmoid])
    def test_gate_rule_on_its_own_is_pass_rule(self, cls: type):
        # Above -3, where hardsigmoid is not exactly 0: relevance put on a zero output is refused (no rule carries it).
        x, relevance_out = (randn(3, 7) * 2).clamp(min=-2.5), randn(3, 7)
        expected = tdhook_relevance(PassRule(), cls(), x, relevance_out)
        assert relative_error(tdhook_relevance(GateRule(), cls(), x, relevance_out), expected) <= 1e-12

    def test_gate_rule_marks_its_output(self):
        sigmoid, x = nn.Sigmoid(), randn(2, 3).requires_grad_(True)
        with GateRule().register(sigmoid):
            assert is_gate(sigmoid(x * 1))
        assert not is_gate(sigmoid(x * 1))


# ----------------------------------------------------------------------------- HeldGates on functions

GATE_FUNCTIONS = {
    "torch.sigmoid": torch.sigmoid,
    "Tensor.sigmoid": torch.Tensor.sigmoid,
    "F.sigmoid": F.sigmoid,
    "F.hardsigmoid": F.hardsigmoid,
    # In place: ``h.sigmoid_()`` took the plain gradient as a gate (with a warning), 23 % off.
    "Tensor.sigmoid_": torch.Tensor.sigmoid_,
    "torch.sigmoid_": torch.sigmoid_,
    "F.hardsigmoid in place": lambda h: F.hardsigmoid(h, inplace=True),
}
PRODUCTS = {
    "signal * gate": lambda signal, gate: signal * gate,
    "gate * signal": lambda signal, gate: gate * signal,
    "torch.mul": lambda signal, gate: torch.mul(signal, gate),
    "Tensor.mul": lambda signal, gate: gate.mul(signal),
    # ``mul``'s aliases: the gate kept its plain gradient (a different relevance from ``signal * gate``)
    "torch.multiply": lambda signal, gate: torch.multiply(signal, gate),
    "Tensor.multiply": lambda signal, gate: gate.multiply(signal),
}


def gated(x: torch.Tensor, weight: torch.Tensor, gate_function, product, hold: bool) -> torch.Tensor:
    """``product(tanh(x), gate(x @ weight))``, the gate detached by hand with ``hold``."""
    signal = torch.tanh(x)
    gate = gate_function(x @ weight)
    return product(signal, gate.detach() if hold else gate)


class TestHeldGates:
    @pytest.mark.parametrize("product", sorted(PRODUCTS))
    @pytest.mark.parametrize("gate", sorted(GATE_FUNCTIONS))
    def test_function_gates_are_held(self, gate: str, product: str):
        x, weight, grad_out = randn(4, 5).requires_grad_(True), randn(5, 5), randn(4, 5)
        with HeldGates():
            z = gated(x, weight, GATE_FUNCTIONS[gate], PRODUCTS[product], hold=False)
        (actual,) = torch.autograd.grad(z, x, grad_out)
        (expected,) = torch.autograd.grad(gated(x, weight, GATE_FUNCTIONS[gate], PRODUCTS[product], True), x, grad_out)
        assert relative_error(actual, expected) <= 1e-12
        (plain,) = torch.autograd.grad(gated(x, weight, GATE_FUNCTIONS[gate], PRODUCTS[product], False), x, grad_out)
        assert relative_error(plain, expected) > 1e-3

    def test_signal_takes_all_of_the_product_relevance(self):
        x = randn(3, 4).requires_grad_(True)
        with HeldGates():
            signal = 2 * x
            z = signal * torch.sigmoid(x @ randn(4, 4))
        (grad,) = torch.autograd.grad(z, x, torch.ones_like(z))
        assert relative_error(x.detach() * grad, z.detach()) <= 1e-12

    @pytest.mark.parametrize(
        "case",
        ["gate * gate", "gate * constant", "signal * signal", "sigmoid of a leaf"],
    )
    def test_other_products_are_plain(self, case: str):
        x, grad_out = randn(3, 4).requires_grad_(True), randn(3, 4)
        constant = randn(3, 4)

        def forward():
            h = x * 1.5
            if case == "gate * gate":
                return torch.sigmoid(h) * torch.sigmoid(h * 2)
            if case == "gate * constant":
                return torch.sigmoid(h) * constant
            if case == "signal * signal":
                return torch.tanh(h) * h
            return torch.sigmoid(x) * h  # x is an input, not an activation: its sigmoid is no gate

        with HeldGates():
            z = forward()
        (actual,) = torch.autograd.grad(z, x, grad_out)
        (expected,) = torch.autograd.grad(forward(), x, grad_out)
        assert relative_error(actual, expected) <= 1e-12


class InPlaceGate(nn.Module):
    """``head(sigmoid(a(x)) · tanh(b(x)))``, the sigmoid taken in place (``in_place``) or not."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.head = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 3)
        self.act = nn.Tanh()
        self.in_place = in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.a(x)
        gate = gate.sigmoid_() if self.in_place else torch.sigmoid(gate)
        return self.head(gate * self.act(self.b(x)))


@pytest.mark.parametrize("mapper", sorted(MAPPERS))
def test_a_gate_computed_in_place_is_held_as_one_computed_out_of_place(mapper: str):
    x = randn(5, 4)
    results = []
    for in_place in (True, False):
        model = InPlaceGate(in_place).double()
        lrp = LRP(model, MAPPERS[mapper](), in_keys=["x"], out_keys=["y"])
        with warnings.catch_warnings(), lrp:  # the first call finds the gate; later ones run in HeldGates for it
            warnings.simplefilter("error")
            results.append([lrp(TensorDict(x=x, batch_size=[5]))["relevance", "x"] for _ in range(2)])
    for relevance in results[0]:
        assert relative_error(relevance, results[1][0]) <= 1e-12


class TestGateComplements:
    """``1 - z`` of a sigmoid gate ``z`` is a gate too: a GRU's update ``(1 - z) * h + z * q`` holds both (it once
    split ``(1 - z) * h`` evenly, and the complement's half went back through the sigmoid: CP-LRP summed to 2.1
    times the output on torchvision's RAFT ConvGRU, with no warning)."""

    def test_the_complement_of_a_gate_is_held(self):
        x = randn(3, 4).requires_grad_(True)
        weight = randn(4, 4)
        with HeldGates():
            signal = 2 * x
            z = (1 - torch.sigmoid(x @ weight)) * signal
        (grad,) = torch.autograd.grad(z, x, torch.ones_like(z))
        assert relative_error(x.detach() * grad, z.detach()) <= 1e-12

    def test_the_complement_of_another_activation_is_no_gate(self):
        x = randn(3, 4).requires_grad_(True)
        with HeldGates():
            z = (1 - torch.tanh(x * 1.5)) * (x * 2)
        (actual,) = torch.autograd.grad(z, x, torch.ones_like(z))
        (expected,) = torch.autograd.grad((1 - torch.tanh(x * 1.5)) * (x * 2), x, torch.ones_like(z))
        assert relative_error(actual, expected) <= 1e-12

    @pytest.mark.parametrize("mapper", [CPLRP, AttnLRP], ids=["CPLRP", "AttnLRP"])
    def test_a_convolutional_gru_conserves(self, mapper: type):
        # (the CNN presets warn there: no rule of theirs covers the GRU's tanh)
        from torchvision.models.optical_flow.raft import ConvGRU

        torch.manual_seed(0)
        encoder, head = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.Conv2d(4, 2, 1, bias=False)
        gru = ConvGRU(input_size=4, hidden_size=4, kernel_size=3, padding=1)
        with torch.no_grad():
            for layer in (gru.convz, gru.convr, gru.convq):
                layer.bias.zero_()

        class Recurrent(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.encoder, self.gru, self.head = encoder, gru, head

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                hidden, context = self.encoder(x).split(4, dim=1)
                return self.head(self.gru(hidden, context.relu())).flatten(1)

        model = Recurrent().double().eval()
        x = randn(2, 3, 5, 5)
        relevance_out = model(x).detach()  # the whole output explained: relevance sums to its sum
        relevance = lrp_relevance(model, x, relevance_out, mapper())
        ratio = relevance.flatten(1).sum(1) / relevance_out.sum(1)
        assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-6), ratio


class HardSigmoidExcite(nn.Module):
    """Squeeze-excite with a hard-sigmoid gate (MobileNetV3's): ``nn.Hardsigmoid``, or written out."""

    def __init__(self, written_out: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.squeeze = nn.Conv2d(2, 4, 3, padding=1, bias=False), nn.Linear(4, 4, bias=False)
        self.gate, self.head, self.written_out = nn.Hardsigmoid(), nn.Linear(4, 3, bias=False), written_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv(x))
        s = self.squeeze(h.mean((2, 3)))
        gate = F.relu6(s + 3) / 6 if self.written_out else self.gate(s)
        return self.head((h * gate[:, :, None, None]).mean((2, 3)))


def test_a_hard_sigmoid_gate_written_out_is_held_as_the_module_is():
    """``relu6(s + 3) / 6``: CP-LRP holds the clip's output as a gate, and the gate divided by a number is still one.
    Before, the division made it an activation: the product was split, the number 3 took a share, and the relevance
    was 0.50 off that of the same net with ``nn.Hardsigmoid`` (summing to half the logit), with no word."""
    x = randn(3, 2, 5, 5)
    module, written = HardSigmoidExcite(False).double(), HardSigmoidExcite(True).double()
    logits = module(x).detach()
    relevance_out = torch.zeros_like(logits)
    relevance_out[:, 0] = logits[:, 0]
    expected = lrp_relevance(module, x, relevance_out, CPLRP())
    actual = lrp_relevance(written, x, relevance_out, CPLRP(strict=True))
    assert relative_error(actual, expected) <= 1e-10
    assert torch.allclose(actual.flatten(1).sum(1), logits[:, 0], rtol=1e-10, atol=0)


def test_a_gate_divided_by_a_number_is_a_gate():
    x = randn(3, 4).requires_grad_(True)
    with HeldGates():
        gate, negated = torch.sigmoid(x * 1) / 2, torch.sigmoid(x * 1) / -2
    assert is_gate(gate) and not is_gate(negated)


class ScaledExcite(nn.Module):
    """Squeeze-excite whose sigmoid gate is multiplied by a positive number (``2 * sigmoid(s)``); ``hold``: the gate
    detached, whose gradient × input is the relevance of the gate held."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.squeeze = nn.Conv2d(2, 4, 3, padding=1, bias=False), nn.Linear(4, 4, bias=False)
        self.head, self.how, self.hold = nn.Linear(4, 3, bias=False), how, False
        self.register_buffer("gain", torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv(x))
        gate = torch.sigmoid(self.squeeze(h.mean((2, 3))))
        gate = gate.detach() if self.hold else gate
        if self.how == "2 * sigmoid":
            gate = 2 * gate
        elif self.how == "sigmoid * 2.0":
            gate = gate * 2.0
        elif self.how == "torch.mul(sigmoid, buffer)":
            gate = torch.mul(gate, self.gain)
        return self.head((h * gate[:, :, None, None]).mean((2, 3)))


@pytest.mark.parametrize("how", ["2 * sigmoid", "sigmoid * 2.0", "torch.mul(sigmoid, buffer)"])
@pytest.mark.parametrize("preset", [CPLRP, AttnLRP, BaseRuleMapper], ids=lambda p: p.__name__)
def test_a_gate_times_a_positive_number_is_held(how, preset):
    """A sigmoid gate multiplied by a positive number lost its mark: CP-LRP and AttnLRP split the product, conserved
    but 2.46 off the relevance of the gate held, with no word (the CNN presets' held gates named the product as
    not piecewise linear, and kept its plain gradient). Held now, as a gate divided by a positive number is."""
    x = randn(3, 2, 5, 5)
    model = ScaledExcite(how).double()
    model.hold = True
    held = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(model(held)[:, 0].sum(), held)
    model.hold = False
    logits = model(x).detach()
    relevance_out = torch.zeros_like(logits)
    relevance_out[:, 0] = logits[:, 0]
    actual = lrp_relevance(model, x, relevance_out, preset(strict=True))
    assert relative_error(actual, grad * x) <= 1e-10


def test_a_gate_times_a_negative_number_or_a_learned_gain_is_no_gate():
    x, gain = randn(3, 4).requires_grad_(True), nn.Parameter(torch.tensor(2.0, dtype=F64))
    with HeldGates():
        gates = [2 * torch.sigmoid(x * 1), torch.sigmoid(x * 1) * torch.tensor(0.5, dtype=F64)]
        others = [torch.sigmoid(x * 1) * -2, torch.sigmoid(x * 1) * gain, torch.sigmoid(x * 1) * torch.zeros(())]
        others.append(torch.sigmoid(x * 1) * torch.full((4,), 2.0, dtype=F64))  # a tensor of several numbers
    assert all(is_gate(gate) for gate in gates) and not any(is_gate(other) for other in others)


def test_a_gate_times_a_reshaped_parameter_passes_relevance_to_the_gate():
    # sigmoid(x) * scale.view(...) is a gate times a parameter, not a gated signal: the gate is the signal here.
    scale = nn.Parameter(torch.tensor([2.0, 3.0], dtype=torch.float64))
    x = torch.tensor([[0.5, -1.0]], dtype=torch.float64, requires_grad=True)
    with HeldGates():
        y = torch.sigmoid(x * 1) * scale.view(1, 2)
    (grad,) = torch.autograd.grad(y.sum(), x)
    assert grad.abs().min() > 0


class TopKRouter(nn.Module):
    """A router as mixtures of experts write it: softmax of router logits, the top two renormalised in place."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 6, dtype=F64))

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(hidden, self.weight)
        weights, index = torch.topk(logits.softmax(-1), 2, dim=-1)
        weights /= weights.sum(-1, keepdim=True)
        return logits, weights, index


class InlineMixture(nn.Module):
    """A mixture whose forward routes by itself: its output is the signal, not routing weights."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.expert = nn.Linear(6, 4, dtype=F64), nn.Linear(6, 6, dtype=F64)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights = torch.topk(self.gate(hidden).softmax(-1), 1, dim=-1).values
        return self.expert(hidden) * weights


class LinearRouter(nn.Linear):
    """A router that is a Linear layer itself (as Llama 4's): sigmoid scores at the top two experts, zero elsewhere."""

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = super().forward(hidden)
        top, index = torch.topk(logits, 2, dim=-1)
        return torch.sigmoid(torch.full_like(logits, float("-inf")).scatter(-1, index, top)), logits


def _largest(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest score's softmax weight and index, by max (no topk)."""
    index = scores.max(-1, keepdim=True).indices
    return scores.softmax(-1).gather(-1, index), index


class MaxSelectingRouter(nn.Module):
    """A router named as Hugging Face names them, selecting its expert by max in a helper (as PhiMoE's)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 6, dtype=F64))

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, index = _largest(F.linear(hidden, self.weight))
        return torch.zeros(*hidden.shape[:-1], 4, dtype=hidden.dtype).scatter(-1, index, weights), index


class ProjectingRouter(nn.Module):
    """A router named as Hugging Face names them that holds its projection and returns logits (as DBRX's): the
    mixture around it selects the experts."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(6, 4, bias=False, dtype=F64)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.layer(hidden),)


class Mixture(nn.Module):
    """Bias-free linear experts weighted by a softmax of a router's scores: with the scores held, a linear map of the
    input."""

    def __init__(self, router: nn.Module) -> None:
        super().__init__()
        self.router = router
        self.experts = nn.ModuleList(nn.Linear(6, 6, bias=False, dtype=F64) for _ in range(4))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        scores = self.router(hidden)[0].softmax(-1)  # weighted in the mixture, as DBRX weighs its router's logits
        return sum(scores[:, i : i + 1] * expert(hidden) for i, expert in enumerate(self.experts))


# Routers known by their names only count as Hugging Face's classes: these two stand in for them.
MaxSelectingRouter.__module__ = ProjectingRouter.__module__ = "transformers.models.sketch.modeling_sketch"
ROUTERS = [LinearRouter(6, 4, bias=False, dtype=F64), MaxSelectingRouter(), ProjectingRouter()]


class BranchRouter(nn.Module):
    """A user's module named a router that is a branch of the signal: one Linear, nothing held."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(6, 4, bias=False, dtype=F64)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.layer(hidden),)


class BranchNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.branch = BranchRouter()
        self.head = nn.Linear(4, 3, bias=False, dtype=F64)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.branch(hidden)[0]))


@pytest.mark.parametrize("mapper", [AttnLRP, CPLRP, BaseRuleMapper])
def test_a_users_module_named_a_router_is_a_branch_of_the_signal(mapper):
    torch.manual_seed(0)
    net, x = BranchNet(), randn(5, 6)
    assert not is_router(net.branch)
    lrp = LRP(net, rule_mapper=mapper(), in_keys=["x"], out_keys=["y"])
    td = lrp(TensorDict(x=x, batch_size=[5]))
    # Bias-free and piecewise linear: the relevance sums to the explained logit (held as a router, it was ~0).
    torch.testing.assert_close(td["relevance", "x"].sum(-1), net(x).max(-1).values, rtol=1e-6, atol=1e-8)


class TestRouterRule:
    @pytest.mark.parametrize("router", ROUTERS)
    def test_a_router_that_is_a_linear_selects_by_max_or_holds_its_projection_is_recognised(self, router):
        """Llama 4's router is a Linear (a layer rule took it, and relevance flowed through its scores); PhiMoE's
        selects by max in a helper function (no topk to see); DBRX's holds a Linear and returns logits."""
        assert is_router(router)
        mappers = [BaseRuleMapper(), AttnLRP(), CPLRP(), *(make() for make in CNN_PRESETS.values())]
        for mapper in mappers:
            assert isinstance(mapper("router", router), RouterRule), mapper
            assert isinstance(mapper.rules(Mixture(router))["router"], RouterRule), mapper

    @pytest.mark.parametrize("router", ROUTERS)
    @pytest.mark.parametrize("preset", [AttnLRP, CPLRP])
    def test_relevance_of_a_mixture_flows_through_its_experts_only(self, router: nn.Module, preset: type):
        torch.manual_seed(0)
        mixture, x = Mixture(router), randn(5, 6)
        lrp = LRP(mixture, preset(), in_keys=["x"], out_keys=["y"], target=lambda y: y)
        td = lrp(TensorDict(x=x, batch_size=[5]))
        assert torch.equal(td["y"], mixture(x))  # the routing is unchanged
        torch.testing.assert_close(td["relevance", "x"].sum(-1), td["y"].sum(-1), rtol=1e-12, atol=1e-12)

    def test_hugging_face_gates_that_hold_their_projection_and_select_the_top_k_are_routers(self):
        """JetMoE's ``TopKGating`` and HunYuan's MoE gate (their routing weights got relevance under AttnLRP); a
        gate that selects nothing, or a user's module named a gate, is none."""
        from transformers import HunYuanMoEV1Config
        from transformers.models.hunyuan_v1_moe.modeling_hunyuan_v1_moe import HunYuanMoEV1Gate
        from transformers.models.jetmoe.modeling_jetmoe import JetMoeTopKGating

        assert is_router(JetMoeTopKGating(6, 4, 2))
        assert is_router(HunYuanMoEV1Gate(HunYuanMoEV1Config(hidden_size=6, num_experts=4, moe_topk=2)))

        class SketchGate(ProjectingRouter):  # a projection named a gate, no top k: a fusion gate (DEIMv2's)
            pass

        class UsersTopKGating(nn.Module):  # not Hugging Face's: may be a branch of the signal
            def __init__(self) -> None:
                super().__init__()
                self.layer = nn.Linear(6, 4)

            def forward(self, hidden: torch.Tensor) -> torch.Tensor:
                return torch.topk(self.layer(hidden), 2).values

        SketchGate.__module__ = ProjectingRouter.__module__
        assert not is_router(SketchGate()) and not is_router(UsersTopKGating())

    def test_routers_are_recognised_by_their_top_k_selection(self):
        assert is_router(TopKRouter())
        assert not is_router(InlineMixture())  # holds layers: the mixture itself, not its router
        assert not is_router(nn.Softmax(-1))
        assert isinstance(BaseRuleMapper()("router", TopKRouter()), RouterRule)

    def test_outputs_held_constant_and_routing_unchanged(self):
        router, x = TopKRouter(), randn(5, 6).requires_grad_(True)
        plain = router(x)
        with RouterRule().register(router):
            held = router(x)
        assert all(torch.equal(a, b) for a, b in zip(plain, held, strict=True))
        assert not any(t.requires_grad for t in held)
        assert all(t.requires_grad for t in router(x)[:2])  # the rule is removed with its handle

    def test_an_output_that_is_not_tensors_is_an_error_naming_the_module(self):
        class DictRouter(TopKRouter):
            def forward(self, hidden):
                return dict(zip(("logits", "weights", "index"), super().forward(hidden), strict=True))

        router = DictRouter()
        with RouterRule().register(router), pytest.raises(TypeError, match="RouterRule on DictRouter"):
            router(randn(2, 6))


class ResizedGate(nn.Module):
    """A signal times a gate computed at half its resolution and resized to it (GhostNetV2's ``GhostModuleV2``:
    ``x * F.interpolate(sigmoid(s), size, mode="nearest")``), the gate detached by hand with ``hold``."""

    def __init__(self, mode: str, hold: bool = False) -> None:
        super().__init__()
        self.conv, self.short = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 1)
        self.gate = nn.Sigmoid()
        self.head = nn.Linear(4, 3)
        self.mode, self.hold = mode, hold

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = F.interpolate(self.gate(2 * self.short(F.avg_pool2d(x, 2))), size=x.shape[-2:], mode=self.mode)
        return self.head((self.conv(x).relu() * (gate.detach() if self.hold else gate)).mean((2, 3)))


class TestResizedGates:
    """A gate resized by copies or convex combinations of its values stays a gate, and is held (it once lost its
    mark in ``F.interpolate``: CP-LRP split the product evenly, and summed to −118 to 1.27 times the logit on
    timm's ``ghostnetv2_100``, EpsilonGammaBox to 254–288, with no warning under CP-LRP)."""

    @pytest.mark.parametrize("mapper", [*sorted(MAPPERS), "CPLRP", "AttnLRP"])
    @pytest.mark.parametrize("mode", ["nearest", "bilinear"])
    def test_equals_the_gate_detached_by_hand(self, mode: str, mapper: str):
        torch.manual_seed(0)
        model = ResizedGate(mode).double().eval()
        oracle = ResizedGate(mode, hold=True).double().eval()
        oracle.load_state_dict(model.state_dict())
        x, relevance_out = randn(2, 3, 6, 6), randn(2, 3)
        make = {"CPLRP": CPLRP, "AttnLRP": AttnLRP, **MAPPERS}[mapper]
        actual = lrp_relevance(model, x, relevance_out, make())
        expected = lrp_relevance(oracle, x, relevance_out, make())
        assert relative_error(actual, expected) <= 1e-12

    @pytest.mark.parametrize("mode", ["nearest", "bilinear", "bicubic"])
    def test_only_convex_resizes_keep_the_mark(self, mode: str):
        x = randn(1, 2, 3, 3).requires_grad_(True)
        with HeldGates():
            gate = F.interpolate(torch.sigmoid(x * 1), scale_factor=2, mode=mode)
        assert is_gate(gate) == (mode != "bicubic")  # bicubic overshoots [0, 1]


class ChunkedGate(nn.Module):
    """A value and a gate split from one sigmoid (iFormer's ``SHMA``: ``v, gate = sigmoid(conv(x)).chunk(2, 1)``),
    the value mixed by a convolution and multiplied by the gate, detached by hand with ``hold``."""

    def __init__(self, split: str, hold: bool = False) -> None:
        super().__init__()
        self.conv, self.mix = nn.Conv2d(3, 8, 1), nn.Conv2d(4, 4, 3, padding=1)
        self.gate = nn.Sigmoid()
        self.head = nn.Linear(4, 3)
        self.split, self.hold = split, hold

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        both = self.gate(2 * self.conv(x))
        value, gate = both.chunk(2, dim=1) if self.split == "chunk" else torch.split(both, 4, dim=1)
        return self.head((self.mix(value) * (gate.detach() if self.hold else gate)).mean((2, 3)))


@pytest.mark.parametrize("mapper", [*sorted(MAPPERS), "CPLRP", "AttnLRP"])
@pytest.mark.parametrize("split", ["chunk", "split"])
def test_a_gate_split_from_a_sigmoid_is_held(split: str, mapper: str):
    # Each piece of a split gate is a gate: EpsilonGammaBox once summed to 1.95-2.8 times the logit on iFormer.
    torch.manual_seed(0)
    model, oracle = ChunkedGate(split).double().eval(), ChunkedGate(split, hold=True).double().eval()
    oracle.load_state_dict(model.state_dict())
    x, relevance_out = randn(2, 3, 5, 5), randn(2, 3)
    make = {"CPLRP": CPLRP, "AttnLRP": AttnLRP, **MAPPERS}[mapper]
    actual = lrp_relevance(model, x, relevance_out, make())
    assert relative_error(actual, lrp_relevance(oracle, x, relevance_out, make())) <= 1e-12


# Casts and reshapes after a gate, before its product (a gate computed in another precision, cast back).
GATE_CASTS = {
    "float, type_as": lambda gate, signal: gate.float().type_as(signal),
    "float, double": lambda gate, signal: gate.float().double(),
    "half, to": lambda gate, signal: gate.half().to(signal.dtype),
    "bfloat16, double": lambda gate, signal: gate.bfloat16().double(),
    "reshape_as": lambda gate, signal: gate.reshape_as(signal),
    ".T, .mT": lambda gate, signal: gate.T.mT,
    "t, adjoint": lambda gate, signal: gate.t().adjoint(),
    "unflatten": lambda gate, signal: torch.unflatten(gate.unflatten(1, (2, 3)), 0, (1, -1)).flatten(0, 1).flatten(1),
    "movedim, moveaxis": lambda gate, signal: gate.movedim(1, 0).moveaxis(0, 1),
    "swapaxes, swapdims": lambda gate, signal: torch.swapaxes(gate, 0, 1).swapdims(0, 1),
    "narrow, repeat": lambda gate, signal: gate.narrow(1, 0, 3).repeat(1, 2),
    "select, broadcast_to": lambda gate, signal: gate.select(1, 2).unsqueeze(1).broadcast_to(signal.shape),
    "tile, flip, roll": lambda gate, signal: torch.roll(gate.tile(1, 1).flip(1), 2, 1),
}


class CastGate(nn.Module):
    """``out(s(x) * cast(sigmoid(g(x))))``, no biases; ``held`` detaches the gate (the oracle)."""

    def __init__(self, cast: str) -> None:
        super().__init__()
        self.s, self.g, self.out = nn.Linear(4, 6, bias=False), nn.Linear(4, 6, bias=False), nn.Linear(6, 3, bias=False)
        self.cast, self.held = GATE_CASTS[cast], False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        signal, gate = self.s(x), torch.sigmoid(self.g(x))
        return self.out(signal * self.cast(gate.detach() if self.held else gate, signal))


@pytest.mark.parametrize("mapper", ["AttnLRP", "CPLRP", "BaseRuleMapper"])
@pytest.mark.parametrize("cast", sorted(GATE_CASTS))
def test_a_gate_cast_or_reshaped_before_its_product_is_held(cast: str, mapper: str):
    """A cast (``gate.float().type_as(x)``, ``.double()``), a ``reshape_as``, a transpose (``.T``, ``.mT``,
    ``movedim``), an ``unflatten``, a ``narrow`` or a copy of the gate's values (``repeat``, ``flip``, ``roll``) keeps a
    gate a gate: held in the product as the gate detached by hand (its mark was lost, and the product's relevance
    shared with the gate: 5.7 off, relative L2, for ``g.T * h.T`` under AttnLRP)."""
    torch.manual_seed(0)
    model, x, relevance_out = CastGate(cast).to(F64), randn(3, 4), randn(3, 3)
    make = {"AttnLRP": AttnLRP, "CPLRP": CPLRP, **MAPPERS}[mapper]
    model.held = True
    expected = lrp_relevance(model, x, relevance_out, make())
    model.held = False
    assert relative_error(lrp_relevance(model, x, relevance_out, make()), expected) <= 1e-12


class GatedPolicy(nn.Module):
    """A goal-conditioned policy with a gated linear unit: the observation's and the goal's features mixed, then
    ``a · sigmoid(b)`` of the mix's halves, by ``nn.GLU``, ``F.glu``, written out, or with the gate detached."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.obs, self.goal = nn.Linear(4, 6), nn.Linear(3, 6)
        self.mix, self.head, self.glu, self.how = nn.Linear(12, 8), nn.Linear(4, 2), nn.GLU(-1), how

    def forward(self, observation: torch.Tensor, goal: torch.Tensor) -> torch.Tensor:
        z = self.mix(torch.cat([F.relu(self.obs(observation)), F.relu(self.goal(goal))], -1))
        if self.how == "nn.GLU":
            h = self.glu(z)
        elif self.how == "F.glu":
            h = F.glu(z, dim=-1)
        else:
            a, b = z.chunk(2, -1)
            gate = torch.sigmoid(b)
            h = a * (gate.detach() if self.how == "detached" else gate)
        return self.head(h)


def gated_relevance(how: str, mapper, zero_biases: bool = False, **kwargs) -> tuple[TensorDict, TensorDict]:
    from tensordict.nn import TensorDictModule

    policy = GatedPolicy(how).double()
    if zero_biases:
        with torch.no_grad():
            for layer in (policy.obs, policy.goal, policy.mix, policy.head):
                layer.bias.zero_()
    td = TensorDict(observation=randn(5, 4), goal=randn(5, 3), batch_size=[5])
    module = TensorDictModule(policy, in_keys=["observation", "goal"], out_keys=["action_value"])
    return LRP(module, mapper, **kwargs)(td.clone()), td


@pytest.mark.parametrize("mapper", list(MAPPERS))
@pytest.mark.parametrize("how", ["nn.GLU", "F.glu"])
def test_a_gated_linear_unit_holds_its_gate_as_the_product_written_out(how, mapper):
    """``F.glu`` and ``nn.GLU`` compute ``a · sigmoid(b)``: the CNN presets held the gate of the product written out
    but named the unit as not piecewise linear and kept its plain gradient (refused with ``strict=True``), where
    AttnLRP and CP-LRP hold it. Its gate is held now, under every preset, as in the product written out."""
    out, _ = gated_relevance(how, MAPPERS[mapper](strict=True))
    expected, _ = gated_relevance("written", MAPPERS[mapper](strict=True))
    assert torch.equal(out["action_value"], expected["action_value"])
    for key in ("observation", "goal"):
        assert relative_error(out["relevance", key], expected["relevance", key]) <= 1e-10


@pytest.mark.parametrize("how", ["nn.GLU", "F.glu"])
def test_a_gated_linear_unit_under_lrp0_is_the_gate_detached_and_conserves(how):
    """Signal-take-all: LRP-0 is gradient × input of the same network with the gate detached, and with every bias
    zeroed the relevance of both inputs adds up to the explained value."""
    out, td = gated_relevance(how, BaseRuleMapper(stabilizer=1e-12), target=lambda y: y)
    detached = GatedPolicy("detached").double()
    leaves = [td[key].clone().requires_grad_() for key in ("observation", "goal")]
    grads = torch.autograd.grad(detached(*leaves).sum(), leaves)
    for key, leaf, grad in zip(("observation", "goal"), leaves, grads, strict=True):
        assert relative_error(out["relevance", key], leaf.detach() * grad) <= 1e-10
    mapper = BaseRuleMapper(stabilizer=1e-12, rule_mapper={nn.Linear: EpsilonRule(0.0)})
    out, _ = gated_relevance(how, mapper, zero_biases=True, target=lambda y: y)
    total = out["relevance", "observation"].sum(-1) + out["relevance", "goal"].sum(-1)
    torch.testing.assert_close(total, out["action_value"].sum(-1), rtol=1e-10, atol=1e-12)


def test_a_gated_linear_unit_keeps_the_derivative_of_its_relevance():
    """With ``create_graph=True`` the relevance is an ordinary call's, and its derivative with respect to the
    observation (the gate's own dependence on it included) is within 1e-6 of central finite differences."""
    from tensordict.nn import TensorDictModule

    module = TensorDictModule(GatedPolicy("F.glu").double(), in_keys=["observation", "goal"], out_keys=["y"])
    td = TensorDict(observation=randn(2, 4), goal=randn(2, 3), batch_size=[2])
    lrp = LRP(module, BaseRuleMapper(stabilizer=1e-12), target=0, create_graph=True)
    weights = randn(2, 4)

    def relevance(observation: torch.Tensor) -> torch.Tensor:
        return lrp(td.clone().set("observation", observation))["relevance", "observation"]

    leaf = td["observation"].clone().requires_grad_()
    kept = relevance(leaf)
    plain = LRP(module, BaseRuleMapper(stabilizer=1e-12), target=0)(td.clone())["relevance", "observation"]
    assert relative_error(kept.detach(), plain) <= 1e-12
    (derivative,) = torch.autograd.grad((kept * weights).sum(), leaf)
    step, numeric = 1e-6, torch.zeros_like(derivative)
    for index in range(leaf.numel()):
        shift = torch.zeros(leaf.numel(), dtype=F64)
        shift[index] = step
        shift = shift.view_as(leaf)
        up = (relevance(td["observation"] + shift) * weights).sum()
        down = (relevance(td["observation"] - shift) * weights).sum()
        numeric.view(-1)[index] = (up - down).detach() / (2 * step)
    assert relative_error(derivative, numeric) <= 1e-6
