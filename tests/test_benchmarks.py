"""Each benchmark script runs once on tiny sizes, so it cannot rot (no timing is asserted).

The scripts run as their command line runs them (``__main__``, their arguments in ``sys.argv``, their folder on
the path), one after the other in one process of their own: torch, zennit and captum are imported once for all.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"

#: each script's tiny command line
COMMANDS = {
    "vision": ["bench_vision.py", "--models", "resnet18", "--batch", "1", "--size", "32", "--repeats", "1"],
    "vision presets": [
        *("bench_vision.py", "--models", "mobilenet_v3_small", "--batch", "1", "--size", "32", "--repeats", "1"),
        *("--presets", "EpsilonPlus", "--no-memory"),
    ],
    "policy": ["bench_policy.py", "--batches", "1", "3", "--repeats", "1"],
    "q-value policy": ["bench_policy.py", "--batches", "2", "--repeats", "1", "--q-value"],
    "targets": ["bench_targets.py", "--units", "2", "3", "--batch", "4", "--repeats", "1"],
    "transformer": [
        *("bench_transformer.py", "--batch", "1", "--tokens", "4"),
        *("--hidden", "16", "--layers", "1", "--repeats", "1"),
    ],
    "transformer floor": [
        *("bench_transformer.py", "--batch", "1", "--tokens", "4"),
        *("--hidden", "16", "--layers", "1", "--repeats", "1", "--floor"),
    ],
    "call timeline": [
        "call_timeline.py",
        "--batch",
        "1",
        "--tokens",
        "4",
        "--hidden",
        "16",
        "--layers",
        "1",
        "--repeats",
        "2",
    ],
    "signatures": ["bench_signatures.py", "--lengths", "3", "--hidden", "16", "--layers", "1"],
    "transformer zoo": ["bench_transformer_zoo.py", "gpt2", "llama", "--repeats", "1"],
    "transformer zoo fed ids": ["bench_transformer_zoo.py", "bert", "--ids", "--repeats", "1"],
    "profile": ["profile_vision.py", "--model", "resnet18", "--batch", "1", "--size", "32"],
    "metrics": [
        *("bench_metrics.py", "--model", "linear", "cnn", "--batch", "2"),
        *("--size", "4", "--features-per-step", "4", "--repeats", "1"),
    ],
    "metrics frozen heap": [
        *("bench_metrics.py", "--model", "linear", "--batch", "2", "--size", "4"),
        *("--features-per-step", "4", "--repeats", "1", "--frozen-heap", "--loop", "2"),
    ],
    "methods": ["bench_methods.py", "--batch", "2", "--size", "8", "--steps", "4", "--repeats", "1"],
    "operations": ["op_sequence.py", "--cases", "uniform and stop", "Taylor"],
    **{
        f"offline {clock}": [
            *("bench_offline.py", "--rows", "24", "--batch", "8", "--hidden", "8"),
            *("--repeats", "1", "--clock", clock),
        ]
        for clock in ["wall", "cpu"]
    },
}

# Runs each command as `python benchmarks/SCRIPT ARGS` would, and records what it printed or how it failed.
RUNNER = """
import contextlib, io, json, runpy, sys, traceback, warnings
folder, commands, result = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
sys.path.insert(0, folder)
printed = {}
for name, (script, *arguments) in commands.items():
    sys.argv = [f"{folder}/{script}", *arguments]
    stdout = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(stdout):
            runpy.run_path(sys.argv[0], run_name="__main__")
        printed[name] = {"stdout": stdout.getvalue()}
    except BaseException:
        printed[name] = {"stdout": stdout.getvalue(), "error": traceback.format_exc()}
with open(result, "w") as file:
    json.dump(printed, file)
