"""Position and token-type ids given to Hugging Face models among the explained keys (the module's ``in_keys``, taken
by default): an embedding that looks them up shifted by a constant (OPT's learned positions) stands in for them, one
that reads a mask and looks up positions counted from it is refused, and ids that no embedding reads (rotary
positions, turned into the cos and sin that scale queries and keys) hold no share and are named by nothing."""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tdhook.attribution import LRP
from tdhook.attribution._offset_ids import offset_of, rows_elsewhere
from tests.attribution.test_lrp_transformer_zoo import PRESETS, ZOO, zero_additive
from tests.conftest import relative_error

pytest.importorskip("transformers")

BATCH, TOKENS = 2, 7
CONSERVATION_TOLERANCE = 1e-6
# Left-padded-like positions for the first sample, plain ones for the second.
POSITIONS = torch.tensor([[0, 0, 0, 1, 2, 3, 4], list(range(TOKENS))])
TOKEN_TYPES = torch.tensor([[0, 0, 0, 1, 1, 1, 1]] * BATCH)


class Called(nn.Module):
    """A model called with its integer inputs by keyword; the next-token (or class) logits."""

    def __init__(self, model: nn.Module, names: list[str]) -> None:
        super().__init__()
        self.model = model
        self.names = names

    def forward(self, *values: torch.Tensor) -> torch.Tensor:
        logits = self.model(**dict(zip(self.names, values, strict=True))).logits
        return logits[:, -1] if logits.dim() == 3 else logits


