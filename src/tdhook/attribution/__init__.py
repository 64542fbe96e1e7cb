"""Attribution methods as TensorDict modules."""

from tdhook.attribution.lrp import LRP

__all__ = ["LRP"]
