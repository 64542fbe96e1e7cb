"""The examples (the README's main job among them) run end to end and write a picture."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

EXAMPLES = Path(__file__).parent.parent / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart_writes_a_png(tmp_path: Path, capsys):
    output = load("quickstart").main(steps=30, output=tmp_path / "relevance.png")
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "pole angle" in printed and "nan" not in printed


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
