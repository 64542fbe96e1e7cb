"""torchrl losses on small float64 networks, with batches of transitions to explain them on."""

from __future__ import annotations

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn


def ppo_loss_and_batch(batch: int) -> tuple[nn.Module, TensorDict]:
    """torchrl's PPO loss with ``reduction="none"`` on a small float64 Gaussian policy, and a batch of transitions
    with a given advantage and value target."""
    from tensordict.nn import NormalParamExtractor
    from torchrl.modules import ProbabilisticActor, TanhNormal, ValueOperator
    from torchrl.objectives import ClipPPOLoss

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2), NormalParamExtractor()).double()
    actor = ProbabilisticActor(
        TensorDictModule(net, ["observation"], ["loc", "scale"]),
        in_keys=["loc", "scale"],
        distribution_class=TanhNormal,
        return_log_prob=True,
    )
    critic = ValueOperator(nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1)).double(), ["observation"])
    loss = ClipPPOLoss(actor, critic, reduction="none")

    def double(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=torch.float64)

    td = TensorDict(
        {
            "observation": double(batch, 3),
            "action": torch.rand(batch, 1, dtype=torch.float64) * 1.8 - 0.9,
            "action_log_prob": double(batch),
            "sample_log_prob": double(batch),
            "advantage": double(batch, 1),
            "value_target": double(batch, 1),
            ("next", "observation"): double(batch, 3),
            ("next", "reward"): double(batch, 1),
            ("next", "done"): torch.zeros(batch, 1, dtype=torch.bool),
            ("next", "terminated"): torch.zeros(batch, 1, dtype=torch.bool),
        },
        batch_size=[batch],
    )
    return loss, td
