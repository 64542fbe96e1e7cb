"""Fixtures of the attribution tests."""

from __future__ import annotations

import pytest

from tdhook.attribution import _function_rule_plan


@pytest.fixture
def applied(monkeypatch) -> list[bool]:
    """Whether each call that had a plan found its recorded graph (and so ran without the mode)."""
    results: list[bool] = []
    apply = _function_rule_plan._Plan.apply

    def watched(self, *args):
        results.append(apply(self, *args))
        return results[-1]

    monkeypatch.setattr(_function_rule_plan._Plan, "apply", watched)
    return results
