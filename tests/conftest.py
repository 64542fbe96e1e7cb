"""Shared oracles: zennit as the reference for every rule it has."""

from __future__ import annotations

import os

import pytest
import torch
from tensordict import TensorDict

from tdhook.attribution import LRP
from tests._memory import release_freed_memory


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||``."""
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-300)).item()


def zennit_relevance(hook, layer: torch.nn.Module, x: torch.Tensor, relevance_out: torch.Tensor) -> torch.Tensor:
    """Input relevance of ``layer`` under zennit's ``hook`` for output relevance ``relevance_out``."""
    x = x.detach().clone().requires_grad_(True)
    handles = hook.register(layer)
    try:
        out = layer(x)
        (relevance,) = torch.autograd.grad(out, x, relevance_out)
    finally:
        handles.remove()
    return relevance


def tdhook_relevance(
    rule, layer: torch.nn.Module, x: torch.Tensor, relevance_out: torch.Tensor, **options
) -> torch.Tensor:
    """Input relevance of ``layer`` under tdhook's ``rule``, through the LRP wrapper (given further ``options``)."""
    lrp = LRP(
        layer,
        rule_mapper=lambda name, module: rule if module is layer else None,
        in_keys=["x"],
        out_keys=["y"],
        target=lambda y: relevance_out,
        **options,
    )
    td = lrp(TensorDict(x=x.detach().clone(), batch_size=[x.shape[0]]))
    return td["relevance", "x"]


def zennit_model_relevance(composite, model: torch.nn.Module, x: torch.Tensor, canonizers=None) -> torch.Tensor:
    """zennit's relevance for the argmax logit, starting from the logit's value."""
    from zennit.attribution import Gradient

    with torch.no_grad():
        out = model(x)
    start = torch.zeros_like(out).scatter_(1, out.argmax(1, keepdim=True), 1.0) * out
    if canonizers is not None:
        composite.canonizers = canonizers
    with Gradient(model=model, composite=composite) as attributor:
        _, relevance = attributor(x.detach().clone(), start)
    return relevance


if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    # A worker of `pytest -n N` runs on one of N cores: one thread for torch, and for the processes its tests start.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _release_freed_memory():
    """After each test, the heap pages its freed tensors left are given back: without it a worker's resident set
    grows to the sum of the largest tests it ran (see ``tests/_memory.py``)."""
    yield
    release_freed_memory()


def pytest_collection_modifyitems(config, items):
    """The model gallery (``@pytest.mark.gallery``) runs only where ``-m`` names it: ``pytest -m gallery``."""
    if "gallery" in (config.getoption("markexpr") or ""):
        return
    gallery = [item for item in items if item.get_closest_marker("gallery") is not None]
    if gallery:
        config.hook.pytest_deselected(items=gallery)
        items[:] = [item for item in items if item.get_closest_marker("gallery") is None]
