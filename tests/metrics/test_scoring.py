"""Scorer: the target fixed on the unperturbed input, stacks of perturbed inputs scored in one pass."""

from __future__ import annotations

import copy
import functools
import re
from unittest import mock

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule, TensorDictModuleBase, TensorDictSequential
from torch import nn

from tdhook.attribution.targets import initial_gradient
from tdhook.metrics import infidelity, pixel_flipping
from tdhook.metrics._leading_affine import LeadingAffine
from tdhook.metrics._scoring import Scorer, chunks
from tests.attribution.methods._transformers import image_pairs, next_token, next_token_td, similarity
from tests.metrics._models import Trajectory


def test_the_argmax_is_fixed_on_the_unperturbed_input():
    net = torch.nn.Linear(2, 2, bias=False).double()
    with torch.no_grad():
        net.weight.copy_(torch.eye(2, dtype=torch.float64))
    td = TensorDict(x=torch.tensor([[1.0, 0.0]], dtype=torch.float64), batch_size=[1])
    scorer = Scorer(net, td, in_keys=["x"], out_keys=["y"])
    assert scorer.target_index.tolist() == [0]
    flipped = scorer.scores({"x": torch.tensor([[[0.0, 5.0]]], dtype=torch.float64)})
    assert flipped.tolist() == [[0.0]]  # still unit 0, although unit 1 is now the largest


def test_pipelines_keep_their_other_inputs_and_any_batch_shape():
    pipeline = TensorDictSequential(
        TensorDictModule(lambda x, s: x * s, in_keys=["x", "scale"], out_keys=["h"]),
        TensorDictModule(lambda h: h.sum(-1, keepdim=True), in_keys=["h"], out_keys=["value"]),
    )
    td = TensorDict(x=torch.ones(2, 3, 4), scale=torch.full((2, 3, 1), 2.0), batch_size=[2, 3])
    scorer = Scorer(pipeline, td, in_keys=["x"])
    assert scorer.target_key == "value" and scorer.reference.shape == (2, 3)
    stack = torch.zeros(5, 2, 3, 4)
    stack[1] = 1.0
    scores = scorer.scores({"x": stack})
    assert scores.shape == (5, 2, 3) and scores[1].eq(8.0).all() and scores[0].eq(0.0).all()


def test_a_callable_target_is_summed_and_its_shape_checked():
    td = TensorDict(x=torch.ones(2, 3), batch_size=[2])
    scorer = Scorer(torch.nn.Identity(), td, in_keys=["x"], out_keys=["y"], target=lambda out: out * 2)
    assert scorer.reference.tolist() == [6.0, 6.0]
    with pytest.raises(ValueError, match="a callable target must return a tensor shaped like output 'y'"):
        Scorer(torch.nn.Identity(), td, in_keys=["x"], out_keys=["y"], target=lambda out: out.sum(-1))
    with pytest.raises(TypeError, match="metrics needs in_keys and out_keys"):
        Scorer(torch.nn.Identity(), td, in_keys=["x"])


def test_chunks_cover_the_range():
    assert list(chunks(7, 3)) == [(0, 3), (3, 6), (6, 7)]


def sequence_model() -> nn.Module:
    """A per-step encoder, attention over the time dimension of a ``[B, T]`` batch, and a per-step head."""
    torch.manual_seed(3)
    encoder = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    return nn.Sequential(nn.Linear(4, 8), encoder, nn.Linear(8, 3)).double().eval()


def hooked(net: nn.Module) -> nn.Module:
    """A copy of ``net`` with a hook that changes nothing: the metrics then run it on every perturbed input."""
    net = copy.deepcopy(net)
    net.register_forward_pre_hook(lambda module, args: None)
    return net


@pytest.mark.parametrize("update", [True, False], ids=["first layer updated", "stacked passes"])
@pytest.mark.parametrize("as_module", [True, False], ids=["TensorDictModule", "plain module"])
def test_stacked_steps_keep_the_time_dimension_of_a_sequence_batch(update, as_module):
    """A ``[B, T]`` batch through a model that attends over ``T``: every stack of steps must reach the model (and
    the layers after an updated first layer) as ``[S * B, T]``, never flattened (attention across the samples of
    every step), so that the curve is the one of passes over the batch as it is, one step at a time."""
    net = sequence_model()
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    td = TensorDict(x=x, attribution=TensorDict(x=torch.randn(2, 5, 4, dtype=torch.float64)), batch_size=[2, 5])

    def curve(model, **kwargs):
        if as_module:
            return pixel_flipping(TensorDictModule(model, in_keys=["x"], out_keys=["y"]), td, **kwargs)
        return pixel_flipping(model, td, in_keys=["x"], out_keys=["y"], **kwargs)

    expected = curve(hooked(net), features_per_step=1, steps_per_forward=1)
    with mock.patch.object(LeadingAffine, "outputs", autospec=True, side_effect=LeadingAffine.outputs) as updated:
        stacked = curve(net if update else hooked(net), features_per_step=1)
    assert updated.called == update
    assert stacked.shape == (2, 5, 5)
    torch.testing.assert_close(stacked, expected, rtol=0, atol=1e-12)


class ActsOnce(TensorDictModuleBase):
    """Reads a context and returns one action per sequence, in a TensorDict of the sequences' batch."""

    in_keys, out_keys = ["x"], ["act"]

    def forward(self, td):
        return TensorDict(act=td["x"].sum(-2), batch_size=td.batch_size[:1])


def test_an_output_without_the_batch_shape_is_refused_by_name():
    """A model that reads a ``[B, T]`` context and acts once per sequence: its output has no time dimension, so a
    ``[B, T]`` TensorDict has no score per sample; the error says which batch to give."""
    net = ActsOnce()
    td = TensorDict(x=torch.randn(3, 6, 2), attribution=TensorDict(x=torch.randn(3, 6, 2)), batch_size=[3, 6])
    with pytest.raises(ValueError, match=r"'act' of shape \[3, 2\] does not start with the TensorDict's batch shape"):
        pixel_flipping(net, td)
    flat = TensorDict(x=td["x"], attribution=TensorDict(x=td["attribution", "x"]), batch_size=[3])
    assert pixel_flipping(net, flat, features_per_step=4).shape == (3, 4)


