"""Differentiable relevance on the models used to train with a loss on it: torchrl heads (a Q-value actor, a TanhNormal
actor, a recurrent policy, multi-agent MLPs with separate parameters), gated layers (GLU, a hard-sigmoid
squeeze-excite), a layer called twice, parametrised weights, and training loops run inside one open context.

The oracle, in float64: central finite differences of ``(relevance · weights).sum()`` (the ordinary call) along
random directions, one tensor at a time (the input and every parameter; a parameter's direction leaves out its entries
within 1e-4 of zero, where ``W⁺`` and ``W⁻`` switch), and the relevance of ``create_graph=True`` equal to the ordinary
relevance. The training loops are compared with the same loop written by hand with autograd's double backward of
gradient × input (LRP-0), and with a fresh wrapper at each step (no state kept across the optimizer's steps).
``pytest -m gallery`` adds torchvision's resnet18 and a tiny BERT.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from tensordict.nn import NormalParamExtractor, TensorDictModule, TensorDictSequential
from tensordict.utils import NestedKey
from torch import nn
from torch.nn.utils import parametrizations
from torchrl.envs.utils import ExplorationType, set_exploration_type
from torchrl.modules import (
    MLP,
    LSTMModule,
    MultiAgentMLP,
    ProbabilisticActor,
    QValueActor,
    TanhNormal,
    set_recurrent_mode,
)

from tdhook.attribution import LRP, BaseRuleMapper
from tdhook.attribution.mappers.presets import EpsilonGammaBox, EpsilonPlus, EpsilonPlusFlat

F64 = torch.float64
TOLERANCE = 1e-6
PRESETS = {
    "EpsilonPlus": lambda: EpsilonPlus(epsilon=0.1),
    "EpsilonPlusFlat": lambda: EpsilonPlusFlat(epsilon=0.1),
    "EpsilonGammaBox": lambda: EpsilonGammaBox(low=-3.0, high=3.0, epsilon=0.1),
}


def directional_errors(
    module: nn.Module,
    mapper: Callable[[], object],
    td: TensorDict,
    key: NestedKey,
    step: float = 1e-7,
    **kwargs,
) -> dict[str, float]:
    """The relative error of ``LRP(module, ..., create_graph=True)``'s derivative of the relevance of ``key`` along
    a random direction per tensor, against central finite differences of the ordinary call; ``"values"`` compares
    the relevance of the two calls. An error is relative to the derivative's size, or to a hundredth of the largest
    one where it is smaller."""
    relevance_key = ("relevance", *((key,) if isinstance(key, str) else key))
    generator = torch.Generator().manual_seed(0)
    x = td[key]
    plain = LRP(module, mapper(), **kwargs)
    kept = LRP(module, mapper(), create_graph=True, **kwargs)
    point = x.clone().requires_grad_(True)
    given = td.clone()
    given[key] = point
    relevance = kept(given)[relevance_key]
    weights = torch.randn(relevance.shape, generator=generator, dtype=relevance.dtype)
    named = {"input": point, **{name: p for name, p in module.named_parameters() if p.requires_grad}}
    grads = torch.autograd.grad((relevance * weights).sum(), list(named.values()), allow_unused=True)
    rows = []
    with plain:  # parameter writes are seen by the rules
        reference = plain(td.clone())[relevance_key]
        for (name, tensor), grad in zip(named.items(), grads, strict=True):
            target = x if name == "input" else tensor
            direction = torch.randn(target.shape, generator=generator, dtype=target.dtype)
            if name != "input":
                direction *= target.detach().abs() > 1e-4
            losses = []
            for sign in (1.0, -1.0):
                with torch.no_grad():
                    target.add_(sign * step * direction)
                losses.append((plain(td.clone())[relevance_key] * weights).sum().item())
                with torch.no_grad():
                    target.sub_(sign * step * direction)
            expected = (losses[0] - losses[1]) / (2 * step)
            actual = 0.0 if grad is None else (grad * direction).sum().item()
            rows.append((name, expected, actual))
    largest = max(abs(expected) for _, expected, _ in rows)
    errors = {"values": ((relevance.detach() - reference).norm() / reference.norm()).item()}
    for name, expected, actual in rows:
        errors[name] = abs(actual - expected) / max(abs(expected), 1e-2 * largest)
    return errors


def assert_exact(errors: dict[str, float]) -> None:
    assert errors.pop("values") < 1e-12
    worst = max(errors, key=errors.get)
    assert errors[worst] < TOLERANCE, f"{worst}: {errors[worst]:.2e}"


# ---------------------------------------------------------------------------------------------- torchrl heads


def observations(batch: int = 5) -> TensorDict:
    return TensorDict(observation=torch.randn(batch, 4, dtype=F64), batch_size=[batch])


def policy_mlp(out_features: int) -> nn.Module:
    return MLP(in_features=4, out_features=out_features, num_cells=[16, 16], activation_class=nn.Tanh).to(F64)


class RecurrentSequence(TensorDictSequential):
    def forward(self, td, *args, **kwargs):
        with set_recurrent_mode(True):
            return super().forward(td, *args, **kwargs)


def torchrl_case(kind: str) -> tuple[nn.Module, TensorDict, NestedKey, dict]:
    """A torchrl head, its input, the explained input key and the wrapper's keyword arguments."""
    torch.manual_seed(0)
    if kind == "QValueActor":
        return (
            QValueActor(policy_mlp(3), in_keys=["observation"], action_space="one-hot"),
            observations(),
            "observation",
            {},
        )
    if kind == "ProbabilisticActor(TanhNormal)":
        net = nn.Sequential(policy_mlp(4), NormalParamExtractor())
        actor = ProbabilisticActor(
            TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"]),
            in_keys=["loc", "scale"],
            distribution_class=TanhNormal,
        )
        return actor, observations(), "observation", {"target_key": "loc"}
    if kind == "LSTMModule":
        rnn = LSTMModule(input_size=4, hidden_size=6, in_key="observation", out_key="embed").to(F64)
        head = TensorDictModule(nn.Linear(6, 3).to(F64), ["embed"], ["out"])
        td = TensorDict(observation=torch.randn(3, 4, 4, dtype=F64), batch_size=[3, 4])
        td["is_init"] = torch.zeros(3, 4, 1, dtype=torch.bool)
        td["is_init"][:, 0] = True
        return RecurrentSequence(rnn, head), td, "observation", {"target_key": "out"}
    centralized = kind.endswith("centralised)")
    net = MultiAgentMLP(
        4, 2, n_agents=3, centralized=centralized, share_params=False, depth=2, num_cells=8, activation_class=nn.Tanh
    )
    module = TensorDictModule(net.to(F64), [("agents", "observation")], [("agents", "out")])
    agents = TensorDict(observation=torch.randn(5, 3, 4, dtype=F64), batch_size=[5, 3])
    return module, TensorDict(agents=agents, batch_size=[5]), ("agents", "observation"), {}


