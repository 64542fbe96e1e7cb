"""The ε-rule on a module whose inner modules change the gradient with rules of their own: refused; the plain
gradient asked for a container of such modules: warned of.

:class:`~tdhook.attribution.rules.basic.EpsilonRule` rescales a module's output
gradient and lets the module's own backward do the rest. On a container (an
``nn.Sequential``, a residual block, the whole model) that backward runs
through the rules of the modules inside it, so the ε-rule of the block would be
applied on top of theirs (the last layer's output stabilised twice), which is
neither the ε-rule of the block as one layer (its plain Jacobian) nor the rules
of its layers. The wrapper refuses the pair at the first call of a context,
naming both modules, where the inner module ran. Inner rules that keep the plain
gradient (``IgnoreRule``, LRP-0, a pass rule that registers nothing on ``nn.ReLU``), and
those of modules the block does not call (``nn.MultiheadAttention`` computes
with ``out_proj.weight`` directly), leave the block's ε-rule exact.

A rule of one's own (see :func:`~tdhook.attribution.rules._rewrites.is_own_rewrite`) on a module with modules
inside is refused alike: where its redirect goes to the block's output, or to a pass of the block's own modules,
the gradient runs through their rules too, and the two stack without a word (zennit's composites map leaf layers
only). With the modules inside mapped to ``IgnoreRule``, the block's rule alone decides its relevance.

:class:`~tdhook.attribution.rules.basic.IgnoreRule` on a module gives the plain gradient of what the module's own
forward computes; the modules inside it keep their rules. On a container that computes nothing of its own (an
``nn.Sequential``, ``nn.ModuleList``, ``nn.ModuleDict``, a ``TensorDictModule`` or ``TensorDictSequential``) it
changes nothing at all, and where modules inside it ran with rules that change the gradient, the block's relevance
is theirs, not its plain gradient: the wrapper warns at the first call of each input signature of a context, naming
the container and them (:func:`warn_for_plain_gradient_over_ruled_modules`), once a context.

Examples:
    >>> from torch import nn
    >>> from tdhook.attribution.rules import EpsilonRule
    >>> net = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Tanh()), nn.Linear(2, 1))
    >>> modules = dict(net.named_modules())
    >>> handles = [EpsilonRule().register(modules["0"]), EpsilonRule().register(modules["0.0"])]
    >>> try:
    ...     refuse_rescaling_over_ruled_modules(handles, modules, ran={id(m) for m in net.modules()})
    ... except ValueError as error:
    ...     print(str(error).split(" of the")[0])
    LRP: EpsilonRule(epsilon=1e-06) on module '0' (Sequential) would act on top
    >>> for handle in handles:
    ...     handle.remove()
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from tensordict.nn import TensorDictModuleBase
from torch import nn

from tdhook.attribution.rules._caller import warn_at_caller
from tdhook.attribution.rules.base import RemovableRuleHandle
from tdhook.attribution.rules.basic import EpsilonRule, IgnoreRule

__all__ = ["refuse_rescaling_over_ruled_modules", "warn_for_plain_gradient_over_ruled_modules"]

# Modules whose forward only calls their children: the plain gradient of what they compute themselves is nothing.
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict, TensorDictModuleBase)

_SHOWN = 3  # inner modules an error names

_PLAIN_OVER_RULES = "IgnoreRule over ruled modules"  # what warn_for_plain_gradient_over_ruled_modules notes


def _changes_gradient(handle: RemovableRuleHandle) -> bool:
    """Whether the rule of ``handle`` may change its module's gradient: it has hooks, is more than a mark, and is not
    LRP-0 (the ε-rule with ``ε = 0``, gradient × input)."""
    rule = handle.rule
    lrp0 = type(rule) is EpsilonRule and rule.epsilon == 0
    return bool(handle.hook_handles()) and not isinstance(rule, IgnoreRule) and not rule.only_marks and not lrp0


def refuse_rescaling_over_ruled_modules(
    handles: Sequence[RemovableRuleHandle], modules: Mapping[str, nn.Module], ran: Collection[int]
) -> None:
    """Raise where an ε-rule, or a rule of one's own, is on a module some of whose inner modules ran with rules that
    change their gradient.

    Args:
        handles: the handles of the context's rules.
        modules: the model's modules by name.
        ran: the ``id`` of each module that ran in the call watched.
        warned: what was warned about before in the context (a container is named once); its warnings are added.

    Raises:
        ValueError: naming the module with the ε-rule (or the rule of one's own), the rule, and the first inner
            modules with rules of their own, and what to map instead.
    """
    rescaling = [
        h
        for h in handles
        if (isinstance(h.rule, EpsilonRule) or h.rule.own_rewrite) and h.module is not None and h.module._modules
    ]
    if not rescaling:
        return
    names = {id(module): name for name, module in modules.items()}
    ruled = {id(h.module): h.rule for h in handles if id(h.module) in ran and _changes_gradient(h)}
    for handle in rescaling:
        outer = handle.module
        inner = _ruled_inside(outer, ruled)
        if not inner:
            continue
        path = names.get(id(outer), "?")
        shown = ", ".join(
            f"{names.get(id(module), name)!r} ({type(module).__name__}): {ruled[id(module)]!r}"
            for name, module in inner[:_SHOWN]
        )
        more = f" and {len(inner) - _SHOWN} more" if len(inner) > _SHOWN else ""
        pattern = f"{path}.*" if path else "*"
        where = f"LRP: {handle.rule!r} on module {path or 'the model itself'!r} ({type(outer).__name__})"
        if handle.rule.own_rewrite and not isinstance(handle.rule, EpsilonRule):
            raise ValueError(
                f"{where} would act on top of the rules of the modules inside it ({shown}{more}): a rule of one's own "
                "on a module with modules inside stacks with theirs, as the gradient it hands to the block's output "
                f"(or to a pass of its modules) runs through their rules too. Map the modules inside to IgnoreRule() "
                f"(a pattern such as {pattern!r}) so that the block's rule alone decides its relevance, or map the "
                "rule to the layers inside instead"
            )
        raise ValueError(
            f"{where} would act on top of the rules of the modules inside it ({shown}{more}): its own backward runs "
            f"through theirs. Map the rule to the layers inside instead (a pattern such as {pattern!r}, or their "
            "types), map those modules to IgnoreRule() to treat the block as one ε-layer, or use "
            "TaylorDecompositionRule for a block"
        )


def _ruled_inside(outer: nn.Module, ruled: Mapping[int, object]) -> list[tuple[str, nn.Module]]:
    """The modules inside ``outer`` (by their names in it) among ``ruled``."""
    return [
        (name, module)
        for name, module in outer.named_modules(remove_duplicate=False)
        if module is not outer and id(module) in ruled
    ]


def warn_for_plain_gradient_over_ruled_modules(
    handles: Sequence[RemovableRuleHandle],
    modules: Mapping[str, nn.Module],
    ran: Collection[int],
    warned: set | None = None,
) -> None:
    """Warn where :class:`~tdhook.attribution.rules.basic.IgnoreRule`, asked for by the caller, is on a container
    some of whose inner modules ran with rules that change their gradient: it changes nothing there.

    Args:
        handles: the handles of the context's rules.
        modules: the model's modules by name.
        ran: the ``id`` of each module that ran in the call watched.
        warned: what was warned about before in the context (a container is named once); its warnings are added.

    Examples:
        >>> import warnings
        >>> from tdhook.attribution.rules import AlphaBetaRule
        >>> net = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), nn.Linear(2, 1))
        >>> modules = dict(net.named_modules())
        >>> handles = [IgnoreRule().register(modules["0"]), AlphaBetaRule(1.0, 0.0).register(modules["0.0"])]
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_for_plain_gradient_over_ruled_modules(handles, modules, ran={id(m) for m in net.modules()})
        >>> str(caught[0].message).split(":")[1]
        " IgnoreRule() on module '0' (Sequential) changes nothing"
        >>> for handle in handles:
        ...     handle.remove()
    """
    plain = [
        h
        for h in handles
        if isinstance(h.rule, IgnoreRule) and h.rule._plain_inside and isinstance(h.module, _CONTAINERS)
    ]
    if not plain:
        return
    names = {id(module): name for name, module in modules.items()}
    ruled = {id(h.module): h.rule for h in handles if id(h.module) in ran and _changes_gradient(h)}
    for handle in plain:
        inner = _ruled_inside(handle.module, ruled)
        if not inner or (warned is not None and (_PLAIN_OVER_RULES, id(handle.module)) in warned):
            continue
        path = names.get(id(handle.module), "?")
        shown = ", ".join(
            f"{names.get(id(module), name)!r} ({type(module).__name__}): {ruled[id(module)]!r}"
            for name, module in inner[:_SHOWN]
        )
        more = f" and {len(inner) - _SHOWN} more" if len(inner) > _SHOWN else ""
        pattern = f"{path}.*" if path else "*"
        warn_at_caller(
            f"LRP: {handle.rule!r} on module {path or 'the model itself'!r} ({type(handle.module).__name__}) changes "
            f"nothing: the container computes nothing of its own, and the modules inside it keep their rules "
            f"({shown}{more}), so the block's relevance is not its plain gradient. Map the modules inside to "
            f"IgnoreRule() (a pattern such as {pattern!r}) for that, or leave the container out of the mapping"
        )
        if warned is not None:
            warned.add((_PLAIN_OVER_RULES, id(handle.module)))
