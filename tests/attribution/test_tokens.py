"""Integer tokens read by an ``nn.EmbeddingBag``: each token gets the relevance of its embedding row in the bag.

The oracle is LRP-0 with the gathered embedding rows as the inputs: a token's relevance is its row times the
gradient the row receives through the bag's reduction (sum, mean or max, with per-sample weights held as
constants), summed over the features.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from tensordict import LazyStackedTensorDict, TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.mappers.base import BaseRuleMapper
from tdhook.attribution.rules.basic import EpsilonRule
from tests.conftest import relative_error

F64 = torch.float64


class BagNet(nn.Module):
    """An ``nn.EmbeddingBag`` over the tokens of each sample, then a small head."""

    def __init__(self, mode: str, padding_idx: int | None = None, weighted: bool = False) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(11, 6, mode=mode, padding_idx=padding_idx)
        self.head = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
        self.weighted = weighted

    def weights(self, tokens: torch.Tensor) -> torch.Tensor | None:
        return torch.linspace(0.5, 2.0, tokens.numel(), dtype=F64).view_as(tokens) if self.weighted else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.bag(tokens, per_sample_weights=self.weights(tokens)))


def bagged_rows(net: BagNet, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows the bag gathers for ``tokens`` (a leaf), and the bag's output computed from them."""
    rows = net.bag.weight.detach()[tokens].requires_grad_(True)
    index = torch.arange(tokens.numel()).view_as(tokens)
    if net.bag.padding_idx is not None:
        index = torch.where(tokens == net.bag.padding_idx, tokens.numel(), index)
    table = torch.cat([rows.reshape(-1, rows.shape[-1]), rows.new_zeros(1, rows.shape[-1])])
    weights = net.weights(tokens)
    bagged = F.embedding_bag(index, table, mode=net.bag.mode, per_sample_weights=weights, padding_idx=tokens.numel())
    return rows, bagged


def expected_token_relevance(net: BagNet, tokens: torch.Tensor) -> torch.Tensor:
    """LRP-0 of the head with the gathered rows as inputs, summed over the features."""
    rows, bagged = bagged_rows(net, tokens)
    out = net.head(bagged)
    one_hot = torch.zeros_like(out).scatter_(-1, out.argmax(-1, keepdim=True), 1.0)
    (grad,) = torch.autograd.grad(out, rows, one_hot)
    return (rows.detach() * grad).sum(-1)


def explain(net: nn.Module, tokens: torch.Tensor) -> TensorDict:
    """LRP-0 on the Linear layers, with a strict mapper: the bag is covered, no warning is raised."""
    mapper = BaseRuleMapper(rule_mapper={nn.Linear: EpsilonRule(0.0)}, strict=True)
    lrp = LRP(TensorDictModule(net, in_keys=["tokens"], out_keys=["logits"]), rule_mapper=mapper)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return lrp(TensorDict(tokens=tokens, batch_size=tokens.shape[:1]))


class TestEmbeddingBag:
    @pytest.mark.parametrize(
        ("mode", "padding_idx", "weighted"),
        [("sum", None, False), ("mean", None, False), ("max", None, False), ("sum", None, True), ("mean", 0, False)],
        ids=["sum", "mean", "max", "sum-weighted", "mean-padding"],
    )
    def test_token_relevance_is_that_of_its_row_in_the_bag(self, mode: str, padding_idx: int | None, weighted: bool):
        torch.manual_seed(0)
        net = BagNet(mode, padding_idx, weighted).double()
        tokens = torch.randint(0, 11, (4, 5))
        tokens[:, -1] = 0  # the padding token, where there is one: no relevance
        before = {k: v.clone() for k, v in net.state_dict().items()}
        td = explain(net, tokens)
        relevance = td["relevance", "tokens"]
        assert relevance.shape == tokens.shape and relevance.dtype == F64
        assert relative_error(relevance, expected_token_relevance(net, tokens)) <= 1e-12
        if padding_idx is not None:
            assert torch.all(relevance[:, -1] == 0)
        assert torch.equal(td["logits"], net(tokens))
        assert all(torch.equal(v, net.state_dict()[k]) for k, v in before.items())

    def test_conserves_the_logit_without_biases(self):
        torch.manual_seed(0)
        net = BagNet("sum").double()
        for layer in (net.head[0], net.head[2]):
            layer.bias = None
        tokens = torch.randint(0, 11, (3, 6))
        relevance = explain(net, tokens)["relevance", "tokens"]
        logits = net(tokens)
        torch.testing.assert_close(relevance.sum(-1), logits.max(-1).values, rtol=1e-10, atol=1e-12)

    @pytest.mark.parametrize("include_last_offset", [False, True])
    def test_flat_tokens_with_offsets_equal_the_batched_bag(self, include_last_offset: bool):
        class OffsetBag(BagNet):
            def forward(self, tokens: torch.Tensor) -> torch.Tensor:
                flat = tokens.flatten()
                offsets = torch.arange(0, flat.numel() + include_last_offset, tokens.shape[1])
                return self.head(self.bag(flat, offsets=offsets))

        torch.manual_seed(0)
        net = OffsetBag("mean").double()
        net.bag.include_last_offset = include_last_offset
        tokens = torch.randint(0, 11, (3, 4))
        relevance = explain(net, tokens)["relevance", "tokens"]
        assert relevance.shape == tokens.shape
        assert relative_error(relevance, expected_token_relevance(net, tokens)) <= 1e-12


def bag_rows_relevance(net: BagNet, tokens: torch.Tensor, relevance_out: torch.Tensor) -> torch.Tensor:
    """The relevance ``relevance_out`` at the bag's output handed to its tokens by LRP-0 through the reduction (each
    row its share ``row · ∂out/∂row · R / out``), summed over the features."""
    rows, bagged = bagged_rows(net, tokens)
    ratio = torch.where(bagged != 0, relevance_out / bagged.detach().where(bagged != 0, 1.0), 0.0)
    (grad,) = torch.autograd.grad(bagged, rows, ratio)
    return (rows.detach() * grad).sum(-1)


