"""A model that draws at random in its own forward is named, once, where the explained target depends on the draw;
samplers, exploration steps and Dropout modules, which draw by design, are not."""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule, TensorDictSequential
from torch import nn
from torchrl.data import OneHot
from torchrl.envs.utils import ExplorationType, set_exploration_type
from torchrl.modules import MLP, EGreedyModule, OneHotCategorical, ProbabilisticActor, QValueActor

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.rules import CPLRP, EpsilonPlus

DRAWS = "draws at random in its own forward"


class NoisyEncoder(nn.Module):
    """A linear layer on its input plus noise drawn in the forward (a reparameterised sample's form)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x + torch.randn_like(x))


class Model(nn.Module):
    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder, self.head = encoder, nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def draw_warnings(lrp: LRP, td: TensorDict) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lrp(td.clone())
    return [str(w.message) for w in caught if DRAWS in str(w.message)]


def test_a_draw_in_a_forward_is_named_once() -> None:
    lrp = LRP(Model(NoisyEncoder()), EpsilonPlus(), in_keys=["x"], out_keys=["y"])
    (message,) = draw_warnings(lrp, TensorDict(x=torch.randn(4, 3), batch_size=[4]))
    assert "module 'encoder' (NoisyEncoder)" in message and "torch.randn_like" in message
    assert draw_warnings(lrp, TensorDict(x=torch.randn(4, 3), batch_size=[4])) == []  # told once
    assert draw_warnings(lrp, TensorDict(x=torch.randn(5, 3), batch_size=[5])) == []  # another signature, watched


@pytest.mark.parametrize(
    "draw",
    [
        lambda x: x * torch.full_like(x, 0.5).bernoulli(),
        lambda x: torch.rand(x.shape) * x,
        lambda x: x[torch.randperm(x.shape[0])],
        lambda x: x * torch.empty_like(x).uniform_(),
        lambda x: x + torch.normal(0.0, 1.0, x.shape),
    ],
    ids=["Tensor.bernoulli", "torch.rand", "torch.randperm", "Tensor.uniform_", "torch.normal"],
)
def test_every_kind_of_draw_is_named(draw, request) -> None:
    class Drawing(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return draw(x)

    lrp = LRP(Model(nn.Sequential(nn.Linear(3, 2), Drawing())), CPLRP(), in_keys=["x"], out_keys=["y"])
    (message,) = draw_warnings(lrp, TensorDict(x=torch.rand(4, 3), batch_size=[4]))
    assert "module 'encoder.1' (Drawing)" in message and request.node.callspec.id in message


def test_vitmae_random_mask_is_named() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTMAEConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, image_size=32, patch_size=8
    )

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = transformers.ViTMAEModel(config).eval()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(pixel_values=x).last_hidden_state[:, 0]

    lrp = LRP(Encoder(), CPLRP(), in_keys=["x"], out_keys=["y"])
    (message,) = draw_warnings(lrp, TensorDict(x=torch.randn(2, 3, 32, 32), batch_size=[2]))
    assert "module 'model.embeddings' (ViTMAEEmbeddings)" in message and "torch.rand" in message


def test_samplers_exploration_and_dropout_modules_are_not_named_here() -> None:
    actor = ProbabilisticActor(
        TensorDictModule(
            MLP(in_features=4, out_features=2, num_cells=[8]), in_keys=["observation"], out_keys=["logits"]
        ),
        in_keys=["logits"],
        distribution_class=OneHotCategorical,
        spec=OneHot(2),
        return_log_prob=True,
    )
    td = TensorDict(observation=torch.randn(3, 4), batch_size=[3])
    with set_exploration_type(ExplorationType.RANDOM):  # the action drawn is the one explained
        assert draw_warnings(LRP(actor, EpsilonPlus()), td) == []
    q_actor = QValueActor(MLP(in_features=4, out_features=2, num_cells=[8]), in_keys=["observation"], spec=OneHot(2))
    greedy = TensorDictSequential(q_actor, EGreedyModule(spec=OneHot(2), eps_init=0.5))
    assert draw_warnings(LRP(greedy, EpsilonPlus()), td) == []
    dropout = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 2)).train()  # warned of as a module
    assert draw_warnings(LRP(dropout, EpsilonPlus(), in_keys=["observation"], out_keys=["y"]), td) == []


def test_a_draw_with_the_model_deterministic_is_not_named() -> None:
    lrp = LRP(Model(nn.Linear(3, 2)), EpsilonPlus(), in_keys=["x"], out_keys=["y"])
    assert draw_warnings(lrp, TensorDict(x=torch.randn(4, 3), batch_size=[4])) == []


class SampledState(nn.Module):
    """A mean, and a state sampled around it (RSSM's form: ``mean + torch.randn_like(std) * std``)."""

    def __init__(self) -> None:
        super().__init__()
        self.mean, self.std = nn.Linear(3, 2), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean, std = self.mean(x), nn.functional.softplus(self.std(x))
        return mean, mean + torch.randn_like(std) * std


@pytest.mark.parametrize(("target_key", "named"), [("mean", False), ("state", True)])
def test_a_draw_is_named_where_the_target_depends_on_it(target_key: str, named: bool) -> None:
    module = TensorDictModule(SampledState(), in_keys=["x"], out_keys=["mean", "state"])
    lrp = LRP(module, CPLRP(), target_key=target_key)
    found = draw_warnings(lrp, TensorDict(x=torch.randn(4, 3), batch_size=[4]))
    assert len(found) == int(named)
    assert all("module 'module' (SampledState)" in message and "torch.randn_like" in message for message in found)


class VariationalEncoder(nn.Module):
    """A code sampled by ``torch.distributions.Normal(...).rsample()`` in a plain module (a VAE's encoder), decoded."""

    def __init__(self) -> None:
        super().__init__()
        self.mean, self.log_std, self.decoder = nn.Linear(4, 2), nn.Linear(4, 2), nn.Linear(2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        code = torch.distributions.Normal(self.mean(x), self.log_std(x).exp()).rsample()
        return self.decoder(code)


def test_a_sample_of_a_torch_distribution_is_named_and_nothing_is_left_on_the_tensors() -> None:
    model, codes = VariationalEncoder(), []
    model.decoder.register_forward_pre_hook(lambda module, args: codes.append(args[0]))  # the code drawn
    lrp = LRP(model, CPLRP(), in_keys=["x"], out_keys=["y"])
    (message,) = draw_warnings(lrp, TensorDict(x=torch.randn(3, 4), batch_size=[3]))
    assert "the model itself (VariationalEncoder)" in message and "Tensor.normal_" in message
    assert codes and all(vars(code) == {} for code in codes)  # the watch keeps its own record of what was drawn


class SampledKeys(nn.Module):
    """Units picked by their scores against units sampled at random (ProbSparse attention's form): the draw reaches
    the output through integer indices only."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.layer(x)
        sampled = scores[:, torch.randint(0, 6, (3,))]
        picked = sampled.topk(2, dim=-1).indices  # no gradient: only the picked units carry the draw on
        return scores.gather(1, picked)


def test_a_draw_that_picks_units_is_named_through_their_indices() -> None:
    lrp = LRP(SampledKeys(), CPLRP(), in_keys=["x"], out_keys=["y"])
    (message,) = draw_warnings(lrp, TensorDict(x=torch.randn(4, 6), batch_size=[4]))
    assert "(SampledKeys)" in message and "torch.randint" in message


class RandomBranch(nn.Module):
    """One of two layers picked by a draw read into Python (stochastic depth's or a random augmentation's form):
    the draw reaches the output through the branch taken, not through a node of its graph."""

    def __init__(self, read: str) -> None:
        super().__init__()
        self.a, self.b, self.read = nn.Linear(3, 2), nn.Linear(3, 2), read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        draw = torch.rand(())
        taken = {
            "bool": lambda: bool(draw < 0.5),
            "item": lambda: draw.item() < 0.5,
            "float": lambda: float(draw) < 0.5,
            "equal": lambda: torch.equal(draw < 0.5, torch.tensor(True)),
            "allclose": lambda: torch.allclose((draw < 0.5).float(), torch.ones(())),
            "is_nonzero": lambda: torch.is_nonzero(draw < 0.5),
            "numpy": lambda: (draw < 0.5).numpy() == 1,
        }
        return self.a(x) if taken[self.read]() else self.b(x)


@pytest.mark.parametrize(
    ("read", "function"),
    [
        ("bool", "Tensor.__bool__"),
        ("item", "Tensor.item"),
        ("float", "Tensor.__float__"),
        ("equal", "torch.equal"),
        ("allclose", "torch.allclose"),
        ("is_nonzero", "torch.is_nonzero"),
        ("numpy", "Tensor.numpy"),
    ],
)
def test_a_draw_that_decides_a_branch_is_named(read: str, function: str) -> None:
    lrp = LRP(Model(RandomBranch(read)), EpsilonPlus(), in_keys=["x"], out_keys=["y"])
    (message,) = draw_warnings(lrp, TensorDict(x=torch.randn(4, 3), batch_size=[4]))
    assert "module 'encoder' (RandomBranch)" in message and f"torch.rand read by {function}" in message


class RandomlySizedSlice(nn.Module):
    """A layer applied to as many leading features as a random mask keeps: the draw sets a size read into Python
    (by ``len``, ``.shape``, ``.size()`` or ``.numel()``), and reaches the output through the slice taken."""

    def __init__(self, read: str) -> None:
        super().__init__()
        self.layer, self.read = nn.Linear(3, 2), read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept = torch.rand(3) < 0.5
        size = {
            "len": lambda: len(torch.nonzero(kept)),
            "shape": lambda: kept.nonzero().shape[0],
            "size": lambda: torch.arange(3)[kept].size(0),
            "numel": lambda: torch.unique(torch.randint(0, 3, (3,))).numel(),
        }[self.read]()
        return self.layer(torch.cat([x[:, :size], torch.zeros_like(x[:, size:])], dim=1))


@pytest.mark.parametrize(
    ("read", "function"),
    [("len", "torch.rand read by len"), ("shape", "torch.rand read by Tensor.shape"), ("size", "Tensor.size")]
    + [("numel", "torch.randint read by Tensor.numel")],
)
def test_a_draw_that_sets_a_size_read_into_python_is_named(read: str, function: str) -> None:
    lrp = LRP(Model(RandomlySizedSlice(read)), EpsilonPlus(), in_keys=["x"], out_keys=["y"])
    (message,) = draw_warnings(lrp, TensorDict(x=torch.randn(4, 3), batch_size=[4]))
    assert "module 'encoder' (RandomlySizedSlice)" in message and function in message


class DrawOfAFixedSize(nn.Module):
    """Noise added to a layer's output, whose size (not set by the draw) the forward reads: the noise is named, and
    its size is no read of the draw."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(x.shape[-1])
        return x + noise[: noise.shape[0]] * len(noise) * noise.numel() * noise.size(0)


def test_the_size_of_a_draw_that_does_not_set_it_is_no_read() -> None:
    lrp = LRP(Model(DrawOfAFixedSize()), EpsilonPlus(), in_keys=["x"], out_keys=["y"])
    (message,) = draw_warnings(lrp, TensorDict(x=torch.randn(4, 2), batch_size=[4]))
    assert "(torch.randn)" in message and "read by" not in message
