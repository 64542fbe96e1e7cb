"""The entries of a caller's TensorDict that the perturbed passes of a method or a metric carry: the module's inputs.

A first pass runs the module on the caller's whole TensorDict; the perturbed passes run it on copies of the entries
it reads, the explained ones perturbed. A ``TensorDictModule`` reads its ``in_keys`` and nothing else, and so does a
sequence of such steps: the copies hold those alone (a rollout's ``"next"`` entries are not copied for each step of
an integral). Other modules may read more than they declare: a torchrl loss reads ``"advantage"`` and
``"value_target"`` where the TensorDict holds them and computes them otherwise (its value estimator runs the critic
over the trajectory). Copies without them ran another function than the first pass: every feature of a sample
took the same attribution, the difference between the two. Such modules' copies carry every entry.

Examples:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from tensordict.nn import TensorDictModule, TensorDictModuleBase
    >>> td = TensorDict(x=torch.ones(2, 3), advantage=torch.ones(2, 1), batch_size=[2])
    >>> sorted(carried_inputs(TensorDictModule(torch.nn.Linear(3, 1), ["x"], ["y"]), td).keys())
    ['x']
    >>> class Loss(TensorDictModuleBase):
    ...     in_keys, out_keys = ["x"], ["loss"]
    ...     def forward(self, td):
    ...         return td.set("loss", td["x"].sum(-1) * td.get("advantage", torch.ones(2, 1))[:, 0])
    >>> sorted(carried_inputs(Loss(), td).keys())
    ['advantage', 'x']
"""

from __future__ import annotations

from tensordict import TensorDictBase
from torch import nn

__all__ = ["carried_inputs", "reads_only_in_keys"]

# Classes whose forward reads the entries of ``in_keys`` alone (by the qualified name of the class that defines it:
# torchrl is not imported for it).
_EXACT_FORWARDS = frozenset(
    {
        "tensordict.nn.common.TensorDictModule",
        "tensordict.nn.probabilistic.ProbabilisticTensorDictModule",
        "torchrl.modules.tensordict_module.probabilistic.SafeProbabilisticModule",
        "torchrl.modules.tensordict_module.actors.QValueModule",
    }
)
# Sequences, whose forward runs their steps in turn: they read what their steps read.
_SEQUENCE_FORWARDS = frozenset(
    {"tensordict.nn.sequence.TensorDictSequential", "tensordict.nn.probabilistic.ProbabilisticTensorDictSequential"}
)


def reads_only_in_keys(module: nn.Module) -> bool:
    """Whether ``module`` reads no entry of a TensorDict but those of its ``in_keys``: a ``TensorDictModule``, a
    sequence of such steps, an attribution wrapper of one (whose model is its ``module``).

    Examples:
        >>> from tensordict.nn import TensorDictModule, TensorDictSequential
        >>> step = TensorDictModule(nn.Linear(3, 3), ["x"], ["h"])
        >>> reads_only_in_keys(TensorDictSequential(step, TensorDictModule(nn.Tanh(), ["h"], ["y"])))
        True
    """
    if hasattr(module, "named_explained_modules"):  # LRP or a method: it runs its model on the TensorDict it is given
        return reads_only_in_keys(module.module)
    owner = next((kind for kind in type(module).__mro__ if "forward" in vars(kind)), None)
    name = None if owner is None else f"{owner.__module__}.{owner.__qualname__}"
    if name in _SEQUENCE_FORWARDS:
        return all(reads_only_in_keys(step) for step in module.module.children())  # a list of steps, or named
    return name in _EXACT_FORWARDS


def carried_inputs(module: nn.Module, tensordict: TensorDictBase) -> TensorDictBase:
    """The entries of ``tensordict`` that a pass of ``module`` on a copy of it needs (see the module): its
    ``in_keys`` where it reads no other, else every entry (a shallow copy)."""
    if reads_only_in_keys(module):
        return tensordict.select(*module.in_keys, strict=False)
    return tensordict.copy()
