"""Integer token inputs: the embeddings that stand in for token ids in the relevance backward pass.

Token ids have no gradient, so the output of the ``nn.Embedding`` that reads
them becomes the tensor the relevance is taken for, and each token's
relevance is that of its embedding vector, summed over the features. An
``nn.EmbeddingBag`` reduces its tokens' rows in one call: the rows it gathered
stand in for its tokens, and its output is computed again from them.

Examples:
    >>> import torch
    >>> embedding = torch.nn.Embedding(10, 4)
    >>> tokens = TokenInputs(["input_ids"])
    >>> hook = embedding.register_forward_hook(tokens.embedding_hook("embedding"), prepend=True, with_kwargs=True)
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

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from tensordict.utils import NestedKey
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle
from torchrl.envs.transforms import ToTensorImage

from tdhook.attribution._bag_rows import bag_of_rows
from tdhook.attribution._derived_ids import derived_ids_message
from tdhook.attribution._embedding_tables import embedding_weights, embeddings_at_or_under, made_of, own_tables
from tdhook.attribution._fed_ids import RESTACKING, looks_up_ids, mark_restacked, reads_fed_ids, restacks
from tdhook.attribution._offset_ids import offset_reader, rows_elsewhere
from tdhook.attribution._token_values import (
    CODING,
    COMPARISONS,
    COMPUTED,
    PRODUCTS,
    TEMPLATES,
    is_weight_table,
    mark_values,
    marked_operand,
    taken_values,
    weight_met,
)
from tdhook.attribution._unit_rows import (
    RowUse,
    gate_error,
    gated_inputs,
    linear_parameters,
    note_row_uses,
    rows_of_output_units,
    watch_rows,
)
from tdhook.attribution.rules._keeping_graph import graph_kept
from tdhook.attribution.rules._linked_inputs import linked_input

__all__ = ["TokenInputs", "is_embedding_leaf", "rewind"]


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
        self._derived: list[tuple[int, str, str]] = []  # lookups of ids computed from a key: key, module, class
        # Weights indexed by the ids (an embedding's own included), with the embeddings whose forward was running and,
        # where the lookup picked rows of a linear layer's weight or bias, how the forward used them.
        self._tables: list[tuple[int, torch.Tensor, tuple[str, ...], RowUse | None]] = []
        self._linear: frozenset[int] = frozenset()  # the ids of the parameters of the model's nn.Linear layers
        self._embedded: frozenset[int] = frozenset()  # the ids of the embeddings' own weights
        self._inside: list[str] = []  # the embeddings whose forward is running, by name
        self._watched: list[RowUse] = []  # the rows picked from a linear layer's weight whose uses are recorded
        self._modules: Mapping[str, nn.Module] = {}
        self._embeddings_under: dict[str, list[nn.Module]] = {}  # by embedding name, those at or under it

    @property
    def feeding(self) -> bool:
        """Whether the current call feeds token ids to an embedding."""
        return bool(self._ids)

    def clear(self) -> None:
        """Forget the tokens of the last call."""
        self._ids = {}
        self._leaves, self._fed, self._derived, self._tables, self._inside = [], [], [], [], []
        self._watched = []

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

    def register(self, modules: Mapping[str, nn.Module], into: list | None = None) -> list[RemovableHandle]:
        """Hook each ``nn.Embedding`` (:meth:`embedding_hook`) and ``nn.EmbeddingBag`` (:meth:`bag_hook`) of
        ``modules``, so that the tokens they read get the relevance of their embeddings.

        Args:
            modules: the explained model's modules, by name (the names go into error messages).
            into: where each handle goes as soon as its hook is registered (a new list by default), so that a
                registration that fails (an error, an interrupt) leaves none unlisted.

        Returns:
            The hooks' handles: ``into``.
        """
        handles = [] if into is None else into
        self._modules = modules
        self._embeddings_under = {}
        self._linear = linear_parameters(modules)
        self._embedded = embedding_weights(modules)
        for name, module in modules.items():
            if isinstance(module, nn.Embedding):
                handles.append(module.register_forward_hook(self.embedding_hook(name), prepend=True, with_kwargs=True))
            elif isinstance(module, nn.EmbeddingBag):
                handles.append(module.register_forward_hook(self.bag_hook(name), prepend=True, with_kwargs=True))
            else:
                continue
            handles.append(module.register_forward_pre_hook(self._entering(name), prepend=True))
        return handles

    def _reader_of(self, module: nn.Module, args: tuple, output: torch.Tensor, name: str) -> int | None:
        """The explained input whose fed token ids (or a reshaped view of them) ``args[0]`` is, if any; an input
        embedded twice is refused, but for an embedding that reads the ids for their shape only (BART's learned
        positions), which does not embed them."""
        if not self._ids or not torch.is_grad_enabled() or not args or not isinstance(args[0], torch.Tensor):
            return None
        for i, tokens in self._ids.items():
            # Looking at what the embedding read is no call of the model: out of the function modes' sight.
            with torch._C.DisableTorchFunction():
                if not reads_fed_ids(args[0], tokens):
                    continue
                second = self._leaves[i] is not None
                if isinstance(module, nn.Embedding) and not looks_up_ids(module, args[0], output):
                    if second or rows_elsewhere(module, name, i, output, self._tables, self._derived):
                        return None
            if second:
                raise ValueError(
                    f"LRP: input key {self.keys[i]!r} is embedded twice (again by {name!r}); "
                    "its token relevance would be ambiguous"
                )
            return i
        derived = getattr(args[0], _DERIVED, None)
        if derived is not None:
            with torch._C.DisableTorchFunction():
                looks_up = not isinstance(module, nn.Embedding) or looks_up_ids(module, args[0], output)
            if looks_up:  # judged after the call: inside the embedding of the ids themselves, it is theirs
                self._derived.append((derived, name, type(module).__name__))
        return None

    def _raise_for_derived(self) -> None:
        """Refuse a lookup of token ids computed from explained ones (see :meth:`tracking`), but where it is
        part of the embedding that looked up the ids themselves (a module inside it)."""
        for index, name, kind in self._derived:
            leaf = self._leaves[index] if index < len(self._leaves) else None
            outer = getattr(leaf, "_tdhook_embedding_of", None)
            if outer is not None and name.startswith(f"{outer}." if outer else ""):
                continue
            raise ValueError(derived_ids_message(self.keys[index], name, kind, self._ids.get(index)))

    def tracking(self) -> contextlib.AbstractContextManager:
        """A context, for the model's call, that marks the integer tensors computed from the fed token ids by the
        operations that carry token values on (indexing, copies, concatenation, shifts, in-place writes): an
        embedding that looks them up is refused by name, as its relevance could not reach the tokens. It also notes
        each weight the ids index, so that a lookup beside the embedding is refused.

        Every call that feeds token ids is tracked, in a context too: a call whose inputs have the kinds and shapes
        of an earlier one may still look up the ids elsewhere (the model changed between the calls, as an adapter
        switched on with peft's ``disable_adapter()`` left, or it branches on the ids' values).

        Returns:
            The context (a no-op where the call feeds no token ids).

        Examples:
            >>> tokens = TokenInputs(["input_ids"])
            >>> ids = tokens.feed(0, torch.tensor([[5, 6, 7]]), [], [])
            >>> with tokens.tracking():
            ...     shifted = ids.new_zeros(ids.shape)
            ...     shifted[:, 1:] = ids[:, :-1]
            ...     positions = ids.ne(0).cumsum(1)
            >>> getattr(shifted, "_tdhook_tokens_of", None), getattr(positions, "_tdhook_tokens_of", None)
            (0, None)
            >>> tokens.clear()
        """
        if not self._ids:
            return contextlib.nullcontext()
        return _DerivedTokens(self._ids, self._tables, self._inside, self._linear, self._embedded, self._watched)

    def _entering(self, name: str) -> Callable[[nn.Module, tuple], None]:
        """A forward pre-hook for embedding ``name``: its forward runs (its hook, :meth:`_left`, ends it), and a lookup
        of its own table by the ids in the meantime is its own."""

        def pre_hook(module: nn.Module, args: tuple) -> None:
            self._inside.append(name)

        return pre_hook

    def _left(self, name: str) -> None:
        """The forward of embedding ``name`` (its last run) ended."""
        for position in range(len(self._inside) - 1, -1, -1):
            if self._inside[position] == name:
                del self._inside[position]
                return

    def _looked_up_rightly(
        self,
        index: int,
        table: torch.Tensor,
        inside: tuple[str, ...],
        rows: RowUse | None,
        leaves: list[torch.Tensor | None],
    ) -> bool:
        """Whether a lookup of ``table`` by the ids of embedded input ``index`` loses no relevance: the lookup of
        the embedding that embedded the input, inside its forward, or a choice of output units of a linear layer
        (:meth:`_output_units`)."""
        return self._looked_up_by_its_embedding(index, table, inside, leaves) or (
            rows is not None and self._output_units(index, table, leaves)
        )

    def _output_units(self, index: int, table: torch.Tensor, leaves: list[torch.Tensor | None]) -> bool:
        """Whether ``table`` is the weight or the bias of an ``nn.Linear`` of the model, whose rows (looked up by
        the ids) are that layer's output units, each use of them a factor of a signal (see
        :func:`~tdhook.attribution._unit_rows.rows_of_output_units`); not the embedding's own lookup of a weight tied
        to the layer's (a language model's head sharing the embedding's table), which is no use of the layer's rows."""
        if index >= len(leaves) or leaves[index] is None:
            return False
        lookups = [entry for entry in self._tables if not self._looked_up_by_its_embedding(*entry[:3], leaves)]
        return rows_of_output_units(index, table, self._modules, lookups)

    def _looked_up_by_its_embedding(
        self, index: int, table: torch.Tensor, inside: tuple[str, ...], leaves: list[torch.Tensor | None]
    ) -> bool:
        """Whether ``table``, indexed by the ids of input ``index`` while the embeddings ``inside`` ran their forward,
        is the table of the embedding that embedded the input (its weight, a view of it or a tensor computed from it),
        looked up inside that embedding: its own lookup. Another embedding's weight indexed directly
        (``self.other.weight[ids]``), or the embedding's own weight indexed outside it, is a lookup beside it."""
        leaf = leaves[index] if index < len(leaves) else None
        if leaf is None:
            return False
        name = leaf._tdhook_embedding_of
        if name not in inside:
            return False
        if name not in self._embeddings_under:  # once per context: a change of its modules enters it again
            self._embeddings_under[name] = embeddings_at_or_under(self._modules, name)
        own = {id(weight) for module in self._embeddings_under[name] for weight in own_tables(module)}
        return made_of(table, own)

    def embedding_hook(self, name: str) -> Callable[[nn.Module, tuple, dict, torch.Tensor], torch.Tensor | None]:
        """A forward hook for ``nn.Embedding`` ``name`` that takes its output as the tokens' leaf.

        Args:
            name: the embedding's module name, for error messages.

        Returns:
            The hook, for ``register_forward_hook(..., prepend=True, with_kwargs=True)``: when
            the embedding reads fed token ids (or a reshaped view of them),
            it returns a copy of the detached output, whose leaf is recorded.
        """

        def embedded(module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor | None:
            i = self._reader_of(module, _with_input(args, kwargs), output, name)
            if i is None:  # the ids given beside its input, looked up shifted (OPT's positions): theirs too
                given = (*args, *kwargs.values())
                i = offset_reader(module, name, given, output, self._ids, self._tables, self._leaves)
            if i is None:
                return None
            if graph_kept() is not None and output.requires_grad:  # linked to the table's rows
                leaf, fed = linked_input(output)
            else:
                leaf = output.detach().requires_grad_(True)
                fed = leaf.clone()
            leaf._tdhook_embedding_of = name
            self._leaves[i], self._fed[i] = leaf, fed
            return fed

        def hook(module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor | None:
            try:
                return embedded(module, args, kwargs, output)
            finally:
                self._left(name)

        return hook

    def bag_hook(self, name: str) -> Callable[[nn.Module, tuple, dict, torch.Tensor], torch.Tensor | None]:
        """A forward hook for ``nn.EmbeddingBag`` ``name``: the rows it gathered for the tokens become their leaf,
        and its output is computed again from that leaf, so that each token gets the relevance of its own row.

        The bag's sum, mean or max is linear in the rows (piecewise for max): the plain gradient through it is
        LRP-0, and the relevance of the rows sums to that of the bag's output. Per-sample weights are held as
        constants, as gates are: relevance goes to the tokens they weight, not to the weights.

        Args:
            name: the bag's module name, for error messages.

        Returns:
            The hook, for ``register_forward_hook(..., prepend=True, with_kwargs=True)``.
        """

        def bag(module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor | None:
            args = _with_input(args, kwargs)
            i = self._reader_of(module, args, output, name)
            if i is None:
                return None
            ids = args[0]
            offsets = args[1] if len(args) > 1 else kwargs.get("offsets")
            weights = args[2] if len(args) > 2 else kwargs.get("per_sample_weights")
            # Read after the call: with max_norm, the bag has renormalised in place the rows it used.
            if graph_kept() is not None and module.weight.requires_grad:  # linked to the table's rows
                leaf, rows = linked_input(module.weight[ids])
            else:
                leaf = rows = module.weight.detach()[ids].requires_grad_(True)
            leaf._tdhook_embedding_of = name
            self._leaves[i], self._fed[i] = leaf, rows
            return bag_of_rows(module, ids, rows, offsets, None if weights is None else weights.detach())

        def hook(module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor | None:
            try:  # the rows it reads here, from its own weight, are its own lookup
                return bag(module, args, kwargs, output)
            finally:
                self._left(name)

        return hook

    def raise_for_unembedded(
        self, leaves: list[torch.Tensor | None], cause: Exception | None = None, optional: bool = False
    ) -> None:
        """Raise if the tokens of an input were read by no ``nn.Embedding`` or ``nn.EmbeddingBag``.

        Args:
            leaves: the tensors the relevance is taken for.
            cause: the exception the model raised, if any: it is the error to see (it may come before any embedding
                runs), and gets, instead of an error raised here, a note naming the inputs no embedding read.
            optional: the inputs were taken from the module's ``in_keys``, not named by the caller: after a
                forward pass that succeeded, integers no embedding read (an action mask, a step count) are
                simply not explained (their leaf stays ``None``), unless no input at all is left to explain.

        Raises:
            ValueError: token ids computed from an input were looked up outside the embedding of the input itself.
            TypeError: an input's leaf is still ``None`` after a forward pass that succeeded.
        """
        if cause is None:
            self._raise_for_derived()
            if self._tables:  # most calls looked up no weight by the ids: no call for them
                self._raise_for_lookups_beside(leaves)
        if optional and cause is None and any(leaf is not None for leaf in leaves):
            self._raise_for_tables(leaves)
            return
        for i in self._ids:
            if leaves[i] is None:
                key, dtype = self.keys[i], self._ids[i].dtype
                pixels = self._pixels_advice(key) if dtype == torch.uint8 else ""
                message = _unembedded(key, dtype, pixels, " before this error" if cause is not None else "")
                if cause is None:
                    raise TypeError(message)
                cause.add_note(message)

    def _pixels_advice(self, key: NestedKey) -> str:
        """What to do with uint8 pixels at ``key``: convert them before the model; where the model converts them
        itself with torchrl's ``ToTensorImage`` (no gradient reaches integers), apply that transform first."""
        converters = [f"{name!r}" for name, module in self._modules.items() if _converts_pixels_at(module, key)]
        if converters:
            return (
                f" (uint8 pixels, which the model's ToTensorImage {', '.join(converters)} converts to floating point "
                "inside the model, where no gradient reaches the integers: apply that transform to the TensorDict "
                "before the call and explain the rest of the model, so that the pixels it writes receive relevance)"
            )
        return (
            " (uint8 pixels: convert them to floating point before the model, for example with torchrl's "
            "ToTensorImage transform applied to the TensorDict, so that the pixels themselves receive relevance)"
        )

    def _raise_for_lookups_beside(self, leaves: list[torch.Tensor | None]) -> None:
        """Refuse an input embedded by an ``nn.Embedding`` and also looked up in a weight of another kind (peft's LoRA
        on the embedding: ``F.embedding(ids, self.lora_A.T)``), or picking rows of a Linear that gate another input
        (:func:`gated_inputs`): the relevance of that lookup would be lost, its rows held constant."""
        for index, table, inside, rows in self._tables:
            leaf = leaves[index] if index < len(leaves) else None
            if leaf is not None and rows is not None and (others := gated_inputs(rows, index, self._fed)):
                raise gate_error(self.keys[index], self._table_name(table), [self.keys[i] for i in others])
            if leaf is None or self._looked_up_rightly(index, table, inside, rows, leaves):
                continue
            raise ValueError(
                f"LRP: input key {self.keys[index]!r} is embedded by {leaf._tdhook_embedding_of!r} and also indexes "
                f"{self._table_name(table)} (shape {tuple(table.shape)}) outside an nn.Embedding: the relevance of "
                "that lookup would be lost, as its rows are held constant (a low-rank adapter on the embedding adds "
                "such a lookup: merge it into the embedding first, for example with peft's merge_and_unload(), or "
                "explain the embeddings the model computes, as inputs_embeds)"
            )

    def _table_name(self, table: torch.Tensor) -> str:
        """``table`` in words: the parameter it is (or a view or function of), by name where one is found."""
        for module_name, module in self._modules.items():
            for name, value in module.named_parameters(recurse=False):
                if value is table or value is table._base:
                    full = f"{module_name}.{name}" if module_name else name
                    return f"parameter {full!r}" if value is table else f"a view of parameter {full!r}"
        return "a parameter" if isinstance(table, nn.Parameter) else "a tensor computed from parameters"

    def _raise_for_tables(self, leaves: list[torch.Tensor | None]) -> None:
        """Refuse an input left out of the explanation (no embedding read it) whose ids index a parameter directly
        (``self.table[task]``): an embedding lookup in all but name, whose key the wrapper lists among its relevance
        keys and would not write."""
        for lookup in self._tables:
            index, table = lookup[:2]
            if leaves[index] is not None:
                continue
            what, key, dtype = self._table_name(table), self.keys[index], self._ids[index].dtype
            if (refusal := getattr(lookup, "refusal", None)) is not None:  # a product's (ProductLookup), in its words
                raise TypeError(refusal(key, dtype, what))
            raise TypeError(
                f"LRP: input key {key!r} holds integers ({dtype}) that index {what} (shape {tuple(table.shape)}) "
                "directly, outside an nn.Embedding: a lookup whose rows would be held constant, so the key would get "
                f"no relevance and ('relevance', {key!r}) would not be written; hold the table in an nn.Embedding (or "
                "nn.EmbeddingBag) for the key to receive relevance, or pass in_keys without it to explain the other "
                "inputs with its rows held constant"
            )

    def per_token(self, index: int, relevance: torch.Tensor) -> torch.Tensor:
        """The relevance of each token of input ``index``, from that of its embeddings.

        Args:
            index: the input's position among the explained keys.
            relevance: the relevance of the embedding output.

        Returns:
            ``relevance`` summed over its last dimension, shaped like the token ids.
        """
        return relevance.sum(-1).reshape(self._ids[index].shape)


_DERIVED = "_tdhook_tokens_of"
# Operations whose integer output holds token values of an integer input (not positions or counts computed from
# them, as RoBERTa's positions are: ``ne``, ``cumsum`` and products are not among them); ``__get__``: a property.
_CARRYING = frozenset(
    {
        "__getitem__", "clone", "contiguous", "detach", "to", "long", "int", "cat", "concat", "concatenate",
        "stack", "hstack", "vstack", "roll", "flip", "narrow", "select", "index_select", "gather", "take",
        "masked_fill", "where", "repeat", "repeat_interleave", "expand", "tile", "unsqueeze", "squeeze",
        "transpose", "permute", "t", "flatten", "unflatten", "view", "reshape", "split", "chunk", "unbind",
        "tensor_split", "movedim", "pad", "pad_sequence", "cpu", "cuda", "__get__",
    }
)  # fmt: skip
# Lookups of rows of a table by integer ids: the position of the table among the arguments.
_LOOKUPS = {"__getitem__": 0, "index_select": 0, "take": 0, "gather": 0, "embedding": 1, "embedding_bag": 1}
# In-place writes of token values into their first argument (``out[:, 1:] = ids[:, :-1]``, ``out.copy_(ids)``): the
# position of the values written among the arguments (an index is no value).
_WRITING = {"__setitem__": 2, "copy_": 1, "index_copy_": 3, "scatter_": 3, "masked_scatter_": 2}


class _DerivedTokens(TorchFunctionMode):
    """Marks the integer tensors that carry the values of fed token ids (see :meth:`TokenInputs.tracking`)."""

    def __init__(
        self,
        ids: Mapping[int, torch.Tensor],
        tables: list[tuple[int, torch.Tensor, tuple[str, ...], RowUse | None]],
        inside: list[str] | None = None,
        linear: frozenset[int] = frozenset(),
        embedded: frozenset[int] = frozenset(),
        watched: list[RowUse] | None = None,
    ) -> None:
        super().__init__()
        self._fed = {id(tokens): index for index, tokens in ids.items()}
        self._ids = ids
        # (input, parameter, embeddings running, rows) of each parameter indexed by the ids (or ids carried on), rows
        # (their uses) where the lookup picked whole rows (its first dimension) of a parameter of an nn.Linear
        self._tables = tables
        self._inside = [] if inside is None else inside
        self._linear = linear  # the ids of the nn.Linear layers' parameters
        # The ids of the embeddings' weights: one tied to a Linear's (a language model's head) and looked up inside an
        # embedding is that embedding's lookup, whose rows are the model's input, not the layer's output units.
        self._embedded = embedded
        # The uses of the rows picked from such a parameter, while their uses are recorded: none, mostly.
        self._watched = [] if watched is None else watched
        self._floats = False  # whether a floating-point tensor holds token values (``ids.double()``): none, mostly

    def _source(self, values: Iterator[object]) -> int | None:
        for value in values:
            if isinstance(value, torch.Tensor):
                index = self._fed.get(id(value), getattr(value, _DERIVED, None))
                if index is None and value._base is not None:
                    index = self._fed.get(id(value._base), getattr(value._base, _DERIVED, None))
                if index is not None:
                    return index
            elif isinstance(value, (list, tuple)):
                index = self._source(iter(value))
                if index is not None:
                    return index
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        try:  # read as an attribute: a call of getattr on each of the model's torch calls costs more
            name = func.__name__
        except AttributeError:
            name = ""
        if self._watched:
            note_row_uses(name, args, kwargs, out)
        if self._floats and name in PRODUCTS:  # token values as numbers met with a weight: a lookup of the weight
            met = weight_met(name, args, kwargs, self._fed, self._inside)
            if met is not None:
                self._tables.append(met)
        # Most calls do none of these: back at once (``in`` and ``[]`` make no Python call); of a property's
        # ``__get__``, only a tensor (``code.mT``, ``ids.data``) carries the values.
        if name not in _KINDS or (name == "__get__" and not isinstance(out, torch.Tensor)):
            return out
        kind = _KINDS[name]
        if kind is _COMPARES:  # a code of the ids only where compared with a set of values (``ids[..., None] == r``)
            index = marked_operand(args[:2], self._fed)
            if index is not None:
                with torch._C.DisableTorchFunction():  # a shape is read through the function modes
                    _mark_code(out, args[:2], index, self._fed)
            return out
        if kind is _COMPUTES:  # arithmetic or a conversion: looked at only where an operand holds token values
            taken = args if not kwargs and name not in TEMPLATES else taken_values(name, args, kwargs)
            index = marked_operand(taken, self._fed)
            if index is not None:
                with torch._C.DisableTorchFunction():  # a dtype is read through the function modes
                    self._floats |= mark_values(out, index)
                    _carry_code(out, taken, index)  # ``~code``, ``code & mask``
            return out
        if kind is _LOOKS:  # a lookup of rows by integers, or a write (rare: looked at in a call of its own)
            self._looked_up_or_written(name, args, kwargs, out)
            if name not in _CARRYING:
                return out
        with torch._C.DisableTorchFunction():  # looking at tensors is no call of the model: out of the modes' sight
            # An integer output is searched for among its arguments' token ids; a floating-point one (most of a
            # model's reshapes) only where it may hold them (below).
            if out.dtype in _INTEGERS if isinstance(out, torch.Tensor) else _has_integers(out):
                index = self._source(iter((*args, *kwargs.values())))
                restacked = None
                if index is not None and name in RESTACKING:
                    restacked = restacks(self._ids[index], args, kwargs, name)
                if restacked is not None:  # a lazy stack's read of the fed ids, or of a part (a lazy stack's inside)
                    mark_restacked(out, restacked)
                if index is not None:  # taken from the ids (the ids themselves only while nothing writes into them)
                    for tensor in out if isinstance(out, (list, tuple)) else (out,):
                        _mark(tensor, index)
            elif isinstance(out, torch.Tensor) and out.dtype == torch.bool:  # a code reshaped: ``code.transpose(1, 2)``
                index = marked_operand(args[:1], self._fed)
                if index is not None:
                    _carry_code(out, args[:1], index)
            # A floating-point output holds token values where ids were converted (``ids.to(torch.float64)``), or
            # where it is carried on from one that holds them (only then are the model's reshapes looked at).
            elif (self._floats or name in _CONVERTING) and isinstance(out, torch.Tensor) and out.is_floating_point():
                index = marked_operand(args if self._floats else args[:1], self._fed)
                if index is not None:
                    self._floats |= mark_values(out, index)
        return out

    def _looked_up_or_written(self, name: str, args: tuple, kwargs: dict, out: object) -> None:
        """Note a weight's rows looked up by the token ids (a function of ``_LOOKUPS``), or mark an integer tensor
        written token values in place (a function of ``_WRITING``)."""
        position = _LOOKUPS.get(name)
        if name == "embedding" and args and isinstance(args[0], torch.Tensor):  # torch.embedding(table, ids)
            with torch._C.DisableTorchFunction():
                position = 0 if args[0].is_floating_point() else position
        if position is not None and len(args) > position and isinstance(args[position], torch.Tensor):
            others = args[1:] if position == 0 else (*args[:position], *args[position + 1 :])  # all but the table
            with torch._C.DisableTorchFunction():
                index = self._source(iter(others))
            # Whether the table is a weight is asked only of lookups by the ids: it may walk the table's history.
            if index is not None and is_weight_table(args[position]):
                rows = None
                with torch._C.DisableTorchFunction():  # an inspection, which a function mode of the call must not see
                    table = id(args[position])
                    own = self._inside and table in self._embedded
                    if table in self._linear and not own and _picks_rows(name, args, kwargs):
                        rows = RowUse()
                        watch_rows(out, rows)
                        self._watched.append(rows)
                self._tables.append((index, args[position], tuple(self._inside), rows))
            elif index is not None:  # a constant table's rows picked by the ids (``torch.eye(n)[ids]``): a code of them
                self._floats |= mark_values(out, index)
        elif name in _WRITING:
            with torch._C.DisableTorchFunction():  # looking at tensors is no call of the model: out of the modes' sight
                if args and isinstance(args[0], torch.Tensor):
                    index = self._source(iter(args[_WRITING[name] : _WRITING[name] + 1]))
                    if index is None and name in CODING and args[0].is_floating_point():  # a one-hot code written
                        index = self._source(iter(args[CODING[name] : CODING[name] + 1]))
                    if index is not None and not args[0].is_floating_point():
                        _mark(args[0], index)
                    elif index is not None:  # token values written into a floating-point tensor (not a signal)
                        self._floats |= mark_values(args[0], index)


# The dtypes of marked token ids, the unsigned ones included (ids stored as ``uint8`` or ``uint16`` to save memory).
_INTEGERS = frozenset(
    {torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64}
)
# What the mode does after a call, by the function's name: a lookup or a write (looked at on its own), or a carrying
# of token values only; most of a model's calls are none of these.
_LOOKS = object()
_CARRIES = object()
_COMPUTES = object()  # arithmetic and conversions: most of them a model makes on activations, looked at cheaply
_COMPARES = object()  # comparisons: a mask of the ids (``ids != pad``), or a code of them (see ``_mark_code``)
# Carrying calls whose floating-point output, from the tensor they are called on, holds its token values: a conversion,
# a bit reinterpretation (``ids.view(torch.float64)``), a choice by a code (``torch.where(code, 1.0, 0.0)``).
_CONVERTING = frozenset({"to", "view", "where"})
_KINDS = (
    {name: _COMPARES for name in COMPARISONS}
    | {name: _COMPUTES for name in COMPUTED}
    | {name: _CARRIES for name in _CARRYING}
    | {name: _LOOKS for name in (*_LOOKUPS, *_WRITING)}
)


def _unembedded(key: NestedKey, dtype: torch.dtype, pixels: str, when: str) -> str:
    """What an input of integer tokens that no embedding read (``when``: before the model's error) needs."""
    return (
        f"LRP: input key {key!r} holds integer tokens ({dtype}), which receive relevance only through an "
        f"nn.Embedding or nn.EmbeddingBag that reads them directly, and none did{when}{pixels}; pass in_keys=[...] to "
        "explain only the floating-point inputs (a plain nn.Module's in_keys are also its inputs: to feed it an input "
        "that is not explained, such as an attention mask, wrap it in a TensorDictModule with every input key and give "
        "the wrapper in_keys of the explained ones)"
    )


def _has_integers(out: object) -> bool:
    """Whether ``out``, what a call returned, is (or holds) a tensor of integers that :func:`_mark` marks; to be
    asked with the function modes off (a tensor's dtype is read through them).

    Examples:
        >>> _has_integers(torch.tensor([1, 2])), _has_integers(torch.ones(2)), _has_integers(torch.ones(2) > 0)
        (True, False, False)
        >>> _has_integers(torch.tensor([1, 2, 3]).split(2)), _has_integers(3)
        (True, False)
    """
    if isinstance(out, (list, tuple)):
        return any(isinstance(tensor, torch.Tensor) and tensor.dtype in _INTEGERS for tensor in out)
    return isinstance(out, torch.Tensor) and out.dtype in _INTEGERS


def _picks_rows(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a lookup (a function of ``_LOOKUPS``, with its table and ids in ``args``) picks rows of its table by
    the ids, the indices of its first dimension: ``table[ids]``, ``table[ids, :k]``, ``F.embedding(ids, table)``,
    ``table.index_select(0, ids)``, or ``torch.take`` of a one-dimensional table; not ``table[:, ids]``.

    Examples:
        >>> table, ids = torch.randn(5, 3), torch.tensor([1, 4])
        >>> _picks_rows("__getitem__", (table, ids), {}), _picks_rows("__getitem__", (table, (slice(None), ids)), {})
        (True, False)
        >>> _picks_rows("embedding", (ids, table), {}), _picks_rows("index_select", (table, 1, ids), {})
        (True, False)
    """
    if name == "embedding":
        return True
    table = args[0]
    if name == "__getitem__":
        index = args[1] if len(args) > 1 else None
        first = index[0] if isinstance(index, tuple) and index else index
        return isinstance(first, torch.Tensor) and not first.is_floating_point() and first.dtype != torch.bool
    if name == "index_select":
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        return isinstance(dim, int) and dim % max(table.dim(), 1) == 0
    return name == "take" and table.dim() == 1


def _mark(tensor: object, index: int) -> None:
    """Mark an integer tensor (not a boolean mask) as carrying the token values of explained input ``index``."""
    if isinstance(tensor, torch.Tensor) and tensor.dtype in _INTEGERS:
        setattr(tensor, _DERIVED, index)
        if tensor._base is not None:  # a write into a view writes into its base
            setattr(tensor._base, _DERIVED, index)


def _mark_code(out: object, operands: tuple, index: int, fed: Mapping[int, int]) -> None:
    """Mark the boolean result ``out`` of a comparison of token values (among ``operands``, of explained input
    ``index``) where it is a code of them: it spans more places than each marked operand, the ids compared with a
    set of values (``ids[..., None] == torch.arange(n)``, a one-hot code). A mask of the same places as the ids
    (``ids != pad``, ``ids == eos``) is none; to be called with the function modes off (a shape is read through them).

    Examples:
        >>> ids, values = torch.tensor([2, 0]), torch.arange(3)
        >>> column = ids[:, None]
        >>> code, mask, fed = column == values, ids != 0, {id(ids): 0, id(column): 0}
        >>> _mark_code(code, (column, values), 0, fed)
        >>> _mark_code(mask, (ids, 0), 0, fed)
        >>> getattr(code, "_tdhook_tokens_of", None), getattr(mask, "_tdhook_tokens_of", None)
        (0, None)
    """
    if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
        return
    marked = [
        value
        for value in operands
        if isinstance(value, torch.Tensor) and (id(value) in fed or getattr(value, _DERIVED, None) is not None)
    ]
    if marked and all(out.numel() > value.numel() for value in marked):
        setattr(out, _DERIVED, index)


def _carry_code(out: object, operands: tuple, index: int) -> None:
    """Mark the boolean ``out`` computed from ``operands`` (or one level of lists of them) where one of them is a
    marked code of token ids (see :func:`_mark_code`), of explained input ``index``: a code reshaped, sliced, negated
    or masked; to be called with the function modes off (a dtype is read through them).

    Examples:
        >>> code = torch.tensor([[False, True]])
        >>> code._tdhook_tokens_of = 0
        >>> moved = code.t()
        >>> _carry_code(moved, (code,), 0)
        >>> getattr(moved, "_tdhook_tokens_of", None)
        0
    """
    if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
        return
    for value in operands:
        for tensor in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.bool and hasattr(tensor, _DERIVED):
                setattr(out, _DERIVED, index)
                return


def _with_input(args: tuple, kwargs: dict) -> tuple:
    """A call's positional arguments, with its input first where it was given by keyword (``embedding(input=ids)``)."""
    return args if args or "input" not in kwargs else (kwargs["input"],)


def _converts_pixels_at(module: nn.Module, key: NestedKey) -> bool:
    """Whether ``module`` is torchrl's ``ToTensorImage`` reading ``key``.

    Examples:
        >>> _converts_pixels_at(ToTensorImage(in_keys=["pixels"]), "pixels"), _converts_pixels_at(nn.ReLU(), "pixels")
        (True, False)
    """
    if not isinstance(module, ToTensorImage):
        return False
    wanted = key if isinstance(key, tuple) else (key,)
    return any((k if isinstance(k, tuple) else (k,)) == wanted for k in getattr(module, "in_keys", ()))


def rewind(tokens: TokenInputs) -> None:
    """Before the model runs again on the same inputs (see :func:`~tdhook.attribution._model_run.run_model`): the
    token ids ``tokens`` fed, none of them embedded yet.

    >>> tokens, leaves, fed = TokenInputs(["input_ids"]), [], []
    >>> ids = tokens.feed(0, torch.tensor([[5, 6]]), leaves, fed)
    >>> leaves[0] = fed[0] = torch.zeros(1, 2, 4)  # what the embedding's hook gives
    >>> rewind(tokens)
    >>> leaves, fed, tokens.feeding
    ([None], [None], True)
    """
    for index in tokens._ids:
        tokens._leaves[index] = tokens._fed[index] = None
    tokens._derived, tokens._tables, tokens._inside, tokens._watched = [], [], [], []