def batch_normalised(first: str) -> nn.Module:
    """A model whose BatchNorm normalises each pass by the statistics of the batch it sees: in training mode, or
    without running statistics."""
    torch.manual_seed(5)
    if first == "linear":  # the first layer updated step by step, the layers after it on stacks
        layers = [nn.Flatten(), nn.Linear(48, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)]
    else:
        layers = [nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, track_running_stats=False), nn.ReLU(), nn.Flatten()]
        layers.append(nn.Linear(16, 3))
    return nn.Sequential(*layers).double().train(first == "linear")


def step_by_step(net: nn.Module, x: torch.Tensor, a: torch.Tensor, score, per_step: int):
    """The curve by its definition: one pass of the whole batch per step, ``per_step`` more features at 0 each,
    ``score(output)`` per sample."""
    ranks = torch.sort(a.flatten(1), dim=-1, descending=True, stable=True).indices.argsort(-1).view_as(a)
    with torch.no_grad():
        columns = [net(torch.where(ranks < k, 0.0, x)) for k in range(0, a[0].numel() + per_step, per_step)]
    return torch.stack([score(c) for c in columns], -1)


@pytest.mark.parametrize("first", ["linear", "convolution"])
def test_a_model_normalising_over_the_batch_sees_one_step_at_a_time(first):
    """Stacked steps would share their BatchNorm statistics (0.4 off the curve here): each step runs alone, as the
    batch it is, and an explicit stack of several steps is refused, naming the layer."""
    net = batch_normalised(first)
    x, a = torch.randn(4, 3, 4, 4, dtype=torch.float64), torch.randn(4, 3, 4, 4, dtype=torch.float64)
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[4])
    with torch.no_grad():
        target = net(x).argmax(-1)
    curve = pixel_flipping(net, td, in_keys=["x"], out_keys=["y"], features_per_step=8)
    expected = step_by_step(net, x, a, lambda y: y[torch.arange(4), target], 8)
    torch.testing.assert_close(curve, expected, rtol=0, atol=1e-12)
    name = "2 (BatchNorm1d)" if first == "linear" else "1 (BatchNorm2d)"
    with pytest.raises(ValueError, match=rf"module {re.escape(name)} normalises over the batch"):
        pixel_flipping(net, td, in_keys=["x"], out_keys=["y"], steps_per_forward=2)


def test_perturbations_scored_at_once_run_alone_through_a_model_normalising_over_the_batch():
    net = batch_normalised("convolution")
    x = torch.randn(3, 3, 4, 4, dtype=torch.float64)
    td = TensorDict(x=x, batch_size=[3])
    scorer = Scorer(net, td, in_keys=["x"], out_keys=["y"])
    stack = torch.randn(5, 3, 3, 4, 4, dtype=torch.float64)
    with torch.no_grad():
        expected = torch.stack([net(s)[torch.arange(3), scorer.target_index] for s in stack])
    torch.testing.assert_close(scorer.scores({"x": stack}), expected, rtol=0, atol=1e-12)


class Heads(nn.Module):
    """Splits the last dimension of its input into ``heads`` outputs of ``units`` each."""

    def __init__(self, heads: int, units: int) -> None:
        super().__init__()
        self.heads, self.units = heads, units

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.view(*h.shape[:-1], self.heads, self.units)


@pytest.mark.parametrize(
    ("target", "units"), [(None, 3), (2, 3), ("per head", 3), ("callable", 3), (None, 1), ("callable", 1)]
)
def test_an_output_with_more_dimensions_is_scored_as_the_methods_explain_it(target, units):
    """An output ``batch + [heads, units]``: the score is what the methods explain, the sum over every non-batch
    dimension of the output times the target's initial gradient (each head's argmax for ``None``)."""
    torch.manual_seed(6)
    net = nn.Sequential(nn.Flatten(), nn.Linear(48, 2 * units), nn.Tanh(), Heads(2, units)).double()
    x, a = torch.randn(4, 3, 4, 4, dtype=torch.float64), torch.randn(4, 3, 4, 4, dtype=torch.float64)
    td = TensorDict(x=x, attribution=TensorDict(x=a), batch_size=[4])
    with torch.no_grad():
        y = net(x)
    target = {"per head": torch.tensor([[0, 1], [2, 2], [1, 0], [0, 0]]), "callable": lambda o: o.exp()}.get(
        target, target
    )
    gradient = initial_gradient(y, target, "y", 1)
    expected = step_by_step(hooked(net), x, a, lambda out: (out * gradient).sum((-2, -1)), 8)
    for model in (net, hooked(net)):  # the first layer updated, and stacked passes
        curve = pixel_flipping(model, td, in_keys=["x"], out_keys=["y"], target=target, features_per_step=8)
        torch.testing.assert_close(curve, expected, rtol=0, atol=1e-12)


