"""A chain of linear layers and activations explained without autograd: the same relevance, one layer at a time.

A small policy at batch 1 (an ``nn.Sequential`` of ``nn.Linear`` and ``nn.ReLU`` layers, as torchrl's ``MLP``
builds) spends most of an LRP call in fixed costs of Python: a forward hook and an autograd ``Function`` per ruled
layer, and the autograd engine. Where every layer's rule only rescales the gradient of the layer's output (LRP-ε,
LRP-0) the modified gradient is a product of factors known after the forward pass, so this module runs the chain
layer by layer under ``torch.no_grad()``, keeps each factor, and multiplies the seed back through them:

* ``nn.Linear`` under :class:`~tdhook.attribution.rules.basic.EpsilonRule`: the output gradient times the rule's
  own scale ``|z| / (|z| + ε)`` (``z != 0`` for ε = 0), then times ``W``;
* ``nn.Linear`` under :class:`~tdhook.attribution.rules.basic.IgnoreRule` (or no rule): times ``W``;
* ``nn.ReLU`` under :class:`~tdhook.attribution.rules.basic.PassRule`, ``IgnoreRule`` or no rule (each leaves
  the plain gradient there): the kernel autograd runs, ``threshold_backward``;
* another element-wise activation (``nn.Tanh``, torchrl's default, ``nn.ELU``, ``nn.SiLU`` …, not in place) under
  ``PassRule``: times the rule's scale ``output / stabilize(input)``.

The result equals what the hooks and autograd compute, up to rounding (the tests compare the two). The wrapper
uses a plan only where nothing else would act on the call (see :meth:`ChainPlan.build`). The chain is the module of
the wrapped ``TensorDictModule``, or of the first step of a wrapped ``TensorDictSequential`` (torchrl's
``QValueActor``: a Q-network, then the ``QValueModule`` that picks the action): the steps after it run as they are,
rules included, and their outputs take the gradient back to the chain's output with autograd.

Examples:
    >>> from torch import nn
    >>> from tdhook.attribution.rules.basic import EpsilonRule
    >>> net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    >>> plan = ChainPlan.build(net, {net[0]: EpsilonRule(0.0), net[2]: EpsilonRule(0.0)})
    >>> x = torch.randn(5, 3)
    >>> output, factors = plan.forward(x)
    >>> seed = torch.zeros(5, 2).index_fill_(1, torch.tensor([0]), 1.0)
    >>> x_ = x.clone().requires_grad_(True)
    >>> torch.allclose(plan.input_gradient(factors, seed), torch.autograd.grad(net(x_)[:, 0].sum(), x_)[0])
    True
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule, TensorDictModuleBase, TensorDictSequential, skip_existing
from tensordict.utils import NestedKey
from torch import nn
from torch.nn.modules import module as module_globals
from torchrl.modules import MLP

from tdhook.attribution._inputs import feed_inputs
from tdhook.attribution._keys import as_tuple
from tdhook.attribution._policy_targets import sequential_steps
from tdhook.attribution._scaled_passes import relevance_product
from tdhook.attribution._writes import model_updates
from tdhook.attribution.rules._meta_tensors import raise_for_meta_tensors
from tdhook.attribution.rules._scopes import closing_scopes
from tdhook.attribution.rules.base import Rule
from tdhook.attribution.rules.basic import EpsilonRule, IgnoreRule, PassRule, is_homogeneous_activation, pass_factor

__all__ = ["ChainPlan", "PlannedCall", "context_plan", "planned_call", "planned_feed", "planned_updates"]

_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
# Set on an instance, each of these changes what calling the module runs (a forward patched on a layer, a
# TensorDictModule's call step replaced, ``module.compile()``'s ``_compiled_call_impl``).
_CALL_ATTRIBUTES = frozenset(("forward", "_call_impl", "_wrapped_call_impl", "_call_module", "_write_to_tensordict"))
# Element-wise activations whose PassRule gradient is the plan's ``grad * output / stabilize(input)``.
_ACTIVATIONS = (
    nn.Tanh,
    nn.ELU,
    nn.LeakyReLU,
    nn.SiLU,
    nn.GELU,
    nn.Softplus,
    nn.Mish,
    nn.Hardtanh,
    nn.ReLU6,
    nn.Hardswish,
    nn.SELU,
    nn.CELU,
    nn.Softsign,
    nn.Tanhshrink,
    nn.PReLU,
)


def _pass_factor(layer: nn.Module, rule: PassRule, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """The factor of ``PassRule`` on the activation ``layer`` at its input ``x``: ``output / stabilize(x)`` (in
    float32 for float16, whose smallest step is far above the stabiliser: see
    :func:`~tdhook.attribution.rules.basic.pass_factor`); on a positively homogeneous one (a leaky or parametric
    ReLU, ``nn.Hardtanh(0, inf)``), where the rule registers nothing, its plain derivative, 1 where ``x > 0`` and
    its slope elsewhere, as autograd's kernels take it (the stabiliser would move it off by ``stabilizer / |x|``).

    Examples:
        >>> x = torch.tensor([-2.0, 0.0, 1e-12], dtype=torch.float64)
        >>> _pass_factor(nn.LeakyReLU(0.1), PassRule(), x, nn.functional.leaky_relu(x, 0.1)).tolist()
        [0.1, 0.1, 1.0]
    """
    if is_homogeneous_activation(layer):
        slope = layer.forward(torch.full_like(x, -1.0)).neg_()
        return torch.where(x > 0, torch.ones_like(x), slope)
    return pass_factor(output, x, rule.stabilizer)


def _plain_chain(module: nn.Module) -> bool:
    """An ``nn.Sequential`` whose call runs its layers in order: the class's own ``forward``, or torchrl's
    ``MLP`` with a flat output (its ``forward`` then only calls the layers on its one input), and ``nn.Module``'s
    call."""
    if not isinstance(module, nn.Sequential) or not _calls_as(type(module), nn.Sequential, "__iter__"):
        return False
    if type(module).forward is nn.Sequential.forward:
        return True
    return type(module) is MLP and not getattr(module, "_reshape_out", True)


def _calls_as(cls: type, base: type, *names: str) -> bool:
    """Whether ``cls`` calls its instances as ``base`` does: the same ``__call__`` and ``_call_impl`` (and
    ``names``)."""
    return all(getattr(cls, name) is getattr(base, name) for name in ("__call__", "_call_impl", *names))


def _runs_its_class_code(module: nn.Module) -> bool:
    """Whether calling ``module`` runs its class's code: no forward or call step set on the instance, and not
    compiled in place (``module.compile()``)."""
    return _run_their_class_code((module,))


def _run_their_class_code(modules: Sequence[nn.Module]) -> bool:
    """Whether calling each of ``modules`` runs its class's code (see :func:`_runs_its_class_code`), in one loop:
    a plan checks it on every call."""
    for module in modules:
        attributes = module.__dict__
        if attributes.get("_compiled_call_impl") is not None or not attributes.keys().isdisjoint(_CALL_ATTRIBUTES):
            return False
    return True


@dataclass
class ChainPlan:
    """The layers of a chain and how each one's gradient is taken.

    Attributes:
        layers: ``(layer, rule)`` in order: an ``nn.Linear`` with its ``EpsilonRule`` (``None``: the plain
            gradient), an ``nn.ReLU`` (rule ``None``), or another activation with its ``PassRule``.
        hooks: the hook dicts of the chain and its layers, and their sizes when the plan was built (the rules' own
            hooks included): a hook added later runs code the plan would skip, so the plan then stands aside.
        chain: the planned chain (a layer replaced in it later also sets the plan aside).
        kinds: the class of each layer when the plan was built (a parametrization added later changes it).
        head: the ``TensorDictModule`` that holds the chain (set by :func:`context_plan`).
        tail: the steps of a ``TensorDictSequential`` after the head, run as they are (torchrl's ``QValueModule``
            after a Q-network): their outputs take the gradient to the chain's output with autograd.
        reads: each step of the tail (and of the ``TensorDictSequential`` steps in it) with the keys it read when the
            plan was made (see :func:`_tail_reads`): a step put in or a key changed since sets the plan aside.
    """

    layers: list[tuple[nn.Module, EpsilonRule | None]]
    hooks: tuple[tuple[dict, ...], tuple[int, ...]]
    chain: nn.Module
    kinds: tuple[type, ...]
    head: TensorDictModuleBase | None = None
    tail: tuple[TensorDictModuleBase, ...] = ()
    reads: tuple[tuple[TensorDictModuleBase, tuple], ...] = ()

    def __post_init__(self) -> None:
        # What every call compares (see applies): the layers in order, and those that could be set to run in place.
        self.modules = tuple(layer for layer, _ in self.layers)
        self.activations = tuple(layer for layer in self.modules if type(layer) in _ACTIVATIONS)

    @classmethod
    def build(cls, chain: nn.Module, rules: Mapping[nn.Module, Rule], ours: Collection[int] = ()) -> ChainPlan | None:
        """The plan of ``chain`` under ``rules`` (module to rule), or ``None`` where the chain or a rule is not
        one the plan follows exactly (a rule on the chain itself other than ``IgnoreRule``), a hook other than
        ``ours`` (hook ids: the rules' own) sits on the chain or a layer, or a forward is set on one of them (see
        :meth:`applies`).
        """
        if not _plain_chain(chain) or type(rules.get(chain, IgnoreRule())) is not IgnoreRule:
            return None  # a rule on the chain as a whole acts beyond its layers' rules
        layers: list[tuple[nn.Module, EpsilonRule | None]] = []
        for layer in chain:
            rule = rules.get(layer)
            if type(layer) is nn.Linear and (rule is None or type(rule) in (EpsilonRule, IgnoreRule)):
                layers.append((layer, rule if type(rule) is EpsilonRule else None))
            elif type(layer) is nn.ReLU and (rule is None or type(rule) in (PassRule, IgnoreRule)):
                layers.append((layer, None))
            elif type(layer) in _ACTIVATIONS and type(rule) is PassRule and not getattr(layer, "inplace", False):
                layers.append((layer, rule))
            else:
                return None
        if not layers or any(list(layer.children()) for layer, _ in layers):
            return None
        dicts = tuple(getattr(m, name) for m in (chain, *chain) for name in _HOOKS if hasattr(m, name))
        if any(hook not in ours for hooks in dicts for hook in hooks):
            return None
        if not _run_their_class_code((chain, *(layer for layer, _ in layers))):
            return None
        return cls(layers, (dicts, tuple(map(len, dicts))), chain, tuple(type(layer) for layer, _ in layers))

    def applies(self) -> bool:
        """Whether the chain still holds the planned layers, of the same classes, and runs them as their classes
        do (no forward set on an instance, nothing compiled in place), no hook was added to the chain or its
        layers, and no global module hook is set."""
        layers = tuple(self.chain._modules.values())
        # The planned classes (Linear, activations) compare modules by identity: the same objects, same classes.
        if tuple(map(type, layers)) != self.kinds or layers != self.modules:
            return False
        if not _run_their_class_code((self.chain, *layers)):
            return False
        if any(getattr(layer, "inplace", False) for layer in self.activations):
            return False  # an activation set to run in place since: its input is gone by the time of its factor
        if module_globals._global_forward_hooks or module_globals._global_forward_pre_hooks:
            return False
        if module_globals._global_backward_hooks or module_globals._global_backward_pre_hooks:
            return False
        dicts, sizes = self.hooks
        return tuple(map(len, dicts)) == sizes

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """The chain's output on ``x``, and per layer the factor its gradient needs (``None``: ``W`` alone)."""
        factors: list[torch.Tensor | None] = []
        with torch.no_grad():
            for layer, rule in self.layers:
                if type(layer) is nn.Linear:
                    weight, bias = layer.weight, layer.bias
                    x = torch.nn.functional.linear(x, weight, bias)
                    if weight.is_meta or (bias is not None and bias.is_meta):  # set there since the plan was made
                        raise_for_meta_tensors(layer, x)
                    factors.append(None if rule is None else rule._scale_of(x, 1))  # x has no history: no detach
                elif type(layer) is nn.ReLU:
                    x = torch.relu(x)
                    factors.append(x)
                else:  # PassRule's scale, output over stabilized input
                    output = layer.forward(x)  # its class's own code (checked), without the rules' hooks
                    if layer._parameters:  # PReLU's weight
                        raise_for_meta_tensors(layer, output)
                    factors.append(_pass_factor(layer, rule, x, output))
                    x = output
        return x, factors

    def input_gradient(self, factors: list[torch.Tensor | None], seed: torch.Tensor) -> torch.Tensor:
        """The modified gradient of the chain's input for the output gradient ``seed``."""
        grad = seed
        with torch.no_grad():
            for (layer, rule), factor in zip(reversed(self.layers), reversed(factors), strict=True):
                if type(layer) is nn.Linear:
                    grad = (grad if rule is None else grad * factor).matmul(layer.weight)
                elif type(layer) is nn.ReLU:
                    grad = torch.ops.aten.threshold_backward(grad, factor, 0)
                else:
                    grad = grad * factor
        return grad


