"""Hugging Face transformers called as users call them: padding masks, position ids, a KV cache, returned attention
weights, per-token targets, encoder-decoder models, training mode and gradient checkpointing.

The models are built as in the zoo (tiny random configs, float64, weights scaled up). Each case is checked against
an oracle that needs no reference implementation: the same model called without the feature (a padded sequence
against the sequence alone, a cached prefix against the whole sequence, one call per position against one call
with ``split_dim``), or conservation.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import CPLRP, LRP, AttnLRP
from tests.attribution.test_lrp_transformer_zoo import (
    BATCH,
    HIDDEN,
    PRESETS,
    TOKENS,
    ZOO,
    Architecture,
    Explained,
    model_input,
    zero_additive,
)
from tests.conftest import relative_error

F64 = torch.float64


class NextToken(nn.Module):
    """A language model's next-token logits from embeddings, with the keyword arguments it is called with."""

    def __init__(self, model: nn.Module, **kwargs) -> None:
        super().__init__()
        self.model = model
        self.kwargs = kwargs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(inputs_embeds=x, **self.kwargs).logits[:, -1]


class Called(nn.Module):
    """A model called on the explained inputs by ``call(model, *inputs)``."""

    def __init__(self, model: nn.Module, call) -> None:
        super().__init__()
        self.model = model
        self.call = call

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.call(self.model, *inputs)


def all_logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(inputs_embeds=x).logits


