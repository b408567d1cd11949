"""Decoding: the speculative decoder, the drafter protocol, drafters, trees, verification and sampling."""
from __future__ import annotations

from .budget import AdaptiveBudget, BudgetOption, CostModel
from .decoder import GenerateOutput, KVUpdate, Numerics, SpeculativeDecoder
from .drafter import DecodeState, Drafter, DraftTree, TreeSpec
from .merge import MergedDrafter
from .pld import PromptLookupDrafter
from .sampling import SamplingParams
from .stats import DecodeStats
from .streaming import StreamingSelfDrafter

__all__ = [
    "AdaptiveBudget",
    "BudgetOption",
    "CostModel",
    "DecodeState",
    "DecodeStats",
    "DraftTree",
    "Drafter",
    "GenerateOutput",
    "KVUpdate",
    "MergedDrafter",
    "Numerics",
    "PromptLookupDrafter",
    "SamplingParams",
    "SpeculativeDecoder",
    "StreamingSelfDrafter",
    "TreeSpec",
]
