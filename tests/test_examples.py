"""The examples (the README's main job among them) run end to end and write a picture."""

from __future__ import annotations

import doctest
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

import tdhook

EXAMPLES = Path(__file__).parent.parent / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_example(name: str, output: Path) -> subprocess.CompletedProcess:
    """``python examples/<name>.py --output <output>`` in a process of its own, as a user runs it."""
    return subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), "--output", str(output)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )


def test_main_job_explains_the_shipped_policy_and_writes_a_png_with_nothing_on_stderr(tmp_path: Path):
    # The README's command, in a process of its own: what a user's console shows, warnings at import included.
    output = tmp_path / "relevance.png"
    done = run_example("explain_cartpole", output)
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "pole angle" in done.stdout and "nan" not in done.stdout
    # The shipped policy is trained: its greedy episode balances the pole for the full 500 steps.
    assert "episode of 500 steps" in done.stdout
    assert done.stderr == ""


def test_main_job_figure_says_what_its_colours_steps_and_actions_are():
    example = load("explain_cartpole")
    env = example.GymEnv("CartPole-v1")
    env.set_seed(0)
    policy = example.train_cartpole.make_policy(env)
    policy.load_state_dict(torch.load(example.train_cartpole.CHECKPOINT))
    rollout = example.explain_episode(example.LRP(policy), env, steps=60)
    for window, title in ((None, "steps 0–59 of 60"), (25, "steps 0–24 of 60"), (100, "steps 0–59 of 60")):
        fig = example.plot_episode(rollout, window)
        heat, strip = fig.axes[:2]
        assert heat.get_title().endswith(title)
        colours = [t.get_text() for t in heat.get_legend().get_texts()]
        assert any(t.startswith("positive relevance") for t in colours)
        assert any(t.startswith("negative relevance") for t in colours)
        assert [t.get_text() for t in strip.get_legend().get_texts()] == ["push cart left", "push cart right"]
        # The heatmap holds the relevance (features as rows), the strip the actions taken, both over the steps shown.
        shown = 60 if window is None or window > 60 else window
        relevance = rollout["relevance", "observation"][:shown]
        np.testing.assert_array_equal(heat.get_images()[0].get_array(), relevance.T.numpy())
        np.testing.assert_array_equal(strip.get_images()[0].get_array()[0], rollout["action"][:shown].argmax(-1))
        assert [t.get_text() for t in heat.get_yticklabels()] == example.FEATURES
        example.plt.close(fig)


def test_main_job_example_docstrings_run():
    for name in ("explain_cartpole", "train_cartpole", "explain_recurrent_cartpole"):
        failed, attempted = doctest.testmod(load(name), optionflags=doctest.NORMALIZE_WHITESPACE)
        assert attempted > 0 and failed == 0, name


def test_main_job_table_and_relevance_follow_the_rollout():
    example = load("explain_cartpole")
    env = example.GymEnv("CartPole-v1")
    env.set_seed(1)
    policy = example.train_cartpole.make_policy(env)
    policy.load_state_dict(torch.load(example.train_cartpole.CHECKPOINT))
    rollout = example.explain_episode(example.LRP(policy), env, steps=40)
    relevance = rollout["relevance", "observation"]
    assert relevance.shape == rollout["observation"].shape == (40, 4)
    logits = rollout["logits"]
    assert torch.equal(rollout["action"].argmax(-1), logits.argmax(-1))  # greedy actions
    # The same as explaining the logits network alone on the rollout's observations. One batch-40 call and 40
    # batch-1 calls take different matrix kernels, whose float32 sums may differ in the last bits.
    net = TensorDictModule(policy.module[0].module, in_keys=["observation"], out_keys=["logits"])
    alone = example.LRP(net)(TensorDict(observation=rollout["observation"], batch_size=[40]))
    torch.testing.assert_close(relevance, alone["relevance", "observation"])
    table = example.feature_table(rollout)
    assert len(table.splitlines()) == 2 + 4


def test_training_improves_the_policy():
    trainer = load("train_cartpole")
    torch.manual_seed(0)
    env = trainer.GymEnv("CartPole-v1")
    env.set_seed(0)
    history = trainer.train(trainer.make_policy(env), env, max_updates=25, max_seconds=float("inf"))
    assert len(history) == 25
    assert sum(history[-5:]) / 5 > 2 * sum(history[:5]) / 5


