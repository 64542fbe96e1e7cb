"""A wrapper without ``create_graph`` inside a torchrl loss module is refused by name; with it the loss trains."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.modules import QValueActor

from tdhook.attribution import LRP, EpsilonPlus
from tests.attribution.test_lrp_torchrl_training import transitions

F64 = torch.float64


def one_hot_transitions() -> TensorDict:
    """Five transitions of a four-observation, two-action task, their actions one-hot."""
    return transitions(nn.functional.one_hot(torch.randint(2, (5,)), 2))


def dqn_gradients(wrapper: dict | None) -> list[torch.Tensor]:
    """The gradients of ``DQNLoss`` for a Q-network, plain or with an LRP wrapper (``wrapper``: its keywords)."""
    from torchrl.objectives import DQNLoss

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(F64)
    core = TensorDictModule(net, in_keys=["observation"], out_keys=["action_value"])
    network = core if wrapper is None else LRP(core, EpsilonPlus(), **wrapper)
    loss = DQNLoss(QValueActor(network, in_keys=["observation"], action_space="one-hot"), action_space="one-hot")
    loss(one_hot_transitions())["loss"].backward()
    return [p.grad.clone() for p in net.parameters()]


def test_dqn_loss_with_a_wrapper_without_create_graph_is_refused_naming_it():
    # Before, torch's own error at backward ("element 0 of tensors does not require grad"), naming no module.
    with pytest.raises(RuntimeError, match=r"LRP: called by torchrl's DQNLoss .*around "):
        dqn_gradients({})


def test_dqn_loss_with_a_create_graph_wrapper_gives_the_plain_gradients():
    plain = dqn_gradients(None)
    for grad, expected in zip(dqn_gradients({"create_graph": True}), plain, strict=True):
        torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)


def test_a_ppo_loss_whose_actor_holds_a_wrapper_without_create_graph_is_refused():
    """Before, the critic's term carried a gradient, and the actor's network was left untrained without a word."""
    from tensordict.nn import NormalParamExtractor
    from torchrl.modules import ProbabilisticActor, TanhNormal, ValueOperator
    from torchrl.objectives import ClipPPOLoss

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2), NormalParamExtractor()).to(F64)
    core = TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"])
    actor = ProbabilisticActor(
        LRP(core, EpsilonPlus(), target_key="loc"),
        in_keys=["loc", "scale"],
        distribution_class=TanhNormal,
        return_log_prob=True,
    )
    critic = ValueOperator(nn.Linear(3, 1).to(F64), in_keys=["observation"])
    loss = ClipPPOLoss(actor, critic)
    batch = TensorDict(
        observation=torch.randn(6, 3, dtype=F64),
        action=torch.rand(6, 1, dtype=F64) * 1.8 - 0.9,
        action_log_prob=torch.zeros(6, dtype=F64),
        advantage=torch.randn(6, 1, dtype=F64),
        value_target=torch.randn(6, 1, dtype=F64),
        batch_size=[6],
    )
    with pytest.raises(RuntimeError, match=r"LRP: called by torchrl's ClipPPOLoss .*create_graph=True"):
        loss(batch)


def test_dqn_loss_with_another_method_inside_is_refused_naming_it():
    """The methods write their outputs detached too, and have no create_graph: refused alike."""
    from torchrl.objectives import DQNLoss

    from tdhook.attribution import Saliency

    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(F64)
    saliency = Saliency(TensorDictModule(net, in_keys=["observation"], out_keys=["action_value"]))
    loss = DQNLoss(QValueActor(saliency, in_keys=["observation"], action_space="one-hot"), action_space="one-hot")
    with pytest.raises(RuntimeError, match=r"Saliency: called by torchrl's DQNLoss .*beside it(?!, or build)"):
        loss(one_hot_transitions())
    assert Saliency(TensorDictModule(net, in_keys=["observation"], out_keys=["action_value"]))(
        one_hot_transitions().select("observation")
    )["attribution", "observation"].shape == (5, 4)  # called by the caller: explained


def own_loss(how: str):
    """A loss of one's own, a ``LossModule`` subclass defined here, outside torchrl: an actor regressed to 1, plus a
    critic term that carries a gradient of its own; the actor called from ``forward``, from a helper method, or from
    a closure in ``forward``."""
    from torchrl.objectives import LossModule

    class RegressionLoss(LossModule):
        def __init__(self, actor: nn.Module, critic: nn.Module) -> None:
            super().__init__()
            self.actor, self.critic = actor, critic

        def actor_output(self, td: TensorDict) -> torch.Tensor:
            return self.actor(td.clone())["y"]

        def forward(self, td: TensorDict) -> TensorDict:
            if how == "forward":
                y = self.actor(td.clone())["y"]
            elif how == "helper":
                y = self.actor_output(td)
            else:
                y = (lambda: self.actor(td.clone())["y"])()
            return TensorDict(loss=((y - 1.0) ** 2).mean() + (self.critic(td.clone())["v"] ** 2).mean())

    return RegressionLoss


def own_loss_gradients(how: str, wrapper: dict | None) -> list[torch.Tensor]:
    """The gradients of the actor's network under :func:`own_loss`, plain or with an LRP wrapper (its keywords)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2)).to(F64)
    critic = TensorDictModule(nn.Linear(3, 1).to(F64), in_keys=["x"], out_keys=["v"])
    actor = TensorDictModule(net, in_keys=["x"], out_keys=["y"])
    loss = own_loss(how)(actor if wrapper is None else LRP(actor, EpsilonPlus(), **wrapper), critic)
    loss(TensorDict(x=torch.randn(5, 3, dtype=F64), batch_size=[5]))["loss"].backward()
    return [p.grad for p in net.parameters()]


