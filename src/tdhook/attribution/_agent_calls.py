"""Which agent of a multi-agent network runs now, for the relevance of a layer inside the network's template.

A torchrl multi-agent network with per-agent parameters runs its template network once per agent inside an LRP
context (see :mod:`~tdhook.attribution._agents`). A layer of that template named in ``layers`` then has one output
per agent: each agent's relevance is its own, and they are stacked along the network's agent dimension, as the
outputs are, not summed as the calls of a module used twice in one network are.

Examples:
    >>> import torch
    >>> with agent_call(1, 3, 1):
    ...     current_agent()
    AgentCall(index=1, count=3, dim=1)
    >>> current_agent() is None
    True
    >>> calls = [AgentCall(agent, 3, 1) for agent in range(3)]
    >>> stacked_by_agent("net.1", [torch.ones(2, 4) * agent.index for agent in calls], calls).shape
    torch.Size([2, 3, 4])
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from typing import NamedTuple

import torch

__all__ = ["AgentCall", "agent_call", "current_agent", "stacked_by_agent"]


class AgentCall(NamedTuple):
    """One agent's call of the template: the agent's ``index`` among ``count``, stacked at ``dim`` of the output."""

    index: int
    count: int
    dim: int


_CURRENT: ContextVar[AgentCall | None] = ContextVar("tdhook_agent_call", default=None)


@contextlib.contextmanager
def agent_call(index: int, count: int, dim: int) -> Iterator[None]:
    """Mark the calls inside as agent ``index``'s (of ``count``), whose outputs stack at ``dim``."""
    token = _CURRENT.set(AgentCall(index, count, dim))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_agent() -> AgentCall | None:
    """The agent whose call of a template runs now, or ``None`` outside such a call."""
    return _CURRENT.get()


def stacked_by_agent(name: str, values: Sequence[torch.Tensor], agents: Sequence[AgentCall | None]) -> torch.Tensor:
    """The relevance of module ``name``'s outputs ``values``, made in the agents' calls ``agents``: summed per agent
    (a module its template calls twice), stacked along the agents' dimension.

    Raises:
        ValueError: some calls were no agent's, the agents' dimension is counted from the end, or an agent made
            no call.
    """
    if any(agent is None for agent in agents):
        raise ValueError(
            f"LRP: module {name!r} named in layers ran both inside and outside a multi-agent network's agent-by-agent "
            "calls; its relevance cannot be put in one key"
        )
    count, dim = agents[0].count, agents[0].dim
    if dim < 0 or any((agent.count, agent.dim) != (count, dim) for agent in agents):
        raise ValueError(
            f"LRP: module {name!r} named in layers runs once per agent of a multi-agent network whose agents' "
            f"dimension is {dim} (counted from the end): where it lies in this module's output is unknown; name "
            "the network itself in layers"
        )
    per_agent: list[torch.Tensor | None] = [None] * count
    for value, agent in zip(values, agents, strict=True):
        held = per_agent[agent.index]
        per_agent[agent.index] = value if held is None else held + value
    missing = [index for index, value in enumerate(per_agent) if value is None]
    if missing:
        raise ValueError(f"LRP: module {name!r} named in layers did not run for the agents {missing}")
    return torch.stack(per_agent, dim)