@pytest.mark.parametrize(
    ("mode", "padding_idx", "weighted"),
    [("sum", None, False), ("mean", None, False), ("max", None, False), ("sum", None, True), ("mean", 0, False)],
    ids=["sum", "mean", "max", "sum-weighted", "mean-padding"],
)
def test_a_first_layer_rule_after_the_bag_equals_zennits_passed_to_the_tokens(mode, padding_idx, weighted):
    """EpsilonPlusFlat puts Flat on the Linear layer after the bag, whose relevance is carried back to the tokens
    through the bag by differentiating its backward again: torch's ``_embedding_bag_backward`` has no derivative, and
    every call raised its ``NotImplementedError``. The tokens get zennit's EpsilonPlusFlat relevance at the bag's
    output, shared by LRP-0 through the reduction; the model's outputs are the bag's, bit for bit."""
    from zennit.composites import EpsilonPlusFlat as ZennitEpsilonPlusFlat

    from tdhook.attribution import EpsilonPlusFlat

    torch.manual_seed(0)
    net = BagNet(mode, padding_idx, weighted).double().eval()
    tokens = torch.randint(0, 11, (4, 5))
    tokens[:, -1] = 0
    lrp = LRP(TensorDictModule(net, in_keys=["tokens"], out_keys=["logits"]), rule_mapper=EpsilonPlusFlat())
    td = lrp(TensorDict(tokens=tokens, batch_size=[4]))
    assert torch.equal(td["logits"], net(tokens))
    with torch.no_grad():
        bagged = net.bag(tokens, per_sample_weights=net.weights(tokens))
    leaf = bagged.clone().requires_grad_(True)
    with ZennitEpsilonPlusFlat().context(net.head) as head:
        out = head(leaf)
        start = torch.zeros_like(out).scatter_(-1, out.argmax(-1, keepdim=True), 1.0) * out.detach()
        (at_bag,) = torch.autograd.grad(out, leaf, start)
    expected = bag_rows_relevance(net, tokens, at_bag)
    assert relative_error(td["relevance", "tokens"], expected) <= 1e-10


class ByKeyword(nn.Module):
    """An ``nn.Embedding`` or ``nn.EmbeddingBag`` called with the tokens by keyword (``embedding(input=tokens)``), or
    by position."""

    def __init__(self, bag: bool, keyword: bool) -> None:
        super().__init__()
        self.embedding = nn.EmbeddingBag(11, 6, mode="mean") if bag else nn.Embedding(11, 6)
        self.head = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
        self.bag, self.keyword = bag, keyword

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        embedded = self.embedding(input=tokens) if self.keyword else self.embedding(tokens)
        return self.head(embedded if self.bag else embedded.mean(1))


@pytest.mark.parametrize("bag", [False, True], ids=["embedding", "bag"])
def test_tokens_given_by_keyword_get_the_relevance_of_tokens_given_by_position(bag: bool):
    """The embedding's hook sees the tokens given by keyword (the call was refused: no embedding read them)."""
    torch.manual_seed(0)
    by_position, by_keyword = ByKeyword(bag, False).double(), ByKeyword(bag, True).double()
    by_keyword.load_state_dict(by_position.state_dict())
    tokens = torch.randint(0, 11, (4, 5))
    expected = explain(by_position, tokens)["relevance", "tokens"]
    torch.testing.assert_close(explain(by_keyword, tokens)["relevance", "tokens"], expected, rtol=0, atol=0)


