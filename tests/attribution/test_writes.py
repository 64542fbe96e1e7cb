"""Writing a call's results into the caller's TensorDict: all of them, or none."""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import EnsembleModule, TensorDictModule, TensorDictModuleBase, TensorDictSequential
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution._writes import set_all_or_nothing
from tests.attribution._interrupts import Interrupt, every_line
from tests.attribution._losses import ppo_loss_and_batch


def test_a_write_interrupted_at_any_line_leaves_the_tensordict_as_it_was():
    def caller_td() -> TensorDict:
        return TensorDict(x=torch.ones(2, 3), y=torch.zeros(2), batch_size=[2])

    updates = {"y": torch.ones(2), ("relevance", "x"): torch.full((2, 3), 2.0), ("relevance", "z", "w"): torch.ones(2)}
    written = caller_td()
    set_all_or_nothing(written, updates)
    assert set(written.keys(include_nested=True, leaves_only=True)) == {"x", "y", *updates}
    for at in every_line(lambda: set_all_or_nothing(caller_td(), updates), stride=1):
        td = caller_td()
        before = dict(td.items(include_nested=True, leaves_only=True))
        with Interrupt(at) as interrupt:
            set_all_or_nothing(td, updates)
        assert interrupt.where is not None  # a write runs the same lines every time
        now = dict(td.items(include_nested=True, leaves_only=True))
        assert now.keys() == before.keys() and all(now[k] is v for k, v in before.items()), interrupt.where
        assert list(td.keys()) == ["x", "y"], interrupt.where  # no branch of its own left, empty or not


@pytest.mark.parametrize("method", ["LRP", "Saliency"])
def test_a_module_that_puts_a_dimension_in_front_of_the_batch_is_refused_naming_both_sizes(method):
    """tensordict's EnsembleModule returns its members' outputs in a ``[members, *batch]`` TensorDict: the results
    could not be written into the caller's (tensordict's own error, once every backward pass had run)."""
    import tdhook.attribution as attribution

    torch.manual_seed(0)
    critic = TensorDictModule(nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1)), ["observation"], ["q"])
    ensemble = EnsembleModule(critic, num_copies=3)
    state = {k: v.clone() for k, v in ensemble.state_dict().items()}
    td = TensorDict(observation=torch.randn(5, 3), batch_size=[5])
    before = td.clone()
    message = rf"{method}: the module returned a TensorDict of batch size \[3, 5\] for one of batch size \[5\]"
    if method == "LRP":  # refused before it runs (see test_lrp_functional_params.py)
        message = r"LRP: module 'the model itself' \(EnsembleModule\) runs its members under torch\.vmap"
    with pytest.raises(ValueError, match=message):
        getattr(attribution, method)(ensemble)(td)
    assert list(td.keys()) == ["observation"] and torch.equal(td["observation"], before["observation"])
    assert all(torch.equal(ensemble.state_dict()[k], v) for k, v in state.items())


def _lazy_stack(x: torch.Tensor) -> tuple[list[TensorDict], TensorDict]:
    from tensordict import LazyStackedTensorDict

    # Heterogeneous entries, as torchrl's multi-agent environments and variable-length replay buffer items give.
    parts = [TensorDict(x=x[i].clone(), extra=torch.zeros(i + 1), batch_size=[]) for i in range(len(x))]
    return parts, LazyStackedTensorDict.lazy_stack(parts, 0)


@pytest.mark.parametrize("method", ["LRP", "LRP in a context", "Saliency"])
def test_a_lazy_stack_gets_the_results_of_its_dense_batch_and_keeps_its_own_entries(method):
    """A ``LazyStackedTensorDict`` whose sub-TensorDicts hold entries of different shapes was explained, then its
    write failed (tensordict cannot stack ``extra``); one of equal shapes had each of its entries (the explained input
    and every other) replaced by a view of a new tensor: the caller's sub-TensorDicts no longer held their tensors."""
    import tdhook.attribution as attribution

    torch.manual_seed(0)
    net = TensorDictModule(
        nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).double(), in_keys=["x"], out_keys=["y"]
    )
    x = torch.randn(5, 6, dtype=torch.float64)
    make = (
        (lambda: attribution.Saliency(net, relevance_key="relevance"))
        if method == "Saliency"
        else (lambda: attribution.LRP(net))
    )
    dense = make()(TensorDict(x=x.clone(), batch_size=[5]))
    parts, stacked = _lazy_stack(x)
    entries = [dict(part.items()) for part in parts]
    wrapper = make()
    if method == "LRP in a context":
        with wrapper:
            for _ in range(3):  # later calls of a context may take other paths
                parts, stacked = _lazy_stack(x)
                entries = [dict(part.items()) for part in parts]
                out = wrapper(stacked)
    else:
        out = wrapper(stacked)
    assert out is stacked
    torch.testing.assert_close(out["relevance", "x"], dense["relevance", "x"], rtol=0, atol=0)
    torch.testing.assert_close(out["y"], dense["y"], rtol=0, atol=0)
    for part, before in zip(parts, entries, strict=True):
        assert all(part.get(key) is value for key, value in before.items())  # the caller's tensors, not copies
        assert set(part.keys(include_nested=True, leaves_only=True)) == {"x", "extra", "y", ("relevance", "x")}


