"""Time LRP on an MLP policy, at rollout batch sizes, against gradient × input, zennit and captum.

A torchrl ``MLP`` policy (observation → action values) is explained at batch 1
(one environment step: the wrapper's per-call overhead dominates) and at a
large batch (a replay-buffer batch: the arithmetic dominates). The baseline is
a plain gradient × input call that reads the observation from a TensorDict
and writes its relevance back, as the wrapper does. The tdhook wrapper runs
inside one open context (as in a rollout loop); the row "entering the context"
calls a wrapper outside its context, so that each call enters and leaves one.
Every method runs in this one process, pinned to one thread; after a warm-up
round, ``--repeats`` rounds run every method once in turn, and medians are
reported with their ratio to the baseline.

    python benchmarks/bench_policy.py --batches 1 4096 --repeats 200
    python benchmarks/bench_policy.py --batches 1 --features 64 --cells 256 256 --actions 8 --repeats 200

With ``--q-value`` the policy is torchrl's ``QValueActor`` (the MLP, then the ``QValueModule`` that picks the
action), as a DQN rollout runs it; the baseline then runs the same actor and takes the gradient of the chosen
action's value, and the peers, which take no TensorDict pipeline, are left out.
"""

from __future__ import annotations

import argparse
import copy
import warnings
from collections.abc import Callable

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from timing import interleaved_medians
from torch import nn
from torchrl.modules import MLP, QValueActor

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.rules import EpsilonPlus


def gradient_times_input(net: nn.Module, td: TensorDict) -> TensorDict:
    x = td["observation"].detach().requires_grad_(True)
    out = net(x)
    (grad,) = torch.autograd.grad(out.max(-1).values.sum(), x)
    td.set("action_value", out.detach())
    td.set(("relevance", "observation"), x.detach() * grad)
    return td


def q_value_gradient_times_input(actor: nn.Module, td: TensorDict) -> TensorDict:
    x = td["observation"].detach().requires_grad_(True)
    out = actor(td.set("observation", x))
    (grad,) = torch.autograd.grad(out["chosen_action_value"].sum(), x)
    td.set("observation", x.detach())
    td.set(("relevance", "observation"), x.detach() * grad)
    return td


def zennit_runner(net: nn.Module, td: TensorDict) -> Callable[[], torch.Tensor]:
    from zennit.attribution import Gradient
    from zennit.composites import EpsilonPlus as ZennitEpsilonPlus

    composite = ZennitEpsilonPlus()

    def run() -> torch.Tensor:
        with Gradient(model=net, composite=composite) as attributor:
            _, relevance = attributor(
                td["observation"], lambda out: torch.zeros_like(out).scatter_(1, out.argmax(1, keepdim=True), 1)
            )
        return relevance

    return run


def captum_runner(net: nn.Module, td: TensorDict) -> Callable[[], torch.Tensor]:
    from captum.attr import LRP as CaptumLRP

    def run() -> torch.Tensor:
        x = td["observation"]
        with torch.no_grad():
            target = net(x).argmax(-1)
        return CaptumLRP(net).attribute(x, target=target)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4096])
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--actions", type=int, default=4)
    parser.add_argument("--cells", type=int, nargs="+", default=[64, 64])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--q-value", action="store_true", help="explain torchrl's QValueActor around the MLP")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", module="captum")  # it notes that it made the input require grad
    torch.manual_seed(0)
    net = MLP(in_features=args.features, out_features=args.actions, num_cells=args.cells, activation_class=nn.ReLU)
    policy = TensorDictModule(net, in_keys=["observation"], out_keys=["action_value"])
    baseline = gradient_times_input
    if args.q_value:
        policy = QValueActor(net, in_keys=["observation"], action_space="one_hot")
        baseline, args.peers = q_value_gradient_times_input, False

    print(
        f"MLP {'-'.join(map(str, [args.features, *args.cells, args.actions]))} (ReLU)"
        f"{' in a QValueActor' if args.q_value else ''}, EpsilonPlus, 1 thread, "
        f"median of {args.repeats} interleaved rounds"
    )
    print(f"{'batch':>6} {'method':<42} {'milliseconds':>12} {'x baseline':>11}")
    for batch in args.batches:
        td = TensorDict(observation=torch.randn(batch, args.features), batch_size=[batch])
        # Called outside a context, each call of this one enters and leaves one (on a copy of the policy: a
        # module belongs to one open context at a time).
        entering = LRP(copy.deepcopy(policy), rule_mapper=EpsilonPlus())
        # A copy of the policy: the baseline calls `net` itself, which must not run under the context's rules.
        with LRP(copy.deepcopy(policy), rule_mapper=EpsilonPlus()) as lrp:
            methods: dict[str, Callable] = {
                "gradient x input, TensorDict in/out": lambda: baseline(
                    policy if args.q_value else net, td.clone(False)
                ),
                "tdhook EpsilonPlus": lambda: lrp(td.clone(False)),
                "tdhook EpsilonPlus, entering the context": lambda: entering(td.clone(False)),
            }
            if args.peers:
                methods["zennit EpsilonPlus"] = zennit_runner(net, td)
                methods["captum LRP"] = captum_runner(net, td)
            seconds = interleaved_medians(methods, args.repeats)
        base = seconds["gradient x input, TensorDict in/out"]
        for label, value in seconds.items():
            print(f"{batch:6d} {label:<42} {1000 * value:12.3f} {value / base:11.2f}")


if __name__ == "__main__":
    main()