@dataclass
class PlannedCall:
    """One call of a wrapper run by a :class:`ChainPlan`: the forward pass writes the model's output into the
    call's TensorDict, as the model's ``TensorDictModule`` does, and keeps the factors for the passes after it.

    Attributes:
        plan: the plan of the wrapped chain.
        wrapper: the ``TensorDictModule`` holding the chain (one input key, one output key).
        value: the input the call's TensorDict holds at the wrapper's input key (read once per call).
    """

    plan: ChainPlan
    wrapper: TensorDictModuleBase
    value: torch.Tensor
    factors: list[torch.Tensor | None] | None = None
    output: torch.Tensor | None = None

    @property
    def tail(self) -> tuple[TensorDictModuleBase, ...]:
        """The steps run after the chain, as they are (see :attr:`ChainPlan.tail`)."""
        return self.plan.tail

    def feed(self, work: TensorDictBase) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The leaf of the one explained input and the tensor the chain reads (the input itself: the plan writes
        into no input), as :func:`~tdhook.attribution._inputs.feed_inputs` gives them."""
        leaf = self.value.detach()
        return [leaf], [leaf]

    def run(self, work: TensorDictBase) -> TensorDictBase:
        """Run the chain on ``work``'s input and write its output there, then the tail's steps; ``work``."""
        output, self.factors = self.plan.forward(self.value)
        self.output = output.requires_grad_(True)
        # It depends on the input, as the wrapper's checks of the target ask (the wrapper writes it detached); the
        # tail's outputs take their gradient to it with autograd.
        work.set(self.wrapper.out_keys[0], self._read_by_tail(output) if self.tail else output)
        if self.tail:
            with closing_scopes():  # what the tail's rules enter and an interrupt keeps them from leaving
                for step in self.tail:
                    work = step(work)
        return work

    def _read_by_tail(self, output: torch.Tensor) -> torch.Tensor:
        """What the tail reads for the chain's output ``output`` (a leaf): a tensor that autograd takes back to it
        and that a step may change in place, as it may the chain's output on the general path, leaving the leaf and
        the factors as the forward pass made them. After a ReLU it is that ReLU's output again, which autograd
        keeps: changed in place, the backward pass then raises as the general path's does."""
        return torch.relu(output) if type(self.plan.layers[-1][0]) is nn.ReLU else output.clone()

    def updates(self) -> dict | None:
        """The model's outputs to write into the caller's TensorDict: the chain's one output, detached (what
        :func:`~tdhook.attribution._writes.model_updates` finds after the call); ``None`` with a tail, whose outputs
        that function finds."""
        return None if self.tail else {self.wrapper.out_keys[0]: self.output.detach()}

    def one_pass(self, seeds: list, keep: bool, leaves: list[torch.Tensor], **unused: object) -> tuple[list, list]:
        """The relevance of the one leaf for the backward pass started at ``seeds`` (``(tensor, gradient)`` pairs),
        and whether it was reached, as :func:`~tdhook.attribution._backward.leaf_relevance` gives them. Seeds on
        the tail's outputs reach the chain's output through autograd (``keep``: for a later pass); nothing is
        recorded."""
        if not self.tail:
            ((_, seed),) = seeds
            return [relevance_product(leaves[0].detach(), self.plan.input_gradient(self.factors, seed))], [True]
        tensors, grads = zip(*seeds, strict=True)
        (grad,) = torch.autograd.grad(tensors, self.output, grads, retain_graph=keep, allow_unused=True)
        if grad is None:
            return [torch.zeros_like(leaves[0])], [False]
        return [relevance_product(leaves[0].detach(), self.plan.input_gradient(self.factors, grad))], [True]


