"""Rules that never take effect: a module with a rule that does not run, while its parent does; and the ε-rule on
a block whose inner modules ran with rules of their own, refused (see :mod:`~tdhook.attribution._nested_rules`).

``nn.MultiheadAttention`` computes its output projection with ``out_proj.weight``
directly, never calling ``out_proj``; swin's attention does the same with its
``qkv`` and ``proj``. A rule registered on such a module has no effect, and the
parent's computation keeps its plain gradient. The first call of each input
signature in an LRP context (a forward may branch on a shape: see
:mod:`~tdhook.attribution._call_signatures`) watches which modules run and
warns, naming each such module. A module whose
parameters the graph of the call's outputs does not reach is unused, not
bypassed, and is not named (one whose parameters do not require grad leaves no
trace there, and is named all the same).

Examples:
    >>> import warnings
    >>> import torch
    >>> from tdhook.attribution import EpsilonRule
    >>> attention = torch.nn.MultiheadAttention(4, 2, batch_first=True)
    >>> modules = dict(attention.named_modules())
    >>> handles = [EpsilonRule().register(modules["out_proj"])]
    >>> use = RuleUse()
    >>> x = torch.randn(1, 3, 4)
    >>> with warnings.catch_warnings(record=True) as caught, use.watch(lambda: modules, handles):
    ...     warnings.simplefilter("always")
    ...     _ = attention(x, x, x)
    >>> "'out_proj'" in str(caught[0].message)
    True
    >>> handles[0].remove()
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import nn

from tdhook.attribution._nested_rules import (
    refuse_rescaling_over_ruled_modules,
    warn_for_plain_gradient_over_ruled_modules,
)
from tdhook.attribution.rules._attention_projections import projected_with
from tdhook.attribution.rules._caller import warn_at_caller
from tdhook.attribution.rules._first_pass import first_pass, watching_first_pass
from tdhook.attribution.rules.base import RemovableRuleHandle
from tdhook.attribution.rules.basic import IgnoreRule

__all__ = ["RuleUse"]

_NO_EFFECT = "a rule without effect"  # what RuleUse notes in the first pass's set (see first_pass) once it warned


class RuleUse:
    """Watches the first forward pass of each input signature after :meth:`reset` and warns about rules that did not
    take effect."""

    #: what :meth:`watch` returns when it does not watch: a context manager that does nothing.
    NOTHING = contextlib.nullcontext()

    def __init__(self) -> None:
        self._watched: set[Hashable] = set()  # the signatures whose first pass of the context was watched
        self._warned: set = set()  # what the rules warned about in those passes (see first_pass): once a context
        self._outputs: list[torch.Tensor] = []  # what the watched pass returned (see :meth:`saw`)

    def reset(self) -> None:
        """Watch the next forward pass of every signature (called when a context opens)."""
        self._watched.clear()
        self._warned = set()

    def saw(self, outputs: TensorDictBase) -> None:
        """Note what the watched pass returned: a module none of whose parameters its graph reaches is unused, and
        its rule is not named."""
        self._outputs = list(_tensors_of(outputs))

    def watches(self, handles: Sequence[RemovableRuleHandle], signature: Hashable = None) -> bool:
        """Whether the next forward pass of ``signature`` with the rules of ``handles`` is watched."""
        return signature not in self._watched and bool(handles)

    def watch(
        self,
        named_modules: Callable[[], Mapping[str, nn.Module]],
        handles: Sequence[RemovableRuleHandle],
        hooks: list | None = None,
        signature: Hashable = None,
    ) -> contextlib.AbstractContextManager[None]:
        """Run the block; if it is the first forward pass of ``signature`` (see
        :mod:`~tdhook.attribution._call_signatures`) since :meth:`reset`, warn about rules without effect.

        Args:
            named_modules: gives the model's modules by name (asked only when watching).
            handles: the handles of the registered rules.
            hooks: where the watch's hooks are listed while they are on the model (the context's hooks, which
                leaving the context removes: one left by an interrupt is removed then).
            signature: the call's: a forward may run other modules, or call a module's parameters directly, on
                inputs of another shape.
        """
        if signature in self._watched:
            return RuleUse.NOTHING  # every later call: nothing to set up
        if not handles:  # no module rule to watch; the function modes' rules still check their calls in this pass
            return self._first_pass_only(signature)
        return self._watching(named_modules, handles, [] if hooks is None else hooks, signature)

    @contextlib.contextmanager
    def _first_pass_only(self, signature: Hashable) -> Iterator[None]:
        try:
            with watching_first_pass(self._warned):
                warned = first_pass()
                yield
        finally:
            self._outputs = []  # noted for the module rules' check, which has none to check: not kept with its graph
        self._warned = warned
        self._watched.add(signature)  # as after a watched pass: a failed one is the first pass again at the next call

    @contextlib.contextmanager
    def _watching(
        self,
        named_modules: Callable[[], Mapping[str, nn.Module]],
        handles: Sequence[RemovableRuleHandle],
        hooks: list,
        signature: Hashable,
    ) -> Iterator[None]:
        modules = named_modules()
        ran: set[int] = set()
        # A hook on each module of the model, not a global one: torch.compile warns about global module hooks.
        mine: list = []
        noted: set | None = None
        try:
            for module in modules.values():  # each listed as it is registered
                mine.append(module.register_forward_pre_hook(lambda m, args: ran.add(id(m))))
                hooks.append(mine[-1])
            with watching_first_pass(self._warned):  # rules check their calls' inputs in this pass only
                noted = first_pass()  # what they noted: the projections an attention took with a module's rule
                yield
        finally:
            while mine:  # each left listed in ``hooks`` until it is removed (removing again does nothing)
                mine[-1].remove()
                if mine[-1] in hooks:
                    hooks.remove(mine[-1])
                mine.pop()
            outputs, self._outputs = self._outputs, []  # not kept with their graph past the pass
        # Raised before the pass counts as watched: every later call is refused alike.
        refuse_rescaling_over_ruled_modules(handles, modules, ran)
        warn_for_plain_gradient_over_ruled_modules(handles, modules, ran, noted)
        names = {id(module): name for name, module in modules.items()}
        reached: set[int] | None = None
        for handle in handles:
            module = handle.module
            if module is None or id(module) in ran or isinstance(handle.rule, IgnoreRule):
                continue
            if (_NO_EFFECT, id(module)) in noted:  # named in the first pass of another signature
                continue
            if not handle.rule.is_registered(module) or next(module.parameters(), None) is None:
                continue  # a module without parameters: its parent cannot compute with them directly
            name = names.get(id(module), "")
            parent_name = name.rpartition(".")[0]
            parent = modules.get(parent_name)
            if parent is None or parent is module or id(parent) not in ran:
                continue
            if projected_with(noted, module, handle.rule):  # nn.MultiheadAttention's out_proj under AttnLRP(epsilon)
                continue
            if outputs and all(p.requires_grad for p in module.parameters()):
                reached = _parameters_reached(outputs) if reached is None else reached
                if not any(id(p) in reached for p in module.parameters()):
                    continue  # unused: nothing computes with its parameters, so no relevance passes them by
            warn_at_caller(
                f"LRP: {handle.rule!r} on module {name!r} ({type(module).__name__}) has no effect: the module did "
                f"not run, although its parent {parent_name or 'the model'!r} ({type(parent).__name__}) did. The "
                "parent computes with the module's parameters directly (as nn.MultiheadAttention does with "
                "out_proj), so that computation keeps its plain gradient; map the parent to a rule, or use a "
                "preset that handles it (AttnLRP, CPLRP), with an ε for Linear layers given as the preset's epsilon "
                "(AttnLRP(epsilon=...)) rather than in rule_mapper"
            )
            noted.add((_NO_EFFECT, id(module)))
        # Watched once its warnings are out: a pass that failed or was interrupted, or a warning that the caller's
        # filter turned into an error (warnings.simplefilter("error")), is watched again at the next call.
        self._warned = noted
        self._watched.add(signature)


def _tensors_of(value: object) -> Iterator[torch.Tensor]:
    """The tensors ``value`` holds: itself, or a TensorDict's entries at every level, a lazy stack's by its
    TensorDicts (whose entries may not stack).

    >>> from tensordict import TensorDict, lazy_stack
    >>> stack = lazy_stack([TensorDict(x=torch.zeros(1)), TensorDict(x=torch.zeros(2))])
    >>> [t.shape for t in _tensors_of(TensorDict(a=torch.ones(3), s=stack))]
    [torch.Size([3]), torch.Size([1]), torch.Size([2])]
    """
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, TensorDictBase):
        parts = getattr(value, "tensordicts", None)  # a lazy stack's
        for part in parts if parts is not None else value.values():
            yield from _tensors_of(part)


def _parameters_reached(outputs: Sequence[torch.Tensor]) -> set[int]:
    """The ids of the leaves that require grad (the parameters, mostly) which the graphs of ``outputs`` reach.

    >>> layer = nn.Linear(2, 1)
    >>> id(layer.weight) in _parameters_reached([layer(torch.ones(2))])
    True
    """
    reached: set[int] = set()
    seen: set[Any] = set()
    nodes = [value.grad_fn for value in outputs if value.grad_fn is not None]
    while nodes:
        node = nodes.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node's leaf
        if variable is not None:
            reached.add(id(variable))
        nodes.extend(following for following, _ in node.next_functions if following is not None)
    return reached
