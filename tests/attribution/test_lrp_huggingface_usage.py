"""Hugging Face models called as users call them beyond one plain forward pass: a generation loop that keeps its
KV cache from step to step in one open context, padded batches explained through token ids and sequence
classifiers that pool the last real token, the keyword arguments that change what the model returns, task heads,
gradient modes and ``generate`` inside an open context.

The models are built as in the zoo (tiny random configs, float64, weights scaled up). Oracles: the same model called
without the feature (a padded sample against the sequence alone, a cached step against the whole sequence, token ids
against their embeddings, a plain call against one returning more), and CP-LRP's conservation with biases and
additive embeddings zeroed.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
import transformers
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import LRP
from tests.attribution.test_lrp_transformer_calls import SEQ2SEQ, Called
from tests.attribution.test_lrp_transformer_zoo import (
    BATCH,
    COMMON,
    HIDDEN,
    PRESETS,
    TOKENS,
    ZOO,
    scaled_up,
    zero_additive,
)
from tests.attribution.test_lrp_transformer_zoo_recurrent import RECURRENT
from tests.conftest import relative_error

F64 = torch.float64
PREFIX = 5  # tokens given as a cache before the explained steps (and a padded sample's tokens)
PADDED = 3  # left padding of the first sample


def next_token(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(inputs_embeds=x).logits[:, -1]


def explain(module: nn.Module, preset: str, x: torch.Tensor, fed: dict | None = None, **options) -> TensorDict:
    """The wrapper's result on ``x``, with the tensors of ``fed`` given to the module but not explained."""
    fed = fed or {}
    wrapped = TensorDictModule(module, in_keys=["x", *fed], out_keys=["y"])
    lrp = LRP(wrapped, PRESETS[preset](), in_keys=["x"], **options)
    return lrp(TensorDict({"x": x.clone(), **fed}, batch_size=[x.shape[0]]))


