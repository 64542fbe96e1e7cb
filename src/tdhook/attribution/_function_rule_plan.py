"""The function rules' products, found in the autograd graph instead of through a function mode.

:class:`~tdhook.attribution.rules.functional.FunctionalRules` is a ``TorchFunctionMode``: every torch call of
the model's own code goes through its Python dispatch, a few microseconds each, whether it has a rule or not.
On a small transformer that is a fifth of a gradient pass. In most models every rule it applies is the uniform
rule on a product of two activations (``q · kᵀ``, ``attention · v``, ``silu(gate) * up``), which halves the
gradient that reaches the product's autograd node; the rest of the calls it only lets through.

So a call of a wrapper that runs in the mode records where those products' nodes lie in the graph the forward
pass leaves: the shape of that graph (see :mod:`~tdhook.attribution._graph_shape`), the place of each of them in
the walk that reads it, and how many nodes the pass creates before each and in all (autograd numbers the nodes a
thread creates). A later call on inputs of the same shapes runs the model without the mode, walks its own graph
from its outputs, checks that it has the recorded shape and that the node at each recorded place has the
recorded number, and puts a pre-hook that halves the gradient on each product's node: the same factor on the same
node, with no Python between the torch calls. Where anything differs, its hooks are not set, and the call runs
again in the mode (and records anew); inputs whose graph differs twice keep the mode from then on. The numbers of
the nodes made in the calls of modules the mode pauses in (a module with a rule of its own, or mapped to its plain
gradient) are checked too: a flag that moves a product into such a module leaves the same graph, but no rule on it.

Norms written out (Llama's RMSNorm: ``x * rsqrt(mean(x²) + ε)``) get the same treatment: their rule
(:class:`~tdhook.attribution.rules.normalization.NormRule`) holds the normalising scale constant by detaching it in
a mode of its own, nine torch calls of Python dispatch per norm. The recording call notes each held scale's node and
the node of the call that took the scale (see :mod:`~tdhook.attribution.rules._graph_calls`); a later call runs the
norm's forward as it is (without the rule's hooks, see :mod:`~tdhook.attribution._quiet_modules`; the call notes the
node of its output all the same, where the walk to its scales starts) and puts a pre-hook on the scale's node that
passes no gradient, so that the nodes behind it get none either, as behind the detached scale: the same gradient,
bit for bit. A fused ``F.layer_norm`` (a module's, or called as a function) gets its rule as a hook on its own node,
from the scale the node saved: the recording call puts it there and notes the node, a later call puts it on the same
node of its plain graph (its weight and bias get no gradient, as they get none from the mode's rule). A norm whose
forward does more keeps its mode in later calls (a fused layer norm in it still runs plainly, for the plan's hook),
and so does one whose plain backward would read a tensor changed in place after the forward saved it (a layer norm's
input changed in place after it). Under saved-tensor hooks (a checkpoint region's) a fused layer norm computes its
scale itself.

CP-LRP's held attention weights and held gates get it too, and so does a fused attention (sdpa). In a recording
call the mode holds them without detaching them, so that its graph is the plain call's: a softmax's output, held
whole, gets a pre-hook on its node that passes no gradient (every call that takes it takes it held); a gate held in
an element-wise product of two activations gets a post-hook on the product's node that passes none to the gate's
place (in a ``matmul``, which torch computes by a ``bmm`` of views of its factors, the node of those that takes the
gate: MiniMax's lightning attention); a fused attention's node gets a post-hook that multiplies the gradients it
passes to the query, key and value by the rule's factors (none to the query and key under CP-LRP; the uniform
rule's halves under AttnLRP); where torch computes it by several nodes (its math path, for a mask that requires
grad: a learned position bias), the nodes that take the query, key and value get those factors.
They are recorded, and a later call puts the same hooks on the same nodes. What the call makes of held tensors alone
(a stack of heads' weights, a buffer they are written into) needs a gradient, as what is made of detached ones does
not: the mode marks it a constant to the rules; a held tensor that then takes other values in place (an activation's)
would be an activation if detached, and the call runs again with its held tensors detached. The nodes behind a held
tensor run with
no gradient, as they would not behind a detached one: a call whose graph there saved a tensor that was changed in
place after runs again in the mode (their backward would raise), and so do later calls on inputs of its signature;
a later call whose branch changed one in place after (which the recording call did not take) runs again in the mode.

GELU and SiLU called as functions get it too: their nodes save their input, from which a hook computes the
identity rule's factor (see :func:`~tdhook.attribution.rules.basic.hook_pass_rule`); so do clipping calls (``clamp``
and ``clip`` with bounds that are numbers, ``F.hardtanh``, ``F.relu6``; in place too, whose node saves the input as
it was: OLMo's and DBRX's ``clip_qkv``). So do GELU and SiLU modules
under the pass rule: their rule's hook puts it on the node in a recording call, and leaves it to the plan in a later
one, which runs the module without its hooks where they have nothing else to do (see
:mod:`~tdhook.attribution._quiet_modules`) and takes the factor's ``f(x)`` from the output the module returned,
unchanged in place since, instead of computing it again from the saved input. The backward of such a node, and
of a fused layer norm's, runs in a later call, never in the mode: a later call whose tensors they saved were changed
in place since (a branch the recording call did not take) runs in the mode. A sigmoid-like gate called as a
function (a mixture of experts' shared-expert gate) is left without its rule in a recording call: where every
product that takes it holds it, no gradient reaches its node, and the plan is made; where one does (the gate also
used as a signal), the call runs again in the mode, and so do later calls on inputs of its signature.

``torch.tanh`` called as a function gets it too where its input is a module's output (RoBERTa's, MobileBERT's and
Funnel's classification heads): its node saves its output, not its input, so a recording call that meets one asks
the next recording call on the same signature to keep every module's output; where the tanh's input is one, the
plan keeps a forward hook on that module for the rest of the context, and its hook on the tanh's node computes the
identity rule's factor from the kept output and the output the node saved, as the mode computes it from both (see
:mod:`~tdhook.attribution._kept_outputs`). A kept output that is no longer the node's input, or that was changed in
place since, runs the call in the mode. An ``einsum`` of two activations (Funnel's relative attention), often a view
that the mode's in-place factor would rebase, gets the uniform rule as a pre-hook that halves its own node's gradient.

Where the mode applies any other rule (a softmax with ε, an RMS norm, an activation called as a function whose node
keeps no input and whose input is no module's output (Gemma 2's softcapping ``tanh``), a clipping call with bounds
that are tensors or in place through a view, a fused attention with dropout, a gate held in a product other than an
element-wise one or a ``matmul``), every later call on inputs of that signature runs in the mode. So does every call
where the forward reads values computed from the explained inputs into Python (``if x.sum() > 0``, ``.item()``,
``int(...)``; held attention weights' values are the inputs' too): on other inputs of the same shapes it may take
another branch whose graph has the same nodes, with a product of two activations on one and of an activation and a
constant (which the uniform rule leaves whole) on the other. So do calls that keep the relevance's graph, that ask
for inner layers' relevance or token relevance, and models run with other function modes. Values of inputs that are
not explained (masks, token ids) and the model's own flags are not followed: a branch on them that changes which
products are of two activations is seen in the shape of the graph, which a later call compares with the recorded
one (see :mod:`~tdhook.attribution._graph_shape`). The marks the mode leaves on tensors (computed from parameters
alone; gates) are read by the function modes only, to decide which products are of two activations: the recording
holds those decisions.

Examples:
    >>> from tensordict import TensorDict
    >>> from tdhook.attribution.rules._autograd import scale_gradient
    >>> plan, x = FunctionRulePlan(), torch.randn(3, requires_grad=True)
    >>> recording, start = plan.recorder("inputs of shape 3"), plan.sequence_number()
    >>> product = (x * 2) * (x * 3)
    >>> node = product.grad_fn
    >>> halved = scale_gradient(product, 0.5, in_place=True)  # the mode's uniform rule
    >>> recording.scaled(node, halved.grad_fn)
    >>> plan.settle(recording, TensorDict(y=halved.sum()), start)  # a graph whose backward can run
    True
    >>> start = plan.sequence_number()  # a later call, without the mode
    >>> result = TensorDict(y=((x * 2) * (x * 3)).sum())
    >>> plan.usable("inputs of shape 3").apply(result, start, plan.sequence_number(), [])
    True
    >>> torch.allclose(torch.autograd.grad(result["y"], x)[0], 6 * x)  # half of the plain gradient, 12 x
    True
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Hashable, Sequence
from typing import Any, NamedTuple

import torch
from tensordict import TensorDictBase
from torch.nn.modules.batchnorm import _BatchNorm

from tdhook.attribution._graph_inputs import chain_of, computed_again
from tdhook.attribution._graph_shape import graph_shape
from tdhook.attribution._kept_outputs import OutputKeepers
from tdhook.attribution._quiet_modules import QuietModules
from tdhook.attribution._training_norms import normalises_by_batch
from tdhook.attribution.rules._autograd import first_input_is, pass_no_relevance
from tdhook.attribution.rules._graph_calls import KeptOutputs
from tdhook.attribution.rules._norm_gradient_layout import BATCH_NORM_KERNEL_NODES, NO_NORM_KERNEL_BELOW
from tdhook.attribution.rules.basic import PassRuleOnNode, hook_pass_rule_given

__all__ = ["FunctionRulePlan", "Recording"]

# Input signatures whose plans a wrapper keeps (the shapes of a few sequence lengths); more are run in the mode.
_MOST_PLANS = 16

_sequence_number = torch._C._autograd._get_sequence_nr


class _Cut(NamedTuple):
    """A scale a norm's mode held (detached): its node, cut in a later call where the norm runs plainly."""

    module: Any  # the norm
    node: Any  # the scale's node
    inputs: tuple  # the consumer's tensor inputs and their versions: changed in place later, a plain call's
    # consumer node, which saves them to pass the scale its gradient, could not run its backward
    consumer: Any  # the node of the call that took the scale
    index: int  # the scale's place among the consumer's next functions
    earlier: int  # how many products' nodes of the mode's own came before