def shifted_right(tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
    """An encoder-decoder's decoder input made from its input (BART's ``shift_tokens_right``, T5's
    ``_shift_right``): a new tensor the tokens are written into."""
    shifted = tokens.new_zeros(tokens.shape)
    shifted[:, 1:] = tokens[:, :-1].clone()
    shifted[:, 0] = start
    return shifted


class ReadsTokensTwice(nn.Module):
    """Tokens embedded as given and again as computed from them (shifted, sliced, copied), or positions computed
    from them (RoBERTa's: ``ne``, ``cumsum``), which carry no token's value."""

    def __init__(self, again: str) -> None:
        super().__init__()
        self.words = nn.Embedding(11, 4, dtype=torch.float64)
        self.decoder_words = nn.Embedding(11, 4, dtype=torch.float64)
        self.positions = nn.Embedding(16, 4, dtype=torch.float64)
        self.head = nn.Linear(4, 3, dtype=torch.float64)
        self.again = again

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.words(tokens)
        if self.again == "positions":
            mask = tokens.ne(1).long()
            hidden = hidden + self.positions(mask.cumsum(1) * mask + 1)
        elif self.again == "shifted":
            hidden = hidden + self.decoder_words(shifted_right(tokens))
        elif self.again == "sliced":
            hidden = hidden[:, 1:] + self.decoder_words(tokens[:, :-1])
        elif self.again == "copied":
            hidden = hidden + self.decoder_words(torch.cat([tokens[:, :1], tokens.clone()[:, 1:]], 1))
        return self.head(hidden).sum(1)


@pytest.mark.parametrize("again", ["shifted", "sliced", "copied"])
def test_token_ids_computed_from_explained_ones_and_embedded_are_refused_by_name(again: str):
    """A lookup of token ids computed from an explained input (an encoder-decoder's decoder input shifted from its
    input, as BART's and T5's sequence classifiers make it) took no relevance to the tokens: the relevance of that
    lookup was lost without a word (CP-LRP on a tiny BartForSequenceClassification explained from its input_ids
    summed to 3.4 times the logit, on T5ForSequenceClassification to -5.6 times). It is refused, naming the key and
    the embedding, and leaves the caller's TensorDict as it was."""
    torch.manual_seed(0)
    tokens = torch.randint(2, 11, (2, 5))
    td = TensorDict(tokens=tokens, batch_size=[2])
    lrp = LRP(ReadsTokensTwice(again), in_keys=["tokens"], out_keys=["y"])
    with lrp:
        for _ in range(2):  # every call of a context
            with pytest.raises(ValueError, match=r"'tokens' reaches 'decoder_words' \(Embedding\) through token ids"):
                lrp(td)
    assert set(td.keys()) == {"tokens"}


def test_positions_computed_from_explained_tokens_are_no_tokens():
    """Positions computed from the tokens (RoBERTa's) are looked up as positions: explained as before, the
    relevance of the words' embeddings and positions' lookups conserved to the logit with the positions zeroed."""
    torch.manual_seed(0)
    model = ReadsTokensTwice("positions")
    with torch.no_grad():
        model.positions.weight.zero_()
        model.head.bias.zero_()
    tokens = torch.randint(1, 11, (2, 5))
    td = LRP(model, in_keys=["tokens"], out_keys=["y"])(TensorDict(tokens=tokens, batch_size=[2]))
    logit = td["y"].max(-1).values
    torch.testing.assert_close(td["relevance", "tokens"].sum(1), logit)


class CopyingEmbedding(nn.Embedding):
    """An embedding that looks the tokens up through an inner one, on a copy with out-of-range ids set to 0 (as
    Idefics' decoupled embedding does): the outer embedding's output stands for the tokens."""

    def __init__(self) -> None:
        super().__init__(11, 4, dtype=torch.float64)
        self.inner = nn.Embedding(11, 4, dtype=torch.float64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        copy = tokens.clone()
        copy[copy >= 11] = 0
        return self.inner(copy)


def test_a_copy_looked_up_inside_the_embedding_of_the_tokens_is_theirs():
    torch.manual_seed(0)
    model = nn.Sequential(CopyingEmbedding(), nn.Flatten(), nn.Linear(20, 3, dtype=torch.float64))
    tokens = torch.randint(0, 11, (2, 5))
    td = LRP(model, in_keys=["tokens"], out_keys=["y"])(TensorDict(tokens=tokens, batch_size=[2]))
    embedded = model[0](tokens).detach().requires_grad_(True)
    out = model[2](model[1](embedded))
    out.gather(1, out.argmax(1, keepdim=True)).sum().backward()
    torch.testing.assert_close(td["relevance", "tokens"], (embedded * embedded.grad).sum(-1))


class TaskTable(nn.Module):
    """A policy gated per task by a row of a table: ``table[task]`` (a parameter indexed by an integer input)."""

    def __init__(self, lookup: str) -> None:
        super().__init__()
        self.enc, self.head, self.lookup = nn.Linear(4, 6), nn.Linear(6, 2), lookup
        self.table = nn.Parameter(torch.randn(3, 6))

    def forward(self, obs: torch.Tensor, task: torch.Tensor) -> torch.Tensor:
        if self.lookup == "getitem":
            rows = self.table[task]
        elif self.lookup == "view":
            rows = F.embedding(task, self.table.T.T)
        elif self.lookup == "scaled":
            rows = (2.0 * self.table)[task]
        elif self.lookup == "index_select":
            rows = self.table.index_select(0, task.long())
        else:
            rows = F.embedding(task, self.table)
        return self.head(torch.relu(self.enc(obs)) * rows)


@pytest.mark.parametrize("lookup", ["getitem", "index_select", "embedding"])
def test_integer_input_indexing_a_parameter_directly_is_refused_by_name_with_default_keys(lookup: str):
    """``self.table[task]`` is an embedding lookup outside an nn.Embedding: with the default keys, ("relevance",
    "task") was listed among the wrapper's relevance keys and never written, with no word. Refused, naming the key and
    the parameter, leaving the TensorDict as it was; without the key in in_keys, its rows are held constant."""
    torch.manual_seed(0)
    net = TaskTable(lookup).to(F64)
    td = TensorDict(obs=torch.randn(5, 4, dtype=F64), task=torch.tensor([0, 1, 2, 1, 0]), batch_size=[5])
    module = TensorDictModule(net, ["obs", "task"], ["out"])
    lrp = LRP(module, BaseRuleMapper(stabilizer=0.0))
    assert ("relevance", "task") in lrp.out_keys
    with pytest.raises(TypeError, match=r"input key 'task' holds integers \(torch.int64\) that index parameter "
                       r"'module.table' \(shape \(3, 6\)\) directly, outside an nn.Embedding"):  # fmt: skip
        lrp(td)
    assert sorted(td.keys()) == ["obs", "task"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = LRP(module, BaseRuleMapper(stabilizer=0.0), in_keys=["obs"])(td.clone())
    obs = td["obs"].clone().requires_grad_(True)
    logits = net(obs, td["task"])
    start = torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    (gradient,) = torch.autograd.grad(logits, obs, start)
    assert relative_error(out["relevance", "obs"], obs.detach() * gradient) < 1e-10  # LRP-0, the rows held constant


@pytest.mark.parametrize(
    "lookup, what", [("view", "a view of parameter 'module.table'"), ("scaled", "a tensor computed from parameters")]
)
def test_integer_input_indexing_a_view_of_a_parameter_is_refused_as_the_parameter_is(lookup: str, what: str):
    """A view of a parameter (``self.table.T.T``) or a tensor computed from parameters alone (``2 * self.table``),
    indexed by an integer input no embedding reads, is a lookup as the parameter is: with the default keys,
    ("relevance", "task") was listed and never written, with no word. Refused as the parameter's lookup is."""
    torch.manual_seed(0)
    net = TaskTable(lookup).to(F64)
    td = TensorDict(obs=torch.randn(5, 4, dtype=F64), task=torch.tensor([0, 1, 2, 1, 0]), batch_size=[5])
    lrp = LRP(TensorDictModule(net, ["obs", "task"], ["out"]), BaseRuleMapper(stabilizer=0.0))
    with pytest.raises(TypeError, match=rf"input key 'task' holds integers \(torch.int64\) that index {what} "):
        lrp(td)


class TestUint8PixelsAdvice:
    """uint8 pixels no embedding reads: the advice says to convert them before the model, or, where the model's own
    ToTensorImage converts them (no gradient reaches the integers), to apply that transform first."""

    @staticmethod
    def policy(with_transform: bool):
        from tensordict.nn import TensorDictSequential
        from torchrl.envs.transforms import ToTensorImage

        torch.manual_seed(0)
        net = TensorDictModule(nn.Sequential(nn.Flatten(-3), nn.Linear(3 * 4 * 4, 2)).double(), ["pixels"], ["y"])
        if not with_transform:
            cast = TensorDictModule(lambda p: p.permute(0, 3, 1, 2).double() / 255, ["pixels"], ["pixels"])
            return TensorDictSequential(cast, net), net, None
        transform = ToTensorImage(in_keys=["pixels"], dtype=torch.float64)
        return TensorDictSequential(transform, net), net, transform

    def test_the_models_own_to_tensor_image_is_named(self):
        policy, net, transform = self.policy(with_transform=True)
        td = TensorDict(pixels=torch.randint(0, 256, (2, 4, 4, 3), dtype=torch.uint8), batch_size=[2])
        with pytest.raises(TypeError, match="uint8") as caught:
            LRP(policy, in_keys=["pixels"])(td.clone())
        message = str(caught.value)
        assert "the model's ToTensorImage 'module.0' converts" in message and "apply that transform" in message
        assert "convert them to floating point before the model" not in message
        # As the message says: the transform applied first, the rest explained (LRP-0 of a linear map: grad x input).
        converted = transform(td.clone())
        relevance = LRP(net)(converted.clone())["relevance", "pixels"]
        y = net.module(converted["pixels"])
        unit = y.argmax(-1)
        expected = converted["pixels"] * net.module[1].weight.detach()[unit].view(2, 3, 4, 4)
        torch.testing.assert_close(relevance, expected, rtol=1e-12, atol=1e-12)

    def test_without_one_the_advice_is_to_convert_before_the_model(self):
        policy, _, _ = self.policy(with_transform=False)
        td = TensorDict(pixels=torch.randint(0, 256, (2, 4, 4, 3), dtype=torch.uint8), batch_size=[2])
        with pytest.raises(TypeError, match="uint8 pixels: convert them to floating point before the model"):
            LRP(policy, in_keys=["pixels"])(td)


class TokenNet(nn.Module):
    """Token ids embedded by an ``nn.Embedding`` and, beside it, looked up again by ``lookup``: in a low-rank table
    (``F.embedding(ids, A.T) @ B.T``, a LoRA adapter on the embedding), in a parameter (``self.table[ids]``), or not at
    all; then a small head, whose logits at the positions of the next tokens (an activation indexed by the ids) are
    the output of ``"next_token_logits"``."""

    def __init__(self, lookup: str) -> None:
        super().__init__()
        self.embedding, self.lookup = nn.Embedding(11, 6), lookup
        self.lora_A, self.lora_B = nn.Parameter(torch.randn(3, 11)), nn.Parameter(torch.randn(6, 3))
        self.table = nn.Parameter(torch.randn(11, 6))
        self.head = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 11))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        embedded = self.embedding(tokens)
        if self.lookup == "low_rank":
            embedded = embedded + F.embedding(tokens, self.lora_A.T) @ self.lora_B.T * 2.0
        elif self.lookup == "table":
            embedded = embedded + self.table[tokens]
        logits = self.head(embedded)
        if self.lookup == "next_token_logits":
            batch, steps = tokens.shape
            return logits[torch.arange(batch)[:, None], torch.arange(steps - 1), tokens[:, 1:]]
        return logits.sum(1)


@pytest.mark.parametrize(
    "lookup, what",
    [
        ("low_rank", r"a view of parameter 'lora_A' \(shape \(11, 3\)\)"),
        ("table", r"parameter 'table' \(shape \(11, 6\)\)"),
    ],
)
def test_token_ids_also_looked_up_in_a_weight_beside_their_embedding_are_refused_naming_it(lookup: str, what: str):
    """The tokens' relevance is taken from their nn.Embedding's output: a second lookup of the same ids in a weight
    (a LoRA adapter's low-rank table, a parameter indexed by the ids) had its rows held constant, and its share of
    the relevance was lost without a word (0.78 away, in relative L2, from LRP-0 of the merged table on the
    low-rank net). Refused, naming the key, the embedding and the weight."""
    torch.manual_seed(0)
    net = TokenNet(lookup).to(F64)
    tokens = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(1))
    lrp = LRP(net, BaseRuleMapper(stabilizer=0.0), in_keys=["tokens"], out_keys=["y"])
    with pytest.raises(ValueError, match=rf"input key 'tokens' is embedded by 'embedding' and also indexes {what}"):
        lrp(TensorDict(tokens=tokens, batch_size=[4]))