def context_plan(
    lrp: Any, rules: Mapping[str, Rule], modules: Mapping[str, nn.Module], ours: Collection[int]
) -> ChainPlan | None:
    """The plan of ``lrp``'s context (its rules registered), or ``None`` where a feature of the wrapper or the
    model acts on calls beyond the chain: a function mode, inner layers or a relevance check, a kept graph, a
    random or compiled module, several explained keys, a TensorDict module that calls its module otherwise than
    ``TensorDictModule`` does, a hook other than ``ours`` (the ids of the context's hooks), steps after the chain
    that read the explained input or whose rules read the layers' marks (input-layer rules, merged BatchNorms)."""
    head, tail = _head_and_tail(lrp.module)
    if head is None or len(head.in_keys) != 1 or len(head.out_keys) != 1 or list(head.in_keys) != lrp.explained_keys:
        return None
    reads = _tail_reads(tail)
    if any(_on_one_path(key, head.in_keys[0]) for _, keys in reads for key in keys):
        return None  # the tail reads the explained input or a branch holding it: relevance reaches it elsewhere
    if tail and lrp._marks_read:
        return None  # a tail rule walks back to the layers before it (input-layer rules), which the plan runs bare
    if lrp.create_graph or lrp.relevance_check is not None or lrp.layer_keys or lrp._stochastic or lrp._compiled:
        return None
    if getattr(lrp.rule_mapper, "function_modes", list)():
        return None
    plan = ChainPlan.build(head.module, {modules[name]: rule for name, rule in rules.items()}, ours)
    if plan is not None:
        plan.head, plan.tail, plan.reads = head, tail, reads
    return plan