@pytest.mark.parametrize("method", ["LRP", "Saliency"])
@pytest.mark.parametrize("how", ["lock_", "memmap_", "share_memory_", "consolidate"])
def test_a_locked_tensordict_is_refused_before_the_model_runs_naming_the_keys(method, how, tmp_path):
    """A locked TensorDict (``lock_()``, ``memmap_()``, ``share_memory_()``, ``consolidate()``) takes no new key: the
    call ran the model and every backward pass, then failed in tensordict's write with a message that named no key.
    The message names the call that locked it."""
    import tdhook.attribution as attribution

    torch.manual_seed(0)
    layer = nn.Linear(3, 2)
    calls = []
    layer.register_forward_hook(lambda *_: calls.append(1))
    net = TensorDictModule(layer, in_keys=["x"], out_keys=["y"])
    td = TensorDict(x=torch.randn(4, 3), batch_size=[4])
    td = td.memmap_(tmp_path) if how == "memmap_" else getattr(td, how)()
    before = dict(td.items())
    wrapper = getattr(attribution, method)(net)
    locked = rf"is locked \(.*{how}\(\).*\).*\('(relevance|attribution)', 'x'\).*unlock_\(\)"
    with pytest.raises(RuntimeError, match=locked):
        wrapper(td)
    assert not calls
    assert dict(td.items()).keys() == before.keys() and all(td.get(k) is v for k, v in before.items())


