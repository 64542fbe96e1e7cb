"""Attribution methods as TensorDict modules."""

from tdhook.attribution.lrp import LRP
from tdhook.attribution.offline import explain_offline

__all__ = ["LRP", "explain_offline"]
