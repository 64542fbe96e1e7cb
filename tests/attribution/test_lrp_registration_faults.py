"""A registration that fails while a context is entered or a call runs: nothing of the context is left behind.

An exception (a ``KeyboardInterrupt``, or an error of a module whose ``register_forward_hook`` raises) is made to
arrive at the k-th hook registration of tdhook (a module's forward hook, forward pre-hook or backward hook, a
tensor's hook, an autograd node's hook or pre-hook), for every k up to the number of registrations that entering
the context (or the call) makes. Afterwards the model holds no hook of the context and its parameters, buffers,
``requires_grad``, ``.grad`` and training flags are as before, the caller's TensorDict holds what it held (no new
key, no tensor written to or hooked), and the next context, or the next call of the open context, gives the
relevance of a fresh wrapper.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

import pytest
import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule, TensorDictSequential
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.rules import AttnLRP, EpsilonPlus, EpsilonRule
from tests.attribution._helpers import small_bn_cnn
from tests.attribution.test_detached_caches import Cache, Step
from tests.attribution.test_lrp_interrupts import assert_same_state, global_state, module_state

F64 = torch.float64

# The registrations counted: torch's Python methods, replaced for the block, and an autograd node's, which a C type
# holds (seen through the interpreter's profile of C calls).
METHODS = (
    (nn.Module, "register_forward_hook"),
    (nn.Module, "register_forward_pre_hook"),
    (nn.Module, "register_full_backward_hook"),
    (nn.Module, "register_full_backward_pre_hook"),
    (torch.Tensor, "register_hook"),
)
NODE_METHODS = ("register_hook", "register_prehook")


class FailingRegistration:
    """Raise ``error`` at the ``at``-th hook registration inside the block (never, with ``at=None``: then
    :attr:`count` is the number of registrations), and catch it; :attr:`where` names the method (``None``: the block
    made fewer registrations). With ``after=False`` the registration raises before it registers anything; with
    ``after=True``, once torch has put the hook into the dict, before its handle is returned (as a registration that
    fails after its insertion does, or an interrupt that arrives before the handle is listed)."""

    def __init__(self, at: int | None, error: type[BaseException] = KeyboardInterrupt, after: bool = False) -> None:
        self.at, self.error, self.after, self.count, self.where = at, error, after, 0, None

    def _registering(self, what: str) -> None:
        self.count += 1
        if self.count == self.at:
            self.where = what
            raise self.error(f"registration {self.count} ({what}) failed")

    def _profile(self, frame, event: str, arg: object) -> None:
        if event == ("c_return" if self.after else "c_call") and getattr(arg, "__name__", None) in NODE_METHODS:
            if isinstance(getattr(arg, "__self__", None), torch.autograd.graph.Node):
                self._registering(f"Node.{arg.__name__}")

    def _replaced(self, owner: type, name: str) -> Callable:
        original = owner.__dict__[name]

        def method(*args, **kwargs):
            if not self.after:
                self._registering(f"{owner.__name__}.{name}")
                return original(*args, **kwargs)
            handle = original(*args, **kwargs)
            self._registering(f"{owner.__name__}.{name}")
            return handle

        return method

    def __enter__(self) -> FailingRegistration:
        self._originals = [(owner, name, owner.__dict__[name]) for owner, name in METHODS]
        for owner, name, _ in self._originals:
            setattr(owner, name, self._replaced(owner, name))
        self._previous = sys.getprofile()
        sys.setprofile(self._profile)  # unset by the interpreter where the profile raises
        return self

    def __exit__(self, kind: type | None, *exc_info: object) -> bool:
        sys.setprofile(self._previous)
        for owner, name, original in self._originals:
            setattr(owner, name, original)
        return kind is not None and issubclass(kind, self.error) and self.where is not None


class Checked(nn.Module):
    """A relevance check that checks nothing: it puts the hooks of one on every ruled module."""

    def forward(self, *args: object) -> None:
        return None


def cnn_case() -> tuple[nn.Module, Callable[[], LRP], Callable[[], TensorDict]]:
    model = small_bn_cnn()
    x = torch.randn(2, 3, 8, 8, dtype=F64, generator=torch.Generator().manual_seed(1))

    def wrapper() -> LRP:
        return LRP(model, EpsilonPlus(), in_keys=["x"], out_keys=["y"], layers=["0", "3"], relevance_check=Checked())

    return model, wrapper, lambda: TensorDict(x=x.clone(), batch_size=[2])


class TokenClassifier(nn.Module):
    """A tiny BERT fed token ids and an attention mask: the logits of its classifier."""

    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        config = transformers.BertConfig(
            vocab_size=32,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=16,
            num_labels=3,
        )
        config._attn_implementation = "eager"
        torch.manual_seed(0)
        self.model = transformers.BertForSequenceClassification(config).eval().to(F64)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=mask).logits


def bert_case() -> tuple[nn.Module, Callable[[], LRP], Callable[[], TensorDict]]:
    model = TokenClassifier()
    ids = torch.randint(1, 32, (2, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, 3:] = 0
    policy = TensorDictModule(model, in_keys=["ids", "mask"], out_keys=["logits"])

    def wrapper() -> LRP:
        return LRP(policy, AttnLRP(), in_keys=["ids"])

    return model, wrapper, lambda: TensorDict(ids=ids.clone(), mask=mask.clone(), batch_size=[2])


def actor_case() -> tuple[nn.Module, Callable[[], LRP], Callable[[], TensorDict]]:
    torchrl = pytest.importorskip("torchrl")
    from torchrl.data import Bounded

    spec = Bounded(-1.0, 1.0, (2,), dtype=F64)
    torch.manual_seed(0)
    net = torchrl.modules.MLP(in_features=4, out_features=2, num_cells=[8, 8], activation_class=nn.ReLU).to(F64)
    actor = torchrl.modules.Actor(net, in_keys=["observation"], spec=spec)
    noise = torchrl.modules.AdditiveGaussianModule(spec=spec, sigma_init=0.5, sigma_end=0.5)
    policy = TensorDictSequential(actor, noise)
    observation = torch.randn(3, 4, dtype=F64, generator=torch.Generator().manual_seed(1))

    def wrapper() -> LRP:
        return LRP(policy, EpsilonPlus(), target_key="action")

    def inputs() -> TensorDict:
        torch.manual_seed(2)  # each call draws the same noise
        return TensorDict(observation=observation.clone(), batch_size=[3])

    return policy, wrapper, inputs


class CachedStep(nn.Module):
    """A step handed a key-value cache, which it appends to (its context's watch and a call's own hooks note it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.step, self.cache = Step(), Cache()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.step(x, past_key_values=self.cache)


def cache_case() -> tuple[nn.Module, Callable[[], LRP], Callable[[], TensorDict]]:
    model = CachedStep()
    x = torch.randn(2, 3, dtype=F64, generator=torch.Generator().manual_seed(1))

    def inputs() -> TensorDict:
        model.cache.keys = torch.zeros(2, 0, dtype=F64)  # each call is handed an empty cache
        return TensorDict(x=x.clone(), batch_size=[2])

    return model, lambda: LRP(model, EpsilonPlus(), in_keys=["x"], out_keys=["y"]), inputs


CASES = {
    "CNN under EpsilonPlus, with layers and a relevance check": cnn_case,
    "tiny BERT fed token ids under AttnLRP": bert_case,
    "torchrl actor with exploration noise under EpsilonPlus": actor_case,
    "step handed a key-value cache": cache_case,
}


def relevance(out: TensorDictBase) -> dict:
    return {key: value for key, value in out.items(include_nested=True, leaves_only=True) if key[0] == "relevance"}


def assert_same_relevance(actual: dict, expected: dict, where: str | None) -> None:
    assert actual.keys() == expected.keys(), where
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=1e-10, atol=1e-12, msg=lambda m: f"{where} {key}: {m}")


