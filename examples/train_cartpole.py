"""Train a small categorical policy on CartPole-v1 with REINFORCE (about a minute on one CPU core).

The policy is a torchrl ``ProbabilisticActor``: an MLP maps the observation to
two logits, and a ``OneHotCategorical`` samples the action. Training stops when
the mean return of a batch of episodes reaches ``target_return`` or after
``max_seconds``. The state dict is saved for ``examples/explain_cartpole.py``;
a copy trained with the defaults ships as ``examples/cartpole_policy.pt``.

    python examples/train_cartpole.py --output examples/cartpole_policy.pt
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule
from torchrl.envs import EnvBase, GymEnv
from torchrl.envs.utils import ExplorationType, set_exploration_type
from torchrl.modules import MLP, OneHotCategorical, ProbabilisticActor
from tqdm import tqdm  # the plain bar: tqdm.auto warns in notebooks without ipywidgets

CHECKPOINT = Path(__file__).parent / "cartpole_policy.pt"


def make_policy(env: EnvBase) -> ProbabilisticActor:
    """A ``ProbabilisticActor`` reading ``"observation"`` and writing ``"logits"`` and ``"action"``."""
    net = MLP(in_features=4, out_features=2, num_cells=[32], activation_class=torch.nn.Tanh)
    return ProbabilisticActor(
        TensorDictModule(net, in_keys=["observation"], out_keys=["logits"]),
        in_keys=["logits"],
        distribution_class=OneHotCategorical,
        spec=env.action_spec,
    )


def train(
    policy: ProbabilisticActor,
    env: EnvBase,
    *,
    max_seconds: float = 90.0,
    target_return: float = 475.0,
    episodes_per_update: int = 4,
    lr: float = 1e-2,
    max_updates: int | None = None,
    log_prob: Callable[[list[TensorDictBase]], torch.Tensor] | None = None,
) -> list[float]:
    """REINFORCE with normalised returns-to-go; returns the mean episode return of each update.

    Episodes are collected without gradients (sampled actions); the log-probabilities
    of the taken actions are recomputed in one batch for the update, by ``log_prob``
    (the episodes -> their steps' log-probabilities, concatenated in order) if given,
    else by the MLP behind the logits.
    """
    net = policy.module[0].module  # the MLP behind the logits
    if log_prob is None:

        def log_prob(episodes: list[TensorDictBase]) -> torch.Tensor:
            observation = torch.cat([ep["observation"] for ep in episodes])
            action = torch.cat([ep["action"] for ep in episodes]).float()
            return (net(observation).log_softmax(-1) * action).sum(-1)

    optimiser = torch.optim.Adam(policy.parameters(), lr=lr)
    history: list[float] = []
    start = time.monotonic()
    bar = tqdm(desc="training on CartPole-v1", unit="update", total=max_updates)
    while time.monotonic() - start < max_seconds and (max_updates is None or len(history) < max_updates):
        episodes = []
        for _ in range(episodes_per_update):
            with torch.no_grad(), set_exploration_type(ExplorationType.RANDOM):
                episodes.append(env.rollout(500, policy, break_when_any_done=True))
        returns_to_go = [ep["next", "reward"].squeeze(-1).flip(0).cumsum(0).flip(0) for ep in episodes]
        flat = torch.cat(returns_to_go)
        advantage = (flat - flat.mean()) / (flat.std() + 1e-8)
        loss = -(log_prob(episodes) * advantage).mean()
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()

        history.append(sum(len(ep) for ep in episodes) / len(episodes))
        bar.update()
        bar.set_postfix(mean_return=history[-1])
        if history[-1] >= target_return:
            break
    bar.close()
    if history and history[-1] >= target_return:
        print(f"reached the target return {target_return:g} after {len(history)} updates")
    elif max_updates is not None and len(history) == max_updates:
        print(f"stopped after the maximum of {max_updates} updates, reached mean return {history[-1]:.0f}")
    else:
        print(stop_message(history, max_seconds, target_return))
    return history


def stop_message(history: list[float], max_seconds: float, target_return: float) -> str:
    """What training says when it stops at its time cap before reaching the target return.

    Example:
        >>> stop_message([20.0, 35.5, 180.25], max_seconds=90, target_return=475)
        'stopped at the time cap (90 s) after 3 updates, reached mean return 180 (target 475)'
    """
    reached = f"reached mean return {history[-1]:.0f}" if history else "no update finished"
    cap = f"stopped at the time cap ({max_seconds:g} s) after {len(history)} updates"
    return f"{cap}, {reached} (target {target_return:g})"


def main(output: Path = CHECKPOINT, max_seconds: float = 90.0, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    env = GymEnv("CartPole-v1")
    env.set_seed(seed)
    policy = make_policy(env)
    train(policy, env, max_seconds=max_seconds)
    output.parent.mkdir(parents=True, exist_ok=True)
    torch.save(policy.state_dict(), output)
    print(f"saved {output}")
    return output


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=CHECKPOINT)
    parser.add_argument("--max-seconds", type=float, default=90.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    main(args.output, args.max_seconds, args.seed)
