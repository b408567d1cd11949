"""A transformers decoder's attention geometry: KV heads, head dim, the attention modules (what the target's cache
and the tensor-parallel head split both read)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel


def num_kv_heads(config: "PretrainedConfig") -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def head_dim(config: "PretrainedConfig") -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def attention_modules(model: "PreTrainedModel") -> list[torch.nn.Module]:
    """The self-attention module of every decoder layer, in layer order (``module.layer_idx == i``)."""
    return [layer.self_attn for layer in model.base_model.layers]


__all__ = ["attention_modules", "head_dim", "num_kv_heads"]