class Scaled(nn.Module):
    """Scales its inputs in place (``obs /= 255`` in a policy's forward), then a linear head over both."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        x.div_(2)
        s.mul_(3)
        return self.head(x.flatten(1) * s)


@pytest.mark.parametrize("steps_per_forward", [None, 1])
@pytest.mark.parametrize("as_module", [True, False], ids=["TensorDictModule", "plain module"])
def test_a_model_that_changes_its_inputs_in_place_is_given_copies(steps_per_forward, as_module):
    """The unperturbed pass and the one-step passes ran on the caller's tensors: the model halved the TensorDict's
    input (and tripled its fixed input at every step), and the curve was the one of those inputs."""
    torch.manual_seed(7)
    net = Scaled().double()
    x, s, a = (torch.randn(2, 3, 4, dtype=torch.float64) for _ in range(3))
    td = TensorDict(x=x.clone(), s=s[:, :1, 0].clone(), attribution=TensorDict(x=a), batch_size=[2])
    if as_module:
        model, kwargs = TensorDictModule(net, in_keys=["x", "s"], out_keys=["y"]), dict(in_keys=["x"])
    else:
        model, kwargs = net, dict(in_keys=["x", "s"], out_keys=["y"])
        td["attribution", "s"] = torch.full((2, 1), -torch.inf, dtype=torch.float64)  # ranked last
    before = td.clone()
    curve = pixel_flipping(model, td, features_per_step=4, steps_per_forward=steps_per_forward, **kwargs)
    assert (td == before).all()
    with torch.no_grad():
        target = net(x.clone(), before["s"].clone()).argmax(-1)
        expected = step_by_step(
            lambda perturbed: net(perturbed.clone(), before["s"].clone()), x, a, lambda y: y[torch.arange(2), target], 4
        )
    torch.testing.assert_close(curve[:, : expected.shape[1]], expected, rtol=0, atol=1e-12)


def test_an_explained_key_the_model_does_not_read_is_refused_by_name():
    """Perturbing a key the model never reads (a typo, or a key a pipeline writes before reading it) gave a flat
    curve, as if every feature were irrelevant."""
    policy = TensorDictModule(nn.Linear(4, 2), in_keys=["x"], out_keys=["y"])
    td = TensorDict(x=torch.randn(2, 4), z=torch.randn(2, 4), batch_size=[2])
    td["attribution"] = TensorDict(x=torch.randn(2, 4), z=torch.randn(2, 4), batch_size=[2])
    with pytest.raises(
        ValueError, match=r"metrics: in_keys \['z'\] are not inputs of the model \(its in_keys: \['x'\]\)"
    ):
        pixel_flipping(policy, td, in_keys=["z"])
    pipeline = TensorDictSequential(
        TensorDictModule(nn.Linear(4, 4), in_keys=["x"], out_keys=["z"]),
        policy.__class__(nn.Linear(4, 2), ["z"], ["y"]),
    )
    with pytest.raises(ValueError, match=r"in_keys \['z'\] are not inputs of the model"):
        pixel_flipping(pipeline, td, in_keys=["x", "z"])


@pytest.mark.parametrize("states", [False, True], ids=["no-states", "states"])
def test_a_recurrent_policys_default_keys_are_those_lrp_explains(states):
    """By default the metrics perturb the inputs LRP explains by default: not ``is_init`` (a flag), nor the
    recurrent states of an LSTMModule/GRUModule the TensorDict does not hold (the module starts from zeros)."""
    from torchrl.modules import MLP, GRUModule

    from tdhook.attribution import LRP
    from tdhook.metrics import action_fidelity

    torch.manual_seed(0)
    rnn = GRUModule(input_size=4, hidden_size=6, in_key="observation", out_key="embed").double()
    head = TensorDictModule(MLP(in_features=6, out_features=3, num_cells=[8]).double(), ["embed"], ["action_value"])
    policy = TensorDictSequential(rnn, head)
    td = TensorDict(
        observation=torch.randn(5, 4, dtype=torch.float64), is_init=torch.zeros(5, 1, dtype=torch.bool), batch_size=[5]
    )
    if states:
        td["recurrent_state"] = torch.randn(5, 1, 6, dtype=torch.float64)
    explained = LRP(policy, relevance_key="attribution")(td)
    keys = ["observation", "recurrent_state"] if states else ["observation"]
    assert set(explained["attribution"].keys()) == set(keys)
    for metric in (
        lambda **kw: action_fidelity(policy, explained, k=2, n_random=3, seed=0, progress=False, **kw),
        lambda **kw: pixel_flipping(policy, explained, progress=False, **kw),
    ):
        by_default, by_name = metric(), metric(in_keys=keys)
        if isinstance(by_name, TensorDict):
            by_default, by_name = by_default.to_dict(), by_name.to_dict()
        torch.testing.assert_close(by_default, by_name)


class _MaskedSum(nn.Module):
    """A linear layer on the sum of the positions an integer mask keeps (an attention mask as Hugging Face gives it)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.linear((x * mask.unsqueeze(-1)).sum(1))


def test_an_integer_mask_is_held_as_it_is_by_default_as_lrp_leaves_it_out():
    """LRP's default keys leave out an integer mask no embedding reads, and the relevance it writes holds none for it;
    the metrics' default keys then refused its output, the mask being no floating-point input. By default they hold
    an integer input as it is (it takes no baseline value), as with in_keys naming the floating-point keys; where only
    integer inputs remain, the check still names them."""
    from tdhook.attribution import LRP, EpsilonPlus
    from tdhook.metrics import faithfulness_correlation, region_perturbation

    torch.manual_seed(0)
    model = TensorDictModule(_MaskedSum().double(), in_keys=["x", "mask"], out_keys=["y"])
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[0, 3:] = 0
    td = TensorDict(x=torch.randn(2, 5, 4, dtype=torch.float64), mask=mask, batch_size=[2])
    explained = LRP(model, EpsilonPlus())(td)
    assert list(explained["relevance"].keys()) == ["x"]
    for metric in (
        lambda **kw: pixel_flipping(model, explained, relevance_key="relevance", progress=False, **kw),
        lambda **kw: region_perturbation(model, explained, patch_size=2, relevance_key="relevance", **kw),
        lambda **kw: faithfulness_correlation(
            model, explained, n_runs=4, subset_size=3, seed=0, relevance_key="relevance", **kw
        ),
    ):
        torch.testing.assert_close(metric(), metric(in_keys=["x"]), rtol=0, atol=0)
    tokens = TensorDictModule(nn.Embedding(6, 3).double(), in_keys=["ids"], out_keys=["y"])
    ids = TensorDict(ids=torch.tensor([[1, 2], [3, 4]]), attribution=TensorDict(ids=torch.ones(2, 2)), batch_size=[2])
    with pytest.raises(TypeError, match="input key 'ids' must be a floating-point tensor"):
        pixel_flipping(tokens, ids, progress=False)


