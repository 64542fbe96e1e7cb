"""The metrics' own generator: the seeds it takes, and those it refuses by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tdhook.metrics._random import generator


def test_a_numpy_integer_seed_draws_as_the_same_int():
    """A NumPy integer (a seed drawn by ``np.random``, an entry of a NumPy array of seeds) was refused as no int."""
    draws = torch.rand(4, generator=generator(np.int64(7)))
    torch.testing.assert_close(draws, torch.rand(4, generator=generator(7)), rtol=0, atol=0)


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_a_seed_torch_does_not_take_is_refused_by_name(seed):
    """A seed out of torch's range failed with its "Overflow when unpacking long", which names no seed."""
    with pytest.raises(ValueError, match=r"metrics: seed must be an int in \[-2\*\*63, 2\*\*64\)"):
        generator(seed)


@pytest.mark.parametrize("seed", [1.5, True, "0"])
def test_a_seed_that_is_no_int_is_refused(seed):
    with pytest.raises(TypeError, match="metrics: seed must be an int or None"):
        generator(seed)