TORCHRL = [
    "QValueActor",
    "ProbabilisticActor(TanhNormal)",
    "LSTMModule",
    "MultiAgentMLP(share_params=False)",
    "MultiAgentMLP(share_params=False, centralised)",
]


@pytest.mark.parametrize("kind", TORCHRL)
def test_torchrl_heads(kind: str):
    """Every parameter of the head (a multi-agent MLP's per-agent ones, the LSTM's gates) gets the derivative of the
    relevance; the actor acts deterministically (the TanhNormal's mode), the LSTM over whole sequences."""
    module, td, key, kwargs = torchrl_case(kind)
    with set_exploration_type(ExplorationType.DETERMINISTIC):
        assert_exact(directional_errors(module, PRESETS["EpsilonPlus"], td, key, **kwargs))


# ---------------------------------------------------------------------------------------------- gates, shared layers


class GLUNet(nn.Module):
    def __init__(self, functional: bool) -> None:
        super().__init__()
        self.a, self.glu, self.b, self.functional = nn.Linear(5, 16), nn.GLU(-1), nn.Linear(8, 3), functional

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(F.glu(h, -1) if self.functional else self.glu(h))


class HardSqueezeExcite(nn.Module):
    """mobilenet_v3's squeeze-excite: a hard-sigmoid gate on the channels."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.reduce, self.expand = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 1), nn.Conv2d(4, 8, 1)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv(x))
        gate = F.hardsigmoid(self.expand(F.relu(self.reduce(h.mean((2, 3), keepdim=True)))))
        return self.head((h * gate).mean((2, 3)))


class CalledTwice(nn.Module):
    """One convolution applied twice (weights shared across depth)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.shared, self.head = (
            nn.Conv2d(2, 4, 3, padding=1),
            nn.Conv2d(4, 4, 3, padding=1),
            nn.Linear(64, 3),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.shared(F.relu(self.shared(F.relu(self.first(x))))))
        return self.head(h.flatten(1))