def test_a_policy_in_recurrent_mode_over_steps_is_refused_naming_its_recurrent_module():
    """In recurrent mode the last batch dimension is time: perturbing every step at once would change each step's
    action through the steps before it as well (0.31 of the actions changed for k=1 against 0.21 one step at a
    time, on a random GRU policy); the steps are scored one by one outside recurrent mode instead."""
    from torchrl.modules import MLP, GRUModule, set_recurrent_mode

    from tdhook.attribution import LRP
    from tdhook.metrics import action_fidelity

    torch.manual_seed(0)
    rnn = GRUModule(input_size=4, hidden_size=6, in_key="observation", out_key="embed").double()
    head = TensorDictModule(MLP(in_features=6, out_features=3, num_cells=[8]).double(), ["embed"], ["action_value"])
    policy = TensorDictSequential(rnn, head)
    td = TensorDict(
        observation=torch.randn(2, 5, 4, dtype=torch.float64),
        is_init=torch.zeros(2, 5, 1, dtype=torch.bool),
        batch_size=[2, 5],
    )
    td["is_init"][:, 0] = True
    with set_recurrent_mode(True):
        explained = LRP(policy, relevance_key="attribution")(td)
        with pytest.raises(ValueError, match=r"GRUModule 'module.0' runs in recurrent mode"):
            action_fidelity(policy, explained, k=1, progress=False)
        with pytest.raises(ValueError, match=r"GRUModule 'module.0' runs in recurrent mode"):
            pixel_flipping(policy, explained, progress=False)
    steps = TensorDict(  # one step per sample, with the state the rollout stored: the steps are independent
        observation=td["observation"][:, 1], is_init=td["is_init"][:, 1], batch_size=[2]
    ).set("recurrent_state", torch.randn(2, 1, 6, dtype=torch.float64))
    explained = LRP(policy, relevance_key="attribution")(steps)
    assert 0 <= action_fidelity(policy, explained, k=1, progress=False)["relevant"] <= 1


def assert_scored_alike_for_any_seed(net: torch.nn.Module, td: TensorDict) -> None:
    """Pixel flipping gives ``net`` the same curve whatever the global random state."""
    torch.manual_seed(0)
    first = pixel_flipping(net, td, in_keys=["x"], out_keys=["y"])
    torch.manual_seed(1)
    torch.testing.assert_close(pixel_flipping(net, td, in_keys=["x"], out_keys=["y"]), first, rtol=0, atol=0)


def test_rrelu_in_training_mode_is_refused_by_name():
    """nn.RReLU in training mode draws each negative slope anew at every forward pass: each perturbed input's score
    carried its own slopes (pixel flipping's curve moved by 0.26, half its range, with the global seed), without
    a word. In eval mode (a fixed slope), or with lower == upper, it is scored."""
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.RReLU(0.1, 0.9), torch.nn.Linear(16, 3))
    x = torch.randn(4, 6)
    td = TensorDict(x=x, attribution=TensorDict(x=x), batch_size=[4])
    expected = r"metrics: module '1' \(RReLU, negative slopes drawn from \[0.1, 0.9\]\) is in training mode"
    with pytest.raises(ValueError, match=expected):
        pixel_flipping(net, td, in_keys=["x"], out_keys=["y"])
    net.eval()
    assert_scored_alike_for_any_seed(net, td)
    net.train()
    net[1].upper = 0.1
    assert pixel_flipping(net, td, in_keys=["x"], out_keys=["y"]).shape == (4, 7)


@pytest.mark.parametrize("kind", ["MultiheadAttention", "LSTM"])
def test_a_layer_with_a_dropout_probability_of_its_own_is_refused_by_name_in_training_mode(kind):
    """nn.MultiheadAttention's attention dropout and an nn.LSTM's dropout between its layers are no Dropout module:
    in training mode each perturbed input's score carried its own draws (pixel flipping's curve moved by 0.65 and
    0.23 of its norm from seed to seed), without a word."""
    from tests.attribution.methods.test_base import SequenceNet

    net = SequenceNet(kind).double().train()
    x = torch.randn(4, 5, dtype=torch.float64)
    td = TensorDict(x=x, attribution=TensorDict(x=x), batch_size=[4])
    what = "attention dropout p=0.5" if kind == "MultiheadAttention" else "dropout p=0.5 between layers"
    with pytest.raises(ValueError, match=rf"metrics: module 'layer' \({kind}, {what}\) is in training mode"):
        pixel_flipping(net, td, in_keys=["x"], out_keys=["y"])
    net.eval()
    assert_scored_alike_for_any_seed(net, td)


def test_fractional_max_pooling_is_refused_by_name_in_eval_mode_too():
    """nn.FractionalMaxPool2d draws its pooling regions at every forward pass, in eval mode too: each perturbed
    input's score carried its own regions (pixel flipping's curve moved by 0.62 of its norm from seed to seed),
    without a word. With its regions fixed by ``_random_samples`` it is scored, the same for any seed."""
    pool = torch.nn.FractionalMaxPool2d(2, output_size=2)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3, padding=1), pool, torch.nn.Flatten(), torch.nn.Linear(8, 3))
    net = net.double().eval()
    x = torch.randn(4, 1, 4, 4, dtype=torch.float64)
    td = TensorDict(x=x, attribution=TensorDict(x=x), batch_size=[4])
    expected = r"metrics: module '1' \(FractionalMaxPool2d, pooling regions drawn at random\) draws in eval mode too"
    with pytest.raises(ValueError, match=expected):
        pixel_flipping(net, td, in_keys=["x"], out_keys=["y"])
    pool._random_samples = torch.rand(4096, 2, 2, dtype=torch.float64)  # rows for every stack of perturbed inputs
    assert_scored_alike_for_any_seed(net, td)


@pytest.mark.parametrize("as_module", [False, True])
def test_dropout_in_training_mode_is_refused_by_name(as_module):
    """Each perturbed input drew its own dropout mask: two runs of a curve differed by 0.6, and the global random
    state moved. A model in eval mode, or a dropout that drops nothing, is scored."""
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(16, 3))
    x = torch.randn(4, 6)
    td = TensorDict(x=x, attribution=TensorDict(x=x), batch_size=[4])
    model = TensorDictModule(net, in_keys=["x"], out_keys=["y"]) if as_module else net
    keys = {} if as_module else {"in_keys": ["x"], "out_keys": ["y"]}
    name = "module.2" if as_module else "2"
    rng = torch.get_rng_state()
    with pytest.raises(ValueError, match=rf"metrics: module '{name}' \(Dropout, p=0.5\) is in training mode"):
        pixel_flipping(model, td, **keys)
    assert torch.equal(torch.get_rng_state(), rng)
    net.eval()
    torch.testing.assert_close(pixel_flipping(model, td, **keys), pixel_flipping(model, td, **keys), rtol=0, atol=0)
    net.train()
    net[2].p = 0.0
    pixel_flipping(model, td, **keys)


