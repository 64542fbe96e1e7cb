"""Explain a CartPole Q-value policy with LRP and save a picture of the relevance.

Runs a real ``GymEnv("CartPole-v1")`` rollout through an LRP-wrapped torchrl
``QValueActor``: each step's observation gets a relevance for the chosen
action's value, recorded in the rollout TensorDict next to the observation.

    python examples/quickstart.py --steps 100 --output cartpole_relevance.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from torchrl.envs import GymEnv  # noqa: E402
from torchrl.modules import MLP, QValueActor  # noqa: E402

from tdhook.attribution import LRP  # noqa: E402
from tdhook.attribution.lrp_helpers.rules import EpsilonPlus  # noqa: E402

FEATURES = ["cart position", "cart velocity", "pole angle", "pole angular velocity"]


def fit_q_network(net: torch.nn.Module, steps: int = 300) -> None:
    """Fit the network to a simple hand-made Q-function so that it acts sensibly.

    The target prefers pushing the cart towards the side the pole leans to.
    """
    optimiser = torch.optim.Adam(net.parameters(), lr=1e-2)
    obs = torch.randn(1024, 4) * torch.tensor([1.0, 1.0, 0.1, 0.5])
    lean = obs[:, 2] + 0.5 * obs[:, 3]
    target = torch.stack([-lean, lean], dim=-1)
    for _ in range(steps):
        optimiser.zero_grad()
        loss = torch.nn.functional.mse_loss(net(obs), target)
        loss.backward()
        optimiser.step()


def main(steps: int, output: Path) -> Path:
    torch.manual_seed(0)
    env = GymEnv("CartPole-v1")
    env.set_seed(0)
    net = MLP(in_features=4, out_features=2, num_cells=[32, 32], activation_class=torch.nn.ReLU)
    fit_q_network(net)
    policy = QValueActor(net, in_keys=["observation"], spec=env.action_spec)

    lrp = LRP(policy, rule_mapper=EpsilonPlus())
    with lrp:
        rollout = env.rollout(steps, policy=lrp)

    observation = rollout["observation"]
    relevance = rollout["relevance", "observation"]
    share = relevance.abs() / relevance.abs().sum(-1, keepdim=True).clamp_min(1e-12)
    print(f"explained {rollout.shape[0]} steps; mean share of |relevance| per feature:")
    for name, value in zip(FEATURES, share.mean(0).tolist(), strict=True):
        print(f"  {name:>22}: {value:6.1%}")

    fig, axes = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for i, name in enumerate(FEATURES):
        axes[0].plot(observation[:, i], label=name)
        axes[1].plot(relevance[:, i], label=name)
    axes[0].set_ylabel("observation")
    axes[1].set_ylabel("LRP relevance")
    axes[1].set_xlabel("step")
    axes[0].legend(loc="upper left", fontsize="small")
    axes[0].set_title("CartPole-v1: relevance of each observation for the chosen action's value")
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120)
    plt.close(fig)
    print(f"saved {output}")
    return output


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--output", type=Path, default=Path("cartpole_relevance.png"))
    args = parser.parse_args()
    main(args.steps, args.output)