def test_training_says_when_it_stops_at_its_time_cap(capsys):
    trainer = load("train_cartpole")
    env = trainer.GymEnv("CartPole-v1")
    env.set_seed(0)
    history = trainer.train(trainer.make_policy(env), env, max_seconds=0.5)
    printed = capsys.readouterr().out
    assert history and f"stopped at the time cap (0.5 s) after {len(history)} updates" in printed
    assert f"reached mean return {history[-1]:.0f} (target 475)" in printed


def test_training_says_when_it_reaches_the_target(capsys):
    trainer = load("train_cartpole")
    env = trainer.GymEnv("CartPole-v1")
    env.set_seed(0)
    history = trainer.train(trainer.make_policy(env), env, target_return=1.0)
    assert len(history) == 1
    printed = capsys.readouterr().out
    assert "reached the target return 1 after 1 updates" in printed and "time cap" not in printed


def test_vision_heatmap_writes_a_png(tmp_path: Path, capsys):
    example = load("vision_heatmap")
    output = example.main(tmp_path / "figures" / "heatmap.png", size=32)
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "predicted class" in printed and "nan" not in printed

    image = example.synthetic_image(32)
    assert image.shape == (1, 3, 32, 32) and 0.0 <= image.min() and image.max() <= 1.0
    model = example.build_model()
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert norms and all(not torch.allclose(m.running_var, torch.ones_like(m.running_var)) for m in norms)
    td = example.explain(model, image)
    relevance = td["relevance", "image"]
    assert relevance.shape == image.shape and torch.isfinite(relevance).all()
    assert relevance.abs().sum() > 0


