"""The LRP wrapper: a ``TensorDictModule`` that writes relevance next to the outputs."""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import (
    ProbabilisticTensorDictModule,
    TensorDictModule,
    TensorDictModuleBase,
    TensorDictSequential,
    dispatch,
)
from tensordict.utils import NestedKey, unravel_key, unravel_key_list
from torch import nn
from torchrl.modules import ActorCriticWrapper, ActorValueOperator

from tdhook.attribution.lrp_helpers.rules import (
    BaseRuleMapper,
    MergeBatchNormRule,
    RemovableRuleHandle,
    Rule,
    RuleMapper,
    layer_call_of,
)
from tdhook.attribution.lrp_helpers.targets import Target, initial_gradient

__all__ = ["LRP"]

RelevanceCheck = Callable[[str, nn.Module, torch.Tensor, torch.Tensor], None]

# Every module inside an open LRP context, with the wrapper that owns it: two wrappers' rules on one module would mix.
_OWNERS: weakref.WeakKeyDictionary[nn.Module, LRP] = weakref.WeakKeyDictionary()


def _as_tuple(key: NestedKey) -> tuple[str, ...]:
    key = unravel_key(key)
    return key if isinstance(key, tuple) else (key,)


def _leaf_modules(module: TensorDictModuleBase) -> list[TensorDictModuleBase]:
    if isinstance(module, TensorDictSequential):
        return [leaf for sub in module.module for leaf in _leaf_modules(sub)]
    return [module]


def _named_targets(
    module: TensorDictModuleBase, target_key: NestedKey | Mapping[str, NestedKey] | None
) -> dict[str | None, tuple[NestedKey | None, TensorDictModuleBase]]:
    """``name -> (target key or None for the default, module whose outputs give the default)``."""
    if isinstance(target_key, Mapping):
        if not target_key:
            raise ValueError("LRP: target_key is an empty dict; name at least one output to explain")
        return {name: (unravel_key(key), module) for name, key in target_key.items()}
    if target_key is None and isinstance(module, (ActorValueOperator, ActorCriticWrapper)):
        return {"actor": (None, module.get_policy_operator()), "critic": (None, module.get_value_operator())}
    return {None: (unravel_key(target_key) if target_key is not None else None, module)}


def _default_target_candidates(module: TensorDictModuleBase) -> list[NestedKey]:
    """Out keys in pipeline order that no module of the pipeline reads.

    Probabilistic modules (the sampling step of a torchrl ``ProbabilisticActor``)
    are left out: their inputs, the distribution's parameters (``loc``,
    ``logits``), are what gets explained, not a random sample.
    """
    leaves = [leaf for leaf in _leaf_modules(module) if not isinstance(leaf, ProbabilisticTensorDictModule)]
    if not leaves:
        return []
    read = {unravel_key(k) for leaf in leaves for k in leaf.in_keys}
    written = [unravel_key(k) for leaf in leaves for k in leaf.out_keys]
    ordered = list(dict.fromkeys(written))
    return [k for k in ordered if k not in read] or ordered[::-1]


