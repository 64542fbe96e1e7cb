"""Per-position targets (``split_dim``): one backward pass per position of the target, in one call."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tdhook.attribution import CPLRP, LRP, EpsilonPlus
from tdhook.attribution._backward_passes import DEFAULT_MEMORY_BUDGET, units_per_chunk
from tdhook.attribution.targets import EveryUnit
from tests.attribution.test_lrp_transformer_zoo import ZOO, zero_additive

F64 = torch.float64


class CausalPolicy(nn.Module):
    """Action values at each step from the observations up to it: a per-step layer, then a causal running sum."""

    def __init__(self, features: int = 3, actions: int = 2) -> None:
        super().__init__()
        self.encode, self.head = nn.Linear(features, 8), nn.Linear(8, actions)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:  # [B, T, F] -> [B, T, A]
        return self.head(torch.relu(self.encode(observation)).cumsum(1))


def per_step_policy() -> TensorDictModule:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2)).double()
    return TensorDictModule(net, in_keys=["observation"], out_keys=["action_value"])


class TestTimeBatches:
    def test_a_per_step_policy_puts_each_steps_relevance_on_its_own_step(self):
        policy = per_step_policy()
        td = TensorDict(observation=torch.randn(4, 5, 3, dtype=F64), batch_size=[4, 5])
        whole = LRP(policy, EpsilonPlus())(td.clone())["relevance", "observation"]
        split = LRP(policy, EpsilonPlus(), split_dim=1)(td.clone())["relevance", "observation"]
        assert split.shape == (4, 5, 5, 3)
        steps = torch.arange(5)
        torch.testing.assert_close(split[:, steps, steps], whole)
        off_diagonal = ~torch.eye(5, dtype=torch.bool)
        assert split[:, off_diagonal].abs().max() == 0

    @pytest.mark.parametrize("target", [None, 1, "all"])
    def test_a_causal_policy_has_no_relevance_on_later_steps_and_its_positions_add_up(self, target):
        torch.manual_seed(0)
        policy = TensorDictModule(CausalPolicy().double(), in_keys=["observation"], out_keys=["action_value"])
        td = TensorDict(observation=torch.randn(2, 6, 3, dtype=F64), batch_size=[2])
        whole = LRP(policy, EpsilonPlus(), target=target)(td.clone())["relevance", "observation"]
        split = LRP(policy, EpsilonPlus(), target=target, split_dim=1)(td.clone())["relevance", "observation"]
        units = (2,) if target == "all" else ()
        assert split.shape == (2, 6, *units, 6, 3)
        later = torch.ones(6, 6, dtype=torch.bool).triu(1)  # [t_target, t]: t after t_target
        per_pair = split if target != "all" else split.movedim(2, -1)  # [B, T_target, T, F(, units)]
        assert per_pair[:, later].abs().max() == 0
        assert per_pair[:, ~later].abs().max() > 0
        # Every rule is linear in the relevance it receives: the positions' relevances add up to the whole's
        # (target="all" puts the units right after the batch dimension in both: [B, units, T, F]).
        torch.testing.assert_close(split.sum(1), whole)

    def test_coverage_reads_the_positions_together(self):
        torch.manual_seed(0)
        net = CausalPolicy().double()
        for layer in (net.encode, net.head):
            nn.init.zeros_(layer.bias)
        lrp = LRP(net, EpsilonPlus(stabilizer=1e-12), in_keys=["observation"], out_keys=["q"], split_dim=1)
        lrp(TensorDict(observation=torch.rand(2, 6, 3, dtype=F64), batch_size=[2]))
        # Per sample, the positions' relevances together: all of the targets' relevance, without biases.
        torch.testing.assert_close(lrp.coverage().reached, torch.ones(2, dtype=F64), rtol=0, atol=1e-4)

    @pytest.mark.parametrize("split_dim", [2, -1, 5])
    def test_a_dimension_that_is_not_a_position_is_refused_by_name(self, split_dim):
        td = TensorDict(observation=torch.randn(4, 5, 3, dtype=F64), batch_size=[4, 5])
        with pytest.raises(ValueError, match=rf"split_dim={split_dim} must be a dimension of target 'action_value'"):
            LRP(per_step_policy(), EpsilonPlus(), split_dim=split_dim)(td)
        assert set(td.keys()) == {"observation"}
        with pytest.raises(TypeError, match="split_dim must be an int"):
            LRP(per_step_policy(), EpsilonPlus(), split_dim="time")(td)

    @pytest.mark.parametrize("batch, split_dim", [((2, 3, 3), 1), ((2, 3, 4), 1), ((2, 3, 3), 0), ((4, 5), 0)])
    def test_a_batch_dimension_before_the_last_is_refused_by_name(self, batch, split_dim):
        """The split dimension goes right before ``split_dim``: before the last batch dimension it would take a
        batch dimension's place, so the TensorDict's batch would index the wrong dimensions (silently where two
        sizes agree, time and agents of [B, T, agents] with T = agents) or refuse the write."""
        td = TensorDict(observation=torch.randn(*batch, 3, dtype=F64), batch_size=batch)
        with pytest.raises(ValueError, match=rf"split_dim={split_dim} is a batch dimension before the last"):
            LRP(per_step_policy(), EpsilonPlus(), split_dim=split_dim)(td)
        assert set(td.keys()) == {"observation"}
        last = LRP(per_step_policy(), EpsilonPlus(), split_dim=len(batch) - 1)(td.clone())["relevance", "observation"]
        assert last.shape == (*batch, batch[-1], 3)


class NextTokenLogits(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        return self.model(inputs_embeds=embeddings).logits  # [B, T, V]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_every_next_token_prediction_of_a_language_model_in_one_call(name: str):
    model = ZOO[name].build("eager")
    zero_additive(model)
    explained = NextTokenLogits(model)
    x = torch.randn(2, 5, 32, dtype=F64)
    lrp = LRP(explained, CPLRP(), in_keys=["x"], out_keys=["logits"], split_dim=1)
    td = lrp(TensorDict(x=x, batch_size=[2]))
    relevance = td["relevance", "x"]  # [B, t_target, t, H]
    assert relevance.shape == (2, 5, 5, 32)
    later = torch.ones(5, 5, dtype=torch.bool).triu(1)
    assert relevance[:, later].abs().max() == 0  # causal: nothing after the predicting position
    # CP-LRP conserves each position's prediction, with biases and additive embeddings zeroed.
    logits = td["logits"]
    chosen = logits.gather(-1, logits.argmax(-1, keepdim=True)).squeeze(-1)  # [B, T]
    torch.testing.assert_close(relevance.sum((-2, -1)), chosen, rtol=1e-6, atol=1e-9)

    # Position 2 alone, by a callable target that keeps only it: the same relevance.
    def position_two(out: torch.Tensor) -> torch.Tensor:
        kept = torch.zeros_like(out)
        kept[:, 2] = out[:, 2] * nn.functional.one_hot(out[:, 2].argmax(-1), out.shape[-1])
        return kept

    alone = LRP(explained, CPLRP(), in_keys=["x"], out_keys=["logits"], target=position_two)
    torch.testing.assert_close(relevance[:, 2], alone(TensorDict(x=x, batch_size=[2]))["relevance", "x"])


class _LargestTensor(TorchDispatchMode):
    """Records the bytes of the largest tensor any operation returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def seven_unit_policy() -> TensorDictModule:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 7)).double()
    return TensorDictModule(net, in_keys=["observation"], out_keys=["action_value"])


