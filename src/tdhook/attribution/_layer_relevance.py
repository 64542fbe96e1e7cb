"""Relevance at inner modules: the outputs of the layers named in ``layers``, and relevance checks.

:class:`OutputRelevance` records the relevance ``z * grad(z)`` of one module
output as the backward pass reaches it; :class:`LayerRelevance` gathers it for
the modules named in :class:`~tdhook.attribution.LRP`'s ``layers``, and
:func:`add_check_hooks` hands every module with a rule its relevance in and
out to a ``relevance_check``.

Examples:
    >>> import torch
    >>> layer = torch.nn.Linear(3, 2)
    >>> layers = LayerRelevance()
    >>> handle = layer.register_forward_hook(layers.hook("layer"))
    >>> x = torch.ones(1, 3, requires_grad=True)
    >>> out = layer(x)
    >>> out.backward(torch.ones_like(out))
    >>> torch.equal(layers.pop("layer", x), out.detach())
    True
    >>> handle.remove()
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from tdhook.attribution._agent_calls import AgentCall, current_agent, stacked_by_agent
from tdhook.attribution.mappers.aliases import every_named_module
from tdhook.attribution.rules._keeping_graph import graph_kept
from tdhook.attribution.rules._set_relevance import forget_watched, pop_set_relevance, probing, watch
from tdhook.attribution.rules.base import RemovableRuleHandle, Rule, layer_call_of, rules_apply
from tdhook.attribution.rules.batch_norm import MergeBatchNormRule

__all__ = [
    "LayerRelevance",
    "OutputRelevance",
    "RelevanceCheck",
    "add_check_hooks",
    "refuse_layers_inside_whole_rules",
]

RelevanceCheck = Callable[[str, nn.Module, torch.Tensor, torch.Tensor], None]


class OutputRelevance:
    """The relevance ``z * grad(z)`` of one module output, as the backward pass reaches it.

    When the module is a layer merged with the BatchNorm after it, the merged
    output's relevance takes precedence over the layer's own output. The
    gradient hooks it puts on the output hold the output (and, in a call that
    keeps the graph, a copy with its history): :meth:`release` removes them
    once the call is over, or the output would keep itself, and its graph, alive.
    """

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None
        self.merged = False
        self.shape: torch.Size | None = None
        self.handles: list[RemovableHandle] = []
        self.observed: list[tuple[list, Callable]] = []  # (a layer call's observers, the one this cell added)
        self.agent: AgentCall | None = None  # the agent of a multi-agent network whose call made the output

    @classmethod
    def watch(cls, output: torch.Tensor) -> OutputRelevance:
        """Start recording the relevance of ``output`` (and of its BatchNorm-merged form, if any).

        Args:
            output: a module's output.

        Returns:
            The cell that the backward pass fills.
        """
        cell = cls()
        cell.shape = output.shape
        cell.agent = current_agent()
        cell._hook(output, merged=False)
        call = layer_call_of(output)
        if call is not None:
            observer = functools.partial(cell._hook, merged=True)
            call.observers.append(observer)
            cell.observed.append((call.observers, observer))
        return cell

    def _hook(self, tensor: torch.Tensor, merged: bool) -> None:
        if not tensor.requires_grad:
            return
        # A copy (later in-place operations must not change it); with its history in a call that keeps the graph.
        relevance_pass = graph_kept()
        value = tensor.detach().clone() if relevance_pass is None else tensor.clone()
        watch(tensor)  # a first-layer rule reading it leaves there the relevance its gradient does not carry

        def record(grad: torch.Tensor) -> None:
            if probing():
                return  # a pass reading the glue's Jacobian, not the relevance pass
            if relevance_pass is not None and not relevance_pass.is_running:
                return  # a later backward pass through the graph the call kept (a loss on the relevance)
            set_there = pop_set_relevance(tensor, grad)  # each reader of the tensor, in one pass
            if merged or not self.merged:
                self.value, self.merged = value * grad, merged
                if set_there is not None:
                    self.value = self.value + set_there

        self.handles.append(tensor.register_hook(record))

    def release(self) -> None:
        """Remove the gradient hooks this cell put on the outputs it watches, and its observer of the layer call
        that made them (the call is over): the layer call lives in the graph, and would hold the cell from there."""
        for handle in self.handles:
            handle.remove()
        for observers, observer in self.observed:
            if observer in observers:
                observers.remove(observer)
        self.handles.clear()
        self.observed.clear()

    def total(self) -> torch.Tensor:
        """The relevance recorded so far, or a zero scalar if none."""
        return self.value if self.value is not None else torch.zeros(())

    def pop(self, like: torch.Tensor) -> torch.Tensor:
        """The relevance of the last backward pass (zeros if it never reached the output); then reset.

        Args:
            like: a tensor whose dtype and device the zeros take.

        Returns:
            The relevance, shaped like the watched output.
        """
        value = self.value if self.value is not None else torch.zeros(self.shape, dtype=like.dtype, device=like.device)
        self.value, self.merged = None, False
        return value


class LayerRelevance:
    """The output relevance of named inner modules, gathered during one call of the wrapper.

    A module called several times gets the relevance of all its outputs,
    summed.
    """

    def __init__(self) -> None:
        self._cells: dict[str, list[OutputRelevance]] = {}
        self._held: list[OutputRelevance | RemovableHandle] = []

    def hold(self, *hooks: OutputRelevance | RemovableHandle) -> None:
        """Keep the gradient hooks of this call (cells, or handles of tensor hooks) for :meth:`clear` to remove."""
        self._held.extend(hooks)

    def hook(self, name: str) -> Callable[[nn.Module, tuple, Any], None]:
        """A forward hook that watches the output of module ``name``.

        Args:
            name: the module's name, as ``layers`` gives it.

        Returns:
            The hook, for ``module.register_forward_hook``; it raises a
            ``TypeError`` if the output is not a tensor.
        """

        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not rules_apply():  # no gradient, or no call of the model's (the Taylor rule's at its reference)
                return
            if not isinstance(output, torch.Tensor):
                raise TypeError(
                    f"LRP: layers asks for the relevance of module {name!r} ({type(module).__name__}), "
                    f"whose output is a {type(output).__name__}, not a tensor"
                )
            self._cells.setdefault(name, []).append(OutputRelevance.watch(output))

        return hook

    def register(
        self, modules: Mapping[str, nn.Module], names: Iterable[str], into: list | None = None
    ) -> list[RemovableHandle]:
        """Watch the modules ``names`` (:meth:`hook`), each found under any name the model holds it under.

        Args:
            modules: the model's modules by name (the model itself at ``""``).
            names: the names ``layers`` gives, in order.
            into: where each handle goes as soon as its hook is registered (a new list by default), so that a
                registration that fails (an error, an interrupt) leaves none unlisted.

        Returns:
            The hooks' handles: ``into``.
        """
        handles = [] if into is None else into
        names = list(names)
        every = every_named_module(modules[""]) if names else {}
        for name in names:
            handles.append(every[name].register_forward_hook(self.hook(name)))
        return handles

    def clear(self) -> None:
        """Forget every watched output, before and after a call, and remove the gradient hooks put on them: a hook
        holds its tensor, and with it the tensor's graph, from inside that graph, beyond the reach of garbage
        collection."""
        if self._cells or self._held:  # most calls watch nothing: no generator built for them
            for cell in (cell for cells in self._cells.values() for cell in cells):
                cell.release()
            for hook in self._held:
                hook.release() if isinstance(hook, OutputRelevance) else hook.remove()
            self._cells, self._held = {}, []
        forget_watched()

    def pop(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The relevance of module ``name``'s outputs in the last backward pass; then reset.

        Args:
            name: the module's name.
            like: a tensor whose dtype and device the zeros of an unreached output take.

        Returns:
            The relevance, summed over the module's calls; the calls of a multi-agent network's agents, each with
            its own parameters, stacked along the network's agents' dimension.

        Raises:
            RuntimeError: the module did not run.
            ValueError: its calls had outputs of different shapes.
        """
        cells = self._cells.get(name, [])
        if not cells:
            raise RuntimeError(f"LRP: module {name!r} named in layers did not run in the forward pass")
        values = [cell.pop(like) for cell in cells]
        shapes = {tuple(v.shape) for v in values}
        if len(shapes) > 1:
            raise ValueError(
                f"LRP: module {name!r} named in layers ran {len(values)} times with different output shapes "
                f"{sorted(shapes)}; its relevance cannot be summed into one key"
            )
        agents = [cell.agent for cell in cells]
        if any(agent is not None for agent in agents):  # one call per agent, each with its own parameters
            return stacked_by_agent(name, values, agents)
        return sum(values[1:], values[0])


