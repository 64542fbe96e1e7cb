"""A callable target computing a nonlinear function of the output (a log-probability) is warned of: what it returns is
the relevance put on the output, not a function whose gradient is taken."""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import LRP, FeatureAblation, Saliency

F64 = torch.float64


def policy() -> TensorDictModule:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 5)).double()
    return TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])


def warned(explainer_class, target) -> list[str]:
    td = TensorDict(observation=torch.randn(6, 4, dtype=F64), batch_size=[6])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explainer_class(policy(), target=target)(td)
    return [str(w.message) for w in caught if "the callable target" in str(w.message)]


def token_log_probability(logits: torch.Tensor) -> torch.Tensor:
    one_hot = torch.zeros_like(logits)
    one_hot[:, 2] = 1.0
    return logits.log_softmax(-1) * one_hot


@pytest.mark.parametrize("explainer_class", [LRP, Saliency, FeatureAblation])
def test_a_log_probability_given_as_a_callable_is_warned_of_naming_it_and_the_output(explainer_class):
    """Saliency of ``log_softmax(y)[:, k]`` given so was ``(log p / y_k) ∂y_k/∂x`` (103 times off the gradient of
    log p on a tiny GPT-2), FeatureAblation's drops of the opposite sign for some tokens, with no word."""

    def log_probability(logits: torch.Tensor) -> torch.Tensor:  # a callable of its own: each is checked once
        return token_log_probability(logits)

    (message,) = warned(explainer_class, log_probability)
    assert message.startswith("the callable target test_a_log_probability_given_as_a_callable_is_warned_of_naming_it")
    assert "computes a function of output 'logits'" in message
    assert "not differentiated" in message and "target_key" in message


def test_the_explanation_a_callable_gives_is_the_outputs_weighted_as_the_warning_says():
    """What the warning describes: the relevance returned, shared as the output is (seed = relevance / output)."""
    module = policy()
    x = torch.randn(6, 4, dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = Saliency(module, target=token_log_probability, abs=False)(TensorDict(observation=x, batch_size=[6]))
    leaf = x.clone().requires_grad_(True)
    logits = module.module(leaf)
    seed = (token_log_probability(logits) / logits).detach()
    (expected,) = torch.autograd.grad(logits, leaf, seed)
    torch.testing.assert_close(found["attribution", "observation"], expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "target",
    [
        lambda y: y * (torch.arange(5) == 3),  # a unit, as a mask
        lambda y: torch.where(y == y.max(-1, keepdim=True).values, y, 0),  # the greedy unit
        lambda y: torch.nn.functional.one_hot(y.argmax(-1), 5).to(y.dtype),  # a constant seed
        torch.ones_like,  # the same relevance on every unit
        lambda y: y * torch.tensor([0.5, 0.0, 2.0, -1.0, 1.0], dtype=y.dtype),  # units weighted
    ],
    ids=["mask", "greedy", "one-hot", "ones", "weights"],
)
def test_a_part_of_the_output_or_a_constant_relevance_is_not_warned_of(target):
    assert warned(LRP, target) == [] and warned(Saliency, target) == []


def test_each_callable_is_checked_once():
    def log_probability(logits: torch.Tensor) -> torch.Tensor:
        return token_log_probability(logits)

    assert len(warned(LRP, log_probability)) == 1
    assert warned(Saliency, log_probability) == []  # the same callable, already warned of