class _Hold(NamedTuple):
    """What the function mode did to a node's gradients without a node of its own: it passes no gradient at all
    (``factors`` None: a held tensor's own node), or it multiplies the gradients it passes to its inputs by
    ``factors`` (one per input: ``None`` leaves it, ``0.0`` passes none: a held input); or ``hook`` put a rule of
    its own on the node (a fused layer norm's), which passes no gradient where ``factors`` holds ``0.0``."""

    node: Any
    factors: tuple[float | None, ...] | None
    earlier: int  # how many products' nodes of the mode's own came before
    hook: Any = None  # puts the rule on a node of the same type: ``hook(node)``

    @property
    def dropped(self) -> tuple[int, ...]:
        """The places of the node's inputs that get no gradient."""
        return () if self.factors is None else tuple(i for i, f in enumerate(self.factors) if f == 0.0)


class Recording:
    """What the function mode did in one call: the products whose gradient it halved, or that it did more; and the
    scales that norms' modes held constant."""

    def __init__(self, key: Hashable, keeps_outputs: bool = False) -> None:
        self.key = key
        self.products: list[Any] = []  # the products' autograd nodes, in the order of their calls
        self.factors: dict[int, Any] = {}  # by id: the mode's node after a product, and the product's node
        self.plannable = True
        self.cuts: list[_Cut] = []
        self.norms: dict[int, Any] = {}  # by id: norms whose every call only held scales taken by one node each
        self.moded: set[int] = set()  # ids of norms with a call that did more: later calls keep their mode
        self.outputs: list[Any] = []  # the nodes of the norms' outputs, in the order of their calls
        self.holds: list[_Hold] = []  # what the mode held without detaching it, in the order of the calls
        self.follows = False  # whether the mode follows what is made of tensors it held (see held_output)
        self.followed: dict[int, torch.Tensor] = {}  # by id: the held tensors and what is made of them
        self.held_alone: dict[int, torch.Tensor] = {}  # by id: the held tensors and what is made of them alone
        self.strayed = False  # whether a held tensor took other values in place: unlike a detached one's
        self.settled = False  # whether the call ended (see FunctionRulePlan.settle)
        self.unruled: list[Any] = []  # sigmoid-like gates' nodes left without their rule (see unruled_gate)
        self.on_node: dict[int, Any] = {}  # by id: modules whose rule went on their output's node (rule_on_node)
        self.applied: set[int] = set()  # ids of modules whose rule acted in their forward in some call
        self.in_forward: set[int] = set()  # ids of modules whose rule's hooks let some call be
        # The outputs of every module, where this call keeps them (see hooked_given); an activation's input that is
        # a module's output, where it does not and would need them.
        self.kept = KeptOutputs(None) if keeps_outputs else None
        self.wants_outputs = False
        self.regions: list[tuple[int | None, int]] = []  # the calls of modules the modes pause in (see note_region)

    def scaled(self, product: Any, factor: Any) -> None:
        """The mode halves the gradient of a product (the uniform rule): ``factor``, a node of its own, passes
        half of it to the product's node ``product``."""
        self.products.append(product)
        self.factors[id(factor)] = product

    def other_rule(self) -> None:
        """The mode applied a rule that is not the uniform rule on a product."""
        self.plannable = False

    def held_output(self, tensor: torch.Tensor) -> None:
        """The mode holds ``tensor`` (a softmax's output, CP-LRP's attention weights) constant without detaching it:
        its node passes no gradient from now on, in this call and in a later one. The mode then follows what the
        call makes of it: a detached tensor needs no gradient, nor does what is made of it alone, while this one
        and what is made of it do (see :func:`~tdhook.attribution.rules.functional.FunctionalRules`)."""
        self.follows = True
        self.made_of_held(tensor, alone=True)
        node = tensor.grad_fn
        node.register_prehook(_cut)
        pass_no_relevance(node, range(len(node.next_functions)))  # what is behind it is not explained
        self.holds.append(_Hold(node, None, len(self.products)))

    def made_of_held(self, tensor: torch.Tensor, alone: bool) -> None:
        """``tensor`` is made of held tensors (``alone``: of them and of constants only, and so a constant too); the
        recording keeps it (its id stands for it) until the call ends."""
        self.followed[id(tensor)] = tensor
        if alone:
            self.held_alone[id(tensor)] = tensor

    def held_factor(self, product: torch.Tensor, factor: torch.Tensor) -> bool:
        """The mode holds ``factor`` (a gate) constant in ``product``, an element-wise product of two activations
        just computed, without detaching it: ``product``'s node passes no gradient to the factor's place, in this
        call and in a later one. ``False``, and nothing done, where that place is not one input of the node."""
        node, edge = product.grad_fn, (factor.grad_fn, factor.output_nr)
        places = [] if node is None else [i for i, next_edge in enumerate(node.next_functions) if next_edge == edge]
        if len(places) != 1 or len(node.next_functions) != 2:
            return False
        return self.scaled_inputs(product, [factor], [0.0], places)

    def held_in_call(self, product: torch.Tensor, factor: torch.Tensor, start: int) -> bool:
        """:meth:`held_factor` for a product whose nodes, from sequence number ``start`` on, take its factors through
        views (a ``matmul``, which torch computes by a ``bmm`` of reshaped factors; MiniMax's lightning attention
        holds its values there): the one node of those that takes ``factor`` passes it no gradient, in this call and
        in a later one. ``False``, and nothing done, where not exactly one place of one such node takes it."""
        node, edge = product.grad_fn, (factor.grad_fn, factor.output_nr)
        if node is None or edge[0] is None:
            return False
        places, stack, seen = [], [node], set()
        while stack:
            current = stack.pop()
            if id(current) in seen:
                continue
            seen.add(id(current))
            for place, next_edge in enumerate(current.next_functions):
                if next_edge == edge:
                    places.append((current, place))
                elif next_edge[0] is not None and next_edge[0]._sequence_nr() >= start:
                    stack.append(next_edge[0])
        if len(places) != 1:
            return False
        return self.scaled_at([(*places[0], factor, 0.0)])

    def scaled_inputs(
        self, output: torch.Tensor, inputs: Sequence[Any], factors: Sequence[float | None], places: Sequence[int]
    ) -> bool:
        """The mode multiplies the gradients that ``output``'s node (just made, as by a plain call) passes to
        ``inputs`` (its inputs at ``places``) by ``factors`` (``0.0``: none, as to a detached input; ``None`` or 1:
        unchanged), without a node of its own, in this call and in a later one. ``False``, and nothing done, where
        an input is not at its place."""
        node = output.grad_fn
        if node is None:
            return False
        return self.scaled_at(
            [(node, place, tensor, factor) for tensor, factor, place in zip(inputs, factors, places, strict=True)]
        )

    def scaled_at(self, places: Sequence[tuple[Any, int, Any, float | None]]) -> bool:
        """:meth:`scaled_inputs` on nodes of a call's graph (a fused attention computed by several nodes): each
        ``(node, place, tensor, factor)`` multiplies the gradient ``node`` passes to ``tensor``, its input at
        ``place``, by ``factor``. ``False``, and nothing done, where an input is not at its place."""
        by_node: dict[int, tuple[Any, list[float | None]]] = {}
        for node, place, tensor, factor in places:
            if factor is None or factor == 1:
                continue
            nexts = node.next_functions
            edge = (tensor.grad_fn, tensor.output_nr) if isinstance(tensor, torch.Tensor) else None
            if edge is None or edge[0] is None or place >= len(nexts) or nexts[place] != edge:
                return False
            by_node.setdefault(id(node), (node, [None] * len(nexts)))[1][place] = float(factor)
        for node, scaled in by_node.values():
            hold = _Hold(node, tuple(scaled), len(self.products))
            node.register_hook(functools.partial(_scale_inputs, hold.factors))
            pass_no_relevance(node, hold.dropped)
            self.holds.append(hold)
        return True

    def hooked(self, node: Any, hook: Any, dropped: Sequence[int] = ()) -> bool:
        """A rule puts its gradient on ``node`` (just made, as by a plain call) by ``hook(node)``, which it can do on
        the same node of a later call, and passes no gradient to its inputs at ``dropped``; the recording does it
        now. ``False``, and nothing done, once the recording is settled (a call that runs again in the mode after it
        puts its rules its own way)."""
        if self.settled:
            return False
        hook(node)
        factors = tuple(0.0 if place in dropped else None for place in range(len(node.next_functions)))
        self.holds.append(_Hold(node, factors, len(self.products), hook))
        return True

    def halved(self, node: Any) -> bool:
        """The uniform rule on a product whose node is ``node`` (just made, as by a plain call: an ``einsum``'s, a
        view), which halves the gradient it is given, in this call and in a later one (see :meth:`hooked`)."""
        return self.hooked(node, _HALVE)

    def hooked_given(self, node: Any, x: torch.Tensor, stabilizer: float) -> bool:
        """The identity rule (stabiliser ``stabilizer``) on ``node``, an activation's of ``x`` that saved its output,
        not ``x`` (``torch.tanh``): where ``x`` is a module's output, which a later call keeps for the rule's factor
        (see :mod:`~tdhook.attribution._kept_outputs`), the recording puts the rule on the node (see
        :meth:`hooked`). ``False``, and nothing done, where ``x`` is no such output (a later call could not find
        it), or where this call keeps no module's outputs (the next recording call on its signature will)."""
        if self.kept is None:
            self.wants_outputs = True
            return False
        module = self.kept.module_of(x)
        if module is None or self.settled:
            return False
        return self.hooked(node, _GivenInput(stabilizer, id(module), module, x))

    def hooked_recomputed(self, node: Any, x: torch.Tensor, stabilizer: float) -> bool:
        """The identity rule (stabiliser ``stabilizer``) on ``node``, an activation's of ``x`` that saved its output,
        not ``x``: where the nodes below compute ``x`` again to the last bit (Gemma 2's softcapping ``tanh``, see
        :mod:`~tdhook.attribution._graph_inputs`), the recording puts the rule on the node (see :meth:`hooked`), and
        a later call computes its ``x`` the same way. ``False``, and nothing done, where they do not."""
        if self.settled:
            return False
        chain = chain_of(x, self.factors)
        return chain is not None and self.hooked(node, _Recomputed(stabilizer, chain, x))

    def rule_on_node(self, module: Any) -> None:
        """``module``'s rule put its gradient on the node of the module's output (see :meth:`hooked`): in a later
        call its hook leaves that to the plan (see :func:`~tdhook.attribution.rules._graph_calls.runs_plain`), and
        the module may run without its hooks (see :mod:`~tdhook.attribution._quiet_modules`), if they had nothing
        else to do in this call."""
        self.on_node[id(module)] = module

    def rule_applied(self, module: Any) -> None:
        """``module``'s rule put its gradient in the module's forward: a module whose rule also went on a node in
        this call (in another of its calls) leaves no plan (later calls could not tell which call is which)."""
        self.applied.add(id(module))

    def rule_in_forward(self, module: Any) -> None:
        """``module``'s rule's hooks let a call of it be (without gradients, a plain call): later calls keep them."""
        self.in_forward.add(id(module))

    def unruled_gate(self, node: Any) -> None:
        """The mode left a sigmoid-like gate made by ``node`` without its rule: where every product that takes the
        gate holds it, no gradient reaches the node, and the rule would change nothing. The plan is made only if no
        output reaches the node (see :meth:`FunctionRulePlan.settle`); else the call runs again in the mode."""
        self.unruled.append(node)

    def read_values(self) -> None:
        """The forward read values computed from the explained inputs into Python (``if x.sum() > 0``,
        ``.item()``): on other inputs of the same shapes it may take another way, whose graph may look the same."""
        self.plannable = False

    def held(self, module: Any, node: Any, inputs: Sequence[torch.Tensor], consumer: Any, index: int) -> None:
        """A norm's mode held a scale (``node`` made it) constant, and the call whose node is ``consumer`` took it,
        with the tensors ``inputs``, as its ``index``-th input with a gradient in a plain call."""
        versions = tuple((tensor, tensor._version) for tensor in inputs)
        self.cuts.append(_Cut(module, node, versions, consumer, index, len(self.products)))

    def norm_done(self, module: Any, plain: bool) -> None:
        """A norm's forward ended: ``plain`` where it did nothing but hold scales that one node each took."""
        if plain:
            self.norms[id(module)] = module
        else:
            self.moded.add(id(module))


