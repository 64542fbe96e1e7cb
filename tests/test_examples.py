"""The examples (the README's main job among them) run end to end and write a picture."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

EXAMPLES = Path(__file__).parent.parent / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_main_job_explains_the_shipped_policy_and_writes_a_png(tmp_path: Path, capsys):
    output = load("explain_cartpole").main(output=tmp_path / "relevance.png")
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "pole angle" in printed and "nan" not in printed
    # The shipped policy is trained: its greedy episode balances the pole for the full 500 steps.
    assert "episode of 500 steps" in printed


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
    history = trainer.train(trainer.make_policy(env), env, max_updates=25)
    assert len(history) == 25
    assert sum(history[-5:]) / 5 > 2 * sum(history[:5]) / 5


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