def dense(first: nn.Module) -> nn.Module:
    return nn.Sequential(first, nn.ReLU(), nn.Linear(6, 3))


MODELS = {
    "nn.GLU": (lambda: GLUNet(functional=False), (4, 5)),
    "F.glu": (lambda: GLUNet(functional=True), (4, 5)),
    "hard-sigmoid squeeze-excite": (HardSqueezeExcite, (2, 3, 5, 5)),
    "convolution called twice": (CalledTwice, (2, 2, 4, 4)),
    "spectral_norm (eval)": (lambda: dense(parametrizations.spectral_norm(nn.Linear(5, 6))).eval(), (4, 5)),
    # Square: the matrix exponential map (the Householder one of a non-square weight is not smooth in its parameter).
    "orthogonal": (lambda: dense(parametrizations.orthogonal(nn.Linear(6, 6))), (4, 6)),
}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_gates_shared_layers_and_parametrisations(model: str):
    """Held gates pass their derivative on to the gate's layers; a layer called twice sums both calls' paths; a
    parametrised weight passes its derivative on to the parametrisation's own parameters."""
    build, shape = MODELS[model]
    preset = "EpsilonGammaBox" if len(shape) == 4 else "EpsilonPlus"  # the same ε-rule on dense layers
    torch.manual_seed(0)
    net = build().to(F64)
    td = TensorDict(x=2 * torch.randn(*shape, dtype=F64), batch_size=shape[:1])
    assert_exact(directional_errors(net, PRESETS[preset], td, "x", in_keys=["x"], out_keys=["y"]))


# ---------------------------------------------------------------------------------------------- training loops


class ResidualCNN(nn.Module):
    """Convolutions with eval-mode BatchNorms (merged) and a residual addition."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6)
        self.c2, self.b2 = nn.Conv2d(6, 6, 3, padding=1), nn.BatchNorm2d(6)
        self.fc = nn.Linear(6 * 16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.b1(self.c1(x)))
        h = F.relu(h + self.b2(self.c2(h)))
        return self.fc(F.avg_pool2d(h, 2).flatten(1))


def training_case(kind: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if kind == "MLP":
        net = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
        return net.to(F64), torch.randn(8, 5, dtype=F64)
    net = ResidualCNN().to(F64)
    with torch.no_grad():
        for module in net.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.normal_()
                module.running_var.uniform_(0.5, 2.0)
                module.weight.normal_()
                module.bias.normal_()
    return net.eval(), torch.randn(4, 3, 8, 8, dtype=F64)


OPTIMIZERS = {
    "SGD(momentum)": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "Adam": lambda params: torch.optim.Adam(params, lr=1e-2),
}
STEPS = 3


def task_and_penalty(relevance: torch.Tensor, logits: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    labels = torch.arange(logits.shape[0]) % logits.shape[1]
    return F.cross_entropy(logits, labels) + (relevance * weights).pow(2).sum()


def train_in_context(net: nn.Module, x: torch.Tensor, weights: torch.Tensor, mapper, optimizer: str, fresh: bool):
    """``STEPS`` optimizer steps on a loss of the relevance, in one open context (or a fresh wrapper per step)."""
    opt = OPTIMIZERS[optimizer](net.parameters())
    lrp = LRP(net, mapper(), in_keys=["x"], out_keys=["y"], create_graph=True)

    def step(wrapper: LRP) -> None:
        td = wrapper(TensorDict(x=x, batch_size=x.shape[:1]))
        opt.zero_grad()
        task_and_penalty(td["relevance", "x"], td["y"], weights).backward()
        opt.step()

    if fresh:
        for _ in range(STEPS):
            step(LRP(net, mapper(), in_keys=["x"], out_keys=["y"], create_graph=True))
    else:
        with lrp:
            for _ in range(STEPS):
                step(lrp)
    return net


def train_by_hand(net: nn.Module, x: torch.Tensor, weights: torch.Tensor, optimizer: str) -> nn.Module:
    """The same loop on gradient × input at the argmax, with autograd's double backward."""
    opt = OPTIMIZERS[optimizer](net.parameters())
    for _ in range(STEPS):
        point = x.clone().requires_grad_(True)
        logits = net(point)
        onehot = torch.zeros_like(logits).scatter_(1, logits.argmax(1, keepdim=True), 1.0)
        (grad,) = torch.autograd.grad(logits, point, onehot, create_graph=True)
        opt.zero_grad()
        task_and_penalty(point * grad, logits, weights).backward()
        opt.step()
    return net