class _Plan:
    """The places of a call's products', held scales' and held tensors' nodes in its graph, and the shape of that
    graph (see :mod:`~tdhook.attribution._graph_shape`).

    A later call whose graph has the recorded shape has, at each place of ``hooks``, the node that stands for the
    recorded one: ``hooks`` holds per node its place in the walk of :func:`graph_shape`, its sequence number
    (relative to the first number of the call) and what puts its hook on it. ``plain``: the modules whose rule the
    plan puts on the graph (norms that run without their mode, activations whose rule goes on their node);
    ``quiet``: those of them whose hooks have nothing to do in a later call, which runs them without (the norms'
    calls note their outputs all the same: ``noting``, their ids).
    """

    def __init__(
        self,
        keys: list,
        norm_outputs: int,
        hooks: list[tuple[int, int, Any]],
        nodes: int,
        plain: tuple,
        shape: tuple,
        quiet: tuple = (),
        noting: frozenset = frozenset(),
        kept: tuple = (),
        unread: tuple[int, ...] = (),
        regions: tuple = (),
    ) -> None:
        self.keys = keys  # the keys of the outputs the walk starts from
        # Per call of a module the modes paused in: its id where it starts, ``None`` where it ends, and the number
        # of the next node then (relative to the first of the call): the nodes the mode saw made, and those it did not.
        self.regions = regions
        # The places of the nodes whose backward a later call runs and the mode's never does (see _build): tensors
        # they saved that a branch of a later call changed in place would raise in its backward.
        self.unread = unread
        self.kept = frozenset(id(module) for module in kept)  # modules whose outputs a call keeps (see _GivenInput)
        self.kept_modules = kept
        self.quiet, self.noting = quiet, noting
        self.norm_outputs = norm_outputs  # how many norm outputs the call notes, where the walk starts too
        self.hooks = hooks
        self.nodes = nodes  # how many nodes the call creates
        self.modules = plain  # the modules themselves, kept alive while their ids stand for them
        # The BatchNorms run plainly, and whether each normalised with the batch's statistics (another rule if not).
        self.batch_norms = tuple((norm, normalises_by_batch(norm)) for norm in plain if isinstance(norm, _BatchNorm))
        self.plain = frozenset(id(module) for module in plain)
        self.shape = shape  # the graph's shape (see graph_shape): the same nodes may be another graph
        # Whether the recorded graph holds no node of the batch_norm kernel: one of the same shape holds none either,
        # and a later call's look for such nodes (see late_norm_nodes_laid_out) need not walk it.
        self.without_norm_kernels = BATCH_NORM_KERNEL_NODES.isdisjoint(shape)  # a node's type is one of its entries

    def apply(
        self,
        result: TensorDictBase,
        start: int,
        end: int,
        norm_outputs: list,
        kept: KeptOutputs | None = None,
        activation_outputs: Sequence[tuple[torch.Tensor, int]] = (),
        regions: Sequence[tuple[int | None, int]] = (),
    ) -> bool:
        """Put the hooks on the nodes of the products, held scales and held tensors of a call that created nodes
        ``start`` to ``end``, returned ``result`` and whose norms returned tensors of the nodes ``norm_outputs``,
        the modules of ``self.kept`` their outputs in ``kept``, the activations run without their hooks theirs in
        ``activation_outputs`` (with their versions then), and that noted the calls of modules the modes pause in
        in ``regions`` (see :func:`~tdhook.attribution.rules._graph_calls.note_region`); ``False``, and no hook set,
        where the graph is not the recorded one (a norm's scale on the recorded node, but no norm's call around it:
        a forward called directly, which the mode leaves its plain gradient; an activation's input that is not the
        kept output; a product made in a module the modes pause in, where the recorded one was made outside)."""
        if end - start != self.nodes or len(norm_outputs) != self.norm_outputs or len(regions) != len(self.regions):
            return False
        if any(normalises_by_batch(norm) != batch for norm, batch in self.batch_norms):
            return False  # a BatchNorm in training mode since an eval-mode recording: the same nodes, another rule
        for (key, number), recorded in zip(regions, self.regions, strict=True):
            if (key, number - start) != recorded:
                return False
        try:
            roots = [result.get(key, None).grad_fn for key in self.keys] + norm_outputs
        except AttributeError:  # an output the recorded call returned is gone
            return False
        walked: list[Any] = []
        if graph_shape(roots, walked=walked) != self.shape:
            return False  # a branch fed a product a constant, or a held gate to a product that does not hold it
        for place in self.unread:
            if not _saved_readable(walked[place]):
                return False  # a tensor saved behind a held one, changed in place since: the mode's graph has none
        hooked = []
        for place, offset, attach in self.hooks:
            node = walked[place]
            if node._sequence_nr() - start != offset:
                return False
            if isinstance(attach, _OnNode) and not _saved_readable(node):
                return False
            if type(attach) is _OnNode and type(attach.hook) in (_GivenInput, _Recomputed):
                attach = attach.hook.given(node, kept)
                if attach is None:
                    return False
            elif activation_outputs and type(attach) is _OnNode and type(attach.hook) is PassRuleOnNode:
                attach = attach.hook.given(node, activation_outputs)
            hooked.append((node, attach))
        for node, attach in hooked:
            attach(node)
        if self.without_norm_kernels:
            for root in roots[: len(self.keys)]:
                if root is not None:
                    root.metadata[NO_NORM_KERNEL_BELOW] = True
        return True


