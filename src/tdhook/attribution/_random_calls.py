"""Random draws in a model's own forward, outside the modules that draw by design: an explanation is then random from
call to call, and the user is told once, naming the module.

A Dropout module in training mode is named by :mod:`~tdhook.attribution._random_modules`, a dropout function by the
coverage watch (see :func:`~tdhook.attribution._plain_gradient_reports.report_dropout_calls`). What neither sees is a
draw written in a forward with torch's random functions: Hugging Face's ViTMAE masks a random share of its patches
(``torch.rand``, then ``argsort``), torchrl's ``RSSMPrior`` and ``RSSMPosterior`` sample their state
(``mean + torch.randn_like(std) * std``). The watched first call of each input signature (see
:class:`~tdhook.attribution._nonlinear_calls.NonlinearCalls`) follows every such draw, by the module that makes it,
to the explained target (see :class:`RandomCalls`), and names a draw read into Python (``if torch.rand(()) < p:``,
``.item()``) or one whose values set a size read into Python (``len(torch.nonzero(mask))``), whose branch or size
no graph shows, but a draw in a sampler (tensordict's
``ProbabilisticTensorDictModule``: the action LRP explains is the one it drew, written beside the relevance), in a
torchrl exploration step (its noise is added after the explained output), in a module named for its draws already (a
Dropout module, an ``nn.RReLU``), and in this package's own code.

Examples:
    >>> import warnings
    >>> from torch import nn
    >>> draws, modules, x = RandomCalls(), {"encoder": nn.Identity()}, torch.ones(2, requires_grad=True)
    >>> noise = torch.randn_like(x)
    >>> draws.follow(torch.randn_like, (x,), None, noise, ["encoder"], modules)
    >>> y = x + noise
    >>> draws.follow(torch.add, (x, noise), None, y, ["encoder"], modules)
    >>> draws.found({y.grad_fn}), draws.found(set())
    ({'encoder': {'torch.randn_like': 1}}, {})
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     report_random_calls(draws.found({y.grad_fn}), modules)
    >>> str(caught[0].message)[:69]
    "LRP: module 'encoder' (Identity) draws at random in its own forward ("
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict.nn import ProbabilisticTensorDictModule
from torch import nn
from torchrl.modules import AdditiveGaussianModule, EGreedyModule, OrnsteinUhlenbeckProcessModule

from tdhook.attribution._random_modules import draw
from tdhook.attribution.mappers.aliases import module_place
from tdhook.attribution.rules._caller import warn_at_caller

__all__ = ["RANDOM_CALLS", "READS", "RandomCalls", "report_random_calls"]

# torch's functions that draw from a random generator, by the name a message gives them.
RANDOM_CALLS: dict[Any, str] = {
    **{getattr(torch, name): f"torch.{name}" for name in ("rand", "rand_like", "randn", "randn_like", "randint")},
    **{getattr(torch, name): f"torch.{name}" for name in ("randint_like", "randperm", "bernoulli", "multinomial")},
    **{getattr(torch, name): f"torch.{name}" for name in ("normal", "poisson")},
    **{
        getattr(torch.Tensor, name): f"Tensor.{name}"
        for name in ("bernoulli", "bernoulli_", "uniform_", "normal_", "exponential_", "geometric_", "log_normal_")
    },
    **{getattr(torch.Tensor, name): f"Tensor.{name}" for name in ("cauchy_", "random_", "multinomial")},
}

# Calls that hand a tensor's values to Python, where a branch or a size can depend on them: a draw read there reaches
# the output through the forward's control flow, with no node in its graph.
_READ_INTO_PYTHON: dict[Any, str] = {
    **{
        getattr(torch.Tensor, name): f"Tensor.{name}"
        for name in ("__bool__", "item", "tolist", "__int__", "__float__", "__index__", "numpy", "__array__")
    },
    **{getattr(torch, name): f"torch.{name}" for name in ("equal", "allclose", "is_nonzero")},
}

# Calls whose result's size depends on their input's values (``nonzero`` of a random mask), and those that read a size
# into Python: a draw read there sets how many elements the forward takes (``x[: len(kept)]``).
_SIZED_BY_VALUES = {torch.nonzero, torch.argwhere, torch.masked_select, torch.unique, torch.unique_consecutive}
_SIZED_BY_VALUES |= {torch.Tensor.nonzero, torch.Tensor.argwhere, torch.Tensor.masked_select, torch.Tensor.unique}
_SIZED_BY_VALUES |= {torch.repeat_interleave, torch.Tensor.repeat_interleave, torch.bincount, torch.Tensor.bincount}
_READ_SIZE: dict[Any, str] = {
    torch.Tensor.shape.__get__: "Tensor.shape",
    torch.Tensor.size: "Tensor.size",
    torch.Tensor.numel: "Tensor.numel",
    torch.Tensor.__len__: "len",
}

# The calls above, which this package's own code makes too (a rule's probe of a module's output): those are no read.
READS = frozenset(_READ_INTO_PYTHON) | frozenset(_READ_SIZE)

# Modules that draw by design, whose draws a call explains or that are named otherwise (see the module).
_DRAWING_BY_DESIGN = (
    ProbabilisticTensorDictModule,
    AdditiveGaussianModule,
    EGreedyModule,
    OrnsteinUhlenbeckProcessModule,
)


class RandomCalls:
    """The draws of one watched forward pass that a target depends on, by module name and function.

    Every tensor computed from a draw is marked as depending on it, with gradient or without (``argsort``, a slice,
    ``topk``'s indices); the autograd nodes of those with gradient (a sum with noise, a ``gather`` of the tokens a
    random permutation keeps, Informer's queries picked by keys sampled at random) are where a target's graph shows
    that its value depends on the draw. A draw that no target's graph reaches (a sampled action next to the explained
    logits, the noise of a state sampled next to the explained mean) is no reason to warn.
    """

    def __init__(self) -> None:
        self._reaching: list[tuple[str, str, Any]] = []  # (module, function, node of a call with gradient)
        self._read: list[tuple[str, str]] = []  # (module, function) of draws read into Python (a branch, a size)
        # By id: each tensor drawn or computed from a draw in the pass, held (its id is not reused meanwhile), and where
        # and how it was drawn. Kept here, not on the tensors: nothing is left on the model's or the caller's tensors.
        self._drawn: dict[int, tuple[torch.Tensor, tuple[str, str]]] = {}
        self._sized: set[int] = set()  # the ids, among those, of the tensors whose size depends on a draw

    def follow(self, func: Any, args: tuple, kwargs: dict | None, result: Any, stack: Sequence[str], modules) -> None:
        """Follow the call ``func(*args, **kwargs)`` that returned ``result``, made in the module innermost in
        ``stack`` (the names of the module calls open, outermost first) of ``modules``."""
        if func in RANDOM_CALLS:
            if not _by_design(stack, modules):
                self._mark(result, (stack[-1] if stack else "", RANDOM_CALLS[func]))
            return
        if not self._drawn:  # nothing drawn yet: the calls before a draw are not looked at
            return
        tensors = _flat(args, kwargs)
        origin = next(filter(None, map(self._origin, tensors)), None)
        if origin is None:
            return
        if func in _READ_INTO_PYTHON:  # ``if torch.rand(()) < p:``: the branch taken, not a node, depends on it
            self._read.append((origin[0], f"{origin[1]} read by {_READ_INTO_PYTHON[func]}"))
            return
        if func in _READ_SIZE:  # the size of a tensor drawn or computed from a draw, which depends on it only here
            if any(id(tensor) in self._sized for tensor in tensors):
                self._read.append((origin[0], f"{origin[1]} read by {_READ_SIZE[func]} of a size it sets"))
            return
        sized = func in _SIZED_BY_VALUES or any(id(tensor) in self._sized for tensor in tensors)
        sized |= func is torch.Tensor.__getitem__ and any(tensor.dtype is torch.bool for tensor in tensors[1:])
        self._mark(result, origin, sized)  # what is computed from a draw depends on it, with gradient or not
        node = next((t.grad_fn for t in _flat((result,), None) if t.grad_fn is not None), None)
        if node is not None:
            self._reaching.append((*origin, node))

    def found(self, reached: set) -> dict[str, dict[str, int]]:
        """Module name → function → number of draws whose node is in ``reached``, and of draws read into Python (a
        branch of the forward, which no graph shows) where a target has a graph at all."""
        found: dict[str, dict[str, int]] = {}
        read = [(name, function, None) for name, function in self._read] if reached else []
        for name, function, node in self._reaching + read:
            if node is None or node in reached:
                per_module = found.setdefault(name, {})
                per_module[function] = per_module.get(function, 0) + 1
        return found

    def _origin(self, tensor: torch.Tensor) -> tuple[str, str] | None:
        entry = self._drawn.get(id(tensor))
        return entry[1] if entry is not None and entry[0] is tensor else None

    def _mark(self, result: Any, origin: tuple[str, str], sized: bool = False) -> None:
        for tensor in _flat((result,), None):
            self._drawn[id(tensor)] = (tensor, origin)
            if sized:
                self._sized.add(id(tensor))
            else:
                self._sized.discard(id(tensor))


def _by_design(stack: Sequence[str], modules: Mapping[str, nn.Module]) -> bool:
    return any(
        isinstance(module, _DRAWING_BY_DESIGN) or draw(module) is not None
        for module in (modules.get(name) for name in stack)
    )


def _flat(args: tuple, kwargs: dict | None) -> list[torch.Tensor]:
    """The tensors among ``args`` and ``kwargs``' values, and in the lists and tuples among them (one level)."""
    values = [*args, *(kwargs or {}).values()]
    values += [v for value in values if isinstance(value, (list, tuple)) for v in value]
    return [value for value in values if isinstance(value, torch.Tensor)]


def report_random_calls(found: Mapping[str, Mapping[str, int]], modules: Mapping[str, nn.Module]) -> None:
    """Warn, per module, of the draws :meth:`RandomCalls.found` found: each forward pass draws anew, and the
    explanation is that of its own draw."""
    for name, functions in found.items():
        module = modules.get(name)
        kind = f" ({type(module).__name__})" if module is not None else ""
        warn_at_caller(
            f"LRP: {module_place(name, modules)}{kind} draws at random in its own forward ({', '.join(functions)}), "
            "so each forward pass draws anew and each call explains the output of its own draw, random from call "
            "to call; pass the draw as an input of the model where it takes one (ViTMAE's noise, for instance), "
            "or seed torch's generator before each call for a repeatable explanation"
        )
