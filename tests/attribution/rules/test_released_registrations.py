"""What a rule keeps for a layer (its registration: the prepared state, copies of the layer's weights modified or
merged with a BatchNorm) is freed as soon as the rule is removed, by reference counting alone.

A reference cycle through a rule's hook kept every registration, and with it two to six copies of each layer's
weights, until the garbage collector's next full pass: in a process with many long-lived objects that pass is rare,
and each context left its copies behind (some 0.6 GB per ``with LRP(...)`` block on a float64 ResNet-18 under
EpsilonGammaBox). The tests run with the collector off and watch the registrations and their states through weak
references.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP, EpsilonAlpha2Beta1, EpsilonGammaBox, EpsilonPlus, EpsilonPlusFlat
from tdhook.attribution.rules import AlphaBetaRule, GammaRule, Rule
from tests.attribution._helpers import small_bn_cnn
from tests.conftest import relative_error

F64 = torch.float64


def tensors_held_by(registration: object) -> list[torch.Tensor]:
    """The tensors a registration holds: its prepared state (nested dicts, lists, records) and its record of the
    layer's parameters, but not the modules, rules and functions it refers to."""
    found, seen, pending = [], set(), [registration]
    while pending:
        item = pending.pop()
        if id(item) in seen or isinstance(item, (nn.Module, Rule, type, str)) or callable(item):
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            found.append(item)
        else:
            pending.extend(gc.get_referents(item))
    return found


@pytest.fixture
def kept(monkeypatch) -> Callable[[nn.Module], list[tuple[weakref.ref, bool]]]:
    """With the garbage collector off for the test: a function that, called inside a context, gives weak references
    to the registrations the rules made and to the tensors they hold (the model's own parameters and buffers left
    out), each with whether it is a tensor's."""
    made: list[object] = []
    new_registration = Rule._new_registration

    def watched(self, module):
        made.append(new_registration(self, module))
        return made[-1]

    def references(model: nn.Module) -> list[tuple[weakref.ref, bool]]:
        own = {id(t) for t in (*model.parameters(), *model.buffers())}
        held = [t for registration in made for t in tensors_held_by(registration) if id(t) not in own]
        refs = [(weakref.ref(obj), isinstance(obj, torch.Tensor)) for obj in (*made, *held)]
        made.clear()
        return refs

    monkeypatch.setattr(Rule, "_new_registration", watched)
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield references
    finally:
        if enabled:
            gc.enable()


def assert_freed(refs: list[tuple[weakref.ref, bool]], copies: int) -> None:
    tensors = sum(is_tensor for _, is_tensor in refs)
    assert tensors >= copies, f"the rules held {tensors} tensors, expected at least {copies}"
    alive = [ref() for ref, _ in refs if ref() is not None]
    assert alive == [], f"{len(alive)} of {len(refs)} registrations and tensors they held outlive the rules"


# The mappers, and how many tensors (weight copies, merged layers, records of the parameters) their rules hold at
# least on the small CNN: every Conv2d and the Linear keep a record of their parameters where they derive a state.
MAPPERS: dict[str, tuple[Callable[[], object], int]] = {
    "EpsilonPlus": (EpsilonPlus, 4),
    "EpsilonPlusFlat": (EpsilonPlusFlat, 4),
    "EpsilonGammaBox": (lambda: EpsilonGammaBox(-3.0, 3.0), 4),
    "EpsilonAlpha2Beta1": (EpsilonAlpha2Beta1, 4),
    "gamma-on-every-layer": (lambda: {nn.Conv2d: GammaRule(), nn.Linear: GammaRule()}, 6),
    "z-plus-on-every-layer": (lambda: {nn.Conv2d: AlphaBetaRule(1.0, 0.0), nn.Linear: AlphaBetaRule(1.0, 0.0)}, 6),
}


@pytest.mark.parametrize("create_graph", [False, True], ids=["plain", "create_graph"])
@pytest.mark.parametrize("mapper", sorted(MAPPERS))
def test_a_context_frees_what_its_rules_held_when_it_exits(kept, mapper: str, create_graph: bool):
    make, copies = MAPPERS[mapper]
    model = small_bn_cnn()
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1), dtype=F64)
    with LRP(model, rule_mapper=make(), in_keys=["x"], out_keys=["y"], create_graph=create_graph) as lrp:
        first = lrp(TensorDict(x=x, batch_size=[2]))["relevance", "x"].detach()
        second = lrp(TensorDict(x=x, batch_size=[2]))["relevance", "x"].detach()
        refs = kept(model)
    del lrp
    assert relative_error(second, first) <= 1e-12  # what the rules kept served the second call as the first
    assert_freed(refs, copies if not create_graph else 0)


@pytest.mark.parametrize("mapper", sorted(MAPPERS))
def test_a_call_outside_a_context_frees_what_its_rules_held(kept, mapper: str, monkeypatch):
    make, copies = MAPPERS[mapper]
    model = small_bn_cnn()
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1), dtype=F64)
    refs: list[tuple[weakref.ref, bool]] = []
    exit_context = LRP.__exit__

    def exit_watched(self, *args):
        refs.extend(kept(model))  # inside the context the call opened, just before it closes
        return exit_context(self, *args)

    monkeypatch.setattr(LRP, "__exit__", exit_watched)
    LRP(model, rule_mapper=make(), in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[2]))
    assert_freed(refs, copies)
