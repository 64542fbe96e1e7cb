"""Where LRP writes relevance: one key per explained input and inner layer, for every target.

The relevance of input key ``k`` goes to ``(relevance_key, *k)``, that of an
inner layer to ``(relevance_key, *layer_key)``; with several named targets,
the target's name comes right after ``relevance_key``.

Examples:
    >>> import torch
    >>> modules = dict(torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.ReLU()).named_modules())
    >>> layers = layer_keys(["0"], modules, ["observation"])
    >>> layers
    {'0': ('0',)}
    >>> relevance_keys("relevance", [None], ["observation", *layers.values()])
    [('relevance', 'observation'), ('relevance', '0')]
    >>> relevance_keys("relevance", ["actor", "critic"], [("next", "obs")])
    [('relevance', 'actor', 'next', 'obs'), ('relevance', 'critic', 'next', 'obs')]
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase, TensorDictSequential
from tensordict.utils import NestedKey, unravel_key, unravel_key_list
from torch import nn
from torchrl.envs.transforms import Compose
from torchrl.modules import ConsistentDropoutModule

from tdhook.attribution.mappers.aliases import every_named_module

__all__ = [
    "as_tuple",
    "check_free",
    "check_prefix",
    "check_read",
    "check_writable",
    "layer_keys",
    "read_not_written",
    "relevance_keys",
    "unique_keys",
]


def as_tuple(key: NestedKey) -> tuple[str, ...]:
    """``key`` as a tuple of strings.

    Args:
        key: a string or a (possibly nested) tuple of strings.

    Returns:
        The flat tuple, one element for a string key.

    Examples:
        >>> as_tuple("a"), as_tuple(("a", ("b", "c")))
        (('a',), ('a', 'b', 'c'))
    """
    key = unravel_key(key)
    return key if isinstance(key, tuple) else (key,)


def is_key(key: object) -> bool:
    """Whether ``key`` is a TensorDict key: a str, or a non-empty tuple of keys (tensordict's own check drops a
    number inside a tuple, reading ``("x", 0)`` as ``"x"``).

    Examples:
        >>> is_key("x"), is_key(("next", ("x",))), is_key(("x", 0)), is_key(["x"])
        (True, True, False, False)
    """
    return isinstance(key, str) or (isinstance(key, tuple) and bool(key) and all(map(is_key, key)))


def unique_keys(keys: Sequence[NestedKey]) -> list[NestedKey]:
    """``keys`` unravelled, each once, in the order of their first appearance: a key named twice (``"obs"`` and
    ``("obs",)``) is explained once.

    Examples:
        >>> unique_keys(["obs", ("obs",), ("agent", ("x",)), ("agent", "x")])
        ['obs', ('agent', 'x')]
    """
    return list(dict.fromkeys(unravel_key_list(list(keys))))


def layer_keys(
    layers: Sequence[str] | Mapping[str, NestedKey] | None,
    modules: Mapping[str, nn.Module],
    explained_keys: Sequence[NestedKey],
) -> dict[str, tuple[str, ...]]:
    """The key, below the relevance prefix, of each inner layer whose relevance is written.

    Args:
        layers: see :class:`~tdhook.attribution.LRP`: module names, a dict
            ``name -> key``, or ``None`` for none.
        modules: the wrapped model's modules by name (the model itself at ``""``); a module the model holds
            under several names is found under any of them.
        explained_keys: the explained input keys, whose relevance keys the
            layers' must not take.

    Returns:
        ``module name -> key`` as a tuple, in the order of ``layers``.

    Raises:
        TypeError: ``layers`` is a string.
        KeyError: a name in ``layers`` is not one of ``modules``.
        ValueError: a layer's key is an explained input's or another layer's, or holds one or lies inside one.

    Examples:
        >>> import torch
        >>> modules = dict(torch.nn.Sequential(torch.nn.Linear(4, 2)).named_modules())
        >>> layer_keys({"0": ("hidden", "first")}, modules, ["x"])
        {'0': ('hidden', 'first')}
        >>> layer_keys({"0": "x"}, modules, ["x"])
        Traceback (most recent call last):
        ...
        ValueError: LRP: layers asks for the relevance of module '0' at ('x',), the key ('x',) that input 'x' takes; \
