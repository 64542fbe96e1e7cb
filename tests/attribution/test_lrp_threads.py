"""One wrapper called from several threads at once (one explainer for several environment workers)."""

from __future__ import annotations

import threading

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.rules import EpsilonAlpha2Beta1Flat, EpsilonPlusFlat

F64 = torch.float64


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return (
        nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.Conv2d(4, 4, 3),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(4 * 4 * 4, 3),
        )
        .to(F64)
        .eval()
    )


def batches(n: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        x = torch.randn(1 + i % 3, 3, 6, 6, dtype=F64, generator=generator)
        x[x < 0.3] = 0.0  # zero inputs: the relevance the first layer sets there is recorded separately
        out.append(x)
    return out


def call(lrp: LRP, x: torch.Tensor) -> torch.Tensor:
    return lrp(TensorDict(x=x, batch_size=[len(x)]))["relevance", "x"]


@pytest.mark.parametrize("preset", [EpsilonPlusFlat, EpsilonAlpha2Beta1Flat])
@pytest.mark.parametrize("inside", [True, False], ids=["inside a context", "a context per call"])
def test_concurrent_calls_give_the_sequential_results(preset, inside: bool):
    model = small_cnn()
    lrp = LRP(model, preset(), in_keys=["x"], out_keys=["y"], layers=["3"])
    inputs = batches(12)
    expected = [call(lrp, x) for x in inputs]
    results: dict[tuple[int, int], torch.Tensor] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def worker(w: int) -> None:
        try:
            start.wait()
            for repeat in range(6):
                for i in range(w, len(inputs), 4):
                    results[(i, repeat)] = call(lrp, inputs[i])
        except BaseException as err:  # noqa: BLE001 (re-raised below)
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    if inside:
        lrp.__enter__()
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        if inside:
            lrp.__exit__(None, None, None)
    assert not errors, errors[0]
    for (i, _), actual in results.items():
        torch.testing.assert_close(actual, expected[i], rtol=1e-12, atol=1e-12)
    assert len(results) == 6 * len(inputs)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