def _pre_hook(hook: Any) -> Any:
    """What puts ``hook`` on a node as a pre-hook."""
    return lambda node: node.register_prehook(hook)


def _post_hook(hook: Any) -> Any:
    """What puts ``hook`` on a node as a post-hook."""
    return lambda node: node.register_hook(hook)


def _scale_inputs(factors: tuple, grad_inputs: tuple, grad_outputs: tuple) -> tuple:
    """A node's gradients to its inputs times ``factors``: none where the factor is 0 (as none reaches a detached
    input), unchanged where it is ``None``; as the mode's ``grad * factor`` elsewhere."""
    return tuple(
        grad if factor is None or grad is None else None if factor == 0.0 else grad * factor
        for grad, factor in zip(grad_inputs, factors, strict=True)
    )


def _halve(grads: tuple) -> tuple:
    """The uniform rule on a product's node: half of its gradient (as the mode's ``grad * 0.5``)."""
    grad = grads[0]
    return grads if grad is None else (grad * 0.5, *grads[1:])


def _cut(grads: tuple) -> tuple:
    """A held scale's node: no gradient (as none reaches a detached scale); the nodes behind it get none either."""
    return (None, *grads[1:])


_HALVE, _CUT = _pre_hook(_halve), _pre_hook(_cut)


