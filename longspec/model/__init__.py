"""Models: the target adapter (static KV cache + the ``"longspec"`` attention implementation)."""
from __future__ import annotations

from .target import (
    ATTN_IMPLEMENTATION,
    SUPPORTED_MODEL_TYPES,
    AttentionStep,
    Phase,
    StaticKVCache,
    check_generation_length,
    check_supported,
    forward_extend,
    forward_tree,
    lm_logits,
    use_longspec_attention,
)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "SUPPORTED_MODEL_TYPES",
    "AttentionStep",
    "Phase",
    "StaticKVCache",
    "check_generation_length",
    "check_supported",
    "forward_extend",
    "forward_tree",
    "lm_logits",
    "use_longspec_attention",
]
