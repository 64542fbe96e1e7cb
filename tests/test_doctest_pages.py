"""Every documentation page with ``>>>`` examples runs in the test suite.

A page runs only when pytest both collects it (``testpaths``, which a plain ``pytest`` uses) and reads it for
doctests (a ``--doctest-glob`` in ``addopts``); a page with only one of the two is silently skipped.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def pytest_options() -> tuple[set[str], set[str]]:
    """The paths of ``testpaths`` and the patterns of ``--doctest-glob`` in pyproject.toml."""
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    globs = {arg.split("=", 1)[1] for arg in shlex.split(options["addopts"]) if arg.startswith("--doctest-glob=")}
    return set(options["testpaths"]), globs


def pages_with_examples() -> list[str]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [p.relative_to(ROOT).as_posix() for p in pages if re.search(r"^>>> ", p.read_text(), re.M)]


def test_every_page_with_examples_is_collected_and_read_for_doctests():
    testpaths, globs = pytest_options()
    pages = pages_with_examples()
    assert "docs/quickstart.md" in pages and "docs/design.md" not in pages  # a page of prose only needs neither
    assert [page for page in pages if page not in testpaths] == []
    assert [page for page in pages if Path(page).name not in globs] == []
