"""Attribution methods as TensorDict modules: the LRP wrapper, its rules and presets, and offline runs.

Every name of :mod:`tdhook.attribution.rules`, :mod:`tdhook.attribution.mappers`
and :mod:`tdhook.attribution.methods` (Saliency, IntegratedGradients, ...) is
importable from here, and so is :func:`~tdhook.attribution.tuning.tune`.

Examples:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from tensordict.nn import TensorDictModule
    >>> from tdhook.attribution import LRP, EpsilonPlus
    >>> policy = TensorDictModule(torch.nn.Linear(3, 2), in_keys=["observation"], out_keys=["action_value"])
    >>> td = LRP(policy, rule_mapper=EpsilonPlus())(TensorDict(observation=torch.randn(4, 3), batch_size=[4]))
    >>> td["relevance", "observation"].shape
    torch.Size([4, 3])
"""

from tdhook.attribution.lrp import LRP
from tdhook.attribution.mappers import *  # noqa: F403
from tdhook.attribution.mappers import __all__ as _mapper_names
from tdhook.attribution.methods import *  # noqa: F403
from tdhook.attribution.methods import __all__ as _method_names
from tdhook.attribution.offline import explain_offline
from tdhook.attribution.rules import *  # noqa: F403
from tdhook.attribution.rules import __all__ as _rule_names
from tdhook.attribution.shares import relevance_shares
from tdhook.attribution.tuning import TuneResult, tune

__all__ = [
    "LRP",
    "explain_offline",
    "relevance_shares",
    "tune",
    "TuneResult",
    *_method_names,
    *_rule_names,
    *_mapper_names,
]
