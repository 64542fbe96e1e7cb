"""What a rule is: registration, the handle that removes it, and ParamModifier."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tdhook.attribution.rules.base import ParamModifier
from tdhook.attribution.rules.basic import EpsilonRule
from tdhook.attribution.rules.modified import GammaRule
from tdhook.attribution.rules.normalization import NormRule
from tests.attribution.rules._helpers import make_layer


class TestRegistration:
    def test_double_registration_is_refused(self):
        layer = nn.Linear(2, 2)
        rule = EpsilonRule()
        with rule.register(layer):
            with pytest.raises(ValueError, match="already registered"):
                rule.register(layer)
        assert not layer._forward_hooks

    def test_an_interrupted_removal_is_finished_by_the_next_one(self):
        layer = nn.LayerNorm(3)  # the rule acts in the forward: a pre-hook enters its mode, a forward hook leaves it
        rule = NormRule()
        handle = rule.register(layer)
        hooks = rule._registrations[layer].hooks
        assert len(hooks) == 2

        class Interrupted:
            """A hook handle whose first removal is interrupted before it removes anything."""

            def __init__(self, inner) -> None:
                self.inner, self.calls = inner, 0

            def remove(self) -> None:
                self.calls += 1
                if self.calls == 1:
                    raise KeyboardInterrupt
                self.inner.remove()

        hooks[0] = Interrupted(hooks[0])  # removed last
        with pytest.raises(KeyboardInterrupt):
            handle.remove()
        assert rule.is_registered(layer)  # what is left is still the rule's, to be removed
        handle.remove()
        assert not rule.is_registered(layer) and not layer._forward_hooks and not layer._forward_pre_hooks
        with rule.register(layer):  # registered again, once
            assert len(layer._forward_hooks) == 1 and len(layer._forward_pre_hooks) == 1

    def test_handle_removes_hooks_and_never_writes_parameters(self):
        layer, x = make_layer("conv2d")
        before = {k: v.clone() for k, v in layer.state_dict().items()}
        params = dict(layer.named_parameters())
        with GammaRule().register(layer):
            layer(x.requires_grad_(True)).sum().backward()
        assert not layer._forward_hooks and not layer._forward_pre_hooks
        assert all(params[k] is p for k, p in layer.named_parameters())
        assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())

    def test_param_modifier_context_restores_the_same_objects(self):
        layer = nn.Linear(3, 2)
        weight = layer.weight
        with ParamModifier(lambda n, p: p * 0, lambda n, p: n == "weight")(layer):
            assert torch.count_nonzero(layer.weight) == 0
            assert layer.bias is not None
        assert layer.weight is weight

    def test_param_modifier_restores_after_an_error(self):
        layer = nn.Linear(3, 2)
        weight = layer.weight
        with pytest.raises(RuntimeError, match="boom"):
            with ParamModifier(lambda n, p: p * 0)(layer):
                raise RuntimeError("boom")
        assert layer.weight is weight