def tensordict_state(td: TensorDictBase) -> dict:
    """Each entry of ``td``: the tensor, its version, values, ``requires_grad``, ``.grad`` and hooks."""
    return {
        key: (value, value._version, value.clone(), value.requires_grad, value.grad, value._backward_hooks)
        for key, value in td.items(include_nested=True, leaves_only=True)
    }


def assert_same_tensordict(before: dict, td: TensorDictBase, where: str | None) -> None:
    after = tensordict_state(td)
    assert after.keys() == before.keys(), where
    for key, (value, version, values, requires_grad, grad, hooks) in before.items():
        now = after[key]
        assert now[0] is value and now[1] == version and torch.equal(now[2], values), (where, key)
        assert now[3] == requires_grad and now[4] is grad and not now[5] and not hooks, (where, key)


@pytest.mark.parametrize("after", [False, True], ids=["before insertion", "after insertion"])
@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_failing_registration_while_entering_leaves_no_hook_and_the_next_context_works(
    case: str, error: type, after: bool
):
    model, wrapper, inputs = CASES[case]()
    expected = relevance(wrapper()(inputs()))  # a fresh wrapper's relevance
    lrp = wrapper()
    before, before_global = module_state(model), global_state()
    with FailingRegistration(None) as counting:
        lrp.__enter__()
    lrp.__exit__(None, None, None)
    assert counting.count > 0
    for at in range(1, counting.count + 1):
        with FailingRegistration(at, error, after) as failing:
            lrp.__enter__()
        assert failing.where is not None, at  # entering makes the same registrations each time
        assert global_state() == before_global, failing.where
        assert_same_state(before, module_state(model), f"{at}: {failing.where}")
        with lrp:
            assert_same_relevance(relevance(lrp(inputs())), expected, f"{at}: {failing.where}")
        assert_same_state(before, module_state(model), f"{at}: {failing.where}")


