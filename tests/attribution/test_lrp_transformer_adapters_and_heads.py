"""Hugging Face language models as people adapt and use them: LoRA adapters (peft), reward models and sequence
classifiers on left-padded batches, encoder-decoders on a padded source, and sentence-embedding similarity.

The models are built as in the zoo (tiny random configs, float64, weights scaled up). Oracles: the model with its
adapters merged into its weights (peft's ``merge_and_unload()``), the same sequence explained alone, CP-LRP's
conservation with biases and additive embeddings zeroed, and the closed form of CP-LRP on a product of two
normalised embeddings (norms held, each factor half of each element's relevance) given as a callable target.

The presets give Linear layers LRP-0 (no stabiliser, ``epsilon=None``), so a LoRA layer's three Linear modules and
the merged layer give the same relevance up to rounding: the tolerance is 1e-10, not the ε-rule's. With an ε on
the Linear layers they differ (tests/attribution/test_lrp_adapters.py).
"""

from __future__ import annotations

import copy
import warnings

import peft
import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import LRP
from tests.attribution.test_lrp_huggingface_usage import CLASSIFIERS, NO_GQA, build
from tests.attribution.test_lrp_transformer_calls import SEQ2SEQ, Called
from tests.attribution.test_lrp_transformer_zoo import (
    BATCH,
    HIDDEN,
    PRESETS,
    TOKENS,
    ZOO,
    Architecture,
    zero_additive,
)
from tests.conftest import relative_error

F64 = torch.float64
CONSERVATION_TOLERANCE = 1e-6  # the zoo's: several norms compute in float32 whatever the model's dtype
PADDED = 3


def explain(module: nn.Module, preset: str, inputs: dict, fed: dict | None = None, **options) -> TensorDict:
    """The wrapper's result on the tensors of ``inputs`` (explained), with those of ``fed`` given but not explained;
    no warning may be raised."""
    fed = fed or {}
    wrapped = TensorDictModule(module, in_keys=[*inputs, *fed], out_keys=["y"])
    batch = next(iter(inputs.values())).shape[0]
    lrp = LRP(wrapped, PRESETS[preset](), in_keys=list(inputs), **options)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return lrp(TensorDict({**{k: v.clone() for k, v in inputs.items()}, **fed}, batch_size=[batch]))


def conservation_error(td: TensorDict, keys: list[str], target: torch.Tensor) -> float:
    total = sum(td["relevance", key].flatten(1).sum(1) for key in keys)
    return ((total - target) / target).abs().max().item()


def chosen(y: torch.Tensor) -> torch.Tensor:
    """The logit the default target explains: the largest of each row."""
    return y.gather(1, y.argmax(1, keepdim=True)).squeeze(1)


def logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(inputs_embeds=x).logits
    return out[:, -1] if out.dim() == 3 else out


# ---------------------------------------------------------------------------------------------------------------
# LoRA adapters (peft)

LORA_TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],  # transformers' Conv1D: weights stored (in, out)
    "bert": ["query", "key", "value", "dense"],
}
BERT = Architecture("BertConfig", "BertForSequenceClassification", NO_GQA)


def adapted(name: str, implementation: str, **lora) -> tuple[nn.Module, nn.Module]:
    """A zoo model with LoRA adapters of rank 4 (random, as trained ones are: peft starts B at zero), biases and
    additive embeddings zeroed, in eval mode; and a copy with the adapters merged into the weights."""
    base = (BERT if name == "bert" else ZOO[name]).build(implementation)
    zero_additive(base)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS[name], fan_in_fan_out=name == "gpt2", **lora)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's notes on fan_in_fan_out and on the tied lm_head
        model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if "lora_A" in parameter_name or "lora_B" in parameter_name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=F64) * 0.5)
            elif "lora_magnitude" in parameter_name:
                parameter.mul_(1 + 0.3 * torch.rand(parameter.shape, generator=generator, dtype=F64))
    model.eval()
    return model, copy.deepcopy(model).merge_and_unload()


