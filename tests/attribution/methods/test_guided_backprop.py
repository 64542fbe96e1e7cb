"""Guided backpropagation against captum's GuidedBackprop in float64; the model comes out without hooks."""

from __future__ import annotations

import copy

import captum.attr
import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn
from torchrl.modules import MultiAgentMLP

from tdhook.attribution import GuidedBackprop, Saliency
from tests.attribution._helpers import assert_unchanged, state_snapshot
from tests.attribution.methods._models import assert_random_mlp_matches, assert_two_key_policy_matches, small_cnn
from tests.conftest import relative_error

pytestmark = pytest.mark.filterwarnings("ignore:.*(require gradients|backward hooks on ReLU).*:UserWarning")


class TestAgainstCaptum:
    @pytest.mark.parametrize("target", [None, 1])
    def test_small_cnn(self, target):
        net = small_cnn()
        x = torch.randn(6, 3, 8, 8, dtype=torch.float64)
        snapshot = state_snapshot(net)
        td = GuidedBackprop(net, in_keys=["image"], out_keys=["logits"], target=target)(
            TensorDict(image=x, batch_size=[6])
        )
        assert_unchanged(net, snapshot)
        expected = captum.attr.GuidedBackprop(net).attribute(
            x.clone(), target=net(x).argmax(-1) if target is None else target
        )
        assert relative_error(td["attribution", "image"], expected) <= 1e-8
        plain = Saliency(net, in_keys=["image"], out_keys=["logits"], target=target, abs=False)(
            TensorDict(image=x, batch_size=[6])
        )
        assert relative_error(td["attribution", "image"], plain["attribution", "image"]) > 1e-3

    def test_in_place_relu(self):
        torch.manual_seed(1)
        net = nn.Sequential(
            nn.Linear(5, 8), nn.ReLU(inplace=True), nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 3)
        ).double()
        x = torch.randn(7, 5, dtype=torch.float64)
        td = GuidedBackprop(net, in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[7]))
        expected = captum.attr.GuidedBackprop(net).attribute(x.clone(), target=net(x).argmax(-1))
        assert relative_error(td["attribution", "x"], expected) <= 1e-8

    @pytest.mark.parametrize("call", ["F.relu", "torch.relu", "Tensor.relu", "Tensor.relu_", "F.relu inplace"])
    def test_relus_called_as_functions(self, call):
        """A ReLU called as a function kept its plain gradient: the attribution was off by a relative L2 error of 4.2
        from that of the same model with nn.ReLU modules. Every ReLU call is guided now, in place or not."""
        relu = {
            "F.relu": F.relu,
            "torch.relu": torch.relu,
            "Tensor.relu": torch.Tensor.relu,
            "Tensor.relu_": torch.Tensor.relu_,
            "F.relu inplace": lambda h: F.relu(h, inplace=True),
        }[call]

        class Functional(nn.Module):
            def __init__(self, layers: nn.Sequential) -> None:
                super().__init__()
                self.layers = layers

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                first, _, second, _, last = self.layers
                h = first(x)
                out = relu(h)
                h = h if call in ("Tensor.relu_", "F.relu inplace") else out  # in place: read as the input tensor
                return last(relu(second(h)))

        torch.manual_seed(2)
        modules = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).double()
        x = torch.randn(7, 5, dtype=torch.float64)
        net = Functional(modules)
        td = GuidedBackprop(net, in_keys=["x"], out_keys=["y"], target=1)(TensorDict(x=x, batch_size=[7]))
        torch.testing.assert_close(td["y"], modules(x), rtol=0, atol=0)
        expected = captum.attr.GuidedBackprop(modules).attribute(x.clone(), target=1)
        assert relative_error(td["attribution", "x"], expected) <= 1e-8
        assert relative_error(torch.func.grad(lambda v: modules(v)[:, 1].sum())(x), expected) > 0.1

    def test_an_in_place_operation_on_a_relus_output(self):
        """A model adding to a ReLU's output in place (after ``ReLU(inplace=True)`` too) raised torch's error about a
        view made in a custom Function modified in place. The model runs forward; captum raises on it, as the plain
        gradient does (the ReLU's saved output changed): the oracle is the model with the additions out of place."""

        class AddOne(nn.Module):
            def __init__(self, in_place: bool) -> None:
                super().__init__()
                self.in_place = in_place

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return x.add_(1.0) if self.in_place else x + 1.0

        def model(in_place: bool) -> nn.Module:
            torch.manual_seed(1)
            return nn.Sequential(
                nn.Linear(5, 8),
                nn.ReLU(),
                AddOne(in_place),
                nn.Linear(8, 8),
                nn.ReLU(inplace=in_place),
                AddOne(in_place),
                nn.Linear(8, 3),
            ).double()

        net, twin = model(True), model(False)
        x = torch.randn(7, 5, dtype=torch.float64)
        td = GuidedBackprop(net, in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[7]))
        torch.testing.assert_close(td["y"], twin(x), rtol=0, atol=0)
        expected = captum.attr.GuidedBackprop(twin).attribute(x.clone(), target=twin(x).argmax(-1))
        assert relative_error(td["attribution", "x"], expected) <= 1e-8
        assert td["attribution", "x"].abs().max() > 0.1  # not a comparison of zeros

    def test_two_key_policy(self):
        assert_two_key_policy_matches(GuidedBackprop, captum.attr.GuidedBackprop, target=2)

    @pytest.mark.parametrize("seed", range(4))
    def test_random_mlps(self, seed):
        assert_random_mlp_matches(GuidedBackprop, captum.attr.GuidedBackprop, seed, (2, 3))

    def test_hooks_removed_after_a_failure(self):
        net = small_cnn()
        snapshot = state_snapshot(net)
        with pytest.raises(RuntimeError):
            GuidedBackprop(net, in_keys=["image"], out_keys=["logits"])(
                TensorDict(image=torch.randn(2, 3, 12, 12, dtype=torch.float64), batch_size=[2])
            )
        assert_unchanged(net, snapshot)


