"""AttnLRP and CP-LRP on the Hugging Face models LXT has rules for (GPT-2, Llama, Qwen2, Qwen3, Gemma 3 and
BERT, the last under AttnLRP only), against LXT.

The models are tiny random configs with eager attention, in float64. tdhook
runs on the ``transformers`` release of the test extra; LXT, the oracle, runs
in a process of its own on the release it supports (``lxt_oracle.py``), on the
same weights and inputs.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from tensordict import TensorDict
from torch import nn
from transformers.models.gpt2 import modeling_gpt2
from transformers.models.llama import modeling_llama

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.rules import CPLRP, AttnLRP
from tests.attribution.lxt_oracle import MODELS
from tests.attribution.test_lrp_transformers import assert_restored, snapshot
from tests.conftest import relative_error

HERE = Path(__file__).resolve().parent
ORACLE_REQUIREMENTS = HERE / "lxt_oracle_requirements.txt"
# One per Python version: what is installed there (tokenizers, ...) is built for the interpreter that installed it.
ORACLE_DIR = HERE.parents[1] / ".oracle" / f"lxt-py{sys.version_info.major}{sys.version_info.minor}"
F64 = torch.float64
VARIANTS = {"attnlrp": AttnLRP, "cp": CPLRP}

CONFIGS = {
    "gpt2": dict(
        vocab_size=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    ),
    "llama": dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    ),
}
QWEN = dict(CONFIGS["llama"], max_window_layers=2)
CONFIGS |= {
    "qwen2": QWEN,
    "qwen3": dict(QWEN, head_dim=8),
    "gemma3": dict(CONFIGS["llama"], head_dim=8, sliding_window=4, tie_word_embeddings=True),
    "bert": {key: value for key, value in CONFIGS["llama"].items() if "_key_value_" not in key and "tie_" not in key}
    | dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3),
}
# Every kind and variant LXT has rules for.
ORACLE_CASES = [
    (kind, variant) for kind in sorted(CONFIGS) for variant in sorted(VARIANTS) if variant in MODELS[kind][3]
]


def build(kind: str, seed: int = 0) -> nn.Module:
    config_class, model_class = (getattr(transformers, name) for name in MODELS[kind][:2])
    config = config_class(**CONFIGS[kind])
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_class(config).to(F64).eval()
    with torch.no_grad():  # weights larger than the 0.02 init, so that every rule matters
        for param in model.parameters():
            param.mul_(10.0 if param.dim() > 1 else 1.0)
    return model


class LastLogits(nn.Module):
    """The language model's next-token logits (a classifier's logits), from embeddings."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        logits = self.model(inputs_embeds=embeds).logits
        return logits[:, -1] if logits.dim() == 3 else logits


