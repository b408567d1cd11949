"""longspec: long-context lossless speculative decoding on the ``longspec_ops`` kernels."""
from __future__ import annotations

import longspec_ops  # noqa: F401  (registers torch.ops.longspec)

__version__ = "0.1.0"
