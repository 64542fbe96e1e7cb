"""docs/migrating.md: every pair of blocks, the peer's (zennit, captum, LXT) and tdhook's, gives the same relevance.

The page's blocks are run as written, in float64: the ``setup`` blocks build the models, which are then given
BatchNorm statistics far from the identity (and ``eps = 0``, see below) and a Llama with weights large enough for
every rule to matter; each case then runs its tdhook block and its peer's block in that namespace and compares the
results with the tolerance the page states. zennit and captum run in this process; LXT, which patches
``transformers`` 4 process-wide, runs in a process of its own (``tests/attribution/lxt_oracle.py``'s setting).
"""

from __future__ import annotations

import doctest
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.attribution.test_lrp_huggingface import lxt_pythonpath  # noqa: F401 (a fixture)
from tests.conftest import relative_error

PAGE = Path(__file__).resolve().parents[1] / "docs" / "migrating.md"
BLOCK = re.compile(r"<!-- (\w+)(?:: (\w+))? -->\n```python\n(.*?)```", re.S)
PEERS = ("zennit", "captum", "lxt")

# case -> (peer, {result name: relative tolerance the page states})
CASES = {
    "composite": ("zennit", {"relevance": 1e-10}),
    "layer_map_option": ("zennit", {"relevance": 1e-10}),
    "resnet": ("zennit", {"relevance": 1e-10}),
    "layer_map": ("zennit", {"relevance": 1e-10}),
    "name_map": ("zennit", {"relevance": 1e-10}),
    "first_layer": ("zennit", {"relevance": 1e-10}),
    "lrp": ("captum", {"relevance": 1e-6}),
    "rules": ("captum", {"relevance": 1e-6}),
    "methods": ("captum", {"integrated": 1e-7, "saliency": 0.0, "occlusion": 1e-7}),
    "attnlrp": ("lxt", {"relevance": 1e-6}),
}


def source(text: str) -> str:
    """The code of a block: its doctest examples (tdhook's blocks), or the block as it is (the peers')."""
    examples = doctest.DocTestParser().get_examples(text)
    return "".join(example.source for example in examples) if examples else text


def page_blocks() -> list[tuple[str, str | None, str]]:
    """``(kind, case, code)`` of every marked block, in the page's order."""
    return [(kind, case or None, source(text)) for kind, case, text in BLOCK.findall(PAGE.read_text())]


def case_blocks(case: str) -> tuple[str, str]:
    """tdhook's and the peer's code of ``case``."""
    found = {kind: code for kind, name, code in page_blocks() if name == case}
    return found["tdhook"], found[CASES[case][0]]