"""


@pytest.fixture(scope="module")
def printed(tmp_path_factory) -> dict[str, dict[str, str]]:
    """What each benchmark printed (``stdout``), and its traceback (``error``) where it failed."""
    result = tmp_path_factory.mktemp("benchmarks") / "printed.json"
    command = [sys.executable, "-c", RUNNER, str(BENCHMARKS), json.dumps(COMMANDS), str(result)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr
    return json.loads(result.read_text())


def stdout_of(printed: dict[str, dict[str, str]], name: str) -> str:
    assert "error" not in printed[name], printed[name]["error"]
    return printed[name]["stdout"]


def test_vision_benchmark_runs_on_tiny_inputs(printed):
    stdout = stdout_of(printed, "vision")
    rows = [re.split(r"\s{2,}", line) for line in stdout.splitlines() if line.startswith("resnet18")]
    assert [row[1].strip() for row in rows] == [
        "gradient x input",
        "tdhook epsilon only",
        "tdhook EpsilonPlusFlat",
        "tdhook EpsilonGammaBox",
        "zennit epsilon only",
        "zennit EpsilonPlusFlat",
        "zennit EpsilonGammaBox",
        "captum LRP",
    ]
    # seconds, ratio and peak memory are numbers
    assert all(float(value) >= 0 for row in rows for value in " ".join(row[2:]).split())


def test_vision_benchmark_times_the_presets_asked_for_on_any_torchvision_model(printed):
    stdout = stdout_of(printed, "vision presets")
    lines = [line for line in stdout.splitlines() if line.startswith("mobilenet_v3_small")]
    assert "captum LRP refuses the model" in lines[0]  # it has no rule for Hardswish
    methods = [re.split(r"\s{2,}", line)[1] for line in lines[1:]]
    assert methods == ["gradient x input", "tdhook EpsilonPlus", "zennit EpsilonPlus"]


def test_policy_benchmark_runs_on_tiny_inputs(printed):
    stdout = stdout_of(printed, "policy")
    rows = [line.split() for line in stdout.splitlines()[2:]]
    assert [row[0] for row in rows] == ["1"] * 5 + ["3"] * 5
    assert sum("entering the context" in line for line in stdout.splitlines()) == 2
    assert all(float(row[-1]) > 0 for row in rows)


def test_q_value_policy_benchmark_runs_on_tiny_inputs(printed):
    stdout = stdout_of(printed, "q-value policy")
    assert "in a QValueActor" in stdout.splitlines()[0]
    rows = [line.split() for line in stdout.splitlines()[2:]]
    assert [row[0] for row in rows] == ["2"] * 3  # the baseline, in a context, entering one: no peers
    assert all(float(row[-1]) > 0 for row in rows)


def test_target_benchmark_runs_on_tiny_inputs(printed):
    stdout = stdout_of(printed, "targets")
    rows = [line.split() for line in stdout.splitlines()[2:]]
    assert [row[0] for row in rows] == ["2", "3"]
    assert all(float(value) > 0 for row in rows for value in row[1:])


def test_signatures_benchmark_runs_on_tiny_inputs(printed):
    stdout = stdout_of(printed, "signatures")
    rows = [re.split(r"\s{2,}", line) for line in stdout.splitlines()[2:]]
    assert [row[0] for row in rows] == [
        "AttnLRP, tiny Llama, a new shape each call",
        "AttnLRP, tiny Llama, shapes seen",
        "EpsilonPlus, small CNN, a new shape each call",
        "EpsilonPlus, small CNN, shapes seen",
    ]
    assert all(float(value) > 0 for row in rows for value in row[1:])


def test_transformer_benchmark_runs_on_tiny_inputs(printed):
    stdout = stdout_of(printed, "transformer")
    rows = [line.rsplit(None, 2) for line in stdout.splitlines()[2:]]
    tdhook = ["tdhook AttnLRP", "tdhook AttnLRP, entering", "tdhook CP-LRP", "tdhook CP-LRP, entering"]
    assert [row[0] for row in rows] == ["gradient x input", *tdhook]
    assert all(float(value) > 0 for row in rows for value in row[1:])


def test_transformer_benchmark_times_the_bare_planned_steps_when_asked(printed):
    # The bare steps are checked against the wrapper's relevance before they are timed (planned_steps.py).
    stdout = stdout_of(printed, "transformer floor")
    rows = [line.rsplit(None, 2) for line in stdout.splitlines()[2:]]
    assert [row[0] for row in rows][-2:] == ["AttnLRP, bare planned steps", "the same, no plan hooks"]
    assert all(float(value) > 0 for row in rows for value in row[1:])


def test_call_timeline_cuts_a_planned_call_where_the_model_runs(printed):
    stdout = stdout_of(printed, "call timeline")
    rows = dict(re.split(r"\s{2,}", line.strip().removesuffix(" us")) for line in stdout.splitlines()[1:])
    parts = [name for name in rows if name.startswith("AttnLRP: ") and name != "AttnLRP: all"]
    assert len(parts) == 7 and all(float(value) > 0 for value in rows.values())
    assert sum(float(rows[name]) for name in parts) == pytest.approx(float(rows["AttnLRP: all"]), rel=0.2)
    assert len([name for name in rows if name.startswith("first touch")]) == 4


def test_transformer_zoo_benchmark_runs_on_the_architectures_asked_for(printed):
    stdout = stdout_of(printed, "transformer zoo")
    rows = [line.split() for line in stdout.splitlines()[2:] if not line.startswith("[")]
    assert [row[:2] for row in rows] == [["gpt2", "eager"], ["gpt2", "sdpa"], ["llama", "eager"], ["llama", "sdpa"]]
    assert all(float(value) > 0 for row in rows for value in row[2:])


def test_transformer_zoo_benchmark_feeds_token_ids_when_asked(printed):
    stdout = stdout_of(printed, "transformer zoo fed ids")
    assert "fed token ids" in stdout.splitlines()[0]
    rows = [line.split() for line in stdout.splitlines()[2:] if not line.startswith("[")]
    assert [row[:2] for row in rows] == [["bert", "eager"], ["bert", "sdpa"]]
    assert all(float(value) > 0 for row in rows for value in row[2:])


def test_profile_script_runs_on_tiny_inputs(printed):
    stdout = stdout_of(printed, "profile")
    rows = {line.split()[0]: line.split()[-3:] for line in stdout.splitlines()[2:]}
    assert list(rows) == ["convolution", "matrix", "element-wise", "total"]
    assert all(float(value) >= 0 for value in rows["total"][:2])


def test_metrics_benchmark_runs_on_tiny_inputs(printed):
    stdout = stdout_of(printed, "metrics")
    rows = [line.split() for line in stdout.splitlines()[2:]]
    assert [row[0] for row in rows] == ["linear", "cnn"]
    assert all(float(value) >= 0 for value in rows[0][1:])
    # the bare operations' bound is for models that start with a linear layer only
    assert rows[1][-2] == "-" and all(float(value) >= 0 for value in rows[1][1:-2] + rows[1][-1:])
    assert all(float(row[-1]) < 1e-6 for row in rows)  # the same curve as Quantus


def test_metrics_benchmark_runs_with_the_imports_out_of_the_collectors_walk(printed):
    stdout = stdout_of(printed, "metrics frozen heap")
    assert stdout.splitlines()[0].endswith("frozen heap")
    [row] = [line.split() for line in stdout.splitlines()[2:]]
    assert row[0] == "linear" and all(float(value) >= 0 for value in row[1:])
    assert float(row[-1]) < 1e-6


def test_methods_benchmark_runs_on_tiny_inputs(printed):
    stdout = stdout_of(printed, "methods")
    rows = [line.rsplit(None, 2) for line in stdout.splitlines()[2:]]
    assert [row[0] for row in rows] == ["captum IntegratedGradients", "tdhook IntegratedGradients"]
    assert all(float(value) > 0 for row in rows for value in row[1:])


def test_operation_sequence_script_runs(printed):
    rows = stdout_of(printed, "operations").splitlines()
    assert [row.split(":")[0] for row in rows] == ["uniform and stop", "Taylor"]
    assert all(int(row.split(": ")[1].split()[0]) > 0 for row in rows)  # operations were recorded


@pytest.mark.parametrize("clock", ["wall", "cpu"])
def test_offline_benchmark_runs_on_tiny_inputs(printed, clock: str):
    rows = [line.rsplit(None, 2) for line in stdout_of(printed, f"offline {clock}").splitlines()[2:]]
    assert [row[0] for row in rows] == [
        "bare loop of LRP calls",
        "bare loop, relevance into a memmap",
        "explain_offline",
    ]
    assert all(float(value) > 0 for row in rows for value in row[1:])
