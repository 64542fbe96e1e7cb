"""A module call's tensors in the order of its forward's parameters (tdhook.attribution.rules._module_inputs).

The hooks put a call's keyword tensors after its positional ones in the order the call named them:
``lstm(hx=state, input=x)`` and ``renorm(mask=m, x=h)`` were read with their second parameter as the input.
"""

from __future__ import annotations

import torch
from torch import nn

from tdhook.attribution.rules._module_inputs import inputs_in_forward


class _Masked(nn.Module):
    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, **extra) -> torch.Tensor:
        return x if mask is None else x * mask


def test_keyword_tensors_follow_the_forward_parameters_order():
    x, mask = torch.ones(2), torch.zeros(2)
    inputs = inputs_in_forward(_Masked(), (), {"mask": mask, "x": x})
    assert [t is x for t in inputs] == [True, False] and inputs[1] is mask


def test_positional_arguments_come_first_and_names_the_forward_lacks_last():
    x, mask, other, late = torch.ones(2), torch.zeros(2), torch.full((2,), 2.0), torch.full((2,), 3.0)
    inputs = inputs_in_forward(_Masked(), (x,), {"late": late, "mask": mask, "other": other})
    assert [id(t) for t in inputs] == [id(x), id(mask), id(late), id(other)]  # unknown names: the call's order


def test_values_that_are_no_tensor_are_left_out():
    x = torch.ones(1, 2)
    state = (torch.zeros(1, 3), torch.zeros(1, 3))
    inputs = inputs_in_forward(nn.LSTM(2, 3), (), {"hx": state, "input": x})
    assert len(inputs) == 1 and inputs[0] is x
    assert inputs_in_forward(nn.ReLU(), (x,), {"inplace": True}) == (x,)


def test_a_forward_replaced_on_the_instance_gives_the_order():
    module, x, mask = nn.Identity(), torch.ones(2), torch.zeros(2)
    module.forward = lambda x, mask=None: x  # Identity's own forward takes ``input`` alone
    inputs = inputs_in_forward(module, (), {"mask": mask, "x": x})
    assert inputs[0] is x and inputs[1] is mask


def test_a_forward_replaced_on_the_instance_is_not_kept():
    """A dispatch hook's ``functools.partial(new_forward, module)`` holds the module: read, not cached with it."""
    import functools
    import gc
    import weakref

    def new_forward(module: nn.Module, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return x

    module, x, mask = nn.Identity(), torch.ones(2), torch.zeros(2)
    module.forward = functools.partial(new_forward, module)
    assert inputs_in_forward(module, (), {"mask": mask, "x": x})[0] is x
    ref = weakref.ref(module)
    del module
    gc.collect()
    assert ref() is None
