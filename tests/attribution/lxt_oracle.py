"""LXT's AttnLRP on a Hugging Face model, run as a separate process.

LXT patches ``transformers`` classes for the whole process and supports only an
older ``transformers`` release, so the oracle runs in its own interpreter with
that release first on ``PYTHONPATH`` (see ``test_lrp_huggingface.py``).

Usage: ``python lxt_oracle.py CASE.pt RESULT.pt``. ``CASE.pt`` holds ``kind``
(``"gpt2"`` or ``"llama"``), ``variant`` (``"attnlrp"`` or ``"cp"``), the
config keyword arguments, a state dict, ``embeds`` [B, T, H] and ``target`` [B]
(a vocabulary index per sample). ``RESULT.pt`` receives the relevance
``embeds * grad`` of the last position's target logit, the logits, and the
``transformers`` version that produced them.
"""

from __future__ import annotations

import sys


def main(case_path: str, result_path: str) -> None:
    import torch
    import transformers
    from lxt.efficient import monkey_patch
    from transformers.models.gpt2 import modeling_gpt2
    from transformers.models.llama import modeling_llama

    case = torch.load(case_path)
    if case["kind"] == "gpt2":
        from lxt.efficient.models import gpt2 as maps

        modeling, config_class, model_class = modeling_gpt2, transformers.GPT2Config, transformers.GPT2LMHeadModel
    else:
        from lxt.efficient.models import llama as maps

        modeling, config_class, model_class = modeling_llama, transformers.LlamaConfig, transformers.LlamaForCausalLM
    monkey_patch(modeling, maps.attnLRP if case["variant"] == "attnlrp" else maps.cp_LRP)

    config = config_class(**case["config"])
    config._attn_implementation = "eager"
    model = model_class(config).to(torch.float64).eval()
    model.load_state_dict(case["state_dict"])
    embeds = case["embeds"].clone().requires_grad_(True)
    logits = model(inputs_embeds=embeds).logits[:, -1]
    logits.gather(1, case["target"][:, None]).sum().backward()
    torch.save(
        {"relevance": (embeds * embeds.grad).detach(), "logits": logits.detach(), "version": transformers.__version__},
        result_path,
    )


if __name__ == "__main__":
    main(*sys.argv[1:3])
