"""Modules put into the model, replaced or taken out while an LRP context is open: the context follows the change.

A context gives the rules once, when it opens, to the modules the model has then. A module put in later
(``model[2] = nn.Conv2d(...)``, a new head, a step appended to a pipeline) had no rule: it kept its plain gradient
(LRP-0), and every later call of the context explained the model as if the preset did not apply there, with no word
(a small CNN under ``EpsilonPlus`` 118 % off, relative L2, and an MLP under ``UniformEpsilon`` 57 % off the changed
model explained in a context entered after the change). A module taken out left the first-layer rules of the old
layout in place. Each call now compares the model's modules with those the context found, cheaply (each module's
children, by identity, in one pass; where the call's check of the modules holding buffers, which passes over the
same modules, found them as they were when the context's were last confirmed, that check stands for this one), and
where they differ the context is left and entered again: the rules are
given anew to the model as it is, as a context entered after the change gives them. Parametrizations registered or
removed in the meantime (``weight_norm``, ``spectral_norm``) change nothing: their modules compute a layer's weight,
which the layer's rule reads at each call.

Hooks of the caller's put on the model's modules (or torch's global ones) in the meantime are a change too: the
first call of a context watches the backward hooks and the hooks a forward puts on tensors, and refuses those that
change the gradient (see ``tdhook.attribution._gradient_hooks``); a hook registered after it (``register_full_
backward_hook`` halving a layer's gradient between two calls of a rollout) was taken into the relevance, halved,
with no word. Each call compares torch's hook counter (it grows with every hook registered anywhere) with its value
when this context's last call ended; where it moved, the count and sum of the hook ids of each kind over the
model's modules (ids only grow: a hook added, or one swapped for another, moves them) with those found before, and
where they differ the call is watched as a first one, which checks the hooks.

Examples:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from torch import nn
    >>> from tdhook.attribution import LRP, UniformEpsilon
    >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    >>> lrp = LRP(net, UniformEpsilon(), in_keys=["x"], out_keys=["y"])
    >>> td = TensorDict(x=torch.ones(3, 2), batch_size=[3])
    >>> with lrp:
    ...     _ = lrp(td)
    ...     net[2] = nn.Linear(2, 1)  # a new head: the next call gives it the preset's rule
    ...     relevance = lrp(td)["relevance", "x"]
    >>> torch.equal(relevance, lrp(td)["relevance", "x"])  # a call outside the context enters one of its own
    True
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn
from torch.nn.modules import module as module_globals
from torch.nn.utils import parametrize
from torch.utils.hooks import RemovableHandle

from tdhook.attribution.methods._batch_statistics import _CHILDREN, _children
from tdhook.attribution.rules._identity import IdentityWeakKeyDict
from tdhook.attribution.tunables import _ARGUMENTS

__all__ = ["follow_model_changes", "forget_modules", "note_call_end", "record_modules"]


class _Found:
    """The modules an open context found, and the children of each, in a row."""

    __slots__ = (
        "children",
        "computing_weights",
        "hooks",
        "lead",
        "lead_children",
        "linked",
        "mapper",
        "modules",
        "stamp",
    )

    def __init__(self, modules: Iterable[nn.Module], mapper: tuple = (None, None)) -> None:
        self.modules = list(modules)
        self.mapper = mapper  # the owner's rule mapper and the arguments it was last built with (see _mapper_of)
        self.children = _children(self.modules)
        self.computing_weights = _parametrization_modules(self.modules)
        # A check of the buffer holders (BufferHolders.checked) found these modules, after ``lead`` (the
        # wrapper's own modules, ``lead_children`` children in all), with these children.
        self.linked: tuple | None = None
        self.lead: list[nn.Module] = []
        self.lead_children = 0
        # The hooks on the modules when last compared (see _hooks_on), and torch's hook counter when the context's
        # last call ended.
        self.hooks: tuple | None = None
        self.stamp = -1

    def unchanged(self, checked: tuple | None) -> bool:
        """The modules have the children they had. ``checked``: what this call's check of the buffer holders found
        (the model's modules and their children in a row, as they are now), or ``None``."""
        if checked is not None and checked is self.linked and _count(self.lead) == self.lead_children:
            # The holders' modules have the children they had when linked: these modules' children follow the
            # lead's, unchanged in number, so they are those found.
            return True
        if not _same(_children(self.modules), self.children):
            return False
        if checked is not None:
            self._link(checked)
        return True

    def _link(self, checked: tuple) -> None:
        modules, children = checked[1], checked[2]
        lead = modules[: len(modules) - len(self.modules)]
        count = _count(lead)
        if (
            len(modules) >= len(self.modules)
            and _same(modules[len(lead) :], self.modules)
            and _same(children[count:], self.children)
        ):
            self.linked, self.lead, self.lead_children = checked, lead, count


# Per open context (its wrapper, held weakly), the modules it gave its rules to.
_FOUND: IdentityWeakKeyDict[object, _Found] = IdentityWeakKeyDict()


def record_modules(owner: object, modules: Mapping[str, nn.Module]) -> None:
    """Record ``modules`` (the model's modules by name, the model itself at ``""``) as those ``owner``'s context
    gave its rules to."""
    _FOUND[owner] = _Found(modules.values(), _mapper_of(owner))


def forget_modules(owner: object) -> None:
    """Forget what :func:`record_modules` recorded for ``owner`` (its context is left)."""
    _FOUND.pop(owner, None)


def follow_model_changes(lrp: Any) -> None:
    """Enter ``lrp``'s open context again where a module was put into the model, replaced, moved or taken out since
    the context was entered (its rules are given to the model as it is now); nothing where the model is as it was,
    or where only parametrizations came or went."""
    found = _FOUND.get(lrp)
    if found is None:
        return
    if RemovableHandle.next_id != found.stamp:  # a hook registered somewhere since the last call: one of the model's?
        hooks = _hooks_on(found.modules)
        if found.hooks is not None and hooks != found.hooks:
            lrp._coverage.watch_every_signature_again()  # the watch checks the hooks (a refused call, again)
        found.hooks = hooks
    if _given(lrp, found):
        if found.unchanged(lrp._buffer_holders.take_checked()):
            return
    else:  # another model or rule mapper given to the wrapper, or the mapper built anew (set_kwargs)
        lrp._leave(lrp._handles or [])
        lrp._enter()
        return
    now = list(found.modules[0].modules()) if found.modules else []
    before = {id(module) for module in found.modules}
    after = {id(module) for module in now}
    weights = found.computing_weights | _parametrization_modules(now)
    if (before ^ after) <= weights and _same(_without(now, weights), _without(found.modules, weights)):
        _FOUND[lrp] = _Found(now)  # parametrizations only: the layers read their weights at each call
        return
    lrp._leave(lrp._handles or [])
    lrp._enter()


def note_call_end(lrp: Any) -> None:
    """Note torch's hook counter at the end of a call of ``lrp`` (its own hooks on the graph included)."""
    found = _FOUND.get(lrp)
    if found is not None:
        found.stamp = RemovableHandle.next_id


_HOOK_DICTS = tuple(
    operator.attrgetter(name)
    for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
)


def _hooks_on(modules: list[nn.Module]) -> tuple:
    """The count and the sum of the hook ids of each kind over ``modules``, and of torch's global hooks.

    Examples:
        >>> net = nn.Linear(2, 2)
        >>> before = _hooks_on([net])
        >>> handle = net.register_full_backward_hook(lambda *args: None)
        >>> _hooks_on([net]) != before, handle.remove(), _hooks_on([net]) == before
        (True, None, True)
    """
    dicts = [list(map(get, modules)) for get in _HOOK_DICTS]
    dicts += [[hooks] for hooks in (module_globals._global_forward_hooks, module_globals._global_forward_pre_hooks)]
    dicts += [[hooks] for hooks in (module_globals._global_backward_hooks, module_globals._global_backward_pre_hooks)]
    return tuple((sum(map(len, kind)), sum(map(sum, kind))) for kind in dicts)


def _given(lrp: Any, found: _Found) -> bool:
    """Whether ``lrp`` still wraps the model its context gave the rules to (``lrp.module``, or the module inside the
    ``TensorDictModule`` a plain module was wrapped in), with the rule mapper they came from, as it was built."""
    module = lrp._modules["module"]
    root = module._modules.get("module") if lrp._name_prefix else module
    mapper, arguments = found.mapper
    return (
        (not found.modules or root is found.modules[0])
        and lrp.rule_mapper is mapper
        and getattr(mapper, "__dict__", {}).get(_ARGUMENTS) is arguments
    )


def _mapper_of(owner: object) -> tuple:
    """``owner``'s rule mapper and the arguments a tunable mapper was last built with: ``set_kwargs`` builds it anew,
    with new rules, on the same object."""
    mapper = getattr(owner, "rule_mapper", None)
    return mapper, getattr(mapper, "__dict__", {}).get(_ARGUMENTS)


def _count(modules: list[nn.Module]) -> int:
    """How many children ``modules`` have in all."""
    return sum(map(len, map(_CHILDREN, modules)))


def _without(modules: list[nn.Module], ids: set[int]) -> list[nn.Module]:
    return [module for module in modules if id(module) not in ids]


def _same(modules: list[nn.Module], others: list[nn.Module]) -> bool:
    """The same modules in the same order, told apart by identity (``TensorDictParams`` compare element-wise)."""
    return len(modules) == len(others) and all(map(operator.is_, modules, others))


def _parametrization_modules(modules: Iterable[nn.Module]) -> set[int]:
    """``id`` of every module that computes a parametrized tensor of one of ``modules`` (their ``parametrizations``
    and the modules inside)."""
    ids: set[int] = set()
    for module in modules:
        if parametrize.is_parametrized(module):
            ids.update(id(inner) for inner in module.parametrizations.modules())
    return ids
