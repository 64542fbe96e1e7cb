"""Relevance set directly at a layer's input, carried back through the glue between the model inputs and that layer.

The input-layer rules (Flat, w², z^B) and the Uniform rule give relevance to
input positions whose value is zero, where ``x * grad`` cannot carry it; the
input-layer rules give all of theirs this way where the glue maps positions one
to one (:func:`whole_records`), so that a normaliser's shift takes no share. The
wrapper adds it back to the explained input it belongs to. When glue sits
between the explained input ``u`` and the layer's input ``x`` (a normaliser
``(u - mean) / std``, a scaling step of a ``TensorDictSequential``, a reshape,
a concatenation of observation keys), :func:`carry_back` maps it onto ``u``:

* each position ``i`` of ``x`` that depends on exactly one position ``π(i)``
  of the inputs (``x_i = a_i u_π(i) + b_i`` near the call: element-wise affine
  maps, reshapes, permutations, slices, concatenations, broadcasts) gives its
  relevance to that position; a broadcast input collects the relevance of all
  its copies, so the sum is kept;
* a position that depends on no input (padding, a constant) keeps its
  relevance for that constant, as a bias does: it is not an input's;
* a position that depends on several input positions at once (a sum of two
  inputs, a matrix product, a mean) has no single owner: :class:`GlueError`.

The positions are read from the glue's Jacobian ``J`` with forward products
``J p`` (computed as double backward passes through the glue only) for probes
``p`` holding each input position's index digits; last probes holding a hash
of each position's index check that every row has one owner (a mean of
neighbours gives back the digits of the middle one, as any affine probe does,
but not its hash).
"""

from __future__ import annotations

import math
import weakref

import torch
from torch import nn

from tdhook.attribution.rules._autograd import relevance_pass_edges
from tdhook.attribution.rules._caller import warn_at_caller
from tdhook.attribution.rules._identity import IdentityWeakKeyDict
from tdhook.attribution.rules._layer_nodes import is_layer_node
from tdhook.attribution.rules._linked_inputs import is_linked_copy
from tdhook.attribution.rules._set_relevance import glue_probe, note_set_relevance, watched_tensors

__all__ = ["GlueError", "carry_back", "input_leaves", "note_up_the_glue", "rest_records", "whole_records"]


class GlueError(ValueError):
    """Relevance at a layer's input that cannot be given to the explained inputs position by position.

    ``module`` is the layer whose rule set the relevance.

    Examples:
        A Flat rule's relevance at a position of the layer's input that sums two explained positions:

        >>> from tensordict import TensorDict
        >>> from tdhook.attribution import LRP, FlatRule
        >>> class Mixed(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.layer = nn.Linear(3, 2)
        ...     def forward(self, u):
        ...         return self.layer(u + u.roll(1, -1))
        >>> lrp = LRP(Mixed(), {"layer": FlatRule()}, in_keys=["u"], out_keys=["y"])
        >>> lrp(TensorDict(u=torch.tensor([[1.0, -1.0, 2.0]]), batch_size=[1]))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        tdhook.attribution.rules._glue.GlueError: FlatRule on Linear: the layer's input at position (0, 1) depends ...
    """

    def __init__(self, message: str, module: nn.Module | None = None) -> None:
        super().__init__(message)
        self.module = module