def _head_and_tail(wrapper: object) -> tuple[TensorDictModule | None, tuple[TensorDictModuleBase, ...]]:
    """The ``TensorDictModule`` holding a chain that ``wrapper`` runs first, and the steps after it: ``wrapper``
    itself and none, or the first step of a ``TensorDictSequential`` that runs its steps one after the other on the
    TensorDict it is given (no ``selected_out_keys``, ``inplace`` or ``partial_tolerant``) and the steps after it;
    ``(None, ())`` for anything else."""
    if _plain_tensordict_module(wrapper):
        return wrapper, ()
    if not isinstance(wrapper, TensorDictSequential) or not _runs_steps_in_turn(wrapper):
        return None, ()
    steps = sequential_steps(wrapper)
    if len(steps) < 2 or not _plain_tensordict_module(steps[0]):
        return None, ()
    return steps[0], tuple(steps[1:])


def _tail_reads(tail: Sequence[TensorDictModuleBase]) -> tuple[tuple[TensorDictModuleBase, tuple], ...]:
    """Each step of ``tail`` with the keys it reads, then, for a ``TensorDictSequential``, its steps in turn."""
    reads: list[tuple[TensorDictModuleBase, tuple]] = []
    for step in tail:
        reads.append((step, tuple(step.in_keys)))
        reads += _tail_reads(sequential_steps(step))
    return tuple(reads)


