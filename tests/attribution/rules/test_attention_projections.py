"""The ε of AttnLRP and CP-LRP on the projections ``nn.MultiheadAttention`` computes with its own parameters.

The oracle is the same attention written with four ``nn.Linear`` layers (query, key, value and output
projections), whose ε-rule the presets apply as to any Linear layer: the fused module must give the same relevance
for every ε, and no warning. torchrl's ``ACTModel`` (action chunking with transformers, a robot policy) decodes its
action chunk with ``nn.TransformerDecoder`` layers: the same holds for it, on observations of a Pendulum-v1 rollout.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import CPLRP, LRP, AttnLRP, EpsilonRule
from tests.conftest import relative_error

F64 = torch.float64
PRESETS = {"AttnLRP": AttnLRP, "CPLRP": CPLRP}


class WrittenAttention(nn.Module):
    """``nn.MultiheadAttention`` (batch first, no masks, no dropout) written with ``nn.Linear`` projections."""

    batch_first = True

    def __init__(self, mha: nn.MultiheadAttention) -> None:
        super().__init__()
        e, self.heads = mha.embed_dim, mha.num_heads
        packed = mha.in_proj_weight is not None
        weights = mha.in_proj_weight.split(e) if packed else (mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight)
        self.q, self.k, self.v = (
            nn.Linear(w.shape[1], e, dtype=w.dtype) for w in weights
        )  # query, key and value projections
        self.out = nn.Linear(e, e, dtype=mha.out_proj.weight.dtype)
        with torch.no_grad():
            for layer, weight, bias in zip((self.q, self.k, self.v), weights, mha.in_proj_bias.split(e), strict=True):
                layer.weight.copy_(weight)
                layer.bias.copy_(bias)
            self.out.weight.copy_(mha.out_proj.weight)
            self.out.bias.copy_(mha.out_proj.bias)

    def forward(self, query, key, value, need_weights=True, **masks) -> tuple[torch.Tensor, None]:
        assert all(mask is None or mask is False for mask in masks.values())

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(*t.shape[:2], self.heads, -1).transpose(1, 2)

        q, k, v = split(self.q(query)), split(self.k(key)), split(self.v(value))
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1)
        return self.out((weights @ v).transpose(1, 2).flatten(2)), None


class Attend(nn.Module):
    """One attention call: self-attention, or queries attending to a memory (keys of another width: ``kdim``)."""

    def __init__(self, mha: nn.Module, kind: str, need_weights: bool) -> None:
        super().__init__()
        self.mha, self.kind, self.need_weights = mha, kind, need_weights

    def forward(self, query: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        if self.kind == "self":
            return self.mha(query, query, query, need_weights=self.need_weights)[0]
        return self.mha(query, memory, memory, need_weights=self.need_weights)[0] + query


def written_out(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with each ``nn.MultiheadAttention`` written with ``nn.Linear`` projections."""
    copied = copy.deepcopy(model)
    for module in list(copied.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.MultiheadAttention):
                setattr(module, child_name, WrittenAttention(child))
    return copied