def _compiled(net: nn.Module, x: torch.Tensor, how: str) -> nn.Module:
    if how == "script":
        return torch.jit.script(net)
    if how == "trace":
        return torch.jit.trace(net, x)
    return torch.export.export(net, (x,)).module()


@pytest.mark.filterwarnings("ignore:`torch.jit.*` is deprecated:FutureWarning")
@pytest.mark.parametrize("how", ["script", "trace", "export"])
def test_a_model_whose_relus_no_hook_reaches_is_refused_by_name(how: str):
    """A TorchScript or exported model runs its ReLUs where no forward hook reaches: the guide was never applied and
    the result was the plain gradient's (1.15 off, relative, on a small CNN)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3)).eval()
    x = torch.randn(2, 3, 6, 6)
    compiled = _compiled(net, x, how)
    before = state_snapshot(compiled)
    td = TensorDict(x=x, batch_size=[2])
    with pytest.raises(TypeError, match=r"GuidedBackprop: module 'the model itself' .* computes ReLU"):
        GuidedBackprop(compiled, in_keys=["x"], out_keys=["y"])(td)
    assert_unchanged(compiled, before)
    assert list(td.keys()) == ["x"]


def test_a_scripted_part_without_relu_is_explained():
    torch.manual_seed(0)
    net = nn.Sequential(torch.jit.script(nn.Linear(3, 4)), nn.ReLU(), nn.Linear(4, 2))
    plain = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    plain.load_state_dict(net.state_dict())
    x = torch.randn(5, 3)
    got = GuidedBackprop(net, in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[5]))["attribution", "x"]
    expected = GuidedBackprop(plain, in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[5]))["attribution", "x"]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("centralized", [False, True])
def test_multi_agent_mlp_with_agents_under_vmap(centralized: bool):
    """torchrl's ``MultiAgentMLP`` with ``share_params=False`` runs its agents under ``torch.vmap``, where a tensor
    reports no gradient: no ReLU was guided and the result was the plain gradient (a relative L2 error of 1.19, 0.40
    with a centralised critic). The oracle is captum's GuidedBackprop on each agent's network, with its own
    parameters."""
    torch.manual_seed(0)
    n_agents, features = 3, 4
    net = MultiAgentMLP(
        features,
        2,
        n_agents=n_agents,
        centralized=centralized,
        share_params=False,
        depth=2,
        num_cells=6,
        activation_class=nn.ReLU,
    ).double()
    x = torch.randn(5, n_agents, features, dtype=torch.float64)
    target = net(x).argmax(-1)
    td = GuidedBackprop(net, in_keys=["obs"], out_keys=["q"])(TensorDict(obs=x, batch_size=[5]))
    expected = torch.zeros_like(x)
    for agent in range(n_agents):
        with net.params[agent].detach().clone().to_module(net._empty_net):
            agent_net = copy.deepcopy(net._empty_net)
        seen = x.flatten(1) if centralized else x[:, agent]
        attribution = captum.attr.GuidedBackprop(agent_net).attribute(seen.clone(), target=target[:, agent])
        if centralized:
            expected += attribution.view_as(x)
        else:
            expected[:, agent] = attribution
    assert relative_error(td["attribution", "obs"], expected) <= 1e-8
    plain = Saliency(net, in_keys=["obs"], out_keys=["q"], abs=False)(TensorDict(obs=x, batch_size=[5]))
    assert relative_error(td["attribution", "obs"], plain["attribution", "obs"]) > 1e-2
