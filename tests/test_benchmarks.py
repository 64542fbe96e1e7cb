"""Each benchmark script runs once on tiny sizes, so it cannot rot (no timing is asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


def test_vision_benchmark_runs_on_tiny_inputs():
    command = [sys.executable, str(BENCHMARKS / "bench_vision.py"), "--models", "resnet18", "--batch", "1"]
    result = subprocess.run(
        [*command, "--size", "32", "--repeats", "1"], capture_output=True, text=True, timeout=600, check=True
    )
    rows = [line.split("  ") for line in result.stdout.splitlines() if line.startswith("resnet18")]
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


def test_policy_benchmark_runs_on_tiny_inputs():
    command = [sys.executable, str(BENCHMARKS / "bench_policy.py"), "--batches", "1", "3", "--repeats", "1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True)
    rows = [line.split() for line in result.stdout.splitlines()[2:]]
    assert [row[0] for row in rows] == ["1"] * 4 + ["3"] * 4
    assert all(float(row[-1]) > 0 for row in rows)


def test_target_benchmark_runs_on_tiny_inputs():
    command = [sys.executable, str(BENCHMARKS / "bench_targets.py"), "--units", "2", "3", "--batch", "4"]
    result = subprocess.run([*command, "--repeats", "1"], capture_output=True, text=True, timeout=600, check=True)
    rows = [line.split() for line in result.stdout.splitlines()[2:]]
    assert [row[0] for row in rows] == ["2", "3"]
    assert all(float(value) > 0 for row in rows for value in row[1:])


def test_transformer_benchmark_runs_on_tiny_inputs():
    command = [sys.executable, str(BENCHMARKS / "bench_transformer.py"), "--batch", "1", "--tokens", "4"]
    result = subprocess.run(
        [*command, "--hidden", "16", "--layers", "1", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    rows = [line.rsplit(None, 2) for line in result.stdout.splitlines()[2:]]
    assert [row[0] for row in rows] == ["gradient x input", "tdhook AttnLRP", "tdhook CP-LRP"]
    assert all(float(value) > 0 for row in rows for value in row[1:])


def test_profile_script_runs_on_tiny_inputs():
    command = [sys.executable, str(BENCHMARKS / "profile_vision.py"), "--model", "resnet18", "--batch", "1"]
    result = subprocess.run([*command, "--size", "32"], capture_output=True, text=True, timeout=600, check=True)
    rows = {line.split()[0]: line.split()[-3:] for line in result.stdout.splitlines()[2:]}
    assert list(rows) == ["convolution", "matrix", "element-wise", "total"]
    assert all(float(value) >= 0 for value in rows["total"][:2])


def test_metrics_benchmark_runs_on_tiny_inputs():
    command = [sys.executable, str(BENCHMARKS / "bench_metrics.py"), "--model", "linear", "cnn", "--batch", "2"]
    result = subprocess.run(
        [*command, "--size", "4", "--features-per-step", "4", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    rows = [line.split() for line in result.stdout.splitlines()[2:]]
    assert [row[0] for row in rows] == ["linear", "cnn"]
    assert all(float(value) >= 0 for row in rows for value in row[1:])
    assert all(float(row[-1]) < 1e-6 for row in rows)  # the same curve as Quantus


def test_methods_benchmark_runs_on_tiny_inputs():
    command = [sys.executable, str(BENCHMARKS / "bench_methods.py"), "--batch", "2", "--size", "8", "--steps", "4"]
    result = subprocess.run([*command, "--repeats", "1"], capture_output=True, text=True, timeout=600, check=True)
    rows = [line.rsplit(None, 2) for line in result.stdout.splitlines()[2:]]
    assert [row[0] for row in rows] == ["captum IntegratedGradients", "tdhook IntegratedGradients"]
    assert all(float(value) > 0 for row in rows for value in row[1:])


def test_offline_benchmark_runs_on_tiny_inputs():
    command = [sys.executable, str(BENCHMARKS / "bench_offline.py"), "--rows", "24", "--batch", "8", "--hidden", "8"]
    for clock in ["wall", "cpu"]:
        result = subprocess.run(
            [*command, "--repeats", "1", "--clock", clock], capture_output=True, text=True, timeout=600, check=True
        )
        rows = [line.rsplit(None, 2) for line in result.stdout.splitlines()[2:]]
        assert [row[0] for row in rows] == [
            "bare loop of LRP calls",
            "bare loop, relevance into a memmap",
            "explain_offline",
        ]
        assert all(float(value) > 0 for row in rows for value in row[1:])