def seq2seq(model: nn.Module, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """An encoder-decoder's next-token logits from the embeddings of both sequences."""
    return model(inputs_embeds=source, decoder_inputs_embeds=target).logits[:, -1]


def seq2seq_tokens(model: nn.Module, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return model(input_ids=source, decoder_input_ids=target).logits[:, -1]


def with_mask(model: nn.Module, embeds: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    return model(inputs_embeds=embeds, attention_mask=attention_mask).logits[:, -1]


def explain(module: nn.Module, preset: str, x: torch.Tensor, **options) -> TensorDict:
    lrp = LRP(module, PRESETS[preset](), in_keys=["x"], out_keys=["y"], **options)
    return lrp(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))


def without_dropout(architecture: Architecture) -> Architecture:
    values = dict(architecture.values, attention_dropout=0.0, hidden_dropout_prob=0.0)
    values |= dict(attention_probs_dropout_prob=0.0, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    return Architecture(architecture.config, architecture.model, values, architecture.inputs, architecture.sdpa)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_gradient_checkpointing_in_training_mode_is_an_error_naming_the_module(name: str, preset: str):
    """A checkpointed layer recomputes its forward pass in the backward pass, outside the rules: torch then finds
    other saved tensors than the forward pass saved, or, where they happen to match, relevance with rules missing.
    The wrapper refuses it before running the model, naming the module and how to switch it off."""
    model = without_dropout(ZOO[name]).build("sdpa")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    td = TensorDict(x=model_input(ZOO[name]), batch_size=[BATCH])
    lrp = LRP(Explained(model), PRESETS[preset](), in_keys=["x"], out_keys=["y"])
    with pytest.raises(ValueError, match=r"module 'model[.\w]*' \(\w+\) .*gradient checkpointing.*training mode"):
        lrp(td)
    assert set(td.keys()) == {"x"}
    model.eval()  # checkpointing is off in eval mode: explained as without it
    eval_mode = lrp(td)["relevance", "x"]
    model.activation_checkpointing_disable()
    assert torch.equal(eval_mode, lrp(td)["relevance", "x"])
    model.train()  # training mode without checkpointing (and without dropout): explained
    assert torch.equal(eval_mode, lrp(td)["relevance", "x"])


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_attention_dropout_in_training_mode_is_warned(implementation: str, preset: str):
    """Attention dropout computed by a function (``F.dropout`` on the weights, ``dropout_p`` of the fused
    attention), not by a ``Dropout`` module: in training mode each call drops other weights, and the user is told,
    as for a ``Dropout`` module."""
    architecture = Architecture("LlamaConfig", "LlamaForCausalLM", dict(attention_dropout=0.5))
    model, x = architecture.build(implementation).train(), model_input(architecture)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = explain(Explained(model), preset, x), explain(Explained(model), preset, x)
    assert not torch.equal(first["relevance", "x"], second["relevance", "x"])  # random indeed
    messages = [str(w.message) for w in caught]
    assert any("dropout (p=0.5) in training mode" in m and ".eval()" in m for m in messages), messages
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explain(Explained(model.eval()), preset, x)
    assert [str(w.message) for w in caught] == []


PADDED = 3  # left padding of the first sample


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("name, implementation, dtype", [("llama", "eager", torch.float32), ("llama", "sdpa", F64)])
def test_left_padding_gives_the_relevance_of_the_sequence_alone(name: str, implementation: str, dtype, preset: str):
    """A left-padded sample with its attention mask and position ids is explained as the sequence alone: the same
    relevance on its tokens, none on the padding. (transformers' eager Llama gives NaN logits for a padded sample
    in float64 without any wrapper: float32 there.)"""
    model, x = ZOO[name].build(implementation, dtype), model_input(ZOO[name], dtype)
    mask = torch.ones(BATCH, TOKENS, dtype=torch.long)
    mask[0, :PADDED] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    padded = explain(NextToken(model, attention_mask=mask, position_ids=positions), preset, x)
    alone = explain(NextToken(model), preset, x[:1, PADDED:])
    torch.testing.assert_close(padded["y"][:1], alone["y"])
    assert relative_error(padded["relevance", "x"][0, PADDED:], alone["relevance", "x"][0]) <= 1e-6
    assert torch.equal(padded["relevance", "x"][0, :PADDED], torch.zeros(PADDED, x.shape[-1], dtype=dtype))


UNFUSED = {  # the fused attention computed unfused: a softmax ε, or a relevance that keeps its graph
    "attnlrp-softmax-epsilon": (lambda: AttnLRP(softmax_epsilon=0.01), {}),
    "attnlrp-create-graph": (AttnLRP, {"create_graph": True}),
    "cplrp-create-graph": (CPLRP, {"create_graph": True}),
}


@pytest.mark.parametrize("case", sorted(UNFUSED))
def test_left_padding_where_the_rules_compute_the_attention_unfused(case: str):
    """A left-padded query sees no key: the fused kernel gives it zeros, an unfused softmax NaN, which reached
    every token through ``0 · NaN`` (NaN logits and relevance). The output is the model's, bit for bit, and the
    padded sample is explained as the sequence alone."""
    model, x = ZOO["llama"].build("sdpa"), model_input(ZOO["llama"])
    mask = torch.ones(BATCH, TOKENS, dtype=torch.long)
    mask[0, :PADDED] = 0
    padded_model = NextToken(model, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    make, options = UNFUSED[case]
    padded = LRP(padded_model, make(), in_keys=["x"], out_keys=["y"], **options)(TensorDict(x=x, batch_size=[BATCH]))
    alone = LRP(NextToken(model), make(), in_keys=["x"], out_keys=["y"], **options)(
        TensorDict(x=x[:1, PADDED:], batch_size=[1])
    )
    assert torch.equal(padded["y"], padded_model(x))
    assert relative_error(padded["relevance", "x"][0, PADDED:], alone["relevance", "x"][0]) <= 1e-6
    assert torch.equal(padded["relevance", "x"][0, :PADDED], torch.zeros(PADDED, HIDDEN, dtype=F64))


class CachedPrefix(nn.Module):
    """The next-token logits of the last tokens, the prefix given as a KV cache (a fresh copy at each call)."""

    def __init__(self, model: nn.Module, cache) -> None:
        super().__init__()
        self.model = model
        self.cache = cache

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cache = copy.deepcopy(self.cache)
        return self.model(inputs_embeds=x, past_key_values=cache, use_cache=True).logits[:, -1]


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize(
    "name, implementation",
    [
        ("llama", "sdpa"),
        ("gpt2", "eager"),
        ("llama", "eager"),
        ("gpt2", "sdpa"),
        ("mistral", "eager"),
        ("qwen2", "sdpa"),
    ],
)
def test_a_kv_cache_gives_the_relevance_of_the_whole_sequence_on_the_new_tokens(name: str, implementation, preset):
    """In a causal model the prefix's keys and values do not depend on the later tokens: explaining those tokens
    after a cached prefix gives them the relevance the whole sequence gives them (the cache is a constant)."""
    model, x = ZOO[name].build(implementation), model_input(ZOO[name])
    with torch.no_grad():
        cache = model(inputs_embeds=x[:, :4], use_cache=True).past_key_values
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers renames past_key_values
        cached = explain(CachedPrefix(model, cache), preset, x[:, 4:])
    whole = explain(NextToken(model), preset, x)
    torch.testing.assert_close(cached["y"], whole["y"])
    assert relative_error(cached["relevance", "x"], whole["relevance", "x"][:, 4:]) <= 1e-12


def test_a_kv_cache_in_a_call_keeping_its_graph_gives_the_relevance_of_the_whole_sequence():
    """With ``create_graph=True`` the cache is not detached after the call, but its prefix is still the whole
    sequence's keys and values, not constants beside the new ones (taken so, GPT-2 under AttnLRP was 0.45 off)."""
    model, x = ZOO["gpt2"].build("eager"), model_input(ZOO["gpt2"])
    with torch.no_grad():
        cache = model(inputs_embeds=x[:, :4], use_cache=True).past_key_values
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers renames past_key_values
        cached = explain(CachedPrefix(model, cache), "attnlrp", x[:, 4:], create_graph=True)
    whole = explain(NextToken(model), "attnlrp", x, create_graph=True)
    assert relative_error(cached["relevance", "x"].detach(), whole["relevance", "x"][:, 4:].detach()) <= 1e-12


class StaticCachedPrefix(nn.Module):
    """The next-token logits of the last tokens, the prefix's keys and values written into a ``StaticCache``."""

    def __init__(self, model: nn.Module, cache, start: int) -> None:
        super().__init__()
        self.model, self.cache, self.start = model, cache, start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(self.start, self.start + x.shape[1])
        return self.model(inputs_embeds=x, past_key_values=self.cache, cache_position=positions).logits[:, -1]


def test_a_static_kv_cache_gives_the_relevance_of_the_whole_sequence_on_the_new_tokens():
    """A ``StaticCache`` holds the prefix's keys in a buffer the new keys are written into (``index_copy_``): the
    buffer's other elements are the prefix's keys, not constants beside the new ones (taken so, GPT-2 under AttnLRP
    was 0.45 off, relative L2)."""
    transformers = pytest.importorskip("transformers")
    model, x = ZOO["gpt2"].build("eager"), model_input(ZOO["gpt2"])
    cache = transformers.StaticCache(config=model.config, max_cache_len=x.shape[1])
    with torch.no_grad():
        model(inputs_embeds=x[:, :4], past_key_values=cache, cache_position=torch.arange(4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers renames past_key_values
        cached = explain(StaticCachedPrefix(model, cache, 4), "attnlrp", x[:, 4:])
    whole = explain(NextToken(model), "attnlrp", x)
    torch.testing.assert_close(cached["y"], whole["y"])
    assert relative_error(cached["relevance", "x"], whole["relevance", "x"][:, 4:]) <= 1e-12


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_returning_the_attention_weights_changes_nothing(preset: str):
    model, x = ZOO["llama"].build("eager"), model_input(ZOO["llama"])
    returned = explain(NextToken(model, output_attentions=True), preset, x)
    assert torch.equal(returned["relevance", "x"], explain(NextToken(model), preset, x)["relevance", "x"])


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_next_token_prediction_in_one_call(preset: str):
    """``split_dim=1`` over the sequence explains the prediction at each position on its own: as one call per
    position does, with no relevance on the tokens after it (a causal model)."""
    model, x = ZOO["llama"].build("sdpa"), model_input(ZOO["llama"])
    tokens = torch.randint(0, 64, (BATCH, TOKENS), generator=torch.Generator().manual_seed(2))
    every = explain(Called(model, all_logits), preset, x, split_dim=1, target=tokens)["relevance", "x"]
    assert every.shape == (BATCH, TOKENS, TOKENS, HIDDEN)
    after = torch.ones(TOKENS, TOKENS, dtype=torch.bool).triu(1)  # [position, token]: tokens after the position
    assert torch.equal(every.sum(-1)[:, after], torch.zeros(BATCH, int(after.sum()), dtype=F64))
    for position in (0, 3, TOKENS - 1):
        at_position = Called(model, lambda m, x, t=position: all_logits(m, x)[:, t])
        alone = explain(at_position, preset, x, target=tokens[:, position])["relevance", "x"]
        assert relative_error(every[:, position], alone) <= 1e-12


NOT_FOR_SEQ2SEQ = {key: None for key in ("num_key_value_heads", "head_dim", "num_attention_heads", "intermediate_size")}
SEQ2SEQ = {
    "t5": Architecture(
        "T5Config",
        "T5ForConditionalGeneration",
        dict(NOT_FOR_SEQ2SEQ, d_model=HIDDEN, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0),
    ),
    "bart": Architecture(
        "BartConfig",
        "BartForConditionalGeneration",
        dict(NOT_FOR_SEQ2SEQ, d_model=HIDDEN, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4)
        | dict(decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64),
    ),
}


@pytest.mark.parametrize("name", sorted(SEQ2SEQ))
def test_an_encoder_decoder_conserves_over_both_sequences_under_cplrp(name: str):
    """Cross-attention included: the relevance of the source and of the decoder's input sum to the explained
    logit (biases and additive embeddings zeroed), and eager and sdpa attention agree, under both presets."""
    generator = torch.Generator().manual_seed(1)
    source, target = (torch.randn(BATCH, n, HIDDEN, generator=generator, dtype=F64) for n in (TOKENS, 4))
    relevance = {}
    for implementation in ("eager", "sdpa"):
        for preset in sorted(PRESETS):
            model = SEQ2SEQ[name].build(implementation)
            zero_additive(model)
            lrp = LRP(Called(model, seq2seq), PRESETS[preset](), in_keys=["source", "target"], out_keys=["y"])
            td = lrp(TensorDict({"source": source, "target": target}, batch_size=[BATCH]))
            relevance[implementation, preset] = torch.cat(
                [td["relevance", k].flatten(1) for k in ("source", "target")], 1
            )
            logit = td["y"].max(-1).values
            error = ((relevance[implementation, preset].sum(1) - logit).abs() / logit.abs()).max()
            if preset == "cplrp":
                assert error <= 1e-6, (implementation, error)
            assert td["relevance", "source"].abs().sum() > 0 and td["relevance", "target"].abs().sum() > 0
    for preset in PRESETS:
        assert relative_error(relevance["sdpa", preset], relevance["eager", preset]) <= 1e-6


def test_an_attention_mask_given_as_an_input_key_is_fed_but_not_explained():
    """A plain module's ``in_keys`` are its inputs, so the integer mask is one of the explained inputs: the error
    says how to feed it without explaining it (a ``TensorDictModule``, and ``in_keys`` for the wrapper), and that
    way the embeddings are explained, none on the padding."""
    model, x = ZOO["llama"].build("sdpa"), model_input(ZOO["llama"])
    mask = torch.ones(BATCH, TOKENS, dtype=torch.long)
    mask[0, :PADDED] = 0
    td = TensorDict(embeds=x, attention_mask=mask, batch_size=[BATCH])
    plain = LRP(Called(model, with_mask), PRESETS["cplrp"](), in_keys=["embeds", "attention_mask"], out_keys=["y"])
    with pytest.raises(TypeError, match="'attention_mask' holds integer tokens.*TensorDictModule.*in_keys"):
        plain(td)
    module = TensorDictModule(Called(model, with_mask), in_keys=["embeds", "attention_mask"], out_keys=["y"])
    explained = LRP(module, PRESETS["cplrp"](), in_keys=["embeds"])(td)
    assert list(explained["relevance"].keys()) == ["embeds"]
    relevance = explained["relevance", "embeds"]
    assert torch.equal(relevance[0, :PADDED], torch.zeros(PADDED, HIDDEN, dtype=F64))
    assert relevance[0, PADDED:].abs().sum() > 0


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("name", sorted(SEQ2SEQ))
def test_token_ids_of_both_sequences_are_explained_through_their_embeddings(name: str, preset: str):
    """BART's learned positions are an ``nn.Embedding`` that reads the token ids for their shape only and looks
    up positions: the ids are embedded once, by the token embedding (it was refused as embedded twice). Each
    token's relevance is that of its embedding, as when the model is fed the embeddings, and nothing is warned
    of (looking at what an embedding reads was reported as a nonlinear call of the model)."""
    model = SEQ2SEQ[name].build("sdpa")
    generator = torch.Generator().manual_seed(0)
    source, target = (torch.randint(3, 64, (BATCH, n), generator=generator) for n in (TOKENS, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from_ids = LRP(Called(model, seq2seq_tokens), PRESETS[preset](), in_keys=["source", "target"], out_keys=["y"])(
            TensorDict({"source": source, "target": target}, batch_size=[BATCH])
        )
    # BART's encoder hands its positions a view of the embeddings, for their shape: no call of the model.
    assert [str(w.message) for w in caught] == []
    embeds = {"source": model.get_encoder().embed_tokens(source), "target": model.get_decoder().embed_tokens(target)}
    from_embeds = LRP(Called(model, seq2seq), PRESETS[preset](), in_keys=["source", "target"], out_keys=["y"])(
        TensorDict({key: value.detach() for key, value in embeds.items()}, batch_size=[BATCH])
    )
    torch.testing.assert_close(from_ids["y"], from_embeds["y"])
    for key in ("source", "target"):
        assert relative_error(from_ids["relevance", key], from_embeds["relevance", key].sum(-1)) <= 1e-12


class ShapeReadingPositions(nn.Embedding):
    """Learned positions that read the token ids for their shape only, as BART's do."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(torch.arange(ids.shape[-1]).expand_as(ids))


class TokensAndPositions(nn.Module):
    def __init__(self, shape_reading: bool) -> None:
        super().__init__()
        self.words = nn.Embedding(8, 4, dtype=F64)
        self.positions = (ShapeReadingPositions if shape_reading else nn.Embedding)(8, 4, dtype=F64)
        self.head = nn.Linear(4, 2, dtype=F64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.words(tokens) + self.positions(tokens)).sum(1)


def test_an_embedding_that_reads_the_ids_without_looking_them_up_does_not_embed_them():
    tokens = torch.randint(0, 8, (2, 5), generator=torch.Generator().manual_seed(0))
    td = TensorDict(tokens=tokens, batch_size=[2])
    model = TokensAndPositions(shape_reading=True)
    relevance = LRP(model, in_keys=["tokens"], out_keys=["y"], layers={"words": "words"})(td)
    torch.testing.assert_close(relevance["relevance", "tokens"], relevance["relevance", "words"].sum(-1))
    with pytest.raises(ValueError, match="'tokens' is embedded twice .again by 'positions'"):
        LRP(TokensAndPositions(shape_reading=False), in_keys=["tokens"], out_keys=["y"])(td)  # two lookups


def classifier(name: str) -> Architecture:
    """The sequence classifier of an encoder-decoder of SEQ2SEQ, its inputs ending with the end-of-sequence token."""
    architecture = SEQ2SEQ[name]
    values = dict(architecture.values, pad_token_id=0, eos_token_id=2)
    return Architecture(
        architecture.config, architecture.model.replace("ConditionalGeneration", "SequenceClassification"), values
    )


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("name", sorted(SEQ2SEQ))
def test_a_decoder_input_shifted_from_the_explained_tokens_is_refused_naming_the_embedding(name: str, preset: str):
    """BART's and T5's sequence classifiers make the decoder's input by shifting their ``input_ids``: the decoder's
    embedding of the shifted ids took no relevance to the tokens, and CP-LRP's relevance summed to 3.4 (BART) and
    -5.6 (T5) times the logit without a word. The call is refused, naming the key and the decoder's embedding; the
    decoder's input given as a key of its own is explained."""
    model = classifier(name).build("sdpa")
    zero_additive(model)
    tokens = torch.randint(3, 64, (BATCH, TOKENS), generator=torch.Generator().manual_seed(0))
    tokens[:, -1] = 2
    td = TensorDict({"source": tokens}, batch_size=[BATCH])
    lrp = LRP(
        Called(model, lambda m, ids: m(input_ids=ids).logits), PRESETS[preset](), in_keys=["source"], out_keys=["y"]
    )
    with pytest.raises(ValueError, match=r"'source' reaches 'model\.[.\w]*decoder\.embed_tokens' .*through token"):
        lrp(td)
    assert set(td.keys()) == {"source"}
    shifted = model._shift_right(tokens) if name == "t5" else transformers_shift(tokens, model.config)
    call = lambda m, ids, decoder_ids: m(input_ids=ids, decoder_input_ids=decoder_ids).logits  # noqa: E731
    both = LRP(Called(model, call), PRESETS[preset](), in_keys=["source", "target"], out_keys=["y"])(
        TensorDict({"source": tokens, "target": shifted}, batch_size=[BATCH])
    )
    torch.testing.assert_close(both["y"], model(input_ids=tokens).logits)
    assert both["relevance", "source"].abs().sum() > 0 and both["relevance", "target"][:, 1:].abs().sum() > 0


def transformers_shift(tokens: torch.Tensor, config) -> torch.Tensor:
    from transformers.models.bart.modeling_bart import shift_tokens_right

    return shift_tokens_right(tokens, config.pad_token_id, config.decoder_start_token_id)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_funnel_fed_token_ids_is_explained_as_when_fed_their_embeddings(preset: str):
    """Funnel's embeddings look the ids up in ``word_embeddings`` and normalise them, and its attention compares
    token types (``token_type_ids[:, :, None] == token_type_ids[:, None]``): the ids are embedded once, and each
    token's relevance is that of its embedding, as when the model is fed ``inputs_embeds``; under CP-LRP, with
    biases and additive embeddings zeroed, it sums to the explained logit."""
    model = ZOO["funnel"].build("eager")
    zero_additive(model)
    tokens = torch.randint(0, 64, (BATCH, TOKENS), generator=torch.Generator().manual_seed(0))
    from_ids = LRP(
        Called(model, lambda m, ids: m(input_ids=ids).logits), PRESETS[preset](), in_keys=["ids"], out_keys=["y"]
    )(TensorDict(ids=tokens, batch_size=[BATCH]))
    embeds = model.get_input_embeddings()(tokens).detach()
    from_embeds = LRP(Explained(model), PRESETS[preset](), in_keys=["x"], out_keys=["y"])(
        TensorDict(x=embeds, batch_size=[BATCH])
    )
    torch.testing.assert_close(from_ids["y"], from_embeds["y"])
    assert relative_error(from_ids["relevance", "ids"], from_embeds["relevance", "x"].sum(-1)) <= 1e-12
    if preset == "cplrp":
        logit = from_ids["y"].max(-1).values
        assert (from_ids["relevance", "ids"].sum(-1) - logit).abs().max() <= 1e-6 * logit.abs().max()
