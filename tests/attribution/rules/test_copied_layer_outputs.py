"""A BatchNorm that reads a layer's output as another tensor of the same values (a copy, a view of the same shape, a
forward hook's or an observer's output) is not merged: warned of by name where the layer's rule would merge it and
is not (near) the plain gradient; nothing said where merged or not is the same relevance, or where the code between
changed the values."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP, EpsilonPlus, UniformEpsilon
from tdhook.attribution.rules import EpsilonRule
from tdhook.attribution.rules._copied_layer_outputs import copied_layer_call
from tests.attribution.rules._helpers import CNN_PRESETS
from tests.attribution.test_lrp_layers import randomise_batch_norm
from tests.conftest import relative_error

F64 = torch.float64
# The CNN presets whose rules differ on a convolution (EpsilonPlusFlat's are EpsilonPlus's after the first layer).
PRESETS: dict[str, Callable[..., object]] = {
    **{name: CNN_PRESETS[name] for name in ("EpsilonPlus", "EpsilonAlpha2Beta1", "EpsilonGammaBox")},
    "UniformEpsilon": UniformEpsilon,
}
MESSAGE = r"the BatchNorm2d after Conv2d \(\w+\) is not merged into it: .* made by {}"
COPIES: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str]] = {
    "clone": (torch.clone, "clone"),
    "view": (lambda z: z.view(z.shape), "view"),
    "plus-zero": (lambda z: z + 0.0, "add"),
    "contiguous": (lambda z: z.contiguous(), "clone"),  # of a channels_last output
}


class ConvNorm(nn.Module):
    """A convolution whose output reaches its BatchNorm through ``between``, a ReLU and a head."""

    def __init__(self, between: Callable[[torch.Tensor], torch.Tensor] = lambda z: z) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.norm = nn.Conv2d(3, 4, 3, padding=1), randomise_batch_norm(nn.BatchNorm2d(4))
        self.head = nn.Sequential(nn.ReLU(), nn.Conv2d(4, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3))
        self.between = between
        self.to(F64).eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.between(self.conv(x))))


def image(channels_last: bool = False) -> torch.Tensor:
    x = torch.rand(2, 3, 6, 6, generator=torch.Generator().manual_seed(1), dtype=F64) * 4 - 2
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def relevance(model: nn.Module, x: torch.Tensor, mapper, calls: int = 1) -> torch.Tensor:
    lrp = LRP(model, rule_mapper=mapper, in_keys=["x"], out_keys=["y"], target=0)
    with lrp:
        for _ in range(calls):
            result = lrp(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))["relevance", "x"]
    return result


def copy_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "is not merged into it" in str(w.message)]


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("how", sorted(COPIES))
def test_a_copy_of_the_layer_output_is_warned_of_by_name(how: str, preset: str):
    between, operation = COPIES[how]
    model = ConvNorm(between)
    direct = ConvNorm()
    channels_last = how == "contiguous"
    if channels_last:
        model, direct = model.to(memory_format=torch.channels_last), direct.to(memory_format=torch.channels_last)
    x = image(channels_last)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.warns(UserWarning, match=MESSAGE.format(operation)):
        actual = relevance(model, x, PRESETS[preset]())
    assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items())
    # What the warning is for: the unmerged BatchNorm's relevance is measurably not the merged one's.
    assert relative_error(actual, relevance(direct, x, PRESETS[preset]())) > 1e-2


def test_a_forward_hook_of_the_layer_that_returns_a_copy_is_warned_of():
    model = ConvNorm()
    model.conv.register_forward_hook(lambda module, args, output: output.clone())
    with pytest.warns(UserWarning, match=MESSAGE.format("clone")):
        relevance(model, image(), EpsilonPlus())


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_an_unfused_quantization_aware_model_with_its_fake_quantisation_off_is_warned_of():
    from torch.ao import quantization

    model = nn.Sequential(quantization.QuantStub(), ConvNorm().float(), quantization.DeQuantStub())
    model.qconfig = quantization.get_default_qat_qconfig("x86")
    quantization.prepare_qat(model.train(), inplace=True)
    x = image().float()
    with torch.no_grad():  # the observers see one batch, in eval mode (the BatchNorm's statistics stay)
        model.eval()(x)
    model.apply(quantization.disable_observer)
    model.apply(quantization.disable_fake_quant)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        relevance(model, x, EpsilonPlus())
    found = copy_warnings(caught)
    assert len(found) == 1 and "fusedMovingAvgObsFqHelper" in found[0], found


def test_warned_once_per_batch_norm():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        relevance(ConvNorm(torch.clone), image(), EpsilonPlus(), calls=3)
    assert len(copy_warnings(caught)) == 1


@pytest.mark.parametrize(
    "between",
    [lambda z: z, torch.relu, lambda z: z * 2.0, lambda z: z.clone().add_(0.1), lambda z: z.mul_(2.0)],
    ids=["direct", "relu", "scaled", "shifted-copy", "scaled-in-place"],
)
def test_nothing_said_where_the_batch_norm_merges_or_the_values_changed(between):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        relevance(ConvNorm(between), image(), EpsilonPlus())
    assert copy_warnings(caught) == []


def test_nothing_said_under_rules_whose_merge_changes_nothing():
    # LRP-0 on every layer: merged or not, the BatchNorm's gradient is its plain one.
    model = ConvNorm(torch.clone)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = relevance(model, image(), lambda name, module: EpsilonRule(0.0) if name == "conv" else None)
    assert copy_warnings(caught) == []
    x = image().requires_grad_(True)
    expected = x * torch.autograd.grad(model(x)[:, 0].sum(), x)[0]
    assert relative_error(actual, expected.detach()) <= 1e-6  # the BatchNorm's ε-rule: a 1e-6 stabilizer


def test_copied_layer_call_names_the_operations_in_order():
    from tdhook.attribution.rules.basic import EpsilonRule as Epsilon
    from tdhook.attribution.rules.batch_norm import MergeBatchNormRule

    layer, norm = nn.Linear(3, 4).double(), nn.BatchNorm1d(4).double().eval()
    x = torch.randn(2, 3, dtype=F64, requires_grad=True)
    seen = []
    norm.register_forward_pre_hook(lambda module, args: seen.append(copied_layer_call(args[0])))
    with Epsilon(0.1).register(layer), MergeBatchNormRule().register(norm), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        norm(layer(x).clone().view(2, 4))
        norm(layer(x).relu())
    (call, operations), after_relu = seen
    assert call.module is layer and operations == ("clone", "view") and after_relu is None


# A layer's output rearranged before its BatchNorm (values moved, none changed): a per-channel affine map after the
# rearrangement is one before it, so the BatchNorm could be folded into the layer; the merge does not follow it, and
# nothing was said (0.38-1.68 off the folded model under the CNN presets: IBN-Net's split, a flatten before a
# BatchNorm1d, a permutation there and back, a crop, a nearest upsampling).
REARRANGED: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str]] = {
    "permuted-and-back": (lambda z: z.permute(0, 2, 3, 1).permute(0, 3, 1, 2), "permute"),
    "flipped": (lambda z: z.flip(-1), "flip"),
    "transposed": (lambda z: z.transpose(2, 3), "transpose"),
    "rolled": (lambda z: z.roll(1, -1), "roll"),
}


def _folded(model: ConvNorm) -> ConvNorm:
    """``model`` with its BatchNorm folded into its convolution by hand, the rearrangement kept: the same function."""
    norm, folded = model.norm, ConvNorm(model.between)
    scale = norm.weight / torch.sqrt(norm.running_var + norm.eps)
    with torch.no_grad():
        folded.conv.weight.copy_(model.conv.weight * scale.view(-1, 1, 1, 1))
        folded.conv.bias.copy_((model.conv.bias - norm.running_mean) * scale + norm.bias)
        folded.head.load_state_dict(model.head.state_dict())
    folded.norm = nn.Identity()
    return folded


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("how", sorted(REARRANGED))
def test_a_rearranged_layer_output_is_warned_of_by_name(how: str, preset: str):
    between, operation = REARRANGED[how]
    model, x = ConvNorm(between), image()
    folded = _folded(model)
    with torch.no_grad():
        torch.testing.assert_close(folded(x), model(x), rtol=1e-12, atol=1e-12)
    match = rf"the BatchNorm2d after Conv2d \(\w+\) is not merged into it: .* rearranged by .*{operation}"
    with pytest.warns(UserWarning, match=match):
        actual = relevance(model, x, PRESETS[preset]())
    # What the warning is for: the unmerged BatchNorm's relevance is measurably not the folded model's.
    assert relative_error(actual, relevance(folded, x, PRESETS[preset]())) > 1e-2


class _Rearranging(nn.Module):
    """A convolution, then a BatchNorm over half its channels (IBN-Net's split) or over its flattened positions."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.how, self.conv = how, nn.Conv2d(3, 4, 3, padding=1)
        self.norm = randomise_batch_norm(nn.BatchNorm2d(2) if how == "split" else nn.BatchNorm1d(4))
        self.head = nn.Sequential(nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
        self.to(F64).eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.conv(x)
        if self.how == "split":
            kept, normed = torch.split(z, 2, dim=1)
            return self.head(torch.cat([kept, self.norm(normed.contiguous())], dim=1))
        return self.head(self.norm(z.flatten(2)).view_as(z))


@pytest.mark.parametrize(("how", "names"), [("split", "clone, split"), ("flatten", "view")])
def test_a_split_or_flattened_layer_output_is_warned_of_naming_the_operations(how: str, names: str):
    with pytest.warns(UserWarning, match=rf"BatchNorm\dd after Conv2d .* rearranged by {names} "):
        relevance(_Rearranging(how), image(), EpsilonPlus())
