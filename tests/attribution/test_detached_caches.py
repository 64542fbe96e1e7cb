"""The caches' watch of an open context: hooks registered once, noting only the wrapper's calls in their thread."""

from __future__ import annotations

import threading

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP


class Cache:
    """Stands for a ``transformers`` cache (told by its class's module and name)."""

    __module__ = "transformers.cache_utils"

    def __init__(self) -> None:
        self.keys = torch.zeros(2, 0, dtype=torch.float64)


class Step(nn.Module):
    """Appends its input's projection to the cache it is handed, and reads the cache back."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3, dtype=torch.float64)

    def forward(self, x: torch.Tensor, past_key_values: Cache | None = None) -> torch.Tensor:
        h = self.linear(x)
        if past_key_values is not None:
            past_key_values.keys = torch.cat([past_key_values.keys, h], 1)
            return h + past_key_values.keys.sum(1, keepdim=True)
        return h


def wrapper(step: Step, cache: Cache) -> LRP:
    class Called(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.step = step

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.step(x, past_key_values=cache)

    return LRP(Called(), in_keys=["x"], out_keys=["y"])


def test_a_call_in_an_open_context_registers_no_module_hook(monkeypatch: pytest.MonkeyPatch):
    step, cache = Step(), Cache()
    lrp = wrapper(step, cache)
    x = torch.randn(2, 3, dtype=torch.float64)
    registered = []
    for name in ("register_forward_pre_hook", "register_forward_hook"):
        original = getattr(nn.Module, name)
        monkeypatch.setattr(
            nn.Module, name, lambda self, *a, _o=original, **k: registered.append(self) or _o(self, *a, **k)
        )
    with lrp:
        lrp(TensorDict(x=x, batch_size=[2]))  # the first call of a context watches the model with hooks
        before = cache.keys.clone()
        registered.clear()
        relevance = lrp(TensorDict(x=x, batch_size=[2]))["relevance", "x"]
        assert registered == []
    assert not cache.keys.requires_grad and cache.keys.shape == (2, 6)
    # LRP-0 of a linear step: gradient × input (the cache, held outside the call, is a constant of it)
    e = x.clone().requires_grad_(True)
    plain = Cache()
    plain.keys = before
    out = step(e, past_key_values=plain)
    (grad,) = torch.autograd.grad(out.gather(1, out.argmax(1, keepdim=True)).sum(), e)
    torch.testing.assert_close(relevance, e.detach() * grad)


def test_a_plain_call_of_the_model_in_an_open_context_keeps_its_cache_graph():
    step, cache = Step(), Cache()
    lrp = wrapper(step, cache)
    x = torch.randn(2, 3, dtype=torch.float64)
    with lrp:
        lrp(TensorDict(x=x, batch_size=[2]))
        mine = Cache()
        step(x, past_key_values=mine)  # the caller's own call: its cache keeps its graph, as without the wrapper
        assert mine.keys.requires_grad
        lrp(TensorDict(x=x, batch_size=[2]))
        assert mine.keys.requires_grad and not cache.keys.requires_grad


def test_another_threads_call_of_the_model_during_a_call_keeps_its_cache_graph():
    class Pausing(Step):
        def forward(self, x: torch.Tensor, past_key_values: Cache | None = None) -> torch.Tensor:
            if past_key_values is cache:  # the wrapper's call: the other thread runs the model meanwhile
                worker = threading.Thread(target=lambda: self.forward_plain(x, theirs))
                worker.start()
                worker.join()
            return super().forward(x, past_key_values)

        def forward_plain(self, x: torch.Tensor, their_cache: Cache) -> None:
            with torch.enable_grad():
                self(x, past_key_values=their_cache)

    step, cache, theirs = Pausing(), Cache(), Cache()
    lrp = wrapper(step, cache)
    with lrp:
        lrp(TensorDict(x=torch.randn(2, 3, dtype=torch.float64), batch_size=[2]))
    assert theirs.keys.requires_grad and not cache.keys.requires_grad
