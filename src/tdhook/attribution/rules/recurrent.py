"""LRP for LSTM and GRU layers and cells: the signal-take-all rule of Arras et al. (2017).

The gates of a recurrent cell (sigmoids in ``[0, 1]``) are held constant and
receive no relevance; the signal they gate keeps all of it. With
``stabilize(z) = z + ε·sign(z)`` (``sign(0) = 1``):

* LSTM, ``h_t = o ⊙ tanh(c_t)``: all of ``R(h_t)`` goes to ``c_t``.
  ``c_t = f ⊙ c_{t−1} + i ⊙ g`` splits ``R(c_t)`` between its two terms in
  proportion to their values over ``stabilize(c_t)``; ``f ⊙ c_{t−1}`` passes its
  share to ``c_{t−1}`` and ``i ⊙ g`` to ``g``. ``tanh`` passes it on to the
  pre-activation ``z_g = W_g x_t + U_g h_{t−1} + b``, which the ε-rule splits:
  ``R(x_t) = x_t ⊙ W_gᵀ (R(z_g) / stabilize(z_g))``, likewise ``h_{t−1}``, and the
  bias absorbs its share.
* GRU, ``h_t = (1 − z) ⊙ n + z ⊙ h_{t−1}``: split over ``stabilize(h_t)``. With
  ``n = tanh(a)``, ``a = W_n x + b_in + r ⊙ v`` and ``v = U_n h_{t−1} + b_hn``,
  ``tanh`` passes, ``a`` is split over ``stabilize(a)`` between ``W_n x + b_in``
  and ``r ⊙ v``, whose share goes to ``v`` and, by the ε-rule over
  ``stabilize(v)``, to ``h_{t−1}``.

:class:`RecurrentRule` re-computes the recurrence step by step from the
module's own weights, with the gates detached and each stabilised split
written as a scaling of the gradient, so that relevance stays input ×
gradient. The module's outputs are returned unchanged (the same tensors'
values), with their gradient sent through the re-computation.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from tdhook.attribution.rules._arguments import nonnegative
from tdhook.attribution.rules._autograd import hold, redirect, scale_gradient
from tdhook.attribution.rules._numerics import safe_divide, stabilize
from tdhook.attribution.rules.base import _LAYER_MARK, RemovableRuleHandle, Rule, rules_apply
from tdhook.attribution.tunables import EPSILON

__all__ = ["RecurrentRule", "is_recurrent", "lstm_step", "gru_step"]

_KINDS = ("LSTM", "GRU")


def _kind(module: nn.Module) -> str | None:
    """``"LSTM"`` or ``"GRU"`` for the layers and cells the rule handles (torch's and torchrl's), else ``None``."""
    if isinstance(module, nn.RNNBase):
        return module.mode if module.mode in _KINDS else None
    if isinstance(module, nn.RNNCellBase) and not isinstance(module, nn.RNNCell):
        gates = module.weight_ih.shape[0] // module.hidden_size
        return {4: "LSTM", 3: "GRU"}.get(gates)
    return None


def is_recurrent(module: nn.Module) -> bool:
    """Whether ``module`` is an LSTM or GRU layer or cell (``nn.LSTM``, ``nn.GRU``, ``nn.LSTMCell``,
    ``nn.GRUCell`` and torchrl's Python implementations of them).

    Examples:
        >>> is_recurrent(nn.LSTM(2, 3)), is_recurrent(nn.GRUCell(2, 3)), is_recurrent(nn.RNN(2, 3))
        (True, True, False)
    """
    return _kind(module) is not None


def _split(z: torch.Tensor, epsilon: float) -> torch.Tensor:
    """``z`` (a sum of terms) with its relevance split among the terms over ``stabilize(z)``: the gradient
    through it is multiplied by ``z / stabilize(z)``."""
    value = hold(z)
    return scale_gradient(z, value / stabilize(value, epsilon))


def lstm_step(
    x: torch.Tensor,
    h: torch.Tensor,
    c: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None],
    epsilon: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One LSTM step (torch's gate order ``i, f, g, o``) whose gradient is the signal-take-all rule's.

    Args:
        x: the input ``[B, input_size]``.
        h: the previous hidden state ``[B, hidden_size]``.
        c: the previous cell state ``[B, hidden_size]``.
        weights: ``(W_ih, W_hh, b_ih, b_hh)`` as ``nn.LSTMCell`` holds them (biases may be ``None``).
        epsilon: the stabilizer ε.

    Returns:
        ``(h_t, c_t)``, the values of an LSTM cell.

    Examples:
        >>> cell = nn.LSTMCell(3, 2).double()  # float64: a sum near 0 in float32 rounds beyond allclose's 1e-8
        >>> x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
        >>> h, c = torch.zeros(4, 2, dtype=torch.float64), torch.zeros(4, 2, dtype=torch.float64)
        >>> h1, c1 = lstm_step(x, h, c, (cell.weight_ih, cell.weight_hh, None, None), 1e-9)
        >>> relevance = x * torch.autograd.grad(h1.sum(), x)[0]
        >>> torch.allclose(relevance.sum(), h1.sum())  # conserved without biases and initial states
        True
    """
    w_ih, w_hh, b_ih, b_hh = weights
    pre = F.linear(x, w_ih, b_ih) + F.linear(h, w_hh, b_hh)
    z_i, z_f, z_g, z_o = pre.chunk(4, -1)
    i, f, o = hold(torch.sigmoid(z_i)), hold(torch.sigmoid(z_f)), hold(torch.sigmoid(z_o))
    g_value = torch.tanh(z_g)
    # tanh passes R(g) to z_g, and the ε-rule splits it over stabilize(z_g): one factor g / stabilize(z_g).
    g_factor = hold(g_value) / stabilize(hold(z_g), epsilon)
    g = redirect(g_value, [z_g], lambda grad: [grad * g_factor])
    c_value = f * c + i * g
    c_new = _split(c_value, epsilon)
    h_value = o * torch.tanh(hold(c_new))
    h_factor = safe_divide(h_value, hold(c_new))  # all of R(h_t) to c_t
    h_new = redirect(h_value, [c_new], lambda grad: [grad * h_factor])
    return h_new, c_new


def gru_step(
    x: torch.Tensor,
    h: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None],
    epsilon: float,
) -> torch.Tensor:
    """One GRU step (torch's gate order ``r, z, n``) whose gradient is the signal-take-all rule's.

    Args:
        x: the input ``[B, input_size]``.
        h: the previous hidden state ``[B, hidden_size]``.
        weights: ``(W_ih, W_hh, b_ih, b_hh)`` as ``nn.GRUCell`` holds them (biases may be ``None``).
        epsilon: the stabilizer ε.

    Returns:
        ``h_t``, the value of a GRU cell.

    Examples:
        >>> cell = nn.GRUCell(3, 2, bias=False).double()  # float64: a sum near 0 in float32 rounds beyond 1e-8
        >>> x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
        >>> h0 = torch.zeros(4, 2, dtype=torch.float64)
        >>> h1 = gru_step(x, h0, (cell.weight_ih, cell.weight_hh, None, None), 1e-9)
        >>> torch.allclose(h1, cell(x))
        True
        >>> torch.allclose((x * torch.autograd.grad(h1.sum(), x)[0]).sum(), h1.sum())
        True
    """
    w_ih, w_hh, b_ih, b_hh = weights
    x_r, x_z, u = F.linear(x, w_ih, b_ih).chunk(3, -1)
    h_r, h_z, v = F.linear(h, w_hh, b_hh).chunk(3, -1)
    r, z = hold(torch.sigmoid(x_r + h_r)), hold(torch.sigmoid(x_z + h_z))
    v = _split(v, epsilon)  # the ε-rule from v to h_{t−1}
    a = u + r * v
    n_value = torch.tanh(a)
    n_factor = hold(n_value) / stabilize(hold(a), epsilon)  # tanh passes; a split over stabilize(a)
    n = redirect(n_value, [a], lambda grad: [grad * n_factor])
    h_value = (1 - z) * n + z * h
    return _split(h_value, epsilon)


