"""The error a failing run of the wrapped model raises.

A parameter or buffer left on the meta device failed with torch's "Tensor on device meta is not on the expected
device cpu!", which names no module: the error names the module, the tensor and the device expected, and the call
leaves the model and the caller's TensorDict as they were. A model may hold such tensors without computing with them
(torchrl's multi-agent templates, see test_agents.py): they are not refused before the call.
"""

from __future__ import annotations

import re

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import CPLRP, LRP, AttnLRP, EpsilonPlus, Saliency
from tests.attribution._helpers import Attending


def on_meta(where: str) -> nn.Sequential:
    """Two Linear layers and a BatchNorm, with a parameter (or a buffer) of the one at ``where`` on meta."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 1)).eval()
    if where == "buffer":
        model[3].running_var = torch.empty(3, device="meta")
    else:
        model[int(where)].weight = nn.Parameter(torch.empty_like(model[int(where)].weight, device="meta"))
    return model


def state(model: nn.Module) -> list:
    tensors = [*model.named_parameters(), *model.named_buffers()]
    hooks = [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)) for m in model.modules()]
    return [(n, t, t.device, t.clone() if not t.is_meta else None) for n, t in tensors] + hooks


def assert_same(before: list, after: list) -> None:
    assert len(before) == len(after)
    for old, new in zip(before, after, strict=True):
        if isinstance(old, tuple) and len(old) == 4 and isinstance(old[1], torch.Tensor):
            assert old[:3] == new[:3] and new[1] is old[1]
            assert old[3] is None or torch.equal(old[3], new[3])
        else:
            assert old == new


@pytest.mark.parametrize("in_context", [False, True], ids=["call", "context"])
@pytest.mark.parametrize(
    "where, named",
    [("0", "'0' (Linear) holds its parameter 'weight'"), ("2", "'2' (Linear) holds its parameter 'weight'"),
     ("buffer", "'3' (BatchNorm1d) holds its buffer 'running_var'")],
)  # fmt: skip
def test_a_tensor_on_meta_is_named_and_nothing_changes(where: str, named: str, in_context: bool):
    model = on_meta(where)
    lrp = LRP(model, EpsilonPlus(), in_keys=["x"], out_keys=["y"])
    x = torch.randn(4, 2)
    td = TensorDict(x=x, batch_size=[4])
    before = state(model)
    match = re.escape(f"LRP: the module {named} on the meta device") + ".*inputs are on cpu.*expected on cpu"
    with pytest.raises(ValueError, match=match) as info:
        if in_context:
            with lrp:
                lrp(td)
        else:
            lrp(td)
    assert "meta" in str(info.value.__cause__)  # torch's own error, as the cause
    assert_same(before, state(model))
    assert set(td.keys()) == {"x"} and td["x"] is x


def test_another_method_names_it_too():
    model = TensorDictModule(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1)).to("meta"), in_keys=["x"], out_keys=["y"])
    with pytest.raises(ValueError, match="Saliency: the module 'module.0' \\(Linear\\) holds its parameter 'weight'"):
        Saliency(model, target=0)(TensorDict(x=torch.randn(4, 2), batch_size=[4]))


def test_an_error_not_about_meta_is_left_as_it_is():
    # A meta tensor the model holds but does not compute with is no cause of another error.
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(2, 1))
    model.register_buffer("template", torch.empty(3, device="meta"))
    with pytest.raises(RuntimeError, match="cannot be multiplied") as info:
        LRP(model, EpsilonPlus(), in_keys=["x"], out_keys=["y"])(TensorDict(x=torch.randn(4, 2), batch_size=[4]))
    assert any("raised while running the wrapped module" in note for note in info.value.__notes__)


@pytest.mark.parametrize("mapper", [AttnLRP, CPLRP])
@pytest.mark.parametrize("where", ["head", "encoder.layers.1.linear2"])
def test_a_layer_whose_rule_puts_no_hook_is_named_too(mapper, where):
    """The transformer presets give linear layers the plain gradient, whose rule puts no hook: a weight on the meta
    device there gave relevance of up to 2.4e20 (or NaN) with no error. Refused as a ruled layer's is."""
    torch.manual_seed(0)
    model = Attending().eval()
    layer = model.get_submodule(where)
    layer.weight = nn.Parameter(torch.empty_like(layer.weight, device="meta"))
    td = TensorDict(x=torch.randn(2, 5, 8), batch_size=[2])
    before = state(model)
    match = re.escape(f"LRP: the module '{where}' (Linear) holds its parameter 'weight' on the meta device")
    with pytest.raises(ValueError, match=match):
        LRP(model, mapper(), in_keys=["x"], out_keys=["y"])(td)
    assert_same(before, state(model))
    assert set(td.keys()) == {"x"}


class _Energy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).sum(-1)


class _VectorField(nn.Module):
    """The gradient of an energy, taken in the forward by a torch.func transform (a Hamiltonian's vector field)."""

    def __init__(self, transform: str) -> None:
        super().__init__()
        self.energy, self.transform = _Energy(), transform

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.transform == "grad":
            return torch.vmap(torch.func.grad(self.energy))(x)
        energy, pull_back = torch.func.vjp(self.energy, x)
        return pull_back(torch.ones_like(energy))[0]


