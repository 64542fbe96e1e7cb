"""A callable target is the relevance put on the output, shared as the output is: not a function whose gradient is
taken (docs/targets.md)."""

from __future__ import annotations

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import Saliency

F64 = torch.float64


def token_log_probability(logits: torch.Tensor) -> torch.Tensor:
    one_hot = torch.zeros_like(logits)
    one_hot[:, 2] = 1.0
    return logits.log_softmax(-1) * one_hot


def test_a_callable_of_the_output_is_its_relevance_not_a_function_differentiated():
    """``log_softmax(y) * one_hot`` explains the logit weighted by ``log p / logit`` (what the docs say), which is not
    the gradient of ``log p``; the log-probability computed in the model is explained as an output of its own."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 5)).double()
    x = torch.randn(6, 4, dtype=F64)
    module = TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])
    found = Saliency(module, target=token_log_probability, abs=False)(TensorDict(observation=x, batch_size=[6]))
    leaf = x.clone().requires_grad_(True)
    logits = net(leaf)
    (weighted,) = torch.autograd.grad(
        logits, leaf, (token_log_probability(logits) / logits).detach(), retain_graph=True
    )
    torch.testing.assert_close(found["attribution", "observation"], weighted, rtol=1e-12, atol=1e-14)
    (log_p_gradient,) = torch.autograd.grad(logits.log_softmax(-1)[:, 2].sum(), leaf)
    assert (found["attribution", "observation"] - log_p_gradient).norm() > 0.5 * log_p_gradient.norm()
    log_p = TensorDictModule(nn.Sequential(net, nn.LogSoftmax(-1)), in_keys=["observation"], out_keys=["log_p"])
    explained = Saliency(log_p, target=2, abs=False)(TensorDict(observation=x, batch_size=[6]))
    torch.testing.assert_close(explained["attribution", "observation"], log_p_gradient, rtol=1e-12, atol=1e-14)
