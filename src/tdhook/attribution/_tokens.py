"""Integer token inputs: the ``nn.Embedding`` output that stands in for token ids in the relevance backward pass.

Token ids have no gradient, so the output of the ``nn.Embedding`` that reads
them becomes the tensor the relevance is taken for, and each token's
relevance is that of its embedding vector, summed over the features.

Examples:
    >>> import torch
    >>> embedding = torch.nn.Embedding(10, 4)
    >>> tokens = TokenInputs(["input_ids"])
    >>> hook = embedding.register_forward_hook(tokens.embedding_hook("embedding"), prepend=True)
    >>> leaves, fed = [], []
    >>> with torch.enable_grad():
    ...     ids = tokens.feed(0, torch.tensor([[1, 2, 3]]), leaves, fed)
    ...     out = embedding(ids)
    >>> tokens.raise_for_unembedded(leaves)
    >>> leaves[0].shape, is_embedding_leaf(leaves[0]), out is fed[0]
    (torch.Size([1, 3, 4]), True, True)
    >>> tokens.per_token(0, torch.ones(1, 3, 4))
    tensor([[4., 4., 4.]])
    >>> tokens.clear()
    >>> hook.remove()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from tensordict.utils import NestedKey
from torch import nn

__all__ = ["TokenInputs", "is_embedding_leaf"]


def is_embedding_leaf(leaf: torch.Tensor | None) -> bool:
    """Whether ``leaf`` is an embedding output standing in for token ids.

    Args:
        leaf: a tensor the relevance is taken for.

    Returns:
        ``True`` for the leaf made by :meth:`TokenInputs.embedding_hook`.
    """
    return getattr(leaf, "_tdhook_embedding_of", None) is not None


class TokenInputs:
    """The integer token inputs of one call, and the embeddings that stand in for them.

    One per LRP wrapper: :meth:`feed` takes the tokens of an explained input,
    the hooks from :meth:`embedding_hook` replace them by their embedding, and
    :meth:`clear` ends the call.

    Args:
        keys: the explained input keys, for error messages.
    """

    def __init__(self, keys: Sequence[NestedKey]) -> None:
        self.keys = keys
        self._ids: dict[int, torch.Tensor] = {}
        self._leaves: list[torch.Tensor | None] = []
        self._fed: list[torch.Tensor | None] = []

    @property
    def feeding(self) -> bool:
        """Whether the current call feeds token ids to an embedding."""
        return bool(self._ids)

    def clear(self) -> None:
        """Forget the tokens of the last call."""
        self._ids = {}
        self._leaves, self._fed = [], []

    def feed(
        self,
        index: int,
        ids: torch.Tensor,
        leaves: list[torch.Tensor | None],
        fed: list[torch.Tensor | None],
    ) -> torch.Tensor:
        """Take the token ids of explained input ``index``.

        Args:
            index: the input's position among the explained keys.
            ids: its integer tensor.
            leaves: the tensors the relevance is taken for, one per explained
                input; gets ``None`` until the embedding replaces it.
            fed: the tensors given to the model in their place; likewise.

        Returns:
            A copy of ``ids`` to give the model: an ``nn.Embedding`` that
            reads it is recognised by this object.
        """
        self._ids[index] = ids.clone()
        self._leaves, self._fed = leaves, fed
        leaves.append(None)
        fed.append(None)
        return self._ids[index]

    def embedding_hook(self, name: str) -> Callable[[nn.Module, tuple, torch.Tensor], torch.Tensor | None]:
        """A forward hook for ``nn.Embedding`` ``name`` that takes its output as the tokens' leaf.

        Args:
            name: the embedding's module name, for error messages.

        Returns:
            The hook, for ``register_forward_hook(..., prepend=True)``: when
            the embedding reads fed token ids (or a reshaped view of them),
            it returns a copy of the detached output, whose leaf is recorded.
        """

        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
            if not self._ids or not torch.is_grad_enabled() or not args:
                return None
            leaves, fed = self._leaves, self._fed
            for i, tokens in self._ids.items():
                # The tokens themselves, or a reshaped view of them (GPT-2 flattens its input_ids).
                if args[0] is tokens or (args[0]._base is tokens and args[0].numel() == tokens.numel()):
                    if leaves[i] is not None:
                        raise ValueError(
                            f"LRP: input key {self.keys[i]!r} is embedded twice (again by {name!r}); "
                            "its token relevance would be ambiguous"
                        )
                    leaf = output.detach().requires_grad_(True)
                    leaf._tdhook_embedding_of = name
                    leaves[i], fed[i] = leaf, leaf.clone()
                    return fed[i]
            return None

        return hook

    def raise_for_unembedded(
        self, leaves: list[torch.Tensor | None], cause: Exception | None = None, optional: bool = False
    ) -> None:
        """Raise if the tokens of an input were read by no ``nn.Embedding``.

        Args:
            leaves: the tensors the relevance is taken for.
            cause: the exception the model raised, if any, chained to this one.
            optional: the inputs were taken from the module's ``in_keys``, not named by the caller: after a
                forward pass that succeeded, integers no embedding read (an action mask, a step count) are
                simply not explained (their leaf stays ``None``), unless no input at all is left to explain.

        Raises:
            TypeError: an input's leaf is still ``None``.
        """
        if optional and cause is None and any(leaf is not None for leaf in leaves):
            return
        for i in self._ids:
            if leaves[i] is None:
                key, dtype = self.keys[i], self._ids[i].dtype
                pixels = (
                    " (uint8 pixels: convert them to floating point before the model, for example with torchrl's "
                    "ToTensorImage transform, so that the pixels themselves receive relevance)"
                    if dtype == torch.uint8
                    else ""
                )
                raise TypeError(
                    f"LRP: input key {key!r} holds integer tokens ({dtype}), which receive relevance only through "
                    f"an nn.Embedding that reads them directly, and no nn.Embedding did{pixels}; pass in_keys=[...] "
                    "to explain only the floating-point inputs"
                ) from cause

    def per_token(self, index: int, relevance: torch.Tensor) -> torch.Tensor:
        """The relevance of each token of input ``index``, from that of its embeddings.

        Args:
            index: the input's position among the explained keys.
            relevance: the relevance of the embedding output.

        Returns:
            ``relevance`` summed over its last dimension, shaped like the token ids.
        """
        return relevance.sum(-1).reshape(self._ids[index].shape)
