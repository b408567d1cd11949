"""Pure-PyTorch references: the CPU kernels and the test oracles of every ``longspec`` op."""
from . import attention

__all__ = ["attention"]
