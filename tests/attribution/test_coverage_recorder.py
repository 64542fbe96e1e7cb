"""The first call's watch of nonlinear calls: what a module the caller mapped to IgnoreRule computes is not reported.

A recurrent layer mapped to ``IgnoreRule`` by the caller keeps its plain gradient, as asked; the watch still warned
that it "computes lstm ... no rule covers it ... map it (e.g. IgnoreRule)", because the watch saw ``torch.lstm``
inside it (IgnoreRule registers nothing on it, so it was not counted as ruled, and presets without function modes
have no pause that hides it). The relevance was right; the warning named the mapping already made as the way out.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import CPLRP, LRP, AttnLRP, BaseRuleMapper, EpsilonPlus, IgnoreRule

F64 = torch.float64


class Recurrent(nn.Module):
    """``head(relu(rnn(x)[:, -1]))``; ``rnn`` an LSTM, GRU or RNN, or a module that computes ``sin``."""

    def __init__(self, cell: type[nn.Module]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn = cell(3, 4, batch_first=True) if issubclass(cell, nn.RNNBase) else cell()
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(4, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][:, -1])


class Sine(nn.Module):
    """A module of the caller's that computes ``sin`` of ``x @ W`` (no rule covers it), returning ``(out, None)``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.sin(x @ self.weight), None


MAPPERS = {
    "BaseRuleMapper by type": lambda cell: BaseRuleMapper(stabilizer=0, rule_mapper={cell: IgnoreRule()}),
    "BaseRuleMapper by name": lambda cell: BaseRuleMapper(stabilizer=0, rule_mapper={"rnn": IgnoreRule()}),
    "EpsilonPlus": lambda cell: EpsilonPlus(epsilon=0, rule_mapper={cell: IgnoreRule()}),
    "AttnLRP": lambda cell: AttnLRP(rule_mapper={cell: IgnoreRule()}),
}


def _gradient_x_input(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_()
    y = model(x)
    (grad,) = torch.autograd.grad(y.gather(-1, y.argmax(-1, keepdim=True)).sum(), x)
    return x.detach() * grad


@pytest.mark.parametrize("mapper", sorted(MAPPERS))
@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU, nn.RNN, Sine], ids=lambda cell: cell.__name__)
def test_a_module_mapped_to_ignore_rule_is_quiet_and_gets_its_plain_gradient(cell, mapper: str):
    model = Recurrent(cell).double()
    x = torch.randn(5, 6, 3, dtype=F64)
    lrp = LRP(model, MAPPERS[mapper](cell), in_keys=["x"], out_keys=["y"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        relevance = lrp(TensorDict(x=x, batch_size=[5]))["relevance", "x"]
    if mapper != "AttnLRP":  # LRP-0 on a ReLU head behind the plain recurrence: gradient × input
        torch.testing.assert_close(relevance, _gradient_x_input(model, x), rtol=1e-10, atol=1e-12)


def test_a_strict_mapper_accepts_a_module_mapped_to_ignore_rule():
    model = Recurrent(Sine).double()
    mapper = BaseRuleMapper(stabilizer=0, rule_mapper={Sine: IgnoreRule()}, strict=True)
    x = torch.randn(5, 6, 3, dtype=F64)
    relevance = LRP(model, mapper, in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[5]))["relevance", "x"]
    torch.testing.assert_close(relevance, _gradient_x_input(model, x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("cell, call", [(nn.RNN, "rnn_tanh"), (Sine, "sin")], ids=["RNN", "Sine"])
def test_a_module_the_caller_did_not_map_still_warns(cell, call: str):
    model = Recurrent(cell).double()
    lrp = LRP(model, BaseRuleMapper(stabilizer=0), in_keys=["x"], out_keys=["y"])
    with pytest.warns(UserWarning, match=rf"module 'rnn' \({cell.__name__}\) computes {call}"):
        lrp(TensorDict(x=torch.randn(5, 6, 3, dtype=F64), batch_size=[5]))


@pytest.mark.parametrize("batch", [(5,), (2, 3)])
def test_the_share_of_an_output_of_the_batchs_shape_alone_is_per_sample(batch: tuple[int, ...]):
    """A value written with no unit dimension (``[B]``: a squeezed state value, a log-probability) raised an
    IndexError in ``coverage()``: its per-sample total flattened a dimension it does not have. With no bias and the
    ε-rule with ε = 0, the whole value reaches the input: a share of 1 per sample."""
    from tensordict.nn import TensorDictModule

    from tdhook.attribution import EpsilonRule

    class Value(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 1, bias=False, dtype=F64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x).squeeze(-1)

    mapper = BaseRuleMapper(stabilizer=1e-12, rule_mapper={nn.Linear: EpsilonRule(0.0)})
    lrp = LRP(TensorDictModule(Value(), ["x"], ["value"]), mapper)
    out = lrp(TensorDict(x=torch.randn(*batch, 3, dtype=F64), batch_size=batch))
    assert out["value"].shape == batch
    share = lrp.coverage().reached
    assert share.shape == batch
    torch.testing.assert_close(share, torch.ones(batch, dtype=F64), rtol=1e-10, atol=1e-12)


class SineBlock(nn.Module):
    """``head(sin(x @ W))`` with ``sin`` in the container's own forward: no rule of any preset covers it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.sin(x @ self.weight))


@pytest.mark.parametrize(
    ("mapper", "advised"), [(EpsilonPlus, True), (BaseRuleMapper, True), (AttnLRP, False), (CPLRP, False)]
)
def test_an_uncovered_call_advises_the_function_rule_presets_only_where_they_are_not_in_use(mapper, advised: bool):
    # Under AttnLRP or CPLRP the advice "use a preset whose function rules cover it (AttnLRP, CPLRP)" named the
    # preset already in use (seen on FunnelForPreTraining's inline tanh-GELU, whose pow no rule covers).
    torch.manual_seed(0)
    lrp = LRP(SineBlock().double(), mapper(), in_keys=["x"], out_keys=["y"])
    with pytest.warns(UserWarning, match="computes sin in its own forward") as caught:
        lrp(TensorDict(x=torch.randn(5, 3, dtype=F64), batch_size=[5]))
    messages = [str(w.message) for w in caught if "computes sin" in str(w.message)]
    assert len(messages) == 1
    assert ("(AttnLRP, CPLRP)" in messages[0]) is advised
    assert "lrp.coverage() lists every such call" in messages[0]
