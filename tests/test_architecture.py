"""The layout's rules, checked from the source: imports run one way, and files and classes stay small."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SOURCE = Path(__file__).parent.parent / "src"
PACKAGE = "tdhook"
MAX_FILE_LINES = 800
MAX_CLASS_LINES = 400


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SOURCE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files() -> dict[str, Path]:
    return {module_name(path): path for path in sorted((SOURCE / PACKAGE).rglob("*.py"))}


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules that ``name`` imports, at any level of the file (functions included).

    ``from a.b import c`` counts as importing ``a.b.c`` when that is a module, else ``a.b``.
    """
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # a relative import
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module
            found |= {f"{target}.{alias.name}" if f"{target}.{alias.name}" in known else target for alias in node.names}
    return {module for module in found if module in known}


def import_graph() -> dict[str, set[str]]:
    files = source_files()
    known = set(files)
    graph = {}
    for name, path in files.items():
        edges = imported_modules(name, path, known)
        if path.name == "__init__.py":  # a package re-exporting its own children does not count
            edges = {module for module in edges if not module.startswith(name + ".")}
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a list of modules, or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_module_imports_one_that_imports_it_back():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_sees_a_cycle_through_a_function_level_import(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from tdhook.attribution import lrp\n")
    assert imported_modules("tdhook.x", module, {"tdhook.attribution", "tdhook.attribution.lrp"}) == {
        "tdhook.attribution.lrp"
    }


@pytest.mark.parametrize("name", sorted(source_files()))
def test_source_files_and_classes_stay_small(name):
    path = source_files()[name]
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_FILE_LINES, f"{path} has {len(text.splitlines())} lines"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            length = node.end_lineno - node.lineno + 1
            assert length <= MAX_CLASS_LINES, f"class {node.name} in {path} spans {length} lines"
