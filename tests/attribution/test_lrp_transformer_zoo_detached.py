"""CP-LRP on architectures of the zoos against an oracle that shares no code with the rules: the gradient × input of
the same model with its attention weights, its norms' scales and its activations' ratios ``f(x) / x`` detached.

CP-LRP holds the attention weights and the norms' scales constant and passes an activation's relevance on element
by element; every other operation of these models (linear maps, sums, the Fourier transforms of FNet, the gathers
of BigBird's block-sparse attention, the routing of Switch Transformers) keeps its plain gradient. A
``TorchFunctionMode`` detaches the same quantities in a plain forward pass, and a forward hook holds each activation
module's ratio (a GELU written by hand, as ALBERT's ``gelu_new``, computes ``tanh`` inside). Conservation alone
would not see relevance moved between tokens or features; this equality does.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn
from torch.overrides import TorchFunctionMode
from transformers import activations

from tdhook.attribution import CPLRP, LRP
from tests.attribution import test_lrp_transformer_zoo as zoo
from tests.attribution import test_lrp_transformer_zoo_time_series as time_series
from tests.conftest import relative_error

SOFTMAX = {F.softmax, torch.softmax, torch.Tensor.softmax}
RATIOS = {F.gelu, F.silu, F.elu, torch.tanh, torch.Tensor.tanh, F.tanh, torch.sigmoid}
ACTIVATION_MODULES = tuple(
    value for value in vars(activations).values() if isinstance(value, type) and issubclass(value, nn.Module)
)
ACTIVATION_MODULES += (nn.GELU, nn.SiLU, nn.Tanh, nn.ELU)


def held_ratio(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x * (y / x).detach()


class Detached(TorchFunctionMode):
    """Softmax outputs detached, a layer norm's standard deviation and an RMS norm's ``rsqrt`` detached, and the
    ratio ``f(x) / x`` of element-wise activations detached; the outputs of the functions in ``held`` (a class
    attribute a test may set) detached too."""

    held: tuple = ()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SOFTMAX or func in (torch.rsqrt, torch.Tensor.rsqrt) or func in self.held:
            return func(*args, **kwargs).detach()
        if func is F.layer_norm:
            x, shape, weight, bias, eps = (list(args) + [kwargs.get(k) for k in ("weight", "bias", "eps")])[:5]
            dims = tuple(range(-len(shape), 0))
            centred = x - x.mean(dims, keepdim=True)
            y = centred / torch.sqrt(centred.pow(2).mean(dims, keepdim=True) + (eps or 1e-5)).detach()
            return y * (1 if weight is None else weight) + (0 if bias is None else bias)
        if func in RATIOS:
            return held_ratio(args[0], func(*args, **kwargs))
        return func(*args, **kwargs)


def detached_gradient_times_input(model: nn.Module, inputs: tuple[torch.Tensor, ...], target: torch.Tensor):
    leaves = [x.clone().requires_grad_(True) for x in inputs]
    hooks = [
        module.register_forward_hook(lambda _, args, out: held_ratio(args[0], out))
        for module in model.modules()
        if isinstance(module, ACTIVATION_MODULES)
    ]
    try:
        with Detached():
            y = model(*leaves)
    finally:
        for hook in hooks:
            hook.remove()
    grads = torch.autograd.grad(y.gather(1, target[:, None]).sum(), leaves)
    return [(x * g).detach() for x, g in zip(leaves, grads, strict=True)]


@pytest.mark.parametrize(
    "name", ["bert", "albert", "xlm_roberta_xl", "mpnet", "fnet", "bigbird", "switch", "t5_encoder", "vivit"]
)
def test_cplrp_is_gradient_times_input_with_the_held_quantities_detached(name: str):
    architecture = zoo.ZOO[name]
    explained, x = zoo.Explained(architecture.build("eager"), architecture.inputs), zoo.model_input(architecture)
    td = LRP(explained, CPLRP(), in_keys=["x"], out_keys=["y"])(TensorDict(x=x.clone(), batch_size=[zoo.BATCH]))
    (expected,) = detached_gradient_times_input(explained, (x,), td["y"].argmax(-1))
    assert relative_error(td["relevance", "x"], expected) <= 1e-7
    leaf = x.clone().requires_grad_(True)
    y = explained(leaf)
    plain = leaf * torch.autograd.grad(y.gather(1, td["y"].argmax(-1, keepdim=True)).sum(), leaf)[0]
    assert relative_error(td["relevance", "x"], plain.detach()) > 0.05  # the held quantities matter


@pytest.mark.parametrize("name", ["time_series_transformer", "informer", "informer_prob"])
def test_cplrp_on_a_forecaster_is_gradient_times_input_with_the_held_quantities_detached(name: str):
    forecaster = time_series.MODELS[name]
    model, inputs = time_series.Forecast(forecaster.build()), forecaster.inputs()
    torch.manual_seed(2)  # ProbSparse attention's sampled keys, the same in both calls
    lrp = LRP(model, CPLRP(), in_keys=list(time_series.KEYS), out_keys=["y"])
    td = lrp(TensorDict({key: value.clone() for key, value in inputs.items()}, batch_size=[time_series.BATCH]))
    torch.manual_seed(2)
    expected = detached_gradient_times_input(model, tuple(inputs.values()), td["y"].argmax(-1))
    relevance = torch.cat([td["relevance", key].flatten(1) for key in time_series.KEYS], 1)
    assert relative_error(relevance, torch.cat([e.flatten(1) for e in expected], 1)) <= 1e-6
