"""A QValueActor's chosen action value: scored at the action chosen on the unperturbed input, refused as a method's
target where the metric explains other inputs."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torchrl.modules import QValueActor

from tdhook.attribution import LRP, BaseRuleMapper, Saliency
from tdhook.metrics import pixel_flipping, randomisation_check, sensitivity_max


def q_actor() -> QValueActor:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).double()
    return QValueActor(net, in_keys=["observation"], spec=None, action_space="one_hot")


def test_the_chosen_value_is_scored_at_the_action_chosen_unperturbed():
    """The curve followed the greedy action of each perturbed input (0.15 off the explained action's value)."""
    actor = q_actor()
    td = TensorDict(observation=torch.randn(10, 6, dtype=torch.float64), batch_size=[10])
    out = LRP(actor, in_keys=["observation"])(td.clone())
    curve = pixel_flipping(actor, out, relevance_key="relevance")
    net = actor.module[0].module
    x, relevance = td["observation"], out["relevance", "observation"]
    chosen = net(x).argmax(-1, keepdim=True)
    order = relevance.argsort(dim=-1, descending=True, stable=True)
    columns, greedy = [], []
    for k in range(7):
        values = net(x.scatter(-1, order[:, :k], 0.0)).detach()
        columns.append(values.gather(-1, chosen)[:, 0])
        greedy.append(values.amax(-1))
    torch.testing.assert_close(curve, torch.stack(columns, -1), rtol=0, atol=1e-12)
    assert (torch.stack(greedy, -1) - curve).abs().max() > 1e-3  # the case tells the two apart


@pytest.mark.parametrize("metric", [sensitivity_max, randomisation_check])
@pytest.mark.parametrize("method", [LRP, Saliency])
def test_a_method_explaining_the_chosen_value_is_refused_by_the_metrics_that_explain_other_inputs(metric, method):
    actor = q_actor()
    td = TensorDict(observation=torch.randn(4, 6, dtype=torch.float64), batch_size=[4])
    with pytest.raises(ValueError, match=r"explains 'chosen_action_value', the value of the greedy action"):
        metric(method(actor, in_keys=["observation"]), td)
    held = method(actor, in_keys=["observation"], target_key="action_value")
    default = method(actor, in_keys=["observation"])(td.clone())
    prefix = "relevance" if method is LRP else "attribution"
    same = held(td.clone())[prefix, "observation"]
    torch.testing.assert_close(same, default[prefix, "observation"], rtol=0, atol=1e-12)  # the same explanation
    metric(held, td)


def test_a_masked_q_value_actor_chooses_and_is_scored_among_the_allowed_actions():
    """The QValueModule writes forbidden actions' values as the lowest float: their argmax is the allowed action."""
    from tdhook.metrics import action_fidelity

    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).double()
    actor = QValueActor(net, in_keys=["observation"], spec=None, action_space="one_hot", action_mask_key="action_mask")
    x = torch.randn(40, 6, dtype=torch.float64)
    values = net(x).detach()
    mask = torch.ones(40, 3, dtype=torch.bool)
    mask[torch.arange(40), values.argmax(-1)] = False  # the plain argmax is forbidden everywhere
    td = TensorDict(observation=x, action_mask=mask, batch_size=[40])
    out = LRP(actor, in_keys=["observation"])(td.clone())
    chosen = values.masked_fill(~mask, float("-inf")).argmax(-1)
    curve = pixel_flipping(actor, out, relevance_key="relevance")
    torch.testing.assert_close(curve[:, 0], values.gather(-1, chosen[:, None])[:, 0], rtol=0, atol=1e-12)
    top = out["relevance", "observation"].argsort(dim=-1, descending=True, stable=True)[:, :2]
    after = net(x.scatter(-1, top, 0.0)).detach().masked_fill(~mask, float("-inf")).argmax(-1)
    expected = (after != chosen).double().mean()
    for target_key in (None, "action_value"):
        result = action_fidelity(actor, out, k=2, relevance_key="relevance", seed=0, target_key=target_key)
        torch.testing.assert_close(result["relevant"], expected, rtol=0, atol=0)


def several_one_hot_actor() -> tuple[torch.nn.Module, torch.nn.Linear]:
    """A Q-value policy whose action is one unit of each of two groups of action values (sizes 2 and 3)."""
    from tensordict.nn import TensorDictModule, TensorDictSequential
    from torchrl.modules import QValueModule

    torch.manual_seed(0)
    net = torch.nn.Linear(4, 5, bias=False).double()
    values = TensorDictModule(net, in_keys=["observation"], out_keys=["action_value"])
    return TensorDictSequential(values, QValueModule(action_space="mult_one_hot", var_nums=[2, 3])), net


class TestSeveralOneHotActions:
    """With ``action_space="mult_one_hot"`` the action is one unit of each group, and its value their sum: the argmax
    of the action values' row names one unit, not the action. Before, ``target_key="action_value"`` explained that
    unit (0.57 off the action's value, relative L2, on a linear net), and the methods that evaluate perturbed inputs
    explained the argmax unit of the unperturbed row at the default key (0.57 off too)."""

    def batch(self) -> TensorDict:
        return TensorDict(observation=torch.randn(3, 4, dtype=torch.float64), batch_size=[3])

    def test_lrp_at_the_default_key_explains_the_value_of_every_chosen_unit(self):
        actor, net = several_one_hot_actor()
        td = self.batch()
        out = actor(td.clone())
        assert (out["action"].sum(-1) == 2).all()  # one unit of each group
        oracle = td["observation"] * (out["action"].double() @ net.weight)  # a linear net: x * gradient of the value
        relevance = LRP(actor, BaseRuleMapper(stabilizer=0.0))(td.clone())["relevance", "observation"]
        torch.testing.assert_close(relevance, oracle, rtol=1e-10, atol=1e-12)

    def test_the_action_values_without_a_target_are_refused_by_name(self):
        actor, _ = several_one_hot_actor()
        td = self.batch()
        for method in (LRP(actor, target_key="action_value"), Saliency(actor, target_key="action_value")):
            with pytest.raises(ValueError, match=r"'action_value' holds .*'mult_one_hot'.*Pass a target"):
                method(td)
            assert set(td.keys()) == {"observation"}
        explained = LRP(actor, target_key="action_value", target=torch.tensor([0, 2, 4]))(td.clone())
        assert explained["relevance", "observation"].shape == (3, 4)

    @pytest.mark.parametrize("method", ["IntegratedGradients", "FeatureAblation", "Occlusion"])
    def test_methods_evaluating_perturbed_inputs_refuse_the_chosen_value_by_name(self, method):
        import tdhook.attribution as attribution

        actor, _ = several_one_hot_actor()
        td = self.batch()
        options = {"sliding_window_shapes": (1,)} if method == "Occlusion" else {}
        with pytest.raises(ValueError, match=rf"{method}: 'chosen_action_value' is the value .*'mult_one_hot'"):
            getattr(attribution, method)(actor, **options)(td)
        assert set(td.keys()) == {"observation"}

    def test_the_metrics_refuse_the_chosen_value_by_name(self):
        actor, _ = several_one_hot_actor()
        td = self.batch()
        out = Saliency(actor)(td.clone())  # the gradient at the input: the chosen units' value, as LRP's
        with pytest.raises(ValueError, match=r"metrics: 'chosen_action_value' is the value .*'mult_one_hot'"):
            pixel_flipping(actor, out)