MODES = ("own context", "open context", "inactive block")


@contextlib.contextmanager
def calls_in(lrp: LRP, mode: str) -> Iterator[None]:
    """The block's calls of ``lrp`` each in a context of their own, in one open context, or in an open context's
    ``inactive()`` block (the plain gradient times the input)."""
    if mode == "own context":
        yield
        return
    with lrp, lrp.inactive() if mode == "inactive block" else contextlib.nullcontext():
        yield


def expected_relevance(wrapper: Callable[[], LRP], inputs: Callable[[], TensorDict], mode: str) -> dict:
    """A fresh wrapper's relevance, under the rules or (in an ``inactive()`` block) without them."""
    fresh = wrapper()
    with calls_in(fresh, mode):
        return relevance(fresh(inputs()))


# The calls that register hooks: a context's first call watches more than the later ones, and a call in an
# ``inactive()`` block registers the caches' watch of its own.
CALLS = [
    *((case, "own context") for case in sorted(CASES)),
    ("CNN under EpsilonPlus, with layers and a relevance check", "open context"),
    ("step handed a key-value cache", "inactive block"),
]


@pytest.mark.parametrize("after", [False, True], ids=["before insertion", "after insertion"])
@pytest.mark.parametrize("case, mode", CALLS)
def test_a_failing_registration_during_a_call_leaves_model_and_tensordict_as_before(case: str, mode: str, after: bool):
    model, wrapper, inputs = CASES[case]()
    expected = expected_relevance(wrapper, inputs, mode)
    lrp = wrapper()
    before_global = global_state()
    with calls_in(lrp, mode):
        lrp(inputs())  # the first call (of the wrapper, of the context) watches more than the later ones
        before = module_state(model)
        next_call = lambda where: assert_same_relevance(relevance(lrp(inputs())), expected, where)  # noqa: E731
        fail_each_registration(lrp, model, inputs, (before, before_global), next_call, KeyboardInterrupt, after)


def fail_each_registration(
    call: Callable[[TensorDict], object],
    model: nn.Module,
    inputs: Callable[[], TensorDict],
    states: tuple[list, tuple],
    next_call: Callable[[str], None],
    error: type[BaseException],
    after: bool,
) -> None:
    """Make ``call`` fail at each of its hook registrations in turn (``error``, ``after`` the insertion or not), and
    check each time that the TensorDict it was given, torch's global state and the model are as before (``states``:
    the model's and the global state) and that ``next_call(where)`` passes."""
    before, before_global = states
    with FailingRegistration(None) as counting:
        call(inputs())
    assert counting.count > 0
    for at in range(1, counting.count + 1):
        td = inputs()
        entries = tensordict_state(td)
        with FailingRegistration(at, error, after) as failing:
            call(td)
        where = f"{at}: {failing.where}"
        assert failing.where is not None, where
        assert_same_tensordict(entries, td, where)
        assert global_state() == before_global, where
        assert_same_state(before, module_state(model), where)
        next_call(where)


def raised_from(raised: BaseException | None, error: type[BaseException]) -> bool:
    """Whether ``raised`` is an ``error``, or was raised from one (the wrapper names what the model's error may come
    from: token ids that no embedding read, for one)."""
    while raised is not None and not isinstance(raised, error):
        raised = raised.__cause__
    return raised is not None


