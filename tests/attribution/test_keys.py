"""The keys a wrapper writes: each relevance at a key of its own, refused by name where it is not."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule, TensorDictSequential, WrapModule
from torch import nn

from tdhook.attribution import LRP


def policy() -> TensorDictModule:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    return TensorDictModule(net, in_keys=["x"], out_keys=["y"])


@pytest.mark.parametrize(
    ("layers", "match"),
    [
        # Two layers at one key: the second's relevance was written over the first's, with no word.
        ({"module.0": "h", "module.2": "h"}, r"module 'module.2' at \('h',\), the key \('h',\) that module 'module.0'"),
        # A layer inside an input's relevance: tensordict's own KeyError after the backward pass.
        ({"module.0": ("x", "a")}, r"module 'module.0' at \('x', 'a'\), inside or around the key \('x',\) that input"),
        ({"module.0": "x"}, r"module 'module.0' at \('x',\), the key \('x',\) that input 'x' takes"),
        ({"module.0": ("h", "a"), "module.2": "h"}, r"module 'module.2' at \('h',\), inside or around the key"),
    ],
    ids=["same-key", "inside-an-input", "an-inputs-key", "around-a-layer"],
)
def test_a_layer_key_that_another_relevance_takes_is_refused_naming_both(layers, match):
    with pytest.raises(ValueError, match=match):
        LRP(policy(), layers=layers)


def test_layers_at_keys_of_their_own_are_written_each():
    td = TensorDict(x=torch.randn(2, 4, dtype=torch.float64), batch_size=[2])
    out = LRP(policy(), layers={"module.0": ("h", "first"), "module.2": ("h", "second")})(td)
    assert out["relevance", "h", "first"].shape == out["relevance", "h", "second"].shape == (2, 8)
    assert not torch.equal(out["relevance", "h", "first"], out["relevance", "h", "second"])


def test_a_token_relevance_key_inside_the_models_key_names_token_relevance_key():
    """The refusal named ``relevance_key``, which was not the argument to change."""
    with pytest.raises(
        ValueError, match=r"would be written inside the model's key 'y'; pass another token_relevance_key$"
    ):
        LRP(policy(), token_relevance_key="y")
    with pytest.raises(ValueError, match=r"would be written inside the model's key 'y'; pass another relevance_key$"):
        LRP(policy(), relevance_key="y")


@pytest.mark.parametrize("method", ["LRP", "Saliency", "FeatureAblation"])
def test_a_step_that_declares_no_in_keys_is_named_with_what_to_declare(method):
    """tensordict's ``WrapModule(fn)`` declares no keys: a sequence starting with one reads, as far as its keys say,
    only what its later steps read, and the key the function reads was refused as no input of the module, with the
    advice to leave it out. The message names the step and how to declare its keys; declared, the key is explained
    as with a ``TensorDictModule`` step."""
    import tdhook.attribution as attribution

    torch.manual_seed(0)
    body, head = nn.Sequential(nn.Linear(4, 8), nn.ReLU()).double(), nn.Linear(8, 3).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    make = getattr(attribution, method)
    undeclared = TensorDictSequential(
        WrapModule(lambda td: td.set("h", body(td["obs"]))), TensorDictModule(head, ["h"], ["q"])
    )
    expected = (
        r"'obs' is not an input of the module.*'module\.0' \(WrapModule\) declares no in_keys.*in_keys=\[\.\.\.\]"
    )
    with pytest.raises(ValueError, match=expected):
        make(undeclared, in_keys=["obs"], target_key="q", target=1)
    declared = TensorDictSequential(
        WrapModule(lambda td: td.set("h", body(td["obs"])), in_keys=["obs"], out_keys=["h"]),
        TensorDictModule(head, ["h"], ["q"]),
    )
    plain = TensorDictSequential(TensorDictModule(body, ["obs"], ["h"]), TensorDictModule(head, ["h"], ["q"]))
    key = ("relevance" if method == "LRP" else "attribution", "obs")
    out = make(declared, target=1)(TensorDict(obs=x.clone(), batch_size=[5]))
    torch.testing.assert_close(out.get(key), make(plain, target=1)(TensorDict(obs=x, batch_size=[5])).get(key))


def test_a_wrap_module_given_alone_is_named_as_the_module_itself():
    """A ``WrapModule(fn)`` given as the module itself got only the advice to leave the key out, which leaves
    nothing to explain; it is named too."""
    with pytest.raises(ValueError, match=r"the module itself \(WrapModule\) declares no in_keys"):
        LRP(WrapModule(lambda td: td.set("q", td["obs"] * 2)), in_keys=["obs"], target_key="q")