@pytest.mark.parametrize("how", ["forward", "helper", "closure"])
def test_a_loss_module_of_ones_own_with_a_wrapper_without_create_graph_is_refused_naming_it(how: str):
    """Only losses in torchrl's code were looked for: a ``LossModule`` subclass written outside it trained the critic
    and left the actor's network without any gradient (every ``.grad`` None), without a word."""
    assert all(grad is not None and grad.abs().sum() > 0 for grad in own_loss_gradients(how, None))
    with pytest.raises(RuntimeError, match=r"^LRP: called by the torchrl LossModule RegressionLoss as one of its"):
        own_loss_gradients(how, {})


@pytest.mark.parametrize("how", ["forward", "closure"])
def test_a_loss_module_of_ones_own_with_a_create_graph_wrapper_gives_the_plain_gradients(how: str):
    plain = own_loss_gradients(how, None)
    for grad, expected in zip(own_loss_gradients(how, {"create_graph": True}), plain, strict=True):
        torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)


def test_a_method_of_another_class_calling_a_wrapper_is_not_taken_for_a_loss():
    """A caller's method (``self`` not a loss module) explains as a call from a function does."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2)).to(F64)
    lrp = LRP(TensorDictModule(net, in_keys=["x"], out_keys=["y"]), EpsilonPlus())
    td = TensorDict(x=torch.randn(5, 3, dtype=F64), batch_size=[5])

    class Explainer:
        def explain(self, td: TensorDict) -> torch.Tensor:
            return lrp(td.clone())["relevance", "x"]

    torch.testing.assert_close(Explainer().explain(td), lrp(td.clone())["relevance", "x"], rtol=0, atol=0)


@pytest.mark.parametrize("estimator", ["GAE", "TD0Estimator", "TDLambdaEstimator"])
def test_a_value_estimator_running_a_wrapped_critic_under_vmap_is_named_with_its_option(estimator: str):
    """The PPO tutorial's GAE, given the wrapper as its value network, runs it under torch.func.vmap: refused, as
    before, and the message now names the estimator and its ``deactivate_vmap`` option (it named neither)."""
    from torchrl.modules import ValueOperator
    from torchrl.objectives import value

    torch.manual_seed(0)
    critic = ValueOperator(nn.Linear(3, 1), in_keys=["observation"])
    data = TensorDict(
        observation=torch.randn(5, 3),
        next=TensorDict(
            observation=torch.randn(5, 3),
            reward=torch.randn(5, 1),
            done=torch.zeros(5, 1, dtype=torch.bool),
            terminated=torch.zeros(5, 1, dtype=torch.bool),
            batch_size=[5],
        ),
        batch_size=[5],
    )
    kind = getattr(value, estimator)
    options = {} if estimator == "TD0Estimator" else {"lmbda": 0.9}
    with pytest.raises(NotImplementedError, match=f"value estimator {estimator}, .*deactivate_vmap=True"):
        kind(gamma=0.9, value_network=LRP(critic, EpsilonPlus()), **options)(data.clone())
    looped = kind(gamma=0.9, value_network=LRP(critic, EpsilonPlus()), deactivate_vmap=True, **options)(data.clone())
    plain = kind(gamma=0.9, value_network=critic, **options)(data.clone())
    torch.testing.assert_close(looped["advantage"], plain["advantage"])
