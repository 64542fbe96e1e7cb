"""Agents held in a lazily stacked TensorDict, under the gradient and perturbation methods.

Agents whose observations or action values differ in shape read as no one tensor: the methods raised tensordict's
"Failed to stack" error, which names no key. They now refuse the input or the target by name, with its entries'
shapes, as LRP does, and leave the caller's TensorDict and the model as they were. Agents of one shape are explained
as a dense stack: InputXGradient is each agent's own gradient × input.
"""

from __future__ import annotations

import re

import pytest
import torch
from tensordict import LazyStackedTensorDict, TensorDict

from tdhook.attribution import InputXGradient
from tests.attribution._helpers import assert_unchanged, state_snapshot
from tests.attribution.methods.test_base import METHODS
from tests.attribution.test_lrp_torchrl_workflows import HeterogeneousAgents as Agents

F64 = torch.float64


def agents(sizes: list[int]) -> TensorDict:
    torch.manual_seed(1)
    parts = [TensorDict(observation=torch.randn(4, size, dtype=F64), batch_size=[4]) for size in sizes]
    return TensorDict(agents=LazyStackedTensorDict.lazy_stack(parts, dim=1), batch_size=[4])


REFUSED = [([3, 5], [2, 2], "input ('agents', 'observation')"), ([3, 3], [2, 4], "output ('agents', 'action_value')")]


@pytest.mark.parametrize("sizes, actions, key", REFUSED, ids=["observations", "action values"])
@pytest.mark.parametrize("name", sorted(set(METHODS) - {"GradientShap"}))
def test_agents_of_different_shapes_are_refused_naming_the_key(name: str, sizes, actions, key):
    cls, kwargs = METHODS[name]
    module, td = Agents(sizes, actions), agents(sizes)
    before, snapshot = set(td.keys(True, True)), state_snapshot(module)
    pattern = rf"{name}: the {re.escape(key)}: entries of shapes \[\(4, \d\), \(4, \d\)\]"
    with pytest.raises(ValueError, match=pattern):
        cls(module, **kwargs)(td)
    assert set(td.keys(True, True)) == before
    assert_unchanged(module, snapshot)


def test_agents_of_one_shape_get_each_their_gradient_times_input():
    module, td = Agents([3, 3], [2, 2]), agents([3, 3])
    attribution = InputXGradient(module)(td.clone())["attribution", "agents", "observation"]
    assert attribution.shape == (4, 2, 3)
    for index, (net, agent) in enumerate(zip(module.nets, td["agents"].tensordicts, strict=True)):
        x = agent["observation"].clone().requires_grad_()
        values = net(x)
        (grad,) = torch.autograd.grad(values.gather(-1, values.argmax(-1, keepdim=True)).sum(), x)
        torch.testing.assert_close(attribution[:, index], x.detach() * grad, rtol=1e-12, atol=1e-14)