@pytest.mark.parametrize(
    "name, implementation, preset, lora",
    [
        ("llama", "sdpa", "cplrp", dict(lora_dropout=0.1)),  # dropout of the adapter's input, off in eval mode
        ("llama", "eager", "attnlrp", dict(use_dora=True)),  # magnitudes over the merged weight's column norms
        ("gpt2", "eager", "cplrp", dict(use_dora=True)),
        ("gpt2", "sdpa", "attnlrp", dict(lora_dropout=0.1)),
        ("bert", "sdpa", "cplrp", dict(use_rslora=True)),
        ("bert", "eager", "attnlrp", {}),
    ],
)
def test_lora_adapters_are_explained_as_the_merged_model(name: str, implementation: str, preset: str, lora: dict):
    """Each LoRA layer computes ``W x + s · B(A x)`` (DoRA rescales it by magnitudes over the merged weight's norms,
    a constant of the call): under both presets the relevance is that of the model with the adapters merged, and
    under CP-LRP it conserves the logit."""
    model, merged = adapted(name, implementation, **lora)
    x = torch.randn(BATCH, TOKENS, HIDDEN, dtype=F64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), model.disable_adapter():
        assert (logits(model, x) - logits(merged, x)).abs().max() > 0.1  # the adapters change the logits
    unmerged = explain(Called(model, logits), preset, {"x": x})
    reference = explain(Called(merged, logits), preset, {"x": x})
    torch.testing.assert_close(unmerged["y"], reference["y"], rtol=1e-10, atol=1e-10)
    assert relative_error(unmerged["relevance", "x"], reference["relevance", "x"]) <= 1e-10
    if preset == "cplrp":
        assert conservation_error(unmerged, ["x"], chosen(unmerged["y"])) <= CONSERVATION_TOLERANCE