@pytest.mark.parametrize("transform", ["grad", "vjp"])
@pytest.mark.parametrize("preset", [None, "EpsilonPlus"])
def test_a_torch_func_transform_in_the_forward_is_refused_naming_it_and_the_modules(transform, preset):
    # Before, torch's "In order to use an autograd.Function with functorch transforms ... must override the
    # setup_context staticmethod", naming neither the transform nor a module.
    torch.manual_seed(0)
    field = _VectorField(transform).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    expected = torch.func.vmap(torch.func.grad(field.energy))(x)
    torch.testing.assert_close(field(x), expected)  # the model runs on its own
    lrp = LRP(TensorDictModule(field, ["x"], ["y"]), rule_mapper=None if preset is None else EpsilonPlus())
    ruled = r"module 'module.energy.net.1' \(Tanh\)" if preset is None else r"module 'module.energy.net.0' \(Linear\)"
    named = "torch.func.vmap, torch.func.grad" if transform == "grad" else "torch.func.vjp"
    with pytest.raises(
        NotImplementedError,
        match=rf"module 'module' \(_VectorField\) calls {named} in its own forward "
        rf"through {ruled}, whose rule works through autograd hooks",
    ):
        lrp(TensorDict(x=x, batch_size=[4]))


def test_the_advised_rewrite_with_create_graph_is_explained():
    """As the refusal says: the gradient taken by torch.autograd.grad(..., create_graph=True), explained by LRP with
    create_graph=True; with no rule on the model, that is gradient x input of the chosen output."""
    from tdhook.attribution.mappers.base import rule_mapper_from_dict

    class Advised(_VectorField):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x if x.requires_grad else x.requires_grad_(True)
            return torch.autograd.grad(self.energy(x).sum(), x, create_graph=True)[0]

    torch.manual_seed(0)
    field = Advised("grad").double()
    x = torch.randn(4, 3, dtype=torch.float64)
    lrp = LRP(TensorDictModule(field, ["x"], ["y"]), rule_mapper=rule_mapper_from_dict({}), create_graph=True)
    relevance = lrp(TensorDict(x=x, batch_size=[4]))["relevance", "x"]
    y = torch.func.vmap(torch.func.grad(field.energy))(x)
    chosen = y.argmax(-1)
    jacobians = torch.func.vmap(torch.func.jacrev(torch.func.grad(field.energy)))(x)  # [4, 3 outputs, 3 inputs]
    expected = x * jacobians[torch.arange(4), chosen]
    torch.testing.assert_close(relevance.detach(), expected, rtol=1e-10, atol=1e-12)


def test_an_error_not_about_torch_func_transforms_is_left_to_the_usual_notes():
    from tdhook.attribution._function_transforms import transform_refusal

    class Failing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.func.grad(lambda t: self.linear(t).sum())(x)

    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        raise RuntimeError("the model's own error")  # under the transform, in a module inside it

    model = Failing()
    model.linear.register_forward_hook(hook)
    with pytest.raises(RuntimeError, match="the model's own error") as caught:
        model(torch.randn(3))
    assert transform_refusal(caught.value, dict(model.named_modules()), "LRP", lambda frame: True) is None


class CheckedTokens(nn.Module):
    """Embeds token ids after checking the mask that comes with them, which raises before the embedding runs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(7, 4), nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if mask.shape != ids.shape:
            raise ValueError(f"mask of shape {tuple(mask.shape)} for ids of shape {tuple(ids.shape)}")
        return self.head(self.embed(ids) * mask.unsqueeze(-1)).sum(1)


def test_a_model_error_before_the_embedding_is_raised_as_the_model_raised_it():
    """The model's own error is raised, with its type and message: that no embedding read the ids is a note, not the
    error (the error used to be a TypeError saying so, the model's error only its cause)."""
    model = CheckedTokens().double()
    policy = TensorDictModule(model, in_keys=["ids", "mask"], out_keys=["y"])
    ids = torch.randint(0, 7, (3, 5))
    td = TensorDict(ids=ids, mask=torch.ones(3, 4, dtype=torch.long), batch_size=[3])
    before = state(model)
    with pytest.raises(ValueError, match=re.escape("mask of shape (3, 4) for ids of shape (3, 5)")) as info:
        LRP(policy, in_keys=["ids"])(td)
    assert str(info.value) == "mask of shape (3, 4) for ids of shape (3, 5)"
    assert any("'ids' holds integer tokens" in note and "before this error" in note for note in info.value.__notes__)
    assert_same(before, state(model))
    assert set(td.keys()) == {"ids", "mask"}
    # With a mask of the right shape, the tokens are explained.
    td = TensorDict(ids=ids, mask=torch.ones(3, 5, dtype=torch.long), batch_size=[3])
    assert LRP(policy, in_keys=["ids"])(td)["relevance", "ids"].shape == (3, 5)


class _MeanLoss(nn.Module):
    """One number for the whole batch, as a loss with ``reduction="mean"``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.net(x).squeeze(-1) ** 2).mean()


@pytest.mark.parametrize("wrapper", [LRP, Saliency])
def test_an_output_without_the_batch_is_said_to_need_one_per_sample(wrapper):
    """tensordict's bare "batch dimension mismatch" named neither the batch shape expected nor what to do."""
    td = TensorDict(x=torch.randn(5, 4), batch_size=[5])
    with pytest.raises(RuntimeError, match="batch dimension mismatch") as info:
        wrapper(_MeanLoss(), in_keys=["x"], out_keys=["loss"])(td)
    notes = "\n".join(info.value.__notes__)
    assert f"{wrapper.__name__}: the module returned an output that does not start with the TensorDict's batch" in notes
    assert "[5]: one output per sample is expected" in notes and "reduction='none'" in notes
    assert set(td.keys()) == {"x"}
