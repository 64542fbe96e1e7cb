"""A wrapper without ``create_graph`` (LRP's option; the other methods have none) called by a torchrl loss module:
refused, naming the wrapper and the loss.

A call without ``create_graph`` writes its outputs detached, as it writes the relevance (see
docs/differentiable.md). A torchrl loss module (``DQNLoss``, ``ClipPPOLoss``, ``SACLoss``, ``DDPGLoss``) given a
network with the wrapper inside computes its loss from those outputs: the loss then has no gradient through the
network, and either its ``backward`` fails with torch's own error, which names no module (``DQNLoss``: "element 0
of tensors does not require grad"), or, where another term of the loss carries a gradient (the critic's), the
network's parameters are left untrained without a word. The wrapper finds such a caller where the call comes
(through torch's, tensordict's and tdhook's own frames, and torchrl's outside its losses: the environments and
modules a loss runs its networks through, as ``DreamerActorLoss`` rolls its actor out in its model-based
environment, and the losses' helpers, through which ``SACLoss(deactivate_vmap=True)`` calls its Q-networks) from
the code of ``torchrl.objectives`` with a ``LossModule`` as ``self``, or from a method of a ``LossModule`` subclass
of one's own (a loss written outside torchrl), with gradient enabled, and refuses it. The
value estimators (``GAE``, ``TD0``), which compute their targets without gradient, and a loss's target networks
(called from its value estimator) are not refused.

Examples:
    >>> calling_loss_module() is None  # called from here, not by a loss module
    True
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import Any

import tensordict
import torch

import tdhook

__all__ = ["calling_loss_module", "loss_module_transform_advice", "refuse_loss_module_caller"]

# The packages whose frames lie between a loss module's code and the wrapper's forward; torchrl's own frames lie
# there too (an environment's rollout, a module of torchrl's calling its parts), but for those of its losses.
_PASSED = tuple(os.path.dirname(package.__file__) + os.sep for package in (torch, tensordict, tdhook))
_OBJECTIVES = f"{os.sep}torchrl{os.sep}objectives{os.sep}"
_DEPTH = 200  # frames looked at, at most (some six per TensorDictSequential around the wrapper)
_COMMON = "torchrl.objectives.common"  # imported with any of torchrl's loss modules


_TORCHRL_PATHS: list[tuple[str, str, str]] = []  # torchrl's directory, its losses', their helpers' file, once


def _torchrl_paths() -> tuple[str, str, str]:
    """torchrl's directory, that of its losses (``torchrl.objectives``) and the file of their helpers
    (``torchrl.objectives.utils``), read once torchrl's losses are imported."""
    if not _TORCHRL_PATHS:
        torchrl = os.path.dirname(sys.modules["torchrl"].__file__) + os.sep
        objectives = torchrl + "objectives" + os.sep
        _TORCHRL_PATHS.append((torchrl, objectives, objectives + "utils.py"))
    return _TORCHRL_PATHS[0]


def calling_loss_module() -> Any | None:
    """The torchrl ``LossModule`` whose code called the running wrapper, or ``None`` (torchrl not imported, or
    another caller): the first frame outside torch, tensordict, tdhook and torchrl's frames outside its losses (the
    losses' helpers, ``torchrl.objectives.utils``, passed too: their ``_vmap_func``, which with
    ``deactivate_vmap=True`` calls the Q-networks in a Python loop) is that loss module's code: one of torchrl's
    losses, or a ``LossModule`` subclass of one's own, in a method of its own (or a closure in one)."""
    common = sys.modules.get(_COMMON)
    if common is None:
        return None
    torchrl, objectives, helpers = _TORCHRL_PATHS[0] if _TORCHRL_PATHS else _torchrl_paths()
    frame = sys._getframe(1)
    for _ in range(_DEPTH):
        if frame is None:
            break
        name = frame.f_code.co_filename
        if not name.startswith(_PASSED) and (
            not name.startswith(torchrl) or (name.startswith(objectives) and name != helpers)
        ):
            break
        frame = frame.f_back
    if frame is None:
        return None
    code = frame.f_code
    if _OBJECTIVES in code.co_filename:
        caller = frame.f_locals.get("self")
        return caller if isinstance(caller, common.LossModule) else None
    # A loss of one's own (a LossModule subclass outside torchrl), calling from one of its methods or a closure in one:
    # a frame with no ``self`` (most callers of a wrapper) is passed by attribute reads alone, without a call.
    if not (code.co_argcount and code.co_varnames[0] == "self") and "self" not in code.co_freevars:
        return None
    try:
        caller = frame.f_locals["self"]  # read without a call, as the class's MRO next: a method of another class
    except KeyError:  # ``del self`` before the call
        return None
    return caller if common.LossModule in type(caller).__mro__ else None