def _on_one_path(key: NestedKey, other: NestedKey) -> bool:
    """Whether ``key`` and ``other`` are the same key, or one is a branch holding the other."""
    key, other = as_tuple(key), as_tuple(other)
    return key[: len(other)] == other[: len(key)]


def _runs_steps_in_turn(wrapper: TensorDictSequential) -> bool:
    """Whether calling ``wrapper`` only calls each of its steps on the TensorDict it is given, in order."""
    calls = ("forward", "_run_module", "_module_iter")
    if not _calls_as(type(wrapper), TensorDictSequential, *calls) or not _runs_its_class_code(wrapper):
        return False
    return wrapper.inplace is None and not wrapper._select_before_return and not wrapper.partial_tolerant


def _plain_tensordict_module(wrapper: object) -> bool:
    """A ``TensorDictModule`` (or a subclass with its call, as torchrl's ``ValueOperator`` and ``Actor``) that reads
    its inputs positionally as they are stored, calls its module itself (no ``method``) and writes its outputs into
    the TensorDict it is given."""
    calls = ("forward", "_call_module", "_write_to_tensordict")
    if not isinstance(wrapper, TensorDictModule) or not _calls_as(type(wrapper), TensorDictModule, *calls):
        return False
    return wrapper._kwargs is None and not getattr(wrapper, "_get_kwargs", None) and _calls_its_module(wrapper)


