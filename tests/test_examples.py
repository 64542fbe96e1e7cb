"""The README's main job runs end to end and writes a picture."""

from __future__ import annotations

import importlib.util
from pathlib import Path

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
