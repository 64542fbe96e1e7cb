"""Calls with keyword tensors: a keyword that names no input key is refused with the names the call takes.

Before, ``lrp(obs=x)`` for a wrapper reading ``"observation"`` failed with Python's "LRP.forward() got an unexpected
keyword argument 'obs'", which named neither the keys nor how a nested key is spelt as a keyword; ``lrp(td,
target=1)``, captum's habit, failed alike.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import LRP, EpsilonPlus, IntegratedGradients, Saliency


def policy(key: str | tuple[str, ...] = "observation") -> TensorDictModule:
    torch.manual_seed(0)
    return TensorDictModule(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)), [key], ["action_value"])


WRAPPERS = {
    "LRP": lambda module: LRP(module, EpsilonPlus()),
    "Saliency": Saliency,
    "IntegratedGradients": lambda module: IntegratedGradients(module, n_steps=2),
}


@pytest.mark.parametrize("name", WRAPPERS)
class TestKeywordCalls:
    def test_a_keyword_naming_no_input_key_is_refused_with_the_keys(self, name):
        wrapper = WRAPPERS[name](policy())
        with pytest.raises(TypeError, match=rf"^{name}: keyword 'obs' names no input key; .*: observation \("):
            wrapper(obs=torch.randn(5, 3))

    def test_several_unknown_keywords_are_all_named(self, name):
        wrapper = WRAPPERS[name](policy())
        with pytest.raises(TypeError, match=rf"^{name}: keywords 'obs', 'mask' name no input key"):
            wrapper(observation=torch.randn(5, 3), obs=torch.randn(5, 3), mask=torch.ones(5, dtype=torch.bool))

    def test_a_nested_key_is_named_as_its_keyword(self, name):
        wrapper = WRAPPERS[name](policy(("agents", "observation")))
        with pytest.raises(TypeError, match=r"names: agents_observation \(a nested key's parts joined by '_'\)"):
            wrapper(observation=torch.randn(5, 3))
        value, attribution = wrapper(agents_observation=torch.randn(5, 3))
        assert value.shape == (5, 2) and attribution.shape == (5, 3)

    @pytest.mark.parametrize("with_tensordict", [True, False], ids=["tensordict", "keywords"])
    def test_an_argument_of_the_constructor_given_to_the_call_is_named_as_one(self, name, with_tensordict):
        wrapper, x = WRAPPERS[name](policy()), torch.randn(5, 3)
        inputs = ((TensorDict(observation=x, batch_size=[5]),), {}) if with_tensordict else ((), {"observation": x})
        with pytest.raises(
            TypeError,
            match=rf"^{name}: 'target' is an argument of {name}\(\.\.\.\), not of its call: .*target=\.\.\.\)",
        ):
            wrapper(*inputs[0], **inputs[1], target=1)

    def test_a_call_with_the_right_keywords_equals_a_call_with_a_tensordict(self, name):
        wrapper, x = WRAPPERS[name](policy()), torch.randn(5, 3)
        value, attribution = wrapper(observation=x)
        td = wrapper(TensorDict(observation=x, batch_size=[5]))
        assert torch.equal(value, td["action_value"])
        assert torch.equal(attribution, td[wrapper.relevance_key, "observation"])
