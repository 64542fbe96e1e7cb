"""A method's once-per-wrapper warning that the caller's filter turns into an error is given again at the next call.

The methods counted the warning as given before giving it: under ``warnings.simplefilter("error")`` (pytest's
``-W error``) the call raised, and no later call warned that dropout called as a function makes the attribution
random from call to call.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import InputXGradient, IntegratedGradients, Saliency


class FunctionalDropout(nn.Module):
    """Dropout called as a function in training mode, outside any Dropout module."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(nn.functional.dropout(torch.relu(self.a(x)), p=0.3, training=self.training))


@pytest.mark.parametrize("method", [Saliency, InputXGradient, lambda m, **kw: IntegratedGradients(m, n_steps=4, **kw)])
def test_a_warning_made_an_error_is_given_again_at_the_next_call(method):
    torch.manual_seed(0)
    net = FunctionalDropout().double()
    state = {key: value.clone() for key, value in net.state_dict().items()}
    explainer = method(TensorDictModule(net, in_keys=["x"], out_keys=["y"]), target=0)
    td = TensorDict(x=torch.randn(3, 4, dtype=torch.float64), batch_size=[3])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="calls dropout"):
            explainer(td)
    assert list(td.keys()) == ["x"]
    assert all(torch.equal(value, net.state_dict()[key]) for key, value in state.items())
    with pytest.warns(UserWarning, match=r"the forward pass calls dropout \(p=0.3\) in training mode"):
        explainer(td)
