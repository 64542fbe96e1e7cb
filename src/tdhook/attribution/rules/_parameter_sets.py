"""A rule's modified parameter sets, each built at its first read.

The rules that compute with modified parameters (z⁺, αβ, γ, Flat, w², z^B) name several sets (``"up"``,
``"down_nobias"``, ``"shift"``, ...), and a call reads only those its path needs: γ after a ReLU reads the shift
``γ W⁺`` and ``W^γ⁺``, never ``W^γ⁻``; a layer whose following BatchNorm is merged into it reads none of its own
sets, only those built from the merged weights. :class:`ParameterSets` builds each set when it is first read and
keeps it while the context lasts, so a context holds the sets its calls used, not every set of every rule.

The sets are built from the tensors the rule was prepared from. Where those are the layer's own parameters (no
copy), a set built later than the call that needs it would read values written in between; the tensors' version
counters tell, and such a build raises instead of returning sets of other weights than the call ran with. A write
through ``.data`` leaves the counters as they were: where copies of the sources' values are given
(:meth:`ParameterSets.hold`, the copies a rule keeps to see such writes between calls), they tell.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from typing import Any

import torch

__all__ = ["ParameterSets"]


class ParameterSets(MutableMapping):
    """Parameter sets by name, each built by its builder at its first read and kept; ``in`` builds nothing.

    Args:
        builders: ``name -> builder``; a builder takes the mapping itself (to read the sets it derives from).
        sources: the tensors the builders read; building after one of them was written in place (its version
            counter moved) raises a ``RuntimeError`` that starts with ``owner``.
        owner: who the sets belong to, named in that error (the rule and the layer).

    Examples:
        >>> w = torch.tensor([[-1.0, 2.0]])
        >>> sets = ParameterSets({"pos": lambda s: {"weight": w.clamp(min=0)}}, sources=[w], owner="z+ on Linear")
        >>> "pos" in sets, sets.built()
        (True, [])
        >>> sets["pos"]["weight"], sets.built()
        (tensor([[0., 2.]]), ['pos'])
        >>> sets = ParameterSets({"pos": lambda s: {"weight": w.clamp(min=0)}}, sources=[w], owner="z+ on Linear")
        >>> _ = w.mul_(2)
        >>> sets["pos"]  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        RuntimeError: z+ on Linear: the layer's parameters were written in place after the layer ran ...
    """

    __slots__ = ("_builders", "_built", "_sources", "_held", "owner")

    def __init__(
        self,
        builders: Mapping[str, Callable[[ParameterSets], Any]],
        sources: Iterable[torch.Tensor] = (),
        owner: str = "",
    ) -> None:
        self._builders = dict(builders)
        self._built: dict[str, Any] = {}
        self._sources = [(t, t._version) for t in sources]
        self._held: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.owner = owner

    def __getitem__(self, name: str) -> Any:
        built = self._built
        if name in built:
            return built[name]
        builder = self._builders[name]  # KeyError for a name it has no builder for
        if any(t._version != version for t, version in self._sources) or not all(
            _same_values(t, copy) for t, copy in self._held
        ):
            raise RuntimeError(
                f"{self.owner}: the layer's parameters were written in place after the layer ran and before "
                "its relevance was computed; write them outside the call, or out of place"
            )
        value = built[name] = builder(self)
        return value

    def __setitem__(self, name: str, value: Any) -> None:
        self._built[name] = value

    def __delitem__(self, name: str) -> None:
        found = self._builders.pop(name, None) is not None
        if self._built.pop(name, None) is None and not found:
            raise KeyError(name)

    def __contains__(self, name: object) -> bool:
        return name in self._built or name in self._builders

    def __iter__(self) -> Iterator[str]:
        yield from self._builders
        yield from (name for name in self._built if name not in self._builders)

    def __len__(self) -> int:
        return len(self._builders) + sum(name not in self._builders for name in self._built)

    def sources(self) -> list[torch.Tensor]:
        """The tensors the builders read."""
        return [t for t, _ in self._sources]

    def hold(self, copies: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """``(source, copy)`` pairs: building while a source's values differ from its copy's (a write through
        ``.data``, which no version counter sees) raises as an in-place write does.

        Examples:
            >>> w = torch.tensor([1.0, -2.0])
            >>> sets = ParameterSets({"pos": lambda s: w.clamp(min=0)}, sources=[w], owner="z+ on Linear")
            >>> sets.hold([(w, w.clone())])
            >>> _ = w.data.mul_(2)
            >>> sets["pos"]  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            RuntimeError: z+ on Linear: the layer's parameters were written in place after the layer ran ...
        """
        self._held = list(copies)

    def define(self, name: str, builder: Callable[[ParameterSets], Any]) -> None:
        """Build the set ``name`` with ``builder`` at its first read."""
        self._builders[name] = builder
        self._built.pop(name, None)

    def built(self) -> list[str]:
        """The names of the sets built so far, in the order they were."""
        return list(self._built)

    def converted(self, convert: Callable[[torch.Tensor], torch.Tensor], skip: Iterable[str] = ()) -> ParameterSets:
        """The sets with every tensor converted by ``convert``, each set at its first read (from this one's); a
        tensor that several sets share is converted once, and the copies share it too. Names in ``skip`` are left
        out.

        Examples:
            >>> w = torch.ones(2, dtype=torch.float16)
            >>> sets = ParameterSets({"up": lambda s: {"weight": w}, "up_nobias": lambda s: {"weight": w}})
            >>> wide = sets.converted(lambda t: t.float())
            >>> wide["up"]["weight"].dtype, wide["up"]["weight"] is wide["up_nobias"]["weight"]
            (torch.float32, True)
        """
        done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def one(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            kept = done.get(id(value))
            if kept is None or kept[0] is not value:
                kept = done[id(value)] = (value, convert(value))  # the original kept: its id is not reused
            return kept[1]

        def builder(name: str) -> Callable[[ParameterSets], Any]:
            def build(_: ParameterSets) -> Any:
                entry = self[name]
                return {key: one(value) for key, value in entry.items()} if isinstance(entry, dict) else one(entry)

            return build

        skipped = set(skip)
        return ParameterSets({name: builder(name) for name in self if name not in skipped})


def _same_values(live: torch.Tensor, copy: torch.Tensor) -> bool:
    """Bit for bit, NaN equal to NaN."""
    if live.shape != copy.shape:
        return False
    if torch.equal(live, copy):
        return True
    return live.is_floating_point() and bool(((live == copy) | (live.isnan() & copy.isnan())).all())