def refuse_layers_inside_whole_rules(
    rules: Mapping[str, Rule], modules: Mapping[str, nn.Module], names: Iterable[str]
) -> None:
    """Raise where a module named in ``layers`` is inside a module whose rule hands the gradient back past it.

    A rule without :attr:`~tdhook.attribution.rules.base.Rule.reaches_inner_modules` (the Taylor rule) takes its
    module's input gradient from its own evaluation: the outputs of the modules inside receive none, and their
    relevance would read as zeros.

    Args:
        rules: the context's rules by module name.
        modules: the model's modules by name (the model itself at ``""``).
        names: the names ``layers`` gives.

    Raises:
        ValueError: naming the module asked for, the module around it and its rule.

    Examples:
        >>> from tdhook.attribution.rules import TaylorDecompositionRule
        >>> net = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Tanh()), nn.Linear(2, 1))
        >>> modules = dict(net.named_modules())
        >>> try:
        ...     refuse_layers_inside_whole_rules({"0": TaylorDecompositionRule()}, modules, ["0.0"])
        ... except ValueError as error:
        ...     print(str(error).split(", whose")[0])
        LRP: layers asks for the relevance of module '0.0' (Linear), inside module '0' (Sequential)
    """
    whole = [(name, rule) for name, rule in rules.items() if not rule.reaches_inner_modules and name in modules]
    names = list(names)
    if not whole or not names:
        return
    every = every_named_module(modules[""])
    for outer_name, rule in whole:
        outer = modules[outer_name]
        inside = {id(module) for module in outer.modules() if module is not outer}
        for name in names:
            if id(every[name]) in inside:
                raise ValueError(
                    f"LRP: layers asks for the relevance of module {name!r} ({type(every[name]).__name__}), "
                    f"inside module {outer_name!r} ({type(outer).__name__}), whose {rule!r} takes the block's input "
                    "gradient from its own evaluation: the modules inside receive no relevance. Ask for the "
                    f"block's output ({outer_name!r}) or an input of it, or explain the block by rules on the modules "
                    "inside instead of this one"
                )


