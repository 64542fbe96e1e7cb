"""Time AttnLRP and CP-LRP on a tiny random Llama against gradient × input.

The model is a Hugging Face ``LlamaForCausalLM`` from a small random config
with eager attention (``--attention sdpa``: the fused one, transformers' default),
called on embeddings; the explained output is the next-token logit at its
argmax. Every method runs in this one process, pinned to one thread, on the same model and inputs: a warm-up round, then
``--repeats`` timed rounds; the median is reported with its ratio to a plain
gradient × input pass. Each tdhook wrapper runs inside one ``with lrp:``
context, as in a loop over many inputs; the rows marked "entering" call a
wrapper outside its context, so that each call enters and leaves one (the
rules are registered and removed every call). The methods take turns in every
round. ``--clock thread`` times this thread's CPU time instead of the wall time. ``--floor`` adds the rows of the
steps an AttnLRP call in a context cannot do without, run bare (see ``planned_steps.py``; checked to give the
wrapper's relevance bit for bit), with and without the plan's hooks: the floor under the wrapper's time.

    python benchmarks/bench_transformer.py --batch 8 --tokens 64 --repeats 5
"""

from __future__ import annotations

import argparse
import contextlib
import copy
from collections.abc import Callable

import torch
import transformers
from planned_steps import check_planned_steps, planned_steps
from tensordict import TensorDict
from timing import add_clock_options, clock_of, interleaved_medians
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.rules import CPLRP, AttnLRP


class LastLogits(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        return self.model(inputs_embeds=embeds).logits[:, -1]


def tiny_llama(hidden: int, layers: int, attention: str = "eager") -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    config._attn_implementation = attention
    return LastLogits(transformers.LlamaForCausalLM(config).eval())


def gradient_times_input(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(model(x).max(-1).values.sum(), x)
    return x * grad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--attention", choices=["eager", "sdpa"], default="eager", help="the attention implementation of the model"
    )
    parser.add_argument(
        "--floor", action="store_true", help="add the bare steps of a planned AttnLRP call (see planned_steps.py)"
    )
    add_clock_options(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = tiny_llama(args.hidden, args.layers, args.attention)
    x = torch.randn(args.batch, args.tokens, args.hidden)
    methods: dict[str, Callable] = {"gradient x input": lambda: gradient_times_input(model, x)}
    with contextlib.ExitStack() as contexts:
        for label, mapper in [("tdhook AttnLRP", AttnLRP()), ("tdhook CP-LRP", CPLRP())]:
            # A copy of the model each: the wrappers' contexts stay open side by side.
            lrp = contexts.enter_context(LRP(copy.deepcopy(model), mapper, in_keys=["embeds"], out_keys=["logits"]))
            methods[label] = lambda lrp=lrp: lrp(TensorDict(embeds=x, batch_size=x.shape[:1]))["relevance", "embeds"]
            # Called outside a context, each call of this one enters and leaves one.
            entering = LRP(copy.deepcopy(model), mapper, in_keys=["embeds"], out_keys=["logits"])
            methods[f"{label}, entering"] = lambda lrp=entering: lrp(TensorDict(embeds=x, batch_size=x.shape[:1]))
        if args.floor:
            bare = contexts.enter_context(LRP(copy.deepcopy(model), AttnLRP(), in_keys=["embeds"], out_keys=["logits"]))
            check_planned_steps(bare, "embeds", "logits", x)
            methods["AttnLRP, bare planned steps"] = planned_steps(bare, "embeds", "logits", x)
            methods["the same, no plan hooks"] = planned_steps(bare, "embeds", "logits", x, apply=False)
        clock = clock_of(args)
        seconds = interleaved_medians(methods, args.repeats, clock=clock, warm=args.warm)

    print(
        f"Llama {args.layers} layers, hidden {args.hidden}, {args.attention} attention, "
        f"batch {args.batch} x {args.tokens} tokens, "
        f"1 thread, {args.clock} time, median of {args.repeats} interleaved rounds"
    )
    print(f"{'method':<32} {'seconds':>8} {'x grad*input':>13}")
    base = seconds["gradient x input"]
    for label, value in seconds.items():
        print(f"{label:<32} {value:8.4f} {value / base:13.2f}")


if __name__ == "__main__":
    main()
