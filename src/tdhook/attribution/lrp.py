"""The LRP wrapper: a ``TensorDictModule`` that writes relevance next to the outputs."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule, TensorDictModuleBase, TensorDictSequential, dispatch
from tensordict.utils import NestedKey, unravel_key, unravel_key_list
from torch import nn

from tdhook.attribution.lrp_helpers.rules import BaseRuleMapper, RemovableRuleHandle, Rule, RuleMapper
from tdhook.attribution.lrp_helpers.targets import Target, initial_gradient

__all__ = ["LRP"]

RelevanceCheck = Callable[[str, nn.Module, torch.Tensor, torch.Tensor], None]


def _as_tuple(key: NestedKey) -> tuple[str, ...]:
    key = unravel_key(key)
    return key if isinstance(key, tuple) else (key,)


def _leaf_modules(module: TensorDictModuleBase) -> list[TensorDictModuleBase]:
    if isinstance(module, TensorDictSequential):
        return [leaf for sub in module.module for leaf in _leaf_modules(sub)]
    return [module]


def _default_target_candidates(module: TensorDictModuleBase) -> list[NestedKey]:
    """Out keys in pipeline order that no module of the pipeline reads."""
    leaves = _leaf_modules(module)
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
            by default LRP-0 on Linear and convolution layers. Names are
            those of ``module.named_modules()``.
        in_keys: for a plain module, its input keys; for a TensorDict module,
            the input keys to explain (all of its in_keys by default).
        out_keys: the output keys of a plain module.
        target_key: the output to explain. Defaults to the first out key that
            no module of the pipeline reads (for ``QValueActor``,
            ``"chosen_action_value"``).
        target: the initial relevance: ``None`` (the output at the argmax of
            its last dimension, or the output itself for a one-element last
            dimension), an int, a LongTensor of per-sample indices, a callable
            ``output -> relevance``, or ``"all"`` (every output unit, stacked
            in a dimension right after the batch dimensions).
        relevance_key: the prefix of the relevance keys.
        relevance_check: optional ``(name, module, relevance_in, relevance_out)``
            callable run on every module with a rule, for example
            :func:`~tdhook.attribution.lrp_helpers.rules.raise_for_unconserved_rel_factory`.

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
        target_key: NestedKey | None = None,
        target: Target = None,
        relevance_key: str = "relevance",
        relevance_check: RelevanceCheck | None = None,
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
        elif out_keys is not None:
            raise TypeError("out_keys is only for a plain nn.Module: a TensorDict module declares its own")
        self.module = module
        if rule_mapper is None or isinstance(rule_mapper, Mapping):
            rule_mapper = BaseRuleMapper(rule_mapper=rule_mapper)
        self.rule_mapper = rule_mapper
        self.explained_keys = unravel_key_list(list(in_keys if in_keys is not None else module.in_keys))
        self.target_key = unravel_key(target_key) if target_key is not None else None
        self.target = target
        self.relevance_key = relevance_key
        self.relevance_check = relevance_check
        self.relevance_keys = [(relevance_key, *_as_tuple(k)) for k in self.explained_keys]
        self.in_keys = unravel_key_list(list(dict.fromkeys([*module.in_keys, *self.explained_keys])))
        self.out_keys = [*unravel_key_list(module.out_keys), *self.relevance_keys]
        self._handles: list[RemovableRuleHandle] | None = None
        self._check_hooks: list = []

    # ------------------------------------------------------------------ context

    def _rules(self) -> dict[str, Rule]:
        mapper = self.rule_mapper
        if hasattr(mapper, "rules"):
            return mapper.rules(self.module)
        rules = {}
        for name, sub in self.module.named_modules():
            rule = mapper(name, sub)
            if rule is not None:
                rules[name] = rule
        return rules

    def __enter__(self) -> LRP:
        if self._handles is not None:
            raise RuntimeError("this LRP wrapper's context is already active; leave it before entering again")
        modules = dict(self.module.named_modules())
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
                self._add_check_hooks(handles)
        except BaseException:
            self._remove(handles)
            raise
        self._handles = handles
        return self

    def __exit__(self, *exc_info: object) -> None:
        handles, self._handles = self._handles or [], None
        self._remove(handles)

    def _remove(self, handles: list[RemovableRuleHandle]) -> None:
        for hook in self._check_hooks:
            hook.remove()
        self._check_hooks = []
        for handle in reversed(handles):
            handle.remove()

    def _add_check_hooks(self, handles: list[RemovableRuleHandle]) -> None:
        names = {id(m): n for n, m in self.module.named_modules()}
        check = self.relevance_check

        def records_for(x: torch.Tensor) -> torch.Tensor | int:
            registrations = [h.rule._registrations.get(h.module, _NO_RECORDS) for h in handles]
            return sum(r for reg in registrations for t, r in reg.records if t is x)

        for handle in handles:
            module = handle.module
            if getattr(module, "inplace", False) or handle.rule.__class__.register is not Rule.register:
                continue
            name = names[id(module)]

            def forward_hook(mod, args, output, name=name):
                if not (torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad):
                    return
                if len(args) != 1 or not isinstance(args[0], torch.Tensor) or not args[0].requires_grad:
                    return
                x, seen = args[0], {}
                output.register_hook(lambda g: seen.__setitem__("out", output.detach() * g))
                x.register_hook(
                    lambda g: check(name, mod, x.detach() * g + records_for(x), seen.get("out", torch.zeros(())))
                )

            self._check_hooks.append(module.register_forward_hook(forward_hook))

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
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                dtype = getattr(value, "dtype", type(value).__name__)
                raise TypeError(
                    f"LRP: input key {key!r} must be a floating-point tensor to receive relevance, got {dtype}; "
                    "pass in_keys=[...] to explain only the floating-point inputs"
                )

    def _target_key(self, result: TensorDictBase) -> NestedKey:
        if self.target_key is not None:
            if self.target_key not in result.keys(include_nested=True):
                raise KeyError(f"LRP: target key {self.target_key!r} was not written by the wrapped module")
            return self.target_key
        candidates = _default_target_candidates(self.module)
        for key in candidates:
            value = result.get(key, None)
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                return key
        raise KeyError(f"LRP: none of the module's outputs {candidates} is a floating-point tensor; pass target_key")

    def _explain(self, tensordict: TensorDictBase) -> TensorDictBase:
        self._validate_inputs(tensordict)
        work = tensordict.copy()
        leaves, fed = [], []
        try:
            with torch.enable_grad():
                for key in self.explained_keys:
                    leaf = work.get(key).detach().requires_grad_(True)
                    # The model sees a copy: in-place operations on it are legal and never reach the caller's data.
                    fed.append(leaf.clone())
                    work.set(key, fed[-1])
                    leaves.append(leaf)
                result = self.module(work)
                result = work if result is None else result
                target_key = self._target_key(result)
                output = result.get(target_key)
                if not output.requires_grad:
                    raise ValueError(
                        f"LRP: target {target_key!r} does not depend on the explained inputs {self.explained_keys}"
                    )
                grad_outputs = initial_gradient(output, self.target, target_key, tensordict.batch_dims)
                relevances = self._backward(output, grad_outputs, leaves, fed)
        finally:
            for handle in self._handles or []:
                handle.pop_records()
        self._write(tensordict, result, relevances, fed)
        return tensordict

    def _backward(
        self, output: torch.Tensor, grad_outputs: torch.Tensor, leaves: list[torch.Tensor], fed: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        batched = grad_outputs.dim() > output.dim()
        if not batched:
            return self._relevance(output, grad_outputs, leaves, fed, retain=False)
        # target="all": one backward per output unit over a single forward pass.
        n_units = grad_outputs.shape[0]
        per_unit = [
            self._relevance(output, grad_outputs[k], leaves, fed, retain=k < n_units - 1) for k in range(n_units)
        ]
        batch_dims = output.dim() - 1
        return [torch.stack([unit[i] for unit in per_unit], dim=batch_dims) for i in range(len(leaves))]

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
        for handle in self._handles or []:
            for x, rest in handle.pop_records():
                for i, model_input in enumerate(fed):
                    if x is model_input:
                        relevances[i] = relevances[i] + rest
        return relevances

    def _write(
        self, tensordict: TensorDictBase, result: TensorDictBase, relevances: list, fed: list[torch.Tensor]
    ) -> None:
        explained = set(self.explained_keys)
        updates: dict[Any, Any] = {}
        for key in result.keys(include_nested=True, leaves_only=True):
            value = result.get(key)
            if key in explained and any(value is f for f in fed):
                continue
            if key in tensordict.keys(include_nested=True) and tensordict.get(key) is value:
                continue
            updates[key] = value.detach() if isinstance(value, torch.Tensor) else value
        for key, rel in zip(self.relevance_keys, relevances, strict=True):
            updates[key] = rel
        for key, value in updates.items():
            tensordict.set(key, value)


class _NoRecords:
    records: list = []


_NO_RECORDS = _NoRecords()
