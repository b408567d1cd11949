"""longspec: long-context lossless speculative decoding on the ``longspec_ops`` kernels."""
from __future__ import annotations

import longspec_ops  # noqa: F401  (registers torch.ops.longspec)

from .decode import PromptLookupDrafter, SpeculativeDecoder, StreamingSelfDrafter
from .decode.longspec_drafter import LongSpecDrafter
from .model.draft import LongSpecDraft, LongSpecDraftConfig

__version__ = "0.1.0"

__all__ = [
    "LongSpecDraft",
    "LongSpecDraftConfig",
    "LongSpecDrafter",
    "PromptLookupDrafter",
    "SpeculativeDecoder",
    "StreamingSelfDrafter",
]
