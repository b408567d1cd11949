"""Pure-PyTorch references: the CPU kernels and the test oracles of every ``longspec`` op."""
from . import attention, invariant, linear, lookup, stats

__all__ = ["attention", "invariant", "linear", "lookup", "stats"]
