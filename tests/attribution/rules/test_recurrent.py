"""RecurrentRule against an explicit loop: LRP for LSTMs and GRUs by the formulas of Arras et al. (2017).

The oracle runs the recurrence step by step in float64 with plain tensor
arithmetic (no autograd), keeping every gate, and then walks the steps
backwards, splitting each relevance by the signal-take-all formulas. The rule
must give the same relevance for the inputs and the given initial states.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence
from torchrl.modules.tensordict_module.rnn import GRU as TorchrlGRU
from torchrl.modules.tensordict_module.rnn import LSTM as TorchrlLSTM

from tdhook.attribution import LRP
from tdhook.attribution.mappers.presets import EpsilonAlpha2Beta1Flat, EpsilonPlus, EpsilonPlusFlat
from tdhook.attribution.mappers.transformer import CPLRP, AttnLRP
from tdhook.attribution.rules._glue import GlueError
from tdhook.attribution.rules.input_layer import FlatRule
from tdhook.attribution.rules.recurrent import RecurrentRule, is_recurrent
from tests.attribution.rules._helpers import F64

TOL = 1e-10


def stab(z: torch.Tensor, eps: float) -> torch.Tensor:
    return z + eps * torch.where(z >= 0, 1.0, -1.0).to(z.dtype)


def sig(z: torch.Tensor) -> torch.Tensor:
    return 1 / (1 + torch.exp(-z))


def lstm_direction(xs, h, c, w, reverse):
    """One LSTM layer in one direction: its outputs, final states and what each step saved for the way back."""
    w_ih, w_hh, b_ih, b_hh = w
    size = w_hh.shape[1]
    order = list(range(len(xs)))[::-1] if reverse else list(range(len(xs)))
    saved, ys = {}, [None] * len(xs)
    for t in order:
        pre = xs[t] @ w_ih.T + h @ w_hh.T
        if b_ih is not None:
            pre = pre + b_ih + b_hh
        i, f = sig(pre[:, :size]), sig(pre[:, size : 2 * size])
        z_g, o = pre[:, 2 * size : 3 * size], sig(pre[:, 3 * size :])
        g = torch.tanh(z_g)
        c_new = f * c + i * g
        h_new = o * torch.tanh(c_new)
        saved[t] = (xs[t], h, c, i, f, g, z_g, c_new)
        h, c, ys[t] = h_new, c_new, h_new
    return ys, (h, c), saved


def lstm_back(saved, w, r_y, r_h, r_c, eps, reverse):
    w_ih, w_hh = w[0], w[1]
    size = w_hh.shape[1]
    w_g, u_g = w_ih[2 * size : 3 * size], w_hh[2 * size : 3 * size]
    order = sorted(saved, reverse=not reverse)
    r_x = [None] * len(saved)
    for t in order:
        x, h_prev, c_prev, i, f, g, z_g, c_t = saved[t]
        r_h = r_h + r_y[t]
        r_c = r_c + r_h  # h_t = o ⊙ tanh(c_t): all of R(h_t) to c_t
        share = r_c / stab(c_t, eps)
        r_c_prev, r_g = f * c_prev * share, i * g * share
        q = r_g / stab(z_g, eps)  # tanh passes R(g) to z_g; the ε-rule splits z_g
        r_x[t] = x * (q @ w_g)
        r_h, r_c = h_prev * (q @ u_g), r_c_prev
    return r_x, (r_h, r_c)


def gru_direction(xs, h, w, reverse):
    """One GRU layer in one direction: its outputs, final state and what each step saved for the way back."""
    w_ih, w_hh, b_ih, b_hh = w
    size = w_hh.shape[1]
    order = list(range(len(xs)))[::-1] if reverse else list(range(len(xs)))
    saved, ys = {}, [None] * len(xs)
    for t in order:
        gi, gh = xs[t] @ w_ih.T, h @ w_hh.T
        if b_ih is not None:
            gi, gh = gi + b_ih, gh + b_hh
        r = sig(gi[:, :size] + gh[:, :size])
        z = sig(gi[:, size : 2 * size] + gh[:, size : 2 * size])
        u, v = gi[:, 2 * size :], gh[:, 2 * size :]
        a = u + r * v
        n = torch.tanh(a)
        h_new = (1 - z) * n + z * h
        saved[t] = (xs[t], h, r, z, v, a, n, h_new)
        h, ys[t] = h_new, h_new
    return ys, (h,), saved


def gru_back(saved, w, r_y, r_h, eps, reverse):
    w_ih, w_hh = w[0], w[1]
    size = w_hh.shape[1]
    w_n, u_n = w_ih[2 * size :], w_hh[2 * size :]
    order = sorted(saved, reverse=not reverse)
    r_x = [None] * len(saved)
    for t in order:
        x, h_prev, r, z, v, a, n, h_t = saved[t]
        r_h = r_h + r_y[t]
        share = r_h / stab(h_t, eps)
        r_n, r_direct = (1 - z) * n * share, z * h_prev * share
        q = r_n / stab(a, eps)  # tanh passes R(n) to a, split over stabilize(a)
        r_x[t] = x * (q @ w_n)
        r_v = r * v * q  # the term r ⊙ v gives its share to v
        r_h = r_direct + h_prev * ((r_v / stab(v, eps)) @ u_n)
    return r_x, (r_h,)


def weights_of(module: nn.Module, index: int) -> tuple:
    if isinstance(module, nn.RNNCellBase):
        return module.weight_ih, module.weight_hh, module.bias_ih, module.bias_hh
    names = module._all_weights[index]
    w = [getattr(module, n) for n in names[:2]]
    b = [getattr(module, n) for n in names[2:4]] if module.bias else [None, None]
    return tuple(t.detach() if t is not None else None for t in (*w, *b))


def oracle(module, x, states, seeds, eps):
    """Relevance of ``x`` [T, B, F] and of the initial states by the explicit loop.

    ``states``: the initial states [layers · directions, B, H] (zeros when not given); ``seeds``: the gradients
    seeded on y [T, B, D·H] and on the final states, so that each output's relevance is value × seed.
    """
    kind = "LSTM" if module.mode == "LSTM" else "GRU"
    directions = 2 if module.bidirectional else 1
    layer_input = list(x.unbind(0))
    runs = []
    finals = [[] for _ in states]
    for layer in range(module.num_layers):
        outs = []
        for d in range(directions):
            index = layer * directions + d
            w = weights_of(module, index)
            init = [s[index] for s in states]
            if kind == "LSTM":
                ys, final, saved = lstm_direction(layer_input, *init, w, d == 1)
            else:
                ys, final, saved = gru_direction(layer_input, *init, w, d == 1)
            runs.append((layer, d, w, saved))
            outs.append(ys)
            for f_list, f in zip(finals, final, strict=True):
                f_list.append(f)
        layer_input = outs[0] if directions == 1 else [torch.cat(p, -1) for p in zip(*outs, strict=True)]
    y = torch.stack(layer_input)
    finals = [torch.stack(f) for f in finals]
    seed_y, *seed_states = seeds
    r_y = list((y * seed_y).unbind(0))
    r_finals = [f * s for f, s in zip(finals, seed_states, strict=True)]
    r_init = [torch.zeros_like(s) for s in states]
    size = module.hidden_size
    for layer in reversed(range(module.num_layers)):
        r_below = None
        for d in range(directions):
            index = layer * directions + d
            _, _, w, saved = runs[index]
            r_y_d = [r[:, d * size : (d + 1) * size] for r in r_y]
            r_state = [rf[index] for rf in r_finals]
            if kind == "LSTM":
                r_x, r_start = lstm_back(saved, w, r_y_d, *r_state, eps, d == 1)
            else:
                r_x, r_start = gru_back(saved, w, r_y_d, *r_state, eps, d == 1)
            for ri, rs in zip(r_init, r_start, strict=True):
                ri[index] = rs
            r_below = r_x if r_below is None else [a + b for a, b in zip(r_below, r_x, strict=True)]
        r_y = r_below
    return torch.stack(r_y), r_init, y, finals


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def make(kind: str, layers: int = 1, bidirectional: bool = False, batch_first: bool = False, bias: bool = True):
    cls = nn.LSTM if kind == "LSTM" else nn.GRU
    module = cls(3, 4, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first, bias=bias).double()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.7)
    return module


def rule_relevance(module, x, hx, seeds, eps):
    """The rule's relevance of x and hx, and the module's outputs (y, finals) under the rule."""
    leaves = [x, *hx]
    with RecurrentRule(eps).register(module):
        out, state = module(x, None if not hx else (hx[0] if len(hx) == 1 else tuple(hx)))
    states = (state,) if isinstance(state, torch.Tensor) else state
    grads = torch.autograd.grad([out, *states], leaves, [seeds[0], *seeds[1:]], allow_unused=True)
    relevance = [leaf * (g if g is not None else torch.zeros_like(leaf)) for leaf, g in zip(leaves, grads, strict=True)]
    return relevance, out, states


KINDS = ["LSTM", "GRU"]


class TestAgainstTheLoop:
    @pytest.mark.parametrize("kind", KINDS)
    @pytest.mark.parametrize("layers", [1, 2, 3])
    @pytest.mark.parametrize("bidirectional", [False, True])
    @pytest.mark.parametrize("given_states", [False, True])
    def test_layer_relevance_equals_the_loop(self, kind, layers, bidirectional, given_states):
        torch.manual_seed(layers + 10 * bidirectional + 100 * given_states)
        module = make(kind, layers, bidirectional)
        directions = 2 if bidirectional else 1
        x = torch.randn(5, 2, 3, dtype=F64, requires_grad=True)
        n_states = 2 if kind == "LSTM" else 1
        init = [torch.randn(layers * directions, 2, 4, dtype=F64) for _ in range(n_states)]
        hx = [s.clone().requires_grad_(True) for s in init] if given_states else []
        seeds = [torch.randn(5, 2, 4 * directions, dtype=F64), *(torch.randn_like(init[0]) for _ in range(n_states))]
        (r_x, *r_hx), out, states = rule_relevance(module, x, hx, seeds, 0.01)
        zeros = [torch.zeros_like(s) for s in init]
        expected_x, expected_init, y_loop, finals = oracle(
            module, x.detach(), init if given_states else zeros, seeds, 0.01
        )
        assert rel_err(r_x, expected_x) < TOL
        for got, want in zip(r_hx, expected_init if given_states else [], strict=True):
            assert rel_err(got, want) < TOL
        assert torch.allclose(out, y_loop, atol=1e-12)  # the loop computes the same recurrence
        for got, want in zip(states, finals, strict=True):
            assert torch.allclose(got, want, atol=1e-12)

    @pytest.mark.parametrize("kind", KINDS)
    def test_batch_first_and_unbatched_inputs_give_the_time_major_relevance(self, kind):
        torch.manual_seed(1)
        module = make(kind, 2)
        x = torch.randn(6, 2, 3, dtype=F64)
        n_states = 2 if kind == "LSTM" else 1
        seeds = [torch.randn(6, 2, 4, dtype=F64), *(torch.randn(2, 2, 4, dtype=F64) for _ in range(n_states))]
        expected, _, _, _ = oracle(module, x, [torch.zeros(2, 2, 4, dtype=F64)] * n_states, seeds, 1e-3)
        module.batch_first = True
        xb = x.transpose(0, 1).clone().requires_grad_(True)
        seeds_b = [seeds[0].transpose(0, 1), *seeds[1:]]
        (r_b,), _, _ = rule_relevance(module, xb, [], seeds_b, 1e-3)
        assert rel_err(r_b.transpose(0, 1), expected) < TOL
        module.batch_first = False
        xu = x[:, 0].clone().requires_grad_(True)
        seeds_u = [seeds[0][:, 0], *(s[:, 0] for s in seeds[1:])]
        (r_u,), _, _ = rule_relevance(module, xu, [], seeds_u, 1e-3)
        seeds_one = [s[:, :1] for s in seeds]
        expected_u, *_ = oracle(module, x[:, :1], [torch.zeros(2, 1, 4, dtype=F64)] * n_states, seeds_one, 1e-3)
        assert rel_err(r_u, expected_u[:, 0]) < TOL

    @pytest.mark.parametrize("kind", KINDS)
    def test_a_cell_called_in_a_loop_equals_the_loop(self, kind):
        torch.manual_seed(2)
        layer = make(kind, 1)
        cell = (nn.LSTMCell if kind == "LSTM" else nn.GRUCell)(3, 4).double()
        with torch.no_grad():
            for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                getattr(cell, name).copy_(getattr(layer, f"{name}_l0"))
        x = torch.randn(4, 2, 3, dtype=F64, requires_grad=True)
        init = [torch.randn(2, 4, dtype=F64, requires_grad=True) for _ in range(1 + (kind == "LSTM"))]
        seed_y = torch.randn(4, 2, 4, dtype=F64)
        with RecurrentRule(0.05).register(cell):
            state = tuple(init) if kind == "LSTM" else init[0]
            ys = []
            for t in range(4):
                state = cell(x[t], state)
                ys.append(state[0] if kind == "LSTM" else state)
        y = torch.stack(ys)
        grads = torch.autograd.grad(y, [x, *init], seed_y)
        zeros = [torch.zeros(1, 2, 4, dtype=F64) for _ in init]
        expected_x, expected_init, y_loop, _ = oracle(
            layer, x.detach(), [s.detach().unsqueeze(0) for s in init], [seed_y, *zeros], 0.05
        )
        assert torch.allclose(y, y_loop, atol=1e-12)
        assert rel_err(x * grads[0], expected_x) < TOL
        for leaf, g, want in zip(init, grads[1:], expected_init, strict=True):
            assert rel_err(leaf * g, want[0]) < TOL

    @pytest.mark.parametrize("kind", KINDS)
    def test_unbatched_cell_and_cell_without_state(self, kind):
        torch.manual_seed(3)
        cell = (nn.LSTMCell if kind == "LSTM" else nn.GRUCell)(3, 4, bias=False).double()
        x = torch.randn(3, dtype=F64, requires_grad=True)
        with RecurrentRule(1e-9).register(cell):
            out = cell(x)
        h = out[0] if kind == "LSTM" else out
        relevance = x * torch.autograd.grad(h.sum(), x)[0]
        assert torch.equal(h, (cell(x)[0] if kind == "LSTM" else cell(x)))
        assert relevance.sum().item() == pytest.approx(h.sum().item(), rel=1e-6)


class TestConservation:
    @pytest.mark.parametrize("kind", KINDS)
    @pytest.mark.parametrize("layers", [1, 3])
    @pytest.mark.parametrize("bidirectional", [False, True])
    def test_relevance_over_all_steps_sums_to_the_target(self, kind, layers, bidirectional):
        torch.manual_seed(4)
        module = make(kind, layers, bidirectional, batch_first=True, bias=False)
        x = torch.randn(3, 7, 3, dtype=F64, requires_grad=True)
        with RecurrentRule(1e-9).register(module):
            y, _ = module(x)
            target = y[:, -1].sum(-1)
            relevance = x * torch.autograd.grad(target.sum(), x)[0]
        sums = relevance.sum((1, 2))
        assert torch.allclose(sums, target.detach(), rtol=1e-6, atol=0)

    def test_plain_gradient_does_not_conserve(self):
        # The check above can fail: the plain gradient through the gates creates or loses relevance.
        torch.manual_seed(4)
        module = make("LSTM", 1, bias=False)
        x = torch.randn(7, 3, 3, dtype=F64, requires_grad=True)
        y, _ = module(x)
        relevance = x * torch.autograd.grad(y[-1].sum(), x)[0]
        assert not torch.allclose(relevance.sum((0, 2)), y[-1].sum(-1), rtol=1e-3)


class TestModuleUnchanged:
    @pytest.mark.parametrize("kind", KINDS)
    def test_outputs_are_the_modules_own_and_the_state_dict_is_untouched(self, kind):
        torch.manual_seed(5)
        module = make(kind, 2, bidirectional=True).float()
        before = {k: v.clone() for k, v in module.state_dict().items()}
        x = torch.randn(4, 2, 3, requires_grad=True)
        plain_y, plain_state = module(x)
        with RecurrentRule().register(module):
            y, state = module(x)
        assert torch.equal(y, plain_y)
        for got, want in zip(
            (state if isinstance(state, tuple) else (state,)),
            (plain_state if isinstance(plain_state, tuple) else (plain_state,)),
            strict=True,
        ):
            assert torch.equal(got, want)
        assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())
        assert not module._forward_hooks


class TestPackedAndMasked:
    @pytest.mark.parametrize("kind", KINDS)
    def test_packed_sequences_equal_each_sequence_alone(self, kind):
        torch.manual_seed(6)
        module = make(kind, 2, batch_first=True)
        lengths = torch.tensor([5, 2, 4])
        x = torch.randn(3, 5, 3, dtype=F64, requires_grad=True)
        # Given initial states are in the caller's batch order, not the packed (longest first) one.
        hx = [torch.randn(2, 3, 4, dtype=F64, requires_grad=True) for _ in range(1 + (kind == "LSTM"))]
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        with RecurrentRule(0.01).register(module):
            out, state = module(packed, tuple(hx) if kind == "LSTM" else hx[0])
        h_n = state[0] if kind == "LSTM" else state
        grad, *grad_hx = torch.autograd.grad(h_n[-1].sum(), [x, *hx])
        for b, length in enumerate(lengths.tolist()):
            alone = x[b : b + 1, :length].detach().clone().requires_grad_(True)
            hx_alone = [h[:, b : b + 1].detach().clone().requires_grad_(True) for h in hx]
            with RecurrentRule(0.01).register(module):
                _, s = module(alone, tuple(hx_alone) if kind == "LSTM" else hx_alone[0])
            h_alone = s[0] if kind == "LSTM" else s
            assert torch.allclose(h_alone[-1, 0], h_n[-1, b], atol=1e-12)
            want, *want_hx = torch.autograd.grad(h_alone[-1].sum(), [alone, *hx_alone])
            assert rel_err(x[b, :length] * grad[b, :length], (alone * want)[0]) < TOL
            for h, g, h1, w in zip(hx, grad_hx, hx_alone, want_hx, strict=True):
                assert rel_err(h[:, b] * g[:, b], (h1 * w)[:, 0]) < TOL
            assert not grad[b, length:].any()

    @pytest.mark.parametrize("cls", [TorchrlLSTM, TorchrlGRU])
    def test_torchrl_python_recurrence_with_a_mask(self, cls):
        torch.manual_seed(7)
        module = cls(3, 4, num_layers=2, batch_first=True).double()
        reference = (nn.LSTM if cls is TorchrlLSTM else nn.GRU)(3, 4, num_layers=2, batch_first=True).double()
        reference.load_state_dict(module.state_dict())
        x = torch.randn(2, 5, 3, dtype=F64, requires_grad=True)
        n_states = 2 if cls is TorchrlLSTM else 1
        hx = tuple(torch.zeros(2, 2, 4, dtype=F64) for _ in range(n_states))
        mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
        with RecurrentRule(0.01).register(module):
            y, state = module(x, hx if n_states == 2 else hx[0], mask=mask)
        h_n = state[0] if n_states == 2 else state
        grad = torch.autograd.grad(h_n[-1, 1].sum(), x)[0]
        alone = x[1:, :3].detach().clone().requires_grad_(True)
        with RecurrentRule(0.01).register(reference):
            _, s = reference(alone)
        h_alone = s[0] if n_states == 2 else s
        want = alone * torch.autograd.grad(h_alone[-1].sum(), alone)[0]
        assert rel_err(x[1:, :3] * grad[1:, :3], want) < TOL


class TestRefusals:
    def test_not_a_recurrent_module(self):
        with pytest.raises(ValueError, match="RNN is not an LSTM or GRU"):
            RecurrentRule().register(nn.RNN(2, 3))
        assert not is_recurrent(nn.RNN(2, 3)) and is_recurrent(nn.LSTMCell(2, 3))

    def test_projected_lstm(self):
        with pytest.raises(ValueError, match="LSTM with proj_size=2"):
            RecurrentRule().register(nn.LSTM(3, 4, proj_size=2))

    def test_dropout_between_layers_in_training(self):
        module = nn.LSTM(3, 4, num_layers=2, dropout=0.5)
        with RecurrentRule().register(module), pytest.raises(ValueError, match="dropout=0.5 between layers"):
            module(torch.randn(2, 1, 3, requires_grad=True))
        module.eval()
        with RecurrentRule().register(module):
            module(torch.randn(2, 1, 3, requires_grad=True))

    def test_negative_epsilon(self):
        with pytest.raises(ValueError, match="epsilon"):
            RecurrentRule(-1.0)


class LastStepHead(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.rnn = make(kind, 2, batch_first=True)
        self.fc = nn.Linear(4, 2, bias=False).double()

    def forward(self, x):
        return self.fc(self.rnn(x)[0][:, -1])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "preset",
    {
        "EpsilonPlus": lambda: EpsilonPlus(epsilon=0.0, stabilizer=1e-3),
        "EpsilonPlus-stabilized-sums": lambda: EpsilonPlus(epsilon=0.0, stabilizer=1e-3, stabilize_additions=True),
        "AttnLRP": lambda: AttnLRP(stabilizer=1e-3),
        "CPLRP": lambda: CPLRP(stabilizer=1e-3),
    }.items(),
    ids=lambda item: item[0],
)
def test_every_preset_applies_the_rule_alone_inside_the_module(kind, preset):
    # The presets' function modes (stabilised sums, AttnLRP's products) must not touch the rule's re-computation.
    torch.manual_seed(8)
    net = LastStepHead(kind)
    x = torch.randn(3, 6, 3, dtype=F64)
    leaf = x.clone().requires_grad_(True)
    with RecurrentRule(1e-3).register(net.rnn):
        out = net(leaf)
    seed = torch.zeros_like(out).scatter_(-1, out.argmax(-1, keepdim=True), 1.0)
    expected = leaf * torch.autograd.grad(out, leaf, seed)[0]
    td = LRP(net, preset[1](), in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[3]))
    assert rel_err(td["relevance", "x"], expected) < TOL


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_non_finite_sample_leaves_the_other_samples_relevance_alone(kind, bad):
    # The check that the step-by-step re-computation reproduces the module's output compared NaN with NaN as
    # different: every batch with a NaN sample was refused, saying the module is not torch's recurrence.
    torch.manual_seed(8)
    net = LastStepHead(kind)
    x = torch.randn(3, 6, 3, dtype=F64)
    bad_x = x.clone()
    bad_x[1, 2, 0] = bad
    expected = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"])(TensorDict(x=x[[0, 2]], batch_size=[2]))
    td = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"])(TensorDict(x=bad_x, batch_size=[3]))
    assert rel_err(td["relevance", "x"][[0, 2]], expected["relevance", "x"]) < TOL


class RecurrentPolicy(nn.Module):
    """An optional encoder Linear, a recurrent layer or cell, and a head of two Linear layers on its last state."""

    def __init__(self, kind: str, cell: bool, encoder: bool):
        super().__init__()
        self.cell = cell
        self.encoder = nn.Linear(3, 3) if encoder else nn.ReLU()
        module = {"LSTM": nn.LSTMCell, "GRU": nn.GRUCell} if cell else {"LSTM": nn.LSTM, "GRU": nn.GRU}
        self.rnn = module[kind](3, 4) if cell else module[kind](3, 4, batch_first=True)
        self.fc, self.out = nn.Linear(4, 5), nn.Linear(5, 2)

    def forward(self, x):
        x = self.encoder(x).relu()
        last = self.rnn(x[:, -1]) if self.cell else self.rnn(x)[0][:, -1]
        last = last[0] if isinstance(last, tuple) else last
        return self.out(self.fc(last).relu())


@pytest.mark.parametrize("cell", [False, True], ids=["layer", "cell"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_layers_after_a_recurrent_layer_are_not_first_layers(kind: str, cell: bool):
    # The first-layer rule (Flat) goes on the layers the input reaches first: the encoder before the recurrent
    # layer, never the head after it, which reads the recurrent layer's output (Flat there gave the hidden state
    # relevance regardless of its values, 1.9 to 3 off, relative).
    torch.manual_seed(3)
    x = torch.randn(3, 6, 3, dtype=F64)

    def relevance(net, mapper):
        return LRP(net, mapper, in_keys=["x"], out_keys=["y"], target=0)(TensorDict(x=x, batch_size=[3]))

    encoded = RecurrentPolicy(kind, cell, encoder=True).double().eval()
    flat_encoder = EpsilonPlus(rule_mapper={"encoder": FlatRule()})
    expected = relevance(encoded, flat_encoder)["relevance", "x"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the encoder takes Flat: nothing to say
        assert rel_err(relevance(encoded, EpsilonPlusFlat())["relevance", "x"], expected) < TOL
    # The recurrent layer reads the model's input (through a ReLU): no layer gets Flat, and the preset says so,
    # naming the layer (the relevance was EpsilonPlus's without a word), or refuses it when strict.
    bare = RecurrentPolicy(kind, cell, encoder=False).double().eval()
    expected = relevance(bare, EpsilonPlus())["relevance", "x"]
    recurrent = type(bare.rnn).__name__
    with pytest.warns(UserWarning, match=rf"module 'rnn' \({recurrent}\) is the first layer .* \(FlatRule\)"):
        assert rel_err(relevance(bare, EpsilonPlusFlat())["relevance", "x"], expected) < TOL
    with pytest.raises(ValueError, match=r"EpsilonAlpha2Beta1Flat's first-layer rule \(FlatRule\) has no form"):
        relevance(bare, EpsilonAlpha2Beta1Flat(strict=True))
    # Flat on the head, asked for by name, is refused as on any layer after another one, naming it.
    with pytest.raises(GlueError, match="output of another Linear, convolution or recurrent layer") as refused:
        relevance(bare, EpsilonPlus(rule_mapper={"fc": FlatRule()}))
    assert "module 'fc'" in "\n".join(getattr(refused.value, "__notes__", []))


def measure() -> None:
    """Print the rule's largest relative error against the loop, and the conservation error, per configuration."""
    print("| module | layers | directions | error vs loop (float64) | error vs loop (float32 model) | conservation |")
    print("| --- | --- | --- | --- | --- | --- |")
    for kind in KINDS:
        for layers in (1, 2, 3):
            for bidirectional in (False, True):
                torch.manual_seed(0)
                module = make(kind, layers, bidirectional)
                directions = 2 if bidirectional else 1
                n_states = 2 if kind == "LSTM" else 1
                x = torch.randn(20, 8, 3, dtype=F64)
                init = [torch.randn(layers * directions, 8, 4, dtype=F64) for _ in range(n_states)]
                seeds = [torch.randn(20, 8, 4 * directions, dtype=F64), *(torch.randn_like(init[0]) for _ in init)]
                want, want_init, _, _ = oracle(module, x, init, seeds, 0.01)
                errors = []
                for dtype in (F64, torch.float32):
                    module.to(dtype)
                    leaves = [x.to(dtype).requires_grad_(True), *(s.to(dtype).requires_grad_(True) for s in init)]
                    got = rule_relevance(module, leaves[0], leaves[1:], [s.to(dtype) for s in seeds], 0.01)[0]
                    errors.append(max(rel_err(g.double(), w) for g, w in zip(got, [want, *want_init], strict=True)))
                module.double()
                with torch.no_grad():
                    for name, p in module.named_parameters():
                        if "bias" in name:
                            p.zero_()
                module.batch_first = True
                xb = x.transpose(0, 1).clone().requires_grad_(True)
                with RecurrentRule(1e-9).register(module):
                    y, _ = module(xb)
                    target = y[:, -1].sum(-1)
                    sums = (xb * torch.autograd.grad(target.sum(), xb)[0]).sum((1, 2))
                conservation = ((sums - target.detach()).abs() / target.detach().abs()).max().item()
                print(f"| {kind} | {layers} | {directions} | {errors[0]:.1e} | {errors[1]:.1e} | {conservation:.1e} |")
    for kind in KINDS:
        torch.manual_seed(0)
        layer = make(kind, 1)
        cell = (nn.LSTMCell if kind == "LSTM" else nn.GRUCell)(3, 4).double()
        cell.load_state_dict({name: getattr(layer, f"{name}_l0") for name in cell.state_dict()})
        x = torch.randn(20, 8, 3, dtype=F64, requires_grad=True)
        init = [torch.randn(8, 4, dtype=F64, requires_grad=True) for _ in range(1 + (kind == "LSTM"))]
        seed = torch.randn(20, 8, 4, dtype=F64)
        with RecurrentRule(0.01).register(cell):
            state, ys = (tuple(init) if kind == "LSTM" else init[0]), []
            for t in range(20):
                state = cell(x[t], state)
                ys.append(state[0] if kind == "LSTM" else state)
        grads = torch.autograd.grad(torch.stack(ys), [x, *init], seed)
        zeros = [torch.zeros(1, 8, 4, dtype=F64) for _ in init]
        want, want_init, _, _ = oracle(layer, x.detach(), [s.detach().unsqueeze(0) for s in init], [seed, *zeros], 0.01)
        got = [x * grads[0], *(s * g for s, g in zip(init, grads[1:], strict=True))]
        error = max(rel_err(g, w) for g, w in zip(got, [want, *(w[0] for w in want_init)], strict=True))
        print(f"| {kind}Cell, 20 calls | 1 | 1 | {error:.1e} | | |")


if __name__ == "__main__":
    measure()
