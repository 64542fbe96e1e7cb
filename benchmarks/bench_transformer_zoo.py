"""Time AttnLRP and CP-LRP on every architecture of the test suite's transformer zoo against gradient × input.

The zoo (``tests/attribution/test_lrp_transformer_zoo.py``) builds each Hugging Face architecture from a tiny random
config (hidden size 32, 2 layers, batch 2 × 7 tokens or a small image; no weights downloaded), with eager attention
and, where transformers offers it, sdpa. Each model is explained on its input embeddings (pixels, features), the
explained output its top logit. Per architecture and attention, the three methods run in this one process on one
thread: a warm-up round, then ``--repeats`` rounds in which each runs once, in an order drawn anew every round; the
median of each is reported with its ratio to gradient × input. The wrappers run inside one open ``with lrp:``
context each, as in a loop over many inputs. With ``--ids``, the text models are fed token ids instead (the same
ids each call, their embeddings looked up inside the model, as a user explaining ``input_ids`` runs them), and the
relevance is that of the tokens; gradient × input stays on the embeddings of those ids.

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/bench_transformer_zoo.py --clock thread --repeats 40
    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/bench_transformer_zoo.py bert gpt2 llama --ids --clock thread
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import warnings
from pathlib import Path

import torch
from tensordict import TensorDict
from timing import add_clock_options, clock_of, interleaved_medians
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: the zoo lives in its tests

from tdhook.attribution import LRP  # noqa: E402
from tdhook.attribution.lrp_helpers.rules import CPLRP, AttnLRP  # noqa: E402
from tests.attribution.test_lrp_transformer_zoo import INPUTS, ZOO, Explained, model_input  # noqa: E402


class FedIds(nn.Module):
    """What :class:`Explained` explains, the model fed token ids."""

    def __init__(self, explained: Explained) -> None:
        super().__init__()
        self.model = explained.model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids)
        if getattr(out, "logits", None) is None:
            return out.last_hidden_state[:, -1]
        return out.logits[:, -1] if out.logits.dim() == 3 else out.logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="architectures of the zoo (default: all of them)")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--ids", action="store_true", help="feed the text models token ids (the others are left out)")
    add_clock_options(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dtype = getattr(torch, args.dtype)
    clock = clock_of(args)
    unknown = sorted(set(args.names) - set(ZOO))
    if unknown:
        parser.error(f"not in the zoo: {', '.join(unknown)}; it has {', '.join(sorted(ZOO))}")
    fed = "token ids" if args.ids else "embeddings"
    print(f"{args.dtype}, fed {fed}, 1 thread, {args.clock} time, median of {args.repeats} rounds in random order")
    print(f"{'architecture':<14} {'attention':<9} {'grad*input ms':>14} {'AttnLRP':>8} {'CP-LRP':>8}")
    for name in args.names or sorted(ZOO):
        architecture = ZOO[name]
        if args.ids and architecture.inputs not in ("text", "long_text"):
            continue
        for implementation in architecture.implementations():
            model = Explained(architecture.build(implementation, dtype=dtype), architecture.inputs)
            x = model_input(architecture, dtype)
            if args.ids:
                vocabulary = model.model.get_input_embeddings().num_embeddings
                shape, generator = INPUTS[architecture.inputs][1][:2], torch.Generator().manual_seed(1)
                ids = torch.randint(0, vocabulary, shape, generator=generator)
                with torch.no_grad():
                    x = model.model.get_input_embeddings()(ids)  # gradient × input of the same embeddings

            def gradient_times_input(model=model, x=x) -> torch.Tensor:
                leaf = x.detach().requires_grad_(True)
                (grad,) = torch.autograd.grad(model(leaf).max(-1).values.sum(), leaf)
                return leaf * grad

            methods = {"gradient x input": gradient_times_input}
            with contextlib.ExitStack() as contexts:
                for label, preset in [("AttnLRP", AttnLRP), ("CP-LRP", CPLRP)]:
                    if args.ids:
                        lrp = LRP(FedIds(copy.deepcopy(model)), preset(), in_keys=["ids"], out_keys=["y"])
                        lrp = contexts.enter_context(lrp)
                        methods[label] = lambda lrp=lrp, ids=ids: lrp(TensorDict(ids=ids, batch_size=ids.shape[:1]))
                        continue
                    lrp = contexts.enter_context(LRP(copy.deepcopy(model), preset(), in_keys=["x"], out_keys=["y"]))
                    methods[label] = lambda lrp=lrp, x=x: lrp(TensorDict(x=x, batch_size=x.shape[:1]))
                seconds = interleaved_medians(methods, args.repeats, clock=clock, warm=args.warm)
            base = seconds["gradient x input"]
            print(
                f"{name:<14} {implementation:<9} {base * 1e3:14.2f} "
                f"{seconds['AttnLRP'] / base:8.2f} {seconds['CP-LRP'] / base:8.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
