"""A plain module's TensorDict wrapper, built from the attributes of the first one made for the same keys."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

from tdhook.attribution._plain_modules import as_tensordict_module


@pytest.mark.parametrize(
    ("in_keys", "out_keys"),
    [(["x"], ["y"]), ("x", "y"), (("a", "x"), [("b", "y"), "z"]), (["x", ("a", "b")], ["y", "_"])],
)
def test_a_second_wrapper_for_the_same_keys_equals_a_constructed_one(in_keys, out_keys):
    """The second wrapper does not run the constructor; it has the same attributes as one that does, and keys of its
    own (changing them changes no other wrapper's)."""
    first_module, second_module = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    first, plain = as_tensordict_module(first_module, in_keys, out_keys)
    with mock.patch.object(TensorDictModule, "__init__", side_effect=AssertionError("constructed")):
        second, _ = as_tensordict_module(second_module, in_keys, out_keys)
    expected = TensorDictModule(second_module, in_keys=in_keys, out_keys=out_keys)
    assert plain and type(second) is TensorDictModule
    assert second.__dict__.keys() == expected.__dict__.keys()
    for name, value in expected.__dict__.items():
        if name != "_modules":
            assert second.__dict__[name] == value, name
    assert dict(second.named_children()) == {"module": second_module}
    assert second._out_keys is second._out_keys_apparent  # one list under two names, as the constructor leaves it
    second.in_keys.append("w")
    second.out_keys = ["v"]
    third, _ = as_tensordict_module(second_module, in_keys, out_keys)
    assert first.in_keys == expected.in_keys == third.in_keys and first.out_keys == expected.out_keys == third.out_keys


def test_a_second_wrapper_runs_its_own_module():
    first, second = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    as_tensordict_module(first, ["obs"], ["action"])
    wrapper, _ = as_tensordict_module(second, ["obs"], ["action"])
    x = torch.randn(4, 3)
    torch.testing.assert_close(wrapper(TensorDict(obs=x, batch_size=[4]))["action"], second(x))


def test_keys_that_do_not_hash_are_wrapped_by_the_constructor():
    module = torch.nn.Linear(3, 2)
    wrapper, _ = as_tensordict_module(module, {"input": "x"}, ["y"])
    assert wrapper.in_keys == ["x"]
    out = wrapper(TensorDict(x=torch.ones(2, 3), batch_size=[2]))["y"]
    torch.testing.assert_close(out, module(torch.ones(2, 3)))