def test_an_activation_indexed_by_the_token_ids_is_explained_through_it():
    """Logits picked at the ids of the next tokens (a likelihood of the sequence) index an activation, not a
    weight: the ids get the relevance LRP-0 gives their embeddings (gradient × input), with no error."""
    torch.manual_seed(0)
    net = TokenNet("next_token_logits").to(F64)
    tokens = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(1))
    start = torch.rand(4, 4, dtype=F64, generator=torch.Generator().manual_seed(2))
    lrp = LRP(net, BaseRuleMapper(stabilizer=0.0), in_keys=["tokens"], out_keys=["y"], target=lambda y: start * y)
    td = lrp(TensorDict(tokens=tokens, batch_size=[4]))
    embedded = net.embedding(tokens).detach().requires_grad_(True)
    out = net.head(embedded)[torch.arange(4)[:, None], torch.arange(4), tokens[:, 1:]]
    (gradient,) = torch.autograd.grad(out, embedded, start)
    assert relative_error(td["relevance", "tokens"], (embedded * gradient).sum(-1).detach()) <= 1e-12


class ScaledTableEmbedding(nn.Embedding):
    """An ``nn.Embedding`` that scales its own table before its lookup."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight * 3.0)


def test_an_embedding_looking_up_its_own_scaled_table_is_explained_as_one_lookup():
    """The lookup inside the embedding, in a table computed from its own weight, is the embedding's: no error, and
    the ids get the relevance LRP-0 gives the embedding's output (gradient × input)."""
    torch.manual_seed(0)
    net = nn.Sequential(ScaledTableEmbedding(11, 6), nn.Flatten(), nn.Linear(30, 3)).to(F64)
    tokens = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(1))
    td = LRP(net, BaseRuleMapper(stabilizer=0.0), in_keys=["tokens"], out_keys=["y"])(
        TensorDict(tokens=tokens, batch_size=[4])
    )
    embedded = net[0](tokens).detach().requires_grad_(True)
    out = net[2](net[1](embedded))
    (gradient,) = torch.autograd.grad(out.gather(1, out.argmax(1, keepdim=True)).sum(), embedded)
    assert relative_error(td["relevance", "tokens"], (embedded * gradient).sum(-1).detach()) <= 1e-12