def randomise_batch_norms(model: nn.Module, eps: float) -> None:
    """Statistics and affine parameters far from the identity, so that merging a BatchNorm matters."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                n = module.num_features
                module.eps = eps
                module.running_mean.copy_(torch.randn(n, generator=generator) * 0.2)
                module.running_var.copy_(torch.rand(n, generator=generator) * 1.5 + 0.5)
                module.weight.copy_(torch.rand(n, generator=generator) + 0.5)
                module.bias.copy_(torch.randn(n, generator=generator) * 0.1)


def page_namespace(eps: float = 0.0) -> dict:
    """The page's setup blocks run in float64, with the models made harder (see the module's docstring).

    ``eps = 0``: zennit's canonizer leaves each merged BatchNorm dividing by ``sqrt(1 + eps)``, so only there do
    zennit and tdhook compute the same function.
    """
    namespace: dict = {}
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        for kind, _, code in page_blocks():
            if kind == "setup":
                exec(code, namespace)
    finally:
        torch.set_default_dtype(default)
    randomise_batch_norms(namespace["model"], eps)
    randomise_batch_norms(namespace["resnet"], eps)
    with torch.no_grad():
        for param in namespace["llm"].parameters():
            param.mul_(10.0 if param.dim() > 1 else 1.0)  # the 0.02 init leaves attention nearly uniform
        namespace["target"] = namespace["model"](namespace["x"]).argmax(-1)
        namespace["resnet_target"] = namespace["resnet"](namespace["image"]).argmax(-1)
        namespace["token"] = namespace["llm"](input_ids=namespace["ids"]).logits[:, -1].argmax(-1)
    assert all(
        p.dtype == torch.float64 for name in ("model", "resnet", "net", "llm") for p in namespace[name].parameters()
    )
    return namespace


def run(code: str, namespace: dict, names) -> dict[str, torch.Tensor]:
    """The tensors ``names`` that ``code`` leaves, run in a copy of ``namespace`` (a peer's imports, zennit's
    ``EpsilonPlusFlat``, would hide tdhook's)."""
    scope = dict(namespace)
    exec(code, scope)
    return {name: scope[name].detach().clone() for name in names}


@pytest.fixture(scope="module")
def namespace() -> dict:
    return page_namespace()


def test_the_page_marks_every_case_once_and_nothing_else():
    marks = [(kind, case) for kind, case, _ in page_blocks() if kind != "setup"]
    expected = [(kind, case) for case, (peer, _) in CASES.items() for kind in (peer, "tdhook")]
    assert sorted(marks) == sorted(expected)
    assert all(kind in PEERS for _, (kind, _) in CASES.items())


@pytest.mark.parametrize("case", [case for case, (peer, _) in CASES.items() if peer != "lxt"])
def test_tdhook_gives_the_peers_result(case: str, namespace: dict):
    ours, theirs = case_blocks(case)
    tolerances = CASES[case][1]
    actual = run(ours, namespace, tolerances)
    expected = run(theirs, namespace, tolerances)
    for name, tolerance in tolerances.items():
        assert actual[name].dtype == torch.float64  # captum's occlusion returns float32: compared in float64
        assert relative_error(actual[name], expected[name].double()) <= tolerance, name
        assert expected[name].abs().sum() > 0


@pytest.mark.parametrize("preset", ["EpsilonPlus", "EpsilonPlusFlat", "EpsilonAlpha2Beta1", "EpsilonAlpha2Beta1Flat"])
def test_every_composite_the_page_names_is_the_preset_of_its_name(preset: str, namespace: dict):
    """The composite case with each other composite the page lists in place of ``EpsilonGammaBox(low, high)``."""
    import tdhook.attribution

    ours, theirs = case_blocks("composite")
    ours = ours.replace("EpsilonGammaBox(low=-3.0, high=3.0)", f"{preset}()")
    theirs = theirs.replace("EpsilonGammaBox(low=-3.0, high=3.0, ", f"{preset}(")
    theirs = theirs.replace("import EpsilonGammaBox", f"import {preset}")
    actual = run(ours, {**namespace, preset: getattr(tdhook.attribution, preset)}, ["relevance"])["relevance"]
    expected = run(theirs, namespace, ["relevance"])["relevance"]
    assert f"{preset}()" in ours and f"{preset}(" in theirs
    assert relative_error(actual, expected) <= 1e-10


def test_a_batch_norms_eps_moves_zennits_result_by_about_half_of_it():
    """The page: with torch's default ``eps = 1e-5`` the two differ by about ``eps / 2`` per BatchNorm."""
    namespace = page_namespace(eps=1e-5)
    ours, theirs = case_blocks("composite")
    error = relative_error(
        run(ours, namespace, ["relevance"])["relevance"], run(theirs, namespace, ["relevance"])["relevance"]
    )
    assert 1e-7 < error <= 1e-5


def test_the_comparisons_can_fail(namespace: dict):
    """What the page says of the neighbouring settings: each differs measurably from the peer's result."""
    from zennit.attribution import Gradient
    from zennit.composites import LayerMapComposite, MixedComposite, NameMapComposite
    from zennit.rules import Epsilon, Flat, Norm, ZPlus
    from zennit.torchvision import SequentialMergeBatchNorm
    from zennit.types import AvgPool

    model, x, target = namespace["model"], namespace["x"], namespace["target"]
    one_hot = torch.eye(5, dtype=torch.float64)[target]
    ours = run(case_blocks("name_map")[0], namespace, ["relevance"])["relevance"]

    # A NameMapComposite alone: the average pool passes relevance by its transposed weights (24 % away); its Norm
    # rule is all the name map lacks.
    def by_name(*composites):
        names = NameMapComposite([(("0",), Flat()), (("3",), ZPlus()), (("7", "9"), Epsilon())])
        composite = MixedComposite([names, *composites], canonizers=[SequentialMergeBatchNorm()])
        with Gradient(model=model, composite=composite) as attributor:
            return attributor(x, one_hot)[1]

    assert 0.2 < relative_error(ours, by_name()) < 0.3
    assert relative_error(ours, by_name(LayerMapComposite([(AvgPool, Norm())]))) <= 1e-10
    # A rule_mapper entry for the convolutions takes the first one from z^B too: as far as the result's own size.
    ours_code, theirs_code = case_blocks("layer_map_option")
    expected = run(theirs_code, namespace, ["relevance"])["relevance"]
    mapped = ours_code.replace("gamma=0.5)", "rule_mapper={nn.Conv2d: GammaRule(gamma=0.5)})")
    assert "rule_mapper" in mapped
    assert 0.8 < relative_error(run(mapped, namespace, ["relevance"])["relevance"], expected) < 1.2
    # The residual sums split exactly (no stabilize_additions): about 1e-5 from zennit's ResNet canonizer.
    ours_code, theirs_code = case_blocks("resnet")
    expected = run(theirs_code, namespace, ["relevance"])["relevance"]
    exact = run(ours_code.replace("stabilize_additions=True", "stabilize_additions=False"), namespace, ["relevance"])
    assert 5e-6 < relative_error(exact["relevance"], expected) < 2e-5
    # captum's default is not EpsilonPlus, and its rules differ from its default: the captum cases can tell.
    lrp, rules = (run(case_blocks(case)[1], namespace, ["relevance"])["relevance"] for case in ("lrp", "rules"))
    assert relative_error(lrp, rules) > 1e-2
    # captum's γ keeps the bias (2 % away where it is not zeroed) and ignores the inputs' signs (83 % on the first
    # layer, whose inputs are signed), where tdhook's γ on the same layer is the page's.
    for layer, zero_bias, (low, high) in (("features.3", False, (0.01, 0.03)), ("features.0", True, (0.7, 0.95))):
        actual, expected = captum_gamma_against_tdhook(namespace, layer, zero_bias)
        assert low < relative_error(actual, expected) < high, layer


def captum_gamma_against_tdhook(namespace: dict, layer: str, zero_bias: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """tdhook's and captum's relevance with γ = 0.25 on ``layer`` of the page's ``net`` and captum's default
    elsewhere."""
    from captum.attr import LRP as CaptumLRP
    from captum.attr._utils.lrp_rules import GammaRule as CaptumGamma
    from tensordict import TensorDict

    from tdhook.attribution import LRP, GammaRule, UniformEpsilon

    net, x, target = namespace["net"], namespace["x"], namespace["target"]
    net.get_submodule(layer).rule = CaptumGamma(gamma=0.25, set_bias_to_zero=zero_bias)
    expected = CaptumLRP(net).attribute(x.clone(), target=target)
    rule = GammaRule(gamma=0.25, zero_params=["bias"] if zero_bias else [], stabilizer=1e-9)
    mapper = UniformEpsilon(epsilon=1e-9, stabilizer=1e-9, rule_mapper={layer: rule})
    lrp = LRP(net, mapper, in_keys=["x"], out_keys=["y"], target=target)
    return lrp(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))["relevance", "x"], expected


LXT_RUNNER = """
import sys
import torch, transformers
case = torch.load(sys.argv[1])
torch.set_default_dtype(torch.float64)
config = transformers.LlamaConfig(**case["config"])
model = transformers.LlamaForCausalLM(config)
model.load_state_dict(case["state_dict"])
path = sys.argv[3]
model.save_pretrained(path)  # before LXT patches the modeling module
namespace = {"torch": torch, "path": path, "ids": case["ids"], "token": case["token"]}
exec(case["code"], namespace)
torch.save({"relevance": namespace["relevance"].detach(), "version": transformers.__version__}, sys.argv[2])
"""


def test_attnlrp_gives_lxts_result(namespace: dict, lxt_pythonpath: str, tmp_path: Path):  # noqa: F811
    ours, theirs = case_blocks("attnlrp")
    actual = run(ours, namespace, ["relevance"])["relevance"]
    llm = namespace["llm"]
    case = {"config": llm.config.to_diff_dict(), "state_dict": llm.state_dict(), "code": theirs}
    case |= {"ids": namespace["ids"], "token": namespace["token"]}
    torch.save(case, tmp_path / "case.pt")
    (tmp_path / "runner.py").write_text(LXT_RUNNER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([lxt_pythonpath, os.environ.get("PYTHONPATH", "")])}
    command = [
        sys.executable,
        str(tmp_path / "runner.py"),
        *(str(tmp_path / name) for name in ("case.pt", "result.pt", "llama")),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    result = torch.load(tmp_path / "result.pt")
    assert result["version"].startswith("4."), result["version"]
    assert result["relevance"].dtype == actual.dtype == torch.float64
    assert relative_error(actual, result["relevance"]) <= CASES["attnlrp"][1]["relevance"]
    # The plain gradient × input is measurably different: the comparison can fail.
    embeds = namespace["llm"].get_input_embeddings()(namespace["ids"]).detach().requires_grad_(True)
    logits = namespace["llm"](inputs_embeds=embeds).logits[:, -1]
    (grad,) = torch.autograd.grad(logits.gather(1, namespace["token"][:, None]).sum(), embeds)
    assert relative_error(embeds.detach() * grad, result["relevance"]) > 1e-2
