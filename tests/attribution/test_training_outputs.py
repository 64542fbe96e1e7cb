"""An LRP-wrapped model inside a training step: the outputs carry the plain model's gradient."""

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torch.distributions import Categorical
from torchrl.modules import MLP, ProbabilisticActor, QValueActor, ValueOperator
from torchrl.objectives import ClipPPOLoss, DQNLoss
from torchrl.objectives.value import GAE

from tdhook.attribution import LRP, EpsilonAlpha2Beta1, EpsilonGammaBox, EpsilonPlus, EpsilonPlusFlat


def _grads(params):
    return [None if p.grad is None else p.grad.clone() for p in params]


def _assert_same_grads(ours, plain):
    assert all(g is not None for g in plain)
    for a, b in zip(ours, plain, strict=True):
        assert a is not None, "no gradient reached the parameter"
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def _transitions(batch: int = 6) -> TensorDict:
    g = torch.Generator().manual_seed(1)
    return TensorDict(
        observation=torch.randn(batch, 4, generator=g, dtype=torch.float64),
        action=torch.randint(0, 2, (batch,), generator=g),
        action_log_prob=torch.full((batch,), -0.7, dtype=torch.float64),
        next=TensorDict(
            observation=torch.randn(batch, 4, generator=g, dtype=torch.float64),
            reward=torch.randn(batch, 1, generator=g, dtype=torch.float64),
            done=torch.zeros(batch, 1, dtype=torch.bool),
            terminated=torch.zeros(batch, 1, dtype=torch.bool),
        ),
        batch_size=[batch],
    )


@pytest.mark.parametrize("context_open", [False, True])
def test_a_ppo_loss_on_a_wrapped_actor_gives_the_plain_gradients(context_open):
    """ClipPPOLoss with GAE, its actor's logits module wrapped in LRP (the actor got no gradient at all)."""
    torch.manual_seed(0)
    net = MLP(in_features=4, out_features=2, num_cells=[8]).double()
    critic = ValueOperator(MLP(in_features=4, out_features=1, num_cells=[8]).double(), in_keys=["observation"])
    params = [*net.parameters(), *critic.parameters()]
    grads = {}
    for wrapped in (False, True):
        logits = TensorDictModule(net, ["observation"], ["logits"])
        lrp = LRP(logits, EpsilonPlus())
        actor = ProbabilisticActor(
            lrp if wrapped else logits, in_keys=["logits"], distribution_class=Categorical, return_log_prob=True
        )
        loss_module = ClipPPOLoss(actor, critic)
        td = _transitions()
        with torch.no_grad():
            GAE(gamma=0.99, lmbda=0.95, value_network=critic)(td)
        for p in params:
            p.grad = None
        with lrp if wrapped and context_open else torch.enable_grad():
            losses = loss_module(td)
            (losses["loss_objective"] + losses["loss_critic"] + losses["loss_entropy"]).backward()
        grads[wrapped] = _grads(params)
    _assert_same_grads(grads[True], grads[False])


def test_a_dqn_loss_on_a_wrapped_q_value_actor_gives_the_plain_gradients():
    torch.manual_seed(0)
    net = MLP(in_features=4, out_features=2, num_cells=[8]).double()
    grads = {}
    for wrapped in (False, True):
        actor = QValueActor(net, in_keys=["observation"], action_space="categorical")
        loss_module = DQNLoss(LRP(actor, EpsilonPlus()) if wrapped else actor, action_space="categorical")
        loss_module.make_value_estimator(gamma=0.9)
        net.zero_grad()
        loss_module(_transitions())["loss"].backward()
        grads[wrapped] = _grads(net.parameters())
    _assert_same_grads(grads[True], grads[False])


