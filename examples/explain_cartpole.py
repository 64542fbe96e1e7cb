"""Explain a trained CartPole-v1 policy with LRP: a per-feature table and a PNG of relevance over time.

The policy (a torchrl ``ProbabilisticActor`` over two logits, trained by
``examples/train_cartpole.py``) is loaded from ``examples/cartpole_policy.pt``,
or trained first with ``--train`` (about a minute). One greedy episode of
``GymEnv("CartPole-v1")`` runs through the LRP-wrapped policy: every step's
observation gets the relevance of the chosen action's logit, recorded in the
rollout TensorDict at ``("relevance", "observation")``.

    python examples/explain_cartpole.py --output cartpole_relevance.png
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tensordict import TensorDictBase  # noqa: E402
from torchrl.envs import GymEnv  # noqa: E402
from torchrl.envs.utils import ExplorationType, set_exploration_type  # noqa: E402

from tdhook.attribution import LRP  # noqa: E402
from tdhook.attribution.lrp_helpers.rules import EpsilonPlus  # noqa: E402

FEATURES = ["cart position", "cart velocity", "pole angle", "pole angular velocity"]
_spec = importlib.util.spec_from_file_location("train_cartpole", Path(__file__).parent / "train_cartpole.py")
train_cartpole = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_cartpole)


def explain_episode(lrp: LRP, env: GymEnv, steps: int) -> TensorDictBase:
    """One greedy episode (actions = argmax of the logits) with relevance at every step."""
    with lrp, set_exploration_type(ExplorationType.DETERMINISTIC):
        return env.rollout(steps, policy=lrp, break_when_any_done=True)


def feature_table(rollout: TensorDictBase) -> str:
    """Mean observation, mean relevance and mean share of |relevance| per feature."""
    observation = rollout["observation"]
    relevance = rollout["relevance", "observation"]
    share = relevance.abs() / relevance.abs().sum(-1, keepdim=True).clamp_min(1e-12)
    lines = [f"{'feature':>22} | {'mean obs':>9} | {'mean R':>9} | {'mean |R| share':>14}"]
    lines.append("-" * len(lines[0]))
    for i, name in enumerate(FEATURES):
        lines.append(
            f"{name:>22} | {observation[:, i].mean():9.3f} | {relevance[:, i].mean():9.3f} | {share[:, i].mean():14.1%}"
        )
    return "\n".join(lines)


def plot_episode(rollout: TensorDictBase, output: Path, window: int = 150) -> Path:
    """Each feature's observation (line) beside its relevance (filled, red > 0 > blue) over the first steps."""
    observation = rollout["observation"][:window]
    relevance = rollout["relevance", "observation"][:window]
    steps = torch.arange(observation.shape[0])
    limit = relevance.abs().max().clamp_min(1e-12).item()
    fig, axes = plt.subplots(len(FEATURES), 1, figsize=(10, 8), sharex=True)
    for i, (axis, name) in enumerate(zip(axes, FEATURES, strict=True)):
        axis.plot(steps, observation[:, i], color="black", linewidth=1.2)
        axis.set_ylabel(name, fontsize="small")
        twin = axis.twinx()
        for sign, colour in ((1, "tab:red"), (-1, "tab:blue")):
            twin.fill_between(
                steps, relevance[:, i], where=sign * relevance[:, i] > 0, color=colour, alpha=0.45, interpolate=True
            )
        twin.set_ylim(-limit, limit)
        twin.set_ylabel("relevance", fontsize="small")
    axes[0].set_title("CartPole-v1: observations (black) and LRP relevance of the chosen action's logit (filled)")
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output


def main(steps: int = 500, output: Path = Path("cartpole_relevance.png"), train: bool = False, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    env = GymEnv("CartPole-v1")
    env.set_seed(seed)
    policy = train_cartpole.make_policy(env)
    if train:
        train_cartpole.train(policy, env)
    else:
        policy.load_state_dict(torch.load(train_cartpole.CHECKPOINT))

    lrp = LRP(policy, rule_mapper=EpsilonPlus())  # explains "logits", the chosen (argmax) action's unit
    rollout = explain_episode(lrp, env, steps)
    print(f"episode of {rollout.shape[0]} steps; relevance of the chosen action's logit per observation feature:")
    print(feature_table(rollout))
    plot_episode(rollout, output)
    print(f"saved {output}")
    return output


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--output", type=Path, default=Path("cartpole_relevance.png"))
    parser.add_argument("--train", action="store_true", help="train the policy first instead of loading the checkpoint")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    main(args.steps, args.output, args.train, args.seed)