@pytest.fixture(scope="session")
def lxt_pythonpath() -> str:
    """A directory holding LXT and the ``transformers`` release it supports (installed once, then reused)."""
    stamp = ORACLE_DIR / "requirements.txt"
    wanted = ORACLE_REQUIREMENTS.read_text()
    ORACLE_DIR.parent.mkdir(parents=True, exist_ok=True)
    # One install at a time: the workers of `pytest -n N` may each ask for it.
    with open(ORACLE_DIR.parent / "lxt.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not stamp.exists() or stamp.read_text() != wanted:
            command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade"]
            command += ["--target", str(ORACLE_DIR), "-r", str(ORACLE_REQUIREMENTS)]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                pytest.fail(f"cannot install the LXT oracle ({' '.join(command)}):\n{done.stderr}")
            stamp.write_text(wanted)
    return str(ORACLE_DIR)


def lxt_relevance(folder: Path, pythonpath: str, cases: dict[str, dict]) -> dict[str, dict]:
    """LXT's results for several cases of one variant, from one process of its own."""
    arguments = []
    for name, case in cases.items():
        torch.save(case, folder / f"{name}_case.pt")
        arguments += [str(folder / f"{name}_case.pt"), str(folder / f"{name}_result.pt")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([pythonpath, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(HERE / "lxt_oracle.py"), *arguments], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return {name: torch.load(folder / f"{name}_result.pt") for name in cases}


def lxt_inputs(kind: str) -> tuple[nn.Module, torch.Tensor]:
    """The model and the embeddings that tdhook and LXT explain."""
    model = build(kind)
    return model, model.get_input_embeddings()(torch.randint(0, 64, (4, 7))).detach()


@pytest.fixture(scope="module")
def lxt_results(tmp_path_factory, lxt_pythonpath: str) -> dict[tuple[str, str], dict]:
    """LXT's relevance of the predicted logit for each kind and variant: one process per variant, as LXT patches
    ``transformers`` process-wide."""
    results = {}
    for variant in sorted(VARIANTS):
        cases = {}
        for kind in (kind for kind, of in ORACLE_CASES if of == variant):
            model, embeds = lxt_inputs(kind)
            with torch.no_grad():
                target = LastLogits(model)(embeds).argmax(-1)
            config, state = CONFIGS[kind], model.state_dict()
            cases[kind] = {"kind": kind, "variant": variant, "config": config, "state_dict": state}
            cases[kind] |= {"embeds": embeds, "target": target}
        folder = tmp_path_factory.mktemp(f"lxt_{variant}")
        for kind, result in lxt_relevance(folder, lxt_pythonpath, cases).items():
            results[kind, variant] = {**result, "target": cases[kind]["target"]}
    return results


def cosine_per_sample(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return nn.functional.cosine_similarity(a.flatten(1), b.flatten(1), dim=1)


@pytest.mark.parametrize("kind, variant", ORACLE_CASES)
def test_agrees_with_lxt(kind: str, variant: str, lxt_results: dict):
    model, embeds = lxt_inputs(kind)
    lrp = LRP(LastLogits(model), VARIANTS[variant](), in_keys=["embeds"], out_keys=["logits"])
    td = lrp(TensorDict(embeds=embeds.clone(), batch_size=[4]))
    target = td["logits"].argmax(-1)

    oracle = lxt_results[kind, variant]
    assert torch.equal(oracle["target"], target)  # LXT explained the logit tdhook did
    assert oracle["version"].startswith("4."), oracle["version"]
    torch.testing.assert_close(oracle["logits"], td["logits"])  # the same model on both sides
    cosine = cosine_per_sample(td["relevance", "embeds"], oracle["relevance"])
    assert (cosine >= 0.999).all(), cosine
    # Far closer than that in fact: the same computation up to rounding (RMS norms run in float32).
    assert relative_error(td["relevance", "embeds"], oracle["relevance"]) <= 1e-6
    # The plain gradient × input is measurably different: the comparison can fail.
    leaf = embeds.clone().requires_grad_(True)
    logits = LastLogits(model)(leaf)
    (grad,) = torch.autograd.grad(logits.gather(1, target[:, None]).sum(), leaf)
    assert (cosine_per_sample(leaf.detach() * grad, oracle["relevance"]) < 0.99).any()


class NextTokenLogits(nn.Module):
    """The language model's next-token logits, from token ids."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits[:, -1]


def module_functions(kind: str) -> dict:
    """What a process-wide patch (LXT's way) would replace: the modeling module's functions and classes."""
    modeling = {"gpt2": modeling_gpt2, "llama": modeling_llama}[kind]
    return {name: value for name, value in vars(modeling).items() if callable(value)}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_current_release_forward_unchanged_and_model_restored(kind: str, variant: str):
    model = build(kind)
    embeds = model.get_input_embeddings()(torch.randint(0, 64, (3, 6))).detach()
    plain = LastLogits(model)(embeds)
    before, functions = snapshot(model), module_functions(kind)
    lrp = LRP(LastLogits(model), VARIANTS[variant](), in_keys=["embeds"], out_keys=["logits"])
    with lrp:
        td = lrp(TensorDict(embeds=embeds.clone(), batch_size=[3]))
        assert module_functions(kind) == functions  # nothing is patched process-wide, even inside the context
    assert torch.equal(td["logits"], plain)  # bit for bit
    assert torch.isfinite(td["relevance", "embeds"]).all() and td["relevance", "embeds"].abs().sum() > 0
    assert_restored(model, before)
    assert torch.equal(LastLogits(model)(embeds), plain)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_token_relevance_from_embeddings_and_from_token_ids(kind: str):
    model = build(kind)
    ids = torch.randint(0, 64, (3, 6))
    embeds = model.get_input_embeddings()(ids).detach()

    from_embeds = LRP(
        LastLogits(model), AttnLRP(), in_keys=["embeds"], out_keys=["logits"], token_relevance_key="token_relevance"
    )(TensorDict(embeds=embeds, batch_size=[3]))
    per_token = from_embeds["token_relevance", "embeds"]
    assert per_token.shape == (3, 6)
    torch.testing.assert_close(per_token, from_embeds["relevance", "embeds"].sum(-1), rtol=0, atol=0)

    # Token ids: relevance per token directly, and at the embedding layer's output through `layers`.
    embedding = "model.transformer.wte" if kind == "gpt2" else "model.model.embed_tokens"
    from_ids = LRP(
        NextTokenLogits(model),
        AttnLRP(),
        in_keys=["input_ids"],
        out_keys=["logits"],
        layers={embedding: "embedding"},
        token_relevance_key="token_relevance",
    )(TensorDict(input_ids=ids, batch_size=[3]))
    torch.testing.assert_close(from_ids["relevance", "input_ids"], per_token)
    torch.testing.assert_close(from_ids["token_relevance", "input_ids"], per_token)
    torch.testing.assert_close(from_ids["relevance", "embedding"], from_embeds["relevance", "embeds"])
    torch.testing.assert_close(from_ids["token_relevance", "embedding"], per_token)