def test_an_actor_critic_without_target_key_is_refused_by_name():
    """LRP explains both heads of an ActorValueOperator by default; a metric scores one (it raised KeyError: None)."""
    from torchrl.modules import ActorValueOperator, OneHotCategorical, ProbabilisticActor, ValueOperator

    common = TensorDictModule(nn.Linear(4, 8), ["observation"], ["hidden"])
    logits = TensorDictModule(nn.Linear(8, 3), ["hidden"], ["logits"])
    actor = ProbabilisticActor(logits, in_keys=["logits"], distribution_class=OneHotCategorical)
    operator = ActorValueOperator(common, actor, ValueOperator(nn.Linear(8, 1), in_keys=["hidden"]))
    x = torch.randn(5, 4)
    td = TensorDict(observation=x, relevance=TensorDict(actor=TensorDict(observation=x)), batch_size=[5])
    with pytest.raises(ValueError, match=r"ActorValueOperator has several outputs to score by default \(\['actor'"):
        pixel_flipping(operator, td, relevance_key=("relevance", "actor"))
    curve = pixel_flipping(operator, td, relevance_key=("relevance", "actor"), target_key="logits")
    assert curve.shape == (5, 5)


def test_the_models_own_draws_leave_the_global_rng_and_a_sampled_target_is_refused():
    """An EGreedyModule after the actor drew from the caller's global random state at every pass; a sampled action
    as the target was drawn anew at every pass (two curves 1.9 apart)."""
    from tensordict.nn import NormalParamExtractor
    from torchrl.data import OneHot
    from torchrl.envs.utils import ExplorationType, set_exploration_type
    from torchrl.modules import EGreedyModule, ProbabilisticActor, QValueActor, TanhNormal

    from tdhook.metrics import action_fidelity, faithfulness_correlation, infidelity

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)).double()
    actor = QValueActor(net, in_keys=["observation"], spec=OneHot(3), action_space="one_hot")
    policy = TensorDictSequential(actor, EGreedyModule(spec=OneHot(3), eps_init=0.5))
    x = torch.randn(4, 6, dtype=torch.float64)
    td = TensorDict(observation=x, attribution=TensorDict(observation=x), batch_size=[4])
    rng = torch.get_rng_state()
    pixel_flipping(policy, td)
    action_fidelity(policy, td, k=2, seed=0)
    faithfulness_correlation(policy, td, n_runs=3, subset_size=2, seed=0)
    infidelity(policy, td, perturb_fn=lambda t: (t.apply(torch.zeros_like), t))
    assert torch.equal(torch.get_rng_state(), rng)

    body = nn.Sequential(nn.Linear(6, 4), NormalParamExtractor()).double()
    params = TensorDictModule(body, ["observation"], ["loc", "scale"])
    sampler = ProbabilisticActor(params, in_keys=["loc", "scale"], distribution_class=TanhNormal)
    with set_exploration_type(ExplorationType.RANDOM):
        with pytest.raises(ValueError, match=r"target 'action' is sampled from the TanhNormal distribution"):
            pixel_flipping(sampler, td, target_key="action")
        pixel_flipping(sampler, td, target_key="loc")
    pixel_flipping(sampler, td, target_key="action")  # deterministic by default: the distribution's mode


def test_a_callable_target_with_relevance_on_a_zero_output_is_refused_by_name():
    """Its weight there was 0: the curve started at sum(target(y)) minus that relevance, without a word."""
    net = nn.Sequential(nn.Linear(3, 2), nn.ReLU())
    with torch.no_grad():
        net[0].weight.copy_(torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]]))
        net[0].bias.zero_()
    x = torch.ones(2, 3)  # outputs [3, 0]
    td = TensorDict(x=x, attribution=TensorDict(x=x), batch_size=[2])
    keys = {"in_keys": ["x"], "out_keys": ["y"]}
    with pytest.raises(ValueError, match=r"target puts relevance on 2 entries of output 'y' that are exactly 0"):
        pixel_flipping(net, td, target=lambda y: torch.ones_like(y), **keys)
    curve = pixel_flipping(net, td, target=lambda y: y * torch.tensor([1.0, 2.0]), **keys)
    torch.testing.assert_close(curve[:, 0], torch.full((2,), 3.0))


class _HoldsATensorDictModule(nn.Module):
    """A plain model with a TensorDict module inside (called on tensors through its own module)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = TensorDictModule(nn.Linear(4, 3), in_keys=["h"], out_keys=["q"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.module(x)


@pytest.mark.parametrize("holds", [False, True])
def test_a_plain_model_is_searched_for_torchrls_modules_only_where_it_holds_a_tensordict_module(holds):
    """Torchrl's recurrent, sampling, Q-value and masked modules are TensorDict modules: a plain model that holds none
    is not searched for them (and scores the argmax as before); one that holds one is."""
    torch.manual_seed(0)
    net = _HoldsATensorDictModule() if holds else nn.Linear(4, 3)
    x = torch.randn(5, 4)
    td = TensorDict(x=x, batch_size=[5])
    searches = ["_refuse_steps_read_together", "_refuse_sampled_target", "chosen_action", "_taken_action"]
    with mock.patch.multiple("tdhook.metrics._scoring", **{name: mock.DEFAULT for name in searches}) as found:
        for name in ("chosen_action", "_taken_action"):
            found[name].return_value = None
        scorer = Scorer(net, td, in_keys=["x"], out_keys=["y"])
    assert all(found[name].called == holds for name in searches)
    assert scorer.allowed is None and torch.equal(scorer.target_index, net(x).argmax(-1))
    torch.testing.assert_close(scorer.reference, net(x).max(-1).values)


def test_stochastic_depth_in_training_mode_is_refused_by_name():
    """timm's DropPath drops a sample's residual branch at random in training mode, as dropout drops units."""
    from timm.layers import DropPath

    class Residual(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.drop, self.head = torch.nn.Linear(6, 6), DropPath(0.5), torch.nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(x + self.drop(torch.relu(self.fc(x))))

    net, x = Residual(), torch.randn(4, 6)
    td = TensorDict(x=x, attribution=TensorDict(x=x), batch_size=[4])
    with pytest.raises(ValueError, match=r"metrics: module 'drop' \(DropPath, p=0.5\) is in training mode"):
        pixel_flipping(net, td, in_keys=["x"], out_keys=["y"])
    net.eval()
    pixel_flipping(net, td, in_keys=["x"], out_keys=["y"])


@pytest.mark.parametrize("layer", [0, 2])
def test_a_weight_on_the_meta_device_is_named(layer):
    """torch computes a linear layer from a weight on the meta device and returns what the memory held (a curve
    running to 86 for outputs below 1, or a flat one, before): refused as the methods refuse it, naming the
    module, whether the curve runs through the leading layer's sums or the model's own passes."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    net[layer].weight = nn.Parameter(torch.empty_like(net[layer].weight, device="meta"))
    td = TensorDict(x=torch.randn(5, 3), attribution=TensorDict(x=torch.randn(5, 3), batch_size=[5]), batch_size=[5])
    expected = rf"^metrics: the module '{layer}' \(Linear\) holds its parameter 'weight' on the meta device"
    with pytest.raises(ValueError, match=expected):
        pixel_flipping(net, td, in_keys=["x"], out_keys=["y"])
    assert not any(m._forward_hooks for m in net.modules())