class FunctionRulePlan:
    """One wrapper's plans, by the signature of the inputs of the call that recorded them (see the module).

    Not shared between threads: the wrapper runs one call at a time.
    """

    def __init__(self, own_hook_ids: Collection[int] = (), hidden: set[int] | None = None) -> None:
        self._plans: dict[Hashable, _Plan | None] = {}
        self.quiet = QuietModules(own_hook_ids)  # runs the modules of a plan's ``quiet`` without the hooks
        # Keep modules' outputs for activations' rules; ``hidden``: the ids of hooks that copies leave out.
        self.keepers = OutputKeepers(set() if hidden is None else hidden)
        self._keeping: set[Hashable] = set()  # signatures whose recording calls keep every module's outputs
        self._changed: set[Hashable] = set()  # signatures whose graph differed from their plan's once

    def remove(self) -> None:
        """Put every module run without its hooks back on torch's way, and remove the hooks that keep outputs
        (a hook handle's interface: the context lists the plan with its hooks)."""
        self.quiet.remove()
        self.keepers.remove()

    def __reduce__(self) -> tuple:
        """A copy or a pickle (of a wrapper, after its context) starts with no plan: the plans are their context's
        own, and hold autograd node types, which do not pickle."""
        return FunctionRulePlan, ()

    @staticmethod
    def sequence_number() -> int:
        """The number autograd gives the next node this thread creates."""
        return _sequence_number()

    def usable(self, key: Hashable) -> _Plan | None:
        """The plan for a call on inputs of signature ``key``, if one was recorded."""
        return self._plans.get(key)

    def recorder(self, key: Hashable) -> Recording | None:
        """A recording for a call in the mode on inputs of signature ``key``, where a plan may come of it."""
        if key in self._plans:
            return None if self._plans[key] is None else Recording(key, key in self._keeping)  # None: the mode
        return Recording(key, key in self._keeping) if len(self._plans) < _MOST_PLANS else None

    def settle(self, recording: Recording, result: TensorDictBase, start: int) -> bool:
        """After a call in the mode that completed and returned ``result``: the plan for its signature (``None``:
        the mode for good). ``False`` where the call held tensors without detaching them and its graph saved a
        tensor that was changed in place since (its backward would raise), or a held tensor took other values in
        place (a detached one would then be another activation): the call must run again in the mode with no
        recording."""
        end = _sequence_number()
        recording.settled = True
        intact = not recording.holds or _saved_intact(result, recording.outputs)
        plan = _build(recording, result, start, end) if recording.plannable and intact else None
        # A gate left without its rule that a gradient reaches (or may: no plan was made) needs the rule.
        if recording.strayed or not intact or (recording.unruled and plan in (None, _GATE_REACHED)):
            self._plans[recording.key] = None
            return False
        if recording.wants_outputs and recording.key not in self._keeping:
            # An activation's input may be a module's output: the next call records again, keeping them all.
            self._keeping.add(recording.key)
            self._plans.pop(recording.key, None)
            return True
        if isinstance(plan, _Plan) and plan.kept:
            self.keepers.keep(plan.kept_modules)
        self._plans[recording.key] = plan
        return True

    def forget(self, key: Hashable) -> None:
        """Drop the plan for ``key``, whose call's graph was another: the next call records again; the second
        time, the mode for good (a graph that changes from call to call would run every forward pass twice)."""
        if key in self._changed:
            self._plans[key] = None
        else:
            self._changed.add(key)
            self._plans.pop(key, None)


