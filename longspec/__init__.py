"""longspec: long-context lossless speculative decoding on the ``longspec_ops`` kernels.

The public names below load on first use (PEP 562), so that ``import longspec`` (and ``longspec --help``) does not
import torch and transformers; the first of them imported registers ``torch.ops.longspec``.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "AdaptiveBudget": "longspec.decode",
    "LongSpecDraft": "longspec.model.draft",
    "LongSpecDraftConfig": "longspec.model.draft",
    "LongSpecDrafter": "longspec.decode.longspec_drafter",
    "MergedDrafter": "longspec.decode",
    "Numerics": "longspec.decode",
    "PromptLookupDrafter": "longspec.decode",
    "SpeculativeDecoder": "longspec.decode",
    "StreamingSelfDrafter": "longspec.decode",
    "TreeSpec": "longspec.decode",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .decode import (AdaptiveBudget, MergedDrafter, Numerics, PromptLookupDrafter, SpeculativeDecoder,
                         StreamingSelfDrafter, TreeSpec)
    from .decode.longspec_drafter import LongSpecDrafter
    from .model.draft import LongSpecDraft, LongSpecDraftConfig


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'longspec' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