class _Patches(nn.Module):
    """Folds the batch into the patches, as MobileViT's transformer blocks do: ``[B, C, H, W] -> [B·H·W, C]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.permute(0, 2, 3, 1).reshape(-1, x.shape[1])


class _Unfolded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.patches, self.mix = nn.Conv2d(2, 3, 1), _Patches(), nn.Linear(3, 3)
        self.head = nn.Linear(12, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        patches = self.mix(self.patches(self.conv(x)))
        return self.head(patches.reshape(x.shape[0], -1))


def test_a_layer_whose_output_folds_the_batch_is_refused_naming_it_and_the_shapes():
    """Relevance at a layer whose output is ``[batch x patches, C]`` cannot be written per sample: tensordict's own
    error named neither the layer nor what was expected."""
    from tdhook.attribution import LRP

    torch.manual_seed(0)
    td = TensorDict(x=torch.randn(3, 2, 2, 2), batch_size=[3])
    before = td.clone()
    lrp = LRP(_Unfolded(), in_keys=["x"], out_keys=["y"], layers=["conv", "mix"])
    message = r"LRP: the relevance at \('relevance', 'mix'\) has shape \[12, 3\], which does not start with the "
    with pytest.raises(ValueError, match=message + r"TensorDict's batch shape \[3\]"):
        lrp(td)
    assert list(td.keys()) == ["x"] and torch.equal(td["x"], before["x"])
    written = LRP(_Unfolded(), in_keys=["x"], out_keys=["y"], layers=["conv"])(td.clone())
    assert written["relevance", "conv"].shape == (3, 3, 2, 2)


@pytest.mark.parametrize("method", ["LRP", "Saliency"])
def test_a_tensorclass_output_next_to_non_tensor_data_is_written(method):
    """A model that writes its output as a tensorclass (torchrl's VLA policies write a ``VLAAction``) into a
    TensorDict that also holds non-tensor data (a ``NonTensorStack``: their language instructions): the output was
    left out of the result, no error, as the non-tensor stack made the write compare entries one stacked TensorDict
    at a time and a tensorclass was taken for a leaf that is not there."""
    from tensordict import tensorclass
    from tensordict.nn import TensorDictModuleBase

    import tdhook.attribution as attribution

    @tensorclass(shadow=True)
    class Action:
        chunk: torch.Tensor

    class Policy(TensorDictModuleBase):
        in_keys, out_keys = ["x", "instruction"], ["action"]

        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(3, 2).double()

        def forward(self, td: TensorDict) -> TensorDict:
            return td.set("action", Action(chunk=self.layer(td["x"]), batch_size=td.batch_size))

    torch.manual_seed(0)
    policy = Policy()
    td = TensorDict(x=torch.randn(4, 3, dtype=torch.float64), instruction=["a", "b", "c", "d"], batch_size=[4])
    keys = {"in_keys": ["x"], "target_key": ("action", "chunk")}
    wrapper = getattr(attribution, method)(policy, **keys)
    out = wrapper(td.clone())
    torch.testing.assert_close(out["action", "chunk"], policy(td.clone())["action"].chunk, rtol=0, atol=0)


@pytest.mark.parametrize("method", ["LRP", "Saliency"])
def test_a_step_that_cuts_the_batch_is_named_without_the_ensemble_hint(method):
    """torchrl's RandomCropTensorDict in a pipeline returns a TensorDict cut along its time dimension: the refusal
    names that step, and says nothing of an EnsembleModule where the model has none."""
    from torchrl.envs.transforms import RandomCropTensorDict

    import tdhook.attribution as attribution

    torch.manual_seed(0)
    critic = TensorDictModule(nn.Linear(3, 1).double(), ["observation"], ["q"])
    policy = TensorDictSequential(RandomCropTensorDict(sub_seq_len=3, sample_dim=-1), critic)
    td = TensorDict(observation=torch.randn(2, 5, 3, dtype=torch.float64), batch_size=[2, 5])
    with pytest.raises(ValueError, match=r"batch size \[2, 3\] for one of batch size \[2, 5\]") as caught:
        getattr(attribution, method)(policy)(td)
    assert "'module.0' (RandomCropTensorDict)" in str(caught.value)
    assert "EnsembleModule" not in str(caught.value)
    assert list(td.keys()) == ["observation"]
    # As the message says: the crop applied first, the rest explained; LRP-0 of a linear critic is gradient x input.
    cropped = RandomCropTensorDict(sub_seq_len=3, sample_dim=-1)(td.clone())
    if method == "LRP":
        explained = attribution.LRP(critic)(cropped.clone())
        expected = cropped["observation"] * critic.module.weight.detach()[0]
        torch.testing.assert_close(explained["relevance", "observation"], expected, rtol=1e-12, atol=1e-12)


def test_an_ensemble_keeps_its_hint():
    import tdhook.attribution as attribution

    critic = TensorDictModule(nn.Linear(3, 1), ["observation"], ["q"])
    policy = TensorDictSequential(
        TensorDictModule(nn.Identity(), ["observation"], ["observation"]), EnsembleModule(critic, num_copies=2)
    )
    with pytest.raises(ValueError, match=r"an EnsembleModule puts its members' dimension in front of the batch"):
        attribution.LRP(policy, target_key="q")(TensorDict(observation=torch.randn(5, 3), batch_size=[5]))


class _Pointer(TensorDictModuleBase):
    """A policy pointing at one of the batch's items: scores over the items, centred, returned in a TensorDict
    without a batch size (one decision over them all)."""

    def __init__(self) -> None:
        super().__init__()
        self.in_keys, self.out_keys = ["item"], ["logits"]
        self.score = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, td: TensorDict) -> TensorDict:
        scores = self.score(td["item"]).squeeze(-1)
        return TensorDict(logits=scores - scores.mean())


_PER_METHOD = {
    "LRP": {},
    "Saliency": {},
    "FeatureAblation": {},
    "Occlusion": {"sliding_window_shapes": (2,)},
    "ShapleyValueSampling": {"feature_masks": torch.tensor([0, 0, 1, 2])},
}


def _returning_without_batch_size(net: nn.Module, returns: str) -> TensorDictModuleBase:
    if returns == "TensorDictModule":
        return TensorDictModule(net, ["obs"], ["q"], inplace=False)
    if returns == "TensorDictSequential":
        return TensorDictSequential(TensorDictModule(net, ["obs"], ["q"]), inplace=False)
    return TensorDictSequential(
        TensorDictModule(net[:2], ["obs"], ["h"]), TensorDictModule(net[2:], ["h"], ["q"], inplace=False)
    )


@pytest.mark.parametrize("method", list(_PER_METHOD))
@pytest.mark.parametrize("returns", ["TensorDictModule", "TensorDictSequential", "last step"])
def test_outputs_returned_without_a_batch_size_are_explained_per_sample(method, returns):
    """A ``TensorDictModule`` or ``TensorDictSequential`` made with ``inplace=False`` (or a sequence whose last step
    is) returns a new TensorDict of its outputs without a batch size. It was read as a module that cut the batch to
    none: the whole batch one sample, and the perturbation methods moved every sample's features at once
    (FeatureAblation 0.5 off, every feature of a sample given the drop of the whole batch). The call's results are
    now those of the same module with ``inplace=True``, written into the caller's TensorDict, with its batch size."""
    import tdhook.attribution as attribution

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    plain = TensorDictModule(net, in_keys=["obs"], out_keys=["q"])
    make = getattr(attribution, method)
    key = ("relevance" if method == "LRP" else "attribution", "obs")
    expected = make(plain, target=1, **_PER_METHOD[method])(TensorDict(obs=x.clone(), batch_size=[5]))
    td = TensorDict(obs=x.clone(), batch_size=[5])
    out = make(_returning_without_batch_size(net, returns), target=1, **_PER_METHOD[method])(td)
    assert out is td and out.batch_size == torch.Size([5])
    torch.testing.assert_close(out.get(key), expected.get(key), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(out["q"], expected["q"])


@pytest.mark.parametrize("method", ["LRP", "Saliency"])
def test_a_module_of_ones_own_returning_no_batch_size_is_taken_at_its_word(method):
    """A policy pointing at one of the batch's items returns its scores over them without a batch size: one
    decision, whose output is as long as the batch by construction. It is explained as one sample (the chosen item's
    score, over every item), not per item, where each item's own centred score would sum to zero."""
    import tdhook.attribution as attribution

    torch.manual_seed(0)
    policy = _Pointer().double()
    x = torch.randn(5, 4, dtype=torch.float64)
    out = getattr(attribution, method)(policy)(TensorDict(item=x.clone(), batch_size=[5]))
    leaf = x.clone().requires_grad_(True)
    scores = policy.score(leaf).squeeze(-1)
    logits = scores - scores.mean()
    (gradient,) = torch.autograd.grad(logits[logits.argmax()], leaf)
    expected = leaf.detach() * gradient if method == "LRP" else gradient.abs()
    key = ("relevance" if method == "LRP" else "attribution", "item")
    assert out.batch_size == torch.Size([])
    torch.testing.assert_close(out.get(key), expected, rtol=1e-6, atol=1e-8)


def _transitions(batch: int) -> TensorDict:
    """A batch of transitions of a 4-feature observation and two one-hot actions (float64)."""
    return TensorDict(
        {
            "observation": torch.randn(batch, 4, dtype=torch.float64),
            "action": nn.functional.one_hot(torch.randint(0, 2, (batch,)), 2),
            ("next", "observation"): torch.randn(batch, 4, dtype=torch.float64),
            ("next", "reward"): torch.randn(batch, 1, dtype=torch.float64),
            ("next", "done"): torch.zeros(batch, 1, dtype=torch.bool),
            ("next", "terminated"): torch.zeros(batch, 1, dtype=torch.bool),
        },
        batch_size=[batch],
    )


def test_a_loss_per_sample_is_explained_per_sample():
    """torchrl's losses with ``reduction="none"`` return their per-sample loss in a TensorDict without a batch size:
    read as a batch cut to none, LRP explained the largest sample's loss alone (the argmax of the whole tensor),
    every other sample's relevance zero. Each sample's relevance is now that of its own loss: gradient × input of
    loss[i] at sample i under LRP-0 (the loss's mse_loss keeps its plain gradient, and says so)."""
    from torchrl.modules import QValueActor
    from torchrl.objectives import DQNLoss

    from tdhook.attribution.mappers.base import BaseRuleMapper

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).double()
    actor = QValueActor(net, in_keys=["observation"], action_space="one_hot")
    loss = DQNLoss(actor, action_space="one_hot", reduction="none", delay_value=False)
    batch = 5
    td = _transitions(batch)
    lrp = LRP(loss, BaseRuleMapper(stabilizer=0.0), in_keys=["observation"], target_key="loss")
    with pytest.warns(UserWarning, match="mse_loss"):
        out = lrp(td.clone())
    x = td["observation"].clone().requires_grad_(True)
    per_sample = loss(td.clone().set("observation", x))["loss"]
    expected = torch.stack([(x * torch.autograd.grad(per_sample[i], x, retain_graph=True)[0])[i] for i in range(batch)])
    assert out.batch_size == torch.Size([batch])
    torch.testing.assert_close(out["relevance", "observation"], expected, rtol=1e-10, atol=1e-12)


def test_a_loss_per_sample_with_statistics_of_the_batch_is_explained_per_sample():
    """torchrl's PPO loss with ``reduction="none"`` returns its per-sample losses with statistics of the whole batch
    (``clip_fraction``, ``ESS``: no batch dimension) in a TensorDict without a batch size: read as one sample, LRP
    explained the largest sample's loss alone, every other sample's relevance zero. Each sample is now explained as
    it is alone, and the statistics are kept whole next to the samples (tensordict's ``UnbatchedTensor``)."""
    from tensordict import UnbatchedTensor

    from tdhook.attribution.mappers.base import BaseRuleMapper

    loss, td = ppo_loss_and_batch(5)
    lrp = LRP(loss, BaseRuleMapper(stabilizer=0.0), in_keys=["observation"], target_key="loss_objective")
    with pytest.warns(UserWarning, match="computes"):
        out = lrp(td.clone())
    alone = torch.cat([lrp(td[i : i + 1].clone())["relevance", "observation"] for i in range(5)])
    assert out.batch_size == torch.Size([5]) and (alone != 0).all()
    torch.testing.assert_close(out["relevance", "observation"], alone, rtol=1e-10, atol=1e-12)
    plain = loss(td.clone())
    assert isinstance(out.get("clip_fraction"), UnbatchedTensor)
    torch.testing.assert_close(out["clip_fraction"], plain["clip_fraction"])
    torch.testing.assert_close(out["loss_critic"], plain["loss_critic"].detach())


def test_a_loss_read_by_a_perturbation_method_keeps_the_entries_it_does_not_declare():
    """A torchrl loss reads ``"advantage"`` where the TensorDict holds it and computes it otherwise (its value
    estimator runs the critic over the batch); its ``in_keys`` leave it out. The perturbed passes ran on the
    declared keys alone: FeatureAblation refused the PPO loss, or compared the caller's loss with one of another
    advantage. Each sample's drop is now that of its own loss, the advantage the caller gave."""
    from tdhook.attribution import FeatureAblation

    loss, td = ppo_loss_and_batch(5)
    out = FeatureAblation(loss, in_keys=["observation"], target_key="loss_objective")(td.clone())
    ablated = td.clone()
    ablated["observation"].zero_()  # the default group: every feature of a sample's key
    drop = (loss(td.clone())["loss_objective"] - loss(ablated)["loss_objective"]).detach()
    assert out.batch_size == torch.Size([5])
    torch.testing.assert_close(out["attribution", "observation"], drop[:, None].expand(5, 3), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("method", ["LRP", "FeatureAblation"])
@pytest.mark.parametrize("loss_name", ["DQNLoss", "DiscreteCQLLoss"])
def test_a_loss_writes_each_samples_priority_into_the_callers_tensordict_as_called_by_itself(method, loss_name):
    """torchrl's value losses write each sample's ``td_error`` (a prioritised replay buffer's priority) into the
    TensorDict they are given and return their losses in a new one, where DiscreteCQL's ``td_error`` is a statistic
    of the batch. The write was lost with the wrapper's copy of the inputs, and the statistic took the key: a second
    call on the same TensorDict failed to update it. The caller's TensorDict now holds each sample's ``td_error``,
    as after the loss called by itself, call after call."""
    import torchrl.objectives as objectives
    from torchrl.modules import QValueActor

    import tdhook.attribution as attribution
    from tdhook.attribution.mappers.base import BaseRuleMapper

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).double()
    actor = QValueActor(net, in_keys=["observation"], action_space="one_hot")
    loss = getattr(objectives, loss_name)(actor, action_space="one_hot", reduction="none", delay_value=False)
    batch = 5
    td = _transitions(batch)
    alone = td.clone()
    loss(alone)
    key = "loss" if loss_name == "DQNLoss" else "loss_qvalue"
    rules = {"rule_mapper": BaseRuleMapper(stabilizer=0.0)} if method == "LRP" else {}
    wrapper = getattr(attribution, method)(loss, in_keys=["observation"], target_key=key, **rules)
    given = td.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the loss's own functions, which keep their plain gradient under LRP
        for _ in range(2):
            wrapper(given)
            assert type(given.get("td_error")) is torch.Tensor
            torch.testing.assert_close(given["td_error"], alone["td_error"], rtol=1e-12, atol=1e-14)