def _layer_weights(module: nn.RNNBase, index: int) -> tuple:
    names = module._all_weights[index]
    w_ih, w_hh = getattr(module, names[0]), getattr(module, names[1])
    if module.bias:
        return w_ih, w_hh, getattr(module, names[2]), getattr(module, names[3])
    return w_ih, w_hh, None, None


def _cell_weights(module: nn.RNNCellBase) -> tuple:
    return module.weight_ih, module.weight_hh, module.bias_ih, module.bias_hh


def _run_direction(
    kind: str,
    xs: list[torch.Tensor],
    state: tuple[torch.Tensor, ...],
    weights: tuple,
    epsilon: float,
    mask: list[torch.Tensor] | None,
    reverse: bool,
) -> tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]:
    """One layer in one direction over time-major steps ``xs``; ``mask[t]`` (``[B, 1]``) freezes the state."""
    steps = range(len(xs) - 1, -1, -1) if reverse else range(len(xs))
    outputs: list[torch.Tensor | None] = [None] * len(xs)
    for t in steps:
        if kind == "LSTM":
            new = lstm_step(xs[t], state[0], state[1], weights, epsilon)
        else:
            new = (gru_step(xs[t], state[0], weights, epsilon),)
        if mask is not None:  # a step outside the sequence keeps the state, and outputs it (as torchrl's LSTM)
            new = tuple(torch.where(mask[t], n, s) for n, s in zip(new, state, strict=True))
        outputs[t] = new[0]
        state = new
    return outputs, state  # type: ignore[return-value]