def assert_same_parameters(actual: nn.Module, expected: nn.Module, start: nn.Module) -> None:
    moved = max((e - s).abs().max().item() for e, s in zip(expected.parameters(), start.parameters(), strict=True))
    assert moved > 1e-2  # the loop moves the parameters
    for (name, a), e in zip(actual.named_parameters(), expected.parameters(), strict=True):
        assert torch.allclose(a, e, rtol=1e-10, atol=1e-12), name


@pytest.mark.parametrize(("kind", "optimizer"), [("MLP", "SGD(momentum)"), ("residual CNN with BatchNorm", "Adam")])
def test_a_training_loop_on_lrp0_relevance_matches_the_loop_by_hand(kind: str, optimizer: str):
    net, x = training_case(kind)
    weights = torch.randn_like(x)
    lrp0 = lambda: BaseRuleMapper(stabilizer=0.0)  # noqa: E731
    trained = train_in_context(copy.deepcopy(net), x, weights, lrp0, optimizer, fresh=False)
    assert_same_parameters(trained, train_by_hand(copy.deepcopy(net), x, weights, optimizer), net)


@pytest.mark.parametrize("preset", ["EpsilonGammaBox"])
@pytest.mark.parametrize("kind", ["residual CNN with BatchNorm"])
def test_a_training_loop_in_one_context_matches_a_fresh_wrapper_per_step(kind: str, preset: str):
    """The modified weights and merged BatchNorms follow the optimizer's in-place updates."""
    net, x = training_case(kind)
    weights = torch.randn_like(x)
    in_context = train_in_context(copy.deepcopy(net), x, weights, PRESETS[preset], "Adam", fresh=False)
    fresh = train_in_context(copy.deepcopy(net), x, weights, PRESETS[preset], "Adam", fresh=True)
    assert_same_parameters(in_context, fresh, net)


# ---------------------------------------------------------------------------------------------- gallery


@pytest.mark.gallery
@pytest.mark.parametrize("preset", ["EpsilonPlus", "EpsilonGammaBox"])
def test_resnet18(preset: str):
    """torchvision's resnet18 at 32 × 32 with calibrated BatchNorms (merged); a few parameters (the stem, a block's
    convolution, a downsampling convolution, the head)."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    net = torchvision.models.resnet18(weights=None, num_classes=5).to(F64).train()
    with torch.no_grad():
        for _ in range(3):
            net(torch.randn(16, 3, 32, 32, dtype=F64))
    net.eval()
    td = TensorDict(x=torch.randn(1, 3, 32, 32, dtype=F64), batch_size=[1])
    chosen = ("conv1.weight", "layer1.1.conv1.weight", "layer2.0.downsample.0.weight", "fc.weight")
    for name, param in net.named_parameters():
        param.requires_grad_(name in chosen)
    assert_exact(directional_errors(net, PRESETS[preset], td, "x", in_keys=["x"], out_keys=["y"]))


@pytest.mark.gallery
@pytest.mark.parametrize("preset", ["attnlrp", "cplrp"])
def test_bert_on_embeddings(preset: str):
    """A tiny random BERT classifier on ``inputs_embeds`` (its embeddings' LayerNorm, the pooler's Tanh)."""
    pytest.importorskip("transformers")
    from tdhook.attribution import CPLRP, AttnLRP
    from tests.attribution.test_lrp_transformer_zoo import ZOO, Explained, model_input

    mapper = {"attnlrp": lambda: AttnLRP(epsilon=0.1, softmax_epsilon=0.1), "cplrp": lambda: CPLRP(epsilon=0.1)}
    net = Explained(ZOO["bert"].build("sdpa", scale=1.0))
    td = TensorDict(x=model_input(ZOO["bert"])[:1, :5], batch_size=[1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_exact(directional_errors(net, mapper[preset], td, "x", in_keys=["x"], out_keys=["y"]))
