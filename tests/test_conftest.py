"""The root conftest.py: a source file's doctests run alone as they run in the whole suite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_doctest_that_reads_module_state_passes_alone():
    """``pytest src/tdhook/attribution/rules/base.py::...plain_calls`` (the doctest lived there then) alone got
    ``tensor([False])``: pytest's importlib mode ran the file a second time for the doctest, whose ``plain_calls``
    set the flag of that copy, which the rules (bound to the package's copy) never read; inside the whole suite
    tests/conftest.py had imported the package first, and it passed. The doctest is in ``_plain_calls.py`` now."""
    doctest = "src/tdhook/attribution/rules/_plain_calls.py::tdhook.attribution.rules._plain_calls.plain_calls"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", doctest],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-2000:]
    assert "1 passed" in run.stdout
