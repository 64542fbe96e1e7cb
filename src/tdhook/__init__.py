"""tdhook: layer-wise relevance propagation native to tensordict and torchrl."""

__version__ = "0.1.0"

__all__ = ["__version__"]
