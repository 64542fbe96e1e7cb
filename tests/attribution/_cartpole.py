"""What the torchrl tests on CartPole share: a small Q-value actor, and the batches a collector gathers with a
policy."""

from __future__ import annotations

from tensordict import TensorDict
from tensordict.nn import TensorDictModuleBase
from torchrl.collectors import Collector
from torchrl.envs import GymEnv
from torchrl.modules import MLP, QValueActor


def q_value_actor() -> QValueActor:
    """A Q-value actor for CartPole-v1: an MLP of 16 units from its 4 observations to its 2 actions' values."""
    net = MLP(in_features=4, out_features=2, num_cells=[16])
    return QValueActor(net, in_keys=["observation"], spec=GymEnv("CartPole-v1").action_spec)


def collected(policy: TensorDictModuleBase) -> list[TensorDict]:
    """The two batches of 16 frames that a collector in this process gathers on CartPole-v1 with ``policy``."""
    collector = Collector(
        lambda: GymEnv("CartPole-v1"),
        policy,
        frames_per_batch=16,
        total_frames=32,
        auto_register_policy_transforms=False,  # a policy with no recurrent state: the env stays as it is
    )
    try:
        return list(collector)
    finally:
        collector.shutdown()