class LRP(TensorDictModuleBase):
    """Layer-wise relevance propagation around a ``TensorDictModule``.

    Inside ``with lrp:`` the rules chosen by ``rule_mapper`` are registered on
    the wrapped model once; every call runs the model, writes its outputs as
    the model would and writes the relevance of each input key ``k`` at
    ``(relevance_key, *k)``. The relevance of a tensor is the tensor times its
    rule-modified gradient, so glue code between modules (concatenation,
    scaling, reshapes) needs no rule. Calling outside ``with`` enters and
    leaves the context for that call.

    Args:
        module: a ``TensorDictModuleBase`` (``TensorDictModule``,
            ``TensorDictSequential``, torchrl actors and value operators), or a
            plain ``nn.Module`` together with ``in_keys`` and ``out_keys``.
        rule_mapper: ``(name, module) -> Rule | None``, or a dict keyed by
            module type or name pattern (completed with the defaults of
            :class:`~tdhook.attribution.lrp_helpers.rules.BaseRuleMapper`);
            by default LRP-0 on Linear and convolution layers, with each
            eval-mode BatchNorm merged into the layer before it. Names are
            those of ``module.named_modules()`` for the object passed as
            ``module`` (a plain ``nn.Module``'s own names).
        in_keys: for a plain module, its input keys; for a TensorDict module,
            the input keys to explain (all of its in_keys by default).
        out_keys: the output keys of a plain module.
        target_key: the output to explain. Defaults to the first
            floating-point out key that no module of the pipeline reads,
            leaving out sampling steps: ``"chosen_action_value"`` for a
            ``QValueActor``, ``"loc"`` for a ``ProbabilisticActor`` with a
            ``TanhNormal`` (or other location-scale) distribution,
            ``"logits"`` for one with a ``Categorical`` or
            ``OneHotCategorical``, ``"state_value"`` for a ``ValueOperator``.
            A dict ``name -> key`` explains several outputs from one forward
            pass, writing relevance at ``(relevance_key, name, *input_key)``.
            An ``ActorValueOperator`` or ``ActorCriticWrapper`` gets
            ``{"actor": <its actor's default>, "critic": <its critic's>}``.
        target: the initial relevance: ``None`` (the output at the argmax of
            its last dimension, or the output itself for a one-element last
            dimension), an int, a LongTensor of per-sample indices, a callable
            ``output -> relevance``, or ``"all"`` (every output unit, stacked
            in a dimension right after the batch dimensions).
        relevance_key: the prefix of the relevance keys.
        layers: inner modules whose output relevance is written too: a list
            of module names (written at ``(relevance_key, name)``) or a dict
            ``name -> key`` (written at ``(relevance_key, *key)``). A Linear or
            convolution layer merged with its BatchNorm reports the merged
            output's relevance.
        relevance_check: optional ``(name, module, relevance_in, relevance_out)``
            callable run on every module with a rule, for example
            :func:`~tdhook.attribution.lrp_helpers.rules.raise_for_unconserved_rel_factory`.
        token_relevance_key: if given, every relevance is also written summed
            over its last (feature) dimension at ``(token_relevance_key, ...)``,
            in place of ``relevance_key``: for embeddings ``[B, T, H]`` given
            as input, or an embedding layer named in ``layers``, the relevance
            of each token ``[B, T]``. Integer token ids read by an
            ``nn.Embedding`` get their per-token relevance at
            ``(relevance_key, key)`` already.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tensordict.nn import TensorDictModule
        >>> from tdhook.attribution import LRP
        >>> from tdhook.attribution.lrp_helpers.rules import EpsilonPlus
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        >>> policy = TensorDictModule(net, in_keys=["observation"], out_keys=["action_value"])
        >>> lrp = LRP(policy, rule_mapper=EpsilonPlus())
        >>> with lrp:
        ...     td = lrp(TensorDict(observation=torch.randn(3, 4), batch_size=[3]))
        >>> td["relevance", "observation"].shape
        torch.Size([3, 4])
        >>> torch.equal(td["action_value"], net(td["observation"]))
        True
    """

    def __init__(
        self,
        module: TensorDictModuleBase | nn.Module,
        rule_mapper: RuleMapper | Mapping | None = None,
        *,
        in_keys: Sequence[NestedKey] | None = None,
        out_keys: Sequence[NestedKey] | None = None,
        target_key: NestedKey | Mapping[str, NestedKey] | None = None,
        target: Target = None,
        relevance_key: str = "relevance",
        layers: Sequence[str] | Mapping[str, NestedKey] | None = None,
        relevance_check: RelevanceCheck | None = None,
        token_relevance_key: str | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, TensorDictModuleBase):
            if not isinstance(module, nn.Module):
                raise TypeError(f"LRP wraps a TensorDictModuleBase or an nn.Module, got {type(module).__name__}")
            if in_keys is None or out_keys is None:
                raise TypeError(
                    f"LRP needs in_keys and out_keys to wrap a plain {type(module).__name__}; "
                    "give both or pass a TensorDictModule"
                )
            module = TensorDictModule(module, in_keys=in_keys, out_keys=out_keys)
            # Module names (for rule mappers and inner-layer keys) are relative to what the caller passed.
            self._name_prefix = "module."
        elif out_keys is not None:
            raise TypeError("out_keys is only for a plain nn.Module: a TensorDict module declares its own")
        else:
            self._name_prefix = ""
        self.module = module
        if rule_mapper is None or isinstance(rule_mapper, Mapping):
            rule_mapper = BaseRuleMapper(rule_mapper=rule_mapper)
        self.rule_mapper = rule_mapper
        self.explained_keys = unravel_key_list(list(in_keys if in_keys is not None else module.in_keys))
        self.targets = _named_targets(module, target_key)
        named = None not in self.targets
        self.target_key = {n: k for n, (k, _) in self.targets.items()} if named else self.targets[None][0]
        self.target = target
        self.relevance_key = relevance_key
        self.relevance_check = relevance_check
        self.layer_keys = self._layer_keys(layers)
        # Output keys per target, in order: the explained inputs' relevance, then the inner layers'.
        self._keys_per_target = {
            name: [
                (relevance_key, *prefix, *_as_tuple(k))
                for k in [*self.explained_keys, *self.layer_keys.values()]
                for prefix in [(name,) if name is not None else ()]
            ]
            for name in self.targets
        }
        self.relevance_keys = [key for keys in self._keys_per_target.values() for key in keys]
        # The input key each relevance key belongs to (None for an inner layer's).
        self._relevance_sources = [
            key for _ in self.targets for key in [*self.explained_keys, *[None] * len(self.layer_keys)]
        ]
        if token_relevance_key is not None and token_relevance_key == relevance_key:
            raise ValueError(f"LRP: token_relevance_key and relevance_key are both {relevance_key!r}; pick two")
        self.token_relevance_key = token_relevance_key
        self.token_relevance_keys = (
            [(token_relevance_key, *key[1:]) for key in self.relevance_keys] if token_relevance_key else []
        )
        self.in_keys = unravel_key_list(list(dict.fromkeys([*module.in_keys, *self.explained_keys])))
        self.out_keys = [*unravel_key_list(module.out_keys), *self.relevance_keys, *self.token_relevance_keys]
        self._handles: list[RemovableRuleHandle] | None = None
        self._hooks: list = []
        self._layer_cells: dict[str, list[OutputRelevance]] = {}
        self._tokens: dict[int, tuple] = {}
        self._stochastic: list[tuple[str, nn.Module]] = []

    def named_explained_modules(self) -> dict[str, nn.Module]:
        """The wrapped model's modules by the names rule mappers and ``layers`` use."""
        prefix = self._name_prefix
        root = self.module.module if prefix else self.module
        return dict(root.named_modules())

    def _layer_keys(self, layers: Sequence[str] | Mapping[str, NestedKey] | None) -> dict[str, tuple[str, ...]]:
        if layers is None:
            return {}
        if isinstance(layers, str):
            raise TypeError(f"LRP: layers must be a list or dict of module names, got the string {layers!r}")
        named = layers if isinstance(layers, Mapping) else {name: name for name in layers}
        modules = self.named_explained_modules()
        keys = {}
        for name, key in named.items():
            if name not in modules:
                known = [n for n in modules if n]
                raise KeyError(f"LRP: layers names {name!r}, which is not a module of the model (modules: {known})")
            keys[name] = _as_tuple(key)
        clash = set(keys.values()) & {_as_tuple(k) for k in self.explained_keys}
        if clash:
            raise ValueError(f"LRP: layer relevance keys {sorted(clash)} clash with the input relevance keys")
        return keys

    # ------------------------------------------------------------------ context

    def _rules(self) -> dict[str, Rule]:
        mapper = self.rule_mapper
        modules = self.named_explained_modules()
        if hasattr(mapper, "rules"):
            return mapper.rules(modules[""])
        rules = {}
        for name, sub in modules.items():
            rule = mapper(name, sub)
            if rule is not None:
                rules[name] = rule
        return rules

    def __enter__(self) -> LRP:
        if self._handles is not None:
            raise RuntimeError("this LRP wrapper's context is already active; leave it before entering again")
        modules = self.named_explained_modules()
        self._claim(modules)
        handles: list[RemovableRuleHandle] = []
        try:
            for name, rule in self._rules().items():
                try:
                    handles.append(rule.register(modules[name]))
                except Exception as err:
                    raise type(err)(
                        f"cannot register {rule!r} on module {name!r} ({type(modules[name]).__name__}): {err}"
                    ) from err
            if self.relevance_check is not None:
                self._add_check_hooks(handles, modules)
            if getattr(self.rule_mapper, "function_modes", list)():
                self._suspend_function_modes_in(handles)
            for name in self.layer_keys:
                self._hooks.append(modules[name].register_forward_hook(self._layer_hook(name)))
            for name, sub in modules.items():
                if isinstance(sub, nn.Embedding):
                    self._hooks.append(sub.register_forward_hook(self._embedding_hook(name), prepend=True))
        except BaseException:
            self._remove(handles)
            self._release()
            raise
        self._handles = handles
        self._stochastic = [(n, m) for n, m in modules.items() if isinstance(m, nn.Dropout) and m.p > 0]
        return self

    def __exit__(self, *exc_info: object) -> None:
        handles, self._handles = self._handles or [], None
        try:
            self._remove(handles)
        finally:
            self._release()

    def __getstate__(self) -> dict:
        if self._handles is not None:
            raise RuntimeError("LRP: leave the wrapper's context before copying or pickling it")
        return super().__getstate__()

    def _claim(self, modules: dict[str, nn.Module]) -> None:
        for name, module in modules.items():
            owner = _OWNERS.get(module)
            if owner is not None and owner is not self:
                path = name or "the model itself"
                raise RuntimeError(
                    f"LRP: module {path!r} ({type(module).__name__}) is already inside another LRP wrapper's "
                    "context; leave that context first (the rules of two wrappers on one model would mix)"
                )
        for module in modules.values():
            _OWNERS[module] = self

    def _release(self) -> None:
        for module in [m for m, owner in _OWNERS.items() if owner is self]:
            del _OWNERS[module]

    def _remove(self, handles: list[RemovableRuleHandle]) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for handle in reversed(handles):
            handle.remove()

    def _suspend_function_modes_in(self, handles: list[RemovableRuleHandle]) -> None:
        """Run modules that have a rule of their own without the mapper's function modes.

        A module rule decides the module's gradient as a whole, so the function
        rules (AttnLRP's products and softmax, stabilised additions) have
        nothing to change inside it, and skipping their Python dispatch there
        saves time. The modes resume when the module returns or raises.
        """
        guards: list = []

        def suspend(module: nn.Module, args: tuple) -> None:
            guard = torch._C.DisableTorchFunction() if torch._C._is_torch_function_mode_enabled() else None
            if guard is not None:
                guard.__enter__()
            guards.append(guard)

        def resume(module: nn.Module, args: tuple, output: Any) -> None:
            guard = guards.pop() if guards else None
            if guard is not None:
                guard.__exit__(None, None, None)

        for handle in handles:
            module = handle.module
            if module is not None and handle.rule.is_registered(module):
                self._hooks.append(module.register_forward_pre_hook(suspend))
                self._hooks.append(module.register_forward_hook(resume, always_call=True))

    def _layer_hook(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not torch.is_grad_enabled():
                return
            if not isinstance(output, torch.Tensor):
                raise TypeError(
                    f"LRP: layers asks for the relevance of module {name!r} ({type(module).__name__}), "
                    f"whose output is a {type(output).__name__}, not a tensor"
                )
            self._layer_cells.setdefault(name, []).append(OutputRelevance.watch(output))

        return hook

    def _add_check_hooks(self, handles: list[RemovableRuleHandle], modules: dict[str, nn.Module]) -> None:
        names = {id(m): n for n, m in modules.items()}
        check = self.relevance_check

        def records_for(x: torch.Tensor) -> torch.Tensor | int:
            return sum(r for h in handles for t, r in h.records if t is x)

        for handle in handles:
            module = handle.module
            if getattr(module, "inplace", False) or isinstance(handle.rule, MergeBatchNormRule):
                continue  # a merged BatchNorm is checked as part of the layer before it
            if not handle.rule.is_registered(module):
                continue
            name = names[id(module)]

            def pre_hook(mod, args):
                if torch.is_grad_enabled() and len(args) == 1 and isinstance(args[0], torch.Tensor):
                    if args[0].requires_grad:
                        # A view of its own, so that the gradient seen is this module's share only,
                        # even when the input also feeds other modules (a residual branch).
                        alias = args[0].view_as(args[0])
                        alias._tdhook_alias_of = args[0]
                        return (alias,)
                return None

            def forward_hook(mod, args, output, name=name):
                if not (torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad):
                    return
                if len(args) != 1 or not hasattr(args[0], "_tdhook_alias_of"):
                    return
                x, out = args[0], OutputRelevance.watch(output)
                x.register_hook(lambda g: check(name, mod, x.detach() * g + records_for(x), out.total()))

            self._hooks.append(module.register_forward_pre_hook(pre_hook))
            self._hooks.append(module.register_forward_hook(forward_hook))

    # ------------------------------------------------------------------ call

    @dispatch(auto_batch_size=False)
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        if self._handles is None:
            with self:
                return self._explain(tensordict)
        return self._explain(tensordict)

    def _validate_inputs(self, tensordict: TensorDictBase) -> None:
        for key in self.explained_keys:
            value = tensordict.get(key, None)
            if value is None:
                raise KeyError(
                    f"LRP: input key {key!r} is missing from the TensorDict "
                    f"(keys: {sorted(map(str, tensordict.keys(include_nested=True, leaves_only=True)))})"
                )
            if not isinstance(value, torch.Tensor) or value.dtype == torch.bool or value.is_complex():
                dtype = getattr(value, "dtype", type(value).__name__)
                raise TypeError(
                    f"LRP: input key {key!r} must be a floating-point tensor (or integer tokens read by an "
                    f"nn.Embedding) to receive relevance, got {dtype}; pass in_keys=[...] to explain only those inputs"
                )

    def _target_key(self, result: TensorDictBase, name: str | None) -> NestedKey:
        target_key, operator = self.targets[name]
        if target_key is not None:
            if target_key not in result.keys(include_nested=True):
                raise KeyError(f"LRP: target key {target_key!r} was not written by the wrapped module")
            return target_key
        candidates = _default_target_candidates(operator)
        for key in candidates:
            value = result.get(key, None)
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                return key
        raise KeyError(f"LRP: none of the module's outputs {candidates} is a floating-point tensor; pass target_key")

    def _warn_for_stochastic_modules(self) -> None:
        for name, module in self._stochastic:
            if module.training:
                warnings.warn(
                    f"LRP: module {name!r} ({type(module).__name__}, p={module.p}) is in training mode, so the "
                    "relevance is random from call to call; call .eval() on the model for a deterministic explanation",
                    stacklevel=4,
                )
                self._stochastic = []  # once per context
                return

    def _explain(self, tensordict: TensorDictBase) -> TensorDictBase:
        self._validate_inputs(tensordict)
        self._warn_for_stochastic_modules()
        work = tensordict.copy()
        leaves: list[torch.Tensor | None] = []
        fed: list[torch.Tensor | None] = []
        self._layer_cells = {}
        self._tokens = {}
        try:
            with torch.enable_grad():
                for i, key in enumerate(self.explained_keys):
                    value = work.get(key)
                    if not value.is_floating_point():
                        # Integer tokens: the relevance of their embeddings stands for them (see _embedding_hook).
                        self._tokens[i] = (value.clone(), leaves, fed)
                        work.set(key, self._tokens[i][0])
                        leaves.append(None)
                        fed.append(None)
                        continue
                    leaf = value.detach().requires_grad_(True)
                    # The model sees a copy: in-place operations on it are legal and never reach the caller's data.
                    fed.append(leaf.clone())
                    work.set(key, fed[-1])
                    leaves.append(leaf)
                try:
                    with contextlib.ExitStack() as modes:
                        for mode in getattr(self.rule_mapper, "function_modes", list)():
                            modes.enter_context(mode)
                        result = self._call_model(work)
                except Exception as err:
                    self._raise_for_unembedded_tokens(leaves, err)
                    shapes = ", ".join(f"{k!r}: {_describe(tensordict.get(k))}" for k in self.explained_keys)
                    err.add_note(f"LRP: raised while running the wrapped module on the inputs {shapes}")
                    raise
                self._raise_for_unembedded_tokens(leaves)
                result = work if result is None else result
                relevances = []
                names = list(self.targets)
                for position, name in enumerate(names):
                    target_key = self._target_key(result, name)
                    output = result.get(target_key)
                    if not isinstance(output, torch.Tensor) or not output.is_floating_point():
                        raise TypeError(
                            f"LRP: target {target_key!r} is {_describe(output)}; relevance explains a floating-point "
                            "output (logits, action values, a value estimate): pass target_key=<such a key>"
                        )
                    if not output.requires_grad:
                        raise ValueError(
                            f"LRP: target {target_key!r} does not depend on the explained inputs {self.explained_keys}"
                        )
                    grad_outputs = initial_gradient(output, self.target, target_key, tensordict.batch_dims)
                    retain = position < len(names) - 1  # the next target reuses this forward pass
                    relevances += self._backward(output, grad_outputs, leaves, fed, retain)
        finally:
            self._layer_cells = {}
            self._tokens = {}
            for handle in self._handles or []:
                handle.pop_records()
        self._write(tensordict, result, relevances, fed)
        return tensordict

    def _backward(
        self,
        output: torch.Tensor,
        grad_outputs: torch.Tensor,
        leaves: list[torch.Tensor],
        fed: list[torch.Tensor],
        retain: bool = False,
    ) -> list[torch.Tensor]:
        batched = grad_outputs.dim() > output.dim()
        if not batched:
            return self._relevance(output, grad_outputs, leaves, fed, retain=retain)
        # target="all": one backward per output unit over a single forward pass.
        n_units = grad_outputs.shape[0]
        per_unit = [
            self._relevance(output, grad_outputs[k], leaves, fed, retain=retain or k < n_units - 1)
            for k in range(n_units)
        ]
        batch_dims = output.dim() - 1
        return [torch.stack([unit[i] for unit in per_unit], dim=batch_dims) for i in range(len(per_unit[0]))]

    def _relevance(
        self,
        output: torch.Tensor,
        grad_output: torch.Tensor,
        leaves: list[torch.Tensor],
        fed: list[torch.Tensor],
        retain: bool,
    ) -> list[torch.Tensor]:
        grads = torch.autograd.grad(output, leaves, grad_output, retain_graph=retain, allow_unused=True)
        relevances = [
            leaf.detach() * g if g is not None else torch.zeros_like(leaf)
            for leaf, g in zip(leaves, grads, strict=True)
        ]
        # Token relevance: the relevance of each token's embedding vector, summed over its features.
        token_indices = [i for i, leaf in enumerate(leaves) if self._is_token_leaf(leaf)]
        for handle in self._handles or []:
            for x, rest in handle.pop_records():
                x = getattr(x, "_tdhook_alias_of", x)
                for i, model_input in enumerate(fed):
                    if x is model_input:
                        relevances[i] = relevances[i] + rest
        for i in token_indices:
            relevances[i] = relevances[i].sum(-1).reshape(self._tokens[i][0].shape)
        return relevances + [self._layer_relevance(name, leaves[0]) for name in self.layer_keys]

    def _call_model(self, work: TensorDictBase) -> TensorDictBase | None:
        if not self._name_prefix:
            return self.module(work)
        # A plain nn.Module wrapped here: call it directly, without the generic conversion of every
        # output that TensorDictModule applies (a fixed cost per call, large next to a small policy).
        wrapper = self.module
        outputs = wrapper.module(*(work.get(key) for key in wrapper.in_keys))
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        if len(outputs) != len(wrapper.out_keys):
            raise RuntimeError(
                f"LRP: the module returned {len(outputs)} outputs for the {len(wrapper.out_keys)} out_keys "
                f"{wrapper.out_keys}"
            )
        for key, value in zip(wrapper.out_keys, outputs, strict=True):
            if key != "_":  # TensorDictModule's placeholder for an output to drop
                work.set(key, value if isinstance(value, torch.Tensor) else TensorDict.from_any(value))
        return work

    def _raise_for_unembedded_tokens(self, leaves: list, cause: Exception | None = None) -> None:
        for i in self._tokens:
            if leaves[i] is None:
                key, dtype = self.explained_keys[i], self._tokens[i][0].dtype
                raise TypeError(
                    f"LRP: input key {key!r} holds integer tokens ({dtype}), which receive relevance only through "
                    "an nn.Embedding that reads them directly, and no nn.Embedding did; pass in_keys=[...] to "
                    "explain only the floating-point inputs"
                ) from cause

    @staticmethod
    def _is_token_leaf(leaf: torch.Tensor) -> bool:
        return getattr(leaf, "_tdhook_embedding_of", None) is not None

    def _embedding_hook(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
            if not self._tokens or not torch.is_grad_enabled() or not args:
                return None
            for i, (tokens, leaves, fed) in self._tokens.items():
                # The tokens themselves, or a reshaped view of them (GPT-2 flattens its input_ids).
                if args[0] is tokens or (args[0]._base is tokens and args[0].numel() == tokens.numel()):
                    if leaves[i] is not None:
                        raise ValueError(
                            f"LRP: input key {self.explained_keys[i]!r} is embedded twice (again by {name!r}); "
                            "its token relevance would be ambiguous"
                        )
                    leaf = output.detach().requires_grad_(True)
                    leaf._tdhook_embedding_of = name
                    leaves[i], fed[i] = leaf, leaf.clone()
                    return fed[i]
            return None

        return hook

    def _layer_relevance(self, name: str, like: torch.Tensor) -> torch.Tensor:
        cells = self._layer_cells.get(name, [])
        if not cells:
            raise RuntimeError(f"LRP: module {name!r} named in layers did not run in the forward pass")
        values = [cell.pop(like) for cell in cells]
        shapes = {tuple(v.shape) for v in values}
        if len(shapes) > 1:
            raise ValueError(
                f"LRP: module {name!r} named in layers ran {len(values)} times with different output shapes "
                f"{sorted(shapes)}; its relevance cannot be summed into one key"
            )
        # A module called several times gets the relevance of all its outputs, summed.
        return sum(values[1:], values[0])

    def _write(
        self, tensordict: TensorDictBase, result: TensorDictBase, relevances: list, fed: list[torch.Tensor]
    ) -> None:
        explained = set(self.explained_keys)
        updates: dict[Any, Any] = {}
        for key in result.keys(include_nested=True, leaves_only=True):
            value = result.get(key)
            if key in explained and (any(value is f for f in fed) or not value.is_floating_point()):
                continue
            if key in tensordict.keys(include_nested=True) and tensordict.get(key) is value:
                continue
            updates[key] = value.detach() if isinstance(value, torch.Tensor) else value
        for key, rel in zip(self.relevance_keys, relevances, strict=True):
            updates[key] = rel
        if self.token_relevance_keys:
            for key, source, rel in zip(self.token_relevance_keys, self._relevance_sources, relevances, strict=True):
                # Token ids already have one relevance per token; embeddings and layer outputs sum their features.
                per_token = source is not None and not tensordict.get(source).is_floating_point()
                updates[key] = rel if per_token else rel.sum(-1)
        _set_all_or_nothing(tensordict, updates)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {list(value.shape)}"
    return type(value).__name__


def _set_all_or_nothing(tensordict: TensorDictBase, updates: dict) -> None:
    """Write every update, or, if one fails, none: the caller's TensorDict never holds partial results."""
    previous = {key: _get_or_none(tensordict, key) for key in updates}
    branches = {key[:depth] for key in map(_as_tuple, updates) for depth in range(1, len(key))}
    new_branches = sorted((b for b in branches if _get_or_none(tensordict, b) is None), key=len, reverse=True)
    written = []
    try:
        for key, value in updates.items():
            tensordict.set(key, value)
            written.append(key)
    except BaseException:
        for key in reversed(written):
            if previous[key] is None:
                tensordict.del_(key)
            else:
                tensordict.set(key, previous[key])
        for branch in new_branches:  # deepest first; only the ones this call created
            value = _get_or_none(tensordict, branch)
            if isinstance(value, TensorDictBase) and value.is_empty():
                tensordict.del_(branch)
        raise


def _get_or_none(tensordict: TensorDictBase, key: Any) -> Any:
    try:
        return tensordict.get(key, None)
    except (KeyError, ValueError):  # a leaf where the key needs a branch: setting it will fail, before any write
        return None


class OutputRelevance:
    """The relevance ``z * grad(z)`` of one module output, as the backward pass reaches it.

    When the module is a layer merged with the BatchNorm after it, the merged
    output's relevance takes precedence over the layer's own output.
    """

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None
        self.merged = False
        self.shape: torch.Size | None = None

    @classmethod
    def watch(cls, output: torch.Tensor) -> OutputRelevance:
        cell = cls()
        cell.shape = output.shape
        cell._hook(output, merged=False)
        call = layer_call_of(output)
        if call is not None:
            call.observers.append(lambda merged_output: cell._hook(merged_output, merged=True))
        return cell

    def _hook(self, tensor: torch.Tensor, merged: bool) -> None:
        if not tensor.requires_grad:
            return
        value = tensor.detach().clone()  # later in-place operations must not change it

        def record(grad: torch.Tensor) -> None:
            if merged or not self.merged:
                self.value, self.merged = value * grad, merged

        tensor.register_hook(record)

    def total(self) -> torch.Tensor:
        return self.value if self.value is not None else torch.zeros(())

    def pop(self, like: torch.Tensor) -> torch.Tensor:
        """The relevance of the last backward pass (zeros if it never reached the output); then reset."""
        value = self.value if self.value is not None else torch.zeros(self.shape, dtype=like.dtype, device=like.device)
        self.value, self.merged = None, False
        return value