def test_a_trajectory_read_as_time_scores_one_step_per_pass():
    """A TensorDict of one trajectory ``[6]`` fed to a plain GRU, which reads the batch's dimension as time: the
    stacked steps of a curve ran as one sequence, each starting from the state the step before it left (pixel
    flipping off by 0.0072 here, by 0.066 for random attributions where its scores reach 0.32; faithfulness
    correlation by 0.88). The first stack shows it, and the steps then run one per pass: the definition."""
    from tdhook.metrics import faithfulness_correlation

    net = Trajectory().double()
    x = torch.randn(6, 3, dtype=torch.float64)
    ranked = torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64).expand(6, 3)  # the features in index order
    td = TensorDict(x=x, attribution=TensorDict(x=ranked), batch_size=[6])
    keys = {"in_keys": ["x"], "out_keys": ["y"], "target": 0}
    with torch.no_grad():  # the definition: one pass per step
        expected = torch.stack([net(torch.where(torch.arange(3) < k, 0.0, x))[:, 0] for k in range(4)], -1)
    torch.testing.assert_close(pixel_flipping(net, td, **keys), expected, rtol=0, atol=1e-12)
    td["attribution", "x"] = torch.randn(6, 3, dtype=torch.float64)
    correlation = {"n_runs": 10, "subset_size": 2, "seed": 0, **keys}
    expected = faithfulness_correlation(net, td, steps_per_forward=1, **correlation)
    torch.testing.assert_close(faithfulness_correlation(net, td, **correlation), expected, rtol=0, atol=1e-12)
    assert not net.rnn._forward_pre_hooks


def test_a_trajectory_read_as_time_after_a_leading_linear_layer_scores_one_step_per_pass():
    """The same GRU after a leading nn.Linear, whose output the curve updates from step to step: the layers after it
    ran the stacked steps as one sequence (pixel flipping off by 0.21, in its unperturbed score too). A model with a
    recurrent layer takes the stacked passes, which see it; the scores are those of one pass per step."""

    class Recurrent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.GRU(5, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.rnn(x)[0]

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 5), Recurrent(), nn.Linear(4, 2)).double()
    x = torch.randn(6, 3, dtype=torch.float64)
    ranked = torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64).expand(6, 3)  # the features in index order
    td = TensorDict(x=x, attribution=TensorDict(x=ranked), batch_size=[6])
    with torch.no_grad():  # the definition: one pass per step
        expected = torch.stack([net(torch.where(torch.arange(3) < k, 0.0, x))[:, 0] for k in range(4)], -1)
    got = pixel_flipping(net, td, in_keys=["x"], out_keys=["y"], target=0)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("step", ["AdditiveGaussianModule", "OrnsteinUhlenbeckProcessModule"])
def test_an_action_an_exploration_step_perturbs_is_refused_by_name(step):
    """An exploration step after the actor drew new noise at every pass while exploration is random or unset (as in
    env.rollout): the pixel-flipping curve of the noisy action was 1.3 off the actor's action's, without a word."""
    import torchrl.modules
    from torchrl.data import Bounded
    from torchrl.envs.utils import ExplorationType, set_exploration_type
    from torchrl.modules import Actor

    torch.manual_seed(0)
    spec = Bounded(-2.0, 2.0, (1,), dtype=torch.float64)
    actor = Actor(nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).double(), ["observation"], spec=spec)
    policy = TensorDictSequential(actor, getattr(torchrl.modules, step)(spec=spec))
    x = torch.randn(4, 3, dtype=torch.float64)
    td = TensorDict(
        observation=x,
        is_init=torch.zeros(4, 1, dtype=torch.bool),
        attribution=TensorDict(observation=x),
        batch_size=[4],
    )
    for mode in (None, ExplorationType.RANDOM):
        with (
            set_exploration_type(mode),
            pytest.raises(ValueError, match=f"target 'action' is perturbed by module 'module.1' \\({step}\\)"),
        ):
            pixel_flipping(policy, td, target_key="action", in_keys=["observation"])
    expected = pixel_flipping(actor, td, target_key="action", in_keys=["observation"])
    with set_exploration_type(ExplorationType.DETERMINISTIC):  # the step adds nothing
        got = pixel_flipping(policy, td, target_key="action", in_keys=["observation"])
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:LRP. module .* computes log_softmax")
def test_a_distributional_q_actor_is_scored_at_its_greedy_action_at_every_atom():
    """Its action values are ``[batch, atoms, actions]``: the curve scored the action most likely at each atom (a mix
    of actions; the curve was up to 1.27 off on this batch), where the methods explain the greedy action."""
    from tdhook.attribution import Saliency
    from tests.attribution.test_policy_targets import distributional_actor, greedy_distributional

    actor = distributional_actor()
    td = TensorDict(
        observation=torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1)), batch_size=[6]
    )
    explained = Saliency(actor, target_key="action_value")(td.clone())
    greedy = greedy_distributional(explained, actor.support)
    assert (explained["action_value"].argmax(-1) != greedy).any()
    curve = pixel_flipping(actor, explained, target_key="action_value")
    expected = pixel_flipping(actor, explained, target_key="action_value", target=greedy)
    torch.testing.assert_close(curve, expected)