class DoubledTable(nn.Module):
    """A parametrization that doubles the table it is given."""

    def forward(self, table: torch.Tensor) -> torch.Tensor:
        return 2.0 * table


@pytest.mark.parametrize("parametrization", ["weight_norm", "custom"])
def test_an_embedding_with_a_parametrized_table_is_explained_as_one_lookup(parametrization: str):
    """An ``nn.Embedding`` whose weight is parametrized (weight norm, or any ``register_parametrization``) looks up a
    table computed from its ``original`` parameters: that lookup is the embedding's own. It was refused as a lookup
    beside the embedding; the ids get the relevance LRP-0 gives the embedding's output (gradient × input)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(11, 6), nn.Flatten(), nn.Linear(30, 3)).to(F64)
    if parametrization == "weight_norm":
        nn.utils.parametrizations.weight_norm(net[0])
    else:
        nn.utils.parametrize.register_parametrization(net[0], "weight", DoubledTable())
    tokens = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(1))
    td = LRP(net, BaseRuleMapper(stabilizer=0.0), in_keys=["tokens"], out_keys=["y"])(
        TensorDict(tokens=tokens, batch_size=[4])
    )
    embedded = net[0](tokens).detach().requires_grad_(True)
    out = net[2](net[1](embedded))
    (gradient,) = torch.autograd.grad(out.gather(1, out.argmax(1, keepdim=True)).sum(), embedded)
    assert relative_error(td["relevance", "tokens"], (embedded * gradient).sum(-1).detach()) <= 1e-12


def test_every_call_of_a_context_that_feeds_token_ids_is_tracked(monkeypatch):
    """The token ids are tracked through the model (a function mode seeing every torch call) on every call of a
    context, those after a call with the same inputs' signature that looked up nothing beside the embedding
    included: the model may look them up elsewhere in a later call. Each call gets LRP-0 (gradient × input of the
    embedding's output)."""
    from tdhook.attribution import _tokens

    seen = []
    tracked = _tokens._DerivedTokens.__torch_function__
    monkeypatch.setattr(
        _tokens._DerivedTokens, "__torch_function__", lambda *a, **k: seen.append(1) or tracked(*a, **k)
    )
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(11, 6), nn.Flatten(), nn.Linear(30, 3)).to(F64)
    lrp = LRP(net, BaseRuleMapper(stabilizer=0.0), in_keys=["tokens"], out_keys=["y"])
    counts = []
    with lrp:
        for seed in range(3):
            tokens = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(seed))
            before = len(seen)
            td = lrp(TensorDict(tokens=tokens, batch_size=[4]))
            counts.append(len(seen) - before)
            embedded = net[0](tokens).detach().requires_grad_(True)
            out = net[2](net[1](embedded))
            (gradient,) = torch.autograd.grad(out.gather(1, out.argmax(1, keepdim=True)).sum(), embedded)
            assert relative_error(td["relevance", "tokens"], (embedded * gradient).sum(-1).detach()) <= 1e-12
    assert all(count > 0 for count in counts)


@pytest.mark.parametrize("lookup", ["low_rank", "table"])
def test_a_lookup_beside_the_embedding_is_refused_on_every_call_of_a_context(lookup: str):
    """A call refused for a lookup beside the embedding leaves its signature tracked: the next call is refused too."""
    torch.manual_seed(0)
    net = TokenNet(lookup).to(F64)
    tokens = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(1))
    lrp = LRP(net, BaseRuleMapper(stabilizer=0.0), in_keys=["tokens"], out_keys=["y"])
    with lrp:
        for _ in range(2):
            with pytest.raises(ValueError, match="input key 'tokens' is embedded by 'embedding' and also indexes"):
                lrp(TensorDict(tokens=tokens, batch_size=[4]))


@pytest.mark.parametrize("lookup", ["low_rank", "table"])
def test_a_lookup_beside_the_embedding_that_a_later_call_of_a_context_makes_is_refused(lookup: str):
    """The model may change between calls of one context (a flag, an adapter switched on): a call whose inputs have
    the signature of an earlier call that looked up nothing beside the embedding is refused all the same. It was not
    tracked, and the lookup's share of the relevance was lost without a word."""
    torch.manual_seed(0)
    net = TokenNet("none").to(F64)
    tokens = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(1))
    lrp = LRP(net, BaseRuleMapper(stabilizer=0.0), in_keys=["tokens"], out_keys=["y"])
    with lrp:
        lrp(TensorDict(tokens=tokens, batch_size=[4]))
        net.lookup = lookup
        with pytest.raises(ValueError, match="input key 'tokens' is embedded by 'embedding' and also indexes"):
            lrp(TensorDict(tokens=tokens, batch_size=[4]))