OTHER_ADAPTERS = {  # peft's other adapters of Linear layers, on a Llama's attention and MLP
    "oft": lambda: peft.OFTConfig(r=0, oft_block_size=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    "ia3": lambda: peft.IA3Config(target_modules=["q_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]),
    "lokr": lambda: peft.LoKrConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    "vera": lambda: peft.VeraConfig(r=4, target_modules=["q_proj", "v_proj"]),
}


@pytest.mark.parametrize(
    "kind, preset", [("oft", "cplrp"), ("oft", "attnlrp"), ("ia3", "attnlrp"), ("lokr", "cplrp"), ("vera", "cplrp")]
)
def test_other_adapters_are_explained_as_the_merged_model(kind: str, preset: str):
    """OFT rotates a layer's input by a block-diagonal orthogonal matrix that it builds in place from its
    parameters (``torch.zeros(...)[rows, cols] = vec``, then ``add_``): the rotation was taken for an activation, so
    its product with the signal got the uniform rule of two activations, and the relevance was 0.69 (CP-LRP) and
    0.52 (AttnLRP) away from the merged model's, without a word (CP-LRP kept a third of the logit). IA³ scales
    activations by learned vectors, LoKr adds a Kronecker product of small matrices and VeRA shared random
    projections with learned scales: all are explained as the model with the adapters merged."""
    base = ZOO["llama"].build("sdpa")
    zero_additive(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers renames is_gradient_checkpointing, which peft asks
        model = get_peft_model(base, OTHER_ADAPTERS[kind]())
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad:  # the adapters' (the base model is frozen): as trained, not as initialised
                parameter.add_(torch.randn(parameter.shape, generator=generator, dtype=F64) * 0.3)
    model.eval()
    merged = copy.deepcopy(model).merge_and_unload()
    x = torch.randn(BATCH, TOKENS, HIDDEN, dtype=F64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), model.disable_adapter():
        assert (logits(model, x) - logits(merged, x)).abs().max() > 0.1  # the adapters change the logits
    adapted = explain(Called(model, logits), preset, {"x": x})
    reference = explain(Called(merged, logits), preset, {"x": x})
    torch.testing.assert_close(adapted["y"], reference["y"], rtol=1e-10, atol=1e-10)
    assert relative_error(adapted["relevance", "x"], reference["relevance", "x"]) <= 1e-10
    if preset == "cplrp":
        assert conservation_error(adapted, ["x"], chosen(adapted["y"])) <= CONSERVATION_TOLERANCE


def adapted_embedding() -> tuple[nn.Module, nn.Module]:
    """A Llama with a LoRA adapter on its token embedding (peft adds ``F.embedding(ids, A.T) @ B.T · s`` to the
    embedding's lookup) and on its queries; and the merged copy."""
    base = ZOO["llama"].build("sdpa")
    zero_additive(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers renames is_gradient_checkpointing, which peft asks
        model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"]))
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if "lora_" in parameter_name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=F64) * 0.5)
    model.eval()
    return model, copy.deepcopy(model).merge_and_unload()


def from_ids(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits[:, -1]


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_lora_adapter_on_the_embedding_explained_from_token_ids_is_refused_naming_it(preset: str):
    """The token ids were explained through the embedding's base layer alone: the adapter's lookup of the same ids
    (its rows held constant) lost its relevance without a word: on a tiny Llama the token relevance was 1.0 away
    from the merged model's (relative L2), and under CP-LRP it summed to 0.4 % to 0.6 % of the logit instead of all
    of it. The call is refused, naming
    the key, the embedding and the adapter's parameter; the embeddings the adapted model computes, explained as
    ``inputs_embeds``, give each token the relevance the merged model gives its id."""
    model, merged = adapted_embedding()
    ids = torch.randint(3, 64, (BATCH, TOKENS), generator=torch.Generator().manual_seed(2))
    with pytest.raises(
        ValueError,
        match=r"input key 'x' is embedded by '.*embed_tokens.base_layer' and also indexes a view of parameter "
        r"'.*embed_tokens.lora_embedding_A.default' \(shape \(64, 4\)\) outside an nn.Embedding.*merge_and_unload",
    ):
        explain(Called(model, from_ids), preset, {"x": ids})
    reference = explain(Called(merged, from_ids), preset, {"x": ids})
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
    adapted_embeds = explain(Called(model, logits), preset, {"x": embeds})
    torch.testing.assert_close(adapted_embeds["y"], reference["y"], rtol=1e-10, atol=1e-10)
    assert relative_error(adapted_embeds["relevance", "x"].sum(-1), reference["relevance", "x"]) <= 1e-10
    if preset == "cplrp":
        assert conservation_error(reference, ["x"], chosen(reference["y"])) <= CONSERVATION_TOLERANCE


VIRTUAL = 4  # virtual tokens of a prompt-tuned model


def prompt_tuned(kind: str) -> nn.Module:
    """A Llama with peft's prompt tuning (learned virtual tokens before the input's embeddings) or prefix tuning
    (learned keys and values of virtual tokens in every layer), the virtual tokens random as trained ones are."""
    base = ZOO["llama"].build("sdpa")
    zero_additive(base)
    config = (peft.PromptTuningConfig if kind == "prompt" else peft.PrefixTuningConfig)(
        task_type=peft.TaskType.CAUSAL_LM, num_virtual_tokens=VIRTUAL
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers renames is_gradient_checkpointing, which peft asks
        model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for parameter in model.prompt_encoder.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    return model.eval()


def test_prompt_tuning_virtual_tokens_are_read_from_the_embeddings_the_model_builds():
    """A prompt-tuned model puts its learned virtual tokens before the input's embeddings: explained from the
    input's embeddings, the tokens get their relevance and the virtual tokens' share is reported nowhere (under
    CP-LRP the tokens keep 76 % and 79 % of the logit here). The embeddings the model builds
    (``model.get_prompt(batch)`` then the input's) explained through ``model.get_base_model()`` give the same logits,
    the tokens the same relevance, and the virtual tokens the rest: the two conserve the logit together."""
    model = prompt_tuned("prompt")
    embeds = torch.randn(BATCH, TOKENS, HIDDEN, dtype=F64, generator=torch.Generator().manual_seed(1))
    tokens = explain(Called(model, logits), "cplrp", {"x": embeds})
    with torch.no_grad():
        virtual = model.get_prompt(batch_size=BATCH).to(F64)
    built = explain(Called(model.get_base_model(), logits), "cplrp", {"x": torch.cat([virtual, embeds], 1)})
    torch.testing.assert_close(built["y"], tokens["y"], rtol=1e-10, atol=1e-10)
    assert relative_error(built["relevance", "x"][:, VIRTUAL:], tokens["relevance", "x"]) <= 1e-10
    assert conservation_error(built, ["x"], chosen(built["y"])) <= CONSERVATION_TOLERANCE
    shares = built["relevance", "x"][:, :VIRTUAL].flatten(1).sum(1) / chosen(built["y"])
    assert (shares.abs() > 0.1).all(), shares  # a share the tokens alone do not show
    assert conservation_error(tokens, ["x"], chosen(tokens["y"])) > 0.1


def test_prefix_tuning_virtual_keys_and_values_are_a_cache_whose_share_the_tokens_leave():
    """Prefix tuning gives every layer learned keys and values of virtual tokens: a KV cache, a constant of the call,
    which gets no relevance. Under CP-LRP with biases zeroed the tokens' relevance leaves the prefix's share of the
    logit (6 % and 13 % here); the same model with its adapter disabled conserves."""
    model = prompt_tuned("prefix")
    embeds = torch.randn(BATCH, TOKENS, HIDDEN, dtype=F64, generator=torch.Generator().manual_seed(1))
    wrapped = TensorDictModule(Called(model, logits), in_keys=["x"], out_keys=["y"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens = LRP(wrapped, PRESETS["cplrp"]())(TensorDict(x=embeds.clone(), batch_size=[BATCH]))
    assert not [w for w in caught if "LRP" in str(w.message)]  # transformers' word on peft's past_key_values alone
    with model.disable_adapter():
        plain = explain(Called(model, logits), "cplrp", {"x": embeds})
    assert conservation_error(plain, ["x"], chosen(plain["y"])) <= CONSERVATION_TOLERANCE
    assert conservation_error(tokens, ["x"], chosen(tokens["y"])) > 0.05


# ---------------------------------------------------------------------------------------------------------------
# Sequence classifiers and reward models on left-padded batches


def classify(model: nn.Module, ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor):
    return model(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids).logits


@pytest.mark.parametrize(
    "name, implementation, preset, labels",
    [
        ("llama", "sdpa", "cplrp", 3),
        ("llama", "sdpa", "attnlrp", 1),  # a reward model: one score, explained as it is
        ("gpt2", "eager", "cplrp", 1),
        ("gpt2", "sdpa", "attnlrp", 3),
    ],
)
def test_a_left_padded_batch_is_explained_as_each_sequence_alone(name: str, implementation: str, preset: str, labels):
    """Llama and GPT-2 classifiers pool the last token that is not padding (found by comparing the explained ids with
    the pad token); padded on the left, with the mask and the position ids that skip the padding, each row's logits
    and token relevance are those of its tokens alone, the padding gets none, and under CP-LRP (biases zeroed) the
    relevance sums to the explained logit or score. (transformers' eager Llama gives NaN logits in float64 for a
    left-padded row: docs/transformers.md.)"""
    config, model_class, values = CLASSIFIERS[name]
    model = build(config, model_class, implementation, **values)
    model.score = nn.Linear(HIDDEN, labels, bias=False).to(F64)
    nn.init.normal_(model.score.weight, std=3.0, generator=torch.Generator().manual_seed(3))
    model.config.num_labels = labels
    if preset == "cplrp":
        zero_additive(model)
    pad = model.config.pad_token_id
    ids = torch.randint(3, 64, (BATCH, TOKENS), generator=torch.Generator().manual_seed(2))
    ids[0, :PADDED] = pad
    mask = (ids != pad).long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    padded = explain(Called(model, classify), preset, {"x": ids}, {"a": mask, "p": positions})
    for row, start in ((0, PADDED), (1, 0)):
        alone_ids = ids[row : row + 1, start:]
        alone = explain(
            Called(model, classify),
            preset,
            {"x": alone_ids},
            {"a": torch.ones_like(alone_ids), "p": torch.arange(TOKENS - start)[None]},
        )
        torch.testing.assert_close(padded["y"][row], alone["y"][0], rtol=1e-10, atol=1e-10)
        assert relative_error(padded["relevance", "x"][row, start:], alone["relevance", "x"][0]) <= 1e-10
    assert torch.equal(padded["relevance", "x"][0, :PADDED], torch.zeros(PADDED, dtype=F64))
    if preset == "cplrp":
        score = chosen(padded["y"]) if labels > 1 else padded["y"][:, 0]
        assert conservation_error(padded, ["x"], score) <= CONSERVATION_TOLERANCE


# ---------------------------------------------------------------------------------------------------------------
# Encoder-decoders on a padded source


def seq2seq(model: nn.Module, source: torch.Tensor, target: torch.Tensor, attention_mask: torch.Tensor):
    return model(inputs_embeds=source, decoder_inputs_embeds=target, attention_mask=attention_mask).logits[:, -1]


@pytest.mark.parametrize("name, implementation, preset", [("t5", "sdpa", "cplrp"), ("bart", "eager", "attnlrp")])
def test_an_encoder_decoder_on_a_padded_source_explains_each_pair_alone(name: str, implementation: str, preset: str):
    """A decoder logit explained on the encoder's and the decoder's embeddings, the first source padded on the right
    (its attention mask given): the padding gets no relevance, the pair's relevance is that of the unpadded pair, and
    under CP-LRP (biases and additive embeddings zeroed) the two inputs' relevance together conserves the logit."""
    model = SEQ2SEQ[name].build(implementation)
    if preset == "cplrp":
        zero_additive(model)
    generator = torch.Generator().manual_seed(1)
    source = torch.randn(BATCH, TOKENS, HIDDEN, dtype=F64, generator=generator)
    target = torch.randn(BATCH, 4, HIDDEN, dtype=F64, generator=generator)
    mask = torch.ones(BATCH, TOKENS, dtype=torch.long)
    mask[0, TOKENS - PADDED :] = 0
    kept = TOKENS - PADDED
    padded = explain(Called(model, seq2seq), preset, {"s": source, "t": target}, {"a": mask})
    alone = explain(Called(model, seq2seq), preset, {"s": source[:1, :kept], "t": target[:1]}, {"a": mask[:1, :kept]})
    torch.testing.assert_close(padded["y"][:1], alone["y"], rtol=1e-10, atol=1e-10)
    assert relative_error(padded["relevance", "s"][:1, :kept], alone["relevance", "s"]) <= 1e-10
    assert relative_error(padded["relevance", "t"][:1], alone["relevance", "t"]) <= 1e-10
    assert torch.equal(padded["relevance", "s"][0, kept:], torch.zeros(PADDED, HIDDEN, dtype=F64))
    if preset == "cplrp":
        assert conservation_error(padded, ["s", "t"], chosen(padded["y"])) <= CONSERVATION_TOLERANCE


# ---------------------------------------------------------------------------------------------------------------
# Sentence-embedding similarity


def mean_pooled(model: nn.Module, embeds: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean pooling over the tokens the mask keeps (sentence-transformers' pooling)."""
    hidden = model(inputs_embeds=embeds, attention_mask=mask).last_hidden_state
    weights = mask[..., None].to(hidden.dtype)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)


SIMILARITIES = {  # the cosine similarity of two pooled embeddings, as users write it
    "normalize": lambda a, b: (F.normalize(a, dim=-1) * F.normalize(b, dim=-1)).sum(-1, keepdim=True),
    "matmul": lambda a, b: (F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).T).diagonal()[:, None],
    "written": lambda a, b: ((a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)))[:, None],
}
ENCODERS = {"bert": Architecture("BertConfig", "BertModel", NO_GQA), "llama": Architecture("LlamaConfig", "LlamaModel")}


@pytest.mark.parametrize(
    "encoder, implementation, similarity",
    [("bert", "eager", "normalize"), ("bert", "sdpa", "matmul"), ("llama", "sdpa", "written")],
)
def test_sentence_similarity_gives_each_sentence_half_of_the_cosine_under_cplrp(encoder, implementation, similarity):
    """Two sentences mean-pooled with their masks (the second padded), then their cosine similarity: CP-LRP holds
    the norms, so the cosine is a sum of products of the two pooled embeddings, each product giving each factor
    half. The oracle is the first sentence's pooled embedding explained alone with that half as a callable target
    (``a · b̂ / (2 |a|)``, which sums to half the cosine): each sentence gets exactly half of the cosine, the padding
    none."""
    model = ENCODERS[encoder].build(implementation)
    zero_additive(model)
    generator = torch.Generator().manual_seed(1)
    a, b = (torch.randn(BATCH, TOKENS, HIDDEN, dtype=F64, generator=generator) for _ in range(2))
    mask_a = torch.ones(BATCH, TOKENS, dtype=torch.long)
    mask_b = mask_a.clone()
    mask_b[1, TOKENS - PADDED :] = 0

    def cosine(m: nn.Module, x: torch.Tensor, y: torch.Tensor, mx: torch.Tensor, my: torch.Tensor) -> torch.Tensor:
        return SIMILARITIES[similarity](mean_pooled(m, x, mx), mean_pooled(m, y, my))

    td = explain(Called(model, cosine), "cplrp", {"a": a, "b": b}, {"ma": mask_a, "mb": mask_b})
    with torch.no_grad():
        pooled_b = F.normalize(mean_pooled(model, b, mask_b), dim=-1)
    half = explain(
        Called(model, mean_pooled),
        "cplrp",
        {"a": a},
        {"ma": mask_a},
        target=lambda pooled: pooled * pooled_b / (2 * pooled.norm(dim=-1, keepdim=True)),
    )
    assert relative_error(td["relevance", "a"], half["relevance", "a"]) <= 1e-10
    for key in ("a", "b"):
        shares = td["relevance", key].flatten(1).sum(1) / td["y"][:, 0]
        torch.testing.assert_close(shares, torch.full_like(shares, 0.5), rtol=0, atol=CONSERVATION_TOLERANCE)
    assert torch.equal(td["relevance", "b"][1, TOKENS - PADDED :], torch.zeros(PADDED, HIDDEN, dtype=F64))


COSINE_CALLS = {  # the cosine similarity of two pooled embeddings called as one function
    "function": lambda a, b: F.cosine_similarity(a, b, dim=-1)[:, None],
    "module": lambda a, b: nn.CosineSimilarity(dim=1)(a, b)[:, None],
}


@pytest.mark.parametrize("preset, call", [("cplrp", "function"), ("attnlrp", "module")])
def test_cosine_similarity_called_as_one_function_gets_the_relevance_of_the_cosine_written_out(preset, call):
    """``F.cosine_similarity`` (and ``nn.CosineSimilarity``, which calls it) is computed as the cosine written out,
    its norms held and its product under the preset's rule: the relevance of ``normalize(a) · normalize(b)`` summed,
    with no warning, and under CP-LRP each sentence half of the score (its plain gradient gave each a relevance
    summing to zero, the score being unchanged by the scale of either input)."""
    model = ENCODERS["bert"].build("sdpa")
    zero_additive(model)
    generator = torch.Generator().manual_seed(1)
    a, b = (torch.randn(BATCH, TOKENS, HIDDEN, dtype=F64, generator=generator) for _ in range(2))
    mask = torch.ones(BATCH, TOKENS, dtype=torch.long)

    def similarity(how):
        def cosine(m: nn.Module, x: torch.Tensor, y: torch.Tensor, mx: torch.Tensor, my: torch.Tensor):
            return how(mean_pooled(m, x, mx), mean_pooled(m, y, my))

        return Called(model, cosine)

    fed = {"ma": mask, "mb": mask}
    td = explain(similarity(COSINE_CALLS[call]), preset, {"a": a, "b": b}, fed)
    written = explain(similarity(SIMILARITIES["normalize"]), preset, {"a": a, "b": b}, fed)
    for key in ("a", "b"):
        assert relative_error(td["relevance", key], written["relevance", key]) <= 1e-10
    if preset == "cplrp":
        for key in ("a", "b"):
            shares = td["relevance", key].flatten(1).sum(1) / td["y"][:, 0]
            torch.testing.assert_close(shares, torch.full_like(shares, 0.5), rtol=0, atol=CONSERVATION_TOLERANCE)
