"""The API reference (docs/api.rst) documents every public name, and each has a runnable example.

A name a user imports from ``tdhook.attribution``, ``tdhook.attribution.lrp_helpers.rules``, ``tdhook.metrics`` or
``tdhook.visualization`` must be found in the reference: the pages send readers there for a rule's arguments. This
reads the autodoc directives of the page instead of building it (the docs build runs in CI on its own): a module
documented with a bare ``:members:`` contributes the names in its ``__all__``, one with ``:members: a, b`` those
names, and ``autofunction``/``autoclass`` their one name.
"""

import importlib
import inspect
import re
from pathlib import Path

import pytest

import tdhook.attribution
import tdhook.attribution.lrp_helpers.rules
import tdhook.metrics
import tdhook.visualization

API_PAGE = Path(__file__).resolve().parents[1] / "docs" / "api.rst"
PUBLIC_MODULES = (tdhook.attribution, tdhook.attribution.lrp_helpers.rules, tdhook.metrics, tdhook.visualization)
DIRECTIVE = re.compile(r"^\.\. (automodule|autoclass|autofunction|autoexception):: (\S+)\n((?:   :.*\n)*)", re.M)


def documented_members(page: str) -> list[tuple[str, str]]:
    """``(module, name)`` of every object the page's autodoc directives document."""
    found = []
    for kind, target, options in DIRECTIVE.findall(page):
        if kind != "automodule":
            module_name, _, name = target.rpartition(".")
            found.append((module_name, name))
            continue
        members = re.search(r":members:(.*)", options)
        if members is None:
            continue
        module = importlib.import_module(target)
        names = [n.strip() for n in members.group(1).split(",") if n.strip()] or getattr(module, "__all__", [])
        found.extend((target, name) for name in names)
    return found


def documented_objects(page: str) -> set[int]:
    """The ids of the objects the page's autodoc directives document."""
    return {id(getattr(importlib.import_module(module), name)) for module, name in documented_members(page)}


def public_names() -> list[tuple[str, str]]:
    return [(module.__name__, name) for module in PUBLIC_MODULES for name in module.__all__]


def test_the_reader_finds_a_documented_name_and_misses_a_name_left_out():
    page = ".. automodule:: tdhook.attribution.rules.basic\n   :members: EpsilonRule\n"
    found = documented_objects(page)
    assert id(tdhook.attribution.EpsilonRule) in found
    assert id(tdhook.attribution.PassRule) not in found


@pytest.mark.parametrize(("module", "name"), public_names())
def test_every_public_name_is_in_the_api_reference(module, name):
    obj = getattr(importlib.import_module(module), name)
    assert id(obj) in documented_objects(API_PAGE.read_text()), (
        f"{module}.{name} (defined in {obj.__module__}) is not in docs/api.rst"
    )


@pytest.mark.parametrize(("module", "name"), public_names())
def test_every_public_name_has_a_runnable_example(module, name):
    obj = getattr(importlib.import_module(module), name)
    assert ">>>" in (inspect.getdoc(obj) or ""), f"{module}.{name} has no >>> example in its docstring"


@pytest.mark.parametrize(("module", "name"), documented_members(API_PAGE.read_text()))
def test_every_class_and_function_of_the_api_reference_has_a_runnable_example(module, name):
    obj = getattr(importlib.import_module(module), name)
    if inspect.isclass(obj) or inspect.isfunction(obj):
        assert ">>>" in (inspect.getdoc(obj) or ""), f"{module}.{name} has no >>> example in its docstring"
