"""Print, per case, the aten operations one ordinary LRP call runs (how many, and a digest of their sequence) and
the relevance's sum.

Run it on two checkouts of the package to see that a change leaves calls without ``create_graph`` as they were:
the same operations in the same order, and the same relevance, bit for bit. The cases are the tiny GPT-2 and
Llama of the tests under AttnLRP (with and without ε) and CP-LRP, squeeze-excite CNNs with a gate module and a gate
function, a CNN with GroupNorm and stabilised additions, an LSTM, a GRU, the uniform and stop rules, and the
Taylor rule (``tests/attribution/test_lrp_differentiable_rules.py`` builds them).

    PYTHONPATH=src python benchmarks/op_sequence.py > after.txt   # and again with the other checkout's src
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import warnings
from pathlib import Path

import torch
from tensordict import TensorDict
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' models

from tdhook.attribution import LRP  # noqa: E402
from tdhook.attribution.lrp_helpers.rules import CPLRP, AttnLRP  # noqa: E402
from tdhook.attribution.mappers.presets import EpsilonPlus  # noqa: E402
from tdhook.attribution.rules import RecurrentRule, StopRule, TaylorDecompositionRule, UniformRule  # noqa: E402
from tests.attribution.test_lrp_differentiable_rules import (  # noqa: E402
    normed_cnn,
    recurrent,
    squeeze_excite,
    taylor_block,
    two_branches,
)


class Operations(TorchDispatchMode):
    """Records the name of every aten operation dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def language_model(kind: str, preset) -> tuple[nn.Module, object, torch.Tensor]:
    from tests.attribution.test_lrp_huggingface import LastLogits, build  # transformers: imported when asked

    torch.manual_seed(0)
    model = build(kind)
    return LastLogits(model), preset, model.get_input_embeddings()(torch.randint(0, 64, (2, 5))).detach()


def case(make, mapper) -> tuple[nn.Module, object, torch.Tensor]:
    net, x = make(0)
    return net, mapper, x


CASES = {
    "gpt2 AttnLRP(ε=0.1, softmax ε=0.1)": lambda: language_model(
        "gpt2", lambda: AttnLRP(epsilon=0.1, softmax_epsilon=0.1)
    ),
    "gpt2 AttnLRP()": lambda: language_model("gpt2", AttnLRP),
    "gpt2 CPLRP()": lambda: language_model("gpt2", CPLRP),
    "llama AttnLRP(ε=0.1, softmax ε=0.1)": lambda: language_model(
        "llama", lambda: AttnLRP(epsilon=0.1, softmax_epsilon=0.1)
    ),
    "llama AttnLRP()": lambda: language_model("llama", AttnLRP),
    "llama CPLRP()": lambda: language_model("llama", CPLRP),
    "squeeze-excite, gate module": lambda: case(squeeze_excite(False), lambda: EpsilonPlus(epsilon=0.1)),
    "squeeze-excite, gate function": lambda: case(squeeze_excite(True), lambda: EpsilonPlus(epsilon=0.1)),
    "GroupNorm, stabilised additions": lambda: case(
        normed_cnn("GroupNorm"), lambda: EpsilonPlus(epsilon=0.1, stabilize_additions=True)
    ),
    "LSTM": lambda: case(recurrent("LSTM"), lambda: {nn.LSTM: RecurrentRule(0.1)}),
    "GRU": lambda: case(recurrent("GRU"), lambda: {nn.GRU: RecurrentRule(0.1)}),
    "uniform and stop": lambda: case(two_branches(True), lambda: {"add": UniformRule(), "b": StopRule()}),
    "Taylor": lambda: case(taylor_block, lambda: {"1": TaylorDecompositionRule(0.3)}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    warnings.simplefilter("ignore")
    for name in parser.parse_args().cases:
        net, mapper, x = CASES[name]()
        lrp = LRP(net, mapper(), in_keys=["x"], out_keys=["y"])
        with lrp:
            lrp(TensorDict(x=x, batch_size=x.shape[:1]))  # the first call's checks are not compared
            with Operations() as operations:
                relevance = lrp(TensorDict(x=x, batch_size=x.shape[:1]))["relevance", "x"]
        digest = hashlib.md5("|".join(operations.names).encode()).hexdigest()[:12]
        print(f"{name}: {len(operations.names)} operations, {digest}, relevance sum {relevance.double().sum():.17g}")


if __name__ == "__main__":
    main()
