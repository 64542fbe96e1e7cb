"""TorchScript modules inside an explained model: refused by name, the model left as it was."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.rules import AttnLRP, EpsilonPlus, EpsilonRule
from tests.attribution._helpers import assert_unchanged, mlp, state_snapshot

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.*` is deprecated:FutureWarning")

MAPPERS = {
    "default": lambda: None,
    "EpsilonPlus": EpsilonPlus,
    "AttnLRP": AttnLRP,
    "callable": lambda: lambda name, module: EpsilonRule(epsilon=0.0) if isinstance(module, nn.Linear) else None,
}


def with_scripted_layer(how: str) -> nn.Sequential:
    net = mlp()
    x = torch.randn(1, 16, dtype=torch.float64)
    net[2] = torch.jit.script(net[2]) if how == "script" else torch.jit.trace(net[2], x)
    return net


@pytest.mark.parametrize("mapper", sorted(MAPPERS))
@pytest.mark.parametrize("how", ["script", "trace"])
def test_a_scripted_layer_is_refused_by_name_and_the_model_left_as_it_was(how: str, mapper: str):
    # TorchScript runs neither forward hooks nor function modes inside it: no rule can act there. Mappers used to
    # fail with an AttributeError of torch's, and a callable mapper left the first call's watch hooks on the model.
    net = with_scripted_layer(how)
    before = state_snapshot(net)
    x = torch.randn(3, 5, dtype=torch.float64)
    td = TensorDict(x=x, batch_size=[3])
    lrp = LRP(net, MAPPERS[mapper](), in_keys=["x"], out_keys=["y"])
    with pytest.raises(TypeError, match=r"module '2' \(Linear compiled by torch\.jit\) is a TorchScript module"):
        lrp(td)
    assert_unchanged(net, before)
    assert list(td.keys()) == ["x"]


def test_a_scripted_model_is_refused_by_name():
    net = torch.jit.script(mlp())
    lrp = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
    with pytest.raises(TypeError, match=r"module 'the model itself' \(Sequential compiled by torch\.jit\)"):
        lrp(TensorDict(x=torch.randn(3, 5, dtype=torch.float64), batch_size=[3]))


def _exported(net: nn.Module, x: torch.Tensor, how: str) -> nn.Module:
    if how == "make_fx":
        from torch.fx.experimental.proxy_tensor import make_fx

        return make_fx(net)(x)
    program = torch.export.export(net, (x,))
    return torch.export.unflatten(program) if how == "unflatten" else program.module()


@pytest.mark.parametrize("how", ["module", "unflatten", "make_fx"])
def test_a_model_exported_to_aten_operators_is_refused_by_name_and_left_as_it_was(how: str):
    # ExportedProgram.module() computes with ATen operators (torch.ops.aten.conv2d, ...) read from get_attr nodes: its
    # layers are no longer the nn.Linear and nn.Conv2d a rule mapper maps, and no function rule matches an ATen
    # operator. Its relevance was the plain gradient's, with a warning about calls named "default" and "using_ints":
    # EpsilonPlusFlat on a small CNN was 5.3 off (relative L2) from the same model explained before export.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3)).double().eval()
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    exported = _exported(net, x, how)
    before = state_snapshot(exported)
    td = TensorDict(x=x, batch_size=[2])
    lrp = LRP(exported, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
    with pytest.raises(TypeError, match=r"module '(the model itself|0)' \(.*\) computes with ATen operators"):
        lrp(td)
    assert_unchanged(exported, before)
    assert list(td.keys()) == ["x"]


def test_a_graph_module_of_torch_fx_symbolic_trace_keeps_its_layers_and_is_explained():
    # symbolic_trace calls the model's layers as modules (call_module): the rules reach them.
    net = mlp()
    x = torch.randn(3, 5, dtype=torch.float64)
    traced = torch.fx.symbolic_trace(net)
    expected = LRP(net, EpsilonPlus(), in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[3]))
    got = LRP(traced, EpsilonPlus(), in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[3]))
    torch.testing.assert_close(got["relevance", "x"], expected["relevance", "x"], rtol=0, atol=0)


@torch.library.custom_op("tdhook_tests::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


_twice.register_autograd(lambda ctx, grad: grad * 2)


class CallsACustomOperator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(torch.ops.tdhook_tests.twice(x))


@pytest.mark.filterwarnings(
    "ignore:LRP.*computes tdhook_tests.twice:UserWarning"
)  # the custom operator keeps its gradient
def test_a_traced_graph_calling_a_custom_operator_is_explained_as_its_eager_form():
    # A custom operator of torch.library is called alike by the eager model and its graph: not refused as ATen.
    model = CallsACustomOperator()
    traced = torch.fx.symbolic_trace(model)
    x = torch.randn(3, 5, dtype=torch.float64)
    expected = LRP(model, EpsilonPlus(), in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[3]))
    got = LRP(traced, EpsilonPlus(), in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[3]))
    torch.testing.assert_close(got["relevance", "x"], expected["relevance", "x"], rtol=0, atol=0)
