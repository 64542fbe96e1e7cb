"""LXT's AttnLRP on a Hugging Face model, run as a separate process.

LXT patches ``transformers`` classes for the whole process and supports only an
older ``transformers`` release, so the oracle runs in its own interpreter with
that release first on ``PYTHONPATH`` (see ``test_lrp_huggingface.py``).

Usage: ``python lxt_oracle.py CASE.pt RESULT.pt [CASE.pt RESULT.pt ...]``.
Each ``CASE.pt`` holds ``kind`` (a key of ``MODELS``), ``variant``
(``"attnlrp"`` or ``"cp"``, the same in every case of one process: LXT's patch
is process-wide), the config keyword arguments, a state dict, ``embeds``
[B, T, H] and ``target`` [B] (a vocabulary or class index per sample). Its
``RESULT.pt`` receives the relevance ``embeds * grad`` of the target logit (at
the last position for a language model), the logits, and the ``transformers``
version that produced them.
"""

from __future__ import annotations

import importlib
import sys

# The models LXT 2.1 has rules for: kind -> (config class, model class, ``transformers.models`` package, LXT
# variants). LXT's BERT rules are AttnLRP's only.
MODELS = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", "gpt2", ("attnlrp", "cp")),
    "llama": ("LlamaConfig", "LlamaForCausalLM", "llama", ("attnlrp", "cp")),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "qwen2", ("attnlrp", "cp")),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "qwen3", ("attnlrp", "cp")),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", "gemma3", ("attnlrp", "cp")),
    "bert": ("BertConfig", "BertForSequenceClassification", "bert", ("attnlrp",)),
}


def main(*paths: str) -> None:
    import torch

    if not paths or len(paths) % 2:
        raise ValueError("usage: lxt_oracle.py CASE.pt RESULT.pt [CASE.pt RESULT.pt ...]")
    cases = [(torch.load(case), result) for case, result in zip(paths[::2], paths[1::2], strict=True)]
    variants = {case["variant"] for case, _ in cases}
    if len(variants) != 1:
        raise ValueError(f"one variant per process (LXT patches process-wide), got {sorted(variants)}")
    (variant,) = variants
    for kind in sorted({case["kind"] for case, _ in cases}):
        patch(kind, variant)
    for case, result_path in cases:
        explain(case, result_path)


def patch(kind: str, variant: str) -> None:
    """LXT's rules on the ``transformers`` classes of ``kind``."""
    from lxt.efficient import monkey_patch

    package = MODELS[kind][2]
    modeling = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
    maps = importlib.import_module(f"lxt.efficient.models.{package}")
    monkey_patch(modeling, maps.attnLRP if variant == "attnlrp" else maps.cp_LRP)


def explain(case: dict, result_path: str) -> None:
    import torch
    import transformers

    config_name, model_name = MODELS[case["kind"]][:2]
    config_class, model_class = getattr(transformers, config_name), getattr(transformers, model_name)
    config = config_class(**case["config"])
    config._attn_implementation = "eager"
    model = model_class(config).to(torch.float64).eval()
    model.load_state_dict(case["state_dict"])
    embeds = case["embeds"].clone().requires_grad_(True)
    logits = model(inputs_embeds=embeds).logits
    logits = logits[:, -1] if logits.dim() == 3 else logits
    logits.gather(1, case["target"][:, None]).sum().backward()
    torch.save(
        {"relevance": (embeds * embeds.grad).detach(), "logits": logits.detach(), "version": transformers.__version__},
        result_path,
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
