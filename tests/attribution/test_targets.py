"""What LRP explains: the target picks the output units and sets the initial relevance; bad targets are refused."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tdhook.attribution.mappers.presets import EpsilonPlus
from tests.attribution._helpers import ExpectsARefusal, explain, mlp


class TestInitialRelevance:
    @pytest.mark.parametrize(
        "target,index",
        [(1, torch.tensor([1, 1, 1])), (torch.tensor([0, 2, 1]), torch.tensor([0, 2, 1]))],
    )
    def test_int_and_tensor_targets_pick_the_unit(self, target, index):
        net = mlp(bias=False)
        td = explain(net, torch.randn(3, 5, dtype=torch.float64), rule_mapper=EpsilonPlus(epsilon=1e-12), target=target)
        expected = td["y"].gather(-1, index.unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(td["relevance", "x"].sum(-1), expected, rtol=1e-9, atol=1e-12)

    def test_callable_target_sets_initial_relevance(self):
        net = mlp(bias=False)
        td = explain(
            net, torch.randn(3, 5, dtype=torch.float64), rule_mapper=EpsilonPlus(epsilon=1e-12), target=lambda y: y
        )
        torch.testing.assert_close(td["relevance", "x"].sum(-1), td["y"].sum(-1), rtol=1e-9, atol=1e-12)

    def test_target_all_equals_stacked_single_targets(self):
        net = mlp()
        x = torch.randn(3, 5, dtype=torch.float64)
        every = explain(net, x, rule_mapper=EpsilonPlus(), target="all")["relevance", "x"]
        singles = torch.stack(
            [explain(net, x, rule_mapper=EpsilonPlus(), target=k)["relevance", "x"] for k in range(3)], 1
        )
        assert every.shape == (3, 3, 5)
        torch.testing.assert_close(every, singles)


class TestBadTarget(ExpectsARefusal):
    def test_target_out_of_range(self):
        td = TensorDict(x=torch.randn(2, 5, dtype=torch.float64), batch_size=[2])
        self.run_and_expect(td, IndexError, "target 7 is out of range for output 'y' with 3 units", target=7)

    def test_target_indices_out_of_range(self):
        td = TensorDict(x=torch.randn(2, 5, dtype=torch.float64), batch_size=[2])
        self.run_and_expect(td, IndexError, r"\[0, 3\) for output 'y'", target=torch.tensor([0, 3]))


class TestDefaultTargetKey:
    def test_states_for_the_next_step_come_after_the_action_output(self):
        from tensordict.nn import TensorDictModule, TensorDictSequential

        from tdhook.attribution.targets import resolve_target_key

        # A recurrent core writes its next state under "next" before the head writes the action values.
        core = TensorDictModule(
            lambda x: (x * 2, x + 1), in_keys=["observation"], out_keys=["embed", ("next", "recurrent_state")]
        )
        head = TensorDictModule(lambda e: e.sum(-1, keepdim=True), in_keys=["embed"], out_keys=["action_value"])
        policy = TensorDictSequential(core, head)
        result = policy(TensorDict(observation=torch.ones(2, 3), batch_size=[2]))
        assert resolve_target_key(result, None, policy) == "action_value"
        # With nothing else unread, the next state is still a candidate.
        assert resolve_target_key(core(TensorDict(observation=torch.ones(2, 3), batch_size=[2])), None, core) == "embed"
        alone = TensorDictModule(lambda x: x + 1, in_keys=["observation"], out_keys=[("next", "recurrent_state")])
        result = alone(TensorDict(observation=torch.ones(2, 3), batch_size=[2]))
        assert resolve_target_key(result, None, alone) == ("next", "recurrent_state")