class FailingModuleCall:
    """Raise ``error`` as the ``at``-th module call inside the block starts (a global forward pre-hook of torch's;
    never, with ``at=None``: then :attr:`count` is the number of module calls)."""

    def __init__(self, at: int | None, error: type[BaseException] = RuntimeError) -> None:
        self.at, self.error, self.count, self.raised = at, error, 0, False

    def _pre_hook(self, module: nn.Module, args: tuple) -> None:
        self.count += 1
        if self.count == self.at:
            self.raised = True
            raise self.error(f"module call {self.count} ({type(module).__name__}) failed")

    def __enter__(self) -> FailingModuleCall:
        self._handle = torch.nn.modules.module.register_module_forward_pre_hook(self._pre_hook)
        return self

    def __exit__(self, kind: type | None, value: BaseException | None, *exc_info: object) -> bool:
        self._handle.remove()
        return self.raised and raised_from(value, self.error)


class FailingTensorHook:
    """Raise ``error`` at the ``at``-th run of a tensor hook registered inside the block (in the backward pass;
    never, with ``at=None``: then :attr:`count` is the number of runs)."""

    def __init__(self, at: int | None, error: type[BaseException] = RuntimeError) -> None:
        self.at, self.error, self.count, self.raised = at, error, 0, False

    def __enter__(self) -> FailingTensorHook:
        original = self._original = torch.Tensor.register_hook

        def register_hook(tensor: torch.Tensor, hook: Callable) -> object:
            def failing(grad: torch.Tensor) -> object:
                self.count += 1
                if self.count == self.at:
                    self.raised = True
                    raise self.error(f"tensor hook run {self.count} failed")
                return hook(grad)

            return original(tensor, failing)

        torch.Tensor.register_hook = register_hook
        return self

    def __exit__(self, kind: type | None, value: BaseException | None, *exc_info: object) -> bool:
        torch.Tensor.register_hook = self._original
        return self.raised and raised_from(value, self.error)


# An error of the model in its forward pass, an interrupt in the backward pass (each kind is checked at a fixed
# place for every kind of exception in test_lrp_faults.py).
FAILURES = {
    "an error in the k-th module's forward": (FailingModuleCall, RuntimeError),
    "an interrupt in the k-th tensor hook's run": (FailingTensorHook, KeyboardInterrupt),
}


@pytest.mark.parametrize("failure", sorted(FAILURES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_call_failing_in_the_model_or_its_backward_writes_nothing_and_the_next_call_is_right(case: str, failure: str):
    """The model raising in the forward pass (at its k-th module call), or a hook raising in the backward pass (at
    its k-th run), in an open context: the caller's TensorDict is as it was, and the context's next call gives the
    relevance of a fresh wrapper."""
    model, wrapper, inputs = CASES[case]()
    expected = relevance(wrapper()(inputs()))
    lrp = wrapper()
    before_global, (injected, error) = global_state(), FAILURES[failure]
    with lrp:
        lrp(inputs())
        before = module_state(model)
        with injected(None) as counting:
            assert_same_relevance(relevance(lrp(inputs())), expected, "counting")
        for at in range(1, counting.count + 1):
            td = inputs()
            entries = tensordict_state(td)
            with injected(at, error) as failing:
                lrp(td)
            assert failing.raised, at
            assert_same_tensordict(entries, td, at)
            assert_same_state(before, module_state(model), at)
            assert_same_relevance(relevance(lrp(inputs())), expected, at)
    assert global_state() == before_global


def test_a_rule_left_registered_by_hand_is_named_when_a_context_is_entered():
    """A rule registered by hand on a module and not removed stacked with the wrapper's rule on it, with no word: the
    wrapper's LRP-0 (``EpsilonRule(0.0)``) came out 0.75 off, one sample's sign flipped. Entering the context is
    refused, naming the module and both rules; the model keeps the hand rule alone, and once it is removed the
    wrapper gives its own rule's relevance."""
    torch.manual_seed(1)
    layer = nn.Linear(4, 3).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    by_hand = EpsilonRule(0.5).register(layer)
    hooks = dict(layer._forward_hooks)
    lrp = LRP(nn.Sequential(layer), {nn.Linear: EpsilonRule(0.0)}, in_keys=["x"], out_keys=["y"], target=0)
    message = r"cannot register EpsilonRule\(epsilon=0.0\) on module '0' \(Linear\): .* EpsilonRule\(epsilon=0.5\)"
    with pytest.raises(ValueError, match=message):
        lrp(TensorDict(x=x, batch_size=[5]))
    assert dict(layer._forward_hooks) == hooks and not layer._forward_pre_hooks
    by_hand.remove()
    relevance = lrp(TensorDict(x=x, batch_size=[5]))["relevance", "x"]
    torch.testing.assert_close(relevance, x * layer.weight.detach()[0], rtol=1e-12, atol=1e-14)