def refuse_loss_module_caller(name: str, wrapper: Any, create_graph: bool | None) -> None:
    """Raise where a torchrl loss module calls a wrapper without ``create_graph`` with gradient enabled.

    Args:
        name: the wrapper's name, for the message.
        wrapper: the wrapper; the class of the module it explains is named in the message.
        create_graph: whether the wrapper keeps the graph of its outputs (then the loss trains through them);
            ``None`` for a wrapper that has no such option (the methods other than LRP).

    Raises:
        RuntimeError: naming the wrapper, the loss module, and what to do instead.
    """
    # Every call passes here: the cheap tests first (torchrl's losses not imported, no gradient), no frame walked.
    if create_graph or _COMMON not in sys.modules or not torch.is_grad_enabled():
        return
    loss = calling_loss_module()
    if loss is None:
        return
    flag = "a call without create_graph writes" if create_graph is not None else "the wrapper writes"
    option = ", or build the wrapper with create_graph=True, whose outputs keep the plain gradient"
    kind = type(loss)
    owner = "torchrl's" if kind.__module__.startswith("torchrl.") else "the torchrl LossModule"
    raise RuntimeError(
        f"{name}: called by {owner} {kind.__name__} as one of its networks (the wrapper around "
        f"{type(wrapper.module).__name__}): {flag} its outputs detached, so the loss would have no gradient through "
        "the network (torch's 'does not require grad' error at backward, or, where another term carries one, the "
        "network left untrained without a word). Give the loss module the plain network and explain with the wrapper "
        f"beside it{option if create_graph is not None else ''}"
    )


def loss_module_transform_advice() -> str:
    """What to tell a caller whose wrapper runs under a ``torch.func`` transform (refused, as no hook runs there)
    inside a torchrl loss module, which runs its networks under ``torch.func.vmap`` over stacked parameters (the
    Q-networks of ``SACLoss``, ``TD3Loss``, the critic of ``A2CLoss`` through its value estimator), or inside a value
    estimator called on its own (``GAE``, ``TD0Estimator``, which vmap the value network over the step and the
    next): the loss's class, its estimator's, and the option that calls the networks in a loop, where they have one;
    ``""`` where neither is on the stack. Asked on that error's path only: it walks every frame.

    Examples:
        >>> loss_module_transform_advice()  # called from here, not by a loss module
        ''
    """
    common = sys.modules.get(_COMMON)
    if common is None:
        return ""
    estimators = sys.modules.get("torchrl.objectives.value")
    estimator_type = getattr(estimators, "ValueEstimatorBase", ())
    frame, estimator = sys._getframe(1), None
    while frame is not None:
        caller = frame.f_locals.get("self")
        if estimator is None and estimator_type and isinstance(caller, estimator_type):
            estimator = caller
        if isinstance(caller, common.LossModule):
            break
        frame = frame.f_back
    if frame is None:  # a value estimator called on its own (the PPO tutorial's GAE), or none
        if estimator is not None and _has_option(type(estimator), "deactivate_vmap"):
            return (
                f"; it is called by torchrl's value estimator {type(estimator).__name__}, which runs the value "
                "network under torch.func.vmap: build the estimator with deactivate_vmap=True, which calls it in a "
                "loop (the estimator keeps the value keys of the call, not the relevance: explain with the wrapper "
                "beside it)"
            )
        return ""
    loss = type(caller).__name__
    if estimator is not None and _has_option(type(estimator), "deactivate_vmap"):
        return (
            f"; it is called by torchrl's {loss} through its value estimator ({type(estimator).__name__}), which runs "
            "the network under torch.func.vmap: make the estimator with loss.make_value_estimator(..., "
            "deactivate_vmap=True), which calls it in a loop"
        )
    if estimator is None and _has_option(type(caller), "deactivate_vmap"):
        return (
            f"; it is called by torchrl's {loss}, which runs its networks under torch.func.vmap: build the loss with "
            "deactivate_vmap=True, which calls them in a loop"
        )
    return (
        f"; it is called by torchrl's {loss}, which runs its networks under torch.func.vmap: give the loss the plain "
        "network and explain with the wrapper beside it"
    )


def _has_option(kind: type, option: str) -> bool:
    """Whether ``kind``'s constructor takes ``option``."""
    try:
        return option in inspect.signature(kind.__init__).parameters
    except (TypeError, ValueError):  # no signature to read
        return False