def explain(module: TensorDictModule, preset, td: TensorDict, **options) -> tuple[TensorDict, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = LRP(module, preset, **options)(td.clone())
    return out, [str(w.message) for w in caught]


def assert_as_written(model: nn.Module, oracle: nn.Module, preset, td: TensorDict, in_keys: list[str]) -> None:
    """``model`` and its attention written out (``oracle``) give the same output and relevance, with no warning."""
    results = []
    for net in (model, oracle):
        out, messages = explain(TensorDictModule(net, ["query", "memory"], ["out"]), preset, td, in_keys=in_keys)
        assert messages == []
        results.append(out)
    fused, written = results
    torch.testing.assert_close(fused["out"], written["out"], rtol=1e-12, atol=1e-12)
    for key in in_keys:
        assert relative_error(fused["relevance", key], written["relevance", key]) <= 1e-10


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("kind", ["self", "cross", "cross kdim"])
@pytest.mark.parametrize("need_weights", [False, True], ids=["fused", "weights"])
@pytest.mark.parametrize("epsilon", [0.5, 0.01])
def test_a_fused_attention_gets_the_dense_epsilon_as_written_out(preset, kind, need_weights, epsilon):
    """The fused module kept LRP-0 on its four projections whatever ε was asked for (a relative L2 error of 2.5 to
    5.0 at ε = 0.5, of 0.0014 to 0.35 at ε = 0.01, against the written-out attention) and warned that out_proj's
    rule had no effect, advising the preset in use."""
    torch.manual_seed(0)
    kdim = 6 if kind == "cross kdim" else 8
    mha = nn.MultiheadAttention(8, 2, batch_first=True, kdim=kdim, vdim=kdim, dtype=F64).eval()
    model = Attend(mha, kind, need_weights)
    td = TensorDict(query=torch.randn(3, 4, 8, dtype=F64), memory=torch.randn(3, 5, kdim, dtype=F64), batch_size=[3])
    in_keys = ["query"] if kind == "self" else ["memory"] if preset == "CPLRP" else ["query", "memory"]
    assert_as_written(model, written_out(model), PRESETS[preset](epsilon=epsilon), td, in_keys)


def test_the_epsilon_changes_a_fused_attentions_relevance_as_it_does_the_written_out_one():
    """The check above tells the two apart: ε = 0.5 moves the written-out relevance far from ε = 0's."""
    torch.manual_seed(0)
    model = Attend(nn.MultiheadAttention(8, 2, batch_first=True, dtype=F64).eval(), "cross", False)
    td = TensorDict(query=torch.randn(3, 4, 8, dtype=F64), memory=torch.randn(3, 5, 8, dtype=F64), batch_size=[3])
    module = TensorDictModule(model, ["query", "memory"], ["out"])
    plain, _ = explain(module, AttnLRP(), td)
    stabilised, _ = explain(module, AttnLRP(epsilon=0.5), td)
    assert relative_error(stabilised["relevance", "memory"], plain["relevance", "memory"]) > 0.1


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_later_calls_in_an_open_context_keep_the_epsilon(preset):
    torch.manual_seed(0)
    model = Attend(nn.MultiheadAttention(8, 2, batch_first=True, dtype=F64).eval(), "cross", False)
    in_keys = ["memory"] if preset == "CPLRP" else ["query", "memory"]  # CP-LRP holds the query's path constant
    fused, written = (
        LRP(TensorDictModule(net, ["query", "memory"], ["out"]), PRESETS[preset](epsilon=0.5), in_keys=in_keys)
        for net in (model, written_out(model))
    )
    with fused, written:
        for _ in range(3):
            td = TensorDict(
                query=torch.randn(3, 4, 8, dtype=F64), memory=torch.randn(3, 5, 8, dtype=F64), batch_size=[3]
            )
            with warnings.catch_warnings():  # CP-LRP: the written-out query of constants alone is named there
                warnings.simplefilter("ignore")
                expected = written(td.clone())["relevance", "memory"]
            assert relative_error(fused(td.clone())["relevance", "memory"], expected) <= 1e-10


def test_an_epsilon_mapped_to_linear_layers_under_a_transformer_preset_is_named_with_the_presets_epsilon():
    """The projections take the preset's ε, not a rule the user maps to nn.Linear: out_proj's rule is named, and
    the advice says where the ε goes (it advised the preset in use, AttnLRP, and nothing more)."""
    model = Attend(nn.MultiheadAttention(8, 2, batch_first=True, dtype=F64).eval(), "cross", False)
    td = TensorDict(query=torch.randn(3, 4, 8, dtype=F64), memory=torch.randn(3, 5, 8, dtype=F64), batch_size=[3])
    module = TensorDictModule(model, ["query", "memory"], ["out"])
    _, messages = explain(module, AttnLRP(rule_mapper={nn.Linear: EpsilonRule(0.5)}), td)
    assert len(messages) == 1
    assert "'module.mha.out_proj'" in messages[0] and "AttnLRP(epsilon=...)) rather than in rule_mapper" in messages[0]


class AttendThenProject(nn.Module):
    """Cross-attention whose output projection is also called as a module, on the attention's output."""

    def __init__(self, mha: nn.Module) -> None:
        super().__init__()
        self.mha = mha

    def forward(self, query: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        attended = self.mha(query, memory, memory, need_weights=False)[0]
        projection = self.mha.out if isinstance(self.mha, WrittenAttention) else self.mha.out_proj
        return projection(torch.relu(attended))


class Quantizable(nn.Module):
    """torch.ao's ``nn.MultiheadAttention`` subclass (not converted) with ``mha``'s weights, whose forward calls its
    query, key, value and output projections as ``nn.Linear`` modules; sequence first (batch first, its heads' output
    is laid out wrong), its batch-first inputs and output transposed here."""

    def __init__(self, mha: nn.MultiheadAttention) -> None:
        from torch.ao.nn.quantizable import MultiheadAttention

        super().__init__()
        self.attention = MultiheadAttention(mha.embed_dim, mha.num_heads).to(F64).eval()
        e, layers = mha.embed_dim, (self.attention.linear_Q, self.attention.linear_K, self.attention.linear_V)
        with torch.no_grad():
            for layer, weight, bias in zip(layers, mha.in_proj_weight.split(e), mha.in_proj_bias.split(e), strict=True):
                layer.weight.copy_(weight)
                layer.bias.copy_(bias)
            self.attention.out_proj.weight.copy_(mha.out_proj.weight)
            self.attention.out_proj.bias.copy_(mha.out_proj.bias)

    def forward(self, query, key, value, need_weights=True) -> tuple[torch.Tensor, None]:
        output = self.attention(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), need_weights=False)
        return output[0].transpose(0, 1), None


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("layout", ["out_proj called again", "quantizable subclass"])
def test_an_out_proj_that_runs_as_a_module_keeps_the_epsilon(preset, layout):
    """Where out_proj runs as a module (called by the user's code as well, or by torch.ao's quantizable subclass,
    whose forward calls its four projections as modules), that call gets the ε as any Linear layer. With out_proj
    mapped to the plain gradient (so that its rule was not named as without effect), that call lost the ε under a
    warning calling it no Linear layer: a relative L2 error of 1.3 to 1.5 called again, 2.6 to 2.7 in the
    quantizable subclass (0 before the projections got the ε there)."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True, dtype=F64).eval()
    if layout == "out_proj called again":
        model, oracle = AttendThenProject(mha), written_out(AttendThenProject(mha))
    else:
        model, oracle = Attend(Quantizable(mha), "cross", False), written_out(Attend(mha, "cross", False))
    td = TensorDict(query=torch.randn(3, 4, 8, dtype=F64), memory=torch.randn(3, 5, 8, dtype=F64), batch_size=[3])
    in_keys = ["memory"] if preset == "CPLRP" else ["query", "memory"]
    assert_as_written(model, oracle, PRESETS[preset](epsilon=0.5), td, in_keys)


@pytest.mark.parametrize("in_keys", [["query", "memory"], ["memory"]], ids=["both", "memory alone"])
def test_a_kept_graph_gives_the_fused_attention_the_written_out_relevance_and_derivative(in_keys):
    """With the query not explained, its projection (of a constant and parameters) got the rule's node in a kept
    graph, which made it an activation that the product with the keys shared relevance with: a relative L2 error of
    0.16 on the memory's relevance, against none without a kept graph."""
    torch.manual_seed(0)
    model = Attend(nn.MultiheadAttention(8, 2, batch_first=True, dtype=F64).eval(), "cross", False)
    query, memory = torch.randn(2, 3, 8, dtype=F64), torch.randn(2, 4, 8, dtype=F64)
    results = []
    for net in (model, written_out(model)):
        leaf = memory.clone().requires_grad_()
        td = TensorDict(query=query.clone(), memory=leaf, batch_size=[2])
        lrp = LRP(
            TensorDictModule(net, ["query", "memory"], ["out"]),
            AttnLRP(epsilon=0.5),
            in_keys=in_keys,
            create_graph=True,
        )
        relevance = lrp(td)["relevance", "memory"]
        (derivative,) = torch.autograd.grad(relevance.pow(2).sum(), leaf)
        results.append((relevance.detach(), derivative))
    (fused, fused_derivative), (written, written_derivative) = results
    assert relative_error(fused, written) <= 1e-10
    assert relative_error(fused_derivative, written_derivative) <= 1e-9


@pytest.fixture(scope="module")
def pendulum_observations() -> torch.Tensor:
    from torchrl.envs import GymEnv

    env = GymEnv("Pendulum-v1")
    env.set_seed(0)
    return env.rollout(6)["observation"].to(F64)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_an_action_chunking_transformer_gets_the_dense_epsilon_as_written_out(preset, pendulum_observations):
    """torchrl's ACTModel in inference mode: the decoder's self- and cross-attention over the observation's token
    (a relative L2 error of 31 to 35 before the projections got the ε)."""
    from torchrl.modules.models import ACTModel

    torch.manual_seed(0)
    model = ACTModel(
        obs_dim=3, action_dim=1, chunk_size=4, hidden_dim=8, nheads=2, num_encoder_layers=1, num_decoder_layers=2
    )
    model = model.to(F64).eval()
    td = TensorDict(observation=pendulum_observations, batch_size=pendulum_observations.shape[:1])
    results = []
    for net in (model, written_out(model)):
        policy = TensorDictModule(net, ["observation"], ["action_pred", "mu", "log_var"])
        out, messages = explain(policy, PRESETS[preset](epsilon=0.5), td, target_key="action_pred")
        # (The written-out first layer's queries are made of parameters alone, which LRP names in its products.)
        assert messages == [] or net is not model
        results.append(out)
    fused, written = results
    torch.testing.assert_close(fused["action_pred"], written["action_pred"], rtol=1e-12, atol=1e-12)
    assert relative_error(fused["relevance", "observation"], written["relevance", "observation"]) <= 1e-10