@pytest.mark.parametrize("metric", ["pixel_flipping", "faithfulness_correlation"])
def test_a_target_the_model_draws_in_its_own_forward_is_refused_naming_the_module(metric):
    """torchrl's RSSMPrior samples its state (``mean + torch.randn_like(std) * std``): a curve of it mixed the
    perturbation with new draws (with the baseline equal to the input, where the curve is flat, it moved by up to 1.8
    where the score is at most 0.78, with no word). Its mean, computed before the draw, is scored as before; the
    caller's TensorDict is left as it was."""
    import tdhook.metrics
    from tdhook.attribution import Saliency
    from tests.attribution.methods.test_random_draws import PRIOR_MEAN, STATE, inputs, rssm_prior

    prior = rssm_prior()
    options = {"subset_size": 4, "n_runs": 4} if metric == "faithfulness_correlation" else {}
    score = functools.partial(getattr(tdhook.metrics, metric), **options)
    explained = Saliency(prior, target_key=STATE, target=0)(inputs())
    before = explained.clone()
    with pytest.raises(
        ValueError,
        match=r"target \('next', 'state'\) differs between two forward passes on the same "
        r"input .*module 'module' \(RSSMPrior\) drew at random in its own forward",
    ):
        score(prior, explained, target_key=STATE, target=0)
    assert (explained == before).all()
    mean = Saliency(prior, target_key=PRIOR_MEAN, target=0)(inputs())
    assert torch.isfinite(score(prior, mean, target_key=PRIOR_MEAN, target=0)).all()


@pytest.mark.parametrize("steps_per_forward", [None, 1])
def test_a_drawn_target_is_refused_where_the_curve_runs_through_the_leading_linear_layer(steps_per_forward):
    """A model that starts with a linear layer scores step 0 with the other steps (``steps_per_forward=None``): the
    draws of that pass are checked as those of a pass of its own; a model that draws nothing runs no extra pass."""

    class Noisy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.randn_like(x)

    torch.manual_seed(0)
    layers = [nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)]
    x = torch.randn(5, 4, dtype=torch.float64)
    td = TensorDict(
        x=x, attribution=TensorDict(x=torch.randn(5, 4, dtype=torch.float64), batch_size=[5]), batch_size=[5]
    )
    noisy = nn.Sequential(*layers, Noisy()).double()
    with pytest.raises(ValueError, match=r"target 'y' differs between two forward passes.*module '3' \(Noisy\) drew"):
        pixel_flipping(noisy, td, in_keys=["x"], out_keys=["y"], target=0, steps_per_forward=steps_per_forward)
    plain, passes = nn.Sequential(*layers).double(), []
    plain.register_forward_hook(lambda *_: passes.append(1))
    pixel_flipping(plain, td, in_keys=["x"], out_keys=["y"], target=0, steps_per_forward=steps_per_forward)
    expected = []
    bare = nn.Sequential(*layers).double()
    bare.register_forward_hook(lambda *_: expected.append(1))
    with mock.patch("tdhook.metrics._scoring.redrawn", return_value=None):
        pixel_flipping(bare, td, in_keys=["x"], out_keys=["y"], target=0, steps_per_forward=steps_per_forward)
    assert len(passes) == len(expected)


