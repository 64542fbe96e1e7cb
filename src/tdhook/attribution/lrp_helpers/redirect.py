"""Moved: the gradient redirection lives in :mod:`tdhook.attribution.rules._autograd` (``redirect`` and
``relevance_proxy`` are public in :mod:`tdhook.attribution.rules`); this path re-exports it."""

from tdhook.attribution.rules._autograd import backward_keeps_graph, is_batched_gradient, redirect, relevance_proxy

__all__ = ["redirect", "relevance_proxy", "backward_keeps_graph", "is_batched_gradient"]