def run_layer_stack(
    module: nn.RNNBase,
    x: torch.Tensor,
    hx: tuple[torch.Tensor, ...],
    epsilon: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The rule's re-computation of a whole (multi-layer, possibly bidirectional) LSTM or GRU.

    ``x`` is time-major ``[T, B, input_size]``, ``hx`` holds ``h_0`` (and ``c_0``), each
    ``[layers · directions, B, hidden]``, and ``mask`` (``[T, B]``, boolean) marks the
    steps that update the state. Returns ``y`` (``[T, B, directions · hidden]``) and
    the final states.
    """
    kind = _kind(module)
    directions = 2 if module.bidirectional else 1
    masks = None if mask is None else [m.unsqueeze(-1) for m in mask.unbind(0)]
    layer_input = list(x.unbind(0))
    finals: list[list[torch.Tensor]] = [[] for _ in hx]
    for layer in range(module.num_layers):
        per_direction = []
        for direction in range(directions):
            index = layer * directions + direction
            state = tuple(s[index] for s in hx)
            weights = _layer_weights(module, index)
            outputs, state = _run_direction(kind, layer_input, state, weights, epsilon, masks, direction == 1)
            per_direction.append(outputs)
            for final, s in zip(finals, state, strict=True):
                final.append(s)
        if directions == 1:
            layer_input = per_direction[0]
        else:
            layer_input = [torch.cat(pair, -1) for pair in zip(*per_direction, strict=True)]
    return torch.stack(layer_input, 0), tuple(torch.stack(final, 0) for final in finals)


def _check_close(module: nn.Module, recomputed: torch.Tensor, output: torch.Tensor) -> None:
    tolerance = 1e-6 if output.dtype == torch.float64 else 1e-2
    # NaN where the output is NaN (a sample that is not finite) is a reproduction too.
    same = output.shape == recomputed.shape
    if not same or not torch.allclose(recomputed, output, rtol=tolerance, atol=tolerance, equal_nan=True):
        error = RuntimeError(
            f"RecurrentRule on {type(module).__name__}: the step-by-step re-computation from the module's weights "
            f"does not reproduce its output (shape {tuple(output.shape)}); the module computes something other than "
            "torch's LSTM/GRU recurrence: map it to another rule"
        )
        error.module = module  # the wrapper names the module's path
        raise error


def _through(output: torch.Tensor, recomputed: torch.Tensor) -> torch.Tensor:
    """``output``'s value with its gradient sent to ``recomputed``, marked as a layer's output: the layers it feeds
    are not first layers (the walks of the first-layer rule and of the glue before it stop there, as at a Linear
    layer's output)."""
    routed = redirect(output, [recomputed], lambda grad: [grad])
    if routed.grad_fn is not None:
        routed.grad_fn.metadata[_LAYER_MARK] = True
    return routed


class RecurrentRule(Rule):
    """The signal-take-all rule (Arras et al., 2017) on ``nn.LSTM``, ``nn.GRU``, ``nn.LSTMCell``, ``nn.GRUCell``.

    Gates are held constant and receive no relevance; the stabilised splits of
    the module docstring hold at every step. Multi-layer, ``batch_first``,
    bidirectional and unbatched inputs, packed sequences, and initial states
    given or not are supported, as are torchrl's Python LSTM and GRU (their
    ``mask`` argument included). Relevance on a given initial state is its
    value times its gradient, as for any input. The module's outputs are its
    own values; only their gradient changes.

    Args:
        epsilon: the stabilizer ε of every split.

    Raises:
        ValueError: at registration, for a module that is not an LSTM or GRU, or
            an LSTM with ``proj_size``; at a call, for dropout between layers in
            training mode.

    Examples:
        >>> lstm = nn.LSTM(3, 4, num_layers=2, bias=False, batch_first=True).double()
        >>> seeded = torch.Generator().manual_seed(0)
        >>> x = torch.randn(2, 5, 3, dtype=torch.float64, generator=seeded, requires_grad=True)
        >>> with RecurrentRule(epsilon=1e-9).register(lstm):
        ...     y, (h, c) = lstm(x)
        ...     relevance = x * torch.autograd.grad(y[:, -1].sum(), x)[0]
        >>> torch.equal(y, lstm(x)[0]), torch.allclose(relevance.sum(), y[:, -1].sum())
        (True, True)
    """

    uses_input = False
    tunables = {"epsilon": EPSILON}
    differentiable = True

    def __init__(self, epsilon: float = 1e-6) -> None:
        nonnegative(type(self).__name__, "epsilon", epsilon)
        super().__init__()
        self.epsilon = epsilon

    def register(self, module: nn.Module) -> RemovableRuleHandle:
        if module in self._registrations:
            raise ValueError(f"{self!r} is already registered on this {type(module).__name__}")
        if _kind(module) is None:
            raise ValueError(
                f"RecurrentRule: {type(module).__name__} is not an LSTM or GRU layer or cell; it supports nn.LSTM, "
                "nn.GRU, nn.LSTMCell, nn.GRUCell and torchrl's LSTM and GRU"
            )
        if getattr(module, "proj_size", 0):
            raise ValueError(
                f"RecurrentRule: {type(module).__name__} with proj_size={module.proj_size} (projected hidden states) "
                "is not supported"
            )
        registration = self._new_registration(module)
        with self._recorded(module, registration):
            registration.hooks.append(module.register_forward_hook(self._recurrent_hook, with_kwargs=True))
        return RemovableRuleHandle(self, module)

    def _recurrent_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if not rules_apply(module):
            return None
        x = args[0] if args else kwargs.get("input")
        hx = args[1] if len(args) > 1 else kwargs.get("hx")
        mask = args[2] if len(args) > 2 else kwargs.get("mask")
        tensors = [x.data if isinstance(x, PackedSequence) else x, *_states(hx)]
        if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
            return None
        if isinstance(module, nn.RNNCellBase):
            return self._cell(module, x, hx, output)
        if module.training and module.dropout > 0 and module.num_layers > 1:
            error = ValueError(
                f"RecurrentRule: {type(module).__name__} applies dropout={module.dropout} between layers in training "
                "mode, which is not supported; call .eval() on the model"
            )
            error.module = module  # the wrapper names the module's path
            raise error
        return self._layers(module, x, hx, mask, output)

    def _cell(self, module: nn.RNNCellBase, x: torch.Tensor, hx: Any, output: Any) -> Any:
        kind = _kind(module)
        batched = x.dim() == 2
        x = x if batched else x.unsqueeze(0)
        shape = (x.shape[0], module.hidden_size)
        states = [s if batched else s.unsqueeze(0) for s in _states(hx)]
        if not states:
            states = [x.new_zeros(shape)] * (2 if kind == "LSTM" else 1)
        if kind == "LSTM":
            recomputed = lstm_step(x, states[0], states[1], _cell_weights(module), self.epsilon)
        else:
            recomputed = (gru_step(x, states[0], _cell_weights(module), self.epsilon),)
        recomputed = tuple(r if batched else r.squeeze(0) for r in recomputed)
        outputs = output if isinstance(output, tuple) else (output,)
        for r, o in zip(recomputed, outputs, strict=True):
            _check_close(module, r, o)
        routed = tuple(_through(o, r) for o, r in zip(outputs, recomputed, strict=True))
        return routed if isinstance(output, tuple) else routed[0]

    def _layers(self, module: nn.RNNBase, x: Any, hx: Any, mask: Any, output: Any) -> Any:
        kind = _kind(module)
        y_out, h_out = output
        packed = isinstance(x, PackedSequence)
        if packed:
            x, lengths = pad_packed_sequence(x, batch_first=False)
            steps = torch.arange(x.shape[0]).unsqueeze(1)
            mask = steps < lengths.unsqueeze(0)
        else:
            batched = x.dim() == 3
            if not batched:
                x = x.unsqueeze(1)
            elif module.batch_first:
                x = x.transpose(0, 1)
            if mask is not None:
                mask = mask if batched else mask.unsqueeze(1)
                mask = mask.transpose(0, 1) if module.batch_first and batched else mask
        directions = 2 if module.bidirectional else 1
        shape = (module.num_layers * directions, x.shape[1], module.hidden_size)
        states = _states(hx)
        if not states:
            states = (x.new_zeros(shape),) * (2 if kind == "LSTM" else 1)
        elif not packed and not batched:
            states = tuple(s.unsqueeze(1) for s in states)
        mask = None if mask is None else mask.to(x.device)
        y, finals = run_layer_stack(module, x, states, self.epsilon, mask)
        if packed:
            y_data = _packed_data(y, output[0])
            finals_out = _states(h_out)
            y_routed = PackedSequence(
                _through(y_out.data, y_data), y_out.batch_sizes, y_out.sorted_indices, y_out.unsorted_indices
            )
            _check_close(module, y_data, y_out.data)
        else:
            if not batched:
                y, finals = y.squeeze(1), tuple(f.squeeze(1) for f in finals)
            elif module.batch_first:
                y = y.transpose(0, 1)
            _check_close(module, y, y_out)
            y_routed = _through(y_out, y)
            finals_out = _states(h_out)
        for f, o in zip(finals, finals_out, strict=True):
            _check_close(module, f, o)
        routed_states = tuple(_through(o, f) for o, f in zip(finals_out, finals, strict=True))
        return y_routed, (routed_states if kind == "LSTM" else routed_states[0])


def _states(hx: Any) -> tuple[torch.Tensor, ...]:
    if hx is None:
        return ()
    if isinstance(hx, torch.Tensor):
        return (hx,)
    return tuple(hx)


def _packed_data(y: torch.Tensor, like: PackedSequence) -> torch.Tensor:
    """The time-major padded ``y`` laid out as ``like.data``: per step, the sequences still running, longest first."""
    y = y if like.sorted_indices is None else y.index_select(1, like.sorted_indices.to(y.device))
    return torch.cat([y[t, :size] for t, size in enumerate(like.batch_sizes.tolist())], 0)