# What _build returns where an output reaches a gate the recording left without its rule.
_GATE_REACHED = object()


def _build(recording: Recording, result: TensorDictBase, start: int, end: int) -> _Plan | None | object:
    """The plan of a recorded call: a breadth-first walk from the outputs in ``result`` to every product's node and
    held scale's node."""
    keyed = [
        (key, value)
        for key, value in result.items(True, True)
        if isinstance(value, torch.Tensor) and value.grad_fn is not None
    ]
    keys, outputs = [key for key, _ in keyed], [value for _, value in keyed]
    wanted = {id(node): position for position, node in enumerate(recording.products)}
    if len(wanted) != len(recording.products) or any(key in recording.applied for key in recording.on_node):
        return None  # a module whose rule went on its node in one call and acted in its forward in another
    norms = {key: module for key, module in recording.norms.items() if key not in recording.moded}
    cuts = [cut for cut in recording.cuts if id(cut.module) in norms]
    # A held scale's node is no next function of its consumer in the mode's graph: a plain call's has it there.
    # Nothing behind it, nor behind a held tensor's node or a held factor's place, gets a gradient.
    held = {id(cut.node) for cut in cuts} | {id(hold.node) for hold in recording.holds if hold.factors is None}
    dropped = {(id(hold.node), place) for hold in recording.holds for place in hold.dropped}
    extra: dict[int, dict[int, Any]] = {}
    for cut in cuts:
        extra.setdefault(id(cut.consumer), {})[cut.index] = cut.node
    # Breadth first: the shortest path to each node, through the node first reached.
    parents: dict[int, tuple[int | None, int, Any]] = {}  # id -> (parent id, index, node)
    queue: list[Any] = []
    factors = recording.factors
    # The paths start from the outputs and from the norms' outputs (the shortest then take a few steps each): a scale
    # is then found through the call of its norm, which a later call notes, quiet or not.
    for index, root in enumerate([output.grad_fn for output in outputs] + recording.outputs):
        node = factors.get(id(root), root)  # a plain call's graph has the product's node there
        if node is not None and id(node) not in parents:
            parents[id(node)] = (None, index, node)
            queue.append(node)
    for node in queue:  # grows while it is read
        if id(node) in held:
            continue  # what is behind a scale is no part of the mode's graph
        scales = extra.get(id(node), {})
        for index, (child, _) in enumerate(node.next_functions):
            if dropped and (id(node), index) in dropped:
                continue
            child = scales.get(index) if child is None else factors.get(id(child), child)
            if child is not None and id(child) not in parents:
                parents[id(child)] = (id(node), index, child)
                queue.append(child)
    if any(id(node) in parents for node in recording.unruled):
        return _GATE_REACHED
    # A product or a held tensor that no output reaches but through a held one gets no gradient: it needs no hook.
    products = [(position, node) for position, node in enumerate(recording.products) if id(node) in parents]
    holds = [hold for hold in recording.holds if id(hold.node) in parents]
    # A norm keeps its mode where a scale's node is on no path from the outputs, where its consumer's inputs were
    # changed in place after the call, or where the scale's branch saved tensors that were (a plain call runs the
    # consumer's backward towards the scale, and the branch's with no gradient: they would raise).
    for cut in cuts:
        changed = any(tensor._version != version for tensor, version in cut.inputs)
        if changed or id(cut.node) not in parents or not _branch_intact(cut.node, parents):
            norms.pop(id(cut.module), None)
    cuts = [cut for cut in cuts if id(cut.module) in norms]
    if not products and not cuts and not holds:
        return None  # nothing to gain
    # Each earlier product added a node of the mode's own (its gradient's factor), which a plain call lacks.
    targets = {id(node): (position, _HALVE) for position, node in products}
    targets |= {id(cut.node): (cut.earlier, _CUT) for cut in cuts}
    targets |= {id(hold.node): (hold.earlier, _hold_hook(hold)) for hold in holds}
    nodes = end - start - len(recording.products)
    # The norms that run plainly and the activations whose rule goes on their node run without their hooks (but
    # those of activations whose hooks let a call be).
    # The modules whose outputs are activations' inputs keep their hooks, which keep those outputs.
    given = [hold.hook for hold in holds if type(hold.hook) is _GivenInput]
    if any(recording.kept.output(hook.module) is not hook.x for hook in given):
        return None  # the module returned another output after the one the activation took: a later call keeps that
    kept = {hook.module: hook.holder for hook in given}
    quiet = tuple(module for key, module in recording.on_node.items() if key not in recording.in_forward | set(kept))
    on_node = tuple(recording.on_node.values())
    plain = (*norms.values(), *on_node)
    quiet = (*(module for key, module in norms.items() if key not in kept), *quiet)
    # The shape of the graph a plain call leaves: the scales of the norms that run plainly are their consumers' inputs.
    scales: dict[int, dict[int, Any]] = {}
    for cut in cuts:
        scales.setdefault(id(cut.consumer), {})[cut.index] = cut.node
    walked: list[Any] = []
    shape = graph_shape([output.grad_fn for output in outputs] + recording.outputs, factors, scales, walked)
    # The walk reaches every node of the paths above (it skips no node behind a held one, nor a dropped input).
    places = {id(node): place for place, node in enumerate(walked)}
    hooks = [
        (places[key], parents[key][2]._sequence_nr() - start - earlier, attach)
        for key, (earlier, attach) in targets.items()
    ]
    kept_modules = tuple(kept.values())
    # A later call runs the backward of the nodes behind a held tensor, a cut scale or an input that gets no gradient,
    # and of the calls that take a cut scale (which save their other input for it): the mode's graph has none of them
    # (or takes a detached scale), and a branch this call did not take may change what they saved in place.
    unreached = {*held, *(id(cut.consumer) for cut in cuts)}
    unread = tuple(
        place
        for place, node in enumerate(walked)
        if (id(node) not in parents or id(node) in unreached) and _saved_names(type(node))
    )
    regions = tuple((key, number - start) for key, number in recording.regions)
    return _Plan(
        keys, len(recording.outputs), hooks, nodes, plain, shape, quiet, frozenset(norms), kept_modules, unread, regions
    )