def test_a_peft_adapter_on_the_embedding_enabled_after_a_call_without_it_is_refused():
    """peft's ``disable_adapter()`` for one call of a context, then the adapter's own lookup of the ids
    (``F.embedding(ids, lora_A.T)``) in the next call: refused, as in a call of its own context."""
    import peft

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding, self.head = nn.Embedding(11, 6), nn.Linear(6, 3)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.embedding(tokens).sum(1))

    torch.manual_seed(0)
    config = peft.LoraConfig(target_modules=["embedding"], r=2, init_lora_weights=False)
    model = peft.get_peft_model(Net().to(F64), config)
    tokens = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(1))
    lrp = LRP(model, BaseRuleMapper(stabilizer=0.0), in_keys=["tokens"], out_keys=["y"])
    with lrp:
        with model.disable_adapter():
            lrp(TensorDict(tokens=tokens, batch_size=[4]))
        with pytest.raises(ValueError, match="input key 'tokens' is embedded by .* and also indexes"):
            lrp(TensorDict(tokens=tokens, batch_size=[4]))


class OwnTableBeside(nn.Module):
    """Token ids embedded by an ``nn.Embedding``, and the same embedding's weight indexed by them again outside it."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.head = nn.Embedding(11, 6), nn.Linear(6, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(tokens).sum(1) + self.embedding.weight[tokens].pow(2).sum(1))


def test_the_embeddings_own_weight_indexed_by_its_ids_outside_it_is_refused():
    """The embedding's weight indexed by the ids in the model's forward, outside the embedding: a second lookup,
    whose rows are held constant (its share of the relevance was lost without a word, as it was taken for the
    embedding's own lookup). Refused, naming the weight; the lookups inside an embedding (its own, of a table scaled
    or parametrized) stay its own (see the tests above)."""
    torch.manual_seed(0)
    net = OwnTableBeside().to(F64)
    tokens = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(1))
    lrp = LRP(net, BaseRuleMapper(stabilizer=0.0), in_keys=["tokens"], out_keys=["y"])
    with pytest.raises(ValueError, match=r"embedded by 'embedding' and also indexes parameter 'embedding.weight'"):
        lrp(TensorDict(tokens=tokens, batch_size=[4]))


class SharedTable(nn.Module):
    """Token ids embedded by an ``nn.Embedding``, and a task id that indexes the same embedding's weight directly."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.head = nn.Embedding(11, 6), nn.Linear(6, 3)

    def forward(self, tokens: torch.Tensor, task: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(tokens).sum(1) + self.embedding.weight[task])


def test_an_input_indexing_an_embeddings_weight_outside_it_is_refused_on_every_call_of_a_context():
    """The task id indexes the embedding's own weight, but no embedding reads it: refused on each call of a context,
    its signature never taken for one whose lookups are all embedded."""
    torch.manual_seed(0)
    net = SharedTable().to(F64)
    td = TensorDict(tokens=torch.randint(0, 11, (4, 5)), task=torch.tensor([0, 1, 2, 1]), batch_size=[4])
    lrp = LRP(TensorDictModule(net, ["tokens", "task"], ["y"]), BaseRuleMapper(stabilizer=0.0))
    with lrp:
        for _ in range(2):
            with pytest.raises(
                TypeError, match=r"input key 'task' holds integers \(torch.int64\) that index parameter"
            ):
                lrp(td)


