"""Attribution methods as TensorDict modules."""

from tdhook.attribution.lrp import LRP
from tdhook.attribution.offline import explain_offline
from tdhook.attribution.shares import relevance_shares

__all__ = ["LRP", "explain_offline", "relevance_shares"]