give each layer a key of its own
    """
    if layers is None:
        return {}
    if isinstance(layers, str):
        raise TypeError(f"LRP: layers must be a list or dict of module names, got the string {layers!r}")
    named = layers if isinstance(layers, Mapping) else {name: name for name in layers}
    modules = every_named_module(modules[""]) if "" in modules else modules
    keys = {}
    for name, key in named.items():
        if name not in modules:
            known = [n for n in modules if n]
            raise KeyError(f"LRP: layers names {name!r}, which is not a module of the model (modules: {known})")
        keys[name] = as_tuple(key)
    # Each relevance goes to a key of its own: one at another's key, or inside it, would overwrite it or be lost.
    taken = {as_tuple(k): f"input {k!r}" for k in explained_keys}
    for name, key in keys.items():
        for other, owner in taken.items():
            if key[: len(other)] == other or other[: len(key)] == key:
                where = "the key" if key == other else "inside or around the key"
                raise ValueError(
                    f"LRP: layers asks for the relevance of module {name!r} at {key!r}, {where} {other!r} that "
                    f"{owner} takes; give each layer a key of its own"
                )
        taken[key] = f"module {name!r}"
    return keys


def check_prefix(relevance_key: object, owner: str) -> None:
    """Refuse a ``relevance_key`` that is not one key name: the relevance keys are ``(relevance_key, *key)``.

    Raises:
        TypeError: ``relevance_key`` is neither a string nor a tuple of one (a nested prefix such as
            ``("explanations", "lrp")``, or a number).

    Examples:
        >>> check_prefix("relevance", "LRP"), check_prefix(("relevance",), "LRP")
        (None, None)
        >>> check_prefix(("explanations", "lrp"), "LRP")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: LRP: relevance_key must be one key name (a str), ... got ('explanations', 'lrp')
    """
    name = relevance_key[0] if isinstance(relevance_key, tuple) and len(relevance_key) == 1 else relevance_key
    if not isinstance(name, str):
        raise TypeError(
            f"{owner}: relevance_key must be one key name (a str), the prefix of the keys (relevance_key, "
            f"*in_key); got {relevance_key!r}"
        )


def relevance_keys(
    relevance_key: str, target_names: Iterable[str | None], keys: Sequence[NestedKey], owner: str = "LRP"
) -> list[tuple[str, ...]]:
    """The relevance key of each of ``keys``, target by target.

    Args:
        relevance_key: the prefix of the relevance keys.
        target_names: the names of the explained targets; ``None`` for a
            single unnamed one.
        keys: the explained input keys, then the inner layers' keys.
        owner: the wrapper, named in the error of a bad ``relevance_key``.

    Returns:
        ``(relevance_key, name, *key)`` (without ``name`` for ``None``) for
        every name, then every key.

    Raises:
        TypeError: ``relevance_key`` is not one key name (see :func:`check_prefix`).
    """
    check_prefix(relevance_key, owner)
    name = relevance_key[0] if isinstance(relevance_key, tuple) else relevance_key  # ``("rel",)`` is ``"rel"``
    return [
        (name, *prefix, *as_tuple(k))
        for target in target_names
        for prefix in [(target,) if target is not None else ()]
        for k in keys
    ]


def check_free(module: TensorDictModuleBase, keys: Sequence[tuple[str, ...]], argument: str = "relevance_key") -> None:
    """Refuse relevance keys that would overwrite, or be written inside, a key the model reads or writes.

    Args:
        module: the wrapped module.
        keys: the relevance keys (or the token relevance keys) of the wrapper.
        argument: the argument that names them, for the message.

    Raises:
        ValueError: a relevance key equals a key of the model or one holds the other (``relevance_key="x"``
            with an input ``"x"`` would write ``("x", "x")`` inside the input).

    Examples:
        >>> from tensordict.nn import TensorDictModule
        >>> policy = TensorDictModule(nn.Linear(3, 2), in_keys=["obs"], out_keys=["action_value"])
        >>> check_free(policy, [("relevance", "obs")])
        >>> check_free(policy, [("action_value", "obs")])
        Traceback (most recent call last):
        ...
        ValueError: LRP: the relevance key ('action_value', 'obs') would be written inside the model's key \
'action_value'; pass another relevance_key
    """
    for model_key in unravel_key_list([*module.in_keys, *module.out_keys]):
        ours = as_tuple(model_key)
        for key in keys:
            if key[: len(ours)] == ours or ours[: len(key)] == key:
                verb = "overwrite" if len(ours) >= len(key) else "be written inside"
                raise ValueError(
                    f"LRP: the relevance key {key!r} would {verb} the model's key {model_key!r}; pass another "
                    f"{argument}"
                )


def check_writable(tensordict: TensorDictBase, *keys: Sequence[tuple[str, ...]]) -> None:
    """Refuse a call whose relevance keys run through a leaf of the caller's TensorDict (a tensor at
    ``"relevance"``): they need a sub-TensorDict there; or a call on a locked TensorDict (``lock_()``,
    ``memmap_()``), which takes no new key. Found before the model runs.

    Args:
        tensordict: the caller's TensorDict.
        keys: the relevance keys, in one or more lists.

    Raises:
        KeyError: a leaf sits where a relevance key needs a sub-TensorDict.
        RuntimeError: the TensorDict is locked.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> check_writable(TensorDict(x=torch.ones(2), batch_size=[2]), [("relevance", "x")])
        >>> check_writable(TensorDict(x=torch.ones(2), relevance=torch.ones(2), batch_size=[2]), [("relevance", "x")])
        Traceback (most recent call last):
        ...
        KeyError: "LRP: the TensorDict holds a Tensor at 'relevance', where the relevance key ('relevance', 'x') \
needs a sub-TensorDict; remove it or pass relevance_key= another prefix"
        >>> locked = TensorDict(x=torch.ones(2), batch_size=[2]).lock_()
        >>> check_writable(locked, [("relevance", "x")])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        RuntimeError: LRP: the TensorDict is locked (lock_(), memmap_(), share_memory_() and consolidate() lock it), ...
    """
    if tensordict.is_locked:
        wanted = [key for group in keys for key in group]
        raise RuntimeError(
            "LRP: the TensorDict is locked (lock_(), memmap_(), share_memory_() and consolidate() lock it), so the "
            f"relevance keys {wanted} and the module's outputs cannot be written into it; pass an unlocked one: "
            "td.unlock_() (new entries are then neither memory-mapped nor shared) or td.clone()"
        )
    seen = set()
    present = tensordict.keys()
    for key in (key for group in keys for key in group):
        if key[0] not in present:
            continue  # the common case, checked cheaply: the write creates the whole path
        for depth in range(1, len(key)):
            prefix = key[:depth]
            if prefix in seen:
                continue
            seen.add(prefix)
            value = tensordict.get(prefix, None)
            if value is None:
                break  # absent: the write creates the rest of the path
            if not isinstance(value, TensorDictBase):
                shown = prefix[0] if depth == 1 else prefix
                raise KeyError(
                    f"LRP: the TensorDict holds a {type(value).__name__} at {shown!r}, where the relevance key "
                    f"{key!r} needs a sub-TensorDict; remove it or pass relevance_key= another prefix"
                )


def read_not_written(module: TensorDictModuleBase) -> list[NestedKey]:
    """The input keys of ``module`` that it does not fill itself: the inputs explained by default.

    The mask of a torchrl ``ConsistentDropoutModule`` is left out: it steers the call (the module draws one where
    the TensorDict has none), it is no evidence, and explaining it would count the dropped signal twice.

    A key whose entries the module writes (a ``ProbabilisticActor`` with ``return_composite`` reads ``"params"``,
    which its network fills with ``("params", "cat", "logits")``, ...) is computed, not given. A key the module
    reads and then writes anew under the same name is given: the caller's value is what the module reads (torchrl's
    ``DecisionTransformerInferenceWrapper`` reads a context of observations, actions and returns-to-go and writes
    back the last step's; a decision transformer's actor reads the past actions and writes the next one).

    Examples:
        >>> from tensordict.nn import TensorDictModule, TensorDictSequential
        >>> net = TensorDictSequential(
        ...     TensorDictModule(nn.Linear(3, 2), in_keys=["obs"], out_keys=[("params", "loc")]),
        ...     TensorDictModule(nn.Identity(), in_keys=["params"], out_keys=["action"]),
        ... )
        >>> read_not_written(net)
        ['obs']
        >>> normalise = TensorDictModule(lambda obs: obs / 2, in_keys=["obs"], out_keys=["obs"])  # in place
        >>> read_not_written(normalise)
        ['obs']

    A torchrl ``Compose`` of transforms (an environment's ``env.transform``) declares no keys of its own: its
    transforms' are read, in their order, as a sequence's are.

        >>> from torchrl.envs.transforms import CatTensors, Compose
        >>> joined = Compose(CatTensors(["obs", "velocity"], out_key="vector"))
        >>> read_not_written(TensorDictSequential(joined, TensorDictModule(nn.Linear(5, 2), ["vector"], ["out"])))
        ['obs', 'velocity']
    """
    in_keys, out_keys = _keys_through_compose(module)
    written = [as_tuple(key) for key in out_keys]
    masks = {unravel_key(sub.in_keys[1]) for sub in module.modules() if isinstance(sub, ConsistentDropoutModule)}
    return [
        key
        for key in unravel_key_list(list(in_keys))
        if not any(len(out) > len(as_tuple(key)) and out[: len(as_tuple(key))] == as_tuple(key) for out in written)
        and key not in masks
    ]


def check_read(
    name: str,
    given: Sequence[NestedKey],
    keys: Sequence[NestedKey],
    fields: bool = False,
    module: nn.Module | None = None,
) -> None:
    """Refuse an explained input key that is not among ``given``, the keys the module reads without filling them
    itself (see :func:`read_not_written`): a key it writes in the call (an intermediate key of a sequence), or one it
    does not read, would get a relevance of zero whatever the model does. ``name`` names the wrapper in the message;
    with ``fields``, a key inside a given one is accepted (a field of a tensorclass the module reads whole). Given
    the ``module``, the message names its steps that declare no in_keys (a ``WrapModule`` of a function), which may
    read the key unseen.

    Examples:
        >>> check_read("LRP", ["obs"], ["obs"])
        >>> check_read("LRP", ["obs"], [("obs", "position")], fields=True)
        >>> check_read("LRP", ["obs"], ["obs", "hidden"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: LRP: input key 'hidden' is not an input of the module (it reads ['obs'], ...); leave it ...
    """
    for key in keys:
        inside = fields and any(as_tuple(key)[: len(as_tuple(read))] == as_tuple(read) for read in given)
        if key not in given and not inside:
            raise ValueError(
                f"{name}: input key {key!r} is not an input of the module (it reads {list(given)}, besides the keys "
                f"it fills itself); leave it out of in_keys{_undeclared_steps(module)}"
            )


def _undeclared_steps(module: nn.Module | None) -> str:
    """The end of the message for a key the module does not read: its steps (or itself) that declare no in_keys,
    if any; a sequence's own keys are its steps'."""
    steps = [
        f"{step_name!r} ({type(step).__name__})" if step_name else f"the module itself ({type(step).__name__})"
        for step_name, step in ([] if module is None else module.named_modules())
        if isinstance(step, TensorDictModuleBase)
        and not isinstance(step, TensorDictSequential)
        and not list(getattr(step, "in_keys", None) or [])
    ]
    if not steps:
        return ""
    return (
        f", or, if a step reads it without saying so, declare what it reads: {', '.join(steps)} "
        f"declare{'' if len(steps) > 1 else 's'} no in_keys (WrapModule(fn, in_keys=[...], out_keys=[...]))"
    )


def _keys_through_compose(module: nn.Module) -> tuple[list[NestedKey], list[NestedKey]]:
    """``module``'s in_keys and out_keys, with those of the transforms of every torchrl ``Compose`` in a
    ``TensorDictSequential`` (or itself) in place of the Compose's own (none): the keys read before any step
    writes them, and the keys written."""
    if not any(isinstance(sub, Compose) for sub in module.modules()):
        return list(module.in_keys), list(module.out_keys)
    if isinstance(module, Compose):
        steps = list(module.transforms)
    elif isinstance(module, TensorDictSequential):
        steps = list(module.module)
    else:
        return list(module.in_keys), list(module.out_keys)
    read: list[NestedKey] = []
    written: list[NestedKey] = []
    for step in steps:
        step_in, step_out = _keys_through_compose(step)
        read += [key for key in unravel_key_list(step_in) if key not in written and key not in read]
        written += [key for key in unravel_key_list(step_out) if key not in written]
    return read, written
