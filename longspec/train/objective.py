"""The training objective: one frozen target forward per batch, one draft forward, chunked LM loss.

The target runs under ``torch.no_grad`` with a registered attention function that is plain causal SDPA and, at the
last layer, hands back the post-RoPE keys and values the draft cross-attends to (no model file is forked, and no
mask is built: transformers skips mask creation for attention functions without a mask function, which matters
here because anchor-offset positions would otherwise be read as packed-sequence boundaries).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AttentionInterface

from .loss import IGNORE_INDEX, chunked_lm_loss

CAPTURE_IMPL = "longspec_train_capture"


def _capture_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal SDPA over the whole sequence; stores the last layer's post-RoPE k/v [B, Hkv, L, D] when asked."""
    store = kwargs.get("longspec_capture")
    if store is not None and module.layer_idx == store["layer"]:
        store["k"], store["v"] = key, value
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2), None


AttentionInterface.register(CAPTURE_IMPL, _capture_attention)


@dataclass
class TargetOutputs:
    k: Tensor  # [B, L, Hkv, D] last layer's keys, post-RoPE at the given positions
    v: Tensor  # [B, L, Hkv, D]
    hidden: Tensor  # [B, L, H] final (normed) hidden states, for the optional KL term


def prepare_target(target) -> None:
    """Freeze the target and route its attention through the capture function."""
    target.requires_grad_(False)
    target.eval()
    window = getattr(target.config, "sliding_window", None)
    if window is not None and getattr(target.config, "use_sliding_window", True) and getattr(target.config, "layer_types", None):
        if any(t == "sliding_attention" for t in target.config.layer_types):
            raise ValueError(f"{type(target).__name__} uses sliding-window attention layers, which draft training "
                             "does not reproduce; train against a full-attention configuration")
    target.set_attn_implementation(CAPTURE_IMPL)


@torch.no_grad()
def run_target(target, input_ids: Tensor, positions: Tensor) -> TargetOutputs:
    """input_ids int64 [B, L]; positions int64 [L] shared by the batch."""
    store = {"layer": target.config.num_hidden_layers - 1}
    pos = positions[None].expand(input_ids.shape[0], -1).to(input_ids.device)
    out = target.model(input_ids=input_ids, position_ids=pos, use_cache=False, longspec_capture=store)
    return TargetOutputs(k=store["k"].transpose(1, 2), v=store["v"].transpose(1, 2), hidden=out.last_hidden_state)


def next_token_labels(input_ids: Tensor) -> Tensor:
    """int64 [B, L]: position t predicts token t + 1; the last position is not counted."""
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, :-1] = input_ids[:, 1:]
    return labels


def step_loss(draft, target, input_ids: Tensor, positions: Tensor, delta: int, kl_weight: float = 0.0,
              chunk: int = 1024, ce_weight: float = 1.0) -> tuple[Tensor, int]:
    """Summed loss of one micro-batch and its token count (see :func:`chunked_lm_loss`)."""
    t = run_target(target, input_ids, positions)
    pos = positions[None].expand(input_ids.shape[0], -1).to(input_ids.device)
    hidden = draft(input_ids, t.k, t.v, position_ids=pos, delta=delta)  # [B, L, H]; DDP/FSDP hooks run here
    labels = next_token_labels(input_ids)
    H = hidden.shape[-1]
    weight = target.get_output_embeddings().weight
    return chunked_lm_loss(hidden.reshape(-1, H), weight, labels.reshape(-1), chunk=chunk,
                           target_hidden=t.hidden.reshape(-1, H) if kl_weight > 0 else None, kl_weight=kl_weight,
                           ce_weight=ce_weight)