class _OnNode(NamedTuple):
    """A rule's own hook on a node whose backward the function mode never runs (a fused layer norm's, an
    activation's): a later call puts it there only where that backward can run, none of the tensors the node saved
    changed in place since (a branch the recording call did not take may change one in a graph of the same shape)."""

    hook: Any

    def __call__(self, node: Any) -> None:
        self.hook(node)


class _GivenInput(NamedTuple):
    """The identity rule on the node of an activation that saved its output, not its input (``torch.tanh``): its
    input ``x`` is the output of the module whose id is ``module``, which a later call keeps (see
    :class:`~tdhook.attribution.rules._graph_calls.KeptOutputs`). ``holder`` and ``x`` are the recording call's (the
    ids stand for them while the plan is made)."""

    stabilizer: float
    module: int
    holder: Any
    x: torch.Tensor

    def __call__(self, node: Any) -> None:
        """The rule in the recording call, from its own input."""
        hook_pass_rule_given(self.stabilizer, self.x, node)

    def given(self, node: Any, kept: KeptOutputs | None) -> Any:
        """What puts the rule on ``node``, an activation's node of a later call, from its module's kept output;
        ``None`` where that output is not the node's input, or was changed in place since the module returned it."""
        x = None if kept is None else kept.output(self.module)
        if x is None or not first_input_is(node, x):
            return None
        return functools.partial(hook_pass_rule_given, self.stabilizer, x)