def _calls_its_module(wrapper: TensorDictModule) -> bool:
    """Whether ``wrapper`` calls its module itself (no ``method``) with its class's code (checked on every call)."""
    method = getattr(wrapper, "method", None) is not None or getattr(wrapper, "method_kwargs", None)
    return not method and _runs_its_class_code(wrapper)


def planned_call(
    lrp: Any, explained: list[bool], work: TensorDictBase, signature: Hashable = None
) -> PlannedCall | None:
    """The planned run of this call of ``lrp`` on ``work``, or ``None`` where it takes the hooks and autograd:
    outside a context or inside ``inactive()``, ``create_graph`` (switched on in the context), the first call of a
    context (it watches the rules and the functions the model calls), a model calling ``F.batch_norm`` or the like
    as a function (its gradient laid out in a mode; not known before the wrapper's first call), the first call of a
    ``signature`` (see :mod:`~tdhook.attribution._call_signatures`; it is watched as the first), a model computing
    gates with functions (held), a callable or ``"all"`` target, ``split_dim``, an input missing or not
    floating-point, a hook added since the context was entered, or a model that runs other code than when the plan
    was made (see :meth:`ChainPlan.applies`; another chain, call step or ``method`` in the wrapped
    ``TensorDictModule``, or other keys it reads)."""
    plan = lrp._plan
    if plan is None or lrp._handles is None or lrp._inactive or not all(explained) or lrp.split_dim is not None:
        return None
    if lrp.create_graph:  # switched on in the open context: the graph is kept by the hooks and autograd
        return None
    if (
        lrp._coverage.watches(signature)
        or lrp._norm_calls.found is not False  # F.batch_norm and the like called as functions: laid out in a mode
        or lrp._rule_use.watches(lrp._handles, signature)
        or lrp._function_gates.may_hold(lrp.rule_mapper, signature)  # a gate the model computes with functions
        or callable(lrp.target)
        or isinstance(lrp.target, str)
    ):
        return None
    wrapper, head = lrp.module, plan.head
    if skip_existing() or _hooked(wrapper) or not plan.applies():
        return None
    if plan.tail and (
        _hooked(head) or _head_and_tail(wrapper) != (head, plan.tail) or _tail_reads(plan.tail) != plan.reads
    ):
        return None  # a hook on the head, or other steps or keys put in since the context was entered
    if getattr(head, "module", None) is not plan.chain or not _calls_its_module(head):
        return None  # another chain, call step or method put in since the context was entered
    in_keys = head.in_keys
    if in_keys != lrp.explained_keys:
        return None  # the chain set to read another key since: the plan would explain that one under this one's name
    value = work.get(in_keys[0])
    if not value.is_floating_point():
        return None
    return PlannedCall(plan, head, value)


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def planned_feed(planned: PlannedCall | None, *args: Any) -> tuple[list, list]:
    """The leaves and fed inputs of a call: ``planned``'s, or :func:`~tdhook.attribution._inputs.feed_inputs`
    of ``args`` where the call is not planned."""
    return planned.feed(args[0]) if planned is not None else feed_inputs(*args)


def planned_updates(planned: PlannedCall | None, *args: Any, **kwargs: Any) -> dict:
    """The model's outputs to write: ``planned``'s, or :func:`~tdhook.attribution._writes.model_updates` of the
    arguments where the call is not planned."""
    updates = planned.updates() if planned is not None else None
    return model_updates(*args, **kwargs) if updates is None else updates
