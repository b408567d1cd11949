"""The draft's submodules: the attention projections of the published block, and the optional extra cross-attention
blocks (``LongSpecDraftConfig.extra_cross_blocks``)."""
from __future__ import annotations

from torch import Tensor, nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, rotate_half

from longspec.model.draft_config import LongSpecDraftConfig


class LongSpecAttention(nn.Module):
    """The projections of one attention sublayer (``GlideAttention``): q/k/v with bias, o_proj without.

    Only projections live here; the attention itself runs on the ``longspec_ops`` kernels in the caller, which
    knows where keys come from (the draft's ring, the tree scratch, or the target's cache).
    """

    def __init__(self, config: LongSpecDraftConfig) -> None:
        super().__init__()
        hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = hq, hkv, d
        self.q_proj = nn.Linear(config.hidden_size, hq * d, bias=True)
        self.k_proj = nn.Linear(config.hidden_size, hkv * d, bias=True)
        self.v_proj = nn.Linear(config.hidden_size, hkv * d, bias=True)
        self.o_proj = nn.Linear(hq * d, config.hidden_size, bias=False)


class CrossQueryAttention(nn.Module):
    """A cross-attention into the target's cache that owns only its query and output projections (q with bias,
    o without, as the published block's): its keys and values are the target's cache rows."""

    def __init__(self, config: LongSpecDraftConfig) -> None:
        super().__init__()
        hq, d = config.num_attention_heads, config.head_dim
        self.num_heads, self.head_dim = hq, d
        self.q_proj = nn.Linear(config.hidden_size, hq * d, bias=True)
        self.o_proj = nn.Linear(hq * d, config.hidden_size, bias=False)


class CrossBlock(nn.Module):
    """One extra block after the published one, without self-attention (so it adds nothing to the drafter's
    window caches: its input is the previous block's output at the same token)::

        h2  = h + CA(cross_norm(h))      the same cross-attention as the block's: the target's last-layer rows
        out = h2 + MLP(mlp_norm(h2))

    Not part of the LongSpec method, whose draft is the single block: a second look into the target's context with
    a query that already holds the first one's answer, for drafts whose loss a wider MLP did not lower. Each one
    costs a draft level one more cross-attention pass over the target's last-layer cache and one more MLP.
    """

    def __init__(self, config: LongSpecDraftConfig) -> None:
        super().__init__()
        self.cross_norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.cross_attn = CrossQueryAttention(config)
        self.mlp_norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x ``[B, S, H, D]`` (flash layout) rotated by cos/sin ``[B, S, D]``, broadcast over heads (transformers'
    ``rotate_half`` convention, as the Llama/Qwen2 targets rotate)."""
    return x * cos[:, :, None, :] + rotate_half(x) * sin[:, :, None, :]