class TestUnitsInChunks:
    """target="all" builds the units' seeds in chunks that fit ``memory_budget``; the result is unchanged."""

    @pytest.mark.parametrize("chunk", [1, 3, 7])  # 3 does not divide the 7 units
    @pytest.mark.parametrize("split_dim", [None, 1])
    def test_chunks_give_the_result_of_all_units_at_once(self, chunk, split_dim, monkeypatch):
        policy = seven_unit_policy()
        td = TensorDict(observation=torch.randn(4, 5, 3, dtype=F64), batch_size=[4, 5])
        seed_bytes = 4 * 5 * 7 * 8  # one unit's seed: the output [4, 5, 7] in float64
        whole = LRP(policy, EpsilonPlus(), target="all", split_dim=split_dim)(td.clone())["relevance", "observation"]
        built = []
        seeds = EveryUnit.seeds
        monkeypatch.setattr(EveryUnit, "seeds", lambda self, a, b, out: built.append(b - a) or seeds(self, a, b, out))
        lrp = LRP(policy, EpsilonPlus(), target="all", split_dim=split_dim, memory_budget=chunk * seed_bytes + 7)
        chunked = lrp(td.clone())["relevance", "observation"]
        assert built == [chunk] * (7 // chunk) + ([7 % chunk] if 7 % chunk else [])
        assert chunked.shape == whole.shape == ((4, 5, 7, 5, 3) if split_dim else (4, 5, 7, 3))
        torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=1e-14)
        shares = lrp.coverage().reached  # [4, 5, units]
        for unit in range(7):  # and each unit's relevance and coverage are that unit's own call's
            lrp.target = unit
            one = lrp(td.clone())["relevance", "observation"]
            torch.testing.assert_close(chunked.select(2, unit), one, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(shares[..., unit], lrp.coverage().reached, rtol=1e-10, atol=1e-12)

    def test_no_tensor_of_the_call_exceeds_the_budget(self):
        # 300 units of a [4, 300] output: all seeds at once are 300 x 4 x 300 x 8 bytes = 2.9 MB (and an
        # identity matrix of every unit 0.7 MB); the result [4, 300, 3] is 29 kB, each seed 9.6 kB.
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 300)).double()
        td = TensorDict(x=torch.randn(4, 3, dtype=F64), batch_size=[4])
        budget = 64 * 1024
        lrp = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"], target="all", memory_budget=budget)
        with lrp:
            lrp(td.clone())  # the first call of a context prepares the rules
            largest = _LargestTensor()
            with largest:
                relevance = lrp(td.clone())["relevance", "x"]
        assert relevance.shape == (4, 300, 3)
        assert largest.largest <= budget, f"a tensor of {largest.largest} bytes (budget {budget})"
        one = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"], target=123)(td.clone())["relevance", "x"]
        torch.testing.assert_close(relevance[:, 123], one, rtol=1e-12, atol=1e-14)

    def test_the_default_budget_explains_every_unit_at_once_below_it(self):
        every = EveryUnit(torch.zeros(256, 18), batch_dims=1)
        assert units_per_chunk(every, DEFAULT_MEMORY_BUDGET) == 18
        assert units_per_chunk(EveryUnit(torch.zeros(64, 1000), 1), DEFAULT_MEMORY_BUDGET) == 131

    @pytest.mark.parametrize(("budget", "error"), [(0, ValueError), (-5, ValueError), (1.5, TypeError)])
    def test_a_budget_that_is_not_a_positive_int_is_refused(self, budget, error):
        with pytest.raises(error, match="memory_budget"):
            LRP(seven_unit_policy(), memory_budget=budget)


