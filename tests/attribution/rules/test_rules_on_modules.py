"""The rules registered on each module: a second rule on a module that holds one is refused."""

from __future__ import annotations

import pytest
from torch import nn

from tdhook.attribution.rules.basic import EpsilonRule
from tdhook.attribution.rules.modified import GammaRule


def test_a_second_rule_on_a_module_is_refused_naming_both():
    """Two rule objects registered on one module stacked with no word: each rewrote the module's output, and
    ``EpsilonRule(0.5)`` with ``GammaRule(0.5)`` gave a gradient 0.21 off the one and 0.54 off the other. The
    second is refused, naming both, and leaves no hook; once the first is removed it registers."""
    layer = nn.Linear(4, 3).double()
    first, second = EpsilonRule(0.5), GammaRule(0.5)
    with first.register(layer):
        hooks = (dict(layer._forward_hooks), dict(layer._forward_pre_hooks))
        with pytest.raises(ValueError, match=r"GammaRule\(.*\) cannot be registered on this Linear: EpsilonRule"):
            second.register(layer)
        assert (dict(layer._forward_hooks), dict(layer._forward_pre_hooks)) == hooks
        assert not second.is_registered(layer)
    with second.register(layer):
        assert second.is_registered(layer)