@pytest.mark.parametrize("preset", [EpsilonPlus, EpsilonPlusFlat, EpsilonAlpha2Beta1, lambda: EpsilonGammaBox(-3, 3)])
def test_an_optimisation_step_inside_an_open_context_is_the_plain_step(preset):
    """Gradients to the parameters and to an input that requires grad, with the context open; relevance stays
    detached and equals a call's without the training step."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    (net(x).square().sum()).backward()
    plain = _grads([*net.parameters(), x])
    net.zero_grad()
    x.grad = None
    lrp = LRP(TensorDictModule(net, ["x"], ["y"]), preset())
    with lrp:
        first = lrp(TensorDict(x=x.detach(), batch_size=[5]))["relevance", "x"]
        for _ in range(2):  # a second step: the context is still open and its rules still on
            td = lrp(TensorDict(x=x, batch_size=[5]))
            assert not td["relevance", "x"].requires_grad
            torch.testing.assert_close(td["relevance", "x"], first, rtol=0, atol=0)
            td["y"].square().sum().backward()
            _assert_same_grads(_grads([*net.parameters(), x]), plain)
            net.zero_grad()
            x.grad = None


def test_parameters_given_by_a_loss_module_get_the_gradient():
    """Views of stacked parameters put in with ``to_module`` (as torchrl's loss modules do) get theirs."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)).double()
    own = TensorDict.from_module(net)
    stacked = {k: torch.stack([v.detach()] * 2).requires_grad_() for k, v in own.items(True, True)}
    x = torch.randn(5, 4, dtype=torch.float64)
    lrp = LRP(TensorDictModule(net, ["x"], ["y"]), EpsilonPlus())
    grads = {}
    for wrapped in (False, True):
        views = TensorDict({k: v[1] * 2 for k, v in stacked.items()}).unflatten_keys(".")
        with views.to_module(net):
            y = lrp(TensorDict(x=x, batch_size=[5]))["y"] if wrapped else net(x)
        grads[wrapped] = torch.autograd.grad(y.square().sum(), list(stacked.values()))
    assert all(g.abs().sum() > 0 for g in grads[False])
    _assert_same_grads(grads[True], grads[False])


def test_outputs_under_no_grad_or_without_anything_that_requires_grad_stay_detached():
    net = nn.Sequential(nn.Linear(4, 3)).double()
    lrp = LRP(TensorDictModule(net, ["x"], ["y"]), EpsilonPlus())
    td = TensorDict(x=torch.randn(2, 4, dtype=torch.float64), batch_size=[2])
    with torch.no_grad():
        assert not lrp(td.clone())["y"].requires_grad
    net.requires_grad_(False)
    assert not lrp(td.clone())["y"].requires_grad


def test_a_random_module_is_refused_at_the_backward_pass_naming_the_output():
    """Dropout in training mode: the rerun for the gradient draws another mask; refused, not a wrong gradient."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 1)).double().train()
    lrp = LRP(TensorDictModule(net, ["x"], ["y"]), EpsilonPlus())
    with pytest.warns(UserWarning):
        td = lrp(TensorDict(x=torch.randn(8, 4, dtype=torch.float64), batch_size=[8]))
    with pytest.raises(RuntimeError, match="'y'.*other values"):
        td["y"].sum().backward()


@pytest.mark.parametrize("method", ["Saliency", "IntegratedGradients", "Occlusion", "GuidedBackprop"])
def test_the_other_methods_in_a_ppo_loss_give_the_plain_gradients(method):
    from tdhook.attribution import methods

    options = {"IntegratedGradients": {"baselines": 0.0, "n_steps": 4}, "Occlusion": {"sliding_window_shapes": (1,)}}
    torch.manual_seed(0)
    net = MLP(in_features=4, out_features=2, num_cells=[8]).double()
    critic = ValueOperator(MLP(in_features=4, out_features=1, num_cells=[8]).double(), in_keys=["observation"])
    grads = {}
    for wrapped in (False, True):
        logits = TensorDictModule(net, ["observation"], ["logits"])
        if wrapped:
            logits = getattr(methods, method)(logits, **options.get(method, {}))
        actor = ProbabilisticActor(logits, in_keys=["logits"], distribution_class=Categorical, return_log_prob=True)
        td = _transitions()
        with torch.no_grad():
            GAE(gamma=0.99, lmbda=0.95, value_network=critic)(td)
        net.zero_grad()
        ClipPPOLoss(actor, critic)(td)["loss_objective"].backward()
        grads[wrapped] = _grads(net.parameters())
    _assert_same_grads(grads[True], grads[False])


def test_the_backward_pass_leaves_running_statistics_as_the_call_left_them():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2)).double().train()
    twin = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2)).double().train()
    twin.load_state_dict(net.state_dict())
    x = torch.randn(6, 4, dtype=torch.float64)
    twin(x).square().sum().backward()
    td = LRP(TensorDictModule(net, ["x"], ["y"]), EpsilonPlus())(TensorDict(x=x, batch_size=[6]))
    td["y"].square().sum().backward()
    for (name, ours), theirs in zip(net.state_dict().items(), twin.state_dict().values(), strict=True):
        assert torch.equal(ours, theirs), name
    _assert_same_grads(_grads(net.parameters()), _grads(twin.parameters()))
