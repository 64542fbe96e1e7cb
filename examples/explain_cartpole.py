"""Explain a trained CartPole-v1 policy with LRP: a per-feature table and a PNG of relevance over time.

The policy (a torchrl ``ProbabilisticActor`` over two logits, trained by
``examples/train_cartpole.py``) is loaded from ``examples/cartpole_policy.pt``,
or trained first with ``--train`` (about a minute). One greedy episode of
``GymEnv("CartPole-v1")`` runs through the LRP-wrapped policy: every step's
observation gets the relevance of the chosen action's logit, recorded in the
rollout TensorDict at ``("relevance", "observation")``.

The picture shows the whole episode (or its first ``--window`` steps, stated in
the title): a heatmap of the relevance per feature and step (red: positive, the
feature raised the chosen action's logit; blue: negative), a strip of the
actions taken under it, and the observations below.

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
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
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


ACTIONS = ["push cart left", "push cart right"]
ACTION_COLOURS = ["tab:orange", "tab:green"]


def plot_episode(rollout: TensorDictBase, window: int | None = None) -> Figure:
    """A heatmap of the relevance per feature and step, the actions taken under it, and the observations below.

    Red cells are positive relevance (the feature raised the chosen action's logit), blue cells negative
    (it lowered it), on one symmetric colour scale. ``window`` keeps the first steps only; the title states
    which steps are shown, of how many.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> rollout = TensorDict(
        ...     {"observation": torch.randn(6, 4), "action": torch.eye(2)[torch.tensor([0, 1, 1, 0, 1, 0])],
        ...      ("relevance", "observation"): torch.randn(6, 4)}, batch_size=[6])
        >>> fig = plot_episode(rollout, window=4)
        >>> fig.axes[0].get_title()
        'CartPole-v1, greedy episode: steps 0–3 of 6'
        >>> [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
        ['push cart left', 'push cart right']
        >>> plt.close(fig)
    """
    length = rollout.shape[0]
    shown = length if window is None else min(window, length)
    observation = rollout["observation"][:shown].detach().cpu()
    relevance = rollout["relevance", "observation"][:shown].detach().cpu()
    action = rollout["action"][:shown].argmax(-1).cpu()  # one-hot actions
    limit = relevance.abs().max().clamp_min(1e-12).item()
    steps = torch.arange(shown).numpy()

    fig, axes = plt.subplots(
        2 + len(FEATURES),
        1,
        figsize=(14, 9),
        sharex=True,
        gridspec_kw={"height_ratios": [4, 0.6] + [1] * len(FEATURES)},
    )
    extent = (-0.5, shown - 0.5, len(FEATURES) - 0.5, -0.5)
    heat = axes[0]
    heat.imshow(
        relevance.T.numpy(), cmap="bwr", vmin=-limit, vmax=limit, aspect="auto", interpolation="nearest", extent=extent
    )
    heat.set_yticks(range(len(FEATURES)), FEATURES, fontsize="small")
    heat.set_title(f"CartPole-v1, greedy episode: steps 0–{shown - 1} of {length}")
    heat.legend(
        handles=[
            Patch(color="red", label="positive relevance: the feature raised the chosen action's logit"),
            Patch(color="blue", label="negative relevance: the feature lowered it"),
            Patch(facecolor="white", edgecolor="grey", label=f"white: none (scale ±{limit:.3g})"),
        ],
        title="LRP relevance per observation feature",
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize="small",
    )

    strip = axes[1]
    strip.imshow(
        action[None].numpy(),
        cmap=ListedColormap(ACTION_COLOURS),
        vmin=0,
        vmax=len(ACTIONS) - 1,
        aspect="auto",
        interpolation="nearest",
        extent=(-0.5, shown - 0.5, 0.5, -0.5),
    )
    strip.set_yticks([0], ["action"], fontsize="small")
    strip.legend(
        handles=[Patch(color=c, label=a) for a, c in zip(ACTIONS, ACTION_COLOURS, strict=True)],
        title="action taken",
        loc="upper left",
        bbox_to_anchor=(1.01, 1.6),
        fontsize="small",
    )

    for i, (axis, name) in enumerate(zip(axes[2:], FEATURES, strict=True)):
        axis.plot(steps, observation[:, i].numpy(), color="black", linewidth=1.0)
        axis.set_ylabel(name, fontsize="x-small", rotation=0, ha="right", va="center")
        axis.tick_params(labelsize="x-small")
    axes[2].set_title("observations", fontsize="small", loc="left")
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    return fig


def save_figure(fig: Figure, output: Path) -> Path:
    """Write ``fig`` as a PNG at ``output`` (making its folder) and close it."""
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return output


def main(
    steps: int = 500,
    output: Path = Path("cartpole_relevance.png"),
    train: bool = False,
    seed: int = 0,
    window: int | None = None,
) -> Path:
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
    save_figure(plot_episode(rollout, window), output)
    print(f"saved {output}")
    return output


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--output", type=Path, default=Path("cartpole_relevance.png"))
    parser.add_argument("--train", action="store_true", help="train the policy first instead of loading the checkpoint")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--window", type=int, default=None, help="plot only the first WINDOW steps (default: all)")
    args = parser.parse_args()
    main(args.steps, args.output, args.train, args.seed, args.window)
