"""Chunked LM-head + cross-entropy (+ optional KL to the target) that never materialises [tokens x vocab] logits.

Tokens are processed in chunks; each chunk's logits exist only inside a checkpointed function, so the forward pass
keeps no logits and the backward pass recomputes one chunk at a time. Peak extra memory is one chunk's
``chunk x vocab`` float32 logits (1024 x 152k x 4 B = 0.6 GB) instead of all of them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


def _chunk_loss(hidden: Tensor, weight: Tensor, labels: Tensor, target_hidden: Tensor | None,
                target_weight: Tensor | None, kl_weight: float, ce_weight: float) -> Tensor:
    logits = (hidden @ weight.t()).float()
    loss = logits.new_zeros(())
    if ce_weight > 0:
        loss = ce_weight * F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    if target_hidden is not None and kl_weight > 0:
        with torch.no_grad():
            t_logp = torch.log_softmax((target_hidden @ target_weight.t()).float(), dim=-1)
        logq = torch.log_softmax(logits, dim=-1)
        keep = (labels != IGNORE_INDEX).float()
        kl = token_kl(t_logp, logq)
        loss = loss + kl_weight * (kl * keep).sum()
    return loss


def token_kl(t_logp: Tensor, logq: Tensor) -> Tensor:
    """KL(p_target || q_draft) per row, from float32 log-probabilities [..., V] -> [...]."""
    return (t_logp.exp() * (t_logp - logq)).sum(-1)


def check_loss_weights(ce_weight: float, kl_weight: float) -> None:
    """The loss's two weights: each >= 0, not both 0 (a ValueError naming both)."""
    if ce_weight < 0 or kl_weight < 0 or ce_weight + kl_weight == 0:
        raise ValueError(f"ce_weight ({ce_weight}) and kl_weight ({kl_weight}) must be >= 0 and not both 0")


def chunked_lm_loss(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    chunk: int = 1024,
    target_hidden: Tensor | None = None,
    kl_weight: float = 0.0,
    ce_weight: float = 1.0,
) -> tuple[Tensor, int]:
    """Summed next-token loss over tokens and the number of counted tokens.

    hidden: [T, H] draft outputs (no final norm: LongSpec feeds them to the LM head directly).
    weight: [V, H] the (frozen, shared) LM head. labels: int64 [T], IGNORE_INDEX where not counted.
    target_hidden: [T, H] the target's final (normed) hidden states, for the optional KL(p_target || q_draft) term.
    ce_weight: the CE term's weight (0 with kl_weight > 0: pure distillation, the draft matches the target's
    distribution and spends none of its capacity on the data's tokens where the target disagrees with them).
    Returns (sum of ce_weight * CE + kl_weight * KL over counted tokens, count); divide by the count across
    ranks/accumulation.
    """
    if hidden.shape[0] != labels.shape[0]:
        raise ValueError(f"hidden has {hidden.shape[0]} tokens but labels has {labels.shape[0]}")
    if kl_weight > 0 and target_hidden is None:
        raise ValueError("kl_weight > 0 needs target_hidden")
    check_loss_weights(ce_weight, kl_weight)
    total = hidden.new_zeros((), dtype=torch.float32)
    for s in range(0, hidden.shape[0], chunk):
        e = s + chunk
        th = target_hidden[s:e] if target_hidden is not None else None
        total = total + checkpoint(_chunk_loss, hidden[s:e], weight, labels[s:e], th, weight, kl_weight,
                                   ce_weight, use_reentrant=False)
    return total, int((labels != IGNORE_INDEX).sum())