class TwoTables(nn.Module):
    """Token ids embedded by one ``nn.Embedding``, and looked up again in a second embedding's weight directly."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.offsets, self.head = nn.Embedding(11, 6), nn.Embedding(11, 6), nn.Linear(6, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head((self.embedding(tokens) + self.offsets.weight[tokens]).sum(1))


def test_token_ids_also_looked_up_in_another_embeddings_weight_are_refused_naming_it():
    """The second lookup, in another ``nn.Embedding``'s weight outside that embedding, had its rows held constant,
    and its share of the relevance was lost without a word: any embedding's weight was taken for the one that
    embedded the ids. Refused, naming the key, the embedding and the weight."""
    torch.manual_seed(0)
    net = TwoTables().to(F64)
    tokens = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(1))
    lrp = LRP(net, BaseRuleMapper(stabilizer=0.0), in_keys=["tokens"], out_keys=["y"])
    match = r"input key 'tokens' is embedded by 'embedding' and also indexes parameter 'offsets.weight' \(shape"
    with pytest.raises(ValueError, match=match):
        lrp(TensorDict(tokens=tokens, batch_size=[4]))


class HeadRowsScore(nn.Module):
    """A log-likelihood-like score of each next token, read from the rows of the language-model head ``out`` that the
    next tokens' ids pick (``lookup``): ``(h[:, :-1] * out.weight[ids[:, 1:]]).sum(-1) + out.bias[ids[:, 1:]]``, by
    indexing, ``F.embedding`` or ``index_select``; ``"logits"`` computes the same as ``F.linear(h, out.weight,
    out.bias)`` gathered at the next tokens; ``"columns"`` indexes the head's input units by the ids instead, a
    lookup of an input beside the embedding. With ``tied=True`` the head's weight is the embedding's (weight tying,
    as GPT-2 and most language models have it)."""

    def __init__(self, lookup: str, tied: bool = False) -> None:
        super().__init__()
        self.lookup = lookup
        self.embedding = nn.Embedding(11, 6)
        self.body = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 6))
        self.out, self.mix = nn.Linear(6, 11), nn.Linear(11, 6)
        if tied:
            self.out.weight = self.embedding.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        embedded = self.embedding(ids)
        if self.lookup == "columns":
            embedded = embedded + self.mix.weight[:, ids].movedim(0, -1)
        h, following = self.body(embedded)[:, :-1], ids[:, 1:]
        if self.lookup in ("logits", "columns"):
            return F.linear(h, self.out.weight, self.out.bias).gather(-1, following[..., None]).squeeze(-1)
        if self.lookup == "indexing":
            rows = self.out.weight[following]
        elif self.lookup == "embedding":
            rows = F.embedding(following, self.out.weight)
        else:
            rows = self.out.weight.index_select(0, following.flatten()).view(*following.shape, -1)
        return (h * rows).sum(-1) + self.out.bias[following]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("lookup", ["indexing", "embedding", "index_select"])
def test_a_score_read_from_the_rows_of_a_linear_head_by_the_next_ids_is_explained_as_its_gathered_logits(lookup, tied):
    """The rows of an ``nn.Linear``'s weight that the ids pick are its output units: the score is the head's logits
    gathered at the next tokens, and the ids only choose what is explained. It was refused as a lookup beside the
    embedding; the ids get the relevance LRP-0 gives their embeddings in the same model written with ``F.linear``
    then a gather (gradient × input), on every call of a context (the calls after the first are not tracked).
    With the head's weight tied to the embedding's, the embedding's own lookup of that weight (inside its forward,
    its rows the model's input) is no use of the head's rows: the score was refused as a lookup beside it."""
    torch.manual_seed(0)
    net = HeadRowsScore(lookup, tied).to(F64)
    start = torch.rand(4, 4, dtype=F64, generator=torch.Generator().manual_seed(2))
    lrp = LRP(net, BaseRuleMapper(stabilizer=0.0), in_keys=["ids"], out_keys=["y"], target=lambda y: start * y)
    with lrp:
        for seed in range(2):
            ids = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(seed))
            td = lrp(TensorDict(ids=ids, batch_size=[4]))
            embedded = net.embedding(ids).detach().requires_grad_(True)
            h = net.body(embedded)[:, :-1]
            out = F.linear(h, net.out.weight, net.out.bias).gather(-1, ids[:, 1:, None]).squeeze(-1)
            (gradient,) = torch.autograd.grad(out, embedded, start)
            assert relative_error(td["relevance", "ids"], (embedded * gradient).sum(-1).detach()) <= 1e-12


def test_token_ids_indexing_the_input_units_of_a_linear_beside_their_embedding_are_refused_naming_it():
    """Columns of an ``nn.Linear``'s weight picked by the ids are no output units of it, but an input added beside
    the embedding: still refused, naming the weight."""
    torch.manual_seed(0)
    net = HeadRowsScore("columns").to(F64)
    tokens = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(1))
    lrp = LRP(net, BaseRuleMapper(stabilizer=0.0), in_keys=["ids"], out_keys=["y"])
    with pytest.raises(ValueError, match=r"input key 'ids' is embedded by 'embedding' and also indexes parameter 'mix"):
        lrp(TensorDict(ids=tokens, batch_size=[4]))


class HeadRowsAdded(nn.Module):
    """Rows of an ``nn.Linear``'s weight (``adapter``, of as many output units as there are tokens) picked by the
    ids and added to their embedding (``how="added"``): an input of the model beside the embedding, as an adapter
    on the embedding written with a linear layer adds, not output units; ``how="bias"``: the rows of its bias alone,
    added to a score; ``how="scaled"``: the rows multiply the embedding, a constant factor of each token's signal.
    With ``tied=True`` the adapter's weight is the embedding's."""

    def __init__(self, how: str, tied: bool = False) -> None:
        super().__init__()
        self.how = how
        self.embedding = nn.Embedding(11, 6)
        self.adapter = nn.Linear(6, 11)
        if tied:
            self.adapter.weight = self.embedding.weight
        self.body = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        embedded = self.embedding(ids)
        if self.how == "added":
            embedded = embedded + self.adapter.weight[ids]
        elif self.how == "scaled":
            embedded = embedded * self.adapter.weight[ids]
        score = self.body(embedded).squeeze(-1)
        return score + self.adapter.bias[ids] if self.how == "bias" else score


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("how", ["added", "bias"])
def test_rows_of_a_linear_picked_by_the_ids_and_added_beside_the_embedding_are_refused_naming_them(how, tied):
    """Rows of an ``nn.Linear``'s weight or bias picked by the ids count as the layer's output units only where they
    multiply a signal (a head's score): added to the embedding or the score, they are an input beside the embedding,
    whose relevance was lost with no error (the ids' relevance summed up to 0.15 off the score, LRP-0). So with the
    weight tied to the embedding's too: the embedding's own lookup of it does not make the others its own."""
    torch.manual_seed(0)
    net = HeadRowsAdded(how, tied).to(F64)
    tokens = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(1))
    lrp = LRP(net, BaseRuleMapper(stabilizer=0.0), in_keys=["ids"], out_keys=["y"])
    weight = "embedding.weight" if tied and how == "added" else "adapter."
    with pytest.raises(
        ValueError, match=rf"input key 'ids' is embedded by 'embedding' and also indexes parameter '{weight}"
    ):
        lrp(TensorDict(ids=tokens, batch_size=[4]))


@pytest.mark.parametrize("tied", [False, True])
def test_rows_of_a_linear_picked_by_the_ids_that_scale_the_embedding_are_a_constant_factor_of_its_signal(tied):
    """Rows that multiply the embedding hold no relevance (a constant factor of a linear map): the ids get that of
    their embeddings, gradient x input of the embedding output (LRP-0). With the weight tied to the embedding's, the
    embedding's output was taken for more rows of it, no signal, and the product refused."""
    torch.manual_seed(0)
    net = HeadRowsAdded("scaled", tied).to(F64)
    ids = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(1))
    lrp = LRP(net, BaseRuleMapper(stabilizer=0.0), in_keys=["ids"], out_keys=["y"], target=lambda y: y)
    td = lrp(TensorDict(ids=ids, batch_size=[4]))
    embedded = net.embedding(ids).detach().requires_grad_(True)
    out = net.body(embedded * net.adapter.weight[ids]).squeeze(-1)
    (gradient,) = torch.autograd.grad(out, embedded, torch.ones_like(out))
    assert relative_error(td["relevance", "ids"], (embedded * gradient).sum(-1).detach()) <= 1e-12


class ObservationAndToken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.head = nn.Embedding(10, 4), nn.Linear(8, 3)

    def forward(self, observation: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([observation, self.embedding(token)], -1))


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("mapper", [BaseRuleMapper, lambda: BaseRuleMapper(rule_mapper={nn.Linear: EpsilonRule(0.1)})])
def test_token_ids_in_a_lazy_stack_get_the_relevance_of_the_dense_batch(dim, mapper):
    """A lazily stacked TensorDict reads the ids written into it by stacking their slices anew: the lookup of that
    stack was refused as one of ids computed from the input ("sliced, shifted or copied"), though the caller gave
    the ids as they are."""
    torch.manual_seed(0)
    policy = TensorDictModule(ObservationAndToken().double(), in_keys=["observation", "token"], out_keys=["q"])
    dense = TensorDict(
        observation=torch.randn(2, 3, 4, dtype=torch.float64), token=torch.randint(0, 10, (2, 3)), batch_size=[2, 3]
    )
    expected = LRP(policy, mapper(), target=1)(dense.clone())
    lazy = LazyStackedTensorDict.lazy_stack(list(dense.clone().unbind(dim)), dim)
    out = LRP(policy, mapper(), target=1)(lazy)
    for key in ("observation", "token"):
        torch.testing.assert_close(out["relevance", key], expected["relevance", key], rtol=1e-12, atol=1e-14)
    assert torch.equal(lazy.tensordicts[0]["token"], dense.unbind(dim)[0]["token"])  # the ids as they were


@pytest.mark.parametrize(("outer", "inner"), [(0, 0), (0, 1), (1, 0), (1, 1), (2, 1)])
def test_token_ids_in_a_lazy_stack_of_lazy_stacks_get_the_relevance_of_the_dense_batch(outer, inner):
    """A lazy stack of lazy stacks reads the ids by stacking the inner stacks' reads, each a stack of the slices of
    a slice: that was refused as ids computed from the input."""
    torch.manual_seed(0)
    policy = TensorDictModule(ObservationAndToken().double(), in_keys=["observation", "token"], out_keys=["q"])
    dense = TensorDict(
        observation=torch.randn(2, 3, 4, 4, dtype=torch.float64),
        token=torch.randint(0, 10, (2, 3, 4)),
        batch_size=[2, 3, 4],
    )
    expected = LRP(policy, target=1)(dense.clone())
    parts = [LazyStackedTensorDict.lazy_stack(list(part.unbind(inner)), inner) for part in dense.clone().unbind(outer)]
    out = LRP(policy, target=1)(LazyStackedTensorDict.lazy_stack(parts, outer))
    for key in ("observation", "token"):
        torch.testing.assert_close(out["relevance", key], expected["relevance", key], rtol=1e-12, atol=1e-14)


def test_an_inner_stack_of_the_ids_alone_is_still_refused():
    """A stack of the slices of one row of the ids is that row: ids sliced from the input, not the ids."""

    class FirstRow(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding, self.head = nn.Embedding(10, 4), nn.Linear(4, 3)

        def forward(self, token: torch.Tensor) -> torch.Tensor:
            return self.head(self.embedding(torch.stack(token[0].unbind(0))).sum(0))

    policy = TensorDictModule(FirstRow().double(), in_keys=["token"], out_keys=["q"])
    with pytest.raises(ValueError, match="through token ids computed from it"):
        LRP(policy, target=0)(TensorDict(token=torch.randint(0, 10, (2, 3)), batch_size=[]))


def _changed_after_restacking(token: torch.Tensor, how: str) -> torch.Tensor:
    if how == "the whole stack":
        ids = torch.stack(token.unbind(0))
        ids.add_(1)
        return ids
    row = torch.stack(token[0].unbind(0))
    row[0] = 9
    return torch.stack([row, torch.stack(token[1].unbind(0))])


@pytest.mark.parametrize("how", ["the whole stack", "an inner stack"])
def test_ids_put_back_together_then_written_into_are_refused(how: str):
    """A stack of the ids' slices stood for the ids by its memory, whatever was written into it since: the ids plus
    one were explained as the ids (0.66 of the relevance where the untouched ids give 1.24)."""

    class Changed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding, self.head = nn.Embedding(10, 4), nn.Linear(4, 3)

        def forward(self, token: torch.Tensor) -> torch.Tensor:
            return self.head(self.embedding(_changed_after_restacking(token, how)).sum((0, 1)))

    policy = TensorDictModule(Changed().double(), in_keys=["token"], out_keys=["q"])
    with pytest.raises(ValueError, match="through token ids computed from it"):
        LRP(policy, target=0)(TensorDict(token=torch.randint(0, 8, (2, 3)), batch_size=[]))


def test_ids_put_back_together_in_another_order_are_still_refused():
    """Only the slices in their order are the ids: a model stacking them swapped looks up other ids per place."""

    class Swapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding, self.head = nn.Embedding(10, 4), nn.Linear(4, 3)

        def forward(self, token: torch.Tensor) -> torch.Tensor:
            return self.head(self.embedding(torch.stack(token.unbind(1)[::-1], 1)).sum(1))

    policy = TensorDictModule(Swapped().double(), in_keys=["token"], out_keys=["q"])
    with pytest.raises(ValueError, match="through token ids computed from it"):
        LRP(policy, target=0)(TensorDict(token=torch.randint(0, 10, (2, 3)), batch_size=[2]))