def test_offline_distributed_example_prints_two_ranks_equal_to_one_process(tmp_path: Path):
    # The documentation's command, on fewer rows: two ranks by torchrun on gloo, then one process on rank 0.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(tdhook.__file__).parents[1]), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    arguments = [str(EXAMPLES / "explain_offline_distributed.py"), "--rows", "1000", "--folder", str(tmp_path)]
    done = subprocess.run([*command, *arguments], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert "1000 rows, batch size 256" in done.stdout
    assert "max |ranks - one process| with the same batches: 0\n" in done.stdout
    other = done.stdout.split("max |ranks - one process| with batches of 356: ")[1].split()[0]
    assert float(other) < 1e-5


def recurrent_episode(example, seed: int, steps: int):
    env = example.make_env(seed)
    policy = example.make_policy(env)
    policy.load_state_dict(torch.load(example.CHECKPOINT))
    return policy, example.run_episode(policy, env, steps)


def test_recurrent_example_explains_the_shipped_policy_and_writes_a_png_with_nothing_on_stderr(tmp_path: Path):
    output = tmp_path / "recurrent_relevance.png"
    done = run_example("explain_recurrent_cartpole", output)
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The shipped policy is trained: its greedy episode keeps the pole up over the whole 100-step window.
    assert "episode of 100 steps" in done.stdout and "nan" not in done.stdout
    assert done.stderr == ""
    # No training: the checkpoint is loaded (training says how it stopped or that it reached its target).
    assert "stopped" not in done.stdout and "reached the target" not in done.stdout


def test_recurrent_example_relevance_is_causal_and_conserved():
    example = load("explain_recurrent_cartpole")
    policy, episode = recurrent_episode(example, seed=1, steps=40)
    assert len(episode) == 40 and episode["observation"].shape == (40, 2)  # velocities dropped
    explained = example.explain_episode(policy, episode)
    relevance = explained["relevance", "observation"][0]  # [t (action), s (observation), feature]
    assert relevance.shape == (40, 40, 2)
    # Only the observation is explained: is_init holds booleans, and the sequence carries no recurrent state.
    assert set(explained["relevance"].keys()) == {"observation"}
    # The [1, T] sequence in recurrent mode computes the logits the step-mode rollout acted on.
    torch.testing.assert_close(explained["logits"][0], episode["logits"], rtol=1e-5, atol=1e-5)

    # Causal: the action at step t has no relevance on the observations after t, and the memory is used (the
    # observations one and two steps back get relevance too).
    later = torch.ones(40, 40, dtype=torch.bool).triu(1)
    assert relevance[later].abs().max() == 0
    assert relevance.diagonal(-1).abs().sum() > 0 and relevance.diagonal(-2).abs().sum() > 0

    # Conserved: the policy has no biases and starts from a zero state, so every rule passes on all the relevance it
    # receives but what its stabilizer absorbs where a pre-activation or cell state is close to 0. Each step's
    # relevance over all the observations (all steps, both features) sums to the chosen action's logit at that step.
    chosen = explained["logits"][0].max(-1).values
    scale = chosen.abs().max()
    gap = relevance.sum((-2, -1)) - chosen
    assert gap.abs().max() <= 1e-4 * scale  # the example's EpsilonPlus (ε = 1e-6), float32: 1.6e-5 measured
    # In float64, with ε = 1e-9, what the stabilizer absorbs all but vanishes.
    episode64 = episode.apply(lambda x: x.double() if x.is_floating_point() else x)
    tight = example.EpsilonPlus(epsilon=1e-9, stabilizer=1e-9)
    exact = example.explain_episode(policy.double(), episode64, tight)
    gap64 = exact["relevance", "observation"][0].sum((-2, -1)) - exact["logits"][0].max(-1).values
    assert gap64.abs().max() <= 1e-7 * scale  # 1.6e-8 measured
    torch.testing.assert_close(exact["relevance", "observation"][0].float(), relevance, rtol=1e-3, atol=1e-4 * scale)


def test_recurrent_example_figure_shows_each_steps_relevance_the_actions_and_the_lags():
    example = load("explain_recurrent_cartpole")
    policy, episode = recurrent_episode(example, seed=0, steps=30)
    explained = example.explain_episode(policy, episode)
    relevance = explained["relevance", "observation"][0]
    fig = example.plot_episode(explained, lags=5)
    axes = {axis.get_title(): axis for axis in fig.axes}
    assert "greedy episode of 30 steps" in fig._suptitle.get_text()
    later = torch.ones(30, 30, dtype=torch.bool).triu(1)
    for title, values in zip(
        ["summed over features", "cart position", "pole angle"], [relevance.sum(-1), *relevance.unbind(-1)], strict=True
    ):
        image = axes[title].get_images()[0]
        np.testing.assert_array_equal(image.get_array(), values.numpy())
        assert not image.get_array()[later.numpy()].any()  # white right of the diagonal
        assert axes[title].get_xlabel() == "step s of the observation"
        assert image.colorbar is not None and image.colorbar.ax.get_ylabel() == "relevance"
    np.testing.assert_array_equal(axes["action"].get_images()[0].get_array()[:, 0], episode["action"].argmax(-1))
    assert axes["action"].get_ylabel() == "step t of the action"
    legends = [axis.get_legend() for axis in fig.axes if axis.get_legend() is not None]
    texts = [[t.get_text() for t in legend.get_texts()] for legend in legends]
    assert ["push cart left", "push cart right"] in texts and example.FEATURES in texts
    profile = axes["mean relevance of the observation k steps before the action"]
    by_lag = example.relevance_by_lag(relevance, 5)
    lines = profile.get_lines()[: len(example.FEATURES)]  # then the zero line
    for line, values in zip(lines, by_lag.unbind(-1), strict=True):
        np.testing.assert_allclose(line.get_ydata(), values.numpy())
    # Lag 0 is the diagonal of the maps: the mean relevance of each step's own observation.
    torch.testing.assert_close(by_lag[0], relevance.diagonal().mean(-1))
    example.plt.close(fig)


def test_recurrent_training_improves_over_random_and_says_why_it_stopped(capsys):
    example = load("explain_recurrent_cartpole")
    torch.manual_seed(0)
    env = example.make_env(0)
    # No time cap here: on a busy machine 50 s may end the run before its 25 updates.
    history = example.train(example.make_policy(env), env, max_updates=25, max_seconds=float("inf"))
    assert len(history) == 25
    # The first updates are as long as random play (about 22 steps); the last ten are more than half as long again.
    assert sum(history[-10:]) / 10 > 1.5 * sum(history[:5]) / 5
    assert "stopped after the maximum of 25 updates" in capsys.readouterr().out