class TestKeepingTheGraph:
    @pytest.mark.parametrize(
        ("split_dim", "target", "memory_budget"),
        [(1, None, DEFAULT_MEMORY_BUDGET), (1, "all", DEFAULT_MEMORY_BUDGET), (None, "all", 1), (1, "all", 1)],
    )
    def test_the_derivative_of_relevance_explained_in_several_passes(self, split_dim, target, memory_budget):
        # each pass saves its seed in the graph it keeps: a seed buffer refilled for the next pass broke the
        # derivative (torch's error about a variable modified by an inplace operation)
        torch.manual_seed(0)
        policy = TensorDictModule(CausalPolicy().to(F64), in_keys=["observation"], out_keys=["action_value"])
        options = dict(split_dim=split_dim, target=target, memory_budget=memory_budget)

        def relevance(observation: torch.Tensor, **extra) -> torch.Tensor:
            lrp = LRP(policy, EpsilonPlus(epsilon=0.1), **options, **extra)
            return lrp(TensorDict(observation=observation, batch_size=[2]))["relevance", "observation"]

        observation = torch.randn(2, 3, 3, dtype=F64)
        kept = relevance(observation.clone().requires_grad_(True), create_graph=True)
        assert (kept - relevance(observation)).abs().max() <= 1e-12
        assert torch.autograd.gradcheck(
            lambda x: relevance(x, create_graph=True), (observation.clone().requires_grad_(True),), eps=1e-6, atol=1e-6
        )


class _SequenceHead(nn.Module):
    """Per-step values ``[*batch, steps, units]`` of per-step features (read as floats, token ids or one vector)."""

    def __init__(self, read: str) -> None:
        super().__init__()
        self.read = read
        self.embedding = nn.Embedding(10, 4)
        self.decode = nn.Linear(4, 5 * 4)
        self.head = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.read == "tokens":
            x = self.embedding(x)
        elif self.read == "vector":
            x = self.decode(x).unflatten(-1, (5, 4))
        return self.head(x).cumsum(-2)  # step t reads the steps up to t


@pytest.mark.parametrize(
    ("read", "x"),
    [
        ("floats", torch.randn(2, 5, 4, dtype=torch.float64)),
        ("tokens", torch.randint(0, 10, (2, 5))),
        ("vector", torch.randn(2, 4, dtype=torch.float64)),
    ],
)
def test_every_unit_goes_right_after_the_batch_dimensions_before_the_outputs_other_dimensions(read, x):
    """An output ``[batch, steps, units]`` explained with ``target="all"``: the units went before the output's last
    dimension counted in the input ([2, 5, 3, 4] for input [2, 5, 4]; token ids' and a vector's last), so
    ``relevance[:, k]`` held step k of every unit, where the documented layout (and every other method) puts unit k."""
    torch.manual_seed(0)
    policy = TensorDictModule(_SequenceHead(read).double(), in_keys=["x"], out_keys=["q"])
    every = LRP(policy, target="all")(TensorDict(x=x, batch_size=[2]))["relevance", "x"]
    units = [LRP(policy, target=k)(TensorDict(x=x, batch_size=[2]))["relevance", "x"] for k in range(3)]
    torch.testing.assert_close(every, torch.stack(units, 1), rtol=1e-12, atol=1e-14)