class _Recomputed(NamedTuple):
    """The identity rule on the node of an activation that saved its output, not its input ``x``, which the nodes
    below compute again by ``chain`` (see :mod:`~tdhook.attribution._graph_inputs`). ``x`` is the recording call's."""

    stabilizer: float
    chain: tuple[str, ...]
    x: torch.Tensor | None

    def __call__(self, node: Any) -> None:
        """The rule in the recording call, from its own input."""
        hook_pass_rule_given(self.stabilizer, self.x, node)

    def given(self, node: Any, kept: KeptOutputs | None) -> Any:
        """What puts the rule on ``node``, an activation's node of a later call, from its input computed again;
        ``None`` where the nodes below are not the chain's."""
        x = computed_again(node, self.chain, node._saved_result.shape)
        return None if x is None else functools.partial(hook_pass_rule_given, self.stabilizer, x)


def _hold_hook(hold: _Hold) -> Any:
    """What puts a hold's hook on its node in a later call."""
    if type(hold.hook) is _GivenInput:  # the plan keeps no tensor of the recording call
        return _OnNode(hold.hook._replace(holder=None, x=None))
    if type(hold.hook) is _Recomputed:
        return _OnNode(hold.hook._replace(x=None))
    if hold.hook is not None:
        return _OnNode(hold.hook)
    return _CUT if hold.factors is None else _post_hook(functools.partial(_scale_inputs, hold.factors))


def _saved_intact(result: TensorDictBase, norm_outputs: list) -> bool:
    """Whether every node of a call's graph, from its outputs in ``result`` and from its norms' outputs, can run
    its backward: none of the tensors it saved was changed in place since."""
    roots = [value.grad_fn for value in result.values(True, True) if isinstance(value, torch.Tensor)]
    return _branch_intact(None, {}, roots + norm_outputs)


def _branch_intact(node: Any, graph: dict, roots: Sequence[Any] = ()) -> bool:
    """Whether the backward of ``node`` (or of the ``roots``) and of the nodes behind it that are not in ``graph``
    can run: none of the tensors they saved was changed in place since (reading a saved tensor checks its
    version)."""
    stack, seen = [node, *roots], set()
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen or (current is not node and id(current) in graph):
            continue
        seen.add(id(current))
        if not _saved_readable(current):
            return False
        stack.extend(child for child, _ in current.next_functions)
    return True


def _saved_readable(node: Any) -> bool:
    """Whether ``node`` can run its backward: none of the tensors it saved was changed in place since (reading a
    saved tensor checks its version)."""
    for name in _saved_names(type(node)):
        try:
            getattr(node, name)
        except RuntimeError:
            return False
    return True


@functools.cache
def _saved_names(kind: type) -> tuple[str, ...]:
    """The attributes through which a node of type ``kind`` gives the tensors and values it saved."""
    return tuple(name for name in dir(kind) if name.startswith("_saved_"))
