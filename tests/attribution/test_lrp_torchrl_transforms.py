"""Every transform class of ``torchrl.envs.transforms``, put before a tiny float64 head in the explained policy.

Users move an environment's transforms into the policy (``TensorDictSequential(ObservationNorm(...), actor)``, or
``env.transform`` before the actor) so that relevance lands on the raw observation. Each class is listed once below
with what LRP does with it, and the test holds it to that:

* ``LRP0``: LRP-0 (the default rules with no stabilizer) equals gradient × input on every raw key, shaped like it, the
  policy's output is the plain one and the transform's state is left as a plain call leaves it, with no word;
* ``CONSERVES``: with every bias zeroed, the ε-rule with ε = 0 conserves the explained value, with no word (a clip:
  the pass rule of clipping calls);
* ``WARNS``: a warning naming the transform (its path and class) and what its plain gradient misses;
* ``RAISES``: an error saying what is refused;
* ``CHECKED``: held to tests of its own, named in the reason (``VecNorm``: statistics moved once and held constant);
* ``NOT_EXPLAINED``: no part of an explained policy (a base class, an environment, a transform of rewards or actions,
  or of the environment's flow), with the reason; where the reason claims a behaviour (its forward refuses to run
  outside an environment), a check holds it.

A class of a newer torchrl in none of these lists fails :func:`test_every_transform_class_is_listed`.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torchrl.envs.transforms as T
from tensordict import TensorDict
from tensordict.nn import TensorDictModule, TensorDictModuleBase, TensorDictSequential
from tensordict.utils import NestedKey
from torch import nn

from tdhook.attribution import LRP, BaseRuleMapper, EpsilonRule
from tdhook.attribution._keys import as_tuple
from tdhook.attribution.lrp_helpers.rules import EpsilonAlpha2Beta1, EpsilonPlus, EpsilonPlusFlat
from tests.attribution.test_lrp_torchrl_catalogue import _gradient_times_input
from tests.attribution.test_lrp_world_models import zero_biases

F64 = torch.float64
LRP0, CONSERVES, WARNS, RAISES, CHECKED = "LRP-0", "conserves", "warns", "raises", "checked"
NOT_EXPLAINED = "not explained"
Built = tuple[TensorDictModuleBase, TensorDict, NestedKey]


@dataclass(frozen=True)
class Case:
    """What LRP does with a transform class; ``build`` makes a policy with it, its input and the key to explain."""

    outcome: str
    build: Callable[[], Built] | None = None
    reason: str = ""
    check: Callable[[], None] | None = None
    match: str = ""  # what a RAISES case's error says
    dtype: torch.dtype = F64  # a cast to float32 runs its head in float32


def head(features: int, in_key: NestedKey = "observation", batch_dims: int = 1, dtype=F64) -> TensorDictModule:
    net = nn.Sequential(nn.Flatten(batch_dims), nn.Linear(features, 8), nn.ReLU(), nn.Linear(8, 3))
    return TensorDictModule(net.to(dtype), [in_key], ["logits"])


def vector(batch: int = 3, features: int = 4, **more: int) -> TensorDict:
    td = TensorDict(observation=torch.randn(batch, features, dtype=F64), batch_size=[batch])
    for key, size in more.items():
        td[key] = torch.randn(batch, size, dtype=F64)
    return td


def image(batch: int = 2, channels_last: bool = False) -> TensorDict:
    shape = (batch, 8, 8, 3) if channels_last else (batch, 3, 8, 8)
    return TensorDict(pixels=torch.rand(*shape, dtype=F64), batch_size=[batch])


def policy(*transforms: nn.Module, features: int, td: TensorDict, in_key: NestedKey = "observation", **kw) -> Built:
    return TensorDictSequential(*transforms, head(features, in_key, **kw)), td, "logits"


def trajectory() -> TensorDict:
    """Two trajectories of 5 steps, the first ending at step 2 (CatFrames pads across it)."""
    done = torch.zeros(2, 5, 1, dtype=torch.bool)
    done[0, 2] = True
    td = TensorDict(
        observation=torch.randn(2, 5, 3, dtype=F64), next=TensorDict(done=done, batch_size=[2, 5]), batch_size=[2, 5]
    )
    return td.refine_names(None, "time")


def _normalised(standard_normal: bool = False) -> T.ObservationNorm:
    loc, scale = torch.randn(4, dtype=F64), torch.rand(4, dtype=F64) + 0.5
    return T.ObservationNorm(loc, scale, ["observation"], standard_normal=standard_normal)


class Twice(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x


def _observation_norm() -> Built:
    return policy(_normalised(), features=4, td=vector())


def _cat_tensors() -> Built:
    cat = T.CatTensors(["observation", "velocity"], out_key="observation_vector")
    return policy(cat, features=6, td=vector(velocity=2), in_key="observation_vector")


def _compose() -> Built:
    cat = T.CatTensors(["observation", "velocity"], out_key="observation_vector")
    return policy(T.Compose(_normalised(True), cat), features=6, td=vector(velocity=2), in_key="observation_vector")


def _image(transform: nn.Module, features: int, channels_last: bool = False) -> Callable[[], Built]:
    return lambda: policy(transform, features=features, td=image(channels_last=channels_last), in_key="pixels")


def _cast(transform: nn.Module) -> Callable[[], Built]:
    return lambda: policy(transform, features=4, td=vector(), dtype=torch.float32)


def _vector(transform: Callable[[], nn.Module], features: int = 4, in_key: NestedKey = "observation", **more: int):
    return lambda: policy(transform(), features=features, td=vector(**more), in_key=in_key)


def _cat_frames() -> Built:
    cat = T.CatFrames(N=3, dim=-1, in_keys=["observation"], out_keys=["stacked"])  # offline: unfolds the trajectory
    return policy(cat, features=9, td=trajectory(), in_key="stacked", batch_dims=2)


def _random_crop() -> Built:
    return policy(T.RandomCropTensorDict(sub_seq_len=3), features=3, td=trajectory(), batch_dims=2)


def _forward_refuses(make: Callable[[], nn.Module], error: type[Exception] = NotImplementedError) -> Callable[[], None]:
    """Check that the transform's forward refuses to run on a policy's TensorDict (it runs inside an environment)."""

    def check() -> None:
        with pytest.raises(error):
            TensorDictSequential(make(), head(4))(vector())

    return check


def _projected() -> Built:
    actor = TensorDictModule(nn.Linear(4, 3).to(F64), ["observation"], ["action"])
    return TensorDictSequential(actor, T.DiscreteActionProjection(2, 3)), vector(), None


BASE_CLASS = "a base class: its subclasses are listed"
ENVIRONMENT = "an environment, not a module of the policy"
REWARD = "transforms the reward (or a return) an environment gives, which no policy reads"
ACTION = "transforms the action a policy wrote, on its way to the environment (its inverse), into no float to explain"
FLOW = "steers the environment's steps, resets, batch, devices or timing; it computes no observation"
REPLAY = "a replay buffer's transform of stored transitions (n-step returns, next states, filters), no observation"
PRETRAINED = (
    "a pretrained image encoder (R3M, VIP, VC-1) built from downloaded weights; the torchvision ResNets it wraps are "
    "checked under LRP in the model gallery"
)
TEXT = "maps strings or tensors to hashes or tokens: integers, with no gradient and no relevance to carry"
REMOTE = "runs a transform in a Ray actor, in another process"


CASES: dict[str, Case] = {
    # Linear maps of the observation: relevance passes to the raw keys as through any glue.
    "ObservationNorm": Case(LRP0, _observation_norm),
    "CatTensors": Case(LRP0, _cat_tensors),
    "Stack": Case(LRP0, lambda: policy(T.Stack(["observation", "o2"], "s"), features=8, td=vector(o2=4), in_key="s")),
    "Compose": Case(LRP0, _compose),
    "Resize": Case(LRP0, _image(T.Resize(4, 4, in_keys=["pixels"]), 48)),
    "GrayScale": Case(LRP0, _image(T.GrayScale(in_keys=["pixels"]), 64)),
    "CenterCrop": Case(LRP0, _image(T.CenterCrop(4, in_keys=["pixels"]), 48)),
    "Crop": Case(LRP0, _image(T.Crop(4, 4, 1, 2, in_keys=["pixels"]), 48)),
    "FlattenObservation": Case(LRP0, _image(T.FlattenObservation(-3, -1, in_keys=["pixels"]), 192)),
    "PermuteTransform": Case(LRP0, _image(T.PermuteTransform((-1, -3, -2), in_keys=["pixels"]), 192)),
    # Float pixels, channels last (uint8 pixels: test_uint8_pixels_are_refused_by_key).
    "ToTensorImage": Case(
        LRP0, _image(T.ToTensorImage(from_int=True, dtype=F64, in_keys=["pixels"]), 192, channels_last=True)
    ),
    "UnsqueezeTransform": Case(LRP0, _vector(lambda: T.UnsqueezeTransform(-1, in_keys=["observation"]))),
    "SqueezeTransform": Case(
        LRP0,
        lambda: policy(
            T.UnsqueezeTransform(-2, in_keys=["observation"]),
            T.SqueezeTransform(-2, in_keys=["observation"]),
            features=4,
            td=vector(),
        ),
    ),
    "RenameTransform": Case(LRP0, _vector(lambda: T.RenameTransform(["observation"], ["obs"]), in_key="obs")),
    "ExcludeTransform": Case(LRP0, _vector(lambda: T.ExcludeTransform("unused"), unused=2)),
    "SelectTransform": Case(LRP0, _vector(lambda: T.SelectTransform("observation"), unused=2)),
    "ExpandAs": Case(
        LRP0,
        _vector(lambda: T.ExpandAs("scalar", "observation", "wide"), in_key="wide", scalar=1),
    ),
    "FiniteTensorDictCheck": Case(LRP0, _vector(T.FiniteTensorDictCheck)),
    "UnaryTransform": Case(LRP0, _vector(lambda: T.UnaryTransform(["observation"], ["o2"], fn=Twice()), in_key="o2")),
    "ModuleTransform": Case(
        LRP0,
        _vector(
            lambda: T.ModuleTransform(module=TensorDictModule(nn.Linear(4, 5).to(F64), ["observation"], ["o2"])),
            features=5,
            in_key="o2",
        ),
    ),
    "RewardScaling": Case(LRP0, _vector(lambda: T.RewardScaling(1.0, 2.0, in_keys=["observation"]))),  # affine
    "CatFrames": Case(LRP0, _cat_frames),  # offline unfolding of a trajectory, "same" padding (a gather)
    "DoubleToFloat": Case(LRP0, _cast(T.DoubleToFloat(in_keys=["observation"])), dtype=torch.float32),
    "DTypeCastTransform": Case(
        LRP0, _cast(T.DTypeCastTransform(F64, torch.float32, in_keys=["observation"])), dtype=torch.float32
    ),
    "DeviceCastTransform": Case(LRP0, _vector(lambda: T.DeviceCastTransform("cpu", in_keys=["observation"]))),
    # Clips: the pass rule of clipping calls (docs: PassRule), which conserves; a clipped feature keeps its share.
    "ClipTransform": Case(CONSERVES, _vector(lambda: T.ClipTransform(["observation"], low=-0.5, high=0.5))),
    "RewardClipping": Case(CONSERVES, _vector(lambda: T.RewardClipping(-0.5, 0.5, in_keys=["observation"]))),
    # Piecewise constant: no gradient, so no relevance; named.
    "SignTransform": Case(WARNS, _vector(lambda: T.SignTransform(in_keys=["observation"]))),
    # A random crop along time returns fewer steps than it was given: refused, not written next to the wrong rows.
    "RandomCropTensorDict": Case(RAISES, _random_crop, match="batch size"),
    "VecNorm": Case(CHECKED, reason="statistics moved once and held: test_vec_norm_*"),
    "VecNormV2": Case(
        NOT_EXPLAINED,
        reason="runs only in an environment",
        check=_forward_refuses(lambda: T.VecNormV2(["observation"])),
    ),
    "StepCounter": Case(NOT_EXPLAINED, reason="runs only in an environment", check=_forward_refuses(T.StepCounter)),
    "TimeMaxPool": Case(
        NOT_EXPLAINED,
        reason="runs only in an environment",
        check=_forward_refuses(lambda: T.TimeMaxPool(["observation"])),
    ),
    "InitTracker": Case(NOT_EXPLAINED, reason="needs its parent environment", check=_forward_refuses(T.InitTracker)),
    # After an actor: the one-hot action it writes is no float to explain; the call asks for a target_key.
    "DiscreteActionProjection": Case(RAISES, _projected, match="pass target_key"),
    "Transform": Case(NOT_EXPLAINED, reason=BASE_CLASS),
    "ObservationTransform": Case(NOT_EXPLAINED, reason=BASE_CLASS),
    "TransformedEnv": Case(NOT_EXPLAINED, reason=ENVIRONMENT),
    "AutoResetEnv": Case(NOT_EXPLAINED, reason=ENVIRONMENT),
    **{
        name: Case(NOT_EXPLAINED, reason=REWARD)
        for name in "BinarizeReward LineariseRewards Reward2GoTransform RewardSum SuccessReward TargetReturn "
        "VIPRewardTransform RNDTransform".split()
    },
    "RunningMeanStd": Case(NOT_EXPLAINED, reason="random network distillation's running statistics of its own error"),
    **{
        name: Case(NOT_EXPLAINED, reason=ACTION)
        for name in "ActionChunkTransform ActionDiscretizer ActionMask ActionScaling ActionTokenizerTransform "
        "FlattenAction MultiAction MeanActionSelector MacroPrimitiveTransform SatelliteAttitudeTransform "
        "URScriptPrimitiveTransform".split()
    },
    **{
        name: Case(NOT_EXPLAINED, reason=FLOW)
        for name in "AutoResetTransform BatchSizeTransform BurnInTransform ConditionalPolicySwitch ConditionalSkip "
        "DecodeVideoTransform EndOfLifeTransform FrameSkipTransform NoopResetEnv PinMemoryTransform "
        "RandomTruncationTransform RemoveEmptySpecs TensorDictPrimer TerminateTransform Timer TrajCounter "
        "VecGymEnvTransform gSDENoise".split()
    },
    **{
        name: Case(NOT_EXPLAINED, reason=REPLAY)
        for name in "MultiStepTransform NextObservationDelta NextStateReconstructor PolicyAgeFilter".split()
    },
    **{name: Case(NOT_EXPLAINED, reason=PRETRAINED) for name in ("R3MTransform", "VIPTransform", "VC1Transform")},
    **{name: Case(NOT_EXPLAINED, reason=TEXT) for name in ("Hash", "Tokenizer")},
    "RayTransform": Case(NOT_EXPLAINED, reason=REMOTE),
}


def _transform_classes() -> list[str]:
    """The names in ``torchrl.envs.transforms.__all__`` that are module classes."""
    return [
        name for name in T.__all__ if isinstance(value := getattr(T, name, None), type) and issubclass(value, nn.Module)
    ]


def test_every_transform_class_is_listed():
    """A transform class of a newer torchrl enters LRP unchecked: look at it in a policy, and list it."""
    unlisted = [name for name in _transform_classes() if name not in CASES]
    assert unlisted == [], f"torchrl.envs.transforms classes not checked under LRP: {unlisted}; check each and list it"
    stale = [name for name in CASES if not hasattr(T, name)]
    assert stale == [], f"listed but not in this torchrl: {stale}"


def _explain(
    module: TensorDictModuleBase, td: TensorDict, key: NestedKey, mapper, target=None
) -> tuple[TensorDict, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = LRP(module, mapper, target_key=key, target=target)(td.clone())
    return out, [str(w.message) for w in caught]


def _state(module: nn.Module) -> dict:
    return {k: v.clone() for k, v in module.named_buffers() if not isinstance(v, nn.parameter.UninitializedBuffer)}


def _build(case: Case) -> Built:
    torch.manual_seed(0)
    module, td, key = case.build()
    return module.to(case.dtype), td, key


@pytest.mark.parametrize("name", list(CASES))
def test_each_transform_class(name: str):
    case = CASES[name]
    if case.outcome in (NOT_EXPLAINED, CHECKED):
        assert case.reason
        if case.check is not None:
            case.check()
        return
    module, td, key = _build(case)
    tolerance = {"rtol": 1e-9, "atol": 1e-12} if case.dtype == F64 else {"rtol": 1e-5, "atol": 1e-6}
    if case.outcome == RAISES:
        with pytest.raises((ValueError, TypeError, KeyError), match=case.match):
            _explain(module, td, key, BaseRuleMapper(stabilizer=0.0))
        return
    if case.outcome == WARNS:
        _, messages = _explain(module, td, key, BaseRuleMapper(stabilizer=0.0))
        assert any(re.search(rf"module '[\w.]*' \({name}\)", m) for m in messages), messages
        return
    if case.outcome == LRP0:
        plain = _build(case)[0]
        expected_out = plain(td.clone())[key]
        expected_state = _state(plain)
        out, messages = _explain(module, td, key, BaseRuleMapper(stabilizer=0.0))
        assert messages == []
        assert torch.equal(out[key], expected_out), f"{key} left out of LRP's result"
        assert {k: torch.equal(v, expected_state[k]) for k, v in _state(module).items()} == dict.fromkeys(
            expected_state, True
        )
        expected, _ = _gradient_times_input(module, td, key)
        assert set(out["relevance"].keys(True, True)) == set(expected)
        for k, relevance in expected.items():
            assert out["relevance", *as_tuple(k)].shape == td[k].shape
            torch.testing.assert_close(out["relevance", *as_tuple(k)], relevance, **tolerance)
        return
    zero_biases(module)
    out, messages = _explain(module, td, key, BaseRuleMapper(stabilizer=1e-12, rule_mapper={nn.Linear: EpsilonRule(0)}))
    assert messages == []
    total = sum(r.sum() for r in out["relevance"].values(True, True))
    _, explained = _gradient_times_input(module, td, key)
    torch.testing.assert_close(total.item(), explained, **tolerance)


LINEAR = ("ObservationNorm", "CatTensors", "Compose", "Resize", "GrayScale", "CatFrames", "ClipTransform")


@pytest.mark.parametrize(
    "mapper", [EpsilonPlus(epsilon=1e-12), EpsilonAlpha2Beta1(epsilon=1e-12)], ids=["EpsilonPlus", "a2b1"]
)
@pytest.mark.parametrize("name", LINEAR)
def test_presets_conserve_through_transforms_with_biases_zeroed(name: str, mapper):
    """The presets on the head, the transform's own map passed through: the relevance on the raw keys sums to the
    explained values (an ObservationNorm's shift counts as a bias: zeroed)."""
    module, td, key = _build(CASES[name])
    zero_biases(module)
    for norm in module.modules():
        if isinstance(norm, T.ObservationNorm):
            norm.loc.zero_()
    out, messages = _explain(module, td, key, mapper)
    assert messages == []
    total = sum(r.sum() for r in out["relevance"].values(True, True))
    _, explained = _gradient_times_input(module, td, key)
    torch.testing.assert_close(total.item(), explained, rtol=1e-6, atol=1e-9)


def test_uint8_pixels_are_refused_by_key():
    """``ToTensorImage`` on uint8 pixels: integers take no gradient; the call names the key instead of writing
    zeros."""
    to_float = T.ToTensorImage(in_keys=["pixels"])
    module = TensorDictSequential(to_float, head(192, "pixels", dtype=torch.float32))
    pixels = TensorDict(pixels=torch.randint(0, 256, (2, 8, 8, 3), dtype=torch.uint8), batch_size=[2])
    with pytest.raises(TypeError, match="'pixels' holds integer"):
        LRP(module, EpsilonPlus())(pixels)


# ----------------------------------------------------------------------------- VecNorm: running statistics


def _vec_norm_policy() -> TensorDictSequential:
    torch.manual_seed(0)
    norm = T.VecNorm(in_keys=["observation"], decay=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        norm(TensorDict(observation=3 * torch.randn(10, 4, dtype=F64) + 1, batch_size=[10]))  # statistics so far
    return TensorDictSequential(norm, head(4))


def _statistics(module: TensorDictSequential) -> dict:
    return {k: v.clone() for k, v in module[0]._td.items(True, True)}


@pytest.mark.parametrize("mapper", [BaseRuleMapper(stabilizer=0.0), EpsilonAlpha2Beta1()], ids=["LRP-0", "a2b1"])
@pytest.mark.parametrize("target", [None, "all"])
def test_vec_norm_moves_its_statistics_once_and_holds_them(mapper, target):
    """A VecNorm that is not frozen: its statistics move as one plain call moves them, once and with no graph, and
    LRP-0 is gradient × input of the normalisation by the moved statistics held constant (per sample, as a
    BatchNorm in training mode)."""
    td = TensorDict(observation=3 * torch.randn(3, 4, dtype=F64) + 1, batch_size=[3])
    module, plain = _vec_norm_policy(), _vec_norm_policy()
    expected_out = plain(td.clone())["logits"]
    out, messages = _explain(module, td, "logits", mapper, target)
    assert messages == []
    assert torch.equal(out["logits"], expected_out)
    moved = _statistics(plain)
    for k, v in _statistics(module).items():
        assert not v.requires_grad, f"{k} keeps the call's graph"
        assert torch.equal(v, moved[k]), f"{k} moved otherwise than by one plain call"
    if type(mapper) is BaseRuleMapper and target is None:  # LRP-0
        frozen = copy.deepcopy(plain)
        frozen[0].freeze()  # the statistics the call moved, held
        expected, _ = _gradient_times_input(frozen, td, "logits")
        assert out["relevance", "observation"].shape == td["observation"].shape
        torch.testing.assert_close(out["relevance", "observation"], expected["observation"], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(
    "mapper",
    [EpsilonPlus(epsilon=1e-12), EpsilonPlusFlat(epsilon=1e-12), EpsilonAlpha2Beta1(epsilon=1e-12)],
    ids=["EpsilonPlus", "EpsilonPlusFlat", "a2b1"],
)
def test_vec_norm_conserves_each_sample_with_no_shift(mapper):
    """With the biases zeroed, running sums of zero and a batch whose features sum to zero (so the moved mean, the
    normalisation's shift, is zero), each sample's relevance sums to its own explained value."""
    module = zero_biases(_vec_norm_policy())
    module[0]._td["observation_sum"].zero_()
    x = torch.randn(3, 4, dtype=F64)
    out, messages = _explain(module, TensorDict(observation=x - x.mean(0), batch_size=[3]), "logits", mapper)
    assert messages == []
    torch.testing.assert_close(
        out["relevance", "observation"].sum(-1), out["logits"].max(-1).values, rtol=1e-6, atol=1e-8
    )


def test_vec_norm_frozen_is_lrp0():
    td = TensorDict(observation=torch.randn(3, 4, dtype=F64), batch_size=[3])
    module = _vec_norm_policy()
    module[0].freeze()
    before = _statistics(module)
    out, messages = _explain(module, td, "logits", BaseRuleMapper(stabilizer=0.0))
    expected, _ = _gradient_times_input(module, td, "logits")
    assert messages == [] and all(torch.equal(v, before[k]) for k, v in _statistics(module).items())
    torch.testing.assert_close(out["relevance", "observation"], expected["observation"], rtol=1e-9, atol=1e-12)


# ----------------------------------------------------------------------------- a real rollout


def test_rollout_with_the_environment_transforms_in_the_policy():
    """``GymEnv("Pendulum-v1")`` with an ObservationNorm and a VecNorm moved into the policy: LRP's rollout takes the
    plain policy's actions, leaves the VecNorm's statistics where the plain rollout leaves them, and puts relevance
    on the raw observation of every step."""
    from torchrl.envs import GymEnv
    from torchrl.modules import MLP, Actor

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        norm = T.VecNorm(in_keys=["observation"], decay=0.99)
    scale = T.ObservationNorm(torch.zeros(3), torch.tensor([1.0, 1.0, 0.125]), ["observation"])
    actor = Actor(MLP(in_features=3, out_features=1, num_cells=[16], activation_class=nn.ReLU), in_keys=["observation"])
    policy = TensorDictSequential(scale, norm, actor)
    plain_policy = copy.deepcopy(policy)
    env = GymEnv("Pendulum-v1")
    env.set_seed(0)
    plain = env.rollout(12, plain_policy, break_when_any_done=False)
    env.set_seed(0)
    explained = env.rollout(12, LRP(policy, EpsilonPlus()), break_when_any_done=False)
    torch.testing.assert_close(explained["action"], plain["action"], rtol=0, atol=0)
    assert explained["relevance", "observation"].shape == plain["observation"].shape
    for k, v in norm._td.items():
        assert torch.equal(v, plain_policy[1]._td[k]) and not v.requires_grad, k


@pytest.mark.parametrize("method", ["IntegratedGradients", "Saliency", "Occlusion"])
def test_the_other_methods_refuse_a_live_vec_norm_by_name(method):
    """The gradient and perturbation methods run the model on copies of the batch: a VecNorm that is not frozen would
    move its statistics at every pass (fifty times for integrated gradients) and be differentiated through them.
    Refused by name; frozen, it is a fixed affine map, explained with its statistics left as they were."""
    from tests.attribution.methods.test_base import make

    td = TensorDict(observation=torch.randn(3, 4, dtype=F64), batch_size=[3])
    module = _vec_norm_policy()
    before = _statistics(module)
    with pytest.raises(ValueError, match=r"module 'module.0' \(VecNorm\) is not frozen"):
        make(method, module, target_key="logits")(td.clone())
    module[0].freeze()
    out = make(method, module, target_key="logits")(td.clone())
    assert out["attribution", "observation"].shape == td["observation"].shape
    for k, v in _statistics(module).items():
        assert torch.equal(v, before[k]) and not v.requires_grad, k