class GenerationStep(nn.Module):
    """One step of a generation loop: the next-token logits of the new tokens after the cache the loop keeps, which
    the step then replaces with the one the model returns (the loop's own cache object, appended to in place). An
    encoder-decoder is given its encoder's output."""

    def __init__(self, model: nn.Module, cache, encoder_outputs=None) -> None:
        super().__init__()
        self.model = model
        self.cache = cache
        self.encoder = {} if encoder_outputs is None else {"encoder_outputs": encoder_outputs}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        embeds = "decoder_inputs_embeds" if self.encoder else "inputs_embeds"
        out = self.model(**{embeds: x}, **self.encoder, past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        return out.logits[:, -1]


class InnerGenerationStep(GenerationStep):
    """A step that runs the causal model's inner model on the cache, then its head on the last hidden state."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.model.model(inputs_embeds=x, past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        return self.model.lm_head(out.last_hidden_state[:, -1])


def decoder_model(name: str, implementation: str) -> tuple[nn.Module, dict]:
    """A causal model of the zoo, or T5 given a fixed source (its encoder's output then a constant of each step)."""
    if name != "t5":
        return ZOO[name.removesuffix("-inner")].build(implementation), {}
    model = SEQ2SEQ[name].build(implementation)
    source = torch.randn(BATCH, TOKENS, HIDDEN, dtype=F64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model, {"encoder_outputs": model.get_encoder()(inputs_embeds=source)}


@pytest.mark.parametrize(
    "name, implementation, preset",
    [
        ("llama", "sdpa", "cplrp"),
        ("llama-inner", "sdpa", "attnlrp"),
        ("gpt2", "eager", "attnlrp"),
        ("t5", "sdpa", "attnlrp"),
    ],
)
def test_a_generation_loop_keeping_its_cache_in_one_context_explains_each_step_as_the_whole_sequence(
    name: str, implementation: str, preset: str
):
    """A later call of a context may run the model twice (its graph is not the recorded one): each run appended the
    new token's keys and values to the loop's cache, so the second run saw the token twice. From the second step on
    the logits were off by up to 3.3 and the relevance by 0.13 to 10 times its norm (tiny Llama, GPT-2, T5), without a
    word, and the cache grew by three tokens a step. Each step now gives the logits and the relevance that the whole
    sequence gives the new token, and the cache grows by one token a step."""
    model, encoder = decoder_model(name, implementation)
    x = torch.randn(BATCH, TOKENS, HIDDEN, dtype=F64, generator=torch.Generator().manual_seed(1))
    keyword = "decoder_inputs_embeds" if encoder else "inputs_embeds"
    whole = {
        t: explain(Called(model, lambda m, e: m(**{keyword: e}, **encoder).logits[:, -1]), preset, x[:, : t + 1])
        for t in range(PREFIX, TOKENS)
    }
    with torch.no_grad():
        cache = model(**{keyword: x[:, :PREFIX]}, **encoder, use_cache=True).past_key_values
    step = (InnerGenerationStep if name.endswith("-inner") else GenerationStep)(model, cache, **encoder)
    lrp = LRP(step, PRESETS[preset](), in_keys=["x"], out_keys=["y"])
    with lrp, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers renames past_key_values
        for t in range(PREFIX, TOKENS):
            td = lrp(TensorDict(x=x[:, t : t + 1].clone(), batch_size=[BATCH]))
            assert step.cache.get_seq_length() == t + 1
            torch.testing.assert_close(td["y"], whole[t]["y"])
            assert relative_error(td["relevance", "x"], whole[t]["relevance", "x"][:, t:]) <= 1e-10


class ChangingStep(GenerationStep):
    """A generation step whose graph changes after its first call (its first logit doubled)."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        logits = super().forward(x)
        return logits if self.calls == 1 else torch.cat([logits[:, :1] * 2, logits[:, 1:]], 1)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers renames past_key_values
def test_a_static_cache_written_in_place_in_a_call_that_runs_again_is_refused_naming_it():
    """A static cache writes the new keys into its own tensors: a call that runs the model again (a step whose graph
    changed) cannot put them back (autograd refused the second run's graph with an in-place error that named no
    cache). The error names the cache and what to do. A step explained in a call of its own, and a loop in one
    context whose steps keep one graph, are explained as the whole sequence (such a loop was refused too, from its
    first call after an explained one: the cache held that call's graph, freed, and each call ran again)."""
    model = ZOO["llama"].build("sdpa")
    steps = TOKENS + 2
    x = torch.randn(BATCH, steps, HIDDEN, dtype=F64, generator=torch.Generator().manual_seed(1))
    whole = {t: explain(Called(model, next_token), "cplrp", x[:, : t + 1]) for t in range(PREFIX, steps)}
    caches = [transformers.StaticCache(config=model.config, max_cache_len=steps) for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            model(inputs_embeds=x[:, :PREFIX], past_key_values=cache)
    step = GenerationStep(model, caches[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        alone = explain(step, "cplrp", x[:, PREFIX : PREFIX + 1])  # a call of its own
        assert relative_error(alone["relevance", "x"], whole[PREFIX]["relevance", "x"][:, PREFIX:]) <= 1e-10
        lrp = LRP(step, PRESETS["cplrp"](), in_keys=["x"], out_keys=["y"])
        with lrp:
            for t in range(PREFIX + 1, steps):
                td = lrp(TensorDict(x=x[:, t : t + 1].clone(), batch_size=[BATCH]))
                torch.testing.assert_close(td["y"], whole[t]["y"])
                assert relative_error(td["relevance", "x"], whole[t]["relevance", "x"][:, t:]) <= 1e-10
        lrp = LRP(ChangingStep(model, caches[1]), PRESETS["cplrp"](), in_keys=["x"], out_keys=["y"])
        with lrp, pytest.raises(RuntimeError, match=r"key-value cache .*\(StaticCache\) in place.*outside `with lrp:`"):
            for t in range(PREFIX, steps):
                lrp(TensorDict(x=x[:, t : t + 1].clone(), batch_size=[BATCH]))


@pytest.mark.parametrize("name, implementation, preset", [("gpt2", "eager", "cplrp"), ("qwen2", "sdpa", "attnlrp")])
def test_a_left_padded_generation_step_after_a_cache(name: str, implementation: str, preset: str):
    """Batched generation: the first prompt left-padded, its position ids taken from the mask, the prefix given as a
    cache. The step explains the new tokens as the whole padded call does, and that call explains the padded sample
    as its tokens alone, with nothing on the padding."""
    model = ZOO[name].build(implementation)
    x = torch.randn(BATCH, TOKENS, HIDDEN, dtype=F64, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(BATCH, TOKENS, dtype=torch.long)
    mask[0, :PADDED] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        cache = model(
            inputs_embeds=x[:, :PREFIX], attention_mask=mask[:, :PREFIX], position_ids=positions[:, :PREFIX]
        ).past_key_values

    def step(m: nn.Module, e: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor):
        kept = copy.deepcopy(cache)
        return m(inputs_embeds=e, attention_mask=attention_mask, position_ids=position_ids, past_key_values=kept)

    def whole_call(m: nn.Module, e: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor):
        return m(inputs_embeds=e, attention_mask=attention_mask, position_ids=position_ids)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        cached = explain(
            Called(model, lambda *a: step(*a).logits[:, -1]),
            preset,
            x[:, PREFIX:],
            {"attention_mask": mask, "position_ids": positions[:, PREFIX:]},
        )
    whole = explain(
        Called(model, lambda *a: whole_call(*a).logits[:, -1]),
        preset,
        x,
        {"attention_mask": mask, "position_ids": positions},
    )
    alone = explain(Called(model, next_token), preset, x[:1, PADDED:])
    torch.testing.assert_close(cached["y"], whole["y"])
    torch.testing.assert_close(whole["y"][:1], alone["y"])
    assert relative_error(cached["relevance", "x"], whole["relevance", "x"][:, PREFIX:]) <= 1e-10
    assert relative_error(whole["relevance", "x"][0, PADDED:], alone["relevance", "x"][0]) <= 1e-10
    assert torch.equal(whole["relevance", "x"][0, :PADDED], torch.zeros(PADDED, HIDDEN, dtype=F64))


def build(config: str, model: str, implementation: str, **values) -> nn.Module:
    """A task model of a zoo architecture's config (pad token 0)."""
    values = {key: value for key, value in {**COMMON, "pad_token_id": 0, **values}.items() if value is not None}
    built = getattr(transformers, config)(**values)
    built._attn_implementation = implementation
    built.num_labels = 2 if "QuestionAnswering" in model else 3
    torch.manual_seed(0)
    return scaled_up(getattr(transformers, model)(built).eval(), 10.0).to(F64)


NO_GQA = dict(num_key_value_heads=None, head_dim=None)
GPT2 = dict(NO_GQA, n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=64)
CLASSIFIERS = {  # each pools its own way: the first token (BERT), the last one that is not padding (Llama, GPT-2)
    "bert": ("BertConfig", "BertForSequenceClassification", NO_GQA),
    "roberta": ("RobertaConfig", "RobertaForSequenceClassification", dict(NO_GQA, pad_token_id=1)),
    "llama": ("LlamaConfig", "LlamaForSequenceClassification", {}),
    "gpt2": ("GPT2Config", "GPT2ForSequenceClassification", GPT2),
}


def classify(model: nn.Module, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=attention_mask).logits


@pytest.mark.parametrize(
    "name, implementation, preset",
    [
        ("bert", "eager", "attnlrp"),
        ("roberta", "sdpa", "cplrp"),
        ("llama", "sdpa", "attnlrp"),
        ("gpt2", "eager", "cplrp"),
    ],
)
def test_a_right_padded_batch_of_token_ids_is_explained_as_each_sequence_alone(name: str, implementation: str, preset):
    """Token ids explained through the embedding (its ``padding_idx`` the pad token), the second sample padded on the
    right with its attention mask: the classifier's logits and token relevance of the padded sample are those of
    its tokens alone, the padding gets none. Llama and GPT-2 find the token they pool by comparing the explained ids
    with the pad token; RoBERTa numbers its positions from them."""
    config, model_class, values = CLASSIFIERS[name]
    model = build(config, model_class, implementation, **values)
    pad = model.config.pad_token_id
    assert model.get_input_embeddings().padding_idx in (pad, None)
    ids = torch.randint(3, 64, (BATCH, TOKENS), generator=torch.Generator().manual_seed(2))
    ids[1, PREFIX:] = pad
    mask = (ids != pad).long()
    padded = explain(Called(model, classify), preset, ids, {"attention_mask": mask})
    alone = explain(Called(model, classify), preset, ids[1:, :PREFIX], {"attention_mask": mask[1:, :PREFIX]})
    torch.testing.assert_close(padded["y"][1:], alone["y"])
    assert padded["relevance", "x"].shape == (BATCH, TOKENS)
    assert relative_error(padded["relevance", "x"][1, :PREFIX], alone["relevance", "x"][0]) <= 1e-10
    assert torch.equal(padded["relevance", "x"][1, PREFIX:], torch.zeros(TOKENS - PREFIX, dtype=F64))
    assert padded["relevance", "x"][1, :PREFIX].abs().min() > 0


LABELS = torch.randint(0, 64, (BATCH, TOKENS), generator=torch.Generator().manual_seed(4))
RETURNING_MORE = {  # the same logits, the model returning more or in another form
    "use_cache": lambda m, x: m(inputs_embeds=x, use_cache=True).logits[:, -1],
    "output_hidden_states": lambda m, x: m(inputs_embeds=x, output_hidden_states=True).logits[:, -1],
    "output_attentions": lambda m, x: m(inputs_embeds=x, output_attentions=True).logits[:, -1],
    "return_dict": lambda m, x: m(inputs_embeds=x, return_dict=False)[0][:, -1],
    "labels": lambda m, x: m(inputs_embeds=x, labels=LABELS).logits[:, -1],
}


@pytest.mark.parametrize("implementation, preset", [("eager", "cplrp"), ("sdpa", "attnlrp")])
def test_returning_more_or_as_a_tuple_changes_no_relevance(implementation: str, preset: str):
    """A cache built on the full call, the hidden states and attention weights returned, a tuple instead of an
    output object, a loss computed from given labels, a call under ``torch.no_grad()``: the logits' relevance is the
    plain call's."""
    model, x = ZOO["llama"].build(implementation), torch.randn(BATCH, TOKENS, HIDDEN, dtype=F64)
    plain = explain(Called(model, lambda m, e: m(inputs_embeds=e, use_cache=False).logits[:, -1]), preset, x)
    for name, call in RETURNING_MORE.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            returned = explain(Called(model, call), preset, x)
        assert not [w for w in caught if "LRP" in str(w.message)], name
        torch.testing.assert_close(returned["y"], plain["y"], rtol=0, atol=1e-12)
        assert relative_error(returned["relevance", "x"], plain["relevance", "x"]) <= 1e-12, name
    with torch.no_grad():
        in_no_grad = explain(Called(model, RETURNING_MORE["use_cache"]), preset, x)
    assert relative_error(in_no_grad["relevance", "x"], plain["relevance", "x"]) <= 1e-12
    assert not in_no_grad["relevance", "x"].requires_grad


def test_explaining_the_loss_computed_inside_the_model_is_named_and_inference_mode_refused():
    """The loss a model computes from ``labels`` goes through a cross-entropy that no rule covers: the warning names
    the model and the function. Inference mode keeps the gradients relevance is made of: refused, saying so."""
    model, x = ZOO["gpt2"].build("sdpa"), torch.randn(BATCH, TOKENS, HIDDEN, dtype=F64)
    loss = Called(model, lambda m, e: m(inputs_embeds=e, labels=LABELS).loss.expand(e.shape[0])[:, None])
    with pytest.warns(UserWarning, match=r"module '(module\.)?model' \(GPT2LMHeadModel\) computes cross_entropy"):
        explain(loss, "cplrp", x)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="inference_mode"):
        explain(Called(model, next_token), "cplrp", x)


def test_generate_inside_an_open_context_gives_the_plain_tokens(preset: str = "attnlrp"):
    """``generate`` called while a context is open on the model (its rules on, its own cache, its own
    ``no_grad``) picks the tokens the plain model picks, and the context explains as before afterwards."""
    model = ZOO["llama"].build("sdpa")
    model.generation_config.pad_token_id = 0
    ids = torch.randint(3, 64, (BATCH, 4), generator=torch.Generator().manual_seed(5))
    tokens = model.generate(ids, max_new_tokens=4, do_sample=False)
    x = model.get_input_embeddings()(ids).detach()
    lrp = LRP(Called(model, next_token), PRESETS[preset](), in_keys=["x"], out_keys=["y"])
    with lrp:
        before = lrp(TensorDict(x=x, batch_size=[BATCH]))["relevance", "x"]
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), tokens)
        after = lrp(TensorDict(x=x, batch_size=[BATCH]))["relevance", "x"]
    assert torch.equal(before, after)
    assert relative_error(before, explain(Called(model, next_token), preset, x)["relevance", "x"]) <= 1e-12


HEADS = {  # a task head and the logit explained
    "bert-token": ("BertConfig", "BertForTokenClassification", NO_GQA, lambda out: out.logits[:, 2]),
    "bert-start": ("BertConfig", "BertForQuestionAnswering", NO_GQA, lambda out: out.start_logits),
    "bert-end": ("BertConfig", "BertForQuestionAnswering", NO_GQA, lambda out: out.end_logits),
    "bert-masked": ("BertConfig", "BertForMaskedLM", NO_GQA, lambda out: out.logits[:, 3]),
    "llama-start": ("LlamaConfig", "LlamaForQuestionAnswering", {}, lambda out: out.start_logits),
    "gpt2-token": ("GPT2Config", "GPT2ForTokenClassification", GPT2, lambda out: out.logits[:, PREFIX - 1]),
}


@pytest.mark.parametrize("name", sorted(HEADS))
def test_task_heads_conserve_under_cplrp_through_token_ids(name: str):
    """Token classification, question answering (start and end logits) and masked language modelling (BERT's
    decoder tied to its input embedding, whose ``padding_idx`` row a padded token looks up), explained from token
    ids with an attention mask: with biases and additive embeddings zeroed, CP-LRP's token relevance sums to the
    logit, the padding gets none, and the ids get the relevance their embeddings get."""
    config, model_class, values, logit = HEADS[name]
    model = build(config, model_class, "sdpa", **values)
    zero_additive(model)
    ids = torch.randint(3, 64, (BATCH, TOKENS), generator=torch.Generator().manual_seed(6))
    ids[1, PREFIX:] = model.config.pad_token_id
    mask = (ids != model.config.pad_token_id).long()
    from_ids = explain(
        Called(model, lambda m, i, a: logit(m(input_ids=i, attention_mask=a))), "cplrp", ids, {"a": mask}
    )
    explained = from_ids["y"].gather(1, from_ids["y"].argmax(1, keepdim=True)).squeeze(1)
    assert relative_error(from_ids["relevance", "x"].sum(1), explained) <= 1e-6
    assert torch.equal(from_ids["relevance", "x"][1, PREFIX:], torch.zeros(TOKENS - PREFIX, dtype=F64))
    embeds = model.get_input_embeddings()(ids).detach()
    from_embeds = explain(
        Called(model, lambda m, e, a: logit(m(inputs_embeds=e, attention_mask=a))), "cplrp", embeds, {"a": mask}
    )
    assert relative_error(from_ids["relevance", "x"], from_embeds["relevance", "x"].sum(-1)) <= 1e-12


class CacheStep(GenerationStep):
    """A generation step handing the model its cache as ``cache``, the name every model takes (a state-space
    model's included), and keeping the one it returns."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        embeds = "decoder_inputs_embeds" if self.encoder else "inputs_embeds"
        out = self.model(**{embeds: x}, **self.encoder, cache=self.cache, use_cache=True)
        self.cache = out.cache if "cache" in out else out.past_key_values
        return out.logits[:, -1]


def held_tensors(cache) -> list[torch.Tensor]:
    """Every tensor a cache holds: in its layers (keys and values, convolutions' and recurrent states) and, for an
    encoder-decoder, in its self- and cross-attention caches' layers."""
    found, objects = [], [cache]
    while objects:
        obj = objects.pop(0)
        for value in vars(obj).values():
            items = value.values() if isinstance(value, dict) else value if isinstance(value, list | tuple) else [value]
            for item in items:
                if isinstance(item, torch.Tensor):
                    found.append(item)
                elif type(item).__module__.startswith("transformers"):
                    objects.append(item)
    return found


def cached_model(name: str) -> tuple[nn.Module, dict]:
    """A causal model of the zoo, FalconMamba (its convolutions' and scan's states cached), or an encoder-decoder
    given a fixed source."""
    if name == "falcon_mamba":
        return RECURRENT[name].architecture.build("eager"), {}
    if name not in SEQ2SEQ:
        return ZOO[name].build("sdpa"), {}
    model = SEQ2SEQ[name].build("sdpa")
    source = torch.randn(BATCH, TOKENS, HIDDEN, dtype=F64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model, {"encoder_outputs": model.get_encoder()(inputs_embeds=source)}


@pytest.mark.filterwarnings("ignore")  # transformers renames the cache argument; the scan's exp is named
@pytest.mark.parametrize("grad_mode", [False, True])
@pytest.mark.parametrize("name", ["llama", "t5", "bart", "falcon_mamba"])
def test_an_explained_step_leaves_its_cache_as_a_plain_step_does_without_a_graph(name: str, grad_mode: bool):
    """The keys and values (a state-space model's states) a step writes into the cache it is handed come from a
    forward pass run with grad: they required grad and held that step's graph, so a generation loop's cache kept
    every explained step's graph alive (about 97 autograd nodes more each step on a tiny Llama), whatever the
    caller's grad mode. As the wrapper's outputs, the cache now ends detached, with the plain step's values, and
    each step's relevance is that of the step explained alone on the plain loop's cache. FalconMamba writes its
    states in place: its steps are explained each in a call of its own."""
    model, encoder = cached_model(name)
    x = torch.randn(BATCH, TOKENS, HIDDEN, dtype=F64, generator=torch.Generator().manual_seed(1))
    keyword = "decoder_inputs_embeds" if encoder else "inputs_embeds"
    with torch.no_grad():
        out = model(**{keyword: x[:, :PREFIX]}, **encoder, use_cache=True)
    plain = CacheStep(model, out.cache if "cache" in out else out.past_key_values, **encoder)
    step = CacheStep(model, copy.deepcopy(plain.cache), **encoder)
    alone, expected = {}, {}  # each step explained on a copy of the plain loop's cache; the plain loop's cache after it
    for t in range(PREFIX, TOKENS):
        alone[t] = explain(CacheStep(model, copy.deepcopy(plain.cache), **encoder), "attnlrp", x[:, t : t + 1])
        with torch.no_grad():
            plain(x[:, t : t + 1])
        expected[t] = [tensor.clone() for tensor in held_tensors(plain.cache)]  # a state written in place
    lrp = LRP(step, PRESETS["attnlrp"](), in_keys=["x"], out_keys=["y"])
    with contextlib.nullcontext() if name == "falcon_mamba" else lrp, torch.set_grad_enabled(grad_mode):
        for t in range(PREFIX, TOKENS):
            td = lrp(TensorDict(x=x[:, t : t + 1].clone(), batch_size=[BATCH]))
            held = held_tensors(step.cache)
            assert [tensor.shape for tensor in held if tensor.requires_grad] == []
            assert [tensor.shape for tensor in held] == [tensor.shape for tensor in expected[t]]
            for tensor, value in zip(held, expected[t], strict=True):
                torch.testing.assert_close(tensor, value, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(td["y"], alone[t]["y"], rtol=1e-12, atol=1e-12)
            assert relative_error(td["relevance", "x"], alone[t]["relevance", "x"]) <= 1e-10


@pytest.mark.filterwarnings("ignore")  # transformers renames the cache argument
def test_a_cache_the_model_makes_ends_detached_and_a_differentiable_wrapper_keeps_its_graph():
    """A first step handed no cache returns the one the model made: it ends detached too, with the plain step's
    values. With ``create_graph=True`` the wrapper keeps the graph of what it writes, the cache's included: a loss
    on the cache reaches the parameters as after a plain call with grad (its gradient the plain call's)."""
    model = ZOO["llama"].build("sdpa")
    x = torch.randn(BATCH, 1, HIDDEN, dtype=F64, generator=torch.Generator().manual_seed(1))
    plain = CacheStep(model, None)
    with torch.no_grad():
        plain(x)
    made = CacheStep(model, None)
    LRP(made, PRESETS["cplrp"](), in_keys=["x"], out_keys=["y"])(TensorDict(x=x.clone(), batch_size=[BATCH]))
    held = held_tensors(made.cache)
    assert held and not any(tensor.requires_grad for tensor in held)
    for tensor, value in zip(held, held_tensors(plain.cache), strict=True):
        torch.testing.assert_close(tensor, value, rtol=1e-12, atol=1e-12)
    weight = model.model.layers[0].self_attn.k_proj.weight
    plain = CacheStep(model, None)
    plain(x)
    expected = torch.autograd.grad(sum(tensor.square().sum() for tensor in held_tensors(plain.cache)), weight)[0]
    kept = CacheStep(model, None)
    lrp = LRP(kept, PRESETS["cplrp"](), in_keys=["x"], out_keys=["y"], create_graph=True)
    lrp(TensorDict(x=x.clone(), batch_size=[BATCH]))
    loss = sum(tensor.square().sum() for tensor in held_tensors(kept.cache))
    assert relative_error(torch.autograd.grad(loss, weight)[0], expected) <= 1e-10