def add_check_hooks(
    handles: Sequence[RemovableRuleHandle],
    modules: dict[str, nn.Module],
    check: RelevanceCheck,
    layers: LayerRelevance | None = None,
) -> list[RemovableHandle]:
    """Hooks that run ``check(name, module, relevance_in, relevance_out)`` on every module with a rule.

    Each module gets a view of its own input, so that the relevance in is its
    share only, even when the input also feeds other modules (a residual
    branch). In-place modules and merged BatchNorms (checked as part of the
    layer before them) are left out.

    Args:
        handles: the handles of the registered rules; their records add to
            the relevance in.
        modules: the wrapped model's modules by name.
        check: the relevance check.
        layers: where the gradient hooks each call puts are held, for its :meth:`LayerRelevance.clear` to remove.

    Returns:
        The handles of the hooks registered, for removal.
    """
    names = {id(m): n for n, m in modules.items()}

    def records_for(x: torch.Tensor) -> torch.Tensor | int:
        return sum(r for h in handles for t, r in h.records if t is x)

    def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        key = _one_input(args, kwargs)
        if key is None or not rules_apply():
            return None
        x = args[0] if key == 0 else kwargs[key]
        if isinstance(x, torch.Tensor) and x.requires_grad:
            # A view of its own, so that the gradient seen is this module's share only,
            # even when the input also feeds other modules (a residual branch).
            alias = x.view_as(x)
            alias._tdhook_alias_of = x
            watch(alias)  # a first-layer rule leaves there the relevance it sets that no gradient carries
            return ((alias,), kwargs) if key == 0 else (args, {**kwargs, key: alias})
        return None

    def forward_hook_for(name: str) -> Callable[[nn.Module, tuple, dict, Any], None]:
        def forward_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if not (rules_apply() and isinstance(output, torch.Tensor) and output.requires_grad):
                return
            key = _one_input(args, kwargs)
            x = None if key is None else args[0] if key == 0 else kwargs[key]
            if not hasattr(x, "_tdhook_alias_of"):
                return
            out, relevance_pass = OutputRelevance.watch(output), graph_kept()

            def run_check(grad: torch.Tensor) -> None:
                if probing():
                    return  # a pass reading the glue's Jacobian, not the relevance pass
                if relevance_pass is None or relevance_pass.is_running:  # not a later pass through a kept graph
                    # What a first-layer rule set at its input beyond the gradient: on the input, or as records on
                    # the explained inputs up the glue (a normaliser before the layer), which the input is not.
                    set_there = pop_set_relevance(x, grad)
                    rest = set_there if set_there is not None else records_for(x)
                    check(name, module, x.detach() * grad + rest, out.total())

            handle = x.register_hook(run_check)
            if layers is not None:
                layers.hold(out, handle)

        return forward_hook

    hooks: list[RemovableHandle] = []
    try:
        for handle in handles:
            module = handle.module
            if getattr(module, "inplace", False) or isinstance(handle.rule, MergeBatchNormRule):
                continue  # a merged BatchNorm is checked as part of the layer before it
            if not handle.rule.is_registered(module) or not handle.rule.decides_every_call:
                continue
            hooks.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
            hooks.append(module.register_forward_hook(forward_hook_for(names[id(module)]), with_kwargs=True))
    except BaseException:  # leave the model as it was
        for hook in hooks:
            hook.remove()
        raise
    return hooks


def _one_input(args: tuple, kwargs: dict) -> int | str | None:
    """Where a call's one input is: ``0`` for ``module(x)`` (keywords beside it, flags, are no input), its keyword for
    ``module(input=x)``; ``None`` for a call with several tensors or none.

    Examples:
        >>> x = torch.ones(2)
        >>> _one_input((x,), {}), _one_input((), {"input": x}), _one_input((), {"query": x, "key": x})
        (0, 'input', None)
    """
    if len(args) == 1:
        return 0
    if not args and len(kwargs) == 1:
        return next(iter(kwargs))
    return None