def input_leaves(x: torch.Tensor) -> tuple[list[torch.Tensor], bool]:
    """The non-parameter leaves ``x`` is computed from, and whether its graph also passes through a layer.

    Examples:
        >>> u = torch.ones(2, requires_grad=True)
        >>> leaves, through_layer = input_leaves(u / 2 + 1)
        >>> leaves[0] is u, through_layer
        (True, False)
    """
    if x.grad_fn is None:
        return ([x] if x.requires_grad and not isinstance(x, nn.Parameter) else []), False
    leaves: dict[int, torch.Tensor] = {}
    through_layer = False
    stack, seen = [x.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if is_layer_node(node):
            through_layer = True
            continue
        variable = getattr(node, "variable", None)
        if variable is not None:
            if not isinstance(variable, nn.Parameter):
                leaves.setdefault(id(variable), variable)
            continue
        stack.extend(relevance_pass_edges(node))
    return list(leaves.values()), through_layer


def _digits(dtype: torch.dtype) -> int:
    """The base of the index digits a forward product in ``dtype`` gives back exactly enough to round.

    A digit ``p`` comes back as ``(a p) / a`` with ``a`` the glue's factor, off by about ``p`` times the unit
    roundoff for each rounding in the glue and in the quotient (a normaliser's shift, its division by a deviation):
    digits below ``2⁻⁹ / ε`` keep a dozen roundings well inside the reading's tolerance of 0.1.
    """
    mantissa = round(-math.log2(torch.finfo(dtype).eps)) + 1
    return 2 ** max(1, min(20, mantissa - 9))


def _hashed(index: torch.Tensor, salt: int, base: int) -> torch.Tensor:
    """A hash of each index in ``1 … base``: no mean of the hashes of other indices is the hash of one but by chance
    (an affine function of the index gives a mean of neighbours the middle one's value)."""
    h = (index * 2654435761 + salt * 40503 + 12345) & 0x7FFFFFFF
    h = h ^ (h >> 15)
    h = (h * 73244475) & 0x7FFFFFFF
    h = h ^ (h >> 13)
    return h % base + 1


def carry_back(
    x: torch.Tensor,
    relevance: torch.Tensor,
    who: str,
    mixed: list[torch.Tensor] | None = None,
    sources: list[torch.Tensor] | None = None,
    dropped: list[torch.Tensor] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``relevance`` of the non-leaf layer input ``x``, given to the leaves ``x`` was computed from.

    Args:
        x: the layer's input, computed from the model inputs by glue (no Linear or convolution layer between).
        relevance: relevance shaped like ``x``.
        who: the rule and module, for error messages.
        mixed: where given, a position that depends on several input positions is not refused: the mask of such
            positions (shaped like ``x``) is appended to this list, and their relevance is left out of the result.
        sources: where given, the tensors to carry the relevance back to, in place of the leaves (tensors the glue
            computes ``x`` from, with no layer between); none of them when ``x`` depends on none.
        dropped: where given, the mask of the positions holding relevance whose row of the glue's Jacobian is 0 here
            (a constant, or an activation's zeroed output) is appended to this list: their relevance is left out.

    Returns:
        ``(leaf, relevance of leaf)`` pairs, one per leaf ``x`` depends on; the sum of the relevance is kept
        except at positions that depend on no leaf.

    Raises:
        GlueError: a position holding relevance depends on several input positions (``mixed`` not given), or the glue's
            Jacobian cannot be read (a rule inside the glue whose backward is not differentiable).

    Examples:
        >>> u = torch.tensor([[0.0, 4.0]], requires_grad=True)
        >>> x = (u - 1.0) / 2.0
        >>> [(leaf is u, r) for leaf, r in carry_back(x, torch.tensor([[3.0, 0.0]]), "FlatRule on Linear")]
        [(True, tensor([[3., 0.]]))]
        >>> carry_back(u[:, :1] + u[:, 1:], torch.tensor([[1.0]]), "FlatRule on Linear")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        tdhook.attribution.rules._glue.GlueError: FlatRule on Linear: the layer's input at position (0, 0) ...
    """
    leaves, through_layer = input_leaves(x) if sources is None else (sources, False)
    if through_layer:
        # A hidden layer (its input made by a layer alone) or one whose input mixes both: this rule gives relevance
        # to its input's positions by itself, which only the explained inputs can take (input x modified gradient).
        read = "mixes the model inputs with" if leaves else "is"
        raise GlueError(
            f"{who}: the layer's input {read} the output of another Linear, convolution or recurrent layer, so the "
            "relevance this rule sets at its input's entries (whatever their values, zeros included) cannot be given "
            "to the explained inputs; use this rule on the layer the inputs reach first only (a preset's first-layer "
            "rule: map this layer to another rule in rule_mapper)"
        )
    rows = relevance != 0
    if mixed is not None:
        mixed.append(torch.zeros_like(rows))
    if not leaves or not bool(rows.any()):
        return []
    sizes = [leaf.numel() for leaf in leaves]
    total = sum(sizes)
    base = _digits(x.dtype)
    n_digits = max(1, math.ceil(math.log(max(total, 2)) / math.log(base)))
    index = torch.arange(total, device=x.device)
    probes = [torch.ones(total, dtype=x.dtype, device=x.device)]
    for d in range(n_digits):
        probes.append(((index // base**d) % base + 1).to(x.dtype))
    check_base = base - 1 if base > 2 else base
    checks = [_hashed(index, salt, check_base) for salt in range(2 if check_base > 1000 else 8)]
    probes.extend(check.to(x.dtype) for check in checks)
    with torch.enable_grad(), glue_probe():  # the hooks on the tensors passed are not the relevance pass's
        w = torch.zeros_like(x, requires_grad=True)
        vjp = torch.autograd.grad(x, leaves, w, retain_graph=True, create_graph=True, allow_unused=True)
        used = [(g, leaf, i) for i, (g, leaf) in enumerate(zip(vjp, leaves, strict=True)) if g is not None]
        if not used and sources is not None:
            return []  # x is not computed from them
        if not used or not all(g.requires_grad for g, _, _ in used):
            raise GlueError(f"{who}: the glue before the layer has a backward that cannot be differentiated again")
        products = []
        for probe in probes:
            parts = list(probe.split(sizes))
            jvp = torch.autograd.grad(
                [g for g, _, _ in used],
                w,
                [parts[i].view_as(leaf) for _, leaf, i in used],
                retain_graph=True,
                allow_unused=True,
            )[0]
            products.append(torch.zeros_like(x) if jvp is None else jvp.detach())
    scale, *digit_products = products[: n_digits + 1]
    check_products = products[n_digits + 1 :]
    owned = scale != 0
    orphan = rows & ~owned & torch.stack([p != 0 for p in products[1:]]).any(0)
    if dropped is not None:
        dropped.append(rows & ~owned & ~orphan)
    owned = rows & owned
    position = torch.zeros(x.shape, dtype=torch.long, device=x.device)
    single = torch.ones_like(owned)
    for d, product in enumerate(digit_products):
        ratio = product / torch.where(owned, scale, 1)
        digit = ratio.round()
        single &= ((ratio - digit).abs() <= 0.1) & (digit >= 1) & (digit <= base)
        position += (digit.clamp(1, base).long() - 1) * base**d
    position = position.clamp(0, total - 1)
    for salt, check in enumerate(check_products):
        expected = _hashed(position, salt, check_base).to(x.dtype)
        single &= ((check / torch.where(owned, scale, 1)) - expected).abs() <= 0.1
    several = orphan | (owned & ~single)
    if mixed is not None:
        mixed[-1] = several
        owned &= single
    elif bool(several.any()):
        where = tuple(int(i) for i in several.nonzero()[0])
        raise GlueError(
            f"{who}: the layer's input at position {where} depends on several input positions at once (glue "
            "before the layer that sums or mixes inputs); its relevance has no single owner among the explained "
            "inputs"
        )
    flat = torch.zeros(total, dtype=relevance.dtype, device=relevance.device)
    flat.index_add_(0, position[owned], relevance[owned])
    parts = flat.split(sizes)
    return [(leaves[i], parts[i].view_as(leaf)) for _, leaf, i in used]


def _copied_leaf(x: torch.Tensor) -> torch.Tensor | None:
    """The non-parameter leaf that ``x`` is an unmodified copy of, if it is one."""
    node = x.grad_fn
    edges = relevance_pass_edges(node)  # a call that keeps the graph links its copy to the caller's tensor too
    if (type(node).__name__ != "CloneBackward0" and not is_linked_copy(node)) or len(edges) != 1:
        return None
    variable = getattr(edges[0], "variable", None)
    return variable if variable is not None and not isinstance(variable, nn.Parameter) else None


def rest_records(
    rule: object,
    module: nn.Module,
    x: torch.Tensor,
    rest: torch.Tensor,
    registration: object | None = None,
    uncarried: torch.Tensor | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The records of the relevance ``rest`` that ``x * grad`` did not carry at ``module``'s input ``x``.

    A model input (a leaf, a copy of a leaf as the wrapper feeds the model, or an alias of one) keeps all of it,
    rounding included; an input computed by glue gives what lies at the entries ``x * grad`` does not carry
    (``uncarried``; by default its zero entries) to the model inputs through :func:`carry_back`. In the first call
    for ``registration`` (the rule's on ``module``), relevance that an activation in the glue zeroed is warned about
    (see :func:`warn_if_zeroed_by_glue`).

    Examples:
        >>> u = torch.tensor([0.0, 2.0], requires_grad=True)
        >>> [(leaf is u, r) for leaf, r in rest_records(object(), nn.Identity(), u * 3, torch.tensor([1.0, 0.0]))]
        [(True, tensor([1., 0.]))]
    """
    source = getattr(x, "_tdhook_alias_of", x)
    if source.grad_fn is None:
        return [(x, rest)]
    copied = _copied_leaf(source)
    if copied is not None:
        return [(copied, rest)]
    at_zero = torch.where(x.detach() == 0 if uncarried is None else uncarried, rest, 0)
    who = f"{type(rule).__name__} on {type(module).__name__}"
    dropped = _unchecked(registration)
    try:
        records = carry_back(x, at_zero, who, dropped=dropped)
    except GlueError as err:
        err.module = module
        raise
    warn_if_zeroed_by_glue(rule, module, x, dropped)
    return records


def whole_records(
    rule: object, module: nn.Module, x: torch.Tensor, relevance: torch.Tensor, registration: object | None = None
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor] | None:
    """The records of ``relevance``, set directly at ``module``'s input ``x``, at the positions that glue computes
    from the model inputs one position each (``(u - mean) / std``, a scaling, a flip, a reshape), and the relevance
    left at the positions that mix several inputs (a mean of the inputs beside them), for the gradient to carry;
    ``None`` where ``x`` is a model input or a copy of one, or where the glue passes through another layer or its
    backward cannot be differentiated again (the gradient then carries ``x * grad`` and :func:`rest_records` the
    rest).

    The relevance a first-layer rule sets belongs to the input position its input was computed from, whole: the
    gradient through glue with a shift ``b`` would carry ``R (x - b) / x`` instead, unbounded where ``x`` nears
    zero (a pixel near a normaliser's mean), and the relevance would no longer sum to the layer's.
    ``registration`` is checked as in :func:`rest_records`.

    Examples:
        >>> u = torch.tensor([0.5, 2.0], requires_grad=True)
        >>> x = torch.cat([(u - 0.5) * 4, u.sum(0, keepdim=True)])  # the last position mixes both inputs
        >>> records, left = whole_records(object(), nn.Identity(), x, torch.ones(3))
        >>> [(leaf is u, r) for leaf, r in records], left
        ([(True, tensor([1., 1.]))], tensor([0., 0., 1.]))
    """
    source = getattr(x, "_tdhook_alias_of", x)
    if source.grad_fn is None or _only_moves_values(source) or input_leaves(x)[1]:
        return None  # a model input, or one moved without a shift: x * grad carries the relevance exactly
    mixed: list[torch.Tensor] = []
    dropped = _unchecked(registration)
    try:
        records = carry_back(x, relevance, f"{type(rule).__name__} on {type(module).__name__}", mixed, dropped=dropped)
    except GlueError:
        return None  # a backward that cannot be differentiated again
    warn_if_zeroed_by_glue(rule, module, x, dropped)
    # Only the positions that mix inputs are left to the gradient: one of them must not send the shifted ones
    # there too, where their relevance would be scaled by (x - b) / x.
    return records, torch.where(mixed[0], relevance, 0)


# Autograd nodes of activations whose gradient is 0 where they zero (or clamp) their input: glue made of them
# gives a layer input positions that depend on no model input here, though they do elsewhere.
_ZEROING = frozenset(
    {
        "ReluBackward0",
        "ThresholdBackward0",
        "HardtanhBackward0",
        "ClampBackward0",
        "ClampBackward1",
        "ClampMinBackward0",
        "ClampMaxBackward0",
        "HardsigmoidBackward0",
        "HardswishBackward0",
    }
)

# Set on a rule's registration once its first call was checked by :func:`warn_if_zeroed_by_glue`.
_ZEROED_BY_GLUE = "_tdhook_zeroed_by_glue_checked"
# The rules warned of, per module: once warned, a rule on a module is not warned of again, in any later context (each
# call of a wrapper outside its context enters one of its own), as the wrapper's other warnings about its model.
_WARNED: IdentityWeakKeyDict = IdentityWeakKeyDict()


def _unchecked(registration: object | None) -> list[torch.Tensor] | None:
    """A list for :func:`carry_back`'s ``dropped`` in the first call that carries relevance back for a rule's
    ``registration`` on a module (once per context: the check costs nothing later), else ``None``."""
    if registration is None or getattr(registration, _ZEROED_BY_GLUE, False):
        return None
    setattr(registration, _ZEROED_BY_GLUE, True)
    return []


def warn_if_zeroed_by_glue(
    rule: object, module: nn.Module, x: torch.Tensor, dropped: list[torch.Tensor] | None
) -> bool:
    """Warn, naming ``module``, where relevance the rule set at its input ``x`` was
    dropped (``dropped``, from :func:`carry_back`) at positions an activation in the glue zeroed (a ReLU before the
    first layer): no gradient reaches the model input there, while zennit's pass rule hands the relevance on to it.
    Returns whether it warned. A rule is warned of once per module (later calls, and later contexts, stay quiet).

    Examples:
        >>> import warnings
        >>> u = torch.tensor([-1.0, 2.0], requires_grad=True)
        >>> layer = nn.Linear(2, 1)
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_if_zeroed_by_glue(layer, layer, u.relu(), [torch.tensor([True, False])])
        ...     warn_if_zeroed_by_glue(layer, nn.Linear(2, 1), u * 2, [torch.tensor([True, False])])
        ...     warn_if_zeroed_by_glue(layer, layer, u.relu(), [torch.tensor([True, False])])  # warned already
        True
        False
        False
    """
    if not dropped or not bool(dropped[0].any()):
        return False
    names = {type(node).__name__ for node in _glue_nodes(x)[0]}
    zeroing = sorted(name.rpartition("Backward")[0] for name in names & _ZEROING)
    if not zeroing:
        return False  # a constant (padding) keeps its relevance, as a bias does
    warned = _WARNED.get(module, [])
    if any(ref() is rule for ref in warned):
        return False
    name = type(module).__name__
    warn_at_caller(
        f"{type(rule).__name__} on {name}: the relevance it sets at {int(dropped[0].sum())} entries of its input "
        f"that the glue before it zeroed ({', '.join(zeroing)} at its inputs) cannot pass back, since the glue's "
        f"gradient is 0 there: it is dropped, where zennit's pass rule hands it to the model input. Explain at the "
        f"{name}'s input, or map the {name} to another rule (EpsilonRule)"
    )
    # Recorded once the warning is out: a filter that makes it an error warns again in the next context.
    _WARNED[module] = [*(ref for ref in warned if ref() is not None), weakref.ref(rule)]
    return True


# Autograd nodes of glue that only moves or copies values (no shift, no scale): the gradient through them carries
# ``x * grad`` to the input position ``x`` came from exactly.
_MOVES = frozenset(
    {
        "CloneBackward0",
        "ViewBackward0",
        "UnsafeViewBackward0",
        "ReshapeAliasBackward0",
        "AliasBackward0",
        "PermuteBackward0",
        "TransposeBackward0",
        "TBackward0",
        "SqueezeBackward0",
        "SqueezeBackward1",
        "SqueezeBackward2",
        "UnsqueezeBackward0",
        "FlipBackward0",
    }
)


def _only_moves_values(x: torch.Tensor) -> bool:
    """Whether ``x`` is a non-parameter leaf moved by a chain of single-input views, copies and permutations."""
    node = x.grad_fn
    while node is not None and (type(node).__name__ in _MOVES or is_linked_copy(node)):
        edges = relevance_pass_edges(node)
        if len(edges) != 1:
            break
        node = edges[0]
    variable = getattr(node, "variable", None)
    return variable is not None and not isinstance(variable, nn.Parameter)


def note_up_the_glue(rule: object, module: nn.Module, x: torch.Tensor, whole: torch.Tensor, carried=None) -> None:
    """:func:`~tdhook.attribution.rules._set_relevance.note_set_relevance` at ``module``'s input ``x``, and at each
    watched tensor (a module output named in ``layers``) that glue computes ``x`` from: the relevance the gradient
    does not carry, carried back to its positions. A normaliser's output before a ``Flatten`` and the first layer gets
    the relevance the rule set at the positions computed from it, which reaches it through no gradient.

    Examples:
        >>> from tensordict import TensorDict
        >>> from tdhook.attribution import LRP, EpsilonPlusFlat
        >>> model = nn.Sequential(nn.Tanh(), nn.Flatten(), nn.Linear(4, 2))  # Flat on the Linear
        >>> lrp = LRP(model, EpsilonPlusFlat(), in_keys=["x"], out_keys=["y"], layers=["0"])
        >>> td = lrp(TensorDict(x=torch.tensor([[[0.5, 1.0], [-2.0, 0.25]]]), batch_size=[1]))
        >>> relevance = td["relevance", "0"]  # the Tanh's output: each input's, which the pass rule passes on
        >>> torch.allclose(relevance, td["relevance", "x"]), bool(relevance.abs().sum() > 0)
        (True, True)
    """
    source = getattr(x, "_tdhook_alias_of", x)
    watched = [t for t in watched_tensors() if t is not source and t is not x and t.requires_grad]
    rest = whole if carried is None else whole - carried
    notes = []
    if watched and bool(rest.any()) and not input_leaves(x)[1]:  # (glue through another layer: no first layer's)
        nodes, leaves = _glue_nodes(x)
        upstream = [t for t in watched if (t.grad_fn in nodes if t.grad_fn is not None else id(t) in leaves)]
        who = f"{type(rule).__name__} on {type(module).__name__}"
        for tensor in upstream:
            try:
                notes.extend(carry_back(x, rest, who, mixed=[], sources=[tensor]))
            except GlueError:
                continue  # a backward that cannot be differentiated again: the gradient's share alone
    # Noted once every pass through the glue has run: such a pass runs the watchers' hooks, which take what is noted.
    note_set_relevance(x, whole, carried)
    for watched, relevance in notes:
        note_set_relevance(watched, relevance)


def _glue_nodes(x: torch.Tensor) -> tuple[set, set[int]]:
    """The autograd nodes of the glue ``x`` is computed by, up to the layers before it, and the ids of its leaves."""
    nodes: set = set()
    leaves: set[int] = set()
    stack = [x.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in nodes or is_layer_node(node):
            continue
        nodes.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves.add(id(variable))
            continue
        stack.extend(relevance_pass_edges(node))
    return nodes, leaves
