"""Evaluation metrics for attributions, batched over TensorDicts.

Every metric reads the inputs at ``in_keys`` and an attribution method's output at ``(relevance_key, *key)``
(``"attribution"`` by default; ``"relevance"`` for :class:`~tdhook.attribution.LRP`), and leaves the caller's
TensorDict, model and global random state as they were. See ``docs/metrics.md``.
"""

from tdhook.metrics.action_fidelity import action_fidelity
from tdhook.metrics.aopc import aopc
from tdhook.metrics.faithfulness_correlation import faithfulness_correlation
from tdhook.metrics.infidelity import infidelity
from tdhook.metrics.pixel_flipping import pixel_flipping
from tdhook.metrics.randomisation_check import randomisation_check
from tdhook.metrics.region_perturbation import region_perturbation
from tdhook.metrics.sensitivity_max import sensitivity_max

__all__ = [
    "action_fidelity",
    "aopc",
    "faithfulness_correlation",
    "infidelity",
    "pixel_flipping",
    "randomisation_check",
    "region_perturbation",
    "sensitivity_max",
]
