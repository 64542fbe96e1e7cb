"""What LRP explains: the output it starts from (the target key) and the initial relevance put on it.

:func:`named_targets` reads the ``target_key`` given to
:class:`~tdhook.attribution.LRP`, :func:`resolve_target_key` finds the key in
the model's outputs (choosing a default where none was given), and
:func:`initial_gradient` turns ``target`` into the gradient that starts the
relevance backward pass.

Examples:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from tensordict.nn import TensorDictModule
    >>> policy = TensorDictModule(torch.nn.Linear(3, 2), in_keys=["observation"], out_keys=["action_value"])
    >>> key, operator = named_targets(policy, None)[None]
    >>> key is None, operator is policy
    (True, True)
    >>> result = policy(TensorDict(observation=torch.ones(4, 3), batch_size=[4]))
    >>> resolve_target_key(result, key, operator)
    'action_value'
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal, Union

import numpy as np
import torch
from tensordict import TensorDictBase, is_non_tensor
from tensordict.nn import ProbabilisticTensorDictModule, TensorDictModuleBase, TensorDictSequential, skip_existing
from tensordict.utils import NestedKey, unravel_key, unravel_key_list
from torchrl.modules import MultiStepActorWrapper

from tdhook.attribution._inputs import describe
from tdhook.attribution._keys import is_key
from tdhook.attribution._map_targets import warn_for_rows_of_a_map
from tdhook.attribution._policy_targets import (
    EXPLORATION_MODULES,
    acted_step,
    actor_and_critic,
    default_target_operator,
    sequential_steps,
)
from tdhook.attribution._quantized_calls import quantized_modules
from tdhook.attribution.rules._keeping_graph import graph_kept
from tdhook.attribution.rules._numerics import carrying_gradient
from tdhook.attribution.rules.base import layer_call_of

__all__ = [
    "DefaultTargets",
    "EveryUnit",
    "Target",
    "TargetWithoutGradient",
    "default_target_candidates",
    "explained_output",
    "initial_gradient",
    "initial_relevance",
    "named_targets",
    "raise_for_no_gradient",
    "raise_for_unreached",
    "why_no_gradient",
    "resolve_target_key",
    "target_output",
    "zero_entries",
    "zero_output_seeds",
]

Target = Union[None, int, torch.Tensor, Callable[[torch.Tensor], torch.Tensor], Literal["all"]]


class EveryUnit:
    """The initial gradients of ``target="all"``: a one-hot gradient per output unit, built a chunk of units at a
    time (all of them at once would hold ``units`` copies of the output).

    Args:
        output: the explained output, of shape ``batch + [..., units]`` (or ``batch`` alone: one unit).
        batch_dims: the number of batch dimensions.

    Examples:
        >>> every = EveryUnit(torch.tensor([[1.0, 3.0, 2.0]]), batch_dims=1)
        >>> len(every), every.seeds(1, 3)  # units 1 and 2: [units, *output.shape]
        (3, tensor([[[0., 1., 0.]],
        <BLANKLINE>
                [[0., 0., 1.]]]))
        >>> every.totals(torch.tensor([[1.0, 3.0, 2.0]]))  # each unit's initial relevance, per sample
        tensor([[1., 3., 2.]], dtype=torch.float64)
    """

    def __init__(self, output: torch.Tensor, batch_dims: int) -> None:
        self.shape, self.dtype, self.device = output.shape, output.dtype, output.device
        self.batch_dims = batch_dims
        self.has_units = output.dim() > batch_dims
        self.n_units = output.shape[-1] if self.has_units else 1

    def __len__(self) -> int:
        return self.n_units

    def seed_bytes(self) -> int:
        """The bytes one unit's initial gradient takes."""
        return self.shape.numel() * torch.empty((), dtype=self.dtype).element_size()

    def seeds(self, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The initial gradients of units ``start`` to ``stop - 1``, stacked in a leading dimension; written into
        the first ``stop - start`` of ``out`` (of at least that many units) when given."""
        count = stop - start
        if out is None:
            out = torch.empty(count, *self.shape, dtype=self.dtype, device=self.device)
        seeds = out[:count]
        if not self.has_units:
            return seeds.fill_(1)
        rows = seeds.zero_().view(count, -1, self.n_units)
        units = torch.arange(start, stop, device=self.device)
        rows[torch.arange(count, device=self.device), :, units] = 1
        return seeds

    def totals(self, output: torch.Tensor) -> torch.Tensor:
        """Each unit's initial relevance summed per sample (``output`` times its seed), in float64:
        ``batch + [units]``."""
        output = output.detach().double()
        if not self.has_units:
            return output.unsqueeze(-1)
        return output.reshape(*self.shape[: self.batch_dims], -1, self.n_units).sum(-2)


def explained_output(
    result: TensorDictBase, key: NestedKey, explained_keys: list[NestedKey], operator: TensorDictModuleBase
) -> torch.Tensor:
    """The target output of key ``key`` in ``result`` (see :func:`target_output`), checked: a floating-point
    tensor that depends on the explained inputs.

    Examples:
        >>> from tensordict import TensorDict
        >>> from tensordict.nn import TensorDictModule
        >>> policy = TensorDictModule(torch.nn.Linear(3, 2), in_keys=["obs"], out_keys=["q"])
        >>> explained_output(TensorDict(q=torch.ones(2, 3), batch_size=[2]), "q", ["obs"], policy)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        tdhook.attribution.targets.TargetWithoutGradient: LRP: target 'q' does not depend on the explained inputs ...
    """
    output = target_output(result, key, operator)
    if not isinstance(output, torch.Tensor) or not output.is_floating_point():
        raise TypeError(
            f"LRP: target {key!r} is {describe(output)}; relevance explains a floating-point "
            "output (logits, action values, a value estimate): pass target_key=<such a key>"
        )
    raise_for_no_gradient("LRP", key, output, operator, explained_keys)
    return output


def raise_for_no_gradient(
    name: str,
    key: NestedKey,
    output: torch.Tensor,
    operator: TensorDictModuleBase,
    explained_keys: list[NestedKey] | None = None,
) -> None:
    """Refuse a target ``output`` (at ``key``) that carries no gradient from the explained inputs, saying why where
    known (see :func:`why_no_gradient`); ``name`` is the wrapper's.

    Examples:
        >>> raise_for_no_gradient("Saliency", "q", torch.ones(2), torch.nn.Linear(2, 2))
        Traceback (most recent call last):
        ...
        tdhook.attribution.targets.TargetWithoutGradient: Saliency: target 'q' does not depend on the explained inputs
    """
    if not output.requires_grad:
        keys = "" if explained_keys is None else f" {explained_keys}"
        why = why_no_gradient(operator)
        raise TargetWithoutGradient(
            f"{name}: target {key!r} does not depend on the explained inputs{keys}{why}", cause_known=bool(why)
        )


class TargetWithoutGradient(ValueError):
    """A target that carries no gradient from the explained inputs (see :func:`raise_for_no_gradient`): a
    ``ValueError``, which a wrapper may complete with what its rules did (CP-LRP's held softmax).

    Examples:
        >>> try:
        ...     raise_for_no_gradient("LRP", "q", torch.ones(2), torch.nn.Linear(2, 2))
        ... except TargetWithoutGradient as err:
        ...     isinstance(err, ValueError), err.cause_known
        (True, False)
    """

    def __init__(self, message: str, cause_known: bool = False) -> None:
        super().__init__(message)
        self.cause_known = cause_known  # whether the message names what in the operator cut the target


def why_no_gradient(operator: TensorDictModuleBase) -> str:
    """What in ``operator`` may give a target no gradient from its inputs, as the end of an error message (``""``
    where nothing is known): tensordict's ``set_skip_existing(True)``, under which a module whose output keys the
    TensorDict holds already skips its call, statically quantized modules, or torchrl's ``MultiStepActorWrapper``,
    which replays actions its actor computed at an earlier step.

    Examples:
        >>> why_no_gradient(torch.nn.Linear(2, 2))
        ''
    """
    if skip_existing():
        return (
            ": tensordict's set_skip_existing(True) is in force, under which a module whose output keys the "
            "TensorDict holds already skips its call (the target is then the value the TensorDict held, which no "
            "pass computed from the inputs). Explain outside set_skip_existing(True), or with the model's output "
            "keys left out of the TensorDict"
        )
    quantized = quantized_modules(operator)
    if quantized:
        return (
            f": the model computes it with statically quantized modules ({', '.join(quantized[:3])}"
            f"{', ...' if len(quantized) > 3 else ''}), whose quantized tensors carry no gradient. Explain the float "
            "model (torchvision's quantize=False, or the model before torch.ao.quantization.convert)"
        )
    replaying = [name for name, module in operator.named_modules() if isinstance(module, MultiStepActorWrapper)]
    if replaying:
        place = f"module {replaying[0]!r}" if replaying[0] else "the model itself"
        return (
            f"; if this step is one that {place} (MultiStepActorWrapper) replays: it runs its actor once per chunk of "
            "steps and replays the chunk's actions at the steps between, which those steps' inputs do not reach. "
            "Explain its actor (the wrapper's .actor): the chunk it computes from the observation of a chunk's first "
            "step"
        )
    return ""


def _one_hot(output: torch.Tensor, index: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """Ones at ``index`` of the last dimension (``index`` shaped like ``output`` without it, or with it of size 1
    when ``keepdim``), zeros elsewhere."""
    return torch.zeros_like(output).scatter_(-1, index if keepdim else index.unsqueeze(-1), 1.0)


def initial_gradient(
    output: torch.Tensor, target: Target, key: NestedKey, batch_dims: int, owner: str = "LRP"
) -> torch.Tensor:
    """The gradient ``g`` such that ``output * g`` is the initial relevance (for ``target="all"``, every unit's
    gradient, stacked; :func:`initial_relevance` gives them as an :class:`EveryUnit` to build in chunks).

    Args:
        output: the explained output, of shape ``batch + [n]`` (or ``batch`` alone).
        target: see :class:`~tdhook.attribution.LRP`.
        key: the output's key, for error messages.
        batch_dims: the number of batch dimensions.
        owner: who explains or scores, for the warning on a map's rows (LRP and the methods, the metrics).

    Returns:
        A tensor shaped like ``output``; for ``target="all"`` a stack of ``n`` of them.

    Examples:
        >>> out = torch.tensor([[1.0, 3.0], [4.0, 2.0]])
        >>> initial_gradient(out, None, "q", 1)
        tensor([[0., 1.],
                [1., 0.]])
        >>> initial_gradient(out, torch.tensor([0, -1]), "q", 1)  # -1: the last unit, as for an int
        tensor([[1., 0.],
                [0., 1.]])
        >>> initial_gradient(out, 2, "q", 1)
        Traceback (most recent call last):
        ...
        IndexError: LRP: target 2 is out of range for output 'q' with 2 units in its last dimension
    """
    gradient = initial_relevance(output, target, key, batch_dims, owner)[0]
    return gradient.seeds(0, len(gradient)) if isinstance(gradient, EveryUnit) else gradient


def initial_relevance(
    output: torch.Tensor, target: Target, key: NestedKey, batch_dims: int, owner: str = "LRP"
) -> tuple[torch.Tensor | EveryUnit, torch.Tensor | None]:
    """:func:`initial_gradient`, and the relevance a callable target put on outputs that are exactly zero (or so
    close to it that relevance / output overflows).

    ``output * g`` cannot carry relevance where ``output`` is zero; that part is returned separately
    (``None`` when there is none) for :func:`zero_output_seeds`.

    Raises:
        ValueError: a callable target returned NaN or ±inf where the output is finite (where the output
            itself is not finite, the relevance of that sample follows it, as with the other targets).

    Examples:
        >>> out = torch.tensor([[2.0, 0.0]])
        >>> initial_relevance(out, lambda o: torch.ones_like(o), "q", 1)
        (tensor([[0.5000, 0.0000]]), tensor([[0., 1.]]))
    """
    out = output.detach()
    if not callable(target):
        return _initial_gradient(out, target, key, batch_dims, owner), None
    # In a call that keeps the graph, the initial relevance is a function of the output like the rest of the
    # relevance: the target sees the output with its history, and the gradient keeps it.
    keep = graph_kept() is not None
    given = target(output if keep else out)
    if not isinstance(given, torch.Tensor) or given.shape != out.shape:
        picked = isinstance(given, torch.Tensor) and not given.is_floating_point() and given.shape == out.shape[:-1]
        advice = (
            "; it returned unit indices (integers of the batch's shape), which go as target=indices, not through a "
            "callable"
            if picked
            else ""
        )
        raise ValueError(
            f"LRP: a callable target must return a tensor shaped like output {key!r} {tuple(out.shape)}, "
            f"got {getattr(given, 'shape', type(given).__name__)}{advice}"
        )
    relevance = given.detach().to(out.dtype)
    bad = ~relevance.isfinite() & out.isfinite()
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"LRP: the callable target {_name(target)} returned {relevance[where].item()} at {where} for output "
            f"{key!r}, where the output is {out[where].item()}; a target's relevance must be finite"
        )
    # Where relevance / output is infinite (an output of 0, or one so small that the quotient overflows: 1e-310 in
    # float64, below about 1.5e-5 · |relevance| in float16), ``output × gradient`` cannot carry the relevance.
    at_zero = (relevance / out).isinf()
    rest = torch.where(at_zero, relevance, 0) if bool(at_zero.any()) else None
    if keep:
        return carrying_gradient(given.to(out.dtype), output), rest
    return carrying_gradient(relevance, out).to(out.dtype), rest


def _name(target: Callable) -> str:
    return getattr(target, "__qualname__", None) or type(target).__name__


def zero_output_seeds(
    output: torch.Tensor, rest: torch.Tensor, key: NestedKey
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Where the backward pass starts for relevance ``rest`` put on outputs that are exactly zero (or so close to it
    that relevance / output overflows).

    ``output × gradient`` cannot carry relevance from a zero output: the rule of the Linear or convolution
    layer that made the output says where its explicit form sends it (:meth:`Rule.zero_output_seeds
    <tdhook.attribution.rules.base.Rule.zero_output_seeds>`): the ε-rule (ε > 0) sends ``R / stabilize(z, ε)``
    (``R / ε`` at 0) through the layer's gradient, z⁺, αβ, Flat and w² share ``R`` by their modified outputs.

    Raises:
        ValueError: no rule carries it (an activation, a norm or another operation made the output, or the
            layer's rule is LRP-0 or γ, which give a zero output nothing to pass on, or z^B), naming the output
            and the entries.

    Examples:
        An output no layer's rule made (here a plain tensor) carries nothing:

        >>> zero_output_seeds(torch.zeros(1, 2), torch.tensor([[1.0, 0.0]]), "y")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: LRP: the callable target puts relevance 1 on 1 entries of output 'y' that are exactly 0 ...
    """
    call = layer_call_of(output)
    seeds = call.rule.zero_output_seeds(call, rest) if call is not None else None
    if seeds is not None:
        return seeds
    made_by = f"{type(call.module).__name__} with {type(call.rule).__name__}" if call is not None else "its producer"
    raise ValueError(
        f"LRP: the callable target puts relevance {float(rest.sum()):.4g} on {zero_entries(rest, key, output)}; "
        f"{made_by} "
        "cannot carry relevance from a zero output (a Linear or convolution layer with the ε-rule, ε > 0, z⁺, αβ, "
        "Flat or w² can): put no relevance there (multiply the target's relevance by a mask of the outputs to "
        "explain, output != 0 for the zeros), or explain an "
        "output such a layer makes"
    )


def zero_entries(rest: torch.Tensor, key: NestedKey, output: torch.Tensor | None = None) -> str:
    """Where a callable target put relevance on outputs that are exactly 0, in words (the first four entries);
    given the ``output``, those that are not 0 are said to be too small to divide by.

    Examples:
        >>> zero_entries(torch.tensor([[0.0, 1.0], [2.0, 0.0]]), "q")
        "2 entries of output 'q' that are exactly 0 (at (0, 1), (1, 0))"
        >>> zero_entries(torch.tensor([[0.0, 1.0]]), "q", torch.tensor([[3.0, 1e-44]]))
        "1 entries of output 'q' that are exactly 0 or so small that relevance / output overflows (at (0, 1))"
    """
    entries = rest.nonzero()
    where = ", ".join(str(tuple(int(i) for i in entry)) for entry in entries[:4])
    tiny = output is not None and bool((output.detach()[rest != 0] != 0).any())
    what = "exactly 0 or so small that relevance / output overflows" if tiny else "exactly 0"
    return f"{len(entries)} entries of output {key!r} that are {what} (at {where}{', ...' if len(entries) > 4 else ''})"


def raise_for_unreached(key: NestedKey | list[NestedKey], keys: list[NestedKey], reached: list[bool]) -> None:
    """Raise when the target ``key`` (or every target of a list: the heads of an actor-critic) does not depend on
    some explained input.

    Examples:
        >>> raise_for_unreached("q", ["obs", "mask"], [True, False])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: LRP: target 'q' does not depend on the explained input 'mask' through its gradient ...
        >>> raise_for_unreached(["logits", "value"], ["obs"], [False])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: LRP: none of the targets ['logits', 'value'] depends on the explained input 'obs' through ...
    """
    targets = f"none of the targets {key!r} depends" if isinstance(key, list) else f"target {key!r} does not depend"
    for input_key, was_reached in zip(keys, reached, strict=True):
        if not was_reached:
            raise ValueError(
                f"LRP: {targets} on the explained input {input_key!r} through its gradient "
                "(the model does not read it for this output, or detaches it, as torchrl's CrossGroupCritic does "
                "with the groups in detach_groups; or it reaches the output only through what a rule holds constant: "
                "CP-LRP's attention weights, all that a cross-attention's query reaches where no residual adds it, "
                "or an nn.EmbeddingBag's per_sample_weights where the tokens it weights are explained, which take the "
                "relevance); its relevance would be zero everywhere: leave it out of in_keys, or explain an output "
                "that reads it"
            )


def _initial_gradient(
    out: torch.Tensor, target: Target, key: NestedKey, batch_dims: int, owner: str = "LRP"
) -> torch.Tensor | EveryUnit:
    has_units = out.dim() > batch_dims
    n_units = out.shape[-1] if has_units else 1
    if isinstance(target, str):
        if target != "all":
            raise ValueError(f"LRP: target must be None, an int, a LongTensor, a callable or 'all', got {target!r}")
        warn_for_rows_of_a_map(out, target, key, batch_dims, owner)
        return EveryUnit(out, batch_dims)
    if target is None:
        if not has_units or n_units == 1:
            return torch.ones_like(out)
        warn_for_rows_of_a_map(out, target, key, batch_dims, owner)
        return _one_hot(out, out.argmax(-1, keepdim=True), keepdim=True)
    if not has_units:
        raise ValueError(f"LRP: output {key!r} has no unit dimension to index with target {target!r}")
    if isinstance(target, (np.integer, np.ndarray)) and target.dtype.kind in "iu":  # an action from numpy
        target = int(target) if isinstance(target, np.integer) else torch.from_numpy(target)
    if isinstance(target, int) and not isinstance(target, bool):
        if not -n_units <= target < n_units:
            advice = (
                " (a value, explained as it is with target=None; to pick a unit of another output, pass its "
                "target_key, such as a QValueActor's 'action_value')"
                if n_units == 1
                else ""
            )
            raise IndexError(
                f"LRP: target {target} is out of range for output {key!r} with {n_units} "
                f"unit{'s' if n_units != 1 else ''} in its last dimension{advice}"
            )
        warn_for_rows_of_a_map(out, target, key, batch_dims, owner)
        index = torch.full(out.shape[:-1], target % n_units, dtype=torch.long, device=out.device)
        return _one_hot(out, index)
    if isinstance(target, torch.Tensor) and not target.is_floating_point() and target.dtype != torch.bool:
        # As int64: compared with -n_units, an unsigned tensor (actions stored as uint8) would wrap the bound.
        index = target.to(device=out.device, dtype=torch.long)
        if index.shape == (*out.shape[:-1], 1):
            index = index.squeeze(-1)
        if index.shape != out.shape[:-1]:
            index = index.expand(out.shape[:-1]) if index.dim() == 0 else index
        if index.shape != out.shape[:-1]:
            raise ValueError(
                f"LRP: target indices of shape {tuple(target.shape)} do not match output {key!r} "
                f"of shape {tuple(out.shape)}; expected {tuple(out.shape[:-1])}"
            )
        if ((index < -n_units) | (index >= n_units)).any():
            raise IndexError(
                f"LRP: target indices must lie in [{-n_units}, {n_units}) for output {key!r}, "
                f"got values from {int(index.min())} to {int(index.max())}"
            )
        # Negative indices count from the last unit, as an int target does and as torch's indexing does.
        return _one_hot(out, index.long() % n_units)
    if isinstance(target, torch.Tensor):
        raise TypeError(
            f"LRP: target for output {key!r} must be None, an int, a LongTensor of unit indices, a callable or 'all', "
            f"got a {target.dtype} tensor; to start from a tensor of initial relevance shaped like the output, pass "
            "target=lambda output: relevance"
        )
    indices = isinstance(target, (list, tuple)) and all(isinstance(i, int) for i in target)  # captum's per-sample list
    shown = repr(list(target)) if indices and len(target) <= 8 else "target"
    advice = f"; per-sample unit indices go as a LongTensor, torch.tensor({shown})" if indices else ""
    raise TypeError(
        f"LRP: target must be None, an int, a LongTensor, a callable or 'all', got {type(target).__name__}{advice}"
    )


def named_targets(
    module: TensorDictModuleBase, target_key: NestedKey | Mapping[str, NestedKey] | None
) -> dict[str | None, tuple[NestedKey | None, TensorDictModuleBase]]:
    """The outputs to explain, by name, as given by ``target_key``.

    Args:
        module: the wrapped model.
        target_key: see :class:`~tdhook.attribution.LRP`: a key, a dict
            ``name -> key``, or ``None`` for the default.

    Returns:
        ``name -> (key, operator)``: the target key, or ``None`` for the default
        key of ``operator``, the module whose outputs give that default. A
        single target is named ``None``; an ``ActorValueOperator`` or
        ``ActorCriticWrapper`` without ``target_key`` gets ``"actor"`` and
        ``"critic"``.

    Raises:
        ValueError: ``target_key`` is an empty dict.

    Examples:
        >>> from tensordict.nn import TensorDictModule
        >>> policy = TensorDictModule(torch.nn.Linear(3, 2), in_keys=["x"], out_keys=["y"])
        >>> named_targets(policy, ("next", "y"))[None][0]
        ('next', 'y')
        >>> {name: key for name, (key, _) in named_targets(policy, {"a": "y", "b": ("z", "w")}).items()}
        {'a': 'y', 'b': ('z', 'w')}
    """
    if isinstance(target_key, Mapping):
        if not target_key:
            raise ValueError("LRP: target_key is an empty dict; name at least one output to explain")
        return {name: (_output_key(key), module) for name, key in target_key.items()}
    heads = actor_and_critic(module) if target_key is None else None
    if heads is not None:
        return {name: (None, operator) for name, operator in heads.items()}
    return {None: (_output_key(target_key) if target_key is not None else None, module)}


def _output_key(key: object) -> NestedKey:
    """``key`` unravelled (``("y",)`` is ``"y"``).

    Raises:
        TypeError: ``key`` is no key: tensordict would refuse a list, and drop a number inside a tuple.

    Examples:
        >>> _output_key(("next", ("y",)))
        ('next', 'y')
        >>> _output_key(("y", 0))
        Traceback (most recent call last):
        ...
        TypeError: LRP: target_key must be a key (a str or a tuple of str), or a dict of them, got ('y', 0)
    """
    if not is_key(key):
        raise TypeError(f"LRP: target_key must be a key (a str or a tuple of str), or a dict of them, got {key!r}")
    return unravel_key(key)


def resolve_target_key(
    result: TensorDictBase,
    target_key: NestedKey | None,
    operator: TensorDictModuleBase,
    candidates: list[NestedKey] | None = None,
) -> NestedKey:
    """The key of the output to explain in the model's ``result``.

    Args:
        result: the TensorDict the model wrote its outputs to.
        target_key: the key asked for, or ``None`` for the default: the first
            floating-point out key of ``operator`` that none of its modules
            reads (see :class:`~tdhook.attribution.LRP`).
        operator: the module whose out keys give the default.
        candidates: ``default_target_candidates(operator)``, if found already.

    Returns:
        ``target_key`` if given, else the default key.

    Raises:
        KeyError: ``target_key`` is not in ``result``, or no candidate for the
            default is a floating-point tensor there.

    Examples:
        >>> from tensordict import TensorDict
        >>> from tensordict.nn import TensorDictModule, TensorDictSequential
        >>> net = TensorDictSequential(
        ...     TensorDictModule(torch.nn.Linear(3, 4), in_keys=["x"], out_keys=["hidden"]),
        ...     TensorDictModule(torch.nn.Linear(4, 2), in_keys=["hidden"], out_keys=["logits"]),
        ... )
        >>> result = net(TensorDict(x=torch.ones(3), batch_size=[]))
        >>> resolve_target_key(result, None, net)
        'logits'
        >>> resolve_target_key(result, "hidden", net)
        'hidden'
    """
    if target_key is not None:
        if target_key not in result.keys(include_nested=True):
            written = [key for key in unravel_key_list(list(operator.out_keys)) if key in result.keys(True)]
            raise KeyError(
                f"LRP: target key {target_key!r} was not written by the wrapped module{_skipped(result, operator)}; "
                f"its outputs are {written}{_left_out(result, operator)}"
            )
        return target_key
    if candidates is None:
        candidates = default_target_candidates(operator)
    for key in candidates:
        value = result.get(key, None)
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return key
    present = result.keys(include_nested=True)
    found = ", ".join(f"{key!r}: {describe(result.get(key)) if key in present else 'absent'}" for key in candidates)
    non_tensors = [key for key in candidates if key in present and is_non_tensor(result.get(key))]
    advice = (
        "; they hold Python objects (a list of dicts, as torchvision's detection models return), which carry no "
        "gradient: wrap the model in a module that returns the tensor to explain (the scores or logits of the "
        "detections; see the model gallery's detection section), or pass target_key= a floating-point output"
        if non_tensors and len(non_tensors) == len([key for key in candidates if key in present])
        else f"; pass target_key{_floating_outputs(result, operator, candidates)}"
    )
    advice += _left_out(result, operator)
    raise KeyError(
        f"LRP: none of the module's outputs {candidates} is a floating-point tensor in its result ({found}){advice}"
    )


def _floating_outputs(result: TensorDictBase, operator: TensorDictModuleBase, candidates: list[NestedKey]) -> str:
    """The floating-point outputs of ``operator`` in ``result`` other than ``candidates``, those a ``target_key`` may
    name (a distributional Q-value actor's ``action_value``, whose default is its integer ``action``), or ``""``."""
    floats = [
        key
        for key in unravel_key_list(list(operator.out_keys))
        if key not in candidates
        and isinstance(value := result.get(key, None), torch.Tensor)
        and value.is_floating_point()
    ]
    return f" (its floating-point outputs: {', '.join(map(repr, floats))})" if floats else ""


def _skipped(result: TensorDictBase, operator: TensorDictModuleBase) -> str:
    """Why a ``TensorDictSequential`` with ``partial_tolerant=True`` in ``operator`` may have written nothing: the
    input keys of its that ``result`` lacks (its modules that read them were skipped), or ``""``."""
    present = set(result.keys(include_nested=True))
    missing = {
        key: None
        for sub in operator.modules()
        if isinstance(sub, TensorDictSequential) and sub.partial_tolerant
        for key in unravel_key_list(list(sub.in_keys))
        if key not in present
    }
    if not missing:
        return ""
    return (
        f" (a TensorDictSequential with partial_tolerant=True skips the modules whose inputs are missing, and the "
        f"TensorDict lacks {list(missing)})"
    )


def _left_out(result: TensorDictBase, operator: TensorDictModuleBase) -> str:
    """The outputs that a module in ``operator`` computes but leaves out of ``result`` by its selected out keys
    (``TensorDictSequential(..., selected_out_keys=...)``, ``select_out_keys``), or ``""``.

    Examples:
        >>> from tensordict import TensorDict
        >>> from tensordict.nn import TensorDictModule, TensorDictSequential
        >>> policy = TensorDictSequential(
        ...     TensorDictModule(torch.nn.Linear(3, 2), in_keys=["x"], out_keys=["logits"]),
        ...     TensorDictModule(lambda logits: logits.argmax(-1), in_keys=["logits"], out_keys=["action"]),
        ...     selected_out_keys=["action"],
        ... )
        >>> result = policy(TensorDict(x=torch.ones(4, 3), batch_size=[4]))
        >>> "TensorDictSequential leave out ['logits']" in _left_out(result, policy)
        True
    """
    present = set(result.keys(include_nested=True))
    for sub in operator.modules():
        if not isinstance(sub, TensorDictModuleBase):
            continue
        selected = unravel_key_list(list(sub.out_keys))
        computed = unravel_key_list(list(getattr(sub, "out_keys_source", selected)))
        dropped = [k for k in computed if k not in selected and k not in present]
        if dropped:
            return (
                f"; the selected out keys {selected} of {type(sub).__name__} leave out {dropped}, which it computes: "
                "select the output to explain too"
            )
    return ""


def target_output(result: TensorDictBase, key: NestedKey, operator: TensorDictModuleBase) -> object:
    """The explained output of key ``key`` in ``result``: the value it holds, at the step the policy acts on
    where ``operator`` runs a context of steps (torchrl's ``DecisionTransformerInferenceWrapper``: the last).

    Examples:
        >>> from tensordict import TensorDict
        >>> from tensordict.nn import TensorDictModule
        >>> policy = TensorDictModule(torch.nn.Linear(3, 2), in_keys=["x"], out_keys=["y"])
        >>> result = policy(TensorDict(x=torch.ones(4, 3), batch_size=[4]))
        >>> target_output(result, "y", policy) is result["y"]
        True
    """
    output = result.get(key)
    return acted_step(operator, key, output) if isinstance(output, torch.Tensor) else output


def _leaf_modules(module: TensorDictModuleBase) -> list[TensorDictModuleBase]:
    if isinstance(module, TensorDictSequential):
        return [leaf for sub in sequential_steps(module) for leaf in _leaf_modules(sub)]
    return [module]


class DefaultTargets(dict):
    """A wrapper's default target keys, per target name, kept while a context is open and found again where the
    pipeline's steps or their keys change (a step appended, an output renamed inside the context).

    Examples:
        >>> from tensordict.nn import TensorDictModule
        >>> from tdhook.attribution import LRP
        >>> lrp = LRP(TensorDictModule(torch.nn.Linear(3, 2), in_keys=["x"], out_keys=["y"]))
        >>> DefaultTargets().of(lrp, None) is None  # outside a context: looked up on every call
        True
        >>> with lrp:
        ...     targets = DefaultTargets()
        ...     first = targets.of(lrp, None)
        ...     lrp.module.out_keys = ["z"]
        ...     first, targets.of(lrp, None)
        (['y'], ['z'])
    """

    def of(self, wrapper: Any, name: str | None) -> list[NestedKey] | None:
        """The default target keys of ``wrapper``'s target ``name`` (``None`` outside a context, or where the
        target key is given)."""
        key, operator = wrapper.targets[name]
        if wrapper._handles is None or key is not None:
            return None
        leaves = _leaf_modules(default_target_operator(operator))
        # The steps by identity (kept alive with the keys, so that no other module takes their ids) and their keys.
        steps = [(id(leaf), list(leaf.in_keys), list(leaf.out_keys)) for leaf in leaves]
        kept = self.get(name)
        if kept is None or kept[1] != steps:
            kept = self[name] = (leaves, steps, _unread_outputs(leaves))
        return kept[2]


def default_target_candidates(module: TensorDictModuleBase) -> list[NestedKey]:
    """Out keys in pipeline order that no module of the pipeline reads.

    Probabilistic modules (the sampling step of a torchrl ``ProbabilisticActor``)
    are left out: their inputs, the distribution's parameters (``loc``,
    ``logits``), are what gets explained, not a random sample. So are torchrl's
    exploration steps: the action they perturb is explained, not the noise
    process's state. Keys under
    ``"next"`` (the recurrent state a torchrl ``LSTMModule`` carries to the next
    step) come after the others: a recurrent actor explains its action output.

    Examples:
        >>> from tensordict.nn import TensorDictModule, TensorDictSequential
        >>> net = TensorDictSequential(
        ...     TensorDictModule(torch.nn.Linear(3, 4), in_keys=["x"], out_keys=["hidden"]),
        ...     TensorDictModule(torch.nn.Linear(4, 2), in_keys=["hidden"], out_keys=["logits"]),
        ... )
        >>> default_target_candidates(net)
        ['logits']
    """
    return _unread_outputs(_leaf_modules(default_target_operator(module)))


def _unread_outputs(steps: list[TensorDictModuleBase]) -> list[NestedKey]:
    """:func:`default_target_candidates` of a pipeline whose steps (its leaf modules) are ``steps``."""
    leaves = [leaf for leaf in steps if not isinstance(leaf, (ProbabilisticTensorDictModule, *EXPLORATION_MODULES))]
    if not leaves:
        return []
    read = {unravel_key(k) for leaf in leaves for k in leaf.in_keys}
    written = [unravel_key(k) for leaf in leaves for k in leaf.out_keys]
    ordered = list(dict.fromkeys(written))
    unread = [k for k in ordered if k not in read]
    next_states = [k for k in unread if isinstance(k, tuple) and k[0] == "next"]
    return [k for k in unread if k not in next_states] + next_states or ordered[::-1]
