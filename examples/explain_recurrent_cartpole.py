"""Explain a recurrent CartPole-v1 policy that sees no velocities: which past observations drove each action.

CartPole-v1 with the velocities hidden (``MaskVelocities``: only the cart
position and the pole angle are observed) cannot be balanced from one
observation; a policy must remember the last ones to tell where the pole is
going. The pole angle is observed in degrees (``ObservationNorm``), which
makes it large enough for the LSTM to learn from quickly. The policy is a
torchrl ``LSTMModule`` (16 cells) and an MLP head over two logits in a
``ProbabilisticActor``, with ``InitTracker`` and the LSTM's recurrent-state
primer on the environment, as torchrl's recurrent tutorial sets them up. It
has no biases, so its relevance is conserved.

The trained weights ship as ``examples/recurrent_cartpole_policy.pt``;
``--train`` retrains them first (REINFORCE, under a minute on one CPU core;
``--train --save examples/recurrent_cartpole_policy.pt`` made the shipped copy).
One greedy episode (at most ``--steps`` steps) runs in step mode, as in
``env.rollout``; it is then explained in one call in recurrent mode, as one
``[1, T]`` sequence, with ``LRP(..., split_dim=1)``: the relevance of the
chosen action's logit at every step ``t`` on the observations of every step
``s`` (``[1, T, T, 2]``, zero for ``s > t``).

The picture shows, as ``T x T`` maps (rows: the action's step, columns: the
observation's step), the relevance summed over the two features and per
feature, the actions taken, and the mean relevance by how many steps back the
observation lies.

    python examples/explain_recurrent_cartpole.py --output recurrent_cartpole_relevance.png
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from tensordict import TensorDict, TensorDictBase  # noqa: E402
from tensordict.nn import TensorDictModule, TensorDictSequential  # noqa: E402
from torch import nn  # noqa: E402
from torchrl.data import Bounded, Composite  # noqa: E402
from torchrl.envs import Compose, EnvBase, GymEnv, InitTracker, ObservationNorm, TransformedEnv  # noqa: E402
from torchrl.envs.transforms import ObservationTransform  # noqa: E402
from torchrl.envs.utils import ExplorationType, set_exploration_type  # noqa: E402
from torchrl.modules import MLP, LSTMModule, OneHotCategorical, ProbabilisticActor, set_recurrent_mode  # noqa: E402

from tdhook.attribution import LRP, EpsilonPlus  # noqa: E402


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


train_cartpole = _load("train_cartpole")
explain_cartpole = _load("explain_cartpole")

CHECKPOINT = Path(__file__).parent / "recurrent_cartpole_policy.pt"
FEATURES = ["cart position", "pole angle"]  # in metres and degrees
KEPT = [0, 2]  # of CartPole's cart position, cart velocity, pole angle, pole angular velocity
HIDDEN = 16


class MaskVelocities(ObservationTransform):
    """Keeps the cart position and the pole angle of CartPole's ``"observation"``, dropping both velocities.

    Example:
        >>> MaskVelocities()._apply_transform(torch.tensor([0.1, 2.0, -0.05, 3.0]))
        tensor([ 0.1000, -0.0500])
    """

    def __init__(self) -> None:
        super().__init__(in_keys=["observation"], out_keys=["observation"])

    def _apply_transform(self, observation: torch.Tensor) -> torch.Tensor:
        return observation[..., KEPT]

    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase) -> TensorDictBase:
        return self._call(tensordict_reset)

    def transform_observation_spec(self, observation_spec: Composite) -> Composite:
        spec = observation_spec["observation"]
        observation_spec["observation"] = Bounded(
            low=spec.space.low[..., KEPT],
            high=spec.space.high[..., KEPT],
            shape=(*spec.shape[:-1], len(KEPT)),
            dtype=spec.dtype,
            device=spec.device,
        )
        return observation_spec


def make_env(seed: int = 0) -> TransformedEnv:
    """``GymEnv("CartPole-v1")`` observed without velocities (the pole angle in degrees), with ``InitTracker``
    (the ``"is_init"`` flag)."""
    degrees = ObservationNorm(
        loc=torch.zeros(len(KEPT)),
        scale=torch.tensor([1.0, 180.0 / math.pi]),
        in_keys=["observation"],
        standard_normal=False,
    )
    env = TransformedEnv(GymEnv("CartPole-v1"), Compose(MaskVelocities(), degrees, InitTracker()))
    env.set_seed(seed)
    return env


def make_policy(env: TransformedEnv) -> ProbabilisticActor:
    """An LSTM and an MLP head over two logits, without biases, in a ``ProbabilisticActor``.

    Appends the LSTM's recurrent-state primer to ``env``, so that its rollouts carry the state from step to step.
    """
    lstm = LSTMModule(input_size=len(KEPT), hidden_size=HIDDEN, bias=False, in_key="observation", out_key="memory")
    env.append_transform(lstm.make_tensordict_primer())
    head = MLP(
        in_features=HIDDEN,
        out_features=2,
        num_cells=[HIDDEN],
        activation_class=nn.Tanh,
        layer_kwargs={"bias": False},
        bias_last_layer=False,
    )
    return ProbabilisticActor(
        TensorDictSequential(lstm, TensorDictModule(head, in_keys=["memory"], out_keys=["logits"])),
        in_keys=["logits"],
        distribution_class=OneHotCategorical,
        spec=env.action_spec,
    )


def as_sequences(episodes: list[TensorDictBase]) -> tuple[TensorDict, torch.Tensor]:
    """The episodes' observations as one ``[N, T_max]`` batch for recurrent mode (zero-padded, ``"is_init"`` at
    their first step), and the mask of their real steps.

    Example:
        >>> episodes = [TensorDict(observation=torch.ones(n, 2), batch_size=[n]) for n in (3, 1)]
        >>> batch, steps = as_sequences(episodes)
        >>> batch.batch_size, steps.tolist()
        (torch.Size([2, 3]), [[True, True, True], [True, False, False]])
    """
    length = max(len(ep) for ep in episodes)
    batch = TensorDict(
        observation=torch.zeros(len(episodes), length, len(KEPT)),
        is_init=torch.zeros(len(episodes), length, 1, dtype=torch.bool),
        batch_size=[len(episodes), length],
    )
    batch["is_init"][:, 0] = True
    steps = torch.zeros(len(episodes), length, dtype=torch.bool)
    for i, ep in enumerate(episodes):
        batch["observation"][i, : len(ep)] = ep["observation"]
        steps[i, : len(ep)] = True
    return batch, steps


def train(policy: ProbabilisticActor, env: EnvBase, **options) -> list[float]:
    """REINFORCE (``train_cartpole.train``), the log-probabilities recomputed in recurrent mode over the episodes.

    ``options`` go to ``train_cartpole.train``; the defaults here stop at a mean return of 400 or after 50 s.
    """
    options = {"max_seconds": 50.0, "target_return": 400.0, "episodes_per_update": 4, "lr": 2e-2, **options}
    logits_module = policy.module[0]

    def log_prob(episodes: list[TensorDictBase]) -> torch.Tensor:
        batch, steps = as_sequences(episodes)
        with set_recurrent_mode(True):
            logits = logits_module(batch)["logits"][steps]  # episode after episode, as the returns are
        action = torch.cat([ep["action"] for ep in episodes]).float()
        return (logits.log_softmax(-1) * action).sum(-1)

    return train_cartpole.train(policy, env, log_prob=log_prob, **options)


def run_episode(policy: ProbabilisticActor, env: EnvBase, steps: int) -> TensorDictBase:
    """One greedy episode (actions = argmax of the logits) in step mode, the LSTM state carried by the rollout."""
    with torch.no_grad(), set_exploration_type(ExplorationType.DETERMINISTIC):
        return env.rollout(steps, policy, break_when_any_done=True)


def explain_episode(
    policy: ProbabilisticActor, episode: TensorDictBase, rule_mapper: EpsilonPlus | None = None
) -> TensorDictBase:
    """The episode as one ``[1, T]`` sequence in recurrent mode, with the relevance of the chosen action's logit at
    every step on the observations of every step: ``("relevance", "observation")`` of shape ``[1, T, T, 2]``,
    ``[0, t, s]`` for the action at step ``t`` and the observation at step ``s``. ``rule_mapper`` defaults to
    ``EpsilonPlus()``."""
    sequence = episode.select("observation", "is_init").unsqueeze(0)
    # Explains "logits", the chosen (argmax) action's unit, at every step.
    lrp = LRP(policy, rule_mapper or EpsilonPlus(), split_dim=1)
    with set_recurrent_mode(True), set_exploration_type(ExplorationType.DETERMINISTIC):
        return lrp(sequence)


def relevance_by_lag(relevance: torch.Tensor, lags: int) -> torch.Tensor:
    """The mean relevance ``[lags, features]`` of the observation ``k`` steps before the action, for ``k`` from 0,
    over the actions with such an observation (``relevance``: ``[T, T, features]``, action step first).

    Example:
        >>> relevance = torch.tensor([[[1.0], [0.0]], [[2.0], [3.0]]])  # [T=2, T=2, 1]
        >>> relevance_by_lag(relevance, 2).squeeze(-1).tolist()  # lag 0: (1 + 3) / 2, lag 1: 2
        [2.0, 2.0]
    """
    length = relevance.shape[0]
    return torch.stack([relevance.diagonal(-k).mean(-1) for k in range(min(lags, length))])


def plot_episode(explained: TensorDictBase, lags: int = 15) -> Figure:
    """``T x T`` maps of the relevance of the action at step ``t`` (rows) on the observation at step ``s``
    (columns), summed over the features and per feature, the actions taken, and the mean relevance by lag.

    Red cells are positive relevance (the observation raised the chosen action's logit), blue cells negative; the
    cells right of the diagonal (observations after the action) are zero. Each map has its own symmetric scale.

    Example:
        >>> relevance = torch.randn(1, 5, 5, 2) * torch.ones(5, 5, 1).tril()  # zero after the action's step
        >>> explained = TensorDict({"logits": torch.randn(1, 5, 2), ("relevance", "observation"): relevance},
        ...                        batch_size=[1, 5])
        >>> fig = plot_episode(explained, lags=3)
        >>> [axis.get_title() for axis in fig.axes if axis.get_images()]
        ['action', 'summed over features', 'cart position', 'pole angle']
        >>> plt.close(fig)
    """
    relevance = explained["relevance", "observation"][0].detach().cpu()  # [T (action), T (observation), F]
    action = explained["logits"][0].argmax(-1).cpu()
    length = relevance.shape[0]
    maps = [relevance.sum(-1), *relevance.unbind(-1)]
    titles = ["summed over features", *FEATURES]

    fig = plt.figure(figsize=(16, 9))
    grid = fig.add_gridspec(2, 4, width_ratios=[0.12, 1, 1, 1], height_ratios=[3, 1.3], wspace=0.35, hspace=0.3)
    strip = fig.add_subplot(grid[0, 0])
    strip.imshow(
        action[:, None].numpy(),
        cmap=ListedColormap(explain_cartpole.ACTION_COLOURS),
        vmin=0,
        vmax=1,
        aspect="auto",
        interpolation="nearest",
        extent=(-0.5, 0.5, length - 0.5, -0.5),
    )
    strip.set_xticks([])
    strip.set_ylabel("step t of the action")
    strip.set_title("action", fontsize="small")
    extent = (-0.5, length - 0.5, length - 0.5, -0.5)
    for column, (values, title) in enumerate(zip(maps, titles, strict=True), start=1):
        axis = fig.add_subplot(grid[0, column], sharey=strip)
        limit = values.abs().max().clamp_min(1e-12).item()
        image = axis.imshow(
            values.numpy(), cmap="bwr", vmin=-limit, vmax=limit, aspect="auto", interpolation="nearest", extent=extent
        )
        axis.plot([-0.5, length - 0.5], [-0.5, length - 0.5], color="grey", linewidth=0.6, linestyle=":")
        axis.set_title(title, fontsize="medium")
        axis.set_xlabel("step s of the observation")
        axis.tick_params(labelleft=False)
        fig.colorbar(image, ax=axis, fraction=0.05, pad=0.02, label="relevance")
    key = fig.add_subplot(grid[1, 0])
    key.axis("off")
    key.legend(
        handles=[
            Patch(color=c, label=a)
            for a, c in zip(explain_cartpole.ACTIONS, explain_cartpole.ACTION_COLOURS, strict=True)
        ],
        title="action taken",
        loc="center right",
        fontsize="small",
    )

    profile = fig.add_subplot(grid[1, 1:])
    by_lag = relevance_by_lag(relevance, lags)
    for i, name in enumerate(FEATURES):
        profile.plot(range(len(by_lag)), by_lag[:, i].numpy(), marker="o", label=name)
    profile.axhline(0.0, color="grey", linewidth=0.6)
    profile.set_xlabel("steps back from the action (t − s)")
    profile.set_ylabel("mean relevance")
    profile.set_title("mean relevance of the observation k steps before the action", fontsize="medium")
    profile.legend(title="feature", fontsize="small")
    fig.suptitle(
        f"CartPole-v1 without velocities, LSTM policy, greedy episode of {length} steps\n"
        "relevance (LRP, EpsilonPlus) of the chosen action's logit at step t on the observation at step s "
        "(red: raised it, blue: lowered it, white: none; nothing after t)"
    )
    return fig


def main(
    steps: int = 100,
    output: Path = Path("recurrent_cartpole_relevance.png"),
    train_first: bool = False,
    seed: int = 0,
    save: Path | None = None,
) -> Path:
    torch.manual_seed(seed)
    env = make_env(seed)
    policy = make_policy(env)
    if train_first:
        train(policy, env)
    else:
        policy.load_state_dict(torch.load(CHECKPOINT))
    if save is not None:
        save.parent.mkdir(parents=True, exist_ok=True)
        torch.save(policy.state_dict(), save)
        print(f"saved the policy at {save}")

    start = time.monotonic()
    episode = run_episode(policy, env, steps)
    explained = explain_episode(policy, episode)
    relevance = explained["relevance", "observation"][0]
    chosen = explained["logits"][0].max(-1).values
    gap = (relevance.sum((-2, -1)) - chosen).abs().max() / chosen.abs().max()
    print(f"episode of {len(episode)} steps, explained in {time.monotonic() - start:.1f} s")
    own_step = relevance.diagonal().abs().sum() / relevance.abs().sum()
    print(f"share of |relevance| on the action's own step: {own_step:.0%}")
    print(f"largest gap between a step's relevance (all steps, both features) and its logit: {gap:.1e} of the largest")
    explain_cartpole.save_figure(plot_episode(explained), output)
    print(f"saved {output}")
    return output


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="explain at most STEPS steps of the episode")
    parser.add_argument("--output", type=Path, default=Path("recurrent_cartpole_relevance.png"))
    parser.add_argument("--train", action="store_true", help="train the policy first instead of loading the checkpoint")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", type=Path, default=None, help="save the policy's state dict at SAVE")
    args = parser.parse_args()
    main(args.steps, args.output, args.train, args.seed, args.save)