def _zero_biases(model: nn.Module) -> None:
    """Biases zeroed, learned position and token-type tables kept: their share must reach their keys."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "bias" in name:
                param.zero_()


def _inputs(keys: list[str]) -> TensorDict:
    ids = torch.randint(3, 60, (BATCH, TOKENS), generator=torch.Generator().manual_seed(0))
    given = {"input_ids": ids, "position_ids": POSITIONS.clone(), "token_type_ids": TOKEN_TYPES.clone()}
    given["attention_mask"] = torch.ones(BATCH, TOKENS, dtype=torch.long)
    return TensorDict({key: given[key] for key in keys}, batch_size=[BATCH])


def _explained(model: nn.Module, keys: list[str], preset: str, in_keys: list[str] | None = None) -> tuple:
    """The call's output TensorDict and the warnings it gave, every key of ``keys`` given to the model."""
    module = TensorDictModule(Called(model, keys), keys, ["y"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = LRP(module, PRESETS[preset](), in_keys=in_keys)(_inputs(keys))
    return out, [str(w.message) for w in caught]


def _conservation_error(out: TensorDict, keys: list[str]) -> float:
    """The largest ``|Σ relevance − logit| / |logit|`` over the batch, the relevance of every key written summed."""
    logit = out["y"].gather(1, out["y"].argmax(1, keepdim=True)).squeeze(1)
    written = [out["relevance", key] for key in keys if ("relevance", key) in out.keys(True)]
    total = sum(relevance.flatten(1).sum(1) for relevance in written)
    return ((total - logit).abs() / logit.abs()).max().item()


class _GivenPositions(nn.Module):
    """OPT fed its word embeddings and its position embeddings as floating-point inputs: the latter replace the output
    of its learned positions (a forward hook), so that plain input × gradient gives their relevance."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self._positions: torch.Tensor | None = None
        model.model.decoder.embed_positions.register_forward_hook(lambda *_: self._positions)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self._positions = positions
        try:
            return self.model(inputs_embeds=embeds, position_ids=POSITIONS).logits[:, -1]
        finally:
            self._positions = None


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_opt_position_ids_given_by_default_get_the_relevance_of_their_learned_positions(preset: str):
    """OPT's learned positions are an ``nn.Embedding`` called as ``embed_positions(mask, past, position_ids=ids)``,
    whose forward looks up ``ids + 2``: with ``position_ids`` among the module's in_keys (explained by default) the
    call was refused with a TypeError saying the ids index the table "outside an nn.Embedding", where GPT-2 and BERT
    explain theirs. The position ids now get the relevance of their rows: under CP-LRP, with biases zeroed and the
    table kept, the relevance of ids and positions sums to the logit (the positions held about half of it), each
    matches float inputs' input × gradient with the positions fed as embeddings, and the relevance of the ids is the
    one explaining them alone gives."""
    model = ZOO["opt"].build("eager")
    _zero_biases(model)
    keys = ["input_ids", "position_ids"]
    out, caught = _explained(model, keys, preset)
    assert caught == []
    assert out["relevance", "position_ids"].shape == POSITIONS.shape
    if preset == "cplrp":
        assert _conservation_error(out, keys) <= CONSERVATION_TOLERANCE
        assert out["relevance", "position_ids"].sum(1).abs().min() > 0.1 * out["y"].max(1).values.abs().min()
    alone, _ = _explained(model, keys, preset, in_keys=["input_ids"])
    assert relative_error(out["relevance", "input_ids"], alone["relevance", "input_ids"]) <= 1e-12

    decoder = model.model.decoder
    with torch.no_grad():
        embeds = decoder.embed_tokens(out["input_ids"])
        positions = decoder.embed_positions.weight[POSITIONS + decoder.embed_positions.offset]
    floats = TensorDictModule(_GivenPositions(model), ["embeds", "positions"], ["y"])
    given = TensorDict(embeds=embeds, positions=positions, batch_size=[BATCH])
    oracle = LRP(floats, PRESETS[preset]())(given)
    assert torch.equal(oracle["y"], out["y"])
    for key, float_key in (("input_ids", "embeds"), ("position_ids", "positions")):
        expected = oracle["relevance", float_key].sum(-1)
        assert relative_error(out["relevance", key], expected) <= 1e-10, key


def test_opt_positions_counted_from_an_attention_mask_explained_by_default_are_refused_naming_it():
    """OPT called without position ids counts them from the attention mask inside its learned positions, which read
    the mask as their input: the mask (explained by default) took the relevance of the position rows as its own
    (0.15 of a logit of 0.21, conserved but credited to a mask). That lookup of ids computed from the mask is refused
    as the same lookup outside the embedding is (GPT-2's and BERT's positions counted from a mask), naming the mask
    and the module."""
    model = ZOO["opt"].build("eager")
    _zero_biases(model)
    with pytest.raises(ValueError) as raised:
        _explained(model, ["input_ids", "attention_mask"], "cplrp")
    message = str(raised.value)
    assert "input key 'attention_mask' reaches 'module.model.model.decoder.embed_positions'" in message
    assert "'attention_mask' holds only zeros and ones, as a mask does" in message


def test_opt_given_its_attention_mask_and_position_ids_explains_the_positions_and_not_the_mask():
    """With both given and explained by default, the learned positions read the mask as their input and look up the
    position ids: the ids take the rows' relevance, the mask none (no relevance written for it), and under CP-LRP the
    relevance of ids and positions sums to the logit."""
    model = ZOO["opt"].build("eager")
    _zero_biases(model)
    keys = ["input_ids", "attention_mask", "position_ids"]
    out, caught = _explained(model, keys, "cplrp")
    assert caught == []
    assert ("relevance", "attention_mask") not in out.keys(True)
    assert _conservation_error(out, keys) <= CONSERVATION_TOLERANCE
    assert out["relevance", "position_ids"].sum(1).abs().min() > 0.1 * out["y"].max(1).values.abs().min()


@pytest.mark.parametrize(
    ("name", "keys"),
    [("gpt2", ["input_ids", "position_ids"]), ("bert", ["input_ids", "token_type_ids", "position_ids"])],
)
def test_learned_position_and_token_type_ids_given_by_default_take_their_share(name: str, keys: list[str]):
    """GPT-2's and BERT's position and token-type ids are read by an ``nn.Embedding``: with biases zeroed and the
    tables kept, the relevance of every key sums to the logit under CP-LRP, nothing named."""
    model = ZOO[name].build("eager")
    _zero_biases(model)
    out, caught = _explained(model, keys, "cplrp")
    assert caught == []
    assert _conservation_error(out, keys) <= CONSERVATION_TOLERANCE


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma", "gpt_neox"])
def test_rotary_position_ids_given_by_default_hold_no_share_and_are_named_by_nothing(name: str):
    """Rotary position ids become the cos and sin that scale queries and keys: constants of the call (gates), so the
    products' relevance goes whole to the queries and keys. With ``position_ids`` among the explained keys, nothing is
    named, no relevance is written for them, the token ids' relevance is the one explaining them alone gives, and
    under CP-LRP (biases zeroed) it sums to the logit."""
    model = ZOO[name].build("eager")
    zero_additive(model)
    keys = ["input_ids", "position_ids"]
    out, caught = _explained(model, keys, "cplrp")
    assert caught == []
    assert ("relevance", "position_ids") not in out.keys(True)
    assert _conservation_error(out, keys) <= CONSERVATION_TOLERANCE
    alone, _ = _explained(model, keys, "cplrp", in_keys=["input_ids"])
    assert relative_error(out["relevance", "input_ids"], alone["relevance", "input_ids"]) <= 1e-12


class _Shifted(nn.Embedding):
    """An embedding called with a mask as its input and the ids by keyword, looking its table up at ``f(ids)``."""

    def __init__(self, shift: object) -> None:
        super().__init__(16, 4, dtype=torch.float64)
        self.shift = shift

    def forward(self, mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(self.shift(position_ids))


class _Positions(nn.Module):
    def __init__(self, shift: object) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.positions = _Shifted(shift)
        self.head = nn.Linear(4, 1, bias=False, dtype=torch.float64)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(x + self.positions(torch.ones_like(position_ids), position_ids=position_ids)))


def _positions_call(shift: object) -> TensorDict:
    x = torch.randn(3, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    td = TensorDict(x=x, position_ids=torch.arange(5).expand(3, 5).clone(), batch_size=[3])
    module = TensorDictModule(_Positions(shift), ["x", "position_ids"], ["y"])
    return LRP(module, PRESETS["cplrp"](), target=lambda y: y)(td)


def test_ids_looked_up_shifted_by_a_constant_inside_their_embedding_stand_in_for_them():
    """The relevance of ids looked up at ``ids + 3`` is that of their rows, as if read directly: with LRP-0 through
    the head and ReLU, the relevances of the two keys sum to the output."""
    out = _positions_call(lambda ids: ids + 3)
    total = out["relevance", "x"].sum((1, 2)) + out["relevance", "position_ids"].sum(1)
    assert relative_error(total, out["y"].sum((1, 2))) <= 1e-12


@pytest.mark.parametrize("shift", [lambda ids: ids.flip(-1), lambda ids: 2 * ids], ids=["flipped", "doubled"])
def test_ids_looked_up_out_of_place_inside_an_embedding_are_still_refused(shift: object):
    """Ids looked up reordered (``ids.flip(-1)``) or by a map that is not a shift (``2 * ids``) would put a row's
    relevance at another position or is not a lookup of the ids themselves: the call is refused as before."""
    with pytest.raises((TypeError, ValueError), match="'position_ids'"):
        _positions_call(shift)


def test_offset_of_finds_the_shift_only_where_every_row_fits():
    """``offset_of`` returns the constant a whole lookup is shifted by; not one that fits the first row alone."""
    embedding = nn.Embedding(10, 3, dtype=torch.float64)
    ids = torch.tensor([[1, 2], [4, 0]])
    assert offset_of(embedding, ids, embedding(ids + 5)) == 5
    assert offset_of(embedding, ids, embedding(ids)) == 0
    wrong = embedding(ids + 5).detach().clone()
    wrong[1, 1] = embedding.weight[0].detach()
    assert offset_of(embedding, ids, wrong) is None
    assert offset_of(embedding, ids, 2 * embedding(ids + 5)) is None


class _CountedOps(TorchDispatchMode):
    """Counts the operators dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.count += 1
        return func(*args, **(kwargs or {}))


def _ops_of_rows_elsewhere(embedding: nn.Embedding, output: torch.Tensor) -> tuple[bool, int]:
    with _CountedOps() as counted:
        found = rows_elsewhere(embedding, "positions", 0, output, [], [])
    return found, counted.count


def test_rows_elsewhere_checks_the_rows_against_the_table_in_a_number_of_operations_independent_of_the_rows():
    """Whether the output is rows of the table is judged at once: it compared every row with the whole table in turn
    (three operators and a device sync per row: 48 s for OPT-125m's positions read by a mask of 8 x 512 tokens, on
    every call explaining its attention mask). Rows of the table are found, a row off by one ulp or of another
    table is not, and 512 rows take no more operators than 2."""
    embedding = nn.Embedding(40, 6, dtype=torch.float64)
    ids = torch.randint(0, 40, (4, 128), generator=torch.Generator().manual_seed(0))
    rows = embedding(ids).detach()
    few, few_ops = _ops_of_rows_elsewhere(embedding, rows[:1, :2])
    many, many_ops = _ops_of_rows_elsewhere(embedding, rows)
    assert few and many
    assert many_ops <= few_ops
    off = rows.clone()
    off[2, 5, 3] = torch.nextafter(off[2, 5, 3], torch.tensor(float("inf"), dtype=torch.float64))
    assert not rows_elsewhere(embedding, "positions", 0, off, [], [])
    other = nn.Embedding(40, 6, dtype=torch.float64)
    assert not rows_elsewhere(embedding, "positions", 0, other(ids).detach(), [], [])


class _Moved(nn.Embedding):
    """An embedding that looks its ids up and returns the rows moved to other positions."""

    def __init__(self, move: object) -> None:
        super().__init__(20, 4, dtype=torch.float64)
        self.move = move

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.move(super().forward(ids))


@pytest.mark.parametrize(
    "move",
    [lambda rows: rows.flip(1), lambda rows: rows[:, :1].expand_as(rows)],
    ids=["reversed", "first-broadcast"],
)
def test_an_embedding_returning_its_rows_at_other_positions_is_refused_naming_it(move: object):
    """Rows of the table returned at other positions than their ids' (reversed, the first one broadcast) stood in for
    the ids position for position: each token took the relevance of another token's row, the sum still conserved.
    The call is refused naming the key and the module."""
    torch.manual_seed(0)
    module = nn.Sequential(_Moved(move), nn.ReLU(), nn.Linear(4, 1, bias=False, dtype=torch.float64))
    ids = torch.randint(0, 20, (3, 5), generator=torch.Generator().manual_seed(2))
    explained = TensorDictModule(module, ["ids"], ["y"])
    with pytest.raises(ValueError, match="input key 'ids' reaches '.*0' \\(_Moved\\)"):
        LRP(explained, PRESETS["cplrp"](), target=lambda y: y)(TensorDict(ids=ids, batch_size=[3]))
