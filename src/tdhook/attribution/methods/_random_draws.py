"""Targets that change from one forward pass to the next on the same input: a model that draws at random in its own
forward (torchrl's ``RSSMPrior`` and ``RSSMPosterior`` sample their state, ``mean + torch.randn_like(std) * std``).

A method that runs the model again on perturbed copies (perturbation, path and
sampling methods) compares outputs of separate forward passes. Where the
explained output depends on a draw the model makes itself, every pass draws
anew, and the differences are those of independent draws rather than of the
perturbation. The draws the library knows by their modules (dropout in
training mode, a probabilistic module sampling at random, an exploration step)
are named by their own warnings; the others are found by what the pass does:
where the global random state moved during the caller's pass, the model runs
once more on the same inputs (on the method's fork of the random state, once
per wrapper), and a target that differs is warned of, naming the modules whose
own forward moved the random state.

Examples:
    >>> from torch import nn
    >>> class Noisy(nn.Module):
    ...     def forward(self, x):
    ...         return x + torch.randn_like(x)
    >>> net = nn.Sequential(nn.Linear(2, 2), Noisy())
    >>> moved, drawers = drawing_modules(dict(net.named_modules()), lambda: net(torch.randn(3, 2)))
    >>> drawers
    ['1']
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from tdhook.attribution.methods._global_rng import cuda_devices
from tdhook.attribution.rules._caller import warn_at_caller

__all__ = ["RandomDraws", "drawing_modules", "drew", "random_states", "redrawn"]


def random_states(model: nn.Module) -> list[torch.Tensor]:
    """The global random states a forward pass of ``model`` draws from: the CPU's and those of its CUDA devices.

    Examples:
        >>> before = random_states(nn.Linear(2, 2))
        >>> _ = torch.rand(1)
        >>> all(torch.equal(a, b) for a, b in zip(before, random_states(nn.Linear(2, 2))))
        False
    """
    return [torch.get_rng_state(), *(torch.cuda.get_rng_state(device) for device in cuda_devices(model))]


def _moved(before: list[torch.Tensor], after: list[torch.Tensor]) -> bool:
    return any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


def drew(model: nn.Module, before: list[torch.Tensor]) -> bool:
    """Whether the global random states of ``model`` (see :func:`random_states`) moved from ``before``.

    Examples:
        >>> net = nn.Linear(2, 2)
        >>> before = random_states(net)
        >>> drew(net, before), (torch.rand(1), drew(net, before))[1]
        (False, True)
    """
    return _moved(before, random_states(model))


def drawing_modules(modules: Mapping[str, nn.Module], run: Callable[[], Any]) -> tuple[Any, list[str]]:
    """``run()``, and the innermost of ``modules`` (by name) whose forward moved the global random state in it.

    Args:
        modules: the model's modules by name.
        run: a forward pass of the model.

    Returns:
        What ``run`` returned, and the names of the modules that drew, none of whose submodules did.
    """
    root = next(iter(modules.values()), None)
    open_calls: list[list[torch.Tensor]] = []
    drew: set[str] = set()
    handles = []

    def enter(module: nn.Module, args: tuple) -> None:
        open_calls.append(random_states(root))

    def leave(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if open_calls and _moved(open_calls.pop(), random_states(root)):
                drew.add(name)

        return hook

    try:
        for name, module in modules.items():
            handles.append(module.register_forward_pre_hook(enter))
            handles.append(module.register_forward_hook(leave(name), always_call=True))
        result = run()
    finally:
        for handle in reversed(handles):
            handle.remove()
    innermost = [
        name for name in modules if name in drew and not any(o != name and o.startswith(f"{name}.") for o in drew)
    ]
    innermost = [name for name in innermost if not (name == "" and len(drew) > 1)]
    return result, innermost


def redrawn(
    model: nn.Module,
    modules: Mapping[str, nn.Module],
    before: list[torch.Tensor],
    first: torch.Tensor,
    run: Callable[[], torch.Tensor],
) -> tuple[float, str] | None:
    """Where the pass of ``model`` that gave ``first`` drew at random (the random states moved from ``before``): run
    ``run`` (a pass on the same inputs) once more, on a fork of the random state, and, where its result differs from
    ``first`` beyond rounding, give the largest difference and the modules (among ``modules``, by name) that drew;
    else ``None``.

    Examples:
        >>> class Noisy(nn.Module):
        ...     def forward(self, x):
        ...         return x + torch.randn_like(x)
        >>> net, x = Noisy(), torch.zeros(3)
        >>> before = random_states(net)
        >>> redrawn(net, dict(net.named_modules()), before, net(x), lambda: net(x))[1]
        'the model (Noisy)'
        >>> before = random_states(net)
        >>> redrawn(net, dict(net.named_modules()), before, x * 2, lambda: x * 2) is None
        True
    """
    if not drew(model, before):
        return None
    with torch.random.fork_rng(devices=cuda_devices(model)):
        again, drawers = drawing_modules(modules, run)
    scale = float(first.abs().max()) if first.numel() else 0.0
    if torch.allclose(again, first, rtol=1e-6, atol=1e-9 * max(scale, 1.0)):
        return None
    named = ", ".join(_described(name, modules[name]) for name in drawers) or "the model"
    return float((again - first).abs().max()), named


def _described(name: str, module: nn.Module) -> str:
    return f"module {name!r} ({type(module).__name__})" if name else f"the model ({type(module).__name__})"


class RandomDraws:
    """Whether one method wrapper's target changes between passes on the same input, checked once (shared by the
    wrapper's narrowed copies)."""

    def __init__(self) -> None:
        self.checked = False

    def check(self, method: Any, call: Any, before: list[torch.Tensor] | None) -> None:
        """After the caller's pass (which started from the random states ``before``), on the method's fork of the
        random state: if that pass drew, run the model once more on the same inputs and warn if the explained
        quantity differs. Nothing where the method compares no passes, or a warning named the draw already.

        Args:
            method: the attribution method (an ``AttributionMethod``) making the call.
            call: the call (a ``Call``), after the caller's pass.
            before: :func:`random_states` before the caller's pass (``None`` once checked).
        """
        if self.checked or not method._evaluates_copies or not _moved(before, random_states(method.module)):
            return
        if method._warned or method._warned_sampled:  # a dropout module or a sampled target: told already
            self.checked = True
            return
        found = redrawn(
            method.module,
            method.named_explained_modules(),
            before,
            method._contract(call, call.output.detach(), None),
            lambda: method._evaluate(call, [x.unsqueeze(0) for x in call.inputs])[0].squeeze(1),
        )
        if found is None:
            self.checked = True
            return
        difference, named = found
        warn_at_caller(
            f"{type(method).__name__}: the target {call.target_key!r} differs between two forward passes on the same "
            f"input (by up to {difference:.3g}): {named} drew at random in its "
            "own forward, so each perturbed pass draws anew and the explanation compares independent draws; explain an "
            "output computed before the draw, or make the draw an input of the model (torchrl's RSSMPrior and "
            "RSSMPosterior take their noise as an argument)"
        )
        self.checked = True  # once the warning is out: made an error, the next call checks again
