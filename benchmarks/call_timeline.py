"""Where one planned AttnLRP call's time goes, against gradient × input's forward and backward passes.

A diagnostic of the design, not an API (it patches the wrapper's private steps to read a clock around them): the
tiny random Llama of ``bench_transformer.py`` is explained inside one ``with lrp:`` context, and each call's thread
time is cut at the model's forward pass, the plan's check and hooks (``_Plan.apply``) and the backward pass, the
medians of ``--repeats`` calls printed beside those of gradient × input's own passes (the two take turns). The
lines "first touch" time one input check (``validate_inputs``) three times in a row inside each call, where the
model's last passes have just run, and alone in a loop: what a step of the wrapper costs where its code and data
are no longer in the processor's caches (the second and third runs add a few microseconds to the time "to the
forward pass").

    python benchmarks/call_timeline.py --batch 2 --tokens 7 --hidden 32 --layers 2 --repeats 300
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
import timeit
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from bench_transformer import tiny_llama
from tensordict import TensorDict

from tdhook.attribution import LRP
from tdhook.attribution import _explained_call as explained_call
from tdhook.attribution import _function_rule_plan as function_rule_plan
from tdhook.attribution import _model_run as model_run
from tdhook.attribution.lrp_helpers.rules import AttnLRP

_clock = time.thread_time_ns


def _stamped(function: Callable, stamps: dict, name: str) -> Callable:
    """``function``, noting in ``stamps`` the clock as it starts (``name + ">"``) and as it ends (``name + "<"``)."""

    def stamped(*args: Any, **kwargs: Any) -> Any:
        stamps[name + ">"] = _clock()
        try:
            return function(*args, **kwargs)
        finally:
            stamps[name + "<"] = _clock()

    return stamped


def _three_times(function: Callable, stamps: dict) -> Callable:
    """``function`` run three times in a row, each run's time noted in ``stamps``; the last run's result returned."""

    def repeated(*args: Any, **kwargs: Any) -> Any:
        for run in range(3):
            start = _clock()
            result = function(*args, **kwargs)
            stamps[f"run {run + 1}"] = _clock() - start
        return result

    return repeated


@contextlib.contextmanager
def _clocked(stamps: dict) -> Iterator[None]:
    """The wrapper's steps read the clock into ``stamps`` in the block (see the module); put back as they were after
    it (the benchmarks' tests run every script in one process)."""
    patched = [
        (model_run, "_call", _stamped(model_run._call, stamps, "forward")),
        (function_rule_plan._Plan, "apply", _stamped(function_rule_plan._Plan.apply, stamps, "plan")),
        (torch.autograd, "grad", _stamped(torch.autograd.grad, stamps, "backward")),  # the wrapper's one pass
        (explained_call, "validate_inputs", _three_times(explained_call.validate_inputs, stamps)),
    ]
    kept = [(owner, name, getattr(owner, name)) for owner, name, _ in patched]
    try:
        for owner, name, function in patched:
            setattr(owner, name, function)
        yield
    finally:
        for owner, name, function in kept:
            setattr(owner, name, function)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=7)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = tiny_llama(args.hidden, args.layers)
    x = torch.randn(args.batch, args.tokens, args.hidden)
    plain_grad, check = torch.autograd.grad, explained_call.validate_inputs

    def gradient_times_input() -> tuple[int, int, int]:
        leaf = x.detach().requires_grad_(True)
        start = _clock()
        out = model(leaf)
        forward_end = _clock()
        total = out.max(-1).values.sum()
        backward_start = _clock()
        (grad,) = plain_grad(total, leaf)
        backward_end = _clock()
        _ = leaf * grad
        return forward_end - start, backward_end - backward_start, _clock() - start

    lrp = LRP(copy.deepcopy(model), AttnLRP(), in_keys=["x"], out_keys=["y"])  # the baseline runs outside the rules
    stamps: dict[str, int] = {}
    times: dict[str, list[int]] = defaultdict(list)
    with _clocked(stamps), lrp:
        for _ in range(10):
            lrp(TensorDict(x=x, batch_size=[args.batch]))
            gradient_times_input()
        for _ in range(args.repeats):
            forward, backward_pass, total = gradient_times_input()
            times["gradient x input: forward"].append(forward)
            times["gradient x input: backward"].append(backward_pass)
            times["gradient x input: all"].append(total)
            tensordict = TensorDict(x=x, batch_size=[args.batch])
            stamps.clear()  # a step the call did not take (no plan followed) raises below, not reads an old stamp
            start = _clock()
            lrp(tensordict)
            end = _clock()
            times["AttnLRP: to the forward pass"].append(stamps["forward>"] - start)
            times["AttnLRP: forward"].append(stamps["forward<"] - stamps["forward>"])
            times["AttnLRP: to the plan"].append(stamps["plan>"] - stamps["forward<"])
            times["AttnLRP: the plan's check and hooks"].append(stamps["plan<"] - stamps["plan>"])
            times["AttnLRP: to the backward pass"].append(stamps["backward>"] - stamps["plan<"])
            times["AttnLRP: backward"].append(stamps["backward<"] - stamps["backward>"])
            times["AttnLRP: from the backward pass to the end"].append(end - stamps["backward<"])
            times["AttnLRP: all"].append(end - start)
            for run in (1, 2, 3):
                times[f"first touch: validate_inputs, run {run} in a call"].append(stamps[f"run {run}"])
    tensordict = TensorDict(x=x, batch_size=[args.batch])
    alone = min(timeit.repeat(lambda: check(tensordict, ["x"]), number=2000, repeat=5)) / 2000
    print(
        f"Llama {args.layers} layers, hidden {args.hidden}, batch {args.batch} x {args.tokens} tokens, 1 thread, "
        f"thread time, median of {args.repeats} calls"
    )
    for name, values in times.items():
        print(f"{name:52s} {statistics.median(values) / 1e3:9.1f} us")
    print(f"{'first touch: validate_inputs alone, in a loop':52s} {alone * 1e6:9.1f} us")


if __name__ == "__main__":
    main()