@pytest.mark.parametrize("metric", ["pixel_flipping", "infidelity"])
def test_similarities_scored_across_stacked_steps_score_one_step_per_pass(metric):
    """A model returning the ``[B, B]`` similarities of two batches of images (as CLIP's ``logits_per_image``) returns
    ``[S * B, S * B]`` for ``S`` stacked steps, and the target index picked the first step's images for every step:
    pixel flipping's curve was 0.87 off (3.9 %, of about 22) at its later steps, infidelity 66 off (20 %). The
    stacked pass shows it, and the steps are scored one per pass, as the definition (one step per pass) has them."""
    module, td = similarity(), image_pairs()
    draws = torch.Generator().manual_seed(3)
    for key in ("a", "b"):
        td["attribution", key] = torch.randn(3, 1, 8, 8, dtype=torch.float64, generator=draws)
    if metric == "pixel_flipping":
        found = pixel_flipping(module, td, features_per_step=32)
        expected = pixel_flipping(module, td, features_per_step=32, steps_per_forward=1)
    else:
        noise = {key: torch.randn(3, 4, 3, 8, 8, dtype=torch.float64, generator=draws) for key in ("a", "b")}

        def perturb(repeated):
            perturbation = TensorDict(noise, batch_size=repeated.batch_size)
            return perturbation, repeated - perturbation

        found = infidelity(module, td, perturb_fn=perturb, n_perturb_samples=4)
        alone = []
        for k in range(4):  # each draw of the batch in a pass of its own

            def one(repeated, k=k):
                perturbation = TensorDict({key: value[:, k : k + 1] for key, value in noise.items()}, [3, 1])
                return perturbation, repeated - perturbation

            alone.append(infidelity(module, td, perturb_fn=one, n_perturb_samples=1))
        expected = torch.stack(alone).mean(0)
    torch.testing.assert_close(found, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_attention_dropout_in_training_mode_is_refused(implementation):
    """A Llama with attention dropout holds no Dropout module: its attention calls ``F.dropout`` (eager) or passes
    ``dropout_p`` to the fused attention (sdpa). In training mode every perturbed input was scored with its own
    dropout, without a word (the curve 0.13 off that of the model in eval mode, whose largest score is 0.37), as a
    Dropout module's is refused. A model in eval mode is scored."""
    module, td = next_token(implementation, attention_dropout=0.3), next_token_td()
    td["attribution", "embeds"] = torch.randn(3, 6, 1, generator=torch.Generator().manual_seed(2))
    rng = torch.get_rng_state()
    with pytest.raises(ValueError, match=r"metrics: the forward pass calls dropout \(p=0.3\) in training mode"):
        pixel_flipping(module.train(), td, in_keys=["embeds"])
    assert torch.equal(torch.get_rng_state(), rng)
    curve = pixel_flipping(module.eval(), td, in_keys=["embeds"])
    torch.testing.assert_close(pixel_flipping(module, td, in_keys=["embeds"]), curve, rtol=0, atol=0)


@pytest.mark.parametrize("target_key", [["y"], ("y", 0)], ids=["list", "tuple-with-int"])
def test_a_target_key_that_is_no_key_is_named_as_the_metrics(target_key):
    """The check is the wrapper's; its message named LRP where a metric was called."""
    net = nn.Linear(6, 3).double()
    td = TensorDict(x=torch.randn(4, 6, dtype=torch.float64), batch_size=[4])
    td["attribution"] = TensorDict(x=torch.randn(4, 6, dtype=torch.float64), batch_size=[4])
    before = {k: v for k, v in td.items(True, True)}
    with pytest.raises(TypeError, match=r"^metrics: target_key must be a key \(a str or a tuple of str\)"):
        pixel_flipping(net, td, in_keys=["x"], out_keys=["y"], target_key=target_key)
    assert {k: v for k, v in td.items(True, True)}.keys() == before.keys()
    assert all(td.get(k) is v for k, v in before.items())


@pytest.mark.parametrize("target", [0, 3, torch.tensor([7, 7, 7])], ids=["0", "3", "tensor"])
@pytest.mark.parametrize("metric", ["pixel_flipping", "faithfulness_correlation"])
def test_an_index_target_on_an_output_with_no_unit_dimension_is_refused_as_the_methods_refuse_it(metric, target):
    """A value head squeezed to ``[B]`` has no unit to index: the metrics scored the output itself whatever the
    target named (even out of range), where every method raises; they raise the same error, naming the output."""
    from tdhook.attribution import Saliency
    from tdhook.metrics import faithfulness_correlation

    value_head = nn.Sequential(nn.Linear(5, 1), nn.Flatten(0)).double()
    x = torch.randn(3, 5, dtype=torch.float64)
    td = TensorDict(x=x, attribution=TensorDict(x=torch.randn(3, 5, dtype=torch.float64)), batch_size=[3])
    score = {"pixel_flipping": pixel_flipping, "faithfulness_correlation": faithfulness_correlation}[metric]
    options = {"n_runs": 3, "subset_size": 2, "seed": 0} if metric == "faithfulness_correlation" else {}
    with pytest.raises(ValueError) as method_error:
        Saliency(value_head, in_keys=["x"], out_keys=["v"], target=target)(td.clone())
    expected = str(method_error.value).replace("Saliency:", "metrics:", 1)
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        score(value_head, td, in_keys=["x"], out_keys=["v"], target=target, **options)
    curve = pixel_flipping(value_head, td, in_keys=["x"], out_keys=["v"])  # no target: the value itself
    torch.testing.assert_close(curve[:, 0], value_head(x).detach(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("target", [1.0, "all"])
def test_a_target_of_another_kind_is_refused_listing_only_what_the_metrics_accept(target):
    """A float's message listed 'all', which the metrics refuse (one unit's score each)."""
    td = TensorDict(x=torch.randn(2, 4), attribution=TensorDict(x=torch.randn(2, 4)), batch_size=[2])
    accepted = "metrics: target must be None, an int, a LongTensor or a callable, got "
    with pytest.raises((TypeError, ValueError), match=f"^{re.escape(accepted)}(float|'all')$"):
        pixel_flipping(nn.Linear(4, 3), td, in_keys=["x"], out_keys=["y"], target=target)


class SquashedLogits(nn.Sequential):
    """An ``nn.Sequential`` with a method of its own that a ``TensorDictModule`` calls in place of its forward."""

    def squashed(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(super().forward(x)) * 3.0


def test_a_sequential_called_through_another_method_is_scored_through_that_method():
    """``TensorDictModule(net, ..., method="squashed")`` calls ``net.squashed``: a curve through the leading linear
    layer's sums ran ``nn.Sequential``'s forward after it instead, without the squashing (0.6 off). The same function
    as a plain module, whose first layer is no leading linear layer of an ``nn.Sequential``, is the reference."""

    class Plain(nn.Module):
        def __init__(self, net: SquashedLogits) -> None:
            super().__init__()
            self.net = net

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net.squashed(x)

    torch.manual_seed(0)
    net = SquashedLogits(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3)).double()
    td = TensorDict(x=torch.randn(5, 8, dtype=torch.float64), batch_size=[5])
    td["attribution", "x"] = torch.randn(5, 8, dtype=torch.float64)
    for steps in (1, 2):
        got = pixel_flipping(TensorDictModule(net, ["x"], ["y"], method="squashed"), td, features_per_step=steps)
        expected = pixel_flipping(TensorDictModule(Plain(net), ["x"], ["y"]), td, features_per_step=steps)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def _rows_classifier() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3), nn.LogSoftmax(dim=1)).double().eval()


@pytest.mark.parametrize("wrapped", [False, True])
def test_the_steps_of_a_batch_of_none_are_scored_at_the_samples_shape(wrapped):
    """A batch [] holds one sample, ``[rows, classes]`` here, which a classifier normalises over ``dim=1``; stacked
    steps are a new first dimension of it, over which that softmax then ran (1.6 off direct passes at the first
    step, no warning: ``nn.LogSoftmax(dim=1)`` was vouched for as it is on a batch of samples)."""
    net = _rows_classifier()
    model = nn.Sequential(net) if not wrapped else TensorDictModule(net, ["x"], ["y"])
    x = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    attribution = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    target = net(x).argmax(-1)
    td = TensorDict(x=x, attribution=TensorDict(x=attribution, batch_size=[]), batch_size=[])
    keys = {} if wrapped else {"in_keys": ["x"], "out_keys": ["y"]}
    curve = pixel_flipping(model, td, **keys, target=target, features_per_step=5, progress=False)
    order = torch.sort(-attribution.flatten(), stable=True).indices
    expected = []
    with torch.no_grad():
        for k in range(5):
            gone = torch.zeros(20, dtype=torch.bool)
            gone[order[: 5 * k]] = True
            expected.append(net(torch.where(gone.view(4, 5), 0.0, x)).gather(1, target[:, None]).sum())
    assert torch.allclose(curve, torch.stack(expected), rtol=1e-12, atol=1e-12)
