"""Decoding: the speculative decoder, the drafter protocol, drafters, trees, verification and sampling."""
from __future__ import annotations

from .decoder import GenerateOutput, KVUpdate, SpeculativeDecoder
from .drafter import DecodeState, Drafter, DraftTree, TreeSpec
from .pld import PromptLookupDrafter
from .sampling import SamplingParams
from .stats import DecodeStats
from .streaming import StreamingSelfDrafter

__all__ = [
    "DecodeState",
    "DecodeStats",
    "DraftTree",
    "Drafter",
    "GenerateOutput",
    "KVUpdate",
    "PromptLookupDrafter",
    "SamplingParams",
    "SpeculativeDecoder",
    "StreamingSelfDrafter",
    "TreeSpec",
]
