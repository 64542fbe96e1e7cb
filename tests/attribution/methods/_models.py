"""What the method tests share: a small CNN, a two-key policy, random MLPs, and captum calls on them."""

from __future__ import annotations

import copy

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tests.conftest import relative_error


def small_cnn(seed: int = 0) -> nn.Module:
    """A float64 CNN on ``[B, 3, 8, 8]`` images with 5 logits."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 6, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(6 * 2 * 2, 5),
    ).double()


class TwoKeyNet(nn.Module):
    """A policy reading an observation ``[..., 4]`` and a goal ``[..., 2]``, with 3 action values."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 3))

    def forward(self, obs: torch.Tensor, goal: torch.Tensor) -> torch.Tensor:
        return self.body(torch.cat([obs, goal * 2.0], dim=-1))


def two_key_policy(seed: int = 0) -> TensorDictModule:
    torch.manual_seed(seed)
    return TensorDictModule(TwoKeyNet().double(), in_keys=["obs", "goal"], out_keys=["action_value"])


def random_mlp(seed: int, features: int = 5, units: int = 3) -> nn.Module:
    """A float64 MLP with smooth and piecewise-linear activations, any leading dimensions."""
    generator = torch.Generator().manual_seed(seed)
    width = int(torch.randint(4, 12, (1,), generator=generator))
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(features, width), nn.Softplus(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, units)
    ).double()


def flat(x: torch.Tensor, batch_dims: int) -> torch.Tensor:
    """``x`` with its batch dimensions flattened into one, for captum."""
    return x.reshape(-1, *x.shape[batch_dims:])


class FromCallersStatistics(nn.Module):
    """``net`` run, on every call, from a copy of it as it was when wrapped: no pass moves the running statistics
    that a later pass normalises with (the definition of each pass of a method or metric on a model in training
    mode). It holds a BatchNorm in training mode that it never runs, so that methods and metrics give it one
    perturbed copy of the batch per pass, as they give the model it wraps."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "net", copy.deepcopy(net))  # not a submodule: nothing outside sees its buffers
        self.one_copy_per_pass = nn.BatchNorm1d(1).train()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return copy.deepcopy(self.net)(x)


def bfloat16_linear(features: int, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    """A bfloat16 linear model with 3 outputs, and the float64 weights of output 0 (exactly the bfloat16 ones)."""
    torch.manual_seed(seed)
    net = nn.Linear(features, 3).to(torch.bfloat16)
    return net, net.weight[0].detach().double()


def assert_two_key_policy_matches(ours: type, theirs: type, target: int, tolerance: float = 1e-8, **options) -> None:
    """The method ``ours`` on :func:`two_key_policy`'s output ``target`` gives the attribution of both its keys that
    captum's ``theirs`` gives, both with ``options``."""
    policy = two_key_policy()
    obs, goal = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    td = ours(policy, target=target, **options)(TensorDict(obs=obs, goal=goal, batch_size=[5]))
    expected = theirs(policy.module).attribute((obs.clone(), goal.clone()), target=target, **options)
    assert relative_error(td["attribution", "obs"], expected[0]) <= tolerance
    assert relative_error(td["attribution", "goal"], expected[1]) <= tolerance


def assert_random_mlp_matches(ours: type, theirs: type, seed: int, batch: tuple[int, ...], **options) -> None:
    """The method ``ours`` (with ``options``) on :func:`random_mlp` ``seed`` over a batch of shape ``batch`` gives
    captum's ``theirs`` attribution of each sample's largest output."""
    net = random_mlp(seed)
    x = torch.randn(*batch, 5, dtype=torch.float64)
    td = ours(net, in_keys=["x"], out_keys=["y"], **options)(TensorDict(x=x, batch_size=batch))
    fx = flat(x, len(batch))
    expected = theirs(net).attribute(fx.clone(), target=net(fx).argmax(-1))
    assert relative_error(td["attribution", "x"].reshape(fx.shape), expected) <= 1e-8
